//! A process of the heap tests: attaches to the pool named by its
//! argument and answers commands on stdin, one line each (`ok ...` or
//! `err ...`). The heap's root is a `HeapMap<u64, HeapVec<u64>>`.
#![allow(clippy::unwrap_used)]

use dm_heap::{Heap, HeapMap, HeapRef, HeapVec};
use dm_pool::{Pool, Ref};
use std::io::{BufRead, Write};

type Root<'h> = HeapMap<'h, u64, HeapVec<'h, u64>>;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

fn main() {
    let path = std::env::args().nth(1).expect("a pool path");
    let pool = Pool::open(std::path::Path::new(&path), Default::default()).unwrap();
    let mut heap: Option<Heap> = None;
    println!("ok slot {}", pool.slot());
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let w: Vec<&str> = line.split_whitespace().collect();
        let r: Result<String, String> = (|| {
            match w.as_slice() {
                ["open", hex] => {
                    let r = HeapRef::from_bytes(&unhex(hex)).map_err(|e| e.to_string())?;
                    heap = Some(Heap::open(&pool, &r).map_err(|e| e.to_string())?);
                    Ok(String::new())
                }
                ["reserve", addr, len] => {
                    // Takes a range, as another library of the process might.
                    let r =
                        dm_sys::mem::Reservation::at(addr.parse().unwrap(), len.parse().unwrap())
                            .map_err(|e| e.to_string())?;
                    std::mem::forget(r);
                    Ok(String::new())
                }
                ["sum"] => {
                    let h = heap.as_ref().ok_or("no heap")?;
                    // SAFETY: the tests' root is a Root.
                    let m: &Root = unsafe { h.root() }.ok_or("no root")?;
                    let sum: u64 = m.values().flat_map(|v| v.iter()).sum();
                    Ok(format!("{} {sum}", m.len()))
                }
                ["insert", k, n] => {
                    let h = heap.as_ref().ok_or("no heap")?;
                    let p = h.root_ptr::<Root>().ok_or("no root")?;
                    // SAFETY: the tests' root is a Root, and the test
                    // changes it from one process at a time.
                    let m = unsafe { &mut *p.as_ptr() };
                    let n: u64 = n.parse().unwrap();
                    let mut v = HeapVec::new_in(h.alloc());
                    for i in 0..n {
                        v.push(i);
                    }
                    m.insert(k.parse().unwrap(), v);
                    Ok(String::new())
                }
                ["remove", k] => {
                    let h = heap.as_ref().ok_or("no heap")?;
                    let p = h.root_ptr::<Root>().ok_or("no root")?;
                    // SAFETY: as for insert.
                    let m = unsafe { &mut *p.as_ptr() };
                    m.remove(&k.parse::<u64>().unwrap());
                    Ok(String::new())
                }
                ["churn", n, seed] => {
                    // Allocates and frees boxes of many sizes, checking each.
                    let h = heap.as_ref().ok_or("no heap")?;
                    let (n, seed): (u64, u64) = (n.parse().unwrap(), seed.parse().unwrap());
                    let mut live: Vec<HeapVec<u64>> = Vec::new();
                    for i in 0..n {
                        let len = ((i * 7919 + seed) % 300) as usize;
                        let mut v = HeapVec::with_capacity_in(len, h.alloc());
                        v.extend((0..len as u64).map(|x| x ^ seed));
                        live.push(v);
                        if live.len() > 40 {
                            let v = live.swap_remove(((i * 31) % 40) as usize);
                            if !v.iter().enumerate().all(|(j, &x)| x == j as u64 ^ seed) {
                                return Err("a block changed under its holder".into());
                            }
                        }
                    }
                    Ok(String::new())
                }
                ["seal", n] => {
                    // A scope holding 0..n, sealed and left in flight:
                    // "id addr len" of the vector's elements.
                    let h: &'static Heap = Box::leak(Box::new(heap.take().ok_or("no heap")?));
                    let scope = Box::leak(Box::new(h.scope(64 << 10).map_err(|e| e.to_string())?));
                    let mut v = allocator_api2::vec::Vec::new_in(scope.alloc());
                    v.extend(0..n.parse::<u64>().unwrap());
                    let v = Box::leak(Box::new(v));
                    let seal = scope.seal().map_err(|e| e.to_string())?;
                    let id = seal.id();
                    std::mem::forget(seal);
                    Ok(format!("{id} {} {}", v.as_ptr() as u64, v.len() * 8))
                }
                ["write", addr] => {
                    // A plain store, as a buggy sender would make.
                    let p = addr.parse::<u64>().unwrap() as *mut u64;
                    // SAFETY: none: the test asks for a store that faults.
                    unsafe { p.write_volatile(99) };
                    Ok(String::new())
                }
                ["lock-and-die"] => {
                    // Dies holding the heap's lock, mid-allocation.
                    let h = heap.as_ref().ok_or("no heap")?;
                    dm_heap::testing::die_holding_lock(h)
                }
                ["in-use"] => Ok(heap.as_ref().ok_or("no heap")?.in_use().to_string()),
                ["release", hex] => {
                    let r = Ref::from_bytes(&unhex(hex)).map_err(|e| e.to_string())?;
                    pool.release_ref(&r).map_err(|e| e.to_string())?;
                    Ok(String::new())
                }
                ["close"] => {
                    heap = None;
                    Ok(String::new())
                }
                ["check"] => {
                    let c = pool.check();
                    if c.ok() {
                        Ok(String::new())
                    } else {
                        Err(format!("{c:?}"))
                    }
                }
                ["exit"] => Err("exit".into()),
                _ => Err(format!("unknown command {line:?}")),
            }
        })();
        if w.as_slice() == ["exit"] {
            break;
        }
        match r {
            Ok(s) => println!("ok {s}"),
            Err(e) => println!("err {e}"),
        }
        std::io::stdout().flush().unwrap();
    }
    // The heap closes before the pool detaches.
    drop(heap);
    drop(pool);
}

//! Heap values as call arguments between processes: a chain of three
//! services, each its own process, forwarding a document untouched and
//! reading it in place; sealed arguments verified; forged arguments
//! refused with typed errors.
//!
//! The services are this test binary again, run with `DM_HEAP_TIER` set
//! (the `tier` test serves then, and returns at once otherwise).
#![allow(clippy::unwrap_used)]

use dm_heap::{Heap, HeapError, HeapMap, HeapVec, Heaps, ScopeAlloc, ARG_LEN};
use dm_pool::testing::TempPool;
use dm_pool::{AttachOptions, Pool};
use dm_rpc::{Node, Payload, RpcError};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

/// The document: field names to lists of numbers.
type Doc<'h> = HeapMap<'h, u64, HeapVec<'h, u64>>;
/// A sealed argument: numbers in a scope.
type Sealed<'s> = allocator_api2::vec::Vec<u64, ScopeAlloc<'s>>;

const TIERS: usize = 3;

fn bad(e: HeapError) -> RpcError {
    RpcError::invalid_argument(e.to_string())
}

/// A tier's process: reads field 7 of the document in place, adds what
/// the next tier answers for the same bytes, passed on untouched.
#[test]
fn tier() {
    let Ok(k) = std::env::var("DM_HEAP_TIER") else {
        return;
    };
    let k: usize = k.parse().unwrap();
    let path = std::env::var("DM_HEAP_POOL").unwrap();
    let pool = Pool::open(std::path::Path::new(&path), AttachOptions::default()).unwrap();
    let node = Node::new(pool.clone());
    let next = (k + 1 < TIERS).then(|| format!("heap/tier{}", k + 1));
    let heaps = std::sync::Arc::new(Heaps::new(&pool));
    let h2 = heaps.clone();
    let n2 = node.clone();
    let _server = node
        .server(&format!("heap/tier{k}"))
        .method("field7", move |call| {
            let bytes = call.payload().to_vec()?;
            let doc = heaps.arg::<Doc>(&bytes).map_err(bad)?;
            // SAFETY: the test's sender passes a Doc and leaves it be.
            let mine: u64 = unsafe { doc.get() }.get(&7).map_or(0, |v| v.iter().sum());
            let rest = match &next {
                Some(n) => {
                    let a = n2.connect(n)?.call("field7", Payload::from_vec(bytes))?;
                    u64::from_le_bytes(a.to_vec()?.try_into().unwrap())
                }
                None => 0,
            };
            Ok(Payload::from_vec((mine + rest).to_le_bytes().to_vec()))
        })
        .method("sealed", move |call| {
            let bytes = call.payload().to_vec()?;
            let v = h2.sealed_arg::<Sealed>(&bytes).map_err(bad)?;
            // SAFETY: sealed (verified): its sender cannot change it.
            let sum: u64 = unsafe { v.get() }.iter().sum();
            Ok(Payload::from_vec(sum.to_le_bytes().to_vec()))
        })
        .spawn()
        .unwrap();
    println!("ready");
    std::io::stdout().flush().unwrap();
    // Serves until its stdin closes.
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

fn spawn_tier(tp: &TempPool, k: usize) -> std::process::Child {
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "tier", "--nocapture", "--test-threads=1"])
        .env("DM_HEAP_TIER", k.to_string())
        .env("DM_HEAP_POOL", &tp.path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(c.stdout.take().unwrap());
    let mut line = String::new();
    while out.read_line(&mut line).unwrap() > 0 && !line.contains("ready") {
        line.clear();
    }
    assert!(line.contains("ready"), "tier {k} did not start");
    // (What it prints after, read to its end.)
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    c
}

#[test]
fn a_document_crosses_a_chain_of_three_services_untouched() {
    let tp = TempPool::new(64 << 20);
    let pool = tp.attach();
    let heap = Heap::create(&pool, 4 << 20).unwrap();
    let mut doc: Doc = HeapMap::with_capacity_and_hasher_in(64, Default::default(), heap.alloc());
    for f in 0..50u64 {
        let mut v = HeapVec::new_in(heap.alloc());
        v.extend(0..f);
        doc.insert(f, v);
    }
    let doc = heap.put(doc).unwrap();
    let tiers: Vec<_> = (0..TIERS).map(|k| spawn_tier(&tp, k)).collect();
    let node = Node::new(pool.clone());
    let c = node.connect("heap/tier0").unwrap();
    let arg = heap.arg(doc).unwrap();
    assert_eq!(arg.len(), ARG_LEN);
    let a = c.call("field7", Payload::from_vec(arg.to_vec())).unwrap();
    let got = u64::from_le_bytes(a.to_vec().unwrap().try_into().unwrap());
    assert_eq!(got, 3 * 21, "each tier read field 7 (0+..+6) in place");

    // A sealed argument: verified, read.
    let scope = heap.scope(64 << 10).unwrap();
    let mut v: Sealed = allocator_api2::vec::Vec::new_in(scope.alloc());
    v.extend(0..1000u64);
    let v = scope.put(v).unwrap();
    let seal = scope.seal().unwrap();
    let arg = heap.sealed_arg(v, &seal).unwrap();
    let a = c.call("sealed", Payload::from_vec(arg.to_vec())).unwrap();
    assert_eq!(a.to_vec().unwrap(), (999 * 1000 / 2u64).to_le_bytes());
    drop(seal);
    heap.flush_seals();
    // Released: the same bytes are refused now.
    let e = c
        .call("sealed", Payload::from_vec(arg.to_vec()))
        .unwrap_err();
    assert!(e.message.contains("not sealed"), "{e}");
    // Unsealed, as a sealed one: refused.
    let plain = heap.arg(v).unwrap();
    assert!(c.call("sealed", Payload::from_vec(plain.to_vec())).is_err());

    // Forged arguments: typed errors, the service lives on.
    let mut wrong_type = arg;
    wrong_type[88] ^= 1;
    let mut outside = heap.arg(doc).unwrap();
    outside[64..72].copy_from_slice(&(heap.len() - 8).to_le_bytes());
    let mut unaligned = heap.arg(doc).unwrap();
    let off = u64::from_le_bytes(unaligned[64..72].try_into().unwrap());
    unaligned[64..72].copy_from_slice(&(off + 1).to_le_bytes());
    // (A heap at another address: opened by its Ref, refused by its header.)
    let mut forged_ref = heap.arg(doc).unwrap();
    let addr = u64::from_le_bytes(forged_ref[48..56].try_into().unwrap());
    forged_ref[48..56].copy_from_slice(&(addr + (1 << 30)).to_le_bytes());
    for (what, b) in [
        ("type", wrong_type.to_vec()),
        ("outside", outside.to_vec()),
        ("unaligned", unaligned.to_vec()),
        ("short", arg[..50].to_vec()),
        ("forged ref", forged_ref.to_vec()),
    ] {
        let e = c.call("field7", Payload::from_vec(b)).unwrap_err();
        assert!(
            e.message.contains("bad heap argument") || e.message.contains("not a heap"),
            "{what}: {e}"
        );
    }
    assert_eq!(
        c.call("field7", Payload::from_vec(heap.arg(doc).unwrap().to_vec()))
            .unwrap()
            .to_vec()
            .unwrap(),
        63u64.to_le_bytes()
    );
    for mut t in tiers {
        drop(t.stdin.take());
        t.wait().unwrap();
    }
    drop((c, node, scope));
    drop(heap);
    pool.maintain().unwrap();
    drop(pool);
    tp.assert_clean();
}

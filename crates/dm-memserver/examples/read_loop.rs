//! Reads of one buffer in a loop against a memory server in this
//! process, for profiling a request's round trip (`perf record -a --
//! target/release/examples/read_loop 200000`). Env `SPIN_US`: both
//! sides' busy-poll budget; `SIZE`: bytes per read (4096); `REF=1`:
//! read a Ref of the buffer (`read_ref`) instead of the buffer;
//! `WRITE=1`: write the buffer instead of reading it.
#![allow(clippy::unwrap_used)]

use dm_memserver::{ClientConfig, Config, MemPool, Server};
use dm_pool::{Dm, DmBuffer};
use std::time::{Duration, Instant};

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let spin = std::env::var("SPIN_US")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(Config::default().spin, Duration::from_micros);
    let s = Server::start(Config {
        spin,
        ..Default::default()
    })
    .unwrap();
    let p = MemPool::connect_with(
        &[s.addr().to_string()],
        ClientConfig {
            spin,
            // Every read crosses to the server.
            cache_bytes: 0,
            ..Default::default()
        },
    )
    .unwrap();
    let size: usize = std::env::var("SIZE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4096);
    let by_ref = std::env::var_os("REF").is_some();
    let write = std::env::var_os("WRITE").is_some();
    let mut b = p.alloc(size as u64).unwrap();
    b.write(0, &vec![7u8; size]).unwrap();
    let r = p.create_ref(&b, 0, size as u64).unwrap();
    let mut out = vec![7u8; size];
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        if write {
            b.write(0, &out).unwrap();
        } else if by_ref {
            p.read_ref(&r, 0, &mut out).unwrap();
        } else {
            b.read(0, &mut out).unwrap();
        }
        v.push(t.elapsed().as_nanos() as u64);
    }
    b.read(0, &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 7));
    p.release_ref(&r).unwrap();
    v.sort_unstable();
    println!(
        "{size} B {}: p50 {:.1} us, p99 {:.1} us, avg {:.1} us",
        match (write, by_ref) {
            (true, _) => "writes",
            (false, true) => "reads of a Ref",
            (false, false) => "reads",
        },
        v[n / 2] as f64 / 1e3,
        v[n * 99 / 100] as f64 / 1e3,
        v.iter().sum::<u64>() as f64 / n as f64 / 1e3
    );
    drop((b, p));
    s.shutdown();
}

//! Sharing one buffer in a loop against a memory server in this process,
//! as `bench cow`'s network variant does, for profiling: `create_ref` by
//! one client, `map_ref` by another, then the mapping freed and the Ref
//! released. Prints each step's median. Env `SIZE`: the buffer's bytes
//! (1 MiB); `RELEASE=wait`: release with a round trip of its own
//! (default: `release_ref_nowait`, which goes with the next request).
#![allow(clippy::unwrap_used)]

use dm_memserver::{Config, MemPool, Server};
use dm_pool::{Dm, DmBuffer};
use std::time::Instant;

fn median(v: &mut [u64]) -> f64 {
    v.sort_unstable();
    v[v.len() / 2] as f64 / 1e3
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    let size: u64 = std::env::var("SIZE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1 << 20);
    let wait = std::env::var("RELEASE").is_ok_and(|v| v == "wait");
    let threads = std::env::var("THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(Config::default().threads);
    let s = Server::start(Config {
        threads,
        ..Config::default()
    })
    .unwrap();
    let addr = [s.addr().to_string()];
    let (caller, callee) = (
        MemPool::connect(&addr).unwrap(),
        MemPool::connect(&addr).unwrap(),
    );
    let mut src = caller.alloc(size).unwrap();
    src.write(0, &vec![7u8; size as usize]).unwrap();
    let (mut create, mut map, mut free, mut release) = (vec![], vec![], vec![], vec![]);
    for _ in 0..n {
        let t = Instant::now();
        let r = caller.create_ref(&src, 0, size).unwrap();
        let t1 = Instant::now();
        let m = callee.map_ref(&r).unwrap();
        let t2 = Instant::now();
        callee.free(m).unwrap();
        let t3 = Instant::now();
        if wait {
            caller.release_ref(&r).unwrap();
        } else {
            caller.release_ref_nowait(&r).unwrap();
        }
        let t4 = Instant::now();
        create.push((t1 - t).as_nanos() as u64);
        map.push((t2 - t1).as_nanos() as u64);
        free.push((t3 - t2).as_nanos() as u64);
        release.push((t4 - t3).as_nanos() as u64);
    }
    println!(
        "{size} B: create_ref {:.1} us, map_ref {:.1} us, free {:.1} us, release {:.1} us ({})",
        median(&mut create),
        median(&mut map),
        median(&mut free),
        median(&mut release),
        if wait {
            "waited"
        } else {
            "with the next request"
        }
    );
}

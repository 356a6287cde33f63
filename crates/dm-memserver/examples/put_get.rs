//! Times put and read_ref of SIZE bytes against an in-process server
//! (`cargo run --release -p dm-memserver --example put_get -- 1048576`;
//! env N: calls per measurement, default 50).
#![allow(clippy::unwrap_used)]

use dm_memserver::{ClientConfig, Config, MemPool, Server};
use std::time::{Duration, Instant};

fn main() {
    let size: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1 << 20);
    let s = Server::start(Config {
        size: 256 << 20,
        ..Default::default()
    })
    .unwrap();
    for cache in [0u64, 32 << 20] {
        let p = MemPool::connect_with(
            &[s.addr().to_string()],
            ClientConfig {
                cache_bytes: cache,
                ..Default::default()
            },
        )
        .unwrap();
        let data = vec![7u8; size];
        let mut out = vec![0u8; size];
        let (mut tp, mut tr) = (Duration::ZERO, Duration::ZERO);
        let n: u32 = std::env::var("N")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(50);
        for _ in 0..n {
            let t = Instant::now();
            let r = p.put(&data, Duration::ZERO).unwrap();
            tp += t.elapsed();
            let t = Instant::now();
            p.read_ref(&r, 0, &mut out).unwrap();
            tr += t.elapsed();
            p.release_ref_nowait(&r).unwrap();
        }
        println!(
            "cache {cache}: put {:?}, read_ref {:?} per {size} bytes",
            tp / n,
            tr / n
        );
    }
}

//! 4 KiB reads of one buffer in a loop against a memory server in this
//! process, for profiling a request's round trip (`perf record -a --
//! target/release/examples/read_loop 200000`; env SPIN_US: both sides'
//! busy-poll budget).
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
            ..Default::default()
        },
    )
    .unwrap();
    let mut b = p.alloc(4096).unwrap();
    b.write(0, &[7u8; 4096]).unwrap();
    let mut out = vec![0u8; 4096];
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        b.read(0, &mut out).unwrap();
        v.push(t.elapsed().as_nanos() as u64);
    }
    v.sort_unstable();
    println!(
        "4 KiB reads: p50 {:.1} us, p99 {:.1} us, avg {:.1} us",
        v[n / 2] as f64 / 1e3,
        v[n * 99 / 100] as f64 / 1e3,
        v.iter().sum::<u64>() as f64 / n as f64 / 1e3
    );
    drop((b, p));
    s.shutdown();
}

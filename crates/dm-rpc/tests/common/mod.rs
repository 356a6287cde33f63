//! What the RPC test files share: the transports a test runs over and
//! names no other test takes.
#![allow(dead_code)]

use dm_pool::testing::TempPool;
use dm_pool::PoolConfig;
use dm_rpc::Transport;
use std::sync::atomic::{AtomicU32, Ordering};

static SEQ: AtomicU32 = AtomicU32::new(0);

/// Shared-memory rings, TCP on loopback, in-process queues.
pub fn every_transport() -> [Transport; 3] {
    [
        Transport::Shm,
        Transport::Tcp("127.0.0.1:0".into()),
        Transport::Mem,
    ]
}

/// A service name of this test process no other test uses.
pub fn unique(name: &str) -> String {
    format!(
        "test/{name}/{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// A pool of 256 MiB with 32 channels.
pub fn pool() -> TempPool {
    TempPool::with(PoolConfig {
        size: 256 << 20,
        channels: Some(32),
        ..Default::default()
    })
}

/// `len` bytes of a pattern that differs with `seed`.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

/// A tokio runtime of two worker threads (for tests whose tasks run
/// beside each other).
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

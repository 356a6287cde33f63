//! What the RPC test files share: the transports a test runs over and
//! names no other test takes.
#![allow(dead_code)]

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

//! The DM conformance suite (the same the pool runs) against memory
//! servers: one server, and three servers as one pool.
#![allow(clippy::unwrap_used)]

use dm_memserver::{ClientConfig, Config, MemPool, Server};
use dm_pool::Dm;
use std::time::Duration;

fn server() -> Server {
    Server::start(Config {
        size: 16 << 20,
        ..Default::default()
    })
    .unwrap()
}

fn assert_clean(s: &Server) {
    let problems = s.state().check();
    assert!(problems.is_empty(), "{problems:#?}");
    let u = s.state().usage();
    assert_eq!(u.pages_held, 0, "{u:?}");
    assert_eq!(u.refs, 0, "{u:?}");
}

#[test]
fn one_server() {
    let s = server();
    let other = server();
    let addr = s.addr().to_string();
    let oaddr = other.addr().to_string();
    dm_pool::conformance::run_all(&|| MemPool::connect(&[&addr]).unwrap(), &|| {
        MemPool::connect(&[&oaddr]).unwrap()
    });
    // Sessions end when their pools drop; give the server a moment.
    std::thread::sleep(Duration::from_millis(100));
    assert_clean(&s);
    assert_clean(&other);
}

#[test]
fn one_server_without_busy_polling() {
    // Polling is on by default on both sides (tests above); here every
    // wait blocks at once: the blocking paths alone must be correct.
    let quiet = || {
        Server::start(Config {
            size: 16 << 20,
            spin: Duration::ZERO,
            ..Default::default()
        })
        .unwrap()
    };
    let (s, other) = (quiet(), quiet());
    let cfg = ClientConfig {
        spin: Duration::ZERO,
        ..Default::default()
    };
    let (addr, oaddr) = (s.addr().to_string(), other.addr().to_string());
    dm_pool::conformance::run_all(
        &|| MemPool::connect_with(&[&addr], cfg.clone()).unwrap(),
        &|| MemPool::connect_with(&[&oaddr], cfg.clone()).unwrap(),
    );
    std::thread::sleep(Duration::from_millis(100));
    assert_clean(&s);
    assert_clean(&other);
}

#[test]
fn three_servers_as_one_pool() {
    let servers: Vec<Server> = (0..3).map(|_| server()).collect();
    let other = server();
    let addrs: Vec<String> = servers.iter().map(|s| s.addr().to_string()).collect();
    let oaddr = other.addr().to_string();
    dm_pool::conformance::run_all(&|| MemPool::connect(&addrs).unwrap(), &|| {
        MemPool::connect(&[&oaddr]).unwrap()
    });
    // Round-robin placement: consecutive buffers land on different servers.
    let p = MemPool::connect(&addrs).unwrap();
    let bufs: Vec<_> = (0..3).map(|_| p.alloc(10).unwrap()).collect();
    let mut on: Vec<usize> = bufs.iter().map(|b| b.server()).collect();
    on.sort();
    assert_eq!(on, vec![0, 1, 2]);
    drop((bufs, p));
    std::thread::sleep(Duration::from_millis(100));
    for s in &servers {
        assert_clean(s);
    }
    assert_clean(&other);
}

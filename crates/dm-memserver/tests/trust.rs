//! Who a memory server serves and how much: keys, admin operations,
//! listening beyond loopback, per-client quotas, and clients that send or
//! read too slowly.
#![allow(clippy::unwrap_used)]

use dm_memserver::proto::Request;
use dm_memserver::{ClientConfig, Config, MemPool, Server};
use dm_pool::auth::Key;
use dm_pool::{Dm, DmBuffer, Error};
use std::io::{Read, Write};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn key(s: &str) -> Key {
    Key::from_secret(s.as_bytes()).unwrap()
}

fn with_keys(key: Option<Key>, admin_key: Option<Key>) -> ClientConfig {
    ClientConfig {
        key,
        admin_key,
        ..Default::default()
    }
}

fn settle(s: &Server) {
    for _ in 0..200 {
        if s.state().usage().pages_held == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(s.state().check().is_empty(), "{:#?}", s.state().check());
    assert_eq!(s.state().usage().pages_held, 0);
}

#[test]
fn a_server_with_a_key_serves_only_clients_that_prove_it() {
    let s = Server::start(Config {
        key: Some(key("the cluster's memory key")),
        ..Default::default()
    })
    .unwrap();
    let addr = [s.addr().to_string()];
    // No key: it connects (the hello is open) but is served nothing.
    let p = MemPool::connect(&addr).unwrap();
    let e = p.alloc(4096).unwrap_err();
    assert!(matches!(e, Error::Unauthenticated(_)), "{e}");
    assert!(e.to_string().contains("--key-file"), "{e}");
    assert!(matches!(p.usage(), Err(Error::Unauthenticated(_))));
    drop(p);
    // A wrong key: refused at connect, because the server cannot prove it.
    let e = MemPool::connect_with(&addr, with_keys(Some(key("some other key here")), None))
        .unwrap_err();
    assert!(matches!(e, Error::Unauthenticated(_)), "{e}");
    assert!(e.to_string().contains("did not prove"), "{e}");
    // The right key: served.
    let p = MemPool::connect_with(
        &addr,
        with_keys(Some(key("the cluster's memory key")), None),
    )
    .unwrap();
    let mut b = p.alloc(8192).unwrap();
    b.write(100, b"authenticated").unwrap();
    let r = p.create_ref(&b, 0, 8192).unwrap();
    let mut got = [0u8; 13];
    p.read_ref(&r, 100, &mut got).unwrap();
    assert_eq!(&got, b"authenticated");
    p.release_ref(&r).unwrap();
    p.free(b).unwrap();
    drop(p);
    settle(&s);
}

/// A client that proves the wrong key itself (a server that holds the key
/// proves it; the client then answers with another) is refused and
/// counted.
#[test]
fn a_wrong_proof_is_refused_and_counted() {
    let k = key("the cluster's memory key");
    let s = Server::start(Config {
        key: Some(k),
        ..Default::default()
    })
    .unwrap();
    let mut c = std::net::TcpStream::connect(s.addr()).unwrap();
    let mut f = Vec::new();
    Request::Hello {
        lease_ms: 10_000,
        nonce: Some([7; 16]),
    }
    .encode(1, &mut f);
    Request::Auth {
        role: dm_memserver::proto::ROLE_CLIENT,
        proof: [0; 32],
    }
    .encode(2, &mut f);
    Request::Alloc { len: 4096 }.encode(3, &mut f);
    c.write_all(&f).unwrap();
    let mut answers = Vec::new();
    for _ in 0..3 {
        let mut len = [0u8; 4];
        c.read_exact(&mut len).unwrap();
        let mut frame = vec![0u8; u32::from_le_bytes(len) as usize];
        c.read_exact(&mut frame).unwrap();
        let (_, a) = dm_memserver::proto::decode_answer(&frame).unwrap();
        answers.push(a.map(<[u8]>::to_vec));
    }
    let hello = dm_memserver::proto::HelloAnswer::decode(answers[0].as_ref().unwrap()).unwrap();
    let offer = hello.auth.unwrap();
    assert_eq!(offer.flags & dm_memserver::proto::AUTH_NEEDS_KEY, 1);
    assert!(k.verify(
        dm_memserver::proto::AUTH_CONTEXT,
        b'S',
        &[7; 16],
        &offer.nonce,
        &offer.proof
    ));
    assert!(matches!(answers[1], Err(Error::Unauthenticated(_))));
    assert!(matches!(answers[2], Err(Error::Unauthenticated(_))));
    assert_eq!(s.state().metrics.auth_failures.load(Ordering::Relaxed), 1);
}

/// A client with a key refuses a server that has none (it could be anyone
/// listening on that address).
#[test]
fn a_client_with_a_key_refuses_a_server_without_one() {
    let s = Server::start(Config::default()).unwrap();
    let e = MemPool::connect_with(
        &[s.addr().to_string()],
        with_keys(Some(key("the cluster's memory key")), None),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Unauthenticated(_)), "{e}");
}

#[test]
fn admin_operations_need_the_admin_key() {
    let s = Server::start(Config {
        key: Some(key("the cluster's memory key")),
        admin_key: Some(key("the operators' admin key")),
        ..Default::default()
    })
    .unwrap();
    let addr = [s.addr().to_string()];
    let client = MemPool::connect_with(
        &addr,
        with_keys(Some(key("the cluster's memory key")), None),
    )
    .unwrap();
    let e = client.check_servers().unwrap_err();
    assert!(matches!(e, Error::PermissionDenied(_)), "{e}");
    assert!(e.to_string().contains("admin key"), "{e}");
    assert!(matches!(client.maintain(), Err(Error::PermissionDenied(_))));
    // The client's own work goes on.
    client.free(client.alloc(4096).unwrap()).unwrap();
    let admin = MemPool::connect_with(
        &addr,
        with_keys(None, Some(key("the operators' admin key"))),
    )
    .unwrap();
    assert!(admin.check_servers().unwrap().is_empty());
    admin.maintain().unwrap();
    // The admin key admits as a client too.
    admin.free(admin.alloc(4096).unwrap()).unwrap();
    drop((client, admin));
    settle(&s);
}

#[test]
fn listening_beyond_loopback_needs_a_key_or_open() {
    let e = Server::start(Config {
        listen: "0.0.0.0:0".into(),
        ..Default::default()
    })
    .unwrap_err();
    assert!(matches!(e, Error::InvalidConfig(_)), "{e}");
    assert!(
        e.to_string().contains("--key-file") && e.to_string().contains("--open"),
        "{e}"
    );
    let keyed = Server::start(Config {
        listen: "0.0.0.0:0".into(),
        key: Some(key("the cluster's memory key")),
        ..Default::default()
    })
    .unwrap();
    let open = Server::start(Config {
        listen: "0.0.0.0:0".into(),
        open: true,
        ..Default::default()
    })
    .unwrap();
    keyed.shutdown();
    open.shutdown();
}

/// A client's buffers and the Refs it made count against its quota;
/// passing it is `ResourceExhausted` naming the quota, and what is given
/// back can be taken again. Another client has its own quota.
#[test]
fn a_client_quota_bounds_buffers_and_refs() {
    let s = Server::start(Config {
        client_quota: Some(64 << 10),
        ..Default::default()
    })
    .unwrap();
    let addr = [s.addr().to_string()];
    let p = MemPool::connect(&addr).unwrap();
    let a = p.alloc(48 << 10).unwrap();
    let e = p.alloc(32 << 10).unwrap_err();
    assert!(
        matches!(e, Error::ResourceExhausted { what } if what == "memory-server quota"),
        "{e}"
    );
    assert!(e.to_string().contains("--client-quota"), "{e}");
    // A Ref of the buffer charges its pages again (it outlives the buffer).
    let r = p.create_ref(&a, 0, 16 << 10).unwrap();
    assert!(
        p.create_ref(&a, 0, 16 << 10).is_err(),
        "48 + 16 + 16 > 64 KiB"
    );
    p.free(a).unwrap();
    // A put charges its Ref only.
    let big = vec![3u8; 48 << 10];
    let r2 = p.put(&big, Duration::from_secs(60)).unwrap();
    assert!(p.put(&big, Duration::from_secs(60)).is_err());
    // Another client is not limited by this one's holdings.
    let q = MemPool::connect(&addr).unwrap();
    let m = q.map_ref(&r2).unwrap();
    q.free(m).unwrap();
    p.release_ref(&r2).unwrap();
    p.release_ref(&r).unwrap();
    let again = p.alloc(64 << 10).unwrap();
    p.free(again).unwrap();
    drop((p, q));
    settle(&s);
}

/// Frames sent too slowly, announced and never sent, and answers never
/// read: each such connection is dropped within the lease, and the server
/// keeps serving others.
#[test]
fn slow_and_silent_clients_are_dropped() {
    let s = Server::start(Config {
        default_lease: Duration::from_millis(300),
        ..Default::default()
    })
    .unwrap();
    // A frame announced at 16 MiB, of which 10 bytes come.
    let mut slow = std::net::TcpStream::connect(s.addr()).unwrap();
    slow.write_all(&((16u32 << 20) + 16).to_le_bytes()).unwrap();
    slow.write_all(&[1u8; 10]).unwrap();
    // A client that asks for 64 MiB of answers and reads none.
    let mut deaf = std::net::TcpStream::connect(s.addr()).unwrap();
    let p = MemPool::connect(&[s.addr().to_string()]).unwrap();
    let b = p.alloc(4 << 20).unwrap();
    let r = p.create_ref(&b, 0, 4 << 20).unwrap();
    let mut f = Vec::new();
    for id in 0..16 {
        Request::ReadRef {
            r,
            offset: 0,
            len: 4 << 20,
        }
        .encode(id, &mut f);
    }
    deaf.write_all(&f).unwrap();
    // Neither connection is read from: both sessions end, and only the
    // well-behaved client's stays.
    let t = Instant::now();
    let clients = || s.state().metrics.clients.load(Ordering::Relaxed);
    while clients() > 1 && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(clients(), 1, "after {:?}", t.elapsed());
    drop((slow, deaf));
    // The well-behaved client is still served.
    let mut got = [0u8; 4];
    p.read_ref(&r, 0, &mut got).unwrap();
    p.release_ref(&r).unwrap();
    p.free(b).unwrap();
    drop(p);
    settle(&s);
}

/// A connection to a keyed server that never proves the key, but keeps
/// its session alive with pings, is dropped.
#[test]
fn an_unauthenticated_session_cannot_be_held_open() {
    let s = Server::start(Config {
        key: Some(key("the cluster's memory key")),
        default_lease: Duration::from_millis(300),
        ..Default::default()
    })
    .unwrap();
    let mut c = std::net::TcpStream::connect(s.addr()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let t = Instant::now();
    let mut id = 0;
    let dropped = loop {
        id += 1;
        let mut f = Vec::new();
        Request::Ping.encode(id, &mut f);
        if c.write_all(&f).is_err() {
            break true;
        }
        let mut len = [0u8; 4];
        if c.read_exact(&mut len).is_err() {
            break true;
        }
        let mut frame = vec![0u8; u32::from_le_bytes(len) as usize];
        if c.read_exact(&mut frame).is_err() {
            break true;
        }
        if t.elapsed() > Duration::from_secs(5) {
            break false;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(dropped, "still open after {:?}", t.elapsed());
}

/// Without an admin key, admin operations are for clients of the
/// server's host that hold the client key, not for any local process.
#[test]
fn without_an_admin_key_admin_operations_need_this_host_and_the_key() {
    let s = Server::start(Config {
        key: Some(key("the cluster's memory key")),
        ..Default::default()
    })
    .unwrap();
    let addr = [s.addr().to_string()];
    let anyone = MemPool::connect(&addr).unwrap();
    assert!(matches!(
        anyone.check_servers(),
        Err(Error::PermissionDenied(_))
    ));
    let client = MemPool::connect_with(
        &addr,
        with_keys(Some(key("the cluster's memory key")), None),
    )
    .unwrap();
    assert!(client.check_servers().unwrap().is_empty());
    client.maintain().unwrap();
}

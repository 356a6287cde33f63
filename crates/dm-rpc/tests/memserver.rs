//! RPC between nodes in different pools that use the same memory servers
//! (DmRPC-net): large arguments and answers travel as memory-server Refs
//! over TCP, are forwarded untouched through a middle tier, and everything
//! is released when the calls complete.
#![allow(clippy::unwrap_used)]

use dm_memserver::{Config as MsConfig, MemPool, Server as MemServer};
use dm_pool::testing::TempPool;
use dm_pool::{Dm, DmBuffer};
use dm_rpc::{Config, Node, Payload, RemoteChoice, Transport};

/// A node that uses the memory servers `ms`, sending by Ref above the
/// threshold (not learning: the tests check which way payloads go).
fn node(tp: &TempPool, ms: &[&MemServer]) -> Node {
    node_with(tp, ms, RemoteChoice::Threshold)
}

fn node_with(tp: &TempPool, ms: &[&MemServer], choice: RemoteChoice) -> Node {
    let addrs: Vec<String> = ms.iter().map(|s| s.addr().to_string()).collect();
    let cfg = Config {
        remote_choice: choice,
        ..Config::default()
    };
    Node::with_config(tp.attach(), cfg).with_memserver(MemPool::connect(&addrs).unwrap())
}

/// A memory server of 64 MiB in this process.
fn mem_server() -> MemServer {
    MemServer::start(MsConfig {
        size: 64 << 20,
        ..Default::default()
    })
    .unwrap()
}

fn sum(p: &Payload) -> u64 {
    p.segments()
        .unwrap()
        .iter()
        .flat_map(|s| s.iter())
        .map(|&b| b as u64)
        .sum()
}

/// Answers the sum of what arrived and whether it came by memory-server Ref.
fn sum_and_how(c: &mut dm_rpc::Call<'_>) -> Result<Payload, dm_rpc::RpcError> {
    let mut v = sum(c.payload()).to_le_bytes().to_vec();
    v.push(c.payload().is_remote() as u8);
    Ok(Payload::from_vec(v))
}

fn settled(ms: &MemServer) {
    for _ in 0..200 {
        let u = ms.state().usage();
        if u.pages_held == 0 && u.refs == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let problems = ms.state().check();
    assert!(problems.is_empty(), "{problems:#?}");
    let u = ms.state().usage();
    assert_eq!((u.pages_held, u.refs), (0, 0), "{u:?}");
}

#[test]
fn large_payloads_travel_as_memory_server_refs_and_are_released() {
    let ms = mem_server();
    let (pa, pb, pc) = (
        TempPool::new(16 << 20),
        TempPool::new(16 << 20),
        TempPool::new(16 << 20),
    );
    // C, the last tier: reads every byte, answers with the sum and, for
    // `echo`, the data itself.
    let nc = node(&pc, &[&ms]);
    let sc = nc
        .server("net/last")
        .transport(Transport::Tcp("127.0.0.1:0".into()))
        .method("sum", sum_and_how)
        .method("echo", |c| Ok(c.take_payload()))
        .spawn()
        .unwrap();
    let c_addr = sc.tcp_addr().unwrap().to_owned();
    // B, the middle tier: forwards without touching the data.
    let nb = node(&pb, &[&ms]);
    let to_c = nb.connect_tcp(&c_addr).unwrap();
    let sb = nb
        .server("net/middle")
        .transport(Transport::Tcp("127.0.0.1:0".into()))
        .method("sum", move |c| {
            let large = c.payload().len() > dm_rpc::DEFAULT_INLINE_MAX as u64;
            assert_eq!(c.payload().is_remote(), large, "large ones arrive by Ref");
            to_c.call("sum", c.payload().forward()?)
        })
        .spawn()
        .unwrap();
    let na = node(&pa, &[&ms]);
    let to_b = na.connect_tcp(sb.tcp_addr().unwrap()).unwrap();
    let data: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    let want: u64 = data.iter().map(|&b| b as u64).sum();
    let puts =
        || ms.state().metrics.requests_of("put") + ms.state().metrics.requests_of("stream_put");
    let refs0 = puts();
    for _ in 0..3 {
        let r = to_b.call("sum", Payload::from_vec(data.clone())).unwrap();
        let v = r.to_vec().unwrap();
        assert_eq!(u64::from_le_bytes(v[..8].try_into().unwrap()), want);
        assert_eq!(v[8], 1, "the last tier got a memory-server Ref");
    }
    assert_eq!(
        puts() - refs0,
        3,
        "one Ref per call (one put), none at the forwarding hop"
    );
    // A buffer built on the memory server goes by its Ref, no copy.
    let m = na.memserver().unwrap();
    let mut b = m.alloc(300_000).unwrap();
    b.write(0, &vec![2u8; 300_000]).unwrap();
    let r = to_b.call("sum", Payload::from_mem_buffer(b)).unwrap();
    assert_eq!(
        u64::from_le_bytes(r.to_vec().unwrap()[..8].try_into().unwrap()),
        600_000
    );
    // A large answer comes back by Ref too (and is released by the caller).
    let to_c = na.connect_tcp(&c_addr).unwrap();
    let back = to_c.call("echo", Payload::from_vec(data.clone())).unwrap();
    assert!(back.to_vec().unwrap() == data);
    // Small payloads stay inline.
    let r = to_b.call("sum", Payload::from_vec(vec![1u8; 100])).unwrap();
    assert_eq!(r.to_vec().unwrap()[..9], [100, 0, 0, 0, 0, 0, 0, 0, 0]);
    drop(back); // an answer's Ref lives as long as the answer
    drop((to_b, to_c, sb, sc));
    settled(&ms);
    drop((na, nb, nc));
    pa.assert_clean();
    pb.assert_clean();
    pc.assert_clean();
}

#[test]
fn a_peer_without_the_memory_servers_gets_values() {
    let ms = MemServer::start(MsConfig::default()).unwrap();
    let (pa, pb) = (TempPool::new(16 << 20), TempPool::new(16 << 20));
    // The server uses no memory server; the client does.
    let nb = Node::new(pb.attach());
    let sb = nb
        .server("net/plain")
        .transport(Transport::Tcp("127.0.0.1:0".into()))
        .method("sum", sum_and_how)
        .spawn()
        .unwrap();
    let na = node(&pa, &[&ms]);
    let c = na.connect_tcp(sb.tcp_addr().unwrap()).unwrap();
    let r = c
        .call("sum", Payload::from_vec(vec![3u8; 500_000]))
        .unwrap();
    let v = r.to_vec().unwrap();
    assert_eq!(u64::from_le_bytes(v[..8].try_into().unwrap()), 1_500_000);
    assert_eq!(v[8], 0, "sent by value");
    assert_eq!(ms.state().metrics.requests_of("put"), 0);
    assert_eq!(ms.state().metrics.requests_of("create_ref"), 0);
    drop((c, sb, na, nb));
    settled(&ms);
    pa.assert_clean();
    pb.assert_clean();
}

#[test]
fn reading_part_of_a_remote_payload_fetches_that_part() {
    let ms = mem_server();
    let (pa, pb) = (TempPool::new(16 << 20), TempPool::new(16 << 20));
    // A tier that reads 8 bytes at the offset the payload's first 8 bytes
    // name (a header, then a field it points to), and a range past the end.
    let nb = node(&pb, &[&ms]);
    let sb = nb
        .server("net/peek")
        .transport(Transport::Tcp("127.0.0.1:0".into()))
        .method("peek", |c| {
            let p = c.payload();
            assert!(p.is_remote());
            let mut h = [0u8; 8];
            p.read(0, &mut h)?;
            let mut v = vec![0u8; 8];
            p.read(u64::from_le_bytes(h), &mut v)?;
            let past = p.read(p.len() - 4, &mut [0u8; 8]).unwrap_err();
            assert_eq!(past.status, dm_rpc::Status::InvalidArgument, "{past}");
            Ok(Payload::from_vec(v))
        })
        .spawn()
        .unwrap();
    let na = node(&pa, &[&ms]);
    let to_b = na.connect_tcp(sb.tcp_addr().unwrap()).unwrap();
    let mut data: Vec<u8> = (0..1 << 20).map(|i| (i % 253) as u8).collect();
    data[..8].copy_from_slice(&777_777u64.to_le_bytes());
    let reads0 = ms.state().metrics.requests_of("read_ref");
    let r = to_b.call("peek", Payload::from_vec(data.clone())).unwrap();
    assert_eq!(r.to_vec().unwrap(), data[777_777..777_785]);
    assert_eq!(
        ms.state().metrics.requests_of("read_ref") - reads0,
        2,
        "two small reads, not a fetch of the whole payload"
    );
    drop((to_b, sb));
    settled(&ms);
    drop((na, nb));
    pa.assert_clean();
    pb.assert_clean();
}

/// A request carrying a memory-server Ref whose length was forged (2^62
/// bytes) is refused with `InvalidArgument` as it arrives, before the
/// length sizes anything; the server goes on serving.
#[test]
fn a_memory_server_ref_with_a_forged_length_is_refused_on_arrival() {
    use dm_rpc::frame::{method_id, Body, Frame};
    use std::time::{Duration, Instant};
    let ms = MemServer::start(MsConfig::default()).unwrap();
    let tp = TempPool::new(16 << 20);
    let n = node(&tp, &[&ms]);
    let svc = n
        .server("net/forged")
        .method("sum", sum_and_how)
        .spawn()
        .unwrap();
    let m = n.memserver().unwrap();
    let mut b = m.alloc(4096).unwrap();
    b.write(0, &[1u8; 4096]).unwrap();
    let real = m.create_ref(&b, 0, 4096).unwrap();
    let mut forged = real;
    forged.len = 1 << 62;
    let info = n.pool().lookup("net/forged").unwrap().unwrap();
    let policy = dm_rpc::WaitPolicy::default();
    let mut raw = dm_rpc::raw::shm::connect(n.pool(), &info, policy).unwrap();
    let soon = || Some(Instant::now() + Duration::from_secs(10));
    let ask = |id, r| Frame::request(id, method_id("sum"), 0, Body::Refs(vec![r]));
    assert!(raw.tx.send(&ask(1, forged), soon()).unwrap());
    let f = raw.rx.recv(soon()).unwrap().expect("an answer");
    assert_eq!(f.status, dm_rpc::Status::InvalidArgument, "{f:?}");
    // The real Ref is served on the same connection.
    assert!(raw.tx.send(&ask(2, real), soon()).unwrap());
    let f = raw.rx.recv(soon()).unwrap().expect("an answer");
    assert_eq!(f.status, dm_rpc::Status::Ok);
    let Body::Inline(v) = &f.payload else {
        panic!("{f:?}")
    };
    assert_eq!(u64::from_le_bytes(v[..8].try_into().unwrap()), 4096);
    drop(raw);
    m.release_ref(&real).unwrap();
    m.free(b).unwrap();
    drop((svc, n));
    settled(&ms);
    tp.assert_clean();
}

/// A service keeps what arrived by memory-server Ref (its own buffer on
/// the server, no copy) and answers it by Ref again and again, as a
/// store does: each answer a Ref of the kept buffer.
#[test]
fn kept_remote_data_is_answered_by_ref_many_times() {
    let ms = mem_server();
    let (pa, pb) = (TempPool::new(16 << 20), TempPool::new(16 << 20));
    let nb = node(&pb, &[&ms]);
    let kept = std::sync::Arc::new(std::sync::Mutex::new(None::<Payload>));
    let (k1, k2, k3) = (kept.clone(), kept.clone(), kept.clone());
    let sb = nb
        .server("net/store")
        .transport(Transport::Tcp("127.0.0.1:0".into()))
        .method("put", move |c| {
            *k1.lock().unwrap() = Some(c.take_payload().keep()?);
            Ok(Payload::empty())
        })
        .method("get", move |_| {
            k2.lock().unwrap().as_ref().unwrap().forward()
        })
        .method("stamp", move |_| {
            let mut g = k3.lock().unwrap();
            let p = g.as_mut().unwrap();
            p.write(0, b"stamped")?;
            Ok(Payload::empty())
        })
        .spawn()
        .unwrap();
    // A middle tier passes the store's answers back untouched.
    let pm = TempPool::new(16 << 20);
    let nm = node(&pm, &[&ms]);
    let to_store = nm.connect_tcp(sb.tcp_addr().unwrap()).unwrap();
    let sm = nm
        .server("net/middle-back")
        .transport(Transport::Tcp("127.0.0.1:0".into()))
        .method("get", move |c| to_store.call("get", c.take_payload()))
        .spawn()
        .unwrap();
    let na = node(&pa, &[&ms]);
    let c = na.connect_tcp(sb.tcp_addr().unwrap()).unwrap();
    let data: Vec<u8> = (0..300_000).map(|i| (i % 253) as u8).collect();
    c.call("put", Payload::from_vec(data.clone())).unwrap();
    let creates = || ms.state().metrics.requests_of("create_ref");
    let reads = || ms.state().metrics.requests_of("read_ref");
    let before = creates();
    let answers: Vec<Payload> = (0..3)
        .map(|_| c.call("get", Payload::empty()).unwrap())
        .collect();
    assert_eq!(
        creates() - before,
        3,
        "each answer a Ref of the kept buffer"
    );
    let via = na.connect_tcp(sm.tcp_addr().unwrap()).unwrap();
    let (c0, r0) = (creates(), reads());
    let back = via.call("get", Payload::empty()).unwrap();
    assert_eq!(
        (creates() - c0, reads() - r0),
        (1, 0),
        "passed back, not read"
    );
    assert!(back.is_remote());
    assert_eq!(back.to_vec().unwrap(), data);
    drop((back, via));
    sm.shutdown();
    drop(nm);
    for a in &answers {
        assert!(a.is_remote(), "by Ref");
        assert_eq!(a.to_vec().unwrap(), data);
    }
    // Written once its forwards are gone; an answer not read yet keeps
    // what it was given (its Ref is a snapshot).
    let unread = c.call("get", Payload::empty()).unwrap();
    c.call("stamp", Payload::empty()).unwrap();
    let after = c.call("get", Payload::empty()).unwrap().to_vec().unwrap();
    assert_eq!(&after[..7], b"stamped");
    assert_eq!(&after[7..], &data[7..]);
    assert_eq!(unread.to_vec().unwrap(), data);
    drop((answers, unread, c, na));
    sb.shutdown();
    drop((kept, nb));
    settled(&ms);
}

/// With the choice learned, a client tries both ways for a size before
/// it settles on the faster, and the data arrives whole whichever way it
/// went. (Here by Ref is made slow: the service sleeps on it.)
#[test]
fn a_learning_client_tries_both_ways_and_settles_on_the_faster() {
    let ms = mem_server();
    let (pa, pb) = (TempPool::new(16 << 20), TempPool::new(16 << 20));
    let nb = node(&pb, &[&ms]);
    let sb = nb
        .server("net/learn")
        .transport(Transport::Tcp("127.0.0.1:0".into()))
        .method("sum", |c| {
            if c.payload().is_remote() {
                // (Far slower than inline even on a loaded machine.)
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            sum_and_how(c)
        })
        .spawn()
        .unwrap();
    let na = node_with(&pa, &[&ms], RemoteChoice::Measured);
    let c = na.connect_tcp(sb.tcp_addr().unwrap()).unwrap();
    let data: Vec<u8> = (0..200_000).map(|i| (i % 241) as u8).collect();
    let want: u64 = data.iter().map(|&b| b as u64).sum();
    let mut ways = Vec::new();
    for _ in 0..40 {
        let v = c
            .call("sum", Payload::from_vec(data.clone()))
            .unwrap()
            .to_vec()
            .unwrap();
        assert_eq!(u64::from_le_bytes(v[..8].try_into().unwrap()), want);
        ways.push(v[8]);
    }
    // Warming up: both ways, four times each, first.
    let by_ref = ways[..8].iter().filter(|&&w| w == 1).count();
    assert_eq!(by_ref, 4, "{ways:?}");
    // Then the faster (exploring the other once in 64 calls: not yet).
    assert!(ways[8..].iter().all(|&w| w == 0), "{ways:?}");
    // Small payloads are never learned: inline.
    let v = c
        .call("sum", Payload::from_vec(vec![1u8; 1000]))
        .unwrap()
        .to_vec()
        .unwrap();
    assert_eq!(v[8], 0);
    drop((c, na));
    sb.shutdown();
    drop(nb);
    settled(&ms);
}

/// A tier serving a call a learner sent inline forwards inline too (and
/// says so), without learning: the learner measures inline all the way.
/// A tier called without the mark learns for its callee.
#[test]
fn a_tier_follows_its_learning_callers_inline_choice() {
    let ms = mem_server();
    let (pa, pb, pc) = (
        TempPool::new(16 << 20),
        TempPool::new(16 << 20),
        TempPool::new(16 << 20),
    );
    // The last tier answers the sum, how the payload came, and whether
    // the call carried the mark.
    let nc = node(&pc, &[&ms]);
    let sc = nc
        .server("net/follow/last")
        .transport(Transport::Tcp("127.0.0.1:0".into()))
        .method("sum", |c| {
            let marked = c.metadata().get(dm_rpc::WAY_KEY) == Some(dm_rpc::WAY_INLINE);
            let mut p = sum_and_how(c)?.to_vec()?;
            p.push(marked as u8);
            Ok(Payload::from_vec(p))
        })
        .spawn()
        .unwrap();
    // The middle tier learns (Measured) and forwards what it gets.
    let nb = node_with(&pb, &[&ms], RemoteChoice::Measured);
    let next = nb.connect_tcp(sc.tcp_addr().unwrap()).unwrap();
    let sb = nb
        .server("net/follow/middle")
        .transport(Transport::Tcp("127.0.0.1:0".into()))
        .method("sum", move |c| {
            let came_inline = !c.payload().is_remote();
            let mut v = next.call("sum", c.take_payload())?.to_vec()?;
            v.push(came_inline as u8);
            Ok(Payload::from_vec(v))
        })
        .spawn()
        .unwrap();
    let data: Vec<u8> = (0..100_000).map(|i| (i % 251) as u8).collect();
    let want: u64 = data.iter().map(|&b| b as u64).sum();
    // (sum, last tier got it by Ref, marked, middle got it inline)
    let call = |c: &dm_rpc::Client| {
        let v = c
            .call("sum", Payload::from_vec(data.clone()))
            .unwrap()
            .to_vec()
            .unwrap();
        assert_eq!(u64::from_le_bytes(v[..8].try_into().unwrap()), want);
        (v[8], v[9], v[10])
    };
    let na = node_with(&pa, &[&ms], RemoteChoice::Measured);
    let c = na.connect_tcp(sb.tcp_addr().unwrap()).unwrap();
    // The learner warms up: inline, by Ref, inline, by Ref... Each inline
    // call is passed on inline and marked; each by Ref passes its Ref.
    for i in 0..8 {
        let (last_by_ref, marked, middle_inline) = call(&c);
        if i % 2 == 0 {
            assert_eq!((middle_inline, last_by_ref, marked), (1, 0, 1), "call {i}");
        } else {
            assert_eq!((middle_inline, last_by_ref, marked), (0, 1, 0), "call {i}");
        }
    }
    // A caller that does not learn sends inline, unmarked: the middle
    // tier learns, and warms up both ways for its callee.
    let plain = Node::with_config(
        pa.attach(),
        Config {
            inline_max: usize::MAX,
            ..Config::default()
        },
    );
    let pc_ = plain.connect_tcp(sb.tcp_addr().unwrap()).unwrap();
    let mut last_ways = Vec::new();
    for _ in 0..8 {
        let v = pc_
            .call("sum", Payload::from_vec(data.clone()))
            .unwrap()
            .to_vec()
            .unwrap();
        // Inline to the middle; the middle's own inline calls are marked
        // for its callee, its calls by Ref not.
        assert_eq!((v[9], v[10]), (1 - v[8], 1), "{v:?}");
        last_ways.push(v[8]);
    }
    assert!(
        last_ways.contains(&0) && last_ways.contains(&1),
        "{last_ways:?}"
    );
    drop((c, na, pc_, plain));
    sb.shutdown();
    sc.shutdown();
    drop((nb, nc));
    settled(&ms);
}

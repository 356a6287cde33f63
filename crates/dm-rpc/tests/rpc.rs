//! The RPC contract, run over every transport: the same calls, statuses,
//! deadlines, payload sizes and forwarding over shared-memory rings and
//! in-process queues. Each test ends with the pool clean.

#![allow(clippy::unwrap_used)]

use dm_pool::testing::TempPool;
use dm_pool::PoolConfig;
use dm_rpc::{CallOptions, Config, Node, Payload, RpcError, Status, Transport, WaitPolicy};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

mod common;
use common::{every_transport, unique};

fn pool() -> TempPool {
    TempPool::with(PoolConfig {
        size: 256 << 20,
        channels: Some(16),
        ..Default::default()
    })
}

fn sum(p: &Payload) -> u64 {
    p.segments()
        .unwrap()
        .iter()
        .flat_map(|s| s.iter())
        .fold(0u64, |a, &b| a.wrapping_mul(31).wrapping_add(b as u64))
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed))
        .collect()
}

/// A service with the methods the tests use.
fn spawn_svc(node: &Node, name: &str, t: &Transport) -> dm_rpc::Server {
    node.server(name)
        .transport(t.clone())
        // Answers [len, in_pool, hash] of what arrived.
        .method("inspect", |c| {
            let p = c.payload();
            let mut out = p.len().to_le_bytes().to_vec();
            // By Ref: in the pool, or on a memory server.
            out.push((p.in_pool() || p.is_remote()) as u8);
            out.extend_from_slice(&sum(p).to_le_bytes());
            Ok(Payload::from_vec(out))
        })
        .method("echo", |c| Ok(c.take_payload()))
        .method("fail", |_| Err(RpcError::invalid_argument("no thanks")))
        .method("panic", |_| panic!("handler bug"))
        .method("sleep", |c| {
            let ms = u64::from_le_bytes(c.payload().to_vec()?.try_into().unwrap_or([0; 8]));
            std::thread::sleep(Duration::from_millis(ms));
            Ok(Payload::empty())
        })
        .spawn()
        .unwrap()
}

fn inspect(node: &Node, c: &dm_rpc::Client, data: Vec<u8>) -> (u64, bool, u64) {
    inspect_arg(c, arg(node, false, data))
}

/// What `inspect` answers for argument `p`.
fn inspect_arg(c: &dm_rpc::Client, p: Payload) -> (u64, bool, u64) {
    inspected(&c.call("inspect", p).unwrap().to_vec().unwrap())
}

/// `inspect`'s answer: the argument's length, whether it came by Ref, its hash.
fn inspected(r: &[u8]) -> (u64, bool, u64) {
    (
        u64::from_le_bytes(r[..8].try_into().unwrap()),
        r[8] == 1,
        u64::from_le_bytes(r[9..17].try_into().unwrap()),
    )
}

/// A call's argument: bytes, or (`remote`, above the node's threshold) a
/// buffer written on the node's memory server.
#[cfg(feature = "memserver")]
fn arg(node: &Node, remote: bool, data: Vec<u8>) -> Payload {
    match node.memserver() {
        Some(m) if remote && data.len() > node.config().inline_max => {
            use dm_pool::{Dm, DmBuffer};
            let mut b = m.alloc(data.len() as u64).unwrap();
            b.write(0, &data).unwrap();
            Payload::from_mem_buffer(b)
        }
        _ => Payload::from_vec(data),
    }
}

#[cfg(not(feature = "memserver"))]
fn arg(_: &Node, _: bool, data: Vec<u8>) -> Payload {
    Payload::from_vec(data)
}

fn contract(t: Transport) {
    let tp = pool();
    let node = Node::new(tp.attach());
    run_contract(&node, &node, &t, false, false);
    drop(node);
    tp.assert_clean();
}

/// The contract between a server on `snode` and clients on `node` (the
/// same node, or one in another pool reaching the server by its TCP
/// address when `direct`); with `remote`, the clients' large arguments are
/// buffers on their memory server.
fn run_contract(snode: &Node, node: &Node, t: &Transport, direct: bool, remote: bool) {
    let name = unique("contract");
    let svc = spawn_svc(snode, &name, t);
    let addr = svc.tcp_addr().map(str::to_owned);
    let connect = || match (direct, &addr) {
        (true, Some(a)) => node.connect_tcp(a),
        _ => node.connect(&name),
    };
    let c = connect().unwrap();

    // Size-aware: inline up to the threshold, by Ref above; same answers.
    let th = node.config().inline_max;
    for len in [0usize, 1, 100, th, th + 1, 1 << 20, (4 << 20) + 123] {
        let data = pattern(len, len as u8);
        let want = sum(&Payload::from_vec(data.clone()));
        let (l, in_pool, h) = inspect_arg(&c, arg(node, remote, data.clone()));
        assert_eq!((l, h), (len as u64, want), "len {len}");
        assert_eq!(in_pool, len > th, "len {len} travelled the wrong way");
        // The same from a borrowed slice (copied once, into the pool when
        // large and the server shares it).
        let r = c.call_slice("inspect", &data).unwrap().to_vec().unwrap();
        assert_eq!(
            inspected(&r),
            (len as u64, len > th, want),
            "slice of {len}"
        );
        let back = c.call("echo", arg(node, remote, data.clone())).unwrap();
        assert_eq!(back.len(), len as u64);
        assert_eq!(back.in_pool() || back.is_remote(), len > th);
        assert!(
            back.to_vec().unwrap() == data,
            "echo of {len} bytes differs"
        );
    }
    // A buffer written in the pool goes by Ref with no copy.
    let mut b = node.pool().alloc(3 << 20).unwrap();
    b.write(5, b"hello").unwrap();
    let (l, in_pool, _) = {
        let r = c.call("inspect", b).unwrap().to_vec().unwrap();
        (
            u64::from_le_bytes(r[..8].try_into().unwrap()),
            r[8] == 1,
            (),
        )
    };
    assert_eq!((l, in_pool), (3 << 20, true));

    // Statuses.
    let e = c.call("nope", Payload::empty()).unwrap_err();
    assert_eq!(e.status, Status::NotFound, "{e}");
    // The frame carries only the method's id; the caller names it.
    assert!(e.message.contains("no method \"nope\""), "{e}");
    let e = c.call("fail", Payload::empty()).unwrap_err();
    assert_eq!(
        (e.status, e.message.as_str()),
        (Status::InvalidArgument, "no thanks")
    );
    let e = c.call("panic", Payload::empty()).unwrap_err();
    assert_eq!(e.status, Status::Internal);
    assert!(e.message.contains("handler bug"), "{e}");
    let e = node.connect(&unique("absent")).unwrap_err();
    assert_eq!(e.status, Status::NotFound);
    let e = node.connect("bad//name").unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument);
    // The connection still works after errors.
    assert_eq!(inspect(node, &c, vec![1, 2, 3]).0, 3);

    // Deadlines: the caller stops waiting; a queued call is skipped.
    let t0 = Instant::now();
    let e = c
        .call_with(
            "sleep",
            Payload::from_vec(300u64.to_le_bytes().to_vec()),
            CallOptions::deadline(Duration::from_millis(50)),
        )
        .unwrap_err();
    assert_eq!(e.status, Status::DeadlineExceeded);
    assert!(
        t0.elapsed() < Duration::from_millis(250),
        "took {:?}",
        t0.elapsed()
    );
    let e = c
        .call_with(
            "inspect",
            Payload::from_vec(vec![1]),
            CallOptions::deadline(Duration::from_millis(20)),
        )
        .unwrap_err();
    assert_eq!(
        e.status,
        Status::DeadlineExceeded,
        "queued behind the sleep"
    );
    // After the sleep, the connection serves again (late answers dropped).
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(inspect(node, &c, vec![9; 10]).0, 10);
    assert!(
        svc.stats().expired.load(Ordering::Relaxed) + svc.stats().cancelled.load(Ordering::Relaxed)
            >= 1,
        "the expired call was run anyway"
    );

    // Concurrent calls on one connection and on several.
    let c2 = connect().unwrap();
    std::thread::scope(|s| {
        for k in 0..4u8 {
            let cl = if k % 2 == 0 { c.clone() } else { c2.clone() };
            let node = &node;
            s.spawn(move || {
                for i in 0..200usize {
                    let len = if i % 10 == 0 { 100_000 } else { i * 13 };
                    let data = pattern(len, k);
                    let want = sum(&Payload::from_vec(data.clone()));
                    let got = inspect_arg(&cl, arg(node, remote, data));
                    assert_eq!(got, (len as u64, len > th, want));
                }
            });
        }
    });
    drop((c, c2));
    svc.shutdown();
    let e = connect().unwrap_err();
    let gone = if direct {
        Status::Unavailable
    } else {
        Status::NotFound
    };
    assert_eq!(e.status, gone, "a stopped service is gone");
}

/// The contract with a memory server behind both nodes: over TCP between
/// two pools (two hosts, in effect), or over `t` within one pool; the
/// client's large arguments are written on the memory server, and travel
/// as its Refs where both ends use it (TCP, in-process queues) or are
/// read and passed through the pool (shared-memory rings, whose ends share
/// only the pool).
#[cfg(feature = "memserver")]
fn contract_with_memory_server(t: Transport, between_pools: bool) {
    let ms = dm_memserver::Server::start(dm_memserver::Config::default()).unwrap();
    let mem = || dm_memserver::MemPool::connect(&[ms.addr().to_string()]).unwrap();
    let (ps, pc) = (pool(), pool());
    // The threshold, not the learned choice: the contract checks which
    // way payloads go.
    let cfg = dm_rpc::Config {
        remote_choice: dm_rpc::RemoteChoice::Threshold,
        ..dm_rpc::Config::default()
    };
    let snode = Node::with_config(ps.attach(), cfg).with_memserver(mem());
    let cnode = if between_pools {
        Node::with_config(pc.attach(), cfg).with_memserver(mem())
    } else {
        snode.clone()
    };
    run_contract(&snode, &cnode, &t, between_pools, true);
    drop((snode, cnode));
    for _ in 0..200 {
        if ms.state().usage().refs == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let u = ms.state().usage();
    assert_eq!(
        (u.refs, u.pages_held),
        (0, 0),
        "Refs left on the memory server: {u:?}"
    );
    assert!(ms.state().check().is_empty());
    let m = &ms.state().metrics;
    assert!(m.requests_of("write") > 0, "no argument was written there");
    // Where both ends use the memory server, its Refs travel; shared-memory
    // rings pass such an argument through the pool.
    let refs = m.requests_of("create_ref") + m.requests_of("put") + m.requests_of("stream_put");
    assert_eq!(
        refs > 0,
        t != Transport::Shm,
        "{refs} memory-server Refs made"
    );
    ps.assert_clean();
    pc.assert_clean();
}

#[test]
#[cfg(feature = "memserver")]
fn contract_over_tcp_between_pools_with_a_memory_server() {
    // Payloads above the threshold travel as memory-server Refs, both ways.
    contract_with_memory_server(Transport::Tcp("127.0.0.1:0".into()), true);
}

#[test]
#[cfg(feature = "memserver")]
fn contract_over_shm_with_a_memory_server() {
    contract_with_memory_server(Transport::Shm, false);
}

#[test]
#[cfg(feature = "memserver")]
fn contract_over_mem_with_a_memory_server() {
    contract_with_memory_server(Transport::Mem, false);
}

#[test]
#[cfg(feature = "memserver")]
fn contract_over_tcp_with_a_memory_server() {
    contract_with_memory_server(Transport::Tcp("127.0.0.1:0".into()), false);
}

#[test]
fn contract_over_shm() {
    contract(Transport::Shm);
}

#[test]
fn contract_over_mem() {
    contract(Transport::Mem);
}

#[test]
fn contract_over_tcp() {
    contract(Transport::Tcp("127.0.0.1:0".into()));
}

fn nested(t: Transport) {
    let tp = pool();
    let node = Node::new(tp.attach());
    let base = unique("nested");
    let hops = 6;
    // Hop k forwards the payload it got to hop k+1 without touching it; the
    // last one answers with its hash and the Ref it saw.
    let mut servers = Vec::new();
    for k in (0..hops).rev() {
        let me = format!("{base}/h{k}");
        let next = format!("{base}/h{}", k + 1);
        let last = k == hops - 1;
        let n = node.clone();
        let next_client = std::sync::OnceLock::new();
        let s = node
            .server(&me)
            .transport(t.clone())
            .method("go", move |c| {
                if last {
                    let mut out = sum(c.payload()).to_le_bytes().to_vec();
                    if let Some(r) = c.payload().as_ref_handle() {
                        out.extend_from_slice(&r.to_bytes());
                    }
                    return Ok(Payload::from_vec(out));
                }
                let cl = next_client.get_or_init(|| n.connect(&next).unwrap());
                cl.call("go", c.payload().forward()?)
            })
            .spawn()
            .unwrap();
        servers.push(s);
    }
    let c = node.connect(&format!("{base}/h0")).unwrap();
    let data = pattern(8 << 20, 3);
    let want = sum(&Payload::from_vec(data.clone()));
    let mut b = node.pool().alloc(data.len() as u64).unwrap();
    b.write(0, &data).unwrap();
    let before = node.pool().counters();
    let got = c.call("go", b).unwrap().to_vec().unwrap();
    assert_eq!(u64::from_le_bytes(got[..8].try_into().unwrap()), want);
    assert_eq!(got.len(), 8 + dm_pool::Ref::SIZE, "the last hop got a Ref");
    let after = node.pool().counters();
    assert_eq!(
        after.refs_created - before.refs_created,
        1,
        "one Ref made by the caller, forwarded by {hops} hops"
    );
    assert_eq!(after.cow_copies, before.cow_copies, "nobody copied a page");
    // Small payloads go inline through the same chain.
    let got = c.call("go", vec![5u8; 10]).unwrap().to_vec().unwrap();
    assert_eq!(got.len(), 8);
    drop(c);
    drop(servers);
    drop(node);
    tp.assert_clean();
}

#[test]
fn nested_forwarding_over_shm() {
    nested(Transport::Shm);
}

#[test]
fn nested_forwarding_over_mem() {
    nested(Transport::Mem);
}

#[test]
fn nested_forwarding_over_tcp() {
    nested(Transport::Tcp("127.0.0.1:0".into()));
}

/// A pool buffer (here an answer that arrived by Ref) forwarded into
/// another call: its pages are shared again, not copied, and the original
/// stays readable.
#[test]
fn an_answer_is_forwarded_by_sharing_its_pages() {
    let tp = pool();
    let node = Node::new(tp.attach());
    let name = unique("fwd-answer");
    let svc = spawn_svc(&node, &name, &Transport::Shm);
    let c = node.connect(&name).unwrap();
    let data = pattern(1 << 20, 9);
    let want = sum(&Payload::from_vec(data.clone()));
    let answer = c.call("echo", data).unwrap();
    assert!(answer.in_pool(), "a 1 MiB answer arrives by Ref");
    let before = node.pool().counters();
    let (len, by_ref, hash) = {
        let r = c.call("inspect", answer.forward().unwrap()).unwrap();
        let r = r.to_vec().unwrap();
        (
            u64::from_le_bytes(r[..8].try_into().unwrap()),
            r[8] == 1,
            u64::from_le_bytes(r[9..17].try_into().unwrap()),
        )
    };
    assert_eq!((len, by_ref, hash), (1 << 20, true, want));
    assert_eq!(node.pool().counters().cow_copies, before.cow_copies);
    assert_eq!(sum(&answer), want, "the forwarded answer is unchanged");
    drop((answer, c, svc, node));
    tp.assert_clean();
}

#[test]
fn tcp_between_pools_passes_by_value() {
    // A client attached to another pool (another host, in effect): every
    // payload travels inline, by value, both ways, whatever its size.
    let server_pool = pool();
    let client_pool = pool();
    let snode = Node::new(server_pool.attach());
    let name = unique("by-value");
    let svc = spawn_svc(&snode, &name, &Transport::Tcp("127.0.0.1:0".into()));
    let addr = svc.tcp_addr().unwrap().to_owned();
    let cnode = Node::new(client_pool.attach());
    assert_eq!(
        cnode.connect(&name).unwrap_err().status,
        Status::NotFound,
        "not in this pool's registry"
    );
    let c = cnode.connect_tcp(&addr).unwrap();
    for len in [10usize, 100_000, 1 << 20, (4 << 20) + 123] {
        let data = pattern(len, 9);
        let (l, in_pool, h) = inspect(&cnode, &c, data.clone());
        assert_eq!(
            (l, in_pool, h),
            (len as u64, false, sum(&Payload::from_vec(data.clone())))
        );
        let back = c.call("echo", data.clone()).unwrap();
        assert!(!back.in_pool());
        assert!(back.to_vec().unwrap() == data);
    }
    // Large requests and answers back to back on one connection.
    std::thread::scope(|sc| {
        for k in 0..3u8 {
            let c = &c;
            sc.spawn(move || {
                for _ in 0..5 {
                    let data = pattern((1 << 20) + k as usize * 4099, k);
                    let back = c.call("echo", data.clone()).unwrap();
                    assert!(back.to_vec().unwrap() == data);
                }
            });
        }
    });
    // A buffer built in the client's pool is sent by value too.
    let mut b = cnode.pool().alloc(100_000).unwrap();
    b.write(0, &[1; 100_000]).unwrap();
    assert!(
        !inspect_payload(&c, Payload::from_buffer(b)).1,
        "sent by value"
    );
    drop(c);
    drop(svc);
    drop((snode, cnode));
    server_pool.assert_clean();
    client_pool.assert_clean();
}

fn inspect_payload(c: &dm_rpc::Client, p: Payload) -> (u64, bool) {
    let r = c.call("inspect", p).unwrap().to_vec().unwrap();
    (u64::from_le_bytes(r[..8].try_into().unwrap()), r[8] == 1)
}

#[test]
fn malformed_bytes_on_tcp_drop_only_that_connection() {
    use std::io::{Read, Write};
    let (tp, node, svc, addr) = tcp_service("tcp-garbage");
    let good = node.connect_tcp(&addr).unwrap();
    let mut hello = b"DMRPCTCP".to_vec();
    hello.extend_from_slice(&0u64.to_le_bytes());
    let mut bad_frame = dm_rpc::Frame::request(1, 1, 0, dm_rpc::Body::None).encode();
    bad_frame[2] = 99; // unknown version
    let mut oversized =
        dm_rpc::Frame::request(1, 1, 0, dm_rpc::Body::Inline(vec![1].into())).encode();
    oversized[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
    let cases: [(&str, Vec<u8>); 4] = [
        ("bad hello", b"GET / HTTP/1.1\r\n\r\n".to_vec()),
        ("bad version", [hello.clone(), bad_frame].concat()),
        ("oversized length", [hello.clone(), oversized].concat()),
        (
            "random bytes",
            [hello.clone(), (0..255u8).collect()].concat(),
        ),
    ];
    for (what, bytes) in cases {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.write_all(&bytes).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        // The server answers the hello (if any) and then closes.
        let mut sink = Vec::new();
        let r = s.read_to_end(&mut sink);
        // Closed (EOF), or reset because it left our bytes unread.
        let closed = match &r {
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        };
        assert!(closed, "{what}: connection not closed: {r:?}");
        assert_eq!(inspect(&node, &good, vec![4; 4]).0, 4, "{what}");
    }
    drop(good);
    close(tp, node, svc);
}

/// The test service on TCP in a fresh pool: the pool, the node, the
/// server and its address.
fn tcp_service(tag: &str) -> (TempPool, Node, dm_rpc::Server, String) {
    let tp = pool();
    let node = Node::new(tp.attach());
    let svc = spawn_svc(&node, &unique(tag), &Transport::Tcp("127.0.0.1:0".into()));
    let addr = svc.tcp_addr().unwrap().to_owned();
    (tp, node, svc, addr)
}

/// Stops the server, detaches, and checks the pool is clean.
fn close(tp: TempPool, node: Node, svc: dm_rpc::Server) {
    drop(svc);
    drop(node);
    tp.assert_clean();
}

/// A raw TCP client of `addr` that has said hello (as a peer without a
/// pool: every payload inline): its hello (pool 0, no memory servers, a
/// nonce), the server's hello and proof, its own (empty) proof.
fn raw_tcp_client(addr: &str) -> std::net::TcpStream {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    use dm_rpc::raw::tcp::{HELLO, HELLO_LEN, PROOFS_LEN};
    let mut hello = HELLO.to_vec();
    hello.resize(HELLO_LEN, 0);
    s.write_all(&hello).unwrap();
    let mut theirs = [0u8; HELLO_LEN + PROOFS_LEN];
    s.read_exact(&mut theirs).unwrap();
    assert_eq!(&theirs[..8], &HELLO);
    s.write_all(&[0u8; PROOFS_LEN]).unwrap();
    s
}

/// Reads one whole frame from `s`.
fn read_frame(s: &mut std::net::TcpStream, buf: &mut Vec<u8>) -> dm_rpc::Frame {
    use std::io::Read;
    let limits = dm_rpc::frame::Limits::default();
    loop {
        if let Some((f, used)) = dm_rpc::Frame::decode(buf, &limits).unwrap() {
            buf.drain(..used);
            return f;
        }
        let mut chunk = vec![0u8; 1 << 20];
        let n = s.read(&mut chunk).unwrap();
        assert!(n > 0, "closed mid-frame");
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[test]
fn a_tcp_client_that_sends_many_large_requests_before_reading_is_served() {
    use std::io::Write;
    let (tp, node, svc, addr) = tcp_service("tcp-pipelined");
    let mut s = raw_tcp_client(&addr);
    // Twelve 4 MiB echoes written back to back before any answer is read:
    // the answers fill the socket while the requests are still coming, so
    // the server must read ahead while it waits for room.
    let echo = dm_rpc::frame::method_id("echo");
    let n = 12u64;
    let data: Vec<Vec<u8>> = (0..n).map(|k| vec![k as u8 + 1; 4 << 20]).collect();
    let mut bytes = Vec::new();
    for (k, d) in data.iter().enumerate() {
        dm_rpc::Frame::request(
            k as u64 + 1,
            echo,
            0,
            dm_rpc::Body::Inline(d.clone().into()),
        )
        .encode_into(&mut bytes);
    }
    s.write_all(&bytes).unwrap();
    let mut buf = Vec::new();
    for k in 0..n {
        let f = read_frame(&mut s, &mut buf);
        assert_eq!(f.call_id, k + 1);
        assert_eq!(f.status, dm_rpc::Status::Ok);
        assert_eq!(
            f.payload,
            dm_rpc::Body::Inline(data[k as usize].clone().into())
        );
    }
    drop(s);
    close(tp, node, svc);
}

#[test]
fn a_tcp_connection_that_never_says_hello_is_dropped_and_others_are_served() {
    use std::io::{Read, Write};
    let (tp, node, svc, addr) = tcp_service("tcp-silent");
    let mut silent = std::net::TcpStream::connect(&addr).unwrap();
    let mut half = std::net::TcpStream::connect(&addr).unwrap();
    half.write_all(&dm_rpc::raw::tcp::HELLO[..5]).unwrap(); // a start
    let t = Instant::now();
    let good = node.connect_tcp(&addr).unwrap();
    for _ in 0..50 {
        assert_eq!(inspect(&node, &good, vec![4; 4]).0, 4);
    }
    for s in [&mut silent, &mut half] {
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut b = [0u8; 8];
        let r = s.read(&mut b);
        assert!(
            matches!(r, Ok(0)) || r.is_err(),
            "still open after {:?}: {r:?}",
            t.elapsed()
        );
    }
    // The hello timeout is 5 s.
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_secs(4) && waited < Duration::from_secs(15),
        "{waited:?}"
    );
    assert_eq!(inspect(&node, &good, vec![4; 4]).0, 4);
    drop(good);
    close(tp, node, svc);
}

#[test]
fn a_tcp_client_that_never_reads_its_answers_is_dropped_and_others_are_served() {
    use std::io::{Read, Write};
    let (tp, node, svc, addr) = tcp_service("tcp-deaf");
    let good = node.connect_tcp(&addr).unwrap();
    let mut deaf = raw_tcp_client(&addr);
    // Far more answers than the sockets hold, and more requests than the
    // server reads ahead: the server gives up on this client after its
    // reply timeout and closes the connection. (The kernel's buffers on
    // loopback take a lot: 20 to 50 of these were sent before the close
    // in runs here, so 64 was too few to tell.)
    let echo = dm_rpc::frame::method_id("echo");
    let req = |k: u64| {
        dm_rpc::Frame::request(k, echo, 0, dm_rpc::Body::Inline(vec![7; 4 << 20].into())).encode()
    };
    deaf.set_write_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let t = Instant::now();
    let mut sent = 0u64;
    let n = 256;
    for k in 1..=n {
        if deaf.write_all(&req(k)).is_err() {
            break;
        }
        sent += 1;
    }
    assert!(
        sent < n,
        "the server kept reading a client that never reads ({:?})",
        t.elapsed()
    );
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
    // The connection is gone (what it answered before that may be read).
    deaf.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut sink = vec![0u8; 1 << 20];
    loop {
        match deaf.read(&mut sink) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => {
                assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
                break;
            }
        }
    }
    assert_eq!(inspect(&node, &good, vec![4; 4]).0, 4);
    drop(good);
    close(tp, node, svc);
}

#[test]
fn idle_server_parks_and_wakes() {
    // With a park-only policy every call needs a futex wake: calls still
    // complete, and a parked server is woken by a client's first call.
    let tp = pool();
    let node = Node::with_config(
        tp.attach(),
        Config {
            wait: WaitPolicy::park_only(),
            ..Default::default()
        },
    );
    let name = unique("park");
    let svc = spawn_svc(&node, &name, &Transport::Shm);
    std::thread::sleep(Duration::from_millis(50));
    let c = node.connect(&name).unwrap();
    for i in 0..200usize {
        assert_eq!(inspect(&node, &c, vec![1; i]).0, i as u64);
    }
    drop(c);
    drop(svc);
    drop(node);
    tp.assert_clean();
}

/// A pool whose rings (4 KiB) hold a frame or two of a kilobyte.
fn small_rings() -> TempPool {
    TempPool::with(PoolConfig {
        size: 64 << 20,
        ring_size: 4096,
        channels: Some(8),
        ..Default::default()
    })
}

/// [`small_rings`], and a node that sends every payload inline (up to
/// what a ring carries).
fn small_rings_inline() -> (TempPool, Node) {
    let tp = small_rings();
    let cfg = Config {
        inline_max: usize::MAX,
        ..Default::default()
    };
    let node = Node::with_config(tp.attach(), cfg);
    (tp, node)
}

#[test]
fn a_client_that_stops_reading_does_not_stall_others() {
    // The raw transport lets a client send without reading answers: its
    // response ring fills, the server stops reading its requests
    // (back-pressure), and serves everyone else.
    let tp = small_rings();
    let node = Node::new(tp.attach());
    let name = unique("greedy");
    let svc = spawn_svc(&node, &name, &Transport::Shm);
    let info = node.pool().lookup(&name).unwrap().unwrap();
    let mut greedy = dm_rpc::raw::shm::connect(node.pool(), &info, WaitPolicy::default()).unwrap();
    let frame = dm_rpc::Frame::request(
        1,
        dm_rpc::frame::method_id("echo"),
        0,
        dm_rpc::Body::Inline(vec![0; 1000].into()),
    );
    let mut sent = 0;
    let until = Instant::now() + Duration::from_millis(500);
    while Instant::now() < until {
        match greedy
            .tx
            .send(&frame, Some(Instant::now() + Duration::from_millis(5)))
        {
            Ok(true) => sent += 1,
            Ok(false) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(sent >= 2, "the greedy client could send only {sent}");
    let c = node.connect(&name).unwrap();
    for i in 0..50usize {
        assert_eq!(inspect(&node, &c, vec![1; i]).0, i as u64);
    }
    drop(greedy);
    drop(c);
    drop(svc);
    drop(node);
    tp.assert_clean();
}

/// A server that starts a response ring's next lap early (its client had
/// read everything, and the ring's producer stood past the hot window)
/// still keeps the room it promised for the other answers it owes: the
/// bytes the early lap skips stay taken until the client reads on, so
/// without that room kept an owed answer would wait for a client that
/// does not read, and the server with it. Default 256 KiB rings: nine
/// 8 000-byte answers, read one by one, leave the producer at 72 576,
/// past the 64 KiB window; the first of two calls taken then answers
/// 60 000 bytes, which would fit before that place, but with the room
/// kept for the second's (small) answer it does not, so no lap starts
/// early and the second answer fits after it while the client reads
/// nothing.
#[test]
fn a_lap_started_early_keeps_the_room_promised_for_answers_owed() {
    use dm_rpc::{frame::method_id, Body, Frame};
    use std::sync::Arc;
    let tp = common::pool();
    let node = Node::new(tp.attach());
    let name = unique("keep");
    let gates = Arc::new([tokio::sync::Notify::new(), tokio::sync::Notify::new()]);
    let g = gates.clone();
    // Both answer as many bytes as the request's first four say; `gated`
    // first waits for the gate its fifth names.
    let len = |b: &[u8]| u32::from_le_bytes(b[..4].try_into().unwrap()) as usize;
    let svc = node
        .server(&name)
        .method("sized", move |c| {
            Ok(Payload::from_vec(vec![1; len(&c.payload().to_vec()?)]))
        })
        .method_async("gated", move |c| {
            let g = g.clone();
            async move {
                let b = c.payload.to_vec()?;
                g[b[4] as usize].notified().await;
                Ok(Payload::from_vec(vec![2; len(&b)]))
            }
        })
        .spawn()
        .unwrap();
    let info = node.pool().lookup(&name).unwrap().unwrap();
    let mut raw = dm_rpc::raw::shm::connect(node.pool(), &info, WaitPolicy::default()).unwrap();
    let ask = |id: u64, method: &str, n: u32, gate: u8| {
        let mut b = n.to_le_bytes().to_vec();
        b.push(gate);
        Frame::request(id, method_id(method), 0, Body::Inline(b.into()))
    };
    let soon = || Some(Instant::now() + Duration::from_secs(10));
    for id in 1..=9 {
        assert!(raw.tx.send(&ask(id, "sized", 8000, 0), soon()).unwrap());
        let f = raw.rx.recv(soon()).unwrap().expect("an answer");
        assert!(matches!(&f.payload, Body::Inline(b) if b.len() == 8000));
    }
    assert!(raw.tx.send(&ask(10, "gated", 60_000, 0), soon()).unwrap());
    assert!(raw.tx.send(&ask(11, "gated", 16_000, 1), soon()).unwrap());
    // Both taken (their handlers wait at their gates), then answered in
    // turn; the client reads nothing meanwhile.
    std::thread::sleep(Duration::from_millis(200));
    gates[0].notify_one();
    gates[1].notify_one();
    // The server is not stuck on the second answer: another client is
    // served.
    let c = node.connect(&name).unwrap();
    let opts = CallOptions::deadline(Duration::from_secs(5));
    let got = c
        .call_with("sized", Payload::from_vec(vec![8, 0, 0, 0]), opts)
        .unwrap();
    assert_eq!(got.to_vec().unwrap(), vec![1; 8]);
    for (id, n) in [(10, 60_000), (11, 16_000)] {
        let f = raw.rx.recv(soon()).unwrap().expect("an answer");
        assert_eq!(f.call_id, id);
        assert!(
            matches!(&f.payload, Body::Inline(b) if b.len() == n),
            "{id}"
        );
    }
    drop((raw, c));
    svc.shutdown();
    drop(node);
    tp.assert_clean();
}

#[test]
fn a_server_waiting_for_room_for_an_answer_wakes_when_the_client_reads() {
    // A server takes a request only when its connection has room for the
    // largest answer it may send. Here (a 4 KiB ring) that is only when the
    // response ring is empty: after answering the first of three pipelined
    // requests it parks, with a park slice of a minute, until the client
    // reads that answer. Reading must wake it (it used to wait out the
    // slice: the client rang a bell nobody waited on).
    let tp = small_rings();
    let node = Node::with_config(
        tp.attach(),
        Config {
            wait: WaitPolicy {
                park_slice: Duration::from_secs(60),
                ..WaitPolicy::park_only()
            },
            ..Default::default()
        },
    );
    let name = unique("room");
    let svc = spawn_svc(&node, &name, &Transport::Shm);
    let info = node.pool().lookup(&name).unwrap().unwrap();
    let mut conn = dm_rpc::raw::shm::connect(node.pool(), &info, WaitPolicy::default()).unwrap();
    for id in 1..=3u64 {
        let frame = dm_rpc::Frame::request(
            id,
            dm_rpc::frame::method_id("echo"),
            0,
            dm_rpc::Body::Inline(vec![id as u8; 100].into()),
        );
        assert!(conn.tx.send(&frame, None).unwrap());
    }
    // Let the server answer the first and park for room.
    std::thread::sleep(Duration::from_millis(200));
    for id in 1..=3u64 {
        let deadline = Instant::now() + Duration::from_secs(10);
        let f = conn.rx.recv(Some(deadline)).unwrap();
        let f = f.unwrap_or_else(|| panic!("answer {id} did not come within 10 s"));
        assert_eq!(f.call_id, id);
        match f.payload {
            dm_rpc::Body::Inline(b) => assert_eq!(b, vec![id as u8; 100]),
            other => panic!("answer {id}: {other:?}"),
        }
    }
    drop(conn);
    drop(svc);
    drop(node);
    tp.assert_clean();
}

type Scribble<'a> = Box<dyn Fn(&mut dm_rpc::raw::shm::RawConnection) + 'a>;

#[test]
fn malformed_frames_drop_only_that_connection() {
    let tp = pool();
    let node = Node::new(tp.attach());
    let name = unique("garbage");
    let svc = spawn_svc(&node, &name, &Transport::Shm);
    let good = node.connect(&name).unwrap();
    assert_eq!(inspect(&node, &good, vec![1; 5]).0, 5);
    let info = node.pool().lookup(&name).unwrap().unwrap();
    let mut frame =
        dm_rpc::Frame::request(7, dm_rpc::frame::method_id("echo"), 0, dm_rpc::Body::None).encode();
    frame[0] = 0; // bad magic
    let cases: [(&str, Scribble); 4] = [
        ("bad magic", Box::new(|r| assert!(r.push(&frame)))),
        (
            "truncated frame",
            Box::new(|r| assert!(r.push(&frame[..20]))),
        ),
        (
            "trailing bytes",
            Box::new(|r| {
                let mut f = dm_rpc::Frame::request(1, 1, 0, dm_rpc::Body::None).encode();
                f.extend_from_slice(&[1, 2, 3]);
                assert!(r.push(&f));
            }),
        ),
        (
            "record past the ring",
            Box::new(|r| r.scribble_header(u32::MAX / 2)),
        ),
    ];
    for (what, make) in cases {
        let mut raw = dm_rpc::raw::shm::RawConnection::open(node.pool(), &info).unwrap();
        make(&mut raw);
        // The server drops that connection...
        let t0 = Instant::now();
        while !raw.closed_by_server() {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "{what}: connection not dropped"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // ...and keeps serving the others.
        assert_eq!(inspect(&node, &good, vec![2; 7]).0, 7, "{what}");
    }
    drop(good);
    drop(svc);
    drop(node);
    tp.assert_clean();
}

#[test]
fn a_reused_channel_carries_nothing_of_the_previous_connection() {
    // Channels are reused after both ends close; records left in the rings
    // must never be taken for the new connection's (its call ids start
    // over, so a stale answer would match).
    let tp = TempPool::with(PoolConfig {
        size: 64 << 20,
        channels: Some(1),
        ..Default::default()
    });
    let node = Node::new(tp.attach());
    for round in 0..3u8 {
        let name = unique("reuse");
        let svc = node
            .server(&name)
            .method("who", move |_| Ok(Payload::from_vec(vec![round])))
            .spawn()
            .unwrap();
        let c = node.connect(&name).unwrap();
        for _ in 0..100 {
            assert_eq!(
                c.call("who", Payload::empty()).unwrap().to_vec().unwrap(),
                [round]
            );
        }
        assert_eq!(svc.stats().calls.load(Ordering::Relaxed), 100);
        drop(c);
        svc.shutdown();
    }
    drop(node);
    tp.assert_clean();
}

/// A client that finds every channel of the pool in use waits while one
/// is being closed: a connection just dropped frees its channel only when
/// its server next looks, which a server busy in a handler does only
/// after it. With none closing, the dial is refused at once.
#[test]
fn a_dial_waits_for_a_channel_being_closed() {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    let tp = TempPool::with(PoolConfig {
        size: 64 << 20,
        channels: Some(2),
        ..Default::default()
    });
    let node = Node::new(tp.attach());
    let name = unique("busy");
    let busy = Arc::new(AtomicBool::new(false));
    let b2 = busy.clone();
    let svc = node
        .server(&name)
        .method("slow", move |_| {
            b2.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(300));
            Ok(Payload::empty())
        })
        .method("who", |_| Ok(Payload::from_vec(b"me".to_vec())))
        .spawn()
        .unwrap();
    let a = node.connect(&name).unwrap();
    let b = node.connect(&name).unwrap();
    for c in [&a, &b] {
        assert_eq!(
            c.call("who", Payload::empty()).unwrap().to_vec().unwrap(),
            b"me"
        );
    }
    let e = node.connect(&name).unwrap_err();
    assert_eq!(e.status, Status::ResourceExhausted, "{e}");
    // The error says how many channels there are and how to get more.
    assert!(e.message.contains("all 2 channels"), "{e}");
    assert!(e.message.contains("--channels"), "{e}");
    assert_eq!(node.pool().channels_closing().soon, 0);
    let slow = std::thread::spawn(move || a.call("slow", Payload::empty()).map(|_| a));
    while !busy.load(Ordering::SeqCst) {
        std::thread::yield_now();
    }
    drop(b); // its server, in the handler, cannot notice yet
    assert_eq!(node.pool().channels_closing().soon, 1);
    let c = node.connect(&name).unwrap();
    assert_eq!(
        c.call("who", Payload::empty()).unwrap().to_vec().unwrap(),
        b"me"
    );
    let a = slow.join().unwrap().unwrap();
    drop((a, c));
    svc.shutdown();
    drop(node);
    tp.assert_clean();
}

/// A server that answers and at once closes the connection (it stops, or
/// dies, just after its last answers): those answers are read before the
/// close is reported, by `check_peer` (the async client's liveness look)
/// as by `recv`, and only then is the server's end gone. (A client that
/// looked at the ring just before the answers came and at the channel
/// just after the close used to fail those calls `Unavailable` with
/// their answers unread, although the server had run them.)
#[test]
fn answers_sent_before_the_server_closed_are_read_first() {
    use dm_rpc::raw::{shm, Listener};
    use dm_rpc::{Body, Frame};
    use std::sync::{atomic::AtomicBool, Arc};
    let tp = pool();
    let node = Node::new(tp.attach());
    let svc = node
        .pool()
        .register(&unique("closing"), &dm_pool::Endpoint::Shm)
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let policy = WaitPolicy::default();
    let max = dm_rpc::DEFAULT_INLINE_MAX;
    let mut l = shm::ShmListener::new(node.pool(), svc.clone(), policy, stop, max).unwrap();
    let mut conn = shm::connect(node.pool(), &svc, policy).unwrap();
    let method = dm_rpc::frame::method_id("noop");
    for id in 1..=3 {
        let req = Frame::request(id, method, 0, Body::None);
        assert!(conn.tx.send(&req, None).unwrap());
    }
    let soon = || Some(Instant::now() + Duration::from_secs(5));
    for id in 1..=3 {
        let (c, f) = l.next(soon()).unwrap().expect("a request");
        assert_eq!(f.call_id, id);
        let body = Body::Inline(vec![id as u8].into());
        l.reply(c, &Frame::response(id, Status::Ok, body)).unwrap();
    }
    drop(l); // closes the server's end of every connection
    for id in 1..=3 {
        conn.rx.check_peer().expect("answers are waiting");
        let f = conn.rx.recv(soon()).unwrap().expect("an answer");
        assert_eq!((f.call_id, f.status), (id, Status::Ok));
    }
    let e = conn.rx.check_peer().unwrap_err();
    assert!(e.to_string().contains("closed the connection"), "{e}");
    assert!(conn.rx.recv(soon()).is_err());
    drop(conn);
    node.pool().unregister(&svc).unwrap();
    drop(node);
    tp.assert_clean();
}

/// A call whose argument cannot even be copied into the pool (larger than
/// any buffer of it) ends with `InvalidArgument`, and its answer
/// interceptors see that end as they see any other, from every client
/// kind's `call_slice`.
#[test]
fn answer_interceptors_see_a_call_slice_whose_copy_failed() {
    use std::sync::{Arc, Mutex};
    let tp = TempPool::with(PoolConfig {
        size: 8 << 20,
        channels: Some(8),
        ..Default::default()
    });
    let node = Node::new(tp.attach());
    let name = unique("slice");
    let svc = node
        .server(&name)
        .replica()
        .method("len", |c| {
            Ok(Payload::from_vec(c.payload().len().to_le_bytes().to_vec()))
        })
        .spawn()
        .unwrap();
    let ended = Arc::new(Mutex::new(Vec::new()));
    let log = ended.clone();
    let note = move |method: &str, r: &mut Result<dm_rpc::Reply, RpcError>| {
        let status = r.as_ref().map_or_else(|e| e.status, |_| Status::Ok);
        log.lock().unwrap().push((method.to_owned(), status));
    };
    let rt = current_thread_rt();
    let huge = vec![7u8; 16 << 20];
    let c = node.connect(&name).unwrap().intercept_answers(note.clone());
    let ac = node
        .connect_async(&name)
        .unwrap()
        .intercept_answers(note.clone());
    let bc = node
        .connect_balanced(&name)
        .unwrap()
        .intercept_answers(note.clone());
    let abc = node
        .connect_balanced_async(&name)
        .unwrap()
        .intercept_answers(note);
    let too_big = Status::InvalidArgument;
    let e = c.call_slice("len", &huge).unwrap_err();
    assert!(e.to_string().contains("maximum buffer size"), "{e}");
    assert_eq!(e.status, too_big);
    assert_eq!(
        rt.block_on(ac.call_slice("len", &huge)).unwrap_err().status,
        too_big
    );
    assert_eq!(bc.call_slice("len", &huge).unwrap_err().status, too_big);
    assert_eq!(
        rt.block_on(abc.call_slice("len", &huge))
            .unwrap_err()
            .status,
        too_big
    );
    assert!(c.call_slice("len", &huge[..100_000]).is_ok());
    let want: Vec<_> = [too_big, too_big, too_big, too_big, Status::Ok]
        .into_iter()
        .map(|s| ("len".to_owned(), s))
        .collect();
    assert_eq!(*ended.lock().unwrap(), want);
    drop((c, ac, bc, abc));
    drop((svc, rt, node));
    assert_clean_after_pumps(&tp);
}

/// A registry outside any pool (what etcd will be): one map shared by the
/// nodes of two pools, standing for two hosts.
#[derive(Debug, Default)]
struct MapRegistry(std::sync::Mutex<std::collections::HashMap<String, dm_pool::Endpoint>>);

impl dm_rpc::Registry for MapRegistry {
    fn register(
        &self,
        name: &str,
        endpoint: &dm_pool::Endpoint,
    ) -> Result<dm_rpc::registry::Registration, RpcError> {
        let mut m = self.0.lock().unwrap();
        if m.contains_key(name) {
            return Err(RpcError::already_exists("taken"));
        }
        m.insert(name.to_owned(), endpoint.clone());
        Ok(dm_rpc::registry::Registration {
            name: name.to_owned(),
            handle: 0,
        })
    }
    fn unregister(&self, r: &dm_rpc::registry::Registration) -> Result<(), RpcError> {
        self.0.lock().unwrap().remove(&r.name);
        Ok(())
    }
    fn lookup(&self, name: &str) -> Result<Option<dm_rpc::ServiceEntry>, RpcError> {
        Ok(self
            .0
            .lock()
            .unwrap()
            .get(name)
            .map(|e| dm_rpc::ServiceEntry {
                name: name.to_owned(),
                endpoint: e.clone(),
                owner: "test".into(),
                live: true,
                handle: 0,
            }))
    }
    fn list(&self) -> Result<Vec<dm_rpc::ServiceEntry>, RpcError> {
        let names: Vec<String> = self.0.lock().unwrap().keys().cloned().collect();
        Ok(names
            .iter()
            .filter_map(|n| self.lookup(n).ok().flatten())
            .collect())
    }
}

#[test]
fn a_registry_outside_the_pool_finds_tcp_services_across_pools() {
    let reg: std::sync::Arc<dyn dm_rpc::Registry> = std::sync::Arc::new(MapRegistry::default());
    let (pa, pb) = (pool(), pool());
    let server_node = Node::new(pa.attach()).with_registry(reg.clone());
    let client_node = Node::new(pb.attach()).with_registry(reg.clone());
    let name = unique("elsewhere");
    let svc = spawn_svc(&server_node, &name, &Transport::Tcp("127.0.0.1:0".into()));
    assert!(
        server_node.pool().lookup(&name).unwrap().is_none(),
        "a TCP service goes to the node's registry"
    );
    let entry = reg.lookup(&name).unwrap().unwrap();
    assert_eq!(
        entry.endpoint,
        dm_pool::Endpoint::Tcp(svc.tcp_addr().unwrap().into())
    );
    let c = client_node.connect(&name).unwrap();
    let (len, in_pool, _) = inspect(&client_node, &c, vec![1; 50_000]);
    assert_eq!((len, in_pool), (50_000, false), "between pools: by value");
    drop(c);
    svc.shutdown();
    assert!(
        reg.lookup(&name).unwrap().is_none(),
        "unregistered on shutdown"
    );
    assert_eq!(
        client_node.connect(&name).unwrap_err().status,
        Status::NotFound
    );
    drop((server_node, client_node));
    pa.assert_clean();
    pb.assert_clean();
}

/// Clients connecting at the same moment are all accepted: a server that
/// looks at the channels when one client announces itself may find
/// another's channel opened but not yet set up, and must wait for it
/// rather than refuse it.
#[test]
fn clients_connecting_at_once_are_all_accepted() {
    let tp = TempPool::with(PoolConfig {
        size: 64 << 20,
        channels: Some(64),
        ..Default::default()
    });
    let node = Node::new(tp.attach());
    let name = unique("connect-at-once");
    let s = node
        .server(&name)
        .method("echo", |c| Ok(c.take_payload()))
        .spawn()
        .unwrap();
    let (threads, rounds) = (8, 6);
    let barrier = std::sync::Barrier::new(threads);
    std::thread::scope(|sc| {
        for t in 0..threads {
            let (node, name, barrier) = (&node, &name, &barrier);
            sc.spawn(move || {
                for r in 0..rounds {
                    barrier.wait();
                    let c = node.connect(name).unwrap();
                    let v = vec![(t * rounds + r) as u8; 100];
                    let back = c.call("echo", v.clone()).unwrap();
                    assert_eq!(back.to_vec().unwrap(), v);
                }
            });
        }
    });
    drop(s);
    drop(node);
    tp.assert_clean();
}

/// A chain whose callees answer with the payload they were given: the
/// last echoes its request, the others return the answer they got. The
/// request's Ref comes back as it went (flagged as an echo): no hop makes
/// a Ref or copies a page, and the caller's answer reads the data.
fn echo_chain(t: Transport) {
    let tp = pool();
    let node = Node::new(tp.attach());
    let base = unique("echo-chain");
    let hops = 3;
    let mut servers = Vec::new();
    for k in (0..hops).rev() {
        let next = format!("{base}/h{}", k + 1);
        let n = node.clone();
        let next_client = std::sync::OnceLock::new();
        let s = node
            .server(&format!("{base}/h{k}"))
            .transport(t.clone())
            .method("go", move |c| {
                if k == hops - 1 {
                    return Ok(c.take_payload());
                }
                let cl = next_client.get_or_init(|| n.connect(&next).unwrap());
                let back = cl.call("go", c.payload().forward()?)?;
                // What came back is what we forwarded: the same Ref.
                assert_eq!(
                    back.as_ref_handle().map(|r| r.to_bytes()),
                    c.payload().as_ref_handle().map(|r| r.to_bytes())
                );
                Ok(back)
            })
            .spawn()
            .unwrap();
        servers.push(s);
    }
    let c = node.connect(&format!("{base}/h0")).unwrap();
    for len in [3 << 20, 100 << 10] {
        let data = pattern(len, 5);
        let mut b = node.pool().alloc(len as u64).unwrap();
        b.write(0, &data).unwrap();
        let before = node.pool().counters();
        let back = c.call("go", b).unwrap();
        let after = node.pool().counters();
        assert!(back.in_pool());
        assert!(
            back.to_vec().unwrap() == data,
            "{len} bytes came back changed"
        );
        assert_eq!(
            after.refs_created - before.refs_created,
            1,
            "the caller's only"
        );
        assert_eq!(after.cow_copies, before.cow_copies, "nobody copied a page");
        drop(back);
    }
    // Bytes above the threshold: the framework's Ref comes back too.
    let data = pattern(1 << 20, 6);
    let back = c.call("go", data.clone()).unwrap();
    assert!(back.to_vec().unwrap() == data);
    drop((back, c, servers, node));
    tp.assert_clean();
}

#[test]
fn echo_chain_over_shm() {
    echo_chain(Transport::Shm);
}

#[test]
fn echo_chain_over_mem() {
    echo_chain(Transport::Mem);
}

#[test]
fn echo_chain_over_tcp() {
    echo_chain(Transport::Tcp("127.0.0.1:0".into()));
}

/// An echo that arrives after its caller gave up (a hop whose own call to
/// the next timed out) is dropped without releasing the Ref: that Ref is
/// the upstream caller's, still in use.
#[test]
fn a_late_echo_does_not_release_the_upstream_ref() {
    let tp = pool();
    let node = Node::new(tp.attach());
    let base = unique("late-echo");
    let b_name = format!("{base}/b");
    let slow = node
        .server(&b_name)
        .method("slow", |c| {
            std::thread::sleep(Duration::from_millis(60));
            Ok(c.take_payload())
        })
        .method("ping", |_| Ok(Payload::empty()))
        .spawn()
        .unwrap();
    let n = node.clone();
    let a = node
        .server(&format!("{base}/a"))
        .method("go", move |c| {
            let cl = n.connect(&b_name)?;
            let opts = CallOptions::deadline(Duration::from_millis(10));
            let late = cl.call_with("slow", c.payload().forward()?, opts);
            assert_eq!(late.unwrap_err().status, Status::DeadlineExceeded);
            std::thread::sleep(Duration::from_millis(120));
            // Reads the late echo (an orphan) while waiting for this one.
            cl.call("ping", Payload::empty())?;
            Ok(Payload::from_vec(sum(c.payload()).to_le_bytes().to_vec()))
        })
        .spawn()
        .unwrap();
    let c = node.connect(&format!("{base}/a")).unwrap();
    let data = pattern(1 << 20, 8);
    let want = sum(&Payload::from_vec(data.clone()));
    let mut b = node.pool().alloc(data.len() as u64).unwrap();
    b.write(0, &data).unwrap();
    let got = c.call("go", b).unwrap().to_vec().unwrap();
    assert_eq!(u64::from_le_bytes(got[..8].try_into().unwrap()), want);
    drop((c, a, slow, node));
    tp.assert_clean();
}

/// A peer that flags as an echo a Ref its request did not carry gets the
/// call an `Internal` error, and that Ref is released by nobody.
#[test]
fn a_forged_echo_is_refused() {
    use std::io::{Read, Write};
    let tp = pool();
    let node = Node::new(tp.attach());
    let mut other = node.pool().alloc(4096).unwrap();
    other.write(0, b"not yours").unwrap();
    let forged = other.share().unwrap();
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let pool_id = node.pool().id();
    let peer = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        use dm_rpc::raw::tcp::{HELLO, HELLO_LEN, PROOFS_LEN};
        let mut hello = [0u8; HELLO_LEN];
        s.read_exact(&mut hello).unwrap();
        // It claims the pool, and cannot prove it (proofs of zeros).
        let mut mine = HELLO.to_vec();
        mine.extend_from_slice(&pool_id.to_le_bytes());
        mine.resize(HELLO_LEN + PROOFS_LEN, 0);
        s.write_all(&mine).unwrap();
        let mut proof = [0u8; PROOFS_LEN];
        s.read_exact(&mut proof).unwrap();
        let mut h = [0u8; dm_rpc::frame::HEADER_LEN];
        s.read_exact(&mut h).unwrap();
        let len = u32::from_le_bytes(h[24..28].try_into().unwrap()) as usize;
        let mut body = vec![0u8; len];
        s.read_exact(&mut body).unwrap();
        let id = u64::from_le_bytes(h[8..16].try_into().unwrap());
        s.write_all(&dm_rpc::Frame::echo(id, forged).encode())
            .unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    });
    let c = node.connect_tcp(&addr).unwrap();
    let e = c.call("any", vec![1u8; 1 << 20]).unwrap_err();
    assert_eq!(e.status, Status::Internal, "{e}");
    drop(c);
    peer.join().unwrap();
    node.pool().release_ref(&forged).unwrap();
    drop((other, node));
    tp.assert_clean();
}

/// Callers sharing one connection wait past the waiting policy's yield
/// phase (each call takes 10 ms, served one at a time), so the followers
/// sleep on the client's condition variable: every call still gets its
/// own answer, over every transport.
#[test]
fn callers_sharing_a_connection_sleep_and_are_woken() {
    let tp = pool();
    let node = Node::new(tp.attach());
    for t in every_transport() {
        let name = unique("sleepers");
        let svc = spawn_svc(&node, &name, &t);
        let c = match &t {
            Transport::Tcp(_) => node.connect_tcp(svc.tcp_addr().unwrap()).unwrap(),
            _ => node.connect(&name).unwrap(),
        };
        std::thread::scope(|s| {
            for k in 0..6u8 {
                let c = c.clone();
                s.spawn(move || {
                    for i in 0..5usize {
                        let ms = 10u64.to_le_bytes().to_vec();
                        c.call("sleep", Payload::from_vec(ms)).unwrap();
                        let data = pattern(i * 100 + k as usize, k);
                        let got = c.call("echo", Payload::from_vec(data.clone())).unwrap();
                        assert_eq!(got.to_vec().unwrap(), data);
                    }
                });
            }
        });
        drop(c);
        svc.shutdown();
    }
    drop(node);
    tp.assert_clean();
}

/// Many threads share one client and call with `size`-byte arguments, more
/// in flight than the connection holds (over shared memory, rings that
/// hold a few frames each way). The caller reading answers may itself find
/// no room to send while the server, its answers unread, waits for room to
/// answer: whoever holds the receiving half must keep reading while it
/// waits to send.
fn crowd(t: Transport, size: usize) {
    let (tp, node) = small_rings_inline();
    let name = unique("crowd");
    let svc = spawn_svc(&node, &name, &t);
    let c = node.connect(&name).unwrap();
    std::thread::scope(|s| {
        for t in 0..8u8 {
            let c = c.clone();
            s.spawn(move || {
                for i in 0..200usize {
                    let data = vec![t; size + i % 7];
                    let opts = CallOptions::deadline(Duration::from_secs(20));
                    let got = c.call_with("echo", Payload::from_vec(data.clone()), opts);
                    assert_eq!(got.unwrap().to_vec().unwrap(), data, "thread {t} call {i}");
                }
            });
        }
    });
    drop(c);
    close(tp, node, svc);
}

#[test]
fn many_callers_on_one_client_all_finish_over_shm() {
    crowd(Transport::Shm, 1000);
}

#[test]
fn many_callers_on_one_client_all_finish_over_tcp() {
    crowd(Transport::Tcp("127.0.0.1:0".into()), 1 << 20);
}

#[test]
fn many_callers_on_one_client_all_finish_in_memory() {
    crowd(Transport::Mem, 1000);
}

#[test]
fn a_caller_waiting_to_send_reads_answers_nobody_else_reads() {
    // Over 4 KiB rings a server takes a request only when the response
    // ring is empty. D holds the receiving half (its call is running);
    // three callers queue requests and give up; C, sending a large
    // argument, finds no room and waits. When D's answer comes and D
    // leaves, the answer to the first given-up request fills the response
    // ring: the server waits for it to be read, and the request ring stays
    // too full for C. Nobody else is left to read it: C must, while it
    // waits to send (it used to wait out its deadline).
    let (tp, node) = small_rings_inline();
    let name = unique("unread");
    let (started, running) = std::sync::mpsc::channel();
    let started = std::sync::Mutex::new(started);
    let svc = node
        .server(&name)
        .method("hold", move |_| {
            let _ = started.lock().unwrap().send(());
            std::thread::sleep(Duration::from_millis(300));
            Ok(Payload::empty())
        })
        .method("echo", |c| Ok(c.take_payload()))
        .spawn()
        .unwrap();
    let c = node.connect(&name).unwrap();
    std::thread::scope(|s| {
        let d = c.clone();
        let holder = s.spawn(move || d.call("hold", Payload::empty()));
        running.recv_timeout(Duration::from_secs(10)).unwrap();
        let mut given_up = Vec::new();
        for size in [0, 1500, 1500] {
            let o = c.clone();
            given_up.push(s.spawn(move || {
                let opts = CallOptions::deadline(Duration::from_millis(50));
                o.call_with("echo", Payload::from_vec(vec![1; size]), opts)
            }));
            std::thread::sleep(Duration::from_millis(10));
        }
        let waits = c.clone();
        let big = pattern(2000, 9);
        let want = big.clone();
        let last = s.spawn(move || {
            let opts = CallOptions::deadline(Duration::from_secs(10));
            let t = Instant::now();
            let got = waits.call_with("echo", Payload::from_vec(big), opts);
            (got.map(|p| p.to_vec().unwrap()), t.elapsed())
        });
        holder.join().unwrap().unwrap();
        for o in given_up {
            let e = o.join().unwrap().unwrap_err();
            assert_eq!(e.status, Status::DeadlineExceeded, "{e}");
        }
        let (got, took) = last.join().unwrap();
        assert_eq!(got.unwrap(), want);
        assert!(took < Duration::from_secs(5), "the last call took {took:?}");
    });
    drop(c);
    close(tp, node, svc);
}

/// How much of its caller's deadline a call had left when it arrived, in
/// µs (0: no deadline).
fn left_us(c: &dm_rpc::Call<'_>) -> Payload {
    let left = c.deadline().map_or(0, |d| {
        d.saturating_duration_since(Instant::now()).as_micros() as u64 + 1
    });
    Payload::from_vec(left.to_le_bytes().to_vec())
}

fn as_u64(p: Payload) -> u64 {
    u64::from_le_bytes(p.to_vec().unwrap().try_into().unwrap())
}

/// The options a front service's nested call uses, by the request's first
/// byte: none of its own, a longer deadline, detached, a shorter deadline.
fn nested_opts(mode: u8) -> CallOptions {
    match mode {
        0 => CallOptions::default(),
        1 => CallOptions::deadline(Duration::from_secs(30)),
        2 => CallOptions::default().detached(),
        _ => CallOptions::deadline(Duration::from_millis(50)),
    }
}

#[test]
fn a_handlers_calls_inherit_the_deadline_of_the_call_it_serves() {
    // A front service (blocking and async handlers) calls a leaf: its call
    // waits no longer than its own caller does, the leaf sees what is left
    // of that deadline, and a call started after it passed fails at once
    // without reaching the leaf.
    let tp = pool();
    let node = Node::new(tp.attach());
    for t in every_transport() {
        let leaf = unique("leaf");
        let reached = std::sync::Arc::new(AtomicU32::new(0));
        let r = reached.clone();
        let leaf_svc = node
            .server(&leaf)
            .transport(t.clone())
            .method("left", move |c| {
                r.fetch_add(1, Ordering::Relaxed);
                Ok(left_us(c))
            })
            .method("sleep", |_| {
                std::thread::sleep(Duration::from_millis(800));
                Ok(Payload::empty())
            })
            .spawn()
            .unwrap();
        let front = unique("front");
        let stuck_for = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (n, l, na, la) = (node.clone(), leaf.clone(), node.clone(), leaf.clone());
        let (nl, ll, ns, ls, sf) = (
            node.clone(),
            leaf.clone(),
            node.clone(),
            leaf.clone(),
            stuck_for.clone(),
        );
        let front_svc = node
            .server(&front)
            .transport(t.clone())
            .method("via", move |c| {
                let mode = c.payload().to_vec()?[0];
                n.connect(&l)?
                    .call_with("left", Payload::empty(), nested_opts(mode))
            })
            .method_async("via_async", move |c| {
                let (n, l) = (na.clone(), la.clone());
                async move {
                    let mode = c.payload.to_vec()?[0];
                    let cl = n.connect_async(&l)?;
                    cl.call_with("left", Payload::empty(), nested_opts(mode))
                        .await
                }
            })
            // Starts its call after its caller's deadline passed.
            .method("late", move |c| {
                let cl = nl.connect(&ll)?;
                std::thread::sleep(
                    c.deadline().unwrap() - Instant::now() + Duration::from_millis(5),
                );
                cl.call("left", Payload::empty())
            })
            // Its call would take 800 ms; its caller waits 150 ms.
            .method("stuck", move |_| {
                let cl = ns.connect(&ls)?;
                let t0 = Instant::now();
                let r = cl.call("sleep", Payload::empty());
                sf.store(t0.elapsed().as_micros() as u64 + 1, Ordering::Relaxed);
                r
            })
            .spawn()
            .unwrap();
        let c = node.connect(&front).unwrap();
        let within = CallOptions::deadline(Duration::from_secs(2));
        for via in ["via", "via_async"] {
            let call = |mode: u8, opts| {
                as_u64(
                    c.call_with(via, Payload::from_vec(vec![mode]), opts)
                        .unwrap(),
                )
            };
            // No deadline anywhere: none inherited.
            assert_eq!(call(0, CallOptions::default()), 0, "{via} {t:?}");
            for (mode, most) in [(0, 2_000_000), (1, 2_000_000), (3, 50_000)] {
                let left = call(mode, within);
                assert!(
                    left > 0 && left <= most + 1,
                    "{via} {t:?} mode {mode}: {left} µs left"
                );
            }
            // Detached: its own (none).
            assert_eq!(call(2, within), 0, "{via} {t:?} detached");
        }
        let before = reached.load(Ordering::Relaxed);
        let e = c
            .call_with(
                "late",
                Payload::empty(),
                CallOptions::deadline(Duration::from_millis(100)),
            )
            .unwrap_err();
        assert_eq!(e.status, Status::DeadlineExceeded, "{t:?}: {e}");
        // Give the front time to try, then check the leaf saw nothing.
        let ping = c.call_with("via", Payload::from_vec(vec![0]), CallOptions::default());
        assert_eq!(as_u64(ping.unwrap()), 0);
        assert_eq!(
            reached.load(Ordering::Relaxed),
            before + 1,
            "{t:?}: the late call reached the leaf"
        );
        let e = c
            .call_with(
                "stuck",
                Payload::empty(),
                CallOptions::deadline(Duration::from_millis(150)),
            )
            .unwrap_err();
        assert_eq!(e.status, Status::DeadlineExceeded, "{t:?}: {e}");
        let until = Instant::now() + Duration::from_secs(10);
        while stuck_for.load(Ordering::Relaxed) == 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        let took = Duration::from_micros(stuck_for.load(Ordering::Relaxed));
        assert!(
            took > Duration::ZERO && took < Duration::from_millis(600),
            "{t:?}: the front's nested call took {took:?} (its caller waited 150 ms)"
        );
        drop(c);
        front_svc.shutdown();
        leaf_svc.shutdown();
    }
    drop(node);
    tp.assert_clean();
}

type Started = std::sync::mpsc::Receiver<&'static str>;

/// A service for the graceful shutdown tests: `hold` runs 300 ms on the
/// dispatcher, `later` awaits `ms` (its argument) without holding the
/// dispatcher (both say when they start, on the receiver returned),
/// `echo` answers at once.
fn draining_svc(node: &Node, name: &str, t: &Transport) -> (dm_rpc::Server, Started) {
    let (tx, started) = std::sync::mpsc::channel();
    let (hold, later) = (std::sync::Mutex::new(tx.clone()), std::sync::Mutex::new(tx));
    let svc = node
        .server(name)
        .transport(t.clone())
        .method("hold", move |c| {
            let _ = hold.lock().unwrap().send("hold");
            std::thread::sleep(Duration::from_millis(300));
            Ok(c.take_payload())
        })
        .method("echo", |c| Ok(c.take_payload()))
        .method("who", |_| Ok(Payload::from_vec(b"old".to_vec())))
        .method_async("later", move |c| {
            let _ = later.lock().unwrap().send("later");
            async move {
                let ms = u64::from_le_bytes(c.payload.to_vec()?.try_into().unwrap_or([0; 8]));
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok(c.payload)
            }
        })
        .spawn()
        .unwrap();
    (svc, started)
}

/// Waits until the draining service says `what` started.
fn started(s: &Started, what: &str) {
    while s.recv_timeout(Duration::from_secs(10)).unwrap() != what {}
}

fn ms(n: u64) -> Payload {
    Payload::from_vec(n.to_le_bytes().to_vec())
}

#[test]
fn a_graceful_shutdown_finishes_what_was_sent_and_refuses_what_comes_after() {
    let tp = pool();
    let node = Node::new(tp.attach());
    for t in every_transport() {
        // In progress (async), running (blocking) and queued behind it
        // when the shutdown begins: all three are served.
        let name = unique("graceful");
        let (svc, running) = draining_svc(&node, &name, &t);
        let c = node.connect(&name).unwrap();
        std::thread::scope(|s| {
            let later = s.spawn(|| c.call("later", ms(400)));
            started(&running, "later");
            let hold = s.spawn(|| c.call("hold", vec![2u8; 3000]));
            started(&running, "hold");
            let queued = s.spawn(|| c.call("echo", vec![3u8; 5]));
            std::thread::sleep(Duration::from_millis(50));
            let t0 = Instant::now();
            let stopping = s.spawn(move || svc.shutdown_gracefully(Duration::from_secs(20)));
            assert_eq!(as_u64(later.join().unwrap().unwrap()), 400, "{t:?}");
            assert_eq!(
                hold.join().unwrap().unwrap().to_vec().unwrap(),
                vec![2u8; 3000]
            );
            assert_eq!(
                queued.join().unwrap().unwrap().to_vec().unwrap(),
                vec![3u8; 5]
            );
            stopping.join().unwrap();
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{t:?}: {:?}",
                t0.elapsed()
            );
        });
        let e = c.call("echo", vec![4u8]).unwrap_err();
        assert_eq!(e.status, Status::Unavailable, "{t:?}: {e}");
        drop(c);

        // While it waits for a call in progress, a new request is refused
        // (once the dispatcher sees the shutdown begin).
        let name = unique("graceful");
        let (svc, running) = draining_svc(&node, &name, &t);
        let c = node.connect(&name).unwrap();
        std::thread::scope(|s| {
            let later = s.spawn(|| c.call("later", ms(1500)));
            started(&running, "later");
            let stopping = s.spawn(move || svc.shutdown_gracefully(Duration::from_secs(20)));
            let until = Instant::now() + Duration::from_secs(10);
            let e = loop {
                match c.call("echo", vec![5u8]) {
                    Err(e) => break e,
                    Ok(_) if Instant::now() < until => std::thread::sleep(Duration::from_millis(5)),
                    Ok(_) => panic!("{t:?}: still served 10 s into the shutdown"),
                }
            };
            assert_eq!(e.status, Status::Unavailable, "{t:?}: {e}");
            assert!(e.message.contains("shutting down"), "{t:?}: {e}");
            assert_eq!(as_u64(later.join().unwrap().unwrap()), 1500, "{t:?}");
            stopping.join().unwrap();
        });
        drop(c);

        // Out of time: a call still in progress when the grace ends fails.
        let name = unique("graceful");
        let (svc, running) = draining_svc(&node, &name, &t);
        let c = node.connect(&name).unwrap();
        std::thread::scope(|s| {
            let later = s.spawn(|| c.call("later", ms(5000)));
            started(&running, "later");
            let t0 = Instant::now();
            svc.shutdown_gracefully(Duration::from_millis(200));
            let took = t0.elapsed();
            assert!(took < Duration::from_secs(3), "{t:?}: {took:?}");
            let e = later.join().unwrap().unwrap_err();
            assert_eq!(e.status, Status::Unavailable, "{t:?}: {e}");
        });
        drop(c);
    }
    drop(node);
    tp.assert_clean();
}

fn current_thread_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Checks the pool is clean once the pump threads of dropped async
/// clients have noticed (they look every 100 ms; a busy machine may
/// hold them up past that).
fn assert_clean_after_pumps(tp: &TempPool) {
    tp.assert_clean_within(Duration::from_secs(5));
}

/// Calls `method` with `arg` until it succeeds, for up to 5 s: every
/// failure meanwhile is `Unavailable`.
fn call_until_served(c: &dm_rpc::Client, method: &str, arg: &[u8]) -> Payload {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        match c.call_slice(method, arg) {
            Ok(p) => return p,
            Err(e) => {
                assert_eq!(e.status, Status::Unavailable, "{e}");
                assert!(Instant::now() < until, "not served again: {e}");
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}

/// A server that leaves and a new one registered under its name: the
/// clients of the first, blocking and async, and an async service's client
/// to the next tier (whose answers its server's listener reads), call the
/// second. Until it is there, calls fail at once with `Unavailable`.
#[test]
fn clients_call_the_service_registered_again_after_their_server_left() {
    let tp = pool();
    let node = Node::new(tp.attach());
    let rt = current_thread_rt();
    let big = pattern(300_000, 9);
    for t in every_transport() {
        let name = unique("again");
        let svc = spawn_svc(&node, &name, &t);
        // An async front service forwarding to it through one client.
        let front_name = unique("again-front");
        let leaf = node.connect_async(&name).unwrap();
        let via = leaf.clone();
        let front = node
            .server(&front_name)
            .transport(t.clone())
            .method_async("via", move |c| {
                let via = via.clone();
                async move { via.call("echo", c.payload.forward()?).await }
            })
            .spawn()
            .unwrap();
        let c = node.connect(&name).unwrap();
        let c2 = c.clone();
        let front_c = node.connect(&front_name).unwrap();
        assert_eq!(c.call_slice("echo", &big).unwrap().to_vec().unwrap(), big);
        assert_eq!(
            front_c.call_slice("via", &big).unwrap().to_vec().unwrap(),
            big
        );
        let ac = node.connect_async(&name).unwrap();
        rt.block_on(ac.call("echo", vec![1u8])).unwrap();

        svc.shutdown();
        for _ in 0..3 {
            let t0 = Instant::now();
            let e = c.call("echo", vec![1u8]).unwrap_err();
            assert_eq!(e.status, Status::Unavailable, "{t:?}: {e}");
            let e = rt.block_on(ac.call("echo", vec![1u8])).unwrap_err();
            assert_eq!(e.status, Status::Unavailable, "{t:?}: {e}");
            let e = front_c.call("via", vec![1u8]).unwrap_err();
            assert_eq!(e.status, Status::Unavailable, "{t:?}: {e}");
            // (At once: not after a lease or a connect timeout.)
            assert!(t0.elapsed() < Duration::from_secs(1), "{t:?}");
        }
        assert_eq!((c.reconnects(), ac.reconnects()), (0, 0), "{t:?}");

        let svc = spawn_svc(&node, &name, &t);
        let got = call_until_served(&c, "echo", &big);
        assert_eq!(got.to_vec().unwrap(), big, "{t:?}");
        // Clones share the new connection.
        assert_eq!(c2.call_slice("echo", &big).unwrap().to_vec().unwrap(), big);
        assert_eq!((c.reconnects(), c2.reconnects()), (1, 1), "{t:?}");
        // By Ref, as on the first connection.
        let (len, by_ref, _) = inspect(&node, &c, big.clone());
        assert_eq!((len, by_ref), (big.len() as u64, true), "{t:?}");
        let got = call_until_served(&front_c, "via", &big);
        assert_eq!(got.to_vec().unwrap(), big, "{t:?}");
        assert_eq!(leaf.reconnects(), 1, "{t:?}");
        let until = Instant::now() + Duration::from_secs(5);
        let got = loop {
            match rt.block_on(ac.call_slice("echo", &big)) {
                Ok(p) => break p,
                Err(e) if Instant::now() < until => {
                    assert_eq!(e.status, Status::Unavailable, "{t:?}: {e}");
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => panic!("{t:?}: {e}"),
            }
        };
        assert_eq!(got.to_vec().unwrap(), big, "{t:?}");
        assert_eq!(ac.reconnects(), 1, "{t:?}");
        drop((c, c2, ac, front_c, leaf));
        front.shutdown();
        svc.shutdown();
    }
    drop((rt, node));
    assert_clean_after_pumps(&tp);
}

/// A TCP forwarder that can cut every connection through it while both
/// ends live, as a network (or a proxy) may.
struct Cutter {
    addr: String,
    conns: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    accept: Option<std::thread::JoinHandle<()>>,
}

impl Cutter {
    fn new(upstream: &str) -> Cutter {
        use std::net::{TcpListener, TcpStream};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let conns = std::sync::Arc::new(std::sync::Mutex::new(Vec::<TcpStream>::new()));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (c, st, up) = (conns.clone(), stop.clone(), upstream.to_owned());
        let accept = std::thread::spawn(move || {
            for down in l.incoming() {
                if st.load(Ordering::Acquire) {
                    return;
                }
                let down = down.unwrap();
                let up = TcpStream::connect(&up).unwrap();
                for s in [&down, &up] {
                    s.set_nodelay(true).unwrap();
                    c.lock().unwrap().push(s.try_clone().unwrap());
                }
                let pipe = |mut from: TcpStream, mut to: TcpStream| {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                };
                pipe(down.try_clone().unwrap(), up.try_clone().unwrap());
                pipe(up, down);
            }
        });
        Cutter {
            addr,
            conns,
            stop,
            accept: Some(accept),
        }
    }

    /// Cuts every connection made through it so far.
    fn cut(&self) {
        for s in self.conns.lock().unwrap().drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for Cutter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = std::net::TcpStream::connect(&self.addr);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        self.cut();
    }
}

/// A TCP connection cut while its server lives: the clients dial the same
/// service again, by its address and by its name (the same registration:
/// over TCP a connection can break with both ends alive).
#[test]
fn tcp_clients_whose_connections_were_cut_dial_the_same_service_again() {
    let tp = pool();
    let node = Node::new(tp.attach());
    let svc = spawn_svc(&node, &unique("cut"), &Transport::Tcp("127.0.0.1:0".into()));
    let cutter = Cutter::new(svc.tcp_addr().unwrap());
    let reg: std::sync::Arc<dyn dm_rpc::Registry> = std::sync::Arc::new(MapRegistry::default());
    let name = unique("cut-by-name");
    reg.register(&name, &dm_pool::Endpoint::Tcp(cutter.addr.clone()))
        .unwrap();
    let named = Node::new(tp.attach()).with_registry(reg);
    let by_addr = node.connect_tcp(&cutter.addr).unwrap();
    let by_name = named.connect(&name).unwrap();
    let ac = named.connect_async(&name).unwrap();
    let rt = current_thread_rt();
    let big = pattern(200_000, 3);
    for c in [&by_addr, &by_name] {
        assert_eq!(c.call_slice("echo", &big).unwrap().to_vec().unwrap(), big);
    }
    rt.block_on(ac.call("echo", vec![1u8])).unwrap();
    cutter.cut();
    for c in [&by_addr, &by_name] {
        let got = call_until_served(c, "echo", &big);
        assert_eq!(got.to_vec().unwrap(), big);
        assert_eq!(c.reconnects(), 1, "{c:?}");
        // By Ref (one pool) on the new connection, as on the first.
        let (len, by_ref, _) = inspect(&node, c, big.clone());
        assert_eq!((len, by_ref), (big.len() as u64, true));
    }
    let until = Instant::now() + Duration::from_secs(5);
    while let Err(e) = rt.block_on(ac.call("echo", vec![2u8])) {
        assert_eq!(e.status, Status::Unavailable, "{e}");
        assert!(Instant::now() < until, "not served again: {e}");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(ac.reconnects(), 1);
    assert_eq!(svc.stats().refused.load(Ordering::Relaxed), 0);
    drop((by_addr, by_name, ac, cutter, rt));
    svc.shutdown();
    drop((node, named));
    assert_clean_after_pumps(&tp);
}

/// Calls in flight when their TCP connection is cut: whether the server
/// ran them is unknown, so they fail with `Unavailable`, except those
/// marked idempotent, which are sent again on the new connection.
#[test]
fn idempotent_calls_in_flight_when_their_connection_breaks_are_sent_again() {
    let tp = pool();
    let node = Node::new(tp.attach());
    let svc = spawn_svc(&node, &unique("cut"), &Transport::Tcp("127.0.0.1:0".into()));
    let cutter = Cutter::new(svc.tcp_addr().unwrap());
    let c = node.connect_tcp(&cutter.addr).unwrap();
    let ac = node.connect_tcp_async(&cutter.addr).unwrap();
    let rt = current_thread_rt();
    let again = CallOptions::deadline(Duration::from_secs(20)).idempotent();
    let big = pattern(200_000, 4);
    c.call("echo", vec![1u8]).unwrap();
    std::thread::scope(|s| {
        // The first runs (300 ms); the others wait behind it.
        let plain = s.spawn(|| c.call("sleep", ms(300)));
        std::thread::sleep(Duration::from_millis(30));
        let marked = s.spawn(|| c.call_with("sleep", ms(300), again));
        let by_ref = s.spawn(|| c.call_with("echo", Payload::from_vec(big.clone()), again));
        let asynced = s.spawn(|| rt.block_on(ac.call_with("echo", ms(7), again)));
        std::thread::sleep(Duration::from_millis(100));
        cutter.cut();
        let e = plain.join().unwrap().unwrap_err();
        assert_eq!(e.status, Status::Unavailable, "{e}");
        assert!(marked.join().unwrap().is_ok());
        assert_eq!(by_ref.join().unwrap().unwrap().to_vec().unwrap(), big);
        assert_eq!(as_u64(asynced.join().unwrap().unwrap()), 7);
    });
    assert_eq!((c.reconnects(), ac.reconnects()), (1, 1));
    drop((c, ac, cutter, rt));
    svc.shutdown();
    drop(node);
    assert_clean_after_pumps(&tp);
}

/// A blocking handler with long work that looks whether its call was
/// given up: it stops when its caller cancels (an async call dropped, with
/// no deadline) or when the deadline passes, and the requests read while
/// it looked are served after it, in order.
#[test]
fn a_blocking_handler_learns_that_its_call_was_given_up() {
    let tp = pool();
    let node = Node::new(tp.attach());
    let rt = current_thread_rt();
    for t in every_transport() {
        let name = unique("given-up");
        let (stopped_tx, stopped) = std::sync::mpsc::channel::<(bool, Duration)>();
        let stopped_tx = std::sync::Mutex::new(stopped_tx);
        let svc = node
            .server(&name)
            .transport(t.clone())
            // Works for up to 5 s, looking every millisecond.
            .method("long", move |c| {
                let t0 = Instant::now();
                let mut gave_up = false;
                while t0.elapsed() < Duration::from_secs(5) {
                    if c.cancelled() {
                        gave_up = true;
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                let _ = stopped_tx.lock().unwrap().send((gave_up, t0.elapsed()));
                Ok(Payload::empty())
            })
            .method("echo", |c| Ok(c.take_payload()))
            .spawn()
            .unwrap();

        // Cancelled: an async call with no deadline, dropped at 100 ms.
        let ac = node.connect_async(&name).unwrap();
        let other = node.connect(&name).unwrap();
        let late = std::thread::scope(|s| {
            // Sent while the handler runs: read by its looks, served after.
            let late = s.spawn(|| {
                std::thread::sleep(Duration::from_millis(40));
                other.call("echo", vec![9u8; 3]).unwrap().to_vec().unwrap()
            });
            let r = rt.block_on(async {
                tokio::time::timeout(Duration::from_millis(100), ac.call("long", vec![1u8])).await
            });
            assert!(r.is_err(), "{t:?}: the call was dropped");
            late.join().unwrap()
        });
        assert_eq!(late, [9u8; 3], "{t:?}");
        let (gave_up, took) = stopped.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(gave_up, "{t:?}: worked for {took:?}");
        assert!(took < Duration::from_secs(3), "{t:?}: {took:?}");

        // Its deadline passed. (The handler stops as the deadline passes
        // on its side, so its empty answer may beat the caller's.)
        let c = node.connect(&name).unwrap();
        let r = c.call_with(
            "long",
            Payload::empty(),
            CallOptions::deadline(Duration::from_millis(100)),
        );
        if let Err(e) = r {
            assert_eq!(e.status, Status::DeadlineExceeded, "{t:?}");
        }
        let (gave_up, took) = stopped.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(gave_up && took < Duration::from_secs(3), "{t:?}: {took:?}");
        // Still serving.
        assert_eq!(c.call("echo", vec![4u8]).unwrap().to_vec().unwrap(), [4]);
        drop((c, ac, other));
        svc.shutdown();
    }
    drop((rt, node));
    assert_clean_after_pumps(&tp);
}

/// A call that waits for ready waits, until its deadline, for a service
/// that went away to be registered again, instead of failing at once.
#[test]
fn a_call_that_waits_for_ready_waits_for_the_service_to_come_back() {
    let tp = pool();
    let node = Node::new(tp.attach());
    let rt = current_thread_rt();
    let ready = |ms| CallOptions::deadline(Duration::from_millis(ms)).wait_for_ready();
    for t in every_transport() {
        let name = unique("ready");
        let svc = spawn_svc(&node, &name, &t);
        let c = node.connect(&name).unwrap();
        let ac = node.connect_async(&name).unwrap();
        c.call("echo", vec![1u8]).unwrap();
        rt.block_on(ac.call("echo", vec![1u8])).unwrap();
        svc.shutdown();
        // Broken: without waiting, at once.
        let e = c.call("echo", vec![1u8]).unwrap_err();
        assert_eq!(e.status, Status::Unavailable, "{t:?}: {e}");
        let e = rt.block_on(ac.call("echo", vec![1u8])).unwrap_err();
        assert_eq!(e.status, Status::Unavailable, "{t:?}: {e}");
        // Waiting, until the deadline.
        let t0 = Instant::now();
        let e = c
            .call_with("echo", Payload::from_vec(vec![1]), ready(150))
            .unwrap_err();
        assert_eq!(e.status, Status::DeadlineExceeded, "{t:?}: {e}");
        let e = rt
            .block_on(ac.call_with("echo", Payload::from_vec(vec![1]), ready(150)))
            .unwrap_err();
        assert_eq!(e.status, Status::DeadlineExceeded, "{t:?}: {e}");
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(290) && took < Duration::from_secs(3),
            "{t:?}: {took:?}"
        );
        // Back 200 ms from now: both calls get through.
        let (svc, got, agot) = std::thread::scope(|s| {
            let back = s.spawn(|| {
                std::thread::sleep(Duration::from_millis(200));
                spawn_svc(&node, &name, &t)
            });
            let waiter = s.spawn(|| {
                rt.block_on(ac.call_with("echo", Payload::from_vec(vec![3]), ready(5000)))
            });
            let got = c.call_with("echo", Payload::from_vec(vec![2]), ready(5000));
            (back.join().unwrap(), got, waiter.join().unwrap())
        });
        assert_eq!(got.unwrap().to_vec().unwrap(), [2], "{t:?}");
        assert_eq!(agot.unwrap().to_vec().unwrap(), [3], "{t:?}");
        assert_eq!((c.reconnects(), ac.reconnects()), (1, 1), "{t:?}");
        // The deadline bounds the wait and the call together: back after
        // 200 ms, a 500 ms call no longer fits in 600.
        svc.shutdown();
        assert!(c.call("echo", vec![1u8]).is_err());
        let (svc, got) = std::thread::scope(|s| {
            let back = s.spawn(|| {
                std::thread::sleep(Duration::from_millis(200));
                spawn_svc(&node, &name, &t)
            });
            let got = c.call_with("sleep", ms(500), ready(600));
            (back.join().unwrap(), got)
        });
        let e = got.unwrap_err();
        assert_eq!(e.status, Status::DeadlineExceeded, "{t:?}: {e}");
        drop((c, ac));
        svc.shutdown();
    }
    drop((rt, node));
    assert_clean_after_pumps(&tp);
}

/// A graceful restart: the old server drains while its successor takes
/// the name. A call in progress completes on the old server; a request the
/// old server refuses is sent again to the successor, so no call fails
/// (blocking and async), and the calls after go to the successor.
#[test]
fn clients_move_to_the_successor_of_a_server_that_shuts_down_gracefully() {
    let tp = pool();
    let node = Node::new(tp.attach());
    let rt = current_thread_rt();
    for t in every_transport() {
        let name = unique("successor");
        let (old, running) = draining_svc(&node, &name, &t);
        let c = node.connect(&name).unwrap();
        let ac = node.connect_async(&name).unwrap();
        c.call("echo", vec![1u8]).unwrap();
        rt.block_on(ac.call("echo", vec![1u8])).unwrap();
        std::thread::scope(|s| {
            let c2 = c.clone();
            let later = s.spawn(move || c2.call("later", ms(800)));
            started(&running, "later");
            let stopping = s.spawn(move || old.shutdown_gracefully(Duration::from_secs(20)));
            // The name is free at once: the successor takes it.
            let until = Instant::now() + Duration::from_secs(5);
            let successor = loop {
                let svc = node
                    .server(&name)
                    .transport(t.clone())
                    .method("who", |_| Ok(Payload::from_vec(b"new".to_vec())))
                    .spawn();
                match svc {
                    Ok(svc) => break svc,
                    Err(e) => {
                        assert!(Instant::now() < until, "{t:?}: {e}");
                        std::thread::sleep(Duration::from_millis(2));
                    }
                }
            };
            // The old server answers `old` until its dispatcher sees the
            // drain begin, then refuses; a refused request goes to the
            // successor, which answers `new`.
            let who = |r: Result<Payload, RpcError>, refused: &mut u32| match r {
                Ok(p) => p.to_vec().unwrap() == b"new",
                Err(e) => {
                    assert_eq!(e.status, Status::Unavailable, "{t:?}: {e}");
                    *refused += 1;
                    false
                }
            };
            let mut refused = 0;
            let until = Instant::now() + Duration::from_secs(5);
            while !who(c.call("who", Payload::empty()), &mut refused) {
                assert!(Instant::now() < until, "{t:?}: never the successor");
                std::thread::sleep(Duration::from_millis(1));
            }
            while !who(rt.block_on(ac.call("who", Payload::empty())), &mut refused) {
                assert!(Instant::now() < until, "{t:?}: never the successor");
                std::thread::sleep(Duration::from_millis(1));
            }
            // Once moved, they stay.
            assert_eq!(
                c.call("who", Payload::empty()).unwrap().to_vec().unwrap(),
                b"new"
            );
            assert_eq!(refused, 0, "{t:?}: {refused} calls failed");
            assert_eq!((c.reconnects(), ac.reconnects()), (1, 1), "{t:?}");
            // The call in progress completed on the old server.
            assert_eq!(as_u64(later.join().unwrap().unwrap()), 800, "{t:?}");
            stopping.join().unwrap();
            successor.shutdown();
        });
        drop((c, ac));
    }
    drop((rt, node));
    assert_clean_after_pumps(&tp);
}

/// The handler's view of a call's metadata: `key=value` lines.
fn meta_lines(m: &dm_rpc::Metadata) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in m.iter() {
        out.extend_from_slice(k.as_bytes());
        out.push(b'=');
        out.extend_from_slice(v);
        out.push(b'\n');
    }
    out
}

/// Metadata a caller attaches reaches the handler (blocking and async,
/// from blocking and async clients) over every transport, with inline and
/// by-Ref payloads, and the largest inline payload still fits beside it.
#[test]
fn metadata_reaches_the_handler_over_every_transport() {
    let tp = pool();
    let node = Node::new(tp.attach());
    let rt = current_thread_rt();
    let meta = dm_rpc::Metadata::new()
        .with("trace-id", "0af7651916cd43dd")
        .and_then(|m| m.with("tenant", vec![0u8, 1, 255]))
        .and_then(|m| m.with("trace-id", "again"))
        .unwrap();
    let by_value = Node::with_config(
        tp.attach(),
        Config {
            inline_max: usize::MAX,
            ..Default::default()
        },
    );
    let want = meta_lines(&meta);
    let expect = |arg: &[u8]| {
        let s = sum(&Payload::from_vec(arg.to_vec()));
        [want.clone(), s.to_le_bytes().to_vec()].concat()
    };
    let big = pattern(300_000, 2);
    for t in every_transport() {
        let name = unique("meta");
        let svc = node
            .server(&name)
            .transport(t.clone())
            .method("meta", |c| {
                let mut out = meta_lines(c.metadata());
                out.extend_from_slice(&sum(c.payload()).to_le_bytes());
                Ok(Payload::from_vec(out))
            })
            .method_async("meta_async", |c| async move {
                let mut out = meta_lines(&c.metadata);
                out.extend_from_slice(&sum(&c.payload).to_le_bytes());
                Ok(Payload::from_vec(out))
            })
            .spawn()
            .unwrap();
        let c = node.connect(&name).unwrap();
        let ac = node.connect_async(&name).unwrap();
        let opts = CallOptions::default();
        for arg in [vec![7u8; 10], big.clone()] {
            for method in ["meta", "meta_async"] {
                let p = Payload::from_vec(arg.clone());
                let got = c.call_with_metadata(method, p, opts, meta.clone()).unwrap();
                assert_eq!(got.to_vec().unwrap(), expect(&arg), "{t:?} {method}");
                let p = Payload::from_vec(arg.clone());
                let got = rt.block_on(ac.call_with_metadata(method, p, opts, meta.clone()));
                let got = got.unwrap().to_vec().unwrap();
                assert_eq!(got, expect(&arg), "{t:?} {method} async");
            }
        }
        // Too much is refused before it is sent; the connection goes on.
        let huge = dm_rpc::Metadata::new().with("k", vec![1; 20_000]).unwrap();
        let e = c
            .call_with_metadata("meta", Payload::empty(), opts, huge)
            .unwrap_err();
        assert_eq!(e.status, Status::InvalidArgument, "{t:?}: {e}");
        // None: nothing reaches the handler.
        let got = c.call("meta", vec![1u8]).unwrap().to_vec().unwrap();
        assert_eq!(got.len(), 8, "{t:?}");
        assert_eq!(c.reconnects(), 0, "{t:?}");
        // The largest payload a transport carries inline, from a node that
        // sends everything it can inline: with metadata beside it, it goes
        // by Ref instead of failing as too large.
        let max = match &t {
            Transport::Shm => dm_rpc::raw::shm::ring_max_inline(node.pool()),
            Transport::Tcp(_) => dm_rpc::raw::tcp::MAX_INLINE,
            Transport::Mem => dm_rpc::raw::mem::MAX_INLINE,
        };
        let edge = pattern(max, 3);
        let cv = by_value.connect(&name).unwrap();
        // (And over TCP a large inline frame, read into its own vector.)
        let p = Payload::from_vec(big.clone());
        let got = cv
            .call_with_metadata("meta", p, opts, meta.clone())
            .unwrap();
        assert_eq!(got.to_vec().unwrap(), expect(&big), "{t:?}");
        for m in [dm_rpc::Metadata::new(), meta.clone()] {
            let p = Payload::from_vec(edge.clone());
            let got = cv.call_with_metadata("meta", p, opts, m.clone()).unwrap();
            let s = sum(&Payload::from_vec(edge.clone())).to_le_bytes();
            assert_eq!(
                got.to_vec().unwrap(),
                [meta_lines(&m), s.to_vec()].concat(),
                "{t:?}"
            );
        }
        drop((c, ac, cv));
        svc.shutdown();
    }
    drop((rt, node, by_value));
    assert_clean_after_pumps(&tp);
}

/// Client interceptors: every call of a client (blocking, async,
/// balanced, unary or streaming) passes them first, in the order added:
/// they see the method, options, metadata (the client's `with_metadata`
/// keys too) and payload size, may add metadata the server then sees (and
/// its own interceptor checks), and may refuse a call, which then returns
/// their error with nothing sent and nothing leaked (a by-Ref argument
/// included). A client without them is unchanged, on the same connection.
/// Answer interceptors see every unary call's outcome, in order, and may
/// change it.
#[test]
fn client_interceptors_see_change_and_refuse_calls() {
    use std::sync::{Arc, Mutex};
    let tp = pool();
    let node = Node::new(tp.attach());
    let rt = current_thread_rt();
    let name = unique("intercepted");
    let svc = node
        .server(&name)
        .replica()
        .intercept(|c| match c.metadata().get("token") {
            Some(b"sesame") => Ok(()),
            _ => Err(RpcError::unauthenticated("no token")),
        })
        .method("who", |c| {
            let tenant = c.metadata().get("tenant").unwrap_or_default().to_vec();
            Ok(Payload::from_vec(
                [tenant, sum(c.payload()).to_le_bytes().to_vec()].concat(),
            ))
        })
        .method_stream("count", |_c, sink| {
            for i in 0..3u8 {
                sink.send(Payload::from_vec(vec![i]))?;
            }
            Ok(())
        })
        .spawn()
        .unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let plain = node.connect(&name).unwrap();
    let tenant = dm_rpc::Metadata::new().with("tenant", "acme").unwrap();
    let c = plain
        .with_metadata(tenant.clone())
        .intercept(move |call| {
            let tenant = call.metadata().get("tenant").map(<[u8]>::to_vec);
            let entry = (call.method().to_owned(), call.payload_len(), tenant);
            log.lock().unwrap().push(entry);
            call.metadata_mut().insert("token", "sesame").unwrap();
            Ok(())
        })
        .intercept(|call| match call.method() {
            "forbidden" => Err(RpcError::permission_denied("not from here")),
            _ => Ok(()),
        });
    let big = pattern(300_000, 5);
    let expect = |arg: &[u8]| {
        [
            b"acme".to_vec(),
            sum(&Payload::from_vec(arg.to_vec())).to_le_bytes().to_vec(),
        ]
        .concat()
    };
    for arg in [vec![3u8; 10], big.clone()] {
        let got = c.call("who", arg.clone()).unwrap().to_vec().unwrap();
        assert_eq!(got, expect(&arg));
    }
    // Refused on the caller's side: the interceptor's error, the method
    // not even looked up, a by-Ref argument released.
    let mut b = node.pool().alloc(big.len() as u64).unwrap();
    b.write(0, &big).unwrap();
    let e = c.call("forbidden", Payload::from_buffer(b)).unwrap_err();
    assert_eq!(e.status, Status::PermissionDenied, "{e}");
    assert!(e.to_string().contains("not from here"), "{e}");
    // The stream's call passes them too.
    let items: Vec<u8> = c
        .call_stream("count", Payload::empty())
        .unwrap()
        .map(|i| i.unwrap().to_vec().unwrap()[0])
        .collect();
    assert_eq!(items, [0, 1, 2]);
    // Without them, on the same connection: no token, refused by the
    // server's interceptor.
    let e = plain.call("who", vec![1u8]).unwrap_err();
    assert_eq!(e.status, Status::Unauthenticated, "{e}");
    {
        let seen = seen.lock().unwrap();
        let acme = Some(b"acme".to_vec());
        let want = [
            ("who".to_owned(), 10, acme.clone()),
            ("who".to_owned(), big.len() as u64, acme.clone()),
            ("forbidden".to_owned(), big.len() as u64, acme.clone()),
            ("count".to_owned(), 0, acme.clone()),
        ];
        assert_eq!(*seen, want);
    }
    // The async and balanced clients' interceptors.
    let add_token = |call: &mut dm_rpc::OutgoingCall<'_>| {
        call.metadata_mut().insert("token", "sesame").unwrap();
        call.metadata_mut().insert("tenant", "async").unwrap();
        Ok(())
    };
    let ac = node.connect_async(&name).unwrap();
    let e = rt.block_on(ac.call("who", vec![1u8])).unwrap_err();
    assert_eq!(e.status, Status::Unauthenticated, "{e}");
    let got = rt
        .block_on(ac.intercept(add_token).call("who", vec![1u8]))
        .unwrap();
    assert_eq!(&got.to_vec().unwrap()[..5], b"async");
    let bc = node.connect_balanced(&name).unwrap().intercept(add_token);
    assert_eq!(
        &bc.call("who", vec![1u8]).unwrap().to_vec().unwrap()[..5],
        b"async"
    );
    let abc = node
        .connect_balanced_async(&name)
        .unwrap()
        .intercept(add_token);
    let got = rt.block_on(abc.call("who", vec![1u8])).unwrap();
    assert_eq!(&got.to_vec().unwrap()[..5], b"async");
    let refuse = |_: &mut dm_rpc::OutgoingCall<'_>| Err(RpcError::new(Status::Cancelled, "no"));
    let e = bc.intercept(refuse).call("who", vec![1u8]).unwrap_err();
    assert_eq!(e.status, Status::Cancelled, "{e}");
    // Answer interceptors: every unary call's outcome, a request
    // interceptor's refusal too, in order; they may change it.
    let ended = Arc::new(Mutex::new(Vec::new()));
    let log = ended.clone();
    let ca = c
        .intercept_answers(move |method, r| {
            let status = r.as_ref().map_or_else(|e| e.status, |_| Status::Ok);
            log.lock().unwrap().push((method.to_owned(), status));
        })
        .intercept_answers(|_, r| {
            if let Err(e) = r {
                if e.status == Status::PermissionDenied {
                    *r = Ok(dm_rpc::Reply {
                        payload: Payload::from_vec(b"denied".to_vec()),
                        metadata: dm_rpc::Metadata::new(),
                    });
                }
            }
        });
    assert_eq!(
        &ca.call("who", vec![1u8]).unwrap().to_vec().unwrap()[..4],
        b"acme"
    );
    let got = ca.call("forbidden", vec![1u8]).unwrap().to_vec().unwrap();
    assert_eq!(got, b"denied");
    let e = ca.call("nonesuch", vec![1u8]).unwrap_err();
    assert_eq!(e.status, Status::NotFound, "{e}");
    let seen_async = Arc::new(Mutex::new(Vec::new()));
    let log = seen_async.clone();
    let note = move |method: &str, r: &mut Result<dm_rpc::Reply, RpcError>| {
        log.lock().unwrap().push((method.to_owned(), r.is_ok()));
    };
    let aca = ac.intercept_answers(note.clone());
    assert!(rt.block_on(aca.call("who", vec![1u8])).is_err()); // no token
    let bca = bc.intercept_answers(note.clone());
    assert!(bca.call("who", vec![1u8]).is_ok());
    let abca = abc.intercept_answers(note);
    assert!(rt.block_on(abca.call("who", vec![1u8])).is_ok());
    assert!(bca.intercept(refuse).call("who", vec![1u8]).is_err());
    assert_eq!(
        *ended.lock().unwrap(),
        [
            ("who".to_owned(), Status::Ok),
            ("forbidden".to_owned(), Status::PermissionDenied),
            ("nonesuch".to_owned(), Status::NotFound),
        ]
    );
    let who = |ok| ("who".to_owned(), ok);
    assert_eq!(
        *seen_async.lock().unwrap(),
        [who(false), who(true), who(true), who(false)]
    );
    drop((c, ca, plain, ac, aca, bc, bca, abc, abca));
    drop((svc, rt, node));
    // (The async clients' answer pump lets go a moment after them.)
    assert_clean_after_pumps(&tp);
}

/// Metadata from `pairs`.
fn md(pairs: &[(&str, &str)]) -> dm_rpc::Metadata {
    let mut m = dm_rpc::Metadata::new();
    for (k, v) in pairs {
        m.insert(k, *v).unwrap();
    }
    m
}

/// An answer carries the metadata its handler set (blocking and async
/// handlers, over several polls, from blocking and async clients), on a
/// success, an answer passing its request's Ref back, an error, and an
/// error passed on from a nested call, over every transport; a handler
/// that sets too much fails with `Internal`, and one that sets it from a
/// thread it started learns that nothing serves there. The largest inline
/// answer still fits beside its metadata.
#[test]
fn answers_carry_the_metadata_their_handler_set_over_every_transport() {
    let tp = pool();
    let node = Node::new(tp.attach());
    let by_value = Node::with_config(
        tp.attach(),
        Config {
            inline_max: usize::MAX,
            ..Default::default()
        },
    );
    let rt = current_thread_rt();
    let big = pattern(300_000, 5);
    for t in every_transport() {
        let upstream = unique("reply-up");
        let up = node
            .server(&upstream)
            .transport(t.clone())
            .method("busy", |c| {
                c.set_reply_metadata(md(&[("retry-after-ms", "250")]))?;
                Err(RpcError::resource_exhausted("busy"))
            })
            .spawn()
            .unwrap();
        let name = unique("reply");
        let up_client = node.connect(&upstream).unwrap();
        let svc = node
            .server(&name)
            .transport(t.clone())
            .method("echo", |c| {
                // What the caller sent, back as the answer's metadata.
                let mut m = c.metadata().clone();
                m.insert("served-by", "blocking")?;
                c.set_reply_metadata(md(&[("replaced", "yes")]))?;
                c.set_reply_metadata(m)?;
                Ok(c.take_payload())
            })
            .method("fail", |c| {
                c.set_reply_metadata(md(&[("set", "1")]))?;
                let e = RpcError::invalid_argument("no");
                Err(e.with_metadata(md(&[("carried", "2")])))
            })
            .method("nested", move |c| {
                c.set_reply_metadata(md(&[("hop", "front")]))?;
                up_client.call("busy", Payload::empty())
            })
            .method("too_much", |c| {
                c.set_reply_metadata(md(&[("k", &"x".repeat(20_000))]))?;
                Ok(Payload::from_vec(vec![1]))
            })
            .method_async("echo_async", |c| async move {
                c.set_reply_metadata(md(&[("first-poll", "1")]))?;
                tokio::task::yield_now().await;
                let mut m = c.metadata.clone();
                m.insert("served-by", "async")?;
                c.set_reply_metadata(m)?;
                tokio::task::yield_now().await;
                Ok(c.payload)
            })
            .method_async("fail_async", |c| async move {
                c.set_reply_metadata(md(&[("set", "1")]))?;
                tokio::task::yield_now().await;
                Err(RpcError::unavailable("down").with_metadata(md(&[("carried", "2")])))
            })
            .method_async("from_a_thread", |_| async move {
                let r = std::thread::spawn(|| dm_rpc::metadata::set_reply(md(&[("k", "v")])));
                r.join().unwrap()?;
                Ok(Payload::empty())
            })
            .spawn()
            .unwrap();
        let c = node.connect(&name).unwrap();
        let ac = node.connect_async(&name).unwrap();
        let opts = CallOptions::default();
        let sent = md(&[("trace-id", "t-1"), ("tenant", "a")]);
        for arg in [vec![7u8; 10], big.clone()] {
            for (method, by) in [("echo", "blocking"), ("echo_async", "async")] {
                let mut want = sent.clone();
                want.insert("served-by", by).unwrap();
                let p = Payload::from_vec(arg.clone());
                let r = c.call_full(method, p, opts, sent.clone()).unwrap();
                assert_eq!(r.metadata, want, "{t:?} {method}");
                assert_eq!(r.payload.to_vec().unwrap(), arg, "{t:?} {method}");
                let p = Payload::from_vec(arg.clone());
                let r = rt.block_on(ac.call_full(method, p, opts, sent.clone()));
                let r = r.unwrap();
                assert_eq!(r.metadata, want, "{t:?} {method} async");
                assert_eq!(r.payload.to_vec().unwrap(), arg, "{t:?} {method} async");
            }
        }
        // Errors carry what was set, then what the error carried.
        let both = md(&[("set", "1"), ("carried", "2")]);
        for (method, status) in [
            ("fail", Status::InvalidArgument),
            ("fail_async", Status::Unavailable),
        ] {
            let e = c.call(method, Payload::empty()).unwrap_err();
            assert_eq!((e.status, &e.metadata), (status, &both), "{t:?} {method}");
            let e = rt.block_on(ac.call(method, Payload::empty())).unwrap_err();
            assert_eq!((e.status, &e.metadata), (status, &both), "{t:?} {method}");
        }
        // A nested call's error passes its metadata on.
        let e = c.call("nested", Payload::empty()).unwrap_err();
        let want = md(&[("hop", "front"), ("retry-after-ms", "250")]);
        assert_eq!((e.status, &e.metadata), (Status::ResourceExhausted, &want));
        let e = c.call("too_much", Payload::empty()).unwrap_err();
        assert_eq!(e.status, Status::Internal, "{t:?}: {e}");
        assert!(
            e.metadata.is_empty() && e.message.contains("metadata"),
            "{e}"
        );
        let e = c.call("from_a_thread", Payload::empty()).unwrap_err();
        assert_eq!(e.status, Status::Internal, "{t:?}: {e}");
        assert!(e.message.contains("no call is being served"), "{e}");
        // Calls without metadata get answers without it.
        let r = c.call_full("fail", Payload::empty(), opts, dm_rpc::Metadata::new());
        assert_eq!(r.unwrap_err().metadata, both);
        assert_eq!(c.reconnects(), 0, "{t:?}");

        // The largest answer a transport carries inline, from a server
        // that answers everything it can inline: with metadata beside it,
        // it goes by Ref instead of failing as too large.
        let max = match &t {
            Transport::Shm => dm_rpc::raw::shm::ring_max_inline(node.pool()),
            Transport::Tcp(_) => dm_rpc::raw::tcp::MAX_INLINE,
            Transport::Mem => dm_rpc::raw::mem::MAX_INLINE,
        };
        let edge_name = unique("reply-edge");
        let edge = by_value
            .server(&edge_name)
            .transport(t.clone())
            .method("edge", move |c| {
                let n = u64::from_le_bytes(c.payload().to_vec()?[..8].try_into().unwrap());
                c.set_reply_metadata(md(&[("trace-id", "edge")]))?;
                Ok(Payload::from_vec(pattern(max - n as usize, 9)))
            })
            .spawn()
            .unwrap();
        let ce = node.connect(&edge_name).unwrap();
        for less in [0u64, 1, 64] {
            let arg = Payload::from_vec(less.to_le_bytes().to_vec());
            let r = ce.call_full("edge", arg, opts, dm_rpc::Metadata::new());
            let r = r.unwrap();
            assert_eq!(r.metadata, md(&[("trace-id", "edge")]), "{t:?} {less}");
            let want = pattern(max - less as usize, 9);
            assert_eq!(r.payload.to_vec().unwrap(), want, "{t:?} {less}");
        }
        drop((c, ac, ce));
        edge.shutdown();
        svc.shutdown();
        up.shutdown();
    }
    drop((rt, node, by_value));
    assert_clean_after_pumps(&tp);
}

/// Interceptors run before every handler of a registered method, in
/// order, and their errors (with the metadata they set) are the answer;
/// the keys a server propagates go on to the calls its handlers make
/// (blocking and async), unless the call sets them itself, and the others
/// stay; over every transport.
#[test]
fn interceptors_guard_every_method_and_servers_pass_chosen_metadata_on() {
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;
    let tp = pool();
    let node = Node::new(tp.attach());
    let rt = current_thread_rt();
    for t in every_transport() {
        let up_name = unique("guard-up");
        let up = node
            .server(&up_name)
            .transport(t.clone())
            .method("show", |c| Ok(Payload::from_vec(meta_lines(c.metadata()))))
            .spawn()
            .unwrap();
        let up_client = node.connect(&up_name).unwrap();
        let up_async = node.connect_async(&up_name).unwrap();
        let (seen, admitted, ran) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
        );
        let (seen2, admitted2, ran2, ran3) =
            (seen.clone(), admitted.clone(), ran.clone(), ran.clone());
        let name = unique("guard");
        let svc = node
            .server(&name)
            .transport(t.clone())
            .propagate_metadata(["trace-id", "tenant"])
            .intercept(move |inc| {
                seen2.fetch_add(1, Ordering::Relaxed);
                if inc.metadata().get("token") != Some(&b"secret"[..]) {
                    dm_rpc::metadata::set_reply(md(&[("auth", "token")]))?;
                    return Err(RpcError::unauthenticated("no valid token"));
                }
                Ok(())
            })
            .intercept(move |inc| {
                if inc.method() == "admin" {
                    return Err(RpcError::permission_denied("not for you"));
                }
                if inc.method() == "size" && inc.payload_len() > 1000 {
                    return Err(RpcError::resource_exhausted("too big to admit"));
                }
                admitted2.fetch_add(1, Ordering::Relaxed);
                Ok(())
            })
            .method("relay", move |_| {
                ran2.fetch_add(1, Ordering::Relaxed);
                let own = md(&[("tenant", "own")]);
                let opts = CallOptions::default();
                up_client.call_with_metadata("show", Payload::empty(), opts, own)
            })
            .method_async("relay_async", move |_| {
                let up = up_async.clone();
                async move {
                    tokio::task::yield_now().await;
                    up.call("show", Payload::empty()).await
                }
            })
            .method("admin", move |_| {
                ran3.fetch_add(1, Ordering::Relaxed);
                Ok(Payload::empty())
            })
            .method("size", |c| {
                Ok(Payload::from_vec(c.payload().len().to_le_bytes().to_vec()))
            })
            .spawn()
            .unwrap();
        let c = node.connect(&name).unwrap();
        let ac = node.connect_async(&name).unwrap();
        let opts = CallOptions::default();
        let creds = md(&[("token", "secret"), ("trace-id", "t-9"), ("tenant", "a")]);
        // No token: refused before the handler, with what the check set.
        let e = c.call("relay", Payload::empty()).unwrap_err();
        assert_eq!(
            (e.status, &e.metadata),
            (Status::Unauthenticated, &md(&[("auth", "token")]))
        );
        let bad = md(&[("token", "guess")]);
        let e = c
            .call_full("relay", Payload::empty(), opts, bad)
            .unwrap_err();
        assert_eq!(e.status, Status::Unauthenticated, "{t:?}: {e}");
        assert_eq!(ran.load(Ordering::Relaxed), 0, "{t:?}");
        // Admitted: the upstream call inherits trace-id and tenant (its
        // own tenant kept), not the token.
        let r = c
            .call_full("relay", Payload::empty(), opts, creds.clone())
            .unwrap();
        let got = r.payload.to_vec().unwrap();
        assert_eq!(got, b"tenant=own\ntrace-id=t-9\n", "{t:?}");
        let r = rt.block_on(ac.call_full("relay_async", Payload::empty(), opts, creds.clone()));
        let got = r.unwrap().payload.to_vec().unwrap();
        assert_eq!(got, b"trace-id=t-9\ntenant=a\n", "{t:?}");
        // A client whose calls all carry the token; a call's own wins.
        let authed = c.with_metadata(md(&[("token", "secret")]));
        let got = authed.call("relay", Payload::empty()).unwrap();
        assert_eq!(got.to_vec().unwrap(), b"tenant=own\n", "{t:?}");
        let guess = md(&[("token", "guess")]);
        let e = authed.call_with_metadata("relay", Payload::empty(), opts, guess);
        assert_eq!(e.unwrap_err().status, Status::Unauthenticated, "{t:?}");
        let authed_async = ac.with_metadata(md(&[("token", "secret"), ("trace-id", "c")]));
        let r = rt.block_on(authed_async.call("relay_async", Payload::empty()));
        assert_eq!(r.unwrap().to_vec().unwrap(), b"trace-id=c\n", "{t:?}");
        assert!(
            c.call("relay", Payload::empty()).is_err(),
            "the original has none"
        );
        // The second check.
        let e = c
            .call_full("admin", Payload::empty(), opts, creds.clone())
            .unwrap_err();
        assert_eq!(e.status, Status::PermissionDenied, "{t:?}: {e}");
        assert_eq!(ran.load(Ordering::Relaxed), 2, "{t:?}: admin never ran");
        for (len, ok) in [(10usize, true), (300_000, false)] {
            let p = Payload::from_vec(vec![1; len]);
            let r = c.call_full("size", p, opts, creds.clone());
            assert_eq!(r.is_ok(), ok, "{t:?} {len}");
        }
        // An unknown method is not found, without the checks.
        let before = seen.load(Ordering::Relaxed);
        let e = c
            .call_full("nope", Payload::empty(), opts, creds.clone())
            .unwrap_err();
        assert_eq!(e.status, Status::NotFound, "{t:?}");
        assert_eq!(seen.load(Ordering::Relaxed), before, "{t:?}");
        assert_eq!(
            (
                seen.load(Ordering::Relaxed),
                admitted.load(Ordering::Relaxed)
            ),
            (11, 5)
        );
        // Outside a handler, nothing is inherited.
        let got = node
            .connect(&up_name)
            .unwrap()
            .call("show", Payload::empty())
            .unwrap();
        assert!(got.to_vec().unwrap().is_empty(), "{t:?}");
        drop((c, ac, authed, authed_async));
        svc.shutdown();
        up.shutdown();
    }
    // A check that panics fails the call with Internal; the server goes on.
    let name = unique("guard-panic");
    let svc = node
        .server(&name)
        .intercept(|inc| {
            assert!(inc.metadata().get("boom").is_none(), "boom");
            Ok(())
        })
        .method("m", |_| Ok(Payload::from_vec(vec![1])))
        .spawn()
        .unwrap();
    let c = node.connect(&name).unwrap();
    let boom = md(&[("boom", "1")]);
    let e = c
        .call_full("m", Payload::empty(), CallOptions::default(), boom)
        .unwrap_err();
    assert_eq!(e.status, Status::Internal, "{e}");
    assert!(e.message.contains("interceptor"), "{e}");
    assert_eq!(
        c.call("m", Payload::empty()).unwrap().to_vec().unwrap(),
        [1]
    );
    drop(c);
    svc.shutdown();
    // Keys to propagate are checked.
    let e = node
        .server(&unique("guard-bad"))
        .propagate_metadata(["Trace"])
        .method("m", |_| Ok(Payload::empty()))
        .spawn()
        .unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    drop((rt, node));
    assert_clean_after_pumps(&tp);
}

/// A retry policy sends a call again when its answer has a status the
/// policy lists: as it was (a large payload's Refs stay lent, nothing
/// leaks), up to its attempts, after the server's pushback if it gives
/// one, never past the deadline, and not for statuses it does not list;
/// from blocking and async clients, per call or per client, over every
/// transport.
#[test]
fn a_retry_policy_sends_a_call_again_on_the_statuses_it_lists() {
    use dm_rpc::Retry;
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;
    let tp = pool();
    let node = Node::new(tp.attach());
    let rt = current_thread_rt();
    let big = pattern(300_000, 4);
    let policy = Retry::new(4, &[Status::Unavailable, Status::ResourceExhausted])
        .backoff(Duration::from_millis(1), Duration::from_millis(5));
    for t in every_transport() {
        let calls = Arc::new(AtomicU64::new(0));
        let (flaky, busy) = (calls.clone(), calls.clone());
        let (stop, bad, slow) = (calls.clone(), calls.clone(), calls.clone());
        // (Whose turn it is to answer, of flaky's three.)
        let turn = Arc::new(AtomicU64::new(0));
        let turn_of = turn.clone();
        let name = unique("retry");
        let svc = node
            .server(&name)
            .transport(t.clone())
            // Fails twice in three, then answers the payload's sum.
            .method("flaky", move |c| {
                flaky.fetch_add(1, Ordering::Relaxed);
                if turn.fetch_add(1, Ordering::Relaxed) % 3 != 2 {
                    return Err(RpcError::unavailable("not now"));
                }
                Ok(Payload::from_vec(sum(c.payload()).to_le_bytes().to_vec()))
            })
            .method("busy", move |c| {
                busy.fetch_add(1, Ordering::Relaxed);
                c.set_reply_metadata(md(&[("retry-after-ms", "40")]))?;
                Err(RpcError::resource_exhausted("busy"))
            })
            .method("stop", move |c| {
                stop.fetch_add(1, Ordering::Relaxed);
                c.set_reply_metadata(md(&[("retry-after-ms", "never")]))?;
                Err(RpcError::unavailable("down for good"))
            })
            .method("bad", move |_| {
                bad.fetch_add(1, Ordering::Relaxed);
                Err(RpcError::invalid_argument("no"))
            })
            .method("slow_fail", move |c| {
                slow.fetch_add(1, Ordering::Relaxed);
                c.set_reply_metadata(md(&[("retry-after-ms", "3000")]))?;
                Err(RpcError::unavailable("later"))
            })
            .spawn()
            .unwrap();
        let c = node.connect(&name).unwrap();
        let ac = node.connect_async(&name).unwrap();
        let opts = CallOptions::default().retry(policy);
        let attempts = |f: &dyn Fn()| {
            let before = calls.load(Ordering::Relaxed);
            f();
            calls.load(Ordering::Relaxed) - before
        };
        let want = sum(&Payload::from_vec(big.clone())).to_le_bytes().to_vec();
        for arg in [vec![5u8; 10], big.clone()] {
            let want = sum(&Payload::from_vec(arg.clone())).to_le_bytes().to_vec();
            let n = attempts(&|| {
                let got = c.call_with("flaky", Payload::from_vec(arg.clone()), opts);
                assert_eq!(got.unwrap().to_vec().unwrap(), want, "{t:?}");
            });
            assert_eq!(n, 3, "{t:?}");
            let n = attempts(&|| {
                let p = Payload::from_vec(arg.clone());
                let got = rt.block_on(ac.call_with("flaky", p, opts));
                assert_eq!(got.unwrap().to_vec().unwrap(), want, "{t:?} async");
            });
            assert_eq!(n, 3, "{t:?} async");
        }
        // Without a policy, the first failure is the answer.
        let n = attempts(&|| {
            let e = c.call("flaky", Payload::empty()).unwrap_err();
            assert_eq!(e.status, Status::Unavailable);
        });
        assert_eq!(n, 1, "{t:?}");
        turn_of.store(0, Ordering::Relaxed);
        // Pushback: 40 ms between its four attempts; the last answer wins.
        let t0 = Instant::now();
        let n = attempts(&|| {
            let e = c.call_with("busy", Payload::from_vec(big.clone()), opts);
            let e = e.unwrap_err();
            assert_eq!(e.status, Status::ResourceExhausted);
            assert_eq!(e.metadata, md(&[("retry-after-ms", "40")]));
        });
        assert_eq!(n, 4, "{t:?}");
        assert!(t0.elapsed() >= Duration::from_millis(120), "{t:?}");
        // A pushback that is not a number stops; an unlisted status too.
        for method in ["stop", "bad"] {
            let n = attempts(&|| assert!(c.call_with(method, Payload::empty(), opts).is_err()));
            assert_eq!(n, 1, "{t:?} {method}");
        }
        // A wait that would outlast the deadline is not waited.
        let t0 = Instant::now();
        let short = opts;
        let short = CallOptions {
            deadline: Some(Duration::from_millis(1000)),
            ..short
        };
        let n = attempts(&|| {
            let e = c
                .call_with("slow_fail", Payload::empty(), short)
                .unwrap_err();
            assert_eq!(e.status, Status::Unavailable, "the server's answer");
        });
        assert_eq!(n, 1, "{t:?}");
        assert!(t0.elapsed() < Duration::from_millis(2500), "{t:?}");
        // The client's policy, for calls that set none.
        let retrying = c.with_retry(policy);
        let n = attempts(&|| {
            let got = retrying.call("flaky", big.clone()).unwrap();
            assert_eq!(got.to_vec().unwrap(), want, "{t:?}");
        });
        assert_eq!(n, 3, "{t:?}");
        let retrying_async = ac.with_retry(policy);
        let n = attempts(&|| {
            let got = rt.block_on(retrying_async.call("flaky", big.clone()));
            assert_eq!(got.unwrap().to_vec().unwrap(), want, "{t:?}");
        });
        assert_eq!(n, 3, "{t:?}");
        // An async call dropped while it waits to go again releases what
        // it lent (the pool is checked clean below).
        let p = Payload::from_vec(big.clone());
        let dropped = rt.block_on(async {
            tokio::time::timeout(Duration::from_millis(10), ac.call_with("busy", p, opts)).await
        });
        assert!(dropped.is_err(), "{t:?}: timed out");
        drop((c, ac, retrying, retrying_async));
        svc.shutdown();
    }
    drop((rt, node));
    assert_clean_after_pumps(&tp);
}

type RawPair = (
    Box<dyn dm_rpc::raw::Listener>,
    dm_rpc::raw::Connection,
    Option<dm_pool::ServiceInfo>,
);

/// A listener and a client connection to it, on transport `t` (with the
/// registration to remove, over shared memory).
fn raw_pair(node: &Node, t: &Transport) -> RawPair {
    use dm_rpc::raw::{mem, shm, tcp, Listener};
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let name = unique("raw");
    match t {
        Transport::Shm => {
            let svc = node
                .pool()
                .register(&name, &dm_pool::Endpoint::Shm)
                .unwrap();
            let l = shm::ShmListener::new(node.pool(), svc.clone(), WaitPolicy::default(), stop, 0);
            let c = shm::connect(node.pool(), &svc, WaitPolicy::default()).unwrap();
            (Box::new(l.unwrap()), c, Some(svc))
        }
        Transport::Tcp(_) => {
            let me = tcp::Identity::default();
            let spin = dm_rpc::DEFAULT_TCP_SPIN;
            let mut l =
                tcp::TcpListener::bind("127.0.0.1:0", me, stop, spin, Default::default()).unwrap();
            let addr = l.local_addr().to_string();
            // The hello is answered by the listener's turns.
            let c = std::thread::scope(|s| {
                let c = s.spawn(|| tcp::connect(&addr, me, Duration::from_secs(5), spin));
                while !c.is_finished() {
                    l.next(Some(Instant::now() + Duration::from_millis(1)))
                        .unwrap();
                }
                c.join().unwrap().unwrap()
            });
            (Box::new(l), c, None)
        }
        Transport::Mem => {
            let l = mem::bind(&name, stop).unwrap();
            (Box::new(l), mem::connect(&name).unwrap(), None)
        }
    }
}

/// Three streaming requests from tasks of one client, their grants sent
/// after all three requests (the order concurrent callers give): a
/// stream's grant reaches its server as the stream runs, though a later
/// request waits for the stream to end (held by the shared-memory
/// listener). Before, the grant stayed held behind that request, and the
/// stream waited for it forever.
#[test]
fn a_streams_grant_is_not_held_behind_a_later_request() {
    let tp = pool();
    let node = Node::new(tp.attach());
    for t in every_transport() {
        let (mut l, mut c, reg) = raw_pair(&node, &t);
        let mut frames = Vec::new();
        for id in [1, 2, 3] {
            let mut f =
                dm_rpc::Frame::request(id, 1, 0, dm_rpc::Body::Inline(vec![id as u8].into()));
            f.flags |= dm_rpc::frame::FLAG_STREAM;
            frames.push(f);
        }
        frames.insert(1, dm_rpc::Frame::credit(1, 4));
        frames.extend([2, 3].map(|id| dm_rpc::Frame::credit(id, 4)));
        for f in &frames {
            assert!(c.tx.send(f, None).unwrap(), "{t:?}");
        }
        // The server reads what is there, then answers each stream that
        // has its grant (as a running stream's sink reads its server's
        // connections while it waits for credit).
        let (mut requests, mut granted, mut answered) = (Vec::new(), Vec::new(), Vec::new());
        let until = Instant::now() + Duration::from_secs(5);
        let mut conn = None;
        while answered.len() < 3 {
            let soon = Instant::now() + Duration::from_millis(5);
            match l.next(Some(soon)).unwrap() {
                Some((from, f)) => {
                    conn = Some(from);
                    match f.kind {
                        dm_rpc::Kind::Request => requests.push(f.call_id),
                        dm_rpc::Kind::Credit => granted.push(f.call_id),
                        _ => panic!("{t:?}: {f:?}"),
                    }
                }
                None => {
                    let Some(conn) = conn else { continue };
                    for id in requests.clone() {
                        if granted.contains(&id) && !answered.contains(&id) {
                            let end = dm_rpc::Frame::response(id, Status::Ok, dm_rpc::Body::None);
                            l.reply(conn, &end).unwrap();
                            answered.push(id);
                        }
                    }
                }
            }
            assert!(
                Instant::now() < until,
                "{t:?}: requests {requests:?}, grants {granted:?}: a stream waits for its grant"
            );
        }
        assert_eq!(answered, [1, 2, 3], "{t:?}");
        for id in [1, 2, 3] {
            let got = c.rx.recv(Some(until)).unwrap().unwrap();
            assert_eq!(got.call_id, id, "{t:?}");
        }
        drop((l, c));
        if let Some(svc) = reg {
            node.pool().unregister(&svc).unwrap();
        }
    }
}

/// A listener that takes the first of three requests and goes away tells
/// the client just that: the other two were never taken (transport level;
/// over TCP the three are in the server's buffer already).
#[test]
fn a_listener_that_goes_away_says_which_requests_it_took() {
    let tp = pool();
    let node = Node::new(tp.attach());
    for t in every_transport() {
        let (mut l, mut c, reg) = raw_pair(&node, &t);
        for id in [7, 8, 9] {
            let f =
                dm_rpc::Frame::request(id, 1, 0, dm_rpc::Body::Inline(vec![id as u8; 100].into()));
            assert!(c.tx.send(&f, None).unwrap(), "{t:?}");
        }
        let until = Instant::now() + Duration::from_secs(5);
        let (conn, first) = loop {
            let soon = Instant::now() + Duration::from_millis(5);
            if let Some(x) = l.next(Some(soon)).unwrap() {
                break x;
            }
            assert!(Instant::now() < until, "{t:?}: nothing came");
        };
        assert_eq!(first.call_id, 7, "{t:?}");
        // Its answer goes before the go-away.
        let answer = dm_rpc::Frame::response(7, Status::Ok, dm_rpc::Body::None);
        l.reply(conn, &answer).unwrap();
        assert!(!c.goaway.unread(8), "{t:?}: said before the server spoke");
        l.go_away();
        drop(l);
        let got = c.rx.recv(Some(until)).unwrap().unwrap();
        assert_eq!(got.call_id, 7, "{t:?}");
        let e = loop {
            match c.rx.recv(Some(until)) {
                Err(e) => break e,
                Ok(x) => assert!(x.is_none() && Instant::now() < until, "{t:?}: {x:?}"),
            }
        };
        assert!(
            matches!(e, dm_rpc::raw::TransportError::Unavailable(_)),
            "{t:?}: {e}"
        );
        let unread: Vec<bool> = [6, 7, 8, 9].iter().map(|&id| c.goaway.unread(id)).collect();
        assert_eq!(unread, [false, false, true, true], "{t:?}");
        if let Some(svc) = reg {
            node.pool().unregister(&svc).unwrap();
        }
    }
    drop(node);
    tp.assert_clean();
}

/// A client that dials a registration it looked up just before its server
/// stopped is told so at once: the channel would never be accepted, and
/// its calls would wait out their deadlines.
#[test]
fn dialling_a_server_that_just_stopped_fails_at_once() {
    let tp = pool();
    let node = Node::new(tp.attach());
    let name = unique("stale");
    let svc = spawn_svc(&node, &name, &Transport::Shm);
    let info = node.pool().lookup(&name).unwrap().unwrap();
    svc.shutdown();
    let r = dm_rpc::raw::shm::connect(node.pool(), &info, WaitPolicy::default());
    let Err(e) = r else {
        panic!("connected to a stopped server")
    };
    assert!(
        matches!(e, dm_rpc::raw::TransportError::Unavailable(_)),
        "{e}"
    );
    drop(node);
    tp.assert_clean();
}

/// A server stopped at once (`shutdown`, no drain) while requests wait in
/// its connections, unread behind a running call: it tells each client
/// which requests it took (the go-away), so the others go to the server
/// registered next, with their Refs, and none fails; without a successor
/// they fail with `Unavailable` and lend nothing any more.
#[test]
fn requests_a_stopped_server_never_took_go_to_its_successor() {
    let tp = pool();
    let node = Node::new(tp.attach());
    let rt = current_thread_rt();
    let ready = CallOptions::deadline(Duration::from_secs(20)).wait_for_ready();
    let big = pattern(300_000, 9);
    for t in every_transport() {
        let name = unique("goaway");
        let (old, running) = draining_svc(&node, &name, &t);
        let c = node.connect(&name).unwrap();
        let ac = node.connect_async(&name).unwrap();
        let small = node.connect(&name).unwrap();
        rt.block_on(ac.call("echo", vec![1u8])).unwrap();
        std::thread::scope(|s| {
            let hold = s.spawn(|| c.call("hold", vec![2u8; 100]));
            started(&running, "hold");
            // Sent while the one dispatcher runs `hold`: not read yet.
            let queued: Vec<_> = (0..3)
                .map(|_| {
                    let c = c.clone();
                    s.spawn(move || c.call_with("who", Payload::empty(), ready))
                })
                .collect();
            let by_ref = s.spawn(|| {
                let arg = Payload::from_vec(big.clone());
                small.call_with("echo", arg, ready)
            });
            let asynced = s.spawn(|| rt.block_on(ac.call_with("who", Payload::empty(), ready)));
            // Sent again with its metadata.
            let meta = dm_rpc::Metadata::new().with("trace-id", "t7").unwrap();
            let with_meta = s.spawn(|| c.call_with_metadata("meta", Payload::empty(), ready, meta));
            std::thread::sleep(Duration::from_millis(100));
            // Waits for `hold` (a running blocking handler finishes).
            old.shutdown();
            let new = node
                .server(&name)
                .transport(t.clone())
                .method("who", |_| Ok(Payload::from_vec(b"new".to_vec())))
                .method("echo", |c| Ok(c.take_payload()))
                .method("meta", |c| Ok(Payload::from_vec(meta_lines(c.metadata()))))
                .spawn()
                .unwrap();
            assert_eq!(
                hold.join().unwrap().unwrap().to_vec().unwrap(),
                [2u8; 100],
                "{t:?}"
            );
            let got = with_meta.join().unwrap().unwrap().to_vec().unwrap();
            assert_eq!(got, b"trace-id=t7\n", "{t:?}");
            for q in queued {
                let got = q.join().unwrap();
                assert_eq!(got.unwrap().to_vec().unwrap(), b"new", "{t:?}");
            }
            let got = asynced.join().unwrap();
            assert_eq!(got.unwrap().to_vec().unwrap(), b"new", "{t:?}");
            assert_eq!(
                by_ref.join().unwrap().unwrap().to_vec().unwrap(),
                big,
                "{t:?}"
            );
            assert_eq!(
                (c.reconnects(), ac.reconnects(), small.reconnects()),
                (1, 1, 1),
                "{t:?}"
            );
            // Without a successor, the request fails and its Ref is
            // released (the pool is checked clean below).
            let (held, running) = draining_svc(&node, &unique("goaway"), &t);
            let c = node.connect(held.name()).unwrap();
            let c2 = c.clone();
            let hold = s.spawn(move || c2.call("hold", vec![3u8]));
            started(&running, "hold");
            let arg = Payload::from_vec(big.clone());
            let alone = s.spawn(move || c.call("echo", arg));
            std::thread::sleep(Duration::from_millis(100));
            held.shutdown();
            assert!(hold.join().unwrap().is_ok(), "{t:?}");
            let e = alone.join().unwrap().unwrap_err();
            assert_eq!(e.status, Status::Unavailable, "{t:?}: {e}");
            new.shutdown();
        });
        drop((c, ac, small));
    }
    drop((rt, node));
    assert_clean_after_pumps(&tp);
}

/// A client made before its service exists: calls fail at once with
/// `Unavailable`, or wait for the service with `wait_for_ready`, until it
/// registers; then the client is connected.
#[test]
fn a_lazy_client_connects_once_its_service_is_registered() {
    let tp = pool();
    let node = Node::new(tp.attach());
    let rt = current_thread_rt();
    let ready = |ms| CallOptions::deadline(Duration::from_millis(ms)).wait_for_ready();
    let e = node.connect_lazily("not a name!").unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    let big = pattern(300_000, 5);
    for t in every_transport() {
        let name = unique("lazy");
        let c = node.connect_lazily(&name).unwrap();
        let ac = node.connect_async_lazily(&name).unwrap();
        assert!(!c.is_connected());
        let e = c.call("echo", vec![1u8]).unwrap_err();
        assert_eq!(e.status, Status::Unavailable, "{t:?}: {e}");
        let e = rt.block_on(ac.call("echo", vec![1u8])).unwrap_err();
        assert_eq!(e.status, Status::Unavailable, "{t:?}: {e}");
        let e = c
            .call_with("echo", Payload::from_vec(vec![1]), ready(100))
            .unwrap_err();
        assert_eq!(e.status, Status::DeadlineExceeded, "{t:?}: {e}");
        // Registered 150 ms from now: calls waiting for it get through.
        let (svc, got, agot) = std::thread::scope(|s| {
            let up = s.spawn(|| {
                std::thread::sleep(Duration::from_millis(150));
                spawn_svc(&node, &name, &t)
            });
            let waiter = s.spawn(|| {
                rt.block_on(ac.call_with("echo", Payload::from_vec(vec![3]), ready(5000)))
            });
            let p = Payload::from_vec(big.clone());
            let got = c.call_with("echo", p, ready(5000));
            (up.join().unwrap(), got, waiter.join().unwrap())
        });
        assert_eq!(got.unwrap().to_vec().unwrap(), big, "{t:?}");
        assert_eq!(agot.unwrap().to_vec().unwrap(), [3], "{t:?}");
        assert!(c.is_connected(), "{t:?}");
        assert_eq!((c.reconnects(), ac.reconnects()), (0, 0), "{t:?}");
        // By Ref, as a client connected at once.
        let (len, by_ref, _) = inspect(&node, &c, big.clone());
        assert_eq!((len, by_ref), (big.len() as u64, true), "{t:?}");
        drop((c, ac));
        svc.shutdown();
    }
    drop((rt, node));
    assert_clean_after_pumps(&tp);
}

/// Eight calls of one connection run at once in an async server: each
/// handler waits until all eight have arrived. Over shared memory the
/// server keeps room in the connection for every answer it owes: the
/// largest answer's room for the first call, a small answer's for the
/// others (their answers above it go by Ref), so eight fit a 256 KiB
/// ring where two full ones used to. Answers of every size arrive whole,
/// inline or by Ref, and the pool is clean after.
#[test]
fn eight_async_calls_of_one_connection_run_at_once() {
    for t in every_transport() {
        let tp = pool();
        {
            let node = Node::new(tp.attach());
            let name = unique("eight-at-once");
            let arrived = std::sync::Arc::new(AtomicU32::new(0));
            let a = arrived.clone();
            let s = node
                .server(&name)
                .transport(t.clone())
                .method_async("gate", move |c| {
                    let a = a.clone();
                    async move {
                        a.fetch_add(1, Ordering::SeqCst);
                        let until = Instant::now() + Duration::from_secs(5);
                        while !a.load(Ordering::SeqCst).is_multiple_of(8) {
                            if Instant::now() > until {
                                let n = a.load(Ordering::SeqCst);
                                return Err(RpcError::deadline_exceeded(format!(
                                    "{n} calls in progress, not 8"
                                )));
                            }
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                        Ok(c.payload)
                    }
                })
                .spawn()
                .unwrap();
            let c = node.connect(&name).unwrap();
            for round in 0..3u8 {
                std::thread::scope(|sc| {
                    let calls: Vec<_> = (0..8u8)
                        .map(|k| {
                            let c = c.clone();
                            sc.spawn(move || {
                                // 10 B to 60 KiB: inline, and above the small room.
                                let data = pattern(10 + k as usize * 8600, k + round);
                                let back = c.call("gate", data.clone())?;
                                assert_eq!(back.to_vec().unwrap(), data);
                                Ok::<bool, RpcError>(back.in_pool())
                            })
                        })
                        .collect();
                    let by_ref = calls
                        .into_iter()
                        .map(|h| h.join().unwrap().unwrap_or_else(|e| panic!("{t:?}: {e}")))
                        .filter(|&r| r)
                        .count();
                    // (Over shared memory, the answers above the small
                    // room: by Ref.)
                    let shm = matches!(t, Transport::Shm);
                    assert_eq!(by_ref > 0, shm, "{t:?}: {by_ref} answers by Ref");
                });
            }
            assert_eq!(arrived.load(Ordering::SeqCst), 24, "{t:?}");
            drop(c);
            s.shutdown();
        }
        tp.assert_clean();
    }
}

/// A caller sends a buffer and keeps it (`Buffer::dup`): the callee keeps
/// what it got, and the caller's later writes never reach it.
#[test]
fn a_caller_sends_a_buffer_and_keeps_it() {
    use std::sync::{Arc, Mutex};
    let tp = TempPool::new(64 << 20);
    let node = Node::new(tp.attach());
    let name = unique("keep");
    // The callee keeps what it received, inline or by Ref, in one way, and
    // writes into it later.
    let kept: Arc<Mutex<Option<Payload>>> = Arc::new(Mutex::new(None));
    let (k1, k2, k3) = (kept.clone(), kept.clone(), kept.clone());
    let svc = node
        .server(&name)
        .method("keep", move |call| {
            *k1.lock().unwrap() = Some(call.take_payload().keep()?);
            Ok(Payload::empty())
        })
        .method("edit", move |_| {
            let mut k = k2.lock().unwrap();
            k.as_mut().expect("nothing kept").write(0, &[0xAA])?;
            Ok(Payload::empty())
        })
        .method("read", move |_| {
            k3.lock().unwrap().take().expect("nothing kept").keep()
        })
        .spawn()
        .unwrap();
    let client = node.connect(&name).unwrap();
    // Inline (below the default threshold) and by Ref (above it).
    for len in [1000, 256 << 10] {
        let mut buf = node.pool().alloc(len as u64).unwrap();
        buf.write(0, &vec![1u8; len]).unwrap();
        client.call("keep", buf.dup().unwrap()).unwrap();
        // The caller still has its buffer, and writes it again.
        buf.write(0, &vec![2u8; len]).unwrap();
        buf.write(len as u64 - 1, &[3]).unwrap();
        client.call("edit", Payload::empty()).unwrap();
        let seen = client
            .call("read", Payload::empty())
            .unwrap()
            .to_vec()
            .unwrap();
        let mut want = vec![1u8; len];
        want[0] = 0xAA;
        assert!(
            seen == want,
            "{len}: the callee saw the caller's later writes"
        );
        let mine = buf.to_vec().unwrap();
        assert_eq!(
            (mine[0], mine[len - 2], mine[len - 1]),
            (2, 2, 3),
            "{len}: the caller saw the callee's write"
        );
    }
    drop(client);
    svc.shutdown();
    drop(node);
    tp.assert_clean();
}

/// A name a live server holds: a second server is refused with
/// `AlreadyExists` (saying what to do), one that waits past its deadline
/// is refused saying how long it waited, and one that waits gets the name
/// once the holder stops; over every transport.
#[test]
fn a_name_held_by_a_live_server_is_refused_or_waited_for() {
    for t in every_transport() {
        let tp = pool();
        let node = Node::new(tp.attach());
        let name = unique("held");
        let echo = |c: &mut dm_rpc::Call| Ok(c.take_payload());
        let holder = node
            .server(&name)
            .transport(t.clone())
            .method("echo", echo)
            .spawn()
            .unwrap();
        let e = node.server(&name).transport(t.clone()).spawn().unwrap_err();
        assert_eq!(e.status, Status::AlreadyExists, "{t:?}: {e}");
        assert!(e.message.contains("wait_for_name"), "{t:?}: {e}");
        let t0 = Instant::now();
        let e = node
            .server(&name)
            .transport(t.clone())
            .wait_for_name(Duration::from_millis(100))
            .spawn()
            .unwrap_err();
        assert_eq!(e.status, Status::AlreadyExists, "{t:?}: {e}");
        assert!(e.message.contains("waited"), "{t:?}: {e}");
        assert!(t0.elapsed() >= Duration::from_millis(100));
        let (n2, t2, name2) = (node.clone(), t.clone(), name.clone());
        let waiter = std::thread::spawn(move || {
            n2.server(&name2)
                .transport(t2)
                .method("echo", echo)
                .wait_for_name(Duration::from_secs(30))
                .spawn()
        });
        std::thread::sleep(Duration::from_millis(50));
        drop(holder);
        let successor = waiter.join().unwrap().unwrap();
        let c = node.connect(&name).unwrap();
        assert_eq!(
            c.call("echo", vec![7u8; 3]).unwrap().to_vec().unwrap(),
            [7, 7, 7]
        );
        drop((c, successor, node));
        tp.assert_clean();
    }
}

/// What a `how` handler answers: whether its argument came by Ref, and
/// its length and hash.
fn how(c: &mut dm_rpc::Call) -> Result<Payload, RpcError> {
    let p = c.payload();
    let mut v = vec![p.in_pool() as u8];
    v.extend_from_slice(&p.len().to_le_bytes());
    v.extend_from_slice(&sum(p).to_le_bytes());
    Ok(Payload::from_vec(v))
}

/// A node that asks for by value sends every payload inline, whatever
/// its size, over every transport that carries it (checked on the
/// receiver): over shared memory a frame longer than a ring's record goes
/// in parts, both ways. It forwards a payload that came by Ref as bytes.
/// A payload too large for the connection fails its call with a message
/// that says what to do, and never travels by Ref instead.
#[test]
fn by_value_goes_inline_at_any_size_or_fails_saying_why() {
    let big = common::pattern(6 << 20, 3);
    let check = |got: Payload, data: &[u8], by_ref: bool| {
        let v = got.to_vec().unwrap();
        assert_eq!(v[0] == 1, by_ref, "by Ref");
        assert_eq!(
            u64::from_le_bytes(v[1..9].try_into().unwrap()),
            data.len() as u64
        );
        assert_eq!(
            u64::from_le_bytes(v[9..17].try_into().unwrap()),
            sum(&Payload::from(data))
        );
    };
    // Default rings (256 KiB): a record takes at most half a ring.
    let tp = pool();
    let value = Node::with_config(tp.attach(), Config::by_value());
    let name = unique("by-value");
    let svc = value
        .server(&name)
        .method("how", how)
        .method("echo", |c| Ok(c.take_payload()))
        .spawn()
        .unwrap();
    let c = value.connect(&name).unwrap();
    let small = common::pattern(100 << 10, 1); // above the default threshold
    check(c.call("how", small.clone()).unwrap(), &small, false);
    // 6 MiB both ways, in parts, many at once.
    check(c.call("how", big.clone()).unwrap(), &big, false);
    std::thread::scope(|s| {
        for k in 0..3u8 {
            let (c, v) = (c.clone(), common::pattern((3 << 20) + k as usize, k));
            s.spawn(move || {
                let back = c.call("echo", v.clone()).unwrap();
                assert!(!back.in_pool());
                assert!(back.to_vec().unwrap() == v, "echo {k}");
            });
        }
    });
    // Beyond what a connection carries: refused, saying what to do.
    let huge = vec![0u8; (64 << 20) + 1];
    let e = c.call("how", huge).unwrap_err();
    assert_eq!(e.status, Status::ResourceExhausted, "{e}");
    assert!(e.message.contains("by Ref"), "{e}");
    // The connection is fine after the refusal.
    check(c.call("how", small.clone()).unwrap(), &small, false);
    // A pool buffer, and a Ref forwarded by a by-value node, go as bytes.
    let mut b = tp.attach().alloc(small.len() as u64).unwrap();
    b.write(0, &small).unwrap();
    check(c.call("how", b).unwrap(), &small, false);
    let by_ref = Node::new(tp.attach());
    let relay_name = unique("relay");
    let (v2, to) = (value.clone(), name.clone());
    let relay = value
        .server(&relay_name)
        .method("fwd", move |call| {
            let next = v2.connect(&to)?;
            next.call("how", call.payload().forward()?)
        })
        .spawn()
        .unwrap();
    let rc = by_ref.connect(&relay_name).unwrap();
    check(rc.call("fwd", big.clone()).unwrap(), &big, false);
    // Without by_value the same call goes by Ref (the threshold rule).
    let svc2 = by_ref
        .server(&unique("sized"))
        .method("how", how)
        .spawn()
        .unwrap();
    let c2 = by_ref.connect(svc2.name()).unwrap();
    check(c2.call("how", big.clone()).unwrap(), &big, true);
    drop((rc, relay, c, svc, c2, svc2, by_ref));
    // TCP carries 6 MiB by value too (its frames, up to 16 MiB).
    let svc = value
        .server(&name)
        .transport(Transport::Tcp("127.0.0.1:0".into()))
        .method("how", how)
        .spawn()
        .unwrap();
    let c = value.connect(&name).unwrap();
    check(c.call("how", big.clone()).unwrap(), &big, false);
    drop((c, svc, value));
    tp.assert_clean();
}

/// A name nobody serves: `NotFound`, saying where to look and how to wait.
#[test]
fn connecting_to_a_missing_service_says_where_to_look() {
    let tp = pool();
    let node = Node::new(tp.attach());
    let e = node.connect(&unique("missing")).unwrap_err();
    assert_eq!(e.status, Status::NotFound, "{e}");
    assert!(
        e.message.contains("dmrpc ls") && e.message.contains("wait_for_ready"),
        "{e}"
    );
    let e = node.connect_balanced(&unique("missing")).unwrap_err();
    assert!(e.message.contains("dmrpc ls"), "{e}");
}

/// Over TCP, pool Refs go only to a peer that proves it is attached to
/// the pool: one that claims the pool id (a hello discloses it) without
/// the pool's secret gets a large answer by value, never a Ref it could
/// not release; a node of the pool gets it by Ref.
#[test]
fn a_tcp_peer_that_claims_the_pool_without_proof_gets_values() {
    use std::io::{Read, Write};
    let (tp, node, svc, addr) = tcp_service("tcp-claim");
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    use dm_rpc::raw::tcp::{HELLO, HELLO_LEN, PROOFS_LEN};
    let mut hello = HELLO.to_vec();
    hello.extend_from_slice(&node.pool().id().to_le_bytes()); // the claim
    hello.extend_from_slice(&0u64.to_le_bytes());
    hello.extend_from_slice(&[7u8; 16]);
    hello.resize(HELLO_LEN, 0);
    s.write_all(&hello).unwrap();
    let mut theirs = [0u8; HELLO_LEN + PROOFS_LEN];
    s.read_exact(&mut theirs).unwrap();
    s.write_all(&[9u8; PROOFS_LEN]).unwrap(); // not proofs
    let big = vec![5u8; 1 << 20];
    let req = dm_rpc::Frame::request(
        1,
        dm_rpc::frame::method_id("echo"),
        0,
        dm_rpc::Body::Inline(big.clone().into()),
    );
    s.write_all(&req.encode()).unwrap();
    let f = read_frame(&mut s, &mut Vec::new());
    assert_eq!(f.status, Status::Ok, "{f:?}");
    match &f.payload {
        dm_rpc::Body::Inline(b) => assert!(b[..] == big[..]),
        other => panic!("the unproved peer got {other:?}"),
    }
    drop(s);
    // A node of the pool proves it, and gets the answer by Ref.
    let c = node.connect_tcp(&addr).unwrap();
    let back = c.call("echo", big.clone()).unwrap();
    assert!(back.in_pool(), "a proved peer shares the pool");
    assert!(back.to_vec().unwrap() == big);
    drop((back, c));
    close(tp, node, svc);
}

/// A connection's calls share one `Peer`; the disconnect hook runs once
/// for each connection that made calls, when it closes or when the
/// server stops.
fn disconnect_hook(t: Transport) {
    use std::collections::hash_map::DefaultHasher;
    use std::hash::{Hash, Hasher};
    use std::sync::{Arc, Mutex};
    fn key(p: dm_rpc::Peer) -> u64 {
        let mut h = DefaultHasher::new();
        p.hash(&mut h);
        h.finish()
    }
    let tp = pool();
    let node = Node::new(tp.attach());
    let name = unique("peers");
    let gone = Arc::new(Mutex::new(Vec::new()));
    let g = gone.clone();
    let svc = node
        .server(&name)
        .method("who", |c| {
            Ok(Payload::from_vec(key(c.peer()).to_le_bytes().to_vec()))
        })
        .method_async("who_async", |c| async move {
            Ok(Payload::from_vec(key(c.peer).to_le_bytes().to_vec()))
        })
        .on_disconnect(move |p| g.lock().unwrap().push(key(p)))
        .transport(t)
        .spawn()
        .unwrap();
    let who = |c: &dm_rpc::Client, m: &str| {
        let a = c.call(m, Payload::empty()).unwrap().to_vec().unwrap();
        u64::from_le_bytes(a.try_into().unwrap())
    };
    let (c1, c2, c3) = (
        node.connect(&name).unwrap(),
        node.connect(&name).unwrap(),
        node.connect(&name).unwrap(),
    );
    let p1 = who(&c1, "who");
    assert_eq!(who(&c1, "who_async"), p1, "one connection, one peer");
    let p2 = who(&c2, "who");
    let p3 = who(&c3, "who_async");
    assert!(p1 != p2 && p2 != p3 && p1 != p3);
    let wait_for = |n: usize| {
        let start = Instant::now();
        while gone.lock().unwrap().len() < n {
            assert!(start.elapsed() < Duration::from_secs(5), "no hook ran");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    drop(c1);
    wait_for(1);
    assert_eq!(*gone.lock().unwrap(), [p1]);
    drop(c2);
    wait_for(2);
    assert_eq!(*gone.lock().unwrap(), [p1, p2]);
    // The last is still open when the server stops: it ends with it.
    svc.shutdown();
    assert_eq!(*gone.lock().unwrap(), [p1, p2, p3], "once each");
    drop(c3);
    drop(node);
    tp.assert_clean();
}

#[test]
fn a_disconnect_hook_runs_once_per_connection_over_every_transport() {
    for t in every_transport() {
        disconnect_hook(t);
    }
}

//! The async client over every transport: many calls outstanding on one
//! connection, deadlines, and a server that goes away.
#![allow(clippy::unwrap_used)]

use dm_pool::testing::TempPool;
use dm_pool::PoolConfig;
use dm_rpc::{CallOptions, Config, Node, Payload, RpcError, Status, Transport, WaitPolicy};
use std::time::Duration;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Who reads the answers of the suite's client.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Reads {
    /// The default policy: calls read while they spin, then the pump.
    Either,
    /// Spins long enough for every answer: the calls alone (no pump
    /// thread is ever started).
    Calls,
    /// No spin: a call takes its answer only if it is there when it first
    /// looks; the pump thread waits for the others.
    Pump,
}

fn suite(t: Transport, tag: &str, reads: Reads) {
    let tp = TempPool::with(PoolConfig {
        size: 256 << 20,
        channels: Some(8),
        ..Default::default()
    });
    let wait = match reads {
        Reads::Either => WaitPolicy::default(),
        Reads::Calls => WaitPolicy {
            spin: Duration::from_secs(30),
            adaptive: false,
            ..WaitPolicy::default()
        },
        Reads::Pump => WaitPolicy::park_only(),
    };
    let node = Node::with_config(
        tp.attach(),
        Config {
            wait,
            ..Config::default()
        },
    );
    let name = format!("async/{tag}/{}", std::process::id());
    let svc = node
        .server(&name)
        .transport(t)
        .method("len", |c| {
            Ok(Payload::from_vec(c.payload().len().to_le_bytes().to_vec()))
        })
        .method("sleep", |_| {
            std::thread::sleep(Duration::from_millis(300));
            Ok(Payload::empty())
        })
        .method("fail", |_| Err(RpcError::invalid_argument("no")))
        .spawn()
        .unwrap();
    // A TCP service is also reached by its address (another host's).
    let c = match svc.tcp_addr() {
        Some(addr) if reads != Reads::Either => node.connect_tcp_async(addr).unwrap(),
        _ => node.connect_async(&name).unwrap(),
    };
    rt().block_on(async {
        // 200 calls in flight at once, small and large, on one connection.
        let mut set = tokio::task::JoinSet::new();
        for i in 0..200usize {
            let c = c.clone();
            set.spawn(async move {
                let len = if i % 20 == 0 { 300_000 } else { i };
                let got = c.call("len", vec![1u8; len]).await.unwrap();
                assert_eq!(got.to_vec().unwrap(), (len as u64).to_le_bytes());
            });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
        if reads == Reads::Calls {
            assert!(!c.has_pump(), "a call outlasted a 30 s spin");
        }
        let e = c.call("fail", Payload::empty()).await.unwrap_err();
        assert_eq!(e.status, Status::InvalidArgument);
        let e = c
            .call_with(
                "sleep",
                Payload::empty(),
                CallOptions::deadline(Duration::from_millis(50)),
            )
            .await
            .unwrap_err();
        assert_eq!(e.status, Status::DeadlineExceeded);
        if reads == Reads::Pump {
            // Without a spin, a call takes an answer already there (as
            // most of the 200 above may have), and leaves any longer wait
            // to the pump.
            assert!(c.has_pump(), "a call that waited did not wait on the pump");
        }
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert_eq!(
            c.call("len", vec![0u8; 3]).await.unwrap().to_vec().unwrap(),
            3u64.to_le_bytes()
        );
        // A call in flight when the server stops fails, as do later ones.
        let pending = {
            let c = c.clone();
            tokio::spawn(async move { c.call("sleep", Payload::empty()).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        std::thread::spawn(move || svc.shutdown());
        let r = pending.await.unwrap();
        assert!(
            r.is_ok() || r.as_ref().unwrap_err().status == Status::Unavailable,
            "{r:?}"
        );
        let e = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match c.call("len", Payload::empty()).await {
                    Err(e) => break e,
                    Ok(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            }
        })
        .await
        .expect("calls to a stopped server must fail, not hang");
        assert!(
            matches!(e.status, Status::Unavailable | Status::NotFound),
            "{e}"
        );
        if reads == Reads::Calls {
            // Every answer, failures included, came within the spin.
            assert!(!c.has_pump());
        }
    });
    drop(c);
    drop(node);
    // The pump notices the dropped client within its 100 ms poll.
    std::thread::sleep(Duration::from_millis(300));
    tp.assert_clean();
}

#[test]
fn async_over_shm() {
    suite(Transport::Shm, "shm", Reads::Either);
}

#[test]
fn async_over_tcp() {
    suite(Transport::Tcp("127.0.0.1:0".into()), "tcp", Reads::Either);
}

#[test]
fn async_over_mem() {
    suite(Transport::Mem, "mem", Reads::Either);
}

/// The suite over every transport, with answers read by `reads`.
fn suite_everywhere(reads: Reads) {
    let tag = format!("{reads:?}").to_lowercase();
    suite(Transport::Shm, &format!("shm-{tag}"), reads);
    suite(
        Transport::Tcp("127.0.0.1:0".into()),
        &format!("tcp-{tag}"),
        reads,
    );
    suite(Transport::Mem, &format!("mem-{tag}"), reads);
}

#[test]
fn async_calls_that_read_their_own_answers() {
    suite_everywhere(Reads::Calls);
}

#[test]
fn async_calls_whose_answers_the_pump_reads() {
    suite_everywhere(Reads::Pump);
}

/// Async handlers run concurrently: twenty calls that each await 200 ms
/// finish together, and a handler can await a nested async call.
fn async_handlers(t: Transport, tag: &str) {
    // A small threshold: many answers may be owed on one connection.
    let (tp, node) = pool_and_node(8, None, 4096);
    let leaf = format!("async-h/{tag}/leaf/{}", std::process::id());
    let front = format!("async-h/{tag}/front/{}", std::process::id());
    let leaf_svc = node
        .server(&leaf)
        .transport(t.clone())
        .method_async("slow", |c| async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            Ok(Payload::from_vec(c.payload.len().to_le_bytes().to_vec()))
        })
        .spawn()
        .unwrap();
    let leaf_name = leaf.clone();
    let next: Slot = Default::default();
    let front_svc = node
        .server(&front)
        .transport(t)
        .method_async("via", move |c| {
            let cl = client_in(&next, &c.node, &leaf_name);
            async move { cl?.call("slow", c.payload.forward()?).await }
        })
        .method_async("boom", |_| async { panic!("async handler bug") })
        // Panics before it has a future to return.
        .method_async("boom_now", |_| {
            if std::hint::black_box(true) {
                panic!("no future");
            }
            async { Ok(Payload::empty()) }
        })
        .spawn()
        .unwrap();
    let c = node.connect_async(&front).unwrap();
    rt().block_on(async {
        let t0 = std::time::Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for i in 0..20usize {
            let c = c.clone();
            set.spawn(async move {
                let got = c.call("via", vec![7u8; i * 100]).await.unwrap();
                assert_eq!(got.to_vec().unwrap(), ((i * 100) as u64).to_le_bytes());
            });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
        let took = t0.elapsed();
        assert!(
            took < Duration::from_millis(1500),
            "calls were not concurrent: {took:?}"
        );
        let e = c.call("boom", Payload::empty()).await.unwrap_err();
        assert_eq!(e.status, Status::Internal, "{e}");
        assert!(e.message.contains("async handler bug"), "{e}");
        let e = c.call("boom_now", Payload::empty()).await.unwrap_err();
        assert_eq!(e.status, Status::Internal, "{e}");
        assert!(e.message.contains("no future"), "{e}");
        // The server still serves after its handlers panicked.
        let got = c.call("via", vec![1u8; 3]).await.unwrap();
        assert_eq!(got.to_vec().unwrap(), 3u64.to_le_bytes());
    });
    drop(c);
    stop_and_check(&tp, node, [front_svc, leaf_svc]);
}

#[test]
fn async_handlers_over_shm() {
    async_handlers(Transport::Shm, "shm");
}

#[test]
fn async_handlers_over_tcp() {
    async_handlers(Transport::Tcp("127.0.0.1:0".into()), "tcp");
}

#[test]
fn async_handlers_over_mem() {
    async_handlers(Transport::Mem, "mem");
}

/// Stops `servers` in order, lets pump threads notice their dropped
/// clients (they look every 100 ms), and checks the pool is clean.
fn stop_and_check<const N: usize>(tp: &TempPool, node: Node, servers: [dm_rpc::Server; N]) {
    for s in servers {
        s.shutdown();
    }
    drop(node);
    std::thread::sleep(Duration::from_millis(300));
    tp.assert_clean();
}

/// Where an async handler keeps the client it makes on its first call.
type Slot = std::sync::Arc<std::sync::OnceLock<dm_rpc::AsyncClient>>;

/// The client in `slot`, connected to `to` on first use.
fn client_in(slot: &Slot, node: &Node, to: &str) -> Result<dm_rpc::AsyncClient, RpcError> {
    if let Some(cl) = slot.get() {
        return Ok(cl.clone());
    }
    let cl = node.connect_async(to)?;
    let _ = slot.set(cl.clone());
    Ok(cl)
}

/// A pool of `channels` channels (rings of `ring_size` bytes, or the
/// default) and a node that sends up to `inline_max` bytes inline.
fn pool_and_node(channels: u32, ring_size: Option<u32>, inline_max: usize) -> (TempPool, Node) {
    waiting_node(channels, ring_size, inline_max, WaitPolicy::default())
}

/// [`pool_and_node`], the node waiting by `wait`.
fn waiting_node(
    channels: u32,
    ring_size: Option<u32>,
    inline_max: usize,
    wait: WaitPolicy,
) -> (TempPool, Node) {
    let d = PoolConfig::default();
    let tp = TempPool::with(PoolConfig {
        size: 256 << 20,
        channels: Some(channels),
        ring_size: ring_size.unwrap_or(d.ring_size),
        ..d
    });
    let cfg = dm_rpc::Config {
        inline_max,
        wait,
        ..Default::default()
    };
    let node = Node::with_config(tp.attach(), cfg);
    (tp, node)
}

/// A pool with small rings (32 KiB) and a node that sends up to 8 KiB
/// inline: a few calls in flight fill a ring.
fn small_rings() -> (TempPool, Node) {
    pool_and_node(8, Some(32 << 10), 8192)
}

/// Makes 64 calls of `method` at once from the calling task, call `i`
/// (1 to 64) with `arg(i)`, each to be answered with 6000 bytes of `i`;
/// answers how many were.
async fn fan64(
    cl: dm_rpc::AsyncClient,
    method: &str,
    arg: impl Fn(u8) -> Vec<u8>,
) -> Result<Payload, RpcError> {
    let calls = (1..=64u8).map(|i| {
        let (cl, p) = (cl.clone(), arg(i));
        async move {
            let opts = CallOptions::deadline(Duration::from_secs(5));
            let got = cl.call_with(method, p.into(), opts).await?;
            Ok::<bool, RpcError>(got.to_vec()? == vec![i; 6000])
        }
    });
    let mut good = 0u64;
    for r in join_all(calls.collect()).await {
        good += r? as u64;
    }
    Ok(Payload::from_vec(good.to_le_bytes().to_vec()))
}

/// Calls `method` five times; each must answer 64 (calls that went well).
fn five_rounds_of_64(c: &dm_rpc::Client, method: &str) {
    for _ in 0..5 {
        let opts = CallOptions::deadline(Duration::from_secs(30));
        let got = c.call_with(method, Payload::empty(), opts).unwrap();
        assert_eq!(got.to_vec().unwrap(), 64u64.to_le_bytes());
    }
}

/// An async service whose `via` forwards to `leaf` with an async client
/// made in the handler (kept in `next`): `len` for a payload, `hang` for
/// none.
fn forwarding_front(node: &Node, name: &str, leaf: &str, next: &Slot) -> dm_rpc::Server {
    let (next, leaf) = (next.clone(), leaf.to_owned());
    node.server(name)
        .method_async("via", move |c| {
            let cl = client_in(&next, &c.node, &leaf);
            async move {
                let cl = cl?;
                let method = if c.payload.is_empty() { "hang" } else { "len" };
                cl.call(method, c.payload.forward()?).await
            }
        })
        .spawn()
        .unwrap()
}

/// Over shared memory, the answers to the calls an async handler awaits
/// are read by its server's listener (no pump thread): calls from several
/// threads get theirs; a call in flight when the callee stops fails with
/// `Unavailable` instead of hanging; and a client whose listener's server
/// stops gets a pump and keeps working.
#[test]
fn answers_to_async_handlers_are_read_by_their_listener() {
    let (tp, node) = pool_and_node(16, None, 4096);
    let pid = std::process::id();
    let leaf = format!("async-w/leaf/{pid}");
    let leaf_svc = node
        .server(&leaf)
        .method_async("len", |c| async move {
            Ok(Payload::from_vec(c.payload.len().to_le_bytes().to_vec()))
        })
        .method_async("hang", |_| async {
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok(Payload::empty())
        })
        .spawn()
        .unwrap();
    let next: Slot = Default::default();
    let front = format!("async-w/front/{pid}");
    let front_svc = forwarding_front(&node, &front, &leaf, &next);
    let c = node.connect(&front).unwrap();
    // Four threads, 200 calls each, small (inline) and large (by Ref).
    std::thread::scope(|s| {
        for t in 0..4usize {
            let c = c.clone();
            s.spawn(move || {
                for i in 0..200usize {
                    let len = if i % 10 == t { 100_000 + i } else { 1 + i };
                    let got = c.call("via", vec![3u8; len]).unwrap();
                    assert_eq!(got.to_vec().unwrap(), (len as u64).to_le_bytes());
                }
            });
        }
    });
    let cl = next.get().unwrap().clone();
    assert!(cl.answers_read_by_listener());
    // Its reader's server stops: a pump takes over.
    drop(c);
    front_svc.shutdown();
    assert!(!cl.answers_read_by_listener());
    rt().block_on(async {
        let got = cl.call("len", vec![1u8; 5]).await.unwrap();
        assert_eq!(got.to_vec().unwrap(), 5u64.to_le_bytes());
    });
    drop((cl, next));
    // A nested call in flight when the callee stops.
    let next2: Slot = Default::default();
    let front2 = format!("async-w/front2/{pid}");
    let front2_svc = forwarding_front(&node, &front2, &leaf, &next2);
    let c2 = node.connect(&front2).unwrap();
    assert_eq!(
        c2.call("via", vec![1u8; 9]).unwrap().to_vec().unwrap(),
        9u64.to_le_bytes()
    );
    assert!(next2.get().unwrap().answers_read_by_listener());
    let hung = std::thread::spawn(move || {
        let t0 = std::time::Instant::now();
        (c2.call("via", Payload::empty()), t0.elapsed())
    });
    std::thread::sleep(Duration::from_millis(200));
    leaf_svc.shutdown();
    let (r, took) = hung.join().unwrap();
    let e = r.unwrap_err();
    assert_eq!(e.status, Status::Unavailable, "{e}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    drop(next2);
    stop_and_check(&tp, node, [front2_svc]);
}

/// Polls every future of `fs` in the calling task (as one handler's
/// future does with its nested calls) until all are done.
async fn join_all<F: std::future::Future>(fs: Vec<F>) -> Vec<F::Output> {
    let mut fs: Vec<std::pin::Pin<Box<F>>> = fs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = fs.iter().map(|_| None).collect();
    std::future::poll_fn(move |cx| {
        let mut done = true;
        for (f, o) in fs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *o = Some(v),
                    std::task::Poll::Pending => done = false,
                }
            }
        }
        if done {
            std::task::Poll::Ready(out.iter_mut().filter_map(Option::take).collect())
        } else {
            std::task::Poll::Pending
        }
    })
    .await
}

/// An async handler with more nested calls in flight than the rings hold:
/// the callee stops reading requests until its answers are read, and the
/// one reading them is the listener of the very dispatcher that waits to
/// send. The sending call takes the answers itself meanwhile.
#[test]
fn many_nested_calls_in_flight_through_small_rings_do_not_wait_on_themselves() {
    let (tp, node) = small_rings();
    let pid = std::process::id();
    let leaf = format!("async-f/leaf/{pid}");
    let front = format!("async-f/front/{pid}");
    let leaf_svc = node
        .server(&leaf)
        .method("echo", |c| Ok(c.take_payload()))
        .spawn()
        .unwrap();
    let next: Slot = Default::default();
    let front_svc = {
        let (next, leaf) = (next.clone(), leaf.clone());
        node.server(&front)
            .method_async("fan", move |c| {
                let cl = client_in(&next, &c.node, &leaf);
                async move { fan64(cl?, "echo", |i| vec![i; 6000]).await }
            })
            .spawn()
            .unwrap()
    };
    let c = node.connect(&front).unwrap();
    five_rounds_of_64(&c, "fan");
    assert!(next.get().unwrap().answers_read_by_listener());
    drop((c, next));
    stop_and_check(&tp, node, [front_svc, leaf_svc]);
}

/// Two services calling each other with many calls in flight through
/// small rings, each one's answers read by the other's listener. (A
/// listener never waits to answer: it takes a request only when there is
/// room for its answer; so what could wait is a send, as above.)
#[test]
fn services_calling_each_other_through_small_rings_do_not_deadlock() {
    let (tp, node) = small_rings();
    let pid = std::process::id();
    let (a, b) = (format!("async-m/a/{pid}"), format!("async-m/b/{pid}"));
    let (to_b, to_a): (Slot, Slot) = Default::default();
    // A: `fan` makes 64 calls to B's `relay` at once; `leaf` answers 6000 bytes.
    let a_svc = {
        let (to_b, b) = (to_b.clone(), b.clone());
        node.server(&a)
            .method("leaf", |c| {
                Ok(Payload::from_vec(vec![c.payload().len() as u8; 6000]))
            })
            .method_async("fan", move |c| {
                let cl = client_in(&to_b, &c.node, &b);
                async move { fan64(cl?, "relay", |i| vec![i; i as usize]).await }
            })
            .spawn()
            .unwrap()
    };
    // B: `relay` calls A's `leaf` and answers what it got.
    let b_svc = {
        let (to_a, a) = (to_a.clone(), a.clone());
        node.server(&b)
            .method_async("relay", move |c| {
                let cl = client_in(&to_a, &c.node, &a);
                async move {
                    let opts = CallOptions::deadline(Duration::from_secs(5));
                    cl?.call_with("leaf", c.payload.forward()?, opts).await
                }
            })
            .spawn()
            .unwrap()
    };
    let c = node.connect(&a).unwrap();
    five_rounds_of_64(&c, "fan");
    assert!(to_a.get().unwrap().answers_read_by_listener());
    assert!(to_b.get().unwrap().answers_read_by_listener());
    drop((c, to_a, to_b));
    stop_and_check(&tp, node, [a_svc, b_svc]);
}

/// Many calls of one async client in flight through rings that hold a few
/// frames each way (the server takes a request only when it has room to
/// answer it): whoever waits for room to send must not stop the answers
/// from being read. On a runtime of one thread and of two, under the
/// default policy and without spin (answers left to the pump).
#[test]
fn many_async_calls_through_small_rings_all_finish() {
    for (threads, wait) in [
        (1, WaitPolicy::default()),
        (2, WaitPolicy::default()),
        (1, WaitPolicy::park_only()),
        (2, WaitPolicy::park_only()),
    ] {
        let (tp, node) = waiting_node(8, Some(4096), usize::MAX, wait);
        let name = format!("async/crowd/{threads}/{}", std::process::id());
        let svc = node
            .server(&name)
            .method("echo", |c| Ok(c.take_payload()))
            .spawn()
            .unwrap();
        let c = node.connect_async(&name).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut set = tokio::task::JoinSet::new();
            for t in 0..16u8 {
                let c = c.clone();
                set.spawn(async move {
                    for i in 0..100usize {
                        let data = vec![t; 1000 + i % 7];
                        let opts = CallOptions::deadline(Duration::from_secs(20));
                        let got = c.call_with("echo", Payload::from_vec(data.clone()), opts);
                        let got = got
                            .await
                            .unwrap_or_else(|e| panic!("task {t} call {i}: {e}"));
                        assert_eq!(got.to_vec().unwrap(), data);
                    }
                });
            }
            while let Some(r) = set.join_next().await {
                r.unwrap();
            }
        });
        drop(rt);
        drop(c);
        stop_and_check(&tp, node, [svc]);
    }
}

/// Dropping an async call's future (a timeout around it, a `select!` that
/// took another branch) cancels the call: the Ref made for its argument is
/// released, the server is told, and the answer that comes later is
/// released too. Over every transport, for a call awaiting a channel
/// (the pump or a listener reads) and one that reads its own answer.
#[test]
fn a_dropped_call_releases_what_it_lent() {
    for (t, wait) in [
        (Transport::Shm, WaitPolicy::default()),
        (Transport::Shm, WaitPolicy::park_only()),
        (Transport::Tcp("127.0.0.1:0".into()), WaitPolicy::default()),
        (Transport::Mem, WaitPolicy::park_only()),
    ] {
        let (tp, node) = waiting_node(8, None, 4096, wait);
        let kind = match t {
            Transport::Shm => "shm",
            Transport::Mem => "mem",
            _ => "tcp",
        };
        let name = format!("async/dropped/{kind}/{}", std::process::id());
        let svc = node
            .server(&name)
            .transport(t)
            .method("slow", |c| {
                std::thread::sleep(Duration::from_millis(100));
                Ok(c.take_payload())
            })
            .spawn()
            .unwrap();
        let c = match svc.tcp_addr() {
            Some(addr) => node.connect_tcp_async(addr).unwrap(),
            None => node.connect_async(&name).unwrap(),
        };
        let rt = rt();
        rt.block_on(async {
            for _ in 0..3 {
                let arg = Payload::from_vec(vec![7u8; 100_000]);
                let r = tokio::time::timeout(Duration::from_millis(20), c.call("slow", arg)).await;
                assert!(r.is_err(), "the call should still have been running");
            }
            // The connection still works.
            let got = c.call("slow", vec![1u8; 10]).await.unwrap();
            assert_eq!(got.to_vec().unwrap(), vec![1u8; 10]);
        });
        drop(rt);
        drop(c);
        stop_and_check(&tp, node, [svc]);
    }
}

/// Counts a handler's future dropped before it completed.
struct CountsDrop(std::sync::Arc<std::sync::atomic::AtomicU32>, bool);

impl Drop for CountsDrop {
    fn drop(&mut self) {
        if !self.1 {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// A cancel travels down a chain of async services: the caller gives up
/// (its deadline passes, or it drops its call), the first service drops
/// its handler's future, whose nested call is cancelled in turn, and the
/// last service drops its own long before it would have finished; what
/// was lent on the way is released.
#[test]
fn a_cancel_travels_down_a_chain_of_async_services() {
    use std::sync::atomic::{AtomicU32, Ordering};
    for t in [Transport::Shm, Transport::Tcp("127.0.0.1:0".into())] {
        let (tp, node) = pool_and_node(8, None, 4096);
        let kind = if t == Transport::Shm { "shm" } else { "tcp" };
        let pid = std::process::id();
        let (a_name, b_name) = (
            format!("async/cancel/{kind}/a/{pid}"),
            format!("async/cancel/{kind}/b/{pid}"),
        );
        let dropped = std::sync::Arc::new(AtomicU32::new(0));
        let d = dropped.clone();
        let b = node
            .server(&b_name)
            .transport(t.clone())
            .method_async("wait", move |c| {
                let d = d.clone();
                async move {
                    let mut g = CountsDrop(d, false);
                    let n = c.payload.len();
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    g.1 = true;
                    Ok(Payload::from_vec(n.to_le_bytes().to_vec()))
                }
            })
            .spawn()
            .unwrap();
        let next = Slot::default();
        let to = b_name.clone();
        let a = node
            .server(&a_name)
            .transport(t)
            .method_async("fwd", move |c| {
                let cl = client_in(&next, &c.node, &to);
                async move { cl?.call("wait", c.payload.forward()?).await }
            })
            .spawn()
            .unwrap();
        let c = node.connect_async(&a_name).unwrap();
        rt().block_on(async {
            let t0 = std::time::Instant::now();
            let arg = Payload::from_vec(vec![3u8; 100_000]);
            let opts = CallOptions::deadline(Duration::from_millis(100));
            let e = c.call_with("fwd", arg, opts).await.unwrap_err();
            assert_eq!(e.status, Status::DeadlineExceeded);
            while dropped.load(Ordering::SeqCst) < 1 {
                assert!(
                    t0.elapsed() < Duration::from_secs(2),
                    "the deadline's cancel did not reach the last service"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let t0 = std::time::Instant::now();
            let arg = Payload::from_vec(vec![4u8; 100_000]);
            let r = tokio::time::timeout(Duration::from_millis(100), c.call("fwd", arg)).await;
            assert!(r.is_err(), "the call should still have been running");
            while dropped.load(Ordering::SeqCst) < 2 {
                assert!(
                    t0.elapsed() < Duration::from_secs(2),
                    "a dropped call's cancel did not reach the last service"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        drop(c);
        stop_and_check(&tp, node, [a, b]);
    }
}

/// A call's future stays small: a server boxes an async handler's future
/// for every call, and the futures of the calls it awaits are part of it
/// (glibc serves a box above 1 032 bytes from its slow path). With an
/// async fn per layer (`call`, `call_with`, `call_with_metadata`,
/// `call_full`, ...) `call`'s future took 1 656 bytes, each layer keeping
/// its own copy of the arguments; flattened, 632 (rustc 1.95). The bound
/// leaves room for compiler changes.
#[test]
fn a_calls_future_stays_small() {
    let (tp, node) = pool_and_node(4, None, 64 << 10);
    let name = format!("async/size/{}", std::process::id());
    let svc = node
        .server(&name)
        .method("echo", |c| Ok(Payload::from_vec(c.payload().to_vec()?)))
        .spawn()
        .unwrap();
    let cl = node.connect_async(&name).unwrap();
    let call = cl.call("echo", Payload::from_vec(vec![1, 2, 3]));
    let size = std::mem::size_of_val(&call);
    assert!(size <= 800, "a call's future takes {size} bytes");
    assert_eq!(rt().block_on(call).unwrap().to_vec().unwrap(), [1, 2, 3]);
    drop(cl);
    stop_and_check(&tp, node, [svc]);
}

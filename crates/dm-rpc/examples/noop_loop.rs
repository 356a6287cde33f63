//! A no-op call loop between two processes, for profiling the round trip
//! (`perf record -a -- target/release/examples/noop_loop 2000000`; env:
//! SIZE, BYREF=1, INLINE_MAX, ECHO=1, SUM=1, POLICY=spin|park|yield,
//! TCP=1: over the TCP transport on loopback instead of shm rings,
//! TCP_SPIN_US: its busy-poll budget, SERVE_CPU: the server's CPU,
//! ASYNC=1: no-op calls of the async client on a current-thread runtime
//! (ASYNC_METHOD=async: to an async handler; stream: opening a stream
//! that a bidirectional async handler ends with one item, as gRPC's
//! direct way does; sstream: the same from a server-streaming handler),
//! BALANCED=1: the server registered as a replica, the client balanced
//! over the name's replicas, here one; RAW=1: request frames sent and
//! answers read straight through a connection's halves, no client;
//! RAW_SERVER=1: the server's end the same way, requests read from its
//! listener and empty answers sent back, no dispatcher;
//! PROBE=PATH: with the `probe`
//! feature, each process writes its timestamps to PATH.client and
//! PATH.server, for `scripts/call-split.sh`).
#![allow(clippy::unwrap_used)]

#[cfg(not(loom))]
mod common;

#[cfg(not(loom))]
use dm_rpc::{Node, Payload};
#[cfg(not(loom))]
use std::time::Instant;

#[cfg(loom)]
fn main() {}

#[cfg(not(loom))]
fn main() {
    use dm_pool::{AttachOptions, Pool};
    let args: Vec<String> = std::env::args().collect();
    let wait = common::wait_policy();
    // TCP_SPIN_US: the TCP transport's busy-poll budget.
    let tcp_spin = std::env::var("TCP_SPIN_US")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(dm_rpc::DEFAULT_TCP_SPIN, std::time::Duration::from_micros);
    let cfg = dm_rpc::Config {
        wait,
        tcp_spin,
        ..Default::default()
    };
    if args.get(1).map(String::as_str) == Some("serve") {
        // SERVE_CPU=k: the server process on that CPU alone.
        if let Some(k) = std::env::var("SERVE_CPU").ok().and_then(|s| s.parse().ok()) {
            dm_sys::set_affinity(&[k]).unwrap();
        }
        let pool = Pool::open(args[2].as_ref(), AttachOptions::default()).unwrap();
        let node = Node::with_config(pool, cfg);
        if std::env::var("RAW_SERVER").is_ok_and(|v| v == "1") {
            raw_serve(&node, cfg.wait);
            return;
        }
        let every = std::env::var("SUM").is_ok_and(|v| v == "1");
        // ECHO=1: answer what arrived (an echo) instead of nothing.
        let echo = std::env::var("ECHO").is_ok_and(|v| v == "1");
        let tcp = std::env::var("TCP").is_ok_and(|v| v == "1");
        let mut b = node.server("profile/noop");
        if std::env::var("BALANCED").is_ok_and(|v| v == "1") {
            b = b.replica();
        }
        let s = b
            .transport(if tcp {
                dm_rpc::Transport::Tcp("127.0.0.1:0".into())
            } else {
                dm_rpc::Transport::Shm
            })
            .method_bidi_async("noop_stream", |mut c, _inbox, mut sink| async move {
                sink.end_with(std::mem::take(&mut c.payload));
                Ok(())
            })
            .method_stream_async("noop_sstream", |mut c, mut sink| async move {
                sink.end_with(std::mem::take(&mut c.payload));
                Ok(())
            })
            .method_async("noop_async", |_c| async { Ok(Payload::empty()) })
            .method("noop", move |c| {
                dm_rpc::probe::stamp(dm_rpc::probe::USER[2]);
                let _end = Stamp(dm_rpc::probe::USER[3]);
                // Touch what arrived, as a callee would (SUM=1: read
                // every byte).
                for s in c.payload().segments()? {
                    if every {
                        std::hint::black_box(s.iter().fold(0u8, |a, &b| a ^ b));
                    }
                    std::hint::black_box(s.first());
                }
                Ok(if echo {
                    c.take_payload()
                } else {
                    Payload::empty()
                })
            })
            .spawn()
            .unwrap();
        common::ready_until_stdin_closes();
        probe_dump("server");
        s.shutdown();
        return;
    }
    let n: u64 = args
        .get(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000);
    let path = common::create_pool("noop-loop", 64 << 20);
    let child = common::spawn_peer(&["serve", &path]);
    // INLINE_MAX=N: the client's threshold (0 forces Refs).
    let inline_max = std::env::var("INLINE_MAX")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(dm_rpc::DEFAULT_INLINE_MAX);
    let node = Node::with_config(
        Pool::open(path.as_ref(), AttachOptions::default()).unwrap(),
        dm_rpc::Config { inline_max, ..cfg },
    );
    // Each loop closes its connection before the server stops.
    let (per, what) = if std::env::var("ASYNC").is_ok_and(|v| v == "1") {
        (async_calls(&node, n), "async, no payload".to_owned())
    } else if std::env::var("RAW").is_ok_and(|v| v == "1") {
        (
            raw_frames(&node, cfg.wait, n),
            "raw frames, no client".to_owned(),
        )
    } else {
        calls(&node, n)
    };
    println!("{per:.0} ns per round trip ({what})");
    probe_dump("client");
    common::stop_peer(child);
    let _ = std::fs::remove_file(&path);
}

/// ASYNC=1: the async client, on a current-thread runtime. Nanoseconds per
/// call.
#[cfg(not(loom))]
fn async_calls(node: &Node, n: u64) -> f64 {
    let c = node.connect_async("profile/noop").unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let how = std::env::var("ASYNC_METHOD").unwrap_or_default();
        let t = Instant::now();
        for _ in 0..n {
            match how.as_str() {
                "stream" | "sstream" => {
                    let mut st = c
                        .call_stream_with(
                            if how == "stream" {
                                "noop_stream"
                            } else {
                                "noop_sstream"
                            },
                            Payload::from(vec![7u8; 16]),
                            dm_rpc::CallOptions::default(),
                            dm_rpc::Metadata::new(),
                        )
                        .await
                        .unwrap();
                    st.next_with_metadata().await.unwrap().unwrap();
                    assert!(st.next().await.is_none());
                }
                "async" => {
                    c.call("noop_async", Payload::empty()).await.unwrap();
                }
                _ => {
                    c.call("noop", Payload::empty()).await.unwrap();
                }
            }
        }
        t.elapsed().as_nanos() as f64 / n as f64
    })
}

/// RAW=1: no client at all: request frames pushed and answers read
/// straight through a shared-memory connection's two halves (what the RPC
/// client adds to the transport is the difference). Nanoseconds per round
/// trip.
#[cfg(not(loom))]
fn raw_frames(node: &Node, wait: dm_rpc::wait::WaitPolicy, n: u64) -> f64 {
    let svc = node.pool().lookup("profile/noop").unwrap().unwrap();
    let mut conn = dm_rpc::raw::shm::connect(node.pool(), &svc, wait).unwrap();
    let method = dm_rpc::frame::method_id("noop");
    let t = Instant::now();
    for id in 1..=n {
        dm_rpc::probe::stamp(dm_rpc::probe::USER[0]);
        let _end = Stamp(dm_rpc::probe::USER[1]);
        let req = dm_rpc::Frame::request(id, method, 0, dm_rpc::Body::None);
        assert!(conn.tx.send(&req, None).unwrap());
        let answer = conn.rx.recv(None).unwrap().unwrap();
        assert_eq!(answer.call_id, id);
    }
    t.elapsed().as_nanos() as f64 / n as f64
}

/// RAW_SERVER=1: no dispatcher: requests read from a shared-memory
/// listener and answered with empty answers on the spot (what the server
/// adds to the transport is the difference), until stdin closes.
#[cfg(not(loom))]
fn raw_serve(node: &Node, wait: dm_rpc::wait::WaitPolicy) {
    use dm_rpc::raw::Listener;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let svc = node
        .pool()
        .register("profile/noop", &dm_pool::Endpoint::Shm)
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mut l = dm_rpc::raw::shm::ShmListener::new(
        node.pool(),
        svc.clone(),
        wait,
        stop.clone(),
        dm_rpc::DEFAULT_INLINE_MAX,
    )
    .unwrap();
    let waker = l.waker();
    let serving = std::thread::spawn(move || {
        while let Ok(Some((conn, f))) = l.next(None) {
            // (The handler's points, with nothing between them.)
            dm_rpc::probe::stamp(dm_rpc::probe::USER[2]);
            dm_rpc::probe::stamp(dm_rpc::probe::USER[3]);
            if f.kind == dm_rpc::Kind::Request {
                let answer =
                    dm_rpc::Frame::response(f.call_id, dm_rpc::Status::Ok, dm_rpc::Body::None);
                let _ = l.reply(conn, &answer);
            }
        }
    });
    common::ready_until_stdin_closes();
    stop.store(true, Ordering::Release);
    waker.wake();
    serving.join().unwrap();
    probe_dump("server");
    node.pool().unregister(&svc).unwrap();
}

/// The blocking client's calls (SIZE, BYREF, BALANCED). Nanoseconds per
/// call, and what was called.
#[cfg(not(loom))]
fn calls(node: &Node, n: u64) -> (f64, String) {
    // BALANCED=1: through a balanced client (its pick and bookkeeping).
    let balanced = std::env::var("BALANCED").is_ok_and(|v| v == "1");
    let (c, bc) = if balanced {
        let bc = node.connect_balanced("profile/noop").unwrap();
        (None, Some(bc))
    } else {
        (Some(node.connect("profile/noop").unwrap()), None)
    };
    // SIZE bytes per call (0: none), BYREF=1 to build it in the pool.
    let size: usize = std::env::var("SIZE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let by_ref = std::env::var("BYREF").is_ok_and(|v| v == "1");
    let data = vec![5u8; size];
    let t = Instant::now();
    for _ in 0..n {
        let p = if size == 0 {
            Payload::empty()
        } else if by_ref {
            let mut b = node.pool().alloc(size as u64).unwrap();
            b.write(0, &data).unwrap();
            Payload::from_buffer(b)
        } else {
            Payload::from_vec(data.clone())
        };
        dm_rpc::probe::stamp(dm_rpc::probe::USER[0]);
        let _end = Stamp(dm_rpc::probe::USER[1]);
        match (&c, &bc) {
            (Some(c), _) => c.call("noop", p).unwrap(),
            (_, Some(bc)) => bc.call("noop", p).unwrap(),
            _ => unreachable!(),
        };
    }
    let per = t.elapsed().as_nanos() as f64 / n as f64;
    (
        per,
        format!("{size} bytes, by_ref {by_ref}, balanced {balanced}"),
    )
}

/// Stamps its point when dropped (the end of what it spans).
#[cfg(not(loom))]
struct Stamp(usize);

#[cfg(not(loom))]
impl Drop for Stamp {
    fn drop(&mut self) {
        dm_rpc::probe::stamp(self.0);
    }
}

/// PROBE=PATH: this process's stamps to PATH.`side`.
#[cfg(not(loom))]
fn probe_dump(side: &str) {
    if let Ok(p) = std::env::var("PROBE") {
        if let Err(e) = dm_rpc::probe::dump(format!("{p}.{side}").as_ref()) {
            eprintln!("noop_loop: probe: {e}");
        }
    }
}

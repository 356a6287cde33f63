//! Streaming calls over every transport: items arrive in order, inline
//! and by Ref; the caller's window bounds what the server sends ahead; a
//! dropped stream cancels its call; a stream ends with its handler's
//! error or its deadline; unary and streaming methods each refuse or
//! serve the other kind of call. Each test ends with the pool clean.

#![allow(clippy::unwrap_used)]

use dm_rpc::{CallOptions, Client, Metadata, Node, Payload, RpcError, Server, Status, Transport};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod common;
use common::{every_transport, pattern, pool, unique};

/// Waits (up to 5 s) until `f` holds.
fn eventually(what: &str, f: impl Fn() -> bool) {
    let until = Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(Instant::now() < until, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// What the handlers saw, for the tests to check.
#[derive(Default)]
struct Seen {
    /// Items sent by the "endless" handler so far.
    sent: AtomicU64,
    /// How the "endless" handler's last stream ended.
    ended: Mutex<Option<Status>>,
}

/// The service: `count` streams N items (`[n: u32, len: u32]` in its
/// argument) of `len` bytes each, item k filled with pattern(len, k), and
/// sets its answer's metadata; `endless` sends items (a u64 counter, every
/// `ms` milliseconds of its argument's first byte) until a send fails;
/// `fail` sends two items and ends with PermissionDenied; `unary` answers
/// its argument.
fn service(node: &Node, name: &str, t: &Transport, seen: Arc<Seen>) -> Server {
    node.server(name)
        .transport(t.clone())
        .method_stream("count", |c, sink| {
            let a = c.payload().to_vec()?;
            let n = u32::from_le_bytes(a[0..4].try_into().unwrap());
            let len = u32::from_le_bytes(a[4..8].try_into().unwrap()) as usize;
            for k in 0..n {
                sink.send(pattern(len, k as u8))?;
            }
            let meta = Metadata::new().with("items", n.to_string()).unwrap();
            c.set_reply_metadata(meta).unwrap();
            Ok(())
        })
        .method_stream("endless", move |c, sink| {
            let ms = c.payload().to_vec()?.first().copied().unwrap_or(0);
            seen.sent.store(0, Ordering::SeqCst);
            let mut k = 0u64;
            let end = loop {
                if ms > 0 {
                    std::thread::sleep(Duration::from_millis(ms as u64));
                }
                if let Err(e) = sink.send(k.to_le_bytes().to_vec()) {
                    break e;
                }
                k += 1;
                seen.sent.store(sink.sent(), Ordering::SeqCst);
            };
            *seen.ended.lock().unwrap() = Some(end.status);
            Err(end)
        })
        .method_stream("fail", |_, sink| {
            sink.send(vec![1])?;
            sink.send(vec![2])?;
            Err(RpcError::permission_denied("no more for you"))
        })
        .method("unary", |c| Ok(c.take_payload()))
        .spawn()
        .unwrap()
}

/// Runs `body` over every transport with a client of a fresh `service`,
/// then stops it and checks that the pool is clean.
fn over_every_transport(test: &str, body: impl Fn(&Transport, &Client, &Server, &Seen)) {
    for t in every_transport() {
        let tp = pool();
        {
            let node = Node::new(tp.attach());
            let name = unique(test);
            let seen = Arc::new(Seen::default());
            let s = service(&node, &name, &t, seen.clone());
            let c = node.connect(&name).unwrap();
            body(&t, &c, &s, &seen);
            drop(c);
            s.shutdown();
        }
        tp.assert_clean();
    }
}

fn count_args(n: u32, len: u32) -> Vec<u8> {
    let mut a = n.to_le_bytes().to_vec();
    a.extend_from_slice(&len.to_le_bytes());
    a
}

#[test]
fn items_arrive_in_order_inline_and_by_ref_over_every_transport() {
    over_every_transport("stream-order", |t, c, s, _| {
        // Small items inline, large ones by Ref (shm, in-process) or
        // by value (TCP); more items than the window.
        for (n, len) in [(0u32, 0u32), (1, 10), (100, 100), (40, 256 << 10)] {
            let mut st = c.call_stream("count", count_args(n, len)).unwrap();
            let mut k = 0u32;
            for item in st.by_ref() {
                let item = item.unwrap();
                assert_eq!(item.len(), len as u64, "{t:?} item {k}");
                assert_eq!(item.to_vec().unwrap(), pattern(len as usize, k as u8));
                k += 1;
            }
            assert_eq!(k, n, "{t:?}: every item, once");
            assert!(st.is_done());
            assert_eq!(st.metadata().get("items"), Some(n.to_string().as_bytes()));
            assert!(st.next().is_none(), "ended for good");
        }
        // A unary call on the same connection after the streams.
        let back = c.call("unary", vec![7u8; 3]).unwrap();
        assert_eq!(back.to_vec().unwrap(), vec![7u8; 3]);
        assert!(s.stats().items.load(Ordering::Relaxed) >= 141);
    });
}

#[test]
fn the_window_bounds_what_the_server_sends_ahead() {
    over_every_transport("stream-window", |t, c, _, seen| {
        let window = 4u64;
        let opts = CallOptions::default().window(window as u32);
        let mut st = c
            .call_stream_with("endless", Payload::from_vec(vec![0]), opts, Metadata::new())
            .unwrap();
        let mut read = 0u64;
        for _ in 0..5 {
            // Granted: the window, and what was read in halves of it.
            let granted = window + read / (window / 2) * (window / 2);
            eventually("the server sent what was granted", || {
                seen.sent.load(Ordering::SeqCst) == granted
            });
            std::thread::sleep(Duration::from_millis(30));
            assert_eq!(
                seen.sent.load(Ordering::SeqCst),
                granted,
                "{t:?}: no item beyond the grant"
            );
            for _ in 0..3 {
                let item = st.next().unwrap().unwrap();
                assert_eq!(item.to_vec().unwrap(), read.to_le_bytes());
                read += 1;
            }
        }
        drop(st);
        eventually("the handler saw the cancel", || {
            seen.ended.lock().unwrap().is_some()
        });
        assert_eq!(*seen.ended.lock().unwrap(), Some(Status::Cancelled));
        // The server serves again.
        let back = c.call("unary", vec![1u8]).unwrap();
        assert_eq!(back.to_vec().unwrap(), vec![1u8]);
    });
}

#[test]
fn a_dropped_stream_cancels_its_call_and_releases_its_items() {
    over_every_transport("stream-drop", |_, c, _, seen| {
        // Large items (by Ref where the pool is shared), some unread.
        let mut st = c.call_stream("count", count_args(1000, 64 << 10)).unwrap();
        for _ in 0..3 {
            st.next().unwrap().unwrap();
        }
        drop(st);
        let mut st = c.call_stream("endless", vec![1u8]).unwrap();
        st.next().unwrap().unwrap();
        drop(st);
        eventually("the handler saw the cancel", || {
            seen.ended.lock().unwrap().is_some()
        });
        assert_eq!(*seen.ended.lock().unwrap(), Some(Status::Cancelled));
        let back = c.call("unary", vec![2u8]).unwrap();
        assert_eq!(back.to_vec().unwrap(), vec![2u8]);
    });
}

#[test]
fn a_stream_ends_with_its_handlers_error_or_its_deadline() {
    over_every_transport("stream-end", |t, c, _, seen| {
        let mut st = c.call_stream("fail", vec![]).unwrap();
        assert_eq!(st.next().unwrap().unwrap().to_vec().unwrap(), vec![1]);
        assert_eq!(st.next().unwrap().unwrap().to_vec().unwrap(), vec![2]);
        let e = st.next().unwrap().unwrap_err();
        assert_eq!(e.status, Status::PermissionDenied, "{e}");
        assert!(st.next().is_none());
        // The deadline bounds the whole stream: items every 5 ms, for
        // 150 ms.
        let opts = CallOptions::deadline(Duration::from_millis(150));
        let st = c
            .call_stream_with("endless", Payload::from_vec(vec![5]), opts, Metadata::new())
            .unwrap();
        let start = Instant::now();
        let mut items = 0;
        let mut end = None;
        for item in st {
            match item {
                Ok(_) => items += 1,
                Err(e) => end = Some(e.status),
            }
        }
        assert_eq!(end, Some(Status::DeadlineExceeded), "{t:?}");
        assert!(items >= 1, "{t:?}: items came before the deadline");
        assert!(start.elapsed() < Duration::from_secs(2));
        eventually("the handler stopped", || {
            seen.ended.lock().unwrap().is_some()
        });
        let back = c.call("unary", vec![3u8]).unwrap();
        assert_eq!(back.to_vec().unwrap(), vec![3u8]);
    });
}

#[test]
fn unary_and_streaming_methods_meet_the_other_kind_of_call() {
    over_every_transport("stream-kinds", |t, c, _, _| {
        // A streaming method called as a unary one: refused.
        let e = c.call("count", count_args(3, 3)).unwrap_err();
        assert_eq!(e.status, Status::InvalidArgument, "{e}");
        // A unary method called as a stream: its answer is the one item,
        // by Ref too (the request's own Ref passed back).
        for len in [5usize, 300 << 10] {
            let st = c.call_stream("unary", pattern(len, 9)).unwrap();
            let items: Vec<Vec<u8>> = st.map(|i| i.unwrap().to_vec().unwrap()).collect();
            assert_eq!(items, vec![pattern(len, 9)], "{t:?}");
        }
        // No such method.
        let mut st = c.call_stream("nope", vec![]).unwrap();
        assert_eq!(st.next().unwrap().unwrap_err().status, Status::NotFound);
    });
}

#[test]
fn streams_and_calls_share_a_connection_across_threads() {
    over_every_transport("stream-mix", |_, c, _, _| {
        std::thread::scope(|sc| {
            for th in 0..4u32 {
                let c = c.clone();
                sc.spawn(move || {
                    for round in 0..20u32 {
                        if (th + round) % 2 == 0 {
                            let n = 5 + th;
                            let st = c.call_stream("count", count_args(n, 2000)).unwrap();
                            let got: Vec<Payload> = st.map(Result::unwrap).collect();
                            assert_eq!(got.len(), n as usize);
                            for (k, p) in got.iter().enumerate() {
                                assert_eq!(p.to_vec().unwrap(), pattern(2000, k as u8));
                            }
                        } else {
                            let v = vec![th as u8; 100];
                            let back = c.call("unary", v.clone()).unwrap();
                            assert_eq!(back.to_vec().unwrap(), v);
                        }
                    }
                });
            }
        });
    });
}

#[test]
fn streams_survive_a_rolling_restart() {
    for t in every_transport() {
        let tp = pool();
        {
            let node = Node::new(tp.attach());
            let name = unique("stream-restart");
            let mut server = Some(service(&node, &name, &t, Arc::default()));
            let c = node.connect(&name).unwrap();
            let done = std::sync::atomic::AtomicBool::new(false);
            std::thread::scope(|sc| {
                // Streams one after another from two threads, each checked
                // whole: none may fail.
                let load: Vec<_> = (0..2u8)
                    .map(|th| {
                        let (c, done, t) = (c.clone(), &done, &t);
                        sc.spawn(move || {
                            let mut n = 0;
                            while !done.load(Ordering::Relaxed) {
                                let len = 10 + th as u32;
                                let o = CallOptions::deadline(Duration::from_secs(10))
                                    .wait_for_ready()
                                    .idempotent();
                                let arg = Payload::from_vec(count_args(4, len));
                                let st = c
                                    .call_stream_with("count", arg, o, Metadata::new())
                                    .unwrap();
                                let items: Vec<Vec<u8>> = st
                                    .map(|i| i.unwrap_or_else(|e| panic!("{t:?} stream {n}: {e}")))
                                    .map(|p| p.to_vec().unwrap())
                                    .collect();
                                assert_eq!(items.len(), 4);
                                assert_eq!(items[3], pattern(len as usize, 3));
                                n += 1;
                            }
                            n
                        })
                    })
                    .collect();
                for _ in 0..3 {
                    std::thread::sleep(Duration::from_millis(30));
                    let old = server.take().unwrap();
                    // The successor registers once the old server has
                    // unregistered (as it starts draining).
                    let drain = sc.spawn(move || old.shutdown_gracefully(Duration::from_secs(5)));
                    let until = Instant::now() + Duration::from_secs(5);
                    let next = loop {
                        let s = node
                            .server(&name)
                            .transport(t.clone())
                            .method_stream("count", |c, sink| {
                                let a = c.payload().to_vec()?;
                                let n = u32::from_le_bytes(a[0..4].try_into().unwrap());
                                let len = u32::from_le_bytes(a[4..8].try_into().unwrap());
                                for k in 0..n {
                                    sink.send(pattern(len as usize, k as u8))?;
                                }
                                Ok(())
                            })
                            .spawn();
                        match s {
                            Ok(s) => break s,
                            Err(_) => assert!(Instant::now() < until, "the name stays taken"),
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    };
                    server = Some(next);
                    drain.join().unwrap();
                }
                std::thread::sleep(Duration::from_millis(30));
                done.store(true, Ordering::Relaxed);
                let streams: usize = load.into_iter().map(|h| h.join().unwrap()).sum();
                assert!(streams >= 4, "{t:?}: {streams} streams");
            });
            drop(c);
            if let Some(s) = server {
                s.shutdown();
            }
        }
        tp.assert_clean();
    }
}

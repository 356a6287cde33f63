//! Streaming calls over every transport: items arrive in order, inline
//! and by Ref; the caller's window bounds what the server sends ahead; a
//! dropped stream cancels its call; a stream ends with its handler's
//! error or its deadline; unary and streaming methods each refuse or
//! serve the other kind of call. Each holds for blocking streaming
//! handlers and for async ones (whose streams also run beside the
//! server's other calls), read by the blocking and the async client.
//! Each test ends with the pool clean.

#![allow(clippy::unwrap_used)]

use dm_rpc::{CallOptions, Client, Metadata, Node, Payload, RpcError, Server, Status, Transport};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod common;
use common::{every_transport, pattern, pool, rt, unique};

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

/// Records how an async `endless` stream ended when its future goes:
/// with its send's error, or dropped (`Cancelled`: its caller cancelled).
struct OnEnd(Arc<Seen>, Option<Status>);

impl Drop for OnEnd {
    fn drop(&mut self) {
        *self.0.ended.lock().unwrap() = Some(self.1.unwrap_or(Status::Cancelled));
    }
}

/// The handler kinds every stream test runs over: a method's name is
/// the blocking handler's, with this suffix the async one's.
const KINDS: [&str; 2] = ["", "_async"];

/// The service: `count` streams N items (`[n: u32, len: u32]` in its
/// argument) of `len` bytes each, item k filled with pattern(len, k), and
/// sets its answer's metadata; `endless` sends items (a u64 counter, every
/// `ms` milliseconds of its argument's first byte) until a send fails;
/// `fail` sends two items and ends with PermissionDenied; `unary` answers
/// its argument. `count_async`, `endless_async` and `fail_async` do the
/// same as async handlers.
fn service(node: &Node, name: &str, t: &Transport, seen: Arc<Seen>) -> Server {
    let seen_async = seen.clone();
    node.server(name)
        .transport(t.clone())
        .method_stream_async("count_async", |c, mut sink| async move {
            let a = c.payload.to_vec()?;
            let n = u32::from_le_bytes(a[0..4].try_into().unwrap());
            let len = u32::from_le_bytes(a[4..8].try_into().unwrap()) as usize;
            for k in 0..n {
                sink.send(pattern(len, k as u8)).await?;
            }
            let meta = Metadata::new().with("items", n.to_string()).unwrap();
            c.set_reply_metadata(meta).unwrap();
            Ok(())
        })
        .method_stream_async("endless_async", move |c, mut sink| {
            let seen = seen_async.clone();
            async move {
                let ms = c.payload.to_vec()?.first().copied().unwrap_or(0);
                seen.sent.store(0, Ordering::SeqCst);
                let mut end = OnEnd(seen.clone(), None);
                let mut k = 0u64;
                loop {
                    if ms > 0 {
                        tokio::time::sleep(Duration::from_millis(ms as u64)).await;
                    }
                    if let Err(e) = sink.send(k.to_le_bytes().to_vec()).await {
                        end.1 = Some(e.status);
                        return Err(e);
                    }
                    k += 1;
                    seen.sent.store(sink.sent(), Ordering::SeqCst);
                }
            }
        })
        .method_stream_async("fail_async", |_, mut sink| async move {
            sink.send(vec![1]).await?;
            sink.send(vec![2]).await?;
            Err(RpcError::permission_denied("no more for you"))
        })
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

/// The streams of the order tests: each handler kind, with `n` items of
/// `len` bytes: none, one, many small ones, inline ones that fill the
/// connection (the server waits for room), large ones by Ref (shm,
/// in-process) or by value (TCP); more items than the window.
fn order_cases() -> impl Iterator<Item = (&'static str, u32, u32)> {
    let sizes = [
        (0u32, 0u32),
        (1, 10),
        (100, 100),
        (64, 60 << 10),
        (40, 256 << 10),
    ];
    KINDS
        .iter()
        .flat_map(move |k| sizes.map(|(n, len)| (*k, n, len)))
}

#[test]
fn items_arrive_in_order_inline_and_by_ref_over_every_transport() {
    over_every_transport("stream-order", |t, c, s, _| {
        for (kind, n, len) in order_cases() {
            let mut st = c
                .call_stream(&format!("count{kind}"), count_args(n, len))
                .unwrap();
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
        assert!(s.stats().items.load(Ordering::Relaxed) >= 2 * (141 + 64));
    });
}

#[test]
fn the_window_bounds_what_the_server_sends_ahead() {
    over_every_transport("stream-window", |t, c, _, seen| {
        for kind in KINDS {
            *seen.ended.lock().unwrap() = None;
            let window = 4u64;
            let opts = CallOptions::default().window(window as u32);
            let m = format!("endless{kind}");
            let mut st = c
                .call_stream_with(&m, Payload::from_vec(vec![0]), opts, Metadata::new())
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
                    "{t:?} {m}: no item beyond the grant"
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
            assert_eq!(*seen.ended.lock().unwrap(), Some(Status::Cancelled), "{m}");
            // The server serves again.
            let back = c.call("unary", vec![1u8]).unwrap();
            assert_eq!(back.to_vec().unwrap(), vec![1u8]);
        }
    });
}

#[test]
fn a_dropped_stream_cancels_its_call_and_releases_its_items() {
    over_every_transport("stream-drop", |_, c, _, seen| {
        for kind in KINDS {
            *seen.ended.lock().unwrap() = None;
            // Large items (by Ref where the pool is shared), some unread.
            let m = format!("count{kind}");
            let mut st = c.call_stream(&m, count_args(1000, 64 << 10)).unwrap();
            for _ in 0..3 {
                st.next().unwrap().unwrap();
            }
            drop(st);
            let mut st = c.call_stream(&format!("endless{kind}"), vec![1u8]).unwrap();
            st.next().unwrap().unwrap();
            drop(st);
            eventually("the handler saw the cancel", || {
                seen.ended.lock().unwrap().is_some()
            });
            assert_eq!(*seen.ended.lock().unwrap(), Some(Status::Cancelled), "{m}");
            let back = c.call("unary", vec![2u8]).unwrap();
            assert_eq!(back.to_vec().unwrap(), vec![2u8]);
        }
    });
}

#[test]
fn a_stream_ends_with_its_handlers_error_or_its_deadline() {
    over_every_transport("stream-end", |t, c, _, seen| {
        for kind in KINDS {
            *seen.ended.lock().unwrap() = None;
            let mut st = c.call_stream(&format!("fail{kind}"), vec![]).unwrap();
            assert_eq!(st.next().unwrap().unwrap().to_vec().unwrap(), vec![1]);
            assert_eq!(st.next().unwrap().unwrap().to_vec().unwrap(), vec![2]);
            let e = st.next().unwrap().unwrap_err();
            assert_eq!(e.status, Status::PermissionDenied, "{e}");
            assert!(st.next().is_none());
            // The deadline bounds the whole stream: items every 5 ms, for
            // 150 ms.
            let opts = CallOptions::deadline(Duration::from_millis(150));
            let m = format!("endless{kind}");
            let st = c
                .call_stream_with(&m, Payload::from_vec(vec![5]), opts, Metadata::new())
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
            assert_eq!(end, Some(Status::DeadlineExceeded), "{t:?} {m}");
            assert!(items >= 1, "{t:?} {m}: items came before the deadline");
            assert!(start.elapsed() < Duration::from_secs(2));
            eventually("the handler stopped", || {
                seen.ended.lock().unwrap().is_some()
            });
            let back = c.call("unary", vec![3u8]).unwrap();
            assert_eq!(back.to_vec().unwrap(), vec![3u8]);
        }
    });
}

#[test]
fn unary_and_streaming_methods_meet_the_other_kind_of_call() {
    over_every_transport("stream-kinds", |t, c, _, _| {
        // A streaming method called as a unary one: refused.
        for kind in KINDS {
            let e = c
                .call(&format!("count{kind}"), count_args(3, 3))
                .unwrap_err();
            assert_eq!(e.status, Status::InvalidArgument, "{e}");
        }
        // A unary method called as a stream: its answer is the one item,
        // by Ref too (the request's own Ref passed back).
        for len in [5usize, 300 << 10] {
            let st = c.call_stream("unary", pattern(len, 9)).unwrap();
            let items: Vec<Vec<u8>> = st.map(|i| i.unwrap().to_vec().unwrap()).collect();
            assert_eq!(items, vec![pattern(len, 9)], "{t:?}");
        }
        // No such method.
        let mut st = c.call_stream("nope", vec![]).unwrap();
        let e = st.next().unwrap().unwrap_err();
        assert_eq!(e.status, Status::NotFound);
        assert!(e.message.contains("no method \"nope\""), "{e}");
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
                            let m = format!("count{}", KINDS[(round / 2 % 2) as usize]);
                            let st = c.call_stream(&m, count_args(n, 2000)).unwrap();
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

/// Stops `old` gracefully and starts its successor, a server of `count`
/// and `count_async` alone, registered as soon as the old one unregistered (as it starts
/// draining); returns it once the old one stopped.
fn restart(node: &Node, name: &str, t: &Transport, old: Server) -> Server {
    let drain = std::thread::spawn(move || old.shutdown_gracefully(Duration::from_secs(5)));
    let until = Instant::now() + Duration::from_secs(5);
    let next = loop {
        let s = node
            .server(name)
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
            .method_stream_async("count_async", |c, mut sink| async move {
                let a = c.payload.to_vec()?;
                let n = u32::from_le_bytes(a[0..4].try_into().unwrap());
                let len = u32::from_le_bytes(a[4..8].try_into().unwrap());
                for k in 0..n {
                    sink.send(pattern(len as usize, k as u8)).await?;
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
    drain.join().unwrap();
    next
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
                                let m = format!("count{}", KINDS[n % 2]);
                                let st = c.call_stream_with(&m, arg, o, Metadata::new()).unwrap();
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
                    server = Some(restart(&node, &name, &t, server.take().unwrap()));
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

// The async client's streams ([`dm_rpc::AsyncStreaming`]): the same
// service, read from futures.

/// Runs `body` over every transport with an async client of a fresh
/// `service` on a tokio runtime, then stops it and checks that the pool
/// is clean.
fn async_over_every_transport<F, Fut>(test: &str, body: F)
where
    F: Fn(Transport, dm_rpc::AsyncClient, Arc<Seen>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for t in every_transport() {
        let tp = pool();
        {
            let node = Node::new(tp.attach());
            let name = unique(test);
            let seen = Arc::new(Seen::default());
            let s = service(&node, &name, &t, seen.clone());
            let c = node.connect_async(&name).unwrap();
            rt().block_on(body(t, c, seen));
            s.shutdown();
        }
        // (Its pump thread lets the client go within 100 ms.)
        tp.assert_clean_within(Duration::from_secs(2));
    }
}

/// Reads a stream to its end: its items, and the error it ended with.
async fn read_all(st: &mut dm_rpc::AsyncStreaming) -> (Vec<Vec<u8>>, Option<RpcError>) {
    let mut items = Vec::new();
    while let Some(item) = st.next().await {
        match item {
            Ok(p) => items.push(p.to_vec().unwrap()),
            Err(e) => {
                assert!(st.next().await.is_none(), "nothing after the error");
                return (items, Some(e));
            }
        }
    }
    (items, None)
}

#[test]
fn async_streams_carry_items_in_order_and_end_with_their_answer() {
    async_over_every_transport("astream-order", |t, c, _| async move {
        for (kind, n, len) in order_cases() {
            let m = format!("count{kind}");
            let mut st = c.call_stream(&m, count_args(n, len)).await.unwrap();
            let (items, end) = read_all(&mut st).await;
            assert!(end.is_none(), "{t:?}: {end:?}");
            assert_eq!(items.len(), n as usize, "{t:?}: every item, once");
            for (k, item) in items.iter().enumerate() {
                assert_eq!(*item, pattern(len as usize, k as u8), "{t:?} item {k}");
            }
            assert!(st.is_done());
            assert_eq!(st.metadata().get("items"), Some(n.to_string().as_bytes()));
        }
        // A handler's error, after its items.
        for kind in KINDS {
            let mut st = c.call_stream(&format!("fail{kind}"), vec![]).await.unwrap();
            let (items, end) = read_all(&mut st).await;
            assert_eq!(items, vec![vec![1], vec![2]]);
            assert_eq!(end.unwrap().status, Status::PermissionDenied);
        }
        // The other kinds of call.
        let e = c.call("count", count_args(3, 3)).await.unwrap_err();
        assert_eq!(e.status, Status::InvalidArgument, "{e}");
        let mut st = c.call_stream("unary", pattern(300 << 10, 9)).await.unwrap();
        assert_eq!(read_all(&mut st).await.0, vec![pattern(300 << 10, 9)]);
        let mut st = c.call_stream("nope", vec![]).await.unwrap();
        let e = read_all(&mut st).await.1.unwrap();
        assert_eq!(e.status, Status::NotFound);
        assert!(e.message.contains("no method \"nope\""), "{e}");
    });
}

#[test]
fn an_async_streams_window_bounds_the_server_and_a_drop_cancels_it() {
    async_over_every_transport("astream-window", |t, c, seen| async move {
        for kind in KINDS {
            *seen.ended.lock().unwrap() = None;
            let window = 4u64;
            let opts = CallOptions::default().window(window as u32);
            let arg = Payload::from_vec(vec![0]);
            let m = format!("endless{kind}");
            let mut st = c
                .call_stream_with(&m, arg, opts, Metadata::new())
                .await
                .unwrap();
            let mut read = 0u64;
            for _ in 0..5 {
                let granted = window + read / (window / 2) * (window / 2);
                let until = Instant::now() + Duration::from_secs(5);
                while seen.sent.load(Ordering::SeqCst) != granted {
                    assert!(Instant::now() < until, "{t:?}: the server sent {granted}");
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                tokio::time::sleep(Duration::from_millis(30)).await;
                let sent = seen.sent.load(Ordering::SeqCst);
                assert_eq!(sent, granted, "{t:?} {m}: no item beyond the grant");
                for _ in 0..3 {
                    let item = st.next().await.unwrap().unwrap();
                    assert_eq!(item.to_vec().unwrap(), read.to_le_bytes());
                    read += 1;
                }
            }
            drop(st);
            let until = Instant::now() + Duration::from_secs(5);
            while seen.ended.lock().unwrap().is_none() {
                assert!(Instant::now() < until, "{t:?}: the handler saw the cancel");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            assert_eq!(*seen.ended.lock().unwrap(), Some(Status::Cancelled), "{m}");
            // Large items, some unread, released with the dropped stream.
            let mut st = c
                .call_stream(&format!("count{kind}"), count_args(1000, 64 << 10))
                .await
                .unwrap();
            for _ in 0..3 {
                st.next().await.unwrap().unwrap();
            }
            drop(st);
            let back = c.call("unary", vec![1u8]).await.unwrap();
            assert_eq!(back.to_vec().unwrap(), vec![1u8]);
        }
    });
}

#[test]
fn an_async_stream_ends_at_its_deadline_and_a_dropped_next_loses_nothing() {
    async_over_every_transport("astream-deadline", |t, c, seen| async move {
        for kind in KINDS {
            *seen.ended.lock().unwrap() = None;
            let m = format!("endless{kind}");
            // Items every 20 ms: a wait of 5 ms for the next one gives up,
            // and the item it waited for is the next one's.
            let mut st = c.call_stream(&m, vec![20u8]).await.unwrap();
            for k in 0..4u64 {
                let quick = tokio::time::timeout(Duration::from_millis(5), st.next()).await;
                if let Ok(item) = quick {
                    // (A slow host: the item came within the 5 ms.)
                    assert_eq!(item.unwrap().unwrap().to_vec().unwrap(), k.to_le_bytes());
                    continue;
                }
                let item = st.next().await.unwrap().unwrap();
                assert_eq!(item.to_vec().unwrap(), k.to_le_bytes(), "{t:?}");
            }
            drop(st);
            // The deadline bounds the whole stream: items every 5 ms, for
            // 150 ms.
            let opts = CallOptions::deadline(Duration::from_millis(150));
            let arg = Payload::from_vec(vec![5]);
            // (The first stream's handler ends with its cancel.)
            let until = Instant::now() + Duration::from_secs(5);
            while seen.ended.lock().unwrap().take().is_none() {
                assert!(Instant::now() < until, "{t:?} {m}: the first stream ended");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let start = Instant::now();
            let mut st = c
                .call_stream_with(&m, arg, opts, Metadata::new())
                .await
                .unwrap();
            let (items, end) = read_all(&mut st).await;
            assert_eq!(
                end.map(|e| e.status),
                Some(Status::DeadlineExceeded),
                "{t:?} {m}"
            );
            assert!(!items.is_empty(), "{t:?}: items came before the deadline");
            assert!(start.elapsed() < Duration::from_secs(2));
            let until = Instant::now() + Duration::from_secs(5);
            while seen.ended.lock().unwrap().is_none() {
                assert!(Instant::now() < until, "{t:?}: the handler stopped");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let back = c.call("unary", vec![3u8]).await.unwrap();
            assert_eq!(back.to_vec().unwrap(), vec![3u8]);
        }
    });
}

#[test]
fn async_streams_and_calls_share_a_connection_across_tasks() {
    async_over_every_transport("astream-mix", |_, c, _| async move {
        let mut set = tokio::task::JoinSet::new();
        for task in 0..8u32 {
            let c = c.clone();
            set.spawn(async move {
                for round in 0..20u32 {
                    if (task + round) % 2 == 0 {
                        let n = 5 + task;
                        let m = format!("count{}", KINDS[(round / 2 % 2) as usize]);
                        let mut st = c.call_stream(&m, count_args(n, 2000)).await.unwrap();
                        let (items, end) = read_all(&mut st).await;
                        assert!(end.is_none(), "{end:?}");
                        assert_eq!(items.len(), n as usize);
                        for (k, item) in items.iter().enumerate() {
                            assert_eq!(*item, pattern(2000, k as u8));
                        }
                    } else {
                        let v = vec![task as u8; 100];
                        let back = c.call("unary", v.clone()).await.unwrap();
                        assert_eq!(back.to_vec().unwrap(), v);
                    }
                }
            });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
    });
}

/// An async stream waiting for its caller holds up nothing: calls on its
/// own connection and on others are served meanwhile, and two streams of
/// one connection advance together (blocking handlers' would not: the
/// second would wait for the first to end, which waits for its caller,
/// who reads them in turn). The items and ends of streams need less room
/// than unary answers: three streams and a call fit one connection.
#[test]
fn async_streams_run_beside_the_servers_other_calls() {
    for t in every_transport() {
        let tp = pool();
        {
            let node = Node::new(tp.attach());
            let name = unique("astream-beside");
            let seen = Arc::new(Seen::default());
            let s = service(&node, &name, &t, seen.clone());
            let (c, other) = (node.connect(&name).unwrap(), node.connect(&name).unwrap());
            let within = || CallOptions::deadline(Duration::from_secs(10));
            // A stream that waits for its caller (one item granted, unread).
            let arg = Payload::from_vec(vec![0]);
            let o = within().window(1);
            let mut waiting = c
                .call_stream_with("endless_async", arg, o, Metadata::new())
                .unwrap();
            eventually("the stream waits for a grant", || {
                seen.sent.load(Ordering::SeqCst) == 1
            });
            for k in 0..20u8 {
                for cl in [&c, &other] {
                    let arg = Payload::from_vec(vec![k; 1 + k as usize * 1000]);
                    let back = cl.call_with("unary", arg, within()).unwrap();
                    assert_eq!(back.to_vec().unwrap(), vec![k; 1 + k as usize * 1000]);
                }
            }
            // Two more streams of the same connection, read in turn, with
            // items inline and by Ref.
            for len in [100u32, 200 << 10] {
                let open = |n: u32| {
                    let arg = Payload::from_vec(count_args(n, len));
                    let o = within().window(2);
                    c.call_stream_with("count_async", arg, o, Metadata::new())
                        .unwrap()
                };
                let (mut a, mut b) = (open(30), open(20));
                for k in 0..30u8 {
                    let item = a.next().unwrap().unwrap();
                    assert_eq!(item.to_vec().unwrap(), pattern(len as usize, k), "{t:?}");
                    if k < 20 {
                        let item = b.next().unwrap().unwrap();
                        assert_eq!(item.to_vec().unwrap(), pattern(len as usize, k));
                    }
                }
                assert!(a.next().is_none() && b.next().is_none(), "{t:?}");
                assert_eq!(a.metadata().get("items"), Some(&b"30"[..]));
            }
            // The first stream still waits, and goes on when read.
            assert_eq!(seen.sent.load(Ordering::SeqCst), 1, "{t:?}");
            for k in 0..3u64 {
                let item = waiting.next().unwrap().unwrap();
                assert_eq!(item.to_vec().unwrap(), k.to_le_bytes(), "{t:?}");
            }
            drop(waiting);
            eventually("the handler saw the cancel", || {
                seen.ended.lock().unwrap().is_some()
            });
            assert_eq!(*seen.ended.lock().unwrap(), Some(Status::Cancelled));
            drop((c, other));
            s.shutdown();
        }
        tp.assert_clean();
    }
}

/// An async handler reads a stream of another service (its answers read
/// by the handler's own server's listener over shm) and answers with
/// the sum of the items' first bytes.
#[test]
fn an_async_handler_reads_another_services_stream() {
    for t in every_transport() {
        let tp = pool();
        {
            let node = Node::new(tp.attach());
            let (back, front) = (unique("astream-back"), unique("astream-front"));
            let s = service(&node, &back, &t, Arc::default());
            let target = node.connect_async(&back).unwrap();
            let f = node
                .server(&front)
                .transport(t.clone())
                .method_async("sum", move |call| {
                    let target = target.clone();
                    async move {
                        let mut st = target.call_stream("count", call.payload.to_vec()?).await?;
                        let mut sum = 0u64;
                        while let Some(item) = st.next().await {
                            sum += item?.to_vec()?.first().copied().unwrap_or(0) as u64;
                        }
                        Ok(Payload::from_vec(sum.to_le_bytes().to_vec()))
                    }
                })
                .spawn()
                .unwrap();
            let c = node.connect(&front).unwrap();
            for (n, len) in [(50u32, 10u32), (20, 128 << 10)] {
                let got = c.call("sum", count_args(n, len)).unwrap().to_vec().unwrap();
                let want: u64 = (0..n)
                    .map(|k| pattern(len as usize, k as u8)[0] as u64)
                    .sum();
                assert_eq!(got, want.to_le_bytes(), "{t:?}");
            }
            drop(c);
            f.shutdown();
            s.shutdown();
        }
        tp.assert_clean_within(Duration::from_secs(2));
    }
}

#[test]
fn async_streams_survive_a_rolling_restart_and_balance_over_replicas() {
    for t in every_transport() {
        let tp = pool();
        {
            let node = Node::new(tp.attach());
            let name = unique("astream-restart");
            let mut server = Some(service(&node, &name, &t, Arc::default()));
            let c = node.connect_async(&name).unwrap();
            let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let rt = rt();
            // Streams one after another from two tasks, each checked
            // whole: none may fail.
            let load: Vec<_> = (0..2u8)
                .map(|task| {
                    let (c, done, t) = (c.clone(), done.clone(), t.clone());
                    rt.spawn(async move {
                        let mut n = 0;
                        while !done.load(Ordering::Relaxed) {
                            let len = 10 + task as u32;
                            let o = CallOptions::deadline(Duration::from_secs(10))
                                .wait_for_ready()
                                .idempotent();
                            let arg = Payload::from_vec(count_args(4, len));
                            let m = format!("count{}", KINDS[n % 2]);
                            let mut st = c
                                .call_stream_with(&m, arg, o, Metadata::new())
                                .await
                                .unwrap_or_else(|e| panic!("{t:?} stream {n}: {e}"));
                            let (items, end) = read_all(&mut st).await;
                            assert!(end.is_none(), "{t:?} stream {n}: {end:?}");
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
                server = Some(restart(&node, &name, &t, server.take().unwrap()));
            }
            std::thread::sleep(Duration::from_millis(30));
            done.store(true, Ordering::Relaxed);
            let streams: usize = load.into_iter().map(|h| rt.block_on(h).unwrap()).sum();
            assert!(streams >= 4, "{t:?}: {streams} streams");
            drop(c);
            if let Some(s) = server {
                s.shutdown();
            }
            // Replicas: an async balanced client's streams go to each in
            // turn, and an open one counts as in flight on its replica.
            let rname = unique("astream-replicas");
            let reps: Vec<Server> = (0..2)
                .map(|k| {
                    node.server(&rname)
                        .transport(t.clone())
                        .replica()
                        .method_stream("who", move |_, sink| sink.send(vec![k as u8]))
                        .spawn()
                        .unwrap()
                })
                .collect();
            let b = node.connect_balanced_async(&rname).unwrap();
            rt.block_on(async {
                let mut seen = Vec::new();
                for _ in 0..4 {
                    let mut st = b.call_stream("who", vec![]).await.unwrap();
                    seen.push(read_all(&mut st).await.0[0][0]);
                }
                seen.sort();
                assert_eq!(seen, vec![0, 0, 1, 1], "{t:?}: in turn");
                // One open stream: the next two go to the other replica.
                let mut open = b.call_stream("who", vec![]).await.unwrap();
                let first = open.next().await.unwrap().unwrap().to_vec().unwrap()[0];
                for _ in 0..2 {
                    let mut st = b.call_stream("who", vec![]).await.unwrap();
                    assert_ne!(read_all(&mut st).await.0[0][0], first, "{t:?}");
                }
                assert!(open.next().await.is_none());
            });
            drop(b);
            for r in reps {
                r.shutdown();
            }
        }
        tp.assert_clean_within(Duration::from_secs(2));
    }
}

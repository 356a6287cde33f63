//! Calls whose caller sends a stream of items ([`dm_rpc::AsyncBidi`]):
//! bidirectional streams and callers' streams answered once, over every
//! transport; flow control from server to caller; early ends either way;
//! large items by Ref both ways, with nothing left in the pool.
#![cfg(not(loom))]
#![allow(clippy::unwrap_used)]

use dm_rpc::frame::{method_id, Frame, FLAG_CALLER_STREAM, FLAG_STREAM};
use dm_rpc::{Body, CallOptions, Metadata, Node, Payload, RpcError, Server, Status, Transport};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;
use common::{every_transport, pattern, pool, rt, unique};

/// What the handlers saw.
#[derive(Default)]
struct Seen {
    /// Items the `gate` handler may read (it waits for more).
    allow: AtomicU64,
    /// Items the `gate` handler read.
    read: AtomicU64,
    /// A handler's future was dropped before it ended.
    dropped: AtomicBool,
}

/// Sets `dropped` if the future holding it is dropped before `done`.
struct Guard(Arc<Seen>, bool);

impl Drop for Guard {
    fn drop(&mut self) {
        if !self.1 {
            self.0.dropped.store(true, Ordering::SeqCst);
        }
    }
}

fn service(node: &Node, name: &str, t: &Transport, seen: Arc<Seen>) -> Server {
    let gate = seen.clone();
    let held = seen;
    node.server(name)
        .transport(t.clone())
        // Every item back as it comes, then how many.
        .method_bidi_async("echo", |_call, mut inbox, mut sink| async move {
            while let Some(item) = inbox.next().await {
                sink.send(item?).await?;
            }
            let n = inbox.read();
            sink.send(Payload::from_vec(n.to_le_bytes().to_vec())).await
        })
        // A caller's stream answered once: the bytes of every item, and
        // how many items (the call's argument says how many to expect).
        .method_bidi_async("sum", |call, mut inbox, mut sink| async move {
            let want = u64::from_le_bytes(call.payload.to_vec()?.try_into().unwrap());
            let mut bytes = 0u64;
            while let Some(item) = inbox.next().await {
                let item = item?;
                let v = item.to_vec()?;
                let k = inbox.read() - 1;
                if v != pattern(v.len(), k as u8) {
                    return Err(RpcError::invalid_argument(format!(
                        "item {k} is not its own"
                    )));
                }
                bytes += v.len() as u64;
            }
            if inbox.read() != want {
                return Err(RpcError::invalid_argument("items missing"));
            }
            let mut out = bytes.to_le_bytes().to_vec();
            out.extend(inbox.read().to_le_bytes());
            // Carried by the answer itself.
            sink.end_with(Payload::from_vec(out));
            Ok(())
        })
        // Reads only as many items as `allow` says.
        .method_bidi_async("gate", move |_call, mut inbox, _sink| {
            let seen = gate.clone();
            async move {
                let mut guard = Guard(seen.clone(), false);
                loop {
                    while seen.read.load(Ordering::SeqCst) >= seen.allow.load(Ordering::SeqCst) {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    match inbox.next().await {
                        Some(item) => {
                            item?;
                            seen.read.fetch_add(1, Ordering::SeqCst);
                        }
                        None => break,
                    }
                }
                guard.1 = true;
                Ok(())
            }
        })
        // Reads two items, then fails.
        .method_bidi_async("two", |_call, mut inbox, _sink| async move {
            for _ in 0..2 {
                inbox.next().await.unwrap()?;
            }
            Err(RpcError::new(Status::PermissionDenied, "two is enough"))
        })
        // Never ends on its own.
        .method_bidi_async("hold", move |_call, mut inbox, _sink| {
            let seen = held.clone();
            async move {
                let _guard = Guard(seen, false);
                while let Some(item) = inbox.next().await {
                    item?;
                }
                std::future::pending::<()>().await;
                Ok(())
            }
        })
        .method_async("unary", |call| async move { Ok(call.payload) })
        // `echo`, from a blocking handler.
        .method_bidi("becho", |_call, inbox, sink| {
            for item in inbox.by_ref() {
                sink.send(item?)?;
            }
            sink.send(Payload::from_vec(inbox.read().to_le_bytes().to_vec()))
        })
        // Any other method: its name from the metadata, back as the
        // first item's metadata, then the items it was sent.
        .fallback_bidi_async(|call, mut inbox, mut sink| async move {
            let asked = call.metadata.get("path").unwrap_or(b"?").to_vec();
            let head = Metadata::new().with("path", asked).unwrap();
            sink.send_with_metadata(Payload::empty(), head).await?;
            sink.send(call.payload).await?;
            while let Some(item) = inbox.next().await {
                sink.send(item?).await?;
            }
            Ok(())
        })
        .spawn()
        .unwrap()
}

/// Runs `body` over every transport with an async client of a fresh
/// service, then stops it and checks that the pool is clean.
fn over_every_transport<F, Fut>(test: &str, body: F)
where
    F: Fn(Transport, dm_rpc::AsyncClient, Arc<Seen>, String) -> Fut,
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
            rt().block_on(body(t, c, seen, name));
            s.shutdown();
        }
        tp.assert_clean_within(Duration::from_secs(2));
    }
}

async fn eventually(what: &str, f: impl Fn() -> bool) {
    let until = Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(Instant::now() < until, "{what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[test]
fn items_go_both_ways_in_order_inline_and_by_ref() {
    over_every_transport("bidi-echo", |t, c, _, _| async move {
        for (n, len) in [(0u32, 0usize), (1, 10), (100, 64), (40, 300 << 10)] {
            let mut call = c.call_bidi("echo", vec![]).await.unwrap();
            // Sends and reads in turn: each item comes back before the next.
            for k in 0..n {
                call.send(pattern(len, k as u8)).await.unwrap();
                let back = call.next().await.unwrap().unwrap();
                assert_eq!(back.to_vec().unwrap(), pattern(len, k as u8), "{t:?} {k}");
            }
            call.finish().await.unwrap();
            let count = call.next().await.unwrap().unwrap().to_vec().unwrap();
            assert_eq!(count, u64::from(n).to_le_bytes(), "{t:?}");
            assert!(call.next().await.is_none(), "{t:?}: the end");
        }
        // Split: one task sends everything while another reads.
        let (mut items, mut answers) = c.call_bidi("echo", vec![]).await.unwrap().split();
        let sender = tokio::spawn(async move {
            for k in 0..500u32 {
                items.send(pattern(1000, k as u8)).await.unwrap();
            }
            items.finish().await.unwrap();
        });
        for k in 0..500u32 {
            let back = answers.next().await.unwrap().unwrap();
            assert_eq!(back.to_vec().unwrap(), pattern(1000, k as u8), "{t:?} {k}");
        }
        let count = answers.next().await.unwrap().unwrap().to_vec().unwrap();
        assert_eq!(count, 500u64.to_le_bytes());
        assert!(answers.next().await.is_none());
        sender.await.unwrap();
    });
}

#[test]
fn a_callers_stream_is_answered_once() {
    over_every_transport("bidi-sum", |t, c, _, _| async move {
        for (n, len) in [(0u64, 1usize), (3, 100), (50, 1 << 20)] {
            let mut call = c.call_bidi("sum", n.to_le_bytes().to_vec()).await.unwrap();
            for k in 0..n {
                call.send(pattern(len, k as u8)).await.unwrap();
            }
            call.finish().await.unwrap();
            let got = call.next().await.unwrap().unwrap().to_vec().unwrap();
            let (bytes, count) = got.split_at(8);
            assert_eq!(bytes, (n * len as u64).to_le_bytes(), "{t:?}");
            assert_eq!(count, n.to_le_bytes(), "{t:?}");
            assert!(call.next().await.is_none());
        }
        // Finished before the server even took the request.
        let mut call = c
            .call_bidi("sum", 0u64.to_le_bytes().to_vec())
            .await
            .unwrap();
        call.finish().await.unwrap();
        assert!(call.next().await.unwrap().is_ok(), "{t:?}");
    });
}

#[test]
fn the_server_grants_what_its_handler_reads() {
    over_every_transport("bidi-gate", |t, c, seen, _| async move {
        let (mut items, mut answers) = c.call_bidi("gate", vec![]).await.unwrap().split();
        let sent = Arc::new(AtomicU64::new(0));
        let counter = sent.clone();
        let sender = tokio::spawn(async move {
            for k in 0..100u32 {
                items.send(pattern(100, k as u8)).await.unwrap();
                counter.fetch_add(1, Ordering::SeqCst);
            }
            items.finish().await.unwrap();
        });
        // The handler reads nothing: the caller sends its window, no more.
        let window = dm_rpc::stream::DEFAULT_WINDOW as u64;
        eventually("the first window goes", || {
            sent.load(Ordering::SeqCst) == window
        })
        .await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            sent.load(Ordering::SeqCst),
            window,
            "{t:?}: nothing beyond the grant"
        );
        // Half a window read: half a window more may go.
        seen.allow.store(window / 2, Ordering::SeqCst);
        let more = window + window / 2;
        eventually("half a window more", || sent.load(Ordering::SeqCst) == more).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(sent.load(Ordering::SeqCst), more, "{t:?}");
        // Then everything.
        seen.allow.store(u64::MAX, Ordering::SeqCst);
        sender.await.unwrap();
        assert!(answers.next().await.is_none(), "{t:?}: ends well");
        assert_eq!(seen.read.load(Ordering::SeqCst), 100);
    });
}

#[test]
fn an_early_end_either_way_stops_the_other() {
    over_every_transport("bidi-early", |t, c, seen, _| async move {
        // The server ends first: the caller's sends fail, its answer says why.
        let mut call = c.call_bidi("two", vec![]).await.unwrap();
        let mut failed = None;
        for k in 0..1000u32 {
            if let Err(e) = call.send(pattern(10, k as u8)).await {
                failed = Some(e);
                break;
            }
        }
        let e = failed.expect("a send fails once the call ended");
        assert_eq!(e.status, Status::Cancelled, "{t:?}: {e}");
        let end = call.next().await.unwrap().unwrap_err();
        assert_eq!(end.status, Status::PermissionDenied, "{t:?}: {end}");
        // The caller drops the call: the handler's future is dropped.
        let mut call = c.call_bidi("hold", vec![]).await.unwrap();
        call.send(pattern(300 << 10, 1)).await.unwrap();
        call.send(vec![1u8]).await.unwrap();
        drop(call);
        eventually("the handler is dropped", || {
            seen.dropped.load(Ordering::SeqCst)
        })
        .await;
        // The items dropped without a finish: the call is not left hanging.
        seen.dropped.store(false, Ordering::SeqCst);
        let (items, answers) = c.call_bidi("hold", vec![]).await.unwrap().split();
        drop(items);
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(answers);
        eventually("and dropped again", || seen.dropped.load(Ordering::SeqCst)).await;
        // A method that takes no items says so; the connection goes on.
        let mut call = c.call_bidi("unary", vec![1u8]).await.unwrap();
        let e = call.next().await.unwrap().unwrap_err();
        assert_eq!(e.status, Status::InvalidArgument, "{t:?}: {e}");
        assert!(e.message.contains("takes no items"), "{e}");
        let back = c.call("unary", vec![7u8]).await.unwrap();
        assert_eq!(back.to_vec().unwrap(), vec![7u8]);
    });
}

#[test]
fn a_caller_that_sends_more_than_granted_is_refused() {
    let tp = pool();
    {
        let node = Node::new(tp.attach());
        let name = unique("bidi-flood");
        let s = service(&node, &name, &Transport::Mem, Arc::new(Seen::default()));
        // From an async handler, and from a blocking one.
        for (id, method) in [(1u64, "echo"), (2, "becho")] {
            let mut conn = dm_rpc::raw::mem::connect(&name).unwrap();
            let mut req = Frame::request(id, method_id(method), 0, Body::None);
            req.flags = FLAG_STREAM | FLAG_CALLER_STREAM;
            assert!(conn.tx.send(&req, None).unwrap());
            assert!(conn.tx.send(&Frame::credit(id, 1000), None).unwrap());
            // Past the window, without waiting for a grant.
            for k in 0..100u8 {
                let item = Frame::item(id, Body::Inline(vec![k].into()));
                assert!(conn.tx.send(&item, None).unwrap());
            }
            let until = Instant::now() + Duration::from_secs(5);
            let end = loop {
                let f = conn.rx.recv(Some(until)).unwrap().expect("an answer");
                if f.kind == dm_rpc::Kind::Response {
                    break f;
                }
            };
            assert_eq!(end.status, Status::ResourceExhausted, "{method}");
        }
        s.shutdown();
    }
    tp.assert_clean_within(Duration::from_secs(2));
}

#[test]
fn items_for_a_call_that_takes_none_are_dropped_unread() {
    let tp = pool();
    {
        let node = Node::new(tp.attach());
        let name = unique("bidi-none");
        let s = service(&node, &name, &Transport::Mem, Arc::new(Seen::default()));
        let mut conn = dm_rpc::raw::mem::connect(&name).unwrap();
        // A stream opened without items of its caller, then items anyway.
        let mut req = Frame::request(1, method_id("echo"), 0, Body::None);
        req.flags = FLAG_STREAM;
        assert!(conn.tx.send(&req, None).unwrap());
        assert!(conn.tx.send(&Frame::credit(1, 1000), None).unwrap());
        for k in 0..20u8 {
            let item = Frame::item(1, Body::Inline(vec![k].into()));
            assert!(conn.tx.send(&item, None).unwrap());
        }
        let until = Instant::now() + Duration::from_secs(5);
        let mut items = Vec::new();
        let end = loop {
            let f = conn.rx.recv(Some(until)).unwrap().expect("an answer");
            match f.kind {
                dm_rpc::Kind::Response => break f,
                _ => items.push(f),
            }
        };
        assert_eq!(end.status, Status::Ok);
        // The handler read none: its one item (or the answer) says 0.
        let said: Vec<u8> = match (items.as_slice(), &end.payload) {
            ([f], _) | ([f, ..], _) => match &f.payload {
                Body::Inline(b) => b.to_vec(),
                other => panic!("an item of {other:?}"),
            },
            ([], Body::Inline(b)) => b.to_vec(),
            (_, other) => panic!("an answer of {other:?}"),
        };
        assert_eq!(said, 0u64.to_le_bytes().to_vec(), "{items:?}");
        // The connection goes on.
        let req = Frame::request(2, method_id("unary"), 0, Body::Inline(vec![9u8].into()));
        assert!(conn.tx.send(&req, None).unwrap());
        let f = conn.rx.recv(Some(until)).unwrap().expect("an answer");
        assert_eq!((f.call_id, f.status), (2, Status::Ok));
        s.shutdown();
    }
    tp.assert_clean_within(Duration::from_secs(2));
}

#[test]
fn a_fallback_serves_every_other_method_and_items_carry_metadata() {
    over_every_transport("bidi-fallback", |t, c, _, _| async move {
        for (method, items) in [("/pkg.Svc/Unary", 0u32), ("/pkg.Svc/Stream", 3)] {
            let meta = Metadata::new().with("path", method).unwrap();
            let arg = Payload::from_vec(pattern(300 << 10, 1));
            let mut call = c
                .call_bidi_with(method, arg, CallOptions::default(), meta)
                .await
                .unwrap();
            // The first item: empty, with metadata.
            let (head, m) = call.next_with_metadata().await.unwrap().unwrap();
            assert!(head.is_empty(), "{t:?}");
            assert_eq!(m.get("path"), Some(method.as_bytes()), "{t:?}");
            let (arg, m) = call.next_with_metadata().await.unwrap().unwrap();
            assert!(m.is_empty());
            assert_eq!(arg.to_vec().unwrap(), pattern(300 << 10, 1), "{t:?}");
            for k in 0..items {
                call.send(pattern(10, k as u8)).await.unwrap();
                let back = call.next().await.unwrap().unwrap();
                assert_eq!(back.to_vec().unwrap(), pattern(10, k as u8));
            }
            call.finish().await.unwrap();
            assert!(call.next().await.is_none(), "{t:?}");
        }
        // Registered methods are still theirs; a plain call of an
        // unregistered one is refused, not served.
        let back = c.call("unary", vec![3u8]).await.unwrap();
        assert_eq!(back.to_vec().unwrap(), vec![3u8]);
        let e = c.call("/pkg.Svc/Unary", vec![3u8]).await.unwrap_err();
        assert_eq!(e.status, Status::InvalidArgument, "{t:?}: {e}");
    });
}

/// Echoes through `method` with a blocking caller: in turn, then from two
/// threads.
fn blocking_echo(t: &Transport, c: &dm_rpc::Client, method: &str) {
    for (n, len) in [(0u32, 0usize), (30, 64), (10, 300 << 10)] {
        let mut call = c.call_bidi(method, vec![]).unwrap();
        for k in 0..n {
            call.send(pattern(len, k as u8)).unwrap();
            let back = call.next().unwrap().unwrap();
            assert_eq!(
                back.to_vec().unwrap(),
                pattern(len, k as u8),
                "{t:?} {method} {k}"
            );
        }
        call.finish().unwrap();
        let count = call.next().unwrap().unwrap().to_vec().unwrap();
        assert_eq!(count, u64::from(n).to_le_bytes(), "{t:?} {method}");
        assert!(call.next().is_none());
    }
    let (mut items, answers) = c.call_bidi(method, vec![]).unwrap().split();
    let sender = std::thread::spawn(move || {
        for k in 0..300u32 {
            items.send(pattern(500, k as u8)).unwrap();
        }
        items.finish().unwrap();
    });
    let got: Vec<_> = answers.map(|p| p.unwrap().to_vec().unwrap()).collect();
    sender.join().unwrap();
    assert_eq!(got.len(), 301, "{t:?} {method}");
    for (k, g) in got[..300].iter().enumerate() {
        assert_eq!(*g, pattern(500, k as u8), "{t:?} {method} {k}");
    }
}

#[test]
fn blocking_callers_and_handlers_stream_both_ways() {
    for t in every_transport() {
        let tp = pool();
        {
            let node = Node::new(tp.attach());
            let name = unique("bidi-blocking");
            let s = service(&node, &name, &t, Arc::new(Seen::default()));
            // A blocking caller, of a blocking handler and of an async one.
            let c = node.connect(&name).unwrap();
            blocking_echo(&t, &c, "becho");
            blocking_echo(&t, &c, "echo");
            // An async caller of the blocking handler.
            let ac = node.connect_async(&name).unwrap();
            rt().block_on(async {
                let mut call = ac.call_bidi("becho", vec![]).await.unwrap();
                for k in 0..40u32 {
                    call.send(pattern(70 << 10, k as u8)).await.unwrap();
                    let back = call.next().await.unwrap().unwrap();
                    assert_eq!(back.to_vec().unwrap(), pattern(70 << 10, k as u8));
                }
                call.finish().await.unwrap();
                let count = call.next().await.unwrap().unwrap().to_vec().unwrap();
                assert_eq!(count, 40u64.to_le_bytes(), "{t:?}");
            });
            // A method that takes no items says so to a blocking caller.
            let mut call = c.call_bidi("unary", vec![1u8]).unwrap();
            let e = call.next().unwrap().unwrap_err();
            assert_eq!(e.status, Status::InvalidArgument, "{t:?}: {e}");
            drop((c, ac));
            s.shutdown();
        }
        tp.assert_clean_within(Duration::from_secs(2));
    }
}

//! The async client over every transport: many calls outstanding on one
//! connection, deadlines, and a server that goes away.
#![allow(clippy::unwrap_used)]

use dm_pool::testing::TempPool;
use dm_pool::PoolConfig;
use dm_rpc::{CallOptions, Node, Payload, RpcError, Status, Transport};
use std::time::Duration;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn suite(t: Transport, tag: &str) {
    let tp = TempPool::with(PoolConfig {
        size: 256 << 20,
        channels: Some(8),
        ..Default::default()
    });
    let node = Node::new(tp.attach());
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
    let c = node.connect_async(&name).unwrap();
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
    });
    drop(c);
    drop(node);
    // The pump notices the dropped client within its 100 ms poll.
    std::thread::sleep(Duration::from_millis(300));
    tp.assert_clean();
}

#[test]
fn async_over_shm() {
    suite(Transport::Shm, "shm");
}

#[test]
fn async_over_tcp() {
    suite(Transport::Tcp("127.0.0.1:0".into()), "tcp");
}

#[test]
fn async_over_mem() {
    suite(Transport::Mem, "mem");
}

/// Async handlers run concurrently: twenty calls that each await 200 ms
/// finish together, and a handler can await a nested async call.
fn async_handlers(t: Transport, tag: &str) {
    let tp = TempPool::with(PoolConfig {
        size: 256 << 20,
        channels: Some(8),
        ..Default::default()
    });
    // A small threshold: many answers may be owed on one connection.
    let node = Node::with_config(
        tp.attach(),
        dm_rpc::Config {
            inline_max: 4096,
            ..Default::default()
        },
    );
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
    let next: std::sync::Arc<std::sync::OnceLock<dm_rpc::AsyncClient>> = Default::default();
    let front_svc = node
        .server(&front)
        .transport(t)
        .method_async("via", move |c| {
            let (next, leaf) = (next.clone(), leaf_name.clone());
            async move {
                let cl = match next.get() {
                    Some(cl) => cl.clone(),
                    None => {
                        let cl = c.node.connect_async(&leaf)?;
                        let _ = next.set(cl.clone());
                        cl
                    }
                };
                cl.call("slow", c.payload.forward()?).await
            }
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
    front_svc.shutdown();
    leaf_svc.shutdown();
    drop(node);
    std::thread::sleep(Duration::from_millis(300));
    tp.assert_clean();
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

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

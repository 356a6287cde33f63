//! The example service and its clients as separate processes: a server
//! killed with `kill -9` in the middle of a stream, and bytes that are
//! not HTTP/2 sent down a byte stream.
#![allow(clippy::unwrap_used)]

use dm_grpc::example::imaging::imaging_client::ImagingClient;
use dm_grpc::example::imaging::Blob;
use dm_pool::testing::TempPool;
use dm_pool::PoolConfig;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tokio_stream::StreamExt;

fn pool() -> TempPool {
    TempPool::with(PoolConfig {
        size: 64 << 20,
        channels: Some(16),
        ..Default::default()
    })
}

/// `imaging serve` on `tp`, ready.
fn server(tp: &TempPool, name: &str) -> Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_imaging"))
        .args(["serve", tp.path.to_str().unwrap(), name])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready");
    child
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn a_server_killed_mid_stream_ends_it_unavailable_and_leaks_nothing() {
    for way in [dm_grpc::Way::Direct, dm_grpc::Way::Http2] {
        killed_mid_stream(way);
    }
}

fn killed_mid_stream(way: dm_grpc::Way) {
    let tp = pool();
    let name = format!("test/grpc-kill/{}", std::process::id());
    let mut srv = server(&tp, &name);
    {
        let node = dm_rpc::Node::new(tp.attach());
        rt().block_on(async {
            let mut dial = dm_grpc::Dial::new(&node, &name);
            if way == dm_grpc::Way::Http2 {
                dial = dial.http2();
            }
            let ch = dial.connect().await.unwrap();
            let mut c = ImagingClient::new(ch);
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            let mut back = c
                .chat(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .unwrap()
                .into_inner();
            for k in 0..20u64 {
                let data = if k % 5 == 0 {
                    vec![1u8; 300 << 10]
                } else {
                    vec![2u8; 10]
                };
                tx.send(Blob {
                    data: data.into(),
                    seq: k,
                })
                .await
                .unwrap();
                assert_eq!(back.next().await.unwrap().unwrap().seq, k);
            }
            // Mid-stream: the server dies.
            srv.kill().unwrap();
            srv.wait().unwrap();
            let _ = tx
                .send(Blob {
                    data: vec![3u8; 10].into(),
                    seq: 99,
                })
                .await;
            let end = tokio::time::timeout(Duration::from_secs(10), back.next())
                .await
                .expect("the stream ends");
            let status = end.expect("with a status").unwrap_err();
            assert_eq!(status.code(), tonic::Code::Unavailable, "{way:?}: {status}");
            // New calls fail the same way, promptly.
            let e = tokio::time::timeout(
                Duration::from_secs(10),
                c.echo(Blob {
                    data: vec![1u8].into(),
                    seq: 1,
                }),
            )
            .await
            .expect("promptly")
            .unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unavailable, "{way:?}: {e}");
        });
    }
    // What the dead server held is reclaimed; nothing else is left.
    dm_pool::gc_path(&tp.path).unwrap();
    tp.assert_clean_within(Duration::from_secs(2));
}

#[test]
fn bytes_that_are_not_http2_lose_their_stream_only() {
    let tp = pool();
    let name = format!("test/grpc-garbage/{}", std::process::id());
    let mut srv = server(&tp, &name);
    {
        let node = dm_rpc::Node::new(tp.attach());
        rt().block_on(async {
            // A raw byte stream to the server: garbage instead of the
            // HTTP/2 preface, then a preface and a malformed frame.
            let client = node.connect_async(&name).unwrap();
            for junk in [
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
                [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".as_slice(), &[0xff; 64]].concat(),
                vec![0u8; 1 << 20],
            ] {
                let mut call = client.call_bidi("dmrpc.grpc/h2", Vec::new()).await.unwrap();
                call.send(junk).await.unwrap();
                // The server drops the stream: the call ends.
                let ended = tokio::time::timeout(Duration::from_secs(10), async {
                    while let Some(Ok(_)) = call.next().await {}
                })
                .await;
                assert!(ended.is_ok(), "the server ends the stream");
            }
            // The server still serves.
            let ch = dm_grpc::Dial::new(&node, &name)
                .http2()
                .connect()
                .await
                .unwrap();
            let mut c = ImagingClient::new(ch);
            let b = c
                .echo(Blob {
                    data: vec![5u8; 10].into(),
                    seq: 5,
                })
                .await
                .unwrap();
            assert_eq!(b.into_inner().seq, 5);
        });
    }
    srv.kill().unwrap();
    srv.wait().unwrap();
    dm_pool::gc_path(&tp.path).unwrap();
    tp.assert_clean_within(Duration::from_secs(2));
}

//! The example service over every path a client may take: tonic over TCP,
//! and HTTP/2 over dmrpc's shared memory. One suite: unary calls with
//! metadata, errors with details, deadlines and cancellation, large
//! messages checked byte for byte, and every kind of stream.
#![allow(clippy::unwrap_used)]

use dm_grpc::example::imaging::imaging_client::ImagingClient;
use dm_grpc::example::imaging::{Blob, Image, TileRequest};
use dm_grpc::example::{digest, pattern};
use dm_grpc::Channel;
use dm_pool::testing::TempPool;
use dm_pool::PoolConfig;
use dm_rpc::Node;
use std::time::Duration;
use tokio_stream::StreamExt;
use tonic::Code;

/// The paths a channel takes.
#[derive(Debug, Clone, Copy)]
enum Path {
    Tcp,
    H2OverShm,
    Direct,
}

const PATHS: [Path; 3] = [Path::Tcp, Path::H2OverShm, Path::Direct];

fn pool() -> TempPool {
    TempPool::with(PoolConfig {
        size: 256 << 20,
        channels: Some(32),
        ..Default::default()
    })
}

/// What serves the example service for a test.
enum Serving {
    Task(tokio::task::JoinHandle<()>),
    Dmrpc(Box<dm_rpc::Server>),
}

/// Serves the example service over `path` and gives a channel to it.
async fn serve(node: &Node, path: Path, name: &str) -> (Channel, Serving) {
    // The example service with health and reflection beside it.
    let routes = dm_grpc::example::routes().await.unwrap();
    let router = tonic::transport::Server::builder().add_routes(routes.clone());
    match path {
        Path::Tcp => {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(l);
            let task = tokio::spawn(async move {
                router.serve_with_incoming(incoming).await.unwrap();
            });
            // The same dial as shared memory's: the name is not in the
            // pool, so it falls back to TCP.
            let ch = dm_grpc::Dial::new(node, name)
                .or_tcp(&format!("http://{addr}"))
                .connect()
                .await
                .unwrap();
            assert!(!ch.is_direct());
            (ch, Serving::Task(task))
        }
        Path::H2OverShm => {
            // tonic's own server, on dmrpc byte streams.
            let incoming = dm_grpc::h2::listen(node, name).unwrap();
            let task = tokio::spawn(async move {
                router.serve_with_incoming(incoming).await.unwrap();
            });
            let dial = dm_grpc::Dial::new(node, name)
                .http2()
                .or_tcp("http://127.0.0.1:1");
            assert!(dial.in_pool());
            (dial.connect().await.unwrap(), Serving::Task(task))
        }
        Path::Direct => {
            let server = dm_grpc::serve(node, name, routes).unwrap();
            let ch = dm_grpc::Dial::new(node, name).connect().await.unwrap();
            assert!(ch.is_direct());
            (ch, Serving::Dmrpc(Box::new(server)))
        }
    }
}

/// Runs `body` with a client of the example service over every path,
/// then checks that the pool is clean.
fn over_every_path<F, Fut>(test: &str, body: F)
where
    F: Fn(Path, Channel) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for path in PATHS {
        let tp = pool();
        {
            let node = Node::new(tp.attach());
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let name = format!("test/{test}/{}", std::process::id());
                let (ch, serving) = serve(&node, path, &name).await;
                body(path, ch).await;
                match serving {
                    Serving::Task(task) => {
                        task.abort();
                        let _ = task.await;
                    }
                    Serving::Dmrpc(server) => server.shutdown(),
                }
            });
        }
        tp.assert_clean_within(Duration::from_secs(2));
    }
}

/// The example service's client on `ch`.
fn imaging(ch: Channel) -> ImagingClient<Channel> {
    ImagingClient::new(ch).max_decoding_message_size(64 << 20)
}

fn blob(len: usize, seq: u64) -> Blob {
    Blob {
        data: pattern(len, seq as u8).into(),
        seq,
    }
}

#[test]
fn unary_calls_carry_metadata_and_large_messages() {
    over_every_path("grpc-unary", |path, ch| async move {
        let mut c = imaging(ch);
        for len in [0usize, 64, 4 << 10, 64 << 10, 1 << 20, 4 << 20] {
            let mut req = tonic::Request::new(blob(len, 3));
            req.metadata_mut().insert("x-tag", "seven".parse().unwrap());
            let answer = c.echo(req).await.unwrap();
            assert_eq!(answer.metadata().get("x-tag").unwrap(), "seven", "{path:?}");
            let b = answer.into_inner();
            assert_eq!(b.seq, 3);
            assert!(
                b.data.as_ref() == pattern(len, 3).as_slice(),
                "{path:?} {len}"
            );
        }
        // An image, inverted, byte for byte.
        let (w, h) = (640u32, 480u32);
        let pixels = pattern((w * h * 3) as usize, 1);
        let img = Image {
            width: w,
            height: h,
            pixels: pixels.clone().into(),
            digest: 0,
        };
        let out = c.invert(img).await.unwrap().into_inner();
        let want: Vec<u8> = pixels.iter().map(|p| 255 - p).collect();
        assert!(out.pixels.as_ref() == want.as_slice(), "{path:?}");
        assert_eq!(out.digest, digest(&want));
    });
}

#[test]
fn errors_deadlines_and_cancellation_behave_as_grpc_says() {
    over_every_path("grpc-errors", |path, ch| async move {
        let mut c = imaging(ch);
        // An error with details and metadata.
        let mut req = tonic::Request::new(blob(8, 1));
        req.metadata_mut().insert("x-fail", "7".parse().unwrap());
        let e = c.echo(req).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{path:?}");
        assert_eq!(e.message(), "asked to fail");
        assert_eq!(e.details(), b"\x01details");
        assert_eq!(e.metadata().get("x-why").unwrap(), "asked");
        // The server's own check.
        let bad = Image {
            width: 2,
            height: 2,
            pixels: vec![0u8; 5].into(),
            digest: 0,
        };
        let e = c.invert(bad).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{path:?}");
        // A deadline.
        let mut req = tonic::Request::new(blob(8, 1));
        req.metadata_mut()
            .insert("x-sleep-ms", "2000".parse().unwrap());
        req.set_timeout(Duration::from_millis(50));
        let started = std::time::Instant::now();
        let e = c.echo(req).await.unwrap_err();
        // (tonic's own server says Cancelled, "Timeout expired", when its
        // timer fires before the client's.)
        assert!(
            matches!(e.code(), Code::DeadlineExceeded | Code::Cancelled),
            "{path:?}: {e}"
        );
        assert!(started.elapsed() < Duration::from_secs(1), "{path:?}");
        // A dropped call (a timeout around the future): the channel goes on.
        let mut req = tonic::Request::new(blob(8, 1));
        req.metadata_mut()
            .insert("x-sleep-ms", "2000".parse().unwrap());
        let mut c2 = c.clone();
        let dropped = tokio::time::timeout(Duration::from_millis(50), c2.echo(req)).await;
        assert!(dropped.is_err(), "{path:?}");
        let b = c.echo(blob(10, 2)).await.unwrap().into_inner();
        assert_eq!(b.seq, 2);
    });
}

#[test]
fn every_kind_of_stream() {
    over_every_path("grpc-streams", |path, ch| async move {
        let mut c = imaging(ch);
        // The server's stream.
        for (count, size) in [(0u32, 1u32), (10, 100), (100, 64 << 10)] {
            let req = TileRequest {
                count,
                size,
                fail_with: 0,
            };
            let mut s = c.tiles(req).await.unwrap().into_inner();
            let mut k = 0u32;
            while let Some(b) = s.next().await {
                let b = b.unwrap();
                assert_eq!(b.seq, u64::from(k));
                assert!(b.data.as_ref() == pattern(size as usize, k as u8).as_slice());
                k += 1;
            }
            assert_eq!(k, count, "{path:?}");
        }
        // ... ending with an error.
        let req = TileRequest {
            count: 3,
            size: 10,
            fail_with: Code::ResourceExhausted as i32,
        };
        let mut s = c.tiles(req).await.unwrap().into_inner();
        for _ in 0..3 {
            s.next().await.unwrap().unwrap();
        }
        let e = s.next().await.unwrap().unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{path:?}");
        // The caller's stream.
        for (n, len) in [(0u64, 1usize), (5, 10), (40, 256 << 10)] {
            let up = tokio_stream::iter((0..n).map(move |k| blob(len, k)));
            let sum = c.upload(up).await.unwrap().into_inner();
            assert_eq!((sum.blobs, sum.bytes), (n, n * len as u64), "{path:?}");
        }
        // Both ways: every blob back, in order, while more go.
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut back = c
            .chat(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        for k in 0..200u64 {
            let len = if k % 50 == 0 { 300 << 10 } else { 100 };
            tx.send(blob(len, k)).await.unwrap();
            let b = back.next().await.unwrap().unwrap();
            assert_eq!(b.seq, k, "{path:?}");
            assert!(b.data.as_ref() == pattern(len, k as u8).as_slice());
        }
        drop(tx);
        assert!(back.next().await.is_none(), "{path:?}");
    });
}

#[test]
fn health_checking_and_reflection_work_over_every_path() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    over_every_path("grpc-health", |path, ch| async move {
        let mut health = HealthClient::new(ch.clone());
        let req = HealthCheckRequest {
            service: "imaging.Imaging".into(),
        };
        let status = health.check(req).await.unwrap().into_inner().status;
        assert_eq!(status, ServingStatus::Serving as i32, "{path:?}");
        let unknown = HealthCheckRequest {
            service: "nope.Nope".into(),
        };
        let e = health.check(unknown).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{path:?}");
        // Reflection: a bidirectional stream, listing the services.
        let mut refl = ServerReflectionClient::new(ch);
        let ask = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut answers = refl
            .server_reflection_info(tokio_stream::iter([ask]))
            .await
            .unwrap()
            .into_inner();
        let got = answers.next().await.unwrap().unwrap();
        let Some(MessageResponse::ListServicesResponse(list)) = got.message_response else {
            panic!("{path:?}: not a list of services: {got:?}");
        };
        let names: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
        assert!(names.contains(&"imaging.Imaging"), "{path:?}: {names:?}");
        assert!(
            names.contains(&"grpc.health.v1.Health"),
            "{path:?}: {names:?}"
        );
    });
}

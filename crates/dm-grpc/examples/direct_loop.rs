//! Unary calls of the example service the direct way, one at a time,
//! between two processes, for profiling
//! (`perf record -a -- target/release/examples/direct_loop 300000`; env:
//! SIZE: the `bytes` field's length (default 64), SERVE_CPU and
//! CLIENT_CPU: each process on that CPU alone, WAY=h2: HTTP/2 over shared
//! memory instead, WAY=alone: the generated client calling the generated
//! server in this process, no transport).
#![allow(clippy::unwrap_used)]

use dm_grpc::example::imaging::imaging_client::ImagingClient;
use dm_grpc::example::imaging::imaging_server::ImagingServer;
use dm_grpc::example::imaging::Blob;
use dm_rpc::Node;
use std::process::{Command, Stdio};
use std::time::Instant;

fn cpu(var: &str) {
    if let Some(k) = std::env::var(var).ok().and_then(|s| s.parse().ok()) {
        dm_sys::set_affinity(&[k]).unwrap();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    if args.get(1).map(String::as_str) == Some("serve") {
        cpu("SERVE_CPU");
        let pool = dm_pool::Pool::open(args[2].as_ref(), Default::default()).unwrap();
        let node = Node::new(pool);
        let s = dm_grpc::serve(
            &node,
            "profile/grpc",
            ImagingServer::new(dm_grpc::example::Service),
        )
        .unwrap();
        println!("ready");
        let mut l = String::new();
        let _ = std::io::stdin().read_line(&mut l);
        s.shutdown();
        return;
    }
    cpu("CLIENT_CPU");
    let n: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(300_000);
    let size: usize = std::env::var("SIZE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64);
    let way = std::env::var("WAY").unwrap_or_default();
    let blob = Blob {
        data: vec![7u8; size].into(),
        seq: 0,
    };
    if way == "alone" {
        let per = rt.block_on(async {
            let svc = ImagingServer::new(dm_grpc::example::Service);
            let mut c = ImagingClient::new(svc);
            calls(&mut c, &blob, n).await
        });
        println!("{per:.0} ns per call (tonic alone, {size} B)");
        return;
    }
    let path = format!("/dev/shm/dmrpc-direct-loop-{}.pool", std::process::id());
    dm_pool::Pool::create(
        path.as_ref(),
        &dm_pool::PoolConfig {
            size: 256 << 20,
            ..Default::default()
        },
    )
    .unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["serve", &path])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut l = String::new();
    let _ = std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut l,
    );
    let node = Node::new(dm_pool::Pool::open(path.as_ref(), Default::default()).unwrap());
    let per = rt.block_on(async {
        let mut d = dm_grpc::Dial::new(&node, "profile/grpc");
        if way == "h2" {
            d = d.http2();
        }
        let mut c = ImagingClient::new(d.connect().await.unwrap());
        calls(&mut c, &blob, n).await
    });
    println!(
        "{per:.0} ns per call ({} way, {size} B)",
        if way == "h2" { "HTTP/2" } else { "direct" }
    );
    drop(child.stdin.take());
    let _ = child.wait();
    let _ = std::fs::remove_file(&path);
}

/// Nanoseconds per `Echo` of `blob` through `c`, over `n` calls (after a
/// thousand to warm up).
async fn calls<T>(c: &mut ImagingClient<T>, blob: &Blob, n: u64) -> f64
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = bytes::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    for _ in 0..1000 {
        c.echo(blob.clone()).await.unwrap();
    }
    let t = Instant::now();
    for _ in 0..n {
        std::hint::black_box(c.echo(blob.clone()).await.unwrap());
    }
    t.elapsed().as_nanos() as f64 / n as f64
}

//! The example service and its client as two processes: the client is
//! the same code over shared memory and over TCP, only its channel is
//! made differently.
//!
//! ```text
//! imaging serve POOL NAME [TCP_ADDR]     serve on dmrpc NAME in pool file POOL
//!                                        (both ways: direct, and HTTP/2 over
//!                                        shared memory), and on TCP_ADDR too
//!                                        if given, with gRPC health checking
//!                                        and reflection; prints `ready`
//! imaging call POOL NAME [HOW]           unary echo, a 1 MiB image, and a chat
//!                                        of 100 blobs; prints what it measured.
//!                                        HOW: `direct` (the default), `http2`,
//!                                        or a TCP URI (`http://host:port`) for
//!                                        when NAME is not in the pool
//! imaging chat POOL NAME N [HOW]         a chat of N blobs, one line per answer
//! ```

use dm_grpc::example::imaging::imaging_client::ImagingClient;
use dm_grpc::example::imaging::{Blob, Image};
use dm_grpc::example::{digest, pattern};
use std::error::Error;
use std::io::Write;
use std::time::Instant;
use tokio_stream::StreamExt;

type Result<T> = std::result::Result<T, Box<dyn Error>>;

fn node(pool: &str) -> Result<dm_rpc::Node> {
    let pool = dm_pool::Pool::open(std::path::Path::new(pool), Default::default())?;
    Ok(dm_rpc::Node::new(pool))
}

async fn serve(pool: &str, name: &str, tcp: Option<&str>) -> Result<()> {
    let node = node(pool)?;
    // The example service, with gRPC health checking and reflection.
    let routes = dm_grpc::example::routes().await?;
    let _served = dm_grpc::serve(&node, name, routes.clone())?;
    let tcp = match tcp {
        Some(addr) => {
            let l = tokio::net::TcpListener::bind(addr).await?;
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(l);
            Some(
                tonic::transport::Server::builder()
                    .add_routes(routes)
                    .serve_with_incoming(incoming),
            )
        }
        None => None,
    };
    println!("ready");
    std::io::stdout().flush()?;
    match tcp {
        Some(tcp) => tcp.await?,
        None => std::future::pending().await,
    }
    Ok(())
}

/// A client of `name`: `how` is `direct` (the default), `http2`, or a TCP
/// URI for when `name` is not in the pool.
async fn client(
    pool: &str,
    name: &str,
    how: Option<&str>,
) -> Result<ImagingClient<dm_grpc::Channel>> {
    let node = node(pool)?;
    let mut dial = dm_grpc::Dial::new(&node, name);
    match how {
        None | Some("direct") => {}
        Some("http2") => dial = dial.http2(),
        Some(uri) => dial = dial.or_tcp(uri),
    }
    let via = match (dial.in_pool(), dial.way()) {
        (false, _) => "TCP",
        (true, dm_grpc::Way::Direct) => "shared memory, direct",
        (true, dm_grpc::Way::Http2) => "shared memory, HTTP/2",
    };
    eprintln!("imaging: {name} over {via}");
    Ok(ImagingClient::new(dial.connect().await?).max_decoding_message_size(64 << 20))
}

async fn call(pool: &str, name: &str, tcp: Option<&str>) -> Result<()> {
    let mut c = client(pool, name, tcp).await?;
    let t = Instant::now();
    let n = 1000u32;
    for k in 0..n {
        let b = Blob {
            data: vec![k as u8; 64].into(),
            seq: u64::from(k),
        };
        let back = c.echo(b).await?.into_inner();
        if back.seq != u64::from(k) {
            return Err("echo answered another blob".into());
        }
    }
    println!(
        "echo 64 B: {:.1} us a call",
        t.elapsed().as_secs_f64() * 1e6 / f64::from(n)
    );
    let (w, h) = (1024u32, 341u32);
    let pixels = pattern((w * h * 3) as usize, 5);
    let t = Instant::now();
    let img = c
        .invert(Image {
            width: w,
            height: h,
            pixels: pixels.clone().into(),
            digest: 0,
        })
        .await?
        .into_inner();
    let want: Vec<u8> = pixels.iter().map(|p| 255 - p).collect();
    if img.digest != digest(&want) || img.pixels.as_ref() != want.as_slice() {
        return Err("the inverted image is wrong".into());
    }
    println!(
        "invert {} KiB: {:.1} us",
        pixels.len() >> 10,
        t.elapsed().as_secs_f64() * 1e6
    );
    let blobs = tokio_stream::iter((0..100u64).map(|k| Blob {
        data: pattern(1000, k as u8).into(),
        seq: k,
    }));
    let mut back = c.chat(blobs).await?.into_inner();
    let mut got = 0;
    while let Some(b) = back.next().await {
        b?;
        got += 1;
    }
    println!("chat: {got} blobs back");
    Ok(())
}

async fn chat(pool: &str, name: &str, n: u64, how: Option<&str>) -> Result<()> {
    let mut c = client(pool, name, how).await?;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut back = c
        .chat(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    let mut out = std::io::stdout();
    for k in 0..n {
        tx.send(Blob {
            data: pattern(100, k as u8).into(),
            seq: k,
        })
        .await?;
        match back.next().await {
            Some(Ok(b)) => writeln!(out, "blob {}", b.seq)?,
            Some(Err(s)) => {
                writeln!(out, "status {:?}", s.code())?;
                return Ok(());
            }
            None => {
                writeln!(out, "ended")?;
                return Ok(());
            }
        }
        out.flush()?;
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let a = |i: usize| args.get(i).map(String::as_str);
    match (a(0), a(1), a(2)) {
        (Some("serve"), Some(pool), Some(name)) => rt.block_on(serve(pool, name, a(3))),
        (Some("call"), Some(pool), Some(name)) => rt.block_on(call(pool, name, a(3))),
        (Some("chat"), Some(pool), Some(name)) => {
            let n = a(3).and_then(|n| n.parse().ok()).unwrap_or(1000);
            rt.block_on(chat(pool, name, n, a(4)))
        }
        _ => Err("usage: imaging serve|call|chat POOL NAME [...] (see the source)".into()),
    }
}

//! The gRPC peer of the benchmarks: a tonic service over TCP loopback or a
//! Unix socket, and its client. Messages are raw bytes (a codec that
//! copies the payload into and out of gRPC's length-prefixed messages:
//! what a protobuf `bytes` field costs, without the protobuf code
//! generation step). `/dmrpc.bench.Bench/Echo` answers what it got (an
//! empty request is a no-op call); `/dmrpc.bench.Bench/Go` is a tier of
//! `bench chain`: it passes the bytes on to the next tier's `Go` (by
//! value, as gRPC does), or in the last tier answers their 8-byte
//! checksum. Given several next tiers it is `bench lb`'s load balancer:
//! each request goes to the next of them in turn.

use anyhow::{anyhow, Context, Result};
use bytes::Bytes;
use dm_grpc::raw::BytesCodec;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status};

const ECHO: &str = "/dmrpc.bench.Bench/Echo";
const GO: &str = "/dmrpc.bench.Bench/Go";

type Channel = tonic::transport::Channel;

/// The Echo method.
#[derive(Debug, Clone, Copy)]
struct Echo;

impl tonic::server::UnaryService<Bytes> for Echo {
    type Response = Bytes;
    type Future = std::future::Ready<Result<Response<Bytes>, Status>>;
    fn call(&mut self, req: Request<Bytes>) -> Self::Future {
        std::future::ready(Ok(Response::new(req.into_inner())))
    }
}

/// The Go method: a chain tier, or a load balancer.
#[derive(Debug, Clone)]
struct Go {
    next: Option<tonic::client::Grpc<Channel>>,
}

/// Where `Go` passes requests on: none (the last tier), one (a chain
/// tier), or several in turn (a load balancer).
#[derive(Debug, Clone, Default)]
struct Next {
    to: Vec<tonic::client::Grpc<Channel>>,
    turn: Arc<AtomicUsize>,
}

impl Next {
    fn pick(&self) -> Option<tonic::client::Grpc<Channel>> {
        if self.to.is_empty() {
            return None;
        }
        let k = self.turn.fetch_add(1, Ordering::Relaxed) % self.to.len();
        Some(self.to[k].clone())
    }
}

impl tonic::server::UnaryService<Bytes> for Go {
    type Response = Bytes;
    type Future = BoxFuture<Result<Response<Bytes>, Status>>;
    fn call(&mut self, req: Request<Bytes>) -> Self::Future {
        let next = self.next.clone();
        Box::pin(async move {
            let data = req.into_inner();
            match next {
                Some(mut g) => {
                    g.ready()
                        .await
                        .map_err(|e| Status::unavailable(e.to_string()))?;
                    let path = http::uri::PathAndQuery::from_static(GO);
                    let r = g.unary(Request::new(data), path, BytesCodec).await?;
                    Ok(Response::new(r.into_inner()))
                }
                None => {
                    let h = super::peer::sum(&[&data]);
                    Ok(Response::new(Bytes::copy_from_slice(&h.to_le_bytes())))
                }
            }
        })
    }
}

/// The service: routes `Echo` and `Go`, answers UNIMPLEMENTED otherwise.
#[derive(Debug, Clone, Default)]
pub struct BenchService {
    next: Next,
}

impl tonic::server::NamedService for BenchService {
    const NAME: &'static str = "dmrpc.bench.Bench";
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<B> tower_service::Service<http::Request<B>> for BenchService
where
    B: http_body::Body + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut TaskContext<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() == ECHO {
            Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(BytesCodec);
                Ok(grpc.unary(Echo, req).await)
            })
        } else if req.uri().path() == GO {
            let go = Go {
                next: self.next.pick(),
            };
            Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(BytesCodec);
                Ok(grpc.unary(go, req).await)
            })
        } else {
            Box::pin(async move { Ok(Status::unimplemented("no such method").into_http()) })
        }
    }
}

/// Where a peer's server listens.
#[derive(Debug, Clone)]
pub enum Listen {
    Tcp,
    Uds(std::path::PathBuf),
}

/// Starts the service on a runtime of its own (two worker threads, like
/// a default tonic server on this machine) and returns its address
/// (`host:port`, or the socket's path), serving until the process ends.
/// `next`: the address of the next chain tier for `Go` (`host:port`, or
/// a Unix socket's path), or the comma-separated addresses of the workers
/// of a load balancer.
pub fn serve(listen: Listen, next: Option<&str>) -> Result<String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut to = Vec::new();
    for addr in next.into_iter().flat_map(|n| n.split(',')) {
        let _in_rt = rt.enter();
        to.push(tonic::client::Grpc::new(Target::of(addr)?.lazy()));
    }
    let next = Next {
        to,
        turn: Arc::default(),
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("grpc-peer".into())
        .spawn(move || {
            rt.block_on(async move {
                let router = tonic::transport::Server::builder().add_service(BenchService { next });
                let served = match listen {
                    Listen::Tcp => {
                        let l = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
                            Ok(l) => l,
                            Err(e) => return tx.send(Err(e.to_string())).unwrap_or(()),
                        };
                        let addr = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
                        let _ = tx.send(Ok(addr));
                        // Nagle off on every connection, as on the client
                        // (else small answers wait for delayed ACKs).
                        let incoming = tokio_stream::wrappers::TcpListenerStream::new(l).map(|s| {
                            let s = s?;
                            s.set_nodelay(true)?;
                            Ok::<_, std::io::Error>(s)
                        });
                        router.serve_with_incoming(incoming).await
                    }
                    Listen::Uds(path) => {
                        let _ = std::fs::remove_file(&path);
                        let l = match tokio::net::UnixListener::bind(&path) {
                            Ok(l) => l,
                            Err(e) => return tx.send(Err(e.to_string())).unwrap_or(()),
                        };
                        let _ = tx.send(Ok(path.display().to_string()));
                        let incoming = tokio_stream::wrappers::UnixListenerStream::new(l);
                        router.serve_with_incoming(incoming).await
                    }
                };
                if let Err(e) = served {
                    eprintln!("grpc peer: {e}");
                }
            })
        })?;
    rx.recv()
        .context("the gRPC server thread ended")?
        .map_err(|e| anyhow!("gRPC server: {e}"))
}

/// Where a channel goes: a TCP address (`host:port`), or a Unix socket
/// (an absolute path).
enum Target {
    Tcp(tonic::transport::Endpoint),
    Uds(tonic::transport::Endpoint, std::path::PathBuf),
}

impl Target {
    fn of(addr: &str) -> Result<Target> {
        Ok(if addr.starts_with('/') {
            Target::Uds(
                tonic::transport::Endpoint::try_from("http://uds.invalid")?,
                addr.into(),
            )
        } else {
            Target::Tcp(
                tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
                    .tcp_nodelay(true),
            )
        })
    }

    /// Connects to a Unix socket at `path` for every connection the
    /// channel makes.
    fn uds(
        path: std::path::PathBuf,
    ) -> impl tower_service::Service<
        http::Uri,
        Response = hyper_util::rt::TokioIo<tokio::net::UnixStream>,
        Error = std::io::Error,
        Future = impl Send,
    > + Clone
           + Send {
        tower::service_fn(move |_: http::Uri| {
            let path = path.clone();
            async move {
                Ok(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        })
    }

    /// A channel that connects on first use (inside a runtime).
    fn lazy(self) -> Channel {
        match self {
            Target::Tcp(e) => e.connect_lazy(),
            Target::Uds(e, path) => e.connect_with_connector_lazy(Self::uds(path)),
        }
    }

    /// A channel connected now.
    async fn connect(self) -> Result<Channel, tonic::transport::Error> {
        match self {
            Target::Tcp(e) => e.connect().await,
            Target::Uds(e, path) => e.connect_with_connector(Self::uds(path)).await,
        }
    }
}

/// A blocking client of the peer: each call runs on a single-threaded
/// runtime of the client's own.
#[derive(Debug)]
pub struct Client {
    rt: tokio::runtime::Runtime,
    grpc: tonic::client::Grpc<tonic::transport::Channel>,
}

impl Client {
    /// Connects over TCP (`host:port`) or, for a path, a Unix socket.
    pub fn connect(addr: &str) -> Result<Client> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let channel = rt.block_on(Target::of(addr)?.connect())?;
        Ok(Client {
            rt,
            grpc: tonic::client::Grpc::new(channel),
        })
    }

    /// One Echo call.
    pub fn echo(&mut self, data: Bytes) -> Result<Bytes> {
        self.call(ECHO, data)
    }

    /// One Go call (through the chain from this tier).
    pub fn go(&mut self, data: Bytes) -> Result<Bytes> {
        self.call(GO, data)
    }

    fn call(&mut self, method: &'static str, data: Bytes) -> Result<Bytes> {
        let grpc = &mut self.grpc;
        self.rt.block_on(async {
            grpc.ready()
                .await
                .map_err(|e| anyhow!("gRPC not ready: {e}"))?;
            let path = http::uri::PathAndQuery::from_static(method);
            let r = grpc.unary(Request::new(data), path, BytesCodec).await?;
            Ok(r.into_inner())
        })
    }
}

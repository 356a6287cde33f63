//! NotNets' way: tonic's HTTP/2, unchanged, over byte streams that
//! dmrpc's shared-memory rings carry ([`Pipe`]). A server takes them from
//! [`listen`] into tonic's `serve_with_incoming`; a client dials them
//! through tonic's `connect_with_connector` ([`Dial`]).

use crate::pipe::{Pipe, PIPE_METHOD};
use crate::Channel;
use dm_pool::Endpoint;
use dm_rpc::{Node, RpcError};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::{mpsc, oneshot};
use tonic::transport::Endpoint as GrpcEndpoint;

/// How many byte streams wait, accepted and not yet taken by tonic.
const BACKLOG: usize = 64;

/// The byte streams of a dmrpc service, as they are opened: give it to
/// tonic's `Server::serve_with_incoming`. The service stays registered
/// while this lives (tonic drops it when it stops serving).
pub struct Incoming {
    rx: mpsc::Receiver<Pipe>,
    _server: dm_rpc::Server,
}

impl std::fmt::Debug for Incoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Incoming").finish_non_exhaustive()
    }
}

impl tokio_stream::Stream for Incoming {
    type Item = std::io::Result<Pipe>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx).map(|p| p.map(Ok))
    }
}

/// Registers dmrpc service `name` in `node`'s pool and takes the byte
/// streams its clients open, for tonic:
///
/// ```no_run
/// # async fn f(node: dm_rpc::Node, svc: impl tonic::server::NamedService) {}
/// // tonic::transport::Server::builder()
/// //     .add_service(GreeterServer::new(greeter))
/// //     .serve_with_incoming(dm_grpc::h2::listen(&node, "shop/greeter")?)
/// //     .await?;
/// ```
pub fn listen(node: &Node, name: &str) -> Result<Incoming, RpcError> {
    let (tx, rx) = mpsc::channel(BACKLOG);
    let server = node
        .server(name)
        .method_bidi_async(PIPE_METHOD, move |_call, inbox, sink| {
            let tx = tx.clone();
            async move {
                let (end, ended) = oneshot::channel();
                if tx.send(Pipe::server(inbox, sink, end)).await.is_err() {
                    return Err(RpcError::unavailable("the gRPC server stopped serving"));
                }
                // The call lasts as long as its byte stream.
                let _ = ended.await;
                Ok(())
            }
        })
        .spawn()?;
    Ok(Incoming {
        rx,
        _server: server,
    })
}

/// How a client reaches a gRPC service: over shared memory when the
/// service is registered in this node's pool, else over ordinary gRPC
/// (HTTP/2 over TCP) at the address it is given. The generated client is
/// the same either way: only its channel differs.
#[derive(Debug, Clone)]
pub struct Dial {
    node: Node,
    name: String,
    tcp: Option<String>,
}

impl Dial {
    /// Dials dmrpc service `name` of `node`'s pool.
    pub fn new(node: &Node, name: &str) -> Dial {
        Dial {
            node: node.clone(),
            name: name.to_owned(),
            tcp: None,
        }
    }

    /// Where the service is served over TCP (`http://host:port`), for when
    /// it is not in this pool.
    pub fn or_tcp(mut self, uri: &str) -> Dial {
        self.tcp = Some(uri.to_owned());
        self
    }

    /// Whether the service is registered, live, in this node's pool.
    pub fn in_pool(&self) -> bool {
        matches!(
            self.node.pool().lookup(&self.name),
            Ok(Some(s)) if s.endpoint == Endpoint::Shm
        )
    }

    /// A channel to the service, connected now.
    pub async fn connect(self) -> Result<Channel, RpcError> {
        if !self.in_pool() {
            let Some(uri) = self.tcp else {
                return Err(RpcError::new(
                    dm_rpc::Status::NotFound,
                    format!(
                        "no gRPC service {:?} in this pool, and no TCP address to fall back on \
                         (Dial::or_tcp)",
                        self.name
                    ),
                ));
            };
            let e = GrpcEndpoint::from_shared(uri.clone())
                .map_err(|e| RpcError::invalid_argument(format!("bad URI {uri:?}: {e}")))?
                .tcp_nodelay(true);
            return e
                .connect()
                .await
                .map(Channel::new)
                .map_err(|e| RpcError::unavailable(format!("cannot connect to {uri}: {e}")));
        }
        let client = Arc::new(self.node.connect_async(&self.name)?);
        let connector = tower::service_fn(move |_: http::Uri| {
            let client = client.clone();
            async move {
                let call = client
                    .call_bidi(PIPE_METHOD, Vec::new())
                    .await
                    .map_err(std::io::Error::other)?;
                let (items, answer) = call.split();
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(Pipe::client(items, answer)))
            }
        });
        GrpcEndpoint::from_static("http://dmrpc.invalid")
            .connect_with_connector(connector)
            .await
            .map(Channel::new)
            .map_err(|e| RpcError::unavailable(format!("cannot open {:?}: {e}", self.name)))
    }
}

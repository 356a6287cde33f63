//! NotNets' way: tonic's HTTP/2, unchanged, over byte streams that
//! dmrpc's shared-memory rings carry ([`Pipe`]). A server takes them from
//! [`listen`] into tonic's `serve_with_incoming` (or [`crate::serve`]
//! serves them); a client dials them through tonic's
//! `connect_with_connector` ([`Dial::http2`](crate::Dial::http2)).

use crate::pipe::{Pipe, PIPE_METHOD};
use dm_rpc::{Node, RpcError};
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::sync::{mpsc, oneshot};

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
        .protocol(dm_pool::Protocol::Grpc)
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

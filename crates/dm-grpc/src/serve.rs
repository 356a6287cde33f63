//! A tonic service served on a dmrpc name, both ways at once: each call
//! as a dmrpc call (the direct way), and HTTP/2 over dmrpc byte streams
//! (NotNets' way). Clients choose ([`Dial`](crate::Dial)).

use crate::direct::server::serve_call;
use crate::direct::GrpcService;
use crate::pipe::{Pipe, PIPE_METHOD};
use dm_rpc::{Node, RpcError, Server};
use tonic::body::Body;
use tower::ServiceExt;

/// Registers dmrpc service `name` in `node`'s pool and serves `svc` (a
/// generated `FooServer<T>`, or a tonic `Routes`) on it, until the
/// returned server is shut down or dropped. Its calls run on the
/// server's own runtime; a TCP listener for peers outside the pool is
/// the application's (tonic's `Server` as usual).
///
/// ```ignore
/// let server = dm_grpc::serve(&node, "shop/imaging", ImagingServer::new(service))?;
/// ```
pub fn serve<S: GrpcService>(node: &Node, name: &str, svc: S) -> Result<Server, RpcError> {
    let pipes = svc.clone();
    node.server(name)
        .protocol(dm_pool::Protocol::Grpc)
        .method_bidi_async(PIPE_METHOD, move |_call, inbox, sink| {
            let svc = pipes.clone();
            async move {
                let (end, _ended) = tokio::sync::oneshot::channel();
                let io = hyper_util::rt::TokioIo::new(Pipe::server(inbox, sink, end));
                let http =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        svc.clone().oneshot(req.map(Body::new))
                    });
                let conn =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(io, http);
                // (Its streams run as tasks of the server's runtime.)
                match tokio::spawn(conn).await {
                    // A connection that ends, well or not, ends its call.
                    Ok(_) => Ok(()),
                    Err(e) => Err(RpcError::internal(format!(
                        "an HTTP/2 connection failed: {e}"
                    ))),
                }
            }
        })
        .fallback_bidi_async(move |call, inbox, sink| serve_call(svc.clone(), call, inbox, sink))
        .spawn()
}

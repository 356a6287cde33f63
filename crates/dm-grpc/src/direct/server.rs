//! The server's end of the direct way: every call a dmrpc service takes
//! is handed to a tonic service as the gRPC call it maps (see
//! `wire.rs`).

use super::body::{self, Gather};
use super::wire::{headers_into, request_headers, status_trailers, HEADERS, PATH, TRAILERS};
use bytes::Bytes;
use dm_rpc::{AsyncCall, AsyncInbox, AsyncSink, Metadata, Payload, RpcError};
use http_body::Body as _;
use std::pin::Pin;
use std::task::{Context, Poll};
use tonic::body::Body;
use tower::ServiceExt;

/// What a tonic service is, to be served: a generated `FooServer<T>`, a
/// tonic `Routes`, or any service of the same shape.
pub trait GrpcService:
    tower::Service<
        http::Request<Body>,
        Response = http::Response<Body>,
        Error = std::convert::Infallible,
        Future: Send,
    > + Clone
    + Send
    + Sync
    + 'static
{
}

impl<S> GrpcService for S where
    S: tower::Service<
            http::Request<Body>,
            Response = http::Response<Body>,
            Error = std::convert::Infallible,
            Future: Send,
        > + Clone
        + Send
        + Sync
        + 'static
{
}

/// Serves call `call` (with its caller's items `inbox`, answering into
/// `sink`) with `svc`.
pub(crate) async fn serve_call<S: GrpcService>(
    svc: S,
    mut call: AsyncCall,
    inbox: AsyncInbox,
    mut sink: AsyncSink,
) -> Result<(), RpcError> {
    let uri = request_uri(&call.metadata)?;
    let mut headers = request_headers(&call.metadata)?;
    headers.insert("te", http::HeaderValue::from_static("trailers"));
    headers
        .entry(http::header::CONTENT_TYPE)
        .or_insert(http::HeaderValue::from_static("application/grpc"));
    let first = std::mem::take(&mut call.payload).into_bytes()?;
    let mut req = http::Request::new(Body::new(body::Request::new(first, inbox)));
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = uri;
    *req.version_mut() = http::Version::HTTP_2;
    *req.headers_mut() = headers;
    let Ok(resp) = svc.oneshot(req).await;
    let (parts, mut out) = resp.into_parts();
    let mut head = Metadata::new();
    headers_into(&mut head, &parts.headers)?;
    // A body that is whole at once (a unary answer, an error) goes in the
    // answer that ends the call: one frame.
    let (data, end) = ready_body(&mut out);
    if let Some(trailers) = end {
        head.insert(TRAILERS, "")
            .map_err(|e| RpcError::internal(e.to_string()))?;
        headers_into(&mut head, &trailers)?;
        call.set_reply_metadata(head)
            .map_err(|e| RpcError::internal(e.to_string()))?;
        if !data.is_empty() {
            sink.end_with(Payload::from_bytes(data));
        }
        return Ok(());
    }
    // A stream: the headers now (a bidirectional call's client may wait
    // for them before it writes), then the body as it comes.
    head.insert(HEADERS, "")
        .map_err(|e| RpcError::internal(e.to_string()))?;
    sink.send_with_metadata(Payload::from_bytes(data), head)
        .await?;
    let mut trailers = http::HeaderMap::new();
    let mut out = std::pin::pin!(out);
    while let Some(f) = std::future::poll_fn(|cx| out.as_mut().poll_frame(cx)).await {
        match f {
            Ok(f) => match f.into_data() {
                Ok(d) => sink.send(Payload::from_bytes(d)).await?,
                Err(f) => {
                    if let Ok(t) = f.into_trailers() {
                        trailers.extend(t);
                    }
                }
            },
            Err(s) => {
                trailers = status_trailers(&s);
                break;
            }
        }
    }
    let mut tail = Metadata::new();
    tail.insert(TRAILERS, "")
        .map_err(|e| RpcError::internal(e.to_string()))?;
    headers_into(&mut tail, &trailers)?;
    call.set_reply_metadata(tail)
        .map_err(|e| RpcError::internal(e.to_string()))?;
    Ok(())
}

/// The URI of the method a request's metadata names (its path, checked).
pub(crate) fn request_uri(meta: &Metadata) -> Result<http::Uri, RpcError> {
    let path = meta
        .get(PATH)
        .and_then(|p| std::str::from_utf8(p).ok())
        .filter(|p| p.starts_with('/'))
        .ok_or_else(|| RpcError::invalid_argument("a gRPC call without its method's path"))?;
    format!("http://dmrpc{path}")
        .parse()
        .map_err(|_| RpcError::invalid_argument(format!("{path:?} is not a method's path")))
}

/// The data of `b` there now, and its trailers if it ended (empty ones
/// if it ended without any).
fn ready_body(b: &mut Body) -> (Bytes, Option<http::HeaderMap>) {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let mut data = Gather::default();
    let mut trailers = http::HeaderMap::new();
    loop {
        match Pin::new(&mut *b).poll_frame(&mut cx) {
            Poll::Ready(Some(Ok(f))) => match f.into_data() {
                Ok(d) => data.push(d),
                Err(f) => {
                    if let Ok(t) = f.into_trailers() {
                        trailers.extend(t);
                    }
                }
            },
            Poll::Ready(Some(Err(s))) => return (data.bytes(), Some(status_trailers(&s))),
            Poll::Ready(None) => return (data.bytes(), Some(trailers)),
            Poll::Pending => return (data.bytes(), None),
        }
    }
}

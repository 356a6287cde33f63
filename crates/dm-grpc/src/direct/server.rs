//! The server's end of the direct way: every call a dmrpc service takes
//! is handed to a tonic service as the gRPC call it maps (see
//! `wire.rs`).

use super::body;
use super::by_ref::{Outbox, Part, Parts};
use super::wire::{headers_into, request_headers, status_trailers, HEADERS, PATH, TRAILERS};
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
    let first = super::forward::view(std::mem::take(&mut call.payload))?;
    let mut req = http::Request::new(Body::new(body::Request::new(first, inbox)));
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = uri;
    *req.version_mut() = http::Version::HTTP_2;
    *req.headers_mut() = headers;
    let Ok(resp) = svc.oneshot(req).await;
    let (parts, mut out) = resp.into_parts();
    let mut head = Metadata::new();
    headers_into(&mut head, &parts.headers)?;
    // Large messages straight into the pool, unless tonic compresses what
    // the codec encodes.
    let mut outbox = match parts.headers.get("grpc-encoding") {
        Some(e) if e != "identity" => None,
        _ => Outbox::new(&call.node),
    };
    // A body that is whole at once (a unary answer, an error) goes in the
    // answer that ends the call: one frame.
    let (mut now, end) = ready_body(&mut out, &mut outbox);
    if now.len() <= 1 {
        if let Some(trailers) = end {
            head.insert(TRAILERS, "")
                .map_err(|e| RpcError::internal(e.to_string()))?;
            headers_into(&mut head, &trailers)?;
            call.set_reply_metadata(head)
                .map_err(|e| RpcError::internal(e.to_string()))?;
            if let Some(data) = now.take_first() {
                sink.end_with(data.payload());
            }
            return Ok(());
        }
    }
    // (Boxed: what a stream needs is no part of every call's future.)
    Box::pin(stream_answer(call, sink, head, out, outbox, now, end)).await
}

/// Answers call `call` with a stream, into `sink`: headers `head` (the
/// response's), the body parts `now` that were ready and the rest of body
/// `out` as it comes (large messages into `outbox`), then its trailers
/// (`end`, if the body ended already).
async fn stream_answer(
    call: AsyncCall,
    mut sink: AsyncSink,
    mut head: Metadata,
    out: Body,
    mut outbox: Option<Outbox>,
    now: Parts,
    end: Option<http::HeaderMap>,
) -> Result<(), RpcError> {
    // A stream (or messages in the pool, each its own item): the headers
    // now (a bidirectional call's client may wait for them before it
    // writes), then the body as it comes.
    head.insert(HEADERS, "")
        .map_err(|e| RpcError::internal(e.to_string()))?;
    let mut now = now.into_iter();
    sink.send_with_metadata(now.next().map_or_else(Payload::empty, Part::payload), head)
        .await?;
    for part in now {
        sink.send(part.payload()).await?;
    }
    let end_seen = end.is_some();
    let mut trailers = end.unwrap_or_default();
    let mut out = std::pin::pin!(out);
    while let Some(f) = if end_seen {
        None
    } else {
        std::future::poll_fn(|cx| Outbox::lend(&mut outbox, || out.as_mut().poll_frame(cx))).await
    } {
        match f {
            Ok(f) => match f.into_data() {
                Ok(d) => {
                    for part in Outbox::parts(&mut outbox, d) {
                        sink.send(part.payload()).await?;
                    }
                }
                Err(f) => {
                    if let Ok(t) = f.into_trailers() {
                        add_trailers(&mut trailers, t);
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
    let bad = || RpcError::invalid_argument(format!("{path:?} is not a method's path"));
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(http::uri::Scheme::HTTP);
    parts.authority = Some(http::uri::Authority::from_static("dmrpc"));
    parts.path_and_query = Some(path.parse().map_err(|_| bad())?);
    http::Uri::from_parts(parts).map_err(|_| bad())
}

/// Adds trailers `t` to `to`: moved, when they are the first (a unary
/// answer's only ones), with no copy and no allocation.
fn add_trailers(to: &mut http::HeaderMap, t: http::HeaderMap) {
    if to.is_empty() {
        *to = t;
    } else {
        to.extend(t);
    }
}

/// The data of `b` there now, and its trailers if it ended (empty ones
/// if it ended without any).
fn ready_body(b: &mut Body, outbox: &mut Option<Outbox>) -> (Parts, Option<http::HeaderMap>) {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let mut data = Parts::default();
    let mut trailers = http::HeaderMap::new();
    let end = loop {
        match Outbox::lend(outbox, || Pin::new(&mut *b).poll_frame(&mut cx)) {
            Poll::Ready(Some(Ok(f))) => match f.into_data() {
                Ok(d) => data.append(Outbox::parts(outbox, d)),
                Err(f) => {
                    if let Ok(t) = f.into_trailers() {
                        add_trailers(&mut trailers, t);
                    }
                }
            },
            Poll::Ready(Some(Err(s))) => break Some(status_trailers(&s)),
            Poll::Ready(None) => break Some(trailers),
            Poll::Pending => break None,
        }
    };
    (data, end)
}

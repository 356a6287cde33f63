//! The channel a generated client is given ([`Channel`]): one type
//! whichever way it goes, which says `Unavailable` when the transport
//! under a call breaks, as gRPC asks.

use crate::direct::client::Direct;
use bytes::Bytes;
use http_body::Frame;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tonic::body::Body;

/// A channel to a gRPC service, for a generated client
/// (`FooClient::new(channel)`), made by [`Dial`](crate::Dial): each call
/// straight onto a dmrpc call, HTTP/2 over dmrpc's shared memory, or
/// gRPC over TCP. Cheap to clone; clones share the connection.
///
/// A call whose transport breaks under it (its server killed, its
/// connection reset) ends with `Unavailable`, on every path. (tonic
/// alone reports a stream broken mid-way as `Unknown`.)
#[derive(Debug, Clone)]
pub struct Channel {
    via: Via,
}

#[derive(Debug, Clone)]
enum Via {
    /// HTTP/2, over a dmrpc byte stream or TCP.
    Http2(tonic::transport::Channel),
    /// Each call a dmrpc call.
    Direct(Box<Direct>),
}

impl Channel {
    pub(crate) fn http2(inner: tonic::transport::Channel) -> Channel {
        Channel {
            via: Via::Http2(inner),
        }
    }

    pub(crate) fn direct(d: Direct) -> Channel {
        Channel {
            via: Via::Direct(Box::new(d)),
        }
    }

    /// Whether its calls are dmrpc calls (no HTTP/2).
    pub fn is_direct(&self) -> bool {
        matches!(self.via, Via::Direct(_))
    }
}

type Answer = Result<http::Response<Body>, tonic::Status>;

impl tower::Service<http::Request<Body>> for Channel {
    type Response = http::Response<Body>;
    type Error = tonic::Status;
    type Future = Pin<Box<dyn Future<Output = Answer> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        match &mut self.via {
            Via::Http2(c) => c.poll_ready(cx).map_err(unavailable),
            Via::Direct(_) => Poll::Ready(Ok(())),
        }
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        match &mut self.via {
            Via::Http2(c) => {
                let answer = c.call(req);
                Box::pin(async move {
                    let a = answer.await.map_err(unavailable)?;
                    Ok(a.map(|b| {
                        Body::new(Guarded {
                            inner: b,
                            done: false,
                        })
                    }))
                })
            }
            Via::Direct(d) => Box::pin(d.clone().call(req)),
        }
    }
}

/// What a call that failed in its channel ends with: `DeadlineExceeded`
/// if its timeout passed (tonic's client says `Cancelled`), else
/// `Unavailable`, as gRPC says of a transport that fails (a connection
/// that closed, or none that could be made).
fn unavailable(e: tonic::transport::Error) -> tonic::Status {
    let mut x: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(c) = x {
        if c.is::<tonic::TimeoutExpired>() {
            return tonic::Status::deadline_exceeded(format!("the call's timeout passed: {e}"));
        }
        x = c.source();
    }
    tonic::Status::unavailable(format!("the transport failed: {e}"))
}

/// A response body whose transport failure ends it with trailers that
/// say `Unavailable`.
struct Guarded {
    inner: Body,
    done: bool,
}

impl http_body::Body for Guarded {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        if self.done {
            return Poll::Ready(None);
        }
        match ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
            Some(Err(s)) if broken_transport(&s) => {
                self.done = true;
                let mut t = http::HeaderMap::new();
                let msg = format!("the transport broke: {s}");
                let u = tonic::Status::unavailable(msg);
                if u.add_header(&mut t).is_err() {
                    return Poll::Ready(Some(Err(tonic::Status::unavailable(s.to_string()))));
                }
                Poll::Ready(Some(Ok(Frame::trailers(t))))
            }
            other => Poll::Ready(other),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Whether a body's error is its transport's failure (an I/O error
/// under it, its connection closed), not a status its server sent.
fn broken_transport(s: &tonic::Status) -> bool {
    let mut e: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(s);
    while let Some(x) = e {
        if x.is::<std::io::Error>()
            || x.downcast_ref::<h2::Error>().is_some_and(h2::Error::is_io)
            || x.downcast_ref::<hyper::Error>()
                .is_some_and(|h| h.is_canceled() || h.is_closed() || h.is_incomplete_message())
        {
            return true;
        }
        e = x.source();
    }
    false
}

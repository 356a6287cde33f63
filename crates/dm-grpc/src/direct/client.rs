//! The client's end of the direct way: a gRPC call as a dmrpc call
//! (see `wire.rs` for the mapping).

use super::body;
use super::by_ref::{Outbox, Part, Parts};
use super::wire::{answer_headers, grpc_timeout, headers_into, status_of, HEADERS, PATH};
use bytes::Bytes;
use dm_rpc::{AsyncClient, AsyncStreaming, CallOptions, Metadata, Node, Payload};
use http_body::Body as _;
use std::pin::Pin;
use std::task::{Context, Poll};
use tonic::body::Body;

/// A client of a gRPC service served the direct way.
#[derive(Debug, Clone)]
pub(crate) struct Direct {
    client: AsyncClient,
    /// Where large messages are encoded (its pool).
    node: Node,
}

impl Direct {
    pub(crate) fn new(node: &Node, client: AsyncClient) -> Direct {
        Direct {
            client,
            node: node.clone(),
        }
    }

    /// Makes gRPC call `req`, and gives its response.
    pub(crate) async fn call(
        self,
        req: http::Request<Body>,
    ) -> Result<http::Response<Body>, tonic::Status> {
        let (parts, mut req_body) = req.into_parts();
        let path = parts.uri.path();
        let mut meta = Metadata::new();
        meta.insert(PATH, path.as_bytes())
            .map_err(|e| tonic::Status::internal(e.to_string()))?;
        headers_into(&mut meta, &parts.headers).map_err(status_of)?;
        let opts = CallOptions {
            deadline: grpc_timeout(&parts.headers),
            ..CallOptions::default()
        };
        // Large messages straight into the pool, unless tonic compresses
        // what the codec encodes.
        let mut outbox = match parts.headers.get("grpc-encoding") {
            Some(e) if e != "identity" => None,
            _ => Outbox::new(&self.node),
        };
        // The body the client wrote already goes with the request: all
        // of a unary or server-streaming call's (messages in the pool go
        // one per payload).
        let (mut now, ended) = ready_data(&mut req_body, &mut outbox)?;
        let st = if ended && now.len() <= 1 {
            let first = now.take_first().map_or_else(Payload::empty, Part::payload);
            self.client
                .call_stream_with(path, first, opts, meta)
                .await
                .map_err(status_of)?
        } else {
            // (Boxed: what a call whose client writes as it goes needs is
            // no part of every call's future.)
            Box::pin(self.open_bidi(path, now, ended, (opts, meta), req_body, outbox)).await?
        };
        answer(st).await
    }

    /// Opens the call of `path` as one whose client writes as it goes:
    /// the parts `now` ready first, then the rest of `body` (which
    /// `ended` already, or not) as it comes, large messages into `outbox`.
    async fn open_bidi(
        &self,
        path: &str,
        now: Parts,
        ended: bool,
        (opts, meta): (CallOptions, Metadata),
        req_body: Body,
        mut outbox: Option<Outbox>,
    ) -> Result<AsyncStreaming, tonic::Status> {
        let mut now = now.into_iter();
        let first = now.next().map_or_else(Payload::empty, Part::payload);
        let call = self
            .client
            .call_bidi_with(path, first, opts, meta)
            .await
            .map_err(status_of)?;
        let (mut items, st) = call.split();
        // The rest, as the client writes it.
        tokio::spawn(async move {
            for part in now {
                if items.send(part.payload()).await.is_err() {
                    return;
                }
            }
            let mut b = std::pin::pin!(req_body);
            while let Some(f) = if ended {
                None
            } else {
                std::future::poll_fn(|cx| Outbox::lend(&mut outbox, || b.as_mut().poll_frame(cx)))
                    .await
            } {
                let Ok(f) = f else {
                    items.abort();
                    return;
                };
                if let Ok(d) = f.into_data() {
                    for part in Outbox::parts(&mut outbox, d) {
                        if items.send(part.payload()).await.is_err() {
                            return;
                        }
                    }
                }
            }
            let _ = items.finish().await;
        });
        Ok(st)
    }
}

/// The data of `b` that is there now, and whether `b` ended.
fn ready_data(b: &mut Body, outbox: &mut Option<Outbox>) -> Result<(Parts, bool), tonic::Status> {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let mut got = Parts::default();
    let ended = loop {
        match Outbox::lend(outbox, || Pin::new(&mut *b).poll_frame(&mut cx)) {
            Poll::Ready(Some(Ok(f))) => {
                if let Ok(d) = f.into_data() {
                    got.append(Outbox::parts(outbox, d));
                }
            }
            Poll::Ready(Some(Err(s))) => return Err(s),
            Poll::Ready(None) => break true,
            Poll::Pending => break false,
        }
    };
    Ok((got, ended))
}

/// The response of a call whose answer comes through `st`.
async fn answer(mut st: AsyncStreaming) -> Result<http::Response<Body>, tonic::Status> {
    let first = st.next_with_metadata().await;
    let (head, body) = match first {
        Some(Err(e)) => return Err(status_of(e)),
        // A stream: the headers came first, the rest follows.
        Some(Ok((p, m))) if m.get(HEADERS).is_some() => {
            let (head, _) = answer_headers(&m).map_err(status_of)?;
            let data = super::forward::view(p).map_err(status_of)?;
            (head, Body::new(body::Answer::new(st, data)))
        }
        // The whole answer at once: its payload (if any), then the
        // headers and trailers its metadata holds.
        got => {
            let data = match got {
                Some(Ok((p, _))) => {
                    if st.next().await.is_some() {
                        return Err(tonic::Status::internal(
                            "the server sent items after an answer without headers",
                        ));
                    }
                    super::forward::view(p).map_err(status_of)?
                }
                _ => Bytes::new(),
            };
            let (head, tail) = answer_headers(st.metadata()).map_err(status_of)?;
            (head, Body::new(body::Ready::new(data, tail)))
        }
    };
    let mut r = http::Response::new(body);
    *r.headers_mut() = head;
    Ok(r)
}

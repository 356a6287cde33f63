//! The HTTP bodies the direct way hands tonic: a request body read from a
//! call's payload and its caller's items (server side), and response
//! bodies read from a call's answer (client side).

use super::wire::{answer_headers, status_of, status_trailers};
use crate::reader::Reader;
use bytes::Bytes;
use dm_rpc::{AsyncInbox, AsyncStreaming, Payload};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use std::pin::Pin;
use std::task::{Context, Poll};

type Polled = Poll<Option<Result<Frame<Bytes>, tonic::Status>>>;

/// Chunks of body data joined: one chunk as it is (no copy), more
/// copied into one.
#[derive(Default)]
pub(crate) struct Gather {
    first: Option<Bytes>,
    more: bytes::BytesMut,
}

impl Gather {
    pub(crate) fn push(&mut self, d: Bytes) {
        match &self.first {
            None => self.first = Some(d),
            Some(f) => {
                if self.more.is_empty() {
                    self.more.extend_from_slice(f);
                }
                self.more.extend_from_slice(&d);
            }
        }
    }

    pub(crate) fn bytes(self) -> Bytes {
        if self.more.is_empty() {
            self.first.unwrap_or_default()
        } else {
            self.more.freeze()
        }
    }
}

/// A body that is whole already: data, then trailers.
pub(crate) struct Ready {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl Ready {
    pub(crate) fn new(data: Bytes, trailers: HeaderMap) -> Ready {
        Ready {
            data: (!data.is_empty()).then_some(data),
            trailers: (!trailers.is_empty()).then_some(trailers),
        }
    }
}

impl Body for Ready {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Polled {
        if let Some(d) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.data.as_ref().map_or(0, |d| d.len() as u64))
    }
}

/// What an item is as body data: its bytes (by Ref, a view of the
/// pool's pages that owns them).
fn data(p: Payload) -> Result<Bytes, tonic::Status> {
    p.into_bytes().map_err(status_of)
}

/// The response body of a call whose answer is a stream: its items as
/// data, then the trailers the ending answer carries (or those of the
/// status it failed with).
pub(crate) struct Answer {
    items: Reader<AsyncStreaming>,
    /// Data that came with the headers.
    first: Option<Bytes>,
    done: bool,
}

impl Answer {
    pub(crate) fn new(st: AsyncStreaming, first: Bytes) -> Answer {
        Answer {
            items: Reader::new(st),
            first: (!first.is_empty()).then_some(first),
            done: false,
        }
    }
}

impl Body for Answer {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled {
        if let Some(d) = self.first.take() {
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        if self.done {
            return Poll::Ready(None);
        }
        let got = std::task::ready!(self.items.poll_next(cx));
        let trailers = match got {
            Some(Ok(p)) => return Poll::Ready(Some(data(p).map(Frame::data))),
            // The end: the trailers its answer carries.
            None => match self.items.source().map(|st| answer_headers(st.metadata())) {
                Some(Ok((_, t))) => t,
                Some(Err(e)) => status_trailers(&status_of(e)),
                None => status_trailers(&tonic::Status::internal("an answer lost its end")),
            },
            // The call failed under it: a status of its own.
            Some(Err(e)) => status_trailers(&status_of(e)),
        };
        self.done = true;
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.first.is_none()
    }
}

/// The request body a served call hands its service: the payload the
/// request carried, then its caller's items.
pub(crate) struct Request {
    first: Option<Bytes>,
    items: Reader<AsyncInbox>,
    done: bool,
}

impl Request {
    pub(crate) fn new(first: Bytes, inbox: AsyncInbox) -> Request {
        Request {
            first: (!first.is_empty()).then_some(first),
            items: Reader::new(inbox),
            done: false,
        }
    }
}

impl Body for Request {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled {
        if let Some(d) = self.first.take() {
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        if self.done {
            return Poll::Ready(None);
        }
        Poll::Ready(match std::task::ready!(self.items.poll_next(cx)) {
            Some(Ok(p)) => Some(data(p).map(Frame::data)),
            None => {
                self.done = true;
                None
            }
            Some(Err(e)) => {
                self.done = true;
                Some(Err(status_of(e)))
            }
        })
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.first.is_none()
    }
}

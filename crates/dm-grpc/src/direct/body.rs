//! The HTTP bodies the direct way hands tonic: a request body read from a
//! call's payload and its caller's items (server side), and response
//! bodies read from a call's answer (client side).

use super::by_ref::{views_wanted, Inbox, Part};
use super::wire::{answer_headers, status_of, status_trailers};
use crate::reader::Reader;
use bytes::Bytes;
use dm_rpc::{AsyncInbox, AsyncStreaming, Payload};
use http::HeaderMap;
use http_body::{Body, Frame};
use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

type Polled = Poll<Option<Result<Frame<Bytes>, tonic::Status>>>;

impl Part {
    /// The payload that sends this part.
    pub(crate) fn payload(self) -> Payload {
        match self {
            Part::Bytes(b) => Payload::from_bytes(b),
            Part::Pool(b) => Payload::from_buffer(b),
        }
    }
}

/// What a body hands tonic next: the parts of the chunks it has read, cut
/// as the decoder reading it wants them ([`Inbox`]).
#[derive(Default)]
struct Out {
    inbox: Inbox,
    queue: VecDeque<Bytes>,
}

impl Out {
    /// The next part, of what is queued or else of `more` (if it has any).
    fn next(&mut self, wanted: bool, more: Option<Bytes>) -> Option<Bytes> {
        if let Some(d) = more.filter(|d| !d.is_empty()) {
            if self.queue.is_empty() && !self.inbox.may_take(&d, wanted) {
                self.inbox.pass(&d);
                return Some(d);
            }
            self.queue.extend(self.inbox.parts(d, wanted));
        }
        self.queue.pop_front()
    }

    fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

/// A body that is whole already: data, then trailers.
pub(crate) struct Ready {
    data: Option<Bytes>,
    out: Out,
    trailers: Option<HeaderMap>,
}

impl Ready {
    pub(crate) fn new(data: Bytes, trailers: HeaderMap) -> Ready {
        Ready {
            data: (!data.is_empty()).then_some(data),
            out: Out::default(),
            trailers: (!trailers.is_empty()).then_some(trailers),
        }
    }
}

impl Body for Ready {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Polled {
        let wanted = views_wanted();
        let this = &mut *self;
        if let Some(d) = this.out.next(wanted, this.data.take()) {
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.out.is_empty() && self.trailers.is_none()
    }
}

/// What an item is as body data: its bytes (by Ref, a view of the
/// pool's pages that owns them: [`super::by_ref::view`]).
fn data(p: Payload) -> Result<Bytes, tonic::Status> {
    super::forward::view(p).map_err(status_of)
}

/// The response body of a call whose answer is a stream: its items as
/// data, then the trailers the ending answer carries (or those of the
/// status it failed with).
pub(crate) struct Answer {
    items: Reader<AsyncStreaming>,
    /// Data that came with the headers.
    first: Option<Bytes>,
    out: Out,
    done: bool,
}

impl Answer {
    pub(crate) fn new(st: AsyncStreaming, first: Bytes) -> Answer {
        Answer {
            items: Reader::new(st),
            first: (!first.is_empty()).then_some(first),
            out: Out::default(),
            done: false,
        }
    }
}

impl Body for Answer {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled {
        let wanted = views_wanted();
        let this = &mut *self;
        if let Some(d) = this.out.next(wanted, this.first.take()) {
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        if this.done {
            return Poll::Ready(None);
        }
        let got = std::task::ready!(this.items.poll_next(cx));
        let trailers = match got {
            Some(Ok(p)) => {
                return Poll::Ready(Some(data(p).map(|d| {
                    // (An item is never empty: the reader skips those.)
                    Frame::data(this.out.next(wanted, Some(d)).unwrap_or_default())
                })));
            }
            // The end: the trailers its answer carries.
            None => match this.items.source().map(|st| answer_headers(st.metadata())) {
                Some(Ok((_, t))) => t,
                Some(Err(e)) => status_trailers(&status_of(e)),
                None => status_trailers(&tonic::Status::internal("an answer lost its end")),
            },
            // The call failed under it: a status of its own.
            Some(Err(e)) => status_trailers(&status_of(e)),
        };
        this.done = true;
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.first.is_none() && self.out.is_empty()
    }
}

/// The request body a served call hands its service: the payload the
/// request carried, then its caller's items.
pub(crate) struct Request {
    first: Option<Bytes>,
    /// The caller's items (none for a call made without them).
    items: Option<Reader<AsyncInbox>>,
    out: Out,
    done: bool,
}

impl Request {
    pub(crate) fn new(first: Bytes, inbox: AsyncInbox) -> Request {
        let done = inbox.is_done();
        Request {
            first: (!first.is_empty()).then_some(first),
            items: (!done).then(|| Reader::new(inbox)),
            out: Out::default(),
            done,
        }
    }
}

impl Body for Request {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled {
        let wanted = views_wanted();
        let this = &mut *self;
        if let Some(d) = this.out.next(wanted, this.first.take()) {
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        let Some(items) = this.items.as_mut().filter(|_| !this.done) else {
            return Poll::Ready(None);
        };
        Poll::Ready(match std::task::ready!(items.poll_next(cx)) {
            Some(Ok(p)) => Some(data(p).map(|d| {
                // (An item is never empty: the reader skips those.)
                Frame::data(this.out.next(wanted, Some(d)).unwrap_or_default())
            })),
            None => {
                this.done = true;
                None
            }
            Some(Err(e)) => {
                this.done = true;
                Some(Err(status_of(e)))
            }
        })
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.first.is_none() && self.out.is_empty()
    }
}

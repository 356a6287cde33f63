//! A byte stream over one dmrpc call: what HTTP/2 runs over between two
//! processes of one pool (NotNets' way). The client's end is a call whose
//! caller's items carry what it writes and whose answer's items carry
//! what it reads. The server's end is that call's handler. Each write is
//! one item (inline in the ring, or by Ref when large), so the rings'
//! flow control by items is the stream's.

use crate::reader::Reader;
use bytes::Bytes;
use dm_rpc::{AsyncInbox, AsyncItems, AsyncSink, AsyncStreaming, Payload, RpcError};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The method a pipe's call is made to.
pub(crate) const PIPE_METHOD: &str = "dmrpc.grpc/h2";

/// The most bytes one write sends as one item.
const MAX_WRITE: usize = 1 << 20;

type Boxed<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Where a pipe's bytes come from.
enum Source {
    /// The answer's items (the client's end).
    Answer(AsyncStreaming),
    /// The caller's items (the server's end).
    Inbox(AsyncInbox),
}

impl crate::reader::Source for Source {
    async fn next(&mut self) -> Option<Result<Payload, RpcError>> {
        match self {
            Source::Answer(s) => s.next().await,
            Source::Inbox(i) => i.next().await,
        }
    }
}

/// Where a pipe's bytes go.
enum Drain {
    /// The caller's items (the client's end).
    Items(AsyncItems),
    /// The answer's items (the server's end).
    Sink(AsyncSink),
}

impl Drain {
    async fn send(mut self, b: Bytes) -> (Drain, Result<(), RpcError>) {
        let r = match &mut self {
            Drain::Items(i) => i.send(Payload::from_bytes(b)).await,
            Drain::Sink(s) => s.send(Payload::from_bytes(b)).await,
        };
        (self, r)
    }

    async fn finish(mut self) -> (Drain, Result<(), RpcError>) {
        let r = match &mut self {
            Drain::Items(i) => i.finish().await,
            // The server's end finishes when its handler returns.
            Drain::Sink(_) => Ok(()),
        };
        (self, r)
    }
}

// One per byte stream, moved between its states by value on every write:
// boxing the idle half would allocate per write instead.
#[allow(clippy::large_enum_variant)]
enum Writing {
    Idle(Drain),
    Busy(Boxed<(Drain, Result<(), RpcError>)>),
    Closed,
}

/// One end of a byte stream carried by a dmrpc call: `AsyncRead` and
/// `AsyncWrite` for HTTP/2 (tonic's `serve_with_incoming` and
/// `connect_with_connector`).
pub struct Pipe {
    reading: Reader<Source>,
    /// The other end finished writing (or failed).
    read_all: bool,
    /// What is left of the item being read, and where.
    current: Option<(Payload, u64)>,
    writing: Writing,
    /// Dropped with the pipe: the server's handler ends then.
    _end: Option<tokio::sync::oneshot::Sender<()>>,
}

impl std::fmt::Debug for Pipe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipe").finish_non_exhaustive()
    }
}

fn io_error(e: RpcError) -> io::Error {
    let kind = match e.status {
        dm_rpc::Status::Unavailable | dm_rpc::Status::Cancelled => io::ErrorKind::BrokenPipe,
        dm_rpc::Status::DeadlineExceeded => io::ErrorKind::TimedOut,
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, e)
}

impl Pipe {
    /// The client's end: the caller's items and the answer's.
    pub(crate) fn client(items: AsyncItems, answer: AsyncStreaming) -> Pipe {
        Pipe {
            reading: Reader::new(Source::Answer(answer)),
            read_all: false,
            current: None,
            writing: Writing::Idle(Drain::Items(items)),
            _end: None,
        }
    }

    /// The server's end, in its call's handler: `end` fires when the pipe
    /// is dropped (the handler then returns, which ends the call).
    pub(crate) fn server(
        inbox: AsyncInbox,
        sink: AsyncSink,
        end: tokio::sync::oneshot::Sender<()>,
    ) -> Pipe {
        Pipe {
            reading: Reader::new(Source::Inbox(inbox)),
            read_all: false,
            current: None,
            writing: Writing::Idle(Drain::Sink(sink)),
            _end: Some(end),
        }
    }

    /// Waits for the write in flight, if any: its error, if it failed.
    fn poll_written(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Writing::Busy(f) = &mut self.writing {
            let (drain, r) = ready!(f.as_mut().poll(cx));
            self.writing = Writing::Idle(drain);
            r.map_err(io_error)?;
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for Pipe {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if let Some((p, at)) = &mut this.current {
                let left = p.len() - *at;
                let n = (left as usize).min(buf.remaining());
                p.read(*at, buf.initialize_unfilled_to(n))
                    .map_err(io_error)?;
                buf.advance(n);
                *at += n as u64;
                if *at == p.len() {
                    this.current = None;
                }
                return Poll::Ready(Ok(()));
            }
            if this.read_all {
                return Poll::Ready(Ok(()));
            }
            match ready!(this.reading.poll_next(cx)) {
                Some(Ok(p)) => this.current = Some((p, 0)),
                // The other end finished: end of stream.
                None => {
                    this.read_all = true;
                    return Poll::Ready(Ok(()));
                }
                Some(Err(e)) => {
                    this.read_all = true;
                    return Poll::Ready(Err(io_error(e)));
                }
            }
        }
    }
}

impl AsyncWrite for Pipe {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        ready!(this.poll_written(cx))?;
        let drain = match std::mem::replace(&mut this.writing, Writing::Closed) {
            Writing::Idle(d) => d,
            _ => return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
        };
        let n = buf.len().min(MAX_WRITE);
        let b = Bytes::copy_from_slice(&buf[..n]);
        // Sent behind the caller's back: the next write, a flush or the
        // shutdown waits for it.
        this.writing = Writing::Busy(Box::pin(drain.send(b)));
        if let Writing::Busy(f) = &mut this.writing {
            if let Poll::Ready((drain, r)) = f.as_mut().poll(cx) {
                this.writing = Writing::Idle(drain);
                r.map_err(io_error)?;
            }
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_written(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        ready!(this.poll_written(cx))?;
        match std::mem::replace(&mut this.writing, Writing::Closed) {
            Writing::Idle(d) => {
                this.writing = Writing::Busy(Box::pin(d.finish()));
                let r = this.poll_written(cx);
                if let Poll::Ready(Ok(())) = r {
                    this.writing = Writing::Closed;
                }
                r
            }
            Writing::Closed => Poll::Ready(Ok(())),
            Writing::Busy(_) => Poll::Pending,
        }
    }
}

impl tonic::transport::server::Connected for Pipe {
    type ConnectInfo = ();

    fn connect_info(&self) -> Self::ConnectInfo {}
}

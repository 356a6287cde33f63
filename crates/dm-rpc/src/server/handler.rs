//! What a handler is and what it sees ([`Call`], [`AsyncCall`],
//! [`Incoming`]), and how the dispatcher runs one: in its call's scope
//! (the deadline and the metadata the calls it makes inherit), with a
//! panic caught and turned into `Internal` for that call alone.

use crate::error::RpcError;
use crate::frame::{Body, Frame};
use crate::metadata::{Metadata, MetadataError};
use crate::node::Node;
use crate::payload::Payload;
use crate::stream::{AsyncInbox, AsyncSink, Inbox, Sink};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// A method's handler.
pub type Handler = Arc<dyn Fn(&mut Call<'_>) -> Result<Payload, RpcError> + Send + Sync>;

/// A streaming method's handler: it sends the items of its answer into
/// the [`Sink`], and returns how the stream ends ([`ServerBuilder::method_stream`](crate::ServerBuilder::method_stream)).
pub type StreamHandler =
    Arc<dyn Fn(&mut Call<'_>, &mut Sink<'_>) -> Result<(), RpcError> + Send + Sync>;

/// A blocking handler of a method whose caller sends items too
/// ([`ServerBuilder::method_bidi`](crate::ServerBuilder::method_bidi)): it reads them from the [`Inbox`] and
/// answers with items into the [`Sink`].
pub type BidiHandler =
    Arc<dyn Fn(&mut Call<'_>, &mut Inbox<'_>, &mut Sink<'_>) -> Result<(), RpcError> + Send + Sync>;

/// The future an async handler returns.
pub type HandlerFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Payload, RpcError>> + Send>>;

/// An async method's handler.
pub type AsyncHandler = Arc<dyn Fn(AsyncCall) -> HandlerFuture + Send + Sync>;

/// The future an async streaming handler returns: how its stream ends.
pub type StreamFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), RpcError>> + Send>>;

/// An async streaming method's handler
/// ([`ServerBuilder::method_stream_async`](crate::ServerBuilder::method_stream_async)).
pub type AsyncStreamHandler = Arc<dyn Fn(AsyncCall, AsyncSink) -> StreamFuture + Send + Sync>;

/// An async handler of a method whose caller sends items too
/// ([`ServerBuilder::method_bidi_async`](crate::ServerBuilder::method_bidi_async)): it reads them from the
/// [`AsyncInbox`] and answers with items into the [`AsyncSink`].
pub type AsyncBidiHandler =
    Arc<dyn Fn(AsyncCall, AsyncInbox, AsyncSink) -> StreamFuture + Send + Sync>;

/// A check every request passes before its handler runs
/// ([`ServerBuilder::intercept`](crate::ServerBuilder::intercept)).
pub type Interceptor = Arc<dyn Fn(&Incoming<'_>) -> Result<(), RpcError> + Send + Sync>;

/// The client connection a call came on. Calls with equal `Peer`s came
/// on one connection of one server, and no later connection of this
/// process's servers gets that `Peer` again. The server says when one
/// closes ([`ServerBuilder::on_disconnect`](crate::ServerBuilder::on_disconnect)):
/// what a service keeps per connection (a heap, a session) lives as
/// long as it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Peer {
    server: u64,
    conn: u64,
}

impl Peer {
    pub(super) fn new(server: u64, conn: crate::transport::ConnId) -> Peer {
        Peer { server, conn }
    }
}

/// A hook a server runs when a connection that made calls closes.
pub type DisconnectHook = Arc<dyn Fn(Peer) + Send + Sync>;

/// A request as an interceptor sees it, before its handler runs: its
/// method, metadata, deadline and size (not its payload's bytes).
#[derive(Debug)]
pub struct Incoming<'a> {
    pub(super) peer: Peer,
    pub(super) method: &'a str,
    pub(super) metadata: &'a Metadata,
    pub(super) deadline: Option<Instant>,
    pub(super) len: u64,
}

impl Incoming<'_> {
    /// The connection it came on.
    pub fn peer(&self) -> Peer {
        self.peer
    }

    /// The method's name.
    pub fn method(&self) -> &str {
        self.method
    }

    /// The request's metadata.
    pub fn metadata(&self) -> &Metadata {
        self.metadata
    }

    /// When the caller stops waiting, if it set a deadline.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Bytes of the payload (inline or by Ref).
    pub fn payload_len(&self) -> u64 {
        self.len
    }
}

/// Methods by id. The ids are FNV-1a hashes of the names already
/// ([`method_id`]), so the map uses them as they are instead of hashing
/// them again on every request.
pub(super) type Methods = HashMap<u32, (Arc<str>, Method), std::hash::BuildHasherDefault<IdHasher>>;

/// A hasher for keys that are hashes: the `u32` itself.
#[derive(Default)]
pub(super) struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | b as u64;
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = n as u64;
    }
}

/// A registered method.
#[derive(Clone)]
pub(super) enum Method {
    /// Runs on the dispatcher thread, one call at a time.
    Blocking(Handler),
    /// Runs as a task on the server's runtime; many at once.
    Async(AsyncHandler),
    /// Runs on the dispatcher thread, one call at a time, answering with
    /// a stream of items ([`crate::stream`]).
    Stream(StreamHandler),
    /// Answers with a stream of items, its calls polled by the dispatcher
    /// as async handlers' are: many at once, beside the server's other
    /// calls.
    AsyncStream(AsyncStreamHandler),
    /// Reads a stream of its caller's items and answers with a stream of
    /// its own, on the dispatcher thread, as a blocking stream's handler.
    Bidi(BidiHandler),
    /// Reads a stream of its caller's items and answers with a stream of
    /// its own, polled as an async stream's handler is.
    AsyncBidi(AsyncBidiHandler),
}

/// One call, as an async handler sees it (owned, so it can be held across
/// awaits).
#[derive(Debug)]
pub struct AsyncCall {
    /// The request's payload.
    pub payload: Payload,
    /// When the caller stops waiting, if it set a deadline. Calls the
    /// handler's future makes while it is polled inherit it
    /// ([`crate::deadline`]).
    pub deadline: Option<Instant>,
    /// The method's name (shared with the server's table of methods).
    pub method: Arc<str>,
    /// This process's node, for nested calls.
    pub node: Node,
    /// The request's metadata ([`crate::metadata`]).
    pub metadata: Metadata,
    /// The connection it came on.
    pub peer: Peer,
}

impl AsyncCall {
    /// Sets the metadata of this call's answer, replacing what was set
    /// before: from the handler's future itself, not from a task it
    /// spawned ([`crate::metadata::set_reply`]).
    pub fn set_reply_metadata(&self, meta: Metadata) -> Result<(), MetadataError> {
        crate::metadata::set_reply(meta)
    }
}

/// One call, as a handler sees it.
#[derive(Debug)]
pub struct Call<'a> {
    pub(super) payload: Payload,
    pub(super) deadline: Option<Instant>,
    pub(super) method: &'a str,
    pub(super) node: &'a Node,
    pub(super) metadata: Metadata,
    pub(super) peer: Peer,
}

impl<'a> Call<'a> {
    /// The call of method `name` with a request's payload and metadata,
    /// as a blocking handler sees it in `scope`.
    #[inline]
    fn of(
        name: &'a str,
        node: &'a Node,
        (body, metadata): (Body, Metadata),
        scope: &Scope,
    ) -> Result<Self, RpcError> {
        crate::stats::count(&body, false);
        Ok(Call {
            payload: Payload::from_request_body(body, node)?,
            deadline: scope.deadline,
            method: name,
            node,
            metadata,
            peer: scope.peer,
        })
    }

    /// The request's payload.
    pub fn payload(&self) -> &Payload {
        &self.payload
    }

    /// Takes the payload (to keep it, or to move it into another call).
    pub fn take_payload(&mut self) -> Payload {
        std::mem::take(&mut self.payload)
    }

    /// When the caller stops waiting, if it set a deadline. Nested calls
    /// made while the handler runs inherit it ([`crate::deadline`]).
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Whether the caller gave up on this call: its deadline passed, or it
    /// cancelled it ([`crate::deadline::cancelled`]). A handler with long
    /// work may look now and then and stop early: what it answers then is
    /// dropped.
    pub fn cancelled(&self) -> bool {
        crate::deadline::cancelled()
    }

    /// The method's name.
    pub fn method(&self) -> &str {
        self.method
    }

    /// The request's metadata (empty if the caller sent none).
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Sets the metadata of this call's answer, replacing what was set
    /// before: from the handler's thread ([`crate::metadata::set_reply`]).
    pub fn set_reply_metadata(&mut self, meta: Metadata) -> Result<(), MetadataError> {
        crate::metadata::set_reply(meta)
    }

    /// This process's node, for nested calls.
    pub fn node(&self) -> &Node {
        self.node
    }

    /// The connection it came on.
    pub fn peer(&self) -> Peer {
        self.peer
    }
}

/// What a handler's work runs in: the call's deadline (which the calls it
/// makes inherit), the metadata they inherit, and where its answer's
/// metadata goes.
pub(super) struct Scope {
    pub(super) peer: Peer,
    pub(super) deadline: Option<Instant>,
    pub(super) meta: crate::metadata::Served,
}

impl Scope {
    /// Runs `f`, a handler's (or interceptor's) work, in this scope; a
    /// panic is caught.
    #[inline]
    pub(super) fn run<R>(&mut self, f: impl FnOnce() -> R) -> std::thread::Result<R> {
        let deadline = self.deadline;
        crate::metadata::serving(&mut self.meta, || guarded(deadline, f))
    }
}

/// Runs a blocking handler on the dispatcher's thread (borrowed where it is
/// registered: no reference count is touched per call).
pub(super) fn run_handler(
    h: &Handler,
    name: &str,
    node: &Node,
    (body, metadata): (Body, Metadata),
    scope: &mut Scope,
    cancelled: &mut dyn FnMut() -> bool,
) -> Result<Payload, RpcError> {
    let mut call = Call::of(name, node, (body, metadata), scope)?;
    match crate::deadline::watching(cancelled, || scope.run(|| h(&mut call))) {
        Ok(r) => r,
        Err(p) => Err(panicked(name, &*p)),
    }
}

/// Runs a streaming handler on the dispatcher's thread, as
/// [`run_handler`] runs a blocking one; a look for a cancel of its call
/// is a look through its sink's feed.
pub(super) fn run_stream(
    h: &StreamHandler,
    name: &str,
    node: &Node,
    (body, metadata): (Body, Metadata),
    scope: &mut Scope,
    sink: &mut Sink<'_>,
) -> Result<(), RpcError> {
    let mut call = Call::of(name, node, (body, metadata), scope)?;
    let feed = sink.feed();
    let mut check = || feed.borrow_mut().cancelled();
    match crate::deadline::watching(&mut check, || scope.run(|| h(&mut call, sink))) {
        Ok(r) => r,
        Err(p) => Err(panicked(name, &*p)),
    }
}

/// Runs a blocking bidirectional handler on the dispatcher's thread, as
/// [`run_stream`] runs a streaming one.
pub(super) fn run_bidi(
    h: &BidiHandler,
    name: &str,
    node: &Node,
    (body, metadata): (Body, Metadata),
    scope: &mut Scope,
    (inbox, sink): (&mut Inbox<'_>, &mut Sink<'_>),
) -> Result<(), RpcError> {
    let mut call = Call::of(name, node, (body, metadata), scope)?;
    let feed = sink.feed();
    let mut check = || feed.borrow_mut().cancelled();
    match crate::deadline::watching(&mut check, || scope.run(|| h(&mut call, inbox, sink))) {
        Ok(r) => r,
        Err(p) => Err(panicked(name, &*p)),
    }
}

/// Runs the interceptors on a request of `method` (a registered one) in
/// the call's scope: the first error is the call's.
pub(super) fn intercept(
    interceptors: &[Interceptor],
    method: Option<&(Arc<str>, Method)>,
    frame: &Frame,
    scope: &mut Scope,
) -> Result<(), RpcError> {
    let Some((name, _)) = method.filter(|_| !interceptors.is_empty()) else {
        return Ok(());
    };
    let len = match &frame.payload {
        Body::None => 0,
        Body::Inline(b) => b.len() as u64,
        Body::Refs(rs) => rs.iter().map(|r| r.len).sum(),
    };
    let incoming = Incoming {
        peer: scope.peer,
        method: name,
        metadata: &frame.meta,
        deadline: scope.deadline,
        len,
    };
    for check in interceptors {
        match scope.run(|| check(&incoming)) {
            Ok(r) => r?,
            Err(p) => {
                let what = panic_text(&*p);
                let e = format!("an interceptor of {name:?} panicked: {what}");
                return Err(RpcError::internal(e));
            }
        }
    }
    Ok(())
}

/// Runs `f`, a handler's work on a call whose deadline is `deadline`: the
/// calls it makes inherit that deadline ([`crate::deadline`]), and a panic
/// is caught.
pub(super) fn guarded<R>(
    deadline: Option<Instant>,
    f: impl FnOnce() -> R,
) -> std::thread::Result<R> {
    crate::deadline::serving(deadline, || {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
    })
}

/// A handler's panic as the call's `Internal` error.
pub(super) fn panicked(name: &str, p: &(dyn std::any::Any + Send)) -> RpcError {
    let what = panic_text(p);
    RpcError::internal(format!("the handler of {name:?} panicked: {what}"))
}

/// What a panic said.
pub(super) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

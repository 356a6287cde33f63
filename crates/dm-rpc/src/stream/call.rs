//! The caller's end of a stream: one state machine ([`Opened`]) over
//! either client's connection ([`StreamConn`]), read by the blocking
//! client ([`Streaming`], an iterator) or the async one
//! ([`AsyncStreaming`], whose `next` is a future). The two differ only in
//! how they wait: for the stream's next frame, and for a server to come
//! back when the request moves on.

use crate::call::attempt::{answer, orphan, Outgoing};
use crate::call::options::CallOptions;
use crate::call::options::Reply;
use crate::error::RpcError;
use crate::frame::Status;
use crate::frame::{Frame, Kind, FLAG_CALLER_STREAM, FLAG_REFUSED, FLAG_STREAM, FLAG_WINDOW};
use crate::metadata::Metadata;
use crate::node::Node;
use crate::payload::{Lent, Payload};
use crate::reconnect::{Connected, Redial};
use crate::transport::Sharing;
use std::sync::Arc;
use std::time::Instant;

/// What the caller's end of a stream needs of its client's connection
/// (the blocking client's and the async client's).
pub(crate) trait StreamConn: Connected {
    /// The connection's node.
    fn node(&self) -> &Node;
    /// Which Refs its server can use.
    fn refs(&self) -> Sharing;
    /// Whether request `req`, placed for a connection whose Refs are
    /// `refs`, can go over this one as it is.
    fn carries(&self, req: &Frame, refs: Sharing) -> bool;
    /// Whether request `id` was never taken by this connection's server,
    /// which stopped and said so (its go-away).
    fn never_taken(&self, id: u64) -> bool;
    /// Sends request `req` of a stream (flagged [`FLAG_STREAM`]),
    /// reading answers for the others while it waits for room. It gets
    /// its call id as it goes ([`crate::sender`]), and the stream is
    /// listed under it first: its frames find their place whoever reads
    /// them (and someone reads them). On a failure, the error and whether
    /// the connection broke.
    fn send_opening(
        &self,
        req: &mut Frame,
        deadline: Option<Instant>,
    ) -> Result<(), (RpcError, bool)>;
    /// Sends a frame of a stream's caller, reading answers for the others
    /// while it waits for room: on a failure, the error and whether the
    /// connection broke.
    fn send_own(&self, f: &Frame, deadline: Option<Instant>) -> Result<(), (RpcError, bool)>;
    /// Opens the stream of request `req`: the request goes (and gets its
    /// id), then the first grant of `window` items. On a failure, whether
    /// the request was sent.
    fn start_stream(
        &self,
        req: &mut Frame,
        deadline: Option<Instant>,
        window: u32,
    ) -> Result<(), (RpcError, bool)> {
        // The default window goes with the request (one frame); another
        // in a grant right after it.
        let with = window == super::DEFAULT_WINDOW;
        if with {
            req.flags |= FLAG_WINDOW;
        } else {
            req.flags &= !FLAG_WINDOW;
        }
        let r = match self.send_opening(req, deadline) {
            Ok(()) if with => Ok(()),
            Ok(()) => self
                .send_own(&Frame::credit(req.call_id, window), deadline)
                .map_err(|(e, _)| (e, true)),
            Err((e, _)) => Err((e, false)),
        };
        if r.is_err() {
            self.close_stream(req.call_id, false);
        }
        r
    }
    /// Grants stream `id` `items` more items.
    fn grant(&self, id: u64, items: u32, deadline: Option<Instant>) -> Result<(), RpcError> {
        self.send_own(&Frame::credit(id, items), deadline)
            .map_err(|(e, _)| e)
    }
    /// Closes stream `id`: what arrived for it unread is released (and
    /// what still comes, as it comes); with `cancel`, its server is told
    /// (best effort, without waiting for room).
    fn close_stream(&self, id: u64, cancel: bool);
}

/// An item and the metadata it carried.
type Item = (Payload, Metadata);

/// How a stream is asked for: its window, whether its request waits for
/// a server to come back, and whether it may run twice.
#[derive(Debug, Clone, Copy)]
pub(crate) struct How {
    window: u32,
    wait_for_ready: bool,
    idempotent: bool,
    /// The caller sends items of its own ([`FLAG_CALLER_STREAM`]).
    caller_items: bool,
}

impl How {
    /// The stream a call with `opts` (as the client applied its defaults)
    /// opens with request `out`.
    pub(crate) fn of(opts: CallOptions, out: &Outgoing) -> How {
        How {
            window: match opts.window {
                0 => super::DEFAULT_WINDOW,
                n => n,
            },
            wait_for_ready: opts.wait_for_ready,
            idempotent: out.again.idempotent,
            caller_items: false,
        }
    }

    /// The same, for a stream whose caller sends items too: its request
    /// never moves to another server once it went (its items went with
    /// it).
    pub(crate) fn with_caller_items(self) -> How {
        How {
            caller_items: true,
            ..self
        }
    }
}

/// The state of a stream's caller end.
struct Opened<C: StreamConn> {
    h: Arc<Redial<C>>,
    conn: Arc<C>,
    /// The method called (its errors name it).
    method: Box<str>,
    /// The call id its request went with (0 until it goes).
    id: u64,
    /// The request, until the server answers anything: a request refused
    /// unrun (its server was stopping) goes to the service's next server.
    request: Option<Frame>,
    /// What the argument lent, ended with the stream.
    lent: Option<Lent>,
    deadline: Option<Instant>,
    how: How,
    /// The request and first grant went over `conn` (false while the
    /// request moves to another server).
    started: bool,
    /// Items read since the last grant.
    read: u32,
    done: bool,
    trailer: Metadata,
    /// Kept while the stream lives (a balanced client's count of what is
    /// in flight on the replica it went to).
    _hold: Option<Box<dyn Send + Sync>>,
}

impl<C: StreamConn> Opened<C> {
    fn new(h: Arc<Redial<C>>, conn: Arc<C>, method: &str, out: Outgoing, how: How) -> Self {
        let (mut req, lent, deadline, _) = out.into_frame();
        req.flags |= FLAG_STREAM;
        if how.caller_items {
            req.flags |= FLAG_CALLER_STREAM;
        }
        Opened {
            h,
            conn,
            method: method.into(),
            id: 0,
            request: Some(req),
            lent: Some(lent),
            deadline,
            how,
            started: false,
            read: 0,
            done: false,
            trailer: Metadata::new(),
            _hold: None,
        }
    }

    /// Ends the stream here: what it lent is released, and with `cancel`
    /// its server is told.
    fn end(&mut self, cancel: bool) {
        self.done = true;
        if self.id != 0 {
            self.conn.close_stream(self.id, cancel);
        }
        if let Some(lent) = self.lent.take() {
            lent.release(self.conn.node());
        }
    }

    /// Ends the stream with `e` (a failure of the connection makes the
    /// client look whether its service moved).
    fn fail(&mut self, e: RpcError) -> RpcError {
        let cancel = e.status != Status::Unavailable;
        self.end(cancel);
        self.h.settle_error(&self.conn, e)
    }

    /// Whether `got`, what came for the stream, leaves its request unrun
    /// before any answer, so that it may go to the service's next server:
    /// `Some(true)` refused by a server that was stopping, `Some(false)`
    /// on a connection that broke (never taken by its server, or the call
    /// may run twice).
    fn unrun_by(&self, got: &Result<Frame, RpcError>) -> Option<bool> {
        self.request.as_ref()?;
        match got {
            Ok(f) => (f.kind != Kind::Item && f.flags & FLAG_REFUSED != 0).then_some(true),
            Err(e) => (e.status == Status::Unavailable && self.unrun()).then_some(false),
        }
    }

    /// Whether the request, on a connection that broke before any answer
    /// came, may go elsewhere.
    fn unrun(&self) -> bool {
        self.how.idempotent || self.conn.never_taken(self.id)
    }

    /// Whether the request would wait for `n`, the connection it goes to
    /// next, to be usable.
    fn waits_for(&self, n: &C) -> bool {
        self.how.wait_for_ready && n.is_spent()
    }

    /// The request's next connection, before any wait for it: the
    /// client's current one (after a refusal, once it retired the
    /// refusing one). None without a request to move.
    fn next_conn(&self, refused: bool) -> Option<arc_swap::Guard<Arc<C>>> {
        self.request.as_ref()?;
        if refused {
            self.h.refused(&self.conn);
        }
        Some(self.h.live())
    }

    /// Moves the request, known not to have run, to connection `n`; false
    /// if it is the same, the request cannot go there as it is, or its
    /// deadline passed.
    fn move_to(&mut self, n: &Arc<C>) -> bool {
        let Some(req) = self.request.as_mut() else {
            return false;
        };
        if Arc::ptr_eq(n, &self.conn)
            || !n.carries(req, self.conn.refs())
            || self.deadline.is_some_and(|d| Instant::now() >= d)
        {
            return false;
        }
        self.conn.close_stream(self.id, false);
        self.started = false;
        // (It draws a new id as it goes there.)
        req.call_id = 0;
        self.id = 0;
        self.conn = Arc::clone(n);
        true
    }

    /// Attempt `attempt` at sending the request and the first grant. On a
    /// failure, the error and whether the request may go to the next
    /// server (it is known not to have run; three servers at most).
    fn start(&mut self, attempt: u32) -> Result<(), (RpcError, bool)> {
        let Some(req) = &mut self.request else {
            return Err((RpcError::internal("a stream without its request"), false));
        };
        let started = self.conn.start_stream(req, self.deadline, self.how.window);
        self.id = req.call_id;
        let (e, sent) = match started {
            Ok(()) => {
                self.started = true;
                return Ok(());
            }
            Err(x) => x,
        };
        let again = e.status == Status::Unavailable && (!sent || self.unrun()) && attempt < 3;
        Err((e, again))
    }

    /// What the stream gives for `got`, what came for it: an item with
    /// its metadata (`Ok(Some)`), its end (`Ok(None)`, or the last item
    /// the ending answer carries, whose metadata is then the stream's
    /// [`trailer`](Self::trailer)), or the error it ended with.
    fn take(&mut self, got: Result<Frame, RpcError>) -> Result<Option<Item>, RpcError> {
        let f = match got {
            Ok(f) => f,
            Err(e) => return Err(self.fail(e)),
        };
        if f.kind == Kind::Item {
            self.request = None;
            self.read += 1;
            if self.read >= (self.how.window / 2).max(1) {
                let n = std::mem::take(&mut self.read);
                if let Err(e) = self.conn.grant(self.id, n, self.deadline) {
                    orphan(self.conn.node(), f);
                    return Err(self.fail(e));
                }
            }
            crate::stats::count(&f.payload, false);
            let p = Payload::from_response_body(f.payload, self.conn.node())?;
            return Ok(Some((p, f.meta)));
        }
        // The answer that ends the stream (what the argument lent is
        // ended with it: an answer may pass the request's Ref back).
        let lent = self.lent.take().unwrap_or_default();
        self.end(false);
        match answer(self.conn.node(), f, lent) {
            Ok(Reply { payload, metadata }) => {
                self.trailer = metadata;
                Ok((!payload.is_empty()).then_some((payload, Metadata::new())))
            }
            Err(mut e) => {
                self.trailer = e.metadata.clone();
                crate::error::name_the_method(&mut e, &self.method);
                Err(self.h.settle_error(&self.conn, e))
            }
        }
    }
}

impl<C: StreamConn> Drop for Opened<C> {
    fn drop(&mut self) {
        if !self.done {
            self.end(true);
        }
    }
}

impl<C: StreamConn> std::fmt::Debug for Opened<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("service", &self.h.target())
            .field("call_id", &self.id)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

/// The caller's end of a streaming call
/// ([`Client::call_stream`](crate::Client::call_stream)): an iterator
/// over the items as they come, then `None` once the stream ended well, or
/// one `Err` with the status it ended with. Dropping it before the end
/// cancels the call (its server is told) and releases what came and was
/// not read.
#[derive(Debug)]
pub struct Streaming {
    o: Opened<crate::client::BlockingConn>,
}

impl Streaming {
    /// Sends request `out` (a call of `method`) over `conn` and opens its
    /// stream.
    pub(crate) fn open(
        h: Arc<Redial<crate::client::BlockingConn>>,
        conn: Arc<crate::client::BlockingConn>,
        method: &str,
        out: Outgoing,
        how: How,
    ) -> Result<Streaming, RpcError> {
        let mut s = Streaming {
            o: Opened::new(h, conn, method, out, how),
        };
        match s.launch() {
            Ok(()) => Ok(s),
            Err(e) => Err(s.o.fail(e)),
        }
    }

    /// This stream, keeping `hold` until it is dropped.
    pub(crate) fn holding(mut self, hold: Box<dyn Send + Sync>) -> Self {
        self.o._hold = Some(hold);
        self
    }

    /// The metadata of the answer that ended the stream (empty before the
    /// end, and if the handler set none).
    pub fn metadata(&self) -> &Metadata {
        &self.o.trailer
    }

    /// Whether the stream has ended (well or not).
    pub fn is_done(&self) -> bool {
        self.o.done
    }

    /// Moves the request, known not to have run, to the server the
    /// client now connects to, waiting for one if the call waits for
    /// ready; false if there is none other ([`Opened::move_to`]).
    fn move_on(&mut self, refused: bool) -> bool {
        let Some(mut n) = self.o.next_conn(refused) else {
            return false;
        };
        if self.o.waits_for(&n) {
            match self.o.h.ready(n, self.o.deadline) {
                Ok(r) => n = r,
                Err(_) => return false,
            }
        }
        self.o.move_to(&n)
    }

    /// Sends the request and the first grant; again, to the next server,
    /// while the failure leaves the request unrun.
    fn launch(&mut self) -> Result<(), RpcError> {
        let mut attempt = 1;
        loop {
            match self.o.start(attempt) {
                Ok(()) => return Ok(()),
                Err((e, again)) => {
                    if !again || !self.move_on(false) {
                        return Err(e);
                    }
                }
            }
            attempt += 1;
        }
    }

    /// Sends the request, known not to have run, to the next server: true
    /// if it went, false if there is none to go to; the stream's end if
    /// sending it there failed.
    fn went_again(&mut self, refused: bool) -> Result<bool, RpcError> {
        if !self.move_on(refused) {
            return Ok(false);
        }
        match self.launch() {
            Ok(()) => Ok(true),
            Err(e) => Err(self.o.fail(e)),
        }
    }

    /// The next item and the metadata it carried (empty unless its
    /// handler sent some with it), as [`next`](Iterator::next) gives the
    /// item.
    pub fn next_with_metadata(&mut self) -> Option<Result<Item, RpcError>> {
        if self.o.done {
            return None;
        }
        self.step().transpose()
    }

    /// The next item: `Ok(Some)`, `Ok(None)` at the end, or the error the
    /// stream ended with.
    fn step(&mut self) -> Result<Option<Item>, RpcError> {
        loop {
            let got = self.o.conn.stream_next(self.o.id, self.o.deadline);
            if let Some(refused) = self.o.unrun_by(&got) {
                if self.went_again(refused)? {
                    continue;
                }
            }
            return self.o.take(got);
        }
    }
}

impl Iterator for Streaming {
    type Item = Result<Payload, RpcError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_with_metadata().map(|r| r.map(|(p, _)| p))
    }
}

/// The async caller's end of a streaming call
/// ([`AsyncClient::call_stream`](crate::AsyncClient::call_stream)):
/// [`next`](Self::next) gives the items as they come, then `None` once the
/// stream ended well, or one `Err` with the status it ended with.
/// Dropping it before the end cancels the call (its server is told) and
/// releases what came and was not read. Dropping a `next` future while it
/// waits (a `select!`, a timeout around it) loses nothing: the item it
/// waited for is the next one's.
#[derive(Debug)]
pub struct AsyncStreaming {
    o: Opened<crate::async_client::AsyncConn>,
}

impl AsyncStreaming {
    /// Sends request `out` (a call of `method`) over `conn` and opens its
    /// stream.
    pub(crate) async fn open(
        h: Arc<Redial<crate::async_client::AsyncConn>>,
        conn: Arc<crate::async_client::AsyncConn>,
        method: &str,
        out: Outgoing,
        how: How,
    ) -> Result<AsyncStreaming, RpcError> {
        let mut s = AsyncStreaming {
            o: Opened::new(h, conn, method, out, how),
        };
        match s.launch().await {
            Ok(()) => Ok(s),
            Err(e) => Err(s.o.fail(e)),
        }
    }

    /// This stream, keeping `hold` until it is dropped.
    pub(crate) fn holding(mut self, hold: Box<dyn Send + Sync>) -> Self {
        self.o._hold = Some(hold);
        self
    }

    /// The metadata of the answer that ended the stream (empty before the
    /// end, and if the handler set none).
    pub fn metadata(&self) -> &Metadata {
        &self.o.trailer
    }

    /// Whether the stream has ended (well or not).
    pub fn is_done(&self) -> bool {
        self.o.done
    }

    /// The next item: `Some(Ok)`, `None` once the stream ended well, or
    /// `Some(Err)` with the status it ended with (then `None`).
    pub async fn next(&mut self) -> Option<Result<Payload, RpcError>> {
        self.next_with_metadata().await.map(|r| r.map(|(p, _)| p))
    }

    /// The next item and the metadata it carried (empty unless its
    /// handler sent some with it: [`AsyncSink::send_with_metadata`](crate::AsyncSink::send_with_metadata)),
    /// as [`next`](Self::next) gives the item. The last item an ending
    /// answer carries comes with none: the answer's is
    /// [`metadata`](Self::metadata), once this gives `None`.
    pub async fn next_with_metadata(&mut self) -> Option<Result<Item, RpcError>> {
        if self.o.done {
            return None;
        }
        self.step().await.transpose()
    }

    /// [`Streaming::move_on`], awaiting a server that comes back.
    async fn move_on(&mut self, refused: bool) -> bool {
        let Some(n) = self.o.next_conn(refused) else {
            return false;
        };
        let mut n = arc_swap::Guard::into_inner(n);
        if self.o.waits_for(&n) {
            match self.o.h.ready_async(n, self.o.deadline).await {
                Ok(r) => n = r,
                Err(_) => return false,
            }
        }
        self.o.move_to(&n)
    }

    /// [`Streaming::launch`].
    async fn launch(&mut self) -> Result<(), RpcError> {
        let mut attempt = 1;
        loop {
            match self.o.start(attempt) {
                Ok(()) => return Ok(()),
                Err((e, again)) => {
                    if !again || !self.move_on(false).await {
                        return Err(e);
                    }
                }
            }
            attempt += 1;
        }
    }

    /// [`Streaming::went_again`].
    async fn went_again(&mut self, refused: bool) -> Result<bool, RpcError> {
        if !self.move_on(refused).await {
            return Ok(false);
        }
        match self.launch().await {
            Ok(()) => Ok(true),
            Err(e) => Err(self.o.fail(e)),
        }
    }

    /// [`Streaming::step`].
    async fn step(&mut self) -> Result<Option<Item>, RpcError> {
        if !self.o.started {
            // (A `next` dropped while its request moved to another server.)
            if let Err(e) = self.launch().await {
                return Err(self.o.fail(e));
            }
        }
        loop {
            let got = self.o.conn.stream_next(self.o.id, self.o.deadline).await;
            if let Some(refused) = self.o.unrun_by(&got) {
                if self.went_again(refused).await? {
                    continue;
                }
            }
            return self.o.take(got);
        }
    }
}

/// The async caller's end of a call whose caller sends a stream of items
/// too ([`AsyncClient::call_bidi`](crate::AsyncClient::call_bidi)): a
/// bidirectional stream, or a caller's stream answered once. Items go
/// with [`send`](Self::send), their end with [`finish`](Self::finish);
/// what the server answers comes from [`next`](Self::next), as from an
/// [`AsyncStreaming`]. [`split`](Self::split) gives the two halves to two
/// tasks.
#[derive(Debug)]
pub struct AsyncBidi {
    items: super::AsyncItems,
    answers: AsyncStreaming,
}

impl AsyncBidi {
    /// Sends request `out` (a call of `method`) over `conn`, flagged as
    /// followed by the caller's items, and opens its stream.
    pub(crate) async fn open(
        h: Arc<Redial<crate::async_client::AsyncConn>>,
        conn: Arc<crate::async_client::AsyncConn>,
        method: &str,
        out: Outgoing,
        how: How,
    ) -> Result<AsyncBidi, RpcError> {
        let mut answers =
            AsyncStreaming::open(h, conn, method, out, how.with_caller_items()).await?;
        // Its items follow it: the request stays where it went.
        answers.o.request = None;
        let o = &answers.o;
        let items = super::AsyncItems::new(o.conn.clone(), o.id, o.deadline);
        Ok(AsyncBidi { items, answers })
    }

    /// Sends `item` to the server ([`AsyncItems::send`](super::AsyncItems::send)).
    pub async fn send(&mut self, item: impl Into<Payload>) -> Result<(), RpcError> {
        self.items.send(item).await
    }

    /// Ends the items ([`AsyncItems::finish`](super::AsyncItems::finish)).
    pub async fn finish(&mut self) -> Result<(), RpcError> {
        self.items.finish().await
    }

    /// The next item of the answer ([`AsyncStreaming::next`]).
    pub async fn next(&mut self) -> Option<Result<Payload, RpcError>> {
        self.answers.next().await
    }

    /// The next item of the answer and its metadata
    /// ([`AsyncStreaming::next_with_metadata`]).
    pub async fn next_with_metadata(&mut self) -> Option<Result<(Payload, Metadata), RpcError>> {
        self.answers.next_with_metadata().await
    }

    /// The metadata of the answer that ended the call.
    pub fn metadata(&self) -> &Metadata {
        self.answers.metadata()
    }

    /// The two halves: the items to send, and the answer's stream. The
    /// answer's half owns the call: dropping it before the end cancels
    /// the call, and then the items' sends fail.
    pub fn split(self) -> (super::AsyncItems, AsyncStreaming) {
        (self.items, self.answers)
    }
}

/// The blocking caller's end of a call whose caller sends items too
/// ([`Client::call_bidi`](crate::Client::call_bidi)): as [`AsyncBidi`],
/// with calls that block. [`split`](Self::split) gives the two halves to
/// two threads.
#[derive(Debug)]
pub struct Bidi {
    items: super::Items,
    answers: Streaming,
}

impl Bidi {
    /// Sends request `out` (a call of `method`) over `conn`, flagged as
    /// followed by the caller's items, and opens its stream.
    pub(crate) fn open(
        h: Arc<Redial<crate::client::BlockingConn>>,
        conn: Arc<crate::client::BlockingConn>,
        method: &str,
        out: Outgoing,
        how: How,
    ) -> Result<Bidi, RpcError> {
        let mut answers = Streaming::open(h, conn, method, out, how.with_caller_items())?;
        // Its items follow it: the request stays where it went.
        answers.o.request = None;
        let o = &answers.o;
        let items = super::Items::new(o.conn.clone(), o.id, o.deadline);
        Ok(Bidi { items, answers })
    }

    /// Sends `item` to the server ([`Items::send`](super::Items::send)).
    pub fn send(&mut self, item: impl Into<Payload>) -> Result<(), RpcError> {
        self.items.send(item)
    }

    /// Ends the items ([`Items::finish`](super::Items::finish)).
    pub fn finish(&mut self) -> Result<(), RpcError> {
        self.items.finish()
    }

    /// The metadata of the answer that ended the call.
    pub fn metadata(&self) -> &Metadata {
        self.answers.metadata()
    }

    /// The two halves: the items to send, and the answer's stream. The
    /// answer's half owns the call: dropping it before the end cancels
    /// the call, and then the items' sends fail.
    pub fn split(self) -> (super::Items, Streaming) {
        (self.items, self.answers)
    }
}

impl Iterator for Bidi {
    type Item = Result<Payload, RpcError>;

    /// The next item of the answer, as [`Streaming`] gives them.
    fn next(&mut self) -> Option<Self::Item> {
        self.answers.next()
    }
}

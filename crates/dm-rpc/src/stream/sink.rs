//! The server's end of a stream: the sink a streaming handler sends its
//! items into, and what it reads from its server's connections meanwhile.

use crate::error::RpcError;
use crate::frame::{Frame, Kind};
use crate::metadata::Metadata;
use crate::node::Node;
use crate::payload::{Dir, Payload};
use crate::server::{take_in, Later, Pending, Stats};
use crate::transport::{ConnId, Listener, Sharing};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The longest a waiting sink sleeps between looks at its room and its
/// caller's state (a grant of credit wakes it at once).
const LONGEST_WAIT: Duration = Duration::from_millis(50);

/// What a streaming handler's sink reads from its server's connections
/// while the handler runs: grants and a cancel of its own call, and,
/// for the dispatcher, the requests and cancels of other calls
/// ([`take_in`]).
pub(crate) struct Feed<'a> {
    listener: &'a mut dyn Listener,
    queue: &'a mut VecDeque<Pending>,
    stats: &'a Stats,
    draining: Option<Instant>,
    /// Cancels of other calls and grants of async streams, applied when
    /// the handler returns.
    later: Vec<Later>,
    /// The connection and call id of the stream.
    running: (ConnId, u64),
    /// Items granted and not yet sent.
    credit: u64,
    /// The caller cancelled the stream.
    cancelled: bool,
    /// The caller's own items, for a handler that reads them
    /// ([`super::Inbox`]); `None` for one that does not.
    pub(crate) taking: Option<super::inbox::Taking>,
}

impl<'a> Feed<'a> {
    pub(crate) fn new(
        listener: &'a mut dyn Listener,
        queue: &'a mut VecDeque<Pending>,
        stats: &'a Stats,
        draining: Option<Instant>,
        (running, credit): ((ConnId, u64), u64),
    ) -> Self {
        Feed {
            listener,
            queue,
            stats,
            draining,
            later: Vec::new(),
            running,
            credit,
            cancelled: false,
            taking: None,
        }
    }

    /// The cancels of other calls and grants of async streams it read.
    pub(crate) fn take_later(&mut self) -> Vec<Later> {
        std::mem::take(&mut self.later)
    }

    /// The listener it reads, and the stream's connection.
    pub(crate) fn listener(&mut self) -> (&mut dyn Listener, ConnId) {
        (&mut *self.listener, self.running.0)
    }

    /// The stream's call id.
    pub(crate) fn call_id(&self) -> u64 {
        self.running.1
    }

    /// Takes in what already waits, then says whether the stream was
    /// cancelled.
    pub(crate) fn cancelled(&mut self) -> bool {
        self.look();
        self.cancelled
    }

    fn take(&mut self, conn: ConnId, f: Frame) {
        if (conn, f.call_id) == self.running {
            match f.kind {
                Kind::Credit => {
                    self.credit += u64::from(f.method);
                    return;
                }
                Kind::Cancel => {
                    self.cancelled = true;
                    return;
                }
                Kind::Item => {
                    if let Some(t) = &mut self.taking {
                        if let Some(f) = t.take(f) {
                            t.spill(f);
                        }
                        return;
                    }
                }
                _ => {}
            }
        }
        let (stats, draining) = (self.stats, self.draining);
        take_in(
            &mut *self.listener,
            self.queue,
            stats,
            draining,
            &mut self.later,
            (conn, f),
        );
    }

    /// Takes in every frame already waiting, without waiting.
    pub(crate) fn look(&mut self) {
        while let Ok(Some((conn, f))) = self.listener.poll() {
            self.take(conn, f);
            if self.queue.len() > 4096 {
                break;
            }
        }
    }

    /// Waits for a frame until `until`, and takes it in.
    pub(crate) fn wait(&mut self, until: Instant) {
        if let Ok(Some((conn, f))) = self.listener.next(Some(until)) {
            self.take(conn, f);
        }
    }
}

/// Counts item `f`, sent, in the server's and the transport's stats.
fn count_item(stats: &Stats, f: &Frame) {
    stats.items.fetch_add(1, Ordering::Relaxed);
    crate::stats::count(&f.payload, true);
}

/// Where a streaming handler sends its items
/// ([`ServerBuilder::method_stream`](crate::ServerBuilder::method_stream)).
pub struct Sink<'a> {
    feed: &'a RefCell<Feed<'a>>,
    node: &'a Node,
    stop: &'a AtomicBool,
    deadline: Option<Instant>,
    inline_max: usize,
    refs: Sharing,
    id: u64,
    sent: u64,
}

impl std::fmt::Debug for Sink<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sink")
            .field("call_id", &self.id)
            .field("sent", &self.sent)
            .finish_non_exhaustive()
    }
}

impl<'a> Sink<'a> {
    pub(crate) fn new(
        feed: &'a RefCell<Feed<'a>>,
        node: &'a Node,
        stop: &'a AtomicBool,
        deadline: Option<Instant>,
        id: u64,
    ) -> Self {
        let (inline_max, refs) = {
            let f = feed.borrow();
            let max = f.listener.max_inline();
            (node.cfg.threshold().min(max), f.listener.refs(f.running.0))
        };
        Sink {
            feed,
            node,
            stop,
            deadline,
            inline_max,
            refs,
            id,
            sent: 0,
        }
    }

    pub(crate) fn feed(&self) -> &'a RefCell<Feed<'a>> {
        self.feed
    }

    /// Items sent so far.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// Sends `item` to the caller: inline if small, else as a Ref made for
    /// the caller (which the caller's client releases when it drops the
    /// item). Waits while the caller holds as many unread items as it
    /// asked for. Fails, and the handler should return, with `Cancelled`
    /// once the caller dropped the stream, `DeadlineExceeded` once the
    /// call's deadline passed, `Unavailable` if the caller is gone or the
    /// server is stopping; the item is then released.
    pub fn send(&mut self, item: impl Into<Payload>) -> Result<(), RpcError> {
        let (body, lent) =
            item.into()
                .into_body(self.node, self.inline_max, Dir::Answer(None), self.refs)?;
        let made = lent.made_ref();
        let frame = Frame::item(self.id, body);
        let r = self.deliver(&frame);
        match &r {
            Ok(()) => self.sent += 1,
            Err(_) => {
                if let Some(r) = made {
                    let _ = self.node.release_ref(&r);
                }
            }
        }
        r
    }

    /// Sends `frame` once the caller has granted an item and the
    /// connection has room for it, reading the server's connections
    /// meanwhile.
    fn deliver(&mut self, frame: &Frame) -> Result<(), RpcError> {
        let mut slice = Duration::from_millis(1);
        loop {
            let mut f = self.feed.borrow_mut();
            if f.cancelled() {
                return Err(RpcError::new(
                    crate::frame::Status::Cancelled,
                    "the caller cancelled the stream",
                ));
            }
            if self.stop.load(Ordering::Acquire) {
                return Err(RpcError::unavailable("the server is stopping"));
            }
            let now = Instant::now();
            if self.deadline.is_some_and(|d| now >= d) {
                return Err(RpcError::deadline_exceeded("the stream's deadline passed"));
            }
            if f.credit > 0 {
                let conn = f.running.0;
                match f.listener.send_item(conn, frame) {
                    Ok(true) => {
                        f.credit -= 1;
                        count_item(f.stats, frame);
                        return Ok(());
                    }
                    // No room in the connection yet: its caller reads.
                    Ok(false) => {
                        let until = self
                            .deadline
                            .map_or(now + LONGEST_WAIT, |d| d.min(now + LONGEST_WAIT));
                        f.listener.wait_room(conn, frame.encoded_len(), until);
                        if !f.listener.is_open(conn) {
                            return Err(RpcError::unavailable("the stream's caller is gone"));
                        }
                        continue;
                    }
                    Err(e) => {
                        return Err(RpcError::unavailable(format!(
                            "the stream's caller is gone: {e}"
                        )))
                    }
                }
            }
            // No grant: one (or a cancel) comes as a frame, and ends the
            // wait; the slices only bound how long a dead caller goes
            // unnoticed.
            let until = self.deadline.map_or(now + slice, |d| d.min(now + slice));
            f.wait(until);
            if !f.listener.is_open(f.running.0) {
                // Its client closed the connection, or died.
                return Err(RpcError::unavailable("the stream's caller is gone"));
            }
            slice = (slice * 2).min(LONGEST_WAIT);
        }
    }
}

/// What an async streaming handler's sink and its dispatcher share
/// ([`AsyncSink`]): the sink queues items here as its caller grants them,
/// and the dispatcher sends them between polls (it owns the connections),
/// adds the grants it reads, and ends the stream when its caller goes.
pub(crate) struct Outlet {
    /// The stream's connection and call id.
    pub(crate) conn: ConnId,
    pub(crate) id: u64,
    /// When the call's deadline passes (the dispatcher ends the stream).
    pub(crate) deadline: Option<Instant>,
    /// The dispatcher's thread: a sink used elsewhere (moved into a
    /// spawned task) pokes it after queuing an item.
    home: std::thread::ThreadId,
    state: std::sync::Mutex<Outbox>,
}

/// How a stream ended.
enum Ended {
    /// Its handler returned: a send after is refused with an error made
    /// then (none is made for the stream that ends as it should).
    Done,
    /// Early, with this error.
    Early(RpcError),
}

impl Ended {
    fn error(&self) -> RpcError {
        match self {
            Ended::Done => RpcError::unavailable("the stream has ended"),
            Ended::Early(e) => e.clone(),
        }
    }
}

#[derive(Default)]
struct Outbox {
    /// Items granted and not yet queued.
    credit: u64,
    /// Items queued and not yet sent, with the Ref each made for the
    /// caller (released if it is never sent).
    out: VecDeque<(Frame, Option<dm_pool::Ref>)>,
    /// How the stream ended (early: cancelled, caller gone, deadline,
    /// server stopping): every send from then on fails with its error.
    ended: Option<Ended>,
    /// A send waiting for credit.
    credit_waker: Option<std::task::Waker>,
    /// The handler's end waiting for its items to go out.
    flush_waker: Option<std::task::Waker>,
    /// The last item, which the answer that ends the stream carries
    /// ([`AsyncSink::end_with`]).
    last: Option<Payload>,
}

impl Outlet {
    pub(crate) fn new(conn: ConnId, id: u64, deadline: Option<Instant>, credit: u64) -> Self {
        Outlet {
            conn,
            id,
            deadline,
            home: std::thread::current().id(),
            state: std::sync::Mutex::new(Outbox {
                credit,
                ..Outbox::default()
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Outbox> {
        crate::sync::lock(&self.state)
    }

    /// The caller granted `n` more items.
    pub(crate) fn grant(&self, n: u32) {
        let mut b = self.lock();
        b.credit += u64::from(n);
        if let Some(w) = b.credit_waker.take() {
            drop(b);
            w.wake();
        }
    }

    /// Whether items wait to be sent.
    pub(crate) fn unsent(&self) -> bool {
        !self.lock().out.is_empty()
    }

    /// Sends what is queued, as far as the connection has room
    /// ([`Listener::send_item`]), counting each item sent in `stats`; an
    /// error ends the stream (its caller is gone).
    pub(crate) fn flush(&self, node: &Node, listener: &mut dyn Listener, stats: &Stats) {
        let mut b = self.lock();
        if b.ended.is_some() {
            return;
        }
        while let Some((f, _)) = b.out.front() {
            match listener.send_item(self.conn, f) {
                Ok(true) => {
                    count_item(stats, f);
                    b.out.pop_front();
                }
                Ok(false) => return,
                Err(e) => {
                    let e = RpcError::unavailable(format!("the stream's caller is gone: {e}"));
                    Self::end_locked(b, node, Ended::Early(e));
                    return;
                }
            }
        }
        if let Some(w) = b.flush_waker.take() {
            drop(b);
            w.wake();
        }
    }

    /// Ends the stream early with `e` (if it has not ended): what is
    /// queued is released, and a waiting send or flush is woken to fail.
    pub(crate) fn end(&self, node: &Node, e: RpcError) {
        let b = self.lock();
        if b.ended.is_none() {
            Self::end_locked(b, node, Ended::Early(e));
        }
    }

    /// Ends the stream as its handler returned (if it has not ended).
    pub(crate) fn finish(&self, node: &Node) {
        let b = self.lock();
        if b.ended.is_none() {
            Self::end_locked(b, node, Ended::Done);
        }
    }

    fn end_locked(mut b: std::sync::MutexGuard<'_, Outbox>, node: &Node, e: Ended) {
        b.ended = Some(e);
        let out = std::mem::take(&mut b.out);
        let wakers = (b.credit_waker.take(), b.flush_waker.take());
        drop(b);
        for (_, made) in out {
            if let Some(r) = made {
                let _ = node.release_ref(&r);
            }
        }
        for w in [wakers.0, wakers.1].into_iter().flatten() {
            w.wake();
        }
    }

    /// Waits until every item queued is sent (or the stream ended early:
    /// then its error).
    pub(crate) async fn flushed(&self) -> Result<(), RpcError> {
        std::future::poll_fn(|cx| {
            let mut b = self.lock();
            if let Some(e) = &b.ended {
                return std::task::Poll::Ready(Err(e.error()));
            }
            if b.out.is_empty() {
                return std::task::Poll::Ready(Ok(()));
            }
            b.flush_waker = Some(cx.waker().clone());
            std::task::Poll::Pending
        })
        .await
    }

    /// The last item the answer carries, if the handler set one.
    pub(crate) fn take_last(&self) -> Option<Payload> {
        self.lock().last.take()
    }

    /// Takes one item of credit, waiting for a grant.
    async fn take_credit(&self) -> Result<(), RpcError> {
        std::future::poll_fn(|cx| {
            let mut b = self.lock();
            if let Some(e) = &b.ended {
                return std::task::Poll::Ready(Err(e.error()));
            }
            if b.credit > 0 {
                b.credit -= 1;
                return std::task::Poll::Ready(Ok(()));
            }
            b.credit_waker = Some(cx.waker().clone());
            std::task::Poll::Pending
        })
        .await
    }
}

/// Where an async streaming handler sends its items
/// ([`ServerBuilder::method_stream_async`](crate::ServerBuilder::method_stream_async)):
/// owned, so the handler's future holds it across awaits (or moves it
/// into a task it spawns).
pub struct AsyncSink {
    outlet: std::sync::Arc<Outlet>,
    node: Node,
    /// Pokes the dispatcher (a sink used off its thread).
    poke: crate::transport::Waker,
    inline_max: usize,
    refs: Sharing,
    sent: u64,
}

impl std::fmt::Debug for AsyncSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncSink")
            .field("call_id", &self.outlet.id)
            .field("sent", &self.sent)
            .finish_non_exhaustive()
    }
}

impl AsyncSink {
    pub(crate) fn new(
        outlet: std::sync::Arc<Outlet>,
        node: Node,
        poke: crate::transport::Waker,
        inline_max: usize,
        refs: Sharing,
    ) -> Self {
        AsyncSink {
            outlet,
            node,
            poke,
            inline_max,
            refs,
            sent: 0,
        }
    }

    /// Items sent so far.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// Sends `item` to the caller, as [`Sink::send`] does (inline if
    /// small, else as a Ref made for the caller), awaiting a grant while
    /// the caller holds as many unread items as it asked for: the server's
    /// other calls go on meanwhile. The item is on its way when this
    /// returns (the dispatcher writes it into the connection after the
    /// poll, before the stream's end). Fails, and the handler should
    /// return, with `DeadlineExceeded` once the call's deadline passed,
    /// `Unavailable` if the caller is gone or the server is stopping. A
    /// caller that drops the stream cancels the call: the handler's
    /// future is dropped (as an async handler's is).
    pub async fn send(&mut self, item: impl Into<Payload>) -> Result<(), RpcError> {
        self.send_with_metadata(item, Metadata::new()).await
    }

    /// Makes `item` the stream's last item, carried by the answer that
    /// ends it once the handler returns `Ok` (instead of a frame of its
    /// own): a stream that turns out to be one item long costs one frame,
    /// as a call's answer does. It needs no grant. The caller reads it as
    /// it reads any item, before the end. Replaces a last item set
    /// before.
    pub fn end_with(&mut self, item: impl Into<Payload>) {
        self.outlet.lock().last = Some(item.into());
    }

    /// Sends `item` with metadata `meta`, as [`send`](Self::send) does:
    /// for what a caller must see before the stream's first item (gRPC's
    /// response headers). The item may be empty. An item's metadata is
    /// bounded as an answer's: what exceeds the room for it fails
    /// with `Internal`.
    pub async fn send_with_metadata(
        &mut self,
        item: impl Into<Payload>,
        meta: Metadata,
    ) -> Result<(), RpcError> {
        let item = item.into();
        self.outlet.take_credit().await?;
        let inline_max = match meta.inline_room(self.inline_max, self.inline_max) {
            Ok(room) => room,
            Err((len, max)) => {
                self.outlet.grant(1);
                return Err(RpcError::internal(format!(
                    "an item's metadata of {len} bytes exceeds the limit of {max}"
                )));
            }
        };
        let (body, lent) =
            match item.into_body(&self.node, inline_max, Dir::Answer(None), self.refs) {
                Ok(x) => x,
                Err(e) => {
                    self.outlet.grant(1);
                    return Err(e);
                }
            };
        let made = lent.made_ref();
        let mut frame = Frame::item(self.outlet.id, body);
        if !meta.is_empty() {
            frame.meta = meta;
        }
        {
            let mut b = self.outlet.lock();
            if let Some(e) = &b.ended {
                let e = e.error();
                drop(b);
                if let Some(r) = made {
                    let _ = self.node.release_ref(&r);
                }
                return Err(e);
            }
            b.out.push_back((frame, made));
        }
        self.sent += 1;
        if std::thread::current().id() != self.outlet.home {
            self.poke.wake();
        }
        Ok(())
    }
}

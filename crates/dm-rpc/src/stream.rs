//! Streaming calls: a method that answers with a stream of items.
//!
//! A server registers a streaming method with
//! [`ServerBuilder::method_stream`](crate::ServerBuilder::method_stream):
//! its handler sends items into a [`Sink`] as it has them and returns how
//! the stream ends. A caller opens the stream with
//! [`Client::call_stream`](crate::Client::call_stream) and reads the items
//! from a [`Streaming`], an iterator, as they come. Each item is a
//! [`Payload`]: small ones travel inline, large ones as Refs made for the
//! caller (the size-aware rule of every answer), so a stream of large
//! items moves no bytes through the connection.
//!
//! **Flow control.** The caller says how many items it will hold (its
//! window, [`CallOptions::window`](crate::CallOptions::window), default
//! [`DEFAULT_WINDOW`]): the server sends an item only while the caller has
//! granted more than it was sent, and the caller grants more as it reads
//! (in [`Kind::Credit`](crate::Kind::Credit) frames, once half its window
//! is read). So what a slow reader has not read stays within its window:
//! its client never buffers more, and its connection never fills with it
//! (the answers of the connection's other calls still get through). A
//! handler that sends faster than its caller reads waits in
//! [`Sink::send`]; meanwhile its server queues the requests that come (it
//! runs one blocking handler at a time, a streaming one too; over shared
//! memory the stream's own connection is not read for requests until it
//! ends, so that its items have the room).
//!
//! **Ends.** The stream ends with the call's answer: `Ok` after the
//! handler returned `Ok(())`, or the error it returned (or
//! `DeadlineExceeded` once the call's deadline passes: the deadline
//! bounds the whole stream). A caller that drops its [`Streaming`] before
//! the end cancels the call: the handler's next [`Sink::send`] fails with
//! `Cancelled` (and [`Call::cancelled`](crate::Call::cancelled) is true),
//! and the items already sent are released. A server that dies ends its
//! streams with `Unavailable`, as it does calls.
//!
//! The wire format is in [`crate::frame`] (frames v7).

use crate::client::{answer, orphan, Inner, Outgoing, Reply};
use crate::error::RpcError;
use crate::frame::{Frame, Kind, FLAG_REFUSED, FLAG_STREAM};
use crate::metadata::Metadata;
use crate::node::Node;
use crate::payload::{Dir, Lent, Payload};
use crate::reconnect::Connected;
use crate::server::{take_in, Pending, Stats};
use crate::transport::{ConnId, Listener, Sharing};
use crate::Client;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Items a caller holds unread at most, unless it says otherwise
/// ([`CallOptions::window`](crate::CallOptions::window)).
pub const DEFAULT_WINDOW: u32 = 16;

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
    /// Cancels of other calls, applied when the handler returns.
    later: Vec<(ConnId, u64)>,
    /// The connection and call id of the stream.
    running: (ConnId, u64),
    /// Items granted and not yet sent.
    credit: u64,
    /// The caller cancelled the stream.
    cancelled: bool,
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
        }
    }

    /// The cancels of other calls it read.
    pub(crate) fn take_later(&mut self) -> Vec<(ConnId, u64)> {
        std::mem::take(&mut self.later)
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
    fn look(&mut self) {
        while let Ok(Some((conn, f))) = self.listener.poll() {
            self.take(conn, f);
            if self.queue.len() > 4096 {
                break;
            }
        }
    }

    /// Waits for a frame until `until`, and takes it in.
    fn wait(&mut self, until: Instant) {
        if let Ok(Some((conn, f))) = self.listener.next(Some(until)) {
            self.take(conn, f);
        }
    }
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
            (node.cfg.inline_max.min(max), f.listener.refs(f.running.0))
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
                    crate::Status::Cancelled,
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
                        f.stats.items.fetch_add(1, Ordering::Relaxed);
                        crate::stats::count(&frame.payload, true);
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

/// The caller's end of a streaming call ([`Client::call_stream`]): an
/// iterator over the items as they come, then `None` once the stream
/// ended well, or one `Err` with the status it ended with. Dropping it
/// before the end cancels the call (its server is told) and releases what
/// came and was not read.
pub struct Streaming {
    client: Client,
    conn: Arc<Inner>,
    id: u64,
    /// The request, until the server answers anything: a request refused
    /// unrun (its server was stopping) goes to the service's next server.
    request: Option<Frame>,
    /// What the argument lent, ended with the stream.
    lent: Option<Lent>,
    deadline: Option<Instant>,
    window: u32,
    /// A request that goes elsewhere waits for a server to come back
    /// ([`CallOptions::wait_for_ready`](crate::CallOptions::wait_for_ready)).
    wait_for_ready: bool,
    /// A request whose connection breaks before any answer may go again
    /// ([`CallOptions::idempotent`](crate::CallOptions::idempotent)).
    idempotent: bool,
    /// Items read since the last grant.
    read: u32,
    done: bool,
    trailer: Metadata,
    /// Kept while the stream lives (a balanced client's count of what is
    /// in flight on the replica it went to).
    _hold: Option<Box<dyn Send + Sync>>,
}

impl std::fmt::Debug for Streaming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streaming")
            .field("service", &self.client.service())
            .field("call_id", &self.id)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl Streaming {
    /// Sends request `out` over `conn` and opens its stream.
    pub(crate) fn open(
        client: Client,
        conn: Arc<Inner>,
        out: Outgoing,
        (window, wait_for_ready, idempotent): (u32, bool, bool),
    ) -> Result<Streaming, RpcError> {
        let id = conn.next_id();
        let (mut req, lent, deadline, _) = out.into_frame(id);
        req.flags |= FLAG_STREAM;
        let mut st = Streaming {
            client,
            conn,
            id,
            request: Some(req),
            lent: Some(lent),
            deadline,
            window,
            wait_for_ready,
            idempotent,
            read: 0,
            done: false,
            trailer: Metadata::new(),
            _hold: None,
        };
        match st.launch() {
            Ok(()) => Ok(st),
            Err(e) => Err(st.fail(e)),
        }
    }

    /// This stream, keeping `hold` until it is dropped.
    pub(crate) fn holding(mut self, hold: Box<dyn Send + Sync>) -> Self {
        self._hold = Some(hold);
        self
    }

    /// The metadata of the answer that ended the stream (empty before the
    /// end, and if the handler set none).
    pub fn metadata(&self) -> &Metadata {
        &self.trailer
    }

    /// Whether the stream has ended (well or not).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Ends the stream here: what it lent is released, and with `cancel`
    /// its server is told.
    fn end(&mut self, cancel: bool) {
        self.done = true;
        self.conn.close_stream(self.id, cancel);
        if let Some(lent) = self.lent.take() {
            lent.release(self.conn.node());
        }
    }

    /// Ends the stream with `e` (a failure of the connection makes the
    /// client look whether its service moved).
    fn fail(&mut self, e: RpcError) -> RpcError {
        let cancel = e.status != crate::Status::Unavailable;
        self.end(cancel);
        self.client.redial().settle_error(&self.conn, e)
    }

    /// Moves the request, known not to have run (refused by a server that
    /// was stopping, never taken by one that stopped, or never sent), to
    /// the server the client now connects to (waiting for one if the call
    /// waits for ready); false if there is none other, the request cannot
    /// go there as it is, or its deadline passed.
    fn move_on(&mut self, refused: bool) -> bool {
        let Some(req) = self.request.as_mut() else {
            return false;
        };
        let h = self.client.redial();
        if refused {
            h.refused(&self.conn);
        }
        let mut n = h.live();
        if self.wait_for_ready && n.is_spent() {
            match self.client.ready(n, self.deadline) {
                Ok(r) => n = r,
                Err(_) => return false,
            }
        }
        if Arc::ptr_eq(&n, &self.conn)
            || !n.carries(req, self.conn.refs())
            || self.deadline.is_some_and(|d| Instant::now() >= d)
        {
            return false;
        }
        self.conn.close_stream(self.id, false);
        req.call_id = n.next_id();
        self.id = req.call_id;
        self.conn = Arc::clone(&*n);
        true
    }

    /// Whether the request, on a connection that broke before any answer
    /// came, may go elsewhere: its server said it never took it, or the
    /// call may run twice.
    fn unrun(&self) -> bool {
        self.idempotent || self.conn.never_taken(self.id)
    }

    /// Sends the request and the first grant; again, to the next server,
    /// while the failure leaves the request unrun (three servers at most).
    fn launch(&mut self) -> Result<(), RpcError> {
        for attempt in 1.. {
            let Some(req) = &self.request else { break };
            let (e, sent) = match self.conn.start_stream(req, self.deadline, self.window) {
                Ok(()) => return Ok(()),
                Err(x) => x,
            };
            let unrun = !sent || self.unrun();
            if e.status != crate::Status::Unavailable
                || !unrun
                || attempt >= 3
                || !self.move_on(false)
            {
                return Err(e);
            }
        }
        Err(RpcError::internal("a stream without its request"))
    }

    /// The next item: `Ok(Some)`, `Ok(None)` at the end, or the error the
    /// stream ended with.
    fn step(&mut self) -> Result<Option<Payload>, RpcError> {
        loop {
            let f = match self.conn.stream_next(self.id, self.deadline) {
                Ok(f) => f,
                Err(e)
                    if e.status == crate::Status::Unavailable
                        && self.request.is_some()
                        && self.unrun()
                        && self.went_again(false)? =>
                {
                    continue
                }
                Err(e) => return Err(self.fail(e)),
            };
            if f.kind == Kind::Item {
                self.request = None;
                self.read += 1;
                if self.read >= (self.window / 2).max(1) {
                    let n = std::mem::take(&mut self.read);
                    if let Err(e) = self.conn.grant(self.id, n, self.deadline) {
                        orphan(self.conn.node(), f);
                        return Err(self.fail(e));
                    }
                }
                crate::stats::count(&f.payload, false);
                return Payload::from_response_body(f.payload, self.conn.node()).map(Some);
            }
            if f.flags & FLAG_REFUSED != 0 && self.went_again(true)? {
                continue;
            }
            // The answer that ends the stream (what the argument lent is
            // ended with it: an answer may pass the request's Ref back).
            let lent = self.lent.take().unwrap_or_default();
            self.end(false);
            return match answer(self.conn.node(), f, lent) {
                Ok(Reply { payload, metadata }) => {
                    self.trailer = metadata;
                    Ok((!payload.is_empty()).then_some(payload))
                }
                Err(e) => {
                    self.trailer = e.metadata.clone();
                    Err(self.client.redial().settle_error(&self.conn, e))
                }
            };
        }
    }

    /// Sends the request, known not to have run, to the next server
    /// ([`move_on`](Self::move_on), [`launch`](Self::launch)): true if it
    /// went, false if there is none to go to; the stream's end if sending
    /// it there failed.
    fn went_again(&mut self, refused: bool) -> Result<bool, RpcError> {
        if !self.move_on(refused) {
            return Ok(false);
        }
        match self.launch() {
            Ok(()) => Ok(true),
            Err(e) => Err(self.fail(e)),
        }
    }
}

impl Iterator for Streaming {
    type Item = Result<Payload, RpcError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        self.step().transpose()
    }
}

impl Drop for Streaming {
    fn drop(&mut self) {
        if !self.done {
            self.end(true);
        }
    }
}

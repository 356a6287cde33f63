//! The server's end of a stream: the sink a streaming handler sends its
//! items into, and what it reads from its server's connections meanwhile.

use crate::error::RpcError;
use crate::frame::{Frame, Kind};
use crate::node::Node;
use crate::payload::{Dir, Payload};
use crate::server::{take_in, Pending, Stats};
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

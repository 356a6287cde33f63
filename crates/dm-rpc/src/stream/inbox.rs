//! The server's end of the items a caller sends (frames v9): what the
//! dispatcher takes in for a call in progress, and what its handler reads
//! from an [`AsyncInbox`] (an async handler) or an [`Inbox`] (a blocking
//! one, which reads its server's connections itself meanwhile).

use crate::call::attempt::orphan;
use crate::error::RpcError;
use crate::frame::{Frame, Status, FLAG_LAST};
use crate::node::Node;
use crate::payload::Payload;
use crate::transport::{ConnId, Listener};
use std::collections::VecDeque;
use std::sync::Mutex;
use std::task::{Poll, Waker};

/// Items a handler takes from its caller at once: the caller sends no
/// more before the handler reads half of them.
pub(crate) const WINDOW: u32 = super::DEFAULT_WINDOW;

/// What a call's caller sent and its handler has not read, shared by the
/// dispatcher (which takes the items in and sends the grants) and the
/// handler's [`AsyncInbox`].
pub(crate) struct Inlet {
    /// The call's connection and id.
    pub(crate) conn: ConnId,
    pub(crate) id: u64,
    /// The dispatcher's thread: a read elsewhere pokes it to send grants.
    home: std::thread::ThreadId,
    state: Mutex<Held>,
}

struct Held {
    /// The items and their grants (the dispatcher sends those owed, as
    /// the connection has room).
    t: Taking,
    /// How the items ended early: every read from then on gives it.
    ended: Option<Ended>,
    waker: Option<Waker>,
}

/// How a call's items ended early.
enum Ended {
    /// The call is over: its error is made only if something reads on
    /// (most calls' items end so, and nobody reads them again).
    CallOver,
    /// With this error.
    Error(RpcError),
}

impl Ended {
    fn error(&self) -> RpcError {
        match self {
            Ended::CallOver => RpcError::unavailable("the call has ended"),
            Ended::Error(e) => e.clone(),
        }
    }
}

impl Inlet {
    /// The inlet of call `id` of `conn`: with the first grant owed if
    /// its caller sends `items`, else ended already (a call made without
    /// items).
    pub(crate) fn new(conn: ConnId, id: u64, items: bool) -> Self {
        Inlet {
            conn,
            id,
            home: std::thread::current().id(),
            state: Mutex::new(Held {
                t: Taking::new(items),
                ended: None,
                waker: None,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        crate::sync::lock(&self.state)
    }

    /// Whether its items ended cleanly and every one was read.
    fn is_done(&self) -> bool {
        let h = self.lock();
        h.t.finished && h.t.items.is_empty() && h.ended.is_none()
    }

    /// Takes item `f` of the caller in: queued for the handler, or the
    /// end of the items. An item beyond what was granted ends the items
    /// with `ResourceExhausted` (the caller broke the flow control); one
    /// after the end, or after they ended, is released.
    pub(crate) fn take(&self, node: &Node, f: Frame) {
        let mut h = self.lock();
        if h.ended.is_some() {
            drop(h);
            orphan(node, f);
            return;
        }
        if let Some(f) = h.t.take(f) {
            let left = if h.t.overflow {
                Self::end_locked(&mut h, Ended::Error(overflowed()))
            } else {
                VecDeque::new()
            };
            drop(h);
            orphan(node, f);
            release(node, left);
            return;
        }
        if let Some(w) = h.waker.take() {
            drop(h);
            w.wake();
        }
    }

    /// Whether grants wait to be sent.
    pub(crate) fn owes(&self) -> bool {
        self.lock().t.owed > 0
    }

    /// Sends the grants owed, if the connection has room for them; a
    /// connection that fails ends the items (its caller is gone).
    pub(crate) fn flush(&self, node: &Node, listener: &mut dyn Listener) {
        let mut h = self.lock();
        if h.t.owed == 0 || h.ended.is_some() {
            return;
        }
        match listener.send_item(self.conn, &Frame::credit(self.id, h.t.owed)) {
            Ok(true) => h.t.owed = 0,
            Ok(false) => {}
            Err(e) => {
                let e = RpcError::unavailable(format!("the call's caller is gone: {e}"));
                let left = Self::end_locked(&mut h, Ended::Error(e));
                drop(h);
                release(node, left);
            }
        }
    }

    /// Ends the items early with `e` (if they have not ended): what is
    /// held is released, and a waiting read is woken to fail.
    pub(crate) fn end(&self, node: &Node, e: RpcError) {
        self.end_with(node, Ended::Error(e));
    }

    /// Ends the items because their call is over: as [`end`](Self::end)
    /// with `Unavailable`, made only if a read comes.
    pub(crate) fn end_call(&self, node: &Node) {
        self.end_with(node, Ended::CallOver);
    }

    fn end_with(&self, node: &Node, e: Ended) {
        let mut h = self.lock();
        if h.ended.is_some() {
            return;
        }
        let left = Self::end_locked(&mut h, e);
        let w = h.waker.take();
        drop(h);
        release(node, left);
        if let Some(w) = w {
            w.wake();
        }
    }

    fn end_locked(h: &mut Held, e: Ended) -> VecDeque<Frame> {
        h.ended = Some(e);
        std::mem::take(&mut h.t.items)
    }

    /// The next item, as its handler reads it: a grant is owed once half
    /// the window is read.
    fn poll_next(&self, cx: &mut std::task::Context<'_>) -> Poll<Option<Result<Frame, RpcError>>> {
        let mut h = self.lock();
        if let Some(f) = h.t.pop() {
            return Poll::Ready(Some(Ok(f)));
        }
        if let Some(e) = &h.ended {
            return Poll::Ready(Some(Err(e.error())));
        }
        if h.t.finished {
            return Poll::Ready(None);
        }
        match &mut h.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            w => *w = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

/// How a caller's items end when it sends more than it was granted.
fn overflowed() -> RpcError {
    RpcError::new(
        Status::ResourceExhausted,
        "the caller sent more items than the server granted",
    )
}

/// Releases what items carried.
fn release(node: &Node, items: VecDeque<Frame>) {
    for f in items {
        orphan(node, f);
    }
}

/// Where an async handler reads the items its caller sends
/// ([`ServerBuilder::method_bidi_async`](crate::ServerBuilder::method_bidi_async)).
/// Owned, so the handler's future holds it across awaits (or moves it
/// into a task it spawns).
pub struct AsyncInbox {
    /// None for a call whose caller sends no items (its items ended
    /// with the request): nothing to queue, grant or end.
    inlet: Option<std::sync::Arc<Inlet>>,
    node: Node,
    /// Pokes the dispatcher (an inbox read off its thread), to send the
    /// grants the read owes.
    poke: crate::transport::Waker,
    read: u64,
}

impl std::fmt::Debug for AsyncInbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncInbox")
            .field("call_id", &self.inlet.as_ref().map(|i| i.id))
            .field("read", &self.read)
            .finish_non_exhaustive()
    }
}

impl AsyncInbox {
    pub(crate) fn new(
        inlet: Option<std::sync::Arc<Inlet>>,
        node: Node,
        poke: crate::transport::Waker,
    ) -> Self {
        AsyncInbox {
            inlet,
            node,
            poke,
            read: 0,
        }
    }

    /// Items read so far.
    pub fn read(&self) -> u64 {
        self.read
    }

    /// Whether every item the caller will send was read: its items ended
    /// (at once for a call made without any), and none is waiting.
    /// [`next`](Self::next) then gives `None`.
    pub fn is_done(&self) -> bool {
        self.inlet.as_ref().is_none_or(|i| i.is_done())
    }

    /// The caller's next item: `Some(Ok)`, `None` once the caller ended
    /// its items (also at once for a call made without any), or
    /// `Some(Err)` if they ended early: `Unavailable` (the caller is
    /// gone, the server stopping) or `ResourceExhausted` (the caller sent
    /// more than it was granted). Items travel inline or as Refs made for
    /// this server, which the payload releases when it is dropped.
    pub async fn next(&mut self) -> Option<Result<Payload, RpcError>> {
        let inlet = self.inlet.as_ref()?;
        let f = match std::future::poll_fn(|cx| inlet.poll_next(cx)).await? {
            Ok(f) => f,
            Err(e) => return Some(Err(e)),
        };
        self.read += 1;
        if std::thread::current().id() != inlet.home && inlet.owes() {
            self.poke.wake();
        }
        crate::stats::count(&f.payload, false);
        Some(Payload::from_response_body(f.payload, &self.node))
    }
}

/// A call's items from its caller and their grants: what the async
/// handler's [`Inlet`] and the blocking handler's feed ([`super::Feed`],
/// read by its [`Inbox`]) both keep.
pub(crate) struct Taking {
    items: VecDeque<Frame>,
    granted: u64,
    received: u64,
    read: u32,
    /// Grants to send.
    owed: u32,
    finished: bool,
    /// The caller sent beyond its grant.
    overflow: bool,
    /// Items not to be read (after the end, or beyond the grant), to
    /// release.
    spill: Vec<Frame>,
}

impl Taking {
    /// The items of a call, with the first grant owed if its caller sends
    /// `items`, else ended already.
    pub(crate) fn new(items: bool) -> Taking {
        let window = if items { WINDOW } else { 0 };
        Taking {
            items: VecDeque::new(),
            granted: u64::from(window),
            received: 0,
            read: 0,
            owed: window,
            finished: !items,
            overflow: false,
            spill: Vec::new(),
        }
    }

    /// Takes item `f` of the caller in: queued, or the end of the items.
    /// One after the end, or beyond what was granted (which sets
    /// `overflow`: the caller broke the flow control), is given back, to
    /// be released.
    pub(crate) fn take(&mut self, f: Frame) -> Option<Frame> {
        if self.finished || self.overflow {
            return Some(f);
        }
        if f.flags & FLAG_LAST != 0 {
            self.finished = true;
        } else if self.received >= self.granted {
            self.overflow = true;
            return Some(f);
        } else {
            self.received += 1;
            self.items.push_back(f);
        }
        None
    }

    /// The next item as the handler reads it: a grant is owed once half
    /// the window is read.
    fn pop(&mut self) -> Option<Frame> {
        let f = self.items.pop_front()?;
        self.read += 1;
        if self.read >= (WINDOW / 2).max(1) && !self.finished {
            let n = std::mem::take(&mut self.read);
            self.owed += n;
            self.granted += u64::from(n);
        }
        Some(f)
    }

    /// Keeps `f`, given back by [`take`](Self::take), for release by the
    /// blocking handler's inbox (which has the node).
    pub(crate) fn spill(&mut self, f: Frame) {
        self.spill.push(f);
    }

    /// Releases what it holds (its call ended).
    pub(crate) fn release(self, node: &Node) {
        release(node, self.items);
        release(node, self.spill.into());
    }
}

/// Where a blocking handler reads the items its caller sends
/// ([`ServerBuilder::method_bidi`](crate::ServerBuilder::method_bidi)).
/// While it waits for one, it reads its server's connections, as its
/// [`Sink`](super::Sink) does.
pub struct Inbox<'a> {
    feed: &'a std::cell::RefCell<super::Feed<'a>>,
    node: &'a Node,
    stop: &'a std::sync::atomic::AtomicBool,
    deadline: Option<std::time::Instant>,
    read: u64,
}

impl std::fmt::Debug for Inbox<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("read", &self.read)
            .finish_non_exhaustive()
    }
}

impl<'a> Inbox<'a> {
    pub(crate) fn new(
        feed: &'a std::cell::RefCell<super::Feed<'a>>,
        node: &'a Node,
        stop: &'a std::sync::atomic::AtomicBool,
        deadline: Option<std::time::Instant>,
    ) -> Self {
        Inbox {
            feed,
            node,
            stop,
            deadline,
            read: 0,
        }
    }

    /// Items read so far.
    pub fn read(&self) -> u64 {
        self.read
    }
}

impl Iterator for Inbox<'_> {
    type Item = Result<Payload, RpcError>;

    /// The caller's next item, as [`AsyncInbox::next`] gives it; also
    /// `Cancelled` if the caller cancelled the call, `DeadlineExceeded`
    /// once its deadline passed.
    fn next(&mut self) -> Option<Self::Item> {
        let mut slice = std::time::Duration::from_millis(1);
        loop {
            let mut f = self.feed.borrow_mut();
            f.look();
            let id = f.call_id();
            let t = f.taking.as_mut()?;
            if !t.spill.is_empty() {
                let spilled: VecDeque<Frame> = std::mem::take(&mut t.spill).into();
                release(self.node, spilled);
            }
            if t.overflow {
                let left = std::mem::take(&mut t.items);
                drop(f);
                release(self.node, left);
                return Some(Err(overflowed()));
            }
            if let Some(item) = t.pop() {
                grant(&mut f, id);
                drop(f);
                self.read += 1;
                crate::stats::count(&item.payload, false);
                return Some(Payload::from_response_body(item.payload, self.node));
            }
            if t.finished {
                return None;
            }
            grant(&mut f, id);
            if f.cancelled() {
                return Some(Err(RpcError::new(
                    Status::Cancelled,
                    "the caller cancelled the call",
                )));
            }
            if self.stop.load(std::sync::atomic::Ordering::Acquire) {
                return Some(Err(RpcError::unavailable("the server is stopping")));
            }
            let now = std::time::Instant::now();
            if self.deadline.is_some_and(|d| now >= d) {
                return Some(Err(RpcError::deadline_exceeded(
                    "the call's deadline passed",
                )));
            }
            let until = self.deadline.map_or(now + slice, |d| d.min(now + slice));
            f.wait(until);
            let (l, conn) = f.listener();
            if !l.is_open(conn) {
                return Some(Err(RpcError::unavailable("the call's caller is gone")));
            }
            slice = (slice * 2).min(std::time::Duration::from_millis(50));
        }
    }
}

/// Sends the grants the feed's items owe, if its connection has room.
fn grant(f: &mut super::Feed<'_>, id: u64) {
    let owed = f.taking.as_ref().map_or(0, |t| t.owed);
    if owed == 0 {
        return;
    }
    let (l, conn) = f.listener();
    if let Ok(true) = l.send_item(conn, &Frame::credit(id, owed)) {
        if let Some(t) = f.taking.as_mut() {
            t.owed = 0;
        }
    }
}

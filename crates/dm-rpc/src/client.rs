//! Clients: calls to a service over one connection.
//!
//! A [`Client`] is cheap to clone and may be used by many threads at once:
//! each call sends its frame and waits for its answer. Whichever waiting
//! thread holds the receiving half reads answers and hands the others
//! theirs (leader/followers). A caller that finds the receiving half free
//! takes it before sending and reads its own answer, with no entry in the
//! waiting list, no thread hop and no look at the list when it lets the
//! half go unless someone waits ([`crate::handoff`]); callers that find it
//! taken list their call under its id as their request goes (the id is
//! drawn then: [`crate::sender`]) and wait to be handed their answer or to
//! take over reading. The caller holding the receiving half keeps reading while
//! it waits to send (for room, or for the sending half): a server takes a
//! request only when it has room to answer it, so answers left unread
//! there would stall every caller of the connection (found with eight
//! threads on one client over 4 KiB rings). A caller without the half that finds no room takes
//! the half if nobody holds it, and reads too: answers to calls that gave
//! up would otherwise stall it. A peer that dies fails every pending and
//! future call on the connection with `Unavailable`; the client replaces
//! the connection when a later call finds the service registered again
//! ([`crate::reconnect`]).

use crate::call::attempt::{
    answers, carried, deadline_of, ended, orphan, outgoing, outgoing_at, sent_as, Failure,
    Outgoing, Refused,
};
use crate::call::failover::{Failover, Link, Next};
use crate::call::options::{CallOptions, Reply};
use crate::choice::{Chooser, Way};
use crate::dial::Target;
use crate::error::RpcError;
use crate::frame::{Frame, Kind, Status};
use crate::handle::ClientOf;
use crate::handoff::{Half, Held};
use crate::metadata::Metadata;
use crate::node::Node;
use crate::payload::Payload;
use crate::reconnect::{Connected, Redial};
use crate::sender::{send_holding_rx, send_unheld, Out, Sender};
use crate::sync::lock;
use crate::transport::{Connection, FrameRx};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A client of one service: calls wait for their answers on the calling
/// thread. Cheap to clone; clones share the connection. Its connection is
/// replaced when it breaks and the service is registered again
/// ([`crate::reconnect`]). What every client has (its options, its
/// interceptors) is [`ClientOf`]'s.
pub type Client = ClientOf<BlockingConn>;

/// One connection of a [`Client`].
pub struct BlockingConn {
    node: Node,
    name: String,
    tx: Mutex<Sender>,
    /// The receiving half: whoever holds it reads the answers of all
    /// ([`crate::handoff`]: its count of waiters is `state`'s).
    rx: Half<Box<dyn FrameRx>>,
    state: Mutex<State>,
    /// `state.broken` is set (read without the lock by a lone caller).
    broken: AtomicBool,
    /// New calls go elsewhere ([`Connected::retire`]).
    retired: AtomicBool,
    cv: Condvar,
    max_inline: usize,
    refs: crate::transport::Sharing,
    goaway: Arc<dyn crate::transport::GoAway>,
    /// Inline or by memory-server Ref, learned ([`crate::RemoteChoice`]),
    /// with the node's other clients of this service.
    choice: Arc<Chooser>,
}

impl std::fmt::Debug for BlockingConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockingConn")
            .field("service", &self.name)
            .finish_non_exhaustive()
    }
}

/// Calls waiting for answers (a short list: one entry per concurrent
/// caller, so a scan beats hashing), and the error that broke the
/// connection, if any.
#[derive(Default)]
struct State {
    waiting: Vec<(u64, Option<Frame>)>,
    /// Streams open on the connection ([`Client::call_stream`]), each with
    /// what arrived for it and is not read yet: items, then the answer
    /// that ends it (bounded by its window).
    streams: Vec<(u64, Incoming)>,
    broken: Option<RpcError>,
    /// Callers asleep on the condition variable: it is notified only if
    /// there are any (a notification is a `futex` system call).
    sleepers: usize,
}

impl State {
    fn slot(&mut self, id: u64) -> Option<&mut Option<Frame>> {
        self.waiting
            .iter_mut()
            .find(|(i, _)| *i == id)
            .map(|(_, f)| f)
    }

    fn remove(&mut self, id: u64) -> Option<Frame> {
        let k = self.waiting.iter().position(|(i, _)| *i == id)?;
        self.waiting.swap_remove(k).1
    }

    fn stream(&mut self, id: u64) -> Option<&mut Incoming> {
        self.streams
            .iter_mut()
            .find(|(i, _)| *i == id)
            .map(|(_, q)| q)
    }

    /// How many callers wait for something to arrive.
    fn waiters(&self) -> usize {
        self.waiting.len() + self.streams.len()
    }

    /// Whether any caller waits for something to arrive.
    fn anyone_waits(&self) -> bool {
        self.waiters() != 0
    }
}

/// What came for an open stream and is not read yet.
#[derive(Default)]
struct Incoming {
    /// Items, then the answer that ends it.
    frames: VecDeque<Frame>,
    /// Grants of the caller's own items, not yet used.
    credit: u64,
    /// The answer came: the server takes no more items.
    answered: bool,
}

/// Lists a call under `new`, the id its request goes with: moves what
/// `list` holds for it from `old` (its id at an earlier try:
/// [`crate::sender`]), or, on its first try (`old` 0), adds it with
/// `fresh` (true then).
fn list_under<T>(list: &mut Vec<(u64, T)>, old: u64, new: u64, fresh: impl FnOnce() -> T) -> bool {
    match list.iter_mut().find(|(k, _)| *k == old) {
        Some((k, _)) if old != 0 => {
            *k = new;
            false
        }
        _ => {
            list.push((new, fresh()));
            true
        }
    }
}

impl Connected for BlockingConn {
    fn open(node: Node, name: &str, conn: Connection) -> BlockingConn {
        let choice = node.choices.of(name);
        BlockingConn {
            node,
            name: name.to_owned(),
            tx: Mutex::new(Sender::new(conn.tx)),
            rx: Half::new(conn.rx),
            state: Mutex::new(State::default()),
            broken: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            cv: Condvar::new(),
            max_inline: conn.max_inline,
            refs: conn.refs,
            goaway: conn.goaway,
            choice,
        }
    }

    #[inline]
    fn is_spent(&self) -> bool {
        self.broken.load(Ordering::Acquire) || self.retired.load(Ordering::Acquire)
    }

    fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }

    fn break_with(&self, e: RpcError) {
        self.fail(e);
    }

    fn failure(&self) -> Option<RpcError> {
        if !self.broken.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.state).broken.clone()
    }

    const CLIENT: &'static str = "Client";

    fn link(&self) -> Link {
        Link {
            spent: self.is_spent(),
            refs: self.refs,
            max_inline: self.max_inline,
        }
    }
}

impl Client {
    /// Calls `method` with `payload` and waits for the answer.
    pub fn call(&self, method: &str, payload: impl Into<Payload>) -> Result<Payload, RpcError> {
        self.call_with(method, payload.into(), CallOptions::default())
    }

    /// Calls `method` with a copy of `data`, made once: a large argument
    /// is written straight into the pool (`call(method, data)` copies it
    /// into a vector first).
    pub fn call_slice(&self, method: &str, data: &[u8]) -> Result<Payload, RpcError> {
        match self.payload_for(data) {
            Ok(p) => self.call_with(method, p, CallOptions::default()),
            // (A copy that failed ends the call: its answer interceptors see it.)
            Err(e) => self.defaults.answered(method, Err(e)).map(|r| r.payload),
        }
    }

    /// A copy of `data` as this client's calls send it (inline, or written
    /// into the pool when it will travel by Ref).
    pub(crate) fn payload_for(&self, data: &[u8]) -> Result<Payload, RpcError> {
        let i = self.h.live();
        Payload::copy_for(&i.node, i.max_inline, i.refs, data)
    }

    /// Calls streaming method `method` with `payload`: its answer is a
    /// stream of items, read as they come from the [`Streaming`](crate::stream::Streaming)
    /// (an iterator). See [`crate::stream`].
    pub fn call_stream(
        &self,
        method: &str,
        payload: impl Into<Payload>,
    ) -> Result<crate::stream::Streaming, RpcError> {
        self.call_stream_with(
            method,
            payload.into(),
            CallOptions::default(),
            Metadata::new(),
        )
    }

    /// Calls streaming method `method` with options (the deadline bounds
    /// the whole stream; [`CallOptions::window`] is how many items it
    /// holds unread at most) and metadata. The request is sent and the
    /// stream open when this returns; what the server answers comes
    /// through the stream, its errors included.
    pub fn call_stream_with(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Result<crate::stream::Streaming, RpcError> {
        let (opts, meta) = self.defaults.apply(method, &payload, opts, meta)?;
        let (c, opts) = self.usable(opts)?;
        let out = outgoing(&c.node, c.max_inline, c.refs, method, payload, opts, meta)?;
        let how = crate::stream::How::of(opts, &out);
        crate::stream::Streaming::open(self.h.clone(), Arc::clone(&*c), method, out, how)
    }

    /// Calls method `method` with `payload` and a stream of items the
    /// caller sends after it, as [`AsyncClient::call_bidi`](crate::AsyncClient::call_bidi)
    /// does, blocking.
    pub fn call_bidi(
        &self,
        method: &str,
        payload: impl Into<Payload>,
    ) -> Result<crate::stream::Bidi, RpcError> {
        self.call_bidi_with(
            method,
            payload.into(),
            CallOptions::default(),
            Metadata::new(),
        )
    }

    /// [`call_bidi`](Self::call_bidi) with options and metadata
    /// ([`AsyncClient::call_bidi_with`](crate::AsyncClient::call_bidi_with)).
    pub fn call_bidi_with(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Result<crate::stream::Bidi, RpcError> {
        let (opts, meta) = self.defaults.apply(method, &payload, opts, meta)?;
        let (c, opts) = self.usable(opts)?;
        let out = outgoing(&c.node, c.max_inline, c.refs, method, payload, opts, meta)?;
        let how = crate::stream::How::of(opts, &out);
        crate::stream::Bidi::open(self.h.clone(), Arc::clone(&*c), method, out, how)
    }

    /// Calls `method` with options.
    pub fn call_with(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
    ) -> Result<Payload, RpcError> {
        self.call_with_metadata(method, payload, opts, Metadata::new())
    }

    /// Calls `method` with options and metadata, which the handler reads
    /// ([`Call::metadata`](crate::server::Call::metadata)).
    pub fn call_with_metadata(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Result<Payload, RpcError> {
        self.call_full(method, payload, opts, meta)
            .map(|r| r.payload)
    }

    /// Calls `method` with options and metadata, and returns the answer
    /// with the metadata its handler set (on a failure, the error carries
    /// it: [`RpcError::metadata`]).
    pub fn call_full(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Result<Reply, RpcError> {
        let r = self.call_intercepted(method, payload, opts, meta);
        self.defaults.answered(method, r)
    }

    /// [`call_full`](Self::call_full) before the answer interceptors.
    #[inline]
    fn call_intercepted(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Result<Reply, RpcError> {
        let (opts, meta) = self.defaults.apply(method, &payload, opts, meta)?;
        let (c, opts) = self.usable(opts)?;
        let r = c.call_with(method, payload, opts, meta);
        match r {
            Err(Failure::Refused(_) | Failure::Again(_)) => self.again(c, r, opts),
            r => self.h.settle(&c, r),
        }
    }

    /// The connection a call with `opts` goes over, and its options then:
    /// the current one, or, if it is broken or retired with nothing new to
    /// dial, the one a call that waits for ready waits for; else the
    /// failure (the argument is not even placed).
    #[inline]
    fn usable(
        &self,
        mut opts: CallOptions,
    ) -> Result<(arc_swap::Guard<Arc<BlockingConn>>, CallOptions), RpcError> {
        let mut c = self.h.live();
        if c.is_spent() {
            if opts.wait_for_ready {
                let until = deadline_of(&c.node, opts, Instant::now()).0;
                c = self.h.ready(c, until)?;
                opts = opts.after_waiting(until);
            }
            if let Some(e) = c.failure() {
                return Err(e);
            }
        }
        Ok((c, opts))
    }

    /// Where a call whose request may go again (`r`: refused, or answered
    /// with a status its retry policy lists) on connection `c` ends: what
    /// [`Failover`] decides, done on this thread.
    #[cold]
    #[inline(never)]
    fn again(
        &self,
        mut c: arc_swap::Guard<Arc<BlockingConn>>,
        mut r: Result<Reply, Failure>,
        opts: CallOptions,
    ) -> Result<Reply, RpcError> {
        let mut f = Failover::new(&opts);
        loop {
            let x = match f.next(r, Instant::now()) {
                Next::End(r) => return self.h.settle(&c, r),
                Next::GiveUp(x) => return Err(x.fail(&c.node)),
                Next::Elsewhere(x) => {
                    self.h.refused(&c);
                    let mut n = self.h.live();
                    if f.waits_for(n.link()) {
                        match self.h.ready(n, x.deadline()) {
                            Ok(ready) => n = ready,
                            Err(e) => return Err(x.drop_with(&c.node, e)),
                        }
                    }
                    if !f.takes(&x, n.link(), Arc::ptr_eq(&n, &c)) {
                        return Err(x.fail(&c.node));
                    }
                    c = n;
                    x
                }
                Next::Later(x, wait) => {
                    std::thread::sleep(wait);
                    let n = self.h.live();
                    if !f.takes(&x, n.link(), false) {
                        return Err(x.fail(&c.node));
                    }
                    c = n;
                    x
                }
            };
            r = c.resend(*x);
        }
    }
}

impl BlockingConn {
    fn call_with(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Result<Reply, Failure> {
        let (node, refs) = (&self.node, self.refs);
        let Some((k, way)) = self.learned(method, &payload) else {
            let out = outgoing(node, self.max_inline, refs, method, payload, opts, meta)?;
            return self.send_and_wait(out);
        };
        let mut meta = meta;
        if way == Way::Inline {
            meta.insert(crate::choice::WAY_KEY, crate::choice::WAY_INLINE)
                .map_err(|e| RpcError::internal(e.to_string()))?;
        }
        // Inline: as to a peer that shares nothing. By Ref: whatever the
        // size.
        let (refs, threshold) = match way {
            Way::Inline => (
                crate::transport::Sharing {
                    remote: false,
                    ..refs
                },
                usize::MAX,
            ),
            Way::ByRef => (refs, 0),
        };
        let t = Instant::now();
        let limits = (self.max_inline, threshold);
        let out = outgoing_at(node, limits, refs, method, payload, opts, meta)?;
        let r = self.send_and_wait(out);
        if let (Ok(_), Some(k)) = (&r, k) {
            let ns = t.elapsed().as_nanos() as f64;
            self.choice.record(method, k, way, ns);
        }
        r
    }

    /// The size class and the way chosen for `payload`, if its way is
    /// learned ([`crate::RemoteChoice::Measured`]): bytes of a size that
    /// may go either way, to a peer in another pool that uses the same
    /// memory servers. No class (nothing to record) when serving a call
    /// a learner sent inline: inline too, for the learner measures the
    /// whole way (`choice`).
    fn learned(&self, method: &str, payload: &Payload) -> Option<(Option<usize>, Way)> {
        let cfg = &self.node.cfg;
        #[cfg(feature = "memserver")]
        let remote = self.node.remote.is_some();
        #[cfg(not(feature = "memserver"))]
        let remote = false;
        let len = payload.len();
        let open = remote
            && cfg.remote_choice == crate::RemoteChoice::Measured
            && !cfg.by_value
            && self.refs.remote
            && !self.refs.pool
            && payload.is_plain_bytes()
            && len >= crate::choice::MIN_LEARNED
            && len <= self.max_inline as u64;
        open.then(|| {
            if crate::metadata::follows_inline() {
                (None, Way::Inline)
            } else {
                let (k, way) = self.choice.choose(method, len);
                (Some(k), way)
            }
        })
    }

    /// Sends again, on this connection, a request another refused.
    fn resend(&self, r: Refused) -> Result<Reply, Failure> {
        let req = r.left(&self.node, &self.name)?;
        self.send_and_wait(req)
    }

    /// Sends a request and waits for its answer. An idempotent one is
    /// treated as not run if the connection breaks before its answer.
    fn send_and_wait(&self, out: Outgoing) -> Result<Reply, Failure> {
        let i = self;
        let (mut frame, lent, deadline, again) = out.into_frame();
        if let Some(e) = i.failure() {
            // A broken connection sends nothing: the request goes to the
            // service's next server if there is one (it did not run),
            // else fails at once.
            return Err(Failure::not_run(frame, e, lent, deadline, i.refs, again));
        }
        // Nobody reading answers: read our own (taken before sending, so
        // no one else can take our answer). Else the call is listed under
        // its id as it goes, before its answer can come, and counted
        // before it first looks for the reading half.
        let mut reader = i.rx.try_take();
        let mut enlist = |old: u64, new: u64| i.enlist(false, old, new);
        let out = match reader {
            Some(_) => Out::Own(&mut frame),
            None => Out::Listed(&mut frame, &mut enlist),
        };
        // Reading answers while it waits for room (see `send_reading`).
        let sent = self.send_reading(out, deadline, reader.as_mut());
        let id = frame.call_id;
        // (The error, and whether the connection broke: then the request
        // was not sent, and may go elsewhere.)
        if let Err((e, broke)) = self.sent(sent) {
            match reader {
                Some(rx) => self.hand_over(rx),
                None => {
                    self.forget(id);
                }
            }
            if broke {
                return Err(Failure::not_run(frame, e, lent, deadline, i.refs, again));
            }
            lent.release(&i.node);
            return Err(e.into());
        }
        let got = match reader {
            Some(rx) => self.read_own(rx, id, deadline),
            None => self.wait_for(id, deadline),
        };
        let f = match got {
            Ok(f) => f,
            Err(e) if e.status == Status::Unavailable && self.may_resend(id, again.idempotent) => {
                // Its server stopped without taking it, or it may run twice.
                return Err(Failure::not_run(frame, e, lent, deadline, i.refs, again));
            }
            Err(e) => {
                lent.release(&i.node);
                if e.status == Status::DeadlineExceeded {
                    lock(&i.tx).cancel(id);
                }
                return Err(e.into());
            }
        };
        ended(&i.node, frame, f, (lent, deadline, i.refs, again))
    }

    /// Whether the request `id`, whose call failed with `Unavailable`, may
    /// be sent again: its server said it never took it, or the connection
    /// broke and the call may run twice.
    #[cold]
    fn may_resend(&self, id: u64, idempotent: bool) -> bool {
        self.goaway.unread(id) || (idempotent && self.broken.load(Ordering::Acquire))
    }

    /// Marks the connection broken (every pending and future call fails).
    fn fail(&self, e: RpcError) -> RpcError {
        let mut st = lock(&self.state);
        self.broken(&mut st, e)
    }

    /// Marks the connection broken, under the state lock; the error every
    /// call now gets.
    fn broken(&self, st: &mut State, e: RpcError) -> RpcError {
        let e = st.broken.get_or_insert(e).clone();
        self.broken.store(true, Ordering::Release);
        self.notify(st);
        e
    }

    /// Hands `f`, read for another caller, to it and wakes the callers
    /// asleep (see [`deliver`](Self::deliver)).
    fn pass_on(&self, f: Frame) {
        let mut st = lock(&self.state);
        self.deliver(&mut st, f);
        self.notify(&st);
    }

    /// Gives an answer read for another caller to it (or releases what it
    /// carries if that caller gave up).
    fn deliver(&self, st: &mut State, f: Frame) {
        if f.kind == Kind::Credit {
            // A grant of the caller's own items (one for nothing open
            // carries nothing to release).
            if let Some(q) = st.stream(f.call_id) {
                q.credit += u64::from(f.method);
            }
            return;
        }
        if f.kind == Kind::Response {
            if let Some(slot) = st.slot(f.call_id) {
                *slot = Some(f);
                return;
            }
        }
        match st.stream(f.call_id) {
            Some(q) => {
                q.answered |= f.kind == Kind::Response;
                q.frames.push_back(f);
            }
            None => orphan(&self.node, f),
        }
    }

    /// Sends `f`, as the holder of the receiving half `rx`
    /// ([`send_holding_rx`]) or as a caller without it ([`send_unheld`]):
    /// the answers read meanwhile go to their callers.
    fn send_reading(
        &self,
        f: Out<'_>,
        deadline: Option<Instant>,
        rx: Option<&mut Held<'_, Box<dyn FrameRx>>>,
    ) -> Result<bool, crate::transport::TransportError> {
        let i = self;
        let mut stray = false;
        let mut got = |a: Frame| {
            if !answers(a.kind) {
                stray = true;
                return;
            }
            self.pass_on(a);
        };
        let yield_for = i.node.cfg.wait.yield_for;
        let sent = match rx {
            Some(rx) => send_holding_rx(&i.tx, f, deadline, rx, yield_for, &mut got),
            None => send_unheld(&i.tx, f, || i.rx.try_take(), deadline, yield_for, &mut got),
        };
        if stray {
            return Err(crate::transport::TransportError::Protocol(
                "the server sent a frame that is not a response".into(),
            ));
        }
        sent
    }

    /// The lone caller's wait: reads answers until its own, handing the
    /// others theirs, then lets a waiting caller take over reading.
    fn read_own(
        &self,
        mut rx: Held<'_, Box<dyn FrameRx>>,
        id: u64,
        deadline: Option<Instant>,
    ) -> Result<Frame, RpcError> {
        let i = self;
        let r = loop {
            match rx.recv(deadline) {
                Ok(Some(f)) if answers(f.kind) => {
                    if f.call_id == id && f.kind == Kind::Response {
                        break Ok(f);
                    }
                    self.pass_on(f);
                }
                Ok(Some(_)) => {
                    let e = RpcError::internal("the server sent a frame that is not a response");
                    break Err(self.fail(e));
                }
                Ok(None) => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        break Err(RpcError::deadline_exceeded(format!(
                            "no answer from {:?} before the deadline",
                            i.name
                        )));
                    }
                }
                Err(e) => break Err(self.fail(e.into())),
            }
        };
        self.hand_over(rx);
        r
    }

    /// Gives up the receiving half: a caller waiting for its answer while
    /// it was taken is woken to take over reading ([`crate::handoff`]: it
    /// looks for the half with the state lock held and then waits on the
    /// condvar, which releases the lock, so taking the lock after letting
    /// the half go cannot fall between the two). A lone caller takes no
    /// lock here.
    fn hand_over(&self, rx: Held<'_, Box<dyn FrameRx>>) {
        if rx.hand_over() {
            let st = lock(&self.state);
            self.notify(&st);
        }
    }

    /// Lists a call (a stream's, with `stream`) under `new`, the id its
    /// request goes with, before its answer can come ([`Out::Listed`]):
    /// moved from `old`, or, on its first try, counted as a waiter before
    /// it first looks for the reading half.
    fn enlist(&self, stream: bool, old: u64, new: u64) {
        let mut st = lock(&self.state);
        let added = if stream {
            list_under(&mut st.streams, old, new, Incoming::default)
        } else {
            list_under(&mut st.waiting, old, new, || None)
        };
        if added {
            self.rx.set_waiting(st.waiters());
        }
    }

    /// Takes call `id` off the waiting list, with what arrived for it.
    fn forget(&self, id: u64) -> Option<Frame> {
        let mut st = lock(&self.state);
        let f = st.remove(id);
        self.rx.set_waiting(st.waiters());
        f
    }

    /// Wakes the callers asleep on the condition variable, if any.
    fn notify(&self, st: &State) {
        if st.sleepers > 0 {
            self.cv.notify_all();
        }
    }

    fn wait_for(&self, id: u64, deadline: Option<Instant>) -> Result<Frame, RpcError> {
        let take = |st: &mut State| match st.slot(id) {
            Some(Some(_)) => {
                let f = st.remove(id);
                self.rx.set_waiting(st.waiters());
                f
            }
            _ => None,
        };
        let r = self.wait_until(id, deadline, take);
        if r.is_err() {
            // (An answer that came meanwhile is released.)
            if let Some(f) = self.forget(id) {
                orphan(&self.node, f);
            }
        }
        r
    }

    /// The next frame of stream `id`: an item, or the answer that ends it.
    pub(crate) fn stream_next(
        &self,
        id: u64,
        deadline: Option<Instant>,
    ) -> Result<Frame, RpcError> {
        self.wait_until(id, deadline, |st| {
            st.stream(id).and_then(|q| q.frames.pop_front())
        })
    }

    /// Takes one grant for an item the caller of stream `id` sends,
    /// waiting for one: `Ok(false)` once the stream's answer came or it
    /// was closed (the server takes no more).
    pub(crate) fn item_credit(&self, id: u64, deadline: Option<Instant>) -> Result<bool, RpcError> {
        self.wait_until(id, deadline, |st| match st.stream(id) {
            None => Some(false),
            Some(q) if q.answered => Some(false),
            Some(q) if q.credit > 0 => {
                q.credit -= 1;
                Some(true)
            }
            Some(_) => None,
        })
    }

    /// Reads what is already there on the connection, if nobody else
    /// reads, handing each answer to its caller.
    fn read_rest(&self) {
        if let Some(mut rx) = self.rx.try_take() {
            let mut got = |f: Frame| {
                if answers(f.kind) {
                    self.pass_on(f);
                }
            };
            let _ = crate::transport::drain(&mut **rx, &mut got);
        }
    }

    /// What a send's outcome `r` means for its call ([`sent_as`]).
    fn sent(
        &self,
        r: Result<bool, crate::transport::TransportError>,
    ) -> Result<(), (RpcError, bool)> {
        sent_as(&self.name, r, |e| self.fail(e.into()))
    }

    /// Waits until `take` gives a frame (it looks in the state for what
    /// arrived for call `id`), reading frames when nobody else does and
    /// handing each to its caller, or until the connection breaks or
    /// `deadline` passes.
    fn wait_until<T>(
        &self,
        id: u64,
        deadline: Option<Instant>,
        mut take: impl FnMut(&mut State) -> Option<T>,
    ) -> Result<T, RpcError> {
        let i = self;
        let yielding = Instant::now();
        let mut st = lock(&i.state);
        let mut read_rest = false;
        loop {
            if let Some(f) = take(&mut st) {
                if st.anyone_waits() {
                    // Someone else may need to take over reading.
                    self.notify(&st);
                }
                return Ok(f);
            }
            if let Some(e) = &st.broken {
                if !std::mem::replace(&mut read_rest, true) {
                    // (What arrived before it broke, another caller's send
                    // failing, is still delivered.)
                    drop(st);
                    self.read_rest();
                    st = lock(&i.state);
                    continue;
                }
                return Err(e.clone());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(RpcError::deadline_exceeded(format!(
                    "no answer from {:?} before the deadline",
                    i.name
                )));
            }
            if let Some(mut rx) = i.rx.try_take() {
                drop(st);
                let got = rx.recv(deadline);
                st = lock(&i.state);
                drop(rx);
                match got {
                    Ok(Some(f)) if answers(f.kind) => {
                        let mine = f.call_id == id;
                        self.deliver(&mut st, f);
                        if !mine {
                            self.notify(&st);
                        }
                    }
                    Ok(Some(_)) => {
                        let e =
                            RpcError::internal("the server sent a frame that is not a response");
                        self.broken(&mut st, e);
                    }
                    Ok(None) => {}
                    Err(e) => {
                        self.broken(&mut st, e.into());
                    }
                }
            } else if yielding.elapsed() < i.node.cfg.wait.yield_for {
                // Another caller reads answers: ours, or the reading half,
                // usually comes within microseconds, sooner than a sleeper
                // wakes (a futex wake-up on each side). So first look
                // between yields, as every waiter of the waiting policy does.
                drop(st);
                dm_sys::sched_yield();
                st = lock(&i.state);
            } else {
                let wait = deadline.map_or(Duration::from_millis(50), |d| {
                    d.saturating_duration_since(Instant::now())
                        .min(Duration::from_millis(50))
                });
                st.sleepers += 1;
                st =
                    i.cv.wait_timeout(st, wait)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                st.sleepers -= 1;
            }
        }
    }
}

impl crate::stream::StreamConn for BlockingConn {
    fn node(&self) -> &Node {
        &self.node
    }

    fn carries(&self, req: &Frame, refs: crate::transport::Sharing) -> bool {
        carried(req, (refs, self.refs), self.max_inline)
    }

    fn never_taken(&self, id: u64) -> bool {
        if !self.goaway.unread(id) {
            self.read_rest();
        }
        self.goaway.unread(id)
    }

    fn refs(&self) -> crate::transport::Sharing {
        self.refs
    }

    fn send_opening(
        &self,
        req: &mut Frame,
        deadline: Option<Instant>,
    ) -> Result<(), (RpcError, bool)> {
        if let Some(e) = self.failure() {
            return Err((e, false));
        }
        let mut enlist = |old: u64, new: u64| self.enlist(true, old, new);
        let f = Out::Listed(req, &mut enlist);
        self.sent(self.send_reading(f, deadline, None))
    }

    fn send_own(&self, f: &Frame, deadline: Option<Instant>) -> Result<(), (RpcError, bool)> {
        self.sent(self.send_reading(Out::Kept(f), deadline, None))
    }

    fn close_stream(&self, id: u64, cancel: bool) {
        let left = {
            let mut st = lock(&self.state);
            let left = match st.streams.iter().position(|(i, _)| *i == id) {
                Some(k) => st.streams.swap_remove(k).1.frames,
                None => VecDeque::new(),
            };
            self.rx.set_waiting(st.waiters());
            left
        };
        for f in left {
            orphan(&self.node, f);
        }
        if cancel && !self.broken.load(Ordering::Acquire) {
            lock(&self.tx).cancel(id);
        }
    }
}

impl Node {
    /// Connects to service `name`: a service of this process bound on the
    /// in-memory transport, else a TCP service in the node's registry, else
    /// a service in the pool's registry. The client reconnects when its
    /// connection breaks and the name is registered again (see
    /// [`crate::reconnect`]).
    pub fn connect(&self, name: &str) -> Result<Client, RpcError> {
        Ok(Client::new(self.redialer(Target::Name(name.to_owned()))?))
    }

    /// A client of service `name` that connects on its first call, for a
    /// caller that may start before the service does: until the name is
    /// registered, calls fail at once with `Unavailable`, or, with
    /// [`CallOptions::wait_for_ready`](crate::CallOptions), wait for it
    /// until their deadline. Then as [`connect`](Self::connect).
    pub fn connect_lazily(&self, name: &str) -> Result<Client, RpcError> {
        dm_pool::validate_service_name(name)?;
        Ok(Client::new(Redial::unconnected(
            self.clone(),
            Target::Name(name.to_owned()),
        )))
    }

    /// Connects to a service by TCP address (`host:port`), for servers
    /// whose registry this process cannot see (another host). Refs travel
    /// only if the server is attached to this node's pool.
    pub fn connect_tcp(&self, addr: &str) -> Result<Client, RpcError> {
        Ok(Client::new(self.redialer(Target::Addr(addr.to_owned()))?))
    }
}

impl crate::stream::ItemConn for BlockingConn {
    fn regrant(&self, id: u64) {
        if let Some(q) = lock(&self.state).stream(id) {
            q.credit += 1;
        }
    }

    fn finish_or_cancel(&self, id: u64) {
        if !self.broken.load(Ordering::Acquire) {
            lock(&self.tx).finish_or_cancel(id);
        }
    }

    fn cancel_call(&self, id: u64) {
        if !self.broken.load(Ordering::Acquire) {
            lock(&self.tx).cancel(id);
        }
    }

    fn carries_what(&self) -> (usize, crate::transport::Sharing) {
        (self.max_inline, self.refs)
    }
}

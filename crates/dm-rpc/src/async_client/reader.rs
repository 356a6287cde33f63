//! Who reads an async client's answers, and how each reaches its call:
//! a call reads its own while it spins, a pump thread reads them once a
//! call outlasts its spin, or a server's listener reads them while it
//! waits for requests. Each pending call has a slot.

use crate::call::attempt::{answers, orphan};
use crate::error::RpcError;
use crate::frame::{Frame, Kind};
use crate::node::Node;
use crate::sender::{send_holding_rx, send_unheld, Out, Sender};
use crate::sync::lock;
use crate::transport::{FrameRx, Looked, TransportError, WatchSet, Watched};
use crate::wait::Waiter;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

pub(super) type AnswerTx = oneshot::Sender<Result<Frame, RpcError>>;

/// Where a pending call's answer goes.
pub(super) enum Slot {
    /// The call reads its own answer while it spins: one read by someone
    /// else meanwhile is left here (as `Ready`), with no channel made for
    /// it.
    Spinning,
    /// The answer (or the error that broke the connection), read by
    /// someone else while the call spun.
    Ready(Result<Frame, RpcError>),
    /// The call awaits its answer on this channel.
    Waiting(AnswerTx),
    /// A stream's caller ([`crate::stream::AsyncStreaming`]): the frames
    /// that came for it.
    Stream(Fed),
}

/// Frames in the order they came: the first kept in place, so a stream
/// that gets one frame at a time (a call answered at once) makes no
/// queue.
#[derive(Default)]
pub(super) struct Frames {
    first: Option<Frame>,
    rest: VecDeque<Frame>,
}

impl Frames {
    fn push_back(&mut self, f: Frame) {
        if self.first.is_none() && self.rest.is_empty() {
            self.first = Some(f);
        } else {
            self.rest.push_back(f);
        }
    }

    fn pop_front(&mut self) -> Option<Frame> {
        self.first.take().or_else(|| self.rest.pop_front())
    }
}

impl IntoIterator for Frames {
    type Item = Frame;
    type IntoIter = std::iter::Chain<
        std::option::IntoIter<Frame>,
        std::collections::vec_deque::IntoIter<Frame>,
    >;
    fn into_iter(self) -> Self::IntoIter {
        self.first.into_iter().chain(self.rest)
    }
}

/// What came for a stream and is not read yet: items, then the answer
/// that ends it (bounded by its window), or the error that broke the
/// connection; and the task waiting for it.
#[derive(Default)]
pub(super) struct Fed {
    pub(super) frames: Frames,
    pub(super) failed: Option<RpcError>,
    /// After `failed`, what was left on the connection was read.
    pub(super) rest_read: bool,
    pub(super) waker: Option<Waker>,
    /// Items of its own the caller may still send (granted by the server,
    /// not yet sent).
    pub(super) credit: u64,
    /// The answer that ends the stream came: the caller sends no more.
    pub(super) answered: bool,
    /// The task waiting for a grant, if any.
    pub(super) credit_waker: Option<Waker>,
}

impl Fed {
    /// Wakes the tasks waiting for the stream, if any.
    fn wake(&mut self) {
        if let Some(w) = self.waker.take() {
            w.wake();
        }
        if let Some(w) = self.credit_waker.take() {
            w.wake();
        }
    }

    /// The same, later ([`Wakes`]).
    fn wake_later(&mut self, wakes: &mut Wakes) {
        wakes.wakers.extend(self.waker.take());
        wakes.wakers.extend(self.credit_waker.take());
    }
}

/// What a delivery owes the callers it served: wake-ups, and answers to
/// hand over. The pump fires them once it holds no reference to the
/// reader: a woken caller may drop its client then, and with the last
/// reference the connection closes and the pool detaches, before the
/// process (a short one) exits.
#[derive(Default)]
pub(super) struct Wakes {
    wakers: Vec<Waker>,
    answers: Vec<(AnswerTx, Frame)>,
}

impl Wakes {
    /// Fires them all: gives the answers whose callers had given up,
    /// whose Refs are the caller's to release.
    pub(super) fn fire(self) -> Vec<Frame> {
        for w in self.wakers {
            w.wake();
        }
        let mut left = Vec::new();
        for (tx, f) in self.answers {
            if let Err(Ok(f)) = tx.send(Ok(f)) {
                left.push(f);
            }
        }
        left
    }
}

/// Call ids are a counter: one multiplication spreads them over the whole
/// hash (the map's control bytes come from its top bits), with none of
/// the default hasher's cost per call.
#[derive(Default)]
pub(super) struct CallIdHasher(u64);

impl std::hash::Hasher for CallIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

pub(super) type Pending = HashMap<u64, Slot, std::hash::BuildHasherDefault<CallIdHasher>>;

/// The receiving half and the calls waiting for answers. Whoever reads
/// answers (a pump thread, or a server's listener) holds it weakly: it goes
/// with the client, and its connection closes then.
pub(super) struct Reader {
    pub(super) node: Node,
    pub(super) rx: Mutex<Box<dyn FrameRx>>,
    pub(super) state: Mutex<State>,
    /// Calls in `state.pending` (read without the lock by a watching
    /// listener, which skips an idle client with one load).
    pub(super) waiting: AtomicUsize,
    /// `Slot::Ready` entries in `state.pending`: a spinning call looks
    /// for its answer there only when there are any.
    pub(super) ready: AtomicUsize,
    /// `state.broken` is set (read without the lock by a lone caller).
    pub(super) broken: AtomicBool,
    /// Who reads answers: [`NO_READER`], [`PUMP`] or [`LISTENER`].
    pub(super) driver: AtomicU8,
    /// Wakes the pump thread out of its idle wait, when a call relies on
    /// it (`State::wanted`). The wait holds no reference to the reader: a
    /// client dropped while its pump idles is gone at once, its pool with
    /// it.
    pub(super) pump: Arc<PumpSignal>,
    /// The spin of calls that read their own answers (the node's waiting
    /// policy, adapted to the waits seen).
    pub(super) spinner: Mutex<Waiter>,
    /// Held while the reader is chosen.
    pub(super) choosing: Mutex<()>,
    pub(super) name: String,
}

/// No call has waited yet.
pub(super) const NO_READER: u8 = 0;
/// Calls read their answers while they spin, then a pump thread does.
pub(super) const PUMP: u8 = 1;
/// A server's listener reads answers while it waits for requests.
pub(super) const LISTENER: u8 = 2;

#[derive(Default)]
pub(super) struct State {
    pub(super) pending: Pending,
    pub(super) broken: Option<RpcError>,
    /// A pending call waits on the pump thread (it reads answers until
    /// none is parked).
    pub(super) wanted: bool,
    /// The pump thread runs.
    pub(super) pumping: bool,
    /// When the last answer for a parked caller came (read to adapt the
    /// spin to when answers come, not to when their callers wake).
    pub(super) arrived: Option<Instant>,
}

impl State {
    /// Whether a caller is parked, waiting for someone to read for it: a
    /// call awaiting its answer on its channel, a stream's caller awaiting
    /// a frame or a grant. (Callers that spin read for themselves; the
    /// pump reading meanwhile would only take the connection from them.)
    pub(super) fn anyone_parked(&self) -> bool {
        self.pending.values().any(|s| match s {
            Slot::Waiting(_) => true,
            Slot::Stream(fed) => fed.waker.is_some() || fed.credit_waker.is_some(),
            Slot::Spinning | Slot::Ready(_) => false,
        })
    }
}

thread_local! {
    /// The watch set of the listener whose dispatcher is polling an async
    /// handler on this thread, while it does (`server.rs`).
    static WATCH: std::cell::RefCell<Option<Arc<WatchSet>>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` (a poll of an async handler's call on a dispatcher) with
/// `watch` as the place where async clients it awaits find their reader.
pub(crate) fn polling_with<R>(watch: Option<&Arc<WatchSet>>, f: impl FnOnce() -> R) -> R {
    let Some(w) = watch else {
        return f();
    };
    let before = WATCH.with(|c| c.replace(Some(w.clone())));
    struct Restore(Option<Arc<WatchSet>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let before = self.0.take();
            WATCH.with(|c| *c.borrow_mut() = before);
        }
    }
    let _restore = Restore(before);
    f()
}

impl Reader {
    pub(super) fn insert(&self, st: &mut State, id: u64, slot: Slot) {
        st.pending.insert(id, slot);
        self.waiting.store(st.pending.len(), Ordering::Release);
    }

    pub(super) fn remove(&self, st: &mut State, id: u64) -> Option<Slot> {
        let r = st.pending.remove(&id);
        if let Some(Slot::Ready(_)) = r {
            self.ready.fetch_sub(1, Ordering::Relaxed);
        }
        self.waiting.store(st.pending.len(), Ordering::Release);
        r
    }

    /// Forgets call `id`, which gave up (or stream `id`, closed): what was
    /// already read for it is released.
    pub(super) fn forget(&self, id: u64) {
        let gone = self.remove(&mut lock(&self.state), id);
        match gone {
            Some(Slot::Ready(Ok(f))) => orphan(&self.node, f),
            Some(Slot::Stream(fed)) => {
                for f in fed.frames {
                    orphan(&self.node, f);
                }
            }
            _ => {}
        }
    }

    /// Hands an answer to its call (or releases what it carries if the
    /// call gave up). False if the connection is broken now.
    pub(super) fn deliver(&self, got: Result<Frame, TransportError>) -> bool {
        let mut wakes = Wakes::default();
        let alive = self.deliver_later(got, &mut wakes);
        for f in wakes.fire() {
            orphan(&self.node, f);
        }
        alive
    }

    /// [`deliver`](Self::deliver), with the wake-ups and answers it owes
    /// left in `wakes` (an error still fails the calls at once).
    pub(super) fn deliver_later(
        &self,
        got: Result<Frame, TransportError>,
        wakes: &mut Wakes,
    ) -> bool {
        let f = match got {
            Ok(f) if answers(f.kind) => f,
            Ok(_) => {
                self.break_all(RpcError::internal(
                    "the server sent a frame that is not a response",
                ));
                return false;
            }
            Err(e) => {
                self.break_all(e.into());
                return false;
            }
        };
        let mut st = lock(&self.state);
        match st.pending.get_mut(&f.call_id) {
            Some(Slot::Stream(fed)) if f.kind == Kind::Credit => {
                fed.credit += u64::from(f.method);
                wakes.wakers.extend(fed.credit_waker.take());
            }
            Some(Slot::Stream(fed)) => {
                fed.answered |= f.kind == Kind::Response;
                fed.frames.push_back(f);
                let parked = fed.waker.is_some();
                fed.wake_later(wakes);
                if parked {
                    st.arrived = Some(Instant::now());
                }
            }
            // (A grant for nothing open carries nothing to release.)
            _ if f.kind == Kind::Credit => {}
            // (An item is only ever a stream's.)
            _ if f.kind != Kind::Response => {
                drop(st);
                orphan(&self.node, f);
            }
            Some(slot @ Slot::Spinning) => {
                *slot = Slot::Ready(Ok(f));
                self.ready.fetch_add(1, Ordering::Release);
            }
            Some(Slot::Waiting(_)) => {
                st.arrived = Some(Instant::now());
                if let Some(Slot::Waiting(w)) = self.remove(&mut st, f.call_id) {
                    wakes.answers.push((w, f));
                }
            }
            // No such call (it gave up), or a second answer to one.
            Some(Slot::Ready(_)) | None => {
                drop(st);
                orphan(&self.node, f);
            }
        }
        true
    }

    /// Fails every pending and future call with `e`.
    pub(super) fn break_all(&self, e: RpcError) {
        let mut st = lock(&self.state);
        st.broken.get_or_insert(e.clone());
        self.broken.store(true, Ordering::Release);
        st.pending.retain(|_, slot| self.fail_slot(slot, &e));
        self.waiting.store(st.pending.len(), Ordering::Release);
    }

    /// Fails the call of `slot` with `e` (its connection broke): a call
    /// awaiting its answer gets the error now, a spinning one finds it in
    /// its slot, a stream after what came before it. False if the slot
    /// goes (its call has its error).
    pub(super) fn fail_slot(&self, slot: &mut Slot, e: &RpcError) -> bool {
        match slot {
            Slot::Waiting(_) => {
                if let Slot::Waiting(w) = std::mem::replace(slot, Slot::Spinning) {
                    let _ = w.send(Err(e.clone()));
                }
                false
            }
            Slot::Spinning => {
                *slot = Slot::Ready(Err(e.clone()));
                self.ready.fetch_add(1, Ordering::Release);
                true
            }
            Slot::Ready(_) => true,
            Slot::Stream(fed) => {
                // (What came before the break is read first.)
                fed.failed.get_or_insert_with(|| e.clone());
                fed.wake();
                true
            }
        }
    }

    /// Lists a call whose request goes now under its id `new`
    /// ([`crate::sender`]): `first`, its slot, on its first try (`old`
    /// 0), else the slot it had under `old`. On a broken connection the
    /// call fails at once, as [`break_all`](Self::break_all) failed those
    /// listed before.
    pub(super) fn enlist(&self, old: u64, new: u64, first: &mut Option<Slot>) {
        let mut st = lock(&self.state);
        let slot = match old {
            0 => first.take(),
            _ => st.pending.remove(&old),
        };
        let Some(mut slot) = slot else {
            return;
        };
        if let Some(e) = st.broken.clone() {
            if !self.fail_slot(&mut slot, &e) {
                return;
            }
        }
        self.insert(&mut st, new, slot);
    }

    /// Delivers the answers already there, without waiting (a client
    /// read by a listener, with calls waiting).
    ///
    /// It takes the receiving half with `lock`, not `try_lock`: the
    /// listener calls this after announcing that it will park, and must
    /// not park while an answer is there (its doorbell may have rung
    /// before). Nobody holds the half long here: its other users (a
    /// sending call taking its own answers, a liveness check) never wait
    /// with it held.
    pub(super) fn take_answers(&self) -> Looked {
        if self.waiting.load(Ordering::Acquire) == 0
            || self.driver.load(Ordering::Acquire) != LISTENER
        {
            return Looked::Idle;
        }
        self.drain(lock(&self.rx))
    }

    /// Call `id`'s answer, if it is there: read now (if nobody else is
    /// reading; the answers to other calls read before it are delivered),
    /// or left in its slot by whoever read it (a call reading its own
    /// while it spins).
    pub(super) fn take_own(&self, id: u64) -> Option<Result<Frame, RpcError>> {
        if let Ok(mut rx) = self.rx.try_lock() {
            if let Some(got) = self.read_until(&mut rx, id) {
                drop(rx);
                // (A second answer read meanwhile is the peer's fault:
                // released, as `deliver` does.)
                self.forget(id);
                return Some(got);
            }
        }
        if self.ready.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.take_ready(&mut lock(&self.state), id)
    }

    /// Call `id`'s answer, if someone else read it into its slot.
    pub(super) fn take_ready(&self, st: &mut State, id: u64) -> Option<Result<Frame, RpcError>> {
        if !matches!(st.pending.get(&id), Some(Slot::Ready(_))) {
            return None;
        }
        match self.remove(st, id) {
            Some(Slot::Ready(r)) => Some(r),
            _ => None,
        }
    }

    /// Stream `id`'s next frame, if one came; else the error that broke
    /// the connection, once what came before it is read; else pending,
    /// and the task of `cx` woken when something comes.
    pub(super) fn poll_stream(
        &self,
        id: u64,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Result<Frame, RpcError>> {
        let mut st = lock(&self.state);
        let Some(Slot::Stream(fed)) = st.pending.get_mut(&id) else {
            return Poll::Ready(Err(RpcError::internal("a stream lost its place")));
        };
        if let Some(f) = fed.frames.pop_front() {
            return Poll::Ready(Ok(f));
        }
        if fed.failed.is_some() && !std::mem::replace(&mut fed.rest_read, true) {
            // The connection broke (a send failing, or the peer found
            // dead) with frames perhaps still to read: the stream's end
            // may be among them. Whoever holds the receiving half lets it
            // go within moments (nobody waits long with it on a broken
            // connection).
            drop(st);
            self.drain(lock(&self.rx));
            return self.poll_stream(id, cx);
        }
        if let Some(e) = &fed.failed {
            return Poll::Ready(Err(e.clone()));
        }
        match &mut fed.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            w => *w = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    /// The next frame of stream `id` if it is there, reading what the
    /// connection holds if nobody else reads it (a stream's caller looks
    /// while it spins, as a call's does). `None` if nothing came yet, or
    /// the connection failed (then [`poll_stream`](Self::poll_stream)
    /// says how, in order).
    pub(super) fn try_stream(&self, id: u64) -> Option<Frame> {
        let take = |st: &mut State| match st.pending.get_mut(&id) {
            Some(Slot::Stream(fed)) if fed.failed.is_none() => fed.frames.pop_front(),
            _ => None,
        };
        if let Some(f) = take(&mut lock(&self.state)) {
            return Some(f);
        }
        if let Ok(rx) = self.rx.try_lock() {
            self.drain(rx);
        }
        take(&mut lock(&self.state))
    }

    /// [`poll_credit`](Self::poll_credit) without waiting: `None` if no
    /// grant is there yet (no waker is left behind).
    pub(super) fn try_credit(&self, id: u64) -> Option<Result<bool, RpcError>> {
        Self::credit_in(&mut lock(&self.state), id)
    }

    /// [`try_credit`](Self::try_credit) under the state lock.
    fn credit_in(st: &mut State, id: u64) -> Option<Result<bool, RpcError>> {
        let Some(Slot::Stream(fed)) = st.pending.get_mut(&id) else {
            // (Closed: its answer was read, or it was dropped.)
            return Some(Ok(false));
        };
        if fed.answered {
            return Some(Ok(false));
        }
        if let Some(e) = &fed.failed {
            return Some(Err(e.clone()));
        }
        if fed.credit > 0 {
            fed.credit -= 1;
            return Some(Ok(true));
        }
        None
    }

    /// Takes one item of credit for the items the caller of stream `id`
    /// sends, waiting for a grant: `Ok(false)` once the stream's answer
    /// came (the server takes no more), the error that broke the
    /// connection.
    pub(super) fn poll_credit(
        &self,
        id: u64,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Result<bool, RpcError>> {
        let mut st = lock(&self.state);
        if let Some(got) = Self::credit_in(&mut st, id) {
            return Poll::Ready(got);
        }
        let Some(Slot::Stream(fed)) = st.pending.get_mut(&id) else {
            return Poll::Ready(Ok(false));
        };
        match &mut fed.credit_waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            w => *w = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    /// Gives back a grant of stream `id`, taken for an item that did not
    /// go.
    pub(super) fn regrant(&self, id: u64) {
        if let Some(Slot::Stream(fed)) = lock(&self.state).pending.get_mut(&id) {
            fed.credit += 1;
        }
    }

    /// The lone caller `id`, whose spin ran out (it holds the receiving
    /// half), awaits its answer: on a channel that the reader completes.
    pub(super) fn await_lone(
        &self,
        id: u64,
    ) -> Result<oneshot::Receiver<Result<Frame, RpcError>>, Result<Frame, RpcError>> {
        let mut st = lock(&self.state);
        if let Some(e) = &st.broken {
            return Err(Err(e.clone()));
        }
        let (reply, waiting) = oneshot::channel();
        self.insert(&mut st, id, Slot::Waiting(reply));
        Ok(waiting)
    }

    /// Sends `f` as the lone caller, holding the receiving half `rx`: the
    /// answers that come while it waits go to their calls.
    pub(super) fn send_lone(
        &self,
        tx: &Mutex<Sender>,
        f: Out<'_>,
        deadline: Option<Instant>,
        rx: &mut MutexGuard<'_, Box<dyn FrameRx>>,
    ) -> Result<bool, TransportError> {
        let yield_for = self.node.cfg.wait.yield_for;
        send_holding_rx(tx, f, deadline, rx, yield_for, &mut |a| {
            self.deliver(Ok(a));
        })
    }

    /// The call `id`, whose spin ran out, awaits its answer: on a channel
    /// that the reader completes, unless the answer came meanwhile.
    pub(super) fn await_own(
        &self,
        id: u64,
    ) -> Result<oneshot::Receiver<Result<Frame, RpcError>>, Result<Frame, RpcError>> {
        let mut st = lock(&self.state);
        if let Some(r) = self.take_ready(&mut st, id) {
            return Err(r);
        }
        match st.pending.get_mut(&id) {
            Some(slot @ Slot::Spinning) => {
                let (reply, waiting) = oneshot::channel();
                *slot = Slot::Waiting(reply);
                Ok(waiting)
            }
            _ => Err(Err(RpcError::internal("a waiting call lost its place"))),
        }
    }

    /// Delivers every answer already in `rx`, without waiting.
    pub(super) fn drain(&self, mut rx: MutexGuard<'_, Box<dyn FrameRx>>) -> Looked {
        let mut looked = Looked::Idle;
        loop {
            match rx.try_recv() {
                Ok(None) => return looked,
                Ok(Some(f)) => {
                    looked = Looked::Delivered;
                    if !self.deliver(Ok(f)) {
                        return looked;
                    }
                }
                Err(e) => {
                    drop(rx);
                    self.deliver(Err(e));
                    return Looked::Delivered;
                }
            }
        }
    }

    /// Fails the pending calls if the peer is gone.
    pub(super) fn check(&self) -> Looked {
        if self.waiting.load(Ordering::Acquire) == 0 {
            return Looked::Idle;
        }
        let Ok(mut rx) = self.rx.try_lock() else {
            return Looked::Idle;
        };
        match rx.check_peer() {
            Ok(()) => Looked::Idle,
            Err(e) => {
                drop(rx);
                self.break_all(e.into());
                Looked::Delivered
            }
        }
    }

    /// Sends `f`, waiting for room until `deadline`. A client read by a
    /// listener takes its own answers while it waits: the listener's
    /// dispatcher is most likely this very thread (polling the handler
    /// that calls), and the service may wait for room to answer before it
    /// reads more requests. Any other reads them if nobody else does
    /// ([`send_unheld`]: the pump may have stopped, its calls done).
    pub(super) fn send(
        &self,
        tx: &Mutex<Sender>,
        mut f: Out<'_>,
        deadline: Option<Instant>,
    ) -> Result<bool, TransportError> {
        if self.driver.load(Ordering::Acquire) != LISTENER {
            let yield_for = self.node.cfg.wait.yield_for;
            return send_unheld(
                tx,
                f,
                || self.rx.try_lock().ok(),
                deadline,
                yield_for,
                &mut |a| {
                    self.deliver(Ok(a));
                },
            );
        }
        let mut last_check = Instant::now();
        loop {
            let now = Instant::now();
            match lock(tx).push(f.again(), Some(now), None) {
                Ok(false) if deadline.is_none_or(|d| now < d) => {}
                done => return done,
            }
            self.take_answers();
            if now - last_check >= Duration::from_millis(1) {
                last_check = now;
                lock(&self.rx).check_peer()?;
            }
            std::thread::yield_now();
        }
    }

    /// Makes sure someone reads answers before a call waits for one: the
    /// listener of the server whose async handler makes the call, if its
    /// transport can watch this connection; else a pump thread.
    pub(super) fn ensure_reader(self: &Arc<Self>) -> Result<(), RpcError> {
        if self.driver.load(Ordering::Acquire) != NO_READER {
            return Ok(());
        }
        let _g = lock(&self.choosing);
        if self.driver.load(Ordering::Acquire) != NO_READER {
            return Ok(());
        }
        let watch = WATCH.with(|c| c.borrow().clone());
        let bell = lock(&self.rx).bell();
        if let (Some(ws), Some(bell)) = (watch, bell) {
            let w = Arc::new(WatchedClient {
                reader: Arc::downgrade(self),
                bell,
            });
            if ws.add(w) {
                self.driver.store(LISTENER, Ordering::Release);
                return Ok(());
            }
        }
        self.driver.store(PUMP, Ordering::Release);
        Ok(())
    }

    /// Has the pump thread read answers until no call is pending (a call
    /// waits on it): starts it the first time.
    pub(super) fn want_pump(self: &Arc<Self>) -> Result<(), RpcError> {
        let mut st = lock(&self.state);
        st.wanted = true;
        if !st.pumping {
            let weak = Arc::downgrade(self);
            std::thread::Builder::new()
                .name(format!("dmrpc-pump:{}", self.name))
                .spawn(move || pump(weak))
                .map_err(|e| RpcError::internal(format!("cannot start the answer pump: {e}")))?;
            st.pumping = true;
        }
        drop(st);
        self.pump.poke();
        Ok(())
    }

    /// Reads answers while spinning, for up to the spin of the waiting
    /// policy: call `id`'s own answer (or error), if it comes by then.
    pub(super) fn spin_for(
        &self,
        id: u64,
        deadline: Option<Instant>,
    ) -> (Option<Result<Frame, RpcError>>, Duration) {
        self.spin_with(
            deadline,
            || self.take_own(id),
            // A dead peer fails the pending calls, ours included.
            || {
                self.check();
            },
        )
    }

    /// The lone caller's spin: reads answers with the receiving half `rx`,
    /// taken before it sent, until call `id`'s (no slot: nobody else can
    /// read it), delivering the others; for up to the spin of the waiting
    /// policy.
    pub(super) fn spin_lone(
        &self,
        rx: &mut MutexGuard<'_, Box<dyn FrameRx>>,
        id: u64,
        deadline: Option<Instant>,
    ) -> (Option<Result<Frame, RpcError>>, Duration) {
        let check_due = std::cell::Cell::new(false);
        self.spin_with(
            deadline,
            || {
                if check_due.replace(false) {
                    if let Err(e) = rx.check_peer() {
                        return Some(Err(self.fail(e)));
                    }
                }
                self.read_until(rx, id)
            },
            || check_due.set(true),
        )
    }

    /// Checks `ready` while spinning (see [`Waiter::spin_phase`]), with
    /// the spin this client has adapted to: what it gave, and the spin.
    pub(super) fn spin_with<T>(
        &self,
        deadline: Option<Instant>,
        ready: impl FnMut() -> Option<T>,
        idle: impl FnMut(),
    ) -> (Option<T>, Duration) {
        let mut w = lock(&self.spinner).clone();
        let spun = w.spin();
        let got = w.spin_phase(deadline, ready, idle);
        if w.spin() != spun {
            // (Unchanged, as when the answer came within the spin: no
            // second lock.)
            *lock(&self.spinner) = w;
        }
        (got, spun)
    }

    /// Reads the answers already in `rx` until call `id`'s (or an error,
    /// which breaks the connection), delivering the others.
    #[inline]
    pub(super) fn read_until(
        &self,
        rx: &mut Box<dyn FrameRx>,
        id: u64,
    ) -> Option<Result<Frame, RpcError>> {
        loop {
            if self.broken.load(Ordering::Acquire) {
                return Some(Err(self.broken_error()));
            }
            match rx.try_recv() {
                Ok(None) => return None,
                Ok(Some(f)) if f.call_id == id && f.kind == Kind::Response => return Some(Ok(f)),
                Ok(Some(f)) => {
                    self.deliver(Ok(f));
                }
                Err(e) => return Some(Err(self.fail(e))),
            }
        }
    }

    /// Breaks the connection with `e`: the error every call now gets.
    pub(super) fn fail(&self, e: TransportError) -> RpcError {
        let e = RpcError::from(e);
        self.break_all(e.clone());
        e
    }

    /// The error that broke the connection.
    pub(super) fn broken_error(&self) -> RpcError {
        lock(&self.state)
            .broken
            .clone()
            .unwrap_or_else(|| RpcError::internal("the connection broke"))
    }

    /// How long after `at` (when a caller's spin ran out) its answer
    /// came: when the last answer for a parked caller came, if that was
    /// after `at` (a later caller's, at worst), else now.
    pub(super) fn came_after(&self, at: Instant) -> Duration {
        let arrived = lock(&self.state).arrived.filter(|a| *a >= at);
        arrived.unwrap_or_else(Instant::now) - at
    }

    /// Grows the spin again after a wait that ended `waited` after it
    /// started, just after a spin of `spun` ran out.
    pub(super) fn ended_after_spin(&self, spun: Duration, waited: Duration) {
        lock(&self.spinner).ended_after_spin(spun, waited);
    }
}

/// An async client's connection as a server's listener watches it.
pub(super) struct WatchedClient {
    pub(super) reader: Weak<Reader>,
    pub(super) bell: &'static AtomicU32,
}

impl Watched for WatchedClient {
    fn look(&self) -> Looked {
        match self.reader.upgrade() {
            Some(r) => r.take_answers(),
            None => Looked::Gone,
        }
    }

    fn check(&self) -> Looked {
        match self.reader.upgrade() {
            Some(r) => r.check(),
            None => Looked::Gone,
        }
    }

    fn bell(&self) -> &'static AtomicU32 {
        self.bell
    }

    fn gone(&self) -> bool {
        self.reader.strong_count() == 0
    }

    fn orphaned(&self) {
        if let Some(r) = self.reader.upgrade() {
            let _g = lock(&r.choosing);
            // The calls waiting on the listener now wait on the pump.
            r.driver.store(PUMP, Ordering::Release);
            if let Err(e) = r.want_pump() {
                r.break_all(e);
            }
        }
    }
}

/// What wakes an idle pump thread: a count of pokes (a want, or the
/// client's end), so that a poke between its look and its wait is not
/// lost.
#[derive(Default)]
pub(super) struct PumpSignal {
    pokes: Mutex<u64>,
    cv: Condvar,
}

impl PumpSignal {
    /// The pokes so far.
    pub(super) fn seen(&self) -> u64 {
        *lock(&self.pokes)
    }

    /// Wakes the pump.
    pub(super) fn poke(&self) {
        *lock(&self.pokes) += 1;
        self.cv.notify_one();
    }

    /// Waits until a poke after `seen`, or `max` passes.
    fn wait_past(&self, seen: u64, max: Duration) {
        let g = lock(&self.pokes);
        let _ = self.cv.wait_timeout_while(g, max, |p| *p == seen);
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        // The pump, if idle, ends now.
        self.pump.poke();
    }
}

/// Reads answers and completes the calls waiting for them while calls rely
/// on it (from a call's `want_pump` until none is parked), until the
/// client is dropped or the connection breaks. In between it waits on
/// its [`PumpSignal`] without the receiving half (nor the reader itself),
/// which the calls then read
/// themselves.
pub(super) fn pump(reader: Weak<Reader>) {
    loop {
        let Some(r) = reader.upgrade() else {
            return;
        };
        {
            let mut st = lock(&r.state);
            if !st.anyone_parked() {
                // The callers that spin read for themselves.
                st.wanted = false;
            }
            if !st.wanted {
                // Waits for a poke (or looks again within 100 ms) holding
                // only the signal: the client may go meanwhile.
                let (signal, seen) = (r.pump.clone(), r.pump.seen());
                drop(st);
                drop(r);
                signal.wait_past(seen, Duration::from_millis(100));
                continue;
            }
        }
        // (The receiving half is held until what it gave is delivered: a
        // stream's items reach it in the order they came.)
        let mut rx = lock(&r.rx);
        let got = rx.recv(Some(Instant::now() + Duration::from_millis(100)));
        let mut wakes = Wakes::default();
        let alive = match got {
            Ok(None) => true,
            Ok(Some(f)) => r.deliver_later(Ok(f), &mut wakes),
            Err(e) => r.deliver_later(Err(e), &mut wakes),
        };
        drop(rx);
        if !alive {
            lock(&r.state).pumping = false;
        }
        // The callers go on only once the pump holds the reader no more.
        drop(r);
        let left = wakes.fire();
        if !left.is_empty() {
            if let Some(r) = reader.upgrade() {
                for f in left {
                    orphan(&r.node, f);
                }
            }
        }
        if !alive {
            return;
        }
    }
}

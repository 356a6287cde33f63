//! The async (tokio) client: calls are futures, and any number of them may
//! be outstanding on one connection.
//!
//! Sending happens in the calling task (a push into a ring or a socket
//! write, which waits only when the transport is full). A call that reads
//! its own answer while it spins takes it straight from the transport (an
//! answer read by someone else meanwhile is left in its slot); a call
//! that awaits gets it through a oneshot channel, made only then, and its
//! future resolves on whatever runtime awaits it. Who reads the answers
//! is chosen when a call first waits:
//!
//! * a client whose first call is awaited by a server's async handler, on
//!   a transport with a doorbell (shared-memory rings), is read by that
//!   server's listener, which looks at it while it waits for requests and
//!   parks on its bell along with its own (`futex_waitv`): an answer then
//!   costs no thread of its own and no hand-off between threads, and the
//!   dispatcher polls the handler it wakes right away. It is read only
//!   while that dispatcher waits for requests, so a long blocking handler
//!   of the same server delays its answers (to any caller: a client is
//!   read by the listener of the first server that awaited it). When that
//!   server stops, a pump thread takes over;
//! * any other client's calls read the answers themselves while they spin
//!   (the spin of the node's waiting policy, adaptive): a call whose
//!   answer comes within it completes in the task that awaits it, with no
//!   thread in between, as a blocking call does. A call still waiting
//!   when its spin runs out leaves the wait to the connection's pump
//!   thread (started the first time one is needed), which reads answers
//!   while calls rely on it and parks on the transport's doorbell. The
//!   spin holds the runtime's thread, as a blocking call would, for at
//!   most the policy's spin (20 µs by default, less once answers take
//!   longer); a policy without spin (`WaitPolicy::park_only`, or
//!   `DMRPC_WAIT=0,0,20`) never holds it and leaves every wait to the
//!   pump.
//!
//! A dead peer fails every pending and future call on the connection with
//! `Unavailable` (until a call finds the service registered again:
//! [`crate::reconnect`]); a
//! deadline fails the call with `DeadlineExceeded` and sends a cancel, as
//! the blocking client does. Dropping a call's future while it waits (a
//! timeout around it, a `select!` that took another branch) cancels it
//! the same way: the Ref made for its argument is released at once, and
//! so is its answer when it comes.

use crate::call::attempt::{
    answers, carried, deadline_of, ended, orphan, outgoing, sent_as, Again, Failure, Outgoing,
    Refused,
};
use crate::call::failover::{Failover, Link, Next};
use crate::call::options::{CallOptions, Reply};
use crate::dial::Target;
use crate::error::RpcError;
use crate::frame::{Frame, Kind, Status};
use crate::handle::ClientOf;
use crate::metadata::Metadata;
use crate::node::Node;
use crate::payload::Payload;
use crate::reconnect::{Connected, Redial};
use crate::sender::{send_holding_rx, send_unheld, Out, Sender};
use crate::sync::lock;
use crate::transport::{Connection, FrameRx, Looked, TransportError, WatchSet, Watched};
use crate::wait::Waiter;
use arc_swap::Guard;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

type AnswerTx = oneshot::Sender<Result<Frame, RpcError>>;

/// Where a pending call's answer goes.
enum Slot {
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
    Stream(Box<Fed>),
}

/// What came for a stream and is not read yet: items, then the answer
/// that ends it (bounded by its window), or the error that broke the
/// connection; and the task waiting for it.
#[derive(Default)]
struct Fed {
    frames: VecDeque<Frame>,
    failed: Option<RpcError>,
    /// After `failed`, what was left on the connection was read.
    rest_read: bool,
    waker: Option<Waker>,
}

impl Fed {
    /// Wakes the task waiting for the stream, if any.
    fn wake(&mut self) {
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }
}

/// Call ids are a counter: one multiplication spreads them over the whole
/// hash (the map's control bytes come from its top bits), with none of
/// the default hasher's cost per call.
#[derive(Default)]
struct CallIdHasher(u64);

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

type Pending = HashMap<u64, Slot, std::hash::BuildHasherDefault<CallIdHasher>>;

/// An async client of one service: calls are futures, any number
/// outstanding on one connection. Cheap to clone; clones share the
/// connection. Its connection is replaced when it breaks and the service
/// is registered again ([`crate::reconnect`]). What every client has (its
/// options, its interceptors) is [`ClientOf`]'s.
pub type AsyncClient = ClientOf<AsyncConn>;

/// One connection of an [`AsyncClient`].
pub struct AsyncConn {
    node: Node,
    name: String,
    tx: Mutex<Sender>,
    reader: Arc<Reader>,
    /// New calls go elsewhere ([`Connected::retire`]).
    retired: AtomicBool,
    max_inline: usize,
    refs: crate::transport::Sharing,
    goaway: Arc<dyn crate::transport::GoAway>,
}

impl std::fmt::Debug for AsyncConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncConn")
            .field("service", &self.name)
            .finish_non_exhaustive()
    }
}

/// The receiving half and the calls waiting for answers. Whoever reads
/// answers (a pump thread, or a server's listener) holds it weakly: it goes
/// with the client, and its connection closes then.
struct Reader {
    node: Node,
    rx: Mutex<Box<dyn FrameRx>>,
    state: Mutex<State>,
    /// Calls in `state.pending` (read without the lock by a watching
    /// listener, which skips an idle client with one load).
    waiting: AtomicUsize,
    /// `Slot::Ready` entries in `state.pending`: a spinning call looks
    /// for its answer there only when there are any.
    ready: AtomicUsize,
    /// `state.broken` is set (read without the lock by a lone caller).
    broken: AtomicBool,
    /// Who reads answers: [`NO_READER`], [`PUMP`] or [`LISTENER`].
    driver: AtomicU8,
    /// The pump thread waits here, under `state`, until a call relies on
    /// it (`State::wanted`).
    pump_cv: Condvar,
    /// The spin of calls that read their own answers (the node's waiting
    /// policy, adapted to the waits seen).
    spinner: Mutex<Waiter>,
    /// Held while the reader is chosen.
    choosing: Mutex<()>,
    name: String,
}

/// No call has waited yet.
const NO_READER: u8 = 0;
/// Calls read their answers while they spin, then a pump thread does.
const PUMP: u8 = 1;
/// A server's listener reads answers while it waits for requests.
const LISTENER: u8 = 2;

#[derive(Default)]
struct State {
    pending: Pending,
    broken: Option<RpcError>,
    /// A pending call waits on the pump thread (it reads answers until
    /// none is pending).
    wanted: bool,
    /// The pump thread runs.
    pumping: bool,
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
    fn insert(&self, st: &mut State, id: u64, slot: Slot) {
        st.pending.insert(id, slot);
        self.waiting.store(st.pending.len(), Ordering::Release);
    }

    fn remove(&self, st: &mut State, id: u64) -> Option<Slot> {
        let r = st.pending.remove(&id);
        if let Some(Slot::Ready(_)) = r {
            self.ready.fetch_sub(1, Ordering::Relaxed);
        }
        self.waiting.store(st.pending.len(), Ordering::Release);
        r
    }

    /// Forgets call `id`, which gave up (or stream `id`, closed): what was
    /// already read for it is released.
    fn forget(&self, id: u64) {
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
    fn deliver(&self, got: Result<Frame, TransportError>) -> bool {
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
            Some(Slot::Stream(fed)) => {
                fed.frames.push_back(f);
                fed.wake();
            }
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
                if let Some(Slot::Waiting(w)) = self.remove(&mut st, f.call_id) {
                    drop(st);
                    if let Err(Ok(f)) = w.send(Ok(f)) {
                        orphan(&self.node, f);
                    }
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
    fn break_all(&self, e: RpcError) {
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
    fn fail_slot(&self, slot: &mut Slot, e: &RpcError) -> bool {
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
    fn enlist(&self, old: u64, new: u64, first: &mut Option<Slot>) {
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
    fn take_answers(&self) -> Looked {
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
    fn take_own(&self, id: u64) -> Option<Result<Frame, RpcError>> {
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
    fn take_ready(&self, st: &mut State, id: u64) -> Option<Result<Frame, RpcError>> {
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
    fn poll_stream(
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

    /// The lone caller `id`, whose spin ran out (it holds the receiving
    /// half), awaits its answer: on a channel that the reader completes.
    fn await_lone(
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
    fn send_lone(
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
    fn await_own(
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
    fn drain(&self, mut rx: MutexGuard<'_, Box<dyn FrameRx>>) -> Looked {
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
    fn check(&self) -> Looked {
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
    fn send(
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
    fn ensure_reader(self: &Arc<Self>) -> Result<(), RpcError> {
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
    fn want_pump(self: &Arc<Self>) -> Result<(), RpcError> {
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
        self.pump_cv.notify_one();
        Ok(())
    }

    /// Reads answers while spinning, for up to the spin of the waiting
    /// policy: call `id`'s own answer (or error), if it comes by then.
    fn spin_for(
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
    fn spin_lone(
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
    fn spin_with<T>(
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
    fn read_until(&self, rx: &mut Box<dyn FrameRx>, id: u64) -> Option<Result<Frame, RpcError>> {
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
    fn fail(&self, e: TransportError) -> RpcError {
        let e = RpcError::from(e);
        self.break_all(e.clone());
        e
    }

    /// The error that broke the connection.
    fn broken_error(&self) -> RpcError {
        lock(&self.state)
            .broken
            .clone()
            .unwrap_or_else(|| RpcError::internal("the connection broke"))
    }

    /// Grows the spin again after a wait that ended `waited` after it
    /// started, just after a spin of `spun` ran out.
    fn ended_after_spin(&self, spun: Duration, waited: Duration) {
        lock(&self.spinner).ended_after_spin(spun, waited);
    }
}

/// An async client's connection as a server's listener watches it.
struct WatchedClient {
    reader: Weak<Reader>,
    bell: &'static AtomicU32,
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

impl Connected for AsyncConn {
    fn open(node: Node, name: &str, conn: Connection) -> AsyncConn {
        let reader = Arc::new(Reader {
            node: node.clone(),
            rx: Mutex::new(conn.rx),
            state: Mutex::new(State::default()),
            waiting: AtomicUsize::new(0),
            ready: AtomicUsize::new(0),
            broken: AtomicBool::new(false),
            driver: AtomicU8::new(NO_READER),
            pump_cv: Condvar::new(),
            spinner: Mutex::new(node.cfg.wait.waiter()),
            choosing: Mutex::new(()),
            name: name.to_owned(),
        });
        AsyncConn {
            node,
            name: name.to_owned(),
            tx: Mutex::new(Sender::new(conn.tx)),
            reader,
            retired: AtomicBool::new(false),
            max_inline: conn.max_inline,
            refs: conn.refs,
            goaway: conn.goaway,
        }
    }

    #[inline]
    fn is_spent(&self) -> bool {
        self.reader.broken.load(Ordering::Acquire) || self.retired.load(Ordering::Acquire)
    }

    fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }

    fn break_with(&self, e: RpcError) {
        self.reader.break_all(e);
    }

    fn failure(&self) -> Option<RpcError> {
        self.reader
            .broken
            .load(Ordering::Acquire)
            .then(|| self.reader.broken_error())
    }

    const CLIENT: &'static str = "AsyncClient";

    fn link(&self) -> Link {
        Link {
            spent: self.is_spent(),
            refs: self.refs,
            max_inline: self.max_inline,
        }
    }
}

impl AsyncClient {
    /// Whether a server's listener reads this client's answers (no pump
    /// thread of its own; see the module's documentation).
    pub fn answers_read_by_listener(&self) -> bool {
        self.h.current().reader.driver.load(Ordering::Acquire) == LISTENER
    }

    /// Whether this client has a pump thread (started when a call first
    /// outlasted its spin; see the module's documentation).
    pub fn has_pump(&self) -> bool {
        lock(&self.h.current().reader.state).pumping
    }

    /// Calls `method` with `payload`. (Like every call of this client,
    /// nothing is sent before the future is first polled.)
    pub fn call<'a>(
        &'a self,
        method: &'a str,
        payload: impl Into<Payload>,
    ) -> impl std::future::Future<Output = Result<Payload, RpcError>> + Send + 'a {
        self.call_with(method, payload.into(), CallOptions::default())
    }

    /// Calls `method` with a copy of `data`, made once: a large argument
    /// is written straight into the pool (`call(method, data)` copies it
    /// into a vector first).
    pub async fn call_slice(&self, method: &str, data: &[u8]) -> Result<Payload, RpcError> {
        match self.payload_for(data) {
            Ok(p) => self.call_with(method, p, CallOptions::default()).await,
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

    /// Calls `method` with options.
    pub fn call_with<'a>(
        &'a self,
        method: &'a str,
        payload: Payload,
        opts: CallOptions,
    ) -> impl std::future::Future<Output = Result<Payload, RpcError>> + Send + 'a {
        self.call_with_metadata(method, payload, opts, Metadata::new())
    }

    /// Calls `method` with options and metadata, which the handler reads
    /// ([`Call::metadata`](crate::server::Call::metadata)).
    pub fn call_with_metadata<'a>(
        &'a self,
        method: &'a str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> impl std::future::Future<Output = Result<Payload, RpcError>> + Send + 'a {
        Then::new(
            self.call_full(method, payload, opts, meta),
            |r: Result<Reply, RpcError>| r.map(|r| r.payload),
        )
    }

    /// Calls `method` with options and metadata, and returns the answer
    /// with the metadata its handler set (on a failure, the error carries
    /// it: [`RpcError::metadata`]).
    ///
    /// The layers above are this future, not futures around it: an async
    /// fn that awaits another keeps its own copy of the arguments beside
    /// the other's state, and a call's future is held by whatever awaits
    /// it (a server's task boxes it for every call).
    pub fn call_full<'a>(
        &'a self,
        method: &'a str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> impl std::future::Future<Output = Result<Reply, RpcError>> + Send + 'a {
        Then::new(
            self.call_intercepted(method, payload, opts, meta),
            move |r| self.defaults.answered(method, r),
        )
    }

    /// [`call_full`](Self::call_full) before the answer interceptors.
    async fn call_intercepted(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Result<Reply, RpcError> {
        let (opts, meta) = self.defaults.apply(method, &payload, opts, meta)?;
        let (mut c, opts) = self.usable(opts).await?;
        let mut r = c.call_with(method, payload, opts, meta).await;
        // What Failover decides, done in this task. (Each wait is boxed:
        // a rare state kept out of every call's future. The request is
        // held across it, so that a call dropped meanwhile ends what it
        // lent.)
        let mut f = Failover::new(&opts);
        loop {
            let x = match f.next(r, Instant::now()) {
                Next::End(r) => return self.h.settle(&c, r),
                Next::GiveUp(x) => return Err(x.fail(&c.node)),
                Next::Elsewhere(mut x) => {
                    self.h.refused(&c);
                    let mut n = Guard::into_inner(self.h.live());
                    if f.waits_for(n.link()) {
                        let until = x.deadline();
                        let held = Held(Some(x), c.node.clone());
                        let ready = Box::pin(self.h.ready_async(n, until)).await;
                        x = held.take();
                        match ready {
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
                    let held = Held(Some(x), c.node.clone());
                    Box::pin(tokio::time::sleep(wait)).await;
                    let x = held.take();
                    let n = Guard::into_inner(self.h.live());
                    if !f.takes(&x, n.link(), false) {
                        return Err(x.fail(&c.node));
                    }
                    c = n;
                    x
                }
            };
            r = c.resend(*x).await;
        }
    }

    /// The connection a call with `opts` goes over, and its options then:
    /// the current one, or, if it is broken or retired with nothing new to
    /// dial, the one a call that waits for ready waits for; else the
    /// failure (the argument is not even placed).
    async fn usable(
        &self,
        mut opts: CallOptions,
    ) -> Result<(Arc<AsyncConn>, CallOptions), RpcError> {
        // (Held as an Arc: a guard is no thing to keep across awaits.)
        let mut c = Guard::into_inner(self.h.live());
        if c.is_spent() {
            if opts.wait_for_ready {
                let until = deadline_of(&c.node, opts, Instant::now()).0;
                c = Box::pin(self.h.ready_async(c, until)).await?;
                opts = opts.after_waiting(until);
            }
            if let Some(e) = c.failure() {
                return Err(e);
            }
        }
        Ok((c, opts))
    }

    /// Calls streaming method `method` with `payload`: its answer is a
    /// stream of items, read as they come from the
    /// [`AsyncStreaming`](crate::stream::AsyncStreaming). See
    /// [`crate::stream`].
    pub async fn call_stream(
        &self,
        method: &str,
        payload: impl Into<Payload>,
    ) -> Result<crate::stream::AsyncStreaming, RpcError> {
        let p = payload.into();
        self.call_stream_with(method, p, CallOptions::default(), Metadata::new())
            .await
    }

    /// Calls streaming method `method` with options (the deadline bounds
    /// the whole stream; [`CallOptions::window`] is how many items it
    /// holds unread at most) and metadata. The request is sent and the
    /// stream open when this returns; what the server answers comes
    /// through the stream, its errors included.
    pub async fn call_stream_with(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Result<crate::stream::AsyncStreaming, RpcError> {
        let (opts, meta) = self.defaults.apply(method, &payload, opts, meta)?;
        let (c, opts) = self.usable(opts).await?;
        let out = outgoing(&c.node, c.max_inline, c.refs, method, payload, opts, meta)?;
        let how = crate::stream::How::of(opts, &out);
        crate::stream::AsyncStreaming::open(self.h.clone(), c, method, out, how).await
    }
}

impl AsyncConn {
    /// Sends a call now; the future of its answer. (Like `send_and_wait`,
    /// for callers that await it at once.)
    fn call_with(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Answer<'_> {
        let (node, refs) = (&self.node, self.refs);
        match outgoing(node, self.max_inline, refs, method, payload, opts, meta) {
            Ok(out) => self.send_and_wait(out),
            Err(e) => Answer::Ready(Some(Err(e.into()))),
        }
    }

    /// Sends again, on this connection, a request another refused.
    fn resend(&self, r: Refused) -> Answer<'_> {
        match r.left(&self.node, &self.name) {
            Ok(req) => self.send_and_wait(req),
            Err(e) => Answer::Ready(Some(Err(e.into()))),
        }
    }

    /// Sends a request now, reading its answer while it spins; the future
    /// of its answer (ready if it came within the spin). An idempotent one
    /// is treated as not run if the connection breaks before its answer.
    /// Callers await it at once, so sending before the first poll is the
    /// same as sending at it; splitting the call this way keeps its
    /// future small (the state kept across the wait is boxed, and only
    /// when the call does wait): every layer above holds it, and a
    /// server's task holds those in turn.
    fn send_and_wait(&self, out: Outgoing) -> Answer<'_> {
        match self.send_and_spin(out) {
            Ok(AfterSpin::Answered(sent, got)) => Answer::Ready(Some(self.conclude(sent, got))),
            Ok(AfterSpin::Waiting(mut sent, w)) => {
                // From here the call is cancelled if its future is dropped,
                // even before the answer's future is first polled (the
                // guard is the wait's argument: dropped with it).
                let cancel = Cancel {
                    inner: self,
                    id: sent.id,
                    lent: Some(std::mem::take(&mut sent.lent)),
                };
                Answer::Waiting(Box::pin(self.await_answer(sent, w, cancel)))
            }
            Err(e) => Answer::Ready(Some(Err(e))),
        }
    }

    /// The part of [`send_and_wait`](Self::send_and_wait) before any
    /// await: sends the request and spins for its answer.
    fn send_and_spin(&self, out: Outgoing) -> Result<AfterSpin, Failure> {
        let i = self;
        let (mut frame, lent, deadline, again) = out.into_frame();
        let r = &i.reader;
        if let Err(e) = r.ensure_reader() {
            lent.release(&i.node);
            return Err(e.into());
        }
        // A call whose answers a listener reads awaits them from the
        // start. Any other first reads its own while it spins: if nobody
        // reads now (the lone caller), with the receiving half taken before
        // it sends and no slot, as the blocking client's lone caller does;
        // else through its slot. (In a block: the half's guard must not
        // live across an await.)
        let (own, waiting, spun, frame, id) = {
            let mut lone = None;
            if r.driver.load(Ordering::Acquire) == PUMP && !r.broken.load(Ordering::Acquire) {
                lone = r.rx.try_lock().ok();
            }
            let mut waiting = None;
            let mut slot = None;
            if lone.is_none() {
                if let Some(e) = i.failure() {
                    lent.release(&i.node);
                    return Err(e.into());
                }
                slot = Some(if r.driver.load(Ordering::Acquire) == LISTENER {
                    let (reply, w) = oneshot::channel();
                    waiting = Some(w);
                    Slot::Waiting(reply)
                } else {
                    Slot::Spinning
                });
            }
            // (Listed under its id as it goes: `Reader::enlist`.)
            let mut enlist = |old: u64, new: u64| r.enlist(old, new, &mut slot);
            let sent = match lone {
                Some(ref mut rx) => {
                    let out = Out::Own(&mut frame);
                    r.send_lone(&i.tx, out, deadline, rx)
                }
                None => r.send(&i.tx, Out::Listed(&mut frame, &mut enlist), deadline),
            };
            let id = frame.call_id;
            // (The error, and whether the connection broke: then the
            // request was not sent, and may go elsewhere. A send that
            // fails with the connection lost may be the first to see it:
            // no answer is read before a call.)
            let unsent = sent_as(&i.name, sent, |e| r.fail(e)).err();
            if let Some((e, broke)) = unsent {
                match lone {
                    Some(rx) => drop(rx),
                    None => r.forget(id),
                }
                if broke {
                    return Err(Failure::not_run(frame, e, lent, deadline, i.refs, again));
                }
                lent.release(&i.node);
                return Err(e.into());
            }
            // Read our own answer while we spin; past the spin, the pump
            // reads. (`spun`: the spin that ran out, and when.)
            let mut spun = None;
            let mut own = None;
            if waiting.is_none() {
                let (got, spin) = match lone {
                    Some(ref mut rx) => r.spin_lone(rx, id, deadline),
                    None => r.spin_for(id, deadline),
                };
                own = got;
                if own.is_none() {
                    let awaited = match lone.take() {
                        // The lone caller's slot goes in before it lets
                        // the half go (to the pump, or another caller).
                        Some(rx) => {
                            let a = r.await_lone(id);
                            drop(rx);
                            a
                        }
                        None => r.await_own(id),
                    };
                    match awaited {
                        Err(x) => own = Some(x),
                        Ok(w) => {
                            waiting = Some(w);
                            let at = Instant::now();
                            // (Past the deadline, the wait below ends at once.)
                            if deadline.is_none_or(|d| at < d) {
                                spun = Some((spin, at));
                                if let Err(e) = r.want_pump() {
                                    r.forget(id);
                                    lent.release(&i.node);
                                    return Err(e.into());
                                }
                            }
                        }
                    }
                }
            }
            (own, waiting, spun, frame, id)
        };
        let sent = Sent {
            frame,
            lent,
            deadline,
            again,
            id,
            spun,
        };
        Ok(match (own, waiting) {
            (Some(x), _) => AfterSpin::Answered(sent, Ok(x)),
            (None, Some(w)) => AfterSpin::Waiting(sent, w),
            (None, None) => {
                AfterSpin::Answered(sent, Ok(Err(RpcError::internal("a call lost its answer"))))
            }
        })
    }

    /// Awaits the answer of a sent call whose spin ran out. Dropped at
    /// its await, the call is cancelled (`cancel`, which holds what the
    /// call lent).
    async fn await_answer(
        &self,
        mut sent: Sent,
        w: oneshot::Receiver<Result<Frame, RpcError>>,
        mut cancel: Cancel<'_>,
    ) -> Result<Reply, Failure> {
        let got = match sent.deadline {
            None => w.await,
            Some(d) => match tokio::time::timeout_at(d.into(), w).await {
                Ok(r) => r,
                Err(_) => {
                    drop(cancel);
                    return Err(RpcError::deadline_exceeded(format!(
                        "no answer from {:?} before the deadline",
                        self.name
                    ))
                    .into());
                }
            },
        };
        sent.lent = cancel.disarm();
        self.conclude(sent, got)
    }

    /// How a sent call ends, given its answer (`got`: `Err` if whoever
    /// was to deliver it went away).
    fn conclude(
        &self,
        sent: Sent,
        got: Result<Result<Frame, RpcError>, oneshot::error::RecvError>,
    ) -> Result<Reply, Failure> {
        let i = self;
        let r = &i.reader;
        let Sent {
            frame,
            lent,
            deadline,
            again,
            id,
            spun,
        } = sent;
        if let Some((spin, at)) = spun {
            // The wait began a spin before it ran out.
            r.ended_after_spin(spin, spin + at.elapsed());
        }
        let got = got.unwrap_or_else(|_| Err(RpcError::unavailable("the connection closed")));
        let f = match got {
            Ok(f) => f,
            Err(e) => {
                if e.status == Status::Unavailable && i.may_resend(id, again.idempotent) {
                    // Its server stopped without taking it, or it may run twice.
                    return Err(Failure::not_run(frame, e, lent, deadline, i.refs, again));
                }
                lent.release(&i.node);
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
        self.goaway.unread(id) || (idempotent && self.reader.broken.load(Ordering::Acquire))
    }
}

impl AsyncConn {
    /// The next frame of stream `id` (an item, or the answer that ends
    /// it), as it comes; the error that broke the connection; or
    /// `DeadlineExceeded` once `deadline` passes. Whoever reads the
    /// connection's answers (its pump, or a server's listener) delivers
    /// it.
    pub(crate) async fn stream_next(
        &self,
        id: u64,
        deadline: Option<Instant>,
    ) -> Result<Frame, RpcError> {
        let next = std::future::poll_fn(|cx| self.reader.poll_stream(id, cx));
        let Some(d) = deadline else {
            return next.await;
        };
        match tokio::time::timeout_at(d.into(), next).await {
            Ok(got) => got,
            Err(_) => Err(RpcError::deadline_exceeded(format!(
                "no answer from {:?} before the deadline",
                self.name
            ))),
        }
    }
}

impl crate::stream::StreamConn for AsyncConn {
    fn node(&self) -> &Node {
        &self.node
    }

    fn refs(&self) -> crate::transport::Sharing {
        self.refs
    }

    fn carries(&self, req: &Frame, refs: crate::transport::Sharing) -> bool {
        carried(req, (refs, self.refs), self.max_inline)
    }

    fn never_taken(&self, id: u64) -> bool {
        if !self.goaway.unread(id) {
            // What is left to read of the broken connection, if nobody
            // else reads: its go-away may be there.
            if let Ok(rx) = self.reader.rx.try_lock() {
                self.reader.drain(rx);
            }
        }
        self.goaway.unread(id)
    }

    fn send_opening(
        &self,
        req: &mut Frame,
        deadline: Option<Instant>,
    ) -> Result<(), (RpcError, bool)> {
        let r = &self.reader;
        r.ensure_reader().map_err(|e| (e, false))?;
        if let Some(e) = self.failure() {
            return Err((e, false));
        }
        let mut first = Some(Slot::Stream(Box::default()));
        let mut enlist = |old: u64, new: u64| r.enlist(old, new, &mut first);
        let sent = r.send(&self.tx, Out::Listed(req, &mut enlist), deadline);
        sent_as(&self.name, sent, |e| r.fail(e))?;
        // A stream's frames come at any time: the pump reads while it is
        // open (a server's listener reads while any call waits).
        if r.driver.load(Ordering::Acquire) == PUMP {
            r.want_pump().map_err(|e| (e, false))?;
        }
        Ok(())
    }

    fn send_own(&self, f: &Frame, deadline: Option<Instant>) -> Result<(), (RpcError, bool)> {
        let r = &self.reader;
        sent_as(&self.name, r.send(&self.tx, Out::Kept(f), deadline), |e| {
            r.fail(e)
        })
    }

    fn close_stream(&self, id: u64, cancel: bool) {
        self.reader.forget(id);
        if cancel && !self.reader.broken.load(Ordering::Acquire) {
            lock(&self.tx).cancel(id);
        }
    }
}

/// A call that gave up its answer: its deadline passed, or its future was
/// dropped while it waited (a timeout around it, a `select!` that took
/// another branch). On drop, unless disarmed, it forgets the call (an
/// answer read later is released), releases what the argument lent, and
/// tells the server (best effort, without waiting: a queued request is
/// then skipped).
struct Cancel<'a> {
    inner: &'a AsyncConn,
    id: u64,
    lent: Option<crate::payload::Lent>,
}

impl Cancel<'_> {
    /// The call completed: what its argument lent, to end with it.
    fn disarm(&mut self) -> crate::payload::Lent {
        self.lent.take().unwrap_or_default()
    }
}

/// A future whose output goes through a function when it is ready: a
/// layer that adds nothing to the future's state but the function.
pub(crate) struct Then<F, G>(F, Option<G>);

impl<F, G> Then<F, G> {
    pub(crate) fn new(fut: F, then: G) -> Self {
        Then(fut, Some(then))
    }
}

impl<F: std::future::Future, G: FnOnce(F::Output) -> T, T> std::future::Future for Then<F, G> {
    type Output = T;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<T> {
        // SAFETY: the inner future is pinned structurally: it is never
        // moved out of `self`, which is pinned; the function is not
        // pinned (only taken, by value).
        let this = unsafe { self.get_unchecked_mut() };
        if this.1.is_none() {
            // Polled again after it was ready (its future is done and
            // must not be polled): pending for ever, as the Future
            // contract allows.
            return Poll::Pending;
        }
        // SAFETY: as above.
        let fut = unsafe { std::pin::Pin::new_unchecked(&mut this.0) };
        match fut.poll(cx) {
            Poll::Ready(v) => this.1.take().map_or(Poll::Pending, |g| Poll::Ready(g(v))),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// A request sent, past its spin: what ends its call.
struct Sent {
    frame: Frame,
    lent: crate::payload::Lent,
    deadline: Option<Instant>,
    again: Again,
    id: u64,
    /// The spin that ran out, and when (for the waiting policy).
    spun: Option<(Duration, Instant)>,
}

/// How a sent call's spin ended.
enum AfterSpin {
    /// With its answer (`Err`: whoever was to deliver it went away).
    Answered(
        Sent,
        Result<Result<Frame, RpcError>, oneshot::error::RecvError>,
    ),
    /// With its answer to come through this receiver.
    Waiting(Sent, oneshot::Receiver<Result<Frame, RpcError>>),
}

/// The answer of a call sent on a connection: ready (it came within the
/// spin, or the call failed), or awaited. The state kept across the wait
/// is boxed, so this stays small for the futures that hold it, and only
/// calls that wait pay for the box.
pub(crate) enum Answer<'a> {
    /// Taken by the first poll.
    Ready(Option<Result<Reply, Failure>>),
    /// The wait.
    Waiting(
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<Reply, Failure>> + Send + 'a>>,
    ),
}

impl std::future::Future for Answer<'_> {
    type Output = Result<Reply, Failure>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Self::Output> {
        match &mut *self {
            Answer::Ready(r) => Poll::Ready(
                r.take()
                    .unwrap_or_else(|| Err(RpcError::internal("an answer polled again").into())),
            ),
            Answer::Waiting(f) => f.as_mut().poll(cx),
        }
    }
}

/// A request waiting to go again across an await: if the call is dropped
/// meanwhile, what it lent is released.
struct Held(Option<Box<Refused>>, Node);

impl Held {
    fn take(mut self) -> Box<Refused> {
        // (Always held until taken.)
        self.0.take().unwrap_or_else(|| unreachable!())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(x) = self.0.take() {
            let _ = x.fail(&self.1);
        }
    }
}

impl Drop for Cancel<'_> {
    fn drop(&mut self) {
        let Some(lent) = self.lent.take() else {
            return;
        };
        let i = self.inner;
        i.reader.forget(self.id);
        lent.release(&i.node);
        // (Not waiting for the sending half: a drop must not block.)
        if let Ok(mut tx) = i.tx.try_lock() {
            tx.cancel(self.id);
        }
    }
}

/// Reads answers and completes the calls waiting for them while calls rely
/// on it (from a call's `want_pump` until none is pending), until the
/// client is dropped or the connection breaks. In between it waits on
/// `pump_cv` without the receiving half, which the calls then read
/// themselves.
fn pump(reader: Weak<Reader>) {
    loop {
        let Some(r) = reader.upgrade() else {
            return;
        };
        {
            let mut st = lock(&r.state);
            if st.pending.is_empty() {
                st.wanted = false;
            }
            if !st.wanted {
                // Looks again within 100 ms: the client may be gone.
                let _ = r.pump_cv.wait_timeout(st, Duration::from_millis(100));
                continue;
            }
        }
        // (The receiving half is held until what it gave is delivered: a
        // stream's items reach it in the order they came.)
        let mut rx = lock(&r.rx);
        let got = rx.recv(Some(Instant::now() + Duration::from_millis(100)));
        let alive = match got {
            Ok(None) => true,
            Ok(Some(f)) => r.deliver(Ok(f)),
            Err(e) => r.deliver(Err(e)),
        };
        drop(rx);
        if !alive {
            lock(&r.state).pumping = false;
            return;
        }
    }
}

impl Node {
    /// Like [`connect`](Self::connect), for async callers: calls are
    /// futures, any number may be outstanding on the connection.
    pub fn connect_async(&self, name: &str) -> Result<AsyncClient, RpcError> {
        Ok(AsyncClient::new(
            self.redialer(Target::Name(name.to_owned()))?,
        ))
    }

    /// Like [`connect_lazily`](Self::connect_lazily), for async callers.
    pub fn connect_async_lazily(&self, name: &str) -> Result<AsyncClient, RpcError> {
        dm_pool::validate_service_name(name)?;
        Ok(AsyncClient::new(Redial::unconnected(
            self.clone(),
            Target::Name(name.to_owned()),
        )))
    }

    /// Like [`connect_tcp`](Self::connect_tcp), for async callers.
    pub fn connect_tcp_async(&self, addr: &str) -> Result<AsyncClient, RpcError> {
        Ok(AsyncClient::new(
            self.redialer(Target::Addr(addr.to_owned()))?,
        ))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::frame::Body;
    use crate::transport::FrameTx;
    use std::sync::mpsc;

    /// Pending at its first poll (waking its waker), ready at the next.
    struct YieldOnce(bool);

    impl std::future::Future for YieldOnce {
        type Output = ();
        fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<()> {
            if self.0 {
                return Poll::Ready(());
            }
            self.0 = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    /// `Then` polls a future that borrows from itself across an await (so
    /// must stay where it is pinned) and maps its output once; a second
    /// poll after it was ready stays pending; one dropped while pending
    /// drops its future in place. (Run under Miri by `scripts/miri.sh`:
    /// its pinning is unsafe code.)
    #[test]
    fn then_maps_a_pinned_futures_output() {
        use std::future::Future;
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let inner = async {
            let v = vec![1u8, 2, 3];
            let r = &v;
            YieldOnce(false).await;
            r.len()
        };
        let mut t = std::pin::pin!(Then::new(inner, |n: usize| n * 10));
        assert!(t.as_mut().poll(&mut cx).is_pending());
        assert_eq!(t.as_mut().poll(&mut cx), Poll::Ready(30));
        assert!(t.as_mut().poll(&mut cx).is_pending());
        let dropped = std::sync::Arc::new(());
        let held = dropped.clone();
        let pending = async move {
            let _held = held;
            YieldOnce(false).await;
        };
        let mut t = Box::pin(Then::new(pending, |()| ()));
        assert!(t.as_mut().poll(&mut cx).is_pending());
        drop(t);
        assert_eq!(std::sync::Arc::strong_count(&dropped), 1);
    }

    /// A receiving half fed by the test.
    struct FedRx(mpsc::Receiver<Frame>);

    impl FrameRx for FedRx {
        fn recv(&mut self, _deadline: Option<Instant>) -> Result<Option<Frame>, TransportError> {
            Ok(self.0.try_recv().ok())
        }
    }

    /// A sending half that takes everything.
    struct Sink;

    impl FrameTx for Sink {
        fn send(&mut self, _f: &Frame, _d: Option<Instant>) -> Result<bool, TransportError> {
            Ok(true)
        }
    }

    fn answer(id: u64, byte: u8) -> Frame {
        Frame::response(id, Status::Ok, Body::Inline(vec![byte]))
    }

    fn byte(got: Option<Result<Frame, RpcError>>) -> u8 {
        match got {
            Some(Ok(Frame {
                payload: Body::Inline(b),
                ..
            })) => b[0],
            other => panic!("no answer: {other:?}"),
        }
    }

    #[test]
    fn spinning_calls_take_their_own_answers_and_find_the_others_in_their_slots() {
        let (_tp, c, feed) = fed_client(crate::WaitPolicy::default());
        let i = c.h.current();
        let r = &i.reader;
        r.driver.store(PUMP, Ordering::Release);
        for id in 1..=4 {
            r.insert(&mut lock(&r.state), id, Slot::Spinning);
        }
        // Call 1 reads past call 2's answer to its own: call 2's waits in
        // its slot.
        feed.send(answer(2, 20)).unwrap();
        feed.send(answer(1, 10)).unwrap();
        assert_eq!(byte(r.take_own(1)), 10);
        assert_eq!(r.ready.load(Ordering::Relaxed), 1);
        assert_eq!(byte(r.take_own(2)), 20);
        assert_eq!(r.ready.load(Ordering::Relaxed), 0);
        assert!(r.take_own(3).is_none(), "no answer yet");
        // Call 3's spin ran out after its answer came: it takes it
        // instead of waiting on a channel.
        feed.send(answer(3, 30)).unwrap();
        assert!(r.take_own(4).is_none());
        match r.await_own(3) {
            Err(got) => assert_eq!(byte(Some(got)), 30),
            Ok(_) => panic!("call 3 would wait for an answer already there"),
        }
        // Call 4 awaits on a channel; a second answer to it is dropped.
        let mut w = r
            .await_own(4)
            .unwrap_or_else(|_| panic!("call 4 has no answer yet"));
        feed.send(answer(4, 40)).unwrap();
        feed.send(answer(4, 41)).unwrap();
        assert!(r.take_own(99).is_none());
        assert_eq!(byte(w.try_recv().ok()), 40);
        assert_eq!(lock(&r.state).pending.len(), 0);
        // A connection that breaks while a call spins fails that call.
        r.insert(&mut lock(&r.state), 5, Slot::Spinning);
        r.break_all(RpcError::unavailable("gone"));
        match r.take_own(5) {
            Some(Err(e)) => assert_eq!(e.status, Status::Unavailable),
            other => panic!("call 5 got {other:?}"),
        }
        assert_eq!(r.ready.load(Ordering::Relaxed), 0);
        assert_eq!(r.waiting.load(Ordering::Relaxed), 0);
    }

    /// A client whose connection takes every frame and whose answers the
    /// test feeds, on a pool of its own.
    fn fed_client(
        wait: crate::WaitPolicy,
    ) -> (dm_pool::testing::TempPool, AsyncClient, mpsc::Sender<Frame>) {
        let tp = dm_pool::testing::TempPool::new(16 << 20);
        let node = Node::with_config(
            tp.attach(),
            crate::Config {
                wait,
                ..Default::default()
            },
        );
        let (feed, rx) = mpsc::channel();
        let conn = Connection {
            tx: Box::new(Sink),
            rx: Box::new(FedRx(rx)),
            max_inline: 1 << 20,
            refs: crate::transport::Sharing::POOL,
            goaway: crate::transport::silent(),
        };
        let target = crate::dial::Target::Name("test/lone".into());
        let h = Redial::new(node, target, crate::dial::Origin::Addr, conn);
        (tp, AsyncClient::new(h), feed)
    }

    #[test]
    fn a_lone_call_reads_its_own_answer_and_hands_the_others_theirs() {
        let (_tp, c, feed) = fed_client(crate::WaitPolicy::default());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        // Another call (id 100) spins meanwhile, through its slot.
        let r = c.h.current().reader.clone();
        r.insert(&mut lock(&r.state), 100, Slot::Spinning);
        feed.send(answer(100, 7)).unwrap();
        feed.send(answer(1, 10)).unwrap();
        let got = rt.block_on(c.call("m", Payload::empty())).unwrap();
        assert_eq!(got.to_vec().unwrap(), [10]);
        assert!(!c.has_pump(), "the answer was there: no pump");
        assert_eq!(byte(r.take_own(100)), 7);
        // A lone call whose spin runs out leaves its answer to the pump.
        let (_tp, c, feed) = fed_client(crate::WaitPolicy::park_only());
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            feed.send(answer(1, 11)).unwrap();
        });
        let got = rt.block_on(c.call("m", Payload::empty())).unwrap();
        assert_eq!(got.to_vec().unwrap(), [11]);
        assert!(c.has_pump());
        late.join().unwrap();
    }
}

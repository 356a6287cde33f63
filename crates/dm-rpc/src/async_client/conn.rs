//! One connection of an async client: sending a call, spinning for its
//! answer, awaiting it, cancelling it when its future is dropped, and
//! what a call that failed over keeps across its waits.

use crate::call::attempt::{carried, ended, outgoing, sent_as, Again, Failure, Outgoing, Refused};
use crate::call::failover::Link;
use crate::call::options::{CallOptions, Reply};
use crate::error::RpcError;
use crate::frame::{Frame, Status};
use crate::metadata::Metadata;
use crate::node::Node;
use crate::payload::Payload;
use crate::reconnect::Connected;
use crate::sender::{Out, Sender};
use crate::sync::lock;
use crate::transport::Connection;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

use super::reader::{Fed, Reader, Slot, State, LISTENER, NO_READER, PUMP};

/// One connection of an [`AsyncClient`].
pub struct AsyncConn {
    pub(super) node: Node,
    pub(super) name: String,
    pub(super) tx: Mutex<Sender>,
    pub(super) reader: Arc<Reader>,
    /// New calls go elsewhere ([`Connected::retire`]).
    pub(super) retired: AtomicBool,
    pub(super) max_inline: usize,
    pub(super) refs: crate::transport::Sharing,
    pub(super) goaway: Arc<dyn crate::transport::GoAway>,
}

impl std::fmt::Debug for AsyncConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncConn")
            .field("service", &self.name)
            .finish_non_exhaustive()
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
            pump: Arc::default(),
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

impl AsyncConn {
    /// Sends a call now; the future of its answer. (Like `send_and_wait`,
    /// for callers that await it at once.)
    pub(super) fn call_with(
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
    pub(super) fn resend(&self, r: Refused) -> Answer<'_> {
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
                    // Nothing sent: the request may go to the next server.
                    return Err(Failure::not_run(frame, e, lent, deadline, i.refs, again));
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
            r.ended_after_spin(spin, spin + r.came_after(at));
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
        // It spins first, reading the connection itself, as a call does
        // for its answer: a frame that comes within the spin wakes no
        // thread (the pump's hand-over costs microseconds).
        let r = &self.reader;
        let now = || r.try_stream(id).map(Ok);
        let poll = |cx: &mut std::task::Context<'_>| r.poll_stream(id, cx);
        self.wait_for(deadline, now, poll, "no answer").await
    }
}

impl AsyncConn {
    /// Takes one grant for an item the caller of stream `id` sends,
    /// awaiting one: `Ok(false)` once the stream's answer came or the
    /// stream was closed (the server takes no more); `DeadlineExceeded`
    /// once `deadline` passes.
    pub(crate) async fn item_credit(
        &self,
        id: u64,
        deadline: Option<Instant>,
    ) -> Result<bool, RpcError> {
        let r = &self.reader;
        let now = || {
            r.try_credit(id).or_else(|| {
                // Reads what came, if nobody else does.
                if let Ok(rx) = r.rx.try_lock() {
                    r.drain(rx);
                }
                r.try_credit(id)
            })
        };
        let poll = |cx: &mut std::task::Context<'_>| r.poll_credit(id, cx);
        self.wait_for(deadline, now, poll, "no room for an item")
            .await
    }

    /// Waits for what `poll` gives: spinning first, checking `now` (which
    /// may read the connection itself), as a call spins for its answer;
    /// then, with someone reading for it (the pump, unless a server's
    /// listener reads), awaiting it (`poll` registers its waker). A spin that ran out just before the
    /// wait ended grows the next one again, as a call's does.
    /// `DeadlineExceeded` (saying `what` came) once `deadline` passes.
    async fn wait_for<T>(
        &self,
        deadline: Option<Instant>,
        now: impl FnMut() -> Option<Result<T, RpcError>>,
        mut poll: impl FnMut(&mut std::task::Context<'_>) -> Poll<Result<T, RpcError>>,
        what: &str,
    ) -> Result<T, RpcError> {
        let r = &self.reader;
        let (got, spun) = r.spin_with(deadline, now, || {
            r.check();
        });
        if let Some(x) = got {
            return x;
        }
        let at = Instant::now();
        // Someone reads for it while it waits (the pump, unless a server's
        // listener does), asked once its waker is in place: the pump
        // reads only while a caller is parked.
        let mut asked = r.driver.load(Ordering::Acquire) != PUMP;
        let waited = std::future::poll_fn(|cx| {
            let p = poll(cx);
            if p.is_pending() && !std::mem::replace(&mut asked, true) {
                if let Err(e) = r.want_pump() {
                    return Poll::Ready(Err(e));
                }
            }
            p
        });
        let got = match deadline {
            None => waited.await,
            Some(d) => match tokio::time::timeout_at(d.into(), waited).await {
                Ok(got) => got,
                Err(_) => Err(RpcError::deadline_exceeded(format!(
                    "{what} from {:?} before the deadline",
                    self.name
                ))),
            },
        };
        r.ended_after_spin(spun, spun + r.came_after(at));
        got
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
        let mut first = Some(Slot::Stream(Fed::default()));
        let mut enlist = |old: u64, new: u64| r.enlist(old, new, &mut first);
        let sent = r.send(&self.tx, Out::Listed(req, &mut enlist), deadline);
        sent_as(&self.name, sent, |e| r.fail(e))?;
        // (Its frames are read by its caller while it spins for them, and
        // by the pump once it waits: `stream_next`.)
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
pub(super) struct Cancel<'a> {
    pub(super) inner: &'a AsyncConn,
    pub(super) id: u64,
    pub(super) lent: Option<crate::payload::Lent>,
}

impl Cancel<'_> {
    /// The call completed: what its argument lent, to end with it.
    fn disarm(&mut self) -> crate::payload::Lent {
        self.lent.take().unwrap_or_default()
    }
}

/// A request sent, past its spin: what ends its call.
pub(super) struct Sent {
    pub(super) frame: Frame,
    pub(super) lent: crate::payload::Lent,
    pub(super) deadline: Option<Instant>,
    pub(super) again: Again,
    pub(super) id: u64,
    /// The spin that ran out, and when (for the waiting policy).
    pub(super) spun: Option<(Duration, Instant)>,
}

/// How a sent call's spin ended.
pub(super) enum AfterSpin {
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
pub(super) struct Held(pub(super) Option<Box<Refused>>, pub(super) Node);

impl Held {
    pub(super) fn take(mut self) -> Box<Refused> {
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

impl crate::stream::ItemConn for AsyncConn {
    fn regrant(&self, id: u64) {
        self.reader.regrant(id);
    }

    fn finish_or_cancel(&self, id: u64) {
        if !self.reader.broken.load(Ordering::Acquire) {
            lock(&self.tx).finish_or_cancel(id);
        }
    }

    fn cancel_call(&self, id: u64) {
        if !self.reader.broken.load(Ordering::Acquire) {
            lock(&self.tx).cancel(id);
        }
    }

    fn carries_what(&self) -> (usize, crate::transport::Sharing) {
        (self.max_inline, self.refs)
    }
}

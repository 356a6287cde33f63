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

use crate::error::RpcError;
use crate::frame::{method_id, Body, Frame, Kind, Status, FLAG_REFUSED};
use crate::handoff::{Half, Held};
use crate::metadata::Metadata;
use crate::node::Node;
use crate::payload::{Dir, Lent, Payload};
use crate::reconnect::{Connected, Redial};
use crate::retry::{Retry, Statuses};
use crate::sender::{send_holding_rx, send_unheld, Out, Sender};
use crate::transport::{Connection, FrameRx};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Options of one call.
///
/// A call made while a handler serves a call (on the dispatcher's thread)
/// waits no longer than the served call's caller does: it takes the
/// earlier of its own deadline and the served one (see [`crate::deadline`]),
/// unless it is `detached`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallOptions {
    /// How long to wait for the answer (the server also skips the call if
    /// it is still queued when this passes). None: the node's default.
    pub deadline: Option<Duration>,
    /// Do not inherit the deadline of the call being served (for work
    /// meant to outlive it).
    pub detached: bool,
    /// If the connection broke and the service is not registered again
    /// yet, wait (until the deadline) for it to come back instead of
    /// failing at once with `Unavailable` (gRPC's `wait_for_ready`).
    pub wait_for_ready: bool,
    /// The call may run more than once: if its connection breaks while it
    /// is in flight (its server died, or closed the connection without
    /// saying which requests it took), it is sent again, as a request
    /// known not to have run is, to the service registered next (up to
    /// three times, within its deadline).
    pub idempotent: bool,
    /// Send it again when its answer has one of these statuses, up to a
    /// number of attempts, after growing waits, within its deadline
    /// ([`crate::retry`]). None: the client's policy
    /// ([`Client::with_retry`]), if any.
    pub retry: Option<Retry>,
    /// Items a streaming call's caller holds unread at most
    /// ([`Client::call_stream`], [`crate::stream`]); 0: the default,
    /// [`DEFAULT_WINDOW`](crate::stream::DEFAULT_WINDOW). Unary calls
    /// ignore it.
    pub window: u32,
}

impl CallOptions {
    /// These options, with a streaming call's window (see
    /// [`window`](Self::window)).
    pub fn window(self, items: u32) -> Self {
        CallOptions {
            window: items,
            ..self
        }
    }

    /// Options with a deadline.
    pub fn deadline(d: Duration) -> Self {
        CallOptions {
            deadline: Some(d),
            ..CallOptions::default()
        }
    }

    /// These options for the rest of a call that waited for ready: its
    /// deadline is what is left until `until` (the deadline of the whole
    /// call).
    pub(crate) fn after_waiting(self, until: Option<Instant>) -> Self {
        match until {
            Some(u) => CallOptions {
                deadline: Some(u.saturating_duration_since(Instant::now())),
                ..self
            },
            None => self,
        }
    }

    /// These options, waiting for a service that went away to come back
    /// (see [`wait_for_ready`](Self::wait_for_ready)).
    pub fn wait_for_ready(self) -> Self {
        CallOptions {
            wait_for_ready: true,
            ..self
        }
    }

    /// These options, for a call that may run more than once (see
    /// [`idempotent`](Self::idempotent)).
    pub fn idempotent(self) -> Self {
        CallOptions {
            idempotent: true,
            ..self
        }
    }

    /// These options, with a retry policy (see [`retry`](Self::retry)).
    pub fn retry(self, policy: Retry) -> Self {
        CallOptions {
            retry: Some(policy),
            ..self
        }
    }

    /// These options, not inheriting the deadline of the call being served.
    pub fn detached(self) -> Self {
        CallOptions {
            detached: true,
            ..self
        }
    }
}

/// A client of one service. Its connection is replaced when it breaks
/// and the service is registered again ([`crate::reconnect`]).
#[derive(Clone)]
pub struct Client {
    h: Arc<Redial<Inner>>,
    defaults: Defaults,
}

/// What a client adds to each of its calls (every client's
/// `with_metadata`, `with_retry` and `intercept`).
#[derive(Clone, Default)]
pub(crate) struct Defaults {
    /// Metadata every call carries.
    pub(crate) meta: Metadata,
    /// The retry policy of calls that set none.
    pub(crate) retry: Option<Retry>,
    /// Run on every call, in order, before it is sent.
    pub(crate) interceptors: Vec<CallInterceptor>,
    /// Run on every unary call's outcome, in order, before it is returned.
    pub(crate) answer_interceptors: Vec<AnswerInterceptor>,
}

impl std::fmt::Debug for Defaults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Defaults")
            .field("meta", &self.meta)
            .field("retry", &self.retry)
            .field("interceptors", &self.interceptors.len())
            .field("answer_interceptors", &self.answer_interceptors.len())
            .finish()
    }
}

impl Defaults {
    /// These defaults with `meta`.
    pub(crate) fn with_meta(&self, meta: Metadata) -> Defaults {
        Defaults {
            meta,
            ..self.clone()
        }
    }

    /// These defaults with `policy`.
    pub(crate) fn with_retry(&self, policy: Retry) -> Defaults {
        Defaults {
            retry: Some(policy),
            ..self.clone()
        }
    }

    /// These defaults with `check` run after the interceptors already there.
    pub(crate) fn with_interceptor(&self, check: CallInterceptor) -> Defaults {
        let mut d = self.clone();
        d.interceptors.push(check);
        d
    }

    /// These defaults with `see` run after the answer interceptors already
    /// there.
    pub(crate) fn with_answer_interceptor(&self, see: AnswerInterceptor) -> Defaults {
        let mut d = self.clone();
        d.answer_interceptors.push(see);
        d
    }

    /// How a unary call of `method` ended, as its caller gets it: `r` as
    /// the answer interceptors leave it.
    #[inline]
    pub(crate) fn answered(
        &self,
        method: &str,
        mut r: Result<Reply, RpcError>,
    ) -> Result<Reply, RpcError> {
        if let Err(e) = &mut r {
            crate::error::name_the_method(e, method);
        }
        if !self.answer_interceptors.is_empty() {
            self.see_answer(method, &mut r);
        }
        r
    }

    #[cold]
    fn see_answer(&self, method: &str, r: &mut Result<Reply, RpcError>) {
        for see in &self.answer_interceptors {
            see(method, r);
        }
    }

    /// A call of `method` with `payload`: its options and metadata with
    /// these added (the call's own keys and policy win), then as the
    /// interceptors leave them; or the error of the first interceptor
    /// that refuses it (nothing is sent).
    #[inline]
    pub(crate) fn apply(
        &self,
        method: &str,
        payload: &Payload,
        opts: CallOptions,
        mut meta: Metadata,
    ) -> Result<(CallOptions, Metadata), RpcError> {
        meta.fill_from(&self.meta);
        let opts = match self.retry {
            Some(r) if opts.retry.is_none() => opts.retry(r),
            _ => opts,
        };
        if !self.interceptors.is_empty() {
            self.intercept(method, payload, &opts, &mut meta)?;
        }
        Ok((opts, meta))
    }

    #[cold]
    fn intercept(
        &self,
        method: &str,
        payload: &Payload,
        opts: &CallOptions,
        meta: &mut Metadata,
    ) -> Result<(), RpcError> {
        let mut call = OutgoingCall {
            method,
            options: opts,
            metadata: meta,
            len: payload.len(),
        };
        for check in &self.interceptors {
            check(&mut call)?;
        }
        Ok(())
    }
}

/// A check or change every call of a client passes before it is sent
/// ([`Client::intercept`]): a token or trace id added to its metadata, a
/// call refused on the caller's side, logging.
pub type CallInterceptor = Arc<dyn Fn(&mut OutgoingCall<'_>) -> Result<(), RpcError> + Send + Sync>;

/// What every unary call of a client ends with passes before its caller
/// gets it ([`Client::intercept_answers`]): the method called and the
/// outcome, which it may change (an error translated, metadata taken
/// off), or only look at it (counting statuses, logging).
pub type AnswerInterceptor = Arc<dyn Fn(&str, &mut Result<Reply, RpcError>) + Send + Sync>;

/// A call as a client's interceptor sees it, before it is sent: its
/// method, options, metadata (which the interceptor may change) and
/// payload size (not the payload's bytes).
#[derive(Debug)]
pub struct OutgoingCall<'a> {
    method: &'a str,
    options: &'a CallOptions,
    metadata: &'a mut Metadata,
    len: u64,
}

impl OutgoingCall<'_> {
    /// The method's name.
    pub fn method(&self) -> &str {
        self.method
    }

    /// The call's options (the client's retry policy applied).
    pub fn options(&self) -> &CallOptions {
        self.options
    }

    /// The metadata the call carries (the client's `with_metadata` keys
    /// included).
    pub fn metadata(&self) -> &Metadata {
        self.metadata
    }

    /// The metadata, to add keys to or change.
    pub fn metadata_mut(&mut self) -> &mut Metadata {
        self.metadata
    }

    /// Bytes of the payload (inline or by Ref).
    pub fn payload_len(&self) -> u64 {
        self.len
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("service", &self.h.target())
            .finish()
    }
}

/// One connection of a [`Client`].
pub(crate) struct Inner {
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
    streams: Vec<(u64, VecDeque<Frame>)>,
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

    fn stream(&mut self, id: u64) -> Option<&mut VecDeque<Frame>> {
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

/// Whether a client takes frames of this kind from its server: answers,
/// and items of the streams it opened.
#[inline]
pub(crate) fn answers(kind: Kind) -> bool {
    matches!(kind, Kind::Response | Kind::Item)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A request ready to send: what both clients compute from a call (and
/// keep of a request to send it again).
pub(crate) struct Outgoing {
    pub(crate) method: u32,
    pub(crate) body: Body,
    pub(crate) meta: Metadata,
    /// What the argument lends (the Ref the framework made for it, or the
    /// payload it forwards): ended when the call completes, whatever its
    /// outcome.
    pub(crate) lent: Lent,
    pub(crate) deadline: Option<Instant>,
    /// What is left of the deadline, as the request says it (0: none).
    pub(crate) deadline_us: u32,
    /// When it may be sent again besides when it is known not to have run.
    pub(crate) again: Again,
}

/// When a request may be sent again besides when it is known not to have
/// run ([`Failure::Refused`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Again {
    /// Its connection broke while it was in flight, and it may run twice
    /// ([`CallOptions::idempotent`]).
    pub(crate) idempotent: bool,
    /// Its answer has one of these statuses ([`CallOptions::retry`]).
    pub(crate) on: Statuses,
}

impl Outgoing {
    /// Its request frame, and what the call keeps beside it: what the
    /// argument lent, when it gives up, and when it may be sent again.
    /// (The frame is kept until the answer: a request known not to have
    /// run is sent again. Its call id, 0 here, is drawn when it enters a
    /// connection: [`crate::sender`].)
    pub(crate) fn into_frame(self) -> (Frame, Lent, Option<Instant>, Again) {
        let mut frame = Frame::request(0, self.method, self.deadline_us, self.body);
        frame.meta = self.meta;
        (frame, self.lent, self.deadline, self.again)
    }
}

/// When a call with `opts` gives up (the earlier of its own deadline, or
/// the node's default, and the served one unless detached), and whether
/// the served call's caller gave up already.
pub(crate) fn deadline_of(node: &Node, opts: CallOptions, now: Instant) -> (Option<Instant>, bool) {
    let own = opts.deadline.or(node.cfg.default_deadline).map(|d| now + d);
    let served = if opts.detached {
        None
    } else {
        crate::deadline::served()
    };
    let d = match (own, served) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    (d, served.is_some_and(|s| s <= now))
}

/// Applies the size-aware rule and the deadline to a call of `method`
/// with `meta`.
pub(crate) fn outgoing(
    node: &Node,
    max_inline: usize,
    refs: crate::transport::Sharing,
    method: &str,
    payload: Payload,
    opts: CallOptions,
    mut meta: Metadata,
) -> Result<Outgoing, RpcError> {
    // What the call being served passes on (ServerBuilder::propagate_metadata).
    crate::metadata::inherit_into(&mut meta);
    let (deadline, deadline_us) = if opts.deadline.is_none()
        && node.cfg.default_deadline.is_none()
        && (opts.detached || crate::deadline::served().is_none())
    {
        // (No clock read on the common path.)
        (None, 0)
    } else {
        let now = Instant::now();
        let (d, gone) = deadline_of(node, opts, now);
        if gone {
            // Its caller gave up already: nothing to send.
            return Err(RpcError::deadline_exceeded(
                "the deadline of the call being served has passed",
            ));
        }
        match d {
            None => (None, 0),
            Some(d) => {
                let left = d.saturating_duration_since(now).as_micros();
                (Some(d), left.clamp(1, u32::MAX as u128) as u32)
            }
        }
    };
    // (The metadata travels in the frame too, within the receiver's limit.)
    let inline_max = meta
        .inline_room(node.cfg.inline_max, max_inline)
        .map_err(|(len, max)| {
            RpcError::invalid_argument(format!(
                "metadata of {len} bytes exceeds the limit of {max}"
            ))
        })?;
    let (body, lent) = payload.into_body(node, inline_max, Dir::Request, refs)?;
    crate::stats::count(&body, true);
    Ok(Outgoing {
        method: method_id(method),
        body,
        meta,
        lent,
        deadline,
        deadline_us,
        again: again_of(opts),
    })
}

/// How long a call whose answer `x` has a status its retry policy lists
/// waits before attempt `n`; None to give up: no attempt left, the server
/// said not to, or the wait would outlast the deadline.
pub(crate) fn retry_wait(x: &Refused, n: u32, policy: Option<Retry>) -> Option<Duration> {
    let wait = policy?.wait(n, x.answer_metadata())?;
    match x.deadline() {
        Some(d) if Instant::now() + wait >= d => None,
        _ => Some(wait),
    }
}

/// When a call with `opts` may be sent again: a retry policy that lists
/// `Unavailable` makes it idempotent too.
fn again_of(opts: CallOptions) -> Again {
    let on = opts.retry.map(|r| r.retries_on()).unwrap_or_default();
    Again {
        idempotent: opts.idempotent || on.contains(Status::Unavailable),
        on,
    }
}

/// The error an answer of an error status carries (with its metadata).
pub(crate) fn answer_error(f: Frame) -> RpcError {
    RpcError::new(f.status, message_of(f.payload)).with_metadata(f.meta)
}

/// What a send's outcome `r`, over a connection to `name`, means for its
/// call: sent, or the error and whether the connection broke with it (it
/// is then marked broken with `broke`, and the frame was not sent: a
/// request may go elsewhere).
pub(crate) fn sent_as(
    name: &str,
    r: Result<bool, crate::transport::TransportError>,
    broke: impl FnOnce(crate::transport::TransportError) -> RpcError,
) -> Result<(), (RpcError, bool)> {
    match r {
        Ok(true) => Ok(()),
        Ok(false) => Err((
            RpcError::deadline_exceeded(format!("no room to send to {name:?} before the deadline")),
            false,
        )),
        Err(e) if e.breaks_connection() => Err((broke(e), true)),
        Err(e) => Err((e.into(), false)),
    }
}

/// Whether request `req`, placed for a connection whose Refs are
/// `sharing.0`, can go as it is over one whose Refs are `sharing.1` and
/// largest inline payload `max_inline` (its Refs usable there, its inline
/// bytes and metadata within the limit).
pub(crate) fn carried(
    req: &Frame,
    sharing: (crate::transport::Sharing, crate::transport::Sharing),
    max_inline: usize,
) -> bool {
    goes_as_is(
        req.payload.len() + req.meta.encoded_len(),
        sharing,
        max_inline,
    )
}

/// Whether a request of `len` bytes of payload and metadata, placed for a
/// connection whose Refs are `from.0`, can go as it is over one whose Refs
/// are `from.1` and largest inline payload `max_inline` (a request sent
/// again elsewhere).
fn goes_as_is(
    len: usize,
    (from, to): (crate::transport::Sharing, crate::transport::Sharing),
    max_inline: usize,
) -> bool {
    from == to && len <= max_inline
}

/// A call's answer with the metadata its handler set
/// ([`crate::metadata::set_reply`]); see [`Client::call_full`].
#[derive(Debug, Default)]
pub struct Reply {
    /// What the handler returned.
    pub payload: Payload,
    /// The answer's metadata (empty if the handler set none).
    pub metadata: Metadata,
}

/// How the answer `f` to request `frame` ends its call: a refusal or a
/// status its retry policy lists lets the request go again (with what it
/// lent, its deadline, the sharing it was placed for and when it may go
/// again); any other answer is the call's result.
pub(crate) fn ended(
    node: &Node,
    frame: Frame,
    f: Frame,
    (lent, deadline, refs, again): (Lent, Option<Instant>, crate::transport::Sharing, Again),
) -> Result<Reply, Failure> {
    if f.flags & FLAG_REFUSED != 0 {
        return Err(Failure::not_run(
            frame,
            refusal(f),
            lent,
            deadline,
            refs,
            again,
        ));
    }
    if f.status != Status::Ok && again.on.contains(f.status) {
        // Its retry policy lists this status: it may go again.
        let r = Refused::new(frame, answer_error(f), lent, deadline, refs, again);
        return Err(Failure::Again(Box::new(r)));
    }
    drop(frame);
    Ok(answer(node, f, lent)?)
}

/// Turns an answer frame into the call's result, ending what the
/// argument lent.
pub(crate) fn answer(node: &Node, f: Frame, lent: Lent) -> Result<Reply, RpcError> {
    crate::stats::count(&f.payload, false);
    if f.status != Status::Ok {
        lent.release(node);
        return Err(answer_error(f));
    }
    let payload = lent.answer(node, f.flags, f.payload)?;
    Ok(Reply {
        payload,
        metadata: f.meta,
    })
}

/// How a call on one connection failed.
pub(crate) enum Failure {
    /// With this error.
    Error(RpcError),
    /// Not run, and known not to be: refused by a server shutting down
    /// ([`FLAG_REFUSED`]), never taken by a server that stopped
    /// ([`crate::transport::GoAway`]), or never sent (the connection
    /// broke first). It may be sent again elsewhere.
    Refused(Box<Refused>),
    /// Run, and answered with a status its retry policy lists: it may be
    /// sent again, to the same service, after a wait ([`crate::retry`]).
    Again(Box<Refused>),
}

impl Failure {
    /// The failure of request `frame`, placed for a connection with
    /// `refs`, which did not run (or may run again: `idempotent`) because
    /// of `e`: it may be sent again elsewhere.
    #[cold]
    pub(crate) fn not_run(
        frame: Frame,
        e: RpcError,
        lent: Lent,
        deadline: Option<Instant>,
        refs: crate::transport::Sharing,
        again: Again,
    ) -> Failure {
        let r = Refused::new(frame, e, lent, deadline, refs, again);
        Failure::Refused(Box::new(r))
    }
}

impl From<RpcError> for Failure {
    fn from(e: RpcError) -> Self {
        Failure::Error(e)
    }
}

/// A request known not to have run ([`Failure::Refused`]), with what it
/// takes to send it again: its method, its payload as it was sent (its
/// Refs still lent), its metadata and its deadline.
pub(crate) struct Refused {
    pub(crate) req: Outgoing,
    /// The sharing of Refs of the connection it was placed for.
    refs: crate::transport::Sharing,
    /// Why it did not run: the call's error if it is not sent again.
    error: RpcError,
}

/// The error of a refusal answer ([`FLAG_REFUSED`]).
pub(crate) fn refusal(answer: Frame) -> RpcError {
    RpcError::new(Status::Unavailable, message_of(answer.payload))
}

impl Refused {
    /// The request `frame`, which did not run because of `error`.
    pub(crate) fn new(
        frame: Frame,
        error: RpcError,
        lent: Lent,
        deadline: Option<Instant>,
        refs: crate::transport::Sharing,
        again: Again,
    ) -> Refused {
        let req = Outgoing {
            method: frame.method,
            body: frame.payload,
            meta: frame.meta,
            lent,
            deadline,
            deadline_us: frame.deadline_us,
            again,
        };
        Refused { req, refs, error }
    }

    /// The metadata of the answer that made it go again.
    pub(crate) fn answer_metadata(&self) -> &Metadata {
        &self.error.metadata
    }

    /// When the call gives up.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.req.deadline
    }

    /// Whether a connection with `refs` and `max_inline` can carry it as
    /// it is (its Refs usable at the other end, its inline bytes and
    /// metadata within the limit).
    pub(crate) fn fits(&self, refs: crate::transport::Sharing, max_inline: usize) -> bool {
        let len = self.req.body.len() + self.req.meta.encoded_len();
        goes_as_is(len, (self.refs, refs), max_inline)
    }

    /// Gives up sending it again, with `e`: ends what it lent.
    pub(crate) fn drop_with(self, node: &Node, e: RpcError) -> RpcError {
        self.req.lent.release(node);
        e
    }

    /// The request to send again to `name`, with what is left of its
    /// deadline; or, if its deadline passed, the call's error (what it
    /// lent released).
    pub(crate) fn left(self, node: &Node, name: &str) -> Result<Outgoing, RpcError> {
        let mut req = self.req;
        let Some(d) = req.deadline else {
            req.deadline_us = 0;
            return Ok(req);
        };
        match d.saturating_duration_since(Instant::now()).as_micros() {
            0 => {
                req.lent.release(node);
                Err(RpcError::deadline_exceeded(format!(
                    "the deadline passed before {name:?} could be called again"
                )))
            }
            us => {
                req.deadline_us = us.min(u32::MAX as u128) as u32;
                Ok(req)
            }
        }
    }

    /// Gives up sending it: ends what it lent; the refusal.
    pub(crate) fn fail(self, node: &Node) -> RpcError {
        self.req.lent.release(node);
        self.error
    }
}

/// The message an error answer carries.
fn message_of(b: Body) -> String {
    match b {
        Body::Inline(m) => String::from_utf8_lossy(&m).into_owned(),
        _ => String::new(),
    }
}

/// An answer nobody waits for (its caller gave up): a Ref in it was made
/// for us, so release it.
pub(crate) fn orphan(node: &Node, f: Frame) {
    if f.flags & crate::frame::FLAG_ECHO != 0 {
        // Our request's own Ref passed back: released with the call.
        return;
    }
    if let Body::Refs(rs) = f.payload {
        for r in rs {
            let _ = node.pool.release_ref(&r);
        }
    }
}

impl Connected for Inner {
    fn open(node: Node, name: &str, conn: Connection) -> Inner {
        Inner {
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
}

impl Client {
    pub(crate) fn new(h: Redial<Inner>) -> Client {
        Client {
            h: Arc::new(h),
            defaults: Defaults::default(),
        }
    }

    /// A client on the same connection whose calls that set no retry
    /// policy of their own follow `policy` ([`crate::retry`]): the
    /// service's retry configuration.
    pub fn with_retry(&self, policy: Retry) -> Client {
        Client {
            h: self.h.clone(),
            defaults: self.defaults.with_retry(policy),
        }
    }

    /// A client on the same connection whose calls all carry `meta` (a
    /// credential, a client name), besides their own; a key a call sets
    /// itself keeps the call's value.
    pub fn with_metadata(&self, meta: Metadata) -> Client {
        Client {
            h: self.h.clone(),
            defaults: self.defaults.with_meta(meta),
        }
    }

    /// A client on the same connection whose calls all pass `check`
    /// first (after the interceptors this client has), in the calling
    /// thread, before anything is placed or sent: it sees each call's
    /// method, options, metadata and payload size, may add to or change
    /// the metadata (a token, a trace id), and may refuse the call with
    /// an error, which the call then returns. It runs once per call, not
    /// again when a request is sent again (to a restarted server, or
    /// under a retry policy).
    pub fn intercept(
        &self,
        check: impl Fn(&mut OutgoingCall<'_>) -> Result<(), RpcError> + Send + Sync + 'static,
    ) -> Client {
        Client {
            h: self.h.clone(),
            defaults: self.defaults.with_interceptor(Arc::new(check)),
        }
    }

    /// A client on the same connection whose unary calls' outcomes all
    /// pass `see` (after the answer interceptors this client has), in the
    /// calling thread, before the caller gets them: the method called and
    /// the answer or error, whatever ended the call (a request
    /// interceptor's refusal too), after any retries. It may change the
    /// outcome. A streaming call's items and end do not pass it.
    pub fn intercept_answers(
        &self,
        see: impl Fn(&str, &mut Result<Reply, RpcError>) + Send + Sync + 'static,
    ) -> Client {
        Client {
            h: self.h.clone(),
            defaults: self.defaults.with_answer_interceptor(Arc::new(see)),
        }
    }

    /// Whether new calls would go over the current connection (false
    /// once it broke or was retired, until a call replaces it).
    pub fn is_connected(&self) -> bool {
        !self.h.current().is_spent()
    }

    /// The service this client calls.
    pub fn service(&self) -> &str {
        self.h.target()
    }

    /// How many times the client connected again after its connection
    /// broke.
    pub fn reconnects(&self) -> u64 {
        self.h.redials()
    }

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

    /// Its connection and how it is replaced.
    pub(crate) fn redial(&self) -> &Redial<Inner> {
        &self.h
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
    ) -> Result<(arc_swap::Guard<Arc<Inner>>, CallOptions), RpcError> {
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
    /// with a status its retry policy lists) on connection `c` ends.
    #[cold]
    #[inline(never)]
    fn again(
        &self,
        mut c: arc_swap::Guard<Arc<Inner>>,
        mut r: Result<Reply, Failure>,
        opts: CallOptions,
    ) -> Result<Reply, RpcError> {
        let mut attempt = 1;
        loop {
            // A request known not to have run (refused by a server shutting
            // down, never taken by one that stopped, never sent) goes to the
            // service's next server, and so does an idempotent one whose
            // connection broke (a few times at most: it may be stopping too).
            for _ in 0..3 {
                let Err(Failure::Refused(x)) = r else { break };
                self.h.refused(&c);
                let mut n = self.h.live();
                if opts.wait_for_ready && n.is_spent() {
                    match self.h.ready(n, x.deadline()) {
                        Ok(ready) => n = ready,
                        Err(e) => return Err(x.drop_with(&c.node, e)),
                    }
                }
                if Arc::ptr_eq(&n, &c) || n.is_spent() || !x.fits(n.refs, n.max_inline) {
                    return Err(x.fail(&c.node));
                }
                c = n;
                r = c.resend(*x);
            }
            // An answer whose status its retry policy lists: again, after
            // a wait, on the client's connection then.
            let Err(Failure::Again(x)) = r else { break };
            attempt += 1;
            let Some(wait) = retry_wait(&x, attempt, opts.retry) else {
                return Err(x.fail(&c.node));
            };
            std::thread::sleep(wait);
            let n = self.h.live();
            if n.is_spent() || !x.fits(n.refs, n.max_inline) {
                return Err(x.fail(&c.node));
            }
            c = n;
            r = c.resend(*x);
        }
        self.h.settle(&c, r)
    }
}

impl Inner {
    fn call_with(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Result<Reply, Failure> {
        let (node, refs) = (&self.node, self.refs);
        let out = outgoing(node, self.max_inline, refs, method, payload, opts, meta)?;
        self.send_and_wait(out)
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
            // A broken connection fails the call at once.
            lent.release(&i.node);
            return Err(e.into());
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
        if f.kind == Kind::Response {
            if let Some(slot) = st.slot(f.call_id) {
                *slot = Some(f);
                return;
            }
        }
        match st.stream(f.call_id) {
            Some(q) => q.push_back(f),
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
            list_under(&mut st.streams, old, new, VecDeque::new)
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
            st.stream(id).and_then(VecDeque::pop_front)
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
    fn wait_until(
        &self,
        id: u64,
        deadline: Option<Instant>,
        mut take: impl FnMut(&mut State) -> Option<Frame>,
    ) -> Result<Frame, RpcError> {
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

impl crate::stream::StreamConn for Inner {
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
                Some(k) => st.streams.swap_remove(k).1,
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::transport::Sharing;

    fn refused(deadline: Option<Instant>, inline: usize, meta: Metadata) -> Refused {
        let req = Frame::request(1, 7, 9, Body::Inline(vec![1; inline])).with_meta(meta);
        let answer = Frame::refused(1, "the service is shutting down");
        let lent = Lent::default();
        let again = Again {
            idempotent: true,
            ..Again::default()
        };
        Refused::new(req, refusal(answer), lent, deadline, Sharing::POOL, again)
    }

    #[test]
    fn a_refused_request_goes_again_only_where_it_fits_and_in_time() {
        let tp = dm_pool::testing::TempPool::new(16 << 20);
        let node = Node::new(tp.attach());
        let none = Metadata::new;
        let r = refused(None, 800, none());
        assert_eq!((r.req.method, r.req.body.len()), (7, 800));
        // The same sharing, and room for its bytes (and its metadata).
        assert!(r.fits(Sharing::POOL, 1000));
        assert!(r.fits(Sharing::POOL, 800));
        assert!(!r.fits(Sharing::POOL, 799));
        assert!(!r.fits(Sharing::ALL, 1000));
        let meta = Metadata::new().with("k", "v").unwrap();
        let m = refused(None, 800, meta.clone());
        assert!(m.fits(Sharing::POOL, 805) && !m.fits(Sharing::POOL, 804));
        // Sent again as it was, with what is left of its deadline.
        let again = m.left(&node, "s").unwrap();
        assert_eq!(
            (again.deadline_us, again.again.idempotent),
            (0, true),
            "no deadline"
        );
        assert_eq!((again.method, again.meta), (7, meta));
        let soon = Instant::now() + Duration::from_secs(5);
        let us = refused(Some(soon), 1, none())
            .left(&node, "s")
            .unwrap()
            .deadline_us;
        assert!(us > 4_000_000 && us <= 5_000_000, "{us}");
        let Err(e) = refused(Some(Instant::now()), 1, none()).left(&node, "s") else {
            panic!("sent again after its deadline");
        };
        assert_eq!(e.status, Status::DeadlineExceeded);
        let e = refused(None, 1, none()).fail(&node);
        assert_eq!(e.status, Status::Unavailable);
        assert!(e.message.contains("shutting down"), "{e}");
        drop(node);
        tp.assert_clean();
    }
}

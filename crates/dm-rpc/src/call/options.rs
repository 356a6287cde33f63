//! What a caller gives a call and gets back: its options
//! ([`CallOptions`]), what a client adds to each of its calls (metadata, a
//! retry policy, interceptors: `Defaults`), and the answer ([`Reply`]).

use crate::error::RpcError;
use crate::metadata::Metadata;
use crate::payload::Payload;
use crate::retry::Retry;
use std::sync::Arc;
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
    /// ([`Client::with_retry`](crate::Client::with_retry)), if any.
    pub retry: Option<Retry>,
    /// Items a streaming call's caller holds unread at most
    /// ([`Client::call_stream`](crate::Client::call_stream), [`crate::stream`]); 0: the default,
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
/// ([`Client::intercept`](crate::Client::intercept)): a token or trace id added to its metadata, a
/// call refused on the caller's side, logging.
pub type CallInterceptor = Arc<dyn Fn(&mut OutgoingCall<'_>) -> Result<(), RpcError> + Send + Sync>;

/// What every unary call of a client ends with passes before its caller
/// gets it ([`Client::intercept_answers`](crate::Client::intercept_answers)): the method called and the
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

/// A call's answer with the metadata its handler set
/// ([`crate::metadata::set_reply`]); see [`Client::call_full`](crate::Client::call_full).
#[derive(Debug, Default)]
pub struct Reply {
    /// What the handler returned.
    pub payload: Payload,
    /// The answer's metadata (empty if the handler set none).
    pub metadata: Metadata,
}

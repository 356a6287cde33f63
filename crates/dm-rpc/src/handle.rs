//! What every client has, blocking or async: its connection, replaced
//! when it breaks ([`Redial`]), and what it adds to each of its calls
//! (metadata, a retry policy, interceptors). [`Client`](crate::Client)
//! and [`AsyncClient`](crate::AsyncClient) are [`ClientOf`] over their
//! kinds of connection; their calls are in `client.rs` and
//! `async_client/`.

use crate::call::options::{Defaults, OutgoingCall, Reply};
use crate::error::RpcError;
use crate::metadata::Metadata;
use crate::reconnect::{Connected, Redial};
use crate::retry::Retry;
use std::sync::Arc;

/// A client of one service over connections of kind `C` (see
/// [`Client`](crate::Client) and [`AsyncClient`](crate::AsyncClient)).
pub struct ClientOf<C> {
    pub(crate) h: Arc<Redial<C>>,
    pub(crate) defaults: Defaults,
}

impl<C> Clone for ClientOf<C> {
    fn clone(&self) -> Self {
        ClientOf {
            h: self.h.clone(),
            defaults: self.defaults.clone(),
        }
    }
}

// (Connected is the crate's own: users name only Client and AsyncClient.)
#[allow(private_bounds)]
impl<C: Connected> std::fmt::Debug for ClientOf<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(C::CLIENT)
            .field("service", &self.h.target())
            .finish()
    }
}

#[allow(private_bounds)]
impl<C: Connected> ClientOf<C> {
    pub(crate) fn new(h: Redial<C>) -> Self {
        ClientOf {
            h: Arc::new(h),
            defaults: Defaults::default(),
        }
    }

    /// This client with other defaults, on the same connection.
    fn with(&self, defaults: Defaults) -> Self {
        ClientOf {
            h: self.h.clone(),
            defaults,
        }
    }

    /// A client on the same connection whose calls that set no retry
    /// policy of their own follow `policy` ([`crate::retry`]): the
    /// service's retry configuration.
    pub fn with_retry(&self, policy: Retry) -> Self {
        self.with(self.defaults.with_retry(policy))
    }

    /// A client on the same connection whose calls all carry `meta` (a
    /// credential, a client name), besides their own; a key a call sets
    /// itself keeps the call's value.
    pub fn with_metadata(&self, meta: Metadata) -> Self {
        self.with(self.defaults.with_meta(meta))
    }

    /// A client on the same connection whose calls all pass `check`
    /// first (after the interceptors this client has), in the calling
    /// thread or task, before anything is placed or sent: it sees each
    /// call's method, options, metadata and payload size, may add to or
    /// change the metadata (a token, a trace id), and may refuse the call
    /// with an error, which the call then returns. It runs once per call,
    /// not again when a request is sent again (to a restarted server, or
    /// under a retry policy).
    pub fn intercept(
        &self,
        check: impl Fn(&mut OutgoingCall<'_>) -> Result<(), RpcError> + Send + Sync + 'static,
    ) -> Self {
        self.with(self.defaults.with_interceptor(Arc::new(check)))
    }

    /// A client on the same connection whose unary calls' outcomes all
    /// pass `see` (after the answer interceptors this client has), before
    /// the caller gets them: the method called and the answer or error,
    /// whatever ended the call (a request interceptor's refusal too),
    /// after any retries. It may change the outcome. A streaming call's
    /// items and end do not pass it.
    pub fn intercept_answers(
        &self,
        see: impl Fn(&str, &mut Result<Reply, RpcError>) + Send + Sync + 'static,
    ) -> Self {
        self.with(self.defaults.with_answer_interceptor(Arc::new(see)))
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

    /// Its connection and how it is replaced.
    pub(crate) fn redial(&self) -> &Redial<C> {
        &self.h
    }
}

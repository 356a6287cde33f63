//! Client-side load balancing over the replicas of a service: servers that
//! share one name ([`ServerBuilder::replica`](crate::ServerBuilder::replica)),
//! in any processes and over any transports. A [`BalancedClient`] (or
//! [`AsyncBalancedClient`]) keeps a connection to every replica and sends
//! each call to the replica with the fewest of its calls in flight, taking
//! turns among equals: one caller's calls go round robin, and a slow
//! replica gets fewer of many callers' calls (gRPC's `round_robin` and
//! least-request policies, in one).
//!
//! * **Replicas come and go.** The client looks the name up again every
//!   [`REFRESH_EVERY`], and within [`REFRESH_SOON`] after a call fails
//!   with `Unavailable`, finds a connection spent, or failed over to
//!   another replica, on the thread of the call that finds it due (a scan
//!   of the registry, and dialling the replicas it has no connection to),
//!   or when asked ([`BalancedClient::refresh`]). Where the node's
//!   registry watches names (etcd: [`crate::Registry::changes`]), the
//!   next call after a change looks at once. A new replica gets
//!   calls from then on; the connection to a replica that left is dropped
//!   from the set (calls in flight on it go on). (The pool's registry has
//!   no change counter a client could watch per call without a cache
//!   miss: its header line is written by every `create_ref`; hence the
//!   period.)
//! * **Each replica's connection is a client of its own**
//!   ([`crate::reconnect`]), so what a client does holds per replica:
//!   deadlines, metadata, retry policies, and above all failover. A
//!   request that a replica refuses unrun as it shuts down, or never took
//!   before it stopped (its go-away), is sent again to another replica of
//!   the name, as it was (its Refs still lent), and so is an idempotent
//!   one whose connection broke; a graceful restart of replicas one at a
//!   time fails no call. A call in flight on a replica that dies
//!   (`kill -9`) fails with `Unavailable`, unless idempotent, as with a
//!   plain client; no new call goes to it once its connection is known
//!   broken.
//! * With no replica left, calls fail at once with `Unavailable` (or,
//!   with [`CallOptions::wait_for_ready`], wait for one until their
//!   deadline), and the client keeps looking.
//!
//! Picking a replica costs a load of the set (no lock), a shared counter
//! and a scan of the replicas' in-flight counts: a few nanoseconds per
//! replica.

use crate::async_client::AsyncClient;
use crate::call::options::{CallOptions, Defaults, OutgoingCall, Reply};
use crate::client::Client;
use crate::dial::{Origin, Route, Target};
use crate::error::RpcError;
use crate::frame::Status;
use crate::metadata::Metadata;
use crate::node::Node;
use crate::payload::Payload;
use arc_swap::ArcSwap;
use dm_sys::time::monotonic_ms_coarse as now_ms;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often a balanced client looks its replicas up again.
pub const REFRESH_EVERY: Duration = Duration::from_millis(500);
/// How soon after a call failed with `Unavailable` (or found a
/// connection it could not use, or failed over) the replicas are looked
/// up again (give or take a tick of the coarse clock).
pub const REFRESH_SOON: Duration = Duration::from_millis(1);

/// A connection to one replica, as the balancer sees it: a client of the
/// name whose first connection went to that replica.
pub(crate) trait Member: Send + Sync + Sized + 'static {
    /// A client of `name` connected along `route`.
    fn open(node: &Node, name: &str, route: &Route) -> Result<Self, RpcError>;
    /// Whether new calls should not use it (broken, or retired).
    fn spent(&self) -> bool;
    /// The registration its connection went to.
    fn origin(&self) -> Option<Origin>;
    /// How many times its connection was replaced (it failed over to
    /// another replica, or dialled its service again).
    fn redials(&self) -> u64;
}

impl Member for Client {
    fn open(node: &Node, name: &str, route: &Route) -> Result<Self, RpcError> {
        Ok(Client::new(node.redialer_along(name, route)?))
    }

    fn spent(&self) -> bool {
        !self.is_connected()
    }

    fn origin(&self) -> Option<Origin> {
        self.redial().origin()
    }

    fn redials(&self) -> u64 {
        self.redial().redials()
    }
}

impl Member for AsyncClient {
    fn open(node: &Node, name: &str, route: &Route) -> Result<Self, RpcError> {
        Ok(AsyncClient::new(node.redialer_along(name, route)?))
    }

    fn spent(&self) -> bool {
        !self.is_connected()
    }

    fn origin(&self) -> Option<Origin> {
        self.redial().origin()
    }

    fn redials(&self) -> u64 {
        self.redial().redials()
    }
}

/// One replica's connection and its calls in flight.
struct Replica<C> {
    client: C,
    busy: AtomicUsize,
    /// Its client's [`Member::redials`] when last looked at.
    redials: AtomicU64,
}

impl<C: Member> Replica<C> {
    fn new(client: C) -> Self {
        let redials = AtomicU64::new(client.redials());
        Replica {
            client,
            busy: AtomicUsize::new(0),
            redials,
        }
    }
}

/// A call in flight on a replica (counted until dropped: an async call
/// dropped midway too).
struct Busy<C>(Arc<Replica<C>>);

impl<C> Busy<C> {
    fn on(r: Arc<Replica<C>>) -> Self {
        r.busy.fetch_add(1, Ordering::Relaxed);
        Busy(r)
    }
}

impl<C> Drop for Busy<C> {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The replicas of a name and the choice among them.
struct Balancer<C> {
    node: Node,
    name: String,
    /// The connections in use (never empty).
    set: ArcSwap<Vec<Arc<Replica<C>>>>,
    /// Whose turn it is among equals.
    turn: AtomicUsize,
    /// When the replicas are next looked up, in ms of the coarse
    /// monotonic clock (read on every call: a tick is 4 ms, a fine read
    /// costs several times as much).
    next: AtomicU64,
    /// Held by the call that looks them up.
    refreshing: Mutex<()>,
    /// How many replicas the last look found and connected to.
    found: AtomicUsize,
    /// How soon (ms) to look again after a failure: [`REFRESH_SOON`],
    /// doubling up to [`crate::reconnect::MAX_BACKOFF`] while looks find
    /// no replica to call (a caller in a loop on a service that is gone
    /// does not scan the registry every millisecond).
    backoff: AtomicU64,
    /// The registry's change counter of the name, where it watches
    /// ([`crate::Registry::changes`]), and its value at the last look.
    changes: Option<(Arc<AtomicU64>, AtomicU64)>,
}

impl<C: Member> Balancer<C> {
    /// Connects to every replica of `name` (`NotFound` if it has none;
    /// the first error if none could be dialled).
    fn connect(node: &Node, name: &str) -> Result<Self, RpcError> {
        dm_pool::validate_service_name(name)?;
        // (Watched from before the first look: no change is missed.)
        let changes = node.registry.changes(name).map(|c| {
            let seen = AtomicU64::new(c.load(Ordering::Acquire));
            (c, seen)
        });
        let routes = node.resolve_all(&Target::Name(name.to_owned()))?;
        let mut set = Vec::with_capacity(routes.len());
        let mut first_error = None;
        for r in &routes {
            match C::open(node, name, r) {
                Ok(c) => set.push(Arc::new(Replica::new(c))),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if set.is_empty() {
            return Err(first_error.unwrap_or_else(|| node.no_service(name)));
        }
        let found = AtomicUsize::new(set.len());
        Ok(Balancer {
            node: node.clone(),
            name: name.to_owned(),
            set: ArcSwap::from_pointee(set),
            turn: AtomicUsize::new(0),
            next: AtomicU64::new(now_ms() + REFRESH_EVERY.as_millis() as u64),
            refreshing: Mutex::new(()),
            found,
            backoff: AtomicU64::new(REFRESH_SOON.as_millis() as u64),
            changes,
        })
    }

    fn now(&self) -> u64 {
        now_ms()
    }

    /// Looks the replicas up again soon: within [`REFRESH_SOON`], or the
    /// backoff while looks find no replica.
    fn soon(&self, now: u64) {
        let after = self.backoff.load(Ordering::Relaxed);
        self.next.fetch_min(now + after, Ordering::Relaxed);
    }

    /// The replica the next call goes to: the one with the fewest calls
    /// in flight, from whoever's turn it is (a spent one only if all are).
    fn pick(&self) -> Arc<Replica<C>> {
        let now = self.now();
        if let Some((c, seen)) = &self.changes {
            // A watched name changed: look now.
            let v = c.load(Ordering::Acquire);
            if v != seen.load(Ordering::Relaxed) {
                seen.store(v, Ordering::Relaxed);
                self.next.store(now, Ordering::Relaxed);
            }
        }
        if now >= self.next.load(Ordering::Relaxed) {
            self.refresh_if_due(now, false);
        }
        let set = self.set.load();
        let n = set.len();
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        // Whoever's turn it is, if idle and usable (one caller: always).
        let first = &set[turn % n];
        if first.busy.load(Ordering::Relaxed) == 0 && !first.client.spent() {
            return first.clone();
        }
        let mut best: Option<&Arc<Replica<C>>> = None;
        let mut least = usize::MAX;
        for k in 0..n {
            let r = &set[(turn + k) % n];
            if r.client.spent() {
                // Its replica left or broke: the set is looked at again.
                self.soon(now);
                continue;
            }
            let busy = r.busy.load(Ordering::Relaxed);
            if busy < least {
                (least, best) = (busy, Some(r));
                if busy == 0 {
                    break;
                }
            }
        }
        match best {
            Some(r) => r.clone(),
            None => {
                // Every connection is spent: the call goes over one of them
                // (which dials another replica if there is one, or fails
                // at once, or waits for ready), and the set is looked up
                // again soon.
                self.soon(now);
                set[turn % n].clone()
            }
        }
    }

    /// After a call on `on` ended with `r`: an `Unavailable` failure, or
    /// a connection that failed over to another replica meanwhile (its
    /// replica refused the call as it left, or broke), makes the set be
    /// looked up again soon (the replica that left may have a successor,
    /// and two connections may now go to one replica).
    fn after<T>(&self, on: &Replica<C>, r: &Result<T, RpcError>) {
        let redials = on.client.redials();
        let moved = redials != on.redials.load(Ordering::Relaxed);
        if moved {
            on.redials.store(redials, Ordering::Relaxed);
        }
        if moved || matches!(r, Err(e) if e.status == Status::Unavailable) {
            self.soon(self.now());
        }
    }

    /// Looks the replicas up if it is time, unless another call is doing
    /// so; or, `force`d, now (after the look in progress, if any).
    fn refresh_if_due(&self, now: u64, force: bool) {
        let _g = if force {
            crate::sync::lock(&self.refreshing)
        } else {
            match self.refreshing.try_lock() {
                Ok(g) => g,
                Err(_) => return,
            }
        };
        if !force && now < self.next.load(Ordering::Relaxed) {
            return;
        }
        self.next
            .store(now + REFRESH_EVERY.as_millis() as u64, Ordering::Relaxed);
        self.refresh();
    }

    /// Keeps the connections to replicas still registered (one each),
    /// dials those it has none to, and drops the rest.
    fn refresh(&self) {
        let target = Target::Name(self.name.clone());
        let routes = match self.node.resolve_all(&target) {
            Ok(r) => r,
            Err(e) if e.status == Status::NotFound => Vec::new(),
            // A registry that failed to answer changes nothing.
            Err(_) => return,
        };
        let old = self.set.load_full();
        let mut set = Vec::with_capacity(routes.len());
        let mut covered: Vec<Origin> = Vec::with_capacity(routes.len());
        for r in old.iter() {
            if r.client.spent() {
                continue;
            }
            let Some(o) = r.client.origin() else { continue };
            // (Two connections may have gone to one replica: one failed
            // over to it from a replica that left.)
            if !covered.contains(&o) && routes.iter().any(|x| x.origin == o) {
                covered.push(o);
                set.push(r.clone());
            }
        }
        for route in &routes {
            if covered.contains(&route.origin) {
                continue;
            }
            if let Ok(c) = C::open(&self.node, &self.name, route) {
                covered.push(route.origin.clone());
                set.push(Arc::new(Replica::new(c)));
            }
        }
        self.found.store(set.len(), Ordering::Relaxed);
        let soon = REFRESH_SOON.as_millis() as u64;
        let backoff = if set.is_empty() {
            // No replica: keep one connection, whose calls fail at once or
            // wait for ready, and whose redial finds the next replica.
            set.push(old[0].clone());
            let max = crate::reconnect::MAX_BACKOFF.as_millis() as u64;
            (self.backoff.load(Ordering::Relaxed) * 2).min(max)
        } else {
            soon
        };
        self.backoff.store(backoff, Ordering::Relaxed);
        self.set.store(Arc::new(set));
    }

    /// How many replicas new calls may go to: connections not known to be
    /// broken, to replicas the last look found.
    fn replicas(&self) -> usize {
        let usable = self.set.load().iter().filter(|r| !r.client.spent()).count();
        usable.min(self.found.load(Ordering::Relaxed))
    }

    /// How many times the connections in use were replaced (failed over).
    fn failovers(&self) -> u64 {
        self.set.load().iter().map(|r| r.client.redials()).sum()
    }
}

impl<C> std::fmt::Debug for Balancer<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Balancer")
            .field("service", &self.name)
            .field("connections", &self.set.load().len())
            .finish()
    }
}

/// A client of every replica of a service, spreading its calls over them
/// (see the [module](self)): a [`BalancedClient`] (blocking calls) or an
/// [`AsyncBalancedClient`] (calls are futures). Cheap to clone: clones
/// share the connections.
pub struct Balanced<C> {
    b: Arc<Balancer<C>>,
    defaults: Defaults,
}

/// A [`Balanced`] client whose calls block.
pub type BalancedClient = Balanced<Client>;

/// A [`Balanced`] client for async callers: calls are futures.
pub type AsyncBalancedClient = Balanced<AsyncClient>;

impl<C> Clone for Balanced<C> {
    fn clone(&self) -> Self {
        Balanced {
            b: self.b.clone(),
            defaults: self.defaults.clone(),
        }
    }
}

impl<C> std::fmt::Debug for Balanced<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Balanced")
            .field("balancer", &self.b)
            .field("defaults", &self.defaults)
            .finish()
    }
}

// `Member` stays the crate's own: the only clients balanced are `Client`
// and `AsyncClient`.
#[allow(private_bounds)]
impl<C: Member> Balanced<C> {
    pub(crate) fn connect(node: &Node, name: &str) -> Result<Self, RpcError> {
        Ok(Balanced {
            b: Arc::new(Balancer::connect(node, name)?),
            defaults: Defaults::default(),
        })
    }

    /// The service this client calls.
    pub fn service(&self) -> &str {
        &self.b.name
    }

    /// How many replicas new calls may go to now.
    pub fn replicas(&self) -> usize {
        self.b.replicas()
    }

    /// How many times the connections in use failed over to another
    /// replica (or connected again to their service).
    pub fn reconnects(&self) -> u64 {
        self.b.failovers()
    }

    /// Looks the replicas up now (new ones get calls from the next one
    /// on), rather than at the next [`REFRESH_EVERY`].
    pub fn refresh(&self) {
        self.b.refresh_if_due(self.b.now(), true);
    }

    /// A client on the same connections whose calls that set no retry
    /// policy of their own follow `policy` ([`crate::retry`]).
    pub fn with_retry(&self, policy: crate::retry::Retry) -> Self {
        Balanced {
            b: self.b.clone(),
            defaults: self.defaults.with_retry(policy),
        }
    }

    /// A client on the same connections whose calls all carry `meta`
    /// besides their own (a key a call sets itself keeps the call's value).
    pub fn with_metadata(&self, meta: Metadata) -> Self {
        Balanced {
            b: self.b.clone(),
            defaults: self.defaults.with_meta(meta),
        }
    }

    /// A client on the same connections whose calls all pass `check` first
    /// ([`crate::Client::intercept`]: once per call, before anything is sent).
    pub fn intercept(
        &self,
        check: impl Fn(&mut OutgoingCall<'_>) -> Result<(), RpcError> + Send + Sync + 'static,
    ) -> Self {
        Balanced {
            b: self.b.clone(),
            defaults: self.defaults.with_interceptor(std::sync::Arc::new(check)),
        }
    }

    /// A client on the same connections whose unary calls' outcomes all
    /// pass `see` ([`crate::Client::intercept_answers`]).
    pub fn intercept_answers(
        &self,
        see: impl Fn(&str, &mut Result<Reply, RpcError>) + Send + Sync + 'static,
    ) -> Self {
        Balanced {
            b: self.b.clone(),
            defaults: self
                .defaults
                .with_answer_interceptor(std::sync::Arc::new(see)),
        }
    }
}

impl Balanced<Client> {
    /// Calls `method` with `payload` on one replica.
    pub fn call(&self, method: &str, payload: impl Into<Payload>) -> Result<Payload, RpcError> {
        self.call_with(method, payload.into(), CallOptions::default())
    }

    /// Calls `method` with a copy of `data`, made once, straight into the
    /// pool when it travels by Ref.
    pub fn call_slice(&self, method: &str, data: &[u8]) -> Result<Payload, RpcError> {
        let r = self.b.pick();
        match r.client.payload_for(data) {
            Ok(p) => self
                .call_on(r, method, p, CallOptions::default(), Metadata::new())
                .map(|r| r.payload),
            // (A copy that failed ends the call: its answer interceptors see it.)
            Err(e) => self.defaults.answered(method, Err(e)).map(|r| r.payload),
        }
    }

    /// Calls `method` with options.
    pub fn call_with(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
    ) -> Result<Payload, RpcError> {
        self.call_full(method, payload, opts, Metadata::new())
            .map(|r| r.payload)
    }

    /// Calls `method` with options and metadata.
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

    /// Calls `method` with options and metadata on one replica, and
    /// returns the answer with its metadata ([`Client::call_full`]).
    pub fn call_full(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Result<Reply, RpcError> {
        self.call_on(self.b.pick(), method, payload, opts, meta)
    }

    /// Calls streaming method `method` on one replica (the one with the
    /// fewest calls and streams in flight; a stream counts until it is
    /// dropped): see [`Client::call_stream`].
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

    /// [`call_stream`](Self::call_stream) with options and metadata
    /// ([`Client::call_stream_with`]).
    pub fn call_stream_with(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Result<crate::stream::Streaming, RpcError> {
        let (opts, meta) = self.defaults.apply(method, &payload, opts, meta)?;
        let busy = Busy::on(self.b.pick());
        let out = busy.0.client.call_stream_with(method, payload, opts, meta);
        self.b.after(&busy.0, &out);
        Ok(out?.holding(Box::new(busy)))
    }

    fn call_on(
        &self,
        r: Arc<Replica<Client>>,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Result<Reply, RpcError> {
        let out = self
            .defaults
            .apply(method, &payload, opts, meta)
            .and_then(|(opts, meta)| {
                let busy = Busy::on(r);
                let out = busy.0.client.call_full(method, payload, opts, meta);
                self.b.after(&busy.0, &out);
                out
            });
        self.defaults.answered(method, out)
    }
}

impl Balanced<AsyncClient> {
    /// Calls `method` with `payload` on one replica (chosen when the
    /// future is first polled).
    pub fn call<'a>(
        &'a self,
        method: &'a str,
        payload: impl Into<Payload>,
    ) -> impl std::future::Future<Output = Result<Payload, RpcError>> + Send + 'a {
        self.call_with(method, payload.into(), CallOptions::default())
    }

    /// Calls `method` with a copy of `data`, made once.
    pub async fn call_slice(&self, method: &str, data: &[u8]) -> Result<Payload, RpcError> {
        let r = self.b.pick();
        match r.client.payload_for(data) {
            Ok(p) => {
                let out = self.call_on(r, method, p, CallOptions::default(), Metadata::new());
                out.await.map(|r| r.payload)
            }
            // (A copy that failed ends the call: its answer interceptors see it.)
            Err(e) => self.defaults.answered(method, Err(e)).map(|r| r.payload),
        }
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

    /// Calls `method` with options and metadata. (The layers above
    /// `call_full` are its future, not futures around it: see
    /// [`AsyncClient::call_full`](crate::AsyncClient::call_full).)
    pub fn call_with_metadata<'a>(
        &'a self,
        method: &'a str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> impl std::future::Future<Output = Result<Payload, RpcError>> + Send + 'a {
        crate::async_client::Then::new(
            self.call_full(method, payload, opts, meta),
            |r: Result<Reply, RpcError>| r.map(|r| r.payload),
        )
    }

    /// Calls `method` with options and metadata on one replica, and
    /// returns the answer with its metadata.
    pub async fn call_full(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Result<Reply, RpcError> {
        self.call_on(self.b.pick(), method, payload, opts, meta)
            .await
    }

    /// Calls streaming method `method` on one replica (the stream counts
    /// as in flight there until it is dropped): see
    /// [`AsyncClient::call_stream`].
    pub async fn call_stream(
        &self,
        method: &str,
        payload: impl Into<Payload>,
    ) -> Result<crate::stream::AsyncStreaming, RpcError> {
        let p = payload.into();
        self.call_stream_with(method, p, CallOptions::default(), Metadata::new())
            .await
    }

    /// [`call_stream`](Self::call_stream) with options and metadata
    /// ([`AsyncClient::call_stream_with`]).
    pub async fn call_stream_with(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Result<crate::stream::AsyncStreaming, RpcError> {
        let (opts, meta) = self.defaults.apply(method, &payload, opts, meta)?;
        let busy = Busy::on(self.b.pick());
        let out = busy.0.client.call_stream_with(method, payload, opts, meta);
        let out = out.await;
        self.b.after(&busy.0, &out);
        Ok(out?.holding(Box::new(busy)))
    }

    async fn call_on(
        &self,
        r: Arc<Replica<AsyncClient>>,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Result<Reply, RpcError> {
        let out = match self.defaults.apply(method, &payload, opts, meta) {
            Ok((opts, meta)) => {
                let busy = Busy::on(r);
                let out = busy.0.client.call_full(method, payload, opts, meta).await;
                self.b.after(&busy.0, &out);
                out
            }
            Err(e) => Err(e),
        };
        self.defaults.answered(method, out)
    }
}

impl Node {
    /// A client of every replica of service `name`
    /// ([`ServerBuilder::replica`](crate::ServerBuilder::replica)), spreading its calls over them and
    /// following them as they come and go ([`crate::balance`]). A name
    /// with one registration works too (one replica). `NotFound` if the
    /// name has none.
    pub fn connect_balanced(&self, name: &str) -> Result<BalancedClient, RpcError> {
        BalancedClient::connect(self, name)
    }

    /// Like [`connect_balanced`](Self::connect_balanced), for async callers.
    pub fn connect_balanced_async(&self, name: &str) -> Result<AsyncBalancedClient, RpcError> {
        AsyncBalancedClient::connect(self, name)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::Transport;

    fn replica(node: &Node, name: &str) -> crate::Server {
        node.server(name)
            .transport(Transport::Mem)
            .replica()
            .method("echo", |c| Ok(c.take_payload()))
            .spawn()
            .unwrap()
    }

    /// Looks without replicas back off (1 ms doubling up to 0.5 s); a look
    /// that finds one starts over, and one asked for looks at once.
    #[test]
    fn looks_that_find_no_replica_back_off_and_a_found_one_resets_them() {
        let tp = dm_pool::testing::TempPool::new(16 << 20);
        let node = Node::new(tp.attach());
        let name = format!("test/balance/backoff/{}", std::process::id());
        let svc = replica(&node, &name);
        let b: Balancer<Client> = Balancer::connect(&node, &name).unwrap();
        assert_eq!(b.replicas(), 1);
        svc.shutdown();
        let mut seen = Vec::new();
        for _ in 0..12 {
            b.refresh_if_due(b.now(), true);
            seen.push(b.backoff.load(Ordering::Relaxed));
        }
        assert_eq!(seen, [2, 4, 8, 16, 32, 64, 128, 256, 500, 500, 500, 500]);
        assert_eq!(b.replicas(), 0);
        // A call on the connection kept fails (its server is gone): the
        // next look comes after the backoff, not at once.
        let now = b.now();
        let r = b.pick();
        let e = r.client.call("echo", crate::Payload::empty()).unwrap_err();
        assert_eq!(e.status, Status::Unavailable, "{e}");
        b.next.store(u64::MAX, Ordering::Relaxed);
        b.after(&r, &Err::<(), _>(e));
        assert!(b.next.load(Ordering::Relaxed) >= now + 500);
        assert!(r.client.spent());
        drop(r);
        let back = replica(&node, &name);
        b.refresh_if_due(b.now(), true);
        assert_eq!((b.replicas(), b.backoff.load(Ordering::Relaxed)), (1, 1));
        drop(b);
        back.shutdown();
        drop(node);
        tp.assert_clean();
    }
}

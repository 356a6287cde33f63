//! Reconnecting: a client whose connection broke (its server died, shut
//! down or closed it) opens a new one when a call finds the service
//! registered again, so a restarted service, or another process taking
//! over its name, is called through the clients its predecessor had.
//!
//! * Calls in flight when the connection breaks fail with `Unavailable`:
//!   whether the server ran them is unknown, so none is sent again (only
//!   a request refused unrun is: see below).
//! * A call that finds the connection broken looks the service up again
//!   (its name, in this process, the node's registry and the pool's; or
//!   its TCP address) and dials what it finds. Over TCP that may be the
//!   same registration (a connection can break while both ends live:
//!   the network, a proxy), dialled with [`REDIAL_TIMEOUT`]. Over shared
//!   memory or in memory a connection breaks only when its server closes
//!   it or dies, so the registration whose connection broke is not
//!   dialled again: a server that died on another host stays registered
//!   until its lease ends, and a new connection to it would only wait for
//!   that. Until there is something to dial, calls fail at once with the
//!   error that broke the connection. A name shared by replicas
//!   ([`ServerBuilder::replica`](crate::ServerBuilder::replica)) has
//!   several registrations: a connection is current while its own is
//!   among them, and one that broke goes to another replica first.
//! * Lookups are spaced out, from [`FIRST_BACKOFF`] doubling up to
//!   [`MAX_BACKOFF`] while they find nothing new: a caller retrying in a
//!   loop neither scans the registry nor dials on every call. A call in
//!   between fails at once.
//! * A server that shuts down gracefully unregisters at once and refuses
//!   new requests while it drains, with an `Unavailable` answer flagged
//!   [`FLAG_REFUSED`](crate::frame::FLAG_REFUSED): the request was not
//!   run. The connection is then retired (calls in flight on it go on,
//!   new ones go to the successor) and the refused request is sent again
//!   to the successor, as it was (its Refs still lent), if there is one
//!   and it can carry it (the same sharing of Refs, room for its inline
//!   bytes); else the call fails with the refusal. Any other `Unavailable`
//!   answer looks the service up, and retires the connection if its
//!   registration changed.
//! * Callers use the connection through an [`ArcSwap`]: a call loads it
//!   with no lock (about 5 ns on the test machine), and a call in flight
//!   keeps the connection it was sent on; the broken one closes when its
//!   last call ends.
//!
//! Dialling is done by the call that found the connection broken, on its
//! thread (an async call too: a lookup, and opening a channel in the pool
//! or a TCP connection, as `connect` does).

use crate::call::attempt::Failure;
use crate::call::failover::Link;
use crate::dial::{How, Origin, Route, Target};
use crate::error::RpcError;
use crate::node::Node;
use crate::transport::Connection;
use arc_swap::{ArcSwap, Guard};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long `connect` waits for a TCP peer to accept.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a call that redials waits for a TCP peer to accept (a peer
/// that does not answer then is tried again after the backoff).
pub const REDIAL_TIMEOUT: Duration = Duration::from_secs(1);
/// The first pause after a lookup that found nothing new.
pub const FIRST_BACKOFF: Duration = Duration::from_millis(1);
/// The longest pause between lookups.
pub const MAX_BACKOFF: Duration = Duration::from_millis(500);

/// A client's connection, as [`Redial`] sees it.
pub(crate) trait Connected: Send + Sync + Sized + 'static {
    /// A connection of `node` to `name` over `conn`.
    fn open(node: Node, name: &str, conn: Connection) -> Self;
    /// Whether new calls should not use the connection: it broke (every
    /// call on it now fails), or it was retired.
    fn is_spent(&self) -> bool;
    /// Sends no more new calls over the connection (its service's
    /// registration changed); calls in flight go on.
    fn retire(&self);
    /// Breaks the connection with `e` (every call on it fails so).
    fn break_with(&self, e: RpcError);
    /// The error that broke it, if it broke.
    fn failure(&self) -> Option<RpcError>;
    /// What a request that must go again can tell of it.
    fn link(&self) -> Link;
    /// The name of the clients of this kind of connection (for `Debug`).
    const CLIENT: &'static str;
}

/// The current connection of a client, replaced when it breaks and its
/// service is registered again.
pub(crate) struct Redial<C> {
    cur: ArcSwap<C>,
    /// Connections opened after the first (read without the lock: a
    /// balanced client learns so that one of its connections moved).
    redials: std::sync::atomic::AtomicU64,
    node: Node,
    target: Target,
    dial: Mutex<Dial>,
}

/// The state of redialling.
struct Dial {
    /// The registration the current connection was opened to (None: not
    /// connected yet).
    origin: Option<Origin>,
    /// No lookup before this.
    next: Option<Instant>,
    /// The pause after the next lookup that finds nothing new.
    backoff: Duration,
    /// The last lookup of [`Redial::recheck`].
    rechecked: Option<Instant>,
}

impl<C: Connected> Redial<C> {
    /// A client's first connection, opened to `origin` over `conn`.
    pub(crate) fn new(node: Node, target: Target, origin: Origin, conn: Connection) -> Self {
        let first = C::open(node.clone(), target.text(), conn);
        Redial::with(node, target, Some(origin), first)
    }

    /// A client that connects on its first call (and until one connects,
    /// on every call, spaced out as redials are).
    pub(crate) fn unconnected(node: Node, target: Target) -> Self {
        let name = target.text().to_owned();
        let none = C::open(
            node.clone(),
            &name,
            crate::transport::Unconnected::connection(&name),
        );
        none.break_with(RpcError::unavailable(format!(
            "{name:?} is not connected: no such service was found yet"
        )));
        Redial::with(node, target, None, none)
    }

    fn with(node: Node, target: Target, origin: Option<Origin>, first: C) -> Self {
        Redial {
            cur: ArcSwap::from_pointee(first),
            redials: std::sync::atomic::AtomicU64::new(0),
            node,
            target,
            dial: Mutex::new(Dial {
                origin,
                next: None,
                backoff: FIRST_BACKOFF,
                rechecked: None,
            }),
        }
    }

    /// The name or address the client calls.
    pub(crate) fn target(&self) -> &str {
        self.target.text()
    }

    /// The current connection, whatever its state.
    #[inline]
    pub(crate) fn current(&self) -> Guard<Arc<C>> {
        self.cur.load()
    }

    /// The connection a call should use: the current one, or, if it broke
    /// and the service is registered again, a new one. (A broken one when
    /// there is nothing new to dial: the call fails on it at once.)
    #[inline]
    pub(crate) fn live(&self) -> Guard<Arc<C>> {
        let c = self.cur.load();
        if !c.is_spent() {
            return c;
        }
        self.redial(c)
    }

    /// For a call waiting for its service to come back: when to look
    /// again (the next lookup the backoff allows, or a moment from now),
    /// or None once `until` has passed.
    pub(crate) fn next_look(&self, until: Option<Instant>) -> Option<Instant> {
        let now = Instant::now();
        if until.is_some_and(|u| now >= u) {
            return None;
        }
        let soonest = now + Duration::from_micros(100);
        let at = self.lock().next.map_or(soonest, |n| n.max(soonest));
        Some(until.map_or(at, |u| at.min(u)))
    }

    /// After a call on `c` failed with `Unavailable` from its server (a
    /// server that shuts down gracefully refuses new requests that way,
    /// having unregistered at once): if `c` is current and its service's
    /// registration is no longer the one `c` was opened to (another, or
    /// none; not a registry that failed to answer), retires `c`,
    /// so that the next call dials the successor (or fails at once, or
    /// waits for one) instead of being refused again.
    pub(crate) fn recheck(&self, c: &C) {
        if matches!(self.target, Target::Addr(_)) {
            return;
        }
        let mut d = self.lock();
        if !std::ptr::eq(&**self.cur.load(), c) {
            return;
        }
        // At most one lookup a millisecond: a service whose handlers
        // answer `Unavailable` themselves does not scan the registry on
        // every call.
        let at = Instant::now();
        if d.rechecked.is_some_and(|t| at < t + FIRST_BACKOFF) {
            return;
        }
        d.rechecked = Some(at);
        // (Of a name with replicas, any of them may be the one `c` was
        // opened to.)
        let changed = match self.node.resolve_all(&self.target) {
            Ok(routes) => !routes.iter().any(|r| Some(&r.origin) == d.origin.as_ref()),
            Err(e) => e.status == crate::frame::Status::NotFound,
        };
        if changed {
            c.retire();
            d.next = None;
        }
    }

    /// After a call on `c` was refused unrun by its server (it shuts
    /// down, and unregistered): retires `c` if it is current, so that the
    /// next call, and the refused one sent again, dial the successor.
    pub(crate) fn refused(&self, c: &C) {
        let mut d = self.lock();
        if std::ptr::eq(&**self.cur.load(), c) {
            c.retire();
            d.next = None;
        }
    }

    /// What a call that ended on `c` with `r` returns: a refusal that was
    /// not sent again fails with it (what it lent released); another
    /// `Unavailable` answer makes the client look whether the service
    /// moved ([`recheck`](Self::recheck)).
    #[inline]
    pub(crate) fn settle<T>(&self, c: &C, r: Result<T, Failure>) -> Result<T, RpcError> {
        r.map_err(|f| self.settle_failure(c, f))
    }

    /// The error `e` a call on `c` ended with, as [`settle`](Self::settle)
    /// returns it (an `Unavailable` makes the client look whether the
    /// service moved).
    pub(crate) fn settle_error(&self, c: &C, e: RpcError) -> RpcError {
        self.settle_failure(c, Failure::Error(e))
    }

    #[cold]
    fn settle_failure(&self, c: &C, f: Failure) -> RpcError {
        match f {
            Failure::Refused(x) | Failure::Again(x) => x.fail(&self.node),
            Failure::Error(e) => {
                if e.status == crate::frame::Status::Unavailable && !c.is_spent() {
                    self.recheck(c);
                }
                e
            }
        }
    }

    /// Waits until the connection `c` is replaced by one new calls can use
    /// (a call that waits for ready), or `until` passes.
    pub(crate) fn ready(
        &self,
        mut c: Guard<Arc<C>>,
        until: Option<Instant>,
    ) -> Result<Guard<Arc<C>>, RpcError> {
        while c.is_spent() {
            let at = self.next_look(until).ok_or_else(|| self.not_back())?;
            std::thread::sleep(at.saturating_duration_since(Instant::now()));
            c = self.live();
        }
        Ok(c)
    }

    /// [`ready`](Self::ready), for async callers.
    pub(crate) async fn ready_async(
        &self,
        mut c: Arc<C>,
        until: Option<Instant>,
    ) -> Result<Arc<C>, RpcError> {
        while c.is_spent() {
            let at = self.next_look(until).ok_or_else(|| self.not_back())?;
            tokio::time::sleep_until(at.into()).await;
            c = Guard::into_inner(self.live());
        }
        Ok(c)
    }

    /// The error of a call that waited for its service until its deadline.
    pub(crate) fn not_back(&self) -> RpcError {
        RpcError::deadline_exceeded(format!(
            "{:?} did not come back before the deadline",
            self.target()
        ))
    }

    /// How many times the client connected again.
    #[inline]
    pub(crate) fn redials(&self) -> u64 {
        self.redials.load(std::sync::atomic::Ordering::Acquire)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Dial> {
        crate::sync::lock(&self.dial)
    }

    #[cold]
    fn redial(&self, broken: Guard<Arc<C>>) -> Guard<Arc<C>> {
        let mut d = self.lock();
        // Another caller may have dialled while this one waited.
        let now = self.cur.load();
        if !Arc::ptr_eq(&now, &broken) {
            return now;
        }
        let at = Instant::now();
        if d.next.is_some_and(|n| at < n) {
            return broken;
        }
        match self.open_new(d.origin.as_ref()) {
            Some((conn, origin)) => {
                self.cur
                    .store(Arc::new(C::open(self.node.clone(), self.target(), conn)));
                // (A lazy client's first connection is no redial.)
                self.redials.fetch_add(
                    d.origin.is_some() as u64,
                    std::sync::atomic::Ordering::Release,
                );
                d.origin = Some(origin);
                d.next = None;
                d.backoff = FIRST_BACKOFF;
                self.cur.load()
            }
            None => {
                d.next = Some(at + d.backoff);
                d.backoff = (d.backoff * 2).min(MAX_BACKOFF);
                broken
            }
        }
    }

    /// A connection to the service's current registration (of a name with
    /// replicas, the first that answers other than `lost`), unless that
    /// is `lost` over a transport whose connections break only with their
    /// server (and if it answers).
    fn open_new(&self, lost: Option<&Origin>) -> Option<(Connection, Origin)> {
        let routes = self.node.resolve_all(&self.target).ok()?;
        let (others, same): (Vec<_>, Vec<_>) =
            routes.into_iter().partition(|r| lost != Some(&r.origin));
        let again = same.into_iter().filter(|r| matches!(r.how, How::Tcp(_)));
        others.into_iter().chain(again).find_map(|route| {
            let conn = self.node.dial(&self.target, &route, REDIAL_TIMEOUT).ok()?;
            Some((conn, route.origin))
        })
    }

    /// The registration the current connection was opened to (None: not
    /// connected yet).
    pub(crate) fn origin(&self) -> Option<Origin> {
        self.lock().origin.clone()
    }
}

impl Node {
    /// A client's connection to service `name` along `route` (one of its
    /// registrations), redialled by name when it breaks.
    pub(crate) fn redialer_along<C: Connected>(
        &self,
        name: &str,
        route: &Route,
    ) -> Result<Redial<C>, RpcError> {
        let target = Target::Name(name.to_owned());
        let conn = self.dial(&target, route, REDIAL_TIMEOUT)?;
        Ok(Redial::new(
            self.clone(),
            target,
            route.origin.clone(),
            conn,
        ))
    }

    /// Resolves `target` and opens a first connection to it.
    pub(crate) fn redialer<C: Connected>(&self, target: Target) -> Result<Redial<C>, RpcError> {
        let route = self.resolve(&target)?;
        let conn = self.dial(&target, &route, CONNECT_TIMEOUT)?;
        Ok(Redial::new(self.clone(), target, route.origin, conn))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::{Payload, Transport};
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A connection that only says whether it broke (the test breaks it).
    struct Probe {
        _conn: Mutex<Connection>,
        broken: AtomicBool,
    }

    impl Connected for Probe {
        fn open(_: Node, _: &str, conn: Connection) -> Probe {
            Probe {
                _conn: Mutex::new(conn),
                broken: AtomicBool::new(false),
            }
        }

        fn is_spent(&self) -> bool {
            self.broken.load(Ordering::Acquire)
        }

        fn retire(&self) {
            self.broken.store(true, Ordering::Release);
        }

        fn break_with(&self, _: RpcError) {
            self.broken.store(true, Ordering::Release);
        }

        fn failure(&self) -> Option<RpcError> {
            self.is_spent().then(|| RpcError::unavailable("broken"))
        }

        const CLIENT: &'static str = "Probe";

        fn link(&self) -> Link {
            let refs = crate::transport::Sharing::POOL;
            let (spent, max_inline) = (self.is_spent(), 0);
            Link {
                spent,
                refs,
                max_inline,
            }
        }
    }

    fn serve(node: &Node, name: &str) -> crate::Server {
        node.server(name)
            .transport(Transport::Mem)
            .method("echo", |c| Ok(c.take_payload()))
            .spawn()
            .unwrap()
    }

    fn redial(node: &Node, name: &str) -> Redial<Probe> {
        let target = Target::Name(name.into());
        let route = node.resolve(&target).unwrap();
        let conn = node.dial(&target, &route, CONNECT_TIMEOUT).unwrap();
        Redial::new(node.clone(), target, route.origin, conn)
    }

    fn pause(r: &Redial<Probe>) -> Option<Duration> {
        let d = r.lock();
        d.next.map(|n| n.saturating_duration_since(Instant::now()))
    }

    #[test]
    fn a_broken_connection_is_replaced_only_by_another_registration() {
        let tp = dm_pool::testing::TempPool::new(16 << 20);
        let node = Node::new(tp.attach());
        let name = format!("test/redial/{}", std::process::id());
        let svc = serve(&node, &name);
        let r = redial(&node, &name);
        let first = r.current();
        assert!(Arc::ptr_eq(&r.live(), &first), "not broken: kept");

        // Broken, while the same registration is still there: not dialled
        // again, and the next lookup waits for the backoff.
        first.broken.store(true, Ordering::Release);
        assert!(Arc::ptr_eq(&r.live(), &first));
        assert_eq!(r.redials(), 0);
        assert!(pause(&r).is_some_and(|p| p <= FIRST_BACKOFF));

        // Gone: lookups find nothing, and space out.
        svc.shutdown();
        for k in 0..10 {
            // Past the pause: a lookup, which doubles the next pause.
            std::thread::sleep(pause(&r).unwrap_or_default());
            let before = r.lock().backoff;
            assert!(Arc::ptr_eq(&r.live(), &first));
            let after = r.lock().backoff;
            assert_eq!(after, (before * 2).min(MAX_BACKOFF), "lookup {k}");
        }
        assert_eq!(r.lock().backoff, MAX_BACKOFF);
        assert_eq!(r.redials(), 0);

        // Registered again: the first call after the pause dials it.
        let svc = serve(&node, &name);
        r.lock().next = Some(Instant::now() + Duration::from_secs(60));
        assert!(Arc::ptr_eq(&r.live(), &first), "within the pause");
        r.lock().next = Some(Instant::now());
        let second = r.live();
        assert!(!Arc::ptr_eq(&second, &first));
        assert!(!second.is_spent());
        assert_eq!(r.redials(), 1);
        assert_eq!(pause(&r), None);
        assert!(Arc::ptr_eq(&r.live(), &second));
        drop((first, second, r));

        // The clients built on it: through the new connection.
        let c = node.connect(&name).unwrap();
        assert_eq!(c.call("echo", vec![7u8]).unwrap().to_vec().unwrap(), [7]);
        svc.shutdown();
        let svc = serve(&node, &name);
        let mut got = None;
        for _ in 0..100 {
            if let Ok(p) = c.call("echo", Payload::from_vec(vec![8u8])) {
                got = Some(p.to_vec().unwrap());
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(got.as_deref(), Some(&[8u8][..]));
        assert_eq!(c.reconnects(), 1);
        drop(c);
        svc.shutdown();
        drop(node);
        tp.assert_clean();
    }

    #[test]
    fn a_connection_whose_registration_changed_is_retired() {
        let tp = dm_pool::testing::TempPool::new(16 << 20);
        let node = Node::new(tp.attach());
        let name = format!("test/recheck/{}", std::process::id());
        let svc = serve(&node, &name);
        let r = redial(&node, &name);
        let c = r.current();
        r.recheck(&c);
        assert!(!c.is_spent(), "the same registration: kept");
        svc.shutdown();
        let svc = serve(&node, &name);
        // (As if it had just looked, whatever the time this test takes.)
        r.lock().rechecked = Some(Instant::now() + Duration::from_secs(60));
        r.recheck(&c);
        assert!(!c.is_spent(), "one lookup a millisecond at most");
        r.lock().rechecked = None;
        r.recheck(&c);
        assert!(c.is_spent(), "registered again: retired");
        // The next call dials the new registration at once.
        let next = r.live();
        assert!(!Arc::ptr_eq(&next, &c) && !next.is_spent());
        assert_eq!(r.redials(), 1);
        drop((c, next, r));
        svc.shutdown();
        drop(node);
        tp.assert_clean();
    }
}

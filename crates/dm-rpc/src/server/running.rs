//! A running server: its handle ([`Server`]: stop it, now or after
//! draining, or wait for it), its counters ([`Stats`]), and where its name
//! is registered.

use crate::node::Node;
use crate::transport::Waker;
use dm_pool::ServiceInfo;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Adds one to a counter only the server's dispatcher thread writes: a
/// load and a store, not a locked add (about 10 ns here, on the way to
/// every answer). Readers on other threads see each count whole.
#[inline]
pub(super) fn bump(c: &AtomicU64) {
    c.store(c.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
}

/// Counters of a running server. (`calls` and `errors` are written by
/// the server's dispatcher thread alone.)
#[derive(Debug, Default)]
pub struct Stats {
    /// Requests answered (any status).
    pub calls: AtomicU64,
    /// Requests answered with an error status.
    pub errors: AtomicU64,
    /// Requests dropped because the caller cancelled them before they ran
    /// (or, with an async handler, while it ran).
    pub cancelled: AtomicU64,
    /// Requests whose deadline passed before they ran.
    pub expired: AtomicU64,
    /// Requests refused unrun because the server was stopping: they came
    /// while it drained ([`Server::shutdown_gracefully`]), or were still
    /// queued when it stopped.
    pub refused: AtomicU64,
    /// Items sent by streaming methods ([`ServerBuilder::method_stream`](crate::ServerBuilder::method_stream)).
    pub items: AtomicU64,
}

/// Where a server's name is registered.
pub(super) enum Reg {
    /// In the pool (shared-memory services), and listed in the node's
    /// registry if it lists local services.
    Pool(ServiceInfo, Option<crate::registry::Registration>),
    /// In the node's registry (TCP services).
    Registry(crate::registry::Registration),
    /// Bound in this process (in-memory services): the name and binding.
    Mem(String, u64),
}

/// A running service. Stops (and unregisters) on [`shutdown`](Self::shutdown) or drop.
pub struct Server {
    pub(super) endpoint: Option<String>,
    pub(super) name: String,
    pub(super) node: Node,
    pub(super) reg: Option<Reg>,
    pub(super) stop: Arc<AtomicBool>,
    /// Set when the server starts draining: the time it stops at the latest.
    pub(super) drain_by: Arc<OnceLock<Instant>>,
    pub(super) waker: Waker,
    pub(super) stats: Arc<Stats>,
    pub(super) thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("name", &self.name).finish()
    }
}

impl Server {
    /// The service name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The address a TCP server listens on (with the port it was given).
    pub fn tcp_addr(&self) -> Option<&str> {
        self.endpoint.as_deref()
    }

    /// Live counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Stops taking requests, closes every connection and unregisters.
    /// Calls in progress fail with `Unavailable` (a blocking handler
    /// running at that moment finishes first). Requests not run yet are
    /// refused, and each client is told which requests were taken: the
    /// others, still waiting in the connections, were never read. Clients
    /// send both kinds to the server registered under the name next, if
    /// any (see `transport::GoAway`).
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    /// Stops taking new calls and finishes those it has, then shuts down:
    /// unregisters at once (no new client finds it), serves every request
    /// already sent to it (read, or waiting in its connections) and lets
    /// async handlers' calls in progress complete, and answers requests
    /// that come after with `Unavailable`, refused: their callers send
    /// them to the server registered under the name next, if any.
    /// Returns when nothing is left, or once `grace` has passed: then
    /// calls in progress fail and requests still queued are refused, as
    /// with [`shutdown`](Self::shutdown).
    pub fn shutdown_gracefully(mut self, grace: Duration) {
        self.unregister();
        let _ = self.drain_by.set(Instant::now() + grace);
        self.waker.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.stop_now();
    }

    /// Blocks until the server stops (from another thread's shutdown, or
    /// a fatal transport error).
    pub fn wait(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.stop_now();
    }

    fn unregister(&mut self) {
        match self.reg.take() {
            Some(Reg::Pool(s, listed)) => {
                let _ = self.node.pool.unregister(&s);
                if let Some(r) = listed {
                    let _ = self.node.registry.unregister(&r);
                }
            }
            Some(Reg::Registry(r)) => {
                let _ = self.node.registry.unregister(&r);
            }
            Some(Reg::Mem(name, binding)) => crate::transport::mem::unbind(&name, binding),
            None => {}
        }
    }

    fn stop_now(&mut self) {
        self.unregister();
        self.stop.store(true, Ordering::Release);
        self.waker.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_now();
    }
}

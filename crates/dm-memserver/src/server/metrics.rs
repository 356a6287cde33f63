//! Server metrics in the Prometheus text format, served over HTTP on
//! `--metrics`.

use crate::proto::{OPS, OP_NAMES};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency histogram's buckets, in microseconds.
pub const BUCKETS_US: [u64; 12] = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000, 20000];

/// Shards of the per-request counters: sessions update their own shard,
/// so threads serving different sessions do not bounce one cache line.
const SHARDS: usize = 8;

/// The per-request counters of one shard, on cache lines of their own.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Shard {
    requests: [AtomicU64; OPS],
    errors: AtomicU64,
    buckets: [AtomicU64; BUCKETS_US.len()],
    sum_ns: AtomicU64,
    count: AtomicU64,
}

/// Counters updated by the request path (relaxed atomics).
#[derive(Debug, Default)]
pub struct Metrics {
    shards: [Shard; SHARDS],
    malformed: AtomicU64,
    /// Sessions open now.
    pub clients: AtomicU64,
    /// Sessions ended by lease expiry.
    pub leases_expired: AtomicU64,
    /// Refs expired by TTL.
    pub refs_expired: AtomicU64,
    /// Proofs of a key that did not hold.
    pub auth_failures: AtomicU64,
}

/// Point-in-time values the state supplies when rendering.
#[derive(Debug, Clone, Copy)]
pub struct Gauges {
    /// Pages free.
    pub pages_free: u64,
    /// Pages held.
    pub pages_held: u64,
    /// Live Refs.
    pub refs: u64,
    /// Refs created since start.
    pub refs_created: u64,
    /// Pages copied on write since start.
    pub cow_copies: u64,
}

impl Metrics {
    /// Counts a request of operation `op` (1-based) of session `session`
    /// that took `t`.
    pub fn request(&self, session: usize, op: u8, t: Duration, ok: bool) {
        let s = &self.shards[session % SHARDS];
        if let Some(c) = s.requests.get((op as usize).wrapping_sub(1)) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        if !ok {
            s.errors.fetch_add(1, Ordering::Relaxed);
        }
        let us = t.as_micros() as u64;
        if let Some(i) = BUCKETS_US.iter().position(|&b| us <= b) {
            s.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        s.sum_ns.fetch_add(t.as_nanos() as u64, Ordering::Relaxed);
        s.count.fetch_add(1, Ordering::Relaxed);
    }

    /// A counter summed over the shards.
    fn total(&self, f: impl Fn(&Shard) -> &AtomicU64) -> u64 {
        self.shards
            .iter()
            .map(|s| f(s).load(Ordering::Relaxed))
            .sum()
    }

    /// Counts a malformed frame.
    pub fn malformed(&self) {
        self.malformed.fetch_add(1, Ordering::Relaxed);
    }

    /// Requests of operation `name` so far.
    pub fn requests_of(&self, name: &str) -> u64 {
        OP_NAMES
            .iter()
            .position(|n| *n == name)
            .map_or(0, |i| self.total(|s| &s.requests[i]))
    }

    /// The Prometheus text exposition.
    pub fn render(&self, g: Gauges) -> String {
        let mut s = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, v: u64| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        metric(
            "dmrpc_memserver_pages_free",
            "gauge",
            "Pages free.",
            g.pages_free,
        );
        metric(
            "dmrpc_memserver_pages_held",
            "gauge",
            "Pages holding data.",
            g.pages_held,
        );
        metric("dmrpc_memserver_refs", "gauge", "Live Refs.", g.refs);
        metric(
            "dmrpc_memserver_refs_created_total",
            "counter",
            "Refs created.",
            g.refs_created,
        );
        metric(
            "dmrpc_memserver_refs_expired_total",
            "counter",
            "Refs reclaimed by TTL.",
            self.refs_expired.load(Ordering::Relaxed),
        );
        metric(
            "dmrpc_memserver_cow_copies_total",
            "counter",
            "Pages copied on write.",
            g.cow_copies,
        );
        metric(
            "dmrpc_memserver_clients",
            "gauge",
            "Open sessions.",
            self.clients.load(Ordering::Relaxed),
        );
        metric(
            "dmrpc_memserver_leases_expired_total",
            "counter",
            "Sessions ended by lease expiry.",
            self.leases_expired.load(Ordering::Relaxed),
        );
        metric(
            "dmrpc_memserver_errors_total",
            "counter",
            "Requests answered with an error.",
            self.total(|s| &s.errors),
        );
        metric(
            "dmrpc_memserver_auth_failures_total",
            "counter",
            "Proofs of a key that did not hold.",
            self.auth_failures.load(Ordering::Relaxed),
        );
        metric(
            "dmrpc_memserver_malformed_total",
            "counter",
            "Malformed frames received.",
            self.malformed.load(Ordering::Relaxed),
        );
        let _ = writeln!(
            s,
            "# HELP dmrpc_memserver_requests_total Requests by operation.\n# TYPE dmrpc_memserver_requests_total counter"
        );
        for (i, name) in OP_NAMES.iter().enumerate() {
            let _ = writeln!(
                s,
                "dmrpc_memserver_requests_total{{op=\"{name}\"}} {}",
                self.total(|s| &s.requests[i])
            );
        }
        let _ = writeln!(
            s,
            "# HELP dmrpc_memserver_request_seconds Time to serve a request.\n# TYPE dmrpc_memserver_request_seconds histogram"
        );
        let mut cum = 0;
        for (i, b) in BUCKETS_US.iter().enumerate() {
            cum += self.total(|s| &s.buckets[i]);
            let _ = writeln!(
                s,
                "dmrpc_memserver_request_seconds_bucket{{le=\"{}\"}} {cum}",
                *b as f64 / 1e6
            );
        }
        let count = self.total(|s| &s.count);
        let _ = writeln!(
            s,
            "dmrpc_memserver_request_seconds_bucket{{le=\"+Inf\"}} {count}\ndmrpc_memserver_request_seconds_sum {}\ndmrpc_memserver_request_seconds_count {count}",
            self.total(|s| &s.sum_ns) as f64 / 1e9
        );
        s
    }
}

//! Process-wide counters of what this process's calls moved: payload bytes
//! copied into and out of transports (inline), and Refs passed instead.
//! Empty payloads cost nothing here; others cost one relaxed add each.

use crate::frame::Body;
use std::sync::atomic::{AtomicU64, Ordering};

static INLINE_IN: AtomicU64 = AtomicU64::new(0);
static INLINE_OUT: AtomicU64 = AtomicU64::new(0);
static REFS_IN: AtomicU64 = AtomicU64::new(0);
static REFS_OUT: AtomicU64 = AtomicU64::new(0);

/// A snapshot of the counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Inline payload bytes received (copied out of a transport).
    pub inline_in: u64,
    /// Inline payload bytes sent (copied into a transport).
    pub inline_out: u64,
    /// Refs received.
    pub refs_in: u64,
    /// Refs sent.
    pub refs_out: u64,
}

impl Counters {
    /// Payload bytes this process copied through transports.
    pub fn bytes_copied(&self) -> u64 {
        self.inline_in + self.inline_out
    }

    /// `self - earlier`, field by field.
    pub fn since(&self, earlier: &Counters) -> Counters {
        Counters {
            inline_in: self.inline_in - earlier.inline_in,
            inline_out: self.inline_out - earlier.inline_out,
            refs_in: self.refs_in - earlier.refs_in,
            refs_out: self.refs_out - earlier.refs_out,
        }
    }
}

/// The counters now.
pub fn counters() -> Counters {
    Counters {
        inline_in: INLINE_IN.load(Ordering::Relaxed),
        inline_out: INLINE_OUT.load(Ordering::Relaxed),
        refs_in: REFS_IN.load(Ordering::Relaxed),
        refs_out: REFS_OUT.load(Ordering::Relaxed),
    }
}

#[inline]
pub(crate) fn count(body: &Body, out: bool) {
    match (body, out) {
        (Body::None, _) => {}
        (Body::Inline(b), true) => {
            INLINE_OUT.fetch_add(b.len() as u64, Ordering::Relaxed);
        }
        (Body::Inline(b), false) => {
            INLINE_IN.fetch_add(b.len() as u64, Ordering::Relaxed);
        }
        (Body::Refs(r), true) => {
            REFS_OUT.fetch_add(r.len() as u64, Ordering::Relaxed);
        }
        (Body::Refs(r), false) => {
            REFS_IN.fetch_add(r.len() as u64, Ordering::Relaxed);
        }
    }
}

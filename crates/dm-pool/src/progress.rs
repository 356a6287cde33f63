//! How far a long pass over a pool has come (`dmrpc pool check` and `gc`
//! show it): what it counts, and how many of how many.

/// How far a pass over a pool has come: what it counts, and how many of
/// how many. `dmrpc pool check` and `gc` show it when they run long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// What is counted: descriptors (three passes: the buffers mapped from
    /// Refs, the Refs, the pages each names), `pages`, `list pages`,
    /// `slots`, `expiry groups`.
    pub what: &'static str,
    /// Done so far.
    pub done: u64,
    /// Of.
    pub total: u64,
}

/// A pass's progress reports: at each start, every [`STRIDE`] items and
/// at each end.
pub(crate) struct Pass<'a>(pub(crate) &'a mut dyn FnMut(Progress));

/// Items between two progress reports.
pub(crate) const STRIDE: u64 = 1 << 16;

impl Pass<'_> {
    /// A pass that reports to no one.
    pub(crate) fn quiet<T>(f: impl FnOnce(&mut Pass<'_>) -> T) -> T {
        f(&mut Pass(&mut |_| {}))
    }

    /// Item `i` of `total` of `what` is next.
    #[inline]
    pub(crate) fn at(&mut self, what: &'static str, i: u64, total: u64) {
        if i.is_multiple_of(STRIDE) {
            (self.0)(Progress {
                what,
                done: i,
                total,
            });
        }
    }

    /// All `total` of `what` done.
    pub(crate) fn end(&mut self, what: &'static str, total: u64) {
        (self.0)(Progress {
            what,
            done: total,
            total,
        });
    }
}

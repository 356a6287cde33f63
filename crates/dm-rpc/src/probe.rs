//! Timestamps along the call path, for splitting a round trip's time
//! between the client's software, the server's and the two transfers
//! between them (`scripts/call-split.sh`). Compiled in only with the
//! `probe` feature; without it [`stamp`] is empty and costs nothing.
//!
//! A stamp is the time-stamp counter (`lfence; rdtsc`: one counter for
//! every core on hosts with an invariant TSC, so stamps of two processes
//! compare; the fence makes the loads before the stamp complete first, so
//! a miss is counted where it happens) stored in this process's table for
//! its point, in order; the table of each point holds the first [`CAP`]
//! stamps. A stamp costs about 25 ns on the 2-core VM (the fence, the
//! counter read and a store), so stamps are for splitting a round trip,
//! not for timing it.
//!
//! The points: [`PUBLISHED`] (a ring record published), [`SEEN`] (a ring
//! record seen by its consumer; a wrap marker is not a record) and four
//! for the program's own use (`examples/noop_loop`: a call's start and
//! end, its handler's start and end). Each point is meant to be stamped
//! by one thread of its process (a load and a store, no locked
//! instruction): in a process where several threads push or pop rings,
//! their stamps would overwrite each other.

/// A ring record was published (the producer's header store).
pub const PUBLISHED: usize = 0;
/// A ring record was seen by its consumer (before it is copied out).
pub const SEEN: usize = 1;
/// Points a program stamps itself.
pub const USER: [usize; 4] = [2, 3, 4, 5];
/// How many points.
pub const POINTS: usize = 6;
/// Stamps kept per point.
pub const CAP: usize = 1 << 19;

#[cfg(feature = "probe")]
mod on {
    use super::{CAP, POINTS};
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

    static STAMPS: [[AtomicU64; CAP]; POINTS] =
        [const { [const { AtomicU64::new(0) }; CAP] }; POINTS];
    static COUNT: [AtomicUsize; POINTS] = [const { AtomicUsize::new(0) }; POINTS];

    pub(super) fn ticks() -> u64 {
        #[cfg(target_arch = "x86_64")]
        {
            // The fence first: rdtsc is not ordered with the loads before
            // it, so a stamp after a load that misses (a ring record's
            // header seen) could read the counter while the load is still
            // in flight, and move the miss into the next segment.
            // SAFETY: lfence and rdtsc have no preconditions.
            unsafe {
                core::arch::x86_64::_mm_lfence();
                core::arch::x86_64::_rdtsc()
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            since_start_ns()
        }
    }

    /// Elsewhere: nanoseconds of the monotonic clock (one process only).
    #[cfg(not(target_arch = "x86_64"))]
    fn since_start_ns() -> u64 {
        use std::sync::OnceLock;
        static T0: OnceLock<std::time::Instant> = OnceLock::new();
        T0.get_or_init(std::time::Instant::now).elapsed().as_nanos() as u64
    }

    #[inline(always)]
    pub(super) fn stamp(point: usize) {
        let i = COUNT[point].load(Relaxed);
        if i < CAP {
            STAMPS[point][i].store(ticks(), Relaxed);
            COUNT[point].store(i + 1, Relaxed);
        }
    }

    pub(super) fn table(point: usize) -> Vec<u64> {
        let n = COUNT[point].load(Relaxed).min(CAP);
        STAMPS[point][..n].iter().map(|t| t.load(Relaxed)).collect()
    }
}

/// Stamps `point` (one of [`PUBLISHED`], [`SEEN`], [`USER`]).
#[inline(always)]
pub fn stamp(point: usize) {
    #[cfg(feature = "probe")]
    on::stamp(point);
    #[cfg(not(feature = "probe"))]
    let _ = point;
}

/// Writes this process's stamps to `path`: a first line with the counter's
/// ticks per nanosecond (measured over 50 ms), then one line per point
/// with its stamps, space-separated. An error if built without the
/// `probe` feature.
pub fn dump(path: &std::path::Path) -> std::io::Result<()> {
    #[cfg(feature = "probe")]
    {
        use std::fmt::Write as _;
        let (t0, c0) = (std::time::Instant::now(), on::ticks());
        std::thread::sleep(std::time::Duration::from_millis(50));
        let (c1, ns) = (on::ticks(), t0.elapsed().as_nanos() as f64);
        let mut out = format!("{}\n", (c1 - c0) as f64 / ns);
        for p in 0..POINTS {
            for (k, t) in on::table(p).iter().enumerate() {
                let sep = if k == 0 { "" } else { " " };
                let _ = write!(out, "{sep}{t}");
            }
            out.push('\n');
        }
        std::fs::write(path, out)
    }
    #[cfg(not(feature = "probe"))]
    {
        let _ = path;
        Err(std::io::Error::other(
            "dm-rpc was built without the probe feature",
        ))
    }
}

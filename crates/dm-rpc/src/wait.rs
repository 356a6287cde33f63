//! The waiting policy: spin, then yield, then park on a futex in shared
//! memory, with the waker paying for a syscall only when the waiter is
//! actually parked.
//!
//! A [`Bell`] is one `u32` in shared memory with a single waiter and any
//! number of ringers:
//!
//! ```text
//! waiter:  bell = ASLEEP; fence(SeqCst); if ready() { bell = AWAKE; return }
//!          futex_wait(bell, ASLEEP); bell = AWAKE
//! ringer:  publish (Release store); fence(SeqCst);
//!          if bell == ASLEEP && swap(bell, AWAKE) == ASLEEP { futex_wake(bell) }
//! ```
//!
//! The two fences order each side's store before its load (the
//! store-buffering pattern), so either the waiter sees the published data
//! or the ringer sees `ASLEEP` and wakes it: no lost wake-ups (checked by
//! loom, `tests/loom.rs`). A ringer that finds the waiter awake does no
//! syscall and no write to the bell's cache line.

use crate::sync::{fence, futex_wait, futex_wake, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The waiter is running (or spinning).
pub const AWAKE: u32 = 0;
/// The waiter is parked, or about to park, on the futex.
pub const ASLEEP: u32 = 1;

/// A doorbell: one waiter, many ringers.
#[derive(Debug, Clone, Copy)]
pub struct Bell<'a>(pub &'a AtomicU32);

impl Bell<'_> {
    /// Announces that the waiter is about to sleep. The caller must check
    /// its condition after this and before [`sleep`](Self::sleep).
    #[inline]
    pub fn prepare(&self) {
        self.0.store(ASLEEP, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Cancels a [`prepare`](Self::prepare) (the condition became true).
    #[inline]
    pub fn cancel(&self) {
        self.0.store(AWAKE, Ordering::Relaxed);
    }

    /// Parks until rung (or `timeout`), then marks the waiter awake.
    pub fn sleep(&self, timeout: Option<Duration>) {
        futex_wait(self.0, ASLEEP, timeout);
        self.0.store(AWAKE, Ordering::Relaxed);
    }

    /// Wakes the waiter if it is parked. Call after publishing.
    #[inline]
    pub fn ring(&self) {
        fence(Ordering::SeqCst);
        if self.0.load(Ordering::Relaxed) == ASLEEP
            && self.0.swap(AWAKE, Ordering::SeqCst) == ASLEEP
        {
            futex_wake(self.0);
        }
    }
}

/// How a waiter waits: `spin` checks with a pause between them, then
/// `yields` checks with `sched_yield` between them, then parks on the futex
/// for at most `park_slice` at a time (between slices it checks that the
/// peer is alive, so a dead peer is noticed within a slice of its lease).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitPolicy {
    /// Checks while spinning.
    pub spin: u32,
    /// Checks while yielding.
    pub yields: u32,
    /// Longest single park.
    pub park_slice: Duration,
}

impl Default for WaitPolicy {
    /// Measured on the 2-core test machine (`dmrpc bench rtt` prints the
    /// policies side by side; BENCHMARKS.md records the choice): a short
    /// spin covers a hot peer's answer (a round trip is ~0.3 us), yields
    /// hand the core to a peer that shares it (~1 us each), and parking
    /// keeps idle services at zero CPU.
    fn default() -> Self {
        WaitPolicy {
            spin: 2000,
            yields: 50,
            park_slice: Duration::from_millis(20),
        }
    }
}

impl WaitPolicy {
    /// Never parks early: spins, then yields until the deadline (for
    /// benchmarks with a dedicated core per process).
    pub fn spin_only() -> Self {
        WaitPolicy {
            spin: u32::MAX,
            yields: 0,
            park_slice: Duration::from_millis(20),
        }
    }

    /// Parks at once (lowest CPU use, each wake-up costs a futex call).
    pub fn park_only() -> Self {
        WaitPolicy {
            spin: 0,
            yields: 0,
            park_slice: Duration::from_millis(20),
        }
    }

    /// Waits until `ready` gives a value, `deadline` passes (`Ok(None)`), or
    /// `idle` (run between park slices, e.g. a peer liveness check) fails.
    pub fn wait<T, E>(
        &self,
        bell: Bell<'_>,
        deadline: Option<Instant>,
        mut ready: impl FnMut() -> Option<T>,
        mut idle: impl FnMut() -> Result<(), E>,
    ) -> Result<Option<T>, E> {
        if deadline.is_some_and(|d| d <= Instant::now()) {
            return Ok(ready());
        }
        for i in 0..self.spin {
            if let Some(x) = ready() {
                return Ok(Some(x));
            }
            std::hint::spin_loop();
            if i & 1023 == 1023 {
                if past(deadline) {
                    return Ok(None);
                }
                if i & 0xF_FFFF == 0xF_FFFF {
                    idle()?;
                }
            }
        }
        for _ in 0..self.yields {
            if let Some(x) = ready() {
                return Ok(Some(x));
            }
            dm_sys::sched_yield();
        }
        loop {
            if let Some(x) = ready() {
                return Ok(Some(x));
            }
            let now = Instant::now();
            let slice = match deadline {
                Some(d) if d <= now => return Ok(None),
                Some(d) => (d - now).min(self.park_slice),
                None => self.park_slice,
            };
            bell.prepare();
            if let Some(x) = ready() {
                bell.cancel();
                return Ok(Some(x));
            }
            bell.sleep(Some(slice));
            if let Some(x) = ready() {
                return Ok(Some(x));
            }
            if Instant::now() >= now + slice {
                idle()?;
            }
        }
    }
}

fn past(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

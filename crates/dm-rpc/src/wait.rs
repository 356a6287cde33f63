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

    /// Wakes the waiter if it is seen parked, without the fence: a waiter
    /// that parks at this very moment may be missed, so such a waiter must
    /// park with a timeout (which bounds the delay). For waits that are
    /// rare (a full ring), where a fence on every message would cost more.
    #[inline]
    pub fn ring_lazy(&self) {
        if self.0.load(Ordering::Relaxed) == ASLEEP
            && self.0.swap(AWAKE, Ordering::SeqCst) == ASLEEP
        {
            futex_wake(self.0);
        }
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

/// Where a [`Waiter`] parks: one bell, or several at once.
pub trait Sleeper {
    /// Announces that the waiter is about to sleep (see [`Bell::prepare`]).
    fn prepare(&self);
    /// Cancels a [`prepare`](Self::prepare).
    fn cancel(&self);
    /// Parks until rung (or `timeout`), then marks the waiter awake.
    fn sleep(&self, timeout: Option<Duration>);
}

impl Sleeper for Bell<'_> {
    fn prepare(&self) {
        Bell::prepare(self)
    }
    fn cancel(&self) {
        Bell::cancel(self)
    }
    fn sleep(&self, timeout: Option<Duration>) {
        Bell::sleep(self, timeout)
    }
}

/// Several bells with one waiter: it parks on all of them at once
/// (`futex_waitv`), and a ring of any one wakes it. Each bell keeps the
/// [`Bell`] protocol (one waiter each, this one), so its ringers need not
/// know that the waiter listens to others too.
#[cfg(not(loom))]
#[derive(Debug, Clone, Copy)]
pub struct Bells<'a>(pub &'a [&'a AtomicU32]);

#[cfg(not(loom))]
impl Sleeper for Bells<'_> {
    fn prepare(&self) {
        for b in self.0 {
            b.store(ASLEEP, Ordering::Relaxed);
        }
        fence(Ordering::SeqCst);
    }
    fn cancel(&self) {
        for b in self.0 {
            b.store(AWAKE, Ordering::Relaxed);
        }
    }
    fn sleep(&self, timeout: Option<Duration>) {
        let words: Vec<(&AtomicU32, u32)> = self.0.iter().map(|&b| (b, ASLEEP)).collect();
        dm_sys::futex::wait_any(&words, timeout);
        self.cancel();
    }
}

/// How a waiter waits: it checks while spinning for up to `spin`, then
/// checks between `sched_yield`s for up to `yield_for`, then parks on the
/// futex for at most `park_slice` at a time (between slices it checks that
/// the peer is alive, so a dead peer is noticed within a slice of its
/// lease).
///
/// With `adaptive` on, each [`Waiter`] tunes its spin to what it sees:
/// waits that end while spinning keep the full spin (a hot peer on another
/// core answers in about a microsecond), waits that outlast it halve it
/// down to [`MIN_SPIN`], so a process waiting on a long chain of others
/// hands its core to them at once instead of burning it — on 2 cores, a
/// chain of 8 processes only moves if the waiting ones step aside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitPolicy {
    /// Longest spin before yielding.
    pub spin: Duration,
    /// How long to keep yielding before parking.
    pub yield_for: Duration,
    /// Longest single park.
    pub park_slice: Duration,
    /// Tune the spin to the waits seen.
    pub adaptive: bool,
}

/// A `sched_yield` that takes this long ran another task: the core is
/// crowded. (An empty yield takes well under a microsecond.)
const CROWDED_YIELD: Duration = Duration::from_micros(3);

/// How a spin ended.
enum Spun<T> {
    /// `ready` gave this.
    Ready(T),
    /// The spin ran out.
    Out,
    /// The deadline passed.
    Deadline,
}

/// Checks a spinning waiter makes between two clock reads, and before
/// the first.
const CLOCKLESS_CHECKS: u32 = 32;

/// The shortest spin an adaptive waiter keeps.
pub const MIN_SPIN: Duration = Duration::from_nanos(500);

impl Default for WaitPolicy {
    /// Measured on the 2-core test machine (`dmrpc bench rtt` for two
    /// processes, `dmrpc bench chain` for eight; BENCHMARKS.md): spin up to
    /// 20 us, adaptively; yield for up to 2 ms (a sched_yield hand-off is
    /// about 1 us, a futex wake-up 25 us); then park, so an idle service
    /// uses no CPU.
    fn default() -> Self {
        WaitPolicy {
            spin: Duration::from_micros(20),
            yield_for: Duration::from_millis(2),
            park_slice: Duration::from_millis(20),
            adaptive: true,
        }
    }
}

impl WaitPolicy {
    /// Spins until the answer or the deadline (for benchmarks with a
    /// dedicated core per process).
    pub fn spin_only() -> Self {
        WaitPolicy {
            spin: Duration::from_secs(3600),
            yield_for: Duration::ZERO,
            park_slice: Duration::from_millis(20),
            adaptive: false,
        }
    }

    /// Parks at once (lowest CPU use; each wake-up costs a futex call).
    pub fn park_only() -> Self {
        WaitPolicy {
            spin: Duration::ZERO,
            yield_for: Duration::ZERO,
            park_slice: Duration::from_millis(20),
            adaptive: false,
        }
    }

    /// The default policy, or the one in the environment variable
    /// `DMRPC_WAIT` = `SPIN_US,YIELD_US,PARK_MS[,fixed]` (for tuning a
    /// deployment without rebuilding; `fixed` turns adaptation off).
    /// A malformed value is ignored.
    pub fn from_env() -> Self {
        std::env::var("DMRPC_WAIT")
            .ok()
            .and_then(|v| Self::parse(&v))
            .unwrap_or_default()
    }

    /// Parses `SPIN_US,YIELD_US,PARK_MS[,fixed]`.
    pub fn parse(v: &str) -> Option<Self> {
        let f: Vec<&str> = v.split(',').map(str::trim).collect();
        let num = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok());
        Some(WaitPolicy {
            spin: Duration::from_micros(num(0)?),
            yield_for: Duration::from_micros(num(1)?),
            park_slice: Duration::from_millis(num(2)?.max(1)),
            adaptive: match f.get(3) {
                None => true,
                Some(&"fixed") => false,
                Some(_) => return None,
            },
        })
    }

    /// A waiter following this policy.
    pub fn waiter(&self) -> Waiter {
        Waiter {
            policy: *self,
            spin: self.spin,
            crowded: false,
        }
    }
}

/// One waiting party (a connection end, a server): the policy and the
/// spin it has adapted to.
#[derive(Debug, Clone)]
pub struct Waiter {
    policy: WaitPolicy,
    spin: Duration,
    /// The last `sched_yield` ran another task (this core is shared by
    /// more runnable tasks than cores): spinning only delays the one that
    /// has work, so an adaptive waiter goes straight to yielding.
    crowded: bool,
}

impl Waiter {
    /// The spin this waiter uses now.
    pub fn spin(&self) -> Duration {
        self.spin
    }

    /// The spin phase of [`wait`](Self::wait) alone, for a waiter with
    /// somewhere else to wait when it ends (an async call, which then
    /// leaves its wait to a thread that can park): checks `ready` until it
    /// gives a value, or the spin or `deadline` runs out (`None`), running
    /// `idle` (a liveness check) about every millisecond. Adapts
    /// as `wait` does: a spin that runs out halves the next one, and
    /// [`ended_after_spin`](Self::ended_after_spin) grows it again when the
    /// wait ended just after.
    pub fn spin_phase<T>(
        &mut self,
        deadline: Option<Instant>,
        mut ready: impl FnMut() -> Option<T>,
        mut idle: impl FnMut(),
    ) -> Option<T> {
        if let Some(x) = ready() {
            return Some(x);
        }
        if self.spin.is_zero() {
            return None;
        }
        let (mut start, mut last_idle) = (None, None);
        let mut idle = || {
            idle();
            Ok::<(), std::convert::Infallible>(())
        };
        let Ok(spun) = self.spin_loop(&mut start, deadline, &mut last_idle, &mut ready, &mut idle);
        if let Spun::Ready(x) = spun {
            return Some(x);
        }
        self.spin_less();
        None
    }

    /// Checks `ready` until it gives a value, the spin runs out, or
    /// `deadline` passes (in that order of precedence), reading the clock
    /// every [`CLOCKLESS_CHECKS`] checks, and running `idle` about every
    /// millisecond after `last_idle` (which it moves). The spin is counted
    /// from `start`; left `None`, both are set at the first clock read, so
    /// the first checks go before any clock read: a busy peer's answer
    /// often comes within them, and a clock read (about 35 ns here) in its
    /// way would delay the wait's end.
    fn spin_loop<T, E>(
        &self,
        start: &mut Option<Instant>,
        deadline: Option<Instant>,
        last_idle: &mut Option<Instant>,
        ready: &mut impl FnMut() -> Option<T>,
        idle: &mut impl FnMut() -> Result<(), E>,
    ) -> Result<Spun<T>, E> {
        let mut i = 0u32;
        loop {
            if let Some(x) = ready() {
                return Ok(Spun::Ready(x));
            }
            std::hint::spin_loop();
            i = i.wrapping_add(1);
            if i.is_multiple_of(CLOCKLESS_CHECKS) {
                let now = Instant::now();
                if now - *start.get_or_insert(now) >= self.spin {
                    return Ok(Spun::Out);
                }
                if deadline.is_some_and(|d| now >= d) {
                    return Ok(Spun::Deadline);
                }
                let idled = last_idle.get_or_insert(now);
                if now - *idled >= Duration::from_millis(1) {
                    *idled = now;
                    idle()?;
                }
            }
        }
    }

    /// The wait outlasted the spin: spin less next time (a policy that
    /// spins less than MIN_SPIN, or not at all, keeps its own spin as the
    /// floor).
    fn spin_less(&mut self) {
        if self.policy.adaptive {
            self.spin = (self.spin / 2).max(MIN_SPIN.min(self.policy.spin));
        }
    }

    /// A wait whose spin phase ran out ended `waited` after it started
    /// (with a spin of `spun`): grows the spin again if that was just
    /// after the spin ran out.
    pub fn ended_after_spin(&mut self, spun: Duration, waited: Duration) {
        if self.policy.adaptive && waited < spun * 2 + MIN_SPIN {
            self.spin = (spun * 2).clamp(MIN_SPIN.min(self.policy.spin), self.policy.spin);
        }
    }

    /// Waits until `ready` gives a value, `deadline` passes (`Ok(None)`), or
    /// `idle` (run between park slices, and about every millisecond of
    /// spinning or yielding, e.g. a peer liveness check) fails.
    pub fn wait<T, E>(
        &mut self,
        bell: impl Sleeper,
        deadline: Option<Instant>,
        mut ready: impl FnMut() -> Option<T>,
        mut idle: impl FnMut() -> Result<(), E>,
    ) -> Result<Option<T>, E> {
        if let Some(x) = ready() {
            return Ok(Some(x));
        }
        let p = self.policy;
        // Spin (unless the spin is none, or the core is crowded).
        let crowded = p.adaptive && self.crowded;
        let (mut start, mut last_idle) = (None, None);
        if !self.spin.is_zero() && !crowded {
            match self.spin_loop(&mut start, deadline, &mut last_idle, &mut ready, &mut idle)? {
                Spun::Ready(x) => return Ok(Some(x)),
                Spun::Deadline => return Ok(None),
                Spun::Out => {}
            }
        }
        // (`start` is set by the spin, which checked the deadline; else
        // it is now. `now` opens the yield phase below.)
        let (start, mut now) = match start {
            Some(s) => (s, Instant::now()),
            None => {
                let now = Instant::now();
                if deadline.is_some_and(|d| d <= now) {
                    return Ok(None);
                }
                (now, now)
            }
        };
        let mut last_idle = last_idle.unwrap_or(start);
        // The answer outlasted the spin: spin less next time.
        let spun = self.spin;
        self.spin_less();
        // Yield. One clock read per round, just after the yield: it times
        // the yield (a long one ran someone else) and is the round's `now`
        // (the check of `ready` in between takes nanoseconds; a clock read
        // costs about 45 ns here, and a yield that finds no one else to
        // run about 250 ns).
        let yield_until = now + p.yield_for;
        loop {
            if let Some(x) = ready() {
                // Just missed: spin longer next time. (How long the wait
                // took as of the last clock read: a yield short at most.)
                self.ended_after_spin(spun, now - start);
                return Ok(Some(x));
            }
            if now >= yield_until {
                break;
            }
            if deadline.is_some_and(|d| now >= d) {
                return Ok(None);
            }
            let mut before = now;
            if now - last_idle >= Duration::from_millis(1) {
                last_idle = now;
                idle()?;
                before = Instant::now();
            }
            dm_sys::sched_yield();
            now = Instant::now();
            // A yield that took a while ran someone else.
            self.crowded = now - before >= CROWDED_YIELD;
        }
        // Park.
        loop {
            if let Some(x) = ready() {
                return Ok(Some(x));
            }
            let now = Instant::now();
            let slice = match deadline {
                Some(d) if d <= now => return Ok(None),
                Some(d) => (d - now).min(p.park_slice),
                None => p.park_slice,
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Waits with `w` for a condition that comes true at its `n`th check.
    fn wait_n(w: &mut Waiter, n: u32) -> Option<u32> {
        let bell = AtomicU32::new(AWAKE);
        let mut checks = 0;
        let ready = || {
            checks += 1;
            (checks >= n).then_some(checks)
        };
        w.wait(Bell(&bell), None, ready, || Ok::<(), ()>(()))
            .unwrap_or(None)
    }

    #[test]
    fn an_adaptive_policy_without_spin_never_spins() {
        // `DMRPC_WAIT=0,2000,20`: yield at once, adaptively. A wait that
        // ends just after the spin phase used to clamp the next spin to
        // [MIN_SPIN, 0] and panic.
        let p = WaitPolicy::parse("0,2000,20").unwrap();
        assert!(p.adaptive);
        let mut w = p.waiter();
        for n in [2, 3, 50, 2] {
            assert_eq!(wait_n(&mut w, n), Some(n));
            assert_eq!(w.spin(), Duration::ZERO);
        }
    }

    #[test]
    fn a_spin_phase_that_runs_out_halves_and_a_near_miss_grows_it_back() {
        let p = WaitPolicy {
            spin: Duration::from_micros(200),
            ..Default::default()
        };
        let mut w = p.waiter();
        let idled = std::cell::Cell::new(0);
        assert_eq!(
            w.spin_phase(None, || None::<()>, || idled.set(idled.get() + 1)),
            None
        );
        assert_eq!(w.spin(), Duration::from_micros(100));
        // A wait that ended long after: no change; just after: doubled.
        w.ended_after_spin(Duration::from_micros(100), Duration::from_millis(5));
        assert_eq!(w.spin(), Duration::from_micros(100));
        w.ended_after_spin(Duration::from_micros(100), Duration::from_micros(150));
        assert_eq!(w.spin(), Duration::from_micros(200));
        // Ready at once, or within the spin (a day long here, so that no
        // preemption can outlast it): the spin stays.
        assert_eq!(w.spin_phase(None, || Some(1), || {}), Some(1));
        assert_eq!(w.spin(), Duration::from_micros(200));
        let day = Duration::from_secs(86_400);
        let mut d = WaitPolicy {
            spin: day,
            ..Default::default()
        }
        .waiter();
        let mut n = 0;
        let got = d.spin_phase(
            None,
            || {
                n += 1;
                (n > 50).then_some(n)
            },
            || {},
        );
        assert_eq!(got, Some(51));
        assert_eq!(d.spin(), day);
        // A deadline already past ends the spin at its first clock read
        // (without it this would spin for a day).
        let mut long = WaitPolicy {
            spin: Duration::from_secs(86_400),
            adaptive: false,
            ..Default::default()
        }
        .waiter();
        assert_eq!(
            long.spin_phase(Some(Instant::now()), || None::<()>, || {}),
            None
        );
        // No spin: one look, and nothing adapts.
        let mut z = WaitPolicy::park_only().waiter();
        assert_eq!(z.spin_phase(None, || None::<()>, || {}), None);
        assert_eq!(z.spin(), Duration::ZERO);
        assert_eq!(idled.get(), 0, "a 200 us spin runs no millisecond check");
    }

    #[test]
    fn an_adaptive_spin_stays_within_its_bounds() {
        // A spin below MIN_SPIN is its own floor; a longer one halves
        // down to MIN_SPIN and never grows past the policy's.
        for us in [0u64, 1, 20] {
            let p = WaitPolicy {
                spin: Duration::from_nanos(us * 300),
                park_slice: Duration::from_millis(1),
                ..Default::default()
            };
            let mut w = p.waiter();
            for n in [2, 100, 2, 300, 2, 2] {
                assert_eq!(wait_n(&mut w, n), Some(n));
                assert!(w.spin() <= p.spin, "{:?} > {:?}", w.spin(), p.spin);
                assert!(w.spin() >= MIN_SPIN.min(p.spin));
            }
        }
    }
}

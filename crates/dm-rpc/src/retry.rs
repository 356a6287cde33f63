//! Retry policies (gRPC's): a call whose answer has a status its policy
//! lists is sent again, after a random wait that grows with each attempt,
//! up to a number of attempts and within the call's deadline. The caller
//! declares those statuses worth another try (the handler may have run:
//! list only statuses that mean it did nothing, or calls that may run
//! twice). The last attempt's answer is the call's.
//!
//! A server can say when to try again: an answer whose metadata has
//! [`RETRY_AFTER`] (milliseconds, decimal) is tried again after that long
//! instead of the policy's wait, and one whose value is not a number is
//! not tried again (gRPC's pushback).
//!
//! A policy that lists `Unavailable` also makes the call
//! [`idempotent`](crate::CallOptions::idempotent): a call whose
//! connection breaks while it is in flight goes to the service's next
//! server.
//!
//! The request is sent again as it was: its payload's Refs stay lent until
//! the last attempt ends, so nothing is copied again.

use crate::frame::Status;
use crate::metadata::Metadata;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The metadata key of a server's pushback: milliseconds to wait before
/// trying again, or anything else for "do not".
pub const RETRY_AFTER: &str = "retry-after-ms";

/// Most attempts a policy makes (the first included).
pub const MAX_ATTEMPTS: u32 = 10;

/// A set of statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Statuses(u16);

impl Statuses {
    /// These statuses.
    pub fn of(statuses: &[Status]) -> Statuses {
        statuses.iter().fold(Statuses(0), |s, &x| s.with(x))
    }

    /// This set and `s`.
    pub fn with(self, s: Status) -> Statuses {
        Statuses(self.0 | 1 << (s as u8))
    }

    /// Whether `s` is in it.
    #[inline]
    pub fn contains(self, s: Status) -> bool {
        self.0 & (1 << (s as u8)) != 0
    }

    /// Whether it has none.
    #[inline]
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

/// How a call is tried again ([`CallOptions::retry`](crate::CallOptions)):
/// up to a number of attempts in all (the first included, at most
/// [`MAX_ATTEMPTS`]), when the answer has one of its statuses (never
/// `Ok`), after a wait of up to `backoff` before the second attempt that
/// doubles for each attempt after, up to `max_backoff`. Each wait is
/// random between zero and that (full jitter), so that callers failing
/// together do not come back together. (Compact: it rides in every
/// call's options.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retry {
    attempts: u8,
    on: Statuses,
    /// Microseconds.
    backoff: u32,
    /// Microseconds.
    max_backoff: u32,
}

/// `d` in microseconds, saturated.
fn micros(d: Duration) -> u32 {
    d.as_micros().min(u32::MAX as u128) as u32
}

impl Retry {
    /// Up to `attempts` attempts in all when the answer has one of `on`'s
    /// statuses, waiting up to 10 ms before the second, doubling to 1 s.
    pub fn new(attempts: u32, on: &[Status]) -> Retry {
        Retry {
            attempts: attempts.min(MAX_ATTEMPTS) as u8,
            on: Statuses::of(on),
            backoff: 10_000,
            max_backoff: 1_000_000,
        }
    }

    /// This policy, waiting up to `first` before the second attempt,
    /// doubling to `max` (each at most about 71 minutes).
    pub fn backoff(self, first: Duration, max: Duration) -> Retry {
        Retry {
            backoff: micros(first),
            max_backoff: micros(max.max(first)),
            ..self
        }
    }

    /// Attempts in all, the first included.
    pub fn attempts(&self) -> u32 {
        self.attempts as u32
    }

    /// The statuses worth another attempt.
    pub fn on(&self) -> Statuses {
        self.on
    }

    /// The longest wait before the second attempt.
    pub fn first_backoff(&self) -> Duration {
        Duration::from_micros(self.backoff as u64)
    }

    /// The longest wait between two attempts.
    pub fn max_backoff(&self) -> Duration {
        Duration::from_micros(self.max_backoff as u64)
    }

    /// The statuses that make a call try again, if it may try again.
    pub(crate) fn retries_on(&self) -> Statuses {
        match self.attempts {
            0 | 1 => Statuses::default(),
            _ => Statuses(self.on.0 & !1),
        }
    }

    /// The wait before attempt `n` (2: the first retry) after an answer
    /// with metadata `meta`, or None if there is to be no attempt `n`.
    pub(crate) fn wait(&self, n: u32, meta: &Metadata) -> Option<Duration> {
        if n > self.attempts() {
            return None;
        }
        if let Some(v) = meta.get(RETRY_AFTER) {
            let ms = std::str::from_utf8(v).ok()?.trim().parse::<u64>().ok()?;
            return Some(Duration::from_millis(ms));
        }
        let doubled = self
            .first_backoff()
            .saturating_mul(1 << (n.saturating_sub(2)).min(20))
            .min(self.max_backoff());
        Some(doubled.mul_f64(jitter()))
    }
}

/// A random number in [0, 1): splitmix64 of a counter seeded by the clock.
fn jitter() -> f64 {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let seed = SEQ.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut z = seed ^ t;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn waits_grow_to_their_cap_stop_after_the_last_attempt_and_heed_pushback() {
        let r = Retry::new(4, &[Status::Unavailable, Status::ResourceExhausted])
            .backoff(Duration::from_millis(100), Duration::from_millis(250));
        assert!(r.retries_on().contains(Status::Unavailable));
        assert!(!r.retries_on().contains(Status::Internal));
        let none = Metadata::new();
        for _ in 0..200 {
            for (n, cap) in [(2, 100), (3, 200), (4, 250)] {
                let w = r.wait(n, &none).unwrap();
                assert!(w <= Duration::from_millis(cap), "attempt {n}: {w:?}");
            }
            assert_eq!(r.wait(5, &none), None, "four attempts in all");
        }
        // Full jitter: the waits spread over their range.
        let waits: Vec<_> = (0..200).map(|_| r.wait(2, &none).unwrap()).collect();
        let low = waits
            .iter()
            .filter(|w| **w < Duration::from_millis(50))
            .count();
        assert!((40..160).contains(&low), "{low} of 200 below half");
        // The server's word wins, and a word that is not a number stops.
        let after = |v: &str| Metadata::new().with(RETRY_AFTER, v).unwrap();
        assert_eq!(r.wait(2, &after("700")), Some(Duration::from_millis(700)));
        assert_eq!(r.wait(2, &after("no")), None);
        assert_eq!(r.wait(5, &after("1")), None);
        // One attempt, or Ok, is no policy at all.
        assert!(Retry::new(1, &[Status::Unavailable])
            .retries_on()
            .is_empty());
        assert!(Retry::new(3, &[Status::Ok]).retries_on().is_empty());
        assert_eq!(Retry::new(99, &[]).attempts(), MAX_ATTEMPTS);
        assert_eq!(r.first_backoff(), Duration::from_millis(100));
        assert_eq!(r.max_backoff(), Duration::from_millis(250));
        let long = Retry::new(2, &[]).backoff(Duration::from_secs(1 << 40), Duration::ZERO);
        assert_eq!(long.first_backoff(), long.max_backoff(), "saturated");
    }
}

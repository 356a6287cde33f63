//! The receiving half of a client's connection: one caller at a time holds
//! it and reads the answers of all (leader/followers, see
//! [`crate::client`]); when it lets go, the callers waiting for their
//! answers are woken to take over reading, if there are any.
//!
//! A lone caller (the common case) takes the half with one
//! compare-exchange and lets it go with a store, a fence and a load: no
//! lock, and no look at the waiting list unless someone is on it. (With a
//! mutex for the half and the waiting list's lock taken on every
//! hand-over, a no-op call paid four locked instructions here instead of
//! two: about 20 ns of a 1 µs round trip.)
//!
//! The protocol is the store-buffering pattern, with a SeqCst fence on
//! each side (as [`crate::wait::Bell`]'s):
//!
//! ```text
//! holder:  busy = false (Release); fence(SeqCst); n = waiting;
//!          if n > 0 { lock the list; wake the sleepers }
//! waiter:  (list locked) waiting = n; fence(SeqCst) ... then, each look:
//!          compare_exchange(busy, false -> true); if it fails, sleep on
//!          the list's condition variable (which unlocks it)
//! ```
//!
//! Either the holder's fence comes after the waiter's, and its load sees
//! the registration (it takes the list's lock, which the waiter holds from
//! its failed look until it sleeps, so the wake-up cannot fall between the
//! two), or it comes before it, and the waiter's looks see the half free.
//! No waiter sleeps while the half lies free (`tests/loom.rs`; loom checks
//! fences, not the total order of SeqCst accesses, hence fences).

use crate::sync::{fence, AtomicBool, AtomicUsize, Ordering};
use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};

/// A value held by one taker at a time, with a count of the parties that
/// wait for it.
#[derive(Debug)]
pub struct Half<T> {
    busy: AtomicBool,
    /// Parties registered as waiting (kept by their owner, under its own
    /// lock: see the module doc).
    waiting: AtomicUsize,
    val: UnsafeCell<T>,
}

// SAFETY: the value is reached only through a `Held`, and `busy` admits
// one at a time (Acquire on taking, Release on letting go).
unsafe impl<T: Send> Send for Half<T> {}
// SAFETY: as above: `&Half` gives no access to the value without taking it.
unsafe impl<T: Send> Sync for Half<T> {}

impl<T> Half<T> {
    /// A free half holding `val`.
    pub fn new(val: T) -> Self {
        Half {
            busy: AtomicBool::new(false),
            waiting: AtomicUsize::new(0),
            val: UnsafeCell::new(val),
        }
    }

    /// Takes the half if it is free.
    #[inline]
    pub fn try_take(&self) -> Option<Held<'_, T>> {
        self.busy
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| Held { half: self })
    }

    /// Says how many parties wait for the half now. A party must be
    /// counted before its first [`try_take`](Self::try_take) after which
    /// it may sleep.
    #[inline]
    pub fn set_waiting(&self, n: usize) {
        self.waiting.store(n, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }
}

/// The half, taken: let go when dropped.
#[derive(Debug)]
pub struct Held<'a, T> {
    half: &'a Half<T>,
}

impl<T> Held<'_, T> {
    /// Lets the half go, and says whether parties wait for it (who may
    /// have to be woken to take it over).
    #[inline]
    pub fn hand_over(self) -> bool {
        let half = self.half;
        drop(self);
        fence(Ordering::SeqCst);
        half.waiting.load(Ordering::Relaxed) != 0
    }
}

impl<T> Drop for Held<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.half.busy.store(false, Ordering::Release);
    }
}

impl<T> Deref for Held<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: `busy` is ours until this `Held` is dropped.
        unsafe { &*self.half.val.get() }
    }
}

impl<T> DerefMut for Held<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes the borrow unique.
        unsafe { &mut *self.half.val.get() }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn one_taker_at_a_time_and_the_count_of_waiters_is_told_on_hand_over() {
        let h = Half::new(5u32);
        let mut a = h.try_take().expect("free");
        assert!(h.try_take().is_none(), "taken");
        *a += 1;
        assert!(!a.hand_over(), "nobody waits");
        h.set_waiting(2);
        let b = h.try_take().expect("free again");
        assert_eq!(*b, 6);
        assert!(b.hand_over(), "two wait");
        h.set_waiting(0);
        drop(h.try_take().expect("free after hand_over"));
        assert!(h.try_take().is_some(), "free after a drop");
    }

    /// Two threads take the half in turn and change the value it holds:
    /// under Miri (`scripts/miri.sh`), a taking without Acquire or a
    /// letting go without Release is a data race on the value.
    #[test]
    fn takers_on_two_threads_see_each_others_writes() {
        let h = std::sync::Arc::new(Half::new(0u64));
        let n = if cfg!(miri) { 20 } else { 2000 };
        let run = |h: std::sync::Arc<Half<u64>>| {
            move || {
                let mut done = 0;
                while done < n {
                    if let Some(mut v) = h.try_take() {
                        *v += 1;
                        done += 1;
                        let _ = v.hand_over();
                    } else {
                        std::thread::yield_now();
                    }
                }
            }
        };
        let t = std::thread::spawn(run(h.clone()));
        run(h.clone())();
        t.join().expect("taker");
        assert_eq!(*h.try_take().expect("free"), 2 * n);
    }
}

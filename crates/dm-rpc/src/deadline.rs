//! Deadline propagation: the calls a handler makes while it serves a call
//! inherit that call's deadline, so a chain of services gives up together
//! when its first caller does, instead of working on for nobody.
//!
//! The dispatcher marks its thread as serving a call while a blocking
//! handler runs and while an async handler's future is polled
//! (`serving`); a call started then takes the earlier of its own
//! deadline and the served one (`client::outgoing`), and sends
//! what is left of it, so the next service inherits it in turn. A call
//! marked [`CallOptions::detached`](crate::CallOptions) keeps only its own.
//! Work the handler hands to another thread (a spawned task, a thread of
//! its own) is not bound by the caller's deadline: it is not serving.
//!
//! A blocking handler with long work can ask whether its call was given
//! up ([`cancelled`]: the deadline passed, or the caller cancelled it) and
//! stop early. (An async handler's future is dropped when its call is
//! cancelled.)

use std::cell::Cell;
use std::time::Instant;

/// What tells whether the call being served was cancelled: a look at the
/// connections for a cancel of it (the dispatcher's), erased of its
/// borrow's lifetime (see [`watching`]).
type Check = *mut (dyn FnMut() -> bool + 'static);

thread_local! {
    /// The deadline of the call this thread serves now, if it has one.
    static SERVED: Cell<Option<Instant>> = const { Cell::new(None) };
    /// The check of the call a blocking handler serves on this thread.
    static CHECK: Cell<Option<Check>> = const { Cell::new(None) };
}

/// Whether the call this thread serves was given up: its deadline passed,
/// or (for a blocking handler) its caller cancelled it — a deadline that
/// ran out on the caller's side, or a call dropped by an async caller. A
/// handler doing long work may look now and then (each look reads the
/// connections once, without waiting) and stop: what it answers then is
/// dropped. False on a thread that serves no call.
pub fn cancelled() -> bool {
    if served().is_some_and(|d| Instant::now() >= d) {
        return true;
    }
    // Taken while it runs: a check cannot reach itself.
    let Some(check) = CHECK.with(Cell::take) else {
        return false;
    };
    let _restore = RestoreCheck(Some(check));
    // SAFETY: `watching` installed the pointer from a live `&mut`, and
    // removes it before that borrow ends; it is used only on this thread,
    // and taken out of the cell while in use, so never aliased.
    unsafe { (*check)() }
}

/// Puts a check back when dropped (a panic in it included).
struct RestoreCheck(Option<Check>);

impl Drop for RestoreCheck {
    fn drop(&mut self) {
        CHECK.with(|c| c.set(self.0));
    }
}

/// Runs `f` with `check` as the answer of [`cancelled`] on this thread.
pub(crate) fn watching<R>(check: &mut dyn FnMut() -> bool, f: impl FnOnce() -> R) -> R {
    let p: *mut (dyn FnMut() -> bool + '_) = check;
    // SAFETY: only the lifetime bound of the trait object changes (same
    // layout); the pointer is removed from the cell (by `RestoreCheck`,
    // on return or unwind) before `check`'s borrow ends.
    let p: Check = unsafe { std::mem::transmute(p) };
    let _restore = RestoreCheck(CHECK.with(|c| c.replace(Some(p))));
    f()
}

/// The deadline of the call this thread is serving (a blocking handler
/// runs on it, or an async handler's future is being polled on it), if
/// that call's caller set one. Calls made now inherit it.
pub fn served() -> Option<Instant> {
    SERVED.with(Cell::get)
}

/// Puts the previous served deadline back when dropped (a handler's panic
/// included).
struct Restore(Option<Instant>);

impl Drop for Restore {
    fn drop(&mut self) {
        SERVED.with(|c| c.set(self.0));
    }
}

/// Runs `f` as the serving of a call whose deadline is `deadline`.
#[inline]
pub(crate) fn serving<R>(deadline: Option<Instant>, f: impl FnOnce() -> R) -> R {
    let _restore = Restore(SERVED.with(|c| c.replace(deadline)));
    f()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn cancelled_asks_the_check_of_the_call_being_served() {
        assert!(!cancelled(), "serving nothing");
        let mut looks = 0;
        let mut check = || {
            looks += 1;
            // A check that looks again reaches nothing.
            assert!(!cancelled());
            looks >= 3
        };
        watching(&mut check, || {
            assert!(!cancelled());
            assert!(!cancelled());
            assert!(cancelled());
            // A passed deadline answers without a look.
            serving(Some(Instant::now()), || assert!(cancelled()));
            let r = std::panic::catch_unwind(|| {
                watching(&mut || panic!("a check that panics"), cancelled)
            });
            assert!(r.is_err());
            assert!(cancelled(), "the outer check is back");
        });
        assert_eq!(looks, 4);
        assert!(!cancelled(), "removed on return");
    }

    #[test]
    fn serving_nests_and_restores_even_on_a_panic() {
        let a = Instant::now() + Duration::from_secs(5);
        let b = a + Duration::from_secs(1);
        assert_eq!(served(), None);
        serving(Some(a), || {
            assert_eq!(served(), Some(a));
            serving(None, || assert_eq!(served(), None));
            assert_eq!(served(), Some(a));
            let r = std::panic::catch_unwind(|| serving(Some(b), || panic!("handler bug")));
            assert!(r.is_err());
            assert_eq!(served(), Some(a));
        });
        assert_eq!(served(), None);
        // Another thread serves nothing.
        serving(Some(a), || {
            assert_eq!(std::thread::spawn(served).join().unwrap(), None);
        });
    }
}

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

use std::cell::Cell;
use std::time::Instant;

thread_local! {
    /// The deadline of the call this thread serves now, if it has one.
    static SERVED: Cell<Option<Instant>> = const { Cell::new(None) };
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
pub(crate) fn serving<R>(deadline: Option<Instant>, f: impl FnOnce() -> R) -> R {
    let _restore = Restore(SERVED.with(|c| c.replace(deadline)));
    f()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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

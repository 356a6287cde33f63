//! Where the RPC layer's atomics and futex calls come from, so that the
//! ring and doorbell protocols can be model-checked with loom
//! (`RUSTFLAGS="--cfg loom" cargo test -p dm-rpc --release --test loom`).

#[cfg(loom)]
pub use loom::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{
    fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering,
};

/// Locks `m`, poisoned or not. A panic while holding one of the RPC
/// layer's mutexes (a handler's, caught at the dispatcher) leaves its data
/// consistent: each is changed in steps that hold at any point.
#[cfg(not(loom))]
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sleeps while `*word == expected` (at most `timeout`).
#[cfg(not(loom))]
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<std::time::Duration>) {
    dm_sys::futex::wait(word, expected, timeout);
}

/// Wakes one waiter on `word`.
#[cfg(not(loom))]
pub(crate) fn futex_wake(word: &AtomicU32) {
    dm_sys::futex::wake(word, 1);
}

/// The model of a futex: without a timeout, blocks until the word changes
/// (no spurious wake-ups, so a lost wake-up is a hang loom reports); with
/// one, it may also return at once (the timeout passing).
#[cfg(loom)]
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<std::time::Duration>) {
    if timeout.is_some() {
        loom::thread::yield_now();
        return;
    }
    while word.load(Ordering::SeqCst) == expected {
        loom::thread::yield_now();
    }
}

/// Wakes: in the model, waiters watch the word itself.
#[cfg(loom)]
pub fn futex_wake(_word: &AtomicU32) {}

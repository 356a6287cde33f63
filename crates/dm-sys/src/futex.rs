//! Cross-process futexes on words in shared memory.
//!
//! Without `FUTEX_PRIVATE_FLAG`: the kernel keys the wait on the backing
//! page, so a process can wake another that maps the same file at any
//! address. The word must be a naturally aligned `u32` in a `MAP_SHARED`
//! mapping (or in ordinary memory, for waiters in one process).

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Why a wait returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// Woken (or a spurious wake-up: callers re-check their condition).
    Woken,
    /// The word did not hold `expected` when the kernel looked.
    Changed,
    /// The timeout passed.
    TimedOut,
}

/// Sleeps while `*word == expected`, for at most `timeout` (None: forever).
pub fn wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) -> Wake {
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let tsp = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `word` is a valid, aligned u32 for the duration of the call;
    // FUTEX_WAIT only reads it; the timeout pointer is null or valid.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            tsp,
            std::ptr::null::<u32>(),
            0u32,
        )
    };
    if r == 0 {
        return Wake::Woken;
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::ETIMEDOUT) => Wake::TimedOut,
        Some(libc::EAGAIN) => Wake::Changed,
        _ => Wake::Woken, // EINTR: treat as a wake-up; callers re-check
    }
}

/// Wakes up to `n` waiters on `word`. Returns how many were woken.
pub fn wake(word: &AtomicU32, n: u32) -> u32 {
    // SAFETY: FUTEX_WAKE does not access the word's memory beyond keying.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            n.min(i32::MAX as u32),
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        )
    };
    r.max(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    #[test]
    fn wait_and_wake() {
        let w = Arc::new(AtomicU32::new(0));
        assert_eq!(wait(&w, 1, None), Wake::Changed);
        assert_eq!(wait(&w, 0, Some(Duration::from_millis(5))), Wake::TimedOut);
        let w2 = w.clone();
        let t = std::thread::spawn(move || {
            while w2.load(Ordering::Acquire) == 0 {
                wait(&w2, 0, Some(Duration::from_secs(5)));
            }
        });
        std::thread::sleep(Duration::from_millis(20));
        w.store(1, Ordering::Release);
        wake(&w, 1);
        t.join().unwrap();
    }
}

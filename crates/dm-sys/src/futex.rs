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
    failed(std::io::Error::last_os_error())
}

/// Why a wait that returned -1 ended.
fn failed(e: std::io::Error) -> Wake {
    match e.raw_os_error() {
        Some(libc::ETIMEDOUT) => Wake::TimedOut,
        Some(libc::EAGAIN) => Wake::Changed,
        _ => Wake::Woken, // EINTR: treat as a wake-up; callers re-check
    }
}

/// The most words [`wait_any`] takes (the kernel's limit for `futex_waitv`).
pub const WAIT_ANY_MAX: usize = 128;

/// One word of a [`wait_any`] (the kernel's `struct futex_waitv`).
#[repr(C)]
struct WaitV {
    val: u64,
    uaddr: u64,
    flags: u32,
    reserved: u32,
}

/// `FUTEX2_SIZE_U32`: a 32-bit word (shared: no `FUTEX2_PRIVATE`).
const FUTEX2_SIZE_U32: u32 = 0x02;

/// Sleeps while every `*word == expected` of `words` (at most
/// [`WAIT_ANY_MAX`] of them), for at most `timeout` (None: forever):
/// `futex_waitv(2)`, Linux 5.16 and later. A wake of any one of the words
/// ends the wait. On a kernel without it (or with too many words) this
/// sleeps on the first word alone for at most a millisecond, so callers
/// that re-check every word between waits still see the others soon.
pub fn wait_any(words: &[(&AtomicU32, u32)], timeout: Option<Duration>) -> Wake {
    let Some(&(first, first_expected)) = words.first() else {
        std::thread::sleep(timeout.unwrap_or(Duration::from_millis(1)));
        return Wake::TimedOut;
    };
    if words.len() == 1 {
        return wait(first, first_expected, timeout);
    }
    let fallback = |t: Option<Duration>| {
        let ms = Duration::from_millis(1);
        wait(first, first_expected, Some(t.map_or(ms, |t| t.min(ms))))
    };
    if words.len() > WAIT_ANY_MAX {
        return fallback(timeout);
    }
    let v: Vec<WaitV> = words
        .iter()
        .map(|&(w, expected)| WaitV {
            val: expected as u64,
            uaddr: w.as_ptr() as u64,
            flags: FUTEX2_SIZE_U32,
            reserved: 0,
        })
        .collect();
    // futex_waitv takes an absolute CLOCK_MONOTONIC time.
    let ts = timeout.map(|t| {
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `now` is a valid timespec to write.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
        let ns = now.tv_nsec as u64 + t.subsec_nanos() as u64;
        libc::timespec {
            tv_sec: now
                .tv_sec
                .saturating_add(t.as_secs().min(i32::MAX as u64) as libc::time_t)
                .saturating_add((ns / 1_000_000_000) as libc::time_t),
            tv_nsec: (ns % 1_000_000_000) as libc::c_long,
        }
    });
    let tsp = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `v` holds `v.len()` valid entries naming aligned u32 words
    // that outlive the call (borrowed); the kernel only reads them; the
    // timeout pointer is null or valid.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex_waitv,
            v.as_ptr(),
            v.len() as libc::c_uint,
            0u32,
            tsp,
            libc::CLOCK_MONOTONIC,
        )
    };
    if r >= 0 {
        return Wake::Woken;
    }
    match std::io::Error::last_os_error() {
        e if e.raw_os_error() == Some(libc::ENOSYS) => fallback(timeout),
        e => failed(e),
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

    #[test]
    fn wait_any_wakes_on_any_word_and_checks_every_value() {
        let (a, b) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        // A word that does not hold its value: no sleep at all.
        assert_eq!(wait_any(&[(&a, 0), (&b, 1)], None), Wake::Changed);
        let t0 = std::time::Instant::now();
        assert_eq!(
            wait_any(&[(&a, 0), (&b, 0)], Some(Duration::from_millis(20))),
            Wake::TimedOut
        );
        assert!(t0.elapsed() >= Duration::from_millis(19));
        // A wake of the second word ends a wait on both.
        let (a2, b2) = (a.clone(), b.clone());
        let t = std::thread::spawn(move || {
            let t0 = std::time::Instant::now();
            while b2.load(Ordering::Acquire) == 0 {
                wait_any(&[(&a2, 0), (&b2, 0)], Some(Duration::from_secs(10)));
            }
            t0.elapsed()
        });
        std::thread::sleep(Duration::from_millis(20));
        b.store(1, Ordering::Release);
        wake(&b, 1);
        // Woken, not timed out (the timeout is 10 s).
        assert!(t.join().unwrap() < Duration::from_secs(5));
    }
}

//! The heaps open in this process, by base address: how an allocator
//! handle (which lives in the heap, the same in every process) finds the
//! process's pool and its mapping's length when it needs them.

use crate::error::HeapError;
use dm_pool::Pool;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

const MAX_OPEN: usize = 64;
static OPEN: [AtomicPtr<Pool>; MAX_OPEN] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_OPEN];
static OPEN_BASE: [AtomicU64; MAX_OPEN] = [const { AtomicU64::new(0) }; MAX_OPEN];
static OPEN_LEN: [AtomicU64; MAX_OPEN] = [const { AtomicU64::new(0) }; MAX_OPEN];

/// The pool and the length of the heap open at `base` in this process.
pub(crate) fn open_at(base: u64) -> Option<(&'static Pool, u64)> {
    let i = OPEN_BASE
        .iter()
        .position(|b| b.load(Ordering::Acquire) == base)?;
    let p = OPEN[i].load(Ordering::Acquire);
    // SAFETY: a non-null entry is a leaked Box<Pool> freed only when its
    // heap closes; a lookup runs inside a call on the heap's allocator,
    // which borrows the open heap.
    (!p.is_null()).then(|| (unsafe { &*p }, OPEN_LEN[i].load(Ordering::Acquire)))
}

/// Lists the heap mapped at `base` (`len` bytes) of `pool`: its entry.
pub(crate) fn register(base: u64, len: u64, pool: &Pool) -> Result<usize, HeapError> {
    let entry = OPEN_BASE
        .iter()
        .position(|b| {
            b.compare_exchange(0, u64::MAX, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        })
        .ok_or(HeapError::Pool(dm_pool::Error::ResourceExhausted {
            what: "open heaps (64 per process)",
        }))?;
    OPEN[entry].store(Box::into_raw(Box::new(pool.clone())), Ordering::Release);
    OPEN_LEN[entry].store(len, Ordering::Release);
    OPEN_BASE[entry].store(base, Ordering::Release);
    Ok(entry)
}

/// Takes entry `entry` off the list (its heap is closing).
pub(crate) fn unregister(entry: usize) {
    OPEN_BASE[entry].store(u64::MAX, Ordering::Release);
    let p = OPEN[entry].swap(std::ptr::null_mut(), Ordering::AcqRel);
    if !p.is_null() {
        // SAFETY: the Box leaked in `register`, taken back once.
        drop(unsafe { Box::from_raw(p) });
    }
    OPEN_BASE[entry].store(0, Ordering::Release);
}

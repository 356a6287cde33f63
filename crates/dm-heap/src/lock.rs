//! The heap's lock: one word in the heap's header, shared by every
//! process that opens it.
//!
//! The word is 0 when free, else its holder's attachment to the pool
//! ([`Pool::attachment`], with the top bit set so it is never 0). A
//! process killed while it holds the lock does not keep it: a waiter
//! that has waited a while asks the pool whether the holder is still
//! attached, and takes the lock over once it is not. Everything done
//! under the lock is a store of one word at a time (`alloc.rs`), so what
//! a dead holder leaves is consistent: at worst a block it was taking or
//! giving back is lost to the heap.

use dm_pool::Pool;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const HELD: u64 = 1 << 63;

/// How long a waiter spins before it asks whether the holder lives.
const PATIENCE: Duration = Duration::from_millis(2);
/// How often it asks the pool to reclaim the dead, while it waits on one
/// that the pool still counts as attached.
const GC_EVERY: Duration = Duration::from_millis(50);

/// A held lock; dropping it lets go.
pub(crate) struct Held<'a> {
    word: &'a AtomicU64,
    me: u64,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        // (Taken over meanwhile: it is no longer ours to free.)
        let _ = self
            .word
            .compare_exchange(self.me, 0, Ordering::Release, Ordering::Relaxed);
    }
}

/// Takes the lock in `word` for this process of `pool`.
pub(crate) fn lock<'a>(word: &'a AtomicU64, pool: Option<&Pool>) -> Held<'a> {
    let me = pool.map_or(HELD, |p| p.attachment() | HELD);
    let mut spins = 0u32;
    let mut since: Option<Instant> = None;
    let mut last_gc: Option<Instant> = None;
    loop {
        let cur = word.load(Ordering::Relaxed);
        if cur == 0
            && word
                .compare_exchange_weak(0, me, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
        {
            return Held { word, me };
        }
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
            continue;
        }
        std::thread::yield_now();
        let now = Instant::now();
        let start = *since.get_or_insert(now);
        if cur == 0 || now - start < PATIENCE {
            continue;
        }
        let Some(p) = pool else { continue };
        if !p.is_attached(cur & !HELD) {
            // Its holder is gone: the lock is ours.
            if word
                .compare_exchange(cur, me, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return Held { word, me };
            }
        } else if last_gc.is_none_or(|t| now - t >= GC_EVERY) {
            // Held long: perhaps by one that died and is not reclaimed yet.
            last_gc = Some(now);
            let _ = p.maintain();
        }
    }
}

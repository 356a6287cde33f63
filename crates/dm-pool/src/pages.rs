//! Where pages are counted: the page table and the free-page structure.
//!
//! Every data page of the pool has one 64-bit word in the pool's page table.
//! The word says, in one atomic value, which of three states the page is in
//! and, where it matters, who owns it:
//!
//! | state    | meaning                                               | fields          |
//! |----------|-------------------------------------------------------|-----------------|
//! | `Free`   | in the shared free set, contents left as they were    | word == 0       |
//! | `Cached` | claimed by one slot (its page cache, or being filled) | owner slot      |
//! | `Held`   | reachable from descriptors (buffers, Refs, lists)     | refcount > 0    |
//! | `Locked` | held; its count was just changed by one descriptor    | refcount, desc  |
//!
//! Because the owner of a cached page is recorded in the same word that a
//! claim changes, a process killed between any two instructions never loses
//! a page: whatever it had claimed is `Cached(its slot)` and is swept back
//! when its lease expires. The free set is therefore the page table itself
//! read as a bitmap, and claiming is a CAS `Free -> Cached(slot)` on each
//! page — lock-free, with a shared cursor that spreads processes over the
//! table and makes consecutive claims contiguous runs (one `mmap` per run for
//! mapped buffers). A process giving pages back points the cursor at them,
//! so the pages in circulation stay a small, warm set instead of the cursor
//! sweeping the whole pool. Processes claim in batches into a private page cache and give
//! back surplus, so the per-allocation fast path touches no shared line
//! beyond the page's own word (DmRPC-CXL's page-ownership coordinator).
//!
//! A count change is one CAS that also *locks* the page to the descriptor
//! making it; the descriptor then records the change in its own counter and
//! unlocks. Since the lock names the descriptor, a process killed between
//! the two steps leaves enough in the pool for anyone to finish its record:
//! crash recovery is exact, with no leaked and no doubly dropped share.
//!
//! Reference counts follow the copy-on-write rule of `docs/design.md` (*The DM contract*): a
//! holder that writes a page whose count is above one copies it first; the
//! last holder to drop a page turns it into `Cached(itself)` and reuses or
//! returns it as it is. Pages are zeroed when taken, not when freed, and
//! only where the taker does not overwrite them (a write of whole pages,
//! the common case of a buffer filled once, zeroes nothing): a partial
//! first write zeroes the rest of its page, a write fault on an unbacked
//! page of a mapped buffer zeroes the page, list pages are filled. Pool
//! format 5; up to 4, the last holder zeroed every page it freed.

use crate::sync::{AtomicU64, Ordering};

/// Marks "no page" in page lists (an unbacked page reads as zero).
pub const NO_PAGE: u32 = u32::MAX;

/// Flag on a page-list entry: the page is *borrowed* from the Ref a buffer
/// was mapped from (held by the Ref's share, not by this entry).
pub const BORROWED: u32 = 1 << 31;

/// Most data pages a pool can have (entries keep the top bit for [`BORROWED`]).
pub const MAX_PAGES: u32 = BORROWED - 2;

const RC_MASK: u64 = 0xFFFF_FFFF;
const ID_SHIFT: u32 = 32;
const ID_MASK: u64 = ((1 << 29) - 1) << ID_SHIFT;
const LOCK_BIT: u64 = 1 << 61;
const STATE_SHIFT: u32 = 62;
const ST_CACHED: u64 = 1;
const ST_HELD: u64 = 2;

/// Largest descriptor index a page lock can name.
pub const MAX_LOCK_DESC: u32 = (1 << 29) - 1;

/// Decoded state of one page.
///
/// Word layout: `state (2) | lock (1) | id (29) | rc (32)`, where `id` is
/// the owner slot of a cached page or the locking descriptor of a locked one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageState {
    /// In the free set (contents undefined).
    Free,
    /// Claimed by the slot with this index.
    Cached(u16),
    /// Held by this many holders.
    Held(u32),
    /// Held by `rc` holders, and locked by descriptor `desc`, which has just
    /// changed `rc` and not yet recorded that in its own counter.
    Locked {
        /// Reference count (already including the locker's change).
        rc: u32,
        /// Locking descriptor.
        desc: u32,
    },
    /// A word no correct writer produces.
    Invalid(u64),
}

impl PageState {
    /// Decodes a page-table word.
    pub fn decode(w: u64) -> Self {
        let id = (w & ID_MASK) >> ID_SHIFT;
        let rc = (w & RC_MASK) as u32;
        match (w >> STATE_SHIFT, w & LOCK_BIT != 0) {
            (0, _) if w == 0 => PageState::Free,
            (ST_CACHED, false) if rc == 0 && id <= u16::MAX as u64 => PageState::Cached(id as u16),
            (ST_HELD, false) if id == 0 && rc > 0 => PageState::Held(rc),
            (ST_HELD, true) if rc > 0 => PageState::Locked {
                rc,
                desc: id as u32,
            },
            _ => PageState::Invalid(w),
        }
    }

    /// Encodes a state as a page-table word.
    pub fn encode(self) -> u64 {
        match self {
            PageState::Free => 0,
            PageState::Cached(s) => (ST_CACHED << STATE_SHIFT) | ((s as u64) << ID_SHIFT),
            PageState::Held(rc) => (ST_HELD << STATE_SHIFT) | rc as u64,
            PageState::Locked { rc, desc } => {
                (ST_HELD << STATE_SHIFT)
                    | LOCK_BIT
                    | (((desc as u64) << ID_SHIFT) & ID_MASK)
                    | rc as u64
            }
            PageState::Invalid(w) => w,
        }
    }

    /// Reference count of a held (possibly locked) page, else 0.
    pub fn rc(self) -> u32 {
        match self {
            PageState::Held(rc) | PageState::Locked { rc, .. } => rc,
            _ => 0,
        }
    }
}

/// A reference-count change asked of [`PageTable::change`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delta {
    /// Add a share to a page that must be held.
    Inc,
    /// Add a share if the page is held; report `NotHeld` otherwise. No
    /// pool operation asks for it since a mapped buffer borrows its Ref's
    /// pages; the loom model of a map racing a release still checks it.
    #[cfg_attr(not(loom), allow(dead_code))]
    TryInc,
    /// Drop a share; the last one turns the page into `Cached(slot)`.
    Dec(u16),
}

/// Outcome of [`PageTable::change`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Changed {
    /// The count changed and the page is now locked by the caller's
    /// descriptor (this is the locked word): record the change in the
    /// descriptor, then [`PageTable::unlock`].
    Locked(u64),
    /// The last share was dropped: the page is `Cached(slot)` of the caller,
    /// to reuse or return (as it is). Not locked.
    Last,
    /// `TryInc` on a page that is not held: nothing changed.
    NotHeld,
    /// Locked by another descriptor: wait for it (or complete its operation
    /// if its owner is dead), then retry.
    Busy(u32),
}

/// A page-table protocol violation: an operation met a page in a state it
/// cannot be in if every process follows the protocol (or the pool is corrupt).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("page {page} is {found:?}, expected {expected}")]
pub struct PageError {
    /// Page index.
    pub page: u32,
    /// What was found.
    pub found: PageState,
    /// What the operation needed.
    pub expected: &'static str,
}

/// Pages per stripe lock.
pub const STRIPE: u32 = 64;

/// Stripe words needed for `pages` pages.
pub fn stripes_for(pages: u32) -> u32 {
    pages.div_ceil(STRIPE)
}

/// The page table: a view of `n` atomic words in the pool, and the stripe
/// locks (one word per [`STRIPE`] consecutive pages: 0, or locker desc + 1).
///
/// Every change of a *held* page's count happens under its stripe lock:
/// one CAS takes the stripe, then the words of its pages are changed with
/// plain loads and stores (nobody else writes a held word of a locked
/// stripe), each left `Locked` by the descriptor until it has recorded the
/// changes, then the pages and the stripe are unlocked. Sharing a run of
/// pages thus costs one atomic read-modify-write per stripe, not per page.
/// Claims and releases of free and cached pages are single CASes and do not
/// take stripes (they never touch a held word).
#[derive(Debug, Clone, Copy)]
pub struct PageTable<'a> {
    words: &'a [AtomicU64],
    stripes: &'a [AtomicU64],
}

impl<'a> PageTable<'a> {
    /// Wraps the page-table words and their stripe locks
    /// (`stripes.len() >= stripes_for(words.len())`).
    pub fn new(words: &'a [AtomicU64], stripes: &'a [AtomicU64]) -> Self {
        Self { words, stripes }
    }

    fn stripe(&self, page: u32) -> Result<&'a AtomicU64, PageError> {
        self.stripes.get((page / STRIPE) as usize).ok_or(PageError {
            page,
            found: PageState::Invalid(u64::MAX),
            expected: "a page with a stripe lock",
        })
    }

    /// Takes the stripe lock of `page` for `desc`: `Ok(None)` when taken,
    /// `Ok(Some(other))` when descriptor `other` holds it.
    pub fn lock_stripe_of(&self, page: u32, desc: u32) -> Result<Option<u32>, PageError> {
        let s = self.stripe(page)?;
        match s.compare_exchange(0, desc as u64 + 1, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => Ok(None),
            Err(other) => Ok(Some((other - 1) as u32)),
        }
    }

    /// Releases the stripe lock of `page` (held by the caller).
    pub fn unlock_stripe_of(&self, page: u32) {
        if let Ok(s) = self.stripe(page) {
            s.store(0, Ordering::Release);
        }
    }

    /// Stripe `index`'s holder, if locked.
    pub fn stripe_holder(&self, index: u32) -> Option<u32> {
        match self.stripes.get(index as usize)?.load(Ordering::Acquire) {
            0 => None,
            w => Some((w - 1) as u32),
        }
    }

    /// Releases stripe `index` if `desc` holds it (crash recovery). Idempotent.
    pub fn unlock_stripe_if(&self, index: u32, desc: u32) -> bool {
        self.stripes.get(index as usize).is_some_and(|s| {
            s.compare_exchange(desc as u64 + 1, 0, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        })
    }

    /// Number of stripes.
    pub fn stripe_count(&self) -> u32 {
        self.stripes.len() as u32
    }

    fn word(&self, page: u32) -> Result<&'a AtomicU64, PageError> {
        self.words.get(page as usize).ok_or(PageError {
            page,
            found: PageState::Invalid(u64::MAX),
            expected: "a page index inside the pool",
        })
    }

    /// Current state of a page.
    pub fn state(&self, page: u32) -> Result<PageState, PageError> {
        Ok(PageState::decode(self.word(page)?.load(Ordering::Acquire)))
    }

    /// Reference count of a held page (0 if not held).
    pub fn rc(&self, page: u32) -> u32 {
        self.state(page).map_or(0, PageState::rc)
    }

    /// `Free -> Cached(slot)`: claims a free page. False if it was not free.
    pub fn try_claim(&self, page: u32, slot: u16) -> bool {
        self.words.get(page as usize).is_some_and(|w| {
            w.compare_exchange(
                0,
                PageState::Cached(slot).encode(),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
        })
    }

    /// `Cached(slot) -> Free`.
    pub fn release_cached(&self, page: u32, slot: u16) -> Result<(), PageError> {
        self.transition(
            page,
            PageState::Cached(slot),
            PageState::Free,
            "cached by this slot",
        )
    }

    /// `Cached(slot) -> Free` for each of `pages`, by plain stores: no
    /// other process writes a page its live owner caches (a claim takes
    /// only free pages; a reclaimer, only a dead slot's). A page not
    /// cached by `slot` is left alone and not counted. Returns how many
    /// were freed and the lowest of them. A freed page's last writes come
    /// before its store (release): its next taker, who claims it by a CAS
    /// (acquire), sees them.
    pub fn release_cached_run(&self, pages: &[u32], slot: u16) -> (usize, Option<u32>) {
        let cached = PageState::Cached(slot).encode();
        let free = PageState::Free.encode();
        let (mut n, mut first) = (0, None::<u32>);
        for &p in pages {
            let Some(w) = self.words.get(p as usize) else {
                continue;
            };
            if w.load(Ordering::Acquire) == cached {
                w.store(free, Ordering::Release);
                n += 1;
                first = Some(first.map_or(p, |f| f.min(p)));
            }
        }
        (n, first)
    }

    /// `Cached(slot) -> Held(1)`: a page from the slot's page cache becomes held by
    /// one descriptor entry (which the caller has already written).
    pub fn hold_cached(&self, page: u32, slot: u16) -> Result<(), PageError> {
        self.transition(
            page,
            PageState::Cached(slot),
            PageState::Held(1),
            "cached by this slot",
        )
    }

    fn transition(
        &self,
        page: u32,
        from: PageState,
        to: PageState,
        expected: &'static str,
    ) -> Result<(), PageError> {
        let w = self.word(page)?;
        w.compare_exchange(
            from.encode(),
            to.encode(),
            Ordering::AcqRel,
            Ordering::Acquire,
        )
        .map(|_| ())
        .map_err(|cur| PageError {
            page,
            found: PageState::decode(cur),
            expected,
        })
    }

    /// The common case of [`change_in_stripe`](Self::change_in_stripe): a
    /// held, unlocked page whose count changes and stays above zero (the
    /// caller holds the stripe). `None` means "take the general path".
    #[inline(always)]
    pub fn change_fast(&self, page: u32, desc: u32, delta: Delta) -> Option<Changed> {
        let w = self.words.get(page as usize)?;
        let cur = w.load(Ordering::Acquire);
        if cur & !RC_MASK != ST_HELD << STATE_SHIFT {
            return None;
        }
        let rc = cur & RC_MASK;
        let lock = LOCK_BIT | (((desc as u64) << ID_SHIFT) & ID_MASK);
        let next = match delta {
            Delta::Inc | Delta::TryInc if rc < u32::MAX as u64 - 1 => (cur + 1) | lock,
            Delta::Dec(_) if rc > 1 => (cur - 1) | lock,
            _ => return None,
        };
        w.store(next, Ordering::Relaxed);
        Some(Changed::Locked(next))
    }

    /// Changes a held page's count for descriptor `desc`, which must hold
    /// the page's stripe lock ([`lock_stripe_of`](Self::lock_stripe_of)).
    ///
    /// The new count and the page lock are one store: a page `Locked` by
    /// `desc` has had its count changed and `desc` has not yet recorded it.
    /// Whoever reclaims a dead owner's descriptor can therefore complete the
    /// record and unlock, and no crash point leaves a share counted twice or
    /// not at all (see `reclaim.rs`).
    #[inline]
    pub fn change_in_stripe(
        &self,
        page: u32,
        desc: u32,
        delta: Delta,
    ) -> Result<Changed, PageError> {
        let w = self.word(page)?;
        let cur = w.load(Ordering::Acquire);
        let lock = LOCK_BIT | (((desc as u64) << ID_SHIFT) & ID_MASK);
        // Fast path: held and unlocked — no decoding.
        let next = if cur & !RC_MASK == ST_HELD << STATE_SHIFT {
            let rc = cur & RC_MASK;
            match delta {
                Delta::Inc | Delta::TryInc if rc < u32::MAX as u64 - 1 => (cur + 1) | lock,
                Delta::Dec(slot) if rc == 1 => PageState::Cached(slot).encode(),
                Delta::Dec(_) => (cur - 1) | lock,
                _ => {
                    return Err(PageError {
                        page,
                        found: PageState::decode(cur),
                        expected: "below 2^32-1 shares",
                    })
                }
            }
        } else {
            return match (PageState::decode(cur), delta) {
                (PageState::Locked { desc: other, .. }, _) => Ok(Changed::Busy(other)),
                (_, Delta::TryInc) => Ok(Changed::NotHeld),
                (found, _) => Err(PageError {
                    page,
                    found,
                    expected: "held",
                }),
            };
        };
        w.store(next, Ordering::Relaxed);
        Ok(if next & LOCK_BIT != 0 {
            Changed::Locked(next)
        } else {
            Changed::Last
        })
    }

    /// Changes one page's count for `desc`, taking its stripe. On `Locked`
    /// or `Last` the stripe stays held: record the change, then call
    /// [`done`](Self::done). `Busy` means another descriptor holds the
    /// stripe or the page: wait (or reclaim its dead owner) and retry.
    pub fn change(&self, page: u32, desc: u32, delta: Delta) -> Result<Changed, PageError> {
        if let Some(other) = self.lock_stripe_of(page, desc)? {
            return Ok(Changed::Busy(other));
        }
        let r = self.change_in_stripe(page, desc, delta);
        if !matches!(r, Ok(Changed::Locked(_) | Changed::Last)) {
            self.unlock_stripe_of(page);
        }
        r
    }

    /// Ends a single-page [`change`](Self::change) once it is recorded:
    /// unlocks the page (if locked) and its stripe.
    pub fn done(&self, page: u32, changed: Changed) {
        if let Changed::Locked(w) = changed {
            self.unlock_own(page, w);
        }
        self.unlock_stripe_of(page);
    }

    /// Unlocks a page locked by `desc` (keeping its count). Idempotent:
    /// false if it was not locked by `desc`.
    pub fn unlock(&self, page: u32, desc: u32) -> bool {
        let Ok(w) = self.word(page) else { return false };
        let mut cur = w.load(Ordering::Acquire);
        loop {
            let PageState::Locked { rc, desc: d } = PageState::decode(cur) else {
                return false;
            };
            if d != desc & MAX_LOCK_DESC {
                return false;
            }
            match w.compare_exchange_weak(
                cur,
                PageState::Held(rc).encode(),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(c) => cur = c,
            }
        }
    }

    /// Unlocks a page this caller locked, given the word the change
    /// returned. A plain store: while a page is locked only its locker
    /// writes the word.
    #[inline]
    pub fn unlock_own(&self, page: u32, locked: u64) {
        if let Some(w) = self.words.get(page as usize) {
            w.store(locked & !(LOCK_BIT | ID_MASK), Ordering::Release);
        }
    }

    /// Whether `page` is locked by `desc`.
    pub fn locked_by(&self, page: u32, desc: u32) -> bool {
        matches!(self.state(page), Ok(PageState::Locked { desc: d, .. }) if d == desc & MAX_LOCK_DESC)
    }

    /// Claims one free page for `slot`. Allocation-free and lock-free, so
    /// the fault handler can call it.
    pub fn claim_one(&self, cursor: &AtomicU64, slot: u16) -> Option<u32> {
        let n = self.words.len();
        if n == 0 {
            return None;
        }
        let start = (cursor.fetch_add(1, Ordering::Relaxed) % n as u64) as usize;
        (0..n)
            .map(|k| (start + k) % n)
            .find(|&i| self.words[i].load(Ordering::Relaxed) == 0 && self.try_claim(i as u32, slot))
            .map(|i| i as u32)
    }

    /// Claims `want` free pages that are consecutive, for `slot`, scanning
    /// from the shared cursor over at most `budget` words (a run does not
    /// wrap round the table's end). Gives the first page, or `None` if the
    /// scan found no such run (it then holds nothing it claimed).
    pub fn claim_run(
        &self,
        cursor: &AtomicU64,
        slot: u16,
        want: usize,
        budget: usize,
    ) -> Option<u32> {
        let n = self.words.len();
        if want == 0 || want > n {
            return None;
        }
        let mut i = (cursor.load(Ordering::Relaxed) % n as u64) as usize;
        let mut free = 0;
        for _ in 0..budget.min(n + want) {
            if i == n {
                (i, free) = (0, 0);
            }
            free = if self.words[i].load(Ordering::Relaxed) == 0 {
                free + 1
            } else {
                0
            };
            i += 1;
            if free < want {
                continue;
            }
            // Free when looked at: claim them, or give back what was
            // claimed if another process was quicker.
            let first = i - want;
            let claimed = (first..i)
                .take_while(|&p| self.try_claim(p as u32, slot))
                .count();
            if claimed == want {
                cursor.store(i as u64, Ordering::Relaxed);
                return Some(first as u32);
            }
            for p in first..first + claimed {
                let _ = self.release_cached(p as u32, slot);
            }
            free = 0;
        }
        None
    }

    /// Claims up to `want` free pages for `slot`, scanning from a shared
    /// cursor, appending them to `out` in ascending runs. Returns how many.
    ///
    /// The cursor is advanced by `want` up front so that processes refilling
    /// at the same time scan different parts of the table. The scan covers
    /// the whole table at most once, so an exhausted pool costs one pass.
    pub fn claim_batch(
        &self,
        cursor: &AtomicU64,
        slot: u16,
        want: usize,
        out: &mut Vec<u32>,
    ) -> usize {
        let n = self.words.len();
        if n == 0 || want == 0 {
            return 0;
        }
        let start = (cursor.fetch_add(want as u64, Ordering::Relaxed) % n as u64) as usize;
        let mut got = 0;
        let mut i = start;
        for _ in 0..n {
            if self.words[i].load(Ordering::Relaxed) == 0 && self.try_claim(i as u32, slot) {
                out.push(i as u32);
                got += 1;
                if got == want {
                    break;
                }
            }
            i += 1;
            if i == n {
                i = 0;
            }
        }
        cursor.store((i + 1) as u64, Ordering::Relaxed);
        got
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn table(n: usize) -> (Vec<AtomicU64>, Vec<AtomicU64>) {
        let w = (0..n).map(|_| AtomicU64::new(0)).collect();
        let s = (0..stripes_for(n as u32))
            .map(|_| AtomicU64::new(0))
            .collect();
        (w, s)
    }

    #[test]
    fn encode_decode_roundtrip() {
        for s in [
            PageState::Free,
            PageState::Cached(0),
            PageState::Cached(65535),
            PageState::Held(1),
            PageState::Held(u32::MAX),
            PageState::Locked { rc: 3, desc: 0 },
            PageState::Locked {
                rc: 1,
                desc: MAX_LOCK_DESC,
            },
        ] {
            assert_eq!(PageState::decode(s.encode()), s);
        }
        assert!(matches!(PageState::decode(3 << 62), PageState::Invalid(_)));
        assert!(matches!(
            PageState::decode(ST_HELD << 62),
            PageState::Invalid(_)
        ));
        assert!(matches!(
            PageState::decode(ST_CACHED << 62 | 5),
            PageState::Invalid(_)
        ));
    }

    #[test]
    fn lifecycle_with_locks() {
        let (w, st) = table(4);
        let t = PageTable::new(&w, &st);
        assert!(t.try_claim(1, 7));
        assert!(!t.try_claim(1, 8));
        assert_eq!(t.state(1).unwrap(), PageState::Cached(7));
        assert!(t.hold_cached(1, 8).is_err());
        t.hold_cached(1, 7).unwrap();
        let c = t.change(1, 40, Delta::Inc).unwrap();
        assert!(matches!(c, Changed::Locked(_)));
        assert_eq!(t.state(1).unwrap(), PageState::Locked { rc: 2, desc: 40 });
        assert_eq!(
            t.change(1, 41, Delta::Dec(3)),
            Ok(Changed::Busy(40)),
            "a locked stripe waits"
        );
        assert_eq!(t.stripe_holder(0), Some(40));
        assert!(!t.unlock(1, 41), "only the locker unlocks");
        t.done(1, c);
        assert_eq!(t.stripe_holder(0), None);
        assert_eq!(t.state(1).unwrap(), PageState::Held(2));
        assert!(!t.unlock(1, 40), "unlock is idempotent");
        let c = t.change(1, 41, Delta::Dec(3)).unwrap();
        assert!(matches!(c, Changed::Locked(_)));
        t.done(1, c);
        assert_eq!(t.change(1, 42, Delta::Dec(3)), Ok(Changed::Last));
        t.done(1, Changed::Last);
        assert_eq!(t.state(1).unwrap(), PageState::Cached(3));
        assert!(
            t.change(1, 42, Delta::Dec(3)).is_err(),
            "double drop is detected"
        );
        assert_eq!(t.stripe_holder(0), None, "an error releases the stripe");
        assert_eq!(t.change(1, 42, Delta::TryInc), Ok(Changed::NotHeld));
        assert_eq!(t.stripe_holder(0), None);
        t.release_cached(1, 3).unwrap();
        assert_eq!(t.state(1).unwrap(), PageState::Free);
        assert!(t.state(99).is_err());
    }

    #[test]
    fn claim_run_finds_consecutive_free_pages_or_claims_nothing() {
        let (w, st) = table(12);
        let t = PageTable::new(&w, &st);
        let c = AtomicU64::new(0);
        // Pages 2 and 7 taken: the first run of four is 3..7.
        assert!(t.try_claim(2, 9) && t.try_claim(7, 9));
        assert_eq!(t.claim_run(&c, 1, 4, 100), Some(3));
        assert_eq!(c.load(Ordering::Relaxed), 7);
        for p in 3..7 {
            assert_eq!(t.state(p).unwrap(), PageState::Cached(1));
        }
        // 8..12 is the only run of four left. None of five, and a budget
        // too short to reach it finds nothing either.
        assert_eq!(t.claim_run(&c, 1, 5, 100), None);
        c.store(0, Ordering::Relaxed);
        assert_eq!(t.claim_run(&c, 1, 4, 6), None);
        assert_eq!(t.claim_run(&c, 1, 4, 100), Some(8));
        assert_eq!(t.claim_run(&c, 1, 1, 100), Some(0));
        assert_eq!(t.state(1).unwrap(), PageState::Free);
    }

    #[test]
    fn claim_batch_is_contiguous_and_exhausts_cleanly() {
        let (w, st) = table(10);
        let t = PageTable::new(&w, &st);
        let c = AtomicU64::new(0);
        let mut out = Vec::new();
        assert_eq!(t.claim_batch(&c, 1, 4, &mut out), 4);
        assert_eq!(out, vec![0, 1, 2, 3]);
        assert_eq!(t.claim_batch(&c, 1, 100, &mut out), 6);
        assert_eq!(t.claim_batch(&c, 1, 1, &mut out), 0);
        assert_eq!(t.claim_one(&c, 1), None);
        t.release_cached(5, 1).unwrap();
        assert_eq!(t.claim_batch(&c, 2, 3, &mut out), 1);
        assert_eq!(*out.last().unwrap(), 5);
    }
}

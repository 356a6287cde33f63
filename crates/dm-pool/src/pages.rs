//! Where pages are counted: the page table and the free-page structure.
//!
//! Every data page of the pool has one 64-bit word in the pool's page table.
//! The word says, in one atomic value, which of three states the page is in
//! and, where it matters, who owns it:
//!
//! | state    | meaning                                               | fields          |
//! |----------|-------------------------------------------------------|-----------------|
//! | `Free`   | in the shared free set, contents all zero             | word == 0       |
//! | `Cached` | claimed by one slot (its local FIFO, or being filled) | owner slot      |
//! | `Held`   | reachable from descriptors (buffers, Refs, lists)     | refcount > 0    |
//!
//! Because the owner of a cached page is recorded in the same word that a
//! claim changes, a process killed between any two instructions never loses
//! a page: whatever it had claimed is `Cached(its slot)` and is swept back
//! when its lease expires. The free set is therefore the page table itself
//! read as a bitmap, and claiming is a CAS `Free -> Cached(slot)` on each
//! page — lock-free, with a shared cursor that spreads processes over the
//! table and makes consecutive claims contiguous runs (one `mmap` per run for
//! mapped buffers). Processes claim in batches into a private FIFO and give
//! back surplus, so the per-allocation fast path touches no shared line
//! beyond the page's own word (DmRPC-CXL's page-ownership coordinator).
//!
//! Reference counts follow the copy-on-write rule of DESIGN.md section 3: a
//! holder that writes a page whose count is above one copies it first; the
//! last holder to drop a page turns it into `Cached(itself)`, zeroes it and
//! reuses or returns it, so recycled pages are always zero.

use crate::sync::{AtomicU64, Ordering};

/// Marks "no page" in page lists (an unbacked page reads as zero).
pub const NO_PAGE: u32 = u32::MAX;

const RC_MASK: u64 = 0xFFFF_FFFF;
const OWNER_SHIFT: u32 = 32;
const OWNER_MASK: u64 = 0xFFFF << OWNER_SHIFT;
const STATE_SHIFT: u32 = 48;
const ST_CACHED: u64 = 1;
const ST_HELD: u64 = 2;

/// Decoded state of one page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageState {
    /// In the free set (zeroed).
    Free,
    /// Claimed by the slot with this index.
    Cached(u16),
    /// Held by this many holders.
    Held(u32),
    /// A word no correct writer produces.
    Invalid(u64),
}

impl PageState {
    /// Decodes a page-table word.
    pub fn decode(w: u64) -> Self {
        match w >> STATE_SHIFT {
            0 if w == 0 => PageState::Free,
            ST_CACHED if w & RC_MASK == 0 => {
                PageState::Cached(((w & OWNER_MASK) >> OWNER_SHIFT) as u16)
            }
            ST_HELD if w & OWNER_MASK == 0 && w & RC_MASK > 0 => {
                PageState::Held((w & RC_MASK) as u32)
            }
            _ => PageState::Invalid(w),
        }
    }

    /// Encodes a state as a page-table word.
    pub fn encode(self) -> u64 {
        match self {
            PageState::Free => 0,
            PageState::Cached(s) => (ST_CACHED << STATE_SHIFT) | ((s as u64) << OWNER_SHIFT),
            PageState::Held(rc) => (ST_HELD << STATE_SHIFT) | rc as u64,
            PageState::Invalid(w) => w,
        }
    }
}

/// Outcome of dropping one share of a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unshared {
    /// Other holders remain.
    Shared,
    /// This was the last share: the page is now `Cached(slot)` of the caller,
    /// which must zero it before reusing or freeing it.
    Last,
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

/// The page table: a view of `n` atomic words in the pool.
#[derive(Debug, Clone, Copy)]
pub struct PageTable<'a> {
    words: &'a [AtomicU64],
}

impl<'a> PageTable<'a> {
    /// Wraps the page-table words.
    pub fn new(words: &'a [AtomicU64]) -> Self {
        Self { words }
    }

    /// Number of pages.
    pub fn len(&self) -> usize {
        self.words.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
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
        match self.state(page) {
            Ok(PageState::Held(rc)) => rc,
            _ => 0,
        }
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

    /// `Cached(slot) -> Free`. The caller must have zeroed the page.
    pub fn release_cached(&self, page: u32, slot: u16) -> Result<(), PageError> {
        self.transition(
            page,
            PageState::Cached(slot),
            PageState::Free,
            "cached by this slot",
        )
    }

    /// `Cached(slot) -> Held(1)`: a page from the slot's FIFO becomes held by
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

    /// Adds a share to a page that is held and stays held for the duration
    /// (the caller itself holds a share, or holds the descriptor that does).
    pub fn share(&self, page: u32) -> Result<(), PageError> {
        if self.try_share(page)? {
            Ok(())
        } else {
            Err(PageError {
                page,
                found: self.state(page)?,
                expected: "held",
            })
        }
    }

    /// Adds a share if the page is held (count above zero); false otherwise.
    /// Used where the page may be dropped concurrently (mapping a Ref that is
    /// being released): the caller validates afterwards and undoes on failure.
    pub fn try_share(&self, page: u32) -> Result<bool, PageError> {
        let w = self.word(page)?;
        let mut cur = w.load(Ordering::Acquire);
        loop {
            match PageState::decode(cur) {
                PageState::Held(rc) if rc < u32::MAX - 1 => {
                    match w.compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
                    {
                        Ok(_) => return Ok(true),
                        Err(c) => cur = c,
                    }
                }
                PageState::Held(_) => {
                    return Err(PageError {
                        page,
                        found: PageState::decode(cur),
                        expected: "a reference count below 2^32-1",
                    })
                }
                _ => return Ok(false),
            }
        }
    }

    /// Drops one share. The last share turns the page into `Cached(slot)`.
    pub fn unshare(&self, page: u32, slot: u16) -> Result<Unshared, PageError> {
        let w = self.word(page)?;
        let mut cur = w.load(Ordering::Acquire);
        loop {
            let (next, out) = match PageState::decode(cur) {
                PageState::Held(1) => (PageState::Cached(slot).encode(), Unshared::Last),
                PageState::Held(_) => (cur - 1, Unshared::Shared),
                found => {
                    return Err(PageError {
                        page,
                        found,
                        expected: "held",
                    })
                }
            };
            match w.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(out),
                Err(c) => cur = c,
            }
        }
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

    fn table(n: usize) -> Vec<AtomicU64> {
        (0..n).map(|_| AtomicU64::new(0)).collect()
    }

    #[test]
    fn encode_decode_roundtrip() {
        for s in [
            PageState::Free,
            PageState::Cached(0),
            PageState::Cached(65535),
            PageState::Held(1),
            PageState::Held(u32::MAX),
        ] {
            assert_eq!(PageState::decode(s.encode()), s);
        }
        assert!(matches!(PageState::decode(3 << 48), PageState::Invalid(_)));
        assert!(matches!(
            PageState::decode(ST_HELD << 48),
            PageState::Invalid(_)
        ));
    }

    #[test]
    fn lifecycle() {
        let w = table(4);
        let t = PageTable::new(&w);
        assert!(t.try_claim(1, 7));
        assert!(!t.try_claim(1, 8));
        assert_eq!(t.state(1).unwrap(), PageState::Cached(7));
        assert!(t.hold_cached(1, 8).is_err());
        t.hold_cached(1, 7).unwrap();
        t.share(1).unwrap();
        assert_eq!(t.rc(1), 2);
        assert_eq!(t.unshare(1, 7).unwrap(), Unshared::Shared);
        assert_eq!(t.unshare(1, 3).unwrap(), Unshared::Last);
        assert_eq!(t.state(1).unwrap(), PageState::Cached(3));
        assert!(t.unshare(1, 3).is_err(), "double drop is detected");
        t.release_cached(1, 3).unwrap();
        assert_eq!(t.state(1).unwrap(), PageState::Free);
        assert!(!t.try_share(1).unwrap());
        assert!(t.state(99).is_err());
    }

    #[test]
    fn claim_batch_is_contiguous_and_exhausts_cleanly() {
        let w = table(10);
        let t = PageTable::new(&w);
        let c = AtomicU64::new(0);
        let mut out = Vec::new();
        assert_eq!(t.claim_batch(&c, 1, 4, &mut out), 4);
        assert_eq!(out, vec![0, 1, 2, 3]);
        assert_eq!(t.claim_batch(&c, 1, 100, &mut out), 6);
        assert_eq!(t.claim_batch(&c, 1, 1, &mut out), 0);
        t.release_cached(5, 1).unwrap();
        assert_eq!(t.claim_batch(&c, 2, 3, &mut out), 1);
        assert_eq!(*out.last().unwrap(), 5);
    }
}

//! Descriptors: the pool-resident records of buffers and Refs.
//!
//! A descriptor owns a list of page indices (its *entries*): a buffer's pages,
//! or a Ref's frozen snapshot. Each non-`NO_PAGE` entry is one share of that
//! page (held by its list page, for entries in one: see *Shared lists*),
//! except entries flagged `BORROWED`: a buffer mapped from a Ref
//! borrows the Ref's pages and holds the Ref itself by one count on its
//! mapper word (see [`mappers`]); writing such a page copies it first.
//!
//! Short lists live inline in the descriptor. Longer ones live in *list
//! pages* (pool pages, counted once by each descriptor naming them), in one of two
//! shapes:
//! - one level (`FLAG_INDIRECT`): the inline entries name list pages of
//!   data entries, up to `INLINE * per` entries (`per` = page size / 4:
//!   184 MiB of 4 KiB pages);
//! - two levels (`FLAG_INDIRECT | FLAG_TWO_LEVEL`): the inline entries
//!   name second-level list pages, whose entries name the list pages of
//!   data entries, up to `INLINE * per * per` entries (184 GiB of 4 KiB
//!   pages; the pool's size bounds it first).
//!
//! A descriptor's list pages, in the order a drop releases them, are its
//! *list slots*: the first-level lists (slot `j` is list `j` of data
//! entries), then, with two levels, the inline entries at `INLINE * per`
//! onwards. A list page is dropped only after every page it names.
//!
//! **Shared lists** (pool format 9). A first-level list page holds the
//! shares of the data pages it names, one each, however many descriptors
//! name it. Its own count is the number of descriptors naming it. A Ref
//! of a whole buffer names the buffer's first-level lists and takes one
//! count on each ([`Pool::create_ref`](crate::Pool::create_ref)): sharing
//! costs one count change per list (1024 pages of 4 KiB), not one per
//! page. Second-level lists and inline entries are never shared.
//!
//! A buffer about to write through a shared list first gives itself a
//! copy of it, recorded in the CoW journal as `LIST_JOURNAL | j`:
//! 1. the copy is taken (cached by the writer) and filled; `journal_old`
//!    names the old list, the journal says `LIST_JOURNAL | j`, then slot
//!    `j` names the copy;
//! 2. a count is taken on each page the copy names (`progress`), then the
//!    copy becomes held;
//! 3. under the old list's stripe lock, the buffer's count on it drops
//!    (the page locked to the buffer) and the journal says
//!    `LIST_DROPPED`. If the buffer held it alone by then, the count
//!    reaches zero and the journal says `LIST_DRAIN`: the old list's
//!    pages lose its counts (`progress`, from zero), then it is freed;
//! 4. the journal is cleared.
//!
//! The copy counts its pages before the old list is let go: a holder
//! that then finds itself alone drops the old list's counts, and the
//! pages stay held by the copy. A reclaimer drives each step forward
//! (`reclaim.rs`, `finish_list_copy`).
//!
//! A drop meets each first-level list at the first entry it covers. It
//! decides under the list's stripe lock:
//! - a list others hold too loses this descriptor's count (the page
//!   locked to it), the slot is cleared, and `progress` skips the list's
//!   entries;
//! - a list this descriptor holds alone has its entries dropped one by
//!   one, then itself, as before.
//!
//! Only a holder makes another holder, so "alone" stays true until the
//! drop ends, and a reclaimer finds the same answer again. A count
//! dropped and not recorded is the list page locked to the descriptor.
//!
//! A Ref of shared lists is built with `FLAG_LIST_BUILD`: its `held`
//! counts first-level list slots holding a count, not data entries. Once
//! all are counted, `held` becomes `n_pages` and the flag goes: both
//! readings then say every list is held.
//!
//! The state word packs `generation (32) | kind (8) | owner slot (16)`.
//! Changing it is the commit point of every multi-step operation, and each
//! kind says exactly which entries hold shares, so a reclaimer can finish or
//! undo the work of a process killed at any instruction:
//!
//! | kind        | owner      | entries holding a share                        |
//! |-------------|------------|------------------------------------------------|
//! | `Free`      | -          | none                                           |
//! | `Buf`       | user slot  | every entry not flagged `BORROWED` (see CoW journal) |
//! | `MapBuild`  | user slot  | none: a mapped buffer borrows its Ref's pages   |
//! | `RefBuild`  | user slot  | `[0, held)` (building a Ref from a buffer; list slots with `FLAG_LIST_BUILD`) |
//! | `RefLive`   | none       | all                                            |
//! | `Drop`      | dropper    | `[progress, held)`, then list slots `k` with `held + k >= progress` |
//!
//! Shares are taken and dropped in entry order under the page lock of
//! `pages.rs`: each page's count changes in the same CAS that locks it to
//! this descriptor; every 64 pages (and at the end) the counter (`held` or
//! `progress`) is stored, then those pages are unlocked. The pages between
//! the stored counter and the first untouched entry are exactly those
//! locked by this descriptor (or, for drops, turned `Cached` by its owner),
//! so a reclaimer of a dead owner can walk forward from the counter and
//! finish the record: every share is accounted exactly once, whatever
//! instruction the owner died at (see `reclaim.rs`).
//!
//! A buffer whose entries are all its own shares (not mapped from a Ref,
//! no copy-on-write under way) can become a Ref in place
//! ([`Pool::into_ref`](crate::Pool::into_ref)): its owner writes the
//! Ref's fields (`tag`, `expiry_ms`, `held = n_pages`, `aux = IS_REF`),
//! then one CAS of the state word turns `Buf` into `RefLive`. Every entry
//! holds a share under both kinds, so no page count changes. A reclaimer
//! that takes the buffer first (its owner died before the CAS) drops it
//! as a buffer: an `aux` of `IS_REF` is not 1, so no mapping is undone.
//!
//! Entries `[0, n_pages)` are page words (a page or `NO_PAGE`) whenever a
//! reclaimer can look: a `RefBuild`'s list pages come with their old
//! bytes, so its `n_pages` is stored only after its entries are copied
//! (until then a reclaimer walks none of them).

use crate::sync::{AtomicU32, AtomicU64};

/// Inline entries per descriptor.
pub const INLINE: usize = 46;

/// Flag: entries name list pages, not data pages.
pub const FLAG_INDIRECT: u32 = 1;
/// Flag (with `FLAG_INDIRECT`): the inline entries name second-level
/// list pages, whose entries name the lists of data entries.
pub const FLAG_TWO_LEVEL: u32 = 4;
/// Flag: a buffer mapped from a Ref with no entries of its own yet: entry
/// `k` reads as the Ref's entry `k`, borrowed (the Ref's index is in `tag`).
/// Its first write materialises the list.
pub const FLAG_INHERIT: u32 = 2;
/// Flag on a `RefBuild`: `held` counts first-level list slots holding a
/// count (a Ref sharing its buffer's lists), not data entries.
pub const FLAG_LIST_BUILD: u32 = 8;
/// A CoW journal (`journal_idx`) replacing shared first-level list `j`
/// (`LIST_JOURNAL | j`), not data entry `j`: data entries are below
/// [`MAX_PAGES`](crate::pages::MAX_PAGES), under this bit.
pub const LIST_JOURNAL: u32 = 1 << 31;
/// With [`LIST_JOURNAL`]: the old list's count is dropped.
pub const LIST_DROPPED: u32 = 1 << 30;
/// With [`LIST_JOURNAL`]: the old list's count dropped to zero (this
/// buffer held it alone by then); its pages' counts are being dropped.
pub const LIST_DRAIN: u32 = 1 << 29;
/// The list index `j` of a [`LIST_JOURNAL`] (lists number below 2^21).
pub const LIST_INDEX: u32 = (1 << 29) - 1;
/// End reason stored in `flags` bits 8..16 when a Ref ends.
pub const END_RELEASED: u32 = 1;
/// The Ref expired (TTL) and was reclaimed.
pub const END_EXPIRED: u32 = 2;
/// The Ref's creator died before it was complete.
pub const END_ABORTED: u32 = 3;

/// Descriptor kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Unused.
    Free = 0,
    /// A live buffer owned by a slot.
    Buf = 1,
    /// Being dropped by its owner.
    Drop = 2,
    /// A buffer being built from a Ref.
    MapBuild = 3,
    /// A Ref being built.
    RefBuild = 4,
    /// A live Ref.
    RefLive = 5,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            0 => Kind::Free,
            1 => Kind::Buf,
            2 => Kind::Drop,
            3 => Kind::MapBuild,
            4 => Kind::RefBuild,
            5 => Kind::RefLive,
            _ => return None,
        })
    }
}

/// Decoded descriptor state word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DescState {
    /// Generation: bumped each time the descriptor is taken from `Free`.
    pub generation: u32,
    /// Kind (`None` for a value no writer produces).
    pub kind: Option<Kind>,
    /// Owner slot for owned kinds.
    pub owner: u16,
}

impl DescState {
    /// Decodes.
    pub fn decode(w: u64) -> Self {
        DescState {
            generation: w as u32,
            kind: Kind::from_u8((w >> 32) as u8),
            owner: (w >> 40) as u16,
        }
    }

    /// Encodes.
    pub fn encode(generation: u32, kind: Kind, owner: u16) -> u64 {
        generation as u64 | ((kind as u64) << 32) | ((owner as u64) << 40)
    }
}

/// A descriptor as laid out in the pool (256 bytes).
#[repr(C)]
#[derive(Debug)]
pub struct Desc {
    /// `generation | kind | owner` (see [`DescState`]).
    pub state: AtomicU64,
    /// Random tag of a Ref.
    pub tag: AtomicU64,
    /// Length in bytes.
    pub len: AtomicU64,
    /// Ref expiry, ms on the pool's Ref clock ([`RefClock`](crate::RefClock):
    /// the owning host's monotonic clock, or the wall clock).
    pub expiry_ms: AtomicU64,
    /// Byte offset of the content in the first page.
    pub offset: AtomicU32,
    /// Number of page entries.
    pub n_pages: AtomicU32,
    /// Building: entries `[0, held)` hold shares. Dropping: upper bound.
    pub held: AtomicU32,
    /// Dropping: entries below `progress` are done.
    pub progress: AtomicU32,
    /// CoW journal: entry index being replaced, or `NO_PAGE`.
    pub journal_idx: AtomicU32,
    /// CoW journal: the page being replaced.
    pub journal_old: AtomicU32,
    /// `FLAG_INDIRECT`, `FLAG_TWO_LEVEL`, `FLAG_INHERIT` and the end reason.
    pub flags: AtomicU32,
    /// Serialises the fault handler against other threads of the owner.
    pub lock: AtomicU32,
    /// A Ref: its mapper word (see `refs_aux`). A buffer mapped from a Ref:
    /// 1 once linked to it (the Ref's index is in `tag`), else 0.
    pub aux: AtomicU64,
    /// Inline entries: data pages, or list pages if `FLAG_INDIRECT`
    /// (second-level ones if `FLAG_TWO_LEVEL`).
    pub entries: [AtomicU32; INLINE],
}

impl Desc {
    /// Resets the fields to the `Free` invariants (no entries, no lists,
    /// empty journal). Called before the state word says `Free`.
    pub(crate) fn reset(&self) {
        use crate::sync::Ordering;
        for e in &self.entries {
            e.store(crate::pages::NO_PAGE, Ordering::Relaxed);
        }
        self.n_pages.store(0, Ordering::Relaxed);
        self.held.store(0, Ordering::Relaxed);
        self.progress.store(0, Ordering::Relaxed);
        self.len.store(0, Ordering::Relaxed);
        self.offset.store(0, Ordering::Relaxed);
        self.journal_idx
            .store(crate::pages::NO_PAGE, Ordering::Relaxed);
        self.journal_old
            .store(crate::pages::NO_PAGE, Ordering::Relaxed);
        self.lock.store(0, Ordering::Relaxed);
        self.aux.store(0, Ordering::Relaxed);
        let end = self.flags.load(Ordering::Relaxed) & 0xFF00;
        self.flags.store(end, Ordering::Release);
    }
}

/// Size of a descriptor in the pool.
pub const DESC_SIZE: usize = 256;

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Desc>() == DESC_SIZE);

/// The mapper word of a Ref (`Desc::aux`): how many buffers are mapped from
/// it, whether it was released, and who drops it — one word, so that
/// release, map (link) and unmap (unlink) race only through CASes on it.
///
/// `count (32) | id (29) << 32 | LOCK (61) | RELEASED (62) | DROPPING (63)`,
/// plus `IS_REF` (bit 60) on every Ref's word. With `LOCK`, `id` is the
/// descriptor linking or unlinking (its own record follows, then unlock);
/// with `DROPPING`, `id` is the slot dropping the Ref's pages.
pub mod mappers {
    use crate::sync::{AtomicU64, Ordering};

    /// Marks a Ref's word (a buffer's `aux` never has it).
    pub const IS_REF: u64 = 1 << 60;
    const LOCK: u64 = 1 << 61;
    const RELEASED: u64 = 1 << 62;
    const DROPPING: u64 = 1 << 63;
    const ID_SHIFT: u32 = 32;
    const ID_MASK: u64 = ((1 << 28) - 1) << ID_SHIFT;
    const COUNT: u64 = 0xFFFF_FFFF;

    /// Outcome of [`link`] and [`unlink`].
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Step {
        /// Done; the word is locked by the caller: record, then [`unlock`].
        Locked(u64),
        /// Unlinked the last mapper of a released Ref: the caller's slot is
        /// now its dropper (record, then drop the Ref). Not locked.
        Drop,
        /// The Ref is released or being dropped: no new mappers.
        Closed,
        /// Locked by descriptor `.0`: wait and retry.
        Busy(u32),
        /// Not a Ref's word.
        NotARef,
    }

    /// Outcome of [`release`].
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Release {
        /// No mappers: the caller's slot now drops the Ref.
        Drop,
        /// Mapped: the last mapper to unmap drops it.
        Kept,
        /// Released before.
        Already,
        /// Locked by descriptor `.0`: wait and retry.
        Busy(u32),
    }

    fn id(w: u64) -> u32 {
        ((w & ID_MASK) >> ID_SHIFT) as u32
    }

    /// Mappers of a Ref word.
    pub fn count(w: u64) -> u32 {
        (w & COUNT) as u32
    }

    /// Whether the Ref was released.
    pub fn released(w: u64) -> bool {
        w & RELEASED != 0
    }

    /// The descriptor holding the lock, if locked.
    pub fn locker(w: u64) -> Option<u32> {
        (w & LOCK != 0).then(|| id(w))
    }

    /// The slot dropping the Ref, if any.
    pub fn dropper(w: u64) -> Option<u16> {
        (w & DROPPING != 0).then(|| id(w) as u16)
    }

    fn step(a: &AtomicU64, f: impl Fn(u64) -> Result<u64, Step>) -> Step {
        let mut cur = a.load(Ordering::Acquire);
        loop {
            if cur & IS_REF == 0 {
                return Step::NotARef;
            }
            if cur & LOCK != 0 {
                return Step::Busy(id(cur));
            }
            let next = match f(cur) {
                Ok(n) => n,
                Err(s) => return s,
            };
            match a.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) if next & DROPPING != 0 => return Step::Drop,
                Ok(_) => return Step::Locked(next),
                Err(c) => cur = c,
            }
        }
    }

    /// Adds mapper `desc` (refused once released or dropping).
    pub fn link(a: &AtomicU64, desc: u32) -> Step {
        step(a, |w| {
            if w & (RELEASED | DROPPING) != 0 || count(w) == u32::MAX {
                return Err(Step::Closed);
            }
            Ok((w + 1) | LOCK | (((desc as u64) << ID_SHIFT) & ID_MASK))
        })
    }

    /// Removes mapper `desc`; the last one out of a released Ref becomes its
    /// dropper (`slot`).
    pub fn unlink(a: &AtomicU64, desc: u32, slot: u16) -> Step {
        step(a, |w| {
            if w & DROPPING != 0 || count(w) == 0 {
                return Err(Step::Closed);
            }
            if count(w) == 1 && w & RELEASED != 0 {
                return Ok(IS_REF | RELEASED | DROPPING | ((slot as u64) << ID_SHIFT));
            }
            Ok((w - 1) | LOCK | (((desc as u64) << ID_SHIFT) & ID_MASK))
        })
    }

    /// Unlocks a word the caller locked (`w` from [`link`] or [`unlink`]).
    pub fn unlock(a: &AtomicU64, w: u64) {
        a.store(w & !(LOCK | ID_MASK), Ordering::Release);
    }

    /// Unlocks if `desc` holds the lock (crash recovery). Idempotent.
    pub fn unlock_if(a: &AtomicU64, desc: u32) -> bool {
        let w = a.load(Ordering::Acquire);
        locker(w) == Some(desc)
            && a.compare_exchange(
                w,
                w & !(LOCK | ID_MASK),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
    }

    /// Makes `slot` the dropper of a Ref whose dropper was `dead`. Returns
    /// whether it did.
    pub fn adopt(a: &AtomicU64, dead: u16, slot: u16) -> bool {
        let w = a.load(Ordering::Acquire);
        dropper(w) == Some(dead)
            && a.compare_exchange(
                w,
                (w & !ID_MASK) | ((slot as u64) << ID_SHIFT),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
    }

    /// Releases the Ref: with no mappers `slot` becomes its dropper.
    pub fn release(a: &AtomicU64, slot: u16) -> Release {
        let mut cur = a.load(Ordering::Acquire);
        loop {
            if cur & IS_REF == 0 || cur & (RELEASED | DROPPING) != 0 {
                return Release::Already;
            }
            if cur & LOCK != 0 {
                return Release::Busy(id(cur));
            }
            let (next, out) = if count(cur) == 0 {
                (
                    IS_REF | RELEASED | DROPPING | ((slot as u64) << ID_SHIFT),
                    Release::Drop,
                )
            } else {
                (cur | RELEASED, Release::Kept)
            };
            match a.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return out,
                Err(c) => cur = c,
            }
        }
    }

    #[cfg(all(test, not(loom)))]
    mod tests {
        use super::*;

        #[test]
        fn protocol() {
            let a = AtomicU64::new(0);
            assert_eq!(link(&a, 3), Step::NotARef, "a buffer's aux is never linked");
            a.store(IS_REF, Ordering::Relaxed);
            let Step::Locked(w) = link(&a, 3) else {
                panic!()
            };
            assert_eq!(link(&a, 4), Step::Busy(3));
            assert_eq!(release(&a, 1), Release::Busy(3));
            unlock(&a, w);
            assert_eq!(count(a.load(Ordering::Relaxed)), 1);
            assert_eq!(release(&a, 1), Release::Kept);
            assert_eq!(release(&a, 1), Release::Already);
            assert_eq!(link(&a, 5), Step::Closed, "no new mappers after release");
            assert_eq!(unlink(&a, 3, 7), Step::Drop, "the last mapper out drops");
            assert_eq!(dropper(a.load(Ordering::Relaxed)), Some(7));
            let b = AtomicU64::new(IS_REF);
            assert_eq!(release(&b, 2), Release::Drop);
            assert!(!unlock_if(&b, 9));
        }
    }
}

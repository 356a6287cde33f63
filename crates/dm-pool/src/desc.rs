//! Descriptors: the pool-resident records of buffers and Refs.
//!
//! A descriptor owns a list of page indices (its *entries*): a buffer's pages,
//! or a Ref's frozen snapshot. Each non-`NO_PAGE` entry is one share of that
//! page. Short lists live inline in the descriptor; longer ones in *list
//! pages* (pool pages, each held once by the descriptor) named inline.
//!
//! The state word packs `generation (32) | kind (8) | owner slot (16)`.
//! Changing it is the commit point of every multi-step operation, and each
//! kind says exactly which entries hold shares, so a reclaimer can finish or
//! undo the work of a process killed at any instruction:
//!
//! | kind        | owner      | entries holding a share                        |
//! |-------------|------------|------------------------------------------------|
//! | `Free`      | -          | none                                           |
//! | `Buf`       | user slot  | every entry that is `Held` (see CoW journal)   |
//! | `MapBuild`  | user slot  | `[0, held)` (building a buffer from a Ref)      |
//! | `RefBuild`  | user slot  | `[0, held)` (building a Ref from a buffer)      |
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

use crate::sync::{AtomicU32, AtomicU64};

/// Inline entries per descriptor.
pub const INLINE: usize = 48;

/// Flag: entries name list pages, not data pages.
pub const FLAG_INDIRECT: u32 = 1;
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
    /// Ref expiry, ms since the epoch.
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
    /// `FLAG_INDIRECT` and the end reason.
    pub flags: AtomicU32,
    /// Serialises the fault handler against other threads of the owner.
    pub lock: AtomicU32,
    /// Inline entries: data pages, or list pages if `FLAG_INDIRECT`.
    pub entries: [AtomicU32; INLINE],
}

/// Size of a descriptor in the pool.
pub const DESC_SIZE: usize = 256;

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Desc>() == DESC_SIZE);

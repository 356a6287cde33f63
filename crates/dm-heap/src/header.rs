//! The format of a heap's first page: its header, which every process
//! that opens the heap shares. It depends on nothing above it.
//!
//! | bytes | field |
//! |-------|-------|
//! | 8 | magic `DMHEAP\0\x01` |
//! | 4 | version ([`HEAP_VERSION`]) |
//! | 4 | zero |
//! | 8 | the address it sits at |
//! | 8 | its length in bytes |
//! | 8 | the lock (`lock.rs`) |
//! | 8 | the bump: the offset where unused memory starts |
//! | 8 | the root: the offset of the value set as root, or 0 |
//! | 8 | bytes in blocks handed out and not given back |
//! | 8 × 37 | the free lists' heads, one per size class |
//! | 32 × 64 | the seal records: id, offset, length, sealer (`seal.rs`) |
//!
//! Every field is atomic: any process of the heap may change any of them
//! at any time, and every reader checks what it reads before it uses it.

use std::sync::atomic::AtomicU64;

/// The version of the heap header's layout (the table above).
pub const HEAP_VERSION: u32 = 1;

/// The header's first word.
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"DMHEAP\0\x01");

/// The bytes the header takes; memory handed out starts after it.
pub(crate) const HEADER_LEN: u64 = 4096;

/// The number of the allocator's size classes: 16 bytes to
/// 16 << (CLASSES - 1) (`alloc.rs`).
pub(crate) const CLASSES: usize = 37;

/// Seal records in a heap's header (`seal.rs`).
pub(crate) const SEALS: usize = 64;

/// The header at a heap's first byte (see the module docs).
#[repr(C)]
#[derive(Debug)]
pub(crate) struct Header {
    pub(crate) magic: AtomicU64,
    pub(crate) version: AtomicU64,
    pub(crate) addr: AtomicU64,
    pub(crate) len: AtomicU64,
    pub(crate) lock: AtomicU64,
    pub(crate) bump: AtomicU64,
    pub(crate) root: AtomicU64,
    pub(crate) in_use: AtomicU64,
    pub(crate) free: [AtomicU64; CLASSES],
    pub(crate) seals: [SealRecord; SEALS],
}

const _: () = assert!(std::mem::size_of::<Header>() as u64 <= HEADER_LEN);

/// A seal record. `id` 0 is a free record; [`CLAIMED`] is one being
/// written.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct SealRecord {
    pub(crate) id: AtomicU64,
    /// Offset of the first page in the heap.
    pub(crate) off: AtomicU64,
    /// Bytes (whole pages).
    pub(crate) len: AtomicU64,
    /// The sealer's attachment to the pool.
    pub(crate) sealer: AtomicU64,
}

/// The id of a seal record being written.
pub(crate) const CLAIMED: u64 = u64::MAX;

/// The length of a heap's reference as it travels
/// (`HeapRef::to_bytes`): a pool Ref, the address and the length.
pub const HEAP_REF_LEN: usize = dm_pool::Ref::SIZE + 16;

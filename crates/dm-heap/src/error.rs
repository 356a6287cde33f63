//! The errors of heaps.

use crate::header::HEAP_REF_LEN;

/// Why a heap cannot be made, opened or used as asked.
#[derive(Debug, thiserror::Error)]
pub enum HeapError {
    /// The pool refused (no room, a quota, a Ref expired or forged), or
    /// the heap's address range is in use in this process
    /// (`SysError::AddressInUse`).
    #[error(transparent)]
    Pool(#[from] dm_pool::Error),
    /// What should be a heap's header is not one, or does not match the
    /// `HeapRef` it was opened by.
    #[error("not a heap (or not the one its reference names): {0}")]
    NotAHeap(String),
    /// Too small to hold its header and anything else, or larger than
    /// the range heaps are placed in.
    #[error("a heap of {0} bytes cannot be made (at least 8 KiB, at most 1 TiB)")]
    BadSize(u64),
    /// No free range found for it in this process.
    #[error("no free address range of {0} bytes for a heap in this process")]
    NoAddress(u64),
    /// A heap encoding of the wrong length.
    #[error("a heap reference is {HEAP_REF_LEN} bytes, not {0}")]
    BadRef(usize),
    /// The heap has no room for the value.
    #[error("the heap is full: no block of {0} bytes is free")]
    Full(u64),
    /// Alignment above a page's, which the heap does not give.
    #[error("an alignment of {0} bytes is more than a heap gives (4096)")]
    TooAligned(usize),
    /// The allocator found what another process wrote in the heap's
    /// bookkeeping out of bounds: nothing was taken from it.
    #[error("the heap's bookkeeping is corrupt: {0}")]
    Corrupt(&'static str),
    /// A pointer that is not into this heap (or not to a block of it).
    #[error("{0:#x} is not a block of this heap")]
    Foreign(u64),
    /// An argument that should be sealed is not (why).
    #[error("not sealed: {0}")]
    NotSealed(&'static str),
    /// Bytes that are not a heap argument, or one that names a value the
    /// receiver cannot take (why).
    #[error("bad heap argument: {0}")]
    BadArg(&'static str),
    /// An archive that validation refused (what it found).
    #[error("an archive is not valid: {0}")]
    Invalid(String),
    /// A call on a connection that attached no heap, to a service with
    /// no shared heap (`channel.rs`).
    #[error("the connection has no heap: attach one first (HeapChannel does)")]
    NoHeap,
}

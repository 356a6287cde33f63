//! The allocator inside a heap, shared by every process that opens it.
//!
//! Blocks come in power-of-two size classes from 16 bytes up; a block of
//! a class is aligned to its size, up to a page. A request takes the
//! class of its size and alignment (whichever is larger). Each class has
//! a free list, linked through the first word of its free blocks (the
//! next block's offset, 0 at the end); a class whose list is empty takes
//! a new block from the bump, the offset where unused memory starts.
//!
//! Everything is done under the heap's lock (`lock.rs`), with stores of
//! one word at a time: taking a block is one store (the list's head, or
//! the bump), giving one back is two (its link, then the head). A process
//! killed between them leaves the heap consistent, the block lost to it
//! at worst. No block has a header: the class of a block given back comes
//! from the layout the caller gives, as `Allocator` requires.
//!
//! Every offset read from the heap is checked before it is used: inside
//! the heap, past its header, below the bump, aligned to its class.
//! Another process may have written anything there: a bad one is
//! [`HeapError::Corrupt`], and nothing is taken from it or written
//! through it. Walks are never needed (one link is read per block taken),
//! so a cycle in a list costs nothing.

use crate::error::HeapError;
use crate::header::{Header, CLASSES, HEADER_LEN};
use crate::open::open_at;
use allocator_api2::alloc::{AllocError, Allocator};
use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

const MIN_BLOCK: u64 = 16;
/// The largest alignment blocks get (and requests may ask).
const MAX_ALIGN: u64 = 4096;

/// A heap's allocator, for the collections of `allocator-api2` and
/// `hashbrown` (`HeapVec::new_in(heap.alloc())`). It is a pointer to the
/// heap's header, which sits at the same address in every process: a
/// collection built in one process is grown or freed in another that has
/// the heap open. It borrows the open [`Heap`](crate::heap::Heap): nothing
/// made with it outlives the heap's mapping in this process.
#[derive(Debug, Clone, Copy)]
pub struct HeapAlloc<'h> {
    hdr: &'h Header,
}

// SAFETY: the header is all atomics, and the heap's memory is shared on
// purpose; blocks are handed out under the heap's lock.
unsafe impl Send for HeapAlloc<'_> {}
// SAFETY: as above.
unsafe impl Sync for HeapAlloc<'_> {}

/// The class of a request, and its block size.
fn class_of(layout: Layout) -> Result<(usize, u64), HeapError> {
    if layout.align() as u64 > MAX_ALIGN {
        return Err(HeapError::TooAligned(layout.align()));
    }
    let need = (layout.size() as u64)
        .max(layout.align() as u64)
        .max(MIN_BLOCK);
    let size = need
        .checked_next_power_of_two()
        .ok_or(HeapError::Full(need))?;
    let class = (size.trailing_zeros() - MIN_BLOCK.trailing_zeros()) as usize;
    if class >= CLASSES {
        return Err(HeapError::Full(size));
    }
    Ok((class, size))
}

impl<'h> HeapAlloc<'h> {
    pub(crate) fn new(hdr: &'h Header) -> HeapAlloc<'h> {
        HeapAlloc { hdr }
    }

    fn base(&self) -> u64 {
        self.hdr as *const Header as u64
    }

    /// Whether `off` may be a block of `size` bytes: past the header, under
    /// the bump, aligned to its class.
    fn plausible(&self, off: u64, size: u64, bump: u64) -> bool {
        off >= HEADER_LEN
            && off.checked_add(size).is_some_and(|e| e <= bump)
            && off.is_multiple_of(size.min(MAX_ALIGN))
    }

    /// A block for `layout`, or why there is none (the `Allocator` trait's
    /// `allocate` says only that there is none).
    pub fn try_allocate(&self, layout: Layout) -> Result<NonNull<u8>, HeapError> {
        self.block(layout)
    }

    /// A block for `layout`.
    pub(crate) fn block(&self, layout: Layout) -> Result<NonNull<u8>, HeapError> {
        let (class, size) = class_of(layout)?;
        let h = self.hdr;
        // (The length is this process's mapping's, not the header's word.)
        let (pool, len) = open_at(self.base()).ok_or(HeapError::Foreign(self.base()))?;
        let _held = crate::lock::lock(&h.lock, Some(pool));
        let bump = h.bump.load(Ordering::Relaxed);
        if bump < HEADER_LEN || bump > len {
            return Err(HeapError::Corrupt("the bump is outside the heap"));
        }
        let head = h.free[class].load(Ordering::Relaxed);
        let off = if head != 0 {
            if !self.plausible(head, size, bump) {
                return Err(HeapError::Corrupt("a free list's head is not a block"));
            }
            // SAFETY: a checked block of the heap, at least 16 bytes,
            // 8-aligned: its first word is the link.
            let next =
                unsafe { &*((self.base() + head) as *const AtomicU64) }.load(Ordering::Relaxed);
            if next != 0 && !self.plausible(next, size, bump) {
                return Err(HeapError::Corrupt("a free block's link is not a block"));
            }
            h.free[class].store(next, Ordering::Relaxed);
            head
        } else {
            let at = bump.next_multiple_of(size.min(MAX_ALIGN));
            let end = at
                .checked_add(size)
                .filter(|&e| e <= len)
                .ok_or(HeapError::Full(size))?;
            h.bump.store(end, Ordering::Relaxed);
            at
        };
        h.in_use.fetch_add(size, Ordering::Relaxed);
        // SAFETY: off is inside the mapping (checked), so non-null.
        Ok(unsafe { NonNull::new_unchecked((self.base() + off) as *mut u8) })
    }

    /// Gives back the block at `ptr`, taken for `layout`.
    pub(crate) fn give_back(&self, ptr: NonNull<u8>, layout: Layout) -> Result<(), HeapError> {
        let (class, size) = class_of(layout)?;
        let a = ptr.as_ptr() as u64;
        let h = self.hdr;
        let off = a.checked_sub(self.base()).ok_or(HeapError::Foreign(a))?;
        let (pool, len) = open_at(self.base()).ok_or(HeapError::Foreign(a))?;
        let _held = crate::lock::lock(&h.lock, Some(pool));
        let bump = h.bump.load(Ordering::Relaxed).min(len);
        if !self.plausible(off, size, bump) {
            return Err(HeapError::Foreign(a));
        }
        // (A bad head is not linked to: the list restarts at this block.)
        let head = h.free[class].load(Ordering::Relaxed);
        let head = if head == 0 || self.plausible(head, size, bump) {
            head
        } else {
            0
        };
        // SAFETY: a checked block of the heap, given back by its holder.
        unsafe { &*(a as *const AtomicU64) }.store(head, Ordering::Relaxed);
        h.free[class].store(off, Ordering::Relaxed);
        let _ = h
            .in_use
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                Some(u.saturating_sub(size))
            });
        Ok(())
    }
}

// SAFETY: blocks are valid for their layout's size and alignment (class
// sizes are powers of two at least the larger of both, aligned to their
// size up to MAX_ALIGN, and larger alignments are refused), stay valid
// until given back, and no block is handed out twice (each is in at most
// one list, or past the bump).
unsafe impl Allocator for HeapAlloc<'_> {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        let p = self.block(layout).map_err(|_| AllocError)?;
        Ok(NonNull::slice_from_raw_parts(p, layout.size()))
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // (A pointer that is not a block of this heap is not linked: the
        // heap loses nothing of its own to a caller's mistake.)
        let _ = self.give_back(ptr, layout);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn classes_are_powers_of_two_covering_size_and_alignment() {
        let c = |s, a| class_of(Layout::from_size_align(s, a).unwrap()).unwrap();
        assert_eq!(c(1, 1), (0, 16));
        assert_eq!(c(16, 8), (0, 16));
        assert_eq!(c(17, 1), (1, 32));
        assert_eq!(c(8, 64), (2, 64));
        assert_eq!(c(4097, 8), (9, 8192));
        assert!(matches!(
            class_of(Layout::from_size_align(8, 8192).unwrap()),
            Err(HeapError::TooAligned(8192))
        ));
    }
}

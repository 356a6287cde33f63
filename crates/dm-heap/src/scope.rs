//! Scopes: regions of whole pages of a heap, each for one call's
//! argument, with an allocator of their own (an arena: nothing is given
//! back until the scope is reset). An argument built in a scope owns its
//! pages, so sealing them (`seal.rs`) seals it and nothing else.

use crate::error::HeapError;
use crate::heap::Heap;
use crate::seal::{self, Seal};
use allocator_api2::alloc::{AllocError, Allocator};
use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

/// A scope's header, at its first bytes (in the heap: the same in every
/// process).
#[repr(C)]
#[derive(Debug)]
pub(crate) struct ScopeHeader {
    /// Offset of the next free byte from the scope's start.
    bump: AtomicU64,
    /// The scope's length.
    len: AtomicU64,
}

const SCOPE_HEADER: u64 = 64;

/// A region of whole pages of a heap for one argument (see the module
/// docs).
#[derive(Debug)]
pub struct Scope<'h> {
    heap: &'h Heap,
    start: NonNull<u8>,
    len: u64,
}

// SAFETY: a scope is a block of shared memory it owns in an open heap;
// its allocator works through atomics, and sealing through the heap's
// records and this process's table (atomics too).
unsafe impl Send for Scope<'_> {}
// SAFETY: as above; `&Scope` only allocates and seals.
unsafe impl Sync for Scope<'_> {}

/// The allocator of a [`Scope`]: an arena in the scope's pages. Giving a
/// block back does nothing; [`Scope::reset`] empties the scope.
#[derive(Debug, Clone, Copy)]
pub struct ScopeAlloc<'h> {
    hdr: &'h ScopeHeader,
}

// SAFETY: the header is atomics in shared memory, as the heap's.
unsafe impl Send for ScopeAlloc<'_> {}
// SAFETY: as above.
unsafe impl Sync for ScopeAlloc<'_> {}

// SAFETY: blocks lie in the scope past its header, aligned as asked (up to
// a page), and are never handed out twice before a reset, which needs the
// scope borrowed mutably (no block made with it lives on).
unsafe impl Allocator for ScopeAlloc<'_> {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        let align = layout.align() as u64;
        if align > 4096 {
            return Err(AllocError);
        }
        let len = self.hdr.len.load(Ordering::Relaxed);
        let mut at = 0;
        self.hdr
            .bump
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                // (Checked: another process may have written the bump.)
                let a = b.max(SCOPE_HEADER).checked_next_multiple_of(align)?;
                let end = a.checked_add(layout.size() as u64).filter(|&e| e <= len)?;
                at = a;
                Some(end)
            })
            .map_err(|_| AllocError)?;
        let base = self.hdr as *const ScopeHeader as *mut u8;
        // SAFETY: at + size <= len: inside the scope.
        let p = unsafe { NonNull::new_unchecked(base.add(at as usize)) };
        Ok(NonNull::slice_from_raw_parts(p, layout.size()))
    }

    unsafe fn deallocate(&self, _ptr: NonNull<u8>, _layout: Layout) {}
}

impl<'h> Scope<'h> {
    pub(crate) fn new(heap: &'h Heap, len: u64) -> Result<Scope<'h>, HeapError> {
        let ps = 4096u64;
        let len = len.max(SCOPE_HEADER + 1).div_ceil(ps) * ps;
        let l = Layout::from_size_align(len as usize, ps as usize)
            .map_err(|_| HeapError::BadSize(len))?;
        let start = heap.alloc().block(l)?;
        let s = Scope { heap, start, len };
        let h = s.header();
        h.len.store(len, Ordering::Relaxed);
        h.bump.store(SCOPE_HEADER, Ordering::Relaxed);
        Ok(s)
    }

    fn header(&self) -> &'h ScopeHeader {
        // SAFETY: a block of at least a page, page aligned, ours.
        unsafe { &*(self.start.as_ptr() as *const ScopeHeader) }
    }

    /// Its allocator, for collections built in it (they borrow the scope:
    /// a reset waits for them to go).
    pub fn alloc(&self) -> ScopeAlloc<'_> {
        ScopeAlloc { hdr: self.header() }
    }

    /// Moves `value` into the scope.
    pub fn put<T>(&self, value: T) -> Result<&T, HeapError> {
        let p = self
            .alloc()
            .allocate(Layout::new::<T>())
            .map_err(|_| HeapError::Full(std::mem::size_of::<T>() as u64))?
            .cast::<T>();
        // SAFETY: a fresh block of T's size and alignment.
        unsafe {
            p.as_ptr().write(value);
            Ok(&*p.as_ptr())
        }
    }

    /// Empties it: everything built in it is gone (its pages unsealed
    /// first, if a released seal holds them).
    pub fn reset(&mut self) {
        // (No seal of it is in flight: a seal borrows the scope.)
        seal::unseal_at(self.start.as_ptr() as u64, true);
        self.header().bump.store(SCOPE_HEADER, Ordering::Relaxed);
    }

    /// Its first byte, and its length.
    pub fn range(&self) -> (*const u8, u64) {
        (self.start.as_ptr(), self.len)
    }

    /// Seals it: its pages read-only in this process until the seal is
    /// released (and a batch later), recorded in the heap for receivers
    /// to verify.
    pub fn seal(&self) -> Result<Seal<'_>, HeapError> {
        let addr = self.start.as_ptr() as u64;
        let off = addr - self.heap.base() as u64;
        seal::seal(
            self.heap.seal_records(),
            self.heap.pool(),
            addr,
            off,
            self.len,
        )
    }
}

impl Drop for Scope<'_> {
    fn drop(&mut self) {
        // (A seal still in flight was forgotten: a seal borrows its scope.)
        seal::unseal_at(self.start.as_ptr() as u64, true);
        let l = Layout::from_size_align(self.len as usize, 4096);
        if let Ok(l) = l {
            let _ = self.heap.alloc().give_back(self.start, l);
        }
    }
}

impl Heap {
    /// A scope of `len` bytes (rounded up to pages) for one argument.
    pub fn scope(&self, len: u64) -> Result<Scope<'_>, HeapError> {
        Scope::new(self, len)
    }
}

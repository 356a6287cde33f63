//! Scopes and seals: an argument its sender cannot change while a call
//! reads it (RPCool's seals).
//!
//! A [`Scope`] is a region of whole pages of a heap, with an allocator of
//! its own ([`ScopeAlloc`], an arena: nothing is given back until the
//! scope is reset). A call's argument is built in a scope, so its pages
//! hold it and nothing else. Sealing the scope ([`Scope::seal`]) makes
//! those pages read-only in the sender's mapping (`mprotect`), so a store
//! there faults, and records the seal in the heap's seal table: an id,
//! the range, and the sealer's attachment. The receiver checks the record
//! ([`Heap::verify_sealed`]) before it trusts that the argument holds
//! still.
//!
//! Releasing a seal is batched, because `mprotect` costs microseconds: a
//! released seal keeps its pages read-only until [`BATCH`] seals wait, or
//! [`Heap::flush_seals`], or until the sender stores into one of them.
//! That store faults, and the fault hook (`dm_sys::fault`) releases that
//! seal there and then, and the store goes on. A store into a seal not
//! released yet (its call in flight) is not resolved: the process gets
//! `SIGSEGV`, as a store into read-only memory does. Released seals of
//! scopes side by side are unsealed with one `mprotect`, and a scope
//! sealed again while its released seal still holds its pages costs no
//! page-table work at all.
//!
//! So a sender that builds each call's argument in the next of a ring of
//! [`BATCH`] scopes pays about one `mprotect` per call, which grows with
//! the argument's pages (`dmrpc bench heap`, BENCHMARKS.md: a sealed
//! call 2.9x an unsealed one at 4 KiB, 5.1x at 64 KiB). One scope
//! written before every call pays a fault and two `mprotect`s.
//!
//! What a seal does not do: it binds the sender's mapping alone (other
//! processes of the heap can still write the pages), and a sender that
//! calls `mprotect` itself, around this library, is not detected. It
//! protects a receiver from a sender's bugs and races, not from a
//! malicious sender.

use crate::heap::{Heap, HeapError, HEADER_LEN};
use allocator_api2::alloc::{AllocError, Allocator};
use dm_sys::mem::{protect, Prot};
use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Released seals wait for this many before their pages are made
/// writable again (one `mprotect` each).
pub const BATCH: usize = 16;

/// Seal records in a heap's header.
pub(crate) const SEALS: usize = 64;

/// A seal record in a heap's header. `id` 0 is a free record; `CLAIMED`
/// is one being written.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct SealRecord {
    id: AtomicU64,
    /// Offset of the first page in the heap.
    off: AtomicU64,
    /// Bytes (whole pages).
    len: AtomicU64,
    /// The sealer's attachment to the pool.
    sealer: AtomicU64,
}

const CLAIMED: u64 = u64::MAX;

/// This process's seals, for the fault hook: no allocation, no locks.
/// `state`: 0 free, 1 in flight, 2 released (pages still read-only).
struct Local {
    state: AtomicU64,
    addr: AtomicU64,
    len: AtomicU64,
    /// The address of its record in the heap's header.
    record: AtomicU64,
}

const LOCALS: usize = 256;
static LOCAL: [Local; LOCALS] = [const {
    Local {
        state: AtomicU64::new(0),
        addr: AtomicU64::new(0),
        len: AtomicU64::new(0),
        record: AtomicU64::new(0),
    }
}; LOCALS];
/// Released seals not yet unprotected.
static WAITING: AtomicUsize = AtomicUsize::new(0);

const FREE: u64 = 0;
const IN_FLIGHT: u64 = 1;
const RELEASED: u64 = 2;
/// Being unprotected by one thread (or the fault hook).
const UNSEALING: u64 = 3;

/// Makes local seal `i`'s pages writable and frees its record, if it is
/// released (or, with `any`, in any state). Async-signal-safe.
fn unseal(i: usize, any: bool) -> bool {
    let l = &LOCAL[i];
    let from = l.state.load(Ordering::Acquire);
    if from == FREE || from == UNSEALING || (!any && from != RELEASED) {
        return false;
    }
    if l.state
        .compare_exchange(from, UNSEALING, Ordering::AcqRel, Ordering::Relaxed)
        .is_err()
    {
        return false;
    }
    let (addr, len) = (
        l.addr.load(Ordering::Relaxed),
        l.len.load(Ordering::Relaxed),
    );
    // SAFETY: the range is whole pages of an open heap's mapping, sealed
    // by this process (it made them read-only; this gives them back).
    let _ = unsafe { protect(addr as *mut u8, len as usize, Prot::ReadWrite) };
    let rec = l.record.load(Ordering::Relaxed) as *const SealRecord;
    // SAFETY: the record is in the heap's header, mapped while the heap is
    // open (a heap closes only after its seals are unsealed).
    unsafe { &*rec }.id.store(0, Ordering::Release);
    if from == RELEASED {
        WAITING.fetch_sub(1, Ordering::Relaxed);
    }
    l.state.store(FREE, Ordering::Release);
    true
}

/// The fault hook: a store into a released seal's pages unseals it.
fn resolve(addr: usize, is_write: bool) -> bool {
    if !is_write {
        return false;
    }
    let a = addr as u64;
    (0..LOCALS).any(|i| {
        let l = &LOCAL[i];
        l.state.load(Ordering::Acquire) == RELEASED && {
            let s = l.addr.load(Ordering::Relaxed);
            a >= s && a < s + l.len.load(Ordering::Relaxed) && unseal(i, false)
        }
    })
}

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
        self.unseal_mine(true);
        self.header().bump.store(SCOPE_HEADER, Ordering::Relaxed);
    }

    /// Its first byte, and its length.
    pub fn range(&self) -> (*const u8, u64) {
        (self.start.as_ptr(), self.len)
    }

    /// Unseals its released seals (with `any`, its forgotten ones too).
    fn unseal_mine(&self, any: bool) {
        let a = self.start.as_ptr() as u64;
        for (i, l) in LOCAL.iter().enumerate() {
            if l.addr.load(Ordering::Acquire) == a {
                unseal(i, any);
            }
        }
    }

    /// Seals it: its pages read-only in this process until the seal is
    /// released (and a batch later), recorded in the heap for receivers
    /// to verify.
    pub fn seal(&self) -> Result<Seal<'_>, HeapError> {
        dm_sys::fault::install(resolve).map_err(|e| HeapError::Pool(dm_pool::Error::Io(e)))?;
        let addr = self.start.as_ptr() as u64;
        // A released seal of these pages still read-only: sealed again as
        // it is, under a new id, with no page-table work.
        for (i, l) in LOCAL.iter().enumerate() {
            if l.addr.load(Ordering::Acquire) == addr
                && l.len.load(Ordering::Relaxed) == self.len
                && l.state
                    .compare_exchange(RELEASED, UNSEALING, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            {
                WAITING.fetch_sub(1, Ordering::Relaxed);
                let rec = l.record.load(Ordering::Relaxed) as *const SealRecord;
                // SAFETY: its record, in this open heap's header.
                let rec = unsafe { &*rec };
                let id = new_id();
                rec.id.store(id, Ordering::Release);
                l.state.store(IN_FLIGHT, Ordering::Release);
                return Ok(Seal {
                    _scope: std::marker::PhantomData,
                    local: i,
                    id,
                });
            }
        }
        let heap = self.heap;
        let recs = heap.seal_records();
        let r = recs
            .iter()
            .position(|r| {
                r.id.compare_exchange(0, CLAIMED, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            })
            .ok_or(HeapError::Pool(dm_pool::Error::ResourceExhausted {
                what: "seal records (64 per heap)",
            }))?;
        let local = LOCAL.iter().position(|l| {
            l.state
                .compare_exchange(FREE, UNSEALING, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        });
        let Some(local) = local else {
            recs[r].id.store(0, Ordering::Release);
            return Err(HeapError::Pool(dm_pool::Error::ResourceExhausted {
                what: "seals in flight (256 per process)",
            }));
        };
        let rec = &recs[r];
        rec.off.store(addr - heap.base() as u64, Ordering::Relaxed);
        rec.len.store(self.len, Ordering::Relaxed);
        rec.sealer
            .store(heap.pool().attachment(), Ordering::Relaxed);
        let l = &LOCAL[local];
        l.addr.store(addr, Ordering::Relaxed);
        l.len.store(self.len, Ordering::Relaxed);
        l.record
            .store(rec as *const SealRecord as u64, Ordering::Relaxed);
        // Read-only first, then the record says so.
        // SAFETY: whole pages of this heap's mapping (a scope is a
        // page-aligned block of whole pages).
        if let Err(e) = unsafe { protect(self.start.as_ptr(), self.len as usize, Prot::Read) } {
            rec.id.store(0, Ordering::Release);
            l.state.store(FREE, Ordering::Release);
            return Err(HeapError::Pool(e.into()));
        }
        let id = new_id();
        rec.id.store(id, Ordering::Release);
        l.state.store(IN_FLIGHT, Ordering::Release);
        Ok(Seal {
            _scope: std::marker::PhantomData,
            local,
            id,
        })
    }
}

impl Drop for Scope<'_> {
    fn drop(&mut self) {
        // (A seal still in flight was forgotten: a seal borrows its scope.)
        self.unseal_mine(true);
        let l = Layout::from_size_align(self.len as usize, 4096);
        if let Ok(l) = l {
            let _ = self.heap.alloc().give_back(self.start, l);
        }
    }
}

/// A seal of a scope (see the module docs). Dropping it releases it.
#[derive(Debug)]
pub struct Seal<'s> {
    _scope: std::marker::PhantomData<&'s ()>,
    local: usize,
    id: u64,
}

impl Seal<'_> {
    /// Its id, which the receiver verifies ([`Heap::verify_sealed`]).
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for Seal<'_> {
    fn drop(&mut self) {
        let l = &LOCAL[self.local];
        if l.state
            .compare_exchange(IN_FLIGHT, RELEASED, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
            && WAITING.fetch_add(1, Ordering::Relaxed) + 1 >= BATCH
        {
            flush();
        }
    }
}

/// A seal id: random, never 0 or `CLAIMED`.
fn new_id() -> u64 {
    loop {
        let id = dm_sys::rand::random_u64();
        if id != 0 && id != CLAIMED {
            return id;
        }
    }
}

/// Unseals every released seal of this process: seals side by side (as
/// scopes made one after another are) with one `mprotect`.
fn flush() {
    let mut mine: Vec<(u64, u64, usize)> = Vec::new();
    for (i, l) in LOCAL.iter().enumerate() {
        if l.state
            .compare_exchange(RELEASED, UNSEALING, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            mine.push((
                l.addr.load(Ordering::Relaxed),
                l.len.load(Ordering::Relaxed),
                i,
            ));
        }
    }
    mine.sort_unstable();
    let mut k = 0;
    while k < mine.len() {
        let (start, mut end) = (mine[k].0, mine[k].0 + mine[k].1);
        let mut j = k + 1;
        while j < mine.len() && mine[j].0 == end {
            end += mine[j].1;
            j += 1;
        }
        // SAFETY: whole pages of open heaps' mappings, sealed by this
        // process (read-only by its doing; this gives them back).
        let _ = unsafe { protect(start as *mut u8, (end - start) as usize, Prot::ReadWrite) };
        for &(_, _, i) in &mine[k..j] {
            let l = &LOCAL[i];
            let rec = l.record.load(Ordering::Relaxed) as *const SealRecord;
            // SAFETY: its record, in an open heap's header.
            unsafe { &*rec }.id.store(0, Ordering::Release);
            WAITING.fetch_sub(1, Ordering::Relaxed);
            l.state.store(FREE, Ordering::Release);
        }
        k = j;
    }
}

impl Heap {
    pub(crate) fn seal_records(&self) -> &[SealRecord; SEALS] {
        &self.header().seals
    }

    /// A scope of `len` bytes (rounded up to pages) for one argument.
    pub fn scope(&self, len: u64) -> Result<Scope<'_>, HeapError> {
        Scope::new(self, len)
    }

    /// Makes the pages of this process's released seals writable now
    /// (which a batch of [`BATCH`], or a store into them, does too).
    pub fn flush_seals(&self) {
        flush();
    }

    /// Whether bytes `[ptr, ptr + len)` of this heap are sealed by seal
    /// `id`, by a process still attached: the receiver's check before it
    /// trusts that a call's argument holds still. Every field of the
    /// record is checked (another process may have written it).
    pub fn verify_sealed(&self, id: u64, ptr: *const u8, len: u64) -> Result<(), HeapError> {
        let not = |why: &'static str| Err(HeapError::NotSealed(why));
        if id == 0 || id == CLAIMED {
            return not("no seal has that id");
        }
        let base = self.base() as u64;
        let off = (ptr as u64)
            .checked_sub(base)
            .ok_or(HeapError::Foreign(ptr as u64))?;
        let Some(rec) = self
            .seal_records()
            .iter()
            .find(|r| r.id.load(Ordering::Acquire) == id)
        else {
            return not("no seal has that id");
        };
        let (s, n) = (
            rec.off.load(Ordering::Relaxed),
            rec.len.load(Ordering::Relaxed),
        );
        let sealer = rec.sealer.load(Ordering::Relaxed);
        if s < HEADER_LEN || s.checked_add(n).is_none_or(|e| e > self.len()) {
            return not("its record is out of bounds");
        }
        if off < s || off.checked_add(len).is_none_or(|e| e > s + n) {
            return not("it covers other bytes");
        }
        if !self.pool().is_attached(sealer) {
            return not("its sealer is gone");
        }
        // (Read again: a record freed and taken meanwhile is another seal.)
        if rec.id.load(Ordering::Acquire) != id {
            return not("it was released");
        }
        Ok(())
    }

    /// Unseals this process's seals in this heap, whatever their state
    /// (the heap is closing).
    pub(crate) fn unseal_all(&self) {
        let (b, e) = (self.base() as u64, self.base() as u64 + self.len());
        for (i, l) in LOCAL.iter().enumerate() {
            let a = l.addr.load(Ordering::Acquire);
            if a >= b && a < e {
                unseal(i, true);
            }
        }
    }
}

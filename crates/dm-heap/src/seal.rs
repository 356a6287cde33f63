//! Seals: an argument its sender cannot change while a call reads it
//! (RPCool's seals). This file keeps this process's seals; `scope.rs`
//! holds the scopes they seal.
//!
//! A [`Scope`](crate::scope::Scope) is a region of whole pages of a heap, with an allocator of
//! its own (`ScopeAlloc`, an arena: nothing is given back until the
//! scope is reset). A call's argument is built in a scope, so its pages
//! hold it and nothing else. Sealing the scope (`Scope::seal`) makes
//! those pages read-only in the sender's mapping (`mprotect`), so a store
//! there faults, and records the seal in the heap's seal table: an id,
//! the range, and the sealer's attachment. The receiver checks the record
//! (`Heap::verify_sealed`) before it trusts that the argument holds
//! still.
//!
//! Releasing a seal is batched, because `mprotect` costs microseconds: a
//! released seal keeps its pages read-only until [`BATCH`] seals wait, or
//! `Heap::flush_seals`, or until the sender stores into one of them.
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

use crate::error::HeapError;
use crate::header::{SealRecord, CLAIMED, HEADER_LEN, SEALS};
use dm_pool::Pool;
use dm_sys::mem::{protect, Prot};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Released seals wait for this many before their pages are made
/// writable again (one `mprotect` each).
pub const BATCH: usize = 16;

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

/// A seal of a scope (see the module docs). Dropping it releases it.
#[derive(Debug)]
pub struct Seal<'s> {
    _scope: std::marker::PhantomData<&'s ()>,
    local: usize,
    id: u64,
}

impl Seal<'_> {
    /// Its id, which the receiver verifies
    /// ([`Heap::verify_sealed`](crate::heap::Heap::verify_sealed)).
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
pub(crate) fn flush() {
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

/// Unseals this process's seals of the pages at `addr` that are released
/// (with `any`, in any state: forgotten ones too).
pub(crate) fn unseal_at(addr: u64, any: bool) {
    for (i, l) in LOCAL.iter().enumerate() {
        if l.addr.load(Ordering::Acquire) == addr {
            unseal(i, any);
        }
    }
}

/// Unseals this process's seals of addresses `[b, e)`, whatever their
/// state (their heap is closing).
pub(crate) fn unseal_within(b: u64, e: u64) {
    for (i, l) in LOCAL.iter().enumerate() {
        let a = l.addr.load(Ordering::Acquire);
        if a >= b && a < e {
            unseal(i, true);
        }
    }
}

/// Seals the `len` bytes (whole pages) at `addr`, `off` bytes into a heap
/// whose seal table is `records`, for this process of `pool`: read-only
/// here, then recorded.
pub(crate) fn seal<'s>(
    records: &[SealRecord; SEALS],
    pool: &Pool,
    addr: u64,
    off: u64,
    len: u64,
) -> Result<Seal<'s>, HeapError> {
    dm_sys::fault::install(resolve).map_err(|e| HeapError::Pool(dm_pool::Error::Io(e)))?;
    // A released seal of these pages still read-only: sealed again as
    // it is, under a new id, with no page-table work.
    for (i, l) in LOCAL.iter().enumerate() {
        if l.addr.load(Ordering::Acquire) == addr
            && l.len.load(Ordering::Relaxed) == len
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
    let r = records
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
        records[r].id.store(0, Ordering::Release);
        return Err(HeapError::Pool(dm_pool::Error::ResourceExhausted {
            what: "seals in flight (256 per process)",
        }));
    };
    let rec = &records[r];
    rec.off.store(off, Ordering::Relaxed);
    rec.len.store(len, Ordering::Relaxed);
    rec.sealer.store(pool.attachment(), Ordering::Relaxed);
    let l = &LOCAL[local];
    l.addr.store(addr, Ordering::Relaxed);
    l.len.store(len, Ordering::Relaxed);
    l.record
        .store(rec as *const SealRecord as u64, Ordering::Relaxed);
    // Read-only first, then the record says so.
    // SAFETY: whole pages of an open heap's mapping (the caller's scope
    // is a page-aligned block of whole pages).
    if let Err(e) = unsafe { protect(addr as *mut u8, len as usize, Prot::Read) } {
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

/// Whether bytes `[off, off + len)` of a heap of `heap_len` bytes whose
/// seal table is `records` are sealed by seal `id`, by a process of
/// `pool` still attached. Every field of the record is checked.
pub(crate) fn verify(
    records: &[SealRecord; SEALS],
    heap_len: u64,
    pool: &Pool,
    id: u64,
    off: u64,
    len: u64,
) -> Result<(), HeapError> {
    let not = |why: &'static str| Err(HeapError::NotSealed(why));
    if id == 0 || id == CLAIMED {
        return not("no seal has that id");
    }
    let Some(rec) = records.iter().find(|r| r.id.load(Ordering::Acquire) == id) else {
        return not("no seal has that id");
    };
    let (s, n) = (
        rec.off.load(Ordering::Relaxed),
        rec.len.load(Ordering::Relaxed),
    );
    let sealer = rec.sealer.load(Ordering::Relaxed);
    if s < HEADER_LEN || s.checked_add(n).is_none_or(|e| e > heap_len) {
        return not("its record is out of bounds");
    }
    if off < s || off.checked_add(len).is_none_or(|e| e > s + n) {
        return not("it covers other bytes");
    }
    if !pool.is_attached(sealer) {
        return not("its sealer is gone");
    }
    // (Read again: a record freed and taken meanwhile is another seal.)
    if rec.id.load(Ordering::Acquire) != id {
        return not("it was released");
    }
    Ok(())
}

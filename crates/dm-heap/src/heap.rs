//! Heaps: creating, sharing and opening them.
//!
//! A heap is a pool buffer of whole pages, mapped read-write at one
//! address in every process that opens it ([`dm_pool::FixedMapping`]).
//! Its creator picks the address at random in a range processes seldom
//! use, and records it in the heap's header (`header.rs`).
//!
//! It is shared as a [`HeapRef`]: a Ref of the buffer, with the address
//! and the length. Opening it maps the Ref at that address, and checks
//! the header against the Ref before trusting anything in it. Every value
//! the allocator later reads from the header or from a free block is
//! checked too (`alloc.rs`): another process of the heap can write
//! anything there.

use crate::alloc::HeapAlloc;
use crate::error::HeapError;
use crate::header::{Header, SealRecord, HEADER_LEN, HEAP_REF_LEN, HEAP_VERSION, MAGIC, SEALS};
use crate::open::{register, unregister};
use dm_pool::{FixedMapping, Pool, Ref};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError, Weak};

/// Where heaps are placed: addresses `[LOW, HIGH)`, in steps of `ALIGN`.
/// Far below where Linux places `mmap`s (just under the stack, near
/// 0x7fff_...) and far above programs and their heaps.
const LOW: u64 = 0x5000_0000_0000;
const HIGH: u64 = 0x6000_0000_0000;
const ALIGN: u64 = 2 << 20;

/// The heaps this process holds as shared handles, by address
/// ([`Heap::open_held`], [`Heap::held`]).
static HELD: Mutex<Vec<Weak<Heap>>> = Mutex::new(Vec::new());

/// A heap opened by this process (see the crate docs). Values in it are
/// reachable only while it is open: the collections made with its
/// [`alloc`](Self::alloc) borrow it.
#[derive(Debug)]
pub struct Heap {
    map: FixedMapping,
    pool: Pool,
    /// This process's entry in the list of open heaps (`open.rs`).
    entry: usize,
    /// The reference its arguments carry, and when it was made (one Ref
    /// for many calls, made anew at half its TTL).
    shared: std::sync::Mutex<Option<(HeapRef, std::time::Instant)>>,
}

/// A heap as it travels: a Ref of its buffer, its address and length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeapRef {
    r: Ref,
    addr: u64,
    len: u64,
}

impl HeapRef {
    /// Its encoding: the Ref's, then the address and the length
    /// (little-endian).
    pub fn to_bytes(&self) -> [u8; HEAP_REF_LEN] {
        let mut b = [0u8; HEAP_REF_LEN];
        let n = dm_pool::Ref::SIZE;
        b[..n].copy_from_slice(&self.r.to_bytes());
        b[n..n + 8].copy_from_slice(&self.addr.to_le_bytes());
        b[n + 8..].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes [`to_bytes`](Self::to_bytes) (checked when opened).
    pub fn from_bytes(b: &[u8]) -> Result<HeapRef, HeapError> {
        let n = dm_pool::Ref::SIZE;
        if b.len() != HEAP_REF_LEN {
            return Err(HeapError::BadRef(b.len()));
        }
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        Ok(HeapRef {
            r: Ref::from_bytes(&b[..n]).map_err(dm_pool::Error::from)?,
            addr: word(n),
            len: word(n + 8),
        })
    }

    /// The Ref of the heap's buffer (released with
    /// [`Pool::release_ref`] once every process it went to opened it, or
    /// left to its TTL).
    pub fn pool_ref(&self) -> &Ref {
        &self.r
    }

    /// The address the heap sits at.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty (never, for a heap).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Heap {
    /// Makes a heap of `len` bytes (rounded up to pages) in `pool`, at an
    /// address free in this process, and opens it.
    pub fn create(pool: &Pool, len: u64) -> Result<Heap, HeapError> {
        let ps = pool.page_size() as u64;
        let len = len.div_ceil(ps).saturating_mul(ps);
        if !(2 * HEADER_LEN..=(HIGH - LOW) / 16).contains(&len) {
            return Err(HeapError::BadSize(len));
        }
        let mut buf = pool.alloc(len)?;
        // Every page backed and zeroed (its first owner may have left bytes).
        buf.overwrite(|_| 0)?;
        let slots = (HIGH - LOW - len) / ALIGN;
        let mut map = None;
        for _ in 0..32 {
            let addr = LOW + (dm_sys::rand::random_u64() % slots) * ALIGN;
            match FixedMapping::new(buf, addr) {
                Ok(m) => {
                    map = Some(m);
                    break;
                }
                Err(dm_pool::Error::Sys(dm_sys::mem::SysError::AddressInUse { .. })) => {
                    // (The buffer went with the failed mapping: take it anew.)
                    buf = pool.alloc(len)?;
                    buf.overwrite(|_| 0)?;
                }
                Err(e) => return Err(e.into()),
            }
        }
        let map = map.ok_or(HeapError::NoAddress(len))?;
        let base = map.base() as u64;
        // SAFETY: the mapping is at least HEADER_LEN bytes, page aligned,
        // read-write, and zeroed (all-zero atomics are valid).
        let h = unsafe { &*(map.base() as *const Header) };
        h.version.store(u64::from(HEAP_VERSION), Ordering::Relaxed);
        h.addr.store(base, Ordering::Relaxed);
        h.len.store(len, Ordering::Relaxed);
        h.bump.store(HEADER_LEN, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        Heap::register(map, pool)
    }

    /// Opens the heap `r` names, at its address: `AddressInUse` (in
    /// [`HeapError::Pool`]) if that range is taken in this process.
    pub fn open(pool: &Pool, r: &HeapRef) -> Result<Heap, HeapError> {
        let buf = pool.map_ref(&r.r)?;
        if buf.len() != r.len {
            return Err(HeapError::NotAHeap(format!(
                "its Ref is {} bytes, its reference says {}",
                buf.len(),
                r.len
            )));
        }
        if r.addr < LOW
            || r.addr.checked_add(r.len).is_none_or(|e| e > HIGH)
            || !r.addr.is_multiple_of(ALIGN)
        {
            return Err(HeapError::NotAHeap(format!(
                "address {:#x} is outside where heaps are placed",
                r.addr
            )));
        }
        let map = FixedMapping::new(buf, r.addr)?;
        // SAFETY: as in `create`; the bytes are checked below before use.
        let h = unsafe { &*(map.base() as *const Header) };
        let magic = h.magic.load(Ordering::Acquire);
        let version = h.version.load(Ordering::Relaxed);
        let (addr, len) = (
            h.addr.load(Ordering::Relaxed),
            h.len.load(Ordering::Relaxed),
        );
        if magic != MAGIC || version != u64::from(HEAP_VERSION) || addr != r.addr || len != r.len {
            return Err(HeapError::NotAHeap(format!(
                "header says magic {magic:#x}, version {version}, at {addr:#x}, {len} bytes"
            )));
        }
        Heap::register(map, pool)
    }

    /// The heap `r` names as this process holds it: the handle every
    /// channel, service and [`Heaps`](crate::Heaps) of the process shares,
    /// opened on first use. (A heap is mapped once per process: a second
    /// [`open`](Self::open) of it fails with `AddressInUse`.)
    pub fn open_held(pool: &Pool, r: &HeapRef) -> Result<Arc<Heap>, HeapError> {
        let mut held = HELD.lock().unwrap_or_else(PoisonError::into_inner);
        held.retain(|w| w.strong_count() > 0);
        if let Some(h) = held
            .iter()
            .filter_map(Weak::upgrade)
            .find(|h| h.base() as u64 == r.addr())
        {
            if h.len() != r.len() {
                return Err(HeapError::BadArg(
                    "a heap at that address has another length",
                ));
            }
            return Ok(h);
        }
        let h = Arc::new(Heap::open(pool, r)?);
        held.push(Arc::downgrade(&h));
        Ok(h)
    }

    /// This heap, made or opened here, as the handle the rest of the
    /// process finds with [`open_held`](Self::open_held).
    pub fn held(self) -> Arc<Heap> {
        let h = Arc::new(self);
        let mut held = HELD.lock().unwrap_or_else(PoisonError::into_inner);
        held.retain(|w| w.strong_count() > 0);
        held.push(Arc::downgrade(&h));
        h
    }

    fn register(map: FixedMapping, pool: &Pool) -> Result<Heap, HeapError> {
        let entry = register(map.base() as u64, map.len() as u64, pool)?;
        Ok(Heap {
            map,
            pool: pool.clone(),
            entry,
            shared: std::sync::Mutex::new(None),
        })
    }

    pub(crate) fn header(&self) -> &Header {
        // SAFETY: checked at creation or opening; mapped while self lives.
        unsafe { &*(self.map.base() as *const Header) }
    }

    /// The address it sits at, in every process.
    pub fn base(&self) -> *mut u8 {
        self.map.base()
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The allocator of this heap, for collections:
    /// `HeapVec::new_in(heap.alloc())`.
    pub fn alloc(&self) -> HeapAlloc<'_> {
        HeapAlloc::new(self.header())
    }

    /// Bytes in blocks handed out and not given back.
    pub fn in_use(&self) -> u64 {
        self.header().in_use.load(Ordering::Relaxed)
    }

    /// Moves `value` into the heap: the returned reference lives as long
    /// as the heap is open here. (The value is never dropped: a heap's
    /// memory goes with the heap.)
    pub fn put<T>(&self, value: T) -> Result<&T, HeapError> {
        let p = self
            .alloc()
            .block(std::alloc::Layout::new::<T>())?
            .cast::<T>();
        // SAFETY: a fresh block of T's size and alignment, ours alone.
        unsafe {
            p.as_ptr().write(value);
            Ok(&*p.as_ptr())
        }
    }

    /// The offset of `value` in this heap, if it is in it.
    pub fn offset_of<T>(&self, value: &T) -> Option<u64> {
        let a = value as *const T as u64;
        let base = self.base() as u64;
        (a >= base + HEADER_LEN && a + std::mem::size_of::<T>() as u64 <= base + self.len())
            .then(|| a - base)
    }

    /// Sets the heap's root: the value other processes find first.
    pub fn set_root<T>(&self, value: &T) {
        // (A value outside the heap is no root.)
        let off = self.offset_of(value).unwrap_or(0);
        self.header().root.store(off, Ordering::Release);
    }

    /// The heap's root, as a `T`.
    ///
    /// # Safety
    /// The root must have been set to a `T` by a process trusted to have
    /// done so, and nothing may change it while the reference lives:
    /// nothing here checks the bytes (validated access does).
    pub unsafe fn root<T>(&self) -> Option<&T> {
        let off = self.header().root.load(Ordering::Acquire);
        let size = std::mem::size_of::<T>() as u64;
        let ok = off >= HEADER_LEN
            && off.checked_add(size).is_some_and(|e| e <= self.len())
            && (self.base() as u64 + off).is_multiple_of(std::mem::align_of::<T>() as u64);
        // SAFETY: in bounds and aligned (checked); a T by the caller's word.
        ok.then(|| unsafe { &*(self.base().add(off as usize) as *const T) })
    }

    /// Where the heap's root is, as a `T`, if it is in bounds and aligned
    /// for one (what is there is the caller's to trust: see
    /// [`root`](Self::root)).
    pub fn root_ptr<T>(&self) -> Option<std::ptr::NonNull<T>> {
        // SAFETY: only the bounds are used; nothing is read through it.
        unsafe { self.root::<T>() }.map(std::ptr::NonNull::from)
    }

    /// Shares the heap: a [`HeapRef`] any process of the pool opens it by,
    /// valid for the pool's Ref TTL (or until released).
    pub fn share(&self) -> Result<HeapRef, HeapError> {
        Ok(HeapRef {
            r: self.map.buffer().share()?,
            addr: self.base() as u64,
            len: self.len(),
        })
    }

    /// The reference arguments carry: one [`share`](Self::share) kept
    /// for many, made anew once half the pool's Ref TTL has passed (the
    /// old one runs out by itself), released when the heap closes here.
    pub(crate) fn shared_ref(&self) -> Result<HeapRef, HeapError> {
        let ttl = std::time::Duration::from_millis(self.pool.layout().ref_ttl_ms);
        let mut s = self
            .shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match &*s {
            Some((r, at)) if at.elapsed() < ttl / 2 => Ok(r.clone()),
            _ => {
                let r = self.share()?;
                *s = Some((r.clone(), std::time::Instant::now()));
                Ok(r)
            }
        }
    }

    pub(crate) fn seal_records(&self) -> &[SealRecord; SEALS] {
        &self.header().seals
    }

    /// Makes the pages of this process's released seals writable now
    /// (which a batch of [`BATCH`](crate::seal::BATCH), or a store into them,
    /// does too).
    pub fn flush_seals(&self) {
        crate::seal::flush();
    }

    /// Whether bytes `[ptr, ptr + len)` of this heap are sealed by seal
    /// `id`, by a process still attached: the receiver's check before it
    /// trusts that a call's argument holds still. Every field of the
    /// record is checked (another process may have written it).
    pub fn verify_sealed(&self, id: u64, ptr: *const u8, len: u64) -> Result<(), HeapError> {
        let off = (ptr as u64)
            .checked_sub(self.base() as u64)
            .ok_or(HeapError::Foreign(ptr as u64))?;
        crate::seal::verify(self.seal_records(), self.len(), &self.pool, id, off, len)
    }

    /// The pool it is in.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }
}

impl Drop for Heap {
    fn drop(&mut self) {
        // (Before the mapping goes: the seals' records are in it.)
        let base = self.base() as u64;
        crate::seal::unseal_within(base, base + self.len());
        // Arguments passed since name the heap by this Ref: released with
        // the heap (a process that opened it holds the pages itself).
        let shared = self.shared.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some((r, _)) = shared.take() {
            let _ = self.pool.release_ref(&r.r);
        }
        unregister(self.entry);
    }
}

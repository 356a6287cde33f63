//! Pointer-rich call arguments: a value in a heap, passed as 96 bytes.
//!
//! The sender puts a value in a heap and sends [`Heap::arg`] (or
//! [`Heap::sealed_arg`]) as a call's payload. The receiver reads it in
//! place through its [`Heaps`], which opens the sender's heap the first
//! time one of its arguments arrives (at the same address) and keeps it
//! open. Nothing is serialized: the value's pointers are valid in the
//! receiver as they are.
//!
//! An argument's bytes (version 1, little-endian):
//!
//! | bytes | field |
//! |-------|-------|
//! | 4 | magic `DMHA` |
//! | 1 | version (1) |
//! | 3 | zero |
//! | 56 | the heap ([`HeapRef`]) |
//! | 8 | the value's offset in the heap |
//! | 8 | the value's size |
//! | 8 | the seal that holds it still, or 0 |
//! | 8 | its type: a hash of its Rust type's name, size and alignment |
//!
//! Every field is checked before use: the heap's Ref and header as
//! [`Heap::open`] checks them, the offset and size against the heap's
//! bounds and the type's alignment, the type against the one the
//! receiver asks for, and the seal against the heap's seal table. Both
//! ends must name the type alike (one crate defines it for both).

use crate::error::HeapError;
use crate::header::{HEADER_LEN, HEAP_REF_LEN};
use crate::heap::{Heap, HeapRef};
use crate::seal::Seal;
use dm_pool::Pool;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

/// The length of an argument's bytes.
pub const ARG_LEN: usize = 96;
const MAGIC: [u8; 4] = *b"DMHA";
const VERSION: u8 = 1;

/// The type tag of `T`: FNV-1a of its name, then its size and alignment.
pub(crate) fn type_tag<T>() -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let name = std::any::type_name::<T>().as_bytes();
    let size = (std::mem::size_of::<T>() as u64).to_le_bytes();
    let align = (std::mem::align_of::<T>() as u64).to_le_bytes();
    for &b in name.iter().chain(&size).chain(&align) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl Heap {
    /// The bytes that pass `value` (in this heap) to another process of
    /// the pool.
    pub fn arg<T>(&self, value: &T) -> Result<[u8; ARG_LEN], HeapError> {
        self.encode_arg(value, 0)
    }

    /// As [`arg`](Self::arg), for a value in a sealed scope: the receiver
    /// can verify that it holds still ([`Heaps::sealed_arg`]).
    pub fn sealed_arg<T>(&self, value: &T, seal: &Seal<'_>) -> Result<[u8; ARG_LEN], HeapError> {
        self.encode_arg(value, seal.id())
    }

    fn encode_arg<T>(&self, value: &T, seal: u64) -> Result<[u8; ARG_LEN], HeapError> {
        let off = self
            .offset_of(value)
            .ok_or(HeapError::Foreign(value as *const T as u64))?;
        encode_raw(
            &self.shared_ref()?,
            off,
            std::mem::size_of::<T>() as u64,
            seal,
            type_tag::<T>(),
        )
    }
}

/// An argument's bytes (see the module docs).
pub(crate) fn encode_raw(
    heap: &HeapRef,
    off: u64,
    size: u64,
    seal: u64,
    tag: u64,
) -> Result<[u8; ARG_LEN], HeapError> {
    let mut b = [0u8; ARG_LEN];
    b[..4].copy_from_slice(&MAGIC);
    b[4] = VERSION;
    b[8..8 + HEAP_REF_LEN].copy_from_slice(&heap.to_bytes());
    let mut at = 8 + HEAP_REF_LEN;
    for w in [off, size, seal, tag] {
        b[at..at + 8].copy_from_slice(&w.to_le_bytes());
        at += 8;
    }
    Ok(b)
}

/// An argument as it arrived, its fields not yet checked against a heap.
#[derive(Debug)]
pub(crate) struct Decoded {
    pub(crate) heap: HeapRef,
    pub(crate) off: u64,
    pub(crate) size: u64,
    pub(crate) seal: u64,
    pub(crate) tag: u64,
}

pub(crate) fn decode(b: &[u8]) -> Result<Decoded, HeapError> {
    let bad = |why: &'static str| HeapError::BadArg(why);
    if b.len() != ARG_LEN {
        return Err(bad("an argument is 96 bytes"));
    }
    if b[..4] != MAGIC {
        return Err(bad("no argument's magic"));
    }
    if b[4] != VERSION || b[5..8] != [0, 0, 0] {
        return Err(bad("an argument of another version"));
    }
    let heap = HeapRef::from_bytes(&b[8..8 + HEAP_REF_LEN])?;
    let at = 8 + HEAP_REF_LEN;
    let word = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[at + 8 * i..at + 8 * i + 8]);
        u64::from_le_bytes(w)
    };
    Ok(Decoded {
        heap,
        off: word(0),
        size: word(1),
        seal: word(2),
        tag: word(3),
    })
}

/// The heaps a receiver reads arguments from: each opened when its first
/// argument arrives, and kept open while this lives ([`Heaps::new`]);
/// or a fixed set, the heaps of one connection ([`Heaps::only`]).
#[derive(Debug)]
pub struct Heaps {
    /// Where heaps not open yet are opened from (none for a fixed set).
    pool: Option<Pool>,
    open: Mutex<Vec<Arc<Heap>>>,
}

/// A value in a heap, as a call passed it. It keeps its heap open.
#[derive(Debug)]
pub struct Arg<T> {
    heap: Arc<Heap>,
    ptr: NonNull<T>,
}

// SAFETY: a view of shared memory; what `T` allows across threads is the
// same as for `&T` (see `get`).
unsafe impl<T: Sync> Send for Arg<T> {}
// SAFETY: as above.
unsafe impl<T: Sync> Sync for Arg<T> {}

impl<T> Arg<T> {
    /// The value, read in place.
    ///
    /// # Safety
    /// Its sender must be trusted to have passed a valid `T` (its
    /// pointers into the heap, its bytes a `T`'s) and to leave it be
    /// while the reference lives (a sealed argument holds still). Only
    /// its place was checked: inside the heap, aligned, of `T`'s size
    /// and type name.
    pub unsafe fn get(&self) -> &T {
        // SAFETY: in bounds and aligned (checked on arrival); a valid T by
        // the caller's word.
        unsafe { self.ptr.as_ref() }
    }

    /// The heap it is in.
    pub fn heap(&self) -> &Heap {
        &self.heap
    }

    /// Where it is.
    pub fn as_ptr(&self) -> *const T {
        self.ptr.as_ptr()
    }
}

impl Heaps {
    /// Heaps of `pool`, none open yet.
    pub fn new(pool: &Pool) -> Heaps {
        Heaps {
            pool: Some(pool.clone()),
            open: Mutex::new(Vec::new()),
        }
    }

    /// These heaps and no other: an argument in another heap is refused
    /// (`BadArg`) and nothing is opened for it.
    pub fn only(heaps: impl IntoIterator<Item = Arc<Heap>>) -> Heaps {
        Heaps {
            pool: None,
            open: Mutex::new(heaps.into_iter().collect()),
        }
    }

    /// Adds `heap`, which this process made or opened itself: arguments
    /// in it are read here too (a sender and a receiver in one process).
    pub fn add(&self, heap: Heap) -> Arc<Heap> {
        let h = heap.held();
        self.open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(h.clone());
        h
    }

    /// The `T` that argument `bytes` passes.
    pub fn arg<T>(&self, bytes: &[u8]) -> Result<Arg<T>, HeapError> {
        let d = decode(bytes)?;
        self.place(&d)
    }

    /// As [`arg`](Self::arg), for an argument that must be sealed: the
    /// seal it names holds exactly its bytes' pages, by a sealer still
    /// attached ([`Heap::verify_sealed`]).
    pub fn sealed_arg<T>(&self, bytes: &[u8]) -> Result<Arg<T>, HeapError> {
        let d = decode(bytes)?;
        let a = self.place::<T>(&d)?;
        a.heap
            .verify_sealed(d.seal, a.ptr.as_ptr().cast(), d.size)?;
        Ok(a)
    }

    fn place<T>(&self, d: &Decoded) -> Result<Arg<T>, HeapError> {
        if d.size != std::mem::size_of::<T>() as u64 {
            return Err(HeapError::BadArg("a value of another type"));
        }
        let (heap, p) = self.place_raw(d, type_tag::<T>(), std::mem::align_of::<T>())?;
        Ok(Arg {
            // SAFETY: inside the heap's mapping (checked), so not null.
            ptr: unsafe { NonNull::new_unchecked(p as *mut T) },
            heap,
        })
    }

    /// Where the bytes argument `d` names are: of type `tag`, inside the
    /// heap past its header, aligned to `align`.
    pub(crate) fn place_raw(
        &self,
        d: &Decoded,
        tag: u64,
        align: usize,
    ) -> Result<(Arc<Heap>, *const u8), HeapError> {
        if d.tag != tag {
            return Err(HeapError::BadArg("a value of another type"));
        }
        let heap = self.heap_of(&d.heap)?;
        if d.off < HEADER_LEN || d.off.checked_add(d.size).is_none_or(|e| e > heap.len()) {
            return Err(HeapError::BadArg("a value outside its heap"));
        }
        let addr = heap.base() as u64 + d.off;
        if !addr.is_multiple_of(align as u64) {
            return Err(HeapError::BadArg("a value not aligned for its type"));
        }
        Ok((heap, addr as *const u8))
    }

    /// The heap `r` names, opened if it is not open yet.
    fn heap_of(&self, r: &HeapRef) -> Result<Arc<Heap>, HeapError> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(h) = open.iter().find(|h| h.base() as u64 == r.addr()) {
            if h.len() != r.len() {
                return Err(HeapError::BadArg(
                    "a heap at that address has another length",
                ));
            }
            return Ok(h.clone());
        }
        let Some(pool) = &self.pool else {
            return Err(HeapError::BadArg(
                "a heap this receiver does not take (not its connection's, nor its service's)",
            ));
        };
        let h = Heap::open_held(pool, r)?;
        open.push(h.clone());
        Ok(h)
    }
}

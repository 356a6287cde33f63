//! Validated access: values archived with `rkyv` in a heap, read in place
//! by a receiver that does not trust their sender, after `bytecheck`'s
//! validation.
//!
//! Collections built with [`HeapAlloc`](crate::alloc::HeapAlloc) hold native
//! pointers: a receiver follows them as they are, so it must trust their
//! sender. A value that needs no mutation can travel as an `rkyv` archive
//! instead: written once into the heap ([`Heap::archive`], or
//! [`Scope::archive`] to seal it), passed as a heap argument, and read
//! in place. Its pointers are relative and its layout is checkable:
//! validation proves that every pointer the receiver can follow lies
//! inside the archive's bytes, is aligned, points to a value of the right
//! type, and that no two pointers claim the same bytes (so walks end). A
//! bad archive is [`HeapError::Invalid`], never a crash and never a read
//! outside it.
//!
//! Validation reads the bytes where they are, so what it proves holds
//! only while they hold still: [`Heaps::archived_sealed`] takes only a
//! sealed argument (its sender cannot write it while the call reads it).
//! [`Heaps::archived_copy`] copies the archive into this process first,
//! for an argument that is not sealed. [`Heaps::archived_trusted`] skips
//! validation, for a sender the receiver trusts.

use crate::arg::{decode, encode_raw, type_tag, Heaps, ARG_LEN};
use crate::error::HeapError;
use crate::heap::Heap;
use crate::scope::Scope;
use crate::seal::Seal;
use rkyv::api::high::{HighSerializer, HighValidator};
use rkyv::rancor::Error as RkyvError;
use rkyv::ser::allocator::ArenaHandle;
use rkyv::util::AlignedVec;
use rkyv::{Archive, Portable, Serialize};
use std::marker::PhantomData;
use std::sync::Arc;

/// The alignment of an archive's first byte (rkyv's `AlignedVec`'s).
const ALIGN: usize = 16;

/// What [`Heap::archive`] takes: a value rkyv serializes.
pub trait Archivable:
    Archive + for<'a> Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, RkyvError>>
{
}
impl<T> Archivable for T where
    T: Archive + for<'a> Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, RkyvError>>
{
}

/// What a receiver validates: an archived value bytecheck can check.
pub trait Checkable:
    Portable + for<'a> rkyv::bytecheck::CheckBytes<HighValidator<'a, RkyvError>>
{
}
impl<T> Checkable for T where
    T: Portable + for<'a> rkyv::bytecheck::CheckBytes<HighValidator<'a, RkyvError>>
{
}

/// What an archive borrows (its heap or scope) and holds (a `T`'s bytes).
type Of<'a, T> = PhantomData<(&'a (), fn() -> T)>;

/// An archive of a `T` in a heap, as its sender holds it.
#[derive(Debug)]
pub struct HeapArchive<'a, T> {
    ptr: *const u8,
    len: usize,
    _of: Of<'a, T>,
}

impl<T> HeapArchive<'_, T> {
    /// Its bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has none (never: an archive has its root).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Serializes `value` and copies the archive into a block `alloc` gives.
fn write_archive<T: Archivable>(
    value: &T,
    block: impl FnOnce(std::alloc::Layout) -> Result<*mut u8, HeapError>,
) -> Result<(*const u8, usize), HeapError> {
    let bytes =
        rkyv::to_bytes::<RkyvError>(value).map_err(|e| HeapError::Invalid(e.to_string()))?;
    let layout = std::alloc::Layout::from_size_align(bytes.len().max(1), ALIGN)
        .map_err(|_| HeapError::Full(bytes.len() as u64))?;
    let p = block(layout)?;
    // SAFETY: a fresh block of at least the archive's length.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len()) };
    Ok((p, bytes.len()))
}

impl Heap {
    /// Archives `value` (rkyv) into this heap: any process that opens
    /// the heap reads it in place, validated or not. (The block is the
    /// heap's until it closes: archives are not given back.)
    pub fn archive<T: Archivable>(&self, value: &T) -> Result<HeapArchive<'_, T>, HeapError> {
        let (ptr, len) = write_archive(value, |l| Ok(self.alloc().block(l)?.as_ptr()))?;
        Ok(HeapArchive {
            ptr,
            len,
            _of: PhantomData,
        })
    }

    /// The bytes that pass archive `a` to another process of the pool
    /// (read with [`Heaps::archived_copy`] or
    /// [`Heaps::archived_trusted`]).
    pub fn archive_arg<T: Archive>(
        &self,
        a: &HeapArchive<'_, T>,
    ) -> Result<[u8; ARG_LEN], HeapError> {
        self.raw_arg(a.ptr, a.len, 0, type_tag::<T::Archived>())
    }

    /// As [`archive_arg`](Self::archive_arg), for an archive in a sealed
    /// scope ([`Heaps::archived_sealed`] reads it in place).
    pub fn sealed_archive_arg<T: Archive>(
        &self,
        a: &HeapArchive<'_, T>,
        seal: &Seal<'_>,
    ) -> Result<[u8; ARG_LEN], HeapError> {
        self.raw_arg(a.ptr, a.len, seal.id(), type_tag::<T::Archived>())
    }

    fn raw_arg(
        &self,
        ptr: *const u8,
        len: usize,
        seal: u64,
        tag: u64,
    ) -> Result<[u8; ARG_LEN], HeapError> {
        let off = (ptr as u64)
            .checked_sub(self.base() as u64)
            .filter(|o| o + len as u64 <= self.len())
            .ok_or(HeapError::Foreign(ptr as u64))?;
        encode_raw(&self.shared_ref()?, off, len as u64, seal, tag)
    }
}

impl Scope<'_> {
    /// Archives `value` into this scope, to be sealed with it.
    pub fn archive<T: Archivable>(&self, value: &T) -> Result<HeapArchive<'_, T>, HeapError> {
        let (ptr, len) = write_archive(value, |l| {
            allocator_api2::alloc::Allocator::allocate(&self.alloc(), l)
                .map(|p| p.cast::<u8>().as_ptr())
                .map_err(|_| HeapError::Full(l.size() as u64))
        })?;
        Ok(HeapArchive {
            ptr,
            len,
            _of: PhantomData,
        })
    }
}

/// A sealed archive, validated, read in place. It keeps its heap open.
#[derive(Debug)]
pub struct Validated<T: Archive> {
    _heap: Arc<Heap>,
    root: *const T::Archived,
}

// SAFETY: a view of validated, sealed shared memory, read only.
unsafe impl<T: Archive> Send for Validated<T> where T::Archived: Sync {}
// SAFETY: as above.
unsafe impl<T: Archive> Sync for Validated<T> where T::Archived: Sync {}

impl<T: Archive> Validated<T> {
    /// The archived value.
    pub fn get(&self) -> &T::Archived {
        // SAFETY: validated by bytecheck over bytes that are sealed: its
        // sender cannot change them while this lives (see the module docs
        // on what a seal binds).
        unsafe { &*self.root }
    }
}

/// An archive copied out of the heap, validated: this process's own.
#[derive(Debug)]
pub struct Copied<T: Archive> {
    bytes: AlignedVec,
    _of: PhantomData<fn() -> T>,
}

impl<T: Archive> Copied<T> {
    /// The archived value.
    pub fn get(&self) -> &T::Archived {
        // SAFETY: validated when copied, and private to this process since.
        unsafe { rkyv::access_unchecked::<T::Archived>(&self.bytes) }
    }
}

impl Heaps {
    /// The archive a sealed argument passes, validated in place: the
    /// seal verified first ([`Heap::verify_sealed`]), then every pointer
    /// in it checked.
    pub fn archived_sealed<T: Archive>(&self, bytes: &[u8]) -> Result<Validated<T>, HeapError>
    where
        T::Archived: Checkable,
    {
        let d = decode(bytes)?;
        let (heap, ptr) = self.place_raw(&d, type_tag::<T::Archived>(), ALIGN)?;
        heap.verify_sealed(d.seal, ptr, d.size)?;
        // SAFETY: in the heap's mapping (checked), sealed: it holds still.
        let b = unsafe { std::slice::from_raw_parts(ptr, d.size as usize) };
        let root = rkyv::access::<T::Archived, RkyvError>(b)
            .map_err(|e| HeapError::Invalid(e.to_string()))?
            as *const T::Archived;
        Ok(Validated { _heap: heap, root })
    }

    /// The archive an argument passes, copied out of the heap (one copy of
    /// its bytes, no parse) and validated there.
    pub fn archived_copy<T: Archive>(&self, bytes: &[u8]) -> Result<Copied<T>, HeapError>
    where
        T::Archived: Checkable,
    {
        let d = decode(bytes)?;
        let (_heap, ptr) = self.place_raw(&d, type_tag::<T::Archived>(), ALIGN)?;
        let mut own = AlignedVec::<ALIGN>::with_capacity(d.size as usize);
        // SAFETY: in the heap's mapping (checked); copied once, whatever
        // its sender does meanwhile (the copy is what is validated).
        own.extend_from_slice(unsafe { std::slice::from_raw_parts(ptr, d.size as usize) });
        rkyv::access::<T::Archived, RkyvError>(&own)
            .map_err(|e| HeapError::Invalid(e.to_string()))?;
        Ok(Copied {
            bytes: own,
            _of: PhantomData,
        })
    }

    /// The archive an argument passes, not validated.
    ///
    /// # Safety
    /// Its sender must be trusted to have archived a `T` and to leave it
    /// be while the reference lives: only its place and type name were
    /// checked.
    pub unsafe fn archived_trusted<T: Archive>(
        &self,
        bytes: &[u8],
    ) -> Result<&T::Archived, HeapError>
    where
        T::Archived: Portable,
    {
        let d = decode(bytes)?;
        let (heap, ptr) = self.place_raw(&d, type_tag::<T::Archived>(), ALIGN)?;
        // SAFETY: in the heap's mapping (checked), kept open by this
        // `Heaps`; a valid archive by the caller's word.
        let b = unsafe { std::slice::from_raw_parts(ptr, d.size as usize) };
        drop(heap);
        // SAFETY: as above.
        Ok(unsafe { rkyv::access_unchecked::<T::Archived>(b) })
    }
}

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
        let h = Arc::new(heap);
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
        let h = Arc::new(Heap::open(pool, r)?);
        open.push(h.clone());
        Ok(h)
    }
}

/// A document for the fuzz target's archives.
#[derive(rkyv::Archive, rkyv::Serialize)]
struct FuzzDoc {
    id: u64,
    name: String,
    tags: Vec<String>,
    rows: Vec<Vec<u32>>,
}

/// Reads `data` as edits of valid arguments, as a peer could send them,
/// for the fuzz target `heap_arg` (and its corpus, replayed by the tests):
/// the first byte picks a plain or a sealed argument and the type asked
/// for, or an archive; then each pair of bytes sets one byte of the
/// argument (of the archive's bytes, for an archive). Whatever comes out
/// must be a typed error, or a value in bounds of the heap (an archive
/// whose every part reads).
#[doc(hidden)]
pub fn fuzz_arg(data: &[u8]) {
    use std::sync::OnceLock;
    struct Fixture {
        heaps: Heaps,
        heap: Arc<Heap>,
        plain: [u8; ARG_LEN],
        sealed: [u8; ARG_LEN],
        _scope: &'static crate::scope::Scope<'static>,
        /// An archive's argument, where its bytes are, and a copy of them.
        archive: ([u8; ARG_LEN], usize, Vec<u8>),
    }
    struct Shared(Fixture);
    // SAFETY: the fixture is built once and then only read; the heap's
    // memory is shared on purpose.
    unsafe impl Send for Shared {}
    // SAFETY: as above.
    unsafe impl Sync for Shared {}
    static FIXTURE: OnceLock<Shared> = OnceLock::new();
    let f = &FIXTURE
        .get_or_init(|| {
            let path = std::env::temp_dir().join(format!("dm-heap-fuzz-{}", std::process::id()));
            let _ = Pool::destroy(&path);
            let cfg = dm_pool::PoolConfig {
                size: 16 << 20,
                ..Default::default()
            };
            let pool = Pool::open_or_create(&path, &cfg, Default::default()).expect("a pool");
            // (Mapped, it needs no name: nothing is left behind.)
            let _ = std::fs::remove_file(&path);
            let heaps = Heaps::new(&pool);
            let heap = heaps.add(Heap::create(&pool, 1 << 20).expect("a heap"));
            let v: &[u64; 4] = heap.put([1, 2, 3, 4]).expect("room");
            let plain = heap.arg(v).expect("an argument");
            // (Leaked: the fixture lives as long as the process.)
            let scope: &'static crate::scope::Scope<'static> = Box::leak(Box::new(
                // SAFETY: the heap lives in the fixture, for the process.
                unsafe { &*Arc::as_ptr(&heap) }
                    .scope(4096)
                    .expect("a scope"),
            ));
            let w = scope.put([5u64, 6, 7, 8]).expect("room");
            let seal = scope.seal().expect("a seal");
            let sealed = heap.sealed_arg(w, &seal).expect("an argument");
            std::mem::forget(seal);
            let d = FuzzDoc {
                id: 7,
                name: "doc".into(),
                tags: vec!["a".into(), "bc".into(), "a longer tag than inline".into()],
                rows: (0..6).map(|i| (0..i).collect()).collect(),
            };
            let a = heap.archive(&d).expect("an archive");
            let a_arg = heap.archive_arg(&a).expect("an argument");
            let at = decode(&a_arg).expect("its own argument").off as usize;
            // SAFETY: the archive's bytes, just written.
            let pristine =
                unsafe { std::slice::from_raw_parts(heap.base().add(at), a.len()) }.to_vec();
            Shared(Fixture {
                heaps,
                heap,
                plain,
                sealed,
                _scope: scope,
                archive: (a_arg, at, pristine),
            })
        })
        .0;
    let Some((&mode, edits)) = data.split_first() else {
        return;
    };
    if (mode >> 1) % 6 == 5 {
        // A document's archive, edited, read through checked views.
        static DOC: OnceLock<Vec<u8>> = OnceLock::new();
        let pristine = DOC.get_or_init(|| {
            let d = crate::document::Value::List(vec![
                crate::document::Value::Map(
                    [
                        (
                            "title".to_string(),
                            crate::document::Value::Str("a doc".repeat(9)),
                        ),
                        ("n".to_string(), crate::document::Value::Int(7)),
                        (
                            "raw".to_string(),
                            crate::document::Value::Bytes(vec![1; 40]),
                        ),
                    ]
                    .into_iter()
                    .collect(),
                ),
                crate::document::Value::Float(0.5),
                crate::document::Value::Bool(true),
            ]);
            rkyv::to_bytes::<rkyv::rancor::Failure>(&d)
                .expect("a document archives")
                .to_vec()
        });
        let mut b = rkyv::util::AlignedVec::<16>::new();
        b.extend_from_slice(pristine);
        for e in edits.chunks(2) {
            if let [p, v] = e {
                let at = usize::from(*p) % b.len();
                b[at] = *v;
            }
        }
        if let Ok(r) = crate::view::DocView::root(&b) {
            std::hint::black_box(crate::view::read_all(r, 0));
        }
        return;
    }
    if (mode >> 1) % 6 == 4 {
        // An archive, its bytes edited in the heap, validated (copied).
        let (arg, at, pristine) = &f.archive;
        // SAFETY: the fixture's archive, in its heap, this process's own
        // (the fuzzer runs one input at a time).
        let b = unsafe { std::slice::from_raw_parts_mut(f.heap.base().add(*at), pristine.len()) };
        b.copy_from_slice(pristine);
        for e in edits.chunks(2) {
            if let [p, v] = e {
                b[usize::from(*p) % pristine.len()] = *v;
            }
        }
        if let Ok(c) = f.heaps.archived_copy::<FuzzDoc>(arg) {
            let d = c.get();
            let n: usize = d.name.len()
                + d.tags.iter().map(|t| t.len()).sum::<usize>()
                + d.rows
                    .iter()
                    .map(|r| r.iter().map(|x| x.to_native() as usize).sum::<usize>())
                    .sum::<usize>();
            std::hint::black_box((d.id, n));
        }
        return;
    }
    let mut b = if mode & 1 == 0 { f.plain } else { f.sealed };
    let mut len = ARG_LEN;
    for e in edits.chunks(2) {
        match e {
            [255, n] => len = usize::from(*n).min(ARG_LEN),
            [at, v] => b[usize::from(*at) % ARG_LEN] = *v,
            _ => {}
        }
    }
    let b = &b[..len];
    let (base, end) = (f.heap.base() as u64, f.heap.base() as u64 + f.heap.len());
    let check = |p: *const u8, size: usize| {
        let a = p as u64;
        assert!(
            a >= base + HEADER_LEN && a + size as u64 <= end,
            "a value outside its heap"
        );
    };
    match (mode >> 1) % 6 {
        0 => {
            if let Ok(a) = f.heaps.arg::<[u64; 4]>(b) {
                check(a.as_ptr().cast(), 32);
            }
        }
        1 => {
            if let Ok(a) = f.heaps.sealed_arg::<[u64; 4]>(b) {
                check(a.as_ptr().cast(), 32);
            }
        }
        2 => {
            if let Ok(a) = f.heaps.arg::<u8>(b) {
                check(a.as_ptr(), 1);
            }
        }
        _ => {
            if let Ok(a) = f.heaps.arg::<[u64; 512]>(b) {
                check(a.as_ptr().cast(), 4096);
            }
        }
    }
}

//! # dm-heap — shared heaps: pool memory at one address in every process
//!
//! A [`Heap`] is a buffer of the pool mapped at the same virtual address
//! in every process that opens it, so native pointers inside it are
//! valid everywhere: a tree, a map or a document built in it crosses
//! processes with no serialization (RPCool's shared heaps).
//!
//! ```
//! use dm_pool::{Pool, PoolConfig};
//! use dm_heap::{Heap, HeapMap, HeapVec};
//! let path = std::env::temp_dir().join(format!("heap-doc-{}.pool", std::process::id()));
//! Pool::create(&path, &PoolConfig { size: 32 << 20, ..Default::default() })?;
//! let pool = Pool::open(&path, Default::default())?;
//!
//! let heap = Heap::create(&pool, 1 << 20)?;
//! let mut m = HeapMap::with_capacity_and_hasher_in(8, Default::default(), heap.alloc());
//! let mut v = HeapVec::new_in(heap.alloc());
//! v.extend([1u32, 2, 3]);
//! m.insert(7u64, v);
//! let m = heap.put(m)?;                 // the map itself, in the heap
//! heap.set_root(m);
//! let shared = heap.share()?.to_bytes(); // 56 bytes to send anywhere
//!
//! // Another process opens it (`Heap::open(&pool, &HeapRef::from_bytes(..)?)`)
//! // at the same address, and reads the map in place:
//! // SAFETY: the root is a HeapMap<u64, HeapVec<u32>>, as set above.
//! let m: &HeapMap<u64, HeapVec<u32>> = unsafe { heap.root() }.unwrap();
//! assert_eq!(&m[&7][..], &[1, 2, 3]);
//! # pool.release_ref(dm_heap::HeapRef::from_bytes(&shared)?.pool_ref())?;
//! # drop(heap); drop(pool); Pool::destroy(&path)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! From the bottom up (no file imports one above it):
//!
//! * `header.rs` — the format of a heap's first page; `error.rs` — the
//!   errors; `lock.rs` — the heap's lock, which a dead holder does not
//!   keep; `open.rs` — the heaps open in this process;
//! * `alloc.rs` — the allocator inside a heap ([`HeapAlloc`]), which the
//!   collections of `allocator-api2` and `hashbrown` take;
//! * `seal.rs` — this process's seals: pages read-only to their sender
//!   while a call reads them;
//! * `heap.rs` — [`Heap`]: creating, sharing and opening heaps;
//! * `scope.rs` — scopes: a call's argument in pages of its own, to seal;
//! * `collections.rs` — the heap's collections ([`HeapVec`], [`HeapMap`],
//!   ...), and [`HeapString`] and [`HeapOrderedMap`], which the crates
//!   above do not have; `copy.rs` — deep copies into a heap
//!   and out of one ([`Heap::copy_from`], [`CopyFrom`]); `document.rs` — [`Value`], a document
//!   that describes itself, for readers that know no Rust type (Python);
//! * `arg.rs` — a value in a heap as a call's argument (96 bytes), and
//!   the receiver's side ([`Heaps`]), which reads it in place;
//! * `archive.rs` — validated access: `rkyv` archives in a heap, checked
//!   by `bytecheck` before a receiver that does not trust their sender
//!   reads them;
//! * `view.rs` — checked views of documents: each node checked when a
//!   reader reaches it, for receivers that read a few fields;
//! * `channel.rs` — heaps of a connection and of a service: a client's
//!   [`HeapChannel`] brings a heap of its own, and a [`HeapService`]
//!   takes each connection's arguments from its heap and its shared one;
//! * `fuzz.rs` — the fuzz target's reader of peer bytes ([`fuzz_arg`]).
//!
//! A heap lives while a process holds it open: each opening holds its
//! pages as a buffer of the pool, so leases, crash reclaim, quotas and
//! `pool check` cover it. What a process killed mid-way was building is
//! left in the heap unreachable, until the heap goes.

mod alloc;
mod archive;
mod arg;
mod channel;
mod collections;
mod copy;
mod document;
mod error;
mod fuzz;
mod header;
mod heap;
mod lock;
mod open;
mod scope;
mod seal;
mod view;

/// What the multi-process tests reach beneath the API; it is not API.
#[doc(hidden)]
pub mod testing {
    /// Takes `heap`'s lock and kills this process with `SIGKILL`, as a
    /// process killed mid-allocation would leave it.
    pub fn die_holding_lock(heap: &crate::Heap) -> ! {
        let held = crate::lock::lock(&heap.header().lock, Some(heap.pool()));
        std::mem::forget(held);
        // SAFETY: signals this process; nothing is touched after.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        std::process::abort()
    }
}

pub use alloc::HeapAlloc;
pub use archive::{Archivable, Checkable, Copied, HeapArchive, Validated};
pub use arg::{Arg, Heaps, ARG_LEN};
pub use channel::{HeapChannel, HeapService, ATTACH, DEFAULT_PRIVATE_MAX, SHARED};
pub use collections::{
    extend_copy, HeapBox, HeapHasher, HeapMap, HeapOrderedMap, HeapSet, HeapString, HeapVec,
};
pub use copy::CopyFrom;
pub use document::{ArchivedValue, Value};
pub use error::HeapError;
pub use fuzz::fuzz_arg;
pub use header::{HEAP_REF_LEN, HEAP_VERSION};
pub use heap::{Heap, HeapRef};
/// `rkyv`, whose archives are validated access's values.
pub use rkyv;
pub use scope::{Scope, ScopeAlloc};
pub use seal::{Seal, BATCH};
pub use view::{DocView, Kind, Viewed};

/// A vector whose memory is in a scope (an argument to seal).
pub type ScopeVec<'s, T> = allocator_api2::vec::Vec<T, ScopeAlloc<'s>>;
/// `allocator-api2`, whose collections take the heap's allocators.
pub use allocator_api2;

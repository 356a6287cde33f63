//! # dm-pool — pass-by-reference over a shared memory pool
//!
//! The pool backend of dmrpc's DM contract (`docs/design.md`): buffers in
//! a memory pool every attached process maps, small unforgeable [`Ref`]s that
//! name frozen snapshots of them, and page-granular copy-on-write that keeps
//! RPC's pass-by-value semantics.
//!
//! ```
//! use dm_pool::{Pool, PoolConfig, AttachOptions};
//! let path = std::env::temp_dir().join(format!("doc-{}.pool", std::process::id()));
//! Pool::create(&path, &PoolConfig { size: 8 << 20, ..Default::default() })?;
//! let pool = Pool::open(&path, AttachOptions::default())?;
//!
//! let mut buf = pool.alloc(10_000)?;
//! buf.write(0, b"hello")?;
//! let r = buf.share()?;                  // shared, no copy
//! let bytes = r.to_bytes();              // 40 bytes to put in any message
//!
//! // ... in another process: map the Ref and read it through the pool window
//! let mut seen = pool.map_ref(&dm_pool::Ref::from_bytes(&bytes)?)?;
//! buf.write(0, b"HELLO")?;               // the writer copies its page first
//! assert_eq!(&seen.to_vec()?[..5], b"hello");
//! seen.write(0, b"J")?;                  // and so does every other holder
//! assert_eq!(&seen.to_vec()?[..5], b"Jello");
//! pool.release_ref(&r)?;
//! drop((buf, seen));
//! assert!(pool.check().ok());
//! # drop(pool); std::fs::remove_file(&path)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Where things are, from the bottom up (every module is private; what a
//! user needs is re-exported here):
//!
//! * `sync.rs` — the atomics, swapped for loom's in the models;
//! * `pages.rs` — counts pages: the page table, its locks and the free set;
//! * `desc.rs` — buffer and Ref records; `slot.rs` — processes and leases;
//! * `refs.rs` — the Ref encoding; `error.rs` — the error type;
//! * `layout.rs` — the file format, which depends on nothing above it;
//! * `shm.rs` — the mapped pool, its areas by offset;
//! * `process.rs` — this process's attachment (slot, lease, descriptor
//!   claims); `reclaim.rs` — crash-exact share changes, and reclaiming what
//!   the dead and the expired hold; `page_cache.rs` — a process's pages;
//! * `pool/` — [`Pool`]: attach, buffers, Refs, copy-on-write;
//! * `mapped.rs` — [`MappedBuffer`], plain loads and stores;
//!   `fixed.rs` — [`FixedMapping`], a buffer at one address in every
//!   process, with no copy-on-write (what shared heaps are made of);
//! * `check.rs` — the invariant and the counters; `admin.rs` — gc and
//!   queries of a pool by path;
//! * `registry.rs` — service names; `channel.rs` — the memory of the RPC
//!   layer's connections;
//! * `contract.rs` — the DM contract shared with memory servers.

#![cfg_attr(loom, allow(dead_code, unused_imports))]
// What is public is what the root re-exports: nothing else is `pub`.
#![warn(unreachable_pub)]

// The loom models (tests/loom.rs) drive the page table and the descriptor
// protocols directly: public only in those builds.
#[cfg(loom)]
pub mod desc;
#[cfg(not(loom))]
#[allow(unreachable_pub)]
pub(crate) mod desc;
#[cfg(loom)]
pub mod expiry;
#[cfg(not(loom))]
#[allow(unreachable_pub)]
pub(crate) mod expiry;
#[cfg(loom)]
pub mod pages;
#[cfg(not(loom))]
#[allow(unreachable_pub)]
pub(crate) mod pages;
mod refs;
mod slot;
mod sync;

#[cfg(not(loom))]
mod admin;
#[cfg(not(loom))]
pub mod auth;
#[cfg(not(loom))]
mod channel;
#[cfg(not(loom))]
mod check;
#[cfg(not(loom))]
#[doc(hidden)]
pub mod conformance;
#[cfg(not(loom))]
mod contract;
#[cfg(not(loom))]
mod error;
#[cfg(not(loom))]
mod fixed;
#[cfg(not(loom))]
#[doc(hidden)]
pub mod fuzzing;
#[cfg(not(loom))]
mod layout;
#[cfg(not(loom))]
mod mapped;
#[cfg(not(loom))]
pub mod namespace;
#[cfg(not(loom))]
mod page_cache;
#[cfg(not(loom))]
mod pool;
#[cfg(not(loom))]
mod process;
#[cfg(not(loom))]
mod progress;
#[cfg(not(loom))]
mod quota;
#[cfg(not(loom))]
mod reclaim;
#[cfg(not(loom))]
mod registry;
#[cfg(not(loom))]
mod shm;
#[cfg(not(loom))]
#[doc(hidden)]
pub mod testing;

#[cfg(not(loom))]
pub use admin::{
    gc_path, gc_path_progress, gc_path_with, layout_of, ref_clock_is_ours, services_at,
};
#[cfg(not(loom))]
pub use channel::{ChannelId, ChannelMemory, Closing, Peer, Side};
#[cfg(not(loom))]
pub use check::{check_path, check_path_with, counters_of, CheckReport, Counters, QuotaUse};
#[cfg(not(loom))]
pub use contract::{Dm, DmBuffer, Usage};
#[cfg(not(loom))]
pub use error::{check_range, Error, Result};
#[cfg(not(loom))]
pub use fixed::FixedMapping;
#[cfg(not(loom))]
pub use layout::{
    Layout, ParseError, PoolConfig, RefClock, EXPIRY_GROUP, MAX_RING, MAX_TENANTS, MIN_RING,
    POOL_VERSION, TENANT_NAME_MAX,
};
#[cfg(not(loom))]
pub use mapped::MappedBuffer;
#[cfg(not(loom))]
pub use pool::{default_path, AttachOptions, Buffer, BufferId, Pool};
#[cfg(not(loom))]
pub use progress::Progress;
#[cfg(not(loom))]
pub use reclaim::GcReport;
pub use refs::{Ref, RefDecodeError, BACKEND_MEMSERVER, BACKEND_POOL, REF_VERSION};
#[cfg(not(loom))]
pub use registry::{
    validate_name as validate_service_name, Endpoint, Protocol, ServiceInfo, NAME_MAX,
};

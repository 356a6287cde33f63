//! # dm-pool — pass-by-reference over a shared memory pool
//!
//! The pool backend of dmrpc's DM contract (DESIGN.md section 3): buffers in
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
//! let r = buf.share()?;                  // +1 share per page, no copy
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
//! Layout: [`pages`] counts pages (the page table and free set), [`desc`] holds
//! buffer and Ref records, [`slot`] leases, [`layout`] the file format,
//! [`refs`] the Ref encoding, [`pool`] the operations, [`check`] the
//! invariant and gc, [`mapped`] transparent load/store buffers, [`registry`]
//! the service names and [`channel`] the per-connection memory of the RPC
//! layer.

#![cfg_attr(loom, allow(dead_code, unused_imports))]

pub mod desc;
pub mod pages;
pub mod refs;
pub mod slot;
pub mod sync;

#[cfg(not(loom))]
pub mod channel;
#[cfg(not(loom))]
pub mod check;
#[cfg(not(loom))]
#[doc(hidden)]
pub mod conformance;
#[cfg(not(loom))]
pub mod contract;
#[cfg(not(loom))]
pub mod error;
#[cfg(not(loom))]
#[doc(hidden)]
pub mod fuzzing;
#[cfg(not(loom))]
pub mod layout;
#[cfg(not(loom))]
pub mod mapped;
#[cfg(not(loom))]
mod page_cache;
#[cfg(not(loom))]
pub mod pool;
#[cfg(not(loom))]
mod reclaim;
#[cfg(not(loom))]
pub mod registry;
#[cfg(not(loom))]
pub mod shm;
#[cfg(not(loom))]
#[doc(hidden)]
pub mod testing;

#[cfg(not(loom))]
pub use channel::{ChannelId, ChannelMemory, Closing, Peer, Side};
#[cfg(not(loom))]
pub use check::{
    check_path, counters_of, gc_path, layout_of, ref_clock_is_ours, CheckReport, Counters, GcReport,
};
#[cfg(not(loom))]
pub use contract::{Dm, DmBuffer, Usage};
#[cfg(not(loom))]
pub use error::{Error, Result};
#[cfg(not(loom))]
pub use layout::{Layout, PoolConfig, RefClock, POOL_VERSION};
#[cfg(not(loom))]
pub use mapped::MappedBuffer;
#[cfg(not(loom))]
pub use pool::{default_path, AttachOptions, Buffer, BufferId, Pool};
pub use refs::{Ref, RefDecodeError};
#[cfg(not(loom))]
pub use registry::{Endpoint, ServiceInfo};

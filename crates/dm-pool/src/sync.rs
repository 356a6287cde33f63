//! The one place atomics come from, so that the lock-free protocols can be
//! model-checked with loom (`RUSTFLAGS="--cfg loom" cargo test -p dm-pool --test loom`).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

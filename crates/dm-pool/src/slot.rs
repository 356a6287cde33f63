//! Slots: one record per attached process, with its lease.
//!
//! The state word packs `incarnation (32) | kind (8) | reclaimer (16)`. A
//! process takes a `Free` slot with a CAS (bumping the incarnation), renews
//! its heartbeat from a background thread, and frees the slot on detach.
//! The heartbeat is kept on two clocks: the host's monotonic clock, by
//! which processes on the same host judge it (it never steps), and the
//! wall clock, by which other hosts sharing the pool judge it.
//! A slot whose heartbeat is older than its lease is dead: any live process
//! (or `dmrpc pool gc`) CASes it to `Reclaiming` and releases everything the
//! pool records as its holdings (descriptors it owns, pages cached by it).

use crate::sync::{AtomicU32, AtomicU64};

/// Size of a slot record in the pool.
pub(crate) const SLOT_SIZE: usize = 128;

/// Slot kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SlotKind {
    /// Unused.
    Free,
    /// Attached.
    Live,
    /// Dead, being reclaimed by the slot in `reclaimer`.
    Reclaiming,
}

/// Decoded slot state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotState {
    /// Bumped on every attach.
    pub incarnation: u32,
    /// Kind (None for an impossible value).
    pub kind: Option<SlotKind>,
    /// Reclaiming slot index.
    pub reclaimer: u16,
}

impl SlotState {
    /// Decodes.
    pub(crate) fn decode(w: u64) -> Self {
        SlotState {
            incarnation: w as u32,
            kind: match (w >> 32) as u8 {
                0 => Some(SlotKind::Free),
                1 => Some(SlotKind::Live),
                2 => Some(SlotKind::Reclaiming),
                _ => None,
            },
            reclaimer: (w >> 40) as u16,
        }
    }

    /// Encodes.
    pub(crate) fn encode(incarnation: u32, kind: SlotKind, reclaimer: u16) -> u64 {
        let k = match kind {
            SlotKind::Free => 0u64,
            SlotKind::Live => 1,
            SlotKind::Reclaiming => 2,
        };
        incarnation as u64 | (k << 32) | ((reclaimer as u64) << 40)
    }
}

/// A slot as laid out in the pool.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct Slot {
    /// `incarnation | kind | reclaimer`.
    pub state: AtomicU64,
    /// Last renewal, ms since the epoch (wall clock): how another host
    /// judges the lease.
    pub heartbeat_ms: AtomicU64,
    /// Lease length, ms.
    pub lease_ms: AtomicU64,
    /// Attach time, ms since the epoch.
    pub attached_ms: AtomicU64,
    /// Hash of the host's boot id (pid checks are only meaningful on the same host).
    pub host: AtomicU64,
    /// Process id.
    pub pid: AtomicU32,
    _pad: AtomicU32,
    /// Process name, up to 32 bytes, NUL padded.
    pub name: [AtomicU64; 4],
    /// Last renewal, ms of the host's monotonic clock (since pool format
    /// 6): how processes on the same host (same boot id, `host`) judge
    /// the lease, so that a step of the wall clock makes no live process
    /// look dead.
    pub heartbeat_mono_ms: AtomicU64,
    /// The process's PID namespace ([`dm_sys::proc::pid_namespace`]; in
    /// words reserved before pool format 7 had them, so 0 in slots
    /// written by older builds, and for an attach judged by its lease
    /// alone). A process of this host and namespace is judged by its pid
    /// and start time, never by its lease.
    pub pid_ns: AtomicU64,
    /// When the process started, in clock ticks since boot
    /// ([`dm_sys::proc::start_time`]; 0: unknown).
    pub start: AtomicU64,
    /// Pages of the buffers this process holds, counted against its
    /// quota and its tenant's (`quota.rs`; in words reserved before, so 0
    /// in slots of builds without quotas).
    pub held_pages: AtomicU64,
    /// Its quota in pages (0: none).
    pub quota_pages: AtomicU64,
    /// Its tenant: index + 1 in the pool's tenant table (0: none).
    pub tenant: AtomicU64,
}

/// The time a lease is judged at, on both clocks a heartbeat records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LeaseNow {
    /// Wall clock, ms since the epoch ([`dm_sys::time::now_ms`]).
    pub wall_ms: u64,
    /// This host's monotonic clock, ms ([`dm_sys::time::monotonic_ms`]).
    pub mono_ms: u64,
}

#[cfg(not(loom))]
impl LeaseNow {
    /// Reads both clocks.
    pub(crate) fn read() -> Self {
        LeaseNow {
            wall_ms: dm_sys::time::now_ms(),
            mono_ms: dm_sys::time::monotonic_ms(),
        }
    }
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Slot>() == SLOT_SIZE);

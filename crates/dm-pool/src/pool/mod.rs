//! The pool backend: a process's handle on a pool ([`Pool`]), and what it
//! does with it.
//!
//! Data is reached through *the pool window*: every attached process maps the
//! whole pool once, so reading a buffer or a mapped Ref is pointer arithmetic
//! (no syscall, no per-call page-table work). Writes go through [`Buffer::write`],
//! which copies a page first when its reference count is above one.
//!
//! * this file: create, open and destroy a pool; allocate and free buffers;
//! * `attach.rs`: attaching (a slot), the lease thread, the process's page
//!   cache and descriptor claims;
//! * `share.rs`: Ref operations (create, seal in place, map, release);
//! * `buffer.rs`: [`Buffer`], its reads and its copy-on-write writes.

mod attach;
mod buffer;
mod share;

pub use attach::AttachOptions;
pub(crate) use attach::Inner;
pub use buffer::{Buffer, BufferId};
pub(crate) use share::stop_before_noting;

use crate::desc::{DescState, Kind, END_ABORTED, END_RELEASED};
use crate::error::{Error, Result};
use crate::layout::{Layout, PoolConfig};
use crate::shm::Shm;
use crate::sync::Ordering;
use dm_sys::mem::{Access, SharedFile};
use dm_sys::time::now_ms;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where a named pool lives by default.
pub fn default_path(name: &str) -> PathBuf {
    if name.contains('/') {
        PathBuf::from(name)
    } else {
        PathBuf::from(format!("/dev/shm/dmrpc-{name}.pool"))
    }
}

/// An attached pool. Cheap to clone; the slot is released when the last
/// clone and every buffer of it are dropped.
#[derive(Debug, Clone)]
pub struct Pool {
    pub(crate) inner: Arc<Inner>,
}

impl Pool {
    /// Creates a pool at `path` (a file that must not exist, or a DAX/char
    /// device that is overwritten) with `cfg`. Does not attach. A path
    /// `DEVICE/NAME`, where DEVICE holds a segment table, creates
    /// namespace NAME there ([`crate::namespace::create`]).
    pub fn create(path: &Path, cfg: &PoolConfig) -> Result<()> {
        if let Some((device, name)) = crate::namespace::split(path) {
            return crate::namespace::create(&device, &name, cfg).map(drop);
        }
        let layout = Layout::compute(cfg, dm_sys::rand::random_u64(), now_ms())
            .map_err(Error::InvalidConfig)?;
        let access = if cfg.group {
            Access::Group
        } else {
            Access::Own
        };
        let file = if SharedFile::is_device(path) {
            SharedFile::open(path, Some(layout.total_len), access)?
        } else {
            let f = match SharedFile::create(path, layout.total_len, access) {
                Err(dm_sys::mem::SysError::Exists(p)) => return Err(Error::AlreadyExists(p)),
                r => r?,
            };
            if let Err(e) = crate::shm::prepare_backing(&f, &layout, cfg) {
                drop(f);
                let _ = dm_sys::mem::unlink(path);
                return Err(e);
            }
            f
        };
        Shm::init(file, layout, cfg);
        Ok(())
    }

    /// Attaches to the pool at `path`.
    pub fn open(path: &Path, opts: AttachOptions) -> Result<Pool> {
        let access = if opts.group {
            Access::Group
        } else {
            Access::Own
        };
        let shm = Shm::open(path, access)?;
        Self::attach(shm, opts)
    }

    /// Attaches to the pool of namespace `name` of `device`
    /// ([`crate::namespace`]): the same as [`open`](Self::open) with the
    /// path `DEVICE/NAME`.
    pub fn open_namespace(device: &Path, name: &str, opts: AttachOptions) -> Result<Pool> {
        if !crate::namespace::valid_name(name) {
            return Err(Error::InvalidArgument(format!(
                "{name:?} is not a namespace name"
            )));
        }
        let path = crate::namespace::path(device, name);
        if crate::namespace::split(&path).is_none() {
            return Err(Error::NoNamespace {
                device: device.to_owned(),
                name: name.to_owned(),
                why: " (it is not a file or device that holds namespaces)".into(),
            });
        }
        Self::open(&path, opts)
    }

    /// Attaches to the pool at `path`, creating it with `cfg` if it does not exist.
    pub fn open_or_create(path: &Path, cfg: &PoolConfig, opts: AttachOptions) -> Result<Pool> {
        match Self::create(path, cfg) {
            Ok(()) | Err(Error::AlreadyExists(_)) => Self::open(path, opts),
            Err(e) => Err(e),
        }
    }

    /// Destroys the pool at `path`: removes its backing file, or, on a
    /// device (DAX), erases its header so that nothing opens it as a pool
    /// (the device node itself is never removed). Attached processes keep
    /// their mappings until they detach. A namespace (`DEVICE/NAME`) is
    /// removed from its device, and refused while processes are attached
    /// ([`crate::namespace::remove`]).
    pub fn destroy(path: &Path) -> Result<()> {
        if let Some((device, name)) = crate::namespace::split(path) {
            return crate::namespace::remove(&device, &name);
        }
        let shm = Shm::open(path, Access::Group)?;
        if SharedFile::is_device(path) {
            shm.erase_header();
            return Ok(());
        }
        drop(shm);
        dm_sys::mem::unlink(path)?;
        Ok(())
    }

    /// The pool's layout (page size, counts, id).
    pub fn layout(&self) -> &Layout {
        &self.inner.shm.layout
    }

    /// The pool id carried by every Ref of this pool.
    pub fn id(&self) -> u64 {
        self.inner.shm.layout.pool_id
    }

    /// The page size.
    pub fn page_size(&self) -> usize {
        self.inner.shm.layout.page_size as usize
    }

    /// Largest buffer this pool can hold.
    pub fn max_len(&self) -> u64 {
        self.inner.shm.layout.max_len()
    }

    /// This process's slot index.
    pub fn slot(&self) -> u16 {
        self.inner.slot
    }

    /// This process's attachment, as a word that names it for as long as
    /// it lasts: its slot and the slot's incarnation (bumped by every
    /// attach). See [`is_attached`](Self::is_attached).
    pub fn attachment(&self) -> u64 {
        (u64::from(self.inner.slot) << 32) | u64::from(self.inner.incarnation)
    }

    /// Whether the attachment named by `who` (another process's
    /// [`attachment`](Self::attachment)) is still attached: false once it
    /// detached, or was found dead and reclaimed. What a process records
    /// in shared memory as its own (a lock it holds) is someone else's to
    /// take over once this says false.
    pub fn is_attached(&self, who: u64) -> bool {
        let Ok(slot) = u16::try_from(who >> 32) else {
            return false;
        };
        self.inner.shm.slot(slot).is_some_and(|s| {
            s.state.load(crate::sync::Ordering::Acquire)
                == crate::slot::SlotState::encode(who as u32, crate::slot::SlotKind::Live, 0)
        })
    }

    /// Backing path.
    pub fn path(&self) -> &Path {
        self.inner.shm.path()
    }

    pub(crate) fn shm(&self) -> &Shm {
        &self.inner.shm
    }

    /// Renews this process's lease now (the background thread does this
    /// when `heartbeat` is on).
    pub fn renew(&self) -> Result<()> {
        self.inner.renew()
    }

    /// A key only processes that can read this pool know: 32 random bytes
    /// written at its creation, for proving to a peer (over TCP, say) that
    /// this process is attached to the same pool. None in a pool created
    /// before pools had one.
    pub fn secret(&self) -> Option<[u8; 32]> {
        Some(self.shm().secret()).filter(|s| s.iter().any(|&b| b != 0))
    }

    /// Reserves a zero-filled buffer of `len` bytes. Pages are backed lazily
    /// on first write, so this costs no page work.
    pub fn alloc(&self, len: u64) -> Result<Buffer> {
        let i = &self.inner;
        i.live()?;
        if len == 0 {
            return Err(Error::ZeroLength);
        }
        if len > self.max_len() {
            return Err(Error::TooLarge {
                len,
                max: self.max_len(),
            });
        }
        let n = len.div_ceil(self.page_size() as u64) as usize;
        i.charge(n as u64)?;
        let (idx, gen) = i
            .claim_desc(Kind::Buf)
            .inspect_err(|_| i.uncharge(n as u64))?;
        // (From here a drop of the descriptor gives the charge back.)
        let d = i.desc(idx)?;
        if let Err(e) = i.attach_lists(d, n, true) {
            // (Its n_pages is not set yet: the drop gives back nothing.)
            i.uncharge(n as u64);
            i.drop_own(idx, gen, Kind::Buf, END_ABORTED)?;
            return Err(e);
        }
        d.len.store(len, Ordering::Relaxed);
        d.offset.store(0, Ordering::Relaxed);
        d.n_pages.store(n as u32, Ordering::Release);
        Ok(Buffer {
            pool: self.clone(),
            desc: idx,
            generation: gen,
            len,
            offset: 0,
            n_pages: n as u32,
            detached: false,
            mapped: false,
        })
    }

    /// Frees a buffer (dropping it does the same, ignoring errors).
    pub fn free(&self, mut buf: Buffer) -> Result<()> {
        let id = buf.id();
        buf.detached = true;
        drop(buf);
        self.free_id(id)
    }

    /// Frees a buffer by id: the form used across FFI, where a double free
    /// is possible and is reported as [`Error::DoubleFree`].
    pub fn free_id(&self, id: BufferId) -> Result<()> {
        let i = &self.inner;
        i.live()?;
        if id.pool_id != self.id() {
            return Err(Error::ForeignPool {
                expected: self.id(),
                found: id.pool_id,
            });
        }
        let d = i.desc(id.desc)?;
        let st = DescState::decode(d.state.load(Ordering::Acquire));
        if st.generation != id.generation || st.kind != Some(Kind::Buf) {
            if st.generation == id.generation || st.kind == Some(Kind::Free) {
                return Err(Error::DoubleFree {
                    desc: id.desc,
                    generation: id.generation,
                });
            }
            return Err(Error::NotOwner { desc: id.desc });
        }
        if st.owner != i.slot {
            return Err(Error::NotOwner { desc: id.desc });
        }
        i.drop_own(id.desc, id.generation, Kind::Buf, END_RELEASED)
    }

    /// Takes the id of a buffer and forgets the handle (for FFI). The buffer
    /// stays allocated until [`free_id`](Self::free_id) or detach.
    pub fn into_id(&self, mut buf: Buffer) -> BufferId {
        buf.detached = true;
        buf.id()
    }

    /// Reclaims dead slots and expired Refs now (the heartbeat thread does
    /// this every lease period). Expired Refs are found through the
    /// pool's expiry summary: only groups of descriptors holding a Ref
    /// due are read. Returns what was reclaimed.
    pub fn maintain(&self) -> Result<crate::reclaim::GcReport> {
        crate::progress::Pass::quiet(|p| self.inner.maintain_local(false, p))
    }

    /// Consistency check of the whole pool (`check.rs`: the invariant, [`CheckReport`](crate::CheckReport)).
    pub fn check(&self) -> crate::check::CheckReport {
        crate::check::check(&self.inner.shm)
    }

    /// The pool's lifetime counters (CoW copies, Refs created, ...).
    pub fn counters(&self) -> crate::check::Counters {
        crate::check::counters(&self.inner.shm)
    }

    /// Pages currently in this process's page cache.
    pub fn cached_pages(&self) -> usize {
        self.inner.cache.lock().map(|f| f.len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::RefClock;
    use crate::shm::host_id;
    use crate::slot::{SlotKind, SlotState};
    use crate::testing::TempPool;
    use std::time::Duration;

    /// A process of this host and PID namespace is judged by its pid and
    /// start time, never by its lease; a process of another PID namespace
    /// (whose pid means nothing here) by its lease alone.
    #[test]
    fn this_namespace_is_judged_by_the_process_another_by_the_lease() {
        use crate::slot::LeaseNow;
        use crate::sync::Ordering;
        let tp = TempPool::new(16 << 20);
        let watcher = tp.attach();
        let watched = tp.attach_with(crate::AttachOptions {
            heartbeat: false,
            lease_ms: Some(100),
            ..Default::default()
        });
        let shm = watcher.shm();
        let s = watched.slot();
        let slot = shm.slot(s).unwrap();
        let now = LeaseNow::read();
        assert_eq!(
            slot.pid_ns.load(Ordering::Relaxed),
            dm_sys::proc::pid_namespace()
        );
        // Long past its lease, and alive: live.
        slot.heartbeat_mono_ms
            .store(now.mono_ms - 10_000, Ordering::Release);
        assert!(shm.slot_live(s, LeaseNow::read()));
        // The same pid started at another time is another process: gone.
        let start = slot.start.load(Ordering::Relaxed);
        slot.start.store(start + 1, Ordering::Relaxed);
        assert!(!shm.slot_live(s, LeaseNow::read()));
        slot.start.store(start, Ordering::Relaxed);
        // Another PID namespace, with a pid no process here has: the lease
        // decides, live while it is renewed.
        let (pid, ns) = (
            slot.pid.load(Ordering::Relaxed),
            slot.pid_ns.load(Ordering::Relaxed),
        );
        slot.pid_ns.store(ns ^ 1, Ordering::Relaxed);
        slot.pid.store(0x3fff_fff0, Ordering::Relaxed);
        slot.heartbeat_mono_ms
            .store(LeaseNow::read().mono_ms, Ordering::Release);
        assert!(
            shm.slot_live(s, LeaseNow::read()),
            "judged dead by a foreign pid"
        );
        slot.heartbeat_mono_ms
            .store(now.mono_ms - 10_000, Ordering::Release);
        assert!(!shm.slot_live(s, LeaseNow::read()), "its lease ran out");
        slot.pid_ns.store(ns, Ordering::Relaxed);
        slot.pid.store(pid, Ordering::Relaxed);
        drop((watched, watcher));
        tp.assert_clean();
    }

    /// A step of the wall clock makes no live process of this host look
    /// dead (its lease is judged by the monotonic clock); a process whose
    /// monotonic heartbeat is older than its lease is dead whatever its
    /// wall-clock heartbeat says; another host's slot is judged by the
    /// wall clock.
    #[test]
    fn a_wall_clock_step_kills_no_live_process_of_this_host() {
        use crate::slot::LeaseNow;
        use crate::sync::Ordering;
        let tp = TempPool::new(16 << 20);
        let watcher = tp.attach();
        let lease = 200u64;
        let watched = tp.attach_with(crate::AttachOptions {
            heartbeat: false,
            lease_only: true,
            lease_ms: Some(lease),
            ..Default::default()
        });
        let buf = watched.alloc(4096).unwrap();
        let shm = watcher.shm();
        let s = watched.slot();
        let slot = shm.slot(s).unwrap();
        let now = LeaseNow::read();
        // The wall clock jumped an hour forward since the last renewal.
        slot.heartbeat_ms
            .store(now.wall_ms - 3_600_000, Ordering::Release);
        assert!(shm.slot_live(s, LeaseNow::read()));
        assert_eq!(watcher.maintain().unwrap().slots_reclaimed, 0);
        assert_eq!(crate::check_path(&tp.path, false).unwrap().slots_dead, 0);
        assert!(
            watched.inner.live().is_ok(),
            "its holdings are still its own"
        );
        // Seen from another host, only the wall clock is shared.
        let host = slot.host.load(Ordering::Relaxed);
        slot.host.store(host ^ 1, Ordering::Relaxed);
        assert!(!shm.slot_live(s, LeaseNow::read()));
        slot.host.store(host, Ordering::Relaxed);
        // A process that stopped renewing for longer than its lease (and
        // the pool's quarantine) is dead even if its wall-clock heartbeat
        // (stepped back) looks new.
        slot.heartbeat_ms
            .store(now.wall_ms + 3_600_000, Ordering::Release);
        let quarantine = crate::PoolConfig::default().quarantine_ms;
        slot.heartbeat_mono_ms.store(
            now.mono_ms.saturating_sub(2 * lease + quarantine),
            Ordering::Release,
        );
        assert!(!shm.slot_live(s, LeaseNow::read()));
        assert_eq!(watcher.maintain().unwrap().slots_reclaimed, 1);
        assert!(watched.inner.live().is_err(), "its lease is lost");
        drop(buf);
        drop(watched);
        drop(watcher);
        tp.assert_clean();
    }

    /// A Ref lives by the pool's Ref clock: by default the host's
    /// monotonic clock, which no step of the wall clock moves. (The
    /// monotonic clock counts from boot, so an expiry on it lies decades
    /// before the wall clock's now: judged by the wall clock, as before
    /// format 7, every such Ref would be expired.)
    #[test]
    fn a_ref_lives_by_the_pool_ref_clock() {
        use crate::slot::LeaseNow;
        use crate::sync::Ordering;
        for clock in [RefClock::Host, RefClock::Wall] {
            let tp = TempPool::with(PoolConfig {
                size: 16 << 20,
                ref_clock: clock,
                ..Default::default()
            });
            let pool = tp.attach();
            let buf = pool.alloc(4096).unwrap();
            let before = LeaseNow::read();
            let r = pool
                .create_ref_ttl(&buf, 0, 4096, Duration::from_secs(60))
                .unwrap();
            let after = LeaseNow::read();
            let d = pool.shm().desc(r.desc).unwrap();
            let expiry = d.expiry_ms.load(Ordering::Relaxed);
            let (lo, hi) = match clock {
                RefClock::Host => (before.mono_ms, after.mono_ms),
                RefClock::Wall => (before.wall_ms, after.wall_ms),
            };
            // The coarse clock is up to a tick (a few ms) behind.
            assert!(
                (lo + 60_000 - 50..=hi + 60_000).contains(&expiry),
                "{clock:?}: expiry {expiry} not a minute after {lo}..{hi}"
            );
            let m = pool.map_ref(&r).unwrap();
            drop(m);
            assert_eq!(pool.maintain().unwrap().refs_expired, 0);
            // Its minute is over, on the pool's clock (the per-call check
            // reads it as of the last tick, a few ms behind).
            let past = pool.shm().ref_now(LeaseNow::read()) - 100;
            d.expiry_ms.store(past, Ordering::Relaxed);
            // Unnoted, the summary still says a minute on.
            assert_eq!(pool.maintain().unwrap().refs_expired, 0);
            pool.shm().note_expiry(r.desc, past);
            assert!(matches!(pool.map_ref(&r), Err(Error::RefExpired { .. })));
            assert_eq!(pool.maintain().unwrap().refs_expired, 1);
            drop(buf);
            drop(pool);
            tp.assert_clean();
        }
    }

    /// A host-clock pool belongs to one host's boot: another host is
    /// refused while a process of the owner lives, and takes the clock over
    /// (expiring the old boot's Refs) once none does — a pool on a file
    /// that outlived a reboot.
    #[test]
    fn a_host_clock_pool_is_taken_over_only_from_a_dead_boot() {
        use crate::slot::LeaseNow;
        use crate::sync::Ordering;
        let tp = TempPool::new(16 << 20);
        let old = tp.attach_with(crate::AttachOptions {
            heartbeat: false,
            ..Default::default()
        });
        let buf = old.alloc(4096).unwrap();
        let r = old.create_ref(&buf, 0, 4096).unwrap();
        let shm = old.shm();
        let me = host_id();
        assert_eq!(shm.atomics().ref_clock_host.load(Ordering::Relaxed), me);
        // Make `old` a process of another host (or boot) that owns the clock.
        let other = me ^ 0x5a5a;
        let slot = shm.slot(old.slot()).unwrap();
        slot.host.store(other, Ordering::Relaxed);
        shm.atomics().ref_clock_host.store(other, Ordering::Relaxed);
        assert!(!crate::ref_clock_is_ours(&tp.path).unwrap());
        let free_slots = || {
            (0..shm.layout.n_slots as u16)
                .filter(|&s| {
                    SlotState::decode(shm.slot(s).unwrap().state.load(Ordering::Relaxed)).kind
                        == Some(SlotKind::Free)
                })
                .count()
        };
        let free_before = free_slots();
        match Pool::open(&tp.path, crate::AttachOptions::default()) {
            Err(Error::RefClockInUse { host }) => assert_eq!(host, other),
            r => panic!("attached beside a live process of the clock's host: {r:?}"),
        }
        assert_eq!(
            free_slots(),
            free_before,
            "the refused attach gave its slot back"
        );
        assert_eq!(shm.atomics().maint.load(Ordering::Relaxed), 0);
        // The other host's process dies (its wall-clock lease runs out).
        slot.heartbeat_ms
            .store(LeaseNow::read().wall_ms - 3_600_000, Ordering::Release);
        let new = tp.attach();
        assert_eq!(shm.atomics().ref_clock_host.load(Ordering::Relaxed), me);
        assert!(crate::ref_clock_is_ours(&tp.path).unwrap());
        assert!(
            matches!(new.map_ref(&r), Err(Error::RefExpired { .. })),
            "a Ref of the old boot is expired, not alive for its old clock's time"
        );
        let rep = new.maintain().unwrap();
        assert_eq!((rep.slots_reclaimed, rep.refs_expired), (1, 1));
        drop(buf);
        drop(old);
        drop(new);
        tp.assert_clean();
    }

    #[test]
    fn a_freed_descriptor_is_claimed_again_first() {
        let tp = TempPool::new(16 << 20);
        let pool = tp.attach();
        let keep = pool.alloc(64).unwrap();
        let a = pool.alloc(64).unwrap();
        let desc = a.id().desc;
        pool.free(a).unwrap();
        // Not the next in line: the one just freed (warm in this core's
        // caches), with a new generation.
        let b = pool.alloc(64).unwrap();
        assert_eq!(b.id().desc, desc);
        let r = pool.create_ref(&b, 0, 64).unwrap();
        pool.release_ref(&r).unwrap();
        let c = pool.alloc(64).unwrap();
        assert_eq!(c.id().desc, r.desc, "the Ref's descriptor, freed last");
        drop((keep, b, c));
        drop(pool);
        tp.assert_clean();
    }

    /// Every descriptor shape gives a chunk containing the position asked
    /// for, up to its list slots (bulk changes walk chunk by chunk and
    /// must always advance): inline, with one level of lists and with two,
    /// reading through a Ref, and past the inline entries of a list-less
    /// descriptor. Its list slots name exactly its list pages.
    #[test]
    fn every_chunk_contains_its_position() {
        let tp = TempPool::new(256 << 20);
        let pool = tp.attach();
        let ps = pool.page_size() as u64;
        let per = pool.inner.shm.layout.per_list_page();
        let small = pool.alloc(3 * ps).unwrap();
        let mut long = pool.alloc(300 * ps).unwrap();
        long.write(0, &[1u8; 4096]).unwrap();
        // Past what one level of lists names: two levels.
        let huge_pages = (crate::desc::INLINE * per + 3 * per / 2) as u64;
        let mut huge = pool.alloc(huge_pages * ps).unwrap();
        huge.write((huge_pages - 1) * ps, &[2u8; 10]).unwrap();
        let r = pool.create_ref(&long, 0, long.len()).unwrap();
        let mapped = pool.map_ref(&r).unwrap();
        let shm = &pool.inner.shm;
        let mut lists = 0;
        for (b, want) in [(&small, 0), (&long, 1), (&mapped, 0), (&huge, 2)] {
            let d = pool.inner.desc(b.desc_index()).unwrap();
            let span = shm.list_span(d) as usize;
            assert_eq!(
                span,
                [
                    0,
                    crate::desc::INLINE,
                    crate::desc::INLINE * per + crate::desc::INLINE
                ][want]
            );
            for k in 0..b.page_count() as usize + crate::desc::INLINE + 5 {
                let (base, run, span) = shm.entry_chunk(d, k).unwrap();
                assert!(base <= k && k < base + span, "{k}: {base} + {span}");
                assert!(run.len() <= span);
            }
            let mut named = 0;
            for j in 0..span + 5 {
                let (base, run, len) = shm.list_chunk(d, j).unwrap();
                assert!(base <= j && j < base + len, "{j}: {base} + {len}");
                assert!(run.len() <= len);
                named += usize::from(
                    shm.list_slot(d, j)
                        .unwrap()
                        .is_some_and(|e| e.load(Ordering::Relaxed) != crate::pages::NO_PAGE),
                );
            }
            let (firsts, seconds) = shm.lists_needed(b.page_count() as usize);
            if want > 0 {
                assert_eq!(named, firsts + seconds, "{want} levels");
            }
            lists += named * usize::from(want > 0);
        }
        assert_eq!(
            shm.lists_needed(huge_pages as usize),
            (crate::desc::INLINE + 2, 1)
        );
        // The Ref of `long` shares its list: one list page for both.
        assert_eq!(pool.check().pages_lists as usize, lists);
        drop((small, mapped, long, huge));
        pool.release_ref(&r).unwrap();
        drop(pool);
        tp.assert_clean();
    }

    /// A descriptor flagged with two levels of lists in a pool whose pages
    /// are too large for them (no legitimate one is) is corrupt: the check
    /// says so and freeing it fails, with no hang and no panic.
    #[test]
    fn two_levels_of_lists_of_huge_pages_are_refused_as_corrupt() {
        let tp = TempPool::with(crate::PoolConfig {
            size: 2 << 30,
            page_size: 512 << 20,
            descs: Some(64),
            ..Default::default()
        });
        let pool = tp.attach();
        let mut b = pool.alloc(100).unwrap();
        b.write(0, b"x").unwrap();
        let d = pool.inner.desc(b.desc_index()).unwrap();
        d.flags.fetch_or(
            crate::desc::FLAG_INDIRECT | crate::desc::FLAG_TWO_LEVEL,
            Ordering::Release,
        );
        let rep = pool.check();
        assert!(
            rep.problems.iter().any(|p| p.contains("two levels")),
            "{:?}",
            rep.problems
        );
        assert!(matches!(pool.free(b), Err(Error::Corrupt(_))));
    }

    #[test]
    fn freed_pages_cool_before_reuse_and_come_back_in_order() {
        let tp = TempPool::new(16 << 20);
        for cool in [Some(0), None] {
            let pool = tp.attach_with(AttachOptions {
                cool_pages: cool,
                ..Default::default()
            });
            let ps = pool.page_size();
            let pages =
                |b: &crate::Buffer| -> Vec<u32> { (0..4).map(|k| b.page_at(k).unwrap()).collect() };
            let mut a = pool.alloc(4 * ps as u64).unwrap();
            a.write(0, &vec![1u8; 4 * ps]).unwrap();
            let first = pages(&a);
            // Something else takes pages in between, and is freed earlier.
            let mut other = pool.alloc(ps as u64).unwrap();
            other.write(0, &[2u8; 8]).unwrap();
            pool.free(other).unwrap();
            pool.free(a).unwrap();
            let mut b = pool.alloc(4 * ps as u64).unwrap();
            b.write(0, &vec![3u8; 4 * ps]).unwrap();
            if cool == Some(0) {
                // Nothing cools: the pages freed last come back first, in
                // their order.
                assert_eq!(pages(&b), first);
            } else {
                // They cool (page_cache.rs): b gets other pages, and a
                // page comes back only after `cool` others were freed.
                assert!(pages(&b).iter().all(|p| !first.contains(p)));
                let cool = pool.inner.cool;
                assert!(cool >= 64, "{cool}");
                let mut seen = std::collections::HashMap::new();
                for i in 0..cool {
                    let mut c = pool.alloc(4 * ps as u64).unwrap();
                    c.write(0, &vec![4u8; 4 * ps]).unwrap();
                    for p in pages(&c) {
                        if let Some(j) = seen.insert(p, i) {
                            assert!(i - j >= cool / 4, "page {p} back after {}", i - j);
                        }
                    }
                    pool.free(c).unwrap();
                }
                // (A whole write takes consecutive pages: now and then no
                // run of four has cooled, and it claims a fresh one.)
                assert!(
                    seen.len() < cool + cool / 16,
                    "{} pages for a cool of {cool}",
                    seen.len()
                );
            }
            let mut got = vec![0u8; 4 * ps];
            b.read(0, &mut got).unwrap();
            assert_eq!(got, vec![3u8; 4 * ps]);
            pool.free(b).unwrap();
            drop(pool);
            tp.assert_clean();
        }
    }

    #[test]
    fn pages_one_process_allocates_and_another_frees_stay_a_small_set() {
        // A client writes requests and a server drops their Refs last, so
        // pages flow from the client's cache to the server's, which gives
        // its surplus back. The client's refills must find those pages
        // again rather than sweep the whole pool (cold pages, and a fault
        // and a clear on each first touch).
        let tp = TempPool::new(64 << 20);
        let small = |name: &str| crate::AttachOptions {
            batch: 16,
            cache_max: 64,
            name: Some(name.into()),
            ..Default::default()
        };
        let client = tp.attach_with(small("client"));
        let server = tp.attach_with(small("server"));
        let ps = client.page_size();
        let n = 16;
        let mut seen = std::collections::HashSet::new();
        // 2 000 requests of 16 pages: twice the pool's pages.
        for i in 0..2000u32 {
            let mut b = client.alloc((n * ps) as u64).unwrap();
            b.write(0, &vec![i as u8; n * ps]).unwrap();
            seen.extend((0..n).map(|k| b.page_at(k).unwrap()));
            let r = b.share().unwrap();
            client.free(b).unwrap();
            let m = server.map_ref(&r).unwrap();
            assert_eq!(m.to_vec().unwrap()[n * ps - 1], i as u8);
            server.release_ref(&r).unwrap();
            server.free(m).unwrap();
        }
        // Bounded by the two caches and a refill or two, not the pool's
        // 16 384 pages.
        assert!(seen.len() <= 512, "{} distinct pages used", seen.len());
        drop((client, server));
        tp.assert_clean();
    }

    /// A Ref of a whole buffer with lists shares them: one count per list,
    /// none per page. The buffer's first write through a shared list
    /// copies that list (and the pages it writes), the Ref keeps its
    /// snapshot, and every other way of sharing (a range, a mapped
    /// buffer) still counts each page.
    #[test]
    fn a_ref_of_a_whole_buffer_shares_its_lists_and_a_write_copies_one() {
        let tp = TempPool::new(64 << 20);
        let pool = tp.attach();
        let ps = pool.page_size() as u64;
        let n = 2500u64; // three lists, the last one partly used
        let mut b = pool.alloc(n * ps).unwrap();
        b.write(0, &vec![5u8; (n * ps) as usize]).unwrap();
        let t = pool.inner.shm.pages();
        let lists = |b: &Buffer| -> Vec<u32> {
            let d = pool.inner.desc(b.desc_index()).unwrap();
            (0..3)
                .map(|j| pool.inner.shm.list_page(d, j).unwrap())
                .collect()
        };
        let mine = lists(&b);
        let r = b.share().unwrap();
        for &l in &mine {
            assert_eq!(t.rc(l), 2, "the Ref counts each list once");
        }
        for k in [0, 1023, 1024, 2499] {
            assert_eq!(t.rc(b.page_at(k).unwrap()), 1, "no page was counted");
        }
        let rep = pool.check();
        assert!(rep.ok(), "{:?}", rep.problems);
        assert_eq!(
            rep.pages_lists, 3,
            "one page per list, however many name it"
        );
        assert_eq!(rep.pages_shared, n, "every data page has two readers");
        // A write in the middle list copies it, and the page written.
        let before = pool.counters();
        b.write(1500 * ps + 7, b"new").unwrap();
        let after = pool.counters();
        assert_eq!(after.lists_copied - before.lists_copied, 1);
        assert_eq!(after.cow_copies - before.cow_copies, 1);
        let now = lists(&b);
        assert_eq!((now[0], now[2]), (mine[0], mine[2]));
        assert_ne!(now[1], mine[1]);
        assert_eq!(t.rc(mine[1]), 1, "the Ref alone holds the old list");
        let rep = pool.check();
        assert!(rep.ok(), "{:?}", rep.problems);
        let m = pool.map_ref(&r).unwrap();
        let mut got = [0u8; 3];
        m.read(1500 * ps + 7, &mut got).unwrap();
        assert_eq!(&got, &[5, 5, 5], "the Ref keeps its snapshot");
        b.read(1500 * ps + 7, &mut got).unwrap();
        assert_eq!(&got, b"new");
        drop(m);
        // A second write through the copied list writes in place.
        b.write(1500 * ps + 7, b"two").unwrap();
        assert_eq!(pool.counters().cow_copies, after.cow_copies);
        // A range is shared page by page: the Ref has a list of its own.
        let part = b.create_ref(ps, 100 * ps).unwrap();
        assert_eq!(t.rc(b.page_at(1).unwrap()), 2);
        // Released, the Ref gives the lists back: writes are in place.
        pool.release_ref(&r).unwrap();
        for &l in &[mine[0], mine[2]] {
            assert_eq!(t.rc(l), 1);
        }
        b.write(3 * ps, b"in place").unwrap();
        assert_eq!(pool.counters().lists_copied, after.lists_copied);
        pool.release_ref(&part).unwrap();
        // A mapped buffer never shares a list: it copies those a Ref
        // shares when mapped, and its own Refs count pages.
        let r = b.share().unwrap();
        let mut mb = crate::MappedBuffer::from_buffer(b).unwrap();
        assert!(
            matches!(mb.buffer().share(), Err(Error::InvalidArgument(_))),
            "the inner buffer's own share would leave the mapping writable"
        );
        let r2 = mb.share().unwrap();
        mb.as_mut_slice()[0] = 9;
        let rep = pool.check();
        assert!(rep.ok(), "{:?}", rep.problems);
        let (m, m2) = (pool.map_ref(&r).unwrap(), pool.map_ref(&r2).unwrap());
        let (mut x, mut y) = ([0u8; 1], [0u8; 1]);
        m.read(0, &mut x).unwrap();
        m2.read(0, &mut y).unwrap();
        assert_eq!((x[0], y[0], mb.as_slice()[0]), (5, 5, 9));
        drop((m, m2, mb));
        pool.release_ref(&r).unwrap();
        pool.release_ref(&r2).unwrap();
        drop(pool);
        tp.assert_clean();
    }

    /// A buffer that copies a list the Ref let go meanwhile finds itself
    /// alone when it lets the old list go: the old list's counts drop to
    /// the copy's, and the old list is freed.
    #[test]
    fn a_list_copy_that_finds_itself_alone_drains_the_old_list() {
        let tp = TempPool::new(32 << 20);
        let pool = tp.attach();
        let ps = pool.page_size() as u64;
        let data: Vec<u8> = (0..2000 * ps).map(|x| (x % 251) as u8).collect();
        let mut b = pool.alloc(data.len() as u64).unwrap();
        b.write(0, &data).unwrap();
        let i = &pool.inner;
        let d = i.desc(b.desc_index()).unwrap();
        let slot = i.shm.list_slot(d, 1).unwrap().unwrap();
        let old = slot.load(Ordering::Acquire);
        let t = i.shm.pages();
        assert_eq!(t.rc(old), 1, "no Ref: the buffer holds its list alone");
        i.copy_list(b.desc_index(), d, 1, slot, old).unwrap();
        let now = slot.load(Ordering::Acquire);
        assert_ne!(now, old);
        assert_eq!(t.rc(now), 1);
        assert!(matches!(
            t.state(old).unwrap(),
            crate::pages::PageState::Free | crate::pages::PageState::Cached(_)
        ));
        assert_eq!(t.rc(b.page_at(1500).unwrap()), 1, "the copy's count alone");
        assert_eq!(d.journal_idx.load(Ordering::Acquire), crate::pages::NO_PAGE);
        let rep = pool.check();
        assert!(rep.ok(), "{:?}", rep.problems);
        assert_eq!(b.to_vec().unwrap(), data);
        drop(b);
        drop(pool);
        tp.assert_clean();
    }

    /// The check finds a live Ref the expiry summary says later than it
    /// expires (a sweep would skip it), and a sweep of every group mends
    /// the summary.
    #[test]
    fn the_check_finds_a_ref_the_expiry_summary_misses() {
        let tp = TempPool::new(16 << 20);
        let pool = tp.attach();
        let b = pool.alloc(100).unwrap();
        let r = b.share().unwrap();
        assert!(pool.check().ok());
        let a = pool.inner.shm.atomics();
        let w = pool
            .inner
            .shm
            .expiry_word(r.desc / crate::layout::EXPIRY_GROUP)
            .unwrap();
        w.store(u64::MAX, Ordering::Release);
        a.expiry_top.store(u64::MAX, Ordering::Release);
        let rep = pool.check();
        assert!(
            rep.problems
                .iter()
                .any(|p| p.contains(&format!("Ref {}: expires at", r.desc))),
            "{:?}",
            rep.problems
        );
        crate::progress::Pass::quiet(|p| pool.inner.maintain_local(true, p)).unwrap();
        let rep = pool.check();
        assert!(rep.ok(), "{:?}", rep.problems);
        assert!(a.expiry_top.load(Ordering::Acquire) < u64::MAX);
        pool.release_ref(&r).unwrap();
        drop((b, pool));
        tp.assert_clean();
    }
}

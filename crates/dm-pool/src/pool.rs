//! The pool backend: attach, leases, the per-process page cache, buffers,
//! Refs and copy-on-write through the explicit API.
//!
//! Data is reached through *the pool window*: every attached process maps the
//! whole pool once, so reading a buffer or a mapped Ref is pointer arithmetic
//! (no syscall, no per-call page-table work). Writes go through [`Buffer::write`],
//! which copies a page first when its reference count is above one.

use crate::desc::{
    mappers, Desc, DescState, Kind, END_ABORTED, END_EXPIRED, END_RELEASED, FLAG_INDIRECT,
    FLAG_INHERIT, INLINE,
};
use crate::error::{Error, Result};
use crate::layout::{Layout, PoolConfig};
use crate::page_cache::PageCache;
use crate::pages::{Delta, BORROWED, NO_PAGE};
use crate::reclaim::{Book, Src};
use crate::refs::Ref;
use crate::shm::{host_id, Shm};
use crate::slot::{LeaseNow, SlotKind, SlotState};
use crate::sync::Ordering;
use dm_sys::mem::SharedFile;
use dm_sys::time::{monotonic_ms, now_ms};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Where a named pool lives by default.
pub fn default_path(name: &str) -> PathBuf {
    if name.contains('/') {
        PathBuf::from(name)
    } else {
        PathBuf::from(format!("/dev/shm/dmrpc-{name}.pool"))
    }
}

/// Options for attaching to a pool.
#[derive(Debug, Clone)]
pub struct AttachOptions {
    /// Lease of this process's slot in ms (default: the pool's default).
    pub lease_ms: Option<u64>,
    /// Pages claimed from the shared free set per refill. Default 256.
    pub batch: usize,
    /// Surplus above this many cached pages goes back to the free set. Default 2048.
    pub cache_max: usize,
    /// How many pages freed pages cool behind: a freed page is reused only
    /// once the pages this process has out and the ones it freed after it
    /// add up to this many. By then its lines have left the caches of the
    /// core that read it, which makes rewriting it several times cheaper
    /// (`page_cache.rs`). Default (`None`): 2 MiB of pages; capped at half
    /// of `cache_max` and an eighth of the pool. `Some(0)`: freed pages
    /// are reused at once, the last freed first.
    pub cool_pages: Option<usize>,
    /// Name recorded in the slot (default: this executable's name).
    pub name: Option<String>,
    /// Run the background thread that renews the lease. Default true.
    pub heartbeat: bool,
    /// Let that thread also reclaim dead slots and expired Refs every lease
    /// period. Default true.
    pub reclaim: bool,
    /// Fault in the whole data area at attach so that no access faults later.
    pub prefault: bool,
}

impl Default for AttachOptions {
    fn default() -> Self {
        Self {
            lease_ms: None,
            batch: 256,
            cache_max: 2048,
            cool_pages: None,
            name: None,
            heartbeat: true,
            reclaim: true,
            prefault: false,
        }
    }
}

/// What the lease thread shares with the handle: the mapping and the slot.
/// Everything here works without the process's page cache; pages it frees are
/// handed back to the caller in a `freed` vector (cached by us).
pub(crate) struct Core {
    pub(crate) shm: Shm,
    pub(crate) slot: u16,
    pub(crate) incarnation: u32,
    pub(crate) lost: AtomicBool,
    /// Where this process's next descriptor claim starts looking: the
    /// descriptor it freed last (still in this core's caches), else the
    /// one after its last claim. Process-local: a cursor shared by all
    /// processes cost a cache-line transfer per claim (three per call by
    /// Ref) and handed out cold descriptors.
    pub(crate) desc_hint: std::sync::atomic::AtomicU32,
}

pub(crate) struct Inner {
    core: Arc<Core>,
    cache: Mutex<PageCache>,
    /// How many pages freed pages cool behind (`AttachOptions::cool_pages`,
    /// capped; `page_cache.rs`).
    cool: usize,
    opts: AttachOptions,
    zeros: Box<[u8]>,
    stop: Arc<AtomicBool>,
    lease_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::ops::Deref for Inner {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.core
    }
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("path", &self.shm.path())
            .field("slot", &self.slot)
            .finish()
    }
}

/// An attached pool. Cheap to clone; the slot is released when the last
/// clone and every buffer of it are dropped.
#[derive(Debug, Clone)]
pub struct Pool {
    pub(crate) inner: Arc<Inner>,
}

/// Resets a descriptor's fields to the `Free` invariants (no entries, no
/// lists, empty journal). Called before the state word says `Free`.
pub(crate) fn reset_desc_fields(d: &Desc) {
    for e in &d.entries {
        e.store(NO_PAGE, Ordering::Relaxed);
    }
    d.n_pages.store(0, Ordering::Relaxed);
    d.held.store(0, Ordering::Relaxed);
    d.progress.store(0, Ordering::Relaxed);
    d.len.store(0, Ordering::Relaxed);
    d.offset.store(0, Ordering::Relaxed);
    d.journal_idx.store(NO_PAGE, Ordering::Relaxed);
    d.journal_old.store(NO_PAGE, Ordering::Relaxed);
    d.lock.store(0, Ordering::Relaxed);
    d.aux.store(0, Ordering::Relaxed);
    let end = d.flags.load(Ordering::Relaxed) & 0xFF00;
    d.flags.store(end, Ordering::Release);
}

impl Pool {
    /// Creates a pool at `path` (a file that must not exist, or a DAX/char
    /// device that is overwritten) with `cfg`. Does not attach.
    pub fn create(path: &Path, cfg: &PoolConfig) -> Result<()> {
        let layout = Layout::compute(cfg, dm_sys::rand::random_u64(), now_ms())
            .map_err(Error::InvalidConfig)?;
        let file = if SharedFile::is_device(path) {
            SharedFile::open(path, Some(layout.total_len))?
        } else {
            match SharedFile::create(path, layout.total_len) {
                Err(dm_sys::mem::SysError::Exists(p)) => return Err(Error::AlreadyExists(p)),
                r => r?,
            }
        };
        Shm::init(file, layout);
        Ok(())
    }

    /// Attaches to the pool at `path`.
    pub fn open(path: &Path, opts: AttachOptions) -> Result<Pool> {
        let shm = Shm::open(path)?;
        Self::attach(shm, opts)
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
    /// their mappings until they detach.
    pub fn destroy(path: &Path) -> Result<()> {
        let shm = Shm::open(path)?;
        if SharedFile::is_device(path) {
            shm.erase_header();
            return Ok(());
        }
        drop(shm);
        dm_sys::mem::unlink(path)?;
        Ok(())
    }

    fn attach(shm: Shm, opts: AttachOptions) -> Result<Pool> {
        let now = LeaseNow::read();
        let lease = opts.lease_ms.unwrap_or(shm.layout.lease_ms).max(10);
        let mut claimed = None;
        for i in 0..shm.layout.n_slots as u16 {
            let Some(s) = shm.slot(i) else { break };
            let w = s.state.load(Ordering::Acquire);
            let st = SlotState::decode(w);
            if st.kind != Some(SlotKind::Free) {
                continue;
            }
            // Fill the record before publishing Live so that no observer
            // sees a live slot with a stale heartbeat.
            let inc = st.incarnation.wrapping_add(1);
            if s.state
                .compare_exchange(
                    w,
                    SlotState::encode(inc, SlotKind::Reclaiming, i),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_err()
            {
                continue;
            }
            s.heartbeat_mono_ms.store(now.mono_ms, Ordering::Relaxed);
            s.heartbeat_ms.store(now.wall_ms, Ordering::Relaxed);
            s.lease_ms.store(lease, Ordering::Relaxed);
            s.attached_ms.store(now.wall_ms, Ordering::Relaxed);
            s.pid.store(dm_sys::proc::pid(), Ordering::Relaxed);
            s.host.store(host_id(), Ordering::Relaxed);
            let name = opts.name.clone().unwrap_or_else(|| {
                std::env::current_exe()
                    .ok()
                    .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                    .unwrap_or_default()
            });
            let mut nb = [0u8; 32];
            let n = name.len().min(32);
            nb[..n].copy_from_slice(&name.as_bytes()[..n]);
            for (k, w) in s.name.iter().enumerate() {
                let mut x = [0u8; 8];
                x.copy_from_slice(&nb[k * 8..k * 8 + 8]);
                w.store(u64::from_le_bytes(x), Ordering::Relaxed);
            }
            s.state
                .store(SlotState::encode(inc, SlotKind::Live, 0), Ordering::SeqCst);
            claimed = Some((i, inc));
            break;
        }
        let Some((slot, incarnation)) = claimed else {
            return Err(Error::ResourceExhausted { what: "slots" });
        };
        // Wait out a maintenance recount (gc with no other process
        // attached) or another attacher's taking over the Ref clock, then
        // make sure the Ref clock is this host's.
        loop {
            let m = shm.atomics().maint.load(Ordering::SeqCst);
            if m == 0 {
                match claim_ref_clock(&shm, slot) {
                    Ok(true) => break,
                    Ok(false) => {}
                    Err(e) => {
                        if let Some(s) = shm.slot(slot) {
                            s.state.store(
                                SlotState::encode(incarnation, SlotKind::Free, 0),
                                Ordering::Release,
                            );
                        }
                        return Err(e);
                    }
                }
            } else if !shm.slot_live((m - 1) as u16, LeaseNow::read()) {
                let _ =
                    shm.atomics()
                        .maint
                        .compare_exchange(m, 0, Ordering::AcqRel, Ordering::Relaxed);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if opts.prefault {
            shm.prefault();
        }
        let zeros = vec![0u8; shm.layout.page_size as usize].into_boxed_slice();
        let cool = crate::page_cache::reserve(
            opts.cool_pages,
            shm.layout.page_size as usize,
            opts.cache_max,
            shm.layout.n_pages as usize,
        );
        // Processes start their descriptor claims apart.
        let n_descs = shm.layout.n_descs.max(1);
        let first_desc =
            (slot as u64 * n_descs as u64 / shm.layout.n_slots.max(1) as u64) as u32 % n_descs;
        let core = Arc::new(Core {
            shm,
            slot,
            incarnation,
            lost: AtomicBool::new(false),
            desc_hint: std::sync::atomic::AtomicU32::new(first_desc),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let reclaim = opts.reclaim;
        let lease_thread = if opts.heartbeat {
            let (c, st) = (core.clone(), stop.clone());
            Some(
                std::thread::Builder::new()
                    .name("dmrpc-lease".into())
                    .spawn(move || heartbeat(c, st, lease, reclaim))?,
            )
        } else {
            None
        };
        let inner = Arc::new(Inner {
            core,
            cache: Mutex::new(PageCache::default()),
            cool,
            opts,
            zeros,
            stop,
            lease_thread: Mutex::new(lease_thread),
        });
        Ok(Pool { inner })
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
        let (idx, gen) = i.claim_desc(Kind::Buf)?;
        let d = i.desc(idx)?;
        if let Err(e) = i.attach_lists(d, n, true) {
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

    /// Creates a Ref to `len` bytes at `offset` of `buf`: +1 share on each
    /// page (no copy); the buffer's view of those pages becomes CoW.
    pub fn create_ref(&self, buf: &Buffer, offset: u64, len: u64) -> Result<Ref> {
        self.create_ref_ttl(
            buf,
            offset,
            len,
            Duration::from_millis(self.layout().ref_ttl_ms),
        )
    }

    /// [`create_ref`](Self::create_ref) with an explicit time to live.
    pub fn create_ref_ttl(
        &self,
        buf: &Buffer,
        offset: u64,
        len: u64,
        ttl: Duration,
    ) -> Result<Ref> {
        let i = &self.inner;
        let (ridx, rgen, tag, first, n) = self.begin_ref(buf, offset, len, ttl)?;
        let r = i.desc(ridx)?;
        let b = i.desc(buf.desc)?;
        let res = (|| -> Result<()> {
            i.shm.copy_entries(b, first, r, n, 0)?;
            // Only now do entries [0, n) name pages: a reclaimer of a
            // builder killed before this store walks none of them (the
            // list pages' old bytes read as page indices otherwise).
            r.n_pages.store(n as u32, Ordering::Release);
            let mut none = Vec::new();
            i.bulk_change(
                ridx,
                r,
                0,
                n as u32,
                Src::Entries,
                Book::Held,
                Delta::Inc,
                &mut none,
            )?;
            Ok(())
        })();
        if let Err(e) = res {
            i.drop_own(ridx, rgen, Kind::RefBuild, END_ABORTED)?;
            return Err(e);
        }
        r.aux.store(mappers::IS_REF, Ordering::Release);
        r.state
            .store(DescState::encode(rgen, Kind::RefLive, 0), Ordering::Release);
        i.shm.atomics().refs_created.fetch_add(1, Ordering::Relaxed);
        Ok(Ref {
            backend: crate::refs::BACKEND_POOL,
            pool_id: self.id(),
            desc: ridx,
            generation: rgen,
            tag,
            len,
        })
    }

    /// Turns `buf` into a Ref to all of it, consuming the buffer: what
    /// [`Buffer::share`] then dropping the buffer leaves, without touching
    /// a page. The buffer's descriptor becomes the Ref (`Buf -> RefLive`,
    /// one CAS of its state word), and each of its pages keeps the one
    /// share it has: O(1), where sharing counts every page up for the Ref
    /// and the drop counts it down again (32 count changes for 64 KiB).
    /// A buffer mapped from a Ref (whose pages are borrowed) is shared and
    /// freed instead, with the same result. Default time to live. On an
    /// error the buffer is freed; [`try_into_ref`](Self::try_into_ref)
    /// hands it back instead.
    pub fn into_ref(&self, buf: Buffer) -> Result<Ref> {
        self.into_ref_ttl(buf, Duration::from_millis(self.layout().ref_ttl_ms))
    }

    /// [`into_ref`](Self::into_ref) with an explicit time to live.
    pub fn into_ref_ttl(&self, buf: Buffer, ttl: Duration) -> Result<Ref> {
        // (A buffer handed back is dropped: freed, as `into_ref` says.)
        self.try_into_ref_ttl(buf, ttl).map_err(|(e, _)| e)
    }

    /// [`into_ref`](Self::into_ref) that loses nothing when it fails: the
    /// error comes with the buffer, unchanged (a pool out of descriptors
    /// for a buffer that has to be shared, a buffer of another pool). Only
    /// a buffer this process no longer owns comes back empty-handed: one
    /// freed already (`DoubleFree`), or taken by a reclaimer because this
    /// process was held dead (`Corrupt`, the buffer handed back owns
    /// nothing).
    pub fn try_into_ref(&self, buf: Buffer) -> std::result::Result<Ref, (Error, Buffer)> {
        self.try_into_ref_ttl(buf, Duration::from_millis(self.layout().ref_ttl_ms))
    }

    /// [`try_into_ref`](Self::try_into_ref) with an explicit time to live.
    pub fn try_into_ref_ttl(
        &self,
        mut buf: Buffer,
        ttl: Duration,
    ) -> std::result::Result<Ref, (Error, Buffer)> {
        if let Err(e) = buf.check(self) {
            return Err((e, buf));
        }
        let i = &self.inner;
        let d = match i.desc(buf.desc) {
            Ok(d) => d,
            Err(e) => return Err((e, buf)),
        };
        let mine = DescState::encode(buf.generation, Kind::Buf, i.slot);
        // Only a buffer whose entries are all its own shares: not mapped
        // from a Ref (`aux` 0, no inherited entries), no copy-on-write
        // under way, its content from the start of its first page.
        let whole = buf.offset == 0
            && d.offset.load(Ordering::Relaxed) == 0
            && d.n_pages.load(Ordering::Relaxed) == buf.n_pages
            && d.len.load(Ordering::Relaxed) == buf.len;
        if !whole
            || d.state.load(Ordering::Acquire) != mine
            || d.aux.load(Ordering::Acquire) != 0
            || d.flags.load(Ordering::Acquire) & FLAG_INHERIT != 0
            || d.journal_idx.load(Ordering::Acquire) != NO_PAGE
        {
            let r = match self.create_ref_ttl(&buf, 0, buf.len, ttl) {
                Ok(r) => r,
                Err(e) => return Err((e, buf)),
            };
            // (A free that fails finds a buffer no longer ours: the one
            // handed back owns nothing.)
            let id = buf.id();
            buf.detached = true;
            if let Err(e) = self.free_id(id) {
                let _ = self.release_ref(&r);
                return Err((e, buf));
            }
            return Ok(r);
        }
        // The Ref's fields first, then the commit.
        let tag = self.seal_fields(d, buf.n_pages, ttl);
        let live = DescState::encode(buf.generation, Kind::RefLive, 0);
        // From here the handle owns nothing, whatever the CAS gives.
        buf.detached = true;
        if d.state
            .compare_exchange(mine, live, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            // Only a reclaimer takes an owned descriptor: this slot was
            // taken for dead, and the buffer is its to drop.
            let e = Error::Corrupt(format!("descriptor {} changed under its owner", buf.desc));
            return Err((e, buf));
        }
        i.shm.atomics().refs_created.fetch_add(1, Ordering::Relaxed);
        Ok(Ref {
            backend: crate::refs::BACKEND_POOL,
            pool_id: self.id(),
            desc: buf.desc,
            generation: buf.generation,
            tag,
            len: buf.len,
        })
    }

    /// Crash-recovery testing only: [`into_ref`](Self::into_ref) up to its
    /// commit, as a process killed just before it leaves the descriptor
    /// (the caller is then killed). See `testing::stop_sealing`.
    pub(crate) fn seal_stop_before_commit(&self, mut buf: Buffer) -> Result<()> {
        let d = self.inner.desc(buf.desc)?;
        self.seal_fields(d, buf.n_pages, Duration::from_secs(3600));
        buf.detached = true;
        Ok(())
    }

    /// The first step of [`into_ref`](Self::into_ref): the Ref's fields of
    /// buffer descriptor `d` (of `n_pages` entries), written while it is
    /// still a buffer (a reclaimer of a buffer reads none of them: `aux`
    /// is not 1, so no mapping is undone, and it sets `held` itself).
    /// Returns the tag.
    fn seal_fields(&self, d: &Desc, n_pages: u32, ttl: Duration) -> u64 {
        let tag = dm_sys::rand::random_u64();
        d.tag.store(tag, Ordering::Relaxed);
        d.expiry_ms.store(
            self.inner
                .shm
                .ref_now_coarse()
                .saturating_add(ttl.as_millis() as u64),
            Ordering::Relaxed,
        );
        d.held.store(n_pages, Ordering::Relaxed);
        d.progress.store(0, Ordering::Relaxed);
        d.aux.store(mappers::IS_REF, Ordering::Relaxed);
        tag
    }

    /// First stage of [`create_ref_ttl`](Self::create_ref_ttl): claims a
    /// `RefBuild` descriptor for `len` bytes at `offset` of `buf` and gives
    /// it its list pages and fields, all but `n_pages` (stored once the
    /// entries are copied). Returns (index, generation, tag, first page of
    /// `buf`, pages).
    fn begin_ref(
        &self,
        buf: &Buffer,
        offset: u64,
        len: u64,
        ttl: Duration,
    ) -> Result<(u32, u32, u64, usize, usize)> {
        let i = &self.inner;
        buf.check(self)?;
        if len == 0 {
            return Err(Error::ZeroLength);
        }
        buf.bounds(offset, len)?;
        let ps = self.page_size() as u64;
        let start = buf.offset as u64 + offset;
        let first = (start / ps) as usize;
        let n = ((start + len).div_ceil(ps) - start / ps) as usize;
        let (ridx, rgen) = i.claim_desc(Kind::RefBuild)?;
        let r = i.desc(ridx)?;
        if let Err(e) = i.attach_lists(r, n, false) {
            i.drop_own(ridx, rgen, Kind::RefBuild, END_ABORTED)?;
            return Err(e);
        }
        let tag = dm_sys::rand::random_u64();
        r.tag.store(tag, Ordering::Relaxed);
        r.len.store(len, Ordering::Relaxed);
        r.offset.store((start % ps) as u32, Ordering::Relaxed);
        r.expiry_ms.store(
            i.shm
                .ref_now_coarse()
                .saturating_add(ttl.as_millis() as u64),
            Ordering::Relaxed,
        );
        Ok((ridx, rgen, tag, first, n))
    }

    /// Crash-recovery testing only: starts creating a Ref to the whole of
    /// `buf` and stops before copying its entries, as a process killed at
    /// that point leaves it (the caller is then killed). See
    /// `testing::stop_creating_ref`.
    pub(crate) fn create_ref_stop_before_copy(&self, buf: &Buffer) -> Result<()> {
        self.begin_ref(buf, 0, buf.len(), Duration::from_secs(60))
            .map(|_| ())
    }

    /// Checks a Ref against its descriptor; returns the descriptor state word.
    fn validate(&self, r: &Ref) -> Result<(&Desc, u64)> {
        let i = &self.inner;
        if r.pool_id != self.id() || r.backend != crate::refs::BACKEND_POOL {
            return Err(Error::ForeignPool {
                expected: self.id(),
                found: r.pool_id,
            });
        }
        let d = i
            .shm
            .desc(r.desc)
            .ok_or(Error::RefForged { desc: r.desc })?;
        let w = d.state.load(Ordering::Acquire);
        let st = DescState::decode(w);
        if st.generation != r.generation {
            return Err(Error::RefStale {
                desc: r.desc,
                generation: r.generation,
                current: st.generation,
            });
        }
        if d.tag.load(Ordering::Relaxed) != r.tag {
            return Err(Error::RefForged { desc: r.desc });
        }
        let ended = || {
            if (d.flags.load(Ordering::Relaxed) >> 8) & 0xFF == END_EXPIRED {
                Err(Error::RefExpired {
                    desc: r.desc,
                    generation: r.generation,
                })
            } else {
                Err(Error::RefReleased {
                    desc: r.desc,
                    generation: r.generation,
                })
            }
        };
        match st.kind {
            Some(Kind::RefLive) => {
                if d.len.load(Ordering::Relaxed) != r.len {
                    return Err(Error::RefForged { desc: r.desc });
                }
                if mappers::released(d.aux.load(Ordering::Acquire)) {
                    return ended();
                }
                if i.shm.ref_now_coarse() > d.expiry_ms.load(Ordering::Relaxed) {
                    return Err(Error::RefExpired {
                        desc: r.desc,
                        generation: r.generation,
                    });
                }
                Ok((d, w))
            }
            Some(Kind::Free) | Some(Kind::Drop) => ended(),
            _ => Err(Error::RefForged { desc: r.desc }),
        }
    }

    /// Crash-recovery testing only: starts mapping `r` and stops right after
    /// taking its mapper word's lock, as a process killed at that point
    /// leaves it (the caller is then killed). See `testing::hold_ref_lock`.
    pub(crate) fn map_ref_stop_in_lock(&self, r: &Ref) -> Result<()> {
        let i = &self.inner;
        let (rd, _, idx, _, _) = self.begin_map(r)?;
        let mut spins = 0u32;
        loop {
            match mappers::link(&rd.aux, idx) {
                mappers::Step::Locked(_) => return Ok(()),
                mappers::Step::Busy(other) => {
                    let mut freed = Vec::new();
                    i.wait_busy(NO_PAGE, other, &mut spins, &mut freed);
                    i.give_pages(freed);
                }
                s => return Err(Error::Corrupt(format!("cannot link: {s:?}"))),
            }
        }
    }

    /// First stage of [`map_ref`](Self::map_ref): validates `r` and claims
    /// a `MapBuild` descriptor for it, with its length, offset, page count
    /// and the Ref it will link to. Returns (the Ref's descriptor, its
    /// state word, index, generation, pages).
    fn begin_map(&self, r: &Ref) -> Result<(&Desc, u64, u32, u32, usize)> {
        let i = &self.inner;
        i.live()?;
        let (rd, w) = self.validate(r)?;
        let ps = self.page_size() as u64;
        let offset = rd.offset.load(Ordering::Relaxed) as u64;
        let n = rd.n_pages.load(Ordering::Relaxed) as usize;
        if offset >= ps || n as u64 != (offset + r.len).div_ceil(ps) || r.len > self.max_len() {
            return Err(Error::RefForged { desc: r.desc });
        }
        let (idx, gen) = i.claim_desc(Kind::MapBuild)?;
        let d = i.desc(idx)?;
        d.len.store(r.len, Ordering::Relaxed);
        d.offset.store(offset as u32, Ordering::Relaxed);
        d.n_pages.store(n as u32, Ordering::Relaxed);
        d.tag.store(r.desc as u64, Ordering::Release); // the Ref we link to
        Ok((rd, w, idx, gen, n))
    }

    /// Length of the snapshot a Ref names, after validating it.
    pub fn ref_len(&self, r: &Ref) -> Result<u64> {
        self.validate(r).map(|_| r.len)
    }

    /// Maps a Ref into this process as a new buffer, with no copy and no
    /// per-page work: the buffer *borrows* the Ref's pages and holds the Ref
    /// by one count (so its data outlives a release). Writes to the buffer
    /// copy the pages they touch.
    pub fn map_ref(&self, r: &Ref) -> Result<Buffer> {
        let i = &self.inner;
        let (rd, w, idx, gen, n) = self.begin_map(r)?;
        let d = i.desc(idx)?;
        // Link (one count on the Ref), then check it is still the Ref we
        // validated: from then on it cannot be dropped, so its entries are
        // stable and can be borrowed.
        let mut spins = 0u32;
        let linked = loop {
            match mappers::link(&rd.aux, idx) {
                mappers::Step::Locked(lw) => {
                    d.aux.store(1, Ordering::Release);
                    mappers::unlock(&rd.aux, lw);
                    break true;
                }
                mappers::Step::Busy(other) => {
                    let mut freed = Vec::new();
                    i.wait_busy(NO_PAGE, other, &mut spins, &mut freed);
                    i.give_pages(freed);
                }
                _ => break false,
            }
        };
        // Read through the Ref until the first write (no list of our own).
        let ok = linked && rd.state.load(Ordering::Acquire) == w;
        if ok {
            d.flags.fetch_or(FLAG_INHERIT, Ordering::Release);
        }
        if !ok {
            i.drop_own(idx, gen, Kind::MapBuild, END_ABORTED)?;
            self.validate(r)?;
            return Err(Error::RefReleased {
                desc: r.desc,
                generation: r.generation,
            });
        }
        d.held.store(n as u32, Ordering::Relaxed);
        d.state
            .store(DescState::encode(gen, Kind::Buf, i.slot), Ordering::Release);
        Ok(Buffer {
            pool: self.clone(),
            desc: idx,
            generation: gen,
            len: r.len,
            offset: d.offset.load(Ordering::Relaxed),
            n_pages: n as u32,
            detached: false,
        })
    }

    /// Releases a Ref. Its pages are dropped now, or when the last buffer
    /// mapped from it is freed. A second release is an error.
    pub fn release_ref(&self, r: &Ref) -> Result<()> {
        self.end_ref(r, END_RELEASED)
    }

    fn end_ref(&self, r: &Ref, end: u32) -> Result<()> {
        let i = &self.inner;
        i.live()?;
        let mut spins = 0u32;
        loop {
            let (d, w) = self.validate(r)?;
            let flags = d.flags.load(Ordering::Relaxed);
            d.flags
                .store((flags & 0xFF) | (end << 8), Ordering::Release);
            match mappers::release(&d.aux, i.slot) {
                mappers::Release::Drop => {
                    let mut freed = Vec::new();
                    let res = i.core.drop_ref(r.desc, d, w, end, &mut freed);
                    i.give_pages(freed);
                    return res;
                }
                mappers::Release::Kept => return Ok(()),
                mappers::Release::Already => {
                    return Err(Error::RefReleased {
                        desc: r.desc,
                        generation: r.generation,
                    })
                }
                mappers::Release::Busy(other) => {
                    let mut freed = Vec::new();
                    i.wait_busy(NO_PAGE, other, &mut spins, &mut freed);
                    i.give_pages(freed);
                }
            }
        }
    }

    /// Reclaims dead slots and expired Refs now (the heartbeat thread does
    /// this every lease period). Returns what was reclaimed.
    pub fn maintain(&self) -> Result<crate::check::GcReport> {
        self.inner.maintain_local()
    }

    /// Consistency check of the whole pool (see [`crate::check`]).
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

/// The lease thread: renews the slot's heartbeat every quarter lease and,
/// every lease, reclaims dead slots and expired Refs (pages it frees go
/// straight back to the free set). Parked between ticks; woken to stop.
fn heartbeat(core: Arc<Core>, stop: Arc<AtomicBool>, lease: u64, reclaim: bool) {
    let tick = Duration::from_millis((lease / 4).max(5));
    let mut last_maint = monotonic_ms();
    while !stop.load(Ordering::Acquire) {
        std::thread::park_timeout(tick);
        if stop.load(Ordering::Acquire) || core.renew().is_err() {
            return;
        }
        let now = monotonic_ms();
        if reclaim && now >= last_maint + lease {
            last_maint = now;
            let mut freed = Vec::new();
            let _ = core.maintain(&mut freed);
            core.release_freed(freed);
        }
    }
}

impl Core {
    pub(crate) fn set_entry(&self, d: &Desc, k: usize, p: u32) -> Result<()> {
        match self.shm.entry(d, k)? {
            Some(e) => {
                e.store(p, Ordering::Release);
                Ok(())
            }
            None => Err(Error::Corrupt(format!("entry {k} has no list page"))),
        }
    }

    /// Returns pages cached by this slot to the shared free set.
    pub(crate) fn release_freed(&self, freed: Vec<u32>) {
        let t = self.shm.pages();
        for p in freed {
            let _ = t.release_cached(p, self.slot);
        }
    }

    /// Fails with `LeaseLost` unless this slot is still ours: a process that
    /// was stopped past its lease has had its holdings reclaimed and must
    /// not touch them. One load of the slot word (read-mostly, shared).
    pub(crate) fn live(&self) -> Result<()> {
        if !self.lost.load(Ordering::Relaxed) {
            let w = self
                .shm
                .slot(self.slot)
                .map(|s| s.state.load(Ordering::Acquire));
            if w == Some(SlotState::encode(self.incarnation, SlotKind::Live, 0)) {
                return Ok(());
            }
            self.lost.store(true, Ordering::Relaxed);
        }
        Err(Error::LeaseLost)
    }

    pub(crate) fn renew(&self) -> Result<()> {
        let Some(s) = self.shm.slot(self.slot) else {
            return Err(Error::LeaseLost);
        };
        let st = SlotState::decode(s.state.load(Ordering::Acquire));
        if st.kind != Some(SlotKind::Live) || st.incarnation != self.incarnation {
            self.lost.store(true, Ordering::Relaxed);
            return Err(Error::LeaseLost);
        }
        let now = LeaseNow::read();
        s.heartbeat_mono_ms.store(now.mono_ms, Ordering::Release);
        s.heartbeat_ms.store(now.wall_ms, Ordering::Release);
        Ok(())
    }

    pub(crate) fn desc(&self, i: u32) -> Result<&Desc> {
        self.shm
            .desc(i)
            .ok_or_else(|| Error::Corrupt(format!("descriptor {i} out of range")))
    }

    /// Claims a free descriptor for `kind`, owned by this slot.
    fn claim_desc(&self, kind: Kind) -> Result<(u32, u32)> {
        let n = self.shm.layout.n_descs as u64;
        let start = self.desc_hint.load(std::sync::atomic::Ordering::Relaxed) as u64 % n.max(1);
        for k in 0..n {
            let i = ((start + k) % n) as u32;
            let Some(d) = self.shm.desc(i) else { continue };
            let w = d.state.load(Ordering::Relaxed);
            let st = DescState::decode(w);
            if st.kind != Some(Kind::Free) {
                continue;
            }
            let gen = st.generation.wrapping_add(1);
            if d.state
                .compare_exchange(
                    w,
                    DescState::encode(gen, kind, self.slot),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok()
            {
                self.desc_hint.store(
                    ((i as u64 + 1) % n) as u32,
                    std::sync::atomic::Ordering::Relaxed,
                );
                return Ok((i, gen));
            }
        }
        Err(Error::ResourceExhausted {
            what: "descriptors",
        })
    }
}

impl Inner {
    /// Gives a descriptor of `n` entries the list pages it needs.
    /// `fill`: mark entries `[0, n)` as unbacked (a fresh buffer). Builders
    /// that write all `n` entries themselves pass false. Entries past `n`
    /// are zeroed (taken pages keep old bytes), though every reader of a
    /// descriptor stops at `n` (or `held`).
    pub(crate) fn attach_lists(&self, d: &Desc, n: usize, fill: bool) -> Result<()> {
        let lists = self.shm.lists_needed(n);
        if lists == 0 {
            return Ok(());
        }
        if lists > INLINE {
            return Err(Error::TooLarge {
                len: n as u64 * self.shm.layout.page_size as u64,
                max: self.shm.layout.max_len(),
            });
        }
        let got = self.take_pages(lists)?;
        d.flags.fetch_or(FLAG_INDIRECT, Ordering::Release);
        let pages = self.shm.pages();
        let per = self.shm.layout.per_list_page();
        for (k, &l) in got.iter().enumerate() {
            let used = (n - k * per).min(per);
            let list = self.shm.list(l)?;
            if fill {
                for e in &list[..used] {
                    e.store(NO_PAGE, Ordering::Relaxed);
                }
            }
            for e in &list[used..] {
                e.store(0, Ordering::Relaxed);
            }
            d.entries[k].store(l, Ordering::Release);
            pages.hold_cached(l, self.slot)?;
        }
        Ok(())
    }

    /// Takes `n` pages from the page cache, refilling from the free set.
    /// Their bytes are left as they were: the caller zeroes what it does not
    /// overwrite. The cache is last in, first out: a page freed a moment
    /// ago is likely still in this core's caches, so the next buffer is
    /// written at cache speed (a first-in first-out order handed out the
    /// coldest page: 5-10% of a 64 KiB by-Ref echo here). Pages freed
    /// together come back together and in order, so runs stay contiguous.
    pub(crate) fn take_pages(&self, n: usize) -> Result<Vec<u32>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut retried = false;
        loop {
            {
                let mut cache = self
                    .cache
                    .lock()
                    .map_err(|_| Error::Corrupt("page cache lock poisoned".into()))?;
                let want = cache.refill_for(n, self.opts.batch);
                if want > 0 {
                    let mut got = Vec::with_capacity(want);
                    self.shm.pages().claim_batch(
                        &self.shm.atomics().page_cursor,
                        self.slot,
                        want,
                        &mut got,
                    );
                    cache.refilled(got, want);
                }
                if let Some(pages) = cache.take(n) {
                    return Ok(pages);
                }
            }
            if retried {
                return Err(Error::ResourceExhausted { what: "pages" });
            }
            retried = true;
            // Reclaim what dead processes and expired Refs hold, then retry once.
            self.maintain_local()?;
        }
    }

    /// Returns pages (Cached by this slot) to the page cache, giving the
    /// coldest surplus back to the free set.
    ///
    /// The shared claim cursor is then pointed at the pages given back, so
    /// that the next refill (typically by the process that allocates what
    /// this one frees: a client whose Refs a server drops last) takes them
    /// again. Without that the cursor swept the whole pool: every page of a
    /// fresh pool was first touched by some call (a fault and a clear of
    /// the tmpfs page, in every process that touched it), and later every
    /// claim got the coldest pages there were. With 64 KiB requests through
    /// a 1.5 GiB pool that was the first 24 000 calls (`bench image`).
    pub(crate) fn give_pages(&self, pages: Vec<u32>) {
        if pages.is_empty() {
            // Most drops free nothing here (a mapping, a Ref others hold).
            return;
        }
        let Ok(mut cache) = self.cache.lock() else {
            return;
        };
        cache.give(pages, self.cool);
        if cache.len() > self.opts.cache_max {
            let keep = self.opts.cache_max / 2;
            let t = self.shm.pages();
            let mut first = None;
            while cache.len() > keep {
                if let Some(p) = cache.pop_oldest() {
                    if t.release_cached(p, self.slot).is_ok() {
                        first = Some(first.map_or(p, |f: u32| f.min(p)));
                    }
                }
            }
            if let Some(f) = first {
                self.shm
                    .atomics()
                    .page_cursor
                    .store(u64::from(f), Ordering::Relaxed);
            }
        }
    }

    /// Drops a descriptor this slot owns in `kind` (abort of a build, or free).
    fn drop_own(&self, idx: u32, gen: u32, kind: Kind, end: u32) -> Result<()> {
        let d = self.desc(idx)?;
        let n = d.n_pages.load(Ordering::Relaxed);
        if kind == Kind::Buf {
            d.held.store(n, Ordering::Relaxed);
        }
        d.progress.store(0, Ordering::Relaxed);
        let from = DescState::encode(gen, kind, self.slot);
        let to = DescState::encode(gen, Kind::Drop, self.slot);
        d.state
            .compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire)
            .map_err(|_| Error::Corrupt(format!("descriptor {idx} changed under its owner")))?;
        self.drop_desc_local(idx, d, end)
    }

    /// Drops a descriptor in `Drop` state, keeping freed pages in the page cache.
    pub(crate) fn drop_desc_local(&self, di: u32, d: &Desc, end: u32) -> Result<()> {
        let mut freed = Vec::new();
        let r = self.core.drop_desc(di, d, end, &mut freed);
        self.give_pages(freed);
        r
    }

    /// Reclaims dead slots and expired Refs, keeping freed pages.
    pub(crate) fn maintain_local(&self) -> Result<crate::check::GcReport> {
        let mut freed = Vec::new();
        let r = self.core.maintain(&mut freed);
        self.give_pages(freed);
        r
    }

    /// Takes over and drops every owned descriptor not owned by this slot
    /// (gc's recount runs this when no other process is attached).
    pub(crate) fn reclaim_orphans(&self) -> Result<()> {
        let mut freed = Vec::new();
        let me = self.slot;
        let owned = |st: &DescState| {
            st.owner != me
                && matches!(
                    st.kind,
                    Some(Kind::Buf | Kind::MapBuild | Kind::RefBuild | Kind::Drop)
                )
        };
        let r = self.core.reclaim_descs(owned, &mut freed);
        self.give_pages(freed);
        r
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.lease_thread.lock().ok().and_then(|mut g| g.take()) {
            h.thread().unpark();
            let _ = h.join();
        }
        if self.lost.load(Ordering::Relaxed) {
            return;
        }
        if let Ok(mut cache) = self.cache.lock() {
            let t = self.shm.pages();
            for p in cache.drain_all() {
                let _ = t.release_cached(p, self.slot);
            }
        }
        let mut freed = Vec::new();
        let _ = self.core.release_holdings_of(self.slot, &mut freed);
        self.core.release_freed(freed);
        if let Some(s) = self.shm.slot(self.slot) {
            let _ = s.state.compare_exchange(
                SlotState::encode(self.incarnation, SlotKind::Live, 0),
                SlotState::encode(self.incarnation, SlotKind::Free, 0),
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }
}

/// Makes sure a [`RefClock::Host`](crate::RefClock::Host) pool keeps its
/// Refs on this host's monotonic clock; `slot` is the attaching
/// process's (already claimed). Ok(false): the maintenance lock is busy,
/// try again.
///
/// The clock is another host's (`ref_clock_host`) when the pool was
/// created on another host or in an earlier boot of this one (a pool on a
/// file or device that outlived a reboot). While a process of that host is
/// alive the attach is refused: its Refs' expiries mean nothing on this
/// host's clock. Otherwise, under the maintenance lock (which holds other
/// attachers back), every Ref still live is expired — its holders all died
/// with the old boot — and the clock becomes this host's.
fn claim_ref_clock(shm: &Shm, slot: u16) -> Result<bool> {
    if shm.ref_clock_is_ours() {
        return Ok(true);
    }
    let a = shm.atomics();
    if a.maint
        .compare_exchange(0, slot as u64 + 1, Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        return Ok(false);
    }
    // (Taken over meanwhile by another attacher of this host?)
    let owner = a.ref_clock_host.load(Ordering::Acquire);
    let now = LeaseNow::read();
    let owner_alive = || {
        (0..shm.layout.n_slots as u16).any(|s| {
            shm.slot(s)
                .is_some_and(|sl| sl.host.load(Ordering::Relaxed) == owner)
                && shm.slot_live(s, now)
        })
    };
    let res = if shm.ref_clock_is_ours() {
        Ok(true)
    } else if owner_alive() {
        Err(Error::RefClockInUse { host: owner })
    } else {
        for idx in 0..shm.layout.n_descs {
            if let Some(d) = shm.desc(idx) {
                let st = DescState::decode(d.state.load(Ordering::Acquire));
                if st.kind == Some(Kind::RefLive) {
                    d.expiry_ms.store(0, Ordering::Relaxed);
                }
            }
        }
        a.ref_clock_host.store(host_id(), Ordering::Release);
        Ok(true)
    };
    a.maint.store(0, Ordering::SeqCst);
    res
}

/// A buffer id that can cross an FFI boundary: [`Pool::free_id`] detects
/// double frees with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BufferId {
    /// Pool id.
    pub pool_id: u64,
    /// Descriptor index.
    pub desc: u32,
    /// Generation.
    pub generation: u32,
}

/// A buffer in the pool owned by this process: pages of its own or shared
/// with Refs (copy-on-write). Freed on drop.
#[derive(Debug)]
pub struct Buffer {
    pool: Pool,
    desc: u32,
    generation: u32,
    len: u64,
    offset: u32,
    n_pages: u32,
    /// Set when the handle no longer owns the descriptor (freed explicitly
    /// or turned into a `BufferId`): dropping it then frees nothing.
    detached: bool,
}

impl Buffer {
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the length is zero (never: buffers are at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its id.
    pub fn id(&self) -> BufferId {
        BufferId {
            pool_id: self.pool.id(),
            desc: self.desc,
            generation: self.generation,
        }
    }

    /// The pool it belongs to.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    fn check(&self, pool: &Pool) -> Result<()> {
        pool.inner.live()?;
        if pool.id() != self.pool.id() || !Arc::ptr_eq(&pool.inner, &self.pool.inner) {
            return Err(Error::ForeignPool {
                expected: pool.id(),
                found: self.pool.id(),
            });
        }
        Ok(())
    }

    fn bounds(&self, offset: u64, len: u64) -> Result<()> {
        crate::error::check_range(offset, len, self.len)
    }

    fn d(&self) -> Result<&Desc> {
        self.pool.inner.desc(self.desc)
    }

    /// Page entry `k` of this buffer.
    pub(crate) fn page_at(&self, k: usize) -> Result<u32> {
        self.pool.inner.shm.entry_value(self.d()?, k)
    }

    /// Page entry `k` and whether it is borrowed from the Ref this buffer
    /// was mapped from.
    pub(crate) fn owned_page_at(&self, k: usize) -> Result<(u32, bool)> {
        let raw = self.pool.inner.shm.raw_entry(self.d()?, k)?;
        Ok(if raw == NO_PAGE {
            (raw, false)
        } else {
            (raw & !BORROWED, raw & BORROWED != 0)
        })
    }

    /// Gives a buffer that reads through its Ref a page list of its own
    /// (every page borrowed), before its first write. Order matters for
    /// crash recovery: the list is filled with "no page" before the buffer
    /// stops inheriting, so no entry ever reads as an owned page it is not.
    pub(crate) fn materialize(&mut self) -> Result<()> {
        let i = self.pool.inner.clone();
        let d = self.d()?;
        let Some(r) = i.shm.inherits_from(d) else {
            return Ok(());
        };
        let n = self.n_pages as usize;
        i.attach_lists(d, n, true)?;
        d.flags.fetch_and(!FLAG_INHERIT, Ordering::AcqRel);
        i.shm.copy_entries(r, 0, d, n, BORROWED)
    }

    pub(crate) fn desc_index(&self) -> u32 {
        self.desc
    }

    pub(crate) fn first_offset(&self) -> u32 {
        self.offset
    }

    pub(crate) fn page_count(&self) -> u32 {
        self.n_pages
    }

    /// Copies `out.len()` bytes at `offset` into `out`.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.pool.inner.live()?;
        self.bounds(offset, out.len() as u64)?;
        let mut done = 0;
        for seg in self.segments(offset, out.len() as u64)? {
            out[done..done + seg.len()].copy_from_slice(seg);
            done += seg.len();
        }
        Ok(())
    }

    /// Reads the whole buffer into a vector.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len as usize];
        self.read(0, &mut v)?;
        Ok(v)
    }

    /// Views `len` bytes at `offset` as slices of pool memory: one slice per
    /// run of consecutive pool pages (unbacked pages read as zeros). No copy,
    /// no syscall: this is the fast read path for received data.
    pub fn segments(&self, offset: u64, len: u64) -> Result<Vec<&[u8]>> {
        self.bounds(offset, len)?;
        let i = &self.pool.inner;
        let ps = i.shm.layout.page_size as u64;
        let mut out: Vec<&[u8]> = Vec::new();
        let mut pos = self.offset as u64 + offset;
        let end = pos + len;
        let mut run: Option<(u32, u64, u64)> = None; // (page, in-page start, bytes)
        while pos < end {
            let k = (pos / ps) as usize;
            let in_page = pos % ps;
            let take = (ps - in_page).min(end - pos);
            let p = self.page_at(k)?;
            if p != NO_PAGE {
                i.shm.check_page(p)?;
            }
            run = match run {
                Some((rp, rs, rn))
                    if p != NO_PAGE
                        && rp != NO_PAGE
                        && rp as u64 + (rs + rn) / ps == p as u64
                        && in_page == 0 =>
                {
                    Some((rp, rs, rn + take))
                }
                prev => {
                    if let Some(seg) = prev {
                        out.push(self.seg(seg));
                    }
                    Some((p, in_page, take))
                }
            };
            pos += take;
        }
        if let Some(seg) = run {
            out.push(self.seg(seg));
        }
        Ok(out)
    }

    fn seg(&self, (p, start, n): (u32, u64, u64)) -> &[u8] {
        let i = &self.pool.inner;
        if p == NO_PAGE {
            return &i.zeros[start as usize..(start + n) as usize];
        }
        // SAFETY: p is a checked page index and the run [p, p + pages) lies
        // in the data area (each page index was checked). The pages are held
        // by this buffer; a page shared with others is frozen (writers copy
        // first) and a page we hold alone changes only through `&mut self`,
        // which the returned borrow of `self` excludes.
        unsafe { std::slice::from_raw_parts(i.shm.page_ptr(p).add(start as usize), n as usize) }
    }

    /// The whole buffer as one slice, if its pages are consecutive in the pool.
    pub fn as_slice(&self) -> Result<Option<&[u8]>> {
        let s = self.segments(0, self.len)?;
        Ok(if s.len() == 1 {
            s.into_iter().next()
        } else {
            None
        })
    }

    /// Writes `data` at `offset`. Pages shared with a Ref or another buffer
    /// are copied first (only the pages written); unbacked pages are backed.
    /// If the pool has too few free pages for the whole write, nothing is
    /// written and `ResourceExhausted` is returned.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        let i = self.pool.inner.clone();
        i.live()?;
        self.bounds(offset, data.len() as u64)?;
        if data.is_empty() {
            return Ok(());
        }
        self.materialize()?;
        let ps = i.shm.layout.page_size as u64;
        let d = self.d()?;
        let t = i.shm.pages();
        let start = self.offset as u64 + offset;
        let end = start + data.len() as u64;
        let (k0, k1) = ((start / ps) as usize, end.div_ceil(ps) as usize);
        // Reserve every page the write may need first, so it is all or nothing.
        let mut need = 0;
        for k in k0..k1 {
            let (p, borrowed) = self.owned_page_at(k)?;
            if p == NO_PAGE || borrowed || t.rc(i.shm.check_page(p)?) != 1 {
                need += 1;
            }
        }
        let mut fresh = i.take_pages(need)?.into_iter();
        let mut pos = start;
        let mut src = 0usize;
        let mut copies = 0;
        while pos < end {
            let k = (pos / ps) as usize;
            let in_page = (pos % ps) as usize;
            let take = ((ps as usize) - in_page).min((end - pos) as usize);
            let (p, borrowed) = self.owned_page_at(k)?;
            let target = if p != NO_PAGE && !borrowed && t.rc(p) == 1 {
                p
            } else {
                // A transient share (a stale map attempt) can make a page
                // look shared after we counted: take one more page then.
                let q = match fresh.next() {
                    Some(q) => q,
                    None => i.take_pages(1)?[0],
                };
                let whole = in_page == 0 && take == ps as usize;
                if p != NO_PAGE && !whole {
                    // SAFETY: p is held by us and frozen (rc > 1); q is ours
                    // (Cached by this slot); both are distinct checked pages.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            i.shm.page_ptr(p),
                            i.shm.page_ptr(q),
                            ps as usize,
                        )
                    };
                } else if !whole {
                    // A fresh page keeps old bytes: zero what this write
                    // leaves (an unbacked page reads as zero).
                    i.shm.zero_outside(q, in_page, take);
                }
                // A borrowed page's share belongs to the Ref: nothing to drop.
                i.link_page(self.desc, d, k, if borrowed { NO_PAGE } else { p }, q)?;
                if p != NO_PAGE {
                    copies += 1;
                }
                q
            };
            // SAFETY: `target` is held by this buffer alone (rc == 1), so no
            // one else reads or writes it; the range is inside the page.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    data[src..].as_ptr(),
                    i.shm.page_ptr(target).add(in_page),
                    take,
                )
            };
            pos += take as u64;
            src += take;
        }
        i.give_pages(fresh.collect());
        if copies > 0 {
            i.shm
                .atomics()
                .cow_copies
                .fetch_add(copies, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Creates a Ref to a range of this buffer (see [`Pool::create_ref`]).
    pub fn create_ref(&self, offset: u64, len: u64) -> Result<Ref> {
        self.pool.create_ref(self, offset, len)
    }

    /// Creates a Ref to the whole buffer.
    pub fn share(&self) -> Result<Ref> {
        self.pool.create_ref(self, 0, self.len)
    }
}

impl Inner {
    /// Replaces entry `k` (old page `p`, or NO_PAGE) of an owned buffer with
    /// `q`, a page cached by this slot and already filled. The CoW journal
    /// makes this recoverable at every step (see `undo_journal`).
    pub(crate) fn link_page(&self, di: u32, d: &Desc, k: usize, p: u32, q: u32) -> Result<()> {
        let t = self.shm.pages();
        if p != NO_PAGE {
            d.journal_old.store(p, Ordering::Relaxed);
            d.journal_idx.store(k as u32, Ordering::Release);
        }
        self.set_entry(d, k, q)?;
        t.hold_cached(q, self.slot)?;
        if p != NO_PAGE {
            let mut freed = Vec::new();
            self.bulk_change(
                di,
                d,
                0,
                1,
                Src::One(p),
                Book::Journal,
                Delta::Dec(self.slot),
                &mut freed,
            )?;
            self.give_pages(freed);
        }
        Ok(())
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if !self.detached {
            let _ = self.pool.free_id(self.id());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::RefClock;
    use crate::testing::TempPool;

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
        // A process that stopped renewing for longer than its lease is
        // dead even if its wall-clock heartbeat (stepped back) looks new.
        slot.heartbeat_ms
            .store(now.wall_ms + 3_600_000, Ordering::Release);
        slot.heartbeat_mono_ms
            .store(now.mono_ms - 2 * lease, Ordering::Release);
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
            d.expiry_ms.store(
                pool.shm().ref_now(LeaseNow::read()) - 100,
                Ordering::Relaxed,
            );
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
    /// must always advance): inline, with lists, reading through a Ref,
    /// and past the inline entries of a list-less descriptor.
    #[test]
    fn every_chunk_contains_its_position() {
        let tp = TempPool::new(16 << 20);
        let pool = tp.attach();
        let ps = pool.page_size() as u64;
        let small = pool.alloc(3 * ps).unwrap();
        let mut long = pool.alloc(300 * ps).unwrap();
        long.write(0, &[1u8; 4096]).unwrap();
        let r = pool.create_ref(&long, 0, long.len()).unwrap();
        let mapped = pool.map_ref(&r).unwrap();
        let shm = &pool.inner.shm;
        for b in [&small, &long, &mapped] {
            let d = pool.inner.desc(b.desc_index()).unwrap();
            for k in 0..b.page_count() as usize + crate::desc::INLINE + 5 {
                let (base, run, span) = shm.entry_chunk(d, k).unwrap();
                assert!(base <= k && k < base + span, "{k}: {base} + {span}");
                assert!(run.len() <= span);
            }
        }
        drop((small, mapped, long));
        pool.release_ref(&r).unwrap();
        drop(pool);
        tp.assert_clean();
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
                assert!(
                    seen.len() < cool + 8,
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
}

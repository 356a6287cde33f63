//! Attaching to a pool: claiming a slot, the lease thread that renews it
//! (and reclaims what dead processes and expired Refs hold), the process's
//! page cache, and descriptor claims.

use super::Pool;
use crate::desc::{Desc, DescState, Kind, FLAG_INDIRECT, FLAG_TWO_LEVEL, INLINE};
use crate::error::{Error, Result};
use crate::page_cache::PageCache;
use crate::pages::NO_PAGE;
use crate::process::Core;
use crate::shm::{host_id, Shm};
use crate::slot::{LeaseNow, SlotKind, SlotState};
use crate::sync::Ordering;
use dm_sys::time::monotonic_ms;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
    /// Judge this attachment by its lease alone, as a process of another
    /// host is judged: its holdings are reclaimed once it stops renewing
    /// its lease, even while it runs. Default false: a process of this
    /// host and PID namespace keeps its holdings while it runs, stopped or
    /// not, and loses them at once when it is gone.
    pub lease_only: bool,
    /// Accept a pool file its group may write (mode 0660: created with
    /// [`PoolConfig::group`](crate::PoolConfig::group)). Default false: a
    /// pool file must be this user's alone.
    pub group: bool,
    /// Bytes of buffers this process may hold at most: the smaller of this
    /// and the pool's process quota ([`PoolConfig::process_quota`](crate::PoolConfig::process_quota)).
    /// Past it, an allocation or a mapping is `ResourceExhausted`.
    pub quota: Option<u64>,
    /// The tenant this process belongs to (one of the pool's
    /// [`PoolConfig::tenants`](crate::PoolConfig::tenants)): its buffers
    /// count against the tenant's quota too.
    pub tenant: Option<String>,
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
            lease_only: false,
            group: false,
            quota: None,
            tenant: None,
        }
    }
}

pub(crate) struct Inner {
    pub(super) core: Arc<Core>,
    pub(super) cache: Mutex<PageCache>,
    /// How many pages freed pages cool behind (`AttachOptions::cool_pages`,
    /// capped; `page_cache.rs`).
    pub(super) cool: usize,
    pub(super) opts: AttachOptions,
    pub(super) zeros: Box<[u8]>,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) lease_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
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

impl Pool {
    pub(super) fn attach(shm: Shm, opts: AttachOptions) -> Result<Pool> {
        // (Counted before the slot is claimed: a fork from here on makes a
        // child that must not use this attachment.)
        let forks = dm_sys::proc::watch_forks();
        let now = LeaseNow::read();
        let lease = opts.lease_ms.unwrap_or(shm.layout.lease_ms).max(10);
        let tenant = match &opts.tenant {
            Some(name) => shm.find_tenant(name)?,
            None => 0,
        };
        let quota_pages = {
            let ps = shm.layout.page_size as u64;
            let pool = shm.quotas().process_pages.load(Ordering::Relaxed);
            let mine = opts.quota.map_or(0, |b| b.div_ceil(ps).max(1));
            match (pool, mine) {
                (0, m) | (m, 0) => m,
                (p, m) => p.min(m),
            }
        };
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
            let (ns, start) = if opts.lease_only {
                (0, 0)
            } else {
                let me = dm_sys::proc::pid();
                (
                    dm_sys::proc::pid_namespace(),
                    dm_sys::proc::start_time(me).unwrap_or(0),
                )
            };
            s.pid_ns.store(ns, Ordering::Relaxed);
            s.start.store(start, Ordering::Relaxed);
            s.held_pages.store(0, Ordering::Relaxed);
            s.quota_pages.store(quota_pages, Ordering::Relaxed);
            s.tenant.store(tenant, Ordering::Relaxed);
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
        shm.attached();
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
            forks,
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
            let _ = crate::progress::Pass::quiet(|p| core.maintain(&mut freed, false, p));
            core.release_freed(freed);
        }
    }
}

impl Inner {
    /// Gives a descriptor of `n` entries the list pages it needs (one
    /// level or two: `desc.rs`).
    /// `fill`: mark entries `[0, n)` as unbacked (a fresh buffer). Builders
    /// that write all `n` entries themselves pass false. Entries past `n`
    /// are zeroed (taken pages keep old bytes), though every reader of a
    /// descriptor stops at `n` (or `held`).
    ///
    /// Crash order: the flags first, then each second-level list filled
    /// with NO_PAGE, named and held, then each first-level list filled,
    /// named and held. A list named but not yet held is still cached by
    /// this slot, which is how a reclaimer tells (`normalize`).
    pub(crate) fn attach_lists(&self, d: &Desc, n: usize, fill: bool) -> Result<()> {
        let (firsts, seconds) = self.shm.lists_needed(n);
        if firsts == 0 {
            return Ok(());
        }
        if seconds > INLINE || n > self.shm.layout.n_pages as usize {
            return Err(Error::TooLarge {
                len: n as u64 * self.shm.layout.page_size as u64,
                max: self.shm.layout.max_len(),
            });
        }
        let got = self.take_pages(firsts + seconds)?;
        let (tops, lists) = got.split_at(seconds);
        let two = if seconds > 0 { FLAG_TWO_LEVEL } else { 0 };
        d.flags.fetch_or(FLAG_INDIRECT | two, Ordering::Release);
        let pages = self.shm.pages();
        let per = self.shm.layout.per_list_page();
        for (c, &l) in tops.iter().enumerate() {
            for e in self.shm.list(l)? {
                e.store(NO_PAGE, Ordering::Relaxed);
            }
            d.entries[c].store(l, Ordering::Release);
            pages.hold_cached(l, self.slot)?;
        }
        for (k, &l) in lists.iter().enumerate() {
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
            let slot = if seconds == 0 {
                &d.entries[k]
            } else {
                &self.shm.list(tops[k / per])?[k % per]
            };
            slot.store(l, Ordering::Release);
            pages.hold_cached(l, self.slot)?;
        }
        Ok(())
    }

    /// Gives a descriptor of `n` entries that will name lists it does not
    /// own (a Ref sharing its buffer's lists) its list flags and, for two
    /// levels, `seconds` second-level lists of its own, filled with
    /// NO_PAGE (the crash order of [`attach_lists`](Self::attach_lists)).
    pub(crate) fn attach_tops(&self, d: &Desc, n: usize, seconds: usize) -> Result<()> {
        if seconds > INLINE || n > self.shm.layout.n_pages as usize {
            return Err(Error::TooLarge {
                len: n as u64 * self.shm.layout.page_size as u64,
                max: self.shm.layout.max_len(),
            });
        }
        let tops = self.take_pages(seconds)?;
        let two = if seconds > 0 { FLAG_TWO_LEVEL } else { 0 };
        d.flags.fetch_or(FLAG_INDIRECT | two, Ordering::Release);
        let pages = self.shm.pages();
        for (c, &l) in tops.iter().enumerate() {
            for e in self.shm.list(l)? {
                e.store(NO_PAGE, Ordering::Relaxed);
            }
            d.entries[c].store(l, Ordering::Release);
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
            crate::progress::Pass::quiet(|p| self.maintain_local(false, p))?;
        }
    }

    /// `n` pages consecutive in the pool if there are such, else any `n`
    /// ([`take_pages`](Self::take_pages)): a run the cache holds, or one
    /// claimed from the free pages.
    /// For buffers whose pages should read as one slice.
    pub(crate) fn take_run(&self, n: usize) -> Result<Vec<u32>> {
        if n > 1 {
            let mut cache = self
                .cache
                .lock()
                .map_err(|_| Error::Corrupt("page cache lock poisoned".into()))?;
            if let Some(run) = cache.take_run(n) {
                return Ok(run);
            }
            // (A bounded scan: a fragmented pool gives scattered pages.)
            let t = self.shm.pages();
            if let Some(first) = t.claim_run(&self.shm.atomics().page_cursor, self.slot, n, 64 * n)
            {
                cache.refilled((first..first + n as u32).collect(), n);
                if let Some(run) = cache.take_run(n) {
                    return Ok(run);
                }
            }
        }
        self.take_pages(n)
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
        let keep = self.opts.cache_max / 2;
        let t = self.shm.pages();
        let mut first = None;
        let mut pages = pages;
        if pages.len() > self.opts.cache_max {
            // A large buffer freed: all but the last `keep` of its pages go
            // straight back (the cache would give them back at once).
            let (back, _) = pages.split_at(pages.len() - keep);
            first = t.release_cached_run(back, self.slot).1;
            pages.drain(..pages.len() - keep);
        }
        cache.give(pages, self.cool);
        if cache.len() > self.opts.cache_max {
            let mut back = Vec::with_capacity(cache.len() - keep);
            while cache.len() > keep {
                match cache.pop_oldest() {
                    Some(p) => back.push(p),
                    None => break,
                }
            }
            if let Some(f) = t.release_cached_run(&back, self.slot).1 {
                first = Some(first.map_or(f, |g: u32| g.min(f)));
            }
        }
        if let Some(f) = first {
            self.shm
                .atomics()
                .page_cursor
                .store(u64::from(f), Ordering::Relaxed);
        }
    }

    /// Drops a descriptor this slot owns in `kind` (abort of a build, or free).
    pub(super) fn drop_own(&self, idx: u32, gen: u32, kind: Kind, end: u32) -> Result<()> {
        let d = self.desc(idx)?;
        let n = d.n_pages.load(Ordering::Relaxed);
        if kind == Kind::Buf {
            d.held.store(n, Ordering::Relaxed);
            self.uncharge(n as u64);
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

    /// Reclaims dead slots and expired Refs (of every descriptor group
    /// with `all`, else of those due), keeping freed pages.
    pub(crate) fn maintain_local(
        &self,
        all: bool,
        pass: &mut crate::progress::Pass<'_>,
    ) -> Result<crate::reclaim::GcReport> {
        let mut freed = Vec::new();
        let r = self.core.maintain(&mut freed, all, pass);
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
        if dm_sys::proc::forks() != self.core.forks {
            // A child forked after the attach: the slot, its holdings and
            // the lease thread (which the child does not have) are the
            // parent's. Leave them be.
            return;
        }
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
                    shm.note_expiry(idx, 0);
                }
            }
        }
        a.ref_clock_host.store(host_id(), Ordering::Release);
        Ok(true)
    };
    a.maint.store(0, Ordering::SeqCst);
    res
}

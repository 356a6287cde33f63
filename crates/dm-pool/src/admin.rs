//! Commands on a pool by its path (`dmrpc pool gc`, `info`): gc, which
//! attaches briefly, reclaims, and repairs page counts when no other
//! process is attached; and what the pool says of itself without an
//! attach (its layout, whose clock its Refs keep).

use crate::check::{count_holders, slots_live, CheckReport, Problems};
use crate::error::Result;
use crate::pages::PageState;
use crate::pool::{AttachOptions, Pool};
use crate::progress::{Pass, Progress};
use crate::reclaim::GcReport;
use crate::registry::ServiceInfo;
use crate::shm::Shm;
use crate::slot::{SlotKind, SlotState};
use crate::sync::Ordering;
use std::path::Path;

/// Attaches briefly and reclaims: dead slots, expired Refs and, when no
/// other process is attached, recounts every page from the descriptors and
/// repairs what an ill-timed crash leaked.
pub fn gc_path(path: &Path) -> Result<GcReport> {
    gc_path_with(path, false)
}

/// [`gc_path`], and first, with `now`, ends the quarantine of processes
/// whose lease ran out ([`PoolConfig::quarantine_ms`](crate::PoolConfig::quarantine_ms)):
/// the operator says they are gone, not stopped.
pub fn gc_path_with(path: &Path, now: bool) -> Result<GcReport> {
    gc_path_progress(path, now, &mut |_| {})
}

/// [`gc_path_with`], telling `progress` how far it has come: at the start
/// and end of each part (slots, expiry groups, then the recount's
/// descriptors and pages) and every 65 536 items.
pub fn gc_path_progress(
    path: &Path,
    now: bool,
    progress: &mut dyn FnMut(Progress),
) -> Result<GcReport> {
    if now {
        Shm::open(path, dm_sys::mem::Access::Own)?.end_quarantines();
    }
    gc_inner(path, &mut Pass(progress))
}

fn gc_inner(path: &Path, pass: &mut Pass<'_>) -> Result<GcReport> {
    let pool = Pool::open(
        path,
        AttachOptions {
            heartbeat: false,
            name: Some("dmrpc-gc".into()),
            ..Default::default()
        },
    )?;
    // Every descriptor group, whatever the expiry summary says.
    let mut rep = pool.inner.maintain_local(true, pass)?;
    recount(&pool, &mut rep, pass)?;
    Ok(rep)
}

fn recount(pool: &Pool, rep: &mut GcReport, pass: &mut Pass<'_>) -> Result<()> {
    let shm = pool.shm();
    let me = pool.slot();
    let a = shm.atomics();
    if a.maint
        .compare_exchange(0, me as u64 + 1, Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        return Ok(());
    }
    let others = (0..shm.layout.n_slots as u16).any(|s| {
        s != me
            && shm.slot(s).is_some_and(|sl| {
                SlotState::decode(sl.state.load(Ordering::SeqCst)).kind != Some(SlotKind::Free)
            })
    });
    let res = if others {
        Ok(())
    } else {
        repair(pool, shm, me, rep, pass)
    };
    a.maint.store(0, Ordering::SeqCst);
    res
}

fn repair(pool: &Pool, shm: &Shm, me: u16, rep: &mut GcReport, pass: &mut Pass<'_>) -> Result<()> {
    rep.recounted = true;
    // No other process holds anything: no tenant does (this one's own
    // buffers are a gc's, none).
    shm.reset_tenants();
    // Descriptors owned by slots that no longer exist (we are the only
    // slot: every other owner is gone).
    pool.inner.reclaim_orphans()?;
    let mut problems = Problems::default();
    let mut scratch = CheckReport::default();
    let live = slots_live(shm, crate::slot::LeaseNow::read());
    let holders = count_holders(shm, &mut problems, &mut scratch, &live, pass).count;
    let t = shm.pages();
    let n = holders.len() as u64;
    for (p, &h) in holders.iter().enumerate() {
        pass.at("pages", p as u64, n);
        let p = p as u32;
        let st = t.state(p)?;
        let fixed = match st {
            PageState::Held(rc) if rc == h => continue,
            PageState::Cached(s) if s == me && h == 0 => continue,
            PageState::Free if h == 0 => continue,
            _ if h == 0 => PageState::Free,
            _ => PageState::Held(h),
        };
        // Quiescent (maintenance lock held, no other slot): a plain CAS suffices.
        let w = &shm_words(shm)[p as usize];
        if w.compare_exchange(
            st.encode(),
            fixed.encode(),
            Ordering::AcqRel,
            Ordering::Acquire,
        )
        .is_ok()
        {
            rep.pages_repaired += 1;
        }
    }
    Ok(())
}

fn shm_words(shm: &Shm) -> &[crate::sync::AtomicU64] {
    shm.page_words()
}

/// Whether the pool at `path` keeps its Refs on a clock this process
/// reads as its own (no attach): the wall clock, or the monotonic clock
/// of this host's boot ([`RefClock`](crate::RefClock)). False for a
/// host-clock pool another host (or an earlier boot) owns: the next
/// process of this host to attach takes it over once none of that host's
/// processes lives, and expires the Refs left from it.
pub fn ref_clock_is_ours(path: &Path) -> Result<bool> {
    Ok(Shm::open(path, dm_sys::mem::Access::Group)?.ref_clock_is_ours())
}

/// The validated layout of the pool at `path` (no attach).
pub fn layout_of(path: &Path) -> Result<crate::layout::Layout> {
    Ok(Shm::open(path, dm_sys::mem::Access::Group)?.layout)
}

/// Every service registered in the pool at `path` (no attach), each with
/// the number of open connections to it: what `dmrpc ls` shows.
pub fn services_at(path: &Path) -> Result<Vec<(ServiceInfo, usize)>> {
    let shm = Shm::open(path, dm_sys::mem::Access::Group)?;
    Ok(shm
        .list_services()
        .into_iter()
        .map(|s| {
            let conns = shm.channels_of(s.index, s.generation);
            (s, conns)
        })
        .collect())
}

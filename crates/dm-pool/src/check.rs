//! `dmrpc pool check` and `stats`: the pool's consistency invariant and
//! its counters, read without attaching. The repair that gc does when it
//! finds the pool quiescent is in `admin.rs`.
//!
//! The invariant (`docs/design.md`, *The invariant*): every page is exactly one of free, cached
//! in a live slot's page cache, or held; a held page's reference count equals the
//! number of descriptor entries naming it (buffers, Refs, list pages); free
//! pages are zero. The check reads the pool without attaching, and is exact
//! when no process is in the middle of an operation (run it when quiescent,
//! e.g. after tests). On a busy pool a pass can see work in flight as a
//! problem, so a check with problems passes again, a few milliseconds
//! apart, and reports only those every pass found; an operation stalled
//! in flight for longer can still be reported.

use crate::desc::{Desc, DescState, Kind, FLAG_INDIRECT};
use crate::error::Result;
use crate::pages::{PageState, NO_PAGE};
use crate::progress::{Pass, Progress};
use crate::shm::Shm;
use crate::slot::{LeaseNow, SlotKind, SlotState};
use crate::sync::Ordering;
use std::path::Path;

/// Counts and problems found by a check.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CheckReport {
    /// Data pages in the pool.
    pub pages_total: u64,
    /// Pages in the free set.
    pub pages_free: u64,
    /// Pages cached in slots' page caches.
    pub pages_cached: u64,
    /// Pages held (data and list pages).
    pub pages_held: u64,
    /// Of the held pages, list pages (page lists of large descriptors).
    pub pages_lists: u64,
    /// Of the held data pages, those more than one holder reads (refcount
    /// above one, or named by a list several descriptors share).
    pub pages_shared: u64,
    /// Live Refs.
    pub refs_live: u64,
    /// Of the live Refs, those released but kept by buffers mapped from them.
    pub refs_released_mapped: u64,
    /// Live buffers.
    pub buffers: u64,
    /// Descriptors in flight (building or dropping).
    pub descs_in_flight: u64,
    /// Descriptors in the table.
    pub descs_total: u64,
    /// Live slots (attached processes).
    pub slots_live: u64,
    /// Slots whose lease expired and are not yet reclaimed.
    pub slots_dead: u64,
    /// Slots in the table.
    pub slots_total: u64,
    /// Registered services.
    pub services: u64,
    /// Channels in use.
    pub channels: u64,
    /// Quotas and what is held against them: each tenant, and each live
    /// process that holds buffers or has a quota.
    pub quotas: Vec<QuotaUse>,
    /// Every process's quota unless its attach asks for less, in pages
    /// (0: none).
    pub process_quota_pages: u64,
    /// Every violation of the invariant, precisely.
    pub problems: Vec<String>,
}

/// A quota and what is held against it (pages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaUse {
    /// `tenant NAME`, or `process PID (NAME)`.
    pub who: String,
    /// Pages of buffers held.
    pub held_pages: u64,
    /// The quota in pages (0: none).
    pub quota_pages: u64,
}

impl CheckReport {
    /// Whether the invariant holds.
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// The problems a check found: the first [`MAX_PROBLEMS`] said, the rest
/// counted, so a wrecked pool's report stays small.
#[derive(Default)]
pub(crate) struct Problems {
    said: Vec<String>,
    more: u64,
}

/// Problems a report says one by one.
const MAX_PROBLEMS: usize = 1000;

impl Problems {
    pub(crate) fn push(&mut self, p: String) {
        if self.said.len() < MAX_PROBLEMS {
            self.said.push(p);
        } else {
            self.more += 1;
        }
    }

    fn into_vec(mut self) -> Vec<String> {
        if self.more > 0 {
            self.said
                .push(format!("and {} more problems not listed", self.more));
        }
        self.said
    }
}

/// Counts how many descriptor entries name each page. Returns problems for
/// entries that name no page of the pool.
pub(crate) fn count_holders(
    shm: &Shm,
    problems: &mut Problems,
    rep: &mut CheckReport,
    live: &[bool],
    pass: &mut Pass<'_>,
) -> Holders {
    let n = shm.layout.n_pages as usize;
    let mut holders = vec![0u32; n];
    // First-level lists whose entries were counted: a list shared by
    // several descriptors holds its pages once (`desc.rs`).
    let mut seen = vec![0u64; n.div_ceil(64)];
    // Data pages read through a list others hold too.
    let mut shared = vec![0u64; n.div_ceil(64)];
    // Mapped buffers linked to each Ref (its mapper count must match).
    let mut links = std::collections::HashMap::<u32, u32>::new();
    let n_descs = shm.layout.n_descs;
    for idx in 0..n_descs {
        pass.at("descriptors (mappings)", idx as u64, n_descs as u64);
        let Some(d) = shm.desc(idx) else { continue };
        let st = DescState::decode(d.state.load(Ordering::Acquire));
        if matches!(st.kind, Some(Kind::Buf | Kind::MapBuild | Kind::Drop))
            && d.aux.load(Ordering::Acquire) == 1
        {
            *links
                .entry(d.tag.load(Ordering::Acquire) as u32)
                .or_default() += 1;
        }
    }
    for idx in 0..n_descs {
        pass.at("descriptors (Refs)", idx as u64, n_descs as u64);
        let Some(d) = shm.desc(idx) else { continue };
        if DescState::decode(d.state.load(Ordering::Acquire)).kind != Some(Kind::RefLive) {
            continue;
        }
        let a = d.aux.load(Ordering::Acquire);
        let linked = links.get(&idx).copied().unwrap_or(0);
        if crate::desc::mappers::locker(a).is_none() && crate::desc::mappers::count(a) != linked {
            problems.push(format!(
                "Ref {idx}: mapper count {} but {linked} buffers mapped from it",
                crate::desc::mappers::count(a)
            ));
        }
        if crate::desc::mappers::released(a) && linked > 0 {
            rep.refs_released_mapped += 1;
        }
        if !crate::desc::mappers::released(a) {
            // The expiry summary may say early, never late (`expiry.rs`).
            let at = d.expiry_ms.load(Ordering::Acquire);
            let group = shm
                .expiry_word(idx / crate::layout::EXPIRY_GROUP)
                .map_or(0, |w| w.load(Ordering::Acquire));
            let top = shm.atomics().expiry_top.load(Ordering::Acquire);
            if group > at || top > at {
                problems.push(format!(
                    "Ref {idx}: expires at {at} but the expiry summary says {} (a sweep \
                     would not find it; gc sweeps every group)",
                    group.max(top)
                ));
            }
        }
    }
    for idx in 0..n_descs {
        pass.at("descriptors (pages named)", idx as u64, n_descs as u64);
        let Some(d) = shm.desc(idx) else { continue };
        let st = DescState::decode(d.state.load(Ordering::Acquire));
        let (lo, hi) = match st.kind {
            Some(Kind::Free) => continue,
            Some(Kind::Buf) => {
                rep.buffers += 1;
                (0, d.n_pages.load(Ordering::Acquire))
            }
            Some(Kind::RefLive) => {
                rep.refs_live += 1;
                (0, d.n_pages.load(Ordering::Acquire))
            }
            Some(Kind::RefBuild)
                if d.flags.load(Ordering::Acquire) & crate::desc::FLAG_LIST_BUILD != 0 =>
            {
                // Its lists up to `held` hold a count, and their entries.
                rep.descs_in_flight += 1;
                in_flight(idx, st.owner, live, problems);
                let held = d.held.load(Ordering::Acquire);
                let n = d.n_pages.load(Ordering::Acquire);
                rep.pages_lists += count_desc(
                    shm,
                    Counting {
                        idx,
                        d,
                        lo: 0,
                        hi: n,
                        lists_from: 0,
                        lists_held: Some(held),
                    },
                    &mut holders,
                    (&mut seen, &mut shared),
                    problems,
                );
                continue;
            }
            Some(Kind::MapBuild) | Some(Kind::RefBuild) => {
                rep.descs_in_flight += 1;
                in_flight(idx, st.owner, live, problems);
                (0, d.held.load(Ordering::Acquire))
            }
            Some(Kind::Drop) => {
                rep.descs_in_flight += 1;
                in_flight(idx, st.owner, live, problems);
                let (pr, held) = (
                    d.progress.load(Ordering::Acquire),
                    d.held.load(Ordering::Acquire),
                );
                // Positions >= held are list slots: those below progress are done.
                rep.pages_lists += count_desc(
                    shm,
                    Counting {
                        idx,
                        d,
                        lo: pr.min(held),
                        hi: held,
                        lists_from: pr.saturating_sub(held),
                        lists_held: None,
                    },
                    &mut holders,
                    (&mut seen, &mut shared),
                    problems,
                );
                continue;
            }
            None => {
                problems.push(format!("descriptor {idx}: invalid state word"));
                continue;
            }
        };
        rep.pages_lists += count_desc(
            shm,
            Counting {
                idx,
                d,
                lo,
                hi,
                lists_from: 0,
                lists_held: None,
            },
            &mut holders,
            (&mut seen, &mut shared),
            problems,
        );
    }
    pass.end("descriptors (pages named)", n_descs as u64);
    Holders {
        count: holders,
        lists: seen,
        shared,
    }
}

/// What [`count_holders`] found.
pub(crate) struct Holders {
    /// Per page, the descriptors (and lists) holding it.
    pub count: Vec<u32>,
    /// First-level list pages whose entries were counted.
    lists: Vec<u64>,
    /// Data pages read through a list several descriptors hold.
    shared: Vec<u64>,
}

impl Holders {
    /// Whether page `p`, held `rc` times, is a data page more than one
    /// holder reads: by its count, or through a shared list.
    fn read_by_several(&self, p: usize, rc: u32) -> bool {
        let bit = |v: &[u64]| v.get(p / 64).is_some_and(|w| w & (1 << (p % 64)) != 0);
        (rc > 1 && !bit(&self.lists)) || bit(&self.shared)
    }
}

/// Entries past a live descriptor's page count, in its last list page,
/// must be zero.
fn check_list_tails(shm: &Shm, problems: &mut Problems, pass: &mut Pass<'_>) {
    let per = shm.layout.per_list_page();
    let n = shm.layout.n_descs;
    for idx in 0..n {
        pass.at("list pages", idx as u64, n as u64);
        let Some(d) = shm.desc(idx) else { continue };
        let kind = DescState::decode(d.state.load(Ordering::Acquire)).kind;
        if !matches!(kind, Some(Kind::Buf) | Some(Kind::RefLive))
            || d.flags.load(Ordering::Acquire) & FLAG_INDIRECT == 0
        {
            continue;
        }
        let n = d.n_pages.load(Ordering::Acquire) as usize;
        let k = n.div_ceil(per).saturating_sub(1);
        let Ok(l) = shm.list_page(d, k) else { continue };
        let Ok(list) = shm.list(l) else { continue };
        if let Some(at) = list[(n - k * per).min(per)..]
            .iter()
            .position(|e| e.load(Ordering::Relaxed) != 0)
        {
            problems.push(format!(
                "descriptor {idx}: list page {l} has a nonzero entry {} past its {n} pages",
                k * per + (n - k * per) + at
            ));
        }
    }
}

fn in_flight(idx: u32, owner: u16, live: &[bool], problems: &mut Problems) {
    if !live.get(owner as usize).copied().unwrap_or(false) {
        problems.push(format!(
            "descriptor {idx}: interrupted operation of dead slot {owner} (run gc)"
        ));
    }
}

/// What of a descriptor [`count_desc`] counts.
struct Counting<'a> {
    idx: u32,
    d: &'a Desc,
    /// Data entries `[lo, hi)`.
    lo: u32,
    hi: u32,
    /// List slots from this one.
    lists_from: u32,
    /// A Ref sharing its buffer's lists, being built: the first-level
    /// lists below this one hold a count.
    lists_held: Option<u32>,
}

/// Counts a descriptor's entries `[lo, hi)` and list pages; returns the
/// number of list pages. The entries of a first-level list are counted
/// once, by the first descriptor naming it (`seen`).
fn count_desc(
    shm: &Shm,
    c: Counting<'_>,
    holders: &mut [u32],
    (seen, shared): (&mut [u64], &mut [u64]),
    problems: &mut Problems,
) -> u64 {
    let Counting {
        idx,
        d,
        lo,
        hi,
        lists_from,
        lists_held,
    } = c;
    let mut lists = 0;
    let n = holders.len() as u32;
    let per = shm.layout.per_list_page() as u32;
    let indirect = shm.list_span(d) > 0 && shm.inherits_from(d).is_none();
    let firsts_end = if !indirect {
        0
    } else if d.flags.load(Ordering::Acquire) & crate::desc::FLAG_TWO_LEVEL != 0 {
        (crate::desc::INLINE as u32).saturating_mul(per)
    } else {
        crate::desc::INLINE as u32
    };
    let mut k = lo;
    while k < hi {
        if indirect {
            // One first-level list at a time.
            let j = k / per;
            let end = (j + 1).saturating_mul(per).min(hi);
            let l = shm.list_page(d, j as usize).unwrap_or(NO_PAGE);
            let held = lists_held.is_none_or(|h| j < h);
            if l == NO_PAGE || l >= n || !held || seen[l as usize / 64] & (1 << (l % 64)) != 0 {
                k = end;
                continue;
            }
            seen[l as usize / 64] |= 1 << (l % 64);
            let via_shared = shm.pages().rc(l) > 1;
            for k in k..end {
                if let Some(p) = count_entry(shm, idx, d, k, holders, problems) {
                    if via_shared {
                        shared[p as usize / 64] |= 1 << (p % 64);
                    }
                }
            }
            k = end;
        } else {
            count_entry(shm, idx, d, k, holders, problems);
            k += 1;
        }
    }
    each_list_slot(shm, d, lists_from, |k, l| match l {
        // (A list a Ref being built took no count on yet.)
        Ok(_) if lists_held.is_some_and(|h| (k as u32) < firsts_end && k as u32 >= h) => {}
        Ok(l) if l < n => {
            // (A shared list page is one page, however many name it.)
            lists += u64::from(holders[l as usize] == 0);
            holders[l as usize] += 1;
        }
        Ok(l) => problems.push(format!(
            "descriptor {idx} list {k}: page {l} outside the pool"
        )),
        Err(e) => problems.push(format!("descriptor {idx} list {k}: {e}")),
    });
    lists
}

/// Counts data entry `k` of descriptor `idx`; returns the page it holds.
fn count_entry(
    shm: &Shm,
    idx: u32,
    d: &Desc,
    k: u32,
    holders: &mut [u32],
    problems: &mut Problems,
) -> Option<u32> {
    let n = holders.len() as u32;
    match shm.raw_entry(d, k as usize) {
        Ok(NO_PAGE) => {}
        Ok(p) if p & crate::pages::BORROWED != 0 => {} // the Ref holds it
        Ok(p) if p < n => {
            holders[p as usize] += 1;
            return Some(p);
        }
        Ok(p) => problems.push(format!(
            "descriptor {idx} entry {k}: page {p} outside the pool"
        )),
        Err(e) => problems.push(format!("descriptor {idx} entry {k}: {e}")),
    }
    None
}

/// Calls `f` with every list slot from `from` that names a page (or
/// cannot be read), in order.
fn each_list_slot(shm: &Shm, d: &Desc, from: u32, mut f: impl FnMut(usize, Result<u32>)) {
    let span = shm.list_span(d) as usize;
    let mut j = from as usize;
    while j < span {
        match shm.list_chunk(d, j) {
            Ok((base, run, len)) => {
                for (i, e) in run.iter().enumerate().skip(j - base) {
                    match e.load(Ordering::Acquire) {
                        NO_PAGE => {}
                        l => f(base + i, Ok(l)),
                    }
                }
                j = base + len;
            }
            Err(e) => {
                f(j, Err(e));
                return;
            }
        }
    }
}

/// Which descriptors name page `p` (as an entry they hold or a list
/// page), for a problem report: a pass over every descriptor, run only
/// for pages found wrong.
fn who_names(shm: &Shm, p: u32) -> String {
    let mut found = Vec::new();
    for idx in 0..shm.layout.n_descs {
        let Some(d) = shm.desc(idx) else { continue };
        let st = DescState::decode(d.state.load(Ordering::Acquire));
        if matches!(st.kind, None | Some(Kind::Free)) {
            continue;
        }
        let n = d.n_pages.load(Ordering::Acquire);
        let what = format!(
            "descriptor {idx} ({:?} of slot {}, held {}, progress {}, flags {:#x})",
            st.kind,
            st.owner,
            d.held.load(Ordering::Acquire),
            d.progress.load(Ordering::Acquire),
            d.flags.load(Ordering::Acquire)
        );
        for k in 0..n {
            if shm.raw_entry(d, k as usize).ok() == Some(p) {
                found.push(format!("{what} entry {k}"));
            }
        }
        each_list_slot(shm, d, 0, |k, l| {
            if l.ok() == Some(p) {
                found.push(format!("{what} list {k}"));
            }
        });
    }
    found.join("; ")
}

/// Checks the invariant. `deep` also reads the list pages of every live
/// descriptor, whose entries past its page count must be zero (taken pages
/// keep old bytes since format 5, so list pages are zeroed where unused).
pub(crate) fn check_shm(shm: &Shm, deep: bool, pass: &mut Pass<'_>) -> CheckReport {
    let mut rep = CheckReport {
        pages_total: shm.layout.n_pages as u64,
        descs_total: shm.layout.n_descs as u64,
        slots_total: shm.layout.n_slots as u64,
        ..Default::default()
    };
    let now = LeaseNow::read();
    let mut problems = Problems::default();
    rep.process_quota_pages = shm.quotas().process_pages.load(Ordering::Relaxed);
    for (name, held, quota) in shm.tenant_usage() {
        rep.quotas.push(QuotaUse {
            who: format!("tenant {name}"),
            held_pages: held,
            quota_pages: quota,
        });
    }
    for s in 0..shm.layout.n_slots as u16 {
        let Some(slot) = shm.slot(s) else { continue };
        let st = SlotState::decode(slot.state.load(Ordering::Acquire));
        match st.kind {
            Some(SlotKind::Live) if shm.in_quarantine(slot, None, now) => {
                rep.slots_dead += 1;
                problems.push(format!(
                    "slot {s} (pid {}): lease expired, holdings kept in quarantine in case it \
                     was only stopped (`dmrpc pool gc --now` reclaims them if it is gone)",
                    slot.pid.load(Ordering::Relaxed)
                ));
            }
            Some(SlotKind::Live) if shm.slot_expired(slot, now) => {
                rep.slots_dead += 1;
                problems.push(format!(
                    "slot {s} (pid {}): lease expired, holdings not yet reclaimed (run gc)",
                    slot.pid.load(Ordering::Relaxed)
                ));
            }
            Some(SlotKind::Live) => {
                rep.slots_live += 1;
                let (held, quota) = (
                    slot.held_pages.load(Ordering::Relaxed),
                    slot.quota_pages.load(Ordering::Relaxed),
                );
                if held != 0 || quota != 0 {
                    let name: Vec<u8> = slot
                        .name
                        .iter()
                        .flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes())
                        .take_while(|&c| c != 0)
                        .collect();
                    rep.quotas.push(QuotaUse {
                        who: format!(
                            "process {} ({})",
                            slot.pid.load(Ordering::Relaxed),
                            String::from_utf8_lossy(&name)
                        ),
                        held_pages: held,
                        quota_pages: quota,
                    });
                }
            }
            Some(SlotKind::Reclaiming) => {
                rep.slots_dead += 1;
                problems.push(format!(
                    "slot {s}: reclaim in progress by slot {}",
                    st.reclaimer
                ));
            }
            Some(SlotKind::Free) => {}
            None => problems.push(format!("slot {s}: invalid state word")),
        }
    }
    if rep.slots_live == 0 && rep.slots_dead == 0 {
        // Nobody holds anything: neither does a tenant.
        for q in rep.quotas.iter().filter(|q| q.held_pages != 0) {
            problems.push(format!(
                "{} counts {} pages with no process attached (run gc to recount)",
                q.who, q.held_pages
            ));
        }
    }
    // Each slot's liveness once (for a process of this host, a system call).
    let live = slots_live(shm, now);
    let found = count_holders(shm, &mut problems, &mut rep, &live, pass);
    let holders = &found.count;
    if deep {
        check_list_tails(shm, &mut problems, pass);
    }
    let is_live = |s: u16| live.get(s as usize).copied().unwrap_or(false);
    let t = shm.pages();
    for st in 0..t.stripe_count() {
        if let Some(h) = t.stripe_holder(st) {
            let owner = shm
                .desc(h)
                .map(|d| DescState::decode(d.state.load(Ordering::Acquire)).owner);
            if !owner.is_some_and(is_live) {
                problems.push(format!(
                    "stripe {st}: locked by descriptor {h} whose owner is gone (run gc)"
                ));
            }
        }
    }
    // Pages found free but named whose namers are looked up (a pass over
    // every descriptor each): enough to diagnose, bounded on a wrecked pool.
    let mut named_left = 8;
    let n_pages = holders.len() as u64;
    for (p, &h) in holders.iter().enumerate() {
        pass.at("pages", p as u64, n_pages);
        let p = p as u32;
        match t.state(p) {
            Ok(PageState::Free) => {
                rep.pages_free += 1;
                if h > 0 {
                    let by = if named_left > 0 {
                        named_left -= 1;
                        format!(" ({})", who_names(shm, p))
                    } else {
                        String::new()
                    };
                    problems.push(format!(
                        "page {p}: free but named by {h} descriptor entries{by}"
                    ));
                }
            }
            Ok(PageState::Cached(s)) => {
                rep.pages_cached += 1;
                if !is_live(s) {
                    problems.push(format!(
                        "page {p}: cached by slot {s}, which is not live (run gc)"
                    ));
                }
                if h > 0 && is_live(s) {
                    problems.push(format!(
                        "page {p}: cached by slot {s} but named by {h} descriptor entries"
                    ));
                }
            }
            Ok(PageState::Held(rc)) => {
                rep.pages_held += 1;
                if found.read_by_several(p as usize, rc) {
                    rep.pages_shared += 1;
                }
                if rc > h {
                    problems.push(format!(
                        "page {p}: refcount {rc} but {h} holders ({} share(s) leaked)",
                        rc - h
                    ));
                } else if rc < h {
                    problems.push(format!(
                        "page {p}: refcount {rc} but {h} holders (over-released)"
                    ));
                }
            }
            Ok(PageState::Locked { rc, desc }) => {
                rep.pages_held += 1;
                let owner = shm
                    .desc(desc)
                    .map(|d| DescState::decode(d.state.load(Ordering::Acquire)).owner);
                match owner {
                    Some(o) if is_live(o) => {} // an operation in flight
                    _ => problems.push(format!(
                        "page {p}: refcount {rc}, locked by descriptor {desc} whose owner is gone (run gc)"
                    )),
                }
            }
            Ok(PageState::Invalid(w)) => {
                problems.push(format!("page {p}: invalid page word {w:#x}"))
            }
            Err(e) => problems.push(format!("page {p}: {e}")),
        }
    }
    for s in shm.list_services() {
        rep.services += 1;
        if !s.live {
            problems.push(format!(
                "service {:?} (record {}): its owner slot {} is gone (run gc)",
                s.name, s.index, s.slot
            ));
        }
    }
    for (i, client, server) in shm.channels_in_use() {
        rep.channels += 1;
        if !is_live(client) && !is_live(server) {
            problems.push(format!(
                "channel {i}: both ends (slots {client} and {server}) are gone (run gc)"
            ));
        }
    }
    pass.end("pages", n_pages);
    rep.problems = problems.into_vec();
    rep
}

/// Whether each slot is live at `now`, by slot index.
pub(crate) fn slots_live(shm: &Shm, now: LeaseNow) -> Vec<bool> {
    (0..shm.layout.n_slots)
        .map(|s| shm.slot_live(s as u16, now))
        .collect()
}

/// Checks the pool in this process's mapping (see [`settled`]).
pub(crate) fn check(shm: &Shm) -> CheckReport {
    Pass::quiet(|pass| settled(|| check_shm(shm, false, pass), PAUSE))
}

/// Checks the pool at `path` without attaching to it. A pass that finds
/// problems is repeated, a few milliseconds apart, and only the problems
/// every pass found are reported: on a busy pool an operation in flight
/// looks like a problem to one pass, a real one stays.
pub fn check_path(path: &Path, deep: bool) -> Result<CheckReport> {
    check_path_with(path, deep, &mut |_| {})
}

/// [`check_path`], telling `progress` how far it has come: at the start
/// and end of each part and every 65 536 descriptors or pages (a 16 GiB
/// pool has 4 million pages).
pub fn check_path_with(
    path: &Path,
    deep: bool,
    progress: &mut dyn FnMut(Progress),
) -> Result<CheckReport> {
    let shm = Shm::open(path, dm_sys::mem::Access::Group)?;
    let mut pass = Pass(progress);
    Ok(settled(|| check_shm(&shm, deep, &mut pass), PAUSE))
}

/// Passes a check makes over a pool with problems before reporting them.
const PASSES: usize = 3;
/// The pause between those passes.
const PAUSE: std::time::Duration = std::time::Duration::from_millis(5);

/// Runs `pass` until it finds no problem, at most [`PASSES`] times
/// `pause` apart, and reports the last pass with only the problems whose
/// subject (a page, slot, descriptor, Ref...: the text before the first
/// `:`) every pass found. On a busy pool an operation in flight looks
/// like a problem to one pass (a Ref being dropped: its pages freed while
/// its descriptor still names them); a real one stays.
fn settled(mut pass: impl FnMut() -> CheckReport, pause: std::time::Duration) -> CheckReport {
    fn subject(p: &str) -> &str {
        p.split(':').next().unwrap_or(p)
    }
    let mut rep = pass();
    let mut stable: Vec<String> = rep.problems.iter().map(|p| subject(p).to_owned()).collect();
    for _ in 1..PASSES {
        if stable.is_empty() {
            break;
        }
        std::thread::sleep(pause);
        rep = pass();
        stable.retain(|s| rep.problems.iter().any(|p| subject(p) == s));
    }
    rep.problems
        .retain(|p| stable.iter().any(|s| subject(p) == s));
    rep
}

/// The pool's lifetime counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counters {
    /// Pages copied by copy-on-write, ever.
    pub cow_copies: u64,
    /// Refs created, ever.
    pub refs_created: u64,
    /// Refs reclaimed by TTL, ever.
    pub refs_expired: u64,
    /// Dead slots reclaimed, ever.
    pub slots_reclaimed: u64,
    /// Page lists a buffer copied before writing, because a Ref shared
    /// them, ever.
    pub lists_copied: u64,
}

pub(crate) fn counters(shm: &Shm) -> Counters {
    let a = shm.atomics();
    Counters {
        cow_copies: a.cow_copies.load(Ordering::Relaxed),
        refs_created: a.refs_created.load(Ordering::Relaxed),
        refs_expired: a.refs_expired.load(Ordering::Relaxed),
        slots_reclaimed: a.slots_reclaimed.load(Ordering::Relaxed),
        lists_copied: a.lists_copied.load(Ordering::Relaxed),
    }
}

/// The lifetime counters of the pool at `path` (no attach).
pub fn counters_of(path: &Path) -> Result<Counters> {
    Ok(counters(&Shm::open(path, dm_sys::mem::Access::Group)?))
}

#[cfg(test)]
mod tests {
    use super::{settled, CheckReport, Problems, MAX_PROBLEMS, PASSES};
    use crate::progress::{Pass, Progress, STRIDE};
    use std::time::Duration;

    /// A wrecked pool's report stays small: the first problems, then a count.
    #[test]
    fn problems_past_the_cap_are_counted() {
        let mut p = Problems::default();
        for i in 0..MAX_PROBLEMS + 5 {
            p.push(format!("page {i}: wrong"));
        }
        let v = p.into_vec();
        assert_eq!(v.len(), MAX_PROBLEMS + 1);
        assert_eq!(
            v[MAX_PROBLEMS - 1],
            format!("page {}: wrong", MAX_PROBLEMS - 1)
        );
        assert_eq!(v[MAX_PROBLEMS], "and 5 more problems not listed");
    }

    /// A pass reports its start, every stride and its end.
    #[test]
    fn a_pass_reports_each_stride() {
        let mut seen = Vec::new();
        let mut f = |p: Progress| seen.push(p.done);
        let mut pass = Pass(&mut f);
        let n = 3 * STRIDE + 7;
        for i in 0..n {
            pass.at("pages", i, n);
        }
        pass.end("pages", n);
        assert_eq!(seen, [0, STRIDE, 2 * STRIDE, 3 * STRIDE, n]);
    }

    fn with(problems: &[&str]) -> CheckReport {
        CheckReport {
            problems: problems.iter().map(|p| p.to_string()).collect(),
            ..Default::default()
        }
    }

    /// Settles over `passes` in turn; returns how many ran and the report.
    fn settle(passes: &[CheckReport]) -> (usize, CheckReport) {
        let mut k = 0;
        let rep = settled(
            || {
                k += 1;
                passes[k - 1].clone()
            },
            Duration::ZERO,
        );
        (k, rep)
    }

    #[test]
    fn work_in_flight_is_not_reported_and_a_lasting_problem_is() {
        // Page 7 looks wrong to one pass only (a drop in flight); page 9
        // to every pass, its text changing (the last pass's is reported).
        let (k, rep) = settle(&[
            with(&[
                "page 7: free but named by 1",
                "page 9: refcount 3 but 2 holders",
            ]),
            with(&["page 9: refcount 4 but 2 holders"]),
            with(&[
                "page 9: refcount 4 but 3 holders",
                "slot 2: reclaim in progress",
            ]),
        ]);
        assert_eq!(k, PASSES);
        assert_eq!(rep.problems, vec!["page 9: refcount 4 but 3 holders"]);
    }

    #[test]
    fn a_clean_pass_ends_the_check() {
        let (k, rep) = settle(&[with(&["page 7: free but named by 1"]), with(&[])]);
        assert_eq!(k, 2);
        assert!(rep.ok(), "{:?}", rep.problems);
    }
}

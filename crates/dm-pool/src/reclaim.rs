//! Where shares are taken and dropped crash-safely, and where what dead
//! processes and expired Refs hold is reclaimed.
//!
//! Every share change goes through [`Core::bulk_change`]: per page, one CAS
//! changes the count and locks the page to the descriptor; every
//! [`BATCH`] pages the descriptor's counter is stored and those pages are
//! unlocked (plain stores: nobody else writes a locked word). Before waiting
//! for a page locked by someone else, the pages held so far are recorded
//! and unlocked, so no process waits while holding a lock (no deadlock).
//!
//! A process killed anywhere leaves its descriptors in a state a reclaimer
//! can finish exactly ([`Core::reclaim_descs`]):
//! 1. an interrupted copy-on-write is resolved from the journal;
//! 2. entries naming pages still cached by the dead owner (a page being
//!    linked, or a page whose last share it had just dropped) are removed
//!    and the pages freed — nobody else holds them;
//! 3. the counter is advanced over the pages locked by the descriptor,
//!    which are exactly those changed but not yet recorded, and they are
//!    unlocked;
//! 4. the descriptor is dropped from its counter onwards.

use crate::desc::mappers;
use crate::desc::{
    Desc, DescState, Kind, END_ABORTED, END_RELEASED, FLAG_LIST_BUILD, LIST_DRAIN, LIST_DROPPED,
    LIST_INDEX, LIST_JOURNAL,
};
use crate::error::Result;
use crate::pages::{Changed, Delta, PageState, BORROWED, NO_PAGE, STRIPE};
use crate::process::Core;
use crate::slot::{LeaseNow, SlotKind, SlotState};
use crate::sync::Ordering;

/// What gc reclaimed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GcReport {
    /// Dead slots whose holdings were released.
    pub slots_reclaimed: u64,
    /// Refs reclaimed because their TTL passed.
    pub refs_expired: u64,
    /// Groups of descriptors read to find them: those the expiry summary
    /// said were due (every group for `dmrpc pool gc`).
    pub expiry_groups_swept: u64,
    /// Whether a full recount ran (no other process attached).
    pub recounted: bool,
    /// Pages whose refcount the recount corrected.
    pub pages_repaired: u64,
    /// Registry records of dead services removed.
    pub services_removed: u64,
    /// Channels freed because both ends were closed or dead.
    pub channels_freed: u64,
}

/// Pages changed between two counter stores (bounds how long pages stay locked).
pub(crate) const BATCH: usize = 64;

/// Which counter of a descriptor records its share changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Book {
    /// `held`: building (shares taken for entries below it).
    Held,
    /// `progress`: dropping (shares dropped for positions below it).
    Progress,
    /// The copy-on-write journal: dropping the replaced page's share is
    /// recorded by clearing `journal_idx`.
    Journal,
}

impl Book {
    fn store(self, d: &Desc, k: u32) {
        match self {
            Book::Held => d.held.store(k, Ordering::Release),
            Book::Progress => d.progress.store(k, Ordering::Release),
            Book::Journal => {
                if k > 0 {
                    d.journal_idx.store(NO_PAGE, Ordering::Release)
                }
            }
        }
    }
}

/// Which pages a bulk change walks.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Src {
    /// The descriptor's own entries.
    Entries,
    /// The drop space: data entries below `held`, then list slots.
    Drop {
        /// Data entries.
        held: u32,
    },
    /// One page (position 0).
    One(u32),
    /// The first `.1` entries of list page `.0`.
    List(u32, u32),
}

/// Where a bulk change stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// Every position was processed.
    Done,
    /// `TryInc` met a page that is not held at this position (recorded up to it).
    NotHeld(u32),
}

impl Core {
    /// Position `k` of a descriptor's drop space: data entries `[0, held)`,
    /// then list slot `j` (`desc.rs`) at `held + j`.
    fn drop_slot(&self, d: &Desc, held: u32, k: u32) -> Result<u32> {
        if k < held {
            self.shm.entry_value(d, k as usize)
        } else {
            self.shm.list_page(d, (k - held) as usize)
        }
    }

    /// The end of a descriptor's drop space: `held` data entries, then its
    /// list slots.
    pub(crate) fn drop_span(&self, d: &Desc, held: u32) -> u32 {
        held.saturating_add(self.shm.list_span(d))
    }

    /// Applies `delta` to the page at every position `[from, to)` of
    /// descriptor `di` (pages named by `src`), recording in `book`. Pages
    /// whose last share is dropped are pushed to `freed` (as they are).
    ///
    /// The hot loop walks entries a chunk (list page) at a time with plain
    /// loads, holds one stripe lock at a time, and allocates nothing but
    /// `freed`'s room (once, at the first page freed).
    #[allow(clippy::too_many_arguments)] // the protocol's inputs, each used once
    pub(crate) fn bulk_change(
        &self,
        di: u32,
        d: &Desc,
        from: u32,
        to: u32,
        src: Src,
        book: Book,
        delta: Delta,
        freed: &mut Vec<u32>,
    ) -> Result<Stop> {
        let t = self.shm.pages();
        let np = self.shm.layout.n_pages;
        // Pages locked since the last flush, with their locked words: only
        // the first `nl` entries are ever read, so the array is not zeroed
        // (a 1 KiB store on every call, 7% of a small Ref's lifecycle).
        let mut locked = [const { std::mem::MaybeUninit::<(u32, u64)>::uninit() }; BATCH];
        let mut nl = 0usize;
        // Pages whose last share was dropped since the last flush (already
        // in `freed`, which the caller uses only once this returns, after
        // the final flush has recorded them).
        let mut last = 0usize;
        // The stripe we hold, if any.
        let mut stripe: Option<u32> = None;
        let flush = |k: u32,
                     stripe: &mut Option<u32>,
                     locked: &[std::mem::MaybeUninit<(u32, u64)>],
                     nl: &mut usize,
                     last: &mut usize| {
            book.store(d, k);
            for x in &locked[..*nl] {
                // SAFETY: entries below `nl` were written since it was last
                // reset (it grows by one after each write).
                let (p, w) = unsafe { x.assume_init_read() };
                t.unlock_own(p, w);
            }
            *nl = 0;
            if let Some(s) = stripe.take() {
                t.unlock_stripe_of(s * STRIPE);
            }
            *last = 0;
        };
        let one = [crate::sync::AtomicU32::new(match src {
            Src::One(p) => p,
            _ => NO_PAGE,
        })];
        let mut k = from;
        let mut spins = 0u32;
        let stop: Result<Stop> = 'outer: loop {
            if k >= to {
                break Ok(Stop::Done);
            }
            // The chunk of positions containing k.
            let (base, run, span) = match src {
                Src::Entries => match self.shm.entry_chunk(d, k as usize) {
                    Ok((b, r, sp)) => (b as u32, r, sp as u32),
                    Err(e) => break Err(e),
                },
                Src::Drop { held } if k < held => match self.shm.entry_chunk(d, k as usize) {
                    Ok((b, r, sp)) => (b as u32, r, (sp as u32).min(held - b as u32)),
                    Err(e) => break Err(e),
                },
                Src::Drop { held } => match self.shm.list_chunk(d, (k - held) as usize) {
                    Ok((b, r, sp)) => (held + b as u32, r, sp as u32),
                    Err(e) => break Err(e),
                },
                Src::One(_) => (0, &one[..], 1),
                Src::List(l, used) => match self.shm.list(l) {
                    Ok(run) => (0, &run[..(used as usize).min(run.len())], used),
                    Err(e) => break Err(e),
                },
            };
            let end = to.min(base + span);
            debug_assert!(end > k, "a chunk contains its position");
            // Positions past the run hold no page (the list slots of a
            // descriptor without lists): nothing to walk there.
            let walk = end.min(base.saturating_add(run.len() as u32));
            let mut i = k;
            while i < walk {
                let p = run
                    .get((i - base) as usize)
                    .map_or(NO_PAGE, |e| e.load(Ordering::Relaxed));
                if p == NO_PAGE || p & BORROWED != 0 {
                    // Unbacked, or borrowed from a Ref: no share here.
                    i += 1;
                    continue;
                }
                if p >= np {
                    flush(i, &mut stripe, &locked, &mut nl, &mut last);
                    break 'outer Err(crate::error::Error::Corrupt(format!(
                        "page index {p} is outside the pool ({np} pages)"
                    )));
                }
                if stripe.is_none_or(|st| p / STRIPE != st) {
                    // One stripe at a time: record and release before the next.
                    flush(i, &mut stripe, &locked, &mut nl, &mut last);
                    match t.lock_stripe_of(p, di) {
                        Ok(None) => stripe = Some(p / STRIPE),
                        Ok(Some(other)) => {
                            self.wait_busy(p, other, &mut spins, freed);
                            k = i;
                            continue 'outer;
                        }
                        Err(e) => break 'outer Err(e.into()),
                    }
                }
                if let Some(Changed::Locked(w)) = t.change_fast(p, di, delta) {
                    locked[nl].write((p, w));
                    nl += 1;
                    i += 1;
                    if nl + last >= BATCH {
                        flush(i, &mut stripe, &locked, &mut nl, &mut last);
                    }
                    continue;
                }
                match t.change_in_stripe(p, di, delta) {
                    Ok(Changed::Locked(w)) => {
                        locked[nl].write((p, w));
                        nl += 1;
                    }
                    Ok(Changed::Last) => {
                        if freed.len() == freed.capacity() {
                            // Room for the rest at once: a dropped buffer
                            // frees its pages together.
                            freed.reserve((to - i) as usize);
                        }
                        freed.push(p);
                        last += 1;
                    }
                    Ok(Changed::NotHeld) => {
                        flush(i, &mut stripe, &locked, &mut nl, &mut last);
                        break 'outer Ok(Stop::NotHeld(i));
                    }
                    Ok(Changed::Busy(other)) => {
                        flush(i, &mut stripe, &locked, &mut nl, &mut last);
                        self.wait_busy(p, other, &mut spins, freed);
                        k = i;
                        continue 'outer;
                    }
                    Err(e) => {
                        flush(i, &mut stripe, &locked, &mut nl, &mut last);
                        break 'outer Err(e.into());
                    }
                }
                i += 1;
                if nl + last >= BATCH {
                    flush(i, &mut stripe, &locked, &mut nl, &mut last);
                }
            }
            k = end;
        };
        if let Ok(Stop::Done) = stop {
            flush(to, &mut stripe, &locked, &mut nl, &mut last);
        }
        stop
    }

    /// Waits for page `p` (or its stripe), locked by descriptor `other`. A
    /// live owner holds such a lock briefly; a dead one is reclaimed here as
    /// soon as its lease says so (which completes and unlocks its work).
    pub(crate) fn wait_busy(&self, p: u32, other: u32, spins: &mut u32, freed: &mut Vec<u32>) {
        *spins += 1;
        if *spins < 64 {
            std::hint::spin_loop();
            return;
        }
        std::thread::yield_now();
        if spins.is_multiple_of(512) {
            // A long wait must not cost us our own lease.
            let _ = self.renew();
            if let Some(d) = self.shm.desc(other) {
                let owner = DescState::decode(d.state.load(Ordering::Acquire)).owner;
                let t = self.shm.pages();
                // `p` NO_PAGE: a Ref's mapper word, locked by `other`. A
                // holder that died is reclaimed here: waiting for someone
                // else to reclaim it can wait forever (the lease thread may
                // be the one waiting, reclaiming another dead process that
                // mapped the same Ref).
                if owner != self.slot
                    && (p == NO_PAGE
                        || t.locked_by(p, other)
                        || t.stripe_holder(p / STRIPE) == Some(other))
                {
                    let _ = self.reclaim_slot(owner, LeaseNow::read(), freed);
                }
            }
        }
    }

    /// Finishes dropping a descriptor in `Drop` state owned by this slot:
    /// its data entries from `progress`, then its list pages, then (for a
    /// buffer mapped from a Ref) its count on that Ref; then frees it.
    pub(crate) fn drop_desc(
        &self,
        di: u32,
        d: &Desc,
        end: u32,
        freed: &mut Vec<u32>,
    ) -> Result<()> {
        let held = d.held.load(Ordering::Acquire);
        let span = self.drop_span(d, held);
        // On error the descriptor stays in Drop: gc reports it; nothing is freed twice.
        self.drop_entries(di, d, held, freed)?;
        let from = d.progress.load(Ordering::Acquire).max(held);
        self.bulk_change(
            di,
            d,
            from,
            span,
            Src::Drop { held },
            Book::Progress,
            Delta::Dec(self.slot),
            freed,
        )?;
        if d.aux.load(Ordering::Acquire) == 1 {
            self.unlink(di, d, freed)?;
        }
        d.flags.store(end << 8, Ordering::Release);
        d.reset();
        let st = DescState::decode(d.state.load(Ordering::Acquire));
        d.state.store(
            DescState::encode(st.generation, Kind::Free, 0),
            Ordering::Release,
        );
        // Our next claim takes this one (its lines are in our caches).
        self.desc_hint
            .store(di, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// The data entries of a drop, `[progress, held)`: list by list where
    /// the descriptor has lists, each list first asked whether others hold
    /// it too (then only its count is dropped, `desc.rs`).
    fn drop_entries(&self, di: u32, d: &Desc, held: u32, freed: &mut Vec<u32>) -> Result<()> {
        let per = self.shm.layout.per_list_page() as u32;
        let lists = self.shm.list_span(d) > 0;
        loop {
            let k = d.progress.load(Ordering::Acquire);
            if k >= held {
                return Ok(());
            }
            let next = if lists {
                (k / per + 1).saturating_mul(per).min(held)
            } else {
                held
            };
            if lists && k.is_multiple_of(per) {
                if let Some(slot) = self.shm.list_slot(d, (k / per) as usize)? {
                    let l = slot.load(Ordering::Acquire);
                    if l != NO_PAGE && !self.holds_list_alone(di, d, slot, l, next, freed)? {
                        crate::testing::reached(crate::testing::StopPoint::SharedListLeft);
                        continue;
                    }
                }
            }
            self.bulk_change(
                di,
                d,
                k,
                next,
                Src::Drop { held },
                Book::Progress,
                Delta::Dec(self.slot),
                freed,
            )?;
        }
    }

    /// Whether dropping descriptor `di` holds first-level list `l` (named
    /// by `slot`) alone. If others hold it too, drops `di`'s count on it
    /// instead: clears the slot and records `progress = next` (past the
    /// list's entries) before unlocking it.
    fn holds_list_alone(
        &self,
        di: u32,
        d: &Desc,
        slot: &crate::sync::AtomicU32,
        l: u32,
        next: u32,
        freed: &mut Vec<u32>,
    ) -> Result<bool> {
        self.drop_list_count(di, l, self.slot, true, freed, |_| {
            slot.store(NO_PAGE, Ordering::Release);
            d.progress.store(next, Ordering::Release);
        })
    }

    /// Drops descriptor `di`'s count on first-level list `l`, deciding
    /// under the list's stripe lock (waiting out other lockers) whether
    /// `di` held it alone, which it returns. `record(alone)` runs between
    /// the change and the unlock: a reclaimer finds the change recorded,
    /// or the list page locked to `di`. With `keep_alone` a list held
    /// alone keeps its count (nothing changes, nothing is recorded). A
    /// count dropped to zero leaves the list cached by slot `last`.
    fn drop_list_count(
        &self,
        di: u32,
        l: u32,
        last: u16,
        keep_alone: bool,
        freed: &mut Vec<u32>,
        record: impl FnOnce(bool),
    ) -> Result<bool> {
        let t = self.shm.pages();
        let l = self.shm.check_page(l)?;
        let mut spins = 0u32;
        loop {
            if let Some(other) = t.lock_stripe_of(l, di)? {
                self.wait_busy(l, other, &mut spins, freed);
                continue;
            }
            match t.state(l)? {
                PageState::Held(1) if keep_alone => {
                    t.unlock_stripe_of(l);
                    return Ok(true);
                }
                PageState::Held(rc) => {
                    let c = t.change_in_stripe(l, di, Delta::Dec(last))?;
                    record(rc == 1);
                    t.done(l, c);
                    return Ok(rc == 1);
                }
                PageState::Locked { desc, .. } => {
                    t.unlock_stripe_of(l);
                    self.wait_busy(l, desc, &mut spins, freed);
                }
                found => {
                    t.unlock_stripe_of(l);
                    return Err(crate::pages::PageError {
                        page: l,
                        found,
                        expected: "a held list page",
                    }
                    .into());
                }
            }
        }
    }

    /// Removes buffer `di`'s count on the Ref it was mapped from; the last
    /// mapper of a released Ref drops it.
    fn unlink(&self, di: u32, d: &Desc, freed: &mut Vec<u32>) -> Result<()> {
        let ri = d.tag.load(Ordering::Acquire) as u32;
        let r = self.desc(ri)?;
        let mut spins = 0u32;
        loop {
            match mappers::unlink(&r.aux, di, self.slot) {
                mappers::Step::Locked(w) => {
                    d.aux.store(0, Ordering::Release);
                    mappers::unlock(&r.aux, w);
                    return Ok(());
                }
                mappers::Step::Drop => {
                    d.aux.store(0, Ordering::Release);
                    let w = r.state.load(Ordering::Acquire);
                    return self.drop_ref(ri, r, w, END_RELEASED, freed);
                }
                mappers::Step::Busy(other) => self.wait_busy(NO_PAGE, other, &mut spins, freed),
                s => {
                    return Err(crate::error::Error::Corrupt(format!(
                        "buffer {di} is linked to descriptor {ri}, whose mapper word refuses the unlink ({s:?})"
                    )))
                }
            }
        }
    }

    /// Drops Ref `ri` (state word `w`) once this slot is its dropper.
    pub(crate) fn drop_ref(
        &self,
        ri: u32,
        r: &Desc,
        w: u64,
        end: u32,
        freed: &mut Vec<u32>,
    ) -> Result<()> {
        let st = DescState::decode(w);
        if st.kind != Some(Kind::RefLive) {
            return Err(crate::error::Error::Corrupt(format!(
                "descriptor {ri} is not a Ref to drop"
            )));
        }
        r.progress.store(0, Ordering::Relaxed);
        let to = DescState::encode(st.generation, Kind::Drop, self.slot);
        r.state
            .compare_exchange(w, to, Ordering::AcqRel, Ordering::Acquire)
            .map_err(|_| {
                crate::error::Error::Corrupt(format!("Ref {ri} changed while this slot dropped it"))
            })?;
        self.drop_desc(ri, r, end, freed)
    }

    /// Reclaims dead slots and expired Refs: those of the groups the
    /// expiry summary says are due, or of every group with `all`.
    pub(crate) fn maintain(
        &self,
        freed: &mut Vec<u32>,
        all: bool,
        pass: &mut crate::progress::Pass<'_>,
    ) -> Result<GcReport> {
        let mut rep = GcReport::default();
        let now = LeaseNow::read();
        let n = self.shm.layout.n_slots;
        for s in 0..n as u16 {
            pass.at("slots", s as u64, n as u64);
            if s != self.slot && self.reclaim_slot(s, now, freed)? {
                rep.slots_reclaimed += 1;
            }
        }
        pass.end("slots", n as u64);
        self.expire_due(now, all, &mut rep, freed, pass)?;
        rep.services_removed = self.shm.sweep_services(self.slot, self.incarnation);
        rep.channels_freed = self.shm.sweep_channels();
        Ok(rep)
    }

    /// If slot `s` is dead (lease expired, or its reclaimer died), takes it
    /// over and releases everything it holds. Returns whether it did.
    pub(crate) fn reclaim_slot(&self, s: u16, now: LeaseNow, freed: &mut Vec<u32>) -> Result<bool> {
        let Some(slot) = self.shm.slot(s) else {
            return Ok(false);
        };
        let w = slot.state.load(Ordering::Acquire);
        let st = SlotState::decode(w);
        let dead = match st.kind {
            Some(SlotKind::Live) => {
                self.shm.slot_expired(slot, now) && !self.shm.in_quarantine(slot, None, now)
            }
            Some(SlotKind::Reclaiming) => {
                st.reclaimer != s && !self.shm.slot_live(st.reclaimer, now)
            }
            _ => false,
        };
        if !dead || s == self.slot {
            return Ok(false);
        }
        let to = SlotState::encode(st.incarnation, SlotKind::Reclaiming, self.slot);
        if slot
            .state
            .compare_exchange(w, to, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return Ok(false);
        }
        self.release_holdings_of(s, freed)?;
        slot.state.store(
            SlotState::encode(st.incarnation, SlotKind::Free, 0),
            Ordering::Release,
        );
        self.shm
            .atomics()
            .slots_reclaimed
            .fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// Releases every descriptor owned by slot `s` and every page it caches.
    /// `s` is dead and reclaimed by us (or is this slot, detaching).
    pub(crate) fn release_holdings_of(&self, s: u16, freed: &mut Vec<u32>) -> Result<()> {
        self.reclaim_descs(|st| st.owner == s, freed)?;
        // Refs `s` was dropping (it won the drop, then died): adopt and drop.
        // Every other live Ref is noted in the expiry summary: `s` may have
        // committed one and died before noting it (expiry.rs).
        for idx in 0..self.shm.layout.n_descs {
            let d = self.desc(idx)?;
            let w = d.state.load(Ordering::Acquire);
            if DescState::decode(w).kind != Some(Kind::RefLive) {
                continue;
            }
            if mappers::adopt(&d.aux, s, self.slot) {
                self.drop_ref(idx, d, w, END_RELEASED, freed)?;
            } else if !mappers::released(d.aux.load(Ordering::Acquire)) {
                self.shm
                    .note_expiry(idx, d.expiry_ms.load(Ordering::Relaxed));
            }
        }
        // Descriptors first, then the sweep: after `normalize` no descriptor
        // names a page cached by `s`.
        let t = self.shm.pages();
        for p in 0..self.shm.layout.n_pages {
            if t.state(p)? == PageState::Cached(s) {
                t.release_cached(p, s)?;
            }
        }
        // Its buffers are gone: so are their charges (quota.rs).
        if let Some(sl) = self.shm.slot(s) {
            self.shm.drop_charges(sl);
        }
        Ok(())
    }

    /// Takes over and drops every owned descriptor matching `pick` (whose
    /// owners are gone), in phases that never wait on each other:
    /// A. finish each one's records (journal, counters);
    /// B. unlock every page any of them still locks (one page-table pass);
    /// C/D. normalise and drop each (dropping may wait for live processes).
    pub(crate) fn reclaim_descs(
        &self,
        pick: impl Fn(&DescState) -> bool,
        freed: &mut Vec<u32>,
    ) -> Result<()> {
        let mut owned = Vec::new();
        for idx in 0..self.shm.layout.n_descs {
            let d = self.desc(idx)?;
            let st = DescState::decode(d.state.load(Ordering::Acquire));
            if pick(&st) && self.finish_records(idx, d)? {
                owned.push(idx);
            }
        }
        if owned.is_empty() {
            return Ok(());
        }
        let t = self.shm.pages();
        for p in 0..self.shm.layout.n_pages {
            if let PageState::Locked { desc, .. } = t.state(p)? {
                if owned.binary_search(&desc).is_ok() {
                    t.unlock(p, desc);
                }
            }
        }
        // Pages before stripes: a stripe is released only after its pages.
        for s in 0..t.stripe_count() {
            if let Some(h) = t.stripe_holder(s) {
                if owned.binary_search(&h).is_ok() {
                    t.unlock_stripe_if(s, h);
                }
            }
        }
        for idx in owned {
            self.take_over_desc(idx, self.desc(idx)?, freed)?;
        }
        Ok(())
    }

    /// Drops an owned descriptor whose owner is gone, once its records are
    /// finished and its locks released (`reclaim_descs`): removes pages the
    /// owner still caches, then drops it from its counter on. Returns
    /// whether it was dropped (false: not an owned kind, or raced).
    fn take_over_desc(&self, di: u32, d: &Desc, freed: &mut Vec<u32>) -> Result<bool> {
        let w = d.state.load(Ordering::Acquire);
        let st = DescState::decode(w);
        if !matches!(
            st.kind,
            Some(Kind::Buf | Kind::MapBuild | Kind::RefBuild | Kind::Drop)
        ) {
            return Ok(false);
        }
        let n = d.n_pages.load(Ordering::Acquire);
        if st.kind == Some(Kind::Buf) {
            // (Before `normalize`, which would free the copy still cached.)
            self.finish_list_copy(di, d, st.owner, freed)?;
        }
        if st.kind == Some(Kind::RefBuild) {
            self.end_list_build(d)?;
        }
        self.normalize(d, st)?;
        if st.kind == Some(Kind::Buf) {
            // A copy-on-write that linked and held its new page but had not
            // dropped the old page's share yet: drop it now (recorded by
            // clearing the journal, so this too can be interrupted).
            if d.journal_idx.load(Ordering::Acquire) != NO_PAGE {
                let p = self.shm.check_page(d.journal_old.load(Ordering::Acquire))?;
                self.bulk_change(
                    di,
                    d,
                    0,
                    1,
                    Src::One(p),
                    Book::Journal,
                    Delta::Dec(self.slot),
                    freed,
                )?;
            }
            d.held.store(n, Ordering::Relaxed);
            d.progress.store(0, Ordering::Relaxed);
        } else if matches!(st.kind, Some(Kind::MapBuild | Kind::RefBuild)) {
            d.progress.store(0, Ordering::Relaxed);
        }
        let to = DescState::encode(st.generation, Kind::Drop, self.slot);
        if d.state
            .compare_exchange(w, to, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            self.drop_desc(di, d, END_ABORTED, freed)?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Phase A for one descriptor: resolve an interrupted copy-on-write and
    /// advance the counter over pages it changed but did not record: in
    /// entry order right from the counter, each is locked by it or, for a
    /// drop, became `Cached(owner)` (its last share). Idempotent, never
    /// waits. False if the descriptor is not of an owned kind.
    fn finish_records(&self, di: u32, d: &Desc) -> Result<bool> {
        let st = DescState::decode(d.state.load(Ordering::Acquire));
        let Some(kind) = st.kind else {
            return Ok(false);
        };
        if !matches!(
            kind,
            Kind::Buf | Kind::MapBuild | Kind::RefBuild | Kind::Drop
        ) {
            return Ok(false);
        }
        let t = self.shm.pages();
        // A link to (or unlink from) the Ref this buffer was mapped from,
        // done on the Ref's mapper word but not yet recorded here.
        if matches!(kind, Kind::Buf | Kind::MapBuild | Kind::Drop)
            && d.aux.load(Ordering::Acquire) <= 1
        {
            if let Some(r) = self.shm.desc(d.tag.load(Ordering::Acquire) as u32) {
                let a = r.aux.load(Ordering::Acquire);
                if mappers::locker(a) == Some(di) {
                    d.aux
                        .store(u64::from(kind != Kind::Drop), Ordering::Release);
                    mappers::unlock_if(&r.aux, di);
                } else if kind == Kind::Drop
                    && d.aux.load(Ordering::Acquire) == 1
                    && mappers::dropper(a) == Some(st.owner)
                {
                    // The last unlink happened (the Ref is dropped by its dropper).
                    d.aux.store(0, Ordering::Release);
                }
            }
        }
        if kind == Kind::Buf {
            self.undo_journal(di, d, st.owner)?;
            return Ok(true);
        }
        if kind == Kind::MapBuild {
            // It takes no shares (a mapped buffer borrows): nothing to record.
            return Ok(true);
        }
        let n = d.n_pages.load(Ordering::Acquire);
        let held = d.held.load(Ordering::Acquire);
        let per = self.shm.layout.per_list_page() as u32;
        let lists = self.shm.list_span(d) > 0;
        // A Ref sharing its buffer's lists counts them, not data entries.
        let list_build =
            kind == Kind::RefBuild && d.flags.load(Ordering::Acquire) & FLAG_LIST_BUILD != 0;
        let (from, span) = match kind {
            Kind::Drop => (d.progress.load(Ordering::Acquire), self.drop_span(d, held)),
            _ if list_build => (held, if lists { n.div_ceil(per) } else { 0 }),
            _ => (held, n),
        };
        let mut k = from;
        while k < span {
            if kind == Kind::Drop && lists && k < held && k.is_multiple_of(per) {
                // A shared list's count dropped, not yet recorded: the
                // list page is locked to us. Record it (`holds_list_alone`).
                if let Some(slot) = self.shm.list_slot(d, (k / per) as usize)? {
                    let l = slot.load(Ordering::Acquire);
                    if l != NO_PAGE && t.locked_by(self.shm.check_page(l)?, di) {
                        slot.store(NO_PAGE, Ordering::Release);
                        k = (k / per + 1).saturating_mul(per).min(held);
                        continue;
                    }
                }
            }
            let p = if kind == Kind::Drop {
                self.drop_slot(d, held, k)?
            } else if list_build {
                self.shm.list_page(d, k as usize)?
            } else {
                self.shm.entry_value(d, k as usize)?
            };
            if p != NO_PAGE {
                // Changed but unrecorded: locked by us, or (drops) turned
                // `Cached(owner)` by dropping its last share.
                let p = self.shm.check_page(p)?;
                let changed = t.locked_by(p, di)
                    || (kind == Kind::Drop && t.state(p)? == PageState::Cached(st.owner));
                if !changed {
                    break;
                }
            }
            k += 1;
        }
        if kind == Kind::Drop {
            d.progress.fetch_max(k, Ordering::AcqRel);
        } else {
            d.held.fetch_max(k, Ordering::AcqRel);
        }
        Ok(true)
    }

    /// Phase A for a buffer whose owner died giving itself a copy of a
    /// shared list (journal `LIST_JOURNAL`, `desc.rs`): records the count
    /// changes made and not recorded (pages locked to the buffer), which
    /// phase B would otherwise unlock unseen. The rest is driven forward
    /// by the takeover (`finish_list_copy`), which may wait.
    fn undo_list_journal(&self, di: u32, d: &Desc, idx: u32) -> Result<()> {
        let t = self.shm.pages();
        let st = DescState::decode(d.state.load(Ordering::Acquire));
        let j = (idx & LIST_INDEX) as usize;
        let old = self.shm.check_page(d.journal_old.load(Ordering::Acquire))?;
        let Some(q) = self.list_copy(d, j, old)? else {
            return Ok(());
        };
        let walk = if idx & LIST_DRAIN != 0 {
            old
        } else if idx & LIST_DROPPED != 0 {
            return Ok(());
        } else if t.state(q)? == PageState::Cached(st.owner) {
            q
        } else {
            // The copy is held: was the old list's count dropped?
            if t.locked_by(old, di) {
                d.journal_idx.store(idx | LIST_DROPPED, Ordering::Release);
            } else if t.state(old)? == PageState::Cached(st.owner) {
                d.journal_idx.store(idx | LIST_DRAIN, Ordering::Release);
            }
            return Ok(());
        };
        let used = self.list_used(d, j);
        let list = &self.shm.list(walk)?[..used as usize];
        let mut k = d.progress.load(Ordering::Acquire);
        while let Some(e) = list.get(k as usize) {
            let p = e.load(Ordering::Acquire);
            if p != NO_PAGE && !t.locked_by(self.shm.check_page(p)?, di) {
                break;
            }
            k += 1;
        }
        d.progress.fetch_max(k, Ordering::AcqRel);
        Ok(())
    }

    /// The copy of list `j` (slot `j`) of a buffer with a list journal
    /// whose old list is `old`; `None` if slot `j` still names the old
    /// list: the copy was never linked, and the journal is cleared
    /// (nothing changed; the copy is swept with the owner's cached pages).
    fn list_copy(&self, d: &Desc, j: usize, old: u32) -> Result<Option<u32>> {
        let slot = self
            .shm
            .list_slot(d, j)?
            .ok_or_else(|| crate::error::Error::Corrupt(format!("list {j} has no slot")))?;
        let q = self.shm.check_page(slot.load(Ordering::Acquire))?;
        if q == old {
            d.journal_idx.store(NO_PAGE, Ordering::Release);
            return Ok(None);
        }
        Ok(Some(q))
    }

    /// Entries of first-level list `j` of `d` that name pages (the rest of
    /// the list page is zero).
    pub(crate) fn list_used(&self, d: &Desc, j: usize) -> u32 {
        let per = self.shm.layout.per_list_page();
        let n = d.n_pages.load(Ordering::Acquire) as usize;
        n.saturating_sub(j * per).min(per) as u32
    }

    /// Drives buffer `di`'s copy of a shared list (journal
    /// `LIST_JOURNAL | j`, slot `j` naming the copy, `journal_old` the old
    /// list) to its end from whichever step it is at (`desc.rs`):
    /// 1. a count on each page the copy names (`progress`), then the copy
    ///    held;
    /// 2. under the old list's stripe lock, this buffer's count on it
    ///    dropped (`LIST_DROPPED`); if the buffer held it alone by then,
    ///    the count reaches zero (the list cached by `owner`,
    ///    `LIST_DRAIN`) and its pages' counts are dropped (`progress`);
    /// 3. the journal cleared.
    ///
    /// The copy counts its pages before the old list is let go: another
    /// holder that then finds itself alone drops the old list's counts,
    /// and the pages stay held by the copy. `owner`: the buffer's slot
    /// (this one, or a dead one being reclaimed).
    pub(crate) fn finish_list_copy(
        &self,
        di: u32,
        d: &Desc,
        owner: u16,
        freed: &mut Vec<u32>,
    ) -> Result<()> {
        let t = self.shm.pages();
        loop {
            let idx = d.journal_idx.load(Ordering::Acquire);
            if idx == NO_PAGE || idx & LIST_JOURNAL == 0 {
                return Ok(());
            }
            let j = (idx & LIST_INDEX) as usize;
            let old = self.shm.check_page(d.journal_old.load(Ordering::Acquire))?;
            let used = self.list_used(d, j);
            if idx & LIST_DROPPED != 0 {
                d.journal_idx.store(NO_PAGE, Ordering::Release);
                return Ok(());
            }
            if idx & LIST_DRAIN != 0 {
                let from = d.progress.load(Ordering::Acquire);
                self.bulk_change(
                    di,
                    d,
                    from,
                    used,
                    Src::List(old, used),
                    Book::Progress,
                    Delta::Dec(self.slot),
                    freed,
                )?;
                d.journal_idx.store(NO_PAGE, Ordering::Release);
                // (A dead owner's cached pages are swept after its
                // descriptors: so is the old list.)
                if owner == self.slot {
                    freed.push(old);
                }
                return Ok(());
            }
            let Some(q) = self.list_copy(d, j, old)? else {
                return Ok(());
            };
            if t.state(q)? == PageState::Cached(owner) {
                let from = d.progress.load(Ordering::Acquire);
                self.bulk_change(
                    di,
                    d,
                    from,
                    used,
                    Src::List(q, used),
                    Book::Progress,
                    Delta::Inc,
                    freed,
                )?;
                crate::testing::reached(crate::testing::StopPoint::ListCopied);
                t.hold_cached(q, owner)?;
            }
            // The old list's count: dropped already (not recorded)?
            match t.state(old)? {
                PageState::Locked { desc, .. } if desc == di => {
                    d.journal_idx.store(idx | LIST_DROPPED, Ordering::Release);
                    t.unlock(old, di);
                    continue;
                }
                PageState::Cached(s) if s == owner => {
                    d.journal_idx.store(idx | LIST_DRAIN, Ordering::Release);
                    continue;
                }
                _ => {}
            }
            // (The drain's counter, should the count reach zero.)
            d.progress.store(0, Ordering::Release);
            self.drop_list_count(di, old, owner, false, freed, |alone| {
                let next = if alone { LIST_DRAIN } else { LIST_DROPPED };
                d.journal_idx.store(idx | next, Ordering::Release);
            })?;
        }
    }

    /// Ends the build of a Ref sharing its buffer's lists that will not be
    /// completed (`FLAG_LIST_BUILD`): the lists it took no count on are
    /// its buffer's alone and are forgotten; then `held` reads as entries
    /// (every list left is held). Idempotent; nothing for other builds.
    pub(crate) fn end_list_build(&self, d: &Desc) -> Result<()> {
        if d.flags.load(Ordering::Acquire) & FLAG_LIST_BUILD == 0 {
            return Ok(());
        }
        let n = d.n_pages.load(Ordering::Acquire);
        let per = self.shm.layout.per_list_page();
        let firsts = if self.shm.list_span(d) > 0 {
            (n as usize).div_ceil(per)
        } else {
            0
        };
        for j in d.held.load(Ordering::Acquire) as usize..firsts {
            if let Some(slot) = self.shm.list_slot(d, j)? {
                slot.store(NO_PAGE, Ordering::Release);
            }
        }
        d.held.store(n, Ordering::Release);
        d.flags.fetch_and(!FLAG_LIST_BUILD, Ordering::AcqRel);
        Ok(())
    }

    /// Removes from a descriptor of a gone owner the pages that owner still
    /// caches — a page being linked, or one whose last share it had just
    /// dropped — and frees them: nobody else holds them.
    fn normalize(&self, d: &Desc, st: DescState) -> Result<()> {
        let t = self.shm.pages();
        let owner = st.owner;
        let n = d.n_pages.load(Ordering::Acquire);
        let held = d.held.load(Ordering::Acquire);
        let (lo, hi) = match st.kind {
            Some(Kind::Buf) => (0, n),
            Some(Kind::Drop) => (d.progress.load(Ordering::Acquire).min(held), held),
            _ => (0, held),
        };
        for k in lo..hi {
            let p = self.shm.entry_value(d, k as usize)?;
            if p != NO_PAGE && t.state(self.shm.check_page(p)?)? == PageState::Cached(owner) {
                self.set_entry(d, k as usize, NO_PAGE)?;
                t.release_cached(p, owner)?;
            }
        }
        // List slots in drop order: a second-level list is read for its
        // first-level ones before it may be let go itself.
        let span = self.shm.list_span(d) as usize;
        let mut j = 0;
        while j < span {
            let (base, run, len) = self.shm.list_chunk(d, j)?;
            for e in run {
                let l = e.load(Ordering::Acquire);
                if l != NO_PAGE && t.state(self.shm.check_page(l)?)? == PageState::Cached(owner) {
                    e.store(NO_PAGE, Ordering::Release);
                    t.release_cached(l, owner)?;
                }
            }
            j = base + len;
        }
        Ok(())
    }

    /// Resolves a copy-on-write of entry `idx` (old page `p`, new page `q`)
    /// interrupted by the owner's death, following the order of
    /// `Inner::link_page`: journal, link q, hold q, drop p's share, clear.
    /// If p's share is still to drop, the journal stays for the takeover.
    fn undo_journal(&self, di: u32, d: &Desc, owner: u16) -> Result<()> {
        let idx = d.journal_idx.load(Ordering::Acquire);
        if idx == NO_PAGE {
            return Ok(());
        }
        if idx & LIST_JOURNAL != 0 {
            return self.undo_list_journal(di, d, idx);
        }
        let t = self.shm.pages();
        let p = self.shm.check_page(d.journal_old.load(Ordering::Acquire))?;
        let cur = self.shm.entry_value(d, idx as usize)?;
        if cur != p && cur != NO_PAGE {
            match t.state(self.shm.check_page(cur)?)? {
                // q linked but never held: p's share is intact; put p back.
                PageState::Cached(x) if x == owner => self.set_entry(d, idx as usize, p)?,
                // q held: was p's share dropped?
                _ => match t.state(p)? {
                    // Dropped, not yet recorded.
                    PageState::Locked { desc, .. } if desc == di => {
                        d.journal_idx.store(NO_PAGE, Ordering::Release);
                        t.unlock(p, di);
                        return Ok(());
                    }
                    // Its last share is gone (cached by anyone), ours included.
                    PageState::Cached(_) => {}
                    // Not dropped yet: leave the journal for `take_over_desc`.
                    _ => return Ok(()),
                },
            }
        }
        d.journal_idx.store(NO_PAGE, Ordering::Release);
        Ok(())
    }
}

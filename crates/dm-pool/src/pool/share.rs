//! Ref operations of a [`Pool`]: create a Ref from a buffer (new shares,
//! or in place when the buffer becomes the Ref), validate a Ref a peer
//! sent, map it as a buffer, and release it.

use super::{Buffer, Pool};
use crate::desc::{
    mappers, Desc, DescState, Kind, END_ABORTED, END_EXPIRED, END_RELEASED, FLAG_INHERIT,
    FLAG_LIST_BUILD,
};
use crate::error::{Error, Result};
use crate::pages::{Delta, NO_PAGE};
use crate::reclaim::{Book, Src};
use crate::refs::Ref;
use crate::sync::Ordering;
use std::time::Duration;

/// Set by `testing::stop_before_noting`: the next Ref made stops for good
/// after its commit, before the expiry summary hears of it.
static STOP_BEFORE_NOTE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes this process stop for good between committing its next Ref and
/// noting its expiry (tests of crash recovery).
pub(crate) fn stop_before_noting() {
    STOP_BEFORE_NOTE.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// After a Ref's commit: its expiry into the pool's summary (expiry.rs).
fn noted(i: &super::Inner, di: u32, d: &Desc) {
    if STOP_BEFORE_NOTE.load(std::sync::atomic::Ordering::Relaxed) {
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    i.shm.note_expiry(di, d.expiry_ms.load(Ordering::Relaxed));
}

impl Pool {
    /// Creates a Ref to `len` bytes at `offset` of `buf` (no copy); the
    /// buffer's view of those pages becomes CoW. A Ref of a whole buffer
    /// with lists (more than 46 pages, not mapped from a Ref) shares them:
    /// one count per list of 1024 pages, and the buffer's next write
    /// through a list copies the list first (`desc.rs`). Any other Ref
    /// takes one share of each page.
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
        self.create_ref_as(buf, offset, len, ttl, true)
    }

    /// [`create_ref_ttl`](Self::create_ref_ttl); `share_lists`: whether it
    /// may share the buffer's lists (a mapped buffer's may not be shared:
    /// its fault handler cannot copy a list).
    pub(crate) fn create_ref_as(
        &self,
        buf: &Buffer,
        offset: u64,
        len: u64,
        ttl: Duration,
        share_lists: bool,
    ) -> Result<Ref> {
        let i = &self.inner;
        if share_lists && buf.mapped {
            // Its mapping would stay writable, and stores would change
            // what the Ref names.
            return Err(Error::InvalidArgument(
                "this buffer is mapped for loads and stores: share it with MappedBuffer::create_ref \
                 or ::share, which make the mapping copy-on-write first"
                    .into(),
            ));
        }
        let b = i.desc(buf.desc)?;
        if share_lists
            && offset == 0
            && buf.offset == 0
            && i.shm.list_span(b) > 0
            && b.flags.load(Ordering::Acquire) & FLAG_INHERIT == 0
            && b.aux.load(Ordering::Acquire) == 0
            && b.journal_idx.load(Ordering::Acquire) == NO_PAGE
            && b.n_pages.load(Ordering::Acquire) == buf.n_pages
            && (len.div_ceil(self.page_size() as u64)) == buf.n_pages as u64
        {
            return self.share_lists(buf, len, ttl);
        }
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
        Ok(self.commit_ref(ridx, r, rgen, tag, len))
    }

    /// The last step of building a Ref: `RefBuild -> RefLive`.
    fn commit_ref(&self, ridx: u32, r: &Desc, rgen: u32, tag: u64, len: u64) -> Ref {
        let i = &self.inner;
        r.aux.store(mappers::IS_REF, Ordering::Release);
        r.state
            .store(DescState::encode(rgen, Kind::RefLive, 0), Ordering::Release);
        noted(i, ridx, r);
        i.shm.atomics().refs_created.fetch_add(1, Ordering::Relaxed);
        Ref {
            backend: crate::refs::BACKEND_POOL,
            pool_id: self.id(),
            desc: ridx,
            generation: rgen,
            tag,
            len,
        }
    }

    /// A Ref to the first `len` bytes of `buf` (all its pages) that names
    /// the buffer's first-level lists and takes one count on each
    /// (`desc.rs`, *Shared lists*). With two levels the Ref has
    /// second-level lists of its own.
    fn share_lists(&self, buf: &Buffer, len: u64, ttl: Duration) -> Result<Ref> {
        let i = &self.inner;
        let b = i.desc(buf.desc)?;
        buf.check(self)?;
        if len == 0 {
            return Err(Error::ZeroLength);
        }
        buf.bounds(0, len)?;
        let n = buf.n_pages as usize;
        let (firsts, seconds) = i.shm.lists_needed(n);
        let (ridx, rgen) = i.claim_desc(Kind::RefBuild)?;
        let r = i.desc(ridx)?;
        let res = (|| -> Result<()> {
            // `held` counts lists from the start: a reclaimer drops no
            // list it took no count on.
            r.flags.fetch_or(FLAG_LIST_BUILD, Ordering::Release);
            r.n_pages.store(n as u32, Ordering::Release);
            i.attach_tops(r, n, seconds)?;
            for j in 0..firsts {
                let (Some(from), Some(to)) = (i.shm.list_slot(b, j)?, i.shm.list_slot(r, j)?)
                else {
                    return Err(Error::Corrupt(format!("list {j} of {n} pages has no slot")));
                };
                let l = from.load(Ordering::Acquire);
                if l != NO_PAGE {
                    i.shm.check_page(l)?;
                }
                to.store(l, Ordering::Release);
            }
            let mut none = Vec::new();
            i.bulk_change(
                ridx,
                r,
                0,
                firsts as u32,
                Src::Drop { held: 0 },
                Book::Held,
                Delta::Inc,
                &mut none,
            )?;
            crate::testing::reached(crate::testing::StopPoint::ListsShared);
            // Every list is held: read `held` as entries from now on.
            r.held.store(n as u32, Ordering::Release);
            r.flags.fetch_and(!FLAG_LIST_BUILD, Ordering::AcqRel);
            Ok(())
        })();
        if let Err(e) = res {
            i.core.end_list_build(r)?;
            i.drop_own(ridx, rgen, Kind::RefBuild, END_ABORTED)?;
            return Err(e);
        }
        let tag = dm_sys::rand::random_u64();
        r.tag.store(tag, Ordering::Relaxed);
        r.len.store(len, Ordering::Relaxed);
        r.offset.store(0, Ordering::Relaxed);
        r.expiry_ms.store(
            i.shm
                .ref_now_coarse()
                .saturating_add(ttl.as_millis() as u64),
            Ordering::Relaxed,
        );
        Ok(self.commit_ref(ridx, r, rgen, tag, len))
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
        noted(i, buf.desc, d);
        i.shm.atomics().refs_created.fetch_add(1, Ordering::Relaxed);
        // A Ref in flight is bounded by its TTL, not by a quota.
        i.uncharge(buf.n_pages as u64);
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
        if let Err(e) = i.charge(n as u64) {
            i.drop_own(idx, gen, Kind::MapBuild, END_ABORTED)?;
            return Err(e);
        }
        // (From here a drop of the buffer gives the charge back.)
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
            i.uncharge(n as u64);
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
            mapped: false,
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
}

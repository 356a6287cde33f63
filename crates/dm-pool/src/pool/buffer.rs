//! [`Buffer`]: a range of pool pages owned by this process, read through
//! the pool window and written with page-granular copy-on-write.

use super::{Inner, Pool};
use crate::desc::{Desc, FLAG_INHERIT, LIST_JOURNAL};
use crate::error::{Error, Result};
use crate::pages::{Delta, BORROWED, NO_PAGE};
use crate::reclaim::{Book, Src};
use crate::refs::Ref;
use crate::sync::Ordering;
use std::mem::MaybeUninit;
use std::sync::Arc;

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
    pub(super) pool: Pool,
    pub(super) desc: u32,
    pub(super) generation: u32,
    pub(super) len: u64,
    pub(super) offset: u32,
    pub(super) n_pages: u32,
    /// Set when the handle no longer owns the descriptor (freed explicitly
    /// or turned into a `BufferId`): dropping it then frees nothing.
    pub(super) detached: bool,
    /// Set when a [`MappedBuffer`](crate::MappedBuffer) maps it: shared
    /// only through the mapped buffer, which write-protects its mapping.
    pub(super) mapped: bool,
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

    pub(super) fn check(&self, pool: &Pool) -> Result<()> {
        pool.inner.live()?;
        if pool.id() != self.pool.id() || !Arc::ptr_eq(&pool.inner, &self.pool.inner) {
            return Err(Error::ForeignPool {
                expected: pool.id(),
                found: self.pool.id(),
            });
        }
        Ok(())
    }

    pub(super) fn bounds(&self, offset: u64, len: u64) -> Result<()> {
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

    /// Gives this buffer a copy of every first-level list holding entries
    /// `[k0, k1)` that a Ref shares (`desc.rs`, *Shared lists*), so that
    /// each page's count says whether another holder reads it.
    pub(crate) fn own_lists(&mut self, k0: usize, k1: usize) -> Result<()> {
        let i = self.pool.inner.clone();
        let d = self.d()?;
        if k0 >= k1 || i.shm.list_span(d) == 0 || i.shm.inherits_from(d).is_some() {
            return Ok(());
        }
        let per = i.shm.layout.per_list_page();
        let t = i.shm.pages();
        for j in k0 / per..=(k1 - 1) / per {
            let Some(slot) = i.shm.list_slot(d, j)? else {
                continue;
            };
            let l = slot.load(Ordering::Acquire);
            if l != NO_PAGE && t.rc(i.shm.check_page(l)?) > 1 {
                i.copy_list(self.desc, d, j, slot, l)?;
            }
        }
        Ok(())
    }

    /// Marks this buffer as mapped for loads and stores (see `mapped`).
    pub(crate) fn set_mapped(&mut self) {
        self.mapped = true;
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
    /// are copied first (only the pages written); unbacked pages are backed
    /// (in one run of consecutive pages if the write fills the buffer and
    /// the pool has one, so that it reads as one slice).
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
        let start = self.offset as u64 + offset;
        let end = start + data.len() as u64;
        let mut src = 0usize;
        // (A whole buffer written takes one run of pages if it can.)
        let whole = offset == 0 && data.len() as u64 == self.len;
        self.own_pages(start, end, whole, |target, in_page, take| {
            // SAFETY: `target` is held by this buffer alone (rc == 1), so no
            // one else reads or writes it; the range is inside the page.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    data[src..].as_ptr(),
                    i.shm.page_ptr(target).add(in_page),
                    take,
                )
            };
            src += take;
        })?;
        Ok(())
    }

    /// Makes every page holding bytes `[start, end)` of the buffer's pages
    /// (offsets from its first page) its own alone, then hands each page's
    /// part to `each(page, in-page offset, bytes)`, in order. A shared or
    /// unbacked page is replaced by a fresh one, whose bytes outside the
    /// part are copied from the old page (or zeroed). Pages are reserved
    /// first, so it is all or nothing; `run`: in one run of consecutive
    /// pages if it can ([`Inner::take_run`]).
    fn own_pages(
        &mut self,
        start: u64,
        end: u64,
        run: bool,
        mut each: impl FnMut(u32, usize, usize),
    ) -> Result<()> {
        let i = self.pool.inner.clone();
        let ps = i.shm.layout.page_size as u64;
        // A list shared with a Ref becomes ours first: its pages then count
        // two holders, and are copied below.
        self.own_lists((start / ps) as usize, end.div_ceil(ps) as usize)?;
        let d = self.d()?;
        let t = i.shm.pages();
        let (k0, k1) = ((start / ps) as usize, end.div_ceil(ps) as usize);
        let mut need = 0;
        for k in k0..k1 {
            let (p, borrowed) = self.owned_page_at(k)?;
            if p == NO_PAGE || borrowed || t.rc(i.shm.check_page(p)?) != 1 {
                need += 1;
            }
        }
        let mut fresh = if run && need == k1 - k0 {
            i.take_run(need)?
        } else {
            i.take_pages(need)?
        }
        .into_iter();
        let mut pos = start;
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
                    // SAFETY: q came from this slot's page cache: a checked
                    // page index that no one else reads or writes.
                    unsafe { i.shm.zero_outside(q, in_page, take) };
                }
                // A borrowed page's share belongs to the Ref: nothing to drop.
                i.link_page(self.desc, d, k, if borrowed { NO_PAGE } else { p }, q)?;
                if p != NO_PAGE {
                    copies += 1;
                }
                q
            };
            each(target, in_page, take);
            pos += take as u64;
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

    /// Writes the whole buffer front to back with no copy but the caller's
    /// own stores: an encoder writes straight into pool pages.
    ///
    /// Every page first becomes the buffer's alone. A page shared with a
    /// Ref or another buffer is replaced by a fresh one, not copied (but
    /// the bytes of a first or last page outside the buffer's range, which
    /// are copied or zeroed as [`write`](Self::write) does). `fill` gets the
    /// buffer's bytes as runs of consecutive pool pages, in order. The runs
    /// are uninitialised memory to `fill`: it can write them, not read
    /// them. It returns how many bytes from the front it wrote. The rest is
    /// zeroed. If the pool has too few free pages, nothing changes and
    /// `ResourceExhausted` is returned.
    pub fn overwrite(
        &mut self,
        fill: impl FnOnce(&mut [&mut [MaybeUninit<u8>]]) -> usize,
    ) -> Result<()> {
        let i = self.pool.inner.clone();
        i.live()?;
        self.materialize()?;
        let ps = i.shm.layout.page_size as u64;
        let start = self.offset as u64;
        let end = start + self.len;
        // Fresh pages in one run if it can: the buffer then reads as one
        // slice. (page, in-page start, bytes) per run of consecutive pages.
        let mut runs: Vec<(u32, usize, usize)> = Vec::new();
        self.own_pages(start, end, true, |target, in_page, take| {
            match runs.last_mut() {
                Some((rp, rs, rn))
                    if in_page == 0 && *rp as u64 + ((*rs + *rn) as u64) / ps == target as u64 =>
                {
                    *rn += take
                }
                _ => runs.push((target, in_page, take)),
            }
        })?;
        let mut slices: Vec<&mut [MaybeUninit<u8>]> = runs
            .iter()
            .map(|&(p, at, n)| {
                // SAFETY: the run's pages are consecutive checked pages held
                // by this buffer alone (rc == 1, linked above), so no one else
                // reads or writes them while `&mut self` is borrowed, and
                // [at, at + n) lies inside them. MaybeUninit: `fill` may not
                // read bytes a page kept from its last owner.
                unsafe {
                    std::slice::from_raw_parts_mut(
                        i.shm.page_ptr(p).add(at).cast::<MaybeUninit<u8>>(),
                        n,
                    )
                }
            })
            .collect();
        let mut written = fill(&mut slices).min(self.len as usize);
        for s in slices.iter_mut() {
            let skip = written.min(s.len());
            written -= skip;
            s[skip..].fill(MaybeUninit::new(0));
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

    /// A second buffer over the same pages: each page gets one more share,
    /// nothing is copied. A write to either copies the page it writes
    /// first, so neither sees the other's later writes. This is how a
    /// caller sends a buffer and keeps it: `client.call("m", buf.dup()?)`.
    /// ([`Dm::dup`](crate::Dm::dup), without importing the trait.)
    pub fn dup(&self) -> Result<Buffer> {
        crate::Dm::dup(&self.pool, self)
    }
}

impl Inner {
    /// Replaces shared first-level list `l` (slot `j`, `slot`) of owned
    /// buffer `di` with a copy of its own, following the journal of
    /// `desc.rs` (*Shared lists*); `reclaim.rs` finishes each step the
    /// same way (`Core::finish_list_copy`).
    pub(crate) fn copy_list(
        &self,
        di: u32,
        d: &Desc,
        j: usize,
        slot: &crate::sync::AtomicU32,
        l: u32,
    ) -> Result<()> {
        let q = self.take_pages(1)?[0];
        for (from, to) in self.shm.list(l)?.iter().zip(self.shm.list(q)?) {
            to.store(from.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        d.progress.store(0, Ordering::Relaxed);
        d.journal_old.store(l, Ordering::Relaxed);
        d.journal_idx
            .store(LIST_JOURNAL | j as u32, Ordering::Release);
        slot.store(q, Ordering::Release);
        let mut freed = Vec::new();
        let res = self.core.finish_list_copy(di, d, self.slot, &mut freed);
        self.give_pages(freed);
        res?;
        self.shm
            .atomics()
            .lists_copied
            .fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

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

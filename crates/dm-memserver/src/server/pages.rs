//! The page manager: the pinned region cut into pages, a reference count
//! per page, and free FIFOs (sharded so that threads serving different
//! clients do not share a lock).
//!
//! A page's count is the number of holders: buffers of clients and Refs.
//! A page with count 1 is written in place by its one holder; a page with
//! a higher count is frozen (whoever writes copies it first, see
//! `space.rs`). When the count falls to zero the page goes to the back of
//! a free FIFO with its bytes as they are; it is zeroed when it is taken
//! again, where its taker does not overwrite it (`space.rs`: a write zeroes
//! the rest of a fresh page, a copy on write fills all of it), so a
//! recycled page never shows old data and a page filled whole is never
//! zeroed first. (It was zeroed when freed: a 1 MiB put paid a 1 MiB
//! memset for the pages the previous owner freed.)

use dm_pool::{Error, Result};
use dm_sys::mem::PinnedRegion;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

/// A page index that names no page: an unwritten page, which reads zero.
pub const NONE: u32 = u32::MAX;

/// The longest run of zeros [`Pages::slice`] gives for [`NONE`].
pub const ZERO_RUN: usize = 1 << 16;

/// The pages of a server.
#[derive(Debug)]
pub struct Pages {
    region: PinnedRegion,
    page_size: usize,
    n: u32,
    rc: Box<[AtomicU32]>,
    free: Box<[Mutex<VecDeque<u32>>]>,
    /// Pages in the FIFOs (reserved ones excluded).
    free_count: AtomicU64,
    /// Pages copied on write, since start.
    pub cow_copies: AtomicU64,
    /// Pages reserved by the buffers clients allocated (each the length
    /// of its buffer): never more than the region has, so that the
    /// address maps cannot promise more than the region holds.
    reserved: AtomicU64,
}

/// Locks a mutex, ignoring poisoning (every critical section here leaves
/// its data consistent before anything that can panic).
pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Pages {
    /// `size` bytes of pinned memory in pages of `page_size`, free lists in
    /// `shards` shards.
    pub fn new(size: u64, page_size: usize, shards: usize) -> Result<Pages> {
        if !page_size.is_power_of_two() || page_size < 512 {
            return Err(Error::Protocol(format!(
                "page size {page_size} is not a power of two of at least 512"
            )));
        }
        let n = (size / page_size as u64).min(NONE as u64 - 1) as u32;
        if n == 0 {
            return Err(Error::ResourceExhausted { what: "pages" });
        }
        let region = PinnedRegion::new(n as usize * page_size)?;
        let shards = shards.max(1);
        let mut free: Vec<VecDeque<u32>> = (0..shards).map(|_| VecDeque::new()).collect();
        for p in 0..n {
            free[p as usize % shards].push_back(p);
        }
        Ok(Pages {
            region,
            page_size,
            n,
            rc: (0..n).map(|_| AtomicU32::new(0)).collect(),
            free: free.into_iter().map(Mutex::new).collect(),
            free_count: AtomicU64::new(n as u64),
            cow_copies: AtomicU64::new(0),
            reserved: AtomicU64::new(0),
        })
    }

    /// Page size in bytes.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Number of pages.
    pub fn total(&self) -> u32 {
        self.n
    }

    /// Reserves `n` pages for a buffer being allocated: false if the
    /// buffers allocated already reserve the region but for fewer.
    pub fn reserve(&self, n: u64) -> bool {
        self.reserved
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |r| {
                r.checked_add(n).filter(|&t| t <= self.n as u64)
            })
            .is_ok()
    }

    /// Returns `n` reserved pages (a buffer allocated is freed).
    pub fn unreserve(&self, n: u64) {
        self.reserved.fetch_sub(n, Ordering::AcqRel);
    }

    /// Pages reserved by allocated buffers now.
    pub fn reserved(&self) -> u64 {
        self.reserved.load(Ordering::Relaxed)
    }

    /// Pages free now.
    pub fn free_count(&self) -> u64 {
        self.free_count.load(Ordering::Relaxed)
    }

    /// Whether the region is locked in RAM.
    pub fn locked(&self) -> bool {
        self.region.locked()
    }

    /// A page's count.
    pub fn rc(&self, p: u32) -> u32 {
        self.rc
            .get(p as usize)
            .map_or(0, |c| c.load(Ordering::Acquire))
    }

    /// Takes `n` zeroed pages (count 1 each) into `out`, all or none,
    /// preferring free list `hint`.
    pub fn take(&self, hint: usize, n: usize, out: &mut Vec<u32>) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        // Reserve first: the FIFOs then hold at least `n` pages for us.
        let mut cur = self.free_count.load(Ordering::Relaxed);
        loop {
            if cur < n as u64 {
                return Err(Error::ResourceExhausted { what: "pages" });
            }
            match self.free_count.compare_exchange_weak(
                cur,
                cur - n as u64,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(c) => cur = c,
            }
        }
        let shards = self.free.len();
        let mut got = 0;
        let mut k = hint % shards;
        while got < n {
            {
                let mut f = lock(&self.free[k]);
                while got < n {
                    let Some(p) = f.pop_front() else { break };
                    self.rc[p as usize].store(1, Ordering::Release);
                    out.push(p);
                    got += 1;
                }
            }
            // A page given back after our reservation may still be on its
            // way into a FIFO: keep going round until we have all.
            k = (k + 1) % shards;
        }
        Ok(())
    }

    /// One more holder of page `p`.
    pub fn share(&self, p: u32) {
        if p != NONE {
            self.rc[p as usize].fetch_add(1, Ordering::AcqRel);
        }
    }

    /// One holder fewer; the last one's page is zeroed and freed.
    pub fn unshare(&self, hint: usize, p: u32) {
        if p == NONE {
            return;
        }
        if self.rc[p as usize].fetch_sub(1, Ordering::AcqRel) == 1 {
            // Nobody holds it: free, bytes as they are (zeroed when taken).
            lock(&self.free[hint % self.free.len()]).push_back(p);
            self.free_count.fetch_add(1, Ordering::Release);
        }
    }

    /// Start of page `p` (in range, checked by the caller's invariants).
    fn ptr(&self, p: u32) -> *mut u8 {
        assert!(p < self.n, "page {p} out of range");
        // SAFETY: p < n, so the offset lies inside the region.
        unsafe { self.region.base().add(p as usize * self.page_size) }
    }

    /// Copies bytes `off..off + out.len()` of page `p` (zeros for
    /// [`NONE`]). The caller holds the page (count >= 1), so nobody frees
    /// it meanwhile; if the count is above 1 nobody writes it.
    pub fn read(&self, p: u32, off: usize, out: &mut [u8]) {
        if p == NONE {
            out.fill(0);
            return;
        }
        assert!(off + out.len() <= self.page_size);
        // SAFETY: in range (asserted); the page is held and not written by
        // anyone else (see above); `out` is ours.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr(p).add(off), out.as_mut_ptr(), out.len()) }
    }

    /// Appends bytes `off..off + n` of page `p` to `out` (zeros for
    /// [`NONE`]), with no zero-fill of `out` first. The same holding rule
    /// as [`read`](Self::read).
    pub fn append(&self, p: u32, off: usize, n: usize, out: &mut Vec<u8>) {
        if p == NONE {
            out.resize(out.len() + n, 0);
            return;
        }
        assert!(off + n <= self.page_size);
        // SAFETY: in range (asserted); the page is held and not written by
        // anyone else while the caller holds it (see `read`).
        let src = unsafe { std::slice::from_raw_parts(self.ptr(p).add(off), n) };
        out.extend_from_slice(src);
    }

    /// Bytes `off..off + n` of page `p` where they lie (zeros for
    /// [`NONE`]), for a caller that holds a share of the page on top of
    /// its other holders ([`share`](Self::share), a pin): with a count
    /// above one nobody frees the page or writes it in place (a writer
    /// copies it first) while the slice lives, as long as the pin does.
    /// A piece of [`NONE`] is at most [`ZERO_RUN`] long.
    pub fn slice(&self, p: u32, off: usize, n: usize) -> &[u8] {
        static ZEROS: [u8; ZERO_RUN] = [0; ZERO_RUN];
        if p == NONE {
            assert!(n <= ZERO_RUN, "a run of zeros of {n} bytes");
            return &ZEROS[..n];
        }
        assert!(off + n <= self.page_size);
        // SAFETY: in range (asserted); the page is pinned by the caller,
        // so it stays allocated and unwritten while the slice lives (the
        // region itself lives as long as `self`).
        unsafe { std::slice::from_raw_parts(self.ptr(p).add(off), n) }
    }

    /// Bytes `off..off + n` of page `p`, to receive bytes into while they
    /// arrive: a Ref's (a `stream_put`) or a buffer's (a long `write`).
    ///
    /// # Safety
    /// The caller is the page's filler, and no two slices of the same
    /// bytes live at once. Either it holds a share of a Ref's page and
    /// alone writes these bytes, which nobody reads until the fill says
    /// they have arrived (readers of the Ref wait for that, and the Ref
    /// table hands out no range before: `refs.rs`). Or the page is one
    /// buffer's alone (count 1) and the caller serves the session that
    /// owns the buffer, which does nothing else meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn fill_slice(&self, p: u32, off: usize, n: usize) -> &mut [u8] {
        assert!(p != NONE && off + n <= self.page_size);
        // SAFETY: in range (asserted); exclusive by the caller's word.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(p).add(off), n) }
    }

    /// Zeroes bytes `from..` of page `p`, whose filler the caller is (see
    /// [`fill_slice`](Self::fill_slice)): the tail past a Ref's last byte.
    pub fn zero_tail(&self, p: u32, from: usize) {
        assert!(p != NONE && from <= self.page_size);
        // SAFETY: in range (asserted); bytes past the Ref's end, which no
        // holder reads or writes.
        unsafe { std::ptr::write_bytes(self.ptr(p).add(from), 0, self.page_size - from) }
    }

    /// Zeroes page `p` (held alone by the caller, just taken) except `len`
    /// bytes at `at`, which the caller is about to write.
    pub fn zero_outside(&self, p: u32, at: usize, len: usize) {
        assert!(at + len <= self.page_size);
        debug_assert_eq!(self.rc(p), 1, "only a fresh page is zeroed");
        // SAFETY: in range (asserted); the caller is the page's only
        // holder, so nobody else reads or writes it.
        unsafe {
            std::ptr::write_bytes(self.ptr(p), 0, at);
            std::ptr::write_bytes(self.ptr(p).add(at + len), 0, self.page_size - at - len);
        }
    }

    /// Writes `data` at `off` of page `p`, which the caller holds alone
    /// (count 1).
    pub fn write(&self, p: u32, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.page_size);
        debug_assert_eq!(self.rc(p), 1, "writes go to exclusive pages");
        // SAFETY: in range (asserted); the caller is the page's only holder,
        // so nobody else reads or writes it.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr(p).add(off), data.len()) }
    }

    /// Copies page `from` (held, frozen) into page `to` (held alone).
    pub fn copy(&self, from: u32, to: u32) {
        debug_assert_eq!(self.rc(to), 1);
        // SAFETY: both in range; `from` is only read (frozen), `to` is ours
        // alone, and they differ (`to` was just taken from a free list).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr(from), self.ptr(to), self.page_size) };
        self.cow_copies.fetch_add(1, Ordering::Relaxed);
    }

    /// Pages with more than one holder (a scan).
    pub fn shared(&self) -> u64 {
        self.rc
            .iter()
            .filter(|c| c.load(Ordering::Relaxed) > 1)
            .count() as u64
    }

    /// Checks the page table against `expected` counts (from every holder):
    /// every count matches, every free page is in exactly one FIFO with
    /// count 0. (Free pages keep their bytes: they are zeroed when taken.)
    /// The caller has stopped every change (see `State::check`).
    pub fn check(&self, expected: &[u32], problems: &mut Vec<String>) {
        let mut in_fifo = vec![false; self.n as usize];
        let mut listed = 0u64;
        for f in self.free.iter() {
            for &p in lock(f).iter() {
                listed += 1;
                match in_fifo.get_mut(p as usize) {
                    None => problems.push(format!("free list holds page {p}, out of range")),
                    Some(true) => problems.push(format!("page {p} is on the free lists twice")),
                    Some(seen) => *seen = true,
                }
            }
        }
        if listed != self.free_count() {
            problems.push(format!(
                "{listed} pages on the free lists, the counter says {}",
                self.free_count()
            ));
        }
        for p in 0..self.n {
            let rc = self.rc(p);
            let want = expected.get(p as usize).copied().unwrap_or(0);
            if rc != want {
                problems.push(format!("page {p}: count {rc}, {want} holders"));
            }
            if in_fifo[p as usize] && rc != 0 {
                problems.push(format!("page {p} is free with count {rc}"));
            }
            if !in_fifo[p as usize] && rc == 0 {
                problems.push(format!("page {p} is lost: count 0, not on a free list"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_is_all_or_nothing_and_recycles() {
        let pages = Pages::new(8 * 4096, 4096, 3).unwrap();
        let mut v = Vec::new();
        pages.take(1, 6, &mut v).unwrap();
        assert_eq!(v.len(), 6);
        let mut w = Vec::new();
        assert!(matches!(
            pages.take(0, 3, &mut w),
            Err(Error::ResourceExhausted { what: "pages" })
        ));
        assert!(w.is_empty(), "nothing taken on failure");
        assert_eq!(pages.free_count(), 2);
        pages.write(v[0], 10, b"old data");
        pages.share(v[0]);
        pages.unshare(0, v[0]);
        assert_eq!(pages.rc(v[0]), 1, "still held once");
        for &p in &v {
            pages.unshare(2, p);
        }
        assert_eq!(pages.free_count(), 8);
        let mut expected = vec![0u32; 8];
        let mut problems = Vec::new();
        pages.check(&expected, &mut problems);
        assert!(problems.is_empty(), "{problems:?}");
        // Everything comes back; a taker zeroes what it does not write.
        let mut all = Vec::new();
        pages.take(0, 8, &mut all).unwrap();
        for &p in &all {
            pages.zero_outside(p, 10, 3);
            pages.write(p, 10, b"new");
            let mut b = [1u8; 4096];
            pages.read(p, 0, &mut b);
            let mut want = [0u8; 4096];
            want[10..13].copy_from_slice(b"new");
            assert_eq!(b, want);
        }
        expected.fill(1);
        let mut problems = Vec::new();
        pages.check(&expected, &mut problems);
        assert!(problems.is_empty(), "{problems:?}");
        expected[3] = 2;
        let mut problems = Vec::new();
        pages.check(&expected, &mut problems);
        assert_eq!(problems.len(), 1, "a wrong count is reported");
    }
}

//! The per-process page cache: free pages this process's slot holds
//! (`Cached` in the page table), so that most allocations and frees touch
//! no shared word beyond the pages' own counts.
//!
//! **Pages cool before they are reused.** A pool page is written by one
//! process and read by another, most often on the other core. When the
//! writer frees it and takes it again at once, its lines still sit in the
//! reader's core's caches, and the next write has to take each line back
//! from there, one at a time. Measured on the 2-core test machine (AMD
//! EPYC, 1 MiB of L2 a core; `examples/chain_loop`, one call at a time
//! through one tier that reads every byte; BENCHMARKS.md, "Freed pages
//! cool"): the client's write of a 64 KiB request into the pages its
//! previous call freed took 8.1–8.9 µs (medians of interleaved runs),
//! against 2.4 µs into pages that had cooled, and the whole call went
//! from 11.4–13.3 µs to 4.8–5.5 µs; at 1 MiB, from 136–149 µs to
//! 56–61 µs (the write 116–124 µs to 37 µs). So freed pages first
//! *cool*: they wait, oldest first, until the pages this process has out
//! in buffers and Refs plus the ones freed after them add up to `cool`
//! pages (default [`DEFAULT_COOL_BYTES`]; 1 MiB cooled too little). Then
//! they are *ready*, and a take uses the ready ones cooled last (still in
//! the shared L3, and in the TLB). A process with that much out already
//! (eight 1 MiB calls in flight) keeps nothing cooling: its calls' own
//! traffic pushes the pages out of the reader's L2, and extra distinct
//! pages only cost TLB and L3 reach (there the reader's 1 MiB read took
//! 32 µs with 2 MiB cooling, 18 µs without).
//!
//! The price: a payload nobody reads on another core (an echo that sends
//! the bytes back untouched) was hot in the writer's own L2, and now
//! comes from the L3: `bench rtt`'s 256 KiB echo by Ref went from
//! 8.5–8.8 µs to about 11 µs. A process whose pages stay on its own core
//! can attach with `cool_pages: Some(0)`.
//!
//! **Cost.** A process that allocates holds up to `cool` pages idle; one
//! that only forwards or reads holds none beyond what it frees. `cool` is
//! capped at half the cache's limit and an eighth of the pool. Pages still
//! cooling are used when nothing else is left, so a small pool never runs
//! out because of them; after the pool could not fill a refill, the cache
//! stops claiming pages to spare cooling ones for a while (a nearly full
//! pool is scanned on every claim).

use std::collections::VecDeque;

/// Takes with no give in between after which the pages counted out are
/// taken for gone (freed by other processes): the count of pages out
/// starts again, so that what this process does free cools again.
const FORGET_OUT_TAKES: u32 = 256;

/// Takes after a short refill during which the cache claims only what a
/// take needs.
const LEAN_TAKES: u32 = 64;

/// A process's free pages: the ones freed last cooling (oldest first), and
/// the ones ready to be taken (newest on top).
#[derive(Debug, Default)]
pub(crate) struct PageCache {
    /// Freed pages, oldest first, until `cool` newer ones follow them.
    cooling: VecDeque<u32>,
    /// Pages that have cooled, or were claimed from the pool: taken from
    /// the back (the most recently cooled), given back to the pool from
    /// the front.
    ready: VecDeque<u32>,
    /// Takes left during which the cache claims only what a take needs
    /// (after a refill the pool could not supply in full).
    lean: u32,
    /// Pages taken and not given back yet (out in buffers and Refs),
    /// as far as this cache can tell: pages another process frees last
    /// never come back here, so after [`FORGET_OUT_TAKES`] takes with no
    /// give in between the count starts again from zero.
    out: usize,
    /// Takes since the last give.
    takes_since_give: u32,
}

impl PageCache {
    /// Pages in the cache.
    pub(crate) fn len(&self) -> usize {
        self.cooling.len() + self.ready.len()
    }

    /// How many pages to claim from the pool before taking `n`: zero if
    /// enough have cooled; else a `batch` at least. While lean (the pool
    /// ran short lately), only if the cache as a whole holds fewer than
    /// `n`: then the take uses pages still cooling.
    pub(crate) fn refill_for(&mut self, n: usize, batch: usize) -> usize {
        let have = if self.lean > 0 {
            self.lean -= 1;
            self.len()
        } else {
            self.ready.len()
        };
        match n.checked_sub(have) {
            Some(short) if short > 0 => batch.max(short),
            _ => 0,
        }
    }

    /// Adds pages claimed from the pool for a refill of `wanted`: they are
    /// cold, or hot in no other core's caches, so they are ready at once.
    pub(crate) fn refilled(&mut self, claimed: Vec<u32>, wanted: usize) {
        if claimed.len() < wanted {
            self.lean = LEAN_TAKES;
        }
        self.ready.extend(claimed);
    }

    /// `n` pages, the most recently cooled first, then (only if too few
    /// have cooled) the oldest still cooling; `None` if the cache holds
    /// fewer than `n`.
    pub(crate) fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.len() < n {
            return None;
        }
        self.takes_since_give += 1;
        if self.takes_since_give > FORGET_OUT_TAKES {
            (self.out, self.takes_since_give) = (0, 0);
        }
        self.out = self.out.saturating_add(n);
        let from_ready = n.min(self.ready.len());
        let mut out: Vec<u32> = self.ready.drain(self.ready.len() - from_ready..).collect();
        out.extend(self.cooling.drain(..n - from_ready));
        Some(out)
    }

    /// `n` pages consecutive in the pool, from the ready ones: the run
    /// cooled last that is long enough (a buffer's pages come back in
    /// order, so its run is there whole until taken apart). `None` if
    /// there is none. One pass over the ready pages.
    pub(crate) fn take_run(&mut self, n: usize) -> Option<Vec<u32>> {
        let r = &self.ready;
        if n == 0 || r.len() < n {
            return None;
        }
        let mut run = 1;
        let mut at = (n == 1).then(|| r.len() - 1);
        for i in (0..r.len() - 1).rev() {
            if at.is_some() {
                break;
            }
            run = if r[i].checked_add(1) == Some(r[i + 1]) {
                run + 1
            } else {
                1
            };
            if run == n {
                at = Some(i);
            }
        }
        let at = at?;
        self.takes_since_give += 1;
        if self.takes_since_give > FORGET_OUT_TAKES {
            (self.out, self.takes_since_give) = (0, 0);
        }
        self.out = self.out.saturating_add(n);
        Some(self.ready.drain(at..at + n).collect())
    }

    /// Pages freed now: they cool until the pages out in buffers and the
    /// ones cooling after them add up to `cool`.
    pub(crate) fn give(&mut self, pages: Vec<u32>, cool: usize) {
        self.out = self.out.saturating_sub(pages.len());
        self.takes_since_give = 0;
        self.cooling.extend(pages);
        while self.cooling.len() > cool.saturating_sub(self.out) {
            let Some(p) = self.cooling.pop_front() else {
                break;
            };
            self.ready.push_back(p);
        }
    }

    /// The page to give back to the pool when the cache is over its limit:
    /// the ready page idle longest, else the oldest cooling one.
    pub(crate) fn pop_oldest(&mut self) -> Option<u32> {
        self.ready.pop_front().or_else(|| self.cooling.pop_front())
    }

    /// Every page, emptying the cache (the process detaches).
    pub(crate) fn drain_all(&mut self) -> impl Iterator<Item = u32> + '_ {
        self.ready.drain(..).chain(self.cooling.drain(..))
    }
}

/// What a cache lets cool by default: twice a core's L2 on the test
/// machine. (4 MiB cooled the one-at-a-time calls no better, and cost a
/// fifth of `bench image`'s throughput at 1 MiB, where eight processes
/// allocate: their pages in circulation outgrew the L3.)
pub(crate) const DEFAULT_COOL_BYTES: usize = 2 << 20;

/// How many pages a cache lets cool: `wanted` (default:
/// [`DEFAULT_COOL_BYTES`] of pages),
/// at most half of `cache_max` and an eighth of the pool's `pages`.
pub(crate) fn reserve(
    wanted: Option<usize>,
    page_size: usize,
    cache_max: usize,
    pages: usize,
) -> usize {
    wanted
        .unwrap_or(DEFAULT_COOL_BYTES / page_size.max(1))
        .min(cache_max / 2)
        .min(pages / 8)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn freed_pages_cool_before_they_are_taken_again() {
        let mut c = PageCache::default();
        // Empty: claim a batch at least.
        assert_eq!(c.refill_for(2, 3), 3);
        c.refilled(vec![10, 11, 12], 3);
        assert_eq!(c.take(2), Some(vec![11, 12]));
        // Freed with a cool of two: they cool.
        c.give(vec![12, 11], 2);
        assert_eq!(c.len(), 3);
        assert_eq!(c.refill_for(2, 3), 3, "only one page is ready");
        c.refilled(vec![20, 21, 22], 3);
        assert_eq!(c.take(2), Some(vec![21, 22]));
        // Freeing these pushes the older two past the cool.
        c.give(vec![21, 22], 2);
        assert_eq!(c.refill_for(3, 3), 0);
        assert_eq!(c.take(3), Some(vec![20, 12, 11]));
    }

    #[test]
    fn a_run_is_found_where_it_lies_and_taken_whole() {
        let mut c = PageCache::default();
        c.refilled(vec![7, 1, 2, 3, 9, 4, 5, 6, 40], 9);
        assert_eq!(c.take_run(4), None);
        assert_eq!(c.take_run(3), Some(vec![4, 5, 6]));
        assert_eq!(c.take_run(3), Some(vec![1, 2, 3]));
        assert_eq!(c.take_run(2), None);
        assert_eq!(c.take_run(1), Some(vec![40]));
        assert_eq!(c.take_run(0), None);
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn pages_out_count_toward_the_cool() {
        let mut c = PageCache::default();
        c.refilled((0..8).collect(), 8);
        let a = c.take(4).unwrap();
        let b = c.take(4).unwrap();
        // Eight out, a cool of six: freeing four leaves four out, so two
        // of them cool and two are ready.
        c.give(b.clone(), 6);
        assert_eq!(c.refill_for(4, 2), 2);
        // Freeing the other four too: with nothing out, six cool.
        c.give(a.clone(), 6);
        assert_eq!(c.refill_for(2, 2), 0);
        assert_eq!(c.take(2), Some(b[..2].to_vec()));
        // With four out already (a cool of four), pages freed are ready
        // at once, and taken again first.
        let mut c = PageCache::default();
        c.refilled((0..8).collect(), 8);
        let out = c.take(8).unwrap();
        c.give(out[4..].to_vec(), 4);
        assert_eq!(c.take(4), Some(out[4..].to_vec()));
    }

    #[test]
    fn pages_freed_elsewhere_are_forgotten_and_cooling_resumes() {
        let mut c = PageCache::default();
        c.refilled((0..1000).collect(), 1000);
        // Many takes whose pages other processes free: none come back.
        for _ in 0..FORGET_OUT_TAKES {
            c.take(2).unwrap();
        }
        assert_eq!(c.out, 2 * FORGET_OUT_TAKES as usize);
        // So far they count as out, and a page freed now would not cool
        // (a cool of 8 is far below what is out); one take more forgets
        // them, and the page freed next cools.
        c.take(2).unwrap();
        assert_eq!(c.out, 2);
        c.give(vec![5000], 8);
        assert_eq!(c.cooling.len(), 1);
        // A give resets the count of takes: what a busy process has out
        // is not forgotten while its pages come back.
        for _ in 0..2 * FORGET_OUT_TAKES {
            let p = c.take(1).unwrap();
            c.give(p, 8);
        }
        assert_eq!(c.out, 1);
    }

    #[test]
    fn pages_still_cooling_serve_a_take_the_pool_cannot() {
        let mut c = PageCache::default();
        c.give(vec![1, 2, 3], 8);
        assert_eq!(c.refill_for(2, 4), 4);
        // The pool had nothing: the take uses cooling pages, oldest first.
        c.refilled(Vec::new(), 4);
        assert_eq!(c.take(2), Some(vec![1, 2]));
        // Lean for a while: no claim while the cache can serve the take.
        assert_eq!(c.refill_for(1, 4), 0);
        assert_eq!(c.take(1), Some(vec![3]));
        assert_eq!(c.refill_for(1, 4), 4);
        assert_eq!(c.take(1), None);
        // After the lean takes, claims keep the cooling pages again.
        for _ in 0..LEAN_TAKES {
            c.refill_for(1, 4);
        }
        c.give(vec![7], 8);
        assert_eq!(c.refill_for(1, 4), 4);
    }

    #[test]
    fn the_oldest_go_back_first_and_detaching_returns_all() {
        let mut c = PageCache::default();
        c.refilled(vec![1, 2], 2);
        c.give(vec![3, 4], 1);
        assert_eq!(c.pop_oldest(), Some(1));
        let mut rest: Vec<u32> = c.drain_all().collect();
        rest.sort_unstable();
        assert_eq!(rest, vec![2, 3, 4]);
        assert_eq!(c.len(), 0);
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Take this many (after the refill it asks for).
        Take(usize),
        /// Give back this many of the pages out (the oldest taken first).
        Give(usize),
        /// Give the oldest page back to the pool.
        Pop,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1usize..40).prop_map(Op::Take),
            (1usize..40).prop_map(Op::Give),
            Just(Op::Pop),
        ]
    }

    proptest! {
        /// Every page is in exactly one place (the pool, the cache, out),
        /// a take fails only when the cache and the pool together hold too
        /// few, and pages still cooling are used only when the pool runs
        /// short.
        #[test]
        fn pages_are_never_lost_or_doubled(
            ops in proptest::collection::vec(op(), 1..200),
            supply in 0usize..400,
            cool in 0usize..64,
            batch in 1usize..32,
        ) {
            let mut c = PageCache::default();
            let mut pool: Vec<u32> = (0..supply as u32).collect();
            let mut out: Vec<u32> = Vec::new();
            for op in ops {
                match op {
                    Op::Take(n) => {
                        let lean = c.lean > 0;
                        let want = c.refill_for(n, batch);
                        let got = pool.split_off(pool.len().saturating_sub(want));
                        let short = got.len() < want;
                        c.refilled(got, want);
                        let (before, ready) = (c.len(), c.ready.len());
                        match c.take(n) {
                            Some(p) => {
                                prop_assert_eq!(p.len(), n);
                                if !lean && !short {
                                    // The pool filled the refill: nothing
                                    // still cooling is used.
                                    prop_assert!(ready >= n);
                                }
                                out.extend(p);
                            }
                            None => prop_assert!(before < n && pool.is_empty()),
                        }
                    }
                    Op::Give(k) => {
                        let k = k.min(out.len());
                        c.give(out.drain(..k).collect(), cool);
                        prop_assert!(c.cooling.len() <= cool);
                    }
                    Op::Pop => {
                        if let Some(p) = c.pop_oldest() {
                            pool.push(p);
                        }
                    }
                }
                let mut all: Vec<u32> = pool.iter().chain(&out).copied().collect();
                all.extend(c.ready.iter().chain(&c.cooling));
                all.sort_unstable();
                prop_assert_eq!(all, (0..supply as u32).collect::<Vec<_>>());
            }
            let mut left: Vec<u32> = c.drain_all().collect();
            left.extend(out);
            left.extend(pool);
            left.sort_unstable();
            prop_assert_eq!(left, (0..supply as u32).collect::<Vec<_>>());
            prop_assert_eq!(c.len(), 0);
        }
    }

    #[test]
    fn the_cool_is_capped_by_the_cache_limit_and_the_pool() {
        assert_eq!(reserve(None, 4096, 2048, 1 << 18), 512);
        assert_eq!(reserve(None, 4096, 64, 1 << 18), 32);
        assert_eq!(reserve(None, 4096, 2048, 256), 32);
        assert_eq!(reserve(Some(0), 4096, 2048, 1 << 18), 0);
        assert_eq!(reserve(None, 2 << 20, 2048, 1 << 18), 1);
    }
}

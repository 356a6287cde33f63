//! The Ref table: frozen snapshots of buffer ranges, named by unforgeable
//! Refs (a random tag and a generation per slot), sharded so that threads
//! do not share one lock.
//!
//! A Ref's descriptor number is `slot * SHARDS + shard`. A released or
//! expired slot keeps its generation as a tombstone (so a second release
//! says "released", not "stale") until it is reused, oldest first, with
//! the next generation.

use super::pages::{lock, Pages};
use super::quota::Charge;
use dm_pool::{Error, Ref, Result, BACKEND_MEMSERVER};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Number of shards.
pub const SHARDS: usize = 16;

/// What a live Ref holds: a share of each of its pages.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Bytes.
    pub len: u64,
    /// Offset of the first byte in the first page.
    pub head: u32,
    /// The pages ([`super::pages::NONE`] for unwritten ones).
    pub pages: Vec<u32>,
}

/// The bytes of a Ref still arriving (a `stream_put`): how many have,
/// from the start, and whether they stopped short. Readers of the Ref
/// wait for their range ([`Fill::wait`]); the table refuses to hand out
/// a range not filled yet.
#[derive(Debug)]
pub struct Fill {
    len: u64,
    filled: AtomicU64,
    broken: AtomicBool,
    notify: tokio::sync::Notify,
}

impl Fill {
    /// A fill of `len` bytes, none arrived.
    pub fn new(len: u64) -> Fill {
        Fill {
            len,
            filled: AtomicU64::new(0),
            broken: AtomicBool::new(false),
            notify: tokio::sync::Notify::new(),
        }
    }

    /// Bytes arrived, from the start.
    pub fn filled(&self) -> u64 {
        self.filled.load(Ordering::Acquire)
    }

    /// Whether every byte has arrived.
    pub fn complete(&self) -> bool {
        self.filled() >= self.len
    }

    /// Records that bytes up to `to` have arrived (written to the pages
    /// before this is called), and wakes those waiting.
    pub fn advance(&self, to: u64) {
        self.filled.store(to.min(self.len), Ordering::Release);
        self.notify.notify_waiters();
    }

    /// Records that no more bytes will come, and wakes those waiting.
    pub fn break_off(&self) {
        self.broken.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }

    /// Waits until bytes up to `end` have arrived, or fails if they never
    /// will.
    pub async fn wait(&self, end: u64) -> Result<()> {
        loop {
            let n = self.notify.notified();
            tokio::pin!(n);
            // Registered before the checks, so no wake-up is missed.
            n.as_mut().enable();
            if self.filled() >= end.min(self.len) {
                return Ok(());
            }
            if self.broken.load(Ordering::Acquire) {
                return Err(broken());
            }
            n.await;
        }
    }
}

/// What a Ref whose bytes stopped short answers.
fn broken() -> Error {
    Error::Unavailable(
        "the sender of this Ref's bytes went away before the last of them arrived".into(),
    )
}

/// What a read of bytes not arrived yet gets (the server waits for them
/// first: only a caller that does not wait sees this).
fn arriving() -> Error {
    Error::Unavailable("this Ref's bytes are still arriving".into())
}

#[derive(Debug)]
enum State {
    Live {
        tag: u64,
        snap: Snapshot,
        expires: Instant,
        /// Its pages, charged to the quota of the session that made it.
        _charge: Charge,
        /// Its bytes, if they were still arriving when it was made.
        fill: Option<Arc<Fill>>,
    },
    Released,
    Expired,
}

#[derive(Debug)]
struct Slot {
    generation: u32,
    state: State,
}

#[derive(Debug, Default)]
struct Shard {
    slots: Vec<Slot>,
    /// Tombstoned slots, oldest first.
    reuse: VecDeque<u32>,
}

/// The Ref table of one server.
#[derive(Debug)]
pub struct Refs {
    server_id: u64,
    shards: Box<[Mutex<Shard>]>,
    per_shard: usize,
    next_shard: AtomicUsize,
    live: AtomicU64,
    /// Refs created since start.
    pub created: AtomicU64,
}

impl Refs {
    /// A table for server `server_id` with room for `capacity` live Refs.
    pub fn new(server_id: u64, capacity: usize) -> Refs {
        Refs {
            server_id,
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            per_shard: capacity.div_ceil(SHARDS).max(1),
            next_shard: AtomicUsize::new(0),
            live: AtomicU64::new(0),
            created: AtomicU64::new(0),
        }
    }

    /// Live Refs now.
    pub fn live(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }

    /// Records a snapshot (whose page shares the caller took) as a new Ref.
    /// On failure the caller still owns the shares.
    pub fn insert(&self, snap: Snapshot, expires: Instant, charge: Charge) -> Result<Ref> {
        self.insert_filling(snap, expires, charge, None)
    }

    /// [`insert`](Self::insert), for a snapshot whose bytes are still
    /// arriving (`fill`): its ranges are handed out only once filled.
    pub fn insert_filling(
        &self,
        snap: Snapshot,
        expires: Instant,
        charge: Charge,
        fill: Option<Arc<Fill>>,
    ) -> Result<Ref> {
        let tag = dm_sys::rand::random_u64();
        let start = self.next_shard.fetch_add(1, Ordering::Relaxed);
        for k in 0..SHARDS {
            let si = (start + k) % SHARDS;
            let mut sh = lock(&self.shards[si]);
            let (idx, generation) = if let Some(i) = sh.reuse.pop_front() {
                let s = &mut sh.slots[i as usize];
                s.generation = s.generation.wrapping_add(1).max(1);
                (i, s.generation)
            } else if sh.slots.len() < self.per_shard {
                sh.slots.push(Slot {
                    generation: 1,
                    state: State::Released,
                });
                ((sh.slots.len() - 1) as u32, 1)
            } else {
                continue;
            };
            let len = snap.len;
            sh.slots[idx as usize].state = State::Live {
                tag,
                snap,
                expires,
                _charge: charge,
                fill,
            };
            self.live.fetch_add(1, Ordering::Relaxed);
            self.created.fetch_add(1, Ordering::Relaxed);
            return Ok(Ref {
                backend: BACKEND_MEMSERVER,
                pool_id: self.server_id,
                desc: idx * SHARDS as u32 + si as u32,
                generation,
                tag,
                len,
            });
        }
        Err(Error::ResourceExhausted { what: "refs" })
    }

    /// The fill of `r` if its bytes are still arriving (`None` once they
    /// all have, or for a Ref made whole).
    pub fn filling(&self, pages: &Pages, hint: usize, r: &Ref) -> Result<Option<Arc<Fill>>> {
        self.with_live(pages, hint, r, |_, f| f.filter(|f| !f.complete()).cloned())
    }

    /// Validates `r` and runs `f` on its live snapshot and its fill, under
    /// its shard's lock. A Ref past its TTL is expired on the spot (its
    /// pages freed).
    fn with_live<T>(
        &self,
        pages: &Pages,
        hint: usize,
        r: &Ref,
        f: impl FnOnce(&Snapshot, Option<&Arc<Fill>>) -> T,
    ) -> Result<T> {
        if r.backend != BACKEND_MEMSERVER || r.pool_id != self.server_id {
            return Err(Error::ForeignPool {
                expected: self.server_id,
                found: r.pool_id,
            });
        }
        let si = r.desc as usize % SHARDS;
        let idx = r.desc as usize / SHARDS;
        let mut sh = lock(&self.shards[si]);
        let forged = Error::RefForged { desc: r.desc };
        let slot = sh
            .slots
            .get_mut(idx)
            .ok_or(Error::RefForged { desc: r.desc })?;
        if slot.generation != r.generation {
            return Err(Error::RefStale {
                desc: r.desc,
                generation: r.generation,
                current: slot.generation,
            });
        }
        let (desc, generation) = (r.desc, r.generation);
        match &slot.state {
            State::Released => Err(Error::RefReleased { desc, generation }),
            State::Expired => Err(Error::RefExpired { desc, generation }),
            State::Live { tag, snap, .. } if *tag != r.tag || snap.len != r.len => Err(forged),
            State::Live { expires, .. } if *expires <= Instant::now() => {
                let old = std::mem::replace(&mut slot.state, State::Expired);
                sh.reuse.push_back(idx as u32);
                drop(sh);
                self.drop_snapshot(pages, hint, old);
                Err(Error::RefExpired { desc, generation })
            }
            State::Live { snap, fill, .. } => Ok(f(snap, fill.as_ref())),
        }
    }

    fn drop_snapshot(&self, pages: &Pages, hint: usize, st: State) {
        if let State::Live { snap, .. } = st {
            self.live.fetch_sub(1, Ordering::Relaxed);
            for p in snap.pages {
                pages.unshare(hint, p);
            }
        }
    }

    /// The snapshot of `r`, with one more share of each of its pages for
    /// the caller (a new mapping).
    /// Refused while its bytes are still arriving.
    pub fn map(&self, pages: &Pages, hint: usize, r: &Ref) -> Result<Snapshot> {
        self.with_live(pages, hint, r, |s, fill| {
            if fill.is_some_and(|f| !f.complete()) {
                return Err(arriving());
            }
            for &p in &s.pages {
                pages.share(p);
            }
            Ok(s.clone())
        })?
    }

    /// Hands `emit` the pieces of `len` bytes at `offset` of `r`'s
    /// snapshot, in order, as (page, offset in it, length), with the Ref's
    /// shard locked (so the pages are held: a share taken then ([`Pages::share`]) keeps one past
    /// it). Nothing is emitted on an error, nor for a range whose bytes
    /// have not all arrived.
    pub fn read_spans(
        &self,
        pages: &Pages,
        hint: usize,
        r: &Ref,
        offset: u64,
        len: u64,
        mut emit: impl FnMut(u32, usize, usize),
    ) -> Result<()> {
        self.with_live(pages, hint, r, |s, fill| {
            let end =
                offset
                    .checked_add(len)
                    .filter(|&e| e <= s.len)
                    .ok_or(Error::OutOfBounds {
                        offset,
                        len,
                        size: s.len,
                    })?;
            if fill.is_some_and(|f| f.filled() < end) {
                return Err(arriving());
            }
            let ps = pages.page_size() as u64;
            let mut pos = s.head as u64 + offset;
            let mut left = len as usize;
            while pos < s.head as u64 + end {
                let (pi, po) = ((pos / ps) as usize, (pos % ps) as usize);
                let n = (ps as usize - po).min(left);
                // The Ref holds its pages, and a shard lock keeps it live.
                emit(s.pages[pi], po, n);
                left -= n;
                pos += n as u64;
            }
            Ok(())
        })?
    }

    /// Releases `r`: its shares are dropped (mappings keep their own).
    pub fn release(&self, pages: &Pages, hint: usize, r: &Ref) -> Result<()> {
        self.with_live(pages, hint, r, |_, _| ())?;
        let si = r.desc as usize % SHARDS;
        let idx = r.desc as usize / SHARDS;
        let mut sh = lock(&self.shards[si]);
        // Still ours: with_live checked it and only a release or an expiry
        // (both under this lock) changes a live slot; re-check for a
        // concurrent one.
        let slot = &mut sh.slots[idx];
        if slot.generation != r.generation || !matches!(slot.state, State::Live { .. }) {
            return Err(Error::RefReleased {
                desc: r.desc,
                generation: r.generation,
            });
        }
        let old = std::mem::replace(&mut slot.state, State::Released);
        sh.reuse.push_back(idx as u32);
        drop(sh);
        self.drop_snapshot(pages, hint, old);
        Ok(())
    }

    /// Expires every Ref past its TTL; returns how many.
    pub fn sweep(&self, pages: &Pages, now: Instant) -> u64 {
        let mut n = 0;
        for (si, m) in self.shards.iter().enumerate() {
            let mut dropped = Vec::new();
            {
                let mut sh = lock(m);
                let Shard { slots, reuse } = &mut *sh;
                for (i, s) in slots.iter_mut().enumerate() {
                    if matches!(s.state, State::Live { expires, .. } if expires <= now) {
                        dropped.push(std::mem::replace(&mut s.state, State::Expired));
                        reuse.push_back(i as u32);
                    }
                }
            }
            n += dropped.len() as u64;
            for st in dropped {
                self.drop_snapshot(pages, si, st);
            }
        }
        n
    }

    /// Adds the shares held by live Refs to `counts` (for the check).
    pub fn count_holdings(&self, counts: &mut [u32], problems: &mut Vec<String>) {
        let mut live = 0;
        for m in self.shards.iter() {
            for s in lock(m).slots.iter() {
                if let State::Live { snap, .. } = &s.state {
                    live += 1;
                    for &p in &snap.pages {
                        if p != super::pages::NONE {
                            match counts.get_mut(p as usize) {
                                Some(c) => *c += 1,
                                None => {
                                    problems.push(format!("a Ref holds page {p}, out of range"))
                                }
                            }
                        }
                    }
                }
            }
        }
        if live != self.live() {
            problems.push(format!(
                "{live} live Refs, the counter says {}",
                self.live()
            ));
        }
    }

    /// Releases every live Ref.
    pub fn clear(&self, pages: &Pages) {
        for (si, m) in self.shards.iter().enumerate() {
            let mut old = Vec::new();
            {
                let mut sh = lock(m);
                let Shard { slots, reuse } = &mut *sh;
                for (i, s) in slots.iter_mut().enumerate() {
                    if matches!(s.state, State::Live { .. }) {
                        old.push(std::mem::replace(&mut s.state, State::Released));
                        reuse.push_back(i as u32);
                    }
                }
            }
            for st in old {
                self.drop_snapshot(pages, si, st);
            }
        }
    }
}

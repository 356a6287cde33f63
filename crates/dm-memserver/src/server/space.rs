//! One client's address space: an ordered map from DM addresses to its
//! buffers, and in each buffer the translation of its pages to the
//! server's pages. Reads, writes (with copy-on-write), Refs and mappings.
//!
//! Addresses are never reused within a session: each buffer starts at the
//! next free address, with a guard page after it, so an address below the
//! next one that maps nothing was freed already (a double free), and an
//! address inside no buffer is reported as such.

use super::pages::{Pages, NONE};
use super::quota::{Account, Charge};
use super::refs::{Refs, Snapshot};
use dm_pool::{Error, Ref, Result};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

/// Where addresses start (0 is never a buffer).
const BASE: u64 = 1 << 32;

/// A buffer: `len` bytes from byte `head` of its first page.
#[derive(Debug)]
struct Buffer {
    len: u64,
    head: u32,
    pages: Vec<u32>,
    /// Pages it reserves of the region ([`Pages::reserve`]): its page
    /// count if it was allocated, 0 if it maps a Ref.
    reserved: u64,
    /// Its pages, charged to its session's quota (given back when the
    /// buffer is dropped).
    _charge: Option<Charge>,
}

/// A client's address space.
#[derive(Debug)]
pub struct Space {
    /// Free-list shard this client prefers.
    pub hint: usize,
    maps: BTreeMap<u64, Buffer>,
    next: u64,
    max_buffers: usize,
    /// Pages pinned for the answer this client's session is writing from
    /// where they lie (one share each, taken for it; see `Pages::slice`).
    pub pinned: Vec<u32>,
    /// What its buffers and the Refs it created hold, against its quota.
    pub account: Arc<Account>,
    /// What the session has proved.
    pub standing: Standing,
}

/// What a session has proved (see `proto`, authentication).
#[derive(Debug, Clone, Copy, Default)]
pub struct Standing {
    /// It may use the server (it proved the client key, or the server
    /// has none).
    pub client: bool,
    /// It may run admin operations.
    pub admin: bool,
    /// The nonces of its last hello (the client's, the server's), which
    /// its `auth` proofs bind.
    pub challenge: Option<([u8; 16], [u8; 16])>,
}

/// A buffer's number for errors: its address in pages.
fn desc_of(addr: u64, ps: usize) -> u32 {
    ((addr - BASE.min(addr)) / ps as u64) as u32
}

impl Space {
    /// An empty space.
    pub fn new(hint: usize, max_buffers: usize, quota_pages: u64, standing: Standing) -> Space {
        Space {
            hint,
            maps: BTreeMap::new(),
            next: BASE,
            max_buffers,
            pinned: Vec::new(),
            account: Account::new(quota_pages),
            standing,
        }
    }

    /// Number of buffers.
    pub fn buffers(&self) -> usize {
        self.maps.len()
    }

    fn add(&mut self, ps: usize, b: Buffer) -> Result<u64> {
        if self.maps.len() >= self.max_buffers {
            return Err(Error::ResourceExhausted { what: "buffers" });
        }
        let span = (b.head as u64 + b.len).div_ceil(ps as u64) * ps as u64 + ps as u64;
        let addr = self.next;
        self.next = addr
            .checked_add(span)
            .ok_or(Error::ResourceExhausted { what: "buffers" })?;
        self.maps.insert(addr, b);
        Ok(addr)
    }

    /// The buffer containing `addr`, as (its base address, it).
    fn find(&self, addr: u64, ps: usize) -> Result<(u64, &Buffer)> {
        match self.maps.range(..=addr).next_back() {
            Some((&base, b)) if addr - base < b.len.max(1) => Ok((base, b)),
            _ => Err(Error::NotOwner {
                desc: desc_of(addr, ps),
            }),
        }
    }

    /// The buffer containing `addr`, writable, as (its base address, it).
    fn find_mut(&mut self, addr: u64, ps: usize) -> Result<(u64, &mut Buffer)> {
        match self.maps.range_mut(..=addr).next_back() {
            Some((&base, b)) if addr - base < b.len.max(1) => Ok((base, b)),
            _ => Err(Error::NotOwner {
                desc: desc_of(addr, ps),
            }),
        }
    }
}

/// The range `offset..offset+len` from `addr` in buffer `b` (at `base`), as
/// absolute byte positions from the start of its first page.
fn span(base: u64, b: &Buffer, addr: u64, offset: u64, len: u64) -> Result<(u64, u64)> {
    let oob = || Error::OutOfBounds {
        offset,
        len,
        size: b.len,
    };
    let off = (addr - base).checked_add(offset).ok_or_else(oob)?;
    let end = off
        .checked_add(len)
        .filter(|&e| e <= b.len)
        .ok_or_else(oob)?;
    Ok((b.head as u64 + off, b.head as u64 + end))
}

impl Space {
    /// A zero-filled buffer (no page backed yet), charged to this
    /// session's quota.
    pub fn alloc(&mut self, pages: &Pages, len: u64, max_len: u64) -> Result<u64> {
        self.alloc_with(pages, len, max_len, true)
    }

    /// [`alloc`](Self::alloc), `charged` to the quota or not (a buffer
    /// freed within the same request, whose pages a Ref charged keeps).
    pub fn alloc_with(
        &mut self,
        pages: &Pages,
        len: u64,
        max_len: u64,
        charged: bool,
    ) -> Result<u64> {
        if len == 0 {
            return Err(Error::ZeroLength);
        }
        if len > max_len {
            return Err(Error::TooLarge { len, max: max_len });
        }
        let n = len.div_ceil(pages.page_size() as u64) as usize;
        let charge = match charged {
            true => Some(self.account.charge(n as u64)?),
            false => None,
        };
        if !pages.reserve(n as u64) {
            return Err(Error::ResourceExhausted {
                what: "memory-server pages",
            });
        }
        self.add(
            pages.page_size(),
            Buffer {
                len,
                head: 0,
                pages: vec![NONE; n],
                reserved: n as u64,
                _charge: charge,
            },
        )
        .inspect_err(|_| pages.unreserve(n as u64))
    }

    /// Frees the buffer at `addr` (its exact start).
    pub fn free(&mut self, pages: &Pages, addr: u64) -> Result<()> {
        let ps = pages.page_size();
        match self.maps.remove(&addr) {
            Some(b) => {
                pages.unreserve(b.reserved);
                for p in b.pages {
                    pages.unshare(self.hint, p);
                }
                Ok(())
            }
            None if (BASE..self.next).contains(&addr) && self.find(addr, ps).is_err() => {
                Err(Error::DoubleFree {
                    desc: desc_of(addr, ps),
                    generation: 0,
                })
            }
            None => Err(Error::NotOwner {
                desc: desc_of(addr, ps),
            }),
        }
    }

    /// Hands `emit` the pieces of `len` bytes at `offset` of the buffer
    /// at `addr`, in order, as (page, offset in it, length); a page of
    /// [`NONE`] reads as zeros. Nothing is emitted on
    /// an error. The caller holds this space's lock meanwhile, so the pages
    /// are held: a share taken then ([`Pages::share`]) keeps one past it.
    pub fn read_spans(
        &self,
        pages: &Pages,
        addr: u64,
        offset: u64,
        len: u64,
        mut emit: impl FnMut(u32, usize, usize),
    ) -> Result<()> {
        let ps = pages.page_size();
        let (base, b) = self.find(addr, ps)?;
        let (start, _) = span(base, b, addr, offset, len)?;
        let mut pos = start;
        let mut left = len as usize;
        while left > 0 {
            let (pi, po) = ((pos / ps as u64) as usize, (pos % ps as u64) as usize);
            let n = (ps - po).min(left);
            emit(b.pages[pi], po, n);
            left -= n;
            pos += n as u64;
        }
        Ok(())
    }

    /// Writes `data` at `offset` of the buffer at `addr`: unwritten pages
    /// get a zeroed page, shared pages are copied first (then written), all
    /// pages needed are taken before anything changes (all or nothing).
    pub fn write(&mut self, pages: &Pages, addr: u64, offset: u64, data: &[u8]) -> Result<()> {
        let mut done = 0;
        for (p, off, n) in self.write_pieces(pages, addr, offset, data.len() as u64)? {
            pages.write(p, off, &data[done..done + n]);
            done += n;
        }
        Ok(())
    }

    /// Makes the `len` bytes at `offset` of the buffer at `addr` ready to
    /// be written, as [`write`](Self::write) does (a zeroed page for an
    /// unwritten one, a copy of a shared one; all or nothing), and gives
    /// the pieces (page, offset in it, length) they lie in, in order. The
    /// pages are this buffer's alone: only its session writes them.
    pub fn write_pieces(
        &mut self,
        pages: &Pages,
        addr: u64,
        offset: u64,
        len: u64,
    ) -> Result<Vec<(u32, usize, usize)>> {
        let ps = pages.page_size();
        let hint = self.hint;
        let (base, b) = self.find_mut(addr, ps)?;
        let (start, end) = span(base, b, addr, offset, len)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        let len = len as usize;
        let (first, last) = (
            (start / ps as u64) as usize,
            ((end - 1) / ps as u64) as usize,
        );
        let need = b.pages[first..=last]
            .iter()
            .filter(|&&p| p == NONE || pages.rc(p) > 1)
            .count();
        let mut fresh = Vec::with_capacity(need);
        pages.take(hint, need, &mut fresh)?;
        let mut fresh = fresh.into_iter();
        let mut pieces = Vec::with_capacity(last - first + 1);
        let mut pos = start;
        let mut done = 0;
        for pi in first..=last {
            let old = b.pages[pi];
            let po = (pos % ps as u64) as usize;
            let n = (ps - po).min(len - done);
            if old == NONE || pages.rc(old) > 1 {
                let Some(new) = fresh.next() else {
                    // Counted above; cannot run short.
                    return Err(Error::Corrupt("page reservation ran short".into()));
                };
                if old != NONE {
                    // Copy the whole page first, so a partial write keeps
                    // the rest of it; then drop our share of the old one.
                    pages.copy(old, new);
                    pages.unshare(hint, old);
                } else {
                    // A fresh page keeps a former owner's bytes: zero what
                    // this write does not cover.
                    pages.zero_outside(new, po, n);
                }
                b.pages[pi] = new;
            }
            pieces.push((b.pages[pi], po, n));
            done += n;
            pos += n as u64;
        }
        // A page can become shared by nobody else between the count and
        // the loop (a Ref released meanwhile): give back what we did not use.
        for p in fresh {
            pages.unshare(hint, p);
        }
        Ok(pieces)
    }

    /// A Ref to `len` bytes at `offset` of the buffer at `addr`: one more
    /// share of each page in the range, held by the Ref.
    pub fn create_ref(
        &self,
        pages: &Pages,
        refs: &Refs,
        addr: u64,
        offset: u64,
        len: u64,
        expires: Instant,
    ) -> Result<Ref> {
        if len == 0 {
            return Err(Error::ZeroLength);
        }
        let ps = pages.page_size();
        let (base, b) = self.find(addr, ps)?;
        let (start, end) = span(base, b, addr, offset, len)?;
        let (first, last) = (
            (start / ps as u64) as usize,
            ((end - 1) / ps as u64) as usize,
        );
        let snap = Snapshot {
            len,
            head: (start % ps as u64) as u32,
            pages: b.pages[first..=last].to_vec(),
        };
        let charge = self.account.charge(snap.pages.len() as u64)?;
        for &p in &snap.pages {
            pages.share(p);
        }
        let held = snap.pages.clone();
        refs.insert(snap, expires, charge).inspect_err(|_| {
            for p in held {
                pages.unshare(self.hint, p);
            }
        })
    }

    /// Maps `r` as a new buffer; returns its address and length.
    pub fn map_ref(&mut self, pages: &Pages, refs: &Refs, r: &Ref) -> Result<(u64, u64)> {
        let s = refs.map(pages, self.hint, r)?;
        let charge = match self.account.charge(s.pages.len() as u64) {
            Ok(c) => c,
            Err(e) => {
                for p in s.pages {
                    pages.unshare(self.hint, p);
                }
                return Err(e);
            }
        };
        let len = s.len;
        let held = s.pages.clone();
        self.add(
            pages.page_size(),
            Buffer {
                len,
                head: s.head,
                pages: s.pages,
                reserved: 0,
                _charge: Some(charge),
            },
        )
        .map(|a| (a, len))
        .inspect_err(|_| {
            for p in held {
                pages.unshare(self.hint, p);
            }
        })
    }

    /// Frees every buffer (the session ended).
    pub fn clear(&mut self, pages: &Pages) {
        for (_, b) in std::mem::take(&mut self.maps) {
            pages.unreserve(b.reserved);
            for p in b.pages {
                pages.unshare(self.hint, p);
            }
        }
    }

    /// Adds this space's page shares to `counts` (for the check).
    pub fn count_holdings(&self, counts: &mut [u32], problems: &mut Vec<String>) {
        let held = self.maps.values().flat_map(|b| b.pages.iter());
        for &p in held.chain(&self.pinned) {
            if p != NONE {
                match counts.get_mut(p as usize) {
                    Some(c) => *c += 1,
                    None => problems.push(format!("a buffer holds page {p}, out of range")),
                }
            }
        }
    }
}

//! Typed views of the mapped pool: header atomics, page table, slots,
//! descriptors, page data. Every index read from the pool is bounds-checked
//! here before it is turned into an address.

use crate::desc::{Desc, FLAG_INDIRECT, FLAG_INHERIT, FLAG_TWO_LEVEL, INLINE};
use crate::error::{Error, Result};
use crate::layout::{HeaderAtomics, Layout, ParseError, RefClock, ATOMICS_OFF, HEADER_LEN, READY};
use crate::pages::{PageTable, BORROWED, NO_PAGE};
use crate::slot::{LeaseNow, Slot, SlotKind, SlotState};
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use dm_sys::mem::{Access, SharedFile};
use std::path::Path;

/// A mapped, validated pool.
#[derive(Debug)]
pub(crate) struct Shm {
    file: SharedFile,
    /// The validated layout.
    pub layout: Layout,
    /// The path it was opened by (`DEVICE/NAME` for a namespace).
    path: std::path::PathBuf,
    /// A namespace's tie to its segment table entry.
    ns: Option<crate::namespace::device::Link>,
}

impl Shm {
    /// Maps `path`, a file written by no one `access` does not name
    /// ([`SharedFile::open`]), and validates its header.
    /// A path `DEVICE/NAME` opens namespace NAME of DEVICE
    /// (`namespace/mod.rs`).
    pub(crate) fn open(path: &Path, access: Access) -> Result<Shm> {
        if let Some((device, name)) = crate::namespace::device::split(path) {
            let (file, link) = crate::namespace::device::open(&device, &name, access)?;
            return Self::from_file(file, path, Some(link));
        }
        let device = SharedFile::is_device(path);
        let file = if device {
            // A device has no size: read the header to learn the pool's length.
            let probe = SharedFile::open(path, Some(HEADER_LEN), access)?;
            let l = Self::parse(&probe, path, u64::MAX)?;
            drop(probe);
            SharedFile::open(path, Some(l.total_len), access)?
        } else {
            SharedFile::open(path, None, access)?
        };
        Self::from_file(file, path, None)
    }

    /// Validates the pool in `file` (opened by `path`) and waits briefly
    /// for a concurrent creator to finish.
    pub(crate) fn from_file(
        file: SharedFile,
        path: &Path,
        ns: Option<crate::namespace::device::Link>,
    ) -> Result<Shm> {
        let layout = Self::parse(&file, path, file.len() as u64)?;
        let shm = Shm {
            file,
            layout,
            path: path.to_owned(),
            ns,
        };
        // Wait briefly for a concurrent creator to finish.
        for _ in 0..200 {
            if shm.atomics().ready.load(Ordering::Acquire) == READY {
                return Ok(shm);
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        Err(Error::NotReady)
    }

    fn parse(file: &SharedFile, path: &Path, file_len: u64) -> Result<Layout> {
        if (file.len() as u64) < HEADER_LEN {
            return Err(Error::CorruptHeader(format!(
                "backing is {} bytes, smaller than a pool header",
                file.len()
            )));
        }
        // SAFETY: the mapping is at least HEADER_LEN bytes; the immutable
        // header is only written before `ready` is published, and any bytes
        // are acceptable input to `parse`.
        let bytes = unsafe { std::slice::from_raw_parts(file.base(), ATOMICS_OFF) };
        Layout::parse(bytes, file_len).map_err(|e| match e {
            ParseError::Magic | ParseError::Truncated => Error::NotAPool {
                path: path.to_owned(),
            },
            ParseError::Version(v) => Error::VersionMismatch {
                found: v,
                supported: crate::layout::POOL_VERSION,
            },
            ParseError::Corrupt(why) => Error::CorruptHeader(why),
        })
    }

    /// Creates the pool in a fresh mapping: writes metadata, then publishes `ready`.
    pub(crate) fn init(file: SharedFile, layout: Layout, cfg: &crate::layout::PoolConfig) -> Shm {
        let enc = layout.encode();
        // SAFETY: the mapping is at least total_len >= HEADER_LEN bytes and
        // nobody else uses it before `ready` is published below.
        unsafe { std::ptr::copy_nonoverlapping(enc.as_ptr(), file.base(), enc.len()) };
        let mut secret = [0u8; crate::layout::SECRET_LEN];
        for c in secret.chunks_mut(8) {
            c.copy_from_slice(&dm_sys::rand::random_u64().to_le_bytes());
        }
        // SAFETY: the secret's 32 bytes at SECRET_OFF lie in the header
        // (HEADER_LEN bytes, mapped), past its immutable part and before
        // its atomics; nobody else uses the mapping before `ready`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                secret.as_ptr(),
                file.base().add(crate::layout::SECRET_OFF),
                secret.len(),
            )
        };
        let path = file.path().to_owned();
        let shm = Shm {
            file,
            layout,
            path,
            ns: None,
        };
        for i in 0..shm.layout.n_descs {
            if let Some(d) = shm.desc(i) {
                d.reset();
            }
        }
        shm.init_quotas(cfg);
        shm.atomics()
            .quarantine_ms
            .store(cfg.quarantine_ms, Ordering::Relaxed);
        shm.atomics()
            .ref_clock_host
            .store(host_id(), Ordering::Relaxed);
        shm.atomics().ready.store(READY, Ordering::Release);
        shm
    }

    /// The pool's secret (all zeros in a pool created before there was
    /// one). Written once at creation; a process that scribbles on it only
    /// makes its own proofs fail.
    pub(crate) fn secret(&self) -> [u8; crate::layout::SECRET_LEN] {
        let mut s = [0u8; crate::layout::SECRET_LEN];
        // SAFETY: SECRET_LEN bytes at SECRET_OFF lie in the mapped header;
        // any bytes are a valid [u8; N], and a torn read only breaks a proof.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.file.base().add(crate::layout::SECRET_OFF),
                s.as_mut_ptr(),
                s.len(),
            )
        };
        s
    }

    /// Overwrites the magic so that the backing is no longer a pool.
    pub(crate) fn erase_header(&self) {
        // SAFETY: the mapping is at least HEADER_LEN bytes; writing the
        // magic races only with openers, which then reject the file.
        unsafe { std::ptr::write_bytes(self.file.base(), 0, 8) };
    }

    /// The path it was opened by (`DEVICE/NAME` for a namespace).
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// This process has its slot: a namespace counts the attachment and
    /// lets go of the lock that kept it from being removed meanwhile.
    pub(crate) fn attached(&self) {
        if let Some(l) = &self.ns {
            l.attached();
        }
    }

    /// Whether pool pages can be mapped one by one into a fixed range
    /// (fixed mappings, mapped buffers). On hugetlbfs only whole huge
    /// pages map: the pool's pages must be huge pages (or several).
    pub(crate) fn pages_map_alone(&self) -> Result<()> {
        let Some(h) = self.file.huge_page() else {
            return Ok(());
        };
        let ps = u64::from(self.layout.page_size);
        if ps.is_multiple_of(h) && self.data_file_off().is_multiple_of(h) {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "this pool is on hugetlbfs, which maps only whole huge pages of {} KiB: its {} KiB \
             pages cannot be mapped one by one. Create it with `--page-size {}KiB` \
             (`PoolConfig::page_size`), or use the buffer's reads and writes",
            h >> 10,
            ps >> 10,
            h >> 10
        )))
    }

    /// The huge page size of the pool's file system, if it is hugetlbfs.
    pub(crate) fn huge_page(&self) -> Option<u64> {
        self.file.huge_page()
    }

    /// Where the data area starts in the backing file (a namespace's pool
    /// starts at its region's offset).
    pub(crate) fn data_file_off(&self) -> u64 {
        self.file.file_off() + self.layout.data_off
    }

    /// Slots of processes attached now: live, and not judged gone (a
    /// process of this host that runs; of another, one whose lease lasts;
    /// one in quarantine counts, as it may only be stopped).
    pub(crate) fn live_slots(&self) -> u32 {
        let now = LeaseNow::read();
        (0..self.layout.n_slots as u16)
            .filter_map(|s| self.slot(s))
            .filter(|slot| {
                SlotState::decode(slot.state.load(Ordering::Acquire)).kind == Some(SlotKind::Live)
                    && (!self.slot_expired(slot, now) || self.in_quarantine(slot, None, now))
            })
            .count() as u32
    }

    /// File descriptor of the backing (for fixed mappings).
    pub(crate) fn raw_fd(&self) -> i32 {
        self.file.raw_fd()
    }

    /// Faults in the whole data area.
    pub(crate) fn prefault(&self) {
        self.file.prefault(
            self.layout.data_off as usize,
            self.layout.n_pages as usize * self.layout.page_size as usize,
        );
    }

    /// Base address of the mapping.
    pub(crate) fn base(&self) -> *mut u8 {
        self.file.base()
    }

    /// Whether slot `s` is live and still in incarnation `inc` at `now`.
    pub(crate) fn slot_is(&self, s: u16, inc: u32, now: LeaseNow) -> bool {
        self.slot(s).is_some_and(|slot| {
            SlotState::decode(slot.state.load(Ordering::Acquire)).incarnation == inc
        }) && self.slot_live(s, now)
    }

    /// The record of type `T` at byte offset `off` of the pool.
    ///
    /// # Safety
    /// `off` must be the start of a `T` inside an area that `Layout::parse`
    /// validated (inside the mapping, aligned for `T`), and `T` must be a
    /// `repr(C)` type made only of atomics, valid for any bit pattern.
    pub(crate) unsafe fn at<T>(&self, off: u64) -> &T {
        // SAFETY: the caller's contract: `off` is inside the mapping and
        // aligned for T, and any bytes are a valid T.
        unsafe { &*(self.file.base().add(off as usize) as *const T) }
    }

    /// Shared counters and cursors.
    pub(crate) fn atomics(&self) -> &HeaderAtomics {
        // SAFETY: the header is always mapped (HEADER_LEN bytes, checked at
        // open) and its atomics start at ATOMICS_OFF, 8-aligned.
        unsafe { self.at(ATOMICS_OFF as u64) }
    }

    /// The page table (with its stripe locks).
    pub(crate) fn pages(&self) -> PageTable<'_> {
        PageTable::new(self.page_words(), self.stripe_words())
    }

    /// The stripe-lock words.
    pub(crate) fn stripe_words(&self) -> &[AtomicU64] {
        // SAFETY: the stripe area holds stripes_for(n_pages) u64 words
        // (validated), 8-aligned; AtomicU64 has the layout of u64.
        unsafe {
            std::slice::from_raw_parts(
                self.file.base().add(self.layout.st_off as usize) as *const AtomicU64,
                crate::pages::stripes_for(self.layout.n_pages) as usize,
            )
        }
    }

    /// The raw page-table words (for the quiescent recount in gc).
    pub(crate) fn page_words(&self) -> &[AtomicU64] {
        // SAFETY: as in `pages`.
        unsafe {
            std::slice::from_raw_parts(
                self.file.base().add(self.layout.pt_off as usize) as *const AtomicU64,
                self.layout.n_pages as usize,
            )
        }
    }

    /// Address of the first stripe word (for the fault handler).
    pub(crate) fn stripes_ptr(&self) -> *const AtomicU64 {
        self.stripe_words().as_ptr()
    }

    /// Address of the first page-table word (for the fault handler).
    pub(crate) fn pages_ptr(&self) -> *const AtomicU64 {
        self.page_words().as_ptr()
    }

    /// Slot `i`, if in range.
    pub(crate) fn slot(&self, i: u16) -> Option<&Slot> {
        (u32::from(i) < self.layout.n_slots)
            // SAFETY: i < n_slots: inside the slot table, which
            // `Layout::parse` validated; a Slot is repr(C) atomics.
            .then(|| unsafe {
                self.at(self.layout.slot_off + i as u64 * crate::slot::SLOT_SIZE as u64)
            })
    }

    /// Descriptor `i`, if in range.
    pub(crate) fn desc(&self, i: u32) -> Option<&Desc> {
        (i < self.layout.n_descs)
            // SAFETY: i < n_descs: inside the descriptor table, which
            // `Layout::parse` validated; a Desc is repr(C) atomics.
            .then(|| unsafe {
                self.at(self.layout.desc_off + i as u64 * crate::desc::DESC_SIZE as u64)
            })
    }

    /// Address of data page `p`.
    ///
    /// # Safety
    /// `p` must be below the pool's page count (a page index checked with
    /// [`check_page`](Self::check_page), or taken from the page table).
    pub(crate) unsafe fn page_ptr(&self, p: u32) -> *mut u8 {
        debug_assert!(p < self.layout.n_pages);
        // SAFETY: p < n_pages (the caller's contract), so the page lies
        // inside the validated data area.
        unsafe {
            self.file
                .base()
                .add(self.layout.data_off as usize + p as usize * self.layout.page_size as usize)
        }
    }

    /// Checks a page index read from the pool.
    pub(crate) fn check_page(&self, p: u32) -> Result<u32> {
        if p < self.layout.n_pages {
            Ok(p)
        } else {
            Err(Error::Corrupt(format!(
                "page index {p} is outside the pool ({} pages)",
                self.layout.n_pages
            )))
        }
    }

    /// A list page viewed as entries.
    pub(crate) fn list(&self, p: u32) -> Result<&[AtomicU32]> {
        let p = self.check_page(p)?;
        // SAFETY: p is checked (< n_pages); a data page is page_size bytes
        // (a multiple of 4), 4-aligned, inside the mapping; AtomicU32 has
        // the layout of u32.
        Ok(unsafe {
            std::slice::from_raw_parts(
                self.page_ptr(p) as *const AtomicU32,
                self.layout.per_list_page(),
            )
        })
    }

    /// Entry `i` of descriptor `d` (data page index or NO_PAGE). A missing
    /// list page reads as NO_PAGE (a descriptor whose builder died early),
    /// and so does every entry of an inheriting buffer (it owns none).
    pub(crate) fn entry<'a>(&'a self, d: &'a Desc, i: usize) -> Result<Option<&'a AtomicU32>> {
        let flags = d.flags.load(Ordering::Acquire);
        if flags & FLAG_INHERIT != 0 {
            return Ok(None);
        }
        if flags & FLAG_INDIRECT == 0 {
            return Ok(d.entries.get(i));
        }
        let per = self.layout.per_list_page();
        let l = self.list_page(d, i / per)?;
        if l == NO_PAGE {
            return Ok(None);
        }
        Ok(self.list(l)?.get(i % per))
    }

    /// The page of first-level list `c` of a descriptor with lists (the
    /// list of data entries `[c * per, (c + 1) * per)`), or NO_PAGE when
    /// it is missing or out of range.
    pub(crate) fn list_page(&self, d: &Desc, c: usize) -> Result<u32> {
        Ok(self
            .list_slot(d, c)?
            .map_or(NO_PAGE, |e| e.load(Ordering::Acquire)))
    }

    /// List slots of a descriptor (see `desc.rs`): its first-level lists,
    /// then, with two levels, its inline entries. 0 without lists.
    pub(crate) fn list_span(&self, d: &Desc) -> u32 {
        let flags = d.flags.load(Ordering::Acquire);
        if flags & FLAG_INDIRECT == 0 {
            0
        } else if flags & FLAG_TWO_LEVEL == 0 || !self.two_levels_fit() {
            // (Two levels where they cannot be: `list_chunk` says so.)
            INLINE as u32
        } else {
            (INLINE * self.layout.per_list_page() + INLINE) as u32
        }
    }

    /// Whether a descriptor's positions (`u32`: its entries, then its list
    /// slots) can name two levels of lists of this pool's pages: for pages
    /// up to 128 MiB. Larger pages never need a second level (one names
    /// more pages than a pool has), so a descriptor of them flagged with
    /// two is corrupt.
    fn two_levels_fit(&self) -> bool {
        (INLINE * self.layout.per_list_page() + INLINE) as u64 <= i32::MAX as u64
    }

    /// List slot `j` of a descriptor: the word naming that list page
    /// (None past its list slots, or when the second-level list holding it
    /// is missing).
    pub(crate) fn list_slot<'a>(&'a self, d: &'a Desc, j: usize) -> Result<Option<&'a AtomicU32>> {
        let (base, run, _) = self.list_chunk(d, j)?;
        Ok(run.get(j - base))
    }

    /// The chunk of a descriptor's list slots containing slot `j`:
    /// `(first slot, words, slots the chunk spans)`, like
    /// [`entry_chunk`](Self::entry_chunk). With two levels a chunk is one
    /// second-level list page (empty when missing), and the inline
    /// entries are the last chunk.
    pub(crate) fn list_chunk<'a>(
        &'a self,
        d: &'a Desc,
        j: usize,
    ) -> Result<(usize, &'a [AtomicU32], usize)> {
        let flags = d.flags.load(Ordering::Acquire);
        if flags & FLAG_INDIRECT == 0 {
            return Ok((j, &[], 1 << 20));
        }
        if flags & FLAG_TWO_LEVEL == 0 {
            return Ok(if j < INLINE {
                (0, &d.entries[..], INLINE)
            } else {
                (j, &[], 1 << 20)
            });
        }
        if !self.two_levels_fit() {
            return Err(Error::Corrupt(format!(
                "a descriptor flagged with two levels of lists in a pool of {} pages",
                self.layout.page_size
            )));
        }
        let per = self.layout.per_list_page();
        let firsts = INLINE * per;
        if j >= firsts {
            return Ok(if j < firsts + INLINE {
                (firsts, &d.entries[..], INLINE)
            } else {
                (j, &[], 1 << 20)
            });
        }
        let c = j / per;
        let l = d.entries[c].load(Ordering::Acquire);
        if l == NO_PAGE {
            return Ok((c * per, &[], per));
        }
        Ok((c * per, self.list(l)?, per))
    }

    /// The Ref an inheriting buffer reads through, if `d` inherits.
    pub(crate) fn inherits_from(&self, d: &Desc) -> Option<&Desc> {
        if d.flags.load(Ordering::Acquire) & FLAG_INHERIT == 0 {
            return None;
        }
        self.desc(d.tag.load(Ordering::Acquire) as u32)
    }

    /// The chunk of a descriptor's entries containing position `k`:
    /// `(first position, entries, positions the chunk spans)`; the chunk
    /// always contains `k`. The entries are empty when the chunk's list
    /// page is missing, or `k` is past a list-less descriptor's inline
    /// entries (all read as none).
    #[inline]
    pub(crate) fn entry_chunk<'a>(
        &'a self,
        d: &'a Desc,
        k: usize,
    ) -> Result<(usize, &'a [AtomicU32], usize)> {
        let flags = d.flags.load(Ordering::Acquire);
        let indirect = flags & FLAG_INDIRECT != 0;
        if flags & FLAG_INHERIT != 0 || (!indirect && k >= INLINE) {
            // Owns no entries here (an inheriting buffer; past the inline
            // entries of a descriptor without lists, such as a builder
            // that died before its lists): a chunk from `k` of none.
            return Ok((k, &[], 1 << 20));
        }
        if !indirect {
            return Ok((0, &d.entries[..], INLINE));
        }
        let per = self.layout.per_list_page();
        let c = k / per;
        let l = self.list_page(d, c)?;
        if l == NO_PAGE {
            return Ok((c * per, &[], per));
        }
        Ok((c * per, self.list(l)?, per))
    }

    /// Copies entries `[0, n)` of `from` starting at position `at` into
    /// entries `[0, n)` of `to`, checking every page index. `flag` is or-ed
    /// into every copied page (`BORROWED` to borrow them); a borrowed flag
    /// in the source is dropped.
    pub(crate) fn copy_entries(
        &self,
        from: &Desc,
        at: usize,
        to: &Desc,
        n: usize,
        flag: u32,
    ) -> Result<()> {
        // An inheriting buffer's pages are its Ref's (at the same positions).
        let from = self.inherits_from(from).unwrap_or(from);
        let np = self.layout.n_pages;
        let mut k = 0;
        while k < n {
            let (sb, src, sspan) = self.entry_chunk(from, at + k)?;
            let (db, dst, dspan) = self.entry_chunk(to, k)?;
            let len = (sb + sspan - (at + k)).min(db + dspan - k).min(n - k);
            if dst.is_empty() {
                return Err(Error::Corrupt(format!("entry {k} has no list page")));
            }
            for i in 0..len {
                let mut p = src
                    .get(at + k + i - sb)
                    .map_or(NO_PAGE, |e| e.load(Ordering::Relaxed));
                if p != NO_PAGE {
                    p &= !BORROWED;
                    if p >= np {
                        return Err(Error::Corrupt(format!(
                            "page index {p} is outside the pool ({np} pages)"
                        )));
                    }
                    p |= flag;
                }
                dst[k + i - db].store(p, Ordering::Relaxed);
            }
            k += len;
        }
        std::sync::atomic::fence(Ordering::Release);
        Ok(())
    }

    /// Reads entry `i`: the page it names, borrowed or not (NO_PAGE when absent).
    pub(crate) fn entry_value(&self, d: &Desc, i: usize) -> Result<u32> {
        Ok(unborrow(self.raw_entry(d, i)?))
    }

    /// Reads entry `i` with its `BORROWED` flag (NO_PAGE when absent). An
    /// inheriting buffer reads its Ref's entry, borrowed. Only a mapped
    /// buffer inherits, and from a Ref, which never does: a chain any
    /// longer (a loop included) is corrupt shared metadata, refused
    /// rather than followed.
    pub(crate) fn raw_entry(&self, d: &Desc, i: usize) -> Result<u32> {
        if let Some(r) = self.inherits_from(d) {
            if self.inherits_from(r).is_some() {
                return Err(Error::Corrupt(
                    "a descriptor inherits from one that inherits".into(),
                ));
            }
            let p = unborrow(
                self.entry(r, i)?
                    .map_or(NO_PAGE, |e| e.load(Ordering::Acquire)),
            );
            return Ok(if p == NO_PAGE { p } else { p | BORROWED });
        }
        Ok(self
            .entry(d, i)?
            .map_or(NO_PAGE, |e| e.load(Ordering::Acquire)))
    }

    /// List pages a descriptor of `n` entries needs: `(first-level,
    /// second-level)`; `(0, 0)` when its entries fit inline, and no
    /// second-level ones when the first-level ones do.
    pub(crate) fn lists_needed(&self, n: usize) -> (usize, usize) {
        let per = self.layout.per_list_page();
        if n <= INLINE {
            (0, 0)
        } else if n <= INLINE * per {
            (n.div_ceil(per), 0)
        } else {
            let firsts = n.div_ceil(per);
            (firsts, firsts.div_ceil(per))
        }
    }

    /// Zeroes data page `p` except `len` bytes at `at` (which the caller
    /// is about to write).
    ///
    /// # Safety
    /// `p` must be a page index below the pool's page count that this
    /// process owns alone (Cached by its slot, or held by one of its
    /// buffers with a count of one): no other thread or process may read
    /// or write it meanwhile.
    pub(crate) unsafe fn zero_outside(&self, p: u32, at: usize, len: usize) {
        let ps = self.layout.page_size as usize;
        let (at, end) = (at.min(ps), (at + len).min(ps));
        // SAFETY: p < n_pages and the page is ours alone (the caller's
        // contract); both ranges are inside the page.
        unsafe {
            std::ptr::write_bytes(self.page_ptr(p), 0, at);
            std::ptr::write_bytes(self.page_ptr(p).add(end), 0, ps - end);
        }
    }

    /// Whether slot `s` is live (attached, lease not expired) at `now`.
    pub(crate) fn slot_live(&self, s: u16, now: LeaseNow) -> bool {
        let Some(slot) = self.slot(s) else {
            return false;
        };
        let st = SlotState::decode(slot.state.load(Ordering::Acquire));
        st.kind == Some(SlotKind::Live) && !self.slot_expired(slot, now)
    }

    /// Now on the pool's Ref clock ([`RefClock`]) as of the last tick: what
    /// a Ref's expiry is set from and checked against on the per-call path.
    #[inline]
    pub(crate) fn ref_now_coarse(&self) -> u64 {
        match self.layout.ref_clock {
            RefClock::Host => dm_sys::time::monotonic_ms_coarse(),
            RefClock::Wall => dm_sys::time::now_ms_coarse(),
        }
    }

    /// Whether this process reads the pool's Ref clock as its own: the
    /// wall clock, or the monotonic clock of this host's boot (the one
    /// `ref_clock_host` names).
    pub(crate) fn ref_clock_is_ours(&self) -> bool {
        self.layout.ref_clock == RefClock::Wall
            || self.atomics().ref_clock_host.load(Ordering::Acquire) == host_id()
    }

    /// `now` on the pool's Ref clock.
    pub(crate) fn ref_now(&self, now: LeaseNow) -> u64 {
        match self.layout.ref_clock {
            RefClock::Host => now.mono_ms,
            RefClock::Wall => now.wall_ms,
        }
    }

    /// How long slot `s`'s lease runs from `now` unless its process
    /// renews it, in ms (on the clock [`slot_expired`](Self::slot_expired)
    /// judges it by).
    pub(crate) fn lease_left_ms(&self, s: u16, now: LeaseNow) -> u64 {
        let Some(slot) = self.slot(s) else { return 0 };
        let (hb, now) = if slot.host.load(Ordering::Relaxed) == host_id() {
            (slot.heartbeat_mono_ms.load(Ordering::Acquire), now.mono_ms)
        } else {
            (slot.heartbeat_ms.load(Ordering::Acquire), now.wall_ms)
        };
        hb.saturating_add(slot.lease_ms.load(Ordering::Relaxed))
            .saturating_sub(now)
    }

    /// Whether slot `slot`, of incarnation `inc`, is in quarantine at
    /// `now`: live, judged by its lease (another host or PID namespace, or
    /// [`AttachOptions::lease_only`](crate::AttachOptions::lease_only)),
    /// expired, and expired for less than the pool's quarantine
    /// ([`PoolConfig::quarantine_ms`](crate::PoolConfig::quarantine_ms)).
    ///
    /// Such a process may only be stopped (a debugger, a frozen VM) and
    /// resume storing through its mappings: its pages and the rings of its
    /// channels are not reused until the quarantine ends. Its names are
    /// free at once (a name holds no memory). A process that resumes
    /// within the quarantine renews its lease and loses nothing.
    pub(crate) fn in_quarantine(&self, slot: &Slot, inc: Option<u32>, now: LeaseNow) -> bool {
        let st = SlotState::decode(slot.state.load(Ordering::Acquire));
        if st.kind != Some(SlotKind::Live) || inc.is_some_and(|i| i != st.incarnation) {
            return false;
        }
        let q = self.atomics().quarantine_ms.load(Ordering::Relaxed);
        if q == 0 || !self.slot_expired(slot, now) {
            return false;
        }
        let here = slot.host.load(Ordering::Relaxed) == host_id();
        let ns = slot.pid_ns.load(Ordering::Relaxed);
        if here && ns != 0 && ns == dm_sys::proc::pid_namespace() {
            // Judged by its process, which is gone: nothing can resume.
            return false;
        }
        let (hb, now) = if here {
            (slot.heartbeat_mono_ms.load(Ordering::Acquire), now.mono_ms)
        } else {
            (slot.heartbeat_ms.load(Ordering::Acquire), now.wall_ms)
        };
        let lease = slot.lease_ms.load(Ordering::Relaxed);
        now <= hb.saturating_add(lease).saturating_add(q)
    }

    /// Ends the quarantine of every slot in it now (the operator knows
    /// their processes are gone: `dmrpc pool gc --now`): their heartbeats
    /// are set far enough back. Returns how many.
    pub(crate) fn end_quarantines(&self) -> u64 {
        let now = LeaseNow::read();
        let mut n = 0;
        for s in 0..self.layout.n_slots as u16 {
            let Some(slot) = self.slot(s) else { break };
            if self.in_quarantine(slot, None, now) {
                slot.heartbeat_ms.store(0, Ordering::Release);
                slot.heartbeat_mono_ms.store(0, Ordering::Release);
                n += 1;
            }
        }
        n
    }

    /// Whether a live slot's lease has expired (or its process is gone).
    ///
    /// A slot of this host (same boot id) is judged by the monotonic
    /// clock, which never steps: a wall-clock step by more than a lease
    /// would otherwise make every live process look dead and have its
    /// holdings reclaimed under it. Another host's slot is judged by the
    /// wall clock, the only clock the two hosts share.
    pub(crate) fn slot_expired(&self, slot: &Slot, now: LeaseNow) -> bool {
        let here = slot.host.load(Ordering::Relaxed) == host_id();
        let ns = slot.pid_ns.load(Ordering::Relaxed);
        if here && ns != 0 && ns == dm_sys::proc::pid_namespace() {
            // A process of this host and PID namespace: the process itself
            // decides, alive (stopped or not) or gone, never its lease. So
            // a stopped process is never robbed of pages it may still
            // write through its mappings when it resumes.
            let pid = slot.pid.load(Ordering::Relaxed);
            return !dm_sys::proc::alive_since(pid, slot.start.load(Ordering::Relaxed));
        }
        let (hb, now) = if here {
            (slot.heartbeat_mono_ms.load(Ordering::Acquire), now.mono_ms)
        } else {
            (slot.heartbeat_ms.load(Ordering::Acquire), now.wall_ms)
        };
        let lease = slot.lease_ms.load(Ordering::Relaxed);
        if now > hb.saturating_add(lease) {
            return true;
        }
        // On the same host (a slot of an older build, or one judged by its
        // lease) a vanished pid is dead without waiting for the lease. A
        // pid of another namespace means nothing here: the lease alone.
        here && ns == 0 && !dm_sys::proc::pid_alive(slot.pid.load(Ordering::Relaxed))
    }
}

/// Gives the pool's bookkeeping (header, page table, slots, descriptors,
/// registry) its space in `file` now, and the whole pool its space with
/// `cfg.reserve`. The bookkeeping is small, and it is written inside
/// signal handlers (a mapped buffer's copy-on-write), where a full file
/// system could not be said plainly. The data pages and rings get theirs
/// only if asked.
pub(crate) fn prepare_backing(
    file: &SharedFile,
    layout: &Layout,
    cfg: &crate::layout::PoolConfig,
) -> Result<()> {
    if cfg.reserve {
        file.reserve_range(0, layout.total_len)?;
    } else {
        file.reserve_range(0, layout.chan_off)?;
    }
    Ok(())
}

/// The page an entry names, borrowed or not.
#[inline]
pub(crate) fn unborrow(e: u32) -> u32 {
    if e == NO_PAGE {
        e
    } else {
        e & !BORROWED
    }
}

/// This host's boot, as a hash (never 0): of its boot id; where that
/// cannot be read, of its boot time and machine id together; failing
/// those too, a random value of this process's own, so that two hosts
/// never pass for one. (A host taken for this one would have its live
/// processes judged by pid here, and found dead. With the random value
/// the process's neighbours are judged by their leases, as another host's
/// are, and a pool on the host's clock refuses it while its owner lives:
/// such a pool wants the wall clock, `RefClock::Wall`.)
pub(crate) fn host_id() -> u64 {
    static ID: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *ID.get_or_init(|| {
        let read = |p: &str| std::fs::read_to_string(p).ok();
        let btime = read("/proc/stat").and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("btime ").map(|t| t.trim().to_owned()))
        });
        host_id_from(
            read("/proc/sys/kernel/random/boot_id").as_deref(),
            btime.as_deref(),
            read("/etc/machine-id").as_deref(),
        )
    })
}

/// [`host_id`] from what could be read: the boot id, the boot time (in
/// seconds) and the machine id.
fn host_id_from(boot_id: Option<&str>, btime: Option<&str>, machine: Option<&str>) -> u64 {
    fn known(s: Option<&str>) -> Option<&str> {
        s.map(str::trim).filter(|s| !s.is_empty())
    }
    let h = match (known(boot_id), known(btime), known(machine)) {
        (Some(b), _, _) => crate::layout::fnv1a(b.as_bytes()),
        (None, Some(t), Some(m)) => {
            crate::layout::fnv1a(format!("btime {t} machine {m}").as_bytes())
        }
        _ => dm_sys::rand::random_u64(),
    };
    h.max(1)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn no_two_hosts_pass_for_one_when_the_boot_id_is_unreadable() {
        let boot = Some("6f1c0d2e-0000-4000-8000-000000000001\n");
        // The boot id alone names the boot: the same id, the same host.
        assert_eq!(
            host_id_from(boot, Some("1"), Some("a")),
            host_id_from(boot, None, None)
        );
        assert_ne!(
            host_id_from(boot, None, None),
            host_id_from(Some("x"), None, None)
        );
        // Without it, the boot time and machine id together.
        let (t, m) = (Some("1764000000"), Some("0123abcd\n"));
        assert_eq!(host_id_from(None, t, m), host_id_from(Some(" "), t, m));
        assert_ne!(
            host_id_from(None, t, m),
            host_id_from(None, Some("1764000001"), m)
        );
        // Knowing nothing, each process is a host of its own: never one
        // shared constant (as the hash of an empty boot id was).
        let lone: Vec<u64> = (0..4).map(|_| host_id_from(None, t, None)).collect();
        assert!(lone.windows(2).all(|w| w[0] != w[1]), "{lone:?}");
        assert!(lone
            .iter()
            .all(|&h| h != 0 && h != crate::layout::fnv1a(b"")));
        assert_eq!(host_id(), host_id(), "one value per process");
        assert_ne!(host_id(), 0);
    }
}

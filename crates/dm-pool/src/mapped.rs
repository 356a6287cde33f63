//! Mapped buffers: transparent load/store with copy-on-write by write fault.
//!
//! A [`MappedBuffer`] is a buffer whose pages are also mapped into a private
//! range of virtual addresses (`mmap(MAP_SHARED|MAP_FIXED)` at each page's
//! file offset, one mapping per run of consecutive pages), so code can use
//! it as a plain `&mut [u8]`. Pages held alone are mapped read-write; shared
//! pages (and unbacked ones, which read as zero) are read-only, so the first
//! store faults. The process-wide fault hook (`dm_sys::fault`) finds the
//! window, and resolves the fault as the CoW rule says: if the page is still
//! shared it is copied to a fresh page which is mapped in its place, else the
//! page is just made writable. Only written pages are copied.
//!
//! The handler is async-signal-safe: it uses atomics, plain memory copies and
//! raw `mmap`/`mprotect` only, takes pages straight from the shared free set
//! (never the process's page cache, which is behind a mutex), and serialises with
//! other threads faulting on the same buffer by a spin flag in the descriptor.
//! Faults outside every window are passed to the previous handler.
//!
//! This path costs page-table work (a fault, a copy and a remap, about 13 µs
//! per written shared page here) and sharing a mapped buffer costs one
//! `mprotect` of its range; the explicit API ([`Buffer`]) is the fast path.

use crate::desc::{Desc, FLAG_INDIRECT, FLAG_TWO_LEVEL};
use crate::error::{Error, Result};
use crate::pages::{Changed, Delta, PageState, PageTable, BORROWED, NO_PAGE};
use crate::pool::{Buffer, Pool};
use crate::refs::Ref;
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use dm_sys::mem::{map_file_fixed, protect, Prot, Reservation};
use std::sync::atomic::AtomicPtr;

const MAX_WINDOWS: usize = 256;
static WINDOWS: [AtomicPtr<Window>; MAX_WINDOWS] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_WINDOWS];

/// What the fault handler needs about one mapped buffer, as raw addresses
/// (stable for the life of the `MappedBuffer` that owns it).
struct Window {
    start: usize,
    len: usize,
    ps: usize,
    fd: i32,
    /// Where the data area starts in the file (the pool may be a region of it).
    data_off: u64,
    data: *mut u8,
    n_pages: u32,
    pt: *const AtomicU64,
    stripes: *const AtomicU64,
    desc: *const Desc,
    desc_idx: u32,
    slot: u16,
    cursor: *const AtomicU64,
    cow_copies: *const AtomicU64,
}

/// A buffer usable with plain loads and stores (see the module docs).
#[derive(Debug)]
pub struct MappedBuffer {
    win: Box<WindowBox>,
    slot_idx: usize,
    res: Reservation,
    buf: Buffer,
}

struct WindowBox(Window);

impl std::fmt::Debug for WindowBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Window({:#x}+{})", self.0.start, self.0.len)
    }
}

// SAFETY: the window's raw pointers address the pool mapping, which the
// contained Buffer (through its Pool) keeps alive; access is via atomics.
unsafe impl Send for MappedBuffer {}
// SAFETY: shared access only reads (`&self` gives `&[u8]`).
unsafe impl Sync for MappedBuffer {}

impl MappedBuffer {
    /// Allocates a zero-filled mapped buffer of `len` bytes.
    pub fn alloc(pool: &Pool, len: u64) -> Result<MappedBuffer> {
        Self::from_buffer(pool.alloc(len)?)
    }

    /// Maps a Ref as a mapped buffer (+1 share per page, no copy).
    pub fn map_ref(pool: &Pool, r: &Ref) -> Result<MappedBuffer> {
        Self::from_buffer(pool.map_ref(r)?)
    }

    /// Maps an existing buffer for load/store.
    pub fn from_buffer(mut buf: Buffer) -> Result<MappedBuffer> {
        if let Some(h) = buf.pool().shm().huge_page() {
            // (A write fault copies a page with `pwrite`, which hugetlbfs
            // does not take, and maps single pages.)
            return Err(Error::InvalidArgument(format!(
                "this pool is on hugetlbfs ({} KiB pages), where buffers cannot be mapped for \
                 loads and stores: use the buffer's reads and writes, or a pool on a huge-page \
                 tmpfs (`mount -t tmpfs -o huge=always`)",
                h >> 10
            )));
        }
        // The fault handler cannot allocate: give the buffer its own list
        // now, and its own copy of every list a Ref shares (the handler
        // reads a page's count as its holders).
        buf.materialize()?;
        buf.own_lists(0, buf.page_count() as usize)?;
        buf.set_mapped();
        dm_sys::fault::install(resolve).map_err(Error::Io)?;
        let pool = buf.pool().clone();
        let shm = pool.shm();
        let ps = shm.layout.page_size as usize;
        let n = buf.page_count() as usize;
        if !ps.is_multiple_of(dm_sys::mem::os_page_size()) {
            return Err(Error::Unaligned {
                addr: ps as u64,
                align: dm_sys::mem::os_page_size() as u64,
            });
        }
        let res = Reservation::new(n * ps)?;
        let a = shm.atomics();
        let d = shm
            .desc(buf.desc_index())
            .ok_or_else(|| Error::Corrupt("descriptor out of range".into()))?;
        let win = Box::new(WindowBox(Window {
            start: res.base() as usize,
            len: n * ps,
            ps,
            fd: shm.raw_fd(),
            data_off: shm.data_file_off(),
            // SAFETY: a validated layout has at least one data page.
            data: unsafe { shm.page_ptr(0) },
            n_pages: shm.layout.n_pages,
            pt: shm.pages_ptr(),
            stripes: shm.stripes_ptr(),
            desc: d,
            desc_idx: buf.desc_index(),
            slot: pool.slot(),
            cursor: &a.page_cursor,
            cow_copies: &a.cow_copies,
        }));
        let mut m = MappedBuffer {
            win,
            slot_idx: usize::MAX,
            res,
            buf,
        };
        m.map_all()?;
        let p = &m.win.0 as *const Window as *mut Window;
        let idx = WINDOWS
            .iter()
            .position(|w| {
                w.compare_exchange(std::ptr::null_mut(), p, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            })
            .ok_or(Error::ResourceExhausted {
                what: "mapped-buffer windows (256 per process)",
            })?;
        m.slot_idx = idx;
        Ok(m)
    }

    /// (Re)maps every page with the protection the CoW rule asks for:
    /// read-write if held alone, read-only if shared. Runs of consecutive
    /// pages with the same protection take one `mmap`.
    fn map_all(&mut self) -> Result<()> {
        let pool = self.buf.pool().clone();
        let shm = pool.shm();
        let t = shm.pages();
        let ps = self.win.0.ps;
        let n = self.buf.page_count() as usize;
        let mut k = 0;
        while k < n {
            let (p, borrowed) = self.buf.owned_page_at(k)?;
            if p == NO_PAGE {
                k += 1;
                continue;
            }
            shm.check_page(p)?;
            // Writable only if this buffer holds the page alone.
            let prot = if !borrowed && t.rc(p) == 1 {
                Prot::ReadWrite
            } else {
                Prot::Read
            };
            let mut run = 1;
            while k + run < n {
                let (q, qb) = self.buf.owned_page_at(k + run)?;
                let qprot = if !qb && t.rc(q) == 1 {
                    Prot::ReadWrite
                } else {
                    Prot::Read
                };
                if q != p + run as u32 || qprot != prot {
                    break;
                }
                run += 1;
            }
            let off = shm.data_file_off() + p as u64 * ps as u64;
            self.res
                .map_file(k * ps, shm.raw_fd(), off, run * ps, prot)?;
            k += run;
        }
        Ok(())
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.buf.len() as usize
    }

    /// Whether empty (never).
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The contents.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the reservation covers offset + len bytes, all mapped
        // (pool pages or the reservation's zero pages) and readable.
        unsafe {
            std::slice::from_raw_parts(
                self.res.base().add(self.buf.first_offset() as usize),
                self.len(),
            )
        }
    }

    /// The contents, writable: stores to shared pages fault and are resolved
    /// by copy-on-write. A store that cannot get a page (pool exhausted)
    /// cannot return an error and kills the process with SIGSEGV; write
    /// through [`Buffer::write`] where that must be an error instead.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only view.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.res.base().add(self.buf.first_offset() as usize),
                self.len(),
            )
        }
    }

    /// Shares `len` bytes at `offset` as a Ref. The range is made read-only
    /// first (one `mprotect`), so that later stores fault and copy.
    pub fn create_ref(&mut self, offset: u64, len: u64) -> Result<Ref> {
        self.protect(offset, len)?;
        // One share per page: a shared list would be copied by the fault
        // handler, which cannot allocate.
        let pool = self.buf.pool();
        let ttl = std::time::Duration::from_millis(pool.layout().ref_ttl_ms);
        pool.create_ref_as(&self.buf, offset, len, ttl, false)
    }

    /// A second (explicit) buffer over the same pages ([`Dm::dup`]); the
    /// mapping is made read-only first, as for a Ref.
    ///
    /// [`Dm::dup`]: crate::Dm::dup
    pub fn dup(&mut self) -> Result<Buffer> {
        let r = self.create_ref(0, self.buf.len())?;
        let pool = self.buf.pool();
        let mapped = pool.map_ref(&r);
        let released = pool.release_ref(&r);
        let d = mapped?;
        released?;
        Ok(d)
    }

    /// Makes the pages under `len` bytes at `offset` read-only (one
    /// `mprotect`), so that later stores fault and copy.
    fn protect(&mut self, offset: u64, len: u64) -> Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.buf.len()) {
            return Err(Error::OutOfBounds {
                offset,
                len,
                size: self.buf.len(),
            });
        }
        let ps = self.win.0.ps;
        let start = (self.buf.first_offset() as u64 + offset) as usize / ps * ps;
        let end = ((self.buf.first_offset() as u64 + offset + len) as usize).div_ceil(ps) * ps;
        // SAFETY: the range lies in our reservation and `&mut self` means no
        // slice of it is borrowed.
        unsafe { protect(self.res.base().add(start), end - start, Prot::Read)? };
        Ok(())
    }

    /// Shares the whole buffer.
    pub fn share(&mut self) -> Result<Ref> {
        self.create_ref(0, self.buf.len())
    }

    /// The underlying buffer (explicit reads, segments).
    pub fn buffer(&self) -> &Buffer {
        &self.buf
    }
}

impl Drop for MappedBuffer {
    fn drop(&mut self) {
        if self.slot_idx < MAX_WINDOWS {
            WINDOWS[self.slot_idx].store(std::ptr::null_mut(), Ordering::Release);
        }
    }
}

/// The fault resolver registered with `dm_sys::fault`. Async-signal-safe.
fn resolve(addr: usize, is_write: bool) -> bool {
    if !is_write {
        return false;
    }
    for w in &WINDOWS {
        let p = w.load(Ordering::Acquire);
        if p.is_null() {
            continue;
        }
        // SAFETY: a registered window stays valid until its MappedBuffer is
        // dropped, which unregisters it first; a store into the window needs
        // a `&mut` borrow of that MappedBuffer, so it cannot be dropping now.
        let win = unsafe { &*p };
        if addr >= win.start && addr < win.start + win.len {
            // SAFETY: as above.
            return unsafe { resolve_in(win, addr) };
        }
    }
    false
}

/// # Safety
/// `win` must be a registered, live window and `addr` inside it.
unsafe fn resolve_in(win: &Window, addr: usize) -> bool {
    let k = (addr - win.start) / win.ps;
    let page_addr = (win.start + k * win.ps) as *mut u8;
    // SAFETY: per the contract, the window's pointers are live.
    let (d, pt, cursor) = unsafe { (&*win.desc, &*win.pt, &*win.cursor) };
    // SAFETY: pt addresses n_pages words of the page table.
    // SAFETY: as above; the stripe table has stripes_for(n_pages) words.
    let t = PageTable::new(
        unsafe { std::slice::from_raw_parts(pt, win.n_pages as usize) },
        unsafe {
            std::slice::from_raw_parts(win.stripes, crate::pages::stripes_for(win.n_pages) as usize)
        },
    );
    // Another thread of this process holds it for one page's copy. Held
    // for seconds, it was scribbled on (the word is in the shared pool):
    // the fault is passed on rather than waited for forever.
    let mut spins = 0u32;
    let mut since = None;
    while d
        .lock
        .compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        spins += 1;
        if spins < 1024 {
            std::hint::spin_loop();
            continue;
        }
        let now = dm_sys::time::monotonic_ms();
        if now.saturating_sub(*since.get_or_insert(now)) > LOCK_WAIT_MS {
            return ends_saying(LOCK_MSG);
        }
        // SAFETY: sched_yield is async-signal-safe.
        unsafe { libc_yield() };
    }
    // SAFETY: per the contract.
    let ok = unsafe { cow_one(win, d, t, cursor, k, page_addr) };
    d.lock.store(0, Ordering::Release);
    ok
}

/// # Safety
/// As `resolve_in`, with the descriptor lock held.
unsafe fn cow_one(
    win: &Window,
    d: &Desc,
    t: PageTable<'_>,
    cursor: &AtomicU64,
    k: usize,
    page_addr: *mut u8,
) -> bool {
    // SAFETY: per the contract.
    let Some(entry) = (unsafe { entry_of(win, d, k) }) else {
        return false;
    };
    let raw = entry.load(Ordering::Acquire);
    // A borrowed page is held by the Ref this buffer was mapped from: copy
    // it, never write it, and drop no share of it.
    let borrowed = raw != NO_PAGE && raw & BORROWED != 0;
    let p = if borrowed { raw & !BORROWED } else { raw };
    if p != NO_PAGE && p >= win.n_pages {
        return false;
    }
    if p != NO_PAGE && !borrowed && t.rc(p) == 1 {
        // Held alone (the other shares went away): just make it writable.
        // SAFETY: page_addr is a page of our reservation.
        return unsafe { protect(page_addr, win.ps, Prot::ReadWrite) }.is_ok();
    }
    let Some(q) = t.claim_one(cursor, win.slot) else {
        return ends_saying(NO_PAGE_MSG);
    };
    let qptr = unsafe_page(win, q);
    // The copy must not store into a page the file system has no room for:
    // that bus error would be raised inside this handler, on a nearly full
    // signal stack, and end the process with a bare SIGSEGV. The kernel
    // copies instead (`pwrite`, which says ENOSPC), or the page's storage
    // is allocated before it is zeroed; a full file system is said plainly.
    let off = win.data_off + q as u64 * win.ps as u64;
    let filled = if p != NO_PAGE {
        // SAFETY: p is shared and therefore frozen, a page of the pool.
        let src = unsafe { std::slice::from_raw_parts(unsafe_page(win, p), win.ps) };
        dm_sys::mem::write_at(win.fd, src, off)
    } else {
        dm_sys::mem::back_range(win.fd, off, win.ps).map(|()| {
            // An unbacked page reads as zero; a taken page keeps old bytes.
            // SAFETY: q is ours (Cached by this slot), a page of the pool,
            // and its storage now exists.
            unsafe { std::ptr::write_bytes(qptr, 0, win.ps) };
        })
    };
    if filled.is_err() {
        let _ = t.release_cached(q, win.slot);
        if !dm_sys::bus::explain(qptr as usize) {
            dm_sys::io::write_stderr(NO_SPACE_MSG);
        }
        return false;
    }
    // Map the copy first (the syscall stays outside the commit window), then
    // commit: journal, link, hold q, drop p's share, clear the journal.
    // SAFETY: page_addr is a page of our reservation; the user's access
    // there is the faulting instruction, which retries after we return.
    if unsafe { map_file_fixed(page_addr, win.fd, off, win.ps, Prot::ReadWrite) }.is_err() {
        // q goes back; nothing else changed.
        let _ = t.release_cached(q, win.slot);
        return ends_saying(NO_MAPPING_MSG);
    }
    if p != NO_PAGE && !borrowed {
        d.journal_old.store(p, Ordering::Relaxed);
        d.journal_idx.store(k as u32, Ordering::Release);
    }
    entry.store(q, Ordering::Release);
    if t.hold_cached(q, win.slot).is_err() {
        return false;
    }
    if borrowed {
        // SAFETY: a pool counter.
        unsafe { &*win.cow_copies }.fetch_add(1, Ordering::Relaxed);
    }
    if p != NO_PAGE && !borrowed {
        // Drop p's share under the page lock, recorded by clearing the
        // journal (the protocol of reclaim.rs, without allocating).
        let mut spins = 0u32;
        loop {
            match t.change(p, win.desc_idx, Delta::Dec(win.slot)) {
                Ok(c @ Changed::Locked(_)) => {
                    d.journal_idx.store(NO_PAGE, Ordering::Release);
                    t.done(p, c);
                    break;
                }
                Ok(Changed::Last) => {
                    d.journal_idx.store(NO_PAGE, Ordering::Release);
                    t.done(p, Changed::Last);
                    // Cached by us, nobody else references it: back to the
                    // free set as it is (takers zero what they need).
                    let _ = t.release_cached(p, win.slot);
                    break;
                }
                Ok(Changed::Busy(_)) => {
                    spins += 1;
                    if spins < 64 {
                        std::hint::spin_loop();
                    } else {
                        // SAFETY: sched_yield is async-signal-safe.
                        unsafe { libc_yield() };
                    }
                }
                _ => return false,
            }
        }
        // SAFETY: a pool counter.
        unsafe { &*win.cow_copies }.fetch_add(1, Ordering::Relaxed);
    }
    debug_assert!(!matches!(t.state(q), Ok(PageState::Free)));
    true
}

/// # Safety
/// None beyond the syscall's: it only yields the CPU.
/// Said when a store into a mapped buffer needs a page and the pool has
/// none: a store cannot fail, so the process ends (the fault is passed on).
const NO_PAGE_MSG: &[u8] = b"dmrpc: a store into a mapped buffer needs a new page (copy-on-write) \
and the pool has none free, so the process ends. Free buffers and Refs, use a larger pool, or \
write through explicit buffers, which return ResourceExhausted instead.\n";

/// Said when the page a store copies into cannot get storage (the pool
/// file's file system is full) and the pool file's mapping is not watched.
const NO_SPACE_MSG: &[u8] =
    b"dmrpc: a store into a mapped buffer needs a new page (copy-on-write) \
and the pool file's file system has no room for it, so the process ends. Free space there, or \
create the pool with its space reserved (`dmrpc pool create --reserve`).\n";

/// Said when the kernel refuses the mapping of a copied page: the
/// process's mappings are at `vm.max_map_count` (or memory ran out).
const NO_MAPPING_MSG: &[u8] = b"dmrpc: a store into a mapped buffer needs one more memory mapping \
(copy-on-write) and the kernel refused it (the process is at vm.max_map_count, or out of \
memory), so the process ends. Raise vm.max_map_count (sysctl), map fewer or smaller buffers, or \
write through explicit buffers.\n";

/// The longest a fault waits for its buffer's lock, in ms.
const LOCK_WAIT_MS: u64 = 2000;

/// Said when a buffer's lock stays held (pool metadata scribbled on).
const LOCK_MSG: &[u8] = b"dmrpc: a store into a mapped buffer waited over 2 s for the buffer's \
lock in the pool, which no thread of this process holds that long: the pool's metadata was \
overwritten. The process ends; run `dmrpc pool check`.\n";

/// Writes `msg` to stderr and declines the fault (async-signal-safe).
fn ends_saying(msg: &[u8]) -> bool {
    dm_sys::io::write_stderr(msg);
    false
}

unsafe fn libc_yield() {
    dm_sys::sched_yield();
}

fn unsafe_page(win: &Window, p: u32) -> *mut u8 {
    // SAFETY: callers pass p < n_pages, inside the data area.
    unsafe { win.data.add(p as usize * win.ps) }
}

/// Entry `k` of the descriptor, without allocating.
///
/// # Safety
/// `win` and `d` must be live.
unsafe fn entry_of<'a>(win: &'a Window, d: &'a Desc, k: usize) -> Option<&'a AtomicU32> {
    if d.flags.load(Ordering::Acquire) & FLAG_INDIRECT == 0 {
        return d.entries.get(k);
    }
    let per = win.ps / 4;
    let c = k / per;
    let l = if d.flags.load(Ordering::Acquire) & FLAG_TWO_LEVEL == 0 {
        d.entries.get(c)?.load(Ordering::Acquire)
    } else {
        let top = d.entries.get(c / per)?.load(Ordering::Acquire);
        // SAFETY: as below, for the second-level list.
        unsafe { list_word(win, top, c % per)?.load(Ordering::Acquire) }
    };
    // SAFETY: `list_word` checks the page index; `win` is live.
    unsafe { list_word(win, l, k % per) }
}

/// Word `i` of list page `l`, if `l` lies in the pool.
///
/// # Safety
/// `win` must be live and `i` below the entries of a page.
unsafe fn list_word(win: &Window, l: u32, i: usize) -> Option<&AtomicU32> {
    if l >= win.n_pages {
        return None;
    }
    // SAFETY: l is a page inside the data area; words are u32-aligned and
    // i is within the page (the caller's contract).
    Some(unsafe { &*(unsafe_page(win, l) as *const AtomicU32).add(i) })
}

//! Fixed mappings: a buffer's pages at one chosen address, read-write,
//! with no copy-on-write.
//!
//! A [`FixedMapping`] maps every page of a buffer (`MAP_SHARED|MAP_FIXED`
//! at each run's file offset) into a range reserved at an address the
//! caller chose (`MAP_FIXED_NOREPLACE`: a range in use in this process is
//! [`dm_sys::mem::SysError::AddressInUse`], never replaced). Two processes
//! that map buffers holding the same pages at the same address see one
//! memory: native pointers into it are valid in both. This is what a
//! shared heap is made of.
//!
//! Stores go straight to the pages, shared or not: this is the one way to
//! write pool pages that skips copy-on-write, on purpose. The buffer is
//! held by the mapping and never written through the buffer API, so its
//! pages stay the ones every other mapping of them sees. The pages stay
//! in the pool's accounting as the buffer's: its quota charge, crash
//! reclaim (a dead process's buffer is dropped, the pages live on while
//! another holds them) and `pool check`.

use crate::error::{Error, Result};
use crate::pages::NO_PAGE;
use crate::pool::Buffer;
use dm_sys::mem::{Prot, Reservation};

/// A buffer mapped read-write at a fixed address (see the module docs).
#[derive(Debug)]
pub struct FixedMapping {
    /// (Dropped first: the pages are unmapped before the buffer lets go
    /// of them.)
    res: Reservation,
    buf: Buffer,
}

impl FixedMapping {
    /// Maps all of `buf` at `addr`. The buffer must be whole pages from its
    /// first byte, every page backed (written once, as
    /// [`Buffer::overwrite`] does); `addr` a multiple of the OS page.
    pub fn new(mut buf: Buffer, addr: u64) -> Result<FixedMapping> {
        let pool = buf.pool().clone();
        let shm = pool.shm();
        let ps = shm.layout.page_size as usize;
        let n = buf.page_count() as usize;
        if buf.first_offset() != 0 || buf.len() != (n * ps) as u64 || n == 0 {
            return Err(Error::InvalidArgument(
                "a fixed mapping takes a buffer of whole pages from its first byte".into(),
            ));
        }
        if !ps.is_multiple_of(dm_sys::mem::os_page_size()) {
            return Err(Error::Unaligned {
                addr: ps as u64,
                align: dm_sys::mem::os_page_size() as u64,
            });
        }
        shm.pages_map_alone()?;
        // Its own page list (a mapped Ref's is its Ref's until then).
        buf.materialize()?;
        let res = Reservation::at(addr, n * ps)?;
        let mut k = 0;
        while k < n {
            let (p, _) = buf.owned_page_at(k)?;
            if p == NO_PAGE {
                return Err(Error::InvalidArgument(format!(
                    "page {k} of a buffer to map at a fixed address is not backed"
                )));
            }
            shm.check_page(p)?;
            let mut run = 1;
            while k + run < n {
                let (q, _) = buf.owned_page_at(k + run)?;
                if q == NO_PAGE || q != p + run as u32 {
                    break;
                }
                run += 1;
            }
            let off = shm.data_file_off() + u64::from(p) * ps as u64;
            res.map_file(k * ps, shm.raw_fd(), off, run * ps, Prot::ReadWrite)?;
            k += run;
        }
        Ok(FixedMapping { res, buf })
    }

    /// The first address.
    pub fn base(&self) -> *mut u8 {
        self.res.base()
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.res.len()
    }

    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        self.res.is_empty()
    }

    /// The buffer it maps (to share it: [`Buffer::share`]). Its pages are
    /// this mapping's: write them through [`base`](Self::base), not
    /// through the buffer, whose writes would copy them.
    pub fn buffer(&self) -> &Buffer {
        &self.buf
    }
}

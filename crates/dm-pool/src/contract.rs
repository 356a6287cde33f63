//! The DM contract (`docs/design.md`) as traits, so that code written
//! against it — the RPC layer's payloads, the conformance suite
//! ([`crate::conformance`]) — runs unchanged on the shared pool
//! ([`Pool`]) and on memory servers (`dm-memserver`).
//!
//! | operation | contract |
//! |---|---|
//! | [`Dm::alloc`] | a zero-filled buffer; pages are backed on first write |
//! | [`Dm::free`] | drops this client's shares of the buffer's pages (so does dropping it) |
//! | [`DmBuffer::read`] / [`DmBuffer::write`] | explicit access; a write to a shared page copies it first (CoW) |
//! | [`Dm::create_ref`] | the Ref shares the range's pages (+1 share each; in a pool, a whole buffer's lists are shared instead); the buffer's pages become CoW |
//! | [`Dm::map_ref`] | a new buffer over the Ref's pages (+1 share each), CoW on write; many times |
//! | [`Dm::release_ref`] | drops the Ref's shares; a second release is an error |

use crate::check::CheckReport;
use crate::error::Result;
use crate::pool::{Buffer, Pool};
use crate::refs::Ref;
use std::time::Duration;

/// A buffer of some backend: a range of DM addresses of this client.
pub trait DmBuffer: Send {
    /// Length in bytes.
    fn len(&self) -> u64;

    /// True for a zero-length buffer (never, for a live one).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Reads `out.len()` bytes at `offset`.
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<()>;

    /// Writes `data` at `offset` (copying shared pages first).
    fn write(&mut self, offset: u64, data: &[u8]) -> Result<()>;

    /// The whole buffer, copied out.
    fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len() as usize];
        self.read(0, &mut v)?;
        Ok(v)
    }
}

/// Page counts of a backend, for checks after tests and for monitoring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Pages holding data (at least one share).
    pub pages_held: u64,
    /// Pages with more than one share.
    pub pages_shared: u64,
    /// Live Refs.
    pub refs: u64,
    /// Pages the backend can still hand out.
    pub pages_free: u64,
}

/// A disaggregated-memory backend.
pub trait Dm: Send + Sync {
    /// This backend's buffer.
    type Buffer: DmBuffer;

    /// The backend's page size.
    fn page_size(&self) -> usize;

    /// A zero-filled buffer of `len` bytes.
    fn alloc(&self, len: u64) -> Result<Self::Buffer>;

    /// Frees a buffer (dropping it does the same, reporting nothing).
    fn free(&self, buf: Self::Buffer) -> Result<()>;

    /// A Ref to `len` bytes of `buf` at `offset`, with the backend's
    /// default time to live.
    fn create_ref(&self, buf: &Self::Buffer, offset: u64, len: u64) -> Result<Ref>;

    /// A Ref that expires after `ttl` unless released first.
    fn create_ref_ttl(
        &self,
        buf: &Self::Buffer,
        offset: u64,
        len: u64,
        ttl: Duration,
    ) -> Result<Ref>;

    /// Maps a Ref as a new buffer of this client.
    fn map_ref(&self, r: &Ref) -> Result<Self::Buffer>;

    /// Releases a Ref.
    fn release_ref(&self, r: &Ref) -> Result<()>;

    /// A second buffer over the same pages as `buf` (each page +1 share,
    /// no copy; both become copy-on-write): a Ref made, mapped and
    /// released. The Ref is released even when mapping fails.
    fn dup(&self, buf: &Self::Buffer) -> Result<Self::Buffer> {
        let r = self.create_ref(buf, 0, buf.len())?;
        let mapped = self.map_ref(&r);
        let released = self.release_ref(&r);
        let d = mapped?;
        released?;
        Ok(d)
    }

    /// Reclaims what has expired (Refs past their TTL) now, instead of at
    /// the backend's next periodic sweep.
    fn maintain(&self) -> Result<()>;

    /// The backend's page counts (across all its clients).
    fn usage(&self) -> Result<Usage>;

    /// Checks the backend's invariants (every page's count equals its
    /// holders, free pages are zero, ...): the problems found, none if
    /// consistent.
    fn check(&self) -> Result<Vec<String>>;
}

impl DmBuffer for Buffer {
    fn len(&self) -> u64 {
        Buffer::len(self)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        Buffer::read(self, offset, out)
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        Buffer::write(self, offset, data)
    }

    fn to_vec(&self) -> Result<Vec<u8>> {
        Buffer::to_vec(self)
    }
}

impl Dm for Pool {
    type Buffer = Buffer;

    fn page_size(&self) -> usize {
        Pool::page_size(self)
    }

    fn alloc(&self, len: u64) -> Result<Buffer> {
        Pool::alloc(self, len)
    }

    fn free(&self, buf: Buffer) -> Result<()> {
        Pool::free(self, buf)
    }

    fn create_ref(&self, buf: &Buffer, offset: u64, len: u64) -> Result<Ref> {
        Pool::create_ref(self, buf, offset, len)
    }

    fn create_ref_ttl(&self, buf: &Buffer, offset: u64, len: u64, ttl: Duration) -> Result<Ref> {
        Pool::create_ref_ttl(self, buf, offset, len, ttl)
    }

    fn map_ref(&self, r: &Ref) -> Result<Buffer> {
        Pool::map_ref(self, r)
    }

    fn release_ref(&self, r: &Ref) -> Result<()> {
        Pool::release_ref(self, r)
    }

    fn maintain(&self) -> Result<()> {
        Pool::maintain(self).map(|_| ())
    }

    fn usage(&self) -> Result<Usage> {
        let c: CheckReport = Pool::check(self);
        Ok(Usage {
            pages_held: c.pages_held,
            pages_shared: c.pages_shared,
            refs: c.refs_live,
            pages_free: c.pages_free + c.pages_cached,
        })
    }

    fn check(&self) -> Result<Vec<String>> {
        Ok(Pool::check(self).problems)
    }
}

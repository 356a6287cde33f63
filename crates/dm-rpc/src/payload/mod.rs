//! Size-aware payloads: what a call carries, inline or by Ref, behind one
//! API.
//!
//! A sender builds a [`Payload`] from bytes ([`Payload::from_vec`],
//! `From<&[u8]>`) or from a buffer it wrote in the pool
//! ([`Payload::from_buffer`], zero-copy). When the call is sent, a payload
//! up to the node's `inline_max` travels inline in the frame; a larger one
//! travels as a Ref (bytes are written to the pool first; a pool buffer is
//! shared as is). The Refs the framework created for a request are
//! released when the call completes; for a response, the client maps the
//! Ref and releases it at once, so the answer needs no release by anyone.
//! A handler that answers with the payload it received by Ref (an echo, or
//! the answer of a callee it forwarded it to) passes the request's Ref
//! back as it came, flagged as an echo: no hop makes a Ref or counts a
//! page, and the caller maps its own Ref before releasing it.
//!
//! A receiver reads through the same API whatever the choice: [`bytes`]
//! (borrowed when contiguous), [`segments`] (views of pool memory, no
//! copy), [`read`], [`to_vec`]. A request received by Ref is mapped on
//! first access, which is O(1) and involves no page-table work; a handler
//! that only forwards it ([`forward`]) never maps it. The Ref of a request
//! is valid until the caller's call completes: a handler that keeps the
//! data past its return calls [`keep`], which takes its own shares.
//!
//! Between nodes that do not share a pool but use the same memory servers
//! (`Node::with_memserver`, with the `memserver` feature: `remote.rs`), a large payload is written to a memory
//! server and its Ref travels instead (DmRPC-net); the receiver reads it
//! from the server on first access, through the same API. An answer that
//! arrives as a memory-server Ref keeps it until the payload is dropped
//! (then releases it), so it too is read only if and when it is used.
//!
//! [`bytes`]: Payload::bytes
//! [`segments`]: Payload::segments
//! [`read`]: Payload::read
//! [`to_vec`]: Payload::to_vec
//! [`forward`]: Payload::forward
//! [`keep`]: Payload::keep

use crate::error::RpcError;
use crate::frame::{Body, FLAG_ECHO};
use crate::node::Node;
use crate::transport::Sharing;
use bytes::Bytes;
use dm_pool::BACKEND_MEMSERVER;
use dm_pool::{Buffer, Dm, Pool, Ref};
use std::borrow::Cow;
use std::sync::{Arc, OnceLock};

#[cfg(feature = "memserver")]
mod remote;
#[cfg(feature = "memserver")]
use remote::{answer as remote_answer, request as remote_request};

/// The data of a call or an answer.
#[derive(Debug, Default)]
pub struct Payload {
    repr: Repr,
}

#[derive(Debug, Default)]
enum Repr {
    #[default]
    Empty,
    Bytes(Bytes),
    Buffer(Buffer),
    Ref(Arc<Received>),
    /// A buffer on a memory server (the sender's), with its bytes once read
    /// (shared by its forwards: each sends a Ref of it).
    #[cfg(feature = "memserver")]
    MemBuffer(Arc<remote::MemData>),
    /// A memory-server Ref that arrived.
    #[cfg(feature = "memserver")]
    Remote(Arc<remote::RemoteReceived>),
}

/// A payload that arrived by Ref (or is being forwarded by Ref).
#[derive(Debug)]
struct Received {
    pool: Pool,
    r: Ref,
    mapped: OnceLock<Result<Buffer, RpcError>>,
}

impl Received {
    fn buffer(&self) -> Result<&Buffer, RpcError> {
        self.mapped
            .get_or_init(|| self.pool.map_ref(&self.r).map_err(RpcError::from))
            .as_ref()
            .map_err(Clone::clone)
    }
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Self {
        Payload::from_vec(v)
    }
}

impl From<Bytes> for Payload {
    fn from(b: Bytes) -> Self {
        Payload::from_bytes(b)
    }
}

impl From<&[u8]> for Payload {
    fn from(v: &[u8]) -> Self {
        Payload::from_vec(v.to_vec())
    }
}

impl From<Buffer> for Payload {
    fn from(b: Buffer) -> Self {
        Payload::from_buffer(b)
    }
}

impl Payload {
    /// No data.
    pub fn empty() -> Payload {
        Payload { repr: Repr::Empty }
    }

    /// Bytes owned by the payload (sent inline, or copied into the pool and
    /// sent by Ref when larger than the threshold).
    pub fn from_vec(v: Vec<u8>) -> Payload {
        Payload::from_bytes(Bytes::from(v))
    }

    /// Bytes shared with the payload (no copy): as [`from_vec`](Self::from_vec).
    pub fn from_bytes(b: Bytes) -> Payload {
        if b.is_empty() {
            return Payload::empty();
        }
        Payload {
            repr: Repr::Bytes(b),
        }
    }

    /// A buffer written in the pool: sent by Ref with no copy (or inline
    /// when it is small). The pages become copy-on-write for everyone.
    pub fn from_buffer(b: Buffer) -> Payload {
        Payload {
            repr: Repr::Buffer(b),
        }
    }

    /// A copy of `data` for a peer that shares what `refs` says, through a
    /// transport carrying up to `max_inline` bytes inline: above the
    /// node's threshold (capped by that), and if the peer shares the pool,
    /// written straight into a pool buffer (one copy; `Payload::from(data)`
    /// copies into a vector first, and then into the pool).
    pub(crate) fn copy_for(
        node: &Node,
        max_inline: usize,
        refs: Sharing,
        data: &[u8],
    ) -> Result<Payload, RpcError> {
        if data.len() > node.cfg.threshold().min(max_inline) && refs.pool && !node.cfg.by_value {
            let mut b = node.pool.alloc(data.len() as u64)?;
            b.write(0, data)?;
            return Ok(Payload::from_buffer(b));
        }
        Ok(Payload::from_vec(data.to_vec()))
    }

    /// Bytes of data.
    pub fn len(&self) -> u64 {
        match &self.repr {
            Repr::Empty => 0,
            Repr::Bytes(v) => v.len() as u64,
            Repr::Buffer(b) => b.len(),
            Repr::Ref(r) => r.r.len,
            #[cfg(feature = "memserver")]
            Repr::MemBuffer(m) => m.len(),
            #[cfg(feature = "memserver")]
            Repr::Remote(r) => r.r.len,
        }
    }

    /// Whether the data lives on a memory server (arrived by its Ref, or
    /// built there).
    pub fn is_remote(&self) -> bool {
        #[cfg(feature = "memserver")]
        if let Repr::MemBuffer(..) | Repr::Remote(_) = self.repr {
            return true;
        }
        false
    }

    /// The bytes of remote data, read once.
    #[cfg(feature = "memserver")]
    fn remote_bytes(&self) -> Result<Option<&[u8]>, RpcError> {
        let cell = match &self.repr {
            Repr::MemBuffer(m) => m.bytes(),
            Repr::Remote(r) => r.bytes(),
            _ => return Ok(None),
        };
        cell.as_ref()
            .map(|v| Some(v.as_slice()))
            .map_err(Clone::clone)
    }

    #[cfg(not(feature = "memserver"))]
    fn remote_bytes(&self) -> Result<Option<&[u8]>, RpcError> {
        Ok(None)
    }

    /// Whether there is no data.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the data lives in the pool (arrived by Ref, or built there).
    pub fn in_pool(&self) -> bool {
        matches!(self.repr, Repr::Buffer(_) | Repr::Ref(_))
    }

    /// The Ref this payload arrived by, if it did.
    pub fn as_ref_handle(&self) -> Option<&Ref> {
        match &self.repr {
            Repr::Ref(r) => Some(&r.r),
            #[cfg(feature = "memserver")]
            Repr::Remote(r) => Some(&r.r),
            _ => None,
        }
    }

    fn buffer(&self) -> Result<Option<&Buffer>, RpcError> {
        Ok(match &self.repr {
            Repr::Buffer(b) => Some(b),
            Repr::Ref(r) => Some(r.buffer()?),
            _ => None,
        })
    }

    /// The data as zero-copy views: one slice for inline data, one per run
    /// of contiguous pages for pool data.
    pub fn segments(&self) -> Result<Vec<&[u8]>, RpcError> {
        if let Some(v) = self.remote_bytes()? {
            return Ok(vec![v]);
        }
        Ok(match (&self.repr, self.buffer()?) {
            (Repr::Bytes(v), _) => vec![&v[..]],
            (_, Some(b)) => b.segments(0, b.len())?,
            _ => Vec::new(),
        })
    }

    /// The data: borrowed when it is contiguous (inline data always is;
    /// pool data when its pages are), copied otherwise.
    pub fn bytes(&self) -> Result<Cow<'_, [u8]>, RpcError> {
        let segs = self.segments()?;
        Ok(match segs.len() {
            0 => Cow::Borrowed(&[]),
            1 => Cow::Borrowed(segs[0]),
            _ => Cow::Owned(segs.concat()),
        })
    }

    /// Copies `out.len()` bytes at `offset` into `out`.
    /// Data on a memory server that has not been read yet is not fetched
    /// whole: only the range asked for is (a firewall reading a header
    /// pulls a few bytes, not the image behind it).
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), RpcError> {
        #[cfg(feature = "memserver")]
        if let Repr::Remote(r) = &self.repr {
            if let Some(done) = r.read_unfetched(&mut [(offset, out)]) {
                return done;
            }
        }
        let flat: Option<&[u8]> = match &self.repr {
            Repr::Bytes(v) => Some(v),
            _ => self.remote_bytes()?,
        };
        if let Some(v) = flat {
            let s = usize::try_from(offset)
                .ok()
                .and_then(|o| v.get(o..o.checked_add(out.len())?))
                .ok_or_else(|| {
                    RpcError::invalid_argument(format!(
                        "read of {} bytes at {offset} outside a payload of {}",
                        out.len(),
                        v.len()
                    ))
                })?;
            out.copy_from_slice(s);
            return Ok(());
        }
        match self.buffer()? {
            Some(b) => Ok(b.read(offset, out)?),
            None if out.is_empty() && offset == 0 => Ok(()),
            None => Err(RpcError::invalid_argument("read from an empty payload")),
        }
    }

    /// Reads several ranges, each an offset and the buffer it fills. Data
    /// on a memory server that has not been read yet is read in one
    /// pipelined batch of just those ranges (about one round trip: the
    /// rows a thumbnail samples, not the image); other data is copied
    /// range by range.
    pub fn read_ranges(&self, ranges: &mut [(u64, &mut [u8])]) -> Result<(), RpcError> {
        #[cfg(feature = "memserver")]
        if let Repr::Remote(r) = &self.repr {
            if let Some(done) = r.read_unfetched(ranges) {
                return done;
            }
        }
        for (off, buf) in ranges.iter_mut() {
            self.read(*off, buf)?;
        }
        Ok(())
    }

    /// A copy of the data.
    pub fn to_vec(&self) -> Result<Vec<u8>, RpcError> {
        Ok(self.bytes()?.into_owned())
    }

    /// Whether these are bytes in memory (whose way, inline or by Ref, is
    /// still open), not data in the pool or on a memory server.
    pub(crate) fn is_plain_bytes(&self) -> bool {
        matches!(self.repr, Repr::Bytes(_))
    }

    /// The same data, to pass on in another call without touching it: a
    /// payload that arrived by Ref forwards the Ref (no mapping, no copy),
    /// and inline bytes are shared (no copy either: each call they go
    /// out with copies them once, into its frame).
    /// A pool buffer (an answer, or one you built) is duplicated by sharing
    /// its pages (a Ref made, mapped and released: no copy, and the pages
    /// become copy-on-write). A memory-server buffer (one you built, or
    /// data you kept) is shared by its forwards: each call sends a Ref of
    /// it (one round trip to its server), and the buffer is written again
    /// only once its forwards are gone.
    pub fn forward(&self) -> Result<Payload, RpcError> {
        Ok(Payload {
            repr: match &self.repr {
                Repr::Empty => Repr::Empty,
                Repr::Bytes(v) => Repr::Bytes(v.clone()),
                Repr::Ref(r) => Repr::Ref(r.clone()),
                #[cfg(feature = "memserver")]
                Repr::Remote(r) => Repr::Remote(r.clone()),
                Repr::Buffer(b) => Repr::Buffer(b.pool().dup(b)?),
                #[cfg(feature = "memserver")]
                Repr::MemBuffer(m) => Repr::MemBuffer(m.clone()),
            },
        })
    }

    /// Keeps the data beyond the call that delivered it, whatever its
    /// kind: valid after the caller releases what it lent, and writable
    /// with [`write`](Self::write). A payload that arrived by Ref becomes a
    /// pool buffer with its own shares of the pages (copy-on-write, no
    /// copy); one that arrived as a memory server's Ref becomes a buffer of
    /// this node's on that server (likewise). Inline bytes are the
    /// payload's own already and stay as they are.
    pub fn keep(self) -> Result<Payload, RpcError> {
        match self.repr {
            Repr::Ref(_) => Ok(Payload::from_buffer(
                self.into_buffer()?
                    .ok_or_else(|| RpcError::internal("a pool payload without pages"))?,
            )),
            #[cfg(feature = "memserver")]
            Repr::Remote(r) => Ok(Payload::from_mem_buffer(r.keep()?)),
            repr => Ok(Payload { repr }),
        }
    }

    /// Writes `data` at `offset` into the payload's own data: inline bytes
    /// in place (copied first only if a forward shares them), pool and
    /// memory-server data copy-on-write (only the pages written are
    /// copied; the sender's and every other holder's stay as they were).
    /// Data that arrived by Ref is kept first ([`keep`](Self::keep)). The
    /// payload does not grow: the range must lie inside it.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), RpcError> {
        if self.as_ref_handle().is_some() {
            *self = std::mem::take(self).keep()?;
        }
        match &mut self.repr {
            Repr::Buffer(b) => Ok(b.write(offset, data)?),
            #[cfg(feature = "memserver")]
            Repr::MemBuffer(m) => Arc::get_mut(m)
                .ok_or_else(|| {
                    RpcError::invalid_argument(
                        "a memory-server buffer is written while a forward of it lives: write \
                         it before forwarding it",
                    )
                })?
                .write(offset, data),
            Repr::Bytes(b) => {
                dm_pool::check_range(offset, data.len() as u64, b.len() as u64)?;
                let at = offset as usize;
                let mut own = match std::mem::take(b).try_into_mut() {
                    Ok(m) => m,
                    Err(shared) => bytes::BytesMut::from(&shared[..]),
                };
                own[at..at + data.len()].copy_from_slice(data);
                *b = own.freeze();
                Ok(())
            }
            _ => Ok(dm_pool::check_range(offset, data.len() as u64, 0)?),
        }
    }

    /// The pool buffer of pool data: a buffer built in the pool, or the
    /// pages a Ref brought, with this holder's own shares (copy-on-write),
    /// valid after the caller releases its Ref. `Ok(None)` for inline or
    /// empty data.
    pub fn into_buffer(self) -> Result<Option<Buffer>, RpcError> {
        match self.repr {
            Repr::Buffer(b) => Ok(Some(b)),
            Repr::Ref(r) => match Arc::try_unwrap(r) {
                Ok(rec) => match rec.mapped.into_inner() {
                    Some(Ok(b)) => Ok(Some(b)),
                    Some(Err(e)) => Err(e),
                    None => Ok(Some(rec.pool.map_ref(&rec.r)?)),
                },
                Err(shared) => Ok(Some(shared.pool.map_ref(&shared.r)?)),
            },
            #[cfg(feature = "memserver")]
            Repr::MemBuffer(..) | Repr::Remote(_) => Err(RpcError::invalid_argument(
                "memory-server data is kept with keep_remote",
            )),
            _ => Ok(None),
        }
    }

    /// The data as [`Bytes`]: inline data as it is, and pool data whose
    /// pages are contiguous as a view of them that owns the payload (its
    /// mapping stays while any clone of the `Bytes` lives): no copy. Other
    /// data is copied.
    pub fn into_bytes(self) -> Result<Bytes, RpcError> {
        match self.repr {
            Repr::Bytes(b) => return Ok(b),
            Repr::Empty => return Ok(Bytes::new()),
            _ => {}
        }
        let one = match self.segments()?.as_slice() {
            [s] => Some((s.as_ptr(), s.len())),
            _ => None,
        };
        match one {
            Some((ptr, len)) => Ok(Bytes::from_owner(View {
                _payload: self,
                ptr,
                len,
            })),
            None => self.to_vec().map(Bytes::from),
        }
    }

    /// The data as an owned vector (no copy for inline data).
    pub fn into_vec(self) -> Result<Vec<u8>, RpcError> {
        match self.repr {
            Repr::Bytes(v) => Ok(Vec::from(v)),
            _ => self.to_vec(),
        }
    }

    /// Turns the payload into a frame body, putting data above `inline_max`
    /// in the pool (or on the memory servers). Returns what the body lends
    /// ([`Lent`]): the Ref the framework created, to release when the call
    /// completes (a forwarded Ref is not ours to release), or the payload
    /// it forwards. An answer's Ref belongs to the caller, who releases it:
    /// so an answer passes on a Ref it received only when that Ref is the
    /// request's own ([`Dir::Answer`]: the caller knows it and releases it
    /// once), and otherwise shares the data anew.
    ///
    /// `refs` says which Refs the peer can use: with neither the pool nor
    /// the memory servers in common, everything goes inline (by value),
    /// whatever its size.
    pub(crate) fn into_body(
        self,
        node: &Node,
        inline_max: usize,
        dir: Dir,
        refs: Sharing,
    ) -> Result<(Body, Lent), RpcError> {
        let len = self.len() as usize;
        if node.cfg.by_value {
            return self.by_value_body(inline_max);
        }
        if let (Repr::Ref(rec), Dir::Answer(echo), true) = (&self.repr, dir, refs.pool) {
            if echo == Some(rec.r) {
                // The request's own Ref, passed back as it came.
                let lent = Lent {
                    echo: true,
                    ..Lent::default()
                };
                return Ok((Body::Refs(vec![rec.r]), lent));
            }
            let kept = self.keep()?;
            return kept.into_body(node, inline_max, dir, refs);
        }
        #[cfg(feature = "memserver")]
        let remote = refs.remote && node.remote.is_some();
        #[cfg(feature = "memserver")]
        let answer = matches!(dir, Dir::Answer(_));
        Ok(match self.repr {
            Repr::Empty => (Body::None, Lent::default()),
            Repr::Bytes(v) => bytes_body(v, node, inline_max, refs)?,
            // The buffer becomes the Ref (its pages' shares move to the
            // Ref, none is counted), released when the call completes.
            Repr::Buffer(b) if len > inline_max && refs.pool => {
                let r = node.pool.into_ref(b)?;
                (Body::Refs(vec![r]), Lent::made(r))
            }
            Repr::Ref(rec) if refs.pool => (
                Body::Refs(vec![rec.r]),
                Lent {
                    forwarded: Some(rec),
                    ..Lent::default()
                },
            ),
            #[cfg(feature = "memserver")]
            Repr::MemBuffer(d) if len > inline_max && remote => {
                remote::buffer_body(node, d, len as u64)?
            }
            #[cfg(feature = "memserver")]
            Repr::Remote(rec) if remote && !answer => (Body::Refs(vec![rec.r]), Lent::default()),
            // An answer's Ref that came from further on, passed back: the
            // caller takes it over (no read, no copy), if it is this
            // payload's alone to give.
            #[cfg(feature = "memserver")]
            Repr::Remote(rec) if remote => match remote::hand_over(rec) {
                Ok(r) => (Body::Refs(vec![r]), Lent::made(r)),
                Err(rec) => {
                    let p = Payload {
                        repr: Repr::Remote(rec),
                    };
                    bytes_body(p.to_vec()?.into(), node, inline_max, refs)?
                }
            },
            _ => bytes_body(self.to_vec()?.into(), node, inline_max, refs)?,
        })
    }

    /// The payload inline, as a node that asked for by value sends it
    /// ([`Config::by_value`](crate::Config::by_value)), or an error that
    /// says what carries it when the connection's frames cannot.
    fn by_value_body(self, inline_max: usize) -> Result<(Body, Lent), RpcError> {
        let len = self.len();
        if len > inline_max as u64 {
            return Err(RpcError::resource_exhausted(format!(
                "a payload of {len} bytes is to travel by value (Config::by_value), and this \
                 connection carries at most {inline_max} bytes of it inline (shared memory \
                 64 MiB, in parts; TCP 16 MiB; in process 128 KiB): let large payloads travel \
                 by Ref (`by_value: false`), or send the data in smaller calls or a stream"
            )));
        }
        let body = match self.repr {
            Repr::Empty => Body::None,
            Repr::Bytes(v) => Body::Inline(v),
            _ => Body::Inline(self.to_vec()?.into()),
        };
        Ok((body, Lent::default()))
    }

    /// A received request body. A Ref stays unmapped until read.
    pub(crate) fn from_request_body(body: Body, node: &Node) -> Result<Payload, RpcError> {
        let pool = &node.pool;
        Ok(match body {
            Body::None => Payload::empty(),
            Body::Inline(v) => Payload::from_bytes(v),
            Body::Refs(rs) => {
                let [r] = rs.as_slice() else {
                    return Err(RpcError::invalid_argument(format!(
                        "{} Refs in one payload (this version takes one)",
                        rs.len()
                    )));
                };
                if r.backend == BACKEND_MEMSERVER {
                    return remote_request(node, r);
                }
                if r.pool_id != pool.id() {
                    return Err(RpcError::invalid_argument(format!(
                        "a Ref of pool {:#x}, not of this pool {:#x}",
                        r.pool_id,
                        pool.id()
                    )));
                }
                Payload {
                    repr: Repr::Ref(Arc::new(Received {
                        pool: pool.clone(),
                        r: *r,
                        mapped: OnceLock::new(),
                    })),
                }
            }
        })
    }

    /// A received response body: a Ref is mapped and released at once (the
    /// answer's Ref was made for this caller alone).
    pub(crate) fn from_response_body(body: Body, node: &Node) -> Result<Payload, RpcError> {
        let pool = &node.pool;
        Ok(match body {
            Body::Refs(rs) if rs.first().is_some_and(|r| r.backend == BACKEND_MEMSERVER) => {
                let [r] = rs.as_slice() else {
                    return Err(RpcError::internal(format!(
                        "an answer with {} Refs (this version sends one)",
                        rs.len()
                    )));
                };
                remote_answer(node, r)?
            }
            Body::Refs(rs) => {
                let mut first = None;
                for r in &rs {
                    let m = pool.map_ref(r);
                    let rel = pool.release_ref(r);
                    if first.is_none() {
                        first = Some(m.and_then(|b| rel.map(|()| b)));
                    }
                }
                match (first, rs.len()) {
                    (Some(b), 1) => Payload::from_buffer(b?),
                    (_, n) => {
                        return Err(RpcError::internal(format!(
                            "an answer with {n} Refs (this version sends one)"
                        )))
                    }
                }
            }
            other => Payload::from_request_body(other, node)?,
        })
    }
}

/// Bytes as a body: inline up to `inline_max`, else by a new Ref in the
/// pool (if the peer shares it) or on the memory servers (if it uses them),
/// else inline.
fn bytes_body(
    v: Bytes,
    node: &Node,
    inline_max: usize,
    refs: Sharing,
) -> Result<(Body, Lent), RpcError> {
    if v.is_empty() {
        return Ok((Body::None, Lent::default()));
    }
    if v.len() <= inline_max {
        return Ok((Body::Inline(v), Lent::default()));
    }
    if refs.pool {
        let pool: &Pool = &node.pool;
        let mut b = pool.alloc(v.len() as u64)?;
        b.write(0, &v)?;
        let r = pool.into_ref(b)?;
        return Ok((Body::Refs(vec![r]), Lent::made(r)));
    }
    #[cfg(feature = "memserver")]
    if let Some(put) = refs.remote.then(|| remote::bytes_body(node, &v)).flatten() {
        return put;
    }
    Ok((Body::Inline(v), Lent::default()))
}

/// A memory-server Ref in a build without memory servers: refused (a peer
/// that uses them never sends one here: the TCP hello says this node uses
/// none).
#[cfg(not(feature = "memserver"))]
fn remote_request(_: &Node, r: &Ref) -> Result<Payload, RpcError> {
    Err(RpcError::invalid_argument(format!(
        "a Ref of memory server {:#x}, and this build of dm-rpc has no memory-server support \
         (its `memserver` feature is off)",
        r.pool_id
    )))
}

#[cfg(not(feature = "memserver"))]
fn remote_answer(node: &Node, r: &Ref) -> Result<Payload, RpcError> {
    remote_request(node, r)
}

/// A payload's contiguous bytes, owned with it ([`Payload::into_bytes`]).
struct View {
    _payload: Payload,
    ptr: *const u8,
    len: usize,
}

// (What the impls below rely on.)
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Payload>();
};

// SAFETY: `ptr..ptr+len` is a mapping the payload keeps alive and that
// nobody writes while it is shared (pool pages are copy-on-write once
// shared; a buffer it owns is written only through `&mut` to it, which
// the view owns); the payload itself is Send and Sync.
unsafe impl Send for View {}
// SAFETY: as above: shared access only reads.
unsafe impl Sync for View {}

impl AsRef<[u8]> for View {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: see the Send impl: the range is mapped and unchanged for
        // as long as the view lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// Which way a body goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dir {
    /// A call's argument.
    Request,
    /// An answer, to a request that carried this pool Ref (if any).
    Answer(Option<Ref>),
}

/// What a body lends, kept by its sender until the call completes: the
/// Ref the framework made for it (released then; the buffer it was made
/// of became that Ref), or the received payload it forwards.
#[derive(Debug, Default)]
pub(crate) struct Lent {
    /// Boxed: a Ref is 40 bytes, and most calls (inline or empty) lend
    /// nothing; a call that makes a Ref pays far more than the allocation.
    made: Option<Box<Ref>>,
    forwarded: Option<Arc<Received>>,
    /// An answer's body is the request's own Ref, passed back (sent as an
    /// echo frame, [`FLAG_ECHO`]).
    echo: bool,
}

impl Lent {
    fn made(r: Ref) -> Lent {
        Lent {
            made: Some(Box::new(r)),
            ..Lent::default()
        }
    }

    /// The Ref the framework made, if any.
    pub(crate) fn made_ref(&self) -> Option<Ref> {
        self.made.as_deref().copied()
    }

    /// Whether the body is the request's own Ref passed back.
    pub(crate) fn is_echo(&self) -> bool {
        self.echo
    }

    /// Releases the Ref the framework made, if any.
    pub(crate) fn release(self, node: &Node) {
        if let Some(r) = self.made {
            let _ = node.release_ref(&r);
        }
    }

    /// The payload of a successful answer, and the end of the loan. An
    /// answer that passes back the pool Ref the request carried
    /// ([`FLAG_ECHO`]: a callee that answers with its argument, or a chain
    /// of callees passing it back) costs no new shares: the Ref we made is
    /// mapped before it is released (O(1), no page-table work), and a Ref
    /// we forwarded comes back as the payload we forwarded (valid as long
    /// as it is: until the call that delivered it to us completes). An
    /// echo of any other Ref is refused, and released by nobody.
    pub(crate) fn answer(self, node: &Node, flags: u16, body: Body) -> Result<Payload, RpcError> {
        if flags & FLAG_ECHO == 0 {
            self.release(node);
            return Payload::from_response_body(body, node);
        }
        let r = match &body {
            Body::Refs(rs) => rs.first().copied(),
            _ => None,
        };
        if let Some(f) = self.forwarded.as_ref().filter(|f| Some(f.r) == r) {
            return Ok(Payload {
                repr: Repr::Ref(f.clone()),
            });
        }
        match r.filter(|r| self.made_ref() == Some(*r) && r.backend != BACKEND_MEMSERVER) {
            Some(r) => {
                let b = node.pool.map_ref(&r);
                self.release(node);
                Ok(Payload::from_buffer(b?))
            }
            None => {
                self.release(node);
                Err(RpcError::internal(
                    "the answer passes back a Ref its request did not carry",
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_every_call_moves_stays_small() {
        // Every call moves a payload and a loan through a few frames of
        // its path; the rare kinds (a memory server's buffer, a Ref made
        // for the body) are boxed so that these stay a few words (they
        // were 128 and 104 bytes: `examples/noop_loop` under callgrind
        // ran 12% fewer instructions per call on the client after).
        assert!(std::mem::size_of::<Payload>() <= 48);
        assert!(std::mem::size_of::<Lent>() <= 24);
    }

    fn first_byte(p: &Payload) -> *const u8 {
        p.segments().unwrap()[0].as_ptr()
    }

    #[test]
    fn inline_bytes_are_forwarded_and_kept_without_a_copy() {
        let p = Payload::from_vec(vec![7u8; 1000]);
        let (a, b) = (p.forward().unwrap(), p.forward().unwrap());
        assert_eq!(first_byte(&a), first_byte(&p));
        assert_eq!(first_byte(&b), first_byte(&p));
        let kept = a.keep().unwrap();
        assert_eq!(first_byte(&kept), first_byte(&p));
        assert_eq!(kept.to_vec().unwrap(), vec![7u8; 1000]);
        // into_vec of the last holder takes the bytes as they are.
        drop((b, kept));
        let at = first_byte(&p);
        let v = p.into_vec().unwrap();
        assert_eq!(v.as_ptr(), at);
    }

    #[test]
    fn a_write_into_shared_inline_bytes_changes_only_the_writer() {
        let p = Payload::from_vec((0..100u8).collect());
        let mut w = p.forward().unwrap();
        w.write(10, &[0xEE; 5]).unwrap();
        assert_eq!(p.to_vec().unwrap(), (0..100u8).collect::<Vec<_>>());
        let mut want: Vec<u8> = (0..100u8).collect();
        want[10..15].fill(0xEE);
        assert_eq!(w.to_vec().unwrap(), want);
        // The sole holder writes in place.
        let at = first_byte(&w);
        w.write(0, &[1]).unwrap();
        assert_eq!(first_byte(&w), at);
        // Out of range: a typed error, nothing changed.
        let e = w.write(98, &[0; 3]).unwrap_err();
        assert_eq!(e.status, crate::Status::InvalidArgument, "{e}");
        assert_eq!(w.len(), 100);
        let mut empty = Payload::empty();
        assert!(empty.write(0, &[]).is_ok());
        assert!(empty.write(0, &[1]).is_err());
    }
}

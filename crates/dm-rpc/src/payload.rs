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
//!
//! A receiver reads through the same API whatever the choice: [`bytes`]
//! (borrowed when contiguous), [`segments`] (views of pool memory, no
//! copy), [`read`], [`to_vec`]. A request received by Ref is mapped on
//! first access, which is O(1) and involves no page-table work; a handler
//! that only forwards it ([`forward`]) never maps it. The Ref of a request
//! is valid until the caller's call completes: a handler that keeps the
//! data past its return calls [`keep`], which takes its own shares.
//!
//! [`bytes`]: Payload::bytes
//! [`segments`]: Payload::segments
//! [`read`]: Payload::read
//! [`to_vec`]: Payload::to_vec
//! [`forward`]: Payload::forward
//! [`keep`]: Payload::keep

use crate::error::RpcError;
use crate::frame::Body;
use dm_pool::{Buffer, Pool, Ref};
use std::borrow::Cow;
use std::sync::{Arc, OnceLock};

/// The data of a call or an answer.
#[derive(Debug, Default)]
pub struct Payload {
    repr: Repr,
}

#[derive(Debug, Default)]
enum Repr {
    #[default]
    Empty,
    Bytes(Vec<u8>),
    Buffer(Buffer),
    Ref(Arc<Received>),
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
        if v.is_empty() {
            return Payload::empty();
        }
        Payload {
            repr: Repr::Bytes(v),
        }
    }

    /// A buffer written in the pool: sent by Ref with no copy (or inline
    /// when it is small). The pages become copy-on-write for everyone.
    pub fn from_buffer(b: Buffer) -> Payload {
        Payload {
            repr: Repr::Buffer(b),
        }
    }

    /// Bytes of data.
    pub fn len(&self) -> u64 {
        match &self.repr {
            Repr::Empty => 0,
            Repr::Bytes(v) => v.len() as u64,
            Repr::Buffer(b) => b.len(),
            Repr::Ref(r) => r.r.len,
        }
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
        Ok(match (&self.repr, self.buffer()?) {
            (Repr::Bytes(v), _) => vec![v.as_slice()],
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
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), RpcError> {
        match (&self.repr, self.buffer()?) {
            (Repr::Bytes(v), _) => {
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
                Ok(())
            }
            (_, Some(b)) => Ok(b.read(offset, out)?),
            _ if out.is_empty() && offset == 0 => Ok(()),
            _ => Err(RpcError::invalid_argument("read from an empty payload")),
        }
    }

    /// A copy of the data.
    pub fn to_vec(&self) -> Result<Vec<u8>, RpcError> {
        Ok(self.bytes()?.into_owned())
    }

    /// The same data, to pass on in another call without touching it: a
    /// payload that arrived by Ref forwards the Ref (no mapping, no copy).
    /// Only received payloads and inline bytes can be forwarded while kept;
    /// a buffer you built is sent by moving the payload itself.
    pub fn forward(&self) -> Result<Payload, RpcError> {
        Ok(Payload {
            repr: match &self.repr {
                Repr::Empty => Repr::Empty,
                Repr::Bytes(v) => Repr::Bytes(v.clone()),
                Repr::Ref(r) => Repr::Ref(r.clone()),
                Repr::Buffer(_) => {
                    return Err(RpcError::invalid_argument(
                        "a buffer payload is forwarded by moving it into the call",
                    ))
                }
            },
        })
    }

    /// Keeps pool data beyond the call that delivered it: a buffer with its
    /// own shares of the pages (copy-on-write), valid after the caller
    /// releases its Ref. `Ok(None)` for inline or empty data (use
    /// [`into_vec`](Self::into_vec)).
    pub fn keep(self) -> Result<Option<Buffer>, RpcError> {
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
            _ => Ok(None),
        }
    }

    /// The data as an owned vector (no copy for inline data).
    pub fn into_vec(self) -> Result<Vec<u8>, RpcError> {
        match self.repr {
            Repr::Bytes(v) => Ok(v),
            _ => self.to_vec(),
        }
    }

    /// Turns the payload into a frame body, putting data above `inline_max`
    /// in the pool. Returns the Ref the framework created, to release when
    /// the call completes (a forwarded Ref is not ours to release). An
    /// answer's Ref belongs to the caller, who releases it: so an answer
    /// never passes on a Ref it received, but shares the data anew.
    ///
    /// `refs` says whether the peer shares the pool: if not, everything goes
    /// inline (by value), whatever its size.
    pub(crate) fn into_body(
        self,
        pool: &Pool,
        inline_max: usize,
        answer: bool,
        refs: bool,
    ) -> Result<(Body, Option<Ref>), RpcError> {
        let len = self.len();
        if !refs {
            return Ok(match self.repr {
                Repr::Empty => (Body::None, None),
                Repr::Bytes(v) => (Body::Inline(v), None),
                _ => (Body::Inline(self.to_vec()?), None),
            });
        }
        if answer && matches!(self.repr, Repr::Ref(_)) {
            let kept = self
                .keep()?
                .map_or_else(Payload::empty, Payload::from_buffer);
            return kept.into_body(pool, inline_max, answer, refs);
        }
        Ok(match self.repr {
            Repr::Empty => (Body::None, None),
            Repr::Bytes(v) if v.len() <= inline_max => (Body::Inline(v), None),
            Repr::Bytes(v) => {
                let mut b = pool.alloc(v.len() as u64)?;
                b.write(0, &v)?;
                let r = b.share()?;
                pool.free(b)?;
                (Body::Refs(vec![r]), Some(r))
            }
            Repr::Buffer(b) if len as usize <= inline_max => (Body::Inline(b.to_vec()?), None),
            Repr::Buffer(b) => {
                let r = b.share()?;
                pool.free(b)?;
                (Body::Refs(vec![r]), Some(r))
            }
            Repr::Ref(rec) => (Body::Refs(vec![rec.r]), None),
        })
    }

    /// A received request body. A Ref stays unmapped until read.
    pub(crate) fn from_request_body(body: Body, pool: &Pool) -> Result<Payload, RpcError> {
        Ok(match body {
            Body::None => Payload::empty(),
            Body::Inline(v) => Payload::from_vec(v),
            Body::Refs(rs) => {
                let [r] = rs.as_slice() else {
                    return Err(RpcError::invalid_argument(format!(
                        "{} Refs in one payload (this version takes one)",
                        rs.len()
                    )));
                };
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
    pub(crate) fn from_response_body(body: Body, pool: &Pool) -> Result<Payload, RpcError> {
        Ok(match body {
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
            other => Payload::from_request_body(other, pool)?,
        })
    }
}

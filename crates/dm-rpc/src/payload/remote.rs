//! Payloads on memory servers (DmRPC-net), built only with the
//! `memserver` feature: a buffer the sender wrote on a server, and a
//! server's Ref that arrived. Both are read through [`Payload`]'s API like
//! any other payload.
//!
//! [`Payload`]: super::Payload

use super::{Lent, Payload, Repr};
use crate::error::RpcError;
use crate::frame::Body;
use crate::node::Node;
use dm_memserver::{MemBuffer, MemPool};
use dm_pool::{Dm, DmBuffer, Ref};
use std::sync::{Arc, OnceLock};

/// A buffer on a memory server, and its bytes once read.
#[derive(Debug)]
pub(super) struct MemData {
    pub(super) buf: MemBuffer,
    bytes: OnceLock<Result<Vec<u8>, RpcError>>,
}

impl MemData {
    pub(super) fn new(buf: MemBuffer) -> MemData {
        MemData {
            buf,
            bytes: OnceLock::new(),
        }
    }

    pub(super) fn len(&self) -> u64 {
        DmBuffer::len(&self.buf)
    }

    /// The bytes, read from the server once.
    pub(super) fn bytes(&self) -> &Result<Vec<u8>, RpcError> {
        self.bytes.get_or_init(|| Ok(self.buf.to_vec()?))
    }

    /// Writes into the buffer on the server (copy-on-write there), and
    /// forgets the bytes read before.
    pub(super) fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), RpcError> {
        self.bytes = OnceLock::new();
        Ok(self.buf.write(offset, data)?)
    }
}

/// A payload that arrived as a memory server's Ref: read from the server
/// on first access (one `read_ref`, through the client's page cache),
/// then kept here.
#[derive(Debug)]
pub(super) struct RemoteReceived {
    pool: MemPool,
    pub(super) r: Ref,
    data: OnceLock<Result<Vec<u8>, RpcError>>,
    /// The Ref is ours to release when the payload goes (an answer's Ref,
    /// made for this caller); a request's belongs to the caller.
    owned: bool,
}

impl Drop for RemoteReceived {
    fn drop(&mut self) {
        if self.owned {
            let _ = self.pool.release_ref_nowait(&self.r);
        }
    }
}

impl RemoteReceived {
    /// The bytes, read from the server once.
    pub(super) fn bytes(&self) -> &Result<Vec<u8>, RpcError> {
        self.data.get_or_init(|| {
            let mut v = vec![0u8; self.r.len as usize];
            self.pool.read_ref(&self.r, 0, &mut v)?;
            Ok(v)
        })
    }

    /// Reads the ranges straight from the server if the whole has not been
    /// read yet (`None` otherwise: read from what was).
    pub(super) fn read_unfetched(
        &self,
        ranges: &mut [(u64, &mut [u8])],
    ) -> Option<Result<(), RpcError>> {
        if self.data.get().is_some() {
            return None;
        }
        Some(
            match ranges {
                [(off, out)] => self.pool.read_ref(&self.r, *off, out),
                _ => self.pool.read_ref_ranges(&self.r, ranges),
            }
            .map_err(RpcError::from),
        )
    }

    /// A buffer of this node's on the server with its own shares of the
    /// data (copy-on-write).
    pub(super) fn keep(&self) -> Result<MemBuffer, RpcError> {
        Ok(self.pool.map_ref(&self.r)?)
    }
}

impl Payload {
    /// A buffer written on a memory server: sent by its Ref to peers that
    /// use the same servers (inline when small, or to others).
    pub fn from_mem_buffer(b: MemBuffer) -> Payload {
        Payload {
            repr: Repr::MemBuffer(Arc::new(MemData::new(b))),
        }
    }

    /// Keeps memory-server data beyond the call that delivered it: a
    /// buffer of this node's on the server, with its own shares (CoW).
    /// `Ok(None)` for data that is not on a memory server.
    pub fn keep_remote(self) -> Result<Option<MemBuffer>, RpcError> {
        match self.repr {
            Repr::MemBuffer(m) => match Arc::try_unwrap(m) {
                Ok(d) => Ok(Some(d.buf)),
                // Forwards of it live: a buffer of its own, sharing the
                // pages (copy-on-write).
                Err(shared) => {
                    let p = shared.buf.pool();
                    let r = p.create_ref(&shared.buf, 0, shared.len())?;
                    let m = p.map_ref(&r);
                    p.release_ref_nowait(&r)?;
                    Ok(Some(m?))
                }
            },
            Repr::Remote(r) => Ok(Some(r.keep()?)),
            _ => Ok(None),
        }
    }
}

/// The memory servers `node` uses, or a clear error naming what came.
fn servers<'n>(node: &'n Node, what: &str) -> Result<&'n MemPool, RpcError> {
    node.remote
        .as_ref()
        .ok_or_else(|| RpcError::internal(format!("{what}, and this node uses no memory server")))
}

/// A received request's memory-server Ref: read from the server on first
/// access; the Ref stays the caller's.
pub(super) fn request(node: &Node, r: &Ref) -> Result<Payload, RpcError> {
    let m = node
        .remote
        .as_ref()
        .filter(|m| m.server_ids().contains(&r.pool_id))
        .ok_or_else(|| {
            RpcError::invalid_argument(format!(
                "a Ref of memory server {:#x}, which this node does not use",
                r.pool_id
            ))
        })?;
    received(m, r, false)
}

/// A received answer's memory-server Ref: made for this caller alone, read
/// on first access, released when the payload goes.
pub(super) fn answer(node: &Node, r: &Ref) -> Result<Payload, RpcError> {
    received(servers(node, "a memory-server Ref")?, r, true)
}

fn received(m: &MemPool, r: &Ref, owned: bool) -> Result<Payload, RpcError> {
    // A peer's Ref: checked before its length sizes anything.
    m.check_ref(r)?;
    Ok(Payload {
        repr: Repr::Remote(Arc::new(RemoteReceived {
            pool: m.clone(),
            r: *r,
            data: OnceLock::new(),
            owned,
        })),
    })
}

/// The Ref of `rec` to hand over to another holder (an answer passed
/// back to its caller), if `rec` held it alone and was to release it:
/// it will not now. Otherwise `rec` back.
pub(super) fn hand_over(rec: Arc<RemoteReceived>) -> Result<Ref, Arc<RemoteReceived>> {
    match Arc::try_unwrap(rec) {
        Ok(mut rr) if rr.owned => {
            rr.owned = false;
            Ok(rr.r)
        }
        Ok(rr) => Err(Arc::new(rr)),
        Err(shared) => Err(shared),
    }
}

/// A memory-server buffer as a body: a Ref of `len` bytes of it, released
/// when the call completes (an answer's, by its caller). The buffer is
/// freed (the Ref holds the pages) unless forwards of it live.
pub(super) fn buffer_body(
    node: &Node,
    d: Arc<MemData>,
    len: u64,
) -> Result<(Body, Lent), RpcError> {
    let m = servers(node, "a memory-server buffer")?;
    let r = m.create_ref(&d.buf, 0, len)?;
    if let Ok(d) = Arc::try_unwrap(d) {
        m.free(d.buf)?;
    }
    Ok((Body::Refs(vec![r]), Lent::made(r)))
}

/// Bytes put on the memory servers as a body, if the node uses any.
pub(super) fn bytes_body(node: &Node, v: &[u8]) -> Option<Result<(Body, Lent), RpcError>> {
    let m = node.remote.as_ref()?;
    Some(
        m.put(v, std::time::Duration::ZERO)
            .map(|r| (Body::Refs(vec![r]), Lent::made(r)))
            .map_err(RpcError::from),
    )
}

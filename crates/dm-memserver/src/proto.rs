//! The memory-server wire protocol, version 1.
//!
//! Every message is a frame: a `u32` length (of what follows, at most
//! [`MAX_FRAME`]), then a 12-byte header and a body. All integers
//! little-endian.
//!
//! ```text
//! request:  len u32 | version u8 | op u8     | reserved u16 (0) | id u64 | body
//! response: len u32 | version u8 | status u8 | reserved u16 (0) | id u64 | body
//! ```
//!
//! | op | request body | answer body |
//! |---|---|---|
//! | 1 hello | lease_ms u32 [, nonce 16 bytes] | server_id u64, page_size u32, max_len u64 [, auth u8, nonce 16 bytes, proof 32 bytes, admin proof 32 bytes] |
//! | 2 alloc | len u64 | addr u64 |
//! | 3 free | addr u64 | — |
//! | 4 read | addr u64, offset u64, len u32 | the bytes |
//! | 5 write | addr u64, offset u64, data (the rest) | — |
//! | 6 create_ref | addr u64, offset u64, len u64, ttl_ms u32 (0: default) | Ref (40 bytes) |
//! | 7 map_ref | Ref (40 bytes) | addr u64, len u64 |
//! | 8 release_ref | Ref (40 bytes) | — |
//! | 9 usage | — | pages_held, pages_shared, refs, pages_free (u64 each) |
//! | 10 check | — | problems, UTF-8, one per line |
//! | 11 ping | — | — |
//! | 12 maintain | — | — |
//! | 13 put | ttl_ms u32 (0: default), data (the rest) | Ref (40 bytes) |
//! | 14 read_ref | Ref (40 bytes), offset u64, len u32 | the bytes |
//! | 15 auth | role u8 (1 client, 2 admin), proof 32 bytes | — |
//! | 16 stream_put | ttl_ms u32 (0: default), data (the rest) | Ref (40 bytes), answered before the data has arrived |
//!
//! `put` is alloc + write + create_ref + free in one request (a sender's
//! by-Ref argument in one round trip); `read_ref` reads a Ref's snapshot
//! without mapping it (a receiver's read in one round trip). Both were
//! added within version 1: a server without them answers "unknown
//! operation".
//!
//! `stream_put` (also within version 1) is a `put` whose answer does not
//! wait for its data. The server answers the Ref as soon as it has read
//! the request's head and taken the pages, then receives the data
//! straight into them. So the sender passes the Ref on while its bytes
//! are still on the wire. Until the last byte has arrived the Ref is
//! *filling*: a `read_ref` waits for the bytes of its range, a `map_ref`
//! for all of them. If the sender's connection ends first, the Ref is
//! released and those waiting get `Unavailable`. A server that decodes a
//! whole `stream_put` frame at once (never over TCP) treats it as a
//! `put`.
//!
//! Authentication (also within version 1) is the challenge of
//! [`dm_pool::auth`]. A client that sends a nonce in its hello gets the
//! server's in the answer, with `auth` flags (bit 0: the server wants a
//! client key, bit 1: it has an admin key) and the server's proofs (role
//! `S` under its client key, role `T` under its admin key; zeros for a key
//! it does not have). The client checks the proof of the key it holds,
//! then proves itself with `auth` (role `C` under the client key, `A`
//! under the admin key; the admin key admits as a client too). Until then a server with a client key
//! answers every request but `hello`, `auth` and `ping` with
//! `Unauthenticated`; `check` and `maintain` need the admin key, or, on a
//! server without one, a client on the server's own host
//! (`PermissionDenied`). A hello without a nonce gets the short answer,
//! as before.
//!
//! A request's `id` is the client's; the answer carries it back (a client
//! pipelines many requests on one connection; a connection's answers come
//! in request order). Status 0 is success; any other status is an error
//! ([`ErrorCode`]) whose body is three `u64` fields and a UTF-8 message,
//! from which the client rebuilds the same typed [`dm_pool::Error`] the
//! pool backend returns. The decoders never panic (fuzz target
//! `memserver_request`).

use dm_pool::auth::{NONCE_LEN, PROOF_LEN};
use dm_pool::{Error, Ref};
use std::borrow::Cow;

/// Protocol version.
pub const VERSION: u8 = 1;
/// Header bytes after the length prefix.
pub const HEADER: usize = 12;
/// Largest frame (after the length prefix): 16 MiB of data plus headers.
pub const MAX_FRAME: usize = (16 << 20) + 64;
/// Largest read or write in one request.
pub const MAX_IO: usize = 16 << 20;

/// A request. Its data (of a write or a put) is borrowed from the frame it
/// was decoded from, or from the caller's slice it will be encoded from:
/// no copy on either side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request<'a> {
    /// Opens a session with a lease.
    Hello {
        /// The client's lease: silence longer than this ends the session.
        lease_ms: u32,
        /// The client's challenge (none: the client does not authenticate).
        nonce: Option<[u8; NONCE_LEN]>,
    },
    /// A zero-filled buffer.
    Alloc {
        /// Bytes.
        len: u64,
    },
    /// Frees a buffer.
    Free {
        /// Its address.
        addr: u64,
    },
    /// Reads bytes.
    Read {
        /// Buffer address.
        addr: u64,
        /// Offset in the buffer.
        offset: u64,
        /// Bytes (at most [`MAX_IO`]).
        len: u32,
    },
    /// Writes bytes (CoW on shared pages).
    Write {
        /// Buffer address.
        addr: u64,
        /// Offset in the buffer.
        offset: u64,
        /// The bytes.
        data: Cow<'a, [u8]>,
    },
    /// A Ref to a range of a buffer.
    CreateRef {
        /// Buffer address.
        addr: u64,
        /// Offset in the buffer.
        offset: u64,
        /// Bytes.
        len: u64,
        /// Time to live in ms (0: the server's default).
        ttl_ms: u32,
    },
    /// Maps a Ref as a new buffer.
    MapRef(Ref),
    /// Releases a Ref.
    ReleaseRef(Ref),
    /// The server's page counts.
    Usage,
    /// The server's invariant check.
    Check,
    /// Keeps the session alive.
    Ping,
    /// Reclaims expired Refs now.
    Maintain,
    /// Stores `data` as a new Ref's snapshot.
    Put {
        /// Time to live in ms (0: the server's default).
        ttl_ms: u32,
        /// The bytes.
        data: Cow<'a, [u8]>,
    },
    /// Reads a Ref's snapshot.
    ReadRef {
        /// The Ref.
        r: Ref,
        /// Offset in the snapshot.
        offset: u64,
        /// Bytes (at most [`MAX_IO`]).
        len: u32,
    },
    /// Stores `data` as a new Ref's snapshot, answering the Ref before
    /// the data has arrived (see the module docs).
    StreamPut {
        /// Time to live in ms (0: the server's default).
        ttl_ms: u32,
        /// The bytes.
        data: Cow<'a, [u8]>,
    },
    /// Proves the client holds a key ([`ROLE_CLIENT`] or [`ROLE_ADMIN`]).
    Auth {
        /// Which key.
        role: u8,
        /// HMAC of both nonces under it.
        proof: [u8; PROOF_LEN],
    },
}

/// `auth` role: the client key.
pub const ROLE_CLIENT: u8 = 1;
/// `auth` role: the admin key.
pub const ROLE_ADMIN: u8 = 2;
/// The context of this protocol's proofs.
pub const AUTH_CONTEXT: &[u8] = b"dmrpc-memserver-v1";
/// Hello-answer flag: the server wants a client key.
pub const AUTH_NEEDS_KEY: u8 = 1;
/// Hello-answer flag: the server has an admin key.
pub const AUTH_HAS_ADMIN: u8 = 2;

/// What a server says in its hello answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloAnswer {
    /// The server's id (in its Refs).
    pub server_id: u64,
    /// Its page size.
    pub page_size: u32,
    /// Its largest buffer.
    pub max_len: u64,
    /// Its side of the challenge, if the client sent a nonce.
    pub auth: Option<AuthOffer>,
}

/// The server's side of the challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthOffer {
    /// [`AUTH_NEEDS_KEY`], [`AUTH_HAS_ADMIN`].
    pub flags: u8,
    /// The server's nonce.
    pub nonce: [u8; NONCE_LEN],
    /// The server's proof under its client key (zeros if it has none).
    pub proof: [u8; PROOF_LEN],
    /// The server's proof under its admin key (zeros if it has none).
    pub admin_proof: [u8; PROOF_LEN],
}

/// Operation codes.
pub mod op_code {
    pub const HELLO: u8 = 1;
    pub const ALLOC: u8 = 2;
    pub const FREE: u8 = 3;
    pub const READ: u8 = 4;
    pub const WRITE: u8 = 5;
    pub const CREATE_REF: u8 = 6;
    pub const MAP_REF: u8 = 7;
    pub const RELEASE_REF: u8 = 8;
    pub const USAGE: u8 = 9;
    pub const CHECK: u8 = 10;
    pub const PING: u8 = 11;
    pub const MAINTAIN: u8 = 12;
    pub const PUT: u8 = 13;
    pub const READ_REF: u8 = 14;
    pub const AUTH: u8 = 15;
    pub const STREAM_PUT: u8 = 16;
}

/// Number of operation codes (for per-op counters), index = op - 1.
pub const OPS: usize = 16;

/// Names of the operations, index = op - 1.
pub const OP_NAMES: [&str; OPS] = [
    "hello",
    "alloc",
    "free",
    "read",
    "write",
    "create_ref",
    "map_ref",
    "release_ref",
    "usage",
    "check",
    "ping",
    "maintain",
    "put",
    "read_ref",
    "auth",
    "stream_put",
];

/// Bytes of a `stream_put` frame before its data: the header and the TTL.
pub const STREAM_PUT_HEAD: usize = HEADER + 4;

/// The id and TTL of a `stream_put` whose first [`STREAM_PUT_HEAD`]
/// bytes (after the length prefix) are `head`; `None` for any other
/// request, or a head that is not valid (then the whole frame is read and
/// decoded as usual, which reports it).
pub fn stream_put_head(head: &[u8]) -> Option<(u64, u32)> {
    if head.len() != STREAM_PUT_HEAD {
        return None;
    }
    let (code, id, mut r) = header(head).ok()?;
    (code == op_code::STREAM_PUT).then_some(())?;
    Some((id, r.u32().ok()?))
}

/// Bytes of a `write` frame before its data: the header, the buffer's
/// address and the offset in it.
pub const WRITE_HEAD: usize = HEADER + 16;

/// The id, address and offset of a `write` whose first [`WRITE_HEAD`]
/// bytes (after the length prefix) are `head`; `None` for any other
/// request or a head that is not valid (as [`stream_put_head`]).
pub fn write_head(head: &[u8]) -> Option<(u64, u64, u64)> {
    if head.len() != WRITE_HEAD {
        return None;
    }
    let (code, id, mut r) = header(head).ok()?;
    (code == op_code::WRITE).then_some(())?;
    Some((id, r.u64().ok()?, r.u64().ok()?))
}

/// Why bytes are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// Fewer bytes than the header or the operation needs.
    #[error("truncated frame: {need} bytes needed, {got} given")]
    Truncated {
        /// Needed.
        need: usize,
        /// Given.
        got: usize,
    },
    /// Bytes after the operation's body.
    #[error("{0} trailing bytes after the body")]
    Trailing(usize),
    /// A frame longer than [`MAX_FRAME`].
    #[error("frame of {0} bytes exceeds the maximum {MAX_FRAME}")]
    TooLong(usize),
    /// Another protocol version.
    #[error("protocol version {0} (this build speaks {VERSION})")]
    Version(u8),
    /// Reserved bits set.
    #[error("reserved header bits are not zero")]
    Reserved,
    /// Unknown operation.
    #[error("unknown operation {0}")]
    Op(u8),
    /// A read longer than [`MAX_IO`].
    #[error("read of {0} bytes exceeds the maximum {MAX_IO}")]
    ReadTooLong(u32),
    /// A malformed Ref.
    #[error("malformed Ref: {0}")]
    Ref(#[from] dm_pool::RefDecodeError),
    /// An unknown status code in an answer.
    #[error("unknown status {0}")]
    Status(u8),
}

/// A little-endian reader that reports truncation instead of panicking.
struct Rd<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Rd<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ProtoError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let Some(end) = end else {
            return Err(ProtoError::Truncated {
                need: self.at.saturating_add(n),
                got: self.b.len(),
            });
        };
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, ProtoError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }

    fn u64(&mut self) -> Result<u64, ProtoError> {
        let s = self.take(8)?;
        let mut x = [0u8; 8];
        x.copy_from_slice(s);
        Ok(u64::from_le_bytes(x))
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], ProtoError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn reference(&mut self) -> Result<Ref, ProtoError> {
        Ok(Ref::from_bytes(self.take(Ref::SIZE)?)?)
    }

    fn rest(&mut self) -> &'a [u8] {
        let s = &self.b[self.at..];
        self.at = self.b.len();
        s
    }

    fn end(&self) -> Result<(), ProtoError> {
        match self.b.len() - self.at {
            0 => Ok(()),
            n => Err(ProtoError::Trailing(n)),
        }
    }
}

/// Reads the header of a frame (without its length prefix): the code
/// (op or status), the id and the body.
fn header(frame: &[u8]) -> Result<(u8, u64, Rd<'_>), ProtoError> {
    if frame.len() > MAX_FRAME {
        return Err(ProtoError::TooLong(frame.len()));
    }
    let mut r = Rd { b: frame, at: 0 };
    let h = r.take(4)?;
    if h[0] != VERSION {
        return Err(ProtoError::Version(h[0]));
    }
    if h[2] != 0 || h[3] != 0 {
        return Err(ProtoError::Reserved);
    }
    let id = r.u64()?;
    Ok((h[1], id, r))
}

/// Starts a frame: the length prefix (patched by [`finish`]) and header.
fn start(out: &mut Vec<u8>, code: u8, id: u64) -> usize {
    let at = out.len();
    out.extend_from_slice(&[0u8; 4]);
    out.extend_from_slice(&[VERSION, code, 0, 0]);
    out.extend_from_slice(&id.to_le_bytes());
    at
}

fn finish(out: &mut [u8], at: usize) {
    finish_with(out, at, 0);
}

/// Writes the length prefix of the frame at `at`, counting `more` bytes
/// that follow `out` on the wire.
fn finish_with(out: &mut [u8], at: usize, more: usize) {
    let len = (out.len() - at - 4 + more) as u32;
    out[at..at + 4].copy_from_slice(&len.to_le_bytes());
}

impl<'a> Request<'a> {
    /// The same request, owning its data.
    pub fn into_owned(self) -> Request<'static> {
        match self {
            Request::Write { addr, offset, data } => Request::Write {
                addr,
                offset,
                data: Cow::Owned(data.into_owned()),
            },
            Request::Put { ttl_ms, data } => Request::Put {
                ttl_ms,
                data: Cow::Owned(data.into_owned()),
            },
            Request::StreamPut { ttl_ms, data } => Request::StreamPut {
                ttl_ms,
                data: Cow::Owned(data.into_owned()),
            },
            Request::Hello { lease_ms, nonce } => Request::Hello { lease_ms, nonce },
            Request::Auth { role, proof } => Request::Auth { role, proof },
            Request::Alloc { len } => Request::Alloc { len },
            Request::Free { addr } => Request::Free { addr },
            Request::Read { addr, offset, len } => Request::Read { addr, offset, len },
            Request::CreateRef {
                addr,
                offset,
                len,
                ttl_ms,
            } => Request::CreateRef {
                addr,
                offset,
                len,
                ttl_ms,
            },
            Request::MapRef(r) => Request::MapRef(r),
            Request::ReleaseRef(r) => Request::ReleaseRef(r),
            Request::Usage => Request::Usage,
            Request::Check => Request::Check,
            Request::Ping => Request::Ping,
            Request::Maintain => Request::Maintain,
            Request::ReadRef { r, offset, len } => Request::ReadRef { r, offset, len },
        }
    }

    /// The operation code.
    pub fn op(&self) -> u8 {
        match self {
            Request::Hello { .. } => op_code::HELLO,
            Request::Alloc { .. } => op_code::ALLOC,
            Request::Free { .. } => op_code::FREE,
            Request::Read { .. } => op_code::READ,
            Request::Write { .. } => op_code::WRITE,
            Request::CreateRef { .. } => op_code::CREATE_REF,
            Request::MapRef(_) => op_code::MAP_REF,
            Request::ReleaseRef(_) => op_code::RELEASE_REF,
            Request::Usage => op_code::USAGE,
            Request::Check => op_code::CHECK,
            Request::Ping => op_code::PING,
            Request::Maintain => op_code::MAINTAIN,
            Request::Put { .. } => op_code::PUT,
            Request::ReadRef { .. } => op_code::READ_REF,
            Request::Auth { .. } => op_code::AUTH,
            Request::StreamPut { .. } => op_code::STREAM_PUT,
        }
    }

    /// Appends the frame of this request (with its length prefix).
    pub fn encode(&self, id: u64, out: &mut Vec<u8>) {
        let at = start(out, self.op(), id);
        match self {
            Request::Hello { lease_ms, nonce } => {
                out.extend_from_slice(&lease_ms.to_le_bytes());
                if let Some(n) = nonce {
                    out.extend_from_slice(n);
                }
            }
            Request::Auth { role, proof } => {
                out.push(*role);
                out.extend_from_slice(proof);
            }
            Request::Alloc { len } => out.extend_from_slice(&len.to_le_bytes()),
            Request::Free { addr } => out.extend_from_slice(&addr.to_le_bytes()),
            Request::Read { addr, offset, len } => {
                out.extend_from_slice(&addr.to_le_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
            }
            Request::Write { addr, offset, data } => {
                out.extend_from_slice(&addr.to_le_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
                out.extend_from_slice(data);
            }
            Request::CreateRef {
                addr,
                offset,
                len,
                ttl_ms,
            } => {
                out.extend_from_slice(&addr.to_le_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
                out.extend_from_slice(&ttl_ms.to_le_bytes());
            }
            Request::MapRef(r) | Request::ReleaseRef(r) => out.extend_from_slice(&r.to_bytes()),
            Request::Usage | Request::Check | Request::Ping | Request::Maintain => {}
            Request::Put { ttl_ms, data } | Request::StreamPut { ttl_ms, data } => {
                out.extend_from_slice(&ttl_ms.to_le_bytes());
                out.extend_from_slice(data);
            }
            Request::ReadRef { r, offset, len } => {
                out.extend_from_slice(&r.to_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
            }
        }
        finish(out, at);
    }

    /// Appends the frame of this request but for the data that ends a
    /// write or a put, and returns that data (empty for other requests):
    /// `out`'s new bytes followed by the data are exactly what
    /// [`encode`](Self::encode) appends, so a sender can write both with
    /// one vectored write instead of copying the data first.
    pub fn encode_head(&self, id: u64, out: &mut Vec<u8>) -> &[u8] {
        let at = out.len();
        let data: &[u8] = match self {
            Request::Write { addr, offset, data } => {
                start(out, self.op(), id);
                out.extend_from_slice(&addr.to_le_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
                data
            }
            Request::Put { ttl_ms, data } | Request::StreamPut { ttl_ms, data } => {
                start(out, self.op(), id);
                out.extend_from_slice(&ttl_ms.to_le_bytes());
                data
            }
            _ => {
                self.encode(id, out);
                return &[];
            }
        };
        finish_with(out, at, data.len());
        data
    }

    /// Decodes a request frame (without its length prefix): its id and the
    /// request. Never panics; an error carries the id when the header was
    /// readable, so the answer can name the request.
    pub fn decode(frame: &'a [u8]) -> Result<(u64, Request<'a>), (Option<u64>, ProtoError)> {
        let (code, id, mut r) = header(frame).map_err(|e| (None, e))?;
        let req = (|| {
            let req = match code {
                op_code::HELLO => Request::Hello {
                    lease_ms: r.u32()?,
                    nonce: match r.b.len() - r.at {
                        0 => None,
                        _ => Some(r.array()?),
                    },
                },
                op_code::AUTH => Request::Auth {
                    role: r.take(1)?[0],
                    proof: r.array()?,
                },
                op_code::ALLOC => Request::Alloc { len: r.u64()? },
                op_code::FREE => Request::Free { addr: r.u64()? },
                op_code::READ => {
                    let (addr, offset, len) = (r.u64()?, r.u64()?, r.u32()?);
                    if len as usize > MAX_IO {
                        return Err(ProtoError::ReadTooLong(len));
                    }
                    Request::Read { addr, offset, len }
                }
                op_code::WRITE => Request::Write {
                    addr: r.u64()?,
                    offset: r.u64()?,
                    data: Cow::Borrowed(r.rest()),
                },
                op_code::CREATE_REF => Request::CreateRef {
                    addr: r.u64()?,
                    offset: r.u64()?,
                    len: r.u64()?,
                    ttl_ms: r.u32()?,
                },
                op_code::MAP_REF => Request::MapRef(r.reference()?),
                op_code::RELEASE_REF => Request::ReleaseRef(r.reference()?),
                op_code::USAGE => Request::Usage,
                op_code::CHECK => Request::Check,
                op_code::PING => Request::Ping,
                op_code::MAINTAIN => Request::Maintain,
                op_code::PUT => Request::Put {
                    ttl_ms: r.u32()?,
                    data: Cow::Borrowed(r.rest()),
                },
                op_code::STREAM_PUT => Request::StreamPut {
                    ttl_ms: r.u32()?,
                    data: Cow::Borrowed(r.rest()),
                },
                op_code::READ_REF => {
                    let (rf, offset, len) = (r.reference()?, r.u64()?, r.u32()?);
                    if len as usize > MAX_IO {
                        return Err(ProtoError::ReadTooLong(len));
                    }
                    Request::ReadRef { r: rf, offset, len }
                }
                other => return Err(ProtoError::Op(other)),
            };
            r.end()?;
            Ok(req)
        })()
        .map_err(|e| (Some(id), e))?;
        Ok((id, req))
    }
}

/// Error codes of answers (status byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ErrorCode {
    /// `Error::ZeroLength`.
    ZeroLength = 1,
    /// `Error::TooLarge { len, max }`.
    TooLarge = 2,
    /// `Error::OutOfBounds { offset, len, size }`.
    OutOfBounds = 3,
    /// `Error::ResourceExhausted { what }` (field 0: 0 pages, 1 refs, 2
    /// buffers, 3 the region reserved by allocated buffers, 4 sessions;
    /// an older client reads 3 and 4 as pages).
    Exhausted = 4,
    /// `Error::DoubleFree { desc, generation }`.
    DoubleFree = 5,
    /// `Error::NotOwner { desc }`.
    NotOwner = 6,
    /// `Error::ForeignPool { expected, found }`.
    ForeignPool = 7,
    /// `Error::RefForged { desc }`.
    RefForged = 8,
    /// `Error::RefStale { desc, generation, current }`.
    RefStale = 9,
    /// `Error::RefReleased { desc, generation }`.
    RefReleased = 10,
    /// `Error::RefExpired { desc, generation }`.
    RefExpired = 11,
    /// `Error::Protocol(message)`: the request was malformed.
    Protocol = 12,
    /// `Error::Unavailable(message)`: the server is shutting down.
    Unavailable = 13,
    /// Anything else (`Error::Corrupt(message)`).
    Internal = 14,
    /// `Error::Unauthenticated(message)`: no key, or a wrong one.
    Unauthenticated = 15,
    /// `Error::PermissionDenied(message)`: an admin operation without
    /// the admin key.
    PermissionDenied = 16,
}

const EXHAUSTED: [&str; 6] = [
    "pages",
    "refs",
    "buffers",
    "memory-server pages",
    "memory-server sessions",
    "memory-server quota",
];

/// Encodes a typed error as (code, three fields, message).
pub fn error_parts(e: &Error) -> (ErrorCode, [u64; 3], String) {
    use ErrorCode as C;
    let (c, f) = match e {
        Error::ZeroLength => (C::ZeroLength, [0; 3]),
        Error::TooLarge { len, max } => (C::TooLarge, [*len, *max, 0]),
        Error::OutOfBounds { offset, len, size } => (C::OutOfBounds, [*offset, *len, *size]),
        Error::ResourceExhausted { what } => (
            C::Exhausted,
            [
                EXHAUSTED.iter().position(|w| w == what).unwrap_or(0) as u64,
                0,
                0,
            ],
        ),
        Error::DoubleFree { desc, generation } => {
            (C::DoubleFree, [*desc as u64, *generation as u64, 0])
        }
        Error::NotOwner { desc } => (C::NotOwner, [*desc as u64, 0, 0]),
        Error::ForeignPool { expected, found } => (C::ForeignPool, [*expected, *found, 0]),
        Error::RefForged { desc } => (C::RefForged, [*desc as u64, 0, 0]),
        Error::RefStale {
            desc,
            generation,
            current,
        } => (
            C::RefStale,
            [*desc as u64, *generation as u64, *current as u64],
        ),
        Error::RefReleased { desc, generation } => {
            (C::RefReleased, [*desc as u64, *generation as u64, 0])
        }
        Error::RefExpired { desc, generation } => {
            (C::RefExpired, [*desc as u64, *generation as u64, 0])
        }
        Error::Protocol(_) | Error::RefDecode(_) => (C::Protocol, [0; 3]),
        Error::Unavailable(_) => (C::Unavailable, [0; 3]),
        Error::Unauthenticated(_) => (C::Unauthenticated, [0; 3]),
        Error::PermissionDenied(_) => (C::PermissionDenied, [0; 3]),
        _ => (C::Internal, [0; 3]),
    };
    let msg = match e {
        Error::Protocol(m)
        | Error::Unavailable(m)
        | Error::Corrupt(m)
        | Error::Unauthenticated(m)
        | Error::PermissionDenied(m) => m.clone(),
        _ => e.to_string(),
    };
    (c, f, msg)
}

/// Rebuilds the typed error from an answer's status and body.
pub fn error_from(status: u8, body: &[u8]) -> Result<Error, ProtoError> {
    let mut r = Rd { b: body, at: 0 };
    let f = [r.u64()?, r.u64()?, r.u64()?];
    let msg = String::from_utf8_lossy(r.rest()).into_owned();
    let u32_of = |x: u64| x as u32;
    Ok(match status {
        1 => Error::ZeroLength,
        2 => Error::TooLarge {
            len: f[0],
            max: f[1],
        },
        3 => Error::OutOfBounds {
            offset: f[0],
            len: f[1],
            size: f[2],
        },
        4 => Error::ResourceExhausted {
            what: EXHAUSTED.get(f[0] as usize).copied().unwrap_or("pages"),
        },
        5 => Error::DoubleFree {
            desc: u32_of(f[0]),
            generation: u32_of(f[1]),
        },
        6 => Error::NotOwner { desc: u32_of(f[0]) },
        7 => Error::ForeignPool {
            expected: f[0],
            found: f[1],
        },
        8 => Error::RefForged { desc: u32_of(f[0]) },
        9 => Error::RefStale {
            desc: u32_of(f[0]),
            generation: u32_of(f[1]),
            current: u32_of(f[2]),
        },
        10 => Error::RefReleased {
            desc: u32_of(f[0]),
            generation: u32_of(f[1]),
        },
        11 => Error::RefExpired {
            desc: u32_of(f[0]),
            generation: u32_of(f[1]),
        },
        12 => Error::Protocol(msg),
        13 => Error::Unavailable(msg),
        14 => Error::Corrupt(msg),
        15 => Error::Unauthenticated(msg),
        16 => Error::PermissionDenied(msg),
        s => return Err(ProtoError::Status(s)),
    })
}

/// Appends a success answer: `body` written by the closure.
pub fn encode_ok(id: u64, out: &mut Vec<u8>, body: impl FnOnce(&mut Vec<u8>)) {
    let at = start(out, 0, id);
    body(out);
    finish(out, at);
}

/// Appends the head of a success answer whose body, of `body_len` bytes,
/// follows on the wire from elsewhere (pages written where they lie).
pub fn encode_ok_head(id: u64, body_len: usize, out: &mut Vec<u8>) {
    let at = start(out, 0, id);
    finish_with(out, at, body_len);
}

/// Appends an error answer.
pub fn encode_err(id: u64, e: &Error, out: &mut Vec<u8>) {
    let (code, f, msg) = error_parts(e);
    let at = start(out, code as u8, id);
    for x in f {
        out.extend_from_slice(&x.to_le_bytes());
    }
    let m = msg.as_bytes();
    out.extend_from_slice(&m[..m.len().min(1024)]);
    finish(out, at);
}

/// A decoded answer: its id and either its body or the typed error.
pub fn decode_answer(frame: &[u8]) -> Result<(u64, Result<&[u8], Error>), ProtoError> {
    let (status, id, mut r) = header(frame)?;
    let body = r.rest();
    if status == 0 {
        Ok((id, Ok(body)))
    } else {
        Ok((id, Err(error_from(status, body)?)))
    }
}

/// The id of a success answer whose frame starts with `head` (the
/// [`HEADER`] bytes after the length prefix), or `None` for an error
/// answer or a header [`decode_answer`] would refuse. A client uses it
/// to receive a long answer's body straight into its caller's buffer.
pub fn success_id(head: &[u8; HEADER]) -> Option<u64> {
    let [v, status, r0, r1, id @ ..] = *head;
    (v == VERSION && status == 0 && r0 == 0 && r1 == 0).then(|| u64::from_le_bytes(id))
}

/// Reads fixed `u64`s from an answer body (exactly `N`).
pub fn u64s<const N: usize>(body: &[u8]) -> Result<[u64; N], ProtoError> {
    let mut r = Rd { b: body, at: 0 };
    let mut v = [0u64; N];
    for x in &mut v {
        *x = r.u64()?;
    }
    r.end()?;
    Ok(v)
}

impl HelloAnswer {
    /// Appends the answer's body.
    pub fn encode_body(&self, o: &mut Vec<u8>) {
        o.extend_from_slice(&self.server_id.to_le_bytes());
        o.extend_from_slice(&self.page_size.to_le_bytes());
        o.extend_from_slice(&self.max_len.to_le_bytes());
        if let Some(a) = &self.auth {
            o.push(a.flags);
            o.extend_from_slice(&a.nonce);
            o.extend_from_slice(&a.proof);
            o.extend_from_slice(&a.admin_proof);
        }
    }

    /// Reads the answer's body (short, from a server or to a client that
    /// does not authenticate, or with the server's side of the challenge).
    pub fn decode(body: &[u8]) -> Result<HelloAnswer, ProtoError> {
        let mut r = Rd { b: body, at: 0 };
        let (server_id, page_size, max_len) = (r.u64()?, r.u32()?, r.u64()?);
        let auth = match r.b.len() - r.at {
            0 => None,
            _ => Some(AuthOffer {
                flags: r.take(1)?[0],
                nonce: r.array()?,
                proof: r.array()?,
                admin_proof: r.array()?,
            }),
        };
        r.end()?;
        Ok(HelloAnswer {
            server_id,
            page_size,
            max_len,
            auth,
        })
    }
}

/// A Ref in an answer body.
pub fn decode_ref(body: &[u8]) -> Result<Ref, ProtoError> {
    let mut r = Rd { b: body, at: 0 };
    let x = r.reference()?;
    r.end()?;
    Ok(x)
}

/// The fuzz target `memserver_request`: `data` read as a stream of
/// length-prefixed frames, as the server reads a connection. Each frame is
/// decoded as a request (and, if it decodes, re-encoded to the same
/// bytes) and as an answer. Panics only on a decoder bug.
#[doc(hidden)]
pub fn fuzz_decode(data: &[u8]) {
    let mut rest = data;
    while rest.len() >= 4 {
        let n = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let body = &rest[4..];
        let frame = &body[..n.min(body.len())];
        if let Ok((id, req)) = Request::decode(frame) {
            let mut again = Vec::new();
            req.encode(id, &mut again);
            assert_eq!(
                &again[4..],
                frame,
                "a decoded request re-encodes to its bytes"
            );
        }
        let _ = decode_answer(frame);
        let _ = u64s::<2>(frame);
        let _ = HelloAnswer::decode(frame);
        let _ = decode_ref(frame);
        rest = &body[frame.len()..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn a_ref() -> Ref {
        Ref {
            backend: dm_pool::BACKEND_MEMSERVER,
            pool_id: 9,
            desc: 3,
            generation: 1,
            tag: 77,
            len: 5000,
        }
    }

    fn requests() -> impl Strategy<Value = Request<'static>> {
        prop_oneof![
            (any::<u32>(), any::<Option<[u8; 16]>>())
                .prop_map(|(lease_ms, nonce)| Request::Hello { lease_ms, nonce }),
            (any::<u8>(), any::<[u8; 32]>())
                .prop_map(|(role, proof)| Request::Auth { role, proof }),
            any::<u64>().prop_map(|len| Request::Alloc { len }),
            any::<u64>().prop_map(|addr| Request::Free { addr }),
            (any::<u64>(), any::<u64>(), 0u32..=MAX_IO as u32)
                .prop_map(|(addr, offset, len)| Request::Read { addr, offset, len }),
            (
                any::<u64>(),
                any::<u64>(),
                proptest::collection::vec(any::<u8>(), 0..200)
            )
                .prop_map(|(addr, offset, data)| Request::Write {
                    addr,
                    offset,
                    data: data.into()
                }),
            (any::<u64>(), any::<u64>(), any::<u64>(), any::<u32>()).prop_map(
                |(addr, offset, len, ttl_ms)| Request::CreateRef {
                    addr,
                    offset,
                    len,
                    ttl_ms
                }
            ),
            Just(Request::MapRef(a_ref())),
            Just(Request::ReleaseRef(a_ref())),
            Just(Request::Usage),
            Just(Request::Check),
            Just(Request::Ping),
            Just(Request::Maintain),
            (any::<u32>(), proptest::collection::vec(any::<u8>(), 0..200)).prop_map(
                |(ttl_ms, data)| Request::Put {
                    ttl_ms,
                    data: data.into()
                }
            ),
            (any::<u32>(), proptest::collection::vec(any::<u8>(), 0..200)).prop_map(
                |(ttl_ms, data)| Request::StreamPut {
                    ttl_ms,
                    data: data.into()
                }
            ),
            (any::<u64>(), 0u32..=MAX_IO as u32).prop_map(|(offset, len)| Request::ReadRef {
                r: a_ref(),
                offset,
                len
            }),
        ]
    }

    #[test]
    fn a_stream_put_head_is_known_by_its_first_bytes() {
        let mut f = Vec::new();
        let data = Request::StreamPut {
            ttl_ms: 250,
            data: vec![7u8; 100].into(),
        }
        .encode_head(42, &mut f)
        .to_vec();
        assert_eq!(data.len(), 100);
        assert_eq!(f.len(), 4 + STREAM_PUT_HEAD);
        assert_eq!(stream_put_head(&f[4..]), Some((42, 250)));
        // Another op, another version, a short head: not one.
        let mut g = Vec::new();
        Request::Put {
            ttl_ms: 250,
            data: vec![7u8; 100].into(),
        }
        .encode_head(42, &mut g);
        assert_eq!(stream_put_head(&g[4..]), None);
        let mut bad = f[4..].to_vec();
        bad[0] = VERSION + 1;
        assert_eq!(stream_put_head(&bad), None);
        assert_eq!(stream_put_head(&f[4..f.len() - 1]), None);
    }

    #[test]
    fn a_write_head_is_known_by_its_first_bytes() {
        let mut f = Vec::new();
        Request::Write {
            addr: 1 << 40,
            offset: 12_345,
            data: vec![7u8; 100].into(),
        }
        .encode_head(42, &mut f);
        assert_eq!(f.len(), 4 + WRITE_HEAD);
        assert_eq!(write_head(&f[4..]), Some((42, 1 << 40, 12_345)));
        assert_eq!(stream_put_head(&f[4..4 + STREAM_PUT_HEAD]), None);
        let mut bad = f[4..].to_vec();
        bad[2] = 1;
        assert_eq!(write_head(&bad), None);
        assert_eq!(write_head(&f[4..f.len() - 1]), None);
    }

    proptest! {
        #[test]
        fn requests_roundtrip(req in requests(), id: u64) {
            let mut b = Vec::new();
            req.encode(id, &mut b);
            let len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
            prop_assert_eq!(len, b.len() - 4);
            prop_assert_eq!(Request::decode(&b[4..]), Ok((id, req)));
        }

        #[test]
        fn a_head_and_its_data_are_the_encoding(req in requests(), id: u64) {
            let mut whole = Vec::new();
            req.encode(id, &mut whole);
            let mut split = vec![1, 2];
            let data = req.encode_head(id, &mut split);
            split.extend_from_slice(data);
            prop_assert_eq!(&split[2..], &whole[..]);
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..100)) {
            let _ = Request::decode(&b);
            let _ = decode_answer(&b);
        }

        #[test]
        fn truncations_are_errors(req in requests(), cut in 0usize..60) {
            let mut b = Vec::new();
            req.encode(1, &mut b);
            let body = &b[4..];
            if cut < body.len()
                && !matches!(req, Request::Write { .. } | Request::Put { .. } | Request::StreamPut { .. })
            {
                match (Request::decode(&body[..cut]), &req) {
                    (Err(_), _) => {}
                    // A hello's nonce is optional: a hello cut just before
                    // it is a hello without one.
                    (
                        Ok((_, Request::Hello { lease_ms, nonce: None })),
                        Request::Hello { lease_ms: sent, nonce: Some(_) },
                    ) if lease_ms == *sent => {}
                    (Ok(other), _) => prop_assert!(false, "a truncation decoded: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn malformed_headers_and_bodies() {
        let mut b = Vec::new();
        Request::Alloc { len: 5 }.encode(42, &mut b);
        let f = &b[4..];
        let mut v = f.to_vec();
        v[0] = 2;
        assert_eq!(Request::decode(&v), Err((None, ProtoError::Version(2))));
        let mut v = f.to_vec();
        v[3] = 1;
        assert_eq!(Request::decode(&v), Err((None, ProtoError::Reserved)));
        let mut v = f.to_vec();
        v[1] = 99;
        assert_eq!(Request::decode(&v), Err((Some(42), ProtoError::Op(99))));
        let mut v = f.to_vec();
        v.push(0);
        assert_eq!(
            Request::decode(&v),
            Err((Some(42), ProtoError::Trailing(1)))
        );
        let mut b = Vec::new();
        Request::Read {
            addr: 1,
            offset: 0,
            len: MAX_IO as u32 + 1,
        }
        .encode(7, &mut b);
        assert!(matches!(
            Request::decode(&b[4..]),
            Err((Some(7), ProtoError::ReadTooLong(_)))
        ));
        let mut b = Vec::new();
        Request::MapRef(a_ref()).encode(8, &mut b);
        let n = b.len();
        b[n - 40] = 9; // Ref version
        assert!(matches!(
            Request::decode(&b[4..]),
            Err((Some(8), ProtoError::Ref(_)))
        ));
    }

    #[test]
    fn every_error_roundtrips() {
        let errors = [
            Error::ZeroLength,
            Error::TooLarge { len: 5, max: 4 },
            Error::OutOfBounds {
                offset: 1,
                len: 2,
                size: 3,
            },
            Error::ResourceExhausted { what: "refs" },
            Error::DoubleFree {
                desc: 4,
                generation: 0,
            },
            Error::NotOwner { desc: 6 },
            Error::ForeignPool {
                expected: 1,
                found: 2,
            },
            Error::RefForged { desc: 8 },
            Error::RefStale {
                desc: 1,
                generation: 2,
                current: 3,
            },
            Error::RefReleased {
                desc: 1,
                generation: 2,
            },
            Error::RefExpired {
                desc: 3,
                generation: 4,
            },
            Error::Protocol("bad".into()),
            Error::Unavailable("bye".into()),
        ];
        for e in errors {
            let mut b = Vec::new();
            encode_err(5, &e, &mut b);
            let (id, got) = decode_answer(&b[4..]).unwrap();
            assert_eq!(id, 5);
            let got = got.unwrap_err();
            assert_eq!(got.to_string(), e.to_string());
        }
    }
}

//! Where frames are parsed: the wire format of dmrpc calls (version 10).
//!
//! Every transport carries the same frames: a 32-byte fixed header, then a
//! payload of inline bytes or of [`Ref`]s (the size-aware choice between the
//! two belongs to the layer above), then the call's metadata, if any
//! ([`crate::metadata`]). All integers are little-endian.
//!
//! | bytes  | field        | notes                                                  |
//! |--------|--------------|--------------------------------------------------------|
//! | 0..2   | magic        | `D5 52`                                                |
//! | 2      | version      | [`FRAME_VERSION`]                                      |
//! | 3      | kind         | [`Kind`]: request, response, cancel, go-away, item, credit |
//! | 4..6   | flags        | [`FLAG_ECHO`], [`FLAG_REFUSED`], [`FLAG_STREAM`], [`FLAG_CALLER_STREAM`], [`FLAG_LAST`], [`FLAG_WINDOW`]; others zero |
//! | 6      | payload kind | 0 none, 1 inline bytes, 2 Refs                         |
//! | 7      | status       | [`Status`]; zero except in responses                   |
//! | 8..16  | call id      | chosen by the caller, echoed by the response           |
//! | 16..20 | method       | [`method_id`] of the method's full name (requests); items granted (credits) |
//! | 20..24 | deadline     | microseconds the caller will wait, 0 = none (requests) |
//! | 24..28 | length       | payload bytes                                          |
//! | 28..32 | meta length  | bytes of metadata after the payload (requests, answers, items) |
//!
//! A Refs payload is one or more 40-byte encoded Refs (`dm_pool::refs`).
//! An answer's Ref is made for its caller, who releases it, except in an
//! answer flagged [`FLAG_ECHO`]: its one Ref is the request's own, passed
//! back as it came, which the caller already holds (and releases once).
//! An answer flagged [`FLAG_REFUSED`] (status `Unavailable`, inline or no
//! payload) says its request was not run: the server is shutting down and
//! takes no new requests, so the caller may send it to the server's
//! successor.
//!
//! **Streams** (version 7). A request flagged [`FLAG_STREAM`] asks for its
//! answer as a stream: any number of [`Kind::Item`] frames (server to
//! client, each with a payload as an answer has, and no metadata), then
//! the call's one response, which ends it (its status is the stream's; an
//! `Ok` response's payload, if it has one, is the stream's last item).
//! Flow control is by items: the server sends an item only while the
//! caller has granted more than it was sent, and the caller grants them
//! in [`Kind::Credit`] frames (client to server), whose method field
//! holds how many more items it will take (never zero). A stream starts
//! with no credit: its caller sends its first grant right after the
//! request, unless the request is flagged [`FLAG_WINDOW`] (version 10),
//! which grants [`DEFAULT_WINDOW`](crate::stream::DEFAULT_WINDOW) items
//! with it: a stream of the default window opens with one frame. An item's Refs are made for the caller, as an answer's are.
//! A go-away frame (server to client, TCP) says that the server stopped
//! reading the connection, and which requests it took: every request whose
//! call id is above the frame's call id was never taken, and never will be
//! (see `transport::GoAway`). It carries nothing else.
//!
//! An item may carry metadata too (version 9): a stream's first item may
//! carry what gRPC sends as response headers before any message.
//!
//! **Streams of the caller** (version 9). A request flagged
//! [`FLAG_CALLER_STREAM`] is followed by items of its caller:
//! [`Kind::Item`] frames from client to server, with the request's call
//! id, then one item flagged [`FLAG_LAST`] that carries nothing and ends
//! them. Flow control is by items here too, the other way: the caller
//! sends an item only while the server has granted more than it was
//! sent, in [`Kind::Credit`] frames from server to client (the last
//! marker needs no grant). The server grants once its handler starts;
//! the caller starts with none. An item's Refs are made for the server,
//! which releases them. A request flagged both ways is a bidirectional
//! stream; one flagged [`FLAG_CALLER_STREAM`] alone is answered by its
//! one response.
//!
//! **Parts** (version 8). A frame too large for one record of a
//! shared-memory ring travels as [`Kind::Part`] frames, each carrying the
//! next slice of its encoding as an inline payload, with the call id of
//! the frame: the first flagged [`FLAG_PART_FIRST`], the last
//! [`FLAG_PART_LAST`]. The receiver joins them and decodes the whole
//! (`transport/parts.rs`). Parts never leave the transport.
//! The decoder checks every field, every Ref encoding and every metadata
//! entry, bounds the payload and the metadata by [`Limits`], returns `Ok(None)` when more bytes are needed (streams), and
//! never panics, whatever the bytes: it is fuzzed (`fuzz/fuzz_targets/frame_decode.rs`).

use crate::metadata::Metadata;
use bytes::Bytes;
use dm_pool::{Ref, RefDecodeError};

/// Frame encoding version written and read by this build (history:
/// `CHANGELOG.md`).
pub const FRAME_VERSION: u8 = 10;
/// Flag of a successful answer whose payload is the one Ref its request
/// carried, passed back (not a Ref made for the caller).
pub const FLAG_ECHO: u16 = 1;
/// Flag of an `Unavailable` answer whose request was not run: the server
/// refused it, shutting down (it may be sent again elsewhere).
pub const FLAG_REFUSED: u16 = 2;
/// Flag of a request whose caller reads its answer as a stream of items
/// (frames v7).
pub const FLAG_STREAM: u16 = 4;
/// Flag of the first [`Kind::Part`] of a frame (frames v8).
pub const FLAG_PART_FIRST: u16 = 8;
/// Flag of the last [`Kind::Part`] of a frame (frames v8).
pub const FLAG_PART_LAST: u16 = 16;
/// Flag of a request whose caller sends items after it (frames v9).
pub const FLAG_CALLER_STREAM: u16 = 32;
/// Flag of the item that ends the caller's items: it carries nothing
/// (frames v9).
pub const FLAG_LAST: u16 = 64;
/// Flag of a stream's request that grants the default window with it
/// (frames v10): its caller sends no first grant.
pub const FLAG_WINDOW: u16 = 128;
/// Size of the fixed header.
pub const HEADER_LEN: usize = 32;
const MAGIC: [u8; 2] = [0xD5, 0x52];

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// A call.
    Request = 1,
    /// The answer to the call with the same id.
    Response = 2,
    /// The caller gave up on the call with this id.
    Cancel = 3,
    /// The server stopped reading the connection; it took no request with
    /// an id above this frame's call id (server to client).
    GoAway = 4,
    /// One item of the stream answering the call with the same id (server
    /// to client; frames v7), or of the stream its caller sends (client
    /// to server; frames v9).
    Item = 5,
    /// The caller of the stream with this id takes this many more items
    /// (in the method field; client to server; frames v7), or the server
    /// takes this many more of its caller's (server to client; frames v9).
    Credit = 6,
    /// A slice of the encoding of a frame too large for one record of a
    /// ring (frames v8).
    Part = 7,
}

/// Outcome of a call, carried by responses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Status {
    /// Success.
    Ok = 0,
    /// No such service or method.
    NotFound = 1,
    /// The arguments were rejected.
    InvalidArgument = 2,
    /// The deadline passed before an answer.
    DeadlineExceeded = 3,
    /// The peer is gone or not reachable.
    Unavailable = 4,
    /// Out of memory, pool pages, ring space or quota.
    ResourceExhausted = 5,
    /// A bug or an unexpected failure on the other side.
    Internal = 6,
    /// The call was cancelled.
    Cancelled = 7,
    /// The caller did not prove who it is (a missing, bad or expired
    /// credential). Frames v6.
    Unauthenticated = 8,
    /// The caller is known and may not make this call. Frames v6.
    PermissionDenied = 9,
    /// What the call would create exists already: a service name a live
    /// process holds. Frames v8.
    AlreadyExists = 10,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Request,
            2 => Kind::Response,
            3 => Kind::Cancel,
            4 => Kind::GoAway,
            5 => Kind::Item,
            6 => Kind::Credit,
            7 => Kind::Part,
            _ => return None,
        })
    }
}

impl Status {
    fn from_u8(v: u8) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::NotFound,
            2 => Status::InvalidArgument,
            3 => Status::DeadlineExceeded,
            4 => Status::Unavailable,
            5 => Status::ResourceExhausted,
            6 => Status::Internal,
            7 => Status::Cancelled,
            8 => Status::Unauthenticated,
            9 => Status::PermissionDenied,
            10 => Status::AlreadyExists,
            _ => return None,
        })
    }
}

/// What a frame carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    /// Nothing.
    None,
    /// Bytes, copied with the frame (shared, not copied, between the
    /// payloads and frames that hold them: a forwarded inline payload).
    Inline(Bytes),
    /// References to pool memory (one or more).
    Refs(Vec<Ref>),
}

impl Body {
    fn kind(&self) -> u8 {
        match self {
            Body::None => 0,
            Body::Inline(_) => 1,
            Body::Refs(_) => 2,
        }
    }

    /// Its encoded length.
    pub(crate) fn len(&self) -> usize {
        match self {
            Body::None => 0,
            Body::Inline(b) => b.len(),
            Body::Refs(r) => r.len() * Ref::SIZE,
        }
    }
}

/// One frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Request, response or cancel.
    pub kind: Kind,
    /// Call id (the response and a cancel carry the request's).
    pub call_id: u64,
    /// [`method_id`] of the method (requests; zero otherwise).
    pub method: u32,
    /// Microseconds the caller will wait, 0 = no deadline (requests).
    pub deadline_us: u32,
    /// Outcome (responses; `Ok` otherwise).
    pub status: Status,
    /// `FLAG_*` bits, as the kind allows (see the module documentation).
    pub flags: u16,
    /// Body.
    pub payload: Body,
    /// The call's metadata (requests and answers; empty otherwise).
    pub meta: Metadata,
}

/// Bounds the decoder enforces on what a peer may send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest payload in bytes. Default 16 MiB (larger arguments travel
    /// as Refs).
    pub max_payload: u32,
    /// Most Refs in one frame. Default 64.
    pub max_refs: u32,
    /// Most bytes of metadata in one frame. Default 16 KiB.
    pub max_meta: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_payload: 16 << 20,
            max_refs: 64,
            max_meta: crate::metadata::DEFAULT_MAX_META,
        }
    }
}

/// Why bytes are not a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Not a dmrpc frame (or the stream lost its place).
    #[error("bad frame magic {0:02x?}")]
    Magic([u8; 2]),
    /// A frame version this build does not read.
    #[error("frame version {0} is not supported (this build reads version {FRAME_VERSION})")]
    Version(u8),
    /// Unknown frame kind.
    #[error("unknown frame kind {0}")]
    Kind(u8),
    /// Unknown payload kind.
    #[error("unknown payload kind {0}")]
    PayloadKind(u8),
    /// Unknown status code.
    #[error("unknown status {0}")]
    Status(u8),
    /// Flags or reserved bytes not zero.
    #[error("reserved header bits are set ({0})")]
    Reserved(&'static str),
    /// A field that does not fit the frame's kind.
    #[error("inconsistent frame: {0}")]
    Inconsistent(&'static str),
    /// A payload above the receiver's limit.
    #[error("payload of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Announced length.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// A Refs payload whose length is not a whole number of Refs.
    #[error("Refs payload of {0} bytes is not a multiple of {size}", size = Ref::SIZE)]
    RefsLength(u32),
    /// More Refs than allowed.
    #[error("{count} Refs exceed the limit of {max}")]
    TooManyRefs {
        /// Refs in the frame.
        count: u32,
        /// The limit.
        max: u32,
    },
    /// A malformed Ref in the payload.
    #[error("Ref {index} of the payload: {error}")]
    Ref {
        /// Its position.
        index: u32,
        /// What is wrong with it.
        error: RefDecodeError,
    },
    /// Metadata above the receiver's limit.
    #[error("metadata of {len} bytes exceeds the limit of {max}")]
    MetaTooLarge {
        /// Announced length.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// A malformed metadata section.
    #[error("malformed metadata: {0}")]
    Metadata(&'static str),
    /// A record (a ring's unit) that is not exactly one frame.
    #[error("a record of {record} bytes holds a frame of {} bytes", frame.map_or("too few".into(), |f| f.to_string()))]
    Record {
        /// Bytes in the record.
        record: usize,
        /// Bytes its frame's header announces (`None`: the record is
        /// shorter than a header).
        frame: Option<usize>,
    },
}

/// The method id of a method's full name (`service/path/method`): FNV-1a,
/// never zero (zero means "no method").
pub fn method_id(name: &str) -> u32 {
    let h = name.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ b as u32).wrapping_mul(0x0100_0193)
    });
    if h == 0 {
        1
    } else {
        h
    }
}

impl Frame {
    /// A request.
    pub fn request(call_id: u64, method: u32, deadline_us: u32, payload: Body) -> Frame {
        Frame {
            kind: Kind::Request,
            call_id,
            method,
            deadline_us,
            status: Status::Ok,
            flags: 0,
            payload,
            meta: Metadata::default(),
        }
    }

    /// This request or answer, with `meta`.
    pub fn with_meta(self, meta: Metadata) -> Frame {
        Frame { meta, ..self }
    }

    /// A response.
    pub fn response(call_id: u64, status: Status, payload: Body) -> Frame {
        Frame {
            kind: Kind::Response,
            call_id,
            method: 0,
            deadline_us: 0,
            status,
            flags: 0,
            payload,
            meta: Metadata::default(),
        }
    }

    /// A successful answer passing back `r`, the Ref its request carried
    /// ([`FLAG_ECHO`]).
    pub fn echo(call_id: u64, r: Ref) -> Frame {
        Frame {
            flags: FLAG_ECHO,
            ..Frame::response(call_id, Status::Ok, Body::Refs(vec![r]))
        }
    }

    /// The answer of a request the server refused without running it,
    /// with why ([`FLAG_REFUSED`]).
    pub fn refused(call_id: u64, why: &str) -> Frame {
        Frame {
            flags: FLAG_REFUSED,
            ..Frame::response(
                call_id,
                Status::Unavailable,
                Body::Inline(Bytes::copy_from_slice(why.as_bytes())),
            )
        }
    }

    /// A cancel.
    pub fn cancel(call_id: u64) -> Frame {
        Frame {
            kind: Kind::Cancel,
            call_id,
            method: 0,
            deadline_us: 0,
            status: Status::Ok,
            flags: 0,
            payload: Body::None,
            meta: Metadata::default(),
        }
    }

    /// The go-away of a server that stopped reading a connection on which
    /// the highest call id it took was `last_taken` (0: none).
    pub fn go_away(last_taken: u64) -> Frame {
        Frame {
            kind: Kind::GoAway,
            ..Frame::cancel(last_taken)
        }
    }

    /// One item of the stream answering call `call_id`.
    pub fn item(call_id: u64, payload: Body) -> Frame {
        Frame {
            kind: Kind::Item,
            ..Frame::response(call_id, Status::Ok, payload)
        }
    }

    /// The end of the items the caller of call `call_id` sends
    /// ([`FLAG_LAST`]).
    pub fn last_item(call_id: u64) -> Frame {
        Frame {
            flags: FLAG_LAST,
            ..Frame::item(call_id, Body::None)
        }
    }

    /// A grant of `items` more items (at least one) of the stream
    /// answering call `call_id`, or, from a server, of the stream its
    /// caller sends.
    pub fn credit(call_id: u64, items: u32) -> Frame {
        Frame {
            kind: Kind::Credit,
            method: items,
            ..Frame::cancel(call_id)
        }
    }

    /// One slice of the encoding of the frame of call `call_id`, flagged
    /// [`FLAG_PART_FIRST`] and [`FLAG_PART_LAST`] as it is.
    pub fn part(call_id: u64, flags: u16, slice: Bytes) -> Frame {
        Frame {
            kind: Kind::Part,
            flags,
            payload: Body::Inline(slice),
            ..Frame::cancel(call_id)
        }
    }

    /// Encoded size.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + self.payload.len() + self.meta.encoded_len()
    }

    /// The fixed header of this frame. (A payload above 4 GiB, which no
    /// caller can build within [`Limits`], would be announced as 4 GiB.)
    pub fn header(&self) -> [u8; HEADER_LEN] {
        let len = u32::try_from(self.payload.len()).unwrap_or(u32::MAX);
        let meta = u32::try_from(self.meta.encoded_len()).unwrap_or(u32::MAX);
        let mut h = [0u8; HEADER_LEN];
        h[0..2].copy_from_slice(&MAGIC);
        h[2] = FRAME_VERSION;
        h[3] = self.kind as u8;
        h[4..6].copy_from_slice(&self.flags.to_le_bytes());
        h[6] = self.payload.kind();
        h[7] = self.status as u8;
        h[8..16].copy_from_slice(&self.call_id.to_le_bytes());
        h[16..20].copy_from_slice(&self.method.to_le_bytes());
        h[20..24].copy_from_slice(&self.deadline_us.to_le_bytes());
        h[24..28].copy_from_slice(&len.to_le_bytes());
        h[28..32].copy_from_slice(&meta.to_le_bytes());
        h
    }

    /// Calls `put` with the encoding in pieces (header, payload, metadata),
    /// so a transport can write a frame straight into its ring or socket
    /// buffer.
    #[inline]
    pub fn encode_with(&self, mut put: impl FnMut(&[u8])) {
        put(&self.header());
        match &self.payload {
            Body::None => {}
            Body::Inline(b) => put(b),
            Body::Refs(rs) => {
                for r in rs {
                    put(&r.to_bytes());
                }
            }
        }
        if !self.meta.is_empty() {
            self.meta.encode_with(&mut put);
        }
    }

    /// Appends the encoding to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.reserve(self.encoded_len());
        self.encode_with(|b| out.extend_from_slice(b));
    }

    /// The encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.encoded_len());
        self.encode_into(&mut v);
        v
    }

    /// Decodes the frame at the start of `buf`: `Ok(Some((frame, used)))`,
    /// `Ok(None)` if `buf` holds only part of a frame (read more), or a
    /// typed error for bytes that are not a valid frame. The header is
    /// checked before waiting for a payload, so a bad length is rejected at
    /// once rather than awaited.
    pub fn decode(buf: &[u8], limits: &Limits) -> Result<Option<(Frame, usize)>, FrameError> {
        let Some(h) = buf.get(..HEADER_LEN) else {
            Self::early(buf)?;
            return Ok(None);
        };
        let head = Head::parse(h, limits)?;
        let at_meta = HEADER_LEN + head.len as usize;
        let total = at_meta + head.meta as usize;
        let Some(body) = buf.get(HEADER_LEN..at_meta) else {
            return Ok(None);
        };
        let Some(meta) = buf.get(at_meta..total) else {
            return Ok(None);
        };
        let payload = match head.pkind {
            1 => Body::Inline(Bytes::copy_from_slice(body)),
            _ => head.body(body)?,
        };
        let meta = Metadata::decode(meta).map_err(FrameError::Metadata)?;
        Ok(Some((head.frame(payload, meta), total)))
    }

    /// Decodes one whole record (a ring's unit) that must hold exactly one
    /// frame, given as its first bytes `head` (up to [`HEADER_LEN`]) and the
    /// rest `rest`, already copied out of shared memory. An inline payload
    /// becomes `rest` itself, with no further copy (`rest` is left empty);
    /// otherwise `rest` is left as it was, so that the caller can copy the
    /// next record into the same vector. Same checks as
    /// [`decode`](Self::decode), plus the length: a record shorter or longer
    /// than its frame is [`FrameError::Record`].
    pub fn decode_record(
        head: &[u8],
        rest: &mut Vec<u8>,
        limits: &Limits,
    ) -> Result<Frame, FrameError> {
        let record = head.len() + rest.len();
        let Some(h) = head.get(..HEADER_LEN).filter(|_| head.len() == HEADER_LEN) else {
            Self::early(head)?;
            return Err(FrameError::Record {
                record,
                frame: None,
            });
        };
        let head = Head::parse(h, limits)?;
        let len = head.len as usize;
        if rest.len() != len + head.meta as usize {
            return Err(FrameError::Record {
                record,
                frame: Some(HEADER_LEN + len + head.meta as usize),
            });
        }
        // (The payload is checked before the metadata, as in `decode`.)
        if head.pkind == 2 {
            let payload = head.body(&rest[..len])?;
            let meta = Metadata::decode(&rest[len..]).map_err(FrameError::Metadata)?;
            return Ok(head.frame(payload, meta));
        }
        let meta = match head.meta {
            0 => Metadata::default(),
            _ => Metadata::decode(&rest[len..]).map_err(FrameError::Metadata)?,
        };
        let payload = match head.pkind {
            1 => {
                rest.truncate(len);
                Body::Inline(Bytes::from(std::mem::take(rest)))
            }
            _ => Body::None,
        };
        Ok(head.frame(payload, meta))
    }

    /// The errors the first bytes of a header show before it is whole.
    fn early(buf: &[u8]) -> Result<(), FrameError> {
        // Reject a wrong magic or version as early as the bytes allow.
        if buf.len() >= 2 && buf[..2] != MAGIC {
            return Err(FrameError::Magic([buf[0], buf[1]]));
        }
        if buf.len() >= 3 && buf[2] != FRAME_VERSION {
            return Err(FrameError::Version(buf[2]));
        }
        Ok(())
    }
}

/// A checked header, before its payload.
struct Head {
    kind: Kind,
    call_id: u64,
    method: u32,
    deadline_us: u32,
    status: Status,
    flags: u16,
    pkind: u8,
    len: u32,
    meta: u32,
}

impl Head {
    /// Checks every header field of `h` (`HEADER_LEN` bytes).
    fn parse(h: &[u8], limits: &Limits) -> Result<Head, FrameError> {
        let u16_at = |i: usize| u16::from_le_bytes([h[i], h[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let u64_at = |i: usize| u64::from(u32_at(i)) | (u64::from(u32_at(i + 4)) << 32);
        if h[..2] != MAGIC {
            return Err(FrameError::Magic([h[0], h[1]]));
        }
        if h[2] != FRAME_VERSION {
            return Err(FrameError::Version(h[2]));
        }
        let kind = Kind::from_u8(h[3]).ok_or(FrameError::Kind(h[3]))?;
        let flags = u16_at(4);
        let part = if kind == Kind::Part {
            FLAG_PART_FIRST | FLAG_PART_LAST
        } else {
            0
        };
        let known =
            FLAG_ECHO | FLAG_REFUSED | FLAG_STREAM | FLAG_CALLER_STREAM | FLAG_LAST | FLAG_WINDOW;
        if flags & !(known | part) != 0 {
            return Err(FrameError::Reserved("flags"));
        }
        let pkind = h[6];
        if pkind > 2 {
            return Err(FrameError::PayloadKind(pkind));
        }
        let status = Status::from_u8(h[7]).ok_or(FrameError::Status(h[7]))?;
        let (call_id, method, deadline_us, len) = (u64_at(8), u32_at(16), u32_at(20), u32_at(24));
        let meta = u32_at(28);
        match kind {
            Kind::Request if status != Status::Ok => {
                return Err(FrameError::Inconsistent("a request carries a status"))
            }
            Kind::Request if method == 0 => {
                return Err(FrameError::Inconsistent("a request names no method"))
            }
            Kind::Response | Kind::Cancel | Kind::GoAway | Kind::Item
                if method != 0 || deadline_us != 0 =>
            {
                return Err(FrameError::Inconsistent(
                    "only requests carry a method and a deadline",
                ))
            }
            Kind::Credit if method == 0 || deadline_us != 0 => {
                return Err(FrameError::Inconsistent(
                    "a credit grants at least one item and carries no deadline",
                ))
            }
            Kind::Item | Kind::Credit if status != Status::Ok => {
                return Err(FrameError::Inconsistent(
                    "an item or a credit carries no status",
                ))
            }
            Kind::Credit if pkind != 0 => {
                return Err(FrameError::Inconsistent("a credit carries no payload"))
            }
            Kind::Part
                if method != 0
                    || deadline_us != 0
                    || status != Status::Ok
                    || pkind != 1
                    || meta != 0
                    || flags & !(FLAG_PART_FIRST | FLAG_PART_LAST) != 0 =>
            {
                return Err(FrameError::Inconsistent(
                    "a part carries bytes of its frame and nothing else",
                ))
            }
            Kind::Cancel | Kind::GoAway if status != Status::Ok || pkind != 0 => {
                return Err(FrameError::Inconsistent(
                    "a cancel or go-away carries no status or payload",
                ))
            }
            Kind::Response if status != Status::Ok && pkind == 2 => {
                return Err(FrameError::Inconsistent("an error response carries Refs"))
            }
            _ if flags & FLAG_ECHO != 0
                && (kind != Kind::Response || pkind != 2 || len != Ref::SIZE as u32) =>
            {
                return Err(FrameError::Inconsistent(
                    "only an answer of one Ref passes it back",
                ))
            }
            _ if flags & FLAG_REFUSED != 0
                && (kind != Kind::Response || status != Status::Unavailable) =>
            {
                return Err(FrameError::Inconsistent(
                    "only an Unavailable answer refuses its request",
                ))
            }
            _ if flags & (FLAG_STREAM | FLAG_CALLER_STREAM) != 0 && kind != Kind::Request => {
                return Err(FrameError::Inconsistent("only a request asks for a stream"))
            }
            _ if flags & FLAG_WINDOW != 0
                && (kind != Kind::Request || flags & FLAG_STREAM == 0) =>
            {
                return Err(FrameError::Inconsistent(
                    "only a stream's request grants a window",
                ))
            }
            _ if flags & FLAG_LAST != 0 && (kind != Kind::Item || pkind != 0) => {
                return Err(FrameError::Inconsistent(
                    "only an empty item ends the caller's items",
                ))
            }
            _ if meta != 0 && !matches!(kind, Kind::Request | Kind::Response | Kind::Item) => {
                return Err(FrameError::Inconsistent(
                    "only requests, answers and items carry metadata",
                ))
            }
            _ => {}
        }
        if len > limits.max_payload {
            return Err(FrameError::TooLarge {
                len,
                max: limits.max_payload,
            });
        }
        if meta > limits.max_meta {
            return Err(FrameError::MetaTooLarge {
                len: meta,
                max: limits.max_meta,
            });
        }
        match pkind {
            0 if len != 0 => {
                return Err(FrameError::Inconsistent("an empty payload with a length"))
            }
            2 if len == 0 || len % Ref::SIZE as u32 != 0 => {
                return Err(FrameError::RefsLength(len))
            }
            2 if len / Ref::SIZE as u32 > limits.max_refs => {
                return Err(FrameError::TooManyRefs {
                    count: len / Ref::SIZE as u32,
                    max: limits.max_refs,
                })
            }
            _ => {}
        }
        Ok(Head {
            kind,
            call_id,
            method,
            deadline_us,
            status,
            flags,
            pkind,
            len,
            meta,
        })
    }

    /// The payload of a frame with this header from its bytes (`len` of
    /// them), for payload kinds other than inline.
    fn body(&self, body: &[u8]) -> Result<Body, FrameError> {
        Ok(match self.pkind {
            0 => Body::None,
            1 => Body::Inline(Bytes::copy_from_slice(body)),
            _ => {
                // (Exactly as many as there are: collected from a fallible
                // iterator, a vector would start with room for four.)
                let mut refs = Vec::with_capacity(body.len() / Ref::SIZE);
                for (i, c) in body.chunks_exact(Ref::SIZE).enumerate() {
                    refs.push(Ref::from_bytes(c).map_err(|error| FrameError::Ref {
                        index: i as u32,
                        error,
                    })?);
                }
                Body::Refs(refs)
            }
        })
    }

    fn frame(self, payload: Body, meta: Metadata) -> Frame {
        Frame {
            kind: self.kind,
            call_id: self.call_id,
            method: self.method,
            deadline_us: self.deadline_us,
            status: self.status,
            flags: self.flags,
            payload,
            meta,
        }
    }
}

/// Fuzz entry point shared by `fuzz/fuzz_targets/frame_decode.rs` and the
/// corpus replay test: decode a stream of frames from arbitrary bytes; every
/// frame that decodes must re-encode to exactly its bytes. The whole input
/// is also decoded as one record ([`Frame::decode_record`], split after
/// the header), which must agree with the stream decoder: the same frame
/// when the input is exactly one frame, an error otherwise.
#[doc(hidden)]
pub fn fuzz_decode(data: &[u8]) {
    let limits = Limits {
        max_payload: 1 << 16,
        max_refs: 8,
        max_meta: 1 << 10,
    };
    let cut = data.len().min(HEADER_LEN);
    let record = Frame::decode_record(&data[..cut], &mut data[cut..].to_vec(), &limits);
    // The length the header announces (payload and metadata), if the
    // header is whole.
    let u32_at = |i: usize| u32::from_le_bytes([data[i], data[i + 1], data[i + 2], data[i + 3]]);
    let whole =
        (data.len() >= HEADER_LEN).then(|| HEADER_LEN + u32_at(24) as usize + u32_at(28) as usize);
    match Frame::decode(data, &limits) {
        Ok(Some((f, used))) if used == data.len() => {
            assert_eq!(record, Ok(f), "one record, one frame: both decoders agree")
        }
        // A bad header, or a bad payload or metadata of exactly one frame:
        // the same error. (A bad payload or metadata followed by more
        // bytes: the record decoder refuses the length first.)
        Err(e)
            if whole.is_none_or(|w| w == data.len())
                || !matches!(e, FrameError::Ref { .. } | FrameError::Metadata(_)) =>
        {
            assert_eq!(record, Err(e), "both decoders give the same error")
        }
        _ => assert!(
            matches!(record, Err(FrameError::Record { .. })),
            "a record that is not exactly one frame is refused: {record:?}"
        ),
    }
    let mut at = 0;
    while at < data.len() {
        match Frame::decode(&data[at..], &limits) {
            Ok(Some((f, used))) => {
                assert_eq!(
                    f.encode(),
                    data[at..at + used],
                    "a decoded frame re-encodes to its bytes"
                );
                at += used;
            }
            Ok(None) | Err(_) => break,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn a_ref() -> Ref {
        Ref {
            backend: 0,
            pool_id: 7,
            desc: 3,
            generation: 2,
            tag: 99,
            len: 4096,
        }
    }

    fn frames() -> impl Strategy<Value = Frame> {
        let payload = prop_oneof![
            Just(Body::None),
            proptest::collection::vec(any::<u8>(), 0..300).prop_map(|v| Body::Inline(v.into())),
            (1usize..5, any::<u64>(), any::<u32>(), 1u64..).prop_map(|(n, tag, desc, len)| {
                Body::Refs(
                    (0..n)
                        .map(|i| Ref {
                            backend: (i % 2) as u8,
                            pool_id: 1,
                            desc: desc ^ i as u32,
                            generation: 1,
                            tag,
                            len,
                        })
                        .collect(),
                )
            }),
        ];
        (any::<u64>(), 1u32.., any::<u32>(), payload, 0u8..9).prop_map(|(id, m, dl, p, k)| {
            match (k, p) {
                (0, p) => Frame::request(id, m, dl, p),
                (1, p) => Frame::response(id, Status::Ok, p),
                (2, Body::Refs(rs)) => Frame::echo(id, rs[0]),
                (3, _) => Frame::refused(id, "shutting down"),
                (4, _) => Frame::go_away(id),
                (5, p) => {
                    let meta = crate::metadata::Metadata::new()
                        .with("trace-id", id.to_le_bytes())
                        .and_then(|m| m.with("x", vec![0; (dl % 300) as usize]))
                        .unwrap_or_default();
                    Frame::request(id, m, dl, p).with_meta(meta)
                }
                (6, p) => {
                    let meta = crate::metadata::Metadata::new()
                        .with("retry-after-ms", dl.to_string())
                        .unwrap_or_default();
                    let answer = match p {
                        p if id % 2 == 0 => Frame::response(id, Status::Ok, p),
                        // (An error's payload is its message, if any.)
                        Body::Refs(_) => Frame::response(id, Status::Internal, Body::None),
                        p => Frame::response(id, Status::ResourceExhausted, p),
                    };
                    answer.with_meta(meta)
                }
                (7, p) if id % 3 == 0 => Frame::item(id, p),
                (7, _) if id % 3 == 1 => Frame::credit(id, m),
                (7, p) => {
                    let mut f = Frame::request(id, m, dl, p);
                    f.flags = FLAG_STREAM;
                    f
                }
                _ => Frame::cancel(id),
            }
        })
    }

    proptest! {
        #[test]
        fn roundtrip(f in frames()) {
            let b = f.encode();
            prop_assert_eq!(b.len(), f.encoded_len());
            prop_assert_eq!(Frame::decode(&b, &Limits::default()), Ok(Some((f, b.len()))));
        }

        #[test]
        fn a_stream_split_anywhere_decodes_the_same(fs in proptest::collection::vec(frames(), 1..6), cut in any::<usize>()) {
            let mut stream = Vec::new();
            for f in &fs {
                f.encode_into(&mut stream);
            }
            // Feed the bytes in two parts: no frame is lost, duplicated or torn.
            let cut = cut % (stream.len() + 1);
            let mut buf = stream[..cut].to_vec();
            let mut got = Vec::new();
            let mut rest = &stream[cut..];
            loop {
                match Frame::decode(&buf, &Limits::default()).unwrap() {
                    Some((f, used)) => {
                        got.push(f);
                        buf.drain(..used);
                    }
                    None if !rest.is_empty() => {
                        buf.extend_from_slice(rest);
                        rest = &[];
                    }
                    None => break,
                }
            }
            prop_assert_eq!(got, fs);
            prop_assert!(buf.is_empty());
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            fuzz_decode(&b);
            let _ = Frame::decode(&b, &Limits::default());
        }
    }

    /// A record's rest is taken by an inline payload only: after a Refs
    /// or an empty frame the vector is left, with its room, for the next
    /// record.
    #[test]
    fn decode_record_leaves_the_rest_unless_an_inline_payload_takes_it() {
        let l = Limits::default();
        let mut rest = Vec::with_capacity(64);
        for f in [
            Frame::request(1, 9, 0, Body::Refs(vec![a_ref()])),
            Frame::response(1, Status::Ok, Body::None),
        ] {
            let b = f.encode();
            rest.clear();
            rest.extend_from_slice(&b[HEADER_LEN..]);
            let room = rest.as_ptr();
            assert_eq!(Frame::decode_record(&b[..HEADER_LEN], &mut rest, &l), Ok(f));
            assert_eq!(rest.as_ptr(), room, "the vector is kept");
        }
        let inline = Frame::response(2, Status::Ok, Body::Inline(vec![5; 8].into()));
        let b = inline.encode();
        rest.clear();
        rest.extend_from_slice(&b[HEADER_LEN..]);
        assert_eq!(
            Frame::decode_record(&b[..HEADER_LEN], &mut rest, &l),
            Ok(inline)
        );
        assert_eq!(rest.capacity(), 0, "the payload took the vector");
    }

    #[test]
    fn stream_frames_are_checked_for_their_kind() {
        let l = Limits::default();
        let decode = |f: &Frame| Frame::decode(&f.encode(), &l).map(|d| d.map(|(f, _)| f));
        let inconsistent = |f: Frame| matches!(decode(&f), Err(FrameError::Inconsistent(_)));
        // Well-formed: a streaming request, items of each payload kind, a
        // credit.
        let mut req = Frame::request(3, 9, 0, Body::Inline(vec![1].into()));
        req.flags = FLAG_STREAM;
        for f in [
            req.clone(),
            Frame::item(3, Body::None),
            Frame::item(3, Body::Inline(vec![7; 10].into())),
            Frame::item(3, Body::Refs(vec![a_ref()])),
            Frame::credit(3, 16),
        ] {
            assert_eq!(decode(&f), Ok(Some(f.clone())));
        }
        // Only a request asks for a stream.
        let mut answer = Frame::response(3, Status::Ok, Body::None);
        answer.flags = FLAG_STREAM;
        assert!(inconsistent(answer));
        let mut item = Frame::item(3, Body::None);
        item.flags = FLAG_STREAM;
        assert!(inconsistent(item));
        // An item carries no status, method, deadline or echo (metadata,
        // since version 9, it may).
        let mut item = Frame::item(3, Body::None);
        item.status = Status::Internal;
        assert!(inconsistent(item));
        let mut item = Frame::item(3, Body::None);
        item.method = 5;
        assert!(inconsistent(item));
        let mut item = Frame::item(3, Body::Refs(vec![a_ref()]));
        item.flags = FLAG_ECHO;
        assert!(inconsistent(item));
        // A credit grants at least one item, and carries nothing else.
        assert!(inconsistent(Frame::credit(3, 0)));
        let mut credit = Frame::credit(3, 1);
        credit.payload = Body::Inline(vec![1].into());
        assert!(inconsistent(credit));
        let mut credit = Frame::credit(3, 1);
        credit.deadline_us = 10;
        assert!(inconsistent(credit));
        let mut credit = Frame::credit(3, 1);
        credit.status = Status::Cancelled;
        assert!(inconsistent(credit));
        // Frames of version 6 are refused (no stream kinds there).
        let mut old = Frame::item(3, Body::None).encode();
        old[2] = 6;
        assert_eq!(Frame::decode(&old, &l), Err(FrameError::Version(6)));
    }

    #[test]
    fn malformed_frames_get_typed_errors() {
        let l = Limits::default();
        let good = Frame::request(
            5,
            method_id("shop/images/resize"),
            1000,
            Body::Refs(vec![a_ref()]),
        )
        .encode();
        let bad = |at: usize, v: u8| {
            let mut b = good.clone();
            b[at] = v;
            Frame::decode(&b, &l)
        };
        assert_eq!(bad(0, 0), Err(FrameError::Magic([0, 0x52])));
        assert_eq!(
            Frame::decode(&[0x00, 0x52], &l),
            Err(FrameError::Magic([0, 0x52])),
            "early, from 2 bytes"
        );
        assert_eq!(bad(2, 8), Err(FrameError::Version(8)));
        assert_eq!(bad(3, 0), Err(FrameError::Kind(0)));
        assert_eq!(bad(4, 8), Err(FrameError::Reserved("flags")));
        assert_eq!(bad(5, 1), Err(FrameError::Reserved("flags")));
        // The window flag: on a stream's request only.
        assert!(
            matches!(bad(4, FLAG_WINDOW as u8), Err(FrameError::Inconsistent(_))),
            "a request that is no stream's, flagged with a window"
        );
        assert!(
            bad(4, (FLAG_WINDOW | FLAG_STREAM) as u8).is_ok(),
            "a stream's request with its window"
        );
        let mut windowed = Frame::response(4, Status::Ok, Body::None);
        windowed.flags = FLAG_WINDOW;
        assert!(
            matches!(
                Frame::decode(&windowed.encode(), &l),
                Err(FrameError::Inconsistent(_))
            ),
            "an answer flagged with a window"
        );
        // The caller's stream: its flag on requests only, the last marker
        // on empty items only.
        assert!(
            bad(4, FLAG_CALLER_STREAM as u8).is_ok(),
            "a request with items"
        );
        assert!(
            matches!(bad(4, FLAG_LAST as u8), Err(FrameError::Inconsistent(_))),
            "a request flagged last"
        );
        let last = Frame::last_item(4);
        assert_eq!(Frame::decode(&last.encode(), &l).unwrap().unwrap().0, last);
        let mut full = Frame::item(4, Body::Inline(Bytes::from_static(b"x")));
        full.flags = FLAG_LAST;
        assert!(
            matches!(
                Frame::decode(&full.encode(), &l),
                Err(FrameError::Inconsistent(_))
            ),
            "a last marker with a payload"
        );
        let mut answer = Frame::response(4, Status::Ok, Body::None);
        answer.flags = FLAG_CALLER_STREAM;
        assert!(
            matches!(
                Frame::decode(&answer.encode(), &l),
                Err(FrameError::Inconsistent(_))
            ),
            "an answer flagged with the caller's items"
        );
        assert!(
            matches!(bad(4, 2), Err(FrameError::Inconsistent(_))),
            "a request flagged as refused"
        );
        let refused = Frame::refused(5, "shutting down");
        let (back, _) = Frame::decode(&refused.encode(), &l).unwrap().unwrap();
        assert_eq!(back, refused);
        let mut ok_refused = Frame::response(5, Status::Ok, Body::None);
        ok_refused.flags = FLAG_REFUSED;
        assert!(
            matches!(
                Frame::decode(&ok_refused.encode(), &l),
                Err(FrameError::Inconsistent(_))
            ),
            "a successful answer flagged as refused"
        );
        assert!(
            matches!(bad(4, 1), Err(FrameError::Inconsistent(_))),
            "a request flagged as an echo"
        );
        let echo = Frame::echo(5, a_ref()).encode();
        assert!(Frame::decode(&echo, &l).is_ok());
        let mut two = Frame::response(5, Status::Ok, Body::Refs(vec![a_ref(), a_ref()]));
        two.flags = FLAG_ECHO;
        assert!(
            matches!(
                Frame::decode(&two.encode(), &l),
                Err(FrameError::Inconsistent(_))
            ),
            "an echo of two Refs"
        );
        let head = &good[..HEADER_LEN];
        assert_eq!(
            Frame::decode_record(head, &mut good[HEADER_LEN..].to_vec(), &l),
            Ok(Frame::decode(&good, &l).unwrap().unwrap().0)
        );
        assert_eq!(
            Frame::decode_record(head, &mut good[HEADER_LEN + 1..].to_vec(), &l),
            Err(FrameError::Record {
                record: good.len() - 1,
                frame: Some(good.len())
            })
        );
        assert_eq!(
            Frame::decode_record(&good[..10], &mut Vec::new(), &l),
            Err(FrameError::Record {
                record: 10,
                frame: None
            })
        );
        assert_eq!(
            bad(30, 1),
            Err(FrameError::MetaTooLarge {
                len: 1 << 16,
                max: l.max_meta
            })
        );
        // Metadata: only on requests, answers and items, and well formed,
        // in both decoders.
        let meta = crate::metadata::Metadata::new()
            .with("trace-id", "t1")
            .unwrap();
        let with = Frame::request(4, 9, 0, Body::Inline(vec![1, 2, 3].into())).with_meta(meta);
        let b = with.encode();
        assert_eq!(Frame::decode(&b, &l), Ok(Some((with.clone(), b.len()))));
        let mut rest = b[HEADER_LEN..].to_vec();
        assert_eq!(
            Frame::decode_record(&b[..HEADER_LEN], &mut rest, &l),
            Ok(with)
        );
        assert_eq!(Frame::decode(&b[..b.len() - 1], &l), Ok(None), "cut short");
        let mut upper = b.clone();
        upper[HEADER_LEN + 3 + 1] = b'T';
        assert!(matches!(
            Frame::decode(&upper, &l),
            Err(FrameError::Metadata(_))
        ));
        let mut rest = upper[HEADER_LEN..].to_vec();
        assert!(matches!(
            Frame::decode_record(&upper[..HEADER_LEN], &mut rest, &l),
            Err(FrameError::Metadata(_))
        ));
        let meta = crate::metadata::Metadata::new().with("k", "v").unwrap();
        let answer = Frame::response(4, Status::Internal, Body::None).with_meta(meta);
        let b = answer.encode();
        assert_eq!(Frame::decode(&b, &l), Ok(Some((answer, b.len()))));
        let meta = crate::metadata::Metadata::new().with("k", "v").unwrap();
        let item = Frame::item(4, Body::None).with_meta(meta);
        let b = item.encode();
        assert_eq!(Frame::decode(&b, &l), Ok(Some((item, b.len()))));
        let mut cancel = Frame::cancel(4).encode();
        cancel[28] = 3;
        cancel.extend_from_slice(&[1, b'k', 0]);
        assert!(matches!(
            Frame::decode(&cancel, &l),
            Err(FrameError::Inconsistent(_))
        ));
        assert_eq!(bad(6, 3), Err(FrameError::PayloadKind(3)));
        assert_eq!(bad(7, 99), Err(FrameError::Status(99)));
        assert!(
            matches!(bad(7, 2), Err(FrameError::Inconsistent(_))),
            "a request with a status"
        );
        assert!(matches!(bad(24, 41), Err(FrameError::RefsLength(41))));
        let mut b = good.clone();
        b[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            Frame::decode(&b, &l),
            Err(FrameError::TooLarge {
                len: u32::MAX,
                max: l.max_payload
            })
        );
        let mut b = good.clone();
        b[32] = 9; // the Ref's version byte
        assert!(matches!(
            Frame::decode(&b, &l),
            Err(FrameError::Ref { index: 0, .. })
        ));
        let many = Frame::response(1, Status::Ok, Body::Refs(vec![a_ref(); 65])).encode();
        assert_eq!(
            Frame::decode(&many, &l),
            Err(FrameError::TooManyRefs { count: 65, max: 64 })
        );
        for f in [Frame::cancel(3), Frame::go_away(3)] {
            // A payload length, a method, a deadline, a status, a flag.
            for (at, v) in [(24, 1), (16, 1), (20, 1), (7, 4), (4, 2)] {
                let mut c = f.encode();
                c[at] = v;
                assert!(
                    matches!(Frame::decode(&c, &l), Err(FrameError::Inconsistent(_))),
                    "{:?} with byte {at} = {v}",
                    f.kind
                );
            }
        }
        let mut g = Frame::go_away(3).encode();
        g[3] = 8;
        assert_eq!(Frame::decode(&g, &l), Err(FrameError::Kind(8)));
        // A part carries bytes of its frame and nothing else; its flags
        // are its own.
        let part = Frame::part(3, FLAG_PART_FIRST, Bytes::from_static(b"abc"));
        assert_eq!(Frame::decode(&part.encode(), &l).unwrap().unwrap().0, part);
        for (at, v) in [(16, 1), (20, 1), (7, 4), (4, 1), (6, 0), (28, 1)] {
            let mut c = part.encode();
            c[at] = v;
            assert!(
                matches!(
                    Frame::decode(&c, &l),
                    Err(FrameError::Inconsistent(_) | FrameError::Reserved(_))
                ),
                "a part with byte {at} = {v}"
            );
        }
        let mut c = Frame::cancel(3).encode();
        c[4] = FLAG_PART_LAST as u8;
        assert_eq!(Frame::decode(&c, &l), Err(FrameError::Reserved("flags")));
        let err_refs = Frame::response(1, Status::Internal, Body::Refs(vec![a_ref()])).encode();
        assert!(matches!(
            Frame::decode(&err_refs, &l),
            Err(FrameError::Inconsistent(_))
        ));
        // Incomplete is not an error.
        assert_eq!(Frame::decode(&good[..10], &l), Ok(None));
        assert_eq!(Frame::decode(&good[..good.len() - 1], &l), Ok(None));
    }

    #[test]
    fn method_ids_are_stable_and_never_zero() {
        assert_eq!(
            method_id("shop/images/resize"),
            method_id("shop/images/resize")
        );
        assert_ne!(method_id("a/b"), method_id("a/c"));
        assert_ne!(method_id(""), 0);
    }
}

//! The TCP transport: the same frames over a stream socket, for peers that
//! do not share a pool (other hosts) or cannot map it.
//!
//! Frames are self-delimiting (the fixed header carries the payload
//! length), so the stream is a plain sequence of frames; the decoder
//! enforces [`Limits`] before it buffers a payload. Nagle is off on both
//! ends. A connection starts with a hello each way (version 4, [`Identity`]
//! tells the exchange): `DMRPCTC4`, the sender's pool id and its
//! memory-server domain (a digest of the memory servers it is a client
//! of), each 0 if none, a nonce and flags. When the pool ids are equal and
//! the peer proves it is attached, the two ends share a pool and may pass
//! pool Refs; when the domains are equal they may pass memory-server Refs;
//! otherwise every payload travels inline (by value, up to
//! [`MAX_INLINE`]). A peer of another version is refused.
//!
//! A server that stops sends each client a go-away frame with the highest
//! call id it took from it, then closes: the client sends the requests it
//! never took to another server (see `transport::goaway`).
//!
//! The server has no I/O thread: its dispatcher waits on the sockets
//! itself (epoll), reads the requests and writes the answers, so a call
//! crosses no thread inside the server. It reads a connection only when
//! that connection's last request was taken, so a client that sends
//! faster than the service runs is held back by TCP's own flow control.
//! The blocking client uses the socket directly from the calling thread.
//!
//! Both wait by polling before they sleep (the client its socket, the
//! dispatcher its sockets), for an adaptive budget
//! ([`dm_sys::poll::Spin`]): on the test machine a sleeping thread's
//! wake-up costs more than the loopback round trip.

use super::{ConnId, Connection, FrameRx, FrameTx, Listener, Sharing, TransportError, Waker};
use crate::frame::{Frame, FrameError, Limits, HEADER_LEN};
use dm_sys::poll::{wait_io, ReadySet, Spin};
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Magic and version of the hello exchange (version 4: with the access
/// key's proofs and flags).
pub const HELLO: [u8; 8] = *b"DMRPCTC4";
/// Bytes of a hello: magic, pool id, memory-server domain, a nonce, flags.
pub const HELLO_LEN: usize = 48;
/// Bytes of an end's proofs: of the pool, then of the access key.
pub const PROOFS_LEN: usize = 64;
/// Bytes of one proof.
const PROOF_LEN: usize = 32;
/// Hello flag: this end has an access key (a server: it serves only
/// clients that prove it, and answers their proofs with a verdict byte).
pub const FLAG_KEYED: u64 = 1;
/// Hello flag of a server: it has as many connections as it takes, and
/// closes this one.
pub const FLAG_FULL: u64 = 2;
/// The verdict byte of a keyed server: the client's proof held.
pub const VERDICT_OK: u8 = 0;
/// Contexts of the proofs.
const POOL_PROOF: &[u8] = b"dmrpc-tcp-pool-proof";
const ACCESS_PROOF: &[u8] = b"dmrpc-tcp-access-proof";

/// What an end says about itself in the hello: the pool it is attached to
/// and the memory servers it uses (0: none), the pool's secret
/// ([`dm_pool::Pool::secret`]) with which it proves that it is attached,
/// and the access key the two ends share, if any.
///
/// The exchange: the client sends its hello (with a random nonce); the
/// server answers its own hello and its proofs; the client sends its
/// proofs; a server with an access key then sends one verdict byte
/// ([`VERDICT_OK`], or another and it closes). A proof is HMAC-SHA-256
/// ([`dm_pool::auth`]) of the role and both nonces, under the pool's
/// secret or under the access key (zeros without one).
///
/// - Pool Refs travel on the connection only if both ends name the same
///   pool and the peer's pool proof holds: a peer that merely claims the
///   pool id (which a hello discloses) gets every payload by value, and
///   cannot be handed pool Refs it could never release.
/// - A server with an access key serves only clients whose access proof
///   holds. A client with one connects only to a server whose access
///   proof holds (it cannot be an impostor listening on the address).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Identity {
    /// Pool id.
    pub pool: u64,
    /// Memory-server domain ([`crate::Node::remote_domain`]).
    pub remote: u64,
    /// The pool's secret (None: this end proves nothing, and shares no
    /// pool Refs over TCP).
    pub key: Option<[u8; 32]>,
    /// The access key ([`crate::Config::tcp_key`]).
    pub access: Option<dm_pool::auth::Key>,
}

/// What the peer said in its hello.
#[derive(Debug, Clone, Copy)]
struct Hello {
    pool: u64,
    remote: u64,
    nonce: [u8; 16],
    flags: u64,
}

impl Identity {
    /// Which Refs both ends can use, given the peer's hello and whether
    /// its proof of the pool holds.
    fn sharing(self, theirs: &Hello, proved: bool) -> Sharing {
        Sharing {
            pool: self.pool != 0 && self.pool == theirs.pool && proved,
            remote: self.remote != 0 && self.remote == theirs.remote,
        }
    }

    fn pool_key(&self) -> Option<Key> {
        self.key.map(Key::from_bytes)
    }

    /// This end's proofs (of the pool, of the access key), as `role`
    /// (b'C' client, b'S' server), of the nonces `(client's, server's)`;
    /// zeros for a key it does not have.
    fn proofs(&self, role: u8, (c, s): (&[u8; 16], &[u8; 16])) -> [u8; PROOFS_LEN] {
        let mut out = [0u8; PROOFS_LEN];
        for (k, ctx, at) in [
            (self.pool_key(), POOL_PROOF, 0),
            (self.access, ACCESS_PROOF, PROOF_LEN),
        ] {
            if let Some(k) = k {
                out[at..at + PROOF_LEN].copy_from_slice(&k.proof(ctx, role, c, s));
            }
        }
        out
    }

    /// Whether the peer's proofs (in `role`) hold under this end's keys:
    /// (it is attached to the same pool, it holds the access key).
    /// Compared in constant time.
    fn checks(
        &self,
        role: u8,
        (c, s): (&[u8; 16], &[u8; 16]),
        proofs: &[u8; PROOFS_LEN],
    ) -> (bool, bool) {
        let holds = |k: Option<Key>, ctx, p: &[u8]| k.is_some_and(|k| k.verify(ctx, role, c, s, p));
        (
            holds(self.pool_key(), POOL_PROOF, &proofs[..PROOF_LEN]),
            holds(self.access, ACCESS_PROOF, &proofs[PROOF_LEN..]),
        )
    }

    fn flags(&self) -> u64 {
        if self.access.is_some() {
            FLAG_KEYED
        } else {
            0
        }
    }
}

use dm_pool::auth::{nonce, Key};
/// Largest inline payload over TCP.
pub const MAX_INLINE: usize = 16 << 20;
/// How long the dispatcher waits for room in a client's socket for an
/// answer before it drops the connection.
const REPLY_TIMEOUT: Duration = Duration::from_secs(1);
/// Bytes of requests the dispatcher reads ahead on a connection while it
/// waits for room for an answer on it (so a client that sends several
/// requests before it reads any answer is served, within this bound).
const PENDING_MAX: usize = 64 << 20;
/// How long a new connection may take to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// What a TCP server takes from its clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpLimits {
    /// Connections at once; one more is told so in its hello
    /// ([`FLAG_FULL`]: the client gets `ResourceExhausted`) and closed.
    pub max_connections: usize,
    /// A frame begun must arrive whole within this, or its connection is
    /// dropped (a client that sends slowly holds no memory for long).
    pub frame_timeout: Duration,
}

impl Default for TcpLimits {
    fn default() -> Self {
        TcpLimits {
            max_connections: 1024,
            frame_timeout: Duration::from_secs(10),
        }
    }
}

fn limits() -> Limits {
    Limits {
        max_payload: MAX_INLINE as u32,
        ..Limits::default()
    }
}

fn hello(me: &Identity, nonce: &[u8; 16]) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[..8].copy_from_slice(&HELLO);
    h[8..16].copy_from_slice(&me.pool.to_le_bytes());
    h[16..24].copy_from_slice(&me.remote.to_le_bytes());
    h[24..40].copy_from_slice(nonce);
    h[40..].copy_from_slice(&me.flags().to_le_bytes());
    h
}

fn parse_hello(h: &[u8; HELLO_LEN]) -> Result<Hello, TransportError> {
    if h[..8] != HELLO {
        return Err(TransportError::Protocol(
            "the peer does not speak dmrpc over TCP version 4 (bad hello)".into(),
        ));
    }
    let at = |i: usize| {
        let mut x = [0u8; 8];
        x.copy_from_slice(&h[i..i + 8]);
        u64::from_le_bytes(x)
    };
    let mut nonce = [0u8; 16];
    nonce.copy_from_slice(&h[24..40]);
    Ok(Hello {
        pool: at(8),
        remote: at(16),
        nonce,
        flags: at(40),
    })
}

fn unavailable(e: std::io::Error) -> TransportError {
    TransportError::Unavailable(format!("TCP: {e}"))
}

/// Connects to `addr` as `me`: Refs are allowed on the connection only
/// if the server shares the pool (or the memory servers).
/// `spin` is the longest busy-poll of the socket before a read blocks
/// ([`dm_sys::poll::Spin`]).
pub fn connect(
    addr: &str,
    me: Identity,
    timeout: Duration,
    spin: Duration,
) -> Result<Connection, TransportError> {
    let sa: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| TransportError::Unavailable(format!("cannot resolve {addr:?}: {e}")))?
        .collect();
    let mut last = None;
    for a in sa {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => return handshake(s, me, spin),
            Err(e) => last = Some(e),
        }
    }
    Err(last.map_or_else(
        || TransportError::Unavailable(format!("{addr:?} has no address")),
        unavailable,
    ))
}

fn handshake(mut s: TcpStream, me: Identity, spin: Duration) -> Result<Connection, TransportError> {
    s.set_nodelay(true).map_err(unavailable)?;
    s.set_read_timeout(Some(HELLO_TIMEOUT))
        .map_err(unavailable)?;
    let mine = nonce();
    s.write_all(&hello(&me, &mine)).map_err(unavailable)?;
    let mut h = [0u8; HELLO_LEN + PROOFS_LEN];
    s.read_exact(&mut h).map_err(unavailable)?;
    let theirs = parse_hello(h[..HELLO_LEN].try_into().unwrap_or(&[0; HELLO_LEN]))?;
    let nonces = (&mine, &theirs.nonce);
    let proofs: &[u8; PROOFS_LEN] = h[HELLO_LEN..].try_into().unwrap_or(&[0; PROOFS_LEN]);
    let (proved, holds_key) = me.checks(b'S', nonces, proofs);
    let denied = |m: String| TransportError::Pool(dm_pool::Error::Unauthenticated(m));
    let peer = s.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string());
    if me.access.is_some() && !holds_key {
        return Err(denied(format!(
            "the server at {peer} did not prove it holds this client's key: it is not the \
             service meant, or it runs with another key (or none)"
        )));
    }
    if theirs.flags & FLAG_FULL != 0 {
        return Err(TransportError::Pool(dm_pool::Error::ResourceExhausted {
            what: "TCP connections",
        }));
    }
    if theirs.flags & FLAG_KEYED != 0 && me.access.is_none() {
        return Err(denied(format!(
            "the server at {peer} serves only clients with its key: give this client the \
             service's key file (`Config::tcp_key`; `dmrpc call --key-file`)"
        )));
    }
    s.write_all(&me.proofs(b'C', nonces)).map_err(unavailable)?;
    if theirs.flags & FLAG_KEYED != 0 {
        let mut verdict = [1u8];
        s.read_exact(&mut verdict).map_err(unavailable)?;
        if verdict[0] != VERDICT_OK {
            return Err(denied(format!(
                "the server at {peer} refused this client's key"
            )));
        }
    }
    let refs = me.sharing(&theirs, proved);
    let r = s.try_clone().map_err(unavailable)?;
    let goaway = Arc::new(super::GoAwayWord::default());
    Ok(Connection {
        tx: Box::new(TcpTx { s }),
        rx: Box::new(TcpRx {
            s: r,
            rx: Incoming::new(),
            spin: Spin::new(spin),
            goaway: goaway.clone(),
        }),
        max_inline: MAX_INLINE,
        refs,
        goaway,
    })
}

struct TcpTx {
    s: TcpStream,
}

impl FrameTx for TcpTx {
    fn send(&mut self, f: &Frame, deadline: Option<Instant>) -> Result<bool, TransportError> {
        let len = f.encoded_len();
        if len > MAX_INLINE + crate::frame::HEADER_LEN {
            return Err(TransportError::TooLarge {
                len,
                max: MAX_INLINE + crate::frame::HEADER_LEN,
            });
        }
        // A deadline that has passed still gets one short attempt (a
        // cancel is sent that way), as the other transports try once.
        let wait = deadline.map(|d| {
            d.saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        });
        self.s.set_write_timeout(wait).map_err(unavailable)?;
        match write_frame(&mut self.s, f) {
            Ok(()) => Ok(true),
            // A partial write leaves the stream mid-frame: the connection
            // cannot be used again, so a timeout here is fatal too.
            Err(e) => Err(unavailable(e)),
        }
    }
}

/// `f`'s bytes as three slices: its header (`head`, from
/// [`Frame::header`]), an inline payload where it lies (no copy into one
/// buffer) and its metadata, encoded into `encoded`; a frame of Refs
/// encoded whole into `encoded` (the other slices then empty).
fn frame_parts<'a>(
    f: &'a Frame,
    head: &'a [u8; HEADER_LEN],
    encoded: &'a mut Vec<u8>,
) -> [std::io::IoSlice<'a>; 3] {
    use std::io::IoSlice;
    match &f.payload {
        crate::frame::Body::Inline(b) => {
            if !f.meta.is_empty() {
                *encoded = f.meta.encode();
            }
            [IoSlice::new(head), IoSlice::new(b), IoSlice::new(encoded)]
        }
        _ => {
            *encoded = f.encode();
            [IoSlice::new(encoded), IoSlice::new(&[]), IoSlice::new(&[])]
        }
    }
}

/// Writes `f` (a blocking socket).
fn write_frame(s: &mut TcpStream, f: &Frame) -> std::io::Result<()> {
    let (head, mut encoded) = (f.header(), Vec::new());
    dm_sys::io::write_all_vectored(s, &mut frame_parts(f, &head, &mut encoded))
}

/// Payloads larger than this are read straight into their own vector once
/// their header has arrived: no staging buffer, no second copy.
const DIRECT: usize = 64 << 10;

/// Bytes a connection's receive buffer starts with (a frame up to
/// [`DIRECT`] is assembled in it).
const RX_BUF: usize = 128 << 10;

/// A frame whose payload is being read into the vector that becomes it.
struct Partial {
    head: [u8; HEADER_LEN],
    body: Vec<u8>,
    got: usize,
}

impl Partial {
    /// After [`Frame::decode`] asked for more bytes of `have` (so its
    /// header, if whole, is valid): a partial frame for a large payload,
    /// with the payload (and metadata) bytes already buffered, and the
    /// bytes it took.
    fn start(have: &[u8]) -> Option<(Partial, usize)> {
        let h = have.get(..HEADER_LEN)?;
        let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let len = u32_at(24) as usize + u32_at(28) as usize;
        if len <= DIRECT {
            return None;
        }
        let take = (have.len() - HEADER_LEN).min(len);
        // Zeroed by the allocator (fresh pages for a large vector).
        let mut body = vec![0u8; len];
        body[..take].copy_from_slice(&have[HEADER_LEN..HEADER_LEN + take]);
        let mut head = [0u8; HEADER_LEN];
        head.copy_from_slice(h);
        Some((
            Partial {
                head,
                body,
                got: take,
            },
            HEADER_LEN + take,
        ))
    }

    fn whole(&self) -> bool {
        self.got == self.body.len()
    }

    fn frame(mut self) -> Result<Frame, FrameError> {
        Frame::decode_record(&self.head, &mut self.body, &limits())
    }
}

/// The bytes received on one connection and not yet taken as frames: a
/// buffer (zeroed once, when it grows) holding `buf[start..end]`, or the
/// large payload being read into its own vector.
struct Incoming {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    partial: Option<Partial>,
}

impl Incoming {
    fn new() -> Incoming {
        Incoming {
            buf: vec![0u8; RX_BUF],
            start: 0,
            end: 0,
            partial: None,
        }
    }

    /// Whether bytes of a frame are here whose rest has not come (after
    /// the whole frames were taken).
    fn mid_frame(&self) -> bool {
        self.partial.is_some() || self.start < self.end
    }

    /// The next whole frame, if its bytes are here; an error if they are
    /// malformed (the stream cannot be followed past them).
    fn take(&mut self) -> Result<Option<Frame>, FrameError> {
        if let Some(p) = &self.partial {
            if !p.whole() {
                return Ok(None);
            }
            return match self.partial.take() {
                Some(p) => p.frame().map(Some),
                None => Ok(None),
            };
        }
        let have = &self.buf[self.start..self.end];
        if let Some((f, used)) = Frame::decode(have, &limits())? {
            self.consume(used);
            return Ok(Some(f));
        }
        if let Some((p, used)) = Partial::start(have) {
            self.consume(used);
            let whole = p.whole();
            self.partial = Some(p);
            if whole {
                return self.take();
            }
        }
        Ok(None)
    }

    /// The bytes buffered (not those of a large payload).
    fn buffered(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// The first `N` bytes, taken, once they are here (the hello).
    fn take_prefix<const N: usize>(&mut self) -> Option<[u8; N]> {
        let b = self.buf.get(self.start..self.start + N)?;
        if self.end - self.start < N {
            return None;
        }
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        self.consume(N);
        Some(out)
    }

    fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        }
    }

    /// Where the next read goes: the rest of a large payload, or the free
    /// end of the buffer (moved down, or grown, to make room).
    fn space(&mut self) -> &mut [u8] {
        if let Some(p) = &mut self.partial {
            return &mut p.body[p.got..];
        }
        if self.end == self.buf.len() {
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                (self.start, self.end) = (0, self.end - self.start);
            } else {
                self.buf.resize(self.buf.len() * 2, 0);
            }
        }
        &mut self.buf[self.end..]
    }

    /// `n` bytes were read into [`Incoming::space`].
    fn filled(&mut self, n: usize) {
        match &mut self.partial {
            Some(p) => p.got += n,
            None => self.end += n,
        }
    }
}

struct TcpRx {
    s: TcpStream,
    rx: Incoming,
    /// The busy-poll before a blocking read.
    spin: Spin,
    /// Set from the server's go-away frame.
    goaway: Arc<super::GoAwayWord>,
}

impl TcpRx {
    /// The next whole frame buffered, if any. A go-away ends the
    /// connection: it is recorded, and the connection is unavailable.
    fn take(&mut self) -> Result<Option<Frame>, TransportError> {
        match self.rx.take()? {
            Some(f) if f.kind == crate::frame::Kind::GoAway => {
                self.goaway.say(f.call_id);
                Err(TransportError::Unavailable(
                    "the server stopped reading the TCP connection (go-away)".into(),
                ))
            }
            f => Ok(f),
        }
    }

    /// Takes the result of a read into the buffer's free space: `Ok(true)`
    /// to look again (bytes came, or the read was interrupted),
    /// `Ok(false)` if nothing came in time.
    fn took(&mut self, r: std::io::Result<usize>) -> Result<bool, TransportError> {
        match r {
            Ok(0) => Err(TransportError::Unavailable(
                "the server closed the TCP connection".into(),
            )),
            Ok(n) => {
                self.rx.filled(n);
                Ok(true)
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                Ok(false)
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(true),
            Err(e) => Err(unavailable(e)),
        }
    }
}

impl FrameRx for TcpRx {
    fn recv(&mut self, deadline: Option<Instant>) -> Result<Option<Frame>, TransportError> {
        loop {
            if let Some(f) = self.take()? {
                return Ok(Some(f));
            }
            let wait = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(w) if !w.is_zero() => Some(w),
                    _ => return Ok(None),
                },
                None => None,
            };
            let s = &mut self.s;
            let r = self.spin.read(s.as_raw_fd(), self.rx.space(), |to| {
                s.set_read_timeout(wait)?;
                s.read(to)
            });
            if !self.took(r)? {
                return Ok(None);
            }
        }
    }

    /// A frame already buffered, or whole in the socket now: reads what
    /// the socket has without waiting (an async call reading its own
    /// answer while it spins).
    fn try_recv(&mut self) -> Result<Option<Frame>, TransportError> {
        loop {
            if let Some(f) = self.take()? {
                return Ok(Some(f));
            }
            let r = dm_sys::poll::recv_nowait(self.s.as_raw_fd(), self.rx.space());
            if !self.took(r)? {
                return Ok(None);
            }
        }
    }
}

/// The token of the listening socket in the dispatcher's set.
const ACCEPT: u64 = u64::MAX;
/// The token of the waker's socket.
const WAKE: u64 = u64::MAX - 1;

/// A client's connection, as the dispatcher holds it.
struct ServerConn {
    /// The socket, non-blocking.
    s: TcpStream,
    /// What the client may be sent, once it has said hello.
    refs: Option<Sharing>,
    /// The client's hello and this end's nonce, once the hello came and
    /// until its proof does.
    hello: Option<(Hello, [u8; 16])>,
    /// When it was accepted (a hello is due within [`HELLO_TIMEOUT`]).
    opened: Instant,
    rx: Incoming,
    /// Frames taken from `rx` and not yet served (the connection is then
    /// in the ready queue): normally at most one, more while the
    /// dispatcher waits for room for an answer on this connection.
    pending: VecDeque<Frame>,
    /// Payload bytes in `pending`.
    pending_bytes: usize,
    /// The highest call id of the requests taken (said in the go-away).
    taken: u64,
    /// One connection more than the server takes: its hello is answered
    /// with [`FLAG_FULL`], and it is closed.
    full: bool,
    /// Since when a frame has been arriving (bytes of it buffered, the
    /// rest not come), if one is.
    partial_since: Option<Instant>,
}

impl ServerConn {
    fn push(&mut self, f: Frame) {
        self.pending_bytes += f.encoded_len();
        self.pending.push_back(f);
    }

    fn pop(&mut self) -> Option<Frame> {
        let f = self.pending.pop_front()?;
        self.pending_bytes -= f.encoded_len();
        Some(f)
    }
}

/// A service listening on TCP. There is no I/O thread: the dispatcher
/// waits on the sockets itself (epoll, after a busy-poll), reads the
/// requests and writes the answers, so a call crosses no thread inside
/// the server.
pub struct TcpListener {
    addr: SocketAddr,
    l: std::net::TcpListener,
    set: ReadySet,
    me: Identity,
    conns: HashMap<ConnId, ServerConn>,
    /// Connections with a frame taken, served in this order (one frame
    /// each per turn).
    ready: VecDeque<ConnId>,
    next_id: ConnId,
    /// Connections that have not said hello yet.
    hellos: usize,
    limits: TcpLimits,
    /// Connections with a frame arriving (`partial_since` set).
    partials: usize,
    /// When connections with a partial frame are next looked at.
    next_sweep: Instant,
    tokens: Vec<u64>,
    spin: Spin,
    stop: Arc<AtomicBool>,
    wake_rx: UnixStream,
    wake_tx: Arc<UnixStream>,
}

impl std::fmt::Debug for TcpListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpListener")
            .field("addr", &self.addr)
            .field("connections", &self.conns.len())
            .finish()
    }
}

impl TcpListener {
    /// Binds `addr` (`host:port`, port 0 for any). `me` is told to clients
    /// in the hello. `spin` is the longest busy-poll (adapted) of the
    /// sockets before the dispatcher sleeps on them.
    pub fn bind(
        addr: &str,
        me: Identity,
        stop: Arc<AtomicBool>,
        spin: Duration,
        limits: TcpLimits,
    ) -> Result<TcpListener, TransportError> {
        let l = std::net::TcpListener::bind(addr)
            .map_err(|e| TransportError::Unavailable(format!("cannot listen on {addr}: {e}")))?;
        l.set_nonblocking(true).map_err(unavailable)?;
        let local = l.local_addr().map_err(unavailable)?;
        let set = ReadySet::new().map_err(unavailable)?;
        set.add_with(l.as_raw_fd(), ACCEPT).map_err(unavailable)?;
        let (wake_rx, wake_tx) = UnixStream::pair().map_err(unavailable)?;
        wake_rx.set_nonblocking(true).map_err(unavailable)?;
        wake_tx.set_nonblocking(true).map_err(unavailable)?;
        set.add_with(wake_rx.as_raw_fd(), WAKE)
            .map_err(unavailable)?;
        Ok(TcpListener {
            addr: local,
            l,
            set,
            me,
            conns: HashMap::new(),
            ready: VecDeque::new(),
            next_id: 1,
            hellos: 0,
            limits,
            partials: 0,
            next_sweep: Instant::now(),
            tokens: Vec::new(),
            spin: Spin::new(spin),
            stop,
            wake_rx,
            wake_tx: Arc::new(wake_tx),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The next frame of the connection first in line, if any.
    fn take_ready(&mut self) -> Option<(ConnId, Frame)> {
        while let Some(id) = self.ready.pop_front() {
            let Some(c) = self.conns.get_mut(&id) else {
                continue;
            };
            let Some(f) = c.pop() else { continue };
            if f.kind == crate::frame::Kind::Request {
                c.taken = c.taken.max(f.call_id);
            }
            if c.pending.is_empty() {
                match c.rx.take() {
                    Ok(Some(g)) => c.push(g),
                    Ok(None) => {}
                    // Served up to the garbage, then dropped.
                    Err(_) => {
                        self.close(id);
                        return Some((id, f));
                    }
                }
            }
            if !c.pending.is_empty() {
                self.ready.push_back(id);
            }
            return Some((id, f));
        }
        None
    }

    /// Accepts every connection waiting.
    fn accept(&mut self) {
        loop {
            let s = match self.l.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // WouldBlock: none left; anything else (out of descriptors):
                // the connection stays queued for a later turn.
                Err(_) => return,
            };
            if s.set_nonblocking(true).is_err() || s.set_nodelay(true).is_err() {
                continue;
            }
            let n = self.conns.len();
            if n >= 2 * self.limits.max_connections {
                // Far beyond the cap: not even told.
                continue;
            }
            let id = self.next_id;
            self.next_id += 1;
            if self.set.add_with(s.as_raw_fd(), id).is_err() {
                continue;
            }
            self.conns.insert(
                id,
                ServerConn {
                    s,
                    refs: None,
                    hello: None,
                    opened: Instant::now(),
                    rx: Incoming::new(),
                    pending: VecDeque::new(),
                    pending_bytes: 0,
                    taken: 0,
                    full: n >= self.limits.max_connections,
                    partial_since: None,
                },
            );
            self.hellos += 1;
        }
    }

    /// Reads what connection `id` sent, until it has a frame pending
    /// (`upto` 0) or more than `upto` bytes of frames pending, or the
    /// socket is drained; takes its hello, then its frames (the first puts
    /// the connection in the ready queue). A connection that closed, broke
    /// the protocol or failed is dropped.
    fn pull(&mut self, id: ConnId, upto: usize) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let full = |c: &ServerConn| !c.pending.is_empty() && c.pending_bytes >= upto;
        if full(c) {
            // Served first; its socket is read once those frames are taken.
            return;
        }
        let mut ok = true;
        loop {
            match c.s.read(c.rx.space()) {
                Ok(0) => {
                    ok = false;
                    break;
                }
                Ok(n) => c.rx.filled(n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    ok = false;
                    break;
                }
            }
            if c.refs.is_none() && c.hello.is_none() {
                // Not dmrpc (or another version): no need to wait for the rest.
                let got = c.rx.buffered();
                if got[..got.len().min(HELLO.len())] != HELLO[..got.len().min(HELLO.len())] {
                    ok = false;
                    break;
                }
                match c.rx.take_prefix::<HELLO_LEN>() {
                    None => continue,
                    Some(h) => {
                        let mine = nonce();
                        let me = &self.me;
                        let full = c.full;
                        let answered = parse_hello(&h).ok().filter(|theirs| {
                            let mut out = [0u8; HELLO_LEN + PROOFS_LEN];
                            out[..HELLO_LEN].copy_from_slice(&hello(me, &mine));
                            if full {
                                let f = (me.flags() | FLAG_FULL).to_le_bytes();
                                out[40..HELLO_LEN].copy_from_slice(&f);
                            } else {
                                out[HELLO_LEN..]
                                    .copy_from_slice(&me.proofs(b'S', (&theirs.nonce, &mine)));
                            }
                            c.s.write_all(&out).is_ok() && !full
                        });
                        match answered {
                            Some(theirs) => c.hello = Some((theirs, mine)),
                            None => {
                                ok = false;
                                break;
                            }
                        }
                    }
                }
            }
            if let Some((theirs, mine)) = c.hello.filter(|_| c.refs.is_none()) {
                // The client's proofs, before any frame.
                match c.rx.take_prefix::<PROOFS_LEN>() {
                    None => continue,
                    Some(p) => {
                        let (proved, holds_key) = self.me.checks(b'C', (&theirs.nonce, &mine), &p);
                        if self.me.access.is_some() {
                            let verdict = if holds_key { VERDICT_OK } else { 1 };
                            if c.s.write_all(&[verdict]).is_err() || !holds_key {
                                ok = false;
                                break;
                            }
                        }
                        c.refs = Some(self.me.sharing(&theirs, proved));
                        c.hello = None;
                        self.hellos -= 1;
                    }
                }
            }
            let mut broken = false;
            while !full(c) {
                match c.rx.take() {
                    Ok(Some(f)) => {
                        if c.pending.is_empty() {
                            self.ready.push_back(id);
                        }
                        c.push(f);
                    }
                    Ok(None) => break,
                    Err(_) => {
                        broken = true;
                        break;
                    }
                }
            }
            if broken {
                ok = false;
                break;
            }
            if full(c) {
                break;
            }
        }
        // A frame begun and not finished must finish within the limit
        // (bytes still buffered while no frame is pending are such a frame).
        let was = c.partial_since.is_some();
        if c.pending.is_empty() && c.refs.is_some() && c.rx.mid_frame() {
            c.partial_since.get_or_insert_with(Instant::now);
        } else {
            c.partial_since = None;
        }
        match (was, c.partial_since.is_some()) {
            (false, true) => self.partials += 1,
            (true, false) => self.partials -= 1,
            _ => {}
        }
        // A connection that ended after whole requests still gets them
        // served (their answers then fail to send).
        if !ok && c.pending.is_empty() {
            self.close(id);
        }
    }

    /// Drops the connections whose frame has been arriving for longer
    /// than the limit (looked at a few times per limit); when to look
    /// next.
    fn expire_partials(&mut self) -> Option<Instant> {
        if self.partials == 0 {
            return None;
        }
        let now = Instant::now();
        let limit = self.limits.frame_timeout;
        if now >= self.next_sweep {
            self.next_sweep = now + limit / 4;
            let late: Vec<ConnId> = self
                .conns
                .iter()
                .filter(|(_, c)| c.partial_since.is_some_and(|t| now - t >= limit))
                .map(|(id, _)| *id)
                .collect();
            for id in late {
                self.close(id);
            }
        }
        (self.partials > 0).then_some(self.next_sweep)
    }

    fn close(&mut self, id: ConnId) {
        if let Some(c) = self.conns.remove(&id) {
            self.set.remove(c.s.as_raw_fd());
            if c.partial_since.is_some() {
                self.partials -= 1;
            }
            if c.refs.is_none() {
                self.hellos -= 1;
            }
        }
    }

    /// Drops the connections whose hello is overdue; when the next one is.
    fn expire_hellos(&mut self) -> Option<Instant> {
        if self.hellos == 0 {
            return None;
        }
        let now = Instant::now();
        let mut late = Vec::new();
        let mut due: Option<Instant> = None;
        for (id, c) in &self.conns {
            if c.refs.is_none() {
                let at = c.opened + HELLO_TIMEOUT;
                if at <= now {
                    late.push(*id);
                } else {
                    due = Some(due.map_or(at, |d| d.min(at)));
                }
            }
        }
        for id in late {
            self.close(id);
        }
        due
    }

    /// Handles what the set reported: new connections, bytes, the waker
    /// (`true`: it rang).
    fn handle(&mut self, tokens: &[u64]) -> bool {
        let mut woke = false;
        for &t in tokens {
            match t {
                ACCEPT => self.accept(),
                WAKE => {
                    let mut b = [0u8; 64];
                    while matches!((&self.wake_rx).read(&mut b), Ok(n) if n > 0) {}
                    woke = true;
                }
                id => self.pull(id, 0),
            }
        }
        woke
    }
}

impl Drop for TcpListener {
    fn drop(&mut self) {
        // Clients see their connections close.
        for c in self.conns.values() {
            let _ = c.s.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Listener for TcpListener {
    fn next(
        &mut self,
        deadline: Option<Instant>,
    ) -> Result<Option<(ConnId, Frame)>, TransportError> {
        loop {
            if self.stop.load(Ordering::Acquire) {
                return Ok(None);
            }
            if let Some(x) = self.take_ready() {
                return Ok(Some(x));
            }
            // Overdue hellos go first (a busy server polls without sleeping).
            let hello_due = match (self.expire_hellos(), self.expire_partials()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let mut tokens = std::mem::take(&mut self.tokens);
            let set = &self.set;
            let polled = self.spin.run(|| {
                let r = set.wait(&mut tokens, Some(Duration::ZERO));
                (r.is_err() || !tokens.is_empty()).then_some(r)
            });
            let r = match polled {
                Some(r) => r,
                None => {
                    let now = Instant::now();
                    let mut wait = deadline.map(|d| d.saturating_duration_since(now));
                    if let Some(due) = hello_due {
                        let w = due.saturating_duration_since(now);
                        wait = Some(wait.map_or(w, |x| x.min(w)));
                    }
                    let r = if wait.is_some_and(|w| w.is_zero()) {
                        tokens.clear();
                        Ok(())
                    } else {
                        self.set.wait(&mut tokens, wait)
                    };
                    self.spin.blocked(now.elapsed());
                    r
                }
            };
            if let Err(e) = r {
                self.tokens = tokens;
                return Err(unavailable(e));
            }
            let woke = self.handle(&tokens);
            self.tokens = tokens;
            if self.ready.is_empty() && (woke || deadline.is_some_and(|d| Instant::now() >= d)) {
                return Ok(None);
            }
        }
    }

    fn poll(&mut self) -> Result<Option<(ConnId, Frame)>, TransportError> {
        if let Some(x) = self.take_ready() {
            return Ok(Some(x));
        }
        let mut tokens = std::mem::take(&mut self.tokens);
        let r = self.set.wait(&mut tokens, Some(Duration::ZERO));
        if r.is_ok() {
            self.handle(&tokens);
        }
        self.tokens = tokens;
        r.map_err(unavailable)?;
        Ok(self.take_ready())
    }

    fn reply(&mut self, conn: ConnId, f: &Frame) -> Result<(), TransportError> {
        self.send_within(conn, f, Instant::now() + REPLY_TIMEOUT)
    }

    fn is_open(&self, conn: ConnId) -> bool {
        self.conns.contains_key(&conn)
    }

    fn max_inline(&self) -> usize {
        MAX_INLINE
    }

    fn refs(&self, conn: ConnId) -> Sharing {
        self.conns
            .get(&conn)
            .and_then(|c| c.refs)
            .unwrap_or_default()
    }

    fn connections(&self) -> usize {
        self.conns.len() - self.hellos
    }

    /// Sends each client that said hello its go-away (all within the time
    /// one answer gets), then ends the stream; the sockets close when the
    /// listener is dropped.
    fn go_away(&mut self) {
        let told: Vec<(ConnId, u64)> = self
            .conns
            .iter()
            .filter(|(_, c)| c.refs.is_some())
            .map(|(id, c)| (*id, c.taken))
            .collect();
        let until = Instant::now() + REPLY_TIMEOUT;
        for (id, taken) in told {
            if self.send_within(id, &Frame::go_away(taken), until).is_ok() {
                if let Some(c) = self.conns.get(&id) {
                    let _ = c.s.shutdown(std::net::Shutdown::Write);
                }
            }
        }
    }

    fn waker(&self) -> Waker {
        let w = self.wake_tx.clone();
        Waker(Arc::new(move || {
            let _ = (&*w).write(&[1]);
        }))
    }
}

impl TcpListener {
    /// Writes `f` to connection `conn`, waiting for room in its socket
    /// until `until` at the latest (then the connection is dropped).
    fn send_within(
        &mut self,
        conn: ConnId,
        f: &Frame,
        until: Instant,
    ) -> Result<(), TransportError> {
        let (head, mut encoded) = (f.header(), Vec::new());
        let mut parts = frame_parts(f, &head, &mut encoded);
        let mut parts: &mut [std::io::IoSlice<'_>] = &mut parts;
        // A client that does not take its answers by `until` (a second
        // for an answer: its socket stays full) loses its connection
        // rather than stalling the server. While it waits for room, the dispatcher reads that
        // client's next request, so a client busy sending one (and reading
        // its answers only after) is no deadlock.
        let why = loop {
            let Some(c) = self.conns.get_mut(&conn) else {
                return Err(TransportError::Unavailable(format!(
                    "connection {conn} is gone"
                )));
            };
            if parts.is_empty() {
                return Ok(());
            }
            match c.s.write_vectored(parts) {
                Ok(0) => break "it closed".to_string(),
                Ok(n) => std::io::IoSlice::advance_slices(&mut parts, n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let left = until.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break "it does not read its answers".to_string();
                    }
                    let read = c.pending_bytes < PENDING_MAX;
                    let fd = c.s.as_raw_fd();
                    match wait_io(fd, read, true, left) {
                        Ok(r) if r.read => self.pull(conn, PENDING_MAX),
                        Ok(_) => {}
                        Err(e) => break e.to_string(),
                    }
                }
                Err(e) => break e.to_string(),
            }
        };
        // Mid-frame the stream cannot be used again: end it.
        self.close(conn);
        Err(TransportError::Unavailable(format!(
            "connection {conn} dropped: {why}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{Body, Status};
    use crate::node::DEFAULT_TCP_SPIN as DEFAULT_SPIN;

    /// Large payloads are read straight into their own vector, across
    /// reads that stop at a deadline mid-payload, and frames around them
    /// (small, large, back to back) come out whole and in order.
    #[test]
    fn large_frames_arrive_whole_across_slow_reads_and_deadlines() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let big: Vec<u8> = (0..(1 << 20) + 7).map(|i| (i % 253) as u8).collect();
        let frames = vec![
            Frame::response(1, Status::Ok, Body::Inline(big.clone().into())),
            Frame::response(2, Status::Ok, Body::Inline(vec![9; 10].into())),
            Frame::response(
                3,
                Status::Ok,
                Body::Inline(big[..DIRECT + 1].to_vec().into()),
            ),
            Frame::response(4, Status::Ok, Body::Inline(big.clone().into())),
        ];
        let mut bytes = Vec::new();
        for f in &frames {
            f.encode_into(&mut bytes);
        }
        let peer = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut h = [0u8; HELLO_LEN];
            s.read_exact(&mut h).unwrap();
            s.write_all(&hello(&Identity::default(), &[0; 16])).unwrap();
            s.write_all(&[0; PROOFS_LEN]).unwrap();
            // The first frame in slow pieces (the reader's deadline passes
            // mid-payload), the rest in one go.
            let first = frames[0].encoded_len();
            for piece in bytes[..first].chunks(300_000) {
                s.write_all(piece).unwrap();
                std::thread::sleep(Duration::from_millis(30));
            }
            s.write_all(&bytes[first..]).unwrap();
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
        });
        let mut c = connect(
            &addr,
            Identity::default(),
            Duration::from_secs(5),
            DEFAULT_SPIN,
        )
        .unwrap();
        let mut got = Vec::new();
        let mut timeouts = 0;
        while got.len() < 4 {
            match c
                .rx
                .recv(Some(Instant::now() + Duration::from_millis(5)))
                .unwrap()
            {
                Some(f) => got.push(f),
                None => timeouts += 1,
            }
        }
        assert!(timeouts > 0, "a deadline passed mid-frame");
        let ids: Vec<u64> = got.iter().map(|f| f.call_id).collect();
        assert_eq!(ids, [1, 2, 3, 4]);
        assert_eq!(got[0].payload, Body::Inline(big.clone().into()));
        assert_eq!(got[1].payload, Body::Inline(vec![9; 10].into()));
        assert_eq!(
            got[2].payload,
            Body::Inline(big[..DIRECT + 1].to_vec().into())
        );
        assert_eq!(got[3].payload, Body::Inline(big.into()));
        drop(c);
        peer.join().unwrap();
    }
}

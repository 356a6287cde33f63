//! The TCP transport: the same frames over a stream socket, for peers that
//! do not share a pool (other hosts) or cannot map it.
//!
//! Frames are self-delimiting (the fixed header carries the payload
//! length), so the stream is a plain sequence of frames; the decoder
//! enforces [`Limits`] before it buffers a payload. Nagle is off on both
//! ends. A connection starts with a 24-byte hello each way (version 2):
//! `DMRPCTC2`, the sender's pool id and its memory-server domain (a digest
//! of the memory servers it is a client of), each 0 if none. When the pool
//! ids are equal the two ends share a pool and may pass pool Refs; when the
//! domains are equal they may pass memory-server Refs; otherwise every
//! payload travels inline (by value, up to [`MAX_INLINE`]). (Version 1's
//! hello was `DMRPCTCP` and the pool id: a version-1 peer is refused.)
//!
//! The server side reads on a tokio runtime of its own (one thread: accept
//! and socket reads for every connection), and hands frames to the
//! service's dispatcher through a bounded queue; a connection whose queue
//! is full stops being read (back-pressure through TCP). The dispatcher
//! writes the answers itself, on its own handle of the socket. The
//! blocking client uses the socket directly from the calling thread.
//!
//! Every thread that waits here polls before it sleeps (the client its
//! socket, the I/O thread its sockets, the dispatcher its queue), for an
//! adaptive budget ([`dm_sys::poll::Spin`]): on the test machine a
//! sleeping thread's wake-up costs more than the loopback round trip.

use super::{ConnId, Connection, FrameRx, FrameTx, Listener, Sharing, TransportError, Waker};
use crate::frame::{Frame, FrameError, Limits, HEADER_LEN};
use dm_sys::poll::{recv_nowait, IdlePoll, Spin};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{
    sync_channel, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError,
};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Magic and version of the hello exchange.
pub const HELLO: [u8; 8] = *b"DMRPCTC2";
/// Bytes of a hello.
const HELLO_LEN: usize = 24;

/// What an end says about itself in the hello: the pool it is attached to
/// and the memory servers it uses (0: none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Identity {
    /// Pool id.
    pub pool: u64,
    /// Memory-server domain ([`crate::Node::remote_domain`]).
    pub remote: u64,
}

impl Identity {
    /// Which Refs both ends can use.
    fn sharing(self, theirs: Identity) -> Sharing {
        Sharing {
            pool: self.pool != 0 && self.pool == theirs.pool,
            remote: self.remote != 0 && self.remote == theirs.remote,
        }
    }
}
/// Largest inline payload over TCP.
pub const MAX_INLINE: usize = 16 << 20;
/// Frames queued between the I/O thread and the dispatcher before the
/// I/O thread stops reading the connection.
pub const QUEUE_DEPTH: usize = 256;
/// How long the dispatcher waits for room in a client's socket for an
/// answer before it drops the connection.
const REPLY_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a new connection may take to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

fn limits() -> Limits {
    Limits {
        max_payload: MAX_INLINE as u32,
        ..Limits::default()
    }
}

fn hello(me: Identity) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[..8].copy_from_slice(&HELLO);
    h[8..16].copy_from_slice(&me.pool.to_le_bytes());
    h[16..].copy_from_slice(&me.remote.to_le_bytes());
    h
}

fn parse_hello(h: &[u8; HELLO_LEN]) -> Result<Identity, TransportError> {
    if h[..8] != HELLO {
        return Err(TransportError::Protocol(
            "the peer does not speak dmrpc over TCP version 2 (bad hello)".into(),
        ));
    }
    let at = |i: usize| {
        let mut x = [0u8; 8];
        x.copy_from_slice(&h[i..i + 8]);
        u64::from_le_bytes(x)
    };
    Ok(Identity {
        pool: at(8),
        remote: at(16),
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
    s.write_all(&hello(me)).map_err(unavailable)?;
    let mut h = [0u8; HELLO_LEN];
    s.read_exact(&mut h).map_err(unavailable)?;
    let refs = me.sharing(parse_hello(&h)?);
    let r = s.try_clone().map_err(unavailable)?;
    Ok(Connection {
        tx: Box::new(TcpTx { s }),
        rx: Box::new(TcpRx {
            s: r,
            buf: Vec::with_capacity(64 << 10),
            start: 0,
            partial: None,
            spin: Spin::new(spin),
        }),
        max_inline: MAX_INLINE,
        refs,
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

/// Writes `f` as its header and its payload, with no copy into one
/// buffer first.
fn write_frame(s: &mut TcpStream, f: &Frame) -> std::io::Result<()> {
    let head = f.header();
    let body: &[u8] = match &f.payload {
        crate::frame::Body::Inline(b) => b,
        _ => return s.write_all(&f.encode()),
    };
    let mut parts = [std::io::IoSlice::new(&head), std::io::IoSlice::new(body)];
    dm_sys::io::write_all_vectored(s, &mut parts)
}

/// Payloads larger than this are read straight into their own vector once
/// their header has arrived: no staging buffer, no second copy.
const DIRECT: usize = 64 << 10;

/// A frame whose payload is being read into the vector that becomes it.
struct Partial {
    head: [u8; HEADER_LEN],
    body: Vec<u8>,
    len: usize,
}

impl Partial {
    /// After [`Frame::decode`] asked for more bytes of `have` (so its
    /// header, if whole, is valid): a partial frame for a large payload,
    /// with the payload bytes already buffered, and the bytes it took.
    fn start(have: &[u8]) -> Option<(Partial, usize)> {
        let h = have.get(..HEADER_LEN)?;
        let len = u32::from_le_bytes([h[24], h[25], h[26], h[27]]) as usize;
        if len <= DIRECT {
            return None;
        }
        let take = (have.len() - HEADER_LEN).min(len);
        let mut body = Vec::with_capacity(len);
        body.extend_from_slice(&have[HEADER_LEN..HEADER_LEN + take]);
        let mut head = [0u8; HEADER_LEN];
        head.copy_from_slice(h);
        Some((Partial { head, body, len }, HEADER_LEN + take))
    }

    /// Bytes still to read.
    fn want(&self) -> u64 {
        (self.len - self.body.len()) as u64
    }

    fn frame(self) -> Result<Frame, FrameError> {
        Frame::decode_record(&self.head, self.body, &limits())
    }
}

struct TcpRx {
    s: TcpStream,
    buf: Vec<u8>,
    start: usize,
    partial: Option<Partial>,
    /// The busy-poll before a blocking read.
    spin: Spin,
}

impl FrameRx for TcpRx {
    fn recv(&mut self, deadline: Option<Instant>) -> Result<Option<Frame>, TransportError> {
        loop {
            if self.partial.as_ref().is_some_and(|p| p.want() == 0) {
                if let Some(p) = self.partial.take() {
                    return Ok(Some(p.frame()?));
                }
            }
            if self.partial.is_none() {
                let have = &self.buf[self.start..];
                if let Some((f, used)) = Frame::decode(have, &limits())? {
                    self.start += used;
                    if self.start == self.buf.len() {
                        self.buf.clear();
                        self.start = 0;
                    }
                    return Ok(Some(f));
                }
                if let Some((p, used)) = Partial::start(have) {
                    self.start += used;
                    self.partial = Some(p);
                }
                if self.start > 0 {
                    self.buf.drain(..self.start);
                    self.start = 0;
                }
            }
            let wait = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(w) if !w.is_zero() => Some(w),
                    _ => return Ok(None),
                },
                None => None,
            };
            if let Some(p) = &mut self.partial {
                self.s.set_read_timeout(wait).map_err(unavailable)?;
                let want = p.want();
                match (&mut self.s).take(want).read_to_end(&mut p.body) {
                    Ok(_) if p.want() > 0 => {
                        return Err(TransportError::Unavailable(
                            "the server closed the TCP connection".into(),
                        ))
                    }
                    Ok(_) => continue,
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) =>
                    {
                        return Ok(None)
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(unavailable(e)),
                }
            }
            let at = self.buf.len();
            self.buf.resize(at + (64 << 10), 0);
            let fd = self.s.as_raw_fd();
            let to = &mut self.buf[at..];
            let polled = self.spin.run(|| match recv_nowait(fd, to) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
                r => Some(r),
            });
            let r = match polled {
                Some(r) => r,
                None => {
                    self.s.set_read_timeout(wait).map_err(unavailable)?;
                    let t = Instant::now();
                    let r = self.s.read(to);
                    self.spin.blocked(t.elapsed());
                    r
                }
            };
            match r {
                Ok(0) => {
                    self.buf.truncate(at);
                    return Err(TransportError::Unavailable(
                        "the server closed the TCP connection".into(),
                    ));
                }
                Ok(n) => self.buf.truncate(at + n),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    self.buf.truncate(at);
                    return Ok(None);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => self.buf.truncate(at),
                Err(e) => {
                    self.buf.truncate(at);
                    return Err(unavailable(e));
                }
            }
        }
    }
}

enum Event {
    /// A connection said hello: the dispatcher's handle for writing its
    /// answers (the socket, non-blocking), and what it may be sent.
    Open(ConnId, TcpStream, Sharing),
    Frame(ConnId, Frame),
    Close(ConnId),
    Wake,
}

/// A service listening on TCP.
pub struct TcpListener {
    addr: SocketAddr,
    events: Receiver<Event>,
    /// The busy-poll of `events` before the dispatcher blocks on it.
    spin: Spin,
    wake: SyncSender<Event>,
    conns: HashMap<ConnId, (TcpStream, Sharing)>,
    stop: Arc<AtomicBool>,
    io: Option<std::thread::JoinHandle<()>>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
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
    /// Binds `addr` (`host:port`, port 0 for any) and starts the I/O thread.
    /// `me` is told to clients in the hello.
    /// `spin` is the longest busy-poll (adapted) of the sockets by the I/O
    /// thread, and of the I/O thread's queue by the dispatcher, before
    /// either sleeps.
    pub fn bind(
        addr: &str,
        me: Identity,
        stop: Arc<AtomicBool>,
        spin: Duration,
    ) -> Result<TcpListener, TransportError> {
        let std_l = std::net::TcpListener::bind(addr)
            .map_err(|e| TransportError::Unavailable(format!("cannot listen on {addr}: {e}")))?;
        std_l.set_nonblocking(true).map_err(unavailable)?;
        let local = std_l.local_addr().map_err(unavailable)?;
        let (tx, rx) = sync_channel(QUEUE_DEPTH);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let events = tx.clone();
        let polled = Arc::new(IdlePoll::new(spin).map_err(unavailable)?);
        let (p1, p2) = (polled.clone(), polled.clone());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .on_thread_park(move || p1.before_sleep())
            .on_thread_unpark(move || p2.after_wake())
            .build()
            .map_err(unavailable)?;
        let io = std::thread::Builder::new()
            .name(format!("dmrpc-tcp:{}", local.port()))
            .spawn(move || rt.block_on(accept_loop(std_l, events, me, stop_rx, polled)))
            .map_err(unavailable)?;
        Ok(TcpListener {
            addr: local,
            events: rx,
            spin: Spin::new(spin),
            wake: tx,
            conns: HashMap::new(),
            stop,
            io: Some(io),
            shutdown: Some(stop_tx),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for TcpListener {
    fn drop(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        self.conns.clear();
        if let Some(t) = self.io.take() {
            let _ = t.join();
        }
    }
}

async fn accept_loop(
    l: std::net::TcpListener,
    events: SyncSender<Event>,
    me: Identity,
    mut stop: tokio::sync::oneshot::Receiver<()>,
    polled: Arc<IdlePoll>,
) {
    let Ok(l) = tokio::net::TcpListener::from_std(l) else {
        return;
    };
    let mut next_id: ConnId = 1;
    loop {
        tokio::select! {
            _ = &mut stop => return,
            a = l.accept() => {
                let Ok((s, _)) = a else { continue };
                let id = next_id;
                next_id += 1;
                tokio::spawn(serve_conn(s, id, events.clone(), me, polled.clone()));
            }
        }
    }
}

/// Queues an event for the dispatcher without blocking the I/O thread:
/// while the queue is full the connection is not read (back-pressure).
async fn deliver(events: &SyncSender<Event>, mut ev: Event) -> bool {
    loop {
        match events.try_send(ev) {
            Ok(()) => return true,
            Err(TrySendError::Disconnected(_)) => return false,
            Err(TrySendError::Full(back)) => {
                ev = back;
                tokio::time::sleep(Duration::from_micros(100)).await;
            }
        }
    }
}

async fn serve_conn(
    mut s: tokio::net::TcpStream,
    id: ConnId,
    events: SyncSender<Event>,
    me: Identity,
    polled: Arc<IdlePoll>,
) {
    let _ = s.set_nodelay(true);
    let mut h = [0u8; HELLO_LEN];
    let said = tokio::time::timeout(HELLO_TIMEOUT, s.read_exact(&mut h)).await;
    let Ok(Ok(_)) = said else { return };
    let Ok(theirs) = parse_hello(&h) else { return };
    if s.write_all(&hello(me)).await.is_err() {
        return;
    }
    let refs = me.sharing(theirs);
    // The dispatcher writes the answers itself, on its own handle of the
    // socket (no hand-off to this thread per answer).
    let Ok(w) = s.as_fd().try_clone_to_owned() else {
        return;
    };
    if !deliver(&events, Event::Open(id, TcpStream::from(w), refs)).await {
        return;
    }
    let fd = s.as_raw_fd();
    // Polled before the I/O thread sleeps (a failure only loses that).
    let _ = polled.add(fd);
    let mut rd = s;
    let mut buf: Vec<u8> = Vec::with_capacity(64 << 10);
    let mut start = 0;
    'read: loop {
        loop {
            match Frame::decode(&buf[start..], &limits()) {
                Ok(Some((f, used))) => {
                    start += used;
                    if !deliver(&events, Event::Frame(id, f)).await {
                        break 'read;
                    }
                }
                Ok(None) => break,
                // A client that sends garbage loses its connection.
                Err(_) => break 'read,
            }
        }
        if let Some((mut p, used)) = Partial::start(&buf[start..]) {
            // A large payload: read it into its own vector.
            start += used;
            let want = p.want();
            match (&mut rd).take(want).read_to_end(&mut p.body).await {
                Ok(_) if p.want() == 0 => {}
                _ => break,
            }
            let Ok(f) = p.frame() else { break };
            if !deliver(&events, Event::Frame(id, f)).await {
                break;
            }
        }
        buf.drain(..start);
        start = 0;
        let at = buf.len();
        buf.resize(at + (64 << 10), 0);
        match rd.read(&mut buf[at..]).await {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.truncate(at + n),
        }
    }
    polled.remove(fd);
    let _ = deliver(&events, Event::Close(id)).await;
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
            let events = &self.events;
            let polled = self.spin.run(|| match events.try_recv() {
                Ok(ev) => Some(Ok(ev)),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => Some(Err(RecvTimeoutError::Disconnected)),
            });
            let ev = match polled {
                Some(ev) => ev,
                None => {
                    let t = Instant::now();
                    let ev = match deadline {
                        None => self
                            .events
                            .recv()
                            .map_err(|_| RecvTimeoutError::Disconnected),
                        Some(d) => self
                            .events
                            .recv_timeout(d.saturating_duration_since(Instant::now())),
                    };
                    self.spin.blocked(t.elapsed());
                    ev
                }
            };
            match ev {
                Ok(Event::Open(id, w, refs)) => {
                    self.conns.insert(id, (w, refs));
                }
                Ok(Event::Frame(id, f)) if self.conns.contains_key(&id) => {
                    return Ok(Some((id, f)))
                }
                Ok(Event::Frame(..)) => {}
                Ok(Event::Wake) => return Ok(None),
                Ok(Event::Close(id)) => {
                    self.conns.remove(&id);
                }
                Err(RecvTimeoutError::Timeout) => return Ok(None),
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(TransportError::Unavailable(
                        "the TCP I/O thread stopped".into(),
                    ))
                }
            }
        }
    }

    fn poll(&mut self) -> Result<Option<(ConnId, Frame)>, TransportError> {
        loop {
            match self.events.try_recv() {
                Ok(Event::Open(id, w, refs)) => {
                    self.conns.insert(id, (w, refs));
                }
                Ok(Event::Frame(id, f)) if self.conns.contains_key(&id) => {
                    return Ok(Some((id, f)))
                }
                Ok(Event::Close(id)) => {
                    self.conns.remove(&id);
                }
                Ok(_) => {}
                Err(_) => return Ok(None),
            }
        }
    }

    fn reply(&mut self, conn: ConnId, f: &Frame) -> Result<(), TransportError> {
        let Some((w, _)) = self.conns.get_mut(&conn) else {
            return Err(TransportError::Unavailable(format!(
                "connection {conn} is gone"
            )));
        };
        // A client that does not read its answers for a second (its socket
        // stays full) loses its connection rather than stalling the server.
        let until = Instant::now() + REPLY_TIMEOUT;
        let head = f.header();
        let encoded;
        let mut parts = match &f.payload {
            crate::frame::Body::Inline(b) => {
                [std::io::IoSlice::new(&head), std::io::IoSlice::new(b)]
            }
            _ => {
                encoded = f.encode();
                [std::io::IoSlice::new(&encoded), std::io::IoSlice::new(&[])]
            }
        };
        match dm_sys::io::write_all_vectored_until(w, &mut parts, until) {
            Ok(()) => Ok(()),
            Err(e) => {
                // Mid-frame the stream cannot be used again: end it (its
                // reader then sees the close).
                let _ = w.shutdown(std::net::Shutdown::Both);
                self.conns.remove(&conn);
                Err(TransportError::Unavailable(format!(
                    "connection {conn} is gone or does not read its answers ({e})"
                )))
            }
        }
    }

    fn max_inline(&self) -> usize {
        MAX_INLINE
    }

    fn refs(&self, conn: ConnId) -> Sharing {
        self.conns.get(&conn).map(|c| c.1).unwrap_or_default()
    }

    fn connections(&self) -> usize {
        self.conns.len()
    }

    fn waker(&self) -> Waker {
        let w = self.wake.clone();
        Waker(Arc::new(move || {
            let _ = w.try_send(Event::Wake);
        }))
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
            Frame::response(1, Status::Ok, Body::Inline(big.clone())),
            Frame::response(2, Status::Ok, Body::Inline(vec![9; 10])),
            Frame::response(3, Status::Ok, Body::Inline(big[..DIRECT + 1].to_vec())),
            Frame::response(4, Status::Ok, Body::Inline(big.clone())),
        ];
        let mut bytes = Vec::new();
        for f in &frames {
            f.encode_into(&mut bytes);
        }
        let peer = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut h = [0u8; HELLO_LEN];
            s.read_exact(&mut h).unwrap();
            s.write_all(&hello(Identity::default())).unwrap();
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
        assert_eq!(got[0].payload, Body::Inline(big.clone()));
        assert_eq!(got[1].payload, Body::Inline(vec![9; 10]));
        assert_eq!(got[2].payload, Body::Inline(big[..DIRECT + 1].to_vec()));
        assert_eq!(got[3].payload, Body::Inline(big));
        drop(c);
        peer.join().unwrap();
    }
}

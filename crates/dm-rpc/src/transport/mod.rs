//! Transports: how frames move between a client and a server. One API over
//! all of them — [`FrameTx`]/[`FrameRx`] for a client's connection and
//! [`Listener`] for a server — so services, clients and the test suite do
//! not care which one carries a call:
//!
//! * [`shm`] — rings in the pool's channel table, for processes attached to
//!   the same pool (the fast path);
//! * [`tcp`] — frames over TCP, for peers on other hosts (by value unless
//!   both ends share a pool);
//! * [`mem`] — in-process queues, for tests and for services in one process.
//!
//! Every transport enforces back-pressure (bounded queues; a server stops
//! reading a client that does not read its answers) and turns a vanished
//! peer into [`TransportError::Unavailable`].

use crate::frame::{Frame, FrameError};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

#[allow(unreachable_pub)] // (public in loom builds)
pub(crate) mod goaway;
pub(crate) mod mem;
pub(crate) mod parts;
#[allow(unreachable_pub)] // (public in loom builds)
pub(crate) mod ring;
pub(crate) mod shm;
pub(crate) mod tcp;

pub(crate) use ring::{RingError, RING_VERSION};

/// Identifies one client connection at a server.
pub(crate) type ConnId = u64;

/// What a transport can report.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The peer is gone (dead, closed, or never there).
    #[error("peer unavailable: {0}")]
    Unavailable(String),
    /// The peer sent bytes that are not a valid frame.
    #[error("malformed frame from peer: {0}")]
    Malformed(#[from] FrameError),
    /// The peer broke the transport's own protocol (ring cursors, records).
    #[error("protocol violation by peer: {0}")]
    Protocol(String),
    /// A frame too large for this transport (send larger payloads by Ref).
    #[error("frame of {len} bytes exceeds this transport's limit of {max}")]
    TooLarge {
        /// Encoded frame bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The pool refused (no channels, lease lost, ...).
    #[error(transparent)]
    Pool(#[from] dm_pool::Error),
}

impl TransportError {
    /// Whether the connection is lost with this error: every error but a
    /// frame refused before any of it was sent.
    pub fn breaks_connection(&self) -> bool {
        !matches!(self, TransportError::TooLarge { .. })
    }
}

impl From<RingError> for TransportError {
    fn from(e: RingError) -> Self {
        match e {
            RingError::TooLarge { len, size } => TransportError::TooLarge {
                len,
                max: ring::max_record(size),
            },
            RingError::Corrupt(why) => TransportError::Protocol(why),
        }
    }
}

/// What the server of a client connection said when it stopped: which
/// requests it took ([`goaway`]).
pub trait GoAway: Send + Sync {
    /// Whether the request with call id `id` was never taken by the
    /// server, and never will be: it stopped reading the connection and
    /// said so. False while it runs, and if it stopped without a word
    /// (killed): then nobody knows.
    fn unread(&self, id: u64) -> bool;
}

/// A go-away word shared in this process (the TCP client's, set when it
/// reads the go-away frame; the in-memory transport's, set by the server).
#[derive(Debug, Default)]
pub(crate) struct GoAwayWord(crate::sync::AtomicU64);

impl GoAwayWord {
    /// The server says it took nothing above `last_taken`.
    pub(crate) fn say(&self, last_taken: u64) {
        goaway::say(&self.0, last_taken)
    }
}

impl GoAway for GoAwayWord {
    fn unread(&self, id: u64) -> bool {
        goaway::unread(&self.0, id)
    }
}

/// The go-away of a connection whose server never says one.
pub(crate) fn silent() -> std::sync::Arc<dyn GoAway> {
    std::sync::Arc::new(GoAwayWord::default())
}

/// The sending half of a client connection.
pub trait FrameTx: Send {
    /// Sends `f`, waiting for room until `deadline` (then `Ok(false)`).
    fn send(&mut self, f: &Frame, deadline: Option<Instant>) -> Result<bool, TransportError>;

    /// Sends `f` as [`send`](Self::send) does, for a caller that holds
    /// this connection's receiving half `rx`: while it waits for room, it
    /// reads what arrives and hands each frame to `got`. A server may take
    /// a request only when it has room to answer it, so a caller that
    /// stopped reading answers while it waits to send could wait on the
    /// server while the server waits on it. An error reading `rx` ends
    /// the send with that error. (The default just sends: for a transport
    /// whose server reads requests ahead of room for their answers.)
    fn send_reading(
        &mut self,
        f: &Frame,
        deadline: Option<Instant>,
        rx: &mut dyn FrameRx,
        got: &mut dyn FnMut(Frame),
    ) -> Result<bool, TransportError> {
        let _ = (rx, got);
        self.send(f, deadline)
    }

    /// Whether room to send may wait on answers being read (a server that
    /// takes a request only when it has room to answer it), with a send
    /// that runs out of time sending nothing, so that a caller may wait in
    /// slices and look between them for answers nobody reads. The default
    /// is no: a server that reads requests ahead of room for their answers
    /// (and a stream, where a send cut short breaks the connection).
    fn room_needs_reader(&self) -> bool {
        false
    }
}

/// The connection of a client that has not connected yet
/// ([`Node::connect_lazily`](crate::Node::connect_lazily)): every send
/// and receive fails with `Unavailable`.
#[derive(Debug)]
pub(crate) struct Unconnected(pub(crate) String);

impl Unconnected {
    fn error(&self) -> TransportError {
        TransportError::Unavailable(format!("{:?} is not connected", self.0))
    }

    /// Its two halves, as a connection.
    pub(crate) fn connection(name: &str) -> Connection {
        Connection {
            tx: Box::new(Unconnected(name.to_owned())),
            rx: Box::new(Unconnected(name.to_owned())),
            max_inline: 0,
            refs: Sharing::default(),
            goaway: silent(),
        }
    }
}

impl FrameTx for Unconnected {
    fn send(&mut self, _: &Frame, _: Option<Instant>) -> Result<bool, TransportError> {
        Err(self.error())
    }
}

impl FrameRx for Unconnected {
    fn recv(&mut self, _: Option<Instant>) -> Result<Option<Frame>, TransportError> {
        Err(self.error())
    }
}

/// Hands every frame already in `rx` to `got`, without waiting.
pub(crate) fn drain(
    rx: &mut dyn FrameRx,
    got: &mut dyn FnMut(Frame),
) -> Result<(), TransportError> {
    while let Some(f) = rx.try_recv()? {
        got(f);
    }
    Ok(())
}

/// The receiving half of a client connection.
pub trait FrameRx: Send {
    /// The next frame, or `Ok(None)` once `deadline` passes.
    fn recv(&mut self, deadline: Option<Instant>) -> Result<Option<Frame>, TransportError>;
    /// The next frame if one is already there, without waiting (and
    /// without a check of the peer's liveness: see
    /// [`check_peer`](Self::check_peer)).
    fn try_recv(&mut self) -> Result<Option<Frame>, TransportError> {
        self.recv(Some(Instant::now()))
    }
    /// The word the peer rings ([`crate::wait::Bell`]) after it sends a
    /// frame, if the transport has one: then a server's listener can
    /// watch this half along with its own connections
    /// (`Watched`). Its one waiter must then be the listener.
    fn bell(&self) -> Option<&'static AtomicU32> {
        None
    }
    /// `Unavailable` once the peer is gone and nothing it sent is left
    /// to read. Every transport keeps that order, `recv` too: the frames
    /// a peer sent before it closed its end (or died) are read before its
    /// end is reported, so an answer sent just before a server stopped
    /// reaches its caller.
    fn check_peer(&mut self) -> Result<(), TransportError> {
        Ok(())
    }
}

/// What a watched answer source did when looked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Looked {
    /// Nothing new.
    Idle,
    /// It delivered answers (or failed its calls): woken tasks wait.
    Delivered,
    /// Its client is gone: stop watching it.
    Gone,
}

/// An answer source a server's listener reads while it waits for requests:
/// the receiving half of an async client whose calls are awaited by the
/// server's async handlers, so their answers need no thread of their own
/// (`async_client/`).
pub trait Watched: Send + Sync {
    /// Reads the answers already there, without waiting, and delivers them.
    fn look(&self) -> Looked;
    /// Checks that the peer lives (fails the pending calls if not).
    fn check(&self) -> Looked;
    /// The word to park on ([`FrameRx::bell`]).
    fn bell(&self) -> &'static AtomicU32;
    /// Its client is gone: stop watching it.
    fn gone(&self) -> bool;
    /// The listener stops watching (its server is stopping): the source
    /// must find another reader for the calls still to come.
    fn orphaned(&self);
}

/// The sources a listener watches: added to by async clients on the
/// dispatcher's thread, read by the listener while it waits.
#[derive(Default)]
pub struct WatchSet {
    inner: std::sync::Mutex<WatchList>,
    /// Bumped on every change, so a listener refreshes its copy only then.
    version: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
struct WatchList {
    list: Vec<std::sync::Arc<dyn Watched>>,
    closed: bool,
}

impl WatchSet {
    /// Adds `w`; false if the set is closed (its listener is gone).
    pub fn add(&self, w: std::sync::Arc<dyn Watched>) -> bool {
        let mut l = crate::sync::lock(&self.inner);
        if l.closed {
            return false;
        }
        l.list.push(w);
        self.version.fetch_add(1, Ordering::Release);
        true
    }

    /// The version: changes whenever the set does.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// A copy of the sources.
    pub fn snapshot(&self) -> Vec<std::sync::Arc<dyn Watched>> {
        let l = crate::sync::lock(&self.inner);
        l.list.clone()
    }

    /// Stops watching the sources whose clients are gone.
    pub fn remove_gone(&self) {
        let mut l = crate::sync::lock(&self.inner);
        let n = l.list.len();
        l.list.retain(|w| !w.gone());
        if l.list.len() != n {
            self.version.fetch_add(1, Ordering::Release);
        }
    }

    /// Closes the set: every source is told it is orphaned, and none is
    /// added any more.
    pub fn close(&self) {
        let list = {
            let mut l = crate::sync::lock(&self.inner);
            l.closed = true;
            std::mem::take(&mut l.list)
        };
        self.version.fetch_add(1, Ordering::Release);
        for w in list {
            w.orphaned();
        }
    }
}

impl std::fmt::Debug for WatchSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatchSet")
            .field("version", &self.version())
            .finish_non_exhaustive()
    }
}

/// A client's connection, split into halves that may be used by different
/// threads at once.
pub struct Connection {
    /// Sending half.
    pub tx: Box<dyn FrameTx>,
    /// Receiving half.
    pub rx: Box<dyn FrameRx>,
    /// Largest inline payload the transport carries.
    pub max_inline: usize,
    /// Which Refs may travel to the server (none: every payload goes
    /// inline, by value).
    pub refs: Sharing,
    /// What the server says when it stops: the requests it never took.
    pub goaway: std::sync::Arc<dyn GoAway>,
}

/// Which Refs a connection's two ends can both use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sharing {
    /// Both ends are attached to the same pool: pool Refs.
    pub pool: bool,
    /// Both ends are clients of the same memory servers: their Refs.
    pub remote: bool,
}

impl Sharing {
    /// Both kinds (ends in one pool and one process).
    pub const ALL: Sharing = Sharing {
        pool: true,
        remote: true,
    };
    /// Pool Refs only.
    pub const POOL: Sharing = Sharing {
        pool: true,
        remote: false,
    };

    /// Whether every kind of Ref `other` passes, this passes too: a
    /// request placed for `other` can go over a connection with this.
    pub fn covers(self, other: Sharing) -> bool {
        (self.pool || !other.pool) && (self.remote || !other.remote)
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("max_inline", &self.max_inline)
            .finish_non_exhaustive()
    }
}

/// A server's end of a transport: every client connection, multiplexed.
pub trait Listener: Send {
    /// The next request (or cancel) from any connection, in fair order, or
    /// `Ok(None)` once `deadline` passes or the server is stopping. A
    /// connection whose client breaks the protocol or dies is dropped
    /// here, without disturbing the others.
    fn next(
        &mut self,
        deadline: Option<Instant>,
    ) -> Result<Option<(ConnId, Frame)>, TransportError>;
    /// The next frame already waiting, without waiting.
    fn poll(&mut self) -> Result<Option<(ConnId, Frame)>, TransportError> {
        self.next(Some(Instant::now()))
    }
    /// Answers on connection `conn`. An error concerns that connection only.
    fn reply(&mut self, conn: ConnId, f: &Frame) -> Result<(), TransportError>;
    /// Sends `f`, a frame that answers nothing (an item of a stream,
    /// [`crate::stream`]), on connection `conn` if there is room for it
    /// beside the answers owed to the requests taken: `Ok(false)` if there
    /// is not (then nothing is sent: the caller waits for its client to
    /// read). An error concerns that connection only. The default sends it
    /// as an answer is sent (for a transport that owes no room).
    fn send_item(&mut self, conn: ConnId, f: &Frame) -> Result<bool, TransportError> {
        self.reply(conn, f).map(|()| true)
    }
    /// Waits until connection `conn` may have room for a frame of `len`
    /// bytes that answers nothing ([`send_item`](Self::send_item)), a
    /// frame arrives on it, or `until` passes. The default returns at once
    /// (for a transport that owes no room).
    fn wait_room(&mut self, conn: ConnId, len: usize, until: Instant) {
        let _ = (conn, len, until);
    }
    /// The most bytes of payload and metadata the answer to call `id` of
    /// connection `conn` may carry inline (a larger payload goes by Ref),
    /// if the transport keeps room for each answer (then an answer never
    /// waits for room); `None`: only the transport's own limit. It may
    /// exceed [`max_inline`](Self::max_inline) for a transport that sends
    /// a longer answer in parts (then the parts wait for room).
    fn answer_max(&self, conn: ConnId, id: u64) -> Option<usize> {
        let _ = (conn, id);
        None
    }
    /// Whether [`next`](Self::next) returns (with `Ok(None)`, if no frame
    /// came) once a connection on which [`send_item`](Self::send_item)
    /// found no room may have room: then a caller with items to send can
    /// wait in `next` for it, instead of looking again soon. The default
    /// is no.
    fn wakes_for_room(&self) -> bool {
        false
    }
    /// Stream `id` of connection `conn` runs beside the connection's other
    /// calls (an async streaming handler's): requests that come after it
    /// need not wait for it to end. (A transport that holds a connection's
    /// requests while a stream of it runs, so that its items find room,
    /// holds them for a blocking stream only: that one holds up its
    /// server until it ends.) The default does nothing.
    fn stream_beside(&mut self, conn: ConnId, id: u64) {
        let _ = (conn, id);
    }
    /// Whether it holds requests read but not yet handed out (waiting for
    /// room for their answers): a draining server waits for them, to
    /// refuse them.
    fn holding(&self) -> bool {
        false
    }
    /// Whether connection `conn` is still open (false once its client
    /// closed it or died and the listener dropped it).
    fn is_open(&self, conn: ConnId) -> bool;
    /// Largest inline payload the transport carries.
    fn max_inline(&self) -> usize;
    /// Which Refs connection `conn`'s client can use (for answers).
    fn refs(&self, _conn: ConnId) -> Sharing {
        Sharing::POOL
    }
    /// Connections currently open.
    fn connections(&self) -> usize;
    /// A handle that makes a blocked [`next`](Self::next) return promptly
    /// (with `Ok(None)` if no frame is waiting). A wake is a poke, not a
    /// message: one that arrives while the listener is not blocked may be
    /// used up by [`poll`](Self::poll) (the TCP and in-process listeners
    /// read their wake-ups with their frames), so whoever wakes the
    /// listener records why first, and the dispatcher checks every such
    /// record again before it calls `next` (`Dispatcher::poll_woken`).
    fn waker(&self) -> Waker;
    /// The answer sources this listener reads while it waits, if it can
    /// watch any (`Watched`; the shared-memory listener can).
    fn watch_set(&self) -> Option<std::sync::Arc<WatchSet>> {
        None
    }
    /// The server stops: tells every connection's client the highest call
    /// id it took from it (`GoAway`), so that the requests it never
    /// took go elsewhere. The last call on a listener, before it is
    /// dropped: nothing is taken after it.
    fn go_away(&mut self);
}

/// Wakes a server's listener from another thread (shutdown).
#[derive(Clone)]
pub struct Waker(pub(crate) std::sync::Arc<dyn Fn() + Send + Sync>);

impl Waker {
    /// Wakes the listener.
    pub fn wake(&self) {
        (self.0)()
    }
}

impl std::fmt::Debug for Waker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Waker")
    }
}

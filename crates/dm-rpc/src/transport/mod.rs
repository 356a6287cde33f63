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
use std::time::Instant;

pub mod mem;
pub mod ring;
pub mod shm;
pub mod tcp;

pub use ring::{RingError, RING_VERSION};

/// Identifies one client connection at a server.
pub type ConnId = u64;

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

/// The sending half of a client connection.
pub trait FrameTx: Send {
    /// Sends `f`, waiting for room until `deadline` (then `Ok(false)`).
    fn send(&mut self, f: &Frame, deadline: Option<Instant>) -> Result<bool, TransportError>;
}

/// The receiving half of a client connection.
pub trait FrameRx: Send {
    /// The next frame, or `Ok(None)` once `deadline` passes.
    fn recv(&mut self, deadline: Option<Instant>) -> Result<Option<Frame>, TransportError>;
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

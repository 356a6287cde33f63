//! # dm-rpc — the RPC layer of dmrpc
//!
//! Services call each other by name; large arguments travel as Refs to
//! pool memory, small ones inline, behind one [`Payload`] API.
//!
//! What applications program against is at the crate's root: [`Node`],
//! [`ServerBuilder`] and [`Server`], [`Client`], [`AsyncClient`],
//! [`BalancedClient`], [`Payload`], [`RpcError`]. The public modules
//! explain behaviour a user sees:
//!
//! * [`frame`] — where frames are parsed: the wire format every transport
//!   carries, and its decoder (typed errors, never panics, fuzzed).
//! * [`reconnect`] — a client's connection replaced when it breaks and
//!   its service is registered again.
//! * [`balance`] — clients of every replica of a service, spreading their
//!   calls over them.
//! * [`stream`] — streaming calls, with flow control by items.
//! * [`deadline`] — a handler's calls inherit the deadline of the call it
//!   serves.
//! * [`metadata`] — what calls and answers carry beside their payloads,
//!   and what a handler's calls inherit.
//! * [`retry`] — retry policies: statuses worth another attempt, waits.
//! * [`registry`] — names to endpoints: the trait, and its home in the pool.
//! * [`wait`] — the spin/yield/futex waiting policy and the doorbell.
//! * [`stats`] — counts of what calls carried inline and by Ref.
//!
//! Inside, from the bottom up (private modules): `transport/` (shared-memory
//! rings, TCP, in-process queues, one API over them), `sender.rs` and
//! `handoff.rs` (a connection's two halves shared by callers),
//! `payload/` (the size-aware rule), `node.rs` (the context),
//! `dial.rs` (finding a service, opening a connection), `call/` (one
//! call's logic, without I/O), `client.rs` and `async_client/` (its
//! drivers), `server/` (builder, intake, dispatcher, handlers).
//!
//! ```no_run
//! use dm_rpc::{Node, Payload};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = dm_pool::Pool::open(&dm_pool::default_path("demo"), Default::default())?;
//! let node = Node::new(pool);
//! let server = node
//!     .server("shop/images/resize")
//!     .method("len", |call| Ok(Payload::from_vec(call.payload().len().to_le_bytes().to_vec())))
//!     .spawn()?;
//! let client = node.connect("shop/images/resize")?;
//! let answer = client.call("len", vec![7u8; 1 << 20])?; // travels by Ref
//! assert_eq!(answer.to_vec()?, (1u64 << 20).to_le_bytes());
//! server.shutdown();
//! # Ok(()) }
//! ```

#![cfg_attr(loom, allow(dead_code, unused_imports))]
// What is public is what the root re-exports and the modules above.
#![cfg_attr(not(loom), warn(unreachable_pub))]

// Under loom only the lock-free parts build: the ring, the go-away word
// and the doorbell, public for the models (tests/loom.rs).
#[cfg(loom)]
#[path = "transport/goaway.rs"]
pub mod goaway;
#[cfg(loom)]
pub mod handoff;
#[cfg(not(loom))]
#[allow(unreachable_pub)] // (public in loom builds)
mod handoff;
#[doc(hidden)]
pub mod probe;
#[cfg(loom)]
#[path = "transport/ring.rs"]
pub mod ring;
pub(crate) mod sync;
pub mod wait;

#[cfg(not(loom))]
mod async_client;
#[cfg(not(loom))]
pub mod balance;
#[cfg(not(loom))]
mod call;
/// Inline or by memory-server Ref, learned from the calls' latencies.
mod choice;
#[cfg(not(loom))]
mod client;
#[cfg(not(loom))]
pub mod deadline;
#[cfg(not(loom))]
mod dial;
#[cfg(not(loom))]
mod error;
#[cfg(not(loom))]
pub mod frame;
#[cfg(not(loom))]
mod handle;
#[cfg(not(loom))]
pub mod metadata;
#[cfg(not(loom))]
mod node;
#[cfg(not(loom))]
mod payload;
#[cfg(not(loom))]
pub mod reconnect;
#[cfg(not(loom))]
pub mod registry;
#[cfg(not(loom))]
pub mod retry;
#[cfg(not(loom))]
mod sender;
#[cfg(not(loom))]
mod server;
#[cfg(not(loom))]
pub mod stats;
#[cfg(not(loom))]
pub mod stream;
#[cfg(not(loom))]
mod transport;

#[cfg(not(loom))]
pub use async_client::AsyncClient;
#[cfg(not(loom))]
pub use balance::{AsyncBalancedClient, Balanced, BalancedClient};
#[cfg(not(loom))]
pub use call::options::{AnswerInterceptor, CallInterceptor, CallOptions, OutgoingCall, Reply};
#[cfg(not(loom))]
pub use choice::{WAY_INLINE, WAY_KEY};
#[cfg(not(loom))]
pub use client::Client;
#[cfg(not(loom))]
pub use dial::CLOSED_BY_SERVER_GRACE;
#[cfg(not(loom))]
pub use error::RpcError;
#[cfg(not(loom))]
pub use frame::{Body, Frame, FrameError, Kind, Status};
#[cfg(not(loom))]
pub use handle::ClientOf;
#[cfg(not(loom))]
pub use metadata::{Metadata, MetadataError};
#[cfg(not(loom))]
pub use node::{Config, Node, RemoteChoice, Transport, DEFAULT_INLINE_MAX, DEFAULT_TCP_SPIN};
#[cfg(not(loom))]
pub use payload::Payload;
#[cfg(not(loom))]
pub use registry::{PoolRegistry, Registration, Registry, ServiceEntry};
#[cfg(not(loom))]
pub use retry::{Retry, Statuses};
#[cfg(not(loom))]
pub use server::{
    AsyncBidiHandler, AsyncCall, AsyncHandler, AsyncStreamHandler, BidiHandler, Call,
    DisconnectHook, Handler, HandlerFuture, Incoming, Interceptor, Peer, Server, ServerBuilder,
    Stats, StreamFuture, StreamHandler,
};
#[cfg(not(loom))]
pub use stream::{
    AsyncBidi, AsyncInbox, AsyncItems, AsyncSink, AsyncStreaming, Bidi, Inbox, Items, Sink,
    Streaming,
};
/// What a TCP server takes from its clients ([`Config::tcp_limits`]).
#[cfg(not(loom))]
pub use transport::tcp::TcpLimits;
pub use wait::WaitPolicy;

/// Beneath the API, for the benchmarks' floors (a raw ring ping-pong),
/// the transport tests and the fuzz targets: not part of dmrpc's API, and
/// free to change in any release.
#[cfg(not(loom))]
#[doc(hidden)]
pub mod raw {
    pub use crate::transport::{Connection, FrameRx, FrameTx, Listener, TransportError};

    /// The shared-memory transport.
    pub mod shm {
        pub use crate::transport::shm::{connect, ring_max_inline, RawConnection, ShmListener};
    }
    /// The TCP transport.
    pub mod tcp {
        pub use crate::transport::tcp::{
            connect, Identity, TcpListener, FLAG_FULL, FLAG_KEYED, HELLO, HELLO_LEN, MAX_INLINE,
            PROOFS_LEN, VERDICT_OK,
        };
    }
    /// The in-process transport.
    pub mod mem {
        pub use crate::transport::mem::{bind, connect, MAX_INLINE};
    }
    /// Frames in parts.
    pub mod parts {
        pub use crate::transport::parts::fuzz_join;
    }
    /// The ring of the shared-memory transport.
    pub mod ring {
        pub use crate::transport::ring::{
            fuzz_consume, Consumer, Line, Producer, RawData, RingControl,
        };
    }
}

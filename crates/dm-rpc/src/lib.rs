//! # dm-rpc — the RPC layer of dmrpc
//!
//! Services call each other by name; large arguments travel as Refs to
//! pool memory, small ones inline, behind one [`Payload`] API.
//!
//! * [`frame`] — where frames are parsed: the wire format every transport
//!   carries, and its decoder (typed errors, never panics, fuzzed).
//! * [`transport`] — shared-memory rings in the pool ([`transport::shm`]),
//!   in-process queues ([`transport::mem`]), one API over both.
//! * [`wait`] — the spin/yield/futex waiting policy and the doorbell.
//! * [`payload`] — size-aware payloads.
//! * [`registry`] — names to endpoints: the trait, and its home in the pool.
//! * [`reconnect`] — a client's connection replaced when it breaks and
//!   its service is registered again.
//! * [`balance`] — clients of every replica of a service, spreading their
//!   calls over them.
//! * [`node`], [`server`], [`client`], [`async_client`] — what applications
//!   program against (blocking and tokio).
//! * [`deadline`] — a handler's calls inherit the deadline of the call it
//!   serves.
//! * [`metadata`] — what calls and answers carry beside their payloads,
//!   and what a handler's calls inherit.
//! * [`retry`] — retry policies: statuses worth another attempt, waits.
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

// Under loom only the lock-free parts build: the ring, the go-away word
// and the doorbell.
#[cfg(loom)]
#[path = "transport/goaway.rs"]
pub mod goaway;
#[doc(hidden)]
pub mod handoff;
#[doc(hidden)]
pub mod probe;
#[cfg(loom)]
#[path = "transport/ring.rs"]
pub mod ring;
pub(crate) mod sync;
pub mod wait;

#[cfg(not(loom))]
pub mod async_client;
#[cfg(not(loom))]
pub mod balance;
#[cfg(not(loom))]
mod call;
#[cfg(not(loom))]
pub mod client;
#[cfg(not(loom))]
pub mod deadline;
#[cfg(not(loom))]
mod dial;
#[cfg(not(loom))]
pub mod error;
#[cfg(not(loom))]
pub mod frame;
#[cfg(not(loom))]
pub mod metadata;
#[cfg(not(loom))]
pub mod node;
#[cfg(not(loom))]
pub mod payload;
#[cfg(not(loom))]
pub mod reconnect;
#[cfg(not(loom))]
pub mod registry;
#[cfg(not(loom))]
pub mod retry;
#[cfg(not(loom))]
#[doc(hidden)]
pub mod sender;
#[cfg(not(loom))]
pub mod server;
#[cfg(not(loom))]
pub mod stats;
#[cfg(not(loom))]
pub mod stream;
#[cfg(not(loom))]
pub mod transport;

#[cfg(not(loom))]
pub use async_client::AsyncClient;
#[cfg(not(loom))]
pub use balance::{AsyncBalancedClient, Balanced, BalancedClient};
#[cfg(not(loom))]
pub use call::options::{AnswerInterceptor, CallInterceptor, CallOptions, OutgoingCall, Reply};
#[cfg(not(loom))]
pub use client::Client;
#[cfg(not(loom))]
pub use dial::CLOSED_BY_SERVER_GRACE;
#[cfg(not(loom))]
pub use error::RpcError;
#[cfg(not(loom))]
pub use frame::{Body, Frame, FrameError, Kind, Status};
#[cfg(not(loom))]
pub use metadata::Metadata;
#[cfg(not(loom))]
pub use node::{Config, Node, Transport, DEFAULT_INLINE_MAX, DEFAULT_TCP_SPIN};
#[cfg(not(loom))]
pub use payload::Payload;
#[cfg(not(loom))]
pub use registry::{PoolRegistry, Registry, ServiceEntry};
#[cfg(not(loom))]
pub use retry::{Retry, Statuses};
#[cfg(not(loom))]
pub use server::{Call, Incoming, Server, ServerBuilder};
#[cfg(not(loom))]
pub use stream::{AsyncSink, AsyncStreaming, Sink, Streaming};
pub use wait::WaitPolicy;

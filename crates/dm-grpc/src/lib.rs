//! # dm-grpc — gRPC over dmrpc
//!
//! Existing tonic services and clients, generated from `.proto` files,
//! run between processes of one pool without the network stack, and
//! unchanged: only how a server listens and how a client's channel is
//! made differ.
//!
//! ```ignore
//! // Server: a generated service on a dmrpc name in the pool.
//! let served = dm_grpc::serve(&node, "shop/imaging", ImagingServer::new(service))?;
//! // Client: a channel by name. A service not in this pool: over TCP.
//! let channel = dm_grpc::Dial::new(&node, "shop/imaging")
//!     .or_tcp("http://imaging.example:50051")
//!     .connect()
//!     .await?;
//! let mut client = ImagingClient::new(channel);
//! ```
//!
//! Two ways go through shared memory, both served on one name:
//!
//! * direct (the default): each gRPC call is a dmrpc call, with no
//!   HTTP/2 between the processes. Code generated with [`Codec`] passes
//!   large messages by Ref, with no copy but the encode.
//! * [`h2`], NotNets' way ([`Dial::http2`]): tonic's HTTP/2 as it is, over
//!   byte streams carried by dmrpc's rings ([`h2::listen`] for tonic's own
//!   `serve_with_incoming`).

mod channel;
mod codec;
mod dial;
mod direct;
pub mod example;
pub mod h2;
mod pipe;
pub mod raw;
mod reader;
mod serve;

pub use channel::Channel;
pub use codec::{Codec, MessageDecoder, MessageEncoder};
pub use dial::{Dial, Way};
pub use direct::by_ref::{by_ref_counts, ByRefCounts};
#[doc(hidden)]
pub use direct::fuzz_wire;
pub use direct::GrpcService;
pub use pipe::Pipe;
pub use serve::serve;

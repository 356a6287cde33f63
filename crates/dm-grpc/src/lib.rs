//! # dm-grpc — gRPC over dmrpc
//!
//! Existing tonic services and clients, generated from `.proto` files,
//! run between processes of one pool without the network stack, and
//! unchanged: only how a server listens and how a client's channel is
//! made differ.
//!
//! * [`h2`] — NotNets' way: tonic's HTTP/2 as it is, over byte streams
//!   carried by dmrpc's shared-memory rings ([`h2::listen`] for
//!   `serve_with_incoming`, [`h2::Dial`] for a channel). Outside the pool
//!   the same client dials ordinary gRPC over TCP.
//!
//! A server serves its tonic router on a dmrpc name:
//!
//! ```ignore
//! tonic::transport::Server::builder()
//!     .add_service(ImagingServer::new(service))
//!     .serve_with_incoming(dm_grpc::h2::listen(&node, "shop/imaging")?)
//!     .await?;
//! ```
//!
//! and a client makes its channel by name:
//!
//! ```ignore
//! let channel = dm_grpc::h2::Dial::new(&node, "shop/imaging")
//!     .or_tcp("http://imaging.example:50051")
//!     .connect()
//!     .await?;
//! let mut client = ImagingClient::new(channel);
//! ```

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
pub use codec::{by_ref_counts, Codec, MessageDecoder, MessageEncoder};
pub use dial::{Dial, Way};
#[doc(hidden)]
pub use direct::fuzz_wire;
pub use direct::GrpcService;
pub use pipe::Pipe;
pub use serve::serve;

//! Beyond NotNets: no HTTP/2 between processes of one pool. Each gRPC
//! call is a dmrpc call (its path, metadata, deadline and status map onto
//! dmrpc's: `wire.rs`), its messages travel as the call's payloads and
//! items (inline, or by Ref when large), and the receiving side hands
//! tonic the bytes it got (by Ref, views of the pool's pages).

mod body;
pub(crate) mod client;
pub(crate) mod server;
pub(crate) mod wire;

pub use server::GrpcService;

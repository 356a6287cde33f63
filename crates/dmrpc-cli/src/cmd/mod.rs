//! The subcommands of the `dmrpc` tool.

pub mod call;
pub mod cluster;
pub mod demo;
pub mod etcd;
pub mod grpc;
pub mod key;
pub mod ls;
pub mod memserver;
pub mod ns;
pub mod out;
pub mod pool;

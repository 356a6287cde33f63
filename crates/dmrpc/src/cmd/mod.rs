//! The subcommands of the `dmrpc` tool.

pub mod demo;
pub mod pool;

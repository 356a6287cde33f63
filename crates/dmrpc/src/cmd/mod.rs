//! The subcommands of the `dmrpc` tool.

pub mod demo;
pub mod ls;
pub mod pool;

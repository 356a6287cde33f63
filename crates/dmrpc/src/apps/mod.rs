//! Applications built on dmrpc: real services that the benchmarks run as
//! separate processes (`dmrpc bench image`) and that show how a service
//! passes large data through tiers by Ref.

pub mod image;

//! Applications built on dmrpc: real services that the benchmarks run as
//! separate processes (`dmrpc bench image`) and that show how a service
//! passes large data through tiers by Ref: [`image`] (a 7-tier image
//! pipeline) and [`social`] (a social network whose posts carry media).

pub mod image;
pub mod social;

//! # dm-memserver — network disaggregated memory (DmRPC-net)
//!
//! When services do not share a pool, memory servers hold the pages:
//! clients on any host allocate, write, create Refs and map Refs over the
//! network, and only the Refs travel through RPC calls. The client
//! ([`MemPool`]) implements the same DM contract as the shared pool
//! ([`dm_pool::Dm`]), and passes the same conformance suite.
//!
//! Layout: [`proto`] is the wire format (where request frames are parsed),
//! [`server`] the daemon (its `pages` module counts pages, `space` holds
//! each client's address map, `refs` the Ref table, `metrics` the
//! Prometheus counters), [`client`] the client and [`cache`] its cache of
//! immutable pages.

pub mod cache;
pub mod client;
pub mod proto;
pub mod server;

pub use cache::CacheStats;
pub use client::{ClientConfig, MemBuffer, MemPool, Placement};
pub use server::{default_threads, Config, Server};

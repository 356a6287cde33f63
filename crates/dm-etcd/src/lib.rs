//! # dm-etcd — dmrpc's names, leases and watches on etcd
//!
//! Within one host a service is found in its pool's registry. Services
//! spread over hosts are found in etcd, an existing, proven store of
//! names and leases: [`EtcdRegistry`] implements dmrpc's
//! [`Registry`](dm_rpc::Registry), and a [`Node`](dm_rpc::Node) given it
//! ([`Node::with_registry`](dm_rpc::Node::with_registry)) registers its
//! TCP services there and finds others' there. Shared-memory endpoints
//! stay in the pool, where only processes attached to it find them.
//!
//! Layout: [`keys`] is where registrations lie in etcd and what their
//! values hold (where etcd's bytes are checked), [`registry`] the
//! registry with its lease and watches, [`members`] etcd members started
//! for tests, demos and the one-machine cluster.

pub mod keys;
pub mod members;
pub mod registry;

pub use members::{etcd_available, EtcdCluster};
pub use registry::{parse_endpoints, registry_from_env, EtcdConfig, EtcdRegistry, ETCD_ENV};

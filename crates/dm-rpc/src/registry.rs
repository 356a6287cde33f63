//! Naming and discovery: the [`Registry`] trait, and its implementation in
//! the pool ([`PoolRegistry`], the default).
//!
//! A registry maps hierarchical service names to endpoints with liveness.
//! On one host (or one CXL domain) it lives in the pool (`dm_pool::registry`):
//! no daemon, and a crashed service disappears with its lease. Services
//! spread over hosts need a registry every host can reach: etcd (crate
//! `dm-etcd`), given to
//! [`Node::with_registry`](crate::Node::with_registry). Shared-memory
//! endpoints are always found in the pool (only processes attached to it
//! can use them); TCP endpoints are registered in, and looked up from, the
//! node's registry.

use crate::error::RpcError;
use dm_pool::{Endpoint, Pool};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// A registered service as a registry reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceEntry {
    /// The hierarchical name.
    pub name: String,
    /// Where it is reached.
    pub endpoint: Endpoint,
    /// Who registered it, for people (`pid 1234`, `host:pid`).
    pub owner: String,
    /// Whether the registry still considers it alive.
    pub live: bool,
    /// Which registration this is (the [`Registration::handle`] it
    /// returned): registering the name again gives another, so a client
    /// can tell a restarted service from the one it lost. 0 from a
    /// registry that cannot tell.
    pub handle: u64,
}

/// What a registration returns, to remove it later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// The name registered.
    pub name: String,
    /// The registry's handle for it (opaque outside the registry).
    pub handle: u64,
}

/// Names to endpoints, with liveness.
pub trait Registry: Send + Sync + std::fmt::Debug {
    /// Registers `name` at `endpoint` for as long as this process lives (or
    /// until [`unregister`](Self::unregister)). A name held by a live
    /// process is refused with `AlreadyExists`, naming the holder (what
    /// [`ServerBuilder::wait_for_name`](crate::ServerBuilder::wait_for_name)
    /// waits on).
    fn register(&self, name: &str, endpoint: &Endpoint) -> Result<Registration, RpcError>;
    /// Registers one replica of `name` at `endpoint`: a name may have any
    /// number of replicas (servers that share it, over which balanced
    /// clients spread their calls: [`Node::connect_balanced`](crate::Node::connect_balanced)),
    /// or one exclusive registration ([`register`](Self::register)).
    /// The default refuses with `InvalidArgument`: a registry that keeps
    /// one endpoint per name.
    fn register_replica(&self, name: &str, _endpoint: &Endpoint) -> Result<Registration, RpcError> {
        Err(RpcError::invalid_argument(format!(
            "cannot register a replica of {name:?}: this registry keeps one endpoint per name"
        )))
    }
    /// Removes a registration made through this registry.
    fn unregister(&self, r: &Registration) -> Result<(), RpcError>;
    /// The live registration of `name`, if any (of a name with replicas,
    /// one of them).
    fn lookup(&self, name: &str) -> Result<Option<ServiceEntry>, RpcError>;
    /// Every live registration of `name`: its replicas, or its one
    /// registration. The default is [`lookup`](Self::lookup)'s.
    fn lookup_all(&self, name: &str) -> Result<Vec<ServiceEntry>, RpcError> {
        Ok(self.lookup(name)?.into_iter().collect())
    }
    /// Every registration (live or not yet removed), by name.
    fn list(&self) -> Result<Vec<ServiceEntry>, RpcError>;
    /// Publishes a service reachable only from this node's pool (over
    /// shared memory), for listing beside the others. It claims nothing:
    /// services of the same name on other pools do not clash with it, and
    /// lookups do not return it (its pool's registry has it). `None` (the
    /// default): this registry does not publish them (the pool's own,
    /// which holds them already).
    fn publish_local(
        &self,
        _name: &str,
        _endpoint: &Endpoint,
    ) -> Result<Option<Registration>, RpcError> {
        Ok(None)
    }
    /// A counter that moves whenever the registrations of `name` may have
    /// changed, for a registry that can watch (etcd); `None` (the default)
    /// where the caller must look again to know. Balanced clients read it
    /// on each call and look the replicas up again when it moved.
    fn changes(&self, _name: &str) -> Option<Arc<AtomicU64>> {
        None
    }
}

/// The registry embedded in the pool.
#[derive(Debug, Clone)]
pub struct PoolRegistry {
    pool: Pool,
}

impl PoolRegistry {
    /// The registry of `pool`.
    pub fn new(pool: Pool) -> Self {
        PoolRegistry { pool }
    }
}

/// The handle of a registration in the pool: its record and the record's
/// generation.
fn handle(s: &dm_pool::ServiceInfo) -> u64 {
    s.index as u64 | (s.generation as u64) << 32
}

fn entry(s: dm_pool::ServiceInfo) -> ServiceEntry {
    ServiceEntry {
        handle: handle(&s),
        owner: format!("pid {}", s.pid),
        name: s.name,
        endpoint: s.endpoint,
        live: s.live,
    }
}

impl Registry for PoolRegistry {
    fn register(&self, name: &str, endpoint: &Endpoint) -> Result<Registration, RpcError> {
        let s = self.pool.register(name, endpoint)?;
        Ok(Registration {
            handle: handle(&s),
            name: s.name,
        })
    }

    fn register_replica(&self, name: &str, endpoint: &Endpoint) -> Result<Registration, RpcError> {
        let s = self.pool.register_replica(name, endpoint)?;
        Ok(Registration {
            handle: handle(&s),
            name: s.name,
        })
    }

    fn unregister(&self, r: &Registration) -> Result<(), RpcError> {
        let info = self
            .pool
            .services()
            .into_iter()
            .find(|s| handle(s) == r.handle)
            .ok_or_else(|| RpcError::not_found(format!("{:?} is not registered", r.name)))?;
        Ok(self.pool.unregister(&info)?)
    }

    fn lookup(&self, name: &str) -> Result<Option<ServiceEntry>, RpcError> {
        Ok(self.pool.lookup(name)?.map(entry))
    }

    fn lookup_all(&self, name: &str) -> Result<Vec<ServiceEntry>, RpcError> {
        Ok(self.pool.lookup_all(name)?.into_iter().map(entry).collect())
    }

    fn list(&self) -> Result<Vec<ServiceEntry>, RpcError> {
        let mut v: Vec<_> = self.pool.services().into_iter().map(entry).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(v)
    }
}

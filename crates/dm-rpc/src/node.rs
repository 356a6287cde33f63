//! A [`Node`]: this process's handle on the RPC layer — the pool it is
//! attached to, the size-aware threshold and the waiting policy. Servers
//! are built from it and clients connect through it.

use crate::client::Client;
use crate::error::RpcError;
use crate::server::ServerBuilder;
use crate::wait::WaitPolicy;
use dm_pool::{Endpoint, Pool};
use std::time::Duration;

/// The default size-aware threshold: payloads up to this many bytes travel
/// inline, larger ones by Ref. Chosen from the measured crossover on the
/// 2-core test machine (`dmrpc bench threshold`, BENCHMARKS.md): below it
/// copying the bytes through the ring costs less than writing them to the
/// pool and creating, mapping and releasing a Ref.
pub const DEFAULT_INLINE_MAX: usize = 16 << 10;

/// How a node's calls behave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// Payloads up to this many bytes go inline; larger by Ref. Capped by
    /// what the transport carries inline.
    pub inline_max: usize,
    /// How waiters spin, yield and park (default: [`WaitPolicy::from_env`]).
    pub wait: WaitPolicy,
    /// Deadline applied to calls that set none (None: wait for the answer
    /// or for the peer's death).
    pub default_deadline: Option<Duration>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            inline_max: DEFAULT_INLINE_MAX,
            wait: WaitPolicy::from_env(),
            default_deadline: None,
        }
    }
}

/// Which transport a server listens on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    /// Rings in the pool (clients attached to the same pool).
    Shm,
    /// TCP on this address (`host:port`; port 0 picks one), registered in
    /// the pool's registry under the service name.
    Tcp(String),
    /// Queues inside this process (tests, co-located components).
    Mem,
}

/// This process's RPC endpoint on a pool.
#[derive(Debug, Clone)]
pub struct Node {
    pub(crate) pool: Pool,
    pub(crate) cfg: Config,
}

impl Node {
    /// A node on an attached pool with the default configuration.
    pub fn new(pool: Pool) -> Node {
        Node::with_config(pool, Config::default())
    }

    /// A node with `cfg`.
    pub fn with_config(pool: Pool, cfg: Config) -> Node {
        Node { pool, cfg }
    }

    /// The pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Starts building a server for service `name` (`shop/images/resize`).
    pub fn server(&self, name: &str) -> ServerBuilder {
        ServerBuilder::new(self.clone(), name)
    }

    /// Connects to service `name`: a service of this process bound on the
    /// in-memory transport, else the pool's registry.
    pub fn connect(&self, name: &str) -> Result<Client, RpcError> {
        if crate::transport::mem::is_bound(name) {
            let conn = crate::transport::mem::connect(name)?;
            return Ok(Client::new(self.clone(), name, conn));
        }
        let svc = self
            .pool
            .lookup(name)?
            .ok_or_else(|| RpcError::not_found(format!("no service named {name:?}")))?;
        match &svc.endpoint {
            Endpoint::Shm => {
                let conn = crate::transport::shm::connect(&self.pool, &svc, self.cfg.wait)?;
                Ok(Client::new(self.clone(), name, conn))
            }
            Endpoint::Tcp(addr) => self.connect_tcp_as(name, addr),
        }
    }

    /// Connects to a service by TCP address (`host:port`), for servers
    /// whose registry this process cannot see (another host). Refs travel
    /// only if the server is attached to this node's pool.
    pub fn connect_tcp(&self, addr: &str) -> Result<Client, RpcError> {
        self.connect_tcp_as(addr, addr)
    }

    fn connect_tcp_as(&self, name: &str, addr: &str) -> Result<Client, RpcError> {
        let conn = crate::transport::tcp::connect(addr, self.pool.id(), Duration::from_secs(5))?;
        Ok(Client::new(self.clone(), name, conn))
    }
}

//! A [`Node`]: this process's handle on the RPC layer — the pool it is
//! attached to, the memory servers it may use, the size-aware threshold
//! and the waiting policy. Servers are built from it and clients connect
//! through it.

use crate::async_client::AsyncClient;
use crate::balance::{AsyncBalancedClient, BalancedClient};
use crate::client::Client;
use crate::error::RpcError;
use crate::reconnect::{
    Connected, How, Origin, Redial, Route, Target, CONNECT_TIMEOUT, REDIAL_TIMEOUT,
};
use crate::registry::{PoolRegistry, Registry};
use crate::server::ServerBuilder;
use crate::transport::{Connection, TransportError};
use crate::wait::WaitPolicy;
use dm_memserver::MemPool;
use dm_pool::{Endpoint, Pool, Ref, ServiceInfo};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The default size-aware threshold: payloads up to this many bytes travel
/// inline, larger ones by Ref. From the measured crossover on the 2-core
/// test machine (`dmrpc bench threshold`, BENCHMARKS.md): for an argument
/// the callee reads, inline is faster up to 64 KiB (by 13% there) and the
/// two cost the same at 128 KiB; by Ref wins from there on (2.3x at 256
/// KiB). Sharing has a fixed cost of about 4.5 us (descriptor claims and
/// page counts on both sides) that copying through a ring only exceeds for
/// large payloads. The largest power of two below the crossover is chosen.
/// (A forwarded payload pays the copy at every hop, so chains of services
/// may want a lower threshold: `Config::inline_max`.)
pub const DEFAULT_INLINE_MAX: usize = 64 << 10;

/// How long a dial refused for want of a channel waits for channels that
/// only their client can free (their server closed them): a client in a
/// call, or calling in a loop, notices within microseconds to
/// milliseconds; one that stays idle frees its channel only when it next
/// calls or drops its connection.
pub const CLOSED_BY_SERVER_GRACE: Duration = Duration::from_millis(100);

/// Whether a dial refused for want of a channel, `waited` into its
/// `patience`, should try again: while channels are on their way to free
/// (see [`CLOSED_BY_SERVER_GRACE`] for those waiting on their client).
fn worth_waiting(closing: dm_pool::Closing, waited: Duration, patience: Duration) -> bool {
    waited < patience
        && (closing.soon > 0 || (closing.by_clients > 0 && waited < CLOSED_BY_SERVER_GRACE))
}

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
    /// Longest busy-poll of a TCP socket (and, in a TCP server, of the
    /// queue between its I/O thread and its dispatcher) before the waiting
    /// thread blocks; adapted to the waits seen, and given up at once on a
    /// crowded core ([`dm_sys::poll::Spin`]). Zero: block at once.
    pub tcp_spin: Duration,
}

/// The default [`Config::tcp_spin`]: a loopback round trip between polling
/// threads takes 6-9 us on the test machine, a sleeping thread's wake-up
/// 25-70 us; a budget that also covers the gaps between the calls of a
/// chain of services took a network chain's 3 tiers by value from 155 to
/// 51 us (50 us budget against 200; BENCHMARKS.md, `bench chain`). A
/// poller yields its core between polls and stops on a crowded one.
pub const DEFAULT_TCP_SPIN: Duration = Duration::from_micros(200);

impl Default for Config {
    fn default() -> Self {
        Config {
            inline_max: DEFAULT_INLINE_MAX,
            wait: WaitPolicy::from_env(),
            default_deadline: None,
            tcp_spin: DEFAULT_TCP_SPIN,
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
    pub(crate) registry: Arc<dyn Registry>,
    pub(crate) remote: Option<MemPool>,
}

/// What a lookup found, or, if it failed while the name is bound in this
/// process (`in_here`), nothing.
fn or_none<T>(r: Result<Vec<T>, RpcError>, in_here: bool) -> Result<Vec<T>, RpcError> {
    match r {
        Err(_) if in_here => Ok(Vec::new()),
        r => r,
    }
}

impl Node {
    /// A node on an attached pool with the default configuration.
    pub fn new(pool: Pool) -> Node {
        Node::with_config(pool, Config::default())
    }

    /// A node with `cfg`.
    pub fn with_config(pool: Pool, cfg: Config) -> Node {
        let registry = Arc::new(PoolRegistry::new(pool.clone()));
        Node {
            pool,
            cfg,
            registry,
            remote: None,
        }
    }

    /// This node with memory servers (DmRPC-net): a payload above the
    /// threshold bound for a peer that does not share the pool but uses
    /// the same memory servers is written there and travels as a Ref; Refs
    /// of those servers that arrive are read from them.
    pub fn with_memserver(mut self, remote: MemPool) -> Node {
        self.remote = Some(remote);
        self
    }

    /// The memory servers, if any.
    pub fn memserver(&self) -> Option<&MemPool> {
        self.remote.as_ref()
    }

    /// A digest of the memory servers this node uses (0: none): two nodes
    /// with the same digest can pass each other memory-server Refs.
    pub fn remote_domain(&self) -> u64 {
        let Some(m) = &self.remote else { return 0 };
        let mut ids = m.server_ids();
        ids.sort_unstable();
        let h = ids.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, id| {
            id.to_le_bytes()
                .iter()
                .fold(h, |h, b| (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3))
        });
        h.max(1)
    }

    /// What this node says about itself in a TCP hello.
    pub(crate) fn identity(&self) -> crate::transport::tcp::Identity {
        crate::transport::tcp::Identity {
            pool: self.pool.id(),
            remote: self.remote_domain(),
        }
    }

    /// Releases a Ref of the pool or of a memory server.
    pub(crate) fn release_ref(&self, r: &Ref) -> Result<(), RpcError> {
        match (&self.remote, r.backend) {
            (Some(m), dm_pool::BACKEND_MEMSERVER) => Ok(m.release_ref_nowait(r)?),
            _ => Ok(self.pool.release_ref(r)?),
        }
    }

    /// This node with another registry for TCP services (the pool's own
    /// registry still names its shared-memory services).
    pub fn with_registry(mut self, registry: Arc<dyn Registry>) -> Node {
        self.registry = registry;
        self
    }

    /// The registry TCP services are published in and looked up from.
    pub fn registry(&self) -> &Arc<dyn Registry> {
        &self.registry
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
    /// in-memory transport, else a TCP service in the node's registry, else
    /// a service in the pool's registry. The client reconnects when its
    /// connection breaks and the name is registered again (see
    /// [`crate::reconnect`]).
    pub fn connect(&self, name: &str) -> Result<Client, RpcError> {
        Ok(Client::new(self.redialer(Target::Name(name.to_owned()))?))
    }

    /// Like [`connect`](Self::connect), for async callers: calls are
    /// futures, any number may be outstanding on the connection.
    pub fn connect_async(&self, name: &str) -> Result<AsyncClient, RpcError> {
        Ok(AsyncClient::new(
            self.redialer(Target::Name(name.to_owned()))?,
        ))
    }

    /// A client of service `name` that connects on its first call, for a
    /// caller that may start before the service does: until the name is
    /// registered, calls fail at once with `Unavailable`, or, with
    /// [`CallOptions::wait_for_ready`](crate::CallOptions), wait for it
    /// until their deadline. Then as [`connect`](Self::connect).
    pub fn connect_lazily(&self, name: &str) -> Result<Client, RpcError> {
        dm_pool::validate_service_name(name)?;
        Ok(Client::new(Redial::unconnected(
            self.clone(),
            Target::Name(name.to_owned()),
        )))
    }

    /// Like [`connect_lazily`](Self::connect_lazily), for async callers.
    pub fn connect_async_lazily(&self, name: &str) -> Result<AsyncClient, RpcError> {
        dm_pool::validate_service_name(name)?;
        Ok(AsyncClient::new(Redial::unconnected(
            self.clone(),
            Target::Name(name.to_owned()),
        )))
    }

    /// A client of every replica of service `name`
    /// ([`ServerBuilder::replica`]), spreading its calls over them and
    /// following them as they come and go ([`crate::balance`]). A name
    /// with one registration works too (one replica). `NotFound` if the
    /// name has none.
    pub fn connect_balanced(&self, name: &str) -> Result<BalancedClient, RpcError> {
        BalancedClient::connect(self, name)
    }

    /// Like [`connect_balanced`](Self::connect_balanced), for async callers.
    pub fn connect_balanced_async(&self, name: &str) -> Result<AsyncBalancedClient, RpcError> {
        AsyncBalancedClient::connect(self, name)
    }

    /// A client's connection to service `name` along `route` (one of its
    /// registrations), redialled by name when it breaks.
    pub(crate) fn redialer_along<C: Connected>(
        &self,
        name: &str,
        route: &Route,
    ) -> Result<Redial<C>, RpcError> {
        let target = Target::Name(name.to_owned());
        let conn = self.dial(&target, route, REDIAL_TIMEOUT)?;
        Ok(Redial::new(
            self.clone(),
            target,
            route.origin.clone(),
            conn,
        ))
    }

    /// Resolves `target` and opens a first connection to it.
    fn redialer<C: Connected>(&self, target: Target) -> Result<Redial<C>, RpcError> {
        let route = self.resolve(&target)?;
        let conn = self.dial(&target, &route, CONNECT_TIMEOUT)?;
        Ok(Redial::new(self.clone(), target, route.origin, conn))
    }

    /// Where `target` is now, and which registration that is (of a name
    /// with replicas, the first of [`resolve_all`](Self::resolve_all)).
    pub(crate) fn resolve(&self, target: &Target) -> Result<Route, RpcError> {
        self.resolve_all(target)?
            .into_iter()
            .next()
            .ok_or_else(|| RpcError::not_found(format!("no service named {:?}", target.text())))
    }

    /// Every registration of `target` now (a name's replicas, or its one
    /// registration; a TCP address as it is), nearest transport first:
    /// bound in this process, then shared-memory services in the pool,
    /// then TCP services of the node's registry and of the pool's.
    /// `NotFound` if there is none.
    pub(crate) fn resolve_all(&self, target: &Target) -> Result<Vec<Route>, RpcError> {
        let name = match target {
            Target::Addr(addr) => {
                return Ok(vec![Route {
                    how: How::Tcp(addr.clone()),
                    origin: Origin::Addr,
                }])
            }
            Target::Name(name) => name,
        };
        let mut routes: Vec<Route> = crate::transport::mem::bindings(name)
            .into_iter()
            .map(|b| Route {
                how: How::Mem(b),
                origin: Origin::Mem(b),
            })
            .collect();
        // (A registry that fails to answer fails the lookup only if
        // nothing in this process has the name.)
        let in_here = !routes.is_empty();
        let in_pool = or_none(self.pool.lookup_all(name).map_err(RpcError::from), in_here)?;
        let listed = or_none(self.registry.lookup_all(name), in_here)?;
        let mut tcp = Vec::new();
        for e in listed {
            if let Endpoint::Tcp(addr) = &e.endpoint {
                tcp.push(Route {
                    how: How::Tcp(addr.clone()),
                    origin: Origin::Entry {
                        endpoint: e.endpoint.clone(),
                        owner: e.owner,
                        handle: e.handle,
                    },
                });
            }
        }
        for svc in in_pool {
            let origin = Origin::Pool {
                index: svc.index,
                generation: svc.generation,
            };
            match &svc.endpoint {
                Endpoint::Shm => routes.push(Route {
                    how: How::Shm(Box::new(svc)),
                    origin,
                }),
                // (Found in the node's registry already when that is the
                // pool's.)
                Endpoint::Tcp(addr)
                    if !tcp
                        .iter()
                        .any(|r: &Route| matches!(&r.how, How::Tcp(a) if a == addr)) =>
                {
                    tcp.push(Route {
                        how: How::Tcp(addr.clone()),
                        origin,
                    })
                }
                Endpoint::Tcp(_) => {}
            }
        }
        routes.extend(tcp);
        if routes.is_empty() {
            return Err(RpcError::not_found(format!("no service named {name:?}")));
        }
        Ok(routes)
    }

    /// Opens a transport connection along `route` (resolved for
    /// `target`), waiting at most `patience` for a TCP peer to accept, or
    /// for a channel of the pool to be freed.
    pub(crate) fn dial(
        &self,
        target: &Target,
        route: &Route,
        patience: Duration,
    ) -> Result<Connection, RpcError> {
        Ok(match &route.how {
            How::Mem(b) => crate::transport::mem::connect_to(target.text(), Some(*b))?,
            How::Tcp(addr) => self.open_tcp(addr, patience)?,
            How::Shm(svc) => self.open_shm(svc, patience)?,
        })
    }

    /// Opens a channel to `svc`. With every channel of the pool in use,
    /// waits (at most `patience`) while some are being closed: a client
    /// that just closed its connection frees its channel only when the
    /// server next looks, which a busy server does only between calls.
    /// Channels their server closed wait for their client, which notices
    /// only in a call: those are worth [`CLOSED_BY_SERVER_GRACE`] at most,
    /// since an idle client may never call again. With none closing, no
    /// wait helps: `ResourceExhausted` at once.
    fn open_shm(&self, svc: &ServiceInfo, patience: Duration) -> Result<Connection, RpcError> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(50);
        loop {
            match crate::transport::shm::connect(&self.pool, svc, self.cfg.wait) {
                Err(TransportError::Pool(dm_pool::Error::ResourceExhausted { .. }))
                    if worth_waiting(self.pool.channels_closing(), start.elapsed(), patience) =>
                {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(5));
                }
                r => return Ok(r?),
            }
        }
    }

    fn open_tcp(&self, addr: &str, patience: Duration) -> Result<Connection, RpcError> {
        Ok(crate::transport::tcp::connect(
            addr,
            self.identity(),
            patience,
            self.cfg.tcp_spin,
        )?)
    }

    /// Connects to a service by TCP address (`host:port`), for servers
    /// whose registry this process cannot see (another host). Refs travel
    /// only if the server is attached to this node's pool.
    pub fn connect_tcp(&self, addr: &str) -> Result<Client, RpcError> {
        Ok(Client::new(self.redialer(Target::Addr(addr.to_owned()))?))
    }

    /// Like [`connect_tcp`](Self::connect_tcp), for async callers.
    pub fn connect_tcp_async(&self, addr: &str) -> Result<AsyncClient, RpcError> {
        Ok(AsyncClient::new(
            self.redialer(Target::Addr(addr.to_owned()))?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dm_pool::Closing;

    #[test]
    fn a_dial_waits_for_closing_channels_and_only_briefly_for_idle_clients() {
        let ms = Duration::from_millis;
        let soon = Closing {
            soon: 1,
            by_clients: 0,
        };
        let by_clients = Closing {
            soon: 0,
            by_clients: 2,
        };
        let none = Closing::default();
        assert!(!worth_waiting(none, ms(0), ms(5000)));
        assert!(worth_waiting(soon, ms(4000), ms(5000)));
        assert!(!worth_waiting(soon, ms(5000), ms(5000)));
        assert!(worth_waiting(by_clients, ms(10), ms(5000)));
        assert!(!worth_waiting(by_clients, CLOSED_BY_SERVER_GRACE, ms(5000)));
        assert!(!worth_waiting(by_clients, ms(10), ms(10)));
        let both = Closing {
            soon: 1,
            by_clients: 1,
        };
        assert!(worth_waiting(both, ms(1000), ms(5000)));
    }
}

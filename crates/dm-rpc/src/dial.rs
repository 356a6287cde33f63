//! Finding a service and opening a connection to it: a name resolved to
//! its registrations (bound in this process, in the pool's registry, in
//! the node's registry), nearest transport first, and a transport
//! connection dialled along one of them. Clients (`client.rs`,
//! `async_client/`, `balance.rs`) and reconnecting (`reconnect.rs`)
//! use it; it uses no client.

use crate::error::RpcError;
use crate::node::Node;
use crate::transport::{Connection, TransportError};
use dm_pool::{Endpoint, ServiceInfo};
use std::time::{Duration, Instant};

/// What a client was connected to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// A service name, looked up again on every redial.
    Name(String),
    /// A TCP address, dialled again.
    Addr(String),
}

impl Target {
    /// The name or address, as the client reports it.
    pub(crate) fn text(&self) -> &str {
        match self {
            Target::Name(s) | Target::Addr(s) => s,
        }
    }
}

/// Which registration a connection was opened to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Origin {
    /// A binding of the in-memory transport in this process.
    Mem(u64),
    /// A record of the pool's registry, in one of its generations.
    Pool { index: u32, generation: u32 },
    /// An entry of the node's registry.
    Entry {
        endpoint: Endpoint,
        owner: String,
        handle: u64,
    },
    /// A bare TCP address.
    Addr,
}

/// How to reach a resolved service.
#[derive(Debug)]
pub(crate) enum How {
    Mem(u64),
    Tcp(String),
    Shm(Box<ServiceInfo>),
}

/// A service resolved: how to reach it, and which registration it is.
#[derive(Debug)]
pub(crate) struct Route {
    pub(crate) how: How,
    pub(crate) origin: Origin,
}

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

fn or_none<T>(r: Result<Vec<T>, RpcError>, in_here: bool) -> Result<Vec<T>, RpcError> {
    match r {
        Err(_) if in_here => Ok(Vec::new()),
        r => r,
    }
}

impl Node {
    /// Where `target` is now, and which registration that is (of a name
    /// with replicas, the first of [`resolve_all`](Self::resolve_all)).
    pub(crate) fn resolve(&self, target: &Target) -> Result<Route, RpcError> {
        self.resolve_all(target)?
            .into_iter()
            .next()
            .ok_or_else(|| self.no_service(target.text()))
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
            return Err(self.no_service(name));
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
    /// wait helps: `ResourceExhausted` at once, saying how many channels
    /// the pool has and how to get more.
    fn open_shm(&self, svc: &ServiceInfo, patience: Duration) -> Result<Connection, RpcError> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(50);
        loop {
            match crate::transport::shm::connect(&self.pool, svc, self.cfg.wait) {
                Err(TransportError::Pool(dm_pool::Error::ResourceExhausted {
                    what: "channels",
                })) => {
                    if !worth_waiting(self.pool.channels_closing(), start.elapsed(), patience) {
                        return Err(self.no_channel(&svc.name));
                    }
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(5));
                }
                r => return Ok(r?),
            }
        }
    }

    /// The error of a dial to `name` that found every channel of the pool
    /// in use.
    /// `NotFound` for a name nobody serves, saying where to look and how
    /// to wait for it.
    pub(crate) fn no_service(&self, name: &str) -> RpcError {
        RpcError::not_found(format!(
            "no service named {name:?} in the pool {} (`dmrpc ls` lists those registered). \
             To wait for it: `CallOptions::wait_for_ready`, or `Node::connect_lazily`",
            self.pool.path().display()
        ))
    }

    fn no_channel(&self, name: &str) -> RpcError {
        let n = self.pool.layout().n_channels;
        RpcError::resource_exhausted(format!(
            "cannot connect to {name:?}: all {n} channels of the pool {} are in use. \
             Close idle clients, or create the pool with more channels \
             (`dmrpc pool create NAME --channels N`, or `PoolConfig::channels`)",
            self.pool.path().display()
        ))
    }

    fn open_tcp(&self, addr: &str, patience: Duration) -> Result<Connection, RpcError> {
        Ok(crate::transport::tcp::connect(
            addr,
            self.identity(),
            patience,
            self.cfg.tcp_spin,
        )?)
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

//! Applications built on dmrpc: real services that the benchmarks run as
//! separate processes (`dmrpc bench image`) and that show how a service
//! passes large data through tiers by Ref: [`image`] (a 7-tier image
//! pipeline) and [`social`] (a social network whose posts carry media).

pub mod image;
pub mod social;

use dm_rpc::{BalancedClient, CallOptions, Client, Node, Payload, RpcError};
use std::sync::OnceLock;

/// How a service reaches another: by name over shared-memory channels,
/// at a TCP address, or by name among replicas the node's registry lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Link {
    /// A service in the same pool, by name.
    Shm(String),
    /// A service at `host:port`.
    Tcp(String),
    /// Replicas of a service found by name in the node's registry (etcd
    /// across hosts), wherever they are: calls are balanced over them and,
    /// as the tiers keep no state, one whose replica died is sent again
    /// to another.
    Replicas(String),
}

/// A connection a [`Link`] makes.
#[derive(Debug)]
pub enum Conn {
    /// One service.
    One(Client),
    /// Replicas, balanced.
    Balanced(BalancedClient),
}

impl Conn {
    /// Calls `method` with `p`.
    pub fn call(&self, method: &str, p: impl Into<Payload>) -> Result<Payload, RpcError> {
        match self {
            Conn::One(c) => c.call(method, p),
            Conn::Balanced(b) => b.call_with(method, p.into(), may_repeat()),
        }
    }
}

/// Options of a call to replicas: it may run twice (the tiers keep no
/// state), so one whose replica died is sent to another.
pub fn may_repeat() -> CallOptions {
    CallOptions::deadline(std::time::Duration::from_secs(10)).idempotent()
}

impl Link {
    /// Connects `node` to the service this names.
    pub fn connect(&self, node: &Node) -> Result<Conn, RpcError> {
        Ok(match self {
            Link::Shm(name) => Conn::One(node.connect(name)?),
            Link::Tcp(addr) => Conn::One(node.connect_tcp(addr)?),
            Link::Replicas(name) => Conn::Balanced(node.connect_balanced(name)?),
        })
    }
}

/// The little-endian u32 at byte `i` of `b`.
fn u32_at(b: &[u8], i: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[i..i + 4]);
    u32::from_le_bytes(x)
}

/// The little-endian u64 at byte `i` of `b`.
fn u64_at(b: &[u8], i: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[i..i + 8]);
    u64::from_le_bytes(x)
}

/// A client of another service, connected on first use (services start
/// in any order).
#[derive(Debug)]
struct Next {
    node: Node,
    link: Link,
    client: OnceLock<Conn>,
}

impl Next {
    fn new(node: &Node, link: Link) -> Next {
        Next {
            node: node.clone(),
            link,
            client: OnceLock::new(),
        }
    }

    fn call(&self, method: &str, p: Payload) -> Result<Payload, RpcError> {
        let c = match self.client.get() {
            Some(c) => c,
            None => {
                let c = self.link.connect(&self.node)?;
                self.client.get_or_init(|| c)
            }
        };
        c.call(method, p)
    }
}

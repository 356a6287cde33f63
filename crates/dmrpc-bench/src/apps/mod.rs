//! Applications built on dmrpc: real services that the benchmarks run as
//! separate processes (`dmrpc bench image`) and that show how a service
//! passes large data through tiers by Ref: [`image`] (a 7-tier image
//! pipeline) and [`social`] (a social network whose posts carry media).

pub mod image;
pub mod social;

use dm_rpc::{Client, Node, Payload, RpcError};
use std::sync::OnceLock;

/// How a service reaches another: by name over shared-memory channels,
/// or at a TCP address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Link {
    /// A service in the same pool, by name.
    Shm(String),
    /// A service at `host:port`.
    Tcp(String),
}

impl Link {
    /// Connects `node` to the service this names.
    pub fn connect(&self, node: &Node) -> Result<Client, RpcError> {
        match self {
            Link::Shm(name) => node.connect(name),
            Link::Tcp(addr) => node.connect_tcp(addr),
        }
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
    client: OnceLock<Client>,
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

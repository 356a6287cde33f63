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
                let c = match &self.link {
                    Link::Shm(name) => self.node.connect(name)?,
                    Link::Tcp(addr) => self.node.connect_tcp(addr)?,
                };
                self.client.get_or_init(|| c)
            }
        };
        c.call(method, p)
    }
}

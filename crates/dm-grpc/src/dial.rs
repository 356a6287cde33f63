//! How a client reaches a gRPC service by its dmrpc name ([`Dial`]).

use crate::direct::client::Direct;
use crate::pipe::{Pipe, PIPE_METHOD};
use crate::Channel;
use dm_pool::Endpoint;
use dm_rpc::{Node, RpcError};
use std::sync::Arc;
use tonic::transport::Endpoint as GrpcEndpoint;

/// Which way a channel in the pool goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    /// Each gRPC call a dmrpc call: no HTTP/2 (the default).
    Direct,
    /// HTTP/2 over a dmrpc byte stream (NotNets' way).
    Http2,
}

/// How a client reaches a gRPC service: over shared memory when the
/// service is registered in this node's pool, else over ordinary gRPC
/// (HTTP/2 over TCP) at the address it is given. The generated client is
/// the same either way: only its channel differs.
#[derive(Debug, Clone)]
pub struct Dial {
    node: Node,
    name: String,
    tcp: Option<String>,
    way: Way,
}

impl Dial {
    /// Dials dmrpc service `name` of `node`'s pool.
    pub fn new(node: &Node, name: &str) -> Dial {
        Dial {
            node: node.clone(),
            name: name.to_owned(),
            tcp: None,
            way: Way::Direct,
        }
    }

    /// Goes over HTTP/2 on shared memory (NotNets' way) instead of
    /// making each call a dmrpc call.
    pub fn http2(mut self) -> Dial {
        self.way = Way::Http2;
        self
    }

    /// Which way it goes in the pool.
    pub fn way(&self) -> Way {
        self.way
    }

    /// Where the service is served over TCP (`http://host:port`), for when
    /// it is not in this pool.
    pub fn or_tcp(mut self, uri: &str) -> Dial {
        self.tcp = Some(uri.to_owned());
        self
    }

    /// Whether the service is registered, live, in this node's pool.
    pub fn in_pool(&self) -> bool {
        matches!(
            self.node.pool().lookup(&self.name),
            Ok(Some(s)) if s.endpoint == Endpoint::Shm
        )
    }

    /// A channel to the service, connected now.
    pub async fn connect(self) -> Result<Channel, RpcError> {
        if !self.in_pool() {
            let Some(uri) = self.tcp else {
                return Err(RpcError::new(
                    dm_rpc::Status::NotFound,
                    format!(
                        "no gRPC service {:?} in this pool, and no TCP address to fall back on \
                         (Dial::or_tcp)",
                        self.name
                    ),
                ));
            };
            let e = GrpcEndpoint::from_shared(uri.clone())
                .map_err(|e| RpcError::invalid_argument(format!("bad URI {uri:?}: {e}")))?
                .tcp_nodelay(true);
            return e
                .connect()
                .await
                .map(Channel::http2)
                .map_err(|e| RpcError::unavailable(format!("cannot connect to {uri}: {e}")));
        }
        if self.way == Way::Direct {
            let client = self.node.connect_async(&self.name)?;
            return Ok(Channel::direct(Direct::new(&self.node, client)));
        }
        let client = Arc::new(self.node.connect_async(&self.name)?);
        let connector = tower::service_fn(move |_: http::Uri| {
            let client = client.clone();
            async move {
                let call = client
                    .call_bidi(PIPE_METHOD, Vec::new())
                    .await
                    .map_err(std::io::Error::other)?;
                let (items, answer) = call.split();
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(Pipe::client(items, answer)))
            }
        });
        GrpcEndpoint::from_static("http://dmrpc.invalid")
            .connect_with_connector(connector)
            .await
            .map(Channel::http2)
            .map_err(|e| RpcError::unavailable(format!("cannot open {:?}: {e}", self.name)))
    }
}

//! The iceoryx2 peer of `bench rtt`: request-response between two
//! processes over iceoryx2's shared memory: u64 request and response for
//! the no-op round trip, byte slices for the echo.
//! Both sides poll without sleeping, as in iceoryx2's own latency
//! benchmark; the server stops polling on `unserve`.

use anyhow::{anyhow, Result};
use iceoryx2::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

type Service = iceoryx2::service::ipc::Service;

/// Quiet: without a config file iceoryx2 warns that it uses its defaults
/// (which is what the benchmark wants).
fn quiet() {
    set_log_level_from_env_or(LogLevel::Error);
}

fn name(s: &str) -> Result<ServiceName> {
    quiet();
    s.try_into()
        .map_err(|e| anyhow!("iceoryx2 service name {s:?}: {e:?}"))
}

fn new_node() -> Result<Node<Service>> {
    quiet();
    NodeBuilder::new()
        .create::<Service>()
        .map_err(|e| anyhow!("iceoryx2 node: {e:?}"))
}

/// Runs `serve` on a thread named `thread`; returns once it has called
/// its `ready` argument, or with its error.
fn spawn_server(
    thread: &str,
    serve: impl FnOnce(&dyn Fn()) -> Result<()> + Send + 'static,
) -> Result<()> {
    let (tx, rx) = std::sync::mpsc::channel::<Result<(), String>>();
    std::thread::Builder::new()
        .name(thread.into())
        .spawn(move || {
            let ready_tx = tx.clone();
            let ready = move || {
                let _ = ready_tx.send(Ok(()));
            };
            if let Err(e) = serve(&ready) {
                let _ = tx.send(Err(e.to_string()));
            }
        })?;
    rx.recv()?.map_err(|e| anyhow!(e))
}

/// Serves `service` on a thread, echoing each request, until `stop`.
pub fn serve(service: &str, stop: Arc<AtomicBool>) -> Result<()> {
    let svc = name(service)?;
    spawn_server("iceoryx2-peer", move |ready| {
        let node = new_node()?;
        let s = node
            .service_builder(&svc)
            .request_response::<u64, u64>()
            .open_or_create()
            .map_err(|e| anyhow!("iceoryx2 service: {e:?}"))?;
        let server = s
            .server_builder()
            .create()
            .map_err(|e| anyhow!("iceoryx2 server: {e:?}"))?;
        ready();
        while !stop.load(Ordering::Relaxed) {
            match server.receive().map_err(|e| anyhow!("receive: {e:?}"))? {
                Some(req) => {
                    let v = *req;
                    req.send_copy(v).map_err(|e| anyhow!("respond: {e:?}"))?;
                }
                None => std::hint::spin_loop(),
            }
        }
        Ok(())
    })
}

/// A client of the peer's service.
pub struct Client {
    _node: Node<Service>,
    client: iceoryx2::port::client::Client<Service, u64, (), u64, ()>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("iceoryx2 Client")
    }
}

impl Client {
    pub fn connect(service: &str) -> Result<Client> {
        let node = new_node()?;
        let s = node
            .service_builder(&name(service)?)
            .request_response::<u64, u64>()
            .open_or_create()
            .map_err(|e| anyhow!("iceoryx2 service: {e:?}"))?;
        let client = s
            .client_builder()
            .create()
            .map_err(|e| anyhow!("iceoryx2 client: {e:?}"))?;
        Ok(Client {
            _node: node,
            client,
        })
    }

    /// One request and its response, polling.
    pub fn call(&self, v: u64) -> Result<u64> {
        let pending = self
            .client
            .send_copy(v)
            .map_err(|e| anyhow!("request: {e:?}"))?;
        loop {
            if let Some(r) = pending.receive().map_err(|e| anyhow!("response: {e:?}"))? {
                return Ok(*r);
            }
            std::hint::spin_loop();
        }
    }
}

/// Serves `service` on a thread, echoing byte slices of up to `max` bytes
/// (each request copied into a loaned response), until `stop`.
pub fn serve_bytes(service: &str, max: usize, stop: Arc<AtomicBool>) -> Result<()> {
    let svc = name(service)?;
    spawn_server("iceoryx2-echo", move |ready| {
        let node = new_node()?;
        let s = node
            .service_builder(&svc)
            .request_response::<[u8], [u8]>()
            .open_or_create()
            .map_err(|e| anyhow!("iceoryx2 service: {e:?}"))?;
        let server = s
            .server_builder()
            .initial_max_slice_len(max)
            .create()
            .map_err(|e| anyhow!("iceoryx2 server: {e:?}"))?;
        ready();
        while !stop.load(Ordering::Relaxed) {
            match server.receive().map_err(|e| anyhow!("receive: {e:?}"))? {
                Some(req) => {
                    let p = req.payload();
                    let resp = req
                        .loan_slice_uninit(p.len())
                        .map_err(|e| anyhow!("loan: {e:?}"))?;
                    resp.write_from_slice(p)
                        .send()
                        .map_err(|e| anyhow!("respond: {e:?}"))?;
                }
                None => std::hint::spin_loop(),
            }
        }
        Ok(())
    })
}

/// A client of the peer's byte echo.
pub struct EchoClient {
    _node: Node<Service>,
    client: iceoryx2::port::client::Client<Service, [u8], (), [u8], ()>,
}

impl std::fmt::Debug for EchoClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("iceoryx2 EchoClient")
    }
}

impl EchoClient {
    pub fn connect(service: &str, max: usize) -> Result<EchoClient> {
        let node = new_node()?;
        let s = node
            .service_builder(&name(service)?)
            .request_response::<[u8], [u8]>()
            .open_or_create()
            .map_err(|e| anyhow!("iceoryx2 service: {e:?}"))?;
        let client = s
            .client_builder()
            .initial_max_slice_len(max)
            .create()
            .map_err(|e| anyhow!("iceoryx2 client: {e:?}"))?;
        Ok(EchoClient {
            _node: node,
            client,
        })
    }

    /// Sends `data` (copied into a loaned request) and waits for the echo,
    /// polling; returns its length.
    pub fn echo(&self, data: &[u8]) -> Result<usize> {
        let req = self
            .client
            .loan_slice_uninit(data.len())
            .map_err(|e| anyhow!("loan: {e:?}"))?;
        let pending = req
            .write_from_slice(data)
            .send()
            .map_err(|e| anyhow!("request: {e:?}"))?;
        loop {
            if let Some(r) = pending.receive().map_err(|e| anyhow!("response: {e:?}"))? {
                return Ok(r.payload().len());
            }
            std::hint::spin_loop();
        }
    }
}

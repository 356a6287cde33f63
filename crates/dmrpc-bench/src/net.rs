//! The network backend in the benchmarks (DmRPC-net): a memory server as
//! its own process, and where a peer's TCP servers listen.

use anyhow::{anyhow, Context, Result};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// The environment variable that tells a peer where to listen
/// (`hosts.rs` sets it for the peers it starts on a host).
pub const LISTEN_ENV: &str = "DMRPC_BENCH_LISTEN";

/// The address a peer's TCP servers listen on: its host's, or loopback.
pub fn listen_ip() -> String {
    std::env::var(LISTEN_ENV).unwrap_or_else(|_| "127.0.0.1".into())
}

/// A peer's node config for its host: serving without a key beyond
/// loopback (the benchmark's hosts are its own).
pub fn node_config(cfg: dm_rpc::Config) -> dm_rpc::Config {
    dm_rpc::Config {
        tcp_open: listen_ip() != "127.0.0.1",
        ..cfg
    }
}

/// A client of the memory servers `list` names (comma separated), as one
/// pool.
pub fn memservers(
    list: &str,
    cfg: dm_memserver::ClientConfig,
) -> dm_pool::Result<dm_memserver::MemPool> {
    let addrs: Vec<&str> = list.split(',').collect();
    dm_memserver::MemPool::connect_with(&addrs, cfg)
}

/// A child process killed on drop.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `dmrpc memserver` (2 worker threads) on a free loopback port.
pub fn start_memserver(size: &str) -> Result<(Proc, String)> {
    start_memserver_with(size, &[])
}

/// [`start_memserver`] with more flags (a key file, a quota).
pub fn start_memserver_with(size: &str, more: &[&str]) -> Result<(Proc, String)> {
    start_memserver_cmd(
        Command::new(std::env::current_exe()?),
        "127.0.0.1:0",
        size,
        2,
        more,
    )
}

/// `dmrpc memserver` with `threads` worker threads run by `cmd` (this
/// executable, perhaps in another network namespace), listening on
/// `listen`.
pub fn start_memserver_cmd(
    mut cmd: Command,
    listen: &str,
    size: &str,
    threads: usize,
    more: &[&str],
) -> Result<(Proc, String)> {
    let threads = threads.to_string();
    let mut c = cmd
        .args([
            "memserver",
            "--listen",
            listen,
            "--size",
            size,
            "--threads",
            &threads,
        ])
        .args(more)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .context("starting dmrpc memserver")?;
    let mut line = String::new();
    BufReader::new(c.stdout.take().ok_or_else(|| anyhow!("no stdout"))?).read_line(&mut line)?;
    let addr = line
        .split_whitespace()
        .nth(1)
        .ok_or_else(|| anyhow!("memserver said {line:?}"))?
        .to_owned();
    Ok((Proc(c), addr))
}

//! The network backend in the benchmarks (DmRPC-net): a memory server as
//! its own process, and `bench cow`'s network variant.

use super::peer::median;
use super::serde_like::Obj;
use crate::say;
use anyhow::{anyhow, Context, Result};
use dm_memserver::MemPool;
use dm_pool::{Dm, DmBuffer};
use dmrpc::fmt_size;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
        more,
    )
}

/// `dmrpc memserver` (2 worker threads) run by `cmd` (this executable,
/// perhaps in another network namespace), listening on `listen`.
pub fn start_memserver_cmd(
    mut cmd: Command,
    listen: &str,
    size: &str,
    more: &[&str],
) -> Result<(Proc, String)> {
    let mut c = cmd
        .args([
            "memserver",
            "--listen",
            listen,
            "--size",
            size,
            "--threads",
            "2",
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

/// `bench cow` on a memory server: moving a buffer's value to another
/// client (one transfer of its bytes into a new buffer: a write) against
/// passing it by Ref (create_ref + the other client's map_ref: two small
/// requests, no data moved; the mapping's free and the Ref's release
/// follow, off the timed path, as a call's do). Medians.
pub fn cow(a: &super::BenchArgs, max: u64, budget: Duration) -> Result<Vec<Obj>> {
    let mut rows = Vec::new();
    for link in super::hosts::links(a) {
        // Host 0 the two clients, host 1 the memory server.
        if let Some(net) = super::hosts::Net::new(&link, 2)? {
            rows.extend(cow_over(&net, max, budget)?);
        }
    }
    Ok(rows)
}

/// [`cow`] over one link.
fn cow_over(net: &super::hosts::Net, max: u64, budget: Duration) -> Result<Vec<Obj>> {
    let (_ms, addr) = net.memserver(1, &format!("{}", max * 4 + (64 << 20)))?;
    let link = net.describe();
    let cfg = net.client_config();
    net.on(0, || cow_clients(&addr, cfg, &link, max, budget))
}

/// [`cow`]'s two clients of the memory server at `addr`.
fn cow_clients(
    addr: &str,
    cfg: dm_memserver::ClientConfig,
    link: &str,
    max: u64,
    budget: Duration,
) -> Result<Vec<Obj>> {
    let caller = MemPool::connect_with(&[addr], cfg.clone())?;
    let callee = MemPool::connect_with(&[addr], cfg)?;
    say!("\nnetwork backend (a memory server over {link}): value transfer vs create_ref + map_ref by another client");
    say!(
        "{:>9} {:>11} {:>11} {:>11} {:>11} {:>8}",
        "size",
        "copy",
        "create_ref",
        "map_ref",
        "create+map",
        "ratio"
    );
    let mut rows = Vec::new();
    let mut size = 4096u64;
    while size <= max {
        let data: Vec<u8> = (0..size).map(|i| i as u8).collect();
        let mut src = caller.alloc(size)?;
        src.write(0, &data)?;
        let (mut copy, mut create, mut map, mut total) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let t_end = Instant::now() + budget;
        while copy.len() < 5 || (Instant::now() < t_end && copy.len() < 2_000) {
            let mut dst = callee.alloc(size)?;
            let t = Instant::now();
            dst.write(0, &data)?;
            copy.push(t.elapsed().as_nanos() as f64);
            callee.free(dst)?;
        }
        let t_end = Instant::now() + budget;
        while create.len() < 5 || (Instant::now() < t_end && create.len() < 2_000) {
            let t = Instant::now();
            let r = caller.create_ref(&src, 0, size)?;
            let c = t.elapsed().as_nanos() as f64;
            let m = callee.map_ref(&r)?;
            let both = t.elapsed().as_nanos() as f64;
            create.push(c);
            map.push(both - c);
            total.push(both);
            callee.free(m)?;
            caller.release_ref_nowait(&r)?;
        }
        caller.free(src)?;
        let (copy_ns, create_ns, map_ns, share_ns) = (
            median(&mut copy),
            median(&mut create),
            median(&mut map),
            median(&mut total),
        );
        let ratio = copy_ns / share_ns;
        say!(
            "{:>9} {:>8.1} us {:>8.1} us {:>8.1} us {:>8.1} us {:>7.1}x",
            fmt_size(size),
            copy_ns / 1e3,
            create_ns / 1e3,
            map_ns / 1e3,
            share_ns / 1e3,
            ratio
        );
        let mut o = Obj::default();
        o.num("size", size as f64);
        o.str("link", link);
        o.num("copy_ns", copy_ns);
        o.num("create_ref_ns", create_ns);
        o.num("map_ref_ns", map_ns);
        o.num("create_and_map_ns", share_ns);
        o.num("ratio_copy_over_share", ratio);
        rows.push(o);
        size *= 4;
    }
    let problems = caller.check()?;
    if !problems.is_empty() {
        anyhow::bail!("memory server check failed: {problems:?}");
    }
    Ok(rows)
}

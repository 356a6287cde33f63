//! `dmrpc cluster`: three hosts on this machine, found by name through
//! etcd.
//!
//! The hosts are network namespaces joined by a switch (crate
//! `dm-netns`), each link shaped to `--link`. Each host has a pool of
//! its own and a member of a three-member etcd cluster; hosts 0 and 1
//! run a memory server each, registered in etcd (zone `cluster`). A
//! chain of `--tiers` services spreads over the hosts, each tier a
//! replica on two hosts, registered in etcd under its lease
//! (`cluster/tier/K`) and calling the next tier by name. Payloads go
//! inline or by memory-server Ref as each node learns is faster.
//!
//! A client on host 0 calls the chain with each of `--sizes` and checks
//! every answer (the last tier's checksum of what it read). With
//! `--kill-host N` it then kills every process of host N (its tiers and
//! its etcd member) with SIGKILL, calls on (the balanced clients fail
//! over to the replicas on the other hosts), and says how long etcd took
//! to forget the dead tiers. It ends with every pool checked.
//!
//! Needs root and iproute2 (`scripts/deps.sh`), and etcd.

use super::demo::checksum;
use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use dm_etcd::{EtcdCluster, EtcdConfig, EtcdRegistry};
use dm_pool::auth::Key;
use dm_pool::{AttachOptions, Pool, PoolConfig};
use dm_rpc::{CallOptions, Config, Node, Payload, Registry, RpcError, Transport};
use dmrpc::{fmt_size, parse_size};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Hosts of the cluster.
const HOSTS: usize = 3;
/// The memory servers' zone in etcd.
const ZONE: &str = "cluster";
/// etcd's lease of every process here.
const LEASE: Duration = Duration::from_secs(2);

#[derive(Args, Debug)]
pub struct ClusterArgs {
    /// Each host's link: a rate as `tc` writes it (`10gbit`), or
    /// `unshaped`.
    #[arg(long, default_value = "10gbit")]
    pub link: String,
    /// Tiers of the chain (each a replica on two hosts).
    #[arg(long, default_value_t = 3)]
    pub tiers: usize,
    /// Payload sizes, comma separated.
    #[arg(long, default_value = "64KiB,1MiB", value_delimiter = ',', value_parser = parse_size)]
    pub sizes: Vec<u64>,
    /// Calls per size.
    #[arg(long, default_value_t = 200)]
    pub calls: usize,
    /// After the calls, kill every process of this host (1 or 2) and call
    /// on.
    #[arg(long)]
    pub kill_host: Option<usize>,
}

/// A tier process of the cluster (`dmrpc __cluster-tier`).
#[derive(Args, Debug)]
pub struct TierArgs {
    #[arg(long)]
    pub pool: PathBuf,
    #[arg(long)]
    pub etcd: String,
    #[arg(long)]
    pub ip: String,
    #[arg(long)]
    pub tier: usize,
    #[arg(long)]
    pub tiers: usize,
    #[arg(long)]
    pub host: usize,
    #[arg(long)]
    pub key_file: PathBuf,
}

fn tier_name(t: usize) -> String {
    format!("cluster/tier/{t}")
}

fn ip(host: usize) -> String {
    format!("10.99.0.{}", host + 1)
}

/// A node on `pool` that finds services in etcd and keeps payloads on
/// the zone's memory servers.
fn node(pool: Pool, path: &Path, etcd: &[String], key: &Path) -> Result<(Node, EtcdRegistry)> {
    let mut cfg = EtcdConfig::new(etcd);
    cfg.lease = LEASE;
    cfg.pool = Some(path.display().to_string());
    let reg = EtcdRegistry::connect(cfg)?;
    let mem = reg.mem_pool(
        Some(ZONE),
        dm_memserver::ClientConfig {
            key: Some(Key::from_file(key)?),
            ..Default::default()
        },
    )?;
    let n = Node::with_config(
        pool,
        Config {
            // The hosts' network is this machine's own.
            tcp_open: true,
            ..Default::default()
        },
    )
    .with_registry(Arc::new(reg.clone()))
    .with_memserver(mem);
    Ok((n, reg))
}

/// Options of the chain's calls: they may run twice (a tier has no
/// state), so one whose replica died is sent to another.
fn calls_may_repeat() -> CallOptions {
    CallOptions::deadline(Duration::from_secs(10)).idempotent()
}

/// The tier process: serves `cluster/tier/K` as a replica on its host's
/// address until its stdin closes.
pub fn tier(a: TierArgs) -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let pool = Pool::open(&a.pool, AttachOptions::default())?;
    let eps = dm_etcd::parse_endpoints(&a.etcd);
    let (node, _reg) = node(pool, &a.pool, &eps, &a.key_file)?;
    let next = (a.tier + 1 < a.tiers).then(|| tier_name(a.tier + 1));
    let host = a.host as u8;
    // The next tier is found by name on the first call (it may start
    // after this one).
    let onward: Arc<std::sync::OnceLock<dm_rpc::BalancedClient>> = Default::default();
    let n2 = node.clone();
    let server = node
        .server(&tier_name(a.tier))
        .transport(Transport::Tcp(format!("{}:0", a.ip)))
        .replica()
        .method("pass", move |c| match &next {
            Some(next) => {
                let bc = match onward.get() {
                    Some(bc) => bc,
                    None => {
                        let bc = n2.connect_balanced(next)?;
                        onward.get_or_init(|| bc)
                    }
                };
                let opts = calls_may_repeat();
                bc.call_with("pass", c.take_payload(), opts)
            }
            None => {
                // Every byte read where it lies (no copy out).
                let mut out = checksum(&c.payload().segments()?).to_le_bytes().to_vec();
                out.push(host);
                Ok(Payload::from_vec(out))
            }
        })
        .spawn()?;
    println!("ready");
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(server);
    Ok(())
}

/// A child process: asked to stop by [`Proc::stop`], killed on drop.
struct Proc(Child);

impl Proc {
    /// Asks it to end (a tier when its stdin closes, a memory server on
    /// SIGTERM) and waits for it a while.
    fn stop(mut self) {
        drop(self.0.stdin.take());
        // SAFETY: kill(2) on our own child's pid, which we have not waited
        // for yet (it cannot have been reused).
        unsafe { libc::kill(self.0.id() as libc::pid_t, libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits for `c`'s first line on stdout; it must start with `want`.
fn first_line(c: &mut Child, want: &str) -> Result<String> {
    let out = c.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line)?;
    if !line.starts_with(want) {
        bail!("expected {want:?}, got {line:?} (see its stderr above)");
    }
    Ok(line)
}

pub fn run(a: ClusterArgs) -> Result<()> {
    if a.tiers == 0 || a.sizes.is_empty() || a.calls == 0 {
        bail!("--tiers, --sizes and --calls must not be empty");
    }
    if a.kill_host.is_some_and(|h| h == 0 || h >= HOSTS) {
        bail!("--kill-host must be 1 or 2 (host 0 runs the client)");
    }
    if !dm_etcd::etcd_available() {
        bail!("no etcd here: scripts/deps.sh installs etcd-server");
    }
    let link = dm_netns::Link::parse(&a.link)?;
    let hosts = dm_netns::Hosts::up(HOSTS, link).context("making the hosts")?;
    let work = std::env::temp_dir().join(format!("dmrpc-cluster-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    // All of it from host 0: its network reaches the others'.
    let r = std::thread::scope(|s| {
        s.spawn(|| {
            hosts.enter(0)?;
            run_on(&a, &hosts, &work)
        })
        .join()
        .map_err(|_| anyhow!("the cluster's thread panicked"))?
    });
    let _ = std::fs::remove_dir_all(&work);
    r
}

fn run_on(a: &ClusterArgs, hosts: &dm_netns::Hosts, work: &Path) -> Result<()> {
    let exe = std::env::current_exe()?;
    println!(
        "{HOSTS} hosts joined by a switch, links {}; etcd on each; memory servers on hosts 0 and 1",
        hosts.link().describe()
    );
    // etcd: a member per host.
    let addrs: Vec<(String, String)> = (0..HOSTS)
        .map(|i| (format!("{}:2379", ip(i)), format!("{}:2380", ip(i))))
        .collect();
    let namespaces = hosts.namespaces();
    let mut etcd = EtcdCluster::start_with(&addrs, &work.join("etcd"), move |i, mut c| {
        // (A namespace gone makes the member fail to start, said there.)
        let _ = dm_netns::place(&namespaces[i], &mut c);
        c
    })
    .context("starting etcd")?;
    let eps = etcd.endpoints();
    let eps_arg = eps.join(",");
    // Pools, a key for the memory servers, the memory servers.
    let mut pools = Vec::new();
    for i in 0..HOSTS {
        let p = PathBuf::from(format!(
            "/dev/shm/dmrpc-cluster-{}-h{i}.pool",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&p);
        Pool::create(
            &p,
            &PoolConfig {
                size: 256 << 20,
                ..Default::default()
            },
        )?;
        pools.push(p);
    }
    let pools_guard = RemoveOnDrop(pools.clone());
    let key = work.join("memserver.key");
    Key::generate_file(&key)?;
    let mut procs: Vec<(usize, Proc)> = Vec::new();
    for h in 0..2 {
        let mut c = hosts.command(h, &exe)?;
        c.args(["memserver", "--listen", &format!("{}:7070", ip(h))])
            .args(["--size", "512MiB", "--etcd", &eps_arg, "--zone", ZONE])
            .arg("--key-file")
            .arg(&key)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped());
        let mut child = c.spawn().context("starting a memory server")?;
        first_line(&mut child, "listening")?;
        procs.push((h, Proc(child)));
    }
    // The tiers: tier K on hosts K and K+1 (mod 3).
    for t in 0..a.tiers {
        for h in [t % HOSTS, (t + 1) % HOSTS] {
            let mut c = hosts.command(h, &exe)?;
            c.arg("__cluster-tier")
                .arg("--pool")
                .arg(&pools[h])
                .args(["--etcd", &eps_arg, "--ip", &ip(h)])
                .args(["--tier", &t.to_string(), "--tiers", &a.tiers.to_string()])
                .args(["--host", &h.to_string()])
                .arg("--key-file")
                .arg(&key)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped());
            let mut child = c.spawn().context("starting a tier")?;
            first_line(&mut child, "ready")?;
            procs.push((h, Proc(child)));
        }
    }
    println!(
        "{} tiers, each a replica on two hosts, registered in etcd at {eps_arg}",
        a.tiers
    );
    // The client, on host 0.
    let client = client_on_host0(&pools[0], &key, &eps, a, &mut etcd, &mut procs)?;
    for l in client {
        println!("{l}");
    }
    // Every pool checked: the killed host's too (its dead tiers' holdings
    // are reclaimed on the way).
    for p in &pools {
        dm_pool::gc_path(p)?;
        let r = dm_pool::check_path(p, true)?;
        if !r.ok() {
            bail!("pool check of {} failed: {:#?}", p.display(), r.problems);
        }
        if r.pages_held + r.slots_live + r.services + r.channels != 0 {
            bail!(
                "{} still holds something after every process ended: {r:?}",
                p.display()
            );
        }
    }
    println!("every pool checked: clean");
    drop(pools_guard);
    Ok(())
}

/// Removes pool files (each checked first) when dropped.
struct RemoveOnDrop(Vec<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The client's calls (from host 0), and the kill of `a.kill_host`.
fn client_on_host0(
    pool: &Path,
    key: &Path,
    eps: &[String],
    a: &ClusterArgs,
    etcd: &mut EtcdCluster,
    procs: &mut Vec<(usize, Proc)>,
) -> Result<Vec<String>> {
    let (sizes, calls, tiers) = (&a.sizes, a.calls, a.tiers);
    let mut lines = Vec::new();
    {
        let p = Pool::open(pool, AttachOptions::default())?;
        let (node, reg) = node(p, pool, eps, key)?;
        let bc = node.connect_balanced(&tier_name(0))?;
        let opts = calls_may_repeat;
        let call = |data: &[u8]| -> Result<u8, RpcError> {
            let a = bc.call_with("pass", Payload::from_vec(data.to_vec()), opts())?;
            let v = a.to_vec()?;
            if v.len() != 9 || v[..8] != checksum(&[data]).to_le_bytes() {
                return Err(RpcError::internal(
                    "the chain's answer does not match its request",
                ));
            }
            Ok(v[8])
        };
        lines.push(format!(
            "{:>9} {:>7} {:>10} {:>10} {:>12}",
            "size", "calls", "p50 us", "p99 us", "calls/s"
        ));
        for &size in sizes.iter() {
            let data: Vec<u8> = (0..size as usize).map(|i| (i * 31 % 251) as u8).collect();
            for _ in 0..calls.min(20) {
                call(&data)?;
            }
            let mut t = Vec::with_capacity(calls);
            let start = Instant::now();
            for _ in 0..calls {
                let c = Instant::now();
                call(&data)?;
                t.push(c.elapsed());
            }
            let all = start.elapsed();
            t.sort_unstable();
            lines.push(format!(
                "{:>9} {:>7} {:>10.1} {:>10.1} {:>12.0}",
                fmt_size(size),
                calls,
                t[calls / 2].as_secs_f64() * 1e6,
                t[calls * 99 / 100].as_secs_f64() * 1e6,
                calls as f64 / all.as_secs_f64()
            ));
        }
        if let Some(k) = a.kill_host {
            // Every process of host k: its tiers, its etcd member.
            let dead: Vec<u32> = procs
                .iter()
                .filter(|(h, _)| *h == k)
                .map(|(_, p)| p.0.id())
                .collect();
            let killed = Instant::now();
            etcd.kill(k);
            procs.retain(|(h, _)| *h != k);
            let data = vec![7u8; sizes[0] as usize];
            let mut ok = 0;
            let mut gone = None;
            while killed.elapsed() < LEASE * 3 {
                call(&data)?;
                ok += 1;
                if gone.is_none() {
                    let left = (0..tiers).try_fold(0usize, |n, t| {
                        let l = reg.lookup_all(&tier_name(t))?;
                        Ok::<_, RpcError>(
                            n + l
                                .iter()
                                .filter(|e| {
                                    dead.iter().any(|p| e.owner.ends_with(&format!("pid {p}")))
                                })
                                .count(),
                        )
                    });
                    if left.is_ok_and(|n| n == 0) {
                        gone = Some(killed.elapsed());
                    }
                }
            }
            let gone = gone.ok_or_else(|| anyhow!("the dead host's tiers are still in etcd"))?;
            lines.push(format!(
                "host {k} killed (its {} tiers and etcd member, SIGKILL): {ok} calls since, none failed; \
                 its names left etcd after {:.2} s (lease {} s)",
                dead.len(),
                gone.as_secs_f64(),
                LEASE.as_secs()
            ));
        }
        drop(bc);
        drop(node);
    }
    // The tiers and memory servers stop.
    for (_, p) in procs.drain(..).rev() {
        p.stop();
    }
    Ok(lines)
}

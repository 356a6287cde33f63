//! `dmrpc cluster`: three hosts on this machine, found by name through
//! etcd.
//!
//! The hosts are network namespaces joined by a switch (crate
//! `dm-netns`), each link shaped to `--link`. Each host has a pool of
//! its own: a namespace of one device file, as hosts would each have one
//! of a CXL device. Each host runs a member of a three-member etcd
//! cluster; hosts 0 and 1 run a memory server each, registered in etcd
//! (zone `cluster`). Two applications spread over the hosts, every
//! service a replica on two hosts, registered in etcd under its lease and
//! calling the next by name:
//!
//! * the chain: `--tiers` services (`cluster/tier/K`), the last answering
//!   a checksum of what it read;
//! * the image application (`cluster/image/ROLE`): firewall, load
//!   balancer, two image-processing services, transcoding and
//!   compressing, answering a compressed thumbnail.
//!
//! Payloads go inline or by memory-server Ref as each node learns is
//! faster.
//!
//! A client on host 0 calls each application with each of `--sizes` and
//! checks every answer (the checksum; the thumbnail computed locally).
//! The chain's last tier also says whether the payload reached it by
//! memory-server Ref: the share of calls that did is shown.
//! With `--kill-host N` it then kills every process of host N (its
//! services and its etcd member) with SIGKILL, calls on (the balanced
//! clients fail over to the replicas on the other hosts), and says how
//! long etcd took to forget the dead services. It ends with every pool
//! checked.
//!
//! Needs root and iproute2 (`scripts/deps.sh`), and etcd.

use super::demo::checksum;
use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use dm_etcd::{EtcdCluster, EtcdConfig, EtcdRegistry};
use dm_pool::auth::Key;
use dm_pool::{AttachOptions, Pool, PoolConfig};
use dm_rpc::{Config, Node, Payload, Registry, RpcError, Transport};
use dmrpc::{fmt_size, parse_size};
use dmrpc_bench::apps::image as img;
use dmrpc_bench::apps::may_repeat;
use dmrpc_bench::apps::Link;
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
/// The image application's services, in order.
const IMAGE_ROLES: [&str; 6] = ["firewall", "lb", "proc0", "proc1", "transcode", "compress"];
/// The image application's thumbnails' largest side.
const THUMB: u32 = 64;

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
    /// The applications to run: `chain`, `image` (comma separated).
    #[arg(long, default_value = "chain,image", value_delimiter = ',')]
    pub apps: Vec<String>,
    /// How payloads between hosts travel: as each node learns is faster,
    /// always by memory-server Ref above the inline threshold, or always
    /// inline.
    #[arg(long, value_enum, default_value = "learned")]
    pub payloads: Payloads,
}

impl ClusterArgs {
    /// Whether application `app` runs (`--apps`).
    fn runs(&self, app: &str) -> bool {
        self.apps.iter().any(|x| x == app)
    }
}

/// How payloads between hosts travel (`--payloads`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payloads {
    /// As each node learns is faster, per method and size.
    Learned,
    /// By memory-server Ref above the inline threshold.
    Ref,
    /// Inline.
    Value,
}

impl Payloads {
    fn config(self) -> Config {
        let base = match self {
            Payloads::Value => Config::by_value(),
            _ => Config::default(),
        };
        Config {
            remote_choice: match self {
                Payloads::Learned => dm_rpc::RemoteChoice::Measured,
                _ => dm_rpc::RemoteChoice::Threshold,
            },
            // The hosts' network is this machine's own.
            tcp_open: true,
            ..base
        }
    }

    fn arg(self) -> &'static str {
        match self {
            Payloads::Learned => "learned",
            Payloads::Ref => "ref",
            Payloads::Value => "value",
        }
    }
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
    /// A tier of the chain (with --tiers), or
    #[arg(long)]
    pub tier: Option<usize>,
    #[arg(long, default_value_t = 0)]
    pub tiers: usize,
    /// a role of the image application (with --image-key, hex).
    #[arg(long)]
    pub image_role: Option<String>,
    #[arg(long)]
    pub image_key: Option<String>,
    #[arg(long)]
    pub host: usize,
    #[arg(long)]
    pub key_file: PathBuf,
    #[arg(long, value_enum)]
    pub payloads: Payloads,
}

fn image_name(role: &str) -> String {
    format!("cluster/image/{role}")
}

/// The image application's role `role`, its next services found by name.
fn image_role(role: &str, key: &str) -> Result<img::Role> {
    let next = |r: &str| Link::Replicas(image_name(r));
    Ok(match role {
        "firewall" => {
            let bytes = (0..key.len() / 2)
                .map(|i| u8::from_str_radix(key.get(2 * i..2 * i + 2).unwrap_or("-"), 16))
                .collect::<Result<Vec<u8>, _>>()
                .context("the image key")?;
            img::Role::Firewall {
                key: bytes
                    .try_into()
                    .map_err(|_| anyhow!("the image key is 32 bytes"))?,
                next: next("lb"),
            }
        }
        "lb" => img::Role::Balancer {
            next: vec![next("proc0"), next("proc1")],
        },
        "proc0" | "proc1" => img::Role::Processing {
            transcode: next("transcode"),
            compress: next("compress"),
        },
        "transcode" => img::Role::Transcoding,
        "compress" => img::Role::Compressing,
        r => bail!("no image role {r:?}"),
    })
}

fn tier_name(t: usize) -> String {
    format!("cluster/tier/{t}")
}

fn ip(host: usize) -> String {
    format!("10.99.0.{}", host + 1)
}

/// A node on `pool` that finds services in etcd and keeps payloads on
/// the zone's memory servers.
fn node(
    pool: Pool,
    path: &Path,
    etcd: &[String],
    key: &Path,
    payloads: Payloads,
) -> Result<(Node, EtcdRegistry)> {
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
    let n = Node::with_config(pool, payloads.config())
        .with_registry(Arc::new(reg.clone()))
        .with_memserver(mem);
    Ok((n, reg))
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
    let (node, _reg) = node(pool, &a.pool, &eps, &a.key_file, a.payloads)?;
    let on = Transport::Tcp(format!("{}:0", a.ip));
    let Some(tier) = a.tier else {
        let role = a
            .image_role
            .as_deref()
            .ok_or_else(|| anyhow!("--tier or --image-role"))?;
        let key = a.image_key.as_deref().unwrap_or("");
        let b = node.server(&image_name(role)).transport(on).replica();
        let server = img::serve_with(&node, b, image_role(role, key)?)?;
        println!("ready");
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        drop(server);
        return Ok(());
    };
    let next = (tier + 1 < a.tiers).then(|| tier_name(tier + 1));
    let host = a.host as u8;
    // The next tier is found by name on the first call (it may start
    // after this one).
    let onward: Arc<std::sync::OnceLock<dm_rpc::BalancedClient>> = Default::default();
    let n2 = node.clone();
    let server = node
        .server(&tier_name(tier))
        .transport(on)
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
                bc.call_with("pass", c.take_payload(), may_repeat())
            }
            None => {
                // Every byte read where it lies (no copy out). The answer
                // says which host served it and whether the payload came
                // by memory-server Ref.
                let p = c.payload();
                let mut out = checksum(&p.segments()?).to_le_bytes().to_vec();
                out.extend([host, u8::from(p.is_remote())]);
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
    if a.tiers == 0 || a.sizes.is_empty() || a.calls == 0 || a.apps.is_empty() {
        bail!("--tiers, --sizes, --calls and --apps must not be empty");
    }
    if let Some(x) = a
        .apps
        .iter()
        .find(|x| !matches!(x.as_str(), "chain" | "image"))
    {
        bail!("no application {x:?}: --apps takes chain and image");
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
    // The hosts' pools: a namespace each of one device file.
    let device = PathBuf::from(format!("/dev/shm/dmrpc-cluster-{}.dev", std::process::id()));
    let _ = std::fs::remove_file(&device);
    let device_guard = RemoveOnDrop(vec![device.clone()]);
    dm_pool::namespace::format(&device, 1 << 30, false)?;
    let mut pools = Vec::new();
    for i in 0..HOSTS {
        let cfg = PoolConfig {
            size: 256 << 20,
            ..Default::default()
        };
        let ns = dm_pool::namespace::create(&device, &format!("host{i}"), &cfg)?;
        pools.push(ns.path());
    }
    println!(
        "the hosts' pools: namespaces host0..host{} of {}",
        HOSTS - 1,
        device.display()
    );
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
    // Service K of an application on hosts K and K+1 (mod 3).
    let image_key: img::Key = std::array::from_fn(|_| dm_sys::rand::random_u64() as u8);
    let key_hex: String = image_key.iter().map(|b| format!("{b:02x}")).collect();
    let mut services: Vec<Vec<String>> = Vec::new();
    if a.runs("chain") {
        services.extend((0..a.tiers).map(|t| {
            let (t, n) = (t.to_string(), a.tiers.to_string());
            vec!["--tier".into(), t, "--tiers".into(), n]
        }));
    }
    if a.runs("image") {
        services.extend(IMAGE_ROLES.iter().map(|r| {
            let r = r.to_string();
            vec![
                "--image-role".into(),
                r,
                "--image-key".into(),
                key_hex.clone(),
            ]
        }));
    }
    for (k, args) in services.iter().enumerate() {
        for h in [k % HOSTS, (k + 1) % HOSTS] {
            let mut c = hosts.command(h, &exe)?;
            c.arg("__cluster-tier")
                .arg("--pool")
                .arg(&pools[h])
                .args(["--etcd", &eps_arg, "--ip", &ip(h)])
                .args(args)
                .args(["--host", &h.to_string()])
                .args(["--payloads", a.payloads.arg()])
                .arg("--key-file")
                .arg(&key)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped());
            let mut child = c.spawn().context("starting a service")?;
            first_line(&mut child, "ready")?;
            procs.push((h, Proc(child)));
        }
    }
    println!(
        "{} services ({}), each a replica on two hosts, registered in etcd at {eps_arg}",
        services.len(),
        a.apps.join(", ")
    );
    // The client, on host 0.
    let client = client_on_host0(&pools[0], &key, &image_key, &eps, a, &mut etcd, &mut procs)?;
    for l in client {
        println!("{l}");
    }
    // Every pool checked: the killed host's too (its dead services'
    // holdings are reclaimed on the way).
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
    for i in 0..HOSTS {
        dm_pool::namespace::remove(&device, &format!("host{i}"))?;
    }
    println!("every pool checked: clean; the namespaces removed");
    drop(device_guard);
    Ok(())
}

/// Removes files when dropped.
struct RemoveOnDrop(Vec<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A request, and the answer it must get.
type Exchange = (Vec<u8>, Vec<u8>);

/// Whether an answered payload reached the last service by memory-server
/// Ref (None: the application does not say).
type ByRef = Option<bool>;

/// One application as the client calls it: a request of a size, and a
/// call that checks its answer: whether the payload reached the last
/// service by memory-server Ref, if the application says.
struct App<'a> {
    name: &'static str,
    /// Its services, the one the client calls first.
    services: Vec<String>,
    method: &'static str,
    request: Box<dyn Fn(u64) -> Result<Exchange> + 'a>,
    check: fn(&[u8], &[u8]) -> Result<ByRef, RpcError>,
}

fn chain_app<'a>(tiers: usize) -> App<'a> {
    App {
        name: "chain",
        services: (0..tiers).map(tier_name).collect(),
        method: "pass",
        request: Box::new(|size| {
            let data: Vec<u8> = (0..size as usize).map(|i| (i * 31 % 251) as u8).collect();
            let want = checksum(&[&data]).to_le_bytes().to_vec();
            Ok((data, want))
        }),
        check: |got, want| {
            if got.len() != 10 || got[..8] != *want {
                return Err(RpcError::internal(
                    "the chain's answer does not match its request",
                ));
            }
            Ok(Some(got[9] == 1))
        },
    }
}

fn image_app(key: &img::Key) -> App<'_> {
    App {
        name: "image",
        services: IMAGE_ROLES.iter().map(|r| image_name(r)).collect(),
        method: img::METHOD,
        request: Box::new(move |size| {
            let ppm = img::generate(size as usize, size);
            let h = img::Header {
                client: u64::from(std::process::id()),
                expires: img::unix_now() + 3600,
                thumb: THUMB,
            };
            Ok((img::request(&h, key, &ppm), img::expected(&ppm, THUMB)?))
        }),
        check: |got, want| {
            if got != want {
                return Err(RpcError::internal(
                    "the image application's thumbnail differs from the one computed here",
                ));
            }
            Ok(None)
        },
    }
}

/// The client's calls (from host 0), and the kill of `a.kill_host`.
#[allow(clippy::too_many_arguments)]
fn client_on_host0(
    pool: &Path,
    key: &Path,
    image_key: &img::Key,
    eps: &[String],
    a: &ClusterArgs,
    etcd: &mut EtcdCluster,
    procs: &mut Vec<(usize, Proc)>,
) -> Result<Vec<String>> {
    let calls = a.calls;
    let mut apps = Vec::new();
    if a.runs("chain") {
        apps.push(chain_app(a.tiers));
    }
    if a.runs("image") {
        apps.push(image_app(image_key));
    }
    let mut lines = Vec::new();
    {
        let p = Pool::open(pool, AttachOptions::default())?;
        let (node, reg) = node(p, pool, eps, key, a.payloads)?;
        let clients = apps
            .iter()
            .map(|app| node.connect_balanced(&app.services[0]))
            .collect::<Result<Vec<_>, _>>()?;
        let call = |k: usize, req: &[u8], want: &[u8]| -> Result<ByRef, RpcError> {
            let got = clients[k].call_with(
                apps[k].method,
                Payload::from_vec(req.to_vec()),
                may_repeat(),
            )?;
            (apps[k].check)(&got.to_vec()?, want)
        };
        lines.push(format!(
            "{:>6} {:>9} {:>7} {:>10} {:>10} {:>12} {:>8}",
            "app", "size", "calls", "p50 us", "p99 us", "calls/s", "by Ref"
        ));
        for (k, app) in apps.iter().enumerate() {
            for &size in &a.sizes {
                let (req, want) = (app.request)(size)?;
                for _ in 0..calls.min(20) {
                    call(k, &req, &want)?;
                }
                let mut t = Vec::with_capacity(calls);
                let mut by_ref = Some(0);
                let start = Instant::now();
                for _ in 0..calls {
                    let c = Instant::now();
                    let r = call(k, &req, &want)?;
                    t.push(c.elapsed());
                    by_ref = by_ref.zip(r).map(|(n, r)| n + usize::from(r));
                }
                let all = start.elapsed();
                t.sort_unstable();
                lines.push(format!(
                    "{:>6} {:>9} {:>7} {:>10.1} {:>10.1} {:>12.0} {:>8}",
                    app.name,
                    fmt_size(size),
                    calls,
                    t[calls / 2].as_secs_f64() * 1e6,
                    t[calls * 99 / 100].as_secs_f64() * 1e6,
                    calls as f64 / all.as_secs_f64(),
                    by_ref.map_or("-".into(), |n| format!("{}%", n * 100 / calls))
                ));
            }
        }
        if let Some(k) = a.kill_host {
            // Every process of host k: its services, its etcd member.
            let dead: Vec<u32> = procs
                .iter()
                .filter(|(h, _)| *h == k)
                .map(|(_, p)| p.0.id())
                .collect();
            let killed = Instant::now();
            etcd.kill(k);
            procs.retain(|(h, _)| *h != k);
            let reqs = apps
                .iter()
                .map(|app| (app.request)(a.sizes[0]))
                .collect::<Result<Vec<_>>>()?;
            let names: Vec<&String> = apps.iter().flat_map(|app| &app.services).collect();
            let mut ok = 0;
            let mut gone = None;
            while killed.elapsed() < LEASE * 3 {
                for (j, (req, want)) in reqs.iter().enumerate() {
                    call(j, req, want)?;
                    ok += 1;
                }
                if gone.is_none() {
                    let left = names.iter().try_fold(0usize, |n, name| {
                        let l = reg.lookup_all(name)?;
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
            let gone = gone.ok_or_else(|| anyhow!("the dead host's services are still in etcd"))?;
            lines.push(format!(
                "host {k} killed (its {} processes and etcd member, SIGKILL): {ok} calls since, none \
                 failed; its names left etcd after {:.2} s (lease {} s)",
                dead.len(),
                gone.as_secs_f64(),
                LEASE.as_secs()
            ));
        }
        drop(clients);
        drop(node);
    }
    // The services and memory servers stop.
    for (_, p) in procs.drain(..).rev() {
        p.stop();
    }
    Ok(lines)
}

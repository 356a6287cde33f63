//! `dmrpc memserver`: the memory-server daemon (DmRPC-net).

use anyhow::Result;
use clap::Args;
use dm_pool::auth::Key;
use dmrpc::parse_size;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct MemserverArgs {
    /// Address to listen on, e.g. 0.0.0.0:7070.
    #[arg(long)]
    pub listen: String,
    /// Memory to serve, pinned at start (e.g. 1GiB).
    #[arg(long, value_parser = parse_size)]
    pub size: u64,
    /// Worker threads (default: half the CPUs, at least one).
    #[arg(long, default_value_t = dm_memserver::default_threads())]
    pub threads: usize,
    /// Serve Prometheus metrics over HTTP at this address.
    #[arg(long)]
    pub metrics: Option<String>,
    /// Page size (a power of two).
    #[arg(long, default_value = "4096", value_parser = parse_size)]
    pub page_size: u64,
    /// Time to live of a Ref created without one, in seconds.
    #[arg(long, default_value_t = 60)]
    pub ref_ttl_secs: u64,
    /// The longest TTL a client may ask for, in seconds: a Ref nobody
    /// releases holds its pages at most this long.
    #[arg(long, default_value_t = 3600)]
    pub max_ttl_secs: u64,
    /// Client connections at once at most; one more is refused with
    /// `ResourceExhausted`.
    #[arg(long, default_value_t = 1024)]
    pub max_clients: usize,
    /// A session silent this long ends (clients renew it; seconds).
    #[arg(long, default_value_t = 10)]
    pub lease_secs: u64,
    /// Longest busy-poll of a worker's sockets before it sleeps, in
    /// microseconds (adapted to the load; 0: sleep at once).
    #[arg(long, default_value_t = 200)]
    pub spin_us: u64,
    /// Serve only clients that prove they hold the key in this file
    /// (`dmrpc key new FILE` makes one; clients use the same file).
    #[arg(long)]
    pub key_file: Option<std::path::PathBuf>,
    /// `check` and `maintain` from other hosts need the key in this file
    /// (without it they are served to clients on this host only).
    #[arg(long)]
    pub admin_key_file: Option<std::path::PathBuf>,
    /// Listen beyond loopback without a key: anyone who reaches the port
    /// may allocate and read.
    #[arg(long)]
    pub open: bool,
    /// Bytes one client connection may hold at most (its buffers and the
    /// Refs it created), e.g. 256MiB.
    #[arg(long, value_parser = parse_size)]
    pub client_quota: Option<u64>,
    /// Register in etcd at these endpoints (comma separated; default: the
    /// DMRPC_ETCD environment variable, if set) under this process's
    /// lease, where clients find it (`MemPool` of a zone).
    #[arg(long)]
    pub etcd: Option<String>,
    /// The zone it is registered in.
    #[arg(long, default_value = "default")]
    pub zone: String,
    /// The address registered, where clients reach it (default: the
    /// address it listens on; needed when that is 0.0.0.0).
    #[arg(long)]
    pub advertise: Option<String>,
}

pub fn run(a: MemserverArgs) -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cfg = dm_memserver::Config {
        listen: a.listen,
        size: a.size,
        page_size: usize::try_from(a.page_size)?,
        threads: a.threads.max(1),
        metrics: a.metrics,
        default_ttl: Duration::from_secs(a.ref_ttl_secs.max(1)),
        max_ttl: Duration::from_secs(a.max_ttl_secs.max(a.ref_ttl_secs).max(1)),
        max_clients: a.max_clients.max(1),
        default_lease: Duration::from_secs(a.lease_secs.max(1)),
        spin: Duration::from_micros(a.spin_us),
        key: a.key_file.map(Key::from_file).transpose()?,
        admin_key: a.admin_key_file.map(Key::from_file).transpose()?,
        open: a.open,
        client_quota: a.client_quota,
        ..Default::default()
    };
    let fingerprint = cfg.key.as_ref().map(Key::fingerprint);
    let size = cfg.size;
    let s = dm_memserver::Server::start(cfg)?;
    // Registered before it says it listens: whoever waits for that line
    // finds it in etcd.
    let registered = match super::etcd::config(a.etcd.as_deref()) {
        Some(ecfg) => {
            let addr = a.advertise.clone().unwrap_or_else(|| s.addr().to_string());
            let reg = dm_etcd::EtcdRegistry::connect(ecfg)
                .and_then(|reg| {
                    reg.register_memserver(&a.zone, &addr, size)?;
                    Ok(reg)
                })
                .map_err(|e| anyhow::anyhow!("registering in etcd: {e}"))?;
            eprintln!("registered in etcd as {addr}, zone {}", a.zone);
            Some(reg)
        }
        None => None,
    };
    // One line on stdout for scripts: where it listens and its id.
    println!("listening {} id {:#018x}", s.addr(), s.state().id);
    if let Some(f) = &fingerprint {
        // (stderr: a script may read the first line only, and close.)
        eprintln!("clients must prove key {f}");
    }
    if let Some(m) = s.metrics_addr() {
        // (A reader that took the first line and left must not kill the
        // server: a write to its closed pipe is ignored.)
        use std::io::Write;
        let _ = writeln!(std::io::stdout(), "metrics http://{m}/metrics");
    }
    dm_memserver::server::wait_for_stop_signal()?;
    // Out of etcd first: no client is sent to a server going away.
    drop(registered);
    s.shutdown();
    Ok(())
}

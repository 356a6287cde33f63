//! `dmrpc ls`: the services registered in a pool (a name shared by
//! replicas has a line per replica, marked `replica`), and what each
//! speaks (dmrpc's calls, or gRPC). With `--etcd` (or DMRPC_ETCD set):
//! the services and memory servers of a cluster, with their hosts.

use super::pool::Target;
use anyhow::Result;
use clap::Args;
use dm_pool::Endpoint;

#[derive(Args, Debug)]
pub struct LsArgs {
    #[command(flatten)]
    pub target: Target,
    /// The pool, by name, as `dmrpc call --pool` takes it (instead of NAME).
    #[arg(long, conflicts_with = "name")]
    pub pool: Option<String>,
    /// Only services whose name starts with this prefix (`shop/`).
    #[arg(long)]
    pub prefix: Option<String>,
    /// List the cluster registered in etcd at these endpoints (comma
    /// separated; the DMRPC_ETCD environment variable gives them too)
    /// instead of a pool.
    #[arg(long)]
    pub etcd: Option<String>,
    /// The etcd registry's key prefix.
    #[arg(long, default_value = "/dmrpc")]
    pub etcd_prefix: String,
}

pub fn run(mut a: LsArgs) -> Result<()> {
    // (The environment names a cluster only when no pool is named.)
    let pool_named = a.pool.is_some() || a.target.path.is_some() || a.target.name != "default";
    let etcd = match a.etcd.as_deref() {
        Some(f) => super::etcd::config(Some(f)),
        None if !pool_named => super::etcd::config(None),
        None => None,
    };
    if let Some(mut cfg) = etcd {
        cfg.prefix = a.etcd_prefix.clone();
        return cluster(cfg, a.prefix.as_deref());
    }
    if let Some(name) = a.pool.take() {
        a.target.name = name;
    }
    let mut services = dm_pool::services_at(&a.target.path())?;
    let now = dm_sys::time::now_ms();
    services.retain(|(s, _)| a.prefix.as_deref().is_none_or(|p| s.name.starts_with(p)));
    services.sort_by(|(x, _), (y, _)| x.name.cmp(&y.name));
    if services.is_empty() {
        println!("no services registered in {}", a.target.path().display());
        return Ok(());
    }
    println!(
        "{:<40} {:<22} {:>8} {:>6} {:>5} {:>10}  {:<7} speaks",
        "service", "endpoint", "pid", "conns", "live", "up", "role"
    );
    for (s, conns) in services {
        let ep = match &s.endpoint {
            Endpoint::Shm => "shm".to_string(),
            Endpoint::Tcp(addr) => format!("tcp {addr}"),
        };
        let up = now.saturating_sub(s.registered_ms) as f64 / 1000.0;
        println!(
            "{:<40} {:<22} {:>8} {:>6} {:>5} {:>9.1}s  {:<7} {}",
            s.name,
            ep,
            s.pid,
            conns,
            if s.live { "yes" } else { "DEAD" },
            up,
            if s.replica { "replica" } else { "sole" },
            match s.protocol {
                dm_pool::Protocol::Dmrpc => "dmrpc",
                dm_pool::Protocol::Grpc => "grpc",
            }
        );
    }
    Ok(())
}

/// The services and memory servers registered in etcd.
fn cluster(cfg: dm_etcd::EtcdConfig, prefix: Option<&str>) -> Result<()> {
    let eps = cfg.endpoints.join(",");
    let reg = dm_etcd::EtcdRegistry::connect(cfg)?;
    let mut services = dm_rpc::Registry::list(&reg)?;
    services.retain(|s| prefix.is_none_or(|p| s.name.starts_with(p)));
    if services.is_empty() {
        println!("no services registered in etcd at {eps}");
    } else {
        println!("{:<40} {:<28} owner", "service", "endpoint");
        for s in services {
            let ep = match &s.endpoint {
                Endpoint::Shm => "shm".to_string(),
                Endpoint::Tcp(addr) => format!("tcp {addr}"),
            };
            println!("{:<40} {:<28} {}", s.name, ep, s.owner);
        }
    }
    let ms = reg.memservers(None)?;
    if !ms.is_empty() {
        println!();
        println!(
            "{:<16} {:<28} {:>10} owner",
            "zone", "memory server", "size"
        );
        for (zone, m) in ms {
            println!(
                "{:<16} {:<28} {:>10} {} pid {}",
                zone,
                m.addr,
                dmrpc::fmt_size(m.size),
                m.host,
                m.pid
            );
        }
    }
    Ok(())
}

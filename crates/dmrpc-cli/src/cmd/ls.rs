//! `dmrpc ls`: the services registered in a pool (a name shared by
//! replicas has a line per replica, marked `replica`), and what each
//! speaks (dmrpc's calls, or gRPC).

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
}

pub fn run(mut a: LsArgs) -> Result<()> {
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

//! `dm-etcd-hold ENDPOINTS NAME tcp://ADDR|shm [--replica] [--lease-ms N]`:
//! registers NAME in etcd and holds the registration until killed (or
//! until stdin closes), printing `registered HANDLE` once it is in. For
//! tests and scripts: a process whose lease others watch run out.

use dm_etcd::keys::parse_endpoint;
use dm_etcd::{parse_endpoints, EtcdConfig, EtcdRegistry};
use dm_rpc::Registry;
use std::io::Read;
use std::time::Duration;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 3 {
        eprintln!("usage: dm-etcd-hold ENDPOINTS NAME tcp://ADDR|shm [--replica] [--lease-ms N]");
        std::process::exit(2);
    }
    let mut cfg = EtcdConfig::new(&parse_endpoints(&args[0]));
    let replica = args.iter().any(|a| a == "--replica");
    if let Some(i) = args.iter().position(|a| a == "--lease-ms") {
        match args.get(i + 1).and_then(|v| v.parse().ok()) {
            Some(ms) => cfg.lease = Duration::from_millis(ms),
            None => {
                eprintln!("--lease-ms needs a number");
                std::process::exit(2);
            }
        }
    }
    let Some(endpoint) = parse_endpoint(&args[2]) else {
        eprintln!("{}: not tcp://ADDR or shm", args[2]);
        std::process::exit(2);
    };
    let reg = match EtcdRegistry::connect(cfg) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    let r = if replica {
        reg.register_replica(&args[1], &endpoint)
    } else {
        reg.register(&args[1], &endpoint)
    };
    match r {
        Ok(r) => println!("registered {:016x}", r.handle),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
    // Held until killed, or until whoever started it closes stdin.
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
}

//! A memory server for tests: `dm-memserver [--listen ADDR] [--size BYTES]
//! [--lease-ms MS] [--ttl-ms MS] [--key-file F] [--admin-key-file F]
//! [--open] [--client-quota BYTES]` listens on ADDR (default 127.0.0.1, a
//! free port), prints `listening ADDR ID` and serves until SIGTERM.
//! (`dmrpc memserver` is the daemon users run.)

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    let mut cfg = dm_memserver::Config {
        size: arg("--size").unwrap_or(64 << 20),
        ..Default::default()
    };
    if let Some(i) = args.iter().position(|a| a == "--listen") {
        if let Some(l) = args.get(i + 1) {
            cfg.listen = l.clone();
        }
    }
    if let Some(ms) = arg("--lease-ms") {
        cfg.default_lease = std::time::Duration::from_millis(ms);
    }
    if let Some(ms) = arg("--ttl-ms") {
        cfg.default_ttl = std::time::Duration::from_millis(ms);
    }
    let path = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
    };
    let key = |name: &str| {
        path(name).map(|p| {
            dm_pool::auth::Key::from_file(p).unwrap_or_else(|e| {
                eprintln!("dm-memserver: {e}");
                std::process::exit(1)
            })
        })
    };
    cfg.key = key("--key-file");
    cfg.admin_key = key("--admin-key-file");
    cfg.open = args.iter().any(|a| a == "--open");
    cfg.client_quota = arg("--client-quota");
    let r = dm_memserver::server::run(cfg, |s| {
        println!("listening {} {}", s.addr(), s.state().id);
    });
    if let Err(e) = r {
        eprintln!("dm-memserver: {e}");
        std::process::exit(1);
    }
}

//! What the profiling examples share: the waiting policy from `POLICY`, a
//! pool file for the run, and peer processes (this example run again with
//! other arguments) that say "ready" and serve until their stdin closes.

use std::process::{Child, Command, Stdio};

/// `POLICY`: `spin` (spin only), `park` (park at once), `yield` (no spin:
/// yield, then park) or the policy in `DMRPC_WAIT` (else the default).
pub fn wait_policy() -> dm_rpc::WaitPolicy {
    match std::env::var("POLICY").as_deref() {
        Ok("spin") => dm_rpc::WaitPolicy::spin_only(),
        Ok("park") => dm_rpc::WaitPolicy::park_only(),
        Ok("yield") => dm_rpc::WaitPolicy {
            spin: std::time::Duration::ZERO,
            ..Default::default()
        },
        _ => dm_rpc::WaitPolicy::from_env(),
    }
}

/// Creates a pool of `size` bytes for this run; its path. `POOL_DIR` says
/// where (default /dev/shm; for example a tmpfs mounted with
/// `huge=always`), `RING_KIB` its channels' ring size.
pub fn create_pool(tag: &str, size: u64) -> String {
    let dir = std::env::var("POOL_DIR").unwrap_or_else(|_| "/dev/shm".into());
    let path = format!("{dir}/dmrpc-{tag}-{}.pool", std::process::id());
    let mut cfg = dm_pool::PoolConfig {
        size,
        ..Default::default()
    };
    // `RING_KIB`: the channels' ring size (default: the pool's).
    if let Some(kib) = std::env::var("RING_KIB")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
    {
        cfg.ring_size = kib << 10;
        cfg.channels = Some(32);
    }
    if let Err(e) = dm_pool::Pool::create(path.as_ref(), &cfg) {
        panic!("cannot create {path}: {e}");
    }
    path
}

/// Runs this example again with `args` and waits for its "ready" line.
pub fn spawn_peer(args: &[&str]) -> Child {
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("no executable: {e}"));
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start a peer: {e}"));
    if let Some(out) = child.stdout.take() {
        let mut l = String::new();
        let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut l);
    }
    child
}

/// In a peer: says "ready", then waits until the parent closes stdin.
pub fn ready_until_stdin_closes() {
    println!("ready");
    let mut l = String::new();
    let _ = std::io::stdin().read_line(&mut l);
}

/// Stops a peer (closes its stdin) and waits for it.
pub fn stop_peer(mut child: Child) {
    drop(child.stdin.take());
    let _ = child.wait();
}

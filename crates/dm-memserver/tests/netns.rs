//! A memory server in one network namespace and its clients in another:
//! two "hosts" on one machine (`dm-netns`). Needs root and iproute2
//! (installed by scripts/deps.sh); where either is missing the test says
//! so and passes without running.
#![allow(clippy::unwrap_used)]

use dm_netns::{Hosts, Link};
use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;

#[test]
fn a_ref_across_two_network_namespaces() {
    let hosts = match Hosts::up(2, Link::default()) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("SKIPPED a_ref_across_two_network_namespaces: {e}");
            return;
        }
    };
    // Host 0 runs the server, host 1 the clients.
    let exec = |host: usize, bin: &str, args: &[&str]| {
        let mut c = hosts.command(host, bin).unwrap();
        c.args(args);
        c
    };
    let listen = format!("{}:0", hosts.addr(0).unwrap());
    // Beyond loopback a server needs a key (or --open).
    let refused = exec(
        0,
        env!("CARGO_BIN_EXE_dm-memserver"),
        &["--listen", &listen],
    )
    .output()
    .unwrap();
    assert!(!refused.status.success());
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(why.contains("--key-file"), "{why}");
    let dir = std::env::temp_dir().join(format!("dm-netns-key-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let key_file = dir.join("memory.key");
    dm_pool::auth::Key::generate_file(&key_file).unwrap();
    let key_path = key_file.to_str().unwrap();
    let mut server = Killed(
        exec(
            0,
            env!("CARGO_BIN_EXE_dm-memserver"),
            &["--listen", &listen, "--key-file", key_path],
        )
        .stdout(Stdio::piped())
        .spawn()
        .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(server.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line.split_whitespace().nth(1).unwrap().to_owned();
    assert!(addr.starts_with("10.99.0.1:"), "{line}");
    // The root namespace cannot reach it: it is on the other "host".
    assert!(dm_memserver::MemPool::connect_with(
        &[&addr],
        dm_memserver::ClientConfig {
            connect_timeout: std::time::Duration::from_millis(300),
            ..Default::default()
        }
    )
    .is_err());
    let client = env!("CARGO_BIN_EXE_dm-memclient");
    // Without the key, the other host is served nothing.
    let no_key = exec(1, client, &[&addr, "share", "100"]).output().unwrap();
    assert!(!no_key.status.success());
    let why = String::from_utf8_lossy(&no_key.stderr);
    assert!(why.to_lowercase().contains("unauthenticated"), "{why}");
    // With it, the check (an admin operation) is still refused from there.
    let check = exec(1, client, &[&addr, "check"])
        .env("DMRPC_KEY_FILE", key_path)
        .output()
        .unwrap();
    let why = String::from_utf8_lossy(&check.stderr);
    assert!(
        !check.status.success() && why.to_lowercase().contains("permission"),
        "{why}"
    );
    let mut a = exec(1, client, &[&addr, "share", "20000"])
        .env("DMRPC_KEY_FILE", key_path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(a.stdout.take().unwrap());
    let mut l = String::new();
    out.read_line(&mut l).unwrap();
    let f: Vec<&str> = l.split_whitespace().collect();
    assert_eq!(f[0], "ref", "{l}");
    let b = exec(1, client, &[&addr, "cow", f[1]])
        .env("DMRPC_KEY_FILE", key_path)
        .output()
        .unwrap();
    assert!(b.status.success(), "{}", String::from_utf8_lossy(&b.stderr));
    let text = String::from_utf8(b.stdout).unwrap();
    assert_eq!(
        text.lines().next().unwrap(),
        format!("read {}", f[2]),
        "the other client reads the snapshot across the namespaces"
    );
    writeln!(a.stdin.as_mut().unwrap()).unwrap();
    assert!(a.wait().unwrap().success());
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A child killed (and reaped) on drop, also when an assertion fails.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

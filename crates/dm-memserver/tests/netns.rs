//! A memory server in one network namespace and its clients in another,
//! linked by a veth pair: two "hosts" on one machine. Needs root and
//! `ip netns` (iproute2, installed by scripts/deps.sh); where either is
//! missing the test says so and passes without running.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Two namespaces joined by a veth pair; removed on drop.
struct Hosts {
    server: String,
    client: String,
}

impl Hosts {
    fn new() -> Result<Hosts, String> {
        let id = std::process::id() % 50_000;
        let h = Hosts {
            server: format!("dmrpc-s{id}"),
            client: format!("dmrpc-c{id}"),
        };
        let (vs, vc) = (format!("dms{id}"), format!("dmc{id}"));
        ip(&["netns", "add", &h.server])?;
        ip(&["netns", "add", &h.client])?;
        ip(&["link", "add", &vs, "type", "veth", "peer", "name", &vc])?;
        ip(&["link", "set", &vs, "netns", &h.server])?;
        ip(&["link", "set", &vc, "netns", &h.client])?;
        for (ns, dev, addr) in [
            (&h.server, &vs, "10.77.0.1/24"),
            (&h.client, &vc, "10.77.0.2/24"),
        ] {
            ip(&["-n", ns, "addr", "add", addr, "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(h)
    }

    fn exec(&self, ns: &str, bin: &str, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns, bin]).args(args);
        c
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.server]);
        let _ = ip(&["netns", "del", &self.client]);
    }
}

#[test]
fn a_ref_across_two_network_namespaces() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED a_ref_across_two_network_namespaces: needs root for ip netns");
        return;
    }
    let hosts = match Hosts::new() {
        Ok(h) => h,
        Err(e) => {
            eprintln!("SKIPPED a_ref_across_two_network_namespaces: cannot make namespaces ({e})");
            return;
        }
    };
    // Beyond loopback a server needs a key (or --open).
    let refused = hosts
        .exec(
            &hosts.server,
            env!("CARGO_BIN_EXE_dm-memserver"),
            &["--listen", "10.77.0.1:0"],
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
        hosts
            .exec(
                &hosts.server,
                env!("CARGO_BIN_EXE_dm-memserver"),
                &["--listen", "10.77.0.1:0", "--key-file", key_path],
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
    assert!(addr.starts_with("10.77.0.1:"), "{line}");
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
    let no_key = hosts
        .exec(&hosts.client, client, &[&addr, "share", "100"])
        .output()
        .unwrap();
    assert!(!no_key.status.success());
    let why = String::from_utf8_lossy(&no_key.stderr);
    assert!(why.to_lowercase().contains("unauthenticated"), "{why}");
    // With it, the check (an admin operation) is still refused from there.
    let check = hosts
        .exec(&hosts.client, client, &[&addr, "check"])
        .env("DMRPC_KEY_FILE", key_path)
        .output()
        .unwrap();
    let why = String::from_utf8_lossy(&check.stderr);
    assert!(
        !check.status.success() && why.to_lowercase().contains("permission"),
        "{why}"
    );
    let mut a = hosts
        .exec(&hosts.client, client, &[&addr, "share", "20000"])
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
    let b = hosts
        .exec(&hosts.client, client, &[&addr, "cow", f[1]])
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

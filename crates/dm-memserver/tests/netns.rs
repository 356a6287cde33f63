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

/// A memory server on each of two hosts: a client's puts and buffers go
/// to the one on its own host ([`Placement::Local`], the default), or to
/// both in turn ([`Placement::RoundRobin`]); a client on the other host
/// reads what was placed.
#[test]
fn puts_stay_on_the_writers_host() {
    use dm_memserver::{ClientConfig, MemPool, Placement};
    use dm_pool::Dm;
    let hosts = match Hosts::up(2, Link::default()) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("SKIPPED puts_stay_on_the_writers_host: {e}");
            return;
        }
    };
    let servers: Vec<(Killed, String)> = (0..2)
        .map(|h| {
            let listen = format!("{}:0", hosts.addr(h).unwrap());
            let mut c = hosts
                .command(h, env!("CARGO_BIN_EXE_dm-memserver"))
                .unwrap();
            c.args(["--listen", &listen, "--open"]);
            let mut p = Killed(c.stdout(Stdio::piped()).spawn().unwrap());
            let mut line = String::new();
            BufReader::new(p.0.stdout.take().unwrap())
                .read_line(&mut line)
                .unwrap();
            let addr = line.split_whitespace().nth(1).unwrap().to_owned();
            (p, addr)
        })
        .collect();
    let addrs = [servers[0].1.clone(), servers[1].1.clone()];
    let connect = |host: usize, placement: Placement| {
        let addrs = addrs.clone();
        let hosts = &hosts;
        std::thread::scope(|s| {
            s.spawn(move || {
                hosts.enter(host).unwrap();
                MemPool::connect_with(
                    &addrs,
                    ClientConfig {
                        placement,
                        ..Default::default()
                    },
                )
                .unwrap()
            })
            .join()
            .unwrap()
        })
    };
    let here = connect(0, Placement::Local);
    let ids = here.server_ids();
    assert_eq!(here.local_servers(), vec![0]);
    let data = vec![7u8; 64 << 10];
    let refs: Vec<_> = (0..4)
        .map(|_| here.put(&data, std::time::Duration::ZERO).unwrap())
        .collect();
    assert!(
        refs.iter().all(|r| r.pool_id == ids[0]),
        "puts stay on host 0"
    );
    let b = here.alloc(8192).unwrap();
    assert_eq!(b.server(), 0, "a new buffer too");
    here.free(b).unwrap();
    // The other host's client reads them from there.
    let there = connect(1, Placement::Local);
    assert_eq!(there.local_servers(), vec![1]);
    let mut out = vec![0u8; data.len()];
    there.read_ref(&refs[3], 0, &mut out).unwrap();
    assert_eq!(out, data);
    let spread = connect(0, Placement::RoundRobin);
    let on: Vec<u64> = (0..4)
        .map(|_| {
            let r = spread.put(&data, std::time::Duration::ZERO).unwrap();
            let id = r.pool_id;
            spread.release_ref(&r).unwrap();
            id
        })
        .collect();
    assert!(on.contains(&ids[0]) && on.contains(&ids[1]), "{on:?}");
    for r in refs {
        here.release_ref(&r).unwrap();
    }
}

/// A child killed (and reaped) on drop, also when an assertion fails.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

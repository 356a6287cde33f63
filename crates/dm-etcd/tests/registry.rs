//! The etcd registry against real etcd members started here: names and
//! replicas, leases that run out when their process is killed, watches,
//! a member killed, etcd out of reach at startup and mid-run.
#![allow(clippy::unwrap_used)]

use dm_etcd::{EtcdCluster, EtcdConfig, EtcdRegistry};
use dm_pool::Endpoint;
use dm_rpc::{Registry, Status};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dm-etcd-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn cluster(n: usize, tag: &str) -> EtcdCluster {
    EtcdCluster::start(n, &dir(tag)).expect("etcd starts (scripts/deps.sh installs etcd-server)")
}

fn cfg(c: &EtcdCluster, prefix: &str) -> EtcdConfig {
    let mut cfg = EtcdConfig::new(&c.endpoints());
    cfg.prefix = prefix.to_owned();
    cfg.lease = Duration::from_secs(2);
    cfg
}

fn tcp(a: &str) -> Endpoint {
    Endpoint::Tcp(a.to_owned())
}

/// Waits until `f` holds (at most `within`); how long that took.
fn until(within: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let t = Instant::now();
    while t.elapsed() < within {
        if f() {
            return Some(t.elapsed());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

#[test]
fn names_replicas_and_their_owners() {
    let c = cluster(1, "names");
    let a = EtcdRegistry::connect(cfg(&c, "/t1")).unwrap();
    let b = EtcdRegistry::connect(cfg(&c, "/t1")).unwrap();
    let r = a.register("shop/images", &tcp("10.0.0.1:1")).unwrap();
    // One registration per name: another process is refused, named.
    let e = b.register("shop/images", &tcp("10.0.0.2:1")).unwrap_err();
    assert_eq!(e.status, Status::AlreadyExists, "{e}");
    assert!(e.message.contains("pid"), "{e}");
    let e = b
        .register_replica("shop/images", &tcp("10.0.0.2:1"))
        .unwrap_err();
    assert_eq!(e.status, Status::AlreadyExists, "{e}");
    // A longer name is another name.
    b.register("shop/images/resize", &tcp("10.0.0.3:1"))
        .unwrap();
    let got = b.lookup("shop/images").unwrap().unwrap();
    assert_eq!(got.endpoint, tcp("10.0.0.1:1"));
    assert_eq!(got.handle, r.handle);
    assert!(got.owner.contains(&std::process::id().to_string()));
    // Replicas of another name, from both.
    let r1 = a.register_replica("kv", &tcp("10.0.0.1:2")).unwrap();
    b.register_replica("kv", &tcp("10.0.0.2:2")).unwrap();
    let e = a.register("kv", &tcp("10.0.0.9:9")).unwrap_err();
    assert_eq!(e.status, Status::AlreadyExists);
    let mut eps: Vec<_> = a
        .lookup_all("kv")
        .unwrap()
        .into_iter()
        .map(|e| e.endpoint)
        .collect();
    eps.sort_by_key(|e| format!("{e:?}"));
    assert_eq!(eps, vec![tcp("10.0.0.1:2"), tcp("10.0.0.2:2")]);
    let names: Vec<_> = a.list().unwrap().into_iter().map(|e| e.name).collect();
    assert_eq!(names, ["kv", "kv", "shop/images", "shop/images/resize"]);
    // Unregistering: only one's own.
    assert_eq!(b.unregister(&r).unwrap_err().status, Status::NotFound);
    a.unregister(&r).unwrap();
    a.unregister(&r1).unwrap();
    assert!(b.lookup("shop/images").unwrap().is_none());
    assert_eq!(b.lookup_all("kv").unwrap().len(), 1);
    // A dropped registry's names go at once (its lease is revoked).
    drop(b);
    assert!(a.lookup_all("kv").unwrap().is_empty());
    assert!(a.lookup("shop/images/resize").unwrap().is_none());
    // Another prefix sees none of this.
    let other = EtcdRegistry::connect(cfg(&c, "/t1-other")).unwrap();
    other.register("kv", &tcp("10.0.0.5:5")).unwrap();
    assert_eq!(a.list().unwrap().len(), 0);
}

#[test]
fn a_killed_process_loses_its_names_within_its_lease() {
    let c = cluster(1, "kill");
    let eps = c.endpoints().join(",");
    let mut child = Command::new(env!("CARGO_BIN_EXE_dm-etcd-hold"))
        .args([
            &eps,
            "svc/a",
            "tcp://10.0.0.7:7",
            "--replica",
            "--lease-ms",
            "2000",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("registered"), "{line}");
    let mut cfg = EtcdConfig::new(&c.endpoints());
    cfg.lease = Duration::from_secs(2);
    let r = EtcdRegistry::connect(cfg).unwrap();
    let watch = r.changes("svc/a").unwrap();
    assert_eq!(r.lookup_all("svc/a").unwrap().len(), 1);
    // It keeps its name past its lease while it lives.
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(r.lookup_all("svc/a").unwrap().len(), 1);
    let before = watch.load(Ordering::Acquire);
    let killed = Instant::now();
    child.kill().unwrap();
    child.wait().unwrap();
    let gone = until(Duration::from_secs(6), || {
        r.lookup_all("svc/a").unwrap().is_empty()
    })
    .expect("the name goes when the lease runs out");
    // etcd checks expiry about every 500 ms: the lease, and that.
    assert!(killed.elapsed() < Duration::from_millis(3500), "{gone:?}");
    assert!(
        until(Duration::from_secs(1), || watch.load(Ordering::Acquire)
            != before)
        .is_some(),
        "the watch saw it go"
    );
}

#[test]
fn a_watch_moves_on_every_change_of_its_name_only() {
    let c = cluster(1, "watch");
    let a = EtcdRegistry::connect(cfg(&c, "/t3")).unwrap();
    let b = EtcdRegistry::connect(cfg(&c, "/t3")).unwrap();
    let w = a.changes("kv").unwrap();
    // The watch is up once its first count is in.
    until(Duration::from_secs(5), || w.load(Ordering::Acquire) > 0).unwrap();
    let v0 = w.load(Ordering::Acquire);
    b.register("kv2", &tcp("10.0.0.1:1")).unwrap();
    b.register("kv/x", &tcp("10.0.0.1:1")).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(w.load(Ordering::Acquire), v0, "other names do not move it");
    let r = b.register_replica("kv", &tcp("10.0.0.1:1")).unwrap();
    until(Duration::from_secs(2), || w.load(Ordering::Acquire) > v0).expect("a join");
    let v1 = w.load(Ordering::Acquire);
    b.unregister(&r).unwrap();
    until(Duration::from_secs(2), || w.load(Ordering::Acquire) > v1).expect("a leave");
    // The same counter for the same name.
    assert!(std::sync::Arc::ptr_eq(&w, &a.changes("kv").unwrap()));
}

#[test]
fn etcd_out_of_reach_at_startup_is_a_clear_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut cfg = EtcdConfig::new(&[format!("127.0.0.1:{port}")]);
    cfg.timeout = Duration::from_millis(500);
    let t = Instant::now();
    let e = EtcdRegistry::connect(cfg).unwrap_err();
    assert_eq!(e.status, Status::Unavailable, "{e}");
    assert!(e.message.contains("etcd at 127.0.0.1"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    let e = EtcdRegistry::connect(EtcdConfig::new::<&str>(&[])).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument);
}

#[test]
fn a_member_killed_and_etcd_gone_midway() {
    let mut c = cluster(3, "members");
    let a = EtcdRegistry::connect(cfg(&c, "/t5")).unwrap();
    let b = EtcdRegistry::connect(cfg(&c, "/t5")).unwrap();
    a.register_replica("kv", &tcp("10.0.0.1:1")).unwrap();
    // One member of three killed: the cluster keeps serving, and the
    // registration outlives several leases (its keep-alives go on).
    c.kill(0);
    std::thread::sleep(Duration::from_secs(5));
    let all = until(Duration::from_secs(5), || {
        b.lookup_all("kv").is_ok_and(|v| v.len() == 1)
    });
    assert!(all.is_some(), "the registration survived a member's death");
    b.register_replica("kv", &tcp("10.0.0.2:1")).unwrap();
    // Every member gone: calls fail with a clear error, in bounded time.
    c.kill(1);
    c.kill(2);
    let t = Instant::now();
    let e = b.lookup_all("kv").unwrap_err();
    assert_eq!(e.status, Status::Unavailable, "{e}");
    assert!(t.elapsed() < Duration::from_secs(5));
    // Back after longer than the lease: the names come back under new
    // leases.
    std::thread::sleep(Duration::from_secs(3));
    for i in 0..3 {
        c.restart(i).unwrap();
    }
    c.wait_ready(Duration::from_secs(20)).unwrap();
    let back = until(Duration::from_secs(15), || {
        b.lookup_all("kv").is_ok_and(|v| v.len() == 2)
    });
    assert!(back.is_some(), "{:?}", b.lookup_all("kv"));
}

#[test]
fn memory_servers_register_and_make_a_pool_by_zone() {
    let c = cluster(1, "memservers");
    let a = EtcdRegistry::connect(cfg(&c, "/t6")).unwrap();
    let b = EtcdRegistry::connect(cfg(&c, "/t6")).unwrap();
    let servers: Vec<dm_memserver::Server> = (0..3)
        .map(|_| dm_memserver::Server::start(dm_memserver::Config::default()).unwrap())
        .collect();
    let size = dm_memserver::Config::default().size;
    a.register_memserver("rack-1", &servers[0].addr().to_string(), size)
        .unwrap();
    a.register_memserver("rack-1", &servers[1].addr().to_string(), size)
        .unwrap();
    let r3 = b
        .register_memserver("rack-2", &servers[2].addr().to_string(), size)
        .unwrap();
    assert_eq!(a.memservers(Some("rack-1")).unwrap().len(), 2);
    assert_eq!(a.memservers(None).unwrap().len(), 3);
    assert!(a.register_memserver("no/slash", "h:1", 1).is_err());
    assert!(a.register_memserver("z", "nocolon", 1).is_err());
    assert!(a.memservers(Some("a b")).is_err());
    // A pool of one zone's servers, used.
    let p = b
        .mem_pool(Some("rack-1"), dm_memserver::ClientConfig::default())
        .unwrap();
    assert_eq!(p.server_ids().len(), 2);
    let data = vec![7u8; 100_000];
    let r = p.put(&data, Duration::from_secs(5)).unwrap();
    let mut out = vec![0u8; data.len()];
    p.read_ref(&r, 0, &mut out).unwrap();
    assert_eq!(out, data);
    dm_pool::Dm::release_ref(&p, &r).unwrap();
    drop(p);
    // Gone with its registration (or its process's lease).
    b.unregister(&r3).unwrap();
    let e = a
        .mem_pool(Some("rack-2"), dm_memserver::ClientConfig::default())
        .unwrap_err();
    assert_eq!(e.status, Status::NotFound, "{e}");
    drop(a);
    assert!(b.memservers(None).unwrap().is_empty());
    for s in servers {
        s.shutdown();
    }
}

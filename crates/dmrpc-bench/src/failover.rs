//! `dmrpc bench failover` — how soon a balanced client follows replicas
//! that join and die, with etcd's watch against the pool registry's
//! polling, same run.
//!
//! A balanced client calls `who` on a name in a loop (idempotent calls,
//! one at a time). Each round starts a replica in a process of its own,
//! times how long after its registration it gets its first call
//! (*join*), then kills it with SIGKILL and times how long until the
//! client sends it nothing more (*drop*: its connection known broken and
//! left out of the set), and, with etcd, until its name leaves etcd
//! (*gone*: the lease). Every call must succeed. Pool: replicas over
//! shared memory, found in the pool's registry, looked up every 500 ms.
//! etcd: replicas over TCP on loopback, found in etcd (one member, a
//! lease of 2 s), watched. Target: drop below the lease plus 10 ms, and
//! no failed idempotent call.

use super::peer::{median, Peer};
use super::plot::Chart;
use super::serde_like::Obj;
use super::BenchArgs;
use crate::say;
use anyhow::{anyhow, bail, Result};
use dm_pool::testing::TempPool;
use dm_rpc::{CallOptions, Node, Payload, Registry};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const NAME: &str = "failover/who";
use super::peer::ETCD_LEASE as LEASE;

/// One round's times, in ms.
struct Round {
    join: f64,
    drop: f64,
    gone: Option<f64>,
}

pub fn run(a: &BenchArgs) -> Result<()> {
    if !dm_etcd::etcd_available() {
        bail!("bench failover needs etcd: scripts/deps.sh installs etcd-server");
    }
    let rounds = if a.quick { 2 } else { 10 };
    say!(
        "bench failover: a balanced client calling in a loop; per round a replica joins, then is killed (SIGKILL); {rounds} rounds"
    );
    say!(
        "{:>9} {:>10} {:>10} {:>10} {:>10} {:>11} {:>8} {:>8}",
        "registry",
        "join p50",
        "join max",
        "drop p50",
        "drop max",
        "gone p50",
        "calls",
        "failed"
    );
    let dir = std::env::temp_dir().join(format!("dmrpc-bench-failover-{}", std::process::id()));
    let etcd = dm_etcd::EtcdCluster::start(1, &dir)?;
    let mut rows = Vec::new();
    for reg in ["pool", "etcd"] {
        let eps = etcd.endpoints().join(",");
        let which = if reg == "pool" { "pool" } else { eps.as_str() };
        let (rs, calls, failed) = rounds_with(which, rounds)?;
        let ms = |f: &dyn Fn(&Round) -> f64| -> (f64, f64) {
            let mut v: Vec<f64> = rs.iter().map(f).collect();
            (median(&mut v), v.iter().copied().fold(0.0, f64::max))
        };
        let (jp, jm) = ms(&|r| r.join);
        let (dp, dm) = ms(&|r| r.drop);
        let mut gone: Vec<f64> = rs.iter().filter_map(|r| r.gone).collect();
        let gp = (!gone.is_empty()).then(|| median(&mut gone));
        say!(
            "{:>9} {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>11} {:>8} {:>8}",
            reg,
            jp,
            jm,
            dp,
            dm,
            gp.map_or("-".into(), |g| format!("{g:.0}ms")),
            calls,
            failed
        );
        let mut o = Obj::default();
        o.str("registry", reg);
        o.num("join_p50_ms", jp);
        o.num("join_max_ms", jm);
        o.num("drop_p50_ms", dp);
        o.num("drop_max_ms", dm);
        o.num("gone_p50_ms", gp.unwrap_or(f64::NAN));
        o.num("calls", calls as f64);
        o.num("failed", failed as f64);
        rows.push(o);
    }
    drop(etcd);
    let _ = std::fs::remove_dir_all(&dir);
    let lease_ms = LEASE.as_secs_f64() * 1e3;
    for r in &rows {
        let dm: f64 = r
            .text("drop_max_ms")
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN);
        let failed = r.text("failed").unwrap_or("?");
        say!(
            "{}: longest drop {dm:.1} ms (target: below the lease + 10 ms = {:.0} ms), {failed} failed calls (target: 0)",
            r.text("registry").unwrap_or("?"),
            lease_ms + 10.0
        );
    }
    let mut res = Obj::default();
    res.str("benchmark", "failover");
    res.str(
        "method",
        "a balanced client calls `who` in a loop (idempotent); per round a replica process joins (join: registration to its first call), then is killed with SIGKILL (drop: until the client sends it nothing more; gone: until its name leaves etcd). pool = shared memory and the pool's registry (looked up every 500 ms); etcd = TCP on loopback and etcd's registry (one member, lease 2 s, watched)",
    );
    res.obj("machine", &super::machine());
    res.arr("rows", &rows);
    super::write_results(
        a,
        "failover",
        &Chart {
            title: "bench failover: join and drop times (ms)",
            x: "registry",
            ys: &["join_p50_ms", "drop_p50_ms"],
            by: None,
            y_label: "ms",
            log_x: false,
            log_y: false,
        },
        &res,
        &rows,
        &[
            "registry",
            "join_p50_ms",
            "join_max_ms",
            "drop_p50_ms",
            "drop_max_ms",
            "gone_p50_ms",
            "calls",
            "failed",
        ],
    )
}

/// `rounds` rounds with the registry `reg` (`pool` or etcd's endpoints):
/// their times, the calls made and how many failed.
fn rounds_with(reg: &str, rounds: usize) -> Result<(Vec<Round>, u64, u64)> {
    let tp = TempPool::new(64 << 20);
    let pool = tp.attach();
    let etcd_reg = if reg == "pool" {
        None
    } else {
        let mut cfg = dm_etcd::EtcdConfig::new(&dm_etcd::parse_endpoints(reg));
        cfg.lease = LEASE;
        Some(dm_etcd::EtcdRegistry::connect(cfg)?)
    };
    let node = match &etcd_reg {
        Some(r) => Node::new(pool.clone()).with_registry(Arc::new(r.clone())),
        None => Node::new(pool.clone()),
    };
    // A first replica that stays.
    let mut first = Peer::spawn(&tp.path, &[])?;
    first.cmd(&format!("whoreplica {NAME} {reg}"))?;
    let bc = node.connect_balanced(NAME)?;
    // The caller: who answered each call, and when.
    let stop = AtomicBool::new(false);
    let seen: Mutex<Vec<(u32, Instant)>> = Mutex::new(Vec::new());
    let (calls, failed) = (AtomicU64::new(0), AtomicU64::new(0));
    let mut out = Vec::with_capacity(rounds);
    std::thread::scope(|s| -> Result<()> {
        s.spawn(|| {
            let opts = || CallOptions::deadline(Duration::from_secs(5)).idempotent();
            while !stop.load(Ordering::Relaxed) {
                calls.fetch_add(1, Ordering::Relaxed);
                match bc
                    .call_with("who", Payload::empty(), opts())
                    .and_then(|p| p.to_vec())
                {
                    Ok(v) if v.len() == 4 => {
                        let pid = u32::from_le_bytes([v[0], v[1], v[2], v[3]]);
                        let mut s = seen.lock().unwrap_or_else(|p| p.into_inner());
                        if s.last().is_none_or(|l| l.0 != pid) || s.len() < 2 {
                            s.push((pid, Instant::now()));
                        } else if let Some(l) = s.last_mut() {
                            l.1 = Instant::now();
                        }
                    }
                    _ => {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        });
        let r = (|| -> Result<()> {
            for _ in 0..rounds {
                let mut p = Peer::spawn(&tp.path, &[])?;
                let pid = p.pid();
                p.cmd(&format!("whoreplica {NAME} {reg}"))?;
                let registered = Instant::now();
                let first_call = wait_for(Duration::from_secs(5), || {
                    let s = seen.lock().unwrap_or_else(|p| p.into_inner());
                    s.iter()
                        .find(|(w, t)| *w == pid && *t >= registered)
                        .map(|x| x.1)
                })
                .ok_or_else(|| anyhow!("the new replica got no call within 5 s"))?;
                std::thread::sleep(Duration::from_millis(100));
                // SAFETY: kill(2) of our own child, not reaped yet.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                let killed = Instant::now();
                let dropped = wait_for(Duration::from_secs(5), || {
                    (bc.replicas() == 1).then(Instant::now)
                })
                .ok_or_else(|| anyhow!("the client kept the dead replica for 5 s"))?;
                let gone = match &etcd_reg {
                    Some(r) => Some(
                        wait_for(Duration::from_secs(10), || {
                            let l = r.lookup_all(NAME).ok()?;
                            (!l.iter().any(|e| e.owner.ends_with(&format!("pid {pid}"))))
                                .then(Instant::now)
                        })
                        .ok_or_else(|| anyhow!("the dead replica stayed in etcd"))?,
                    ),
                    None => None,
                };
                drop(p);
                let ms =
                    |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1e3;
                out.push(Round {
                    join: ms(registered, first_call),
                    drop: ms(killed, dropped),
                    gone: gone.map(|g| ms(killed, g)),
                });
            }
            Ok(())
        })();
        stop.store(true, Ordering::Relaxed);
        r
    })?;
    drop(bc);
    drop(first);
    drop(node);
    drop(pool);
    drop(etcd_reg);
    // (The killed replicas' holdings are reclaimed first.)
    dm_pool::gc_path(&tp.path)?;
    tp.assert_clean_within(Duration::from_secs(2));
    Ok((out, calls.into_inner(), failed.into_inner()))
}

/// Polls `f` every 100 µs until it gives a value, at most `within`.
fn wait_for<T>(within: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let t = Instant::now();
    while t.elapsed() < within {
        if let Some(x) = f() {
            return Some(x);
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    None
}

//! `dmrpc bench social` — the social network of [`crate::apps::social`]
//! (DeathStarBench's social network, as DmRPC runs it): seven service
//! processes, posts carrying 16–256 KiB of media, a mix of 60% home
//! timeline reads, 30% user timeline reads and 10% posts.
//!
//! Two modes in the same run, over shared-memory channels in one pool:
//! **ref** (every node sends data by Ref: a post's media is written once by
//! the client, stored by sharing its pages, and read back by Ref) and
//! **value** (everything inline, copied at every hop).
//!
//! First the closed-loop throughput of each mode (two client threads),
//! then latency against offered load: an open-loop generator sends at
//! fixed rates (fractions of by value's throughput) and measures each
//! request from the time it was due, so queueing shows.
//!
//! Then, as DmRPC-net ran DeathStarBench, over each link of `--links`:
//! every service in a pool of its own (on a host of its own beyond
//! loopback), linked by TCP. **memserver**: posts by memory-server Ref,
//! small messages inline; **tcp-value**: everything inline. Closed loop.

use super::peer::{on_threads, percentile, BenchPool, Peer};
use super::plot::Chart;
use super::serde_like::Obj;
use super::BenchArgs;
use crate::apps::social::{self as app, Link};
use crate::say;
use anyhow::{anyhow, bail, Result};
use dm_pool::{Pool, PoolConfig};
use dm_rpc::{Config, Node, Payload, Transport};
use std::time::{Duration, Instant};

const USERS: u32 = 200;
const CAPACITY: usize = 2000;
const CLIENTS: usize = 2;
/// Threads of the open-loop generator (requests in flight at most).
const OPEN_THREADS: usize = 4;
const MODES: [&str; 2] = ["ref", "value"];
/// The modes between pools: posts by memory-server Ref, everything
/// inline, the way learned.
const MODES_NET: [&str; 3] = ["memserver", "tcp-value", "auto"];
/// Offered loads, as fractions of by value's closed-loop throughput.
const LOADS: [f64; 5] = [0.25, 0.5, 0.75, 1.0, 1.5];

fn config(mode: &str) -> Config {
    if mode == "auto" {
        // Inline or by Ref learned per method and size.
        return Config::default();
    }
    Config {
        inline_max: match mode {
            "ref" => 0,
            // Posts (16 KiB and up) by Ref; ids and user numbers inline.
            "memserver" => 4 << 10,
            _ => usize::MAX,
        },
        remote_choice: dm_rpc::RemoteChoice::Threshold,
        ..Default::default()
    }
}

fn name(id: u32, mode: &str, role: &str) -> String {
    format!("bench/social/{id}/{mode}/{role}")
}

/// The peer command `social ROLE MODE ID [ADDRS MS]`: starts service
/// ROLE of mode MODE for the run of process ID. Modes `ref` and `value`
/// serve over shared-memory channels; `memserver` and `tcp-value` over
/// TCP, calling the services at ADDRS (`role=host:port`, comma
/// separated) with memory server MS (`-` for none). Answers the TCP
/// address, or `-`.
pub fn peer_cmd(pool: &Pool, words: &[&str]) -> Result<(dm_rpc::Server, String)> {
    let (role, mode, id, addrs, ms) = match words {
        [role, mode, id] => (*role, *mode, *id, "", "-"),
        [role, mode, id, addrs, ms] => (*role, *mode, *id, *addrs, *ms),
        _ => bail!("usage: social ROLE MODE ID [ADDRS MS]"),
    };
    let id: u32 = id.parse()?;
    let tcp = matches!(mode, "memserver" | "tcp-value" | "auto");
    let mut node = Node::with_config(pool.clone(), super::net::node_config(config(mode)));
    if ms != "-" {
        node = node.with_memserver(dm_memserver::MemPool::connect(&[ms])?);
    }
    let addr_of = |r: &str| {
        addrs
            .split(',')
            .find_map(|kv| kv.strip_prefix(r)?.strip_prefix('='))
            .unwrap_or("")
            .to_owned()
    };
    let at = |r: &str| {
        if tcp {
            Link::Tcp(addr_of(r))
        } else {
            Link::Shm(name(id, mode, r))
        }
    };
    let (_, r) = app::roles(&at, USERS, CAPACITY)
        .into_iter()
        .find(|(n, _)| *n == role)
        .ok_or_else(|| anyhow!("unknown role {role:?}"))?;
    let t = if tcp {
        Transport::Tcp(format!("{}:0", super::net::listen_ip()))
    } else {
        Transport::Shm
    };
    let s = app::serve(&node, &name(id, mode, role), r, t)?;
    let addr = s.tcp_addr().unwrap_or("-").to_owned();
    Ok((s, addr))
}

/// Posts to send, one per media size (16 KiB to 256 KiB).
fn posts() -> Vec<Vec<u8>> {
    (1..=16)
        .map(|k| app::post(k, "a picture of the day", k as usize * (16 << 10), k as u64))
        .collect()
}

/// One client of a mode.
struct Driver<'a> {
    node: &'a Node,
    mode: &'a str,
    entry: Link,
    posts: &'a [Vec<u8>],
}

impl Driver<'_> {
    /// Request `k` of a thread whose random state is `x`: the op's
    /// latency in ns.
    fn one(&self, c: &crate::apps::Conn, x: &mut u64, k: u64) -> Result<f64> {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        let r = *x;
        let user = ((r >> 8) % USERS as u64) as u32;
        let t = Instant::now();
        match r % 10 {
            0 => {
                let p = &self.posts[((r >> 32) % self.posts.len() as u64) as usize];
                // The post by `user`: written once, into the pool or a
                // vector.
                let payload = if self.mode == "ref" {
                    let mut b = self.node.pool().alloc(p.len() as u64)?;
                    b.write(0, p)?;
                    b.write(16, &user.to_le_bytes())?;
                    Payload::from_buffer(b)
                } else {
                    let mut p = p.clone();
                    p[16..20].copy_from_slice(&user.to_le_bytes());
                    Payload::from_vec(p)
                };
                let id = c.call("compose", payload)?;
                if id.len() != 8 {
                    bail!("compose answered {} bytes", id.len());
                }
            }
            r => {
                let m = if r <= 3 { "user" } else { "home" };
                let got = c.call(m, Payload::from_vec(user.to_le_bytes().to_vec()))?;
                if !got.is_empty() {
                    app::verify(&got.bytes()?, k.is_multiple_of(32))?;
                }
            }
        }
        Ok(t.elapsed().as_nanos() as f64)
    }

    fn connect(&self) -> Result<crate::apps::Conn> {
        Ok(self.entry.connect(self.node)?)
    }

    /// Every user posts twice, so timelines have posts to read.
    fn preload(&self) -> Result<()> {
        let c = self.connect()?;
        for u in 0..USERS * 2 {
            let mut p = self.posts[u as usize % self.posts.len()].clone();
            p[16..20].copy_from_slice(&(u % USERS).to_le_bytes());
            c.call("compose", p)?;
        }
        Ok(())
    }

    /// The closed loop's row, printed.
    fn closed_row(&self, budget: Duration, link: Option<&str>) -> Result<(Obj, f64, f64)> {
        let (r, lat) = self.closed(budget)?;
        Ok(self.closed_report(r, lat, link))
    }

    /// Prints the closed loop's row of `r` requests per second whose
    /// latencies were `lat`, and returns it with the rate and the average
    /// latency.
    fn closed_report(&self, r: f64, mut lat: Vec<f64>, link: Option<&str>) -> (Obj, f64, f64) {
        let mut o = Obj::default();
        o.str("mode", self.mode);
        o.str("load", "closed loop");
        if let Some(l) = link {
            o.str("link", l);
        }
        o.num("req_per_s", r);
        let (avg, p50, p99, p999) = stats(&mut o, &mut lat);
        super::progress::tick(format!("{} closed loop", self.mode));
        say!(
            "{:>9} {:>16} {:>10.0} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
            self.mode,
            "closed loop",
            r,
            avg / 1e3,
            p50 / 1e3,
            p99 / 1e3,
            p999 / 1e3
        );
        (o, r, avg)
    }

    /// Runs `body` on `n` threads, each with its connection, the thread's
    /// index and the start time: the requests per second over all of them
    /// since that start, and all their latencies. The connections are made
    /// before the clock starts (a first connection to a service sets up its
    /// channels, which is not what is measured).
    fn threads(
        &self,
        n: usize,
        body: impl Fn(usize, &crate::apps::Conn, Instant) -> Result<Vec<f64>> + Sync,
    ) -> Result<(f64, Vec<f64>)> {
        let cs = (0..n).map(|_| self.connect()).collect::<Result<Vec<_>>>()?;
        let t0 = Instant::now();
        let lats = on_threads(n, |i| body(i, &cs[i], t0))?;
        let secs = t0.elapsed().as_secs_f64();
        let all: Vec<f64> = lats.into_iter().flatten().collect();
        Ok((all.len() as f64 / secs, all))
    }

    /// Closed loop: `CLIENTS` threads for `budget`: ops/s and latencies.
    fn closed(&self, budget: Duration) -> Result<(f64, Vec<f64>)> {
        self.threads(CLIENTS, |i, c, t0| {
            let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ i as u64;
            let mut v = Vec::new();
            while t0.elapsed() < budget || v.len() < 10 {
                v.push(self.one(c, &mut x, v.len() as u64)?);
            }
            Ok(v)
        })
    }

    /// Open loop at `rate` requests/s for `budget`: each request is due at
    /// a fixed time and measured from it when it starts late (so a backlog
    /// shows, as in wrk2). Returns the achieved rate and the latencies.
    fn open(&self, rate: f64, budget: Duration) -> Result<(f64, Vec<f64>)> {
        let gap = Duration::from_secs_f64(OPEN_THREADS as f64 / rate);
        self.threads(OPEN_THREADS, |i, c, t0| {
            let mut x = 0x2545_f491_4f6c_dd1du64 ^ (i as u64 * 7919);
            let mut v = Vec::new();
            let start = t0 + gap.mul_f64(i as f64 / OPEN_THREADS as f64);
            for k in 0u32.. {
                let due = start + gap * k;
                if due.duration_since(t0) >= budget {
                    break;
                }
                // Behind schedule (the last request took longer than the
                // gap), the wait counts; ahead of it, the sleep's own
                // overshoot does not.
                let now = Instant::now();
                let late = now.saturating_duration_since(due);
                if due > now {
                    std::thread::sleep(due - now);
                }
                let took = self.one(c, &mut x, k as u64)?;
                v.push(late.as_nanos() as f64 + took);
            }
            Ok(v)
        })
    }
}

/// The table's header.
fn header() {
    say!(
        "{:>9} {:>16} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "mode",
        "offered req/s",
        "req/s",
        "avg us",
        "p50 us",
        "p99 us",
        "p99.9 us"
    );
}

/// The services over one link: a pool each, TCP between them, posts by
/// memory-server Ref or inline; the closed loop of each mode. Rows, and
/// the ratios.
fn network(
    net: &super::hosts::Net,
    roles: &[&str],
    budget: Duration,
    posts: &[Vec<u8>],
) -> Result<(Vec<Obj>, Obj)> {
    let id = std::process::id();
    let (_ms, ms_addr) = net.memserver(1, "2GiB")?;
    let small = || PoolConfig {
        size: 64 << 20,
        ..Default::default()
    };
    let mut pools = Vec::new();
    let mut peers = Vec::new();
    let mut entry = std::collections::HashMap::new();
    for mode in MODES_NET {
        let mut addrs: Vec<String> = Vec::new();
        for (i, role) in roles.iter().enumerate() {
            if peers.len() <= i {
                let bp = BenchPool::create(&format!("social-net-{role}"), small())?;
                peers.push(net.peer(2 + i, &bp.path)?);
                pools.push(bp);
            }
            let ms = if mode == "tcp-value" {
                "-"
            } else {
                ms_addr.as_str()
            };
            let known = if addrs.is_empty() {
                "-".to_owned()
            } else {
                addrs.join(",")
            };
            let addr = peers[i].cmd_text(&format!("social {role} {mode} {id} {known} {ms}"))?;
            addrs.push(format!("{role}={addr}"));
            if *role == "frontend" {
                entry.insert(mode, addr);
            }
        }
    }
    let client_pool = BenchPool::create("social-client", small())?;
    let link = net.describe();
    say!("\nover {link}: a pool per service, TCP between them; memserver = posts by memory-server Ref, tcp-value = inline, auto = learned");
    header();
    let cfg = net.client_config();
    let out = net.on(0, || {
        let ms_client = dm_memserver::MemPool::connect_with(&[&ms_addr], cfg)?;
        let mut rows = Vec::new();
        let mut res = std::collections::HashMap::new();
        let nodes = MODES_NET.map(|mode| {
            let n = Node::with_config(client_pool.pool.clone(), config(mode));
            if mode != "tcp-value" {
                n.with_memserver(ms_client.clone())
            } else {
                n
            }
        });
        let drivers: Vec<Driver> = MODES_NET
            .iter()
            .zip(&nodes)
            .map(|(&mode, node)| Driver {
                node,
                mode,
                entry: Link::Tcp(entry[mode].clone()),
                posts,
            })
            .collect();
        for d in &drivers {
            d.preload()?;
        }
        // The modes take turns.
        let n = drivers.len();
        let mut lat = vec![Vec::new(); n];
        let mut secs = vec![0.0; n];
        let mut rounds = vec![Vec::new(); n];
        let slice = budget / super::peer::TURN_ROUNDS as u32;
        super::peer::in_turns(n, |m| {
            let (r, l) = drivers[m].closed(slice)?;
            secs[m] += l.len() as f64 / r;
            lat[m].extend(l);
            rounds[m].push(r);
            Ok(())
        })?;
        let auto_at = MODES_NET.iter().position(|m| *m == "auto").unwrap_or(0);
        let auto_median = super::peer::over_best_by_round(&rounds, auto_at);
        for (m, d) in drivers.iter().enumerate() {
            let r = lat[m].len() as f64 / secs[m];
            let (o, r, avg) = d.closed_report(r, std::mem::take(&mut lat[m]), Some(&link));
            res.insert(d.mode, (r, avg));
            rows.push(o);
        }
        let (tput, lat) = (
            res["memserver"].0 / res["tcp-value"].0,
            res["tcp-value"].1 / res["memserver"].1,
        );
        let auto = res["auto"].0 / res["memserver"].0.max(res["tcp-value"].0);
        say!("by memory-server Ref / by value over {link}: {tput:.1}x the throughput, {lat:.1}x lower average latency (DmRPC-net: 3.1x and 2.5x); auto / the better: {auto:.2}x (median of the rounds {auto_median:.2}x)");
        let mut q = Obj::default();
        q.num("auto_over_best_throughput", auto);
        q.num("auto_over_best_median_round", auto_median);
        q.str("link", &link);
        q.num("memserver_over_tcp_value_throughput", tput);
        q.num("tcp_value_over_memserver_avg_latency", lat);
        Ok((rows, q))
    })?;
    drop(peers);
    for p in &pools {
        p.check()?;
    }
    Ok(out)
}

fn stats(o: &mut Obj, v: &mut [f64]) -> (f64, f64, f64, f64) {
    let avg = v.iter().sum::<f64>() / v.len().max(1) as f64;
    let (p50, p99, p999) = (
        percentile(v, 0.5),
        percentile(v, 0.99),
        percentile(v, 0.999),
    );
    o.num("avg_ns", avg);
    o.num("p50_ns", p50);
    o.num("p99_ns", p99);
    o.num("p999_ns", p999);
    (avg, p50, p99, p999)
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let budget = Duration::from_millis(if a.quick { 400 } else { 3000 });
    let open_budget = Duration::from_millis(if a.quick { 300 } else { 2000 });
    let loads: &[f64] = if a.quick { &[0.5, 1.5] } else { &LOADS };
    let links = super::hosts::links(a);
    super::progress::start(
        "social",
        (MODES.len() * (1 + loads.len()) + MODES_NET.len() * links.len()) as u64,
    );
    let id = std::process::id();
    let bp = BenchPool::create(
        "social",
        PoolConfig {
            size: 1 << 30,
            channels: Some(48),
            ring_size: 1 << 20,
            ..Default::default()
        },
    )?;
    let roles: Vec<&str> = app::roles(&|_| Link::Shm(String::new()), USERS, CAPACITY)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let mut peers = Vec::new();
    for role in &roles {
        let mut p = Peer::spawn(&bp.path, &[])?;
        for mode in MODES {
            p.cmd_text(&format!("social {role} {mode} {id}"))?;
        }
        peers.push(p);
    }
    let posts = posts();
    let nodes: Vec<Node> = MODES
        .iter()
        .map(|m| Node::with_config(bp.pool.clone(), config(m)))
        .collect();
    let drivers: Vec<Driver> = MODES
        .iter()
        .zip(&nodes)
        .map(|(m, node)| Driver {
            node,
            mode: m,
            entry: Link::Shm(name(id, m, "frontend")),
            posts: &posts,
        })
        .collect();
    for d in &drivers {
        d.preload()?;
    }
    say!("bench social: frontend, compose-post, text, media, post-storage, user- and home-timeline (7 processes); {USERS} users following {} each; media 16-256 KiB; 60% home reads, 30% user reads, 10% posts", app::FOLLOWS);
    header();
    let mut rows = Vec::new();
    let mut max = Vec::new();
    let mut avgs = Vec::new();
    for d in &drivers {
        let (o, r, avg) = d.closed_row(budget, None)?;
        max.push(r);
        avgs.push(avg);
        rows.push(o);
    }
    let (tput, lat) = (max[0] / max[1], avgs[1] / avgs[0]);
    say!("by Ref / by value: {tput:.1}x the throughput, {lat:.1}x lower average latency (DmRPC: 3.1x and 2.5x)");
    let mut curve = Vec::new();
    for &f in loads {
        let rate = (max[1] * f).max(10.0);
        for d in &drivers {
            let (r, mut lat) = d.open(rate, open_budget)?;
            let mut o = Obj::default();
            o.str("mode", d.mode);
            o.num("offered_per_s", rate.round());
            o.num("req_per_s", r);
            let (avg, p50, p99, p999) = stats(&mut o, &mut lat);
            super::progress::tick(format!("{} at {rate:.0} req/s", d.mode));
            say!(
                "{:>9} {:>16.0} {:>10.0} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
                d.mode,
                rate,
                r,
                avg / 1e3,
                p50 / 1e3,
                p99 / 1e3,
                p999 / 1e3
            );
            curve.push(o);
        }
    }
    drop(drivers);
    drop(peers);
    drop(nodes);
    bp.check()?;
    let mut net_rows = Vec::new();
    let mut net_ratios = Vec::new();
    for link in links {
        // Host 0 the client, 1 the memory server, 2.. the services.
        if let Some(net) = super::hosts::Net::new(&link, roles.len() + 2)? {
            let (r, q) = network(&net, &roles, budget, &posts)?;
            net_rows.extend(r);
            net_ratios.push(q);
        }
    }
    let mut res = Obj::default();
    res.str("benchmark", "social");
    res.str(
        "method",
        "7 service processes over shm channels in one pool (frontend, compose-post, text, media, post-storage, user-timeline, home-timeline); 200 users following 8 each, 2 posts each preloaded; ops: 60% home-timeline read, 30% user-timeline read, 10% compose with 16-256 KiB media; closed loop with 2 client threads, then an open loop (4 threads, requests due at fixed times, latency measured from the due time) at fractions of by value's closed-loop throughput; ref = every node sends data by Ref, value = everything inline; network variant: a pool per service, TCP between them, memserver = posts by memory-server Ref, tcp-value = inline, auto = learned, the three taking turns in 5 rounds of a closed loop (the order rotating)",
    );
    res.obj("machine", &super::machine());
    res.num("ref_over_value_throughput", tput);
    res.num("value_over_ref_avg_latency", lat);
    res.arr("closed_loop", &rows);
    res.arr("network", &net_rows);
    res.arr("network_ratios", &net_ratios);
    res.arr("rows", &curve);
    super::write_results(
        a,
        "social",
        &Chart {
            title: "bench social: latency against offered load",
            x: "offered_per_s",
            ys: &["p50_ns", "p99_ns"],
            by: Some("mode"),
            y_label: "latency (ns)",
            log_x: false,
            log_y: true,
        },
        &res,
        &curve,
        &[
            "mode",
            "offered_per_s",
            "req_per_s",
            "avg_ns",
            "p50_ns",
            "p99_ns",
            "p999_ns",
        ],
    )
}

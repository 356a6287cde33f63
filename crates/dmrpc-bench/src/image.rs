//! `dmrpc bench image` — the research's 7-tier image-processing
//! application ([`crate::apps::image`]): client → firewall → load balancer
//! → two image-processing services → transcoding and compressing, each
//! tier its own process, with images of 4 KiB to 4 MiB.
//!
//! Four modes in the same run:
//! * **ref** — shared-memory channels in one pool; the client writes the
//!   request into the pool once and its Ref travels (DmRPC-CXL);
//! * **value** — the same channels, the request inline at every hop (the
//!   by-value baseline);
//! * **memserver** — every tier in a pool of its own, tiers linked by TCP;
//!   the client writes the request to a memory server and its Ref travels
//!   (DmRPC-net);
//! * **tcp-value** — the same TCP links, the request inline (its baseline).
//!
//! Two client threads call in a closed loop for the budget; reported are
//! throughput and latency (avg, p50, p99, p99.5, p99.9), and the ratios
//! by Ref / by value. Every answer is checked against the thumbnail
//! computed locally, and one forged token per mode must be rejected.

use super::peer::{hex, on_threads, percentile, BenchPool, Peer};
use super::plot::Chart;
use super::serde_like::Obj;
use super::BenchArgs;
use crate::apps::image::{self as app, Header, Key, Link, Role};
use crate::say;
use anyhow::{anyhow, bail, Context, Result};
use dm_pool::{Pool, PoolConfig};
use dm_rpc::{Config, Node, Payload, Transport};
use dmrpc::fmt_size;
use std::time::{Duration, Instant};

const CLIENTS: usize = 2;
/// The thumbnail's side.
const THUMB: u32 = 64;
/// The roles, in the order they start (each after the ones it calls).
const ROLES: [&str; 6] = ["transcode", "compress", "proc0", "proc1", "lb", "firewall"];

/// The peer command `image ROLE NAME MODE NEXT KEY MS`: starts tier ROLE
/// as service NAME in mode MODE (`ref`/`value` over shared-memory
/// channels, `memserver`/`near`/`tcp-value`/`auto` over TCP), calling
/// NEXT (comma separated service names or addresses; `-` for none), with
/// firewall key KEY (hex, `-` for none) and memory servers MS (comma
/// separated; `-` for none). Answers the TCP address, or `-`.
pub fn peer_cmd(pool: &Pool, words: &[&str]) -> Result<(dm_rpc::Server, String)> {
    let [role, name, mode, next, key, ms] = words else {
        bail!("usage: image ROLE NAME MODE NEXT KEY MS");
    };
    let tcp = matches!(*mode, "memserver" | "near" | "tcp-value" | "auto");
    let links: Vec<Link> = next
        .split(',')
        .filter(|n| *n != "-")
        .map(|n| {
            if tcp {
                Link::Tcp(n.to_owned())
            } else {
                Link::Shm(n.to_owned())
            }
        })
        .collect();
    let link = |i: usize| {
        links
            .get(i)
            .cloned()
            .ok_or_else(|| anyhow!("{role} needs {} next services", i + 1))
    };
    let r = match role.trim_end_matches(char::is_numeric) {
        "firewall" => {
            let mut k: Key = [0; 32];
            let bytes: Vec<u8> = (0..key.len() / 2)
                .map(|i| u8::from_str_radix(&key[2 * i..2 * i + 2], 16))
                .collect::<Result<_, _>>()
                .context("the firewall key")?;
            if bytes.len() != 32 {
                bail!("the firewall key is 32 bytes in hex");
            }
            k.copy_from_slice(&bytes);
            Role::Firewall {
                key: k,
                next: link(0)?,
            }
        }
        "lb" => Role::Balancer { next: links },
        "proc" => Role::Processing {
            transcode: link(0)?,
            compress: link(1)?,
        },
        "transcode" => Role::Transcoding,
        "compress" => Role::Compressing,
        r => bail!("unknown role {r:?}"),
    };
    let mut node = Node::with_config(
        pool.clone(),
        super::net::node_config(Config {
            inline_max: if mode.ends_with("value") {
                usize::MAX
            } else {
                dm_rpc::DEFAULT_INLINE_MAX
            },
            remote_choice: if *mode == "auto" {
                dm_rpc::RemoteChoice::Measured
            } else {
                dm_rpc::RemoteChoice::Threshold
            },
            ..Default::default()
        }),
    );
    if matches!(*mode, "memserver" | "near" | "auto") {
        node = node.with_memserver(super::net::memservers(ms, Default::default())?);
    }
    let t = if tcp {
        Transport::Tcp(format!("{}:0", super::net::listen_ip()))
    } else {
        Transport::Shm
    };
    let s = app::serve(&node, name, r, t)?;
    let addr = s.tcp_addr().unwrap_or("-").to_owned();
    Ok((s, addr))
}

/// What the next of each role is, given how to name a role.
fn next_of(role: &str, at: &dyn Fn(&str) -> String) -> String {
    match role {
        "firewall" => at("lb"),
        "lb" => format!("{},{}", at("proc0"), at("proc1")),
        "proc0" | "proc1" => format!("{},{}", at("transcode"), at("compress")),
        _ => "-".into(),
    }
}

/// The modes of the network variant. Between hosts also `near`: by
/// Ref through a memory server on the client's host.
const NET_MODES: [&str; 3] = ["memserver", "tcp-value", "auto"];

/// Runs `cells` in turns ([`super::peer::in_turns`]) of `budget /
/// TURN_ROUNDS` each (each first shows that a forged token is refused).
/// Per cell: calls, latencies (ns), seconds.
fn in_turns(cells: &[Cell], budget: Duration) -> Result<Turns> {
    for c in cells {
        c.forged_is_rejected()?;
    }
    let mut acc = vec![(0, Vec::new(), 0.0); cells.len()];
    let mut rounds = vec![Vec::new(); cells.len()];
    let slice = budget / super::peer::TURN_ROUNDS as u32;
    super::peer::in_turns(cells.len(), |m| {
        let (calls, lat, secs) = cells[m].run(slice)?;
        acc[m].0 += calls;
        acc[m].1.extend(lat);
        acc[m].2 += secs;
        rounds[m].push(calls as f64 / secs);
        Ok(())
    })?;
    Ok((acc, rounds))
}

/// Per cell: its calls, their latencies (ns) and its seconds, from all
/// of its turns; and per cell its calls per second in each round.
type Turns = (Vec<(usize, Vec<f64>, f64)>, Vec<Vec<f64>>);

pub fn run(a: &BenchArgs) -> Result<()> {
    let sizes: &[usize] = if a.quick {
        &[64 << 10, 1 << 20]
    } else {
        &[4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
    };
    let budget = Duration::from_millis(if a.quick { 250 } else { 2000 });
    let links = super::hosts::links(a);
    // Between hosts the network variant has a fourth mode (near).
    let hosts = links.iter().filter(|l| *l != "loopback").count();
    super::progress::start(
        "image",
        (sizes.len() * (2 + 3 * links.len() + hosts)) as u64,
    );
    let id = std::process::id();
    let mut key: Key = [0; 32];
    for c in key.chunks_mut(8) {
        c.copy_from_slice(&dm_sys::rand::random_u64().to_le_bytes());
    }
    let key_hex = hex(&key);
    // Shared memory: one pool, a process per role serving both modes.
    // Rings large enough for a 4 MiB image inline (a record is at most
    // half a ring); 16 channels in use.
    let bp = BenchPool::create(
        "image",
        PoolConfig {
            size: 3 << 29,
            channels: Some(20),
            ring_size: 16 << 20,
            ..Default::default()
        },
    )?;
    let name = |mode: &str, role: &str| format!("bench/image/{id}/{mode}/{role}");
    let mut peers = Vec::new();
    for role in ROLES {
        let mut p = Peer::spawn(&bp.path, &[])?;
        for mode in ["ref", "value"] {
            let next = next_of(role, &|r| name(mode, r));
            p.cmd(&format!(
                "image {role} {} {mode} {next} {key_hex} -",
                name(mode, role)
            ))?;
        }
        peers.push(p);
    }
    say!("bench image: client -> firewall -> LB -> 2 image processing -> transcoding, compressing (6 service processes per transport), {CLIENTS} client threads, {THUMB} px thumbnails");
    header();
    let mut rows = Vec::new();
    let mut ratios = Vec::new();
    for &size in sizes {
        let ppm = app::generate(size, size as u64);
        let want = app::expected(&ppm, THUMB)?;
        let mut per_s = std::collections::HashMap::new();
        for mode in ["ref", "value"] {
            let node = Node::with_config(
                bp.pool.clone(),
                Config {
                    inline_max: if mode == "ref" { 0 } else { usize::MAX },
                    ..Default::default()
                },
            );
            let target = Link::Shm(name(mode, "firewall"));
            let cell = Cell {
                node: &node,
                target: &target,
                mode,
                key: &key,
                ppm: &ppm,
                want: &want,
            };
            let (o, r) = cell.measure(size, budget, None)?;
            per_s.insert(mode, r);
            rows.push(o);
        }
        let mut o = Obj::default();
        o.num("size", ppm.len() as f64);
        o.str("image", &fmt_size(size as u64));
        let ratio = per_s["ref"] / per_s["value"];
        o.num("ref_over_value_throughput", ratio);
        say!(
            "{:>9}   throughput by Ref / by value with the pool: {ratio:.1}x",
            fmt_size(size as u64),
        );
        ratios.push(o);
    }
    drop(peers);
    bp.check()?;
    for link in links {
        // Host 0 the client, 1 the memory server, 2.. the roles.
        if let Some(net) = super::hosts::Net::new(&link, ROLES.len() + 2)? {
            let (r, q) = network(&net, sizes, budget, &key)?;
            rows.extend(r);
            ratios.extend(q);
        }
    }
    say!(
        "target: by Ref at least 8x by value's throughput with the pool at 64 KiB images and above"
    );
    let mut res = Obj::default();
    res.str("benchmark", "image");
    res.str(
        "method",
        "client -> firewall (HMAC-SHA256 token) -> round-robin LB -> 2 image-processing services (PPM header decode, dispatch) -> transcoding (nearest-neighbour 64 px thumbnail with the image crate, PPM) and compressing (zstd level 3), each tier its own process; 2 client threads in a closed loop; every answer checked; ref/value over shm channels in one pool, memserver/tcp-value over TCP between pools, the three taking turns in 5 rounds per size (the order rotating)",
    );
    res.obj("machine", &super::machine());
    res.arr("rows", &rows);
    res.arr("ratios", &ratios);
    super::write_results(
        a,
        "image",
        &Chart {
            title: "bench image: 7-tier image processing, throughput",
            x: "size",
            ys: &["calls_per_s"],
            by: Some("mode"),
            y_label: "requests/s",
            log_x: true,
            log_y: true,
        },
        &res,
        &rows,
        &[
            "image",
            "mode",
            "calls",
            "calls_per_s",
            "avg_ns",
            "p50_ns",
            "p99_ns",
            "p995_ns",
            "p999_ns",
        ],
    )
}

/// The table's header.
fn header() {
    say!(
        "{:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "image",
        "mode",
        "calls/s",
        "avg us",
        "p50 us",
        "p99 us",
        "p99.5 us",
        "p99.9 us"
    );
}

/// The network modes over one link: a pool per role, TCP links, a memory
/// server; each process on a host of its own unless on loopback. Rows,
/// and the ratio of each size.
fn network(
    net: &super::hosts::Net,
    sizes: &[usize],
    budget: Duration,
    key: &Key,
) -> Result<(Vec<Obj>, Vec<Obj>)> {
    let id = std::process::id();
    let key_hex = hex(key);
    let name = |mode: &str, role: &str| format!("bench/image/{id}/{mode}/{role}");
    let (_ms, ms_addr) = net.memserver(1, "1GiB")?;
    // Between hosts a second memory server, on the client's host (`near`;
    // auto places its Refs there too).
    let near = if net.is_loopback() {
        None
    } else {
        Some(net.memserver(0, "1GiB")?)
    };
    let mut modes = NET_MODES.to_vec();
    let mut servers = std::collections::HashMap::from([
        ("memserver", ms_addr.clone()),
        ("tcp-value", "-".to_owned()),
        ("auto", ms_addr.clone()),
    ]);
    if let Some((_, a)) = &near {
        modes.push("near");
        servers.insert("near", a.clone());
        servers.insert("auto", format!("{a},{ms_addr}"));
    }
    let small = || PoolConfig {
        size: 32 << 20,
        ..Default::default()
    };
    let mut pools = Vec::new();
    let mut peers = Vec::new();
    let mut entry = std::collections::HashMap::new();
    for &mode in &modes {
        let mut addrs = std::collections::HashMap::new();
        for (i, role) in ROLES.iter().enumerate() {
            if peers.len() <= i {
                let bp = BenchPool::create(&format!("image-net-{role}"), small())?;
                peers.push(net.peer(2 + i, &bp.path)?);
                pools.push(bp);
            }
            let next = next_of(role, &|r: &str| addrs.get(r).cloned().unwrap_or_default());
            let addr = peers[i].cmd_text(&format!(
                "image {role} {} {mode} {next} {key_hex} {}",
                name(mode, role),
                servers[mode]
            ))?;
            addrs.insert(role.to_string(), addr);
        }
        entry.insert(mode, addrs["firewall"].clone());
    }
    let client_pool = BenchPool::create("image-client", small())?;
    let link = net.describe();
    say!("\nover {link}: a pool per tier, TCP between them; memserver = by memory-server Ref, tcp-value = inline, auto = learned");
    if near.is_some() {
        say!("memserver: the memory server on a host of its own; near: on the client's host (auto's Refs go there too)");
    }
    header();
    let cfg = net.client_config();
    let (rows, ratios) = net.on(0, || {
        let connect = |mode: &str| super::net::memservers(&servers[mode], cfg.clone());
        let mut clients = std::collections::HashMap::new();
        for &mode in modes.iter().filter(|m| **m != "tcp-value") {
            clients.insert(mode, connect(mode)?);
        }
        let mut rows = Vec::new();
        let mut ratios = Vec::new();
        for &size in sizes {
            let ppm = app::generate(size, size as u64);
            let want = app::expected(&ppm, THUMB)?;
            let mut nodes = Vec::new();
            for &mode in &modes {
                let n = Node::with_config(
                    client_pool.pool.clone(),
                    match mode {
                        "memserver" | "near" => Config {
                            inline_max: 0,
                            remote_choice: dm_rpc::RemoteChoice::Threshold,
                            ..Default::default()
                        },
                        "auto" => Config::default(),
                        _ => Config {
                            inline_max: usize::MAX,
                            ..Default::default()
                        },
                    },
                );
                let node = match clients.get(mode) {
                    Some(c) => n.with_memserver(c.clone()),
                    None => n,
                };
                nodes.push((node, Link::Tcp(entry[mode].clone())));
            }
            let cells: Vec<Cell> = modes
                .iter()
                .zip(&nodes)
                .map(|(mode, (node, target))| Cell {
                    node,
                    target,
                    mode,
                    key,
                    ppm: &ppm,
                    want: &want,
                })
                .collect();
            let mut per_s = std::collections::HashMap::new();
            let (turns, rounds) = in_turns(&cells, budget)?;
            let auto_at = modes.iter().position(|m| *m == "auto").unwrap_or(0);
            let auto_median = super::peer::over_best_by_round(&rounds, auto_at);
            for (cell, (calls, mut lat, secs)) in cells.iter().zip(turns) {
                let (o, r) = cell.report(size, Some(&link), (calls, &mut lat, secs));
                per_s.insert(cell.mode, r);
                rows.push(o);
            }
            let ratio = per_s["memserver"] / per_s["tcp-value"];
            let best = per_s
                .iter()
                .filter(|(m, _)| **m != "auto")
                .map(|(_, r)| *r)
                .fold(0.0, f64::max);
            let auto = per_s["auto"] / best;
            let mut o = Obj::default();
            o.num("size", ppm.len() as f64);
            o.str("image", &fmt_size(size as u64));
            o.str("link", &link);
            o.num("memserver_over_tcp_value_throughput", ratio);
            o.num("auto_over_best_throughput", auto);
            o.num("auto_over_best_median_round", auto_median);
            let near_ratio = per_s.get("near").map(|n| n / per_s["tcp-value"]);
            let near_text = near_ratio.map_or(String::new(), |n| {
                o.num("near_over_tcp_value_throughput", n);
                format!(", near {n:.1}x")
            });
            say!(
                "{:>9}   throughput by Ref / by value over memory servers: {ratio:.1}x{near_text}; auto / the best: {auto:.2}x (median of the rounds {auto_median:.2}x)",
                fmt_size(size as u64),
            );
            ratios.push(o);
        }
        // Releases go with the next request: let the last ones go.
        std::thread::sleep(Duration::from_millis(600));
        for c in clients.values() {
            let u = dm_pool::Dm::usage(c)?;
            if u.refs != 0 {
                bail!("the application left {} Refs on a memory server", u.refs);
            }
        }
        Ok((rows, ratios))
    })?;
    drop(peers);
    for p in &pools {
        p.check()?;
    }
    Ok((rows, ratios))
}

/// One image size in one mode.
struct Cell<'a> {
    node: &'a Node,
    target: &'a Link,
    mode: &'a str,
    key: &'a Key,
    ppm: &'a [u8],
    want: &'a [u8],
}

impl Cell<'_> {
    fn connect(&self) -> Result<crate::apps::Conn> {
        Ok(self.target.connect(self.node)?)
    }

    fn header(&self) -> Header {
        Header {
            client: std::process::id() as u64,
            expires: app::unix_now() + 3600,
            thumb: THUMB,
        }
    }

    /// The request as a payload: in the pool (by Ref), or bytes.
    fn request(&self) -> Result<Payload> {
        let h = self.header().sign(self.key);
        if self.mode == "ref" {
            let mut b = self.node.pool().alloc((h.len() + self.ppm.len()) as u64)?;
            b.write(0, &h)?;
            b.write(h.len() as u64, self.ppm)?;
            return Ok(Payload::from_buffer(b));
        }
        let mut v = Vec::with_capacity(h.len() + self.ppm.len());
        v.extend_from_slice(&h);
        v.extend_from_slice(self.ppm);
        Ok(Payload::from_vec(v))
    }

    fn forged_is_rejected(&self) -> Result<()> {
        let mut forged = app::request(&self.header(), self.key, self.ppm);
        forged[16] ^= 0x80;
        match self.connect()?.call(app::METHOD, forged) {
            Err(e) if e.status == dm_rpc::Status::Unauthenticated => Ok(()),
            r => bail!(
                "a forged token was not rejected in mode {}: {r:?}",
                self.mode
            ),
        }
    }

    /// Calls from `CLIENTS` threads for `budget`: calls, latencies (ns),
    /// seconds.
    fn run(&self, budget: Duration) -> Result<(usize, Vec<f64>, f64)> {
        let warm = self.connect()?;
        // (A learning client, and the tiers behind it, try both ways in
        // their first calls.)
        let warm_calls = if self.mode == "auto" { 24 } else { 3 };
        for _ in 0..warm_calls {
            self.check(&warm.call(app::METHOD, self.request()?)?)?;
        }
        // Connected before the clock starts: a first connection to a
        // service sets up its channels, which is not what is measured.
        let cs = (0..CLIENTS)
            .map(|_| self.connect())
            .collect::<Result<Vec<_>>>()?;
        let t0 = Instant::now();
        let lats = on_threads(CLIENTS, |i| {
            let c = &cs[i];
            let mut v = Vec::new();
            while t0.elapsed() < budget || v.len() < 5 {
                let t = Instant::now();
                let r = c.call(app::METHOD, self.request()?)?;
                v.push(t.elapsed().as_nanos() as f64);
                self.check(&r)?;
            }
            Ok(v)
        })?;
        let secs = t0.elapsed().as_secs_f64();
        let all: Vec<f64> = lats.into_iter().flatten().collect();
        Ok((all.len(), all, secs))
    }

    /// Runs the cell for `budget`, prints its line: its row (with the
    /// link, if any) and its calls per second.
    fn measure(&self, size: usize, budget: Duration, link: Option<&str>) -> Result<(Obj, f64)> {
        self.forged_is_rejected()?;
        let (calls, mut lat, secs) = self.run(budget)?;
        Ok(self.report(size, link, (calls, &mut lat, secs)))
    }

    /// Prints the row of `calls` calls in `secs` seconds, whose
    /// latencies were `lat`, and returns it with the calls per second.
    fn report(
        &self,
        size: usize,
        link: Option<&str>,
        (calls, lat, secs): (usize, &mut Vec<f64>, f64),
    ) -> (Obj, f64) {
        let r = calls as f64 / secs;
        let avg = lat.iter().sum::<f64>() / lat.len().max(1) as f64;
        let q = |v: &mut Vec<f64>, p| percentile(v, p);
        let (p50, p99, p995, p999) = (q(lat, 0.5), q(lat, 0.99), q(lat, 0.995), q(lat, 0.999));
        let mode = self.mode;
        super::progress::tick(format!("{} by {mode}", fmt_size(size as u64)));
        say!(
            "{:>9} {:>10} {:>10.0} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
            fmt_size(size as u64),
            mode,
            r,
            avg / 1e3,
            p50 / 1e3,
            p99 / 1e3,
            p995 / 1e3,
            p999 / 1e3
        );
        let mut o = Obj::default();
        o.num("size", self.ppm.len() as f64);
        o.str("image", &fmt_size(size as u64));
        o.str("mode", mode);
        if let Some(l) = link {
            o.str("link", l);
        }
        o.num("calls", calls as f64);
        o.num("calls_per_s", r);
        o.num("avg_ns", avg);
        o.num("p50_ns", p50);
        o.num("p99_ns", p99);
        o.num("p995_ns", p995);
        o.num("p999_ns", p999);
        (o, r)
    }

    fn check(&self, r: &Payload) -> Result<()> {
        if *r.bytes()? != *self.want {
            bail!("wrong thumbnail in mode {}", self.mode);
        }
        Ok(())
    }
}

//! `dmrpc bench chain` — DmRPC's nested-RPC experiment: a request passes
//! through 1 to 7 tiers, each a separate process forwarding it to the next;
//! the last tier reads every byte and answers 8 bytes.
//!
//! Two modes over the same shared-memory transport, in the same run:
//! * **by Ref** — the client writes the request into the pool once; each
//!   tier forwards the 40-byte Ref without touching the data;
//! * **by value** — the request travels inline: copied into and out of a
//!   ring at every tier (what RPC does with value arguments).
//!
//! Then the network variant (DmRPC-net): every tier a process with a pool
//! of its own, tiers linked by TCP; by Ref = the client writes the request
//! to a memory server once and its Ref travels, by value = inline in every
//! TCP frame.
//!
//! Sequential calls from one client: latency p50 and calls per second.
//! By-Ref throughput should stay nearly flat as tiers grow. Then calls in
//! flight: client threads (1, 4 and 16; 1, 2, 4, 8 and 16 in a full
//! run), each with its own connection, through the same chain with async
//! tiers (and as many tonic clients), calls per second at 7 tiers; and
//! each mode's peak throughput, its best over those loads, since modes
//! saturate at different loads (by value's 64 KiB records crowd the
//! rings and caches sooner, by Ref amortizes its hand-offs over more
//! calls). The peak ratio is then measured again in paired rounds: by Ref
//! and by value back to back at their peak loads, the order alternating,
//! and the median of the rounds' ratios reported with their range (the
//! peaks themselves are cells seconds apart, on a host whose speed
//! drifts between them).
//!
//! The gRPC peer: the same chain built with tonic in the same tier
//! processes, passing the bytes by value, once over loopback TCP and once
//! over Unix sockets.
//!
//! Every cell also counts the context switches of all the processes (the
//! client's and the tiers', and the memory server's in the network
//! variant) per call, and the relay floor's per round: on two cores,
//! eight processes only move by switching, and the counts show how much
//! of a chain's time is the scheduler's.

use super::peer::{percentile, yield_until, BenchPool, Peer, PingPong, TempFile};
use super::plot::Chart;
use super::serde_like::Obj;
use super::BenchArgs;
use crate::say;
use anyhow::{bail, Result};
use dm_pool::PoolConfig;
use dm_rpc::{Config, Node, Payload};
use dmrpc::fmt_size;
use std::time::{Duration, Instant};

const TIERS: usize = 7;
/// Calls at once in the in-flight rows (a quick run: 1, 4 and 16).
const IN_FLIGHT: &[usize] = &[1, 2, 4, 8, 16];

/// Rounds of by Ref and by value back to back at their peak loads: the
/// peak ratio measured in pairs (see `run`).
const PAIRED_ROUNDS: usize = 5;

/// One client's calls: made once per client thread, called in a loop.
type Caller<'a> = Box<dyn FnMut() -> Result<()> + 'a>;

/// Counts the context switches of a set of processes (this one and its
/// peers): the scheduler's share of a chain.
struct Switches(Vec<u32>);

impl Switches {
    fn of(peers: &[Peer]) -> Self {
        let own = std::iter::once(std::process::id());
        Switches(own.chain(peers.iter().map(Peer::pid)).collect())
    }

    /// Counts `pid`'s switches too.
    fn and(mut self, pid: u32) -> Self {
        self.0.push(pid);
        self
    }

    /// All their threads' switches so far (a process that cannot be read,
    /// having just exited, counts none).
    fn now(&self) -> u64 {
        dm_sys::proc::context_switches_of(&self.0)
    }

    /// Switches since `before`, per each of `n` calls.
    fn per(&self, before: u64, n: u64) -> f64 {
        Self::between(before, self.now(), n)
    }

    /// Switches from reading `before` to reading `after`, per each of `n`
    /// calls.
    fn between(before: u64, after: u64, n: u64) -> f64 {
        after.saturating_sub(before) as f64 / n.max(1) as f64
    }
}

/// One mode's cell: p50 latency (ns), calls per second, context switches
/// per call.
#[derive(Clone, Copy)]
struct Cell {
    p50: f64,
    per_s: f64,
    switches: f64,
}

/// Calls per second with `threads` client threads each calling in a
/// closed loop for `budget` (after 5 warm-up calls each, all threads
/// starting the clock together); `caller(i)` makes thread `i`'s calls.
/// Also the context switches per call (`sw`).
fn loaded<'a>(
    threads: usize,
    budget: Duration,
    sw: &Switches,
    caller: impl Fn(usize) -> Result<Caller<'a>> + Sync,
) -> Result<Cell> {
    // Both readings of the switches are taken with every client thread
    // alive: a thread that ended takes its count with it.
    let (start, end) = (
        std::sync::Barrier::new(threads),
        std::sync::Barrier::new(threads),
    );
    let (sw0, sw1) = (
        std::sync::atomic::AtomicU64::new(0),
        std::sync::atomic::AtomicU64::new(0),
    );
    let counts = super::peer::on_threads(threads, |i| {
        // A thread whose calls fail still meets the others at both
        // barriers (then gives its error), so that none waits forever.
        let warm = caller(i).and_then(|mut call| {
            for _ in 0..5 {
                call()?;
            }
            Ok(call)
        });
        if start.wait().is_leader() {
            sw0.store(sw.now(), std::sync::atomic::Ordering::Relaxed);
        }
        let t0 = Instant::now();
        let run = warm.and_then(|mut call| {
            let mut n = 0u64;
            while t0.elapsed() < budget {
                call()?;
                n += 1;
            }
            Ok((n, t0.elapsed()))
        });
        if end.wait().is_leader() {
            sw1.store(sw.now(), std::sync::atomic::Ordering::Relaxed);
        }
        run
    })?;
    let calls: u64 = counts.iter().map(|c| c.0).sum();
    let took = counts.iter().map(|c| c.1).max().unwrap_or(budget);
    Ok(Cell {
        // (Calls in flight are judged by their throughput alone.)
        p50: f64::NAN,
        per_s: calls as f64 / took.as_secs_f64(),
        switches: Switches::between(sw0.into_inner(), sw1.into_inner(), calls),
    })
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let sizes: &[usize] = if a.quick {
        &[4 << 10, 64 << 10]
    } else {
        &[4 << 10, 64 << 10, 256 << 10, 1 << 20]
    };
    let tiers: &[usize] = if a.quick {
        &[1, 3, 7]
    } else {
        &[1, 2, 3, 4, 5, 6, 7]
    };
    let budget = Duration::from_millis(if a.quick { 300 } else { 1500 });
    let net_cells = if a.quick { 2 } else { 8 };
    let load_sizes: &[usize] = if a.quick {
        &[64 << 10]
    } else {
        &[64 << 10, 1 << 20]
    };
    let in_flight: Vec<usize> = if a.quick {
        vec![1, 4, 16]
    } else {
        IN_FLIGHT.to_vec()
    };
    let cells = sizes.len() * tiers.len()
        + load_sizes.len() * (in_flight.len() + PAIRED_ROUNDS)
        + net_cells;
    super::progress::start("chain", cells as u64);
    let id = std::process::id();
    let bp = BenchPool::create(
        "chain",
        PoolConfig {
            size: 1 << 30,
            channels: Some(64),
            ring_size: 4 << 20,
            ..Default::default()
        },
    )?;
    let (pool, path) = (&bp.pool, &bp.path);
    let pin = super::peer::Pin::new(a.pin)?;
    // One process per tier, each serving its tier in both modes.
    let name = |mode: &str, k: usize| format!("bench/chain/{id}/{mode}/{k}");
    // The same chain with async tiers, for calls in flight at once.
    let aname = |mode: &str, k: usize| name(&format!("async-{mode}"), k);
    let mut peers = Vec::new();
    for k in 0..TIERS {
        let mut p = pin.spawn(path, k)?;
        for mode in ["ref", "value"] {
            let (next, anext) = if k + 1 < TIERS {
                (name(mode, k + 1), aname(mode, k + 1))
            } else {
                ("-".into(), "-".into())
            };
            p.cmd(&format!("chain {} {next} {mode}", name(mode, k)))?;
            p.cmd(&format!("chainasync {} {anext} {mode}", aname(mode, k)))?;
        }
        peers.push(p);
    }
    // The same chain in gRPC (tonic, by value), twice: over loopback TCP
    // and over Unix sockets. One tonic server per tier process and
    // transport, each forwarding to the next.
    let mut grpc_addrs = vec![String::new(); TIERS];
    let mut uds_addrs = vec![String::new(); TIERS];
    let mut _socks = Vec::new();
    for k in (0..TIERS).rev() {
        let (next, unext) = if k + 1 < TIERS {
            (grpc_addrs[k + 1].clone(), uds_addrs[k + 1].clone())
        } else {
            ("-".into(), "-".into())
        };
        grpc_addrs[k] = peers[k].cmd_text(&format!("grpc tcp {next}"))?;
        let sock = std::env::temp_dir().join(format!("dmrpc-bench-chain-{id}-{k}.sock"));
        _socks.push(TempFile(sock.clone()));
        uds_addrs[k] = peers[k].cmd_text(&format!("grpc uds {} {unext}", sock.display()))?;
    }
    // By Ref is forced (threshold 0) on the client: under the default
    // threshold a 64 KiB request would travel inline, i.e. by value.
    // The tiers keep the default: they forward the Ref they got as it is.
    let by_ref = Node::with_config(
        pool.clone(),
        Config {
            inline_max: 0,
            ..Default::default()
        },
    );
    let by_value = Node::with_config(
        pool.clone(),
        Config {
            inline_max: usize::MAX,
            ..Default::default()
        },
    );
    say!("bench chain: a request through N tiers (processes), by Ref vs by value, {TIERS} tier processes");
    say!(
        "{:>9} {:>6} {:>12} {:>12} {:>12} {:>12} {:>8} {:>9} {:>9} {:>12} {:>9} {:>11} {:>9} {:>16}",
        "size",
        "tiers",
        "Ref p50 us",
        "value p50 us",
        "Ref calls/s",
        "value calls/s",
        "ratio",
        "floor us",
        "Ref/floor",
        "tonic calls/s",
        "Ref/tonic",
        "uds calls/s",
        "Ref/uds",
        "switches F/R/V"
    );
    let sw = Switches::of(&peers);
    let mut rows = Vec::new();
    // The floor per chain length: the raw relay through the same processes.
    let relay_path = std::path::PathBuf::from(format!("/dev/shm/dmrpc-bench-relay-{id}"));
    let _g = TempFile(relay_path.clone());
    let mut floors = Vec::new();
    for &t in tiers {
        floors.push(relay_floor(
            &relay_path,
            &mut peers[TIERS - t..],
            budget / 4,
            &sw,
        )?);
    }
    for &size in sizes {
        let data: Vec<u8> = (0..size).map(|i| (i * 13) as u8).collect();
        let want = super::peer::sum(&[&data]);
        for (&t, &floor) in tiers.iter().zip(&floors) {
            let entry = TIERS - t;
            let mut res = Vec::new();
            for (mode, node) in [("ref", &by_ref), ("value", &by_value)] {
                let c = node.connect(&name(mode, entry))?;
                let call = || -> Result<()> {
                    let p = super::peer::request(pool, mode, &data)?;
                    check(c.call("go", p)?.to_vec()?, want)
                };
                res.push(measure(call, 20, budget, &sw)?);
            }
            let bytes = bytes::Bytes::from(data.clone());
            for addrs in [&grpc_addrs, &uds_addrs] {
                let mut g = super::grpc::Client::connect(&addrs[entry])?;
                let call = || -> Result<()> {
                    let r = g.go(bytes.clone())?;
                    check(r.to_vec(), want)
                };
                res.push(measure(call, 5, budget, &sw)?);
            }
            rows.push(row(size, t, &res, Some(floor)));
        }
    }
    // Calls in flight: client threads through the async tiers, each with a
    // connection of its own (as many clients would be), and as many tonic
    // clients; at each load, then each mode's best.
    say!("\nCalls in flight through {TIERS} tiers (async tiers; client threads each with a connection of its own; tonic: as many clients)");
    say!(
        "{:>9} {:>9} {:>12} {:>13} {:>13} {:>11} {:>8} {:>9} {:>9} {:>14}",
        "size",
        "in flight",
        "Ref calls/s",
        "value calls/s",
        "tonic calls/s",
        "uds calls/s",
        "ratio",
        "Ref/tonic",
        "Ref/uds",
        "switches R/V"
    );
    let modes = ["ref", "value", "tonic", "tonic_uds"];
    let mut loaded_rows = Vec::new();
    let mut peaks = Vec::new();
    for &size in load_sizes {
        let data: Vec<u8> = (0..size).map(|i| (i * 11) as u8).collect();
        let want = super::peer::sum(&[&data]);
        let bytes = bytes::Bytes::from(data.clone());
        // `k` client threads of `mode` for `budget`.
        let dm = |mode: &'static str, k: usize, budget: Duration| {
            let node = if mode == "ref" { &by_ref } else { &by_value };
            loaded(k, budget, &sw, |_| {
                let (c, data) = (node.connect(&aname(mode, 0))?, &data);
                Ok(Box::new(move || {
                    let p = super::peer::request(pool, mode, data)?;
                    check(c.call("go", p)?.to_vec()?, want)
                }))
            })
        };
        // Each mode's best calls per second, and at how many in flight.
        let mut best = [(0.0f64, 0usize); 4];
        for &k in &in_flight {
            let mut cells = Vec::new();
            for mode in ["ref", "value"] {
                cells.push(dm(mode, k, budget)?);
            }
            for addrs in [&grpc_addrs, &uds_addrs] {
                cells.push(loaded(k, budget, &sw, |_| {
                    let mut g = super::grpc::Client::connect(&addrs[0])?;
                    let bytes = bytes.clone();
                    Ok(Box::new(move || check(g.go(bytes.clone())?.to_vec(), want)))
                })?);
            }
            super::progress::tick(format!("{} {k} in flight", fmt_size(size as u64)));
            let per_s: Vec<f64> = cells.iter().map(|c| c.per_s).collect();
            say!(
                "{:>9} {:>9} {:>12.0} {:>13.0} {:>13.0} {:>11.0} {:>7.1}x {:>8.1}x {:>8.1}x {:>14}",
                fmt_size(size as u64),
                k,
                per_s[0],
                per_s[1],
                per_s[2],
                per_s[3],
                per_s[0] / per_s[1],
                per_s[0] / per_s[2],
                per_s[0] / per_s[3],
                format!("{:.0}/{:.0}", cells[0].switches, cells[1].switches)
            );
            let mut o = Obj::default();
            o.num("size", size as f64);
            o.num("tiers", TIERS as f64);
            o.num("in_flight", k as f64);
            for (m, c) in modes.iter().zip(&cells) {
                o.num(&format!("{m}_calls_per_s"), c.per_s);
            }
            o.num("ref_over_value_throughput", per_s[0] / per_s[1]);
            o.num("ref_over_tonic_throughput", per_s[0] / per_s[2]);
            o.num("ref_over_tonic_uds_throughput", per_s[0] / per_s[3]);
            for (m, c) in modes.iter().zip(&cells) {
                o.num(&format!("{m}_switches_per_call"), c.switches);
            }
            loaded_rows.push(o);
            for (b, &x) in best.iter_mut().zip(&per_s) {
                if x > b.0 {
                    *b = (x, k);
                }
            }
        }
        // (The target is at 64 KiB.)
        let target = if size == 64 << 10 {
            " (target: 4x)"
        } else {
            ""
        };
        say!(
            "{:>9} peak (each mode at its best load): by Ref {:.0} calls/s ({} in flight), by value {:.0} ({}): {:.1}x{target}; {:.1}x tonic, {:.1}x tonic over UDS",
            fmt_size(size as u64),
            best[0].0,
            best[0].1,
            best[1].0,
            best[1].1,
            best[0].0 / best[1].0,
            best[0].0 / best[2].0,
            best[0].0 / best[3].0
        );
        // The peak ratio compares cells measured seconds apart, on a host
        // whose speed drifts by tens of percent in that time: measured
        // again in paired rounds (by Ref and by value back to back, each
        // at its peak load, the order alternating), the median of the
        // rounds' ratios is the steadier figure.
        let (mut ratios, mut rounds) = (Vec::new(), Vec::new());
        for r in 0..PAIRED_ROUNDS {
            // Calls per second by Ref and by value, in this round's order.
            let mut per_s = [0.0f64; 2];
            for i in [r % 2, 1 - r % 2] {
                per_s[i] = dm(["ref", "value"][i], best[i].1, budget)?.per_s;
            }
            let [rf, vl] = per_s;
            ratios.push(rf / vl);
            let mut o = Obj::default();
            o.num("ref_calls_per_s", rf);
            o.num("value_calls_per_s", vl);
            o.num("ratio", rf / vl);
            rounds.push(o);
            super::progress::tick(format!("{} paired round {}", fmt_size(size as u64), r + 1));
        }
        let paired = super::peer::median(&mut ratios);
        // (Sorted by the median.)
        let (lo, hi) = (ratios[0], ratios[PAIRED_ROUNDS - 1]);
        say!(
            "{:>9} paired rounds at those loads: by Ref / by value = {paired:.1}x (median of {PAIRED_ROUNDS}; range {lo:.1}-{hi:.1}x){target}",
            fmt_size(size as u64),
        );
        let mut o = Obj::default();
        o.num("size", size as f64);
        o.num("tiers", TIERS as f64);
        o.num("paired_rounds", PAIRED_ROUNDS as f64);
        o.num("paired_ref_over_value_median", paired);
        o.num("paired_ref_over_value_min", lo);
        o.num("paired_ref_over_value_max", hi);
        o.arr("paired", &rounds);
        for (m, b) in modes.iter().zip(&best) {
            o.num(&format!("{m}_calls_per_s"), b.0);
            o.num(&format!("{m}_in_flight"), b.1 as f64);
        }
        o.num("ref_over_value_throughput", best[0].0 / best[1].0);
        o.num("ref_over_tonic_throughput", best[0].0 / best[2].0);
        o.num("ref_over_tonic_uds_throughput", best[0].0 / best[3].0);
        peaks.push(o);
    }
    drop(peers);
    drop((by_ref, by_value));
    bp.check()?;
    // The target against gRPC: 7 tiers, 64 KiB.
    let target = rows
        .iter()
        .find(|r| r.text("tiers") == Some("7") && r.text("size") == Some("65536"));
    let ratio = |k: &str| target.and_then(|r| r.text(k)?.parse::<f64>().ok());
    let over = (
        ratio("ref_over_tonic_throughput"),
        ratio("ref_over_tonic_uds_throughput"),
    );
    if let (Some(x), Some(u)) = over {
        say!("by Ref at 7 tiers with 64 KiB: {x:.1}x tonic's throughput over TCP (target: 50x), {u:.1}x over Unix sockets");
    }
    let net_rows = network(a, budget, &pin)?;
    let mut res = Obj::default();
    res.str("benchmark", "chain");
    res.str(
        "method",
        "one client, sequential calls through N tier processes over shm channels; the last tier reads every byte; by Ref = request written to the pool once, Ref forwarded; by value = request inline at every hop; floor = a raw token relayed down and back up through the same processes, each yielding its core while it waits; in_flight = 1, 4 and 16 (full run: 1, 2, 4, 8, 16) client threads, each with its own connection, calling in a closed loop through the same 7 processes serving with async tiers (tonic: as many clients of its chain); in_flight_peak = each mode's best calls per second over those loads, and the load it was reached at, and the ratio measured again in paired rounds (by Ref and by value back to back at those loads, the order alternating; the median of the rounds' ratios, and their range); tonic = the same chain in gRPC (tonic servers in the same tier processes, bytes by value), over loopback TCP and over Unix sockets (uds); switches = context switches of the client's and the tier processes' threads (in the network variant, the memory server's too) per call (per round for the floor), from /proc; network variant: a pool per tier, TCP between them, by Ref = memory-server Refs (ref: the memory server on a host of its own; near, between hosts: on the client's host, placement Local), auto = the way learned per call size (its Refs placed near), again (on loopback) = by value once more in tier services of its own, an A/A control of what an identical way scores, the modes taking turns in 5 rounds per cell (the order rotating)",
    );
    res.obj("machine", &super::machine());
    res.str(
        "pinned",
        if pin.on() {
            "client on the first CPU, tier k on CPU k+1 mod the CPUs"
        } else {
            "no"
        },
    );
    res.arr("rows", &rows);
    res.arr("in_flight", &loaded_rows);
    res.arr("in_flight_peak", &peaks);
    res.arr("network", &net_rows);
    super::write_results(
        a,
        "chain",
        &Chart {
            title: "bench chain: throughput by Ref over by value",
            x: "tiers",
            ys: &["ref_over_value_throughput"],
            by: Some("payload"),
            y_label: "by Ref / by value (x)",
            log_x: false,
            log_y: false,
        },
        &res,
        &rows,
        &[
            "size",
            "tiers",
            "ref_p50_ns",
            "value_p50_ns",
            "ref_calls_per_s",
            "value_calls_per_s",
            "ref_over_value_throughput",
            "relay_floor_p50_ns",
            "ref_p50_over_floor",
            "tonic_calls_per_s",
            "ref_over_tonic_throughput",
            "tonic_uds_calls_per_s",
            "ref_over_tonic_uds_throughput",
            "relay_switches_per_round",
            "ref_switches_per_call",
            "value_switches_per_call",
        ],
    )
}

/// The p50 of a raw relay round (client down through `tiers` and back up,
/// no RPC at all): the scheduling floor of a chain of that many processes
/// on this machine, measured through the same processes.
fn relay_floor(
    path: &std::path::Path,
    tiers: &mut [Peer],
    budget: Duration,
    sw: &Switches,
) -> Result<Cell> {
    let _ = std::fs::remove_file(path);
    let pp = PingPong::create(path)?;
    let last = tiers.len();
    for (i, p) in tiers.iter_mut().enumerate() {
        p.send(&format!("relay {} {} {last}", path.display(), i + 1))?;
    }
    let (down1, up0) = (pp.word(2), pp.word(1));
    let mut v = Vec::new();
    let sw0 = sw.now();
    let t0 = Instant::now();
    let mut k = 0u64;
    while v.len() < 20 || (t0.elapsed() < budget && v.len() < 100_000) {
        k += 1;
        let t = Instant::now();
        down1.store(k, std::sync::atomic::Ordering::Release);
        yield_until(up0, k);
        v.push(t.elapsed().as_nanos() as f64);
    }
    let switches = sw.per(sw0, k);
    down1.store(u64::MAX, std::sync::atomic::Ordering::Release);
    for p in tiers.iter_mut() {
        p.ok_nums()?;
    }
    Ok(Cell {
        p50: percentile(&mut v, 0.5),
        per_s: k as f64 / t0.elapsed().as_secs_f64(),
        switches,
    })
}

/// The chain over TCP between processes in different pools: memory-server
/// Refs vs values, over each link of `--links`.
fn network(a: &BenchArgs, budget: Duration, pin: &super::peer::Pin) -> Result<Vec<Obj>> {
    let mut rows = Vec::new();
    for link in super::hosts::links(a) {
        // Host 0 the client (and, between hosts, a memory server beside
        // it), 1 the memory host, 2.. the tiers.
        if let Some(net) = super::hosts::Net::new(&link, TIERS + 2)? {
            rows.extend(network_over(a, budget, pin, &net)?);
        }
    }
    Ok(rows)
}

/// [`network`] over one link: on loopback, or each process on a host of
/// its own.
fn network_over(
    a: &BenchArgs,
    budget: Duration,
    pin: &super::peer::Pin,
    net: &super::hosts::Net,
) -> Result<Vec<Obj>> {
    let sizes: &[usize] = if a.quick {
        &[64 << 10, 1 << 20]
    } else {
        &[64 << 10, 256 << 10, 1 << 20]
    };
    let tiers: &[usize] = if a.quick { &[1, 7] } else { &[1, 3, 5, 7] };
    let (ms, ms_addr) = net.memserver(1, "512MiB")?;
    // Between hosts, a second memory server on the client's host: the
    // client's Refs are then written there and cross one link, to the
    // tier that reads them (`near`). On loopback every server is near.
    let near = if net.is_loopback() {
        None
    } else {
        Some(net.memserver(0, "512MiB")?)
    };
    let id = std::process::id();
    let small = || PoolConfig {
        size: 16 << 20,
        ..Default::default()
    };
    let mut pools = Vec::new();
    let mut peers = Vec::new();
    for k in 0..TIERS {
        let bp = BenchPool::create(&format!("chainnet{k}"), small())?;
        peers.push(if net.is_loopback() {
            pin.spawn(&bp.path, k)?
        } else {
            net.peer(2 + k, &bp.path)?
        });
        pools.push(bp);
    }
    // Each mode's tiers, last first (each needs the next one's address),
    // and the memory servers of each mode. Auto places its Refs near.
    let mut modes = vec![("ref", ms_addr.clone()), ("value", ms_addr.clone())];
    match &near {
        Some((_, a)) => {
            modes.push(("auto", format!("{a},{ms_addr}")));
            modes.push(("near", a.clone()));
        }
        None => {
            // On loopback, by value once more in tier services of its
            // own: what an identical way scores here (an A/A control).
            modes.push(("auto", ms_addr.clone()));
            modes.push(("again", ms_addr.clone()));
        }
    }
    let mut addrs = vec![vec![String::new(); TIERS]; modes.len()];
    for (m, (mode, servers)) in modes.iter().enumerate() {
        let mut next = "-".to_string();
        for k in (0..TIERS).rev() {
            let port = peers[k].cmd(&format!(
                "chainnet bench/chainnet/{id}/{mode}/{k} {next} {mode} {servers}"
            ))?;
            next = format!(
                "{}:{}",
                net.ip(2 + k)?,
                port.first().copied().unwrap_or(0.0)
            );
            addrs[m][k] = next.clone();
        }
    }
    let cp = BenchPool::create("chainnet-client", small())?;
    // The memory servers' switches count too (by Ref's puts and reads).
    let mut sw = Switches::of(&peers).and(ms.0.id());
    if let Some((p, _)) = &near {
        sw = sw.and(p.0.id());
    }
    let link = net.describe();
    say!("\nnetwork variant over {link}: tiers in separate pools linked by TCP; by Ref = memory-server Refs, by value = inline, auto = learned per call size");
    if near.is_some() {
        say!("Ref: the memory server on a host of its own; near: on the client's host (auto's Refs go there too)");
    } else {
        say!("again: by value once more, in tier services of its own; A/A: again over value, what an identical way scores");
    }
    say!("auto/best: auto's calls/s over the best other mode's; rounds: the same, the median of the five rounds' own ratios");
    let near_cols = if near.is_some() {
        format!(
            " {:>11} {:>12} {:>8}",
            "near p50", "near calls/s", "near/val"
        )
    } else {
        format!(" {:>13} {:>6}", "again calls/s", "A/A")
    };
    say!(
        "{:>9} {:>6} {:>11} {:>11} {:>11} {:>12} {:>12} {:>12} {:>8}{near_cols} {:>10} {:>7}",
        "size",
        "tiers",
        "Ref p50 us",
        "value p50",
        "auto p50",
        "Ref calls/s",
        "value calls/s",
        "auto calls/s",
        "ratio",
        "auto/best",
        "rounds"
    );
    let rows = net.on(0, || {
        let connect = |servers: &str| super::net::memservers(servers, Default::default());
        let by_ref_on = |servers: &str| -> Result<Node> {
            Ok(Node::with_config(
                cp.pool.clone(),
                Config {
                    inline_max: 0,
                    remote_choice: dm_rpc::RemoteChoice::Threshold,
                    ..Default::default()
                },
            )
            .with_memserver(connect(servers)?))
        };
        let mut nodes = vec![
            by_ref_on(&modes[0].1)?,
            Node::with_config(
                cp.pool.clone(),
                Config {
                    inline_max: usize::MAX,
                    ..Default::default()
                },
            ),
            Node::new(cp.pool.clone()).with_memserver(connect(&modes[2].1)?),
        ];
        match &near {
            Some((_, a)) => nodes.push(by_ref_on(a)?),
            None => nodes.push(Node::with_config(
                cp.pool.clone(),
                Config {
                    inline_max: usize::MAX,
                    ..Default::default()
                },
            )),
        }
        let mut rows = Vec::new();
        for &size in sizes {
            let data: Vec<u8> = (0..size).map(|i| (i * 7) as u8).collect();
            let want = super::peer::sum(&[&data]);
            for &t in tiers {
                let mut callers = Vec::new();
                for (m, node) in nodes.iter().enumerate() {
                    let c = node.connect_tcp(&addrs[m][TIERS - t])?;
                    let data = &data;
                    callers.push(Box::new(move || {
                        check(
                            c.call("go", Payload::from_vec(data.clone()))?.to_vec()?,
                            want,
                        )
                    }) as Caller);
                }
                // (Auto learns in its warm-up calls, 16 of them.)
                let (res, rounds) = measure_in_turns(&mut callers, 16, budget, &sw)?;
                // Auto against the ways (not against the A/A control).
                let ways = if near.is_some() { 4 } else { 3 };
                let auto = super::peer::over_best_by_round(&rounds[..ways], 2);
                rows.push(net_row(size, t, &link, &res, auto, near.is_some()));
            }
        }
        // Releases go with the next request or the keep-alive ping
        // (within half a second): let the last ones land.
        std::thread::sleep(Duration::from_millis(600));
        for m in nodes.iter().filter_map(|n| n.memserver()) {
            let u = dm_pool::Dm::usage(m)?;
            if u.refs != 0 {
                bail!("the chain left {} Refs on a memory server", u.refs);
            }
        }
        Ok(rows)
    })?;
    drop(peers);
    Ok(rows)
}

/// Prints a row of the network variant (by Ref, by value, auto, and
/// between hosts by Ref near, on loopback by value again) and returns
/// it for the results. `auto`: auto against the best of the others, the
/// median of the rounds.
fn net_row(size: usize, tiers: usize, link: &str, res: &[Cell], auto: f64, near: bool) -> Obj {
    super::progress::tick(format!("{} through {tiers} tiers", fmt_size(size as u64)));
    let (r, v, a) = (res[0], res[1], res[2]);
    let (n, again) = match res.get(3).copied() {
        Some(c) if near => (Some(c), None),
        c => (None, c),
    };
    let best = res[..2]
        .iter()
        .chain(n.as_ref())
        .map(|c| c.per_s)
        .fold(0.0, f64::max);
    let near_cols = match (n, again) {
        (Some(n), _) => format!(
            " {:>11.1} {:>12.0} {:>7.1}x",
            n.p50 / 1e3,
            n.per_s,
            n.per_s / v.per_s
        ),
        (None, Some(g)) => format!(" {:>13.0} {:>5.2}x", g.per_s, g.per_s / v.per_s),
        (None, None) => String::new(),
    };
    say!(
        "{:>9} {:>6} {:>11.1} {:>11.1} {:>11.1} {:>12.0} {:>12.0} {:>12.0} {:>7.1}x{near_cols} {:>9.2}x {:>6.2}x",
        fmt_size(size as u64),
        tiers,
        r.p50 / 1e3,
        v.p50 / 1e3,
        a.p50 / 1e3,
        r.per_s,
        v.per_s,
        a.per_s,
        r.per_s / v.per_s,
        a.per_s / best,
        auto
    );
    let mut o = Obj::default();
    o.num("size", size as f64);
    o.str("payload", &fmt_size(size as u64));
    o.num("tiers", tiers as f64);
    o.str("link", link);
    o.num("ref_p50_ns", r.p50);
    o.num("value_p50_ns", v.p50);
    o.num("auto_p50_ns", a.p50);
    o.num("ref_calls_per_s", r.per_s);
    o.num("value_calls_per_s", v.per_s);
    o.num("auto_calls_per_s", a.per_s);
    o.num("ref_over_value_throughput", r.per_s / v.per_s);
    o.num("auto_over_best_throughput", a.per_s / best);
    o.num("auto_over_best_median_round", auto);
    o.num("ref_switches_per_call", r.switches);
    o.num("value_switches_per_call", v.switches);
    o.num("auto_switches_per_call", a.switches);
    if let Some(n) = n {
        o.num("near_p50_ns", n.p50);
        o.num("near_calls_per_s", n.per_s);
        o.num("near_over_value_throughput", n.per_s / v.per_s);
        o.num("near_switches_per_call", n.switches);
    }
    if let Some(g) = again {
        o.num("value_again_calls_per_s", g.per_s);
        o.num("value_again_over_value", g.per_s / v.per_s);
    }
    o
}

/// Checks a tier's answer: the checksum of the request.
fn check(got: Vec<u8>, want: u64) -> Result<()> {
    if got != want.to_le_bytes() {
        bail!("tier answer is wrong");
    }
    Ok(())
}

/// Runs `call` `warm` times, then for `budget` (at least `warm` times
/// more): the p50 latency, the calls per second and the context switches
/// per call (`sw`).
fn measure(
    mut call: impl FnMut() -> Result<()>,
    warm: usize,
    budget: Duration,
    sw: &Switches,
) -> Result<Cell> {
    for _ in 0..warm {
        call()?;
    }
    let mut v = Vec::new();
    let sw0 = sw.now();
    let t0 = Instant::now();
    while v.len() < warm || (t0.elapsed() < budget && v.len() < 100_000) {
        let t = Instant::now();
        call()?;
        v.push(t.elapsed().as_nanos() as f64);
    }
    let per_s = v.len() as f64 / t0.elapsed().as_secs_f64();
    let switches = sw.per(sw0, v.len() as u64);
    Ok(Cell {
        p50: percentile(&mut v, 0.5),
        per_s,
        switches,
    })
}

/// [`measure`] for several callers at once: each makes `warm` calls, then
/// they take turns ([`super::peer::in_turns`]) of `budget / TURN_ROUNDS`
/// each. A cell per caller, from all of its turns, and each caller's
/// calls per second in each round.
fn measure_in_turns(
    callers: &mut [Caller],
    warm: usize,
    budget: Duration,
    sw: &Switches,
) -> Result<(Vec<Cell>, Vec<Vec<f64>>)> {
    for c in callers.iter_mut() {
        for _ in 0..warm {
            c()?;
        }
    }
    let n = callers.len();
    let slice = budget / super::peer::TURN_ROUNDS as u32;
    let mut lat = vec![Vec::new(); n];
    let (mut busy, mut switches) = (vec![Duration::ZERO; n], vec![0u64; n]);
    let mut rounds = vec![Vec::new(); n];
    super::peer::in_turns(n, |m| {
        let (c, v) = (&mut callers[m], &mut lat[m]);
        let (sw0, t0, had) = (sw.now(), Instant::now(), v.len());
        while v.len() - had < warm || (t0.elapsed() < slice && v.len() < 100_000) {
            let t = Instant::now();
            c()?;
            v.push(t.elapsed().as_nanos() as f64);
        }
        busy[m] += t0.elapsed();
        switches[m] += sw.now().saturating_sub(sw0);
        rounds[m].push((v.len() - had) as f64 / t0.elapsed().as_secs_f64());
        Ok(())
    })?;
    let cells = (0..n)
        .map(|m| Cell {
            p50: percentile(&mut lat[m], 0.5),
            per_s: lat[m].len() as f64 / busy[m].as_secs_f64(),
            switches: Switches::between(0, switches[m], lat[m].len() as u64),
        })
        .collect();
    Ok((cells, rounds))
}

/// Prints a row (by Ref and by value: p50 ns and calls/s; the relay
/// floor's p50 if measured; tonic over TCP and over a Unix socket if
/// measured; with the floor, the context switches per round or call of
/// the floor, by Ref and by value) and returns it for the results, every
/// cell's switches included.
fn row(size: usize, tiers: usize, res: &[Cell], floor: Option<Cell>) -> Obj {
    super::progress::tick(format!("{} through {tiers} tiers", fmt_size(size as u64)));
    let (r, v) = (res[0], res[1]);
    let ratio = r.per_s / v.per_s;
    let mut line = format!(
        "{:>9} {:>6} {:>12.1} {:>12.1} {:>12.0} {:>12.0} {:>7.1}x",
        fmt_size(size as u64),
        tiers,
        r.p50 / 1e3,
        v.p50 / 1e3,
        r.per_s,
        v.per_s,
        ratio
    );
    let mut o = Obj::default();
    o.num("size", size as f64);
    o.str("payload", &fmt_size(size as u64));
    o.num("tiers", tiers as f64);
    o.num("ref_p50_ns", r.p50);
    o.num("value_p50_ns", v.p50);
    o.num("ref_calls_per_s", r.per_s);
    o.num("value_calls_per_s", v.per_s);
    o.num("ref_over_value_throughput", ratio);
    o.num("ref_switches_per_call", r.switches);
    o.num("value_switches_per_call", v.switches);
    if let Some(f) = floor {
        line += &format!(" {:>9.1} {:>8.1}x", f.p50 / 1e3, r.p50 / f.p50);
        o.num("relay_floor_p50_ns", f.p50);
        o.num("ref_p50_over_floor", r.p50 / f.p50);
        o.num("relay_switches_per_round", f.switches);
    }
    for (i, (name, width)) in [("tonic", 12), ("tonic_uds", 11)].into_iter().enumerate() {
        if let Some(t) = res.get(2 + i) {
            line += &format!(" {:>width$.0} {:>8.1}x", t.per_s, r.per_s / t.per_s);
            o.num(&format!("{name}_p50_ns"), t.p50);
            o.num(&format!("{name}_calls_per_s"), t.per_s);
            o.num(&format!("ref_over_{name}_throughput"), r.per_s / t.per_s);
            o.num(&format!("{name}_switches_per_call"), t.switches);
        }
    }
    if let Some(f) = floor {
        let sw = format!("{:.0}/{:.0}/{:.0}", f.switches, r.switches, v.switches);
        line += &format!(" {sw:>16}");
    }
    say!("{line}");
    o
}

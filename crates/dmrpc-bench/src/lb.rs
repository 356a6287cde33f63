//! `dmrpc bench lb` — the load-balancer experiment: clients send requests
//! of 4–32 KiB to a load balancer (its own process), which forwards each,
//! round robin, to one of two workers (processes) that read every byte.
//!
//! Two modes in the same run: **by Ref** (requests built in the pool; the
//! balancer forwards the Ref) and **by value** (requests inline; the
//! balancer copies each out of one ring and into another). Reported:
//! throughput with two client threads, and the payload bytes the balancer
//! process copied per request (from its own transport counters). And the
//! same three processes serving gRPC (tonic over loopback TCP, by value):
//! a tonic balancer forwarding round robin to two tonic workers. And
//! client-side balancing: the two workers also serve as replicas of one
//! name, which the clients call directly with a balanced client, by Ref
//! (no balancer hop).

use super::peer::{BenchPool, Peer};
use super::plot::Chart;
use super::serde_like::Obj;
use super::BenchArgs;
use crate::say;
use anyhow::{bail, Result};
use dm_pool::PoolConfig;
use dm_rpc::{Config, Node, Payload};
use dmrpc::fmt_size;
use std::time::{Duration, Instant};

const CLIENTS: usize = 2;

fn lb_copied(node: &Node, lb: &str) -> Result<u64> {
    let v = node
        .connect(lb)?
        .call("stats", Payload::empty())?
        .to_vec()?;
    let w = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&v[i * 8..i * 8 + 8]);
        u64::from_le_bytes(b)
    };
    if v.len() != 32 {
        bail!("bad stats answer");
    }
    Ok(w(0) + w(1))
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let budget = Duration::from_millis(if a.quick { 300 } else { 2000 });
    let id = std::process::id();
    let bp = BenchPool::create(
        "lb",
        PoolConfig {
            size: 512 << 20,
            channels: Some(32),
            ..Default::default()
        },
    )?;
    let (pool, path) = (&bp.pool, &bp.path);
    let base = format!("bench/lb/{id}");
    let mut peers = Vec::new();
    for k in 0..2 {
        let mut p = Peer::spawn(path, &[])?;
        for mode in ["ref", "value"] {
            p.cmd(&format!("chain {base}/{mode}/w{k} - {mode}"))?;
        }
        p.cmd(&format!("replica {base}/ref/workers ref"))?;
        peers.push(p);
    }
    let mut lb_peer = Peer::spawn(path, &[])?;
    for mode in ["ref", "value"] {
        lb_peer.cmd(&format!(
            "lb {base}/{mode}/lb {base}/{mode}/w0,{base}/{mode}/w1 {mode}"
        ))?;
    }
    // The same in gRPC: tonic workers in the worker processes, a tonic
    // balancer in the balancer's.
    let workers = peers
        .iter_mut()
        .map(|p| p.cmd_text("grpc tcp -"))
        .collect::<Result<Vec<_>>>()?;
    let grpc_lb = lb_peer.cmd_text(&format!("grpc tcp {}", workers.join(",")))?;
    say!("bench lb: {CLIENTS} client threads -> load balancer -> 2 workers (3 processes besides this one)");
    say!(
        "{:>8} {:>13} {:>13} {:>8} {:>16} {:>16} {:>13} {:>9} {:>15} {:>9}",
        "size",
        "Ref calls/s",
        "value calls/s",
        "ratio",
        "LB copies (Ref)",
        "LB copies (value)",
        "tonic calls/s",
        "Ref/tonic",
        "no-LB calls/s",
        "no-LB/Ref"
    );
    let mut rows = Vec::new();
    super::progress::start("lb", 4);
    for size in [4usize << 10, 8 << 10, 16 << 10, 32 << 10] {
        let data: Vec<u8> = (0..size).map(|i| i as u8).collect();
        let mut res = Vec::new();
        for mode in ["ref", "value"] {
            let node = Node::with_config(
                pool.clone(),
                Config {
                    inline_max: if mode == "ref" { 0 } else { usize::MAX },
                    ..Default::default()
                },
            );
            let lb = format!("{base}/{mode}/lb");
            let before = lb_copied(&node, &lb)?;
            let (rate, n) = closed_loop(
                mode,
                budget,
                || Ok(node.connect(&lb)?),
                |c| {
                    c.call("go", super::peer::request(pool, mode, &data)?)?;
                    Ok(())
                },
            )?;
            let copied = (lb_copied(&node, &lb)? - before) as f64 / n as f64;
            res.push((rate, copied));
        }
        // Client-side balancing over the workers as replicas, by Ref.
        let node = Node::with_config(
            pool.clone(),
            Config {
                inline_max: 0,
                ..Default::default()
            },
        );
        let replicas = format!("{base}/ref/workers");
        let (direct, _) = closed_loop(
            "balanced",
            budget,
            || Ok(node.connect_balanced(&replicas)?),
            |c| {
                c.call("go", super::peer::request(pool, "ref", &data)?)?;
                Ok(())
            },
        )?;
        let bytes = bytes::Bytes::from(data.clone());
        let (tonic, _) = closed_loop(
            "tonic",
            budget,
            || super::grpc::Client::connect(&grpc_lb),
            |g| {
                g.go(bytes.clone())?;
                Ok(())
            },
        )?;
        let ratio = res[0].0 / res[1].0;
        say!(
            "{:>8} {:>13.0} {:>13.0} {:>7.1}x {:>14.0} B {:>14.0} B {:>13.0} {:>8.1}x {:>15.0} {:>8.1}x",
            fmt_size(size as u64),
            res[0].0,
            res[1].0,
            ratio,
            res[0].1,
            res[1].1,
            tonic,
            res[0].0 / tonic,
            direct,
            direct / res[0].0
        );
        let mut o = Obj::default();
        o.num("size", size as f64);
        o.num("ref_calls_per_s", res[0].0);
        o.num("value_calls_per_s", res[1].0);
        o.num("ref_over_value", ratio);
        o.num("lb_bytes_copied_per_request_ref", res[0].1);
        o.num("lb_bytes_copied_per_request_value", res[1].1);
        o.num("tonic_calls_per_s", tonic);
        o.num("ref_over_tonic", res[0].0 / tonic);
        o.num("balanced_calls_per_s", direct);
        o.num("balanced_over_ref", direct / res[0].0);
        rows.push(o);
        super::progress::tick(format!("{size} bytes"));
    }
    drop(lb_peer);
    drop(peers);
    bp.check()?;
    let mut res = Obj::default();
    res.str("benchmark", "lb");
    res.str("method", "2 client threads here; load balancer and 2 workers each in its own process over shm channels; LB copies = inline payload bytes through the LB's transports per request; tonic = the same processes serving gRPC over loopback TCP, the balancer forwarding by value round robin; balanced = the 2 workers as replicas of one name, called directly by Ref with a balanced client (no balancer)");
    res.obj("machine", &super::machine());
    res.arr("rows", &rows);
    super::write_results(
        a,
        "lb",
        &Chart {
            title: "bench lb: client -> load balancer -> 2 workers",
            x: "size",
            ys: &[
                "ref_calls_per_s",
                "value_calls_per_s",
                "tonic_calls_per_s",
                "balanced_calls_per_s",
            ],
            by: None,
            y_label: "calls/s",
            log_x: true,
            log_y: false,
        },
        &res,
        &rows,
        &[
            "size",
            "ref_calls_per_s",
            "value_calls_per_s",
            "ref_over_value",
            "lb_bytes_copied_per_request_ref",
            "lb_bytes_copied_per_request_value",
            "tonic_calls_per_s",
            "ref_over_tonic",
            "balanced_calls_per_s",
            "balanced_over_ref",
        ],
    )
}

/// Calls per second, and calls, of `CLIENTS` threads each in a closed loop
/// for `budget`: each connects with `connect`, then calls `call` over and
/// over.
fn closed_loop<C>(
    what: &str,
    budget: Duration,
    connect: impl Fn() -> Result<C> + Sync,
    call: impl Fn(&mut C) -> Result<()> + Sync,
) -> Result<(f64, usize)> {
    let t0 = Instant::now();
    let calls: Vec<Result<usize>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..CLIENTS)
            .map(|_| {
                let (connect, call) = (&connect, &call);
                s.spawn(move || -> Result<usize> {
                    let mut c = connect()?;
                    let mut n = 0;
                    while t0.elapsed() < budget {
                        call(&mut c)?;
                        n += 1;
                    }
                    Ok(n)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| bail!("a client thread panicked"))
            })
            .collect()
    });
    let wall = t0.elapsed().as_secs_f64();
    let mut n = 0;
    for c in calls {
        n += c?;
    }
    if n == 0 {
        bail!("{what}: no call completed");
    }
    Ok((n as f64 / wall, n))
}

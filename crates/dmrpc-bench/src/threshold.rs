//! `dmrpc bench threshold` — where passing an argument by Ref starts to beat
//! copying it inline: the measurement behind `DEFAULT_INLINE_MAX`.
//!
//! For each size, a call whose callee (another process) reads every byte
//! of the argument and answers 8 bytes, sent two ways in the same run:
//! * **inline**: the bytes travel in the frame (copied into the ring and out);
//! * **by Ref**: the bytes are written to a pool buffer, a Ref travels, the
//!   callee maps it (no copy) and the caller releases it after the answer.
//!
//! Both start from the same bytes in the caller's memory, so both pay one
//! copy of the source (into the frame's vector, or into the pool buffer).
//! The crossover is the smallest size from which Ref is faster at p50.

use super::peer::{percentile, BenchPool, Peer};
use super::plot::Chart;
use super::serde_like::Obj;
use super::BenchArgs;
use crate::say;
use anyhow::{bail, Result};
use dm_pool::PoolConfig;
use dm_rpc::{Config, Node, Payload};
use dmrpc::fmt_size;
use std::time::Instant;

fn measure(node: &Node, name: &str, data: &[u8], n: usize, by_ref: bool) -> Result<f64> {
    let c = node.connect(name)?;
    let call = || -> Result<()> {
        let p = if by_ref {
            let mut b = node.pool().alloc(data.len() as u64)?;
            b.write(0, data)?;
            Payload::from_buffer(b)
        } else {
            Payload::from_vec(data.to_vec())
        };
        let a = c.call("sum", p)?;
        if a.len() != 8 {
            bail!("bad answer");
        }
        Ok(())
    };
    for _ in 0..(n / 10).max(20) {
        call()?;
    }
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        call()?;
        v.push(t.elapsed().as_nanos() as f64);
    }
    Ok(percentile(&mut v, 0.5))
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let n = if a.quick { 2_000 } else { 20_000 };
    let id = std::process::id();
    let bp = BenchPool::create(
        "threshold",
        PoolConfig {
            size: 512 << 20,
            channels: Some(8),
            ring_size: 4 << 20,
            ..Default::default()
        },
    )?;
    let (pool, path) = (&bp.pool, &bp.path);
    let mut peer = Peer::spawn(path, &[])?;
    let name = format!("bench/threshold/{id}");
    peer.cmd(&format!("serve {name} default"))?;
    // Inline as far as the ring allows / always by Ref.
    let inline = Node::with_config(
        pool.clone(),
        Config {
            inline_max: usize::MAX,
            ..Default::default()
        },
    );
    let by_ref = Node::with_config(
        pool.clone(),
        Config {
            inline_max: 0,
            ..Default::default()
        },
    );
    say!("bench threshold: an argument the callee reads, inline vs by Ref (p50, {n} calls each)");
    say!(
        "{:>9} {:>12} {:>12} {:>12}",
        "size",
        "inline us",
        "by Ref us",
        "inline/Ref"
    );
    let mut rows = Vec::new();
    let mut crossover = None;
    super::progress::start("threshold", 10);
    for size in [
        256usize,
        1 << 10,
        4 << 10,
        16 << 10,
        32 << 10,
        64 << 10,
        96 << 10,
        128 << 10,
        192 << 10,
        256 << 10,
    ] {
        let data: Vec<u8> = (0..size).map(|i| i as u8).collect();
        let t_in = measure(&inline, &name, &data, n, false)?;
        let t_ref = measure(&by_ref, &name, &data, n, true)?;
        let ratio = t_in / t_ref;
        if ratio > 1.0 && crossover.is_none() {
            crossover = Some(size);
        } else if ratio <= 1.0 {
            crossover = None;
        }
        say!(
            "{:>9} {:>12.2} {:>12.2} {:>11.2}x",
            fmt_size(size as u64),
            t_in / 1e3,
            t_ref / 1e3,
            ratio
        );
        let mut o = Obj::default();
        o.num("size", size as f64);
        o.num("inline_p50_ns", t_in);
        o.num("ref_p50_ns", t_ref);
        o.num("inline_over_ref", ratio);
        rows.push(o);
        super::progress::tick(fmt_size(size as u64));
    }
    peer.cmd("unserve")?;
    drop(peer);
    match crossover {
        Some(s) => say!(
            "crossover: by Ref is faster from {} on (default threshold: {})",
            fmt_size(s as u64),
            fmt_size(dm_rpc::DEFAULT_INLINE_MAX as u64)
        ),
        None => say!("no crossover up to 256 KiB in this run"),
    }
    bp.check()?;
    let mut res = Obj::default();
    res.str("benchmark", "threshold");
    res.str(
        "method",
        "p50 of a call whose callee (another process) reads every byte; inline = bytes in the frame; by Ref = written to a pool buffer, Ref mapped by the callee; both start from the caller's bytes",
    );
    res.obj("machine", &super::machine());
    res.num("crossover_bytes", crossover.map_or(f64::NAN, |s| s as f64));
    res.num("default_inline_max", dm_rpc::DEFAULT_INLINE_MAX as f64);
    res.arr("rows", &rows);
    super::write_results(
        a,
        "threshold",
        &Chart {
            title: "bench threshold: an argument inline vs by Ref",
            x: "size",
            ys: &["inline_p50_ns", "ref_p50_ns"],
            by: None,
            y_label: "ns (p50)",
            log_x: true,
            log_y: true,
        },
        &res,
        &rows,
        &["size", "inline_p50_ns", "ref_p50_ns", "inline_over_ref"],
    )
}

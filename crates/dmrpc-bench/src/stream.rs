//! `dmrpc bench stream` — a stream of items against one call per item.
//!
//! A peer process serves items of a given size two ways, measured in the
//! same run over the same shared-memory channel:
//! * **stream**: one streaming call of N items (`call_stream`, the default
//!   window of 16): the server sends while the caller reads, the caller
//!   granting more as it goes; from a blocking handler, and from an async
//!   one (whose items its dispatcher sends between polls of its future);
//! * **calls**: N unary calls, each answered with one item (a round trip
//!   per item).
//!
//! The caller reads every byte of every item (a checksum). Items up to the
//! inline threshold travel inline; larger ones as Refs the peer makes for
//! the caller (written by the peer, mapped by the caller). Reported: items
//! per second and bytes per second of each, and their ratio.

use super::peer::{BenchPool, Peer};
use super::plot::Chart;
use super::serde_like::Obj;
use super::BenchArgs;
use crate::say;
use anyhow::{bail, Result};
use dm_pool::PoolConfig;
use dm_rpc::{Node, Payload, RpcError};
use dmrpc::fmt_size;
use std::time::Instant;

/// The argument of the peer's `items`: N and the size.
pub(crate) fn items_arg(p: &Payload) -> Result<(u64, usize), RpcError> {
    let b = p.to_vec()?;
    let word = |i: usize| {
        b.get(i * 8..i * 8 + 8)
            .and_then(|w| w.try_into().ok())
            .map(u64::from_le_bytes)
            .ok_or_else(|| RpcError::invalid_argument("u64 N | u64 SIZE"))
    };
    Ok((word(0)?, word(1)? as usize))
}

/// An item of `size` bytes, made as a server makes its answer: inline, or
/// written into the pool when it will travel by Ref.
pub(crate) fn item_of(node: &Node, size: usize) -> Result<Payload, RpcError> {
    if size > node.config().inline_max {
        let mut b = node.pool().alloc(size as u64)?;
        b.write(0, &vec![size as u8; size])?;
        Ok(Payload::from_buffer(b))
    } else {
        Ok(Payload::from_vec(vec![size as u8; size]))
    }
}

/// The peer's `item`: one item of the u64 size in `p`.
pub(crate) fn item(node: &Node, p: &Payload) -> Result<Payload, RpcError> {
    let b = p.to_vec()?;
    let size = b
        .get(..8)
        .and_then(|w| w.try_into().ok())
        .map(u64::from_le_bytes)
        .ok_or_else(|| RpcError::invalid_argument("u64 SIZE"))?;
    item_of(node, size as usize)
}

/// Reads every byte of `p`; checks it is `size` bytes.
fn consume(p: &Payload, size: usize) -> Result<u64> {
    let segs = p.segments()?;
    let n: usize = segs.iter().map(|s| s.len()).sum();
    if n != size {
        bail!("an item of {n} bytes, not {size}");
    }
    Ok(segs
        .iter()
        .map(|s| s.iter().map(|&b| b as u64).sum::<u64>())
        .sum())
}

/// Seconds for `n` items of `size` by one stream of streaming method
/// `method`.
fn one_stream(c: &dm_rpc::Client, method: &str, n: u64, size: usize) -> Result<f64> {
    let mut arg = n.to_le_bytes().to_vec();
    arg.extend_from_slice(&(size as u64).to_le_bytes());
    let t = Instant::now();
    let mut got = 0;
    for p in c.call_stream(method, arg)? {
        consume(&p?, size)?;
        got += 1;
    }
    if got != n {
        bail!("the stream of {method} gave {got} items of {n}");
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Seconds for `n` items of `size` by one stream (from the blocking
/// handler, then from the async one), and by `n` calls.
fn measure(node: &Node, name: &str, n: u64, size: usize) -> Result<(f64, f64, f64)> {
    let c = node.connect(name)?;
    let one = (size as u64).to_le_bytes().to_vec();
    // Warm-up of each.
    for m in ["items", "items_async"] {
        one_stream(&c, m, 4, size)?;
    }
    for _ in 0..4 {
        consume(&c.call("item", one.clone())?, size)?;
    }
    let stream = one_stream(&c, "items", n, size)?;
    let async_stream = one_stream(&c, "items_async", n, size)?;
    let t = Instant::now();
    for _ in 0..n {
        consume(&c.call("item", one.clone())?, size)?;
    }
    Ok((stream, async_stream, t.elapsed().as_secs_f64()))
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let id = std::process::id();
    let bp = BenchPool::create(
        "stream",
        PoolConfig {
            size: 1 << 30,
            channels: Some(8),
            ..Default::default()
        },
    )?;
    let (pool, path) = (&bp.pool, &bp.path);
    let mut peer = Peer::spawn(path, &[])?;
    let name = format!("bench/stream/{id}");
    peer.cmd(&format!("serve {name} default"))?;
    let node = Node::new(pool.clone());
    let sizes: &[usize] = &[64, 4 << 10, 64 << 10, 256 << 10, 1 << 20];
    say!(
        "bench stream: N items read from one stream vs one call per item (shm, the default window)"
    );
    say!(
        "{:>9} {:>7} {:>14} {:>14} {:>14} {:>12} {:>9}",
        "size",
        "items",
        "stream items/s",
        "async items/s",
        "calls items/s",
        "stream MB/s",
        "ratio"
    );
    let mut rows = Vec::new();
    super::progress::start("stream", sizes.len() as u64);
    for &size in sizes {
        let budget: u64 = if a.quick { 4 << 20 } else { 256 << 20 };
        let n = (budget / size as u64).clamp(50, if a.quick { 2_000 } else { 100_000 });
        let (ts, ta, tc) = measure(&node, &name, n, size)?;
        let (s_rate, a_rate, c_rate) = (n as f64 / ts, n as f64 / ta, n as f64 / tc);
        let ratio = s_rate / c_rate;
        say!(
            "{:>9} {:>7} {:>14.0} {:>14.0} {:>14.0} {:>12.1} {:>8.2}x",
            fmt_size(size as u64),
            n,
            s_rate,
            a_rate,
            c_rate,
            s_rate * size as f64 / 1e6,
            ratio
        );
        let mut o = Obj::default();
        o.num("size", size as f64);
        o.num("items", n as f64);
        o.num("stream_items_per_s", s_rate);
        o.num("async_stream_items_per_s", a_rate);
        o.num("calls_items_per_s", c_rate);
        o.num("stream_over_calls", ratio);
        rows.push(o);
        super::progress::tick(fmt_size(size as u64));
    }
    peer.cmd("unserve")?;
    drop(peer);
    drop(node);
    bp.check()?;
    let mut res = Obj::default();
    res.str("benchmark", "stream");
    res.str(
        "method",
        "items per second read by a caller (every byte) from one streaming call of N items (default window; from a blocking handler, and from an async one) vs N unary calls of one item each, same peer process and shm channel; items inline up to the threshold, else Refs made by the peer; ratio: the blocking handler's stream over the calls",
    );
    res.obj("machine", &super::machine());
    res.arr("rows", &rows);
    super::write_results(
        a,
        "stream",
        &Chart {
            title: "bench stream: one stream vs one call per item",
            x: "size",
            ys: &[
                "stream_items_per_s",
                "async_stream_items_per_s",
                "calls_items_per_s",
            ],
            by: None,
            y_label: "items/s",
            log_x: true,
            log_y: true,
        },
        &res,
        &rows,
        &[
            "size",
            "items",
            "stream_items_per_s",
            "async_stream_items_per_s",
            "calls_items_per_s",
            "stream_over_calls",
        ],
    )
}

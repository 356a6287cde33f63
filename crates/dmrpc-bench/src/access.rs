//! `dmrpc bench access` — the DirectCXL experiment: the latency
//! distribution of random 64-byte reads from disaggregated memory, by each
//! way dmrpc reaches it, next to local memory (the floor) in the same run.
//!
//! - **local**: a `Vec` of this process's memory;
//! - **pool load/store**: a mapped pool buffer (`MappedBuffer`), read with
//!   plain loads — what CXL memory looks like to a program;
//! - **pool read()**: the explicit API (`Buffer::read`: the page lookup in
//!   software, then a copy);
//! - **memory server**: `MemBuffer::read` over loopback TCP (one round
//!   trip per read).
//!
//! Each read is at a random 64-byte-aligned offset of a 128 MiB region (far
//! beyond the caches; 16 MiB with `--quick`), all pages backed beforehand.
//! Reads are timed one by one with the TSC (`rdtsc` fenced by `lfence`,
//! converted with a frequency measured against the monotonic clock), minus
//! the timer's own cost (measured in the same run). The table gives
//! percentiles; the plot is the CDF.

use super::net::start_memserver;
use super::peer::{percentile, BenchPool};
use super::plot::Chart;
use super::serde_like::Obj;
use super::BenchArgs;
use crate::say;
use anyhow::Result;
use dm_memserver::MemPool;
use dm_pool::{Dm, DmBuffer, MappedBuffer, PoolConfig};
use std::time::{Duration, Instant};

const LINE: usize = 64;

/// Time-stamp counter reads, fenced so the timed load cannot move out.
#[cfg(target_arch = "x86_64")]
fn stamp() -> u64 {
    use std::arch::x86_64::{_mm_lfence, _rdtsc};
    // SAFETY: lfence and rdtsc are available on every x86_64 CPU.
    unsafe {
        _mm_lfence();
        let t = _rdtsc();
        _mm_lfence();
        t
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn stamp() -> u64 {
    use std::sync::OnceLock;
    static T0: OnceLock<Instant> = OnceLock::new();
    T0.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Stamps per nanosecond, measured over 50 ms.
fn stamps_per_ns() -> f64 {
    let (t0, s0) = (Instant::now(), stamp());
    while t0.elapsed() < Duration::from_millis(50) {
        std::hint::spin_loop();
    }
    (stamp() - s0) as f64 / t0.elapsed().as_nanos() as f64
}

/// A small xorshift generator: the offsets of the reads.
struct Offsets(u64, usize);

impl Offsets {
    fn next(&mut self) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 as usize % (self.1 / LINE)) * LINE
    }
}

/// Latencies (ns) of `n` reads by `read(offset)`, less the timer's cost.
fn sample(
    n: usize,
    len: usize,
    per_ns: f64,
    timer: f64,
    mut read: impl FnMut(usize) -> Result<u64>,
) -> Result<Vec<f64>> {
    let mut offs = Offsets(0x9E37_79B9_7F4A_7C15, len);
    let mut sink = 0u64;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let off = offs.next();
        let t = stamp();
        sink = sink.wrapping_add(read(off)?);
        let dt = stamp() - t;
        v.push((dt as f64 / per_ns - timer).max(0.0));
    }
    std::hint::black_box(sink);
    Ok(v)
}

/// Sums a 64-byte line with plain loads (volatile: each one happens).
fn load_line(p: *const u8) -> u64 {
    let mut s = 0u64;
    for k in 0..LINE / 8 {
        // SAFETY: callers pass the start of 64 readable bytes, 8-aligned.
        s = s.wrapping_add(unsafe { std::ptr::read_volatile((p as *const u64).add(k)) });
    }
    s
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let len: usize = if a.quick { 16 << 20 } else { 128 << 20 };
    let n = if a.quick { 20_000 } else { 500_000 };
    let n_net = if a.quick { 500 } else { 5_000 };
    super::progress::start("access", 5);
    let per_ns = stamps_per_ns();
    // The timer's own cost: two fenced stamps around nothing.
    let timer = {
        let mut v = sample(100_000, 4096, per_ns, 0.0, |_| Ok(0))?;
        percentile(&mut v, 0.5)
    };
    super::progress::tick("local memory");
    let fill = |i: usize| (i as u8).wrapping_mul(31);

    let local: Vec<u8> = (0..len).map(fill).collect();
    let mut all = vec![(
        "local",
        sample(n, len, per_ns, timer, |o| {
            Ok(load_line(local[o..].as_ptr()))
        })?,
    )];
    drop(local);
    super::progress::tick("pool load/store");

    let bp = BenchPool::create(
        "access",
        PoolConfig {
            size: (len as u64) * 2 + (64 << 20),
            ..Default::default()
        },
    )?;
    let mut m = MappedBuffer::alloc(&bp.pool, len as u64)?;
    for (i, b) in m.as_mut_slice().iter_mut().enumerate() {
        *b = fill(i);
    }
    let s = m.as_slice();
    all.push((
        "pool load/store",
        sample(n, len, per_ns, timer, |o| Ok(load_line(s[o..].as_ptr())))?,
    ));
    super::progress::tick("pool read()");
    let b = m.buffer();
    let mut line = [0u8; LINE];
    all.push((
        "pool read()",
        sample(n, len, per_ns, timer, |o| {
            b.read(o as u64, &mut line)?;
            Ok(line[0] as u64)
        })?,
    ));
    drop(m);
    bp.check()?;
    super::progress::tick("memory server");

    let (_ms, addr) = start_memserver(if a.quick { "64MiB" } else { "512MiB" })?;
    let mp = MemPool::connect(&[&addr])?;
    let net_len = len.min(64 << 20);
    let mut mb = mp.alloc(net_len as u64)?;
    let chunk: Vec<u8> = (0..1 << 20).map(fill).collect();
    for off in (0..net_len).step_by(chunk.len()) {
        mb.write(off as u64, &chunk[..chunk.len().min(net_len - off)])?;
    }
    all.push((
        "memory server",
        sample(n_net, net_len, per_ns, timer, |o| {
            mb.read(o as u64, &mut line)?;
            Ok(line[0] as u64)
        })?,
    ));
    mp.free(mb)?;
    super::progress::tick("done");

    say!(
        "bench access: random 64 B reads ({} region; timer cost {timer:.0} ns subtracted)",
        dmrpc::fmt_size(len as u64)
    );
    say!(
        "{:<16} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10}",
        "method",
        "samples",
        "p50 ns",
        "p90 ns",
        "p99 ns",
        "p99.9 ns",
        "p50/local"
    );
    let mut rows = Vec::new();
    let mut summary = Vec::new();
    let mut local_p50 = f64::NAN;
    for (name, v) in &mut all {
        let q = |v: &mut [f64], p: f64| percentile(v, p);
        let (p50, p90, p99, p999) = (q(v, 0.5), q(v, 0.9), q(v, 0.99), q(v, 0.999));
        if *name == "local" {
            local_p50 = p50;
        }
        say!(
            "{:<16} {:>9} {:>9.0} {:>9.0} {:>9.0} {:>10.0} {:>9.1}x",
            name,
            v.len(),
            p50,
            p90,
            p99,
            p999,
            p50 / local_p50
        );
        let mut o = Obj::default();
        o.str("method", name);
        o.num("samples", v.len() as f64);
        o.num("p50_ns", p50);
        o.num("p90_ns", p90);
        o.num("p99_ns", p99);
        o.num("p999_ns", p999);
        o.num("p50_over_local", p50 / local_p50);
        summary.push(o);
        // The CDF: the latency at each percent, and at 99.9%.
        v.sort_by(|a, b| a.total_cmp(b));
        for k in (1..=100).map(|k| k as f64 / 100.0).chain([0.999]) {
            let i = ((v.len() as f64 * k) as usize).min(v.len() - 1);
            let mut r = Obj::default();
            r.str("method", name);
            r.num("fraction", k);
            r.num("latency_ns", v[i].max(1.0));
            rows.push(r);
        }
    }
    let mut res = Obj::default();
    res.str("benchmark", "access");
    res.str(
        "method",
        "DirectCXL's access experiment: random 64-byte reads, each timed with fenced rdtsc minus the timer's cost, over a region far larger than the caches: local memory, a mapped pool buffer (loads), the explicit pool read(), a memory server read over loopback TCP",
    );
    res.obj("machine", &super::machine());
    res.num("region_bytes", len as f64);
    res.num("timer_ns", timer);
    res.arr("summary", &summary);
    res.arr("cdf", &rows);
    super::write_results(
        a,
        "access",
        &Chart {
            title: "bench access: random 64 B reads (CDF)",
            x: "latency_ns",
            ys: &["fraction"],
            by: Some("method"),
            y_label: "fraction of reads",
            log_x: true,
            log_y: false,
        },
        &res,
        &rows,
        &["method", "fraction", "latency_ns"],
    )
}

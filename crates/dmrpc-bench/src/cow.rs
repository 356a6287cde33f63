//! `dmrpc bench cow` — DmRPC's create_ref experiment on the pool backend.
//!
//! For each buffer size, in one run:
//! * **copy** (the baseline): `memcpy` of the buffer into a pre-faulted
//!   private buffer — the cheapest possible copy, so the ratio is conservative;
//! * **share**: `create_ref` here + `map_ref` and unmap in *another process*
//!   (timed inside that process) + `release_ref` here. The control messages
//!   between the two processes are not counted: they are the RPC layer's
//!   cost, measured by `bench rtt`.
//!
//! Then the same on the network backend (a memory server process):
//! [`network`].
//!
//! Also: the cost of one copy-on-write (explicit write, and a store through
//! a mapped buffer), and alloc/write/free throughput with 1 and 2 processes.

use super::peer::{hex, median, Peer, TempFile};
use super::plot::Chart;
use super::serde_like::Obj;
use super::BenchArgs;
use crate::say;
use anyhow::{bail, Result};
use dm_memserver::MemPool;
use dm_pool::{AttachOptions, Dm, DmBuffer, MappedBuffer, Pool, PoolConfig, Ref};
use dmrpc::fmt_size;
use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The peer's `map REF` command: maps the Ref (timed), touches it, unmaps
/// (timed). Answers `ok MAP_NS FREE_NS`.
pub(super) fn peer_map(pool: &Pool, hex_ref: &str) -> Result<String> {
    let b: Vec<u8> = (0..hex_ref.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex_ref.get(i..i + 2).unwrap_or("zz"), 16))
        .collect::<Result<_, _>>()?;
    let r = Ref::from_bytes(&b)?;
    let t = Instant::now();
    let m = pool.map_ref(&r)?;
    let map_ns = t.elapsed().as_nanos();
    black_box(m.segments(0, 1)?);
    let t = Instant::now();
    drop(m);
    Ok(format!("ok {map_ns} {}", t.elapsed().as_nanos()))
}

/// The peer's `alloc N` command. Answers `ok NS`.
pub(super) fn peer_alloc(pool: &Pool, n: u64) -> Result<String> {
    let t = Instant::now();
    alloc_loop(pool, n)?;
    Ok(format!("ok {}", t.elapsed().as_nanos()))
}

fn alloc_loop(pool: &Pool, n: u64) -> Result<()> {
    for i in 0..n {
        let mut b = pool.alloc(4096)?;
        b.write(0, &[i as u8])?;
        pool.free(b)?;
    }
    Ok(())
}

/// Sharing `src`: create_ref here, map_ref + unmap in the peer, release
/// here, for `budget` (at least 5 times): each time's create_ref, map_ref
/// and whole round, in ns.
fn share_loop(
    pool: &Pool,
    peer: &mut Peer,
    src: &dm_pool::Buffer,
    budget: Duration,
) -> Result<(Vec<f64>, Vec<f64>, Vec<f64>)> {
    let (mut create, mut map, mut total) = (Vec::new(), Vec::new(), Vec::new());
    let t_end = Instant::now() + budget;
    while create.len() < 5 || (Instant::now() < t_end && create.len() < 5_000) {
        let t = Instant::now();
        let r = src.share()?;
        let c = t.elapsed().as_nanos() as f64;
        peer.send(&format!("map {}", hex(&r.to_bytes())))?;
        let nums = peer.ok_nums()?;
        let t = Instant::now();
        pool.release_ref(&r)?;
        let rel = t.elapsed().as_nanos() as f64;
        let (m, f) = (
            nums.first().copied().unwrap_or(f64::NAN),
            nums.get(1).copied().unwrap_or(f64::NAN),
        );
        create.push(c);
        map.push(m);
        total.push(c + m + f + rel);
    }
    Ok((create, map, total))
}

/// The same sharing on a pool with quotas (a process quota, and both
/// processes in one tenant) against the pool without, alternated three
/// times per size: what quota accounting costs. Rows of medians.
fn quota_cost(pool: &Pool, peer: &mut Peer, budget: Duration, sizes: &[u64]) -> Result<Vec<Obj>> {
    let path = PathBuf::from(format!(
        "/dev/shm/dmrpc-bench-cow-quota-{}.pool",
        std::process::id()
    ));
    let _guard = TempFile(path.clone());
    let size = 256 << 20;
    Pool::create(
        &path,
        &PoolConfig {
            size,
            name: "bench-cow-quota".into(),
            process_quota: Some(size),
            tenants: vec![("bench".into(), size)],
            ..Default::default()
        },
    )?;
    let quota = Pool::open(
        &path,
        AttachOptions {
            prefault: true,
            batch: 1024,
            tenant: Some("bench".into()),
            ..Default::default()
        },
    )?;
    let mut qpeer = Peer::spawn(&path, &[("DMRPC_BENCH_TENANT", "bench")])?;
    say!("\nwith quotas (a process quota, and both processes in one tenant) against without, alternated 3 times (medians of the share totals)");
    say!(
        "{:>9} {:>13} {:>13} {:>8}",
        "size",
        "no quota",
        "quotas",
        "ratio"
    );
    let mut rows = Vec::new();
    for &n in sizes {
        let data: Vec<u8> = (0..n).map(|i| i as u8).collect();
        let mut a = pool.alloc(n)?;
        a.write(0, &data)?;
        let mut b = quota.alloc(n)?;
        b.write(0, &data)?;
        let (mut open, mut quoted) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            open.push(median(&mut share_loop(pool, peer, &a, budget)?.2));
            quoted.push(median(&mut share_loop(&quota, &mut qpeer, &b, budget)?.2));
        }
        let (o, q) = (median(&mut open), median(&mut quoted));
        say!(
            "{:>9} {:>10.2} us {:>10.2} us {:>7.2}x",
            fmt_size(n),
            o / 1e3,
            q / 1e3,
            q / o
        );
        let mut r = Obj::default();
        r.num("size", n as f64);
        r.num("share_total_ns", o);
        r.num("share_total_with_quotas_ns", q);
        r.num("quotas_over_none", q / o);
        rows.push(r);
    }
    Ok(rows)
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let max = if a.quick { 16 << 20 } else { 64 << 20 };
    let budget = Duration::from_millis(if a.quick { 150 } else { 600 });
    let path = PathBuf::from(format!(
        "/dev/shm/dmrpc-bench-cow-{}.pool",
        std::process::id()
    ));
    let _guard = TempFile(path.clone());
    Pool::create(
        &path,
        &PoolConfig {
            size: max * 4 + (64 << 20),
            name: "bench-cow".into(),
            ..Default::default()
        },
    )?;
    let pool = Pool::open(
        &path,
        AttachOptions {
            prefault: true,
            batch: 1024,
            ..Default::default()
        },
    )?;
    let mut peer = Peer::spawn(&path, &[])?;

    say!("bench cow: create_ref + map_ref (in another process) vs copying the buffer");
    say!(
        "{:>9} {:>11} {:>11} {:>11} {:>11} {:>11} {:>8}",
        "size",
        "copy",
        "create_ref",
        "map_ref",
        "share total",
        "per page",
        "ratio"
    );
    let mut rows = Vec::new();
    let mut size = 4096u64;
    while size <= max {
        let mut src = pool.alloc(size)?;
        let data: Vec<u8> = (0..size).map(|i| i as u8).collect();
        src.write(0, &data)?;
        let view = src.segments(0, size)?;
        // Baseline: memcpy into a pre-faulted private buffer.
        let mut dst = vec![1u8; size as usize];
        let mut copy = Vec::new();
        let t_end = Instant::now() + budget;
        while copy.len() < 5 || (Instant::now() < t_end && copy.len() < 10_000) {
            let t = Instant::now();
            let mut at = 0;
            for s in &view {
                dst[at..at + s.len()].copy_from_slice(s);
                at += s.len();
            }
            black_box(&dst);
            copy.push(t.elapsed().as_nanos() as f64);
        }
        let (mut create, mut map, mut total) = share_loop(&pool, &mut peer, &src, budget)?;
        drop(view);
        let (copy_ns, create_ns, map_ns, share_ns) = (
            median(&mut copy),
            median(&mut create),
            median(&mut map),
            median(&mut total),
        );
        let pages = size.div_ceil(pool.page_size() as u64) as f64;
        let ratio = copy_ns / share_ns;
        say!(
            "{:>9} {:>8.1} us {:>8.1} us {:>8.1} us {:>8.1} us {:>8.1} ns {:>7.1}x",
            fmt_size(size),
            copy_ns / 1e3,
            create_ns / 1e3,
            map_ns / 1e3,
            share_ns / 1e3,
            share_ns / pages,
            ratio
        );
        let mut o = Obj::default();
        o.num("size", size as f64);
        o.num("copy_ns", copy_ns);
        o.num("create_ref_ns", create_ns);
        o.num("map_ref_ns", map_ns);
        o.num("share_total_ns", share_ns);
        o.num("share_ns_per_page", share_ns / pages);
        o.num("ratio_copy_over_share", ratio);
        rows.push(o);
        drop(src);
        size *= 4;
    }

    // One copy-on-write: explicit write, and a store through a mapped buffer.
    let n = 256u64;
    let ps = pool.page_size() as u64;
    let mut b = pool.alloc(n * ps)?;
    b.write(0, &vec![7u8; (n * ps) as usize])?;
    let r = b.share()?;
    let t = Instant::now();
    for k in 0..n {
        b.write(k * ps, &[1])?;
    }
    let cow_explicit = t.elapsed().as_nanos() as f64 / n as f64;
    pool.release_ref(&r)?;
    drop(b);
    let mut m = MappedBuffer::alloc(&pool, n * ps)?;
    m.as_mut_slice().fill(7);
    let r = m.share()?;
    let t = Instant::now();
    {
        let s = m.as_mut_slice();
        for k in 0..n {
            s[(k * ps) as usize] = 1;
        }
    }
    let cow_fault = t.elapsed().as_nanos() as f64 / n as f64;
    pool.release_ref(&r)?;
    drop(m);
    say!("\ncopy-on-write of one 4 KiB page: explicit write {:.2} us, store through a mapped buffer (fault) {:.2} us", cow_explicit / 1e3, cow_fault / 1e3);

    // alloc + 1-byte write + free throughput, 1 and 2 processes.
    let loops = if a.quick { 20_000 } else { 200_000 };
    let t = Instant::now();
    alloc_loop(&pool, loops)?;
    let one = loops as f64 / t.elapsed().as_secs_f64();
    peer.send(&format!("alloc {loops}"))?;
    let t = Instant::now();
    alloc_loop(&pool, loops)?;
    let mine = t.elapsed().as_secs_f64();
    let theirs = peer.ok_nums()?.first().copied().unwrap_or(f64::NAN) / 1e9;
    let two = loops as f64 / mine + loops as f64 / theirs;
    say!(
        "alloc + write + free: {:.2} M ops/s with 1 process, {:.2} M ops/s with 2 processes",
        one / 1e6,
        two / 1e6
    );
    let quota_rows = quota_cost(&pool, &mut peer, budget, &[4096, 64 << 10, 1 << 20])?;
    drop(peer);
    let rep = pool.check();
    if !rep.ok() {
        bail!("pool check failed after the benchmark: {:?}", rep.problems);
    }

    let net_rows = network(a, if a.quick { 1 << 20 } else { 16 << 20 }, budget)?;

    let mut res = Obj::default();
    res.str("benchmark", "cow");
    res.arr("network", &net_rows);
    res.arr("quotas", &quota_rows);
    res.str("method", "median; copy = memcpy into a pre-faulted private buffer; share = create_ref + map_ref and unmap in another process + release_ref");
    res.obj("machine", &super::machine());
    res.arr("sizes", &rows);
    res.num("cow_explicit_ns", cow_explicit);
    res.num("cow_fault_ns", cow_fault);
    res.num("alloc_free_ops_1proc", one);
    res.num("alloc_free_ops_2proc", two);
    super::write_results(
        a,
        "cow",
        &Chart {
            title: "bench cow: copying vs create_ref + map_ref",
            x: "size",
            ys: &["copy_ns", "share_total_ns"],
            by: None,
            y_label: "ns (p50)",
            log_x: true,
            log_y: true,
        },
        &res,
        &rows,
        &[
            "size",
            "copy_ns",
            "create_ref_ns",
            "map_ref_ns",
            "share_total_ns",
            "ratio_copy_over_share",
        ],
    )
}

/// `bench cow` on a memory server: moving a buffer's value to another
/// client (one transfer of its bytes into a new buffer: a write) against
/// passing it by Ref (create_ref + the other client's map_ref: two small
/// requests, no data moved; the mapping's free and the Ref's release
/// follow, off the timed path, as a call's do). Medians.
fn network(a: &super::BenchArgs, max: u64, budget: Duration) -> Result<Vec<Obj>> {
    let mut rows = Vec::new();
    for link in super::hosts::links(a) {
        // Host 0 the two clients, host 1 the memory server.
        if let Some(net) = super::hosts::Net::new(&link, 2)? {
            rows.extend(cow_over(&net, max, budget)?);
        }
    }
    Ok(rows)
}

/// [`cow`] over one link.
fn cow_over(net: &super::hosts::Net, max: u64, budget: Duration) -> Result<Vec<Obj>> {
    let (_ms, addr) = net.memserver(1, &format!("{}", max * 4 + (64 << 20)))?;
    let link = net.describe();
    let cfg = net.client_config();
    net.on(0, || cow_clients(&addr, cfg, &link, max, budget))
}

/// [`cow`]'s two clients of the memory server at `addr`.
fn cow_clients(
    addr: &str,
    cfg: dm_memserver::ClientConfig,
    link: &str,
    max: u64,
    budget: Duration,
) -> Result<Vec<Obj>> {
    let caller = MemPool::connect_with(&[addr], cfg.clone())?;
    let callee = MemPool::connect_with(&[addr], cfg)?;
    say!("\nnetwork backend (a memory server over {link}): value transfer vs create_ref + map_ref by another client");
    say!(
        "{:>9} {:>11} {:>11} {:>11} {:>11} {:>8}",
        "size",
        "copy",
        "create_ref",
        "map_ref",
        "create+map",
        "ratio"
    );
    let mut rows = Vec::new();
    let mut size = 4096u64;
    while size <= max {
        let data: Vec<u8> = (0..size).map(|i| i as u8).collect();
        let mut src = caller.alloc(size)?;
        src.write(0, &data)?;
        let (mut copy, mut create, mut map, mut total) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let t_end = Instant::now() + budget;
        while copy.len() < 5 || (Instant::now() < t_end && copy.len() < 2_000) {
            let mut dst = callee.alloc(size)?;
            let t = Instant::now();
            dst.write(0, &data)?;
            copy.push(t.elapsed().as_nanos() as f64);
            callee.free(dst)?;
        }
        let t_end = Instant::now() + budget;
        while create.len() < 5 || (Instant::now() < t_end && create.len() < 2_000) {
            let t = Instant::now();
            let r = caller.create_ref(&src, 0, size)?;
            let c = t.elapsed().as_nanos() as f64;
            let m = callee.map_ref(&r)?;
            let both = t.elapsed().as_nanos() as f64;
            create.push(c);
            map.push(both - c);
            total.push(both);
            callee.free(m)?;
            caller.release_ref_nowait(&r)?;
        }
        caller.free(src)?;
        let (copy_ns, create_ns, map_ns, share_ns) = (
            median(&mut copy),
            median(&mut create),
            median(&mut map),
            median(&mut total),
        );
        let ratio = copy_ns / share_ns;
        say!(
            "{:>9} {:>8.1} us {:>8.1} us {:>8.1} us {:>8.1} us {:>7.1}x",
            fmt_size(size),
            copy_ns / 1e3,
            create_ns / 1e3,
            map_ns / 1e3,
            share_ns / 1e3,
            ratio
        );
        let mut o = Obj::default();
        o.num("size", size as f64);
        o.str("link", link);
        o.num("copy_ns", copy_ns);
        o.num("create_ref_ns", create_ns);
        o.num("map_ref_ns", map_ns);
        o.num("create_and_map_ns", share_ns);
        o.num("ratio_copy_over_share", ratio);
        rows.push(o);
        size *= 4;
    }
    let problems = caller.check()?;
    if !problems.is_empty() {
        anyhow::bail!("memory server check failed: {problems:?}");
    }
    Ok(rows)
}

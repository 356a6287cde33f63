//! `dmrpc bench rtt` — no-op round trips between two processes.
//!
//! In one run, with the client here and the server in a peer process:
//! * **floor**: a raw shared-memory ping-pong (one word each way, both
//!   sides spinning) — the physical cost of a round trip on this machine;
//! * **shm**: a no-op dmrpc call over a shared-memory channel, for each
//!   waiting policy (default, spin-only, park-only), and through the async
//!   client (awaited on a current-thread tokio runtime);
//! * **tcp**: the same call over the TCP transport on loopback, blocking
//!   and async;
//! * **echo**: 64 B .. 1 MiB payloads echoed over every transport: dmrpc
//!   shm with bytes (inline below the threshold, by Ref above it) and with
//!   a pool buffer written by the caller (by Ref at every size, passed back
//!   by the echo: the counterpart of iceoryx2's loaned samples), dmrpc TCP,
//!   tonic over TCP and a Unix socket, iceoryx2. iceoryx2 and dmrpc shm's
//!   echo also run in paired rounds (every size over iceoryx2, then over
//!   dmrpc), and the ratio per size is the median over rounds.
//!
//! Every round trip is timed on its own; the table shows p50/p99/p999 and
//! the throughput of one caller, and the ratio of each p50 to the floor.

use super::peer::{percentile, policy, BenchPool, Peer, PingPong, TempFile};
use super::plot::Chart;
use super::serde_like::Obj;
use super::BenchArgs;
use crate::say;
use anyhow::{bail, Result};
use dm_pool::PoolConfig;
use dm_rpc::{Config, Node, Payload};
use dmrpc::fmt_size;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

struct Dist {
    avg: f64,
    p50: f64,
    p99: f64,
    p999: f64,
    per_sec: f64,
}

fn dist(mut v: Vec<f64>, wall: Duration) -> Dist {
    let n = v.len() as f64;
    Dist {
        avg: v.iter().sum::<f64>() / n.max(1.0),
        p50: percentile(&mut v, 0.5),
        p99: percentile(&mut v, 0.99),
        p999: percentile(&mut v, 0.999),
        per_sec: n / wall.as_secs_f64(),
    }
}

fn row(what: &str, size: u64, d: &Dist, floor: f64) -> Obj {
    say!(
        "{:<28} {:>9} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>12.0} {:>8.2}x",
        what,
        fmt_size(size),
        d.avg / 1e3,
        d.p50 / 1e3,
        d.p99 / 1e3,
        d.p999 / 1e3,
        d.per_sec,
        d.p50 / floor
    );
    let mut o = Obj::default();
    o.str("transport", what);
    o.num("size", size as f64);
    // The plot's x: no-op calls (0 B) at 1 B, on a log axis.
    o.num("bytes", size.max(1) as f64);
    o.num("avg_ns", d.avg);
    o.num("p50_ns", d.p50);
    o.num("p99_ns", d.p99);
    o.num("p999_ns", d.p999);
    o.num("calls_per_s", d.per_sec);
    o.num("p50_over_floor", d.p50 / floor);
    o
}

fn timed(n: usize, mut f: impl FnMut() -> Result<()>) -> Result<(Vec<f64>, Duration)> {
    // Warm up (page faults, caches, the peer's first wake-up).
    for _ in 0..(n / 10).max(100) {
        f()?;
    }
    let mut v = Vec::with_capacity(n);
    let start = Instant::now();
    for _ in 0..n {
        let t = Instant::now();
        f()?;
        v.push(t.elapsed().as_nanos() as f64);
    }
    Ok((v, start.elapsed()))
}

/// `timed` for no-op calls of the async client, awaited one at a time on a
/// current-thread runtime (as a tokio service calling another would).
fn timed_async(c: &dm_rpc::AsyncClient, n: usize) -> Result<(Vec<f64>, Duration)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        for _ in 0..(n / 10).max(100) {
            c.call("noop", Payload::empty()).await?;
        }
        let mut v = Vec::with_capacity(n);
        let start = Instant::now();
        for _ in 0..n {
            let t = Instant::now();
            c.call("noop", Payload::empty()).await?;
            v.push(t.elapsed().as_nanos() as f64);
        }
        Ok((v, start.elapsed()))
    })
}

/// One echo of `data` given as a slice (inline up to the threshold; above
/// it written once into the pool and sent by Ref), checked.
fn echo_bytes(c: &dm_rpc::Client, data: &[u8]) -> Result<()> {
    let back = c.call_slice("echo", data)?;
    if back.len() as usize != data.len() {
        bail!("echo returned {} bytes", back.len());
    }
    Ok(())
}

/// One echo of `data` written by the caller into a pool buffer (by Ref at
/// every size, with a client of threshold 0), checked.
fn echo_pool_buffer(pool: &dm_pool::Pool, c: &dm_rpc::Client, data: &[u8]) -> Result<()> {
    let mut b = pool.alloc(data.len() as u64)?;
    b.write(0, data)?;
    let back = c.call("echo", Payload::from_buffer(b))?;
    if back.len() as usize != data.len() {
        bail!("echo returned {} bytes", back.len());
    }
    Ok(())
}

/// `n` timed raw ping-pongs with the peer (which echoes until told to
/// stop), from a zeroed file.
fn ping_pong(
    peer: &mut Peer,
    path: &std::path::Path,
    pp: &PingPong,
    n: usize,
) -> Result<(Vec<f64>, Duration)> {
    pp.ping().store(0, Ordering::Release);
    pp.pong().store(0, Ordering::Release);
    peer.send(&format!("pong {}", path.display()))?;
    let mut seq = 0u64;
    let r = timed(n, || {
        seq += 1;
        pp.ping().store(seq, Ordering::Release);
        while pp.pong().load(Ordering::Acquire) != seq {
            std::hint::spin_loop();
        }
        Ok(())
    });
    pp.ping().store(u64::MAX, Ordering::Release);
    peer.ok_nums()?;
    r
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let n = if a.quick { 20_000 } else { 200_000 };
    let id = std::process::id();
    let bp = BenchPool::create(
        "rtt",
        PoolConfig {
            size: 256 << 20,
            channels: Some(8),
            ring_size: 4 << 20,
            ..Default::default()
        },
    )?;
    let (pool, path) = (&bp.pool, &bp.path);
    // With --pin: this thread (the client) on CPU 0, the peer on CPU 1;
    // this thread's CPUs are restored when the bench ends.
    let pin = super::peer::Pin::new(a.pin)?;
    let pinned = pin.on();
    let mut peer = pin.spawn(path, 0)?;

    say!(
        "bench rtt: round trips between two processes ({n} per row{})",
        if pinned {
            "; client on CPU 0, peer on CPU 1"
        } else {
            ""
        }
    );
    say!(
        "{:<28} {:>9} {:>9} {:>9} {:>9} {:>9} {:>12} {:>9}",
        "transport",
        "payload",
        "avg us",
        "p50 us",
        "p99 us",
        "p999 us",
        "calls/s",
        "p50/floor"
    );
    let mut rows = Vec::new();

    // The floor: raw ping-pong through two words of shared memory.
    let pp_path = PathBuf::from(format!("/dev/shm/dmrpc-bench-pingpong-{id}"));
    let _g2 = TempFile(pp_path.clone());
    let pp = PingPong::create(&pp_path)?;
    let (v, wall) = ping_pong(&mut peer, &pp_path, &pp, n)?;
    let floor = dist(v, wall);
    let f50 = floor.p50;
    rows.push(row("raw ping-pong (floor)", 8, &floor, f50));

    // dmrpc no-op calls over a shm channel, per waiting policy.
    let mut shm_p50 = f64::NAN;
    for pol in ["default", "spin", "park"] {
        let name = format!("bench/rtt/{id}/{pol}");
        peer.cmd(&format!("serve {name} {pol}"))?;
        let node = Node::with_config(
            pool.clone(),
            Config {
                wait: policy(pol)?,
                ..Default::default()
            },
        );
        let c = node.connect(&name)?;
        let calls = if pol == "park" { n / 10 } else { n };
        let (v, wall) = timed(calls, || {
            c.call("noop", Payload::empty())?;
            Ok(())
        })?;
        let d = dist(v, wall);
        if pol == "default" {
            shm_p50 = d.p50;
        }
        rows.push(row(&format!("dmrpc shm ({pol})"), 0, &d, f50));
        drop(c);
        if pol == "default" {
            // The async client, on the same service.
            let c = node.connect_async(&name)?;
            let (v, wall) = timed_async(&c, n)?;
            rows.push(row("dmrpc shm async (default)", 0, &dist(v, wall), f50));
        }
        peer.cmd("unserve")?;
    }

    // iceoryx2 request-response (u64 each way), both sides polling.
    #[cfg(feature = "iceoryx2")]
    let iox_p50 = {
        let iox = format!("dmrpc/bench/rtt/{id}/iceoryx2");
        peer.cmd(&format!("iox {iox}"))?;
        let ic = super::iox::Client::connect(&iox)?;
        let (v, wall) = timed(n, || {
            ic.call(7)?;
            Ok(())
        })?;
        let d = dist(v, wall);
        rows.push(row("iceoryx2 req-resp", 8, &d, f50));
        drop(ic);
        peer.cmd("unserve")?;
        d.p50
    };
    #[cfg(not(feature = "iceoryx2"))]
    let iox_p50 = {
        say!("iceoryx2: not built in (cargo build --release -p dmrpc-cli --features iceoryx2; needs libclang, which scripts/deps.sh installs)");
        f64::NAN
    };

    // Paired rounds: the floor and the default policy alternate in short
    // batches, so both see the same placement of the VM's cores (which
    // drifts during a run and moves the floor by 2-5x); the ratio is the
    // median over rounds of the two p50s' quotient.
    let name = format!("bench/rtt/{id}/paired");
    peer.cmd(&format!("serve {name} default"))?;
    let node = Node::new(pool.clone());
    let c = node.connect(&name)?;
    let mut ratios = Vec::new();
    let rounds = 10;
    for _ in 0..rounds {
        // Let the idle server park, so it does not compete with the pong.
        std::thread::sleep(Duration::from_millis(5));
        let (v, _) = ping_pong(&mut peer, &pp_path, &pp, n / rounds)?;
        let f = dist(v, Duration::from_secs(1)).p50;
        let (v, _) = timed(n / rounds, || {
            c.call("noop", Payload::empty())?;
            Ok(())
        })?;
        ratios.push(dist(v, Duration::from_secs(1)).p50 / f);
    }
    drop(c);
    peer.cmd("unserve")?;
    let paired = percentile(&mut ratios.clone(), 0.5);
    say!(
        "paired rounds: dmrpc shm (default) p50 / floor p50 = {paired:.2}x (median of {rounds}; range {:.2}-{:.2}x)",
        ratios.iter().copied().fold(f64::MAX, f64::min),
        ratios.iter().copied().fold(0.0, f64::max),
    );

    // The TCP transport over loopback (same frames, same service code).
    let name = format!("bench/rtt/{id}/tcp");
    peer.cmd(&format!("serve {name} default tcp"))?;
    let c = Node::new(pool.clone()).connect(&name)?;
    let (v, wall) = timed(n / 4, || {
        c.call("noop", Payload::empty())?;
        Ok(())
    })?;
    let tcp = dist(v, wall);
    rows.push(row("dmrpc tcp (loopback)", 0, &tcp, f50));
    drop(c);
    let c = Node::new(pool.clone()).connect_async(&name)?;
    let (v, wall) = timed_async(&c, n / 4)?;
    rows.push(row("dmrpc tcp async (loopback)", 0, &dist(v, wall), f50));
    drop(c);
    // The same with an access key on both ends, against the open service,
    // alternated (medians of the p50s).
    let kname = format!("bench/rtt/{id}/tcpkey");
    peer.cmd(&format!("serve {kname} default tcpkey"))?;
    let open = Node::new(pool.clone()).connect(&name)?;
    let keyed = Node::with_config(
        pool.clone(),
        dm_rpc::Config {
            tcp_key: Some(super::peer::bench_key()),
            ..Default::default()
        },
    )
    .connect(&kname)?;
    let (mut po, mut pk) = (Vec::new(), Vec::new());
    let mut keyed_dist = None;
    for _ in 0..3 {
        for (c, p) in [(&open, &mut po), (&keyed, &mut pk)] {
            let (v, wall) = timed(n / 8, || {
                c.call("noop", Payload::empty())?;
                Ok(())
            })?;
            let d = dist(v, wall);
            p.push(d.p50);
            if std::ptr::eq(c, &keyed) {
                keyed_dist = Some(d);
            }
        }
    }
    let (po, pk) = (percentile(&mut po, 0.5), percentile(&mut pk, 0.5));
    if let Some(d) = keyed_dist {
        rows.push(row("dmrpc tcp keyed (loopback)", 0, &d, f50));
    }
    say!("tcp with an access key: p50 {pk:.0} ns against {po:.0} ns open ({:.2}x; medians of 3 alternated rounds)", pk / po);
    let tcp_keyed_over_open = pk / po;
    drop((open, keyed));
    peer.cmd("unserve")?;

    // gRPC (tonic) in the peer process, over loopback TCP and a Unix
    // socket: no-op calls, then echo of growing payloads over TCP.
    let uds = PathBuf::from(format!("/tmp/dmrpc-bench-grpc-{id}.sock"));
    let _g3 = TempFile(uds.clone());
    let mut tonic_tcp = None;
    let mut tonic_addrs = Vec::new();
    for (what, cmd) in [
        ("tonic tcp (loopback)", "grpc tcp".to_string()),
        ("tonic uds", format!("grpc uds {}", uds.display())),
    ] {
        let addr = peer.cmd_text(&cmd)?;
        let mut g = super::grpc::Client::connect(&addr)?;
        let (v, wall) = timed(n / 10, || {
            g.echo(bytes::Bytes::new())?;
            Ok(())
        })?;
        let d = dist(v, wall);
        rows.push(row(what, 0, &d, f50));
        tonic_addrs.push(addr.clone());
        if tonic_tcp.is_none() {
            tonic_tcp = Some(d.p50);
        }
    }
    let tonic_p50 = tonic_tcp.ok_or_else(|| anyhow::anyhow!("no gRPC row"))?;

    // Echo of growing payloads over every transport: dmrpc over shm and
    // over TCP (inline up to the threshold, by Ref above it: both ends
    // share the pool), tonic over TCP and a Unix socket, iceoryx2 (byte
    // slices copied into loaned samples).
    const ECHO_MAX: usize = 1 << 20;
    let name = format!("bench/rtt/{id}/echo");
    peer.cmd(&format!("serve {name} default"))?;
    let tname = format!("bench/rtt/{id}/echotcp");
    peer.cmd(&format!("serve {tname} default tcp"))?;
    let node = Node::new(pool.clone());
    let c = node.connect(&name)?;
    let tc = node.connect(&tname)?;
    // The caller writes the request into a pool buffer, sent by Ref at
    // every size (threshold 0).
    let by_ref = Node::with_config(
        pool.clone(),
        Config {
            inline_max: 0,
            ..Default::default()
        },
    );
    let bc = by_ref.connect(&name)?;
    let mut grpc: Vec<(&str, super::grpc::Client)> = Vec::new();
    for (what, addr) in ["tonic tcp echo", "tonic uds echo"]
        .iter()
        .zip(&tonic_addrs)
    {
        grpc.push((what, super::grpc::Client::connect(addr)?));
    }
    let mut size = 64u64;
    while size as usize <= ECHO_MAX {
        let data = vec![7u8; size as usize];
        let calls = (n / 4).min(((4u64 << 30) / size.max(1)) as usize).max(1000);
        // Fewer calls for the transports that take milliseconds.
        let slow = (calls / if a.quick { 16 } else { 4 }).max(50);
        let how = if size as usize > node.config().inline_max {
            "Ref"
        } else {
            "inline"
        };
        for (what, client, k) in [("shm", &c, calls), ("tcp", &tc, slow)] {
            let (v, wall) = timed(k, || echo_bytes(client, &data))?;
            let label = format!("dmrpc {what} echo ({how})");
            rows.push(row(&label, size, &dist(v, wall), f50));
        }
        let (v, wall) = timed(calls, || echo_pool_buffer(pool, &bc, &data))?;
        rows.push(row(
            "dmrpc shm echo (pool buffer)",
            size,
            &dist(v, wall),
            f50,
        ));
        let bytes = bytes::Bytes::from(data.clone());
        for (what, g) in grpc.iter_mut() {
            let (v, wall) = timed(slow, || {
                let back = g.echo(bytes.clone())?;
                if back.len() as u64 != size {
                    bail!("gRPC echo returned {} bytes", back.len());
                }
                Ok(())
            })?;
            rows.push(row(what, size, &dist(v, wall), f50));
        }
        size *= 4;
    }
    drop((tc, grpc));
    // iceoryx2 against dmrpc's best way, in paired rounds: iceoryx2's
    // server polls without pause, so it runs alone (on two cores it would
    // take a core from the others), and each round runs every size over
    // iceoryx2 and then over dmrpc shm (bytes and pool buffer) while the
    // placement of the VM's cores stays put; the ratio per size is the
    // median over rounds (the placement drifts during a run and moves
    // both by up to 2x).
    #[cfg_attr(not(feature = "iceoryx2"), allow(unused_mut))]
    let mut echo_ratios: Vec<(u64, f64, f64, f64)> = Vec::new();
    #[cfg(feature = "iceoryx2")]
    {
        let sizes: Vec<u64> = std::iter::successors(Some(64u64), |s| Some(s * 4))
            .take_while(|s| *s as usize <= ECHO_MAX)
            .collect();
        let rounds = if a.quick { 3 } else { 5 };
        let calls_at =
            |size: u64| ((n / 4).min(((4u64 << 30) / size) as usize).max(1000) / rounds).max(200);
        let mut iox: Vec<Vec<f64>> = vec![Vec::new(); sizes.len()];
        let mut iox_wall = vec![Duration::ZERO; sizes.len()];
        let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); sizes.len()];
        for round in 0..rounds {
            let svc = format!("dmrpc/bench/rtt/{id}/iceoryx2-echo-{round}");
            peer.cmd(&format!("ioxecho {svc} {ECHO_MAX}"))?;
            let ioc = super::iox::EchoClient::connect(&svc, ECHO_MAX)?;
            let mut theirs = Vec::new();
            for (k, &size) in sizes.iter().enumerate() {
                let data = vec![7u8; size as usize];
                let (v, wall) = timed(calls_at(size), || {
                    let back = ioc.echo(&data)?;
                    if back as u64 != size {
                        bail!("iceoryx2 echo returned {back} bytes");
                    }
                    Ok(())
                })?;
                theirs.push(dist(v.clone(), wall).p50);
                iox[k].extend(v);
                iox_wall[k] += wall;
            }
            drop(ioc);
            peer.cmd("unserve iox")?;
            // Let the idle dmrpc server's spin run out (it parks).
            std::thread::sleep(Duration::from_millis(5));
            for (k, &size) in sizes.iter().enumerate() {
                let data = vec![7u8; size as usize];
                let (v, wall) = timed(calls_at(size), || echo_bytes(&c, &data))?;
                let bytes = dist(v, wall).p50;
                let (v, wall) = timed(calls_at(size), || echo_pool_buffer(pool, &bc, &data))?;
                let ours = bytes.min(dist(v, wall).p50);
                ratios[k].push(theirs[k] / ours);
            }
        }
        for (k, &size) in sizes.iter().enumerate() {
            let v = std::mem::take(&mut iox[k]);
            rows.push(row("iceoryx2 echo", size, &dist(v, iox_wall[k]), f50));
            let r = &mut ratios[k];
            let (lo, hi) = (
                r.iter().copied().fold(f64::MAX, f64::min),
                r.iter().copied().fold(0.0, f64::max),
            );
            echo_ratios.push((size, percentile(r, 0.5), lo, hi));
        }
    }
    drop((c, bc));
    peer.cmd("unserve")?;
    drop(peer);
    let over_grpc = tonic_p50 / shm_p50;
    say!(
        "dmrpc shm (default) p50 is {over_grpc:.0}x lower than tonic over loopback TCP (target: 100x)"
    );
    let over_iox = iox_p50 / shm_p50;
    if over_iox.is_finite() {
        say!(
            "iceoryx2 request-response p50 / dmrpc shm (default) p50 = {over_iox:.2}x (target: above 1)"
        );
    }
    for (size, r, lo, hi) in &echo_ratios {
        say!(
            "echo {:>9}: iceoryx2 p50 / dmrpc shm's best p50 = {r:.2}x (paired rounds, median; range {lo:.2}-{hi:.2}x; target: above 1)",
            fmt_size(*size)
        );
    }
    bp.check()?;

    let mut res = Obj::default();
    res.str("benchmark", "rtt");
    res.str(
        "method",
        "client here, server in a peer process; each round trip timed; floor = raw ping-pong of one shared word each way, both spinning",
    );
    res.obj("machine", &super::machine());
    res.num("floor_p50_ns", f50);
    res.num("paired_p50_over_floor", paired);
    res.str(
        "pinned",
        if pinned {
            "client CPU 0, peer CPU 1"
        } else {
            "no"
        },
    );
    res.num("tonic_tcp_p50_over_dmrpc_shm_p50", over_grpc);
    res.num("tcp_keyed_p50_over_open", tcp_keyed_over_open);
    res.num("iceoryx2_p50_over_dmrpc_shm_p50", over_iox);
    let ratios: Vec<Obj> = echo_ratios
        .iter()
        .map(|&(size, r, lo, hi)| {
            let mut o = Obj::default();
            o.num("size", size as f64);
            o.num("iceoryx2_p50_over_dmrpc_shm_best_p50", r);
            o.num("lowest_round", lo);
            o.num("highest_round", hi);
            o
        })
        .collect();
    res.arr("echo_ratios", &ratios);
    res.arr("rows", &rows);
    super::write_results(
        a,
        "rtt",
        &Chart {
            title: "bench rtt: round-trip p50 by payload (no-op calls at 1 B)",
            x: "bytes",
            ys: &["p50_ns"],
            by: Some("transport"),
            y_label: "ns (p50)",
            log_x: true,
            log_y: true,
        },
        &res,
        &rows,
        &[
            "transport",
            "size",
            "avg_ns",
            "p50_ns",
            "p99_ns",
            "p999_ns",
            "calls_per_s",
            "p50_over_floor",
        ],
    )
}

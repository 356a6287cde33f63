//! `dmrpc bench ray` — DmRPC's Figure 8 against Ray, both driven from
//! Python, and the per-call overhead of the Python binding.
//!
//! This starts what the Python driver (`crates/dmrpc-py/bench/ray_bench.py`,
//! whose docstring has the method) needs: a bench pool, a Rust service in
//! another process (the bench peer) and a memory server. It times the
//! same calls to the Rust service from Rust (the reference for the
//! binding's overhead), then runs the driver, which prints one `row ...`
//! line per measurement: the same calls from Python, and each system of
//! Figure 8 (a 32 KiB array passed by reference to a callee that writes
//! 0-100% of it: dmrpc's pool, by Ref and inline; a memory server; Ray
//! with `ray.put`). The table gives calls/s and latency, and each
//! system's throughput over Ray's.
//!
//! Python comes from `$DMRPC_PYTHON`, else the project's virtualenv
//! (`target/pyenv`, made by `scripts/python.sh setup`, which installs the
//! dmrpc package, NumPy and Ray from PyPI).

use super::net::start_memserver;
use super::peer::{percentile, BenchPool, Peer};
use super::plot::Chart;
use super::serde_like::Obj;
use super::BenchArgs;
use crate::say;
use anyhow::{anyhow, bail, Context, Result};
use dm_pool::PoolConfig;
use dm_rpc::{Config, Node, Payload};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SIZE: usize = 32 << 10;
const DRIVER: &str = "crates/dmrpc-py/bench/ray_bench.py";

/// The project root: the first ancestor of the executable or of the
/// current directory that holds the driver.
fn root() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let cwd = std::env::current_dir()?;
    exe.ancestors()
        .chain(cwd.ancestors())
        .find(|d| d.join(DRIVER).is_file())
        .map(Path::to_path_buf)
        .ok_or_else(|| anyhow!("cannot find {DRIVER} (run from the dmrpc source tree)"))
}

fn python(root: &Path) -> Result<PathBuf> {
    let py = std::env::var_os("DMRPC_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/pyenv/bin/python"));
    let ok = Command::new(&py)
        .args(["-c", "import dmrpc, numpy, ray"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        bail!(
            "{} cannot import dmrpc, numpy and ray: run scripts/python.sh setup (it installs them from PyPI), or set DMRPC_PYTHON",
            py.display()
        );
    }
    Ok(py)
}

/// Calls/s and latency of `call` in a closed loop for `budget`.
fn measure(mut call: impl FnMut() -> Result<()>, budget: Duration) -> Result<Obj> {
    for _ in 0..500 {
        call()?;
    }
    let mut v = Vec::new();
    let start = Instant::now();
    while start.elapsed() < budget {
        let t = Instant::now();
        call()?;
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let wall = start.elapsed().as_secs_f64();
    let mut o = Obj::default();
    o.num("calls", v.len() as f64);
    o.num("calls_s", v.len() as f64 / wall);
    o.num("avg_us", v.iter().sum::<f64>() / v.len() as f64);
    o.num("p50_us", percentile(&mut v, 0.5));
    o.num("p99_us", percentile(&mut v, 0.99));
    Ok(o)
}

/// One `row KIND k=v ...` line of the driver as (kind, fields).
fn parse_row(line: &str) -> Option<(String, Obj)> {
    let mut it = line.split_whitespace();
    let kind = it.next()?.to_owned();
    let mut o = Obj::default();
    for kv in it {
        let (k, v) = kv.split_once('=')?;
        match v.parse::<f64>() {
            Ok(x) => o.num(k, x),
            Err(_) => o.str(k, v),
        }
    }
    Some((kind, o))
}

fn num(o: &Obj, k: &str) -> f64 {
    o.text(k).and_then(|v| v.parse().ok()).unwrap_or(f64::NAN)
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let root = root()?;
    let py = python(&root)?;
    let budget = Duration::from_millis(if a.quick { 400 } else { 3000 });
    let id = std::process::id();
    let bp = BenchPool::create(
        "ray",
        PoolConfig {
            size: 512 << 20,
            channels: Some(16),
            ring_size: 1 << 20,
            ..Default::default()
        },
    )?;
    let mut peer = Peer::spawn(&bp.path, &[])?;
    let rust_svc = format!("bench/ray/rust/{id}");
    peer.cmd(&format!("serve {rust_svc} default"))?;
    let (_ms, ms_addr) = start_memserver("256M")?;

    say!("bench ray: the Python binding's overhead, then DmRPC's Figure 8 against Ray");
    let node = Node::with_config(
        bp.pool.clone(),
        Config {
            inline_max: 4 << 10,
            ..Default::default()
        },
    );
    let c = node.connect(&rust_svc)?;
    let data = vec![1u8; SIZE];
    let mut overhead = Vec::new();
    // 2 Rust cells, then the driver's rows: 4 overhead, 5 fractions x 4 systems.
    super::progress::start("ray", 2 + 4 + 20);
    for method in ["noop", "sum"] {
        let mut o = measure(
            || {
                let p = if method == "noop" {
                    Payload::empty()
                } else {
                    Payload::from_vec(data.clone())
                };
                c.call(method, p)?;
                Ok(())
            },
            budget,
        )?;
        o.str("client", "rust");
        o.str("service", "rust");
        o.str("method", method);
        overhead.push(o);
        super::progress::tick(format!("rust {method}"));
    }
    drop(c);

    let mut child = Command::new(&py)
        .arg(root.join(DRIVER))
        .args(["--pool", &bp.path.to_string_lossy()])
        .args(["--rust-service", &rust_svc, "--memserver", &ms_addr])
        .args(a.quick.then_some("--quick"))
        .stdout(Stdio::piped())
        .spawn()
        .context("running the Python driver")?;
    let out = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
    let mut fig8 = Vec::new();
    for line in BufReader::new(out).lines() {
        match parse_row(&line?) {
            Some((k, o)) if k == "overhead" => overhead.push(o),
            Some((k, o)) if k == "fig8" => fig8.push(o),
            _ => continue,
        }
        super::progress::tick("python driver");
    }
    if !child.wait()?.success() {
        bail!("the Python driver failed");
    }
    peer.cmd("unserve")?;
    drop(peer);

    say!("\nper-call overhead (32 KiB `sum` travels by Ref):");
    say!(
        "{:<8} {:<8} {:<6} {:>10} {:>10} {:>12} {:>14}",
        "client",
        "service",
        "method",
        "p50 us",
        "p99 us",
        "calls/s",
        "p50 vs Rust"
    );
    for o in &overhead {
        let method = o.text("method").unwrap_or("");
        let rust = overhead
            .iter()
            .find(|r| r.text("client") == Some("rust") && r.text("method") == Some(method))
            .map_or(f64::NAN, |r| num(r, "p50_us"));
        say!(
            "{:<8} {:<8} {:<6} {:>10.2} {:>10.2} {:>12.0} {:>13.2}x",
            o.text("client").unwrap_or(""),
            o.text("service").unwrap_or(""),
            method,
            num(o, "p50_us"),
            num(o, "p99_us"),
            num(o, "calls_s"),
            num(o, "p50_us") / rust
        );
    }

    say!("\nFigure 8: 32 KiB array by reference, callee writes a fraction of it:");
    say!(
        "{:<18} {:>5} {:>10} {:>10} {:>10} {:>10}",
        "system",
        "write",
        "calls/s",
        "p50 us",
        "p99 us",
        "vs Ray"
    );
    let ray: Vec<(f64, f64)> = fig8
        .iter()
        .filter(|r| r.text("system") == Some("ray"))
        .map(|r| (num(r, "fraction"), num(r, "calls_s")))
        .collect();
    let ray = |f: f64| ray.iter().find(|r| r.0 == f).map_or(f64::NAN, |r| r.1);
    let mut min_pool_ratio = f64::INFINITY;
    for o in &mut fig8 {
        let f = num(o, "fraction");
        let ratio = num(o, "calls_s") / ray(f);
        o.num("over_ray", ratio);
        if o.text("system") == Some("dmrpc-pool") {
            min_pool_ratio = min_pool_ratio.min(ratio);
        }
        say!(
            "{:<18} {:>4}% {:>10.0} {:>10.1} {:>10.1} {:>9.1}x",
            o.text("system").unwrap_or(""),
            f,
            num(o, "calls_s"),
            num(o, "p50_us"),
            num(o, "p99_us"),
            ratio
        );
    }
    say!("dmrpc pool over Ray: at least {min_pool_ratio:.0}x at every fraction (target: 100x)");
    bp.check()?;

    let mut res = Obj::default();
    res.str("benchmark", "ray");
    res.str(
        "method",
        "Figure 8 of DmRPC from Python: each call creates a 32 KiB NumPy array and passes it by reference to a callee process that writes 0-100% of it (dmrpc: pool by Ref with an explicit CoW buffer, pool inline, memory server; Ray: ray.put + actor); closed loop, one call at a time. Overhead: noop and 32 KiB sum calls from Rust and from Python to the same Rust service, and from Python to a Python service",
    );
    res.obj("machine", &super::machine());
    res.num("min_pool_over_ray", min_pool_ratio);
    res.arr("overhead", &overhead);
    res.arr("rows", &fig8);
    super::write_results(
        a,
        "ray",
        &Chart {
            title: "bench ray: 32 KiB by reference, callee writes a fraction",
            x: "fraction",
            ys: &["calls_s"],
            by: Some("system"),
            y_label: "calls/s",
            log_x: false,
            log_y: true,
        },
        &res,
        &fig8,
        &[
            "system", "fraction", "calls_s", "avg_us", "p50_us", "p99_us", "over_ray",
        ],
    )
}

//! `dmrpc demo`: a client, a load balancer and two workers, as four
//! processes calling each other over shared-memory channels.
//!
//! The client sends requests of each `--sizes` to the load balancer
//! (`demo/lb`), which forwards each, round robin, to one of two workers
//! (`demo/worker/0`, `demo/worker/1`). A worker reads every byte
//! (checksum), transforms the data (rewrites its first 4 KiB) and answers
//! with the transformed data. Two modes, same processes, same code:
//!
//! * **by reference** — the client writes the request into the pool and a
//!   40-byte Ref travels; the load balancer forwards the Ref without
//!   touching the data; the worker maps it, reads it, and its write copies
//!   just the one page it changes (copy-on-write): the client's data stays
//!   intact; the answer travels back by Ref too.
//! * **by value** — every payload travels inline in the frames (the bytes
//!   are copied into each ring and out of it, at every hop, both ways):
//!   what an RPC framework without a shared pool does.
//!
//! For each size it prints latency and throughput of both modes, measured
//! after a warm-up that is not counted, in rounds in which the two take
//! turns (so that a drift of the host's speed does not favour either),
//! with the range of the ratio over the rounds. It checks every answer,
//! shuts the services down and ends with `pool check --deep`.

use anyhow::{bail, Context, Result};
use clap::Args;
use dm_pool::{AttachOptions, Pool, PoolConfig};
use dm_rpc::{Client, Config, Node, Payload, RpcError};
use dmrpc::{fmt_size, parse_size};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Pool name (created under /dev/shm; replaced if it is too small and
    /// nobody is attached).
    #[arg(long, default_value = "demo")]
    pub pool: String,
    /// Sizes of the requests, comma separated: where by reference starts
    /// to win. At most 64 MiB (what a shared-memory connection carries by
    /// value).
    #[arg(long, default_value = "64KiB,1MiB,8MiB", value_delimiter = ',', value_parser = parse_size)]
    pub sizes: Vec<u64>,
    /// Calls per mode and size.
    #[arg(long, default_value_t = 300)]
    pub calls: usize,
}

/// A hidden service process of the demo (`dmrpc __demo-service`).
#[derive(Args, Debug)]
pub struct ServiceArgs {
    #[arg(long)]
    pub path: PathBuf,
    /// `lb` or `worker`.
    #[arg(long)]
    pub role: String,
    /// Service name (the by-value twin is NAME/v).
    #[arg(long)]
    pub name: String,
    /// For the load balancer: the workers, comma separated.
    #[arg(long, default_value = "")]
    pub workers: String,
}

const EDIT: usize = 4096;

/// The worker's "real work": a checksum over every byte (four independent
/// lanes of 64-bit words, so it runs at memory speed). Also the cluster's
/// last tier's.
pub(crate) fn checksum(segs: &[&[u8]]) -> u64 {
    let mut lanes = [0u64; 4];
    let mut tail = 0u64;
    for s in segs {
        let mut chunks = s.chunks_exact(32);
        for c in &mut chunks {
            for (k, l) in lanes.iter_mut().enumerate() {
                let mut w = [0u8; 8];
                w.copy_from_slice(&c[k * 8..k * 8 + 8]);
                *l = l.rotate_left(1) ^ u64::from_le_bytes(w);
            }
        }
        for &b in chunks.remainder() {
            tail = tail.rotate_left(7) ^ b as u64;
        }
    }
    lanes
        .iter()
        .fold(tail, |h, &l| (h ^ l).wrapping_mul(0x0100_0000_01b3))
}

/// The transformation a worker applies: the first 4 KiB inverted.
fn transform_head(b: &mut [u8]) {
    for x in b.iter_mut().take(EDIT) {
        *x = !*x;
    }
}

fn ring_for(size: u64) -> u32 {
    // By value, a request's frame in one record of a ring where it fits
    // (rings are at most 16 MiB; a larger frame goes in parts).
    ((size + 4096) * 2)
        .next_power_of_two()
        .clamp(64 << 10, 16 << 20) as u32
}

fn node_pair(pool: &Pool) -> (Node, Node) {
    let by_ref = Node::with_config(
        pool.clone(),
        Config {
            // Every request of the demo by Ref, whatever its size.
            inline_max: 0,
            ..Default::default()
        },
    );
    (by_ref, Node::with_config(pool.clone(), Config::by_value()))
}

/// One service process: serves NAME by reference and NAME/v by value.
pub fn service(a: ServiceArgs) -> Result<()> {
    let pool = Pool::open(
        &a.path,
        AttachOptions {
            name: Some(format!("demo-{}", a.role)),
            ..Default::default()
        },
    )?;
    let (by_ref, by_value) = node_pair(&pool);
    let mut servers = Vec::new();
    for (node, suffix) in [(&by_ref, ""), (&by_value, "/v")] {
        let name = format!("{}{suffix}", a.name);
        let b = node.server(&name);
        let s = match a.role.as_str() {
            "worker" => b.method("transform", |c| {
                let mut p = c.take_payload();
                // Read every byte.
                std::hint::black_box(checksum(&p.segments()?));
                // Rewrite the head, the same code both ways. By Ref the
                // write copies only the page it lands in (copy-on-write):
                // the caller's pages stay intact. By value the bytes are
                // the payload's own.
                let mut head = vec![0u8; EDIT.min(p.len() as usize)];
                p.read(0, &mut head)?;
                transform_head(&mut head);
                p.write(0, &head)?;
                Ok(p)
            }),
            "lb" => {
                let workers: Vec<String> = a
                    .workers
                    .split(',')
                    .filter(|w| !w.is_empty())
                    .map(|w| format!("{w}{suffix}"))
                    .collect();
                if workers.is_empty() {
                    bail!("the load balancer needs --workers");
                }
                let clients: Vec<OnceLock<Client>> =
                    workers.iter().map(|_| OnceLock::new()).collect();
                let next = AtomicUsize::new(0);
                let n = node.clone();
                b.method("transform", move |c| {
                    let k = next.fetch_add(1, Ordering::Relaxed) % workers.len();
                    let cl = match clients[k].get() {
                        Some(cl) => cl,
                        None => {
                            let _ = clients[k].set(n.connect(&workers[k])?);
                            clients[k]
                                .get()
                                .ok_or_else(|| RpcError::internal("worker client"))?
                        }
                    };
                    // By Ref the Ref is forwarded untouched; inline bytes
                    // are copied into the next frame.
                    cl.call("transform", c.payload().forward()?)
                })
                // This process's transport counters: what it copied.
                .method("stats", |_| {
                    let k = dm_rpc::stats::counters();
                    Ok(Payload::from_vec(k.bytes_copied().to_le_bytes().to_vec()))
                })
            }
            r => bail!("unknown role {r}"),
        };
        servers.push(s.spawn()?);
    }
    println!("ready");
    // Serve until the demo closes our stdin.
    for _ in std::io::stdin().lock().lines() {}
    drop(servers);
    Ok(())
}

struct Proc {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Proc {
    fn spawn(path: &Path, role: &str, name: &str, workers: &str) -> Result<Proc> {
        let mut child = Command::new(std::env::current_exe()?)
            .arg("__demo-service")
            .arg("--path")
            .arg(path)
            .args(["--role", role, "--name", name, "--workers", workers])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        let stdin = child.stdin.take();
        let mut line = String::new();
        if let Some(out) = child.stdout.take() {
            BufReader::new(out).read_line(&mut line)?;
        }
        if line.trim() != "ready" {
            bail!("{name} failed to start");
        }
        Ok(Proc { child, stdin })
    }

    fn stop(mut self) -> Result<()> {
        drop(self.stdin.take());
        let st = self.child.wait()?;
        if !st.success() {
            bail!("a demo service exited with {st}");
        }
        Ok(())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        drop(self.stdin.take());
        if let Ok(None) = self.child.try_wait() {
            std::thread::sleep(Duration::from_millis(200));
            if let Ok(None) = self.child.try_wait() {
                let _ = self.child.kill();
            }
            let _ = self.child.wait();
        }
    }
}

fn open_pool(args: &DemoArgs, largest: u64) -> Result<(PathBuf, Pool)> {
    let path = dm_pool::default_path(&args.pool);
    let ring = ring_for(largest);
    let cfg = PoolConfig {
        size: (largest * 16 + (256 << 20)).max(1 << 30),
        channels: Some(16),
        ring_size: ring,
        name: args.pool.clone(),
        ..Default::default()
    };
    let opts = AttachOptions {
        name: Some("dmrpc-demo".into()),
        ..Default::default()
    };
    // A demo pool left by an earlier run or build may be of another format
    // or too small: replace it if nobody uses it.
    if path.exists() {
        let fits = dm_pool::layout_of(&path)
            .map(|l| {
                l.ring_size >= ring
                    && l.n_channels >= 8
                    && l.n_pages as u64 * l.page_size as u64 >= largest * 8
            })
            .unwrap_or(false);
        if !fits {
            let busy = dm_pool::check_path(&path, false).is_ok_and(|r| r.slots_live > 0);
            if busy {
                bail!(
                    "pool {} is in use and too small for this demo; pick another --pool",
                    path.display()
                );
            }
            println!("replacing {} (another format or too small)", path.display());
            std::fs::remove_file(&path)?;
        }
    }
    let pool = Pool::open_or_create(&path, &cfg, opts)
        .with_context(|| format!("opening pool {}", path.display()))?;
    Ok((path, pool))
}

/// How many rounds the two modes take turns in.
const ROUNDS: usize = 6;

/// One mode of the demo: its client and what it measured at one size.
struct Mode {
    name: &'static str,
    by_ref: bool,
    client: Client,
    /// Each call's latency, ms.
    lat: Vec<f64>,
    /// Time spent in its calls, s.
    secs: f64,
    /// Pages copied on write during its calls.
    cow: u64,
    /// Bytes the load balancer copied during its calls.
    copied: u64,
}

impl Mode {
    fn new(name: &'static str, by_ref: bool, client: Client) -> Self {
        Mode {
            name,
            by_ref,
            client,
            lat: Vec::new(),
            secs: 0.0,
            cow: 0,
            copied: 0,
        }
    }

    fn per_s(&self) -> f64 {
        self.lat.len() as f64 / self.secs
    }

    /// The median latency, ms (of sorted latencies).
    fn p50(&self) -> f64 {
        self.lat[self.lat.len() / 2]
    }
}

/// What every call of the demo at one size needs.
struct CallCtx<'a> {
    pool: &'a Pool,
    data: Vec<u8>,
    /// The checksum of a right answer.
    want: u64,
}

impl<'a> CallCtx<'a> {
    fn new(pool: &'a Pool, size: u64) -> Self {
        let data: Vec<u8> = (0..size)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let mut expect = data.clone();
        transform_head(&mut expect);
        let want = checksum(&[&expect]);
        CallCtx { pool, data, want }
    }

    /// One call. Each builds its request from the client's bytes: written
    /// into a pool buffer (by Ref: one copy, then only the Ref travels),
    /// or into the frame's bytes (by value: copied again at every hop).
    fn one(&self, m: &Mode) -> Result<()> {
        let p = if m.by_ref {
            let mut b = self.pool.alloc(self.data.len() as u64)?;
            b.write(0, &self.data)?;
            Payload::from_buffer(b)
        } else {
            Payload::from_vec(self.data.clone())
        };
        let answer = m.client.call("transform", p)?;
        if checksum(&answer.segments()?) != self.want {
            bail!("{}: wrong answer", m.name);
        }
        if answer.in_pool() != m.by_ref {
            bail!("{}: the answer came the other way", m.name);
        }
        Ok(())
    }

    /// `n` calls of mode `m`, timed: their throughput.
    fn round(&self, m: &mut Mode, n: usize) -> Result<f64> {
        let copied0 = lb_copied(&m.client)?;
        let cow0 = self.pool.counters().cow_copies;
        let t0 = Instant::now();
        for _ in 0..n {
            let t = Instant::now();
            self.one(m)?;
            m.lat.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let secs = t0.elapsed().as_secs_f64();
        m.secs += secs;
        m.cow += self.pool.counters().cow_copies - cow0;
        // (The first stats call's own 8-byte answer is in the difference.)
        m.copied += (lb_copied(&m.client)? - copied0).saturating_sub(8);
        Ok(n as f64 / secs)
    }

    /// Both modes at this size: a warm-up round that is not counted, then
    /// `rounds` in which they take turns. Prints their figures, and
    /// returns the ratio of by reference's throughput to by value's, with
    /// its range over the rounds.
    fn compare(&self, clients: [&Client; 2], calls: usize) -> Result<(f64, f64, f64)> {
        let mut modes = [
            Mode::new("by reference", true, clients[0].clone()),
            Mode::new("by value", false, clients[1].clone()),
        ];
        for m in &modes {
            for _ in 0..(calls / 10).max(3) {
                self.one(m)?;
            }
        }
        // The modes take turns, in rounds whose order alternates: on a
        // shared host the speed of both cores drifts over seconds, and one
        // mode measured after the other would carry the drift into the
        // ratio.
        let rounds = ROUNDS.min(calls);
        let mut ratios = Vec::with_capacity(rounds);
        for r in 0..rounds {
            let n = calls / rounds + usize::from(r < calls % rounds);
            let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
            let mut per_s = [0.0; 2];
            for k in order {
                per_s[k] = self.round(&mut modes[k], n)?;
            }
            ratios.push(per_s[0] / per_s[1]);
        }
        let size = self.data.len() as u64;
        for m in &mut modes {
            m.lat.sort_by(|a, b| a.total_cmp(b));
            let p99 = m.lat[((m.lat.len() - 1) as f64 * 0.99) as usize];
            println!(
                "{:<9} {:<14} {:>9.3} {:>9.3} {:>10.0} {:>10.0} {:>15} {:>16.1}",
                if m.by_ref {
                    fmt_size(size)
                } else {
                    String::new()
                },
                m.name,
                m.p50(),
                p99,
                m.per_s(),
                m.per_s() * size as f64 / (1 << 20) as f64,
                fmt_size(m.copied / calls as u64),
                m.cow as f64 / calls as f64
            );
        }
        ratios.sort_by(|a, b| a.total_cmp(b));
        let ratio = modes[0].per_s() / modes[1].per_s();
        println!(
            "{:<9} by reference: {ratio:.1}x the throughput of by value (rounds {:.1}x to {:.1}x), \
             {:.1}x lower p50",
            "",
            ratios[0],
            ratios[rounds - 1],
            modes[1].p50() / modes[0].p50()
        );
        Ok((ratio, ratios[0], ratios[rounds - 1]))
    }
}

/// The bytes the load balancer's transports copied so far (its `stats`).
fn lb_copied(c: &Client) -> Result<u64> {
    let v = c.call("stats", Payload::empty())?.to_vec()?;
    Ok(u64::from_le_bytes(
        v.try_into().map_err(|_| anyhow::anyhow!("bad stats"))?,
    ))
}

pub fn run(args: DemoArgs) -> Result<()> {
    if args.calls == 0 || args.sizes.iter().any(|&s| s < EDIT as u64) {
        bail!("--calls must be at least 1 and every size at least 4KiB");
    }
    let Some(&largest) = args.sizes.iter().max() else {
        bail!("--sizes names no size");
    };
    if largest > 64 << 20 {
        bail!("--sizes are at most 64MiB: what a shared-memory connection carries by value");
    }
    let (path, pool) = open_pool(&args, largest)?;
    println!(
        "dmrpc demo: client -> load balancer -> 2 workers, 4 processes over shared-memory channels"
    );
    println!(
        "{} calls per mode and size, after a warm-up; pool {}",
        args.calls,
        path.display()
    );
    let id = std::process::id();
    let base = format!("demo/{id}");
    let workers: Vec<String> = (0..2).map(|k| format!("{base}/worker/{k}")).collect();
    let mut procs = Vec::new();
    for w in &workers {
        procs.push(Proc::spawn(&path, "worker", w, "")?);
    }
    let lb = format!("{base}/lb");
    procs.push(Proc::spawn(&path, "lb", &lb, &workers.join(","))?);

    let (by_ref, by_value) = node_pair(&pool);
    let clients = [by_ref.connect(&lb)?, by_value.connect(&format!("{lb}/v"))?];
    println!(
        "{:<9} {:<14} {:>9} {:>9} {:>10} {:>10} {:>15} {:>16}",
        "size", "mode", "p50 ms", "p99 ms", "calls/s", "MiB/s", "LB copied/call", "CoW pages/call"
    );
    for &size in &args.sizes {
        CallCtx::new(&pool, size).compare([&clients[0], &clients[1]], args.calls)?;
    }
    // Copy-on-write: the worker wrote into what it received; the client's
    // own buffer (shared with it) must be unchanged.
    let data = CallCtx::new(&pool, largest).data;
    let mut mine = pool.alloc(largest)?;
    mine.write(0, &data)?;
    clients[0].call("transform", mine.dup()?)?;
    if mine.to_vec()? != data {
        bail!("the client's data changed under copy-on-write");
    }
    drop(mine);
    drop(clients);
    for p in procs {
        p.stop()?;
    }
    drop((by_ref, by_value));
    drop(pool);
    let rep = dm_pool::check_path(&path, true)?;
    if !rep.ok() {
        bail!("pool check failed: {:?}", rep.problems);
    }
    println!(
        "pool check --deep: ok ({} pages held, {} services, {} channels left)",
        rep.pages_held, rep.services, rep.channels
    );
    Ok(())
}

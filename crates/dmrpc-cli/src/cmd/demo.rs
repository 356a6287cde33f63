//! `dmrpc demo`: a client, a load balancer and two workers, as four
//! processes calling each other over shared-memory channels.
//!
//! The client sends requests of `--size` bytes to the load balancer
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
//! It prints latency and throughput of both modes, measured in rounds in
//! which the two take turns (so that a drift of the host's speed does not
//! favour either), checks every answer, shuts the services down and ends
//! with `pool check --deep`.

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
    /// Size of each request.
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    pub size: u64,
    /// Calls per mode.
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
/// lanes of 64-bit words, so it runs at memory speed).
fn checksum(segs: &[&[u8]]) -> u64 {
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
    // By value, a request and its frame must fit half a ring.
    ((size + 4096) * 2)
        .next_power_of_two()
        .clamp(64 << 10, 16 << 20) as u32
}

fn node_pair(pool: &Pool) -> (Node, Node) {
    let by_ref = Node::new(pool.clone());
    let by_value = Node::with_config(
        pool.clone(),
        Config {
            inline_max: usize::MAX,
            ..Default::default()
        },
    );
    (by_ref, by_value)
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
                let p = c.take_payload();
                // Read every byte.
                std::hint::black_box(checksum(&p.segments()?));
                if p.in_pool() {
                    // By Ref: keep the pages (own shares) and write: only
                    // the page written is copied; the caller's stay intact.
                    let Some(mut buf) = p.keep()? else {
                        return Err(RpcError::internal("a pool payload without pages"));
                    };
                    let mut head = vec![0u8; EDIT.min(buf.len() as usize)];
                    buf.read(0, &mut head)?;
                    transform_head(&mut head);
                    buf.write(0, &head)?;
                    Ok(Payload::from_buffer(buf))
                } else {
                    // By value: the bytes are already ours.
                    let mut v = p.into_vec()?;
                    transform_head(&mut v);
                    Ok(Payload::from_vec(v))
                }
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

fn open_pool(args: &DemoArgs) -> Result<(PathBuf, Pool)> {
    let path = dm_pool::default_path(&args.pool);
    let ring = ring_for(args.size);
    let cfg = PoolConfig {
        size: (args.size * 16 + (256 << 20)).max(1 << 30),
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
                    && l.n_pages as u64 * l.page_size as u64 >= args.size * 8
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

/// One mode of the demo: its client and what it measured.
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
}

/// What every call of the demo needs.
struct CallCtx<'a> {
    pool: &'a Pool,
    data: &'a [u8],
    /// The checksum of a right answer.
    want: u64,
}

impl CallCtx<'_> {
    /// One call. Each builds its request from the client's bytes: written
    /// into a pool buffer (by Ref: one copy, then only the Ref travels),
    /// or into the frame's bytes (by value: copied again at every hop).
    fn one(&self, m: &Mode) -> Result<()> {
        let p = if m.by_ref {
            let mut b = self.pool.alloc(self.data.len() as u64)?;
            b.write(0, self.data)?;
            Payload::from_buffer(b)
        } else {
            Payload::from_vec(self.data.to_vec())
        };
        let answer = m.client.call("transform", p)?;
        if checksum(&answer.segments()?) != self.want {
            bail!("{}: wrong answer", m.name);
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
}

/// The bytes the load balancer's transports copied so far (its `stats`).
fn lb_copied(c: &Client) -> Result<u64> {
    let v = c.call("stats", Payload::empty())?.to_vec()?;
    Ok(u64::from_le_bytes(
        v.try_into().map_err(|_| anyhow::anyhow!("bad stats"))?,
    ))
}

pub fn run(args: DemoArgs) -> Result<()> {
    if args.calls == 0 || args.size < 8 {
        bail!("--calls must be at least 1 and --size at least 8 bytes");
    }
    if args.size > 4 << 20 {
        bail!("--size is at most 4MiB (by value, a request must fit a ring)");
    }
    let (path, pool) = open_pool(&args)?;
    println!(
        "dmrpc demo: client -> load balancer -> 2 workers, 4 processes over shared-memory channels"
    );
    println!(
        "{} requests, {} calls per mode; pool {}",
        fmt_size(args.size),
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

    let data: Vec<u8> = (0..args.size)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let mut expect = data.clone();
    transform_head(&mut expect);
    let want = checksum(&[&expect]);
    let (by_ref, by_value) = node_pair(&pool);
    let mut modes = [
        Mode::new("by reference", true, by_ref.connect(&lb)?),
        Mode::new("by value", false, by_value.connect(&format!("{lb}/v"))?),
    ];
    let ctx = CallCtx {
        pool: &pool,
        data: &data,
        want,
    };
    for m in &modes {
        for _ in 0..(args.calls / 10).max(3) {
            ctx.one(m)?;
        }
    }
    // The modes take turns, in rounds whose order alternates: on a shared
    // host the speed of both cores drifts over seconds, and one mode
    // measured after the other would carry the drift into the ratio.
    let rounds = ROUNDS.min(args.calls);
    let mut ratios = Vec::with_capacity(rounds);
    for r in 0..rounds {
        let n = args.calls / rounds + usize::from(r < args.calls % rounds);
        let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        let mut per_s = [0.0; 2];
        for k in order {
            per_s[k] = ctx.round(&mut modes[k], n)?;
        }
        ratios.push(per_s[0] / per_s[1]);
    }
    // Copy-on-write: the worker wrote into what it received; the client's
    // own buffer (shared with it) must be unchanged.
    let mut mine = pool.alloc(args.size)?;
    mine.write(0, &data)?;
    let r = mine.share()?;
    modes[0]
        .client
        .call("transform", Payload::from_buffer(pool.map_ref(&r)?))?;
    pool.release_ref(&r)?;
    if mine.to_vec()? != data {
        bail!("the client's data changed under copy-on-write");
    }
    drop(mine);
    println!(
        "{:<14} {:>9} {:>9} {:>10} {:>10} {:>15} {:>16}",
        "mode", "p50 ms", "p99 ms", "calls/s", "MiB/s", "LB copied/call", "CoW pages/call"
    );
    for m in &mut modes {
        m.lat.sort_by(|a, b| a.total_cmp(b));
    }
    let p50 = |m: &Mode| m.lat[m.lat.len() / 2];
    for m in &modes {
        let p99 = m.lat[((m.lat.len() - 1) as f64 * 0.99) as usize];
        println!(
            "{:<14} {:>9.3} {:>9.3} {:>10.0} {:>10.0} {:>15} {:>16.1}",
            m.name,
            p50(m),
            p99,
            m.per_s(),
            m.per_s() * args.size as f64 / (1 << 20) as f64,
            fmt_size(m.copied / args.calls as u64),
            m.cow as f64 / args.calls as f64
        );
    }
    ratios.sort_by(|a, b| a.total_cmp(b));
    println!(
        "by reference: {:.1}x the throughput of by value, {:.1}x lower p50 \
         ({rounds} round{} taking turns: {:.1}x to {:.1}x)",
        modes[0].per_s() / modes[1].per_s(),
        p50(&modes[1]) / p50(&modes[0]),
        if rounds == 1 { "" } else { "s" },
        ratios[0],
        ratios[rounds - 1]
    );
    drop(modes);
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

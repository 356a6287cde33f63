//! `dmrpc demo`: a large buffer handed down a chain of real processes.
//!
//! The client writes a buffer into the pool and sends it through a chain of
//! `--hops` processes connected by pipes (the control channel). Two modes,
//! same processes, same pipes:
//!
//! * **by reference** — only the 40-byte Ref travels; forwarding hops check
//!   it and pass it on without touching the data; the last hop maps it,
//!   reads all of it and writes 4 KiB (copy-on-write copies one page, the
//!   client's buffer is untouched).
//! * **by value** — every hop copies the data into a buffer of its own (what
//!   RPC does when arguments are values), then passes that on.
//!
//! The table compares the two; the pool is checked at the end.

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use dm_pool::{AttachOptions, Pool, PoolConfig, Ref};
use dmrpc::{fmt_size, parse_size};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Pool name (reused if it exists; created under /dev/shm otherwise).
    #[arg(long, default_value = "demo")]
    pub pool: String,
    /// Size of the buffer passed down the chain.
    #[arg(long, default_value = "16MiB", value_parser = parse_size)]
    pub size: u64,
    /// Processes in the chain (the last one reads and writes the data).
    #[arg(long, default_value_t = 4)]
    pub hops: usize,
    /// Calls per mode.
    #[arg(long, default_value_t = 20)]
    pub calls: usize,
}

/// The hidden worker: one process of the chain.
#[derive(Args, Debug)]
pub struct HopArgs {
    #[arg(long)]
    pub path: PathBuf,
    /// The last process: map, read, write, reply.
    #[arg(long)]
    pub last: bool,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| {
            s.get(i..i + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| anyhow!("bad hex"))
        })
        .collect()
}

/// A checksum over every byte of a view, 8 bytes at a time (the "real
/// work" of the last hop: it reads all the data).
fn checksum(segs: &[&[u8]]) -> u64 {
    let mut h = 0u64;
    let mut pos = 0u64;
    for s in segs {
        let mut chunks = s.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            h = h.rotate_left(5) ^ u64::from_le_bytes(w).wrapping_add(pos);
            pos += 1;
        }
        for &b in chunks.remainder() {
            h = h.rotate_left(5) ^ (b as u64).wrapping_add(pos);
            pos += 1;
        }
    }
    h
}

/// Runs one hop: `<mode> <ref-hex>` lines in, the same (or a reply) out.
pub fn hop(args: HopArgs) -> Result<()> {
    let pool = Pool::open(
        &args.path,
        AttachOptions {
            name: Some("dmrpc-demo-hop".into()),
            ..Default::default()
        },
    )?;
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    for line in stdin.lock().lines() {
        let line = line?;
        let mut it = line.split_whitespace();
        let (Some(mode), Some(rh)) = (it.next(), it.next()) else {
            break;
        };
        let r = Ref::from_bytes(&unhex(rh)?)?;
        let fwd = match mode {
            // Forward without touching the data: check the capability, pass it on.
            "ref" => {
                pool.ref_len(&r)?;
                r
            }
            // Copy into a buffer of our own, pass that on.
            "value" => {
                let src = pool.map_ref(&r)?;
                let mut own = pool.alloc(r.len)?;
                let mut at = 0;
                for s in src.segments(0, r.len)? {
                    own.write(at, s)?;
                    at += s.len() as u64;
                }
                drop(src);
                pool.release_ref(&r)?;
                let copy = own.share()?;
                drop(own); // the Ref keeps the pages
                copy
            }
            m => bail!("unknown mode {m}"),
        };
        if args.last {
            let mut mine = pool.map_ref(&fwd)?;
            let sum = checksum(&mine.segments(0, mine.len())?);
            mine.write(0, &[0xAB; 4096])?; // copy-on-write: one page
            let mut head = [0u8; 4096];
            mine.read(0, &mut head)?;
            let after = head.iter().all(|&b| b == 0xAB);
            drop(mine);
            if mode == "value" {
                pool.release_ref(&fwd)?;
            }
            writeln!(out, "ok {sum} {after}")?;
        } else {
            writeln!(out, "{mode} {}", hex(&fwd.to_bytes()))?;
        }
        out.flush()?;
    }
    Ok(())
}

struct Chain {
    children: Vec<Child>,
    head: ChildStdin,
    tail: BufReader<ChildStdout>,
}

impl Chain {
    fn spawn(path: &Path, hops: usize) -> Result<Chain> {
        let exe = std::env::current_exe()?;
        let mut children: Vec<Child> = Vec::new();
        let mut prev: Option<ChildStdout> = None;
        let mut head = None;
        for i in 0..hops {
            let mut cmd = Command::new(&exe);
            cmd.arg("__hop").arg("--path").arg(path);
            if i + 1 == hops {
                cmd.arg("--last");
            }
            cmd.stdout(Stdio::piped());
            match prev.take() {
                Some(o) => {
                    cmd.stdin(Stdio::from(o));
                }
                None => {
                    cmd.stdin(Stdio::piped());
                }
            }
            let mut c = cmd.spawn().context("starting a hop process")?;
            if i == 0 {
                head = c.stdin.take();
            }
            prev = c.stdout.take();
            children.push(c);
        }
        Ok(Chain {
            children,
            head: head.ok_or_else(|| anyhow!("no chain"))?,
            tail: BufReader::new(prev.ok_or_else(|| anyhow!("no chain"))?),
        })
    }

    fn call(&mut self, mode: &str, r: &Ref) -> Result<(u64, bool)> {
        writeln!(self.head, "{mode} {}", hex(&r.to_bytes()))?;
        self.head.flush()?;
        let mut line = String::new();
        if self.tail.read_line(&mut line)? == 0 {
            bail!("the chain closed (a hop failed)");
        }
        let mut it = line.split_whitespace();
        match (it.next(), it.next(), it.next()) {
            (Some("ok"), Some(sum), Some(w)) => Ok((sum.parse()?, w == "true")),
            _ => bail!("unexpected reply {line:?}"),
        }
    }

    fn close(self) -> Result<()> {
        drop(self.head);
        for mut c in self.children {
            let st = c.wait()?;
            if !st.success() {
                bail!("a hop exited with {st}");
            }
        }
        Ok(())
    }
}

struct Row {
    mode: &'static str,
    p50_ms: f64,
    mean_ms: f64,
    gib_s: f64,
    copied: u64,
    cow: u64,
}

pub fn run(args: DemoArgs) -> Result<()> {
    if args.hops == 0 || args.calls == 0 {
        bail!("--hops and --calls must be at least 1");
    }
    let path = dm_pool::default_path(&args.pool);
    // Room for the client's buffer, a copy per hop in flight, and slack.
    let need = args.size * (args.hops as u64 + 3) + (64 << 20);
    let cfg = PoolConfig {
        size: need.max(256 << 20),
        name: args.pool.clone(),
        ..Default::default()
    };
    let opts = AttachOptions {
        name: Some("dmrpc-demo".into()),
        ..Default::default()
    };
    let pool = match Pool::open_or_create(&path, &cfg, opts.clone()) {
        // The demo's own pool, left by a build with another pool format:
        // replace it (nothing can be attached to a pool this build cannot read).
        Err(dm_pool::Error::VersionMismatch { found, supported }) => {
            println!(
                "replacing {} (pool format {found}; this build uses {supported})",
                path.display()
            );
            std::fs::remove_file(&path)?;
            Pool::open_or_create(&path, &cfg, opts)
        }
        r => r,
    }
    .with_context(|| format!("opening pool {}", path.display()))?;
    if args.size > pool.max_len() {
        bail!(
            "--size {} exceeds this pool's largest buffer {}",
            fmt_size(args.size),
            fmt_size(pool.max_len())
        );
    }
    println!(
        "dmrpc demo: a {} buffer through {} processes ({} forwarding, 1 reading and writing), {} calls per mode",
        fmt_size(args.size),
        args.hops,
        args.hops - 1,
        args.calls
    );
    println!(
        "pool {} ({})",
        path.display(),
        fmt_size(pool.layout().total_len)
    );

    let mut buf = pool.alloc(args.size)?;
    let data: Vec<u8> = (0..args.size)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    buf.write(0, &data)?;
    let want = checksum(&[&data]);
    let mut chain = Chain::spawn(&path, args.hops)?;
    let mut rows = Vec::new();
    for mode in ["ref", "value"] {
        let cow0 = pool.counters().cow_copies;
        let mut lat = Vec::with_capacity(args.calls);
        for _ in 0..args.calls + 1 {
            let t = Instant::now();
            let r = buf.share()?;
            let (sum, wrote) = chain.call(mode, &r)?;
            if mode == "ref" {
                pool.release_ref(&r)?;
            }
            lat.push(t.elapsed().as_secs_f64() * 1e3);
            if sum != want || !wrote {
                bail!("the last hop read the wrong data ({mode})");
            }
        }
        lat.remove(0); // warm-up
        lat.sort_by(|a, b| a.total_cmp(b));
        let p50 = lat[lat.len() / 2];
        let mean = lat.iter().sum::<f64>() / lat.len() as f64;
        let cow = (pool.counters().cow_copies - cow0) / (args.calls as u64 + 1);
        let ps = pool.page_size() as u64;
        rows.push(Row {
            mode: if mode == "ref" {
                "by reference"
            } else {
                "by value"
            },
            p50_ms: p50,
            mean_ms: mean,
            gib_s: args.size as f64 / (p50 / 1e3) / (1u64 << 30) as f64,
            copied: if mode == "ref" {
                cow * ps
            } else {
                args.size * args.hops as u64 + cow * ps
            },
            cow,
        });
    }
    chain.close()?;
    if buf.to_vec()? != data {
        bail!("the client's buffer changed: copy-on-write failed");
    }
    drop(buf);

    println!();
    println!(
        "{:<14} {:>12} {:>12} {:>13} {:>16} {:>10}",
        "mode", "p50", "mean", "throughput", "copied/call", "CoW pages"
    );
    for r in &rows {
        println!(
            "{:<14} {:>9.3} ms {:>9.3} ms {:>8.2} GiB/s {:>16} {:>10}",
            r.mode,
            r.p50_ms,
            r.mean_ms,
            r.gib_s,
            fmt_size(r.copied),
            r.cow
        );
    }
    println!(
        "\nby reference: {:.1}x lower latency than copying at every hop; the client's buffer is intact (CoW).",
        rows[1].p50_ms / rows[0].p50_ms
    );
    drop(pool);
    let rep = dm_pool::check_path(&path, true)?;
    if !rep.ok() || rep.pages_held != 0 {
        eprintln!("pool check FAILED:");
        for p in &rep.problems {
            eprintln!("  - {p}");
        }
        bail!("pool check failed ({} pages still held)", rep.pages_held);
    }
    println!(
        "pool check passed: {} pages free, 0 held, no live slots left (free pages verified zero).",
        rep.pages_free
    );
    Ok(())
}

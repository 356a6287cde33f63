//! `dmrpc bench memserver` — 4 KiB reads and writes on a memory server
//! against `redis-server` doing GET/SET of 4 KiB values, same run, same
//! loopback, at 1, 4 and 16 connections.
//!
//! Both servers are their own processes (the memory server is `dmrpc
//! memserver`, two worker threads; Redis with persistence off). Each
//! connection is a client thread doing one request at a time (a closed
//! loop) over 256 keys or buffers of its own, every request timed. The
//! table gives p50/p99 latency and the total throughput, and the ratio of
//! throughputs (memory server / Redis). Redis comes from the distribution
//! (`scripts/deps.sh` installs it); without it the bench says so and fails.
//! Then p50 at one connection in paired rounds (short alternating slices
//! of both, the median of the per-round quotients), since the host's
//! placement of the vCPUs moves Redis's single-connection latency tenfold
//! within a run.
//!
//! Then the client's page cache: 64 Refs of 64 KiB (4 MiB), each call maps
//! one (80% of calls go to the hottest 20% of the Refs), reads all of it
//! and frees the mapping, with a 2 MiB cache and with none: hit rate and
//! latency.

use super::net::Proc;
use super::peer::{median, percentile};
use super::plot::Chart;
use super::serde_like::Obj;
use super::BenchArgs;
use crate::say;
use anyhow::{anyhow, bail, Result};
use dm_memserver::MemPool;
use dm_pool::{Dm, DmBuffer};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const VALUE: usize = 4096;
const KEYS: usize = 256;

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn start_redis() -> Result<(Proc, String)> {
    let port = free_port()?;
    let c = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
        ])
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| {
            anyhow!("cannot run redis-server ({e}): install it with scripts/deps.sh (apt package redis-server)")
        })?;
    let p = Proc(c);
    let addr = format!("127.0.0.1:{port}");
    let t = Instant::now();
    loop {
        if let Ok(mut r) = Redis::connect(&addr) {
            if r.ping().is_ok() {
                break;
            }
        }
        if t.elapsed() > Duration::from_secs(10) {
            bail!("redis-server did not start");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((p, addr))
}

/// A minimal RESP client: PING, SET and GET, one request at a time.
struct Redis {
    w: TcpStream,
    r: BufReader<TcpStream>,
    line: String,
}

impl Redis {
    fn connect(addr: &str) -> Result<Redis> {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        Ok(Redis {
            r: BufReader::new(s.try_clone()?),
            w: s,
            line: String::new(),
        })
    }

    fn cmd(&mut self, parts: &[&[u8]]) -> Result<()> {
        let mut b = format!("*{}\r\n", parts.len()).into_bytes();
        for p in parts {
            b.extend_from_slice(format!("${}\r\n", p.len()).as_bytes());
            b.extend_from_slice(p);
            b.extend_from_slice(b"\r\n");
        }
        Ok(self.w.write_all(&b)?)
    }

    fn reply_line(&mut self) -> Result<&str> {
        self.line.clear();
        self.r.read_line(&mut self.line)?;
        Ok(self.line.trim_end())
    }

    fn ping(&mut self) -> Result<()> {
        self.cmd(&[b"PING"])?;
        match self.reply_line()? {
            "+PONG" => Ok(()),
            l => bail!("redis: {l}"),
        }
    }

    fn set(&mut self, k: &[u8], v: &[u8]) -> Result<()> {
        self.cmd(&[b"SET", k, v])?;
        match self.reply_line()? {
            "+OK" => Ok(()),
            l => bail!("redis: {l}"),
        }
    }

    fn get(&mut self, k: &[u8], out: &mut [u8]) -> Result<()> {
        self.cmd(&[b"GET", k])?;
        let n: usize = self
            .reply_line()?
            .strip_prefix('$')
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| anyhow!("redis: unexpected GET reply"))?;
        if n != out.len() {
            bail!("redis: value of {n} bytes");
        }
        self.r.read_exact(out)?;
        let mut crlf = [0u8; 2];
        self.r.read_exact(&mut crlf)?;
        Ok(())
    }
}

/// p50 at one connection in paired rounds: short slices of the memory
/// server and of Redis, alternating, and the median of the per-round
/// quotients (memory server / Redis; below 1 is better). The host moves
/// the VM's vCPUs during a run, which moves Redis's p50 at one connection
/// between about 6 and 70 us here (cheap when its client shares its
/// core); alternating slices compare the two under the same placement.
fn paired_p50(ms_addr: &str, redis_addr: &str, quick: bool) -> Result<Vec<Obj>> {
    let (rounds, slice) = if quick {
        (5, Duration::from_millis(40))
    } else {
        (15, Duration::from_millis(150))
    };
    let pool = MemPool::connect(&[ms_addr])?;
    let bufs = (0..KEYS)
        .map(|_| pool.alloc(VALUE as u64))
        .collect::<dm_pool::Result<Vec<_>>>()?;
    let mut mem: Vec<Box<dyn Conn>> = vec![Box::new(MemConn { _pool: pool, bufs })];
    let mut red: Vec<Box<dyn Conn>> = vec![Box::new(RedisConn {
        r: Redis::connect(redis_addr)?,
        tag: 1000,
    })];
    fill(&mut mem)?;
    fill(&mut red)?;
    let mut rows = Vec::new();
    for write in [false, true] {
        let op = if write { "write" } else { "read" };
        let mut q = Vec::new();
        for _ in 0..rounds {
            let m = drive(&mut mem, write, slice)?;
            let r = drive(&mut red, write, slice)?;
            q.push(m.p50 / r.p50);
        }
        let (lo, hi) = q
            .iter()
            .fold((f64::MAX, 0f64), |(l, h), &x| (l.min(x), h.max(x)));
        let med = percentile(&mut q, 0.5);
        say!(
            "{op:>5} at 1 connection, paired rounds: p50 memory server / Redis {med:.2}x (median of {rounds}; {lo:.2}-{hi:.2}x)"
        );
        let mut o = Obj::default();
        o.str("op", op);
        o.num("rounds", rounds as f64);
        o.num("p50_ratio_median", med);
        o.num("p50_ratio_min", lo);
        o.num("p50_ratio_max", hi);
        rows.push(o);
    }
    Ok(rows)
}

/// One client connection's work: `op(i)` for key `i` round robin.
trait Conn: Send {
    fn write(&mut self, i: usize, v: &[u8]) -> Result<()>;
    fn read(&mut self, i: usize, out: &mut [u8]) -> Result<()>;
}

struct MemConn {
    _pool: MemPool,
    bufs: Vec<dm_memserver::MemBuffer>,
}

impl Conn for MemConn {
    fn write(&mut self, i: usize, v: &[u8]) -> Result<()> {
        Ok(self.bufs[i].write(0, v)?)
    }
    fn read(&mut self, i: usize, out: &mut [u8]) -> Result<()> {
        Ok(self.bufs[i].read(0, out)?)
    }
}

struct RedisConn {
    r: Redis,
    tag: usize,
}

impl Conn for RedisConn {
    fn write(&mut self, i: usize, v: &[u8]) -> Result<()> {
        self.r.set(format!("k{}:{i}", self.tag).as_bytes(), v)
    }
    fn read(&mut self, i: usize, out: &mut [u8]) -> Result<()> {
        self.r.get(format!("k{}:{i}", self.tag).as_bytes(), out)
    }
}

struct Cell {
    p50: f64,
    p99: f64,
    ops: f64,
}

/// Writes every key of every connection (reads need something to read).
fn fill(conns: &mut [Box<dyn Conn>]) -> Result<()> {
    let value = vec![0x5au8; VALUE];
    for c in conns.iter_mut() {
        for i in 0..KEYS {
            c.write(i, &value)?;
        }
    }
    Ok(())
}

/// Runs `conns` closed loops for `budget`: writes or reads.
fn drive(conns: &mut [Box<dyn Conn>], write: bool, budget: Duration) -> Result<Cell> {
    let value = vec![0x5au8; VALUE];
    let t0 = Instant::now();
    let results: Vec<Result<Vec<f64>>> = std::thread::scope(|s| {
        let hs: Vec<_> = conns
            .iter_mut()
            .map(|c| {
                let value = &value;
                s.spawn(move || -> Result<Vec<f64>> {
                    let mut out = vec![0u8; VALUE];
                    let mut v = Vec::new();
                    let mut i = 0;
                    while t0.elapsed() < budget {
                        let t = Instant::now();
                        if write {
                            c.write(i % KEYS, value)?;
                        } else {
                            c.read(i % KEYS, &mut out)?;
                        }
                        v.push(t.elapsed().as_nanos() as f64);
                        i += 1;
                    }
                    Ok(v)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("a client thread panicked")))
            })
            .collect()
    });
    let wall = t0.elapsed().as_secs_f64();
    let mut all = Vec::new();
    for r in results {
        all.extend(r?);
    }
    let n = all.len() as f64;
    Ok(Cell {
        p50: percentile(&mut all, 0.5),
        p99: percentile(&mut all, 0.99),
        ops: n / wall,
    })
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let budget = Duration::from_millis(if a.quick { 300 } else { 2000 });
    let (_ms, ms_addr) = super::net::start_memserver("256MiB")?;
    let (_redis, redis_addr) = start_redis()?;
    say!("bench memserver: 4 KiB values, closed loop per connection; memory server vs redis-server (same run, loopback)");
    say!(
        "{:>5} {:>6} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>8}",
        "op",
        "conns",
        "ms p50 us",
        "ms p99 us",
        "ms ops/s",
        "redis p50",
        "redis p99",
        "redis ops/s",
        "ratio"
    );
    let mut rows = Vec::new();
    super::progress::start("memserver", 7);
    for write in [false, true] {
        for conns in [1usize, 4, 16] {
            let mut mem: Vec<Box<dyn Conn>> = Vec::new();
            for _ in 0..conns {
                let pool = MemPool::connect(&[&ms_addr])?;
                let bufs = (0..KEYS)
                    .map(|_| pool.alloc(VALUE as u64))
                    .collect::<dm_pool::Result<Vec<_>>>()?;
                mem.push(Box::new(MemConn { _pool: pool, bufs }));
            }
            fill(&mut mem)?;
            let m = drive(&mut mem, write, budget)?;
            let mut red: Vec<Box<dyn Conn>> = Vec::new();
            for tag in 0..conns {
                red.push(Box::new(RedisConn {
                    r: Redis::connect(&redis_addr)?,
                    tag,
                }));
            }
            fill(&mut red)?;
            let r = drive(&mut red, write, budget)?;
            let op = if write { "write" } else { "read" };
            let ratio = m.ops / r.ops;
            say!(
                "{:>5} {:>6} {:>12.1} {:>12.1} {:>12.0} {:>12.1} {:>12.1} {:>12.0} {:>7.2}x",
                op,
                conns,
                m.p50 / 1e3,
                m.p99 / 1e3,
                m.ops,
                r.p50 / 1e3,
                r.p99 / 1e3,
                r.ops,
                ratio
            );
            let mut o = Obj::default();
            o.str("op", op);
            o.num("connections", conns as f64);
            o.num("memserver_p50_ns", m.p50);
            o.num("memserver_p99_ns", m.p99);
            o.num("memserver_ops_per_s", m.ops);
            o.num("redis_p50_ns", r.p50);
            o.num("redis_p99_ns", r.p99);
            o.num("redis_ops_per_s", r.ops);
            o.num("throughput_ratio", ratio);
            rows.push(o);
            super::progress::tick(format!("{op} x{conns}"));
        }
    }
    let paired = paired_p50(&ms_addr, &redis_addr, a.quick)?;
    let auth = auth_bench(&ms_addr, budget)?;
    // The page cache: Refs read through fresh mappings, with and without.
    let cache_rows = cache_bench(&ms_addr, budget)?;
    let mut res = Obj::default();
    res.str("benchmark", "memserver");
    res.arr("paired", &paired);
    res.arr("auth", &auth);
    res.arr("cache", &cache_rows);
    res.str(
        "method",
        "4 KiB reads/writes on dmrpc memserver (2 threads) vs redis-server GET/SET of 4 KiB values, both separate processes on loopback; one closed-loop client thread per connection over 256 keys; every request timed",
    );
    res.obj("machine", &super::machine());
    res.arr("rows", &rows);
    super::write_results(
        a,
        "memserver",
        &Chart {
            title: "bench memserver: 4 KiB operations, memory server vs Redis",
            x: "connections",
            ys: &["memserver_ops_per_s", "redis_ops_per_s"],
            by: Some("op"),
            y_label: "ops/s",
            log_x: true,
            log_y: false,
        },
        &res,
        &rows,
        &[
            "op",
            "connections",
            "memserver_p50_ns",
            "memserver_p99_ns",
            "memserver_ops_per_s",
            "redis_p50_ns",
            "redis_p99_ns",
            "redis_ops_per_s",
            "throughput_ratio",
        ],
    )
}

/// The open server against one with a key and a per-client quota, in
/// the same run: 16 connections, reads and writes, the two servers
/// alternated three times each (medians of the throughputs).
fn auth_bench(open_addr: &str, budget: Duration) -> Result<Vec<Obj>> {
    let dir = std::env::temp_dir().join(format!("dmrpc-bench-key-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("memory.key");
    let key = dm_pool::auth::Key::generate_file(&file)?;
    let path = file.to_string_lossy().into_owned();
    let (_keyed, keyed_addr) = super::net::start_memserver_with(
        "256MiB",
        &["--key-file", &path, "--client-quota", "8MiB"],
    )?;
    let _ = std::fs::remove_dir_all(&dir);
    let connect = |addr: &str, keyed: bool| -> Result<Vec<Box<dyn Conn>>> {
        let mut v: Vec<Box<dyn Conn>> = Vec::new();
        for _ in 0..16 {
            let cfg = dm_memserver::ClientConfig {
                key: keyed.then_some(key),
                ..Default::default()
            };
            let pool = MemPool::connect_with(&[addr], cfg)?;
            let bufs = (0..KEYS)
                .map(|_| pool.alloc(VALUE as u64))
                .collect::<dm_pool::Result<Vec<_>>>()?;
            v.push(Box::new(MemConn { _pool: pool, bufs }));
        }
        fill(&mut v)?;
        Ok(v)
    };
    let mut open = connect(open_addr, false)?;
    let mut keyed = connect(&keyed_addr, true)?;
    say!("\nwith a key and a per-client quota (8 MiB) against the open server, 16 connections, alternated 3 times (medians)");
    say!(
        "{:>5} {:>14} {:>14} {:>8}",
        "op",
        "open ops/s",
        "keyed ops/s",
        "ratio"
    );
    let mut rows = Vec::new();
    for write in [false, true] {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            a.push(drive(&mut open, write, budget)?.ops);
            b.push(drive(&mut keyed, write, budget)?.ops);
        }
        let (a, b) = (median(&mut a), median(&mut b));
        let op = if write { "write" } else { "read" };
        say!("{:>5} {:>14.0} {:>14.0} {:>7.2}x", op, a, b, b / a);
        let mut o = Obj::default();
        o.str("op", op);
        o.num("connections", 16.0);
        o.num("open_ops_per_s", a);
        o.num("keyed_ops_per_s", b);
        o.num("keyed_over_open", b / a);
        rows.push(o);
    }
    Ok(rows)
}

/// The cache experiment: (cache bytes, hit rate, p50, p99, calls/s) rows.
fn cache_bench(addr: &str, budget: Duration) -> Result<Vec<Obj>> {
    const REFS: usize = 64;
    const LEN: usize = 64 << 10;
    let owner = MemPool::connect(&[addr])?;
    let mut refs = Vec::new();
    let mut bufs = Vec::new();
    for i in 0..REFS {
        let mut b = owner.alloc(LEN as u64)?;
        b.write(0, &vec![i as u8; LEN])?;
        refs.push(owner.create_ref(&b, 0, LEN as u64)?);
        bufs.push(b);
    }
    say!(
        "page cache: {REFS} Refs of {} KiB, 80% of reads on 20% of them, each read maps, reads all, frees",
        LEN >> 10
    );
    say!(
        "{:>12} {:>9} {:>10} {:>10} {:>10}",
        "cache",
        "hit rate",
        "p50 us",
        "p99 us",
        "reads/s"
    );
    let mut rows = Vec::new();
    for cache in [2u64 << 20, 0] {
        let p = MemPool::connect_with(
            &[addr],
            dm_memserver::ClientConfig {
                cache_bytes: cache,
                ..Default::default()
            },
        )?;
        let mut out = vec![0u8; LEN];
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut v = Vec::new();
        let t0 = Instant::now();
        while t0.elapsed() < budget {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let hot = seed % 10 < 8;
            let i = if hot {
                (seed >> 8) as usize % (REFS / 5)
            } else {
                REFS / 5 + (seed >> 8) as usize % (REFS - REFS / 5)
            };
            let t = Instant::now();
            let m = p.map_ref(&refs[i])?;
            m.read(0, &mut out)?;
            p.free(m)?;
            v.push(t.elapsed().as_nanos() as f64);
            if out[LEN - 1] != i as u8 {
                bail!("the cache served wrong data");
            }
        }
        let n = v.len() as f64;
        let per_s = n / t0.elapsed().as_secs_f64();
        let hit = p.cache_stats().hit_rate();
        let (p50, p99) = (percentile(&mut v, 0.5), percentile(&mut v, 0.99));
        say!(
            "{:>12} {:>8.0}% {:>10.1} {:>10.1} {:>10.0}",
            if cache == 0 {
                "none".to_string()
            } else {
                format!("{} MiB", cache >> 20)
            },
            hit * 100.0,
            p50 / 1e3,
            p99 / 1e3,
            per_s
        );
        let mut o = Obj::default();
        o.num("cache_bytes", cache as f64);
        o.num("hit_rate", hit);
        o.num("p50_ns", p50);
        o.num("p99_ns", p99);
        o.num("reads_per_s", per_s);
        rows.push(o);
    }
    for r in &refs {
        owner.release_ref(r)?;
    }
    drop(bufs);
    Ok(rows)
}

//! The other process of the benchmarks (`dmrpc __bench-peer`), driven line
//! by line over stdin/stdout, and the helpers the benchmarks share.
//!
//! Commands: `map REF` and `alloc N` (bench cow), `pong FILE` (the raw
//! shared-memory ping-pong floor of bench rtt), `relay FILE IDX LAST` (the
//! raw relay floor of bench chain), `serve NAME POLICY [tcp]` and
//! `unserve` (a no-op RPC service), `chain NAME NEXT|- ref|value` (a tier
//! of bench chain), `lb NAME W1,W2 ref|value` (bench lb's balancer),
//! `image ROLE NAME MODE NEXT KEY MS` (a tier of bench image),
//! `social ROLE MODE ID` (a service of bench social), `grpc tcp NEXT|-`
//! and `grpc uds PATH [NEXT|-]` (the tonic peer, over loopback TCP or a
//! Unix socket, forwarding `Go` to NEXT), `grpcsvc NAME UDS` (bench
//! grpc's example service, every way), `grpctier WAY NAME NEXT` (a tier
//! of its chain), `iox NAME` and `ioxecho NAME
//! MAX` (iceoryx2 servers, with the feature), `quit`.

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use dm_pool::{AttachOptions, Pool, PoolConfig};
use dm_rpc::{Config, Node, Payload, Transport, WaitPolicy};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Args, Debug)]
pub struct PeerArgs {
    #[arg(long)]
    pub path: PathBuf,
}

/// A waiting policy by name: `default`, `spin`, `park`.
pub fn policy(name: &str) -> Result<WaitPolicy> {
    Ok(match name {
        "default" => WaitPolicy::default(),
        "spin" => WaitPolicy::spin_only(),
        "park" => WaitPolicy::park_only(),
        p => bail!("unknown policy {p:?} (default, spin, park)"),
    })
}

/// The peer process.
pub fn peer(a: PeerArgs) -> Result<()> {
    if let Some(cpu) = std::env::var("DMRPC_BENCH_PIN")
        .ok()
        .and_then(|c| c.parse().ok())
    {
        dm_sys::set_affinity(&[cpu]).context("pinning the bench peer")?;
    }
    let pool = Pool::open(
        &a.path,
        AttachOptions {
            // `bench scale`'s pools are larger than the memory they use.
            prefault: std::env::var("DMRPC_BENCH_PREFAULT").as_deref() != Ok("0"),
            name: Some("bench-peer".into()),
            tenant: std::env::var("DMRPC_BENCH_TENANT").ok(),
            ..Default::default()
        },
    )?;
    let mut servers = Vec::new();
    // Tiers of `bench grpc`'s chain (stopped on `unserve`).
    let mut tiers = Vec::new();
    // Set on `unserve`: stops the iceoryx2 server's polling thread.
    #[cfg_attr(not(feature = "iceoryx2"), allow(unused_mut))]
    let mut iox_stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let mut out = std::io::stdout().lock();
    println!("ready");
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let mut it = line.split_whitespace();
        let fourth = line.split_whitespace().nth(3).map(str::to_owned);
        let answer = match (it.next(), it.next(), it.next()) {
            (Some("map"), Some(r), _) => super::cow::peer_map(&pool, r)?,
            (Some("alloc"), n, _) => {
                super::cow::peer_alloc(&pool, n.and_then(|s| s.parse().ok()).unwrap_or(1000))?
            }
            (Some("pong"), Some(file), _) => pong(Path::new(file))?,
            (Some("relay"), Some(file), Some(idx)) => {
                let last = fourth.as_deref().unwrap_or("").parse()?;
                relay(&PingPong::open(Path::new(file))?, idx.parse()?, last);
                "ok".into()
            }
            (Some("serve"), Some(name), Some(pol)) => {
                let node = Node::with_config(
                    pool.clone(),
                    Config {
                        wait: policy(pol)?,
                        tcp_key: (fourth.as_deref() == Some("tcpkey")).then(bench_key),
                        ..Default::default()
                    },
                );
                let transport = match fourth.as_deref() {
                    Some("tcp" | "tcpkey") => Transport::Tcp("127.0.0.1:0".into()),
                    _ => Transport::Shm,
                };
                servers.push(
                    node.server(name)
                        .transport(transport)
                        .method("noop", |_| Ok(Payload::empty()))
                        .method("echo", |c| Ok(c.take_payload()))
                        // Reads every byte (what a real callee does with
                        // an argument) and answers an 8-byte checksum.
                        .method("sum", |c| {
                            let h = sum(&c.payload().segments()?);
                            Ok(Payload::from_vec(h.to_le_bytes().to_vec()))
                        })
                        // One item of the u64 size in the argument
                        // (`bench stream`'s unary baseline), or a stream
                        // of u64 N items of that size.
                        .method("item", |c| super::stream::item(c.node(), c.payload()))
                        .method_stream("items", |c, sink| {
                            let (n, size) = super::stream::items_arg(c.payload())?;
                            for _ in 0..n {
                                sink.send(super::stream::item_of(c.node(), size)?)?;
                            }
                            Ok(())
                        })
                        // The same from an async handler.
                        .method_stream_async("items_async", |c, mut sink| async move {
                            let (n, size) = super::stream::items_arg(&c.payload)?;
                            for _ in 0..n {
                                sink.send(super::stream::item_of(&c.node, size)?).await?;
                            }
                            Ok(())
                        })
                        .spawn()?,
                );
                "ok".into()
            }
            (Some("chain"), Some(name), Some(next)) => {
                servers.push(chain_tier(&pool, name, next, fourth.as_deref(), false)?);
                "ok".into()
            }
            // A last tier registered as one replica of `name`.
            (Some("replica"), Some(name), mode) => {
                servers.push(chain_tier(&pool, name, "-", mode, true)?);
                "ok".into()
            }
            // A replica of `name` that answers `who` with its pid, found
            // through the pool's registry (`pool`, over shared memory) or
            // through etcd at the endpoints given (over TCP).
            (Some("whoreplica"), Some(name), Some(reg)) => {
                servers.push(who_replica(&pool, name, reg)?);
                "ok".into()
            }
            (Some("chainasync"), Some(name), Some(next)) => {
                servers.push(chain_async_tier(&pool, name, next, fourth.as_deref())?);
                "ok".into()
            }
            (Some("chainnet"), Some(name), Some(next)) => {
                let ms = line.split_whitespace().nth(4);
                let s = chain_net_tier(&pool, name, next, fourth.as_deref(), ms)?;
                let port = s
                    .tcp_addr()
                    .and_then(|a| a.rsplit(':').next())
                    .unwrap_or("0")
                    .to_owned();
                servers.push(s);
                format!("ok {port}")
            }
            (Some("lb"), Some(name), Some(workers)) => {
                servers.push(lb(&pool, name, workers, fourth.as_deref())?);
                "ok".into()
            }
            (Some("social"), _, _) => {
                let words: Vec<&str> = line.split_whitespace().skip(1).collect();
                let (s, addr) = super::social::peer_cmd(&pool, &words)?;
                servers.push(s);
                format!("ok {addr}")
            }
            (Some("image"), _, _) => {
                let words: Vec<&str> = line.split_whitespace().skip(1).collect();
                let (s, addr) = super::image::peer_cmd(&pool, &words)?;
                servers.push(s);
                format!("ok {addr}")
            }
            (Some("grpctier"), Some(way), Some(name)) => {
                let next = fourth.as_deref().unwrap_or("-");
                let (t, addr) = super::grpc_ways::peer_tier(&pool, way, name, next)?;
                tiers.push(t);
                format!("ok {addr}")
            }
            (Some("heapdocs"), Some(name), _) => {
                servers.push(super::heap::peer_serve(&pool, name)?);
                "ok".into()
            }
            (Some("heapkv"), Some(name), _) => {
                servers.push(super::heap::peer_kv(&pool, name)?);
                "ok".into()
            }
            (Some("grpcsvc"), Some(name), Some(uds)) => {
                let (s, addr) = super::grpc_ways::peer_serve(&pool, name, uds)?;
                servers.push(s);
                format!("ok {addr}")
            }
            (Some("grpc"), Some("tcp"), next) => {
                let next = next.filter(|n| *n != "-");
                format!("ok {}", super::grpc::serve(super::grpc::Listen::Tcp, next)?)
            }
            (Some("grpc"), Some("uds"), Some(path)) => {
                let l = super::grpc::Listen::Uds(path.into());
                let next = fourth.as_deref().filter(|n| *n != "-");
                format!("ok {}", super::grpc::serve(l, next)?)
            }
            #[cfg(feature = "iceoryx2")]
            (Some("iox"), Some(service), _) => {
                // The iceoryx2 server polls until the next `unserve`.
                iox_stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
                super::iox::serve(service, iox_stop.clone())?;
                "ok".into()
            }
            #[cfg(feature = "iceoryx2")]
            (Some("ioxecho"), Some(service), Some(max)) => {
                iox_stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
                super::iox::serve_bytes(service, max.parse()?, iox_stop.clone())?;
                "ok".into()
            }
            (Some("unserve"), Some("iox"), _) => {
                // Only the iceoryx2 server (its thread stops polling).
                iox_stop.store(true, Ordering::Relaxed);
                "ok".into()
            }
            (Some("unserve"), _, _) => {
                servers.clear();
                tiers.clear();
                iox_stop.store(true, Ordering::Relaxed);
                "ok".into()
            }
            _ => break,
        };
        writeln!(out, "{answer}")?;
        out.flush()?;
    }
    Ok(())
}

/// The node of a bench chain tier: `mode` is `value` (every payload
/// inline) or `ref` (size-aware, the default).
fn chain_node(pool: &Pool, mode: Option<&str>) -> Node {
    let cfg = match mode {
        Some("value") => Config {
            inline_max: usize::MAX,
            ..Default::default()
        },
        _ => Config::default(),
    };
    Node::with_config(pool.clone(), cfg)
}

/// An async tier of bench chain (its calls in flight at once): forwards
/// `go` to `next` with an async client (`-` for none: then it reads every
/// byte and answers an 8-byte checksum).
fn chain_async_tier(
    pool: &Pool,
    name: &str,
    next: &str,
    mode: Option<&str>,
) -> Result<dm_rpc::Server> {
    let node = chain_node(pool, mode);
    // (Shared, so that a call's copy of it is not an allocation.)
    let next: Option<std::sync::Arc<str>> = (next != "-").then(|| next.into());
    let client: std::sync::Arc<std::sync::OnceLock<dm_rpc::AsyncClient>> = Default::default();
    Ok(node
        .server(name)
        .method_async("go", move |c| {
            let (next, client) = (next.clone(), client.clone());
            async move {
                let Some(to) = next else {
                    let h = sum(&c.payload.segments()?);
                    return Ok(Payload::from_vec(h.to_le_bytes().to_vec()));
                };
                let cl = match client.get() {
                    Some(cl) => cl.clone(),
                    None => {
                        let cl = c.node.connect_async(&to)?;
                        let _ = client.set(cl.clone());
                        cl
                    }
                };
                cl.call("go", c.payload.forward()?).await
            }
        })
        .spawn()?)
}

/// A tier of bench chain: forwards `go` to `next` (`-` for none: then it
/// reads every byte and answers an 8-byte checksum). `mode` is `value`
/// (every payload inline) or `ref` (size-aware, the default).
fn chain_tier(
    pool: &Pool,
    name: &str,
    next: &str,
    mode: Option<&str>,
    replica: bool,
) -> Result<dm_rpc::Server> {
    let node = chain_node(pool, mode);
    let next = (next != "-").then(|| next.to_owned());
    let mut b = node.server(name);
    if replica {
        b = b.replica();
    }
    Ok(b.method("go", tier(node.clone(), next, false)).spawn()?)
}

/// The handler of a chain tier: forwards the payload untouched to the
/// tier `next` (a service name, or a TCP address with `tcp`), or, in the
/// last tier, reads every byte and answers an 8-byte checksum.
fn tier(
    n: Node,
    next: Option<String>,
    tcp: bool,
) -> impl Fn(&mut dm_rpc::Call<'_>) -> Result<Payload, dm_rpc::RpcError> + Send + Sync + 'static {
    let client = std::sync::OnceLock::new();
    move |c| match &next {
        Some(to) => {
            let cl = match client.get() {
                Some(cl) => cl,
                None => {
                    let _ = client.set(if tcp {
                        n.connect_tcp(to)?
                    } else {
                        n.connect(to)?
                    });
                    client
                        .get()
                        .ok_or_else(|| dm_rpc::RpcError::internal("next tier"))?
                }
            };
            cl.call("go", c.payload().forward()?)
        }
        None => {
            let h = sum(&c.payload().segments()?);
            Ok(Payload::from_vec(h.to_le_bytes().to_vec()))
        }
    }
}

/// A tier of bench chain's network variant: a TCP service in this peer's
/// own pool, forwarding `go` to the tier at `next` (`host:port`, `-` for
/// none: then it reads every byte). `ref` mode uses the memory server at
/// `ms` (large payloads travel as its Refs), `value` mode none (inline).
fn chain_net_tier(
    pool: &Pool,
    name: &str,
    next: &str,
    mode: Option<&str>,
    ms: Option<&str>,
) -> Result<dm_rpc::Server> {
    // `ref` and `near`: by Ref above the threshold; `auto`: the choice
    // learned; `value`: no memory server. `ms`: the memory servers,
    // comma separated.
    let choice = match mode {
        Some("auto") => dm_rpc::RemoteChoice::Measured,
        _ => dm_rpc::RemoteChoice::Threshold,
    };
    let cfg = Config {
        remote_choice: choice,
        ..Config::default()
    };
    let mut node = Node::with_config(pool.clone(), super::net::node_config(cfg));
    if matches!(mode, Some("ref" | "near" | "auto")) {
        let addrs = ms.ok_or_else(|| anyhow!("{mode:?} mode needs a memory server"))?;
        node = node.with_memserver(super::net::memservers(addrs, Default::default())?);
    }
    let next = (next != "-").then(|| next.to_owned());
    Ok(node
        .server(name)
        .transport(Transport::Tcp(format!("{}:0", super::net::listen_ip())))
        .method("go", tier(node.clone(), next, true))
        .spawn()?)
}

/// The load balancer of bench lb: forwards `go` round robin to `workers`
/// (comma separated) and answers `stats` with this process's transport
/// counters (inline bytes in, out, Refs in, out: four u64).
fn lb(pool: &Pool, name: &str, workers: &str, mode: Option<&str>) -> Result<dm_rpc::Server> {
    let cfg = match mode {
        Some("value") => Config {
            inline_max: usize::MAX,
            ..Default::default()
        },
        _ => Config {
            inline_max: 0,
            ..Default::default()
        },
    };
    let node = Node::with_config(pool.clone(), cfg);
    let workers: Vec<String> = workers.split(',').map(str::to_owned).collect();
    let clients: Vec<std::sync::OnceLock<dm_rpc::Client>> =
        workers.iter().map(|_| std::sync::OnceLock::new()).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let n = node.clone();
    Ok(node
        .server(name)
        .method("go", move |c| {
            let k = next.fetch_add(1, Ordering::Relaxed) % workers.len();
            let cl = match clients[k].get() {
                Some(cl) => cl,
                None => {
                    let _ = clients[k].set(n.connect(&workers[k])?);
                    clients[k]
                        .get()
                        .ok_or_else(|| dm_rpc::RpcError::internal("worker"))?
                }
            };
            cl.call("go", c.payload().forward()?)
        })
        .method("stats", |_| {
            let k = dm_rpc::stats::counters();
            let mut v = Vec::new();
            for x in [k.inline_in, k.inline_out, k.refs_in, k.refs_out] {
                v.extend_from_slice(&x.to_le_bytes());
            }
            Ok(Payload::from_vec(v))
        })
        .spawn()?)
}

/// What a callee does with an argument in the benchmarks: reads every
/// byte, as a wrapping sum of little-endian u64 words (the tail bytes
/// added one by one). Vectorizes, so it runs at memory speed.
pub fn sum(segs: &[&[u8]]) -> u64 {
    let mut h = 0u64;
    for s in segs {
        let mut words = s.chunks_exact(8);
        h = words.by_ref().fold(h, |a, w| {
            let mut x = [0u8; 8];
            x.copy_from_slice(w);
            a.wrapping_add(u64::from_le_bytes(x))
        });
        h = words
            .remainder()
            .iter()
            .fold(h, |a, &b| a.wrapping_add(b as u64));
    }
    h
}

/// The two words of the ping-pong file, on separate cache lines.
pub struct PingPong {
    file: dm_sys::mem::SharedFile,
}

impl PingPong {
    pub fn create(path: &Path) -> Result<PingPong> {
        Ok(PingPong {
            file: dm_sys::mem::SharedFile::create(path, 4096, dm_sys::mem::Access::Own)?,
        })
    }

    pub fn open(path: &Path) -> Result<PingPong> {
        Ok(PingPong {
            file: dm_sys::mem::SharedFile::open(path, None, dm_sys::mem::Access::Own)?,
        })
    }

    /// The word on cache line `line` (< 64).
    pub fn word(&self, line: usize) -> &AtomicU64 {
        assert!(line < 64, "the file has 64 cache lines");
        // SAFETY: the file is 4096 bytes, mapped shared for our lifetime;
        // each of its 64 lines starts with a 64-byte aligned u64, valid for
        // any bits.
        unsafe { &*(self.file.base().add(line * 64) as *const AtomicU64) }
    }

    pub fn ping(&self) -> &AtomicU64 {
        self.word(0)
    }

    pub fn pong(&self) -> &AtomicU64 {
        self.word(1)
    }
}

/// Echoes every new ping value into pong until ping is `u64::MAX`.
fn pong(path: &Path) -> Result<String> {
    let pp = PingPong::open(path)?;
    // The file starts zeroed; the client may have pinged already.
    let mut last = 0;
    loop {
        let v = pp.ping().load(Ordering::Acquire);
        if v == last {
            std::hint::spin_loop();
            continue;
        }
        if v == u64::MAX {
            return Ok("ok".into());
        }
        pp.pong().store(v, Ordering::Release);
        last = v;
    }
}

/// Waits, yielding the core between looks, until `w` holds `want` or
/// `u64::MAX` (the end); says whether it was `want`.
pub fn yield_until(w: &AtomicU64, want: u64) -> bool {
    loop {
        match w.load(Ordering::Acquire) {
            v if v == want => return true,
            u64::MAX => return false,
            _ => dm_sys::sched_yield(),
        }
    }
}

/// Participant `idx` (1..=`last`) of the raw relay, the floor of bench
/// chain: a token goes down from participant 0 through `last` and back up,
/// each participant yielding its core while it waits (the cheapest hand-off
/// when processes outnumber cores). Participant `i` waits on line `2i`
/// (down) and `2i + 1` (up). Ends when the token is `u64::MAX`.
pub fn relay(pp: &PingPong, idx: usize, last: usize) {
    let (down, up) = (|i: usize| pp.word(2 * i), |i: usize| pp.word(2 * i + 1));
    let mut k = 1;
    loop {
        if !yield_until(down(idx), k) {
            if idx < last {
                down(idx + 1).store(u64::MAX, Ordering::Release);
            }
            return;
        }
        if idx < last {
            down(idx + 1).store(k, Ordering::Release);
            if !yield_until(up(idx), k) {
                return;
            }
        }
        up(idx - 1).store(k, Ordering::Release);
        k += 1;
    }
}

/// A running peer process.
pub struct Peer {
    child: Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
}

impl Peer {
    pub fn spawn(path: &Path, env: &[(&str, &str)]) -> Result<Peer> {
        let mut c = Command::new(std::env::current_exe()?);
        c.envs(env.iter().copied());
        Peer::spawn_cmd(c, path)
    }

    /// A peer run by `cmd` (this executable, perhaps in another network
    /// namespace, with its environment).
    pub fn spawn_cmd(mut cmd: Command, path: &Path) -> Result<Peer> {
        let mut child = cmd
            .arg("__bench-peer")
            .arg("--path")
            .arg(path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the peer process")?;
        let stdin = child.stdin.take().ok_or_else(|| anyhow!("no stdin"))?;
        let out = BufReader::new(child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?);
        let mut p = Peer { child, stdin, out };
        if p.line()? != "ready" {
            bail!("peer failed to start");
        }
        Ok(p)
    }

    /// The peer's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn line(&mut self) -> Result<String> {
        let mut s = String::new();
        if self.out.read_line(&mut s)? == 0 {
            bail!("the peer exited");
        }
        Ok(s.trim().to_string())
    }

    pub fn send(&mut self, cmd: &str) -> Result<()> {
        writeln!(self.stdin, "{cmd}")?;
        Ok(self.stdin.flush()?)
    }

    pub fn ok_nums(&mut self) -> Result<Vec<f64>> {
        let l = self.line()?;
        let mut it = l.split_whitespace();
        if it.next() != Some("ok") {
            bail!("peer: {l}");
        }
        Ok(it.filter_map(|x| x.parse().ok()).collect())
    }

    /// Sends a command and expects `ok`.
    pub fn cmd(&mut self, cmd: &str) -> Result<Vec<f64>> {
        self.send(cmd)?;
        self.ok_nums()
    }

    /// Sends a command and expects `ok TEXT`; returns TEXT.
    pub fn cmd_text(&mut self, cmd: &str) -> Result<String> {
        self.send(cmd)?;
        let l = self.line()?;
        match l.strip_prefix("ok ") {
            Some(t) => Ok(t.trim().to_owned()),
            None => bail!("peer: {l}"),
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.wait();
    }
}

/// Runs `f` on `n` scoped threads (given each its index) and collects
/// their results, in order; a thread's error or panic fails the lot.
pub fn on_threads<T: Send>(n: usize, f: impl Fn(usize) -> Result<T> + Sync) -> Result<Vec<T>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|i| {
                let f = &f;
                s.spawn(move || f(i))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().map_err(|_| anyhow!("a client thread panicked"))?)
            .collect()
    })
}

/// Rounds in which the modes of a benchmark's cell take turns.
pub const TURN_ROUNDS: usize = 5;

/// Runs `n` modes in turns: [`TURN_ROUNDS`] rounds, each calling
/// `run(mode)` for every mode, the order rotating every round, so that a
/// drift of the machine's speed during a cell weighs on each mode alike.
pub fn in_turns(n: usize, mut run: impl FnMut(usize) -> anyhow::Result<()>) -> anyhow::Result<()> {
    for round in 0..TURN_ROUNDS {
        for j in 0..n {
            run((j + round) % n)?;
        }
    }
    Ok(())
}

/// The median over rounds of mode `m`'s rate against the best of the
/// other modes in the same round; `rates[mode][round]`. Robust to a
/// round that the machine slowed for one mode alone, which a ratio of
/// the totals is not.
pub fn over_best_by_round(rates: &[Vec<f64>], m: usize) -> f64 {
    let rounds = rates.iter().map(Vec::len).min().unwrap_or(0);
    let mut v: Vec<f64> = (0..rounds)
        .map(|r| {
            let best = (0..rates.len())
                .filter(|&o| o != m)
                .map(|o| rates[o][r])
                .fold(0.0, f64::max);
            rates[m][r] / best
        })
        .collect();
    median(&mut v)
}

/// Median (sorts in place).
pub fn median(v: &mut [f64]) -> f64 {
    percentile(v, 0.5)
}

/// The `q` quantile (0..=1) of `v` (sorts in place); NaN if empty.
pub fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() - 1) as f64 * q).round() as usize;
    v[i.min(v.len() - 1)]
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A pool of its own for one benchmark run, removed when the run ends:
/// `/dev/shm/dmrpc-bench-NAME-PID.pool` with `cfg`, attached here with
/// every page pre-faulted (so no first touch is timed).
pub struct BenchPool {
    /// The attached pool.
    pub pool: Pool,
    /// Its path (for peer processes).
    pub path: PathBuf,
    _file: TempFile,
}

impl BenchPool {
    pub fn create(name: &str, cfg: PoolConfig) -> Result<BenchPool> {
        let path = PathBuf::from(format!(
            "/dev/shm/dmrpc-bench-{name}-{}.pool",
            std::process::id()
        ));
        let file = TempFile(path.clone());
        Pool::create(
            &path,
            &PoolConfig {
                name: format!("bench-{name}"),
                ..cfg
            },
        )?;
        let pool = Pool::open(
            &path,
            AttachOptions {
                prefault: true,
                ..Default::default()
            },
        )?;
        Ok(BenchPool {
            pool,
            path,
            _file: file,
        })
    }

    /// Fails if the pool's invariant does not hold (after a benchmark).
    pub fn check(&self) -> Result<()> {
        let rep = self.pool.check();
        if !rep.ok() {
            bail!("pool check failed after the benchmark: {:?}", rep.problems);
        }
        Ok(())
    }
}

/// A file removed on drop.
pub struct TempFile(pub PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `--pin` for a bench of several processes: this thread on the first of
/// its CPUs, and peer `k` on CPU `k + 1` (mod the CPUs, through
/// `DMRPC_BENCH_PIN`); this thread gets its CPUs back when dropped.
pub struct Pin {
    cpus: Vec<usize>,
    on: bool,
}

impl Pin {
    /// Pins this thread if `want` and there are two CPUs or more.
    pub fn new(want: bool) -> Result<Pin> {
        let cpus = dm_sys::affinity()?;
        let on = want && cpus.len() >= 2;
        if on {
            dm_sys::set_affinity(&cpus[..1])?;
        }
        Ok(Pin { cpus, on })
    }

    /// Whether the processes are pinned.
    pub fn on(&self) -> bool {
        self.on
    }

    /// Spawns peer `k` on `path`, pinned if pinning.
    pub fn spawn(&self, path: &Path, k: usize) -> Result<Peer> {
        if !self.on {
            return Peer::spawn(path, &[]);
        }
        let cpu = self.cpus[(k + 1) % self.cpus.len()].to_string();
        Peer::spawn(path, &[("DMRPC_BENCH_PIN", &cpu)])
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        if self.on {
            let _ = dm_sys::set_affinity(&self.cpus);
        }
    }
}

/// A bench request of `data`: written into a pool buffer that travels by
/// Ref (`mode` "ref": one copy, as by value makes into a vector), or a
/// vector that travels inline.
pub fn request(pool: &Pool, mode: &str, data: &[u8]) -> Result<Payload> {
    Ok(if mode == "ref" {
        let mut b = pool.alloc(data.len() as u64)?;
        b.write(0, data)?;
        Payload::from_buffer(b)
    } else {
        Payload::from_vec(data.to_vec())
    })
}

/// The access key of the benchmarks' keyed TCP services: the same on both
/// ends, and no secret (it measures what proving a key costs).
pub fn bench_key() -> dm_pool::auth::Key {
    dm_pool::auth::Key::from_bytes(*b"dmrpc bench: what a key costs..!")
}

/// The etcd lease of `bench failover`'s processes.
pub const ETCD_LEASE: std::time::Duration = std::time::Duration::from_secs(2);

/// Serves `name` as a replica answering `who` with this process's pid,
/// found through `reg`: `pool`, or etcd's endpoints.
pub fn who_replica(pool: &dm_pool::Pool, name: &str, reg: &str) -> Result<dm_rpc::Server> {
    let pid = std::process::id();
    let (node, transport) = if reg == "pool" {
        (Node::new(pool.clone()), Transport::Shm)
    } else {
        let mut cfg = dm_etcd::EtcdConfig::new(&dm_etcd::parse_endpoints(reg));
        cfg.lease = ETCD_LEASE;
        let r = dm_etcd::EtcdRegistry::connect(cfg)?;
        (
            Node::new(pool.clone()).with_registry(std::sync::Arc::new(r)),
            Transport::Tcp("127.0.0.1:0".into()),
        )
    };
    Ok(node
        .server(name)
        .transport(transport)
        .replica()
        .method("who", move |_| {
            Ok(Payload::from_vec(pid.to_le_bytes().to_vec()))
        })
        .spawn()?)
}

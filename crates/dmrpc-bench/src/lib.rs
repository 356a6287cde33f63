//! `dmrpc bench NAME`: benchmarks that run their baseline in the same
//! invocation and report ratios (the machine is shared and noisy: compare
//! within one run). Results go to `--out` as JSON, CSV and a PNG plot
//! (`plot.rs`).
//!
//! This crate is not published. The `dmrpc` command (crate `dmrpc-cli`)
//! runs it, so that a user of the `dmrpc` library pulls none of the
//! benchmarks' peers (tonic, iceoryx2) or the applications' codecs.
//!
//! * One file per benchmark (`rtt.rs`, `chain.rs`, ...), and [`peer`]: the
//!   other process of a benchmark (`dmrpc __bench-peer`).
//! * [`apps`]: the applications the benchmarks run as separate processes.

pub mod apps;

mod access;
mod chain;
mod cow;
mod failover;
mod grpc;
mod grpc_ways;
mod heap;
mod hosts;
mod image;
#[cfg(feature = "iceoryx2")]
mod iox;
mod lb;
mod memserver;
mod net;
mod peer;
mod plot;
mod ray;
mod rtt;
mod scale;
mod social;
mod stream;
mod threshold;

use anyhow::{bail, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Which benchmark: `cow` (create_ref + map_ref vs copying), `rtt`
    /// (no-op round trip vs the raw shared-memory floor), `threshold`
    /// (inline vs by-Ref arguments: the size-aware crossover), `chain`
    /// (nested calls through 1-7 processes, by Ref vs by value), `lb`
    /// (clients -> load balancer -> workers), `memserver` (4 KiB reads and
    /// writes on a memory server vs Redis), `ray` (DmRPC's Figure 8 from
    /// Python, against Ray), `access` (random 64 B reads: local memory, the
    /// pool, a memory server), `image` (the 7-tier image-processing
    /// application: by Ref vs by value, pool and memory server), `social`
    /// (the social network: throughput, latency against offered load),
    /// `stream` (items of a streaming call vs one call per item), `grpc`
    /// (one generated tonic service five ways: tonic TCP and UDS, HTTP/2
    /// over shared memory, direct, native dmrpc), `heap` (a document store:
    /// pointers into a shared heap, trusted and validated, against prost,
    /// serde_json and bincode; and the cost of seals), `failover` (how
    /// soon balanced clients follow replicas), `scale` (per-operation cost
    /// as a pool is used whole: its size, processes, live Refs, buffer
    /// size, huge pages), or `all`.
    pub name: String,
    /// A short run for smoke tests (well under a minute).
    #[arg(long)]
    pub quick: bool,
    /// Pin the bench's processes, so the scheduler does not move them
    /// during the run: `rtt`'s and `grpc`'s client and peer on CPUs 0 and
    /// 1; `chain`'s client (and `grpc`'s chain's) on the first CPU and
    /// tier k on CPU k+1 (mod the CPUs), so neighbouring tiers alternate
    /// between cores; `scale`'s client on the first CPU and its server
    /// on the second. dmrpc and its peers
    /// (tonic) run in the same processes, pinned alike.
    #[arg(long)]
    pub pin: bool,
    /// The links the network variants (`chain`, `image`, `social`,
    /// `cow`) run over, comma separated: `loopback`, or a rate as `tc`
    /// writes it (`10gbit`, `25gbit`): then every process of the variant
    /// runs on a host of its own (a network namespace) whose link is
    /// shaped to that rate with `tbf`. Needs root and iproute2; where
    /// they are missing, shaped links are skipped with a message.
    /// Default: `loopback,10gbit` (`--quick`: `loopback`).
    #[arg(long)]
    pub links: Option<String>,
    /// Directory for the JSON, CSV and PNG results.
    #[arg(long, default_value = "bench-results")]
    pub out: PathBuf,
}

pub use peer::{peer, PeerArgs};

/// Runs the benchmark `a.name` (or `all`), writing its results to `a.out`.
pub fn run(a: BenchArgs) -> Result<()> {
    std::fs::create_dir_all(&a.out)?;
    let r = run_named(&a);
    progress::finish();
    r
}

fn run_named(a: &BenchArgs) -> Result<()> {
    match a.name.as_str() {
        "cow" => cow::run(a),
        "rtt" => rtt::run(a),
        "threshold" => threshold::run(a),
        "chain" => chain::run(a),
        "lb" => lb::run(a),
        "memserver" => memserver::run(a),
        "ray" => ray::run(a),
        "access" => access::run(a),
        "image" => image::run(a),
        "social" => social::run(a),
        "stream" => stream::run(a),
        "grpc" => grpc_ways::run(a),
        "heap" => heap::run(a),
        "failover" => failover::run(a),
        "scale" => scale::run(a),
        "all" => {
            cow::run(a)?;
            rtt::run(a)?;
            threshold::run(a)?;
            chain::run(a)?;
            lb::run(a)?;
            memserver::run(a)?;
            ray::run(a)?;
            access::run(a)?;
            image::run(a)?;
            social::run(a)?;
            stream::run(a)?;
            grpc_ways::run(a)?;
            heap::run(a)?;
            failover::run(a)?;
            scale::run(a)
        }
        n => bail!(
            "unknown benchmark {n:?} (available: cow, rtt, threshold, chain, lb, memserver, ray, access, image, social, stream, grpc, heap, failover, scale, all)"
        ),
    }
}

/// The progress bar of the benchmark running (on stderr, drawn only on a
/// terminal), and printing that keeps it intact: benchmarks print their
/// tables with [`say!`](crate::say), which lifts the bar while a line goes
/// out.
pub mod progress {
    use indicatif::{ProgressBar, ProgressStyle};
    use std::sync::{Mutex, MutexGuard};

    static BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);

    fn bar() -> MutexGuard<'static, Option<ProgressBar>> {
        BAR.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a bar of `cells` steps for benchmark `name`.
    pub fn start(name: &str, cells: u64) {
        let pb = ProgressBar::new(cells).with_prefix(name.to_owned());
        if let Ok(style) =
            ProgressStyle::with_template("{prefix:>10} [{bar:32}] {pos}/{len} {msg} ({elapsed})")
        {
            pb.set_style(style.progress_chars("=> "));
        }
        if let Some(old) = bar().replace(pb) {
            old.finish_and_clear();
        }
    }

    /// One step done; `msg` says what comes next.
    pub fn tick(msg: impl Into<String>) {
        if let Some(pb) = bar().as_ref() {
            pb.set_message(msg.into());
            pb.inc(1);
        }
    }

    /// Removes the bar.
    pub fn finish() {
        if let Some(pb) = bar().take() {
            pb.finish_and_clear();
        }
    }

    /// Prints a line to stdout, lifting the bar while it does.
    pub fn print(line: &str) {
        match bar().as_ref() {
            Some(pb) => pb.suspend(|| println!("{line}")),
            None => println!("{line}"),
        }
    }
}

/// `println!` for benchmarks: keeps the progress bar intact.
#[macro_export]
macro_rules! say {
    () => { $crate::progress::print("") };
    ($($t:tt)*) => { $crate::progress::print(&format!($($t)*)) };
}

/// A machine description recorded with every result.
pub fn machine() -> serde_like::Obj {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut o = serde_like::Obj::default();
    o.str("cpu", &cpu);
    o.num(
        "cores",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1) as f64,
    );
    o.str("kernel", kernel.trim());
    o
}

/// A tiny JSON writer (the results are flat tables; no serde needed).
pub mod serde_like {
    #[derive(Default, Debug, Clone)]
    pub struct Obj(Vec<(String, String)>);

    fn esc(s: &str) -> String {
        s.chars()
            .flat_map(|c| match c {
                '"' => "\\\"".chars().collect::<Vec<_>>(),
                '\\' => "\\\\".chars().collect(),
                c if (c as u32) < 0x20 => format!("\\u{:04x}", c as u32).chars().collect(),
                c => vec![c],
            })
            .collect()
    }

    impl Obj {
        pub fn str(&mut self, k: &str, v: &str) {
            self.0.push((k.into(), format!("\"{}\"", esc(v))));
        }
        pub fn num(&mut self, k: &str, v: f64) {
            let v = if v.is_finite() {
                format!("{v}")
            } else {
                "null".into()
            };
            self.0.push((k.into(), v));
        }
        pub fn obj(&mut self, k: &str, v: &Obj) {
            self.0.push((k.into(), v.render()));
        }
        pub fn arr(&mut self, k: &str, v: &[Obj]) {
            let items: Vec<String> = v.iter().map(|o| o.render()).collect();
            self.0.push((k.into(), format!("[{}]", items.join(","))));
        }
        /// The rendered value of field `k`.
        pub fn get(&self, k: &str) -> Option<&str> {
            self.0.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str())
        }
        /// Field `k` as text: a string's contents (unquoted), or a number.
        pub fn text(&self, k: &str) -> Option<&str> {
            self.get(k).map(|v| v.trim_matches('"'))
        }
        pub fn render(&self) -> String {
            let f: Vec<String> = self
                .0
                .iter()
                .map(|(k, v)| format!("\"{}\":{}", esc(k), v))
                .collect();
            format!("{{{}}}", f.join(","))
        }
    }
}

/// Writes `NAME.json` (the whole result), `NAME.csv` (one line per row,
/// the given columns) and `NAME.png` (`chart` of the rows) under the
/// output directory.
pub fn write_results(
    a: &BenchArgs,
    name: &str,
    chart: &plot::Chart,
    res: &serde_like::Obj,
    rows: &[serde_like::Obj],
    columns: &[&str],
) -> Result<()> {
    let json = a.out.join(format!("{name}.json"));
    std::fs::write(&json, res.render())?;
    let mut csv = columns.join(",") + "\n";
    for r in rows {
        let line: Vec<&str> = columns.iter().map(|c| r.get(c).unwrap_or("")).collect();
        csv += &(line.join(",") + "\n");
    }
    std::fs::write(a.out.join(format!("{name}.csv")), csv)?;
    plot::draw(&a.out.join(format!("{name}.png")), chart, rows)?;
    println!("results: {} (and .csv, .png)", json.display());
    Ok(())
}

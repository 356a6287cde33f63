//! `dmrpc bench scale` — does an operation cost the same in a pool used
//! whole as in a small one?
//!
//! Each dimension grows with every other held still, in one run:
//! - **pool size**, 256 MiB to 16 GiB (default configuration at each size);
//! - **attached processes**, 2 to 64 (a server peer, this process, and
//!   idle peers, each with its lease thread);
//! - **live Refs**, 10^2 to 10^6 (Refs to one shared page, long TTL, in a
//!   pool with room for 1.1 million descriptors);
//! - **buffer size**, 1 MiB to 4 GiB: per page, writing a fresh buffer
//!   whole, sharing it (one count per list of 1024 pages), the first
//!   copy-on-write store into a buffer mapped from the Ref, releasing the
//!   Ref and freeing the buffer;
//! - **pages**: a 1 GiB buffer's first write and share on 4 KiB tmpfs
//!   pages, a huge-page tmpfs, and hugetlbfs with 4 KiB and 2 MiB pool
//!   pages (needs root; skipped with a message otherwise).
//!
//! The small operations timed at each setting, each the median of its
//! iterations: `alloc` (64 KiB), `write` (64 KiB into it), `create_ref`,
//! `map_ref`, `release_ref`, `free`, `sweep` (what the lease thread does
//! each lease period: `Pool::maintain`), a no-op call and a 64 KiB call by
//! Ref (the argument built in the pool) to a server peer over shared
//! memory. The target: each stays within 1.5x of its cheapest setting.

use super::peer::{median, Peer, TempFile};
use super::plot::Chart;
use super::serde_like::Obj;
use super::BenchArgs;
use crate::say;
use anyhow::{Context, Result};
use dm_pool::testing::{HugePages, Mount};
use dm_pool::{AttachOptions, Pool, PoolConfig, Ref};
use dm_rpc::{Client, Node, Payload};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The small operations, in the order they are timed.
const OPS: [&str; 9] = [
    "alloc",
    "write",
    "create_ref",
    "map_ref",
    "release_ref",
    "free",
    "sweep",
    "noop call",
    "64 KiB call",
];

/// The target: an operation's cost at any setting of a dimension over
/// its cost at the smallest.
const FLAT: f64 = 1.5;

/// The largest of `costs` over the first (the smallest setting's).
fn growth(costs: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = costs.collect();
    let first = v.first().copied().unwrap_or(f64::NAN);
    v.iter().copied().fold(0.0, f64::max) / first
}

const KIB64: usize = 64 << 10;

/// A pool made for one setting, attached as a user would (lease thread
/// renewing and reclaiming), its file removed on drop.
struct Setting {
    pool: Pool,
    path: PathBuf,
    _file: TempFile,
}

impl Setting {
    fn new(dir: &Path, tag: &str, cfg: PoolConfig) -> Result<Setting> {
        Self::attached(dir, tag, cfg, false)
    }

    /// With `prefault`, every page of the pool is backed before the
    /// setting is measured (here a page's first touch costs ten times a
    /// later one).
    fn attached(dir: &Path, tag: &str, cfg: PoolConfig, prefault: bool) -> Result<Setting> {
        let path = dir.join(format!(
            "dmrpc-bench-scale-{tag}-{}.pool",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let file = TempFile(path.clone());
        Pool::create(
            &path,
            &PoolConfig {
                name: "bench-scale".into(),
                ..cfg
            },
        )
        .with_context(|| format!("creating {}", path.display()))?;
        let pool = Pool::open(
            &path,
            AttachOptions {
                name: Some("bench-scale".into()),
                prefault,
                ..Default::default()
            },
        )?;
        Ok(Setting {
            pool,
            path,
            _file: file,
        })
    }

    /// A peer process attached to this pool (not faulting the pool in).
    fn peer(&self) -> Result<Peer> {
        Peer::spawn(&self.path, &[("DMRPC_BENCH_PREFAULT", "0")])
    }

    /// A server peer answering `noop` and `sum`, and a client of it. With
    /// `pin`, the peer runs on the second CPU (this process on the first).
    fn served(&self, pin: bool) -> Result<(Peer, Client)> {
        let mut p = if pin {
            Peer::spawn(
                &self.path,
                &[("DMRPC_BENCH_PREFAULT", "0"), ("DMRPC_BENCH_PIN", "1")],
            )?
        } else {
            self.peer()?
        };
        p.cmd("serve scale/server default")?;
        let client = Node::new(self.pool.clone()).connect("scale/server")?;
        Ok((p, client))
    }

    fn check(&self) -> Result<()> {
        let rep = self.pool.check();
        anyhow::ensure!(rep.ok(), "pool check: {:?}", rep.problems);
        Ok(())
    }
}

/// Median ns of each of [`OPS`] over `iters` iterations (after a tenth as
/// many to warm up).
fn small_ops(pool: &Pool, client: &Client, iters: usize) -> Result<Vec<f64>> {
    let data = vec![7u8; KIB64];
    let mut t: Vec<Vec<f64>> = vec![Vec::with_capacity(iters); OPS.len()];
    let ns = |s: Instant| s.elapsed().as_nanos() as f64;
    for i in 0..iters + iters / 10 {
        let mut row = [0f64; OPS.len()];
        let s = Instant::now();
        let mut b = pool.alloc(KIB64 as u64)?;
        row[0] = ns(s);
        let s = Instant::now();
        b.write(0, &data)?;
        row[1] = ns(s);
        let s = Instant::now();
        let r = b.share()?;
        row[2] = ns(s);
        let s = Instant::now();
        let m = pool.map_ref(&r)?;
        row[3] = ns(s);
        drop(m);
        let s = Instant::now();
        pool.release_ref(&r)?;
        row[4] = ns(s);
        let s = Instant::now();
        pool.free(b)?;
        row[5] = ns(s);
        if i % 16 == 0 {
            let s = Instant::now();
            pool.maintain()?;
            row[6] = ns(s);
        }
        let s = Instant::now();
        client.call("noop", Payload::empty())?;
        row[7] = ns(s);
        let s = Instant::now();
        let mut a = pool.alloc(KIB64 as u64)?;
        a.write(0, &data)?;
        let sum = client.call("sum", Payload::from_buffer(a))?;
        row[8] = ns(s);
        anyhow::ensure!(sum.len() == 8, "a sum of 8 bytes, not {}", sum.len());
        if i >= iters / 10 {
            for (k, v) in row.iter().enumerate() {
                if k != 6 || i % 16 == 0 {
                    t[k].push(*v);
                }
            }
        }
    }
    Ok(t.iter_mut().map(|v| median(v)).collect())
}

/// One dimension's small-operation costs: a label per setting, the
/// medians (ns) per setting.
struct Dim {
    name: &'static str,
    settings: Vec<String>,
    costs: Vec<Vec<f64>>,
}

impl Dim {
    fn new(name: &'static str) -> Dim {
        Dim {
            name,
            settings: Vec::new(),
            costs: Vec::new(),
        }
    }

    /// Each operation's costliest setting over its smallest setting.
    fn spread(&self) -> Vec<f64> {
        (0..OPS.len())
            .map(|k| growth(self.costs.iter().map(|c| c[k])))
            .collect()
    }

    fn print(&self) {
        say!("\n{}: median ns per operation", self.name);
        let mut head = format!("{:>12}", "setting");
        for op in OPS {
            head += &format!(" {op:>12}");
        }
        say!("{head}");
        for (s, c) in self.settings.iter().zip(&self.costs) {
            let mut line = format!("{s:>12}");
            for v in c {
                line += &format!(" {v:>12.0}");
            }
            say!("{line}");
        }
        let mut line = format!("{:>12}", "max/first");
        for r in self.spread() {
            line += &format!(" {:>11.2}x", r);
        }
        say!("{line}");
    }

    fn rows(&self, out: &mut Vec<Obj>, summary: &mut Vec<Obj>) {
        for (step, (s, c)) in self.settings.iter().zip(&self.costs).enumerate() {
            for (k, v) in c.iter().enumerate() {
                let mut o = Obj::default();
                o.str("dimension", self.name);
                o.str("setting", s);
                o.num("step", step as f64);
                o.str("op", OPS[k]);
                o.num("ns", *v);
                o.num("over_first", v / self.costs[0][k]);
                out.push(o);
            }
        }
        for (k, r) in self.spread().iter().enumerate() {
            let mut o = Obj::default();
            o.str("dimension", self.name);
            o.str("op", OPS[k]);
            o.num("max_over_first", *r);
            o.str("meets_target", if *r <= FLAT { "yes" } else { "no" });
            summary.push(o);
        }
    }
}

fn pool_sizes(a: &BenchArgs, dir: &Path, iters: usize) -> Result<Dim> {
    let mut d = Dim::new("pool size");
    let sizes: &[u64] = if a.quick {
        &[256 << 20, 1 << 30]
    } else {
        &[256 << 20, 1 << 30, 4 << 30, 16 << 30]
    };
    for &size in sizes {
        super::progress::tick(format!("pool size {}", dmrpc::fmt_size(size)));
        let s = Setting::new(
            dir,
            "size",
            PoolConfig {
                size,
                ..Default::default()
            },
        )?;
        let (peer, client) = s.served(a.pin)?;
        d.costs.push(small_ops(&s.pool, &client, iters)?);
        d.settings.push(dmrpc::fmt_size(size));
        drop((client, peer));
        s.check()?;
    }
    Ok(d)
}

fn processes(a: &BenchArgs, dir: &Path, iters: usize) -> Result<Dim> {
    let mut d = Dim::new("processes");
    let counts: &[usize] = if a.quick { &[2, 8] } else { &[2, 8, 32, 64] };
    let s = Setting::new(
        dir,
        "procs",
        PoolConfig {
            size: 1 << 30,
            slots: 128,
            ..Default::default()
        },
    )?;
    let (peer, client) = s.served(a.pin)?;
    let mut idle = Vec::new();
    for &n in counts {
        super::progress::tick(format!("{n} processes"));
        while idle.len() + 2 < n {
            idle.push(s.peer()?);
        }
        d.costs.push(small_ops(&s.pool, &client, iters)?);
        d.settings.push(n.to_string());
    }
    drop((client, peer, idle));
    s.check()?;
    Ok(d)
}

fn live_refs(a: &BenchArgs, dir: &Path, iters: usize) -> Result<Dim> {
    let mut d = Dim::new("live Refs");
    let top: u32 = if a.quick { 10_000 } else { 1_000_000 };
    let s = Setting::new(
        dir,
        "refs",
        PoolConfig {
            size: 1 << 30,
            descs: Some(top + top / 10 + 4096),
            ..Default::default()
        },
    )?;
    let (peer, client) = s.served(a.pin)?;
    let mut page = s.pool.alloc(4096)?;
    page.write(0, b"one page, many Refs")?;
    let mut refs: Vec<Ref> = Vec::with_capacity(top as usize);
    let mut n = 100u32;
    while n <= top {
        super::progress::tick(format!("{n} live Refs"));
        while refs.len() < n as usize {
            refs.push(
                s.pool
                    .create_ref_ttl(&page, 0, 4096, Duration::from_secs(3600))?,
            );
        }
        d.costs.push(small_ops(&s.pool, &client, iters)?);
        d.settings.push(format!("10^{}", n.ilog10()));
        n *= 10;
    }
    for r in &refs {
        s.pool.release_ref(r)?;
    }
    drop((client, peer, page));
    s.check()?;
    Ok(d)
}

/// Per-page costs of a buffer of each size, ns (and `map_ref` per call).
struct Sizes {
    sizes: Vec<u64>,
    /// write, share, first CoW store, release, free: ns per page; map_ref: ns.
    costs: Vec<[f64; 6]>,
}

const SIZE_OPS: [&str; 6] = [
    "write/page",
    "share/page",
    "map_ref",
    "first CoW/page",
    "release/page",
    "free/page",
];

fn buffer_sizes(a: &BenchArgs, dir: &Path) -> Result<Sizes> {
    let sizes: Vec<u64> = if a.quick {
        vec![1 << 20, 16 << 20, 64 << 20]
    } else {
        vec![1 << 20, 16 << 20, 256 << 20, 1 << 30, 4 << 30]
    };
    let top = *sizes.last().unwrap_or(&(1 << 20));
    // Backed beforehand: each size writes pages the same way (a page's
    // first touch is the `pages` part's question).
    let s = Setting::attached(
        dir,
        "buffers",
        PoolConfig {
            size: top + top / 8 + (64 << 20),
            ..Default::default()
        },
        true,
    )?;
    let chunk = vec![0x5Au8; 16 << 20];
    let reps = if a.quick { 2 } else { 3 };
    let mut out = Sizes {
        sizes: sizes.clone(),
        costs: Vec::new(),
    };
    for &size in &sizes {
        super::progress::tick(format!("a buffer of {}", dmrpc::fmt_size(size)));
        let pages = size.div_ceil(s.pool.page_size() as u64) as f64;
        let mut runs: Vec<[f64; 6]> = Vec::new();
        for _ in 0..reps {
            let ns = |t: Instant| t.elapsed().as_nanos() as f64;
            let t = Instant::now();
            let mut b = s.pool.alloc(size)?;
            let mut at = 0;
            while at < size {
                let n = (size - at).min(chunk.len() as u64) as usize;
                b.write(at, &chunk[..n])?;
                at += n as u64;
            }
            let write = ns(t) / pages;
            let t = Instant::now();
            let r = b.share()?;
            let share = ns(t) / pages;
            // map_ref alone is no per-page work: the median of several,
            // each mapping dropped untouched.
            let mut maps: Vec<f64> = (0..64)
                .map(|_| {
                    let t = Instant::now();
                    let m = s.pool.map_ref(&r)?;
                    let took = ns(t);
                    drop(m);
                    Ok(took)
                })
                .collect::<Result<_>>()?;
            let map = median(&mut maps);
            let mut m = s.pool.map_ref(&r)?;
            let t = Instant::now();
            m.write(0, b"a store")?;
            let cow = ns(t) / pages;
            drop(m);
            let t = Instant::now();
            s.pool.release_ref(&r)?;
            let release = ns(t) / pages;
            let t = Instant::now();
            s.pool.free(b)?;
            let free = ns(t) / pages;
            runs.push([write, share, map, cow, release, free]);
        }
        let mut med = [0f64; 6];
        for (k, m) in med.iter_mut().enumerate() {
            let mut v: Vec<f64> = runs.iter().map(|r| r[k]).collect();
            *m = median(&mut v);
        }
        out.costs.push(med);
    }
    s.check()?;
    Ok(out)
}

/// A 1 GiB buffer's first write and share on each kind of page, ms.
struct Pages {
    rows: Vec<(String, f64, f64)>,
    skipped: Option<String>,
}

fn first_write_and_share(pool: &Pool, len: u64) -> Result<(f64, f64)> {
    let chunk = vec![0xA5u8; 16 << 20];
    let t = Instant::now();
    let mut b = pool.alloc(len)?;
    let mut at = 0;
    while at < len {
        let n = (len - at).min(chunk.len() as u64) as usize;
        b.write(at, &chunk[..n])?;
        at += n as u64;
    }
    let write = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let r = b.share()?;
    let share = t.elapsed().as_secs_f64() * 1e3;
    pool.release_ref(&r)?;
    pool.free(b)?;
    Ok((write, share))
}

fn page_kinds(a: &BenchArgs) -> Result<Pages> {
    let len: u64 = if a.quick { 64 << 20 } else { 1 << 30 };
    let reps = if a.quick { 1 } else { 3 };
    let size = len + (96 << 20);
    let mut out = Pages {
        rows: Vec::new(),
        skipped: None,
    };
    // Each repetition on a new pool: the first write meets pages never
    // touched.
    let mut run = |name: &str, dir: &Path, page_size: u32| -> Result<()> {
        super::progress::tick(format!("a {} buffer on {name}", dmrpc::fmt_size(len)));
        let (mut w, mut sh) = (Vec::new(), Vec::new());
        // The first run on a kind of page is dropped: the kernel's first
        // huge pages after a mount cost several times what later ones do.
        for rep in 0..=reps {
            let s = Setting::new(
                dir,
                "pages",
                PoolConfig {
                    size,
                    page_size,
                    ..Default::default()
                },
            )?;
            let (a, b) = first_write_and_share(&s.pool, len)?;
            if rep > 0 {
                w.push(a);
                sh.push(b);
            }
            s.check()?;
        }
        out.rows
            .push((name.to_owned(), median(&mut w), median(&mut sh)));
        Ok(())
    };
    run("tmpfs, 4 KiB pages", Path::new("/dev/shm"), 4096)?;
    let huge = (|| -> std::result::Result<(HugePages, Mount, Mount), String> {
        let want = 2 * size.div_ceil(2 << 20) + 8;
        let hp = HugePages::more(want)?;
        let hugetlb = Mount::new(
            "bench-hugetlbfs",
            &["-t", "hugetlbfs", "-o", "pagesize=2M", "none"],
        )?;
        let thp = Mount::new(
            "bench-hugetmpfs",
            &[
                "-t",
                "tmpfs",
                "-o",
                &format!("huge=always,size={}", 2 * size),
                "none",
            ],
        )?;
        Ok((hp, hugetlb, thp))
    })();
    match huge {
        Ok((_hp, hugetlb, thp)) => {
            run("huge tmpfs, 4 KiB pages", &thp.0, 4096)?;
            run("hugetlbfs, 4 KiB pages", &hugetlb.0, 4096)?;
            run("hugetlbfs, 2 MiB pages", &hugetlb.0, 2 << 20)?;
        }
        Err(why) => out.skipped = Some(why),
    }
    Ok(out)
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let iters = if a.quick { 300 } else { 3000 };
    if a.pin {
        dm_sys::set_affinity(&[0]).context("pinning the bench")?;
    }
    let dir = Path::new("/dev/shm");
    let steps = if a.quick {
        2 + 2 + 3 + 3 + 4
    } else {
        4 + 4 + 5 + 5 + 4
    };
    super::progress::start("scale", steps);
    let dims = [
        pool_sizes(a, dir, iters)?,
        processes(a, dir, iters)?,
        live_refs(a, dir, iters)?,
    ];
    let sizes = buffer_sizes(a, dir)?;
    let pages = page_kinds(a)?;
    super::progress::tick("done");

    say!("bench scale: per-operation cost as each dimension grows (target: at most {FLAT}x its cost at the smallest setting)");
    let mut rows = Vec::new();
    let mut summary = Vec::new();
    for d in &dims {
        d.print();
        d.rows(&mut rows, &mut summary);
    }

    say!("\nbuffer size: ns per page (map_ref: ns per call)");
    let mut head = format!("{:>12}", "size");
    for op in SIZE_OPS {
        head += &format!(" {op:>15}");
    }
    say!("{head}");
    for (size, c) in sizes.sizes.iter().zip(&sizes.costs) {
        let mut line = format!("{:>12}", dmrpc::fmt_size(*size));
        for v in c {
            // (Shared by lists, a page costs hundredths of a ns.)
            if *v < 1.0 {
                line += &format!(" {v:>15.3}");
            } else {
                line += &format!(" {v:>15.1}");
            }
        }
        say!("{line}");
    }
    let mut line = format!("{:>12}", "max/first");
    for k in 0..SIZE_OPS.len() {
        let g = growth(sizes.costs.iter().map(|c| c[k]));
        line += &format!(" {g:>14.2}x");
        let mut o = Obj::default();
        o.str("dimension", "buffer size");
        o.str("op", SIZE_OPS[k]);
        o.num("max_over_first", g);
        o.str("meets_target", if g <= FLAT { "yes" } else { "no" });
        summary.push(o);
    }
    say!("{line}");
    let mut size_rows = Vec::new();
    for (size, c) in sizes.sizes.iter().zip(&sizes.costs) {
        for (k, v) in c.iter().enumerate() {
            let mut o = Obj::default();
            o.num("bytes", *size as f64);
            o.str("op", SIZE_OPS[k]);
            o.num("ns", *v);
            size_rows.push(o);
        }
    }

    say!("\npages: a buffer's first write and share, ms (4 KiB tmpfs over each)");
    let base = pages.rows.first().map(|r| (r.1, r.2));
    let mut page_rows = Vec::new();
    for (name, w, sh) in &pages.rows {
        let (bw, bs) = base.unwrap_or((*w, *sh));
        say!(
            "{name:>26}  write {w:>8.1}  ({:>4.1}x)  share {sh:>8.2}  ({:>5.1}x)",
            bw / w,
            bs / sh
        );
        let mut o = Obj::default();
        o.str("pages", name);
        o.num("first_write_ms", *w);
        o.num("share_ms", *sh);
        o.num("write_speedup", bw / w);
        o.num("share_speedup", bs / sh);
        page_rows.push(o);
    }
    if let Some(why) = &pages.skipped {
        say!("huge pages skipped: {why}");
    }

    let mut res = Obj::default();
    res.str("benchmark", "scale");
    res.str(
        "method",
        "per-operation cost (median of iterations) as one dimension grows with every other held still: pool size, attached processes, live Refs; per page as a buffer grows; a buffer's first write and share on 4 KiB and huge pages",
    );
    res.obj("machine", &super::machine());
    res.num("iterations", iters as f64);
    res.num("target_flat", FLAT);
    res.arr("summary", &summary);
    res.arr("small_ops", &rows);
    res.arr("buffer_sizes", &size_rows);
    res.arr("pages", &page_rows);
    if let Some(why) = &pages.skipped {
        res.str("huge_pages_skipped", why);
    }
    // The plot: per dimension and step, the costliest of the caller's
    // operations over its cost at the smallest setting, and the sweep's.
    let mut plot_rows: Vec<Obj> = Vec::new();
    for d in &dims {
        for (step, c) in d.costs.iter().enumerate() {
            let over = |k: usize| c[k] / d.costs[0][k];
            let worst = (0..OPS.len())
                .filter(|&k| OPS[k] != "sweep")
                .map(over)
                .fold(0.0, f64::max);
            let sweep = OPS
                .iter()
                .position(|&o| o == "sweep")
                .map_or(f64::NAN, over);
            for (what, v) in [("costliest operation", worst), ("lease sweep", sweep)] {
                let mut o = Obj::default();
                o.num("step", step as f64);
                o.num("over_first", v);
                o.str("series", &format!("{}: {what}", d.name));
                plot_rows.push(o);
            }
        }
    }
    super::write_results(
        a,
        "scale",
        &Chart {
            title: "bench scale: cost over the cost at each dimension's smallest setting",
            x: "step",
            ys: &["over_first"],
            by: Some("series"),
            y_label: "cost / cost at the smallest setting",
            log_x: false,
            log_y: false,
        },
        &res,
        &plot_rows,
        &["series", "step", "over_first"],
    )
}

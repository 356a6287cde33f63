//! `dmrpc pool ...`: create, inspect, check, collect and destroy pools.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use dm_pool::{default_path, Pool, PoolConfig, RefClock};
use dmrpc::{fmt_size, parse_size};
use std::path::PathBuf;

/// `NAME=SIZE` of `--tenant`.
fn parse_tenant(s: &str) -> std::result::Result<(String, u64), String> {
    let (name, size) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not NAME=SIZE"))?;
    Ok((name.to_owned(), parse_size(size)?))
}

/// Which pool: a name (backed by /dev/shm/dmrpc-NAME.pool) or a path.
#[derive(Args, Debug, Clone)]
pub struct Target {
    /// Pool name (its file is /dev/shm/dmrpc-NAME.pool).
    #[arg(default_value = "default")]
    pub name: String,
    /// Use this file or DAX device instead of the default location.
    #[arg(long)]
    pub path: Option<PathBuf>,
}

impl Target {
    pub fn path(&self) -> PathBuf {
        self.path
            .clone()
            .unwrap_or_else(|| default_path(&self.name))
    }
}

/// How a pool is made (`pool create`, `ns create`).
#[derive(Args, Debug, Clone)]
pub struct PoolOptions {
    /// Total size, e.g. 256MiB, 1GiB.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    size: u64,
    /// Page size: the unit of sharing and copy-on-write (power of two, >= 4KiB).
    #[arg(long, default_value = "4KiB", value_parser = parse_size)]
    page_size: u64,
    /// How many processes may attach at once.
    #[arg(long, default_value_t = 256)]
    slots: u32,
    /// How many buffers and Refs may live at once (default: one per
    /// four data pages, at least 1024; each costs 256 bytes).
    #[arg(long)]
    descriptors: Option<u32>,
    /// A process silent this long (ms) is dead; its holdings are reclaimed.
    #[arg(long, default_value_t = 2000)]
    lease_ms: u64,
    /// Default time to live of a Ref (ms).
    #[arg(long, default_value_t = 60_000)]
    ref_ttl_ms: u64,
    /// The clock Refs live by: `host` (this host's monotonic clock: a
    /// step of the wall clock expires nothing; only this host may
    /// attach) or `wall` (for a pool on a device several hosts attach).
    #[arg(long, default_value = "host")]
    ref_clock: RefClock,
    /// How many services may be registered at once.
    #[arg(long, default_value_t = 128)]
    services: u32,
    /// How many shared-memory RPC connections may be open at once
    /// (default: as many as fit in a sixteenth of the pool, at most 64).
    #[arg(long)]
    channels: Option<u32>,
    /// Bytes of each ring of a connection (power of two, 4KiB..16MiB).
    #[arg(long, default_value = "256KiB", value_parser = parse_size)]
    ring_size: u64,
    /// Shared with the file's group (mode 0660): for processes of
    /// several users in one group, which attach with
    /// `AttachOptions::group`. By default the pool is its creator's
    /// user's alone (mode 0600).
    #[arg(long)]
    group: bool,
    /// Allocate the whole file now: a pool that does not fit is
    /// refused, and no write into it can later find the file system
    /// full. On tmpfs this takes the memory at once.
    #[arg(long)]
    reserve: bool,
    /// Bytes of buffers each process may hold at most (e.g. 256MiB).
    #[arg(long, value_parser = parse_size)]
    process_quota: Option<u64>,
    /// A tenant and its quota, NAME=SIZE (repeat for more, at most 16):
    /// processes that attach as it share the quota.
    #[arg(long = "tenant", value_name = "NAME=SIZE", value_parser = parse_tenant)]
    tenants: Vec<(String, u64)>,
    /// How long the holdings of a process of another host or PID
    /// namespace are kept after its lease ran out, in case it was only
    /// stopped and resumes storing into them (0: reused at once).
    #[arg(long, default_value_t = 30)]
    quarantine_secs: u64,
}

impl PoolOptions {
    /// The configuration of a pool named `name`.
    pub fn config(&self, name: &str) -> Result<PoolConfig> {
        Ok(PoolConfig {
            size: self.size,
            page_size: u32::try_from(self.page_size).context("page size too large")?,
            slots: self.slots,
            descs: self.descriptors,
            lease_ms: self.lease_ms,
            ref_ttl_ms: self.ref_ttl_ms,
            services: self.services,
            channels: self.channels,
            ring_size: u32::try_from(self.ring_size).context("ring size too large")?,
            ref_clock: self.ref_clock,
            name: name.to_owned(),
            group: self.group,
            reserve: self.reserve,
            process_quota: self.process_quota,
            tenants: self.tenants.clone(),
            quarantine_ms: self.quarantine_secs.saturating_mul(1000),
        })
    }
}

#[derive(Subcommand, Debug)]
pub enum PoolCmd {
    /// Create a pool (a file under /dev/shm by default, or --path FILE|DAX device).
    Create {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        opts: PoolOptions,
    },
    /// Show the pool's format and geometry.
    Info {
        #[command(flatten)]
        target: Target,
    },
    /// Pages free / cached / held, Refs, buffers, slots.
    Stats {
        #[command(flatten)]
        target: Target,
    },
    /// Verify the invariant (every page free, cached or held; refcounts equal
    /// holders). Exits 1 with a precise report if it fails.
    Check {
        #[command(flatten)]
        target: Target,
        /// Also read the list pages of live buffers and Refs (entries past
        /// their page count must be zero).
        #[arg(long)]
        deep: bool,
        /// Say how far it has come from the start (on stderr). Without
        /// it, a check that runs longer than a second says so every second.
        #[arg(long)]
        progress: bool,
    },
    /// Reclaim dead processes' holdings and expired Refs; with no process
    /// attached, also recount every page and repair.
    Gc {
        #[command(flatten)]
        target: Target,
        /// Also reclaim processes in quarantine (lease expired, holdings
        /// kept in case they were only stopped): say so when they are gone.
        #[arg(long)]
        now: bool,
        /// Say how far it has come from the start (on stderr). Without
        /// it, a gc that runs longer than a second says so every second.
        #[arg(long)]
        progress: bool,
    },
    /// Remove the pool's backing file.
    Destroy {
        #[command(flatten)]
        target: Target,
    },
}

/// Prints a long pass's progress on stderr: every report with `always`,
/// else at most once a second once the pass has run for a second.
fn progress_printer(cmd: &'static str, always: bool) -> impl FnMut(dm_pool::Progress) {
    let start = std::time::Instant::now();
    let mut last: Option<std::time::Instant> = None;
    let second = std::time::Duration::from_secs(1);
    move |p| {
        let now = std::time::Instant::now();
        let due = now - start >= second && last.is_none_or(|l| now - l >= second);
        if always || due {
            last = Some(now);
            eprintln!(
                "{cmd}: {} {} of {} ({:.0}%)",
                p.what,
                p.done,
                p.total,
                100.0 * p.done as f64 / p.total.max(1) as f64
            );
        }
    }
}

pub fn run(cmd: PoolCmd) -> Result<()> {
    match cmd {
        PoolCmd::Create { target, opts } => {
            let path = target.path();
            let cfg = opts.config(&target.name)?;
            Pool::create(&path, &cfg)
                .with_context(|| format!("creating pool {}", path.display()))?;
            let info = dm_pool::check_path(&path, false)?;
            println!(
                "created pool {:?} at {} ({} pages of {})",
                target.name,
                path.display(),
                info.pages_total,
                fmt_size(opts.page_size)
            );
        }
        PoolCmd::Info { target } => {
            let path = target.path();
            let l =
                dm_pool::layout_of(&path).with_context(|| format!("opening {}", path.display()))?;
            println!("pool        {:?}", l.name);
            println!("path        {}", path.display());
            println!("format      version {}", dm_pool::POOL_VERSION);
            println!("id          {:#018x}", l.pool_id);
            println!(
                "size        {} ({} bytes)",
                fmt_size(l.total_len),
                l.total_len
            );
            println!("page size   {}", fmt_size(l.page_size as u64));
            println!(
                "data pages  {} ({})",
                l.n_pages,
                fmt_size(l.n_pages as u64 * l.page_size as u64)
            );
            println!("slots       {}", l.n_slots);
            println!("descriptors {}", l.n_descs);
            println!("services    {}", l.n_services);
            println!(
                "channels    {} (rings of {} each way)",
                l.n_channels,
                fmt_size(l.ring_size as u64)
            );
            println!("max buffer  {}", fmt_size(l.max_len()));
            println!("lease       {} ms", l.lease_ms);
            let clock = match (l.ref_clock, dm_pool::ref_clock_is_ours(&path)?) {
                (RefClock::Wall, _) => "the wall clock",
                (RefClock::Host, true) => "this host's monotonic clock",
                (RefClock::Host, false) => {
                    "another host's or an earlier boot's monotonic clock: \
                     the first process of this host to attach takes it over \
                     once none of that host's lives, and expires its Refs"
                }
            };
            println!("Ref TTL     {} ms, on {clock}", l.ref_ttl_ms);
        }
        PoolCmd::Stats { target } => {
            let path = target.path();
            let r = dm_pool::check_path(&path, false)
                .with_context(|| format!("opening {}", path.display()))?;
            let counters = dm_pool::counters_of(&path)?;
            println!(
                "pages   total {}  free {}  cached {}  held {} (shared {}, lists {})",
                r.pages_total,
                r.pages_free,
                r.pages_cached,
                r.pages_held,
                r.pages_shared,
                r.pages_lists
            );
            println!(
                "refs    live {}  created {}  expired {}",
                r.refs_live, counters.refs_created, counters.refs_expired
            );
            println!(
                "buffers {}  in flight {}  descriptors used {} of {}",
                r.buffers,
                r.descs_in_flight,
                r.buffers + r.refs_live + r.descs_in_flight,
                r.descs_total
            );
            println!(
                "slots   live {}  dead {}  total {}  reclaimed {}",
                r.slots_live, r.slots_dead, r.slots_total, counters.slots_reclaimed
            );
            println!("cow     pages copied {}", counters.cow_copies);
            println!("cow     lists copied {}", counters.lists_copied);
            let layout = dm_pool::layout_of(&path)?;
            let ps = u64::from(layout.page_size);
            if r.process_quota_pages != 0 {
                println!(
                    "quota   every process: {}",
                    fmt_size(r.process_quota_pages * ps)
                );
            }
            for q in &r.quotas {
                let quota = match q.quota_pages {
                    0 => "no quota".to_owned(),
                    n => format!("of {}", fmt_size(n * ps)),
                };
                println!(
                    "quota   {}: {} held, {quota}",
                    q.who,
                    fmt_size(q.held_pages * ps)
                );
            }
            println!(
                "rpc     services {} of {}  channels open {} of {}  (dmrpc ls for the list)",
                r.services, layout.n_services, r.channels, layout.n_channels
            );
        }
        PoolCmd::Check {
            target,
            deep,
            progress,
        } => {
            let path = target.path();
            let r = dm_pool::check_path_with(
                &path,
                deep,
                &mut progress_printer("pool check", progress),
            )
            .with_context(|| format!("opening {}", path.display()))?;
            if r.ok() {
                println!(
                    "pool check passed: {} pages ({} free, {} cached, {} held), {} refs, {} buffers, {} live slots, {} services, {} channels",
                    r.pages_total, r.pages_free, r.pages_cached, r.pages_held, r.refs_live, r.buffers, r.slots_live, r.services, r.channels
                );
            } else {
                eprintln!("pool check FAILED: {} problem(s)", r.problems.len());
                for p in &r.problems {
                    eprintln!("  - {p}");
                }
                std::process::exit(1);
            }
        }
        PoolCmd::Gc {
            target,
            now,
            progress,
        } => {
            let path = target.path();
            let g =
                dm_pool::gc_path_progress(&path, now, &mut progress_printer("pool gc", progress))
                    .with_context(|| format!("opening {}", path.display()))?;
            println!(
                "gc: {} dead slot(s) reclaimed, {} expired Ref(s) reclaimed, recount {}{}",
                g.slots_reclaimed,
                g.refs_expired,
                if g.recounted {
                    "ran"
                } else {
                    "skipped (other processes attached)"
                },
                if g.pages_repaired > 0 {
                    format!(", {} page(s) repaired", g.pages_repaired)
                } else {
                    String::new()
                }
            );
        }
        PoolCmd::Destroy { target } => {
            let path = target.path();
            if !path.exists() && dm_pool::namespace::split(&path).is_none() {
                bail!("no pool at {}", path.display());
            }
            Pool::destroy(&path).with_context(|| format!("destroying {}", path.display()))?;
            println!("destroyed {}", path.display());
        }
    }
    Ok(())
}

//! Measures the per-page cost of sharing against a raw CAS over the same
//! number of words (the floor for a per-page reference count), and the
//! per-call lifecycle of a small argument by Ref (alloc, write, create_ref,
//! map_ref, unmap, release_ref, free) step by step and as a whole, and a
//! 64 KiB argument's Ref made by sharing its buffer or by turning the
//! buffer into it (`into_ref`).
//! Profiling aid: `cargo run --release -p dm-pool --example share_cost`
//! (`share_cost cycle`: only the lifecycle loop, for `perf record`).
use dm_pool::{AttachOptions, Pool, PoolConfig};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::path::PathBuf::from(format!(
        "/dev/shm/dmrpc-share-cost-{}.pool",
        std::process::id()
    ));
    Pool::create(
        &path,
        &PoolConfig {
            size: 256 << 20,
            ..Default::default()
        },
    )?;
    let pool = Pool::open(
        &path,
        AttachOptions {
            prefault: true,
            ..Default::default()
        },
    )?;
    let n = 4096u64;
    let mut b = pool.alloc(n * 4096)?;
    b.write(0, &vec![1u8; (n * 4096) as usize])?;
    // `share_cost cycle`: only the untimed per-call lifecycle (for perf).
    let cycle_only = std::env::args().nth(1).as_deref() == Some("cycle");
    let words: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(1)).collect();
    for _ in 0..if cycle_only { 0 } else { 3 } {
        let t = Instant::now();
        for _ in 0..100 {
            for w in &words {
                let c = w.load(Ordering::Relaxed);
                let _ = w.compare_exchange(c, c + 1, Ordering::AcqRel, Ordering::Relaxed);
            }
        }
        let cas = t.elapsed().as_nanos() as f64 / (100 * n) as f64;
        let (mut create, mut release, mut map, mut unmap) = (0.0, 0.0, 0.0, 0.0);
        for _ in 0..100 {
            let t = Instant::now();
            let r = b.share()?;
            create += t.elapsed().as_nanos() as f64;
            let t = Instant::now();
            let m = pool.map_ref(&r)?;
            map += t.elapsed().as_nanos() as f64;
            let t = Instant::now();
            drop(m);
            unmap += t.elapsed().as_nanos() as f64;
            let t = Instant::now();
            pool.release_ref(&r)?;
            release += t.elapsed().as_nanos() as f64;
        }
        let per = |x: f64| x / (100 * n) as f64;
        println!(
            "per page: raw CAS {cas:.1} ns | create_ref {:.1} map_ref {:.1} unmap {:.1} release_ref {:.1} ns",
            per(create),
            per(map),
            per(unmap),
            per(release)
        );
    }
    // The lifecycle of one call's small argument by Ref: what a caller and
    // a callee do per call, each step timed on its own.
    let data = [3u8; 64];
    let rounds = 200_000u32;
    for _ in 0..if cycle_only { 0 } else { 3 } {
        let mut t_ = [0f64; 7];
        for _ in 0..rounds {
            let t = Instant::now();
            let mut b = pool.alloc(64)?;
            t_[0] += t.elapsed().as_nanos() as f64;
            let t = Instant::now();
            b.write(0, &data)?;
            t_[1] += t.elapsed().as_nanos() as f64;
            let t = Instant::now();
            let r = b.share()?;
            t_[2] += t.elapsed().as_nanos() as f64;
            let t = Instant::now();
            let m = pool.map_ref(&r)?;
            t_[3] += t.elapsed().as_nanos() as f64;
            let t = Instant::now();
            drop(m);
            t_[4] += t.elapsed().as_nanos() as f64;
            let t = Instant::now();
            pool.release_ref(&r)?;
            t_[5] += t.elapsed().as_nanos() as f64;
            let t = Instant::now();
            pool.free(b)?;
            t_[6] += t.elapsed().as_nanos() as f64;
        }
        let per = |x: f64| x / rounds as f64;
        println!(
            "one call's 64 B by Ref: alloc {:.0} write {:.0} create_ref {:.0} map_ref {:.0} unmap {:.0} release_ref {:.0} free {:.0} ns",
            per(t_[0]), per(t_[1]), per(t_[2]), per(t_[3]), per(t_[4]), per(t_[5]), per(t_[6])
        );
    }
    let t = Instant::now();
    let rounds = if cycle_only { rounds * 10 } else { rounds };
    for _ in 0..rounds {
        let mut b = pool.alloc(64)?;
        b.write(0, &data)?;
        let r = b.share()?;
        drop(pool.map_ref(&r)?);
        pool.release_ref(&r)?;
        pool.free(b)?;
    }
    println!(
        "one call's 64 B by Ref, untimed steps: {:.0} ns",
        t.elapsed().as_nanos() as f64 / rounds as f64
    );
    // A 64 KiB argument by Ref, as a caller makes one per call: a Ref
    // sharing the buffer, the buffer then freed (16 pages counted up,
    // then down twice), against the buffer turned into the Ref
    // (`into_ref`: no page counted); both released. Rounds alternate.
    if !cycle_only {
        let big = vec![5u8; 65536];
        let rounds = 50_000u32;
        let (mut shared, mut sealed) = (Vec::new(), Vec::new());
        for _ in 0..4 {
            let t = Instant::now();
            for _ in 0..rounds {
                let mut b = pool.alloc(65536)?;
                b.write(0, &big)?;
                let r = b.share()?;
                pool.free(b)?;
                pool.release_ref(&r)?;
            }
            shared.push(t.elapsed().as_nanos() as f64 / f64::from(rounds));
            let t = Instant::now();
            for _ in 0..rounds {
                let mut b = pool.alloc(65536)?;
                b.write(0, &big)?;
                let r = pool.into_ref(b)?;
                pool.release_ref(&r)?;
            }
            sealed.push(t.elapsed().as_nanos() as f64 / f64::from(rounds));
        }
        let fmt = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.0}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        println!(
            "one call's 64 KiB by Ref (alloc, write, Ref, release), ns per round: share + free {} | into_ref {}",
            fmt(&shared),
            fmt(&sealed)
        );
    }
    drop((b, pool));
    std::fs::remove_file(&path)?;
    Ok(())
}

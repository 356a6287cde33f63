//! Measures the per-page cost of sharing against a raw CAS over the same
//! number of words (the floor for a per-page reference count). Profiling aid:
//! `cargo run --release -p dm-pool --example share_cost`.
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
    let words: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(1)).collect();
    for _ in 0..3 {
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
    drop((b, pool));
    std::fs::remove_file(&path)?;
    Ok(())
}

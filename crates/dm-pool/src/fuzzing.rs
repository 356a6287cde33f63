//! Entry points shared by the cargo-fuzz targets (`fuzz/`) and the test that
//! replays their corpus in the regular suite (`tests/fuzz_corpus.rs`).
//! Each takes peer- or disk-controlled bytes and must never panic.

use crate::{AttachOptions, Layout, Pool, Ref};

/// Decodes bytes as a Ref: a typed error, or an exact round trip.
pub fn ref_decode(data: &[u8]) {
    if let Ok(r) = Ref::from_bytes(data) {
        assert_eq!(
            &r.to_bytes()[..],
            data,
            "a decoded Ref re-encodes to its bytes"
        );
    }
}

/// Parses bytes as a pool header, then opens them as a pool file, runs
/// the invariant check over it, and gc (which repairs what it can): no
/// panic, no hang, no unbounded allocation, whatever the page table,
/// descriptors, slots and registry say.
pub fn pool_open(data: &[u8]) {
    for len in [data.len() as u64, 4096, 1 << 20, u64::MAX] {
        let _ = Layout::parse(data, len);
    }
    let path = std::env::temp_dir().join(format!(
        "dmrpc-fuzz-{}-{:?}.pool",
        std::process::id(),
        std::thread::current().id()
    ));
    if std::fs::write(&path, data).is_ok() {
        let opts = AttachOptions {
            heartbeat: false,
            ..Default::default()
        };
        if let Ok(pool) = Pool::open(&path, opts) {
            let _ = pool.check();
            drop(pool);
            let _ = crate::gc_path(&path);
        }
        let _ = std::fs::remove_file(&path);
    }
}

/// Takes bytes as the start of a device's segment table (the rest of a
/// 16 MiB device reads zeros) and parses, lists, opens, creates in and
/// removes from it: no panic, no hang, and a table that is accepted has
/// its regions inside the device, apart from each other.
pub fn ns_table(data: &[u8]) {
    use crate::namespace::table::{check_entries, Header, TABLE_LEN};
    let dev_len = 16u64 << 20;
    if let Ok(h) = Header::parse(data, Some(dev_len)) {
        if let Ok(used) = check_entries(data, &h) {
            let mut r: Vec<(u64, u64)> = used.iter().map(|(_, e)| (e.offset, e.end())).collect();
            r.sort_unstable();
            assert!(r.iter().all(|&(a, b)| a >= TABLE_LEN && b <= h.device_len));
            assert!(r.windows(2).all(|w| w[0].1 <= w[1].0), "regions overlap");
        }
    }
    let dev = std::env::temp_dir().join(format!(
        "dmrpc-fuzz-ns-{}-{:?}.dev",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_file(&dev);
    let written = std::fs::File::create(&dev).and_then(|f| {
        use std::io::Write;
        (&f).write_all(&data[..data.len().min(TABLE_LEN as usize)])?;
        f.set_len(dev_len)
    });
    if written.is_ok() {
        let _ = crate::namespace::list(&dev);
        let opts = AttachOptions {
            heartbeat: false,
            ..Default::default()
        };
        for name in ["a", "b"] {
            if let Ok(pool) = Pool::open(&crate::namespace::path(&dev, name), opts.clone()) {
                let _ = pool.check();
            }
        }
        let cfg = crate::PoolConfig {
            size: 1 << 20,
            ..Default::default()
        };
        let _ = crate::namespace::create(&dev, "c", &cfg);
        let _ = crate::namespace::remove(&dev, "a");
        let _ = crate::namespace::remove(&dev, "c");
        let _ = std::fs::remove_file(&dev);
    }
}

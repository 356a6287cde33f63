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

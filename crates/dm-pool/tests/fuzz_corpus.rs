//! Replays the saved fuzz corpus (`fuzz/corpus/*`) through the fuzz entry
//! points, so every run of the suite covers what fuzzing found, without
//! needing nightly or cargo-fuzz. Long fuzzing: `scripts/fuzz.sh`.

use std::path::PathBuf;

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.expect("corpus entry").path();
        out.push(std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())));
    }
    assert!(!out.is_empty(), "empty corpus in {}", dir.display());
    out
}

#[test]
fn ref_decode_corpus() {
    for input in corpus("ref_decode") {
        dm_pool::fuzzing::ref_decode(&input);
    }
}

#[test]
fn pool_open_corpus() {
    for input in corpus("pool_open") {
        dm_pool::fuzzing::pool_open(&input);
    }
}

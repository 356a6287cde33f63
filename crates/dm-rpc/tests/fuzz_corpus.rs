//! Replays the saved corpora of the RPC layer's fuzz targets in every test run.

#[test]
fn frame_decode_corpus() {
    replay("frame_decode", dm_rpc::frame::fuzz_decode);
}

#[test]
fn ring_consume_corpus() {
    replay("ring_consume", dm_rpc::transport::ring::fuzz_consume);
}

fn replay(target: &str, run: fn(&[u8])) {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.expect("corpus entry").path();
        run(&std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())));
        n += 1;
    }
    assert!(n > 0, "empty corpus in {}", dir.display());
}

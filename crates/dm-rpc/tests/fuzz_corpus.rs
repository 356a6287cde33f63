//! Replays the saved corpus of the frame fuzz target in every test run.

#[test]
fn frame_decode_corpus() {
    let dir =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/frame_decode");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.expect("corpus entry").path();
        dm_rpc::frame::fuzz_decode(
            &std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
        );
        n += 1;
    }
    assert!(n > 0, "empty corpus in {}", dir.display());
}

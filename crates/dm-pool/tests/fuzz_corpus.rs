//! Replays the saved fuzz corpus (`fuzz/corpus/*`) through the fuzz entry
//! points, so every run of the suite covers what fuzzing found, without
//! needing nightly or cargo-fuzz. Long fuzzing: `scripts/fuzz.sh`.

use dm_pool::testing::replay_corpus;

#[test]
fn ref_decode_corpus() {
    replay_corpus("ref_decode", dm_pool::fuzzing::ref_decode);
}

#[test]
fn pool_open_corpus() {
    replay_corpus("pool_open", dm_pool::fuzzing::pool_open);
}

#[test]
fn ns_table_corpus() {
    replay_corpus("ns_table", dm_pool::fuzzing::ns_table);
}

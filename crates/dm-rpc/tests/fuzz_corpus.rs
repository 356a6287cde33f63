//! Replays the saved corpora of the RPC layer's fuzz targets in every test run.

use dm_pool::testing::replay_corpus;

#[test]
fn frame_decode_corpus() {
    replay_corpus("frame_decode", dm_rpc::frame::fuzz_decode);
}

#[test]
fn ring_consume_corpus() {
    replay_corpus("ring_consume", dm_rpc::raw::ring::fuzz_consume);
}

#[test]
fn parts_join_corpus() {
    replay_corpus("parts_join", dm_rpc::raw::parts::fuzz_join);
}

//! Replays the saved corpora of the memory server's fuzz targets in every
//! test run.

use dm_pool::testing::replay_corpus;

#[test]
fn memserver_request_corpus() {
    replay_corpus("memserver_request", dm_memserver::proto::fuzz_decode);
}

#[test]
fn memserver_serve_corpus() {
    replay_corpus("memserver_serve", dm_memserver::server::fuzz_serve);
}

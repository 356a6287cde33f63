//! Replays the saved corpora of the applications' fuzz targets in every
//! test run.

use dm_pool::testing::replay_corpus;

#[test]
fn image_request_corpus() {
    replay_corpus("image_request", dmrpc_bench::apps::image::fuzz_request);
}

#[test]
fn social_post_corpus() {
    replay_corpus("social_post", dmrpc_bench::apps::social::fuzz_post);
}

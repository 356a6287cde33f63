//! The saved fuzz corpus of heap arguments, replayed in every test run.

#[test]
fn heap_arg_corpus() {
    dm_pool::testing::replay_corpus("heap_arg", dm_heap::fuzz_arg);
}

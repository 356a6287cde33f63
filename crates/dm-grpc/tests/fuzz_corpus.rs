//! Replays the saved corpus of the direct gRPC way's fuzz target in every
//! test run.

#[test]
fn grpc_wire_corpus() {
    dm_pool::testing::replay_corpus("grpc_wire", dm_grpc::fuzz_wire);
}

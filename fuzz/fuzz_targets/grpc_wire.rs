//! A peer's metadata as the direct gRPC way reads it (see `dm_grpc::fuzz_wire`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| dm_grpc::fuzz_wire(data));

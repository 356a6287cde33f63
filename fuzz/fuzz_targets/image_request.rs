//! Bytes from a peer decoded as the image application's tiers decode a
//! request (see `dmrpc_bench::apps::image::fuzz_request`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| dmrpc_bench::apps::image::fuzz_request(data));

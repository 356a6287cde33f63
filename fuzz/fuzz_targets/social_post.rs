//! Bytes from a peer decoded as the social network's services decode a
//! post (see `dmrpc_bench::apps::social::fuzz_post`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| dmrpc_bench::apps::social::fuzz_post(data));

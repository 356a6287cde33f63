//! Bytes from a peer decoded as a stream of frames (see `dm_rpc::frame::fuzz_decode`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| dm_rpc::frame::fuzz_decode(data));

//! Bytes from a memory-server client decoded as a stream of request frames
//! (see `dm_memserver::proto::fuzz_decode`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| dm_memserver::proto::fuzz_decode(data));

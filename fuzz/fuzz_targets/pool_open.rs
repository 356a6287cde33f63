//! Arbitrary bytes as a pool file (see `dm_pool::fuzzing::pool_open`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| dm_pool::fuzzing::pool_open(data));

//! Bytes from a peer decoded as a Ref (see `dm_pool::fuzzing::ref_decode`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| dm_pool::fuzzing::ref_decode(data));

//! A peer's frames fed to the joiner of frames in parts (see `dm_rpc::raw::parts::fuzz_join`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| dm_rpc::raw::parts::fuzz_join(data));

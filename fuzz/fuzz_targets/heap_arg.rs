//! A heap argument as a peer could send it (see `dm_heap::fuzz_arg`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| dm_heap::fuzz_arg(data));

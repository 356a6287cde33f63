//! Arbitrary bytes as a device's segment table (see `dm_pool::fuzzing::ns_table`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| dm_pool::fuzzing::ns_table(data));

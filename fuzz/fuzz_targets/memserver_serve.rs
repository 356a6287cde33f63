//! Request frames served by a small memory server, whose invariants are
//! checked afterwards (see `dm_memserver::server::fuzz_serve`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| dm_memserver::server::fuzz_serve(data));

//! A request ring as a misbehaving client could leave it, consumed and
//! decoded as the server does (see `dm_rpc::raw::ring::fuzz_consume`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| dm_rpc::raw::ring::fuzz_consume(data));

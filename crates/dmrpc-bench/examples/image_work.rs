//! Times the work one `bench image` request does outside RPC, on one core:
//! the firewall's token check, transcoding's thumbnail, compressing's zstd,
//! and a by-value hop's copies of the image (`cargo run --release -p dmrpc-bench
//! --example image_work -- 65536`).
#![allow(clippy::unwrap_used)]

use dmrpc_bench::apps::image as app;
use std::time::Instant;

fn main() {
    let size: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(64 << 10);
    let n = 2000;
    let key = [7u8; 32];
    let ppm = app::generate(size, size as u64);
    let h = app::Header {
        client: 1,
        expires: app::unix_now() + 3600,
        thumb: 64,
    };
    let signed = h.sign(&key);
    let time = |what: &str, f: &mut dyn FnMut()| {
        f();
        let t = Instant::now();
        for _ in 0..n {
            f();
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
        println!("{what:>28}: {us:8.1} us");
        us
    };
    time("token check (HMAC-SHA256)", &mut || {
        std::hint::black_box(app::Header::verify(&signed, &key, app::unix_now()).unwrap());
    });
    let mut thumb = Vec::new();
    time("thumbnail (transcoding)", &mut || {
        thumb = app::transcode(std::hint::black_box(&ppm), 64).unwrap();
    });
    time("zstd (compressing)", &mut || {
        std::hint::black_box(app::compress(&thumb).unwrap());
    });
    // A by-value hop writes the request into a ring and the next tier
    // reads it out: two copies; four hops carry the image.
    let mut rings: Vec<Vec<u8>> = (0..8).map(|_| vec![0u8; 16 << 20]).collect();
    let mut at = 0usize;
    let mut out = vec![0u8; ppm.len()];
    time("4 by-value hops' copies", &mut || {
        for r in rings.iter_mut().take(4) {
            if at + ppm.len() > r.len() {
                at = 0;
            }
            r[at..at + ppm.len()].copy_from_slice(&ppm);
            out.copy_from_slice(&r[at..at + ppm.len()]);
        }
        at += ppm.len();
        std::hint::black_box(&out);
    });
}

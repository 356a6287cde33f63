//! The shared-memory ring alone, without the RPC layer: two threads on
//! the two cores send a record of `LEN` bytes (default 40, a no-op call's
//! frame) back and forth over a pair of rings, next to a raw ping-pong of
//! one word each way measured in the same run (the floor of `bench rtt`).
//! What `bench rtt`'s dmrpc rows cost above the ring is the RPC software
//! on both ends. Usage: `ring_pingpong [ROUND_TRIPS]` (env `LEN`, and
//! `RING_KIB` and `HOT_KIB`: the rings' size and hot window, 64 each).
#![allow(clippy::unwrap_used)]

#[cfg(loom)]
fn main() {}

#[cfg(not(loom))]
fn main() {
    use dm_rpc::raw::ring::{Consumer, Producer, RawData, RingControl};
    use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
    use std::time::Instant;

    let ring_kib = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|s| s.parse::<usize>().ok())
            .unwrap_or(d)
            << 10
    };
    // RING_KIB: each ring's size; HOT_KIB: its producer's hot window.
    let (ring_size, hot) = (ring_kib("RING_KIB", 64), ring_kib("HOT_KIB", 64));
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2_000_000);
    let len: usize = std::env::var("LEN")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);

    // Raw ping-pong: one word each way, both sides spinning.
    let floor = {
        let words = [
            dm_rpc::raw::ring::Line(AtomicU64::new(0)),
            dm_rpc::raw::ring::Line(AtomicU64::new(0)),
        ];
        let w = &words;
        std::thread::scope(|s| {
            s.spawn(move || {
                dm_sys::set_affinity(&[1]).unwrap();
                for i in 1..=n {
                    while w[0].0.load(Ordering::Acquire) != i {
                        std::hint::spin_loop();
                    }
                    w[1].0.store(i, Ordering::Release);
                }
            });
            dm_sys::set_affinity(&[0]).unwrap();
            let t = Instant::now();
            for i in 1..=n {
                w[0].0.store(i, Ordering::Release);
                while w[1].0.load(Ordering::Acquire) != i {
                    std::hint::spin_loop();
                }
            }
            t.elapsed().as_nanos() as f64 / n as f64
        })
    };

    // Two rings in 64-byte aligned memory, as a channel lays them out.
    let layout = std::alloc::Layout::from_size_align(2 * ring_size, 4096).unwrap();
    // SAFETY: a non-zero size; freed below with the same layout.
    let mem = unsafe { std::alloc::alloc_zeroed(layout) };
    assert!(!mem.is_null());
    // SAFETY: both halves stay allocated until after the threads end.
    let (req, resp) = unsafe {
        (
            RawData::new(mem, ring_size),
            RawData::new(mem.add(ring_size), ring_size),
        )
    };
    let (c_req, c_resp) = (RingControl::default(), RingControl::default());
    let (b_server, b_client) = (AtomicU32::new(0), AtomicU32::new(0));
    let msg = vec![7u8; len];
    let ring = std::thread::scope(|s| {
        let (c_req, c_resp, b_server, b_client, msg) =
            (&c_req, &c_resp, &b_server, &b_client, &msg);
        s.spawn(move || {
            dm_sys::set_affinity(&[1]).unwrap();
            let mut rx = Consumer::new(c_req, req);
            let mut tx = Producer::new(c_resp, resp, b_client).hot_window(hot);
            let (mut head, mut rest) = ([0u8; 64], Vec::new());
            for _ in 0..n {
                while rx.try_pop_split(&mut head, &mut rest).unwrap().is_none() {
                    std::hint::spin_loop();
                }
                while !tx.try_push(msg.len(), |put| put(msg)).unwrap() {}
            }
        });
        dm_sys::set_affinity(&[0]).unwrap();
        let mut tx = Producer::new(c_req, req, b_server).hot_window(hot);
        let mut rx = Consumer::new(c_resp, resp);
        let (mut head, mut rest) = ([0u8; 64], Vec::new());
        let t = Instant::now();
        for _ in 0..n {
            while !tx.try_push(msg.len(), |put| put(msg)).unwrap() {}
            while rx.try_pop_split(&mut head, &mut rest).unwrap().is_none() {
                std::hint::spin_loop();
            }
        }
        t.elapsed().as_nanos() as f64 / n as f64
    });
    // SAFETY: allocated above with this layout; the threads have ended.
    unsafe { std::alloc::dealloc(mem, layout) };
    println!(
        "raw ping-pong {floor:.0} ns, ring {ring:.0} ns per round trip ({len}-byte records): {:.2}x",
        ring / floor
    );
}

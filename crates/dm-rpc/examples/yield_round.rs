//! What one round of a waiter's yield phase costs when no other task
//! wants the core: a waiter with the policy `0,100000,20,fixed` (no
//! spin, yield for 100 ms) whose condition comes true at its 200 000th
//! check, timed five times. A round is a check, a `sched_yield` that
//! returns at once, and the waiting policy's clock reads (BENCHMARKS.md,
//! `bench chain`).
//!
//! `target/release/examples/yield_round`
#![allow(clippy::unwrap_used)]

#[cfg(loom)]
fn main() {}

#[cfg(not(loom))]
fn main() {
    use dm_rpc::wait::Bell;
    let policy = dm_rpc::WaitPolicy::parse("0,100000,20,fixed").unwrap();
    let bell = std::sync::atomic::AtomicU32::new(dm_rpc::wait::AWAKE);
    let n = 200_000u32;
    for _ in 0..5 {
        let mut w = policy.waiter();
        let mut checks = 0u32;
        let ready = || {
            checks += 1;
            (checks >= n).then_some(())
        };
        let t = std::time::Instant::now();
        let got = w.wait(Bell(&bell), None, ready, || Ok::<(), ()>(()));
        let took = t.elapsed();
        assert!(matches!(got, Ok(Some(()))), "the wait ended early");
        println!(
            "{:.1} ns per yield round",
            took.as_nanos() as f64 / n as f64
        );
    }
}

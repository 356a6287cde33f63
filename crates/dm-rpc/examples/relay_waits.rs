//! The cheapest hand-off between more processes than cores: a token
//! relayed down a chain of processes and back (the relay floor of `bench
//! chain`), each waiting for its turn by `sched_yield` or by a futex
//! (announce that it sleeps; the passer wakes it only then). BENCHMARKS.md
//! (`bench chain`) has the figures for this machine.
//!
//! `target/release/examples/relay_waits [TIERS] [ROUNDS]`, e.g. `7 20000`:
//! prints the p50 and p90 of a round through TIERS processes both ways,
//! and the context switches per round of all the processes.
#![allow(clippy::unwrap_used)]

#[cfg(loom)]
fn main() {}

/// One participant's cache line: the token, and its futex word.
#[cfg(not(loom))]
struct Slot<'a> {
    token: &'a std::sync::atomic::AtomicU64,
    /// Bumped after each token store; a sleeper waits on its value.
    seq: &'a std::sync::atomic::AtomicU32,
    /// The participant sleeps (or is about to).
    sleeping: &'a std::sync::atomic::AtomicU32,
}

#[cfg(not(loom))]
fn slot(f: &dm_sys::mem::SharedFile, i: usize) -> Slot<'_> {
    use std::sync::atomic::{AtomicU32, AtomicU64};
    assert!((i + 1) * 64 <= f.len());
    // SAFETY: the file is mapped shared for our lifetime, 64-byte aligned;
    // line i holds a u64 and two u32s, valid for any bits.
    unsafe {
        let at = f.base().add(i * 64);
        Slot {
            token: &*(at as *const AtomicU64),
            seq: &*(at.add(8) as *const AtomicU32),
            sleeping: &*(at.add(12) as *const AtomicU32),
        }
    }
}

#[cfg(not(loom))]
impl Slot<'_> {
    fn set(&self, v: u64, park: bool) {
        use std::sync::atomic::Ordering::SeqCst;
        self.token.store(v, SeqCst);
        if park {
            self.seq.fetch_add(1, SeqCst);
            if self.sleeping.load(SeqCst) == 1 {
                dm_sys::futex::wake(self.seq, 1);
            }
        }
    }

    /// Waits until the token is `want`; false if it is `u64::MAX` (stop).
    fn wait(&self, want: u64, park: bool) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        loop {
            match self.token.load(SeqCst) {
                v if v == want => return true,
                u64::MAX => return false,
                _ if !park => dm_sys::sched_yield(),
                _ => {
                    let s = self.seq.load(SeqCst);
                    self.sleeping.store(1, SeqCst);
                    let v = self.token.load(SeqCst);
                    if v != want && v != u64::MAX {
                        dm_sys::futex::wait(self.seq, s, None);
                    }
                    self.sleeping.store(0, SeqCst);
                }
            }
        }
    }
}

#[cfg(not(loom))]
fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("relay") {
        // relay FILE IDX LAST PARK: participant IDX of 1..=LAST.
        let f = dm_sys::mem::SharedFile::open(args[2].as_ref(), None, dm_sys::mem::Access::Own)
            .unwrap();
        let (idx, last): (usize, usize) = (args[3].parse().unwrap(), args[4].parse().unwrap());
        let park = args[5] == "1";
        let (down, up) = (|i: usize| slot(&f, 2 * i), |i: usize| slot(&f, 2 * i + 1));
        let mut k = 1;
        loop {
            if !down(idx).wait(k, park) {
                if idx < last {
                    down(idx + 1).set(u64::MAX, park);
                }
                return;
            }
            if idx < last {
                down(idx + 1).set(k, park);
                if !up(idx).wait(k, park) {
                    return;
                }
            }
            up(idx - 1).set(k, park);
            k += 1;
        }
    }
    let tiers: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(7);
    let rounds: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(20_000);
    for park in [false, true] {
        let path = format!("/dev/shm/dmrpc-relay-waits-{}", std::process::id());
        let f =
            dm_sys::mem::SharedFile::create(path.as_ref(), 4096, dm_sys::mem::Access::Own).unwrap();
        let peers: Vec<_> = (1..=tiers)
            .map(|i| {
                let (i, t, p) = (i.to_string(), tiers.to_string(), u8::from(park).to_string());
                std::process::Command::new(std::env::current_exe().unwrap())
                    .args(["relay", &path, &i, &t, &p])
                    .spawn()
                    .unwrap()
            })
            .collect();
        let (down1, up0) = (slot(&f, 2), slot(&f, 1));
        let pids: Vec<u32> = std::iter::once(std::process::id())
            .chain(peers.iter().map(std::process::Child::id))
            .collect();
        let switches = || dm_sys::proc::context_switches_of(&pids);
        // (The first round waits for the peers to start: not counted.)
        down1.set(1, park);
        up0.wait(1, park);
        let sw0 = switches();
        let mut v = Vec::new();
        for k in 2..=rounds {
            let t = std::time::Instant::now();
            down1.set(k, park);
            up0.wait(k, park);
            v.push(t.elapsed().as_nanos() as f64 / 1e3);
        }
        let per_round = switches().saturating_sub(sw0) as f64 / v.len() as f64;
        down1.set(u64::MAX, park);
        for mut p in peers {
            let _ = p.wait();
        }
        let _ = dm_sys::mem::unlink(path.as_ref());
        v.sort_by(f64::total_cmp);
        println!(
            "{tiers} tiers, waiting by {}: p50 {:.1} us, p90 {:.1} us per round, {per_round:.1} context switches per round",
            if park { "futex" } else { "sched_yield" },
            v[v.len() / 2],
            v[v.len() * 9 / 10]
        );
    }
}

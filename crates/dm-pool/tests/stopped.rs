//! A process judged by its lease (as one of another host or PID namespace
//! is) that is stopped past its lease: its holdings are kept in
//! quarantine, so when it resumes it writes into nothing of anyone
//! else's, and loses nothing if it resumes in time. After the quarantine,
//! or when the operator says it is gone (`gc --now`), they are reclaimed
//! and it gets `LeaseLost`.
#![cfg(not(loom))]
#![allow(clippy::unwrap_used)]

mod common;
use common::{Agent, TempPool};
use dm_pool::PoolConfig;
use std::process::{Command, Stdio};
use std::time::Duration;

const LEASE_MS: u64 = 100;

fn pool(quarantine_ms: u64) -> TempPool {
    TempPool::with(PoolConfig {
        size: 16 << 20,
        quarantine_ms,
        ..Default::default()
    })
}

/// An agent judged by its lease, holding a 64 KiB buffer of 0xAA (the
/// buffer's handle).
fn start(tp: &TempPool) -> (Agent, String) {
    let a = Agent::spawn_with(
        &tp.path,
        Some(LEASE_MS),
        &[("DMRPC_LEASE_ONLY", "1")],
        false,
    );
    filled(a)
}

/// `a` with a new 64 KiB buffer of 0xAA, and the buffer's handle.
fn filled(mut a: Agent) -> (Agent, String) {
    let b = a.ok("alloc 65536");
    assert_eq!(a.raw(&format!("fill {b} 0 65536 170")), "ok");
    (a, b)
}

fn report(tp: &TempPool) -> dm_pool::CheckReport {
    dm_pool::check_path(&tp.path, false).unwrap()
}

#[test]
fn a_process_stopped_past_its_lease_resumes_within_the_quarantine_intact() {
    let tp = pool(30_000);
    let (mut a, b) = start(&tp);
    let sum = a.raw(&format!("sum {b}"));
    a.signal(libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(4 * LEASE_MS));
    // Others reclaim nothing of it, and its pages stay its own.
    let g = dm_pool::gc_path(&tp.path).unwrap();
    assert_eq!(g.slots_reclaimed, 0);
    let r = report(&tp);
    assert!(
        r.problems.iter().any(|p| p.contains("quarantine")),
        "{:?}",
        r.problems
    );
    assert!(r.pages_held >= 16, "{r:?}");
    // Another process takes what is free: never its pages.
    let other = tp.attach();
    let mut mine = other.alloc(4 << 20).unwrap();
    mine.write(0, &vec![0x55; 4 << 20]).unwrap();
    a.signal(libc::SIGCONT);
    std::thread::sleep(Duration::from_millis(2 * LEASE_MS));
    assert_eq!(a.raw(&format!("sum {b}")), sum, "resumed, it lost nothing");
    assert_eq!(a.raw(&format!("fill {b} 0 65536 187")), "ok");
    assert!(mine.to_vec().unwrap().iter().all(|&x| x == 0x55));
    let _ = a.end();
    drop((mine, other));
    tp.assert_clean();
}

#[test]
fn after_the_quarantine_or_gc_now_its_holdings_are_reclaimed() {
    for now in [false, true] {
        let tp = pool(if now { 30_000 } else { 300 });
        let (mut a, b) = start(&tp);
        a.signal(libc::SIGSTOP);
        std::thread::sleep(Duration::from_millis(if now { 300 } else { 700 }));
        let g = dm_pool::gc_path_with(&tp.path, now).unwrap();
        assert_eq!(g.slots_reclaimed, 1, "now: {now}");
        assert!(report(&tp).ok(), "{:?}", report(&tp).problems);
        a.signal(libc::SIGCONT);
        let e = a.raw(&format!("fill {b} 0 65536 187"));
        assert!(e.starts_with("err") && e.contains("lease"), "{e}");
        let _ = a.end();
        tp.assert_clean();
    }
}

/// The agent in a PID namespace of its own (`unshare --pid`): from here
/// its pid means nothing, so it is judged by its lease. Alive and renewing,
/// it keeps everything; stopped, its holdings go to quarantine, not to
/// others; resumed, it goes on. Needs root for `unshare`; where it cannot,
/// the test says so and passes without running.
#[test]
fn a_process_of_another_pid_namespace_is_judged_by_its_lease() {
    let tp = pool(30_000);
    let mut cmd = Command::new("unshare");
    cmd.args(["--pid", "--fork", "--kill-child"])
        .arg(env!("CARGO_BIN_EXE_dm-pool-agent"))
        .arg(&tp.path)
        .arg(LEASE_MS.to_string())
        .stderr(Stdio::piped());
    let a = match Agent::spawn_command(cmd) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("SKIPPED a_process_of_another_pid_namespace_is_judged_by_its_lease: {e}");
            return;
        }
    };
    let (mut a, b) = filled(a);
    let sum = a.raw(&format!("sum {b}"));
    // Its pid in this namespace: the child of `unshare`.
    let children =
        std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", a.child.id())).unwrap();
    let agent: i32 = children.split_whitespace().next().unwrap().parse().unwrap();
    std::thread::sleep(Duration::from_millis(3 * LEASE_MS));
    assert_eq!(
        dm_pool::gc_path(&tp.path).unwrap().slots_reclaimed,
        0,
        "alive"
    );
    // SAFETY: signals to our own grandchild.
    unsafe { libc::kill(agent, libc::SIGSTOP) };
    std::thread::sleep(Duration::from_millis(4 * LEASE_MS));
    assert_eq!(
        dm_pool::gc_path(&tp.path).unwrap().slots_reclaimed,
        0,
        "stopped: in quarantine"
    );
    assert!(report(&tp)
        .problems
        .iter()
        .any(|p| p.contains("quarantine")));
    // SAFETY: as above.
    unsafe { libc::kill(agent, libc::SIGCONT) };
    std::thread::sleep(Duration::from_millis(2 * LEASE_MS));
    assert_eq!(a.raw(&format!("sum {b}")), sum);
    let _ = a.end();
    tp.assert_clean();
}

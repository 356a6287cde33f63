//! Multi-process tests: real processes (`dm-pool-agent`) attached to one pool.
#![allow(clippy::unwrap_used)]

mod common;
use common::{hex, unhex, watchdog, Agent, TempPool};
use dm_pool::{MappedBuffer, Pool, PoolConfig, Ref};
use std::time::{Duration, Instant};

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn ref_crosses_processes_with_cow_isolation_both_ways() {
    watchdog(60, || {
        let tp = TempPool::new(32 << 20);
        let pool = tp.attach();
        let data = pattern(200 * 1024 + 5, 1);
        let mut buf = pool.alloc(data.len() as u64).unwrap();
        buf.write(0, &data).unwrap();
        let r = buf.share().unwrap();

        let mut a = Agent::spawn(&tp.path, None);
        let b = a.ok(&format!("map {}", hex(&r.to_bytes())));
        assert_eq!(
            a.ok(&format!("sum {b}")),
            fnv(&data).to_string(),
            "the other process reads the snapshot"
        );
        // The other process writes: it sees its change, we keep ours.
        a.ok(&format!("fill {b} 10 5000 255"));
        let mut want = data.clone();
        want[10..5010].fill(255);
        assert_eq!(a.ok(&format!("sum {b}")), fnv(&want).to_string());
        assert_eq!(buf.to_vec().unwrap(), data);
        // We write: the other process keeps what it had.
        buf.write(100_000, &[7u8; 9000]).unwrap();
        assert_eq!(a.ok(&format!("sum {b}")), fnv(&want).to_string());
        // And a fresh map of the Ref still sees the original snapshot.
        let b2 = a.ok(&format!("map {}", hex(&r.to_bytes())));
        assert_eq!(a.ok(&format!("sum {b2}")), fnv(&data).to_string());
        a.ok(&format!("free {b}"));
        a.ok(&format!("free {b2}"));
        a.ok("check");
        a.exit();
        pool.release_ref(&r).unwrap();
        drop((buf, pool));
        tp.assert_clean();
    });
}

#[test]
fn load_store_cow_across_processes() {
    watchdog(60, || {
        let tp = TempPool::new(32 << 20);
        let pool = tp.attach();
        let mut m = MappedBuffer::alloc(&pool, 16 * 4096).unwrap();
        m.as_mut_slice().fill(3);
        let r = m.share().unwrap();
        let mut a = Agent::spawn(&tp.path, None);
        let mm = a.ok(&format!("mmap {}", hex(&r.to_bytes())));
        assert_eq!(a.ok(&format!("mread {mm} 4095 2")), "0303");
        // Their plain stores fault and copy; our mapping keeps the data.
        a.ok(&format!("mfill {mm} 4095 2 9"));
        assert_eq!(a.ok(&format!("mread {mm} 4095 2")), "0909");
        assert_eq!(&m.as_slice()[4095..4097], &[3, 3]);
        // Our plain stores fault and copy; their mapping keeps the snapshot.
        m.as_mut_slice()[8 * 4096] = 42;
        assert_eq!(a.ok(&format!("mread {mm} {} 1", 8 * 4096)), "03");
        let seen = pool.map_ref(&r).unwrap();
        assert_eq!(seen.to_vec().unwrap(), vec![3u8; 16 * 4096]);
        let rep = pool.check();
        assert!(rep.ok(), "{:?}", rep.problems);
        // 16 shared pages + 2 copied by them + 1 copied by us.
        assert_eq!(rep.pages_held, 16 + 2 + 1);
        a.ok(&format!("free {mm}"));
        a.exit();
        pool.release_ref(&r).unwrap();
        drop((seen, m, pool));
        tp.assert_clean();
    });
}

#[test]
fn fan_out_to_several_processes() {
    watchdog(60, || {
        let tp = TempPool::new(64 << 20);
        let pool = tp.attach();
        let data = pattern(1 << 20, 7);
        let mut buf = pool.alloc(data.len() as u64).unwrap();
        buf.write(0, &data).unwrap();
        let r = buf.share().unwrap();
        let mut agents: Vec<Agent> = (0..4).map(|_| Agent::spawn(&tp.path, None)).collect();
        let ids: Vec<String> = agents
            .iter_mut()
            .map(|a| a.ok(&format!("map {}", hex(&r.to_bytes()))))
            .collect();
        assert_eq!(
            pool.check().pages_shared,
            256,
            "one copy of the data for five holders"
        );
        for (k, (a, b)) in agents.iter_mut().zip(&ids).enumerate() {
            a.ok(&format!("fill {b} {} 1 {}", k * 4096, 100 + k));
        }
        for (k, (a, b)) in agents.iter_mut().zip(&ids).enumerate() {
            let mut want = data.clone();
            want[k * 4096] = 100 + k as u8;
            assert_eq!(a.ok(&format!("sum {b}")), fnv(&want).to_string());
        }
        assert_eq!(buf.to_vec().unwrap(), data);
        let rep = pool.check();
        assert_eq!(
            rep.pages_held - rep.pages_lists,
            256 + 4,
            "one page copied per writer"
        );
        for a in agents {
            a.exit();
        }
        pool.release_ref(&r).unwrap();
        drop((buf, pool));
        tp.assert_clean();
    });
}

/// A process killed and not yet reaped by its parent (a zombie, as under a
/// supervisor that restarts at once) is dead at once to the processes of
/// its host: what it held is reclaimed without waiting out its lease, and
/// the check counts its slot dead.
#[test]
fn a_killed_process_not_yet_reaped_is_dead_at_once() {
    watchdog(60, || {
        let tp = TempPool::new(16 << 20);
        // A lease far longer than the test: only its death can free it.
        let mut a = Agent::spawn(&tp.path, Some(600_000));
        let b = a.ok("alloc 100000");
        a.ok(&format!("fill {b} 0 100000 1"));
        a.child.kill().unwrap(); // SIGKILL; not reaped
        let until = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let rep = dm_pool::check_path(&tp.path, false).unwrap();
            if rep.slots_dead == 1 {
                break;
            }
            assert!(std::time::Instant::now() < until, "{rep:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
        let rep = dm_pool::gc_path(&tp.path).unwrap();
        assert_eq!(rep.slots_reclaimed, 1);
        // Reaped only now: nothing waited for it.
        a.child.wait().unwrap();
        tp.assert_clean();
    });
}

/// A process of this host that is stopped (SIGSTOP, a debugger, a frozen
/// container) keeps its holdings however long it stays stopped: pages it
/// may still write through its mappings when it resumes are never handed
/// to another. Meanwhile another process fills the pool; the stopped one
/// resumes and stores through its mapping, and the other's data is
/// untouched. Once it is gone (killed), its holdings are reclaimed at
/// once.
#[test]
fn a_stopped_process_keeps_its_holdings_and_loses_them_when_gone() {
    watchdog(60, || {
        let tp = TempPool::new(16 << 20);
        let survivor = tp.attach();
        let data = pattern(64 << 10, 3);
        let mut src = survivor.alloc(data.len() as u64).unwrap();
        src.write(0, &data).unwrap();
        let r = src.share().unwrap();
        let mut a = Agent::spawn(&tp.path, Some(300));
        let b = a.ok("alloc 100000");
        a.ok(&format!("fill {b} 0 100000 1"));
        let m = a.ok(&format!("mmap {}", hex(&r.to_bytes())));
        a.ok(&format!("mfill {m} 0 65536 7")); // its own pages now (copy-on-write)
        let pid = a.child.id() as i32;
        let sig = |s: &str| {
            std::process::Command::new("kill")
                .args([s, &pid.to_string()])
                .status()
                .unwrap();
        };
        sig("-STOP");
        std::thread::sleep(Duration::from_millis(1000)); // three leases
        let rep = dm_pool::check_path(&tp.path, false).unwrap();
        assert_eq!((rep.slots_dead, rep.slots_live), (0, 2), "{rep:?}");
        assert_eq!(dm_pool::gc_path(&tp.path).unwrap().slots_reclaimed, 0);
        // The survivor takes every page it can, and writes them all.
        let mut mine = Vec::new();
        while let Ok(mut x) = survivor.alloc(64 << 10) {
            if x.write(0, &pattern(64 << 10, 9)).is_err() {
                break;
            }
            mine.push(x);
        }
        assert!(!mine.is_empty());
        sig("-CONT");
        // It resumes and goes on: stores through its mapping, writes.
        a.ok(&format!("mfill {m} 0 65536 8"));
        a.ok(&format!("fill {b} 0 10 2"));
        for x in &mine {
            assert!(
                x.to_vec().unwrap() == pattern(64 << 10, 9),
                "the survivor's data changed"
            );
        }
        assert_eq!(src.to_vec().unwrap(), data);
        assert!(survivor.check().ok(), "{:?}", survivor.check().problems);
        drop(mine);
        // Gone: reclaimed at once, without waiting for its lease.
        a.child.kill().unwrap();
        a.child.wait().unwrap();
        assert_eq!(dm_pool::gc_path(&tp.path).unwrap().slots_reclaimed, 1);
        survivor.release_ref(&r).unwrap();
        drop((src, survivor));
        tp.assert_clean();
    });
}

/// kill -9 processes at random points of random work (alloc, write, CoW,
/// create_ref, map_ref, load/store faults, release, free) while a survivor
/// holds data; after lease expiry and gc nothing is lost for the survivor
/// and nothing leaks.
#[test]
fn kill9_at_random_points_loses_nothing_and_leaks_nothing() {
    watchdog(240, || kill9_rounds(64 << 20, 0, 12));
}

/// The same with a quarter of the churners' buffers sparse ones past what
/// one level of page lists names: their lists have two levels.
#[test]
fn kill9_with_two_level_page_lists_loses_nothing_and_leaks_nothing() {
    watchdog(240, || kill9_rounds(512 << 20, 200 << 20, 8));
}

/// `rounds` rounds of two churning agents killed at random (`big`: the
/// churn's sparse buffers, 0 for none), then reclaim and check.
fn kill9_rounds(size: u64, big: u64, rounds: usize) {
    {
        // Refs the killed processes created and never released must expire:
        // a short default TTL, and a long one for the survivor's own Ref.
        let tp = TempPool::with(PoolConfig {
            size,
            ref_ttl_ms: 1500,
            ..Default::default()
        });
        // The survivor reclaims only when told (`maintain` below): the
        // final check must see a quiescent pool, and a lease thread
        // expiring the dead's Refs meanwhile would be work in flight
        // (the check reported pages freed by such a drop as still named).
        // The agents' lease threads and waits reclaim the dead meanwhile.
        let survivor = survivor_of(&tp);
        let data = pattern(300 * 1024, 3);
        let mut keep = survivor.alloc(data.len() as u64).unwrap();
        keep.write(0, &data).unwrap();
        let shared: Ref = survivor
            .create_ref_ttl(&keep, 0, data.len() as u64, Duration::from_secs(600))
            .unwrap();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ std::process::id() as u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for round in 0..rounds {
            let mut agents: Vec<Agent> = (0..2)
                .map(|_| Agent::spawn(&tp.path, Some(agent_lease())))
                .collect();
            for a in agents.iter_mut() {
                // Churners also map the survivor's Ref and write to it (CoW).
                let m = a.ok(&format!("map {}", hex(&shared.to_bytes())));
                a.ok(&format!("fill {m} {} 1000 9", rnd() % 200_000));
                assert!(a
                    .raw(&format!("churn {} {} {big}", rnd(), churn_mask()))
                    .starts_with("ok churning"));
            }
            std::thread::sleep(Duration::from_millis(20 + rnd() % 200));
            for a in agents {
                a.kill9();
            }
            // The survivor keeps working meanwhile, and its data is intact.
            assert_eq!(keep.to_vec().unwrap(), data, "round {round}");
            let m = survivor.map_ref(&shared).unwrap();
            assert_eq!(m.to_vec().unwrap(), data);
        }
        // Reclaim the dead (the survivor's maintenance; gc works the same):
        // the invariant holds exactly, with the survivor still attached.
        // (A dead agent's last act may have been to start reclaiming
        // another: its reclaim is taken over once it is seen dead.)
        let mut rep = survivor.check();
        for _ in 0..500 {
            survivor.maintain().unwrap();
            rep = survivor.check();
            if rep.slots_dead == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(rep.ok(), "after reclaim: {:?}", rep.problems);
        assert_eq!(rep.slots_live, 1);
        assert!(
            survivor.counters().lists_copied > 0,
            "the churn wrote through lists a Ref shared"
        );
        survivor.release_ref(&shared).unwrap();
        drop(keep);
        drop(survivor);
        // What is left is held by Refs the dead created: gone after their TTL.
        std::thread::sleep(Duration::from_millis(1600));
        let gc = dm_pool::gc_path(&tp.path).unwrap();
        assert!(gc.recounted);
        assert_eq!(gc.pages_repaired, 0, "the recount found nothing to repair");
        tp.assert_clean();
    }
}

/// A process killed at each step of sharing page lists: a buffer giving
/// itself a copy of a list a Ref shares (its pages counted, the copy not
/// yet held), a second Ref of shared lists half built,
/// and a buffer half freed (one shared list left). Its reclaimer finishes
/// or undoes each exactly: the check passes, the Ref reads what was
/// shared, and once it is released the pool is clean.
#[test]
fn kill9_in_each_step_of_shared_lists_loses_nothing() {
    watchdog(120, || {
        for point in ["list-copied", "lists-shared", "shared-list-left"] {
            let tp = TempPool::new(64 << 20);
            let survivor = survivor_of(&tp);
            let mut a = Agent::spawn(&tp.path, Some(agent_lease()));
            // Three lists of 1024 pages (the last one partly used).
            let len = 2500 * 4096;
            let b = a.ok(&format!("alloc {len}"));
            a.ok(&format!("fill {b} 0 {len} 5"));
            let r = a.ok(&format!("share {b} 0 {len}"));
            let r = Ref::from_bytes(&unhex(&r)).unwrap();
            let t = survivor.check();
            assert!(t.ok(), "{:?}", t.problems);
            assert_eq!(t.pages_lists, 3, "the Ref shares the buffer's lists");
            a.ok(&format!("stopat {point}"));
            let cmd = match point {
                "list-copied" => format!("fill {b} 5000 10 6"),
                "lists-shared" => format!("share {b} 0 {len}"),
                _ => format!("free {b}"),
            };
            assert_eq!(a.raw(&cmd), "ok stopped", "{point}");
            a.kill9();
            let t0 = Instant::now();
            while survivor.maintain().unwrap().slots_reclaimed == 0 {
                assert!(
                    t0.elapsed() < Duration::from_secs(20),
                    "{point}: never reclaimed"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            let rep = survivor.check();
            assert!(rep.ok(), "{point}: {:?}", rep.problems);
            let m = survivor.map_ref(&r).unwrap();
            assert!(
                m.to_vec().unwrap().iter().all(|&x| x == 5),
                "{point}: the Ref reads what was shared"
            );
            drop(m);
            survivor.release_ref(&r).unwrap();
            drop(survivor);
            tp.assert_clean();
        }
    });
}

/// A process killed between committing a Ref and noting its expiry in
/// the pool's summary, in a group a sweep had found empty (its word said
/// no Ref): reclaiming the process notes every live Ref, so the Ref still
/// expires when due.
#[test]
fn a_ref_whose_maker_died_before_noting_it_still_expires() {
    watchdog(60, || {
        let tp = TempPool::new(16 << 20);
        let survivor = survivor_of(&tp);
        assert_eq!(survivor.maintain().unwrap().refs_expired, 0);
        let mut maker = Agent::spawn(&tp.path, Some(agent_lease()));
        let b = maker.ok("alloc 5000");
        maker.ok(&format!("fill {b} 0 5000 7"));
        let ttl = Duration::from_millis(2000);
        maker.send(&format!("stopnote {b} {}", ttl.as_millis()));
        let t = Instant::now();
        while survivor.check().refs_live == 0 {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "the Ref never went live"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        maker.kill9();
        // The maker's slot: reclaimed (a process of this host is gone once
        // killed), its buffer freed, its Ref noted and not yet due.
        let mut reclaimed = 0;
        while reclaimed == 0 {
            let rep = survivor.maintain().unwrap();
            assert_eq!(rep.refs_expired, 0, "{rep:?}");
            reclaimed = rep.slots_reclaimed;
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "the maker was never reclaimed"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(survivor.check().refs_live, 1);
        std::thread::sleep(ttl.saturating_sub(t.elapsed()) + Duration::from_millis(100));
        assert_eq!(survivor.maintain().unwrap().refs_expired, 1);
        drop(survivor);
        tp.assert_clean();
    });
}

/// Two processes that mapped the same Ref die, the second in the middle of
/// mapping it (holding the Ref's mapper lock). Reclaiming the first (whose
/// mapping must unlink from the Ref, so it waits on that lock) reclaims the
/// lock's dead holder too, in the same thread: here the survivor's one
/// explicit maintenance, with no lease thread that could do it instead.
/// (Before, the wait spun forever: the kill9 test hung now and then, with
/// the lease thread the one waiting.)
#[test]
fn reclaiming_a_dead_mapper_reclaims_the_dead_holder_of_the_refs_lock() {
    watchdog(60, || {
        let tp = TempPool::new(16 << 20);
        let survivor = survivor_of(&tp);
        let data = pattern(3 * 4096 + 100, 5);
        let (keep, shared) = share(&survivor, &data);
        let hex_ref = hex(&shared.to_bytes());
        // Slots are taken in order: the plain mapper is reclaimed first.
        let mut mapper = Agent::spawn(&tp.path, Some(agent_lease()));
        let mut holder = Agent::spawn(&tp.path, Some(agent_lease()));
        let m = mapper.ok(&format!("map {hex_ref}"));
        assert_eq!(mapper.ok(&format!("sum {m}")), fnv(&data).to_string());
        assert_eq!(holder.ok(&format!("holdlock {hex_ref}")), "holding");
        mapper.kill9();
        holder.kill9();
        // (The holder is reclaimed inside the mapper's reclaim: the report
        // counts only the slots this call's own sweep reclaimed.)
        assert!(reclaim_killed(&survivor) >= 1);
        // The Ref is whole and mappable again.
        whole_then_clean(&tp, survivor, keep, &shared, &data);
    });
}

/// A process killed in `map_ref` of a Ref with more pages than a
/// descriptor holds inline (its new buffer has no page list: it reads
/// through the Ref) is reclaimed. (Before, the reclaimer counted every one
/// of the buffer's positions as recorded and then, dropping them, found no
/// entries past the inline ones and spun on the same position forever: an
/// agent of the kill9 test hung now and then, reclaiming such a mapper.)
#[test]
fn a_mapper_of_a_long_ref_killed_in_map_ref_is_reclaimed() {
    watchdog(60, || {
        let tp = TempPool::new(16 << 20);
        let survivor = survivor_of(&tp);
        let data = pattern(300 * 1024, 6);
        let (keep, shared) = share(&survivor, &data);
        let mut holder = Agent::spawn(&tp.path, Some(agent_lease()));
        let holding = holder.ok(&format!("holdlock {}", hex(&shared.to_bytes())));
        assert_eq!(holding, "holding");
        holder.kill9();
        assert_eq!(reclaim_killed(&survivor), 1);
        whole_then_clean(&tp, survivor, keep, &shared, &data);
    });
}

/// A process killed in `create_ref` after attaching the Ref's list pages
/// but before copying its entries leaves list pages holding old bytes
/// (here a freed buffer's 0xf9 fill, which reads as page indices outside
/// the pool). Reclaiming it must read none of them as pages. (Before, the
/// kill9 test failed now and then with "page index 2046425593 is outside
/// the pool": 0xf9f9f9f9 without its borrowed bit.)
#[test]
fn a_ref_builder_killed_before_copying_its_entries_is_reclaimed() {
    watchdog(60, || {
        let tp = TempPool::new(16 << 20);
        let survivor = survivor_of(&tp);
        let mut builder = Agent::spawn(&tp.path, Some(agent_lease()));
        // More pages than a descriptor holds inline: the Ref needs a list page.
        let b = builder.ok("alloc 1048576");
        builder.ok(&format!("fill {b} 0 1048576 7"));
        // Freed pages go back to the builder's cache, last in first out:
        // the list page is one of these.
        let junk = builder.ok("alloc 65536");
        builder.ok(&format!("fill {junk} 0 65536 249"));
        builder.ok(&format!("free {junk}"));
        assert_eq!(builder.ok(&format!("stopref {b}")), "stopped");
        builder.kill9();
        assert_eq!(reclaim_killed(&survivor), 1);
        assert_eq!(survivor.check().pages_held, 0);
        drop(survivor);
        tp.assert_clean();
    });
}

/// A buffer one process turned into a Ref (`into_ref`) is a Ref like any
/// other once its maker is killed: another process reads it whole, and
/// releasing it frees every page.
#[test]
fn a_buffer_turned_into_a_ref_outlives_its_killed_maker() {
    watchdog(60, || {
        let tp = TempPool::new(16 << 20);
        let survivor = survivor_of(&tp);
        let mut maker = Agent::spawn(&tp.path, Some(agent_lease()));
        let b = maker.ok("alloc 1048576");
        maker.ok(&format!("fill {b} 0 1048576 7"));
        let hexref = maker.ok(&format!("seal {b}"));
        let r = Ref::from_bytes(&unhex(&hexref)).unwrap();
        maker.kill9();
        assert_eq!(reclaim_killed(&survivor), 1);
        let c = survivor.check();
        assert_eq!((c.buffers, c.refs_live), (0, 1), "{c:?}");
        let m = survivor.map_ref(&r).unwrap();
        assert_eq!(m.to_vec().unwrap(), vec![7u8; 1 << 20]);
        drop(m);
        survivor.release_ref(&r).unwrap();
        drop(survivor);
        tp.assert_clean();
    });
}

/// A process killed while turning a buffer into a Ref, with the Ref's
/// fields written but the descriptor still a buffer, is reclaimed as a
/// buffer: every page freed, nothing read as a Ref.
#[test]
fn a_process_killed_turning_a_buffer_into_a_ref_is_reclaimed() {
    watchdog(60, || {
        let tp = TempPool::new(16 << 20);
        let survivor = survivor_of(&tp);
        let mut maker = Agent::spawn(&tp.path, Some(agent_lease()));
        let b = maker.ok("alloc 1048576");
        maker.ok(&format!("fill {b} 0 1048576 9"));
        assert_eq!(maker.ok(&format!("stopseal {b}")), "stopped");
        maker.kill9();
        assert_eq!(reclaim_killed(&survivor), 1);
        let c = survivor.check();
        assert_eq!((c.buffers, c.refs_live, c.pages_held), (0, 0, 0), "{c:?}");
        drop(survivor);
        tp.assert_clean();
    });
}

/// An agent dies with the thread that started it, so a test that hangs
/// or crashes (its thread or process gone) leaves no agent running: one
/// stuck spinning in a wait ran on for an hour once, loading the machine.
#[test]
fn an_agent_dies_with_the_thread_that_started_it() {
    use std::os::unix::process::ExitStatusExt;
    let tp = TempPool::new(16 << 20);
    let path = tp.path.clone();
    let a = std::thread::spawn(move || Agent::spawn(&path, Some(agent_lease())))
        .join()
        .unwrap();
    let st = a
        .wait_exit(Duration::from_secs(10))
        .expect("the agent outlived the thread that started it");
    assert_eq!(st.signal(), Some(9), "{st:?}");
}

fn agent_lease() -> u64 {
    std::env::var("DMRPC_AGENT_LEASE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(400)
}

/// A survivor attached to `tp` that reclaims only when told (its
/// `maintain`): the checks of these tests must see a quiescent pool, with
/// no lease thread of the survivor reclaiming or expiring Refs meanwhile.
fn survivor_of(tp: &TempPool) -> Pool {
    Pool::open(
        &tp.path,
        dm_pool::AttachOptions {
            reclaim: false,
            ..Default::default()
        },
    )
    .unwrap()
}

/// A buffer of the survivor holding `data`, and a Ref to all of it.
fn share(survivor: &Pool, data: &[u8]) -> (dm_pool::Buffer, Ref) {
    let mut keep = survivor.alloc(data.len() as u64).unwrap();
    keep.write(0, data).unwrap();
    let shared = survivor.create_ref(&keep, 0, data.len() as u64).unwrap();
    (keep, shared)
}

/// After the dead are reclaimed: the Ref is whole and mappable again, and
/// once the survivor lets go of everything nothing is left in the pool.
fn whole_then_clean(
    tp: &TempPool,
    survivor: Pool,
    keep: dm_pool::Buffer,
    shared: &Ref,
    data: &[u8],
) {
    let again = survivor.map_ref(shared).unwrap();
    assert_eq!(again.to_vec().unwrap(), data);
    drop(again);
    survivor.release_ref(shared).unwrap();
    drop(keep);
    drop(survivor);
    tp.assert_clean();
}

/// Waits out the lease of agents just killed, reclaims them with the
/// survivor's maintenance, and checks the invariant; returns how many
/// slots that maintenance reclaimed.
fn reclaim_killed(survivor: &Pool) -> u64 {
    std::thread::sleep(Duration::from_millis(agent_lease() + 300));
    let rep = survivor.maintain().unwrap();
    let check = survivor.check();
    assert!(check.ok(), "{:?}", check.problems);
    assert_eq!(check.slots_dead, 0, "{check:?}");
    rep.slots_reclaimed
}

/// Which churn operations run (bit n = op n of the agent's `churn`); all by
/// default. Narrowing it helps find which protocol a failure comes from.
fn churn_mask() -> u64 {
    std::env::var("DMRPC_CHURN_MASK")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(u64::MAX)
}

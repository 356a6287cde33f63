//! loom models of the shared-memory transport's lock-free protocols (run
//! with `RUSTFLAGS="--cfg loom" cargo test -p dm-rpc --test loom --release`).
//!
//! They run the real ring and doorbell code over loom's atomics, with a
//! futex model that blocks until the word changes (so a lost wake-up is a
//! hang that loom reports):
//! * records cross the ring intact and in order, through wrap-around and a
//!   full ring, with both sides parking on their bells without timeouts
//!   (the consumer rings the producer's bell lazily per record, and with
//!   the fence when it finds the ring empty: a producer parked for room is
//!   never left asleep);
//! * many ringers and one waiter on a doorbell: the waiter always wakes;
//! * a server that stops says, in the go-away word, the highest call id it
//!   took: a client that finds the connection closed sees the word, and
//!   every request it sent is either taken or judged unread, never both;
//! * answers a server published before it closed its end are all read
//!   before the client reports the end (the client looks at the ring
//!   again once it sees the close).
#![cfg(loom)]

use dm_rpc::goaway;
use dm_rpc::ring::{Consumer, Producer, RingControl, RingData};
use dm_rpc::wait::Bell;
use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;

/// Ring bytes as relaxed atomic words (one word per 8 bytes, to keep the
/// model small): a missing Release/Acquire on the cursors would let the
/// consumer read stale words, which the model then shows.
struct Bytes(Vec<AtomicU64>);

impl RingData for &Bytes {
    fn size(&self) -> usize {
        self.0.len() * 8
    }
    fn write(&self, at: usize, src: &[u8]) {
        // Only the producer writes, so a read-modify-write of a word by
        // two separate relaxed operations is race-free.
        for (i, &b) in src.iter().enumerate() {
            let (w, k) = ((at + i) / 8, (at + i) % 8);
            let mut x = self.0[w].load(Ordering::Relaxed).to_le_bytes();
            x[k] = b;
            self.0[w].store(u64::from_le_bytes(x), Ordering::Relaxed);
        }
    }
    fn read(&self, at: usize, dst: &mut [u8]) {
        for (i, d) in dst.iter_mut().enumerate() {
            let (w, k) = ((at + i) / 8, (at + i) % 8);
            *d = self.0[w].load(Ordering::Relaxed).to_le_bytes()[k];
        }
    }
    fn store_word(&self, at: usize, v: u64) {
        self.0[at / 8].store(v, Ordering::Release)
    }
    fn load_word(&self, at: usize) -> u64 {
        self.0[at / 8].load(Ordering::Acquire)
    }
}

/// Bounded exploration: every interleaving with up to 3 preemptions.
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

/// The park phase of `Waiter::wait`: announce, re-check, sleep without a
/// timeout (so a missed wake-up is a hang).
fn wait_until(bell: &AtomicU32, mut ready: impl FnMut() -> bool) {
    loop {
        if ready() {
            return;
        }
        let b = Bell(bell);
        b.prepare();
        if ready() {
            b.cancel();
            return;
        }
        b.sleep(None);
    }
}

struct Shared {
    ctl: RingControl,
    data: Bytes,
    consumer_bell: AtomicU32,
}

#[test]
fn records_cross_in_order_with_parking_on_both_sides() {
    model(|| {
        // 256 bytes: four 64-byte slots; the fifth record waits for room
        // and goes into the ring's second lap, over a slot the consumer
        // zeroed. Past the second slot a producer that finds the ring
        // empty starts the next lap early (a wrap marker, published after
        // the record it leads to).
        let sh = Arc::new(Shared {
            ctl: RingControl::default(),
            data: Bytes((0..32).map(|_| AtomicU64::new(0)).collect()),
            consumer_bell: AtomicU32::new(0),
        });
        const N: u8 = 5;
        let s2 = sh.clone();
        let producer = thread::spawn(move || {
            let mut p = Producer::new(&s2.ctl, &s2.data, &s2.consumer_bell).hot_window(128);
            for i in 0..N {
                let msg = [i + 1; 3];
                let bell = p.bell();
                wait_until(bell.0, || p.fits(msg.len()));
                assert!(p.try_push(msg.len(), |put| put(&msg)).unwrap());
            }
        });
        let mut c = Consumer::new(&sh.ctl, &sh.data);
        let mut out = Vec::new();
        for i in 0..N {
            wait_until(&sh.consumer_bell, || c.ready());
            assert!(c.try_pop(&mut out).unwrap(), "ready but empty");
            assert_eq!(out, [i + 1; 3], "record {i}");
        }
        producer.join().unwrap();
        assert!(!c.ready());
    });
}

#[test]
fn a_doorbell_with_two_ringers_never_loses_a_wake_up() {
    model(|| {
        let bell = Arc::new(AtomicU32::new(0));
        let work = Arc::new(AtomicU32::new(0));
        let ringers: Vec<_> = (0..2)
            .map(|_| {
                let (b, w) = (bell.clone(), work.clone());
                thread::spawn(move || {
                    w.fetch_add(1, Ordering::Release);
                    Bell(&b).ring();
                })
            })
            .collect();
        // The waiter needs both units of work; each ringer rings once.
        wait_until(&bell, || work.load(Ordering::Acquire) == 2);
        for r in ringers {
            r.join().unwrap();
        }
    });
}

#[test]
fn a_request_is_taken_or_known_unread() {
    model(|| {
        // The server takes what it finds in two looks, says the highest id
        // it took and closes its end (`closed` stands for the channel's
        // state word: an AcqRel compare-and-swap there, Acquire loads).
        let sh = Arc::new(Shared {
            ctl: RingControl::default(),
            data: Bytes((0..32).map(|_| AtomicU64::new(0)).collect()),
            consumer_bell: AtomicU32::new(0),
        });
        let word = Arc::new(AtomicU64::new(0));
        let closed = Arc::new(AtomicU32::new(0));
        let taken = Arc::new(AtomicU64::new(0));
        let (s2, w2, c2, t2) = (sh.clone(), word.clone(), closed.clone(), taken.clone());
        let server = thread::spawn(move || {
            let mut c = Consumer::new(&s2.ctl, &s2.data);
            let (mut out, mut last) = (Vec::new(), 0u64);
            for _ in 0..2 {
                if c.try_pop(&mut out).unwrap() {
                    let id = u64::from(out[0]);
                    t2.fetch_or(1 << id, Ordering::Relaxed);
                    last = last.max(id);
                }
            }
            goaway::say(&w2, last);
            c2.store(1, Ordering::Release);
        });
        let mut p = Producer::new(&sh.ctl, &sh.data, &sh.consumer_bell);
        for id in 1..=3u8 {
            assert!(p.try_push(1, |put| put(&[id])).unwrap());
        }
        while closed.load(Ordering::Acquire) == 0 {
            thread::yield_now();
        }
        assert!(goaway::said(&word).is_some(), "closed without the word");
        let unread: Vec<bool> = (1..=3).map(|id| goaway::unread(&word, id)).collect();
        server.join().unwrap();
        let mask = taken.load(Ordering::Relaxed);
        for (k, &u) in unread.iter().enumerate() {
            let was_taken = mask & (1 << (k + 1)) != 0;
            assert_ne!(
                was_taken,
                u,
                "request {}: taken {was_taken}, unread {u}",
                k + 1
            );
        }
    });
}

#[test]
fn answers_sent_before_a_close_are_read_before_it_is_reported() {
    model(|| {
        // The server answers twice and closes its end; the client waits as
        // `ShmRx::recv` does: a look at the ring, then (between looks) at
        // the channel's state; seeing it closed, it looks at the ring once
        // more (`recv`) or asks whether a record waits (`check_peer`), and
        // reports the end only if none does.
        let sh = Arc::new(Shared {
            ctl: RingControl::default(),
            data: Bytes((0..32).map(|_| AtomicU64::new(0)).collect()),
            consumer_bell: AtomicU32::new(0),
        });
        let closed = Arc::new(AtomicU32::new(0));
        let (s2, c2) = (sh.clone(), closed.clone());
        let server = thread::spawn(move || {
            let mut p = Producer::new(&s2.ctl, &s2.data, &s2.consumer_bell);
            for id in 1..=2u8 {
                assert!(p.try_push(1, |put| put(&[id])).unwrap());
            }
            c2.store(1, Ordering::Release);
        });
        let mut c = Consumer::new(&sh.ctl, &sh.data);
        let (mut out, mut got) = (Vec::new(), Vec::new());
        loop {
            if c.try_pop(&mut out).unwrap() {
                got.push(out[0]);
                continue;
            }
            if closed.load(Ordering::Acquire) == 1 {
                // (check_peer's way: the end only once nothing waits.)
                if c.has_record() {
                    continue;
                }
                // (recv's way: one more look.)
                if c.try_pop(&mut out).unwrap() {
                    got.push(out[0]);
                    continue;
                }
                break;
            }
            thread::yield_now();
        }
        server.join().unwrap();
        assert_eq!(got, [1, 2], "an answer sent before the close was lost");
    });
}

/// A client's callers and its receiving half (`dm_rpc::handoff`): a caller
/// registers as waiting under the list's lock, looks for the half, and
/// sleeps on the condition variable (no timeout: a missed wake-up is a
/// deadlock loom reports) until it gets it; the holder lets go and wakes
/// the sleepers only if the half says someone waits. Two holders in turn,
/// so the waiter may find the half taken again by the second.
#[test]
fn a_caller_never_sleeps_while_the_receiving_half_lies_free() {
    use dm_rpc::handoff::Half;
    use loom::sync::{Condvar, Mutex};
    /// Waiting callers, callers asleep.
    type List = (Mutex<(usize, usize)>, Condvar);
    fn hand_over(list: &List, held: dm_rpc::handoff::Held<'_, ()>) {
        if held.hand_over() {
            let st = list.0.lock().unwrap();
            if st.1 > 0 {
                list.1.notify_all();
            }
        }
    }
    model(|| {
        let half = Arc::new(Half::new(()));
        let list: Arc<List> = Arc::new((Mutex::new((0, 0)), Condvar::new()));
        let held = half.try_take().expect("free at first");
        let (h2, l2) = (half.clone(), list.clone());
        let waiter = thread::spawn(move || {
            let mut st = l2.0.lock().unwrap();
            st.0 += 1;
            h2.set_waiting(st.0);
            loop {
                if let Some(mine) = h2.try_take() {
                    st.0 -= 1;
                    h2.set_waiting(st.0);
                    drop(st);
                    hand_over(&l2, mine);
                    return;
                }
                st.1 += 1;
                st = l2.1.wait(st).unwrap();
                st.1 -= 1;
            }
        });
        let (h3, l3) = (half.clone(), list.clone());
        let other = thread::spawn(move || {
            if let Some(mine) = h3.try_take() {
                hand_over(&l3, mine);
            }
        });
        hand_over(&list, held);
        other.join().unwrap();
        waiter.join().unwrap();
    });
}

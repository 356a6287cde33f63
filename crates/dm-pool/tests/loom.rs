//! loom models of the pool's lock-free protocols (run with
//! `RUSTFLAGS="--cfg loom" cargo test -p dm-pool --test loom --release`).
//!
//! They exercise the real `PageTable` code over loom's atomics:
//! * claiming from the free set: every page ends up owned exactly once;
//! * reference counting under page locks: concurrent share/drop keep the
//!   count exact, a locked page makes others wait, the last drop happens once;
//! * mapping a Ref while it is released (validate, take shares, re-validate,
//!   undo): a mapper never keeps a share of a page the release freed;
//! * shared page lists: two holders letting a list go at once (a drop,
//!   and a copy that counted the list's pages first) free it once, and
//!   its pages keep the copy's count;
//! * the expiry summary: a Ref committed while its group is swept is seen
//!   by the sweep or keeps the group's word no later than its expiry; and
//!   the same one level up, for the top word over the group words.
#![cfg(loom)]

use dm_pool::desc::{DescState, Kind};
use dm_pool::pages::{stripes_for, Changed, Delta, PageState, PageTable};
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;

/// Page words followed by their stripe words, in one shared vector.
fn table(n: usize) -> Arc<Vec<AtomicU64>> {
    Arc::new(
        (0..n + stripes_for(n as u32) as usize)
            .map(|_| AtomicU64::new(0))
            .collect(),
    )
}

fn view(v: &[AtomicU64], n: usize) -> PageTable<'_> {
    PageTable::new(&v[..n], &v[n..])
}

/// Changes a page for `desc`, waiting while another descriptor holds its
/// stripe, then records and unlocks — what `bulk_change` does for one page.
fn change(t: &PageTable<'_>, p: u32, desc: u32, d: Delta) -> Changed {
    loop {
        match t.change(p, desc, d).expect("protocol violation") {
            Changed::Busy(_) => thread::yield_now(),
            c @ Changed::Locked(_) => {
                assert!(t.locked_by(p, desc));
                t.done(p, c);
                return c;
            }
            Changed::Last => {
                t.done(p, Changed::Last);
                return Changed::Last;
            }
            other => return other,
        }
    }
}

/// Makes page 0 held by `rc` holders.
fn held_page(t: &PageTable<'_>, rc: u32) {
    assert!(t.try_claim(0, 0));
    t.hold_cached(0, 0).unwrap();
    for _ in 1..rc {
        change(t, 0, 9, Delta::Inc);
    }
}

/// A slot gives cached pages back by plain stores while another slot
/// claims: every page ends owned once (by the claimer, or free).
#[test]
fn giving_back_by_stores_races_claims_safely() {
    loom::model(|| {
        let words = table(2);
        const N: usize = 2;
        let cursor = Arc::new(AtomicU64::new(0));
        {
            let t = view(&words, N);
            let mut got = Vec::new();
            t.claim_batch(&cursor, 0, 2, &mut got);
            assert_eq!(got.len(), 2);
        }
        let (w, c) = (words.clone(), cursor.clone());
        let claimer = thread::spawn(move || {
            let t = view(&w, N);
            let mut got = Vec::new();
            t.claim_batch(&c, 1, 2, &mut got);
            got
        });
        let t = view(&words, N);
        assert_eq!(t.release_cached_run(&[0, 1], 0).0, 2);
        let got = claimer.join().unwrap();
        for p in 0..2u32 {
            let want = if got.contains(&p) {
                PageState::Cached(1)
            } else {
                PageState::Free
            };
            assert_eq!(t.state(p).unwrap(), want, "page {p}");
        }
    });
}

#[test]
fn claims_are_exclusive() {
    loom::model(|| {
        let words = table(3);
        const N: usize = 3;
        let cursor = Arc::new(AtomicU64::new(0));
        let hs: Vec<_> = (0..2u16)
            .map(|slot| {
                let (w, c) = (words.clone(), cursor.clone());
                thread::spawn(move || {
                    let t = view(&w, N);
                    let mut got = Vec::new();
                    t.claim_batch(&c, slot, 2, &mut got);
                    got
                })
            })
            .collect();
        let mut all: Vec<u32> = hs.into_iter().flat_map(|h| h.join().unwrap()).collect();
        let t = view(&words, N);
        // Every page claimed at most once, and owned by whoever claimed it.
        all.sort();
        let n = all.len();
        all.dedup();
        assert_eq!(all.len(), n, "a page was claimed twice");
        assert_eq!(n, 3, "free pages were missed");
        for p in 0..3 {
            assert!(matches!(t.state(p).unwrap(), PageState::Cached(_)));
        }
    });
}

#[test]
fn concurrent_share_and_drop_keep_the_count_exact() {
    loom::model(|| {
        let words = table(1);
        const N: usize = 1;
        held_page(&view(&words, N), 2); // a buffer and a Ref
        let w1 = words.clone();
        let sharer = thread::spawn(move || {
            let t = view(&w1, N);
            change(&t, 0, 1, Delta::Inc) // a mapper takes a share
        });
        let w2 = words.clone();
        let dropper = thread::spawn(move || {
            let t = view(&w2, N);
            change(&t, 0, 2, Delta::Dec(2)) // the Ref is released
        });
        assert!(matches!(sharer.join().unwrap(), Changed::Locked(_)));
        assert!(matches!(dropper.join().unwrap(), Changed::Locked(_)));
        let t = view(&words, N);
        assert_eq!(
            t.state(0).unwrap(),
            PageState::Held(2),
            "one share in, one out"
        );
        // The last two drops: exactly one of them sees Last.
        let a = change(&t, 0, 3, Delta::Dec(1));
        let b = change(&t, 0, 4, Delta::Dec(1));
        assert!(matches!(a, Changed::Locked(_)));
        assert_eq!(b, Changed::Last);
        assert_eq!(t.state(0).unwrap(), PageState::Cached(1));
    });
}

/// Whether descriptor `desc` holds list page 0 alone, decided under its
/// stripe lock; if others hold it too, its count drops (`reclaim.rs`).
/// Alone, a drop keeps its count until it has dropped the list's pages
/// (`keep`); a buffer done copying the list drops it to zero first.
fn settle_list(t: &PageTable<'_>, desc: u32, slot: u16, keep: bool) -> bool {
    loop {
        if t.lock_stripe_of(0, desc).unwrap().is_some() {
            thread::yield_now();
            continue;
        }
        let rc = t.state(0).unwrap().rc();
        assert!(rc > 0, "a holder finds the list held");
        if rc == 1 && keep {
            t.unlock_stripe_of(0);
            return true;
        }
        let c = t.change_in_stripe(0, desc, Delta::Dec(slot)).unwrap();
        t.done(0, c);
        return rc == 1;
    }
}

/// A Ref is dropped while the buffer sharing its page list copies the
/// list: the copy counts the list's page first, then both let the list
/// go, each deciding under its stripe lock. Exactly one finds itself
/// alone and drops the page's count for the list; the page is left with
/// the copy's count, and the list is freed once.
#[test]
fn holders_of_a_shared_list_let_it_go_once() {
    loom::model(|| {
        let words = table(2);
        const N: usize = 2;
        {
            let t = view(&words, N);
            held_page(&t, 2); // page 0: the list, named by a buffer and a Ref
            assert!(t.try_claim(1, 0));
            t.hold_cached(1, 0).unwrap(); // page 1: a page the list names
        }
        let w1 = words.clone();
        let dropper = thread::spawn(move || {
            let t = view(&w1, N);
            let alone = settle_list(&t, 1, 1, true);
            if alone {
                change(&t, 1, 1, Delta::Dec(1));
                assert_eq!(change(&t, 0, 1, Delta::Dec(1)), Changed::Last);
            }
            alone
        });
        let w2 = words.clone();
        let copier = thread::spawn(move || {
            let t = view(&w2, N);
            change(&t, 1, 2, Delta::Inc); // the copy's count on the page
            let alone = settle_list(&t, 2, 2, false);
            if alone {
                change(&t, 1, 2, Delta::Dec(2));
            }
            alone
        });
        let (d, c) = (dropper.join().unwrap(), copier.join().unwrap());
        assert!(d ^ c, "exactly one holder lets the list's pages go");
        let t = view(&words, N);
        assert_eq!(t.state(1).unwrap(), PageState::Held(1), "the copy's count");
        assert!(matches!(
            t.state(0).unwrap(),
            PageState::Cached(1) | PageState::Cached(2)
        ));
    });
}

#[test]
fn last_drop_happens_once_under_contention() {
    loom::model(|| {
        let words = table(1);
        const N: usize = 1;
        held_page(&view(&words, N), 2); // a buffer and a Ref
        let hs: Vec<_> = (1..3u16)
            .map(|s| {
                let w = words.clone();
                thread::spawn(move || {
                    let t = view(&w, N);
                    change(&t, 0, s as u32, Delta::Dec(s))
                })
            })
            .collect();
        let outs: Vec<Changed> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        let lasts = outs.iter().filter(|o| **o == Changed::Last).count();
        assert_eq!(lasts, 1, "exactly one holder frees the page: {outs:?}");
        let t = view(&words, N);
        assert!(matches!(
            t.state(0).unwrap(),
            PageState::Cached(1) | PageState::Cached(2)
        ));
    });
}

#[test]
fn mapping_a_ref_while_it_is_released() {
    loom::model(|| {
        // A live Ref (descriptor state word) holding page 0 alone.
        let words = table(1);
        const N: usize = 1;
        let gen = 7;
        let desc = Arc::new(AtomicU64::new(DescState::encode(gen, Kind::RefLive, 0)));
        held_page(&view(&words, N), 1); // the Ref alone
        let (w1, d1) = (words.clone(), desc.clone());
        let mapper = thread::spawn(move || {
            let t = view(&w1, N);
            let seen = d1.load(Ordering::Acquire);
            if DescState::decode(seen).kind != Some(Kind::RefLive) {
                return false;
            }
            // Take a share only if the page is still held ...
            if !matches!(change(&t, 0, 1, Delta::TryInc), Changed::Locked(_)) {
                return false;
            }
            // ... and keep it only if the Ref stayed the same live Ref.
            if d1.load(Ordering::Acquire) == seen {
                return true;
            }
            change(&t, 0, 1, Delta::Dec(1));
            false
        });
        let (w2, d2) = (words.clone(), desc.clone());
        let releaser = thread::spawn(move || {
            let t = view(&w2, N);
            let live = DescState::encode(gen, Kind::RefLive, 0);
            d2.compare_exchange(
                live,
                DescState::encode(gen, Kind::Drop, 2),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .unwrap();
            change(&t, 0, 2, Delta::Dec(2))
        });
        let mapped = mapper.join().unwrap();
        let released = releaser.join().unwrap();
        let t = view(&words, N);
        let st = t.state(0).unwrap();
        if mapped {
            // The mapper holds the page: the release did not free it.
            assert!(matches!(released, Changed::Locked(_)));
            assert_eq!(st, PageState::Held(1));
        } else {
            // Whoever dropped last owns it; nobody holds it.
            assert!(matches!(st, PageState::Cached(_)), "{st:?}");
        }
    });
}

/// A buffer mapping a Ref (link, then unlink) while the Ref is released:
/// exactly one of them ends up dropping the Ref, never while mapped, and a
/// link refused after the release leaves the count unchanged.
#[test]
fn map_unmap_and_release_race_on_the_mapper_word() {
    use dm_pool::desc::mappers::{self, Release, Step};
    loom::model(|| {
        let aux = Arc::new(AtomicU64::new(mappers::IS_REF));
        let a1 = aux.clone();
        let mapper = thread::spawn(move || {
            // Link (retrying while the word is locked) ...
            let linked = loop {
                match mappers::link(&a1, 1) {
                    Step::Locked(w) => {
                        mappers::unlock(&a1, w);
                        break true;
                    }
                    Step::Busy(_) => thread::yield_now(),
                    _ => break false,
                }
            };
            if !linked {
                return false; // released first: no mapping, no drop duty
            }
            // ... and unlink; the last one out of a released Ref drops it.
            loop {
                match mappers::unlink(&a1, 1, 5) {
                    Step::Locked(w) => {
                        mappers::unlock(&a1, w);
                        return false;
                    }
                    Step::Drop => return true,
                    Step::Busy(_) => thread::yield_now(),
                    s => panic!("unlink refused: {s:?}"),
                }
            }
        });
        let a2 = aux.clone();
        let releaser = thread::spawn(move || loop {
            match mappers::release(&a2, 6) {
                Release::Drop => return true,
                Release::Kept => return false,
                Release::Busy(_) => thread::yield_now(),
                Release::Already => panic!("released twice"),
            }
        });
        let (m, r) = (mapper.join().unwrap(), releaser.join().unwrap());
        assert!(
            m ^ r,
            "exactly one drops the Ref (mapper {m}, releaser {r})"
        );
        let w = aux.load(Ordering::Acquire);
        assert_eq!(mappers::count(w), 0);
        assert!(mappers::released(w));
        assert_eq!(mappers::dropper(w), Some(if m { 5 } else { 6 }));
    });
}

/// A maker commits a Ref expiring at 5 and notes it while a sweeper sweeps
/// its group (the word was due: 0) and a second maker notes a Ref expiring
/// at 9. The sweeper lowers the word to the expiries of the Refs it saw.
/// Whatever the interleaving, the word ends no later than 5: the Ref is
/// found when due.
#[test]
fn expiry_summary_covers_every_live_ref() {
    use dm_pool::expiry::{begin_sweep, end_sweep, note};
    loom::model(|| {
        let word = Arc::new(AtomicU64::new(0));
        let state = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
        let maker = |i: usize, at: u64| {
            let (word, state) = (word.clone(), state.clone());
            thread::spawn(move || {
                state[i].store(at, Ordering::Release);
                note(&word, at);
            })
        };
        let a = maker(0, 5);
        let b = maker(1, 9);
        begin_sweep(&word);
        let left = state
            .iter()
            .map(|s| s.load(Ordering::Acquire))
            .filter(|&at| at > 0)
            .min()
            .unwrap_or(u64::MAX);
        end_sweep(&word, left);
        a.join().unwrap();
        b.join().unwrap();
        assert!(word.load(Ordering::Acquire) <= 5);
    });
}

/// The summary's own summary (`expiry_top`, `expiry.rs`): a Ref committed
/// while a lease period's sweep raises the top word and reads the group
/// words leaves the top word no later than its expiry, so a later sweep
/// does not skip it.
#[test]
fn the_top_word_covers_every_live_ref() {
    use dm_pool::expiry::{begin_sweep, end_sweep, note};
    loom::model(|| {
        let top = Arc::new(AtomicU64::new(0));
        let word = Arc::new(AtomicU64::new(u64::MAX));
        let maker = {
            let (top, word) = (top.clone(), word.clone());
            thread::spawn(move || {
                // Committed (the descriptor's state), then its group's
                // word, then the top word.
                note(&word, 5);
                note(&top, 5);
            })
        };
        // A sweep at time 1: no group is due; it raises the top word,
        // reads the group's word and lowers the top word to it.
        begin_sweep(&top);
        let earliest = word.load(Ordering::Acquire);
        end_sweep(&top, earliest);
        maker.join().unwrap();
        assert!(top.load(Ordering::Acquire) <= 5);
    });
}

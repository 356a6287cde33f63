//! Inline or by memory-server Ref, between pools: learned per method and
//! payload size from the calls' own latencies ([`RemoteChoice::Measured`]).
//!
//! Which way is faster depends on what happens to a payload after the
//! call: through one service, inline wins (by Ref the bytes travel twice:
//! to the memory server and from it); through a chain that forwards it,
//! by Ref wins (the bytes travel twice, not once per hop). A client
//! cannot know the chain behind a method, but it sees each call's
//! latency. So for every method and size class (a power of two) it tries
//! each way a few times, then takes the faster one, and keeps trying the
//! other now and then to follow changes: the slower the other way was,
//! the more rarely ([`explore_gap`]), so that trying it costs about 1% of
//! the calls' time. A try that comes out faster than the chosen way is
//! followed by more at once, so a change is followed within a few calls.
//!
//! A learner's inline call says so in its metadata ([`WAY_KEY`]), and a
//! tier serving it passes the payloads it forwards inline too, without
//! learning: the learner then measures inline all the way, which is what
//! it compares with by Ref all the way. (Inline for some hops and by Ref
//! after costs by Ref's two crossings plus those hops, so it never beats
//! both.) A tier whose caller did not learn (a client without memory
//! servers, or one that always sends inline) learns for its own callee
//! the same way. What one client learned, the node's other clients of
//! the same service use ([`Choices`]).
//!
//! [`RemoteChoice::Measured`]: crate::RemoteChoice::Measured

#[cfg(not(loom))]
use crate::metadata::Metadata;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The metadata key of a call whose payload went inline by its caller's
/// learned choice (value [`WAY_INLINE`]). Reserved: a handler serving such
/// a call sends the payloads it passes on inline.
pub const WAY_KEY: &str = "dmrpc-way";
/// The value of [`WAY_KEY`].
pub const WAY_INLINE: &[u8] = b"inline";

/// Whether a request with metadata `meta` came inline by its caller's
/// learned choice.
#[cfg(not(loom))]
pub(crate) fn came_inline(meta: &Metadata) -> bool {
    meta.get(WAY_KEY) == Some(WAY_INLINE)
}

/// Below this, payloads go inline whatever was measured: by Ref costs a
/// round trip to the memory server that so few bytes never pay back.
pub(crate) const MIN_LEARNED: u64 = 16 << 10;
/// Size classes: powers of two from [`MIN_LEARNED`] up (the last class
/// takes everything above).
const CLASSES: usize = 12;
/// Calls of each way in a class before the faster is chosen.
const WARM: u32 = 4;
/// The share of the calls' time that trying the way not chosen may cost.
/// (Tiers that forward a payload inline each explore too: rarely, so that
/// a chain's calls seldom take the slow way at some hop.)
const EXPLORE_COST: f64 = 0.01;
/// Calls between two tries of the way not chosen: at least this many...
const MIN_GAP: u32 = 32;
/// ...and at most this many (a way far slower is still tried, to follow
/// changes).
const MAX_GAP: u32 = 4096;
/// Latencies kept per way: its estimate is their median, so one slow
/// call (the first of a connection, a hiccup) does not decide, and two
/// ways a few percent apart are told apart through the noise of a busy
/// machine.
const KEPT: usize = 15;

/// A way a payload travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Way {
    Inline = 0,
    ByRef = 1,
}

#[derive(Debug, Clone, Copy)]
struct Arm {
    /// The last latencies, in ns (a ring).
    kept: [f64; KEPT],
    n: u32,
    /// Their median (infinite before the first).
    median: f64,
}

impl Default for Arm {
    fn default() -> Self {
        Arm {
            kept: [0.0; KEPT],
            n: 0,
            median: f64::INFINITY,
        }
    }
}

impl Arm {
    /// The median of the latencies kept.
    fn estimate(&self) -> f64 {
        self.median
    }

    fn add(&mut self, ns: f64) {
        self.kept[self.n as usize % KEPT] = ns;
        self.n = self.n.saturating_add(1);
        let k = (self.n as usize).min(KEPT);
        let mut v = self.kept;
        let v = &mut v[..k];
        v.sort_by(f64::total_cmp);
        self.median = v[k / 2];
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Class {
    arms: [Arm; 2],
    /// Calls since the way not chosen was last tried.
    since: u32,
}

/// Calls between two tries of the way not chosen, when the chosen way
/// takes `best` ns and the other `other`: a try costs `other - best`
/// more, so one in `(other - best) / (EXPLORE_COST * best)` calls keeps
/// the tries at [`EXPLORE_COST`] of the time.
fn explore_gap(best: f64, other: f64) -> u32 {
    let gap = (other - best) / (EXPLORE_COST * best.max(1.0));
    if gap.is_nan() {
        return MIN_GAP;
    }
    // (A float cast saturates: an infinite estimate gives MAX_GAP.)
    (gap as u32).clamp(MIN_GAP, MAX_GAP)
}

impl Class {
    /// The way chosen now (by the estimates), and both estimates.
    fn best(&self) -> (Way, f64, f64) {
        let (ei, er) = (self.arms[0].estimate(), self.arms[1].estimate());
        if ei <= er {
            (Way::Inline, ei, er)
        } else {
            (Way::ByRef, er, ei)
        }
    }
}

/// What a connection learned, per method.
#[derive(Debug, Default)]
pub(crate) struct Chooser {
    methods: Mutex<HashMap<String, [Class; CLASSES]>>,
}

/// What a node's clients learned, per service they call (by the name or
/// address they dialled): a client connected anew starts from what the
/// others found.
#[derive(Debug, Default)]
pub(crate) struct Choices(Mutex<HashMap<String, Arc<Chooser>>>);

impl Choices {
    /// The chooser of calls to `target`.
    pub(crate) fn of(&self, target: &str) -> Arc<Chooser> {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(target.to_owned()).or_default().clone()
    }
}

/// The size class of `len` bytes (at least [`MIN_LEARNED`]).
fn class_of(len: u64) -> usize {
    let log = 63 - len.max(1).leading_zeros() as usize;
    log.saturating_sub(MIN_LEARNED.trailing_zeros() as usize)
        .min(CLASSES - 1)
}

impl Chooser {
    /// The way for a payload of `len` bytes of a call of `method`, and
    /// its class (to [`record`](Self::record) the call's latency under).
    pub(crate) fn choose(&self, method: &str, len: u64) -> (usize, Way) {
        let k = class_of(len);
        let mut m = self.methods.lock().unwrap_or_else(|p| p.into_inner());
        let t = match m.get_mut(method) {
            Some(t) => t,
            None => m.entry(method.to_owned()).or_default(),
        };
        let c = &mut t[k];
        // (Read in place: an arm is 15 latencies, no copy on every call.)
        let (ni, nr) = (c.arms[0].n, c.arms[1].n);
        let way = if ni < WARM || nr < WARM {
            // Warming up: the way tried less.
            if ni <= nr {
                Way::Inline
            } else {
                Way::ByRef
            }
        } else {
            let (best, b, o) = c.best();
            c.since = c.since.saturating_add(1);
            if c.since < explore_gap(b, o) {
                best
            } else {
                c.since = 0;
                match best {
                    Way::Inline => Way::ByRef,
                    Way::ByRef => Way::Inline,
                }
            }
        };
        (k, way)
    }

    /// Records that a call of `method` whose payload was in class `k`
    /// and went `way` took `ns`.
    pub(crate) fn record(&self, method: &str, k: usize, way: Way, ns: f64) {
        let mut m = self.methods.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = m.get_mut(method) {
            let c = &mut t[k.min(CLASSES - 1)];
            let (best, b, _) = c.best();
            c.arms[way as usize].add(ns);
            // A try of the other way that beat the chosen one: try again
            // at once, until its estimate says which is faster now.
            if way != best && ns < b {
                c.since = MAX_GAP;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_powers_of_two_from_the_minimum() {
        assert_eq!(class_of(16 << 10), 0);
        assert_eq!(class_of((32 << 10) - 1), 0);
        assert_eq!(class_of(32 << 10), 1);
        assert_eq!(class_of(1 << 20), 6);
        assert_eq!(class_of(1 << 40), CLASSES - 1);
    }

    /// Feeds `calls` calls whose latency is `cost(way)`: how many went
    /// each way.
    fn run(c: &Chooser, len: u64, calls: u32, mut cost: impl FnMut(Way) -> f64) -> [u32; 2] {
        let mut n = [0u32; 2];
        for _ in 0..calls {
            let (k, w) = c.choose("m", len);
            n[w as usize] += 1;
            c.record("m", k, w, cost(w));
        }
        n
    }

    #[test]
    fn the_faster_way_wins_and_the_other_is_still_tried() {
        let c = Chooser::default();
        let n = run(&c, 1 << 20, 1000, |w| {
            if w == Way::ByRef {
                100.0
            } else {
                300.0
            }
        });
        assert!(n[Way::ByRef as usize] > 980, "{n:?}");
        assert!(n[Way::Inline as usize] >= WARM, "{n:?}");
        // Another size class learns on its own: there inline is faster.
        let n = run(&c, 64 << 10, 1000, |w| {
            if w == Way::Inline {
                50.0
            } else {
                90.0
            }
        });
        assert!(n[Way::Inline as usize] > 980, "{n:?}");
        // And a change is followed: by Ref gets slower at 1 MiB.
        let n = run(&c, 1 << 20, 3000, |w| {
            if w == Way::ByRef {
                500.0
            } else {
                300.0
            }
        });
        assert!(n[Way::Inline as usize] > 2700, "{n:?}");
    }

    #[test]
    fn one_slow_call_does_not_decide() {
        let c = Chooser::default();
        // The first call by Ref is very slow (a connection's first), the
        // rest fast: by Ref still wins at once.
        let mut first = true;
        let n = run(&c, 1 << 20, 200, |w| match w {
            Way::ByRef if std::mem::take(&mut first) => 1e9,
            Way::ByRef => 100.0,
            Way::Inline => 300.0,
        });
        assert_eq!(n[Way::Inline as usize], WARM + 1, "{n:?}");
    }

    #[test]
    fn trying_a_far_slower_way_costs_about_a_hundredth() {
        for (fast, slow) in [(15.0, 130.0), (15.0, 20.0), (100.0, 300.0), (10.0, 400.0)] {
            let c = Chooser::default();
            let mut spent = 0.0;
            let calls = 100_000;
            run(&c, 64 << 10, calls, |w| {
                let t = if w == Way::Inline { fast } else { slow };
                spent += t;
                t
            });
            let ideal = fast * f64::from(calls);
            // (The warm-up's calls of the slow way are part of it.)
            let over = (spent - ideal - f64::from(WARM) * (slow - fast)) / ideal;
            assert!(over < 0.02, "{fast} vs {slow}: {:.2}% more", over * 100.0);
            assert!(over > 0.0, "{fast} vs {slow}: the other way is still tried");
        }
    }

    #[test]
    fn a_change_is_followed_within_a_few_tries_of_a_far_slower_way() {
        let c = Chooser::default();
        // By Ref far slower: tried once in thousands of calls.
        run(&c, 1 << 20, 10_000, |w| {
            if w == Way::ByRef {
                1e6
            } else {
                100.0
            }
        });
        // Then by Ref becomes the faster: the first try that shows it
        // brings the others at once.
        let n = run(&c, 1 << 20, 2 * MAX_GAP + 10, |w| {
            if w == Way::ByRef {
                50.0
            } else {
                100.0
            }
        });
        assert!(n[Way::ByRef as usize] > MAX_GAP, "{n:?}");
        let n = run(
            &c,
            1 << 20,
            100,
            |w| if w == Way::ByRef { 50.0 } else { 100.0 },
        );
        assert!(n[Way::ByRef as usize] >= 95, "{n:?}");
    }

    #[test]
    fn methods_learn_apart() {
        let c = Chooser::default();
        for _ in 0..200 {
            let (k, w) = c.choose("a", 1 << 20);
            c.record("a", k, w, if w == Way::ByRef { 1.0 } else { 2.0 });
            let (k, w) = c.choose("b", 1 << 20);
            c.record("b", k, w, if w == Way::Inline { 1.0 } else { 2.0 });
        }
        assert_eq!(c.choose("a", 1 << 20).1, Way::ByRef);
        assert_eq!(c.choose("b", 1 << 20).1, Way::Inline);
    }
}

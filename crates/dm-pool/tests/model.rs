//! Property test: random sequences of alloc / write / create_ref / map_ref /
//! free / release / into_ref, from two attached slots, against a plain in-memory model.
//! Contents are compared after every step and the pool invariant is checked
//! after every sequence (and must be spotless once everything is dropped).
#![allow(clippy::unwrap_used)]

mod common;
use common::TempPool;
use dm_pool::{Buffer, Error, Pool, Ref};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Alloc {
        who: usize,
        len: u64,
    },
    Write {
        buf: usize,
        at: u64,
        len: u64,
        byte: u8,
    },
    Share {
        buf: usize,
        at: u64,
        len: u64,
    },
    Map {
        who: usize,
        r: usize,
    },
    Free {
        buf: usize,
    },
    Release {
        r: usize,
    },
    Read {
        buf: usize,
    },
    /// The buffer turned into a Ref to all of it (`into_ref`).
    IntoRef {
        buf: usize,
    },
}

const PS: u64 = 4096;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..2usize, prop_oneof![1..3 * PS, 1..70 * PS]).prop_map(|(who, len)| Op::Alloc { who, len }),
        5 => (any::<usize>(), any::<u64>(), 1..3 * PS, any::<u8>())
            .prop_map(|(buf, at, len, byte)| Op::Write { buf, at, len, byte }),
        3 => (any::<usize>(), any::<u64>(), any::<u64>()).prop_map(|(buf, at, len)| Op::Share { buf, at, len }),
        3 => (0..2usize, any::<usize>()).prop_map(|(who, r)| Op::Map { who, r }),
        2 => any::<usize>().prop_map(|buf| Op::Free { buf }),
        2 => any::<usize>().prop_map(|r| Op::Release { r }),
        2 => any::<usize>().prop_map(|buf| Op::Read { buf }),
        2 => any::<usize>().prop_map(|buf| Op::IntoRef { buf }),
    ]
}

struct State {
    bufs: Vec<(Buffer, Vec<u8>)>,
    refs: Vec<(Ref, Vec<u8>, bool)>, // snapshot, released
}

/// The attachment that owns `b`.
fn owner<'a>(pools: &'a [Pool; 2], b: &Buffer) -> &'a Pool {
    if b.pool().slot() == pools[0].slot() {
        &pools[0]
    } else {
        &pools[1]
    }
}

fn apply(pools: &[Pool; 2], st: &mut State, op: &Op) -> Result<(), TestCaseError> {
    match *op {
        Op::Alloc { who, len } => {
            let b = pools[who].alloc(len).unwrap();
            st.bufs.push((b, vec![0; len as usize]));
        }
        Op::Write { buf, at, len, byte } if !st.bufs.is_empty() => {
            let i = buf % st.bufs.len();
            let (b, m) = &mut st.bufs[i];
            let at = at % b.len();
            let len = len.min(b.len() - at);
            b.write(at, &vec![byte; len as usize]).unwrap();
            m[at as usize..(at + len) as usize].fill(byte);
        }
        Op::Share { buf, at, len } if !st.bufs.is_empty() => {
            let i = buf % st.bufs.len();
            let (b, m) = &st.bufs[i];
            let at = at % b.len();
            let len = 1 + len % (b.len() - at);
            let r = b.create_ref(at, len).unwrap();
            st.refs
                .push((r, m[at as usize..(at + len) as usize].to_vec(), false));
        }
        Op::Map { who, r } if !st.refs.is_empty() => {
            let i = r % st.refs.len();
            let (r, snap, released) = &st.refs[i];
            match pools[who].map_ref(r) {
                Ok(b) => {
                    prop_assert!(!released, "mapped a released Ref");
                    prop_assert_eq!(&b.to_vec().unwrap(), snap);
                    st.bufs.push((b, snap.clone()));
                }
                Err(Error::RefReleased { .. }) | Err(Error::RefStale { .. }) => {
                    prop_assert!(*released)
                }
                Err(e) => return Err(TestCaseError::fail(format!("map_ref: {e}"))),
            }
        }
        Op::Free { buf } if !st.bufs.is_empty() => {
            let (b, _) = st.bufs.swap_remove(buf % st.bufs.len());
            owner(pools, &b).free(b).unwrap();
        }
        Op::Release { r } if !st.refs.is_empty() => {
            let i = r % st.refs.len();
            let (r, _, released) = &mut st.refs[i];
            match pools[i % 2].release_ref(r) {
                Ok(()) => prop_assert!(!*released),
                Err(Error::RefReleased { .. }) | Err(Error::RefStale { .. }) => {
                    prop_assert!(*released)
                }
                Err(e) => return Err(TestCaseError::fail(format!("release_ref: {e}"))),
            }
            *released = true;
        }
        Op::IntoRef { buf } if !st.bufs.is_empty() => {
            let (b, m) = st.bufs.swap_remove(buf % st.bufs.len());
            let r = owner(pools, &b).into_ref(b).unwrap();
            prop_assert_eq!(r.len, m.len() as u64);
            st.refs.push((r, m, false));
        }
        Op::Read { buf } if !st.bufs.is_empty() => {
            let (b, m) = &st.bufs[buf % st.bufs.len()];
            prop_assert_eq!(&b.to_vec().unwrap(), m);
        }
        _ => {}
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn random_sequences_match_the_model(ops in proptest::collection::vec(op(), 1..60)) {
        let tp = TempPool::new(16 << 20);
        {
            let pools = [tp.attach(), tp.attach()];
            let mut st = State { bufs: Vec::new(), refs: Vec::new() };
            for op in &ops {
                apply(&pools, &mut st, op)?;
            }
            // Every buffer and every live snapshot still reads as the model says.
            for (b, m) in &st.bufs {
                prop_assert_eq!(&b.to_vec().unwrap(), m);
            }
            for (r, snap, released) in &st.refs {
                if !released {
                    let b = pools[0].map_ref(r).unwrap();
                    prop_assert_eq!(&b.to_vec().unwrap(), snap);
                }
            }
            let rep = pools[0].check();
            prop_assert!(rep.ok(), "{:?}", rep.problems);
            for (r, _, released) in &st.refs {
                if !released {
                    pools[1].release_ref(r).unwrap();
                }
            }
        }
        tp.assert_clean();
    }
}

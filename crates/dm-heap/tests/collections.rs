//! Heap strings and ordered maps against `std`'s.
#![allow(clippy::unwrap_used)]

use dm_heap::{Heap, HeapMap, HeapOrderedMap, HeapString};
use dm_pool::testing::TempPool;
use proptest::prelude::*;
use std::collections::BTreeMap;

#[derive(Debug, Clone)]
enum Op {
    Insert(u16, u32),
    Remove(u16),
    Range(u16, u16),
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn an_ordered_map_behaves_as_a_btree_map(ops in proptest::collection::vec(
        prop_oneof![
            (0u16..200, any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
            (0u16..200).prop_map(Op::Remove),
            (0u16..200, 0u16..200).prop_map(|(a, b)| Op::Range(a, b)),
        ],
        1..200,
    )) {
        let tp = TempPool::new(16 << 20);
        let pool = tp.attach();
        let heap = Heap::create(&pool, 1 << 20).unwrap();
        let mut m = HeapOrderedMap::new_in(heap.alloc());
        let mut want = BTreeMap::new();
        for op in ops {
            match op {
                Op::Insert(k, v) => prop_assert_eq!(m.insert(k, v), want.insert(k, v)),
                Op::Remove(k) => prop_assert_eq!(m.remove(&k), want.remove(&k)),
                Op::Range(a, b) => {
                    let (a, b) = (a.min(b), a.max(b));
                    let got: Vec<_> = m.range(a..b).collect();
                    let exp: Vec<_> = want.range(a..b).collect();
                    prop_assert_eq!(got, exp);
                    let got: Vec<_> = m.range(a..=b).collect();
                    let exp: Vec<_> = want.range(a..=b).collect();
                    prop_assert_eq!(got, exp);
                    let got: Vec<_> = m.range(..b).collect();
                    let exp: Vec<_> = want.range(..b).collect();
                    prop_assert_eq!(got, exp);
                }
            }
            prop_assert_eq!(m.len(), want.len());
        }
        prop_assert!(m.iter().eq(want.iter()));
        prop_assert_eq!(m.first(), want.first_key_value());
        prop_assert_eq!(m.last(), want.last_key_value());
        drop(m);
        drop(heap);
        drop(pool);
        tp.assert_clean();
    }
}

#[test]
fn heap_strings_key_maps_looked_up_by_str() {
    let tp = TempPool::new(16 << 20);
    let pool = tp.attach();
    let heap = Heap::create(&pool, 1 << 20).unwrap();
    let a = heap.alloc();
    let mut m: HeapMap<HeapString, u32> =
        HeapMap::with_capacity_and_hasher_in(8, Default::default(), a);
    for (i, w) in ["alpha", "beta", "gamma"].iter().enumerate() {
        m.insert(HeapString::from_str_in(w, a), i as u32);
    }
    assert_eq!(m.get("beta"), Some(&1));
    let mut s = HeapString::new_in(a);
    s.push_str("gam");
    s.push('m');
    s.push('a');
    assert_eq!(m[&s], 2);
    assert_eq!(s, "gamma");
    assert_eq!(format!("{s}"), "gamma");
    let mut o = HeapOrderedMap::new_in(a);
    o.insert(HeapString::from_str_in("b", a), 1);
    o.insert(HeapString::from_str_in("a", a), 0);
    assert_eq!(o.get("a"), Some(&0));
    assert_eq!(o.keys().map(|k| k.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    drop((m, s, o));
    assert_eq!(heap.in_use(), 0, "every block given back");
    drop(heap);
    drop(pool);
    tp.assert_clean();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// `extend_copy` appends as `extend_from_slice` does.
    #[test]
    fn extend_copy_appends_as_extend_from_slice(
        a in proptest::collection::vec(any::<u32>(), 0..300),
        b in proptest::collection::vec(any::<u32>(), 0..300),
    ) {
        let tp = TempPool::new(16 << 20);
        let pool = tp.attach();
        let heap = Heap::create(&pool, 1 << 20).unwrap();
        let mut v = dm_heap::HeapVec::new_in(heap.alloc());
        dm_heap::extend_copy(&mut v, &a);
        dm_heap::extend_copy(&mut v, &b);
        let want: Vec<u32> = a.iter().chain(&b).copied().collect();
        prop_assert_eq!(&v[..], &want[..]);
        drop(v);
        drop(heap);
        drop(pool);
        tp.assert_clean();
    }
}

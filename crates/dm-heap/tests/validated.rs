//! Validated access: rkyv archives in a heap, read in place when sealed,
//! copied out otherwise, and refused with typed errors when forged.
#![allow(clippy::unwrap_used)]

use dm_heap::rkyv;
use dm_heap::{Heap, HeapError, Heaps};
use dm_pool::testing::TempPool;
use std::collections::BTreeMap;

#[derive(rkyv::Archive, rkyv::Serialize, Debug, Clone, PartialEq)]
#[rkyv(crate = dm_heap::rkyv)]
struct Doc {
    id: u64,
    title: String,
    tags: Vec<String>,
    scores: BTreeMap<String, Vec<i64>>,
    body: Vec<u8>,
}

fn doc(n: usize) -> Doc {
    Doc {
        id: 7,
        title: "a document".into(),
        tags: (0..n).map(|i| format!("tag{i}")).collect(),
        scores: (0..n)
            .map(|i| (format!("k{i}"), vec![i as i64; i % 5]))
            .collect(),
        body: vec![3; n * 10],
    }
}

#[test]
fn a_sealed_archive_is_validated_and_read_in_place() {
    let tp = TempPool::new(64 << 20);
    let pool = tp.attach();
    let heaps = Heaps::new(&pool);
    let heap = heaps.add(Heap::create(&pool, 4 << 20).unwrap());
    let scope = heap.scope(256 << 10).unwrap();
    let a = scope.archive(&doc(100)).unwrap();
    let seal = scope.seal().unwrap();
    let arg = heap.sealed_archive_arg(&a, &seal).unwrap();
    let v = heaps.archived_sealed::<Doc>(&arg).unwrap();
    let d = v.get();
    assert_eq!(d.id, 7);
    assert_eq!(d.title, "a document");
    assert_eq!(d.tags.len(), 100);
    assert_eq!(d.tags[42], "tag42");
    assert_eq!(d.scores.get("k13").unwrap().len(), 3);
    assert_eq!(d.body.len(), 1000);
    // (In place: the view is into the scope's pages.)
    let (start, len) = scope.range();
    let p = d as *const _ as u64;
    assert!(p >= start as u64 && p < start as u64 + len);
    // Unsealed, it is not read in place; copied out, it is.
    let plain = heap.archive_arg(&a).unwrap();
    assert!(matches!(
        heaps.archived_sealed::<Doc>(&plain),
        Err(HeapError::NotSealed(_))
    ));
    let c = heaps.archived_copy::<Doc>(&plain).unwrap();
    assert_eq!(c.get().tags[99], "tag99");
    // Another type asked for: refused.
    assert!(matches!(
        heaps.archived_copy::<Vec<u32>>(&plain),
        Err(HeapError::BadArg(_))
    ));
    drop(v);
    drop(seal);
    drop(scope);
    drop(heaps);
    drop(heap);
    drop(pool);
    tp.assert_clean();
}

/// Archive `rows`, then let `forge` change its bytes (the root, an
/// `ArchivedVec` of relative pointer and length, is its last 8 bytes),
/// and validate it.
fn forged(
    heap: &Heap,
    heaps: &Heaps,
    rows: &Vec<Vec<u32>>,
    forge: impl FnOnce(&mut [u8]),
) -> Result<(), HeapError> {
    let a = heap.archive(rows).unwrap();
    let arg = heap.archive_arg(&a).unwrap();
    let off = u64::from_le_bytes(arg[64..72].try_into().unwrap());
    // SAFETY: the archive's bytes, in this heap, this process's own.
    let b = unsafe { std::slice::from_raw_parts_mut(heap.base().add(off as usize), a.len()) };
    forge(b);
    heaps.archived_copy::<Vec<Vec<u32>>>(&arg).map(|c| {
        // (Valid: every row is readable.)
        let _: u64 = c
            .get()
            .iter()
            .flat_map(|r| r.iter())
            .map(|x| u64::from(x.to_native()))
            .sum();
    })
}

#[test]
fn forged_pointers_in_an_archive_are_typed_errors() {
    let tp = TempPool::new(64 << 20);
    let pool = tp.attach();
    let heaps = Heaps::new(&pool);
    let heap = heaps.add(Heap::create(&pool, 4 << 20).unwrap());
    let rows: Vec<Vec<u32>> = (0..20).map(|i| (0..i).collect()).collect();
    let root = |b: &mut [u8]| b.len() - 8;
    let word = |b: &mut [u8], at: usize, v: i32| b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    let read = |b: &[u8], at: usize| i32::from_le_bytes(b[at..at + 4].try_into().unwrap());
    assert!(forged(&heap, &heaps, &rows, |_| {}).is_ok(), "untouched");
    let invalid = |r: Result<(), HeapError>| matches!(r, Err(HeapError::Invalid(_)));
    // Out of the archive (and of the heap): the root's pointer far off.
    assert!(invalid(forged(&heap, &heaps, &rows, |b| {
        let r = root(b);
        word(b, r, -(1 << 30));
    })));
    // A length past the archive's end.
    assert!(invalid(forged(&heap, &heaps, &rows, |b| {
        let r = root(b);
        word(b, r + 4, 1 << 20);
    })));
    // Misaligned: the rows' array one byte off.
    assert!(invalid(forged(&heap, &heaps, &rows, |b| {
        let r = root(b);
        let p = read(b, r);
        word(b, r, p + 1);
    })));
    // Cyclic: the root's array pointed at itself (the root claims the
    // bytes its own elements would).
    assert!(invalid(forged(&heap, &heaps, &rows, |b| {
        let r = root(b);
        word(b, r, 0);
        word(b, r + 4, 1);
    })));
    // Dangling: a row's pointer into the middle of another row's numbers,
    // claiming bytes twice.
    assert!(invalid(forged(&heap, &heaps, &rows, |b| {
        let r = root(b);
        let arr = (r as i32 + read(b, r)) as usize;
        // Rows 19 and 18: row 19's pointer moved onto row 18's numbers.
        let (r19, r18) = (arr + 19 * 8, arr + 18 * 8);
        let t18 = r18 as i32 + read(b, r18);
        word(b, r19, t18 - r19 as i32);
    })));
    drop(heaps);
    drop(heap);
    drop(pool);
    tp.assert_clean();
}

#[test]
fn a_document_of_values_reads_back_validated() {
    use dm_heap::{ArchivedValue, Value};
    let tp = TempPool::new(64 << 20);
    let pool = tp.attach();
    let heaps = Heaps::new(&pool);
    let heap = heaps.add(Heap::create(&pool, 4 << 20).unwrap());
    let doc = Value::Map(
        [
            ("name".to_string(), Value::Str("a".into())),
            ("n".to_string(), Value::Int(-3)),
            ("x".to_string(), Value::Float(0.5)),
            ("ok".to_string(), Value::Bool(true)),
            ("none".to_string(), Value::Null),
            ("blob".to_string(), Value::Bytes(vec![9; 1000])),
            (
                "list".to_string(),
                Value::List(vec![
                    Value::Int(1),
                    Value::List(vec![Value::Str("deep".into())]),
                ]),
            ),
        ]
        .into_iter()
        .collect(),
    );
    let scope = heap.scope(64 << 10).unwrap();
    let a = scope.archive(&doc).unwrap();
    let seal = scope.seal().unwrap();
    let arg = heap.sealed_archive_arg(&a, &seal).unwrap();
    let v = heaps.archived_sealed::<Value>(&arg).unwrap();
    let ArchivedValue::Map(m) = v.get() else {
        panic!("a map")
    };
    assert_eq!(m.len(), 7);
    let get = |k: &str| m.iter().find(|e| e.key == k).map(|e| &e.value);
    match get("blob") {
        Some(ArchivedValue::Bytes(b)) => assert_eq!(b.len(), 1000),
        other => panic!("{other:?}"),
    }
    match get("list") {
        Some(ArchivedValue::List(l)) => assert!(matches!(&l[1], ArchivedValue::List(_))),
        other => panic!("{other:?}"),
    }
    // The same, through checked views: each node checked as it is read.
    let view = heaps.document_view(&arg).unwrap();
    let root = view.root().unwrap();
    assert_eq!(root.len().unwrap(), 7);
    let blob = root.get("blob").unwrap().unwrap().as_bytes().unwrap();
    assert_eq!(blob.len(), 1000);
    let list = root.get("list").unwrap().unwrap();
    assert_eq!(list.index(1).unwrap().unwrap().kind(), dm_heap::Kind::List);
    assert!(root.get("missing").unwrap().is_none());
    drop(view);
    // Unsealed: no view.
    let plain = heap.archive_arg(&a).unwrap();
    assert!(matches!(
        heaps.document_view(&plain),
        Err(HeapError::NotSealed(_))
    ));
    // Round trip: what was archived is what reads back.
    let back: Value = rkyv::deserialize::<Value, rkyv::rancor::Error>(v.get()).unwrap();
    assert_eq!(back, doc);
    drop(v);
    drop(seal);
    drop(scope);
    drop(heaps);
    drop(heap);
    drop(pool);
    tp.assert_clean();
}

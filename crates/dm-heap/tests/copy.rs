//! Deep copies: from one heap into another, from ordinary memory into a
//! heap, and out to ordinary memory; every part of a copy in its heap; a
//! copy that does not fit gives back what it took.
#![allow(clippy::unwrap_used)]

use dm_heap::{CopyFrom, Heap, HeapBox, HeapMap, HeapOrderedMap, HeapSet, HeapString, HeapVec};
use dm_pool::testing::TempPool;
use std::collections::{BTreeMap, HashMap, HashSet};

/// A document with every kind of collection.
struct Doc<'h> {
    id: u64,
    title: HeapString<'h>,
    fields: HeapMap<'h, HeapString<'h>, HeapVec<'h, i64>>,
    meta: HeapOrderedMap<'h, HeapString<'h>, HeapString<'h>>,
    tags: HeapSet<'h, u32>,
    parent: Option<HeapBox<'h, (u64, HeapString<'h>)>>,
}

#[derive(Debug, PartialEq)]
struct OwnedDoc {
    id: u64,
    title: String,
    fields: HashMap<String, Vec<i64>>,
    meta: BTreeMap<String, String>,
    tags: HashSet<u32>,
    parent: Option<Box<(u64, String)>>,
}

impl CopyFrom for Doc<'_> {
    type In<'h> = Doc<'h>;
    type Owned = OwnedDoc;
    fn copy_in<'h>(&self, a: dm_heap::HeapAlloc<'h>) -> Result<Doc<'h>, dm_heap::HeapError> {
        Ok(Doc {
            id: self.id,
            title: self.title.copy_in(a)?,
            fields: self.fields.copy_in(a)?,
            meta: self.meta.copy_in(a)?,
            tags: self.tags.copy_in(a)?,
            parent: self.parent.copy_in(a)?,
        })
    }
    fn copy_out(&self) -> OwnedDoc {
        OwnedDoc {
            id: self.id,
            title: self.title.copy_out(),
            fields: self.fields.copy_out(),
            meta: self.meta.copy_out(),
            tags: self.tags.copy_out(),
            parent: self.parent.copy_out(),
        }
    }
}

fn build(heap: &Heap) -> &Doc<'_> {
    let a = heap.alloc();
    let s = |t: &str| HeapString::from_str_in(t, a);
    let mut fields = HeapMap::with_capacity_and_hasher_in(16, Default::default(), a);
    for f in 0..10i64 {
        let mut v = HeapVec::new_in(a);
        v.extend(0..f);
        fields.insert(s(&format!("f{f}")), v);
    }
    let mut meta = HeapOrderedMap::new_in(a);
    meta.insert(s("lang"), s("en"));
    meta.insert(s("author"), s("dmrpc"));
    let mut tags = HeapSet::with_capacity_and_hasher_in(4, Default::default(), a);
    tags.extend([3u32, 5, 8]);
    let parent = Some(HeapBox::new_in((7u64, s("root")), a));
    heap.put(Doc {
        id: 42,
        title: s("a document in a heap"),
        fields,
        meta,
        tags,
        parent,
    })
    .unwrap()
}

/// Whether every block of `d` is in `heap`.
fn all_in(heap: &Heap, d: &Doc<'_>) -> bool {
    // SAFETY: only the address is looked at (`offset_of` reads nothing).
    let inside = |p: *const u8| heap.offset_of(unsafe { &*p }).is_some();
    inside(d.title.as_ptr())
        // (An empty vector has no block.)
        && (d.fields.iter())
            .all(|(k, v)| inside(k.as_ptr()) && (v.is_empty() || inside(v.as_ptr().cast())))
        && d.meta.iter().all(|(k, v)| inside(k.as_ptr()) && inside(v.as_ptr()))
        && d.tags.iter().all(|t| inside((t as *const u32).cast()))
        && d.parent.as_ref().is_some_and(|p| {
            inside((&**p as *const (u64, HeapString)).cast()) && inside(p.1.as_ptr())
        })
}

#[test]
fn a_value_is_copied_whole_into_another_heap_and_out() {
    let tp = TempPool::new(64 << 20);
    let pool = tp.attach();
    let (a, b) = (
        Heap::create(&pool, 1 << 20).unwrap(),
        Heap::create(&pool, 1 << 20).unwrap(),
    );
    let orig = build(&a);
    let copy = b.copy_from(orig).unwrap();
    assert!(all_in(&b, copy), "every part of the copy is in its heap");
    assert!(b.offset_of(copy).is_some());
    assert_eq!(copy.copy_out(), orig.copy_out());
    let out = orig.copy_out();
    assert_eq!(out.fields["f9"], (0..9).collect::<Vec<_>>());
    assert_eq!(out.meta.keys().collect::<Vec<_>>(), ["author", "lang"]);
    assert_eq!(out.parent, Some(Box::new((7, "root".to_string()))));
    // A copy looked up as the original is.
    assert_eq!(copy.fields.get("f3").unwrap()[..], [0, 1, 2]);
    assert_eq!(copy.meta.get("lang").unwrap(), "en");
    assert!(copy.tags.contains(&5));

    // From ordinary memory into a heap.
    let words: Vec<String> = (0..100).map(|i| format!("word {i}")).collect();
    let w = b.copy_from(&words).unwrap();
    assert_eq!(w.len(), 100);
    assert_eq!(w[99], "word 99");
    let m: BTreeMap<String, Vec<u8>> = [("z".into(), vec![1]), ("a".into(), vec![2, 3])].into();
    let hm = b.copy_from(&m).unwrap();
    assert_eq!(hm.first().unwrap().0, "a", "in key order");
    assert_eq!(hm.copy_out(), m);
    let t = b.copy_from("text").unwrap();
    assert_eq!(t.as_str(), "text");
    drop((a, b, pool));
    tp.assert_clean();
}

#[test]
fn a_copy_that_does_not_fit_gives_back_what_it_took() {
    let tp = TempPool::new(64 << 20);
    let pool = tp.attach();
    let big = Heap::create(&pool, 4 << 20).unwrap();
    let small = Heap::create(&pool, 64 << 10).unwrap();
    let mut v = HeapVec::new_in(big.alloc());
    for i in 0..2000 {
        v.push(HeapString::from_str_in(&format!("{i:0>60}"), big.alloc()));
    }
    let before = small.in_use();
    // About 2000 blocks of 64 bytes plus the vector: more than 64 KiB.
    let e = small.copy_from(&v).map(|_| ()).unwrap_err();
    assert!(matches!(e, dm_heap::HeapError::Full(_)), "{e}");
    assert_eq!(small.in_use(), before, "nothing kept of the failed copy");
    // A part of it fits.
    let part = small.copy_from(&v[..100]).unwrap();
    assert_eq!(part[42].as_str(), format!("{:0>60}", 42));
    drop(v);
    drop((big, small, pool));
    tp.assert_clean();
}

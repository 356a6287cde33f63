//! Seals in one process: batched release, and a store into a released
//! seal's pages that unseals it there and then.
#![allow(clippy::unwrap_used)]

use dm_heap::{Heap, HeapError, BATCH};
use dm_pool::testing::TempPool;

#[test]
fn released_seals_wait_for_a_batch_or_a_store_and_then_prove_nothing() {
    let tp = TempPool::new(64 << 20);
    let pool = tp.attach();
    let heap = Heap::create(&pool, 8 << 20).unwrap();
    let mut scope = heap.scope(8192).unwrap();
    let (p, len) = scope.range();
    let x = scope.put(41u64).unwrap() as *const u64 as *mut u64;
    let seal = scope.seal().unwrap();
    let id = seal.id();
    heap.verify_sealed(id, p, len).unwrap();
    drop(seal);
    // Released, but its pages stay read-only until a batch: still sealed.
    heap.verify_sealed(id, p, len).unwrap();
    // A store into them unseals it (the fault hook), and goes on.
    // SAFETY: a u64 of the scope, which this process owns.
    unsafe { x.write_volatile(42) };
    // SAFETY: as above.
    assert_eq!(unsafe { x.read_volatile() }, 42);
    assert!(matches!(
        heap.verify_sealed(id, p, len),
        Err(HeapError::NotSealed(_))
    ));
    scope.reset();
    drop(scope);

    // A batch: the BATCH-th release unseals them all.
    let scopes: Vec<_> = (0..BATCH).map(|_| heap.scope(4096).unwrap()).collect();
    let mut ids = Vec::new();
    for s in &scopes {
        let seal = s.seal().unwrap();
        ids.push((seal.id(), s.range()));
        drop(seal);
    }
    for (id, (p, len)) in &ids {
        assert!(
            heap.verify_sealed(*id, *p, *len).is_err(),
            "unsealed by the batch"
        );
    }
    // And the pages are writable again: a scope reset writes its header.
    for mut s in scopes {
        s.reset();
    }
    // A seal still in flight when the heap closes is undone with it.
    let s = heap.scope(4096).unwrap();
    let seal = s.seal().unwrap();
    std::mem::forget(seal);
    drop(s);
    drop(heap);
    drop(pool);
    tp.assert_clean();
}

//! The heap's allocator against a model, and against what another
//! process could write into its bookkeeping.
#![allow(clippy::unwrap_used)]

use dm_heap::{Heap, HeapError};
use dm_pool::testing::TempPool;
use proptest::prelude::*;
use std::alloc::Layout;

#[derive(Debug, Clone)]
enum Op {
    Alloc { size: usize, align_log: u32 },
    Free(usize),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    proptest::collection::vec(
        prop_oneof![
            3 => (1usize..5000, 0u32..8).prop_map(|(size, align_log)| Op::Alloc { size, align_log }),
            2 => (0usize..64).prop_map(Op::Free),
        ],
        1..300,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Live blocks never overlap, are aligned and inside the heap, keep
    /// what was written in them, and are counted in `in_use` by their
    /// class; a heap too full for a request says so and changes nothing.
    #[test]
    fn blocks_are_disjoint_aligned_and_kept(ops in ops()) {
        let tp = TempPool::new(16 << 20);
        let pool = tp.attach();
        let heap = Heap::create(&pool, 512 << 10).unwrap();
        let a = heap.alloc();
        let base = heap.base() as usize;
        let end = base + heap.len() as usize;
        // (address, layout, fill byte)
        let mut live: Vec<(usize, Layout, u8)> = Vec::new();
        let class = |l: Layout| l.size().max(l.align()).max(16).next_power_of_two() as u64;
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                Op::Alloc { size, align_log } => {
                    let l = Layout::from_size_align(size, 1 << align_log).unwrap();
                    let before = heap.in_use();
                    match allocator_api2::alloc::Allocator::allocate(&a, l) {
                        Ok(p) => {
                            let p = p.cast::<u8>().as_ptr() as usize;
                            prop_assert!(p >= base && p + size <= end);
                            prop_assert_eq!(p % l.align(), 0);
                            for &(q, ql, _) in &live {
                                prop_assert!(p + size <= q || q + ql.size() <= p, "overlap");
                            }
                            let fill = i as u8;
                            // SAFETY: a fresh block of `size` bytes.
                            unsafe { std::ptr::write_bytes(p as *mut u8, fill, size) };
                            live.push((p, l, fill));
                            prop_assert_eq!(heap.in_use(), before + class(l));
                        }
                        Err(_) => prop_assert_eq!(heap.in_use(), before),
                    }
                }
                Op::Free(k) if !live.is_empty() => {
                    let (p, l, fill) = live.swap_remove(k % live.len());
                    // SAFETY: a live block of this heap.
                    let s = unsafe { std::slice::from_raw_parts(p as *const u8, l.size()) };
                    prop_assert!(s.iter().all(|&b| b == fill), "a block changed");
                    let before = heap.in_use();
                    // SAFETY: given back once, with its layout.
                    unsafe {
                        allocator_api2::alloc::Allocator::deallocate(
                            &a,
                            std::ptr::NonNull::new(p as *mut u8).unwrap(),
                            l,
                        )
                    };
                    prop_assert_eq!(heap.in_use(), before - class(l));
                }
                Op::Free(_) => {}
            }
        }
        drop(heap);
        drop(pool);
        tp.assert_clean();
    }
}

/// The words of a heap's header, as another process could write them.
fn header_word(heap: &Heap, i: usize) -> &std::sync::atomic::AtomicU64 {
    // SAFETY: the header is atomics at the heap's first bytes.
    unsafe { &*(heap.base() as *const std::sync::atomic::AtomicU64).add(i) }
}

const BUMP: usize = 5;
const FREE: usize = 8;

#[test]
fn bookkeeping_written_by_another_process_is_refused_not_followed() {
    let tp = TempPool::new(16 << 20);
    let pool = tp.attach();
    let heap = Heap::create(&pool, 256 << 10).unwrap();
    let a = heap.alloc();
    let l = Layout::from_size_align(16, 8).unwrap();
    let corrupt = |r: Result<_, _>| matches!(r, Err(HeapError::Corrupt(_)));
    let take = || a.try_allocate(l);
    // A free list's head outside the heap, unaligned, or past the bump.
    for bad in [u64::MAX - 7, 1 << 40, 4099, 200 << 10, 8] {
        header_word(&heap, FREE).store(bad, std::sync::atomic::Ordering::Relaxed);
        assert!(corrupt(take()), "head {bad:#x}");
    }
    header_word(&heap, FREE).store(0, std::sync::atomic::Ordering::Relaxed);
    // A free block's link out of bounds: refused, the list left as it was.
    let p = take().unwrap();
    // SAFETY: a block of 16 bytes, given back with its layout.
    unsafe { allocator_api2::alloc::Allocator::deallocate(&a, p, l) };
    // SAFETY: the freed block's first word is its link.
    unsafe { (p.as_ptr() as *mut u64).write(1 << 50) };
    assert!(corrupt(take()));
    // SAFETY: as above.
    unsafe { (p.as_ptr() as *mut u64).write(0) };
    assert_eq!(take().unwrap(), p, "mended, the block is handed out again");
    // A bump outside the heap.
    let bump = header_word(&heap, BUMP).load(std::sync::atomic::Ordering::Relaxed);
    header_word(&heap, BUMP).store(1 << 45, std::sync::atomic::Ordering::Relaxed);
    assert!(corrupt(take()));
    header_word(&heap, BUMP).store(bump, std::sync::atomic::Ordering::Relaxed);
    // A pointer given back that is no block of the heap is not linked.
    let mut outside = [0u64; 4];
    // SAFETY: deallocate refuses it without writing to it.
    unsafe {
        allocator_api2::alloc::Allocator::deallocate(
            &a,
            std::ptr::NonNull::new(outside.as_mut_ptr().cast::<u8>()).unwrap(),
            l,
        )
    };
    assert_eq!(outside, [0; 4]);
    assert!(take().is_ok());
    drop(heap);
    drop(pool);
    tp.assert_clean();
}

#[test]
fn a_heap_counts_against_the_quota_of_each_process_that_opens_it() {
    use dm_pool::{AttachOptions, PoolConfig};
    let tp = TempPool::with(PoolConfig {
        size: 16 << 20,
        ..Default::default()
    });
    let page = 4096u64;
    let small = tp.attach_with(AttachOptions {
        quota: Some(64 * page),
        ..Default::default()
    });
    // Larger than the quota: refused with the pool's typed error.
    let e = Heap::create(&small, 128 * page).unwrap_err();
    assert!(
        matches!(&e, HeapError::Pool(dm_pool::Error::ResourceExhausted { what }) if what.contains("quota")),
        "{e}"
    );
    // Within it: made, and its pages are the quota's.
    let heap = Heap::create(&small, 48 * page).unwrap();
    assert!(
        small.alloc(32 * page).is_err(),
        "the heap holds 48 of 64 pages"
    );
    // Another process opening it is charged too (its own hold).
    let other = tp.attach_with(AttachOptions {
        quota: Some(32 * page),
        ..Default::default()
    });
    let r = heap.share().unwrap();
    assert!(
        matches!(
            Heap::open(&other, &r),
            Err(HeapError::Pool(dm_pool::Error::ResourceExhausted { .. }))
        ),
        "a 48-page heap is over a 32-page quota"
    );
    small.release_ref(r.pool_ref()).unwrap();
    drop(heap);
    // Closed, its pages are the quota's again.
    let b = small.alloc(60 * page).unwrap();
    drop(b);
    drop((small, other));
    tp.assert_clean();
}

//! The DM contract's conformance suite: one set of checks that every
//! backend must pass (`docs/design.md`, *The DM contract*), run by the pool's tests and by
//! the memory server's (one server and several). Each check takes fresh
//! backends, asserts semantics and each bad input's typed error, and ends
//! with the backend's own invariant check and its page counts back where
//! they started.
//!
//! A check panics on the first violation (it is test support).
#![allow(clippy::unwrap_used)]

use crate::contract::{Dm, DmBuffer};
use crate::error::Error;
use crate::refs::Ref;
use std::time::Duration;

/// Every check of the suite, by name, for a backend made by `mk` (each
/// call a fresh client; two calls in one check are two clients of the same
/// memory). `foreign` makes a client of *another* pool or server, for the
/// foreign-Ref check.
pub fn run_all<D: Dm>(mk: &dyn Fn() -> D, foreign: &dyn Fn() -> D) {
    alloc_write_read_and_lazy_zero(&mk());
    refs_snapshot_and_cow_both_ways(&mk(), &mk());
    partial_ref_at_odd_offset(&mk(), &mk());
    large_buffers(&mk());
    bad_lengths_and_bounds(&mk());
    forged_stale_released_and_foreign_refs(&mk(), &foreign());
    ref_ttl_expires_and_is_reclaimed(&mk());
    fan_out_and_release_while_mapped(&mk(), &mk());
    recycled_pages_read_zero_where_not_written(&mk(), &mk());
}

/// Asserts the backend is consistent and holds what it held at `base`.
fn settle<D: Dm>(d: &D, base: &crate::contract::Usage, what: &str) {
    let problems = d.check().unwrap();
    assert!(problems.is_empty(), "{what}: {problems:#?}");
    let u = d.usage().unwrap();
    assert_eq!(u.pages_held, base.pages_held, "{what}: pages held: {u:?}");
    assert_eq!(u.refs, base.refs, "{what}: Refs: {u:?}");
}

/// Lazy zero pages; reads and writes across a page boundary; only
/// written pages are backed.
pub fn alloc_write_read_and_lazy_zero<D: Dm>(d: &D) {
    let ps = d.page_size() as u64;
    let base = d.usage().unwrap();
    let mut b = d.alloc(3 * ps + 17).unwrap();
    assert_eq!(b.len(), 3 * ps + 17);
    assert_eq!(b.to_vec().unwrap(), vec![0u8; (3 * ps + 17) as usize]);
    assert_eq!(
        d.usage().unwrap().pages_held,
        base.pages_held,
        "alloc backs no page"
    );
    b.write(ps - 6, b"across a page boundary").unwrap();
    let mut out = vec![0u8; 22];
    b.read(ps - 6, &mut out).unwrap();
    assert_eq!(&out, b"across a page boundary");
    let mut tail = [9u8; 17];
    b.read(3 * ps, &mut tail).unwrap();
    assert_eq!(tail, [0u8; 17], "an unwritten page reads zero");
    assert_eq!(
        d.usage().unwrap().pages_held,
        base.pages_held + 2,
        "only written pages are backed"
    );
    d.free(b).unwrap();
    settle(d, &base, "alloc/write/read");
}

/// A Ref is a snapshot: the writer and every mapper copy the pages they
/// write, and only those.
pub fn refs_snapshot_and_cow_both_ways<D: Dm>(d: &D, other: &D) {
    let ps = d.page_size() as u64;
    let n = 5 * ps as usize;
    let base = d.usage().unwrap();
    let mut a = d.alloc(n as u64).unwrap();
    a.write(0, &vec![1u8; n]).unwrap();
    let r = d.create_ref(&a, 0, n as u64).unwrap();
    let u = d.usage().unwrap();
    assert_eq!(u.pages_held, base.pages_held + 5, "sharing copies nothing");
    assert_eq!(u.pages_shared, base.pages_shared + 5, "all pages shared");
    let mut m1 = other.map_ref(&r).unwrap();
    let m2 = d.map_ref(&r).unwrap(); // fan-out, another client
    a.write(ps, &[2u8; 10]).unwrap(); // the writer copies one page
    assert_eq!(
        m1.to_vec().unwrap(),
        vec![1u8; n],
        "holders keep the snapshot"
    );
    m1.write(2 * ps + 5, &[3u8; 3]).unwrap(); // a mapper copies its page
    assert_eq!(m2.to_vec().unwrap(), vec![1u8; n]);
    let mut want_a = vec![1u8; n];
    want_a[ps as usize..ps as usize + 10].fill(2);
    assert_eq!(a.to_vec().unwrap(), want_a);
    let mut want_m1 = vec![1u8; n];
    want_m1[2 * ps as usize + 5..2 * ps as usize + 8].fill(3);
    assert_eq!(m1.to_vec().unwrap(), want_m1);
    assert_eq!(
        d.usage().unwrap().pages_held,
        base.pages_held + 5 + 2,
        "exactly the two written pages were copied"
    );
    d.release_ref(&r).unwrap();
    assert_eq!(
        m2.to_vec().unwrap(),
        vec![1u8; n],
        "a mapping outlives the Ref's release"
    );
    drop((a, m1, m2));
    settle(d, &base, "snapshot/CoW");
}

/// A Ref to an unaligned range; a partial-page write keeps the rest.
pub fn partial_ref_at_odd_offset<D: Dm>(d: &D, other: &D) {
    let ps = d.page_size();
    let base = d.usage().unwrap();
    let mut a = d.alloc(4 * ps as u64).unwrap();
    let data: Vec<u8> = (0..4 * ps).map(|i| (i % 251) as u8).collect();
    a.write(0, &data).unwrap();
    let (off, len) = (1000usize, 2 * ps + 1000);
    let r = d.create_ref(&a, off as u64, len as u64).unwrap();
    assert_eq!(r.len, len as u64);
    let mut m = other.map_ref(&r).unwrap();
    assert_eq!(m.len(), len as u64);
    assert_eq!(m.to_vec().unwrap(), data[off..off + len].to_vec());
    // A write of a few bytes in the middle of a shared page: the copy
    // keeps the rest of the page.
    m.write(ps as u64 + 7, b"xyz").unwrap();
    let mut want = data[off..off + len].to_vec();
    want[ps + 7..ps + 10].copy_from_slice(b"xyz");
    assert_eq!(m.to_vec().unwrap(), want);
    assert_eq!(a.to_vec().unwrap(), data, "the source is untouched");
    d.release_ref(&r).unwrap();
    drop((a, m));
    settle(d, &base, "partial Ref");
}

/// Buffers of hundreds of pages.
pub fn large_buffers<D: Dm>(d: &D) {
    let ps = d.page_size() as u64;
    let base = d.usage().unwrap();
    let len = 300 * ps + 3;
    let mut a = d.alloc(len).unwrap();
    a.write(len - 10, b"0123456789").unwrap();
    a.write(0, b"start").unwrap();
    let r = d.create_ref(&a, 0, len).unwrap();
    let mut m = d.map_ref(&r).unwrap();
    m.write(100 * ps, b"x").unwrap();
    let v = m.to_vec().unwrap();
    assert_eq!(&v[..5], b"start");
    assert_eq!(&v[len as usize - 10..], b"0123456789");
    assert_eq!(v[100 * ps as usize], b'x');
    assert_eq!(a.to_vec().unwrap()[100 * ps as usize], 0);
    d.release_ref(&r).unwrap();
    drop((a, m));
    settle(d, &base, "large buffers");
}

/// Zero and oversized lengths, ranges outside the buffer.
pub fn bad_lengths_and_bounds<D: Dm>(d: &D) {
    let base = d.usage().unwrap();
    assert!(matches!(d.alloc(0), Err(Error::ZeroLength)));
    assert!(matches!(d.alloc(u64::MAX), Err(Error::TooLarge { .. })));
    let mut b = d.alloc(100).unwrap();
    assert!(matches!(b.write(99, b"ab"), Err(Error::OutOfBounds { .. })));
    assert!(matches!(
        b.write(u64::MAX, b"a"),
        Err(Error::OutOfBounds { .. })
    ));
    let mut out = [0u8; 2];
    assert!(matches!(
        b.read(99, &mut out),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(matches!(d.create_ref(&b, 0, 0), Err(Error::ZeroLength)));
    assert!(matches!(
        d.create_ref(&b, 50, 51),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(matches!(
        d.create_ref(&b, u64::MAX, 2),
        Err(Error::OutOfBounds { .. })
    ));
    d.free(b).unwrap();
    settle(d, &base, "bad lengths");
}

/// Forged, stale, released and foreign Refs each get their typed error
/// and change nothing.
pub fn forged_stale_released_and_foreign_refs<D: Dm>(d: &D, foreign: &D) {
    let base = d.usage().unwrap();
    let mut b = d.alloc(8192).unwrap();
    b.write(0, b"secret").unwrap();
    let r = d.create_ref(&b, 0, 8192).unwrap();
    let forged = Ref {
        tag: r.tag ^ 1,
        ..r
    };
    assert!(matches!(d.map_ref(&forged), Err(Error::RefForged { .. })));
    assert!(matches!(
        d.release_ref(&forged),
        Err(Error::RefForged { .. })
    ));
    let longer = Ref {
        len: r.len + 1,
        ..r
    };
    assert!(matches!(d.map_ref(&longer), Err(Error::RefForged { .. })));
    let out_of_range = Ref {
        desc: u32::MAX - 1,
        ..r
    };
    assert!(matches!(
        d.map_ref(&out_of_range),
        Err(Error::RefForged { .. })
    ));
    let stale = Ref {
        generation: r.generation.wrapping_sub(1),
        ..r
    };
    assert!(matches!(d.map_ref(&stale), Err(Error::RefStale { .. })));
    assert!(matches!(
        foreign.map_ref(&r),
        Err(Error::ForeignPool { .. })
    ));
    let other_backend = Ref {
        backend: r.backend ^ 1,
        ..r
    };
    assert!(matches!(
        d.map_ref(&other_backend),
        Err(Error::ForeignPool { .. })
    ));
    assert_eq!(d.map_ref(&r).unwrap().to_vec().unwrap()[..6], *b"secret");
    d.release_ref(&r).unwrap();
    assert!(
        matches!(d.release_ref(&r), Err(Error::RefReleased { .. })),
        "double release"
    );
    assert!(matches!(d.map_ref(&r), Err(Error::RefReleased { .. })));
    drop(b);
    settle(d, &base, "bad Refs");
}

/// An unreleased Ref expires and its pages come back.
pub fn ref_ttl_expires_and_is_reclaimed<D: Dm>(d: &D) {
    let ps = d.page_size() as u64;
    let base = d.usage().unwrap();
    let mut b = d.alloc(3 * ps).unwrap();
    b.write(0, &vec![7u8; 3 * ps as usize]).unwrap();
    let r = d
        .create_ref_ttl(&b, 0, 3 * ps, Duration::from_millis(30))
        .unwrap();
    d.free(b).unwrap();
    assert_eq!(
        d.usage().unwrap().pages_held,
        base.pages_held + 3,
        "the Ref keeps its pages"
    );
    std::thread::sleep(Duration::from_millis(60));
    assert!(matches!(d.map_ref(&r), Err(Error::RefExpired { .. })));
    d.maintain().unwrap();
    assert!(matches!(d.release_ref(&r), Err(Error::RefExpired { .. })));
    settle(d, &base, "TTL");
}

/// One Ref mapped many times by two clients; released while mapped; the
/// pages go when the last mapping does.
pub fn fan_out_and_release_while_mapped<D: Dm>(d: &D, other: &D) {
    let ps = d.page_size() as u64;
    let base = d.usage().unwrap();
    let mut b = d.alloc(2 * ps).unwrap();
    b.write(0, &vec![5u8; 2 * ps as usize]).unwrap();
    let r = d.create_ref(&b, 0, 2 * ps).unwrap();
    d.free(b).unwrap();
    let maps: Vec<D::Buffer> = (0..4)
        .map(|i| if i % 2 == 0 { d } else { other }.map_ref(&r).unwrap())
        .collect();
    d.release_ref(&r).unwrap();
    for m in &maps {
        assert_eq!(m.to_vec().unwrap(), vec![5u8; 2 * ps as usize]);
    }
    assert_eq!(d.usage().unwrap().pages_held, base.pages_held + 2);
    drop(maps);
    settle(d, &base, "fan-out");
}

/// Pages one client filled and freed read zero for the next, wherever the
/// next did not write: a partial first write of a page, a whole page, a
/// Ref of them (backends may zero pages when freed or when taken).
pub fn recycled_pages_read_zero_where_not_written<D: Dm>(d: &D, other: &D) {
    let ps = d.page_size();
    let base = other.usage().unwrap();
    // Dirty pages the backend will hand out again.
    let mut held = Vec::new();
    for _ in 0..8 {
        let mut b = d.alloc(16 * ps as u64).unwrap();
        b.write(0, &vec![0xAB; 16 * ps]).unwrap();
        held.push(b);
    }
    for b in held.drain(..) {
        d.free(b).unwrap();
    }
    let mut a = other.alloc(4 * ps as u64).unwrap();
    a.write(ps as u64 + 100, b"hello").unwrap();
    a.write(2 * ps as u64, &vec![7u8; ps]).unwrap();
    let mut want = vec![0u8; 4 * ps];
    want[ps + 100..ps + 105].copy_from_slice(b"hello");
    want[2 * ps..3 * ps].fill(7);
    assert_eq!(a.to_vec().unwrap(), want, "only written bytes are nonzero");
    let r = other.create_ref(&a, 0, 4 * ps as u64).unwrap();
    let m = d.map_ref(&r).unwrap();
    assert_eq!(m.to_vec().unwrap(), want, "the Ref reads the same");
    drop(m);
    other.release_ref(&r).unwrap();
    other.free(a).unwrap();
    settle(other, &base, "recycled pages");
}

//! Pools used whole. Buffers past what one level of page lists names (184
//! MiB of 4 KiB pages): one of more than 4 GiB through every sharing path,
//! checked byte for byte at sampled offsets, and a sparse one of two-level
//! lists through mapped buffers, partial Refs and `into_ref`. A million
//! live Refs, found by the expiry summary and expired.

#![cfg(not(loom))]
#![allow(clippy::unwrap_used)]

use dm_pool::testing::TempPool;
use dm_pool::{AttachOptions, Buffer, MappedBuffer, Pool, PoolConfig};
use std::time::{Duration, Instant};

/// The original content repeats every `PERIOD` bytes: not a multiple of
/// the page size, so no two pages of a buffer (under 34 TB) hold the same
/// bytes, and a page read from the wrong place is caught.
const PERIOD: u64 = (64 << 20) + 8;

/// The byte the original buffer holds at offset `o`.
fn byte_at(o: u64) -> u8 {
    let o = o % PERIOD;
    let w = (o / 8).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (w >> ((o % 8) * 8)) as u8 ^ (w >> 59) as u8
}

fn pattern(at: u64, out: &mut [u8]) {
    for (i, b) in out.iter_mut().enumerate() {
        *b = byte_at(at + i as u64);
    }
}

/// `PERIOD + extra` bytes of the content from offset 0, built a word at a
/// time (the bytes `byte_at` gives): any run of up to `extra` bytes of the
/// content is a slice of it.
fn period(extra: usize) -> Vec<u8> {
    let mut v = vec![0u8; PERIOD as usize + extra];
    for (i, w) in v[..PERIOD as usize].chunks_exact_mut(8).enumerate() {
        let x = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        w.copy_from_slice(&(x ^ ((x >> 59) * 0x0101_0101_0101_0101)).to_le_bytes());
    }
    v.copy_within(..extra, PERIOD as usize);
    v
}

/// Offsets to check: each end, around every 4 GiB and 4 MiB list boundary
/// the buffer crosses near them, and a spread in between.
fn samples(len: u64, ps: u64) -> Vec<u64> {
    let per = ps / 4;
    let mut v = vec![0, 1, len - 1, len - ps, len / 2];
    for edge in [per * ps, per * per * ps, len - len % ps] {
        for d in [0i64, -1, 1, ps as i64] {
            let o = edge as i64 + d;
            if o >= 0 && (o as u64) < len {
                v.push(o as u64);
            }
        }
    }
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..200 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.push(x % len);
    }
    v
}

fn read_at(b: &Buffer, o: u64, n: usize) -> Vec<u8> {
    let n = n.min((b.len() - o) as usize);
    let mut out = vec![0u8; n];
    b.read(o, &mut out).unwrap();
    out
}

fn expect_original(b: &Buffer, offsets: &[u64], what: &str) {
    for &o in offsets {
        let got = read_at(b, o, 64);
        let mut want = vec![0u8; got.len()];
        pattern(o, &mut want);
        assert_eq!(got, want, "{what} at {o}");
    }
}

/// Create, fill, share, map, write (copy-on-write) and release a buffer of
/// more than 4 GiB, so its page list has two second-level pages.
#[test]
fn a_buffer_over_four_gib_is_shared_mapped_written_and_released() {
    let ps = 4096u64;
    let len = (4 << 30) + 3 * ps + 100;
    let tp = TempPool::new(len + (256 << 20));
    let pool = tp.attach();
    assert!(pool.max_len() >= len, "max buffer {}", pool.max_len());
    let t = Instant::now();
    let mut b = pool.alloc(len).unwrap();
    let chunk = 16 << 20;
    let content = period(chunk);
    let mut at = 0;
    while at < len {
        let n = (len - at).min(chunk as u64) as usize;
        let from = (at % PERIOD) as usize;
        b.write(at, &content[from..from + n]).unwrap();
        at += n as u64;
    }
    drop(content);
    let wrote = t.elapsed();
    let offsets = samples(len, ps);
    expect_original(&b, &offsets, "written");

    let t = Instant::now();
    let r = b.share().unwrap();
    let shared = t.elapsed();
    let t = Instant::now();
    let mut m = pool.map_ref(&r).unwrap();
    let mapped = t.elapsed();
    assert_eq!(m.len(), len);
    expect_original(&m, &offsets, "mapped");

    // Copy-on-write on both sides: each sees its own writes, the Ref none.
    let t = Instant::now();
    for (i, &o) in offsets.iter().enumerate() {
        let n = 16.min(len - o) as usize;
        m.write(o, &vec![0xA0 ^ i as u8; n]).unwrap();
    }
    let cow = t.elapsed();
    // The Ref shares the buffer's lists: the buffer's write copies one.
    let before = pool.counters();
    b.write(0, b"written after sharing").unwrap();
    let after = pool.counters();
    assert_eq!(after.lists_copied - before.lists_copied, 1);
    assert_eq!(after.cow_copies - before.cow_copies, 1);
    let rep = pool.check();
    assert!(rep.ok(), "{:?}", rep.problems);
    for (i, &o) in offsets.iter().enumerate() {
        // A later sample may overwrite an earlier one: the last one wins.
        let last = offsets
            .iter()
            .enumerate()
            .rfind(|&(_, &p)| p <= o && o < p + 16)
            .map_or(i, |(j, _)| j);
        assert_eq!(
            read_at(&m, o, 1)[0],
            0xA0 ^ last as u8,
            "mapped write at {o}"
        );
    }
    let fresh = pool.map_ref(&r).unwrap();
    expect_original(&fresh, &offsets, "the Ref after both wrote");
    assert_eq!(read_at(&b, 0, 21), b"written after sharing");
    let past: Vec<u64> = offsets.iter().copied().filter(|&o| o >= 21).collect();
    expect_original(&b, &past, "the buffer past its own write");

    let t = Instant::now();
    drop((m, fresh));
    pool.release_ref(&r).unwrap();
    pool.free(b).unwrap();
    let released = t.elapsed();
    eprintln!(
        "{} MiB: write {wrote:?}, share {shared:?}, map {mapped:?}, \
         {} copy-on-write writes {cow:?}, release {released:?}",
        len >> 20,
        offsets.len()
    );
    drop(pool);
    tp.assert_clean();
}

/// A sparse buffer just past one level of lists, through the paths a
/// small one takes: a mapped buffer's stores (its fault handler reads two
/// levels), a Ref of a range across a list boundary, `into_ref`, `dup`.
#[test]
fn two_level_lists_work_on_every_path() {
    let tp = TempPool::new(320 << 20);
    let pool: Pool = tp.attach();
    let ps = pool.page_size() as u64;
    let per = ps / 4;
    // One level names 46 lists of `per` pages.
    let len = (46 * per + per + 7) * ps;
    let mut b = pool.alloc(len).unwrap();
    let offsets = samples(len, ps);
    for &o in &offsets {
        let mut v = vec![0u8; 64.min(len - o) as usize];
        pattern(o, &mut v);
        b.write(o, &v).unwrap();
    }
    expect_original(&b, &offsets, "sparse");

    // A Ref of a range across the boundary of the first list.
    let r = pool.create_ref(&b, per * ps - 100, 300).unwrap();
    let part = pool.map_ref(&r).unwrap();
    assert_eq!(part.to_vec().unwrap(), read_at(&b, per * ps - 100, 300));
    pool.release_ref(&r).unwrap();
    drop(part);

    // A mapped buffer of the whole: loads see the pages, stores copy.
    let whole = b.share().unwrap();
    let mut mb = MappedBuffer::map_ref(&pool, &whole).unwrap();
    for &o in &offsets {
        let mut v = vec![0u8; 64.min(len - o) as usize];
        pattern(o, &mut v);
        assert_eq!(
            mb.as_slice()[o as usize..][..v.len()],
            v[..],
            "mapped at {o}"
        );
    }
    for (i, &o) in offsets.iter().enumerate() {
        mb.as_mut_slice()[o as usize] = 0x5A ^ i as u8;
    }
    expect_original(&b, &offsets, "the buffer under a mapped writer");
    let copy = mb.dup().unwrap();
    for &o in &offsets {
        assert_eq!(
            read_at(&copy, o, 1)[0],
            mb.as_slice()[o as usize],
            "dup at {o}"
        );
    }
    drop((mb, copy));
    pool.release_ref(&whole).unwrap();

    // The buffer turned into a Ref in place, mapped and read back.
    let r = pool.into_ref(b).unwrap();
    let back = pool.map_ref(&r).unwrap();
    expect_original(&back, &offsets, "into_ref");
    drop(back);
    pool.release_ref(&r).unwrap();
    let rep = pool.check();
    assert!(rep.ok(), "{:?}", rep.problems);
    assert_eq!(rep.pages_held, 0, "{rep:?}");
    drop(pool);
    tp.assert_clean();
}

/// A million live Refs. The lease's sweep reads only the groups of
/// descriptors whose Refs are due (none while none is), and once their TTL
/// has passed every one expires and the pool is clean.
#[test]
fn a_million_refs_expire_and_leave_nothing() {
    const N: u32 = 1_000_000;
    let tp = TempPool::with(PoolConfig {
        size: 640 << 20,
        descs: Some(N + 4096),
        ..Default::default()
    });
    // No lease thread sweeping meanwhile: the counts are this test's.
    let pool = tp.attach_with(AttachOptions {
        reclaim: false,
        ..Default::default()
    });
    let mut buf = pool.alloc(64).unwrap();
    buf.write(0, b"one page shared by a million Refs").unwrap();
    // A TTL that outlasts making them all, from the time the first 10 000
    // take here (debug builds are slow).
    let t = Instant::now();
    let mut refs = Vec::with_capacity(N as usize);
    let probe = 10_000;
    for _ in 0..probe {
        refs.push(
            pool.create_ref_ttl(&buf, 0, 64, Duration::from_secs(3600))
                .unwrap(),
        );
    }
    let ttl = t.elapsed() * (N / probe) * 2 + Duration::from_secs(2);
    for r in refs.drain(..) {
        pool.release_ref(&r).unwrap();
    }
    let t = Instant::now();
    for _ in 0..N {
        refs.push(pool.create_ref_ttl(&buf, 0, 64, ttl).unwrap());
    }
    let made = t.elapsed();
    let groups = (N as u64).div_ceil(dm_pool::EXPIRY_GROUP as u64);
    // A new pool's summary says every group is due: the first sweep reads
    // them all (and a few more: the freed probe's).
    let first = pool.maintain().unwrap();
    assert_eq!(first.refs_expired, 0);
    assert!(first.expiry_groups_swept >= groups, "{first:?}");
    // Then none is due, and none is read.
    let t = Instant::now();
    let idle = pool.maintain().unwrap();
    let idle_took = t.elapsed();
    assert_eq!(
        (idle.refs_expired, idle.expiry_groups_swept),
        (0, 0),
        "{idle:?}"
    );
    assert!(
        made < ttl,
        "making them took {made:?}, past their TTL {ttl:?}"
    );
    // Their TTL passes: every one expires.
    std::thread::sleep(ttl.saturating_sub(t.elapsed()) + Duration::from_millis(100));
    let t = Instant::now();
    let due = pool.maintain().unwrap();
    let due_took = t.elapsed();
    assert_eq!(due.refs_expired, N as u64, "{due:?}");
    assert!(due.expiry_groups_swept >= groups, "{due:?}");
    for r in &refs[..100] {
        assert!(matches!(
            pool.map_ref(r),
            Err(dm_pool::Error::RefExpired { .. }
                | dm_pool::Error::RefStale { .. }
                | dm_pool::Error::RefReleased { .. })
        ));
    }
    eprintln!(
        "{N} Refs: made in {made:?}; a sweep with none due {idle_took:?}, \
         with all due {due_took:?}"
    );
    drop(buf);
    drop(pool);
    tp.assert_clean();
}

//! The DM contract on the pool backend, in one process: semantics and every
//! bad input's typed error. Each test ends with the pool check.
#![allow(clippy::unwrap_used)]

mod common;
use common::TempPool;
use dm_pool::{AttachOptions, Error, MappedBuffer, Pool, PoolConfig, Ref};
use std::time::Duration;

/// A pool whose processes judged by their lease are reclaimed as soon as
/// it runs out (no quarantine), for tests of what follows a death.
fn no_quarantine() -> TempPool {
    TempPool::with(PoolConfig {
        size: 16 << 20,
        quarantine_ms: 0,
        ..Default::default()
    })
}

/// The conformance suite every backend runs (the memory server runs it
/// too), on two attachments of one pool plus a foreign pool. The tests
/// below are the pool's own: its layout, files, faults and limits.
#[test]
fn conformance_suite() {
    let tp = TempPool::new(16 << 20);
    let tp2 = TempPool::new(8 << 20);
    dm_pool::conformance::run_all(&|| tp.attach(), &|| tp2.attach());
    tp.assert_clean();
    tp2.assert_clean();
}

#[test]
fn partial_ref_at_odd_offset_and_segments() {
    let tp = TempPool::new(8 << 20);
    let pool = tp.attach();
    let mut a = pool.alloc(4 * 4096).unwrap();
    let data: Vec<u8> = (0..4 * 4096).map(|i| (i % 251) as u8).collect();
    a.write(0, &data).unwrap();
    let r = pool.create_ref(&a, 1000, 9000).unwrap();
    assert_eq!(r.len, 9000);
    let m = pool.map_ref(&r).unwrap();
    assert_eq!(m.to_vec().unwrap(), data[1000..10000].to_vec());
    let joined: Vec<u8> = m.segments(0, 9000).unwrap().concat();
    assert_eq!(joined, data[1000..10000].to_vec());
    // Freshly allocated pages come in runs: the view is a single slice.
    assert_eq!(m.segments(0, 9000).unwrap().len(), 1);
    pool.release_ref(&r).unwrap();
    drop((a, m, pool));
    tp.assert_clean();
}

#[test]
fn overwrite_writes_in_place_and_zeroes_what_it_leaves() {
    let tp = TempPool::new(8 << 20);
    let pool = tp.attach();
    let data: Vec<u8> = (0..3 * 4096 + 100).map(|i| (i % 253) as u8).collect();
    // A fresh buffer: its pages come straight from the free set.
    let mut a = pool.alloc(data.len() as u64).unwrap();
    a.overwrite(|runs| {
        let mut at = 0;
        for r in runs.iter_mut() {
            for b in r.iter_mut() {
                b.write(data[at]);
                at += 1;
            }
        }
        at
    })
    .unwrap();
    assert_eq!(a.to_vec().unwrap(), data);
    // Shared pages are replaced, not written: the other holder keeps its
    // bytes. What `fill` leaves unwritten reads as zeros.
    let kept = a.dup().unwrap();
    a.overwrite(|runs| {
        runs[0][..10].fill(std::mem::MaybeUninit::new(7));
        10
    })
    .unwrap();
    let mut want = vec![0u8; data.len()];
    want[..10].fill(7);
    assert_eq!(a.to_vec().unwrap(), want);
    assert_eq!(kept.to_vec().unwrap(), data);
    // A buffer starting inside a page (mapped from a Ref at an odd offset):
    // the bytes around its range stay the page's.
    let r = pool.create_ref(&kept, 1000, 5000).unwrap();
    let mut m = pool.map_ref(&r).unwrap();
    m.overwrite(|runs| {
        let n: usize = runs.iter().map(|r| r.len()).sum();
        assert_eq!(n, 5000);
        for r in runs.iter_mut() {
            r.fill(std::mem::MaybeUninit::new(9));
        }
        n
    })
    .unwrap();
    assert_eq!(m.to_vec().unwrap(), vec![9u8; 5000]);
    assert_eq!(
        pool.map_ref(&r).unwrap().to_vec().unwrap(),
        data[1000..6000]
    );
    pool.release_ref(&r).unwrap();
    drop((a, kept, m, pool));
    // Scattered free pages (every other one of a run freed, and reused at
    // once): a buffer written whole still gets consecutive pages, and
    // reads as one slice.
    let pool = tp.attach_with(AttachOptions {
        cool_pages: Some(0),
        ..Default::default()
    });
    let mut held: Vec<_> = (0..64)
        .map(|_| {
            let mut h = pool.alloc(4096).unwrap();
            h.write(0, &[1]).unwrap();
            h
        })
        .collect();
    let mut k = 0;
    held.retain(|_| {
        k += 1;
        k % 2 == 0
    });
    let mut b = pool.alloc(16 * 4096).unwrap();
    b.overwrite(|runs| runs.iter().map(|r| r.len()).sum())
        .unwrap();
    assert!(b.as_slice().unwrap().is_some(), "one run of pages");
    drop((b, held, pool));
    tp.assert_clean();
}

#[test]
fn double_free_and_foreign_buffers() {
    let tp = TempPool::new(8 << 20);
    let tp2 = TempPool::new(8 << 20);
    let pool = tp.attach();
    let other = tp2.attach();
    let b = pool.alloc(10).unwrap();
    let id = pool.into_id(b);
    pool.free_id(id).unwrap();
    assert!(matches!(pool.free_id(id), Err(Error::DoubleFree { .. })));
    let b2 = other.alloc(10).unwrap();
    assert!(matches!(
        pool.create_ref(&b2, 0, 5),
        Err(Error::ForeignPool { .. })
    ));
    assert!(matches!(
        pool.free_id(b2.id()),
        Err(Error::ForeignPool { .. })
    ));
    // A second process's buffer cannot be freed by this one.
    let p2 = tp.attach();
    let theirs = p2.alloc(10).unwrap();
    assert!(matches!(
        pool.free_id(theirs.id()),
        Err(Error::NotOwner { .. })
    ));
    drop((b2, theirs, p2, pool, other));
    tp.assert_clean();
    tp2.assert_clean();
}

/// Pool-specific: a buffer's descriptor presented as a Ref (the generic
/// forged/stale/foreign cases are in the conformance suite).
#[test]
fn buffer_descriptor_as_ref() {
    let tp = TempPool::new(8 << 20);
    let pool = tp.attach();
    let mut b = pool.alloc(8192).unwrap();
    b.write(0, b"secret").unwrap();
    let r = b.share().unwrap();
    let buf_as_ref = Ref {
        desc: b.id().desc,
        generation: b.id().generation,
        ..r
    };
    assert!(matches!(
        pool.map_ref(&buf_as_ref),
        Err(Error::RefForged { .. }) | Err(Error::RefStale { .. })
    ));
    pool.release_ref(&r).unwrap();
    assert!(pool.check().ok());
    drop((b, pool));
    tp.assert_clean();
}

#[test]
fn stale_ref_after_descriptor_reuse() {
    // A tiny descriptor table forces reuse.
    let tp = TempPool::with(PoolConfig {
        size: 4 << 20,
        descs: Some(4),
        ..Default::default()
    });
    let pool = tp.attach();
    let mut b = pool.alloc(10).unwrap();
    b.write(0, b"x").unwrap();
    let r = b.share().unwrap();
    pool.release_ref(&r).unwrap();
    let mut others = Vec::new();
    for _ in 0..3 {
        others.push(b.share().unwrap());
    }
    assert!(matches!(
        pool.map_ref(&r),
        Err(Error::RefStale { .. }) | Err(Error::RefReleased { .. })
    ));
    assert!(matches!(
        b.share(),
        Err(Error::ResourceExhausted {
            what: "descriptors"
        })
    ));
    for o in &others {
        pool.release_ref(o).unwrap();
    }
    drop((b, pool));
    tp.assert_clean();
}

#[test]
fn exhausted_pool_errors_then_recovers() {
    let tp = TempPool::new(1 << 20);
    let pool = tp.attach_with(AttachOptions {
        batch: 8,
        ..Default::default()
    });
    let mut bufs = Vec::new();
    let err = loop {
        let mut b = pool.alloc(64 * 1024).unwrap();
        match b.write(0, &vec![9u8; 64 * 1024]) {
            Ok(()) => bufs.push(b),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(err, Error::ResourceExhausted { what: "pages" }),
        "{err}"
    );
    // The message says what to do.
    assert!(err.to_string().contains("--size"), "{err}");
    let pages_before = pool.check().pages_held;
    // All-or-nothing: the failed write took nothing.
    assert!(pool.check().ok());
    // Sharing needs no pages; the pool stays usable.
    let r = bufs[0].share().unwrap();
    pool.release_ref(&r).unwrap();
    drop(bufs.pop());
    let mut b = pool.alloc(64 * 1024).unwrap();
    b.write(0, &vec![1u8; 64 * 1024]).unwrap();
    assert_eq!(pool.check().pages_held, pages_before);
    drop((b, bufs, pool));
    tp.assert_clean();
}

#[test]
fn bad_pool_files() {
    let dir = std::env::temp_dir();
    let junk = dir.join(format!("dmrpc-junk-{}", std::process::id()));
    std::fs::write(&junk, vec![0x55u8; 65536]).unwrap();
    assert!(matches!(
        Pool::open(&junk, AttachOptions::default()),
        Err(Error::NotAPool { .. })
    ));
    std::fs::write(&junk, b"tiny").unwrap();
    assert!(matches!(
        Pool::open(&junk, AttachOptions::default()),
        Err(Error::CorruptHeader(_))
    ));
    std::fs::remove_file(&junk).unwrap();

    let tp = TempPool::new(4 << 20);
    let mut bytes = tp.bytes();
    bytes[8] = 99; // version
    let f = dir.join(format!("dmrpc-v99-{}", std::process::id()));
    std::fs::write(&f, &bytes).unwrap();
    assert!(matches!(
        Pool::open(&f, AttachOptions::default()),
        Err(Error::VersionMismatch {
            found: 99,
            supported: dm_pool::POOL_VERSION
        })
    ));
    bytes[8] = dm_pool::POOL_VERSION as u8;
    bytes[60] ^= 0xff; // an offset: checksum catches it
    std::fs::write(&f, &bytes).unwrap();
    assert!(matches!(
        Pool::open(&f, AttachOptions::default()),
        Err(Error::CorruptHeader(_))
    ));
    std::fs::remove_file(&f).unwrap();

    assert!(matches!(
        Pool::open(
            std::path::Path::new("/nonexistent/dir/pool"),
            AttachOptions::default()
        ),
        Err(Error::Sys(_))
    ));
    // /proc/self/status cannot be mapped shared read-write.
    assert!(matches!(
        Pool::open(
            std::path::Path::new("/proc/self/status"),
            AttachOptions::default()
        ),
        Err(Error::Sys(_)) | Err(Error::CorruptHeader(_)) | Err(Error::NotAPool { .. })
    ));
    assert!(matches!(
        Pool::create(&tp.path, &PoolConfig::default()),
        Err(Error::AlreadyExists(_))
    ));
    // A page size that is not a power of two; a pool too small for a page.
    for cfg in [
        PoolConfig {
            page_size: 1000,
            ..Default::default()
        },
        PoolConfig {
            size: 1024,
            ..Default::default()
        },
    ] {
        assert!(matches!(
            Pool::create(&dir.join("x.pool"), &cfg),
            Err(Error::InvalidConfig(_))
        ));
    }
}

#[test]
fn mapped_buffer_load_store_cow() {
    let tp = TempPool::new(8 << 20);
    let pool = tp.attach();
    let mut m = MappedBuffer::alloc(&pool, 4 * 4096).unwrap();
    m.as_mut_slice()[..4].copy_from_slice(b"abcd"); // unbacked page: fault backs it
    m.as_mut_slice()[3 * 4096] = 9;
    assert_eq!(pool.check().pages_held, 2);
    let r = m.share().unwrap();
    let reader = pool.map_ref(&r).unwrap();
    m.as_mut_slice()[1] = b'X'; // shared: fault copies exactly one page
    m.as_mut_slice()[2] = b'Y'; // same page: no second fault
    assert_eq!(&m.as_slice()[..4], b"aXYd");
    assert_eq!(
        &reader.to_vec().unwrap()[..4],
        b"abcd",
        "the snapshot is intact"
    );
    assert_eq!(pool.check().pages_held, 3);
    // A mapped Ref sees the snapshot and copies on its own writes.
    let mut mr = MappedBuffer::map_ref(&pool, &r).unwrap();
    assert_eq!(&mr.as_slice()[..4], b"abcd");
    assert_eq!(mr.as_slice()[3 * 4096], 9);
    mr.as_mut_slice()[3 * 4096] = 10;
    assert_eq!(reader.to_vec().unwrap()[3 * 4096], 9);
    assert_eq!(m.as_slice()[3 * 4096], 9);
    assert_eq!(mr.as_slice()[3 * 4096], 10);
    pool.release_ref(&r).unwrap();
    drop(reader);
    // A mapping keeps the whole Ref alive after its release; once the last
    // one is gone, m is the sole holder again: the write fault just makes
    // the page writable.
    drop(mr);
    let held = pool.check().pages_held;
    m.as_mut_slice()[3 * 4096 + 1] = 1;
    assert_eq!(pool.check().pages_held, held);
    let rep = pool.check();
    assert!(rep.ok(), "{:?}", rep.problems);
    drop((m, pool));
    tp.assert_clean();
}

#[test]
fn faults_outside_windows_still_reach_the_default_handler() {
    // A child that installs the hook and then dereferences null must die of
    // SIGSEGV, not hang or be swallowed.
    if std::env::var("DMRPC_SEGV_CHILD").is_ok() {
        let tp = TempPool::new(4 << 20);
        let pool = tp.attach();
        let _m = MappedBuffer::alloc(&pool, 4096).unwrap();
        // SAFETY: deliberately invalid, to test signal chaining.
        unsafe { std::ptr::write_volatile(8 as *mut u8, 1) };
        unreachable!();
    }
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "faults_outside_windows_still_reach_the_default_handler",
            "--nocapture",
        ])
        .env("DMRPC_SEGV_CHILD", "1")
        .spawn()
        .unwrap();
    let st = child.wait().unwrap();
    // The child died before its cleanup: remove the pools it made.
    let prefix = format!("dmrpc-test-{}-", child.id());
    for e in std::fs::read_dir("/dev/shm").unwrap().flatten() {
        if e.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_file(e.path());
        }
    }
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(st.signal(), Some(libc_sigsegv()), "child status {st:?}");
}

fn libc_sigsegv() -> i32 {
    11
}

#[test]
fn pool_on_a_regular_disk_file() {
    // Any mmap-able file works as a backing, not only /dev/shm (tmpfs).
    let path = std::env::temp_dir().join(format!("dmrpc-disk-{}.pool", std::process::id()));
    let _ = std::fs::remove_file(&path);
    Pool::create(
        &path,
        &PoolConfig {
            size: 8 << 20,
            ..Default::default()
        },
    )
    .unwrap();
    {
        let pool = Pool::open(&path, AttachOptions::default()).unwrap();
        let mut b = pool.alloc(3 * 4096).unwrap();
        b.write(5000, b"on disk").unwrap();
        let r = b.share().unwrap();
        let m = pool.map_ref(&r).unwrap();
        assert_eq!(&m.to_vec().unwrap()[5000..5007], b"on disk");
        pool.release_ref(&r).unwrap();
        drop((b, m, pool));
    }
    let rep = dm_pool::check_path(&path, true).unwrap();
    assert!(rep.ok() && rep.pages_held == 0, "{rep:?}");
    Pool::destroy(&path).unwrap();
    assert!(!path.exists());
}

#[test]
fn registry_names_and_channel_lifecycle() {
    use dm_pool::{Endpoint, Peer, Side};
    // Its dying processes are judged by their lease: reused at once.
    let tp = no_quarantine();
    let server = tp.attach();
    let client = tp.attach();
    assert!(matches!(
        server.register("bad//name", &Endpoint::Shm),
        Err(Error::InvalidName(_))
    ));
    let svc = server
        .register("shop/images/resize", &Endpoint::Shm)
        .unwrap();
    let tcp = server
        .register("shop/cart", &Endpoint::Tcp("10.0.0.1:7000".into()))
        .unwrap();
    // The refusal names the holder, how long its lease runs, and what to do.
    match client.register("shop/images/resize", &Endpoint::Shm) {
        Err(
            e @ Error::NameTaken {
                pid, lease_left_ms, ..
            },
        ) => {
            assert_eq!(pid, std::process::id());
            assert!(lease_left_ms <= server.layout().lease_ms, "{e}");
            let m = e.to_string();
            assert!(
                m.contains(&format!("process {pid}")) && m.contains("wait_for_name"),
                "{m}"
            );
        }
        other => panic!("not refused: {other:?}"),
    }
    let found = client.lookup("shop/images/resize").unwrap().unwrap();
    assert_eq!(found, svc);
    assert_eq!(
        client.lookup("shop/cart").unwrap().unwrap().endpoint,
        Endpoint::Tcp("10.0.0.1:7000".into())
    );
    assert_eq!(client.lookup("shop/none").unwrap(), None);
    assert_eq!(client.services().len(), 2);
    assert!(matches!(
        client.unregister(&svc),
        Err(Error::NotRegistered(_))
    ));

    let ch = client.open_channel(&found).unwrap();
    assert_eq!(server.pending_channels(&svc), vec![ch]);
    server.accept_channel(ch).unwrap();
    assert!(server.pending_channels(&svc).is_empty());
    assert!(
        client.accept_channel(ch).is_err(),
        "only the server accepts"
    );
    assert_eq!(client.channel_peer(ch, Side::Client), Peer::Live);
    assert_eq!(server.channel_peer(ch, Side::Server), Peer::Live);
    let mem = client.channel_memory(ch).unwrap();
    assert!(mem.ring_size.is_power_of_two());
    client.close_channel(ch, Side::Client);
    assert_eq!(server.channel_peer(ch, Side::Server), Peer::Closed);
    assert_eq!(tp_check(&tp).channels, 1, "open until both ends close");
    server.close_channel(ch, Side::Server);
    assert_eq!(tp_check(&tp).channels, 0);
    assert!(
        client.channel_memory(ch).is_err(),
        "a freed channel is gone"
    );

    // Abandoned before it was accepted: freed at once, and the server
    // cannot accept it any more; after it was accepted: closed on the
    // client's side only.
    let ch = client.open_channel(&svc).unwrap();
    client.abandon_channel(ch);
    assert_eq!(tp_check(&tp).channels, 0);
    assert!(server.accept_channel(ch).is_err());
    assert!(server.pending_channels(&svc).is_empty());
    let ch = client.open_channel(&svc).unwrap();
    server.accept_channel(ch).unwrap();
    client.abandon_channel(ch);
    assert_eq!(server.channel_peer(ch, Side::Server), Peer::Closed);
    assert_eq!(tp_check(&tp).channels, 1);
    server.close_channel(ch, Side::Server);
    assert_eq!(tp_check(&tp).channels, 0);

    server.unregister(&svc).unwrap();
    server.unregister(&tcp).unwrap();
    assert!(client.services().is_empty());

    // A dead owner: its service and its end of a channel go with its lease.
    let dying = tp.attach_with(AttachOptions {
        heartbeat: false,
        lease_only: true,
        lease_ms: Some(30),
        ..Default::default()
    });
    let svc = dying.register("svc/dying", &Endpoint::Shm).unwrap();
    let ch = client.open_channel(&svc).unwrap();
    std::thread::sleep(Duration::from_millis(60));
    assert_eq!(client.channel_peer(ch, Side::Client), Peer::Dead);
    assert!(client.lookup("svc/dying").unwrap().is_none());
    let rep = client.maintain().unwrap();
    assert_eq!((rep.services_removed, rep.slots_reclaimed), (1, 1));
    assert_eq!(client.channel_peer(ch, Side::Client), Peer::Closed);
    // The name is free again for a live process.
    let again = server.register("svc/dying", &Endpoint::Shm).unwrap();
    server.unregister(&again).unwrap();
    client.close_channel(ch, Side::Client);
    drop((dying, server, client));
    tp.assert_clean();
}

/// With every channel in use, a client opening one frees the channels of
/// dead processes itself (no maintenance ran) and takes one; channels
/// whose live end has yet to close are counted as closing, the others
/// refused at once.
#[test]
fn an_opener_frees_dead_channels_and_sees_the_closing_ones() {
    use dm_pool::{Closing, Endpoint, Peer, Side};
    let tp = TempPool::with(PoolConfig {
        quarantine_ms: 0,
        size: 16 << 20,
        channels: Some(2),
        ring_size: 16 << 10,
        ..Default::default()
    });
    let server = tp.attach();
    let client = tp.attach();
    let svc = server.register("svc/live", &Endpoint::Shm).unwrap();
    let dying = tp.attach_with(AttachOptions {
        heartbeat: false,
        lease_only: true,
        lease_ms: Some(30),
        ..Default::default()
    });
    let gone = dying.register("svc/dying", &Endpoint::Shm).unwrap();
    // Channel 1: the live client's, to the dying server, closed on the
    // client's side. Channel 2: the dying process's, to the live server.
    let a = client.open_channel(&gone).unwrap();
    client.close_channel(a, Side::Client);
    let b = dying.open_channel(&svc).unwrap();
    server.accept_channel(b).unwrap();
    assert_eq!(client.channels_closing().soon, 1);
    std::thread::sleep(Duration::from_millis(60));
    // Channel 1 has both ends gone: freed by the opener and taken.
    let c = client.open_channel(&svc).unwrap();
    assert_eq!(c.index, a.index);
    // Channel 2's dead client is closed, but its live server has not
    // closed its end yet: closing, not free.
    let e = client.open_channel(&svc).unwrap_err();
    assert!(matches!(e, Error::ResourceExhausted { .. }), "{e:?}");
    assert_eq!(client.channels_closing().soon, 1);
    assert_eq!(server.channel_peer(b, Side::Server), Peer::Closed);
    server.close_channel(b, Side::Server);
    assert_eq!(client.channels_closing().soon, 0);
    let d = client.open_channel(&svc).unwrap();
    // Both in use by live processes: nothing closing, refused.
    assert!(client.open_channel(&svc).is_err());
    assert_eq!(client.channels_closing(), Closing::default());
    // The server closes first: the channel waits on its live client, which
    // only it can free (by noticing, in a call, and closing its end).
    for ch in [c, d] {
        server.close_channel(ch, Side::Server);
    }
    let closing = client.channels_closing();
    assert_eq!((closing.soon, closing.by_clients), (0, 2));
    assert!(client.open_channel(&svc).is_err());
    for ch in [c, d] {
        client.close_channel(ch, Side::Client);
    }
    assert_eq!(client.channels_closing().total(), 0);
    server.unregister(&svc).unwrap();
    client.maintain().unwrap();
    drop((dying, server, client));
    tp.assert_clean();
}

fn tp_check(tp: &TempPool) -> dm_pool::CheckReport {
    dm_pool::check_path(&tp.path, false).unwrap()
}

/// Pages are zeroed when taken, not when freed (format 5): after every page
/// of the pool held old bytes, new buffers still read zero wherever they
/// were not written — a partial first write, a write fault of a mapped
/// buffer, list pages of a large buffer (checked by the deep check).
#[test]
fn recycled_pages_read_zero_where_not_written() {
    let tp = TempPool::new(4 << 20);
    // Dirty every page the pool can give; detaching returns them all to
    // the shared free set (where a mapped buffer's fault claims pages).
    let dirty = tp.attach();
    let mut held = Vec::new();
    while let Ok(mut b) = dirty.alloc(64 << 10) {
        match b.write(0, &[0xAB; 64 << 10]) {
            Ok(()) => held.push(b),
            Err(_) => break,
        }
    }
    assert!(held.len() > 8, "only {} buffers", held.len());
    for b in held.drain(..) {
        dirty.free(b).unwrap();
    }
    drop(dirty);
    let pool = tp.attach();
    // A partial write in the middle of one page, a whole page after it.
    let ps = 4096usize;
    let mut a = pool.alloc(4 * ps as u64).unwrap();
    a.write(ps as u64 + 100, b"hello").unwrap();
    a.write(2 * ps as u64, &[7u8; 4096]).unwrap();
    let got = a.to_vec().unwrap();
    let mut want = vec![0u8; 4 * ps];
    want[ps + 100..ps + 105].copy_from_slice(b"hello");
    want[2 * ps..3 * ps].fill(7);
    assert_eq!(got, want, "only written bytes are nonzero");
    // A write fault on an unbacked page of a mapped buffer.
    let mut m = MappedBuffer::alloc(&pool, 2 * ps as u64).unwrap();
    m.as_mut_slice()[ps + 1] = 5;
    assert!(m.as_slice()[..ps + 1].iter().all(|&x| x == 0));
    assert!(m.as_slice()[ps + 2..].iter().all(|&x| x == 0));
    // A buffer with list pages (more pages than a descriptor holds
    // inline), shared by a Ref: both have list pages from dirty pages.
    let mut big = pool.alloc(100 * ps as u64).unwrap();
    big.write(50 * ps as u64 + 3, b"x").unwrap();
    let r = big.share().unwrap();
    let seen = pool.map_ref(&r).unwrap().to_vec().unwrap();
    assert_eq!(seen.iter().filter(|&&x| x != 0).count(), 1);
    let rep = dm_pool::check_path(&tp.path, true).unwrap();
    assert!(rep.ok(), "{:?}", rep.problems);
    pool.release_ref(&r).unwrap();
    drop((a, m, big, pool));
    tp.assert_clean();
}

#[test]
fn a_name_has_any_number_of_replicas_or_one_exclusive_registration() {
    use dm_pool::Endpoint;
    // Its dying processes are judged by their lease: reused at once.
    let tp = no_quarantine();
    let (a, b, c) = (tp.attach(), tp.attach(), tp.attach());
    let name = "shop/images/worker";
    let ra = a.register_replica(name, &Endpoint::Shm).unwrap();
    let rb = b.register_replica(name, &Endpoint::Shm).unwrap();
    let rt = b
        .register_replica(name, &Endpoint::Tcp("10.0.0.2:7000".into()))
        .unwrap();
    assert!(ra.replica && rb.replica && rt.replica);
    assert_ne!(ra.index, rb.index);
    // An exclusive registration is refused while replicas hold the name.
    assert!(matches!(
        c.register(name, &Endpoint::Shm),
        Err(Error::NameTaken { .. })
    ));
    let all = c.lookup_all(name).unwrap();
    assert_eq!(all, vec![ra.clone(), rb.clone(), rt.clone()]);
    assert_eq!(
        c.lookup(name).unwrap(),
        Some(ra.clone()),
        "the first replica"
    );
    assert_eq!(c.lookup_all("shop/none").unwrap(), vec![]);
    assert!(c.lookup_all("bad//name").is_err());

    // One replica leaves: the others stay.
    a.unregister(&ra).unwrap();
    assert_eq!(c.lookup_all(name).unwrap(), vec![rb.clone(), rt.clone()]);
    b.unregister(&rb).unwrap();
    b.unregister(&rt).unwrap();
    assert!(c.lookup_all(name).unwrap().is_empty());

    // An exclusive registration keeps replicas out, and is not one.
    let ex = a.register(name, &Endpoint::Shm).unwrap();
    assert!(!ex.replica);
    assert!(matches!(
        b.register_replica(name, &Endpoint::Shm),
        Err(Error::NameTaken { .. })
    ));
    a.unregister(&ex).unwrap();

    // A dead replica goes with its lease; the live ones stay, and a dead
    // exclusive owner's name is free for replicas.
    let dying = tp.attach_with(AttachOptions {
        heartbeat: false,
        lease_only: true,
        lease_ms: Some(30),
        ..Default::default()
    });
    let rd = dying.register_replica(name, &Endpoint::Shm).unwrap();
    let rl = a.register_replica(name, &Endpoint::Shm).unwrap();
    std::thread::sleep(Duration::from_millis(60));
    assert_eq!(c.lookup_all(name).unwrap(), vec![rl.clone()]);
    let rep = c.maintain().unwrap();
    assert_eq!(rep.services_removed, 1);
    assert!(!c
        .services()
        .iter()
        .any(|s| s.index == rd.index && s.generation == rd.generation));
    a.unregister(&rl).unwrap();
    let dying = tp.attach_with(AttachOptions {
        heartbeat: false,
        lease_only: true,
        lease_ms: Some(30),
        ..Default::default()
    });
    let _gone = dying.register(name, &Endpoint::Shm).unwrap();
    std::thread::sleep(Duration::from_millis(60));
    let r = b.register_replica(name, &Endpoint::Shm).unwrap();
    b.unregister(&r).unwrap();
    drop((dying, a, b, c));
    tp.assert_clean();
}

/// `into_ref`: the buffer's descriptor becomes the Ref, and its pages
/// keep the one share they have (none counted up or down): the pages
/// held and the descriptors in use stay as they were, the Ref reads what
/// the buffer held (unwritten pages as zeros), and releasing it frees
/// everything. 1 MiB: the buffer's entries live in list pages.
#[test]
fn a_buffer_turned_into_a_ref_keeps_its_pages_and_counts_nothing() {
    let tp = TempPool::new(16 << 20);
    let pool = tp.attach();
    let reader = tp.attach();
    let len = 1 << 20;
    let mut b = pool.alloc(len).unwrap();
    let data: Vec<u8> = (0..len).map(|i| (i % 253) as u8 + 1).collect();
    // All pages but one written (the fourth stays unbacked).
    b.write(0, &data[..3 * 4096]).unwrap();
    b.write(4 * 4096, &data[4 * 4096..]).unwrap();
    let before = pool.check();
    assert_eq!((before.buffers, before.refs_live), (1, 0));
    let created = pool.counters().refs_created;
    let id = b.id();
    let r = pool.into_ref(b).unwrap();
    assert_eq!(r.len, len);
    // The buffer's own descriptor, now a Ref (a Ref made by sharing would
    // have taken another).
    assert_eq!((r.desc, r.generation), (id.desc, id.generation));
    let after = pool.check();
    assert!(after.ok(), "{:?}", after.problems);
    assert_eq!((after.buffers, after.refs_live), (0, 1));
    assert_eq!(after.pages_held, before.pages_held);
    assert_eq!(after.pages_shared, 0, "no page gained a share");
    assert_eq!(pool.counters().refs_created, created + 1);
    let mut want = data.clone();
    want[3 * 4096..4 * 4096].fill(0);
    let m = reader.map_ref(&r).unwrap();
    assert_eq!(m.to_vec().unwrap(), want);
    drop(m);
    reader.release_ref(&r).unwrap();
    assert_eq!(pool.check().pages_held, 0);
    // Released: a second release is a typed error.
    assert!(matches!(
        reader.release_ref(&r),
        Err(Error::RefReleased { .. } | Error::RefStale { .. })
    ));
    drop((pool, reader));
    tp.assert_clean();
}

/// A buffer mapped from a Ref borrows that Ref's pages: `into_ref` shares
/// it and frees it instead, with the same result (the Ref reads the
/// mapped buffer's content, its own writes included), and the original
/// Ref is unchanged.
#[test]
fn a_mapped_buffer_turned_into_a_ref_is_shared_then_freed() {
    let tp = TempPool::new(16 << 20);
    let pool = tp.attach();
    let mut a = pool.alloc(3 * 4096).unwrap();
    a.write(0, &[7u8; 3 * 4096]).unwrap();
    let r0 = a.share().unwrap();
    drop(a);
    let mut m = pool.map_ref(&r0).unwrap();
    m.write(4096, &[9u8; 10]).unwrap();
    let r1 = pool.into_ref(m).unwrap();
    let got = pool.map_ref(&r1).unwrap().to_vec().unwrap();
    let mut want = vec![7u8; 3 * 4096];
    want[4096..4106].fill(9);
    assert_eq!(got, want);
    let orig = pool.map_ref(&r0).unwrap().to_vec().unwrap();
    assert_eq!(orig, vec![7u8; 3 * 4096]);
    let c = pool.check();
    assert!(c.ok(), "{:?}", c.problems);
    assert_eq!((c.buffers, c.refs_live), (0, 2));
    pool.release_ref(&r1).unwrap();
    pool.release_ref(&r0).unwrap();
    drop(pool);
    tp.assert_clean();
}

/// `try_into_ref` loses nothing when it fails: a mapped buffer has to be
/// shared (a new descriptor), and with every descriptor in use the error
/// comes back with the buffer, its content and its writes intact; once a
/// descriptor is free again the same buffer becomes its Ref. (`into_ref`
/// frees the buffer on such an error.)
#[test]
fn a_failed_try_into_ref_hands_the_buffer_back_intact() {
    let tp = TempPool::new(8 << 20);
    let pool = tp.attach();
    let mut a = pool.alloc(2 * 4096).unwrap();
    a.write(0, &[5u8; 2 * 4096]).unwrap();
    let r0 = a.share().unwrap();
    drop(a);
    let mut m = pool.map_ref(&r0).unwrap();
    m.write(100, &[6u8; 4]).unwrap();
    let mut want = vec![5u8; 2 * 4096];
    want[100..104].fill(6);
    let mut fillers = Vec::new();
    let err = loop {
        match pool.alloc(1) {
            Ok(b) => fillers.push(b),
            Err(e) => break e,
        }
    };
    assert!(matches!(err, Error::ResourceExhausted { .. }), "{err:?}");
    let (e, m) = pool.try_into_ref(m).unwrap_err();
    assert!(matches!(e, Error::ResourceExhausted { .. }), "{e:?}");
    assert_eq!(m.to_vec().unwrap(), want);
    drop(fillers.pop());
    let r1 = pool.try_into_ref(m).unwrap();
    assert_eq!(pool.map_ref(&r1).unwrap().to_vec().unwrap(), want);
    drop(fillers);
    pool.release_ref(&r1).unwrap();
    pool.release_ref(&r0).unwrap();
    let c = pool.check();
    assert!(c.ok(), "{:?}", c.problems);
    drop(pool);
    tp.assert_clean();
}

/// The buffer is gone once it is a Ref: freeing it by an id taken before
/// is a double free (a typed error), and the Ref is untouched by it.
#[test]
fn freeing_a_buffer_turned_into_a_ref_by_its_old_id_is_a_double_free() {
    let tp = TempPool::new(8 << 20);
    let pool = tp.attach();
    let mut b = pool.alloc(8192).unwrap();
    b.write(0, &[3u8; 8192]).unwrap();
    let id = b.id();
    let r = pool.into_ref_ttl(b, Duration::from_secs(60)).unwrap();
    assert!(matches!(pool.free_id(id), Err(Error::DoubleFree { .. })));
    assert_eq!(pool.map_ref(&r).unwrap().to_vec().unwrap(), vec![3u8; 8192]);
    pool.release_ref(&r).unwrap();
    drop(pool);
    tp.assert_clean();
}

/// A Ref made by `into_ref` expires like any other: its time to live
/// passes, maintenance drops it, and its pages are freed.
#[test]
fn a_buffer_turned_into_a_ref_expires_with_its_time_to_live() {
    let tp = TempPool::new(8 << 20);
    let pool = tp.attach();
    let mut b = pool.alloc(3 * 4096).unwrap();
    b.write(0, &[1u8; 3 * 4096]).unwrap();
    let r = pool.into_ref_ttl(b, Duration::from_millis(20)).unwrap();
    std::thread::sleep(Duration::from_millis(1200));
    pool.maintain().unwrap();
    assert!(pool.map_ref(&r).is_err());
    assert_eq!(pool.check().pages_held, 0);
    drop(pool);
    tp.assert_clean();
}

/// A pool larger than the free space of its file system is refused at
/// creation with a typed error (written past the free space, its mapping
/// would end the process with SIGBUS), and leaves no file behind.
#[test]
fn a_pool_larger_than_the_free_space_of_its_file_system_is_refused() {
    // SAFETY: a zeroed statvfs is a valid out-value; the path is a valid C string.
    let free = unsafe {
        let mut v: libc::statvfs = std::mem::zeroed();
        assert_eq!(libc::statvfs(c"/dev/shm".as_ptr(), &mut v), 0);
        v.f_bavail * v.f_frsize
    };
    let path = std::path::PathBuf::from(format!(
        "/dev/shm/dmrpc-test-nospace-{}.pool",
        std::process::id()
    ));
    let e = Pool::create(
        &path,
        &PoolConfig {
            size: free + (1 << 30),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(matches!(e, Error::Sys(_)), "{e:?}");
    assert!(e.to_string().contains("SIGBUS"), "{e}");
    assert!(!path.exists());
}

/// Shared metadata corrupted into a loop (a Ref's descriptor set to
/// inherit from itself) is refused with `Corrupt` by a read through it and
/// reported by `check`, never followed without a bound.
#[test]
fn an_inherit_chain_corrupted_into_a_loop_is_refused_not_followed() {
    use std::os::unix::fs::FileExt;
    let tp = TempPool::new(16 << 20);
    let pool = tp.attach();
    let mut b = pool.alloc(8192).unwrap();
    b.write(0, b"data").unwrap();
    let r = b.share().unwrap();
    let m = pool.map_ref(&r).unwrap(); // reads through the Ref
    let (file, start) = tp.backing();
    let at = start + pool.layout().desc_off + r.desc as u64 * 256;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .unwrap();
    let mut saved = [0u8; 64];
    f.read_exact_at(&mut saved, at).unwrap();
    // The Ref's descriptor: its tag names itself, its flags say it inherits.
    f.write_all_at(&(r.desc as u64).to_le_bytes(), at + 8)
        .unwrap();
    let flags = u32::from_le_bytes(saved[56..60].try_into().unwrap()) | 2;
    f.write_all_at(&flags.to_le_bytes(), at + 56).unwrap();
    let e = m.read(0, &mut [0u8; 4]).unwrap_err();
    assert!(matches!(e, Error::Corrupt(_)), "{e}");
    assert!(!pool.check().ok(), "check sees the corruption");
    // Put it back: the pool is whole again.
    f.write_all_at(&saved, at).unwrap();
    let mut got = [0u8; 4];
    m.read(0, &mut got).unwrap();
    assert_eq!(&got, b"data");
    pool.release_ref(&r).unwrap();
    drop((m, b, pool));
    tp.assert_clean();
}

/// A pool file others could have written is refused: a symbolic link to
/// it, a file any user may write, a file of another user, and one its
/// group may write unless the attach asks for group sharing (as a pool
/// created for its group is).
#[test]
fn a_pool_file_others_could_write_is_refused() {
    use dm_pool::AttachOptions;
    use std::os::unix::fs::PermissionsExt;
    let refused = |r: dm_pool::Result<Pool>, what: &str| match r {
        Err(e @ Error::Sys(_)) => assert!(e.to_string().contains("refusing"), "{what}: {e}"),
        Err(e) => panic!("{what}: {e:?}"),
        Ok(_) => panic!("{what}: attached"),
    };
    let tp = TempPool::new(8 << 20);
    // A namespace is judged by its device's file.
    let (file, _) = tp.backing();
    let in_link = |link: &std::path::Path| match dm_pool::namespace::split(&tp.path) {
        Some((_, name)) => link.join(name),
        None => link.to_owned(),
    };
    let chmod =
        |mode| std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
    let link = file.with_extension("link");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&file, &link).unwrap();
    refused(
        Pool::open(&in_link(&link), AttachOptions::default()),
        "a symlink",
    );
    std::fs::remove_file(&link).unwrap();
    chmod(0o666);
    refused(Pool::open(&tp.path, AttachOptions::default()), "mode 666");
    chmod(0o660);
    refused(Pool::open(&tp.path, AttachOptions::default()), "mode 660");
    let group = AttachOptions {
        group: true,
        ..Default::default()
    };
    drop(Pool::open(&tp.path, group.clone()).unwrap());
    chmod(0o600);
    drop(Pool::open(&tp.path, AttachOptions::default()).unwrap());
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        std::os::unix::fs::chown(&file, Some(65534), None).unwrap();
        refused(Pool::open(&tp.path, group.clone()), "another user's");
        std::os::unix::fs::chown(&file, Some(0), None).unwrap();
    }
    if dm_pool::testing::in_namespaces() {
        // (A device's mode is its file's: what follows is about files.)
        return;
    }
    // A pool created for its group is mode 0660, and attached as such.
    let path = tp.path.with_extension("group");
    let _ = Pool::destroy(&path);
    Pool::create(
        &path,
        &PoolConfig {
            size: 8 << 20,
            group: true,
            ..Default::default()
        },
    )
    .unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660);
    drop(Pool::open(&path, group).unwrap());
    Pool::destroy(&path).unwrap();
    tp.assert_clean();
}

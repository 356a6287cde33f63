//! The DM contract on the pool backend, in one process: semantics and every
//! bad input's typed error. Each test ends with the pool check.
#![allow(clippy::unwrap_used)]

mod common;
use common::TempPool;
use dm_pool::{AttachOptions, Error, MappedBuffer, Pool, PoolConfig, Ref};
use std::time::Duration;

#[test]
fn alloc_write_read_and_lazy_zero() {
    let tp = TempPool::new(8 << 20);
    let pool = tp.attach();
    let mut b = pool.alloc(3 * 4096 + 17).unwrap();
    assert_eq!(b.to_vec().unwrap(), vec![0u8; 3 * 4096 + 17]);
    assert_eq!(pool.check().pages_held, 0, "alloc backs no page");
    b.write(4090, b"across a page boundary").unwrap();
    let mut out = vec![0u8; 22];
    b.read(4090, &mut out).unwrap();
    assert_eq!(&out, b"across a page boundary");
    assert_eq!(pool.check().pages_held, 2, "only written pages are backed");
    drop(b);
    drop(pool);
    tp.assert_clean();
}

#[test]
fn refs_snapshot_and_cow_both_ways() {
    let tp = TempPool::new(8 << 20);
    let pool = tp.attach();
    let mut a = pool.alloc(5 * 4096).unwrap();
    a.write(0, &vec![1u8; 5 * 4096]).unwrap();
    let r = a.share().unwrap();
    let copies0 = pool.check().pages_shared;
    assert_eq!(copies0, 5, "all pages shared, none copied");
    let mut m1 = pool.map_ref(&r).unwrap();
    let m2 = pool.map_ref(&r).unwrap(); // fan-out
    a.write(4096, &[2u8; 10]).unwrap(); // writer copies one page
    assert_eq!(
        m1.to_vec().unwrap(),
        vec![1u8; 5 * 4096],
        "holders keep the snapshot"
    );
    m1.write(2 * 4096 + 5, &[3u8; 3]).unwrap(); // a mapper copies its page too
    assert_eq!(m2.to_vec().unwrap(), vec![1u8; 5 * 4096]);
    let mut want_a = vec![1u8; 5 * 4096];
    want_a[4096..4106].fill(2);
    assert_eq!(a.to_vec().unwrap(), want_a);
    let mut want_m1 = vec![1u8; 5 * 4096];
    want_m1[2 * 4096 + 5..2 * 4096 + 8].fill(3);
    assert_eq!(m1.to_vec().unwrap(), want_m1);
    let rep = pool.check();
    assert!(rep.ok(), "{:?}", rep.problems);
    assert_eq!(
        rep.pages_held,
        5 + 2,
        "exactly the two written pages were copied"
    );
    pool.release_ref(&r).unwrap();
    drop((a, m1, m2));
    drop(pool);
    tp.assert_clean();
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
fn large_buffers_use_list_pages() {
    let tp = TempPool::new(64 << 20);
    let pool = tp.attach();
    let len = 300 * 4096 + 3;
    let mut a = pool.alloc(len).unwrap();
    a.write(len - 10, b"0123456789").unwrap();
    a.write(0, b"start").unwrap();
    let r = a.share().unwrap();
    let mut m = pool.map_ref(&r).unwrap();
    m.write(100 * 4096, b"x").unwrap();
    let v = m.to_vec().unwrap();
    assert_eq!(&v[..5], b"start");
    assert_eq!(&v[len as usize - 10..], b"0123456789");
    assert_eq!(v[100 * 4096], b'x');
    assert_eq!(a.to_vec().unwrap()[100 * 4096], 0);
    let rep = pool.check();
    assert!(rep.ok(), "{:?}", rep.problems);
    pool.release_ref(&r).unwrap();
    drop((a, m, pool));
    tp.assert_clean();
}

#[test]
fn bad_lengths_and_bounds() {
    let tp = TempPool::new(8 << 20);
    let pool = tp.attach();
    assert!(matches!(pool.alloc(0), Err(Error::ZeroLength)));
    assert!(matches!(pool.alloc(u64::MAX), Err(Error::TooLarge { .. })));
    let mut b = pool.alloc(100).unwrap();
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
    assert!(matches!(b.create_ref(0, 0), Err(Error::ZeroLength)));
    assert!(matches!(
        b.create_ref(50, 51),
        Err(Error::OutOfBounds { .. })
    ));
    drop((b, pool));
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

#[test]
fn forged_stale_released_and_foreign_refs() {
    let tp = TempPool::new(8 << 20);
    let tp2 = TempPool::new(8 << 20);
    let pool = tp.attach();
    let other = tp2.attach();
    let mut b = pool.alloc(8192).unwrap();
    b.write(0, b"secret").unwrap();
    let r = b.share().unwrap();

    let forged = Ref {
        tag: r.tag ^ 1,
        ..r
    };
    assert!(matches!(
        pool.map_ref(&forged),
        Err(Error::RefForged { .. })
    ));
    assert!(matches!(
        pool.release_ref(&forged),
        Err(Error::RefForged { .. })
    ));
    let longer = Ref {
        len: r.len + 1,
        ..r
    };
    assert!(matches!(
        pool.map_ref(&longer),
        Err(Error::RefForged { .. })
    ));
    let out_of_range = Ref {
        desc: u32::MAX - 1,
        ..r
    };
    assert!(matches!(
        pool.map_ref(&out_of_range),
        Err(Error::RefForged { .. })
    ));
    let stale_gen = Ref {
        generation: r.generation.wrapping_sub(1),
        ..r
    };
    assert!(matches!(
        pool.map_ref(&stale_gen),
        Err(Error::RefStale { .. })
    ));
    assert!(matches!(other.map_ref(&r), Err(Error::ForeignPool { .. })));
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
    assert!(
        matches!(pool.release_ref(&r), Err(Error::RefReleased { .. })),
        "double release"
    );
    assert!(matches!(pool.map_ref(&r), Err(Error::RefReleased { .. })));
    assert!(pool.check().ok());
    drop((b, pool, other));
    tp.assert_clean();
    tp2.assert_clean();
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
fn ref_ttl_expires_and_is_reclaimed() {
    let tp = TempPool::new(8 << 20);
    let pool = tp.attach();
    let mut b = pool.alloc(3 * 4096).unwrap();
    b.write(0, &[7u8; 3 * 4096]).unwrap();
    let r = pool
        .create_ref_ttl(&b, 0, 3 * 4096, Duration::from_millis(30))
        .unwrap();
    drop(b);
    assert_eq!(pool.check().pages_held, 3, "the Ref keeps its pages");
    std::thread::sleep(Duration::from_millis(60));
    assert!(matches!(pool.map_ref(&r), Err(Error::RefExpired { .. })));
    let rep = pool.maintain().unwrap();
    assert_eq!(rep.refs_expired, 1);
    assert_eq!(
        pool.check().pages_held,
        0,
        "an unreleased Ref does not leak"
    );
    assert!(matches!(
        pool.release_ref(&r),
        Err(Error::RefExpired { .. })
    ));
    drop(pool);
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
    let mut bytes = std::fs::read(&tp.path).unwrap();
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
    assert!(matches!(
        Pool::create(
            &dir.join("x.pool"),
            &PoolConfig {
                page_size: 1000,
                ..Default::default()
            }
        ),
        Err(Error::CorruptHeader(_))
    ));
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
    let tp = TempPool::new(16 << 20);
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
    assert!(matches!(
        client.register("shop/images/resize", &Endpoint::Shm),
        Err(Error::NameTaken(_))
    ));
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

    server.unregister(&svc).unwrap();
    server.unregister(&tcp).unwrap();
    assert!(client.services().is_empty());

    // A dead owner: its service and its end of a channel go with its lease.
    let dying = tp.attach_with(AttachOptions {
        heartbeat: false,
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

fn tp_check(tp: &TempPool) -> dm_pool::CheckReport {
    dm_pool::check_path(&tp.path, false).unwrap()
}

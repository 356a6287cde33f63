//! The memory server in this process: metrics, an exhausted server,
//! concurrent clients on a multi-threaded server, pipelined large I/O.
#![allow(clippy::unwrap_used)]

use dm_memserver::{Config, MemPool, Server};
use dm_pool::{Dm, DmBuffer, Error};
use std::io::{Read, Write};
use std::time::Duration;

fn settle(s: &Server) {
    // Sessions of dropped pools end asynchronously.
    for _ in 0..100 {
        if s.state().usage().pages_held == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let problems = s.state().check();
    assert!(problems.is_empty(), "{problems:#?}");
    assert_eq!(s.state().usage().pages_held, 0);
}

#[test]
fn metrics_endpoint_counts_requests_cow_and_pages() {
    let s = Server::start(Config {
        metrics: Some("127.0.0.1:0".into()),
        ..Default::default()
    })
    .unwrap();
    let p = MemPool::connect(&[s.addr().to_string()]).unwrap();
    let mut b = p.alloc(3 * 4096).unwrap();
    b.write(0, &[1u8; 3 * 4096]).unwrap();
    let r = p.create_ref(&b, 0, 3 * 4096).unwrap();
    b.write(0, b"cow").unwrap();
    let mut http = std::net::TcpStream::connect(s.metrics_addr().unwrap()).unwrap();
    http.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    http.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    let value = |name: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
            .rsplit(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert_eq!(value("dmrpc_memserver_requests_total{op=\"alloc\"}"), 1.0);
    assert_eq!(value("dmrpc_memserver_requests_total{op=\"write\"}"), 2.0);
    assert_eq!(value("dmrpc_memserver_cow_copies_total"), 1.0);
    assert_eq!(value("dmrpc_memserver_pages_held"), 4.0);
    assert_eq!(value("dmrpc_memserver_refs"), 1.0);
    assert_eq!(value("dmrpc_memserver_clients"), 1.0);
    assert!(value("dmrpc_memserver_request_seconds_count") >= 5.0);
    p.release_ref(&r).unwrap();
    drop((b, p));
    settle(&s);
}

#[test]
fn an_exhausted_server_says_so_and_keeps_serving() {
    let s = Server::start(Config {
        size: 8 * 4096,
        ..Default::default()
    })
    .unwrap();
    let p = MemPool::connect(&[s.addr().to_string()]).unwrap();
    let mut a = p.alloc(6 * 4096).unwrap();
    a.write(0, &[1u8; 6 * 4096]).unwrap();
    // Allocations reserve the region: 6 pages more do not fit in the 2
    // left.
    let e = p.alloc(6 * 4096).unwrap_err();
    assert!(matches!(e, Error::ResourceExhausted { .. }), "{e}");
    // A Ref needs no page; writing through a mapping needs copies: two
    // fit, a write needing two more fails cleanly, all or nothing.
    let r = p.create_ref(&a, 0, 4096 * 6).unwrap();
    let mut m = p.map_ref(&r).unwrap();
    m.write(0, &[3u8; 4096]).unwrap();
    m.write(4096, &[3u8; 4096]).unwrap();
    let e = m.write(2 * 4096, &[3u8; 2 * 4096]).unwrap_err();
    assert!(
        matches!(e, Error::ResourceExhausted { what: "pages" }),
        "{e}"
    );
    assert_eq!(p.usage().unwrap().pages_held, 8);
    assert_eq!(m.to_vec().unwrap()[2 * 4096..], vec![1u8; 4 * 4096]);
    p.release_ref(&r).unwrap();
    drop((a, m));
    // It keeps serving: the whole region is there again.
    let mut b = p.alloc(8 * 4096).unwrap();
    b.write(0, &[2u8; 8 * 4096]).unwrap();
    drop((b, p));
    settle(&s);
}

#[test]
fn concurrent_clients_on_a_multithreaded_server() {
    let s = Server::start(Config {
        size: 64 << 20,
        threads: 4,
        ..Default::default()
    })
    .unwrap();
    let addr = s.addr().to_string();
    let shared = MemPool::connect(&[&addr]).unwrap();
    let mut src = shared.alloc(16 * 4096).unwrap();
    src.write(0, &vec![7u8; 16 * 4096]).unwrap();
    let r = shared.create_ref(&src, 0, 16 * 4096).unwrap();
    std::thread::scope(|sc| {
        for t in 0..4u8 {
            let addr = &addr;
            sc.spawn(move || {
                let p = MemPool::connect(&[addr]).unwrap();
                for i in 0..150usize {
                    let len = 4096 * (1 + i % 5) + i;
                    let mut b = p.alloc(len as u64).unwrap();
                    b.write(0, &vec![t; len]).unwrap();
                    let own = p.create_ref(&b, 1, (len - 1) as u64).unwrap();
                    let mut m = p.map_ref(&own).unwrap();
                    m.write(0, &[t ^ 0xFF]).unwrap();
                    let mut x = p.map_ref(&r).unwrap(); // everyone maps one Ref
                    x.write((i % 16 * 4096) as u64, &[t]).unwrap();
                    assert_eq!(b.to_vec().unwrap(), vec![t; len]);
                    let mut want = vec![t; len - 1];
                    want[0] = t ^ 0xFF;
                    assert_eq!(m.to_vec().unwrap(), want);
                    let mut one = [0u8; 2];
                    x.read((i % 16 * 4096) as u64, &mut one).unwrap();
                    assert_eq!(one, [t, 7]);
                    p.release_ref(&own).unwrap();
                }
            });
        }
    });
    assert_eq!(src.to_vec().unwrap(), vec![7u8; 16 * 4096]);
    shared.release_ref(&r).unwrap();
    drop((src, shared));
    settle(&s);
}

#[test]
fn large_reads_and_writes_are_pipelined_in_chunks() {
    let s = Server::start(Config {
        size: 64 << 20,
        ..Default::default()
    })
    .unwrap();
    let p = MemPool::connect(&[s.addr().to_string()]).unwrap();
    let n = 9 << 20; // several write and read chunks
    let data: Vec<u8> = (0..n).map(|i| (i * 31 % 253) as u8).collect();
    let mut b = p.alloc(n as u64).unwrap();
    b.write(0, &data).unwrap();
    assert_eq!(b.to_vec().unwrap(), data);
    let writes = s.state().metrics.requests_of("write");
    assert!(writes >= 9, "{writes} write requests");
    drop((b, p));
    settle(&s);
}

#[test]
fn the_page_cache_serves_frozen_pages_and_never_a_clients_own_writes() {
    let s = Server::start(Config::default()).unwrap();
    let p = MemPool::connect(&[s.addr().to_string()]).unwrap();
    let data: Vec<u8> = (0..8 * 4096).map(|i| (i % 249) as u8).collect();
    let mut b = p.alloc(data.len() as u64).unwrap();
    b.write(0, &data).unwrap();
    let r = p.create_ref(&b, 100, 5 * 4096).unwrap(); // unaligned
    let want = &data[100..100 + 5 * 4096];
    let reads0 = s.state().metrics.requests_of("read");
    let m1 = p.map_ref(&r).unwrap();
    assert_eq!(m1.to_vec().unwrap(), want);
    let st = p.cache_stats();
    assert_eq!(
        (st.hits, st.misses, st.bytes),
        (0, 5, 0),
        "read once: not cached"
    );
    assert_eq!(m1.to_vec().unwrap(), want);
    assert_eq!(p.cache_stats().misses, 10, "read twice: cached now");
    // Another mapping of the same Ref: every chunk from the cache.
    let mut m2 = p.map_ref(&r).unwrap();
    assert_eq!(m2.to_vec().unwrap(), want);
    let mut part = [0u8; 10];
    m2.read(4090, &mut part).unwrap(); // across two chunks
    assert_eq!(&part, &want[4090..4100]);
    assert_eq!(p.cache_stats().hits, 7);
    assert_eq!(
        s.state().metrics.requests_of("read") - reads0,
        2,
        "two read requests for the first mapping's two reads, none after"
    );
    // The creator writes its buffer: the Ref, and so the cache, keep the snapshot.
    b.write(100, &[0xEE; 4096]).unwrap();
    assert_eq!(p.map_ref(&r).unwrap().to_vec().unwrap(), want);
    // A mapping's own write is its own: read from the server, not cached.
    m2.write(4096 + 1, b"mine").unwrap();
    let mut got = [0u8; 4];
    m2.read(4096 + 1, &mut got).unwrap();
    assert_eq!(&got, b"mine");
    assert_eq!(m1.to_vec().unwrap(), want, "the other mapping is untouched");
    // Without a cache, every read goes to the server.
    let q = MemPool::connect_with(
        &[s.addr().to_string()],
        dm_memserver::ClientConfig {
            cache_bytes: 0,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(q.map_ref(&r).unwrap().to_vec().unwrap(), want);
    assert_eq!(q.cache_stats().hits + q.cache_stats().misses, 0);
    p.release_ref(&r).unwrap();
    drop((b, m1, m2, p, q));
    settle(&s);
}

#[test]
fn put_and_read_ref_in_one_round_trip_each() {
    let s = Server::start(Config::default()).unwrap();
    let p = MemPool::connect(&[s.addr().to_string()]).unwrap();
    let data: Vec<u8> = (0..10_000).map(|i| (i % 13) as u8).collect();
    let r = p.put(&data, Duration::ZERO).unwrap();
    assert_eq!(r.len, 10_000);
    let mut out = vec![0u8; 5000];
    p.read_ref(&r, 3000, &mut out).unwrap();
    assert_eq!(out, data[3000..8000]);
    assert!(matches!(
        p.read_ref(&r, 9000, &mut out),
        Err(Error::OutOfBounds { .. })
    ));
    let other = MemPool::connect(&[s.addr().to_string()]).unwrap();
    // Read twice: cached from the second read on.
    for _ in 0..2 {
        assert_eq!(other.map_ref(&r).unwrap().to_vec().unwrap(), data);
    }
    assert_eq!(
        s.state().usage().pages_held,
        3,
        "put leaves only the Ref's pages"
    );
    let forged = dm_pool::Ref {
        tag: r.tag ^ 1,
        ..r
    };
    let mut one = [0u8; 1];
    assert!(matches!(
        other.read_ref(&forged, 0, &mut one),
        Err(Error::RefForged { .. })
    ));
    assert!(matches!(p.put(&[], Duration::ZERO), Err(Error::ZeroLength)));
    p.release_ref_nowait(&r).unwrap();
    // Served after the release, on the same connection.
    p.usage().unwrap();
    // A client without a cached copy reads nothing through a released Ref;
    // one that read it before keeps what it cached (immutable data it had).
    let fresh = MemPool::connect(&[s.addr().to_string()]).unwrap();
    assert!(matches!(
        fresh.read_ref(&r, 0, &mut one),
        Err(Error::RefReleased { .. })
    ));
    other.read_ref(&r, 0, &mut one).unwrap();
    assert_eq!(one[0], data[0]);
    drop(fresh);
    drop((p, other));
    settle(&s);
}

#[test]
fn threads_sharing_one_client_pipeline_on_one_connection() {
    // Many callers on one MemPool (one connection per server): whoever
    // finds nobody reading reads for all and hands out the answers.
    let s = Server::start(Config::default()).unwrap();
    let p = MemPool::connect(&[s.addr().to_string()]).unwrap();
    std::thread::scope(|sc| {
        for t in 0..6u8 {
            let p = &p;
            sc.spawn(move || {
                for i in 0..200usize {
                    // Every tenth read is long: its answer is received in
                    // place by whoever reads it, or handed over.
                    let len = if i % 10 == 0 {
                        (300 << 10) + i * 4099
                    } else {
                        100 + i * 37
                    };
                    let mut b = p.alloc(len as u64).unwrap();
                    b.write(0, &vec![t; len]).unwrap();
                    let r = p.create_ref(&b, 0, len as u64).unwrap();
                    let mut out = vec![0u8; len];
                    p.read_ref(&r, 0, &mut out).unwrap();
                    assert_eq!(
                        out,
                        vec![t; len],
                        "thread {t} call {i} got another's answer"
                    );
                    p.release_ref(&r).unwrap();
                    p.free(b).unwrap();
                }
            });
        }
    });
    assert_eq!(s.state().metrics.requests_of("hello"), 1, "one connection");
    drop(p);
    settle(&s);
}

#[test]
fn several_ranges_of_a_ref_are_read_in_one_batch() {
    let s = Server::start(Config::default()).unwrap();
    let p = MemPool::connect(&[s.addr().to_string()]).unwrap();
    let data: Vec<u8> = (0..300_000).map(|i| (i % 251) as u8).collect();
    let r = p.put(&data, Duration::ZERO).unwrap();
    let other = MemPool::connect(&[s.addr().to_string()]).unwrap();
    let (mut a, mut b, mut c, mut d) = (vec![0u8; 10], vec![0u8; 5000], vec![0u8; 0], vec![0u8; 1]);
    let before = s.state().metrics.requests_of("read_ref");
    other
        .read_ref_ranges(
            &r,
            &mut [
                (0, &mut a[..]),
                (123_456, &mut b[..]),
                (7, &mut c[..]),
                (299_999, &mut d[..]),
            ],
        )
        .unwrap();
    assert_eq!(a, data[..10]);
    assert_eq!(b, data[123_456..128_456]);
    assert_eq!(d, data[299_999..]);
    assert_eq!(s.state().metrics.requests_of("read_ref") - before, 3);
    // One range out of bounds: an error, and nothing is sent.
    let before = s.state().metrics.requests_of("read_ref");
    assert!(matches!(
        other.read_ref_ranges(&r, &mut [(0, &mut a[..]), (299_995, &mut b[..])]),
        Err(Error::OutOfBounds { .. })
    ));
    assert_eq!(s.state().metrics.requests_of("read_ref"), before);
    let forged = dm_pool::Ref {
        tag: r.tag ^ 1,
        ..r
    };
    assert!(matches!(
        other.read_ref_ranges(&forged, &mut [(0, &mut a[..])]),
        Err(Error::RefForged { .. })
    ));
    p.release_ref(&r).unwrap();
    drop((p, other));
    settle(&s);
}

#[test]
fn large_reads_answered_from_the_pages_are_whole_and_leave_nothing_pinned() {
    // Reads of 256 KiB and more are written from the pages where they lie,
    // pinned meanwhile: of a buffer (its first 150 KiB never written, so
    // read as zeros), of a Ref, at offsets, while the buffer is written
    // between reads (copy on write of shared pages).
    let s = Server::start(Config::default()).unwrap();
    let p = MemPool::connect(&[s.addr().to_string()]).unwrap();
    let len = 300 << 10;
    let mut b = p.alloc(len as u64).unwrap();
    let mut want = vec![0u8; len];
    for (i, x) in want[150 << 10..].iter_mut().enumerate() {
        *x = (i % 251) as u8;
    }
    b.write(150 << 10, &want[150 << 10..]).unwrap();
    let mut got = vec![0u8; len];
    b.read(0, &mut got).unwrap();
    assert!(got == want, "a buffer's read");
    let r = p.create_ref(&b, 0, len as u64).unwrap();
    b.write(200 << 10, &[9u8; 100]).unwrap();
    let mut snap = vec![0u8; len - 5];
    p.read_ref(&r, 5, &mut snap).unwrap();
    assert!(snap == want[5..], "the Ref's snapshot, not the later write");
    want[200 << 10..(200 << 10) + 100].fill(9);
    b.read(0, &mut got).unwrap();
    assert!(got == want, "the buffer after its copy on write");
    let problems = s.state().check();
    assert!(problems.is_empty(), "nothing pinned is left: {problems:#?}");
    // A read past the end is still a typed error.
    let mut past = vec![0u8; len + 1];
    assert!(matches!(
        b.read(0, &mut past),
        Err(Error::OutOfBounds { .. })
    ));
    // A read of more pages than one writev takes (4 MiB: 1 024 pages and
    // the head).
    let big_len = 5 << 20;
    let mut big = p.alloc(big_len as u64).unwrap();
    let data: Vec<u8> = (0..big_len).map(|i| (i % 253) as u8).collect();
    big.write(0, &data).unwrap();
    let mut back = vec![0u8; big_len];
    big.read(0, &mut back).unwrap();
    assert!(back == data, "a read of 5 MiB");
    p.release_ref(&r).unwrap();
    drop((b, big));
    drop(p);
    settle(&s);
}

/// A Ref whose length was forged (2^62 bytes) is refused with a typed
/// error by every client call, before the length sizes a buffer or a
/// loop; the server and the session go on.
#[test]
fn a_ref_with_a_forged_length_is_refused_before_it_sizes_anything() {
    let s = Server::start(Config::default()).unwrap();
    let p = MemPool::connect(&[s.addr().to_string()]).unwrap();
    let mut b = p.alloc(4096).unwrap();
    b.write(0, b"real").unwrap();
    let r = p.create_ref(&b, 0, 4096).unwrap();
    let mut forged = r;
    forged.len = 1 << 62;
    let too_large = |e: Error| matches!(e, Error::TooLarge { .. });
    assert!(too_large(p.check_ref(&forged).unwrap_err()));
    assert!(too_large(
        p.read_ref(&forged, 0, &mut [0u8; 4]).unwrap_err()
    ));
    assert!(too_large(p.map_ref(&forged).unwrap_err()));
    let mut one = [0u8; 4];
    assert!(too_large(
        p.read_ref_ranges(&forged, &mut [(0, &mut one[..])])
            .unwrap_err()
    ));
    // The real Ref still reads.
    let mut got = [0u8; 4];
    p.read_ref(&r, 0, &mut got).unwrap();
    assert_eq!(&got, b"real");
    p.release_ref(&r).unwrap();
    p.free(b).unwrap();
    drop(p);
    settle(&s);
}

/// Allocations reserve the region: a client cannot allocate more than the
/// server holds, however little it writes (its address maps would grow
/// without bound); a buffer freed, or a session ended, gives its part
/// back. A Ref's TTL is capped.
#[test]
fn allocations_reserve_the_region_and_ttls_are_capped() {
    let s = Server::start(Config {
        size: 1 << 20,
        max_ttl: Duration::from_secs(60),
        ..Default::default()
    })
    .unwrap();
    let p = MemPool::connect(&[s.addr().to_string()]).unwrap();
    let whole = 1 << 20;
    let b = p.alloc(whole).unwrap();
    let e = p.alloc(whole).unwrap_err();
    assert!(matches!(e, Error::ResourceExhausted { .. }), "{e}");
    assert!(e.to_string().contains("--size"), "{e}");
    let e = p.alloc(4096).unwrap_err();
    assert!(matches!(e, Error::ResourceExhausted { .. }), "{e}");
    p.free(b).unwrap();
    let b = p.alloc(whole).unwrap();
    // Another client, while this one holds the region: refused; once this
    // one's session ends, it gets it.
    let q = MemPool::connect(&[s.addr().to_string()]).unwrap();
    assert!(q.alloc(whole).is_err());
    drop(b);
    drop(p);
    let until = std::time::Instant::now() + Duration::from_secs(10);
    let b = loop {
        match q.alloc(whole) {
            Ok(b) => break b,
            Err(_) if std::time::Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("the ended session's reservation stays: {e}"),
        }
    };
    // TTLs: the default and up to the maximum are fine; above, refused.
    let r = q.create_ref(&b, 0, 4096).unwrap();
    q.release_ref(&r).unwrap();
    let r = q
        .create_ref_ttl(&b, 0, 4096, Duration::from_secs(60))
        .unwrap();
    q.release_ref(&r).unwrap();
    let e = q
        .create_ref_ttl(&b, 0, 4096, Duration::from_secs(7200))
        .unwrap_err();
    assert!(e.to_string().contains("maximum"), "{e}");
    q.free(b).unwrap();
    drop(q);
    settle(&s);
}

/// One client more than the server takes is refused with a typed error
/// that says what to do; once a client leaves, a new one is served.
#[test]
fn one_client_more_than_the_cap_is_refused() {
    let s = Server::start(Config {
        max_clients: 2,
        ..Default::default()
    })
    .unwrap();
    let addr = [s.addr().to_string()];
    let a = MemPool::connect(&addr).unwrap();
    let b = MemPool::connect(&addr).unwrap();
    let e = MemPool::connect(&addr).unwrap_err();
    assert!(matches!(e, Error::ResourceExhausted { .. }), "{e}");
    assert!(e.to_string().contains("--max-clients"), "{e}");
    drop(a);
    let until = std::time::Instant::now() + Duration::from_secs(10);
    let c = loop {
        match MemPool::connect(&addr) {
            Ok(c) => break c,
            Err(_) if std::time::Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("no room after a client left: {e}"),
        }
    };
    let mut x = c.alloc(4096).unwrap();
    x.write(0, b"ok").unwrap();
    drop((x, b, c));
    settle(&s);
}

#[test]
fn an_answer_cut_off_midway_fails_the_read_and_the_connection() {
    // A fake server: it says hello, then answers a 256 KiB read with the
    // head of the whole answer and half its body, and hangs up. The
    // client receives such an answer straight into the caller's buffer:
    // the read fails as unavailable, and so does what follows (the
    // stream has lost its place).
    use dm_memserver::proto::{self, HelloAnswer, Request};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let len = 256usize << 10;
    let fake = std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let frame = |c: &mut std::net::TcpStream| {
            let mut n = [0u8; 4];
            c.read_exact(&mut n).unwrap();
            let mut f = vec![0u8; u32::from_le_bytes(n) as usize];
            c.read_exact(&mut f).unwrap();
            let (id, req) = Request::decode(&f).unwrap();
            (id, req.op())
        };
        let (id, _) = frame(&mut c);
        let mut out = Vec::new();
        let hello = HelloAnswer {
            server_id: 7,
            page_size: 4096,
            max_len: 1 << 30,
            auth: None,
        };
        proto::encode_ok(id, &mut out, |o| hello.encode_body(o));
        c.write_all(&out).unwrap();
        let (id, op) = frame(&mut c);
        assert_eq!(op, proto::op_code::READ_REF);
        out.clear();
        proto::encode_ok_head(id, len, &mut out);
        out.extend_from_slice(&vec![9u8; len / 2]);
        c.write_all(&out).unwrap();
        c.shutdown(std::net::Shutdown::Both).unwrap();
    });
    let p = MemPool::connect_with(
        &[addr],
        dm_memserver::ClientConfig {
            cache_bytes: 0,
            ..Default::default()
        },
    )
    .unwrap();
    let r = dm_pool::Ref {
        backend: dm_pool::BACKEND_MEMSERVER,
        pool_id: 7,
        desc: 1,
        generation: 1,
        tag: 1,
        len: len as u64,
    };
    let mut out = vec![0u8; len];
    let e = p.read_ref(&r, 0, &mut out).unwrap_err();
    assert!(matches!(e, Error::Unavailable(_)), "{e:?}");
    fake.join().unwrap();
    let e = p.read_ref(&r, 0, &mut out[..4096]).unwrap_err();
    assert!(matches!(e, Error::Unavailable(_)), "{e:?}");
}

#[test]
fn long_writes_land_in_place_and_keep_snapshots() {
    // Writes of 64 KiB and more are received straight into the buffer's
    // pages: at unaligned offsets, over pages a Ref shares (copied
    // first), over pages never written (zeroed around).
    let s = Server::start(Config::default()).unwrap();
    let p = MemPool::connect_with(
        &[s.addr().to_string()],
        dm_memserver::ClientConfig {
            cache_bytes: 0,
            ..Default::default()
        },
    )
    .unwrap();
    let n = 1 << 20;
    let old: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
    let mut b = p.alloc(n as u64 + 8192).unwrap();
    b.write(0, &old).unwrap();
    let r = p.create_ref(&b, 0, n as u64).unwrap();
    let mut want = old.clone();
    want.resize(n + 8192, 0);
    for (off, len) in [
        (1000usize, 300_000usize),
        (4096, 65_536),
        (n - 70_000, 78_000),
    ] {
        let new: Vec<u8> = (0..len).map(|i| (i * 7 % 253) as u8 ^ 0x5a).collect();
        b.write(off as u64, &new).unwrap();
        want[off..off + len].copy_from_slice(&new);
        assert_eq!(b.to_vec().unwrap(), want, "write of {len} at {off}");
    }
    let mut snap = vec![0u8; n];
    p.read_ref(&r, 0, &mut snap).unwrap();
    assert!(snap == old, "the Ref's snapshot changed");
    p.release_ref(&r).unwrap();
    drop((b, p));
    settle(&s);
}

#[test]
fn a_long_write_refused_keeps_the_session_and_one_cut_off_ends_it() {
    use dm_memserver::proto::{decode_answer, Request, WRITE_HEAD};
    let s = Server::start(Config::default()).unwrap();
    let p = MemPool::connect(&[s.addr().to_string()]).unwrap();
    let b = p.alloc(1 << 20).unwrap();
    // A raw client of its own: a hello, an alloc, then a write's head
    // and half its bytes.
    let mut c = std::net::TcpStream::connect(s.addr()).unwrap();
    let answer = |c: &mut std::net::TcpStream| {
        let mut n = [0u8; 4];
        c.read_exact(&mut n).unwrap();
        let mut f = vec![0u8; u32::from_le_bytes(n) as usize];
        c.read_exact(&mut f).unwrap();
        f
    };
    let mut f = Vec::new();
    Request::Hello {
        lease_ms: 10_000,
        nonce: None,
    }
    .encode(1, &mut f);
    Request::Alloc { len: 1 << 20 }.encode(2, &mut f);
    c.write_all(&f).unwrap();
    answer(&mut c);
    let a = answer(&mut c);
    let addr = u64::from_le_bytes(a[a.len() - 8..].try_into().unwrap());
    // A long write to no buffer is refused and its bytes passed over; one
    // that fits follows and is done.
    f.clear();
    for (id, at) in [(3, addr + (1 << 30)), (4, addr)] {
        Request::Write {
            addr: at,
            offset: 0,
            data: vec![5u8; 200 << 10].into(),
        }
        .encode(id, &mut f);
    }
    c.write_all(&f).unwrap();
    let a = answer(&mut c);
    assert!(matches!(decode_answer(&a).unwrap(), (3, Err(_))));
    let a = answer(&mut c);
    assert!(matches!(decode_answer(&a).unwrap(), (4, Ok(_))));
    // Then a write's head and half its bytes, and the client is gone.
    f.clear();
    let data = vec![3u8; 1 << 20];
    let head_len = {
        let d = Request::Write {
            addr,
            offset: 0,
            data: data.as_slice().into(),
        }
        .encode_head(5, &mut f)
        .len();
        assert_eq!(f.len(), 4 + WRITE_HEAD);
        d
    };
    f.extend_from_slice(&data[..head_len / 2]);
    c.write_all(&f).unwrap();
    drop(c);
    // The cut session ends.
    let clients = || {
        s.state()
            .metrics
            .clients
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    for _ in 0..500 {
        if clients() == 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(clients(), 1, "the cut session is over");
    // The other client's buffer is untouched; the cut session's pages went.
    assert_eq!(b.to_vec().unwrap(), vec![0u8; 1 << 20]);
    drop((b, p));
    settle(&s);
}

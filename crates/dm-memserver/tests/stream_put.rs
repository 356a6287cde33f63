//! `stream_put`: the Ref answered before its bytes have arrived. Readers
//! on other connections wait for their range; a sender that goes away
//! before the last byte leaves nothing behind, and its readers get
//! `Unavailable`; a refused one is passed over and the connection goes
//! on. The sender here is a raw socket, so the bytes can be held back.
#![allow(clippy::unwrap_used)]

use dm_memserver::proto::{self, Request};
use dm_memserver::{Config, MemPool, Server};
use dm_pool::{Dm, DmBuffer, Error, Ref};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::Duration;

const LEN: usize = 300_000;

fn data() -> Vec<u8> {
    (0..LEN).map(|i| (i * 31 % 251) as u8).collect()
}

/// A raw client: hello sent, its answer read.
fn raw(s: &Server) -> TcpStream {
    let mut t = TcpStream::connect(s.addr()).unwrap();
    t.set_nodelay(true).unwrap();
    let mut b = Vec::new();
    Request::Hello {
        lease_ms: 10_000,
        nonce: None,
    }
    .encode(1, &mut b);
    t.write_all(&b).unwrap();
    answer(&mut t).unwrap();
    t
}

/// The next answer's body, or its error.
fn answer(t: &mut TcpStream) -> Result<Vec<u8>, Error> {
    let mut len = [0u8; 4];
    t.read_exact(&mut len).unwrap();
    let mut f = vec![0u8; u32::from_le_bytes(len) as usize];
    t.read_exact(&mut f).unwrap();
    let (_, a) = proto::decode_answer(&f).unwrap();
    a.map(<[u8]>::to_vec)
}

/// Sends a stream_put's head and its first `part` bytes of `data`.
fn start_put(t: &mut TcpStream, data: &[u8], part: usize) {
    let mut head = Vec::new();
    let rest = Request::StreamPut {
        ttl_ms: 0,
        data: data.into(),
    }
    .encode_head(7, &mut head)
    .len();
    assert_eq!(rest, data.len());
    t.write_all(&head).unwrap();
    t.write_all(&data[..part]).unwrap();
}

fn settle(s: &Server) {
    for _ in 0..200 {
        let u = s.state().usage();
        if u.pages_held == 0 && u.refs == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let problems = s.state().check();
    assert!(problems.is_empty(), "{problems:#?}");
    let u = s.state().usage();
    assert_eq!((u.pages_held, u.refs), (0, 0), "{u:?}");
}

#[test]
fn readers_wait_for_the_bytes_of_their_range() {
    let s = Server::start(Config::default()).unwrap();
    let reader = MemPool::connect_with(
        &[s.addr().to_string()],
        dm_memserver::ClientConfig {
            cache_bytes: 0,
            ..Default::default()
        },
    )
    .unwrap();
    let d = data();
    let mut t = raw(&s);
    let half = LEN / 2;
    start_put(&mut t, &d, half);
    // The Ref comes before the rest of the bytes.
    let r = proto::decode_ref(&answer(&mut t).unwrap()).unwrap();
    assert_eq!(r.len, LEN as u64);
    // A range that has arrived is read at once.
    let mut first = vec![0u8; 10_000];
    reader.read_ref(&r, 1000, &mut first).unwrap();
    assert_eq!(first, d[1000..11_000]);
    // The whole, and a mapping, wait for the rest.
    let (tx, rx) = mpsc::channel();
    let (rd2, tx2) = (reader.clone(), tx.clone());
    std::thread::spawn(move || {
        let mut all = vec![0u8; LEN];
        let got = rd2.read_ref(&r, 0, &mut all).map(|()| all);
        tx2.send(("read", got)).unwrap();
    });
    let rd3 = reader.clone();
    std::thread::spawn(move || {
        let got = rd3.map_ref(&r).and_then(|b| {
            let v = b.to_vec();
            rd3.free(b)?;
            v
        });
        tx.send(("map", got)).unwrap();
    });
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        rx.try_recv().is_err(),
        "nothing returns before the bytes have arrived"
    );
    t.write_all(&d[half..]).unwrap();
    for _ in 0..2 {
        let (what, got) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(got.unwrap() == d, "{what}: the bytes sent");
    }
    // The connection goes on: a release on it.
    let mut b = Vec::new();
    Request::ReleaseRef(r).encode(8, &mut b);
    t.write_all(&b).unwrap();
    answer(&mut t).unwrap();
    drop((t, reader));
    settle(&s);
}

#[test]
fn a_sender_gone_before_the_last_byte_leaves_nothing_and_readers_fail() {
    let s = Server::start(Config::default()).unwrap();
    let reader = MemPool::connect(&[s.addr().to_string()]).unwrap();
    let d = data();
    let mut t = raw(&s);
    start_put(&mut t, &d, 5000);
    let r: Ref = proto::decode_ref(&answer(&mut t).unwrap()).unwrap();
    let (tx, rx) = mpsc::channel();
    let rd = reader.clone();
    std::thread::spawn(move || {
        let mut all = vec![0u8; LEN];
        tx.send(rd.read_ref(&r, 0, &mut all)).unwrap();
    });
    std::thread::sleep(Duration::from_millis(100));
    // The sender dies.
    drop(t);
    let e = rx
        .recv_timeout(Duration::from_secs(10))
        .unwrap()
        .unwrap_err();
    assert!(matches!(e, Error::Unavailable(_)), "{e:?}");
    // The Ref is gone; the reader's connection goes on.
    let e = reader.map_ref(&r).unwrap_err();
    assert!(matches!(e, Error::RefReleased { .. }), "{e:?}");
    let r2 = reader.put(&d, Duration::ZERO).unwrap();
    let mut back = vec![0u8; LEN];
    reader.read_ref(&r2, 0, &mut back).unwrap();
    assert!(back == d);
    reader.release_ref(&r2).unwrap();
    drop(reader);
    settle(&s);
}

#[test]
fn a_refused_stream_put_is_passed_over() {
    let s = Server::start(Config {
        size: 1 << 20,
        ..Default::default()
    })
    .unwrap();
    let mut t = raw(&s);
    // More than the server holds: refused, its bytes skipped.
    let big = vec![1u8; 2 << 20];
    start_put(&mut t, &big, big.len());
    let e = answer(&mut t).unwrap_err();
    assert!(
        matches!(e, Error::TooLarge { .. } | Error::ResourceExhausted { .. }),
        "{e:?}"
    );
    // An empty one: refused too.
    start_put(&mut t, &[], 0);
    assert!(matches!(answer(&mut t).unwrap_err(), Error::ZeroLength));
    // The next request on the connection is served.
    let small = vec![9u8; 5000];
    start_put(&mut t, &small, small.len());
    let r = proto::decode_ref(&answer(&mut t).unwrap()).unwrap();
    let p = MemPool::connect(&[s.addr().to_string()]).unwrap();
    let mut back = vec![0u8; 5000];
    p.read_ref(&r, 0, &mut back).unwrap();
    assert_eq!(back, small);
    p.release_ref(&r).unwrap();
    drop((t, p));
    settle(&s);
}

//! The memory server as its own process, with clients in other processes:
//! a Ref made by one client and mapped by another, CoW isolation, a client
//! killed mid-request, a server killed under its clients, malformed bytes
//! on the socket, a silent client's lease, SIGTERM, a client killed
//! with a release still waiting to go.
#![allow(clippy::unwrap_used)]

use dm_memserver::proto::{self, Request};
use dm_memserver::{ClientConfig, MemPool};
use dm_pool::{Dm, DmBuffer, Error};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A server process, killed on drop.
struct ServerProc {
    child: Child,
    addr: String,
}

impl ServerProc {
    fn start(extra: &[&str]) -> ServerProc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dm-memserver"))
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line.split_whitespace().nth(1).unwrap().to_owned();
        ServerProc { child, addr }
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn client(addr: &str, args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_dm-memclient"))
        .arg(addr)
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Waits until the server holds nothing and is consistent.
fn assert_clean_within(addr: &str, t: Duration) {
    let p = MemPool::connect(&[addr]).unwrap();
    let start = Instant::now();
    loop {
        let u = p.usage().unwrap();
        if u.pages_held == 0 && u.refs == 0 {
            break;
        }
        assert!(start.elapsed() < t, "server still holds {u:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let problems = p.check().unwrap();
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn ref_mapped_by_another_process_with_cow_isolation() {
    let s = ServerProc::start(&[]);
    let a = MemPool::connect(&[&s.addr]).unwrap();
    let data: Vec<u8> = (0..3 * 4096).map(|i| (i % 7) as u8).collect();
    let want: u64 = data.iter().map(|&b| b as u64).sum();
    let mut buf = a.alloc(data.len() as u64).unwrap();
    buf.write(0, &data).unwrap();
    let r = a.create_ref(&buf, 0, data.len() as u64).unwrap();
    let b = client(&s.addr, &["cow", &hex(&r.to_bytes())]);
    let out = b.wait_with_output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let nums: Vec<u64> = text
        .lines()
        .map(|l| l.split_whitespace().nth(1).unwrap().parse().unwrap())
        .collect();
    assert_eq!(nums[0], want, "the other process reads the snapshot");
    let changed: u64 = data[4096..4196].iter().map(|&b| b as u64).sum();
    assert_eq!(nums[1], want - changed + 100 * 255, "its write took");
    assert_eq!(buf.to_vec().unwrap(), data, "the writer's copy is its own");
    // And the other way: the creator writes, a fresh mapping keeps the snapshot.
    buf.write(0, &[9u8; 10]).unwrap();
    let m = a.map_ref(&r).unwrap();
    assert_eq!(m.to_vec().unwrap(), data);
    a.release_ref(&r).unwrap();
    drop((m, buf, a));
    assert_clean_within(&s.addr, Duration::from_secs(2));
}

#[test]
fn client_killed_mid_request_releases_its_holdings() {
    let s = ServerProc::start(&["--ttl-ms", "300"]);
    let other = MemPool::connect(&[&s.addr]).unwrap();
    let mut mine = other.alloc(8192).unwrap();
    mine.write(0, b"still here").unwrap();
    let mut c = client(&s.addr, &["churn"]);
    let mut line = String::new();
    BufReader::new(c.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "started");
    std::thread::sleep(Duration::from_millis(200));
    c.kill().unwrap();
    c.wait().unwrap();
    // Others are unaffected, during and after.
    assert_eq!(&mine.to_vec().unwrap()[..10], b"still here");
    mine.write(4096, b"more").unwrap();
    // The killed session's buffers go at once; a Ref it left (if any)
    // expires by TTL.
    let start = Instant::now();
    loop {
        let u = other.usage().unwrap();
        if u.pages_held == 2 && u.refs == 0 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(3), "{u:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop((mine, other));
    assert_clean_within(&s.addr, Duration::from_secs(2));
}

/// A release waits to go with the client's next request; the client is
/// killed first. The Ref's TTL reclaims it: nothing leaks.
#[test]
fn a_release_kept_for_later_is_reclaimed_by_ttl_if_its_client_dies() {
    let s = ServerProc::start(&["--ttl-ms", "300"]);
    let mut c = client(&s.addr, &["release-later"]);
    let mut line = String::new();
    BufReader::new(c.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "queued");
    c.kill().unwrap();
    c.wait().unwrap();
    let p = MemPool::connect(&[&s.addr]).unwrap();
    assert_eq!(p.usage().unwrap().refs, 1, "the release never went");
    drop(p);
    assert_clean_within(&s.addr, Duration::from_secs(5));
}

#[test]
fn killed_server_means_unavailable_not_a_hang() {
    let s = ServerProc::start(&[]);
    let p = MemPool::connect_with(
        &[&s.addr],
        ClientConfig {
            timeout: Duration::from_secs(20),
            ..Default::default()
        },
    )
    .unwrap();
    let mut b = p.alloc(4096).unwrap();
    b.write(0, b"x").unwrap();
    s.signal(libc::SIGKILL);
    let t = Instant::now();
    let e = loop {
        match b.write(0, b"y") {
            Err(e) => break e,
            Ok(()) => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    assert!(matches!(e, Error::Unavailable(_)), "{e}");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "noticed in {:?}",
        t.elapsed()
    );
    assert!(matches!(p.alloc(10), Err(Error::Unavailable(_))));
    drop(b); // its free fails quietly
}

/// Reads one answer frame from a raw socket.
fn answer(s: &mut TcpStream) -> Option<(u64, Result<Vec<u8>, Error>)> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let mut f = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut f).ok()?;
    let (id, a) = proto::decode_answer(&f).unwrap();
    Some((id, a.map(<[u8]>::to_vec)))
}

#[test]
fn malformed_bytes_get_typed_errors_and_others_keep_going() {
    let srv = ServerProc::start(&[]);
    let good = MemPool::connect(&[&srv.addr]).unwrap();
    let mut gb = good.alloc(100).unwrap();
    let mut s = TcpStream::connect(&srv.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    // A bad version: answered as a protocol error, the session goes on.
    let mut f = Vec::new();
    Request::Alloc { len: 10 }.encode(7, &mut f);
    f[4] = 99;
    s.write_all(&f).unwrap();
    let (_, a) = answer(&mut s).unwrap();
    assert!(matches!(a, Err(Error::Protocol(_))));
    // An unknown op names its request.
    let mut f = Vec::new();
    Request::Ping.encode(8, &mut f);
    f[5] = 200;
    s.write_all(&f).unwrap();
    let (id, a) = answer(&mut s).unwrap();
    assert_eq!(id, 8);
    assert!(matches!(a, Err(Error::Protocol(_))));
    // A truncated body (the length covers only part of an alloc).
    s.write_all(&[16, 0, 0, 0, 1, 2, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4])
        .unwrap();
    let (id, a) = answer(&mut s).unwrap();
    assert_eq!(id, 9);
    assert!(matches!(a, Err(Error::Protocol(_))));
    // Reads of addresses it does not hold: a typed error.
    let mut f = Vec::new();
    Request::Read {
        addr: gb.addr(),
        offset: 0,
        len: 4,
    }
    .encode(10, &mut f);
    s.write_all(&f).unwrap();
    let (_, a) = answer(&mut s).unwrap();
    assert!(matches!(a, Err(Error::NotOwner { .. })), "{a:?}");
    // Still a working session.
    let mut f = Vec::new();
    Request::Alloc { len: 10 }.encode(11, &mut f);
    s.write_all(&f).unwrap();
    let (id, a) = answer(&mut s).unwrap();
    assert_eq!(id, 11);
    assert!(a.is_ok());
    // An oversized length: answered, then the connection closes.
    s.write_all(&u32::MAX.to_le_bytes()).unwrap();
    let (_, a) = answer(&mut s).unwrap();
    assert!(matches!(a, Err(Error::Protocol(_))));
    assert!(answer(&mut s).is_none(), "the connection is closed");
    // Everyone else was served throughout.
    gb.write(0, b"fine").unwrap();
    assert_eq!(&gb.to_vec().unwrap()[..4], b"fine");
    drop((gb, good));
    assert_clean_within(&srv.addr, Duration::from_secs(2));
}

#[test]
fn a_silent_client_loses_its_session_at_lease_expiry() {
    let srv = ServerProc::start(&[]);
    let mut s = TcpStream::connect(&srv.addr).unwrap();
    let mut f = Vec::new();
    Request::Hello {
        lease_ms: 300,
        nonce: None,
    }
    .encode(1, &mut f);
    Request::Alloc { len: 8192 }.encode(2, &mut f);
    s.write_all(&f).unwrap();
    let _ = answer(&mut s).unwrap();
    let (_, a) = answer(&mut s).unwrap();
    let [addr] = proto::u64s::<1>(&a.unwrap()).unwrap();
    let mut f = Vec::new();
    Request::Write {
        addr,
        offset: 0,
        data: vec![1u8; 8192].into(),
    }
    .encode(3, &mut f);
    s.write_all(&f).unwrap();
    assert!(answer(&mut s).unwrap().1.is_ok());
    let watcher = MemPool::connect(&[&srv.addr]).unwrap();
    assert_eq!(watcher.usage().unwrap().pages_held, 2);
    // Silence (the socket stays open): the lease passes, the pages go.
    assert_clean_within(&srv.addr, Duration::from_secs(3));
    drop(s);
}

#[test]
fn sigterm_shuts_down_cleanly() {
    let mut srv = ServerProc::start(&[]);
    let p = MemPool::connect(&[&srv.addr]).unwrap();
    let mut b = p.alloc(4096).unwrap();
    b.write(0, b"x").unwrap();
    srv.signal(libc::SIGTERM);
    let t = Instant::now();
    let status = loop {
        if let Some(st) = srv.child.try_wait().unwrap() {
            break st;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "still running");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success(), "{status:?}");
    assert!(matches!(b.write(0, b"y"), Err(Error::Unavailable(_))));
}

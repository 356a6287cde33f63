//! Whether a zero-copy send (`MSG_ZEROCOPY`, what `io_uring`'s
//! `SEND_ZC` uses too) saves the memory server's send copy on this
//! machine's links: 1 MiB messages over loopback TCP, each acknowledged
//! by the receiver with one byte, sent plainly and with `MSG_ZEROCOPY`
//! in turns (sender and receiver on CPUs of their own). Prints each
//! way's median time per message and how many of
//! the zero-copy sends the kernel reports it copied anyway
//! (`SO_EE_CODE_ZEROCOPY_COPIED`). Env `SIZE`: bytes per message.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::Instant;

/// `SO_EE_ORIGIN_ZEROCOPY` (linux/errqueue.h; not in the libc crate).
const SO_EE_ORIGIN_ZEROCOPY: u8 = 5;
/// `SO_EE_CODE_ZEROCOPY_COPIED` (linux/errqueue.h).
const SO_EE_CODE_ZEROCOPY_COPIED: u8 = 1;

/// Sends all of `buf` on `fd` with `flags`.
fn send_all(fd: i32, buf: &[u8], flags: i32) {
    let mut off = 0;
    while off < buf.len() {
        // SAFETY: the pointer and length are those of the live slice's
        // unsent part.
        let n = unsafe { libc::send(fd, buf[off..].as_ptr().cast(), buf.len() - off, flags) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOBUFS) {
                // Too many zero-copy sends in flight: let notifications in.
                std::thread::yield_now();
                continue;
            }
            panic!("send: {e}");
        }
        off += n as usize;
    }
}

/// Reads the zero-copy notifications queued on `fd`: (sends reported,
/// of which copied).
fn notifications(fd: i32) -> (u64, u64) {
    let (mut done, mut copied) = (0u64, 0u64);
    loop {
        let mut control = [0u8; 128];
        // SAFETY: a zeroed msghdr is valid; its control buffer outlives
        // the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = control.len();
        // SAFETY: `msg` is set up above.
        let r = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT) };
        if r < 0 {
            return (done, copied);
        }
        // SAFETY: the kernel filled `control` with `msg_controllen` bytes of
        // control messages.
        let cm = unsafe { libc::CMSG_FIRSTHDR(&msg) };
        if cm.is_null() {
            continue;
        }
        // SAFETY: a non-null control message of the error queue carries a
        // sock_extended_err.
        let err = unsafe { &*(libc::CMSG_DATA(cm) as *const libc::sock_extended_err) };
        if err.ee_origin == SO_EE_ORIGIN_ZEROCOPY {
            let n = u64::from(err.ee_data.wrapping_sub(err.ee_info)) + 1;
            done += n;
            if err.ee_code & SO_EE_CODE_ZEROCOPY_COPIED != 0 {
                copied += n;
            }
        }
    }
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let size: usize = std::env::var("SIZE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1 << 20);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    // The receiver on the second CPU, the sender on the first.
    let rx = std::thread::spawn(move || {
        let _ = dm_sys::set_affinity(&[1]);
        let (mut s, _) = l.accept().unwrap();
        let mut buf = vec![0u8; size];
        while s.read_exact(&mut buf).is_ok() {
            s.write_all(&[1]).unwrap();
        }
    });
    let _ = dm_sys::set_affinity(&[0]);
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let fd = s.as_raw_fd();
    let one: i32 = 1;
    // SAFETY: a valid socket and an int option.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ZEROCOPY,
            (&one as *const i32).cast(),
            4,
        )
    };
    assert_eq!(r, 0, "SO_ZEROCOPY: {}", std::io::Error::last_os_error());
    let msg: Vec<u8> = (0..size).map(|i| i as u8).collect();
    let mut ack = [0u8; 1];
    // The two ways take turns, 100 messages at a time.
    let ways = [("plain send", 0), ("MSG_ZEROCOPY", libc::MSG_ZEROCOPY)];
    let mut t = [Vec::with_capacity(n), Vec::with_capacity(n)];
    let (mut done, mut copied) = (0, 0);
    for round in 0..n.div_ceil(100) {
        for (w, &(_, flags)) in ways.iter().enumerate() {
            for _ in 0..100.min(n - round * 100) {
                let t0 = Instant::now();
                send_all(fd, &msg, flags);
                s.read_exact(&mut ack).unwrap();
                t[w].push(t0.elapsed().as_nanos() as u64);
                let (d, c) = notifications(fd);
                done += d;
                copied += c;
            }
        }
    }
    for (w, (what, _)) in ways.iter().enumerate() {
        t[w].sort_unstable();
        println!(
            "{what}: {size} B in {:.1} us (median of {})",
            t[w][t[w].len() / 2] as f64 / 1e3,
            t[w].len()
        );
    }
    println!("zero-copy sends reported done: {done}, of which the kernel copied: {copied}");
    drop(s);
    rx.join().unwrap();
}

//! Hosts come up joined by a switch, with shaped links; processes and
//! threads run in them; they go away cleanly, also after their maker was
//! killed. Needs root and iproute2: where either is missing the tests
//! say so and pass without running.
#![allow(clippy::unwrap_used)]

use dm_netns::{existing, Hosts, Link};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};

fn skip(test: &str) -> bool {
    match Hosts::available() {
        Ok(()) => false,
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            true
        }
    }
}

/// How many of `names` exist.
fn present(names: &[String]) -> usize {
    let now = existing();
    names.iter().filter(|n| now.contains(n)).count()
}

#[test]
fn three_hosts_reach_each_other_through_shaped_links_and_go_away() {
    if skip("three_hosts_reach_each_other_through_shaped_links_and_go_away") {
        return;
    }
    let hosts = Hosts::up(3, Link::parse("10gbit").unwrap()).unwrap();
    assert_eq!(hosts.len(), 3);
    let names = hosts.namespaces();
    assert_eq!(names.len(), 4, "three hosts and the switch");
    assert_eq!(present(&names), 4);
    // Both ends of every link are shaped at the rate.
    for i in 0..3 {
        let out = Command::new("tc")
            .args(["-n", hosts.name(i).unwrap(), "qdisc", "show", "dev", "eth0"])
            .output()
            .unwrap();
        let s = String::from_utf8_lossy(&out.stdout);
        assert!(s.contains("tbf") && s.contains("rate 10Gbit"), "{s}");
    }
    // A process in host 1 sees its own address.
    let out = hosts
        .command(1, "ip")
        .unwrap()
        .args(["-4", "-o", "addr", "show", "dev", "eth0"])
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("10.99.0.2/24"), "{s}");
    // A thread in host 2 listens; one in host 0 connects through the switch.
    let addr = hosts.addr(2).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let h = &hosts;
    std::thread::scope(|sc| {
        sc.spawn(move || {
            h.enter(2).unwrap();
            let l = TcpListener::bind((addr, 0)).unwrap();
            tx.send(l.local_addr().unwrap()).unwrap();
            let (mut s, peer) = l.accept().unwrap();
            assert_eq!(peer.ip(), h.addr(0).unwrap());
            let mut v = vec![0u8; 1 << 20];
            s.read_exact(&mut v).unwrap();
            s.write_all(&v[..8]).unwrap();
        });
        let at = rx.recv().unwrap();
        sc.spawn(move || {
            h.enter(0).unwrap();
            let mut s = TcpStream::connect(at).unwrap();
            let v: Vec<u8> = (0..1 << 20).map(|i| i as u8).collect();
            s.write_all(&v).unwrap();
            let mut back = [0u8; 8];
            s.read_exact(&mut back).unwrap();
            assert_eq!(back, [0, 1, 2, 3, 4, 5, 6, 7]);
        });
    });
    // This thread never entered a host: the hosts' addresses are not here.
    assert!(TcpListener::bind((addr, 0)).is_err());
    hosts.down().unwrap();
    assert_eq!(present(&names), 0);
}

#[test]
fn hosts_of_a_killed_process_are_swept() {
    if std::env::var_os("DM_NETNS_CHILD").is_some() {
        // The child: make hosts, say so, wait to be killed.
        let _h = Hosts::up(2, Link::default()).unwrap();
        println!("up");
        std::thread::sleep(std::time::Duration::from_secs(60));
        return;
    }
    if skip("hosts_of_a_killed_process_are_swept") {
        return;
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "hosts_of_a_killed_process_are_swept",
            "--nocapture",
        ])
        .env("DM_NETNS_CHILD", "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.starts_with("up") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the child ended");
    }
    let theirs = format!("dmrpc-{}-", child.id());
    let left = || {
        existing()
            .into_iter()
            .filter(|n| n.starts_with(&theirs))
            .count()
    };
    assert_eq!(left(), 3);
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(left(), 3, "nobody removed them yet");
    // The next hosts made anywhere sweep them.
    let h = Hosts::up(1, Link::default()).unwrap();
    assert_eq!(left(), 0);
    let names = h.namespaces();
    assert_eq!(present(&names), 2);
    drop(h);
    assert_eq!(present(&names), 0);
}

//! Who a TCP service serves: access keys proved both ways, no listening
//! beyond loopback without one, a cap on connections, and frames that
//! never finish arriving. Each test ends with the pool clean.

#![allow(clippy::unwrap_used)]

use dm_pool::auth::Key;
use dm_rpc::{Config, Node, Payload, Status, TcpLimits, Transport};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

mod common;
use common::{pool, unique};

fn key(s: &str) -> Key {
    Key::from_secret(s.as_bytes()).unwrap()
}

fn node_with(tp: &dm_pool::testing::TempPool, cfg: Config) -> Node {
    Node::with_config(tp.attach(), cfg)
}

fn echo(node: &Node, listen: &str) -> Result<dm_rpc::Server, dm_rpc::RpcError> {
    node.server(&unique("keyed"))
        .transport(Transport::Tcp(listen.into()))
        .method("echo", |c| Ok(c.take_payload()))
        .spawn()
}

/// A node with `cfg` serving `echo` on loopback, and its address.
fn service(tp: &dm_pool::testing::TempPool, cfg: Config) -> (Node, dm_rpc::Server, String) {
    let node = node_with(tp, cfg);
    let svc = echo(&node, "127.0.0.1:0").unwrap();
    let addr = svc.tcp_addr().unwrap().to_owned();
    (node, svc, addr)
}

/// A raw connection to `addr` that sent a hello without keys and read the
/// server's hello and proofs (returned), and sent proofs of zeros.
fn raw_hello(addr: &str) -> (std::net::TcpStream, Vec<u8>) {
    use dm_rpc::raw::tcp::{HELLO, HELLO_LEN, PROOFS_LEN};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let mut hello = HELLO.to_vec();
    hello.resize(HELLO_LEN, 0);
    s.write_all(&hello).unwrap();
    let mut theirs = vec![0u8; HELLO_LEN + PROOFS_LEN];
    s.read_exact(&mut theirs).unwrap();
    s.write_all(&[0u8; PROOFS_LEN]).unwrap();
    (s, theirs)
}

#[test]
fn a_keyed_service_serves_only_clients_that_prove_the_key() {
    let tp = pool();
    let k = key("the services' access key");
    let (server, svc, addr) = service(
        &tp,
        Config {
            tcp_key: Some(k),
            ..Default::default()
        },
    );
    // Other processes: the same pool's node only shares Refs, not the key.
    let other = pool();
    let no_key = Node::new(other.attach());
    let e = no_key.connect_tcp(&addr).unwrap_err();
    assert_eq!(e.status, Status::Unauthenticated, "{e}");
    assert!(e.message.contains("key file"), "{e}");
    let wrong = node_with(
        &other,
        Config {
            tcp_key: Some(key("another key entirely")),
            ..Default::default()
        },
    );
    let e = wrong.connect_tcp(&addr).unwrap_err();
    assert_eq!(e.status, Status::Unauthenticated, "{e}");
    let right = node_with(
        &other,
        Config {
            tcp_key: Some(k),
            ..Default::default()
        },
    );
    let c = right.connect_tcp(&addr).unwrap();
    let big = vec![9u8; 1 << 20];
    let got = c.call("echo", Payload::from_vec(big.clone())).unwrap();
    assert_eq!(got.to_vec().unwrap(), big);
    drop((c, right, wrong, no_key, svc, server));
    tp.assert_clean();
    other.assert_clean();
}

/// A client that proves a key it has never had (zeros) is told no and
/// closed; a keyed client refuses a server without the key (an impostor
/// on the address).
#[test]
fn a_forged_proof_is_refused_and_an_impostor_server_too() {
    use dm_rpc::raw::tcp::{FLAG_KEYED, VERDICT_OK};
    let tp = pool();
    let (server, svc, addr) = service(
        &tp,
        Config {
            tcp_key: Some(key("the services' access key")),
            ..Default::default()
        },
    );
    let (mut s, theirs) = raw_hello(&addr);
    let flags = u64::from_le_bytes(theirs[40..48].try_into().unwrap());
    assert_eq!(flags & FLAG_KEYED, FLAG_KEYED);
    let mut verdict = [VERDICT_OK];
    s.read_exact(&mut verdict).unwrap();
    assert_ne!(verdict[0], VERDICT_OK);
    let mut rest = Vec::new();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(s.read_to_end(&mut rest).unwrap_or(0), 0, "closed");
    drop((svc, server));
    // An open service on the address a keyed client dials.
    let open = Node::new(tp.attach());
    let svc = echo(&open, "127.0.0.1:0").unwrap();
    let keyed = node_with(
        &tp,
        Config {
            tcp_key: Some(key("the services' access key")),
            ..Default::default()
        },
    );
    let e = keyed.connect_tcp(svc.tcp_addr().unwrap()).unwrap_err();
    assert_eq!(e.status, Status::Unauthenticated, "{e}");
    assert!(e.message.contains("did not prove"), "{e}");
    drop((keyed, svc, open));
    tp.assert_clean();
}

#[test]
fn listening_beyond_loopback_needs_a_key_or_tcp_open() {
    let tp = pool();
    let node = Node::new(tp.attach());
    let e = echo(&node, "0.0.0.0:0").unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    assert!(
        e.message.contains("tcp_key") && e.message.contains("tcp_open"),
        "{e}"
    );
    let open = node_with(
        &tp,
        Config {
            tcp_open: true,
            ..Default::default()
        },
    );
    let svc = echo(&open, "0.0.0.0:0").unwrap();
    drop((svc, open, node));
    tp.assert_clean();
}

#[test]
fn one_connection_more_than_the_cap_is_told_so() {
    let tp = pool();
    let (server, svc, addr) = service(
        &tp,
        Config {
            tcp_limits: TcpLimits {
                max_connections: 2,
                ..Default::default()
            },
            ..Default::default()
        },
    );
    let client = Node::new(tp.attach());
    let a = client.connect_tcp(&addr).unwrap();
    let b = client.connect_tcp(&addr).unwrap();
    let e = client.connect_tcp(&addr).unwrap_err();
    assert_eq!(e.status, Status::ResourceExhausted, "{e}");
    // The two are served; once one leaves, a new one is.
    a.call("echo", Payload::from_vec(vec![1])).unwrap();
    drop(a);
    let until = Instant::now() + Duration::from_secs(10);
    let c = loop {
        match client.connect_tcp(&addr) {
            Ok(c) => break c,
            Err(_) if Instant::now() < until => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("no room after a client left: {e}"),
        }
    };
    c.call("echo", Payload::from_vec(vec![2])).unwrap();
    b.call("echo", Payload::from_vec(vec![3])).unwrap();
    drop((b, c, client, svc, server));
    tp.assert_clean();
}

/// A frame whose header came and whose payload never does: the
/// connection is dropped after the frame timeout; others are served.
#[test]
fn a_frame_that_never_finishes_arriving_is_dropped() {
    let tp = pool();
    let (server, svc, addr) = service(
        &tp,
        Config {
            tcp_limits: TcpLimits {
                frame_timeout: Duration::from_millis(300),
                ..Default::default()
            },
            ..Default::default()
        },
    );
    let (mut s, _) = raw_hello(&addr);
    let req = dm_rpc::Frame::request(
        1,
        dm_rpc::frame::method_id("echo"),
        0,
        dm_rpc::Body::Inline(vec![5u8; 1 << 20].into()),
    )
    .encode();
    s.write_all(&req[..4096]).unwrap();
    let t = Instant::now();
    let client = Node::new(tp.attach());
    let good = client.connect_tcp(&addr).unwrap();
    good.call("echo", Payload::from_vec(vec![1])).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    let took = t.elapsed();
    assert!(rest.is_empty(), "no answer to a frame never finished");
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(5),
        "{took:?}"
    );
    good.call("echo", Payload::from_vec(vec![2])).unwrap();
    drop((good, client, svc, server));
    tp.assert_clean();
}

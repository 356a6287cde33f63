//! The `dmrpc` tool against live pools: `ls` shows registered services.
#![allow(clippy::unwrap_used)]

use dm_pool::testing::TempPool;
use dm_rpc::{Node, Payload};
use std::process::Command;

fn dmrpc(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dmrpc"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

#[test]
fn ls_lists_services_with_their_connections() {
    let tp = TempPool::new(64 << 20);
    let path = tp.path.to_str().unwrap();
    let (ok, out) = dmrpc(&["ls", "--path", path]);
    assert!(ok, "{out}");
    assert!(out.contains("no services"), "{out}");
    let node = Node::new(tp.attach());
    let a = node
        .server("shop/images/resize")
        .method("m", |_| Ok(Payload::empty()))
        .spawn()
        .unwrap();
    let b = node
        .server("shop/cart")
        .method("m", |_| Ok(Payload::empty()))
        .spawn()
        .unwrap();
    let c = node.connect("shop/images/resize").unwrap();
    c.call("m", Payload::empty()).unwrap();
    let (ok, out) = dmrpc(&["ls", "--path", path]);
    assert!(ok, "{out}");
    let line = |name: &str| {
        out.lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} missing from:\n{out}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let resize = line("shop/images/resize");
    assert_eq!(resize[1], "shm");
    assert_eq!(resize[2], std::process::id().to_string());
    assert_eq!(resize[3], "1", "one connection");
    assert_eq!(resize[4], "yes");
    assert_eq!(line("shop/cart")[3], "0");
    let (_, out) = dmrpc(&["ls", "--path", path, "--prefix", "shop/c"]);
    assert!(
        out.contains("shop/cart") && !out.contains("resize"),
        "{out}"
    );
    drop(c);
    a.shutdown();
    b.shutdown();
    drop(node);
    let (_, out) = dmrpc(&["ls", "--path", path]);
    assert!(out.contains("no services"), "{out}");
    tp.assert_clean();
}

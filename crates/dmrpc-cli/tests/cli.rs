//! The `dmrpc` tool against live pools: `ls` shows registered services,
//! `call` calls them, `pool create` and `pool info` make and describe
//! pools.
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
    let g = node
        .server("shop/grpc")
        .protocol(dm_pool::Protocol::Grpc)
        .method("m", |_| Ok(Payload::empty()))
        .spawn()
        .unwrap();
    let workers: Vec<_> = (0..2)
        .map(|_| {
            node.server("shop/workers")
                .replica()
                .method("m", |_| Ok(Payload::empty()))
                .spawn()
                .unwrap()
        })
        .collect();
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
    assert_eq!(resize[6], "sole");
    assert_eq!(resize[7], "dmrpc");
    assert_eq!(line("shop/cart")[3], "0");
    assert_eq!(line("shop/grpc")[7], "grpc", "what it speaks");
    // A name shared by replicas: a line each.
    let replicas: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("shop/workers"))
        .collect();
    assert_eq!(replicas.len(), 2, "{out}");
    assert!(
        replicas.iter().all(|l| l.ends_with("replica dmrpc")),
        "{out}"
    );
    let (_, out) = dmrpc(&["ls", "--path", path, "--prefix", "shop/c"]);
    assert!(
        out.contains("shop/cart") && !out.contains("resize"),
        "{out}"
    );
    drop(c);
    a.shutdown();
    b.shutdown();
    g.shutdown();
    for w in workers {
        w.shutdown();
    }
    drop(node);
    let (_, out) = dmrpc(&["ls", "--path", path]);
    assert!(out.contains("no services"), "{out}");
    tp.assert_clean();
}

/// `dmrpc` with `args`: its exit code, stdout and stderr.
fn dmrpc_out(args: &[&str]) -> (i32, Vec<u8>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dmrpc"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        out.stdout,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn call_calls_a_service_from_the_shell() {
    let tp = TempPool::new(64 << 20);
    let path = tp.path.to_str().unwrap();
    let node = Node::new(tp.attach());
    let svc = |t: dm_rpc::Transport| {
        node.server(&format!(
            "cli/echo/{}",
            matches!(t, dm_rpc::Transport::Tcp(_))
        ))
        .transport(t)
        .method("echo", |c| Ok(c.take_payload()))
        .method("len", |c| {
            Ok(Payload::from_vec(
                c.payload().len().to_string().into_bytes(),
            ))
        })
        .method("meta", |c| {
            let m = c.metadata().iter();
            let m = m.map(|(k, v)| format!("{k}={}", String::from_utf8_lossy(v)));
            Ok(Payload::from_vec(
                m.collect::<Vec<_>>().join(",").into_bytes(),
            ))
        })
        .method("fail", |c| {
            let m = dm_rpc::Metadata::new().with("retry-after-ms", "250")?;
            c.set_reply_metadata(m.with("bin", vec![0u8, 255])?)?;
            Err(dm_rpc::RpcError::invalid_argument("no thanks"))
        })
        // Items "0".."N-1" for an argument of N, then one of 100 000
        // bytes (by Ref), or an error if N is above 9.
        .method_stream("count", |c, sink| {
            let n: u32 = String::from_utf8_lossy(&c.payload().to_vec()?)
                .parse()
                .map_err(|_| dm_rpc::RpcError::invalid_argument("a number"))?;
            if n > 9 {
                sink.send(b"x".to_vec())?;
                return Err(dm_rpc::RpcError::resource_exhausted("too many"));
            }
            for k in 0..n {
                sink.send(k.to_string().into_bytes())?;
            }
            sink.send(vec![7u8; 100_000])?;
            Ok(())
        })
        .spawn()
        .unwrap()
    };
    let shm = svc(dm_rpc::Transport::Shm);
    let call = |args: &[&str]| {
        let mut all = vec!["call", "--path", path];
        all.extend_from_slice(args);
        dmrpc_out(&all)
    };
    let (code, out, err) = call(&["cli/echo/false", "echo", "--data", "hello"]);
    assert_eq!((code, out.as_slice()), (0, &b"hello"[..]), "{err}");
    assert!(err.contains("ok: 5 bytes inline"), "{err}");
    // A large argument from a file goes by Ref, and comes back as it went.
    let dir = std::env::temp_dir().join(format!("dmrpc-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let big: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    let file = dir.join("big");
    std::fs::write(&file, &big).unwrap();
    let f = file.to_str().unwrap();
    let (code, out, err) = call(&["cli/echo/false", "echo", "--file", f]);
    assert_eq!(code, 0, "{err}");
    assert!(out == big, "the answer differs from the file");
    assert!(err.contains("by Ref"), "{err}");
    let (code, out, err) = call(&[
        "cli/echo/false",
        "len",
        "--data",
        "abc",
        "--hex",
        "--repeat",
        "20",
    ]);
    assert_eq!(
        (code, String::from_utf8_lossy(&out).trim()),
        (0, "33"),
        "{err}"
    );
    assert!(err.contains("20 calls") && err.contains("p99"), "{err}");
    let meta = ["--meta", "trace-id=t1", "--meta", "k=a=b"];
    let (code, out, err) = call(&[&["cli/echo/false", "meta"][..], &meta].concat());
    assert_eq!(
        (code, out.as_slice()),
        (0, &b"trace-id=t1,k=a=b"[..]),
        "{err}"
    );
    let (code, _, err) = call(&["cli/echo/false", "meta", "--meta", "Bad=1"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("metadata key"), "{err}");
    // A stream: its items as they come, then a summary.
    let (code, out, err) = call(&["cli/echo/false", "count", "--data", "3", "--stream"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(&out[..3], b"012");
    assert!(out[3..] == [7u8; 100_000], "the last item");
    assert!(
        err.contains("ok: 4 items, 100003 bytes (1 by Ref)"),
        "{err}"
    );
    let (code, out, err) = call(&["cli/echo/false", "count", "--data", "12", "--stream"]);
    assert_eq!((code, out.as_slice()), (1, &b"x"[..]), "{err}");
    assert!(
        err.contains("after 1 items: resource exhausted: too many"),
        "{err}"
    );
    // Typed failures: the call's status (1), or no such service (2).
    let (code, _, err) = call(&["cli/echo/false", "fail"]);
    assert_eq!(code, 1, "{err}");
    // The answer's metadata, on stderr: text as it is, other bytes in hex.
    assert!(
        err.contains("< retry-after-ms: 250\n< bin: 0x00ff\n"),
        "{err}"
    );
    assert!(err.contains("invalid argument: no thanks"), "{err}");
    let (code, _, err) = call(&["cli/echo/false", "nope"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("not found"), "{err}");
    let (code, _, err) = call(&["cli/none", "echo"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not found"), "{err}");
    let (code, _, err) = call(&["cli/none", "echo", "--wait-for-ready", "--timeout", "0.2"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("deadline exceeded"), "{err}");
    // Over TCP from a process with no pool: a private pool, gone after.
    let tcp = svc(dm_rpc::Transport::Tcp("127.0.0.1:0".into()));
    let addr = tcp.tcp_addr().unwrap().to_owned();
    let nowhere = dir.join("no.pool");
    let args = [
        "call",
        "--path",
        nowhere.to_str().unwrap(),
        "--tcp",
        &addr,
        "x",
        "echo",
        "--file",
        f,
    ];
    let child = Command::new(env!("CARGO_BIN_EXE_dmrpc"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let private = std::env::temp_dir().join(format!("dmrpc-call-{}.pool", child.id()));
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        out.stdout == big,
        "the answer over TCP differs from the file"
    );
    assert!(!nowhere.exists() && !private.exists(), "a pool is left");
    std::fs::remove_dir_all(&dir).unwrap();
    shm.shutdown();
    tcp.shutdown();
    drop(node);
    tp.assert_clean();
}

/// `pool create --ref-clock` picks the clock Refs live by, `pool info`
/// says which (and whose), and a clock that is not one is refused.
#[test]
fn pool_info_says_which_clock_refs_live_by() {
    let dir = std::env::temp_dir();
    let host = dir.join(format!("dmrpc-cli-clock-host-{}.pool", std::process::id()));
    let wall = dir.join(format!("dmrpc-cli-clock-wall-{}.pool", std::process::id()));
    let (h, w) = (host.to_str().unwrap(), wall.to_str().unwrap());
    let (ok, out) = dmrpc(&["pool", "create", "h", "--path", h, "--size", "8MiB"]);
    assert!(ok, "{out}");
    let (ok, out) = dmrpc(&["pool", "info", "h", "--path", h]);
    assert!(ok, "{out}");
    assert!(out.contains("on this host's monotonic clock"), "{out}");
    // Stats say each limit beside its use.
    let (ok, out) = dmrpc(&["pool", "stats", "h", "--path", h]);
    assert!(ok, "{out}");
    assert!(out.contains("services 0 of 128"), "{out}");
    assert!(out.contains("channels open 0 of "), "{out}");
    let (ok, out) = dmrpc(&[
        "pool",
        "create",
        "w",
        "--path",
        w,
        "--size",
        "8MiB",
        "--ref-clock",
        "wall",
    ]);
    assert!(ok, "{out}");
    let (ok, out) = dmrpc(&["pool", "info", "w", "--path", w]);
    assert!(ok, "{out}");
    assert!(out.contains("on the wall clock"), "{out}");
    let (ok, out) = dmrpc(&["pool", "create", "x", "--path", w, "--ref-clock", "tsc"]);
    assert!(!ok && out.contains("neither"), "{out}");
    for p in [&host, &wall] {
        assert!(dm_pool::check_path(p, true).unwrap().ok());
        std::fs::remove_file(p).unwrap();
    }
}

/// Every limit is chosen at creation, up to what the pool has room for,
/// and `pool info` shows each: thousands of slots, descriptors, services
/// and channels, and a buffer as large as the pool.
#[test]
fn pool_limits_are_chosen_at_creation_and_shown() {
    let path = std::env::temp_dir().join(format!("dmrpc-cli-limits-{}.pool", std::process::id()));
    let p = path.to_str().unwrap();
    let (ok, out) = dmrpc(&[
        "pool",
        "create",
        "big",
        "--path",
        p,
        "--size",
        "256MiB",
        "--slots",
        "4000",
        "--descriptors",
        "100000",
        "--services",
        "3000",
        "--channels",
        "2000",
        "--ring-size",
        "4KiB",
    ]);
    assert!(ok, "{out}");
    let (ok, out) = dmrpc(&["pool", "info", "big", "--path", p]);
    assert!(ok, "{out}");
    for want in [
        "slots       4000",
        "descriptors 100000",
        "services    3000",
        "channels    2000 (rings of 4 KiB each way)",
    ] {
        assert!(out.contains(want), "{want:?} in {out}");
    }
    let max = out
        .lines()
        .find_map(|l| l.strip_prefix("max buffer  "))
        .unwrap_or_else(|| panic!("no max buffer in {out}"));
    let pages = out
        .lines()
        .find_map(|l| l.strip_prefix("data pages  "))
        .unwrap_or_else(|| panic!("no data pages in {out}"));
    assert!(
        pages.ends_with(&format!("({max})")),
        "max buffer {max}, data pages {pages}"
    );
    let (ok, out) = dmrpc(&["pool", "create", "x", "--path", p, "--slots", "70000"]);
    assert!(
        !ok && out.contains("slots must be between 1 and 65535"),
        "{out}"
    );
    let (ok, out) = dmrpc(&["pool", "stats", "big", "--path", p]);
    assert!(ok, "{out}");
    for want in [
        "descriptors used 0 of 100000",
        "slots   live 0  dead 0  total 4000",
        "services 0 of 3000",
    ] {
        assert!(out.contains(want), "{want:?} in {out}");
    }
    // Check and gc say how far they have come.
    let (ok, out) = dmrpc(&["pool", "check", "big", "--path", p, "--deep", "--progress"]);
    assert!(ok, "{out}");
    for want in [
        "pool check: descriptors (mappings) 0 of 100000 (0%)",
        "pool check: descriptors (pages named) 100000 of 100000 (100%)",
        "pool check: list pages 0 of 100000",
        "pool check: pages 0 of ",
    ] {
        assert!(out.contains(want), "{want:?} in {out}");
    }
    let (ok, out) = dmrpc(&["pool", "gc", "big", "--path", p, "--progress"]);
    assert!(ok, "{out}");
    for want in [
        "pool gc: slots 4000 of 4000 (100%)",
        "pool gc: expiry groups 1563 of 1563 (100%)",
        "pool gc: descriptors (pages named) 100000 of 100000 (100%)",
        "recount ran",
    ] {
        assert!(out.contains(want), "{want:?} in {out}");
    }
    // Without --progress a quick pass says nothing of it.
    let (ok, out) = dmrpc(&["pool", "check", "big", "--path", p]);
    assert!(ok && !out.contains("of 100000"), "{out}");
    assert!(dm_pool::check_path(&path, true).unwrap().ok());
    std::fs::remove_file(&path).unwrap();
}

/// A pool is named the same way to every command: `ls` takes `--pool` as
/// `call` does (or the name alone, as `pool` commands do), and a pool that
/// is not there says so once, with the OS's reason.
#[test]
fn ls_takes_the_pool_as_call_does_and_a_missing_pool_says_why_once() {
    let name = format!("cli-ls-{}", std::process::id());
    let (ok, out) = dmrpc(&["pool", "create", &name, "--size", "16MiB"]);
    assert!(ok, "{out}");
    let file = dm_pool::default_path(&name);
    for args in [vec!["ls", "--pool", &name], vec!["ls", &name]] {
        let (ok, out) = dmrpc(&args);
        assert!(ok, "{args:?}: {out}");
        assert!(
            out.contains(&format!("no services registered in {}", file.display())),
            "{out}"
        );
    }
    let (ok, out) = dmrpc(&["ls", &name, "--pool", &name]);
    assert!(!ok, "both a NAME and --pool: {out}");
    let (ok, out) = dmrpc(&["pool", "destroy", &name]);
    assert!(ok, "{out}");
    let (ok, out) = dmrpc(&["call", "shop/x", "m", "--pool", &name]);
    assert!(!ok, "{out}");
    // ENOENT (2 on Linux): "No such file or directory (os error 2)".
    let reason = std::io::Error::from_raw_os_error(2).to_string();
    assert_eq!(out.matches(&reason).count(), 1, "{out}");
}

#[test]
fn call_calls_a_grpc_service_with_raw_messages() {
    let tp = TempPool::new(64 << 20);
    let path = tp.path.to_str().unwrap();
    let node = Node::new(tp.attach());
    let routes = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(dm_grpc::example::routes())
        .unwrap();
    let server = dm_grpc::serve(&node, "cli/imaging", routes).unwrap();
    let (ok, out) = dmrpc(&["ls", "--path", path]);
    assert!(ok && out.contains("grpc"), "{out}");
    // imaging.Blob { data: "hi", seq: 7 }, encoded by hand.
    let blob = "\x0a\x02hi\x10\x07";
    let call = |more: &[&str]| {
        let base = ["call", "--path", path, "cli/imaging"];
        dmrpc_out(&[&base[..], more].concat())
    };
    let (code, out, err) = call(&["/imaging.Imaging/Echo", "--data", blob]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, blob.as_bytes(), "{err}");
    assert!(
        err.contains("ok: 1 message(s)") && err.contains("grpc-status: 0"),
        "{err}"
    );
    // A server stream: every message.
    // imaging.TileRequest { count: 3, size: 2 }.
    let (code, out, err) = call(&[
        "/imaging.Imaging/Tiles",
        "--data",
        "\x08\x03\x10\x02",
        "--hex",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        String::from_utf8_lossy(&out).matches("\n\n").count(),
        3,
        "{err}"
    );
    // A status other than Ok: its code, and exit 1.
    let (code, _, err) = call(&[
        "/imaging.Imaging/Echo",
        "--data",
        blob,
        "--meta",
        "x-fail=7",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("PermissionDenied") && err.contains("x-why: asked"),
        "{err}"
    );
    // A name that is no path, and a method the service lacks.
    let (code, _, err) = call(&["Echo", "--data", blob]);
    assert_ne!(code, 0);
    assert!(err.contains("/package.Service/Method"), "{err}");
    let (code, _, err) = call(&["/imaging.Imaging/Nope", "--data", blob]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("Unimplemented"), "{err}");
    server.shutdown();
    drop(node);
    // Each `dmrpc call` detached before it exited: no slot of a dead
    // process is left to reclaim.
    tp.assert_clean();
}

#[test]
fn a_cluster_of_three_hosts_finds_services_by_name_and_survives_a_host() {
    // Three network-namespace hosts, etcd on each, memory servers on two,
    // a replicated chain and the image application across them; then one
    // host's processes killed.
    if let Err(e) = dm_netns::Hosts::available() {
        eprintln!("skipped: {e}");
        return;
    }
    let (ok, out) = dmrpc(&[
        "cluster",
        "--link",
        "unshaped",
        "--sizes",
        "4KiB,256KiB",
        "--calls",
        "30",
        "--kill-host",
        "2",
        "--payloads",
        "ref",
    ]);
    assert!(ok, "{out}");
    // Both applications answered (every answer is checked), on pools that
    // are namespaces of one device file; the chain's payloads reached its
    // last tier by memory-server Ref.
    let row = |app: &str| {
        out.lines()
            .find(|l| l.contains(app) && l.contains("256 KiB"))
    };
    assert!(row("image").is_some(), "no image row: {out}");
    assert!(row("chain").is_some_and(|r| r.ends_with("100%")), "{out}");
    assert!(out.contains("namespaces host0..host2"), "{out}");
    assert!(
        out.contains("host 2 killed") && out.contains("none failed"),
        "{out}"
    );
    assert!(out.contains("every pool checked: clean"), "{out}");
}

/// `dmrpc ns`: namespaces of one file made, listed, used by a service and
/// a shell client through `DEVICE/NAME`, and removed once unused.
#[test]
fn namespaces_of_one_file_hold_pools_that_services_use() {
    let dev = std::path::PathBuf::from(format!("/dev/shm/dmrpc-cli-ns-{}.dev", std::process::id()));
    let _ = std::fs::remove_file(&dev);
    let d = dev.to_str().unwrap();
    let (ok, out) = dmrpc(&["ns", "create", d, "alpha", "--size", "32MiB"]);
    assert!(!ok && out.contains("--device-size"), "{out}");
    let (ok, out) = dmrpc(&[
        "ns",
        "create",
        d,
        "alpha",
        "--size",
        "32MiB",
        "--device-size",
        "256MiB",
    ]);
    assert!(ok, "{out}");
    let (ok, out) = dmrpc(&["ns", "create", d, "beta", "--size", "64MiB"]);
    assert!(ok, "{out}");
    let (ok, out) = dmrpc(&["ns", "ls", d]);
    assert!(ok && out.contains("alpha") && out.contains("beta"), "{out}");
    assert!(out.contains("2 namespace(s)"), "{out}");

    let alpha = dm_pool::namespace::path(&dev, "alpha");
    let a = alpha.to_str().unwrap();
    let node = Node::new(dm_pool::Pool::open(&alpha, Default::default()).unwrap());
    let svc = node
        .server("ns/echo")
        .method("echo", |c| Ok(c.take_payload()))
        .spawn()
        .unwrap();
    let (code, out, err) = dmrpc_out(&["call", "--path", a, "ns/echo", "echo", "--data", "hi"]);
    assert_eq!((code, out.as_slice()), (0, &b"hi"[..]), "{err}");
    let (ok, out) = dmrpc(&["ls", "--path", a]);
    assert!(ok && out.contains("ns/echo"), "{out}");
    let (ok, out) = dmrpc(&["ns", "info", d, "alpha"]);
    assert!(ok && out.contains("attached    1 process"), "{out}");
    let (ok, out) = dmrpc(&["ns", "rm", d, "alpha"]);
    assert!(!ok && out.contains("in use"), "{out}");

    drop(svc);
    drop(node);
    let (ok, out) = dmrpc(&["pool", "check", a, "--deep"]);
    assert!(ok, "{out}");
    let (ok, out) = dmrpc(&["ns", "rm", d, "alpha"]);
    assert!(ok, "{out}");
    let (ok, out) = dmrpc(&["ns", "ls", d]);
    assert!(
        ok && !out.contains("alpha") && out.contains("1 namespace(s)"),
        "{out}"
    );
    std::fs::remove_file(&dev).unwrap();
}

/// A command that only prints ends quietly when its reader goes away
/// (`dmrpc pool info | head -1`), with no panic or backtrace.
#[test]
fn a_printing_command_whose_reader_goes_ends_quietly() {
    use std::io::Read;
    let tp = TempPool::new(16 << 20);
    let mut child = Command::new(env!("CARGO_BIN_EXE_dmrpc"))
        .args(["pool", "info", "--path", tp.path.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The reader goes before the command writes.
    drop(child.stdout.take());
    let st = child.wait().unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        st.success() || std::os::unix::process::ExitStatusExt::signal(&st) == Some(libc::SIGPIPE),
        "{st:?} {err}"
    );
}

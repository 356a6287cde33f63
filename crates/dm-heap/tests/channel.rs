//! Heaps of a connection and of a service: each client's arguments read
//! in place from its own heap or the shared one, never from another
//! client's; answers built in the client's heap; a connection's heap let
//! go when it closes, by drop or by `kill -9` of its client's process;
//! a restarted service gets the heap attached again.
//!
//! The client killed is this test binary again, run with
//! `DM_HEAP_CLIENT` set (the `client_process` test connects then, and
//! returns at once otherwise).
#![allow(clippy::unwrap_used)]

use dm_heap::{
    allocator_api2, Heap, HeapChannel, HeapError, HeapService, HeapVec, ScopeAlloc, SHARED,
};
use dm_pool::testing::TempPool;
use dm_pool::{AttachOptions, Pool};
use dm_rpc::{Node, Payload, RpcError, Server, Status};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

type Nums<'h> = HeapVec<'h, u64>;
/// A sealed argument: numbers in a scope.
type Sealed<'s> = allocator_api2::vec::Vec<u64, ScopeAlloc<'s>>;

/// Set when `slow` has read its argument once, and whether its second
/// read found the same.
static SLOW: AtomicBool = AtomicBool::new(false);
static SLOW_SAME: AtomicBool = AtomicBool::new(false);

/// A service of two methods: `sum` reads a vector of numbers in place
/// and answers their sum as plain bytes; `double` answers a new vector
/// built in the caller's own heap.
fn serve(node: &Node, name: &str, svc: &Arc<HeapService>) -> Server {
    let (s1, s2, s3, s4) = (svc.clone(), svc.clone(), svc.clone(), svc.clone());
    svc.serve(node.server(name))
        .method("sum", move |call| {
            let heaps = s1.heaps(call.peer())?;
            let v = heaps.arg::<Nums>(&call.payload().to_vec()?)?;
            // SAFETY: the tests' clients pass a Nums and leave it be.
            let sum: u64 = unsafe { v.get() }.iter().sum();
            Ok(Payload::from_vec(sum.to_le_bytes().to_vec()))
        })
        .method("double", move |call| {
            let heaps = s2.heaps(call.peer())?;
            let v = heaps.arg::<Nums>(&call.payload().to_vec()?)?;
            let mine = s2.private(call.peer())?;
            let mut out = HeapVec::new_in(mine.alloc());
            // SAFETY: as above.
            out.extend(unsafe { v.get() }.iter().map(|x| 2 * x));
            let out = mine.put(out)?;
            Ok(Payload::from_vec(mine.arg(out)?.to_vec()))
        })
        // Reads a sealed argument, waits, reads it again: the same.
        .method("slow", move |call| {
            let heaps = s4.heaps(call.peer())?;
            let v = heaps.sealed_arg::<Sealed>(&call.payload().to_vec()?)?;
            // SAFETY: sealed (verified): its sender cannot change it.
            let before: u64 = unsafe { v.get() }.iter().sum();
            SLOW.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(800));
            // SAFETY: as above.
            let after: u64 = unsafe { v.get() }.iter().sum();
            SLOW_SAME.store(before == after, Ordering::SeqCst);
            Ok(Payload::from_vec(after.to_le_bytes().to_vec()))
        })
        // Keeps a copy of the argument in the shared heap, past the call.
        .method("keep", move |call| {
            let heaps = s3.heaps(call.peer())?;
            let v = heaps.arg::<Nums>(&call.payload().to_vec()?)?;
            let shared = s3
                .shared()
                .ok_or_else(|| RpcError::not_found("no shared heap"))?;
            // SAFETY: as above.
            let kept = shared.copy_from(unsafe { v.get() })?;
            Ok(Payload::from_vec(shared.arg(kept)?.to_vec()))
        })
        .spawn()
        .unwrap()
}

/// Stops the service, lets everything go, and checks the pool is clean.
fn close(server: Server, svc: Arc<HeapService>, node: Node, pool: Pool, tp: &TempPool) {
    server.shutdown();
    drop((svc, node));
    pool.maintain().unwrap();
    drop(pool);
    tp.assert_clean();
}

fn sum(ch: &HeapChannel, v: &Nums) -> Result<u64, RpcError> {
    let a = ch.call("sum", v)?.to_vec()?;
    Ok(u64::from_le_bytes(a.try_into().unwrap()))
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(10), "{what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn each_connection_reads_its_own_heap_and_the_shared_one() {
    let tp = TempPool::new(128 << 20);
    let pool = tp.attach();
    let node = Node::new(pool.clone());
    let svc = Arc::new(HeapService::with_shared(&pool, 4 << 20).unwrap());
    let server = serve(&node, "heap/chan/own", &svc);
    let a = HeapChannel::connect(&node, "heap/chan/own", 1 << 20).unwrap();
    let b = HeapChannel::connect(&node, "heap/chan/own", 1 << 20).unwrap();
    assert_eq!(svc.connections(), 2);
    assert_ne!(a.heap().base(), b.heap().base(), "a heap each");
    let shared = a.shared().unwrap();
    assert_eq!(shared.base(), b.shared().unwrap().base(), "one shared heap");

    let mut va = HeapVec::new_in(a.heap().alloc());
    va.extend(1..=100u64);
    let va = a.heap().put(va).unwrap();
    assert_eq!(sum(&a, va).unwrap(), 5050);
    // In the shared heap, built by a, passed by b.
    let mut vs = HeapVec::new_in(shared.alloc());
    vs.extend([7u64, 8, 9]);
    let vs = shared.put(vs).unwrap();
    assert_eq!(sum(&b, vs).unwrap(), 24);
    // An answer built in the caller's heap, read in place.
    let d = a.call("double", va).unwrap();
    let d = a.answer::<Nums>(&d).unwrap();
    assert_eq!(d.heap().base(), a.heap().base());
    // SAFETY: the service built a Nums and left it.
    assert_eq!(unsafe { d.get() }.iter().sum::<u64>(), 10100);
    drop(d);
    // A copy the service keeps in the shared heap: a's value, as it was.
    let mut mine = HeapVec::new_in(a.heap().alloc());
    mine.extend([1u64, 2, 3]);
    let mine = a.heap().put(mine).unwrap();
    let kept = a.call("keep", mine).unwrap();
    let kept = b.answer::<Nums>(&kept).unwrap();
    assert_eq!(kept.heap().base(), shared.base(), "in the shared heap");
    // SAFETY: the service built a Nums and left it.
    assert_eq!(unsafe { kept.get() }[..], [1, 2, 3]);
    drop(kept);

    // b passes a value in a's heap: refused, a typed error.
    let forged = a.heap().arg(va).unwrap();
    let e = b
        .client()
        .call("sum", Payload::from_vec(forged.to_vec()))
        .unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    assert!(e.message.contains("does not take"), "{e}");
    // A value in neither heap of the channel: refused before any call.
    let other = Heap::create(&pool, 64 << 10).unwrap();
    let x = other.put(5u64).unwrap();
    assert!(matches!(b.arg(x), Err(HeapError::Foreign(_))));
    drop(other);

    // A connection that attached no heap reads the shared one only.
    let plain = node.connect("heap/chan/own").unwrap();
    let arg = shared.arg(vs).unwrap();
    let got = plain.call("sum", Payload::from_vec(arg.to_vec())).unwrap();
    assert_eq!(got.to_vec().unwrap(), 24u64.to_le_bytes());
    // ... and cannot ask for answers in a heap of its own.
    let e = plain
        .call("double", Payload::from_vec(arg.to_vec()))
        .unwrap_err();
    assert_eq!(e.metadata.get("dm-heap"), Some(&b"attach"[..]), "{e}");

    // Attaching the shared heap, or another's, as one's own: refused.
    let sref = plain
        .call(SHARED, Payload::empty())
        .unwrap()
        .to_vec()
        .unwrap();
    let e = plain
        .call(dm_heap::ATTACH, Payload::from_vec(sref))
        .unwrap_err();
    assert!(e.message.contains("shared heap"), "{e}");
    let aref = a.heap().share().unwrap();
    let e = plain
        .call(dm_heap::ATTACH, Payload::from_vec(aref.to_bytes().to_vec()))
        .unwrap_err();
    assert!(e.message.contains("another connection"), "{e}");
    pool.release_ref(aref.pool_ref()).unwrap();
    for bad in [vec![], vec![0u8; 56], vec![1u8; 57]] {
        let e = plain
            .call(dm_heap::ATTACH, Payload::from_vec(bad))
            .unwrap_err();
        assert_eq!(e.status, Status::InvalidArgument, "{e}");
    }

    // Closing a connection lets go of its heap.
    drop(a);
    wait_until("a's heap let go", || svc.connections() == 1);
    drop((b, plain));
    wait_until("b's heap let go", || svc.connections() == 0);
    close(server, svc, node, pool, &tp);
}

#[test]
fn a_heap_too_large_is_refused_and_a_service_without_a_shared_heap_has_none() {
    let tp = TempPool::new(64 << 20);
    let pool = tp.attach();
    let node = Node::new(pool.clone());
    let svc = Arc::new(HeapService::new(&pool).private_max(1 << 20));
    let server = serve(&node, "heap/chan/max", &svc);
    let e = HeapChannel::connect(&node, "heap/chan/max", 2 << 20).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    let ch = HeapChannel::connect(&node, "heap/chan/max", 1 << 20).unwrap();
    assert!(ch.shared().is_none());
    let mut v = HeapVec::new_in(ch.heap().alloc());
    v.extend([1u64, 2]);
    let v = ch.heap().put(v).unwrap();
    assert_eq!(sum(&ch, v).unwrap(), 3);
    // Without a heap and without a shared one: NoHeap, marked.
    let plain = node.connect("heap/chan/max").unwrap();
    let e = plain
        .call("sum", Payload::from_vec(ch.arg(v).unwrap().to_vec()))
        .unwrap_err();
    assert_eq!(e.metadata.get("dm-heap"), Some(&b"attach"[..]), "{e}");
    drop((ch, plain));
    close(server, svc, node, pool, &tp);
}

/// A process that holds a channel's heap and also reads arguments with
/// its own `Heaps` (or opens the heap by its reference) shares one
/// mapping of it: no `AddressInUse`.
#[test]
fn heaps_of_a_process_share_the_channel_heaps_mapping() {
    let tp = TempPool::new(64 << 20);
    let pool = tp.attach();
    let node = Node::new(pool.clone());
    let svc = Arc::new(HeapService::with_shared(&pool, 1 << 20).unwrap());
    let server = serve(&node, "heap/chan/held", &svc);
    let ch = HeapChannel::connect(&node, "heap/chan/held", 1 << 20).unwrap();
    let mut v = HeapVec::new_in(ch.heap().alloc());
    v.extend([5u64, 6]);
    let v = ch.heap().put(v).unwrap();
    let bytes = ch.heap().arg(v).unwrap();
    let heaps = dm_heap::Heaps::new(&pool);
    let got = heaps.arg::<Nums>(&bytes).unwrap();
    assert_eq!(got.heap().base(), ch.heap().base(), "the same mapping");
    // SAFETY: built above as a Nums and left be.
    assert_eq!(unsafe { got.get() }.iter().sum::<u64>(), 11);
    let r = ch.heap().share().unwrap();
    let again = Heap::open_held(&pool, &r).unwrap();
    assert_eq!(again.base(), ch.heap().base());
    // The shared heap too, opened by reference.
    let sr = ch.shared().unwrap().share().unwrap();
    assert_eq!(
        Heap::open_held(&pool, &sr).unwrap().base(),
        ch.shared().unwrap().base()
    );
    pool.release_ref(r.pool_ref()).unwrap();
    pool.release_ref(sr.pool_ref()).unwrap();
    drop((got, heaps, again, ch));
    close(server, svc, node, pool, &tp);
}

#[test]
fn a_restarted_service_gets_the_heap_attached_again() {
    let tp = TempPool::new(64 << 20);
    let pool = tp.attach();
    let node = Node::new(pool.clone());
    let svc = Arc::new(HeapService::new(&pool));
    let server = serve(&node, "heap/chan/again", &svc);
    let ch = HeapChannel::connect(&node, "heap/chan/again", 1 << 20).unwrap();
    let mut v = HeapVec::new_in(ch.heap().alloc());
    v.extend(0..10u64);
    let v = ch.heap().put(v).unwrap();
    assert_eq!(sum(&ch, v).unwrap(), 45);
    server.shutdown();
    assert_eq!(svc.connections(), 0, "its connections ended with it");
    drop(svc);
    let svc = Arc::new(HeapService::new(&pool));
    let server = serve(&node, "heap/chan/again", &svc);
    // The client reconnects (its first calls may find nothing to dial
    // yet), then the channel attaches its heap again by itself.
    let start = Instant::now();
    let got = loop {
        match sum(&ch, v) {
            Err(e) if e.status == Status::Unavailable => {
                assert!(start.elapsed() < Duration::from_secs(10), "{e}");
                std::thread::sleep(Duration::from_millis(20));
            }
            r => break r.unwrap(),
        }
    };
    assert_eq!(got, 45);
    assert_eq!(svc.connections(), 1);
    drop(ch);
    wait_until("the heap let go", || svc.connections() == 0);
    close(server, svc, node, pool, &tp);
}

/// A child process (`DM_HEAP_CHILD` names its part): a client that
/// makes a call and waits to be killed (`idle`), one killed in a call
/// (`mid-call`), or a service killed in a call (`server`).
#[test]
fn child_process() {
    let (Ok(part), Ok(path)) = (
        std::env::var("DM_HEAP_CHILD"),
        std::env::var("DM_HEAP_POOL"),
    ) else {
        return;
    };
    let pool = Pool::open(std::path::Path::new(&path), AttachOptions::default()).unwrap();
    let node = Node::new(pool.clone());
    let say = |what: &str| {
        println!("{what}");
        std::io::stdout().flush().unwrap();
    };
    match part.as_str() {
        "server" => {
            let svc = Arc::new(HeapService::with_shared(&pool, 1 << 20).unwrap());
            let server = serve(&node, "heap/chan/child", &svc);
            say("ready");
            // Serves until killed.
            std::thread::sleep(Duration::from_secs(600));
            drop(server);
        }
        _ => {
            let ch = HeapChannel::connect(&node, "heap/chan/child", 2 << 20).unwrap();
            let mut v = HeapVec::new_in(ch.heap().alloc());
            v.extend(0..1000u64);
            let v = ch.heap().put(v).unwrap();
            assert_eq!(sum(&ch, v).unwrap(), 499_500);
            if part == "mid-call" {
                let scope = ch.heap().scope(64 << 10).unwrap();
                let mut w: Sealed = allocator_api2::vec::Vec::new_in(scope.alloc());
                w.extend(0..1000u64);
                let w = scope.put(w).unwrap();
                let seal = scope.seal().unwrap();
                say("calling");
                let _ = ch.call_sealed("slow", w, &seal);
            }
            say("ready");
        }
    }
    std::thread::sleep(Duration::from_secs(600));
}

/// Starts `child_process` as `part`, and waits until it says `word`.
fn child(tp: &TempPool, part: &str, word: &str) -> std::process::Child {
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("DM_HEAP_CHILD", part)
        .env("DM_HEAP_POOL", &tp.path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(c.stdout.take().unwrap());
    let mut line = String::new();
    while out.read_line(&mut line).unwrap() > 0 && !line.contains(word) {
        line.clear();
    }
    assert!(line.contains(word), "the child ({part}) did not say {word}");
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    c
}

/// A pool whose leases and Ref TTLs are short: what a killed process
/// held (the Ref it attached its heap by) runs out soon.
fn short_pool() -> TempPool {
    TempPool::with(dm_pool::PoolConfig {
        size: 64 << 20,
        lease_ms: 400,
        ref_ttl_ms: 1500,
        ..Default::default()
    })
}

/// After every process let go: waits out leases and TTLs, collects, and
/// checks that nothing is left.
fn settle(tp: &TempPool) {
    std::thread::sleep(Duration::from_millis(1700));
    dm_pool::gc_path(&tp.path).unwrap();
    tp.assert_clean();
}

#[test]
fn a_killed_clients_heap_is_let_go_and_nothing_leaks() {
    let tp = short_pool();
    let pool = tp.attach();
    let node = Node::new(pool.clone());
    let svc = Arc::new(HeapService::with_shared(&pool, 1 << 20).unwrap());
    let server = serve(&node, "heap/chan/child", &svc);
    let mut c = child(&tp, "idle", "ready");
    assert_eq!(svc.connections(), 1);
    c.kill().unwrap();
    c.wait().unwrap();
    wait_until("the killed client's heap let go", || svc.connections() == 0);

    // Killed in a call whose sealed argument the service is reading:
    // the service reads it to the end, unchanged, then lets it go.
    SLOW.store(false, Ordering::SeqCst);
    let mut c = child(&tp, "mid-call", "calling");
    wait_until("the call began", || SLOW.load(Ordering::SeqCst));
    c.kill().unwrap();
    c.wait().unwrap();
    wait_until("the killed caller's heap let go", || svc.connections() == 0);
    assert!(SLOW_SAME.load(Ordering::SeqCst), "the argument held still");
    server.shutdown();
    drop((svc, node, pool));
    settle(&tp);
}

#[test]
fn a_service_killed_mid_call_fails_the_call_and_nothing_leaks() {
    let tp = short_pool();
    let pool = tp.attach();
    let node = Node::new(pool.clone());
    let mut c = child(&tp, "server", "ready");
    let ch = HeapChannel::connect(&node, "heap/chan/child", 1 << 20).unwrap();
    let scope = ch.heap().scope(64 << 10).unwrap();
    let mut w: Sealed = allocator_api2::vec::Vec::new_in(scope.alloc());
    w.extend(0..1000u64);
    let w = scope.put(w).unwrap();
    let seal = scope.seal().unwrap();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        c.kill().unwrap();
        c.wait().unwrap();
    });
    let e = ch.call_sealed("slow", w, &seal).unwrap_err();
    assert_eq!(e.status, Status::Unavailable, "{e}");
    killer.join().unwrap();
    drop(seal);
    drop(scope);
    drop((ch, node, pool));
    settle(&tp);
}

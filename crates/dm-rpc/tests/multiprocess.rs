//! RPC across real processes over shared-memory channels: nested calls
//! through six processes, fan-out, servers and clients killed with
//! `kill -9` mid-call (and a client calling the process that takes the
//! killed server's name), a deadline inherited down a chain, a graceful
//! shutdown, a rolling restart, restarts under load, and hundreds of client
//! processes holding thousands of channels, a quarter of them killed.
//! Every test ends with `pool check` clean.
#![allow(clippy::unwrap_used)]

use dm_pool::testing::TempPool;
use dm_pool::{AttachOptions, PoolConfig};
use dm_rpc::{CallOptions, Node, Payload, Status};
use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

struct Agent {
    child: Child,
    stdin: Option<ChildStdin>,
    out: BufReader<ChildStdout>,
}

impl Agent {
    fn start(tp: &TempPool, args: &[&str]) -> Agent {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dm-rpc-agent"))
            .arg(&tp.path)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let out = BufReader::new(child.stdout.take().unwrap());
        Agent { child, stdin, out }
    }

    fn serve(tp: &TempPool, name: &str, extra: &[&str]) -> Agent {
        let mut args = vec!["serve", name, "--lease", "400"];
        args.extend_from_slice(extra);
        let mut a = Agent::start(tp, &args);
        assert_eq!(a.line(), "ready", "agent {name} did not start");
        a
    }

    fn line(&mut self) -> String {
        let mut s = String::new();
        self.out.read_line(&mut s).unwrap();
        s.trim_end().to_owned()
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Closes stdin: the agent shuts its server down and exits.
    fn stop(mut self) {
        drop(self.stdin.take());
        let st = self.child.wait().unwrap();
        assert!(st.success(), "agent exited with {st}");
    }

    fn say(&mut self, line: &str) {
        use std::io::Write;
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn pool() -> TempPool {
    TempPool::with(PoolConfig {
        size: 512 << 20,
        channels: Some(32),
        lease_ms: 400,
        ref_ttl_ms: 1500,
        ..Default::default()
    })
}

fn node(tp: &TempPool) -> Node {
    Node::new(tp.attach_with(AttachOptions {
        lease_ms: Some(400),
        ..Default::default()
    }))
}

fn hash(b: &[u8]) -> u64 {
    b.iter()
        .fold(0u64, |a, &x| a.wrapping_mul(31).wrapping_add(x as u64))
}

/// The hash of its argument an agent's `hop` answers with.
fn hash_in(got: &[u8]) -> u64 {
    u64::from_le_bytes(got[..8].try_into().unwrap())
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + 1) as u8).collect()
}

/// `hop` with `len` bytes through `c` until a server answers (a failed
/// call is `Unavailable`: the old server gone, its successor not called
/// yet), until `until`; the answer.
fn hop_until_served(c: &dm_rpc::Client, len: usize, until: Instant) -> Vec<u8> {
    loop {
        match c.call("hop", pattern(len)) {
            Ok(p) => return p.to_vec().unwrap(),
            Err(e) => {
                assert_eq!(e.status, Status::Unavailable, "{e}");
                assert!(Instant::now() < until, "no server is called: {e}");
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}

/// Three threads in `s` calling `hop` through `call` until `done`: small
/// requests inline, every fourth one of 100 000 bytes by Ref; each answer
/// is checked and any failure fails the test. Each returns its count.
fn load<'s>(
    s: &'s std::thread::Scope<'s, '_>,
    done: &'s std::sync::atomic::AtomicBool,
    call: impl Fn(Payload) -> Result<Payload, dm_rpc::RpcError> + Send + Sync + 's,
) -> Vec<std::thread::ScopedJoinHandle<'s, usize>> {
    let call = std::sync::Arc::new(call);
    (0..3usize)
        .map(|k| {
            let call = call.clone();
            s.spawn(move || {
                let mut n = 0usize;
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let len = if (n + k).is_multiple_of(4) {
                        100_000
                    } else {
                        10 + k
                    };
                    let got = call(Payload::from_vec(pattern(len)));
                    let got = got.unwrap_or_else(|e| panic!("call {n} of {k}: {e}"));
                    assert_eq!(hash_in(&got.to_vec().unwrap()), hash(&pattern(len)));
                    n += 1;
                }
                n
            })
        })
        .collect()
}

/// Stops the threads of [`load`]: how many calls they made.
fn stop_load(
    done: &std::sync::atomic::AtomicBool,
    workers: Vec<std::thread::ScopedJoinHandle<'_, usize>>,
) -> usize {
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    workers.into_iter().map(|w| w.join().unwrap()).sum()
}

/// Stops every agent, then checks the pool is clean.
fn stop_all(agents: Vec<Agent>, tp: &TempPool) {
    for a in agents {
        a.stop();
    }
    settle(tp);
}

/// After every process left: wait out leases and TTLs, gc, check clean.
fn settle(tp: &TempPool) {
    std::thread::sleep(Duration::from_millis(1700));
    dm_pool::gc_path(&tp.path).unwrap();
    tp.assert_clean();
}

#[test]
fn nested_calls_through_six_processes_forward_one_ref() {
    let tp = pool();
    let base = format!("mp/chain/{}", std::process::id());
    let mut agents = Vec::new();
    for k in (0..6).rev() {
        let me = format!("{base}/h{k}");
        let next = format!("{base}/h{}", k + 1);
        let extra: Vec<&str> = if k == 5 {
            vec![]
        } else {
            vec!["--next", &next]
        };
        agents.push(Agent::serve(&tp, &me, &extra));
    }
    let pids: Vec<u32> = agents.iter().map(Agent::pid).collect();
    let node = node(&tp);
    let c = node.connect(&format!("{base}/h0")).unwrap();
    for len in [10usize, 20_000, 16 << 20] {
        let data = pattern(len);
        let before = node.pool().counters();
        let mut b = node.pool().alloc(len as u64).unwrap();
        b.write(0, &data).unwrap();
        let got = c.call("hop", b).unwrap().to_vec().unwrap();
        let after = node.pool().counters();
        assert_eq!(hash_in(&got), hash(&data));
        let last_pid = u32::from_le_bytes(got[8..12].try_into().unwrap());
        assert_eq!(last_pid, pids[0], "the answer comes from the last hop");
        let by_ref = len > node.config().inline_max;
        assert_eq!(got[12] == 1, by_ref, "len {len}");
        assert_eq!(got.len(), 13 + if by_ref { dm_pool::Ref::SIZE } else { 0 });
        if by_ref {
            assert_eq!(
                after.refs_created - before.refs_created,
                1,
                "one Ref for six hops"
            );
            assert_eq!(after.cow_copies, before.cow_copies, "no hop copied a page");
        }
    }
    // A deadline shorter than the work: DeadlineExceeded, on time; an
    // unknown method: NotFound; and the chain keeps working.
    let t0 = Instant::now();
    let e = c
        .call_with(
            "sleep",
            Payload::from_vec(600u64.to_le_bytes().to_vec()),
            CallOptions::deadline(Duration::from_millis(100)),
        )
        .unwrap_err();
    assert_eq!(e.status, Status::DeadlineExceeded);
    assert!(
        t0.elapsed() < Duration::from_millis(400),
        "{:?}",
        t0.elapsed()
    );
    let e = c.call("nope", Payload::empty()).unwrap_err();
    assert_eq!(e.status, Status::NotFound);
    let got = c.call("hop", vec![3u8; 3]).unwrap().to_vec().unwrap();
    assert_eq!(hash_in(&got), hash(&[3, 3, 3]));
    drop(c);
    drop(node);
    stop_all(agents, &tp);
}

#[test]
fn fan_out_one_ref_to_three_processes() {
    let tp = pool();
    let base = format!("mp/fan/{}", std::process::id());
    let workers: Vec<String> = (0..3).map(|k| format!("{base}/w{k}")).collect();
    let mut agents: Vec<Agent> = workers.iter().map(|w| Agent::serve(&tp, w, &[])).collect();
    let list = workers.join(",");
    agents.push(Agent::serve(&tp, &format!("{base}/fan"), &["--fan", &list]));
    let node = node(&tp);
    let c = node.connect(&format!("{base}/fan")).unwrap();
    let data = pattern(3 << 20);
    let got = c.call("hop", data.clone()).unwrap().to_vec().unwrap();
    let rec = 13 + dm_pool::Ref::SIZE;
    assert_eq!(got.len(), 3 * rec);
    let refs: Vec<&[u8]> = got.chunks(rec).map(|r| &r[13..]).collect();
    for r in got.chunks(rec) {
        assert_eq!(u64::from_le_bytes(r[..8].try_into().unwrap()), hash(&data));
        assert_eq!(r[12], 1, "by Ref");
    }
    assert!(
        refs.iter().all(|r| *r == refs[0]),
        "every worker saw the same Ref"
    );
    drop(c);
    drop(node);
    stop_all(agents, &tp);
}

#[test]
fn server_killed_mid_call_gives_unavailable_and_leaks_nothing() {
    server_killed(&[]);
}

#[test]
fn tcp_server_killed_mid_call_gives_unavailable_and_leaks_nothing() {
    server_killed(&["--tcp"]);
}

fn server_killed(transport: &[&str]) {
    let tp = pool();
    let name = format!("mp/victim/{}/{}", std::process::id(), transport.len());
    let server = Agent::serve(&tp, &name, transport);
    let node = node(&tp);
    let c = node.connect(&name).unwrap();
    // Something in flight by Ref too.
    let big = node.pool().alloc(4 << 20).unwrap();
    let c2 = c.clone();
    let pending = std::thread::spawn(move || {
        let t0 = Instant::now();
        let r = c2.call("sleep", Payload::from_vec(5000u64.to_le_bytes().to_vec()));
        (r.map(|p| p.len()), t0.elapsed())
    });
    std::thread::sleep(Duration::from_millis(200));
    let in_flight = c.clone();
    let by_ref = std::thread::spawn(move || in_flight.call("hop", big).map(|p| p.len()));
    // An idempotent call in flight is sent again, once a server is back.
    let retried = c.clone();
    let idempotent = std::thread::spawn(move || {
        let o = CallOptions::deadline(Duration::from_secs(30))
            .idempotent()
            .wait_for_ready();
        let arg = Payload::from_vec(pattern(100_000));
        retried
            .call_with("hop", arg, o)
            .map(|p| p.to_vec().unwrap())
    });
    std::thread::sleep(Duration::from_millis(100));
    server.kill9();
    let (r, took) = pending.join().unwrap();
    assert_eq!(r.unwrap_err().status, Status::Unavailable);
    assert!(took < Duration::from_secs(3), "noticed after {took:?}");
    assert_eq!(
        by_ref.join().unwrap().unwrap_err().status,
        Status::Unavailable
    );
    // Future calls fail at once; the name goes with the lease.
    let t0 = Instant::now();
    assert_eq!(
        c.call("hop", vec![1u8]).unwrap_err().status,
        Status::Unavailable
    );
    assert!(t0.elapsed() < Duration::from_millis(100));
    std::thread::sleep(Duration::from_millis(600));
    node.pool().maintain().unwrap();
    assert_eq!(node.connect(&name).unwrap_err().status, Status::NotFound);
    // A new process takes the name: the client calls it, by Ref too.
    let successor = Agent::serve(&tp, &name, transport);
    let until = Instant::now() + Duration::from_secs(5);
    let got = hop_until_served(&c, 100_000, until);
    assert_eq!(hash_in(&got), hash(&pattern(100_000)));
    let got = idempotent.join().unwrap().unwrap();
    assert_eq!(hash_in(&got), hash(&pattern(100_000)));
    assert_eq!(c.reconnects(), 1);
    drop(c);
    drop(node);
    successor.stop();
    settle(&tp);
}

#[test]
fn client_killed_mid_call_does_not_disturb_the_server() {
    let tp = pool();
    let name = format!("mp/survivor/{}", std::process::id());
    let server = Agent::serve(&tp, &name, &[]);
    let mut victim = Agent::start(&tp, &["call", &name, "sleep", "500", "--lease", "400"]);
    assert_eq!(victim.line(), "calling");
    std::thread::sleep(Duration::from_millis(100));
    victim.kill9();
    let node = node(&tp);
    let c = node.connect(&name).unwrap();
    for len in [5usize, 100_000] {
        let got = c.call("hop", pattern(len)).unwrap().to_vec().unwrap();
        assert_eq!(hash_in(&got), hash(&pattern(len)));
    }
    // Another client process completes normally meanwhile.
    let mut other = Agent::start(&tp, &["call", &name, "hop", "1000000", "--lease", "400"]);
    assert_eq!(other.line(), "calling");
    let done = other.line();
    assert!(done.starts_with("ok"), "{done}");
    drop(c);
    drop(node);
    server.stop();
    settle(&tp);
}

/// CPU time (user + system) of process `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which is in parentheses).
    let rest = &s[s.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

#[test]
fn an_idle_server_uses_no_cpu() {
    let tp = pool();
    let name = format!("mp/idle/{}", std::process::id());
    let server = Agent::serve(&tp, &name, &[]);
    let node = node(&tp);
    let c = node.connect(&name).unwrap();
    // Busy for a moment, then idle: the server must park.
    for _ in 0..1000 {
        c.call("hop", vec![1u8; 16]).unwrap();
    }
    std::thread::sleep(Duration::from_millis(200));
    let before = cpu_ticks(server.pid());
    std::thread::sleep(Duration::from_secs(1));
    let used = cpu_ticks(server.pid()) - before;
    // 100 ticks a second: allow 5 (the lease thread, a park slice's checks).
    assert!(used <= 5, "an idle server used {used} ticks of CPU in 1 s");
    // And it still answers at once.
    c.call("hop", vec![1u8; 16]).unwrap();
    drop(c);
    drop(node);
    server.stop();
    settle(&tp);
}

/// An async handler awaits a call to another process (its answers read by
/// this server's listener, no pump thread), and that process is killed
/// with `kill -9` mid-call: the handler gets `Unavailable` promptly, so
/// its caller does too, and nothing leaks.
#[test]
fn async_handler_whose_callee_is_killed_mid_call_gets_unavailable() {
    let tp = pool();
    let pid = std::process::id();
    let victim = format!("mp/async-victim/{pid}");
    let server = Agent::serve(&tp, &victim, &[]);
    let node = node(&tp);
    let front = format!("mp/async-front/{pid}");
    let next: std::sync::Arc<std::sync::OnceLock<dm_rpc::AsyncClient>> = Default::default();
    let front_svc = {
        let (next, victim) = (next.clone(), victim.clone());
        node.server(&front)
            .method_async("via", move |c| {
                let (next, victim) = (next.clone(), victim.clone());
                async move {
                    let cl = match next.get() {
                        Some(cl) => cl.clone(),
                        None => {
                            let cl = c.node.connect_async(&victim)?;
                            let _ = next.set(cl.clone());
                            cl
                        }
                    };
                    // `sleep` for the payload's ms, or `hop` (by Ref) for a large one.
                    let method = if c.payload.len() == 8 { "sleep" } else { "hop" };
                    cl.call(method, c.payload.forward()?).await
                }
            })
            .spawn()
            .unwrap()
    };
    let c = node.connect(&front).unwrap();
    let data = pattern(1 << 20);
    let got = c.call("via", data.clone()).unwrap().to_vec().unwrap();
    assert_eq!(hash_in(&got), hash(&data));
    assert!(next.get().unwrap().answers_read_by_listener());
    let c2 = c.clone();
    let pending = std::thread::spawn(move || {
        let t0 = Instant::now();
        let r = c2.call("via", Payload::from_vec(5000u64.to_le_bytes().to_vec()));
        (r.map(|p| p.len()), t0.elapsed())
    });
    std::thread::sleep(Duration::from_millis(200));
    server.kill9();
    let (r, took) = pending.join().unwrap();
    assert_eq!(r.unwrap_err().status, Status::Unavailable);
    assert!(took < Duration::from_secs(3), "noticed after {took:?}");
    // The front still serves: later calls fail as the callee is gone.
    assert_eq!(
        c.call("via", vec![1u8; 16]).unwrap_err().status,
        Status::Unavailable
    );
    drop((c, next));
    front_svc.shutdown();
    drop(node);
    settle(&tp);
}

fn ms(n: u64) -> Payload {
    Payload::from_vec(n.to_le_bytes().to_vec())
}

#[test]
fn a_deadline_travels_down_a_chain_of_processes() {
    // h0 -> h1 -> h2, blocking services: h2 sleeps 1.5 s, the caller waits
    // 150 ms. h0's and h1's nested calls inherit that deadline, so both
    // give up with it and are free again at once (without it, h0 would
    // wait for h2 with no deadline, and a call to h0 would queue behind).
    let tp = pool();
    let base = format!("mp/deadline/{}", std::process::id());
    let (h0, h1, h2) = (
        format!("{base}/h0"),
        format!("{base}/h1"),
        format!("{base}/h2"),
    );
    let agents = vec![
        Agent::serve(&tp, &h2, &[]),
        Agent::serve(&tp, &h1, &["--next", &h2]),
        Agent::serve(&tp, &h0, &["--next", &h1]),
    ];
    let node = node(&tp);
    let c = node.connect(&h0).unwrap();
    let t0 = Instant::now();
    let e = c
        .call_with(
            "wait",
            ms(1500),
            CallOptions::deadline(Duration::from_millis(150)),
        )
        .unwrap_err();
    assert_eq!(e.status, Status::DeadlineExceeded);
    // h0 gave up when its caller did: it serves the next call at once.
    std::thread::sleep(Duration::from_millis(100));
    c.call_with(
        "sleep",
        ms(0),
        CallOptions::deadline(Duration::from_secs(10)),
    )
    .unwrap();
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(1000),
        "h0 was held for {took:?}"
    );
    drop(c);
    drop(node);
    stop_all(agents, &tp);
}

#[test]
fn a_graceful_shutdown_across_processes_finishes_the_call_in_progress() {
    let tp = pool();
    let name = format!("mp/graceful/{}", std::process::id());
    let mut agent = Agent::serve(&tp, &name, &[]);
    let node = node(&tp);
    let c = node.connect(&name).unwrap();
    std::thread::scope(|s| {
        let running = s.spawn(|| c.call("sleep", ms(400)));
        std::thread::sleep(Duration::from_millis(100));
        agent.say("drain");
        // The call in progress completes; then the service is gone.
        running.join().unwrap().unwrap();
        assert_eq!(agent.line(), "drained");
    });
    let e = c.call("sleep", ms(0)).unwrap_err();
    assert_eq!(e.status, Status::Unavailable, "{e}");
    assert_eq!(node.connect(&name).unwrap_err().status, Status::NotFound);
    drop(c);
    drop(node);
    agent.stop();
    settle(&tp);
}

/// A server process that stops while idle clients hold every channel of
/// the pool: those channels wait on their clients, which notice only in
/// a call. A dial to another service is refused after a short grace
/// (`CLOSED_BY_SERVER_GRACE`), not after its whole patience; once a held
/// channel's client calls (and learns the service is gone) and drops
/// its connection, the dial gets that channel.
#[test]
fn channels_held_by_idle_clients_of_a_stopped_server_do_not_stall_a_dial() {
    let tp = TempPool::with(PoolConfig {
        size: 64 << 20,
        channels: Some(2),
        lease_ms: 400,
        ref_ttl_ms: 1500,
        ..Default::default()
    });
    let old = format!("mp/held/old/{}", std::process::id());
    let new = format!("mp/held/new/{}", std::process::id());
    let a = Agent::serve(&tp, &old, &[]);
    let b = Agent::serve(&tp, &new, &[]);
    let node = node(&tp);
    let idle: Vec<_> = (0..2).map(|_| node.connect(&old).unwrap()).collect();
    for c in &idle {
        c.call("sleep", ms(0)).unwrap();
    }
    a.stop();
    let closing = node.pool().channels_closing();
    assert_eq!((closing.soon, closing.by_clients), (0, 2));
    let t = Instant::now();
    let e = node.connect(&new).unwrap_err();
    let waited = t.elapsed();
    assert_eq!(e.status, Status::ResourceExhausted, "{e}");
    assert!(
        waited >= dm_rpc::CLOSED_BY_SERVER_GRACE && waited < Duration::from_secs(3),
        "refused after {waited:?}"
    );
    // One idle client calls: the service is gone; dropped, it frees its
    // channel, which the dial takes.
    let mut idle = idle.into_iter();
    let first = idle.next().unwrap();
    let e = first.call("sleep", ms(0)).unwrap_err();
    assert!(
        matches!(e.status, Status::Unavailable | Status::NotFound),
        "{e}"
    );
    drop(first);
    let c = node.connect(&new).unwrap();
    c.call("sleep", ms(0)).unwrap();
    drop((c, idle));
    drop(node);
    stop_all(vec![b], &tp);
}

/// A rolling restart across processes: the old server drains while a new
/// process takes the name. The call in progress completes on the old one;
/// a request the old one refuses, or never takes, is sent again to the
/// new one, and the calls after go to the new process: no call fails.
#[test]
fn a_rolling_restart_across_processes_loses_no_call() {
    let tp = pool();
    let name = format!("mp/rolling/{}", std::process::id());
    let mut old = Agent::serve(&tp, &name, &[]);
    let node = node(&tp);
    let c = node.connect(&name).unwrap();
    let successor = std::thread::scope(|s| {
        let c2 = c.clone();
        let running = s.spawn(move || c2.call("sleep", ms(800)));
        std::thread::sleep(Duration::from_millis(100));
        old.say("drain");
        // Unregistered at once: the successor can take the name.
        let until = Instant::now() + Duration::from_secs(5);
        while node.pool().lookup(&name).unwrap().is_some() {
            assert!(Instant::now() < until, "still registered");
            std::thread::sleep(Duration::from_millis(2));
        }
        let successor = Agent::serve(&tp, &name, &[]);
        let mut refused = 0;
        for len in [10usize, 100_000, 10, 100_000] {
            match c.call("hop", pattern(len)) {
                Ok(p) => {
                    let got = p.to_vec().unwrap();
                    assert_eq!(hash_in(&got), hash(&pattern(len)));
                }
                Err(e) => {
                    assert_eq!(e.status, Status::Unavailable, "{e}");
                    refused += 1;
                }
            }
        }
        // A refused request is sent again to the new process, and so is
        // one sent as the old one stops (its drain done: here right after
        // the call in progress), which it never took: it says so as it
        // closes the connection (the go-away).
        assert_eq!(refused, 0, "{refused} calls failed");
        assert_eq!(c.reconnects(), 1);
        // The call in progress completed on the old server.
        running.join().unwrap().unwrap();
        assert_eq!(old.line(), "drained");
        successor
    });
    drop(c);
    drop(node);
    stop_all(vec![old, successor], &tp);
}

/// Restarts under load: three threads call the service (small requests
/// inline, large ones by Ref) while its process is replaced four times,
/// in turn gracefully (the new process takes the name during the drain)
/// and at once (the old one stops, then the new one starts; calls wait
/// for ready). No call fails, and every answer is right: each request is
/// run by the old process, or refused by it, or never taken by it (and
/// told so), and then run by the new one.
#[test]
fn restarts_under_load_lose_no_call() {
    use std::sync::atomic::AtomicBool;
    let tp = pool();
    let name = format!("mp/restarts/{}", std::process::id());
    let mut current = Some(Agent::serve(&tp, &name, &[]));
    let node = node(&tp);
    let c = node.connect(&name).unwrap();
    let done = AtomicBool::new(false);
    let opts = CallOptions::deadline(Duration::from_secs(20)).wait_for_ready();
    let calls = std::thread::scope(|s| {
        let workers = load(s, &done, |arg| c.call_with("hop", arg, opts));
        for round in 0..4u32 {
            std::thread::sleep(Duration::from_millis(150));
            if round.is_multiple_of(2) {
                current.as_mut().unwrap().say("drain");
                let until = Instant::now() + Duration::from_secs(5);
                while node.pool().lookup(&name).unwrap().is_some() {
                    assert!(Instant::now() < until, "still registered");
                    std::thread::sleep(Duration::from_millis(1));
                }
                let next = Agent::serve(&tp, &name, &[]);
                let mut old = current.replace(next).unwrap();
                assert_eq!(old.line(), "drained");
                old.stop();
            } else {
                // (Stopped in the other thread, so that the successor
                // starts as soon as the name is free.)
                let old = current.take().unwrap();
                let stopping = s.spawn(move || old.stop());
                let until = Instant::now() + Duration::from_secs(5);
                while node.pool().lookup(&name).unwrap().is_some() {
                    assert!(Instant::now() < until, "still registered");
                    std::thread::sleep(Duration::from_millis(1));
                }
                current = Some(Agent::serve(&tp, &name, &[]));
                stopping.join().unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(150));
        stop_load(&done, workers)
    });
    assert!(calls > 100, "only {calls} calls");
    assert_eq!(c.reconnects(), 4);
    drop(c);
    drop(node);
    stop_all(current.into_iter().collect(), &tp);
}

/// Replicas in three processes behind one name: a balanced client's calls
/// spread over them evenly; then, under load from three threads (small
/// requests inline, large ones by Ref, idempotent), each replica in turn
/// is restarted gracefully (its successor joins at once: replicas share
/// the name) and one is killed with `kill -9`. No call fails: what a
/// stopping replica refused or never took, and what the killed one had
/// in flight, goes to another replica.
#[test]
fn replicas_in_three_processes_share_calls_and_survive_restarts_and_a_kill() {
    replicas_survive(&["--replica"]);
}

/// The same over TCP, where a killed replica's connection breaks at once,
/// while it is still registered (until its lease ends): the calls it had
/// go to a live replica, not to its address again.
#[test]
fn tcp_replicas_in_three_processes_share_calls_and_survive_restarts_and_a_kill() {
    replicas_survive(&["--replica", "--tcp"]);
}

fn replicas_survive(how: &[&str]) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let tp = pool();
    let name = format!("mp/replicas/{}/{}", std::process::id(), how.len());
    let mut agents: Vec<Agent> = (0..3).map(|_| Agent::serve(&tp, &name, how)).collect();
    let node = node(&tp);
    let c = node.connect_balanced(&name).unwrap();
    assert_eq!(c.replicas(), 3);
    let pid_of = |got: &[u8]| u32::from_le_bytes(got[8..12].try_into().unwrap());
    let mut per_pid = std::collections::HashMap::new();
    for _ in 0..90 {
        let got = c.call("hop", pattern(10)).unwrap().to_vec().unwrap();
        *per_pid.entry(pid_of(&got)).or_insert(0) += 1;
    }
    let mut pids: Vec<u32> = agents.iter().map(Agent::pid).collect();
    pids.sort_unstable();
    let mut seen: Vec<u32> = per_pid.keys().copied().collect();
    seen.sort_unstable();
    assert_eq!(seen, pids);
    assert!(per_pid.values().all(|&n| n == 30), "{per_pid:?}");

    let done = AtomicBool::new(false);
    let opts = CallOptions::deadline(Duration::from_secs(20)).idempotent();
    let calls = std::thread::scope(|s| {
        let workers = load(s, &done, |arg| c.call_with("hop", arg, opts));
        // (Stops the load on a failed assertion too, rather than hang.)
        struct StopOnDrop<'a>(&'a AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let _stop = StopOnDrop(&done);
        // A rolling restart: each replica drains while its successor
        // serves beside the others.
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(100));
            let mut old = agents.remove(0);
            old.say("drain");
            agents.push(Agent::serve(&tp, &name, how));
            assert_eq!(old.line(), "drained");
            old.stop();
        }
        // One is killed mid-load: the first registration, which a client
        // that lost it would find first when it looks the name up again.
        std::thread::sleep(Duration::from_millis(100));
        let first = node.pool().lookup_all(&name).unwrap()[0].pid;
        let k = agents.iter().position(|a| a.pid() == first).unwrap();
        agents.remove(k).kill9();
        std::thread::sleep(Duration::from_millis(800));
        stop_load(&done, workers)
    });
    assert!(calls > 100, "only {calls} calls");
    // After its lease, the killed replica is gone from the set.
    std::thread::sleep(Duration::from_millis(500));
    node.pool().maintain().unwrap();
    c.refresh();
    assert_eq!(c.replicas(), 2);
    let mut left: Vec<u32> = agents.iter().map(Agent::pid).collect();
    left.sort_unstable();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..10 {
        let got = c.call("hop", pattern(10)).unwrap().to_vec().unwrap();
        seen.insert(pid_of(&got));
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), left);
    drop(c);
    drop(node);
    stop_all(agents, &tp);
}

/// The argument of an agent's `items` stream.
fn items_arg(n: u32, len: u32, ms: u32) -> Vec<u8> {
    [n, len, ms].iter().flat_map(|w| w.to_le_bytes()).collect()
}

#[test]
fn a_stream_from_another_process_carries_items_inline_and_by_ref() {
    let tp = pool();
    let name = format!("mp/streamer/{}", std::process::id());
    let server = Agent::serve(&tp, &name, &[]);
    let node = node(&tp);
    let c = node.connect(&name).unwrap();
    let cases = [(50u32, 100u32), (20, 1 << 20)];
    for (method, (n, len)) in ["items", "items_async"]
        .iter()
        .flat_map(|m| cases.map(|x| (m, x)))
    {
        let st = c.call_stream(method, items_arg(n, len, 0)).unwrap();
        let mut k = 0u32;
        for item in st {
            let item = item.unwrap();
            assert_eq!(item.len(), len as u64);
            assert_eq!(item.in_pool(), len > 64 << 10, "large items by Ref");
            let v = item.to_vec().unwrap();
            assert_eq!(v[0], k as u8);
            assert_eq!(
                v[1..],
                (1..len as usize).map(|i| i as u8).collect::<Vec<_>>()
            );
            k += 1;
        }
        assert_eq!(k, n);
    }
    drop(c);
    drop(node);
    server.stop();
    settle(&tp);
}

#[test]
fn server_killed_mid_stream_ends_it_with_unavailable() {
    server_killed_mid_stream(&[], "items");
    server_killed_mid_stream(&[], "items_async");
}

#[test]
fn tcp_server_killed_mid_stream_ends_it_with_unavailable() {
    server_killed_mid_stream(&["--tcp"], "items");
    server_killed_mid_stream(&["--tcp"], "items_async");
}

fn server_killed_mid_stream(transport: &[&str], method: &str) {
    let tp = pool();
    let name = format!(
        "mp/stream-victim/{}/{}",
        std::process::id(),
        transport.len()
    );
    let server = Agent::serve(&tp, &name, transport);
    let node = node(&tp);
    let c = node.connect(&name).unwrap();
    // Items of 200 KiB (by Ref over shm), one every 5 ms.
    let mut st = c
        .call_stream(method, items_arg(100_000, 200 << 10, 5))
        .unwrap();
    for _ in 0..5 {
        st.next().unwrap().unwrap();
    }
    server.kill9();
    let t0 = Instant::now();
    let end = loop {
        match st.next() {
            Some(Ok(_)) => assert!(t0.elapsed() < Duration::from_secs(3), "items go on"),
            Some(Err(e)) => break e,
            None => panic!("a killed server's stream ended well"),
        }
    };
    assert_eq!(end.status, Status::Unavailable, "{method}: {end}");
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "{method}: noticed after {:?}",
        t0.elapsed()
    );
    assert!(st.next().is_none());
    drop(st);
    drop(c);
    drop(node);
    settle(&tp);
}

/// The same with an async caller: its pending `next` ends with
/// `Unavailable` (the pump, or the liveness check, sees the server gone).
#[test]
fn server_killed_mid_async_stream_ends_it_with_unavailable() {
    for transport in [&[][..], &["--tcp"][..]] {
        let tp = pool();
        let name = format!(
            "mp/astream-victim/{}/{}",
            std::process::id(),
            transport.len()
        );
        let server = Agent::serve(&tp, &name, transport);
        let node = node(&tp);
        let c = node.connect_async(&name).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (end, took) = rt.block_on(async {
            let arg = items_arg(100_000, 200 << 10, 5);
            let mut st = c.call_stream("items", arg).await.unwrap();
            for _ in 0..5 {
                st.next().await.unwrap().unwrap();
            }
            server.kill9();
            let t0 = Instant::now();
            let end = loop {
                match st.next().await {
                    Some(Ok(_)) => assert!(t0.elapsed() < Duration::from_secs(3), "items go on"),
                    Some(Err(e)) => break e,
                    None => panic!("a killed server's stream ended well"),
                }
            };
            assert!(st.next().await.is_none());
            (end, t0.elapsed())
        });
        assert_eq!(end.status, Status::Unavailable, "{transport:?}: {end}");
        assert!(took < Duration::from_secs(3), "noticed after {took:?}");
        drop(c);
        drop(rt);
        drop(node);
        settle(&tp);
    }
}

#[test]
fn client_killed_mid_stream_does_not_disturb_the_server() {
    client_killed_mid_stream("items");
}

/// The same with an async streaming handler: the server serves on at
/// once, and ends the stream (releasing the items it queued) when it sees
/// the caller gone.
#[test]
fn client_killed_mid_async_stream_does_not_disturb_the_server() {
    client_killed_mid_stream("items_async");
}

fn client_killed_mid_stream(method: &str) {
    let tp = pool();
    let name = format!("mp/stream-survivor/{}/{method}", std::process::id());
    let server = Agent::serve(&tp, &name, &[]);
    // A client that opens an endless stream of items by Ref, reads one
    // and stops reading: the server waits for it to grant more.
    let args = [
        "stream", &name, "1000000", "100000", "--method", method, "--lease", "400",
    ];
    let mut victim = Agent::start(&tp, &args);
    assert_eq!(victim.line(), "reading");
    std::thread::sleep(Duration::from_millis(50));
    victim.kill9();
    // The server notices, ends that stream, and serves the others.
    let node = node(&tp);
    let c = node.connect(&name).unwrap();
    let t0 = Instant::now();
    let o = CallOptions::deadline(Duration::from_secs(10));
    let got = c
        .call_with("hop", Payload::from_vec(pattern(1000)), o)
        .unwrap()
        .to_vec()
        .unwrap();
    assert_eq!(hash_in(&got), hash(&pattern(1000)));
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "served after {:?}",
        t0.elapsed()
    );
    // The victim's stream ended (its handler returned, or its future
    // was dropped).
    let running = || {
        let n = c.call("streams", vec![]).unwrap().to_vec().unwrap();
        u64::from_le_bytes(n.try_into().unwrap())
    };
    while running() != 0 {
        assert!(t0.elapsed() < Duration::from_secs(5), "{method} still runs");
        std::thread::sleep(Duration::from_millis(5));
    }
    let st = c.call_stream(method, items_arg(3, 10, 0)).unwrap();
    assert_eq!(st.map(Result::unwrap).count(), 3);
    drop(c);
    drop(node);
    server.stop();
    settle(&tp);
}

/// Whether process `pid` is a zombie: dead, and not yet reaped.
fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// A supervisor restarts a killed service at once, with a lease much
/// longer than the restart: the new process takes the name as soon as the
/// old one's death is observable (reaped by its parent, or a zombie not
/// yet reaped), and the client calls it. While the old process lived, a
/// new one was refused with `AlreadyExists` naming it, and one that asked
/// to wait for the name got it when the old one died.
fn restart_at_once(reaped: bool) {
    let tp = pool();
    let name = format!("mp/restart/{}/{reaped}", std::process::id());
    let long = ["--lease", "5000"];
    let mut old = Agent::start(&tp, &[&["serve", &name], &long[..]].concat());
    assert_eq!(old.line(), "ready");
    let node = node(&tp);
    let c = node.connect(&name).unwrap();
    assert_eq!(
        hash_in(&c.call("hop", pattern(10)).unwrap().to_vec().unwrap()),
        hash(&pattern(10))
    );
    // The name is held: refused, naming the holder and what to do.
    let mut refused = Agent::start(&tp, &[&["serve", &name], &long[..]].concat());
    let said = refused.line();
    assert!(
        said.starts_with("err AlreadyExists")
            && said.contains(&format!("process {}", old.pid()))
            && said.contains("wait_for_name"),
        "{said}"
    );
    assert!(!refused.child.wait().unwrap().success());
    // One that waits for the name (a rolling restart) gets it later.
    let mut waiting = Agent::start(
        &tp,
        &[&["serve", &name, "--wait-name", "30000"], &long[..]].concat(),
    );
    std::thread::sleep(Duration::from_millis(50));
    // The old one is killed; its parent reaps it at once, or not yet.
    old.child.kill().unwrap();
    if reaped {
        old.child.wait().unwrap();
    } else {
        let until = Instant::now() + Duration::from_secs(5);
        while !is_zombie(old.pid()) {
            assert!(Instant::now() < until, "not a zombie");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let dead = Instant::now();
    assert_eq!(waiting.line(), "ready", "the waiting successor");
    let took = dead.elapsed();
    eprintln!("reaped {reaped}: the waiting successor served {took:?} after the death");
    // Far below the 5 s lease: it did not wait for the lease to run out.
    assert!(
        took < Duration::from_millis(2500),
        "took the name after {took:?}"
    );
    // The client reconnects to the successor.
    let until = Instant::now() + Duration::from_secs(5);
    let got = hop_until_served(&c, 100_000, until);
    assert_eq!(hash_in(&got), hash(&pattern(100_000)));
    assert_eq!(
        u32::from_le_bytes(got[8..12].try_into().unwrap()),
        waiting.pid()
    );
    // Killed again, and a successor started right after, asking no wait.
    let gone = waiting.pid();
    waiting.child.kill().unwrap();
    if reaped {
        waiting.child.wait().unwrap();
    } else {
        while !is_zombie(gone) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let mut third = Agent::start(&tp, &[&["serve", &name], &long[..]].concat());
    assert_eq!(third.line(), "ready", "a restart right after a death");
    let got = hop_until_served(&c, 10, until);
    assert_eq!(
        u32::from_le_bytes(got[8..12].try_into().unwrap()),
        third.pid()
    );
    drop(c);
    drop(node);
    drop((old, waiting));
    third.stop();
    settle(&tp);
}

#[test]
fn a_service_killed_and_reaped_is_restarted_at_once() {
    restart_at_once(true);
}

#[test]
fn a_service_killed_and_not_yet_reaped_is_restarted_at_once() {
    restart_at_once(false);
}

/// A pool made for hundreds of processes and thousands of channels: 200
/// client processes, 10 connections each (a channel each), calling a
/// server all the while. A quarter of them are killed with kill -9, most
/// mid-call. The server goes on answering, the dead's slots and channels
/// are reclaimed, and once all have gone the pool is clean.
#[test]
fn hundreds_of_processes_on_thousands_of_channels_survive_kills() {
    const PROCS: usize = 200;
    const CONNS: usize = 10;
    const KILLED: usize = PROCS / 4;
    let tp = TempPool::with(PoolConfig {
        size: 256 << 20,
        slots: 512,
        channels: Some((PROCS * CONNS + 64) as u32),
        ring_size: 4096,
        lease_ms: 400,
        ..Default::default()
    });
    let node = node(&tp);
    let name = format!("mp/many/{}", std::process::id());
    let server = node
        .server(&name)
        .method_async("nap", |_| async {
            tokio::time::sleep(Duration::from_millis(2)).await;
            Ok(Payload::empty())
        })
        .spawn()
        .unwrap();
    let mut agents: Vec<Agent> = (0..PROCS)
        .map(|_| {
            Agent::start(
                &tp,
                &["many", &name, &CONNS.to_string(), "nap", "--lease", "400"],
            )
        })
        .collect();
    for a in agents.iter_mut() {
        assert_eq!(a.line(), format!("connected {CONNS}"));
    }
    let rep = node.pool().check();
    assert!(rep.ok(), "{:?}", rep.problems);
    assert_eq!(rep.channels, (PROCS * CONNS) as u64, "{rep:?}");
    assert_eq!(rep.slots_live, PROCS as u64 + 1);
    // Every agent is calling: kill a quarter (their calls are in flight).
    for a in agents.drain(..KILLED) {
        a.kill9();
    }
    // The server answers the living and a new client alike.
    let c = node.connect(&name).unwrap();
    for _ in 0..20 {
        c.call("nap", Payload::from_vec(vec![0; 8])).unwrap();
    }
    // The dead are reclaimed (by this process's lease thread, and here).
    let until = Instant::now() + Duration::from_secs(60);
    let rep = loop {
        node.pool().maintain().unwrap();
        let rep = node.pool().check();
        if rep.slots_dead == 0 && rep.channels == ((PROCS - KILLED) * CONNS + 1) as u64 {
            break rep;
        }
        assert!(
            Instant::now() < until,
            "the dead were not reclaimed: {rep:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(rep.ok(), "{:?}", rep.problems);
    assert_eq!(rep.slots_live, (PROCS - KILLED) as u64 + 1);
    drop(c);
    for a in agents {
        a.stop();
    }
    drop(server);
    drop(node);
    settle(&tp);
}

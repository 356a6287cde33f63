//! A nested-call chain through tier processes, for profiling what a hop
//! costs (`perf record -a -- target/release/examples/chain_loop 20000`;
//! env: TIERS (7), SIZE (65536), BYREF=1 (send it by Ref; else inline),
//! POLICY=spin|park|yield, CONC (1: calls in flight, from that many client
//! threads; above 1 the forwarding tiers serve with async handlers and
//! async clients, so calls overlap in every tier), OWN_CONN=1 (each client
//! thread with a connection of its own, as `dmrpc bench chain`'s; else
//! they share one), CLIENT=async (the CONC calls are tasks of one thread,
//! over one async connection), CLIENT_WAIT (the client's waiting policy
//! alone, as `DMRPC_WAIT`), ENTRY (the tier the client calls; 0),
//! RING_KIB (the rings' size), POOL_DIR (where the
//! pool file goes; default /dev/shm)). Tier k
//! forwards its payload to tier k+1 untouched; the last reads every byte
//! and answers 8 bytes. The tiers' nodes are configured as the bench's:
//! by Ref (BYREF=1) size-aware, so the last answers inline; by value,
//! everything inline.
#![allow(clippy::unwrap_used)]

#[cfg(not(loom))]
mod common;

#[cfg(loom)]
fn main() {}

#[cfg(not(loom))]
fn main() {
    use dm_pool::{AttachOptions, Pool};
    use dm_rpc::{Node, Payload};
    use std::time::Instant;
    let args: Vec<String> = std::env::args().collect();
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(d)
    };
    let wait = common::wait_policy();
    let by_ref = std::env::var("BYREF").is_ok_and(|v| v == "1");
    let cfg = dm_rpc::Config {
        wait,
        inline_max: if by_ref { 0 } else { 16 << 20 },
        ..Default::default()
    };
    let tiers = env("TIERS", 7);
    if args.get(1).map(String::as_str) == Some("tier") {
        let pool = Pool::open(args[2].as_ref(), AttachOptions::default()).unwrap();
        let k: usize = args[3].parse().unwrap();
        // As `dmrpc bench chain`'s tiers: by Ref, size-aware (they forward
        // the Ref they got, and the last answers its 8 bytes inline); by
        // value, everything inline.
        let tier_cfg = dm_rpc::Config {
            inline_max: if by_ref {
                dm_rpc::Config::default().inline_max
            } else {
                cfg.inline_max
            },
            ..cfg
        };
        let node = Node::with_config(pool, tier_cfg);
        let n = node.clone();
        let next: std::sync::Arc<str> = format!("profile/chain/{}", k + 1).into();
        let cl = std::sync::OnceLock::new();
        if (env("CONC", 1) > 1 || env("ASYNC", 0) == 1) && k + 1 < tiers {
            let acl = std::sync::Arc::new(std::sync::OnceLock::new());
            let n2 = node.clone();
            let s = node
                .server(&format!("profile/chain/{k}"))
                .method_async("go", move |c| {
                    let acl = acl.clone();
                    let n2 = n2.clone();
                    let next = next.clone();
                    async move {
                        let cl: &dm_rpc::AsyncClient =
                            acl.get_or_init(|| n2.connect_async(&next).unwrap());
                        cl.call("go", c.payload.forward()?).await
                    }
                })
                .spawn()
                .unwrap();
            common::ready_until_stdin_closes();
            s.shutdown();
            return;
        }
        let s = node
            .server(&format!("profile/chain/{k}"))
            .method("go", move |c| {
                if k + 1 == tiers {
                    let mut sum = 0u64;
                    for s in c.payload().segments()? {
                        // By 8-byte words, as `dmrpc bench chain`'s last tier.
                        let mut words = s.chunks_exact(8);
                        sum = words.by_ref().fold(sum, |a, w| {
                            a.wrapping_add(u64::from_le_bytes(w.try_into().unwrap()))
                        });
                        sum = words
                            .remainder()
                            .iter()
                            .fold(sum, |a, &b| a.wrapping_add(b as u64));
                    }
                    return Ok(Payload::from_vec(sum.to_le_bytes().to_vec()));
                }
                let cl: &dm_rpc::Client = cl.get_or_init(|| n.connect(&next).unwrap());
                cl.call("go", c.payload().forward()?)
            })
            .spawn()
            .unwrap();
        common::ready_until_stdin_closes();
        s.shutdown();
        return;
    }
    let n: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let path = common::create_pool("chain-loop", 1 << 30);
    let children: Vec<_> = (0..tiers)
        .map(|k| common::spawn_peer(&["tier", &path, &k.to_string()]))
        .collect();
    // CLIENT_WAIT: the client's waiting policy alone, as `DMRPC_WAIT`.
    let client_cfg = dm_rpc::Config {
        wait: std::env::var("CLIENT_WAIT")
            .ok()
            .and_then(|v| dm_rpc::WaitPolicy::parse(&v))
            .unwrap_or(cfg.wait),
        ..cfg
    };
    let node = Node::with_config(
        Pool::open(path.as_ref(), AttachOptions::default()).unwrap(),
        client_cfg,
    );
    // ENTRY: the tier the client calls (default 0): as `dmrpc bench
    // chain`, a chain of fewer tiers runs through the last ones while the
    // others stay idle.
    let entry = format!("profile/chain/{}", env("ENTRY", 0));
    let c = node.connect(&entry).unwrap();
    let size = env("SIZE", 65536);
    let data = vec![5u8; size];
    let call = || c.call("go", payload(&node, &data, by_ref)).unwrap();
    for _ in 0..n / 10 {
        call();
    }
    let conc = env("CONC", 1);
    let pids: Vec<u32> = std::iter::once(std::process::id())
        .chain(children.iter().map(std::process::Child::id))
        .collect();
    let switches = || dm_sys::proc::context_switches_of(&pids);
    let sw0 = switches();
    let t = Instant::now();
    let sw_end = if std::env::var("CLIENT").is_ok_and(|v| v == "async") {
        // CLIENT=async: the CONC calls in flight are tasks of one thread
        // (a current-thread runtime), over one async connection.
        let ac = node.connect_async(&entry).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let tasks: Vec<_> = (0..conc)
                .map(|_| {
                    let (ac, node, data) = (ac.clone(), node.clone(), data.clone());
                    tokio::spawn(async move {
                        for _ in 0..n / conc as u64 {
                            let p = payload(&node, &data, by_ref);
                            ac.call("go", p).await.unwrap();
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
        });
        switches()
    } else {
        // OWN_CONN=1: each thread calls over a connection of its own (as
        // `dmrpc bench chain`'s client threads), else all share one.
        // The switches are read while every thread is alive: one that
        // ended takes its count with it.
        let own = std::env::var("OWN_CONN").is_ok_and(|v| v == "1");
        let end = std::sync::Barrier::new(conc);
        let sw1 = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..conc {
                s.spawn(|| {
                    let mine = own.then(|| node.connect(&entry).unwrap());
                    let c = mine.as_ref().unwrap_or(&c);
                    for _ in 0..n / conc as u64 {
                        c.call("go", payload(&node, &data, by_ref)).unwrap();
                    }
                    if end.wait().is_leader() {
                        sw1.store(switches(), std::sync::atomic::Ordering::Relaxed);
                    }
                });
            }
        });
        sw1.into_inner()
    };
    let per = t.elapsed().as_nanos() as f64 / n as f64;
    let sw = sw_end.saturating_sub(sw0) as f64 / n as f64;
    println!("{per:.0} ns per call through {tiers} tiers ({size} bytes, by_ref {by_ref}, {conc} in flight), {sw:.1} context switches per call");
    drop(c);
    for ch in children {
        common::stop_peer(ch);
    }
    let _ = std::fs::remove_file(&path);
}

/// A request of `data`: written to the pool (`by_ref`), else inline.
#[cfg(not(loom))]
fn payload(node: &dm_rpc::Node, data: &[u8], by_ref: bool) -> dm_rpc::Payload {
    if by_ref {
        let mut b = node.pool().alloc(data.len() as u64).unwrap();
        b.write(0, data).unwrap();
        dm_rpc::Payload::from_buffer(b)
    } else {
        dm_rpc::Payload::from_vec(data.to_vec())
    }
}

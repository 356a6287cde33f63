//! dmrpc nodes on separate pools (as on separate hosts) finding each
//! other's TCP services through etcd: balanced clients follow replicas
//! that join and leave by the watch, at their next call, not at the next
//! poll; each pool ends clean.
#![allow(clippy::unwrap_used)]

use dm_etcd::{EtcdCluster, EtcdConfig, EtcdRegistry};
use dm_pool::testing::TempPool;
use dm_rpc::{Node, Payload, Registry, Server, Transport};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn node(tp: &TempPool, c: &EtcdCluster) -> (Node, EtcdRegistry) {
    let mut cfg = EtcdConfig::new(&c.endpoints());
    cfg.prefix = "/balanced".into();
    cfg.pool = Some(tp.path.display().to_string());
    let reg = EtcdRegistry::connect(cfg).unwrap();
    let n = Node::new(tp.attach()).with_registry(Arc::new(reg.clone()));
    (n, reg)
}

fn replica(n: &Node, tag: u8) -> Server {
    n.server("kv")
        .transport(Transport::Tcp("127.0.0.1:0".into()))
        .replica()
        .method("who", move |_| Ok(Payload::from_vec(vec![tag])))
        .spawn()
        .unwrap()
}

#[test]
fn balanced_clients_follow_replicas_by_the_watch() {
    let dir = std::env::temp_dir().join(format!("dm-etcd-bal-{}", std::process::id()));
    let c = EtcdCluster::start(1, &dir).unwrap();
    let pools: Vec<TempPool> = (0..3).map(|_| TempPool::new(64 << 20)).collect();
    {
        let (client, creg) = node(&pools[0], &c);
        let (host1, _) = node(&pools[1], &c);
        let (host2, _) = node(&pools[2], &c);
        let s1 = replica(&host1, 1);
        let bc = client.connect_balanced("kv").unwrap();
        assert_eq!(bc.replicas(), 1);
        let w = creg.changes("kv").unwrap();
        let who =
            |bc: &dm_rpc::BalancedClient| bc.call("who", vec![]).unwrap().to_vec().unwrap()[0];
        // Calls for a while: the periodic look has just been, or not.
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(600) {
            assert_eq!(who(&bc), 1);
        }
        // A replica joins on another host: once the watch has seen it,
        // the next call looks, and the one after can go there.
        let v = w.load(Ordering::Acquire);
        let s2 = replica(&host2, 2);
        let seen = Instant::now();
        while w.load(Ordering::Acquire) == v {
            assert!(seen.elapsed() < Duration::from_secs(5), "no watch event");
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut got = [who(&bc), who(&bc)];
        got.sort_unstable();
        assert_eq!(got, [1, 2], "both replicas get calls at once");
        assert_eq!(bc.replicas(), 2);
        // One leaves (its registration first, then its listener).
        let v = w.load(Ordering::Acquire);
        drop(s1);
        while w.load(Ordering::Acquire) == v {
            assert!(seen.elapsed() < Duration::from_secs(5), "no watch event");
            std::thread::sleep(Duration::from_millis(1));
        }
        for _ in 0..4 {
            assert_eq!(who(&bc), 2);
        }
        assert_eq!(bc.replicas(), 1);
        drop((bc, s2));
    }
    for p in &pools {
        p.assert_clean_within(Duration::from_secs(2));
    }
}

#[test]
fn shared_memory_services_are_listed_in_etcd_and_claim_nothing() {
    // A service over shared memory is listed with its pool and host, and
    // goes with its server; lookups leave it out (it is found in its
    // pool), and the same name elsewhere does not clash with it.
    let dir = std::env::temp_dir().join(format!("dm-etcd-local-{}", std::process::id()));
    let c = EtcdCluster::start(1, &dir).unwrap();
    let pools: Vec<TempPool> = (0..2).map(|_| TempPool::new(64 << 20)).collect();
    {
        let (a, areg) = node(&pools[0], &c);
        let (b, _) = node(&pools[1], &c);
        let local = a
            .server("cache")
            .transport(Transport::Shm)
            .method("who", |_| Ok(Payload::from_vec(vec![0])))
            .spawn()
            .unwrap();
        let listed = areg.list().unwrap();
        assert_eq!(listed.len(), 1, "{listed:?}");
        assert_eq!(listed[0].endpoint, dm_pool::Endpoint::Shm);
        assert!(
            listed[0]
                .owner
                .contains(&pools[0].path.display().to_string()),
            "{listed:?}"
        );
        assert!(areg.lookup_all("cache").unwrap().is_empty());
        // Another host's own "cache" (shared memory, then TCP) registers.
        let other = b
            .server("cache")
            .transport(Transport::Shm)
            .method("who", |_| Ok(Payload::from_vec(vec![1])))
            .spawn()
            .unwrap();
        let tcp = b
            .server("cache")
            .transport(Transport::Tcp("127.0.0.1:0".into()))
            .method("who", |_| Ok(Payload::from_vec(vec![2])))
            .spawn()
            .unwrap();
        assert_eq!(areg.list().unwrap().len(), 3);
        // A client on pool 0 reaches its own over shared memory.
        let cl = a.connect("cache").unwrap();
        assert_eq!(cl.call("who", vec![]).unwrap().to_vec().unwrap(), [0]);
        drop(cl);
        drop((local, other, tcp));
        assert!(areg.list().unwrap().is_empty());
    }
    for p in &pools {
        p.assert_clean_within(Duration::from_secs(2));
    }
}

//! The registry chosen by configuration: the pool's without DMRPC_ETCD,
//! etcd's with it. (A test binary of its own: it sets the environment.)
#![allow(clippy::unwrap_used)]

use dm_etcd::{registry_from_env, EtcdCluster, EtcdConfig, EtcdRegistry, ETCD_ENV};
use dm_pool::testing::TempPool;
use dm_pool::Endpoint;
use dm_rpc::Registry;

#[test]
fn the_environment_chooses_etcd_or_the_pool() {
    let tp = TempPool::new(16 << 20);
    let pool = tp.attach();
    std::env::remove_var(ETCD_ENV);
    let local = registry_from_env(&pool).unwrap();
    let r = local
        .register("env/a", &Endpoint::Tcp("127.0.0.1:9".into()))
        .unwrap();
    assert_eq!(pool.lookup("env/a").unwrap().unwrap().name, "env/a");
    local.unregister(&r).unwrap();
    let dir = std::env::temp_dir().join(format!("dm-etcd-env-{}", std::process::id()));
    let c = EtcdCluster::start(1, &dir).unwrap();
    std::env::set_var(ETCD_ENV, c.endpoints().join(","));
    let remote = registry_from_env(&pool).unwrap();
    remote
        .register("env/b", &Endpoint::Tcp("127.0.0.1:9".into()))
        .unwrap();
    assert!(pool.lookup("env/b").unwrap().is_none(), "not in the pool");
    let other = EtcdRegistry::connect(EtcdConfig::new(&c.endpoints())).unwrap();
    let e = other.lookup("env/b").unwrap().unwrap();
    assert_eq!(e.endpoint, Endpoint::Tcp("127.0.0.1:9".into()));
    std::env::remove_var(ETCD_ENV);
    drop((remote, local, pool));
    tp.assert_clean();
}

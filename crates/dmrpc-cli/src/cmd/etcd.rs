//! Where the CLI finds etcd: `--etcd ENDPOINTS`, else the DMRPC_ETCD
//! environment variable.

use dm_etcd::{parse_endpoints, EtcdConfig};

/// The etcd configuration of `flag` (comma-separated endpoints), else of
/// the environment; `None` if neither names any.
pub fn config(flag: Option<&str>) -> Option<EtcdConfig> {
    match flag {
        Some(f) => {
            let eps = parse_endpoints(f);
            (!eps.is_empty()).then(|| EtcdConfig::new(&eps))
        }
        None => EtcdConfig::from_env(),
    }
}

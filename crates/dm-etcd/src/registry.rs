//! [`EtcdRegistry`]: dmrpc's [`Registry`] on etcd.
//!
//! A process connects once, is granted a lease of [`EtcdConfig::lease`],
//! and keeps it alive from a thread of its own (a keep-alive every third
//! of it). Every registration it makes lives under that lease: a process
//! that dies, or is cut off from etcd for longer than the lease, loses its
//! names when the lease runs out. One whose lease ran out while it lived
//! (etcd unreachable for a while) is granted a new one and registers its
//! names again. Dropping the last handle revokes the lease: the names go
//! at once.
//!
//! Lookups read etcd (linearizable reads). A name can be watched
//! ([`Registry::changes`]): a counter that moves on every change of its
//! registrations, which balanced clients check on each call, so a replica
//! that joins or leaves reaches them as an event, not at the next poll.

use crate::keys::{Keys, Kind, MemserverRecord, Record};
use dm_pool::Endpoint;
use dm_rpc::{Registration, Registry, RpcError, ServiceEntry};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    WatchOptions,
};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Environment variable naming etcd's endpoints (comma separated), read
/// by [`EtcdConfig::from_env`] and the `dmrpc` CLI.
pub const ETCD_ENV: &str = "DMRPC_ETCD";

/// How to reach etcd, and how this process appears there.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// etcd's client endpoints (`http://10.99.0.1:2379`, or `host:port`).
    pub endpoints: Vec<String>,
    /// Where this registry's keys start (`/dmrpc`): registries with other
    /// prefixes share an etcd cluster without seeing each other.
    pub prefix: String,
    /// The lease: a process silent for this long loses its names.
    pub lease: Duration,
    /// The longest wait for an answer of etcd.
    pub timeout: Duration,
    /// This host's name, as its registrations show it.
    pub host: String,
    /// The pool this process is attached to, as its registrations show it.
    pub pool: Option<String>,
}

impl EtcdConfig {
    /// The defaults for `endpoints`: prefix `/dmrpc`, a lease of 3 s, a
    /// timeout of 2 s, this host's name.
    pub fn new<S: AsRef<str>>(endpoints: &[S]) -> EtcdConfig {
        EtcdConfig {
            endpoints: endpoints.iter().map(|e| e.as_ref().to_owned()).collect(),
            prefix: "/dmrpc".to_owned(),
            lease: Duration::from_secs(3),
            timeout: Duration::from_secs(2),
            host: host_name(),
            pool: None,
        }
    }

    /// The defaults for the endpoints in [`ETCD_ENV`], if it is set.
    pub fn from_env() -> Option<EtcdConfig> {
        let v = std::env::var(ETCD_ENV).ok()?;
        let eps = parse_endpoints(&v);
        (!eps.is_empty()).then(|| EtcdConfig::new(&eps))
    }
}

/// The registry a node of `pool` uses by configuration: etcd's when
/// [`ETCD_ENV`] names its endpoints, else the pool's own. So the same
/// program runs on one host and across hosts.
pub fn registry_from_env(pool: &dm_pool::Pool) -> Result<Arc<dyn Registry>, RpcError> {
    Ok(match EtcdConfig::from_env() {
        Some(mut cfg) => {
            cfg.pool = Some(pool.path().display().to_string());
            Arc::new(EtcdRegistry::connect(cfg)?)
        }
        None => Arc::new(dm_rpc::PoolRegistry::new(pool.clone())),
    })
}

/// Endpoints from a comma-separated list.
pub fn parse_endpoints(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(str::to_owned)
        .collect()
}

/// This host's name (`uname -n`).
pub fn host_name() -> String {
    // SAFETY: `uname` fills the struct it is given; an all-zero utsname
    // is a valid value of it.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is a valid, writable utsname.
    if unsafe { libc::uname(&mut u) } != 0 {
        return "localhost".to_owned();
    }
    let b: Vec<u8> = u
        .nodename
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&b).into_owned()
}

/// Services' names and endpoints on etcd, under leases this process
/// keeps alive. Cheap to clone (one connection and one lease per
/// [`connect`](Self::connect)).
#[derive(Debug, Clone)]
pub struct EtcdRegistry {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    shared: Arc<Shared>,
    rt: Option<tokio::runtime::Runtime>,
    stop: tokio::sync::watch::Sender<bool>,
}

/// What the calls and the keep-alive task share.
struct Shared {
    client: Client,
    keys: Keys,
    cfg: EtcdConfig,
    /// The high half of every handle this registry gives (random).
    instance: u64,
    seq: AtomicU64,
    /// The lease the registrations are under now.
    lease: AtomicI64,
    /// This process's registrations (handle -> name, kind, value), put
    /// again under a new lease if the old one ran out.
    mine: Mutex<HashMap<u64, Held>>,
    /// Names watched, and their change counters.
    watched: Mutex<HashMap<String, Arc<AtomicU64>>>,
    /// Times the lease ran out while this process lived.
    regrants: AtomicU64,
}

/// A key and its value, as read from etcd.
type KeyValue = (Vec<u8>, Vec<u8>);

/// A registration of this process, as put in etcd.
#[derive(Debug, Clone)]
enum Held {
    /// A service's name, kind and record.
    Service(String, Kind, Vec<u8>),
    /// A memory server's zone and record.
    Memserver(String, Vec<u8>),
}

impl Held {
    fn key(&self, keys: &Keys, handle: u64) -> String {
        match self {
            Held::Service(name, kind, _) => keys.key(name, *kind, handle),
            Held::Memserver(zone, _) => keys.memserver(zone, handle),
        }
    }
}

/// Puts `held` under the current lease: a service as [`put_checked`]
/// does, a memory server as it is.
async fn put_held(s: &Shared, handle: u64, held: &Held) -> Result<(), RpcError> {
    match held {
        Held::Service(name, kind, value) => {
            put_checked(s, name, *kind, handle, value.clone()).await
        }
        Held::Memserver(_, value) => {
            let lease = s.lease.load(Ordering::Relaxed);
            let mut c = s.client.clone();
            c.put(
                held.key(&s.keys, handle),
                value.clone(),
                Some(PutOptions::new().with_lease(lease)),
            )
            .await
            .map_err(|e| unavailable(&s.cfg, e))?;
            Ok(())
        }
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("cfg", &self.cfg)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn unavailable(cfg: &EtcdConfig, e: impl std::fmt::Display) -> RpcError {
    RpcError::unavailable(format!("etcd at {}: {e}", cfg.endpoints.join(",")))
}

impl EtcdRegistry {
    /// Connects to etcd and is granted a lease. Fails with `Unavailable`
    /// if etcd does not answer within the timeout.
    pub fn connect(cfg: EtcdConfig) -> Result<EtcdRegistry, RpcError> {
        if cfg.endpoints.is_empty() {
            return Err(RpcError::invalid_argument("no etcd endpoint given"));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("dmrpc-etcd")
            .enable_all()
            .build()
            .map_err(|e| RpcError::internal(format!("etcd client runtime: {e}")))?;
        let c2 = cfg.clone();
        let (client, lease) = block(&rt, cfg.timeout * 2, async move {
            let opts = ConnectOptions::new()
                .with_connect_timeout(c2.timeout)
                .with_timeout(c2.timeout);
            let mut client = Client::connect(&c2.endpoints, Some(opts))
                .await
                .map_err(|e| unavailable(&c2, e))?;
            let ttl = c2.lease.as_secs().max(1) as i64;
            let l = client
                .lease_grant(ttl, None)
                .await
                .map_err(|e| unavailable(&c2, e))?;
            Ok((client, l.id()))
        })
        .map_err(|e| RpcError::unavailable(format!("{} (unreachable at startup)", e.message)))?;
        let shared = Arc::new(Shared {
            client,
            keys: Keys::new(&cfg.prefix),
            cfg,
            instance: dm_sys::rand::random_u64() & 0xFFFF_FFFF_0000_0000,
            seq: AtomicU64::new(1),
            lease: AtomicI64::new(lease),
            mine: Mutex::new(HashMap::new()),
            watched: Mutex::new(HashMap::new()),
            regrants: AtomicU64::new(0),
        });
        let (stop, stopped) = tokio::sync::watch::channel(false);
        rt.spawn(keep_alive(shared.clone(), stopped));
        Ok(EtcdRegistry {
            inner: Arc::new(Inner {
                shared,
                rt: Some(rt),
                stop,
            }),
        })
    }

    /// The configuration it was connected with.
    pub fn config(&self) -> &EtcdConfig {
        &self.inner.shared.cfg
    }

    /// The lease this process's registrations are under now.
    pub fn lease_id(&self) -> i64 {
        self.inner.shared.lease.load(Ordering::Relaxed)
    }

    /// How many times the lease ran out while this process lived (and its
    /// names were registered again under a new one).
    pub fn regrants(&self) -> u64 {
        self.inner.shared.regrants.load(Ordering::Relaxed)
    }

    /// Runs `f` on the registry's runtime with a client, within the
    /// timeout, and waits for it. An attempt that fails `Unavailable` is
    /// made again after a pause: the client spreads requests over the
    /// members, and one that is down refuses them (every request made
    /// here can be made twice).
    fn run<T: Send + 'static, F>(
        &self,
        f: impl Fn(Arc<Shared>) -> F + Send + 'static,
    ) -> Result<T, RpcError>
    where
        F: Future<Output = Result<T, RpcError>> + Send + 'static,
    {
        let s = self.inner.shared.clone();
        let t = s.cfg.timeout;
        let rt = self
            .inner
            .rt
            .as_ref()
            .ok_or_else(|| unavailable(&s.cfg, "closed"))?;
        let end = tokio::time::Instant::now() + t;
        let last = Arc::new(Mutex::new(None));
        let last2 = last.clone();
        let r = block(rt, t, async move {
            loop {
                match f(s.clone()).await {
                    Err(e) if e.status == dm_rpc::Status::Unavailable => {
                        *lock(&last2) = Some(e);
                        let pause = tokio::time::Instant::now() + Duration::from_millis(20);
                        if pause >= end {
                            return Err(lock(&last2)
                                .take()
                                .unwrap_or_else(|| RpcError::unavailable("no answer in time")));
                        }
                        tokio::time::sleep_until(pause).await;
                    }
                    r => return r,
                }
            }
        });
        // Out of time: the last attempt's error says more than the timeout.
        r.map_err(|e| lock(&last).take().unwrap_or(e))
    }

    fn record(&self, endpoint: &Endpoint) -> Vec<u8> {
        let c = &self.inner.shared.cfg;
        Record {
            endpoint: Record::endpoint_text(endpoint),
            host: c.host.clone(),
            pid: std::process::id(),
            pool: c.pool.clone(),
        }
        .encode()
    }

    fn add(&self, name: &str, endpoint: &Endpoint, kind: Kind) -> Result<Registration, RpcError> {
        dm_pool::validate_service_name(name)?;
        let s = &self.inner.shared;
        let handle = s.instance | s.seq.fetch_add(1, Ordering::Relaxed);
        let value = self.record(endpoint);
        self.hold(name, handle, Held::Service(name.to_owned(), kind, value))
    }

    /// Puts `held` in etcd and keeps it with this process's lease.
    fn hold(&self, name: &str, handle: u64, held: Held) -> Result<Registration, RpcError> {
        let h = held.clone();
        self.run(move |s| {
            let h = h.clone();
            async move { put_held(&s, handle, &h).await }
        })?;
        lock(&self.inner.shared.mine).insert(handle, held);
        Ok(Registration {
            name: name.to_owned(),
            handle,
        })
    }

    /// Registers a memory server this process serves at `addr` (of `size`
    /// bytes) in `zone`, for as long as this process's lease lives (or
    /// until [`unregister`](Registry::unregister)).
    pub fn register_memserver(
        &self,
        zone: &str,
        addr: &str,
        size: u64,
    ) -> Result<Registration, RpcError> {
        if !crate::keys::valid_zone(zone) {
            return Err(RpcError::invalid_argument(format!(
                "zone {zone:?}: 1 to 64 letters, digits, '_', '-' or '.'"
            )));
        }
        let s = &self.inner.shared;
        let handle = s.instance | s.seq.fetch_add(1, Ordering::Relaxed);
        let value = MemserverRecord {
            addr: addr.to_owned(),
            host: s.cfg.host.clone(),
            pid: std::process::id(),
            size,
        }
        .encode();
        if MemserverRecord::decode(&value).is_none() {
            return Err(RpcError::invalid_argument(format!(
                "{addr:?} is not a memory server's address (host:port)"
            )));
        }
        self.hold(
            &format!("memserver {addr}"),
            handle,
            Held::Memserver(zone.to_owned(), value),
        )
    }

    /// The memory servers registered in `zone` (`None`: in every zone),
    /// with their zones.
    pub fn memservers(
        &self,
        zone: Option<&str>,
    ) -> Result<Vec<(String, MemserverRecord)>, RpcError> {
        if zone.is_some_and(|z| !crate::keys::valid_zone(z)) {
            return Err(RpcError::invalid_argument(format!(
                "zone {zone:?}: not a zone name"
            )));
        }
        let prefix = self.inner.shared.keys.memservers(zone);
        let kvs = self.get_prefix(prefix)?;
        let keys = &self.inner.shared.keys;
        let mut v: Vec<_> = kvs
            .iter()
            .filter_map(|(k, val)| {
                let (zone, _) = keys.parse_memserver(k)?;
                Some((zone, MemserverRecord::decode(val)?))
            })
            .collect();
        v.sort_by(|a, b| (&a.0, &a.1.addr).cmp(&(&b.0, &b.1.addr)));
        Ok(v)
    }

    /// A client of every memory server registered in `zone` (`None`: in
    /// every zone), as one pool. `NotFound` if there is none.
    pub fn mem_pool(
        &self,
        zone: Option<&str>,
        cfg: dm_memserver::ClientConfig,
    ) -> Result<dm_memserver::MemPool, RpcError> {
        let addrs: Vec<String> = self
            .memservers(zone)?
            .into_iter()
            .map(|(_, r)| r.addr)
            .collect();
        if addrs.is_empty() {
            return Err(RpcError::not_found(match zone {
                Some(z) => format!("no memory server registered in zone {z:?}"),
                None => "no memory server registered".to_owned(),
            }));
        }
        Ok(dm_memserver::MemPool::connect_with(&addrs, cfg)?)
    }

    /// The keys and values under `prefix`.
    fn get_prefix(&self, prefix: String) -> Result<Vec<KeyValue>, RpcError> {
        self.run(move |s| {
            let prefix = prefix.clone();
            async move {
                let mut c = s.client.clone();
                let r = c
                    .get(prefix, Some(GetOptions::new().with_prefix()))
                    .await
                    .map_err(|e| unavailable(&s.cfg, e))?;
                Ok(r.kvs()
                    .iter()
                    .map(|kv| (kv.key().to_vec(), kv.value().to_vec()))
                    .collect::<Vec<_>>())
            }
        })
    }

    /// The services under `prefix`, with those reached only from their
    /// pool if `local`.
    fn entries(&self, prefix: String, local: bool) -> Result<Vec<ServiceEntry>, RpcError> {
        let kvs = self.get_prefix(prefix)?;
        let keys = &self.inner.shared.keys;
        Ok(kvs
            .iter()
            .filter_map(|(k, v)| {
                let (name, kind, handle) = keys.parse(k)?;
                if kind == Kind::Local && !local {
                    return None;
                }
                let r = Record::decode(v)?;
                Some(ServiceEntry {
                    name,
                    endpoint: r.endpoint()?,
                    owner: r.owner(),
                    live: true,
                    handle,
                })
            })
            .collect())
    }
}

/// Runs `fut` on `rt` and waits at most `t` for it, from any thread (one
/// inside another runtime included).
fn block<T: Send + 'static>(
    rt: &tokio::runtime::Runtime,
    t: Duration,
    fut: impl Future<Output = Result<T, RpcError>> + Send + 'static,
) -> Result<T, RpcError> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    rt.spawn(async move {
        let r = match tokio::time::timeout(t, fut).await {
            Ok(r) => r,
            Err(_) => Err(RpcError::unavailable(format!("no answer within {t:?}"))),
        };
        let _ = tx.send(r);
    });
    rx.recv()
        .unwrap_or_else(|_| Err(RpcError::unavailable("the etcd client stopped")))
}

/// Puts registration `handle` of `name` under the current lease, if its
/// kind allows: an exclusive one where `name` has no sole registration
/// or replica, a replica where it has no sole one, a local one always.
/// Else `AlreadyExists`, naming the holder.
async fn put_checked(
    s: &Shared,
    name: &str,
    kind: Kind,
    handle: u64,
    value: Vec<u8>,
) -> Result<(), RpcError> {
    let k = &s.keys;
    // The kinds that must be absent: a sole registration excludes every
    // other claim on the name, a replica a sole one; a local service
    // claims nothing.
    let guards: Vec<String> = match kind {
        Kind::Exclusive => vec![k.kind(name, Kind::Exclusive), k.kind(name, Kind::Replica)],
        Kind::Replica => vec![k.kind(name, Kind::Exclusive)],
        Kind::Local => Vec::new(),
    };
    let lease = s.lease.load(Ordering::Relaxed);
    let when: Vec<Compare> = guards
        .iter()
        .map(|g| Compare::create_revision(g.clone(), CompareOp::Equal, 0).with_prefix())
        .collect();
    let holders: Vec<TxnOp> = guards
        .iter()
        .map(|g| TxnOp::get(g.clone(), Some(GetOptions::new().with_prefix())))
        .collect();
    let txn = Txn::new()
        .when(when)
        .and_then([TxnOp::put(
            k.key(name, kind, handle),
            value,
            Some(PutOptions::new().with_lease(lease)),
        )])
        .or_else(holders);
    let mut c = s.client.clone();
    let r = c.txn(txn).await.map_err(|e| unavailable(&s.cfg, e))?;
    if r.succeeded() {
        return Ok(());
    }
    let ours = k.key(name, kind, handle);
    let mine = r.op_responses().into_iter().any(|op| match op {
        etcd_client::TxnOpResponse::Get(g) => g.kvs().iter().any(|kv| kv.key() == ours.as_bytes()),
        _ => false,
    });
    if mine {
        // An earlier attempt went in; its answer was lost.
        return Ok(());
    }
    let holder = r
        .op_responses()
        .into_iter()
        .find_map(|op| match op {
            etcd_client::TxnOpResponse::Get(g) => g
                .kvs()
                .iter()
                .find_map(|kv| Record::decode(kv.value()).map(|r| r.owner())),
            _ => None,
        })
        .unwrap_or_else(|| "another process".to_owned());
    Err(RpcError::already_exists(match kind {
        Kind::Replica => {
            format!("{name:?} is registered as one service (not replicas), by {holder}")
        }
        _ => format!("{name:?} is registered already, by {holder}"),
    }))
}

/// Keeps the lease alive until `stopped`; a lease that ran out is
/// replaced and this process's names put again under the new one.
async fn keep_alive(s: Arc<Shared>, mut stopped: tokio::sync::watch::Receiver<bool>) {
    let every = s.cfg.lease / 3;
    loop {
        let lease = s.lease.load(Ordering::Relaxed);
        let mut c = s.client.clone();
        let alive = tokio::select! {
            r = c.lease_keep_alive(lease) => r,
            _ = stopped.changed() => return,
        };
        let Ok((mut keeper, mut answers)) = alive else {
            tokio::select! {
                _ = tokio::time::sleep(every) => continue,
                _ = stopped.changed() => return,
            }
        };
        loop {
            if keeper.keep_alive().await.is_err() {
                break;
            }
            match tokio::time::timeout(s.cfg.timeout, answers.message()).await {
                Ok(Ok(Some(a))) if a.ttl() > 0 => {}
                Ok(Ok(Some(_))) => {
                    // The lease ran out (etcd was out of reach for longer
                    // than it): a new one, and this process's names again.
                    regrant(&s).await;
                    break;
                }
                _ => break,
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stopped.changed() => return,
            }
        }
    }
}

/// A new lease, and this process's registrations put under it.
async fn regrant(s: &Shared) {
    let mut c = s.client.clone();
    let ttl = s.cfg.lease.as_secs().max(1) as i64;
    let Ok(l) = c.lease_grant(ttl, None).await else {
        return;
    };
    s.lease.store(l.id(), Ordering::Relaxed);
    s.regrants.fetch_add(1, Ordering::Relaxed);
    let mine: Vec<(u64, Held)> = lock(&s.mine).iter().map(|(h, x)| (*h, x.clone())).collect();
    for (h, held) in mine {
        // (A member out of reach refuses a few: made again, as calls are.)
        for _ in 0..20 {
            match put_held(s, h, &held).await {
                Ok(()) => break,
                Err(e) if e.status == dm_rpc::Status::AlreadyExists => {
                    // Taken meanwhile (an exclusive name): this process
                    // lost it.
                    lock(&s.mine).remove(&h);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
}

/// Moves `counter` on every change under `prefix`, until `stopped`.
async fn watch(
    s: Arc<Shared>,
    prefix: String,
    counter: Arc<AtomicU64>,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let mut c = s.client.clone();
        let w = tokio::select! {
            w = c.watch(prefix.clone(), Some(WatchOptions::new().with_prefix())) => w,
            _ = stopped.changed() => return,
        };
        if let Ok((_watcher, mut events)) = w {
            // (Changes while the watch was down are not known: count one.)
            counter.fetch_add(1, Ordering::Release);
            loop {
                let m = tokio::select! {
                    m = events.message() => m,
                    _ = stopped.changed() => return,
                };
                match m {
                    Ok(Some(r)) => {
                        let n = r
                            .events()
                            .iter()
                            .filter(|e| {
                                matches!(e.event_type(), EventType::Put | EventType::Delete)
                            })
                            .count();
                        if n > 0 || r.canceled() {
                            counter.fetch_add(1, Ordering::Release);
                        }
                        if r.canceled() {
                            break;
                        }
                    }
                    _ => break,
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = stopped.changed() => return,
        }
    }
}

impl Registry for EtcdRegistry {
    fn register(&self, name: &str, endpoint: &Endpoint) -> Result<Registration, RpcError> {
        self.add(name, endpoint, Kind::Exclusive)
    }

    fn register_replica(&self, name: &str, endpoint: &Endpoint) -> Result<Registration, RpcError> {
        self.add(name, endpoint, Kind::Replica)
    }

    fn unregister(&self, r: &Registration) -> Result<(), RpcError> {
        let Some(held) = lock(&self.inner.shared.mine).remove(&r.handle) else {
            return Err(RpcError::not_found(format!(
                "{:?} is not registered by this process",
                r.name
            )));
        };
        let key = held.key(&self.inner.shared.keys, r.handle);
        self.run(move |s| {
            let key = key.clone();
            async move {
                let mut c = s.client.clone();
                c.delete(key, None)
                    .await
                    .map_err(|e| unavailable(&s.cfg, e))?;
                Ok(())
            }
        })
    }

    fn lookup(&self, name: &str) -> Result<Option<ServiceEntry>, RpcError> {
        Ok(self.lookup_all(name)?.into_iter().next())
    }

    fn lookup_all(&self, name: &str) -> Result<Vec<ServiceEntry>, RpcError> {
        dm_pool::validate_service_name(name)?;
        let mut v = self.entries(self.inner.shared.keys.name(name), false)?;
        v.retain(|e| e.name == name);
        Ok(v)
    }

    fn list(&self) -> Result<Vec<ServiceEntry>, RpcError> {
        let mut v = self.entries(self.inner.shared.keys.services(), true)?;
        v.sort_by(|a, b| a.name.cmp(&b.name).then(a.handle.cmp(&b.handle)));
        Ok(v)
    }

    fn publish_local(
        &self,
        name: &str,
        endpoint: &Endpoint,
    ) -> Result<Option<Registration>, RpcError> {
        self.add(name, endpoint, Kind::Local).map(Some)
    }

    fn changes(&self, name: &str) -> Option<Arc<AtomicU64>> {
        let s = &self.inner.shared;
        let mut w = lock(&s.watched);
        if let Some(c) = w.get(name) {
            return Some(c.clone());
        }
        let rt = self.inner.rt.as_ref()?;
        let c = Arc::new(AtomicU64::new(0));
        rt.spawn(watch(
            s.clone(),
            s.keys.name(name),
            c.clone(),
            self.inner.stop.subscribe(),
        ));
        w.insert(name.to_owned(), c.clone());
        Some(c)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        let Some(rt) = self.rt.take() else { return };
        // The names go at once, not when the lease runs out.
        let s = self.shared.clone();
        let _ = block(&rt, s.cfg.timeout, async move {
            let mut c = s.client.clone();
            let _ = c.lease_revoke(s.lease.load(Ordering::Relaxed)).await;
            Ok(())
        });
        rt.shutdown_timeout(Duration::from_millis(100));
    }
}

//! A [`Node`]: this process's handle on the RPC layer — the pool it is
//! attached to, the memory servers it may use, the size-aware threshold
//! and the waiting policy: the context every server and client works in.
//!
//! What a node makes lives beside what is made: `Node::server` in
//! `server/`, `Node::connect*` in `client.rs`, `async_client/` and
//! `balance.rs`. Finding a service and dialling it is `dial.rs`.

use crate::error::RpcError;
use crate::registry::{PoolRegistry, Registry};
use crate::wait::WaitPolicy;
#[cfg(feature = "memserver")]
use dm_memserver::MemPool;
use dm_pool::{Pool, Ref};
use std::sync::Arc;
use std::time::Duration;

/// The default size-aware threshold: payloads up to this many bytes travel
/// inline, larger ones by Ref. From the measured crossover on the 2-core
/// test machine (`dmrpc bench threshold`, BENCHMARKS.md): for an argument
/// the callee reads, inline is faster up to 64 KiB (by 13% there) and the
/// two cost the same at 128 KiB; by Ref wins from there on (2.3x at 256
/// KiB). Sharing has a fixed cost of about 4.5 us (descriptor claims and
/// page counts on both sides) that copying through a ring only exceeds for
/// large payloads. The largest power of two below the crossover is chosen.
/// (A forwarded payload pays the copy at every hop, so chains of services
/// may want a lower threshold: `Config::inline_max`.)
pub const DEFAULT_INLINE_MAX: usize = 64 << 10;

/// How a node's calls behave.
///
/// What decides inline or by Ref, for each payload a call or an answer
/// carries:
///
/// 1. With [`by_value`](Self::by_value), every payload travels inline,
///    whatever its size, up to what the connection carries: over shared
///    memory 64 MiB (a frame longer than a ring's record goes in parts),
///    over TCP 16 MiB, in process 128 KiB. A larger one fails the call
///    with `ResourceExhausted`, saying what to do.
/// 2. Otherwise a payload up to the threshold travels inline, and a larger
///    one by Ref. The threshold is [`inline_max`](Self::inline_max),
///    capped by what the connection carries (above). An answer's cap can
///    be lower: over shared memory, the room its server keeps for it in
///    the ring (at most half a ring, less the frame's 32-byte header and
///    metadata; `PoolConfig::ring_size`).
/// 3. A Ref needs a peer that can use it. With a peer that shares neither
///    the pool nor the memory servers (TCP between hosts), every payload
///    travels inline.
///
/// A payload that arrived by Ref and is forwarded travels by Ref whatever
/// its size (no copy), unless the node asked for [`by_value`](Self::by_value).
///
/// Between pools, by memory-server Ref ([`remote_choice`](Self::remote_choice)):
/// with [`RemoteChoice::Measured`] (the default) a blocking client learns,
/// per method and size, whether inline or by Ref is faster, from its own
/// calls; with [`RemoteChoice::Threshold`] rule 2 applies as within a
/// pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// The threshold: payloads up to this many bytes go inline, larger by
    /// Ref. Capped by what the connection's frames carry (above).
    pub inline_max: usize,
    /// How a payload of bytes between pools chooses between inline and a
    /// memory server's Ref.
    pub remote_choice: RemoteChoice,
    /// Every payload inline, whatever its size (to compare, or to isolate
    /// a peer): a payload too large for the connection's frames fails its
    /// call, never travels by Ref instead. Off by default.
    pub by_value: bool,
    /// How waiters spin, yield and park (default: [`WaitPolicy::from_env`]).
    pub wait: WaitPolicy,
    /// Deadline applied to calls that set none (None: wait for the answer
    /// or for the peer's death).
    pub default_deadline: Option<Duration>,
    /// Longest busy-poll of a TCP socket (and, in a TCP server, of the
    /// queue between its I/O thread and its dispatcher) before the waiting
    /// thread blocks; adapted to the waits seen, and given up at once on a
    /// crowded core ([`dm_sys::poll::Spin`]). Zero: block at once.
    pub tcp_spin: Duration,
    /// The access key of TCP connections ([`dm_pool::auth`]; a key file is
    /// read with [`Key::from_file`](dm_pool::auth::Key::from_file)). A
    /// server with one serves only TCP clients that prove it; a client
    /// with one connects only to servers that prove it. Shared-memory
    /// clients are attached to the pool and need none. None by default.
    pub tcp_key: Option<dm_pool::auth::Key>,
    /// Listen on TCP beyond loopback without an access key: anyone who
    /// reaches the port may call. Off by default (such a listen is
    /// refused with what to do).
    pub tcp_open: bool,
    /// Connections a TCP server takes at once, and how long a frame may
    /// take to arrive.
    pub tcp_limits: crate::transport::tcp::TcpLimits,
}

/// How a payload of bytes travels to a peer in another pool that uses the
/// same memory servers: inline, or written to a memory server and passed
/// as its Ref. (Data already on a memory server, or in the pool, goes as
/// it is.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RemoteChoice {
    /// Learned from the calls' latencies, per method and power-of-two size
    /// from 16 KiB (smaller ones inline): each way a few times, then the
    /// faster, the other still tried once in 64 calls. What is faster
    /// depends on the services behind the method: through one, inline
    /// (by Ref the bytes cross the network twice); through a chain that
    /// forwards them, by Ref. Blocking clients learn; async ones use the
    /// threshold.
    #[default]
    Measured,
    /// By Ref above [`Config::inline_max`], as within a pool.
    Threshold,
}

/// The default [`Config::tcp_spin`]: a loopback round trip between polling
/// threads takes 6-9 us on the test machine, a sleeping thread's wake-up
/// 25-70 us; a budget that also covers the gaps between the calls of a
/// chain of services took a network chain's 3 tiers by value from 155 to
/// 51 us (50 us budget against 200; BENCHMARKS.md, `bench chain`). A
/// poller yields its core between polls and stops on a crowded one.
pub const DEFAULT_TCP_SPIN: Duration = Duration::from_micros(200);

impl Config {
    /// The default configuration with every payload inline
    /// ([`by_value`](Self::by_value)).
    pub fn by_value() -> Config {
        Config {
            by_value: true,
            ..Config::default()
        }
    }

    /// The size up to which a payload goes inline, before the transport's
    /// cap.
    pub(crate) fn threshold(&self) -> usize {
        if self.by_value {
            usize::MAX
        } else {
            self.inline_max
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            inline_max: DEFAULT_INLINE_MAX,
            remote_choice: RemoteChoice::Measured,
            by_value: false,
            wait: WaitPolicy::from_env(),
            default_deadline: None,
            tcp_spin: DEFAULT_TCP_SPIN,
            tcp_key: None,
            tcp_open: false,
            tcp_limits: crate::transport::tcp::TcpLimits::default(),
        }
    }
}

/// Which transport a server listens on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    /// Rings in the pool (clients attached to the same pool).
    Shm,
    /// TCP on this address (`host:port`; port 0 picks one), registered in
    /// the pool's registry under the service name.
    Tcp(String),
    /// Queues inside this process (tests, co-located components).
    Mem,
}

/// This process's RPC endpoint on a pool.
#[derive(Debug, Clone)]
pub struct Node {
    pub(crate) pool: Pool,
    pub(crate) cfg: Config,
    pub(crate) registry: Arc<dyn Registry>,
    #[cfg(feature = "memserver")]
    pub(crate) remote: Option<MemPool>,
    /// What its blocking clients learned of inline or by memory-server
    /// Ref, per service (shared by the clones of this node).
    pub(crate) choices: Arc<crate::choice::Choices>,
}

/// What a lookup found, or, if it failed while the name is bound in this
/// process (`in_here`), nothing.
impl Node {
    /// A node on an attached pool with the default configuration.
    pub fn new(pool: Pool) -> Node {
        Node::with_config(pool, Config::default())
    }

    /// A node with `cfg`.
    pub fn with_config(pool: Pool, cfg: Config) -> Node {
        let registry = Arc::new(PoolRegistry::new(pool.clone()));
        Node {
            pool,
            cfg,
            registry,
            #[cfg(feature = "memserver")]
            remote: None,
            choices: Arc::default(),
        }
    }

    /// This node with memory servers (DmRPC-net): a payload above the
    /// threshold bound for a peer that does not share the pool but uses
    /// the same memory servers is written there and travels as a Ref; Refs
    /// of those servers that arrive are read from them. (With the
    /// `memserver` feature, on by default.)
    #[cfg(feature = "memserver")]
    pub fn with_memserver(mut self, remote: MemPool) -> Node {
        self.remote = Some(remote);
        self
    }

    /// The memory servers, if any.
    #[cfg(feature = "memserver")]
    pub fn memserver(&self) -> Option<&MemPool> {
        self.remote.as_ref()
    }

    /// A digest of the memory servers this node uses (0: none): two nodes
    /// with the same digest can pass each other memory-server Refs. Always
    /// 0 in a build without the `memserver` feature.
    pub fn remote_domain(&self) -> u64 {
        #[cfg(feature = "memserver")]
        if let Some(m) = &self.remote {
            let mut ids = m.server_ids();
            ids.sort_unstable();
            let h = ids.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, id| {
                id.to_le_bytes()
                    .iter()
                    .fold(h, |h, b| (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3))
            });
            return h.max(1);
        }
        0
    }

    /// What this node says about itself in a TCP hello.
    pub(crate) fn identity(&self) -> crate::transport::tcp::Identity {
        crate::transport::tcp::Identity {
            pool: self.pool.id(),
            remote: self.remote_domain(),
            key: self.pool.secret(),
            access: self.cfg.tcp_key,
        }
    }

    /// Releases a Ref of the pool or of a memory server.
    pub(crate) fn release_ref(&self, r: &Ref) -> Result<(), RpcError> {
        #[cfg(feature = "memserver")]
        if let (Some(m), dm_pool::BACKEND_MEMSERVER) = (&self.remote, r.backend) {
            return Ok(m.release_ref_nowait(r)?);
        }
        Ok(self.pool.release_ref(r)?)
    }

    /// This node with another registry for TCP services (the pool's own
    /// registry still names its shared-memory services).
    pub fn with_registry(mut self, registry: Arc<dyn Registry>) -> Node {
        self.registry = registry;
        self
    }

    /// The registry TCP services are published in and looked up from.
    pub fn registry(&self) -> &Arc<dyn Registry> {
        &self.registry
    }

    /// The pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }
}

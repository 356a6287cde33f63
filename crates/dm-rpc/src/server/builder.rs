//! [`ServerBuilder`]: a service's methods, interceptors and transport,
//! then [`spawn`](ServerBuilder::spawn): its name registered (in the pool,
//! the node's registry, or this process) and its dispatcher started.

use super::dispatch::Dispatcher;
use super::handler::{
    AsyncCall, Call, DisconnectHook, HandlerFuture, Incoming, Interceptor, Method, Methods, Peer,
    StreamFuture,
};
use super::running::{Reg, Server, Stats};
use super::tasks::Tasks;
use crate::error::RpcError;
use crate::frame::method_id;
use crate::metadata::Metadata;
use crate::node::{Node, Transport};
use crate::payload::Payload;
use crate::stream::{AsyncInbox, AsyncSink, Inbox, Sink};
use crate::transport::Listener;
use dm_pool::Endpoint;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Longest pause between two tries of a name `wait_for_name` waits for.
const NAME_POLL: Duration = Duration::from_millis(10);

/// Runs `claim` until it does not answer `AlreadyExists`, or `wait` has
/// passed (then its last answer, saying how long it waited).
fn claim_name<T>(
    wait: Duration,
    mut claim: impl FnMut() -> Result<T, RpcError>,
) -> Result<T, RpcError> {
    let start = Instant::now();
    let mut pause = Duration::from_millis(1);
    loop {
        match claim() {
            Err(e) if e.status == crate::Status::AlreadyExists => {
                let left = wait.saturating_sub(start.elapsed());
                if left.is_zero() {
                    if wait.is_zero() {
                        return Err(e);
                    }
                    return Err(RpcError::already_exists(format!(
                        "{} (waited {} ms for it)",
                        e.message,
                        start.elapsed().as_millis()
                    )));
                }
                std::thread::sleep(pause.min(left));
                pause = (pause * 2).min(NAME_POLL);
            }
            done => return done,
        }
    }
}

/// Builds a server.
pub struct ServerBuilder {
    pub(super) node: Node,
    pub(super) name: String,
    pub(super) methods: Methods,
    /// What serves the methods not registered ([`ServerBuilder::fallback_bidi_async`]).
    pub(super) fallback: Option<(Arc<str>, Method)>,
    pub(super) transport: Transport,
    pub(super) clash: Option<String>,
    pub(super) interceptors: Vec<Interceptor>,
    pub(super) propagate: Vec<String>,
    /// Registered as one replica of the name ([`ServerBuilder::replica`]).
    pub(super) replica: bool,
    /// What the service speaks, as its registration says ([`ServerBuilder::protocol`]).
    pub(super) protocol: dm_pool::Protocol,
    /// How long `spawn` waits for a name a live process holds.
    pub(super) wait_for_name: Duration,
    /// Run when a connection that made calls closes.
    pub(super) on_disconnect: Option<DisconnectHook>,
}

/// The serial of the next server this process starts (a part of each
/// [`Peer`]).
static SERVERS: AtomicU64 = AtomicU64::new(1);

impl std::fmt::Debug for ServerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerBuilder")
            .field("name", &self.name)
            .field("methods", &self.methods.len())
            .field("transport", &self.transport)
            .field("interceptors", &self.interceptors.len())
            .field("propagate", &self.propagate)
            .field("replica", &self.replica)
            .field("wait_for_name", &self.wait_for_name)
            .finish()
    }
}

impl ServerBuilder {
    pub(crate) fn new(node: Node, name: &str) -> Self {
        ServerBuilder {
            node,
            name: name.to_owned(),
            methods: Methods::default(),
            fallback: None,
            transport: Transport::Shm,
            clash: None,
            interceptors: Vec::new(),
            propagate: Vec::new(),
            replica: false,
            protocol: dm_pool::Protocol::Dmrpc,
            wait_for_name: Duration::ZERO,
            on_disconnect: None,
        }
    }

    /// Runs `hook` when a connection that made calls to this server
    /// closes: its client dropped it, its process died, or the server
    /// stopped. It runs on the dispatcher thread within about 100 ms of
    /// the end (a server with a hook wakes that often), once per
    /// connection. What a service keeps per connection
    /// ([`Call::peer`]) goes here. One hook per server: a later one
    /// replaces an earlier one.
    pub fn on_disconnect(mut self, hook: impl Fn(Peer) + Send + Sync + 'static) -> Self {
        self.on_disconnect = Some(Arc::new(hook));
        self
    }

    /// Waits up to `deadline` for the name if a live process holds it
    /// (default: no wait, and `spawn` fails at once with
    /// [`Status::AlreadyExists`](crate::Status::AlreadyExists), naming the
    /// holder). A process that is gone never holds a name: one that exited,
    /// was killed or is a zombie not yet reaped gives its name up at once,
    /// and so does one that lost its lease. So a supervisor that restarts a
    /// service right after its death needs no wait; one that starts the new
    /// server before the old one has quite stopped (a rolling restart) asks
    /// for one. The name is taken within about 10 ms of being free.
    pub fn wait_for_name(mut self, deadline: Duration) -> Self {
        self.wait_for_name = deadline;
        self
    }

    /// Records in the pool's registry that the service speaks `p` (gRPC
    /// over dmrpc, for the `dm-grpc` crate's servers): `dmrpc ls` shows
    /// it. It changes nothing in how calls are served.
    pub fn protocol(mut self, p: dm_pool::Protocol) -> Self {
        self.protocol = p;
        self
    }

    /// Registers the server as one replica of its name: any number of
    /// servers, in any processes and over any transports, may serve one
    /// name so, and balanced clients ([`Node::connect_balanced`](crate::Node::connect_balanced))
    /// spread their calls over them (a plain client calls one of them).
    /// A name is either shared by replicas or held by one server: a
    /// replica is refused while a server holds the name alone, and the
    /// other way round.
    pub fn replica(mut self) -> Self {
        self.replica = true;
        self
    }

    /// Adds `check`, run before the handler of every request (of a
    /// registered method), in the order added: an error it returns is the
    /// call's answer and the handler does not run. For what every method
    /// shares: authentication from the metadata, admission, logging. It
    /// runs on the dispatcher thread as a blocking handler does, and may
    /// set the answer's metadata ([`crate::metadata::set_reply`]), which a
    /// handler that runs after it may replace.
    pub fn intercept(
        mut self,
        check: impl Fn(&Incoming<'_>) -> Result<(), RpcError> + Send + Sync + 'static,
    ) -> Self {
        self.interceptors.push(Arc::new(check));
        self
    }

    /// Passes the values of these metadata keys of the call a handler
    /// serves on to the calls it makes meanwhile (a blocking handler while
    /// it runs, an async handler's future while it is polled), as the
    /// deadline is: a trace id, a tenant, a request id. A call that sets a
    /// key itself keeps its own value; a detached call inherits them too
    /// (it leaves only the deadline behind). Keys not listed are not
    /// passed on (an authentication token meant for this service stays
    /// here).
    pub fn propagate_metadata<I, K>(mut self, keys: I) -> Self
    where
        I: IntoIterator<Item = K>,
        K: Into<String>,
    {
        self.propagate.extend(keys.into_iter().map(Into::into));
        self
    }

    /// Registers `handler` for method `name`.
    pub fn method(
        self,
        name: &str,
        handler: impl Fn(&mut Call<'_>) -> Result<Payload, RpcError> + Send + Sync + 'static,
    ) -> Self {
        self.add(name, Method::Blocking(Arc::new(handler)))
    }

    /// Registers an async `handler` for method `name`: its calls are
    /// futures the dispatcher polls, many in progress at once (a handler
    /// awaiting a nested call does not hold up the others), inside the
    /// server's tokio runtime context (timers, I/O and `tokio::spawn`
    /// work; long CPU work belongs in a spawned task).
    pub fn method_async<F, Fut>(self, name: &str, handler: F) -> Self
    where
        F: Fn(AsyncCall) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<Payload, RpcError>> + Send + 'static,
    {
        self.add(
            name,
            Method::Async(Arc::new(move |c| Box::pin(handler(c)) as HandlerFuture)),
        )
    }

    /// Registers `handler` for method `name`, whose answer is a stream of
    /// items: the handler sends each item into its [`Sink`] as it has it
    /// (the sink waits while the caller has taken as many as it asked
    /// for), and returns `Ok(())` to end the stream or an error to end it
    /// with that status. Callers read it with
    /// [`Client::call_stream`](crate::Client::call_stream). Like a
    /// [`method`](Self::method)'s, it runs on the dispatcher thread: the
    /// server's other calls wait until it returns. See [`crate::stream`].
    pub fn method_stream(
        self,
        name: &str,
        handler: impl Fn(&mut Call<'_>, &mut Sink<'_>) -> Result<(), RpcError> + Send + Sync + 'static,
    ) -> Self {
        self.add(name, Method::Stream(Arc::new(handler)))
    }

    /// Registers an async `handler` for method `name`, whose answer is a
    /// stream of items: its future sends each item into its [`AsyncSink`]
    /// (`sink.send(item).await` waits while the caller has taken as many
    /// as it asked for) and returns how the stream ends, as
    /// [`method_stream`](Self::method_stream)'s handler does. Its calls
    /// are futures the dispatcher polls, as
    /// [`method_async`](Self::method_async)'s are: a stream waiting for
    /// its caller, or for anything else, does not hold up the server's
    /// other calls, those of its own connection included. A caller that
    /// drops the stream cancels the call: the future is dropped. See
    /// [`crate::stream`].
    pub fn method_stream_async<F, Fut>(self, name: &str, handler: F) -> Self
    where
        F: Fn(AsyncCall, AsyncSink) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), RpcError>> + Send + 'static,
    {
        self.add(
            name,
            Method::AsyncStream(Arc::new(move |c, s| {
                Box::pin(handler(c, s)) as StreamFuture
            })),
        )
    }

    /// Registers a method whose caller sends a stream of items after its
    /// request ([`Client::call_bidi`](crate::Client::call_bidi)), with a
    /// blocking handler: it reads them from the [`Inbox`] (reading its
    /// server's connections while it waits), answers with items into the
    /// [`Sink`], and returns how the call ends. It holds up its server's
    /// other calls until it returns, as a blocking streaming handler does
    /// ([`method_bidi_async`](Self::method_bidi_async) runs beside them).
    pub fn method_bidi<F>(self, name: &str, handler: F) -> Self
    where
        F: Fn(&mut Call<'_>, &mut Inbox<'_>, &mut Sink<'_>) -> Result<(), RpcError>
            + Send
            + Sync
            + 'static,
    {
        self.add(name, Method::Bidi(Arc::new(handler)))
    }

    /// Registers an async method whose caller sends a stream of items
    /// after its request ([`AsyncClient::call_bidi`](crate::AsyncClient::call_bidi)):
    /// the handler reads them from the [`AsyncInbox`] as they come
    /// (granting more as it reads: a caller never sends more than the
    /// handler holds unread), answers with items into the [`AsyncSink`]
    /// as a streaming handler does, and returns how the call ends. A
    /// bidirectional stream, or, sending no item, a caller's stream
    /// answered once (its answer's payload travels as the last item).
    /// Called without items (`call_stream`), its inbox is empty. Its
    /// calls run beside the server's others, as async streams do.
    pub fn method_bidi_async<F, Fut>(self, name: &str, handler: F) -> Self
    where
        F: Fn(AsyncCall, AsyncInbox, AsyncSink) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), RpcError>> + Send + 'static,
    {
        self.add(
            name,
            Method::AsyncBidi(Arc::new(move |c, i, s| {
                Box::pin(handler(c, i, s)) as StreamFuture
            })),
        )
    }

    /// Serves every method not registered by name with `handler`, an
    /// async handler of a method whose caller may send items too (as
    /// [`method_bidi_async`](Self::method_bidi_async)): for a server that
    /// learns what a call is from its metadata (a gRPC adapter carries
    /// the method's path there). Its calls see the method name `*`. It
    /// must be called as a stream (`call_stream` or `call_bidi`); a plain
    /// call is refused with `InvalidArgument`.
    pub fn fallback_bidi_async<F, Fut>(mut self, handler: F) -> Self
    where
        F: Fn(AsyncCall, AsyncInbox, AsyncSink) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), RpcError>> + Send + 'static,
    {
        let m = Method::AsyncBidi(Arc::new(move |c, i, s| {
            Box::pin(handler(c, i, s)) as StreamFuture
        }));
        self.fallback = Some(("*".into(), m));
        self
    }

    fn add(mut self, name: &str, m: Method) -> Self {
        let id = method_id(name);
        if let Some((other, _)) = self.methods.get(&id) {
            self.clash = Some(format!("methods {other:?} and {name:?} have the same id"));
        }
        self.methods.insert(id, (name.into(), m));
        self
    }

    /// Listens on `t` (default: shared-memory channels of the pool).
    pub fn transport(mut self, t: Transport) -> Self {
        self.transport = t;
        self
    }

    /// Registers the service and starts its dispatcher thread.
    pub fn spawn(self) -> Result<Server, RpcError> {
        if let Some(c) = self.clash {
            return Err(RpcError::invalid_argument(c));
        }
        for k in &self.propagate {
            Metadata::new().insert(k, Vec::new())?;
        }
        dm_pool::validate_service_name(&self.name)?;
        let stop = Arc::new(AtomicBool::new(false));
        let node = self.node.clone();
        let mut endpoint = None;
        let (listener, reg): (Box<dyn Listener>, Option<Reg>) = match &self.transport {
            Transport::Shm => {
                let svc = claim_name(self.wait_for_name, || {
                    Ok(node.pool.register_with(
                        &self.name,
                        &Endpoint::Shm,
                        self.replica,
                        self.protocol,
                    )?)
                })?;
                match crate::transport::shm::ShmListener::new(
                    &node.pool,
                    svc.clone(),
                    node.cfg.wait,
                    stop.clone(),
                    node.cfg.threshold(),
                )
                .map(|l| {
                    if node.cfg.by_value {
                        l.whole_answers()
                    } else {
                        l
                    }
                }) {
                    Ok(l) => {
                        // Listed beside the other hosts' services too (etcd),
                        // if the node's registry lists local ones; a registry
                        // that fails to take it does not stop the service.
                        let listed = node
                            .registry
                            .publish_local(&self.name, &Endpoint::Shm)
                            .unwrap_or(None);
                        (Box::new(l), Some(Reg::Pool(svc, listed)))
                    }
                    Err(e) => {
                        let _ = node.pool.unregister(&svc);
                        return Err(e.into());
                    }
                }
            }
            Transport::Tcp(addr) => {
                if node.cfg.tcp_key.is_none()
                    && !node.cfg.tcp_open
                    && !dm_pool::auth::is_loopback(addr)
                {
                    return Err(RpcError::invalid_argument(format!(
                        "listening on {addr} without an access key would let any host that \
                         reaches the port call the service: give the node a key \
                         (`Config::tcp_key`; `dmrpc key new FILE` makes a key file, and \
                         clients use the same file), or set `Config::tcp_open` to serve anyone"
                    )));
                }
                let l = crate::transport::tcp::TcpListener::bind(
                    addr,
                    node.identity(),
                    stop.clone(),
                    node.cfg.tcp_spin,
                    node.cfg.tcp_limits,
                )?;
                let at = l.local_addr().to_string();
                let at_ = Endpoint::Tcp(at.clone());
                let r = claim_name(self.wait_for_name, || {
                    Ok(if self.replica {
                        node.registry.register_replica(&self.name, &at_)?
                    } else {
                        node.registry.register(&self.name, &at_)?
                    })
                })?;
                endpoint = Some(at);
                (Box::new(l), Some(Reg::Registry(r)))
            }
            Transport::Mem => {
                let bind = if self.replica {
                    crate::transport::mem::bind_replica
                } else {
                    crate::transport::mem::bind
                };
                let l = claim_name(self.wait_for_name, || {
                    bind(&self.name, stop.clone()).ok_or_else(|| {
                        RpcError::already_exists(format!(
                            "service {:?} is already bound in this process: stop its server, \
                             choose another name, or wait for the name \
                             (`ServerBuilder::wait_for_name`)",
                            self.name
                        ))
                    })
                })?;
                let reg = Reg::Mem(self.name.clone(), l.binding());
                (Box::new(l), Some(reg))
            }
        };
        let waker = listener.waker();
        let stats = Arc::new(Stats::default());
        let rt = if self.methods.values().chain(&self.fallback).any(|(_, m)| {
            matches!(
                m,
                Method::Async(_) | Method::AsyncStream(_) | Method::AsyncBidi(_)
            )
        }) {
            Some(
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .thread_name(format!("dmrpc-async:{}", self.name))
                    .enable_all()
                    .build()
                    .map_err(|e| RpcError::internal(format!("cannot start the runtime: {e}")))?,
            )
        } else {
            None
        };
        let watch = rt.as_ref().and_then(|_| listener.watch_set());
        let drain_by = Arc::new(OnceLock::new());
        let d = Dispatcher {
            watch,
            node: node.clone(),
            methods: self.methods,
            fallback: self.fallback,
            interceptors: self.interceptors,
            propagate: self.propagate,
            listener,
            stop: stop.clone(),
            drain_by: drain_by.clone(),
            draining: None,
            stats: stats.clone(),
            queue: VecDeque::new(),
            tasks: Tasks::default(),
            outlets: Vec::new(),
            inlets: Vec::new(),
            rt,
            waker: waker.clone(),
            serial: SERVERS.fetch_add(1, Ordering::Relaxed),
            on_disconnect: self.on_disconnect,
            peers: Default::default(),
            peers_seen: Instant::now(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("dmrpc:{}", self.name))
            .spawn(move || d.run())
            .map_err(|e| RpcError::internal(format!("cannot start the dispatcher: {e}")))?;
        Ok(Server {
            endpoint,
            name: self.name,
            node,
            reg,
            stop,
            drain_by,
            waker,
            stats,
            thread: Some(thread),
        })
    }
}

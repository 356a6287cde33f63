//! Services: handlers registered by method name under a service name, and
//! the dispatch loop that runs them.
//!
//! The dispatcher is one thread per server. It takes requests from every
//! connection in fair order, answers a request whose deadline passed while
//! it was queued with `DeadlineExceeded` (without running the handler),
//! drops requests the caller cancelled before they ran (and the futures of
//! async handlers' calls cancelled while they run; a blocking handler
//! learns of its call's cancel when it asks, [`Call::cancelled`]), and
//! turns a
//! handler's panic into `Internal` for that call alone. A handler may make
//! nested calls (they inherit its call's deadline: [`crate::deadline`])
//! and forward the payload it received. A graceful shutdown
//! ([`Server::shutdown_gracefully`]) serves what was sent before it began
//! and refuses what comes after (`Unavailable`, flagged as not run). When
//! a server stops, however it stops, it refuses what it took and did not
//! run, and tells each client the highest call id it took
//! ([`crate::transport::GoAway`]): no request it did not run is lost, as
//! its callers send them all to its successor.
//!
//! Blocking handlers run on the dispatcher, one call at a time (a
//! blocking streaming handler too, for its whole stream). Async
//! handlers' calls, async streaming handlers' too, are futures the
//! dispatcher polls, many in progress at once (the items an async stream
//! queues are sent by the dispatcher between polls): a call that awaits
//! (a nested call, a timer) is parked, and its waker queues it and pokes
//! the dispatcher, which polls it again between requests. They are polled inside the server's tokio runtime context, so
//! tokio timers, I/O and `tokio::spawn` work (the runtime's one worker
//! thread drives timers and I/O and runs spawned tasks); a handler with
//! long CPU work should spawn it there, as it holds up the dispatcher
//! while polled. (They used to run as tasks on that runtime, so every call
//! crossed to its worker thread and back: about 35 us a hop on two cores.)
//! The answers to the async calls such a handler makes over shared memory
//! are read by the listener itself, while it waits for requests
//! (`async_client.rs`): a nested call's answer wakes its handler with no
//! thread in between.

use crate::async_client::polling_with;
use crate::error::RpcError;
use crate::frame::{method_id, Body, Frame, Kind, Status, FLAG_STREAM};
use crate::metadata::{Metadata, MetadataError};
use crate::node::{Node, Transport};
use crate::payload::{Dir, Payload};
use crate::stream::{AsyncSink, Outlet, Sink};
use crate::transport::{ConnId, Listener, Waker, WatchSet};
use dm_pool::{Endpoint, Ref, ServiceInfo};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::Poll;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A method's handler.
pub type Handler = Arc<dyn Fn(&mut Call<'_>) -> Result<Payload, RpcError> + Send + Sync>;

/// A streaming method's handler: it sends the items of its answer into
/// the [`Sink`], and returns how the stream ends ([`ServerBuilder::method_stream`]).
pub type StreamHandler =
    Arc<dyn Fn(&mut Call<'_>, &mut Sink<'_>) -> Result<(), RpcError> + Send + Sync>;

/// The future an async handler returns.
pub type HandlerFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Payload, RpcError>> + Send>>;

/// An async method's handler.
pub type AsyncHandler = Arc<dyn Fn(AsyncCall) -> HandlerFuture + Send + Sync>;

/// The future an async streaming handler returns: how its stream ends.
pub type StreamFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), RpcError>> + Send>>;

/// An async streaming method's handler
/// ([`ServerBuilder::method_stream_async`]).
pub type AsyncStreamHandler = Arc<dyn Fn(AsyncCall, AsyncSink) -> StreamFuture + Send + Sync>;

/// A check every request passes before its handler runs
/// ([`ServerBuilder::intercept`]).
pub type Interceptor = Arc<dyn Fn(&Incoming<'_>) -> Result<(), RpcError> + Send + Sync>;

/// A request as an interceptor sees it, before its handler runs: its
/// method, metadata, deadline and size (not its payload's bytes).
#[derive(Debug)]
pub struct Incoming<'a> {
    method: &'a str,
    metadata: &'a Metadata,
    deadline: Option<Instant>,
    len: u64,
}

impl Incoming<'_> {
    /// The method's name.
    pub fn method(&self) -> &str {
        self.method
    }

    /// The request's metadata.
    pub fn metadata(&self) -> &Metadata {
        self.metadata
    }

    /// When the caller stops waiting, if it set a deadline.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Bytes of the payload (inline or by Ref).
    pub fn payload_len(&self) -> u64 {
        self.len
    }
}

/// Methods by id. The ids are FNV-1a hashes of the names already
/// ([`method_id`]), so the map uses them as they are instead of hashing
/// them again on every request.
type Methods = HashMap<u32, (Arc<str>, Method), std::hash::BuildHasherDefault<IdHasher>>;

/// A hasher for keys that are hashes: the `u32` itself.
#[derive(Default)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | b as u64;
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = n as u64;
    }
}

/// A registered method.
#[derive(Clone)]
enum Method {
    /// Runs on the dispatcher thread, one call at a time.
    Blocking(Handler),
    /// Runs as a task on the server's runtime; many at once.
    Async(AsyncHandler),
    /// Runs on the dispatcher thread, one call at a time, answering with
    /// a stream of items ([`crate::stream`]).
    Stream(StreamHandler),
    /// Answers with a stream of items, its calls polled by the dispatcher
    /// as async handlers' are: many at once, beside the server's other
    /// calls.
    AsyncStream(AsyncStreamHandler),
}

/// One call, as an async handler sees it (owned, so it can be held across
/// awaits).
#[derive(Debug)]
pub struct AsyncCall {
    /// The request's payload.
    pub payload: Payload,
    /// When the caller stops waiting, if it set a deadline. Calls the
    /// handler's future makes while it is polled inherit it
    /// ([`crate::deadline`]).
    pub deadline: Option<Instant>,
    /// The method's name (shared with the server's table of methods).
    pub method: Arc<str>,
    /// This process's node, for nested calls.
    pub node: Node,
    /// The request's metadata ([`crate::metadata`]).
    pub metadata: Metadata,
}

impl AsyncCall {
    /// Sets the metadata of this call's answer, replacing what was set
    /// before: from the handler's future itself, not from a task it
    /// spawned ([`crate::metadata::set_reply`]).
    pub fn set_reply_metadata(&self, meta: Metadata) -> Result<(), MetadataError> {
        crate::metadata::set_reply(meta)
    }
}

/// One call, as a handler sees it.
#[derive(Debug)]
pub struct Call<'a> {
    payload: Payload,
    deadline: Option<Instant>,
    method: &'a str,
    node: &'a Node,
    metadata: Metadata,
}

impl<'a> Call<'a> {
    /// The call of method `name` with a request's payload and metadata,
    /// as a blocking handler sees it in `scope`.
    #[inline]
    fn of(
        name: &'a str,
        node: &'a Node,
        (body, metadata): (Body, Metadata),
        scope: &Scope,
    ) -> Result<Self, RpcError> {
        crate::stats::count(&body, false);
        Ok(Call {
            payload: Payload::from_request_body(body, node)?,
            deadline: scope.deadline,
            method: name,
            node,
            metadata,
        })
    }

    /// The request's payload.
    pub fn payload(&self) -> &Payload {
        &self.payload
    }

    /// Takes the payload (to keep it, or to move it into another call).
    pub fn take_payload(&mut self) -> Payload {
        std::mem::take(&mut self.payload)
    }

    /// When the caller stops waiting, if it set a deadline. Nested calls
    /// made while the handler runs inherit it ([`crate::deadline`]).
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Whether the caller gave up on this call: its deadline passed, or it
    /// cancelled it ([`crate::deadline::cancelled`]). A handler with long
    /// work may look now and then and stop early: what it answers then is
    /// dropped.
    pub fn cancelled(&self) -> bool {
        crate::deadline::cancelled()
    }

    /// The method's name.
    pub fn method(&self) -> &str {
        self.method
    }

    /// The request's metadata (empty if the caller sent none).
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Sets the metadata of this call's answer, replacing what was set
    /// before: from the handler's thread ([`crate::metadata::set_reply`]).
    pub fn set_reply_metadata(&mut self, meta: Metadata) -> Result<(), MetadataError> {
        crate::metadata::set_reply(meta)
    }

    /// This process's node, for nested calls.
    pub fn node(&self) -> &Node {
        self.node
    }
}

/// Builds a server.
pub struct ServerBuilder {
    node: Node,
    name: String,
    methods: Methods,
    transport: Transport,
    clash: Option<String>,
    interceptors: Vec<Interceptor>,
    propagate: Vec<String>,
    /// Registered as one replica of the name ([`ServerBuilder::replica`]).
    replica: bool,
}

impl std::fmt::Debug for ServerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerBuilder")
            .field("name", &self.name)
            .field("methods", &self.methods.len())
            .field("transport", &self.transport)
            .field("interceptors", &self.interceptors.len())
            .field("propagate", &self.propagate)
            .field("replica", &self.replica)
            .finish()
    }
}

impl ServerBuilder {
    pub(crate) fn new(node: Node, name: &str) -> Self {
        ServerBuilder {
            node,
            name: name.to_owned(),
            methods: Methods::default(),
            transport: Transport::Shm,
            clash: None,
            interceptors: Vec::new(),
            propagate: Vec::new(),
            replica: false,
        }
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
                let svc = if self.replica {
                    node.pool.register_replica(&self.name, &Endpoint::Shm)?
                } else {
                    node.pool.register(&self.name, &Endpoint::Shm)?
                };
                match crate::transport::shm::ShmListener::new(
                    &node.pool,
                    svc.clone(),
                    node.cfg.wait,
                    stop.clone(),
                    node.cfg.inline_max,
                ) {
                    Ok(l) => (Box::new(l), Some(Reg::Pool(svc))),
                    Err(e) => {
                        let _ = node.pool.unregister(&svc);
                        return Err(e.into());
                    }
                }
            }
            Transport::Tcp(addr) => {
                let l = crate::transport::tcp::TcpListener::bind(
                    addr,
                    node.identity(),
                    stop.clone(),
                    node.cfg.tcp_spin,
                )?;
                let at = l.local_addr().to_string();
                let at_ = Endpoint::Tcp(at.clone());
                let r = if self.replica {
                    node.registry.register_replica(&self.name, &at_)?
                } else {
                    node.registry.register(&self.name, &at_)?
                };
                endpoint = Some(at);
                (Box::new(l), Some(Reg::Registry(r)))
            }
            Transport::Mem => {
                let bind = if self.replica {
                    crate::transport::mem::bind_replica
                } else {
                    crate::transport::mem::bind
                };
                let l = bind(&self.name, stop.clone()).ok_or_else(|| {
                    RpcError::invalid_argument(format!(
                        "service {:?} is already bound in this process",
                        self.name
                    ))
                })?;
                let reg = Reg::Mem(self.name.clone(), l.binding());
                (Box::new(l), Some(reg))
            }
        };
        let waker = listener.waker();
        let stats = Arc::new(Stats::default());
        let rt = if self
            .methods
            .values()
            .any(|(_, m)| matches!(m, Method::Async(_) | Method::AsyncStream(_)))
        {
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
            rt,
            waker: waker.clone(),
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

/// Adds one to a counter only the server's dispatcher thread writes: a
/// load and a store, not a locked add (about 10 ns here, on the way to
/// every answer). Readers on other threads see each count whole.
#[inline]
fn bump(c: &AtomicU64) {
    c.store(c.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
}

/// Counters of a running server. (`calls` and `errors` are written by
/// the server's dispatcher thread alone.)
#[derive(Debug, Default)]
pub struct Stats {
    /// Requests answered (any status).
    pub calls: AtomicU64,
    /// Requests answered with an error status.
    pub errors: AtomicU64,
    /// Requests dropped because the caller cancelled them before they ran
    /// (or, with an async handler, while it ran).
    pub cancelled: AtomicU64,
    /// Requests whose deadline passed before they ran.
    pub expired: AtomicU64,
    /// Requests refused unrun because the server was stopping: they came
    /// while it drained ([`Server::shutdown_gracefully`]), or were still
    /// queued when it stopped.
    pub refused: AtomicU64,
    /// Items sent by streaming methods ([`ServerBuilder::method_stream`]).
    pub items: AtomicU64,
}

/// Where a server's name is registered.
enum Reg {
    /// In the pool (shared-memory services).
    Pool(ServiceInfo),
    /// In the node's registry (TCP services).
    Registry(crate::registry::Registration),
    /// Bound in this process (in-memory services): the name and binding.
    Mem(String, u64),
}

/// A running service. Stops (and unregisters) on [`shutdown`](Self::shutdown) or drop.
pub struct Server {
    endpoint: Option<String>,
    name: String,
    node: Node,
    reg: Option<Reg>,
    stop: Arc<AtomicBool>,
    /// Set when the server starts draining: the time it stops at the latest.
    drain_by: Arc<OnceLock<Instant>>,
    waker: Waker,
    stats: Arc<Stats>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("name", &self.name).finish()
    }
}

impl Server {
    /// The service name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The address a TCP server listens on (with the port it was given).
    pub fn tcp_addr(&self) -> Option<&str> {
        self.endpoint.as_deref()
    }

    /// Live counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Stops taking requests, closes every connection and unregisters.
    /// Calls in progress fail with `Unavailable` (a blocking handler
    /// running at that moment finishes first). Requests not run yet are
    /// refused, and each client is told which requests were taken: the
    /// others, still waiting in the connections, were never read. Clients
    /// send both kinds to the server registered under the name next, if
    /// any (see [`crate::transport::GoAway`]).
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    /// Stops taking new calls and finishes those it has, then shuts down:
    /// unregisters at once (no new client finds it), serves every request
    /// already sent to it (read, or waiting in its connections) and lets
    /// async handlers' calls in progress complete, and answers requests
    /// that come after with `Unavailable`, refused: their callers send
    /// them to the server registered under the name next, if any.
    /// Returns when nothing is left, or once `grace` has passed: then
    /// calls in progress fail and requests still queued are refused, as
    /// with [`shutdown`](Self::shutdown).
    pub fn shutdown_gracefully(mut self, grace: Duration) {
        self.unregister();
        let _ = self.drain_by.set(Instant::now() + grace);
        self.waker.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.stop_now();
    }

    /// Blocks until the server stops (from another thread's shutdown, or
    /// a fatal transport error).
    pub fn wait(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.stop_now();
    }

    fn unregister(&mut self) {
        match self.reg.take() {
            Some(Reg::Pool(s)) => {
                let _ = self.node.pool.unregister(&s);
            }
            Some(Reg::Registry(r)) => {
                let _ = self.node.registry.unregister(&r);
            }
            Some(Reg::Mem(name, binding)) => crate::transport::mem::unbind(&name, binding),
            None => {}
        }
    }

    fn stop_now(&mut self) {
        self.unregister();
        self.stop.store(true, Ordering::Release);
        self.waker.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_now();
    }
}

/// Where an answer goes: the call, and the pool Ref its request carried
/// (which the answer may pass back as it came).
struct To {
    conn: ConnId,
    id: u64,
    echo: Option<Ref>,
}

pub(crate) struct Pending {
    conn: ConnId,
    frame: Frame,
    /// When the caller stops waiting (from the frame's relative deadline,
    /// counted from when the frame was read).
    deadline: Option<Instant>,
    /// Items its caller granted while it was queued (a stream's request).
    credit: u64,
}

fn pending(conn: ConnId, frame: Frame) -> Pending {
    let deadline = (frame.deadline_us > 0)
        .then(|| Instant::now() + Duration::from_micros(frame.deadline_us as u64));
    Pending {
        conn,
        frame,
        deadline,
        credit: 0,
    }
}

/// Async handlers' calls in progress, by slot.
#[derive(Default)]
struct Tasks {
    slots: Vec<Option<Task>>,
    /// Each slot's waker, made with the slot and kept for every call the
    /// slot holds (no allocation per call).
    wakers: Vec<std::task::Waker>,
    free: Vec<usize>,
    /// Slots whose futures were woken (filled by their wakers).
    woken: Arc<Mutex<Vec<usize>>>,
    /// The list being polled (swapped with `woken`, to keep both buffers).
    polling: Vec<usize>,
}

/// One async handler's call.
struct Task {
    to: To,
    /// The method's id (for a panic's message).
    method: u32,
    fut: HandlerFuture,
    /// What it is polled in.
    scope: Scope,
    /// An async stream's items on their way out.
    outlet: Option<Arc<Outlet>>,
}

/// What a handler's work runs in: the call's deadline (which the calls it
/// makes inherit), the metadata they inherit, and where its answer's
/// metadata goes.
struct Scope {
    deadline: Option<Instant>,
    meta: crate::metadata::Served,
}

impl Scope {
    /// Runs `f`, a handler's (or interceptor's) work, in this scope; a
    /// panic is caught.
    #[inline]
    fn run<R>(&mut self, f: impl FnOnce() -> R) -> std::thread::Result<R> {
        let deadline = self.deadline;
        crate::metadata::serving(&mut self.meta, || guarded(deadline, f))
    }
}

/// The waker of slot `slot`'s call: queues the slot and pokes the
/// dispatcher. (A wake that arrives after its call ended and the slot was
/// reused polls the new call once more than needed, which futures allow.)
struct TaskWake {
    slot: usize,
    woken: Arc<Mutex<Vec<usize>>>,
    poke: Waker,
}

impl std::task::Wake for TaskWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        crate::sync::lock(&self.woken).push(self.slot);
        self.poke.wake();
    }
}

struct Dispatcher {
    node: Node,
    methods: Methods,
    /// Run before every handler ([`ServerBuilder::intercept`]).
    interceptors: Vec<Interceptor>,
    /// Metadata keys passed on ([`ServerBuilder::propagate_metadata`]).
    propagate: Vec<String>,
    listener: Box<dyn Listener>,
    stop: Arc<AtomicBool>,
    /// Set by [`Server::shutdown_gracefully`].
    drain_by: Arc<OnceLock<Instant>>,
    /// Draining, until this time at the latest: requests read now are
    /// refused.
    draining: Option<Instant>,
    stats: Arc<Stats>,
    queue: VecDeque<Pending>,
    /// Async handlers' calls in progress (dropped before the runtime their
    /// timers and I/O belong to).
    tasks: Tasks,
    /// The async streams in progress: their items, sent by the
    /// dispatcher between polls.
    outlets: Vec<Arc<Outlet>>,
    /// The context async handlers are polled in (only if the server has
    /// some): their timers, I/O and spawned tasks.
    rt: Option<tokio::runtime::Runtime>,
    /// Pokes the dispatcher (out of a wait for requests).
    waker: Waker,
    /// Where async clients awaited by async handlers register, so that the
    /// listener reads their answers (if it can, and the server has async
    /// methods).
    watch: Option<Arc<WatchSet>>,
}

impl Dispatcher {
    fn run(mut self) {
        self.serve_until_stopped();
        self.close();
    }

    /// The end, however the server stops: the requests taken and never
    /// run are refused ([`FLAG_REFUSED`](crate::frame::FLAG_REFUSED)),
    /// and every client is told which of its requests were taken
    /// ([`Listener::go_away`]): their callers send the others elsewhere.
    fn close(&mut self) {
        for o in std::mem::take(&mut self.outlets) {
            o.end(&self.node, RpcError::unavailable("the server is stopping"));
        }
        for p in std::mem::take(&mut self.queue) {
            if p.frame.kind == Kind::Request {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                let answer = Frame::refused(p.frame.call_id, "the service is shutting down");
                let _ = self.listener.reply(p.conn, &answer);
            }
        }
        self.listener.go_away();
    }

    fn serve_until_stopped(&mut self) {
        while !self.stop.load(Ordering::Acquire) {
            if self.rt.is_some() {
                self.poll_woken();
            }
            if !self.outlets.is_empty() {
                self.tend_outlets();
            }
            if self.drained() {
                return;
            }
            let p = match self.queue.pop_front() {
                Some(p) => p,
                None => match self.listener.next(self.wake_by()) {
                    Ok(Some((conn, frame))) if !self.refused(conn, &frame) => pending(conn, frame),
                    Ok(_) => continue,
                    Err(_) => return,
                },
            };
            match p.frame.kind {
                Kind::Request => self.serve(p),
                // Every transport keeps a connection's frames in order, so
                // the request of a cancel read here was served already, or
                // is an async handler's call in progress.
                Kind::Cancel => {
                    self.cancel_task(p.conn, p.frame.call_id);
                }
                // A grant for an async stream in progress (one for a
                // stream that ended is dropped).
                Kind::Credit => self.grant(p.conn, p.frame.call_id, p.frame.method),
                // Clients do not send responses, go-aways or items.
                Kind::Response | Kind::GoAway | Kind::Item => {}
            }
        }
    }

    /// When the wait for the next frame ends at the latest: the end of a
    /// graceful shutdown; with async streams in progress, their earliest
    /// deadline, and soon enough to notice a caller gone (50 ms, as a
    /// blocking stream's sink does) or, over a transport whose listener
    /// does not say when room comes, to send items that found none (a
    /// millisecond).
    fn wake_by(&self) -> Option<Instant> {
        if self.outlets.is_empty() {
            return self.draining;
        }
        let poll = !self.listener.wakes_for_room() && self.outlets.iter().any(|o| o.unsent());
        let slice = Duration::from_millis(if poll { 1 } else { 50 });
        let mut by = Instant::now() + slice;
        for d in self.outlets.iter().filter_map(|o| o.deadline) {
            by = by.min(d);
        }
        Some(self.draining.map_or(by, |d| d.min(by)))
    }

    /// Sends the items the async streams queued, as far as their
    /// connections have room, and ends the streams whose callers are
    /// gone or whose deadlines passed.
    fn tend_outlets(&mut self) {
        let now = Instant::now();
        let (listener, stats, node) = (&mut self.listener, &self.stats, &self.node);
        for o in &self.outlets {
            o.flush(node, &mut **listener, stats);
            if !listener.is_open(o.conn) {
                o.end(node, RpcError::unavailable("the stream's caller is gone"));
            } else if o.deadline.is_some_and(|d| now >= d) {
                o.end(
                    node,
                    RpcError::deadline_exceeded("the stream's deadline passed"),
                );
            }
        }
    }

    /// Stream `id` of `conn` was granted `n` more items: its sink may go
    /// on, if it is an async stream in progress.
    fn grant(&mut self, conn: ConnId, id: u64, n: u32) {
        if let Some(o) = self.outlets.iter().find(|o| o.conn == conn && o.id == id) {
            o.grant(n);
        }
    }

    /// Applies what was read for calls in progress while a handler ran.
    fn apply(&mut self, later: Vec<Later>) {
        for l in later {
            match l {
                Later::Cancel(conn, id) => self.cancel_task(conn, id),
                Later::Credit(conn, id, n) => self.grant(conn, id, n),
            }
        }
    }

    /// An async stream's call ended (answered, or cancelled): its outlet
    /// goes, and what it still held is released.
    fn close_outlet(&mut self, outlet: Option<Arc<Outlet>>) {
        if let Some(o) = outlet {
            self.outlets.retain(|x| !Arc::ptr_eq(x, &o));
            o.end(&self.node, RpcError::unavailable("the stream has ended"));
        }
    }

    /// Whether a graceful shutdown is done: nothing queued or in progress,
    /// or its time is up. The first time it sees one begin, it queues what
    /// was sent before (to be served): what comes after is refused.
    fn drained(&mut self) -> bool {
        let Some(by) = self.draining else {
            let Some(&by) = self.drain_by.get() else {
                return false;
            };
            self.drain();
            self.draining = Some(by);
            return false;
        };
        let busy = self.tasks.slots.len() > self.tasks.free.len() || self.listener.holding();
        (self.queue.is_empty() && !busy) || Instant::now() >= by
    }

    /// Answers `f` with `Unavailable` if it is a request read while the
    /// server drains (true), instead of taking it.
    fn refused(&mut self, conn: ConnId, f: &Frame) -> bool {
        refuse(&mut *self.listener, &self.stats, self.draining, conn, f)
    }

    /// Moves every frame already waiting into the queue, applying cancels,
    /// so that a request cancelled while queued never runs.
    fn drain(&mut self) {
        let mut later = Vec::new();
        let (stats, draining) = (&self.stats, self.draining);
        intake(
            &mut *self.listener,
            &mut self.queue,
            stats,
            draining,
            &mut later,
        );
        self.apply(later);
    }

    fn serve(&mut self, p: Pending) {
        let Pending {
            conn,
            frame,
            deadline,
            credit,
        } = p;
        let to = To {
            conn,
            id: frame.call_id,
            echo: match &frame.payload {
                Body::Refs(rs) if rs.len() == 1 => Some(rs[0]),
                _ => None,
            },
        };
        // Cancels of async calls and grants of async streams read while a
        // blocking handler ran.
        let mut later = Vec::new();
        let mut scope = Scope {
            deadline,
            meta: Default::default(),
        };
        if !self.propagate.is_empty() && !frame.meta.is_empty() {
            scope.meta.inherited = frame.meta.only(&self.propagate);
        }
        let method = self.methods.get(&frame.method);
        let result = if deadline.is_some_and(|d| Instant::now() >= d) {
            self.stats.expired.fetch_add(1, Ordering::Relaxed);
            Err(RpcError::deadline_exceeded(
                "the deadline passed while the request was queued",
            ))
        } else if let Err(e) = intercept(&self.interceptors, method, &frame, &mut scope) {
            Err(e)
        } else {
            match method {
                Some((name, Method::Stream(_) | Method::AsyncStream(_)))
                    if frame.flags & FLAG_STREAM == 0 =>
                {
                    Err(RpcError::invalid_argument(format!(
                        "method {name:?} answers with a stream: call it with call_stream"
                    )))
                }
                Some((name, Method::Async(h))) => {
                    let h = h.clone();
                    let started =
                        self.start_future(name, (frame.payload, frame.meta), &mut scope, |c| h(c));
                    match started {
                        Ok(fut) => {
                            self.start_async(to, frame.method, fut, scope, None);
                            self.drain();
                            return;
                        }
                        Err(e) => Err(e),
                    }
                }
                Some((name, Method::Blocking(h))) => {
                    // What the handler's looks for a cancel of its call
                    // read: requests are queued, cancels of queued ones
                    // applied, those of async calls kept for after it.
                    let (listener, queue) = (&mut self.listener, &mut self.queue);
                    let (stats, draining) = (&self.stats, self.draining);
                    let running = (conn, frame.call_id);
                    let mut seen = false;
                    let mut check = || {
                        if !seen {
                            intake(&mut **listener, queue, stats, draining, &mut later);
                            let mine = Later::Cancel(running.0, running.1);
                            if let Some(k) = later.iter().position(|c| *c == mine) {
                                later.swap_remove(k);
                                seen = true;
                            }
                        }
                        seen
                    };
                    let req = (frame.payload, frame.meta);
                    run_handler(h, name, &self.node, req, &mut scope, &mut check)
                }
                Some((name, Method::Stream(h))) => {
                    let feed = crate::stream::Feed::new(
                        &mut *self.listener,
                        &mut self.queue,
                        &self.stats,
                        self.draining,
                        ((conn, frame.call_id), credit),
                    );
                    let cell = std::cell::RefCell::new(feed);
                    let mut sink =
                        Sink::new(&cell, &self.node, &self.stop, deadline, frame.call_id);
                    let req = (frame.payload, frame.meta);
                    let r = run_stream(h, name, &self.node, req, &mut scope, &mut sink);
                    later = cell.borrow_mut().take_later();
                    r.map(|()| Payload::empty())
                }
                Some((name, Method::AsyncStream(h))) => {
                    let outlet = Arc::new(Outlet::new(conn, frame.call_id, deadline, credit));
                    let (ours, max) = (self.node.cfg.inline_max, self.listener.max_inline());
                    let sink = AsyncSink::new(
                        outlet.clone(),
                        self.node.clone(),
                        self.waker.clone(),
                        ours.min(max),
                        self.listener.refs(conn),
                    );
                    let (h, o) = (h.clone(), outlet.clone());
                    let req = (frame.payload, frame.meta);
                    let started = self.start_future(name, req, &mut scope, move |c| {
                        let fut = h(c, sink);
                        Box::pin(async move {
                            let r = fut.await;
                            // Its items go before its end.
                            let flushed = o.flushed().await;
                            r.and(flushed).map(|()| Payload::empty())
                        })
                    });
                    match started {
                        Ok(fut) => {
                            // Its connection's other requests go on beside it.
                            self.listener.stream_beside(conn, frame.call_id);
                            self.outlets.push(outlet.clone());
                            self.start_async(to, frame.method, fut, scope, Some(outlet));
                            self.drain();
                            return;
                        }
                        Err(e) => Err(e),
                    }
                }
                None => Err(RpcError::not_found(crate::error::no_method(frame.method))),
            }
        };
        self.apply(later);
        self.answer(to, result, scope.meta.reply);
    }

    /// The future of an async handler's call of method `name` with
    /// request `req` (payload and metadata), made by `make` in the call's
    /// scope and the server's runtime context (a handler may touch tokio
    /// before its first await); a panic is the call's error.
    fn start_future(
        &self,
        name: &Arc<str>,
        (body, metadata): (Body, Metadata),
        scope: &mut Scope,
        make: impl FnOnce(AsyncCall) -> HandlerFuture,
    ) -> Result<HandlerFuture, RpcError> {
        let call = AsyncCall {
            payload: Payload::from_request_body(body, &self.node)?,
            deadline: scope.deadline,
            method: name.clone(),
            node: self.node.clone(),
            metadata,
        };
        let _rt = self.rt.as_ref().map(|rt| rt.enter());
        polling_with(self.watch.as_ref(), || scope.run(|| make(call)))
            .map_err(|p| panicked(name, &*p))
    }

    /// Starts an async handler's call: polls it at once (it runs up to
    /// its first await), and keeps it until it completes.
    fn start_async(
        &mut self,
        to: To,
        method: u32,
        fut: HandlerFuture,
        scope: Scope,
        outlet: Option<Arc<Outlet>>,
    ) {
        let t = &mut self.tasks;
        let slot = t.free.pop().unwrap_or_else(|| {
            let slot = t.slots.len();
            t.slots.push(None);
            t.wakers.push(std::task::Waker::from(Arc::new(TaskWake {
                slot,
                woken: t.woken.clone(),
                poke: self.waker.clone(),
            })));
            slot
        });
        t.slots[slot] = Some(Task {
            to,
            method,
            fut,
            scope,
            outlet,
        });
        self.poll_task(slot);
    }

    /// Cancels call `id` of `conn` if an async handler is running it: drops
    /// its future, which cancels the calls it awaits in turn (an async
    /// client's dropped call sends a cancel and releases what it lent), so
    /// a cancel travels down a chain of async services; answers it
    /// `Cancelled`. (A blocking handler learns of its call's cancel when it
    /// asks: [`Call::cancelled`].)
    fn cancel_task(&mut self, conn: ConnId, id: u64) {
        let t = &mut self.tasks;
        let Some(slot) = t.slots.iter().position(|s| {
            s.as_ref()
                .is_some_and(|s| s.to.conn == conn && s.to.id == id)
        }) else {
            return;
        };
        let Some(task) = t.slots[slot].take() else {
            return;
        };
        t.free.push(slot);
        let Task {
            to, fut, outlet, ..
        } = task;
        {
            // Dropped as it is polled: in the runtime's context, its
            // clients read by this listener, a panic caught.
            let _rt = self.rt.as_ref().map(|rt| rt.enter());
            polling_with(self.watch.as_ref(), || {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(fut)));
            });
        }
        self.close_outlet(outlet);
        self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
        let cancelled = RpcError::new(Status::Cancelled, "cancelled by the caller");
        self.answer(to, Err(cancelled), Metadata::new());
    }

    /// Polls the calls whose futures were woken, until none is.
    ///
    /// It must not return while a call is queued: a waker queues its call
    /// and then pokes the listener, and polling a call may answer it, and
    /// answering drains the listener, which may swallow the poke of a call
    /// woken meanwhile. Returning then, the dispatcher would sleep in the
    /// listener with that call queued and nothing left to wake it (the
    /// hang of d5a618f). So the queue is checked again after each round;
    /// a poke swallowed before a check belongs to a call that check sees.
    fn poll_woken(&mut self) {
        loop {
            {
                let mut w = crate::sync::lock(&self.tasks.woken);
                if w.is_empty() {
                    return;
                }
                std::mem::swap(&mut *w, &mut self.tasks.polling);
            }
            let mut polling = std::mem::take(&mut self.tasks.polling);
            for &slot in &polling {
                self.poll_task(slot);
            }
            polling.clear();
            self.tasks.polling = polling;
        }
    }

    /// Polls the call in `slot`; answers it if it completed (a panic is
    /// `Internal`).
    fn poll_task(&mut self, slot: usize) {
        let Tasks { slots, wakers, .. } = &mut self.tasks;
        let Some(task) = slots.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        let method = task.method;
        let polled = {
            let _rt = self.rt.as_ref().map(|rt| rt.enter());
            let mut cx = std::task::Context::from_waker(&wakers[slot]);
            let (fut, scope) = (&mut task.fut, &mut task.scope);
            polling_with(self.watch.as_ref(), || {
                scope.run(|| fut.as_mut().poll(&mut cx))
            })
        };
        let r = match polled {
            Ok(Poll::Pending) => return,
            Ok(Poll::Ready(r)) => r,
            Err(p) => {
                let name = self.methods.get(&method).map_or("?", |(n, _)| &**n);
                Err(panicked(name, &*p))
            }
        };
        if let Some(t) = self.tasks.slots[slot].take() {
            self.tasks.free.push(slot);
            self.close_outlet(t.outlet);
            self.answer(t.to, r, t.scope.meta.reply);
        }
    }

    /// Sends the answer to a call, with `meta` (what its handler set).
    fn answer(&mut self, to: To, mut result: Result<Payload, RpcError>, mut meta: Metadata) {
        let To { conn, id, echo } = to;
        if let Err(e) = &mut result {
            // The metadata the error carries (a nested call's answer's)
            // goes on, after the handler's.
            meta.extend(std::mem::take(&mut e.metadata));
        }
        // (The metadata travels in the frame too, within the limit: the
        // room the transport keeps for this answer, if it keeps some.)
        let (mut cfg_inline, mut max_inline) =
            (self.node.cfg.inline_max, self.listener.max_inline());
        if let Some(cap) = self.listener.answer_max(conn, id) {
            cfg_inline = cfg_inline.min(cap);
            max_inline = max_inline.min(cap);
        }
        let inline_max = match meta.inline_room(cfg_inline, max_inline) {
            Ok(room) => room,
            Err((len, max)) => {
                result = Err(RpcError::internal(format!(
                    "the answer's metadata of {len} bytes exceeds the limit of {max}"
                )));
                meta = Metadata::new();
                cfg_inline.min(max_inline)
            }
        };
        let refs = self.listener.refs(conn);
        let dir = Dir::Answer(echo);
        let (status, body, made, echoed) =
            match result.and_then(|p| p.into_body(&self.node, inline_max, dir, refs)) {
                Ok((body, lent)) => (Status::Ok, body, lent.made_ref(), lent.is_echo()),
                Err(e) => {
                    let mut msg = e.message.into_bytes();
                    msg.truncate(inline_max.min(4096));
                    let body = if msg.is_empty() {
                        Body::None
                    } else {
                        Body::Inline(msg)
                    };
                    (e.status, body, None, false)
                }
            };
        if status != Status::Ok {
            bump(&self.stats.errors);
        }
        bump(&self.stats.calls);
        crate::stats::count(&body, true);
        let mut frame = match (body, echo) {
            // The request's own Ref, passed back.
            (Body::Refs(_), Some(r)) if echoed => Frame::echo(id, r),
            (body, _) => Frame::response(id, status, body),
        };
        if !meta.is_empty() {
            frame.meta = meta;
        }
        let sent = self.listener.reply(conn, &frame);
        if sent.is_err() {
            // The caller is gone: the answer's Ref is ours to release.
            if let Some(r) = made {
                let _ = self.node.release_ref(&r);
            }
        }
        self.drain();
    }
}

/// Answers `f` with `Unavailable` if it is a request read while the
/// server drains (`draining`), instead of taking it (true).
fn refuse(
    listener: &mut dyn Listener,
    stats: &Stats,
    draining: Option<Instant>,
    conn: ConnId,
    f: &Frame,
) -> bool {
    if draining.is_none() || f.kind != Kind::Request {
        return false;
    }
    stats.refused.fetch_add(1, Ordering::Relaxed);
    let answer = Frame::refused(f.call_id, "the service is shutting down");
    let _ = listener.reply(conn, &answer);
    true
}

/// A frame for a call in progress, read while a handler ran: applied
/// when it returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Later {
    /// The caller of call `.1` of connection `.0` cancelled it.
    Cancel(ConnId, u64),
    /// The caller of stream `.1` of connection `.0` granted `.2` more items.
    Credit(ConnId, u64, u32),
}

/// Moves every frame already waiting in `listener` into `queue`, applying
/// cancels: a cancelled request still queued is answered `Cancelled` and
/// never runs; the other cancels (of calls in progress), and grants of
/// streams in progress, go to `later`.
fn intake(
    listener: &mut dyn Listener,
    queue: &mut VecDeque<Pending>,
    stats: &Stats,
    draining: Option<Instant>,
    later: &mut Vec<Later>,
) {
    while let Ok(Some((conn, frame))) = listener.poll() {
        take_in(listener, queue, stats, draining, later, (conn, frame));
        if queue.len() > 4096 {
            break;
        }
    }
}

/// Takes frame `frame` of connection `conn`, read while a handler runs
/// ([`intake`]): a request is queued (or refused while draining), a cancel
/// applied to a queued request or kept in `later`, a credit added to its
/// queued request's or kept in `later` (for an async stream in progress;
/// dropped there if its stream ended).
#[inline]
pub(crate) fn take_in(
    listener: &mut dyn Listener,
    queue: &mut VecDeque<Pending>,
    stats: &Stats,
    draining: Option<Instant>,
    later: &mut Vec<Later>,
    (conn, frame): (ConnId, Frame),
) {
    match frame.kind {
        Kind::Cancel => {
            // Every request gets exactly one answer (transports count on
            // it to bound what they owe a client): a cancelled one gets
            // `Cancelled`, which its caller, gone, drops.
            if let Some(k) = queue
                .iter()
                .position(|q| q.conn == conn && q.frame.call_id == frame.call_id)
            {
                queue.remove(k);
                stats.cancelled.fetch_add(1, Ordering::Relaxed);
                let _ = listener.reply(
                    conn,
                    &Frame::response(frame.call_id, Status::Cancelled, Body::None),
                );
            } else {
                later.push(Later::Cancel(conn, frame.call_id));
            }
        }
        Kind::Request => {
            if !refuse(listener, stats, draining, conn, &frame) {
                queue.push_back(pending(conn, frame));
            }
        }
        Kind::Credit => {
            // A grant for a stream whose request is queued, or for one in
            // progress.
            if let Some(q) = queue
                .iter_mut()
                .find(|q| q.conn == conn && q.frame.call_id == frame.call_id)
            {
                q.credit += u64::from(frame.method);
            } else {
                later.push(Later::Credit(conn, frame.call_id, frame.method));
            }
        }
        Kind::Response | Kind::GoAway | Kind::Item => {}
    }
}

/// Runs a blocking handler on the dispatcher's thread (borrowed where it is
/// registered: no reference count is touched per call).
fn run_handler(
    h: &Handler,
    name: &str,
    node: &Node,
    (body, metadata): (Body, Metadata),
    scope: &mut Scope,
    cancelled: &mut dyn FnMut() -> bool,
) -> Result<Payload, RpcError> {
    let mut call = Call::of(name, node, (body, metadata), scope)?;
    match crate::deadline::watching(cancelled, || scope.run(|| h(&mut call))) {
        Ok(r) => r,
        Err(p) => Err(panicked(name, &*p)),
    }
}

/// Runs a streaming handler on the dispatcher's thread, as
/// [`run_handler`] runs a blocking one; a look for a cancel of its call
/// is a look through its sink's feed.
fn run_stream(
    h: &StreamHandler,
    name: &str,
    node: &Node,
    (body, metadata): (Body, Metadata),
    scope: &mut Scope,
    sink: &mut Sink<'_>,
) -> Result<(), RpcError> {
    let mut call = Call::of(name, node, (body, metadata), scope)?;
    let feed = sink.feed();
    let mut check = || feed.borrow_mut().cancelled();
    match crate::deadline::watching(&mut check, || scope.run(|| h(&mut call, sink))) {
        Ok(r) => r,
        Err(p) => Err(panicked(name, &*p)),
    }
}

/// Runs the interceptors on a request of `method` (a registered one) in
/// the call's scope: the first error is the call's.
fn intercept(
    interceptors: &[Interceptor],
    method: Option<&(Arc<str>, Method)>,
    frame: &Frame,
    scope: &mut Scope,
) -> Result<(), RpcError> {
    let Some((name, _)) = method.filter(|_| !interceptors.is_empty()) else {
        return Ok(());
    };
    let len = match &frame.payload {
        Body::None => 0,
        Body::Inline(b) => b.len() as u64,
        Body::Refs(rs) => rs.iter().map(|r| r.len).sum(),
    };
    let incoming = Incoming {
        method: name,
        metadata: &frame.meta,
        deadline: scope.deadline,
        len,
    };
    for check in interceptors {
        match scope.run(|| check(&incoming)) {
            Ok(r) => r?,
            Err(p) => {
                let what = panic_text(&*p);
                let e = format!("an interceptor of {name:?} panicked: {what}");
                return Err(RpcError::internal(e));
            }
        }
    }
    Ok(())
}

/// Runs `f`, a handler's work on a call whose deadline is `deadline`: the
/// calls it makes inherit that deadline ([`crate::deadline`]), and a panic
/// is caught.
fn guarded<R>(deadline: Option<Instant>, f: impl FnOnce() -> R) -> std::thread::Result<R> {
    crate::deadline::serving(deadline, || {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
    })
}

/// A handler's panic as the call's `Internal` error.
fn panicked(name: &str, p: &(dyn std::any::Any + Send)) -> RpcError {
    let what = panic_text(p);
    RpcError::internal(format!("the handler of {name:?} panicked: {what}"))
}

/// What a panic said.
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

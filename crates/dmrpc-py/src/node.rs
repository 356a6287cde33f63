//! `dmrpc.Node`, `dmrpc.Server`, `dmrpc.Client`: services and clients from
//! Python. Handlers are Python callables run on the service's dispatcher
//! thread (taking the GIL for the call); a blocking call releases the GIL
//! while it waits. Arguments and results are bytes-like objects (copied
//! once), pool buffers (sent by their pages) or payloads (forwarded
//! untouched), sent inline or by Ref by the size-aware rule; what arrives
//! is a `dmrpc.Payload`, a read-only view with no copy (see
//! [`crate::payload`]).

use crate::aio::{AsyncCaller, PyAsyncClient};
use crate::errors::{to_py, Error as PyDmError};
use crate::mem::PyMemPool;
use crate::payload::{to_payload, PyPayload};
use crate::pool::PyPool;
use dm_rpc::{
    BalancedClient, CallOptions, Client, Config, Node, Retry, RpcError, Server, Status, Transport,
};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::cell::Cell;
use std::sync::Mutex;
use std::time::Duration;

thread_local! {
    static PRIMED: Cell<bool> = const { Cell::new(false) };
}

/// Gives this thread (a dispatcher, not made by Python) a Python thread
/// state that it keeps between calls, so that each handler's `with_gil` is
/// a hand-off of the GIL and not also the creation and deletion of a
/// thread state (which costs several microseconds per call). The state is
/// left to the interpreter, which clears it at exit.
/// (A thread that has a state already, one Python made, keeps it as it is.)
pub(crate) fn keep_thread_state() {
    PRIMED.with(|p| {
        if !p.get() {
            // SAFETY: the interpreter is initialised (this module was
            // imported by it); a thread without a thread state does not
            // hold the GIL: take it with a state of its own, then release
            // the GIL keeping the state (its gilstate count stays at one).
            unsafe {
                if ffi::PyGILState_GetThisThreadState().is_null() {
                    ffi::PyGILState_Ensure();
                    ffi::PyEval_SaveThread();
                }
            }
            p.set(true);
        }
    });
}

/// A client interceptor that calls `f(method, metadata)` (the metadata as
/// pairs): what it returns, unless None, is the call's metadata from
/// then on (a dict or pairs); a `dmrpc.Error` it raises refuses the call
/// with its status (anything else: `Internal`), nothing sent.
pub(crate) fn call_interceptor(
    f: Py<PyAny>,
) -> impl Fn(&mut dm_rpc::OutgoingCall<'_>) -> Result<(), RpcError> + Send + Sync + 'static {
    move |call| {
        keep_thread_state();
        Python::with_gil(|py| {
            let meta = crate::meta::pairs(py, call.metadata())?;
            let r = f.call1(py, (call.method(), meta))?;
            if !r.is_none(py) {
                *call.metadata_mut() = crate::meta::metadata_of(Some(r.bind(py)))?;
            }
            Ok(())
        })
        .map_err(|e| Python::with_gil(|py| to_rpc(py, e)))
    }
}

/// A Python exception raised by a handler, as a typed RPC error: a
/// `dmrpc.Error` keeps its status and its `.metadata` (that of a nested
/// call's answer, or set by the handler), anything else is `Internal`.
pub(crate) fn to_rpc(py: Python<'_>, e: PyErr) -> RpcError {
    let v = e.value(py);
    let msg = v.str().map(|s| s.to_string()).unwrap_or_default();
    if e.is_instance_of::<PyDmError>(py) {
        let meta = v
            .getattr("metadata")
            .ok()
            .and_then(|m| crate::meta::metadata_of(Some(&m)).ok())
            .unwrap_or_default();
        let status = v
            .getattr("status")
            .and_then(|s| s.extract::<String>())
            .unwrap_or_default();
        let st = crate::errors::status_named(&status).unwrap_or(Status::Internal);
        return RpcError::new(st, msg).with_metadata(meta);
    }
    RpcError::internal(format!(
        "{}: {msg}",
        v.get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default()
    ))
}

/// This process's RPC endpoint on a pool.
#[pyclass(module = "dmrpc._native", name = "Node", frozen)]
#[derive(Debug)]
pub struct PyNode {
    node: Node,
}

#[pymethods]
impl PyNode {
    /// A node on `pool`. With `memservers`, large payloads to nodes of
    /// other pools that use the same memory servers travel by their Refs.
    /// `inline_max`: payloads up to this many bytes go inline, larger ones
    /// by Ref (default: `dmrpc.DEFAULT_INLINE_MAX`), capped by what a
    /// connection's frames carry (over shared memory, half a ring).
    /// `by_value`: every payload inline, whatever its size; one too large
    /// for the connection's frames raises `ResourceExhausted`.
    /// `key_file`: the access key of TCP connections (`dmrpc key new FILE`
    /// makes one): its services serve only TCP clients that prove it, its
    /// clients connect only to servers that prove it. `tcp_open`: listen
    /// on TCP beyond loopback without a key.
    #[new]
    #[pyo3(signature = (pool, memservers=None, inline_max=None, by_value=false, key_file=None, tcp_open=false))]
    fn new(
        pool: &PyPool,
        memservers: Option<&PyMemPool>,
        inline_max: Option<usize>,
        by_value: bool,
        key_file: Option<std::path::PathBuf>,
        tcp_open: bool,
    ) -> PyResult<PyNode> {
        let mut cfg = Config {
            by_value,
            tcp_open,
            tcp_key: key_file
                .map(dm_pool::auth::Key::from_file)
                .transpose()
                .map_err(crate::errors::pool_err)?,
            ..Config::default()
        };
        if let Some(m) = inline_max {
            cfg.inline_max = m;
        }
        let mut node = Node::with_config(pool.get()?, cfg);
        if let Some(m) = memservers {
            node = node.with_memserver(m.get()?);
        }
        Ok(PyNode { node })
    }

    /// Registers service `name` with `handlers` ({method: callable}) on the
    /// pool's shared-memory rings, or on TCP at `tcp` (`host:port`, port 0
    /// picks one; still listed in the pool's registry). Each callable
    /// takes the `Payload` that arrived and returns None, a bytes-like
    /// object, a `Buffer`, or a `Payload` (forwarded untouched).
    /// `intercept`, if given, is called as `intercept(method, metadata)`
    /// before every handler; a `dmrpc.Error` it raises is the call's
    /// answer and the handler does not run. `propagate`: metadata keys
    /// whose values the calls a handler makes inherit from the call it
    /// serves. `replica`: register as one replica of `name`, which any
    /// number of servers may share (balanced clients spread their calls
    /// over them: `connect(name, balanced=True)`). `streams`: streaming
    /// methods ({method: callable}), each taking the `Payload` that arrived
    /// and returning an iterable (a generator, say) of items, sent to the
    /// caller as they come (`Client.call_stream`); raising a `dmrpc.Error`
    /// ends the stream with its status. `bidi`: methods whose caller sends
    /// items too (`Client.call_bidi`), each taking the request's `Payload`
    /// and an `Inbox` (an iterator of the caller's items) and returning an
    /// iterable of answer items. `wait_for_name`: seconds to wait
    /// for a name a live process holds (default: raise
    /// `dmrpc.AlreadyExists` at once, naming the holder). A process that
    /// died, even one not yet reaped, holds no name.
    #[pyo3(signature = (name, handlers, tcp=None, intercept=None, propagate=None, replica=false, streams=None, wait_for_name=None, bidi=None))]
    #[allow(clippy::too_many_arguments)]
    fn serve(
        &self,
        py: Python<'_>,
        name: &str,
        handlers: &Bound<'_, PyDict>,
        tcp: Option<String>,
        intercept: Option<Py<PyAny>>,
        propagate: Option<Vec<String>>,
        replica: bool,
        streams: Option<&Bound<'_, PyDict>>,
        wait_for_name: Option<f64>,
        bidi: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyServer> {
        let mut b = self.node.server(name);
        if replica {
            b = b.replica();
        }
        if let Some(s) = wait_for_name {
            let d = Duration::try_from_secs_f64(s).map_err(|_| {
                to_py(RpcError::invalid_argument(format!(
                    "wait_for_name {s} is not a duration in seconds"
                )))
            })?;
            b = b.wait_for_name(d);
        }
        if let Some(addr) = tcp {
            b = b.transport(Transport::Tcp(addr));
        }
        if let Some(keys) = propagate {
            b = b.propagate_metadata(keys);
        }
        if let Some(f) = intercept {
            b = b.intercept(move |inc| {
                keep_thread_state();
                Python::with_gil(|py| {
                    let meta = crate::meta::pairs(py, inc.metadata())?;
                    f.call1(py, (inc.method(), meta)).map(drop)
                })
                .map_err(|e| Python::with_gil(|py| to_rpc(py, e)))
            });
        }
        for (k, v) in handlers.iter() {
            let method: String = k.extract()?;
            let f: Py<PyAny> = v.unbind();
            b = b.method(&method, move |call| {
                let node = call.node().clone();
                let arg = PyPayload::new(call.take_payload(), node.clone());
                keep_thread_state();
                crate::meta::serving(call.metadata(), || {
                    Python::with_gil(|py| {
                        f.call1(py, (arg,))
                            .and_then(|r| to_payload(py, &node, Some(r.bind(py))))
                            .map_err(|e| to_rpc(py, e))
                    })
                })
            });
        }
        for (k, v) in streams.into_iter().flat_map(|d| d.iter()) {
            let method: String = k.extract()?;
            b = b.method_stream(&method, crate::stream::handler(v.unbind()));
        }
        for (k, v) in bidi.into_iter().flat_map(|d| d.iter()) {
            let method: String = k.extract()?;
            b = b.method_bidi(&method, crate::stream::bidi_handler(v.unbind()));
        }
        let server = py.allow_threads(|| b.spawn()).map_err(to_py)?;
        Ok(PyServer {
            server: Mutex::new(Some(server)),
        })
    }

    /// Connects to service `name` (found in the pool's registry). `lazy`:
    /// connect on the first call instead, for a caller that may start
    /// before the service (until it registers, calls raise `Unavailable`,
    /// or wait for it with `wait_for_ready=True`). `balanced`: connect to
    /// every replica of the name (`serve(..., replica=True)`) and spread
    /// the calls over them, following replicas as they come and go.
    #[pyo3(signature = (name, lazy=false, balanced=false))]
    fn connect(
        &self,
        py: Python<'_>,
        name: &str,
        lazy: bool,
        balanced: bool,
    ) -> PyResult<PyClient> {
        let client = py
            .allow_threads(|| match (lazy, balanced) {
                (true, true) => Err(RpcError::invalid_argument(
                    "a balanced client connects at once: lazy=True and balanced=True do not go together",
                )),
                (true, false) => self.node.connect_lazily(name).map(Caller::One),
                (false, false) => self.node.connect(name).map(Caller::One),
                (false, true) => self.node.connect_balanced(name).map(Caller::Replicas),
            })
            .map_err(to_py)?;
        Ok(PyClient {
            client,
            node: self.node.clone(),
        })
    }

    /// Connects to a service by TCP address (`host:port`), for a server
    /// whose pool this process is not attached to.
    fn connect_tcp(&self, py: Python<'_>, addr: &str) -> PyResult<PyClient> {
        let client = py
            .allow_threads(|| self.node.connect_tcp(addr))
            .map(Caller::One)
            .map_err(to_py)?;
        Ok(PyClient {
            client,
            node: self.node.clone(),
        })
    }

    /// Connects to service `name` for asyncio code (see `dmrpc.aio`;
    /// `lazy` and `balanced` as in `connect`).
    #[pyo3(signature = (name, lazy=false, balanced=false))]
    fn connect_async(
        &self,
        py: Python<'_>,
        name: &str,
        lazy: bool,
        balanced: bool,
    ) -> PyResult<PyAsyncClient> {
        let client = py
            .allow_threads(|| match (lazy, balanced) {
                (true, true) => Err(RpcError::invalid_argument(
                    "a balanced client connects at once: lazy=True and balanced=True do not go together",
                )),
                (true, false) => self.node.connect_async_lazily(name).map(AsyncCaller::One),
                (false, false) => self.node.connect_async(name).map(AsyncCaller::One),
                (false, true) => self
                    .node
                    .connect_balanced_async(name)
                    .map(AsyncCaller::Replicas),
            })
            .map_err(to_py)?;
        Ok(PyAsyncClient::new(client, self.node.clone()))
    }

    /// Connects to a service by TCP address for asyncio code.
    fn connect_tcp_async(&self, py: Python<'_>, addr: &str) -> PyResult<PyAsyncClient> {
        let client = py
            .allow_threads(|| self.node.connect_tcp_async(addr))
            .map(AsyncCaller::One)
            .map_err(to_py)?;
        Ok(PyAsyncClient::new(client, self.node.clone()))
    }
}

/// A running service; `shutdown()` (or garbage collection) stops it.
#[pyclass(module = "dmrpc._native", name = "Server", frozen)]
#[derive(Debug)]
pub struct PyServer {
    server: Mutex<Option<Server>>,
}

#[pymethods]
impl PyServer {
    /// The TCP address the service listens on (None on shared memory).
    #[getter]
    fn tcp_addr(&self) -> Option<String> {
        let g = self.server.lock().ok()?;
        g.as_ref()?.tcp_addr().map(str::to_owned)
    }

    /// Stops taking calls and unregisters. With `grace` (seconds), first
    /// serves every call already sent and refuses new ones (`Unavailable`),
    /// for at most that long. Requests it did not run are refused or
    /// marked unread, and their callers send them to the service's next
    /// server, if any.
    #[pyo3(signature = (grace=None))]
    fn shutdown(&self, py: Python<'_>, grace: Option<f64>) -> PyResult<()> {
        let grace = match grace {
            Some(g) if g.is_finite() && g >= 0.0 => Some(Duration::from_secs_f64(g)),
            Some(g) => {
                return Err(to_py(RpcError::invalid_argument(format!(
                    "grace {g} is not a duration"
                ))))
            }
            None => None,
        };
        let s = self.server.lock().ok().and_then(|mut g| g.take());
        // Without the GIL: a handler in flight may need it to finish.
        py.allow_threads(|| match (s, grace) {
            (Some(s), Some(g)) => s.shutdown_gracefully(g),
            (s, _) => drop(s),
        });
        Ok(())
    }
}

impl Drop for PyServer {
    fn drop(&mut self) {
        let s = self.server.get_mut().ok().and_then(Option::take);
        if s.is_some() {
            Python::with_gil(|py| py.allow_threads(|| drop(s)));
        }
    }
}

/// A retry policy from Python: None, or a dict with `attempts` (in all,
/// the first included), `on` (status names or `dmrpc.Error` classes),
/// and optionally `backoff` and `max_backoff` in seconds.
pub(crate) fn retry_of(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Retry>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    let bad = |why: String| to_py(RpcError::invalid_argument(format!("retry: {why}")));
    let d = obj
        .downcast::<PyDict>()
        .map_err(|_| bad("a dict of attempts, on, backoff, max_backoff".into()))?;
    let attempts: u32 = match d.get_item("attempts")? {
        Some(a) => a.extract()?,
        None => return Err(bad("attempts missing".into())),
    };
    let mut on = Vec::new();
    if let Some(list) = d.get_item("on")? {
        for s in list.try_iter()? {
            let s = s?;
            // A class of exception says its status as `.status`.
            let name: String = match s.extract() {
                Ok(n) => n,
                Err(_) => s.getattr("status")?.extract()?,
            };
            on.push(
                crate::errors::status_named(&name)
                    .ok_or_else(|| bad(format!("no status {name:?}")))?,
            );
        }
    }
    let secs = |k: &str, default: Duration| -> PyResult<Duration> {
        match d.get_item(k)? {
            None => Ok(default),
            Some(v) => {
                let f: f64 = v.extract()?;
                Duration::try_from_secs_f64(f)
                    .map_err(|_| bad(format!("{k} {f} is not a duration")))
            }
        }
    };
    let r = Retry::new(attempts, &on);
    let backoff = secs("backoff", r.first_backoff())?;
    let max = secs("max_backoff", r.max_backoff())?;
    Ok(Some(r.backoff(backoff, max)))
}

/// A call's options from its `timeout` in seconds, whether it is
/// `detached` from the deadline of a call being served, waits for its
/// service to be back (`wait_for_ready`) and may run twice (`idempotent`).
pub(crate) fn call_options(
    timeout: Option<f64>,
    detached: bool,
    wait_for_ready: bool,
    idempotent: bool,
) -> PyResult<CallOptions> {
    let opts = match timeout {
        Some(t) if t.is_finite() && t >= 0.0 => CallOptions::deadline(Duration::from_secs_f64(t)),
        Some(t) => {
            return Err(to_py(RpcError::invalid_argument(format!(
                "timeout {t} is not a duration"
            ))))
        }
        None => CallOptions::default(),
    };
    let opts = if detached { opts.detached() } else { opts };
    let opts = if idempotent { opts.idempotent() } else { opts };
    Ok(if wait_for_ready {
        opts.wait_for_ready()
    } else {
        opts
    })
}

/// What a Python client calls through: one connection, or one to each
/// replica of its service (`connect(name, balanced=True)`).
#[derive(Clone, Debug)]
enum Caller {
    One(Client),
    Replicas(BalancedClient),
}

impl Caller {
    fn call_full(
        &self,
        method: &str,
        p: dm_rpc::Payload,
        opts: CallOptions,
        meta: dm_rpc::Metadata,
    ) -> Result<dm_rpc::Reply, RpcError> {
        match self {
            Caller::One(c) => c.call_full(method, p, opts, meta),
            Caller::Replicas(c) => c.call_full(method, p, opts, meta),
        }
    }

    fn with_retry(&self, r: Retry) -> Caller {
        match self {
            Caller::One(c) => Caller::One(c.with_retry(r)),
            Caller::Replicas(c) => Caller::Replicas(c.with_retry(r)),
        }
    }

    fn with_metadata(&self, m: dm_rpc::Metadata) -> Caller {
        match self {
            Caller::One(c) => Caller::One(c.with_metadata(m)),
            Caller::Replicas(c) => Caller::Replicas(c.with_metadata(m)),
        }
    }

    fn intercept(&self, f: Py<PyAny>) -> Caller {
        match self {
            Caller::One(c) => Caller::One(c.intercept(call_interceptor(f))),
            Caller::Replicas(c) => Caller::Replicas(c.intercept(call_interceptor(f))),
        }
    }

    fn reconnects(&self) -> u64 {
        match self {
            Caller::One(c) => c.reconnects(),
            Caller::Replicas(c) => c.reconnects(),
        }
    }

    fn replicas(&self) -> usize {
        match self {
            Caller::One(c) => c.is_connected() as usize,
            Caller::Replicas(c) => c.replicas(),
        }
    }
}

/// A connection to a service (or to each of its replicas).
#[pyclass(module = "dmrpc._native", name = "Client", frozen)]
#[derive(Debug)]
pub struct PyClient {
    client: Caller,
    node: Node,
}

#[pymethods]
impl PyClient {
    /// Calls `method` with `data` (None, a bytes-like object, a `Buffer`
    /// or a `Payload`); returns the answer as a `Payload`. `timeout` in
    /// seconds. Called from a service's handler, the call waits no longer
    /// than the handler's own caller does, unless `detached`. With
    /// `wait_for_ready`, a call whose service went away waits (until its
    /// timeout) for it to be registered again instead of raising
    /// `Unavailable` at once. An `idempotent` call may run twice: if its
    /// connection breaks while it is in flight, it is sent again.
    /// `metadata` (a dict, or `(key, value)` pairs; values `str` or
    /// bytes-like) goes with the call; the handler reads it with
    /// `dmrpc.metadata()`.
    #[pyo3(signature = (method, data=None, timeout=None, detached=false, wait_for_ready=false, idempotent=false, metadata=None, retry=None))]
    #[allow(clippy::too_many_arguments)]
    fn call<'py>(
        &self,
        py: Python<'py>,
        method: &str,
        data: Option<&Bound<'py, PyAny>>,
        timeout: Option<f64>,
        detached: bool,
        wait_for_ready: bool,
        idempotent: bool,
        metadata: Option<&Bound<'py, PyAny>>,
        retry: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<PyPayload> {
        let meta = crate::meta::metadata_of(metadata)?;
        let p = to_payload(py, &self.node, data)?;
        let mut opts = call_options(timeout, detached, wait_for_ready, idempotent)?;
        opts.retry = retry_of(retry)?;
        let out = py
            .allow_threads(|| self.client.call_full(method, p, opts, meta))
            .map_err(to_py)?;
        Ok(PyPayload::answer(out, self.node.clone()))
    }

    /// Calls streaming method `method` with `data`, as `call` does (the
    /// `timeout` bounds the whole stream); returns the `Stream` of its
    /// items, an iterator. `window`: how many items it holds unread at
    /// most (default 16).
    #[pyo3(signature = (method, data=None, timeout=None, window=None, wait_for_ready=false, idempotent=false, metadata=None))]
    #[allow(clippy::too_many_arguments)]
    fn call_stream<'py>(
        &self,
        py: Python<'py>,
        method: &str,
        data: Option<&Bound<'py, PyAny>>,
        timeout: Option<f64>,
        window: Option<u32>,
        wait_for_ready: bool,
        idempotent: bool,
        metadata: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<crate::stream::PyStream> {
        let meta = crate::meta::metadata_of(metadata)?;
        let p = to_payload(py, &self.node, data)?;
        let opts =
            call_options(timeout, false, wait_for_ready, idempotent)?.window(window.unwrap_or(0));
        let st = py
            .allow_threads(|| match &self.client {
                Caller::One(c) => c.call_stream_with(method, p, opts, meta),
                Caller::Replicas(c) => c.call_stream_with(method, p, opts, meta),
            })
            .map_err(to_py)?;
        Ok(crate::stream::PyStream::new(st, self.node.clone()))
    }

    /// Calls `method` with `data`, then sends items as it goes: returns a
    /// `Bidi`, whose `send(item)` and `finish()` write the caller's items
    /// and which iterates over the answer's. The `timeout` bounds the
    /// whole call. A balanced client does not make such calls (its
    /// items would have to follow one replica).
    #[pyo3(signature = (method, data=None, timeout=None, wait_for_ready=false, metadata=None))]
    fn call_bidi<'py>(
        &self,
        py: Python<'py>,
        method: &str,
        data: Option<&Bound<'py, PyAny>>,
        timeout: Option<f64>,
        wait_for_ready: bool,
        metadata: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<crate::stream::PyBidi> {
        let meta = crate::meta::metadata_of(metadata)?;
        let p = to_payload(py, &self.node, data)?;
        let opts = call_options(timeout, false, wait_for_ready, false)?;
        let b = py
            .allow_threads(|| match &self.client {
                Caller::One(c) => c.call_bidi_with(method, p, opts, meta),
                Caller::Replicas(_) => Err(RpcError::invalid_argument(
                    "a balanced client makes no calls whose caller sends items: \
                     connect without balanced=True",
                )),
            })
            .map_err(to_py)?;
        Ok(crate::stream::PyBidi::new(b, self.node.clone()))
    }

    /// A client on the same connection whose calls that pass no `retry`
    /// follow this policy (a dict, as `call`'s `retry`).
    fn with_retry(&self, retry: &Bound<'_, PyAny>) -> PyResult<PyClient> {
        let client = match retry_of(Some(retry))? {
            Some(r) => self.client.with_retry(r),
            None => self.client.clone(),
        };
        Ok(PyClient {
            client,
            node: self.node.clone(),
        })
    }

    /// A client on the same connection whose calls all carry `metadata` (a
    /// credential, a client name), besides their own; a key a call sets
    /// itself keeps the call's value.
    fn with_metadata(&self, metadata: &Bound<'_, PyAny>) -> PyResult<PyClient> {
        let m = crate::meta::metadata_of(Some(metadata))?;
        Ok(PyClient {
            client: self.client.with_metadata(m),
            node: self.node.clone(),
        })
    }

    /// A client on the same connection whose calls all pass `f` first:
    /// `f(method, metadata)` runs before each call is sent (the metadata
    /// as pairs, the client's `with_metadata` keys included); what it
    /// returns, unless None, is the call's metadata from then on (a dict
    /// or pairs: a fresh token, a trace id); a `dmrpc.Error` it raises
    /// refuses the call with its status, nothing sent.
    fn intercept(&self, f: Py<PyAny>) -> PyClient {
        PyClient {
            client: self.client.intercept(f),
            node: self.node.clone(),
        }
    }

    /// How many times the client connected again: after its connection
    /// broke, a call finds the service registered again (a restarted
    /// server, or another process taking its name) and calls it; of a
    /// balanced client, how many times its connections failed over.
    #[getter]
    fn reconnects(&self) -> u64 {
        self.client.reconnects()
    }

    /// How many replicas new calls may go to (a client of one connection:
    /// 1 while it is connected, else 0).
    #[getter]
    fn replicas(&self) -> usize {
        self.client.replicas()
    }
}

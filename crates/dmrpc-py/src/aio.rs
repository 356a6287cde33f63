//! `dmrpc._native.AsyncClient`: calls that complete asyncio futures, with
//! no thread per call. A call is [`dm_rpc::AsyncClient`]'s: it reads its
//! own answer while it spins, or leaves the wait to the connection's pump.
//! It is first polled on the caller's thread (without the GIL): an answer
//! that comes within the spin completes the asyncio future at once.
//! Otherwise the call becomes a task of one tokio runtime shared by the
//! process's async clients (one worker thread, started on first use),
//! which hands the `Payload` (or the exception) to the caller's event loop
//! with `call_soon_threadsafe` when it completes. Cancelling the call (the awaiting
//! task was cancelled) drops the task's future, which cancels the call as
//! a dropped Rust call does: the server is told, and what the argument
//! lent is released. `dmrpc.aio` wraps this in coroutines.

use crate::errors::to_py;
use crate::node::{call_options, keep_thread_state};
use crate::payload::{to_payload, PyPayload};
use dm_rpc::{AsyncBalancedClient, AsyncClient, AsyncStreaming, Node, RpcError};
use pyo3::prelude::*;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};

/// The runtime of every async client's calls in this process.
fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    if let Some(rt) = RT.get() {
        return Ok(rt);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("dmrpc-aio")
        .enable_all()
        .build()
        .map_err(|e| to_py(RpcError::internal(format!("cannot start a runtime: {e}"))))?;
    // (Two threads racing here each build one; the loser's is dropped.)
    Ok(RT.get_or_init(|| rt))
}

/// What an async Python client calls through: one connection, or one to
/// each replica of its service.
#[derive(Clone, Debug)]
pub(crate) enum AsyncCaller {
    One(AsyncClient),
    Replicas(AsyncBalancedClient),
}

impl AsyncCaller {
    async fn call_full(
        &self,
        method: &str,
        p: dm_rpc::Payload,
        opts: dm_rpc::CallOptions,
        meta: dm_rpc::Metadata,
    ) -> Result<dm_rpc::Reply, RpcError> {
        match self {
            AsyncCaller::One(c) => c.call_full(method, p, opts, meta).await,
            AsyncCaller::Replicas(c) => c.call_full(method, p, opts, meta).await,
        }
    }

    async fn call_stream(
        &self,
        method: &str,
        p: dm_rpc::Payload,
        opts: dm_rpc::CallOptions,
        meta: dm_rpc::Metadata,
    ) -> Result<AsyncStreaming, RpcError> {
        match self {
            AsyncCaller::One(c) => c.call_stream_with(method, p, opts, meta).await,
            AsyncCaller::Replicas(c) => c.call_stream_with(method, p, opts, meta).await,
        }
    }

    async fn call_bidi(
        &self,
        method: &str,
        p: dm_rpc::Payload,
        opts: dm_rpc::CallOptions,
        meta: dm_rpc::Metadata,
    ) -> Result<dm_rpc::stream::AsyncBidi, RpcError> {
        match self {
            AsyncCaller::One(c) => c.call_bidi_with(method, p, opts, meta).await,
            AsyncCaller::Replicas(_) => Err(RpcError::invalid_argument(
                "a balanced client makes no calls whose caller sends items: \
                 connect without balanced=True",
            )),
        }
    }

    fn with_retry(&self, r: dm_rpc::Retry) -> AsyncCaller {
        match self {
            AsyncCaller::One(c) => AsyncCaller::One(c.with_retry(r)),
            AsyncCaller::Replicas(c) => AsyncCaller::Replicas(c.with_retry(r)),
        }
    }

    fn with_metadata(&self, m: dm_rpc::Metadata) -> AsyncCaller {
        match self {
            AsyncCaller::One(c) => AsyncCaller::One(c.with_metadata(m)),
            AsyncCaller::Replicas(c) => AsyncCaller::Replicas(c.with_metadata(m)),
        }
    }

    fn intercept(&self, f: Py<PyAny>) -> AsyncCaller {
        let check = crate::node::call_interceptor(f);
        match self {
            AsyncCaller::One(c) => AsyncCaller::One(c.intercept(check)),
            AsyncCaller::Replicas(c) => AsyncCaller::Replicas(c.intercept(check)),
        }
    }

    fn reconnects(&self) -> u64 {
        match self {
            AsyncCaller::One(c) => c.reconnects(),
            AsyncCaller::Replicas(c) => c.reconnects(),
        }
    }

    fn replicas(&self) -> usize {
        match self {
            AsyncCaller::One(c) => c.is_connected() as usize,
            AsyncCaller::Replicas(c) => c.replicas(),
        }
    }
}

/// An async connection to a service (or to each of its replicas).
#[pyclass(module = "dmrpc._native", name = "AsyncClient", frozen)]
#[derive(Debug)]
pub struct PyAsyncClient {
    client: AsyncCaller,
    node: Node,
}

impl PyAsyncClient {
    pub(crate) fn new(client: AsyncCaller, node: Node) -> Self {
        PyAsyncClient { client, node }
    }
}

#[pymethods]
impl PyAsyncClient {
    /// A client on the same connection whose calls that pass no `retry`
    /// follow this policy (see `Client.with_retry`).
    fn with_retry(&self, retry: &Bound<'_, PyAny>) -> PyResult<PyAsyncClient> {
        let client = match crate::node::retry_of(Some(retry))? {
            Some(r) => self.client.with_retry(r),
            None => self.client.clone(),
        };
        Ok(PyAsyncClient::new(client, self.node.clone()))
    }

    /// A client on the same connection whose calls all carry `metadata`
    /// (see `Client.with_metadata`).
    fn with_metadata(&self, metadata: &Bound<'_, PyAny>) -> PyResult<PyAsyncClient> {
        let m = crate::meta::metadata_of(Some(metadata))?;
        Ok(PyAsyncClient::new(
            self.client.with_metadata(m),
            self.node.clone(),
        ))
    }

    /// A client on the same connection whose calls all pass `f` first
    /// (see `Client.intercept`).
    fn intercept(&self, f: Py<PyAny>) -> PyAsyncClient {
        PyAsyncClient::new(self.client.intercept(f), self.node.clone())
    }

    /// How many times the client connected again (see `Client.reconnects`).
    #[getter]
    fn reconnects(&self) -> u64 {
        self.client.reconnects()
    }

    /// How many replicas new calls may go to (see `Client.replicas`).
    #[getter]
    fn replicas(&self) -> usize {
        self.client.replicas()
    }

    /// Starts a call of `method` with `data` (as `Client.call`). When the
    /// call completes, `resolve(fut, ok, value)` is called: `ok` True with
    /// the answer's `Payload`, or False with the exception. That happens
    /// here if the answer comes within the spin of the first poll (or the
    /// call fails at once), else later on `event_loop`
    /// (`call_soon_threadsafe`). The `CallHandle` returned cancels the
    /// call.
    #[pyo3(signature = (method, data, timeout, event_loop, fut, resolve, detached=false, wait_for_ready=false, idempotent=false, metadata=None, retry=None))]
    #[allow(clippy::too_many_arguments)]
    fn start(
        &self,
        py: Python<'_>,
        method: String,
        data: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
        event_loop: Py<PyAny>,
        fut: Py<PyAny>,
        resolve: Py<PyAny>,
        detached: bool,
        wait_for_ready: bool,
        idempotent: bool,
        metadata: Option<&Bound<'_, PyAny>>,
        retry: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyCallHandle> {
        let meta = crate::meta::metadata_of(metadata)?;
        let p = to_payload(py, &self.node, data)?;
        let mut opts = call_options(timeout, detached, wait_for_ready, idempotent)?;
        opts.retry = crate::node::retry_of(retry)?;
        let client = self.client.clone();
        let call = async move { client.call_full(&method, p, opts, meta).await };
        let node = self.node.clone();
        drive(
            py,
            Box::pin(call),
            (event_loop, fut, resolve),
            move |py, r| outcome(py, r, node),
        )
    }

    /// Starts a streaming call of `method` with `data` (as
    /// `Client.call_stream`): `resolve(fut, ok, value)` is called with the
    /// `AsyncStream` once the request is sent, or with the exception (as
    /// `start` does). The `CallHandle` returned cancels the opening.
    #[pyo3(signature = (method, data, timeout, event_loop, fut, resolve, window=None, wait_for_ready=false, idempotent=false, metadata=None))]
    #[allow(clippy::too_many_arguments)]
    fn start_stream(
        &self,
        py: Python<'_>,
        method: String,
        data: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
        event_loop: Py<PyAny>,
        fut: Py<PyAny>,
        resolve: Py<PyAny>,
        window: Option<u32>,
        wait_for_ready: bool,
        idempotent: bool,
        metadata: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyCallHandle> {
        let meta = crate::meta::metadata_of(metadata)?;
        let p = to_payload(py, &self.node, data)?;
        let opts = call_options(timeout, false, wait_for_ready, idempotent)?;
        let opts = opts.window(window.unwrap_or(0));
        let client = self.client.clone();
        let open = async move { client.call_stream(&method, p, opts, meta).await };
        let node = self.node.clone();
        drive(
            py,
            Box::pin(open),
            (event_loop, fut, resolve),
            move |py, r| opened(py, r.map(|st| PyAsyncStream::new(st, node))),
        )
    }

    /// Starts a call of `method` with `data` whose caller sends items too
    /// (as `Client.call_bidi`): `resolve(fut, ok, value)` is called with
    /// the `AsyncBidi` once the request is sent, or with the exception.
    #[pyo3(signature = (method, data, timeout, event_loop, fut, resolve, wait_for_ready=false, metadata=None))]
    #[allow(clippy::too_many_arguments)]
    fn start_bidi(
        &self,
        py: Python<'_>,
        method: String,
        data: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
        event_loop: Py<PyAny>,
        fut: Py<PyAny>,
        resolve: Py<PyAny>,
        wait_for_ready: bool,
        metadata: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyCallHandle> {
        let meta = crate::meta::metadata_of(metadata)?;
        let p = to_payload(py, &self.node, data)?;
        let opts = call_options(timeout, false, wait_for_ready, false)?;
        let client = self.client.clone();
        let open = async move { client.call_bidi(&method, p, opts, meta).await };
        let node = self.node.clone();
        drive(
            py,
            Box::pin(open),
            (event_loop, fut, resolve),
            move |py, r| opened(py, r.map(|b| PyAsyncBidi::new(b, node))),
        )
    }
}

/// An opening's result for `resolve`: the Python object of what opened,
/// or the exception.
fn opened<T>(py: Python<'_>, r: Result<T, RpcError>) -> (bool, Py<PyAny>)
where
    T: Into<pyo3::PyClassInitializer<T>> + pyo3::PyClass,
{
    match r.and_then(|t| Py::new(py, t).map_err(|e| RpcError::internal(e.to_string()))) {
        Ok(t) => (true, t.into_any()),
        Err(e) => (false, to_py(e).into_value(py).into_any()),
    }
}

/// Where a future's outcome goes: the caller's event loop, the asyncio
/// future, and the function that completes it (`resolve(fut, ok, value)`).
type Resolver = (Py<PyAny>, Py<PyAny>, Py<PyAny>);

/// Runs `work` to its end and hands its outcome, as `outcome` makes it
/// (`ok`, and the value or the exception), to `resolve`. It is first polled
/// here, without the GIL: work done within its first poll (an answer that
/// comes within its spin, the waiting policy's, adaptive; an item already
/// there) completes with no thread in between, as a Rust async call does.
/// Only work still waiting after it goes to the runtime, which resolves on
/// the event loop (`call_soon_threadsafe`).
fn drive<T: Send + 'static>(
    py: Python<'_>,
    mut work: Pin<Box<dyn Future<Output = T> + Send>>,
    (event_loop, fut, resolve): Resolver,
    outcome: impl FnOnce(Python<'_>, T) -> (bool, Py<PyAny>) + Send + 'static,
) -> PyResult<PyCallHandle> {
    let rt = runtime()?;
    let first = py.allow_threads(|| {
        let _in_rt = rt.enter();
        let mut cx = Context::from_waker(Waker::noop());
        work.as_mut().poll(&mut cx)
    });
    if let Poll::Ready(r) = first {
        let (ok, value) = outcome(py, r);
        resolve.call1(py, (fut, ok, value))?;
        return Ok(PyCallHandle { task: None });
    }
    let task = rt.spawn(async move {
        let r = work.await;
        keep_thread_state();
        Python::with_gil(|py| {
            let (ok, value) = outcome(py, r);
            // A closed loop has nobody left to tell: the outcome goes with
            // `value`.
            let _ = event_loop.call_method1(py, "call_soon_threadsafe", (resolve, fut, ok, value));
        });
    });
    Ok(PyCallHandle {
        task: Some(task.abort_handle()),
    })
}

/// The items of an async streaming call, read with `next` (`dmrpc.aio`
/// makes it an async iterator). Each `next` is a task of the runtime (or
/// done in its first poll, if the item is there): cancelling it loses
/// nothing (the item it waited for is the next one's). `close()`, or
/// dropping it before the end, cancels the call.
#[pyclass(module = "dmrpc._native", name = "AsyncStream", frozen)]
#[derive(Debug)]
pub struct PyAsyncStream {
    /// (Held across the wait of the `next` in progress; another waits
    /// for it.)
    st: Arc<tokio::sync::Mutex<Option<AsyncStreaming>>>,
    /// The `next` in progress, cancelled by `close`.
    reading: Mutex<Option<tokio::task::AbortHandle>>,
    node: Node,
}

impl PyAsyncStream {
    fn new(st: AsyncStreaming, node: Node) -> PyAsyncStream {
        PyAsyncStream {
            st: Arc::new(tokio::sync::Mutex::new(Some(st))),
            reading: Mutex::new(None),
            node,
        }
    }
}

#[pymethods]
impl PyAsyncStream {
    /// Reads the next item: `resolve(fut, True, Payload)`, `(fut, True,
    /// None)` at the end, or `(fut, False, exception)` if the stream ended
    /// with an error (as `start`).
    fn next(
        &self,
        py: Python<'_>,
        event_loop: Py<PyAny>,
        fut: Py<PyAny>,
        resolve: Py<PyAny>,
    ) -> PyResult<PyCallHandle> {
        let st = self.st.clone();
        let read = async move {
            match st.lock().await.as_mut() {
                Some(s) => s.next().await,
                None => None,
            }
        };
        let node = self.node.clone();
        let h = drive(
            py,
            Box::pin(read),
            (event_loop, fut, resolve),
            move |py, r| match r.map(|r| r.map(|p| Py::new(py, PyPayload::new(p, node)))) {
                None => (true, py.None()),
                Some(Ok(Ok(p))) => (true, p.into_any()),
                Some(Ok(Err(e))) => (false, e.into_value(py).into_any()),
                Some(Err(e)) => (false, to_py(e).into_value(py).into_any()),
            },
        )?;
        *self.reading.lock().unwrap_or_else(|e| e.into_inner()) = h.task.clone();
        Ok(h)
    }

    /// Cancels the call if it has not ended (its server is told), and
    /// releases what came and was not read; a `next` in progress ends.
    fn close(&self, py: Python<'_>) {
        if let Some(t) = self
            .reading
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            t.abort();
        }
        let st = self.st.clone();
        py.allow_threads(|| {
            if let Ok(mut g) = st.try_lock() {
                drop(g.take());
                return;
            }
            // (The aborted `next` lets it go on the runtime.)
            if let Ok(rt) = runtime() {
                rt.spawn(async move { drop(st.lock().await.take()) });
            }
        });
    }

    /// The metadata of the answer that ended the stream, as `(key, value)`
    /// pairs (empty before the end, and while a `next` is in progress).
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
        let empty = dm_rpc::Metadata::new();
        match self.st.try_lock() {
            Ok(g) => crate::meta::pairs(py, g.as_ref().map_or(&empty, |s| s.metadata())),
            Err(_) => crate::meta::pairs(py, &empty),
        }
    }
}

/// The caller's end of an async call whose caller sends items: `send` and
/// `finish` its items, `next` for the answer's (`dmrpc.aio` makes it an
/// async iterator). The two halves lock apart: one task may send while
/// another reads. `close()`, or dropping it before the end, cancels the
/// call.
#[pyclass(module = "dmrpc._native", name = "AsyncBidi", frozen)]
#[derive(Debug)]
pub struct PyAsyncBidi {
    items: Arc<tokio::sync::Mutex<Option<dm_rpc::stream::AsyncItems>>>,
    answers: PyAsyncStream,
}

impl PyAsyncBidi {
    fn new(b: dm_rpc::stream::AsyncBidi, node: Node) -> PyAsyncBidi {
        let (items, answers) = b.split();
        PyAsyncBidi {
            items: Arc::new(tokio::sync::Mutex::new(Some(items))),
            answers: PyAsyncStream::new(answers, node),
        }
    }

    /// Sends `item`, or ends the items if `None` (after a send in
    /// progress), resolving with `None` or the exception.
    fn with_items(
        &self,
        py: Python<'_>,
        resolver: Resolver,
        item: Option<dm_rpc::Payload>,
    ) -> PyResult<PyCallHandle> {
        let items = self.items.clone();
        let work = async move {
            match (items.lock().await.as_mut(), item) {
                (Some(i), Some(p)) => i.send(p).await,
                (Some(i), None) => i.finish().await,
                (None, _) => Err(RpcError::invalid_argument("the call's items were closed")),
            }
        };
        drive(py, Box::pin(work), resolver, |py, r| match r {
            Ok(()) => (true, py.None()),
            Err(e) => (false, to_py(e).into_value(py).into_any()),
        })
    }
}

#[pymethods]
impl PyAsyncBidi {
    /// Sends one item, waiting while the server's grant is used up.
    fn send(
        &self,
        py: Python<'_>,
        data: &Bound<'_, PyAny>,
        event_loop: Py<PyAny>,
        fut: Py<PyAny>,
        resolve: Py<PyAny>,
    ) -> PyResult<PyCallHandle> {
        let p = to_payload(py, &self.answers.node, Some(data))?;
        self.with_items(py, (event_loop, fut, resolve), Some(p))
    }

    /// Ends the items: the server's inbox ends after what was sent.
    fn finish(
        &self,
        py: Python<'_>,
        event_loop: Py<PyAny>,
        fut: Py<PyAny>,
        resolve: Py<PyAny>,
    ) -> PyResult<PyCallHandle> {
        self.with_items(py, (event_loop, fut, resolve), None)
    }

    /// Reads the next item of the answer (as `AsyncStream.next`).
    fn next(
        &self,
        py: Python<'_>,
        event_loop: Py<PyAny>,
        fut: Py<PyAny>,
        resolve: Py<PyAny>,
    ) -> PyResult<PyCallHandle> {
        self.answers.next(py, event_loop, fut, resolve)
    }

    /// Cancels the call if it has not ended.
    fn close(&self, py: Python<'_>) {
        self.answers.close(py);
        let items = self.items.clone();
        py.allow_threads(move || {
            let taken = match items.try_lock() {
                Ok(mut g) => {
                    drop(g.take());
                    true
                }
                Err(_) => false,
            };
            // (A send in progress lets it go on the runtime.)
            if !taken {
                if let Ok(rt) = runtime() {
                    rt.spawn(async move { drop(items.lock().await.take()) });
                }
            }
        });
    }

    /// The metadata of the answer that ended the call.
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
        self.answers.metadata(py)
    }
}

/// A call's result for `resolve`: whether it succeeded, and the answer's
/// `Payload` or the exception.
fn outcome(py: Python<'_>, r: Result<dm_rpc::Reply, RpcError>, node: Node) -> (bool, Py<PyAny>) {
    match r.map(|out| Py::new(py, PyPayload::answer(out, node))) {
        Ok(Ok(v)) => (true, v.into_any()),
        Ok(Err(e)) => (false, e.into_value(py).into_any()),
        Err(e) => (false, to_py(e).into_value(py).into_any()),
    }
}

/// A call started by `AsyncClient.start`.
#[pyclass(module = "dmrpc._native", name = "CallHandle", frozen)]
#[derive(Debug)]
pub struct PyCallHandle {
    /// The runtime's task, if the call did not complete in `start`.
    task: Option<tokio::task::AbortHandle>,
}

#[pymethods]
impl PyCallHandle {
    /// Cancels the call if it has not completed: the server is told, and
    /// what its argument lent is released.
    fn cancel(&self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

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
use dm_rpc::{AsyncBalancedClient, AsyncClient, Node, RpcError};
use pyo3::prelude::*;
use std::future::Future;
use std::sync::OnceLock;
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
#[derive(Clone)]
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
        let (client, node) = (self.client.clone(), self.node.clone());
        let rt = runtime()?;
        let mut call = Box::pin(async move { client.call_full(&method, p, opts, meta).await });
        // First polled here, without the GIL: a call whose answer comes
        // within its spin (the waiting policy's, adaptive) completes with
        // no thread in between, as a Rust async call does. Only a call
        // still waiting after it goes to the runtime.
        let first = py.allow_threads(|| {
            let _in_rt = rt.enter();
            let mut cx = Context::from_waker(Waker::noop());
            call.as_mut().poll(&mut cx)
        });
        if let Poll::Ready(r) = first {
            let (ok, value) = outcome(py, r, node);
            resolve.call1(py, (fut, ok, value))?;
            return Ok(PyCallHandle { task: None });
        }
        let task = rt.spawn(async move {
            let r = call.await;
            keep_thread_state();
            Python::with_gil(|py| {
                let (ok, value) = outcome(py, r, node);
                // A closed loop has nobody left to tell: the answer goes
                // with `value`.
                let _ =
                    event_loop.call_method1(py, "call_soon_threadsafe", (resolve, fut, ok, value));
            });
        });
        Ok(PyCallHandle {
            task: Some(task.abort_handle()),
        })
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

//! Streaming calls from Python (`dm_rpc::stream`): a service's streaming
//! method is a callable that returns an iterable of items (a generator,
//! typically), registered with `Node.serve(..., streams={...})`; a caller
//! reads the items from a `dmrpc.Stream`, an iterator
//! (`Client.call_stream`).

use crate::errors::to_py;
use crate::payload::{to_payload, PyPayload};
use dm_rpc::stream::Streaming;
use dm_rpc::{Call, Node, RpcError, Sink};
use pyo3::prelude::*;
use std::sync::Mutex;

/// The handler of a streaming method whose items the Python callable `f`
/// returns as an iterable: each item is taken with the GIL and sent
/// without it (the send waits while the caller's window is full). A send
/// that fails (the caller cancelled, or is gone) closes the generator, so
/// its `finally` blocks run.
pub(crate) fn handler(
    f: Py<PyAny>,
) -> impl Fn(&mut Call<'_>, &mut Sink<'_>) -> Result<(), RpcError> + Send + Sync + 'static {
    move |call, sink| {
        let node = call.node().clone();
        let arg = PyPayload::new(call.take_payload(), node.clone());
        crate::node::keep_thread_state();
        crate::meta::serving(call.metadata(), || {
            let items = Python::with_gil(|py| {
                f.call1(py, (arg,))
                    .and_then(|it| it.bind(py).try_iter().map(|i| i.unbind()))
                    .map_err(|e| crate::node::to_rpc(py, e))
            })?;
            loop {
                let next = Python::with_gil(|py| match items.bind(py).clone().next() {
                    None => Ok(None),
                    Some(item) => item
                        .and_then(|i| to_payload(py, &node, Some(&i)))
                        .map(Some)
                        .map_err(|e| crate::node::to_rpc(py, e)),
                });
                let Some(item) = next? else {
                    return Ok(());
                };
                if let Err(e) = sink.send(item) {
                    Python::with_gil(|py| {
                        if let Ok(close) = items.bind(py).getattr("close") {
                            let _ = close.call0();
                        }
                    });
                    return Err(e);
                }
            }
        })
    }
}

/// The items of a streaming call, as they come: an iterator of
/// `Payload`s. Iterating waits (without the GIL) for each; the stream's
/// error, if it ends with one, is raised. `close()` (or dropping it before
/// the end) cancels the call.
#[pyclass(module = "dmrpc._native", name = "Stream", frozen)]
#[derive(Debug)]
pub struct PyStream {
    st: Mutex<Option<Streaming>>,
    node: Node,
}

impl PyStream {
    pub(crate) fn new(st: Streaming, node: Node) -> PyStream {
        PyStream {
            st: Mutex::new(Some(st)),
            node,
        }
    }
}

#[pymethods]
impl PyStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<PyPayload>> {
        let mut g = self.st.lock().unwrap_or_else(|e| e.into_inner());
        let Some(st) = g.as_mut() else {
            return Ok(None);
        };
        match py.allow_threads(|| st.next()) {
            Some(Ok(p)) => Ok(Some(PyPayload::new(p, self.node.clone()))),
            Some(Err(e)) => Err(to_py(e)),
            None => Ok(None),
        }
    }

    /// Cancels the call if it has not ended (its server is told), and
    /// releases what came and was not read.
    fn close(&self, py: Python<'_>) {
        let st = self.st.lock().unwrap_or_else(|e| e.into_inner()).take();
        py.allow_threads(|| drop(st));
    }

    /// The metadata of the answer that ended the stream, as `(key, value)`
    /// pairs (empty before the end).
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
        let g = self.st.lock().unwrap_or_else(|e| e.into_inner());
        let empty = dm_rpc::Metadata::new();
        let m = g.as_ref().map_or(&empty, |s| s.metadata());
        crate::meta::pairs(py, m)
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _t: Option<&Bound<'_, PyAny>>,
        _v: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.close(py);
        false
    }
}

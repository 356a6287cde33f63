//! `dmrpc.Node`, `dmrpc.Server`, `dmrpc.Client`: services and clients from
//! Python. Handlers are Python callables run on the service's dispatcher
//! thread (taking the GIL for the call); a blocking call releases the GIL
//! while it waits. Payloads are bytes-like objects (bytes, bytearray,
//! memoryview, NumPy arrays): copied once into the call, then sent inline
//! or by Ref by the size-aware rule; what arrives is given as `bytes`
//! (copied once, from the pool or the frame).

use crate::errors::{to_py, Error as PyDmError};
use crate::pool::PyPool;
use dm_rpc::{CallOptions, Client, Node, Payload, RpcError, Server, Status};
use pyo3::buffer::PyBuffer as PyBuf;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::sync::Mutex;
use std::time::Duration;

/// The bytes of a bytes-like object (None: empty).
fn bytes_of(py: Python<'_>, data: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<u8>> {
    let Some(d) = data else { return Ok(Vec::new()) };
    if d.is_none() {
        return Ok(Vec::new());
    }
    let b = PyBuf::<u8>::get(d).or_else(|_| -> PyResult<PyBuf<u8>> {
        // Any contiguous buffer, read as bytes (e.g. a float array).
        let mv = py
            .import("builtins")?
            .getattr("memoryview")?
            .call1((d,))?
            .call_method1("cast", ("B",))?;
        PyBuf::<u8>::get(&mv)
    })?;
    b.to_vec(py)
}

/// A Python exception raised by a handler, as a typed RPC error: a
/// `dmrpc.Error` keeps its status, anything else is `Internal`.
fn to_rpc(py: Python<'_>, e: PyErr) -> RpcError {
    let v = e.value(py);
    let msg = v.str().map(|s| s.to_string()).unwrap_or_default();
    if e.is_instance_of::<PyDmError>(py) {
        let status = v
            .getattr("status")
            .and_then(|s| s.extract::<String>())
            .unwrap_or_default();
        let st = match status.as_str() {
            "NotFound" => Status::NotFound,
            "InvalidArgument" => Status::InvalidArgument,
            "DeadlineExceeded" => Status::DeadlineExceeded,
            "Unavailable" => Status::Unavailable,
            "ResourceExhausted" => Status::ResourceExhausted,
            "Cancelled" => Status::Cancelled,
            _ => Status::Internal,
        };
        return RpcError::new(st, msg);
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
pub struct PyNode {
    node: Node,
}

#[pymethods]
impl PyNode {
    #[new]
    fn new(pool: &PyPool) -> PyResult<PyNode> {
        Ok(PyNode {
            node: Node::new(pool.get()?),
        })
    }

    /// Registers service `name` with `handlers` ({method: callable}); each
    /// callable takes the payload (`bytes`) and returns a bytes-like
    /// object or None.
    fn serve(
        &self,
        py: Python<'_>,
        name: &str,
        handlers: &Bound<'_, PyDict>,
    ) -> PyResult<PyServer> {
        let mut b = self.node.server(name);
        for (k, v) in handlers.iter() {
            let method: String = k.extract()?;
            let f: Py<PyAny> = v.unbind();
            b = b.method(&method, move |call| {
                let p = call.payload();
                Python::with_gil(|py| {
                    // One copy, straight from the pool (or frame) into the
                    // Python object.
                    let arg = PyBytes::new_with(py, p.len() as usize, |buf| {
                        p.read(0, buf).map_err(to_py)
                    })
                    .map_err(|e| to_rpc(py, e))?;
                    match f.call1(py, (arg,)) {
                        Ok(r) => bytes_of(py, Some(r.bind(py)))
                            .map(Payload::from_vec)
                            .map_err(|e| to_rpc(py, e)),
                        Err(e) => Err(to_rpc(py, e)),
                    }
                })
            });
        }
        let server = py.allow_threads(|| b.spawn()).map_err(to_py)?;
        Ok(PyServer {
            server: Mutex::new(Some(server)),
        })
    }

    /// Connects to service `name`.
    fn connect(&self, py: Python<'_>, name: &str) -> PyResult<PyClient> {
        let client = py
            .allow_threads(|| self.node.connect(name))
            .map_err(to_py)?;
        Ok(PyClient { client })
    }
}

/// A running service; `shutdown()` (or garbage collection) stops it.
#[pyclass(module = "dmrpc._native", name = "Server", frozen)]
pub struct PyServer {
    server: Mutex<Option<Server>>,
}

#[pymethods]
impl PyServer {
    /// Stops taking calls and unregisters.
    fn shutdown(&self, py: Python<'_>) {
        let s = self.server.lock().ok().and_then(|mut g| g.take());
        // Without the GIL: a handler in flight may need it to finish.
        py.allow_threads(|| drop(s));
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

/// A connection to a service.
#[pyclass(module = "dmrpc._native", name = "Client", frozen)]
pub struct PyClient {
    client: Client,
}

#[pymethods]
impl PyClient {
    /// Calls `method` with `data` (any bytes-like object); returns the
    /// answer's bytes. `timeout` in seconds.
    #[pyo3(signature = (method, data=None, timeout=None))]
    fn call<'py>(
        &self,
        py: Python<'py>,
        method: &str,
        data: Option<&Bound<'py, PyAny>>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let v = bytes_of(py, data)?;
        let opts = match timeout {
            Some(t) if t.is_finite() && t >= 0.0 => {
                CallOptions::deadline(Duration::from_secs_f64(t))
            }
            Some(t) => {
                return Err(to_py(RpcError::invalid_argument(format!(
                    "timeout {t} is not a duration"
                ))))
            }
            None => CallOptions::default(),
        };
        let out = py
            .allow_threads(|| {
                self.client
                    .call_with(method, Payload::from_vec(v), opts)
                    .and_then(|p| p.into_vec())
            })
            .map_err(to_py)?;
        Ok(PyBytes::new(py, &out))
    }
}

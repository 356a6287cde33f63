//! `dmrpc.Payload`: the data of a call or an answer as it arrived, read
//! through the buffer protocol with no copy (`memoryview(p)`,
//! `numpy.frombuffer(p)`): for data that arrived by Ref the view is the
//! pool's pages themselves; inline data is the frame's bytes. Read-only:
//! `keep()` gives a writable copy-on-write buffer. Passing a payload to
//! another call (or returning it from a handler) forwards it untouched —
//! a Ref travels on, no byte is copied.
//!
//! Also here: how Python arguments and results become payloads
//! ([`to_payload`]): bytes-like objects are copied once (straight into the
//! pool when they will travel by Ref), `dmrpc.Buffer`s travel by their
//! pages, `dmrpc.Payload`s are forwarded.

use crate::buffer::PyBuffer;
use crate::bytes::BytesLike;
use crate::errors::{pool_err, to_py};
use crate::mem::PyMemBuffer;
use crate::refs::PyRef;
use dm_pool::Buffer;
use dm_rpc::{Node, Payload, RpcError};
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::os::raw::c_int;
use std::sync::OnceLock;

/// Data that arrived (or is about to be sent).
#[pyclass(module = "dmrpc._native", name = "Payload", frozen)]
#[derive(Debug)]
pub struct PyPayload {
    p: Payload,
    /// The node it arrived at (whose pool `keep` puts inline data in).
    node: Node,
    /// The data made contiguous, for pool data whose pages are not (one
    /// copy, made on the first view that needs it).
    flat: OnceLock<Vec<u8>>,
    /// The metadata of the answer it came in (empty otherwise).
    reply: dm_rpc::Metadata,
}

impl PyPayload {
    pub fn new(p: Payload, node: Node) -> PyPayload {
        PyPayload {
            p,
            node,
            flat: OnceLock::new(),
            reply: dm_rpc::Metadata::new(),
        }
    }

    /// The answer of a call: its payload, with its metadata.
    pub fn answer(r: dm_rpc::Reply, node: Node) -> PyPayload {
        PyPayload {
            reply: r.metadata,
            ..PyPayload::new(r.payload, node)
        }
    }

    /// The data as one slice: the payload's own memory when contiguous.
    fn slice(&self) -> PyResult<&[u8]> {
        if let Some(f) = self.flat.get() {
            return Ok(f);
        }
        let segs = self.p.segments().map_err(to_py)?;
        Ok(match segs.as_slice() {
            [] => &[],
            [one] => one,
            many => self.flat.get_or_init(|| many.concat()),
        })
    }
}

#[pymethods]
impl PyPayload {
    fn __len__(&self) -> usize {
        self.p.len() as usize
    }

    /// Whether the data arrived by Ref (lives in the pool or on a memory
    /// server) rather than inline in the frame.
    /// The metadata the handler set on the answer this payload came in
    /// (`dmrpc.set_reply_metadata`), as `(key, value)` pairs; empty for
    /// a handler's argument (read `dmrpc.metadata()` there).
    #[getter]
    fn reply_metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
        crate::meta::pairs(py, &self.reply)
    }

    #[getter]
    fn by_ref(&self) -> bool {
        self.p.in_pool() || self.p.is_remote()
    }

    /// The Ref the data arrived by (None for inline data and answers).
    #[getter]
    fn r#ref(&self) -> Option<PyRef> {
        self.p.as_ref_handle().map(|r| PyRef::new(*r))
    }

    /// A copy of the data.
    fn __bytes__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, self.slice()?))
    }

    /// A copy of the data (as `bytes(p)`).
    fn tobytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        self.__bytes__(py)
    }

    /// A writable buffer with the same data, that this process keeps
    /// beyond the call that delivered it: for pool data its own shares of
    /// the pages (copy-on-write: only the pages written are copied) —
    /// mapped (a writable view) or explicit (`mapped=False`: no page-table
    /// work, writes through `write()`); for data on a memory server a
    /// `MemBuffer` there (mapped on the server, CoW); inline data is
    /// copied into the pool.
    #[pyo3(signature = (mapped=true))]
    fn keep(&self, py: Python<'_>, mapped: bool) -> PyResult<Py<PyAny>> {
        let kept = self.p.forward().map_err(to_py)?;
        if kept.is_remote() {
            let m = self
                .node
                .memserver()
                .ok_or_else(|| {
                    to_py(RpcError::internal(
                        "memory-server data, and no memory server",
                    ))
                })?
                .clone();
            let b = py.allow_threads(|| kept.keep_remote()).map_err(to_py)?;
            let b = b.ok_or_else(|| to_py(RpcError::internal("memory-server data went")))?;
            return Ok(PyMemBuffer::new(m, b)
                .into_pyobject(py)?
                .into_any()
                .unbind());
        }
        let pool = self.node.pool();
        let b = py
            .allow_threads(|| -> Result<Buffer, RpcError> {
                Ok(match kept.into_buffer()? {
                    Some(b) => b,
                    None => {
                        let v = self.p.to_vec()?;
                        let mut b = pool.alloc(v.len() as u64)?;
                        b.write(0, &v)?;
                        b
                    }
                })
            })
            .map_err(to_py)?;
        Ok(PyBuffer::of(b, mapped)?
            .into_pyobject(py)?
            .into_any()
            .unbind())
    }

    /// # Safety
    /// Called by Python with a valid `view`.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if flags & ffi::PyBUF_WRITABLE != 0 {
            return Err(PyBufferError::new_err(
                "a payload is read-only: keep() it for a writable copy-on-write buffer",
            ));
        }
        let s = slf.get().slice()?;
        // SAFETY: `view` is valid (Python's contract). The memory belongs
        // to the payload (its frame bytes, its mapping of the pool's pages,
        // or its flattened copy), which never changes and lives as long as
        // this object, which the view holds a reference to.
        unsafe { crate::buffer::fill_view(slf.as_any(), view, s, true, flags) }
    }

    /// # Safety
    /// Called by Python for a view made by `__getbuffer__`.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}

    fn __repr__(&self) -> String {
        let how = if self.by_ref() { "by Ref" } else { "inline" };
        format!("Payload({} bytes, {how})", self.p.len())
    }
}

/// A Python argument or result as a payload: None (empty), a
/// `dmrpc.Payload` (forwarded untouched), a `dmrpc.Buffer` (its pages
/// shared: no copy, the buffer stays the caller's, copy-on-write), or any
/// bytes-like object (copied once: into the pool when it will travel by
/// Ref, else into the frame).
pub fn to_payload(
    py: Python<'_>,
    node: &Node,
    data: Option<&Bound<'_, PyAny>>,
) -> PyResult<Payload> {
    let Some(d) = data.filter(|d| !d.is_none()) else {
        return Ok(Payload::empty());
    };
    if let Ok(p) = d.downcast::<PyPayload>() {
        return p.get().p.forward().map_err(to_py);
    }
    if let Ok(b) = d.downcast::<PyBuffer>() {
        return b.get().to_payload();
    }
    if let Ok(b) = d.downcast::<crate::mem::PyMemBuffer>() {
        return b.get().to_payload(py);
    }
    let bytes = BytesLike::get(d)?;
    let s = bytes.as_slice();
    if s.len() > node.config().inline_max && !node.config().by_value {
        // Straight into the pool: one copy whether it then travels by Ref
        // or (to a peer that does not share the pool) by value.
        let mut b = node.pool().alloc(s.len() as u64).map_err(pool_err)?;
        b.write(0, s).map_err(pool_err)?;
        return Ok(Payload::from_buffer(b));
    }
    Ok(Payload::from_vec(s.to_vec()))
}

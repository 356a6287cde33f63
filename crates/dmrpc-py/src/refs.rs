//! `dmrpc.Ref`: 40 bytes naming a frozen snapshot; bytes-like (the buffer
//! protocol gives its encoding), hashable, picklable (a Ref can travel to
//! another process in any message).

use crate::bytes::BytesLike;
use crate::errors::pool_err;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyType};
use std::os::raw::c_int;

/// A capability naming a frozen snapshot of a buffer range.
#[pyclass(module = "dmrpc._native", name = "Ref", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct PyRef {
    pub r: dm_pool::Ref,
    /// The encoding, which the buffer protocol exports.
    enc: [u8; dm_pool::Ref::SIZE],
}

impl PyRef {
    pub fn new(r: dm_pool::Ref) -> PyRef {
        PyRef {
            enc: r.to_bytes(),
            r,
        }
    }
}

#[pymethods]
impl PyRef {
    /// A Ref from its 40-byte encoding (raises InvalidArgument if malformed).
    #[classmethod]
    fn from_bytes(_cls: &Bound<'_, PyType>, b: BytesLike) -> PyResult<PyRef> {
        let r = dm_pool::Ref::from_bytes(b.as_slice()).map_err(|e| pool_err(e.into()))?;
        Ok(PyRef::new(r))
    }

    /// The 40-byte encoding.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.enc)
    }

    fn __bytes__<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        self.to_bytes(py)
    }

    /// Bytes of data the Ref names.
    #[getter]
    fn len(&self) -> u64 {
        self.r.len
    }

    fn __len__(&self) -> usize {
        self.r.len as usize
    }

    /// # Safety
    /// Called by Python with a valid `view`.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let enc: &[u8] = &slf.get().enc;
        // SAFETY: `view` is valid (Python's contract); the encoding is part
        // of this frozen object, which the view holds a reference to.
        unsafe { crate::buffer::fill_view(slf.as_any(), view, enc, true, flags) }
    }

    /// # Safety
    /// Called by Python for a view made by `__getbuffer__`.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}

    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyBytes>,))> {
        let py = slf.py();
        let ctor = py.get_type::<PyRef>().getattr("from_bytes")?;
        Ok((ctor, (slf.get().to_bytes(py),)))
    }

    fn __repr__(&self) -> String {
        format!(
            "Ref(pool={:#x}, desc={}, generation={}, len={})",
            self.r.pool_id, self.r.desc, self.r.generation, self.r.len
        )
    }
}

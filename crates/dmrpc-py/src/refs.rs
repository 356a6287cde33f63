//! `dmrpc.Ref`: 40 bytes naming a frozen snapshot; bytes-like, hashable,
//! picklable (a Ref can travel to another process in any message).

use crate::errors::pool_err;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyType};

/// A capability naming a frozen snapshot of a buffer range.
#[pyclass(module = "dmrpc._native", name = "Ref", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyRef {
    pub r: dm_pool::Ref,
}

#[pymethods]
impl PyRef {
    /// A Ref from its 40-byte encoding (raises InvalidArgument if malformed).
    #[classmethod]
    fn from_bytes(_cls: &Bound<'_, PyType>, b: &[u8]) -> PyResult<PyRef> {
        let r = dm_pool::Ref::from_bytes(b).map_err(|e| pool_err(e.into()))?;
        Ok(PyRef { r })
    }

    /// The 40-byte encoding.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.r.to_bytes())
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

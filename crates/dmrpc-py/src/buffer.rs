//! `dmrpc.Buffer`: pool memory exposed through the buffer protocol, so
//! `memoryview` and `numpy.frombuffer` see the pool's pages with no copy.
//! Stores through a writable view follow copy-on-write: the first store to
//! a shared page copies that page (a write fault resolved by the pool).

use crate::errors::{pool_err, to_py};
use crate::refs::PyRef;
use dm_pool::MappedBuffer;
use dm_rpc::{Payload, RpcError};
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// A buffer of pool memory.
#[pyclass(module = "dmrpc._native", name = "Buffer", frozen)]
pub struct PyBuffer {
    m: Mutex<Option<MappedBuffer>>,
    /// Views exported through the buffer protocol and not yet released.
    exports: AtomicUsize,
}

fn freed() -> PyErr {
    to_py(RpcError::invalid_argument("the buffer was freed"))
}

impl PyBuffer {
    pub fn new(m: MappedBuffer) -> PyBuffer {
        PyBuffer {
            m: Mutex::new(Some(m)),
            exports: AtomicUsize::new(0),
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut MappedBuffer) -> PyResult<T>) -> PyResult<T> {
        let mut g = self.m.lock().map_err(|_| freed())?;
        f(g.as_mut().ok_or_else(freed)?)
    }

    pub fn free(&self) -> PyResult<()> {
        let mut g = self.m.lock().map_err(|_| freed())?;
        if self.exports.load(Ordering::Acquire) > 0 {
            return Err(PyBufferError::new_err(
                "the buffer has live views (memoryview, numpy arrays): release them first",
            ));
        }
        match g.take() {
            Some(m) => {
                drop(m);
                Ok(())
            }
            None => Err(to_py(RpcError::invalid_argument(
                "double free: the buffer was freed already",
            ))),
        }
    }

    /// The buffer's data as a call's payload, by its pages: shared (the
    /// range becomes copy-on-write: one `mprotect`), and a second buffer
    /// over them handed to the call. The caller keeps its buffer; later
    /// writes to it copy only the pages written.
    pub fn to_payload(&self) -> PyResult<Payload> {
        self.with(|m| {
            let r = m.share().map_err(pool_err)?;
            let pool = m.buffer().pool();
            let mapped = pool.map_ref(&r);
            let released = pool.release_ref(&r);
            let b = mapped.map_err(pool_err)?;
            released.map_err(pool_err)?;
            Ok(Payload::from_buffer(b))
        })
    }

    pub fn create_ref(&self, offset: u64, length: Option<u64>) -> PyResult<PyRef> {
        self.with(|m| {
            let len = length.unwrap_or_else(|| (m.len() as u64).saturating_sub(offset));
            Ok(PyRef {
                r: m.create_ref(offset, len).map_err(pool_err)?,
            })
        })
    }
}

#[pymethods]
impl PyBuffer {
    fn __len__(&self) -> PyResult<usize> {
        self.with(|m| Ok(m.len()))
    }

    /// The address of the first byte (the same memory numpy sees).
    #[getter]
    fn address(&self) -> PyResult<usize> {
        self.with(|m| Ok(m.as_slice().as_ptr() as usize))
    }

    /// A copy of `length` bytes at `offset` (default: to the end).
    #[pyo3(signature = (offset=0, length=None))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: usize,
        length: Option<usize>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.with(|m| {
            let s = m.as_slice();
            let end = length.map_or(Some(s.len()), |l| offset.checked_add(l));
            match end {
                Some(e) if offset <= e && e <= s.len() => Ok(PyBytes::new(py, &s[offset..e])),
                _ => Err(to_py(RpcError::invalid_argument(format!(
                    "range {offset}+{length:?} outside a buffer of {} bytes",
                    s.len()
                )))),
            }
        })
    }

    /// Writes `data` (any bytes-like object) at `offset`; shared pages are
    /// copied first.
    #[pyo3(signature = (data, offset=0))]
    fn write(&self, data: &[u8], offset: usize) -> PyResult<()> {
        self.with(|m| {
            let s = m.as_mut_slice();
            match offset.checked_add(data.len()) {
                Some(e) if e <= s.len() => {
                    s[offset..e].copy_from_slice(data);
                    Ok(())
                }
                _ => Err(to_py(RpcError::invalid_argument(format!(
                    "a write of {} bytes at {offset} outside a buffer of {} bytes",
                    data.len(),
                    s.len()
                )))),
            }
        })
    }

    /// A Ref to the whole buffer (its pages become copy-on-write).
    fn share(&self) -> PyResult<PyRef> {
        self.create_ref(0, None)
    }

    /// Frees the buffer (BufferError while views exist).
    #[pyo3(name = "free")]
    fn py_free(&self) -> PyResult<()> {
        self.free()
    }

    /// # Safety
    /// Called by Python with a valid `view`.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let me = slf.get();
        let g = me.m.lock().map_err(|_| freed())?;
        let m = g.as_ref().ok_or_else(freed)?;
        let (ptr, len) = (m.as_slice().as_ptr(), m.len());
        // SAFETY: `view` is valid (Python's contract); the memory stays
        // mapped while the view exists: `free` refuses while exports > 0,
        // and the view holds a reference to this object.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                ptr as *mut std::os::raw::c_void,
                len as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        me.exports.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// # Safety
    /// Called by Python for a view made by `__getbuffer__`.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        self.exports.fetch_sub(1, Ordering::AcqRel);
    }

    fn __repr__(&self) -> String {
        match self.m.lock().ok().and_then(|g| g.as_ref().map(|m| m.len())) {
            Some(n) => format!("Buffer({n} bytes)"),
            None => "Buffer(freed)".into(),
        }
    }
}

//! `dmrpc.Buffer`: pool memory, of one of two kinds.
//!
//! - **Mapped** (the default): the pages are mapped at a private range of
//!   addresses, and the buffer protocol gives a writable view, so
//!   `memoryview` and `numpy.frombuffer` see the pool's pages with no copy.
//!   Stores through the view follow copy-on-write: the first store to a
//!   shared page copies that page (a write fault resolved by the pool).
//!   Mapping costs page-table work (`mmap`, faults) at creation and on the
//!   first write to each shared page.
//! - **Explicit** (`mapped=False`): no mapping and no page-table work at
//!   all. `write()` copies shared pages in software (only the pages it
//!   touches); the buffer protocol gives a read-only view of the pages
//!   when they are consecutive in the pool, and `write()` is refused while
//!   such views exist (a copy-on-write would leave them on the old page).
//!   The fast path for a callee that changes part of what it received.

use crate::bytes::BytesLike;
use crate::errors::{pool_err, to_py};
use crate::refs::PyRef;
use dm_pool::{Buffer, Dm, MappedBuffer};
use dm_rpc::{Payload, RpcError};
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// The memory behind a `dmrpc.Buffer`.
#[derive(Debug)]
pub enum Kind {
    Mapped(MappedBuffer),
    Explicit(Buffer),
}

impl Kind {
    fn buffer(&self) -> &Buffer {
        match self {
            Kind::Mapped(m) => m.buffer(),
            Kind::Explicit(b) => b,
        }
    }

    fn len(&self) -> usize {
        self.buffer().len() as usize
    }

    /// The bytes as one slice: always for a mapped buffer, for an explicit
    /// one when its pages are consecutive in the pool.
    fn slice(&self) -> PyResult<Option<&[u8]>> {
        match self {
            Kind::Mapped(m) => Ok(Some(m.as_slice())),
            Kind::Explicit(b) => b.as_slice().map_err(pool_err),
        }
    }
}

/// Fills `view` for the buffer protocol with `s`, owned by `obj`.
///
/// # Safety
/// `view` must be valid, and `s` must stay where it is, unchanged through
/// any other path when `readonly`, for as long as the view exists (the
/// view holds a reference to `obj`).
pub unsafe fn fill_view(
    obj: &Bound<'_, PyAny>,
    view: *mut ffi::Py_buffer,
    s: &[u8],
    readonly: bool,
    flags: c_int,
) -> PyResult<()> {
    // SAFETY: as the caller promises.
    let rc = unsafe {
        ffi::PyBuffer_FillInfo(
            view,
            obj.as_ptr(),
            s.as_ptr() as *mut std::os::raw::c_void,
            s.len() as ffi::Py_ssize_t,
            readonly as c_int,
            flags,
        )
    };
    if rc != 0 {
        return Err(PyErr::fetch(obj.py()));
    }
    Ok(())
}

/// A buffer of pool memory.
#[pyclass(module = "dmrpc._native", name = "Buffer", frozen)]
#[derive(Debug)]
pub struct PyBuffer {
    m: Mutex<Option<Kind>>,
    /// Views exported through the buffer protocol and not yet released.
    exports: AtomicUsize,
}

fn freed() -> PyErr {
    to_py(RpcError::invalid_argument("the buffer was freed"))
}

fn outside(offset: usize, len: usize, size: usize) -> PyErr {
    to_py(RpcError::invalid_argument(format!(
        "range {offset}+{len} outside a buffer of {size} bytes"
    )))
}

impl PyBuffer {
    /// A mapped buffer over `b`'s pages, or `b` itself (explicit).
    pub fn of(b: Buffer, mapped: bool) -> PyResult<PyBuffer> {
        let kind = if mapped {
            Kind::Mapped(MappedBuffer::from_buffer(b).map_err(pool_err)?)
        } else {
            Kind::Explicit(b)
        };
        Ok(PyBuffer {
            m: Mutex::new(Some(kind)),
            exports: AtomicUsize::new(0),
        })
    }

    fn with<T>(&self, f: impl FnOnce(&mut Kind) -> PyResult<T>) -> PyResult<T> {
        let mut g = self.m.lock().map_err(|_| freed())?;
        f(g.as_mut().ok_or_else(freed)?)
    }

    /// The buffer's slot, locked, for an operation that ends the buffer
    /// (`free`, `into_ref`): BufferError while views exist.
    fn ending(&self) -> PyResult<MutexGuard<'_, Option<Kind>>> {
        let g = self.m.lock().map_err(|_| freed())?;
        if self.exports.load(Ordering::Acquire) > 0 {
            return Err(PyBufferError::new_err(
                "the buffer has live views (memoryview, numpy arrays): release them first",
            ));
        }
        Ok(g)
    }

    pub fn free(&self) -> PyResult<()> {
        let mut g = self.ending()?;
        match g.take() {
            Some(Kind::Mapped(m)) => {
                drop(m);
                Ok(())
            }
            Some(Kind::Explicit(b)) => b.pool().clone().free(b).map_err(pool_err),
            None => Err(to_py(RpcError::invalid_argument(
                "double free: the buffer was freed already",
            ))),
        }
    }

    /// The buffer's data as a call's payload, by its pages: a second
    /// buffer over them handed to the call (a Ref made, mapped and
    /// released: no copy). A mapped buffer's range becomes copy-on-write
    /// first (one `mprotect`). The caller keeps its buffer; later writes
    /// to it copy only the pages written.
    pub fn to_payload(&self) -> PyResult<Payload> {
        self.with(|k| {
            let b = match k {
                Kind::Mapped(m) => m.dup(),
                Kind::Explicit(b) => b.pool().dup(b),
            };
            Ok(Payload::from_buffer(b.map_err(pool_err)?))
        })
    }

    pub fn create_ref(&self, offset: u64, length: Option<u64>) -> PyResult<PyRef> {
        self.with(|k| {
            let len = length.unwrap_or_else(|| (k.len() as u64).saturating_sub(offset));
            let r = match k {
                Kind::Mapped(m) => m.create_ref(offset, len),
                Kind::Explicit(b) => b.create_ref(offset, len),
            };
            Ok(PyRef::new(r.map_err(pool_err)?))
        })
    }
}

#[pymethods]
impl PyBuffer {
    fn __len__(&self) -> PyResult<usize> {
        self.with(|k| Ok(k.len()))
    }

    /// Whether the buffer is mapped (a writable view) or explicit.
    #[getter]
    fn mapped(&self) -> PyResult<bool> {
        self.with(|k| Ok(matches!(k, Kind::Mapped(_))))
    }

    /// The address of the first byte (the same memory numpy sees); for an
    /// explicit buffer, only when its pages are consecutive.
    #[getter]
    fn address(&self) -> PyResult<usize> {
        self.with(|k| match k.slice()? {
            Some(s) => Ok(s.as_ptr() as usize),
            None => Err(PyBufferError::new_err(
                "the buffer's pages are not consecutive: it has no single address",
            )),
        })
    }

    /// A copy of `length` bytes at `offset` (default: to the end).
    #[pyo3(signature = (offset=0, length=None))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: usize,
        length: Option<usize>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.with(|k| {
            let size = k.len();
            let len = length.unwrap_or(size.saturating_sub(offset));
            if offset.checked_add(len).is_none_or(|e| e > size) {
                return Err(outside(offset, len, size));
            }
            match k {
                Kind::Mapped(m) => Ok(PyBytes::new(py, &m.as_slice()[offset..offset + len])),
                Kind::Explicit(b) => {
                    PyBytes::new_with(py, len, |out| b.read(offset as u64, out).map_err(pool_err))
                }
            }
        })
    }

    /// Writes `data` (any bytes-like object) at `offset`; shared pages are
    /// copied first (only those written).
    #[pyo3(signature = (data, offset=0))]
    fn write(&self, data: BytesLike, offset: usize) -> PyResult<()> {
        let data = data.as_slice();
        self.with(|k| {
            let size = k.len();
            if offset.checked_add(data.len()).is_none_or(|e| e > size) {
                return Err(outside(offset, data.len(), size));
            }
            match k {
                Kind::Mapped(m) => {
                    m.as_mut_slice()[offset..offset + data.len()].copy_from_slice(data);
                    Ok(())
                }
                Kind::Explicit(b) => {
                    if self.exports.load(Ordering::Acquire) > 0 {
                        return Err(PyBufferError::new_err(
                            "an explicit buffer with live views cannot be written: release them first",
                        ));
                    }
                    b.write(offset as u64, data).map_err(pool_err)
                }
            }
        })
    }

    /// A Ref to the whole buffer (its pages become copy-on-write).
    fn share(&self) -> PyResult<PyRef> {
        self.create_ref(0, None)
    }

    /// Turns the buffer into a Ref to all of it and ends the buffer, as
    /// `share()` then `free()` would, in place where it can (an explicit
    /// buffer of its own pages: `Pool::into_ref`, no page touched). On an
    /// error the buffer is unchanged. BufferError while views exist.
    // (Python methods take `&self`; the name is the Rust API's, and the
    // buffer ends as `free` ends it.)
    #[allow(clippy::wrong_self_convention)]
    fn into_ref(&self) -> PyResult<PyRef> {
        let mut g = self.ending()?;
        match g.take() {
            Some(Kind::Explicit(b)) => match b.pool().clone().try_into_ref(b) {
                Ok(r) => Ok(PyRef::new(r)),
                Err((e, b)) => {
                    *g = Some(Kind::Explicit(b));
                    Err(pool_err(e))
                }
            },
            Some(Kind::Mapped(mut m)) => match m.share() {
                Ok(r) => Ok(PyRef::new(r)),
                Err(e) => {
                    *g = Some(Kind::Mapped(m));
                    Err(pool_err(e))
                }
            },
            None => Err(freed()),
        }
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
        let k = g.as_ref().ok_or_else(freed)?;
        let readonly = matches!(k, Kind::Explicit(_));
        if readonly && flags & ffi::PyBUF_WRITABLE != 0 {
            return Err(PyBufferError::new_err(
                "an explicit buffer's view is read-only: write() to it, or use a mapped buffer",
            ));
        }
        let s = k.slice()?.ok_or_else(|| {
            PyBufferError::new_err(
                "the buffer's pages are not consecutive in the pool: read() it, or use a mapped buffer",
            )
        })?;
        // SAFETY: `view` is valid (Python's contract); the memory stays
        // where it is while the view exists: `free` (and, for an explicit
        // buffer, `write`) refuse while exports > 0, and the view holds a
        // reference to this object.
        unsafe { fill_view(slf.as_any(), view, s, readonly, flags)? };
        me.exports.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// # Safety
    /// Called by Python for a view made by `__getbuffer__`.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        self.exports.fetch_sub(1, Ordering::AcqRel);
    }

    fn __repr__(&self) -> String {
        let g = self.m.lock().ok();
        match g.as_ref().and_then(|g| g.as_ref()) {
            Some(Kind::Mapped(m)) => format!("Buffer({} bytes, mapped)", m.len()),
            Some(Kind::Explicit(b)) => format!("Buffer({} bytes, explicit)", b.len()),
            None => "Buffer(freed)".into(),
        }
    }
}

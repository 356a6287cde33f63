//! `dmrpc.Pool`: a shared memory pool this process is attached to.

use crate::buffer::PyBuffer;
use crate::errors::{closed, pool_err};
use crate::refs::PyRef;
use dm_pool::{AttachOptions, Pool, PoolConfig};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::RwLock;

/// A pool this process is attached to. Closing it (or leaving a `with`
/// block) detaches; every later call raises InvalidArgument.
#[pyclass(module = "dmrpc._native", name = "Pool", frozen)]
#[derive(Debug)]
pub struct PyPool {
    pool: RwLock<Option<Pool>>,
}

impl PyPool {
    /// The attached pool, or the "closed" error.
    pub fn get(&self) -> PyResult<Pool> {
        self.pool
            .read()
            .map_err(|_| closed())?
            .clone()
            .ok_or_else(closed)
    }
}

#[pymethods]
impl PyPool {
    /// Attaches to the pool file at `path`; with `size`, creates it first
    /// if it does not exist (`size` bytes, pages of `page_size`).
    #[new]
    #[pyo3(signature = (path, size=None, page_size=4096))]
    fn new(py: Python<'_>, path: &str, size: Option<u64>, page_size: u32) -> PyResult<PyPool> {
        let path = std::path::PathBuf::from(path);
        let pool = py
            .allow_threads(|| match size {
                Some(size) => Pool::open_or_create(
                    &path,
                    &PoolConfig {
                        size,
                        page_size,
                        ..Default::default()
                    },
                    AttachOptions::default(),
                ),
                None => Pool::open(&path, AttachOptions::default()),
            })
            .map_err(pool_err)?;
        Ok(PyPool {
            pool: RwLock::new(Some(pool)),
        })
    }

    /// The pool's random id.
    #[getter]
    fn id(&self) -> PyResult<u64> {
        Ok(self.get()?.id())
    }

    /// The page size (the unit of sharing and copy-on-write).
    #[getter]
    fn page_size(&self) -> PyResult<usize> {
        Ok(self.get()?.page_size())
    }

    /// A zero-filled buffer of `size` bytes (pages are backed on first
    /// write): mapped (a writable view), or explicit (`mapped=False`: no
    /// page-table work, writes through `write()`).
    #[pyo3(signature = (size, mapped=true))]
    fn alloc(&self, size: u64, mapped: bool) -> PyResult<PyBuffer> {
        let pool = self.get()?;
        PyBuffer::of(pool.alloc(size).map_err(pool_err)?, mapped)
    }

    /// Frees a buffer (raises BufferError while views of it exist).
    fn free(&self, buf: &PyBuffer) -> PyResult<()> {
        self.get()?;
        buf.free()
    }

    /// A Ref to `length` bytes at `offset` of `buf` (default: all of it).
    #[pyo3(signature = (buf, offset=0, length=None))]
    fn create_ref(&self, buf: &PyBuffer, offset: u64, length: Option<u64>) -> PyResult<PyRef> {
        self.get()?;
        buf.create_ref(offset, length)
    }

    /// Maps a Ref as a new buffer (mapped, or explicit with
    /// `mapped=False`): no copy; writes copy the pages they touch.
    #[pyo3(signature = (r, mapped=true))]
    fn map_ref(&self, r: &PyRef, mapped: bool) -> PyResult<PyBuffer> {
        let pool = self.get()?;
        PyBuffer::of(pool.map_ref(&r.r).map_err(pool_err)?, mapped)
    }

    /// Releases a Ref (a second release raises InvalidArgument).
    fn release_ref(&self, r: &PyRef) -> PyResult<()> {
        self.get()?.release_ref(&r.r).map_err(pool_err)
    }

    /// Reclaims now what dead processes held (past their lease) and Refs
    /// past their TTL (a background thread does it every lease period).
    fn maintain(&self, py: Python<'_>) -> PyResult<()> {
        let pool = self.get()?;
        py.allow_threads(|| pool.maintain()).map_err(pool_err)?;
        Ok(())
    }

    /// The pool's consistency check: `ok`, page and Ref counts, problems.
    fn check<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let pool = self.get()?;
        let rep = py.allow_threads(|| pool.check());
        let d = PyDict::new(py);
        d.set_item("ok", rep.ok())?;
        d.set_item("pages_held", rep.pages_held)?;
        d.set_item("pages_shared", rep.pages_shared)?;
        d.set_item("refs", rep.refs_live)?;
        d.set_item("buffers", rep.buffers)?;
        d.set_item("problems", rep.problems)?;
        Ok(d)
    }

    /// Detaches from the pool (buffers still open keep their memory until
    /// they are freed or collected).
    fn close(&self) -> PyResult<()> {
        self.pool.write().map_err(|_| closed())?.take();
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        _t: &Bound<'_, PyAny>,
        _v: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        self.close()?;
        Ok(false)
    }
}

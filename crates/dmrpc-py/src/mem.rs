//! `dmrpc.MemPool`, `dmrpc.MemBuffer`: disaggregated memory on memory
//! servers (`dmrpc memserver`) over the network, with the same contract as
//! a pool — alloc, free, create_ref, map_ref, release_ref — and explicit
//! reads and writes (remote memory has no load/store view). A `MemPool`
//! given to a `Node` carries large payloads between nodes in different
//! pools by memory-server Ref.

use crate::bytes::BytesLike;
use crate::errors::{closed, pool_err, to_py};
use crate::refs::PyRef;
use dm_memserver::{ClientConfig, MemBuffer, MemPool, Placement};
use dm_pool::{Dm, DmBuffer};
use dm_rpc::{Payload, RpcError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::sync::{Mutex, RwLock};
use std::time::Duration;

/// One or more memory servers used as one pool.
#[pyclass(module = "dmrpc._native", name = "MemPool", frozen)]
#[derive(Debug)]
pub struct PyMemPool {
    pool: RwLock<Option<MemPool>>,
}

impl PyMemPool {
    pub fn get(&self) -> PyResult<MemPool> {
        self.pool
            .read()
            .map_err(|_| closed())?
            .clone()
            .ok_or_else(closed)
    }
}

/// `length` bytes from `offset` of `size` (default: to the end), checked.
fn range(offset: u64, length: Option<u64>, size: u64) -> PyResult<u64> {
    let len = length.unwrap_or_else(|| size.saturating_sub(offset));
    dm_pool::check_range(offset, len, size).map_err(pool_err)?;
    Ok(len)
}

/// `len` bytes read by `f` into a new `bytes`, without the GIL.
fn read_into<'py>(
    py: Python<'py>,
    len: u64,
    f: impl FnOnce(&mut [u8]) -> dm_pool::Result<()> + Send,
) -> PyResult<Bound<'py, PyBytes>> {
    let mut v = vec![0u8; len as usize];
    py.allow_threads(|| f(&mut v)).map_err(pool_err)?;
    Ok(PyBytes::new(py, &v))
}

#[pymethods]
impl PyMemPool {
    /// Connects to the memory servers at `servers` (`host:port` each);
    /// `cache_bytes` sizes the cache of pages read through mapped Refs.
    /// `key_file`: the servers' client key (their `--key-file`);
    /// `admin_key_file`: their admin key, for `check` from another host.
    /// `placement`: where new buffers and puts go, `"local"` (the servers
    /// on this host when there are any) or `"round-robin"` (every server).
    #[new]
    #[pyo3(signature = (servers, cache_bytes=None, timeout=None, key_file=None, admin_key_file=None, placement="local"))]
    fn new(
        py: Python<'_>,
        servers: Vec<String>,
        cache_bytes: Option<u64>,
        timeout: Option<f64>,
        key_file: Option<std::path::PathBuf>,
        admin_key_file: Option<std::path::PathBuf>,
        placement: &str,
    ) -> PyResult<PyMemPool> {
        let key = |f: Option<std::path::PathBuf>| {
            f.map(dm_pool::auth::Key::from_file)
                .transpose()
                .map_err(pool_err)
        };
        let placement = match placement {
            "local" => Placement::Local,
            "round-robin" => Placement::RoundRobin,
            p => {
                return Err(to_py(RpcError::invalid_argument(format!(
                    "placement {p:?}: \"local\" or \"round-robin\""
                ))))
            }
        };
        let mut cfg = ClientConfig {
            key: key(key_file)?,
            admin_key: key(admin_key_file)?,
            placement,
            ..ClientConfig::default()
        };
        if let Some(c) = cache_bytes {
            cfg.cache_bytes = c;
        }
        if let Some(t) = timeout {
            cfg.timeout = Duration::try_from_secs_f64(t).map_err(|_| {
                to_py(RpcError::invalid_argument(format!(
                    "timeout {t} is not a duration"
                )))
            })?;
        }
        let pool = py
            .allow_threads(|| MemPool::connect_with(&servers, cfg))
            .map_err(pool_err)?;
        Ok(PyMemPool {
            pool: RwLock::new(Some(pool)),
        })
    }

    /// The page size of the servers (the unit of sharing and CoW).
    #[getter]
    fn page_size(&self) -> PyResult<usize> {
        Ok(self.get()?.page_size())
    }

    /// A zero-filled buffer of `size` bytes on one of the servers.
    fn alloc(&self, py: Python<'_>, size: u64) -> PyResult<PyMemBuffer> {
        let pool = self.get()?;
        let b = py.allow_threads(|| pool.alloc(size)).map_err(pool_err)?;
        Ok(PyMemBuffer::new(pool, b))
    }

    /// Frees a buffer (a second free raises InvalidArgument).
    fn free(&self, py: Python<'_>, buf: &PyMemBuffer) -> PyResult<()> {
        self.get()?;
        buf.free(py)
    }

    /// A Ref to `length` bytes at `offset` of `buf` (default: all of it).
    #[pyo3(signature = (buf, offset=0, length=None))]
    fn create_ref(
        &self,
        py: Python<'_>,
        buf: &PyMemBuffer,
        offset: u64,
        length: Option<u64>,
    ) -> PyResult<PyRef> {
        self.get()?;
        buf.create_ref(py, offset, length)
    }

    /// Maps a Ref as a new buffer of this client (no copy on the server;
    /// writes copy the pages they touch).
    fn map_ref(&self, py: Python<'_>, r: &PyRef) -> PyResult<PyMemBuffer> {
        let pool = self.get()?;
        let b = py.allow_threads(|| pool.map_ref(&r.r)).map_err(pool_err)?;
        Ok(PyMemBuffer::new(pool, b))
    }

    /// Releases a Ref (a second release raises InvalidArgument).
    fn release_ref(&self, py: Python<'_>, r: &PyRef) -> PyResult<()> {
        let pool = self.get()?;
        py.allow_threads(|| pool.release_ref(&r.r))
            .map_err(pool_err)
    }

    /// Stores `data` and returns a Ref to it, in one round trip.
    fn put(&self, py: Python<'_>, data: BytesLike) -> PyResult<PyRef> {
        let pool = self.get()?;
        let data = data.as_slice();
        let r = py
            .allow_threads(|| pool.put(data, Duration::ZERO))
            .map_err(pool_err)?;
        Ok(PyRef::new(r))
    }

    /// Reads `length` bytes at `offset` of what a Ref names (default: all
    /// of it), in one round trip, without mapping it.
    #[pyo3(signature = (r, offset=0, length=None))]
    fn read_ref<'py>(
        &self,
        py: Python<'py>,
        r: &PyRef,
        offset: u64,
        length: Option<u64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let pool = self.get()?;
        // (A forged length must not size the buffer.)
        pool.check_ref(&r.r).map_err(pool_err)?;
        let len = range(offset, length, r.r.len)?;
        read_into(py, len, |out| pool.read_ref(&r.r, offset, out))
    }

    /// Page and Ref counts summed over the servers.
    fn usage<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let pool = self.get()?;
        let u = py.allow_threads(|| pool.usage()).map_err(pool_err)?;
        let d = PyDict::new(py);
        d.set_item("pages_held", u.pages_held)?;
        d.set_item("pages_shared", u.pages_shared)?;
        d.set_item("refs", u.refs)?;
        d.set_item("pages_free", u.pages_free)?;
        Ok(d)
    }

    /// The servers' own consistency checks: the problems found (empty when
    /// all is well).
    fn check(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let pool = self.get()?;
        py.allow_threads(|| pool.check()).map_err(pool_err)
    }

    /// Disconnects (the servers release what this client held).
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

/// A buffer on a memory server.
#[pyclass(module = "dmrpc._native", name = "MemBuffer", frozen)]
#[derive(Debug)]
pub struct PyMemBuffer {
    pool: MemPool,
    b: Mutex<Option<MemBuffer>>,
    len: u64,
}

fn freed() -> PyErr {
    to_py(RpcError::invalid_argument("the buffer was freed"))
}

impl PyMemBuffer {
    pub fn new(pool: MemPool, b: MemBuffer) -> PyMemBuffer {
        PyMemBuffer {
            pool,
            len: DmBuffer::len(&b),
            b: Mutex::new(Some(b)),
        }
    }

    /// Runs `f` on the buffer without the GIL (the buffer's own lock is
    /// held: one operation at a time per buffer).
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&MemPool, &mut MemBuffer) -> dm_pool::Result<T> + Send,
    ) -> PyResult<T> {
        py.allow_threads(|| {
            let mut g = self.b.lock().map_err(|_| freed())?;
            let b = g.as_mut().ok_or_else(freed)?;
            f(&self.pool, b).map_err(pool_err)
        })
    }

    fn free(&self, py: Python<'_>) -> PyResult<()> {
        let b = self.b.lock().map_err(|_| freed())?.take();
        match b {
            Some(b) => py.allow_threads(|| self.pool.free(b)).map_err(pool_err),
            None => Err(to_py(RpcError::invalid_argument(
                "double free: the buffer was freed already",
            ))),
        }
    }

    fn create_ref(&self, py: Python<'_>, offset: u64, length: Option<u64>) -> PyResult<PyRef> {
        let len = range(offset, length, self.len)?;
        let r = self.with(py, |pool, b| pool.create_ref(b, offset, len))?;
        Ok(PyRef::new(r))
    }

    /// The buffer's data as a call's payload: a second buffer over the
    /// same pages on the server (a Ref made, mapped and released: three
    /// round trips, no copy), so the caller keeps its buffer.
    pub fn to_payload(&self, py: Python<'_>) -> PyResult<Payload> {
        let b = self.with(py, |pool, b| pool.dup(b))?;
        Ok(Payload::from_mem_buffer(b))
    }
}

#[pymethods]
impl PyMemBuffer {
    fn __len__(&self) -> usize {
        self.len as usize
    }

    /// A copy of `length` bytes at `offset` (default: to the end).
    #[pyo3(signature = (offset=0, length=None))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: u64,
        length: Option<u64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let len = range(offset, length, self.len)?;
        let mut v = vec![0u8; len as usize];
        self.with(py, |_, b| b.read(offset, &mut v))?;
        Ok(PyBytes::new(py, &v))
    }

    /// Writes `data` (any bytes-like object) at `offset`; shared pages are
    /// copied first (on the server).
    #[pyo3(signature = (data, offset=0))]
    fn write(&self, py: Python<'_>, data: BytesLike, offset: u64) -> PyResult<()> {
        let data = data.as_slice();
        self.with(py, |_, b| b.write(offset, data))
    }

    /// A Ref to the whole buffer (its pages become copy-on-write).
    fn share(&self, py: Python<'_>) -> PyResult<PyRef> {
        self.create_ref(py, 0, None)
    }

    /// Frees the buffer (a second free raises InvalidArgument).
    #[pyo3(name = "free")]
    fn py_free(&self, py: Python<'_>) -> PyResult<()> {
        self.free(py)
    }

    fn __repr__(&self) -> String {
        match self
            .b
            .lock()
            .ok()
            .and_then(|g| g.as_ref().map(|b| b.server()))
        {
            Some(s) => format!("MemBuffer({} bytes on server {s})", self.len),
            None => "MemBuffer(freed)".into(),
        }
    }
}

//! `dmrpc.Heap` and `dmrpc.Heaps`: documents in a shared heap, written
//! from Python objects and read back as Python objects, their bytes as
//! views of the heap (no copy).
//!
//! A document is an `rkyv` archive of a `dm_heap::Value` (maps with text
//! keys, lists, text, integers, floats, booleans, None, bytes): the same
//! documents Rust services read with `Heaps::archived_sealed::<Value>`.

use crate::buffer::fill_view;
use crate::bytes::BytesLike;
use crate::errors::to_py;
use crate::pool::PyPool;
use dm_heap::{ArchivedValue, Heap, HeapError, Heaps, Scope, Seal, Value};
use dm_rpc::RpcError;
use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use std::any::Any;
use std::os::raw::c_int;
use std::sync::{Arc, Mutex};

fn heap_err(e: HeapError) -> PyErr {
    let e = match e {
        HeapError::Pool(e) => return crate::errors::pool_err(e),
        HeapError::Full(_) => RpcError::resource_exhausted(e.to_string()),
        other => RpcError::invalid_argument(other.to_string()),
    };
    to_py(e)
}

/// The deepest document `archive` takes (a list in a list in ...).
const MAX_DEPTH: usize = 128;

/// A Python object as a document.
fn value_of(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
    if depth > MAX_DEPTH {
        return Err(PyTypeError::new_err("a document nested more than 128 deep"));
    }
    if obj.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = obj.downcast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        return Ok(Value::Int(obj.extract()?));
    }
    if obj.is_instance_of::<PyFloat>() {
        return Ok(Value::Float(obj.extract()?));
    }
    if let Ok(s) = obj.downcast::<PyString>() {
        return Ok(Value::Str(s.to_str()?.to_owned()));
    }
    if let Ok(d) = obj.downcast::<PyDict>() {
        let mut m = std::collections::BTreeMap::new();
        for (k, v) in d.iter() {
            let k: String = k
                .extract()
                .map_err(|_| PyTypeError::new_err("a document's map keys are text"))?;
            m.insert(k, value_of(&v, depth + 1)?);
        }
        return Ok(Value::Map(m));
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let mut l = Vec::new();
        for v in obj.try_iter()? {
            l.push(value_of(&v?, depth + 1)?);
        }
        return Ok(Value::List(l));
    }
    if let Ok(b) = BytesLike::get(obj) {
        return Ok(Value::Bytes(b.as_slice().to_vec()));
    }
    Err(PyTypeError::new_err(format!(
        "a document holds None, bool, int, float, str, bytes-like, list, tuple and dict; not {}",
        obj.get_type().name()?
    )))
}

/// A heap this process made: documents are written into it.
#[pyclass(module = "dmrpc._native", name = "Heap", frozen)]
#[derive(Debug)]
pub struct PyHeap {
    heap: Arc<Heap>,
}

/// A document written into a heap: `arg` passes it to another process.
/// A sealed one holds still (its pages read-only here) until `release()`.
#[pyclass(module = "dmrpc._native", name = "HeapDocument", frozen)]
pub struct PyHeapDocument {
    arg: Vec<u8>,
    /// The seal and the scope it seals, both borrowing `heap` (dropped
    /// first, in that order).
    held: Mutex<Option<(Seal<'static>, Box<Scope<'static>>)>>,
    _heap: Arc<Heap>,
}

impl std::fmt::Debug for PyHeapDocument {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeapDocument")
            .field("arg", &self.arg.len())
            .finish()
    }
}

impl PyHeapDocument {
    /// Drops the seal, then the scope it seals (both before the heap
    /// they borrow).
    fn let_go(&self) {
        if let Ok(mut g) = self.held.lock() {
            if let Some((seal, scope)) = g.take() {
                drop(seal);
                drop(scope);
            }
        }
    }
}

impl Drop for PyHeapDocument {
    fn drop(&mut self) {
        self.let_go();
    }
}

#[pymethods]
impl PyHeapDocument {
    /// The 96 bytes that pass the document to another process of the pool.
    #[getter]
    fn arg<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.arg)
    }

    /// Releases its seal (the call that read it has ended).
    fn release(&self) {
        self.let_go();
    }
}

#[pymethods]
impl PyHeap {
    /// A heap of `size` bytes in `pool`, at an address free in this process.
    #[new]
    fn new(pool: &PyPool, size: u64) -> PyResult<PyHeap> {
        let pool = pool.get()?;
        Ok(PyHeap {
            heap: Arc::new(Heap::create(&pool, size).map_err(heap_err)?),
        })
    }

    /// Writes `obj` (None, bool, int, float, str, bytes-like, list, tuple,
    /// dict with str keys) into the heap as a document. Sealed (the
    /// default), it sits in pages of its own, read-only to this process
    /// until `release()`: a receiver reads it in place after validating
    /// it. Unsealed, a receiver copies it out before it validates it.
    #[pyo3(signature = (obj, sealed=true))]
    fn archive(&self, obj: &Bound<'_, PyAny>, sealed: bool) -> PyResult<PyHeapDocument> {
        let v = value_of(obj, 0)?;
        let heap = self.heap.clone();
        if !sealed {
            let a = heap.archive(&v).map_err(heap_err)?;
            let arg = heap.archive_arg(&a).map_err(heap_err)?.to_vec();
            return Ok(PyHeapDocument {
                arg,
                held: Mutex::new(None),
                _heap: heap,
            });
        }
        let len = dm_heap::rkyv::to_bytes::<dm_heap::rkyv::rancor::Error>(&v)
            .map_err(|e| heap_err(HeapError::Invalid(e.to_string())))?
            .len() as u64;
        // SAFETY: the scope borrows the heap, which `_heap` keeps alive
        // for as long as the document lives; the scope is dropped (after
        // its seal) before it, in `Drop`.
        let h: &'static Heap = unsafe { &*Arc::as_ptr(&heap) };
        let scope = Box::new(h.scope(len + 4096).map_err(heap_err)?);
        // SAFETY: as above: the box keeps the scope where it is, and the
        // seal is dropped before it.
        let s: &'static Scope<'static> = unsafe { &*(&*scope as *const Scope<'static>) };
        let a = s.archive(&v).map_err(heap_err)?;
        let seal = s.seal().map_err(heap_err)?;
        let arg = h.sealed_archive_arg(&a, &seal).map_err(heap_err)?.to_vec();
        Ok(PyHeapDocument {
            arg,
            held: Mutex::new(Some((seal, scope))),
            _heap: heap,
        })
    }

    /// Its size in bytes.
    #[getter]
    fn size(&self) -> u64 {
        self.heap.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "Heap({} bytes at {:#x})",
            self.heap.len(),
            self.heap.base() as u64
        )
    }
}

/// The heaps this process reads documents from: each opened, at its
/// address, when its first document arrives.
#[pyclass(module = "dmrpc._native", name = "Heaps", frozen)]
#[derive(Debug)]
pub struct PyHeaps {
    heaps: Arc<Heaps>,
}

/// What keeps a document's bytes where they are while views of them live.
type Keeper = Arc<dyn Any + Send + Sync>;

/// Bytes of a document, read in place: a read-only buffer
/// (`memoryview(b)`, `bytes(b)` to copy).
#[pyclass(module = "dmrpc._native", name = "HeapBytes", frozen)]
pub struct PyHeapBytes {
    ptr: usize,
    len: usize,
    _keep: Keeper,
}

impl std::fmt::Debug for PyHeapBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HeapBytes({} bytes)", self.len)
    }
}

#[pymethods]
impl PyHeapBytes {
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if flags & ffi::PyBUF_WRITABLE != 0 {
            return Err(PyBufferError::new_err("a document's bytes are read-only"));
        }
        let me = slf.get();
        // SAFETY: validated (or trusted) bytes of a document, kept where
        // they are by `_keep` (the heap open, the seal or the copy held),
        // and the view holds a reference to this object.
        let s = unsafe { std::slice::from_raw_parts(me.ptr as *const u8, me.len) };
        // SAFETY: `view` is valid (Python's contract); see above.
        unsafe { fill_view(slf.as_any(), view, s, true, flags) }
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}

    fn __len__(&self) -> usize {
        self.len
    }

    fn __repr__(&self) -> String {
        format!("HeapBytes({} bytes)", self.len)
    }
}

/// An archived document as Python objects; its bytes as views kept by
/// `keep`.
fn to_python<'py>(
    py: Python<'py>,
    v: &ArchivedValue,
    keep: &Keeper,
) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        ArchivedValue::Null => py.None().into_bound(py),
        ArchivedValue::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        ArchivedValue::Int(i) => i.to_native().into_pyobject(py)?.into_any(),
        ArchivedValue::Float(f) => f.to_native().into_pyobject(py)?.into_any(),
        ArchivedValue::Str(s) => PyString::new(py, s.as_str()).into_any(),
        ArchivedValue::Bytes(b) => Bound::new(
            py,
            PyHeapBytes {
                ptr: b.as_ptr() as usize,
                len: b.len(),
                _keep: keep.clone(),
            },
        )?
        .into_any(),
        ArchivedValue::List(l) => {
            let out = PyList::empty(py);
            for x in l.iter() {
                out.append(to_python(py, x, keep)?)?;
            }
            out.into_any()
        }
        ArchivedValue::Map(m) => {
            let out = PyDict::new(py);
            for e in m.iter() {
                out.set_item(e.key.as_str(), to_python(py, &e.value, keep)?)?;
            }
            out.into_any()
        }
    })
}

/// A sealed document, validated, with the heaps that keep it open.
struct Sealed(dm_heap::Validated<Value>);
// SAFETY: a read-only view of validated, sealed shared memory.
unsafe impl Send for Sealed {}
// SAFETY: as above.
unsafe impl Sync for Sealed {}

#[pymethods]
impl PyHeaps {
    /// The heaps of `pool` (none open yet).
    #[new]
    fn new(pool: &PyPool) -> PyResult<PyHeaps> {
        Ok(PyHeaps {
            heaps: Arc::new(Heaps::new(&pool.get()?)),
        })
    }

    /// The document argument `arg` passes, as Python objects (dicts,
    /// lists, str, int, float, bool, None) whose bytes are `HeapBytes`
    /// views, read with no copy. `check` says how far to trust it:
    /// "sealed" (the default) verifies its seal and validates it in
    /// place; "copy" copies it out of the heap and validates the copy
    /// (for a document that is not sealed); "trusted" reads it in place
    /// unchecked, for a sender this process trusts.
    #[pyo3(signature = (arg, check="sealed"))]
    fn document<'py>(
        &self,
        py: Python<'py>,
        arg: BytesLike,
        check: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        let b = arg.as_slice();
        match check {
            "sealed" => {
                let v = self.heaps.archived_sealed::<Value>(b).map_err(heap_err)?;
                let keep: Keeper = Arc::new(Sealed(v));
                let Some(s) = keep.downcast_ref::<Sealed>() else {
                    return Err(PyTypeError::new_err("internal: a sealed document"));
                };
                to_python(py, s.0.get(), &keep)
            }
            "copy" => {
                let c = self.heaps.archived_copy::<Value>(b).map_err(heap_err)?;
                let keep: Keeper = Arc::new(c);
                let Some(c) = keep.downcast_ref::<dm_heap::Copied<Value>>() else {
                    return Err(PyTypeError::new_err("internal: a copied document"));
                };
                to_python(py, c.get(), &keep)
            }
            "trusted" => {
                // SAFETY: the caller said its sender is trusted (the
                // documented meaning of "trusted").
                let v = unsafe { self.heaps.archived_trusted::<Value>(b) }.map_err(heap_err)?;
                // (The heaps keep it mapped.)
                let keep: Keeper = self.heaps.clone();
                to_python(py, v, &keep)
            }
            other => Err(PyTypeError::new_err(format!(
                "check is \"sealed\", \"copy\" or \"trusted\", not {other:?}"
            ))),
        }
    }
}

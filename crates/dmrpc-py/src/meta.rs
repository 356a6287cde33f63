//! Call metadata from Python: what a caller passes as `metadata=` (a dict,
//! or pairs, of `str` keys and `str` or bytes-like values) and what a
//! handler reads with `dmrpc.metadata()`; what a handler sets on its
//! answer with `dmrpc.set_reply_metadata()` and its caller reads as
//! `Payload.reply_metadata`, or an exception's `.metadata`.

use crate::errors::to_py;
use dm_rpc::{Metadata, RpcError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString, PyTuple};
use std::cell::RefCell;

thread_local! {
    /// The metadata of the call this thread's handler serves.
    static SERVED: RefCell<Metadata> = RefCell::new(Metadata::new());
}

/// The metadata a caller passed: None, a dict, or an iterable of
/// `(key, value)` pairs; a bad key or value raises `InvalidArgument`.
pub(crate) fn metadata_of(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Metadata> {
    let mut m = Metadata::new();
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(m);
    };
    let pairs: Vec<(Bound<'_, PyAny>, Bound<'_, PyAny>)> = match obj.downcast::<PyDict>() {
        Ok(d) => d.iter().collect(),
        Err(_) => obj
            .try_iter()?
            .map(|p| p.and_then(|p| p.extract()))
            .collect::<PyResult<_>>()?,
    };
    for (k, v) in pairs {
        let key: String = k.extract()?;
        let value: Vec<u8> = match v.downcast::<PyString>() {
            Ok(s) => s.to_str()?.as_bytes().to_vec(),
            Err(_) => crate::bytes::BytesLike::get(&v)?.as_slice().to_vec(),
        };
        m.insert(&key, value)
            .map_err(|e| to_py(RpcError::invalid_argument(e.to_string())))?;
    }
    Ok(m)
}

/// Sets the metadata of the answer to the call this thread serves (as
/// `metadata=` of a call takes it), replacing what was set before; it goes
/// with the answer, whether the handler returns or raises. Outside a
/// handler, raises `InvalidArgument`.
#[pyfunction]
pub(crate) fn set_reply_metadata(metadata: &Bound<'_, PyAny>) -> PyResult<()> {
    let m = metadata_of(Some(metadata))?;
    dm_rpc::metadata::set_reply(m).map_err(|e| to_py(RpcError::invalid_argument(e.to_string())))
}

/// `m` as `(key, value)` pairs, in order.
pub(crate) fn pairs<'py>(py: Python<'py>, m: &Metadata) -> PyResult<Bound<'py, PyTuple>> {
    let pairs = m
        .iter()
        .map(|(k, v)| {
            PyTuple::new(
                py,
                [
                    k.into_pyobject(py)?.into_any(),
                    PyBytes::new(py, v).into_any(),
                ],
            )
        })
        .collect::<PyResult<Vec<_>>>()?;
    PyTuple::new(py, pairs)
}

/// Runs `f` (a Python handler) with `meta` as the metadata it reads.
pub(crate) fn serving<R>(meta: &Metadata, f: impl FnOnce() -> R) -> R {
    if meta.is_empty() {
        return f();
    }
    SERVED.with(|s| *s.borrow_mut() = meta.clone());
    let r = f();
    SERVED.with(|s| *s.borrow_mut() = Metadata::new());
    r
}

/// The metadata of the call this thread serves, as `(key, value)` pairs
/// in the order the caller gave them (a key may repeat): an empty tuple
/// outside a handler, or if the caller sent none.
#[pyfunction]
pub(crate) fn metadata(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
    SERVED.with(|s| pairs(py, &s.borrow()))
}

//! The `dmrpc` Python package's native module (`dmrpc._native`): one
//! module per wrapped concept — [`pool`], [`buffer`], [`refs`], [`node`]
//! (services and clients), [`payload`] (what calls carry), [`mem`] (memory
//! servers), [`aio`] (calls as asyncio futures), [`meta`] (call metadata),
//! [`stream`] (streaming calls) —
//! the exceptions in
//! [`errors`], and how bytes-like arguments are read ([`bytes`]).

mod aio;
mod buffer;
mod bytes;
mod errors;
mod heap;
mod mem;
mod meta;
mod node;
mod payload;
mod pool;
mod refs;
mod stream;

use pyo3::prelude::*;

/// Whether the call this thread serves was given up: its deadline passed,
/// or its caller cancelled it. A handler with long work may look now and
/// then and stop early (what it answers then is dropped). False outside a
/// handler.
#[pyfunction]
fn cancelled() -> bool {
    dm_rpc::deadline::cancelled()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cancelled, m)?)?;
    m.add_function(wrap_pyfunction!(meta::metadata, m)?)?;
    m.add_function(wrap_pyfunction!(meta::set_reply_metadata, m)?)?;
    m.add_class::<pool::PyPool>()?;
    m.add_class::<buffer::PyBuffer>()?;
    m.add_class::<refs::PyRef>()?;
    m.add_class::<node::PyNode>()?;
    m.add_class::<node::PyServer>()?;
    m.add_class::<node::PyClient>()?;
    m.add_class::<stream::PyStream>()?;
    m.add_class::<stream::PyBidi>()?;
    m.add_class::<stream::PyInbox>()?;
    m.add_class::<aio::PyAsyncBidi>()?;
    m.add_class::<aio::PyAsyncStream>()?;
    m.add_class::<aio::PyAsyncClient>()?;
    m.add_class::<aio::PyCallHandle>()?;
    m.add_class::<payload::PyPayload>()?;
    m.add_class::<mem::PyMemPool>()?;
    m.add_class::<mem::PyMemBuffer>()?;
    m.add_class::<heap::PyHeap>()?;
    m.add_class::<heap::PyHeapDocument>()?;
    m.add_class::<heap::PyHeaps>()?;
    m.add_class::<heap::PyHeapBytes>()?;
    m.add("DEFAULT_INLINE_MAX", dm_rpc::DEFAULT_INLINE_MAX)?;
    errors::register(m)?;
    Ok(())
}

//! The `dmrpc` Python package's native module (`dmrpc._native`): one
//! module per wrapped concept — [`pool`], [`buffer`], [`refs`], [`node`]
//! (services and clients) — and the
//! exceptions in [`errors`].

mod buffer;
mod errors;
mod node;
mod pool;
mod refs;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<pool::PyPool>()?;
    m.add_class::<buffer::PyBuffer>()?;
    m.add_class::<refs::PyRef>()?;
    m.add_class::<node::PyNode>()?;
    m.add_class::<node::PyServer>()?;
    m.add_class::<node::PyClient>()?;
    errors::register(m)?;
    Ok(())
}

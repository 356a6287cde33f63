//! Bytes-like arguments: `bytes`, `bytearray`, `memoryview`, NumPy arrays
//! of any dtype, anything with the buffer protocol. A C-contiguous buffer
//! is read in place (no copy); any other (a strided view) is copied once
//! into a contiguous one first.

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

/// A bytes-like object's bytes, pinned (an exported view) for as long as
/// this lives.
pub struct BytesLike {
    buf: PyBuffer<u8>,
}

impl BytesLike {
    /// The bytes of `obj`, or TypeError if it has no buffer protocol.
    pub fn get(obj: &Bound<'_, PyAny>) -> PyResult<BytesLike> {
        if let Ok(b) = PyBuffer::<u8>::get(obj) {
            if b.is_c_contiguous() {
                return Ok(BytesLike { buf: b });
            }
        }
        // Another item type (a float array) or layout, seen as bytes.
        let memoryview = obj.py().import("builtins")?.getattr("memoryview")?;
        let mut mv = memoryview.call1((obj,))?;
        if !mv.getattr("c_contiguous")?.extract::<bool>()? {
            mv = memoryview.call1((mv.call_method0("tobytes")?,))?;
        }
        Ok(BytesLike {
            buf: PyBuffer::<u8>::get(&mv.call_method1("cast", ("B",))?)?,
        })
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the buffer is C-contiguous with byte items (checked or
        // made so in `get`), and `self.buf` keeps the view exported, so
        // the memory stays where it is while the slice borrows `self`.
        unsafe { std::slice::from_raw_parts(self.buf.buf_ptr() as *const u8, self.buf.len_bytes()) }
    }
}

impl<'py> FromPyObject<'py> for BytesLike {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        BytesLike::get(ob)
    }
}

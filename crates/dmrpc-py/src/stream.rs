//! Streaming calls from Python (`dm_rpc::stream`): a service's streaming
//! method is a callable that returns an iterable of items (a generator,
//! typically), registered with `Node.serve(..., streams={...})`; a caller
//! reads the items from a `dmrpc.Stream`, an iterator
//! (`Client.call_stream`).

use crate::errors::to_py;
use crate::payload::{to_payload, PyPayload};
use dm_rpc::stream::{Bidi, Inbox, Items, Streaming};
use dm_rpc::{Call, Node, RpcError, Sink};
use pyo3::prelude::*;
use std::sync::Mutex;

/// The handler of a streaming method whose items the Python callable `f`
/// returns as an iterable: each item is taken with the GIL and sent
/// without it (the send waits while the caller's window is full). A send
/// that fails (the caller cancelled, or is gone) closes the generator, so
/// its `finally` blocks run.
pub(crate) fn handler(
    f: Py<PyAny>,
) -> impl Fn(&mut Call<'_>, &mut Sink<'_>) -> Result<(), RpcError> + Send + Sync + 'static {
    move |call, sink| {
        let node = call.node().clone();
        let arg = PyPayload::new(call.take_payload(), node.clone());
        crate::node::keep_thread_state();
        crate::meta::serving(call.metadata(), || {
            let items = Python::with_gil(|py| {
                f.call1(py, (arg,))
                    .and_then(|it| it.bind(py).try_iter().map(|i| i.unbind()))
                    .map_err(|e| crate::node::to_rpc(py, e))
            })?;
            send_all(&node, items, sink)
        })
    }
}

/// The items of a streaming call, as they come: an iterator of
/// `Payload`s. Iterating waits (without the GIL) for each; the stream's
/// error, if it ends with one, is raised. `close()` (or dropping it before
/// the end) cancels the call.
#[pyclass(module = "dmrpc._native", name = "Stream", frozen)]
#[derive(Debug)]
pub struct PyStream {
    st: Mutex<Option<Streaming>>,
    pub(crate) node: Node,
}

impl PyStream {
    pub(crate) fn new(st: Streaming, node: Node) -> PyStream {
        PyStream {
            st: Mutex::new(Some(st)),
            node,
        }
    }
}

#[pymethods]
impl PyStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<PyPayload>> {
        let mut g = self.st.lock().unwrap_or_else(|e| e.into_inner());
        let Some(st) = g.as_mut() else {
            return Ok(None);
        };
        match py.allow_threads(|| st.next()) {
            Some(Ok(p)) => Ok(Some(PyPayload::new(p, self.node.clone()))),
            Some(Err(e)) => Err(to_py(e)),
            None => Ok(None),
        }
    }

    /// Cancels the call if it has not ended (its server is told), and
    /// releases what came and was not read.
    fn close(&self, py: Python<'_>) {
        let st = self.st.lock().unwrap_or_else(|e| e.into_inner()).take();
        py.allow_threads(|| drop(st));
    }

    /// The metadata of the answer that ended the stream, as `(key, value)`
    /// pairs (empty before the end).
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
        let g = self.st.lock().unwrap_or_else(|e| e.into_inner());
        let empty = dm_rpc::Metadata::new();
        let m = g.as_ref().map_or(&empty, |s| s.metadata());
        crate::meta::pairs(py, m)
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _t: Option<&Bound<'_, PyAny>>,
        _v: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.close(py);
        false
    }
}

/// The handler of a method whose caller sends items too: the Python
/// callable `f` takes the `Payload` of the request and an `Inbox` of the
/// caller's items, and returns an iterable of answer items, as a
/// streaming method's does ([`handler`]).
pub(crate) fn bidi_handler(
    f: Py<PyAny>,
) -> impl Fn(&mut Call<'_>, &mut Inbox<'_>, &mut Sink<'_>) -> Result<(), RpcError> + Send + Sync + 'static
{
    move |call, inbox, sink| {
        let node = call.node().clone();
        let arg = PyPayload::new(call.take_payload(), node.clone());
        let lent = Lent::new(inbox);
        let py_inbox = PyInbox {
            lent: lent.0.clone(),
            node: node.clone(),
        };
        crate::node::keep_thread_state();
        let r = crate::meta::serving(call.metadata(), || {
            let items = Python::with_gil(|py| {
                f.call1(py, (arg, py_inbox))
                    .and_then(|it| it.bind(py).try_iter().map(|i| i.unbind()))
                    .map_err(|e| crate::node::to_rpc(py, e))
            })?;
            send_all(&node, items, sink)
        });
        drop(lent);
        r
    }
}

/// Sends every item of the Python iterator `items` into `sink`, closing
/// the iterator if a send fails.
fn send_all(
    node: &Node,
    items: Py<pyo3::types::PyIterator>,
    sink: &mut Sink<'_>,
) -> Result<(), RpcError> {
    loop {
        let next = Python::with_gil(|py| match items.bind(py).clone().next() {
            None => Ok(None),
            Some(item) => item
                .and_then(|i| to_payload(py, node, Some(&i)))
                .map(Some)
                .map_err(|e| crate::node::to_rpc(py, e)),
        });
        let Some(item) = next? else {
            return Ok(());
        };
        if let Err(e) = sink.send(item) {
            Python::with_gil(|py| {
                if let Ok(close) = items.bind(py).getattr("close") {
                    let _ = close.call0();
                }
            });
            return Err(e);
        }
    }
}

/// A handler's inbox lent to Python for as long as the handler runs, and
/// the handler's thread, the only one that reads it.
#[derive(Debug)]
struct InboxPtr(*mut Inbox<'static>, std::thread::ThreadId);

// SAFETY: the pointer is only dereferenced under the `Mutex` that holds
// it, on the handler's own thread, and only while the handler that lent
// it runs (its drop takes it back under the same mutex before the inbox
// goes): the inbox is used as `&mut` would let it be.
unsafe impl Send for InboxPtr {}

/// Takes the lent inbox back when dropped.
struct Lent(std::sync::Arc<Mutex<Option<InboxPtr>>>);

impl Lent {
    fn new(inbox: &mut Inbox<'_>) -> Lent {
        let p = (inbox as *mut Inbox<'_>).cast::<Inbox<'static>>();
        let me = std::thread::current().id();
        Lent(std::sync::Arc::new(Mutex::new(Some(InboxPtr(p, me)))))
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

/// The caller's items, as a method whose caller sends items reads them:
/// an iterator of `Payload`s, read by its handler's thread while the
/// handler runs. Iterating waits (without the GIL) for each. Read from
/// another thread, or after the handler returned, it raises
/// `dmrpc.InvalidArgument`.
#[pyclass(module = "dmrpc._native", name = "Inbox", frozen)]
#[derive(Debug)]
pub struct PyInbox {
    lent: std::sync::Arc<Mutex<Option<InboxPtr>>>,
    node: Node,
}

#[pymethods]
impl PyInbox {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<PyPayload>> {
        let lent = self.lent.clone();
        let got = py.allow_threads(move || {
            let mut g = lent.lock().unwrap_or_else(|e| e.into_inner());
            let Some(p) = g.as_mut() else {
                return Some(Err(RpcError::invalid_argument(
                    "an inbox is read only while its handler runs",
                )));
            };
            // (Another thread could block the handler's end on the lock.)
            if p.1 != std::thread::current().id() {
                return Some(Err(RpcError::invalid_argument(
                    "an inbox is read only by its handler's thread",
                )));
            }
            // SAFETY: see `InboxPtr`: the handler that lent the inbox is
            // running (the pointer is still here), and the mutex is held.
            let inbox = unsafe { &mut *p.0 };
            inbox.next()
        });
        match got {
            Some(Ok(p)) => Ok(Some(PyPayload::new(p, self.node.clone()))),
            Some(Err(e)) => Err(to_py(e)),
            None => Ok(None),
        }
    }
}

/// The caller's end of a call whose caller sends items: `send` and
/// `finish` its items, iterate over the answer's. The two halves lock
/// apart, so one thread may send while another reads. `close()` (or
/// dropping it before the end) cancels the call.
#[pyclass(module = "dmrpc._native", name = "Bidi", frozen)]
#[derive(Debug)]
pub struct PyBidi {
    items: Mutex<Option<Items>>,
    answers: PyStream,
}

impl PyBidi {
    pub(crate) fn new(b: Bidi, node: Node) -> PyBidi {
        let (items, answers) = b.split();
        PyBidi {
            items: Mutex::new(Some(items)),
            answers: PyStream::new(answers, node),
        }
    }

    fn with_items(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Items) -> Result<(), RpcError> + Send,
    ) -> PyResult<()> {
        py.allow_threads(|| {
            let mut g = self.items.lock().unwrap_or_else(|e| e.into_inner());
            match g.as_mut() {
                Some(items) => f(items),
                None => Err(RpcError::invalid_argument("the call's items were closed")),
            }
        })
        .map_err(to_py)
    }
}

#[pymethods]
impl PyBidi {
    /// Sends one item (bytes, a buffer, a NumPy array or a `Payload`),
    /// waiting while the server's grant is used up.
    fn send(&self, py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let p = to_payload(py, &self.answers.node, Some(data))?;
        self.with_items(py, move |i| i.send(p))
    }

    /// Ends the items: the server's inbox ends after what was sent.
    fn finish(&self, py: Python<'_>) -> PyResult<()> {
        self.with_items(py, |i| i.finish())
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<PyPayload>> {
        self.answers.__next__(py)
    }

    /// Cancels the call if it has not ended.
    fn close(&self, py: Python<'_>) {
        self.answers.close(py);
        let items = self.items.lock().unwrap_or_else(|e| e.into_inner()).take();
        py.allow_threads(|| drop(items));
    }

    /// The metadata of the answer that ended the call.
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
        self.answers.metadata(py)
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _t: Option<&Bound<'_, PyAny>>,
        _v: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.close(py);
        false
    }
}

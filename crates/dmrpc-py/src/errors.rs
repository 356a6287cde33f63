//! The exceptions, in one place: `dmrpc.Error` and one subclass per typed
//! status of the RPC layer, each carrying `.status` (the status name).

use dm_rpc::{RpcError, Status};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    dmrpc,
    Error,
    PyException,
    "Base of dmrpc's errors; `.status` names the status."
);
create_exception!(dmrpc, NotFound, Error, "No such service, method or object.");
create_exception!(
    dmrpc,
    InvalidArgument,
    Error,
    "Bad input: a wrong size, a forged, stale or released Ref, a double free, a closed pool."
);
create_exception!(
    dmrpc,
    DeadlineExceeded,
    Error,
    "The call's deadline passed."
);
create_exception!(dmrpc, Unavailable, Error, "The peer or server is gone.");
create_exception!(
    dmrpc,
    ResourceExhausted,
    Error,
    "The pool (or server) is full."
);
create_exception!(
    dmrpc,
    Internal,
    Error,
    "A bug or a handler's panic on the other side."
);
create_exception!(dmrpc, Cancelled, Error, "The call was cancelled.");
create_exception!(
    dmrpc,
    Unauthenticated,
    Error,
    "The caller did not prove who it is (a missing, bad or expired credential)."
);
create_exception!(
    dmrpc,
    PermissionDenied,
    Error,
    "The caller may not make this call."
);
create_exception!(
    dmrpc,
    AlreadyExists,
    Error,
    "What the call would create exists already: a service name a live process holds."
);

/// The status a name (as `.status` gives it) stands for.
pub fn status_named(name: &str) -> Option<Status> {
    Some(match name {
        "NotFound" => Status::NotFound,
        "InvalidArgument" => Status::InvalidArgument,
        "DeadlineExceeded" => Status::DeadlineExceeded,
        "Unavailable" => Status::Unavailable,
        "ResourceExhausted" => Status::ResourceExhausted,
        "Internal" => Status::Internal,
        "Cancelled" => Status::Cancelled,
        "Unauthenticated" => Status::Unauthenticated,
        "PermissionDenied" => Status::PermissionDenied,
        "AlreadyExists" => Status::AlreadyExists,
        _ => return None,
    })
}

/// The Python exception for a typed RPC error.
pub fn to_py(e: RpcError) -> PyErr {
    let (msg, status) = (e.message.clone(), e.status);
    let err = match status {
        Status::NotFound => NotFound::new_err(msg),
        Status::InvalidArgument => InvalidArgument::new_err(msg),
        Status::DeadlineExceeded => DeadlineExceeded::new_err(msg),
        Status::Unavailable => Unavailable::new_err(msg),
        Status::ResourceExhausted => ResourceExhausted::new_err(msg),
        Status::Cancelled => Cancelled::new_err(msg),
        Status::Unauthenticated => Unauthenticated::new_err(msg),
        Status::PermissionDenied => PermissionDenied::new_err(msg),
        Status::AlreadyExists => AlreadyExists::new_err(msg),
        _ => Internal::new_err(msg),
    };
    Python::with_gil(|py| {
        let v = err.value(py);
        let _ = v.setattr("status", format!("{status:?}"));
        if let Ok(m) = crate::meta::pairs(py, &e.metadata) {
            let _ = v.setattr("metadata", m);
        }
    });
    err
}

/// The Python exception for a pool error (through its RPC status).
pub fn pool_err(e: dm_pool::Error) -> PyErr {
    to_py(RpcError::from(e))
}

/// Raised for an operation on a closed pool.
pub fn closed() -> PyErr {
    to_py(RpcError::invalid_argument("the pool is closed"))
}

/// Adds the exceptions to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("NotFound", py.get_type::<NotFound>())?;
    m.add("InvalidArgument", py.get_type::<InvalidArgument>())?;
    m.add("DeadlineExceeded", py.get_type::<DeadlineExceeded>())?;
    m.add("Unavailable", py.get_type::<Unavailable>())?;
    m.add("ResourceExhausted", py.get_type::<ResourceExhausted>())?;
    m.add("Internal", py.get_type::<Internal>())?;
    m.add("Unauthenticated", py.get_type::<Unauthenticated>())?;
    m.add("PermissionDenied", py.get_type::<PermissionDenied>())?;
    m.add("AlreadyExists", py.get_type::<AlreadyExists>())?;
    m.add("Cancelled", py.get_type::<Cancelled>())?;
    // Every class says its status, so that an exception a Python handler
    // raises carries it back to the caller too.
    for (t, s) in [
        (py.get_type::<Error>(), "Internal"),
        (py.get_type::<NotFound>(), "NotFound"),
        (py.get_type::<InvalidArgument>(), "InvalidArgument"),
        (py.get_type::<DeadlineExceeded>(), "DeadlineExceeded"),
        (py.get_type::<Unavailable>(), "Unavailable"),
        (py.get_type::<ResourceExhausted>(), "ResourceExhausted"),
        (py.get_type::<Internal>(), "Internal"),
        (py.get_type::<Cancelled>(), "Cancelled"),
        (py.get_type::<Unauthenticated>(), "Unauthenticated"),
        (py.get_type::<PermissionDenied>(), "PermissionDenied"),
        (py.get_type::<AlreadyExists>(), "AlreadyExists"),
    ] {
        t.setattr("status", s)?;
    }
    // None unless an answer carried some, or a handler sets it before it
    // raises (it goes with the error to the caller).
    py.get_type::<Error>()
        .setattr("metadata", pyo3::types::PyTuple::empty(py))?;
    Ok(())
}

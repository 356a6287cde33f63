//! The typed error every call returns: a [`Status`] and a message.

use crate::frame::Status;
use crate::metadata::Metadata;
use crate::transport::TransportError;

/// A failed call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", status.name())]
pub struct RpcError {
    /// What kind of failure.
    pub status: Status,
    /// What happened, for people.
    pub message: String,
    /// The metadata the failed call's answer carried (empty unless its
    /// handler set some, [`crate::metadata::set_reply`], or returned an
    /// error carrying some). A handler's error keeps it: returning a
    /// nested call's error passes its metadata on.
    pub metadata: Metadata,
}

impl RpcError {
    /// An error with this status and message.
    pub fn new(status: Status, message: impl Into<String>) -> Self {
        RpcError {
            status,
            message: message.into(),
            metadata: Metadata::new(),
        }
    }

    /// This error, carrying `metadata` (to its caller, when a handler
    /// returns it).
    pub fn with_metadata(self, metadata: Metadata) -> Self {
        RpcError { metadata, ..self }
    }

    /// No such service or method.
    pub fn not_found(m: impl Into<String>) -> Self {
        Self::new(Status::NotFound, m)
    }

    /// The arguments were rejected.
    pub fn invalid_argument(m: impl Into<String>) -> Self {
        Self::new(Status::InvalidArgument, m)
    }

    /// The peer is gone.
    pub fn unavailable(m: impl Into<String>) -> Self {
        Self::new(Status::Unavailable, m)
    }

    /// The deadline passed.
    pub fn deadline_exceeded(m: impl Into<String>) -> Self {
        Self::new(Status::DeadlineExceeded, m)
    }

    /// Out of pool pages, descriptors, channels or ring space.
    pub fn resource_exhausted(m: impl Into<String>) -> Self {
        Self::new(Status::ResourceExhausted, m)
    }

    /// The caller did not prove who it is.
    pub fn unauthenticated(m: impl Into<String>) -> Self {
        Self::new(Status::Unauthenticated, m)
    }

    /// The caller may not make this call.
    pub fn permission_denied(m: impl Into<String>) -> Self {
        Self::new(Status::PermissionDenied, m)
    }

    /// What the call would create exists already (a service name a live
    /// process holds).
    pub fn already_exists(m: impl Into<String>) -> Self {
        Self::new(Status::AlreadyExists, m)
    }

    /// A failure that is nobody's input's fault.
    pub fn internal(m: impl Into<String>) -> Self {
        Self::new(Status::Internal, m)
    }
}

impl Status {
    /// The status's name, as in error messages.
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::NotFound => "not found",
            Status::InvalidArgument => "invalid argument",
            Status::DeadlineExceeded => "deadline exceeded",
            Status::Unavailable => "unavailable",
            Status::ResourceExhausted => "resource exhausted",
            Status::Internal => "internal",
            Status::Cancelled => "cancelled",
            Status::Unauthenticated => "unauthenticated",
            Status::PermissionDenied => "permission denied",
            Status::AlreadyExists => "already exists",
        }
    }
}

impl From<dm_pool::Error> for RpcError {
    fn from(e: dm_pool::Error) -> Self {
        use dm_pool::Error as E;
        let status = match &e {
            E::ResourceExhausted { .. } => Status::ResourceExhausted,
            E::ZeroLength
            | E::TooLarge { .. }
            | E::OutOfBounds { .. }
            | E::Unaligned { .. }
            | E::DoubleFree { .. }
            | E::NotOwner { .. }
            | E::ForeignPool { .. }
            | E::RefForged { .. }
            | E::RefStale { .. }
            | E::RefReleased { .. }
            | E::RefExpired { .. }
            | E::RefDecode(_)
            | E::InvalidConfig(_)
            | E::InvalidName(_)
            | E::Forked => Status::InvalidArgument,
            E::LeaseLost | E::NoChannel(_) | E::Unavailable(_) | E::RefClockInUse { .. } => {
                Status::Unavailable
            }
            E::NameTaken { .. } => Status::AlreadyExists,
            E::Unauthenticated(_) => Status::Unauthenticated,
            E::PermissionDenied(_) => Status::PermissionDenied,
            E::NotRegistered(_) => Status::InvalidArgument,
            _ => Status::Internal,
        };
        RpcError::new(status, e.to_string())
    }
}

impl From<crate::metadata::MetadataError> for RpcError {
    fn from(e: crate::metadata::MetadataError) -> Self {
        use crate::metadata::MetadataError as E;
        match e {
            E::Key(_) | E::Value(_) => RpcError::invalid_argument(e.to_string()),
            E::NotServing => RpcError::internal(e.to_string()),
        }
    }
}

impl From<TransportError> for RpcError {
    fn from(e: TransportError) -> Self {
        match e {
            TransportError::Unavailable(m) => RpcError::unavailable(m),
            TransportError::Malformed(f) => {
                RpcError::internal(format!("malformed frame from peer: {f}"))
            }
            TransportError::Protocol(m) => RpcError::internal(format!("protocol violation: {m}")),
            TransportError::TooLarge { len, max } => RpcError::invalid_argument(format!(
                "frame of {len} bytes exceeds the transport's {max}"
            )),
            TransportError::Pool(p) => p.into(),
        }
    }
}

/// What a server answers to a request for a method it does not have: it
/// knows only the method's id ([`crate::frame::method_id`], the hash the
/// frame carries), so the caller names the method ([`name_the_method`]).
pub(crate) fn no_method(id: u32) -> String {
    format!("no method with id {id:#x}")
}

/// `e`, the error of a call of `method`, names the method if it is the
/// server's [`no_method`] for that method's id.
#[cold]
pub(crate) fn name_the_method(e: &mut RpcError, method: &str) {
    if e.status == Status::NotFound {
        let id = crate::frame::method_id(method);
        if e.message == no_method(id) {
            e.message = format!("the service has no method {method:?} (id {id:#x})");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the server's answer for this very method is renamed: a
    /// handler's own `NotFound` ("no such user"), another method's id and
    /// other statuses keep their messages.
    #[test]
    fn the_caller_names_only_its_own_missing_method() {
        let id = crate::frame::method_id("resize");
        let mut e = RpcError::not_found(no_method(id));
        name_the_method(&mut e, "resize");
        assert_eq!(
            e.message,
            format!("the service has no method \"resize\" (id {id:#x})")
        );
        for (mut e, method) in [
            (RpcError::not_found("no such user"), "resize"),
            (RpcError::not_found(no_method(id)), "crop"),
            (RpcError::internal(no_method(id)), "resize"),
        ] {
            let before = e.message.clone();
            name_the_method(&mut e, method);
            assert_eq!(e.message, before);
        }
    }
}

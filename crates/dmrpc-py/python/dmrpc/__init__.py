"""dmrpc from Python: pools of shared memory, zero-copy buffers with
copy-on-write, and Refs that pass data by reference between processes."""

from ._native import (
    Buffer,
    Cancelled,
    DeadlineExceeded,
    Error,
    Internal,
    InvalidArgument,
    NotFound,
    Pool,
    Ref,
    ResourceExhausted,
    Unavailable,
)

__all__ = [
    "Buffer",
    "Cancelled",
    "DeadlineExceeded",
    "Error",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "Pool",
    "Ref",
    "ResourceExhausted",
    "Unavailable",
]

"""dmrpc from Python: pools of shared memory, zero-copy buffers with
copy-on-write, and Refs that pass data by reference between processes."""

from ._native import (
    Buffer,
    Cancelled,
    Client,
    DeadlineExceeded,
    Error,
    Internal,
    InvalidArgument,
    Node,
    NotFound,
    Pool,
    Ref,
    ResourceExhausted,
    Server,
    Unavailable,
)

__all__ = [
    "Buffer",
    "Cancelled",
    "Client",
    "DeadlineExceeded",
    "Error",
    "Internal",
    "InvalidArgument",
    "Node",
    "NotFound",
    "Pool",
    "Ref",
    "ResourceExhausted",
    "Server",
    "Unavailable",
]

"""dmrpc from Python: pools of shared memory, zero-copy buffers with
copy-on-write, Refs that pass data by reference between processes,
services and clients whose large payloads travel by Ref, and memory
servers over the network."""

from ._native import (
    Buffer,
    Cancelled,
    Client,
    DEFAULT_INLINE_MAX,
    DeadlineExceeded,
    Error,
    Internal,
    InvalidArgument,
    MemBuffer,
    MemPool,
    Node,
    NotFound,
    Payload,
    Pool,
    Ref,
    ResourceExhausted,
    Server,
    Unavailable,
    cancelled,
)

__all__ = [
    "Buffer",
    "Cancelled",
    "Client",
    "DEFAULT_INLINE_MAX",
    "DeadlineExceeded",
    "Error",
    "Internal",
    "InvalidArgument",
    "MemBuffer",
    "MemPool",
    "Node",
    "NotFound",
    "Payload",
    "Pool",
    "Ref",
    "ResourceExhausted",
    "Server",
    "Unavailable",
    "cancelled",
]

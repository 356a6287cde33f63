"""Type stubs of dmrpc's native module."""

import os
from typing import Any, Callable, Iterable, Literal

class Error(Exception):
    status: str
    metadata: tuple[tuple[str, bytes], ...]
    """Raised by a call: the metadata its answer carried. Raised by a
    handler (set or kept from a nested call's error): goes with the answer."""

class NotFound(Error): ...
class InvalidArgument(Error): ...
class DeadlineExceeded(Error): ...
class Unavailable(Error): ...
class ResourceExhausted(Error): ...
class Internal(Error): ...
class Unauthenticated(Error): ...
class PermissionDenied(Error): ...
class AlreadyExists(Error): ...
class Cancelled(Error): ...

class Ref:
    """40 bytes naming a frozen snapshot of pool memory; picklable, and
    bytes-like (memoryview(r) is the encoding; len(r) is the data's length)."""

    @classmethod
    def from_bytes(cls, b: bytes) -> Ref: ...
    def to_bytes(self) -> bytes: ...
    def __bytes__(self) -> bytes: ...
    @property
    def len(self) -> int: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int) -> memoryview: ...

class Buffer:
    """Pool memory. Mapped: a writable view (memoryview, numpy.frombuffer),
    copy-on-write by write fault. Explicit (mapped=False): no page-table
    work, write() copies shared pages in software, a read-only view when
    its pages are consecutive."""

    def __len__(self) -> int: ...
    @property
    def mapped(self) -> bool: ...
    @property
    def address(self) -> int: ...
    def read(self, offset: int = 0, length: int | None = None) -> bytes: ...
    def write(self, data: bytes | bytearray | memoryview, offset: int = 0) -> None: ...
    def share(self) -> Ref: ...
    def into_ref(self) -> Ref: ...
    def free(self) -> None: ...
    def __buffer__(self, flags: int) -> memoryview: ...

class Pool:
    """A shared memory pool this process is attached to."""

    def __init__(self, path: str, size: int | None = None, page_size: int = 4096) -> None: ...
    @property
    def id(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    def alloc(self, size: int, mapped: bool = True) -> Buffer: ...
    def free(self, buf: Buffer) -> None: ...
    def create_ref(self, buf: Buffer, offset: int = 0, length: int | None = None) -> Ref: ...
    def map_ref(self, r: Ref, mapped: bool = True) -> Buffer: ...
    def release_ref(self, r: Ref) -> None: ...
    def maintain(self) -> None: ...
    def check(self) -> dict[str, Any]: ...
    def close(self) -> None: ...
    def __enter__(self) -> Pool: ...
    def __exit__(self, *exc: object) -> bool: ...

DEFAULT_INLINE_MAX: int

class Payload:
    """Data of a call or an answer: a read-only buffer (memoryview,
    numpy.frombuffer) over the pool's pages or the frame's bytes, no copy.
    Passed to another call or returned from a handler, it is forwarded
    untouched."""

    def __len__(self) -> int: ...
    @property
    def reply_metadata(self) -> tuple[tuple[str, bytes], ...]:
        """The metadata the handler set on the answer this payload came in
        (`set_reply_metadata`); empty for a handler's argument."""
        ...
    @property
    def by_ref(self) -> bool: ...
    @property
    def ref(self) -> Ref | None: ...
    def __bytes__(self) -> bytes: ...
    def tobytes(self) -> bytes: ...
    def keep(self, mapped: bool = True) -> Buffer | MemBuffer: ...
    def __buffer__(self, flags: int) -> memoryview: ...

Data = Payload | Buffer | MemBuffer | bytes | bytearray | memoryview | Any | None
"""What a call takes and a handler returns: None, a bytes-like object
(copied once), a Buffer or MemBuffer (sent by its pages), a Payload
(forwarded)."""

class MemBuffer:
    """A buffer on a memory server: explicit reads and writes."""

    def __len__(self) -> int: ...
    def read(self, offset: int = 0, length: int | None = None) -> bytes: ...
    def write(self, data: bytes | bytearray | memoryview, offset: int = 0) -> None: ...
    def share(self) -> Ref: ...
    def free(self) -> None: ...

class MemPool:
    """Memory servers (`dmrpc memserver`) used as one pool."""

    def __init__(
        self,
        servers: list[str],
        cache_bytes: int | None = None,
        timeout: float | None = None,
        key_file: str | os.PathLike[str] | None = None,
        admin_key_file: str | os.PathLike[str] | None = None,
        placement: Literal["local", "round-robin"] = "local",
    ) -> None: ...
    @property
    def page_size(self) -> int: ...
    def alloc(self, size: int) -> MemBuffer: ...
    def free(self, buf: MemBuffer) -> None: ...
    def create_ref(self, buf: MemBuffer, offset: int = 0, length: int | None = None) -> Ref: ...
    def map_ref(self, r: Ref) -> MemBuffer: ...
    def release_ref(self, r: Ref) -> None: ...
    def put(self, data: bytes | bytearray | memoryview) -> Ref: ...
    def read_ref(self, r: Ref, offset: int = 0, length: int | None = None) -> bytes: ...
    def usage(self) -> dict[str, int]: ...
    def check(self) -> list[str]: ...
    def close(self) -> None: ...
    def __enter__(self) -> MemPool: ...
    def __exit__(self, *exc: object) -> bool: ...

Document = None | bool | int | float | str | bytes | bytearray | memoryview | list["Document"] | tuple["Document", ...] | dict[str, "Document"]

class Heap:
    """A shared heap this process made: documents are written into it."""

    def __init__(self, pool: Pool, size: int) -> None: ...
    @property
    def size(self) -> int: ...
    def archive(self, obj: Document, sealed: bool = True) -> HeapDocument:
        """Writes `obj` into the heap as a document. Sealed, it holds still
        (read-only to this process) until `release()`."""
        ...

class HeapDocument:
    """A document written into a heap."""

    @property
    def arg(self) -> bytes:
        """The 96 bytes that pass it to another process of the pool."""
        ...
    def release(self) -> None: ...

class HeapBytes:
    """Bytes of a document, read in place: a read-only buffer."""

    def __len__(self) -> int: ...
    def __buffer__(self, flags: int) -> memoryview: ...

class Heaps:
    """The heaps this process reads documents from."""

    def __init__(self, pool: Pool) -> None: ...
    def document(self, arg: bytes | bytearray | memoryview, check: str = "sealed") -> object:
        """The document `arg` passes, as dicts, lists, str, int, float,
        bool, None and HeapBytes. `check`: "sealed" (verify the seal,
        validate in place), "copy" (copy out, then validate) or "trusted"."""
        ...

class Server:
    """A running service."""

    @property
    def tcp_addr(self) -> str | None: ...
    def shutdown(self, grace: float | None = None) -> None:
        """Stops the service; with `grace` (seconds), first serves the calls
        already sent (refusing new ones) for at most that long. Requests it
        did not run go to the service's next server, if any."""
        ...

class Client:
    """A connection to a service. When it breaks, a later call finds the
    service registered again (a restarted server, or another process taking
    its name) and calls it; calls in flight then fail with `Unavailable`,
    except those known not to have run (a server that stops says which it
    took) and those marked `idempotent`, which go to the new server."""

    @property
    def reconnects(self) -> int:
        """How many times the client connected again (of a balanced client,
        how many times its connections failed over to another replica)."""
        ...

    @property
    def replicas(self) -> int:
        """How many replicas new calls may go to (a client of one
        connection: 1 while it is connected, else 0)."""
        ...

    def with_metadata(self, metadata: Metadata) -> Client:
        """A client on the same connection whose calls all carry `metadata`
        (a credential, a client name), besides their own; a key a call sets
        itself keeps the call's value."""
        ...

    def intercept(
        self, f: Callable[[str, tuple[tuple[str, bytes], ...]], Metadata | None]
    ) -> Client:
        """A client on the same connection whose calls all pass `f` first:
        `f(method, metadata)` runs before each call is sent; what it returns,
        unless None, is the call's metadata from then on; a `dmrpc.Error` it
        raises refuses the call with its status, nothing sent."""
        ...

    def call(
        self,
        method: str,
        data: Data = None,
        timeout: float | None = None,
        detached: bool = False,
        wait_for_ready: bool = False,
        idempotent: bool = False,
        metadata: Metadata | None = None,
        retry: RetryPolicy | None = None,
    ) -> Payload:
        """Calls `method`; from a service's handler, waits no longer than
        the handler's own caller does, unless `detached`. With
        `wait_for_ready`, a call whose service went away waits (until its
        timeout) for it to be registered again. An `idempotent` call may
        run twice: if its connection breaks while it is in flight, it is
        sent again. `metadata` goes with the call (the handler reads it
        with `dmrpc.metadata()`). `retry`: send it again when its answer's
        status is one the policy lists, up to its attempts, after growing
        random waits (or the server's `retry-after-ms`), within `timeout`."""
        ...

    def with_retry(self, retry: RetryPolicy) -> Client:
        """A client on the same connection whose calls that pass no `retry`
        follow this policy."""
        ...

    def call_stream(
        self,
        method: str,
        data: Data = None,
        timeout: float | None = None,
        window: int | None = None,
        wait_for_ready: bool = False,
        idempotent: bool = False,
        metadata: Metadata | None = None,
    ) -> Stream:
        """Calls streaming method `method` (served with `Node.serve(...,
        streams=...)`); returns the `Stream` of its items. `timeout` bounds
        the whole stream; `window`: items held unread at most (default 16:
        the server waits while the caller holds that many). A request
        refused by a stopping server, never taken by a stopped one, or
        `idempotent` on a broken connection goes to the next server before
        any item came. On a balanced client, the stream goes to one replica
        (counted in flight there until it ends or is dropped)."""
        ...

    def call_bidi(
        self,
        method: str,
        data: Data = None,
        timeout: float | None = None,
        wait_for_ready: bool = False,
        metadata: Metadata | None = None,
    ) -> Bidi:
        """Calls `method` (served with `Node.serve(..., bidi=...)`) with
        `data`, then sends items as it goes: `send` and `finish` on the
        returned `Bidi`, and iterate it for the answer's items. `timeout`
        bounds the whole call. Not on a balanced client."""
        ...

class Bidi:
    """The caller's end of a call whose caller sends items: `send(item)`
    waits while the server's grant is used up; `finish()` ends the items;
    iterating gives the answer's items. One thread may send while another
    reads. `close()` (or leaving a `with` block) cancels the call."""

    def send(self, data: Data) -> None: ...
    def finish(self) -> None: ...
    def __iter__(self) -> Bidi: ...
    def __next__(self) -> Payload: ...
    def close(self) -> None: ...
    def __enter__(self) -> Bidi: ...
    def __exit__(self, *exc: object) -> bool: ...
    @property
    def metadata(self) -> tuple[tuple[str, bytes], ...]: ...

class Inbox:
    """The caller's items, as a `bidi` method's handler reads them: iterate
    for `Payload`s, on the handler's thread while it runs. Read from
    another thread, or after, it raises `dmrpc.InvalidArgument`."""

    def __iter__(self) -> Inbox: ...
    def __next__(self) -> Payload: ...

class Stream:
    """The items of a streaming call, as they come: iterate for `Payload`s;
    the error the stream ends with, if any, is raised. `close()` (or leaving
    a `with` block, or dropping it) before the end cancels the call."""

    def __iter__(self) -> Stream: ...
    def __next__(self) -> Payload: ...
    def close(self) -> None: ...
    def __enter__(self) -> Stream: ...
    def __exit__(self, *exc: object) -> bool: ...
    @property
    def metadata(self) -> tuple[tuple[str, bytes], ...]:
        """The metadata of the answer that ended the stream (empty before
        the end)."""
        ...

class CallHandle:
    """A call started by `AsyncClient.start` (or a stream's opening, or
    one of its reads)."""

    def cancel(self) -> None: ...

class AsyncClient:
    """A connection to a service for asyncio code (wrapped by `dmrpc.aio`)."""

    @property
    def reconnects(self) -> int:
        """How many times the client connected again (see `Client.reconnects`)."""
        ...

    @property
    def replicas(self) -> int:
        """How many replicas new calls may go to (see `Client.replicas`)."""
        ...

    def with_metadata(self, metadata: Metadata) -> AsyncClient:
        """A client on the same connection whose calls all carry `metadata`."""
        ...

    def intercept(
        self, f: Callable[[str, tuple[tuple[str, bytes], ...]], Metadata | None]
    ) -> AsyncClient:
        """A client on the same connection whose calls all pass `f` first."""
        ...

    def start(
        self,
        method: str,
        data: Data,
        timeout: float | None,
        event_loop: Any,
        fut: Any,
        resolve: Callable[[Any, bool, Any], None],
        detached: bool = False,
        wait_for_ready: bool = False,
        idempotent: bool = False,
        metadata: Metadata | None = None,
        retry: RetryPolicy | None = None,
    ) -> CallHandle: ...

    def start_stream(
        self,
        method: str,
        data: Data,
        timeout: float | None,
        event_loop: Any,
        fut: Any,
        resolve: Callable[[Any, bool, Any], None],
        window: int | None = None,
        wait_for_ready: bool = False,
        idempotent: bool = False,
        metadata: Metadata | None = None,
    ) -> CallHandle: ...

    def start_bidi(
        self,
        method: str,
        data: Data,
        timeout: float | None,
        event_loop: Any,
        fut: Any,
        resolve: Callable[[Any, bool, Any], None],
        wait_for_ready: bool = False,
        metadata: Metadata | None = None,
    ) -> CallHandle: ...

    def with_retry(self, retry: RetryPolicy) -> AsyncClient: ...

class AsyncBidi:
    """An async call whose caller sends items (wrapped by `dmrpc.aio`):
    `send` and `finish` resolve their futures with None or the exception,
    `next` as `AsyncStream.next`."""

    def send(self, data: Data, event_loop: Any, fut: Any, resolve: Callable[[Any, bool, Any], None]) -> CallHandle: ...
    def finish(self, event_loop: Any, fut: Any, resolve: Callable[[Any, bool, Any], None]) -> CallHandle: ...
    def next(self, event_loop: Any, fut: Any, resolve: Callable[[Any, bool, Any], None]) -> CallHandle: ...
    def close(self) -> None: ...
    @property
    def metadata(self) -> tuple[tuple[str, bytes], ...]: ...

class AsyncStream:
    """The items of an async streaming call (wrapped by `dmrpc.aio`):
    `next` resolves its future with a `Payload`, None at the end, or the
    exception the stream ended with."""

    def next(self, event_loop: Any, fut: Any, resolve: Callable[[Any, bool, Any], None]) -> CallHandle: ...
    def close(self) -> None: ...
    @property
    def metadata(self) -> tuple[tuple[str, bytes], ...]: ...

Handler = Callable[[Payload], Data]
# A retry policy: {"attempts": 3, "on": ["Unavailable", dmrpc.ResourceExhausted],
# "backoff": 0.01, "max_backoff": 1.0} (attempts in all; waits in seconds).
RetryPolicy = dict[str, Any]
# Call metadata: a dict, or (key, value) pairs; keys of a-z, 0-9, '-', '_',
# '.'; values str or bytes-like.
Metadata = dict[str, str | bytes] | list[tuple[str, str | bytes]] | tuple[tuple[str, str | bytes], ...]

class Node:
    """This process's RPC endpoint on a pool."""

    def __init__(
        self,
        pool: Pool,
        memservers: MemPool | None = None,
        inline_max: int | None = None,
        by_value: bool = False,
    ) -> None:
        """`inline_max`: payloads up to this many bytes go inline, larger by
        Ref, capped by what a connection's frames carry (over shared memory,
        half a ring). `by_value`: every payload inline, whatever its size;
        one too large for the connection's frames raises
        `ResourceExhausted`."""
        ...
    def serve(
        self,
        name: str,
        handlers: dict[str, Handler],
        tcp: str | None = None,
        intercept: Callable[[str, tuple[tuple[str, bytes], ...]], None] | None = None,
        propagate: list[str] | None = None,
        replica: bool = False,
        streams: dict[str, Callable[[Payload], Iterable[Data]]] | None = None,
        wait_for_name: float | None = None,
        bidi: dict[str, Callable[[Payload, Inbox], Iterable[Data]]] | None = None,
    ) -> Server:
        """Serves `handlers` as service `name` (on TCP at `tcp` if given).
        `intercept(method, metadata)` runs before every handler: a
        `dmrpc.Error` it raises is the answer. `propagate`: metadata keys the
        calls a handler makes inherit from the call it serves. `replica`:
        one of any number of servers sharing `name` (see `connect`'s
        `balanced`). `streams`: streaming methods, each returning an iterable
        (a generator, say) of items sent as they come (`Client.call_stream`);
        a `dmrpc.Error` raised ends the stream with its status. `bidi`:
        methods whose caller sends items too (`Client.call_bidi`), each
        taking the request and an `Inbox` of the caller's items.
        `wait_for_name`: seconds to wait for a name a live process holds
        (default: raise `dmrpc.AlreadyExists` at once, naming the holder)."""
        ...
    def connect(self, name: str, lazy: bool = False, balanced: bool = False) -> Client:
        """Connects to service `name`; `lazy`: on the first call instead (until
        the service registers, calls raise `Unavailable`, or wait for it with
        `wait_for_ready=True`). `balanced`: to every replica of `name`, each
        call going to the one with the fewest calls in flight (in turn among
        equals); replicas that join are found, and a request a leaving
        replica refused or never took goes to another."""
        ...
    def connect_tcp(self, addr: str) -> Client: ...
    def connect_async(self, name: str, lazy: bool = False, balanced: bool = False) -> AsyncClient: ...
    def connect_tcp_async(self, addr: str) -> AsyncClient: ...

def cancelled() -> bool:
    """Whether the call this thread serves was given up: its deadline
    passed, or its caller cancelled it. A handler with long work may look
    now and then and stop early (what it answers then is dropped). False
    outside a handler."""
    ...

def set_reply_metadata(metadata: Metadata) -> None:
    """Sets the metadata of the answer to the call this thread serves,
    replacing what was set before; it goes with the answer whether the
    handler returns or raises (its caller reads `Payload.reply_metadata`
    or the exception's `.metadata`). Outside a handler, raises
    `InvalidArgument`."""
    ...

def metadata() -> tuple[tuple[str, bytes], ...]:
    """The metadata of the call this thread serves, as (key, value) pairs in
    the order the caller gave them (a key may repeat); empty outside a
    handler, or if the caller sent none."""
    ...

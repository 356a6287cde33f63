"""An asyncio client: `await client.call(...)` without blocking the event loop.

Each call is a future of the running event loop, with no thread per
call: any number of calls can be awaited together, and the connection
carries them concurrently. A call first waits for its answer on the
loop's thread, without the GIL, for the waiting policy's spin (at most
20 us by default, less once answers take longer; and, when the connection
is full, for room to send, as a Rust async call does); a call still waiting
then is completed by dmrpc's own runtime (one thread for all the async
clients of the process). Cancelling the task that awaits a call cancels
the call: the server is told, and what its argument lent is released.

    import asyncio, dmrpc, dmrpc.aio

    async def main():
        node = dmrpc.Node(dmrpc.Pool("/dev/shm/dmrpc-default.pool"))
        async with dmrpc.aio.connect(node, "shop/images/resize") as c:
            answers = await asyncio.gather(*(c.call("resize", img) for img in images))
"""

from __future__ import annotations

import asyncio
from typing import Any

from ._native import AsyncBidi as _AsyncBidi
from ._native import AsyncClient as _AsyncClient
from ._native import AsyncStream as _AsyncStream
from ._native import Node, Payload

__all__ = ["AsyncBidi", "AsyncClient", "AsyncStream", "connect", "connect_tcp"]


def _resolve(fut: asyncio.Future[Payload], ok: bool, value: Any) -> None:
    # Runs on the loop: a call whose awaiting task was cancelled drops its
    # answer (a Payload releases what it holds when collected).
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


async def _await(start: Any) -> Any:
    # Starts native work that resolves a future of the running loop (see
    # `_resolve`), and awaits it; cancelling the awaiting task cancels it.
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()
    handle = start(loop, fut)
    try:
        return await fut
    except asyncio.CancelledError:
        handle.cancel()
        raise


class AsyncStream:
    """The items of an async streaming call (`AsyncClient.call_stream`), as
    they come: `async for item in stream` gives `Payload`s; the error the
    stream ends with, if any, is raised. Cancelling a task that waits for
    an item loses nothing (the item is the next one's). `close()` (or
    leaving an `async with` block, or dropping it) before the end cancels
    the call."""

    def __init__(self, native: _AsyncStream | _AsyncBidi) -> None:
        self._st = native

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Payload:
        item = await _await(lambda loop, fut: self._st.next(loop, fut, _resolve))
        if item is None:
            raise StopAsyncIteration
        return item

    def close(self) -> None:
        """Cancels the call if it has not ended, and releases what came and
        was not read."""
        self._st.close()

    async def aclose(self) -> None:
        self.close()

    @property
    def metadata(self) -> tuple[tuple[str, bytes], ...]:
        """The metadata of the answer that ended the stream (empty before
        the end)."""
        return self._st.metadata

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class AsyncBidi(AsyncStream):
    """An async call whose caller sends items (`AsyncClient.call_bidi`):
    `await send(item)` waits while the server's grant is used up, `await
    finish()` ends the items, and `async for item in call` gives the
    answer's `Payload`s, as an `AsyncStream`'s. One task may send while
    another reads. `close()` (or leaving an `async with` block) before the
    end cancels the call."""

    def __init__(self, native: _AsyncBidi) -> None:
        super().__init__(native)
        self._b = native

    async def send(self, data: Any) -> None:
        await _await(lambda loop, fut: self._b.send(data, loop, fut, _resolve))

    async def finish(self) -> None:
        await _await(lambda loop, fut: self._b.finish(loop, fut, _resolve))


class AsyncClient:
    """A connection to a service, for asyncio code."""

    def __init__(self, client: _AsyncClient, max_concurrency: int | None = None) -> None:
        self._client = client
        self._limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self._in_flight: set[asyncio.Future[Payload]] = set()

    async def call(
        self,
        method: str,
        data: Any = None,
        timeout: float | None = None,
        detached: bool = False,
        wait_for_ready: bool = False,
        idempotent: bool = False,
        metadata: Any = None,
        retry: Any = None,
    ) -> Payload:
        """Calls `method` (see `dmrpc.Client.call`); the same exceptions."""
        extra = (detached, wait_for_ready, idempotent, metadata, retry)
        if self._limit is None:
            return await self._call(method, data, timeout, extra)
        async with self._limit:
            return await self._call(method, data, timeout, extra)

    async def _call(self, method: str, data: Any, timeout: float | None, extra: tuple[Any, ...]) -> Payload:
        fut: asyncio.Future[Payload] = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()
        handle = self._client.start(method, data, timeout, loop, fut, _resolve, *extra)
        self._in_flight.add(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            handle.cancel()
            raise
        finally:
            self._in_flight.discard(fut)

    async def call_stream(
        self,
        method: str,
        data: Any = None,
        timeout: float | None = None,
        window: int | None = None,
        wait_for_ready: bool = False,
        idempotent: bool = False,
        metadata: Any = None,
    ) -> AsyncStream:
        """Calls streaming method `method` (see `dmrpc.Client.call_stream`):
        the `AsyncStream` of its items, once the request is sent."""
        extra = (window, wait_for_ready, idempotent, metadata)
        native = await _await(
            lambda loop, fut: self._client.start_stream(method, data, timeout, loop, fut, _resolve, *extra)
        )
        return AsyncStream(native)

    async def call_bidi(
        self,
        method: str,
        data: Any = None,
        timeout: float | None = None,
        wait_for_ready: bool = False,
        metadata: Any = None,
    ) -> AsyncBidi:
        """Calls `method` and sends items as it goes (see
        `dmrpc.Client.call_bidi`): the `AsyncBidi`, once the request is
        sent. Not on a balanced client."""
        extra = (wait_for_ready, metadata)
        native = await _await(
            lambda loop, fut: self._client.start_bidi(method, data, timeout, loop, fut, _resolve, *extra)
        )
        return AsyncBidi(native)

    def with_retry(self, retry: Any) -> AsyncClient:
        """A client on the same connection whose calls that pass no `retry`
        follow this policy (see `dmrpc.Client.with_retry`); no limit on calls
        in flight."""
        return AsyncClient(self._client.with_retry(retry))

    def with_metadata(self, metadata: Any) -> AsyncClient:
        """A client on the same connection whose calls all carry `metadata`
        (see `dmrpc.Client.with_metadata`); no limit on calls in flight."""
        return AsyncClient(self._client.with_metadata(metadata))

    def intercept(self, f: Any) -> AsyncClient:
        """A client on the same connection whose calls all pass `f` first
        (see `dmrpc.Client.intercept`); no limit on calls in flight."""
        return AsyncClient(self._client.intercept(f))

    @property
    def reconnects(self) -> int:
        """How many times the client connected again (see `dmrpc.Client.reconnects`)."""
        return self._client.reconnects

    @property
    def replicas(self) -> int:
        """How many replicas new calls may go to (see `dmrpc.Client.replicas`)."""
        return self._client.replicas

    async def aclose(self) -> None:
        """Waits for the calls in flight."""
        await asyncio.gather(*self._in_flight, return_exceptions=True)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def connect(
    node: Node,
    name: str,
    max_concurrency: int | None = None,
    lazy: bool = False,
    balanced: bool = False,
) -> AsyncClient:
    """Connects to service `name` (see `dmrpc.Node.connect`, and its `lazy`
    and `balanced`); at most `max_concurrency` calls in flight at once, if
    given."""
    return AsyncClient(node.connect_async(name, lazy, balanced), max_concurrency)


def connect_tcp(node: Node, addr: str, max_concurrency: int | None = None) -> AsyncClient:
    """Connects to a service by TCP address (see `dmrpc.Node.connect_tcp`)."""
    return AsyncClient(node.connect_tcp_async(addr), max_concurrency)

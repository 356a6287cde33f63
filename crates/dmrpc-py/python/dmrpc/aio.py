"""An asyncio client: `await client.call(...)` without blocking the event loop.

Each call runs the blocking `dmrpc.Client.call` on a thread of a pool of
the client's own (the GIL is released while a call waits), so any number
of calls can be awaited together up to `max_concurrency`; the connection
itself carries them concurrently.

    import asyncio, dmrpc, dmrpc.aio

    async def main():
        node = dmrpc.Node(dmrpc.Pool("/dev/shm/dmrpc-default.pool"))
        async with dmrpc.aio.connect(node, "shop/images/resize") as c:
            answers = await asyncio.gather(*(c.call("resize", img) for img in images))
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ._native import Client as _Client
from ._native import Node, Payload

__all__ = ["AsyncClient", "connect", "connect_tcp"]


class AsyncClient:
    """A connection to a service, for asyncio code."""

    def __init__(self, client: _Client, max_concurrency: int = 16) -> None:
        self._client = client
        self._threads = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="dmrpc-aio")

    async def call(self, method: str, data: Any = None, timeout: float | None = None) -> Payload:
        """Calls `method` (see `dmrpc.Client.call`); the same exceptions."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, functools.partial(self._client.call, method, data, timeout))

    def close(self) -> None:
        """Waits for calls in flight, then stops the threads."""
        self._threads.shutdown(wait=True)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)


def connect(node: Node, name: str, max_concurrency: int = 16) -> AsyncClient:
    """Connects to service `name` (see `dmrpc.Node.connect`)."""
    return AsyncClient(node.connect(name), max_concurrency)


def connect_tcp(node: Node, addr: str, max_concurrency: int = 16) -> AsyncClient:
    """Connects to a service by TCP address (see `dmrpc.Node.connect_tcp`)."""
    return AsyncClient(node.connect_tcp(addr), max_concurrency)

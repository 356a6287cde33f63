"""asyncio calls through `dmrpc.aio` against the same calls run by the
blocking client on a thread pool (what `dmrpc.aio` did before, and what
asyncio code does with a blocking client): microseconds per call, one at a
time and 16 at once, to a Python service in the same process.

    target/pyenv/bin/python crates/dmrpc-py/bench/aio_calls.py [ROUNDS]
"""

import asyncio
import functools
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import dmrpc
import dmrpc.aio


class ThreadPoolClient:
    """The baseline: each call runs `dmrpc.Client.call` on a pool thread."""

    def __init__(self, client: dmrpc.Client) -> None:
        self._client = client
        self._threads = ThreadPoolExecutor(max_workers=16)

    async def call(self, method, data=None):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, functools.partial(self._client.call, method, data))

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self._threads.shutdown(wait=True)


async def per_call(c, n: int, at_once: int) -> float:
    t = time.perf_counter()
    for _ in range(n // at_once):
        await asyncio.gather(*(c.call("len", b"x") for _ in range(at_once)))
    return (time.perf_counter() - t) / n * 1e6


async def main(node: dmrpc.Node, name: str, rounds: int) -> None:
    makers = (
        ("thread pool", lambda: ThreadPoolClient(node.connect(name))),
        ("dmrpc.aio", lambda: dmrpc.aio.connect(node, name)),
    )
    for r in range(rounds):
        for label, make in makers:
            async with make() as c:
                await per_call(c, 200, 1)
                one = await per_call(c, 3000, 1)
                many = await per_call(c, 3200, 16)
            print(f"round {r} {label:>11}: {one:6.1f} us per call one at a time, {many:6.1f} us per call 16 at once")


if __name__ == "__main__":
    path = f"/dev/shm/dmrpc-aio-bench-{os.getpid()}.pool"
    pool = dmrpc.Pool(path, size=64 << 20)
    try:
        node = dmrpc.Node(pool)
        srv = node.serve("bench/aio", {"len": lambda a: len(a).to_bytes(8, "little")})
        asyncio.run(main(node, "bench/aio", int(sys.argv[1]) if len(sys.argv) > 1 else 3))
        srv.shutdown()
        pool.close()
    finally:
        os.unlink(path)

"""Services and clients from Python: across processes, Python to Rust and
Rust to Python, errors as typed exceptions."""

import asyncio
import gc
import itertools
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import dmrpc
from conftest import pool_for
import dmrpc.aio

_N = itertools.count()
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def agent():
    """The Rust service/client process of dm-rpc's tests (built by scripts/python.sh)."""
    path = os.environ.get("DMRPC_AGENT") or os.path.join(ROOT, "target", "release", "dm-rpc-agent")
    if not os.path.exists(path):
        pytest.skip(f"no dm-rpc-agent at {path} (scripts/python.sh builds it)")
    return path


@pytest.fixture
def pool():
    yield from pool_for("rpc", 64 << 20, all_free=True)


def test_python_service_and_client_in_one_process(pool):
    p, _ = pool
    node = dmrpc.Node(p)
    name = f"py/echo/{os.getpid()}/{next(_N)}"

    def upper(b):
        assert isinstance(b, dmrpc.Payload) and not b.by_ref
        return bytes(b).upper()

    def boom(b):
        raise ValueError("bad value")

    def refuse(b):
        raise dmrpc.InvalidArgument("no thanks")

    srv = node.serve(name, {"upper": upper, "boom": boom, "refuse": refuse, "sum": lambda b: np.frombuffer(b, dtype=np.uint8).sum().tobytes()})
    c = node.connect(name)
    assert bytes(c.call("upper", b"hello")) == b"HELLO"
    big = np.arange(1 << 20, dtype=np.uint8)  # above the threshold: by Ref
    got = np.frombuffer(c.call("sum", big), dtype=np.uint64)[0]
    assert got == int(big.sum())
    with pytest.raises(dmrpc.Internal, match="bad value"):
        c.call("boom", b"")
    with pytest.raises(dmrpc.InvalidArgument, match="no thanks") as e:
        c.call("refuse", b"")
    assert e.value.status == "InvalidArgument"
    with pytest.raises(dmrpc.NotFound):
        c.call("absent", b"")
    with pytest.raises(dmrpc.NotFound):
        node.connect(f"py/none/{os.getpid()}")
    with pytest.raises(TypeError):
        c.call("upper", 12)
    with pytest.raises(dmrpc.InvalidArgument):
        c.call("upper", b"x", timeout=-1.0)
    del c
    srv.shutdown()


def test_metadata_goes_with_a_call_to_the_handler(pool):
    p, _ = pool
    node = dmrpc.Node(p)
    name = f"py/meta/{os.getpid()}/{next(_N)}"

    def show(b):
        return repr(dmrpc.metadata()).encode()

    srv = node.serve(name, {"show": show})
    try:
        c = node.connect(name)
        ac = dmrpc.aio.connect(node, name)
        assert bytes(c.call("show", b"")) == b"()"
        got = bytes(c.call("show", b"", metadata={"trace-id": "t1", "bin": b"\x00\xff"}))
        assert got == repr((("trace-id", b"t1"), ("bin", b"\x00\xff"))).encode()
        pairs = [("k", "1"), ("k", bytearray(b"2"))]
        got = bytes(asyncio.run(ac.call("show", b"x", metadata=pairs)))
        assert got == repr((("k", b"1"), ("k", b"2"))).encode()
        assert dmrpc.metadata() == (), "outside a handler"
        with pytest.raises(dmrpc.InvalidArgument):
            c.call("show", b"", metadata={"Not A Key": "v"})
        del c, ac
    finally:
        srv.shutdown()


def test_a_handler_sets_the_metadata_of_its_answer(pool):
    # What a handler sets goes with its answer (Payload.reply_metadata), or
    # with its error (the exception's .metadata); a nested call's error
    # passed on keeps its metadata.
    p, _ = pool
    node = dmrpc.Node(p)
    base = f"py/reply-meta/{os.getpid()}/{next(_N)}"

    def busy(b):
        dmrpc.set_reply_metadata({"retry-after-ms": "250"})
        raise dmrpc.ResourceExhausted("busy")

    up = node.serve(f"{base}/up", {"busy": busy})

    def echo(b):
        dmrpc.set_reply_metadata({"replaced": "yes"})
        dmrpc.set_reply_metadata(list(dmrpc.metadata()) + [("served-by", "py")])
        return b

    def nested(b):
        dmrpc.set_reply_metadata({"hop": "front"})
        return node.connect(f"{base}/up").call("busy", b"")

    def carried(b):
        e = dmrpc.Unavailable("down")
        e.metadata = {"carried": b"\x01"}
        raise e

    srv = node.serve(base, {"echo": echo, "nested": nested, "carried": carried})
    try:
        c = node.connect(base)
        ac = dmrpc.aio.connect(node, base)
        big = bytes(range(256)) * 1200
        for data in (b"small", big):
            r = c.call("echo", data, metadata={"trace-id": "t1"})
            assert bytes(r) == data
            assert r.reply_metadata == (("trace-id", b"t1"), ("served-by", b"py"))
            r = asyncio.run(ac.call("echo", data, metadata=[("k", "v")]))
            assert r.reply_metadata == (("k", b"v"), ("served-by", b"py"))
        # (Released now: the exceptions' tracebacks below hold this frame.)
        del r
        with pytest.raises(dmrpc.ResourceExhausted) as e:
            c.call("nested", b"")
        assert e.value.metadata == (("hop", b"front"), ("retry-after-ms", b"250"))
        with pytest.raises(dmrpc.Unavailable) as e:
            c.call("carried", b"")
        assert e.value.metadata == (("carried", b"\x01"),)
        with pytest.raises(dmrpc.InvalidArgument):
            dmrpc.set_reply_metadata({"k": "v"})  # outside a handler
        with pytest.raises(dmrpc.InvalidArgument) as e:
            c.call("echo", b"", metadata={"Bad Key": "v"})
        assert e.value.metadata == ()
        del c, ac
    finally:
        srv.shutdown()
        up.shutdown()


def test_an_interceptor_guards_every_method_and_chosen_metadata_goes_on(pool):
    p, _ = pool
    node = dmrpc.Node(p)
    base = f"py/guard/{os.getpid()}/{next(_N)}"
    up = node.serve(f"{base}/up", {"show": lambda b: repr(dmrpc.metadata()).encode()})
    seen = []

    def check(method, metadata):
        seen.append(method)
        if ("token", b"secret") not in metadata:
            dmrpc.set_reply_metadata({"auth": "token"})
            raise dmrpc.Unauthenticated("no valid token")
        if method == "admin":
            raise dmrpc.PermissionDenied("not for you")

    def relay(b):
        return node.connect(f"{base}/up").call("show", b"")

    srv = node.serve(
        base,
        {"relay": relay, "admin": lambda b: b"ran"},
        intercept=check,
        propagate=["trace-id"],
    )
    try:
        c = node.connect(base)
        with pytest.raises(dmrpc.Unauthenticated) as e:
            c.call("relay", b"")
        assert e.value.metadata == (("auth", b"token"),)
        creds = {"token": "secret", "trace-id": "t-9"}
        got = bytes(c.call("relay", b"", metadata=creds))
        assert got == repr((("trace-id", b"t-9"),)).encode()
        with pytest.raises(dmrpc.PermissionDenied):
            c.call("admin", b"", metadata=creds)
        assert seen == ["relay", "relay", "admin"]
        # Clients whose calls all carry the credential.
        authed = c.with_metadata({"token": "secret"})
        assert bytes(authed.call("relay", b"")) == b"()"
        aio = dmrpc.aio.connect(node, base).with_metadata([("token", "secret"), ("trace-id", "a")])
        got = bytes(asyncio.run(aio.call("relay", b"")))
        assert got == repr((("trace-id", b"a"),)).encode()
        with pytest.raises(dmrpc.Unauthenticated):
            authed.call("relay", b"", metadata={"token": "guess"})
        # A client interceptor adds the credential (seeing the client's own
        # metadata), or refuses a call before it is sent.
        seen_by_client = []

        def add_token(method, metadata):
            seen_by_client.append((method, metadata))
            if method == "admin":
                raise dmrpc.PermissionDenied("not from this client")
            return list(metadata) + [("token", "secret")]

        tagged = c.with_metadata({"trace-id": "t-1"}).intercept(add_token)
        got = bytes(tagged.call("relay", b""))
        assert got == repr((("trace-id", b"t-1"),)).encode()
        with pytest.raises(dmrpc.PermissionDenied, match="not from this client"):
            tagged.call("admin", b"")
        assert seen_by_client == [("relay", (("trace-id", b"t-1"),)), ("admin", (("trace-id", b"t-1"),))]
        assert seen[-1] == "relay"  # the refused call never reached the server
        # None leaves the metadata as it is; an async client's too.
        with pytest.raises(dmrpc.Unauthenticated):
            c.intercept(lambda m, md: None).call("relay", b"")
        aio_tagged = dmrpc.aio.connect(node, base).intercept(add_token)
        assert bytes(asyncio.run(aio_tagged.call("relay", b""))) == b"()"
        del c, e, authed, aio, tagged, aio_tagged
    finally:
        srv.shutdown()
        up.shutdown()


def test_a_retry_policy_sends_a_call_again(pool):
    p, _ = pool
    node = dmrpc.Node(p)
    base = f"py/retry/{os.getpid()}/{next(_N)}"
    tries = []

    def flaky(b):
        tries.append(len(b))
        if len(tries) % 3:
            raise dmrpc.Unavailable("not now")
        return bytes(b)[:4]

    srv = node.serve(base, {"flaky": flaky})
    try:
        c = node.connect(base)
        policy = {"attempts": 4, "on": ["Unavailable", dmrpc.ResourceExhausted], "backoff": 0.001}
        big = bytes(range(256)) * 1200
        assert bytes(c.call("flaky", big, retry=policy)) == big[:4]
        assert tries == [len(big)] * 3
        with pytest.raises(dmrpc.Unavailable):
            c.call("flaky", b"x")  # no policy: the first answer
        tries.clear()
        assert bytes(c.with_retry(policy).call("flaky", b"abcdef")) == b"abcd"
        assert len(tries) == 3
        tries.clear()
        ac = dmrpc.aio.connect(node, base)
        assert bytes(asyncio.run(ac.call("flaky", b"xyzw", retry=policy))) == b"xyzw"
        assert len(tries) == 3
        with pytest.raises(dmrpc.InvalidArgument):
            c.call("flaky", b"", retry={"attempts": 2, "on": ["NoSuchStatus"]})
        del c, ac
    finally:
        srv.shutdown()


def test_a_handlers_calls_wait_no_longer_than_its_caller(pool):
    # A handler's nested call inherits the deadline of the call it serves:
    # when the first caller gives up, so does the call it caused, unless
    # it is detached.
    p, _ = pool
    node = dmrpc.Node(p)
    base = f"py/deadline/{os.getpid()}/{next(_N)}"

    def slow(b):
        time.sleep(0.6)
        return b"done"

    leaf = node.serve(f"{base}/leaf", {"slow": slow})
    seen = []

    def via(b):
        c = node.connect(f"{base}/leaf")
        t0 = time.monotonic()
        try:
            r = bytes(c.call("slow", b"", detached=bytes(b) == b"detached"))
        except dmrpc.DeadlineExceeded:
            r = b"gave up"
        seen.append((r, time.monotonic() - t0))
        # (Answered well after the caller's deadline, which the nested
        # call's equals: an answer read the instant the deadline passes,
        # by a caller a loaded machine held up, would still be taken.)
        time.sleep(0.1)
        return r

    def via_aio(b):
        # An asyncio call started by the handler inherits too.
        import asyncio

        import dmrpc.aio

        async def main():
            async with dmrpc.aio.connect(node, f"{base}/leaf") as c:
                return bytes(await c.call("slow", b"", detached=bytes(b) == b"detached"))

        t0 = time.monotonic()
        try:
            r = asyncio.run(main())
        except dmrpc.DeadlineExceeded:
            r = b"gave up"
        seen.append((r, time.monotonic() - t0))
        # (Answered well after the caller's deadline, which the nested
        # call's equals: an answer read the instant the deadline passes,
        # by a caller a loaded machine held up, would still be taken.)
        time.sleep(0.1)
        return r

    front = node.serve(f"{base}/front", {"via": via, "via_aio": via_aio})
    c = node.connect(f"{base}/front")
    for method in ["via", "via_aio"]:
        for how, want in [(b"", b"gave up"), (b"detached", b"done")]:
            with pytest.raises(dmrpc.DeadlineExceeded):
                c.call(method, how, timeout=0.15)
            deadline = time.monotonic() + 10
            while not seen and time.monotonic() < deadline:
                time.sleep(0.01)
            r, took = seen.pop()
            assert r == want, (method, how)
            if want == b"gave up":
                assert took < 0.45, took
    # Without a deadline of its own, the front's call has none to inherit.
    assert bytes(c.call("via", b"")) == b"done"
    del c
    front.shutdown()
    leaf.shutdown()


def test_a_graceful_shutdown_serves_the_calls_already_sent(pool):
    p, _ = pool
    node = dmrpc.Node(p)
    name = f"py/graceful/{os.getpid()}/{next(_N)}"

    def slow(b):
        time.sleep(0.3)
        return bytes(b)

    srv = node.serve(name, {"slow": slow})
    c = node.connect(name)
    got = []
    t = threading.Thread(target=lambda: got.append(bytes(c.call("slow", b"abc"))))
    t.start()
    time.sleep(0.1)
    srv.shutdown(grace=10.0)
    t.join()
    assert got == [b"abc"]
    with pytest.raises(dmrpc.Unavailable):
        c.call("slow", b"x")
    with pytest.raises(dmrpc.InvalidArgument):
        node.serve(f"{name}/2", {"slow": slow}).shutdown(grace=-1.0)


SERVER = textwrap.dedent(
    """
    import sys, dmrpc
    p = dmrpc.Pool(sys.argv[1])
    node = dmrpc.Node(p)
    srv = node.serve(sys.argv[2], {"rev": lambda b: bytes(b)[::-1], "len": lambda b: str(len(b)).encode()})
    print("ready", flush=True)
    sys.stdin.readline()
    srv.shutdown()
    """
)


def _start(script, path, name):
    """A Python child process running `script` on pool `path` for service `name`, once it says it is ready."""
    child = subprocess.Popen([sys.executable, "-c", script, path, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


REPLICA = textwrap.dedent(
    """
    import os, sys, dmrpc
    p = dmrpc.Pool(sys.argv[1])
    node = dmrpc.Node(p)
    who = str(os.getpid()).encode()
    srv = node.serve(sys.argv[2], {"who": lambda b: who, "rev": lambda b: bytes(b)[::-1]}, replica=True)
    print("ready", flush=True)
    line = sys.stdin.readline()
    srv.shutdown(grace=5 if line.strip() == "drain" else None)
    print("stopped", flush=True)
    """
)


def test_balanced_clients_spread_calls_over_replicas_in_several_processes(pool):
    p, path = pool
    name = f"py/replicas/{os.getpid()}/{next(_N)}"
    node = dmrpc.Node(p)

    children = [_start(REPLICA, path, name), _start(REPLICA, path, name)]
    me = str(os.getpid()).encode()
    here = node.serve(name, {"who": lambda b: me, "rev": lambda b: bytes(b)[::-1]}, replica=True)
    try:
        with pytest.raises(dmrpc.AlreadyExists):
            node.serve(name, {"who": lambda b: b""})  # a name is shared by replicas or held by one
        with pytest.raises(dmrpc.InvalidArgument):
            node.connect(name, lazy=True, balanced=True)
        c = node.connect(name, balanced=True)
        assert c.replicas == 3
        served = [bytes(c.call("who")) for _ in range(30)]
        want = {me} | {str(ch.pid).encode() for ch in children}
        assert {w: served.count(w) for w in want} == {w: 10 for w in want}

        async def async_calls():
            async with dmrpc.aio.connect(node, name, balanced=True) as ac:
                assert ac.replicas == 3
                return [bytes(await ac.call("who")) for _ in range(30)]

        served = asyncio.run(async_calls())
        assert {w: served.count(w) for w in want} == {w: 10 for w in want}
        # A large argument by Ref to every replica, intact.
        a = np.arange(1 << 18, dtype=np.uint8)
        for _ in range(3):
            assert bytes(c.call("rev", a)) == a.tobytes()[::-1]
        # One replica restarts gracefully while calls go on: none fails.
        errors, stop = [], threading.Event()

        def load():
            while not stop.is_set():
                try:
                    assert bytes(c.call("rev", b"abc", timeout=10)) == b"cba"
                except Exception as e:  # noqa: BLE001 (any failure fails the test)
                    errors.append(e)

        t = threading.Thread(target=load)
        t.start()
        try:
            time.sleep(0.05)
            old = children.pop(0)
            old.stdin.write("drain\n")
            old.stdin.flush()
            children.append(_start(REPLICA, path, name))
            assert old.stdout.readline().strip() == "stopped"
            old.wait(10)
            time.sleep(0.05)
        finally:
            stop.set()
            t.join()
        assert errors == []
        # The client follows the restart: the new replica is found (at its
        # next look, within 0.5 s; this pool has few channels, so a dial
        # may have to wait for the old replica's to be freed) and called.
        until = time.monotonic() + 5
        while c.replicas != 3:
            assert time.monotonic() < until, f"{c.replicas} replicas"
            c.call("who")
            time.sleep(0.01)
        served = {bytes(c.call("who")) for _ in range(30)}
        assert served == {me} | {str(ch.pid).encode() for ch in children}
    finally:
        here.shutdown()
        for ch in children:
            ch.stdin.close()
            ch.wait(10)


def test_a_handler_stops_when_its_call_is_given_up(pool):
    p, _ = pool
    node = dmrpc.Node(p)
    name = f"py/given-up/{os.getpid()}/{next(_N)}"
    stopped = []

    def long(b):
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5:
            if dmrpc.cancelled():
                stopped.append(time.monotonic() - t0)
                break
            time.sleep(0.001)
        return b""

    srv = node.serve(name, {"long": long})
    try:
        assert not dmrpc.cancelled()
        c = node.connect(name)
        # Dropped by an asyncio caller with no deadline: a cancel.
        ac = dmrpc.aio.connect(node, name)

        async def give_up():
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(ac.call("long", b"x"), 0.1)

        asyncio.run(give_up())
        # The deadline of a blocking caller (the handler stops as it passes
        # on its side, so its empty answer may beat the caller's).
        try:
            c.call("long", b"x", timeout=0.1)
        except dmrpc.DeadlineExceeded:
            pass
        until = time.monotonic() + 5
        while len(stopped) < 2 and time.monotonic() < until:
            time.sleep(0.01)
        assert len(stopped) == 2 and max(stopped) < 3, stopped
    finally:
        srv.shutdown()


def test_a_lazy_client_waits_for_a_service_that_starts_later(pool):
    p, _ = pool
    node = dmrpc.Node(p)
    name = f"py/lazy/{os.getpid()}/{next(_N)}"
    c = node.connect(name, lazy=True)
    ac = dmrpc.aio.connect(node, name, lazy=True)
    with pytest.raises(dmrpc.Unavailable):
        c.call("rev", b"abc")
    with pytest.raises(dmrpc.NotFound):
        node.connect(name)
    servers = []
    t = threading.Thread(target=lambda: (time.sleep(0.2), servers.append(node.serve(name, {"rev": lambda b: bytes(b)[::-1]}))))
    t.start()
    try:
        assert bytes(c.call("rev", b"abc", timeout=20, wait_for_ready=True)) == b"cba"
        assert bytes(asyncio.run(ac.call("rev", b"xy", timeout=20, wait_for_ready=True))) == b"yx"
        assert (c.reconnects, ac.reconnects) == (0, 0)
    finally:
        t.join()
        for s in servers:
            s.shutdown()


def _until_served(call):
    """`call()` until it succeeds (for up to 5 s): meanwhile it raises `Unavailable`."""
    until = time.monotonic() + 5
    while True:
        try:
            return call()
        except dmrpc.Unavailable:
            assert time.monotonic() < until, "the service is not called again"
            time.sleep(0.005)


def test_a_client_calls_the_process_that_takes_its_servers_name(pool):
    p, path = pool
    name = f"py/again/{os.getpid()}/{next(_N)}"
    node = dmrpc.Node(p)

    def stop(child):
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=10) == 0

    first = _start(SERVER, path, name)
    try:
        c = node.connect(name)
        ac = dmrpc.aio.connect(node, name)
        assert bytes(c.call("rev", b"abc")) == b"cba"
        assert bytes(asyncio.run(ac.call("rev", b"xy"))) == b"yx"
        assert bytes(c.call("rev", b"ab", idempotent=True)) == b"ba"
        assert bytes(asyncio.run(ac.call("rev", b"cd", idempotent=True))) == b"dc"
    finally:
        stop(first)
    with pytest.raises(dmrpc.Unavailable):
        c.call("rev", b"abc")
    with pytest.raises(dmrpc.Unavailable):
        asyncio.run(ac.call("rev", b"abc"))
    with pytest.raises(dmrpc.DeadlineExceeded):
        c.call("rev", b"abc", timeout=0.1, wait_for_ready=True)
    # Waiting for ready, a call gets through once the name is taken again.
    started = []
    t = threading.Thread(target=lambda: (time.sleep(0.2), started.append(_start(SERVER, path, name))))
    t.start()
    try:
        assert bytes(c.call("len", bytes(3 << 20), timeout=20, wait_for_ready=True)) == str(3 << 20).encode()
        t.join()
        assert bytes(_until_served(lambda: asyncio.run(ac.call("rev", b"abc")))) == b"cba"
        assert bytes(asyncio.run(ac.call("rev", b"de", timeout=5, wait_for_ready=True))) == b"ed"
        assert (c.reconnects, ac.reconnects) == (1, 1)
        del c, ac
    finally:
        t.join()
        for child in started:
            stop(child)


def test_python_client_and_server_in_two_processes(pool):
    p, path = pool
    name = f"py/srv/{os.getpid()}/{next(_N)}"
    child = subprocess.Popen([sys.executable, "-c", SERVER, path, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        c = dmrpc.Node(p).connect(name)
        assert bytes(c.call("rev", b"abc")) == b"cba"
        assert bytes(c.call("len", bytes(3 << 20))) == str(3 << 20).encode()
        del c
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=10) == 0


def test_python_calls_rust_and_rust_calls_python(pool):
    p, path = pool
    bin = agent()
    rust = f"rust/svc/{os.getpid()}/{next(_N)}"
    srv = subprocess.Popen([bin, path, "serve", rust], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout.readline().strip() == "ready"
        c = dmrpc.Node(p).connect(rust)
        data = bytes(range(256)) * 4096  # 1 MiB, by Ref
        out = bytes(c.call("hop", data))  # answers hash (8) | pid (4) | in_pool (1)
        assert len(out) >= 13
        assert out[12] == 1, "the Rust service got the payload by Ref (in the pool)"
        del c
    finally:
        srv.stdin.close()
        assert srv.wait(timeout=10) == 0
    # And the other way: a Rust client calls a Python service.
    node = dmrpc.Node(p)
    name = f"py/for-rust/{os.getpid()}/{next(_N)}"
    seen = []
    srv = node.serve(name, {"hop": lambda b: (seen.append(len(b)), b"\x01" * 13)[1]})
    r = subprocess.run([bin, path, "call", name, "hop", str(200_000)], capture_output=True, text=True, timeout=20)
    assert "ok" in r.stdout, r.stdout + r.stderr
    assert seen == [200_000]
    srv.shutdown()


def test_a_payload_is_a_read_only_view_of_the_pool_with_no_copy(pool):
    p, _ = pool
    node = dmrpc.Node(p)
    name = f"py/view/{os.getpid()}/{next(_N)}"
    seen = {}

    def look(pl):
        a = np.frombuffer(pl, dtype=np.uint8)
        b = np.frombuffer(pl, dtype=np.uint8)
        seen["by_ref"] = pl.by_ref
        seen["ref"] = pl.ref
        seen["same"] = a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        seen["readonly"] = not a.flags.writeable
        with pytest.raises(TypeError):
            memoryview(pl)[0:1] = b"x"
        with pytest.raises((TypeError, BufferError)):
            import ctypes

            ctypes.c_char.from_buffer(pl)  # asks for a writable view: refused
        # keep(): a writable copy-on-write buffer; one page written, one copied.
        k = pl.keep()
        held = p.check()["pages_held"]
        kv = np.frombuffer(k, dtype=np.uint8)
        kv[5000] ^= 0xFF
        seen["copied"] = p.check()["pages_held"] - held
        seen["orig_kept"] = a[5000] != kv[5000]
        del kv, a, b
        k.free()
        # keep(mapped=False): no mapping; write() copies the pages it touches.
        e = pl.keep(mapped=False)
        e.write(bytes(memoryview(pl)[:1]))  # the first write also gives the buffer its own page list
        held = p.check()["pages_held"]
        e.write(b"\xff" * 3, 3 * 4096 - 1)
        seen["explicit_copied"] = p.check()["pages_held"] - held
        seen["explicit_read"] = e.read(3 * 4096 - 2, 5)
        e.free()
        return int(np.frombuffer(pl, dtype=np.uint8).astype(np.uint64).sum()).to_bytes(8, "little")

    srv = node.serve(name, {"look": look})
    c = node.connect(name)
    data = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    out = c.call("look", data)
    assert int.from_bytes(bytes(out), "little") == int(data.astype(np.uint64).sum())
    assert seen["by_ref"] and seen["ref"] is not None and len(seen["ref"]) == 1 << 20
    assert seen["same"] and seen["readonly"]
    assert seen["copied"] == 1, "only the page written was copied"
    assert seen["orig_kept"], "the payload did not change"
    assert seen["explicit_copied"] == 2, "a write across a page boundary copies two pages"
    assert seen["explicit_read"] == bytes(data[3 * 4096 - 2:3 * 4096 - 1]) + b"\xff" * 3 + bytes(data[3 * 4096 + 2:3 * 4096 + 3])
    # An answer is a payload too: large answers arrive by Ref.
    srv2 = node.serve(name + "/echo", {"echo": lambda pl: pl})
    c2 = node.connect(name + "/echo")
    ans = c2.call("echo", data)
    assert ans.by_ref and len(ans) == len(data)
    assert np.array_equal(np.frombuffer(ans, dtype=np.uint8), data)
    small = c2.call("echo", b"tiny")
    assert not small.by_ref and bytes(small) == b"tiny" and small.tobytes() == b"tiny"
    del ans, small, c, c2
    srv.shutdown()
    srv2.shutdown()


def test_a_pool_buffer_is_sent_by_its_pages_and_stays_the_callers(pool):
    p, _ = pool
    node = dmrpc.Node(p)
    name = f"py/buf/{os.getpid()}/{next(_N)}"
    got = []
    srv = node.serve(name, {"get": lambda pl: got.append((pl.by_ref, bytes(memoryview(pl)[:4])))})
    c = node.connect(name)
    buf = p.alloc(256 << 10)
    a = np.frombuffer(buf, dtype=np.uint8)
    a[:] = 3
    c.call("get", buf)
    a[0] = 9  # after the call the caller writes on: copy-on-write
    assert got == [(True, b"\x03" * 4)]
    assert a[0] == 9 and buf.read(0, 2) == b"\x09\x03"
    del a, c
    buf.free()
    srv.shutdown()


FORWARDER = textwrap.dedent(
    """
    import sys, dmrpc
    p = dmrpc.Pool(sys.argv[1])
    node = dmrpc.Node(p)
    nxt = node.connect(sys.argv[3]) if len(sys.argv) > 3 else None

    def hop(pl):
        mine = pl.ref.to_bytes() if pl.ref is not None else b"-" * 40
        if nxt is None:  # the worker: the Ref it saw, then its sum of the data
            import numpy as np
            total = int(np.frombuffer(pl, dtype=np.uint8).astype(np.uint64).sum())
            return mine + total.to_bytes(8, "little")
        return mine + bytes(nxt.call("hop", pl))  # forwarded untouched

    srv = node.serve(sys.argv[2], {"hop": hop})
    print("ready", flush=True)
    sys.stdin.readline()
    srv.shutdown()
    """
)


def test_a_payload_is_forwarded_by_ref_through_python_processes(pool):
    p, path = pool
    base = f"py/chain/{os.getpid()}/{next(_N)}"
    hops = [f"{base}/{i}" for i in range(3)]
    procs = []
    try:
        for i in reversed(range(3)):
            args = [sys.executable, "-c", FORWARDER, path, hops[i]] + ([hops[i + 1]] if i < 2 else [])
            procs.append(subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            assert procs[-1].stdout.readline().strip() == "ready"
        c = dmrpc.Node(p).connect(hops[0])
        data = np.arange(2 << 20, dtype=np.uint32).astype(np.uint8)
        out = bytes(c.call("hop", data))
        refs = [out[i * 40:(i + 1) * 40] for i in range(3)]
        assert refs[0] != b"-" * 40, "the first hop got a Ref"
        assert refs[0] == refs[1] == refs[2], "every hop saw the same Ref: nobody copied"
        assert int.from_bytes(out[120:128], "little") == int(data.astype(np.uint64).sum())
        # Small payloads go inline through the same chain.
        out = bytes(c.call("hop", b"abc"))
        assert out[:120] == b"-" * 120 and int.from_bytes(out[120:], "little") == 97 + 98 + 99
        del c
    finally:
        for pr in procs:
            pr.stdin.write("\n")
            pr.stdin.flush()
        for pr in procs:
            assert pr.wait(timeout=10) == 0


def test_rust_forwards_a_python_clients_payload_to_a_python_service(pool):
    p, path = pool
    bin = agent()
    node = dmrpc.Node(p)
    base = f"py/mixed/{os.getpid()}/{next(_N)}"
    seen = []
    srv = node.serve(base + "/py", {"hop": lambda pl: (seen.append((pl.by_ref, len(pl))), b"\x00" * 13)[1]})
    rust = subprocess.Popen([bin, path, "serve", base + "/rust", "--next", base + "/py"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert rust.stdout.readline().strip() == "ready"
        c = node.connect(base + "/rust")
        c.call("hop", bytes(1 << 20))
        assert seen == [(True, 1 << 20)], "Python -> Rust -> Python, by Ref"
        del c
    finally:
        rust.stdin.close()
        assert rust.wait(timeout=10) == 0
    srv.shutdown()


@pytest.fixture
def memserver():
    path = os.environ.get("DMRPC_MEMSERVER") or os.path.join(ROOT, "target", "release", "dm-memserver")
    if not os.path.exists(path):
        pytest.skip(f"no dm-memserver at {path} (scripts/python.sh builds it)")
    proc = subprocess.Popen([path, "--size", str(64 << 20)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        assert line[0] == "listening", line
        yield line[1]
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_memory_server_contract_from_python(memserver):
    with dmrpc.MemPool([memserver]) as m:
        b = m.alloc(3 * 4096)
        assert len(b) == 3 * 4096 and b.read(0, 8) == bytes(8)
        b.write(b"\x01" * (3 * 4096))
        r = b.share()
        assert isinstance(r, dmrpc.Ref) and len(r) == 3 * 4096
        other = m.map_ref(r)
        other.write(b"\x09", 4096)  # copy-on-write: only this client's copy changes
        assert b.read(4096, 1) == b"\x01" and other.read(4096, 2) == b"\x09\x01"
        assert m.read_ref(r, 4095, 2) == b"\x01\x01"
        r2 = m.put(memoryview(b"hello"))
        assert m.read_ref(r2) == b"hello"
        with pytest.raises(dmrpc.InvalidArgument):
            b.read(3 * 4096 - 1, 2)
        with pytest.raises(dmrpc.InvalidArgument):
            m.read_ref(r2, 0, 6)
        m.release_ref(r2)
        with pytest.raises(dmrpc.InvalidArgument):
            m.release_ref(r2)  # double release
        with pytest.raises(dmrpc.InvalidArgument):
            m.map_ref(dmrpc.Ref.from_bytes(bytes(r)[:-1] + bytes([bytes(r)[-1] ^ 1])))  # forged
        huge = dmrpc.Ref.from_bytes(bytes(r)[:32] + (1 << 62).to_bytes(8, "little"))
        assert len(huge) == 1 << 62
        with pytest.raises(dmrpc.InvalidArgument):
            m.read_ref(huge)  # a forged length sizes nothing: a typed error, not an abort
        m.release_ref(r)
        other.free()
        b.free()
        with pytest.raises(dmrpc.InvalidArgument):
            b.free()  # double free
        assert m.check() == []
        u = m.usage()
        assert u["pages_held"] == 0 and u["refs"] == 0, u
    with pytest.raises(dmrpc.InvalidArgument):
        m.alloc(10)  # closed
    with pytest.raises(dmrpc.Unavailable):
        dmrpc.MemPool(["127.0.0.1:1"], timeout=1.0)
    with dmrpc.MemPool([memserver], placement="round-robin") as m:
        r = m.put(b"spread")
        assert m.read_ref(r) == b"spread"
        m.release_ref(r)
    with pytest.raises(dmrpc.InvalidArgument):
        dmrpc.MemPool([memserver], placement="nearest")


def _key_file(tmp_path, name, secret):
    path = tmp_path / name
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return str(path)


def test_keys_for_memory_servers_and_tcp_services(tmp_path, pool):
    pool, _ = pool
    path = os.environ.get("DMRPC_MEMSERVER") or os.path.join(ROOT, "target", "release", "dm-memserver")
    if not os.path.exists(path):
        pytest.skip(f"no dm-memserver at {path} (scripts/python.sh builds it)")
    key = _key_file(tmp_path, "memory.key", "a memory key of some length")
    wrong = _key_file(tmp_path, "wrong.key", "not the memory key at all")
    proc = subprocess.Popen([path, "--key-file", key], stdout=subprocess.PIPE, text=True)
    try:
        addr = proc.stdout.readline().split()[1]
        with dmrpc.MemPool([addr]) as m:
            with pytest.raises(dmrpc.Unauthenticated):
                m.alloc(10)
        with pytest.raises(dmrpc.Unauthenticated):
            dmrpc.MemPool([addr], key_file=wrong)
        with dmrpc.MemPool([addr], key_file=key) as m:
            r = m.put(b"with the key")
            assert m.read_ref(r) == b"with the key"
            m.release_ref(r)
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
    # A key file others may read is refused, saying how to fix it.
    loose = tmp_path / "loose.key"
    loose.write_text("a memory key of some length")
    loose.chmod(0o644)
    with pytest.raises(dmrpc.InvalidArgument, match="chmod 600"):
        dmrpc.MemPool([addr], key_file=str(loose))
    # A TCP service with a key serves only nodes with it.
    keyed = dmrpc.Node(pool, key_file=key)
    srv = keyed.serve(f"keyed-{os.getpid()}", {"echo": lambda p: p}, tcp="127.0.0.1:0")
    with pytest.raises(dmrpc.Unauthenticated):
        dmrpc.Node(pool).connect_tcp(srv.tcp_addr)
    c = dmrpc.Node(pool, key_file=key).connect_tcp(srv.tcp_addr)
    assert bytes(c.call("echo", b"hi")) == b"hi"
    del c
    with pytest.raises(dmrpc.InvalidArgument, match="tcp_open"):
        dmrpc.Node(pool).serve(f"open-{os.getpid()}", {"echo": lambda p: p}, tcp="0.0.0.0:0")
    srv.shutdown()


def test_services_in_two_pools_pass_payloads_by_memory_server_ref(memserver, tmp_path):
    pools = []
    for i in range(2):
        path = f"/dev/shm/dmrpc-pytest-ms-{os.getpid()}-{next(_N)}.pool"
        pools.append((dmrpc.Pool(path, size=32 << 20), path))
    try:
        ms = [dmrpc.MemPool([memserver]) for _ in range(2)]
        server_node = dmrpc.Node(pools[0][0], memservers=ms[0])
        client_node = dmrpc.Node(pools[1][0], memservers=ms[1])
        seen = []

        def work(pl):
            seen.append(pl.by_ref)
            if pl.by_ref:  # a memory server's data is kept there
                k = pl.keep()
                assert isinstance(k, dmrpc.MemBuffer) and len(k) == len(pl)
                k.write(b"\x00")
                assert k.read(0, 1) == b"\x00"
                k.free()
            return np.frombuffer(pl, dtype=np.uint8)[::-1].copy()  # answer 1 MiB: by Ref too

        srv = server_node.serve(f"py/ms/{os.getpid()}/{next(_N)}", {"work": work}, tcp="127.0.0.1:0")
        assert srv.tcp_addr.startswith("127.0.0.1:")
        c = client_node.connect_tcp(srv.tcp_addr)
        data = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)
        ans = c.call("work", data)
        assert seen == [True], "the request came by memory-server Ref"
        assert ans.by_ref and np.array_equal(np.frombuffer(ans, dtype=np.uint8), data[::-1])
        assert bytes(c.call("work", b"ab")) == b"ba" and seen[-1] is False
        # A memory-server buffer as an argument: sent by its pages.
        b = ms[1].alloc(200_000)
        b.write(b"\x07" * 200_000)
        assert bytes(c.call("work", b))[:3] == b"\x07" * 3 and seen[-1] is True
        b.free()
        del ans, c
        srv.shutdown()
        for m in ms:
            for _ in range(100):
                if m.usage()["pages_held"] == 0:
                    break
                time.sleep(0.05)
        assert ms[0].usage()["pages_held"] == 0 and ms[0].usage()["refs"] == 0, ms[0].usage()
        assert ms[0].check() == []
    finally:
        for p, path in pools:
            p.close()
            os.unlink(path)


def test_asyncio_calls_are_futures_with_no_thread_each_and_cancel_cleanly(pool):
    import asyncio
    import threading

    import dmrpc.aio

    p, _ = pool
    node = dmrpc.Node(p)
    name = f"py/aio/{os.getpid()}/{next(_N)}"

    def slow(arg):
        time.sleep(0.3)
        return len(arg).to_bytes(8, "little")

    srv = node.serve(name, {"len": lambda arg: len(arg).to_bytes(8, "little"), "slow": slow})
    try:

        async def main():
            threads = threading.active_count()
            async with dmrpc.aio.connect(node, name) as c:
                # Far more calls in flight than any thread pool would run.
                outs = await asyncio.gather(*(c.call("len", bytes(i % 300)) for i in range(500)))
                assert [int.from_bytes(o.tobytes(), "little") for o in outs] == [i % 300 for i in range(500)]
                assert threading.active_count() <= threads + 3, "a thread per call?"
                # Cancelling the awaiting task cancels the call; its
                # argument (by Ref: 200 KB) is released, and the
                # connection goes on.
                t = asyncio.create_task(c.call("slow", bytes(200_000)))
                await asyncio.sleep(0.05)
                assert p.check()["refs"] == 1, "the argument went by Ref"
                t.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await t
                # Released at once, while the service still runs the call.
                for _ in range(20):
                    if p.check()["refs"] == 0:
                        break
                    await asyncio.sleep(0.005)
                assert p.check()["refs"] == 0, "the cancelled call still holds its argument's Ref"
                with pytest.raises(dmrpc.DeadlineExceeded):
                    await c.call("slow", bytes(200_000), timeout=0.05)
                assert int.from_bytes((await c.call("len", bytes(70_000))).tobytes(), "little") == 70_000
            await asyncio.sleep(0.4)

        asyncio.run(main())
    finally:
        srv.shutdown()


def test_asyncio_client_does_not_block_the_loop(pool):
    import asyncio

    import dmrpc.aio

    p, path = pool
    bin = agent()
    name = f"rust/aio/{os.getpid()}/{next(_N)}"
    srv = subprocess.Popen([bin, path, "serve", name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout.readline().strip() == "ready"
        node = dmrpc.Node(p)

        async def main():
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            t = asyncio.create_task(ticker())
            async with dmrpc.aio.connect(node, name) as c:
                # sleep: the Rust service waits the u64 ms in the payload.
                await c.call("sleep", (300).to_bytes(8, "little"))
                assert ticks >= 10, f"the loop ran during the call ({ticks} ticks)"
                outs = await asyncio.gather(*(c.call("hop", bytes([i]) * (100_000 + i)) for i in range(20)))
                assert all(len(o) >= 13 and o.tobytes()[12] == 1 for o in outs), "each went by Ref"
                with pytest.raises(dmrpc.DeadlineExceeded):
                    await c.call("sleep", (2000).to_bytes(8, "little"), timeout=0.05)
                with pytest.raises(dmrpc.NotFound):
                    await c.call("absent")
            t.cancel()

        asyncio.run(main())
    finally:
        srv.stdin.close()
        assert srv.wait(timeout=10) == 0


def _serve_streams(node, name, closed):
    """A service of streaming generators: `count` streams N items of SIZE
    bytes (two u32s), item k filled with k % 251, and sets its answer's
    metadata; `endless` counts (a u64 an item, after a pause of its
    argument's first byte in ms) until closed, then appends to `closed`;
    `fail` sends one item and raises. `plain` is unary: its argument
    reversed."""

    def count(b):
        n, size = np.frombuffer(b, dtype=np.uint32)
        for k in range(n):
            yield np.full(size, k % 251, dtype=np.uint8)  # large ones by Ref
        dmrpc.set_reply_metadata({"items": str(n)})

    def endless(b):
        pause = bytes(b)[0] / 1000 if len(b) else 0
        try:
            k = 0
            while True:
                time.sleep(pause)
                yield k.to_bytes(8, "little")
                k += 1
        finally:
            closed.append(True)

    def fail(b):
        yield b"one"
        raise dmrpc.PermissionDenied("no more")

    streams = {"count": count, "endless": endless, "fail": fail}
    return node.serve(name, {"plain": lambda b: bytes(b)[::-1]}, streams=streams)


def _upper(first, inbox):
    # A two-way handler: the request back, then each item in capitals.
    yield bytes(first)
    for item in inbox:
        yield bytes(item).upper()


def _total(first, inbox):
    # A caller's stream answered once: how many bytes came.
    yield sum(len(bytes(i)) for i in inbox).to_bytes(8, "little")


def test_a_caller_sends_items_and_reads_the_answers_as_they_come(pool):
    p, path = pool
    node = dmrpc.Node(p)
    name = f"py/bidi/{os.getpid()}/{next(_N)}"
    kept = []

    def keep(first, inbox):
        kept.append(inbox)
        # Read by another thread: refused (only the handler's reads).
        errors = []
        t = threading.Thread(target=lambda: errors.append(pytest.raises(dmrpc.InvalidArgument, next, inbox)))
        t.start()
        t.join()
        return [b"ok" if "handler's thread" in str(errors[0].value) else b"not refused"]

    srv = node.serve(name, {}, bidi={"upper": _upper, "total": _total, "keep": keep})
    c = node.connect(name)
    # Each item answered as it comes, a large one (by Ref) too.
    with c.call_bidi("upper", b"hi") as b:
        assert bytes(next(b)) == b"hi"
        for w in [b"a", b"bc", b"d" * 300_000]:
            b.send(w)
            assert bytes(next(b)) == w.upper()
        b.finish()
        assert list(b) == []
    # One thread sends (past the server's window of 16) while another
    # reads the answer.
    b = c.call_bidi("total", timeout=30)

    def send():
        for _ in range(100):
            b.send(np.full(1000, 7, dtype=np.uint8))
        b.finish()

    t = threading.Thread(target=send)
    t.start()
    assert int.from_bytes(bytes(next(b)), "little") == 100_000
    t.join()
    # An inbox read after its handler returned is an error, not a crash.
    assert [bytes(x) for x in c.call_bidi("keep")] == [b"ok"]
    with pytest.raises(dmrpc.InvalidArgument, match="while its handler runs"):
        next(kept[0])
    # Sending after finishing, and a balanced client, are refused.
    b = c.call_bidi("upper", b"x")
    b.finish()
    with pytest.raises(dmrpc.Error):
        b.send(b"late")
    b.close()
    with pytest.raises(dmrpc.InvalidArgument, match="balanced"):
        node.connect(name, balanced=True).call_bidi("upper")
    del c, b, kept
    srv.shutdown()


def test_an_async_caller_sends_items_and_reads_the_answers(pool):
    p, path = pool
    node = dmrpc.Node(p)
    name = f"py/abidi/{os.getpid()}/{next(_N)}"
    srv = node.serve(name, {}, bidi={"upper": _upper, "total": _total})

    async def main():
        c = dmrpc.aio.connect(node, name)
        async with await c.call_bidi("upper", b"hi") as b:
            assert bytes(await b.__anext__()) == b"hi"
            for w in [b"a", b"d" * 300_000]:
                await b.send(w)
                assert bytes(await b.__anext__()) == w.upper()
            await b.finish()
            assert [x async for x in b] == []
        # One task sends (past the server's window) while another reads.
        b = await c.call_bidi("total", timeout=30)

        async def send():
            for _ in range(100):
                await b.send(np.full(1000, 7, dtype=np.uint8))
            await b.finish()

        t = asyncio.create_task(send())
        assert int.from_bytes(bytes(await b.__anext__()), "little") == 100_000
        await t
        b.close()
        with pytest.raises(dmrpc.Error):
            await b.send(b"after close")
        with pytest.raises(dmrpc.InvalidArgument, match="balanced"):
            await dmrpc.aio.connect(node, name, balanced=True).call_bidi("upper")

    asyncio.run(main())
    srv.shutdown()


def test_a_generator_streams_items_to_a_caller(pool):
    p, path = pool
    node = dmrpc.Node(p)
    name = f"py/stream/{os.getpid()}/{next(_N)}"
    closed = []
    srv = _serve_streams(node, name, closed)
    c = node.connect(name)
    for n, size in [(0, 1), (3, 10), (40, 100), (5, 1 << 20)]:
        st = c.call_stream("count", np.array([n, size], dtype=np.uint32), window=4)
        items = [np.frombuffer(i, dtype=np.uint8) for i in st]
        assert len(items) == n
        for k, item in enumerate(items):
            assert item.size == size and item[0] == k % 251 and item[-1] == k % 251
        assert dict(st.metadata) == {"items": str(n).encode()}
    # A stream dropped early is cancelled: the generator is closed.
    with c.call_stream("endless") as st:
        assert [int.from_bytes(bytes(next(st)), "little") for _ in range(3)] == [0, 1, 2]
    for _ in range(200):
        if closed:
            break
        time.sleep(0.01)
    assert closed == [True]
    st = c.call_stream("fail")
    assert bytes(next(st)) == b"one"
    with pytest.raises(dmrpc.PermissionDenied, match="no more"):
        next(st)
    # The deadline bounds the whole stream.
    with pytest.raises(dmrpc.DeadlineExceeded):
        for _ in c.call_stream("endless", timeout=0.2, window=2):
            time.sleep(0.01)
    # A unary method answers a stream with one item; a stream is not a call.
    assert [bytes(i) for i in c.call_stream("plain", b"abc")] == [b"cba"]
    with pytest.raises(dmrpc.InvalidArgument):
        c.call("count", np.array([1, 1], dtype=np.uint32))
    # A balanced client (one sole server counts as one replica) streams too.
    assert len(list(node.connect(name, balanced=True).call_stream("count", np.array([2, 5], dtype=np.uint32)))) == 2
    assert bytes(c.call("plain", b"xy")) == b"yx"
    del c, st
    srv.shutdown()


def test_an_asyncio_caller_reads_streams(pool):
    p, path = pool
    node = dmrpc.Node(p)
    name = f"py/astream/{os.getpid()}/{next(_N)}"
    closed = []
    srv = _serve_streams(node, name, closed)

    async def main():
        c = dmrpc.aio.connect(node, name)
        for n, size in [(0, 1), (3, 10), (40, 100), (5, 1 << 20)]:
            st = await c.call_stream("count", np.array([n, size], dtype=np.uint32), window=4)
            items = [np.frombuffer(i, dtype=np.uint8) async for i in st]
            assert len(items) == n
            for k, item in enumerate(items):
                assert item.size == size and item[0] == k % 251 and item[-1] == k % 251
            assert dict(st.metadata) == {"items": str(n).encode()}
        # Streams and calls at once on one connection.
        async def one(k):
            st = await c.call_stream("count", np.array([k, 64], dtype=np.uint32))
            return [bytes(i)[0] async for i in st]

        got = await asyncio.gather(*(one(k) for k in range(10)), *(c.call("plain", b"ab") for _ in range(10)))
        assert got[:10] == [list(range(k)) for k in range(10)]
        assert all(bytes(g) == b"ba" for g in got[10:])
        # A read that times out loses nothing: items every 50 ms.
        async with await c.call_stream("endless", bytes([50])) as st:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(st.__anext__(), 0.005)
            assert [int.from_bytes(bytes(await st.__anext__()), "little") for _ in range(3)] == [0, 1, 2]
        # Leaving the block cancelled the call: the generator is closed.
        for _ in range(200):
            if closed:
                break
            await asyncio.sleep(0.01)
        assert closed == [True]
        st = await c.call_stream("fail")
        assert bytes(await st.__anext__()) == b"one"
        with pytest.raises(dmrpc.PermissionDenied, match="no more"):
            await st.__anext__()
        with pytest.raises(dmrpc.DeadlineExceeded):
            async for _ in await c.call_stream("endless", b"", timeout=0.2, window=2):
                await asyncio.sleep(0.01)
        assert [bytes(i) async for i in await c.call_stream("plain", b"abc")] == [b"cba"]
        b = dmrpc.aio.connect(node, name, balanced=True)
        assert len([i async for i in await b.call_stream("count", np.array([2, 5], dtype=np.uint32))]) == 2

    asyncio.run(main())
    # (The coroutine's frame, with the last items it read, is freed with the
    # tracebacks of the errors it expected: a cycle.)
    gc.collect()
    srv.shutdown()


def test_a_python_caller_reads_a_rust_stream_in_another_process(pool):
    p, path = pool
    name = f"py/rust-stream/{os.getpid()}/{next(_N)}"
    child = subprocess.Popen([agent(), path, "serve", name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        node = dmrpc.Node(p)
        c = node.connect(name)
        # From the agent's blocking streaming handler and its async one.
        for method in ["items", "items_async"]:
            for n, size in [(10, 100), (4, 1 << 20)]:
                items = list(c.call_stream(method, np.array([n, size, 0], dtype=np.uint32)))
                assert [bytes(i)[0] for i in items] == list(range(n)), method
                assert all(i.by_ref == (size > dmrpc.DEFAULT_INLINE_MAX) for i in items)
        del c, items
    finally:
        child.stdin.close()
        assert child.wait(timeout=10) == 0


def test_a_name_held_by_a_live_process_is_refused_then_taken_when_it_dies(pool):
    p, path = pool
    node = dmrpc.Node(p)
    name = f"py/held/{os.getpid()}/{next(_N)}"
    holder = subprocess.Popen(
        [agent(), path, "serve", name, "--lease", "5000"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        echo = {"echo": lambda b: bytes(b)}
        with pytest.raises(dmrpc.AlreadyExists, match=f"process {holder.pid}") as e:
            node.serve(name, echo)
        assert e.value.status == "AlreadyExists" and "wait_for_name" in str(e.value)
        with pytest.raises(dmrpc.AlreadyExists, match="waited"):
            node.serve(name, echo, wait_for_name=0.1)
        # Killed and not reaped (a zombie until `wait`): the name is free
        # at once, far before the holder's 5 s lease runs out.
        threading.Timer(0.1, holder.kill).start()
        t0 = time.monotonic()
        srv = node.serve(name, echo, wait_for_name=30)
        assert time.monotonic() - t0 < 2.5
        with open(f"/proc/{holder.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
        assert bytes(node.connect(name).call("echo", b"back")) == b"back"
        srv.shutdown()
    finally:
        holder.kill()
        holder.wait()


def test_by_value_goes_inline_or_raises_saying_why(pool):
    p, _ = pool
    node = dmrpc.Node(p, by_value=True)
    name = f"py/by-value/{os.getpid()}/{next(_N)}"
    srv = node.serve(name, {"how": lambda b: bytes([b.by_ref]) + len(b).to_bytes(8, "little")})
    c = node.connect(name)
    # Above the default threshold.
    got = bytes(c.call("how", b"x" * (100 << 10)))
    assert got[0] == 0 and int.from_bytes(got[1:], "little") == 100 << 10
    # 6 MiB by value too, in parts (a default ring's record is 128 KiB).
    got = bytes(c.call("how", np.zeros(6 << 20, np.uint8)))
    assert got[0] == 0 and int.from_bytes(got[1:], "little") == 6 << 20
    with pytest.raises(dmrpc.ResourceExhausted, match="by Ref"):
        c.call("how", np.zeros((64 << 20) + 1, np.uint8))
    # A size-aware node sends the same argument by Ref.
    sized = dmrpc.Node(p)
    got = bytes(sized.connect(name).call("how", np.zeros(6 << 20, np.uint8)))
    assert got[0] == 1 and int.from_bytes(got[1:], "little") == 6 << 20
    srv.shutdown()

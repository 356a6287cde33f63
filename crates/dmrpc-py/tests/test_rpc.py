"""Services and clients from Python: across processes, Python to Rust and
Rust to Python, errors as typed exceptions."""

import itertools
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import dmrpc

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
    path = f"/dev/shm/dmrpc-pytest-rpc-{os.getpid()}-{next(_N)}.pool"
    p = dmrpc.Pool(path, size=64 << 20)
    yield p, path
    try:
        for _ in range(100):
            p.maintain()
            rep = p.check()
            if rep["ok"] and rep["pages_held"] == 0:
                break
            time.sleep(0.05)
        assert rep["ok"], rep["problems"]
        assert rep["pages_held"] == 0, rep
        p.close()
    finally:
        os.unlink(path)


def test_python_service_and_client_in_one_process(pool):
    p, _ = pool
    node = dmrpc.Node(p)
    name = f"py/echo/{os.getpid()}/{next(_N)}"

    def upper(b):
        return b.upper()

    def boom(b):
        raise ValueError("bad value")

    def refuse(b):
        raise dmrpc.InvalidArgument("no thanks")

    srv = node.serve(name, {"upper": upper, "boom": boom, "refuse": refuse, "sum": lambda b: np.frombuffer(b, dtype=np.uint8).sum().tobytes()})
    c = node.connect(name)
    assert c.call("upper", b"hello") == b"HELLO"
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


SERVER = textwrap.dedent(
    """
    import sys, dmrpc
    p = dmrpc.Pool(sys.argv[1])
    node = dmrpc.Node(p)
    srv = node.serve(sys.argv[2], {"rev": lambda b: b[::-1], "len": lambda b: str(len(b)).encode()})
    print("ready", flush=True)
    sys.stdin.readline()
    srv.shutdown()
    """
)


def test_python_client_and_server_in_two_processes(pool):
    p, path = pool
    name = f"py/srv/{os.getpid()}/{next(_N)}"
    child = subprocess.Popen([sys.executable, "-c", SERVER, path, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        c = dmrpc.Node(p).connect(name)
        assert c.call("rev", b"abc") == b"cba"
        assert c.call("len", bytes(3 << 20)) == str(3 << 20).encode()
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
        out = c.call("hop", data)  # answers hash (8) | pid (4) | in_pool (1)
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

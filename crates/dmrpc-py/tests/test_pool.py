"""dmrpc's Python bindings: pools, zero-copy buffers, copy-on-write
between processes, Refs, and typed errors for bad input."""

import os
import pickle
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import dmrpc
from conftest import pool_for


@pytest.fixture
def pool():
    yield from pool_for("pool", 16 << 20)


def test_numpy_sees_the_pool_memory_with_no_copy(pool):
    p, _ = pool
    buf = p.alloc(3 * 4096)
    a = np.frombuffer(buf, dtype=np.uint8)
    assert a.__array_interface__["data"][0] == buf.address, "same address"
    assert not a.any(), "a new buffer reads zero"
    a[10:20] = 7
    assert buf.read(10, 10) == b"\x07" * 10, "a store through numpy is in the pool"
    buf.write(b"abc", 100)
    assert bytes(memoryview(buf)[100:103]) == b"abc"
    del a
    p.free(buf)


def test_cow_between_holders_in_one_process(pool):
    p, _ = pool
    buf = p.alloc(4 * 4096)
    buf.write(b"\x01" * (4 * 4096))
    r = buf.share()
    m = p.map_ref(r)
    view = np.frombuffer(m, dtype=np.uint8)
    view[4096] = 9  # the mapper copies one page
    assert buf.read(4096, 1) == b"\x01"
    buf.write(b"\x05", 0)  # the owner copies its page
    assert m.read(0, 1) == b"\x01"
    assert p.check()["pages_held"] == 4 + 2, "only written pages were copied"
    del view
    p.release_ref(r)
    p.free(m)
    p.free(buf)


CHILD = textwrap.dedent(
    """
    import pickle, sys
    import numpy as np
    import dmrpc
    p = dmrpc.Pool(sys.argv[1])
    r = pickle.loads(bytes.fromhex(sys.argv[2]))
    m = p.map_ref(r)
    a = np.frombuffer(m, dtype=np.uint8)
    print(int(a.sum()), flush=True)
    a[:4096] = 200          # copy-on-write: only this process's copy
    print(int(a.sum()), flush=True)
    sys.stdin.readline()    # the parent writes its buffer meanwhile
    print(int(a.sum()), flush=True)
    del a
    p.free(m)
    p.close()
    """
)


def test_cow_isolation_between_two_python_processes(pool):
    p, path = pool
    n = 8 * 4096
    buf = p.alloc(n)
    src = np.frombuffer(buf, dtype=np.uint8)
    src[:] = np.arange(n, dtype=np.uint64) % 251
    want = int(src.sum())
    r = buf.share()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, path, pickle.dumps(r).hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert int(child.stdout.readline()) == want, "the child reads the snapshot"
    changed = int(child.stdout.readline())
    assert changed == want - int(src[:4096].sum()) + 200 * 4096
    assert int(src.sum()) == want, "the child's write stays in the child"
    src[4096:8192] = 0  # the parent's write stays in the parent
    child.stdin.write("\n")
    child.stdin.flush()
    assert int(child.stdout.readline()) == changed
    assert child.wait() == 0
    del src
    p.release_ref(r)
    p.free(buf)


def test_refs_are_bytes_like_and_pickle(pool):
    p, _ = pool
    buf = p.alloc(5000)
    r = p.create_ref(buf, 1000, 3000)
    assert len(r) == 3000 and len(bytes(r)) == 40
    assert dmrpc.Ref.from_bytes(r.to_bytes()) == r
    v = memoryview(r)  # the buffer protocol gives the 40-byte encoding
    assert v.readonly and v.nbytes == 40 and bytes(v) == r.to_bytes()
    assert dmrpc.Ref.from_bytes(v) == r and b"".join([r]) == r.to_bytes()
    v.release()
    assert pickle.loads(pickle.dumps(r)) == r
    assert hash(pickle.loads(pickle.dumps(r))) == hash(r)
    p.release_ref(r)
    p.free(buf)


def test_bad_input_raises_typed_errors(pool):
    p, _ = pool
    with pytest.raises(OverflowError):
        p.alloc(-1)
    with pytest.raises(dmrpc.InvalidArgument) as e:
        p.alloc(0)
    assert e.value.status == "InvalidArgument"
    assert isinstance(e.value, dmrpc.Error)
    with pytest.raises(dmrpc.InvalidArgument):
        p.alloc(1 << 60)
    with pytest.raises(TypeError):
        p.alloc("ten")
    buf = p.alloc(100)
    with pytest.raises(dmrpc.InvalidArgument):
        buf.write(b"xx", 99)
    with pytest.raises(dmrpc.InvalidArgument):
        buf.read(50, 51)
    r = buf.share()
    forged = bytearray(r.to_bytes())
    forged[16] ^= 1  # the tag
    with pytest.raises(dmrpc.InvalidArgument):
        p.map_ref(dmrpc.Ref.from_bytes(bytes(forged)))
    with pytest.raises(dmrpc.InvalidArgument):
        dmrpc.Ref.from_bytes(b"not a ref")
    p.release_ref(r)
    with pytest.raises(dmrpc.InvalidArgument):
        p.release_ref(r)  # double release
    with pytest.raises(dmrpc.InvalidArgument):
        p.map_ref(r)  # released
    view = memoryview(buf)
    with pytest.raises(BufferError):
        p.free(buf)  # a live view
    view.release()
    p.free(buf)
    with pytest.raises(dmrpc.InvalidArgument):
        p.free(buf)  # double free
    with pytest.raises(dmrpc.InvalidArgument):
        buf.read()


def test_a_closed_pool_raises(tmp_path):
    path = f"/dev/shm/dmrpc-pytest-closed-{os.getpid()}.pool"
    try:
        with dmrpc.Pool(path, size=4 << 20) as p:
            pass
        with pytest.raises(dmrpc.InvalidArgument):
            p.alloc(10)
        with pytest.raises(dmrpc.Error):
            dmrpc.Pool("/dev/shm/dmrpc-pytest-does-not-exist.pool")
    finally:
        os.unlink(path)


def test_a_killed_python_process_leaves_the_pool_clean(pool):
    p, path = pool
    code = textwrap.dedent(
        """
        import sys, dmrpc
        p = dmrpc.Pool(sys.argv[1])
        bufs = [p.alloc(64 << 10) for _ in range(8)]
        for b in bufs:
            b.write(b"x" * (64 << 10))
        refs = [b.share() for b in bufs]
        print("ready", flush=True)
        sys.stdin.readline()
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "ready"
    assert p.check()["pages_held"] >= 8 * 16
    child.kill()
    child.wait()
    # Its lease expires; maintenance reclaims what it held (its Refs stay
    # until released or expired: they may be in flight to others).
    deadline = time.time() + 60
    while time.time() < deadline:
        p.maintain()
        rep = p.check()
        if rep["buffers"] == 0:
            break
        time.sleep(0.2)
    rep = p.check()
    assert rep["ok"], rep["problems"]
    assert rep["buffers"] == 0, rep


def test_into_ref_ends_the_buffer_and_its_ref_reads_the_same(pool):
    p, _ = pool
    for mapped in (False, True):
        b = p.alloc(3 * 4096, mapped=mapped)
        b.write(b"\x05" * (3 * 4096))
        b.write(b"\x09", 4096)
        held = p.check()["pages_held"]
        if mapped:
            v = memoryview(b)
            with pytest.raises(BufferError):
                b.into_ref()
            assert b.read(4096, 1) == b"\x09", "a refused into_ref leaves the buffer"
            v.release()
        r = b.into_ref()
        # The pages now belong to the Ref: none copied, none freed.
        assert p.check()["pages_held"] == held
        with pytest.raises(dmrpc.InvalidArgument):
            b.read()
        with pytest.raises(dmrpc.InvalidArgument):
            b.into_ref()
        m = p.map_ref(r, mapped=False)
        want = bytearray(b"\x05" * (3 * 4096))
        want[4096] = 9
        assert m.read() == bytes(want)
        m.free()
        p.release_ref(r)
    assert p.check()["pages_held"] == 0


def test_explicit_buffers_copy_on_write_without_mapping(pool):
    p, _ = pool
    b = p.alloc(4 * 4096, mapped=False)
    assert not b.mapped
    b.write(b"\x02" * (4 * 4096))
    r = b.share()
    m = p.map_ref(r, mapped=False)
    held = p.check()["pages_held"]
    m.write(b"\x07" * 10, 4096 + 5)  # one shared page: copied in software
    assert p.check()["pages_held"] == held + 1, "only the page written was copied"
    assert b.read(4096 + 5, 1) == b"\x02" and m.read(4096 + 5, 1) == b"\x07"
    # A read-only view when the pages are consecutive; no writes while it lives.
    try:
        v = memoryview(m)
    except BufferError:
        v = None  # pages not consecutive: no single view, read() instead
    if v is not None:
        assert v.readonly and bytes(v[4096 + 5:4096 + 6]) == b"\x07"
        with pytest.raises(BufferError):
            m.write(b"x")
        with pytest.raises(TypeError):
            v[0:1] = b"x"
        v.release()
    m.write(b"x")
    m.write(bytearray(b"ab"), 1)  # any bytes-like object
    m.write(np.array([0x0403, 0x0605], dtype="<u2"), 3)
    m.write(np.arange(8, dtype=np.uint8)[::2], 7)  # strided: copied to contiguous first
    assert m.read(0, 11) == b"xab\x03\x04\x05\x06\x00\x02\x04\x06"
    with pytest.raises(TypeError):
        m.write(12)
    with pytest.raises(dmrpc.InvalidArgument):
        m.write(b"xy", 4 * 4096 - 1)
    with pytest.raises(dmrpc.InvalidArgument):
        m.read(4 * 4096, 1)
    p.release_ref(r)
    m.free()
    b.free()
    with pytest.raises(dmrpc.InvalidArgument):
        b.free()

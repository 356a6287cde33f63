"""Documents in a shared heap: written from Python objects in one
process, read in another as Python objects whose bytes are views of the
heap (no copy), validated unless the reader trusts the writer."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import dmrpc
from conftest import pool_for


@pytest.fixture
def pool():
    yield from pool_for("heap", 64 << 20, all_free=True)


DOC = {
    "title": "a document",
    "n": -3,
    "x": 0.5,
    "ok": True,
    "none": None,
    "tags": ["a", "b", ("c", 1)],
    "blob": bytes(range(256)) * 64,
    "nested": {"deep": [{"k": b"v"}]},
}

READER = textwrap.dedent(
    """
    import json, sys
    import dmrpc
    pool = dmrpc.Pool(sys.argv[1])
    heaps = dmrpc.Heaps(pool)
    out = []
    for arg, check in zip(sys.argv[2::2], sys.argv[3::2]):
        try:
            d = heaps.document(bytes.fromhex(arg), check=check)
        except dmrpc.Error as e:
            out.append({"error": type(e).__name__})
            continue
        blob = d["blob"]
        mv = memoryview(blob)
        out.append({
            "keys": sorted(d),
            "n": d["n"], "x": d["x"], "ok": d["ok"], "none": d["none"],
            "tags": [t if isinstance(t, str) else list(t) for t in d["tags"]],
            "blob_len": len(blob), "blob_type": type(blob).__name__,
            "readonly": mv.readonly, "blob_sum": sum(mv),
            "deep": bytes(d["nested"]["deep"][0]["k"]).decode(),
        })
    print(json.dumps(out))
    """
)


def read_in_child(path, *args):
    out = subprocess.run(
        [sys.executable, "-c", READER, path, *args],
        capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout)


def test_a_document_is_read_in_another_process_with_its_bytes_in_place(pool):
    p, path = pool
    heap = dmrpc.Heap(p, 8 << 20)
    sealed = heap.archive(DOC)
    plain = heap.archive(DOC, sealed=False)
    got = read_in_child(
        path,
        sealed.arg.hex(), "sealed",
        plain.arg.hex(), "copy",
        plain.arg.hex(), "trusted",
        plain.arg.hex(), "sealed",
    )
    want_sum = sum(DOC["blob"])
    for r in got[:3]:
        assert r["keys"] == sorted(DOC)
        assert (r["n"], r["x"], r["ok"], r["none"]) == (-3, 0.5, True, None)
        assert r["tags"] == ["a", "b", ["c", 1]]
        assert r["blob_len"] == len(DOC["blob"]) and r["blob_sum"] == want_sum
        assert r["blob_type"] == "HeapBytes" and r["readonly"]
        assert r["deep"] == "v"
    # Not sealed: not read in place as if it were.
    assert got[3] == {"error": "InvalidArgument"}
    sealed.release()
    # Released: its seal proves nothing any more.
    assert read_in_child(path, sealed.arg.hex(), "sealed") == [{"error": "InvalidArgument"}]
    del sealed, plain, heap


def test_bad_documents_and_arguments_raise_typed_errors(pool):
    p, _ = pool
    heap = dmrpc.Heap(p, 1 << 20)
    with pytest.raises(TypeError):
        heap.archive({"k": object()})
    with pytest.raises(TypeError):
        heap.archive({1: "a key that is no text"})
    nested = []
    for _ in range(200):
        nested = [nested]
    with pytest.raises(TypeError):
        heap.archive(nested)
    heaps = dmrpc.Heaps(p)
    for bad in [b"", b"x" * 96, bytes(96)]:
        with pytest.raises(dmrpc.InvalidArgument):
            heaps.document(bad)
    with pytest.raises(TypeError):
        heaps.document(bytes(96), check="maybe")
    del heap

"""The examples run and check their own results (pool clean at the end)."""

import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def run(script, *args):
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_image_pipeline():
    out = run("image_pipeline.py", "--images", "40")
    assert "the forwarder saw 40 by Ref, 0 inline" in out
    assert "the forwarder saw 0 by Ref, 40 inline" in out
    assert "nothing left behind" in out


def test_rust_interop():
    if not os.path.exists(os.path.join(ROOT, "target", "release", "examples", "py_interop")) and not os.environ.get("DMRPC_INTEROP"):
        pytest.skip("py_interop is not built (scripts/python.sh setup builds it)")
    out = run("rust_interop.py")
    assert "Rust says: mean" in out and "the answer came by Ref" in out and "nothing left behind" in out

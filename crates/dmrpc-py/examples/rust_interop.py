"""Python and Rust services calling each other through one pool.

1. A Rust service (`crates/dm-rpc/examples/py_interop.rs`) computes the
   mean, min and max of a float32 NumPy array sent from Python: 4 MiB, so
   it travels by Ref and Rust reads it in place.
2. A Python service doubles a float32 array; the Rust program calls it
   with a million floats and checks the answer.

    python examples/rust_interop.py

The Rust program is built by `scripts/python.sh setup` (or `cargo build
--release -p dm-rpc --example py_interop`); `DMRPC_INTEROP` may name it.
"""

import os
import subprocess
import sys

import numpy as np

import dmrpc

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
RUST = os.environ.get("DMRPC_INTEROP") or os.path.join(ROOT, "target", "release", "examples", "py_interop")


def main():
    if not os.path.exists(RUST):
        sys.exit(f"no {RUST}: build it with cargo build --release -p dm-rpc --example py_interop")
    path = f"/dev/shm/dmrpc-example-interop-{os.getpid()}.pool"
    pool = dmrpc.Pool(path, size=64 << 20)
    node = dmrpc.Node(pool)
    try:
        # 1. Python calls Rust.
        name = f"example/interop/rust/{os.getpid()}"
        rust = subprocess.Popen([RUST, path, "serve", name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert rust.stdout.readline().strip() == "ready"
            x = np.random.default_rng(3).standard_normal(1 << 20).astype(np.float32)
            mean, lo, hi = np.frombuffer(node.connect(name).call("stats", x), dtype="<f4")
            assert np.isclose(mean, x.mean(), atol=1e-4) and lo == x.min() and hi == x.max()
            print(f"Rust says: mean {mean:.5f}, min {lo:.3f}, max {hi:.3f} of {x.size} floats ({x.nbytes >> 20} MiB by Ref)")
        finally:
            rust.stdin.close()
            rust.wait(timeout=10)

        # 2. Rust calls Python.
        name = f"example/interop/python/{os.getpid()}"
        srv = node.serve(name, {"scale": lambda pl: np.frombuffer(pl, dtype="<f4") * 2})
        out = subprocess.run([RUST, path, "call", name, str(1 << 20)], capture_output=True, text=True, timeout=30)
        srv.shutdown()
        if out.returncode != 0:
            sys.exit(f"the Rust client failed: {out.stderr}")
        print("Rust client:", out.stdout.strip())
        rep = pool.check()
        assert rep["ok"] and rep["pages_held"] == 0, rep
        print("pool check: ok, nothing left behind")
    finally:
        pool.close()
        os.unlink(path)


if __name__ == "__main__":
    main()

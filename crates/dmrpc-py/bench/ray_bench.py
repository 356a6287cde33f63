"""dmrpc against Ray from Python: the setting of DmRPC's Figure 8, and the
per-call overhead of the Python binding. Run by `dmrpc bench ray`, which
starts the Rust service and the memory server this needs and reads the
`row ...` lines this prints (progress goes to stderr).

Figure 8: each call, the caller creates a 32 KiB NumPy array and passes it
by reference to a callee in another process, which writes 0-100% of it
and answers one byte. One call at a time (a closed loop), every call
timed.

- dmrpc pool: the array is copied once into the pool and travels by Ref
  (the caller's node sends anything over 4 KiB by Ref); the callee keeps
  the payload as an explicit buffer and writes through it: copy-on-write
  copies only the pages written, with no page-table work.
- dmrpc pool, inline: the same with the default threshold (64 KiB), so
  the 32 KiB travel inside the frame (by value).
- dmrpc memory server: caller and callee in different pools, over TCP; the
  array goes to the memory server with one `put` and its Ref travels; the
  callee keeps it there (a mapping on the server) and writes through it.
- Ray: `ray.put(array)` then an actor method with the ObjectRef; Ray's
  objects are immutable, so the actor copies the array to write to it.

Usage: ray_bench.py --pool PATH --rust-service NAME [--memserver ADDR]
       [--quick] [--verbose]   (and, internally, `callee-pool` / `callee-mem`)
"""

import argparse
import os
import subprocess
import sys
import time

import numpy as np

import dmrpc

SIZE = 32 << 10
FRACTIONS = (0, 25, 50, 75, 100)


VERBOSE = "--verbose" in sys.argv


def log(*a):
    """Progress on stderr, with --verbose (`dmrpc bench ray` draws a bar)."""
    if VERBOSE:
        print(*a, file=sys.stderr, flush=True)


def writer(frac):
    """The callee of Figure 8: writes `frac`% of what it got, in place of
    its own copy-on-write copy of it."""
    n = SIZE * frac // 100
    patch = b"\x01" * n

    def handler(pl):
        if n == 0:
            return bytes(memoryview(pl)[:1])  # reads it
        k = pl.keep(mapped=False)  # Buffer (pool) or MemBuffer (memory server)
        k.write(patch[: len(pl)])
        k.free()
        return b"\x01"

    return handler


def handlers():
    h = {f"w{f}": writer(f) for f in FRACTIONS}
    h["noop"] = lambda pl: None
    h["sum"] = lambda pl: int(np.frombuffer(pl, dtype=np.uint8).sum()).to_bytes(8, "little")
    return h


def callee_pool(path, name):
    node = dmrpc.Node(dmrpc.Pool(path))
    srv = node.serve(name, handlers())
    print("ready", flush=True)
    sys.stdin.readline()
    srv.shutdown()


def callee_mem(name, addr):
    path = f"/dev/shm/dmrpc-bench-ray-callee-{os.getpid()}.pool"
    pool = dmrpc.Pool(path, size=256 << 20)
    try:
        node = dmrpc.Node(pool, memservers=dmrpc.MemPool([addr]))
        srv = node.serve(name, handlers(), tcp="127.0.0.1:0")
        print("ready", srv.tcp_addr, flush=True)
        sys.stdin.readline()
        srv.shutdown()
    finally:
        os.unlink(path)


def measure(call, budget, warm=50, max_calls=None):
    """Times `call` in a closed loop for about `budget` seconds."""
    for _ in range(warm):
        call(0)
    lat = []
    start = time.perf_counter()
    i = 0
    while True:
        t = time.perf_counter()
        call(i)
        lat.append(time.perf_counter() - t)
        i += 1
        if time.perf_counter() - start >= budget or (max_calls and i >= max_calls):
            break
    wall = time.perf_counter() - start
    lat.sort()
    n = len(lat)
    return {
        "calls": n,
        "calls_s": n / wall,
        "avg_us": sum(lat) / n * 1e6,
        "p50_us": lat[n // 2] * 1e6,
        "p99_us": lat[min(n - 1, n * 99 // 100)] * 1e6,
    }


def row(kind, **kv):
    print(kind + " " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in kv.items()), flush=True)


def spawn(args):
    p = subprocess.Popen([sys.executable, __file__] + args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().split()
    if not line or line[0] != "ready":
        raise RuntimeError(f"callee {args[0]} did not start")
    return p, line[1:]


def stop(p):
    p.stdin.write("\n")
    p.stdin.flush()
    p.wait(timeout=20)


def array(i):
    return np.full(SIZE, i & 0xFF, dtype=np.uint8)


def fig8_dmrpc(system, client, budget):
    for f in FRACTIONS:
        m = f"w{f}"
        r = measure(lambda i: client.call(m, array(i)), budget)
        row("fig8", system=system, fraction=f, **r)
        log(f"  {system:<18} {f:>3}%  {r['calls_s']:>9.0f} calls/s  p50 {r['p50_us']:.1f} us")


def fig8_ray(budget, quick):
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:

        @ray.remote
        class Callee:
            def w(self, a, frac):
                n = len(a) * frac // 100
                if n == 0:
                    return int(a[0])
                a = a.copy()  # Ray's objects are immutable
                a[:n] = 1
                return 1

        c = Callee.remote()
        for f in FRACTIONS:
            r = measure(lambda i: ray.get(c.w.remote(ray.put(array(i)), f)), budget, warm=20 if quick else 100)
            row("fig8", system="ray", fraction=f, **r)
            log(f"  {'ray':<18} {f:>3}%  {r['calls_s']:>9.0f} calls/s  p50 {r['p50_us']:.1f} us")
    finally:
        ray.shutdown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pool", required=True)
    ap.add_argument("--rust-service", required=True)
    ap.add_argument("--memserver")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    budget = 0.4 if a.quick else 3.0
    pool = dmrpc.Pool(a.pool)
    by_ref = dmrpc.Node(pool, inline_max=4 << 10)
    default = dmrpc.Node(pool)
    name = f"bench/ray/py/{os.getpid()}"
    callee, _ = spawn(["callee-pool", a.pool, name])
    procs = [callee]
    try:
        # The binding's overhead: the same calls to a Rust service (the Rust
        # client's figures come from `dmrpc bench ray` itself) and to a
        # Python one.
        log("python client:")
        for svc, target in (("rust", a.rust_service), ("python", name)):
            c = by_ref.connect(target)
            for method, data in (("noop", None), ("sum", np.ones(SIZE, dtype=np.uint8))):
                r = measure(lambda i: c.call(method, data), budget, warm=500)
                row("overhead", client="python", service=svc, method=method, **r)
                log(f"  -> {svc:<6} {method:<4} p50 {r['p50_us']:.2f} us")
            del c
        log("figure 8 (32 KiB, callee writes 0-100%):")
        fig8_dmrpc("dmrpc-pool", by_ref.connect(name), budget)
        fig8_dmrpc("dmrpc-pool-inline", default.connect(name), budget)
        if a.memserver:
            mp = dmrpc.MemPool([a.memserver])
            mem_node = dmrpc.Node(pool, memservers=mp, inline_max=4 << 10)
            mc, (addr,) = spawn(["callee-mem", name + "/mem", a.memserver])
            procs.append(mc)
            fig8_dmrpc("dmrpc-memserver", mem_node.connect_tcp(addr), budget)
        fig8_ray(budget * (1 if a.quick else 2), a.quick)
    finally:
        for p in procs:
            stop(p)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "callee-pool":
        callee_pool(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "callee-mem":
        callee_mem(sys.argv[2], sys.argv[3])
    else:
        main()

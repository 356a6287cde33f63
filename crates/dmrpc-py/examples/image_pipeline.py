"""An image pipeline in three Python processes: client -> forwarder -> worker.

The client sends RGB images (NumPy arrays) to the forwarder, which passes
each one on to the worker untouched; the worker converts it to grey levels
and a histogram with NumPy, reading the image straight from the pool (no
copy), and answers. Images above dmrpc's threshold (64 KiB) travel by Ref:
the forwarder moves 40 bytes, not the image. Then the same with every
payload inline (by value), for comparison. The default 75 KiB images sit
near the crossover, where both cost about the same (see `dmrpc bench
threshold`); images larger than half a ring (128 KiB by default) travel by
Ref whatever the setting.

    python examples/image_pipeline.py [--images N] [--size PIXELS]

Each process attaches to the same pool file under /dev/shm; the client
creates it, and removes it at the end after checking it is clean.
"""

import argparse
import os
import subprocess
import sys
import time

import numpy as np

import dmrpc

HEADER = 8  # height, width (u32 each), then height*width*3 bytes of RGB


def encode(img):
    h, w, _ = img.shape
    return np.concatenate([np.array([h, w], dtype="<u4").view(np.uint8), img.reshape(-1)])


def worker(path, name):
    """Grey levels (ITU-R 601 weights) and a 16-bin histogram of them."""

    def grey(pl):
        h, w = np.frombuffer(pl, dtype="<u4", count=2)
        rgb = np.frombuffer(pl, dtype=np.uint8, offset=HEADER).reshape(h, w, 3)  # a view of the pool
        g = (rgb @ np.array([0.299, 0.587, 0.114])).astype(np.uint8)
        hist = np.bincount(g.reshape(-1) >> 4, minlength=16).astype("<u4")
        return np.concatenate([hist.view(np.uint8), g.reshape(-1)])

    serve(path, name, {"grey": grey})


def forwarder(path, name, worker_name, inline):
    node = dmrpc.Node(dmrpc.Pool(path), inline_max=(1 << 30) if inline else None)
    to_worker = node.connect(worker_name)
    stats = {"by_ref": 0, "inline": 0}

    def grey(pl):
        stats["by_ref" if pl.by_ref else "inline"] += 1
        return to_worker.call("grey", pl)  # forwarded untouched: a Ref travels on

    serve(path, name, {"grey": grey, "stats": lambda _: f"{stats['by_ref']} {stats['inline']}".encode()}, node)


def serve(path, name, handlers, node=None):
    node = node or dmrpc.Node(dmrpc.Pool(path))
    srv = node.serve(name, handlers)
    print("ready", flush=True)
    sys.stdin.readline()  # until the client closes our stdin
    srv.shutdown()


def spawn(*args):
    p = subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready", f"{args[0]} did not start"
    return p


def run(path, images, inline):
    tag = f"{os.getpid()}/{'inline' if inline else 'ref'}"
    procs = [spawn("worker", path, f"example/images/worker/{tag}")]
    procs.append(spawn("forwarder", path, f"example/images/forwarder/{tag}", f"example/images/worker/{tag}", "inline" if inline else "ref"))
    try:
        node = dmrpc.Node(dmrpc.Pool(path), inline_max=(1 << 30) if inline else None)
        c = node.connect(f"example/images/forwarder/{tag}")
        start = time.perf_counter()
        for img in images:
            out = c.call("grey", encode(img))
            hist = np.frombuffer(out, dtype="<u4", count=16)
            assert hist.sum() == img.shape[0] * img.shape[1], "every pixel counted once"
        took = time.perf_counter() - start
        by_ref, by_value = bytes(c.call("stats")).decode().split()
        mib = sum(i.nbytes for i in images) / (1 << 20)
        how = "inline (by value)" if inline else "by Ref"
        print(f"{how:>18}: {len(images)} images, {mib:.0f} MiB in {took * 1e3:.0f} ms ({len(images) / took:.0f} images/s); the forwarder saw {by_ref} by Ref, {by_value} inline")
        del c
    finally:
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
        for p in procs:
            p.wait(timeout=20)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--size", type=int, default=160, help="pixels per side (75 KiB images: by Ref, yet small enough for the rings inline)")
    a = ap.parse_args()
    rng = np.random.default_rng(7)
    images = [rng.integers(0, 256, (a.size, a.size, 3), dtype=np.uint8) for _ in range(8)]
    images = [images[i % len(images)] for i in range(a.images)]
    path = f"/dev/shm/dmrpc-example-images-{os.getpid()}.pool"
    pool = dmrpc.Pool(path, size=256 << 20)
    try:
        run(path, images, inline=False)
        run(path, images, inline=True)
        for _ in range(100):  # the callers' Refs are released once each call completes
            rep = pool.check()
            if rep["pages_held"] == 0:
                break
            time.sleep(0.02)
        assert rep["ok"] and rep["pages_held"] == 0, rep
        print("pool check: ok, nothing left behind")
    finally:
        pool.close()
        os.unlink(path)


if __name__ == "__main__":
    role = sys.argv[1] if len(sys.argv) > 1 else None
    if role == "worker":
        worker(sys.argv[2], sys.argv[3])
    elif role == "forwarder":
        forwarder(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "inline")
    else:
        main()

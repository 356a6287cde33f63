"""What every test file shares: a pool of its own for each test."""

import itertools
import os
import time

import dmrpc

_N = itertools.count()


def pool_for(kind, size, all_free=False):
    """A pool under /dev/shm for one test (a fixture's body): it yields the
    pool and its path, then checks it (and, with `all_free`, that every
    page is free once the dead are reclaimed), closes and removes it."""
    path = f"/dev/shm/dmrpc-pytest-{kind}-{os.getpid()}-{next(_N)}.pool"
    p = dmrpc.Pool(path, size=size)
    try:
        yield p, path
        rep = p.check()
        for _ in range(100 if all_free else 0):
            p.maintain()
            rep = p.check()
            if rep["ok"] and rep["pages_held"] == 0:
                break
            time.sleep(0.05)
        assert rep["ok"], rep["problems"]
        if all_free:
            assert rep["pages_held"] == 0, rep
        p.close()
    finally:
        os.unlink(path)

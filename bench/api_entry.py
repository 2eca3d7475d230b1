"""What the Python layer around the fast lane costs: an 8 B ping-pong (one
way = send + recv, each waited) through shmdist.send/recv (C entry points,
_entry.pxi), through a Python wrapper as shmdist had before them, and calling
the Lane directly; 2 ranks, interleaved in the same processes, 9 rounds of
the fastest of 10 batches, medians (us one way). Timings only.

    python bench/api_entry.py
"""
import os, sys, time, statistics
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from ranks import run_ranks

def target(rank, ws, init_method, iters):
    import numpy as np
    import shmdist as dist
    from shmdist.api.fast import paths as _fast
    dist.init_process_group("shm", init_method, rank=rank, world_size=ws, timeout=60)
    a = np.zeros(2, np.float32)
    peer = 1 - rank
    lane = _fast.lane
    def api():
        if rank == 0:
            dist.send(a, 1).wait(); dist.recv(a, 1).wait()
        else:
            dist.recv(a, 0).wait(); dist.send(a, 0).wait()
    def raw():
        if rank == 0:
            lane.send(a, 1, 0).wait(); lane.recv(a, 1, 0).wait()
        else:
            lane.recv(a, 0, 0).wait(); lane.send(a, 0, 0).wait()
    np_ = np.ndarray
    def old_send(tensor, dst, group=None, tag=0):      # the Python wrapper before the C entry points
        lane = _fast.lane
        if lane is not None and group is None:
            arr = tensor if tensor.__class__ is np_ else _fast.array(tensor)
            if arr is not None:
                req = lane.send(arr, dst, tag)
                if req is not None:
                    return req
        raise RuntimeError("general path")
    def old_recv(tensor, src=None, group=None, tag=0):
        lane = _fast.lane
        if lane is not None and group is None and src is not None:
            arr = tensor if tensor.__class__ is np_ else _fast.array(tensor)
            if arr is not None:
                req = lane.recv(arr, src, tag)
                if req is not None:
                    if arr is not tensor:
                        req.tensors = [tensor]
                    return req
        raise RuntimeError("general path")
    def old():
        if rank == 0:
            old_send(a, 1).wait(); old_recv(a, 1).wait()
        else:
            old_recv(a, 0).wait(); old_send(a, 0).wait()
    def nowait():
        if rank == 0:
            lane.send(a, 1, 0); lane.recv(a, 1, 0).wait()
        else:
            lane.recv(a, 0, 0).wait(); lane.send(a, 0, 0)
    out = {}
    for rnd in range(9):
        for name, fn in (("api", api), ("old-python-api", old), ("lane", raw)):
            dist.barrier()
            best = 1e9
            for b in range(10):
                t = time.perf_counter()
                for i in range(iters):
                    fn()
                best = min(best, (time.perf_counter() - t) / iters / 2)
            out.setdefault(name, []).append(best)
    dist.barrier()
    dist.destroy_process_group()
    return {k: statistics.median(v) * 1e6 for k, v in out.items()}

if __name__ == "__main__":
    print(run_ranks(target, 2, 2000, timeout=120)[0])

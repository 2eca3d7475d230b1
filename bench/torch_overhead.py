"""CPU time of one call through torch.distributed on a 1-rank world: backend
"shm" against the backend "null" (whose calls do nothing; bench/test_bench_torch.py),
so the difference is what shmdist costs and "null" is torch's own cost. CPU
time (time.process_time) of this process, best of 9 batches: on a shared,
loaded machine wall-clock medians of µs calls measure the scheduler.

    python bench/torch_overhead.py
"""
import os
import sys
import time
import timeit

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_bench_torch import _register_null  # noqa: E402

N = 20000


def cpu_ns(fn) -> float:
    return min(timeit.repeat(fn, number=N, repeat=9, timer=time.process_time)) / N * 1e9


def through_torch(backend: str, port: int) -> dict:
    import shmdist.torch  # noqa: F401
    _register_null()
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    buf = torch.zeros(1024)
    rows = {"all_reduce 4 KiB": cpu_ns(lambda: dist.all_reduce(buf)), "barrier": cpu_ns(dist.barrier)}
    dist.destroy_process_group()
    return rows


def own_api(port: int) -> dict:
    import shmdist
    shmdist.init_process_group("shm", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    a, t = np.zeros(2, np.float32), torch.zeros(2)
    rows = {"shmdist.all_reduce 8 B, numpy array": cpu_ns(lambda: shmdist.all_reduce(a)),
            "shmdist.all_reduce 8 B, torch tensor": cpu_ns(lambda: shmdist.all_reduce(t))}
    shmdist.destroy_process_group()
    return rows


def _port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else None
    if which is None:              # each measurement in a fresh process
        import subprocess
        for arg in ("shm", "null", "own"):
            subprocess.run([sys.executable, __file__, arg], check=True)
    elif which == "own":
        for row, ns in own_api(_port()).items():
            print(f"{row}: {ns / 1000:.2f} µs CPU")
    else:
        for row, ns in through_torch(which, _port()).items():
            print(f"{which}: dist.{row}: {ns / 1000:.2f} µs CPU")

"""Two members' all_reduce and broadcast, single copies against the arena and the way timed, in and out of slow windows.

    python bench/pair_windows.py [alternations] [size]      # default 16, 1M

Each alternation runs one second of bench/crosscore.c (built with gcc into a
temporary folder), then the same two-rank loop three times, in an order that
rotates: single copies always (SHMDIST_PAIR_CHOOSE=0), the arena always
(SHMDIST_SINGLE_COPY=0), and the default, where the first member times both
and the pair takes the faster (comm/paths.py): 20 calls, then 200
all_reduce (float32) and 200 broadcast calls of ``size`` bytes each, their
median and mean. A line per alternation: crosscore's cache-line round trip,
then each way's figures. On a VM whose CPUs now and then pass data 4-10
times slower (round trips of about 500 ns instead of 45-180), the arena
slowed 4-5 times in those windows and the single copies did not (README,
Benchmarks, "When a single copy is slow").
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spawned import spawned  # noqa: E402
from broadcast_cpu import _bytes  # noqa: E402


def _rank(rank, world_size, init_method, size, out):
    import shmdist as dist
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    x, b = np.ones(size // 4, np.float32), np.ones(size, np.uint8)
    for _ in range(20):
        dist.all_reduce(x)
    reduce_s, bcast_s = [], []
    for _ in range(200):
        t = time.perf_counter()
        dist.all_reduce(x)
        reduce_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        dist.broadcast(b, 0)
        bcast_s.append(time.perf_counter() - t)
    if rank == 0:
        out.put((np.median(reduce_s), np.mean(reduce_s), np.median(bcast_s), np.mean(bcast_s)))
    dist.destroy_process_group()


WAYS = {"single copies": {"SHMDIST_PAIR_CHOOSE": "0"}, "arena": {"SHMDIST_SINGLE_COPY": "0"}, "timed": {}}
KNOBS = ("SHMDIST_PAIR_CHOOSE", "SHMDIST_SINGLE_COPY")


def _pair(size: int, way: str) -> tuple:
    """Medians and means (s) of one two-rank run; the ranks inherit the knobs."""
    saved = {k: os.environ.pop(k, None) for k in KNOBS}
    os.environ.update(WAYS[way])
    try:
        with spawned(_rank, 2, size) as out:
            return out.get(timeout=60)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def main() -> None:
    alternations = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    size = _bytes(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
    with tempfile.TemporaryDirectory() as tmp:
        probe = os.path.join(tmp, "crosscore")
        here = os.path.dirname(os.path.abspath(__file__))
        subprocess.run(["gcc", "-O2", "-pthread", os.path.join(here, "crosscore.c"), "-o", probe], check=True)
        for i in range(alternations):
            line = subprocess.run([probe, "1"], capture_output=True, text=True, check=True).stdout
            trip = re.search(r"round trip (\d+) ns", line).group(1)
            names = list(WAYS)[i % 3:] + list(WAYS)[:i % 3]
            got = {name: _pair(size, name) for name in names}
            us = lambda name, j: f"{got[name][j] * 1e6:.0f}/{got[name][j + 1] * 1e6:.0f}"
            print(f"{i + 1}: round trip {trip} ns; all_reduce (median/mean us) "
                  + ", ".join(f"{name} {us(name, 0)}" for name in WAYS) + "; broadcast "
                  + ", ".join(f"{name} {us(name, 2)}" for name in WAYS), flush=True)


if __name__ == "__main__":
    main()

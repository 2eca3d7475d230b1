"""The default group's big all_reduce and broadcast with and without the
medium path (shmdist/api/collectives.py, _medium_buf), in the same processes.

    python bench/medium_path.py [size] [ranks]      # default 1M 2

For a numpy float32 array, a torch float32 and a torch bfloat16 tensor of
``size`` bytes: 50 calls, then 10 alternations of 200 calls with the medium
path switched off (the general path's checks, as before it) and on; per
alternation the ratio on / off. Prints each figure's medians (us per call)
and the ratio's median and range. Needs torch.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spawned import spawned  # noqa: E402
from broadcast_cpu import _bytes  # noqa: E402


def rank_main(rank, world_size, init_method, nbytes, out):
    import numpy as np
    import torch
    import shmdist
    from shmdist.api import collectives
    real, off = collectives._medium_buf, (lambda *a: None)
    shmdist.init_process_group(init_method=init_method, rank=rank, world_size=world_size)
    res = {}
    for name, t in (("numpy float32", np.zeros(nbytes // 4, np.float32)), ("torch float32", torch.zeros(nbytes // 4)),
                    ("torch bfloat16", torch.zeros(nbytes // 2, dtype=torch.bfloat16))):
        for kind in ("all_reduce", "broadcast"):
            call = (lambda: shmdist.all_reduce(t)) if kind == "all_reduce" else (lambda: shmdist.broadcast(t, 0))
            for _ in range(50):
                call()
            times = ([], [])
            for _ in range(10):
                for way in (0, 1):
                    collectives._medium_buf = off if way == 0 else real
                    shmdist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(200):
                        call()
                    times[way].append((time.perf_counter() - t0) / 200 * 1e6)
            res[f"{kind} {name}"] = times
    collectives._medium_buf = real
    shmdist.barrier()
    out.put((rank, res))
    shmdist.destroy_process_group()


def main() -> None:
    nbytes = _bytes(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    ranks = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    with spawned(rank_main, ranks, nbytes) as out:
        got = dict(out.get(timeout=600) for _ in range(ranks))
    print(f"{nbytes} bytes, {ranks} ranks: us per call, general path -> medium path, ratio median (range)")
    for k, (off, on) in got[0].items():
        r = [b / a for a, b in zip(off, on)]
        print(f"  {k:28s} {statistics.median(off):8.1f} -> {statistics.median(on):8.1f}   "
              f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})")


if __name__ == "__main__":
    main()

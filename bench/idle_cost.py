"""CPU used by a rank blocked in wait(): the figure behind issue 6's "idle cost".

    python bench/idle_cost.py            # 10 s per case
    python bench/idle_cost.py 30 4       # 30 s, 4 ranks (3 of them keep rank 0 waiting)

Rank 0 blocks in ``recv(...).wait()`` and then in ``barrier()`` while the
other ranks sleep; its CPU time (getrusage, user + system, every thread of
the process) over the wall time is printed as a share of one core.
"""
from __future__ import annotations

import os
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spawned import spawned  # noqa: E402


def _cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def rank_main(rank, world_size, init_method, seconds, out):
    import shmdist as dist
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=seconds + 60)
    dist.barrier()
    box = np.zeros(1, dtype=np.int64)
    for how in ("recv", "barrier"):
        if rank == 0:
            cpu, start = _cpu(), time.monotonic()
            if how == "recv":
                dist.recv(box, src=1).wait()
            else:
                dist.barrier()
            out.put((how, _cpu() - cpu, time.monotonic() - start))
        else:
            time.sleep(seconds)
            if how == "recv":
                if rank == 1:
                    dist.send(box, dst=0).wait()
            else:
                dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    world_size = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    with spawned(rank_main, world_size, seconds, join_s=seconds + 60) as out:
        for _ in range(2):
            how, cpu, wall = out.get(timeout=3 * seconds + 120)
            print(f"idle {how:8s} {world_size} ranks, {os.cpu_count()} CPUs: {cpu * 1000:7.1f} ms CPU in "
                  f"{wall:6.2f} s blocked = {100 * cpu / wall:5.2f} % of a core", flush=True)


if __name__ == "__main__":
    main()

"""Wall time and CPU per broadcast, per rank: where a many-rank broadcast's time goes.

    python bench/broadcast_cpu.py               # 3 ranks, 16 MiB, 60 calls
    python bench/broadcast_cpu.py 4 4M 100      # 4 ranks, 4 MiB, 100 calls
    SHMDIST_SINGLE_COPY=0 python bench/broadcast_cpu.py   # through the arena only

Each rank broadcasts the same array from rank 0 (5 calls first, a barrier),
then times the calls and reads its CPU time (user and system, os.times())
around them. With more ranks than cores, CPU per call well above the copies
a rank makes is time spent waiting for a phase: the arena's broadcast of
16 MiB at 3 ranks on 2 cores took 3.3 ms a call and 1.7-1.8 ms of each
rank's CPU; read from the root's array, 1.6-1.9 ms (README, Benchmarks,
"Broadcast of three or more read from the root"). os.times() counts in
10 ms ticks: use enough calls (60 x 16 MiB is about 0.2 s).
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spawned import spawned  # noqa: E402


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def rank_main(rank, world_size, init_method, nbytes, calls, out):
    import shmdist as dist
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=120)
    buf = np.ones(nbytes, np.uint8)
    for _ in range(5):
        dist.broadcast(buf, src=0)
    dist.barrier()
    t, c = time.perf_counter(), os.times()
    for _ in range(calls):
        dist.broadcast(buf, src=0)
    wall, c2 = time.perf_counter() - t, os.times()
    dist.barrier()
    out.put((rank, wall / calls, (c2.user - c.user) / calls, (c2.system - c.system) / calls))
    dist.destroy_process_group()


def main() -> None:
    world_size = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    nbytes = _bytes(sys.argv[2]) if len(sys.argv) > 2 else 16 << 20
    calls = int(sys.argv[3]) if len(sys.argv) > 3 else 60
    with spawned(rank_main, world_size, nbytes, calls) as out:
        rows = sorted(out.get(timeout=300) for _ in range(world_size))
        for rank, wall, user, system in rows:
            print(f"rank {rank}: broadcast {nbytes} B, {world_size} ranks, {os.cpu_count()} CPUs: "
                  f"{wall * 1e3:6.2f} ms a call, CPU {(user + system) * 1e3:5.2f} ms "
                  f"(user {user * 1e3:.2f}, system {system * 1e3:.2f})", flush=True)


if __name__ == "__main__":
    main()

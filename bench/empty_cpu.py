"""CPU time per all_reduce on plain arrays and on arrays from shmdist.empty,
interleaved: the work each rank does per call, a figure a loaded shared
machine still gives (a rank that waits sleeps, so waiting costs little CPU).

    python bench/empty_cpu.py [--ranks 2] [--mib 16] [--rounds 3] [--iters 40]

Prints, per round and kind, the median wall time per call and rank 0's CPU
time per call (user + system).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import socket
import time

import numpy as np


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def rank_main(rank, world, port, nbytes, rounds, iters, out):
    import shmdist as dist
    dist.init_process_group("shm", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    count = nbytes // 4
    plain = np.ones(count, np.float32)
    shared = dist.empty(count, np.float32)
    shared[:] = 1
    rows = []
    for rnd in range(rounds):
        for kind in (("plain", "empty") if rnd % 2 == 0 else ("empty", "plain")):
            x = plain if kind == "plain" else shared
            x[:] = 0
            for _ in range(3):
                dist.all_reduce(x)
            dist.barrier()
            walls, c0 = [], cpu()
            for _ in range(iters):
                t0 = time.perf_counter()
                dist.all_reduce(x)
                walls.append(time.perf_counter() - t0)
            rows.append((rnd, kind, float(np.median(walls)), (cpu() - c0) / iters))
    dist.destroy_process_group()
    if rank == 0:
        out.put(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mib", type=float, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=40)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, a.ranks, port, int(a.mib * 2**20), a.rounds, a.iters, out))
             for r in range(a.ranks)]
    for p in procs:
        p.start()
    rows = out.get(timeout=600)
    for p in procs:
        p.join(60)
    print(f"all_reduce {a.mib:g} MiB float32, {a.ranks} ranks, {a.iters} calls a round")
    for rnd, kind, wall, c in rows:
        print(f"round {rnd + 1} {kind:5s}  wall {wall * 1e3:7.2f} ms   CPU of rank 0 {c * 1e3:7.2f} ms")
    for kind in ("plain", "empty"):
        w = sorted(r[2] for r in rows if r[1] == kind)
        c = sorted(r[3] for r in rows if r[1] == kind)
        print(f"{kind:5s} median wall {np.median(w) * 1e3:.2f} ms ({w[0] * 1e3:.2f}-{w[-1] * 1e3:.2f}), "
              f"CPU {np.median(c) * 1e3:.2f} ms ({c[0] * 1e3:.2f}-{c[-1] * 1e3:.2f})")


if __name__ == "__main__":
    main()

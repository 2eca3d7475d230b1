"""all_reduce of float32, bfloat16 and float16 torch tensors, interleaved, per byte.

    python bench/half_allreduce.py [--ranks 2] [--sizes 4096,65536,1048576,16777216] [--rounds 7]

Starts the ranks itself. For each size (in bytes, the same for every dtype, so
a 16-bit tensor has twice float32's elements), each round times a batch of
all_reduce calls of every dtype in turn (A B C A B C ...); prints rank 0's
median per call over the rounds, its range, and the median of the per-round
ratio to float32 (at 1.0 a 16-bit byte costs what a float32 byte costs).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

DTYPES = ("float32", "bfloat16", "float16")


def rank_main(rank: int, world: int, port: int, sizes, rounds: int) -> None:
    import torch

    import shmdist as dist
    dist.init_process_group("shm", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=120)
    for nbytes in sizes:
        tensors = {d: torch.zeros(nbytes // (4 if d == "float32" else 2), dtype=getattr(torch, d)) for d in DTYPES}
        iters = max(3, min(500, (32 << 20) // nbytes))
        times = {d: [] for d in DTYPES}
        for _ in range(rounds):
            for d, t in tensors.items():
                for _ in range(2):
                    dist.all_reduce(t)
                start = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(t)
                times[d].append((time.perf_counter() - start) / iters)
        if rank == 0:
            ratios = {d: np.median(np.array(times[d]) / np.array(times["float32"])) for d in DTYPES}
            cells = [f"{d} {np.median(v) * 1e6:8.1f} us ({min(v) * 1e6:.1f}-{max(v) * 1e6:.1f})"
                     + ("" if d == "float32" else f" x{ratios[d]:.2f}") for d, v in times.items()]
            print(f"{nbytes:>9d} B, {world} ranks: " + " | ".join(cells), flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="4096,65536,1048576,16777216")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.rank is not None:
        rank_main(args.rank, args.ranks, args.port, sizes, args.rounds)
        return
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r), "--port", str(port),
                               "--ranks", str(args.ranks), "--sizes", args.sizes, "--rounds", str(args.rounds)])
             for r in range(args.ranks)]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()

"""Where the time of "both ways at once" goes: each rank posts a window of
irecvs, then a window of isends, then waits for all of them (sends first, as
the benchmark's wait_all does), and rank 0 times each part.

    python bench/bidir_posting.py [nbytes] [window] [iterations]

Prints, per step (one window each way): GB/s of both directions together,
the microseconds spent posting the receives, posting the sends, and waiting.
Before the fast lane took single copies, a window of 64 x 1 MiB spent 8-14 us
posting each receive and 10-40 us each send; with it, 1-2 us. Timings only,
never a test.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np


def rank_main(rank: int, port: int, nbytes: int, window: int, iterations: int) -> None:
    import shmdist as dist
    dist.init_process_group("shm", f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=60)
    peer = 1 - rank
    out, into = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    pc = time.perf_counter
    for rep in range(3):
        dist.barrier()
        post_r = post_s = waiting = 0.0
        start = pc()
        for _ in range(iterations):
            a = pc()
            reqs = [dist.irecv(into, peer) for _ in range(window)]
            b = pc()
            sends = [dist.isend(out, peer) for _ in range(window)]
            c = pc()
            for q in sends + reqs:
                q.wait()
            d = pc()
            post_r, post_s, waiting = post_r + b - a, post_s + c - b, waiting + d - c
        took = pc() - start
        if rank == 0 and rep:
            print(f"{nbytes} B x {window} each way: {2 * window * nbytes * iterations / took / 1e9:.2f} GB/s; "
                  f"per step: post receives {post_r / iterations * 1e6:.0f} us, post sends "
                  f"{post_s / iterations * 1e6:.0f} us, wait {waiting / iterations * 1e6:.0f} us", flush=True)
    dist.destroy_process_group()


def main() -> None:
    nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    window = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    iterations = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import bidir_posting as b; b.rank_main(*map(int, sys.argv[1:]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(port), str(nbytes), str(window),
                               str(iterations)]) for r in (0, 1)]
    try:
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":
    main()

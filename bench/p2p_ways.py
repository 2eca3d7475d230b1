"""One-way point-to-point between two ranks, single copies against the ring and
the way the sender times (transport/ways.py), alternated.

    python bench/p2p_ways.py [alternations] [size] [patterns]   # default 3 256K blk,bw,pingpong

Each alternation runs every pattern three times, in an order that rotates:
the default (the sender times both ways and sends the faster), single copies
always (SHMDIST_P2P_CHOOSE=0) and the ring always (SHMDIST_SINGLE_COPY=0).
A run is two fresh ranks: 30 repetitions of 5 steps, a step being a window
of isends (bw) or a loop of blocking sends (blk) of ``size`` bytes, 16 MiB
a step, then an 8-byte ack; or one round trip (pingpong). Prints GB/s (bw,
blk; ping-pong: us per one-way trip), medians over the repetitions, one line
per run, then the medians over the alternations.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spawned import spawned  # noqa: E402
from broadcast_cpu import _bytes  # noqa: E402

WAYS = {"timed": {}, "single": {"SHMDIST_P2P_CHOOSE": "0"}, "ring": {"SHMDIST_SINGLE_COPY": "0"}}


def rank_main(rank, world_size, init_method, nbytes, pattern, out):
    import numpy as np
    import shmdist
    shmdist.init_process_group(init_method=init_method, rank=rank, world_size=world_size)
    buf, ack = np.ones(nbytes, np.uint8), np.zeros(8, np.uint8)
    window = max(1, min(64, (16 << 20) // nbytes))

    peer = 1 - rank
    post = shmdist.isend if rank == 0 else shmdist.irecv     # (send and recv are the same calls, waited)

    def step():
        if pattern == "pingpong":
            for move in ((shmdist.send, shmdist.recv) if rank == 0 else (shmdist.recv, shmdist.send)):
                move(buf, peer).wait()
            return
        if pattern == "bw":
            for r in [post(buf, peer) for _ in range(window)]:
                r.wait()
        else:
            for _ in range(window):
                post(buf, peer).wait()
        (shmdist.recv if rank == 0 else shmdist.send)(ack, peer).wait()

    steps = 200 if pattern == "pingpong" else 5
    figures = []
    for _ in range(30):
        shmdist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        took = time.perf_counter() - t0
        figures.append(took / steps / 2 * 1e6 if pattern == "pingpong" else steps * window * nbytes / took / 1e9)
    shmdist.barrier()
    out.put((rank, statistics.median(figures)))
    shmdist.destroy_process_group()


def one_run(env: dict, nbytes: int, pattern: str) -> float:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with spawned(rank_main, 2, nbytes, pattern) as out:
            return dict(out.get(timeout=300) for _ in range(2))[0]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    alternations = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    nbytes = _bytes(sys.argv[2]) if len(sys.argv) > 2 else 256 << 10
    patterns = sys.argv[3].split(",") if len(sys.argv) > 3 else ["blk", "bw", "pingpong"]
    names = list(WAYS)
    got = {(p, w): [] for p in patterns for w in names}
    for a in range(alternations):
        order = names[a % 3:] + names[:a % 3]
        for p in patterns:
            line = []
            for w in order:
                got[(p, w)].append(one_run(WAYS[w], nbytes, p))
                line.append(f"{w} {got[(p, w)][-1]:.1f}")
            print(f"alternation {a + 1}, {p} {nbytes} B: " + ", ".join(line), flush=True)
    print("medians (range); GB/s, ping-pong us one way:")
    for p in patterns:
        print(f"  {p:9s}" + "   ".join(f"{w} {statistics.median(got[(p, w)]):.1f} "
                                      f"({min(got[(p, w)]):.1f}-{max(got[(p, w)]):.1f})" for w in names))


if __name__ == "__main__":
    main()

"""What the flight recorder costs: 8 B send/recv and a small all_reduce,
with the recorder (this tree), without it (SHMDIST_TRACE=0), and from a
tree without the recorder's code at all (--before DIR: a checkout built
with ``python setup.py build_ext --inplace``), interleaved round by round.

    python bench/trace_overhead.py --before /tmp/shmdist-before --rounds 5

Each point runs fresh processes (2 ranks; 1 for "all_reduce, 1 rank",
which times the recording on the quick all_reduce path without any
scheduling between ranks) and reports the fastest of 15 batches (the one
least disturbed on a shared host); the table gives each variant's median
over the rounds and its ratio to the one before. Timings only, never a
pass/fail test.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCHES = 15


KINDS = {"sendrecv": ("8 B send+recv round trip", 2), "all_reduce": ("all_reduce 8 B, 2 ranks", 2),
         "all_reduce1": ("all_reduce 8 B, 1 rank", 1)}


def _worker(kind: str, iters: int) -> None:
    import numpy as np
    import shmdist as dist
    rank = int(os.environ["RANK"])
    dist.init_process_group("shm", f"tcp://127.0.0.1:{os.environ['PORT']}", rank=rank,
                            world_size=KINDS[kind][1])
    x = np.zeros(1, dtype=np.int64)       # 8 bytes
    y = np.ones(2, dtype=np.float32)      # 8 bytes for all_reduce
    per = []
    for b in range(BATCHES + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if kind == "sendrecv":
            for _ in range(iters):
                if rank == 0:
                    dist.send(x, 1).wait()
                    dist.recv(x, 1).wait()
                else:
                    dist.recv(x, 0).wait()
                    dist.send(x, 0).wait()
        else:
            for _ in range(iters):
                dist.all_reduce(y)
        if b:
            per.append((time.perf_counter() - t0) / iters * 1e6)
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(min(per)))


def _point(tree: str, kind: str, iters: int, trace: str) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=tree, PORT=str(port), SHMDIST_TRACE=trace)
    env.pop("SHMDIST_TRACE_DIR", None)
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", kind, str(iters)], cwd="/",
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, text=True)
             for r in range(KINDS[kind][1])]
    out = [p.communicate(timeout=600)[0] for p in procs]
    return float(out[0].strip())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="a built tree without the recorder")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=5000, help="operations per batch")
    a = ap.parse_args()
    variants = {"before": (a.before, "1"), "recorder on": (HERE, "1"), "SHMDIST_TRACE=0": (HERE, "0")}
    res = {(k, v): [] for k in KINDS for v in variants}
    for r in range(a.rounds):
        for kind in KINDS:
            for name, (tree, trace) in variants.items():
                res[(kind, name)].append(_point(tree, kind, a.iters, trace))
        print(f"round {r + 1}: " + ", ".join(f"{k[0]}/{k[1]} {v[-1]:.3f}" for k, v in res.items()), flush=True)
    print(f"\n{'pattern':<28}{'variant':<18}{'us/op':>12}{'vs before':>11}   per round (fastest batch)")
    for kind, (label, _) in KINDS.items():
        base = statistics.median(res[(kind, "before")])
        for name in variants:
            vals = res[(kind, name)]
            med = statistics.median(vals)
            print(f"{label:<28}{name:<18}{med:>12.3f}{med / base:>10.3f}x   "
                  + " ".join(f"{v:.3f}" for v in vals))


if __name__ == "__main__":
    main()

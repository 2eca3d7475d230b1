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


KINDS = {"send": ("8 B send (into the ring)", 2), "recv": ("8 B recv (already there)", 2),
         "sendrecv": ("8 B send+recv round trip", 2), "all_reduce": ("all_reduce 8 B, 2 ranks", 2),
         "all_reduce1": ("all_reduce 8 B, 1 rank", 1)}
P2P_ITERS = 8000     # 8 B records that fit a 2-rank ring (192 B each in 2 MiB)


def _worker(kind: str, iters: int) -> None:
    import numpy as np
    import shmdist as dist
    rank = int(os.environ["RANK"])
    dist.init_process_group("shm", f"tcp://127.0.0.1:{os.environ['PORT']}", rank=rank,
                            world_size=2 if kind == "inproc" else KINDS[kind][1])
    x = np.zeros(1, dtype=np.int64)       # 8 bytes
    y = np.ones(2, dtype=np.float32)      # 8 bytes for all_reduce
    per = []
    if kind == "inproc":
        _inproc(dist, rank, x, y)
        return
    if kind in ("send", "recv"):     # each side timed alone: rank 0 fills the ring, then rank 1 empties it
        for b in range(BATCHES + 1):
            dist.barrier()
            if rank == 0:
                t0 = time.perf_counter()
                for _ in range(P2P_ITERS):
                    dist.send(x, 1)
                t = time.perf_counter() - t0
            dist.barrier()
            if rank == 1:
                t0 = time.perf_counter()
                for _ in range(P2P_ITERS):
                    dist.recv(x, 0)
                t = time.perf_counter() - t0
            if b:
                per.append(t / P2P_ITERS * 1e6)
        dist.destroy_process_group()
        if rank == (0 if kind == "send" else 1):
            print(json.dumps(min(per)))
        return
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


def _inproc(dist, rank, x, y) -> None:
    """The recording alone: the same process times batches with its ring
    attached and detached (_core.trace_attach(0, 0)), alternating, so both
    see the same load; fastest batch of each."""
    from shmdist import _core, trace
    ring = trace._own
    on = {"send": [], "recv": []}
    off = {"send": [], "recv": []}
    for b in range(2 * INPROC_PAIRS):
        attached = b % 2 == 0
        if attached:
            _core.trace_attach(ring.addr, ring.capacity)
        else:
            _core.trace_attach(0, 0)
        dist.barrier()
        if rank == 0:
            t0 = time.perf_counter()
            for _ in range(P2P_ITERS):
                dist.send(x, 1)
            (on if attached else off)["send"].append((time.perf_counter() - t0) / P2P_ITERS * 1e6)
        dist.barrier()
        if rank == 1:
            t0 = time.perf_counter()
            for _ in range(P2P_ITERS):
                dist.recv(x, 0)
            (on if attached else off)["recv"].append((time.perf_counter() - t0) / P2P_ITERS * 1e6)
    _core.trace_attach(ring.addr, ring.capacity)
    dist.destroy_process_group()
    kind = "send" if rank == 0 else "recv"
    print(json.dumps([min(on[kind]), min(off[kind])]))


INPROC_PAIRS = 40


def _inproc1() -> None:
    """all_reduce of 8 B on a 1-rank group, ring attached and detached, alternating."""
    import numpy as np
    import shmdist as dist
    from shmdist import _core, trace
    dist.init_process_group("shm", f"tcp://127.0.0.1:{os.environ['PORT']}", rank=0, world_size=1)
    ring = trace._own
    y = np.ones(2, dtype=np.float32)
    on, off = [], []
    for b in range(2 * INPROC_PAIRS):
        attached = b % 2 == 0
        _core.trace_attach(ring.addr, ring.capacity) if attached else _core.trace_attach(0, 0)
        t0 = time.perf_counter()
        for _ in range(20000):
            dist.all_reduce(y)
        (on if attached else off).append((time.perf_counter() - t0) / 20000 * 1e6)
    _core.trace_attach(ring.addr, ring.capacity)
    dist.destroy_process_group()
    print(json.dumps([min(on), min(off)]))


def _point(tree: str, kind: str, iters: int, trace: str) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=tree, PORT=str(port), SHMDIST_TRACE=trace)
    env.pop("SHMDIST_TRACE_DIR", None)
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", kind, str(iters)], cwd="/",
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, text=True)
             for r in range(KINDS[kind][1])]
    out = [p.communicate(timeout=600)[0].strip() for p in procs]
    return float(next(o for o in out if o))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        if sys.argv[2] == "inproc1":
            _inproc1()
        else:
            _worker(sys.argv[2], int(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="a built tree without the recorder")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=5000, help="operations per batch")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"of {','.join(KINDS)}")
    ap.add_argument("--inproc", action="store_true", help="only the in-process on/off comparison "
                    "(ring attached and detached in one process, alternating: robust on a loaded host)")
    a = ap.parse_args()
    if a.inproc:
        for r in range(a.rounds):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            env = dict(os.environ, PYTHONPATH=HERE, PORT=str(port), SHMDIST_TRACE="1")
            procs = [subprocess.Popen([sys.executable, __file__, "--worker", "inproc", "0"], cwd="/",
                                      env=dict(env, RANK=str(k)), stdout=subprocess.PIPE, text=True) for k in range(2)]
            (s_on, s_off), (r_on, r_off) = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            p = subprocess.run([sys.executable, __file__, "--worker", "inproc1", "0"], cwd="/",
                               env=dict(env, RANK="0", PORT=str(port)), capture_output=True, text=True, timeout=600)
            a_on, a_off = json.loads(p.stdout)
            print(f"round {r + 1}: 8 B send {s_on:.4f} vs {s_off:.4f} us ({s_on / s_off - 1:+.1%}), "
                  f"8 B recv {r_on:.4f} vs {r_off:.4f} us ({r_on / r_off - 1:+.1%}), "
                  f"all_reduce 8 B 1 rank {a_on:.4f} vs {a_off:.4f} us ({a_on / a_off - 1:+.1%})", flush=True)
        return
    variants = {"before": (a.before, "1"), "recorder on": (HERE, "1"), "SHMDIST_TRACE=0": (HERE, "0")}
    kinds = [k for k in a.kinds.split(",") if k in KINDS]
    res = {(k, v): [] for k in kinds for v in variants}
    for r in range(a.rounds):
        for kind in kinds:
            for name, (tree, trace) in variants.items():
                res[(kind, name)].append(_point(tree, kind, a.iters, trace))
        print(f"round {r + 1}: " + ", ".join(f"{k[0]}/{k[1]} {v[-1]:.3f}" for k, v in res.items()), flush=True)
    print(f"\n{'pattern':<28}{'variant':<18}{'us/op':>12}{'vs before':>11}   per round (fastest batch)")
    for kind in kinds:
        label = KINDS[kind][0]
        base = statistics.median(res[(kind, "before")])
        for name in variants:
            vals = res[(kind, name)]
            med = statistics.median(vals)
            print(f"{label:<28}{name:<18}{med:>12.3f}{med / base:>10.3f}x   "
                  + " ".join(f"{v:.3f}" for v in vals))


if __name__ == "__main__":
    main()

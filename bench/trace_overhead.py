"""What the flight recorder costs: 8 B send and receive, an 8 B ping-pong,
all_reduce of 8 B and 4 KiB, and a 1 MiB stream, with the recorder on
(this tree) against SHMDIST_TRACE=0, each run in fresh processes,
interleaved round by round (the order of the variants rotates), medians
over the rounds with their range; wall time and the thread's CPU time.

    python bench/trace_overhead.py --rounds 5
    python bench/trace_overhead.py --rounds 5 --before /tmp/other-tree    # + a built tree to compare
    python bench/trace_overhead.py --inproc --rounds 5

Between the phases of a run the two ranks hand over through a socketpair,
never through shmdist: a rank that waits for its turn sleeps in the
kernel, out of the way of what is measured. "recv_barrier" measures that
other case on purpose: the receives of a rank whose peer sleeps in a
shmdist barrier (which cost a futex_wake syscall per receive until the
doorbells woke only whom the news is for).

Each run reports, per pattern, the fastest of BATCHES batches (the one
least disturbed on a shared host), wall and CPU; ``--inproc`` times the
ring attached and detached in the same processes, alternating batch by
batch (_core.trace_attach), so both see the same load. Timings only,
never a pass/fail test.
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
P2P_ITERS = 8000      # 8 B records that fit a 2-rank ring (192 B each in 2 MiB)
COLL_ITERS = 3000
PING_ITERS = 2000
STREAM = (1 << 20, 64)   # bytes per message, messages per batch

PATTERNS = {"send": "8 B send (into the ring)", "recv": "8 B recv (already there)",
            "recv_barrier": "8 B recv, peer in a barrier",
            "pingpong": "8 B ping-pong, one way", "all_reduce_8": "all_reduce 8 B, 2 ranks",
            "all_reduce_4k": "all_reduce 4 KiB, 2 ranks", "stream": "1 MiB stream, per message"}


class _Turns:
    """Handing the turn over between the two ranks, through a socket."""

    def __init__(self, fd: int):
        self.s = socket.socket(fileno=fd)

    def give(self) -> None:
        self.s.sendall(b"x")

    def take(self) -> None:
        if self.s.recv(1) != b"x":
            raise SystemExit("the other rank went away")

    def both(self) -> None:
        """Both ranks start the next batch together."""
        self.give()
        self.take()


def _timed(fn, n: int) -> tuple[float, float]:
    """(wall, CPU of this thread) per call of ``fn`` run ``n`` times, in µs."""
    w0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        fn()
    return (time.perf_counter() - w0) / n * 1e6, (time.thread_time() - c0) / n * 1e6


def _best(samples: list) -> list:
    return list(min(samples))        # fastest batch (by wall), with its CPU


def _worker(rank: int, fd: int, patterns: list[str], inproc: bool) -> None:
    import numpy as np
    import shmdist as dist
    from shmdist import _core, trace
    turns = _Turns(fd)
    dist.init_process_group("shm", f"tcp://127.0.0.1:{os.environ['PORT']}", rank=rank, world_size=2)
    ring = trace._own
    if inproc and ring is None:
        raise SystemExit("--inproc needs the recorder on")
    x = np.zeros(1, dtype=np.int64)                  # 8 bytes
    y8 = np.ones(2, dtype=np.float32)
    y4k = np.ones(1024, dtype=np.float32)
    big = np.zeros(STREAM[0], dtype=np.uint8)
    peer = 1 - rank
    out: dict = {}

    def note(name, attached, value):
        out.setdefault(name, {}).setdefault("on" if attached else "off", []).append(value)

    for b in range(2 * BATCHES + 2 if inproc else BATCHES + 1):
        attached = b % 2 == 0 or not inproc
        if inproc:
            _core.trace_attach(ring.addr, ring.capacity) if attached else _core.trace_attach(0, 0)
        keep = b >= (2 if inproc else 1)      # the first batch (of each kind) warms up
        if "send" in patterns or "recv" in patterns:     # rank 0 fills the ring, then rank 1 empties it
            if rank == 0:
                t = _timed(lambda: dist.send(x, 1), P2P_ITERS)
                turns.give()
                turns.take()
                if keep:
                    note("send", attached, t)
            else:
                turns.take()
                t = _timed(lambda: dist.recv(x, 0), P2P_ITERS)
                turns.give()
                if keep:
                    note("recv", attached, t)
        if "recv_barrier" in patterns:     # as above, but rank 0 waits in a shmdist barrier meanwhile
            if rank == 0:
                for _ in range(P2P_ITERS):
                    dist.send(x, 1)
                turns.give()
                dist.barrier()         # spins, then sleeps on its doorbell: what do rank 1's receives ring?
            else:
                turns.take()
                time.sleep(0.02)       # rank 0 is asleep by now
                t = _timed(lambda: dist.recv(x, 0), P2P_ITERS)
                dist.barrier()
                if keep:
                    note("recv_barrier", attached, t)
        if "pingpong" in patterns:
            turns.both()
            if rank == 0:
                def one():
                    dist.send(x, 1).wait()
                    dist.recv(x, 1).wait()
            else:
                def one():
                    dist.recv(x, 0).wait()
                    dist.send(x, 0).wait()
            w, c = _timed(one, PING_ITERS)
            if keep and rank == 0:
                note("pingpong", attached, (w / 2, c / 2))
        for name, y in (("all_reduce_8", y8), ("all_reduce_4k", y4k)):
            if name in patterns:
                turns.both()
                t = _timed(lambda: dist.all_reduce(y), COLL_ITERS)
                if keep and rank == 0:
                    note(name, attached, t)
        if "stream" in patterns:
            turns.both()
            if rank == 0:
                _timed(lambda: dist.send(big, 1).wait(), STREAM[1])
            else:
                t = _timed(lambda: dist.recv(big, 0).wait(), STREAM[1])
                if keep:
                    note("stream", attached, t)
    if inproc:
        _core.trace_attach(ring.addr, ring.capacity)
    turns.both()
    dist.destroy_process_group()
    print(json.dumps({name: {k: _best(v) for k, v in sides.items()} for name, sides in out.items()}))


def _run(tree: str, trace: str, patterns: list[str], inproc: bool = False) -> dict:
    """One run of two fresh ranks; pattern -> {"on"/"off": [wall, cpu]}."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    a, b = socket.socketpair()
    env = dict(os.environ, PYTHONPATH=tree, PORT=str(port), SHMDIST_TRACE=trace)
    env.pop("SHMDIST_TRACE_DIR", None)
    procs = []
    for rank, end in ((0, a), (1, b)):
        cmd = [sys.executable, __file__, "--worker", str(rank), str(end.fileno()), ",".join(patterns)]
        if inproc:
            cmd.append("--inproc")
        procs.append(subprocess.Popen(cmd, cwd="/", env=env, stdout=subprocess.PIPE, text=True,
                                      pass_fds=(end.fileno(),)))
    a.close()
    b.close()
    merged: dict = {}
    for p in procs:
        text = p.communicate(timeout=900)[0].strip()
        if p.returncode:
            raise SystemExit(f"a rank failed (exit {p.returncode})")
        merged.update(json.loads(text))
    return merged


def _cell(vals: list[float]) -> str:
    return f"{statistics.median(vals):.3f} [{min(vals):.3f}-{max(vals):.3f}]"


def _table(res: dict, variants: list[str], patterns: list[str], ref: str) -> None:
    print(f"\n{'pattern':<28}{'variant':<18}{'wall us/op [range]':>26}{'vs ' + ref:>12}"
          f"{'CPU us/op [range]':>26}{'vs ' + ref:>12}")
    for pat in patterns:
        if not res.get((pat, ref)):
            continue
        base_w = statistics.median(v[0] for v in res[(pat, ref)])
        base_c = statistics.median(v[1] for v in res[(pat, ref)])
        for name in variants:
            vals = res.get((pat, name), [])
            if not vals:
                continue
            w, c = [v[0] for v in vals], [v[1] for v in vals]
            print(f"{PATTERNS[pat]:<28}{name:<18}{_cell(w):>26}{statistics.median(w) / base_w - 1:>+11.1%} "
                  f"{_cell(c):>26}{statistics.median(c) / base_c - 1:>+11.1%}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(","), "--inproc" in sys.argv)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--patterns", default=",".join(PATTERNS), help=f"of {','.join(PATTERNS)}")
    ap.add_argument("--before", help="a built tree (python setup.py build_ext --inplace) to compare too")
    ap.add_argument("--only-trees", action="store_true",
                    help="with --before: compare the two trees, both with the recorder on")
    ap.add_argument("--inproc", action="store_true", help="ring attached against detached in the same "
                    "processes, alternating batch by batch")
    a = ap.parse_args()
    patterns = [p for p in a.patterns.split(",") if p in PATTERNS]
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    if a.inproc:
        res: dict = {}
        for r in range(a.rounds):
            got = _run(HERE, "1", patterns, inproc=True)
            for pat, sides in got.items():
                res.setdefault((pat, "attached"), []).append(sides["on"])
                res.setdefault((pat, "detached"), []).append(sides["off"])
            print(f"round {r + 1}: " + ", ".join(
                f"{pat} {sides['on'][0]:.3f}/{sides['off'][0]:.3f}" for pat, sides in got.items()), flush=True)
        _table(res, ["attached", "detached"], patterns, "detached")
        print(f"load average at end: {os.getloadavg()[0]:.1f}")
        return
    variants = {"recorder on": (HERE, "1"), "SHMDIST_TRACE=0": (HERE, "0")}
    ref = "SHMDIST_TRACE=0"
    if a.before:
        if a.only_trees:
            variants = {"this tree": (HERE, "1")}
            ref = "before"
        variants["before"] = (a.before, "1")
    names = list(variants)
    res = {}
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            tree, trace = variants[name]
            for pat, sides in _run(tree, trace, patterns).items():
                res.setdefault((pat, name), []).append(sides["on"])
        print(f"round {r + 1}: " + ", ".join(f"{pat}/{name} {res[(pat, name)][-1][0]:.3f}"
                                             for pat in patterns for name in names if (pat, name) in res),
              flush=True)
    _table(res, names, patterns, ref)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

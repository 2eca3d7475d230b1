"""pytest-benchmark runs of shmdist, for regression tracking (not part of the tests):

    pytest bench/ --benchmark-only            # add --benchmark-autosave to keep a baseline
    pytest bench/ --benchmark-compare         # against the last saved one

The pytest process is rank 0; bench/partner.py runs the other ranks and
follows its commands. The side-by-side comparison with the peers is
``python -m shmdist.bench``.
"""
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import shmdist as dist

sys.path.insert(0, os.path.dirname(__file__))
from partner import ALL_REDUCE, BARRIER, BROADCAST, ECHO, EXIT, SINK  # noqa: E402,F401

WARMUP = 20


class World:
    def __init__(self, size: int):
        self.size = size

    def command(self, op: int, nbytes: int = 0, rounds: int = 0, window: int = 1) -> None:
        cmd = np.array([op, nbytes, rounds, window], np.int64)
        for r in range(1, self.size):
            dist.send(cmd, r).wait()

    def run(self, benchmark, op: int, nbytes: int, rounds: int, step, window: int = 1) -> None:
        """Benchmark ``step`` (rank 0's side of one round) while the partners
        do ``rounds + WARMUP`` rounds of ``op``; rounds pytest-benchmark did not
        run (--benchmark-disable) are run afterwards, so both sides agree."""
        self.command(op, nbytes, rounds + WARMUP, window)
        calls = [0]

        def counted():
            calls[0] += 1
            step()
        benchmark.pedantic(counted, rounds=rounds, warmup_rounds=WARMUP)
        for _ in range(rounds + WARMUP - calls[0]):
            step()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=[2])
def world(request):
    """A shmdist job of ``request.param`` ranks; this process is rank 0."""
    n, port = request.param, free_port()
    partner = os.path.join(os.path.dirname(__file__), "partner.py")
    procs = [subprocess.Popen([sys.executable, partner, str(r), str(n), str(port)]) for r in range(1, n)]
    try:
        dist.init_process_group("shm", f"tcp://127.0.0.1:{port}", rank=0, world_size=n, timeout=120)
        w = World(n)
        yield w
        w.command(EXIT)
        dist.destroy_process_group()
        for p in procs:
            p.wait(timeout=30)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

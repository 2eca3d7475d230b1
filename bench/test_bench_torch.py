"""torch.distributed.all_reduce through torch, backend "shm" (shmdist.torch) against "gloo".

    pytest bench/test_bench_torch.py --benchmark-only --benchmark-group-by=group

float32 SUM of 4 KiB ... 64 MiB between 2 ranks, both backends in one run,
grouped by size so that the table reads as the ratio of the two. The pytest
process is rank 0; this file, run as a script, is rank 1 and follows its
commands (size and rounds of the next batch, broadcast by rank 0).
"""
import os
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB]
WARMUP = 10
PARTNER_TIMEOUT = 120     # seconds for the partner to finish after the last command


def _rounds(nbytes: int) -> int:
    return 1000 if nbytes <= 64 * KiB else 200 if nbytes <= MiB else 20


def _command(nbytes: int, rounds: int) -> None:
    """Tell rank 1 what to run next (nbytes 0: leave)."""
    dist.broadcast(torch.tensor([nbytes, rounds], dtype=torch.int64), src=0)


def partner(backend: str, port: int) -> None:
    import shmdist.torch  # noqa: F401
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    cmd = torch.zeros(2, dtype=torch.int64)
    while True:
        dist.broadcast(cmd, src=0)
        nbytes, rounds = cmd.tolist()
        if nbytes == 0:
            break
        buf = torch.zeros(nbytes // 4)
        for _ in range(rounds):
            dist.all_reduce(buf)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=["shm", "gloo"])
def backend(request):
    """A torch.distributed job of 2 ranks on ``request.param``; this process is rank 0."""
    import shmdist.torch  # noqa: F401
    name, port = request.param, _free_port()
    rank1 = subprocess.Popen([sys.executable, os.path.abspath(__file__), name, str(port)])
    try:
        dist.init_process_group(name, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
        yield name
        _command(0, 0)
        dist.destroy_process_group()
        rank1.wait(PARTNER_TIMEOUT)
    finally:
        if rank1.poll() is None:
            rank1.kill()
            rank1.wait()
    assert rank1.returncode == 0, f"rank 1 ({name}) exited with code {rank1.returncode}"


@pytest.mark.parametrize("nbytes", SIZES, ids=[f"{n // KiB}KiB" if n < MiB else f"{n // MiB}MiB" for n in SIZES])
def test_all_reduce(benchmark, backend, nbytes):
    benchmark.group = f"all_reduce {nbytes} bytes"
    rounds = _rounds(nbytes)
    buf = torch.zeros(nbytes // 4)
    _command(nbytes, rounds + WARMUP)
    calls = [0]

    def step():
        calls[0] += 1
        dist.all_reduce(buf)
    benchmark.pedantic(step, rounds=rounds, warmup_rounds=WARMUP)
    for _ in range(rounds + WARMUP - calls[0]):   # rounds not run (--benchmark-disable)
        step()


if __name__ == "__main__":
    partner(sys.argv[1], int(sys.argv[2]))

"""torch.distributed.all_reduce through torch, backend "shm" (shmdist.torch) against "gloo".

    pytest bench/test_bench_torch.py --benchmark-only --benchmark-group-by=group

The torch path's rows (the table of README's torch section), shm against gloo
measured interleaved, round by round, each figure a median with its range
over the rounds:

    python bench/test_bench_torch.py rows [--rounds 3]

- send/recv of 8 bytes one way (half a ping-pong), all_reduce of 4 KiB and
  barrier through torch.distributed, 2 ranks; also on the backend "null",
  whose calls do nothing: torch's own cost of the call, which no backend
  avoids;
- shmdist's own send/recv of 8 bytes one way with a torch tensor and with a
  numpy array (the cost of taking torch tensors);
- the step of a small DDP model (3 Linear layers of 256, batch 32, SGD) on
  2 and 4 ranks.

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


# ---------------------------------------------------------------- the torch path's rows

ROW_ITERS = {"p2p": 3000, "all_reduce": 3000, "barrier": 3000, "own": 5000, "ddp": 30}


def _median_us(step, iters: int, reps: int = 5) -> float:
    """Median over ``reps`` batches of the mean time of one ``step``, in microseconds."""
    import statistics
    import time
    for _ in range(max(iters // 10, 5)):
        step()
    batches = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        batches.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(batches)


def _register_null() -> None:
    """The backend "null": a ProcessGroup whose calls do nothing (a send or
    receive returns one premade completed Work). Through torch.distributed
    it measures torch's own cost of a call, which no backend can avoid; a
    row's shm figure less this one is what shmdist costs."""
    if "null" in dist.Backend.backend_list:
        return

    class _Done(dist.Work):
        def wait(self, timeout=None):
            return True

    class NullProcessGroup(dist.ProcessGroup):
        def __init__(self, rank, size):
            super().__init__(rank, size)
            self._done = _Done()

        def getBackendName(self):
            return "null"

        def allreduce(self, tensors, opts=None):
            return None

        def barrier(self, opts=None):
            return None

        def broadcast(self, tensors, opts=None):
            return None

        def send(self, tensors, dst, tag):
            return self._done

        def recv(self, tensors, src, tag):
            return self._done

        def shutdown(self):
            pass

    dist.Backend.register_backend("null", lambda opts, _: NullProcessGroup(opts.group_rank, opts.group_size),
                                  extended_api=True, devices=["cpu"])


def _torch_rank(rank: int, world: int, port: int, backend: str, kind: str, out) -> None:
    import shmdist.torch  # noqa: F401
    _register_null()
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = {}
    if kind == "calls":
        t = torch.zeros(2)                       # 8 bytes

        def ping():
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
        rows["send/recv 8 B one way"] = _median_us(ping, ROW_ITERS["p2p"]) / 2
        buf = torch.zeros(KiB)                   # 4 KiB of float32
        rows["all_reduce 4 KiB"] = _median_us(lambda: dist.all_reduce(buf), ROW_ITERS["all_reduce"])
        rows["barrier"] = _median_us(dist.barrier, ROW_ITERS["barrier"])
    else:                                        # a DDP step
        from torch.nn.parallel import DistributedDataParallel
        torch.set_num_threads(1)                 # one core per rank: ranks do not fight over cores
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                    torch.nn.ReLU(), torch.nn.Linear(256, 10))
        ddp = DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        x, y = torch.randn(32, 256), torch.randn(32, 10)

        def step():
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        rows[f"DDP step, {world} ranks"] = _median_us(step, ROW_ITERS["ddp"])
    if backend != "null":
        dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        out.put(rows)


def _own_rank(rank: int, world: int, port: int, backend: str, kind: str, out) -> None:
    import numpy as np
    import shmdist
    shmdist.init_process_group("shm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = {}
    for name, buf in (("numpy array", np.zeros(2, np.float32)), ("torch tensor", torch.zeros(2))):
        def ping():
            if rank == 0:
                shmdist.send(buf, 1).wait()
                shmdist.recv(buf, 1).wait()
            else:
                shmdist.recv(buf, 0).wait()
                shmdist.send(buf, 0).wait()
        rows[f"shmdist send/recv 8 B one way, {name}"] = _median_us(ping, ROW_ITERS["own"]) / 2
    t = torch.zeros(2)      # what any view cache must read from a tensor on every call, and no more
    rows["reading a tensor's address, shape, strides, dtype, requires_grad, negative bit"] = _median_us(
        lambda: (t.data_ptr(), t.shape, t.stride(), t.dtype, t.requires_grad, t.is_neg()), ROW_ITERS["own"])
    rows["torch tensor.numpy()"] = _median_us(t.numpy, ROW_ITERS["own"])
    shmdist.destroy_process_group()
    if rank == 0:
        out.put(rows)


def _job(target, world: int, backend: str, kind: str) -> dict:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, backend, kind, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        rows = out.get(timeout=600)
    finally:
        for p in procs:
            p.join(60)
            if p.exitcode is None:
                p.kill()
                p.join()
    return rows


def torch_path_rows(rounds: int = 3) -> dict:
    """{row: {backend: [figure of each round]}}, shm and gloo interleaved in every round."""
    figures: dict = {}

    def keep(backend, rows):
        for row, value in rows.items():
            figures.setdefault(row, {}).setdefault(backend, []).append(value)
    for _ in range(rounds):
        for backend in ("shm", "gloo", "null"):
            keep(backend, _job(_torch_rank, 2, backend, "calls"))
        keep("shmdist", _job(_own_rank, 2, "shm", "own"))
        for world in (2, 4):
            for backend in ("shm", "gloo"):
                keep(backend, _job(_torch_rank, world, backend, "ddp"))
    return figures


def rows_table(figures: dict) -> str:
    import statistics

    def cell(values):
        if not values:
            return ""
        return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"
    lines = ["| torch path, µs (median, range over rounds) | shm | gloo | torch alone (backend \"null\") |",
             "|---|---|---|---|"]
    for row, by in figures.items():
        if "shmdist" in by:
            lines.append(f"| {row} | {cell(by['shmdist'])} | | |")
        else:
            lines.append(f"| {row} | {cell(by.get('shm', []))} | {cell(by.get('gloo', []))} | "
                         f"{cell(by.get('null', []))} |")
    return "\n".join(lines)


@pytest.mark.timeout(1200)
def test_torch_path_rows():
    """The torch path's rows, one quick round (the figures: ``python bench/test_bench_torch.py rows``)."""
    global ROW_ITERS
    saved, ROW_ITERS = ROW_ITERS, {k: max(v // 10, 10) for k, v in ROW_ITERS.items()}
    try:
        figures = torch_path_rows(rounds=1)
    finally:
        ROW_ITERS = saved
    print(rows_table(figures))
    assert {"send/recv 8 B one way", "all_reduce 4 KiB", "barrier", "DDP step, 2 ranks",
            "DDP step, 4 ranks"} <= set(figures)
    assert all(v > 0 for by in figures.values() for values in by.values() for v in values)


if __name__ == "__main__":
    if sys.argv[1] == "rows":
        import argparse
        ap = argparse.ArgumentParser(description="the torch path's rows: shm against gloo, interleaved")
        ap.add_argument("--rounds", type=int, default=3)
        args = ap.parse_args(sys.argv[2:])
        print(rows_table(torch_path_rows(args.rounds)))
    else:
        partner(sys.argv[1], int(sys.argv[2]))

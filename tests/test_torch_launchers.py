"""No shared memory and no process is left behind when a member of a torch
``new_group(backend="shm")`` dies at the worst moment, under the launchers
people use: torchrun (``python -m torch.distributed.run``), a plain
``torch.multiprocessing.spawn``, and a harness that SIGTERMs ranks.

The worst moment: torch's ``new_group`` has no barrier, so the member that
creates the group's arena (group rank 0) may return, and die, before the
others have mapped it. Here that member is global rank 1 (the group is
[1, 2] of 3 ranks, so the rank that serves the rendezvous store is not the
one that dies). It kills itself the moment ``new_group`` returns; rank 2 then
uses the group and rank 0 waits in a barrier of the whole job.

Every launcher must end within seconds of the death, no rank may be left
running (each writes its pid down first), and nothing may appear in
/dev/shm (shmdist's segments are memfds: they vanish with their last
process).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

from ranks import free_port, process_gone  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORLD = 3
VICTIM = 1

RANK_CODE = textwrap.dedent('''
    import datetime, os, signal, sys, time
    import torch
    import torch.distributed as dist
    import shmdist.torch  # noqa: F401

    def rank_main(rank, world, outdir, how):
        open(os.path.join(outdir, f"pid{rank}"), "w").write(str(os.getpid()))
        dist.init_process_group("shm", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        group = dist.new_group([1, 2], backend="shm")
        if rank == 1:                   # the arena's creator, right after new_group returned
            open(os.path.join(outdir, "made"), "w").write("1")
            if how == "self-SIGTERM":
                os.kill(os.getpid(), signal.SIGTERM)
            elif how == "self-SIGKILL":
                os.kill(os.getpid(), signal.SIGKILL)
            else:                       # the harness SIGTERMs this rank
                time.sleep(120)
            time.sleep(120)
        if rank == 2:
            time.sleep(0.5)             # let the creator be gone
            dist.all_reduce(torch.ones(4), group=group)
        dist.barrier()
        dist.destroy_process_group()

    def spawned(local, world, outdir, how):     # torch.multiprocessing.spawn's entry
        rank_main(local, world, outdir, how)

    if __name__ == "__main__":
        how, outdir = sys.argv[1], sys.argv[2]
        if how.startswith("spawn "):
            import torch.multiprocessing as mp
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
            mp.spawn(spawned, args=({world}, outdir, how.split()[1]), nprocs={world}, join=True)
        else:
            rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), outdir, how)
''').replace("{world}", str(WORLD))


def _dev_shm() -> set[str]:
    """/dev/shm entries shmdist or torch could make (other programs on the host make theirs)."""
    return {n for n in os.listdir("/dev/shm") if "shmdist" in n or "torch" in n}


def _pids(outdir: Path) -> list[int]:
    return [int((outdir / f"pid{r}").read_text()) for r in range(WORLD) if (outdir / f"pid{r}").exists()]


def _check_nothing_left(outdir: Path, before: set[str], what: str) -> None:
    pids = _pids(outdir)
    assert len(pids) == WORLD, f"{what}: only {len(pids)} ranks started"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(process_gone(p) for p in pids):
        time.sleep(0.1)
    alive = [p for p in pids if not process_gone(p)]
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert not alive, f"{what}: ranks {alive} were still running after the launcher ended (killed now)"
    new = sorted(_dev_shm() - before)
    assert not new, f"{what}: /dev/shm entries appeared and stayed: {new}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher,how", [
    ("torchrun", "self-SIGTERM"),
    ("torchrun", "self-SIGKILL"),
    ("mp.spawn", "self-SIGKILL"),
    ("mp.spawn", "self-SIGTERM"),
])
def test_a_group_creator_that_dies_leaves_nothing(tmp_path, launcher, how):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_CODE)
    before = _dev_shm()
    port = free_port()
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
               "--master-port", str(port), str(script), how, str(tmp_path)]
    else:
        cmd = [sys.executable, str(script), f"spawn {how}", str(tmp_path), str(port)]
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    took = time.monotonic() - start
    assert (tmp_path / "made").exists(), f"{launcher}: the group was never made:\n{done.stderr[-4000:]}"
    assert done.returncode != 0, f"{launcher} reported success although rank {VICTIM} died"
    assert took < 150, f"{launcher} took {took:.0f} s to end after rank {VICTIM} died:\n{done.stderr[-4000:]}"
    _check_nothing_left(tmp_path, before, f"{launcher} ({how})")


@pytest.mark.timeout(240)
def test_a_harness_that_sigterms_ranks_leaves_nothing(tmp_path):
    """The ranks are plain processes of this test (env://); it SIGTERMs the
    group's creator once the group is made, as a test harness's timeout
    does. The others must end on their own, naming the dead rank, and then
    the harness SIGTERMs whatever is left: nothing may remain."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_CODE)
    before = _dev_shm()
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, str(script), "harness", str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 150
        while not (tmp_path / "made").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
                "the group was never made: " + " | ".join(p.communicate()[1][-2000:] for p in procs
                                                           if p.poll() is not None))
            time.sleep(0.05)
        procs[VICTIM].send_signal(signal.SIGTERM)
        errors = {}
        for rank, p in enumerate(procs):
            if rank != VICTIM:
                try:
                    _, errors[rank] = p.communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    p.send_signal(signal.SIGTERM)          # the harness gives up on it
                    _, err = p.communicate(timeout=30)
                    pytest.fail(f"rank {rank} did not end on its own after rank {VICTIM} was SIGTERMed:\n"
                                f"{err[-3000:]}")
        procs[VICTIM].communicate(timeout=30)
        assert procs[VICTIM].returncode == -signal.SIGTERM
        for rank in errors:
            assert procs[rank].returncode != 0, f"rank {rank} exited 0 although rank {VICTIM} died"
            assert f"rank {VICTIM}" in errors[rank], f"rank {rank}'s error names no dead rank:\n{errors[rank][-3000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    _check_nothing_left(tmp_path, before, "a harness's SIGTERM")

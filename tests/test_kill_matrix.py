"""Kill matrix: the whole job is killed at a random instant, and nothing is left.

Two ways a job dies all at once in real life:

- every rank gets SIGKILL together (the OOM killer, ``docker kill``,
  ``scancel``): here one ``killpg`` on the ranks' process group, at a random
  instant during init or during a loop of ``new_group`` + ``all_reduce``;
- ``shmdist-run`` itself gets SIGKILL: its ranks die by PDEATHSIG and no
  one is left to clean up.

After each run the test asserts that no rank survives and that nothing of
the job is in /dev/shm. Segments are memfds (no name), so this holds by
construction; before they were, 7 of 20, 15 of 30 and 8 of 12 such runs left
a segment. CI runs a few of each; ``SHMDIST_KILL_RUNS=60`` runs 60 of each
(the figure in the closing note of issue 13) and prints where the ranks were
when they died.
"""
from __future__ import annotations

import collections
import glob
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ranks import free_port, process_gone

RUNS = int(os.environ.get("SHMDIST_KILL_RUNS", "6"))
RANKS = 3

RANK = """
    import os, sys
    stage = open(sys.argv[1] + f".{os.environ['RANK']}", "w", buffering=1)
    stage.write("start\\n")
    import numpy as np
    import shmdist as dist
    stage.write("init\\n")
    dist.init_process_group(timeout=30)
    stage.write("groups\\n")
    t = np.ones(1024)
    for i in range(3000):         # killed long before the end
        g = dist.new_group([0, 1] if i % 2 else None)
        if dist.get_rank() in (0, 1) or not i % 2:
            dist.all_reduce(t, group=g)
        dist.destroy_process_group(g)
    stage.write("done\\n")
    dist.destroy_process_group()
"""


def _sleep_into_setup(rng, run: int, base: str) -> None:
    """Odd runs: a random instant from the start; even runs: a random
    instant within 0.4 s after every rank entered init_process_group, so
    that many kills land inside init and the first new_groups."""
    if run % 2:
        time.sleep(rng.uniform(0.2, 1.6))
        return
    deadline = time.monotonic() + 20
    while sum(s in ("init", "groups", "done") for s in _stages(base).split(",")) < RANKS \
            and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 0.4))


def _left_in_dev_shm(job: str) -> list[str]:
    return sorted(glob.glob(f"/dev/shm/*{job}*"))


def _wait_gone(pids, seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [p for p in pids if not process_gone(p)]
        if not alive:
            return []
        time.sleep(0.02)
    return [p for p in pids if not process_gone(p)]


def _stages(base: str) -> str:
    last = []
    for r in range(RANKS):
        try:
            with open(f"{base}.{r}") as f:
                lines = f.read().split()
            last.append(lines[-1] if lines else "-")
        except OSError:
            last.append("-")
    return ",".join(last)


def test_whole_job_sigkill_at_random_instants_leaves_nothing(tmp_path, no_leaks):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK))
    rng = random.Random(os.environ.get("SHMDIST_KILL_SEED", "13"))
    where = collections.Counter()
    leaks = []
    for run in range(RUNS):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   WORLD_SIZE=str(RANKS), SHMDIST_JOB_ID=f"{no_leaks}k{run}")
        base = str(tmp_path / f"stage{run}")
        procs = []
        first = None
        for r in range(RANKS):
            p = subprocess.Popen([sys.executable, str(script), base], env=dict(env, RANK=str(r)),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 process_group=first or 0)
            first = first or p.pid
            procs.append(p)
        _sleep_into_setup(rng, run, base)
        stages = _stages(base)
        os.killpg(first, signal.SIGKILL)
        for p in procs:
            p.wait(30)
        where[stages] += 1
        left = _left_in_dev_shm(env["SHMDIST_JOB_ID"])
        if left:
            leaks.append((run, stages, left))
            for path in left:
                os.unlink(path)
    print(f"\nKILL MATRIX whole job: {RUNS} runs, {len(leaks)} leaked; stages at the kill: "
          + ", ".join(f"{k}: {n}" for k, n in sorted(where.items())))
    assert leaks == [], f"{len(leaks)} of {RUNS} whole-job kills left shared memory: {leaks}"


def test_sigkill_to_the_launcher_leaves_nothing(tmp_path, no_leaks):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK))
    rng = random.Random(os.environ.get("SHMDIST_KILL_SEED", "31"))
    where = collections.Counter()
    leaks, survivors = [], []
    for run in range(RUNS):
        base = str(tmp_path / f"stage{run}")
        launcher = subprocess.Popen([sys.executable, "-m", "shmdist.run", "--master-port", str(free_port()),
                                     "-n", str(RANKS), str(script), base],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    env=dict(os.environ, SHMDIST_JOB_ID=f"{no_leaks}l{run}"))
        _sleep_into_setup(rng, run, base)
        ranks = _children(launcher.pid)
        stages = _stages(base)
        launcher.kill()
        launcher.wait(30)
        where[stages] += 1
        alive = _wait_gone(ranks)
        if alive:
            survivors.append((run, alive))
            for pid in alive:
                os.kill(pid, signal.SIGKILL)
            _wait_gone(alive)
        # the launcher's job id nests the test's: every name it could make contains ours
        left = _left_in_dev_shm(f"{no_leaks}l{run}")
        if left:
            leaks.append((run, stages, left))
            for path in left:
                os.unlink(path)
    print(f"\nKILL MATRIX launcher: {RUNS} runs, {len(leaks)} leaked, {len(survivors)} with surviving ranks; "
          "stages at the kill: " + ", ".join(f"{k}: {n}" for k, n in sorted(where.items())))
    assert survivors == [], f"ranks outlived their launcher: {survivors}"
    assert leaks == [], f"{len(leaks)} of {RUNS} launcher kills left shared memory: {leaks}"


def _children(ppid: int) -> list[int]:
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[1] == str(ppid):
            found.append(int(stat.split("/")[2]))
    return found

"""torch's own distributed test base (DistributedTest._DistTestBase) on the "shm" backend.

tests/torch_suite_driver.py drives torch's file as torch's
test_distributed_spawn.py does; this module runs it in a subprocess and
reads the outcome of each test.

By default (CI), a subset of 3 ranks: the 20 tests below, chosen to cover
every kind of call torch's file makes on a CPU backend in a few minutes on
two cores (each test spawns 3 fresh interpreters that import torch): point
to point (blocking, async, tagged, from any source, batched), each
collective (whole group, a subgroup, coalesced), object collectives,
timeouts (the group's, and a per-call one), and DDP. torch's file runs with SHMDIST_SUITE_GATES=gloo (it reads
BACKEND "gloo" while the ranks run on shm): these are tests gloo runs, and
they must pass on shm as they do on gloo.

SHMDIST_TORCH_SUITE=full runs the whole file with gloo and with shm (gloo's
skip conditions) at each of SHMDIST_TORCH_SUITE_RANKS ranks (default "2,3";
hours on two shared cores), prints the pass/fail/skip counts of both, and
fails when a test gloo passes does not pass on shm, outside EXCEPTIONS.
Every test has torch's own time limit (DISTRIBUTED_TESTS_DEFAULT_TIMEOUT,
120 s here). With SHMDIST_SUITE_START=forkserver (what the counts in README
were measured with) the ranks of each test are forked from one server that
imported torch once, instead of being spawned; tests/torch_suite_driver.py
says what that changes (nothing a test can see but its start-up time).
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed: the torch backend is not tested")
pytest.importorskip("torch.distributed", reason="this torch has no torch.distributed")
pytest.importorskip("expecttest", reason="torch's test base needs expecttest (pip install expecttest)")

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "torch_suite_driver.py"

# Tests gloo passes on CPU and shm does not, each with its reason (README lists them).
EXCEPTIONS = {
    # torch.distributed.monitored_barrier raises "monitored_barrier is only implemented for GLOO
    # backend" for any other backend (test_monitored_barrier_gloo_rank_0_timeout, which calls the
    # group's own method, passes on shm)
    "test_monitored_barrier_gloo": "monitored_barrier is gloo's only (torch refuses other backends)",
    "test_monitored_barrier_gloo_subgroup": "monitored_barrier is gloo's only",
    "test_monitored_barrier_wait_all_ranks": "monitored_barrier is gloo's only",
    "test_monitored_barrier_failure_order": "monitored_barrier is gloo's only",
    "test_monitored_barrier_allreduce_hang": "monitored_barrier is gloo's only",
    "test_monitored_barrier_allreduce_hang_wait_all_ranks": "monitored_barrier is gloo's only",
    # shm moves dense (strided) tensors; a sparse one is refused with an error naming its layout
    "test_sparse_all_reduce_sum": "sparse tensors are not supported",
}

# Tests that, with SHMDIST_SUITE_GATES=gloo, compare the backend's name with the name torch's file
# reads ("gloo" in that mode): not a difference of behaviour. The full run runs them again with
# torch's file reading "shm", where they must pass.
GATES_ARTEFACTS = {
    "test_get_backend": "asserts dist.get_backend() == BACKEND, and BACKEND reads 'gloo' in this mode",
}

SUBSET = [
    # point to point
    "test_send_recv", "test_send_recv_any_source", "test_isend", "test_irecv",
    "test_send_recv_with_tag", "test_batch_isend_irecv_gloo_tags",
    # collectives on the whole group, and on a subgroup of every rank (torch's tests of
    # smaller subgroups need 8 ranks)
    "test_broadcast", "test_reduce_sum", "test_all_reduce_full_group_min",
    "test_all_reduce_coalesced_full_group_max", "test_all_gather", "test_all_gather_coalesced_full_group",
    "test_gather_full_group", "test_scatter", "test_barrier_full_group",
    # objects, timeouts, DDP
    "test_all_gather_object_subgroup", "test_scatter_object_list",
    "test_barrier_timeout_full_group", "test_DistributedDataParallelCPU",
    # a per-call timeout of 0 on the group's own monitored_barrier, with gloo's wording
    "test_monitored_barrier_gloo_rank_0_timeout",
]


def run_driver(backend: str, world_size: int, tests: list[str] | None, timeout: float,
               gates: str = "gloo") -> dict:
    """Run torch's tests on ``backend``; {name: [outcome, seconds, detail]}."""
    job = f"torchsuite{os.getpid()}{backend}"
    env = dict(os.environ, BACKEND=backend, SHMDIST_SUITE_BACKEND=backend, WORLD_SIZE=str(world_size),
               SHMDIST_SUITE_GATES=gates,
               SHMDIST_JOB_ID=job, DISTRIBUTED_TESTS_DEFAULT_TIMEOUT="120",
               PYTORCH_PRINT_REPRO_ON_FAILURE="0", PYTHONPATH=os.pathsep.join(
                   p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p))
    env.pop("TEMP_DIR", None)
    names = [f"TestDistBackendWithSpawn.{t}" for t in tests or []]
    done = subprocess.run([sys.executable, str(DRIVER), *names], env=env, cwd=HERE.parent,
                          capture_output=True, text=True, timeout=timeout)
    left = glob.glob(f"/dev/shm/shmdist-{job}-*")
    for path in left:
        os.unlink(path)
    assert not left, f"torch's tests on {backend} left shared memory behind: {left}"
    summary = [line for line in done.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert summary, f"the driver ({backend}) printed no summary (exit {done.returncode}):\n{done.stderr[-5000:]}"
    return json.loads(summary[-1][len("SUMMARY "):])["outcomes"]


@pytest.fixture(scope="module")
def subset():
    return run_driver("shm", 3, SUBSET, timeout=900)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", SUBSET)
def test_torch_test_base_subset(subset, name):
    outcome, seconds, detail = subset[name]
    assert outcome == "passed", f"torch's {name} on shm (3 ranks) {outcome}: {detail}"


@pytest.mark.skipif(os.environ.get("SHMDIST_TORCH_SUITE") != "full",
                    reason="the whole of torch's test base takes hours: SHMDIST_TORCH_SUITE=full")
@pytest.mark.timeout(16 * 3600)
def test_torch_test_base_full():
    behind = {}
    for ranks in (int(r) for r in os.environ.get("SHMDIST_TORCH_SUITE_RANKS", "2,3").split(",")):
        gloo = run_driver("gloo", ranks, None, timeout=4 * 3600)
        shm = run_driver("shm", ranks, None, timeout=4 * 3600)
        for backend, outcomes in (("gloo", gloo), ("shm", shm)):
            print(f"{backend}, {ranks} ranks: {dict(Counter(v[0] for v in outcomes.values()))}")
        artefacts = [n for n in GATES_ARTEFACTS if gloo.get(n, [""])[0] == "passed"]
        if artefacts:                               # with torch's file reading "shm"
            shm.update(run_driver("shm", ranks, artefacts, timeout=1800, gates="shm"))
        behind.update({f"{name} ({ranks} ranks)": shm.get(name, ["missing", 0, ""])
                       for name, (outcome, _, _) in gloo.items()
                       if outcome == "passed" and shm.get(name, [""])[0] != "passed" and name not in EXCEPTIONS})
    assert not behind, "tests gloo passes and shm does not:\n" + "\n".join(
        f"{name}: {outcome} {detail[-1500:]}" for name, (outcome, _, detail) in behind.items())

"""init_process_group() with no arguments under torchrun, mpirun/mpiexec
(Open MPI, MPICH) and srun: which launcher's variables are read, which win
when several are set, and where the master comes from (shmdist/rendezvous/launchers.py).
Real runs under MPICH's and Open MPI's mpiexec where they are installed;
srun by its environment, on pretend hosts."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import hosts
import shmdist as dist
from shmdist.rendezvous import launchers
from shmdist.errors import DistError

HERE = os.path.dirname(os.path.abspath(__file__))
OMPI = "OMPI_COMM_WORLD_"
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.213.0.1", "MASTER_PORT": "29500"}
OPENMPI = {OMPI + "RANK": "2", OMPI + "SIZE": "6", OMPI + "LOCAL_RANK": "0", OMPI + "LOCAL_SIZE": "3",
           "PMIX_NAMESPACE": "prterun-x-1@1"}
MPICH = {"PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "8"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "12", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "77",
         "SLURM_STEP_ID": "0", "SLURM_NODELIST": "gpu[07-09],login1"}


@pytest.mark.parametrize("present, source, rank, size", [
    ({**SLURM}, "slurm", 5, 12),
    ({**SLURM, **MPICH}, "mpich", 3, 8),
    ({**SLURM, **MPICH, **OPENMPI}, "openmpi", 2, 6),
    ({**SLURM, **MPICH, **OPENMPI, **TORCHRUN}, "torchrun", 1, 4),
])
def test_which_launcher_wins(present, source, rank, size):
    """torchrun's RANK/WORLD_SIZE, then Open MPI, then MPICH/Hydra's PMI_*, then Slurm."""
    got = launchers.detect(present)
    assert (got.source, got.rank, got.world_size) == (source, rank, size)


def test_explicit_arguments_override_the_launcher(monkeypatch):
    for k, v in OPENMPI.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1234")
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    launch, env = launchers.resolve(0, 2)
    assert (launch.source, env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("openmpi", 0, 2, 1234)


def test_slurm_master_is_the_first_node_and_a_port_from_the_job():
    got = launchers.detect(SLURM)
    assert got.master_addr == "gpu07" and got.master_from == "SLURM_NODELIST"
    assert got.master_port == launchers.detect(dict(SLURM, SLURM_PROCID="0")).master_port
    assert launchers.PORT_BASE <= got.master_port < launchers.PORT_BASE + launchers.PORT_SPAN
    assert got.master_port != launchers.detect(dict(SLURM, SLURM_JOB_ID="78")).master_port
    assert launchers.detect(dict(SLURM, MASTER_ADDR="h", MASTER_PORT="5")).master_addr == "h"


def test_expand_nodelist():
    assert launchers.expand_nodelist("gpu[07-09,12],login1,x[1-2]y") == \
        ["gpu07", "gpu08", "gpu09", "gpu12", "login1", "x1y", "x2y"]
    assert launchers.expand_nodelist("10.213.0.1") == ["10.213.0.1"]


def test_mpi_on_one_host_needs_no_master(monkeypatch):
    got = launchers.detect({**MPICH, "MPI_LOCALNRANKS": "8"})
    assert got.master_addr == "127.0.0.1" and got.master_port > 0


def test_mpi_on_several_hosts_without_master_says_what_to_do(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {**OPENMPI}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setitem(sys.modules, "mpi4py", None)     # as if mpi4py were not installed
    with pytest.raises(DistError, match="MASTER_ADDR expected.*under openmpi with ranks on several hosts, "
                                        "set MASTER_ADDR"):
        dist.init_process_group()


# ---------------------------------------------------------------- real launchers

def _mpiexec(which: str) -> list | None:
    if which == "mpich":
        exe = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        ok = os.path.exists(exe) and os.path.exists(os.path.join(os.path.dirname(sys.executable), "mpichversion"))
        return [exe] if ok else None
    exe = "/tmp/venv-ompi/bin/mpiexec"
    exe = exe if os.path.exists(exe) else shutil.which("ompi_info") and shutil.which("mpiexec")
    return [exe, "--allow-run-as-root", "--oversubscribe"] if exe else None


def _run_mpi(argv: list, timeout: float = 120) -> list:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         cwd=HERE, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)     # the launcher and the ranks it started
        p.communicate()
        raise
    assert p.returncode == 0, f"{argv} failed ({p.returncode}):\n{out}\n{err}"
    # ranks share the launcher's stdout: two lines may arrive run together
    return sorted((json.loads(obj) for obj in re.findall(r"\{[^{}]*\}", out)),
                  key=lambda d: d["rank"])


@pytest.mark.parametrize("which", ["mpich", "openmpi"])
def test_init_with_no_arguments_under_mpiexec(which):
    launcher = _mpiexec(which)
    if not launcher:
        pytest.skip(f"{which}'s mpiexec is not installed")
    got = _run_mpi([*launcher, "-n", "4", sys.executable, os.path.join(HERE, "mpi_rank.py")])
    assert [g["rank"] for g in got] == [0, 1, 2, 3]
    for g in got:
        assert (g["size"], g["source"], g["sum"], g["left"]) == (4, which, 10, (g["rank"] - 1) % 4)
    # Open MPI may number the local ranks in another order than the global ones
    assert sorted(g["local_rank"] for g in got) == [0, 1, 2, 3]


def test_master_sent_by_mpi4py_under_mpich():
    """Ranks on several hosts without MASTER_ADDR: rank 0's address and a free port, sent by MPI."""
    launcher = _mpiexec("mpich")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        mpi4py = None
    if not launcher or mpi4py is None:
        pytest.skip("needs MPICH's mpiexec and mpi4py")
    got = _run_mpi([*launcher, "-n", "3", sys.executable, os.path.join(HERE, "mpi_rank.py"), "--mpi4py-master"])
    masters = {tuple(g["master"]) for g in got}
    assert len(got) == 3 and all(g["ok"] for g in got) and len(masters) == 1
    addr, port = masters.pop()
    assert addr and port > 0


# ---------------------------------------------------------------- srun, by its environment

def _as_srun(rank, world_size, init_method, nodelist):
    local = rank % 2
    os.environ.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world_size), SLURM_LOCALID=str(local),
                      SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_NODELIST=nodelist)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    dist.init_process_group()
    t = np.full(3, rank + 1, dtype=np.float64)
    dist.all_reduce(t)
    got = (dist.get_rank(), dist.get_world_size(), float(t[0]), list(dist.api.group.world().nodes))
    dist.destroy_process_group()
    return got


@pytest.mark.skipif(bool(hosts.unavailable()), reason=hosts.unavailable() or "")
def test_init_with_no_arguments_under_srun_on_pretend_hosts(run_ranks, monkeypatch):
    """srun's variables (SLURM_PROCID/NTASKS/LOCALID/NODELIST/JOB_ID) on 2 pretend hosts x 2 ranks:
    the master is the first node of the list, the port comes from the job id."""
    monkeypatch.delenv("SHMDIST_HOST_ID", raising=False)
    with hosts.PretendHosts(2) as h:
        got = run_ranks(hosts.in_host, 4, h.pids, (0, 0, 1, 1), _as_srun, f"{h.addresses[0]},{h.addresses[1]}",
                        timeout=120)
    assert [g[:3] for g in got] == [(r, 4, 10.0) for r in range(4)]
    nodes = got[0][3]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]

"""The collective and point-to-point suites on 2 pretend hosts x 2 ranks
(tests/hosts.py), once per inter-host engine (shmdist/comm/inter.py): gloo
(with torch), MPI (under MPICH's mpiexec, hosts pretended with
SHMDIST_HOST_ID, since mpiexec cannot start ranks inside our namespaces),
and our TCP transport. A host whose cable is pulled mid-collective:
every rank raises, naming the host it lost, within the timeout."""
from __future__ import annotations

import importlib.util
import os
import sys
import time

import numpy as np
import pytest

import hosts
import shmdist as dist
from hosts import in_host, master_url
from test_collectives import MOVEMENTS, REDUCTIONS, assert_all_good, make_cases, run_cases
from test_tcp import expected_p2p, p2p_cases

WHY = hosts.unavailable()
HAVE_TORCH = importlib.util.find_spec("torch") is not None
ENGINES = ["tcp", pytest.param("gloo", marks=pytest.mark.skipif(not HAVE_TORCH, reason="gloo needs torch"))]
BLOCKS, INTERLEAVED = (0, 0, 1, 1), (0, 1, 0, 1)
CASES = make_cases(REDUCTIONS, [1, 1023]) + make_cases(MOVEMENTS, [1, 1023], first_seed=1000)


@pytest.fixture
def pretend_hosts(monkeypatch):
    if WHY:
        pytest.skip(WHY)
    for var in ("SHMDIST_HOST_ID", "SHMDIST_TCP_ADDR", "SHMDIST_INTER", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with hosts.PretendHosts(2) as h:
        yield h


def _with_engine(rank, world_size, init_method, engine, target, *args):
    os.environ["SHMDIST_INTER"] = engine
    result = target(rank, world_size, init_method, *args)
    from shmdist.comm import inter
    return {"result": result, "chosen": inter.chosen(), "carried": dict(inter.carried)}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("layout", [BLOCKS, INTERLEAVED], ids=["blocks", "interleaved"])
def test_collectives_on_pretend_hosts(run_ranks, pretend_hosts, engine, layout):
    h = pretend_hosts
    got = run_ranks(in_host, 4, h.pids, layout, _with_engine, engine, run_cases, CASES, timeout=300,
                    init_method=master_url(h))
    assert {g["chosen"] for g in got} == {engine}
    moved = [got[r]["carried"]["bytes"] > 0 for r in range(4)]
    # the engine carried every lane's leg (leaders', and gather/scatter/all_to_all's rank to rank i of the other host)
    assert moved == [engine != "tcp"] * 4
    assert_all_good([g["result"] for g in got])


@pytest.mark.parametrize("engine", ENGINES)
def test_point_to_point_on_pretend_hosts(run_ranks, pretend_hosts, engine):
    h = pretend_hosts
    got = run_ranks(in_host, 4, h.pids, INTERLEAVED, _with_engine, engine, p2p_cases, "shm", timeout=180,
                    init_method=master_url(h))
    assert [g["result"] for g in got] == [expected_p2p(r, 4) for r in range(4)]


def test_auto_engine_is_gloo_with_torch_outside_mpi(monkeypatch):
    """auto: MPI under an MPI launcher (with mpi4py), else gloo with torch and backend shm, else tcp."""
    from shmdist.comm import inter
    for k in ("SHMDIST_INTER", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    assert inter.choose() == ("gloo" if HAVE_TORCH else "tcp")
    assert inter.choose("tcp") == "tcp"
    monkeypatch.setenv("SHMDIST_TRANSPORT", "tcp")
    assert inter.choose() == "tcp"
    monkeypatch.delenv("SHMDIST_TRANSPORT")
    monkeypatch.setattr(inter, "_importable", lambda name: False)
    assert inter.choose() == "tcp"
    monkeypatch.undo()
    for k in ("SHMDIST_INTER", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SHMDIST_INTER", "GLOO")
    assert inter.choose() == "gloo"
    monkeypatch.delenv("SHMDIST_INTER")
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    # under an MPI launcher without mpi4py, the same choice as outside MPI
    assert inter.choose() == ("mpi" if importlib.util.find_spec("mpi4py") else "gloo" if HAVE_TORCH else "tcp")
    monkeypatch.setenv("SHMDIST_INTER", "carrier-pigeon")
    with pytest.raises(dist.DistError, match="SHMDIST_INTER='carrier-pigeon': expected one of auto, gloo, mpi, tcp"):
        inter.choose()


# ---------------------------------------------------------------- a pulled cable

def _all_reduce_until_cut(rank, world_size, init_method, engine, ready_path):
    os.environ["SHMDIST_INTER"] = engine
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=20)
    t = np.ones(1 << 18, dtype=np.float32)
    dist.all_reduce(t)                       # the engine is up
    if rank == 0:
        open(ready_path, "w").close()
    start = time.monotonic()
    try:
        for _ in range(100000):
            dist.all_reduce(t)
            time.sleep(0.01)
        return {"error": None}
    except dist.DistError as e:
        return {"error": f"{type(e).__name__}: {e}", "after": time.monotonic() - start}
    finally:
        try:
            dist.destroy_process_group()
        except Exception:   # noqa: BLE001
            pass


@pytest.mark.parametrize("engine", ENGINES)
def test_a_host_whose_link_goes_down_is_named_by_every_rank(run_ranks, pretend_hosts, engine, tmp_path):
    h = pretend_hosts
    ready = tmp_path / "ready"
    import threading

    def cut():
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        h.link(1, up=False)

    cutter = threading.Thread(target=cut)
    cutter.start()
    try:
        got = run_ranks(in_host, 4, h.pids, BLOCKS, _all_reduce_until_cut, engine, str(ready), timeout=120,
                        errors="return", init_method=master_url(h))
    finally:
        cutter.join()
    for rank, g in enumerate(got):
        assert isinstance(g, dict), f"rank {rank}: {g!r}"
        assert g["error"], f"rank {rank} never noticed"
        print(f"rank {rank} after {g['after']:.1f} s: {g['error']}")
        other = h.hostnames[1 - BLOCKS[rank]]
        assert f"host {other} (ranks {[r for r in range(4) if BLOCKS[r] != BLOCKS[rank]]})" in g["error"], g["error"]


@pytest.mark.parametrize("which", ["mpich", "openmpi"])
def test_collectives_with_the_mpi_engine_under_mpiexec(which, tmp_path):
    """SHMDIST_INTER=mpi under a real mpiexec: 2 pretend hosts (SHMDIST_HOST_ID) x 2 ranks."""
    from test_hosts_launchers import _mpiexec, _run_mpi
    launcher = _mpiexec(which)
    if not launcher or importlib.util.find_spec("mpi4py") is None:
        pytest.skip(f"needs {which}'s mpiexec and mpi4py")
    if which == "openmpi":
        pytest.skip("this venv's mpi4py is built for MPICH; Open MPI runs the launcher test only")
    here = os.path.dirname(os.path.abspath(__file__))
    env_flag = ["-genv", "SHMDIST_INTER", "mpi"]
    _run_mpi([*launcher, *env_flag, "-n", "4", sys.executable, os.path.join(here, "mpi_rank.py"),
              "--collectives", str(tmp_path)], timeout=300)
    import json
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    assert [g["rank"] for g in got] == [0, 1, 2, 3]
    assert {g["chosen"] for g in got} == {"mpi"}
    assert all(g["carried"]["bytes"] > 0 for g in got)    # every lane: leaders, and rank to rank i of the other host
    assert_all_good(got)


class _Stub:
    """Just what inter.for_comm reads of a HierComm, over a dict store."""

    def __init__(self):
        data = {}
        store = type("S", (), {"set": lambda s, k, v: data.__setitem__(k, v),
                               "get": lambda s, k, t=None: data[k]})()
        self.rank, self.world = 0, type("W", (), {"store": store, "timeout": 5})()
        self.group = type("G", (), {"ranks": (0,)})()


def test_the_chosen_engine_is_logged(monkeypatch, caplog):
    from shmdist.comm import inter
    monkeypatch.setattr(inter, "_chosen", "")
    monkeypatch.setenv("SHMDIST_INTER", "tcp")
    with caplog.at_level("INFO", logger="shmdist"):
        assert inter.for_comm(_Stub()) is None          # tcp: the point-to-point engine carries all
    assert "inter-host engine: tcp (SHMDIST_INTER=tcp)" in caplog.text
    assert inter.chosen() == "tcp"


# ---------------------------------------------------------------- MPI across pretend hosts

def _mpich_across(h, tmp_path, n: int, ppn: int) -> list:
    from test_hosts_launchers import _mpiexec
    launcher = _mpiexec("mpich")
    if not launcher or importlib.util.find_spec("mpi4py") is None:
        pytest.skip("needs MPICH's mpiexec and mpi4py")
    # MPICH here is ch4:ucx, and UCX reaches the other pretend host through shared memory and
    # process_vm_readv (the pretend hosts share the PID and IPC namespaces, one kernel): a pulled
    # cable cut nothing, every all_reduce kept completing. Only TCP, as between real hosts:
    return [*h.mpiexec(launcher[0], n, ppn, str(tmp_path)), "-genv", "UCX_TLS", "tcp,self"]


def test_mpi_engine_under_mpiexec_across_pretend_hosts(pretend_hosts, tmp_path):
    """MPICH's mpiexec starts 2 ranks in each pretend host (tests/hosts.py:
    Hydra's ssh bootstrap through nsenter); no SHMDIST_HOST_ID, no
    MASTER_ADDR: the hosts are told apart by their namespaces, the master
    comes through mpi4py, the leg between hosts on MPI, chosen automatically."""
    from test_hosts_launchers import _run_mpi
    h = pretend_hosts
    here = os.path.dirname(os.path.abspath(__file__))
    argv = _mpich_across(h, tmp_path, 4, 2)
    _run_mpi([*argv, sys.executable, os.path.join(here, "mpi_rank.py"), "--collectives", str(tmp_path),
              "--pretend-hosts"], timeout=400)
    import json
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    assert {g["chosen"] for g in got} == {"mpi"}
    assert all(g["carried"]["bytes"] > 0 for g in got)
    assert_all_good(got)


def test_mpi_job_whose_link_goes_down_ends(pretend_hosts, tmp_path):
    """A pulled cable under mpiexec: every rank raises naming the other host
    within its timeout, and the job ends by itself (MPI_Abort at exit, inter.py)."""
    import json
    import subprocess
    h = pretend_hosts
    here = os.path.dirname(os.path.abspath(__file__))
    argv = _mpich_across(h, tmp_path, 4, 2)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.Popen([*argv, sys.executable, os.path.join(here, "mpi_rank.py"), "--until-cut",
                          str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=here,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{r}").exists() for r in range(4)):
            assert p.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.1)
        time.sleep(0.3)
        h.link(1, up=False)
        out, _ = p.communicate(timeout=120)     # ends by itself: 20 s timeout, reports, MPI_Abort
    except BaseException:
        os.killpg(p.pid, 9)
        print(p.communicate()[0][-6000:])
        raise
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    for rank, g in enumerate(got):
        print(f"rank {rank} after {g['after']:.1f} s: {g['error']}")
        assert g["chosen"] == "mpi"
        assert g["error"], f"rank {rank} never noticed"
        other = h.hostnames[1 - BLOCKS[rank]]
        assert f"host {other} (ranks {[r for r in range(4) if BLOCKS[r] != BLOCKS[rank]]})" in g["error"], g["error"]
    assert p.returncode != 0 and "MPI_Abort" in out, out[-2000:]

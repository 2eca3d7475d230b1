"""Shared fixtures of the test suite.

``run_ranks``  runs a module-level function as N ranks in real processes and
               returns what each returned (see tests/ranks.py for the details).

``transport``  runs a test over shared memory and over TCP (SHMDIST_TRANSPORT=tcp).

``no_fast_paths``  turns every fast path off (SHMDIST_FAST=0), in the ranks too.

``p2p_choose_off``  single copies wherever the rule allows them (SHMDIST_P2P_CHOOSE=0).

``--torch-parts``  runs only the tests whose outcome can depend on torch being
               installed: the torch modules, the pretend hosts (gloo is the leg
               between hosts with torch), every TCP-transport case (each rank its own
               host, so the same), and any test whose code names torch, gloo or DDP.
               CI's second step uses it: the first ran everything without torch.

``no_leaks``   (autouse) gives every test its own SHMDIST_JOB_ID. Segments
               have no name (memfd), so nothing of a test should ever appear
               under /dev/shm; as a belt, after the test it fails the test if
               a /dev/shm/shmdist-<job>-* entry exists (what older, named
               segments were called), or if a child process of this process
               is still alive; it removes what it found, so that one leak
               does not fail the next tests.
"""
from __future__ import annotations

import glob
import itertools
import multiprocessing.resource_tracker
import os
import signal

import inspect
import re

import pytest

import ranks

_TORCH_WORDS = re.compile(r"torch|gloo|ddp|DDP")
_TORCH_MODULES = ("test_torch", "test_hosts", "test_promises_torch", "test_bench_smoke", "test_examples")


def pytest_addoption(parser):
    parser.addoption("--torch-parts", action="store_true",
                     help="only the tests whose outcome can depend on torch being installed")


def _torch_part(item) -> bool:
    if item.path.name.startswith(_TORCH_MODULES):
        return True
    spec = getattr(item, "callspec", None)
    if spec is not None and spec.params.get("transport") == "tcp":
        return True
    if _TORCH_WORDS.search(item.name):
        return True
    try:
        return bool(_TORCH_WORDS.search(inspect.getsource(item.function)))
    except (OSError, TypeError):
        return True


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--torch-parts"):
        return
    keep = [i for i in items if _torch_part(i)]
    config.hook.pytest_deselected(items=[i for i in items if not _torch_part(i)])
    items[:] = keep

_test_number = itertools.count()


@pytest.fixture(params=["shm", "tcp"])
def transport(request, monkeypatch):
    """The transport the ranks of the test use: shared memory, or TCP
    (SHMDIST_TRANSPORT=tcp: every rank its own node, so every byte and every
    collective goes over sockets and the hierarchical engine). A test that
    uses it runs once per transport; ``indirect`` parametrization picks one."""
    if request.param == "tcp":
        monkeypatch.setenv("SHMDIST_TRANSPORT", "tcp")
    else:
        monkeypatch.delenv("SHMDIST_TRANSPORT", raising=False)
    return request.param


@pytest.fixture
def no_fast_paths(monkeypatch):
    """Every fast path off (shmdist/api/fast.py: the lane, the one-call barrier and
    all_reduce, the C rounds), here and in the ranks this test spawns."""
    from shmdist.api import fast
    monkeypatch.setenv("SHMDIST_FAST", "0")
    monkeypatch.setattr(fast.paths, "enabled", False)


@pytest.fixture
def p2p_choose_off(monkeypatch):
    """Senders always take single copies where the rule allows them, without timing
    the ring against them (SHMDIST_P2P_CHOOSE=0, transport/ways.py), here and in the
    ranks: for the tests that count single copies."""
    monkeypatch.setenv("SHMDIST_P2P_CHOOSE", "0")


@pytest.fixture
def run_ranks():
    """``run_ranks(target, world_size, *args, timeout=60, env=None, errors="raise")``"""
    return ranks.run_ranks


def _children() -> set[int]:
    """Pids of the live (not zombie) child processes of this process."""
    me = str(os.getpid())
    found = set()
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue     # exited while we looked
        state, ppid = fields[0], fields[1]
        if ppid == me and state not in ("Z", "X"):
            found.add(int(stat.split("/")[2]))
    return found


def _resource_tracker() -> set[int]:
    """multiprocessing's helper process: started once, on purpose, and kept for the session."""
    pid = getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)
    return {pid} if pid else set()


@pytest.fixture(autouse=True)
def no_leaks(monkeypatch):
    job = f"pytest{os.getpid()}t{next(_test_number)}"
    monkeypatch.setenv("SHMDIST_JOB_ID", job)
    before = _children()
    yield job
    problems = []
    stray = _children() - before - _resource_tracker()
    if stray:
        problems.append(f"child processes {sorted(stray)} are still alive (killed now)")
        for pid in stray:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    segments = sorted(glob.glob(f"/dev/shm/shmdist-{job}-*"))
    if segments:
        problems.append(f"shared memory {segments} was left behind (removed now)")
        for path in segments:
            os.unlink(path)
    if problems:
        pytest.fail("the test leaked: " + "; ".join(problems) + ". Every rank must exit and every "
                    "segment must be unlinked, even when a test fails", pytrace=False)

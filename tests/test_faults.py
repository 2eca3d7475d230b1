"""Fault injection: one rank is SIGKILLed at each phase of a job.

For every phase (rendezvous, mapping shared memory, mid-send and mid-recv of
a large message, an any-source receive, inside each collective, during
destroy) and for 2, 3 and 4 ranks, one rank (the victim) dies by SIGKILL and
the test checks that

- every survivor either raises a shmdist error naming the dead rank and the
  operation it was in, within a bound (the issue asks for 2 s; the tests
  assert < MAX_DETECT_S because the CI host is shared, and print the real
  figures: run with ``-s`` to see them), or finishes cleanly when the dead
  rank's part was already done;
- no survivor hangs (every run has a timeout);
- nothing is left in /dev/shm (segments have no name; the autouse ``no_leaks`` fixture checks).

The victim kills itself at a precise point by wrapping one internal
function in its own process only (no test hook exists in the library):
``segment.create``/``segment.attach`` (mapping), ``Engine.progress`` (part of
a message moved), ``GroupComm._pass`` (the k-th phase of a collective),
``ShmHost.close`` (destroy). The victim writes the time of its death to a
file first, so that survivors' detection times are measured from it.

The launcher half (``python -m shmdist.run``) checks that a rank killed
mid-collective makes the launcher exit non-zero naming it, and that SIGTERM
and SIGINT sent to the launcher while the ranks are inside collectives stop
every rank and leave nothing in /dev/shm.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import shmdist as dist
from ranks import RankError

MAX_DETECT_S = 5.0       # issue 6 asks for 2 s; generous because the CI host is shared
INIT_TIMEOUT_S = 4.0     # init timeout in the phases where no pid is known yet
RUN_TIMEOUT_S = 90       # per multi-process run: a hang fails the test
BIG = 24 << 20           # bytes of the "large" p2p message; the default ring is 1 MiB


# ---------------------------------------------------------------- helpers run inside the ranks

def _die(deathfile: str) -> None:
    """Record the time of death, then SIGKILL this process."""
    with open(deathfile, "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def _outcome(fn) -> dict:
    """Run ``fn`` and describe how it ended (time.time() so that ranks compare)."""
    try:
        fn()
    except dist.DistError as e:
        return {"end": "error", "type": type(e).__name__, "message": str(e), "at": time.time()}
    return {"end": "ok", "at": time.time()}


def _finish(result: dict) -> dict:
    """Leave the job; a survivor's destroy must not hang or raise."""
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


# ---------------------------------------------------------------- init: rendezvous and mapping

def dies_in_init(rank, world_size, init_method, phase, victim, deathfile):
    """The victim dies during init: after publishing its rendezvous record
    ("rendezvous"), or right after it created or mapped its first segment,
    before telling anyone ("mapping")."""
    from shmdist.rendezvous import store as rendezvous
    from shmdist.transport import segment
    if rank == victim and phase == "rendezvous":
        real_get = rendezvous.PrefixStore.get

        def get(self, key, timeout=None):
            if key.startswith("info/"):
                _die(deathfile)
            return real_get(self, key, timeout)
        rendezvous.PrefixStore.get = get
    if rank == victim and phase == "mapping":
        for name in ("create", "attach"):
            real = getattr(segment, name)

            def mapped_then_die(*a, _real=real, **k):
                _real(*a, **k)
                _die(deathfile)
            setattr(segment, name, mapped_then_die)
    result = _outcome(lambda: dist.init_process_group("shm", init_method, rank=rank, world_size=world_size,
                                                      timeout=INIT_TIMEOUT_S))
    return _finish(result)


def _survivors(results, victim, deathfile):
    """The victim's slot is a SIGKILL; returns (time of death, survivors' outcomes)."""
    dead = results[victim]
    assert isinstance(dead, RankError) and dead.exitcode == -signal.SIGKILL, \
        f"rank {victim} should have died by SIGKILL, got {dead!r}"
    with open(deathfile) as f:
        death = float(f.read())
    survivors = {r: res for r, res in enumerate(results) if r != victim}
    for r, res in survivors.items():
        assert not isinstance(res, RankError), f"survivor rank {r} failed outside shmdist: {res!r}\n" \
                                               f"{getattr(res, 'traceback', '')}"
    return death, survivors


def _report(case: str, death: float, survivors: dict) -> list[float]:
    times = [res["at"] - death for res in survivors.values()]
    ends = ", ".join(f"rank {r}: {res['end']}" + (f" ({res['type']})" if res["end"] == "error" else "")
                     + f" after {res['at'] - death:.3f} s" for r, res in survivors.items())
    print(f"\nFAULT {case}: {ends}")
    return times


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("victim", ["first", "last"])
def test_sigkill_during_rendezvous(run_ranks, tmp_path, no_leaks, world_size, victim):
    """No pid is known yet, so survivors end by the (short) init timeout, or at
    once when the victim is rank 0, which serves the store."""
    v = 0 if victim == "first" else world_size - 1
    death_file = str(tmp_path / "death")
    results = run_ranks(dies_in_init, world_size, "rendezvous", v, death_file, errors="return",
                        timeout=RUN_TIMEOUT_S)
    death, survivors = _survivors(results, v, death_file)
    times = _report(f"rendezvous n={world_size} victim={v}", death, survivors)
    for r, res in survivors.items():
        assert res["end"] == "error", f"rank {r} finished init although rank {v} died in it"
        assert res["type"] in ("DistTimeoutError", "DistPeerError"), res
        if v == 0:
            assert "rank 0" in res["message"], res["message"]    # it served the store
    assert max(times) < INIT_TIMEOUT_S + MAX_DETECT_S
    _assert_no_leak(f"rendezvous n={world_size} victim={v}", no_leaks)


def _assert_no_leak(case: str, job: str) -> None:
    """Segments have no name (memfd), so a rank that dies during init can
    leave nothing in /dev/shm: assert it (this once removed a known leak)."""
    left = glob.glob(f"/dev/shm/*{job}*")
    assert left == [], f"{case}: left behind {left}"


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("victim", ["creator", "last"])
def test_sigkill_while_mapping_shared_memory(run_ranks, tmp_path, no_leaks, world_size, victim):
    """The victim dies right after it created (rank 0) or mapped (the last rank)
    the host segment, before telling the store. file:// rendezvous, so that
    the store outlives every rank and the survivors see only the dead peer.

    Nothing is left in /dev/shm: the segment has no name."""
    v = 0 if victim == "creator" else world_size - 1
    death_file = str(tmp_path / "death")
    results = run_ranks(dies_in_init, world_size, "mapping", v, death_file, errors="return",
                        timeout=RUN_TIMEOUT_S, init_method=f"file://{tmp_path}/store")
    death, survivors = _survivors(results, v, death_file)
    times = _report(f"mapping n={world_size} victim={v}", death, survivors)
    for r, res in survivors.items():
        assert res["end"] == "error", f"rank {r} finished init although rank {v} died in it"
        assert res["type"] == "DistPeerError" and f"rank {v}" in res["message"], res
    assert max(times) < MAX_DETECT_S
    _assert_no_leak(f"mapping n={world_size} victim={v}", no_leaks)


def test_no_segment_left_when_the_creator_dies_while_mapping(run_ranks, tmp_path, no_leaks):
    death_file = str(tmp_path / "death")
    run_ranks(dies_in_init, 2, "mapping", 0, death_file, errors="return", timeout=RUN_TIMEOUT_S,
              init_method=f"file://{tmp_path}/store")
    assert glob.glob(f"/dev/shm/shmdist-{no_leaks}-*") == []


@pytest.mark.parametrize("phase, victim", [("rendezvous", 1), ("mapping", 1)],
                         ids=["rendezvous", "mapping-attacher"])
def test_no_segment_left_when_a_rank_dies_during_init(run_ranks, tmp_path, no_leaks, phase, victim):
    death_file = str(tmp_path / "death")
    run_ranks(dies_in_init, 2, phase, victim, death_file, errors="return", timeout=RUN_TIMEOUT_S,
              init_method=f"file://{tmp_path}/store")
    assert glob.glob(f"/dev/shm/*{no_leaks}*") == []


def test_a_rank_killed_while_mapping_is_named_within_the_bound(run_ranks, tmp_path):
    death_file = str(tmp_path / "death")
    results = run_ranks(dies_in_init_slowly, 2, death_file, errors="return", timeout=RUN_TIMEOUT_S,
                        init_method=f"file://{tmp_path}/store")
    assert glob.glob(f"/dev/shm/*{os.environ['SHMDIST_JOB_ID']}*") == []
    death, survivors = _survivors(results, 1, death_file)
    res = survivors[0]
    assert res["end"] == "error" and "rank 1" in res["message"], res
    assert res["at"] - death < MAX_DETECT_S


def dies_in_init_slowly(rank, world_size, init_method, deathfile):
    """As dies_in_init("mapping") with the attacher as victim, but a 15 s init timeout."""
    from shmdist.transport import segment
    if rank == 1:
        real = segment.attach

        def mapped_then_die(*a, **k):
            real(*a, **k)
            _die(deathfile)
        segment.attach = mapped_then_die
    result = _outcome(lambda: dist.init_process_group("shm", init_method, rank=rank, world_size=world_size,
                                                      timeout=15))
    return _finish(result)


# ---------------------------------------------------------------- point to point

def _wait_for(path: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


class _DyingChannel:
    """Wraps one ring of the victim: the victim dies when asked to push (or
    pull) more of a record of which more than ``limit`` bytes already moved.
    A push or pull streams for as long as the other side keeps up, so the
    tests make the partner hold still while the victim moves its first part."""

    def __init__(self, chan, limit: int, deathfile: str):
        self.chan, self.limit, self.deathfile = chan, limit, deathfile

    def push(self, header, addr, nbytes, pos):
        if pos > self.limit:
            _die(self.deathfile)
        return self.chan.push(header, addr, nbytes, pos)

    def pull(self, addr, nbytes, pos):
        if pos > self.limit:
            _die(self.deathfile)
        return self.chan.pull(addr, nbytes, pos)

    def __getattr__(self, name):
        return getattr(self.chan, name)


def dies_in_p2p(rank, world_size, init_method, phase, victim, deathfile):
    """The victim and its partner (the next rank) exchange one large message;
    the victim dies after part of it moved. The other survivors pair up and
    exchange among themselves, unaffected."""
    from shmdist.api import group
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    partner = (victim + 1) % world_size
    if rank == victim and phase in ("send", "recv"):
        engine = group._world.engine
        limit = dist.memory_usage()["ring_bytes_per_pair"] // 2
        if phase == "send":
            engine.chan_out[partner] = _DyingChannel(engine.chan_out[partner], limit, deathfile)
        else:
            engine.chan_in = [(src, _DyingChannel(chan, limit, deathfile) if src == partner else chan)
                              for src, chan in engine.chan_in]
    dist.barrier()
    big = np.full(BIG // 8, rank, dtype=np.int64)
    posted = deathfile + ".posted"
    if rank == victim:
        if phase == "send":
            req = dist.send(big, dst=partner)       # fills the ring; the rest waits
            open(posted, "w").close()
            req.wait()                              # the next push dies, the message half sent
        elif phase == "recv":
            _wait_for(posted)
            dist.recv(big, src=partner).wait()      # the second pull dies, the message half received
        else:   # "recv-any": the victim dies idle while the partner waits for anyone
            time.sleep(0.5)
            _die(deathfile)
        raise AssertionError("the victim outlived its phase")
    if rank == partner:
        if phase == "send":
            _wait_for(posted)
            result = _outcome(lambda: dist.recv(big, src=victim).wait())
        elif phase == "recv":
            req = dist.send(big, dst=victim)
            open(posted, "w").close()
            _wait_for(deathfile, 10)    # not streaming meanwhile, so the victim's pull stops mid-record
            result = _outcome(lambda: req.wait())
        else:
            result = _outcome(lambda: dist.recv(big[:1], src=None, tag=7).wait())
        open(deathfile + ".partner-done", "w").close()
        return _finish(result)
    others = [r for r in range(world_size) if r not in (victim, partner)]
    if len(others) >= 2 and rank in others[:2]:     # an unrelated pair keeps working
        peer = others[1] if rank == others[0] else others[0]
        box = np.zeros(BIG // 8, dtype=np.int64)
        reqs = [dist.send(big, dst=peer), dist.recv(box, src=peer)]

        def exchange():
            for req in reqs:
                req.wait()
            if not (box == peer).all():
                raise AssertionError(f"rank {rank} got corrupted data from rank {peer}")
        result = _outcome(exchange)
    else:
        result = {"end": "ok", "at": time.time()}
    if phase == "recv-any":
        # Stay until the partner is done, so that only the victim's death can end
        # its any-source receive (a rank that left is tested on its own below).
        deadline = time.monotonic() + 60
        while not os.path.exists(deathfile + ".partner-done") and time.monotonic() < deadline:
            time.sleep(0.05)
    return _finish(result)


def leaves_then_exits(rank, world_size, init_method, deathfile):
    """Rank 2 leaves cleanly (destroy) and exits while rank 0 waits in an
    any-source receive that rank 1 satisfies a second later."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    dist.barrier()
    box = np.zeros(1, dtype=np.int64)
    if rank == 0:
        return _finish(_outcome(lambda: dist.recv(box, src=None).wait()))
    if rank == 1:
        time.sleep(1.5)
        dist.send(np.array([1]), dst=0).wait()
    return _finish({"end": "ok", "at": time.time()})


def test_any_source_receive_survives_a_rank_that_left_and_exited(run_ranks, tmp_path):
    results = run_ranks(leaves_then_exits, 3, str(tmp_path / "x"), timeout=RUN_TIMEOUT_S)
    assert results[0]["end"] == "ok", results[0]


P2P_OPS = {"send": "recv from rank", "recv": "send to rank", "recv-any": "recv from any rank"}


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("phase", ["send", "recv", "recv-any"])
def test_sigkill_mid_p2p(run_ranks, tmp_path, no_leaks, world_size, phase):
    victim = world_size - 1
    partner = (victim + 1) % world_size
    death_file = str(tmp_path / "death")
    # Through the ring (SHMDIST_SINGLE_COPY=0): one way, a message bigger than the ring would
    # go as a single copy, whose deaths test_p2p_single_copy.py and test_p2p_help.py cover.
    results = run_ranks(dies_in_p2p, world_size, phase, victim, death_file, errors="return",
                        timeout=RUN_TIMEOUT_S, env={"SHMDIST_SINGLE_COPY": "0"})
    death, survivors = _survivors(results, victim, death_file)
    times = _report(f"p2p-{phase} n={world_size} victim={victim}", death, survivors)
    for r, res in survivors.items():
        if r == partner:
            assert res["end"] == "error" and res["type"] == "DistPeerError", res
            assert f"rank {r}: {P2P_OPS[phase]}" in res["message"], res["message"]
            assert f"rank {victim} died" in res["message"], res["message"]
            assert res["at"] - death < MAX_DETECT_S
        else:
            assert res["end"] == "ok", f"rank {r} is not involved with rank {victim} but got {res}"
    assert min(times) < MAX_DETECT_S
    assert glob.glob(f"/dev/shm/shmdist-{no_leaks}-*") == []


# ---------------------------------------------------------------- collectives

def _collective(name: str, rank: int, n: int, root: int):
    """Returns (call, check): run one collective; check its result afterwards."""
    if name == "barrier":
        return (lambda: dist.barrier()), (lambda: None)
    if name in ("all_reduce-small", "all_reduce-large"):
        count = 256 if name.endswith("small") else (16 << 20) // 4
        t = np.full(count, rank + 1, dtype=np.float32)

        def check():
            if not (t == n * (n + 1) / 2).all():
                raise AssertionError("all_reduce result is wrong")
        return (lambda: dist.all_reduce(t)), check
    if name == "reduce":
        t = np.full((8 << 20) // 8, rank + 1, dtype=np.int64)
        return (lambda: dist.reduce(t, dst=root)), (lambda: None)
    if name.startswith("broadcast"):
        t = np.full((8 << 20) // 4, rank, dtype=np.int32)
        return (lambda: dist.broadcast(t, src=root)), (lambda: None)
    if name == "all_gather":
        t = np.full((2 << 20) // 4, rank, dtype=np.int32)
        outs = [np.empty_like(t) for _ in range(n)]
        return (lambda: dist.all_gather(outs, t)), (lambda: None)
    if name == "gather":
        t = np.full((2 << 20) // 4, rank, dtype=np.int32)
        outs = [np.empty_like(t) for _ in range(n)] if rank == root else None
        return (lambda: dist.gather(t, outs, dst=root)), (lambda: None)
    if name.startswith("scatter"):
        t = np.empty((2 << 20) // 4, dtype=np.int32)
        ins = [np.full_like(t, j) for j in range(n)] if rank == root else None
        return (lambda: dist.scatter(t, ins, src=root)), (lambda: None)
    if name == "reduce_scatter":
        out = np.empty((2 << 20) // 4, dtype=np.float32)
        ins = [np.full_like(out, rank) for _ in range(n)]
        return (lambda: dist.reduce_scatter(out, ins)), (lambda: None)
    if name == "all_to_all":
        ins = [np.full((1 << 20) // 4, rank, dtype=np.int32) for _ in range(n)]
        outs = [np.empty_like(x) for x in ins]
        return (lambda: dist.all_to_all(outs, ins)), (lambda: None)
    raise ValueError(name)


# (SHMDIST_SINGLE_COPY=0: two members would copy between their arrays instead, in two phases;
# test_split_copy.py kills a member before, between and inside those.)
PHASED_ARENA = {"SHMDIST_ARENA_BYTES": str(1 << 20), "SHMDIST_ROUND_BYTES": str(512 << 10),
                "SHMDIST_SINGLE_COPY": "0"}

# name: (which operation the survivors' error names, the phase of the call at which the victim dies,
#        the root is the victim)
COLLECTIVES = {
    "barrier": ("barrier", 1, False),
    "all_reduce-small": ("all_reduce", 1, False),
    "all_reduce-large": ("all_reduce", 4, False),
    "broadcast-root-dies": ("broadcast", 3, True),
    "broadcast-leaf-dies": ("broadcast", 3, False),
    "reduce": ("reduce", 3, False),
    "all_gather": ("all_gather", 2, False),
    "gather": ("gather", 2, False),
    "scatter-root-dies": ("scatter", 2, True),
    "reduce_scatter": ("reduce_scatter", 2, False),
    "all_to_all": ("all_to_all", 2, False),
}


def dies_in_collective(rank, world_size, init_method, name, victim, at_phase, deathfile):
    """The victim dies just before it arrives at phase ``at_phase`` of the
    collective (0: right after the collective returned)."""
    from shmdist.comm import arena
    from shmdist.api import fast
    _, _, root_dies = COLLECTIVES[name]
    root = victim if root_dies else 0
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    dist.barrier()
    call, check = _collective(name, rank, world_size, root)
    if rank == victim:
        real = arena.GroupComm._pass
        passes = [0]

        def counting_pass(self, what, timeout, *desc):
            passes[0] += 1
            if passes[0] == at_phase:
                _die(deathfile)
            return real(self, what, timeout, *desc)
        arena.GroupComm._pass = counting_pass
        # The victim takes the general path, whose phases the hook counts; the
        # survivors keep the one-call quick paths, whose waits end the same way.
        arena.GroupComm.quick_barrier = lambda self, timeout, how=None: False
        fast.paths.barrier = None
        arena.GroupComm.quick_all_reduce = lambda self, arr, op, timeout: False
        fast.paths.c_rounds = False
        call()
        _die(deathfile)          # at_phase 0, or the call had fewer phases
    result = _outcome(call)
    if result["end"] == "ok":
        check()
    return _finish(result)


def _case_ids():
    for name in COLLECTIVES:
        for n in (2, 3, 4):
            yield pytest.param(name, n, id=f"{name}-{n}ranks")


@pytest.mark.parametrize("name, world_size", list(_case_ids()))
def test_sigkill_inside_a_collective(run_ranks, tmp_path, no_leaks, name, world_size):
    op, at_phase, root_dies = COLLECTIVES[name]
    victim = world_size - 1 if not root_dies else 1
    death_file = str(tmp_path / "death")
    # The phase numbers above are those of the 1 MiB buffers and 512 KiB rounds a group gets when its
    # members fit the cores; a group with more members than cores gets bigger ones (fewer phases).
    results = run_ranks(dies_in_collective, world_size, name, victim, at_phase, death_file, errors="return",
                        timeout=RUN_TIMEOUT_S, env=PHASED_ARENA)
    death, survivors = _survivors(results, victim, death_file)
    times = _report(f"{name} n={world_size} victim={victim} phase={at_phase}", death, survivors)
    for r, res in survivors.items():
        assert res["end"] == "error", f"rank {r} finished {name} although rank {victim} died in it"
        assert res["type"] == "DistPeerError", res
        assert f"rank {r}: {op}" in res["message"], res["message"]
        assert f"rank {victim} died" in res["message"], res["message"]
    assert max(times) < MAX_DETECT_S, f"survivors noticed after {times}"
    assert glob.glob(f"/dev/shm/shmdist-{no_leaks}-*") == []


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sigkill_right_after_a_collective_lets_the_survivors_finish(run_ranks, tmp_path, no_leaks,
                                                                    world_size):
    """The dead rank's part was done: the survivors' all_reduce completes, correct."""
    victim = world_size - 1
    death_file = str(tmp_path / "death")
    results = run_ranks(dies_in_collective, world_size, "all_reduce-large", victim, 0, death_file,
                        errors="return", timeout=RUN_TIMEOUT_S)
    death, survivors = _survivors(results, victim, death_file)
    _report(f"after all_reduce-large n={world_size}", death, survivors)
    for r, res in survivors.items():
        assert res["end"] == "ok", res
    assert glob.glob(f"/dev/shm/shmdist-{no_leaks}-*") == []


# ---------------------------------------------------------------- destroy

def dies_in_destroy(rank, world_size, init_method, deathfile):
    """The victim dies inside destroy_process_group, between unmapping the
    collective arena and saying goodbye on the host segment."""
    from shmdist.transport import shm
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    t = np.ones(1024, dtype=np.float64)
    dist.all_reduce(t)
    if rank == world_size - 1:
        shm.ShmHost.close = lambda self, cause="", unmap=True: _die(deathfile)
        dist.destroy_process_group()
        raise AssertionError("the victim outlived destroy_process_group")
    return _finish(_outcome(lambda: None))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sigkill_during_destroy(run_ranks, tmp_path, no_leaks, world_size):
    death_file = str(tmp_path / "death")
    results = run_ranks(dies_in_destroy, world_size, death_file, errors="return", timeout=RUN_TIMEOUT_S)
    death, survivors = _survivors(results, world_size - 1, death_file)
    _report(f"destroy n={world_size}", death, survivors)
    assert all(res["end"] == "ok" for res in survivors.values()), survivors
    assert glob.glob(f"/dev/shm/shmdist-{no_leaks}-*") == []


# ---------------------------------------------------------------- through the launcher

LAUNCHER = [sys.executable, "-m", "shmdist.run"]

RANK_SCRIPT = """
    import json, os, signal, sys, time
    import numpy as np
    import shmdist as dist
    from shmdist.comm import arena
    from shmdist.api import fast

    out, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group(timeout=60)
    rank = dist.get_rank()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "job": os.environ["SHMDIST_JOB_ID"]}, f)
    t = np.ones((16 << 20) // 4, dtype=np.float32)
    if mode == "kill" and rank == 1:
        real, passes = arena.GroupComm._pass, [0]
        def counting_pass(self, what, timeout, *desc):
            passes[0] += 1
            if passes[0] == 4:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, what, timeout, *desc)
        arena.GroupComm._pass = counting_pass
        fast.paths.c_rounds = False     # rounds in Python, where the hook counts them
    dist.all_reduce(t)
    open(os.path.join(out, f"inside{rank}"), "w").close()
    while True:                  # "loop": collectives until the launcher is signalled
        dist.all_reduce(t)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, mode: str, n: int) -> subprocess.Popen:
    path = tmp_path / "rank.py"
    path.write_text(textwrap.dedent(RANK_SCRIPT))
    return subprocess.Popen([*LAUNCHER, "--master-port", str(_free_port()), "-n", str(n), str(path),
                             str(tmp_path), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ranks_of(tmp_path, n: int, seconds: float = 60) -> tuple[list[int], str]:
    deadline = time.monotonic() + seconds
    files = [tmp_path / f"rank{r}.json" for r in range(n)]
    while not all(f.exists() and f.stat().st_size for f in files):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)
    time.sleep(0.05)
    infos = [json.loads(f.read_text()) for f in files]
    return [i["pid"] for i in infos], infos[0]["job"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _end(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_launcher_names_a_rank_killed_mid_collective(tmp_path):
    proc = _launch(tmp_path, "kill", 3)
    out, err = _end(proc)
    pids, job = _ranks_of(tmp_path, 3, seconds=1)
    print(f"\nFAULT launcher: exit {proc.returncode}; stderr:\n{err}")
    assert proc.returncode != 0
    assert f"shmdist-run: rank 1 (pid {pids[1]}) was killed by signal SIGKILL" in err, err
    assert not any(_alive(p) for p in pids)
    assert glob.glob(f"/dev/shm/shmdist-{job}-*") == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_to_the_launcher_mid_collective_stops_every_rank(tmp_path, sig):
    proc = _launch(tmp_path, "loop", 3)
    try:
        pids, job = _ranks_of(tmp_path, 3)
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"inside{r}").exists() for r in range(3)):
            assert time.monotonic() < deadline, "the ranks did not reach the collective loop"
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(sig)
        out, err = _end(proc)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    print(f"\nFAULT launcher {sig.name} mid-collective: exit {proc.returncode} after {took:.2f} s")
    assert proc.returncode == 128 + sig
    assert not any(_alive(p) for p in pids)
    assert "killed it (SIGKILL)" not in err, f"a rank ignored {sig.name} inside a collective:\n{err}"
    assert glob.glob(f"/dev/shm/shmdist-{job}-*") == []

"""Attacks on the pair's choice of way (comm/paths.py, GroupComm._splits and
_timed): groups of two inside bigger worlds whose first member is not rank 0,
several pair groups interleaved or driven from threads at once, settings that
differ between the two members, the torch backend with 16-bit floats and
async_op, reduce mixed with all_reduce, sizes at class edges, a member much
later than the other while the first flips its choice on every call, calls
the members disagree on while their ways differ, and a member killed in the
middle of flipping calls.

What must hold in every case: both members of a pair take the same way in
every call (the ways each logged are equal, call by call), every result is
bit-exact, disagreements raise DistMismatchError on both and the group goes
on, SHMDIST_PAIR_CHOOSE=0 of the creating member means single copies always,
and a member that dies is named by the survivor within the timeout."""
from __future__ import annotations

import os
import random
import signal
import threading
import time

import numpy as np
import pytest

import shmdist as dist
from shmdist.comm import paths
from test_pair_paths import Erratic

MiB = 1 << 20


class Fixed:
    """A chooser that asks for single copies for the classes in ``single`` and the arena for the rest."""

    def __init__(self, single):
        self.single = set(single)

    def record(self, cls, single, seconds, nbytes):
        return cls in self.single


class Ways(list):
    """The way _splits gave each call, one entry per call: a call that asks twice at the
    same phase (the one-call broadcast, then the general one) must get the same answer
    both times, which ``twice_differ`` counts."""

    def __init__(self):
        super().__init__()
        self.last_phase = None
        self.twice_differ = []

    def __reduce__(self):
        return (_rebuild_ways, (list(self), self.twice_differ))


def _rebuild_ways(items, twice):
    w = Ways()
    w.extend(items)
    w.twice_differ = twice
    return w


def log_ways(comm) -> list:
    seen, real = Ways(), comm._splits

    def logged(nbytes, kind):
        way = real(nbytes, kind)
        phase = comm.ph.phase
        entry = (kind, nbytes, bool(way))
        if phase == seen.last_phase and seen:
            if seen[-1] != entry:
                seen.twice_differ.append((phase, seen[-1], entry))
        else:
            seen.append(entry)
        seen.last_phase = phase
        return way
    comm._splits = logged
    return seen


def agree(a, b) -> bool:
    """Both members' ways, call by call, are the same (and no call got two answers)."""
    assert a.twice_differ == [] and b.twice_differ == [], (a.twice_differ, b.twice_differ)
    return list(a) == list(b)


def default_comm():
    from shmdist.api import group
    return group._world.default.coll


def erratic_pair(rank, world_size, init_method, seed, log=True):
    """Join a world whose default group's member 0 flips its choice at random after every
    call; the group's engine and (``log``) the list its ways are logged into."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    comm = default_comm()
    if rank == 0:
        comm.chooser = Erratic(seed)
    return comm, (log_ways(comm) if log else None)


def _data(seed, nbytes, members=2):
    """Each member's float32 input of a call (the same on every rank)."""
    r = np.random.default_rng(seed)
    return [r.standard_normal(nbytes // 4, dtype=np.float32) for _ in range(members)]


def one_call(rank, members, g, rng, nbytes_choices, late, with_reduce=True):
    """One random collective on pair group ``g`` (global ranks ``members``, in
    member order); every rank draws the same numbers from ``rng``, whether
    it takes part or not. Returns None when this rank is not in it, else
    (what, nbytes, ok)."""
    what = int(rng.integers(0, 7))
    nbytes = int(nbytes_choices[rng.integers(0, len(nbytes_choices))])
    seed = int(rng.integers(0, 1 << 30))
    root = int(rng.integers(0, 2))
    sleep = late.random() < 0.25
    if rank not in members:
        return None
    me = members.index(rank)
    data = _data(seed, nbytes)
    if sleep:
        time.sleep(late.random() * 0.003)
    src = members[root]
    if what == 0:                                   # broadcast from either member
        b = data[root].copy() if me == root else np.zeros_like(data[root])
        dist.broadcast(b, src=src, group=g)
        ok = np.array_equal(b, data[root])
    elif what == 1:                                 # float32 SUM
        x = data[me].copy()
        dist.all_reduce(x, group=g)
        ok = np.array_equal(x, data[0] + data[1])
    elif what == 2:                                 # int32 MAX
        ints = [(d * 1000).astype(np.int32) for d in data]
        x = ints[me].copy()
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=g)
        ok = np.array_equal(x, np.maximum(ints[0], ints[1]))
    elif what == 3 and with_reduce:                 # reduce to one member, same sizes
        x = data[me].copy()
        dist.reduce(x, dst=src, group=g)
        ok = np.array_equal(x, data[0] + data[1]) if me == root else True
    elif what == 4:                                 # float64 PRODUCT, half the elements
        d64 = [d[: nbytes // 8].astype(np.float64) for d in data]
        x = d64[me].copy()
        dist.all_reduce(x, op=dist.ReduceOp.PRODUCT, group=g)
        ok = np.array_equal(x, d64[0] * d64[1])
    elif what == 5:                                 # a small one: phases move, no way chosen
        x = np.full(16, me + 1.0, np.float32)
        dist.all_reduce(x, group=g)
        ok = bool(np.all(x == 3.0))
    else:                                           # float32 SUM again (the common one)
        x = data[me].copy()
        dist.all_reduce(x, group=g)
        ok = np.array_equal(x, data[0] + data[1])
    return what, nbytes, bool(ok)


# sizes at and around class edges: below the threshold, 1 MiB, 2 MiB - 4, 2 MiB, 4 MiB + 12
EDGES = (MiB - 4, MiB, 2 * MiB - 4, 2 * MiB, 4 * MiB + 12)


# ---------------------------------------------------------------- pair groups inside bigger worlds

SPECS4 = ([3, 1], [0, 2], [2, 3], [0, 1], [1, 2])


def interleaved(rank, world_size, init_method, specs, calls, seed):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    groups = [dist.new_group(s) for s in specs]
    ways = {}
    for k, (s, g) in enumerate(zip(specs, groups)):
        if rank in s:
            comm = g.coll
            if rank == min(s):
                assert comm.me == 0 and isinstance(comm.chooser, paths.Chooser), (s, comm.me)
                comm.chooser = Erratic(seed * 31 + k)
            else:
                assert comm.me == 1 and comm.chooser is None
            ways[k] = log_ways(comm)
    rng = np.random.default_rng(seed)
    late = random.Random(seed * 7 + rank)
    bad, done = [], 0
    for i in range(calls):
        k = int(rng.integers(0, len(specs)))
        members = sorted(specs[k])
        got = one_call(rank, members, groups[k], rng, EDGES, late)
        if got is not None:
            done += 1
            if not got[2]:
                bad.append((i, k) + got)
    for g in groups:
        dist.destroy_process_group(g)
    dist.destroy_process_group()
    return bad, ways, done


@pytest.mark.parametrize("world,seed", [(4, 1), (3, 2)])
def test_pair_groups_interleaved_in_a_bigger_world_agree_call_by_call(run_ranks, world, seed):
    """Groups like new_group([3, 1]) (first member global rank 1), used in turn with
    other pair groups that share ranks; every first member flips its choice on every call."""
    specs = [s for s in SPECS4 if max(s) < world]
    out = run_ranks(interleaved, world, specs, 90 if world == 4 else 110, seed, timeout=150)
    for r, (bad, _, done) in enumerate(out):
        assert bad == [], (r, bad)
        assert done > 10
    both = 0
    for k, s in enumerate(specs):
        a, b = sorted(s)
        wa, wb = out[a][1][k], out[b][1][k]
        assert agree(wa, wb), (s, wa, wb)
        taken = [w for _, n, w in wa if n >= MiB]
        both += (True in taken) and (False in taken)
    assert both >= 2


# ---------------------------------------------------------------- two threads, two groups

def threaded(rank, world_size, init_method, calls, seed, with_default=False):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    groups = [None if with_default else dist.new_group([0, 1]), dist.new_group([1, 0])]
    ways = []
    for k, g in enumerate(groups):
        comm = default_comm() if g is None else g.coll
        if rank == 0:
            comm.chooser = Erratic(seed + k)
        ways.append(log_ways(comm))
    results = [None, None]

    def run(k):
        try:
            rng = np.random.default_rng(seed * 100 + k)
            late = random.Random(seed * 5 + rank * 2 + k)
            bad = []
            for i in range(calls):
                got = one_call(rank, [0, 1], groups[k], rng, EDGES, late)
                if not got[2]:
                    bad.append((i,) + got)
            results[k] = bad
        except BaseException as e:       # said in the result, not lost in the thread
            results[k] = repr(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    for g in groups:
        if g is not None:
            dist.destroy_process_group(g)
    dist.destroy_process_group()
    return results, ways


@pytest.mark.parametrize("with_default", [False, True])
def test_two_threads_on_two_pair_groups_at_once(run_ranks, with_default):
    """Two new groups of the same two ranks, or the default group (its one-call paths) and one."""
    (res0, ways0), (res1, ways1) = run_ranks(threaded, 2, 60, 3, with_default, timeout=150)
    assert res0 == [[], []] and res1 == [[], []], (res0, res1)
    for k in (0, 1):
        assert agree(ways0[k], ways1[k])
        taken = [w for _, n, w in ways0[k] if n >= MiB]
        assert True in taken and False in taken


# ---------------------------------------------------------------- settings that differ between the two

def asymmetric(rank, world_size, init_method, env_by_rank, members, calls, erratic):
    for key, value in env_by_rank.get(rank, {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    g = dist.new_group(members) if world_size > 2 else None
    if rank not in members:
        dist.barrier()
        dist.destroy_process_group()
        return None
    comm = g.coll if g is not None else default_comm()
    chooser = type(comm.chooser).__name__ if comm.chooser is not None else None
    if erratic and comm.chooser is not None:
        comm.chooser = Erratic(9)
    ways = log_ways(comm)
    rng = np.random.default_rng(4)
    late = random.Random(rank)
    bad = []
    for i in range(calls):
        got = one_call(rank, sorted(members), g, rng, EDGES, late)
        if not got[2]:
            bad.append((i,) + got)
    split = comm.split
    dist.barrier()
    dist.destroy_process_group()
    return bad, ways, chooser, split


def _big(ways):
    return [w for _, n, w in ways if n >= MiB]


def test_choose_off_on_the_creator_alone_means_single_copies_for_both(run_ranks):
    out = run_ranks(asymmetric, 2, {0: {"SHMDIST_PAIR_CHOOSE": "0"}, 1: {"SHMDIST_PAIR_CHOOSE": "1"}},
                    [0, 1], 40, False, timeout=90)
    (bad0, ways0, ch0, _), (bad1, ways1, ch1, _) = out
    assert bad0 == bad1 == []
    assert ch0 is None and ch1 is None
    assert agree(ways0, ways1) and len(_big(ways0)) >= 20 and all(_big(ways0))


def test_choose_off_on_the_other_member_alone_changes_nothing(run_ranks):
    """The creator times (its setting holds): both arena tries at the start happen."""
    out = run_ranks(asymmetric, 2, {1: {"SHMDIST_PAIR_CHOOSE": "0"}}, [0, 1], 40, False, timeout=90)
    (bad0, ways0, ch0, _), (bad1, ways1, ch1, _) = out
    assert bad0 == bad1 == []
    assert ch0 == "Chooser" and ch1 is None
    assert agree(ways0, ways1) and False in _big(ways0) and True in _big(ways0)


def test_choose_off_on_a_reversed_pair_s_creator_in_three_ranks(run_ranks):
    """new_group([2, 1]) in a world of 3: rank 1 creates it; its 0 holds, rank 2's 1 does not matter."""
    env = {1: {"SHMDIST_PAIR_CHOOSE": "0"}, 2: {"SHMDIST_PAIR_CHOOSE": "1"}, 0: {"SHMDIST_PAIR_CHOOSE": "1"}}
    out = run_ranks(asymmetric, 3, env, [2, 1], 30, False, timeout=90)
    assert out[0] is None
    (bad1, ways1, ch1, _), (bad2, ways2, ch2, _) = out[1], out[2]
    assert bad1 == bad2 == [] and ch1 is None and ch2 is None
    assert agree(ways1, ways2) and _big(ways1) and all(_big(ways1))


def test_single_copy_off_on_the_second_member_while_the_first_flips(run_ranks):
    """Member 1 cannot be read (SHMDIST_SINGLE_COPY=0 there): the first call that would go
    as single copies finds it out on both, and both take the buffers from then on."""
    out = run_ranks(asymmetric, 2, {1: {"SHMDIST_SINGLE_COPY": "0"}}, [0, 1], 40, True, timeout=90)
    (bad0, ways0, _, split0), (bad1, ways1, _, split1) = out
    assert bad0 == bad1 == []
    assert agree(ways0, ways1)
    assert split0 is False and split1 is False


def test_fast_paths_off_on_one_member_only_while_the_first_flips(run_ranks):
    """SHMDIST_FAST=0 on member 1: its rounds in Python, no one-call broadcast; the first flips."""
    out = run_ranks(asymmetric, 2, {1: {"SHMDIST_FAST": "0"}}, [0, 1], 40, True, timeout=90)
    (bad0, ways0, _, _), (bad1, ways1, _, _) = out
    assert bad0 == bad1 == []
    assert agree(ways0, ways1) and True in _big(ways0) and False in _big(ways0)


def test_a_bigger_single_copy_threshold_on_the_creator_holds_for_both(run_ranks):
    """The creator's SHMDIST_SINGLE_COPY (4 MiB) holds: calls below it never go as single copies."""
    out = run_ranks(asymmetric, 2, {0: {"SHMDIST_SINGLE_COPY": str(4 * MiB)}}, [0, 1], 40, True, timeout=90)
    (bad0, ways0, _, _), (bad1, ways1, _, _) = out
    assert bad0 == bad1 == [] and agree(ways0, ways1)
    assert not any(w for _, n, w in ways0 if n < 4 * MiB)


# ---------------------------------------------------------------- the class edges, with a fixed choice

def fixed_classes(rank, world_size, init_method, calls):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    comm = default_comm()
    if rank == 0:        # class 0 of both kinds single copies, every other class the arena
        comm.chooser = Fixed({paths.bit(0, MiB), paths.bit(1, MiB)})
    ways = log_ways(comm)
    rng = np.random.default_rng(8)
    late = random.Random(rank)
    bad = []
    for i in range(calls):
        got = one_call(rank, [0, 1], None, rng, EDGES, late)
        if not got[2]:
            bad.append((i,) + got)
    dist.destroy_process_group()
    return bad, ways


def test_class_edges_take_their_class_s_way_on_both(run_ranks):
    (bad0, ways0), (bad1, ways1) = run_ranks(fixed_classes, 2, 60, timeout=90)
    assert bad0 == bad1 == [] and agree(ways0, ways1)
    # after each kind's first two calls of a class (the word lags one call), class 0 single, others arena
    seen = {}
    for kind, n, w in ways0:
        cls = paths.bit(kind, n)
        seen[cls] = seen.get(cls, 0) + 1
        if n < MiB:
            assert not w
        elif seen[cls] > 2:
            assert w == (n < 2 * MiB), (kind, n, w, seen[cls])


# ---------------------------------------------------------------- one member much later

def late_member(rank, world_size, init_method, calls, sleeper, arena_bytes):
    if arena_bytes:
        os.environ["SHMDIST_ARENA_BYTES"] = str(arena_bytes)
    _, ways = erratic_pair(rank, world_size, init_method, 77)
    rng = np.random.default_rng(12)
    late = random.Random(rank)
    bad = []
    for i in range(calls):
        if rank == sleeper and i % 3 == 1:
            time.sleep(0.03)
        got = one_call(rank, [0, 1], None, rng, EDGES, late)
        if not got[2]:
            bad.append((i,) + got)
    dist.destroy_process_group()
    return bad, ways


@pytest.mark.parametrize("sleeper", [0, 1])
@pytest.mark.parametrize("arena_bytes", [0, 4 * MiB])
def test_a_much_later_member_while_the_first_flips_every_call(run_ranks, sleeper, arena_bytes):
    """With 4 MiB arena buffers the default group's one-call broadcast covers classes 0-2."""
    (bad0, ways0), (bad1, ways1) = run_ranks(late_member, 2, 45, sleeper, arena_bytes, timeout=90)
    assert bad0 == bad1 == []
    assert agree(ways0, ways1)
    assert True in _big(ways0) and False in _big(ways0)


# ---------------------------------------------------------------- disagreements while ways differ

def _disagree_pairs():
    """(rank 0's call, rank 1's call), each a (kind, nbytes, dtype, root-member); all disagree."""
    return [
        (("all_reduce", MiB, "float32", -1), ("broadcast", MiB, "float32", 0)),
        (("all_reduce", 2 * MiB, "float32", -1), ("reduce", 2 * MiB, "float32", 0)),
        (("all_reduce", MiB, "float32", -1), ("all_reduce", 512 << 10, "float32", -1)),
        (("broadcast", MiB, "float32", 0), ("broadcast", MiB, "float32", 1)),
        (("all_reduce", MiB, "float32", -1), ("all_reduce", MiB, "float64", -1)),
        (("broadcast", 4 * MiB, "float32", 1), ("barrier", 0, "", -1)),
        (("broadcast", 2 * MiB - 4, "float32", 0), ("broadcast", 2 * MiB, "float32", 0)),
        (("all_reduce", 4 * MiB, "int32", -1), ("broadcast", 4 * MiB, "int32", 1)),
    ]


def _do(call, rank, g=None):
    kind, nbytes, dtype, root = call
    if kind == "barrier":
        dist.barrier(group=g)
        return
    x = np.ones(nbytes // np.dtype(dtype).itemsize, dtype)
    if kind == "all_reduce":
        dist.all_reduce(x, group=g)
    elif kind == "reduce":
        dist.reduce(x, dst=root, group=g)
    else:
        dist.broadcast(x, src=root, group=g)


def disagreeing(rank, world_size, init_method, rounds, seed):
    comm, ways = erratic_pair(rank, world_size, init_method, seed)
    said = []
    for r in range(rounds):
        for pair in _disagree_pairs():
            try:
                _do(pair[rank], rank)
                said.append("no error")
            except dist.DistMismatchError:
                said.append("mismatch")
            # the group goes on: a good call of a random big size, checked
            n = (MiB, 2 * MiB, 3 * MiB + 4096)[(r + len(said)) % 3]
            x = np.full(n // 4, rank + 1, np.float32)
            dist.all_reduce(x)
            said.append("ok" if np.all(x == 3) else "wrong")
            b = np.arange(n // 4, dtype=np.float32) if rank == 1 else np.zeros(n // 4, np.float32)
            dist.broadcast(b, src=1)
            said.append("ok" if np.array_equal(b, np.arange(n // 4, dtype=np.float32)) else "wrong")
    dist.destroy_process_group()
    return said, ways


def test_disagreements_raise_on_both_whatever_the_ways_and_the_pair_goes_on(run_ranks):
    (said0, ways0), (said1, ways1) = run_ranks(disagreeing, 2, 3, 21, timeout=120)
    want = ["mismatch", "ok", "ok"] * (3 * len(_disagree_pairs()))
    assert said0 == want, said0
    assert said1 == want, said1


# ---------------------------------------------------------------- the torch backend

def torch_erratic(rank, world_size, init_method, calls, seed):
    import torch
    import torch.distributed as tdist
    import shmdist.torch  # noqa: F401  (registers the backend)
    tdist.init_process_group("shm", init_method=init_method, rank=rank, world_size=world_size)
    comm = default_comm()
    if rank == 0:
        comm.chooser = Erratic(seed)
    ways = log_ways(comm)
    rng = np.random.default_rng(seed)
    late = random.Random(rank)
    bad = []
    for i in range(calls):
        what = int(rng.integers(0, 5))
        nbytes = int(EDGES[rng.integers(0, len(EDGES))])
        dtype = (torch.bfloat16, torch.float16)[int(rng.integers(0, 2))]
        s = int(rng.integers(0, 1 << 30))
        root = int(rng.integers(0, 2))
        base = [torch.from_numpy(d).to(dtype) for d in _data(s, 2 * nbytes)[:2]]   # nbytes of 16-bit
        base = [b[: nbytes // 2] for b in base]
        if late.random() < 0.25:
            time.sleep(late.random() * 0.003)
        t = base[rank].clone()
        if what == 0:
            t = base[root].clone() if rank == root else torch.zeros_like(base[root])
            w = tdist.broadcast(t, src=root, async_op=True)
            w.wait()
            ok = torch.equal(t, base[root])
        elif what == 1:
            w = tdist.all_reduce(t, async_op=True)
            w.wait()
            ok = torch.equal(t, (base[0].float() + base[1].float()).to(dtype))
        elif what == 2:
            tdist.all_reduce(t, op=tdist.ReduceOp.PRODUCT)
            ok = torch.equal(t, (base[0].float() * base[1].float()).to(dtype))
        elif what == 3:
            w = tdist.reduce(t, dst=root, async_op=True)
            w.wait()
            ok = torch.equal(t, (base[0].float() + base[1].float()).to(dtype)) if rank == root else True
        else:
            x = torch.from_numpy(_data(s, nbytes)[rank].copy())
            w = tdist.all_reduce(x, async_op=True)
            w.wait()
            ok = torch.equal(x, torch.from_numpy(_data(s, nbytes)[0] + _data(s, nbytes)[1]))
        if not ok:
            bad.append((i, what, nbytes, str(dtype)))
    tdist.destroy_process_group()
    return bad, ways


def test_torch_backend_16_bit_and_async_while_the_first_flips(run_ranks):
    pytest.importorskip("torch")
    (bad0, ways0), (bad1, ways1) = run_ranks(torch_erratic, 2, 50, 5, timeout=120)
    assert bad0 == bad1 == []
    assert agree(ways0, ways1)
    assert True in _big(ways0) and False in _big(ways0)


# ---------------------------------------------------------------- a member killed mid-run

def killed(rank, world_size, init_method, victim, seed, delay):
    erratic_pair(rank, world_size, init_method, seed, log=False)
    if rank == victim:
        threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    rng = np.random.default_rng(seed)
    late = random.Random(rank)
    t0 = time.monotonic()
    try:
        for i in range(100000):
            one_call(rank, [0, 1], None, rng, (MiB, 2 * MiB, 4 * MiB + 12, 8 * MiB, 32 * MiB), late)
    except dist.DistError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


@pytest.mark.parametrize("victim", [0, 1])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_member_killed_among_flipping_calls_is_named_by_the_other(run_ranks, victim, seed):
    delay = 0.4 + 0.37 * seed
    results = run_ranks(killed, 2, victim, seed, delay, timeout=40, errors="return")
    assert results[victim].exitcode == -9, results[victim]
    kind, message, took = results[1 - victim]
    assert kind == "DistPeerError", (kind, message)
    assert f"rank {victim}" in message and ("died" in message or "exited" in message), message
    assert took < delay + 20, took


# ---------------------------------------------------------------- node pairs of a job on two pretend hosts

def hier_nodes(rank, world_size, init_method, calls, seed):
    os.environ["SHMDIST_HOST_ID"] = f"pretend-host-{rank * 2 // world_size}"   # [a, a, b, b]
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    node = default_comm().comm            # the node's arena: a pair
    assert node is not None and node.n == 2
    if node.me == 0:
        assert node.chooser is not None
        node.chooser = Erratic(seed + rank)
    ways = log_ways(node)
    rng = np.random.default_rng(seed)
    bad = []
    for i in range(calls):
        nbytes = int(EDGES[rng.integers(0, len(EDGES))])
        s = int(rng.integers(0, 1 << 30))
        what = int(rng.integers(0, 3))
        root = int(rng.integers(0, world_size))
        data = [np.random.default_rng(s + r).standard_normal(nbytes // 4, dtype=np.float32)
                for r in range(world_size)]
        if what == 0:
            b = data[root].copy() if rank == root else np.zeros_like(data[root])
            dist.broadcast(b, src=root)
            ok = np.array_equal(b, data[root])
        else:
            x = (data[rank] * 100).astype(np.int32) if what == 1 else data[rank].astype(np.float64)
            dist.all_reduce(x)
            want = sum((d * 100).astype(np.int32) if what == 1 else d.astype(np.float64) for d in data)
            ok = np.array_equal(x, want) if what == 1 else np.allclose(x, want, rtol=1e-12, atol=1e-12)
        if not ok:
            bad.append((i, what, nbytes))
    dist.destroy_process_group()
    return bad, ways


def test_node_pairs_of_a_job_across_pretend_hosts_agree(run_ranks):
    """Two pretend hosts of two ranks (SHMDIST_HOST_ID, TCP on loopback between them): each
    node's arena is a pair whose first member flips; the hierarchical steps must agree."""
    out = run_ranks(hier_nodes, 4, 40, 6, timeout=150)
    for r, (bad, _) in enumerate(out):
        assert bad == [], (r, bad)
    assert agree(out[0][1], out[1][1]) and agree(out[2][1], out[3][1])
    assert any(True in _big(w) and False in _big(w) for _, w in out) or \
        all(len(_big(w)) == 0 for _, w in out)


# ---------------------------------------------------------------- refusals and in-place memory against a pair's ways

def refusing(rank, world_size, init_method, rounds, seed):
    comm, ways = erratic_pair(rank, world_size, init_method, seed)
    said = []
    shared = dist.empty((2 * MiB // 4,), np.float32)
    for r in range(rounds):
        n = (MiB, 2 * MiB, 4 * MiB + 12)[r % 3] // 4
        # 1. rank 1 refuses its own call (a read-only tensor to reduce into); rank 0's is valid
        x = np.ones(n, np.float32)
        if rank == 1:
            x.setflags(write=False)
        try:
            dist.all_reduce(x)
            said.append("no error")
        except dist.DistMismatchError:
            said.append("mismatch")
        except (dist.DistError, ValueError, TypeError) as e:
            said.append("own error" if rank == 1 else repr(e))
        # 2. rank 0's tensor in shmdist.empty memory, rank 1's not (both 2 MiB)
        y = shared if rank == 0 else np.empty(2 * MiB // 4, np.float32)
        y[:] = rank + 1
        try:
            dist.all_reduce(y)
            said.append("no error" if np.all(y == 3) else "wrong")
        except dist.DistMismatchError:
            said.append("mismatch")
        # 3. both in-place memory: fine
        shared[:] = rank + 1
        dist.all_reduce(shared)
        said.append("ok" if np.all(shared == 3) else "wrong")
        # 4. the pair goes on with a big call whichever way
        z = np.full(n, rank + 1.0, np.float32)
        dist.all_reduce(z)
        said.append("ok" if np.all(z == 3) else "wrong")
        b = np.arange(n, dtype=np.float32) if rank == 0 else np.zeros(n, np.float32)
        dist.broadcast(b, src=0)
        said.append("ok" if np.array_equal(b, np.arange(n, dtype=np.float32)) else "wrong")
    del shared
    dist.destroy_process_group()
    return said, ways


def test_refusals_and_in_place_memory_disagree_cleanly_whatever_the_ways(run_ranks):
    (said0, ways0), (said1, ways1) = run_ranks(refusing, 2, 9, 4, timeout=90)
    a = ["mismatch", "mismatch", "ok", "ok", "ok"] * 9
    b = ["own error", "mismatch", "ok", "ok", "ok"] * 9
    assert said0 == a, said0
    assert said1 == b, said1
    assert ways0.twice_differ == [] and ways1.twice_differ == []


# ---------------------------------------------------------------- many quick flips, no sleeps

def flip_storm(rank, world_size, init_method, calls, seed):
    comm, ways = erratic_pair(rank, world_size, init_method, seed)
    a = [np.random.default_rng(seed + r).standard_normal(MiB // 4, dtype=np.float32) for r in (0, 1)]
    want = a[0] + a[1]
    bad = []
    for i in range(calls):
        k = i % 4
        if k == 0:
            x = a[rank].copy()
            dist.all_reduce(x)
            ok = np.array_equal(x, want)
        elif k == 1:
            x = a[0].copy() if rank == 0 else np.zeros_like(a[0])
            dist.broadcast(x, src=0)
            ok = np.array_equal(x, a[0])
        elif k == 2:
            x = a[1].copy() if rank == 1 else np.zeros_like(a[1])
            dist.broadcast(x, src=1)
            ok = np.array_equal(x, a[1])
        else:
            x = a[rank].copy()
            dist.reduce(x, dst=i % 2)
            ok = np.array_equal(x, want) if rank == i % 2 else True
        if not ok:
            bad.append((i, k))
    dist.destroy_process_group()
    return bad, ways


def test_a_storm_of_flips_at_1_mib_without_pauses(run_ranks):
    (bad0, ways0), (bad1, ways1) = run_ranks(flip_storm, 2, 600, 13, timeout=90)
    assert bad0 == bad1 == []
    assert agree(ways0, ways1)
    taken = _big(ways0)
    assert taken.count(True) > 50 and taken.count(False) > 50


# ---------------------------------------------------------------- NaN payloads: the only bits rank order decides in a sum of two

def nan_bits(rank, world_size, init_method, calls):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    comm = default_comm()
    if rank == 0:
        comm.chooser = Erratic(123)
    ways = log_ways(comm)
    bad = []
    for i in range(calls):
        nbytes = (MiB, 2 * MiB + 4096, 4 * MiB + 12)[i % 3]
        for dt, ui in ((np.float32, np.uint32), (np.float64, np.uint64)):
            n = nbytes // np.dtype(dt).itemsize
            r = np.random.default_rng(i)
            data = [r.standard_normal(n).astype(dt) for _ in range(2)]
            bits = [d.view(ui) for d in data]
            top = ui(0x7FC00000) if dt is np.float32 else ui(0x7FF8000000000000)
            for m in range(2):                    # NaNs of different payloads in both, some in one only
                at = r.choice(n, n // 50, replace=False)
                bits[m][at] = top | ui(m + 1) | (r.integers(1, 1 << 20, len(at)).astype(ui) << ui(2))
            both = r.choice(n, n // 50, replace=False)
            bits[0][both] = top | ui(7)
            bits[1][both] = top | ui(11)
            want = (data[0] + data[1]).view(ui)
            x = data[rank].copy()
            dist.all_reduce(x)
            if not np.array_equal(x.view(ui), want):
                bad.append((i, np.dtype(dt).name, int((x.view(ui) != want).sum())))
    dist.destroy_process_group()
    return bad, ways


def test_nan_payloads_are_numpy_s_in_rank_order_whichever_way(run_ranks):
    (bad0, ways0), (bad1, ways1) = run_ranks(nan_bits, 2, 18, timeout=90)
    assert bad0 == [] and bad1 == [], (bad0, bad1)
    assert agree(ways0, ways1) and True in _big(ways0) and False in _big(ways0)

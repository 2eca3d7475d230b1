"""Three or more members choose, per size class, how a big broadcast moves:
read by every other member straight from the root's array (single copies,
from 4 MiB) or through the arena's buffers, by the same word as two members
(comm/paths.py): the first member times both and writes the choice, every
member reads it at the start of the call.

What must hold, in real processes: with the first member changing its mind
at random after every call and the others arriving early or late, every
broadcast is bit-exact and all members' ways agree call by call (3 and 4
ranks, 4 ranks on 2 cores too); all follow the first member's timing; calls
the members disagree on raise on every member whatever their ways, and the
group goes on; SHMDIST_PAIR_CHOOSE=0 on the creator keeps the single copies."""
from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest

import shmdist as dist
from shmdist.comm import paths
from test_pair_paths import Scripted, log_ways
from test_pair_paths_attack import erratic_pair

MiB = 1 << 20
SIZES = (4 * MiB + 12, 5 * MiB, 8 * MiB + 4096 + 8)     # classes 2, 2, 3 (from 4 MiB: either way)


def erratic_broadcasts(rank, world_size, init_method, calls, seed):
    _, ways = erratic_pair(rank, world_size, init_method, seed)   # (member 0 flips after every call)
    rng = np.random.default_rng(seed)           # the same calls on every rank
    late = random.Random(seed * 7 + rank)       # but each rank late in its own way
    bad = []
    for i in range(calls):
        what = int(rng.integers(0, 4))
        nbytes = int(SIZES[rng.integers(0, len(SIZES))])
        root = int(rng.integers(0, world_size))
        data = rng.integers(0, 255, nbytes, dtype=np.uint8)
        if late.random() < 0.3:
            time.sleep(late.random() * 0.003)
        if what == 0:                                # small calls between: phases move, no way to choose
            x = np.full(16, rank + 1.0, np.float32)
            dist.all_reduce(x)
            ok = bool(np.all(x == world_size * (world_size + 1) / 2))
        elif what == 1:                              # under 4 MiB: the arena, never timed
            b = data[:MiB].copy() if rank == root else np.zeros(MiB, np.uint8)
            dist.broadcast(b, src=root)
            ok = np.array_equal(b, data[:MiB])
        else:
            b = data.copy() if rank == root else np.zeros_like(data)
            dist.broadcast(b.view(np.float32) if nbytes % 4 == 0 and what == 3 else b, src=root)
            ok = np.array_equal(b, data)
        if not ok:
            bad.append((i, what, nbytes, root))
    dist.destroy_process_group()
    return bad, ways


@pytest.mark.parametrize("world_size", [3, 4])
def test_every_member_takes_the_same_way_in_every_call_while_the_first_changes_its_mind(run_ranks, world_size):
    got = run_ranks(erratic_broadcasts, world_size, 80, 5 + world_size, timeout=180)
    for bad, _ in got:
        assert bad == []
    ways = [w for _, w in got]
    assert all(w == ways[0] for w in ways)
    taken = [w for _, n, w in ways[0] if n >= 4 * MiB]
    assert taken.count(True) >= 10 and taken.count(False) >= 10, taken
    assert all(w is False for _, n, w in ways[0] if n < 4 * MiB)    # below 4 MiB: never single copies


def scripted_broadcasts(rank, world_size, init_method, calls, slow_from, slow_to):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    from shmdist.api import group
    comm = group._world.default.coll
    if rank == 0:
        assert isinstance(comm.chooser, paths.Chooser)     # three or more members time too
        comm.chooser = Scripted(slow_from, slow_to)
    seen, ways = log_ways(comm), []
    b = np.zeros(4 * MiB, np.uint8)
    for i in range(calls):
        root = i % world_size
        b[:] = root + 1 if rank == root else 0
        dist.broadcast(b, root)
        assert np.all(b == root + 1)
        ways.append(seen[-1][2])       # (the one-call path asks first, then the general path again)
    dist.destroy_process_group()
    return ways


def test_every_member_follows_the_first_one_s_timing(run_ranks):
    """Fast arena: all take it; a slow window: all take single copies within a few
    calls; it ends: all go back within one explore period (5 calls here)."""
    got = run_ranks(scripted_broadcasts, 3, 120, 40, 80, timeout=120)
    assert all(w == got[0] for w in got) and len(got[0]) == 120
    ways = got[0]
    assert ways[:4] == [True, True, False, False]
    assert ways[10:40].count(False) >= 26
    assert ways[45:80].count(True) >= 31
    assert ways[90:].count(False) >= 26


def disagreeing_broadcasts(rank, world_size, init_method, seed):
    """The last rank's broadcast is twice as big on even calls (another class, so its way may
    differ): every member must raise the mismatch, then all go on together."""
    erratic_pair(rank, world_size, init_method, seed, log=False)
    said = []
    for i in range(8):
        n = 8 * MiB if rank == world_size - 1 and i % 2 == 0 else 4 * MiB
        b = np.full(n, 7 if rank == 1 else 0, np.uint8)
        try:
            dist.broadcast(b, 1)
            said.append("ok" if np.all(b == 7) else "wrong")
        except dist.DistMismatchError as e:
            said.append("mismatch" if f"rank {rank}: broadcast" in str(e) else str(e))
    dist.destroy_process_group()
    return said


def test_broadcasts_the_members_disagree_on_raise_on_every_member_whatever_their_ways(run_ranks):
    for said in run_ranks(disagreeing_broadcasts, 3, 5, timeout=120):
        assert said == ["mismatch", "ok"] * 4


def choose_off(rank, world_size, init_method):
    if rank == 0:                                   # the creator's setting holds for every member
        os.environ["SHMDIST_PAIR_CHOOSE"] = "0"
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    from shmdist.api import group
    comm = group._world.default.coll
    seen, ways = log_ways(comm), []
    b = np.zeros(4 * MiB, np.uint8)
    for i in range(30):
        b[:] = 9 if rank == 0 else 0
        dist.broadcast(b, 0)
        assert np.all(b == 9)
        ways.append(seen[-1][2])
    dist.destroy_process_group()
    return rank != 0 or comm.chooser is None, ways


def test_choose_off_on_the_creator_keeps_the_single_copies_for_every_member(run_ranks):
    for no_chooser, ways in run_ranks(choose_off, 3, timeout=60):
        assert ways == [True] * 30
        assert no_chooser

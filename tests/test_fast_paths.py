"""The fast paths (shmdist/api/fast.py) change speed only: with every one of
them off (one switch, the no_fast_paths fixture) point-to-point and every
collective give the same results, and nothing goes through a shortcut."""
from __future__ import annotations

import numpy as np

import shmdist as dist
from test_collectives import MOVEMENTS, REDUCTIONS, assert_all_good, make_cases, run_cases
from test_tcp import expected_p2p, p2p_cases

# small (the one-call paths) and large (the C rounds) sizes
CASES = make_cases(REDUCTIONS, [3, (1 << 20) + 5], dtypes=("float32", "int64", "bfloat16")) + \
    make_cases(MOVEMENTS, [3, 70001], dtypes=("float32",), first_seed=500)


def nothing_took_a_shortcut(rank, world_size, init_method, target, *args):
    from shmdist.api import fast
    out = target(rank, world_size, init_method, *args)
    assert fast.paths.lane is None and fast.paths.barrier is None and not fast.paths.rounds_in_c()
    return out


def small_calls(rank, world_size, init_method):
    from shmdist.api import fast
    from shmdist.api import group
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    lane = group.world().engine.lane
    peer = 1 - rank
    got = np.zeros(4)
    for i in range(3):
        dist.send(np.full(4, rank + i, dtype=np.float64), peer).wait()
        dist.recv(got, peer).wait()
    t = np.full(8, rank + 1.0, dtype=np.float32)
    dist.all_reduce(t)
    dist.barrier()
    out = (got.tolist(), t.tolist(), lane.sends, lane.recvs, fast.paths.lane is None)
    dist.destroy_process_group()
    return out


def test_fast_paths_off_point_to_point_and_quick_calls(run_ranks, no_fast_paths):
    got = run_ranks(small_calls, 2, timeout=60)
    for rank in (0, 1):
        assert got[rank] == ([3.0 - rank] * 4, [3.0] * 8, 0, 0, True)


def test_fast_paths_off_every_collective(run_ranks, no_fast_paths):
    assert_all_good(run_ranks(nothing_took_a_shortcut, 3, run_cases, CASES, timeout=300))


def test_fast_paths_off_point_to_point_cases(run_ranks, no_fast_paths):
    results = run_ranks(nothing_took_a_shortcut, 3, p2p_cases, "shm", timeout=120)
    assert results == [expected_p2p(r, 3) for r in range(3)]

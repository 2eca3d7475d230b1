"""A group with more members than its ranks may use CPUs gets longer collective rounds
(8 MiB buffers, 4 MiB rounds): each phase then waits until every member has been
scheduled, so fewer phases. SHMDIST_ARENA_BYTES / SHMDIST_ROUND_BYTES still win."""
import os

import numpy as np

import shmdist as dist
from shmdist.api import group as _g

MiB = 1 << 20


def sizes(rank, world_size, init_method, cpus):
    if cpus:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:cpus]))
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    coll = _g._world.default.coll
    got = (coll.slot, coll.round_bytes)
    x = np.full((5 * MiB) // 4 + 3, rank + 1, np.float32)     # a large all_reduce still adds up
    dist.all_reduce(x)
    ok = bool(np.all(x == world_size * (world_size + 1) / 2))
    dist.destroy_process_group()
    return got, ok


def test_more_members_than_cpus_take_longer_rounds(run_ranks):
    results = run_ranks(sizes, 2, 1, timeout=120)          # 2 ranks, each allowed one CPU
    assert all(r == ((8 * MiB, 4 * MiB), True) for r in results), results


def test_as_many_cpus_as_members_keep_the_defaults_and_settings_win(run_ranks):
    if len(os.sched_getaffinity(0)) >= 2:
        results = run_ranks(sizes, 2, 0, timeout=120)
        assert all(r == ((MiB, 512 << 10), True) for r in results), results
    results = run_ranks(sizes, 2, 1, timeout=120,
                        env={"SHMDIST_ARENA_BYTES": str(2 * MiB), "SHMDIST_ROUND_BYTES": str(256 << 10)})
    assert all(r == ((2 * MiB, 256 << 10), True) for r in results), results

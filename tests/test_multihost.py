"""Ranks on several hosts, pretended on one machine with SHMDIST_HOST_ID:
shared memory inside each pretend host, TCP between them, and the
hierarchical collectives; and the collectives with backend "tcp"."""
from __future__ import annotations

import os

import numpy as np
import pytest

import shmdist as dist
from test_collectives import MOVEMENTS, REDUCTIONS, assert_all_good, make_cases, run_cases
from test_tcp import expected_p2p, p2p_cases

LAYOUTS = {"blocks": lambda rank, n: rank * 2 // n,      # [a, a, b, b]
           "interleaved": lambda rank, n: rank % 2}      # [a, b, a, b]: leaders 0 and 1


def on_pretend_host(rank, world_size, init_method, layout, target, *args):
    os.environ["SHMDIST_HOST_ID"] = f"pretend-host-{LAYOUTS[layout](rank, world_size)}"
    return target(rank, world_size, init_method, *args)


CASES = make_cases(REDUCTIONS, [1, 1023]) + make_cases(MOVEMENTS, [1, 1023], first_seed=1000)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_collectives_on_two_pretend_hosts(run_ranks, layout):
    assert_all_good(run_ranks(on_pretend_host, 4, layout, run_cases, CASES, timeout=300))


def test_collectives_on_a_group_spanning_hosts(run_ranks):
    cases = make_cases(("all_reduce", "broadcast", "all_gather", "reduce_scatter"), [257],
                       dtypes=("float32", "bfloat16", "int64"))
    members = (1, 2, 3)
    results = run_ranks(on_pretend_host, 4, "blocks", run_cases, cases, members, timeout=300)
    assert_all_good(results, members)


def test_collectives_with_backend_tcp(run_ranks):
    results = run_ranks(run_cases, 3, CASES, timeout=300, env={"SHMDIST_TRANSPORT": "tcp"})
    assert_all_good(results)


def test_point_to_point_on_two_pretend_hosts(run_ranks):
    results = run_ranks(on_pretend_host, 4, "interleaved", p2p_cases, "shm", timeout=120)
    assert results == [expected_p2p(r, 4) for r in range(4)]


def mismatch_then_recover(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    t = np.ones(5 if rank == 3 else 4, dtype=np.float32)
    try:
        dist.all_reduce(t)
        error = "no error"
    except dist.DistMismatchError as e:
        error = str(e)
    after = np.full(2, rank, dtype=np.int64)
    dist.all_reduce(after)
    dist.destroy_process_group()
    return error, after.tolist()


def test_mismatch_across_hosts_raises_everywhere_and_the_group_recovers(run_ranks):
    results = run_ranks(on_pretend_host, 4, "blocks", mismatch_then_recover, timeout=120)
    for rank, (error, after) in enumerate(results):
        assert error.startswith(f"rank {rank}: all_reduce(SUM"), error
        assert "rank 0 called all_reduce(SUM, 16 bytes of float32)" in error
        assert "rank 3 called all_reduce(SUM, 20 bytes of float32)" in error
        assert after == [6, 6]


def die_on_the_other_host(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    dist.barrier()
    if rank == 2:
        os._exit(3)
    try:
        dist.all_reduce(np.ones(4))
    except dist.DistError as e:
        return type(e).__name__, str(e)
    finally:
        dist.destroy_process_group()
    return "no error", ""


@pytest.mark.parametrize("inter", ["tcp", "gloo"])
def test_a_rank_dying_on_another_host_is_named(run_ranks, inter):
    """The group timeout is 60 s and the test's 50 s: errors must come from the death, whichever
    engine carries the leg between hosts (our TCP transport, or gloo: the automatic choice with torch)."""
    if inter == "gloo":
        pytest.importorskip("torch", reason="the gloo leg between hosts needs torch")
    results = run_ranks(on_pretend_host, 4, "blocks", die_on_the_other_host, timeout=50, errors="return",
                        env={"SHMDIST_INTER": inter})
    assert results[2].exitcode == 3
    for rank in (0, 3):     # host a's leader (waits on rank 2 over TCP) and rank 2's host mate
        kind, message = results[rank]
        assert kind == "DistPeerError" and "rank 2 " in message, (rank, kind, message)
    kind, message = results[1]  # waits on its leader, which left after it named rank 2, and says so
    assert kind == "DistPeerError" and "rank 0 left the group" in message, message
    assert "after rank 2 " in message, message

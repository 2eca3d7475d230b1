"""A timeout given to one barrier call is that call's limit, not the group's.

torch's ``dist.barrier(group, async_op, device_ids, timeout)`` takes one (it
reaches the backend as ``BarrierOptions.timeout``), and so does a group's own
``monitored_barrier(timeout)``; shmdist's ``barrier`` takes the same argument.
Every job here has a group timeout of 60 s and a barrier that nobody else
joins is given 0.5 s: the call must fail as a timeout within seconds, and a
backend that ignored the per-call timeout would wait the whole minute.

The shmdist test runs without torch; the torch ones skip without it.
"""
from __future__ import annotations

import datetime
import time

import pytest

try:
    import torch  # noqa: F401
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False

requires_torch = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

HALF = datetime.timedelta(seconds=0.5)


def _lonely(call, rank, label):
    """Run ``call`` (a barrier only rank 0 enters); (label, seconds, error text)."""
    start = time.monotonic()
    try:
        call()
    except Exception as e:          # noqa: BLE001  (the test asserts on type and text)
        return label, time.monotonic() - start, f"{type(e).__name__}: {e}"
    return label, time.monotonic() - start, "returned"


def shmdist_barrier_timeouts(rank, world_size, init_method):
    import shmdist as dist
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    a = dist.new_group([0, 1])
    b = dist.new_group([0, 1])
    out = []
    if rank == 0:         # a subgroup, timeout as seconds; another, as a timedelta and positionally
        out.append(_lonely(lambda: dist.barrier(a, timeout=0.5), rank, "subgroup, seconds"))
        out.append(_lonely(lambda: dist.barrier(b, False, None, HALF), rank, "subgroup, timedelta"))
    dist.barrier()          # the default group is untouched by its subgroups' timeouts
    if rank == 0:         # the default group (its one-call quick path)
        out.append(_lonely(lambda: dist.barrier(timeout=HALF), rank, "default group"))
    else:
        time.sleep(2)       # still in the job while rank 0 times out
    bad = None
    try:
        dist.barrier(a, timeout=-1) if rank == 0 else None
    except (ValueError, dist.DistError) as e:
        bad = str(e)
    dist.destroy_process_group()
    return out, bad


def test_shmdist_barrier_honours_its_own_timeout(run_ranks):
    results = run_ranks(shmdist_barrier_timeouts, 2, timeout=50)
    out, bad = results[0]
    assert [label for label, _, _ in out] == ["subgroup, seconds", "subgroup, timedelta", "default group"]
    for label, seconds, error in out:
        assert error.startswith("DistTimeoutError") and "Timed out after 0.5 s" in error, (label, error)
        assert 0.45 <= seconds < 20, f"{label}: the barrier returned after {seconds:.2f} s, not ~0.5 s"
    assert bad and "timeout must be a positive number" in bad, bad


def torch_barrier_timeouts(rank, world_size, init_method):
    import torch.distributed as dist
    import shmdist.torch  # noqa: F401
    dist.init_process_group("shm", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    a = dist.new_group([0, 1])
    b = dist.new_group([0, 1])
    c = dist.new_group([0, 1])
    out = []
    if rank == 0:
        out.append(_lonely(lambda: dist.barrier(a, timeout=HALF), rank, "dist.barrier"))
        out.append(_lonely(lambda: dist.barrier(b, async_op=True, timeout=HALF).wait(), rank,
                           "dist.barrier async"))
        out.append(_lonely(lambda: c.monitored_barrier(HALF), rank, "ProcessGroup.monitored_barrier"))
        d = dist.new_group([0, 1])      # gloo's test: a timeout of 0 times out at once, worded as gloo's
        zero = _lonely(lambda: d.monitored_barrier(datetime.timedelta(0)), rank, "monitored_barrier(0)")
    else:
        dist.new_group([0, 1])
        zero = None
    dist.barrier()
    if rank == 0:
        out.append(_lonely(lambda: dist.barrier(timeout=HALF), rank, "dist.barrier, default group"))
    else:
        time.sleep(2)
    dist.destroy_process_group()
    return out, zero


@requires_torch
def test_torch_barrier_honours_its_own_timeout(run_ranks):
    out, zero = run_ranks(torch_barrier_timeouts, 2, timeout=50)[0]
    label, seconds, error = zero
    assert "Rank 0 timed out in monitoredBarrier" in error and seconds < 20, zero
    assert [label for label, _, _ in out] == ["dist.barrier", "dist.barrier async",
                                              "ProcessGroup.monitored_barrier", "dist.barrier, default group"]
    for label, seconds, error in out:
        assert "Timed out after 0.5 s" in error, (label, error)
        assert 0.45 <= seconds < 20, f"{label}: the barrier returned after {seconds:.2f} s, not ~0.5 s"

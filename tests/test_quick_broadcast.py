"""A broadcast on the default group that fits one round of the arena is one C
call (Phaser.broadcast, GroupComm.quick_broadcast) when the other members are
already there, and finishes in Python when they are not: the same bytes,
errors and descriptors as the general path.

Bit-exact for every dtype kind, sizes from 0 bytes to one round, every root,
2 and 3 ranks, numpy and torch (bfloat16 too) mixed between ranks; that the
quick path was taken (the general GroupComm.broadcast counted); a late member;
calls that disagree raising on every rank; a read-only array and a bad root
getting the general path's errors; the root killed while the others wait."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import shmdist as dist

ROUND = 1 << 20      # SHMDIST_ARENA_BYTES' default: one round of the arena


def counting_general_broadcasts():
    """Count the calls that reach the general GroupComm.broadcast in this rank."""
    from shmdist.comm import arena
    seen = [0]
    general = arena.GroupComm.broadcast

    def counted(self, *args, **kwargs):
        seen[0] += 1
        return general(self, *args, **kwargs)
    arena.GroupComm.broadcast = counted
    return seen


def make(dtype: str, count: int, seed: int, as_torch: bool):
    rng = np.random.default_rng(seed)
    if dtype == "bfloat16":
        import torch
        return torch.from_numpy(rng.standard_normal(count).astype(np.float32)).to(torch.bfloat16)
    if dtype == "bool":
        a = rng.integers(0, 2, count).astype(bool)
    elif dtype.startswith("complex"):
        a = (rng.standard_normal(count) + 1j * rng.standard_normal(count)).astype(dtype)
    else:
        a = rng.integers(0, 100, count).astype(dtype)
    if as_torch:
        import torch
        return torch.from_numpy(a)
    return a


def same(a, b) -> bool:
    if hasattr(a, "numpy"):
        import torch
        if a.dtype == torch.bfloat16:
            return torch.equal(a, b)
        a, b = a.numpy(), b.numpy()
    return a.dtype == b.dtype and np.array_equal(a, b)


def many(rank, world_size, init_method, cases):
    seen = counting_general_broadcasts()
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    bad, general = [], []
    for i, (dtype, count, root, torch_on) in enumerate(cases):
        as_torch = dtype == "bfloat16" or rank in torch_on
        want = make(dtype, count, 100 + i, as_torch)
        t = want.clone() if as_torch else want.copy()
        if rank != root:
            t = t * 0 if dtype != "bool" else ~t if not as_torch else ~t
        before = seen[0]
        dist.broadcast(t, root)
        if not same(t, want):
            bad.append((i, dtype, count, root))
        if seen[0] != before:
            general.append((dtype, count))
    general = general or 0
    dist.destroy_process_group()
    return bad, general


def cases_for(world_size: int, torch_ok: bool) -> list:
    out = []
    dtypes = ["uint8", "int64", "float32", "float64", "float16", "bool", "complex64"]
    if torch_ok:
        dtypes.append("bfloat16")
    for k, dtype in enumerate(dtypes):
        itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
        for count in (0, 1, 4096 // itemsize + 3, ROUND // itemsize - 1):   # (from 1 MiB two members split)
            root = (k + count) % world_size
            torch_on = (1,) if torch_ok and k % 2 else ()
            if count == 0 and (dtype == "bfloat16" or torch_on):
                continue        # an empty torch tensor has no numpy view: the general path takes it
            out.append((dtype, count, root, torch_on))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_bit_exact_and_one_c_call(run_ranks, world_size):
    try:
        import torch  # noqa: F401
        torch_ok = True
    except ImportError:
        torch_ok = False
    cases = cases_for(world_size, torch_ok)
    res = run_ranks(many, world_size, cases, timeout=120)
    for bad, general in res:
        assert bad == []
        assert general == 0, "a broadcast that fits one round took the general path"


def bigger_than_a_round(rank, world_size, init_method):
    seen = counting_general_broadcasts()
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    from shmdist.api import fast
    want = np.arange(fast.paths.coll.slot + 8, dtype=np.uint8)    # one round: a buffer (8 MiB oversubscribed)
    t = want.copy() if rank == 0 else np.zeros_like(want)
    dist.broadcast(t, 0)
    ok = np.array_equal(t, want)
    dist.destroy_process_group()
    return ok, seen[0]


def test_bigger_than_a_round_takes_the_general_path(run_ranks):
    assert run_ranks(bigger_than_a_round, 3, timeout=60) == [(True, 1)] * 3


def late_member(rank, world_size, init_method):
    """Rank 1 comes 0.3 s late, twice: the others finish in Python (they slept), bytes exact."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    ok = []
    for k, root in enumerate((0, 1)):
        if rank == 1:
            time.sleep(0.3)
        want = np.full(5000, k + 7, dtype=np.int32)
        t = want.copy() if rank == root else np.zeros_like(want)
        dist.broadcast(t, root)
        ok.append(bool(np.array_equal(t, want)))
    dist.destroy_process_group()
    return ok


def test_a_late_member_gets_the_same_bytes(run_ranks):
    assert run_ranks(late_member, 3, timeout=60) == [[True, True]] * 3


def disagree(rank, world_size, init_method, how):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=20)
    t = np.zeros(1024, dtype=np.float32)
    if how == "root":
        root = rank          # every rank names itself
    else:
        root = 0
        if rank == 1:
            t = np.zeros(1024, dtype=np.float64 if how == "dtype" else np.float32)[: 512 if how == "size" else None]
    try:
        dist.broadcast(t, root)
        return "passed"
    except dist.DistMismatchError as e:
        return "broadcast" in str(e) and f"rank {rank}" in str(e)


@pytest.mark.parametrize("how", ["root", "size", "dtype"])
def test_calls_that_disagree_raise_on_every_rank(run_ranks, how):
    assert run_ranks(disagree, 2, how, timeout=60) == [True, True]


def bad_arguments(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=20)
    said = []
    t = np.zeros(16, dtype=np.float32)
    try:
        dist.broadcast(t, 5)
    except dist.DistError as e:
        said.append("src=5 is not a rank" in str(e))
    ro = np.zeros(16, dtype=np.float32)
    ro.flags.writeable = False
    try:
        dist.broadcast(ro if rank == 1 else t, 0)
        said.append("passed")
    except dist.DistError as e:
        said.append(rank == 1 and "read-only" in str(e))
    dist.destroy_process_group()
    return said


def test_bad_root_and_read_only_array_get_the_general_paths_errors(run_ranks):
    res = run_ranks(bad_arguments, 2, timeout=60, errors="return")
    assert res[1] == [True, True]
    assert res[0][0] is True


def root_killed(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    dist.barrier()
    if rank == 0:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        dist.broadcast(np.zeros(4096, np.uint8), 0)
        return "completed"
    except dist.DistError as e:
        return type(e).__name__, "rank 0" in str(e), time.monotonic() - t0 < 30


def test_the_root_killed_before_its_call_is_named(run_ranks):
    res = run_ranks(root_killed, 3, timeout=90, errors="return")
    assert res[1] == ("DistPeerError", True, True) and res[2] == ("DistPeerError", True, True), res

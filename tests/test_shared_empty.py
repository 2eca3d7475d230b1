"""shmdist.empty: arrays in memory the group's local members share, on which
all_reduce and broadcast above 256 KiB run in place (comm/shared.py).

Every result is checked against the same collective on a plain array of the
same data (the plain path is tested elsewhere against numpy), bit for bit.
The ranks count the calls that took the in-place path, so a test cannot pass
by silently falling back to the copying one. 3 and 4 ranks run on this
2-core machine, more ranks than cores.
"""
from __future__ import annotations

import gc
import glob
import os

import numpy as np
import pytest

import shmdist as dist
from shmdist.comm import shared

BIG = 70001            # float32 elements: 280 KB, above the in-place threshold, parts uneven
OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR")


def both_reduced(plain, shared_arr, op: str) -> list:
    """all_reduce ``plain`` then ``shared_arr`` with ``op``; each one's error's type name, or None."""
    errors = []
    for x in (plain, shared_arr):
        try:
            dist.all_reduce(x, getattr(dist.ReduceOp, op))
            errors.append(None)
        except dist.DistError as e:
            errors.append(type(e).__name__)
    return errors


def _count_in_place():
    """Wrap the in-place collectives so the rank can tell how often they ran."""
    calls = {"all_reduce": 0, "broadcast": 0}
    for name in calls:
        orig = getattr(shared, name)

        def counted(*a, _orig=orig, _name=name):
            calls[_name] += 1
            return _orig(*a)
        setattr(shared, name, counted)
    return calls


def _data(rank: int, count: int, dtype) -> np.ndarray:
    """Rank ``rank``'s values: small, varied, exact in every dtype here; near 1 for PRODUCT."""
    x = (np.arange(count) * 7 + rank * 13) % 23
    if np.dtype(dtype).kind == "f":
        return (1 + (x - 11) / 64).astype(dtype)
    return (x + 1).astype(dtype)


def _memfd_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("/memfd:shmdist" in line for line in f)


# ---------------------------------------------------------------- correctness against plain arrays

def against_plain(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    calls = _count_in_place()
    bad, expected_in_place = [], 0
    for dtype in ("float32", "float64", "int32", "int64"):
        for count in (BIG, 1000):
            for op in OPS:
                want = _data(rank, count, dtype)
                got = dist.empty((count,), dtype)
                got[:] = want
                errors = both_reduced(want, got, op)
                if errors[0] != errors[1]:
                    bad.append(f"{dtype} {op} {count}: plain {errors[0]}, shared {errors[1]}")
                elif errors[0] is None:
                    expected_in_place += count * np.dtype(dtype).itemsize > shared.IN_PLACE_MIN
                    if got.tobytes() != want.tobytes():
                        bad.append(f"{dtype} {op} {count}: {got[:4]} != {want[:4]}")
    # 2-D, and broadcast from every root
    for root in range(world_size):
        want = _data(rank, 3 * BIG, "float32").reshape(3, BIG)
        got = dist.empty((3, BIG), np.float32)
        got[...] = want
        dist.broadcast(want, root)
        dist.broadcast(got, root)
        if not np.array_equal(got, want):
            bad.append(f"broadcast from {root}")
    dist.destroy_process_group()
    return bad, calls, expected_in_place


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_reduce_and_broadcast_give_what_plain_arrays_give(run_ranks, world_size):
    for bad, calls, expected in run_ranks(against_plain, world_size, timeout=240):
        assert bad == []
        assert expected > 0 and calls["all_reduce"] == expected
        assert calls["broadcast"] == world_size


def half_floats(rank, world_size, init_method):
    import torch
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    calls = _count_in_place()
    bad = []
    for dtype in (torch.bfloat16, torch.float16):
        for op in ("SUM", "AVG", "PRODUCT", "MAX"):
            count = 150001                      # 300 KB of 2-byte floats
            want = torch.from_numpy(_data(rank, count, "float32")).to(dtype)
            got = dist.empty(count, dtype)
            if not isinstance(got, torch.Tensor) or got.dtype != dtype or got.shape != (count,):
                bad.append(f"empty({count}, {dtype}) gave {type(got).__name__}")
                continue
            got.copy_(want)
            dist.all_reduce(want, getattr(dist.ReduceOp, op))
            dist.all_reduce(got, getattr(dist.ReduceOp, op))
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                bad.append(f"{dtype} {op}")
    dist.destroy_process_group()
    return bad, calls["all_reduce"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_bfloat16_and_float16_torch_tensors(run_ranks, world_size):
    pytest.importorskip("torch")
    assert run_ranks(half_floats, world_size, timeout=180) == [([], 8)] * world_size


# ---------------------------------------------------------------- aliasing and views

def aliasing_and_views(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    calls = _count_in_place()
    n, bad = world_size, []
    k = BIG
    base = dist.empty((n * k,), np.float32)

    def same(name, got, want):
        if got.tobytes() != want.tobytes():
            bad.append(name)

    # contiguous slices at the same offset on every rank: in place
    plain = _data(rank, n * k, "float32")
    base[:] = plain
    dist.all_reduce(plain[k:], dist.ReduceOp.SUM)
    dist.all_reduce(base[k:], dist.ReduceOp.SUM)
    same("slice from k", base, plain)
    rows = base.reshape(n, k)
    plain = _data(rank, n * k, "float32").reshape(n, k)
    rows[...] = plain
    dist.broadcast(plain[1], 0)
    dist.broadcast(rows[1], 0)
    same("row 1 broadcast", rows, plain)
    in_place = dict(calls)
    # a strided view: moved through a contiguous copy, the result still lands in place
    plain = _data(rank, n * k, "float32")
    base[:] = plain
    dist.all_reduce(plain[::2])
    dist.all_reduce(base[::2])
    same("every other element", base, plain)
    strided_in_place = calls["all_reduce"] - in_place["all_reduce"]
    # one tensor as input and output of the other collectives (shared memory is ordinary to them)
    plain = _data(rank, n * k, "float32")
    base[:] = plain
    dist.all_to_all_single(plain, plain)
    dist.all_to_all_single(base, base)
    same("all_to_all_single in place", base, plain)
    plain = _data(rank, n * k, "float32")
    base[:] = plain
    dist.all_gather_into_tensor(plain, plain[rank * k:(rank + 1) * k].copy())
    dist.all_gather_into_tensor(base, base[rank * k:(rank + 1) * k])
    same("all_gather_into_tensor over its own input", base, plain)
    plain = _data(rank, n * k, "float32")
    base[:] = plain
    dist.reduce_scatter_tensor(plain[rank * k:(rank + 1) * k], plain)
    dist.reduce_scatter_tensor(base[rank * k:(rank + 1) * k], base)
    same("reduce_scatter_tensor into its own chunk", base, plain)
    # slices at different offsets on different ranks: they disagree, every rank says so
    mismatch = None
    try:
        dist.all_reduce(base[rank:rank + k])
    except dist.DistMismatchError as e:
        mismatch = str(e)
    x = np.ones(4)
    dist.all_reduce(x)                                  # the group is still in step
    dist.destroy_process_group()
    return bad, in_place, strided_in_place, mismatch, x.tolist()


def test_aliasing_and_views(run_ranks):
    for bad, in_place, strided, mismatch, after in run_ranks(aliasing_and_views, 2, timeout=120):
        assert bad == []
        assert in_place == {"all_reduce": 1, "broadcast": 1}
        assert strided == 0
        assert mismatch is not None and "at offset 0" in mismatch and "at offset 4" in mismatch
        assert after == [2.0] * 4


# ---------------------------------------------------------------- mismatches

def mixed_memory(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=30)
    out = []
    a = dist.empty(BIG, np.float32)
    b = dist.empty(BIG, np.float32)
    for x in (a if rank == 0 else np.zeros(BIG, np.float32),      # shared against ordinary
              a if rank == 0 else b):                             # two different allocations
        x[:] = 1
        try:
            dist.all_reduce(x)
            out.append(None)
        except dist.DistMismatchError as e:
            out.append(str(e))
    try:
        dist.broadcast(a if rank == 1 else np.zeros(BIG, np.float32), 0)
        out.append(None)
    except dist.DistMismatchError as e:
        out.append(str(e))
    for shape, dtype in (((4, rank + 1), np.float32), ((8,), np.float32 if rank else np.int32)):
        try:
            dist.empty(shape, dtype)
            out.append(None)
        except dist.DistMismatchError as e:
            out.append(str(e))
    try:                                   # bad arguments on one rank: its own error, a mismatch elsewhere
        dist.empty(-1 if rank == 0 else 5)
        out.append(None)
    except dist.DistError as e:
        out.append(f"{type(e).__name__}: {e}")
    a[:] = rank
    dist.all_reduce(a)                     # still in step
    out.append(float(a[-1]))
    dist.destroy_process_group()
    return out


def test_ordinary_and_shared_memory_mixed_is_a_mismatch_naming_the_ranks(run_ranks):
    for rank, out in enumerate(run_ranks(mixed_memory, 2, timeout=120)):
        mixed, other, bcast, shape, dtype, refused, last = out
        for text in (mixed, other, bcast):
            assert text is not None and f"rank {rank}:" in text
            assert "rank 0 called" in text and "rank 1 called" in text and "shmdist.empty memory" in text
        assert other.count("shmdist.empty memory #") == 2 and mixed.count("shmdist.empty memory #") == 1
        assert shape is not None and "empty(" in shape and "shape digest" in shape
        assert dtype is not None and "int32" in dtype and "float32" in dtype
        if rank == 0:
            assert refused.startswith("DistError") and "negative" in refused
        else:
            assert refused.startswith("DistMismatchError") and "refused" in refused
        assert last == 1.0


# ---------------------------------------------------------------- lifetime

def lifetime(rank, world_size, init_method, folder):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    gc.collect()
    maps0, out = _memfd_maps(), {}
    for i in range(300):                                   # many allocations, each dropped
        x = dist.empty((1 << 18) + i, np.float32)          # 1 MiB and a bit
        x[:] = i
        dist.all_reduce(x)
        assert x[0] == i * world_size
        del x
    gc.collect()
    out["maps_after_many"] = _memfd_maps() - maps0
    out["registry_after_many"] = len(shared.live)
    out["usage_after_many"] = dist.memory_usage()["empty_arrays"]
    view = dist.empty(BIG, np.float32)[10:20]             # a view alone keeps the memory
    view[:] = 3
    gc.collect()
    out["view_keeps"] = _memfd_maps() - maps0
    usage = dist.memory_usage()
    out["usage_with_view"] = usage["empty_arrays"], usage["total_mapped"] - usage["segment_bytes"] \
        - usage["collective_arenas"]
    del view
    gc.collect()
    out["view_gone"] = _memfd_maps() - maps0
    out["usage_view_gone"] = dist.memory_usage()["empty_arrays"]
    kept = dist.empty(BIG, np.float32)
    kept[:] = rank + 1
    dist.all_reduce(kept)
    dist.destroy_process_group()
    out["readable_after_destroy"] = float(kept[0])
    try:
        dist.empty(4)
        out["empty_after_destroy"] = None
    except dist.DistError as e:
        out["empty_after_destroy"] = f"{type(e).__name__}: {e}"
    dist.init_process_group("shm", f"file://{folder}/again", rank=rank, world_size=world_size)
    try:
        dist.all_reduce(kept)
        out["all_reduce_after_destroy"] = None
    except dist.DistError as e:
        out["all_reduce_after_destroy"] = str(e)
    dist.barrier()                                         # the new world is fine
    dist.destroy_process_group()
    del kept
    gc.collect()
    out["maps_at_end"] = _memfd_maps() - maps0
    return out


def test_memory_is_freed_with_the_last_array_and_use_after_destroy_is_clear(run_ranks, tmp_path):
    before = set(glob.glob("/dev/shm/*"))
    for out in run_ranks(lifetime, 2, str(tmp_path), timeout=180):
        assert out["maps_after_many"] == 0 and out["registry_after_many"] == 0
        assert out["view_keeps"] == 1 and out["view_gone"] == 0
        # memory_usage counts the mapping (every member's region), in the total too, and lets it go
        assert out["usage_after_many"] == 0 and out["usage_view_gone"] == 0
        counted, in_total = out["usage_with_view"]
        assert counted >= 2 * BIG * 4 and in_total == counted, out["usage_with_view"]
        assert out["readable_after_destroy"] == 3.0
        assert out["empty_after_destroy"].startswith("DistNotInitializedError")
        text = out["all_reduce_after_destroy"]
        assert text is not None and "was destroyed" in text and "shmdist.empty" in text
        assert out["maps_at_end"] <= 0
    assert set(glob.glob("/dev/shm/*")) - before == set()


# ---------------------------------------------------------------- across hosts

def across_hosts(rank, world_size, init_method):
    os.environ["SHMDIST_HOST_ID"] = f"pretend-host-{rank * 2 // world_size}"   # [a, a, b, b]
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    calls = _count_in_place()
    maps0 = _memfd_maps()
    x = dist.empty(BIG, np.float32)
    ordinary = _memfd_maps() == maps0 and not shared.live
    want = _data(rank, BIG, "float32")
    x[:] = want
    dist.all_reduce(want)
    dist.all_reduce(x)
    dist.broadcast(x, 3)
    dist.broadcast(want, 3)
    mismatch = None
    try:
        dist.empty(5 if rank else 6)
    except dist.DistMismatchError as e:
        mismatch = str(e)
    dist.destroy_process_group()
    return ordinary, x.tobytes() == want.tobytes(), calls, mismatch is not None


def test_across_hosts_it_is_ordinary_memory(run_ranks):
    for ordinary, same, calls, mismatch in run_ranks(across_hosts, 4, timeout=180):
        assert ordinary and same and mismatch
        assert calls == {"all_reduce": 0, "broadcast": 0}


# ---------------------------------------------------------------- through torch.distributed

def through_torch(rank, world_size, init_method):
    import torch
    import torch.distributed as tdist
    import shmdist.torch  # noqa: F401 - registers the backend "shm"
    tdist.init_process_group("shm", init_method=init_method, rank=rank, world_size=world_size)
    calls = _count_in_place()
    t = dist.empty((3, 1 << 16), torch.float32)
    t.fill_(rank + 1)
    tdist.all_reduce(t)
    summed = bool((t == sum(range(1, world_size + 1))).all())
    tdist.broadcast(t, 1)
    tdist.destroy_process_group()
    return summed, calls


def test_torch_distributed_all_reduce_on_a_shared_tensor_runs_in_place(run_ranks):
    pytest.importorskip("torch")
    assert run_ranks(through_torch, 2, timeout=120) == [(True, {"all_reduce": 1, "broadcast": 1})] * 2

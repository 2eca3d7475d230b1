"""The default group's all_reduce and broadcast of a tensor too big for the
one-call paths skip the general path's checks and second view of the tensor
once the general path took its dtype (and op) (shmdist/api/collectives.py,
_medium_buf): the same descriptor, the same bytes, the same errors.

Counted: after the first call of a dtype, every later big call of it stays
out of the general path (its _enter is counted), at 2 and 3 ranks, numpy
and torch (bfloat16, float16) mixed between ranks, multi-dimensional shapes;
results bit-exact against a reference added in rank order. Whatever the
general path alone may refuse or change still goes there: a tensor that
requires grad, a non-contiguous or read-only array, an op the dtype does not
take (refused on every later call, not once). Calls that disagree in dtype,
size or op after both ranks learned the path raise on every rank, name the
shape, and the group goes on."""
from __future__ import annotations

import numpy as np
import pytest

import shmdist as dist

BIG = (1 << 20) + 4096          # bytes: over every one-call path (2-rank all_reduce: 512 KiB; a round: 1 MiB)
SHAPE = (4, -1)                 # multi-dimensional: the Buf's shape comes from the view


def counting_general_calls():
    """Count the calls that reach the general path (collectives._enter) in this rank."""
    from shmdist.api import collectives
    seen = {"all_reduce": 0, "broadcast": 0}
    enter = collectives._enter

    def counted(op, group):
        if op in seen:
            seen[op] += 1
        return enter(op, group)
    collectives._enter = counted
    return seen


def values(dtype: str, rank: int, call: int, count: int) -> np.ndarray:
    """Small integers (exact in every dtype, sums too) that differ by rank, call and place."""
    v = (np.arange(count) * 7 + rank * 13 + call * 3) % 29 + 1
    return v.astype(np.float32 if dtype == "bfloat16" else dtype)


def make(dtype: str, data: np.ndarray, as_torch: bool):
    if not as_torch:
        return data.reshape(SHAPE).copy()
    import torch
    t = torch.from_numpy(data.astype(np.float32) if dtype == "bfloat16" else data.copy())
    return t.to(torch.bfloat16).reshape(SHAPE).contiguous() if dtype == "bfloat16" else t.reshape(SHAPE)


def as_numpy(t) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t.reshape(-1)
    import torch
    return (t.float() if t.dtype == torch.bfloat16 else t).reshape(-1).numpy()


def big_calls(rank, world_size, init_method, dtypes, torch_ranks):
    seen = counting_general_calls()
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    bad, general = [], {}
    for dtype in dtypes:
        itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
        count = BIG // itemsize // 4 * 4
        as_torch = rank in torch_ranks or dtype == "bfloat16"
        before = dict(seen)
        for call in range(4):
            t = make(dtype, values(dtype, rank, call, count), as_torch)
            dist.all_reduce(t)
            want = sum(values(dtype, r, call, count).astype(np.float64) for r in range(world_size))
            if not np.array_equal(as_numpy(t), want.astype(as_numpy(t).dtype)):
                bad.append(("all_reduce", dtype, call))
            root = call % world_size
            t = make(dtype, values(dtype, root if rank == root else 99, call, count), as_torch)
            dist.broadcast(t, root)
            if not np.array_equal(as_numpy(t), values(dtype, root, call, count).astype(as_numpy(t).dtype)):
                bad.append(("broadcast", dtype, call))
        general[dtype] = {op: seen[op] - before[op] for op in seen}
    dist.destroy_process_group()
    return bad, general


@pytest.mark.parametrize("world_size", [2, 3])
def test_after_the_first_call_big_calls_skip_the_general_path_and_stay_exact(run_ranks, world_size):
    dtypes = ["float32", "int64", "float64", "int32"]
    for bad, general in run_ranks(big_calls, world_size, dtypes, (), timeout=120):
        assert bad == []
        for dtype in dtypes:     # the first all_reduce learned the dtype's name, for broadcast too
            assert general[dtype] == {"all_reduce": 1, "broadcast": 0}, dtype


def test_torch_and_numpy_mixed_and_bfloat16_float16_on_the_medium_path(run_ranks):
    pytest.importorskip("torch")
    dtypes = ["float32", "float16", "bfloat16"]
    for bad, general in run_ranks(big_calls, 3, dtypes, (1,), timeout=120):
        assert bad == []
        assert general["float32"] == general["float16"] == {"all_reduce": 1, "broadcast": 0}
        assert general["bfloat16"] == {"all_reduce": 1, "broadcast": 0}   # its name is its own; its op learned once


def refused_or_changed(rank, world_size, init_method):
    """What only the general path may take, after the dtype and op were learned."""
    seen = counting_general_calls()
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    count = BIG // 4
    said = []
    t = np.ones(count, dtype=np.float32)
    dist.all_reduce(t)
    dist.broadcast(t, 0)                                         # float32 SUM and broadcast learned
    base = dict(seen)
    strided = np.ones(2 * count, dtype=np.float32)[::2]          # not C-contiguous: a copy, copied back
    dist.all_reduce(strided)
    said.append(bool((strided == 2).all()))
    for _ in range(2):                                           # refused every time, not only once
        try:
            dist.all_reduce(np.ones(count, dtype=np.float32), op=dist.ReduceOp.BAND)
            said.append("passed")
        except dist.DistError as e:
            said.append(f"rank {rank}" in str(e) and "BAND" in str(e) and "float32" in str(e))
    ro = np.ones(count, dtype=np.float32)
    ro.flags.writeable = False
    try:
        dist.broadcast(ro if rank == 1 else np.ones(count, dtype=np.float32), 0)
        said.append("passed")
    except dist.DistError as e:          # rank 1 its own error; the root, the refusal it met
        said.append(str(e))
    t = np.ones(count, dtype=np.float32)
    dist.broadcast(t, 1)                                         # the group goes on
    dist.all_reduce(t)
    said.append(bool((t == 2).all()))
    said.append({op: seen[op] - base[op] for op in seen})
    dist.destroy_process_group()
    return said


def test_what_only_the_general_path_may_take_still_goes_there(run_ranks):
    res = run_ranks(refused_or_changed, 2, timeout=60)
    for rank, said in enumerate(res):
        assert said[:3] == [True, True, True]          # strided exact; BAND refused twice, named
        assert said[-2] is True                        # the group went on
        print(rank, said[3])
    assert "rank 1" in res[1][3] and "read-only" in res[1][3]
    assert "rank 0" in res[0][3] and "rank 1" in res[0][3] and "broadcast" in res[0][3]
    # all_reduce: strided, BAND, BAND; broadcast: only rank 1's read-only one
    assert res[0][-1] == {"all_reduce": 3, "broadcast": 0}
    assert res[1][-1] == {"all_reduce": 3, "broadcast": 1}


def disagree(rank, world_size, init_method, how):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=20)
    count = BIG // 4 // 4 * 4
    for dtype in ("float32", "int32"):                  # both names and SUM learned, both ranks
        dist.all_reduce(np.ones(count, dtype=dtype))
    t = np.ones(count, dtype=np.float32).reshape(SHAPE)
    op = dist.ReduceOp.SUM
    if rank == 1:
        if how == "dtype":
            t = np.ones(count, dtype=np.int32).reshape(SHAPE)       # the same bytes, another dtype
        elif how == "size":
            t = np.ones(count + 4, dtype=np.float32).reshape(SHAPE)
        else:
            t, op = np.ones(count, dtype=np.int32).reshape(SHAPE), dist.ReduceOp.MAX
    if how == "op" and rank == 0:
        t = np.ones(count, dtype=np.int32).reshape(SHAPE)
    said = []
    for call in ("all_reduce", "broadcast"):
        if call == "broadcast" and how == "op":
            continue
        try:
            dist.all_reduce(t, op=op) if call == "all_reduce" else dist.broadcast(t, 0)
            said.append("passed")
        except dist.DistMismatchError as e:
            said.append(f"rank {rank}" in str(e) and call in str(e) and f"[4,{t.shape[1]}]" in str(e))
    ok = np.ones(count, dtype=np.float32)
    dist.all_reduce(ok)                                 # the group goes on
    said.append(bool((ok == 2).all()))
    dist.destroy_process_group()
    return said


@pytest.mark.parametrize("how", ["dtype", "size", "op"])
def test_big_calls_that_disagree_raise_on_every_rank_naming_the_shape(run_ranks, how):
    want = [True, True] if how == "op" else [True, True, True]
    assert run_ranks(disagree, 2, how, timeout=60) == [want, want]


def torch_tensors_it_must_not_take(rank, world_size, init_method):
    import torch
    seen = counting_general_calls()
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    count = BIG // 4
    dist.all_reduce(torch.ones(count))                  # float32 SUM learned
    base = dict(seen)
    said = []
    g = torch.ones(count, requires_grad=True)           # as gloo: written outside autograd, general path
    dist.all_reduce(g)
    said.append(bool((g.detach() == 2).all()) and g.grad_fn is None)
    p = torch.nn.Parameter(torch.ones(count))          # a subclass: the general path
    dist.broadcast(p, 0)
    said.append(bool((p.detach() == 1).all()))
    t = torch.ones(count)
    dist.all_reduce(t)                                  # medium; then the same memory, another shape
    t.resize_(count // 2, 2)
    t.fill_(rank + 1.0)
    dist.all_reduce(t)
    said.append(bool((t == 3).all()) and tuple(t.shape) == (count // 2, 2))
    said.append({op: seen[op] - base[op] for op in seen})
    dist.destroy_process_group()
    return said


def test_torch_tensors_that_need_the_general_path_take_it(run_ranks):
    pytest.importorskip("torch")
    for said in run_ranks(torch_tensors_it_must_not_take, 2, timeout=60):
        assert said == [True, True, True, {"all_reduce": 1, "broadcast": 1}]

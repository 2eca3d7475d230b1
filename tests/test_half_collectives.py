"""bfloat16 and float16 all_reduce / reduce through the C kernels, end to end.

Inputs that round (not the exact values test_collectives uses), in every
path: the one-call small all_reduce (numpy float16, torch bfloat16 and
float16), the C rounds of a large one, reduce to a root, reduce_scatter, and
AVG. Every rank must end with numpy's bits for the float32 sum in rank order
rounded once (reduce_ops' numpy path).
"""
import numpy as np
import pytest

import shmdist as dist
from shmdist.reduce_ops import ReduceOp, _from_f32, _to_f32

KiB, MiB = 1 << 10, 1 << 20


def values(dtype, rank, count):
    """Rank ``rank``'s input bits: magnitudes over many binades, so sums round."""
    rng = np.random.default_rng(1000 + rank)
    f = (rng.standard_normal(count) * 2.0 ** rng.integers(-12, 12, count)).astype(np.float32)
    if dtype == "bfloat16":
        return (f.view(np.uint32) >> 16).astype(np.uint16)
    return f.astype(np.float16).view(np.uint16)


def expected(dtype, world, count, op):
    acc = _to_f32(values(dtype, 0, count).view(np.float16 if dtype == "float16" else np.uint16), dtype)
    for r in range(1, world):
        x = values(dtype, r, count).view(np.float16 if dtype == "float16" else np.uint16)
        acc += _to_f32(x, dtype)
    if op == "AVG":
        acc /= np.float32(world)
    out = np.empty(count, np.float16 if dtype == "float16" else np.uint16)
    _from_f32(acc, out, dtype)
    return out.view(np.uint16)


def tensor_of(bits, dtype, kind):
    if kind == "numpy":
        return bits.view(np.float16).copy()
    import torch
    return torch.from_numpy(bits.astype(np.int16)).view(getattr(torch, dtype)).clone()


def bits_of(t):
    if isinstance(t, np.ndarray):
        return t.view(np.uint16).copy()
    import torch
    return t.view(torch.int16).numpy().view(np.uint16).copy()


def reduce_all(rank, world_size, init_method, dtype, kind, count, op):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    got = {}
    t = tensor_of(values(dtype, rank, count), dtype, kind)
    dist.all_reduce(t, op=ReduceOp[op])
    got["all_reduce"] = bits_of(t)
    t = tensor_of(values(dtype, rank, count), dtype, kind)
    dist.reduce(t, dst=world_size - 1, op=ReduceOp[op])
    if rank == world_size - 1:
        got["reduce"] = bits_of(t)
    if kind == "torch":
        import torch
        whole = tensor_of(values(dtype, rank, count * world_size), dtype, kind)
        out = torch.empty(count, dtype=getattr(torch, dtype))
        dist.reduce_scatter_tensor(out, whole, op=ReduceOp[op])
        got["reduce_scatter"] = bits_of(out)
    dist.destroy_process_group()
    return got


CASES = [("float16", "numpy"), ("float16", "torch"), ("bfloat16", "torch")]


@pytest.mark.parametrize("dtype,kind", CASES)
@pytest.mark.parametrize("count", [2 * KiB, 3 * MiB // 2 + 7])
@pytest.mark.parametrize("world,op", [(2, "SUM"), (3, "AVG")])
def test_half_reductions_give_numpys_bits_on_every_rank(run_ranks, dtype, kind, count, world, op):
    if kind == "torch":
        pytest.importorskip("torch")
    results = run_ranks(reduce_all, world, dtype, kind, count, op, timeout=120)
    want = expected(dtype, world, count, op)
    for rank, got in enumerate(results):
        assert np.array_equal(got["all_reduce"], want), f"all_reduce, rank {rank}"
        if "reduce_scatter" in got:
            whole = expected(dtype, world, count * world, op)
            assert np.array_equal(got["reduce_scatter"], whole[rank * count:(rank + 1) * count]), \
                f"reduce_scatter, rank {rank}"
    assert np.array_equal(results[-1]["reduce"], want)

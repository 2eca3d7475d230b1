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


def specials(dtype, rank, count):
    """values() with a NaN (rank 0 only: its payload is the result's), inf on
    rank 0 and -inf on the others at one index (inf - inf: a NaN made), and a
    smallest denormal everywhere at another: in the quick one-call path and in
    the C rounds, in the first and the last 32-element block."""
    bits = values(dtype, rank, count)
    nan, inf, ninf, tiny = ((0x7FC1, 0x7F80, 0xFF80, 0x0001) if dtype == "bfloat16" else
                            (0x7E01, 0x7C00, 0xFC00, 0x0001))
    for at in (3, count - 2):
        if rank == 0:
            bits[at] = nan
        bits[at - 1] = inf if rank == 0 else ninf
        bits[at - 2] = tiny
    return bits


def f32_specials(rank, count):
    rng = np.random.default_rng(2000 + rank)
    f = (rng.standard_normal(count) * 2.0 ** rng.integers(-12, 12, count)).astype(np.float32)
    for at in (3, count - 2):
        if rank == 0:
            f[at] = np.float32("nan")
        f[at - 1] = np.inf if rank == 0 else -np.inf
        f[at - 2] = np.finfo(np.float32).tiny / 8
    return f


def reduce_around_switch(rank, world_size, init_method, counts):
    """all_reduce SUM of every dtype at element counts around the 2-rank switch
    from the one-call path to the C rounds."""
    import torch
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    got = {}
    for dtype, count in counts:
        if dtype == "float32":
            t = f32_specials(rank, count)
        else:
            t = tensor_of(specials(dtype, rank, count), dtype, "torch")
        dist.all_reduce(t)
        got[(dtype, count)] = t.view(np.uint32).copy() if dtype == "float32" else bits_of(t)
    dist.destroy_process_group()
    return got


def test_all_reduce_around_the_pair_switch_gives_numpys_bits(run_ranks):
    """2 ranks: up to arena.SMALL_ALLREDUCE_PAIR bytes every rank reduces the
    whole vector (one call in C), above it the C rounds: one element either
    side, odd lengths, NaN, inf - inf and denormals in the first and last blocks."""
    pytest.importorskip("torch")
    from shmdist.comm.arena import SMALL_ALLREDUCE_PAIR
    counts = []
    for dtype, isz in (("float32", 4), ("bfloat16", 2), ("float16", 2)):
        edge = SMALL_ALLREDUCE_PAIR // isz
        counts += [(dtype, edge + d) for d in (-1, 0, 1, 33)]
    results = run_ranks(reduce_around_switch, 2, counts, timeout=120)
    for dtype, count in counts:
        if dtype == "float32":
            with np.errstate(all="ignore"):
                want = (f32_specials(0, count) + f32_specials(1, count)).view(np.uint32)
        else:
            acc = _to_f32(specials(dtype, 0, count).view(np.float16 if dtype == "float16" else np.uint16), dtype)
            with np.errstate(all="ignore"):
                acc += _to_f32(specials(dtype, 1, count).view(np.float16 if dtype == "float16" else np.uint16),
                               dtype)
            out = np.empty(count, np.float16 if dtype == "float16" else np.uint16)
            _from_f32(acc, out, dtype)
            want = out.view(np.uint16)
        for rank, got in enumerate(results):
            g = got[(dtype, count)]
            bad = np.flatnonzero(g != want)
            assert bad.size == 0, f"{dtype} x {count}, rank {rank}: {bad.size} differ, first at {bad[:5]}: " \
                                  f"{[hex(int(g[i])) for i in bad[:3]]} vs {[hex(int(want[i])) for i in bad[:3]]}"

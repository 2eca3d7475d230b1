"""Attacks on the bfloat16 / float16 reduction promise (README: "float16 and
bfloat16 reductions accumulate in float32 and round once (to nearest even;
NaN stays NaN). Every rank combines inputs in rank order, so floating-point
results are bitwise identical on all ranks"; shmdist/_half.h).

The reference here is written independently of reduce_ops: per element,
acc = float32(x_0); acc = acc op float32(x_1); ... in rank order (numpy
float32 arithmetic), AVG divides the float32 sum by the member count, then one
rounding: bfloat16 by round-to-nearest-even on the float32 bits (a NaN
quietened, its sign and top payload kept), float16 by numpy's astype (RNE).
Results are compared as uint16 bits, on every rank, on every internal path
(one-call small all_reduce, the 2-member split, the C rounds, the Python
rounds for MIN/MAX, reduce, reduce_scatter, the torch "shm" backend), every
kernel build this CPU has (_core.set_half_limit), and ranks running different
builds from each other.
"""
from __future__ import annotations

import numpy as np
import pytest

import shmdist as dist
from shmdist import _core
from shmdist.reduce_ops import ReduceOp

KiB, MiB = 1 << 10, 1 << 20
LEVELS = list(range(_core.half_level() + 1))
NP = {"bfloat16": np.uint16, "float16": np.float16}


# ------------------------------------------------------------------ reference

def widen(bits: np.ndarray, dtype: str) -> np.ndarray:
    bits = np.asarray(bits, np.uint16)
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


def narrow(acc: np.ndarray, dtype: str) -> np.ndarray:
    acc = np.ascontiguousarray(acc, np.float32)
    if dtype == "float16":
        with np.errstate(all="ignore"):
            return acc.astype(np.float16).view(np.uint16)
    b = acc.view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(acc)
    r[nan] = ((b[nan] >> 16) | 0x40).astype(np.uint16)
    return r


QUIET = np.uint32(0x400000)


def reference(rows, dtype: str, op: str) -> np.ndarray:
    """rows: each rank's uint16 bits, in rank order. The NaN rule is spelled
    out (x86's, which _half.h documents): a NaN accumulator stays, quietened;
    else a NaN input comes through, quietened; a NaN made (inf - inf, 0 * inf)
    is the hardware's default NaN. numpy's own acc + x does NOT follow one rule
    for two NaN operands (its vector body and scalar tail keep different
    operands' payloads), so it cannot be the reference there. MIN and MAX are
    numpy's (reduce_ops), compared up to NaN payloads by the caller."""
    fn = {"SUM": np.add, "AVG": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum}[op]
    with np.errstate(all="ignore"):
        acc = widen(rows[0], dtype).copy()
        for x in rows[1:]:
            w = widen(x, dtype)
            new = fn(acc, w)
            if op not in ("MIN", "MAX"):
                nb, ab, wb = new.view(np.uint32), acc.view(np.uint32), w.view(np.uint32)
                a_nan, w_nan = np.isnan(acc), np.isnan(w)
                nb[w_nan] = wb[w_nan] | QUIET
                nb[a_nan] = ab[a_nan] | QUIET
            acc = new
        if op == "AVG":
            acc = acc / np.float32(len(rows))
    return narrow(acc, dtype)


def nan_mask(bits: np.ndarray, dtype: str) -> np.ndarray:
    bits = np.asarray(bits, np.uint16)
    if dtype == "bfloat16":
        return (bits & 0x7FFF) > 0x7F80
    return (bits & 0x7FFF) > 0x7C00


def diff_text(got, want, dtype, label) -> str:
    bad = np.flatnonzero(got != want)
    show = [(int(i), hex(int(got[i])), hex(int(want[i]))) for i in bad[:6]]
    return f"{label} {dtype}: {bad.size} of {got.size} differ (index, got, want): {show}"


def assert_bits(got, want, dtype, label):
    got, want = np.asarray(got, np.uint16), np.asarray(want, np.uint16)
    assert got.shape == want.shape, label
    assert np.array_equal(got, want), diff_text(got, want, dtype, label)


# ------------------------------------------------------------------ inputs

# (dtype, per-rank bits) tuples of hostile cases; ranks beyond a tuple add -0.0 (the identity: x + -0 == x)
SPECIAL = {
    "bfloat16": [
        (0x3F80, 0x3B80),            # 1 + 2^-8: a tie, rounds to even (1.0)
        (0x3F81, 0x3B80),            # (1 + 2^-7) + 2^-8: a tie, rounds up to 1 + 2^-6
        (0xBF81, 0xBB80),            # the same, negative
        (0x3F80, 0x3B80, 0x3B80),    # two ties in float32 make an exact 1 + 2^-7
        (0x3F80, 0x3B80, 0x3380),    # just over the tie: up
        (0x3F80, 0x3B80, 0xB380),    # just under the tie: down
        (0x0001, 0x0001),            # smallest denormals: 2 x 2^-133
        (0x0001, 0x8001),            # denormal minus itself: +0
        (0x007F, 0x0001),            # largest denormal + smallest: the smallest normal
        (0x0080, 0x8001),            # smallest normal - smallest denormal: a denormal
        (0x8000, 0x8000),            # -0 + -0 = -0
        (0x8000, 0x0000),            # -0 + +0 = +0
        (0x7F7F, 0x7F7F),            # max + max: inf
        (0x7F7F, 0x7B00),            # max + a half ulp: overflows by rounding (tie, odd max -> inf)
        (0xFF7F, 0xFF7F),            # -inf
        (0x7F80, 0xFF80),            # inf - inf: a NaN made
        (0x7F80, 0x3F80),            # inf + 1
        (0x7FC1, 0x3F80),            # a NaN with payload, first
        (0x3F80, 0xFFA5),            # a NaN with payload, second
        (0x7F81, 0x3F80),            # a signalling NaN: quietened
        (0x7FC1, 0xFFA5),            # two NaNs: the first one's payload
        (0x3F80, 0x7F81, 0x7FC3),    # a NaN then another
        (0x4B80, 0x3F80),            # 2^24 + 1: lost in float32 too
        (0x0001, 0x3F80),            # denormal + 1
        (0x3F80, 0x0001, 0xBF80),    # 1 + tiny - 1: float32 loses the tiny in rank order: +0
    ],
    "float16": [
        (0x3C00, 0x1000),            # 1 + 2^-11: a tie, rounds to even (1.0)
        (0x3C01, 0x1000),            # (1 + 2^-10) + 2^-11: rounds up
        (0xBC01, 0x9000),
        (0x3C00, 0x1000, 0x1000),    # ties summed in float32: exact 1 + 2^-10
        (0x3C00, 0x1000, 0x0001),    # just over the tie
        (0x3C00, 0x1000, 0x8001),    # just under the tie
        (0x0001, 0x0001),            # smallest denormals
        (0x0001, 0x8001),            # +0
        (0x03FF, 0x0001),            # largest denormal + smallest: smallest normal
        (0x0400, 0x8001),            # a denormal
        (0x0001, 0x0000, 0x0000),
        (0x8000, 0x8000),            # -0
        (0x8000, 0x0000),            # +0
        (0x7BFF, 0x4C00),            # 65504 + 16 = 65520: tie above max, odd max -> inf
        (0x7BFF, 0x4BFF),            # 65504 + 15.99: stays max
        (0xFBFF, 0xCC00),            # -inf
        (0x7BFF, 0x7BFF),            # inf
        (0x7C00, 0xFC00),            # inf - inf
        (0x7E01, 0x3C00),            # NaN payload first
        (0x3C00, 0xFE05),            # NaN payload second
        (0x7C01, 0x3C00),            # a signalling NaN
        (0x7E01, 0xFE05),            # two NaNs
        (0x5BFF, 0x0001),            # 255.9 + tiny
        (0x6800, 0x3C00),            # 2048 + 1: a tie in float16, even
        (0x6801, 0x3C00),            # 2050 + 1: a tie, up
        (0x3C00, 0x0001, 0xBC00),    # 1 + tiny - 1 in float32: the tiny survives (float32 holds it)
        (0x0200, 0x0200),            # denormal + denormal = smallest normal
    ],
}
ZERO_PAD = 0x8000


def inputs(dtype: str, world: int, count: int, seed: int) -> list[np.ndarray]:
    """Every rank's bits (the same list on every rank): random values over many
    binades, uniformly random bit patterns (NaNs, infinities, denormals of
    both signs), and SPECIAL tuples at the start, the end and every 4099th
    element (so every 32-block phase and both sides of each path's boundary
    get some)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(world):
        f = (rng.standard_normal(count) * 2.0 ** rng.integers(-20, 20, count)).astype(np.float32)
        if dtype == "bfloat16":
            bits = narrow(f, dtype)
        else:
            with np.errstate(all="ignore"):
                bits = f.astype(np.float16).view(np.uint16)
        raw = rng.random(count) < 0.02
        bits[raw] = rng.integers(0, 1 << 16, int(raw.sum()), dtype=np.uint16)
        rows.append(bits)
    table = SPECIAL[dtype]
    spots = list(range(min(count, 64))) + list(range(max(0, count - 64), count)) + \
        list(range(0, count, 4099)) + list(range(31, count, 4096))
    for k, at in enumerate(sorted(set(spots))):
        case = table[(k * 7) % len(table)]
        for r in range(world):
            rows[r][at] = case[r] if r < len(case) else ZERO_PAD
    return rows


# ------------------------------------------------------------------ the kernels alone

@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_kernel_every_build_matches_the_reference(level, dtype):
    """_core.reduce_half at every build this CPU has (plain C, AVX2, AVX-512,
    AVX-512 BF16/FP16): SUM, PRODUCT, AVG, 2-5 inputs, the hostile SPECIAL
    cases and random bit patterns, odd counts around the 16/32-lane blocks and
    the 1024-float block, unaligned (odd-element) inputs and output, and the
    in-place form (output = input 0)."""
    _core.set_half_limit(level)
    try:
        for n in (2, 3, 4, 5):
            for count in (1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 63, 65, 1023, 1025, 4099):
                rows = inputs(dtype, n, count, seed=count * 10 + n)
                for op in ("SUM", "PRODUCT", "AVG"):
                    want = reference(rows, dtype, op)
                    # unaligned: each row a slice at an odd element of a bigger array
                    arrs = []
                    for r in rows:
                        big = np.zeros(count + 3, np.uint16)
                        big[1:1 + count] = r
                        arrs.append(big[1:1 + count].view(NP[dtype]))
                    outbig = np.zeros(count + 1, np.uint16)
                    out = outbig[1:].view(NP[dtype])
                    assert _core.reduce_half(out, arrs, int(ReduceOp[op]), dtype, n)
                    assert_bits(out.view(np.uint16), want, dtype, f"level {level} n {n} count {count} {op}")
                    inplace = [a.copy() for a in arrs]
                    assert _core.reduce_half(inplace[0], inplace, int(ReduceOp[op]), dtype, n)
                    assert_bits(inplace[0].view(np.uint16), want, dtype,
                                f"in place, level {level} n {n} count {count} {op}")
    finally:
        _core.set_half_limit(99)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_kernel_random_bit_patterns_pairs(level, dtype):
    """Two inputs of uniformly random 16-bit patterns (every class: NaN, inf,
    denormal, normal, both signs) and pairs of nearby magnitudes whose sums
    often tie: 200k elements per op, every build. Attacks the level-3 claims
    (vcvtne2ps2bf16 with its denormal flush, vaddph/vmulph double rounding)."""
    _core.set_half_limit(level)
    try:
        rng = np.random.default_rng(77 + level)
        count = 200_000
        a = rng.integers(0, 1 << 16, count, dtype=np.uint16)
        b = rng.integers(0, 1 << 16, count, dtype=np.uint16)
        # the second half: b within a few binades of a (sums round, many ties)
        h = count // 2
        shift = rng.integers(0, 14, h).astype(np.uint16) << (7 if dtype == "bfloat16" else 10)
        b[h:] = (a[h:] & 0x8000) ^ (rng.integers(0, 2, h).astype(np.uint16) << 15) | \
            ((a[h:] & 0x7FFF) - np.minimum(a[h:] & 0x7FFF, shift)) ^ rng.integers(0, 4, h).astype(np.uint16)
        for op in ("SUM", "PRODUCT", "AVG"):
            want = reference([a, b], dtype, op)
            out = np.empty(count, NP[dtype])
            assert _core.reduce_half(out, [a.view(NP[dtype]), b.view(NP[dtype])], int(ReduceOp[op]), dtype, 2)
            assert_bits(out.view(np.uint16), want, dtype, f"level {level} {op}")
    finally:
        _core.set_half_limit(99)


# ------------------------------------------------------------------ through the collectives

def _tensor(bits: np.ndarray, dtype: str, kind: str, offset: int = 0):
    """A tensor (or numpy array) holding ``bits``; ``offset`` > 0: a contiguous
    slice starting at that element of a bigger one (unaligned)."""
    count = bits.size
    if kind == "numpy":
        big = np.zeros(count + offset + 1, np.uint16)
        big[offset:offset + count] = bits
        return big[offset:offset + count].view(np.float16)
    import torch
    big = torch.zeros(count + offset + 1, dtype=torch.int16)
    big[offset:offset + count] = torch.from_numpy(bits.view(np.int16))
    return big[offset:offset + count].view(getattr(torch, dtype))


def _bits(t) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t.view(np.uint16).copy()
    import torch
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).copy()


def _collectives(rank, world_size, init_method, cases, level):
    """For each (dtype, kind, count, op, offset, seed): all_reduce twice (the second
    call after the path learned the dtype), reduce to the last rank, and
    reduce_scatter (torch tensors: reduce_scatter_tensor). ``level``: the
    kernel build cap of this rank (a list: one per rank)."""
    if level is not None:
        _core.set_half_limit(level[rank])
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    got = {}
    for dtype, kind, count, op, offset, seed, what in cases:
        rows = inputs(dtype, world_size, count, seed)
        rop = ReduceOp[op]
        if "all_reduce" in what:
            for call in range(2):
                t = _tensor(rows[rank], dtype, kind, offset)
                dist.all_reduce(t, op=rop)
                got[(dtype, kind, count, op, offset, "all_reduce", call)] = _bits(t)
        if "reduce" in what:
            t = _tensor(rows[rank], dtype, kind, offset)
            dist.reduce(t, dst=world_size - 1, op=rop)
            if rank == world_size - 1:
                got[(dtype, kind, count, op, offset, "reduce", 0)] = _bits(t)
        if "reduce_scatter" in what:
            whole = inputs(dtype, world_size, count * world_size, seed + 1)
            if kind == "torch":
                import torch
                out = torch.empty(count, dtype=getattr(torch, dtype))
                dist.reduce_scatter_tensor(out, _tensor(whole[rank], dtype, kind, offset), op=rop)
            else:
                out = np.empty(count, np.float16)
                ins = [_tensor(whole[rank][j * count:(j + 1) * count], dtype, kind, offset)
                       for j in range(world_size)]
                dist.reduce_scatter(out, ins, op=rop)
            got[(dtype, kind, count, op, offset, "reduce_scatter", 0)] = _bits(out)
    dist.destroy_process_group()
    return got


def _loose(got, want, dtype):
    """MIN/MAX: numpy's NaN payloads are not one rule; compare NaN as NaN."""
    nan = nan_mask(want, dtype)
    assert np.array_equal(nan_mask(got, dtype), nan)
    got, want = np.array(got, np.uint16), np.array(want, np.uint16)
    got[nan] = want[nan] = 0x7FFF
    return got, want


def _check(results, cases, world):
    for dtype, kind, count, op, offset, seed, what in cases:
        want = reference(inputs(dtype, world, count, seed), dtype, op)
        mine = [{k[5:]: v for k, v in got.items() if k[:5] == (dtype, kind, count, op, offset)}
                for got in results]
        if op in ("MIN", "MAX"):
            for rank, got in enumerate(mine[1:], 1):     # the same bits, NaN payloads too, on every rank
                for key in got:
                    if key[0] == "all_reduce":
                        assert_bits(got[key], mine[0][key], dtype, f"{op} rank {rank} vs rank 0")
            mine = [{k: (_loose(v, want, dtype)[0] if k[0] != "reduce_scatter" else v) for k, v in got.items()}
                    for got in mine]
            want = _loose(want, want, dtype)[0]
        label = f"{kind} x{count} {op} offset {offset}"
        for rank, got in enumerate(mine):
            for call in range(2):
                if ("all_reduce", call) in got:
                    assert_bits(got[("all_reduce", call)], want, dtype, f"all_reduce {label} call {call}, rank {rank}:")
            if ("reduce_scatter", 0) in got:
                whole = reference(inputs(dtype, world, count * world, seed + 1), dtype, op)
                if op in ("MIN", "MAX"):
                    g, w = _loose(got[("reduce_scatter", 0)], whole[rank * count:(rank + 1) * count], dtype)
                else:
                    g, w = got[("reduce_scatter", 0)], whole[rank * count:(rank + 1) * count]
                assert_bits(g, w, dtype, f"reduce_scatter {label}, rank {rank}:")
        if "reduce" in what:
            assert_bits(mine[-1][("reduce", 0)], want, dtype, f"reduce {label}:")


ALL = ("all_reduce", "reduce", "reduce_scatter")
SMALL_COUNTS = (1, 2, 3, 7, 15, 16, 17, 31, 33, 63, 65)


def _pair_cases():
    from shmdist.comm.arena import SMALL_ALLREDUCE_PAIR, SPLIT_CHUNK
    edge, chunk = SMALL_ALLREDUCE_PAIR // 2, SPLIT_CHUNK // 2
    cases = []
    for dtype, kind in (("bfloat16", "torch"), ("float16", "torch"), ("float16", "numpy")):
        for i, count in enumerate(SMALL_COUNTS):
            cases.append((dtype, kind, count, ("SUM", "AVG", "PRODUCT")[i % 3], i % 2, 11 + i, ALL))
        for count in (chunk - 1, chunk + 1, edge - 1, edge, edge + 1, 2 * edge + 1):
            cases.append((dtype, kind, count, "SUM", count % 2, count, ("all_reduce",)))
        cases.append((dtype, kind, edge + 33, "AVG", 1, 5, ALL))
        cases.append((dtype, kind, 3 * MiB + 5, "SUM", 0, 6, ("all_reduce", "reduce")))
    return cases


def test_pair_every_path_gives_the_reference_bits(run_ranks):
    """2 ranks: counts 1..65, both sides of the split chunk (256 KiB), of the
    one-call limit (512 KiB) and the arena slot (1 MiB), and 3 MiB + 5
    elements (the split / C rounds), SUM/AVG/PRODUCT, aligned and unaligned
    (odd-element slices) tensors, each all_reduce twice (the fast path after the
    general one learned the dtype), reduce and reduce_scatter: every rank has
    the reference bits."""
    pytest.importorskip("torch")
    cases = _pair_cases()
    _check(run_ranks(_collectives, 2, cases, None, timeout=90), cases, 2)


def _group_cases(world):
    from shmdist.comm.arena import SMALL_ALLREDUCE
    edge = SMALL_ALLREDUCE // 2
    cases = []
    for dtype, kind in (("bfloat16", "torch"), ("float16", "numpy")):
        for i, count in enumerate((1, 17, 33, 65)):
            cases.append((dtype, kind, count, ("SUM", "AVG", "PRODUCT", "SUM")[i], i % 2, 21 + i, ALL))
        for count in (edge - 1, edge + 1):
            cases.append((dtype, kind, count, "SUM", 1, count, ("all_reduce", "reduce")))
        cases.append((dtype, kind, (1 << 21) + 3, "AVG", 1, 8, ("all_reduce",)))   # past a 4 MiB round
    return cases


@pytest.mark.parametrize("world", [3, 4])
def test_three_and_four_ranks_give_the_reference_bits(run_ranks, world):
    """3 and 4 ranks (more ranks than this host's cores: 4 MiB rounds): both
    sides of the 64 KiB one-call limit and past one round, SUM/AVG/PRODUCT,
    unaligned tensors, all_reduce twice, reduce and reduce_scatter."""
    pytest.importorskip("torch")
    cases = _group_cases(world)
    _check(run_ranks(_collectives, world, cases, None, timeout=120), cases, world)


def test_ranks_on_different_kernel_builds_agree(run_ranks):
    """Rank 0 on the plain-C kernels, rank 1 on the best build (AVX-512 BF16
    here): where each rank reduces the whole vector itself (the one-call
    path) both must still get the same, reference, bits; and the C rounds
    where each reduces its own part."""
    pytest.importorskip("torch")
    cases = [(dtype, kind, count, op, 1, 40 + count % 97, ("all_reduce", "reduce_scatter"))
             for dtype, kind in (("bfloat16", "torch"), ("float16", "numpy"))
             for count, op in ((33, "SUM"), (4099, "AVG"), ((1 << 18) - 1, "SUM"), ((1 << 19) + 7, "PRODUCT"))]
    _check(run_ranks(_collectives, 2, cases, [0, 99], timeout=90), cases, 2)


@pytest.mark.parametrize("level", [0, 1])
def test_plain_c_and_avx2_builds_through_the_collectives(run_ranks, level):
    """Every rank capped to the plain-C (0) or AVX2 (1) kernels, as on a CPU
    without AVX-512: the same bits on the small, split and round paths."""
    pytest.importorskip("torch")
    cases = [(dtype, "torch", count, op, 1, 60 + count % 89, ("all_reduce", "reduce"))
             for dtype in ("bfloat16", "float16")
             for count, op in ((65, "AVG"), ((1 << 18) + 1, "SUM"), ((1 << 20) + 5, "SUM"))]
    _check(run_ranks(_collectives, 2, cases, [level, level], timeout=90), cases, 2)


def test_min_max_of_half_types(run_ranks):
    """MIN and MAX of bfloat16 / float16 (not in the C kernels: reduce_ops'
    numpy path, small and large): compared exactly in float32 then rounded
    (exact: the values are all 16-bit already), NaNs kept, on every rank."""
    pytest.importorskip("torch")
    cases = [(dtype, kind, count, op, 1, 80 + count % 7, ("all_reduce", "reduce"))
             for dtype, kind in (("bfloat16", "torch"), ("float16", "numpy"))
             for count, op in ((33, "MIN"), (65, "MAX"), ((1 << 19) + 3, "MAX"))]
    _check(run_ranks(_collectives, 2, cases, None, timeout=90), cases, 2)


# ------------------------------------------------------------------ torch.distributed, backend "shm"

def _torch_backend(rank, world_size, init_method, cases):
    import torch
    import torch.distributed as tdist
    import shmdist.torch  # noqa: F401  (registers "shm")
    tdist.init_process_group(backend="shm", init_method=init_method, rank=rank, world_size=world_size)
    ops = {"SUM": tdist.ReduceOp.SUM, "AVG": tdist.ReduceOp.AVG, "PRODUCT": tdist.ReduceOp.PRODUCT,
           "MIN": tdist.ReduceOp.MIN, "MAX": tdist.ReduceOp.MAX}
    got = {}
    for dtype, kind, count, op, offset, seed, what in cases:
        rows = inputs(dtype, world_size, count, seed)
        for call in range(2):
            t = _tensor(rows[rank], dtype, "torch", offset)
            work = tdist.all_reduce(t, op=ops[op], async_op=bool(call))
            if work is not None:
                work.wait()
            got[(dtype, kind, count, op, offset, "all_reduce", call)] = _bits(t)
        t = _tensor(rows[rank], dtype, "torch", offset)
        tdist.reduce(t, dst=world_size - 1, op=ops[op])
        if rank == world_size - 1:
            got[(dtype, kind, count, op, offset, "reduce", 0)] = _bits(t)
        whole = inputs(dtype, world_size, count * world_size, seed + 1)
        out = torch.empty(count, dtype=getattr(torch, dtype))
        work = tdist.reduce_scatter_tensor(out, _tensor(whole[rank], dtype, "torch", offset), op=ops[op],
                                           async_op=True)
        work.wait()
        got[(dtype, kind, count, op, offset, "reduce_scatter", 0)] = _bits(out)
    tdist.destroy_process_group()
    return got


@pytest.mark.parametrize("world", [2, 3])
def test_torch_shm_backend_gives_the_reference_bits(run_ranks, world):
    """torch.distributed with backend "shm": all_reduce (sync, then async_op),
    reduce and reduce_scatter_tensor (async_op) of bfloat16 and float16
    tensors, SUM/AVG/PRODUCT/MAX, small, past the one-call limits, unaligned."""
    pytest.importorskip("torch")
    cases = [(dtype, "torch", count, op, count % 2, 100 + count % 13, ALL)
             for dtype in ("bfloat16", "float16")
             for count, op in ((7, "AVG"), (33, "SUM"), (65, "PRODUCT"), (1025, "MAX"),
                               ((1 << 18) + 1, "AVG"), ((1 << 19) + 5, "SUM"))]
    _check(run_ranks(_torch_backend, world, cases, timeout=120), cases, world)


def _strided(rank, world_size, init_method, cases):
    import torch
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    got = {}
    for dtype, count, op, seed in cases:
        rows = inputs(dtype, world_size, count, seed)
        for call in range(2):                                # the second after the dtype was learned
            big = torch.zeros(2 * count + 1, dtype=torch.int16)
            big[1::2] = torch.from_numpy(rows[rank].view(np.int16))
            t = big.view(getattr(torch, dtype))[1::2]      # every other element, from an odd one
            dist.all_reduce(t, op=ReduceOp[op])
            got[(dtype, count, op, call)] = _bits(t)
        got[(dtype, count, op, "gaps")] = big[0::2].numpy().copy()
    dist.destroy_process_group()
    return got


def test_non_contiguous_half_tensors(run_ranks):
    """A strided bfloat16 / float16 tensor (every other element, starting at an
    odd one): the reduction lands in the right elements with the reference
    bits, and the elements between them stay untouched."""
    pytest.importorskip("torch")
    cases = [(dtype, count, op, 300 + count % 11) for dtype in ("bfloat16", "float16")
             for count, op in ((33, "SUM"), (4097, "AVG"), ((1 << 18) + 1, "SUM"))]
    results = run_ranks(_strided, 2, cases, timeout=60)
    for dtype, count, op, seed in cases:
        want = reference(inputs(dtype, 2, count, seed), dtype, op)
        for rank, got in enumerate(results):
            for call in range(2):
                assert_bits(got[(dtype, count, op, call)], want, dtype, f"strided x{count} {op} call {call}, rank {rank}:")
            assert not got[(dtype, count, op, "gaps")].any()

"""Single-process, bit-exact tests of the reduction kernels added for speed,
against numpy, in every build the CPU runs (AVX-512, AVX2, plain C):

- _sum.h: float32/float64 SUM and PRODUCT of all inputs in one pass (what the
  C rounds and the small all_reduce run), rank order as numpy's reduce;
- _half.h's AVX-512 fast path: 32-element blocks with no NaN input in plain
  vector arithmetic, blocks with one through the careful build.
"""
import numpy as np
import pytest

from shmdist import _core
from shmdist.reduce_ops import ReduceOp, _from_f32, _to_f32

LEVELS = list(range(_core.half_level() + 1))
COUNTS = [0, 1, 15, 31, 32, 33, 63, 64, 65, 1000, 4099]


@pytest.fixture(autouse=True)
def all_builds():
    yield
    _core.set_half_limit(99)     # no cap: the best build this CPU has


def rows_of(dtype, n, count, seed):
    """n rows of ``count`` values: normal ones, large ones whose products
    overflow, infinities of both signs (inf - inf gives NaN), denormals and zeros."""
    rng = np.random.default_rng(seed)
    rows = (rng.standard_normal((n, count)) * 1000).astype(dtype)
    special = np.array([np.inf, -np.inf, 0.0, -0.0, np.finfo(dtype).tiny / 8, np.finfo(dtype).max / 2],
                       dtype)
    pick = rng.random((n, count)) < 0.05
    rows[pick] = rng.choice(special, pick.sum())
    return rows


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind,dtype", [(0, np.float32), (1, np.float64)])
@pytest.mark.parametrize("op,ufunc", [(0, np.add), (1, np.multiply)])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_fused_float_reduction_matches_numpy_bit_for_bit(level, kind, dtype, op, ufunc, n):
    _core.set_half_limit(level)
    for count in COUNTS:
        rows = rows_of(dtype, n, count, seed=count * 7 + n)
        out = np.full(count, 7, dtype)
        with np.errstate(all="ignore"):
            want = rows[0].copy()       # rank order, one input at a time (np.add.reduce starts from +0.0)
            for r in rows[1:]:
                ufunc(want, r, out=want)
            _core.reduce_rows(kind, op, out.ctypes.data, rows.ctypes.data, rows.strides[0], n, count)
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(out), nan), (level, count)
        uint = np.uint32 if dtype == np.float32 else np.uint64
        assert np.array_equal(out[~nan].view(uint), want[~nan].view(uint)), (level, count)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind,dtype", [(0, np.float32), (1, np.float64)])
def test_fused_float_reduction_of_unaligned_rows(level, kind, dtype):
    """Rows and output at addresses that are not vector-aligned, in rank order."""
    _core.set_half_limit(level)
    raw = np.random.default_rng(3).standard_normal(10_000).astype(dtype)
    for n, count, stride in ((2, 999, 1003), (4, 1001, 1037)):
        rows = [raw[1 + stride * j: 1 + stride * j + count] for j in range(n)]
        out = np.empty(count + 1, dtype)[1:]
        _core.reduce_rows(kind, 0, out.ctypes.data, rows[0].ctypes.data, stride * raw.itemsize, n, count)
        want = rows[0].copy()
        for r in rows[1:]:
            want = want + r
        assert np.array_equal(out, want)


def half_reference(inputs, op, dtype, n):
    ufunc = np.multiply if op == ReduceOp.PRODUCT else np.add
    acc = _to_f32(inputs[0], dtype)
    with np.errstate(all="ignore"):
        for x in inputs[1:]:
            ufunc(acc, _to_f32(x, dtype), out=acc)
        if op == ReduceOp.AVG:
            np.divide(acc, n, out=acc)
    out = np.empty_like(inputs[0])
    _from_f32(acc, out, dtype)
    return out


def half_bits(value, dtype):
    f = np.array(value, np.float32)
    if dtype == "bfloat16":
        return np.uint16(f.view(np.uint32) >> 16)
    return f.astype(np.float16).view(np.uint16)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.AVG])
def test_half_blocks_with_and_without_nan_inputs(level, dtype, op):
    """A NaN input in one 32-element block sends that block alone through the
    careful build; its neighbours, inf - inf (a NaN made, not given) and
    denormal results stay in the fast one, and all give numpy's bits."""
    _core.set_half_limit(level)
    rng = np.random.default_rng(int(op) + (dtype == "float16") * 10)
    for n in (2, 3, 4):
        for count in (31, 32, 33, 96, 100, 1000):
            f = (rng.standard_normal((n, count)) * 4).astype(np.float32)
            inputs = [np.array([half_bits(v, dtype) for v in row], np.uint16) for row in f]
            if count >= 64:
                inputs[n - 1][40] = 0x7FC1 if dtype == "bfloat16" else 0x7E01     # a NaN in block 1 only
                inputs[0][5] = half_bits(np.inf, dtype)                            # inf - inf in block 0
                inputs[1][5] = half_bits(-np.inf, dtype)
                tiny = 0x0001                                                      # smallest denormals
                inputs[0][70], inputs[1][70] = tiny, tiny
            arrays = inputs if dtype == "bfloat16" else [x.view(np.float16) for x in inputs]
            want = half_reference(arrays, op, dtype, n).view(np.uint16)
            out = np.empty_like(arrays[0])
            assert _core.reduce_half(out, arrays, int(op), dtype, n)
            assert np.array_equal(out.view(np.uint16), want), (n, count, np.flatnonzero(out.view(np.uint16) != want))
            in_place = [a.copy() for a in arrays]
            assert _core.reduce_half(in_place[0], in_place, int(op), dtype, n)
            assert np.array_equal(in_place[0].view(np.uint16), want)

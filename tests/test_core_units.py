"""Single-process tests of the C core's kernels against numpy.

The 16-bit reductions (_half.h) must give, bit for bit, what reduce_ops'
numpy path gives (float32 accumulation in rank order, one rounding to
nearest even, NaN kept as NaN), in every build the CPU can run (AVX-512,
AVX2 + F16C, plain C), for every bit pattern: NaN (quiet, signalling, both
signs), infinities, denormals, rounding ties.
"""
import numpy as np
import pytest

from shmdist import _core
from shmdist.reduce_ops import ReduceOp, _from_f32, _to_f32, reduce_into

OPS = {ReduceOp.SUM: np.add, ReduceOp.PRODUCT: np.multiply, ReduceOp.AVG: np.add}
LEVELS = list(range(_core.half_level() + 1))


@pytest.fixture(autouse=True)
def all_builds():
    yield
    _core.set_half_limit(99)     # no cap: the best build this CPU has


def numpy_reduce(inputs, op, dtype, count):
    """reduce_ops.reduce_into's numpy path for the 16-bit floats, spelled out."""
    acc = _to_f32(inputs[0], dtype)
    for x in inputs[1:]:
        OPS[op](acc, _to_f32(x, dtype), out=acc)
    if op == ReduceOp.AVG:
        np.divide(acc, count, out=acc)
    out = np.empty_like(inputs[0])
    _from_f32(acc, out, dtype)
    return out


def patterns(dtype, seed):
    """Every 16-bit pattern once, shuffled, as the array type the dtype travels in."""
    bits = np.random.default_rng(seed).permutation(np.arange(1 << 16, dtype=np.uint32)).astype(np.uint16)
    return bits if dtype == "bfloat16" else bits.view(np.float16)


def near(dtype, seed, size=1 << 16):
    """Values of similar magnitude, whose sums round often and hit ties."""
    rng = np.random.default_rng(seed)
    f = (rng.integers(-64, 64, size) * np.float32(2.0) ** rng.integers(-30, 10, size)).astype(np.float32)
    if dtype == "bfloat16":
        return (f.view(np.uint32) >> 16).astype(np.uint16)
    with np.errstate(over="ignore"):
        return f.astype(np.float16)


def as_bits(a):
    return a.view(np.uint16)


def is_nan(a, dtype):
    bits = as_bits(a) & 0x7FFF
    return bits > (0x7F80 if dtype == "bfloat16" else 0x7C00)


def mismatches(out, want, inputs, dtype):
    """Where ``out`` differs from numpy's bits. Where two or more inputs are
    NaN, which NaN's payload comes through is not numpy's to define (its own
    loops differ by position: SIMD body or scalar tail), so there any NaN
    will do; the C rule is: the first NaN in rank order, quietened."""
    differ = as_bits(out) != as_bits(want)
    several = sum(is_nan(x, dtype).astype(int) for x in inputs) >= 2
    differ[several] = ~is_nan(out, dtype)[several]
    return np.flatnonzero(differ)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_half_reduction_matches_numpy_bit_for_bit(level, dtype, op, n):
    _core.set_half_limit(level)
    assert _core.half_level() == level
    for make in (patterns, near):
        inputs = [make(dtype, seed) for seed in range(n)]
        want = numpy_reduce(inputs, op, dtype, n)
        out = np.empty_like(inputs[0])
        with np.errstate(all="ignore"):
            assert _core.reduce_half(out, inputs, int(op), dtype, n)
        bad = mismatches(out, want, inputs, dtype)
        assert bad.size == 0, (f"{bad.size} differ, first inputs "
                               f"{[hex(int(as_bits(x)[bad[0]])) for x in inputs]}: "
                               f"got {hex(int(as_bits(out)[bad[0]]))}, numpy {hex(int(as_bits(want)[bad[0]]))}")


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_rounding_of_every_float32_class(level, dtype):
    """One input of each interesting float32 sum: ties to even both ways, the
    largest finite values and overflow to inf, denormal results, NaN payloads."""
    _core.set_half_limit(level)
    rng = np.random.default_rng(7)
    raw = np.concatenate([rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32),
                          np.array([0x7F7FFFFF, 0x477FEFFF, 0x477FF000, 0x38800000, 0x33000000, 0x33000001,
                                    0x387FC000, 0x00000001, 0x80000001, 0x7F800001, 0xFFC00001],
                                   np.uint32)])
    f = raw.view(np.float32)
    # a = f rounded down to the 16-bit type, b = the remainder: their float32 sum is f again
    # whenever f is representable as the sum; checks the one rounding of many bit patterns
    if dtype == "bfloat16":
        a = (raw >> 16).astype(np.uint16)
        with np.errstate(all="ignore"):
            rest = (f - (a.astype(np.uint32) << 16).view(np.float32))
        b = (rest.view(np.uint32) >> 16).astype(np.uint16)
    else:
        with np.errstate(all="ignore"):
            a = f.astype(np.float16)
            b = (f - a.astype(np.float32)).astype(np.float16)
    for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.AVG):
        want = numpy_reduce([a, b], op, dtype, 2)
        out = np.empty_like(a)
        with np.errstate(all="ignore"):
            assert _core.reduce_half(out, [a, b], int(op), dtype, 2)
        bad = mismatches(out, want, [a, b], dtype)
        assert bad.size == 0, (dtype, op, [(hex(int(raw[k])), hex(int(as_bits(a)[k])), hex(int(as_bits(b)[k])),
                                            hex(int(as_bits(out)[k])), hex(int(as_bits(want)[k]))) for k in bad[:3]])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("count", [0, 1, 7, 15, 16, 17, 1023, 1024, 1025, 5000])
def test_half_reduction_lengths_and_in_place(dtype, count):
    """Tails of every length; out may be one of the inputs (same address)."""
    inputs = [near(dtype, s, count) for s in range(3)]
    want = numpy_reduce(inputs, ReduceOp.SUM, dtype, 3) if count else inputs[0].copy()
    first = inputs[0].copy()
    assert _core.reduce_half(inputs[0], inputs, 0, dtype, 3) == (count > 0) or count == 0
    if count:
        assert np.array_equal(as_bits(inputs[0]), as_bits(want))
    else:
        assert np.array_equal(as_bits(inputs[0]), as_bits(first))


def test_half_reduction_refuses_what_it_does_not_take():
    a = np.ones(8, np.float16)
    out = np.empty_like(a)
    assert not _core.reduce_half(out, [a, a], 2, "float16", 2)          # MIN: numpy's NaN rules
    assert not _core.reduce_half(out, [a, a], 0, "float32", 2)          # not a 16-bit float
    assert not _core.reduce_half(out, [a, a[:4]], 0, "float16", 2)      # sizes differ
    assert not _core.reduce_half(out[::2], [a[::2], a[::2]], 0, "float16", 2)   # not contiguous
    assert not _core.reduce_half(a[1:], [a[:-1], a[:-1]], 0, "float16", 2)      # partial overlap
    ro = a.copy()
    ro.flags.writeable = False
    assert not _core.reduce_half(ro, [a, a], 0, "float16", 2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduce_into_takes_the_c_path_with_the_same_bits(dtype):
    """reduce_ops.reduce_into, which the collectives call, gives numpy's bits."""
    inputs = [patterns(dtype, s) for s in range(3)]
    out = np.empty_like(inputs[0])
    with np.errstate(all="ignore"):
        reduce_into(out, inputs, ReduceOp.SUM, dtype, 3)
        want = numpy_reduce(inputs, ReduceOp.SUM, dtype, 3)
    assert mismatches(out, want, inputs, dtype).size == 0


@pytest.mark.parametrize("kind,dtype", [(0, np.float32), (1, np.float64), (2, np.int32), (3, np.int64)])
def test_reduce_rows_matches_numpy(kind, dtype):
    rng = np.random.default_rng(kind)
    rows = (rng.standard_normal((4, 1000)) * 1000).astype(dtype)
    out = np.empty(1000, dtype)
    _core.reduce_rows(kind, 0, out.ctypes.data, rows.ctypes.data, rows.strides[0], 4, 1000)
    assert np.array_equal(out, np.add.reduce(rows, axis=0))


def test_probe_bits_of_local_ranks_from_64_on_are_never_read_nor_written():
    """A control block holds one probe bit per local rank below 64; a rank from 64 on
    (a shift past the word in C) is reported as unreadable and records nothing."""
    from shmdist import layout
    block = np.zeros(layout.CTL_BYTES // 8, np.uint64)
    ctl = block.ctypes.data
    _core.ctl_probed(ctl, 3, True)
    _core.ctl_probed(ctl, 5, False)
    for index in (64, 67, 69, 128, -1):
        _core.ctl_probed(ctl, index, True)
    assert int(block[layout.CTL_READS // 8]) == 1 << 3
    assert int(block[layout.CTL_PROBED // 8]) == (1 << 3) | (1 << 5)
    assert (_core.ctl_reads(ctl, 3), _core.ctl_reads(ctl, 5), _core.ctl_reads(ctl, 4)) == (True, False, None)
    assert [_core.ctl_reads(ctl, i) for i in (64, 67, 128, -1)] == [False] * 4

"""ReduceOp and the element-wise reductions, on numpy arrays.

numpy's ufuncs run without the GIL and vectorise. float16 and bfloat16
accumulate in float32 and round once at the end, so the sum of N ranks
suffers one rounding, not N-1. Every rank combines inputs in rank order,
so floating-point results are bitwise identical on every rank.
"""
from __future__ import annotations

import enum

import numpy as np

from shmdist import _core, layout
from shmdist.errors import DistError

# SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR, AVG: the codes of layout.OPS, which the C kernels share
ReduceOp = enum.IntEnum("ReduceOp", [(name, code) for code, name in enumerate(layout.OPS)], module=__name__)
ReduceOp.__repr__ = lambda self: f"ReduceOp.{self.name}"


_UFUNC = {
    ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor,
}
_HALF = ("float16", "bfloat16")
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
_C_HALF = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.AVG)   # what _core.reduce_half takes


def as_op(op, who: str) -> ReduceOp:
    """Accept a ReduceOp, its name, or torch.distributed.ReduceOp."""
    if isinstance(op, ReduceOp):
        return op
    name = getattr(op, "name", None) or str(op).rpartition(".")[2]
    try:
        return ReduceOp[str(name).upper()]
    except KeyError:
        raise DistError(f"{who}: unknown reduce op {op!r}; use shmdist.ReduceOp."
                        f"{{{', '.join(o.name for o in ReduceOp)}}}") from None


def check(op: ReduceOp, dtype: str, array_kind: str | None, who: str) -> None:
    """Refuse an op that makes no sense for a dtype, naming both.
    ``array_kind`` is numpy's kind letter of the data, None when numpy
    cannot represent the dtype."""
    if array_kind is None and dtype != "bfloat16":
        raise DistError(f"{who}: {dtype} tensors cannot be reduced (numpy has no such type); "
                        "convert to float32 first")
    kind = "f" if dtype == "bfloat16" else array_kind
    if kind not in "biufc":
        raise DistError(f"{who}: {dtype} tensors cannot be reduced with ReduceOp.{op.name}: reductions "
                        "take numbers and bools (this is a structured, string or time dtype); reduce its "
                        "numeric fields, or use all_gather and combine them yourself")
    if op in _BITWISE and kind not in "iub":
        raise DistError(f"{who}: ReduceOp.{op.name} needs an integer or bool tensor, got {dtype}; "
                        "use SUM/MIN/MAX or reinterpret the bits as an integer dtype")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and kind == "c":
        raise DistError(f"{who}: ReduceOp.{op.name} is not defined for complex {dtype}")
    if op == ReduceOp.AVG and kind not in "fc":
        raise DistError(f"{who}: ReduceOp.AVG needs a floating-point tensor, got {dtype}; use SUM "
                        "and divide, or convert to float")


def _to_f32(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def _from_f32(acc: np.ndarray, out: np.ndarray, dtype: str) -> None:
    if dtype == "float16":
        np.copyto(out, acc, casting="unsafe")
        return
    bits = acc.view(np.uint32)
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    nan = np.isnan(acc)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    np.copyto(out, rounded)


def reduce_into(out: np.ndarray, inputs: list[np.ndarray], op: ReduceOp, dtype: str,
                count: int) -> None:
    """out = inputs[0] op inputs[1] op ... (in that order); AVG divides by
    ``count``. ``out`` must not overlap any input."""
    ufunc = _UFUNC[op]
    if dtype in _HALF:
        if op in _C_HALF and _core.reduce_half(out, inputs, int(op), dtype, count):
            return          # the same bits, in C (_half.h), without the float32 temporaries
        acc = _to_f32(inputs[0], dtype)
        for x in inputs[1:]:
            ufunc(acc, _to_f32(x, dtype), out=acc)
        if op == ReduceOp.AVG:
            np.divide(acc, count, out=acc)
        _from_f32(acc, out, dtype)
        return
    if len(inputs) == 1:
        np.copyto(out, inputs[0])
    else:
        ufunc(inputs[0], inputs[1], out=out)
        for x in inputs[2:]:
            ufunc(out, x, out=out)
    if op == ReduceOp.AVG:
        np.divide(out, count, out=out, casting="unsafe")


def reduce_rows(out: np.ndarray, rows: np.ndarray, op: ReduceOp, dtype: str, count: int) -> None:
    """out = the rows of ``rows`` (one per rank, shape (n, len(out))) combined
    in rank order, in one ufunc call; as reduce_into otherwise."""
    if dtype in _HALF:
        reduce_into(out, list(rows), op, dtype, count)
        return
    _UFUNC[op].reduce(rows, axis=0, out=out)
    if op == ReduceOp.AVG:
        np.divide(out, count, out=out, casting="unsafe")

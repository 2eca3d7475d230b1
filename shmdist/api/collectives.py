"""The collective calls of the torch.distributed surface: argument checks,
tensors, async handles. The algorithms live in comm/arena.py and comm/hier.py.

A rank that is not a member of ``group`` and calls a collective on it gets
a warning and the call does nothing, as in torch.distributed (scripts call
collectives on every rank and rely on it). With ``async_op=True`` the call
returns a completed DistributedRequest: collectives run to completion when
called (they move data through shared memory, so there is nothing left to
overlap with), and ``wait()`` returns at once.
"""
from __future__ import annotations

import io
import operator
import pickle
import warnings
from contextlib import contextmanager

import numpy as np

from shmdist.api import group as _g
from shmdist.api.fast import paths as _fast
from shmdist.errors import DistError, DistMismatchError
from shmdist.reduce_ops import ReduceOp, as_op, check, reduce_into
from shmdist.request import completed
from shmdist import _core
from shmdist.transport.engine import COLLECTIVE_GID
from shmdist.tensors import BF16_BITS, Buf, as_buf, describe, typed_view
from shmdist.comm import shared as _shared


def _enter(op: str, group):
    """(world, group, comm) for a member; (world, group, None) for a non-member."""
    w, g = _g._group(group, op)
    if not g.is_member:
        warnings.warn(f"rank {w.rank}: {op}: this rank is not a member of group {list(g.ranks)}; "
                      "the call does nothing (as in torch.distributed)", stacklevel=3)
        return w, g, None
    if g.coll is None:
        raise DistError(f"rank {w.rank}: {op}: group {list(g.ranks)} has no collective engine; it was "
                        "not made by shmdist.new_group or init_process_group")
    return w, g, g.coll


def _root(w, g, rank, op: str, what: str) -> int:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank not in g.ranks:
        where = "the job" if g is w.default else f"group {list(g.ranks)}"
        raise DistError(f"rank {w.rank}: {op}: {what}={rank!r} is not a rank of {where}; pass the "
                        "global rank of a member")
    return g.group_rank(rank)


def _done(op, async_op, tensors, bufs=()):
    for b in bufs:
        if b.finish is not None:
            b.finish()
    return completed(op, tensors) if async_op else None


_CHECKED: set = set()   # (op, dtype) pairs check() accepted


def _reducible(buf, op, who):
    arr = typed_view(buf)
    if (op, buf.dtype) not in _CHECKED:
        check(op, buf.dtype, None if arr is None else arr.dtype.kind, who)
        _CHECKED.add((op, buf.dtype))
    return arr


def _same(w, op, bufs, ref, what):
    for i, b in enumerate(bufs):
        if b.nbytes != ref.nbytes or b.dtype != ref.dtype:
            raise DistMismatchError(f"rank {w.rank}: {op}: {what}[{i}] is {b.describe()} but the input "
                                    f"is {ref.describe()}; every piece must match the input's size and dtype")


def _list(w, op, tensors, n, what):
    if not isinstance(tensors, (list, tuple)) or len(tensors) != n:
        got = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise DistError(f"rank {w.rank}: {op}: {what} must be a list of {n} tensors (one per rank of the "
                        f"group), got {got}")
    return tensors


@contextmanager
def _refusing(comm, g, kind: str):
    """Around the checks of a call's own arguments: when they fail, this rank
    still takes part in the call's first phase, as a refusal, and then raises
    its own error. The members that called it validly raise a mismatch naming
    the refusal, and the group stays in step instead of pairing this rank's
    next collective with the others' current one."""
    try:
        yield
    except Exception:
        _refuse(comm, g, kind)
        raise


def _refuse(comm, g, kind: str) -> None:
    try:
        with comm.lock:
            comm.refuse(kind, g.timeout)
    except DistError:
        pass        # the others' mismatch (or a broken group): this rank's own error says more


def refuse_call(group, kind: str) -> None:
    """Take part in the call ``kind`` of ``group`` as a refusal: a layer above (shmdist.torch)
    refused its arguments before the call itself ran (_refusing)."""
    w, g, comm = _enter(kind, group)
    if comm is not None:
        _refuse(comm, g, kind)


def _overlaps(a, b) -> bool:
    return a.nbytes > 0 and b.nbytes > 0 and a.addr < b.addr + b.nbytes and b.addr < a.addr + a.nbytes


def _unaliased(ins: list, outs: list, same_ok: tuple = ()) -> list:
    """``ins`` with every input that shares memory with an output replaced by
    a private copy, so that writing the outputs cannot change an input that
    is still to be read (in-place reduce_scatter into my own chunk,
    all_to_all_single with one tensor as input and output, ...). A pair
    (i, j) in ``same_ok`` may be exactly the same memory: the collective
    writes output j with input i's own bytes (in-place all_gather). Costs
    nothing when nothing overlaps."""
    out = list(ins)
    for i, b in enumerate(ins):
        for j, o in enumerate(outs):
            if _overlaps(b, o) and not ((i, j) in same_ok and (b.addr, b.nbytes) == (o.addr, o.nbytes)):
                out[i] = _copy_of(b)
                break
    return out


def _copy_of(b):
    """A Buf over a private copy of ``b``'s bytes, with its dtype and shape."""
    arr = typed_view(b) if isinstance(b, Buf) else None      # a _Piece is copied as bytes
    arr = np.empty(b.nbytes, dtype=np.uint8) if arr is None else np.empty_like(arr)
    _core.copy(arr.ctypes.data, b.addr, b.nbytes)
    return Buf(arr, arr.ctypes.data, b.nbytes, b.dtype, b.shape, None)


# ---------------------------------------------------------------- tensor collectives

def _barrier_py(group=None, async_op=False, device_ids=None, timeout=None):
    """barrier (the C entry point _core.barrier hands calls here unless they
    are on the default group, synchronous and without their own timeout)."""
    seconds = None if timeout is None else _call_seconds("barrier", group, timeout)
    if group is None and _fast.barrier is not None:
        how = _fast.barrier()             # the default group's whole barrier, when the others are there
        if how > 0 or _fast.coll.quick_barrier(seconds or _fast.world.timeout, how):
            return completed("barrier", []) if async_op else None
    return _barrier_general(group, async_op, seconds)


def _call_seconds(kind: str, group, timeout) -> float:
    """A call's own ``timeout`` in seconds; a bad one makes the call a refused one (_refusing),
    so the other members' call does not pair with this rank's next."""
    try:
        return _g._seconds(timeout)
    except ValueError as e:
        w, g, comm = _enter(kind, group)
        if comm is not None:
            _refuse(comm, g, kind)
        raise ValueError(f"rank {w.rank}: {kind}: {e}; or leave it out for the group's timeout") from None


def _barrier_rest(how: int, device_ids=None):
    """The rest of a default-group barrier whose fast pass (the Phaser's
    barrier, called by _core.barrier) returned ``how`` <= 0."""
    if _fast.coll is not None and _fast.coll.quick_barrier(_fast.world.timeout, how):
        return None
    return _barrier_general(None, False, None)


def _barrier_general(group, async_op: bool, seconds):
    w, g, comm = _enter("barrier", group)
    if comm is None:
        return None
    with comm.lock:
        comm.barrier(seconds or g.timeout)
    return _done("barrier", async_op, [])


# barrier, send and recv are C functions (_core, _entry.pxi) that take the fast
# paths and hand every other call to the Python functions above and in group.py.
barrier = _core.barrier
_core.entry_fallbacks(np.ndarray, _g._send_py, _g._send_general, _g._recv_py, _g._recv_general,
                      _barrier_py, _barrier_rest)


def broadcast(tensor, src: int, group=None, async_op=False):
    """Copy ``tensor`` of global rank ``src`` into ``tensor`` of every rank."""
    if group is None and _fast.lane is not None and src.__class__ is int and \
            not (_shared.live and getattr(tensor, "nbytes", 0) > _shared.IN_PLACE_MIN):
        arr = tensor if tensor.__class__ is np.ndarray else _fast.array(tensor, True)   # bfloat16: its bits
        coll = _fast.coll
        if arr is not None and hasattr(coll, "quick_broadcast") and \
                coll.quick_broadcast(arr, src, _fast.world.timeout, "bfloat16" if arr.dtype is BF16_BITS else None):
            return completed("broadcast", [tensor]) if async_op else None
        if arr is not None and 0 <= src < coll.n:     # (the default group's: member index = global rank)
            buf = _medium_buf(tensor, arr, src != coll.me)
            if buf is not None:         # too big for the one-call path
                with coll.lock:
                    coll.broadcast(buf, src, _fast.world.timeout)
                return completed("broadcast", [tensor]) if async_op else None
        learn = arr
    else:
        learn = None
    w, g, comm = _enter("broadcast", group)
    if comm is None:
        return None
    with _refusing(comm, g, "broadcast"):
        root = _root(w, g, src, "broadcast", "src")
        buf = as_buf(tensor, writable=root != g.rank(), who=f"rank {w.rank}: broadcast")
        shared = _shared.live and _shared.target(w.rank, "broadcast", g, buf)   # shmdist.empty memory
    with comm.lock:
        if shared:
            _shared.broadcast(comm, *shared, buf, root, g.timeout)
        else:
            comm.broadcast(buf, root, g.timeout)
    _learn(learn, buf)
    return _done("broadcast", async_op, [tensor], [buf])


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``tensor`` across the group; every rank ends with the result, in place."""
    quick = op.__class__ is ReduceOp      # the one-call path may apply
    if _shared.live and getattr(tensor, "nbytes", 0) > _shared.IN_PLACE_MIN:
        quick = False                     # maybe shmdist.empty memory: in place, below
    if quick and group is None and _fast.lane is not None:    # the default group's, before any other work
        arr = tensor if tensor.__class__ is np.ndarray else _fast.array(tensor, True)   # bfloat16: its bits
        coll = _fast.coll
        if arr is not None and arr.dtype is BF16_BITS:
            ok = getattr(coll, "quick_names", False) and coll.quick_all_reduce(arr, op, _fast.world.timeout,
                                                                               "bfloat16")
        else:         # (a comm whose quick path takes no dtype name, groups spanning hosts: not bfloat16)
            ok = arr is not None and coll.quick_all_reduce(arr, op, _fast.world.timeout)
        if not ok and arr is not None:      # too big for the one-call path (or its op is not in C)
            buf = _medium_buf(tensor, arr, True)
            if buf is not None and (op, buf.dtype) in _CHECKED:
                flat = arr.reshape(-1) if arr.ndim != 1 else arr
                with coll.lock:
                    coll.all_reduce(buf, flat.view(np.uint16) if flat.dtype is BF16_BITS else flat, op,
                                    _fast.world.timeout)
                ok = True
        if ok:
            return completed("all_reduce", [tensor]) if async_op else None
        quick, learn = False, arr
    else:
        learn = None
    w, g, comm = _enter("all_reduce", group)
    if comm is None:
        return None
    if quick and _fast.enabled:
        arr = tensor if tensor.__class__ is np.ndarray else _fast.array(tensor)
        if arr is not None and comm.quick_all_reduce(arr, op, g.timeout):
            return completed("all_reduce", [tensor]) if async_op else None
    with _refusing(comm, g, "all_reduce"):
        who = f"rank {w.rank}: all_reduce"
        op = as_op(op, who)
        buf = as_buf(tensor, writable=True, who=who)
        arr = _reducible(buf, op, who)
        shared = _shared.live and _shared.target(w.rank, "all_reduce", g, buf)   # shmdist.empty memory
    with comm.lock:
        if shared:
            _shared.all_reduce(comm, *shared, buf, arr, op, g.timeout)
        else:
            comm.all_reduce(buf, arr, op, g.timeout)
    _learn(learn, buf)
    return _done("all_reduce", async_op, [tensor], [buf])


# The default group's broadcast and all_reduce of a tensor too big for the one-call paths take
# the general path's own call into the engine, with the same descriptor (dtype name, size, op),
# but without its argument checks and its second view of the tensor: 8-19 us of a 60 us
# all_reduce of 1 MiB. Only for a dtype (and op) the general path already took, so its checks
# passed once and its name for the dtype is known.
_MEDIUM_NAMES: dict = {}   # numpy dtype of a fast view -> the general path's name for its tensor's dtype


def _learn(view, buf) -> None:
    """The general path took the tensor of fast view ``view`` (None: it had
    none) as ``buf``: its dtype's name, for _medium_buf. Only where it took
    the view's own memory as it is: a root's non-native byte order, say, is
    read from a native copy (with no ``finish``, a root only reads), and
    that copy's name is not the view's."""
    if view is not None and buf.finish is None and view.dtype is not BF16_BITS and buf.dtype != "bfloat16" \
            and view.dtype.isnative and view.size and buf.addr == view.ctypes.data:
        _MEDIUM_NAMES[view.dtype] = buf.dtype     # (a bfloat16 view has a dtype of its own, BF16_BITS)


def _medium_buf(tensor, arr: np.ndarray, writable: bool):
    """``tensor`` as the general path's Buf, from ``arr``, its fast view, when
    its dtype was learned and it is C-contiguous (and writable); else None."""
    name = "bfloat16" if arr.dtype is BF16_BITS else _MEDIUM_NAMES.get(arr.dtype)
    if name is None:
        return None
    try:
        addr, nbytes = _core.buffer_address(arr, writable)
    except BufferError:
        return None
    return Buf(tensor, addr, nbytes, name, arr.shape, tensor)


def reduce(tensor, dst: int, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``tensor`` across the group into ``tensor`` of global rank ``dst``."""
    w, g, comm = _enter("reduce", group)
    if comm is None:
        return None
    with _refusing(comm, g, "reduce"):
        who = f"rank {w.rank}: reduce"
        root = _root(w, g, dst, "reduce", "dst")
        op = as_op(op, who)
        buf = as_buf(tensor, writable=True, who=who)
        arr = _reducible(buf, op, who)
    with comm.lock:
        comm.all_reduce(buf, arr, op, g.timeout, root=root)
    return _done("reduce", async_op, [tensor], [buf] if root == g.rank() else ())


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """``tensor_list[j]`` of every rank receives ``tensor`` of group rank j."""
    w, g, comm = _enter("all_gather", group)
    if comm is None:
        return None
    with _refusing(comm, g, "all_gather"):
        who = f"rank {w.rank}: all_gather"
        buf = as_buf(tensor, writable=False, who=who)
        outs = [as_buf(t, writable=True, who=who) for t in _list(w, "all_gather", tensor_list, g.size(), "tensor_list")]
        _same(w, "all_gather", outs, buf, "tensor_list")
        buf = _unaliased([buf], outs, ((0, g.rank()),))[0]
    with comm.lock:
        comm.all_gather([o.addr for o in outs], buf, -1, g.timeout)
    return _done("all_gather", async_op, list(tensor_list), outs)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """``output_tensor`` (size x group size, concatenated in rank order) gets every input."""
    w, g, comm = _enter("all_gather_into_tensor", group)
    if comm is None:
        return None
    with _refusing(comm, g, "all_gather"):
        who = f"rank {w.rank}: all_gather_into_tensor"
        buf = as_buf(input_tensor, writable=False, who=who)
        out = as_buf(output_tensor, writable=True, who=who)
        _split_check(w, who, out, buf, g.size(), "output_tensor")
        pieces = [_Piece(out.addr + j * buf.nbytes, buf.nbytes, out.dtype, buf.shape) for j in range(g.size())]
        buf = _unaliased([buf], pieces, ((0, g.rank()),))[0]
    with comm.lock:
        comm.all_gather([p.addr for p in pieces], buf, -1, g.timeout)
    return _done("all_gather_into_tensor", async_op, [output_tensor], [out])


def _split_check(w, who, whole, piece, n, what):
    if whole.dtype != piece.dtype or whole.nbytes != piece.nbytes * n:
        raise DistMismatchError(f"{who}: {what} is {whole.describe()} but must hold {n} pieces of "
                                f"{piece.describe()} ({piece.nbytes * n} bytes of {piece.dtype})")


def _root_list(w, g, root, tensors, ref, op, what, writable):
    """The root's list of one tensor per rank, each like ``ref``; [] elsewhere."""
    if root != g.rank():
        if tensors:
            raise DistError(f"rank {w.rank}: {op}: {what} is only for rank {g.ranks[root]}; pass None here")
        return []
    bufs = [as_buf(t, writable=writable, who=f"rank {w.rank}: {op}") for t in _list(w, op, tensors, g.size(), what)]
    _same(w, op, bufs, ref, what)
    return bufs


def gather(tensor, gather_list=None, dst: int = 0, group=None, async_op=False):
    """``gather_list`` of global rank ``dst`` receives every rank's ``tensor``."""
    w, g, comm = _enter("gather", group)
    if comm is None:
        return None
    with _refusing(comm, g, "gather"):
        who = f"rank {w.rank}: gather"
        root = _root(w, g, dst, "gather", "dst")
        buf = as_buf(tensor, writable=False, who=who)
        outs = _root_list(w, g, root, gather_list, buf, "gather", "gather_list", writable=True)
        if outs:
            buf = _unaliased([buf], outs, ((0, g.rank()),))[0]
    with comm.lock:
        comm.all_gather([o.addr for o in outs], buf, root, g.timeout)
    return _done("gather", async_op, list(gather_list or []), outs)


def scatter(tensor, scatter_list=None, src: int = 0, group=None, async_op=False):
    """``tensor`` of group rank j receives ``scatter_list[j]`` of global rank ``src``."""
    w, g, comm = _enter("scatter", group)
    if comm is None:
        return None
    with _refusing(comm, g, "scatter"):
        who = f"rank {w.rank}: scatter"
        root = _root(w, g, src, "scatter", "src")
        buf = as_buf(tensor, writable=True, who=who)
        ins = _root_list(w, g, root, scatter_list, buf, "scatter", "scatter_list", writable=False)
        ins = _unaliased(ins, [buf], ((g.rank(), 0),))
    with comm.lock:
        comm.scatter([i.addr for i in ins], buf, root, g.timeout)
    return _done("scatter", async_op, [tensor], [buf])


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """``output`` of group rank i gets the reduction of every rank's ``input_list[i]``.

    As in gloo, the ranks' outputs may differ in size: ``input_list[j]`` has
    the size of rank j's output on every rank."""
    w, g, comm = _enter("reduce_scatter", group)
    if comm is None:
        return None
    with _refusing(comm, g, "reduce_scatter"):
        who = f"rank {w.rank}: reduce_scatter"
        op = as_op(op, who)
        out = as_buf(output, writable=True, who=who)
        ins = [as_buf(t, writable=False, who=who) for t in _list(w, "reduce_scatter", input_list, g.size(), "input_list")]
        for i, b in enumerate(ins):
            if b.dtype != out.dtype:
                raise DistMismatchError(f"{who}: input_list[{i}] is {b.describe()} but the output is "
                                        f"{out.describe()}; use one dtype")
        me = g.rank()
        if ins[me].nbytes != out.nbytes:
            raise DistMismatchError(f"{who}: input_list[{me}] (this rank's own piece) is {ins[me].describe()} "
                                    f"but the output is {out.describe()}; they must be the same size")
        out_arr = _reducible(out, op, who)
        ins = _unaliased(ins, [out])
    if any(b.nbytes != out.nbytes for b in ins):
        _reduce_scatter_uneven(w, g, comm, who, op, out, out_arr, ins)
    else:
        with comm.lock:
            comm.reduce_scatter(out, out_arr, [b.addr for b in ins], [typed_view(b) for b in ins], op,
                                g.timeout)
    return _done("reduce_scatter", async_op, [output], [out])


def _reduce_scatter_uneven(w, g, comm, who, op, out, out_arr, ins) -> None:
    """reduce_scatter whose pieces differ in size: every rank checks every
    pair's sizes, sends each member its piece, and reduces what it got in
    rank order."""
    got = [np.empty_like(out_arr) for _ in ins]
    recv = [Buf(a, a.ctypes.data, out.nbytes, out.dtype, out.shape, None) for a in got]
    with comm.lock:
        comm.barrier_as("reduce_scatter", out.dtype, g.timeout)
        _check_sizes(g, comm, who, recv, ins)
        _exchange_p2p(w, g, who, recv, ins)
    reduce_into(out_arr, got, op, out.dtype, g.size())


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """As reduce_scatter, with the inputs concatenated in one tensor."""
    w, g, comm = _enter("reduce_scatter_tensor", group)
    if comm is None:
        return None
    with _refusing(comm, g, "reduce_scatter"):
        who = f"rank {w.rank}: reduce_scatter_tensor"
        op = as_op(op, who)
        out = as_buf(output, writable=True, who=who)
        inp = as_buf(input, writable=False, who=who)
        _split_check(w, who, inp, out, g.size(), "input")
        out_arr = _reducible(out, op, who)
        whole = typed_view(inp)
        k = out_arr.size
        pieces = [Buf(whole[j * k:(j + 1) * k], inp.addr + j * out.nbytes, out.nbytes, out.dtype, out.shape, None)
                  for j in range(g.size())]
        ins = _unaliased(pieces, [out])      # in place: the output is one of the pieces
    with comm.lock:
        comm.reduce_scatter(out, out_arr, [b.addr for b in ins], [typed_view(b) for b in ins], op, g.timeout)
    return _done("reduce_scatter_tensor", async_op, [output], [out])


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """``output_tensor_list[j]`` of rank i receives ``input_tensor_list[i]`` of rank j."""
    w, g, comm = _enter("all_to_all", group)
    if comm is None:
        return None
    with _refusing(comm, g, "all_to_all"):
        who = f"rank {w.rank}: all_to_all"
        n = g.size()
        outs = [as_buf(t, writable=True, who=who) for t in _list(w, "all_to_all", output_tensor_list, n, "output_tensor_list")]
        ins = [as_buf(t, writable=False, who=who) for t in _list(w, "all_to_all", input_tensor_list, n, "input_tensor_list")]
        _one_dtype(who, outs, ins)
    _exchange(w, g, comm, who, outs, ins)
    return _done("all_to_all", async_op, list(output_tensor_list), outs)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False):
    """all_to_all on one tensor each, split along dim 0 (evenly, or by the split sizes)."""
    w, g, comm = _enter("all_to_all_single", group)
    if comm is None:
        return None
    with _refusing(comm, g, "all_to_all"):
        who = f"rank {w.rank}: all_to_all_single"
        n = g.size()
        out = as_buf(output, writable=True, who=who)
        inp = as_buf(input, writable=False, who=who)
        if out.dtype != inp.dtype:
            raise DistMismatchError(f"{who}: output is {out.dtype} but input is {inp.dtype}; use one dtype")
        ins = _splits(w, who, inp, input_split_sizes, n, "input")
        outs = _splits(w, who, out, output_split_sizes, n, "output")
        _one_dtype(who, outs, ins)
    _exchange(w, g, comm, who, outs, ins)
    return _done("all_to_all_single", async_op, [output], [out])


class _Piece:
    """A slice of a buffer, for all_to_all_single."""
    __slots__ = ("addr", "nbytes", "dtype", "shape", "finish")

    def __init__(self, addr, nbytes, dtype, shape):
        self.addr, self.nbytes, self.dtype, self.shape, self.finish = addr, nbytes, dtype, shape, None

    def describe(self):
        return describe(self.nbytes, self.dtype, self.shape)


def _splits(w, who, buf, sizes, n, what):
    given = sizes
    rows = buf.shape[0] if buf.shape else 1
    row_bytes = buf.nbytes // rows if rows else 0
    if sizes is None:
        if rows % n:
            raise DistError(f"{who}: {what} has {rows} rows, not divisible by the group size {n}; pass "
                            f"{what}_split_sizes")
        sizes = [rows // n] * n
    try:
        sizes = [operator.index(s) for s in sizes]     # ints (numpy's too), not 1.5 or "1"
    except TypeError:
        sizes = None
    if sizes is None or len(sizes) != n or sum(sizes) != rows or any(s < 0 for s in sizes):
        raise DistError(f"{who}: {what}_split_sizes {given!r} must be a list of {n} non-negative whole row "
                        f"counts adding up to {rows}")
    out, at = [], buf.addr
    for s in sizes:
        out.append(_Piece(at, s * row_bytes, buf.dtype, (s,) + tuple(buf.shape[1:])))
        at += s * row_bytes
    return out


def _one_dtype(who, outs, ins):
    for b in ins + outs:
        if b.dtype != ins[0].dtype:
            raise DistMismatchError(f"{who}: every tensor must have one dtype; got {ins[0].dtype} and "
                                    f"{b.dtype}")


def _exchange(w, g, comm, who, outs, ins):
    """Equal pieces go through the arena; uneven ones by point-to-point
    messages between the pairs, after every rank checked all the sizes.

    Whether a call is even is each rank's own view: one rank may have equal
    pieces where another has not (a valid call). Their first phases then
    disagree only in that; every rank sees the same descriptors, so all of
    them go on the uneven way together."""
    dtype = ins[0].dtype
    piece = ins[0].nbytes
    even = all(b.nbytes == piece for b in ins + outs)
    # in the arena's rounds an output exactly over its own input is written only after that
    # input's bytes of the round were read; point-to-point pieces may land before they are sent
    same_ok = even and getattr(comm, "all_to_all_in_place", False)
    ins = _unaliased(ins, outs, tuple((j, j) for j in range(len(ins))) if same_ok else ())
    with comm.lock:
        try:
            if even:
                comm.all_to_all([o.addr for o in outs], [i.addr for i in ins], piece, dtype, g.timeout)
                return
            comm.barrier_as("all_to_all", dtype, g.timeout)
        except DistMismatchError as e:
            if not all(c[0] == "all_to_all" and c[4] == dtype for c in getattr(e, "calls", ())):
                raise
            if same_ok:
                ins = _unaliased(ins, outs)
        _check_sizes(g, comm, who, outs, ins)
        _exchange_p2p(w, g, who, outs, ins)


def _check_sizes(g, comm, who, outs, ins):
    """Every rank learns every pair's send and receive sizes, so a
    disagreement raises the same error everywhere before any byte moves."""
    n = g.size()
    row = np.array([b.nbytes for b in ins] + [b.nbytes for b in outs], dtype=np.int64)
    table = np.zeros((n, 2 * n), dtype=np.int64)
    comm.all_gather([table[j].ctypes.data for j in range(n)], as_buf(row, writable=False, who=who), -1,
                    g.timeout)
    bad = [f"rank {g.ranks[i]} sends rank {g.ranks[j]} {table[i, j]} bytes, which expects {table[j, n + i]}"
           for i in range(n) for j in range(n) if table[i, j] != table[j, n + i]]
    if bad:
        raise DistMismatchError(f"{who}: the split sizes of the ranks disagree: {'; '.join(bad)}. Give "
                                "every rank output split sizes that equal what the others send it")


def _exchange_p2p(w, g, who, outs, ins):
    """Every rank sends its j-th input to group rank j and receives its j-th
    output from it, by point-to-point messages (Engine.exchange)."""
    me = g.rank()
    _core.copy(outs[me].addr, ins[me].addr, ins[me].nbytes)
    others = [(j, r) for j, r in enumerate(g.ranks) if j != me]
    w.engine.exchange(who.partition(": ")[2], [(ins[j], r) for j, r in others], [(outs[j], r) for j, r in others],
                      COLLECTIVE_GID | g.gid, g.ranks, g.timeout)


# ---------------------------------------------------------------- object collectives
# These pickle: like torch.distributed, they trust every rank of the group.

def _dumps(obj, who: str) -> np.ndarray:
    try:
        f = io.BytesIO()
        pickle.Pickler(f).dump(obj)
    except Exception as e:  # noqa: BLE001 - pickle raises PicklingError, AttributeError, TypeError, ...
        raise TypeError(f"{who}: the object could not be pickled ({type(e).__name__}: {e}); pass "
                        "picklable objects (defined at a module's top level)") from e
    return np.frombuffer(f.getbuffer(), dtype=np.uint8).copy()


def _loads(data: np.ndarray, who: str, src: int):
    try:
        return pickle.loads(data.tobytes())
    except Exception as e:  # noqa: BLE001 - whatever the pickle's classes raise
        raise DistError(f"{who}: the objects rank {src} sent could not be unpickled here "
                        f"({type(e).__name__}: {e}); make their classes importable on every rank") from e


def _object_slots(w, op: str, objects, n, what: str):
    """``objects``, a list this rank fills: ``n`` items (None: any number)."""
    if not isinstance(objects, list) or (n is not None and len(objects) != n):
        got = f"{len(objects)} items" if isinstance(objects, list) else type(objects).__name__
        want = f"a list of {n} items (one per rank of the group)" if n is not None else "a list"
        raise DistError(f"rank {w.rank}: {op}: {what} must be {want}, got {got}; pass a list it can fill")
    return objects


def _object_items(w, op: str, objects, what: str) -> list:
    """The objects a root sends, as a list."""
    try:
        return list(objects)
    except TypeError:
        raise TypeError(f"rank {w.rank}: {op}: {what} must be a list of objects, got "
                        f"{type(objects).__name__}") from None


# An object collective is made of several internal ones. Its own checks and its pickling run
# in _refusing, around its FIRST internal collective (the kind named there): a rank that refuses
# takes part in that one only, as a refused call, and every member raises, in step.

@contextmanager
def _within(w, op: str):
    """The errors of an object collective's internal calls name it:
    "rank 0: all_gather_object: all_gather(...): the ranks ... disagree"."""
    try:
        yield
    except DistError as e:
        said = e.args[0] if e.args and isinstance(e.args[0], str) else None
        if said is not None and not said.startswith(f"rank {w.rank}: {op}:"):
            mine = f"rank {w.rank}: "
            e.args = (f"{mine}{op}: {said[len(mine):] if said.startswith(mine) else said}",) + e.args[1:]
        raise

def broadcast_object_list(object_list, src: int = 0, group=None, device=None):
    """Replace ``object_list`` items on every rank by those of global rank ``src``."""
    op = "broadcast_object_list"
    w, g, comm = _enter(op, group)
    if comm is None:
        return None
    with _refusing(comm, g, "broadcast"):
        _root(w, g, src, op, "src")
        if w.rank == src:
            items = _object_items(w, op, object_list, "object_list")
            sent = (_dumps(items, f"rank {w.rank}: {op}"), len(items))
        else:
            _object_slots(w, op, object_list, None, "object_list")
            sent = None
    with _within(w, op):
        _broadcast_objects(w, g, comm, op, object_list, sent, src, group)
    return None


def _broadcast_objects(w, g, comm, op, object_list, sent, src, group) -> None:
    """The root's pickled list (``sent``: its pickle and length there, None
    elsewhere) replaces ``object_list``'s items elsewhere: its size and
    length, then its bytes. A member whose list has another length refuses
    the second broadcast, so every member raises and nothing is unpickled."""
    me_root = sent is not None
    payload = sent[0] if me_root else None
    head = np.array([payload.size, sent[1]] if me_root else [0, 0], dtype=np.int64)
    broadcast(head, src, group)
    if not me_root and int(head[1]) != len(object_list):
        _refuse(comm, g, "broadcast")
        raise DistMismatchError(f"rank {w.rank}: {op}: rank {src} sends {int(head[1])} objects but this rank's "
                                f"list holds {len(object_list)}; pass lists of the same length")
    data = payload if me_root else np.empty(int(head[0]), dtype=np.uint8)
    broadcast(data, src, group)
    if not me_root:
        object_list[:] = _loads(data, f"rank {w.rank}: {op}", src)


def _gather_bytes(op, payload, group, dst):
    """All (dst None) or one rank gets every rank's pickled bytes."""
    w, g = _g._group(group, op)
    n = g.size()
    sizes = np.zeros(n, dtype=np.int64)
    all_gather_into_tensor(sizes, np.array([payload.size], dtype=np.int64), group)
    padded = np.zeros(int(sizes.max()), dtype=np.uint8)
    padded[:payload.size] = payload
    out = np.empty(n * padded.size, dtype=np.uint8)
    if dst is None:
        all_gather_into_tensor(out, padded, group)
    else:
        gather(padded, [out[j * padded.size:(j + 1) * padded.size] for j in range(n)] if w.rank == dst else None,
               dst, group)
    return [out[j * padded.size: j * padded.size + sizes[j]] for j in range(n)]


def all_gather_object(object_list, obj, group=None):
    """``object_list[j]`` of every rank becomes the ``obj`` of group rank j."""
    op = "all_gather_object"
    w, g, comm = _enter(op, group)
    if comm is None:
        return None
    with _refusing(comm, g, "all_gather"):      # (_gather_bytes begins with an all_gather)
        _object_slots(w, op, object_list, g.size(), "object_list")
        payload = _dumps(obj, f"rank {w.rank}: {op}")
    with _within(w, op):
        pieces = _gather_bytes(op, payload, group, None)
    for j, data in enumerate(pieces):
        object_list[j] = _loads(data, f"rank {w.rank}: {op}", g.ranks[j])
    return None


def gather_object(obj, object_gather_list=None, dst: int = 0, group=None):
    """``object_gather_list`` of global rank ``dst`` receives every rank's ``obj``."""
    op = "gather_object"
    w, g, comm = _enter(op, group)
    if comm is None:
        return None
    with _refusing(comm, g, "all_gather"):      # (_gather_bytes begins with an all_gather)
        _root(w, g, dst, op, "dst")
        if w.rank == dst:
            _object_slots(w, op, object_gather_list, g.size(), "object_gather_list")
        payload = _dumps(obj, f"rank {w.rank}: {op}")
    with _within(w, op):
        pieces = _gather_bytes(op, payload, group, dst)
    if w.rank == dst:
        for j, data in enumerate(pieces):
            object_gather_list[j] = _loads(data, f"rank {w.rank}: {op}", g.ranks[j])
    return None


def scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src: int = 0,
                        group=None):
    """``scatter_object_output_list[0]`` of group rank j becomes item j of ``src``'s input list."""
    op = "scatter_object_list"
    w, g, comm = _enter(op, group)
    if comm is None:
        return None
    with _refusing(comm, g, "broadcast"):       # (_broadcast_objects begins with a broadcast)
        _root(w, g, src, op, "src")
        if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
            raise DistError(f"rank {w.rank}: {op}: scatter_object_output_list must be a non-empty list; its "
                            "first item receives the object")
        holder, sent = [None], None
        if w.rank == src:
            items = _object_items(w, op, scatter_object_input_list, "scatter_object_input_list")
            if len(items) != g.size():
                raise DistError(f"rank {w.rank}: {op}: scatter_object_input_list must be a list of {g.size()} "
                                f"objects (one per rank of the group), got {len(items)}")
            holder = [items]
            sent = (_dumps(holder, f"rank {w.rank}: {op}"), 1)
    with _within(w, op):
        _broadcast_objects(w, g, comm, op, holder, sent, src, group)
    scatter_object_output_list[0] = holder[0][g.rank()]
    return None


def send_object_list(object_list, dst: int, group=None, device=None):
    """Send the pickled ``object_list`` to global rank ``dst``: the sizes of
    the objects' pickles (one int64 each, as torch sends them), then the
    pickles. A receive into a list of another length does not fit the sizes,
    so both messages wait for the next recv_object_list."""
    w = _g.world("send_object_list")
    who = f"rank {w.rank}: send_object_list"
    pickles = [_dumps(obj, who) for obj in _object_items(w, "send_object_list", object_list, "object_list")]
    sizes = np.array([p.size for p in pickles], dtype=np.int64)
    payload = np.concatenate(pickles) if pickles else np.zeros(0, dtype=np.uint8)
    _g.send(sizes, dst, group).wait()
    _g.send(payload, dst, group).wait()


def recv_object_list(object_list, src: int | None = None, group=None, device=None):
    """Fill ``object_list`` with the objects sent by ``src``; returns the sender's rank."""
    w = _g.world("recv_object_list")
    who = f"rank {w.rank}: recv_object_list"
    _object_slots(w, "recv_object_list", object_list, None, "object_list")
    sizes = np.zeros(len(object_list), dtype=np.int64)
    req = _g.recv(sizes, src, group)
    try:
        req.wait()
    except DistMismatchError as e:    # the sizes did not fit: both messages stay for the next receive
        raise DistMismatchError(f"{who}: the objects sent do not fit a list of {len(object_list)} ({e}); "
                                "they were kept for the next recv_object_list: pass a list as long as the "
                                "sender's") from None
    data = np.empty(int(sizes.sum()), dtype=np.uint8)
    _g.recv(data, req.source, group).wait()
    objs, at = [], 0
    for s in sizes.tolist():
        objs.append(_loads(data[at:at + s], who, req.source))
        at += s
    object_list[:] = objs
    return req.source


# ---------------------------------------------------------------- memory shared from the start

def empty(shape, dtype=None, group=None):
    """An uninitialised array of ``shape`` and ``dtype`` (default float32) in
    memory shared by the group's local members, for collectives that skip
    their copies (comm/shared.py). A collective call: every member calls it
    with the same shape and dtype. A torch dtype gives a torch tensor, any
    other a numpy array. Across hosts it is ordinary memory."""
    w, g, comm = _enter("empty", group)
    if comm is None:
        return _shared.Spec(shape, dtype, f"rank {w.rank}: empty").ordinary()
    with _refusing(comm, g, "empty"):
        spec = _shared.Spec(shape, dtype, f"rank {w.rank}: empty")
    with comm.lock:
        return _shared.allocate(w.rank, g, comm, spec, g.timeout)

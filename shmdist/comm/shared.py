"""Arrays that live in shared memory from the start (``shmdist.empty``), and
the collectives that work on them in place.

``empty(shape, dtype, group)`` is a collective call of the group's members.
On one host the lowest member makes one nameless segment (memfd, as
transport/segment.py makes every segment: no name in /dev/shm, nothing can
outlive the processes) with one region per member; every member maps the
whole segment and gets its own region as its array. The creator passes the
segment's record (pid, descriptor, token) through the group's arena, and the
others open it through /proc/<pid>/fd after the same checks as any segment.

An all_reduce (or broadcast) whose tensor is such an array, on the group it
was made for and above IN_PLACE_MIN bytes, skips the arena: member i reduces
the i-th part of every member's region straight into its own region, then
copies the others' reduced parts from their regions, then a last phase makes
sure nobody reads its region any more before it returns. Three phases and
no copy into or out of the arena (broadcast: the others copy the root's
region, two phases). Each member's descriptor carries which allocation and
which offset it passed (``extra``), so a member passing ordinary memory, or
another allocation, meets a mismatch error instead of silent garbage.

Lifetime: the arrays hold the mapping (numpy's base, torch's storage), so
the memory goes when the last array (or view) referring to it is gone, in
each process separately; the kernel frees it when the last process unmaps.
The registry below holds only addresses and a weak reference.

Across hosts (groups whose collective engine is the hierarchical one) the
array is ordinary memory, after the same call check.
"""
from __future__ import annotations

import bisect
import json
import struct
import weakref
import zlib

import numpy as np

from shmdist import _core, layout
from shmdist.errors import DistError
from shmdist.reduce_ops import ReduceOp, reduce_into
from shmdist.tensors import _numpy_name, _torch, torch_dtype_name
from shmdist.transport import segment

IN_PLACE_MIN = 256 << 10      # above this, all_reduce and broadcast on these arrays run in place
BLOCK = 512 << 10             # bytes reduced through a private scratch at a time (fits L2)
OFFSET_BITS = 40              # extra = allocation number << OFFSET_BITS | byte offset in the region
PAGE = 4096
_LEN = struct.Struct("<Q")

NUMBERS = (1 << (64 - OFFSET_BITS)) - 1   # allocation numbers wrap after this many (extra is 64 bits)
live: dict[int, "Alloc"] = {}  # start address of this rank's region -> its allocation
_starts: list[int] = []        # the keys of ``live``, sorted
_scratch: list = [None]
_made: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # group engine -> allocations made


class Spec:
    """What empty() was asked for: shape, dtype, and whether torch makes it."""

    def __init__(self, shape, dtype, who: str):
        if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
            shape = (shape,)
        try:
            shape = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise DistError(f"{who}: shape must be an int or a sequence of ints, got {shape!r}") from None
        if any(d < 0 for d in shape):
            raise DistError(f"{who}: shape {shape} has a negative dimension; pass sizes >= 0")
        torch = _torch()
        self.shape, self.torch = shape, torch is not None and isinstance(dtype, torch.dtype)
        if self.torch:
            self.dtype, self.name, self.itemsize = dtype, torch_dtype_name(dtype), dtype.itemsize
        else:
            try:
                self.dtype = np.dtype(np.float32 if dtype is None else dtype)
            except TypeError:
                raise DistError(f"{who}: dtype {dtype!r} is not a numpy dtype; for a torch tensor pass a "
                                "torch dtype (torch.bfloat16, torch.float32, ...)") from None
            self.name, self.itemsize = _numpy_name(self.dtype, who), self.dtype.itemsize
        self.count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        self.nbytes = self.count * self.itemsize
        self.digest = zlib.crc32(repr(shape).encode())    # same shape on every member: the descriptor's extra

    def describe(self) -> str:
        return f"empty({self.shape}, {self.name})"

    def ordinary(self):
        """An array of this shape and dtype in this process's own memory."""
        if self.torch:
            return _torch().empty(self.shape, dtype=self.dtype)
        return np.empty(self.shape, dtype=self.dtype)

    def over(self, mm, offset: int):
        """The array over ``count`` elements of ``mm`` from ``offset`` (it keeps ``mm`` alive)."""
        if self.torch:
            return _torch().frombuffer(mm, dtype=self.dtype, count=self.count, offset=offset).reshape(self.shape)
        return np.frombuffer(mm, dtype=self.dtype, count=self.count, offset=offset).reshape(self.shape)


class Alloc:
    """One allocation as this rank sees it: its region, the members' regions, the group."""

    __slots__ = ("group", "number", "addr", "nbytes", "first", "stride", "mm")

    def __init__(self, group, number, addr, nbytes, first, stride, mm):
        self.group, self.number, self.addr, self.nbytes = group, number, addr, nbytes
        self.first, self.stride = first, stride   # member j's region starts at first + j * stride
        self.mm = weakref.ref(mm)

    def extra(self, offset: int) -> int:
        return self.number << OFFSET_BITS | offset


def _forget(addr: int) -> None:
    live.pop(addr, None)
    i = bisect.bisect_left(_starts, addr)
    if i < len(_starts) and _starts[i] == addr:
        del _starts[i]


def mapped_bytes() -> int:
    """Bytes this process maps for live allocations (every member's region:
    memory_usage's ``empty_arrays``)."""
    maps = (a.mm() for a in live.values())
    return sum(len(mm) for mm in maps if mm is not None)


def find(addr: int, nbytes: int):
    """(allocation, offset in its region) when [addr, addr + nbytes) lies in
    this rank's region of a live allocation, else None."""
    i = bisect.bisect_right(_starts, addr) - 1
    if i < 0:
        return None
    a = live.get(_starts[i])
    if a is None or addr + nbytes > a.addr + a.nbytes:
        return None
    return a, addr - a.addr


def target(rank: int, op: str, g, buf):
    """The allocation and offset for an in-place ``op`` of ``buf`` on group
    ``g``, or None (ordinary memory, another group's, or too small). Raises
    for an array of a group that was destroyed."""
    if buf.nbytes <= IN_PLACE_MIN:
        return None
    found = find(buf.addr, buf.nbytes)
    if found is None:
        return None
    if found[0].group is not g:
        old = found[0].group
        if old.destroyed:
            raise DistError(f"rank {rank}: {op}: this tensor comes from shmdist.empty on group "
                            f"{list(old.ranks)}, which was destroyed (destroy_process_group); its memory "
                            "can no longer take part in collectives. Copy it into an array from "
                            "shmdist.empty of the current group (or into ordinary memory) first")
        return None   # another live group's memory: ordinary memory for this one
    return found


# ---------------------------------------------------------------- empty()

def allocate(rank: int, g, comm, spec: Spec, timeout: float):
    """The collective part of empty(): check the call, make and map the
    segment, return this member's array. Runs under ``comm.lock``."""
    from shmdist.comm.arena import GroupComm
    what = spec.describe()
    desc = ("empty", spec.nbytes, 0, -1, spec.name, spec.digest)
    if not isinstance(comm, GroupComm):       # across hosts: ordinary memory, the call still checked
        check = getattr(comm, "_check", None)   # hier.HierComm's descriptor check (shapes too)
        if check is not None:
            check(what, desc, timeout)
        else:
            comm.barrier_as("empty", spec.name, timeout)
        return spec.ordinary()
    comm._first_pass(what, desc, timeout)
    if spec.nbytes == 0:
        return spec.ordinary()
    who = f"rank {rank}: {what}"
    n, me = comm.n, comm.me
    number = _made[comm] = _made.get(comm, 0) % NUMBERS + 1   # counts this group's empty() calls
    stride = -(-spec.nbytes // PAGE) * PAGE
    first = segment.HEADER_BYTES
    seg, why = None, b""
    b = comm.phase % 2
    if me == 0:                               # make it; its record (or why not) to the others
        try:
            seg = segment.create(first + n * stride, who)
            rec = segment.record(seg)
        except Exception as e:     # noqa: BLE001 - said to every member below
            why = str(e).encode()
            rec = json.dumps({"error": str(e)}).encode()
        _put(comm, b, rec)
    try:
        comm._pass(what, timeout)
        if me != 0:
            rec = json.loads(_get(comm, 0, b))
            try:
                if "error" in rec:
                    raise DistError(f"{who}: rank {g.ranks[0]} could not make the shared memory: {rec['error']}")
                seg = segment.attach(rec, who, f"rank {g.ranks[0]}")
            except Exception as e:     # noqa: BLE001 - said to every member below
                why = str(e).encode()
        b = comm.phase % 2
        _put(comm, b, why)
        comm._pass(what, timeout)             # every member mapped it (or said why not)
    except BaseException:
        if seg is not None:                   # a member died or timed out: this one's memory goes now
            seg.close()                       # (its descriptor too, which nothing else would close)
        raise
    if seg is not None:
        seg.release()                         # the creator's descriptor: the mappings keep it now
    failed = [(g.ranks[j], _get(comm, j, b).decode()) for j in range(n)]
    failed = [text if text.startswith(f"rank {r}: ") else f"rank {r}: {text}" for r, text in failed if text]
    if failed:
        if seg is not None:
            seg.close()
        raise DistError(f"{who}: the shared memory could not be set up on every member, so no member "
                        f"gets it: {'; '.join(failed)}")
    mm = seg.mm
    offset = first + me * stride
    arr = spec.over(mm, offset)
    addr = seg.addr + offset
    live[addr] = Alloc(g, number, addr, spec.nbytes, seg.addr + first, stride, mm)
    bisect.insort(_starts, addr)
    weakref.finalize(mm, _forget, addr)
    seg.array = seg.mm = None                 # the arrays hold the mapping from here on
    return arr


def _put(comm, parity: int, data: bytes) -> None:
    view = comm._view(comm._buf(comm.me, parity), _LEN.size + len(data), np.dtype(np.uint8))
    view[:_LEN.size] = np.frombuffer(_LEN.pack(len(data)), dtype=np.uint8)
    view[_LEN.size:] = np.frombuffer(data, dtype=np.uint8)


def _get(comm, member: int, parity: int) -> bytes:
    addr = comm._buf(member, parity)
    size, = _LEN.unpack(comm._view(addr, _LEN.size, np.dtype(np.uint8)).tobytes())
    return comm._view(addr + _LEN.size, size, np.dtype(np.uint8)).tobytes()


# ---------------------------------------------------------------- in place

def all_reduce(comm, alloc: Alloc, offset: int, buf, arr: np.ndarray, op: ReduceOp, timeout: float) -> None:
    """all_reduce of ``arr`` (this member's region of ``alloc`` from ``offset``),
    reduced from the members' regions directly. Runs under ``comm.lock``."""
    what = lambda: f"all_reduce({op.name}, {buf.describe()}, in place in shmdist.empty memory)"
    comm._first_pass(what, ("all_reduce", buf.nbytes, int(op), -1, buf.dtype, alloc.extra(offset)), timeout)
    n, me, dtype = comm.n, comm.me, arr.dtype
    if n == 1:
        return
    isz = dtype.itemsize
    parts = layout.parts(arr.size, n)
    row = [alloc.first + j * alloc.stride + offset for j in range(n)]
    s, length = parts[me]
    if length:
        _reduce_part(comm, alloc, row, s * isz, length, arr, op, buf.dtype, n)
    comm._pass(what, timeout)                 # every part reduced, in its member's region
    for j, (s, length) in enumerate(parts):
        if j != me and length:
            _core.copy(row[me] + s * isz, row[j] + s * isz, length * isz)
    comm._pass(what, timeout)                 # nobody reads this member's region any more


def broadcast(comm, alloc: Alloc, offset: int, buf, root: int, timeout: float) -> None:
    """broadcast from the root's region straight into each member's. Under ``comm.lock``."""
    what = lambda: f"broadcast(src={comm.ranks[root]}, {buf.describe()}, in shmdist.empty memory)"
    comm._first_pass(what, ("broadcast", buf.nbytes, 0, root, buf.dtype, alloc.extra(offset)), timeout)
    if comm.me != root:
        _core.copy(buf.addr, alloc.first + root * alloc.stride + offset, buf.nbytes)
    comm._pass(what, timeout)                 # the root's region is read: it may change it again


def _alias_safe(plan) -> bool:
    """The C kernel may write its output over one of its inputs: the one-pass
    float32/float64 SUM and PRODUCT (_sum.h), on CPUs with AVX2 or AVX-512."""
    return (plan is not None and plan[0] <= layout.kind_of("float64") and plan[1] <= 1
            and _core.half_level() >= 1)


def _reduce_part(comm, alloc, row, start, length, arr, op, dtype_name, n) -> None:
    """Reduce ``length`` elements from byte ``start`` of every member's row
    into this member's row, in rank order."""
    me, dtype = comm.me, arr.dtype
    isz = dtype.itemsize
    plan = comm.ph.plan(dtype, op, dtype_name)
    if _alias_safe(plan):
        _core.reduce_rows(plan[0], plan[1], row[me] + start, row[0] + start, alloc.stride, n, length)
        return
    scratch = _scratch[0]
    if scratch is None:
        scratch = _scratch[0] = np.empty(BLOCK, dtype=np.uint8)
    step = BLOCK // isz
    mm = alloc.mm()                           # alive: the caller's array holds it
    for at in range(0, length, step):
        k = min(step, length - at)
        byte = start + at * isz
        out = scratch[:k * isz].view(dtype)
        if plan is not None:
            _core.reduce_rows(plan[0], plan[1], out.ctypes.data, row[0] + byte, alloc.stride, n, k)
        else:
            base = alloc.first - segment.HEADER_BYTES   # the mapping's start
            ins = [np.frombuffer(mm, dtype=dtype, count=k, offset=row[j] + byte - base) for j in range(n)]
            reduce_into(out, ins, op, dtype_name, n)
        _core.copy(row[me] + byte, out.ctypes.data, k * isz)

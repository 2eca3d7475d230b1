"""The C core and the Python layers read every binary layout from one
definition (shmdist/layout.py): these single-process tests fail when the
generated C header is stale, when the compiled core was built from another
layout, or when what C writes (a message header, a call descriptor, the
split of a chunk into parts) differs from what Python writes or reads."""
import os

import numpy as np
import pytest

from shmdist import _core, layout
from shmdist.comm import arena
from shmdist.transport.engine import HDR, dtype_field, make_header
from shmdist.reduce_ops import ReduceOp
from shmdist.tensors import as_buf

HERE = os.path.dirname(layout.__file__)


def test_generated_c_files_are_those_layout_py_writes():
    for name, text in (("_layout.h", layout.c_header()), ("_layout.pxi", layout.pxi_text())):
        with open(os.path.join(HERE, name)) as f:
            assert f.read() == text, f"{name} is stale: run python shmdist/layout.py and rebuild"


def test_compiled_core_has_the_layout_of_layout_py():
    assert _core.C_LAYOUT == layout.c_constants()
    assert (_core.HEADER_BYTES, _core.CTL_BYTES, _core.RING_CTL_BYTES, _core.CAUSE_BYTES) == \
        (layout.HEADER_BYTES, layout.CTL_BYTES, layout.RING_CTL_BYTES, layout.CAUSE_BYTES)
    assert HDR.size == layout.HEADER_BYTES and layout.DESC.size == layout.DESC_BYTES
    assert [(op.name, int(op)) for op in ReduceOp] == [(name, i) for i, name in enumerate(layout.OPS)]
    for n in (0, 1, 63, 64, 65, 1 << 20):
        assert _core.record_bytes(n) == layout.record_bytes(n)


def test_header_offsets_name_the_struct_fields():
    fields = HDR.unpack(bytes(range(HDR.size)))
    raw = bytes(range(HDR.size))
    for at, value in ((layout.HDR_TAG, fields[3]), (layout.HDR_GID, fields[4]),
                      (layout.HDR_SRC, fields[5]), (layout.HDR_NBYTES, fields[7])):
        width = 4 if at == layout.HDR_SRC else 8
        assert int.from_bytes(raw[at:at + width], "little", signed=at != layout.HDR_NBYTES) == value
    assert raw[layout.HDR_DTYPE:layout.HDR_DTYPE + layout.DTYPE_BYTES] == fields[8]


@pytest.mark.parametrize("count", [0, 1, 5, 63, 64, 1000, 4099])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16])
def test_c_part_split_is_layout_parts(count, n):
    parts = layout.parts(count, n)
    assert [_core.part_start(count, n, j) for j in range(n + 1)] == [s for s, _ in parts] + [count]
    assert sum(length for _, length in parts) == count


class _FakeEngine:
    """What a Lane binds of its engine, for one process that is both ends."""
    def __init__(self):
        self.backoff = _core.Backoff(0, 0)
        self.lock = _core.RLock()
        self.queues = _core.Queues([0, 1])
        self.single_min = 0         # no single copies: every send goes into the ring
        self.pid = os.getpid()


def _ring_pair(mem, size=1 << 16):
    """A producer Ring and a consumer Ring over the same memory."""
    base = mem.ctypes.data
    ctl_a, ctl_b = base, base + layout.CTL_BYTES
    at = base + 2 * layout.CTL_BYTES
    at = (at + 4095) // 4096 * 4096
    return (_core.Ring(at, at + layout.RING_CTL_BYTES, size, ctl_b),
            _core.Ring(at, at + layout.RING_CTL_BYTES, size, ctl_a))


@pytest.mark.parametrize("shape,dtype,tag", [((3, 4), "float32", 7), ((5,), "int64", -2), ((), "float64", 0),
                                             ((1, 2, 1, 2, 1, 2, 1, 2), "uint8", 1 << 40)])
def test_fast_lane_header_is_the_engines_header(shape, dtype, tag):
    mem = np.zeros(1 << 18, dtype=np.uint8)
    out, inc = _ring_pair(mem)
    lane = _core.Lane(_FakeEngine(), 0, 2, {1: out}, {})
    arr = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    lane.dtypes[arr.dtype] = dtype_field(arr.dtype.name)
    assert lane.send(arr, 1, tag) is not None
    buf = as_buf(arr, writable=False, who="test")
    assert inc.peek() == make_header(tag, 0, 0, buf)
    got = np.empty_like(arr)
    assert inc.take(tag, 0, got.ctypes.data, got.nbytes, dtype_field(arr.dtype.name)) == 1
    assert (got == arr).all()


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
def test_phaser_descriptor_is_the_one_python_packs(dtype):
    slot = 1 << 16
    ctl = np.zeros(layout.SLOT_STRIDE, dtype=np.uint8)
    bufs = np.zeros(2 * slot, dtype=np.uint8)
    bell = np.zeros(layout.CTL_BYTES, dtype=np.uint8)
    ph = _core.Phaser(ctl.ctypes.data, layout.SLOT_STRIDE, 1, 0, np.zeros(0, dtype=np.uint64),
                      bell.ctypes.data, _core.Backoff(1000, 0), _core.RLock(), arena._BARRIER,
                      bufs.ctypes.data, slot, arena._PHASER_KINDS, layout.KINDS.index("all_reduce"))
    arr = np.arange(10, dtype=dtype)
    assert ph.all_reduce(arr, ReduceOp.SUM, slot) > 0
    at = ph.desc_at
    assert bytes(ctl[at:at + layout.DESC_BYTES]) == \
        layout.pack_desc("all_reduce", arr.nbytes, int(ReduceOp.SUM), -1, dtype.encode(), 0)
    assert ph.barrier() > 0
    at = ph.desc_at
    assert bytes(ctl[at:at + layout.DESC_BYTES]) == arena._BARRIER
    assert int.from_bytes(bytes(ctl[layout.SLOT_PHASE:layout.SLOT_PHASE + 8]), "little") == ph.phase == 2

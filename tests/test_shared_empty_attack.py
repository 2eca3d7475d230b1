"""Attacks on shmdist.empty (README, "Memory shared from the start") and the
in-place all_reduce / broadcast on its arrays (comm/shared.py).

Every result is compared bit for bit with the same call on ordinary arrays
holding the same data, and (for SUM) with a local reference added in rank
order from every rank's known input. The ranks count the calls that took
the in-place path where it matters, so a case cannot pass by falling back.

Written by a helper told to break the promise. It found one fault: a member
that died or timed out while empty() set up left the creator holding the
segment's descriptor (its whole memory) until the process exited; allocate()
now closes it on every failure (the last two tests).
"""
from __future__ import annotations

import gc
import glob
import os
import signal
import warnings

import numpy as np
import pytest

import shmdist as dist
from shmdist.comm import shared

from test_shared_empty import _count_in_place, both_reduced

BIG = 70001                         # float32 elements: 280 KB, above the in-place threshold, odd
MIN_COUNT = shared.IN_PLACE_MIN // 4   # float32 elements of exactly the threshold (not in place)
OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR")


def _floats(rank: int, count: int, dtype=np.float32, near_one=False) -> np.ndarray:
    """Rank ``rank``'s values: random, so that the order of the additions shows in the bits."""
    rng = np.random.default_rng(1000 + rank)
    x = rng.standard_normal(count)
    if near_one:
        x = 1 + x / 64
    return x.astype(dtype)


def _values(rank: int, count: int, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(2000 + rank)
    if dtype.kind == "b":
        return rng.integers(0, 2, count).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (1 + rng.standard_normal(count) / 64 + 1j * rng.standard_normal(count) / 64).astype(dtype)
    return (1 + rng.standard_normal(count) / 64).astype(dtype)


def _rank_order_sum(arrays):
    out = arrays[0].copy()
    for a in arrays[1:]:
        out = out + a
    return out


def _memfd_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("/memfd:shmdist" in line for line in f)


def _memfd_fd_sizes() -> list:
    """Sizes of the shmdist memfds this process holds a descriptor of."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:shmdist"):
                out.append(os.fstat(int(fd)).st_size)
        except OSError:
            pass
    return out


def _memfd_fds() -> int:
    return len(_memfd_fd_sizes())


@pytest.fixture
def no_new_dev_shm():
    before = set(glob.glob("/dev/shm/*"))
    yield
    assert set(glob.glob("/dev/shm/*")) - before == set()


# ---------------------------------------------------------------- views, offsets, dtype views

VIEW_CASES = (
    # name, view of the whole float32 array, op, in place expected
    ("offset slice", lambda a: a[BIG:], "SUM", True),
    ("odd offset tail", lambda a: a[1:], "SUM", True),
    ("row of a reshape", lambda a: a.reshape(3, BIG)[2], "PRODUCT", True),
    ("AVG of a slice", lambda a: a[5:-7], "AVG", True),
    ("MAX with NaN and signed zeros", lambda a: a[3:], "MAX", True),
    ("MIN with NaN and signed zeros", lambda a: a[:-3], "MIN", True),
    ("int32 view BXOR", lambda a: a.view(np.int32)[7:], "BXOR", True),
    ("int32 view SUM (wraps)", lambda a: a.view(np.int32), "SUM", True),
    ("float64 view", lambda a: a[:-1].view(np.float64), "SUM", True),
    ("uint8 view at odd byte offset", lambda a: a.view(np.uint8)[3:], "BOR", True),
    ("misaligned float32 SUM", lambda a: a.view(np.uint8)[1:1 + 4 * (3 * BIG - 1)].view(np.float32), "SUM", True),
    ("misaligned float32 MAX", lambda a: a.view(np.uint8)[2:2 + 4 * (3 * BIG - 1)].view(np.float32), "MAX", True),
    ("misaligned float64 PRODUCT", lambda a: a.view(np.uint8)[4:4 + 8 * (3 * BIG // 2 - 1)].view(np.float64),
     "PRODUCT", True),
    ("strided", lambda a: a[::2], "SUM", False),
    ("reversed", lambda a: a[::-1], "SUM", False),
    ("transposed (F order)", lambda a: a.reshape(3, BIG).T, "SUM", False),
    ("other byte order", lambda a: a.view(">f4"), "SUM", False),
    ("exactly the threshold", lambda a: a[:MIN_COUNT], "SUM", False),
    ("one element over the threshold", lambda a: a[:MIN_COUNT + 1], "SUM", True),
)


def views_against_plain(rank, world_size, init_method, half_limit=None):
    if half_limit is not None:             # another kernel build: 0 is plain C, where _alias_safe is False
        from shmdist import _core
        _core.set_half_limit(half_limit)
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=30)
    calls = _count_in_place()
    n, count, bad = world_size, 3 * BIG, []
    base = dist.empty(count, np.float32)
    plain = np.empty(count, np.float32)

    def fill(name, r):
        x = _floats(r, count, near_one="PRODUCT" in name)
        if "NaN" in name:
            x[::101] = np.nan
            x[5::97] = 0.0 if r % 2 else -0.0
            x[7::89] = -0.0 if r % 2 else 0.0
        return x

    for name, view, op, in_place in VIEW_CASES:
        before = calls["all_reduce"]
        base[:] = plain[:] = fill(name, rank)
        try:
            dist.all_reduce(view(plain), getattr(dist.ReduceOp, op))
            dist.all_reduce(view(base), getattr(dist.ReduceOp, op))
        except Exception as e:  # noqa: BLE001 - reported
            bad.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if base.tobytes() != plain.tobytes():
            bad.append(f"{name}: differs from the plain array")
        if (calls["all_reduce"] - before == 1) != in_place:
            bad.append(f"{name}: in place {calls['all_reduce'] - before}, expected {in_place}")
        if op == "SUM" and name in ("offset slice", "odd offset tail"):   # local reference, rank order
            v = view(np.arange(count))
            lo = int(v[0])
            want = _rank_order_sum([fill(name, r)[lo:] for r in range(n)])
            if base[lo:].tobytes() != want.tobytes() or base[:lo].tobytes() != fill(name, rank)[:lo].tobytes():
                bad.append(f"{name}: differs from the rank-order reference")
    # two overlapping views of one array in consecutive calls, and broadcast of views from changing roots
    base[:] = plain[:] = fill("", rank)
    for v, op in ((lambda a: a[:2 * BIG], "SUM"), (lambda a: a[BIG:], "PRODUCT"), (lambda a: a[BIG // 2:], "SUM")):
        dist.all_reduce(v(plain), getattr(dist.ReduceOp, op))
        dist.all_reduce(v(base), getattr(dist.ReduceOp, op))
    if base.tobytes() != plain.tobytes():
        bad.append("consecutive overlapping views")
    for i, v in enumerate((lambda a: a[BIG:], lambda a: a.view(np.uint8)[5:], lambda a: a[::3],
                           lambda a: a.view(np.int16)[1:], lambda a: a)):
        root = i % n
        base[:] = plain[:] = fill("", rank)
        dist.broadcast(v(plain), root)
        dist.broadcast(v(base), root)
        if base.tobytes() != plain.tobytes():
            bad.append(f"broadcast view {i} from {root}")
    x = np.ones(4)
    dist.all_reduce(x)
    dist.destroy_process_group()
    return bad, calls["broadcast"], x.tolist()


@pytest.mark.parametrize("world_size,half_limit", [(2, None), (3, None), (2, 0), (3, 1)])
def test_views_offsets_and_dtype_views_give_what_plain_arrays_give(run_ranks, world_size, half_limit,
                                                                    no_new_dev_shm):
    """Attacks find()/offsets: slices at offsets, rows, dtype views (int32, float64, uint8 at odd
    byte offsets), misaligned float views through the C kernels, NaN and signed zeros for
    MIN/MAX, strided/reversed/F-order/byte-swapped views (copied), the threshold edge, and
    consecutive overlapping views; broadcast of views from changing roots. With the kernel builds
    capped too (plain C: the scratch path of _reduce_part; AVX2)."""
    for bad, bcasts, after in run_ranks(views_against_plain, world_size, half_limit, timeout=90):
        assert bad == []
        assert bcasts == 4          # the contiguous views (offset, uint8 at 5, int16 at 2, whole), not a[::3]
        assert after == [float(world_size)] * 4


# ---------------------------------------------------------------- every numpy dtype, every op

DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "complex64", "complex128")


def dtypes_against_plain(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=30)
    calls = _count_in_place()
    bad, expected = [], 0
    for i, dtype in enumerate(DTYPES):
        isz = np.dtype(dtype).itemsize
        count = shared.IN_PLACE_MIN // isz + 3
        got = dist.empty((count,), dtype)
        for op in OPS:
            want = _values(rank, count, dtype)
            got[:] = want
            errors = both_reduced(want, got, op)
            if errors[0] != errors[1]:
                bad.append(f"{dtype} {op}: plain {errors[0]}, shared {errors[1]}")
            elif errors[0] is None:
                expected += 1
                if got.tobytes() != want.tobytes():
                    bad.append(f"{dtype} {op}: {got[:3]} != {want[:3]}")
        root = i % world_size
        want = _values(rank, count, dtype)
        got[:] = want
        dist.broadcast(want, root)
        dist.broadcast(got, root)
        if got.tobytes() != want.tobytes():
            bad.append(f"{dtype} broadcast from {root}")
        del got
    gc.collect()
    left = dist.memory_usage()["empty_arrays"], len(shared.live)
    dist.destroy_process_group()
    return bad, calls, expected, left


def test_every_numpy_dtype_and_op_with_three_ranks(run_ranks, no_new_dev_shm):
    """Attacks the non-kernel reduction path of _reduce_part (numpy reduce_into over the mapping)
    and the kernels' alias handling: bool, 8/16/32/64-bit ints signed and unsigned (wrapping),
    float16, float32/64, complex, every op, at just over 256 KiB with uneven parts; errors must
    be the plain array's; broadcast from each root; memory returned after del."""
    for bad, calls, expected, left in run_ranks(dtypes_against_plain, 3, timeout=120):
        assert bad == []
        assert expected > 40 and calls == {"all_reduce": expected, "broadcast": len(DTYPES)}
        assert left == (0, 0)


# ---------------------------------------------------------------- sizes

def sizes(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    calls = _count_in_place()
    bad, in_place = [], []
    round_elems = (512 << 10) // 4
    for shape in ((), (0,), (1,), (3, 0), (MIN_COUNT,), (MIN_COUNT + 1,), (round_elems - 1,), (round_elems,),
                  (round_elems + 1,), (2 * round_elems + 3,), (6 << 20,)):  # the last: 24 MiB, > the arena
        before = calls["all_reduce"], calls["broadcast"]
        a = dist.empty(shape, np.float32)
        if a.shape != shape or a.dtype != np.float32:
            bad.append(f"{shape}: got {a.shape} {a.dtype}")
            continue
        count = a.size
        a[...] = _floats(rank, count).reshape(shape)
        dist.all_reduce(a)
        want = _rank_order_sum([_floats(r, count) for r in range(world_size)]).reshape(shape)
        if a.tobytes() != want.tobytes():
            bad.append(f"{shape}: all_reduce")
        a[...] = _floats(rank, count).reshape(shape)
        dist.broadcast(a, world_size - 1)
        if a.tobytes() != _floats(world_size - 1, count).reshape(shape).tobytes():
            bad.append(f"{shape}: broadcast")
        in_place.append((calls["all_reduce"] - before[0], calls["broadcast"] - before[1]))
        del a
    gc.collect()
    left = dist.memory_usage()["empty_arrays"], _memfd_maps()
    dist.destroy_process_group()
    return bad, in_place, left


def test_sizes_zero_one_threshold_round_and_bigger_than_the_arena(run_ranks, no_new_dev_shm):
    """Attacks the size edges: 0-d, empty and zero-width shapes, 1 element, exactly 256 KiB (not in
    place) and one element more (in place), around the 512 KiB round, and 24 MiB (far above the
    1 MiB arena); results against the rank-order reference; nothing left mapped."""
    for bad, in_place, left in run_ranks(sizes, 2, timeout=90):
        assert bad == []
        assert in_place == [(0, 0)] * 5 + [(1, 1)] * 6
        assert left[0] == 0


# ---------------------------------------------------------------- torch through the "shm" backend

def torch_backend(rank, world_size, init_method):
    import torch
    import torch.distributed as tdist
    import shmdist.torch  # noqa: F401
    tdist.init_process_group("shm", init_method=init_method, rank=rank, world_size=world_size)
    calls = _count_in_place()
    bad, expected = [], 0
    ops = {"SUM": tdist.ReduceOp.SUM, "AVG": tdist.ReduceOp.AVG, "PRODUCT": tdist.ReduceOp.PRODUCT,
           "MIN": tdist.ReduceOp.MIN, "MAX": tdist.ReduceOp.MAX}
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64,
                  torch.uint8, torch.complex64, torch.bool):
        count = shared.IN_PLACE_MIN // dtype.itemsize + 5
        got = dist.empty((count,), dtype)
        if not isinstance(got, torch.Tensor) or got.dtype != dtype:
            bad.append(f"{dtype}: {type(got)}")
            continue
        for name, op in ops.items():
            for async_op in (False, True):
                src = torch.from_numpy(_values(rank, count, "float64" if dtype.is_floating_point else
                                               "complex128" if dtype.is_complex else "int64")).to(dtype)
                want = src.clone()
                got.copy_(src)
                errors = []
                for t in (want, got):
                    try:
                        work = tdist.all_reduce(t, op, async_op=async_op)
                        if async_op:
                            work.wait()
                        errors.append(None)
                    except Exception as e:  # noqa: BLE001 - compared
                        errors.append(type(e).__name__)
                if errors[0] != errors[1]:
                    bad.append(f"{dtype} {name}: plain {errors[0]}, shared {errors[1]}")
                elif errors[0] is None:
                    expected += 1
                    if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                        bad.append(f"{dtype} {name} async={async_op}")
        for root in range(world_size):
            want = torch.full((count,), rank + 1).to(dtype)
            got.copy_(want)
            tdist.broadcast(want, root)
            tdist.broadcast(got, root)
            if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                bad.append(f"{dtype} broadcast from {root}")
    # lazily conjugated and negated views of shared tensors: their values, moved resolved
    c = dist.empty((BIG,), torch.complex64)
    src = torch.from_numpy(_values(rank, BIG, "complex64"))
    c.copy_(src)
    want = src.clone()
    dist.all_reduce(want.conj(), dist.ReduceOp.PRODUCT)     # (torch.distributed refuses conj views)
    dist.all_reduce(c.conj(), dist.ReduceOp.PRODUCT)
    if not torch.equal(c, want):
        bad.append("conj view")
    f = dist.empty((BIG,), torch.float32)
    src = torch.from_numpy(_floats(rank, BIG))
    f.copy_(src)
    want = src.clone()
    dist.all_reduce(torch._neg_view(want), dist.ReduceOp.MAX)
    dist.all_reduce(torch._neg_view(f), dist.ReduceOp.MAX)
    if not torch.equal(f, want):
        bad.append("neg view")
    tdist.destroy_process_group()
    del got, c, f, t, work
    gc.collect()
    return bad, calls["all_reduce"], expected, calls["broadcast"], len(shared.live)


def test_torch_dtypes_through_the_shm_backend(run_ranks, no_new_dev_shm):
    """Attacks the torch path: bf16/fp16 (float32 accumulation, one rounding), float/int/uint8/
    complex/bool tensors from shmdist.empty through torch.distributed's "shm" backend, every op
    sync and async_op, errors alike, broadcast from each root, conj and neg lazy views."""
    pytest.importorskip("torch")
    for bad, ar, expected, bc, live in run_ranks(torch_backend, 2, timeout=120):
        assert bad == []
        assert expected > 30 and ar == expected
        assert bc == 9 * 2 and live == 0


# ---------------------------------------------------------------- subgroups and mixed state

def subgroups(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=30)
    calls = _count_in_place()
    bad = []
    sub = dist.new_group([0, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = dist.empty(BIG, np.float32, group=sub)     # rank 2: not a member, an ordinary array
    w = dist.empty(BIG, np.float32)
    n = world_size

    def ref(members, count=BIG):
        return _rank_order_sum([_floats(r, count) for r in members])

    # ranks 0 and 1 hold live allocations (general path), rank 2 none (one-call paths) for ordinary memory
    for count in (MIN_COUNT + 1, (512 << 10) // 4, (512 << 10) // 4 + 1, 3 * BIG):
        x = _floats(rank, count)
        dist.all_reduce(x)
        if x.tobytes() != ref(range(n), count).tobytes():
            bad.append(f"ordinary all_reduce of {count}")
        for root in range(n):
            x = _floats(rank, count)
            dist.broadcast(x, root)
            if x.tobytes() != _floats(root, count).tobytes():
                bad.append(f"ordinary broadcast of {count} from {root}")
    s[:] = _floats(rank, BIG)
    dist.all_reduce(s)                                   # subgroup memory on the world: ordinary
    if s.tobytes() != ref(range(n)).tobytes():
        bad.append("subgroup array on the world")
    if rank < 2:
        s[:] = _floats(rank, BIG)
        dist.all_reduce(s, group=sub)                    # on its own group: in place
        if s.tobytes() != ref(range(2)).tobytes():
            bad.append("subgroup array on the subgroup")
        w[:] = _floats(rank, BIG)
        dist.all_reduce(w, group=sub)                    # world memory on the subgroup: ordinary
        if w.tobytes() != ref(range(2)).tobytes():
            bad.append("world array on the subgroup")
        w[:] = _floats(rank, BIG)
        dist.broadcast(w, 1, group=sub)
        if w.tobytes() != _floats(1, BIG).tobytes():
            bad.append("world array broadcast on the subgroup")
    w[:] = _floats(rank, BIG)
    dist.all_reduce(w)                                   # in place on the world
    if w.tobytes() != ref(range(n)).tobytes():
        bad.append("world array on the world")
    # destroying the subgroup: its arrays then raise on any group, the world's keep working
    dist.destroy_process_group(sub)
    raised = None
    try:
        dist.all_reduce(s)
    except dist.DistError as e:
        raised = f"{type(e).__name__}: {e}"
    w[:] = _floats(rank, BIG)
    dist.all_reduce(w)
    if w.tobytes() != ref(range(n)).tobytes():
        bad.append("world array after the subgroup was destroyed")
    dist.destroy_process_group()
    return bad, calls, raised


def test_subgroup_arrays_world_arrays_and_mixed_registry_state(run_ranks, no_new_dev_shm):
    """Attacks group matching in target() and the fast-path gate on _shared.live: ranks 0-1 hold a
    subgroup's allocation, rank 2 none, and ordinary big all_reduce/broadcast must still pair
    up; subgroup memory on the world and world memory on the subgroup are ordinary; after the
    subgroup is destroyed its array raises (every rank, so the group stays in step)."""
    out = run_ranks(subgroups, 3, timeout=90)
    for rank, (bad, calls, raised) in enumerate(out):
        assert bad == []
        assert calls["all_reduce"] == (2 if rank == 2 else 3) and calls["broadcast"] == 0
        if rank < 2:
            assert raised is not None and "destroyed" in raised, raised
        # (rank 2's s is ordinary memory: it calls, and meets the others' refusals as a mismatch)
        else:
            assert raised is not None and "DistMismatchError" in raised, raised


# ---------------------------------------------------------------- one rank lets go, another keeps

def one_rank_frees(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=30)
    calls = _count_in_place()
    out = {}
    a = dist.empty(BIG, np.float32)
    a[:] = rank + 1
    dist.all_reduce(a)
    if rank == 1:
        del a
        gc.collect()
        out["live_after_del"] = len(shared.live)
    dist.barrier()
    b = dist.empty(BIG, np.float32)           # a second allocation; rank 0 still holds the first
    b[:] = 7
    try:                                      # rank 0: the first allocation, rank 1: the second
        dist.all_reduce(a if rank == 0 else b)
        out["mismatch"] = None
    except dist.DistMismatchError as e:
        out["mismatch"] = str(e)
    if rank == 0:
        out["a_intact"] = bool((a == 3).all())
    b[:] = rank + 2
    dist.all_reduce(b)
    out["b"] = float(b[-1])
    del b
    if rank == 0:
        del a
    gc.collect()
    out["left"] = dist.memory_usage()["empty_arrays"], len(shared.live), _memfd_maps()
    out["calls"] = dict(calls)
    dist.destroy_process_group()
    return out


def test_one_rank_frees_its_array_while_another_keeps_it(run_ranks, no_new_dev_shm):
    """Attacks lifetime across processes: rank 1 drops its array while rank 0 keeps (and reads) its
    own; a call pairing rank 0's old allocation with rank 1's new one is a mismatch on both,
    the group stays usable, and every rank's memory is returned at the end."""
    for rank, out in enumerate(run_ranks(one_rank_frees, 2, timeout=60)):
        assert out["mismatch"] is not None and "shmdist.empty memory #1" in out["mismatch"] \
            and "shmdist.empty memory #2" in out["mismatch"], out["mismatch"]
        assert out["b"] == 5.0
        assert out["left"][:2] == (0, 0)
        assert out["calls"]["all_reduce"] == 3      # the mismatched call took the in-place path too
        if rank == 0:
            assert out["a_intact"]
        else:
            assert out["live_after_del"] == 0


# ---------------------------------------------------------------- many allocations, destroy, re-init

def _outcomes(*calls) -> list:
    """Each call's error as "Type: message", or None."""
    said = []
    for call in calls:
        try:
            call()
            said.append(None)
        except dist.DistError as e:
            said.append(f"{type(e).__name__}: {e}")
    return said


def churn_and_reinit(rank, world_size, init_method, folder):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=30)
    gc.collect()
    maps0, fds0 = _memfd_maps(), _memfd_fds()
    out = {}
    kept = []
    for i in range(150):
        x = dist.empty(((1 << 16) + 1 + 37 * i,), np.float64 if i % 3 else np.float32)
        x[:] = rank + i
        dist.all_reduce(x, dist.ReduceOp.MAX)
        if x[-1] != world_size - 1 + i:
            out.setdefault("bad", []).append(i)
        if i % 50 == 0:
            kept.append(x[i:])                   # a view keeps the memory
        del x
    gc.collect()
    out["live_kept"] = len(shared.live)
    del kept
    gc.collect()
    out["after_churn"] = (dist.memory_usage()["empty_arrays"], len(shared.live),
                          _memfd_maps() - maps0, _memfd_fds() - fds0)
    big = dist.empty(BIG, np.float32)
    view = big.reshape(-1)[1:]
    big[:] = rank + 1
    dist.destroy_process_group()
    out["readable"] = float(view[-1])
    out["before_reinit"] = _outcomes(lambda: dist.all_reduce(big), lambda: dist.broadcast(view, 0))
    dist.init_process_group("shm", f"file://{folder}/again", rank=rank, world_size=world_size, timeout=30)
    out["after_reinit"] = _outcomes(lambda: dist.all_reduce(big), lambda: dist.broadcast(view, 0),
                                    lambda: dist.all_reduce(view, async_op=True))
    fresh = dist.empty(BIG, np.float32)           # the new world's first allocation
    fresh[:] = rank + 1
    req = dist.all_reduce(fresh, async_op=True)
    req.wait()
    out["fresh"] = float(fresh[0])
    out["small_old"] = None
    small = big[:100]                             # 400 bytes: ordinary memory, works anywhere
    dist.all_reduce(small)
    out["small_old"] = float(small[0])
    del fresh, big, view, small, req            # (the request holds its tensor)
    gc.collect()
    out["usage_end"] = dist.memory_usage()["empty_arrays"]
    dist.destroy_process_group()
    gc.collect()
    out["end"] = len(shared.live), _memfd_maps() - maps0
    return out


def test_many_allocations_destroy_and_reinit(run_ranks, tmp_path, no_new_dev_shm):
    """Attacks memory return and use after destroy: 150 allocations of changing sizes and dtypes
    (some kept by a view for a while) must all be unmapped; arrays and views kept past
    destroy_process_group stay readable, and all_reduce/broadcast (sync or async) on them raise a
    DistError naming the destroyed group, before and after re-init, without crashing; the new
    world allocates and reduces; nothing is mapped at the end."""
    for rank, out in enumerate(run_ranks(churn_and_reinit, 2, str(tmp_path), timeout=120)):
        assert "bad" not in out
        assert out["live_kept"] == 3
        assert out["after_churn"] == (0, 0, 0, 0)
        assert out["readable"] == rank + 1
        for text in out["before_reinit"]:
            assert text is not None and "DistNotInitializedError" in text
        for text in out["after_reinit"]:
            assert text is not None and "was destroyed" in text and "shmdist.empty" in text, text
        assert out["fresh"] == 3.0 and out["small_old"] == 3.0
        assert out["usage_end"] == 0
        assert out["end"][0] == 0 and out["end"][1] <= 0     # (the world's arenas went too)


# ---------------------------------------------------------------- a rank killed

def killed_mid_all_reduce(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=20)
    a = dist.empty(BIG, np.float32)
    a[:] = 1
    if rank == 1:          # dies inside the in-place all_reduce, after its first phase
        shared._reduce_part = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(a)
    except dist.DistError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _empty_and_what_is_left(fds0: list) -> tuple:
    """Call empty(); (its error as text or None, the sizes of the memfd descriptors
    this process holds now that it did not hold before, ``fds0``)."""
    try:
        dist.empty(BIG, np.float32)
        text = None
    except dist.DistError as e:
        text = f"{type(e).__name__}: {e}"
    gc.collect()
    left = sorted(_memfd_fd_sizes())
    for size in fds0:
        left.remove(size)
    return text, left


def killed_mid_empty(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=20)
    gc.collect()
    fds0, maps0 = _memfd_fd_sizes(), _memfd_maps()
    if rank == 1:          # dies after rank 0 made the segment, before mapping it
        shared._get = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
    text, left = _empty_and_what_is_left(fds0)
    return text, left, _memfd_maps() - maps0


def test_a_rank_killed_inside_the_in_place_all_reduce(run_ranks, no_new_dev_shm):
    """Attacks the in-place phases: rank 1 is SIGKILLed between the first phase and the second;
    rank 0 must raise a DistPeerError naming rank 1 (no hang), nothing left in /dev/shm."""
    out = run_ranks(killed_mid_all_reduce, 2, timeout=60, errors="return")
    assert out[1].exitcode == -signal.SIGKILL
    assert out[0] is not None and out[0].startswith("DistPeerError") and "rank 1" in out[0], out[0]


def test_a_rank_killed_while_empty_sets_up_leaves_nothing_behind(run_ranks, no_new_dev_shm):
    """Attacks allocate()'s error path: rank 1 dies after rank 0 created the segment and announced
    it; rank 0 must raise naming rank 1, and must not keep the segment (its descriptor or
    mapping) - a memfd descriptor left open keeps the whole segment allocated until exit."""
    out = run_ranks(killed_mid_empty, 2, timeout=60, errors="return")
    assert out[1].exitcode == -signal.SIGKILL
    text, fds, maps = out[0]
    assert text is not None and text.startswith("DistPeerError") and "rank 1" in text, text
    assert maps <= 0
    assert fds == [], f"rank 0 still holds memfd descriptor(s) of {fds} bytes: the segment allocate() made"


def stalled_mid_empty(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=1)
    gc.collect()
    fds0 = _memfd_fd_sizes()
    if rank == 1:          # stalls past the timeout after rank 0 made the segment, before mapping it
        orig = shared._get

        def slow(*args):
            import time
            time.sleep(2)
            return orig(*args)
        shared._get = slow
    return _empty_and_what_is_left(fds0)


def test_a_rank_stalled_while_empty_sets_up_leaves_nothing_behind(run_ranks, no_new_dev_shm):
    """Attacks allocate()'s error path through a timeout instead of a death: rank 0 times out
    waiting for rank 1 after it made the segment; it must raise DistTimeoutError and keep no
    descriptor of the segment (the same leak as a killed peer)."""
    out = run_ranks(stalled_mid_empty, 2, timeout=60)
    text, fds = out[0]
    assert text is not None and text.startswith("DistTimeoutError"), text
    assert out[1][0] is not None          # rank 1 finds the group broken (or timed out) too
    assert fds == [], f"rank 0 still holds memfd descriptor(s) of {fds} bytes: the segment allocate() made"



def stalled_inside_or_absent(rank, world_size, init_method, stalled):
    """``stalled``: rank 1 calls empty() and stalls inside it (after rank 0 made the segment,
    before it maps it); else it calls empty() only after rank 0 gave up. Rank 0's error."""
    import time
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=1.5)
    if rank == 1 and stalled:
        orig = shared._get

        def slow(*args):
            time.sleep(3)
            return orig(*args)
        shared._get = slow
    elif rank == 1:
        time.sleep(3)
    try:
        dist.empty(BIG, np.float32)
        return None
    except dist.DistError as e:
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("stalled", [True, False], ids=["stalled inside", "not called"])
def test_a_timeout_in_empty_says_whether_the_late_rank_called_it(run_ranks, no_new_dev_shm, stalled):
    """A member stalled inside a call is not one that has not called it: the waiting rank's
    message says which (it said "have not called it" of a member stalled inside), and its
    flight recorder shows it inside empty() (it said "not inside any shmdist call": the entry,
    marked done when the first phase passed, was not marked waiting in the later ones)."""
    text = run_ranks(stalled_inside_or_absent, 2, stalled, timeout=60)[0]
    assert text is not None and text.startswith("DistTimeoutError"), text
    first = text.splitlines()[0]
    assert "waiting for rank(s) 1 of group [0, 1]" in first, first
    said = "rank 1 called it and has not finished its part" if stalled else "rank 1 has not called it"
    assert said in first, first
    assert "rank 0: in empty #1 of WORLD" in text, text

"""The fast lane (``_core.Lane``): small sends and receives of numpy arrays
between local ranks in one C call. It must behave exactly as the general
path: receives match in the order they were posted, however they were
posted; a wrong size, a timeout or a dead peer ends the same way; anything
the lane cannot take (torch, non-contiguous, groups, any-source) still works.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import shmdist as dist
from shmdist.api import fast
from shmdist.errors import DistMismatchError, DistTimeoutError


pytestmark = pytest.mark.skipif(os.environ.get("SHMDIST_TRANSPORT", "").lower() == "tcp",
                                reason="the fast lane and the C reductions are shared-memory paths")


def _init(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)


def _lane_counts():
    lane = fast.paths.lane
    return lane.sends, lane.recvs


def _teach(rank, dtype=np.int64):
    """One exchange through the general path, after which the lane knows the dtype."""
    box = np.zeros(1, dtype=dtype)
    if rank == 0:
        dist.send(box, 1).wait()
        dist.recv(box, 1).wait()
    else:
        dist.recv(box, 0).wait()
        dist.send(box, 0).wait()


def pending_then_general(rank, world_size, init_method):
    """A pending fast receive, then an any-source and a fast one behind it:
    three messages fill them in posting order."""
    _init(rank, world_size, init_method)
    _teach(rank)
    go = np.zeros(1, dtype=np.int64)
    if rank == 0:
        dist.recv(go, 1).wait()
        for v in (1, 2, 3):
            dist.send(np.array([v]), 1).wait()
        result = _lane_counts()[0] >= 3
    else:
        a, b, c = (np.zeros(1, dtype=np.int64) for _ in range(3))
        ra = dist.irecv(a, 0)
        rb = dist.irecv(b)          # any source: the general path; the pending one goes first
        rc = dist.irecv(c, 0)
        dist.send(go, 0).wait()
        for r in (rc, rb, ra):      # waiting out of order changes nothing
            r.wait()
        result = ([int(a[0]), int(b[0]), int(c[0])], rb.source, _lane_counts()[1] >= 1)   # a went the fast way
    dist.destroy_process_group()
    return result


def test_receives_match_in_posting_order_across_lanes(run_ranks):
    assert run_ranks(pending_then_general, 2) == [True, ([1, 2, 3], 0, True)]


def wrong_size_while_pending(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    _teach(rank)
    if rank == 0:
        dist.send(np.arange(2, dtype=np.int64), 1).wait()
        result = None
    else:
        small = np.zeros(1, dtype=np.int64)
        req = dist.irecv(small, 0)
        try:
            req.wait()
            result = "no error"
        except DistMismatchError as e:
            right = np.zeros(2, dtype=np.int64)
            dist.recv(right, 0).wait()        # the message was kept for the next receive
            result = ("expected 8 bytes" in str(e) and "got 16 bytes" in str(e), right.tolist(),
                      int(small[0]))
    dist.destroy_process_group()
    return result


def test_wrong_size_fails_that_receive_and_keeps_the_message(run_ranks):
    assert run_ranks(wrong_size_while_pending, 2) == [None, (True, [0, 1], 0)]


def timeout_while_pending(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    _teach(rank)
    go = np.zeros(1, dtype=np.int64)
    if rank == 0:
        dist.recv(go, 1).wait()
        dist.send(np.array([42]), 1).wait()
        result = None
    else:
        first = np.zeros(1, dtype=np.int64)
        try:
            dist.recv(first, 0).wait(timeout=0.3)
            timed_out = False
        except DistTimeoutError as e:
            timed_out = "cancelled" in str(e)
        dist.send(go, 0).wait()
        second = np.zeros(1, dtype=np.int64)
        dist.recv(second, 0).wait()
        result = (timed_out, int(first[0]), int(second[0]))
    dist.destroy_process_group()
    return result


def test_a_timed_out_pending_receive_is_withdrawn(run_ranks):
    assert run_ranks(timeout_while_pending, 2) == [None, (True, 0, 42)]


def _cases():
    """(array to send, its receive buffer) for shapes the lane takes and ones it leaves."""
    rng = np.random.default_rng(5)
    big = rng.integers(0, 255, 100_000, dtype=np.uint8)
    return [
        (np.array(7, dtype=np.int32), np.zeros((), dtype=np.int32)),                 # 0-d
        (np.zeros(0, dtype=np.float64), np.zeros(0, dtype=np.float64)),               # empty
        (np.arange(12, dtype=np.float32).reshape(3, 4), np.zeros((3, 4), np.float32)),
        (np.arange(512, dtype=np.int16).reshape((2,) * 9), np.zeros((2,) * 9, np.int16)),  # 9 dims
        (np.arange(20, dtype=np.int64)[::2], np.zeros(10, dtype=np.int64)),           # strided send
        (np.arange(10, dtype=np.int64), np.zeros(20, dtype=np.int64)[::2]),           # strided receive
        (big, np.zeros_like(big)),                                                    # > one slice
        (np.array([True, False]), np.zeros(2, dtype=bool)),
    ]


def every_shape(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    bad = []
    for rounds in range(3):       # the first round teaches the lane the dtypes
        for i, (data, box) in enumerate(_cases()):
            if rank == 0:
                dist.send(data, 1).wait()
                dist.recv(box, 1).wait()
            else:
                dist.recv(box, 0).wait()
                dist.send(box, 0).wait()
            if not np.array_equal(box, data):
                bad.append((rounds, i))
    counts = _lane_counts()
    dist.destroy_process_group()
    return bad, counts[0] > 0 and counts[1] > 0


def test_every_shape_and_layout_arrives_intact(run_ranks):
    assert run_ranks(every_shape, 2) == [([], True), ([], True)]


def threads_share_the_lane(rank, world_size, init_method, count):
    """Two threads per rank, each its own tag: the lane's lock keeps the ring whole."""
    _init(rank, world_size, init_method)
    _teach(rank)
    bad = []

    def run(tag):
        for i in range(count):
            if rank == 0:
                dist.send(np.full(16 + tag, i, dtype=np.int64), 1, tag=tag).wait()
            else:
                box = np.zeros(16 + tag, dtype=np.int64)
                dist.recv(box, 0, tag=tag).wait()
                if not (box == i).all():
                    bad.append((tag, i))

    threads = [threading.Thread(target=run, args=(tag,)) for tag in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dist.destroy_process_group()
    return bad


def test_two_threads_per_rank_send_and_receive_through_the_lane(run_ranks):
    assert run_ranks(threads_share_the_lane, 2, 2000, timeout=90) == [[], []]


def errors_still_named(rank, world_size, init_method):
    """Bad arguments are refused by the general path's checks, with its words."""
    _init(rank, world_size, init_method)
    _teach(rank)
    box = np.zeros(1, dtype=np.int64)
    said = []
    for call in (lambda: dist.send(box, rank), lambda: dist.send(box, 5), lambda: dist.send(box, 1.0),
                 lambda: dist.recv(box, rank), lambda: dist.send(box, 1 - rank, tag=2 ** 70)):
        try:
            call()
            said.append("accepted")
        except (dist.DistError, TypeError) as e:
            said.append(type(e).__name__)
    readonly = np.zeros(1, dtype=np.int64)
    readonly.setflags(write=False)
    try:
        dist.recv(readonly, 1 - rank)
        said.append("accepted")
    except dist.DistError as e:
        said.append("read-only" in str(e))
    dist.destroy_process_group()
    return said


def test_bad_arguments_get_the_general_paths_errors(run_ranks):
    said = run_ranks(errors_still_named, 2)
    for per_rank in said:
        assert per_rank == ["DistError", "DistError", "TypeError", "DistError", "DistError", True]


# ---------------------------------------------------------------- small all_reduce reduced in C

def _contribution(rank: int, dtype: str, count: int) -> np.ndarray:
    rng = np.random.default_rng([rank, count, 7])
    if dtype.startswith("int"):
        info = np.iinfo(dtype)       # near the top: SUM must wrap as numpy's does
        return rng.integers(info.max - 1000, info.max, count, dtype=dtype)
    return rng.standard_normal(count).astype(dtype)


def quick_all_reduce_cases(rank, world_size, init_method, use_torch):
    from shmdist.comm import arena
    real, took = arena.GroupComm.quick_all_reduce, [0]

    def counting(self, *args):
        done = real(self, *args)
        took[0] += done
        return done
    arena.GroupComm.quick_all_reduce = counting
    _init(rank, world_size, init_method)
    bad = []
    for dtype in ("float32", "float64", "int32", "int64"):
        for op in ("SUM", "PRODUCT", "MIN", "MAX"):
            for count in (1, 7, 1024):
                mine = _contribution(rank, dtype, count)
                if use_torch and rank == 1:      # the other rank passes a torch tensor
                    import torch
                    t = torch.from_numpy(mine.copy())
                    dist.all_reduce(t, getattr(dist.ReduceOp, op))
                    got = t.numpy()
                elif rank == 1:
                    wide = np.zeros(2 * count, dtype=dtype)
                    got = wide[::2]                # strided: the general way too
                    got[:] = mine
                    dist.all_reduce(got, getattr(dist.ReduceOp, op))
                else:
                    got = mine.copy()
                    dist.all_reduce(got, getattr(dist.ReduceOp, op))
                rows = np.stack([_contribution(r, dtype, count) for r in range(world_size)])
                with np.errstate(over="ignore"):
                    want = getattr(np, {"SUM": "add", "PRODUCT": "multiply", "MIN": "minimum",
                                        "MAX": "maximum"}[op]).reduce(rows, axis=0, dtype=rows.dtype)
                if got.tobytes() != want.tobytes():     # the same bits, in rank order
                    bad.append((dtype, op, count))
    if (rank == 0 or use_torch) and not took[0]:     # torch tensors too, with nothing sent before
        bad.append(f"rank {rank} never took the C reduction")
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("other", ["strided", "torch"])
def test_small_all_reduce_in_c_gives_numpys_bits_whatever_the_other_rank_uses(run_ranks, other):
    if other == "torch":
        pytest.importorskip("torch")
    assert run_ranks(quick_all_reduce_cases, 2, other == "torch", timeout=90) == [[], []]


def quick_edge_cases(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    out = {}
    nan = np.array([1.0, np.nan if rank == 0 else 2.0], dtype=np.float32)
    dist.all_reduce(nan, dist.ReduceOp.MAX)             # float MAX keeps numpy's NaN rule
    out["nan"] = bool(np.isnan(nan[1])) and nan[0] == 1.0
    try:
        dist.all_reduce(np.ones(4, dtype=np.float32 if rank == 0 else np.float64))
        out["mismatch"] = "no error"
    except dist.DistMismatchError as e:
        out["mismatch"] = "float32" in str(e) and "float64" in str(e)
    again = np.full(3, rank + 1, dtype=np.int64)
    dist.all_reduce(again)                              # the group still works
    out["after"] = again.tolist()
    scalar = np.array(rank + 1.5, dtype=np.float64)
    dist.all_reduce(scalar)
    out["0-d"] = float(scalar)
    empty = np.zeros(0, dtype=np.int32)
    dist.all_reduce(empty)
    out["empty"] = empty.size
    readonly = np.ones(2, dtype=np.float32)
    readonly.setflags(write=False)
    try:
        dist.all_reduce(readonly)
        out["readonly"] = "accepted"
    except dist.DistError as e:
        out["readonly"] = "read-only" in str(e)
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_small_all_reduce_edges_behave_as_the_general_path(run_ranks):
    want = {"nan": True, "mismatch": True, "after": [3, 3, 3], "0-d": 4.0, "empty": 0, "readonly": True}
    assert run_ranks(quick_edge_cases, 2) == [want, want]


_NUMPY_OP = {"SUM": "add", "PRODUCT": "multiply", "MIN": "minimum", "MAX": "maximum"}


def _want(dtype, op, count, world_size):
    rows = np.stack([_contribution(r, dtype, count) for r in range(world_size)])
    with np.errstate(over="ignore"):
        return getattr(np, _NUMPY_OP[op]).reduce(rows, axis=0, dtype=rows.dtype)


def large_all_reduce_cases(rank, world_size, init_method, small_rounds):
    """Large all_reduce and reduce, rounds in C, against numpy's bits. In
    every other case one rank runs its rounds in Python: the two must split
    the vector alike to give the same result."""
    from shmdist.comm import arena
    if small_rounds:                  # many rounds, the last one short, on tiny buffers
        os.environ["SHMDIST_ARENA_BYTES"] = "16384"
        os.environ["SHMDIST_ROUND_BYTES"] = "8192"
    else:
        os.environ["SHMDIST_ROUND_BYTES"] = str(1 << 30)   # this rank's value: the creator's wins
    if rank == 0:
        os.environ.pop("SHMDIST_ROUND_BYTES", None)
    calls = [0]
    real = arena.GroupComm._all_reduce_rounds

    def counting(self, *args):
        calls[0] += 1
        return real(self, *args)
    arena.GroupComm._all_reduce_rounds = counting
    _init(rank, world_size, init_method)
    bad, case = [], 0
    counts = (30011, 70001) if small_rounds else ((3 << 20) // 8 + 13,)
    for dtype in ("float32", "float64", "int32", "int64"):
        for op in ("SUM", "PRODUCT", "MIN", "MAX"):
            for count in counts:
                for root in (-1, *range(world_size)):
                    case += 1
                    fast.paths.c_rounds = case % world_size != rank
                    got = _contribution(rank, dtype, count)
                    reduce_op = getattr(dist.ReduceOp, op)
                    if root < 0:
                        dist.all_reduce(got, reduce_op)
                    else:
                        dist.reduce(got, root, reduce_op)
                    if root in (-1, rank) and got.tobytes() != _want(dtype, op, count, world_size).tobytes():
                        bad.append((dtype, op, count, root))
    fast.paths.c_rounds = True
    if calls[0] == 0:
        bad.append("the C rounds never ran")
    try:
        dist.all_reduce(np.ones(70001 + (rank == 0), dtype=np.float32))
        bad.append("no mismatch error")
    except DistMismatchError as e:
        if "280004 bytes" not in str(e) or "280008 bytes" not in str(e):
            bad.append(str(e))
    again = np.ones(70001, dtype=np.int64)
    dist.all_reduce(again)                            # the group still works
    if (again != world_size).any():
        bad.append("group unusable after the mismatch")
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("world_size, small_rounds", [(2, False), (3, True)])
def test_large_all_reduce_in_c_gives_numpys_bits_and_splits_as_python_does(run_ranks, world_size,
                                                                           small_rounds):
    assert run_ranks(large_all_reduce_cases, world_size, small_rounds, timeout=120) == [[]] * world_size


def torch_tensors_take_the_lane(rank, world_size, init_method):
    """Plain CPU torch tensors go through the lane as numpy views of their
    memory; tensors with autograd or a conjugate bit go the general way."""
    import torch
    _init(rank, world_size, init_method)
    names = ("float32", "int64", "bool", "complex64", "float16", "uint8")
    wrong = []
    before = None
    for rep in range(2):          # the first pass teaches the lane each dtype, the second uses it
        if rep == 1:
            before = _lane_counts()
        for name in names:
            want = torch.from_numpy(np.arange(6).reshape(2, 3).astype(name))
            if rank == 0:
                dist.send(want, 1).wait()
            else:
                box = torch.zeros(2, 3, dtype=want.dtype)
                dist.recv(box, 0).wait()
                if not torch.equal(box, want):
                    wrong.append((rep, name))
    moved = [after - b for after, b in zip(_lane_counts(), before)]
    if moved[rank] < len(names):       # rank 0 counts sends, rank 1 receives
        wrong.append(f"the lane took {moved} of {len(names)} operations")
    go = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        dist.recv(go, 1).wait()
        dist.send(torch.full((4,), 7.0), 1).wait()
        dist.send(torch.ones(3, requires_grad=True), 1).wait()
    else:
        box = torch.zeros(4)
        req = dist.irecv(box, 0)                  # pending: nothing sent yet
        if fast.paths.lane.pending is not req:
            wrong.append("the torch receive did not wait in the lane")
        dist.send(go, 0).wait()
        req.wait()
        if req.result()[0] is not box or box.tolist() != [7.0] * 4:
            wrong.append(("pending", box.tolist()))
        grad = torch.zeros(3, requires_grad=True)
        dist.recv(grad, 0).wait()
        if grad.tolist() != [1.0] * 3:
            wrong.append(("requires_grad", grad.tolist()))
    dist.destroy_process_group()
    return wrong


def test_plain_torch_tensors_take_the_fast_lane(run_ranks):
    pytest.importorskip("torch")
    assert run_ranks(torch_tensors_take_the_lane, 2) == [[], []]


def one_member_cases(rank, world_size, init_method):
    """Large all_reduce and reduce where the group has one member: the world
    of one rank, or new_group([r]) in a bigger job. The result is the input."""
    _init(rank, world_size, init_method)
    alone = [dist.new_group([r]) for r in range(world_size)][rank] if world_size > 1 else None
    bad = []
    for dtype in ("float32", "float64", "int32", "int64"):
        for count in (7, (64 << 10) // np.dtype(dtype).itemsize + 1, 200001):
            for call in ("all_reduce", "reduce"):
                got = _contribution(rank, dtype, count)
                if call == "all_reduce":
                    dist.all_reduce(got, dist.ReduceOp.SUM, group=alone)
                else:
                    dist.reduce(got, rank, dist.ReduceOp.SUM, group=alone)
                if got.tobytes() != _contribution(rank, dtype, count).tobytes():
                    bad.append((dtype, count, call))
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("world_size", [1, 2])
def test_large_all_reduce_of_one_member_is_its_input(run_ranks, world_size):
    assert run_ranks(one_member_cases, world_size) == [[]] * world_size

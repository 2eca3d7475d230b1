"""Attacks on the default group's medium path for big all_reduce and broadcast
(shmdist/api/collectives.py: _medium_buf, _learn, _MEDIUM_NAMES; commit fb05087).

The promise: once the general path took a dtype (and op), later big calls of
it skip the general path's checks and go to the core with the descriptor the
general path would have made, with exactly the same bytes and the same
errors; whatever only the general path may take still goes there.

Most tests here are differential: the same sequence of calls runs once with
the fast paths on (the medium path taken wherever it applies) and once with
SHMDIST_FAST=0 (every call on the general path), and every call's outcome
(the result's bytes, or the error's type and message) must be the same; the
results are also checked bit-exactly against a reference reduced locally, in
rank order, from every rank's known input.

Written by a helper told to break the promise; it found a big-endian array
broadcast by its root taught as native float32 (wrong bytes, then ranks out
of step), and beside the medium path a bfloat16 mismatch named uint16, a
torch tensor's storage pinned by the general path, and structured dtypes
reduced until numpy failed inside the engine: each fixed, its test kept.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

import shmdist as dist

from test_medium_path import counting_general_calls

KB = 1 << 10
PAIR_SMALL = 512 * KB           # 2-rank quick all_reduce: up to this
ROUND = 1 << 20                 # a round of the arena (quick broadcast: up to this)
BIG = ROUND + 4096
TIMEOUT = 60
FAST_OFF = {"SHMDIST_FAST": "0"}


# ------------------------------------------------------------------ inputs and references

def data(dtype: str, count: int, rank: int, step: int) -> np.ndarray:
    """Deterministic input of a rank for one step: values whose float sums round
    differently in another order, small integers, random bools, complex."""
    rng = np.random.default_rng(1000 * step + rank)
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return (rng.standard_normal(count) * 10.0 ** rng.integers(-3, 4, count)).astype(dt)
    if dt.kind == "c":
        return (rng.standard_normal(count) + 1j * rng.standard_normal(count)).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, count).astype(bool)
    info = np.iinfo(dt)
    return rng.integers(max(info.min, -5), min(info.max, 6), count, endpoint=True).astype(dt)


def reference(dtype: str, count: int, world_size: int, step: int, op: str) -> np.ndarray:
    """The reduction of every rank's input, in rank order, in the dtype itself."""
    xs = [data(dtype, count, r, step) for r in range(world_size)]
    acc = xs[0].copy()
    for x in xs[1:]:
        if op == "SUM":
            acc = (acc | x) if acc.dtype == bool else (acc + x).astype(acc.dtype)
        elif op == "PRODUCT":
            acc = (acc & x) if acc.dtype == bool else (acc * x).astype(acc.dtype)
        elif op == "MAX":
            acc = np.maximum(acc, x)
        elif op == "MIN":
            acc = np.minimum(acc, x)
        elif op == "BAND":
            acc = acc & x
        elif op == "BOR":
            acc = acc | x
        elif op == "BXOR":
            acc = acc ^ x
        else:
            raise AssertionError(op)
    return acc


def digest(a) -> str:
    a = np.ascontiguousarray(a)
    return f"{a.dtype.str}{a.shape}:" + hashlib.sha1(a.tobytes()).hexdigest()[:16]


def outcome(fn):
    """('ok', value) or (error type, message) of one call."""
    try:
        return ("ok", fn())
    except dist.DistError as e:
        return (type(e).__name__, str(e))


def _plan() -> list:
    plan = []
    for dtype in ("float32", "float64", "int32", "int64", "uint8", "bool", "complex64", "float16"):
        isz = np.dtype(dtype).itemsize
        for nbytes in (PAIR_SMALL + 4 * isz, BIG + 3 * isz):
            count = nbytes // isz
            for op in ("SUM", "MAX", "PRODUCT", "AVG", "BAND", "SUM"):
                plan.append(("all_reduce", dtype, count, op))
            plan.append(("broadcast", dtype, count, 0))
            plan.append(("broadcast", dtype, count, 1))
    return plan


PLAN = _plan()


def sweep(rank, world_size, init_method, plan, torch_ranks):
    """Every call of ``plan``; each outcome: the result's digest, or the error."""
    seen = counting_general_calls()
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=TIMEOUT)
    as_torch = rank in torch_ranks
    if as_torch:
        import torch
    out = []
    for step, (call, dtype, count, arg) in enumerate(plan):
        x = data(dtype, count, rank, step)
        t = torch.from_numpy(x) if as_torch else x
        if call == "all_reduce":
            res = outcome(lambda: dist.all_reduce(t, op=getattr(dist.ReduceOp, arg)))
        else:
            if rank != arg:
                x[:] = 0
            res = outcome(lambda: dist.broadcast(t, arg))
        out.append(("ok", digest(x)) if res[0] == "ok" else res)
    dist.destroy_process_group()
    return out, seen


def expected(plan, world_size) -> list:
    """What sweep must return where the call succeeds (None: no local reference: AVG, float16)."""
    want = []
    for step, (call, dtype, count, arg) in enumerate(plan):
        if call == "broadcast":
            want.append(("ok", digest(data(dtype, count, arg, step))))
        elif arg == "AVG" or dtype == "float16" or (np.dtype(dtype).kind == "c" and arg != "SUM"):
            want.append(None)
        else:
            try:
                with np.errstate(all="ignore"):
                    want.append(("ok", digest(reference(dtype, count, world_size, step, arg))))
            except TypeError:       # an op numpy refuses for the dtype (BAND of floats...)
                want.append(None)
    return want


def test_sweep_of_dtypes_ops_sizes_is_the_general_paths_bit_for_bit(run_ranks):
    """Alternates dtypes, ops and sizes (around both one-call limits) between calls,
    so the learned names and checked ops must be right for each, and compares every
    call with the general path alone (SHMDIST_FAST=0) and with a reference reduced
    in rank order: the same bytes, and the same errors (the ops a dtype refuses,
    every time), on every rank. Rank 0 passes numpy arrays, rank 1 torch tensors."""
    pytest.importorskip("torch")
    fast = run_ranks(sweep, 2, PLAN, (1,), timeout=TIMEOUT)
    general = run_ranks(sweep, 2, PLAN, (1,), timeout=TIMEOUT, env=FAST_OFF)
    want = expected(PLAN, 2)
    for rank in range(2):
        for i, (f, g, w) in enumerate(zip(fast[rank][0], general[rank][0], want)):
            assert f == g, (rank, i, PLAN[i])
            if w is not None and f[0] == "ok":
                assert f == w, (rank, i, PLAN[i])
        calls = sum(1 for p in PLAN if p[0] == "all_reduce")
        print(rank, fast[rank][1], general[rank][1], calls, len(PLAN) - calls)
        assert fast[rank][1]["all_reduce"] <= calls - 40     # the medium path was taken, often
    oks = [sum(r[0] == "ok" for r in fast[rank][0]) for rank in range(2)]
    assert oks[0] == oks[1] and 0 < oks[0] < len(PLAN)      # some refused, on both ranks


# ------------------------------------------------------------------ another byte order

def other_byte_order(rank, world_size, init_method, case):
    """A broadcast root's big-endian array (which the general path sends as a
    native copy, with no copy back: the root only reads) and later calls."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=10)
    count = BIG // 4
    want = (np.arange(count) % 97 + 1).astype(np.float32)
    out = []
    a = want.astype(">f4") if rank == 0 else np.zeros(count, np.float32)
    dist.broadcast(a, 0)                                    # the general path
    out.append(bool(np.array_equal(a, want)))
    if case == "broadcast":
        a = want.astype(">f4") if rank == 0 else np.zeros(count, np.float32)
        dist.broadcast(a, 0)                                # the same call again
        out.append(bool(np.array_equal(a, want)))
        b = np.zeros(count, ">f4") if rank == 0 else want.copy()
        dist.broadcast(b, 1)                                # rank 0 receives into its big-endian array
        out.append(bool(np.array_equal(b, want)))
    else:
        dist.all_reduce(np.ones(count, np.float32))         # SUM of float32 checked
        a = np.full(count, rank + 1, ">f4")                 # both ranks big-endian
        out.append(outcome(lambda: dist.all_reduce(a)))
        out.append(bool((a == 3).all()))
        ok = np.ones(count, np.float32)
        out.append(outcome(lambda: dist.all_reduce(ok)))    # the group goes on
        out.append(bool((ok == 2).all()))
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("env", [FAST_OFF, {}], ids=["general", "medium"])
def test_big_endian_broadcast_root_does_not_teach_its_byte_order_as_native(run_ranks, env):
    """A big-endian ('>f4') array broadcast by its root goes the general path, which
    sends a native copy (no finish: the root only reads), and _learn then files
    '>f4' under "float32"; the same root's next big broadcast of '>f4' must not send
    the array's raw (byte-swapped) bytes as float32, nor must a big-endian receive
    get native bytes. It failed with the medium path before _learn took only a
    native view's own memory."""
    res = run_ranks(other_byte_order, 2, "broadcast", timeout=TIMEOUT, env=env)
    assert res == [[True, True, True], [True, True, True]]


@pytest.mark.parametrize("env", [FAST_OFF, {}], ids=["general", "medium"])
def test_big_endian_all_reduce_after_a_root_learned_it_is_exact_and_in_step(run_ranks, env):
    """After rank 0 broadcast a big-endian array as root (learning '>f4' as
    "float32"), an all_reduce of big-endian arrays on both ranks: rank 0 must not
    reduce the raw bytes (and, with a plan of its own for '>f4', run another
    algorithm than rank 1: the ranks fell out of step, rank 1 returned a wrong
    sum and rank 0 waited for a peer that had moved on). It failed with the
    medium path before _learn took only a native view's own memory."""
    res = run_ranks(other_byte_order, 2, "all_reduce", timeout=TIMEOUT, env=env, errors="return")
    for rank, said in enumerate(res):
        assert said == [True, ("ok", None), True, ("ok", None), True], (rank, said)


# ------------------------------------------------------------------ torch tensors changed between calls

def torch_tricks(rank, world_size, init_method):
    """Torch tensors whose memory, dtype, shape or autograd state change between
    big calls; every outcome is recorded: (label, digest of what the call left in
    the tensor and around it) or the error."""
    import torch
    seen = counting_general_calls()
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=TIMEOUT)
    count = BIG // 4
    out = []
    step = iter(range(10 ** 6))

    def call(label, t, kind="all_reduce", arg="SUM", around=None):
        s = next(step)
        if kind == "all_reduce":
            res = outcome(lambda: dist.all_reduce(t, op=getattr(dist.ReduceOp, arg)))
        else:
            res = outcome(lambda: dist.broadcast(t, arg))
        if res[0] != "ok":
            out.append((label, s) + res)
            return
        whole = t if around is None else around
        flat = whole.detach().reshape(-1).clone()     # (.numpy() of its own memory would pin its size)
        if flat.dtype == torch.bfloat16:
            flat = flat.view(torch.int16)
        out.append((label, s, "ok", digest(flat.numpy()), tuple(t.shape), str(t.dtype),
                    t.grad_fn is None, t.requires_grad))

    def fill(t, s=None):
        """Deterministic values by rank and step, in t's dtype."""
        s = next(step) if s is None else s
        src = torch.from_numpy(data("float64", t.numel(), rank, s)).reshape(t.shape)
        with torch.no_grad():
            t.copy_(src.to(t.dtype))
        return t

    for dt in (torch.float32, torch.int32, torch.float64, torch.int64):     # names and SUM learned
        call("learn", fill(torch.empty(count, dtype=dt)))

    # the same memory as another dtype, shape, offset
    t = fill(torch.empty(count))
    call("f32", t)
    call("same memory as int32", t.view(torch.int32))
    call("same memory as int64, half the elements", t.view(torch.int64))
    call("same memory as float32 2-d", t.view(4, -1))
    call("same memory, shorter", t[: count - 1024])
    big = fill(torch.empty(count + 4096))
    call("offset view inside a bigger tensor", big[1024: 1024 + count], around=big)
    call("overlapping offset view, next call", big[2048: 2048 + count], around=big)
    call("same tensor again", big[2048: 2048 + count], around=big)
    call("same view, broadcast from 1", big[2048: 2048 + count], "broadcast", 1, around=big)

    # freed and allocated again: likely the same address, another dtype or size
    for dt, n in ((torch.float32, count), (torch.int32, count), (torch.float64, count // 2),
                  (torch.float32, count // 2 + 8), (torch.float32, count)):
        x = fill(torch.empty(n, dtype=dt))
        call(f"fresh {dt} {n}", x)
        del x

    # changed in place
    t = fill(torch.empty(count))
    call("before resize", t)
    t.resize_(count // 2)            # (growing past its storage: test_resize_after_all_reduce_...)
    fill(t)
    call("resized smaller", t)
    t.resize_(count // 2 + 4096, 1)
    fill(t)
    call("resized bigger within its storage", t)
    other = fill(torch.empty(count + 333))
    t.set_(other)
    call("set_ to another storage", t, around=other)
    t = fill(torch.empty(count))
    call("before .data", t)
    t.data = fill(torch.empty(count, dtype=torch.int32))
    call(".data = int32", t)
    t.data = fill(torch.empty(count // 2 + 16))
    call(".data = shorter float32", t)
    base = torch.zeros(count + 1024)
    t = fill(torch.empty(count))
    call("before set_ with offset", t)
    t.set_(base.untyped_storage(), 512, (count,))
    fill(t)
    call("set_ with a storage offset", t, around=base)

    # autograd toggled
    t = fill(torch.empty(count))
    t.requires_grad_(True)
    call("requires grad", t)
    t.requires_grad_(False)
    fill(t)
    call("grad off again", t)
    t.requires_grad_(True)
    call("requires grad, broadcast", t, "broadcast", 0)
    p = torch.nn.Parameter(fill(torch.empty(count)), requires_grad=False)
    call("Parameter without grad", p)
    call("Parameter without grad, broadcast", p, "broadcast", 1)

    # roots and dtypes alternate
    for i, dt in enumerate((torch.float32, torch.float64, torch.int32, torch.float32, torch.bfloat16,
                            torch.float16, torch.bfloat16)):
        x = fill(torch.empty(count, dtype=dt))
        call(f"broadcast {dt} root {i % 2}", x, "broadcast", i % 2)
        call(f"all_reduce {dt}", fill(x))
        call(f"all_reduce MAX {dt}", fill(x), arg="MAX")
    # async
    x = fill(torch.empty(count))
    req = dist.all_reduce(x, async_op=True)
    req.wait()
    out.append(("async", digest(x.clone().numpy()), req.is_completed()))

    # empty, one element, odd sizes
    for n in (0, 1, 3, PAIR_SMALL // 4 + 1, count + 1):
        call(f"size {n}", fill(torch.empty(n)))
    dist.destroy_process_group()
    return out, seen


def test_torch_tensors_changed_between_calls_behave_as_on_the_general_path(run_ranks):
    """The same memory seen as another dtype, shape or offset; tensors freed and
    allocated again (likely at the same address, so the numpy view cached by
    data_ptr must not serve them); resize_, set_ (with a storage offset) and
    .data = between calls; requires_grad toggled; Parameters; broadcast roots and
    dtypes (bfloat16, float16 too) alternating; async; empty and odd sizes: every
    call's bytes (and the tensor's memory around a view) and errors are the
    general path's, and every rank ends with the same all_reduce result."""
    pytest.importorskip("torch")
    fast = run_ranks(torch_tricks, 2, timeout=TIMEOUT)
    general = run_ranks(torch_tricks, 2, timeout=TIMEOUT, env=FAST_OFF)
    for rank in range(2):
        assert len(fast[rank][0]) == len(general[rank][0])
        for f, g in zip(fast[rank][0], general[rank][0]):
            assert f == g, rank
        print(rank, fast[rank][1], general[rank][1])
        assert fast[rank][1]["all_reduce"] < general[rank][1]["all_reduce"] - 10
    for a, b in zip(fast[0][0], fast[1][0]):
        if a[0] not in ("offset view inside a bigger tensor", "overlapping offset view, next call",
                        "same tensor again", "same view, broadcast from 1", "set_ to another storage",
                        "set_ with a storage offset") and len(a) > 3 and a[2] == "ok":
            assert a[3] == b[3], a[0]


# ------------------------------------------------------------------ ranks that disagree

def disagreements(rank, world_size, init_method):
    """Big calls on which the ranks disagree (after every rank learned the
    dtypes), each followed by a call that must succeed: the outcomes."""
    import torch
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=20)
    count = BIG // 4
    for dt in ("float32", "int32", "float64", "float16"):
        dist.all_reduce(np.ones(count, dt))
        dist.broadcast(np.ones(count, dt), 0)
    dist.all_reduce(torch.ones(count, dtype=torch.bfloat16))
    out = []

    def mine(**per_rank):
        return per_rank[f"r{rank}"]

    f32 = lambda n=count: np.ones(n, np.float32)
    cases = [
        ("float32 torch / float64 numpy", "all_reduce",
         mine(r0=torch.ones(count), r1=np.ones(count, np.float64)), "SUM"),
        ("float32 / int32, same bytes", "all_reduce", mine(r0=f32(), r1=np.ones(count, np.int32)), "SUM"),
        ("one element more", "all_reduce", mine(r0=f32(), r1=f32(count + 1)), "SUM"),
        ("SUM / MAX", "all_reduce", f32(), mine(r0="SUM", r1="MAX")),
        ("bfloat16 / float16", "all_reduce",
         mine(r0=torch.ones(count, dtype=torch.bfloat16), r1=np.ones(count, np.float16)), "SUM"),
        ("float16 torch / float16 numpy", "all_reduce",
         mine(r0=torch.ones(count, dtype=torch.float16), r1=np.ones(count, np.float16)), "SUM"),
        ("requires grad / plain", "all_reduce", mine(r0=torch.ones(count, requires_grad=True), r1=f32()), "SUM"),
        ("strided / plain", "all_reduce", mine(r0=np.ones(2 * count, np.float32)[::2], r1=f32()), "SUM"),
        ("bcast float32 / float64", "broadcast", mine(r0=f32(), r1=np.ones(count, np.float64)), 0),
        ("bcast roots differ", "broadcast", f32(), mine(r0=0, r1=1)),
        ("bcast size differs, root 1", "broadcast", mine(r0=f32(count - 1), r1=f32()), 1),
        ("bcast bfloat16 / int16", "broadcast",     # over a round: the medium path from the first call
         mine(r0=torch.ones(2 * count, dtype=torch.bfloat16), r1=np.ones(2 * count, np.int16)), 0),
        ("bcast int16 / bfloat16, root 1", "broadcast",
         mine(r0=torch.ones(2 * count, dtype=torch.int16), r1=torch.ones(2 * count, dtype=torch.bfloat16)), 1),
        ("bcast src out of range on rank 1", "broadcast", f32(), mine(r0=0, r1=5)),
        ("bcast read-only receiver", "broadcast", mine(r0=f32(), r1=np.ones(count, np.float32)[::1].copy()), 0),
        ("all_reduce read-only on rank 0", "all_reduce", f32(), "SUM"),
    ]
    for label, call, t, arg in cases:
        if label == "bcast read-only receiver" and rank == 1:
            t.flags.writeable = False
        if label == "all_reduce read-only on rank 0" and rank == 0:
            t.flags.writeable = False
        if call == "all_reduce":
            res = outcome(lambda: dist.all_reduce(t, op=getattr(dist.ReduceOp, arg)))
        else:
            res = outcome(lambda: dist.broadcast(t, arg))
        ok = f32()
        after = outcome(lambda: dist.all_reduce(ok))
        out.append((label, res, after[0], bool((ok == 2).all())))
    dist.destroy_process_group()
    return out


def test_ranks_that_disagree_raise_the_general_paths_errors_on_every_rank(run_ranks):
    """Ranks that disagree on dtype (numpy and torch mixed, bfloat16 against
    float16 or int16 of the same bytes), size, op or root, or where one rank's
    own argument is refused (out-of-range src, read-only receiver), once the
    medium path is open to every rank: every rank raises, the same error the
    general path alone raises, naming the rank and the call; calls where one
    rank takes the general path and the other the medium path (requires_grad,
    strided) succeed; the group goes on after each; nothing hangs."""
    pytest.importorskip("torch")
    fast = run_ranks(disagreements, 2, timeout=TIMEOUT)
    general = run_ranks(disagreements, 2, timeout=TIMEOUT, env=FAST_OFF)
    assert fast == general
    agree = ("float16 torch / float16 numpy", "requires grad / plain", "strided / plain")
    for rank, said in enumerate(fast):
        for label, res, after, two in said:
            assert after == "ok" and two, (rank, label)
            if label in agree:
                assert res == ("ok", None), (rank, label, res)
            else:
                assert res[0] != "ok", (rank, label)
                assert f"rank {rank}" in res[1], (rank, label, res)
                call = "all_reduce" if label.startswith("float") or "all_reduce" in label or \
                    label in ("one element more", "SUM / MAX", "bfloat16 / float16") else "broadcast"
                assert call in res[1], (rank, label, res)


def bfloat16_small_mismatch(rank, world_size, init_method):
    """bfloat16 against int16 of the same bytes, at sizes the one-call paths take."""
    import torch
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=20)
    out = []
    for n in (1000, 100_000, 200_000, (ROUND - 4096) // 2):
        t = torch.ones(n, dtype=torch.bfloat16) if rank == 0 else torch.ones(n, dtype=torch.int16)
        out.append(outcome(lambda: dist.broadcast(t, 0)))
        out.append(outcome(lambda: dist.all_reduce(t)))
    dist.destroy_process_group()
    return out


def test_a_bfloat16_mismatch_on_the_one_call_paths_names_bfloat16(run_ranks):
    """Beside the medium path: a bfloat16 broadcast the one-call path took
    (arena.quick_broadcast) and a mismatch: the rank's own description of its
    tensor must say bfloat16, as the general path's does, not uint16 (the bits
    the fast view carries). It failed: quick_broadcast's message named uint16."""
    pytest.importorskip("torch")
    fast = run_ranks(bfloat16_small_mismatch, 2, timeout=TIMEOUT)
    general = run_ranks(bfloat16_small_mismatch, 2, timeout=TIMEOUT, env=FAST_OFF)
    for rank in range(2):
        for f, g in zip(fast[rank], general[rank]):
            assert f[0] == g[0] == "DistMismatchError"
            assert "uint16" not in f[1], (rank, f[1])
            assert f == g, rank


# ------------------------------------------------------------------ what a call leaves the tensor able to do

def resize_after(rank, world_size, init_method, grad):
    import torch
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=20)
    count = BIG // 4
    dist.all_reduce(torch.ones(count))          # float32 SUM learned
    t = torch.ones(count, requires_grad=grad)
    dist.all_reduce(t)                          # grad: the general path; else the medium path
    t.requires_grad_(False)
    said = [outcome(lambda: dist.all_reduce(torch.ones(count)))[0]]
    try:
        t.resize_(2 * count)                    # grows its storage (as gloo leaves possible)
        said.append("resized")
    except RuntimeError as e:
        said.append(str(e))
    dist.destroy_process_group()
    return said


@pytest.mark.parametrize("grad", [False, True], ids=["medium", "general"])
def test_a_tensor_all_reduced_can_still_grow_on_either_path(run_ranks, grad):
    """After a big all_reduce a torch tensor's storage can still be resized, as
    after gloo's and after the medium path's (which only uses the cached numpy
    view, made so as not to pin it): the general path must not differ. It
    failed on the general path: _reducible -> typed_view called tensor.numpy(), which
    marked the storage not resizable ("Trying to resize storage that is not
    resizable"), so the two paths leave the same tensor different."""
    pytest.importorskip("torch")
    for said in run_ranks(resize_after, 2, grad, timeout=TIMEOUT):
        assert said == ["ok", "resized"]


# ------------------------------------------------------------------ three ranks, rank order; TCP; re-init

ORDER_PLAN = [(call, dtype, count, arg)
              for dtype, count in (("float32", BIG // 4 + 1), ("float32", 300 * KB // 4 + 3), ("float64", BIG // 8 + 5),
                                   ("int64", BIG // 8))
              for call, arg in (("all_reduce", "SUM"), ("all_reduce", "SUM"), ("broadcast", 2),
                                ("all_reduce", "PRODUCT"), ("all_reduce", "MAX"), ("broadcast", 1),
                                ("all_reduce", "SUM"), ("broadcast", 0))]


def test_three_ranks_numpy_and_torch_sum_in_rank_order(run_ranks):
    """Three ranks (the middle one torch): float32 and float64 sums and products,
    whose rounding depends on the order, bit-exact against a reference reduced
    in rank order, on the medium path (after the first call of each dtype), with
    broadcast roots changing between calls."""
    pytest.importorskip("torch")
    res = run_ranks(sweep, 3, ORDER_PLAN, (1,), timeout=TIMEOUT)
    want = expected(ORDER_PLAN, 3)
    for rank, (said, seen) in enumerate(res):
        assert said == want, rank
        assert seen["all_reduce"] == 3 * 3, seen      # the first SUM, PRODUCT and MAX of each dtype


TCP_PLAN = [(c, d, n, a % 2 if c == "broadcast" else a) for c, d, n, a in ORDER_PLAN if d != "int64"]


def test_medium_path_over_tcp_is_exact(run_ranks):
    """SHMDIST_TRANSPORT=tcp: the default group's engine is the hierarchical one
    (each rank its own node), which the medium path calls with the same
    arguments: results bit-exact, as on the general path."""
    env = {"SHMDIST_TRANSPORT": "tcp"}
    fast = run_ranks(sweep, 2, TCP_PLAN, (), timeout=TIMEOUT, env=env)
    general = run_ranks(sweep, 2, TCP_PLAN, (), timeout=TIMEOUT, env={**env, **FAST_OFF})
    want = expected(TCP_PLAN, 2)
    for rank in range(2):
        assert fast[rank][0] == general[rank][0] == want, rank
        assert fast[rank][1]["all_reduce"] < general[rank][1]["all_reduce"]


def reinit(rank, world_size, init_method, second):
    """Big calls, destroy, calls after destroy, init again, big calls again."""
    count = BIG // 4
    out = []
    for k, where in enumerate((init_method, second)):
        dist.init_process_group("shm", where, rank=rank, world_size=world_size, timeout=20)
        for step in range(3):
            x = data("float32", count, rank, step + 10 * k)
            dist.all_reduce(x)
            out.append(digest(x))
            y = data("float64", count, rank, step + 10 * k) if rank == step % 2 else np.zeros(count)
            dist.broadcast(y, step % 2)
            out.append(digest(y))
        dist.destroy_process_group()
        for call in (lambda: dist.all_reduce(np.ones(count, np.float32)),
                     lambda: dist.broadcast(np.ones(count, np.float64), 0)):
            try:
                call()
                out.append("passed after destroy")
            except Exception as e:
                out.append((type(e).__name__, str(e)))
    return out


def test_calls_after_destroy_and_after_init_again(run_ranks):
    """The learned names outlive a destroy_process_group: calls after it raise
    the general path's error (not a crash in the medium path's stale engine),
    and after init_process_group again the medium path's results are exact."""
    from ranks import free_port
    second = f"tcp://127.0.0.1:{free_port()}"
    fast = run_ranks(reinit, 2, second, timeout=TIMEOUT)
    second = f"tcp://127.0.0.1:{free_port()}"
    general = run_ranks(reinit, 2, second, timeout=TIMEOUT, env=FAST_OFF)
    assert fast == general
    assert fast[0] == fast[1]
    for k in range(2):
        for step in range(3):
            at = 8 * k + 2 * step
            assert fast[0][at] == digest(reference("float32", BIG // 4, 2, step + 10 * k, "SUM"))
            assert fast[0][at + 1] == digest(data("float64", BIG // 4, step % 2, step + 10 * k))
        assert fast[0][8 * k + 6][0] != "passed after destroy"


# ------------------------------------------------------------------ numpy arrays seen in other ways

def numpy_tricks(rank, world_size, init_method):
    """Numpy arrays whose view of the same memory changes between big calls."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=20)
    count = BIG // 4
    out = []
    step = iter(range(10 ** 6))

    def call(label, a, kind="all_reduce", arg="SUM", around=None):
        res = outcome(lambda: dist.all_reduce(a, op=getattr(dist.ReduceOp, arg)) if kind == "all_reduce"
                      else dist.broadcast(a, arg))
        out.append((label,) + (("ok", digest(a if around is None else around)) if res[0] == "ok" else res))

    def fill(a):
        s = next(step)
        if a.dtype.fields is not None:
            a.view(np.uint8)[...] = data("uint8", a.nbytes, rank, s).reshape(a.view(np.uint8).shape)
        else:
            a[...] = data("float64", a.size, rank, s).reshape(a.shape).astype(a.dtype)
        return a

    for dt in ("float32", "int32", "int64", "uint8"):
        call("learn " + dt, fill(np.empty(count, dt)))
    a = fill(np.empty(count, np.float32))
    call("f32", a)
    call("as int32", fill(a.view(np.int32)))
    call("as int64, half the elements", fill(a.view(np.int64)))
    call("as uint8 bytes", fill(a.view(np.uint8)))
    call("as 2-d", fill(a.reshape(4, -1)))
    call("Fortran order", fill(np.empty((4, count // 4), np.float32, order="F")))
    call("transposed", fill(np.empty((count // 4, 4), np.float32)).T)
    big = fill(np.empty(count + 4096, np.float32))
    call("offset slice", fill(big[1000: 1000 + count]), around=big)
    raw = np.zeros(4 * count + 1, np.uint8)
    odd = raw[1:].view(np.float32)                       # C-contiguous, not aligned
    call("unaligned", fill(odd), around=raw)
    call("unaligned broadcast", fill(odd), "broadcast", 1, around=raw)
    meta = np.dtype(np.float32, metadata={"mine": 1})
    call("dtype with metadata", fill(np.empty(count, meta)))
    rec = np.dtype([("a", "<i4"), ("b", "<f4")])
    call("structured, broadcast", fill(np.empty(count // 2, rec)), "broadcast", 0)
    call("structured, broadcast again", fill(np.empty(count // 2, rec)), "broadcast", 1)
    call("memmap-like subclass", fill(np.empty(count, np.float32).view(np.recarray)))
    ro = fill(np.empty(count, np.float32))
    ro.flags.writeable = False
    call("read-only root", ro, "broadcast", rank)          # each rank the root of its own (a mismatch)
    call("read-only root 0", ro if rank == 0 else fill(np.empty(count, np.float32)), "broadcast", 0)
    call("zero-size", np.empty(0, np.float32))
    call("zero-size broadcast", np.empty((0, 4), np.float32), "broadcast", 1)
    call("0-d", fill(np.empty((), np.float32)))
    dist.destroy_process_group()
    return out


def test_numpy_arrays_seen_in_other_ways_behave_as_on_the_general_path(run_ranks):
    """The same memory as another dtype (int32, int64, bytes) or shape; Fortran
    order and transposed views; an offset slice (the memory around it untouched);
    unaligned arrays; a dtype with metadata (equal to float32, so the same learned
    name); structured dtypes; an ndarray subclass; read-only roots; zero-size and
    0-d arrays: every call's outcome is the general path's."""
    fast = run_ranks(numpy_tricks, 2, timeout=TIMEOUT)
    general = run_ranks(numpy_tricks, 2, timeout=TIMEOUT, env=FAST_OFF)
    for rank in range(2):
        assert len(fast[rank]) == len(general[rank])
        for f, g in zip(fast[rank], general[rank]):
            assert f == g, rank


def structured_all_reduce(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=10)
    rec = np.dtype([("a", "<i4"), ("b", "<f4")])
    said = []
    for _ in range(2):          # the second time the (SUM, name) pair is in _CHECKED: the medium path
        try:
            dist.all_reduce(np.zeros(BIG // 8, rec))
            said.append("passed")
        except Exception as e:
            said.append(type(e).__name__)
    ok = np.ones(BIG // 4, np.float32)
    try:
        dist.all_reduce(ok)
        said.append(bool((ok == 2).all()))
    except Exception as e:
        said.append(type(e).__name__)
    dist.destroy_process_group()
    return said


def test_all_reduce_of_a_structured_dtype_is_refused_up_front(run_ranks):
    """SUM of a structured numpy dtype (no arithmetic): check() lets kind 'V' pass
    and files (SUM, its name) in _CHECKED, so the call fails inside the engine with
    numpy's UFuncNoLoopError after the first phase, and the next one goes the
    medium path to the same failure. It must be refused as a DistError (as
    BAND of floats is) on every rank, every time, and the group go on. It
    failed before check() refused kinds outside numbers and bools."""
    for said in run_ranks(structured_all_reduce, 2, timeout=TIMEOUT, errors="return"):
        assert said == ["DistError", "DistError", True]

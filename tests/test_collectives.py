"""Collectives between real processes, checked against numpy references.

Each test starts its ranks once and runs a whole list of cases in them (see
``run_cases``): every rank builds its own inputs and, from the same seeds,
every other rank's, so it can compute the expected result itself. A rank
returns the problems it found (empty when all is well) and, for all_reduce
and broadcast, a digest of each result, so the test also sees that every
rank ended with the same bits.

Inputs are chosen so that exact answers are known: integers compare exactly
(uint8 SUM wraps, as numpy does); float16 and bfloat16 inputs are multiples
of a power of two whose sums are exact in float32 but not in the half type,
so SUM must equal the float32 sum rounded once (accumulating in the half type
rounds at every step and misses it); float32/float64/complex64 compare within
rounding against a wider-precision reference.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import signal
import threading
import time
from collections import namedtuple

import numpy as np
import pytest

import shmdist as dist

INTS = ("int32", "int64", "uint8", "bool")
HALF = ("float16", "bfloat16")
DTYPES = ("int32", "int64", "uint8", "bool", "float16", "bfloat16", "float32", "float64", "complex64")
BITWISE_OPS = ("BAND", "BOR", "BXOR")
OPS = {d: ("SUM", "PRODUCT", "MIN", "MAX") + BITWISE_OPS for d in INTS}
OPS.update({d: ("SUM", "PRODUCT", "MIN", "MAX", "AVG") for d in HALF + ("float32", "float64")})
OPS["complex64"] = ("SUM", "PRODUCT", "AVG")
UFUNC = {"SUM": np.add, "AVG": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
         "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}

REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor")
MOVEMENTS = ("broadcast", "all_gather", "all_gather_into_tensor", "gather", "scatter", "all_to_all",
             "all_to_all_single", "barrier")
SENTINEL = 7     # fills the gaps of strided tensors; must still be there afterwards

# Without torch, cases of torch tensors run as numpy arrays and bfloat16 (which numpy lacks) is
# left out; test_torch_tensors_and_bfloat16 then skips, saying so.
HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed: torch tensors and "
                                 "bfloat16 are tested when it is (pip install torch)")

# One collective call. ``count`` is the elements of one rank's piece; ``root`` indexes the
# group's members (the call gets the member's global rank); ``uneven`` gives all_to_all*
# pieces of different sizes (some empty).
Case = namedtuple("Case", "coll dtype count op kind layout async_op root seed uneven",
                  defaults=(None, "numpy", "contiguous", False, 0, 0, False))


def label(c: Case) -> str:
    parts = [c.coll, c.op, c.dtype, str(c.count), c.kind, c.layout, "async" if c.async_op else "sync"]
    if c.uneven:
        parts.append("uneven")
    return "/".join(p for p in parts if p)


def _mix(i: int, k: int) -> int:
    """A well-spread choice among k options for case number i."""
    return (i * 2654435761 >> 11) % k


def make_cases(colls, sizes, dtypes=DTYPES, ops=None, first_seed=0) -> list[Case]:
    """Every collective x dtype x op (where it applies) x size, varying the tensor kind,
    layout, async_op and root from case to case. bfloat16 is always a torch tensor."""
    cases, i = [], first_seed
    for coll in colls:
        for dtype in dtypes:
            for op in (OPS[dtype] if coll in REDUCTIONS else (None,)):
                if ops is not None and op is not None and op not in ops:
                    continue
                for count in sizes:
                    kind = "torch" if dtype == "bfloat16" or _mix(i, 2) else "numpy"
                    layout = "strided" if _mix(i + 1, 3) == 0 else "contiguous"
                    cases.append(Case(coll, dtype, count, op, kind, layout, _mix(i + 2, 2) == 1,
                                      root=_mix(i + 3, 8), seed=i))
                    i += 1
                    if coll in ("all_to_all", "all_to_all_single"):
                        cases.append(Case(coll, dtype, count, op, kind, "contiguous", _mix(i, 2) == 1,
                                          seed=i, uneven=True))
                        i += 1
    return available(cases)


def available(cases: list[Case]) -> list[Case]:
    """``cases`` as this machine can run them: without torch, torch tensors become numpy
    arrays and bfloat16 cases are left out."""
    if HAVE_TORCH:
        return cases
    return [c._replace(kind="numpy") for c in cases if c.dtype != "bfloat16"]


# ---------------------------------------------------------------- inputs and references

def values(c: Case, sender: int, part: int, count: int) -> np.ndarray:
    """The data global rank ``sender`` contributes as piece ``part`` (numpy; bfloat16 as
    float32 values that bfloat16 holds exactly)."""
    rng = np.random.default_rng([c.seed, sender, part, 2024])
    product = c.op == "PRODUCT"
    d = c.dtype
    if d == "bool":
        return rng.integers(0, 2, count).astype(bool)
    if d == "uint8":
        return rng.integers(0, 256, count).astype(np.uint8)
    if d in ("int32", "int64"):
        return (rng.integers(-3, 4, count) if product else rng.integers(-1000, 1001, count)).astype(d)
    if d == "float16":       # multiples of 2**-10 in [-2, 2]: float16-exact, sums exact in float32 only
        return (1 + rng.integers(-256, 257, count) / 1024 if product
                else rng.integers(-2048, 2049, count) / 1024).astype(np.float16)
    if d == "bfloat16":      # multiples of 2**-7 in [-2, 2]: bfloat16-exact, sums exact in float32 only
        return (1 + rng.integers(-32, 33, count) / 128 if product
                else rng.integers(-256, 257, count) / 128).astype(np.float32)
    x = rng.standard_normal(count)
    if d == "complex64":
        x = x + 1j * rng.standard_normal(count)
    return (1 + 0.05 * x if product else x).astype(d)


def reference(op: str, dtype: str, inputs: list[np.ndarray], n: int) -> np.ndarray:
    """The reduction of ``inputs`` in rank order, as numpy computes it: integers in their
    own type, float16/bfloat16 accumulated in float32 and rounded once, float32 and
    complex64 in double precision (compared within rounding)."""
    ufunc = UFUNC[op]
    wide = {"float16": np.float32, "bfloat16": np.float32, "float32": np.float64,
            "complex64": np.complex128}.get(dtype)
    acc = inputs[0].astype(wide) if wide else inputs[0].copy()
    for x in inputs[1:]:
        acc = ufunc(acc, x.astype(wide) if wide else x)
    if op == "AVG":
        acc = acc / acc.dtype.type(n)
    if dtype == "float16":
        return acc.astype(np.float16)
    if dtype == "bfloat16":
        import torch
        return torch.from_numpy(np.ascontiguousarray(acc)).to(torch.bfloat16).float().numpy()
    return acc


def _tolerance(dtype: str, op: str | None, n: int):
    """(rtol, atol) for a result, or None when it must be exact."""
    if op not in ("SUM", "PRODUCT", "AVG") or dtype in INTS:
        return None
    if dtype in HALF:
        if op == "SUM":
            return None          # float32 sum is exact for these inputs: one rounding, known result
        return (2.0 ** -10 if dtype == "float16" else 2.0 ** -7), 0.0
    eps = np.finfo(np.float64 if dtype == "float64" else np.float32).eps
    return 8 * n * eps, 32 * n * eps


def compare(name: str, got: np.ndarray, want: np.ndarray, tol) -> str | None:
    """None when ``got`` matches ``want``, else a line saying where it does not."""
    got = np.asarray(got).reshape(-1)
    want = np.asarray(want).reshape(-1)
    if got.shape != want.shape:
        return f"{name}: got {got.size} elements, expected {want.size}"
    if tol is None:
        bad = np.flatnonzero(got != want)
    else:
        rtol, atol = tol
        bad = np.flatnonzero(~np.isclose(got, want, rtol=rtol, atol=atol))
    if bad.size == 0:
        return None
    i = bad[0]
    return (f"{name}: {bad.size} of {want.size} elements differ, first at [{i}]: got {got[i]!r}, "
            f"expected {want[i]!r}")


# ---------------------------------------------------------------- tensors

def _torch_dtype(dtype: str):
    import torch
    return getattr(torch, dtype)


def new_tensor(c: Case, data: np.ndarray, shape=None):
    """``data`` as the case's kind of tensor, strided (every other element of a bigger
    tensor filled with SENTINEL) when the case says so."""
    shape = tuple(shape) if shape is not None else data.shape
    data = data.reshape(shape)
    wide = shape[:-1] + (2 * shape[-1],)
    if c.kind == "torch":
        import torch
        src = torch.from_numpy(np.ascontiguousarray(data)).to(_torch_dtype(c.dtype))
        if c.layout == "contiguous":
            return src
        base = torch.full(wide, SENTINEL, dtype=_torch_dtype(c.dtype))
        view = base[..., ::2]
        view.copy_(src)
        return view
    if c.layout == "contiguous":
        return np.ascontiguousarray(data)
    base = np.full(wide, SENTINEL, dtype=data.dtype)
    view = base[..., ::2]
    view[...] = data
    return view


def zeros(c: Case, shape):
    return new_tensor(c, np.zeros(shape, dtype=np.float32 if c.dtype == "bfloat16" else c.dtype))


def as_numpy(t) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    import torch
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def bits(t) -> str:
    """A digest of the tensor's exact bytes."""
    if not isinstance(t, np.ndarray):
        t = t.contiguous()
        t = (t.view(_torch_dtype("int16")) if t.dtype == _torch_dtype("bfloat16") else t).numpy()
    return hashlib.sha1(np.ascontiguousarray(t).tobytes()).hexdigest()


def gaps_intact(name: str, t) -> str | None:
    """For a strided tensor made by new_tensor: the elements between its own are untouched."""
    base = t.base if isinstance(t, np.ndarray) else t._base
    gaps = as_numpy(base[..., 1::2])
    if np.all(gaps == np.array(SENTINEL).astype(gaps.dtype)):
        return None
    return f"{name}: the gaps of the strided tensor were overwritten"


# ---------------------------------------------------------------- running one case

def check_async(name: str, ret, async_op: bool) -> str | None:
    if not async_op:
        return None if ret is None else f"{name}: async_op=False returned {ret!r}, expected None"
    if not isinstance(ret, dist.DistributedRequest):
        return f"{name}: async_op=True returned {ret!r}, expected a DistributedRequest"
    if ret.wait() is not True or not ret.is_completed():
        return f"{name}: the request did not complete after wait()"
    return None


def _pieces(c: Case, n: int, sender: int, receiver: int) -> int:
    """Elements member ``sender`` sends member ``receiver`` in all_to_all* (0 to count+1)."""
    if not c.uneven:
        return c.count
    return max(0, c.count + (sender + 2 * receiver + c.seed) % 3 - 1)


def run_case(c: Case, members: tuple, me: int, group) -> tuple[list[str], str | None]:
    """Run ``c`` on this rank (member index ``me`` of ``members``); returns the problems
    found and a digest of the result when every rank must hold the same bits."""
    name = label(c)
    n = len(members)
    me_g = members[me]
    root = c.root % n
    root_g = members[root]
    op = getattr(dist.ReduceOp, c.op) if c.op else None
    tol = _tolerance(c.dtype, c.op, n)
    problems, digest = [], None
    out_checks = []      # (name, tensor, expected)

    def red(pieces):
        return reference(c.op, c.dtype, pieces, n)

    if c.coll == "barrier":
        ret = dist.barrier(group=group, async_op=c.async_op)
    elif c.coll == "broadcast":
        t = new_tensor(c, values(c, me_g, 0, c.count)) if me == root else zeros(c, (c.count,))
        ret = dist.broadcast(t, src=root_g, group=group, async_op=c.async_op)
        out_checks.append((name, t, values(c, root_g, 0, c.count)))
        digest = bits(t)
    elif c.coll in ("all_reduce", "reduce"):
        t = new_tensor(c, values(c, me_g, 0, c.count))
        if c.coll == "all_reduce":
            ret = dist.all_reduce(t, op=op, group=group, async_op=c.async_op)
        else:
            ret = dist.reduce(t, dst=root_g, op=op, group=group, async_op=c.async_op)
        if c.coll == "all_reduce" or me == root:
            out_checks.append((name, t, red([values(c, r, 0, c.count) for r in members])))
            digest = bits(t) if c.coll == "all_reduce" else None
    elif c.coll == "reduce_scatter":
        out = zeros(c, (c.count,))
        ins = [new_tensor(c, values(c, me_g, j, c.count)) for j in range(n)]
        ret = dist.reduce_scatter(out, ins, op=op, group=group, async_op=c.async_op)
        out_checks.append((name, out, red([values(c, r, me, c.count) for r in members])))
    elif c.coll == "reduce_scatter_tensor":
        out = zeros(c, (c.count,))
        inp = new_tensor(c, np.concatenate([values(c, me_g, j, c.count) for j in range(n)]))
        ret = dist.reduce_scatter_tensor(out, inp, op=op, group=group, async_op=c.async_op)
        out_checks.append((name, out, red([values(c, r, me, c.count) for r in members])))
    elif c.coll == "all_gather":
        outs = [zeros(c, (c.count,)) for _ in range(n)]
        ret = dist.all_gather(outs, new_tensor(c, values(c, me_g, 0, c.count)), group=group,
                              async_op=c.async_op)
        out_checks += [(f"{name}[{j}]", o, values(c, members[j], 0, c.count)) for j, o in enumerate(outs)]
    elif c.coll == "all_gather_into_tensor":
        out = zeros(c, (n * c.count,))
        ret = dist.all_gather_into_tensor(out, new_tensor(c, values(c, me_g, 0, c.count)), group=group,
                                          async_op=c.async_op)
        out_checks.append((name, out, np.concatenate([values(c, r, 0, c.count) for r in members])))
    elif c.coll == "gather":
        outs = [zeros(c, (c.count,)) for _ in range(n)] if me == root else None
        ret = dist.gather(new_tensor(c, values(c, me_g, 0, c.count)), outs, dst=root_g, group=group,
                          async_op=c.async_op)
        if me == root:
            out_checks += [(f"{name}[{j}]", o, values(c, members[j], 0, c.count))
                           for j, o in enumerate(outs)]
    elif c.coll == "scatter":
        ins = [new_tensor(c, values(c, me_g, j, c.count)) for j in range(n)] if me == root else None
        out = zeros(c, (c.count,))
        ret = dist.scatter(out, ins, src=root_g, group=group, async_op=c.async_op)
        out_checks.append((name, out, values(c, root_g, me, c.count)))
    elif c.coll == "all_to_all":
        ins = [new_tensor(c, values(c, me_g, j, _pieces(c, n, me, j))) for j in range(n)]
        outs = [zeros(c, (_pieces(c, n, j, me),)) for j in range(n)]
        ret = dist.all_to_all(outs, ins, group=group, async_op=c.async_op)
        out_checks += [(f"{name}[{j}]", o, values(c, members[j], me, _pieces(c, n, j, me)))
                       for j, o in enumerate(outs)]
    elif c.coll == "all_to_all_single":
        # rows of 3 elements, split along dim 0
        send_rows = [_pieces(c, n, me, j) for j in range(n)]
        recv_rows = [_pieces(c, n, j, me) for j in range(n)]
        data = np.concatenate([values(c, me_g, j, 3 * send_rows[j]) for j in range(n)])
        inp = new_tensor(c, data, (sum(send_rows), 3))
        out = zeros(c, (sum(recv_rows), 3))
        splits = (recv_rows, send_rows) if c.uneven else (None, None)
        ret = dist.all_to_all_single(out, inp, *splits, group=group, async_op=c.async_op)
        out_checks.append((name, out, np.concatenate([values(c, members[j], me, 3 * recv_rows[j])
                                                      for j in range(n)])))
    else:
        raise ValueError(f"unknown collective {c.coll}")

    problems.append(check_async(name, ret, c.async_op))
    for what, t, want in out_checks:
        problems.append(compare(what, as_numpy(t), want, tol if c.coll in REDUCTIONS else None))
        if c.layout == "strided":
            problems.append(gaps_intact(what, t))
    return [p for p in problems if p], digest


def run_cases(rank, world_size, init_method, cases, members=None, init_timeout=120):
    """Target of run_ranks: run every case in order (on ``new_group(members)`` when given)
    and return {"problems": [...], "digests": {label: digest}}."""
    if any(c.kind == "torch" for c in cases):
        import torch  # noqa: F401  (before the group, so that no rank waits on another's import)
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=init_timeout)
    group = None
    if members is not None:
        group = dist.new_group(list(members))
    members = tuple(range(world_size)) if members is None else tuple(sorted(members))
    problems, digests = [], {}
    if rank in members:
        me = members.index(rank)
        for i, c in enumerate(cases):
            found, digest = run_case(c, members, me, group)
            problems += found
            if digest is not None:
                digests[f"#{i} {label(c)}"] = digest
    dist.destroy_process_group()
    return {"problems": problems, "digests": digests}


def assert_all_good(results, members=None):
    """No rank found a problem, and results that every rank holds are bitwise equal."""
    members = range(len(results)) if members is None else members
    problems = [f"rank {r}: {p}" for r in members for p in results[r]["problems"]]
    assert problems == [], f"{len(problems)} problems:\n" + "\n".join(problems[:40])
    first = results[members[0]]["digests"]
    assert first, "no digests were returned"
    for r in members:
        differ = [k for k in first if results[r]["digests"].get(k) != first[k]]
        assert differ == [], f"rank {r} ended with other bits than rank {members[0]} in {differ[:10]}"


# ---------------------------------------------------------------- tests: every collective

# 8 ranks on 2 cores pay for every phase with context switches: they get the same
# collective x op x dtype product, at fewer sizes.
ODD_SIZES = {2: [1, 1023, 65537], 3: [1, 1023, 65537], 4: [1, 1023, 65537], 8: [1, 1023]}


# Over TCP (each rank its own node: sockets and the hierarchical engine) at 2 and 3 ranks:
# what the larger sizes add is the arena's, which TCP does not use.
SIZES_BY_TRANSPORT = [(2, "shm"), (3, "shm"), (4, "shm"), (8, "shm"), (2, "tcp"), (3, "tcp")]


@pytest.mark.parametrize("world_size,transport", SIZES_BY_TRANSPORT, indirect=["transport"])
def test_reductions_match_numpy(run_ranks, world_size, transport):
    """all_reduce, reduce, reduce_scatter, reduce_scatter_tensor x every op x every dtype it
    applies to, at 1 and 1023 elements; all_reduce also at 65537 (above the 64 KiB switch
    to the reduce-scatter path for most dtypes)."""
    cases = make_cases(REDUCTIONS, [1, 1023])
    cases += make_cases(("all_reduce",), ODD_SIZES[world_size][2:], first_seed=len(cases))
    assert_all_good(run_ranks(run_cases, world_size, cases, timeout=100))


@pytest.mark.parametrize("world_size,transport", SIZES_BY_TRANSPORT, indirect=["transport"])
def test_data_movement_matches_numpy(run_ranks, world_size, transport):
    """broadcast, the gathers, scatter, the all_to_alls (even and uneven) and barrier,
    every dtype, at 1, 1023 and (up to 4 ranks) 65537 elements."""
    assert_all_good(run_ranks(run_cases, world_size, make_cases(MOVEMENTS, ODD_SIZES[world_size]),
                              timeout=100))


def test_sixteen_ranks(run_ranks):
    """16 local ranks: past 8 every ordered pair gets the small ring (transport/shm.py) and the
    arena's phases wait for 16 members. Every collective and reduction at 1 and 1023 elements,
    in three dtypes, plus all_reduces on each side of the 16-rank switch (32 KiB) and above
    64 KiB. On 2 cores this is 8 ranks a
    core (slow, but it must pass); bench/wide_host.sh runs it where 16 ranks have 16 cores."""
    dtypes = ("int64", "float32", "bfloat16")
    cases = make_cases(REDUCTIONS + MOVEMENTS, [1, 1023], dtypes=dtypes, ops=("SUM", "MAX", "AVG"))
    cases += make_cases(("all_reduce",), [6000, 12000, 20001], dtypes=("float32",), first_seed=len(cases))
    assert_all_good(run_ranks(run_cases, 16, cases, timeout=110))


@pytest.mark.parametrize("world_size", [3, 8])
def test_many_rounds_in_a_small_arena(run_ranks, world_size):
    """SHMDIST_ARENA_BYTES=65536 makes every collective here take several rounds through
    the double buffers, and all_reduce above 64 KiB its reduce-scatter path."""
    dtypes = ("int64", "uint8", "bfloat16", "float16", "float64", "complex64")
    sizes = [65537]
    if world_size == 8:
        dtypes, sizes = ("int64", "bfloat16", "float32"), [20001]
    cases = make_cases(REDUCTIONS + MOVEMENTS, sizes, dtypes=dtypes, ops=("SUM", "MAX", "BXOR", "AVG", "PRODUCT"))
    results = run_ranks(run_cases, world_size, cases, timeout=100, env={"SHMDIST_ARENA_BYTES": "65536"})
    assert_all_good(results)


@pytest.mark.parametrize("world_size,single", [(2, True), (2, False), (3, True)],
                         ids=["2 ranks", "2 ranks without single copies", "3 ranks"])
def test_large_tensors_take_the_chunked_paths(run_ranks, world_size, single):
    """4 MiB and more per rank: four times the default 1 MiB arena slot. Two ranks copy
    between their arrays (test_split_copy.py) unless SHMDIST_SINGLE_COPY=0: then they too
    take the buffers' rounds."""
    big = (4 << 20) // 4 + 3     # float32 elements: a little over 4 MiB
    cases = [Case("all_reduce", "float32", big, "SUM", "numpy", "contiguous", False, seed=1),
             Case("all_reduce", "float32", big, "AVG", "torch", "strided", True, seed=2),
             Case("all_reduce", "bfloat16", 2 * big, "SUM", "torch", "contiguous", False, seed=3),
             Case("all_reduce", "int64", big // 2, "BXOR", "numpy", "contiguous", True, seed=4),
             Case("all_reduce", "uint8", 4 * big, "MAX", "numpy", "contiguous", False, seed=5),
             Case("reduce", "float64", big // 2, "SUM", "numpy", "contiguous", False, root=1, seed=6),
             Case("reduce_scatter_tensor", "float32", big, "SUM", "numpy", "contiguous", False, seed=7),
             Case("reduce_scatter", "int32", big, "MIN", "torch", "contiguous", True, seed=8)]
    cases += [Case(coll, "float32", big, None, "numpy", "contiguous", False, root=world_size - 1, seed=20 + i)
              for i, coll in enumerate(MOVEMENTS)]
    cases.append(Case("all_to_all_single", "uint8", 4 * big, None, "torch", "contiguous", True, seed=40,
                      uneven=True))
    env = None if single else {"SHMDIST_SINGLE_COPY": "0"}
    assert_all_good(run_ranks(run_cases, world_size, available(cases), timeout=150, env=env))


@needs_torch
@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_tensors_and_bfloat16(run_ranks, world_size):
    """Every collective on torch tensors, contiguous and strided, bfloat16 included."""
    cases = [c._replace(kind="torch") for c in
             make_cases(REDUCTIONS + MOVEMENTS, [1, 1023], dtypes=("bfloat16", "float32", "int64"),
                        first_seed=5000)]
    assert_all_good(run_ranks(run_cases, world_size, cases, timeout=150))


# ---------------------------------------------------------------- ops that make no sense

def bad_ops(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    tries = [("BXOR", np.ones(4, dtype=np.float32), "all_reduce"),
             ("BOR", np.ones(4, dtype=np.float64), "reduce"),
             ("AVG", np.ones(4, dtype=np.int32), "all_reduce"),
             ("MIN", np.ones(4, dtype=np.complex64), "all_reduce"),
             ("MAX", np.ones(4, dtype=np.complex64), "reduce_scatter")]
    if HAVE_TORCH:
        import torch
        tries += [("BAND", torch.ones(4, dtype=torch.bfloat16), "all_reduce"),
                  ("AVG", torch.ones(4, dtype=torch.int64), "reduce_scatter_tensor")]
    seen = []
    for op_name, t, coll in tries:
        op = getattr(dist.ReduceOp, op_name)
        try:
            if coll == "all_reduce":
                dist.all_reduce(t, op=op)
            elif coll == "reduce":
                dist.reduce(t, dst=0, op=op)
            elif coll == "reduce_scatter":
                dist.reduce_scatter(t[:1], [t[:1]] * world_size, op=op)
            else:
                dist.reduce_scatter_tensor(t[:1], t[:world_size], op=op)
            seen.append((op_name, str(t.dtype), coll, "no error"))
        except Exception as e:
            seen.append((op_name, str(t.dtype), coll, f"{type(e).__name__}: {e}"))
            assert isinstance(e, dist.DistError), seen[-1]
    after = np.full(3, rank + 1, dtype=np.int32)
    dist.all_reduce(after)
    dist.destroy_process_group()
    return seen, after.tolist()


def test_ops_that_make_no_sense_raise_naming_op_and_dtype(run_ranks):
    for seen, after in run_ranks(bad_ops, 2, timeout=60):
        for op_name, dtype, coll, message in seen:
            assert op_name in message and dtype.rpartition(".")[2] in message, f"{coll}: {message}"
        assert after == [3, 3, 3]     # the group still works


# ---------------------------------------------------------------- mismatched calls

def _f32(n, value=1.0):
    return np.full(n, value, dtype=np.float32)


# Each scenario: what rank 0 calls, what the other ranks call, and words the error must
# contain (both calls).
MISMATCHES = {
    "all_reduce vs broadcast": (lambda: dist.all_reduce(_f32(8)), lambda: dist.broadcast(_f32(8), src=0),
                                ["all_reduce", "broadcast"]),
    "sizes": (lambda: dist.all_reduce(_f32(10)), lambda: dist.all_reduce(_f32(12)), ["40 bytes", "48 bytes"]),
    "small vs chunked size": (lambda: dist.all_reduce(_f32(10)), lambda: dist.all_reduce(_f32(1 << 20)),
                              ["40 bytes", f"{4 << 20} bytes"]),
    "dtypes": (lambda: dist.all_reduce(_f32(8)), lambda: dist.all_reduce(np.ones(8, dtype=np.int32)),
               ["float32", "int32"]),
    "ops": (lambda: dist.all_reduce(_f32(8), op=dist.ReduceOp.SUM),
            lambda: dist.all_reduce(_f32(8), op=dist.ReduceOp.MAX), ["SUM", "MAX"]),
    "roots": (lambda: dist.broadcast(_f32(8), src=0), lambda: dist.broadcast(_f32(8), src=1),
              ["root=0", "root=1"]),
    "reduce roots": (lambda: dist.reduce(_f32(8), dst=1), lambda: dist.reduce(_f32(8), dst=0),
                     ["root=1", "root=0"]),
    "all_gather vs barrier": (lambda: dist.all_gather([_f32(4) for _ in range(dist.get_world_size())], _f32(4)),
                              lambda: dist.barrier(), ["all_gather", "barrier"]),
    "barrier vs small all_reduce": (lambda: dist.barrier(), lambda: dist.all_reduce(_f32(8)),
                                    ["barrier", "all_reduce"]),
    "large broadcast vs scatter": (lambda: dist.broadcast(_f32(3 << 20), src=0),
                                   lambda: dist.scatter(_f32(8), None, src=0), ["broadcast", "scatter"]),
}


def mismatches(rank, world_size, init_method, names):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=120)
    out = []
    for name in names:
        mine, theirs, _ = MISMATCHES[name]
        try:
            (mine if rank == 0 else theirs)()
            error = (None, "no error")
        except Exception as e:
            error = (type(e).__name__, str(e))
        t = np.full(5, rank + 1, dtype=np.int64)
        dist.all_reduce(t)                      # the group keeps working
        out.append((name, *error, t.tolist()))
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_mismatched_calls_raise_on_every_rank_and_the_group_recovers(run_ranks, world_size, transport):
    """The group timeout is 120 s and the test's 60 s: an error must come from the check."""
    names = list(MISMATCHES)
    results = run_ranks(mismatches, world_size, names, timeout=60)
    total = world_size * (world_size + 1) // 2
    for rank, rows in enumerate(results):
        assert [row[0] for row in rows] == names
        for name, error, message, after in rows:
            assert error == "DistMismatchError", f"rank {rank}, {name}: {error}: {message}"
            for word in MISMATCHES[name][2] + ["rank 0", "rank 1"]:
                assert word in message, f"rank {rank}, {name}: {word!r} missing from: {message}"
            assert after == [total] * 5


# ---------------------------------------------------------------- a rank dies

def die_mid_run(rank, world_size, init_method, victim, how):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=120)
    t = np.ones(1 << 20, dtype=np.float32)      # 4 MiB: the chunked path, several phases per call
    calls = 0
    if rank == victim:
        if how == "os._exit between calls":
            for _ in range(5):
                dist.all_reduce(t)
            os._exit(3)
        # SIGKILL from another thread, at whatever point the loop below has reached
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    try:
        while True:
            dist.all_reduce(t)
            calls += 1
    except dist.DistPeerError as e:
        first = str(e)
    try:
        dist.all_reduce(np.ones(4, dtype=np.float32))
        after = "no error"
    except dist.DistError as e:       # the group is broken for good: it says so at once
        after = type(e).__name__
    dist.destroy_process_group()
    return first, after, calls


@pytest.mark.parametrize("how", ["os._exit between calls", "SIGKILL during calls"])
def test_killed_rank_is_named_by_the_survivors(run_ranks, how):
    """Every survivor raises DistPeerError naming rank 2 (the group timeout is 120 s, the
    test's 60 s, so the error must come from noticing the death, not from a timeout)."""
    results = run_ranks(die_mid_run, 4, 2, how, timeout=60, errors="return")
    assert results[2].exitcode in (3, -signal.SIGKILL)
    for rank in (0, 1, 3):
        first, after, calls = results[rank]
        assert "rank 2" in first and "all_reduce" in first, first
        assert after in ("DistError", "DistPeerError")


def leaves_after_a_timeout(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    pair = dist.new_group([0, 2], timeout=2)
    if rank == 0:
        try:
            dist.all_reduce(np.ones(4), group=pair)      # rank 2 never comes
        except dist.DistTimeoutError:
            pass
        dist.destroy_process_group()
        return "left"
    if rank == 2:
        time.sleep(4)
        dist.destroy_process_group()
        return "idle"
    try:                                                # rank 1 waits on rank 0, which leaves
        dist.recv(np.zeros(1), src=0).wait(timeout=30)
        return "no error"
    except dist.DistPeerError as e:
        return str(e)
    finally:
        dist.destroy_process_group()


def test_a_rank_that_leaves_after_a_timeout_says_so(run_ranks):
    """Rank 1 never saw the timeout itself: rank 0's goodbye tells it what happened."""
    results = run_ranks(leaves_after_a_timeout, 3, timeout=60)
    message = results[1]
    assert "rank 0 left the group (destroy_process_group) after rank 0 timed out in all_reduce" in message
    assert "rank 2" in message, message


# ---------------------------------------------------------------- 0-d and empty tensors

def edge_shapes(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    out = {}
    t = np.array(rank + 1.5)                                  # 0-d numpy
    dist.all_reduce(t)
    out["all_reduce 0-d numpy"] = float(t)
    if HAVE_TORCH:
        import torch
        import torch.distributed as tdist
        t = torch.tensor(rank + 2)                            # 0-d torch, torch's own ReduceOp
        dist.all_reduce(t, op=tdist.ReduceOp.PRODUCT)
        out["all_reduce 0-d torch, torch ReduceOp"] = int(t)
    t = np.array(float(rank * 10)) if rank == 1 else np.array(-1.0)
    dist.broadcast(t, src=1)
    out["broadcast 0-d"] = float(t)
    e = np.zeros(0, dtype=np.float32)
    dist.all_reduce(e)
    dist.broadcast(e, src=0)
    dist.all_gather_into_tensor(np.zeros(0, dtype=np.float32), e)
    dist.reduce_scatter_tensor(e, np.zeros(0, dtype=np.float32))
    dist.all_to_all_single(np.zeros((0, 4)), np.zeros((0, 4)))
    out["empty tensors"] = e.shape
    t = np.array([rank], dtype=np.int64)
    dist.all_reduce(t)                                        # still in step after all that
    out["after"] = t.tolist()
    dist.destroy_process_group()
    return out


def test_0d_and_empty_tensors(run_ranks, transport):
    results = run_ranks(edge_shapes, 3, timeout=60)
    want = {"all_reduce 0-d numpy": 7.5, "broadcast 0-d": 10.0, "empty tensors": (0,), "after": [3]}
    if HAVE_TORCH:
        want["all_reduce 0-d torch, torch ReduceOp"] = 24
    assert results == [want] * 3


# ---------------------------------------------------------------- split sizes that disagree

def _exchange_rows(rank, output_split_sizes, input_split_sizes):
    inp = np.arange(sum(input_split_sizes), dtype=np.float32) + 10 * rank
    out = np.zeros(sum(output_split_sizes), dtype=np.float32)
    try:
        dist.all_to_all_single(out, inp, output_split_sizes, input_split_sizes)
        return out.tolist()
    except dist.DistError as e:
        return f"{type(e).__name__}: {e}"


def disagreeing_splits(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    # rank 0 sends rank 1 three rows, rank 1 expects two
    bad = _exchange_rows(rank, [1, 1], [1, 3]) if rank == 0 else _exchange_rows(rank, [2, 1], [1, 1])
    # then a correct uneven exchange: rank 0 sends rank 1 two rows, rank 1 sends rank 0 two
    good = _exchange_rows(rank, [1, 2], [1, 2]) if rank == 0 else _exchange_rows(rank, [2, 1], [2, 1])
    dist.destroy_process_group()
    return bad, good


def test_disagreeing_split_sizes_raise_everywhere_and_the_group_recovers(run_ranks, transport):
    (bad0, good0), (bad1, good1) = run_ranks(disagreeing_splits, 2, timeout=60)
    assert [str(bad0).split(":")[0], str(bad1).split(":")[0]] == ["DistMismatchError"] * 2, (bad0, bad1)
    assert good0 == [0.0, 10.0, 11.0]
    assert good1 == [1.0, 2.0, 12.0]

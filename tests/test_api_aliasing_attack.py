"""An outside attack on two README promises of the API section, through
shmdist's own calls (not torch.distributed):

- "Inputs and outputs of one collective may share memory, and the result is
  what separate buffers give": every collective with separate inputs and
  outputs, with the in-place idioms and with odd overlaps (an output at an
  odd element offset straddling two input pieces, list entries that are
  views of one buffer in reversed order, an input that is another rank's
  output slot), at piece sizes that cross the library's thresholds (8 B,
  4 KiB, 64 KiB, 300 KiB, 1 MiB, 3 MiB, 17 MiB once), on 2, 3 and 4 ranks,
  on the default group and on a subgroup whose ranks are not contiguous,
  with the default arena and a small one, and over TCP (the hierarchical
  engine).
- "Tensors: numpy arrays and torch CPU tensors of every dtype either has":
  the same aliasing idioms on bfloat16, float16, complex, bool, unsigned
  (and float8 / complex32 for the moving collectives) torch tensors,
  strided and transposed inputs and outputs, lazily conjugated and negated
  views, tensors that require grad, 0-d and empty tensors, numpy arrays of
  the other byte order and numpy arrays at an unaligned address.

Every expectation is computed locally with numpy from the known per-rank
inputs (what separate buffers give); nothing is checked by "it did not
raise" only.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

import shmdist as dist

KIB, MIB = 1 << 10, 1 << 20


# ---------------------------------------------------------------- data and references

def ints(r: int, count: int, salt: int) -> np.ndarray:
    """Rank ``r``'s values for case ``salt``: small positive integers, so that
    every sum of up to 4 ranks is exact in every dtype used here (bfloat16 too)."""
    return (np.arange(count, dtype=np.int64) * 7 + 13 * r + 5 * salt) % 61 + 1


def F(r: int, count: int, dtype, salt: int) -> np.ndarray:
    """numpy data of rank ``r`` (any numpy dtype, either byte order)."""
    x = ints(r, count, salt)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return (x % 3 == 0).astype(dt)
    if dt.kind == "c":
        return (x + 1j * ((x * 3) % 17)).astype(dt)
    return x.astype(dt)


def fold(arrays: list, dtype, op: str) -> np.ndarray:
    """The reduction of ``arrays`` in rank order, as separate buffers give it."""
    dt = np.dtype(dtype)
    if op == "bor":
        return functools.reduce(np.logical_or, arrays).astype(dt)
    if dt.kind in "iu":      # integer sums wrap as the dtype's arithmetic does
        return functools.reduce(np.add, [a.astype(np.int64) for a in arrays]).astype(dt)
    return functools.reduce(np.add, [a.astype(dt.newbyteorder("=")) for a in arrays]).astype(dt)


def reduce_op(dtype) -> tuple:
    """(shmdist op, name for fold) for a dtype."""
    return (dist.ReduceOp.BOR, "bor") if np.dtype(dtype).kind == "b" else (dist.ReduceOp.SUM, "sum")


class Bad(list):
    """The mismatches one rank found."""

    def __init__(self, me: int):
        super().__init__()
        self.me = me

    def expect(self, name: str, got, want) -> None:
        got, want = np.asarray(got), np.asarray(want)
        if got.shape != want.shape or not np.array_equal(got, want):
            where = "" if got.shape != want.shape else \
                f" first differing element {int(np.flatnonzero(got.reshape(-1) != want.reshape(-1))[0])}"
            self.append(f"rank {self.me}: {name}: got {got.reshape(-1)[:6]} {got.shape} "
                        f"want {want.reshape(-1)[:6]} {want.shape}{where}")


# ---------------------------------------------------------------- numpy: every collective, aliased

def holder(memory: str, group, capacity: int, dtype):
    """A function that puts a 1-D array's values into memory of kind ``memory``:
    ``plain`` (a fresh contiguous array), ``strided`` (every other element of a
    buffer), ``reversed`` (a negative stride), ``shared`` (the start of a
    ``shmdist.empty`` array of ``capacity`` elements: a collective call, so
    every rank allocates alike)."""
    def put(x: np.ndarray) -> np.ndarray:
        if memory == "plain":
            return x.copy()
        if memory == "strided":
            v = np.zeros(2 * x.size, x.dtype)[::2]
        elif memory == "reversed":
            v = np.zeros(x.size, x.dtype)[::-1]
        else:
            v = dist.empty((capacity,), dtype, group=group)[:x.size]
        v[...] = x
        return v
    return put


def _alias_cases(bad: Bad, group, gl: list, n: int, me: int, k: int, dtype, salt: int, what: str,
                 memory: str = "plain") -> None:
    """The aliasing cases of one group at one piece size (``k`` elements of
    ``dtype``). ``gl``: the group's global ranks (group rank -> global rank),
    ``me`` this rank's group rank; ``memory``: what the buffers that inputs
    and outputs share are (see ``holder``)."""
    A = holder(memory, group, 2 * n * k + 2 * k + 8, dtype)
    op, opname = reduce_op(dtype)
    sl = lambda j: slice(j * k, (j + 1) * k)
    off = (k // 2) | 1 if k > 1 else 0       # an odd element offset (straddles two pieces)
    tag = f"{what} {np.dtype(dtype).str}[{k}] n={n}"
    G = lambda r, count, s: F(r, count, dtype, salt * 100 + s)

    def case(s, name):
        return f"{name} ({tag})"

    # 1 all_gather_into_tensor(t, t[mine]) and from another rank's slot, and from an odd offset
    t = A(np.zeros(n * k, dtype))
    t[sl(me)] = G(me, k, 1)
    dist.all_gather_into_tensor(t, t[sl(me)], group=group)
    bad.expect(case(1, "all_gather_into_tensor(t, t[mine])"), t, np.concatenate([G(j, k, 1) for j in range(n)]))

    t = A(np.zeros(n * k, dtype))
    o = (me + 1) % n
    t[sl(o)] = G(me, k, 2)
    dist.all_gather_into_tensor(t, t[sl(o)], group=group)
    bad.expect(case(2, "all_gather_into_tensor(t, t[slot of rank me+1])"), t,
               np.concatenate([G(j, k, 2) for j in range(n)]))

    base = A(G(me, n * k, 3))
    dist.all_gather_into_tensor(base, base[off:off + k], group=group)
    bad.expect(case(3, f"all_gather_into_tensor(t, t[{off}:{off}+k])"), base,
               np.concatenate([G(j, n * k, 3)[off:off + k] for j in range(n)]))

    # 2 reduce_scatter_tensor: output my chunk, another rank's chunk, an odd offset
    for s, place in ((4, sl(me)), (5, sl((me + 1) % n)), (6, slice(off, off + k))):
        t = A(G(me, n * k, s))
        dist.reduce_scatter_tensor(t[place], t, op=op, group=group)
        bad.expect(case(s, f"reduce_scatter_tensor(t[{place.start}:{place.stop}], t)"), t[place],
                   fold([G(r, n * k, s)[sl(me)] for r in range(n)], dtype, opname))

    # 3 all_to_all_single: in place even; in place uneven (symmetric splits, zeros among them);
    #   output over the input shifted by an odd offset, even and uneven
    t = A(G(me, n * k, 7))
    dist.all_to_all_single(t, t, group=group)
    bad.expect(case(7, "all_to_all_single(t, t)"), t, np.concatenate([G(j, n * k, 7)[sl(me)] for j in range(n)]))

    sym = lambda i, j: k * ((i + j) % 3) // 2          # 0 for i + j = 0 (mod 3)
    sizes = [sym(me, j) for j in range(n)]
    rows = lambda r: sum(sym(r, j) for j in range(n))
    starts = lambda r, j: sum(sym(r, x) for x in range(j))
    t = A(G(me, rows(me), 8))
    dist.all_to_all_single(t, t, sizes, sizes, group=group)
    bad.expect(case(8, f"all_to_all_single(t, t, {sizes}, {sizes})"), t,
               np.concatenate([G(j, rows(j), 8)[starts(j, me):starts(j, me) + sym(j, me)] for j in range(n)]))

    base = A(np.zeros(n * k + off, dtype))
    base[:n * k] = G(me, n * k, 9)
    dist.all_to_all_single(base[off:off + n * k], base[:n * k], group=group)
    bad.expect(case(9, f"all_to_all_single(t[{off}:], t[:-{off}])"), base[off:off + n * k],
               np.concatenate([G(j, n * k, 9)[sl(me)] for j in range(n)]))

    send = lambda i, j: k * (1 + (i + 2 * j) % 3) // 2 + (i == j)   # not symmetric
    ins_ = [send(me, j) for j in range(n)]
    outs_ = [send(j, me) for j in range(n)]
    nin, nout = sum(ins_), sum(outs_)
    base = A(np.zeros(max(nin, nout + off) + 1, dtype))
    base[:nin] = G(me, nin, 10)
    dist.all_to_all_single(base[off:off + nout], base[:nin], outs_, ins_, group=group)
    at = lambda r, j: sum(send(r, x) for x in range(j))
    want = np.concatenate([G(j, sum(send(j, x) for x in range(n)), 10)[at(j, me):at(j, me) + send(j, me)]
                           for j in range(n)])
    bad.expect(case(10, f"all_to_all_single(t[{off}:], t[:{nin}], {outs_}, {ins_})"), base[off:off + nout], want)

    # 4 all_gather (list): outputs are views of one buffer in reversed order; the input is
    #   outs[me] (the in-place idiom), the slot at my index (outs[n-1-me]), an odd offset
    rev = lambda j: sl(n - 1 - j)
    for s, inp in ((11, "outs[me]"), (12, "t[mine]"), (13, "odd")):
        t = A(np.zeros(n * k + off, dtype))
        outs = [t[rev(j)] for j in range(n)]
        src = outs[me] if inp == "outs[me]" else t[sl(me)] if inp == "t[mine]" else t[off:off + k]
        src[...] = G(me, k, s)
        dist.all_gather(outs, src, group=group)
        bad.expect(case(s, f"all_gather(reversed views of t, {inp})"), t[:n * k],
                   np.concatenate([G(n - 1 - j, k, s) for j in range(n)]))

    # 5 gather to the last member: the root's list is reversed views of one buffer,
    #   its input its own entry, another entry, an odd offset
    root = n - 1
    for s, inp in ((14, "list[me]"), (15, "t[mine]"), (16, "odd")):
        t = A(np.zeros(n * k + off, dtype))
        if me == root:
            glist = [t[rev(j)] for j in range(n)]
            src = glist[me] if inp == "list[me]" else t[sl(me)] if inp == "t[mine]" else t[off:off + k]
        else:
            glist, src = None, t[sl(me)]
        src[...] = G(me, k, s)
        dist.gather(src, glist, dst=gl[root], group=group)
        if me == root:
            bad.expect(case(s, f"gather(reversed views of t, {inp}) at the root"), t[:n * k],
                       np.concatenate([G(n - 1 - j, k, s) for j in range(n)]))

    # 6 scatter from member 0: its list is reversed views of one buffer, its output
    #   the slot list[n-1], its own entry list[0], an odd offset
    for s, outp in ((17, "list[n-1]"), (18, "list[0]"), (19, "odd")):
        t = A(G(me, n * k + off, s))
        if me == 0:
            slist = [t[rev(j)] for j in range(n)]
            out = slist[n - 1] if outp == "list[n-1]" else slist[0] if outp == "list[0]" else t[off:off + k]
        else:
            slist, out = None, t[sl(me)]
        dist.scatter(out, slist, src=gl[0], group=group)
        bad.expect(case(s, f"scatter(out={outp}, reversed views)"), out, G(0, n * k + off, s)[rev(me)])

    # 7 reduce_scatter (list): reversed views; output its own entry, my slot, an odd offset
    for s, outp in ((20, "list[me]"), (21, "t[mine]"), (22, "odd")):
        t = A(G(me, n * k + off, s))
        ilist = [t[rev(j)] for j in range(n)]
        out = ilist[me] if outp == "list[me]" else t[sl(me)] if outp == "t[mine]" else t[off:off + k]
        dist.reduce_scatter(out, ilist, op=op, group=group)
        bad.expect(case(s, f"reduce_scatter(out={outp}, reversed views)"), out,
                   fold([G(r, n * k + off, s)[rev(me)] for r in range(n)], dtype, opname))

    # 8 all_to_all (list): inputs in order, outputs reversed views of the same buffer; outputs
    #   shifted by an odd offset
    t = A(G(me, n * k, 23))
    dist.all_to_all([t[rev(j)] for j in range(n)], [t[sl(j)] for j in range(n)], group=group)
    bad.expect(case(23, "all_to_all(outs=reversed views, ins=views)"), t,
               np.concatenate([G(n - 1 - j, n * k, 23)[sl(me)] for j in range(n)]))
    base = A(np.zeros(n * k + off, dtype))
    base[:n * k] = G(me, n * k, 24)
    dist.all_to_all([base[off + j * k: off + (j + 1) * k] for j in range(n)], [base[sl(j)] for j in range(n)],
                    group=group)
    bad.expect(case(24, f"all_to_all(outs shifted by {off})"), base[off:off + n * k],
               np.concatenate([G(j, n * k, 24)[sl(me)] for j in range(n)]))

    # 9 reduce to the last member, of a view at an odd offset of a bigger buffer
    t = A(G(me, k + off + 1, 25))
    v = t[off:off + k]
    dist.reduce(v, dst=gl[root], op=op, group=group)
    if me == root:
        bad.expect(case(25, "reduce(t[odd:], dst=last)"), v, fold([G(r, k + off + 1, 25)[off:off + k]
                                                                   for r in range(n)], dtype, opname))

    # 10 all_to_all_single in place on rows of a 2-D array (Fortran order where the memory is
    #    not plain: not C-contiguous), uneven symmetric row splits
    w, k2 = 3, max(1, k // 3)
    sym2 = lambda i, j: k2 * ((i + j) % 3) // 2 + (i + j) % 2
    at2 = lambda r, j: sum(sym2(r, x) for x in range(j))
    x2 = lambda r: G(r, at2(r, n) * w, 26).reshape(-1, w)
    # (the other byte order too: such an array moved its bytes in Fortran order once, see
    # test_fortran_order_arrays_of_the_other_byte_order below)
    fortran = memory != "plain"
    t2 = np.asfortranarray(x2(me)) if fortran else x2(me).copy()
    sizes2 = [sym2(me, j) for j in range(n)]
    dist.all_to_all_single(t2, t2, sizes2, sizes2, group=group)
    bad.expect(case(26, f"all_to_all_single(t2d, t2d, {sizes2}, {sizes2})"), t2,
               np.concatenate([x2(j)[at2(j, me):at2(j, me) + sym2(j, me)] for j in range(n)]))


def numpy_matrix(rank, world_size, init_method, plan, subgroup, memory="plain"):
    """``plan``: [(piece bytes, [dtypes])]; ``subgroup``: also run every case on
    a group of every rank but rank 1 (non-contiguous global ranks); ``memory``:
    the kind of the shared buffers (``holder``)."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    groups = [(None, list(range(world_size)), "default group")]
    if subgroup:
        ranks_ = [r for r in range(world_size) if r != 1]
        groups.append((dist.new_group(ranks_), ranks_, f"group {ranks_}"))
    bad = Bad(rank)
    salt = 0
    for group, gl, what in groups:
        if rank not in gl:
            continue
        n, me = len(gl), gl.index(rank)
        assert dist.get_rank(group) == me and dist.get_world_size(group) == n
        for nbytes, dtypes in plan:
            for dtype in dtypes:
                salt += 1
                k = max(1, nbytes // np.dtype(dtype).itemsize)
                _alias_cases(bad, group, gl, n, me, k, dtype, salt, f"{what}, {memory} memory", memory)
    dist.barrier()
    dist.destroy_process_group()
    return list(bad)


def _check(results) -> None:
    problems = [p for r in results for p in r]
    assert not problems, f"{len(problems)} mismatches:\n" + "\n".join(problems[:25])


PLAN_2 = [(8, ["float32", "int64", ">f4"]), (4 * KIB, ["float32", ">i8", "bool"]), (64 * KIB, ["float64", "int8"]),
          (300 * KIB, ["float32", ">f4"]), (1 * MIB, ["int32"]), (3 * MIB, ["float32"])]
PLAN_3 = [(8, ["float32", ">i8"]), (4 * KIB, ["int64", "complex64"]), (64 * KIB, ["float32", ">c16"]),
          (300 * KIB, ["int64"]), (1 * MIB, ["float32"]), (3 * MIB, ["int32"])]
PLAN_4 = [(8, ["int32"]), (4 * KIB, ["float32"]), (64 * KIB, [">f4"]), (300 * KIB, ["float64"]), (1 * MIB, ["int64"])]
PLAN_SMALL_ARENA = [(8, ["float32"]), (4 * KIB, ["int64"]), (64 * KIB + 4, ["float32", ">i8"]), (300 * KIB, ["float32"])]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size, plan", [(2, PLAN_2), (3, PLAN_3), (4, PLAN_4)], ids=["2 ranks", "3 ranks",
                                                                                          "4 ranks"])
def test_numpy_aliasing_at_every_size_default_group_and_subgroup(run_ranks, world_size, plan):
    _check(run_ranks(numpy_matrix, world_size, plan, world_size > 2, timeout=140))


@pytest.mark.timeout(150)
def test_numpy_aliasing_through_a_small_arena_many_rounds(run_ranks):
    """16 KiB buffers: every piece above takes many rounds (and odd last rounds)."""
    _check(run_ranks(numpy_matrix, 3, PLAN_SMALL_ARENA, True, timeout=140,
                     env={"SHMDIST_ARENA_BYTES": "16384"}))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("memory", ["strided", "reversed", "shared"])
def test_numpy_aliasing_in_strided_reversed_and_shared_memory(run_ranks, memory):
    """The buffers the inputs and outputs share are every other element of a
    buffer, a negative-stride view, or shmdist.empty memory (ordinary memory
    for these collectives, README)."""
    plan = [(8, ["float32"]), (4 * KIB, ["int64"]), (300 * KIB, ["float32"]), (1 * MIB, ["int32"])]
    if memory != "shared":
        plan[1] = (4 * KIB, ["int64", ">f8"])
    _check(run_ranks(numpy_matrix, 3, plan, True, memory, timeout=140))


@pytest.mark.timeout(150)
def test_numpy_aliasing_across_pretend_hosts_at_larger_sizes(run_ranks):
    """4 ranks on 2 pretend hosts (hierarchical engine: shared memory inside a
    host, point to point between them), a subgroup spanning both."""
    from test_multihost import on_pretend_host
    plan = [(8, ["int64"]), (300 * KIB, ["float32"]), (1 * MIB, [">i8"])]
    _check(run_ranks(on_pretend_host, 4, "interleaved", numpy_matrix, plan, True, timeout=140))


@pytest.mark.timeout(150)
def test_numpy_aliasing_over_tcp_hierarchical_engine(run_ranks):
    """Every rank its own node: the collectives of comm/hier.py, point to point."""
    plan = [(8, ["float32"]), (4 * KIB, [">i8"]), (300 * KIB, ["float32"])]
    _check(run_ranks(numpy_matrix, 3, plan, False, timeout=140, env={"SHMDIST_TRANSPORT": "tcp"}))


def big_in_place(rank, world_size, init_method):
    """17 MiB pieces: the three in-place idioms once each."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    n, me, k = world_size, rank, (17 * MIB) // 4
    bad = Bad(rank)
    sl = lambda j: slice(j * k, (j + 1) * k)
    t = np.zeros(n * k, "float32")
    t[sl(me)] = F(me, k, "float32", 1)
    dist.all_gather_into_tensor(t, t[sl(me)])
    bad.expect("all_gather_into_tensor(t, t[mine]) 17 MiB", t, np.concatenate([F(j, k, "float32", 1) for j in range(n)]))
    t = F(me, n * k, "float32", 2)
    dist.reduce_scatter_tensor(t[sl(me)], t)
    bad.expect("reduce_scatter_tensor(t[mine], t) 17 MiB", t[sl(me)],
               fold([F(r, n * k, "float32", 2)[sl(me)] for r in range(n)], "float32", "sum"))
    t = F(me, n * k, "float32", 3)
    dist.all_to_all_single(t, t)
    bad.expect("all_to_all_single(t, t) 17 MiB", t, np.concatenate([F(j, n * k, "float32", 3)[sl(me)] for j in range(n)]))
    dist.destroy_process_group()
    return list(bad)


@pytest.mark.timeout(120)
def test_seventeen_mib_in_place_idioms(run_ranks):
    _check(run_ranks(big_in_place, 2, timeout=110))


# ---------------------------------------------------------------- numpy: unaligned and byte-swapped

def unaligned(count: int, dtype, fill) -> np.ndarray:
    """An array of ``count`` elements of ``dtype`` at an address 1 byte past an alignment."""
    dt = np.dtype(dtype)
    raw = np.zeros(count * dt.itemsize + 16, np.uint8)
    a = raw[1:1 + count * dt.itemsize].view(dt)
    a[...] = fill
    return a


def odd_memory(rank, world_size, init_method):
    """Arrays at an unaligned address (numpy allows them, C kernels may not) and
    arrays of the other byte order, through the reductions and the in-place idioms."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    n, me = world_size, rank
    bad = Bad(rank)
    for nbytes in (8, 4 * KIB, 64 * KIB, 300 * KIB, 1 * MIB):
        for dtype in ("float64", "int64", "float32", ">f8", ">i4", "<f4"):
            salt = nbytes % 997
            k = max(1, nbytes // np.dtype(dtype).itemsize)
            tag = f"unaligned {np.dtype(dtype).str}[{k}] n={n}"
            sl = lambda j: slice(j * k, (j + 1) * k)
            a = unaligned(n * k, dtype, F(me, n * k, dtype, salt))
            assert not a.flags.aligned or np.dtype(dtype).itemsize == 1
            dist.all_reduce(a)
            bad.expect(f"all_reduce ({tag})", a, fold([F(r, n * k, dtype, salt) for r in range(n)], dtype, "sum"))
            a = unaligned(n * k, dtype, F(me, n * k, dtype, salt + 1))
            dist.broadcast(a, src=n - 1)
            bad.expect(f"broadcast ({tag})", a, F(n - 1, n * k, dtype, salt + 1))
            a = unaligned(n * k, dtype, F(me, n * k, dtype, salt + 2))
            dist.reduce_scatter_tensor(a[sl(me)], a)
            bad.expect(f"reduce_scatter_tensor(t[mine], t) ({tag})", a[sl(me)],
                       fold([F(r, n * k, dtype, salt + 2)[sl(me)] for r in range(n)], dtype, "sum"))
            a = unaligned(n * k, dtype, 0)
            a[sl(me)] = F(me, k, dtype, salt + 3)
            dist.all_gather_into_tensor(a, a[sl(me)])
            bad.expect(f"all_gather_into_tensor(t, t[mine]) ({tag})", a,
                       np.concatenate([F(j, k, dtype, salt + 3) for j in range(n)]))
            a = unaligned(n * k, dtype, F(me, n * k, dtype, salt + 4))
            dist.all_to_all_single(a, a)
            bad.expect(f"all_to_all_single(t, t) ({tag})", a,
                       np.concatenate([F(j, n * k, dtype, salt + 4)[sl(me)] for j in range(n)]))
            a = unaligned(k, dtype, F(me, k, dtype, salt + 5))
            dist.reduce(a, dst=0, op=dist.ReduceOp.MAX)
            if me == 0:
                bad.expect(f"reduce MAX ({tag})", a, functools.reduce(np.maximum, [F(r, k, dtype, salt + 5)
                                                                                  for r in range(n)]))
    dist.destroy_process_group()
    return list(bad)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_unaligned_and_byte_swapped_numpy_arrays(run_ranks, world_size):
    _check(run_ranks(odd_memory, world_size, timeout=110))


# ---------------------------------------------------------------- torch: dtypes and layouts

def _torch_dtypes(torch) -> list:
    """(torch dtype, reducible) for every CPU dtype torch has of the README's kinds."""
    names = ["bfloat16", "float16", "float32", "float64", "complex64", "complex128", "bool", "uint8", "int8",
             "int16", "int32", "int64", "uint16", "uint32", "uint64"]
    out = [(getattr(torch, nm), True) for nm in names if hasattr(torch, nm)]
    out += [(getattr(torch, nm), False) for nm in ("float8_e4m3fn", "float8_e5m2", "complex32")
            if hasattr(torch, nm)]
    return out


_TVALS: dict = {}


def tvals(torch, r: int, count: int, dtype, salt: int):
    """Rank ``r``'s torch values of ``dtype`` (from the same small integers), a fresh tensor."""
    key = (r, count, dtype, salt)
    kept = _TVALS.get(key)
    if kept is None:
        if len(_TVALS) > 256:
            _TVALS.clear()
        kept = _TVALS[key] = _tvals(torch, r, count, dtype, salt)
    return kept.clone()


def _tvals(torch, r: int, count: int, dtype, salt: int):
    x = torch.from_numpy(ints(r, count, salt))
    if dtype == torch.bool:
        return x % 3 == 0
    if dtype.is_complex:
        c = torch.complex(x.double(), ((x * 3) % 17).double())
        return c.to(dtype)
    return x.to(torch.float32).to(dtype) if dtype.is_floating_point else x.to(dtype)


def as_np(torch, t) -> np.ndarray:
    """A tensor's values as numpy, comparable exactly (bit for bit where numpy lacks the dtype)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    if t.dtype.itemsize and t.dtype in (getattr(torch, nm, None) for nm in
                                         ("float8_e4m3fn", "float8_e5m2", "complex32")):
        bits = {1: torch.uint8, 4: torch.int32}[t.dtype.itemsize]
        return t.reshape(-1).view(bits).numpy().reshape(tuple(t.shape))
    return t.numpy()


def tsum(torch, tensors, dtype):
    """The reduction of separate buffers: SUM (BOR for bool), in rank order, exact here."""
    if dtype == torch.bool:
        return functools.reduce(torch.logical_or, tensors)
    if not dtype.is_floating_point and not dtype.is_complex:     # (unsigned too: through int64)
        return functools.reduce(lambda a, b: a + b, [x.to(torch.int64) for x in tensors]).to(dtype)
    return functools.reduce(lambda a, b: a + b, [x.to(torch.complex128 if dtype.is_complex else torch.float64)
                                                 for x in tensors]).to(dtype)


def torch_matrix(rank, world_size, init_method, counts, only=None):
    """``counts``: elements per piece; ``only``: the names of the dtypes to take (None: all)."""
    torch = __import__("torch")
    import warnings
    warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    n, me = world_size, rank
    bad = Bad(rank)
    expect = lambda name, got, want: bad.expect(name, as_np(torch, got), as_np(torch, want))
    salt = 0
    for dtype, reducible in _torch_dtypes(torch):
        if only is not None and str(dtype).rpartition(".")[2] not in only:
            continue
        op = dist.ReduceOp.BOR if dtype == torch.bool else dist.ReduceOp.SUM
        for k in counts:
            salt += 10
            tag = f"{dtype}[{k}] n={n}"
            V = lambda r, count, s: tvals(torch, r, count, dtype, salt + s)
            sl = lambda j: slice(j * k, (j + 1) * k)
            rev = lambda j: sl(n - 1 - j)

            # contiguous in-place idioms
            t = torch.zeros(n * k, dtype=dtype)
            t[sl(me)] = V(me, k, 1)
            dist.all_gather_into_tensor(t, t[sl(me)])
            expect(f"all_gather_into_tensor(t, t[mine]) {tag}", t, torch.cat([V(j, k, 1) for j in range(n)]))
            t = V(me, n * k, 2)
            dist.all_to_all_single(t, t)
            expect(f"all_to_all_single(t, t) {tag}", t, torch.cat([V(j, n * k, 2)[sl(me)] for j in range(n)]))
            sizes = [k * ((me + j) % 3) // 2 + 1 for j in range(n)]      # symmetric, uneven
            rows = lambda r: sum(k * ((r + j) % 3) // 2 + 1 for j in range(n))
            at = lambda r, j: sum(k * ((r + x) % 3) // 2 + 1 for x in range(j))
            t = V(me, rows(me), 3)
            dist.all_to_all_single(t, t, sizes, sizes)
            expect(f"all_to_all_single(t, t, uneven {sizes}) {tag}", t,
                   torch.cat([V(j, rows(j), 3)[at(j, me):at(j, me) + sizes[j]] for j in range(n)]))
            t = torch.zeros(n * k, dtype=dtype)
            outs = [t[rev(j)] for j in range(n)]
            outs[me].copy_(V(me, k, 4))
            dist.all_gather(outs, outs[me])
            expect(f"all_gather(reversed views, outs[me]) {tag}", t, torch.cat([V(n - 1 - j, k, 4) for j in range(n)]))
            t = V(me, n * k, 5)
            dist.all_to_all([t[rev(j)] for j in range(n)], [t[sl(j)] for j in range(n)])
            expect(f"all_to_all(outs reversed views of ins) {tag}", t,
                   torch.cat([V(n - 1 - j, n * k, 5)[sl(me)] for j in range(n)]))
            t = V(me, n * k, 6)
            slist = [t[rev(j)] for j in range(n)] if me == 0 else None
            out = slist[n - 1] if me == 0 else t[sl(me)]
            dist.scatter(out, slist, src=0)
            expect(f"scatter(out=list[n-1]) {tag}", out, V(0, n * k, 6)[rev(me)])
            t = torch.zeros(n * k, dtype=dtype)
            t[sl(me)] = V(me, k, 7)
            glist = [t[rev(j)] for j in range(n)] if me == n - 1 else None
            dist.gather(t[sl(me)], glist, dst=n - 1)
            if me == n - 1:
                expect(f"gather(t[mine], reversed views) {tag}", t, torch.cat([V(n - 1 - j, k, 7) for j in range(n)]))
            if reducible:
                t = V(me, n * k, 8)
                dist.reduce_scatter_tensor(t[sl(me)], t, op=op)
                expect(f"reduce_scatter_tensor(t[mine], t) {tag}", t[sl(me)],
                       tsum(torch, [V(r, n * k, 8)[sl(me)] for r in range(n)], dtype))
                t = V(me, n * k + 1, 9)
                dist.reduce_scatter_tensor(t[1:k + 1], t[:n * k], op=op)
                expect(f"reduce_scatter_tensor(t[1:k+1], t[:nk]) {tag}", t[1:k + 1],
                       tsum(torch, [V(r, n * k + 1, 9)[sl(me)] for r in range(n)], dtype))
                t = V(me, n * k, 10)
                ilist = [t[rev(j)] for j in range(n)]
                dist.reduce_scatter(ilist[me], ilist, op=op)
                expect(f"reduce_scatter(list[me], reversed views) {tag}", t[rev(me)],
                       tsum(torch, [V(r, n * k, 10)[rev(me)] for r in range(n)], dtype))
                t = V(me, k, 11)
                dist.all_reduce(t, op=op)
                expect(f"all_reduce {tag}", t, tsum(torch, [V(r, k, 11) for r in range(n)], dtype))

            # strided (every other element) buffers: the in-place idioms, inputs and outputs strided
            raw = torch.zeros(2 * n * k, dtype=dtype)
            t = raw[::2]
            t[sl(me)] = V(me, k, 12)
            dist.all_gather_into_tensor(t, t[sl(me)])
            expect(f"strided all_gather_into_tensor(t, t[mine]) {tag}", t, torch.cat([V(j, k, 12) for j in range(n)]))
            if raw.numel():
                expect(f"strided all_gather_into_tensor leaves the gaps {tag}", raw[1::2], torch.zeros(n * k, dtype=dtype))
            raw = torch.zeros(2 * n * k, dtype=dtype)
            t = raw[::2]
            t.copy_(V(me, n * k, 13))
            dist.all_to_all_single(t, t)
            expect(f"strided all_to_all_single(t, t) {tag}", t, torch.cat([V(j, n * k, 13)[sl(me)] for j in range(n)]))
            if reducible:
                raw = torch.zeros(2 * n * k, dtype=dtype)
                t = raw[::2]
                t.copy_(V(me, n * k, 14))
                dist.reduce_scatter_tensor(t[sl(me)], t, op=op)
                expect(f"strided reduce_scatter_tensor(t[mine], t) {tag}", t[sl(me)],
                       tsum(torch, [V(r, n * k, 14)[sl(me)] for r in range(n)], dtype))
            # transposed: output (n, k) as the transpose of a (k, n) buffer; columns as list entries
            buf = torch.zeros(k, n, dtype=dtype)
            out = buf.t()
            dist.all_gather_into_tensor(out, V(me, k, 15))
            expect(f"transposed output all_gather_into_tensor {tag}", out,
                   torch.stack([V(j, k, 15) for j in range(n)]))
            buf = torch.zeros(k, n, dtype=dtype)
            cols = [buf[:, n - 1 - j] for j in range(n)]
            cols[me].copy_(V(me, k, 16))
            dist.all_gather(cols, cols[me])
            expect(f"all_gather into reversed columns, input its own column {tag}", buf,
                   torch.stack([V(n - 1 - j, k, 16) for j in range(n)], dim=1))
            src2 = V(me, n * k, 17).reshape(k, n)          # rows of my input: the transpose's rows
            out2 = torch.zeros(k, n, dtype=dtype).t()      # (n, k), not contiguous
            dist.all_to_all_single(out2, src2.t())
            expect(f"transposed all_to_all_single {tag}", out2,
                   torch.stack([V(j, n * k, 17).reshape(k, n).t()[me] for j in range(n)]))

            # 0-d and empty
            z = V(me, 1, 18).reshape(())
            outs = [torch.zeros((), dtype=dtype) for _ in range(n)]
            dist.all_gather(outs, z)
            expect(f"all_gather of 0-d {tag}", torch.stack(outs), torch.stack([V(j, 1, 18).reshape(()) for j in range(n)]))
            z = V(me, 1, 19).reshape(())
            dist.broadcast(z, src=n - 1)
            expect(f"broadcast of 0-d {tag}", z, V(n - 1, 1, 19).reshape(()))
            if reducible:
                z = V(me, 1, 20).reshape(())
                dist.all_reduce(z, op=op)
                expect(f"all_reduce of 0-d {tag}", z, tsum(torch, [V(r, 1, 20).reshape(()) for r in range(n)], dtype))
                zl = [V(me, 1, 21 + j).reshape(()) for j in range(n)]
                dist.reduce_scatter(zl[me], zl, op=op)
                expect(f"reduce_scatter of 0-d, in place {tag}", zl[me],
                       tsum(torch, [V(r, 1, 21 + me).reshape(()) for r in range(n)], dtype))
            e = torch.zeros(0, dtype=dtype)
            dist.all_gather_into_tensor(e, e)
            dist.all_to_all_single(e, e)
            dist.all_gather([torch.zeros(0, dtype=dtype) for _ in range(n)], e)
            if reducible:
                dist.reduce_scatter_tensor(e, e, op=op)
                dist.all_reduce(e, op=op)
            expect(f"empty tensors {tag}", e, torch.zeros(0, dtype=dtype))
            x = torch.zeros(3, dtype=dtype)                  # the group is still in step after them
            x[0] = V(me, 1, 22)[0]
            dist.broadcast(x, src=0)
            expect(f"broadcast after the empty ones {tag}", x, torch.cat([V(0, 1, 22), torch.zeros(2, dtype=dtype)]))
    dist.destroy_process_group()
    return list(bad)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size, counts, only", [
    (3, (3, 40_000), None),
    (2, (1, 700_000), ("bfloat16", "complex64", "bool", "uint64", "float8_e4m3fn")),
], ids=["3 ranks every dtype 3 and 40000 elements", "2 ranks 700000 elements"])
def test_torch_dtypes_and_layouts_aliased(run_ranks, world_size, counts, only):
    pytest.importorskip("torch")
    _check(run_ranks(torch_matrix, world_size, counts, only, timeout=140))


def torch_views(rank, world_size, init_method, k):
    """Lazily conjugated and negated views, and tensors that require grad, as
    inputs and outputs of the aliased idioms (no torch.no_grad anywhere)."""
    torch = __import__("torch")
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    n, me = world_size, rank
    bad = Bad(rank)
    expect = lambda name, got, want: bad.expect(name, as_np(torch, got), as_np(torch, want))
    sl = lambda j: slice(j * k, (j + 1) * k)
    for dtype in (torch.complex64, torch.complex128):
        V = lambda r, count, s: tvals(torch, r, count, dtype, s)
        tag = f"{dtype}[{k}] n={n}"
        # conj view as input, over my own slot of the output
        t = torch.zeros(n * k, dtype=dtype)
        t[sl(me)] = V(me, k, 1)
        dist.all_gather_into_tensor(t, t[sl(me)].conj())
        expect(f"all_gather_into_tensor(t, t[mine].conj()) {tag}", t, torch.cat([V(j, k, 1).conj() for j in range(n)]))
        # conj view as output and input: all_to_all_single(t.conj(), t.conj())
        t = V(me, n * k, 2)
        c = t.conj()
        dist.all_to_all_single(c, c)
        want = torch.cat([V(j, n * k, 2).conj()[sl(me)] for j in range(n)])
        expect(f"all_to_all_single(t.conj(), t.conj()) shows {tag}", c, want)
        expect(f"all_to_all_single(t.conj(), t.conj()) memory {tag}", t, want.conj())
        # reduce_scatter_tensor into a conj view of my own chunk
        t = V(me, n * k, 3)
        dist.reduce_scatter_tensor(t[sl(me)].conj(), t)
        want = tsum(torch, [V(r, n * k, 3)[sl(me)] for r in range(n)], dtype)
        expect(f"reduce_scatter_tensor(t[mine].conj(), t) {tag}", t[sl(me)], want.conj())
        # reduce_scatter_tensor from a conj view into my own chunk
        t = V(me, n * k, 4)
        dist.reduce_scatter_tensor(t[sl(me)], t.conj())
        expect(f"reduce_scatter_tensor(t[mine], t.conj()) {tag}", t[sl(me)],
               tsum(torch, [V(r, n * k, 4)[sl(me)] for r in range(n)], dtype).conj())
        # negated views: imag of a conj view has the negative bit
        t = V(me, n * k, 5)
        neg = t.conj().imag
        assert neg.is_neg()
        dist.all_to_all_single(neg, neg)
        want = torch.cat([(-V(j, n * k, 5).imag)[sl(me)] for j in range(n)])
        expect(f"all_to_all_single(neg, neg) shows {tag}", neg, want)
        expect(f"all_to_all_single(neg, neg) memory {tag}", t.imag, -want)
        t = V(me, n * k, 6)
        neg = t.conj().imag
        dist.all_gather_into_tensor(neg, neg[sl(me)].clone())      # output negated, input separate
        want = torch.cat([(-V(j, n * k, 6).imag)[sl(j)] for j in range(n)])
        expect(f"all_gather_into_tensor(neg view, ...) {tag}", t.imag, -want)
        t = V(me, n * k, 7)
        neg = t.conj().imag
        dist.all_reduce(neg)
        expect(f"all_reduce(neg view) {tag}", t.imag, -tsum(torch, [-V(r, n * k, 7).imag for r in range(n)],
                                                             neg.dtype))
        t = V(me, k, 8)
        c = t.conj()
        dist.broadcast(c, src=n - 1)
        expect(f"broadcast(conj view) {tag}", t, V(n - 1, k, 8))
    # real negated views (torch._neg_view) where torch has it
    if hasattr(torch, "_neg_view"):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            V = lambda r, count, s: tvals(torch, r, count, dtype, s)
            tag = f"{dtype}[{k}] n={n}"
            t = V(me, n * k, 9)
            neg = torch._neg_view(t)
            dist.reduce_scatter_tensor(neg[sl(me)], neg)
            want = tsum(torch, [-V(r, n * k, 9)[sl(me)] for r in range(n)], dtype)
            expect(f"reduce_scatter_tensor(neg[mine], neg) {tag}", t[sl(me)], -want)
            t = V(me, n * k, 10)
            neg = torch._neg_view(t)
            dist.all_to_all_single(neg, neg)
            expect(f"all_to_all_single(neg, neg) {tag}", t, torch.cat([V(j, n * k, 10)[sl(me)] for j in range(n)]))
    # tensors that require grad, as outputs and inputs of the in-place idioms, no no_grad()
    for dtype in (torch.float32, torch.bfloat16, torch.complex64):
        V = lambda r, count, s: tvals(torch, r, count, dtype, s)
        tag = f"{dtype}[{k}] n={n}"
        leaf = torch.zeros(n * k, dtype=dtype, requires_grad=True)
        with torch.no_grad():
            leaf[sl(me)] = V(me, k, 11)
        dist.all_gather_into_tensor(leaf, leaf[sl(me)])
        expect(f"grad leaf all_gather_into_tensor(t, t[mine]) {tag}", leaf, torch.cat([V(j, k, 11) for j in range(n)]))
        leaf = V(me, n * k, 12).requires_grad_()
        dist.all_to_all_single(leaf, leaf)
        expect(f"grad leaf all_to_all_single(t, t) {tag}", leaf, torch.cat([V(j, n * k, 12)[sl(me)] for j in range(n)]))
        leaf = V(me, n * k, 13).requires_grad_()
        dist.reduce_scatter_tensor(leaf[sl(me)], leaf)
        expect(f"grad leaf reduce_scatter_tensor(t[mine], t) {tag}", leaf[sl(me)],
               tsum(torch, [V(r, n * k, 13)[sl(me)] for r in range(n)], dtype))
        p = torch.nn.Parameter(V(me, n * k, 14))
        pieces = list(p.split(k))
        dist.reduce_scatter(pieces[me], pieces)
        expect(f"Parameter reduce_scatter(list[me], its split) {tag}", p[sl(me)],
               tsum(torch, [V(r, n * k, 14)[sl(me)] for r in range(n)], dtype))
        base = torch.ones(n * k, dtype=dtype, requires_grad=True)
        nonleaf = base * V(me, n * k, 15)
        dist.all_to_all_single(nonleaf, nonleaf)
        expect(f"non-leaf all_to_all_single(t, t) {tag}", nonleaf,
               torch.cat([V(j, n * k, 15)[sl(me)] for j in range(n)]))
        p = torch.nn.Parameter(torch.zeros(n * k, dtype=dtype))
        slist = [V(0, n * k, 16)[sl(j)] for j in range(n)] if me == 0 else None
        dist.scatter(p[sl(me)], slist, src=0)
        expect(f"scatter into a Parameter's slice {tag}", p[sl(me)], V(0, n * k, 16)[sl(me)])
    dist.destroy_process_group()
    return list(bad)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size, k", [(3, 5), (2, 80_000)], ids=["3 ranks small", "2 ranks 640KiB"])
def test_torch_conj_neg_and_grad_views_aliased(run_ranks, world_size, k):
    pytest.importorskip("torch")
    _check(run_ranks(torch_views, world_size, k, timeout=140))


# ---------------------------------------------------------------- a fault found and fixed: Fortran order + other byte order

def fortran_swapped(rank, world_size, init_method):
    """Arrays of the other byte order that are dense but not C-ordered (Fortran
    order, a transpose): what each collective gives, against separate C buffers."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    n, me = world_size, rank
    bad = Bad(rank)
    vals = lambda r: (np.arange(6) + 10 * r).reshape(2, 3)
    # the root sends a Fortran-order '>f8' array; the others receive into plain C arrays
    a = np.asfortranarray(vals(0).astype(">f8")) if me == 0 else np.zeros((2, 3))
    dist.broadcast(a, src=0)
    bad.expect("broadcast from a Fortran-order >f8 array", a, vals(0))
    # the receivers are Fortran-order '>f8' arrays, the root a plain one
    a = vals(1).astype("float64") if me == 0 else np.asfortranarray(np.zeros((2, 3), ">f8"))
    dist.broadcast(a, src=0)
    bad.expect("broadcast into a Fortran-order >f8 array", a, vals(1))
    # all_gather_into_tensor from the transpose of a C-order '>i4' array (dense, not C-ordered)
    src = vals(me).astype(">i4").T
    out = np.zeros((3 * n, 2), "int32")
    dist.all_gather_into_tensor(out, src)
    bad.expect("all_gather_into_tensor of a transposed >i4 array", out, np.concatenate([vals(j).T for j in range(n)]))
    # all_to_all_single in place on a Fortran-order '>f8' array: rows go to the ranks
    t = np.asfortranarray((np.arange(3 * n) + 100 * me).reshape(n, 3).astype(">f8"))
    dist.all_to_all_single(t, t)
    bad.expect("all_to_all_single(t, t) on a Fortran-order >f8 array", t,
               np.stack([(np.arange(3 * n) + 100 * j).reshape(n, 3)[me] for j in range(n)]))
    # point to point, both ends Fortran-order '>f8' arrays, then a C-order receiver
    if me == 0:
        dist.send(np.asfortranarray(vals(2).astype(">f8")), 1).wait()
        dist.send(np.asfortranarray(vals(3).astype(">f8")), 1).wait()
    elif me == 1:
        a = np.asfortranarray(np.zeros((2, 3), ">f8"))
        dist.recv(a, 0).wait()
        bad.expect("send/recv between Fortran-order >f8 arrays", a, vals(2))
        a = np.zeros((2, 3))
        dist.recv(a, 0).wait()
        bad.expect("send of a Fortran-order >f8 array into a C-order one", a, vals(3))
    dist.destroy_process_group()
    return list(bad)


@pytest.mark.timeout(60)
def test_fortran_order_arrays_of_the_other_byte_order(run_ranks):
    """A non-native byte order array that is not C-ordered (Fortran order, a transpose) moved its
    bytes in its own memory order (tensors._numpy_buf's astype kept order 'K' and the copy's bytes
    were taken as C order): transposed values, no error. Fails on the code before 'order="C"'."""
    _check(run_ranks(fortran_swapped, 2, timeout=50))

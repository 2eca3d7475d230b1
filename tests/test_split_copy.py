"""Big messages as single copies straight between the members' arrays
(comm/arena.py, "two members, single copies"). Two members: broadcast's
root writes the first half into the other's array while the other reads
the second half; all_reduce's members each reduce half of the elements,
reading the other's chunk and writing the result back; from
SHMDIST_SINGLE_COPY bytes, at least 1 MiB (all_reduce: above its one-phase
size too). Three or more: a broadcast from 4 MiB is read in chunks from the
root's array by each other member, the root writing chunks too where the
readers outnumber its CPUs. Only where the probe at init let each reach the
memory it copies from.

Bit-exact results around the sizes where the path starts and where its
chunks end, every dtype and op it takes, odd lengths, both roots, a pair
inside a bigger world, strided torch tensors; that the path was really
taken (its copies counted in the ranks); the fallbacks (the knob at 0, a
probe refused, a copy that fails in the middle of a call) and a member
that dies inside one."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import shmdist as dist
from test_collectives import HAVE_TORCH, Case, assert_all_good, available, run_cases

THRESHOLD = 1 << 20        # arena.PAIR_SPLIT_MIN: SHMDIST_SINGLE_COPY below it counts as it
# always the single copies, never the arena's buffers for a class the pair timed faster there (test_pair_paths.py)
ENV = {"SHMDIST_SINGLE_COPY": str(64 << 10), "SHMDIST_PAIR_CHOOSE": "0"}
CHOOSE_OFF = {"SHMDIST_PAIR_CHOOSE": "0"}
PAIR_SMALL = 512 << 10      # arena.SMALL_ALLREDUCE_PAIR: all_reduce up to this stays one phase
CHUNK = 256 << 10           # arena.SPLIT_CHUNK


def count_copies():
    """Count the single copies of at least 4 KiB this rank makes from now on (_core's three
    functions, wrapped; the probe at init reads 8 bytes): a chunked copy (cma_claim) counts
    once per call, as a read or a write."""
    from shmdist import _core
    seen = {"read": 0, "write": 0}
    read, write, claim = _core.cma_read, _core.cma_write, _core.cma_claim

    def counted_read(pid, dst, src, n):
        seen["read"] += n >= 4096
        return read(pid, dst, src, n)

    def counted_write(pid, dst, src, n):
        seen["write"] += n >= 4096
        return write(pid, dst, src, n)

    def counted_claim(counter, chunks, chunk, pid, local, remote, n, writes, one):
        seen["write" if writes else "read"] += n >= 4096
        return claim(counter, chunks, chunk, pid, local, remote, n, writes, one)
    _core.cma_read, _core.cma_write, _core.cma_claim = counted_read, counted_write, counted_claim
    return seen


def pair_cases(first_seed=0) -> tuple[list[Case], int]:
    """Sizes on both sides of where each path starts and of its chunk edges, odd lengths;
    and how many of them the pair does as single copies."""
    cases, seed = [], first_seed
    for dtype, ops in (("float32", ("SUM", "PRODUCT")), ("float64", ("SUM",)), ("int32", ("MIN", "SUM")),
                       ("int64", ("MAX", "PRODUCT")), ("float16", ("SUM", "AVG", "PRODUCT")),
                       ("bfloat16", ("SUM", "AVG"))):
        isz = 2 if dtype in ("float16", "bfloat16") else np.dtype(dtype).itemsize
        counts = (PAIR_SMALL // isz + 1, (PAIR_SMALL + CHUNK) // isz - 1, (3 << 20) // isz + 7)
        for op in ops:
            for count in counts:
                kind = "torch" if dtype == "bfloat16" or seed % 2 else "numpy"
                layout = "strided" if seed % 5 == 0 else "contiguous"
                cases.append(Case("all_reduce", dtype, count, op, kind, layout, seed % 3 == 0, seed=seed))
                seed += 1
    for count in (THRESHOLD - 1, THRESHOLD, THRESHOLD + 4097, (1 << 20) + 1, (5 << 20) + 13):
        for root in (0, 1):
            layout = "strided" if seed % 4 == 0 else "contiguous"
            cases.append(Case("broadcast", "uint8", count, None, "torch" if seed % 2 else "numpy", layout,
                              seed % 3 == 0, root=root, seed=seed))
            seed += 1
    taken = sum(c.coll == "all_reduce" or c.count >= THRESHOLD for c in available(cases))
    # what the pair does not take this way (MIN of floats, bitwise ops, complex, reduce): the buffers
    cases += [Case("all_reduce", "float32", (1 << 20) + 1, "MAX", "numpy", "contiguous", False, seed=seed),
              Case("all_reduce", "int64", (1 << 18) + 1, "BXOR", "numpy", "contiguous", False, seed=seed + 1),
              Case("all_reduce", "complex64", (1 << 18) + 1, "SUM", "numpy", "contiguous", False, seed=seed + 2),
              Case("reduce", "float32", (1 << 20) + 1, "SUM", "numpy", "contiguous", False, root=1, seed=seed + 3)]
    return available(cases), taken


def cases_and_copies(rank, world_size, init_method, cases, members=None):
    seen = count_copies()
    out = run_cases(rank, world_size, init_method, cases, members)
    out["copies"] = dict(seen)
    return out


@pytest.mark.parametrize("members", [None, (0, 2)], ids=["world of 2", "pair in a world of 3"])
def test_pair_results_are_bit_exact_and_the_single_copies_are_made(run_ranks, members):
    cases, taken = pair_cases()
    world = 2 if members is None else 3
    results = run_ranks(cases_and_copies, world, cases, members, timeout=150, env=ENV)
    members = list(range(world)) if members is None else list(members)
    assert_all_good(results, members)
    for r in members:
        copies = results[r]["copies"]
        # every call taken makes at least one read or write on each member
        assert copies["read"] + copies["write"] >= taken, (r, copies, taken)
    if world == 3:
        assert results[1]["copies"] == {"read": 0, "write": 0}


def float32_sum_bits(rank, world_size, init_method, n):
    """numpy's float32 bits of a + b, on both members, for values whose sum rounds."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    inputs = [np.random.default_rng(7 + r).standard_normal(n).astype(np.float32) * 10 ** r for r in (0, 1)]
    x = inputs[rank].copy()
    dist.all_reduce(x)
    expected = inputs[0] + inputs[1]
    from shmdist.api import group
    used = group._world.default.coll.split
    dist.destroy_process_group()
    return x.view(np.uint32).tobytes() == expected.view(np.uint32).tobytes(), used


def test_float32_sum_is_numpys_bits(run_ranks):
    results = run_ranks(float32_sum_bits, 2, (3 << 20) // 4 + 5, timeout=60)
    assert results == [(True, None), (True, None)]      # split None: the pair never found it could not


def fallback(rank, world_size, init_method, how):
    from shmdist import _core
    if how == "refused" and rank == 1:      # this rank's probe is refused, as under Yama or seccomp
        _core.cma_read = lambda pid, dst, src, n: errno.EPERM
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    from shmdist.api import group
    comm = group._world.default.coll
    seen = count_copies()
    out = []
    for i, n in enumerate(((1 << 20) + 3, (4 << 20) + 1)):
        b = np.arange(n, dtype=np.uint8) * (i + 1) if rank == i % 2 else np.zeros(n, np.uint8)
        dist.broadcast(b, src=i % 2)
        out.append(bool(np.array_equal(b, np.arange(n, dtype=np.uint8) * (i + 1))))
        x = np.full(n // 4, rank + 1.5, np.float32)
        dist.all_reduce(x)
        out.append(bool(np.all(x == 4.0)))
    dist.destroy_process_group()
    return out, comm.split, dict(seen)


@pytest.mark.parametrize("how", ["knob", "refused"])
def test_a_pair_that_cannot_reach_each_other_uses_the_buffers(run_ranks, how):
    env = {"SHMDIST_SINGLE_COPY": "0"} if how == "knob" else ENV
    results = run_ranks(fallback, 2, how, timeout=60, env=env)
    for out, split, copies in results:
        assert out == [True] * 4
        assert split is (None if how == "knob" else False)     # the knob: never tried
        assert copies == {"read": 0, "write": 0}


def copy_fails(rank, world_size, init_method, coll, which):
    """Rank 1's ``which`` fails (EFAULT) at its first call in the broadcast, its second
    (a chunk in) in the all_reduce."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    from shmdist import _core
    from shmdist.api import group
    comm = group._world.default.coll
    n = (2 << 20) + 5
    if rank == 1:
        calls = {"n": 0}
        real = getattr(_core, which)

        def failing(*a):
            calls["n"] += 1
            return errno.EFAULT if calls["n"] == (1 if coll == "broadcast" else 2) else real(*a)
        setattr(_core, which, failing)
    said = "no error"
    if coll == "broadcast":                 # rank 1 makes the copy that fails: root or not
        root = 1 if which == "cma_write" else 0
        b = np.arange(n, dtype=np.uint8) if rank == root else np.zeros(n, np.uint8)
        dist.broadcast(b, src=root)         # redone through the buffers
        right = bool(np.array_equal(b, np.arange(n, dtype=np.uint8)))
    else:
        x = np.full(n, rank + 1, np.int32)
        try:
            dist.all_reduce(x)
        except dist.DistError as e:
            said = str(e)
        right = None
    split = comm.split
    x = np.full(n, rank + 1, np.int32)
    dist.all_reduce(x)                      # the group goes on, through its buffers
    after = bool(np.all(x == 3))
    dist.destroy_process_group()
    return said, right, split, after


@pytest.mark.parametrize("which", ["cma_read", "cma_write"])
@pytest.mark.parametrize("coll", ["broadcast", "all_reduce"])
def test_a_copy_that_fails_mid_call_is_redone_or_said(run_ranks, coll, which):
    results = run_ranks(copy_fails, 2, coll, which, timeout=60, env=CHOOSE_OFF)
    for r, (said, right, split, after) in enumerate(results):
        assert split is False and after is True, (r, results[r])
        if coll == "broadcast":
            assert said == "no error" and right is True, (r, results[r])
        else:
            assert f"rank {r}: all_reduce" in said and "partly reduced" in said and \
                "SHMDIST_SINGLE_COPY=0" in said and os.strerror(errno.EFAULT) in said, (r, said)


def exit_at(when: str, copies: tuple) -> None:
    """This rank exits (os._exit(3)) at its next call's first phase, in its single copies
    (the _core functions named), or at the call's second phase."""
    from shmdist import _core
    from shmdist.comm import arena
    if when == "during its copies":
        for name in copies:
            setattr(_core, name, lambda *a: os._exit(3))
        return
    real, passes = arena.GroupComm._pass, [0]

    def counting(self, what, timeout, *desc):
        passes[0] += 1
        if passes[0] == (1 if when == "at the first phase" else 2):
            os._exit(3)
        return real(self, what, timeout, *desc)
    arena.GroupComm._pass = counting


def dies_inside(rank, world_size, init_method, coll, when):
    """Rank 1 dies (os._exit) at its first phase, at its first single copy, or at the
    call's last phase, having made its copies."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    n = 8 << 20
    if rank == 1:
        exit_at(when, ("cma_read", "cma_write"))
    x = np.ones(n // 4, np.float32)
    try:
        if coll == "broadcast":
            dist.broadcast(x, src=0)
        else:
            dist.all_reduce(x)
        return "no error"
    except dist.DistPeerError as e:
        return str(e)


@pytest.mark.parametrize("when", ["at the first phase", "during its copies", "at the last phase"])
@pytest.mark.parametrize("coll", ["broadcast", "all_reduce"])
def test_a_member_that_dies_inside_the_call_is_named(run_ranks, coll, when):
    """The group timeout is 60 s and the test's 30: the error comes from seeing the death."""
    results = run_ranks(dies_inside, 2, coll, when, timeout=30, errors="return", env=CHOOSE_OFF)
    assert results[1].exitcode == 3
    assert f"rank 0: {coll}" in results[0] and "rank 1 died" in results[0], results[0]


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_torch_backend_shm_takes_the_pair_path(run_ranks):
    results = run_ranks(torch_pair, 2, timeout=90, env=ENV)
    assert results[0] == results[1] == (True, True, True)


def torch_pair(rank, world_size, init_method):
    import torch
    import torch.distributed as tdist
    import shmdist.torch  # noqa: F401  (registers backend "shm")
    seen = count_copies()
    tdist.init_process_group("shm", init_method=init_method, rank=rank, world_size=world_size)
    t = torch.arange(1 << 20, dtype=torch.float32) * (rank + 1)
    tdist.all_reduce(t)
    ok_sum = bool(torch.equal(t, torch.arange(1 << 20, dtype=torch.float32) * 3))
    b = torch.arange(1 << 20, dtype=torch.bfloat16)[::2].clone() if rank == 1 else \
        torch.zeros(1 << 19, dtype=torch.bfloat16)
    tdist.broadcast(b, src=1)
    ok_b = bool(torch.equal(b, torch.arange(1 << 20, dtype=torch.bfloat16)[::2]))
    tdist.destroy_process_group()
    return ok_sum, ok_b, seen["read"] + seen["write"] >= 2


def untouched(rank, world_size, init_method):
    """Receive buffers whose pages this process never touched (np.empty of 16 MiB, fresh
    each time): the other member writes into them."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    n, ok = (16 << 20) + 5, []
    for k in range(3):
        want = np.random.default_rng(k).integers(0, 256, n, dtype=np.uint8)
        b = want.copy() if rank == 0 else np.empty(n, np.uint8)
        dist.broadcast(b, src=0)
        ok.append(bool(np.array_equal(b, want)))
    dist.destroy_process_group()
    return ok


def test_a_broadcast_into_pages_never_touched_is_right(run_ranks):
    assert run_ranks(untouched, 2, timeout=60) == [[True] * 3, [True] * 3]



# ---------------------------------------------------------------- three or more members: broadcast read from the root

DIRECT = 4 << 20           # arena.DIRECT_MIN (checked below)


def test_the_direct_threshold_is_the_arenas():
    from shmdist.comm import arena
    assert arena.DIRECT_MIN == DIRECT


def direct_cases(n: int) -> tuple[list[Case], int]:
    """Broadcasts of ``n`` members on both sides of DIRECT_MIN, odd lengths, every root,
    torch tensors strided or not; and how many of them each non-root member reads straight
    from the root's array."""
    cases, seed = [], 100
    for count, dtype in ((DIRECT - 1, "uint8"), (DIRECT, "uint8"), (DIRECT + 4097, "uint8"),
                         ((DIRECT + 12) // 4, "float32"), (((9 << 20) + 5) // 2, "bfloat16"),
                         ((DIRECT >> 1) + 3, "float16")):
        for root in range(n):
            kind = "torch" if dtype == "bfloat16" or seed % 2 else "numpy"
            layout = "strided" if seed % 3 == 0 else "contiguous"
            cases.append(Case("broadcast", dtype, count, None, kind, layout, seed % 4 == 0, root=root, seed=seed))
            seed += 1
    cases = available(cases)
    isz = {"uint8": 1, "float32": 4, "bfloat16": 2, "float16": 2}
    return cases, sum(c.count * isz[c.dtype] >= DIRECT for c in cases)


def pinned_cases_and_copies(rank, world_size, init_method, cases, members, cpus):
    if cpus:        # every rank on the first CPU it may use: readers outnumber CPUs, the root helps
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    return cases_and_copies(rank, world_size, init_method, cases, members)


@pytest.mark.parametrize("world,members,cpus", [(3, None, None), (4, None, None), (4, (0, 1, 3), None),
                                                (3, None, 1)],
                         ids=["world of 3", "world of 4", "3 of a world of 4", "world of 3 on one CPU"])
def test_broadcast_of_more_members_reads_the_roots_array(run_ranks, world, members, cpus):
    """Bit-exact everywhere; from DIRECT_MIN up, never below it, each member copies its
    array's chunks from the root's in each call it is not root of, the root writes chunks
    to the readers where they outnumber its CPUs; a rank outside the group never copies."""
    n = world if members is None else len(members)
    cases, taken = direct_cases(n)
    results = run_ranks(pinned_cases_and_copies, world, cases, members, cpus, timeout=240, env=CHOOSE_OFF)
    members = list(range(world)) if members is None else list(members)
    assert_all_good(results, members)
    helps = n - 1 > (cpus or len(os.sched_getaffinity(0)))   # the root writes where readers outnumber CPUs
    for r in members:
        # each member is root of 1/n of the calls taken: it reads its own array once in each
        # of the others, and as a root that helps offers to write into every reader's at least once
        copies = results[r]["copies"]
        assert copies["read"] == taken - taken // n, (r, copies, taken)
        assert copies["write"] >= taken // n * (n - 1) if helps else copies["write"] == 0, (r, copies, taken)
    for r in set(range(world)) - set(members):
        assert results[r]["copies"] == {"read": 0, "write": 0}


def direct_fallback(rank, world_size, init_method, how):
    """Three members, a broadcast from each root at DIRECT_MIN + 5: ``how`` keeps them
    from reading each other's memory, or (``fails``) makes rank 2's first read fail."""
    from shmdist import _core
    if how == "refused" and rank == 1:     # this rank's probe is refused, as under Yama or seccomp
        _core.cma_read = lambda pid, dst, src, n: errno.EPERM
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    from shmdist.api import group
    comm = group._world.default.coll
    if how == "fails" and rank == 2:
        real, calls = _core.cma_claim, [0]

        def failing(*a):
            calls[0] += 1
            return errno.EFAULT if calls[0] == 1 else real(*a)
        _core.cma_claim = failing
    seen = count_copies()
    n, out = DIRECT + 5, []
    for root in range(world_size):
        want = np.random.default_rng(root).integers(0, 256, n, dtype=np.uint8)
        b = want.copy() if rank == root else np.empty(n, np.uint8)
        dist.broadcast(b, src=root)
        out.append(bool(np.array_equal(b, want)))
    dist.destroy_process_group()
    return out, comm.split, dict(seen)


@pytest.mark.parametrize("how", ["knob", "refused", "fails"])
def test_more_members_that_cannot_read_the_root_use_the_buffers(run_ranks, how):
    env = {"SHMDIST_SINGLE_COPY": "0"} if how == "knob" else CHOOSE_OFF
    results = run_ranks(direct_fallback, 3, how, timeout=90, env=env)
    for r, (out, split, copies) in enumerate(results):
        assert out == [True] * 3, (r, out)
        assert split is (None if how == "knob" else False), (r, split)    # the knob: never tried
        # a copy that failed: rank 2's in the first broadcast (root 0), where rank 1 read too
        reads = {"knob": 0, "refused": 0, "fails": 1 if r != 0 else 0}[how]
        assert copies["read"] == reads and (copies["write"] == 0 or how == "fails" and r == 0), (r, copies)


def direct_dies(rank, world_size, init_method, who, when):
    """``who`` (the root, rank 0, or a reader, rank 2) dies (os._exit) at the call's first
    phase, in its copies (the root makes some where its readers outnumber its CPUs: all
    ranks on one CPU then), or at the last phase, having made them."""
    if who == "root" and when == "during its copies":
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    dying = 0 if who == "root" else 2
    if rank == dying:
        exit_at(when, ("cma_claim",))
    x = np.ones((DIRECT + 8) // 4, np.float32)
    try:
        dist.broadcast(x, src=0)
        return "no error"
    except dist.DistPeerError as e:
        return str(e)


@pytest.mark.parametrize("who,when", [(who, when) for who in ("root", "reader") for when in
                                      ("at the first phase", "during its copies", "at the last phase")])
def test_a_member_that_dies_inside_a_direct_broadcast_is_named(run_ranks, who, when):
    """The group timeout is 60 s and the test's 30: the error comes from seeing the death."""
    dying = 0 if who == "root" else 2
    results = run_ranks(direct_dies, 3, who, when, timeout=30, errors="return")
    assert results[dying].exitcode == 3
    for r in set(range(3)) - {dying}:
        assert "rank %d: broadcast" % r in results[r] and f"rank {dying} died" in results[r], (r, results[r])


def root_reuses(rank, world_size, init_method):
    """The root overwrites its array the moment broadcast returns: the readers hold
    what it was (the root leaves only once every chunk is in), into pages never touched."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    n, ok = DIRECT * 2 + 3, []
    mine = np.empty(n, np.uint8)
    for k in range(4):
        want = np.random.default_rng(k).integers(0, 256, n, dtype=np.uint8)
        if rank == 0:
            mine[:] = want
            dist.broadcast(mine, src=0)
            mine[:] = 0
        else:
            b = np.empty(n, np.uint8)
            dist.broadcast(b, src=0)
            ok.append(bool(np.array_equal(b, want)))
    dist.destroy_process_group()
    return ok


def test_a_root_that_reuses_its_array_at_once_changes_no_readers_result(run_ranks):
    assert run_ranks(root_reuses, 4, timeout=90) == [[]] + [[True] * 4] * 3

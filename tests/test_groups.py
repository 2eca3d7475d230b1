"""Collectives on groups made by new_group: the seed page's new_group([0, 2, 3]),
subgroups whose roots are global ranks, non-members, and overlapping groups used
one after another, interleaved, and from threads at the same time."""
from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

import shmdist as dist
from test_collectives import MOVEMENTS, REDUCTIONS, assert_all_good, make_cases, needs_torch, run_cases

pytestmark = pytest.mark.usefixtures("transport")   # each test over shm, then over TCP


# ---------------------------------------------------------------- the seed page's group

def seed_group(rank, world_size, init_method, kind):
    """The seed page's example; with numpy arrays in place of torch tensors too."""
    if kind == "torch":
        import torch
        tensor, zeros = torch.tensor, lambda n: torch.zeros(n, dtype=torch.int64)
    else:
        tensor, zeros = (lambda v: np.array(v, dtype=np.int64)), (lambda n: np.zeros(n, dtype=np.int64))
    dist.init_process_group(backend="gloo", init_method=init_method, rank=rank, world_size=world_size)
    new_group = dist.new_group([0, 2, 3])
    shape = (dist.get_rank(new_group), dist.get_world_size(new_group))
    result = None
    if rank in (0, 2, 3):
        t = tensor([100, 200, 300]) if dist.get_rank() == 0 else zeros(3)
        dist.broadcast(t, src=0, group=new_group)
        s = tensor([rank, 1, 10 * rank])
        dist.all_reduce(s, group=new_group)
        dist.barrier(group=new_group)
        result = (t.tolist(), s.tolist())
    dist.destroy_process_group()
    return shape, result


@pytest.mark.parametrize("kind", [pytest.param("torch", marks=needs_torch), "numpy"])
def test_seed_page_group_with_broadcast_all_reduce_barrier(run_ranks, kind):
    assert run_ranks(seed_group, 4, kind, timeout=60) == [
        ((0, 3), ([100, 200, 300], [5, 3, 50])),
        ((-1, -1), None),
        ((1, 3), ([100, 200, 300], [5, 3, 50])),
        ((2, 3), ([100, 200, 300], [5, 3, 50])),
    ]


# ---------------------------------------------------------------- every collective on a subgroup

def test_subgroup_collectives_match_numpy(run_ranks):
    """Every collective on new_group([0, 2, 3]) of 4 ranks, roots given as global ranks
    (2 and 3 as well as 0), with a small arena so 20001 elements take several rounds."""
    cases = make_cases(REDUCTIONS + MOVEMENTS, [1, 20001],
                       dtypes=("int32", "bool", "bfloat16", "float32", "complex64"))
    results = run_ranks(run_cases, 4, cases, (0, 2, 3), timeout=100, env={"SHMDIST_ARENA_BYTES": "65536"})
    assert results[1] == {"problems": [], "digests": {}}     # rank 1 is not a member: it did nothing
    assert_all_good(results, members=[0, 2, 3])


# ---------------------------------------------------------------- non-members

def non_member_calls(g, t):
    """Every collective, called on ``g`` by a rank that is not a member."""
    i64 = lambda n=3: np.zeros(n, dtype=np.int64)   # noqa: E731
    return {
        "broadcast": lambda: dist.broadcast(t, src=0, group=g),
        "all_reduce": lambda: dist.all_reduce(t, group=g),
        "all_reduce async": lambda: dist.all_reduce(t, group=g, async_op=True),
        "reduce": lambda: dist.reduce(t, dst=0, group=g),
        "all_gather": lambda: dist.all_gather([i64() for _ in range(3)], t, group=g),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(i64(9), t, group=g),
        "gather": lambda: dist.gather(t, None, dst=0, group=g),
        "scatter": lambda: dist.scatter(t, None, src=0, group=g),
        "reduce_scatter": lambda: dist.reduce_scatter(t, [i64() for _ in range(3)], group=g),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(t, i64(9), group=g),
        "all_to_all": lambda: dist.all_to_all([i64(1) for _ in range(3)], [i64(1) for _ in range(3)], group=g),
        "all_to_all_single": lambda: dist.all_to_all_single(i64(), i64(), group=g),
        "barrier": lambda: dist.barrier(group=g),
    }


def non_member(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    g = dist.new_group([0, 2, 3])
    if rank == 1:
        t = np.array([1, 2, 3], dtype=np.int64)
        seen = {}
        for name, call in non_member_calls(g, t).items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ret = call()
            said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
            seen[name] = (ret, said, t.tolist())
        result = seen
    else:
        t = np.full(3, rank, dtype=np.int64)
        dist.all_reduce(t, group=g)                     # the members are not disturbed
        try:
            dist.broadcast(t, src=1, group=g)           # a root outside the group
            refused = "no error"
        except dist.DistError as e:
            refused = str(e)
        result = (t.tolist(), refused)
    dist.destroy_process_group()
    return result


def test_non_member_call_warns_and_does_nothing(run_ranks):
    results = run_ranks(non_member, 4, timeout=60)
    for name, (ret, said, t) in results[1].items():
        assert ret is None, name
        assert len(said) == 1 and "not a member" in said[0] and "[0, 2, 3]" in said[0], (name, said)
        assert t == [1, 2, 3], name
    for rank in (0, 2, 3):
        total, refused = results[rank]
        assert total == [5, 5, 5]
        assert "src=1" in refused and "[0, 2, 3]" in refused, refused


# ---------------------------------------------------------------- overlapping groups

GROUPS = {"A": [0, 1, 2], "B": [1, 2, 3], "C": [0, 3], "D": [1, 2], "W": [0, 1, 2, 3]}


def _size_of(name: str, step: int) -> int:
    """Each group and step its own size, some above the 64 KiB all_reduce switch."""
    return 1 + 37 * "ABCDW".index(name) + (70000 if step % 3 == 0 else step)


def _check_group_ops(name: str, members, step: int, rank: int, async_op: bool):
    """all_reduce, broadcast and all_gather on one group; returns (pending requests, checks)."""
    g = GROUP_OBJECTS[name]
    n = _size_of(name, step)
    a = np.full(n, rank + 10 * step, dtype=np.int64)
    b = np.arange(n, dtype=np.float32) * (rank + 1) if rank == members[-1] else np.zeros(n, np.float32)
    outs = [np.zeros(n % 1000, dtype=np.int32) for _ in members]
    reqs = [dist.all_reduce(a, group=g, async_op=async_op),
            dist.broadcast(b, src=members[-1], group=g, async_op=async_op),
            dist.all_gather(outs, np.full(n % 1000, rank, dtype=np.int32), group=g, async_op=async_op)]
    want_a = sum(r + 10 * step for r in members)
    want_b = np.arange(n, dtype=np.float32) * (members[-1] + 1)

    def check():
        problems = []
        if not np.all(a == want_a):
            problems.append(f"step {step} group {name}: all_reduce gave {a[:3]}, expected {want_a}")
        if not np.array_equal(b, want_b):
            problems.append(f"step {step} group {name}: broadcast from {members[-1]} is wrong")
        if [int(o[0]) if o.size else r for o, r in zip(outs, members)] != list(members):
            problems.append(f"step {step} group {name}: all_gather gave {[o[:1] for o in outs]}")
        return problems
    return [r for r in reqs if r is not None], check


GROUP_OBJECTS = {}


def _make_groups(world_size):
    for name, members in GROUPS.items():
        GROUP_OBJECTS[name] = dist.new_group(members)


def overlapping(rank, world_size, init_method, order, async_op, steps):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    _make_groups(world_size)
    problems, pending = [], []
    for step in range(steps):
        for name in order:
            members = GROUPS[name]
            if rank in members:
                reqs, check = _check_group_ops(name, members, step, rank, async_op)
                pending.append((reqs, check))
        if not async_op or step == steps - 1:      # async: wait for everything only at the end
            for reqs, check in pending:
                for r in reqs:
                    r.wait()
                problems += check()
            pending = []
    dist.destroy_process_group()
    return problems


@pytest.mark.parametrize("order,async_op", [("ABCDW", False), ("WDCBA", True), ("ABAB", True)],
                         ids=["one after another", "reverse order, async", "A and B interleaved, async"])
def test_overlapping_groups(run_ranks, order, async_op):
    assert run_ranks(overlapping, 4, order, async_op, 6, timeout=100) == [[], [], [], []]


def threaded(rank, world_size, init_method, steps):
    """One thread per group this rank belongs to (A, B and D overlap on ranks 1 and 2),
    all running collectives at the same time."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    _make_groups(world_size)
    problems = []

    def work(name):
        try:
            for step in range(steps):
                reqs, check = _check_group_ops(name, GROUPS[name], step, rank, False)
                problems.extend(check())
        except Exception as e:
            problems.append(f"group {name}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(name,)) for name in "ABD" if rank in GROUPS[name]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dist.barrier()
    dist.destroy_process_group()
    return problems


def test_overlapping_groups_from_threads_at_once(run_ranks):
    assert run_ranks(threaded, 4, 6, timeout=100) == [[], [], [], []]

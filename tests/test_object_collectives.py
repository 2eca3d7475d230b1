"""The object collectives, with nested Python objects (and some bigger than the
collective arena's 1 MiB slot), on the whole job and on a subgroup."""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

import shmdist as dist

pytestmark = pytest.mark.usefixtures("transport")   # each test over shm, then over TCP


@dataclasses.dataclass
class Point:
    x: int
    tags: list


def nested(rank: int, purpose: str):
    """A nested object that differs by rank and purpose (and in pickled size)."""
    return {"rank": rank, "purpose": purpose,
            "list": [1, 2.5, (rank, "x" * rank), {"deep": [None, True, {rank, -rank - 1}]}],
            "point": Point(rank, [rank] * (rank + 1)),
            "bytes": bytes(range(rank + 1)) * 10,
            "text": "ранг " * (rank + 1),
            "array": np.arange(rank + 2, dtype=np.float32) / 3}


BIG = b"\xab\xcd" * (3 << 19)     # 3 MiB: several rounds through the arena


def same(a, b) -> bool:
    """Deep equality that also compares numpy arrays (dtype and values)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and type(a) is type(b):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def object_collectives(rank, world_size, init_method, members):
    """Run every object collective among ``members`` (the whole job when None); return
    the problems found."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    group = None if members is None else dist.new_group(members)
    members = list(range(world_size)) if members is None else sorted(members)
    problems = []

    def expect(what, got, want):
        if not same(got, want):
            problems.append(f"rank {rank}: {what}: got {got!r:.200}, expected {want!r:.200}")

    if rank in members:
        n, me = len(members), members.index(rank)
        src, dst = members[-1], members[1]

        objs = [nested(rank, "broadcast"), "second", BIG] if rank == src else [None, 0, "x"]
        expect("broadcast_object_list return", dist.broadcast_object_list(objs, src=src, group=group), None)
        expect("broadcast_object_list", objs, [nested(src, "broadcast"), "second", BIG])

        out = [None] * n
        mine = [nested(rank, "all_gather"), BIG if me == 1 else b""]
        dist.all_gather_object(out, mine, group=group)
        expect("all_gather_object", out, [[nested(r, "all_gather"), BIG if j == 1 else b""]
                                          for j, r in enumerate(members)])

        out = [None] * n if rank == dst else None
        dist.gather_object((nested(rank, "gather"), BIG[:rank * 100000]), out, dst=dst, group=group)
        if rank == dst:
            expect("gather_object", out, [(nested(r, "gather"), BIG[:r * 100000]) for r in members])

        out = [None]
        ins = [{"to": r, "obj": nested(r, "scatter")} for r in members] if rank == src else None
        dist.scatter_object_list(out, ins, src=src, group=group)
        expect("scatter_object_list", out, [{"to": rank, "obj": nested(rank, "scatter")}])

        # point to point between the first two members: any source, then a named one
        first, second = members[0], members[1]
        if rank == first:
            dist.send_object_list([nested(rank, "p2p"), BIG, [[[]]]], dst=second, group=group)
            back = [None]
            expect("recv_object_list source", dist.recv_object_list(back, src=second, group=group), second)
            expect("recv_object_list", back, [{"reply": nested(second, "p2p")}])
        elif rank == second:
            got = [None, None, None]
            expect("recv_object_list source (any)", dist.recv_object_list(got, group=group), first)
            expect("recv_object_list", got, [nested(first, "p2p"), BIG, [[[]]]])
            dist.send_object_list([{"reply": nested(rank, "p2p")}], dst=first, group=group)
    dist.destroy_process_group()
    return problems


@pytest.mark.parametrize("world_size", [2, 3])
def test_object_collectives_on_the_job(run_ranks, world_size):
    assert run_ranks(object_collectives, world_size, None, timeout=60) == [[]] * world_size


def test_object_collectives_on_a_subgroup(run_ranks):
    """new_group([0, 2, 3]) of 4: src and dst are global ranks (3 and 2)."""
    assert run_ranks(object_collectives, 4, [0, 2, 3], timeout=60) == [[]] * 4


def object_non_member(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    g = dist.new_group([0, 2, 3])
    result = None
    if rank == 1:
        lists = {"broadcast_object_list": ["mine"], "all_gather_object": [None] * 3,
                 "gather_object": [None] * 3, "scatter_object_list": [None]}
        calls = {"broadcast_object_list": lambda: dist.broadcast_object_list(lists["broadcast_object_list"],
                                                                             src=0, group=g),
                 "all_gather_object": lambda: dist.all_gather_object(lists["all_gather_object"], "x", group=g),
                 "gather_object": lambda: dist.gather_object("x", lists["gather_object"], dst=0, group=g),
                 "scatter_object_list": lambda: dist.scatter_object_list(lists["scatter_object_list"],
                                                                         None, src=0, group=g)}
        result = {}
        for name, call in calls.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ret = call()
            said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
            result[name] = (ret, len(said), all("not a member" in s for s in said), lists[name])
    else:
        objs = [{"from": 0}] if rank == 0 else [None]
        dist.broadcast_object_list(objs, src=0, group=g)
        result = objs
    dist.destroy_process_group()
    return result


def test_object_collectives_non_member_warns_and_does_nothing(run_ranks):
    results = run_ranks(object_non_member, 4, timeout=60)
    assert results[1] == {"broadcast_object_list": (None, 1, True, ["mine"]),
                          "all_gather_object": (None, 1, True, [None] * 3),
                          "gather_object": (None, 1, True, [None] * 3),
                          "scatter_object_list": (None, 1, True, [None])}
    assert results[0] == results[2] == results[3] == [{"from": 0}]

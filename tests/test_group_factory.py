"""Every group is made by one factory (group.open_group): shmdist.new_group's
and torch's "shm" subgroups alike, so a subgroup gets the collective engine
its members' hosts call for (a shared arena on one host, the hierarchical
one across hosts), joins the world (World.close closes it, memory_usage
counts it), and takes its id from the one allocator."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


def torch_subgroup_spanning_hosts(rank, world_size, init_method):
    os.environ["SHMDIST_HOST_ID"] = f"pretend-host-{rank * 2 // world_size}"   # [a, a, b, b]
    import shmdist
    import shmdist.torch  # noqa: F401  (registers the backend)
    from shmdist.comm import arena
    from shmdist.api import group as groups
    dist.init_process_group("shm", init_method=init_method, rank=rank, world_size=world_size)
    spanning = dist.new_group([1, 2])       # one rank on each pretend host
    local = dist.new_group([2, 3])          # both on host b
    out = {}
    for name, sub, members in (("spanning", spanning, (1, 2)), ("local", local, (2, 3))):
        made = [g for g in groups.world().groups if g.ranks == members]
        if rank in members:
            t = torch.full((3,), float(rank))
            dist.all_reduce(t, group=sub)
            assert torch.equal(t, torch.full((3,), float(sum(members)))), f"rank {rank}: {name}: {t}"
            (g,) = made
            out[name] = (isinstance(g.coll, arena.GroupComm), g.gid)
        else:
            assert not made, f"rank {rank}: {name}: a subgroup it is not a member of is in its world"
    out["arenas"] = shmdist.memory_usage()["collective_arenas"] > 0
    out["new_group"] = shmdist.new_group([0, 1, 2, 3]).gid    # the same counter as torch's subgroups
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_torch_shm_subgroup_spanning_hosts_is_made_by_the_group_factory(run_ranks):
    """Before the factory, torch.py opened a subgroup's arena itself: a subgroup
    spanning hosts tried to share one arena between hosts."""
    got = run_ranks(torch_subgroup_spanning_hosts, 4, timeout=180)
    spanning, local, made = got[1]["spanning"][1], got[3]["local"][1], got[0]["new_group"]
    assert got[0] == {"arenas": True, "new_group": made}
    assert got[1] == {"spanning": (False, spanning), "arenas": True, "new_group": made}   # hierarchical: no shared arena
    assert got[2] == {"spanning": (False, spanning), "local": (True, local), "arenas": True, "new_group": made}
    assert got[3] == {"local": (True, local), "arenas": True, "new_group": made}
    # one allocator: torch's subgroups and shmdist.new_group's take ids from the same counter
    # (rank 0, in neither subgroup, may make its new_group before the second subgroup is made)
    assert sorted([spanning, local, made]) == [1, 2, 3] and spanning < local

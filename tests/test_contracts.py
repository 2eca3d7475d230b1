"""The written contracts: both transports implement transport.Transport and
their channels transport.Channel; both collective engines (the shared-arena
GroupComm, the hierarchical HierComm) implement arena.Comm with the
same signatures, so api/collectives.py calls either the same way."""
import inspect

import pytest

from shmdist import _core
from shmdist.comm import arena
from shmdist.comm import hier
from shmdist.transport import shm
from shmdist.transport import tcp
from shmdist.transport import contract as transport


def _protocol_members(proto):
    return [name for name in proto.__dict__ if not name.startswith("_")] + list(proto.__annotations__)


def _signature(f):
    return [(p.name, p.default) for p in inspect.signature(f).parameters.values()]


def test_both_transports_implement_the_transport_contract():
    for cls in (shm.ShmHost, tcp.Transport):
        for name in _protocol_members(transport.Transport):
            assert hasattr(cls, name) or name in cls.__init__.__code__.co_names, (cls.__name__, name)
        for name in ("gone", "close"):
            assert list(inspect.signature(getattr(cls, name)).parameters)[:2] == \
                list(inspect.signature(getattr(transport.Transport, name)).parameters)[:2], (cls.__name__, name)


def test_both_channels_implement_the_channel_contract():
    assert issubclass(_core.Ring, transport.Channel) and issubclass(tcp.Link, transport.Channel)


def test_both_collective_engines_implement_the_comm_contract():
    for cls in (arena.GroupComm, hier.HierComm):
        for name, member in vars(arena.Comm).items():
            if name.startswith("_") or not callable(member):
                continue
            assert _signature(getattr(cls, name))[:len(_signature(member))] == _signature(member) or \
                [n for n, _ in _signature(getattr(cls, name))] == [n for n, _ in _signature(member)], \
                (cls.__name__, name)


# ---------------------------------------------------------------- the group layer's contracts

class _MemoryStore:
    """What allocate_gid needs of a store (set/get/add), in memory, shared by pretend ranks."""
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value

    def get(self, key, timeout=None):
        return self.data[key]

    def add(self, key, amount):
        self.data[key] = int(self.data.get(key, 0)) + amount
        return self.data[key]


def test_one_allocator_hands_out_every_group_id():
    """new_group's groups (every rank calls, rank 0 allocates) and torch's subgroups
    (members only, the first member allocates) draw from the one store counter:
    no second counter, no id range of their own."""
    from shmdist.api import group as groups
    from shmdist.rendezvous.store import PrefixStore
    store = _MemoryStore()
    worlds = [groups.World(r, 3, "shm", 5.0, store, None) for r in range(3)]
    made = PrefixStore("new_group/1/", store)                 # shmdist.new_group: every rank
    assert [w.allocate_gid(made, w.rank == 0) for w in worlds] == [1, 1, 1]
    sub = PrefixStore("torch-subgroup/", store)               # a torch subgroup of ranks 1 and 2
    assert [w.allocate_gid(sub, first) for w, first in ((worlds[1], True), (worlds[2], False))] == [2, 2]
    again = PrefixStore("new_group/2/", store)
    assert [w.allocate_gid(again, w.rank == 0) for w in worlds] == [3, 3, 3]
    assert not hasattr(groups, "SUBGROUP_GID_BASE") and not hasattr(groups.World, "subgroup_gid")


def test_torch_subgroups_go_through_the_group_factory_and_the_allocator():
    """torch.py makes a subgroup as new_group does: its id from World.allocate_gid,
    the group from group.open_group (the multi-rank proof is test_group_factory.py)."""
    pytest.importorskip("torch")
    from shmdist import torch as shm_torch
    names = shm_torch._subgroup.__code__.co_names
    assert "allocate_gid" in names and "open_group" in names
    assert "open_group" not in shm_torch.__dict__ and "GroupComm" not in shm_torch.__dict__


def test_arena_opens_by_key_and_plain_ranks():
    """comm/arena.open_group takes a key and the members' global ranks; nothing
    fakes a ProcessGroup to call it (hier.py's _Node is gone)."""
    assert list(inspect.signature(arena.open_group).parameters) == ["world", "key", "ranks"]
    assert list(inspect.signature(arena.GroupComm).parameters) == ["world", "ranks", "seg"]
    assert not hasattr(hier, "_Node")


def test_the_arena_module_goes_by_its_name():
    """comm/arena.py is imported as ``arena`` (api/collectives.py is the one called collectives)."""
    import pathlib
    import shmdist
    stale = [p.name for p in pathlib.Path(shmdist.__file__).parent.rglob("*.py")
             if "import arena as" in p.read_text() or "collective_api" in p.read_text()]
    assert not stale, stale


# ---------------------------------------------------------------- the engine and its fast lane

def fast_recv_after_a_group_was_destroyed(rank, world_size, init_method):
    """Rank 1 posts an any-source receive (the general path), then a receive
    from rank 0 that the fast lane may take; rank 0 sends 1, then 2."""
    import numpy as np
    import shmdist as dist
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    box = np.zeros(1, dtype=np.int64)     # one exchange on the general path teaches the lane int64
    if rank == 0:
        dist.send(box, 1).wait()
    else:
        dist.recv(box, 0).wait()
    dist.destroy_process_group(dist.new_group([0, 1]))   # fail_group: the engine drops its receives
    got = None
    if rank == 1:
        first, second = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
        anyone = dist.irecv(first, None)
    dist.barrier()            # rank 0 sends only once the any-source receive is posted
    if rank == 0:
        dist.send(np.array([1]), 1).wait()
        dist.send(np.array([2]), 1).wait()
    dist.barrier()            # both messages sit in the ring; rank 1's engine has not looked
    if rank == 1:
        dist.recv(second, 0).wait()
        anyone.wait()
        got = (int(first[0]), int(second[0]))
    dist.destroy_process_group()
    return got


def test_the_fast_lane_sees_the_engines_receives_after_a_group_was_destroyed(run_ranks):
    """The lane and the engine share one _core.Queues, never rebound. When the
    lane held its own references to the engine's lists, destroying a group
    (Engine.fail_group) gave the engine a new list of posted receives and the
    lane kept the old, empty one: its fast receive then took the message that
    the any-source receive posted before it was owed."""
    assert run_ranks(fast_recv_after_a_group_was_destroyed, 2, timeout=90)[1] == (1, 2)


def test_the_engines_queues_cannot_be_rebound():
    """Queues' lists are readonly attributes: code that would replace one (and
    leave the lane reading the old) fails at once instead."""
    q = _core.Queues([0, 1])
    assert q.rx == {0: None, 1: None} and q.posted == [] and q.unexpected == [] and q.sendq == {}
    for name in ("sendq", "posted", "rx", "unexpected"):
        with pytest.raises(AttributeError):
            setattr(q, name, type(getattr(q, name))())


def test_one_point_to_point_exchange_serves_both_collective_layers():
    """hier.py's steps between nodes and the uneven all_to_all/reduce_scatter
    post and wait their messages through Engine.exchange alone: neither makes
    requests or calls the engine's send/recv itself."""
    import re
    from shmdist.api import collectives
    for module in (hier, collectives):
        text = inspect.getsource(module)
        assert not re.search(r"DistributedRequest\(|engine\.(send|recv)\(", text), module.__name__
    assert "engine.exchange(" in inspect.getsource(hier.HierComm._exchange)
    assert "engine.exchange(" in inspect.getsource(collectives._exchange_p2p)


# ---------------------------------------------------------------- settings

def test_only_settings_reads_the_environment():
    """Every environment variable shmdist reads goes through settings.py (its
    table, or the declared launcher variables); elsewhere os.environ is only
    copied into the environment of a child process."""
    import pathlib
    import re
    import shmdist
    child_env = re.compile(r"dict\(os\.environ\)|\*\*os\.environ|os\.environ\.setdefault\(")
    bad = []
    for path in sorted(pathlib.Path(shmdist.__file__).parent.rglob("*.py")):
        if path.name == "settings.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"os\.environ|getenv|import environ", line) and not child_env.search(line):
                bad.append(f"{path.name}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_every_launcher_variable_read_is_declared():
    import ast
    import re
    from shmdist import settings
    from shmdist.rendezvous import launchers
    names = {node.value for node in ast.walk(ast.parse(inspect.getsource(launchers)))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and re.fullmatch(r"[A-Z][A-Z0-9]*(_[A-Za-z0-9]+)*", node.value)}
    assert names and names <= settings.LAUNCHER_VARIABLES
    with pytest.raises(KeyError, match="LAUNCHER_VARIABLES"):
        settings.launcher("HOME")

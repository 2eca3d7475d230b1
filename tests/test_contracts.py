"""The written contracts: both transports implement transport.Transport and
their channels transport.Channel; both collective engines (the shared-arena
GroupComm, the hierarchical HierComm) implement collectives.Comm with the
same signatures, so api/collectives.py calls either the same way."""
import inspect

from shmdist import _core
from shmdist.comm import arena as collectives
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
    for cls in (collectives.GroupComm, hier.HierComm):
        for name, member in vars(collectives.Comm).items():
            if name.startswith("_") or not callable(member):
                continue
            assert _signature(getattr(cls, name))[:len(_signature(member))] == _signature(member) or \
                [n for n, _ in _signature(getattr(cls, name))] == [n for n, _ in _signature(member)], \
                (cls.__name__, name)

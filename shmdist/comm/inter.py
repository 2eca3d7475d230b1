"""The leg between hosts of the hierarchical collectives (hier.py), on an
engine people already run: torch's gloo, MPI (mpi4py), or our own TCP
transport.

hier.py moves every message of a collective through ``HierComm._exchange``
(a list of sends and receives, each a buffer and a peer). An inter-host
engine takes from those lists the messages between this rank and the
members of its lane on other hosts, carries them itself, and leaves the
rest (inside a node: shared memory; to other ranks on another host: the
TCP transport) to the point-to-point engine. Lane i is local rank i of
every node: lane 0 is the leaders, and a sharded all_reduce (hier.py)
moves share i in lane i (with MPI's all_gather, or as messages). So an engine is one
more carrier of the same messages, not another copy of the collective
algorithms: the same check, the same reductions in the same order, the
same bytes.

Choosing (``SHMDIST_INTER``):

- ``mpi``  mpi4py, when the job runs under an MPI launcher and every
  rank's number is its MPI_COMM_WORLD rank;
- ``gloo`` a torch gloo process group per lane, created when the group is
  made (every member is there then) on the job's store among only the
  lane's members, on the address through which the host reaches the
  rendezvous master (so host names need not resolve);
- ``tcp``  the point-to-point engine (our TCP transport), needs nothing.

Unset, or ``auto``: ``mpi`` under an MPI launcher with an mpi4py built for
that MPI, else ``gloo`` when torch is importable and the backend is "shm",
else ``tcp``. The choice is logged (logger "shmdist", INFO) and
``chosen()`` returns it. All members of a lane must choose alike; they
compare their choices through the store when the engine is made and raise
DistMismatchError naming the ranks that differ. An MPI engine that lost a
host aborts the MPI job at exit (``_mpi_lost``).

Messages between a pair of leaders are numbered per direction; the n-th
message from A to B carries tag n on both ends (both ends run the same
steps in the same order), so they never match out of order.
"""
from __future__ import annotations

import ctypes
import datetime
import json
import logging
import os
import socket
import time

from shmdist import settings
from shmdist.errors import DistError, DistMismatchError, DistPeerError, DistTimeoutError

ENV = "SHMDIST_INTER"
CHOICES = ("auto", "gloo", "mpi", "tcp")
TAG_SPAN = 1 << 24
log = logging.getLogger("shmdist")
_chosen: str = ""
_mpi_unusable = ""     # why auto must not pick MPI after all (an mpi4py of another MPI than the launcher's)
carried = {"messages": 0, "bytes": 0}   # what this process's inter-host engines moved (for tests, bench)


def chosen() -> str:
    """The inter-host engine this process chose last ('' before any group spanned hosts)."""
    return _chosen


def _importable(name: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _under_mpi() -> bool:
    from shmdist.rendezvous import launchers
    return launchers.detect().source in ("openmpi", "mpich")


def choose(backend: str = "shm") -> str:
    """SHMDIST_INTER, or for auto: mpi under an MPI launcher with a usable
    mpi4py, else gloo when torch is importable and the backend is "shm"
    (and SHMDIST_TRANSPORT is not tcp), else tcp."""
    want = settings.get(ENV)
    if want not in CHOICES:
        raise DistError(f"{ENV}={want!r}: expected one of {', '.join(CHOICES)}")
    if want == "auto":
        if settings.get("SHMDIST_TRANSPORT") == "tcp":   # "TCP everywhere" (README), between hosts too
            return "tcp"
        if _under_mpi() and _importable("mpi4py") and not _mpi_unusable:
            want = "mpi"
        elif backend == "shm" and _importable("torch"):
            want = "gloo"
        else:
            want = "tcp"
    return want


def load_mpi():
    """mpi4py's MPI, initialized, if it was built for the MPI that launched
    this job; else None and why. Its library is asked first, before MPI_Init:
    an MPICH mpi4py under Open MPI's mpiexec (or the reverse) aborts the
    process in MPI_Init."""
    import sys
    from shmdist.rendezvous import launchers
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = True
    from mpi4py import MPI
    if MPI.Is_initialized():
        return MPI, ""
    source = launchers.detect().source
    library = MPI.Get_library_version()
    is_open_mpi = "Open MPI" in library
    if source in ("openmpi", "mpich") and is_open_mpi != (source == "openmpi"):
        return None, (f"mpi4py is built for {'Open MPI' if is_open_mpi else 'an MPICH-family MPI'} but the job "
                      f"was started by {source}'s launcher")
    MPI.Init_thread(MPI.THREAD_MULTIPLE)
    return MPI, ""


def prepare() -> None:
    """Called by init_process_group before any store exists: with the MPI
    engine, initialize MPI now. MPI_Init is collective under Hydra and holds
    the GIL while it waits, so rank 0 must not enter it later, when its
    store's server thread must keep answering the ranks still on their way."""
    global _mpi_unusable
    if choose() != "mpi":
        return
    MPI, why = load_mpi()
    if MPI is not None:
        from shmdist.rendezvous import launchers
        launch = launchers.detect()
        size = MPI.COMM_WORLD.Get_size()
        if launch.world_size > 0 and size != launch.world_size:
            why = (f"mpi4py's MPI_COMM_WORLD has {size} rank(s) but the launcher ({launch.source}) started "
                   f"{launch.world_size}")
    if why:
        _mpi_unusable = why
        if settings.get(ENV) == "mpi":
            raise DistError(f"{ENV}=mpi: {why}; install mpi4py built against this MPI, or set {ENV}=gloo or tcp")
        log.info("inter-host engine: not MPI: %s", why)


def host_names(comm) -> dict:
    """rank -> host name, of the group's ranks: published when the group is
    made (every rank of it is there), so that an error after a host became
    unreachable can still name it."""
    store = comm.world.store
    store.set(f"hostname/{comm.rank}", socket.gethostname().encode())
    names = {}
    for r in comm.group.ranks:
        try:
            names[r] = bytes(store.get(f"hostname/{r}", comm.world.timeout)).decode()
        except DistError:
            names[r] = "?"
    return names


def on_host(comm, e: DistError, peers) -> DistError:
    """``e`` with the hosts of ``peers`` (those of another node) named."""
    names = getattr(comm, "host_names", {})
    where = []
    for p in peers:
        if p is None or p not in comm.node_of or comm.node_of[p] == comm.node_of[comm.rank]:
            continue
        members = comm.nodes[comm.node_of[p]]
        where.append(f"rank {p} is on host {names.get(p, '?')} (ranks {members})")
    if not where or "is on host" in str(e):
        return e
    return type(e)(f"{e}; {'; '.join(where)}")


def leader_was_away(comm, e: DistError) -> DistError:
    """A non-leader's local step failed while its leader (maybe) waited on
    the other hosts: say which hosts those are."""
    leader = comm.local[0]
    if str(leader) not in str(e) or "is on host" in str(e):
        return e
    names = getattr(comm, "host_names", {})
    others = [f"{names.get(m[0], '?')} (ranks {m})" for m in comm.nodes if comm.rank not in m]
    return type(e)(f"{e}; rank {leader} is this host's leader, which exchanges with the other hosts: "
                   f"host {', host '.join(others)}; if it timed out too, one of those is unreachable or its "
                   "ranks died")


def shares_were_away(comm, e: DistError) -> DistError:
    """A local step of a sharded all_reduce failed (a local rank gave up
    on its share's exchange, or waited for one that did): name the hosts
    the local ranks exchange shares with."""
    if "is on host" in str(e) or " on host " in str(e):
        return e
    names = getattr(comm, "host_names", {})
    others = [f"host {names.get(m[0], '?')} (ranks {m})" for m in comm.nodes if comm.rank not in m]
    return type(e)(f"{e}; this host's ranks each exchange a share of the all_reduce with {', '.join(others)}; "
                   "one of those is unreachable or its ranks died")


def for_comm(comm):
    """The engine for a HierComm's lane (None: the point-to-point engine
    carries everything). Made now, while every member of the group is
    here (group creation is collective), among the members of this rank's
    lane only: a collective never makes it lazily on some ranks alone."""
    global _chosen
    comm.host_names = host_names(comm)
    kind = choose(getattr(comm.world, "backend", "shm"))
    if _chosen != kind:
        log.info("inter-host engine: %s (%s=%s)", kind, ENV, settings.get(ENV))
    _chosen = kind
    if kind == "tcp":
        return None
    engine = (GlooInter if kind == "gloo" else MpiInter)(comm)
    if len(engine.leaders) > 1:
        try:
            engine._setup("making the group", comm.world.timeout)
        except BaseException:
            engine.broken = "its set-up failed"
            engine.close()
            raise
        engine.ready = True
    return engine


def _bytes_at(addr: int, nbytes: int):
    return (ctypes.c_uint8 * nbytes).from_address(addr)


class _Pending:
    """Started messages of one exchange: (handle, peer, 'send'|'receive')."""

    def __init__(self, inter, what: str):
        self.inter, self.what, self.items = inter, what, []

    def wait(self, timeout: float) -> None:
        self.inter._wait(self, timeout)


class _Gather:
    """A started all_gather of the lane (start_gather); wait() finishes it."""

    def __init__(self, inter, what: str, handle, keep):
        self.inter, self.what, self.handle, self.keep = inter, what, handle, keep

    def wait(self, timeout: float) -> None:
        self.inter._gather_wait(self, timeout)


class _Inter:
    """The messages between this rank and the other members of its lane
    (local rank i of every node; lane 0 is the leaders). ``leaders`` is the
    lane's members (the name from when only leaders had one)."""
    kind = ""
    gathers = False   # has all_gather (the sharded all_reduce's leg in one collective)

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.rank
        self.leaders = list(getattr(comm, "lane", comm.leaders))
        self.index = {r: i for i, r in enumerate(self.leaders)}
        self.sent: dict[int, int] = {}
        self.got: dict[int, int] = {}
        self.ready = False
        self.names: dict[int, str] = {}
        self.broken = ""

    def carries(self, peer: int) -> bool:
        c = self.comm
        return peer in self.index and c.node_of[peer] != c.node_of[self.rank]

    def start(self, what: str, sends: list, recvs: list, timeout: float):
        """Start the leader-to-leader messages of ``sends``/``recvs``; return the others, and the pending."""
        mine_s = [(b, p) for b, p in sends if self.carries(p)]
        mine_r = [(b, p) for b, p in recvs if self.carries(p)]
        if not mine_s and not mine_r:
            return sends, recvs, None
        self._not_broken(what)
        if not self.ready:
            self._setup(what, timeout)
            self.ready = True
        pending = _Pending(self, what)
        for buf, peer in mine_r:
            if buf.nbytes:
                n = self.got[peer] = self.got.get(peer, 0) + 1
                pending.items.append((self._recv(buf, peer, n % TAG_SPAN), peer, "receive"))
        carried["messages"] += len(mine_s) + len(mine_r)
        carried["bytes"] += sum(b.nbytes for b, _ in mine_s) + sum(b.nbytes for b, _ in mine_r)
        for buf, peer in mine_s:
            if buf.nbytes:
                n = self.sent[peer] = self.sent.get(peer, 0) + 1
                pending.items.append((self._send(buf, peer, n % TAG_SPAN), peer, "send"))
        rest_s = [(b, p) for b, p in sends if not self.carries(p)]
        rest_r = [(b, p) for b, p in recvs if not self.carries(p)]
        return rest_s, rest_r, pending

    def _agree(self, what: str, timeout: float) -> None:
        """Every leader publishes its choice and host name, and compares."""
        store = self.comm.world.store
        key = f"inter/{self.comm.gid}/{getattr(self.comm, 'lane_index', 0)}"
        store.set(f"{key}/{self.rank}", json.dumps([self.kind, socket.gethostname()]).encode())
        for r in self.leaders:
            kind, name = json.loads(store.get(f"{key}/{r}", timeout))
            self.names[r] = name
            if kind != self.kind:
                raise DistMismatchError(
                    f"rank {self.rank}: {what}: rank {r} chose the inter-host engine '{kind}' but this rank "
                    f"'{self.kind}'; set {ENV} alike on every host (or install the same packages)")

    def host_of(self, peer: int) -> str:
        members = next((m for m in self.comm.nodes if peer in m), [peer])
        name = self.names.get(peer) or self.comm.host_names.get(peer, "?")
        return f"host {name} (ranks {members})"

    def _not_broken(self, what: str) -> None:
        if self.broken:
            raise DistPeerError(f"rank {self.rank}: {what}: the {self.kind} engine between hosts failed "
                                f"earlier ({self.broken})")

    def _broke(self, what: str, why: str, lost: str, timed_out: bool, hint: str) -> DistError:
        """The engine between hosts failed: later calls fail at once (``why``),
        this rank's goodbye passes ``lost`` on, MPI aborts at exit; the error to raise."""
        self.broken = why
        self.comm.engine.note_failed_over(lost)
        if self.kind == "mpi":
            _mpi_lost(why)
        cls = DistTimeoutError if timed_out else DistPeerError
        return cls(f"rank {self.rank}: {what}: {why}; {hint}")

    def _gather_failed(self, what: str, e: BaseException, timed_out: bool) -> DistError:
        """all_gather among the lane failed: name every other host of the lane."""
        others = [p for p in self.leaders if p != self.rank]
        where = f"rank(s) {others} on {', '.join(self.host_of(p) for p in others)}"
        return self._broke(what, f"all_gather with {where} over {self.kind}: {type(e).__name__}: {e}",
                           f"{where} failed to answer over {self.kind}", timed_out,
                           "one of those hosts is unreachable or its ranks died")

    def all_gather(self, what: str, mine, got: dict, timeout: float) -> None:
        """The engine's all_gather among the lane: ``mine`` (an array) to
        every member, theirs into ``got`` {rank: array}."""
        self.start_gather(what, mine, got, timeout).wait(timeout)

    def _start_gather(self, what: str):
        self._not_broken(what)
        n = len(self.leaders)
        carried["messages"] += 2 * (n - 1)

    def _failed(self, what: str, peer: int, role: str, e: BaseException, timed_out: bool) -> DistError:
        where = f"rank {peer} on {self.host_of(peer)}"
        return self._broke(what, f"{role} with {where} over {self.kind}: {type(e).__name__}: {e}",
                           f"{where} failed in a {role} over {self.kind}", timed_out,
                           "that host is unreachable or its ranks died")

    def close(self) -> None:
        pass


class GlooInter(_Inter):
    kind = "gloo"

    def _setup(self, what: str, timeout: float) -> None:
        import torch
        from torch.distributed import ProcessGroupGloo

        from shmdist.rendezvous.hosts import listen_address
        self._agree(what, timeout)
        self.torch = torch
        opts = ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=timeout)
        opts._devices = [ProcessGroupGloo.create_device(hostname=listen_address(self.comm.world.store))]
        lane = getattr(self.comm, "lane_index", 0)
        store = _TorchStore(self.comm.world.store, f"inter/{self.comm.gid}/{lane}/gloo/", timeout)
        try:
            self.pg = ProcessGroupGloo(store, self.index[self.rank], len(self.leaders), opts)
        except RuntimeError as e:
            raise DistPeerError(f"rank {self.rank}: {what}: could not connect the gloo process group of "
                                f"the leaders {self.leaders} ({e})") from e

    def _tensor(self, buf):
        return self.torch.frombuffer(_bytes_at(buf.addr, buf.nbytes), dtype=self.torch.uint8)

    # No all_gather: the sharded all_reduce's shares go by send and recv, which move the
    # bytes straight between the shares' buffers; gloo's allgather flattens its outputs into
    # a fresh tensor, copies them out again and needs its own copy of the input (measured,
    # 16 MiB on 2 pretend hosts x 2 ranks: about 100 against 75 ms of CPU per call).

    def _send(self, buf, peer: int, tag: int):
        return self.pg.send([self._tensor(buf)], self.index[peer], tag)

    def _recv(self, buf, peer: int, tag: int):
        return self.pg.recv([self._tensor(buf)], self.index[peer], tag)

    def _wait(self, pending: _Pending, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for work, peer, role in pending.items:
            left = max(0.001, deadline - time.monotonic())
            try:
                work.wait(datetime.timedelta(seconds=left))
            except RuntimeError as e:
                timed_out = time.monotonic() >= deadline or "imeout" in str(e)
                raise self._failed(pending.what, peer, role, e, timed_out) from None

    def close(self) -> None:
        pg = getattr(self, "pg", None)
        self.pg = None
        if pg is not None:
            try:
                pg.abort() if self.broken else pg.shutdown()
            except Exception:   # noqa: BLE001 - closing after a failure
                pass


class MpiInter(_Inter):
    kind = "mpi"

    def __init__(self, comm):
        super().__init__(comm)
        MPI, why = load_mpi()   # initialized by prepare() already, normally
        if MPI is None:
            raise DistError(f"rank {self.rank}: {ENV}=mpi: {why}")

    def _setup(self, what: str, timeout: float) -> None:
        from mpi4py import MPI
        self.MPI = MPI
        world = MPI.COMM_WORLD
        if world.Get_size() != self.comm.world.world_size or world.Get_rank() != self.rank:
            raise DistError(f"rank {self.rank}: {what}: {ENV}=mpi needs each rank's number to be its "
                            f"MPI_COMM_WORLD rank (this is MPI rank {world.Get_rank()} of {world.Get_size()}); "
                            f"start init_process_group without rank/world_size under mpirun, or set {ENV}=gloo")
        self._agree(what, timeout)
        group = world.Get_group().Incl(self.leaders)
        self.mpi = world.Create_group(group, tag=int(self.comm.gid % 32768))
        group.Free()

    gathers = True

    def start_gather(self, what: str, mine, got: dict, timeout: float):
        """MPI_Iallgather among the lane, started; waited for (our timeout) by _Gather.wait."""
        import numpy as np
        self._start_gather(what)
        carried["bytes"] += mine.nbytes * 2 * len(got)
        flat = mine.view("uint8").reshape(-1)
        into = np.empty((len(self.leaders), flat.size), dtype=np.uint8)
        req = self.mpi.Iallgather([flat, self.MPI.BYTE], [into, self.MPI.BYTE])
        return _Gather(self, what, req, (into, got))

    def _gather_wait(self, gather, timeout: float) -> None:
        into, got = gather.keep
        deadline = time.monotonic() + timeout
        while not gather.handle.Test():
            if time.monotonic() > deadline:
                raise self._gather_failed(gather.what, TimeoutError(f"not done within {timeout:g} s"), True)
            time.sleep(0.00005)
        for i, p in enumerate(self.leaders):
            if p != self.rank:
                got[p].view("uint8").reshape(-1)[:] = into[i]

    def _send(self, buf, peer: int, tag: int):
        return self.mpi.Isend([_bytes_at(buf.addr, buf.nbytes), self.MPI.BYTE], self.index[peer], tag)

    def _recv(self, buf, peer: int, tag: int):
        return self.mpi.Irecv([_bytes_at(buf.addr, buf.nbytes), self.MPI.BYTE], self.index[peer], tag)

    def _wait(self, pending: _Pending, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for req, peer, role in pending.items:
            while not req.Test():
                if time.monotonic() > deadline:
                    raise self._failed(pending.what, peer, role, TimeoutError(f"not done within {timeout:g} s"),
                                       True)
                time.sleep(0.00005)

    def close(self) -> None:
        comm = getattr(self, "mpi", None)
        self.mpi = None
        if comm is not None and not self.broken:
            try:
                comm.Free()
            except Exception:   # noqa: BLE001
                pass


_lost: list = []


def _mpi_lost(why: str) -> None:
    """The MPI engine gave up on a peer. MPI cannot drop a process from a
    job: MPI_Finalize (mpi4py's, at exit) would wait for the lost one
    forever, and so would the launcher. So at exit this process calls
    MPI_Abort instead, which ends the whole job, as MPI's default error
    handler would have at the failure itself; the DistError was raised
    first, so the program could report it."""
    if not _lost:
        import atexit
        atexit.register(_abort_at_exit)   # runs before mpi4py's MPI_Finalize (registered earlier)
    _lost.append(why)


def _abort_at_exit() -> None:
    from mpi4py import MPI
    log.error("inter-host engine mpi lost a host (%s): MPI_Abort, as MPI_Finalize would wait forever", _lost[0])
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)


class _TorchStore:
    """Our store as torch's c10d Store (gloo's rendezvous), keys under a prefix."""

    def __new__(cls, store, prefix: str, timeout: float):
        import torch.distributed as tdist

        class Adapter(tdist.Store):
            def __init__(self):
                super().__init__()

            def set(self, key, value):
                store.set(prefix + key, value if isinstance(value, bytes) else bytes(value, "utf-8")
                          if isinstance(value, str) else bytes(value))

            def get(self, key):
                return store.get(prefix + key, timeout)

            def add(self, key, amount):
                return store.add(prefix + key, amount)

            def wait(self, keys, *args):
                for key in keys:
                    store.get(prefix + key, timeout)

            def check(self, keys):
                raise NotImplementedError

            def set_timeout(self, t):
                pass

        return Adapter()

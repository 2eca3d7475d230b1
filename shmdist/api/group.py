"""Process groups and the point-to-point API (the torch.distributed surface).

One default group per process (as torch has); ``new_group`` makes more.
Ranks passed by users (``dst``, ``src``, roots) are global ranks, as in torch.
"""
from __future__ import annotations

import atexit
import datetime
import errno
import hashlib
import json
import operator
import os
import threading

import numpy as np

from shmdist import _core, errors, settings
from shmdist.comm import arena, shared
from shmdist.rendezvous import store as rendezvous
from shmdist import trace   # the flight recorder: hook lines marked "trace:" below
from shmdist.transport.engine import Engine
from shmdist.api.fast import paths as _fast
from shmdist.errors import DistError, DistMismatchError, DistNotInitializedError, DistPeerError
from shmdist.request import DistributedRequest
from shmdist.transport.shm import ShmHost
from shmdist.tensors import as_buf

DEFAULT_TIMEOUT = 1800.0   # seconds, torch's default for CPU backends
FAILED_INIT_LINGER = 3.0   # seconds the master keeps the store up after a failed init
BACKENDS = {"shm": "shm", "gloo": "shm", "tcp": "tcp"}


def _seconds(timeout, who: str = "", default: str = "") -> float:
    """A call's ``timeout`` in seconds (None: SHMDIST_TIMEOUT or the default); a bad one is a
    ValueError that starts with ``who`` and, given ``default``, says it may be left out."""
    if timeout is None:
        value = settings.get("SHMDIST_TIMEOUT")
        return DEFAULT_TIMEOUT if value is None else value
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < 1e9:
        said = (f"timeout must be a positive number of seconds (finite, below 1e9) or a timedelta, "
                f"got {timeout!r}")
        said = (f"{who}: {said}" if who else said) + (f"; or leave it out for {default}" if default else "")
        raise ValueError(said)
    return float(timeout)


def _whole(what: str, value) -> int:
    """init_process_group's ``rank`` or ``world_size``: an int (numpy's too), not a bool or 1.0."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"init_process_group: {what} must be an int, got {value!r} "
                    f"({type(value).__name__}); leave it out to take it from the launcher")


class ProcessGroup:
    """A set of global ranks that communicate together.

    ``rank()`` and ``size()`` are this process's rank in the group (-1 when
    it is not a member) and the group's size, as in torch.
    """

    def __init__(self, world: "World", gid: int, ranks: tuple[int, ...], timeout: float):
        self.world = world
        self.gid = gid
        self.ranks = ranks
        self.timeout = timeout
        self._rank = ranks.index(world.rank) if world.rank in ranks else -1
        self.destroyed = False
        self.coll = None       # the collective engine of this group, when a member

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_member(self) -> bool:
        return self._rank >= 0

    def group_rank(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)

    def __repr__(self) -> str:
        return f"<shmdist.ProcessGroup {self.gid} ranks={list(self.ranks)}>"


class World:
    """Everything init_process_group set up in this process."""

    def __init__(self, rank, world_size, backend, timeout, store, owned_store):
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout = timeout
        self.store = store
        self.owned_store = owned_store
        self.host = None
        self.tcp = None
        self.engine = None
        self.groups: list[ProcessGroup] = []
        self.default: ProcessGroup | None = None
        self.pid = os.getpid()
        self.forked = False
        self.lock = threading.Lock()
        self.new_groups = 0    # shmdist.new_group calls this rank made (every rank makes the same)

    def allocate_gid(self, store, first: bool) -> int:
        """The id of a new group, from the one allocator of every group id
        (shmdist.new_group's, torch's subgroups'): the group's ``first``
        member takes the next number of the world's store counter and leaves
        it in ``store``, a store only this group's making uses, for the
        others (torch calls its backend on the members only, so they cannot
        count locally). Ids count from 1 (0 is the default group), are never
        handed out twice (a failed new_group consumes its id too, so its
        store keys are never met again) and stay below engine.COLLECTIVE_GID
        (2**40 groups: more than any job makes)."""
        if first:
            store.set("gid", str(self.store.add("gids", 1)).encode())
        return int(store.get("gid", self.timeout))

    def barrier(self, name: str) -> None:
        """Store-based barrier of every rank of the world (set-up only)."""
        self.store.arrive(name, self.world_size, self.timeout)

    def close(self, failed: bool = False) -> None:
        """Leave the job. ``failed``: set-up went wrong, so also remove the
        names of the segments (normally gone already; idempotent)."""
        if self.forked:
            return      # a forked child: leave the parent's resources alone
        # Another thread may sleep inside a wait or a collective: its call fails, and the
        # memory is unmapped only once it is out (else it stays mapped until exit).
        why = "destroy_process_group was called"
        trace.left(self)   # trace: the ring says the rank left
        quiet = [g.coll.retire(why, RETIRE_SECONDS) if g.coll is not None else True for g in self.groups]
        cause = self.engine.leave_cause() if self.engine is not None else ""
        if self.tcp is not None:
            self.tcp.close(cause, self.engine.partly_sent() if self.engine is not None else ())
        engine_quiet = True
        if self.host is not None:
            self.host.goodbye(cause)    # before the sends fail (single copies: ShmHost.goodbye)
        if self.engine is not None:
            self.engine.close()
            engine_quiet = self.engine.quiet(RETIRE_SECONDS)
        for g, ok in zip(self.groups, quiet):
            g.destroyed = True
            if g.coll is not None:
                if failed:
                    g.coll.unlink()
                if ok:
                    g.coll.close()
        if self.host is not None:
            if failed:
                self.host.seg.unlink()
            self.host.close(cause, unmap=engine_quiet)
        if self.owned_store is not None:
            self.owned_store.close(linger=FAILED_INIT_LINGER if failed else 0.0)


RETIRE_SECONDS = 2.0   # how long destroy waits for another thread to leave a wait before unmapping

_world: World | None = None     # the fast paths (fast.paths) point at it while it may be used


def world(op: str = "this call") -> World:
    w = _world
    if w is None:
        raise DistNotInitializedError(
            f"{op}: default process group has not been initialized, please make sure to call "
            "shmdist.init_process_group first")
    if w.forked:
        raise DistError(f"{op}: {_forked_why(w)}")
    return w


def _forked_why(w: World) -> str:
    return (f"this process (pid {os.getpid()}) was forked from rank {w.rank} (pid {w.pid}) "
            "after init_process_group; a forked child cannot use its parent's group. Call "
            "init_process_group in the child with its own rank, or communicate from the parent")


def _mark_forked() -> None:
    """In a forked child: the inherited group belongs to the parent."""
    _fast.attach(None)
    _claims.clear()                 # (the parent's claims: a child that inits is another process)
    if _world is not None:
        _world.forked = True
        if _world.engine is not None:   # requests the parent made wait here no more
            _world.engine.forked = _forked_why(_world)
            queues = _world.engine.queues
            for req in _world.engine.lane.pending_requests() + [
                    op.req for q in queues.awaiting.values() for op in q]:   # (the lane's single copies)
                if req is not None:
                    req._lane = None


os.register_at_fork(after_in_child=_mark_forked)


@atexit.register
def _close_at_exit() -> None:
    """A script that never called destroy_process_group still says goodbye,
    so its peers learn it left rather than died."""
    global _world
    w, _world = _world, None
    _fast.attach(None)
    if w is not None:
        w.close()


def init_process_group(backend: str | None = None, init_method: str | None = None, timeout=None,
                       world_size: int = -1, rank: int = -1, store=None, group_name: str = "",
                       pg_options=None, device_id=None) -> None:
    """Join the job: meet the other ranks, map shared memory, build the default group."""
    global _world
    if _world is not None and not _world.forked:
        raise DistError(f"rank {_world.rank}: init_process_group: trying to initialize the default "
                        "process group twice; call destroy_process_group first")
    rank, world_size = _whole("rank", rank), _whole("world_size", world_size)
    if init_method is not None and not isinstance(init_method, str):
        raise TypeError(f"init_process_group: init_method must be a string ('env://', 'tcp://HOST:PORT' "
                        f"or 'file:///path'), got {type(init_method).__name__}")
    if store is not None and not all(callable(getattr(store, m, None)) for m in ("set", "get", "add")):
        raise TypeError(f"init_process_group: store must be a key-value store with set, get and add (a "
                        f"torch.distributed Store or shmdist's), got {type(store).__name__}")
    seconds = _seconds(timeout, "init_process_group")
    name = str(backend or "shm").lower()
    if name not in BACKENDS:
        raise DistError(f"init_process_group: unknown backend '{backend}'; shmdist offers 'shm' "
                        "(shared memory between local ranks), 'tcp', and 'gloo' as a name for 'shm'")
    kind = BACKENDS[name]
    if settings.get("SHMDIST_TRANSPORT") == "tcp":
        kind = "tcp"
    if store is None:
        scheme, where, rank, world_size = rendezvous.parse_init_method(init_method, rank, world_size)
    else:
        scheme, where = "store", None
        if rank < 0 or world_size < 0:
            rank = int(settings.launcher("RANK") or rank) if rank < 0 else rank
            world_size = int(settings.launcher("WORLD_SIZE") or world_size) if world_size < 0 else world_size
    if not isinstance(world_size, int) or world_size < 1:
        raise DistError(f"init_process_group: world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise DistError(f"init_process_group: rank {rank!r} is outside [0, {world_size}); give each "
                        f"process a distinct rank from 0 to {world_size - 1}")
    w = None
    try:
        owned = None
        if store is None:
            if scheme == "tcp":
                host, port = where
                label = "env://" if (init_method or "env://").startswith("env") else "tcp://"
                owned = rendezvous.TCPStore(host, port, is_master=(rank == 0), timeout=seconds, scheme=label)
            else:
                owned = rendezvous.FileStore(where, world_size, seconds)
            store = owned
        watched = rendezvous.WatchedStore(rendezvous.PrefixStore("shmdist/", store), rank, seconds)
        w = World(rank, world_size, kind, seconds, watched, owned)
        trace.start(rank, world_size)   # trace: the ring exists before peers look for it
        _setup(w)
        trace.joined(w)                 # trace: map the peers' rings, record the default group
    except BaseException as e:
        if w is not None:
            if isinstance(e, DistPeerError):    # others that find this rank gone learn the real cause
                try:
                    w.store.set(f"failed/{rank}", str(e).encode()[:1000])
                except Exception:   # noqa: BLE001 - the store may be gone too
                    pass
            w.close(failed=True)
        if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):
            raise DistError(f"rank {rank}: init_process_group: out of file descriptors ({e.strerror}); "
                            "each rank needs a few per peer and rank 0 a few more for the store: raise "
                            "the limit (ulimit -n)") from e
        raise
    _world = w
    _fast.set_enabled(settings.get("SHMDIST_FAST"), w)


_claims: dict[int, str] = {}    # rank -> this process's token of its last claim of it (in a store)


def _claimed_before(store, rank: int, claim: int) -> bool:
    """Whether claim number ``claim`` of ``rank`` in ``store`` was this process's last one."""
    mine = _claims.get(rank)
    if mine is None:
        return False
    try:
        with errors.expected():
            return store.get(f"claim/{rank}/{claim}", 1.0).decode() == mine
    except DistError:
        return False


def _setup(w: World) -> None:
    who = f"rank {w.rank}: init_process_group"
    store = w.store
    claim = store.add(f"claim/{w.rank}", 1)
    token = f"{os.getpid()}:{os.urandom(8).hex()}"
    store.set(f"claim/{w.rank}/{claim}", token.encode())
    if claim > 1 and not _claimed_before(store, w.rank, claim - 1):
        store.add("claimed-twice", 1)     # the ranks of the other job learn it too
        raise DistError(f"{who}: rank {w.rank} is already claimed by another process; give each "
                        "process a distinct rank (and, for file://, a fresh file). If two jobs were given "
                        "the same master port or file, give each its own, or a job identity "
                        f"({rendezvous.JOB_ENV})")
    _claims[w.rank] = token
    if claim > 1:
        # this process claimed this rank in the store before, and left (destroy_process_group):
        # the same store again (torch keeps its TCPStore per port and hands it to the next init;
        # a file:// kept), so this init's keys go apart from the last one's, where each rank's
        # init of the same number meets
        w.store = store = rendezvous.WatchedStore(
            rendezvous.PrefixStore(f"again/{claim}/", store.store), w.rank, w.timeout)
    me = {"world_size": w.world_size, "host": rendezvous.host_identity(), "pid": os.getpid(),
          "backend": w.backend}
    store.set(f"info/{w.rank}", json.dumps(me).encode())
    infos = []
    for r in range(w.world_size):   # check each as it comes: a rank told a larger world must not wait
        info = json.loads(store.get(f"info/{r}", w.timeout))   # for ranks that will never exist
        infos.append(info)
        if info["world_size"] != w.world_size:
            raise DistMismatchError(f"{who}: rank {r} was started with world_size {info['world_size']} "
                                    f"but this rank with {w.world_size}; start every rank with the same "
                                    "world_size")
        if info["backend"] != w.backend:
            raise DistMismatchError(f"{who}: rank {r} uses backend '{info['backend']}' but this rank "
                                    f"'{w.backend}'; pass the same backend everywhere")
    # A node is a set of ranks that share memory: a host, or each rank alone with backend "tcp".
    w.nodes = [info["host"] if w.backend == "shm" else f"{info['host']}/{r}" for r, info in enumerate(infos)]
    local = [r for r in range(w.world_size) if w.nodes[r] == w.nodes[w.rank]]
    remote = [r for r in range(w.world_size) if w.nodes[r] != w.nodes[w.rank]]
    same_machine = [r for r, info in enumerate(infos) if info["host"] == me["host"]]
    store.peers = {r: infos[r]["pid"] for r in same_machine if r != w.rank}   # watched from now on
    oversubscribed = len(same_machine) > len(os.sched_getaffinity(0))
    transports, ctl, ctl_memory = [], None, None
    if w.backend == "shm":
        w.host = ShmHost.open(store, f"seg/{me['host']}", local, w.rank, who, w.timeout)
        ctl, ctl_memory = w.host.my_ctl, w.host.seg.array
        transports.append(w.host)
    if remote:
        from shmdist.transport import tcp  # loads only when a job spans hosts
        w.tcp = tcp.Transport(w.rank, remote, store, tcp.job_digest(infos), w.timeout, who,
                              settings.get(rendezvous.SECRET_ENV), ctl, ctl_memory)
        transports.append(w.tcp)
    if w.host is not None:
        w.host.watch({r: infos[r]["pid"] for r in local if r != w.rank})
    w.engine = Engine(w.rank, w.timeout, w.tcp.ctl if w.tcp else ctl, transports, oversubscribed)
    w.default = ProcessGroup(w, 0, tuple(range(w.world_size)), w.timeout)
    w.groups.append(w.default)
    w.default.coll = _open_collectives(w, w.default)
    if not rendezvous.job_identity() and store.add("claimed-twice", 0):   # two jobs may have met
        raise DistError(f"{who}: a rank of this job was claimed twice: two jobs were started with the same "
                        "init_method (master port or file) and met in one rendezvous, so this job's ranks "
                        "may not be its own. Give each job its own port or file, or a job identity "
                        f"({rendezvous.JOB_ENV})")
    w.barrier("init")
    if w.host is not None:      # every local rank's control block is set now
        w.host.probe_single_copy(settings.get("SHMDIST_SINGLE_COPY") > 0)


def open_group(w: World, gid: int, ranks: tuple, timeout: float, made=None) -> ProcessGroup:
    """The one group factory (new_group, torch's subgroups): the group, its
    collective engine when this rank is a member (_open_collectives picks it
    by the members' hosts), then ``made()`` (the members' last agreement),
    and the group joins the world, so World.close closes it and
    memory_usage counts it. A failure closes what was opened."""
    g = ProcessGroup(w, gid, tuple(ranks), timeout)
    try:
        if g.is_member:
            g.coll = _open_collectives(w, g)
        if made is not None:
            made()
    except BaseException:
        if g.coll is not None:
            g.coll.close()
            g.coll = None
        g.destroyed = True
        raise
    with w.lock:
        w.groups.append(g)
    trace.group_made(w, g)   # trace: record its collectives
    return g


def _open_collectives(w: World, g: ProcessGroup):
    """The collective engine of a group: its shared arena when every member
    shares this rank's memory, else the hierarchical one (by host, then TCP)."""
    if w.host is not None and all(w.nodes[r] == w.nodes[w.rank] for r in g.ranks):
        return arena.open_group(w, str(g.gid), g.ranks)
    from shmdist.comm import hier
    return hier.open_group(w, g)


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Leave the job (default group) or retire one group. Pending sends that
    have not completed are dropped; completed ones stay deliverable. The
    requests of operations still pending fail: their wait() raises."""
    global _world
    w = world("destroy_process_group")
    if group is None or group is w.default:
        _world = None
        _fast.attach(None)
        w.close()
        return
    group.destroyed = True
    why = f"group {list(group.ranks)} was destroyed (destroy_process_group)"
    w.engine.fail_group((group.gid,), why)
    if group.coll is not None and group.coll.retire(why, RETIRE_SECONDS):
        group.coll.close()


def is_initialized() -> bool:
    return _world is not None


def get_backend(group: ProcessGroup | None = None) -> str:
    return world("get_backend").backend


def _group(group, op: str) -> tuple[World, ProcessGroup]:
    w = world(op)
    g = w.default if group is None else group
    if not isinstance(g, ProcessGroup):
        raise TypeError(f"rank {w.rank}: {op}: group must be a shmdist ProcessGroup (from new_group) "
                        f"or None, got {type(g).__name__}")
    if g.destroyed:
        raise DistError(f"rank {w.rank}: {op}: group {list(g.ranks)} was destroyed")
    return w, g


def get_rank(group: ProcessGroup | None = None) -> int:
    w, g = _group(group, "get_rank")
    return g.rank()


def get_world_size(group: ProcessGroup | None = None) -> int:
    w, g = _group(group, "get_world_size")
    return g.size() if g.is_member else -1


def new_group(ranks=None, timeout=None, backend=None, pg_options=None,
              use_local_synchronization=False, group_desc=None) -> ProcessGroup:
    """Make a group of ``ranks`` (all ranks when None). Every rank of the job
    must call it, in the same order, as in torch; non-members get a group
    whose ``rank()`` is -1. A call one rank refuses (its own arguments are
    bad) is still a call: that rank says so through the store and raises its
    own error, the others raise a DistMismatchError naming the refusal, and
    every rank's next new_group lines up."""
    w = world("new_group")
    who = f"rank {w.rank}: new_group"
    with w.lock:
        w.new_groups += 1    # every rank, whatever happens next: its calls stay in step with the others'
        call = w.new_groups
    asked = rendezvous.PrefixStore(f"new_group/{call}/", w.store)
    try:
        members, seconds = _new_group_args(w, who, ranks, timeout, backend)
    except Exception:
        _ask(w, asked, None)      # a refusal: nothing to wait for, the others learn it from the store
        raise
    # Agree on the members first, through the store, before any id or arena exists:
    # ranks that disagree (or refused) then fail with the mismatch and map nothing.
    _ask(w, asked, members)
    asked.get("asked", w.timeout)
    sig = _members_digest(members)
    agree = int(asked.add(f"sig/{sig}", 0))
    if agree != w.world_size:
        theirs, refused = {}, []
        for r in range(w.world_size):
            got = json.loads(asked.get(f"ranks/{r}", w.timeout))
            if got is None:
                refused.append(r)
            elif tuple(got) != members:
                theirs.setdefault(tuple(got), []).append(r)
        said = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} asked for {list(a)}"
                for a, rs in theirs.items()]
        if refused:
            said.append(f"rank{'s' if len(refused) > 1 else ''} {', '.join(map(str, refused))} called new_group "
                        "with arguments it refused (its own error says why)")
        raise DistMismatchError(f"{who}: this rank asked for a group of ranks {list(members)}, but "
                                f"{'; '.join(said)} (only {agree} of {w.world_size} ranks agree); every rank "
                                "must call new_group with the same valid ranks, in the same order")
    gid = w.allocate_gid(asked, w.rank == 0)
    # the last store call: rank 0 may leave right after it
    return open_group(w, gid, members, seconds, made=lambda: w.barrier(f"group/{gid}/made"))


def _new_group_args(w: World, who: str, ranks, timeout, backend) -> tuple[tuple, float]:
    """new_group's members (sorted) and timeout in seconds, or this rank's refusal of them."""
    if backend is not None and str(backend).lower() not in BACKENDS:
        raise DistError(f"{who}: unknown backend '{backend}'; pass None or one of {sorted(BACKENDS)}")
    try:
        members = list(range(w.world_size)) if ranks is None else list(ranks)
    except TypeError:
        raise TypeError(f"{who}: ranks must be a list of global ranks (or None for every rank), got "
                        f"{type(ranks).__name__}") from None
    for r in members:
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < w.world_size:
            raise DistError(f"{who}: rank {r!r} is not a rank of this job (0..{w.world_size - 1}); pass "
                            "global ranks of the job")
    if len(set(members)) != len(members):
        raise DistError(f"{who}: ranks {members} repeat a rank; list each rank once")
    seconds = w.timeout if timeout is None else _seconds(timeout, who, "the job's timeout")
    return tuple(sorted(members)), seconds


def _ask(w: World, asked, members) -> None:
    """This rank's part of a new_group call in the store: what it asks for
    (None: it refused its own arguments), then its arrival; the last of the
    job's ranks to arrive marks the call asked. Waits for nothing."""
    asked.set(f"ranks/{w.rank}", json.dumps(None if members is None else list(members)).encode())
    if members is not None:
        asked.add(f"sig/{_members_digest(members)}", 1)
    if int(asked.add("arrived", 1)) == w.world_size:
        asked.set("asked", b"1")


def _members_digest(members) -> str:
    """A short name for a list of ranks (store keys stay small for any group)."""
    return hashlib.sha1(repr(tuple(members)).encode()).hexdigest()[:12]


# ---------------------------------------------------------------- point to point

def _peer(w: World, g: ProcessGroup, peer, op: str, what: str) -> int:
    if not isinstance(peer, int) or isinstance(peer, bool):
        raise TypeError(f"rank {w.rank}: {op}: {what} must be an int (a global rank), got {peer!r}")
    if peer not in g.ranks:
        where = "the job" if g is w.default else f"group {list(g.ranks)}"
        raise DistError(f"rank {w.rank}: {op}: {what}={peer} is not a rank of {where}; pass a global "
                        "rank that belongs to the group")
    if peer == w.rank:
        raise DistError(f"rank {w.rank}: {op}: {what}={peer} is this process's own rank; a rank cannot "
                        "send to or receive from itself")
    return peer


def _member(w: World, g: ProcessGroup, op: str) -> None:
    if not g.is_member:
        raise DistError(f"rank {w.rank}: {op}: this rank is not a member of group {list(g.ranks)}; "
                        "only its members may use it")


def _tag(w, tag, op) -> int:
    if not isinstance(tag, int) or isinstance(tag, bool):
        raise TypeError(f"rank {w.rank}: {op}: tag must be an int, got {tag!r}")
    if not -(1 << 63) <= tag < (1 << 63):
        raise DistError(f"rank {w.rank}: {op}: tag {tag} does not fit in 64 bits; use a tag between "
                        f"{-(1 << 63)} and {(1 << 63) - 1}")
    return tag


def _send_py(tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> DistributedRequest:
    """send (the C entry point _core.send hands calls here unless they are of
    a numpy array): a plain torch tensor's numpy view may take the lane."""
    lane = _fast.lane
    if lane is not None and group is None:
        arr = _fast.array(tensor)
        if arr is not None:
            req = lane.send(arr, dst, tag, tensor)   # (a single copy keeps the tensor: the view owns nothing)
            if req is not None:
                return req
    return _send_general(tensor, dst, group, tag)


def _send_general(tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> DistributedRequest:
    w, g = _group(group, "send")
    _member(w, g, "send")
    dst = _peer(w, g, dst, "send", "dst")
    buf = as_buf(tensor, writable=False, who=f"rank {w.rank}: send")
    _fast.learn(w.engine, tensor, buf)
    req = DistributedRequest(w.engine, f"send to rank {dst}")
    trace.p2p(req, True, g.gid, dst, _tag(w, tag, "send"), buf)   # trace
    w.engine.send(req, buf, dst, g.gid, _tag(w, tag, "send"))
    return req


def _recv_py(tensor, src: int | None = None, group: ProcessGroup | None = None,
             tag: int = 0) -> DistributedRequest:
    """recv (as _send_py for send)."""
    lane = _fast.lane
    if lane is not None and group is None and src is not None:
        arr = _fast.array(tensor)
        if arr is not None:
            req = lane.recv(arr, src, tag)
            if req is not None:
                if arr is not tensor:
                    req.tensors = [tensor]
                return req
    return _recv_general(tensor, src, group, tag)


def _recv_general(tensor, src: int | None = None, group: ProcessGroup | None = None,
                  tag: int = 0) -> DistributedRequest:
    w, g = _group(group, "recv")
    _member(w, g, "recv")
    if src is not None:
        src = _peer(w, g, src, "recv", "src")
    buf = as_buf(tensor, writable=True, who=f"rank {w.rank}: recv")
    _fast.learn(w.engine, tensor, buf)
    req = DistributedRequest(w.engine, f"recv from rank {src}" if src is not None else "recv from any rank",
                             [tensor])
    trace.p2p(req, False, g.gid, src, _tag(w, tag, "recv"), buf)   # trace
    w.engine.recv(req, buf, src, g.gid, _tag(w, tag, "recv"), g.ranks)
    return req


# send and recv are C functions (_core, _entry.pxi): a numpy array on the default
# group goes to the lane without a Python frame; everything else comes back here.
send = _core.send
recv = _core.recv
isend = send
irecv = recv


class P2POp:
    """One operation of batch_isend_irecv: ``op`` is shmdist.isend or shmdist.irecv."""

    def __init__(self, op, tensor, peer: int, group: ProcessGroup | None = None, tag: int = 0):
        if op not in (send, recv):
            raise ValueError("P2POp: op must be shmdist.isend or shmdist.irecv")
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


def batch_isend_irecv(p2p_op_list) -> list[DistributedRequest]:
    """Posts the operations in order, after checking the list (as torch does): a bad item posts
    nothing. An operation refused while posting withdraws the receives posted before it (a
    request the caller never gets must not take a message meant for the next receive)."""
    w = world("batch_isend_irecv")
    if not isinstance(p2p_op_list, (list, tuple)):
        raise TypeError(f"rank {w.rank}: batch_isend_irecv: expected a list of shmdist.P2POp, got "
                        f"{type(p2p_op_list).__name__}; nothing was posted")
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise TypeError(f"rank {w.rank}: batch_isend_irecv: item {i} is a {type(p).__name__}, not a "
                            "P2POp; build each with shmdist.P2POp(shmdist.isend or shmdist.irecv, tensor, "
                            "peer); nothing was posted")
    reqs: list[tuple[P2POp, DistributedRequest]] = []
    for p in p2p_op_list:
        try:
            reqs.append((p, p.op(p.tensor, p.peer, p.group, p.tag)))
        except Exception:
            for q, req in reqs:
                if q.op is recv and not req.is_completed():
                    try:
                        req.wait(timeout=0)      # a receive that has not begun is cancelled
                    except DistError:
                        pass
            raise
    return [req for _, req in reqs]


def memory_usage() -> dict:
    """Bytes of shared memory this rank maps, by purpose."""
    w = world("memory_usage")
    out = dict(w.host.memory()) if w.host is not None else {"segment_bytes": 0}
    arenas = sum(g.coll.arena_bytes() for g in w.groups if g.coll is not None)
    out["collective_arenas"] = arenas
    out["empty_arrays"] = shared.mapped_bytes()   # shmdist.empty's memory, all groups (and past worlds)
    out["total_mapped"] = out["segment_bytes"] + arenas + out["empty_arrays"]
    return out

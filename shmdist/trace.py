"""The flight recorder: every rank's recent operations, in shared memory.

Each rank records its last ``SHMDIST_TRACE_SIZE`` operations (default 512)
in a ring of its own: one entry per send, receive and collective, with its
group, arguments, state (posted, waiting, done, failed) and times. The
ring is nameless shared memory (a memfd, ``/memfd:shmdist-trace``) that the
rank keeps open for its whole life, so another process of the same user
(a peer rank, ``shmdist-run``, ``python -m shmdist.doctor``) opens it
through ``/proc/<pid>/fd`` without the rank's help. Every rank maps its
local peers' rings once it joined, and ``shmdist-run`` holds each rank's
ring open, so the history of a rank that was killed stays readable; the
memory goes with the last process that holds it. Nothing appears in
/dev/shm. ``SHMDIST_TRACE=0`` turns recording off.

The hot paths write entries in C (``_trace.h``); the general paths call
``p2p``/``waiting`` here. ``diagnose`` turns the rings of a job into the
table of where each rank is and a verdict in words; it is appended to
the message of a timeout or a dead peer, printed by ``shmdist-run`` on
SIGUSR1 or ``--hang-after``, and by the doctor. On any DistError, with
``SHMDIST_TRACE_DIR`` set, the rank writes its history there as JSON (and
a file torch's flight-recorder analyzer reads).
"""
from __future__ import annotations

import json
import mmap
import os
import pickle
import stat
import struct
import sys
import threading
import time

from shmdist import _core, errors, layout, settings
# The ring's layout, its states and ops: layout.py's "flight recorder" section (the C writer's too).
from shmdist.layout import (TRACE_HEAD as HEAD, TRACE_ENTRY as ENTRY, TRACE_MAGIC as MAGIC,
                            TRACE_VERSION as VERSION, TRACE_META_AT as META_AT, TRACE_META_MAX as META_MAX,
                            TRACE_HDR as _HDR, TRACE_ENT as _ENT, TRACE_POSTED as POSTED,
                            TRACE_WAITING as WAITING, TRACE_DONE as DONE, TRACE_FAILED as FAILED,
                            TRACE_SEND as SEND, TRACE_RECV as RECV, TRACE_COLL as COLL, TRACE_LIVE as LIVE,
                            TRACE_LEFT as LEFT, TRACE_ANY as ANY, KINDS, OPS as REDUCE_OPS)

DEFAULT_SIZE = 512
MEMFD_NAME = "shmdist-trace"
STATES = dict(enumerate(layout.TRACE_STATES, start=POSTED))
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
TRACE_ENV, SIZE_ENV, DIR_ENV = "SHMDIST_TRACE", "SHMDIST_TRACE_SIZE", "SHMDIST_TRACE_DIR"
FR_PREFIX = "shmdist_fr_trace_rank_"
HISTORY_VERSION = 1         # of the JSON history (README); the ring's own layout is layout.TRACE_VERSION
TABLE_TITLE = "where each rank is (flight recorder):"   # torchfrtrace --prefix


_COARSE = getattr(time, "CLOCK_MONOTONIC_COARSE", 6)   # Linux's number; the C writer's clock


def enabled() -> bool:
    return settings.get(TRACE_ENV)


def _now() -> int:
    return time.clock_gettime_ns(_COARSE)


# ---------------------------------------------------------------- this process's ring

class _Own:
    """The ring this process writes (one per process, kept across re-inits)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.size = HEAD + capacity * ENTRY
        self.fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.fchmod(self.fd, 0o600)
            os.ftruncate(self.fd, self.size)
            self.mm = mmap.mmap(self.fd, self.size)   # holds a descriptor of its own: /proc/<pid>/fd shows it
        finally:
            os.close(self.fd)
        self.pid = os.getpid()
        self.addr = _core.buffer_address(self.mm, True)[0]
        _HDR.pack_into(self.mm, 0, MAGIC, VERSION, ENTRY, capacity, 0, 0, -1, 0, self.pid, LIVE, 0,
                       time.clock_gettime_ns(_COARSE), time.time_ns())
        self.meta: dict = {}

    def set_meta(self, **fields) -> None:
        self.meta.update(fields)
        data = _fitted(self.meta)
        _U32.pack_into(self.mm, layout.TRACE_H_META_LEN, 0)
        self.mm[META_AT:META_AT + len(data)] = data
        _U32.pack_into(self.mm, layout.TRACE_H_META_LEN, len(data))

    def set_state(self, state: int) -> None:
        _U32.pack_into(self.mm, layout.TRACE_H_STATE, state)


def _fitted(meta: dict) -> bytes:
    """The metadata as JSON that fits its page (cut short, it would not
    parse, and the job, rank and pids would be lost with the rest): what
    does not fit goes, the oldest groups first (their entries then name
    them by number; the default group's ranks are known from world_size),
    then the local ranks' pids (the doctor finds the others through
    shmdist-run then)."""
    data = json.dumps(meta).encode()
    if len(data) <= META_MAX:
        return data
    meta = dict(meta)
    groups = dict(meta.get("groups", {}))
    while groups and len(data) > META_MAX:
        del groups[next(iter(groups))]
        meta["groups"] = groups
        data = json.dumps(meta).encode()
    if len(data) > META_MAX:
        meta.pop("pids", None)
        data = json.dumps(meta).encode()
    return data if len(data) <= META_MAX else json.dumps({"job": None}).encode()


_own: _Own | None = None
_peers: dict = {}           # global rank -> Ring of a local peer, mapped at join
_world_size = 0
_joined = False             # between the end of init_process_group and destroy: tables make sense
_local = threading.local()


def _capacity() -> int:
    raw = settings.get(SIZE_ENV) or ""
    try:
        n = int(raw) if raw else DEFAULT_SIZE
    except ValueError:
        raise errors.DistError(f"{SIZE_ENV}={raw!r}: must be a number of operations (e.g. 512)") from None
    if not 1 <= n <= 1 << 20:
        raise errors.DistError(f"{SIZE_ENV}={raw!r}: must be between 1 and 1048576 operations")
    return 1 << (n - 1).bit_length()      # a power of two: the C writer masks the index


def start(rank: int, world_size: int) -> None:
    """At the start of init_process_group: make (or reuse) this process's
    ring, before any peer looks for it."""
    global _own, _world_size
    if not enabled():      # (again, for a re-init with SHMDIST_TRACE=0: the ring of the last one goes)
        _drop()
        return
    if _own is None or _own.pid != os.getpid():
        try:
            _own = _Own(_capacity())
        except OSError as e:
            print(f"shmdist: rank {rank}: flight recorder off, cannot create its memory: {e.strerror}",
                  file=sys.stderr)
            _own = None
            return
    struct.pack_into("<qq", _own.mm, layout.TRACE_H_RANK, rank, world_size)
    _own.set_state(LIVE)
    _own.meta = {}
    # since: this job's first entry; those before are an earlier job's of this process (a re-init),
    # whose group ids and collective numbers would read as this one's
    since = _U64.unpack_from(_own.mm, layout.TRACE_H_WRITTEN)[0] + 1
    _own.set_meta(job=settings.get("SHMDIST_JOB_ID"), rank=rank, world_size=world_size,
                  groups={"0": list(range(world_size))}, since=since)
    _world_size = world_size
    _core.trace_attach(_own.addr, _own.capacity)


def _drop() -> None:
    """Stop recording and let go of every ring this process maps: its own
    (its memory goes once no peer maps it) and its peers'."""
    global _own, _joined
    _core.trace_attach(0, 0)
    _joined = False
    if _own is not None and _own.pid == os.getpid():
        _own.mm.close()
    _own = None
    for ring in _peers.values():
        ring.mm.close()
    _peers.clear()


def joined(w) -> None:
    """After init_process_group set up: record the local ranks' pids, map
    their rings (they made them before the set-up ended), record the
    default group's collectives."""
    global _joined
    _peers.clear()
    if _own is None or not enabled():
        return
    pids = dict(getattr(w.store, "peers", {}) or {})
    pids[w.rank] = os.getpid()
    _own.set_meta(pids={str(r): p for r, p in pids.items()})
    for r, pid in pids.items():
        if r != w.rank:
            ring = next((x for x in rings_of(pid) if x.pid == pid), None)
            if ring is not None:
                _peers[r] = ring
    group_made(w, w.default)
    _joined = True


def group_made(w, g) -> None:
    """A new group: its members go into the ring's metadata, its collectives are recorded."""
    if _own is None or not enabled() or _own.pid != os.getpid():
        return
    groups = dict(_own.meta.get("groups", {}))
    groups[str(g.gid)] = list(g.ranks)
    if len(groups) > 64:          # the metadata page is small: keep the newest groups
        groups = dict(list(groups.items())[-64:])
    _own.set_meta(groups=groups)
    coll = getattr(g, "coll", None)
    ph = getattr(coll, "ph", None)
    if ph is not None:
        ph.trace_gid = g.gid          # a shared arena: its Phaser records in C
    elif coll is not None and hasattr(coll, "_check"):
        _record_checks(coll, g)       # a group across hosts (hier.py): its call check is the first phase


def _record_checks(comm, g) -> None:
    """Record each collective of a hier.HierComm at its call check (which
    every member passes first, as a shared arena's first phase): waiting
    until every member arrived, done once they have."""
    check = comm._check
    calls = [0]

    def recorded(what, desc, timeout):
        kind, nbytes, op, root, dtype, _ = desc
        calls[0] += 1
        seq = 0
        if _own is not None and kind in KINDS:
            seq = _core.trace_post(COLL + KINDS.index(kind), WAITING, g.gid, g.ranks[root] if root >= 0 else -1,
                                   int(op), nbytes, calls[0], _dtype16(dtype))
        check(what, desc, timeout)
        _core.trace_set(seq, DONE)
    comm._check = recorded


def left(w) -> None:
    """destroy_process_group: the ring says the rank left (it stays readable)."""
    global _joined
    _joined = False
    if _own is not None and _own.pid == os.getpid():
        _own.set_state(LEFT)


_dtype16s: dict = {}


def _dtype16(name: str) -> bytes:
    field = _dtype16s.get(name)
    if field is None:
        field = _dtype16s[name] = name.encode()[:16].ljust(16, b"\0")
    return field


def p2p(req, send: bool, gid: int, peer, tag: int, buf) -> None:
    """A send or receive of the general path, before the engine gets it."""
    if _own is not None:
        req._tseq = _core.trace_post(SEND if send else RECV, POSTED, gid, ANY if peer is None else peer,
                                     tag, buf.nbytes, 0, _dtype16(buf.dtype))


def waiting(req) -> None:
    """wait() on ``req`` starts to block."""
    if req._tseq:
        _core.trace_set(req._tseq, WAITING)


def not_waiting(req) -> None:
    """wait() on ``req`` left without its completing (KeyboardInterrupt, or
    any exception that is no DistError): the request is still pending, no
    longer waited for; it must not read as waiting for ever."""
    seq = req._tseq
    if not seq or _own is None or _own.pid != os.getpid():
        return
    at = HEAD + (seq % _own.capacity) * ENTRY
    if (_U64.unpack_from(_own.mm, at + layout.TRACE_E_SEQ)[0] == seq
            and _U32.unpack_from(_own.mm, at + layout.TRACE_E_STATE)[0] == WAITING):
        _core.trace_set(seq, POSTED)


def _after_fork() -> None:
    global _own, _joined
    _core.trace_attach(0, 0)      # the parent's ring is not this process's to write
    _own, _joined = None, False
    _peers.clear()


os.register_at_fork(after_in_child=_after_fork)


# ---------------------------------------------------------------- reading a ring

class Entry:
    __slots__ = ("seq", "state", "op", "gid", "peer", "tag", "nbytes", "coll", "posted", "ended",
                 "thread", "dtype", "wait_began")

    @property
    def kind(self) -> str:
        if self.op == SEND:
            return "send"
        if self.op == RECV:
            return "recv"
        k = self.op - COLL
        return KINDS[k] if 0 <= k < len(KINDS) else f"op {self.op}"

    @property
    def is_coll(self) -> bool:
        return self.op >= COLL

    @property
    def open(self) -> bool:
        return self.state in (POSTED, WAITING)


class Ring:
    """A ring opened for reading (another process's, or this one's)."""

    def __init__(self, mm, fd_path: str = ""):
        self.mm = mm
        self.path = fd_path
        (magic, version, entry, self.capacity, _, _, self.rank, self.world_size, self.pid, _, _,
         self.mono0, self.real0) = _HDR.unpack_from(mm, 0)
        if magic != MAGIC or version != VERSION or entry != ENTRY:
            raise ValueError("not a shmdist flight recorder of this version")

    @property
    def state(self) -> int:
        return _U32.unpack_from(self.mm, layout.TRACE_H_STATE)[0]

    @property
    def changes(self) -> int:
        """Progress: operations posted plus state changes (the writer counts
        posts once, in the header's written count, to store less per post)."""
        return (_U64.unpack_from(self.mm, layout.TRACE_H_WRITTEN)[0]
                + _U64.unpack_from(self.mm, layout.TRACE_H_CHANGES)[0])

    def meta(self) -> dict:
        for _ in range(20):
            n = _U32.unpack_from(self.mm, layout.TRACE_H_META_LEN)[0]
            raw = bytes(self.mm[META_AT:META_AT + n])
            if n and _U32.unpack_from(self.mm, layout.TRACE_H_META_LEN)[0] == n:
                try:
                    return json.loads(raw)
                except ValueError:
                    pass
            time.sleep(0.001)
        return {}

    def entries(self) -> list[Entry]:
        """The entries of this job still in the ring, oldest first (ones being
        rewritten are skipped; those of an earlier job of the process too)."""
        mm, cap = self.mm, self.capacity
        since = self.meta().get("since") or 1
        written = _U64.unpack_from(mm, layout.TRACE_H_WRITTEN)[0]
        out = []
        for seq in range(max(1, since, written - cap + 1), written + 1):
            at = HEAD + (seq % cap) * ENTRY
            fields = _ENT.unpack_from(mm, at)
            if fields[0] != seq or _U64.unpack_from(mm, at + layout.TRACE_E_SEQ)[0] != seq:
                continue
            e = Entry()
            (e.seq, e.state, e.op, e.gid, e.peer, e.tag, e.nbytes, e.coll, e.posted, e.ended, e.thread,
             dtype, e.wait_began) = fields
            e.dtype = dtype.rstrip(b"\0").decode(errors="replace")
            out.append(e)
        return out

    def wall(self, ns: int) -> float | None:
        """A recorded time as seconds since the epoch."""
        return (self.real0 + ns - self.mono0) / 1e9 if ns else None

    def alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
        except OSError:
            return False


def own_ring() -> Ring | None:
    return Ring(_own.mm) if _own is not None else None


def rings_of(pid: int) -> list[Ring]:
    """Every flight recorder process ``pid`` holds open (its own, its local
    peers', and for shmdist-run its ranks'), read-only. Only memfds of this
    user, mode 0600. Each mapping holds a descriptor (Python's mmap keeps
    one), so the ring stays findable through this process too."""
    out = []
    base = f"/proc/{pid}/fd"
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        path = f"{base}/{name}"
        try:
            if not os.readlink(path).startswith(f"/memfd:{MEMFD_NAME} "):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o600 or st.st_size < HEAD:
                continue
            out.append(Ring(mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ), path))
        except (OSError, ValueError):
            continue
        finally:
            os.close(fd)
    return out


# ---------------------------------------------------------------- diagnosis

def _group_name(groups: dict, gid: int) -> str:
    ranks = groups.get(str(gid))
    if gid == 0:
        return "WORLD"
    return f"group {ranks}" if ranks is not None else f"group #{gid}"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % (size // 16 or 1) == 0:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def describe(e: Entry, groups: dict) -> str:
    """``broadcast #812 (group [0, 2, 3], root 0, 4 KiB float32)``, ``recv from rank 0 (tag 0, 8 B int64)``."""
    data = f"{_bytes(e.nbytes)} {e.dtype}".strip()
    if not e.is_coll:
        peer = "any rank" if e.peer == ANY else f"rank {e.peer}"
        where = "" if e.gid == 0 else f", {_group_name(groups, e.gid)}"
        return f"{e.kind} {'to' if e.op == SEND else 'from'} {peer} (tag {e.tag}, {data}{where})"
    kind = e.kind
    args = []
    if kind == "refused":
        kind = KINDS[e.tag] if 0 <= e.tag < len(KINDS) else "a collective"
        args.append("refused its own arguments")
    elif kind in ("all_reduce", "reduce", "reduce_scatter") and 0 <= e.tag < len(REDUCE_OPS):
        args.append(REDUCE_OPS[e.tag])
    if e.peer >= 0:
        args.append(f"root {e.peer}")
    if kind != "barrier" and e.nbytes:
        args.append(data)
    name = _group_name(groups, e.gid)
    where = f"of {name}" if name == "WORLD" else f"({name}{', ' if args else ''}{', '.join(args)})"
    if name == "WORLD":
        return f"{kind} #{e.coll} {where}" + (f" ({', '.join(args)})" if args else "")
    return f"{kind} #{e.coll} {where}"


def _ranks(rs) -> str:
    rs = sorted(rs)
    return f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}"


def _ago(ns: int, now: int) -> str:
    return f"{max(0.0, (now - ns) / 1e9):.1f} s"


class _RankState:
    def __init__(self, rank: int, ring: Ring | None):
        self.rank, self.ring = rank, ring
        self.entries = ring.entries() if ring is not None else []
        self.left = ring is not None and ring.state == LEFT
        self.alive = (ring.alive() or self.left) if ring is not None else None   # left, then exited: not "gone"
        newest = {}     # thread -> the newest operation it is blocked in (a thread blocks in one at a time)
        for e in self.entries:
            if e.state == WAITING or (e.state == POSTED and e.is_coll):
                newest[e.thread] = e
            elif (e.thread in newest and newest[e.thread].is_coll
                  and e.posted > (newest[e.thread].wait_began or newest[e.thread].posted)):
                # posted after that collective began to wait: the thread left it (an exception that was
                # no DistError, e.g. KeyboardInterrupt, left it open). Not for a send or receive: another
                # thread may wait for it while its poster goes on (Engine.wait_for says when a wait is left)
                del newest[e.thread]
        self.blocked = sorted(newest.values(), key=lambda e: e.seq)   # every thread's, oldest first
        self.current = self.blocked[-1] if self.blocked else None
        self.last = self.entries[-1] if self.entries else None

    def pending_p2p(self, send: bool, peer: int) -> list[Entry]:
        return [e for e in self.entries if e.open and e.op == (SEND if send else RECV)
                and (e.peer == peer or (not send and e.peer == ANY))]

    def reached(self, gid: int, coll: int) -> bool | None:
        mine = [e.coll for e in self.entries if e.is_coll and e.gid == gid]
        if not mine:
            return None
        return max(mine) >= coll


def diagnose(rings: dict, world_size: int, groups: dict | None = None, now: int | None = None) -> str:
    """The table of where each rank is, and the verdict. ``rings``: global
    rank -> Ring (missing ranks: no recorder readable)."""
    now = _now() if now is None else now
    groups = dict(groups or {})
    for ring in rings.values():
        if ring is not None:
            groups.update(ring.meta().get("groups", {}))
    groups.setdefault("0", list(range(world_size)))
    st = {r: _RankState(r, rings.get(r)) for r in range(world_size)}
    lines = []
    for r in range(world_size):
        s = st[r]
        lines.append(f"rank {r}: {_where(s, st, groups, now)}")
    verdicts = _verdicts(st, groups, now)
    out = [TABLE_TITLE] + ["  " + x for x in lines]
    if verdicts:
        out += ["verdict:"] + ["  " + v for v in verdicts]
    return "\n".join(out)


def _members(groups: dict, gid: int) -> list[int]:
    return list(groups.get(str(gid), []))


def _missing(s: _RankState, st: dict, groups: dict, e: Entry | None = None) -> list[int]:
    e = s.current if e is None else e
    return [m for m in _members(groups, e.gid) if m != s.rank and m in st
            and not (st[m].reached(e.gid, e.coll) and st[m].alive is not False)]


def _where(s: _RankState, st: dict, groups: dict, now: int) -> str:
    if s.ring is None:
        return "no flight recorder readable (another host, SHMDIST_TRACE=0, or not started)"
    last = f"last: {describe(s.last, groups)}, {STATES.get(s.last.state, '?')}" if s.last else "no operation yet"
    if s.alive is False:
        return f"gone (process {s.ring.pid} no longer exists); {last}"
    if s.left:
        return f"left the job (destroy_process_group); {last}"
    if s.current is None:
        ago = f" {_ago(s.last.ended or s.last.posted, now)} ago" if s.last else ""
        return f"not inside any shmdist call; {last}{ago}"
    # the newest first; then each other thread that is blocked too (it may be the one that hangs)
    return "; another thread: ".join(_blocked_in(s, e, st, groups, now) for e in reversed(s.blocked))


def _blocked_in(s: _RankState, e: Entry, st: dict, groups: dict, now: int) -> str:
    since = e.wait_began or e.posted
    if e.is_coll:
        missing = _missing(s, st, groups, e)
        who = f", waiting for {_ranks(missing)}" if missing else ""
        return f"in {describe(e, groups)}{who} ({_ago(since, now)})"
    peer = "any rank" if e.peer == ANY else f"rank {e.peer}"
    verb = "waiting for" if e.state == WAITING else "posted, for"
    return f"in {describe(e, groups)}, {verb} {peer} ({_ago(since, now)})"


def _doing(s: _RankState, groups: dict, now: int) -> str:
    """What rank s does instead, for a verdict."""
    if s.ring is None:
        return f"rank {s.rank}'s recorder is not readable"
    if s.alive is False:
        return f"rank {s.rank} is gone (process {s.ring.pid} no longer exists)"
    if s.left:
        return f"rank {s.rank} left the job (destroy_process_group)"
    if s.current is None:
        last = f"; its last operation, {describe(s.last, groups)}, ended {_ago(s.last.ended or s.last.posted, now)} ago" \
            if s.last else ""
        return f"rank {s.rank} is not inside any shmdist call{last}"
    return f"rank {s.rank} is in {describe(s.current, groups)}"


def _differ(r: int, e: Entry, p: int, x: Entry, groups: dict, theirs: str) -> str:
    """The verdict for a send and a receive between the same ranks that do not match."""
    what = "tags differ" if x.tag != e.tag else "groups differ"
    return (f"{what}: rank {r} waits in {describe(e, groups)}, but rank {p}'s {describe(x, groups)} "
            f"{theirs}; use the same tag and group on both sides")


def _unreceived(ps: _RankState, s: _RankState) -> list[Entry]:
    """The sends of ``ps`` to ``s``'s rank that completed (into the ring) and
    that no receive of ``s`` took yet, as far as both rings still show:
    per tag and group, the sends done beyond the receives done."""
    r, p = s.rank, ps.rank
    took: dict = {}
    for x in s.entries:
        if x.op == RECV and x.state == DONE and x.peer in (p, ANY):
            took[(x.tag, x.gid)] = took.get((x.tag, x.gid), 0) + 1
    out = []
    for x in reversed([x for x in ps.entries if x.op == SEND and x.peer == r and x.state == DONE]):
        key = (x.tag, x.gid)
        if took.get(key, 0) > 0:
            took[key] -= 1      # the newest receives took the newest sends
        else:
            out.append(x)
    return out[::-1]


def _recv_verdicts(r: int, e: Entry, st: dict, groups: dict, now: int) -> list[str]:
    """A receive that blocks: does any peer send it, with the same tag and group?"""
    members = _members(groups, e.gid) or list(st)     # from any rank: any member of its group
    peers = [p for p in members if p != r] if e.peer == ANY else [e.peer]
    out, idle = [], []
    for p in peers:
        if p not in st or st[p].alive is False:
            continue      # a gone rank is said on its own
        ps = st[p]
        other = ps.pending_p2p(True, r) or _unreceived(ps, st[r])
        if any(x.tag == e.tag and x.gid == e.gid for x in other):
            return []     # moving
        if other:
            out.append(_differ(r, e, p, other[-1], groups, "does not match it"))
        else:
            idle.append(p)
    if out or not idle:
        return out
    if e.peer != ANY:
        p = idle[0]
        return [f"a receive nobody sends to: rank {r} waits in {describe(e, groups)}, but rank "
                f"{p} has no send to rank {r} pending: {_doing(st[p], groups, now)}"]
    doing = "; ".join(_doing(st[p], groups, now) for p in idle[:4]) + ("; ..." if len(idle) > 4 else "")
    return [f"a receive nobody sends to: rank {r} waits in {describe(e, groups)}, but no rank has a send "
            f"to rank {r} pending: {doing}"]


def _send_verdicts(r: int, e: Entry, st: dict, groups: dict, now: int) -> list[str]:
    """A send that blocks (too big for the ring): does its peer receive it?"""
    p = e.peer
    if p not in st or st[p].alive is False:
        return []
    ps = st[p]
    theirs = ps.pending_p2p(False, r)
    if any(x.tag == e.tag and x.gid == e.gid for x in theirs):
        return []
    if theirs:
        x = theirs[-1]
        return [_differ(r, e, p, x, groups, "receives with it instead")]
    return [f"a send nobody receives: rank {r} waits in {describe(e, groups)} (too big "
            f"to leave in the ring), but rank {p} does not receive it: {_doing(ps, groups, now)}"]


def _verdicts(st: dict, groups: dict, now: int) -> list[str]:
    out: list[str] = []
    gone = [r for r, s in st.items() if s.ring is not None and s.alive is False]
    for r in gone:
        out.append(f"a rank that is gone: rank {r} (process {st[r].ring.pid}) no longer exists; "
                   f"every operation waiting for it fails. Look for why it died (its output, the OOM "
                   "killer, a signal) and restart the job")
    colls: dict = {}          # (gid, coll, kind) -> waiting ranks
    for r, s in st.items():
        if s.alive is False or s.left:
            continue
        for e in s.blocked:   # every thread's
            if e.is_coll:
                colls.setdefault((e.gid, e.coll, e.kind), []).append(r)
            elif e.op == RECV:
                out += _recv_verdicts(r, e, st, groups, now)
            else:
                out += _send_verdicts(r, e, st, groups, now)
    for (gid, coll, kind), waiters in colls.items():
        e = next(x for x in st[waiters[0]].blocked if (x.gid, x.coll, x.kind) == (gid, coll, kind))
        missing = _missing(st[waiters[0]], st, groups, e)
        call = describe(e, groups)
        for m in missing:
            ms = st[m]
            if ms.alive is False:
                continue
            who = f"{_ranks(waiters)} wait{'s' if len(waiters) == 1 else ''}"
            if ms.ring is None or ms.left:
                out.append(f"rank {m} never called {call} that {who} in: {_doing(ms, groups, now)}")
            elif ms.current is None:
                out.append(f"a rank that never called it: {who} in {call}, but {_doing(ms, groups, now)}. "
                           "Every rank of the group must call every collective, in the same order (look "
                           f"for a branch or an early return on rank {m})")
            elif ms.current.is_coll:
                out.append(f"a rank in a different collective: {who} in {call}, but rank {m} is in "
                           f"{describe(ms.current, groups)}. Every rank must call the collectives of "
                           "all its groups in the same order")
            else:
                out.append(f"a rank that never called it: {who} in {call}, but rank {m} is in "
                           f"{describe(ms.current, groups)} instead")
    if not out and any(s.current is not None for s in st.values()):
        out.append("no hang found: the waiting ranks' peers are in the matching operations "
                   "(still moving, or slow)")
    return out


def local_report() -> str:
    """The table and verdict of this process's job, from the rings it maps."""
    if _own is None:
        return ""
    rings = {r: ring for r, ring in _peers.items()}
    own = own_ring()
    rings[own.rank] = own
    return diagnose(rings, max(_world_size, own.world_size))


# ---------------------------------------------------------------- history on failure

def history(ring: Ring, errors_seen=(), diagnosis: str = "") -> dict:
    """A ring's entries as the documented JSON object."""
    meta = ring.meta()
    groups = dict(meta.get("groups", {}))
    groups.setdefault("0", list(range(max(ring.world_size, meta.get("world_size") or 0))))   # (left out of a full page)
    out = []
    for e in ring.entries():
        d = {"seq": e.seq, "op": e.kind, "state": STATES.get(e.state, str(e.state)),
             "group": e.gid, "group_ranks": groups.get(str(e.gid)), "bytes": e.nbytes, "dtype": e.dtype,
             "posted": ring.wall(e.posted), "wait_began": ring.wall(e.wait_began), "ended": ring.wall(e.ended),
             "thread": e.thread}
        if e.is_coll:
            d["collective"] = e.coll
            d["root"] = e.peer if e.peer >= 0 else None
            if e.kind in ("all_reduce", "reduce", "reduce_scatter"):
                d["reduce_op"] = REDUCE_OPS[e.tag] if 0 <= e.tag < len(REDUCE_OPS) else e.tag
            if e.kind == "refused":
                d["refused"] = KINDS[e.tag] if 0 <= e.tag < len(KINDS) else e.tag
        else:
            d["peer"] = None if e.peer == ANY else e.peer
            d["tag"] = e.tag
        out.append(d)
    return {"format": "shmdist-trace", "version": HISTORY_VERSION, "rank": ring.rank, "world_size": ring.world_size,
            "pid": ring.pid, "job": meta.get("job", ""), "groups": groups, "errors": list(errors_seen),
            "diagnosis": diagnosis, "entries": out}


_ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
             "int32": 4, "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8,
             "complex64": 8, "complex128": 16}
_FR_DTYPES = {"float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16",
              "int64": "Long", "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte", "bool": "Bool"}


def torch_fr(hist: dict) -> dict:
    """The history in the shape torch's flight-recorder analyzer
    (torch/distributed/flight_recorder, ``torchfrtrace``) reads: version
    2.x dumps with pg_config and entries (sizes are element counts, 1-d)."""
    pg_config = {str(g): {"name": str(g), "desc": "default_pg" if g == "0" else f"shmdist_group_{g}",
                          "ranks": str(ranks)} for g, ranks in hist["groups"].items()}
    entries, p2p = [], 0
    for i, e in enumerate(hist["entries"]):
        isz = _ITEMSIZE.get(e["dtype"], 1)
        count = e["bytes"] // isz
        is_p2p = e["op"] in ("send", "recv")
        p2p += is_p2p
        name = e.get("refused") or e["op"]
        if is_p2p and e["peer"] is not None:
            ranks = e["group_ranks"] or []
            local = lambda r: ranks.index(r) if r in ranks else r   # noqa: E731 - its names use group ranks
            me, peer = local(hist["rank"]), local(e["peer"])
            name = f"send {me}->{peer}" if e["op"] == "send" else f"recv {me}<-{peer}"
        state = {"done": "completed", "failed": "completed", "waiting": "started"}.get(e["state"], "scheduled")
        ns = lambda t: int(t * 1e9) if t else None   # noqa: E731
        entries.append({
            "record_id": i, "pg_id": e["group"], "process_group": (str(e["group"]), pg_config.get(
                str(e["group"]), {"desc": f"shmdist_group_{e['group']}"})["desc"]),
            "collective_seq_id": 0 if is_p2p else e["collective"], "p2p_seq_id": p2p if is_p2p else 0,
            "op_id": i, "profiling_name": f"gloo:{name}",   # its analyzer knows backends by name
            "time_created_ns": ns(e["posted"]), "time_discovered_started_ns": ns(e["wait_began"] or e["posted"]),
            "time_discovered_completed_ns": ns(e["ended"]) if state == "completed" else None,
            "duration_ms": None, "input_sizes": [[count]], "output_sizes": [[count]],
            "input_dtypes": [_FR_DTYPES.get(e["dtype"], e["dtype"])],
            "output_dtypes": [_FR_DTYPES.get(e["dtype"], e["dtype"])], "state": state,
            "retired": state == "completed", "timeout_ms": 0, "is_p2p": is_p2p, "frames": []})
    return {"version": "2.10", "pg_config": pg_config, "pg_status": {}, "entries": entries}


_errors_seen: list = []


def write_history(error_text: str = "", diagnosis: str = "") -> list[str]:
    """Write this rank's history into SHMDIST_TRACE_DIR (JSON, and torch's
    flight-recorder pickle). Returns the paths written."""
    where = settings.get(DIR_ENV)
    ring = own_ring()
    if not where or ring is None:
        return []
    if error_text:
        with _write_lock:
            _errors_seen.append(error_text)
            del _errors_seen[:-20]
    with _write_lock:       # threads that fail at once: one writer at a time, the last has every error
        hist = history(ring, _errors_seen, diagnosis)
        os.makedirs(where, exist_ok=True)
        path = os.path.join(where, f"shmdist-trace-rank{ring.rank}.json")
        fr = os.path.join(where, f"{FR_PREFIX}{ring.rank}")
        for p, data in ((path, json.dumps(hist, indent=1).encode()), (fr, pickle.dumps(torch_fr(hist)))):
            tmp = f"{p}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, p)
        written = [path, fr]
        # torch's analyzer wants every rank's dump, and a hang often fails one rank only: write
        # those of the local ranks this one maps too (their state as read now; a rank that meets
        # an error of its own rewrites its own)
        for r, peer in sorted(_peers.items()):
            p = os.path.join(where, f"{FR_PREFIX}{r}")
            tmp = f"{p}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "wb") as f:
                f.write(pickle.dumps(torch_fr(history(peer))))
            os.replace(tmp, p)
            written.append(p)
    return written


_write_lock = threading.Lock()


def on_error(e: BaseException) -> None:
    """Every DistError made in a rank (errors.py calls it): the collective
    this thread sits in failed; a timeout or a dead peer gets the table;
    with SHMDIST_TRACE_DIR the history is written."""
    if _own is None or _own.pid != os.getpid() or getattr(_local, "busy", False):
        return
    _local.busy = True
    try:
        table = ""
        if _joined and isinstance(e, (errors.DistTimeoutError, errors.DistPeerError)) and e.args:
            table = local_report()
            if table and TABLE_TITLE not in str(e.args[0]):    # not again when an error is re-worded
                e.args = (f"{e.args[0]}\n{table}",) + tuple(e.args[1:])
        me = threading.get_ident()
        for x in own_ring().entries():
            if x.thread == me and (x.state == WAITING or (x.is_coll and x.open)):   # what it waited in
                _core.trace_set(x.seq, FAILED)
        if settings.get(DIR_ENV):
            write_history(str(e.args[0]) if e.args else type(e).__name__, table or local_report())
    except Exception as problem:   # noqa: BLE001 - a diagnostic must never hide the error itself
        print(f"shmdist: flight recorder: {type(problem).__name__}: {problem}", file=sys.stderr)
    finally:
        _local.busy = False


errors._on_error = on_error


# ---------------------------------------------------------------- shmdist-run's watch

class JobWatch:
    """What shmdist-run does with its ranks' rings: hold them open (their
    history outlives a killed rank), print the diagnosis on demand, and
    notice when no rank progressed for ``hang_after`` seconds while some
    rank waits."""

    LOOK_EVERY = 0.2     # seconds between looks for a rank's ring not found yet

    def __init__(self, world_size: int, hang_after: float | None):
        self.world_size = world_size
        self.hang_after = hang_after
        self.rings: dict[int, Ring] = {}
        self.looked: dict[int, float] = {}
        self.changes = -1
        self.changed_at = time.monotonic()
        self.reported = False
        self.idle = -1         # the change count at which no rank was found waiting

    def hold(self, procs: dict) -> None:
        """Open the ring of every rank (global rank -> Popen) not held yet."""
        now = time.monotonic()
        for rank, p in procs.items():
            if rank in self.rings or now - self.looked.get(rank, 0.0) < self.LOOK_EVERY:
                continue
            self.looked[rank] = now
            for ring in rings_of(p.pid):
                if ring.pid == p.pid and rank not in self.rings:
                    self.rings[rank] = ring      # its mapping holds the memory (and a descriptor)
                else:
                    ring.mm.close()

    def report(self) -> str:
        return diagnose(dict(self.rings), self.world_size)

    def stalled(self) -> str:
        """The diagnosis once no rank progressed for hang_after seconds
        while one waits; "" otherwise (and again only after progress)."""
        if not self.hang_after or not self.rings:
            return ""
        now = time.monotonic()
        changes = sum(r.changes for r in self.rings.values())
        if changes != self.changes:
            self.changes, self.changed_at, self.reported = changes, now, False
            return ""
        if self.reported or now - self.changed_at < self.hang_after:
            return ""
        if self.idle == changes:
            return ""         # read at this count already: nobody waits (ranks compute); nothing changed
        # any thread's, not only in the newest entries: a thread may wait behind what others did since
        waiting = any(_RankState(rank, ring).blocked for rank, ring in self.rings.items())
        if not waiting:
            self.idle = changes
            return ""
        self.reported = True
        return f"no rank progressed for {now - self.changed_at:.0f} s:\n{self.report()}"

    def close(self) -> None:
        for ring in self.rings.values():
            ring.mm.close()

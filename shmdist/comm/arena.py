"""Collectives computed in a group's shared arena, not as loops of send/recv.

Each group has one arena segment: a control slot per member (its phase
counter and the descriptors of its last two calls) and, per member, two
data buffers of ``slot`` bytes. A collective is a sequence of rounds; in
each round a member writes into its own buffer, then all members pass a
phase (each publishes its phase counter and waits until every member's
counter reached it), then each reads what it needs from the others'
buffers. Rounds alternate between the two buffers, so a member may refill
its buffer for round r+2 only after everyone passed round r+1, which means
everyone has finished reading round r: one phase per round, no extra
barrier, and consecutive collectives pipeline.

The first phase of every call also checks the call itself: each member
wrote a descriptor (which collective, sizes, dtype, op, root) before it
arrived, and after the phase every member compares all descriptors, so a
mismatch raises the same error on every rank instead of hanging or
computing garbage, and the group stays usable.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Protocol

import numpy as np

from shmdist import _core, layout, settings
from shmdist.transport import segment
from shmdist.comm import paths
from shmdist.api.fast import paths as _fast
from shmdist.errors import DistError, DistMismatchError, DistPeerError, DistTimeoutError
from shmdist.layout import ALL_ROUNDS_DONE, BROKEN, DIFFER, DONE, NOT_TAKEN, NOT_YET
from shmdist.reduce_ops import ReduceOp, reduce_into, reduce_rows
from shmdist.tensors import describe
from shmdist.trace import DONE as TRACE_DONE, FAILED as TRACE_FAILED

CTL_STRIDE = layout.SLOT_STRIDE       # per member: phase, descriptors of the last two calls (layout.py)
_DESC = layout.DESC                   # 0 (reserved), kind, bytes, op, root, dtype, extra
KINDS = layout.KINDS
SLOT_ENV = "SHMDIST_ARENA_BYTES"      # bytes per member and buffer; two buffers each (settings.py)
SMALL_ALLREDUCE = 64 << 10            # up to this, every rank reduces the whole vector itself
# The same for 2 ranks, up to 512 KiB: one phase, not 3, for the same bytes moved. Above it the C rounds
# win: a rank reduces half the vector, and its working set (data, its copy, the other's, 3 x the vector)
# no longer fits a core's 2 MiB L2 at 1 MiB. One rank's work at 2 ranks, float32 (CPU time in one
# process, best of 9, bench/pair_allreduce_cost.py, two runs at load 15-21): 512 KiB 36 vs 42 and 32 vs 28 us
# (a draw), 768 KiB 69 vs 71 and 61 vs 46, 1 MiB 149 vs 99 and 138 vs 64 (quick vs the 512 KiB rounds).
SMALL_ALLREDUCE_PAIR = 512 << 10
LIVENESS_PERIOD = 0.2
SPLIT_CHUNK = 256 << 10                # bytes of the other member's array read at a time (_all_reduce_split)
_U64 = np.dtype(np.uint64)
ROUND_ENV = "SHMDIST_ROUND_BYTES"     # most elements' bytes per round of a large all_reduce (settings.py)
# More members than cores: every phase waits until each member has been scheduled, so fewer, longer
# rounds (4 ranks on 2 cores, all_reduce 16 MiB 50-68 -> 20-36 ms, 64 MiB 211-245 -> 104-114 ms)
BUSY_SLOT_BYTES, BUSY_ROUND_BYTES = 8 << 20, 4 << 20


def slot_bytes() -> int:
    return settings.get(SLOT_ENV)


def _align(n: int, a: int = 4096) -> int:
    return (n + a - 1) // a * a


_parts = layout.parts
_mask_at, _bit, _load = paths.mask_at, paths.bit, _core.load_u64   # (a call's way, read by both of two members)
_BARRIER = layout.pack_desc("barrier", 0, 0, -1, b"", 0)
_PHASER_KINDS = {np.dtype(t): (layout.kind_of(t), t.encode())    # the dtypes the C reduction takes
                 for t in ("float32", "float64", "int32", "int64")}


def _said(what) -> str:
    """The name of the call in an error: a string, or a function that makes
    it (formatting it for every call would cost more than a small collective)."""
    return what() if callable(what) else what


def open_group(world, key: str, ranks) -> "GroupComm":
    """Create (lowest member) or attach the shared arena of the group of
    global ``ranks`` (this rank among them) that ``key`` names: the group's
    id, or for a node of a group across hosts the id and the node's leader
    (hier.py). Members only."""
    ranks = tuple(ranks)
    n = len(ranks)
    slot = slot_bytes()
    rounds = settings.get(ROUND_ENV)   # the creator's settings hold for every member
    single = settings.get("SHMDIST_SINGLE_COPY")
    single = max(single, PAIR_SPLIT_MIN) if single > 0 else 0
    settings.get("SHMDIST_PAIR_CHOOSE")   # (only member 0 uses it, below; every member refuses a bad one now)
    if n > len(os.sched_getaffinity(0)):   # see BUSY_SLOT_BYTES; a setting in the environment still wins
        slot, rounds = settings.get(SLOT_ENV, BUSY_SLOT_BYTES), settings.get(ROUND_ENV, BUSY_ROUND_BYTES)
    ctl_at = segment.HEADER_BYTES
    data_at = _align(ctl_at + n * CTL_STRIDE)
    size = data_at + 2 * n * slot
    who = f"rank {world.rank}: new_group"
    # Keyed by the group id and its members: a rank can only ever meet the
    # arena of the very group it asked for (new_group also agrees first).
    import hashlib   # here, not at the top: this function is all of arena.py the group work owns
    members = hashlib.sha1(repr(ranks).encode()).hexdigest()[:12]
    creator = world.rank == ranks[0]
    seg = segment.share(world.store, f"arena/{key}/{members}", n, creator, size if creator else 0, who,
                        world.timeout, init=lambda s: _params(s.mm, slot, rounds, single))
    return GroupComm(world, ranks, seg)


# Two members copy straight between their arrays from SHMDIST_SINGLE_COPY bytes, but never
# below this (it only moves broadcast: all_reduce splits above its one-phase 512 KiB anyway).
# Through the arena in one C call (quick_broadcast), 256 KiB took 21 us against 40 as split
# copies, 512 KiB 38 against 51; at 1 MiB the split copies won, 78 against 89 (interleaved
# benchmark runs, 2026-12-05), where point-to-point both ways at once gains from 64 KiB.
PAIR_SPLIT_MIN = 1 << 20
# Three or more members: a broadcast from this size on may be read by every other member straight from the
# root's array (_broadcast_direct), which saves the root's copy into the arena and the phases' waits.
# 3 and 4 ranks on 2 cores, µs per call, 60 calls after 5 (two runs each, arena -> direct): 1 MiB
# 190-210 -> 290-440 (not taken), 4 MiB 840-890 -> 600-800, 16 MiB 3270-3760 -> 1620-2900 (README).
DIRECT_MIN = 4 << 20
DIRECT_CHUNK = 256 << 10               # bytes of a reader's array copied at a time (_broadcast_direct)
_COUNTER_AT = 16                       # in a member's buffer: its chunk counter, after pid and address


def _split_half(nbytes: int) -> int:
    """The bytes of a two-member broadcast that its root writes (the first ones)."""
    return (nbytes // 2) & ~4095


def _params(mm, slot: int, rounds: int, single: int) -> None:
    """The creator's choices, which every member reads (GroupComm)."""
    layout.PARAMS.pack_into(mm, layout.PARAMS_AT, slot, rounds)
    layout.PAIR_SINGLE.pack_into(mm, layout.PAIR_SINGLE_AT, single)
    layout.PAIR_SINGLE.pack_into(mm, layout.PAIR_PATHS_AT, paths.INITIAL)


class Comm(Protocol):
    """The collective engine of one group, as api/collectives.py calls it: the
    shared-arena GroupComm (members on one node) and hier.HierComm (members
    on several) implement it. Ranks in arguments are group ranks; ``buf``
    and the addresses are tensors.Buf / their addresses; each call first
    checks that every member made the same call (``unusable`` and
    ``disagree`` are the errors), and runs under ``lock``."""

    lock: "_core.RLock | threading.Lock"
    broken: str | None            # why the group can no longer run collectives

    def barrier(self, timeout: float) -> None: ...
    def barrier_as(self, kind: str, dtype: str, timeout: float) -> None: ...
    def refuse(self, kind: str, timeout: float) -> None: ...
    def quick_barrier(self, timeout: float, how: int | None = None) -> bool: ...
    def quick_all_reduce(self, arr, op, timeout: float, dtype_name: str | None = None) -> bool: ...
    def broadcast(self, buf, root: int, timeout: float) -> None: ...
    def all_reduce(self, buf, arr, op, timeout: float, root: int = -1) -> None: ...
    def all_gather(self, outs: list, buf, root: int, timeout: float) -> None: ...
    def scatter(self, ins: list, buf, root: int, timeout: float) -> None: ...
    def reduce_scatter(self, out_buf, out_arr, ins: list, in_arrs: list, op, timeout: float) -> None: ...
    def all_to_all(self, outs: list, ins: list, piece: int, dtype: str, timeout: float) -> None: ...
    def arena_bytes(self) -> int: ...
    def retire(self, why: str, within: float) -> bool: ...
    def unlink(self) -> None: ...
    def close(self) -> None: ...


class GroupComm:
    all_to_all_in_place = True   # an output exactly over its own input: read in a round before written
    quick_names = True     # quick_all_reduce takes a dtype name ("bfloat16" bits as uint16)
    retired: str | None = None   # why the group was destroyed, for a thread still inside a call

    def __init__(self, world, ranks: tuple, seg):
        self.world, self.ranks, self.seg = world, ranks, seg   # ranks: the members' global ranks
        self.n = len(ranks)
        self.me = ranks.index(world.rank)
        self.rank = world.rank
        self.slot, self.round_bytes = layout.PARAMS.unpack_from(seg.mm, layout.PARAMS_AT)
        base = seg.addr
        self.ctl = [base + segment.HEADER_BYTES + i * CTL_STRIDE for i in range(self.n)]
        data_at = _align(segment.HEADER_BYTES + self.n * CTL_STRIDE)
        self.buffers = [[base + data_at + (2 * i + b) * self.slot for b in (0, 1)] for i in range(self.n)]
        host = world.host
        self.my_bell = host.my_ctl
        self.others = np.array([host.ctls[r] for r in ranks if r != world.rank], dtype=np.uint64)
        self.packed: dict[tuple, bytes] = {}   # descriptors already packed, by call
        self.rows: dict[tuple, np.ndarray] = {}  # _rows views, by (parity, count, dtype)
        self.quick: dict[tuple, tuple | None] = {}   # quick_all_reduce plans, by (dtype, op)
        self.split: bool | None = None    # False: the members cannot reach each other's memory
        self.split_min, = layout.PAIR_SINGLE.unpack_from(seg.mm, layout.PAIR_SINGLE_AT)   # the creator's
        self.scratch: np.ndarray | None = None   # where the other member's chunk is read (_all_reduce_split)
        self.paths_at = seg.addr + layout.PAIR_PATHS_AT     # the members' way per size class (paths.py)
        # calls from this size may go as single copies: two members' broadcast and all_reduce, more members'
        # broadcast (read from the root's array)
        self.either_min = self.split_min if self.n == 2 else max(self.split_min, DIRECT_MIN)
        # the first member times both ways and writes the word (its own setting: it is the creator)
        self.chooser = paths.Chooser() if self.me == 0 and self.split_min > 0 and \
            settings.get("SHMDIST_PAIR_CHOOSE") else None
        self.small = min(SMALL_ALLREDUCE_PAIR if self.n == 2 else SMALL_ALLREDUCE, self.slot)
        self.row_stride = 2 * self.slot
        self.lock = _core.RLock()
        self.backoff = world.engine.backoff
        self.ph = _core.Phaser(self.ctl[0], CTL_STRIDE, self.n, self.me, self.others, self.my_bell,
                               self.backoff, self.lock, _BARRIER, self.buffers[0][0], self.slot,
                               _PHASER_KINDS, KINDS.index("all_reduce"), KINDS.index("broadcast"))
        self.last_bdtype, self.last_bname = None, b""   # quick_broadcast's last dtype and its name
        self.cpus = len(os.sched_getaffinity(0))          # CPUs this rank may use

    @property
    def phase(self) -> int:
        """Phases this member entered (the Phaser counts them)."""
        return self.ph.phase

    @property
    def calls(self) -> int:
        return self.ph.calls

    @property
    def broken(self) -> str | None:
        """Why the group can no longer run collectives, or None."""
        return self.ph.broken

    @broken.setter
    def broken(self, why: str | None) -> None:
        self.ph.broken = why

    def arena_bytes(self) -> int:
        return self.seg.size if self.seg.mapped else 0     # (0: unmapped, its group destroyed)

    def unlink(self) -> None:
        """Remove the arena's name now, for a failed set-up (idempotent)."""
        self.seg.unlink()

    def close(self) -> None:
        self.rows.clear()         # (views of the arena: with them alive the mapping could not go)
        self.scratch = None
        self.seg.close()

    def retire(self, why: str, within: float) -> bool:
        """Refuse new calls (``why``) and let a thread that sleeps inside a
        call out (it raises at its next wake); True once no call is inside,
        so the arena may be unmapped. False after ``within`` seconds."""
        self.retired = self.broken = why
        if self.lock._is_owned():
            return False        # this very thread is inside a call (a signal handler's destroy)
        deadline = time.monotonic() + within
        while not self.lock.acquire(timeout=0.005):
            _core.ring_bell(self.my_bell)
            if time.monotonic() > deadline:
                return False
        self.lock.release()
        return True

    # ------------------------------------------------------------ phases

    def _buf(self, member: int, parity: int) -> int:
        return self.buffers[member][parity]

    def _pass(self, what, timeout: float, desc: bytes | None = None) -> int:
        """Arrive at the next phase and wait for every member. With ``desc``,
        first publish this call's descriptor; returns DIFFER when the members'
        descriptors then differ."""
        how = self.ph.enter(desc)
        if how != NOT_YET:
            return how
        return self._finish_pass(what, timeout, desc is not None)

    def _finish_pass(self, what, timeout: float, compare: bool) -> int:
        """Sleep until every member entered the phase this member entered last;
        then, with ``compare``, DIFFER when their last descriptors differ."""
        try:
            self._sleep_until(self.ph.phase, what, timeout)
        except BaseException:
            _core.trace_set(self.ph.tseq, TRACE_FAILED)   # (not left waiting: KeyboardInterrupt too)
            raise
        if compare and not _core.all_same(self.ctl[0] + self.ph.desc_at, CTL_STRIDE, self.n, _DESC.size):
            return DIFFER
        _core.trace_set(self.ph.tseq, TRACE_DONE)   # trace: the call's first phase passed (trace.py)
        return DONE

    def _sleep_until(self, target: int, what, timeout: float) -> None:
        what = _said(what)
        start = time.monotonic()
        deadline = start + timeout
        while not _core.wait_phase(self.ctl[0], CTL_STRIDE, self.n, target, self.my_bell, 0, 0,
                                   min(LIVENESS_PERIOD, max(0.0, deadline - time.monotonic()))):
            if self.retired:
                raise DistError(f"rank {self.rank}: {what}: {self.retired} while this call waited for "
                                "the other members; it never completes")
            late = [i for i in range(self.n) if _core.load_u64(self.ctl[i]) < target]
            if not late:
                continue        # the last one came after the wait gave up: the next wait sees it
            for i in late:
                why = self.world.engine.peer_gone(self.ranks[i])
                if why:
                    self.broken = f"rank {self.ranks[i]} {why} during {what}"
                    raise DistPeerError(
                        f"rank {self.rank}: {what}: rank {self.ranks[i]} {why} before the "
                        "collective finished; the group cannot continue, restart the job")
            if time.monotonic() >= deadline:
                waiting = ", ".join(str(self.ranks[i]) for i in late)
                self.broken = f"{what} timed out"
                self.world.engine.note_timeout(f"{what} waiting for rank{'s' if len(late) > 1 else ''} {waiting}")
                raise DistTimeoutError(
                    f"rank {self.rank}: {what}: Timed out after {timeout:g} s waiting for rank(s) "
                    f"{waiting} of group {list(self.ranks)}; {self._where(late, target)}. This "
                    "group can no longer run collectives: destroy it (or the job) and start again")

    def _where(self, late: list, target: int) -> str:
        """Where the members ``late`` (indices) are, for a timeout's message: at the call's
        first phase, not yet in this call; at a later one, inside it (every member passed
        the first phase: stopped, or busy between its phases)."""
        names = f"rank {self.ranks[late[0]]}" if len(late) == 1 else \
            f"ranks {', '.join(str(self.ranks[i]) for i in late)}"
        has = "has" if len(late) == 1 else "have"
        if target == self.ph.call_phase:
            return f"{names} {has} not called it"
        return f"{names} called it and {has} not finished {'its' if len(late) == 1 else 'their'} " \
               "part (stopped, or busy inside the call)"

    def _first_pass(self, what, desc: tuple | bytes, timeout: float) -> None:
        """The first phase of a call: publish the descriptor (a tuple, or
        already packed), pass, compare."""
        if self._pass(what, timeout, self._packed(what, desc)) == DIFFER:
            self._mismatch(what)

    def _packed(self, what, desc: tuple | bytes) -> bytes:
        """The call's descriptor as its members compare it; refuses a broken group."""
        if self.broken:
            raise unusable(self.rank, what, self.ranks, self.broken)
        packed = desc if desc.__class__ is bytes else self.packed.get(desc)
        if packed is None:
            kind, nbytes, op, root, dtype, extra = desc
            root = self.ranks[root] if root >= 0 else -1
            packed = layout.pack_desc(kind, nbytes, op, root, dtype.encode(), extra)
            if len(self.packed) >= 1024:
                self.packed.clear()
            self.packed[desc] = packed
        return packed

    def _mismatch(self, what) -> None:
        """Raise the error for a call the members disagree on (the last one)."""
        parity = (self.calls - 1) % 2
        descs = [self._read_desc(i, parity) for i in range(self.n)]
        raise disagree(self.rank, what, self.ranks, descs, self.calls)

    def _desc_at(self, member: int, parity: int) -> int:
        return self.ctl[member] - self.seg.addr + layout.SLOT_DESC + layout.DESC_BYTES * parity

    def _read_desc(self, member: int, parity: int) -> tuple:
        return _DESC.unpack_from(self.seg.mm, self._desc_at(member, parity))

    def _rows(self, parity: int, count: int, dtype) -> np.ndarray:
        """The first ``count`` elements of every member's buffer ``parity``
        as one (members, count) array (the buffers are equally spaced)."""
        key = (parity, count, dtype)
        rows = self.rows.get(key)
        if rows is None:
            first = self._view(self._buf(0, parity), count, dtype)
            stride = self._buf(1, parity) - self._buf(0, parity) if self.n > 1 else count * dtype.itemsize
            rows = np.lib.stride_tricks.as_strided(first, (self.n, count), (stride, dtype.itemsize),
                                                   writeable=False)
            if len(self.rows) >= 256:
                self.rows.clear()
            self.rows[key] = rows
        return rows

    def _view(self, addr: int, count: int, dtype) -> np.ndarray:
        off = addr - self.seg.addr
        return self.seg.array[off:off + count * dtype.itemsize].view(dtype)

    # ------------------------------------------------------------ collectives

    def barrier(self, timeout: float) -> None:
        self._first_pass("barrier", _BARRIER, timeout)

    def barrier_as(self, kind: str, dtype: str, timeout: float) -> None:
        """Only the call check, for a collective whose data moves elsewhere."""
        self._first_pass(f"{kind} (uneven)", (kind, 0, 0, -1, dtype, 1), timeout)

    def refuse(self, kind: str, timeout: float) -> None:
        """Take part in a call whose own arguments were bad: the members that
        called it validly raise a mismatch naming this rank's refusal, and the
        group stays in step (every call passes exactly one first phase)."""
        self._first_pass(f"{kind} (refused)", refused(kind), timeout)

    def broadcast(self, buf, root: int, timeout: float) -> None:
        """Root streams through its buffers; the others copy out. A big
        message goes straight between the arrays: two members copy half each,
        more read all of it from the root's."""
        what = lambda: f"broadcast(src={self.ranks[root]}, {buf.describe()})"
        desc = ("broadcast", buf.nbytes, 0, root, buf.dtype, 0)
        start = self._start(buf.nbytes)
        if self._splits(buf.nbytes, 1):
            if self.me != root:     # the root writes (some of) it here: see _ring.pxi, _touch
                _core.touch(buf.addr, _split_half(buf.nbytes) if self.n == 2 else buf.nbytes)
            b = self.phase % 2
            other = self._split_first(buf, what, desc, timeout, root)
            if other is not None and (self._broadcast_split(buf, root, other, what, timeout) if self.n == 2
                                      else self._broadcast_direct(buf, root, other, b, what, timeout)):
                if start:
                    self._timed(1, buf.nbytes, True, start)
                return
            desc, start = None, 0.0     # the call's first phase has passed: the rounds follow it
        total, chunk = buf.nbytes, self.slot
        rounds = max(1, -(-total // chunk))
        for r in range(rounds):
            at, size = r * chunk, min(chunk, total - r * chunk)
            b = self.phase % 2
            if self.me == root:
                _core.copy(self._buf(root, b), buf.addr + at, size)
            if r == 0 and desc is not None:
                self._first_pass(what, desc, timeout)
            else:
                self._pass(what, timeout)
            if self.me != root:
                _core.copy(buf.addr + at, self._buf(root, b), size)
        if start:
            self._timed(1, total, False, start)

    # ------------------------------------------------------------ two members, single copies

    def _splits(self, nbytes: int, kind: int) -> bool:
        """Whether a call of ``kind`` (paths.KINDS: 0 all_reduce, 1
        broadcast) moving ``nbytes`` goes as single copies between the
        members' arrays (process_vm_readv/writev): two members from
        SHMDIST_SINGLE_COPY bytes (the creator's, layout.PAIR_SINGLE), at
        least PAIR_SPLIT_MIN, more members (broadcast only) from DIRECT_MIN,
        where the shared word says so for the size class at this call's
        phase (paths.py); never with SHMDIST_SINGLE_COPY=0, nor once the
        members found they cannot: nothing any member decides alone, so all
        take the same way."""
        if self.split is False or self.split_min <= 0 or (self.n > 2 and kind != 1):
            return False
        return nbytes >= self.either_min and self._masks() >> _bit(kind, nbytes) & 1 == 1

    def _masks(self) -> int:
        """The members' ways (paths.py) for a call starting at this member's phase."""
        return _mask_at(_load(self.paths_at), self.ph.phase)

    def _start(self, nbytes: int) -> float:
        """When a call of ``nbytes`` that member 0 times began (paths.py); 0.0: not timed."""
        return time.perf_counter() if self.chooser is not None and nbytes >= self.either_min else 0.0

    def _timed(self, kind: int, nbytes: int, single: bool, start: float) -> None:
        """Member 0, after a call that could have gone either way and
        went ``single`` (single copies) or through the arena, begun at
        ``start``: time it and write the way its class wants into the shared
        word, from the next phase on (paths.py), under the group's lock (a
        one-call broadcast returns without it): no call of this member's runs
        between reading the phase and the write."""
        if self.split is False:
            return                 # (a copy failed in this call: the pair keeps the buffers)
        cls = _bit(kind, nbytes)
        want = self.chooser.record(cls, single, time.perf_counter() - start, nbytes)
        with self.lock:
            now = self._masks()    # (the word, not what this member wrote last: the masks any reader sees)
            new = now | 1 << cls if want else now & ~(1 << cls)
            if new != now:
                _core.store_u64(self.paths_at, paths.pack(self.ph.phase + 1, new, now))

    def _split_first(self, buf, what, desc, timeout: float, root: int = -1) -> tuple | None:
        """The first phase of a call the members may do as single copies:
        publish (pid, address of the array) in this member's buffer, pass,
        then the (pid, address) of the member this one copies from (the other
        of two; else the root), or None when a member that must reach
        another's memory may not (the probe at init, shm.py: EPERM under
        Yama's ptrace scope, SHMDIST_SINGLE_COPY=0). Every member reads the
        same answers once all are inside the call, so all decide alike, and
        the group takes the buffers from then on."""
        b = self.phase % 2
        self._words(self._buf(self.me, b), 3)[:] = (os.getpid(), buf.addr, 0)   # 0: the counter at _COUNTER_AT
        self._first_pass(what, desc, timeout)
        host = self.world.host
        at = host.local_ranks.index
        # who reads whom: both ways between two; every other member the root's array
        ways = ((0, 1), (1, 0)) if self.n == 2 else ((i, root) for i in range(self.n) if i != root)
        if not all(_core.ctl_reads(host.ctls[self.ranks[i]], at(self.ranks[j])) is True for i, j in ways):
            self.split = False
            return None
        source = 1 - self.me if self.n == 2 else root
        pid, addr = (int(x) for x in self._words(self._buf(source, b)))
        return pid, addr

    def _split_end(self, err: int, what, timeout: float) -> int:
        """The last phase of a call done as single copies: publish this
        member's errno (0: its copies went), pass, and return the first
        nonzero of all members' (the others' copies into this member's array
        included)."""
        b = self.phase % 2
        self._words(self._buf(self.me, b))[0] = err
        self._pass(what, timeout)
        for i in range(self.n):
            err = err or int(self._words(self._buf(i, b))[0])
        return err

    def _broadcast_split(self, buf, root: int, other: tuple, what, timeout: float) -> bool:
        """Broadcast between two members as two single copies at once: the
        root writes the first half into the other's array (process_vm_writev)
        while the other reads the second half from the root's. False when a
        copy failed: the root's array is as it was, and the rounds redo it."""
        pid, addr = other
        half = _split_half(buf.nbytes)
        if self.me == root:
            err = _core.cma_write(pid, addr, buf.addr, half)
        else:
            err = _core.cma_read(pid, buf.addr + half, addr + half, buf.nbytes - half)
        if self._split_end(err, what, timeout):
            self.split = False      # (both saw it: the pair takes the buffers from now on, alike)
            return False
        return True

    def _broadcast_direct(self, buf, root: int, other: tuple, b: int, what, timeout: float) -> bool:
        """Broadcast among three or more members straight from the root's
        array, which is never copied into the arena: each reader's array is
        cut into DIRECT_CHUNK chunks, claimed from a counter in the reader's
        buffer ``b`` (written with its pid and address at the first phase) by
        the reader, which reads them from the root's array (process_vm_readv),
        and, where the readers outnumber the root's CPUs, by the root, which
        writes them (process_vm_writev) round the readers, so a reader the
        scheduler leaves waiting is served by the root (with a CPU per reader
        the root's writes only take time from them). Everyone leaves at the
        last phase, when every chunk is in. False when a copy failed: the
        root's array is as it was, and the rounds redo the call for every
        member."""
        nbytes = buf.nbytes
        chunks = -(-nbytes // DIRECT_CHUNK)
        err = 0
        if self.me != root:
            pid, addr = other
            err = max(0, _core.cma_claim(self._buf(self.me, b) + _COUNTER_AT, chunks, DIRECT_CHUNK, pid,
                                         buf.addr, addr, nbytes, False, False))
        elif self.n - 1 > self.cpus:    # the root helps only where a reader may wait for a CPU (else it slows them)
            readers = []
            for i in range(self.n):
                if i != root:
                    pid, addr = (int(x) for x in self._words(self._buf(i, b)))
                    readers.append((self._buf(i, b) + _COUNTER_AT, pid, addr))
            while readers and not err:
                for r in list(readers):
                    counter, pid, addr = r
                    e = _core.cma_claim(counter, chunks, DIRECT_CHUNK, pid, buf.addr, addr, nbytes, True, True)
                    if e < 0:
                        readers.remove(r)
                    elif e:
                        err = e
                        break
        if self._split_end(err, what, timeout):
            self.split = False      # (all saw it: the group takes the buffers from now on, alike)
            return False
        return True

    def _all_reduce_split(self, buf, arr: np.ndarray, plan: tuple, other: tuple, what,
                          timeout: float) -> None:
        """all_reduce between two members as single copies: member 0 reduces
        the first half of the elements, member 1 the second. Chunk by chunk,
        each reads the other's chunk into a private buffer (process_vm_readv),
        reduces it with its own in place, in rank order, and writes the result
        into the other's array (process_vm_writev). Each array's half that the
        other reduces is only read and then written by that other member, so
        nothing is read after it changed. A copy that fails leaves the arrays
        half reduced: both members raise (never a silently wrong result)."""
        pid, addr = other
        kind, code, _ = plan
        isz, count = arr.dtype.itemsize, arr.size
        half = count // 2
        lo, hi = (0, half) if self.me == 0 else (half, count)
        step = max(1, SPLIT_CHUNK // isz)
        if self.scratch is None:
            self.scratch = np.empty(SPLIT_CHUNK, np.uint8)
        tmp = self.scratch.ctypes.data
        err = 0
        for at in range(lo, hi, step):
            n = min(step, hi - at)
            mine, theirs = buf.addr + at * isz, addr + at * isz
            err = _core.cma_read(pid, tmp, theirs, n * isz)
            if err:
                break
            first, second = (mine, tmp) if self.me == 0 else (tmp, mine)
            _core.reduce_two(kind, code, mine, first, second, n)
            err = _core.cma_write(pid, theirs, mine, n * isz)
            if err:
                break
        err = self._split_end(err, what, timeout)
        if err:
            self.split = False
            raise DistError(
                f"rank {self.rank}: {what()}: could not copy to or from rank {self.ranks[1 - self.me]}'s "
                f"memory ({os.strerror(err)}); the tensor holds a partly reduced result. The group goes "
                "on through its shared buffers (set SHMDIST_SINGLE_COPY=0 to use them from the start)")

    def _words(self, addr: int, count: int = 2) -> np.ndarray:
        return self._view(addr, count, _U64)

    def quick_barrier(self, timeout: float, how: int | None = None) -> bool:
        """The whole barrier in one C call when the others are already there
        (else it sleeps here). False, having done nothing, for a broken group.
        ``how``: what Phaser.barrier() returned, when the caller called it."""
        if how is None:
            how = self.ph.barrier()
        if how > 0:                       # DONE or DONE_SPINNING
            return True
        if how == BROKEN:
            return False
        try:                              # the Phaser left the lock held
            if how == DIFFER or self._finish_pass("barrier", timeout, True) == DIFFER:
                self._mismatch("barrier")
        finally:
            self.lock.release()
        return True

    def quick_all_reduce(self, arr: np.ndarray, op: ReduceOp, timeout: float,
                         dtype_name: str | None = None) -> bool:
        """all_reduce of a small C-contiguous numpy array of a common dtype
        and op, reduced in C in one call when the others are already there:
        what all_reduce below does for it, with less Python around. False,
        having done nothing, when it does not apply. ``dtype_name``:
        "bfloat16" for a uint16 array of bfloat16 bits."""
        how = self.ph.all_reduce(arr, op, self.small, dtype_name)
        if how > 0:                       # DONE or DONE_SPINNING
            return True
        if how == BROKEN or how == NOT_TAKEN:
            return False
        self._finish_quick_all_reduce(arr, op, timeout, dtype_name, how)
        return True

    def quick_broadcast(self, arr: np.ndarray, root: int, timeout: float, dtype_name: str | None = None) -> bool:
        """broadcast of a C-contiguous numpy array that fits one round, from
        member ``root``, in one C call when the others are already there: what
        broadcast below does for it, with less Python around. False, having
        done nothing, when it does not apply (too big, two members that copy
        between their arrays, an array numpy cannot name as the general path
        does). ``dtype_name``: "bfloat16" for a uint16 array of bfloat16 bits."""
        if not 0 <= root < self.n or self.ranks[root] != root or self._splits(arr.nbytes, 1):
            return False        # (the default group, where a global rank is its member index)
        start = self._start(arr.nbytes)
        if dtype_name is not None:
            name = dtype_name.encode()
        elif arr.dtype is self.last_bdtype:
            name = self.last_bname
        else:
            if not arr.dtype.isnative or arr.dtype.hasobject or arr.dtype.fields is not None \
                    or arr.dtype.subdtype is not None:
                return False
            name = arr.dtype.name.encode()
            self.last_bdtype, self.last_bname = arr.dtype, name
        how = self.ph.broadcast(arr, root, self.slot, name)
        if how > 0:                       # DONE or DONE_SPINNING
            if start:
                self._timed(1, arr.nbytes, False, start)
            return True
        if how == BROKEN or how == NOT_TAKEN:
            return False
        what = lambda: f"broadcast(src={self.ranks[root]}, " \
                       f"{describe(arr.nbytes, dtype_name or arr.dtype.name, arr.shape)})"
        try:                              # the Phaser left the lock held
            if how == DIFFER or self._finish_pass(what, timeout, True) == DIFFER:
                self._mismatch(what)
            if self.me != root:
                _core.copy(arr.ctypes.data, self._buf(root, (self.phase - 1) % 2), arr.nbytes)
        finally:
            self.lock.release()
        if start:
            self._timed(1, arr.nbytes, False, start)
        return True

    def _finish_quick_all_reduce(self, arr: np.ndarray, op: ReduceOp, timeout: float,
                                 dtype_name: str | None, how: int) -> None:
        """quick_all_reduce when the others were not all there yet (NOT_YET)
        or the calls differ (DIFFER); apart, so that the common call makes no
        closure."""
        kind, code, _ = self.ph.plan(arr.dtype, op, dtype_name)
        what = lambda: f"all_reduce({op.name}, {describe(arr.nbytes, dtype_name or arr.dtype.name, arr.shape)})"
        try:                              # the Phaser left the lock held
            if how == DIFFER or self._finish_pass(what, timeout, True) == DIFFER:
                self._mismatch(what)
            b = (self.phase - 1) % 2
            _core.reduce_rows(kind, code, arr.ctypes.data, self.buffers[0][b], self.row_stride,
                              self.n, arr.size)
        finally:
            self.lock.release()

    def all_reduce(self, buf, arr: np.ndarray, op: ReduceOp, timeout: float, root: int = -1) -> None:
        """Every rank (or only ``root``, for reduce) ends with the reduction.

        Small: each rank copies its vector in and reduces all of them itself.
        Large: rank i reduces the i-th part of each chunk into its buffer of
        the next round (reduce-scatter), and everyone copies the reduced
        parts out one round later (all-gather), so the two stages of
        consecutive chunks share a phase. For the dtypes and ops of
        Phaser.plan the rounds run in C, in the same chunks.
        """
        kind = "all_reduce" if root < 0 else "reduce"
        what = (lambda: f"{kind}({op.name}, {buf.describe()})") if root < 0 else \
            (lambda: f"reduce({op.name}, dst={self.ranks[root]}, {buf.describe()})")
        desc = (kind, buf.nbytes, int(op), root, buf.dtype, 0)
        n, me, dtype = self.n, self.me, arr.dtype
        isz = dtype.itemsize
        count = arr.size
        start = 0.0      # a call that may go either way, which the first of two members times (paths.py)
        if root < 0 and n == 2 and buf.nbytes > self.small:
            plan = self.ph.plan(dtype, op, buf.dtype)     # (nothing here may differ between the two)
            if plan is not None:
                start = self._start(buf.nbytes)
            if plan is not None and self._splits(buf.nbytes, 0):
                other = self._split_first(buf, what, desc, timeout)
                if other is not None:
                    self._all_reduce_split(buf, arr, plan, other, what, timeout)
                    if start:
                        self._timed(0, buf.nbytes, True, start)
                    return
                start = 0.0     # (the pair found it cannot: this call's first phase has passed, the whole call follows)
        if buf.nbytes <= self.small:
            b = self.phase % 2
            _core.copy(self._buf(me, b), buf.addr, buf.nbytes)
            self._first_pass(what, desc, timeout)
            if root < 0 or root == me:
                reduce_rows(arr, self._rows(b, count, dtype), op, buf.dtype, n)
            return
        # a round's parts, plus my reduced part, fit the slot; C and Python rounds split alike
        per_round = min((self.slot // isz - 1) * n // (n + 1), self.round_bytes // isz)
        plan = self.quick.get((buf.dtype, op), False) if _fast.rounds_in_c() else None
        if plan is False:
            plan = self.quick[(buf.dtype, op)] = self.ph.plan(dtype, op, buf.dtype)
        if plan is not None:
            self._all_reduce_rounds(arr, plan, per_round, root, what, desc, timeout)
            if start:
                self._timed(0, buf.nbytes, False, start)
            return
        rounds = -(-count // per_round)
        parts = None
        for r in range(rounds + 1):
            b = self.phase % 2
            if r < rounds:
                lo = r * per_round
                parts = _parts(min(per_round, count - lo), n)
                for j, (s, length) in enumerate(parts):
                    if j != me and length:
                        _core.copy(self._buf(me, b) + s * isz, buf.addr + (lo + s) * isz, length * isz)
            if r == 0:
                self._first_pass(what, desc, timeout)
            else:
                self._pass(what, timeout)
            if r >= 1 and (root < 0 or root == me):        # gather the parts of chunk r-1
                plo = (r - 1) * per_round
                for j, (s, length) in enumerate(prev_parts):
                    if length:
                        _core.copy(buf.addr + (plo + s) * isz, self._buf(j, b) + per_round * isz,
                                   length * isz)
            if r < rounds:                                  # reduce my part of chunk r
                s, length = parts[me]
                if length:
                    inputs = [arr[lo + s:lo + s + length] if j == me else
                              self._view(self._buf(j, b) + s * isz, length, dtype) for j in range(n)]
                    out = self._view(self._buf(me, 1 - b) + per_round * isz, length, dtype)
                    reduce_into(out, inputs, op, buf.dtype, n)
                prev_parts = parts
        if start:
            self._timed(0, buf.nbytes, False, start)

    def _all_reduce_rounds(self, arr: np.ndarray, plan: tuple, per_round: int, root: int, what,
                           desc: tuple, timeout: float) -> None:
        """The rounds of all_reduce's large case in C (Phaser.all_reduce_rounds),
        back here only to sleep until late members arrive."""
        packed = self._packed(what, desc)
        kind, code, _ = plan
        keep = root < 0 or root == self.me
        addr = arr.ctypes.data
        r, resume = 0, False
        while True:
            r = self.ph.all_reduce_rounds(addr, arr.size, kind, code, per_round, keep, r,
                                          resume, packed)
            if r == ALL_ROUNDS_DONE:
                return
            if r == DIFFER or self._finish_pass(what, timeout, r == 0) == DIFFER:
                self._mismatch(what)
            resume = True

    def all_gather(self, outs: list, buf, root: int, timeout: float) -> None:
        """Each rank's input lands in every rank's ``outs`` (or only root's, for gather)."""
        kind = "all_gather" if root < 0 else "gather"
        what = (lambda: f"{kind}({buf.describe()})") if root < 0 else \
            (lambda: f"gather(dst={self.ranks[root]}, {buf.describe()})")
        total, chunk = buf.nbytes, self.slot
        rounds = max(1, -(-total // chunk))
        for r in range(rounds):
            at, size = r * chunk, min(chunk, total - r * chunk)
            b = self.phase % 2
            _core.copy(self._buf(self.me, b), buf.addr + at, size)
            if r == 0:
                self._first_pass(what, (kind, total, 0, root, buf.dtype, 0), timeout)
            else:
                self._pass(what, timeout)
            if root < 0 or root == self.me:
                for j, out in enumerate(outs):
                    if out != buf.addr:      # an output that is the input itself holds it already
                        _core.copy(out + at, self._buf(j, b), size)

    def scatter(self, ins: list, buf, root: int, timeout: float) -> None:
        """Root's j-th input lands in rank j's ``buf``."""
        what = lambda: f"scatter(src={self.ranks[root]}, {buf.describe()})"
        n = self.n
        total = buf.nbytes
        chunk = self.slot // n // 64 * 64
        rounds = max(1, -(-total // chunk))
        for r in range(rounds):
            at, size = r * chunk, min(chunk, total - r * chunk)
            b = self.phase % 2
            if self.me == root:
                for j, src in enumerate(ins):
                    _core.copy(self._buf(root, b) + j * chunk, src + at, size)
            if r == 0:
                self._first_pass(what, ("scatter", total, 0, root, buf.dtype, 0), timeout)
            else:
                self._pass(what, timeout)
            _core.copy(buf.addr + at, self._buf(root, b) + self.me * chunk, size)

    def reduce_scatter(self, out_buf, out_arr: np.ndarray, ins: list, in_arrs: list, op: ReduceOp,
                       timeout: float) -> None:
        """Rank i ends with the reduction over ranks of everyone's i-th input."""
        what = lambda: f"reduce_scatter({op.name}, {out_buf.describe()} per rank)"
        n, me, dtype = self.n, self.me, out_arr.dtype
        isz = dtype.itemsize
        count = out_arr.size
        per_round = max(1, self.slot // n // isz)
        rounds = max(1, -(-count // per_round))
        for r in range(rounds):
            lo = r * per_round
            length = min(per_round, count - lo)
            b = self.phase % 2
            for j, src in enumerate(ins):
                if j != me and length:
                    _core.copy(self._buf(me, b) + j * per_round * isz, src + lo * isz, length * isz)
            if r == 0:
                self._first_pass(what, ("reduce_scatter", out_buf.nbytes, int(op), -1, out_buf.dtype, 0),
                                 timeout)
            else:
                self._pass(what, timeout)
            if length:
                inputs = [in_arrs[me][lo:lo + length] if j == me else
                          self._view(self._buf(j, b) + me * per_round * isz, length, dtype) for j in range(n)]
                reduce_into(out_arr[lo:lo + length], inputs, op, out_buf.dtype, n)

    def all_to_all(self, outs: list, ins: list, piece: int, dtype: str, timeout: float) -> None:
        """Rank j's i-th input lands in rank i's j-th output (equal pieces)."""
        what = lambda: f"all_to_all({piece} bytes per pair)"
        n, me = self.n, self.me
        chunk = self.slot // n // 64 * 64
        rounds = max(1, -(-piece // chunk))
        for r in range(rounds):
            at, size = r * chunk, min(chunk, piece - r * chunk)
            b = self.phase % 2
            for j, src in enumerate(ins):
                if j != me:
                    _core.copy(self._buf(me, b) + j * chunk, src + at, size)
            if r == 0:
                self._first_pass(what, ("all_to_all", piece, 0, -1, dtype, 0), timeout)
            else:
                self._pass(what, timeout)
            for j, dst in enumerate(outs):
                src = ins[me] + at if j == me else self._buf(j, b) + me * chunk
                _core.copy(dst + at, src, size)


def unusable(rank: int, what, ranks, broken: str) -> DistError:
    """The error of a call on a group that a failure made unusable (every comm says it so)."""
    return DistError(f"rank {rank}: {_said(what)}: group {list(ranks)} is unusable since {broken}; destroy "
                     "it and create a new one")


def disagree(rank: int, what, ranks, descs: list, number: int | None = None) -> DistMismatchError:
    """The error of a call the members of group ``ranks`` disagree on
    (``descs``: each member's layout.DESC fields; ``number``: which call of
    the group it was, when counted)."""
    calls = "; ".join(f"rank {r} called {_describe(d)}" for r, d in zip(ranks, descs))
    on = f" on collective #{number}" if number is not None else ""
    return mismatch(
        f"rank {rank}: {_said(what)}: the ranks of group {list(ranks)} disagree{on}: {calls}. Every rank "
        "of a group must call the same collectives in the same order, with the same sizes, dtypes, ops "
        "and roots", descs)


def refused(kind: str) -> tuple:
    """The descriptor of a call this rank refused for its own arguments."""
    return ("refused", 0, KINDS.index(kind), -1, "", 0)


def mismatch(message: str, descs: list) -> DistMismatchError:
    """The error of a call the members disagree on; ``calls`` holds every
    member's (kind, bytes, op, root, dtype, extra), so a caller can tell one
    disagreement from another."""
    e = DistMismatchError(message)
    e.calls = [(KINDS[d[1]] if d[1] < len(KINDS) else d[1], d[2], d[3], d[4],
                d[5].rstrip(bytes(1)).decode(errors="replace"), d[6]) for d in descs]
    return e


def _describe(d: tuple) -> str:
    _, kind, nbytes, op, root, dtype, extra = d
    name = KINDS[kind] if kind < len(KINDS) else f"collective kind {kind}"
    if name == "refused":
        of = KINDS[op] if 0 <= op < len(KINDS) else "a collective"
        return f"{of} with arguments it refused (its own error says why)"
    args = []
    if name in ("all_reduce", "reduce", "reduce_scatter"):
        args.append(ReduceOp(op).name if 0 <= op < len(ReduceOp) else str(op))
    if root >= 0:
        args.append(f"root={root}")
    if name != "barrier":
        args.append(f"{nbytes} bytes of {dtype.rstrip(bytes(1)).decode()}")
    if name == "empty":
        args.append(f"shape digest {extra:08x}")
    elif extra and name in ("all_reduce", "broadcast"):     # in place (comm/shared.py)
        args.append(f"in place in shmdist.empty memory #{extra >> 40} at offset {extra & (1 << 40) - 1}")
    return f"{name}({', '.join(args)})"

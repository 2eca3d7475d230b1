"""Point-to-point matching and waiting, over any channel that moves records.

A channel (a shared-memory ``_core.Ring`` today) carries records of a
header and a payload from one rank to one other rank, in order. The engine
keeps, per process:

- a FIFO of sends per destination (one record streams at a time),
- the receives posted and not yet matched, in the order they were posted,
- per source, the record now streaming in, and
- the "unexpected" records that arrived before a receive asked for them.

A record is matched to the first posted receive with the same
(source or any, group, tag); the ring is FIFO, so order per (pair, group,
tag) holds. There is no progress thread: every call into the engine and
every wait moves all pending operations forward, so two ranks that both
send before they receive do not deadlock.

Single copy: a message of at least SHMDIST_SINGLE_COPY bytes to a local
peer, while a receive from that peer is pending here (both ways at once) or, one
way, when it is bigger than the ring or of at least ONE_WAY_SINGLE_MIN bytes,
goes as a small record instead (the fast lane,
_lane.pxi, decides the same way for the sends it takes), flagged HDR_SINGLE_COPY, whose payload is
SINGLE_COPY (this process's pid, the message's address). The receiver reads
the message from here with process_vm_readv, straight into its buffer (or,
unasked for, into a private one, so the sender is never held up), then
counts the record in the ring's RING_ACKED and rings the sender; the send
completes when that count passes it. It reads in waits and tests, never
while a receive is posted (progress: posting stays cheap, so a rank posts
its own sends before it reads the peer's). Half the copying of the ring's two
copies (sender in, receiver out), and the one copy left is the receiver's,
so two ranks sending to each other each copy only what they receive. Used
only where the peer's probe at init could read this rank's memory
(shm.py), never while a receive pending here writes into the memory sent
(a single copy reads it later than a ring copy would), and a receive into
memory an unread single copy still reads waits for that read first.

A receiver reading a single copy of at least HELP_MIN bytes for a posted
receive offers the sender to share the reading (_ring.pxi, "sharing a
single copy's reading"): the sender, waiting for that read, copies chunks
into the receiver's buffer with process_vm_writev (_help) while the
receiver reads the others, so each core copies about half. A sender busy
elsewhere copies nothing and loses nothing: the receiver claims every chunk.
No offer while the ring to the sender holds a record of this rank's it has
not read (both ways at once: each core is busy reading already; Ring.pair).
While such a reading is open, nothing else is read from that ring; a receive
that goes elsewhere meanwhile first ends it (settle_help), and so does close.
"""
from __future__ import annotations

import datetime
import errno
import math
import numbers
import os
import threading
import time
from collections import deque

import numpy as np

from shmdist import _core, settings, trace
from shmdist.errors import DistError, DistMismatchError, DistPeerError, DistTimeoutError
from shmdist.layout import DONE, HEADER as HDR, MAGIC, MAX_DIMS, VERSION   # the record header (layout.py)
from shmdist.layout import HDR_SINGLE_COPY, HELPING, SINGLE_COPY
from shmdist.request import DistributedRequest
from shmdist.tensors import as_buf, describe
from shmdist.transport import ways

LIVENESS_PERIOD = 0.2     # seconds between checks that the peers waited on are alive
# One way (no receive from the destination pending here), a message goes in a single copy
# when the ring could not take it whole, or from ONE_WAY_SINGLE_MIN (128 KiB) bytes; smaller
# ones stream through the ring, pipelined on two cores. Its reading is shared with the sender
# from HELP_MIN bytes (two chunks), so each core copies about half: one way at 16 MiB 20-28
# GB/s against 14-15 through the ring, where one process_vm_readv moves 10 (bench/cma_probe.py).
# From 128 KiB rather than 512 with sharing from 256 KiB rather than 512 (2026-12-06, code
# before and after alternated three times, medians GB/s): windowed 128 KiB 13.6 -> 18.0,
# 256 KiB 14.7 -> 17.9; blocking 128 KiB 14.1 -> 16.1, 256 KiB 14.4 -> 19.5; ping-pong
# 256 KiB 33 -> 22 us, 128 KiB 17.1 -> 18.3 us (README).
# Single copies one way only behind earlier ones still being read (a window of isends) left
# the blocking loop and ping-pong to the ring's two copies: 1 MiB blocking 1.28-1.38 x Open MPI
# against 0.52-0.74 now, latency 0.91-0.98 against 0.49-0.58 (interleaved benchmark,
# 2026-12-06; README). When sends went as single copies in Python (2026-12-05) the same
# rule was a loss: each blocking send waited a round trip of Python for its read.
ONE_WAY_SINGLE_MIN = _core.ONE_WAY_SINGLE_MIN    # (the fast lane, _lane.pxi, decides by it too)
HELP_MIN = 256 << 10
COLLECTIVE_GID = 1 << 40  # group ids at and above it carry collectives' own messages


_headers: dict = {}
_dtype_fields: dict = {}


LEFT = "left the group (destroy_process_group)"


def left_because(cause: str) -> str:
    """How a peer that left is described, with the failure that made it leave."""
    return f"{LEFT} after {cause}" if cause else LEFT


def dtype_field(dtype: str) -> bytes:
    """A dtype name as the header carries it (16 bytes, zero-padded)."""
    field = _dtype_fields.get(dtype)
    if field is None:
        field = _dtype_fields[dtype] = dtype.encode().ljust(16, b"\0")
    return field


def make_header(tag: int, gid: int, src: int, buf, flags: int = 0) -> bytes:
    """The record header for ``buf``; repeated sends reuse the bytes.
    ``flags``: HDR_SINGLE_COPY for a single-copy record (its payload is
    SINGLE_COPY, the header still describes the message)."""
    key = (tag, gid, src, buf.dtype, buf.shape, flags)
    header = _headers.get(key)
    if header is None:
        shape = tuple(buf.shape)
        dims = shape if len(shape) <= MAX_DIMS else ()
        header = HDR.pack(MAGIC, VERSION, len(shape), tag, gid, src, flags, buf.nbytes,
                          buf.dtype.encode(), *dims, *([0] * (MAX_DIMS - len(dims))))
        if len(_headers) >= 4096:
            _headers.clear()
        _headers[key] = header
    return header


def Backoff(oversubscribed: bool) -> _core.Backoff:
    """The waiting policy of this process (see _core.Backoff): spin up to
    SHMDIST_SPIN pauses (~50 us), or, with more local ranks than cores, no
    spinning but SHMDIST_YIELDS sched_yields before sleeping."""
    most = 0 if oversubscribed else settings.get("SHMDIST_SPIN")
    yields = settings.get("SHMDIST_YIELDS") if oversubscribed else 0
    return _core.Backoff(most, yields)


class _Send:
    # addr, nbytes: the payload the record carries (the message, or a single copy's SINGLE_COPY in meta)
    __slots__ = ("req", "chan", "header", "buf", "pos", "total", "dst", "addr", "nbytes", "meta")


class _Recv:
    __slots__ = ("req", "src", "gid", "tag", "buf", "dtype16")


class _Incoming:
    """A record arriving (or arrived) from ``src``."""
    __slots__ = ("src", "gid", "tag", "nbytes", "dtype", "shape", "pos", "total",
                 "target", "data", "addr", "done", "claimed", "meta")   # meta: a single copy's SINGLE_COPY

    def matches(self, r: _Recv) -> bool:
        return r.gid == self.gid and r.tag == self.tag and (r.src is None or r.src == self.src)

    def describe(self) -> str:
        return describe(self.nbytes, self.dtype, self.shape)


class Engine:
    def __init__(self, rank: int, timeout: float, my_ctl: int, transports: list, oversubscribed: bool):
        """``transports``: each a transport.Transport; ``my_ctl``: the doorbell
        this rank's waits sleep on (every transport rings it)."""
        self.rank = rank
        self.timeout = timeout
        self.ctl = my_ctl
        chan_out, chan_in = {}, {}
        self.transport_of = {}            # global rank -> the transport that reaches it
        for t in transports:
            chan_out.update(t.out)
            chan_in.update(t.inc)
            self.transport_of.update(dict.fromkeys(t.out, t))
        self.chan_out = chan_out          # global rank -> channel we produce into
        # single copy: local peers that may read this rank's memory take big messages from it
        self.single_min = settings.get("SHMDIST_SINGLE_COPY")
        self.single_by = {r: t for t in transports if hasattr(t, "single_copy_to") for r in t.out}
        self.single = {}                  # local peer -> smallest message it reads itself (once known)
        self.pid = os.getpid()
        self.chan_in = list(chan_in.items())   # (global rank, channel we consume)
        # source -> (its ring, the any-source receive being read from it with the sender's help:
        # take said HELPING): while that help is open the sender may still write a chunk into the
        # receive's buffer, so no other source's message may be given to it (_reserved)
        self.reading: dict = {}
        for src, chan in self.chan_in:    # (both ways at once, a single copy's reading is not shared)
            if isinstance(chan, _core.Ring) and isinstance(chan_out.get(src), _core.Ring):
                chan.pair(chan_out[src])
        # sendq {dst: deque of _Send}, posted [_Recv], rx {src: _Incoming or None}, unexpected
        # [_Incoming]: one object, shared with the fast lane, emptied in place, never replaced
        self.queues = _core.Queues([src for src, _ in self.chan_in])
        self.lock = _core.RLock()     # threading.RLock's behaviour, cheap while uncontended
        self.dead: dict[int, str] = {}    # peer -> why it is gone
        self.causes: dict[int, str] = {}  # peer that left -> the failure it left over
        self.timed_out = ""               # this rank's first timeout, as its peers should read it
        self.failed_over = ""             # a failure seen on the engine between hosts (gloo, MPI)
        self.backoff = Backoff(oversubscribed)
        self.closed = False
        self.forked = ""                  # in a forked child: why the parent's engine is not its own
        self.waiting: set = set()         # threads inside wait_for: close() lets them out before unmapping
        self.lane = _core.Lane(self, rank, 1 + max([rank, *chan_out, *chan_in]), chan_out, chan_in)
        # the big messages to local ranks that may go either way time both (ways.py)
        self.ways = ways.Ways(chan_out, self.lane.complete_sent) \
            if self.single_by and self.single_min > 0 and settings.get("SHMDIST_P2P_CHOOSE") else None

    # ------------------------------------------------------------ posting

    def send(self, req, buf, dst: int, gid: int, tag: int) -> None:
        chan = self.chan_out[dst]
        req._peers = (dst,)
        with self.lock:
            meta = None
            sendq = self.queues.sendq
            q = sendq.get(dst)
            timed = both = False    # a message either way may take, timed (ways.py)
            if buf.nbytes >= self.single_min > 0 and dst in self.single_by:
                both = self._receiving_from(dst)
                whole = self.single_by[dst].ring_bytes >= _core.record_bytes(buf.nbytes)
                if (both or not whole or buf.nbytes >= ONE_WAY_SINGLE_MIN) and \
                        buf.nbytes >= self._single_limit(dst) and not self._written(buf):
                    # one way, into a ring that takes it whole now: one bigger than the room (or
                    # behind queued sends) would need this rank's progress to finish, and a receiver
                    # must not wait for a sender busy elsewhere
                    timed = self.ways is not None and whole and not both and not q and \
                        chan.room() >= _core.record_bytes(buf.nbytes)
                    if not timed or self.ways.single(dst, buf.nbytes, both):
                        meta = np.array([self.pid, buf.addr], dtype=np.uint64)      # layout.SINGLE_COPY
            if meta is not None:
                header = make_header(tag, gid, self.rank, buf, HDR_SINGLE_COPY)
                addr, nbytes = meta.ctypes.data, SINGLE_COPY.size
            else:
                header = make_header(tag, gid, self.rank, buf)
                addr, nbytes = buf.addr, buf.nbytes
            total = _core.record_bytes(nbytes)
            pos = 0
            if not q:       # nothing queued before it: write what fits now
                if timed:   # (a queued one is not: where it starts in the ring is not known yet)
                    self.ways.posted(dst, meta is not None, req, chan.produced() + total, buf.nbytes, both)
                pos = chan.push(header, addr, nbytes, 0)
                if pos == total and meta is None:
                    req._complete()
                    return
            op = _Send()
            op.req, op.buf, op.dst, op.pos, op.chan, op.header, op.total = req, buf, dst, pos, chan, header, total
            op.addr, op.nbytes, op.meta = addr, nbytes, meta
            if pos == total:    # a single copy's record went whole: it completes when dst has read it
                self._await(op)
                return
            if q:
                q.append(op)
            else:
                sendq[dst] = deque([op])

    def _single_limit(self, dst: int) -> float:
        """The smallest message ``dst`` reads from this rank's memory itself
        (inf: none, or not known yet). Lock held."""
        limit = self.single.get(dst)
        if limit is None:
            ok = self.single_by[dst].single_copy_to(dst)
            if ok is None:
                return float("inf")     # it has not probed yet: copy through the ring meanwhile
            limit = self.single[dst] = self.single_min if ok else float("inf")
        return limit

    def _receiving_from(self, dst: int) -> bool:
        """Whether a receive from ``dst`` is pending here: traffic both ways,
        where each rank's copying is what limits (lock held)."""
        if self.queues.rx.get(dst) is not None:
            return True
        if self.lane.pending is not None and any(req._peers == (dst,) for req in self.lane.pending_requests()):
            return True     # a small receive the fast lane keeps
        return any(r.src == dst or r.src is None for r in self.queues.posted)

    def _written(self, buf) -> bool:
        """Whether a receive pending here may write into ``buf``'s memory: a
        single copy of it would then be read after it changed (lock held)."""
        lo, hi = buf.addr, buf.addr + buf.nbytes
        if self.lane.pending is not None:
            self.lane.settle()
        q = self.queues
        targets = [r.buf for r in q.posted]
        targets += [inc.target.buf for inc in q.rx.values() if inc is not None and inc.target is not None]
        targets += [inc.claimed.buf for inc in q.unexpected if inc.claimed is not None]
        return any(t.addr < hi and lo < t.addr + t.nbytes for t in targets)

    def _await(self, op: _Send) -> None:
        """A single copy's record is in the ring: wait for dst to read the message."""
        q = self.queues.awaiting.get(op.dst)
        if q is None:
            self.queues.awaiting[op.dst] = deque([op])
        else:
            q.append(op)

    def _reading(self, buf) -> list:
        """The requests of single-copy sends whose memory a receive into
        ``buf`` would overwrite before their destination has read it (lock held)."""
        lo, hi = buf.addr, buf.addr + buf.nbytes
        return [op.req for q in self.queues.awaiting.values() for op in q
                if op.buf.addr < hi and lo < op.buf.addr + op.buf.nbytes]

    def recv(self, req, buf, src: int | None, gid: int, tag: int, members) -> None:
        if self.queues.awaiting:
            with self.lock:
                self.progress()
                reading = self._reading(buf)
            for sent in reading:   # (only when one buffer is both sent and received into at once)
                self.wait_for(sent, None)
        r = _Recv()
        r.req, r.src, r.gid, r.tag, r.buf = req, src, gid, tag, buf
        r.dtype16 = dtype_field(buf.dtype)
        req._peers = (src,) if src is not None else tuple(m for m in members if m != self.rank)
        with self.lock:
            if self.lane.pending is not None:
                self.lane.settle()      # posted before this one: it matches first
            for inc in self.queues.unexpected:
                if inc.claimed is None and inc.matches(r):
                    if self._fits(r, inc):
                        if inc.done:
                            self._deliver(r, inc)
                        else:
                            inc.claimed = r
                    return
            self.queues.posted.append(r)
            # the caller may be about to post the receives (and sends) for what follows: no single
            # copy is read here, however many have arrived, so posting stays cheap
            self.progress(drain=False, single=False)

    def post_recv(self, req, arr, src: int, tag: int) -> None:
        """Post one of the fast lane's pending receives (lock held): as recv()
        would have when it was called, without looking for a match yet."""
        r = _Recv()
        r.req, r.src, r.gid, r.tag = req, src, 0, tag
        r.buf = as_buf(arr, writable=True, who=f"rank {self.rank}: recv")
        r.dtype16 = dtype_field(r.buf.dtype)
        self.queues.posted.append(r)

    def exchange(self, what: str, sends: list, recvs: list, gid: int, members, timeout: float) -> None:
        """One point-to-point step of a collective (hier.py's between nodes,
        the uneven all_to_all and reduce_scatter): post every receive of
        ``recvs`` [(buf, src)], then every send of ``sends`` [(buf, dst)], on
        group id ``gid`` (COLLECTIVE_GID | the group's: no user message
        matches them) and tag 0, and wait for them all. A request that fails
        raises its error with ``peers``, the ranks it waited on, set on it."""
        self.wait_exchange(self.post_exchange(what, sends, recvs, gid, members), timeout)

    def post_exchange(self, what: str, sends: list, recvs: list, gid: int, members) -> list:
        """The posting half of exchange(): its requests, for wait_exchange."""
        reqs = []
        for buf, src in recvs:
            req = DistributedRequest(self, f"{what}: receive from rank {src}")
            self.recv(req, buf, src, gid, 0, members)
            reqs.append(req)
        for buf, dst in sends:
            req = DistributedRequest(self, f"{what}: send to rank {dst}")
            self.send(req, buf, dst, gid, 0)
            reqs.append(req)
        return reqs

    def wait_exchange(self, reqs: list, timeout: float) -> None:
        """The waiting half of exchange()."""
        for req in reqs:
            try:
                req.wait(timeout)
            except DistError as e:
                e.peers = req._peers or ()
                raise

    # ------------------------------------------------------------ progress

    def poll(self) -> None:
        if self.forked:
            raise DistError(f"is_completed(): {self.forked}")
        with self.lock:
            if not self.closed:
                self.progress()

    def progress(self, drain: bool = True, single: bool = True, until=None) -> None:
        """Move every pending send and receive as far as it goes now.

        A message that no posted receive matches is drained into a buffer of
        its own when ``drain``, so that a sender never stays blocked (two
        ranks that both send large messages before receiving do not
        deadlock); when not, it stays in the ring for a receive posted soon,
        which then gets it without the extra copy. The fast lane's pending
        receives stay in the lane while nothing else is posted or arriving
        (its rings are left to it); else they are posted first, in order.
        Once a receive completed
        in this pass, nothing more is drained in it: the caller that waited
        for that receive is about to post the next one (a loop of blocking
        receives), and the record behind it should stream straight into that
        receive's buffer rather than into a private one and be copied again
        (that extra copy, and the page faults of a fresh buffer per message,
        were the blocking-send "slow mode": ~1.5 GB/s at 1 MiB). A sender
        held up by such a record is served by the next progress pass.

        Without ``single`` (posting a receive), no single copy is read: its
        record waits in rx for the next pass. Reading them there made posting
        a window of irecvs read every message the peer had sent meanwhile
        while this rank's own isends were not posted yet, so the peer sat
        idle: both ways at once ran one way at a time (a window of 32 1 MiB
        messages: one rank waited 2.1 ms while the other read 22 of them
        inside its irecvs).
        ``until``: the request a wait is for; once it is done nothing more is
        drained in this pass. Without that, the pass that saw the last ack of
        a window read the peer's next window unasked, one message at a time
        into fresh private buffers (page faults: 2.6 GB/s), while the peer,
        its sends waiting for those very reads, idled (14 ms for 32 MiB)."""
        held = None
        queues = self.queues
        rx, posted, sendq = queues.rx, queues.posted, queues.sendq
        if self.ways is not None and self.ways.pending:
            self.ways.poll()
        if self.reading:
            self.reading = {s: held for s, held in self.reading.items() if held[0].help_open()}
        if self.lane.pending is not None:
            if posted or queues.unexpected or any(inc is not None for inc in rx.values()):
                self.lane.settle()
            else:
                held = self.lane.progress_pending()
        if sendq:
            for dst in list(sendq):
                q = sendq[dst]
                while q:
                    op = q[0]
                    op.pos = op.chan.push(op.header, op.addr, op.nbytes, op.pos)
                    if op.pos < op.total:
                        break
                    q.popleft()
                    if op.meta is None:
                        op.req._complete()
                    else:
                        self._await(op)
                if not q:
                    del sendq[dst]
        if queues.awaiting:
            self._acked()
            if queues.awaiting:
                self._help()
        for src, chan in self.chan_in:
            if held is not None and src in held:
                continue        # a pending fast receive's ring: the lane takes its records
            while True:
                inc = rx[src]
                if inc is None:
                    if posted:      # the usual case, in one call: a whole record for the next receive
                        r = self._next_posted(src)
                        if r is not None:
                            if single and chan.help_min < 0:
                                chan.help_min = self._help_min(src)
                            got = chan.take(r.tag, r.gid, r.buf.addr, r.buf.nbytes, r.dtype16, single)
                            if got == DONE:
                                posted.remove(r)
                                self._complete_recv(r, src)
                                drain = False
                                continue
                            if got == HELPING:
                                if r.src is None:
                                    self.reading[src] = (chan, r)
                                break       # the producer copies chunks of it too: later
                    if chan.help_open() and (not single or not chan.settle_help()):
                        break   # the record is being read for a receive: its own (or the one gone) first
                    header = chan.peek()
                    if header is None:
                        break
                    if until is not None and until._done:
                        drain = False
                    inc = self._arrive(src, header, drain)
                    if inc is None:
                        break
                    rx[src] = inc
                if inc.meta is None:
                    inc.pos = chan.pull(inc.addr, inc.nbytes, inc.pos)
                    if inc.pos < inc.total:
                        break
                else:
                    inc.pos = chan.pull(inc.meta.ctypes.data, SINGLE_COPY.size, inc.pos)
                    if inc.pos < inc.total or not single:
                        break
                    if not self._read_single(chan, inc):
                        rx[src] = None
                        continue
                rx[src] = None
                if self._finish(inc):
                    drain = False

    def _help(self) -> None:
        """Copy chunks of the single copies that their destinations are reading
        now and offer to share (_ring.pxi, "sharing a single copy's reading"):
        each core then copies about half of a big message (lock held)."""
        for dst, q in self.queues.awaiting.items():
            chan = self.chan_out[dst]
            offer = chan.help_offer()
            if offer is None:
                continue
            seq, src, nbytes = offer
            if not any(op.buf.addr == src and op.buf.nbytes == nbytes for op in q):
                continue        # not a message of ours still waiting: leave it to its reader
            pid = self.single_by[dst].peer_pids.get(dst)
            if pid and self.single_by[dst].reads(dst):
                chan.help(pid, seq, src, nbytes)   # (a failed copy: the reader reads it all again)

    def lane_single_at(self, dst: int) -> int:
        """For the fast lane: the smallest message to ``dst`` that may go as a
        single copy; 0 while not known yet, -1 when none may."""
        if dst not in self.single_by or self.single_min <= 0:
            return -1
        limit = self._single_limit(dst)
        if limit == float("inf"):
            return -1 if dst in self.single else 0
        return int(limit)

    def _help_min(self, src: int) -> int:
        """The smallest single copy from ``src`` whose reading this rank offers
        to share with it: 0 when ``src`` may not write into this rank's
        memory, -1 while that is not known yet."""
        transport = self.single_by.get(src)
        if transport is None:
            return 0
        ok = transport.single_copy_to(src)
        return -1 if ok is None else (HELP_MIN if ok else 0)

    def _acked(self) -> None:
        """Complete the single-copy sends their destinations have read (lock held)."""
        self.lane.complete_sent()

    def _read_single(self, chan, inc: _Incoming) -> bool:
        """Read a single copy's message from the sender's memory into its
        destination, then tell the sender. False when that failed: the
        receive it was for fails, naming the sender."""
        pid, addr = int(inc.meta[0]), int(inc.meta[1])
        err = _core.cma_read(pid, inc.addr, addr, inc.nbytes) if inc.nbytes else 0
        why = self.peer_gone(inc.src)
        chan.ack()      # (after that look: a sender whose send completed may leave at once)
        if not err and (why is None or why == "died"):
            # A sender that died leaves its memory as it was; one that left may already have
            # been told its send failed and changed or freed the memory: what was read is only
            # the message if the sender had not said goodbye when the read ended.
            return True
        if why is None and err == errno.ESRCH:
            why = "died"
        what = (f"rank {inc.src} {why} before this rank had read its message" if why and not err else
                f"rank {inc.src} {why} before this rank could read its message (the send had not "
                "completed: its memory was no longer there to read)" if why else
                f"could not read the message from rank {inc.src}'s memory (process_vm_readv: "
                f"{os.strerror(err)}); set SHMDIST_SINGLE_COPY=0 to send through the ring instead")
        if inc.data is not None:
            self.queues.unexpected.remove(inc)
        r = inc.target if inc.target is not None else inc.claimed
        if r is not None:
            cls = DistPeerError if why else DistError
            r.req._complete(cls(f"rank {self.rank}: {r.req.op}: {what}; restart the job"
                                if why else f"rank {self.rank}: {r.req.op}: {what}"))
        return False

    def _next_posted(self, src: int) -> _Recv | None:
        """The receive the next record from ``src`` goes to if its tag and group fit."""
        for r in self.queues.posted:
            if r.src == src or (r.src is None and not (self.reading and self._reserved(r, src))):
                return r
        return None

    def _reserved(self, r: _Recv, src: int) -> bool:
        """Whether the any-source receive ``r`` is being read from another source's
        ring with that sender's help still open: a chunk of that message may yet
        land in its buffer, so it takes no message from ``src`` (lock held)."""
        return any(held[1] is r and s != src for s, held in self.reading.items())

    def _arrive(self, src: int, header: bytes, drain: bool) -> _Incoming | None:
        magic, version, ndim, tag, gid, hsrc, flags, nbytes, dtype, *dims = HDR.unpack(header)
        if magic != MAGIC or version != VERSION or hsrc != src:
            raise DistError(f"rank {self.rank}: recv: corrupted message header from rank {src} "
                            f"(magic {magic:#x}, version {version}, source {hsrc}); the shared "
                            "memory was overwritten by something else than shmdist")
        inc = _Incoming()
        inc.src, inc.gid, inc.tag, inc.nbytes = src, gid, tag, nbytes
        inc.dtype = dtype.rstrip(b"\0").decode()
        inc.shape = tuple(dims[:ndim]) if ndim <= MAX_DIMS else (f"{ndim} dims",)
        inc.pos, inc.total = 0, _core.record_bytes(nbytes)
        inc.done, inc.claimed, inc.target, inc.data, inc.meta = False, None, None, None, None
        if flags & HDR_SINGLE_COPY:
            inc.meta = np.zeros(2, dtype=np.uint64)
            inc.total = _core.record_bytes(SINGLE_COPY.size)
        i = 0
        posted = self.queues.posted
        while i < len(posted):
            r = posted[i]
            if inc.matches(r) and not (self.reading and r.src is None and self._reserved(r, src)):
                del posted[i]
                if self._fits(r, inc):
                    inc.target = r
                    inc.addr = r.buf.addr
                    return inc
                continue        # that receive failed; the message goes to the next one
            i += 1
        if not drain:
            return None
        inc.data = np.empty(nbytes, dtype=np.uint8)
        inc.addr = inc.data.ctypes.data if nbytes else 0
        self.queues.unexpected.append(inc)
        return inc

    def _fits(self, r: _Recv, inc: _Incoming) -> bool:
        """Check a message against the receive it matched; fail the receive
        (only it) when they disagree."""
        if r.buf.nbytes == inc.nbytes and r.buf.dtype == inc.dtype:
            return True
        r.req._complete(DistMismatchError(
            f"rank {self.rank}: recv: expected {r.buf.describe()} from rank {inc.src} (tag {inc.tag}), "
            f"got {inc.describe()}; post a receive buffer of the sent size and dtype. The message "
            "was kept: the next matching receive gets it"))
        return False

    def _finish(self, inc: _Incoming) -> bool:
        """A record arrived whole; True when that completed a receive."""
        if inc.target is not None:
            self._complete_recv(inc.target, inc.src)
            return True
        inc.done = True
        if inc.claimed is not None:
            self._deliver(inc.claimed, inc)
            return True
        return False

    def _deliver(self, r: _Recv, inc: _Incoming) -> None:
        self.queues.unexpected.remove(inc)
        if inc.nbytes:
            _core.copy(r.buf.addr, inc.addr, inc.nbytes)
        self._complete_recv(r, inc.src)

    def _complete_recv(self, r: _Recv, src: int) -> None:
        if r.buf.finish is not None:
            r.buf.finish()
        r.req.source = src
        r.req._complete()

    # ------------------------------------------------------------ waiting

    def wait_limit(self, req, timeout) -> float:
        """``wait(timeout=...)`` in seconds: a finite number (0 or less: only what has come
        already) or a timedelta, as torch's Work.wait takes; anything else is refused before
        the request is touched (a NaN deadline would never pass)."""
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not math.isfinite(seconds):
            raise ValueError(f"rank {self.rank}: {req.op}: wait(timeout={timeout!r}): expected a finite "
                             "number of seconds or a datetime.timedelta; pass e.g. timeout=5.0, or leave it "
                             "out for the group's timeout (the request is still pending)")
        return float(seconds)

    def wait_for(self, req, timeout: float | None) -> None:
        """Block until ``req`` is done, its deadline passes, or a peer it
        depends on is gone."""
        if self.forked:
            raise DistError(f"{req.op}: {self.forked}")
        if self.closed:         # close() failed every pending request: this one was not pending
            raise self._destroyed(req)
        me = threading.get_ident()
        self.waiting.add(me)
        try:
            self._wait_for(req, timeout)
        except BaseException:
            if not req._done:
                trace.not_waiting(req)   # trace: e.g. KeyboardInterrupt: still pending, not waited for
            raise
        finally:
            self.waiting.discard(me)

    def _wait_for(self, req, timeout: float | None) -> None:
        if req._lane is not None and self.lane.wait_pending(req, self.backoff.spin):
            return
        trace.waiting(req)   # trace: blocked from here on
        limit = self.timeout if timeout is None else float(timeout)
        start = time.monotonic()
        deadline = start + limit
        check_at = start + LIVENESS_PERIOD
        while True:
            if req._done:
                return
            if self.closed:     # another thread's destroy: memory may be unmapped next
                raise self._destroyed(req)
            seen = _core.bell_value(self.ctl)
            with self.lock:
                self.progress(until=req)
            if req._done:
                return
            now = time.monotonic()
            if now >= check_at:
                self._check_peers(req)
                if req._done:
                    return
                check_at = now + LIVENESS_PERIOD
            if now >= deadline:
                self._time_out(req, limit)
            b = self.backoff
            b.update(_core.wait_bell(self.ctl, seen, b.spin, b.yields, min(LIVENESS_PERIOD, deadline - now)))

    def peer_gone(self, peer: int) -> str | None:
        """None while ``peer`` lives and takes part; else why not."""
        if peer in self.dead:
            return self.dead[peer]
        transport = self.transport_of.get(peer)
        if transport is None:
            return None
        why, cause, final = transport.gone(peer)
        if why:
            if cause:
                self.causes[peer] = cause
            if final:
                self.dead[peer] = why
                if self.ways is not None:
                    self.ways.forget(peer)
        return why

    def leave_cause(self) -> str:
        """Why this rank leaves, for its peers to report: the first peer it
        saw fail ("rank 2 died"), else the cause a leaving peer passed on,
        else its own first timeout, else "" (a plain destroy)."""
        for peer, why in self.dead.items():
            if peer not in self.causes and not why.startswith(LEFT):
                return f"rank {peer} {why}"
        return next(iter(self.causes.values()), self.failed_over or self.timed_out)

    def note_failed_over(self, cause: str) -> None:
        """Remember a failure seen on a leg this engine does not carry (the
        gloo or MPI engine between hosts: "rank 2 on host b ...") as the
        cause this rank's goodbye gives, when no peer of its own failed."""
        if not self.failed_over:
            self.failed_over = cause

    def note_timeout(self, what: str) -> None:
        """Remember this rank's first timeout (``what``: the operation and
        whom it waited for) as the cause its goodbye gives."""
        if not self.timed_out:
            self.timed_out = f"rank {self.rank} timed out in {what}"

    def partly_sent(self) -> set:
        """The peers a record went out to only in part (their channel is mid-record)."""
        with self.lock:
            return {dst for dst, q in self.queues.sendq.items() if q and 0 < q[0].pos < q[0].total}

    def _check_peers(self, req) -> None:
        peers = [p for p in req._peers if p is not None]
        gone = [(p, why) for p in peers for why in [self.peer_gone(p)] if why]
        if not gone:
            return
        if len(peers) > 1 and len(gone) < len(peers) and all(why != "died" for _, why in gone):
            return   # any-source: ranks that left cleanly cannot send, but the others still may
        with self.lock:
            self.progress()   # whatever the peer finished before it went still counts
            if req._done:
                return
            self._cancel(req, force=True)
        names = ", ".join(f"rank {p} {why}" for p, why in gone)
        req._complete(DistPeerError(
            f"rank {self.rank}: {req.op}: {names} before the operation finished; restart the job "
            "(the survivors cannot complete this operation)"))

    def _time_out(self, req, limit: float) -> None:
        with self.lock:
            cancelled = self._cancel(req, force=False)
            single = not cancelled and any(op.req is req for q in self.queues.awaiting.values() for op in q)
        peers = [p for p in req._peers if p is not None]
        who = f" with rank {peers[0]}" if len(peers) == 1 else (" with any rank" if peers else "")
        if (len(peers) == 1 and f"rank {peers[0]}" in req.op) or (len(peers) > 1 and "any rank" in req.op):
            who = ""    # the operation names its peer already ("recv from rank 1")
        self.note_timeout(f"{req.op}{who}")
        fate = ("it was cancelled" if cancelled else
                "it went as a single copy, which the receiver reads straight from this rank's buffer "
                "once it posts its receive, so it stays pending (its record is in the ring already): "
                "wait() again to finish it, and leave the buffer as it is until it completes" if single else
                "part of the message already moved, so it stays pending: wait() again to finish it")
        error = DistTimeoutError(
            f"rank {self.rank}: {req.op}{who}: Timed out after {limit:g} s; {fate}. Check that the "
            "peer posts the matching call, or pass a larger timeout")
        if cancelled:
            req._complete(error)    # it will never complete otherwise: it says so from now on
        raise error

    def _cancel(self, req, force: bool) -> bool:
        """Withdraw the operation behind ``req`` if nothing of it moved yet
        (or, with ``force``, because its peer is gone). True if withdrawn."""
        if self.lane.holds(req):
            self.lane.settle()      # a pending fast receive: withdrawn from the engine's list below
        queues = self.queues
        for i, r in enumerate(queues.posted):
            if r.req is req:
                del queues.posted[i]
                return True
        for inc in queues.unexpected:
            if inc.claimed is not None and inc.claimed.req is req:
                inc.claimed = None      # it drains into its own buffer: the next receive gets it
                return True
        for src, inc in queues.rx.items():
            if inc is not None and inc.target is not None and inc.target.req is req:
                if force:
                    queues.rx[src] = None
                return force
        for dst, q in queues.sendq.items():
            for i, op in enumerate(q):
                if op.req is req:
                    if op.pos == 0 or force:
                        del q[i]
                        if not q:
                            del queues.sendq[dst]
                        return True
                    return False
        for dst, q in queues.awaiting.items():
            for op in q:
                if op.req is req:   # its record is in the ring: only a peer that is gone lets it go
                    if force:
                        q.remove(op)
                        if not q:
                            del queues.awaiting[dst]
                    return force
        return False

    def _destroyed(self, req) -> DistError:
        return DistError(f"rank {self.rank}: {req.op}: destroy_process_group was called before it "
                         "completed; it never will")

    def fail_group(self, gids: tuple, why: str) -> None:
        """Fail the receives posted on groups ``gids`` and not yet matched
        (their group was destroyed: nothing will ever match them). Sends
        complete anyway, since receivers drain what they did not ask for."""
        with self.lock:
            if self.lane.pending is not None:
                self.lane.settle()
            posted = self.queues.posted
            gone = [r for r in posted if r.gid in gids]
            posted[:] = [r for r in posted if r.gid not in gids]     # in place: the lane reads this list
        for r in gone:
            r.req._complete(DistError(f"rank {self.rank}: {r.req.op}: {why} before it completed; it "
                                      "never will"))

    def quiet(self, within: float) -> bool:
        """Wake this process's waiters and wait until no other thread is
        inside wait_for (they find their request failed); False if one still
        is after ``within`` seconds: then the memory must stay mapped."""
        me = threading.get_ident()
        deadline = time.monotonic() + within
        while self.waiting - {me}:
            _core.ring_bell(self.ctl)
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def close(self) -> None:
        """Leave: every operation still pending fails now, naming the
        destroy, so that its wait() raises instead of touching memory that
        is unmapped next."""
        with self.lock:
            self.closed = True
            q = self.queues
            reqs = self.lane.pending_requests() + [r.req for r in q.posted]
            reqs += [op.req for sends in q.sendq.values() for op in sends]
            reqs += [op.req for sends in q.awaiting.values() for op in sends]
            reqs += [inc.target.req for inc in q.rx.values() if inc is not None and inc.target is not None]
            reqs += [inc.claimed.req for inc in q.unexpected if inc.claimed is not None]
            self.lane.pending = None
            q.posted.clear()        # in place: the lane reads these very objects
            q.sendq.clear()
            q.awaiting.clear()
            for _, chan in self.chan_in:
                if hasattr(chan, "settle_help"):
                    chan.settle_help()   # no peer copies into a receive's memory once it has failed
        for req in reqs:
            if req is not None and not req._done:
                req._complete(self._destroyed(req))

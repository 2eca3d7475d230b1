"""Which way a big point-to-point message to a local rank moves: a single
copy (the receiver reads it from the sender's memory, process_vm_readv) or
the ring (the sender copies it in, the receiver out), chosen by timing both.

The engine's rule (engine.py, "Single copy") says when a message may go as
a single copy: one way from ONE_WAY_SINGLE_MIN bytes or when the ring could
not take it whole, both ways at once from SHMDIST_SINGLE_COPY bytes. Neither
way wins everywhere. On a 2-core VM in a quiet hour the rings moved 1 MiB
one way at 23-40 GB/s against 15-19 for single copies, a blocking loop at
31-33 against 15-18, both ways 24-36 against 19-20 (README, Benchmarks);
for seconds at a time the same VM's CPUs pass freshly written data 4-10 x
slower and the rings fell to 2.4-6.4 GB/s where single copies held 13-21.

So the sender times both, per destination, kind (one way, both ways) and
size class (128 KiB, 256 KiB ... 8 MiB, 16 MiB or more), with the
collectives' chooser (comm/paths.py: each way timed twice first, the other
tried ever more rarely, 15 % margin). Only the sender decides; the record
says which way it went, so the receiver needs no agreement. A message's
time is from its post until it was read: for a single copy, until the
sender sees its send complete (the receiver's ack; the sender waits for it
in the send's wait, and looks at once); for a ring copy, until the moment
the receiver's tail passed the record's end, which the receiver writes into
the ring's control block when the sender asked for it (layout.RING_TIME_END),
so a ring copy is timed to its reading even when the sender is busy
elsewhere (a ping-pong: waiting for the reply). One message per destination
is timed at a time (one look per post); a try of the other way lasts
TRY_BYTES of messages, so that a window of one way's messages is timed, not
a lone switch.
"""
from __future__ import annotations

import time
from shmdist.comm import paths

CLASSES = 8                    # 128 KiB, 256 KiB, ..., 8 MiB, 16 MiB or more
TRY_BYTES = 2 << 20            # a try of the other way moves about this much (at least 2 messages, at most TRY_MOST)
TRY_MOST = 8
POLL_S = 20e-6                 # a post looks at the timed message at most this often (the rest: progress, waits)


def bit(both: bool, nbytes: int) -> int:
    """The class of a message of ``nbytes`` (``both``: a receive from its destination is pending)."""
    return int(both) * CLASSES + min(max(nbytes.bit_length() - 18, 0), CLASSES - 1)


class _Timed:
    __slots__ = ("single", "req", "end", "posted", "cls", "nbytes")


class Ways:
    """One engine's choices and the timed messages not yet seen read (lock held in every call)."""

    def __init__(self, chan_out: dict, complete_sent, clock=time.monotonic):   # (the ring's stamps' clock)
        self.chan_out = chan_out
        self.complete_sent = complete_sent   # completes the single-copy sends already read (the lane's)
        self.clock = clock
        self.choosers: dict[int, paths.Chooser] = {}
        self.want: dict[tuple, int] = {}     # (destination, class) -> 1 single copy, 0 ring: the home way
        self.trying: dict[tuple, list] = {}  # (destination, class) -> [the other way, messages left to try it on]
        self.pending: dict[int, _Timed] = {}  # destination -> its message being timed
        self.taken = [0, 0]                  # messages either way could take that went through the ring, as single copies
        self.polled = 0.0                    # when single() last looked
        # The fast lane (_lane.pxi) takes want itself, without calling single() or posted(), while
        # a message to the destination is being timed and no try is on (False: it always calls)
        self.shortcut = True

    def single(self, dst: int, nbytes: int, both: bool) -> bool:
        """Whether a message the engine's rule lets go as a single copy should."""
        if self.pending:
            now = self.clock()
            if now - self.polled >= POLL_S:   # (a ring copy's time is its stamp, a single copy's seen in its wait)
                self.polled = now
                self.poll()
        key = (dst, bit(both, nbytes))
        trying = self.trying.get(key)
        return (self.want.get(key, 1) if trying is None else trying[0]) == 1

    def posted(self, dst: int, single: bool, req, end: int, nbytes: int, both: bool) -> None:
        """A message that may go either way went (``req``: a single copy's request; ``end``:
        a ring copy's record ends at that ring position). It is timed unless one to ``dst``
        is timed already: one at a time keeps the cost to a look per post."""
        self.taken[single] += 1
        if dst in self.pending and not self.trying:
            return                 # (the common case, first)
        cls = bit(both, nbytes)
        trying = self.trying.get((dst, cls))
        if trying is not None and trying[0] == single:
            trying[1] -= 1
            if trying[1] <= 0:
                del self.trying[(dst, cls)]      # the try went
        if dst in self.pending:
            return
        t = _Timed()
        t.single, t.req, t.end, t.posted, t.cls, t.nbytes = single, req, end, self.clock(), cls, nbytes
        self.pending[dst] = t
        if not single:
            self.chan_out[dst].time_until(end)    # the receiver writes when it read it (before it is written)

    def poll(self) -> None:
        """Time the timed messages seen read since the last look."""
        for dst, t in list(self.pending.items()):
            if t.single:                          # read when its send completed (the ack)
                if not t.req._done:
                    self.complete_sent()          # (the acks that came)
                    if not t.req._done:
                        continue
                at = self.clock()
            else:                                 # read when the receiver says (the ring's stamp)
                chan = self.chan_out[dst]
                at = chan.read_at(t.end)
                if at is None:
                    if chan.consumed() < t.end:
                        continue
                    at = self.clock()             # (read, no stamp: a receiver that missed it)
            del self.pending[dst]
            chooser = self.choosers.get(dst)
            if chooser is None:
                chooser = self.choosers[dst] = paths.Chooser(self.clock)
            way = chooser.record(t.cls, t.single, max(at - t.posted, 0.0), t.nbytes)
            home = chooser.classes[t.cls].home
            self.want[(dst, t.cls)] = home
            if way != home and (dst, t.cls) not in self.trying:
                # a try: for a few messages (one alone among the other way's times mostly the
                # switch), however many of home's are still in flight
                self.trying[(dst, t.cls)] = [way, min(max(TRY_BYTES // t.nbytes, 2), TRY_MOST)]

    def forget(self, dst: int) -> None:
        """``dst`` is gone: nothing more to time there."""
        self.pending.pop(dst, None)
        self.trying = {k: v for k, v in self.trying.items() if k[0] != dst}

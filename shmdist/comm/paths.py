"""Which way the members of a group move a big broadcast or (two members)
all_reduce: single copies straight between their arrays (three or more:
read from the root's), or rounds through the arena's buffers, chosen by
timing both.

Neither way wins everywhere. On one VM of the 2-core kind the single copies
(process_vm_readv) ran at 6.5 GB/s against memcpy's 13 and the arena took
an all_reduce of 1 MiB in 94-156 us against 122-186; on another the two were
equal; and for seconds at a time the same VM's CPUs passed data to each
other 4-10 x slower, when the arena's calls took 4 x as long and the single
copies' did not (README, Benchmarks). So the first member times every such
call and picks, per kind of call and size class, the way whose last three
calls were fastest per byte, trying the other one now and then.

All members must take the same way in every call (their first phase
writes different things: addresses for single copies, data for the
arena). The choice is one word in the arena's header that only member 0
writes, between its calls: the phase from which the new choice holds (low
32 bits), the new masks (one bit per class; set: single copies) and the
old ones. A member reads it at the start of a call, at the phase it is at
then, which is the same for every member in the same call; member 0 writes
"from my phase + 1", so a member that reads the word before the write and
one that reads it after see the same mask for that call, and no member can
start the next call (at a later phase) before member 0 entered that call's
first phase, after its write. Three or more members use it for broadcast
only, from DIRECT_MIN (comm/arena.py).
"""
from __future__ import annotations

import time
from collections import deque

KINDS = ("all_reduce", "broadcast")
CLASSES = 8                  # per kind: 1 MiB, 2, 4, ..., 64 MiB, and 128 MiB or more
EVERY_CLASS = (1 << (len(KINDS) * CLASSES)) - 1
_LOW = (1 << 32) - 1


def bit(kind: int, nbytes: int) -> int:
    """The class of a call of kind ``kind`` (an index in KINDS) moving ``nbytes``."""
    return kind * CLASSES + min(max(nbytes.bit_length() - 21, 0), CLASSES - 1)


def pack(since: int, new: int, old: int) -> int:
    """The shared word: ``new`` holds from phase ``since`` on, ``old`` before it."""
    return (since & _LOW) | (new << 32) | (old << 48)


INITIAL = pack(0, EVERY_CLASS, EVERY_CLASS)   # single copies everywhere until member 0 has timed both


def mask_at(word: int, phase: int) -> int:
    """The masks that hold for a call starting at ``phase``. The phase is
    compared modulo 2**32: both members compute the same answer from the
    same word at the same phase, whatever the distance."""
    since = word & _LOW
    if (phase - since) & _LOW < 1 << 31:
        return (word >> 32) & 0xFFFF
    return (word >> 48) & 0xFFFF


class _Class:
    __slots__ = ("home", "per_byte", "last", "calls", "gap")

    def __init__(self):
        self.home = 1                                    # single copies (the way before timing)
        self.per_byte = (deque(maxlen=Chooser.SAMPLES), deque(maxlen=Chooser.SAMPLES))   # by way
        self.last = [0.0, 0.0]                           # when each way was last timed
        self.calls = 0                                   # calls the home way made since the other's last
        self.gap = 0.0                                   # seconds between tries of the other way, for now


class Chooser:
    """Member 0's timing of both ways, per class: ``record`` each call and
    get the way wanted from now on (1: single copies, 0: the arena). The
    word takes it from the class's second call after this one (the next one
    may already have read the word), so an answer holds for a call longer
    than it is meant to: a try of the other way is asked once (the count of
    home's calls starts again then), and not again before it was timed. The way whose best of its last SAMPLES calls is
    fastest per byte is home, the other has to be faster by MARGIN to take
    over. Each way is timed twice first; after that the other one is tried
    after at least EXPLORE_CALLS calls of home, and once GAP_S seconds
    passed since its last try, a gap that doubles with each try that
    confirms home, up to EXPLORE_S, and starts again at 0 when home
    changes: a first impression (the first calls of a job run slow, for
    either way) is corrected within tens of calls, and in a slow window of
    the kind above the arena's extra cost is, once settled, one call in 50
    ms; the single copies' in quiet times less."""
    SAMPLES = 3
    MARGIN = 0.85
    EXPLORE_S = 0.05
    GAP_S = 0.001
    EXPLORE_CALLS = 8

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.classes: dict[int, _Class] = {}

    def record(self, cls: int, single: bool, seconds: float, nbytes: int) -> int:
        now = self.clock()
        c = self.classes.get(cls)
        if c is None:
            c = self.classes[cls] = _Class()
        way = int(single)
        c.per_byte[way].append(seconds / max(nbytes, 1))
        c.last[way] = now
        c.calls = c.calls + 1 if way == c.home else 0
        home, other = c.home, 1 - c.home
        if c.per_byte[other] and c.per_byte[home] and \
                min(c.per_byte[other]) < self.MARGIN * min(c.per_byte[home]):
            c.home, home, other = other, other, home
            c.calls, c.gap = 0, 0.0
        elif way != home and len(c.per_byte[way]) >= 2:  # a try that confirmed home: wait longer for the next
            c.gap = min(self.EXPLORE_S, max(2 * c.gap, self.GAP_S))
        if len(c.per_byte[other]) < 2:                   # not yet timed twice
            return other
        if c.calls >= self.EXPLORE_CALLS and now - c.last[other] >= c.gap:
            c.calls = 0    # (the try comes within two calls, and is timed, before home's count reaches this again)
            return other
        return home

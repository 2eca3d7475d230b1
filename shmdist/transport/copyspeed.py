"""Whether a single copy keeps up with memcpy on this machine.

A single copy (process_vm_readv: the receiver reads straight from the
sender's memory) saves a copy per byte over a ring or an arena, which copy
twice through shared memory, but pays the kernel's work per page. On the
2-core VM where shmdist was tuned both ran at one speed; on another VM of
the same kind (2026-12-06, evening) 1 MiB read in 256 KiB pieces took 83-87
us against 21-23 us for one memcpy of it, and a group's arena beat its
single copies below 16 MiB (README, Benchmarks, "When a single copy is
slow"). ``slow()`` measures that once per process; a group's creator then
publishes 16 MiB as where its members copy between their arrays, unless
SHMDIST_SINGLE_COPY is set. Point-to-point keeps its single copies: the
rings beat them there too in quiet hours, but fell 5-10 times in others,
where the single copies held.
"""
from __future__ import annotations

import os
import time

import numpy as np

from shmdist import _core

SLOWER_MAX = 2.0          # a single copy up to this many times memcpy's time keeps up
PROBE_BYTES = 1 << 20
PROBE_PIECE = 256 << 10   # the pieces a two-member collective reads (arena.SPLIT_CHUNK)
_slow: bool | None = None   # this process's answer, once measured


def slow() -> bool:
    """Whether a single copy takes over SLOWER_MAX times memcpy's time here
    (measured once per process, about 2 ms: ``times``)."""
    global _slow
    if _slow is None:
        _slow = too_slow(times())
    return _slow


def too_slow(measured: tuple[float, float] | None) -> bool:
    """The verdict on (single copy's seconds, memcpy's) for the same bytes;
    None (a read refused, as under seccomp) is not slow: the probe at init
    keeps such ranks off single copies anyway."""
    return measured is not None and measured[0] > SLOWER_MAX * measured[1]


def times() -> tuple[float, float] | None:
    """Seconds to read PROBE_BYTES from this very process with
    process_vm_readv in PROBE_PIECE pieces, and to memcpy them: each timed
    6 times, interleaved, best of each (the first warms the pages). None
    when a read is refused."""
    src = np.ones(PROBE_BYTES, dtype=np.uint8)
    dst = np.zeros_like(src)
    pid, at, to = os.getpid(), src.ctypes.data, dst.ctypes.data
    cma = copy = float("inf")
    for _ in range(6):
        t = time.perf_counter()
        for off in range(0, PROBE_BYTES, PROBE_PIECE):
            if _core.cma_read(pid, to + off, at + off, PROBE_PIECE):
                return None
        cma = min(cma, time.perf_counter() - t)
        t = time.perf_counter()
        _core.copy(to, at, PROBE_BYTES)
        copy = min(copy, time.perf_counter() - t)
    return cma, copy

"""The shared-memory transport: one segment per host and job, holding a
control block per local rank and one ring per ordered pair of local ranks.

Layout (offsets in bytes):

    0                      segment header (segment.py) + ring size, rank count
    4096                   control blocks, CTL_BYTES per local rank
    rings_at               ring (s -> d) for every s != d: RING_CTL_BYTES of
                           head/tail, then ring_bytes of data
"""
from __future__ import annotations

import os
import select

import numpy as np

from shmdist import _core, layout, settings
from shmdist.transport import segment
from shmdist.transport.engine import left_because

_LAYOUT = layout.PARAMS                 # ring bytes, local ranks; after the segment header
_LAYOUT_AT = layout.PARAMS_AT
RING_BYTES_BY_RANKS = ((4, 2 << 20), (8, 1 << 20))   # up to N local ranks: bytes per ordered pair
SMALL_RING_BYTES = 1 << 18                          # beyond: 16 ranks stay under 64 MiB
RING_ENV = "SHMDIST_RING_BYTES"
STREAM_ENV = "SHMDIST_STREAM_BYTES"


def stream_bytes() -> int:
    """Smallest payload received with streaming stores: SHMDIST_STREAM_BYTES
    (0 turns them off), else half the last-level cache (at least 8 MiB).
    A destination that big would not stay in the cache anyway, so writing
    it around the cache saves reading every line before it is overwritten."""
    value = settings.get(STREAM_ENV)
    if value is not None:
        return value
    return max(last_level_cache() // 2, 8 << 20)


def last_level_cache() -> int:
    """Bytes of the largest CPU cache Linux reports (0 when it says nothing)."""
    sizes = []
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = [e for e in os.listdir(base) if e.startswith("index")]
    except OSError:
        return 0
    for index in entries:
        try:
            with open(f"{base}/{index}/size") as f:
                text = f.read().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return max(sizes, default=0)


def ring_bytes_for(nlocal: int) -> int:
    """Ring size per ordered pair: SHMDIST_RING_BYTES, else by rank count.
    With few ranks a 1 MiB message and its header fit in one ring fill."""
    value = settings.get(RING_ENV)
    if value is not None:
        return value
    return next((size for most, size in RING_BYTES_BY_RANKS if nlocal <= most), SMALL_RING_BYTES)


def _align(n: int, a: int = 4096) -> int:
    return (n + a - 1) // a * a


def segment_bytes(nlocal: int, ring_bytes: int) -> int:
    rings_at = _align(segment.HEADER_BYTES + nlocal * layout.CTL_BYTES)
    return rings_at + nlocal * (nlocal - 1) * (layout.RING_CTL_BYTES + ring_bytes)


class ShmHost:
    """This rank's view of the host segment: its control block, its rings."""

    @staticmethod
    def open(store, key: str, local_ranks: list[int], rank: int, who: str, timeout: float) -> "ShmHost":
        """Create (lowest local rank) or attach the host segment, and map it."""
        n = len(local_ranks)
        creator = rank == local_ranks[0]
        size = ring = 0
        try:
            _core.set_stream_min(stream_bytes())    # this process's receives, from now on
            if creator:
                ring = ring_bytes_for(n)
                size = segment_bytes(n, ring)
        except BaseException as e:
            if creator:             # (a bad setting) the others learn it at once, not at their timeout
                segment.announce_error(store, key, e)
            raise
        seg = segment.share(store, key, n, creator, size, who, timeout,
                            init=lambda s: _LAYOUT.pack_into(s.mm, _LAYOUT_AT, ring, n))
        try:
            return ShmHost(seg, local_ranks, rank)
        except BaseException:
            seg.close()
            raise

    def __init__(self, seg: segment.Segment, local_ranks: list[int], rank: int):
        self.seg = seg
        n = len(local_ranks)
        self.ring_bytes, nl = _LAYOUT.unpack_from(seg.mm, _LAYOUT_AT)
        assert nl == n, "segment laid out for another number of local ranks"
        self.local_ranks = local_ranks
        self.me = local_ranks.index(rank)
        base = seg.addr
        self.ctls = {r: base + segment.HEADER_BYTES + i * layout.CTL_BYTES
                     for i, r in enumerate(local_ranks)}
        rings_at = _align(segment.HEADER_BYTES + n * layout.CTL_BYTES)
        stride = layout.RING_CTL_BYTES + self.ring_bytes

        def ring(s: int, d: int, other: int):
            idx = s * (n - 1) + (d if d < s else d - 1)
            at = base + rings_at + idx * stride
            return _core.Ring(at, at + layout.RING_CTL_BYTES, self.ring_bytes, self.ctls[other])

        self.out = {r: ring(self.me, i, r) for i, r in enumerate(local_ranks) if i != self.me}
        self.inc = {r: ring(i, self.me, r) for i, r in enumerate(local_ranks) if i != self.me}
        self.my_ctl = self.ctls[rank]
        self.peer_pids: dict = {}
        self.pidfds: dict = {}
        _core.ctl_set_pid(self.my_ctl, os.getpid())

    @property
    def ctl(self) -> int:
        return self.my_ctl

    def watch(self, pids: dict) -> None:
        """Watch the local peers' processes (global rank -> pid): a pidfd
        each, polled by gone(). Called once their pids are known."""
        self.peer_pids = dict(pids)
        self.pidfds = {}
        for r, pid in pids.items():
            try:
                self.pidfds[r] = os.pidfd_open(pid)
            except (OSError, AttributeError):
                self.pidfds[r] = None   # already gone, or no pidfd: checked by kill(0)

    def probe_single_copy(self, enabled: bool) -> None:
        """Find out, for each local peer, whether this rank may read its
        memory (process_vm_readv: refused with EPERM under Yama's ptrace
        scope, seccomp or some containers), by reading the peer's control
        block where the peer sees it, and publish the answer in this rank's
        control block for the peer to read (``single_copy_to``). With
        ``enabled`` false (SHMDIST_SINGLE_COPY=0) every peer is told no.
        Called once every local rank has set its control block."""
        for i, r in enumerate(self.local_ranks):
            if i == self.me or i >= 64:
                continue
            ok = False
            pid = self.peer_pids.get(r)
            addr = _core.ctl_addr(self.ctls[r])
            if enabled and pid and addr:
                word = np.zeros(1, dtype=np.uint64)
                ok = _core.cma_read(pid, word.ctypes.data, addr + layout.CTL_ADDR, 8) == 0 and int(word[0]) == addr
            _core.ctl_probed(self.my_ctl, i, ok)

    def reads(self, peer: int) -> bool:
        """Whether this rank may read (and write) local ``peer``'s memory: its own probe."""
        i = self.local_ranks.index(peer)
        return i < 64 and self.me < 64 and _core.ctl_reads(self.my_ctl, i) is True

    def single_copy_to(self, peer: int) -> bool | None:
        """Whether local ``peer`` reads this rank's memory itself (its probe
        succeeded); None until it has probed."""
        i = self.local_ranks.index(peer)
        if i >= 64 or self.me >= 64:
            return False
        return _core.ctl_reads(self.ctls[peer], self.me)

    def gone(self, peer: int) -> tuple[str | None, str, bool]:
        """transport.Transport.gone: a peer that closed its control block
        left (maybe over another's failure: its cause); one whose process
        ended without closing it died."""
        ctl = self.ctls.get(peer)
        if ctl is not None and _core.ctl_closed(ctl):
            # a clean leave (the rank may have exited since), maybe forced by another's failure
            cause = _core.ctl_cause(ctl).decode(errors="ignore")
            return left_because(cause), cause, False
        fd = self.pidfds.get(peer, -1)
        if fd is None:
            try:
                os.kill(self.peer_pids[peer], 0)
            except ProcessLookupError:
                return "died", "", True
        elif fd >= 0:
            p = select.poll()
            p.register(fd, select.POLLIN)
            if p.poll(0):
                return "died", "", True
        return None, "", False

    def unwatch(self) -> None:
        for fd in self.pidfds.values():
            if fd is not None and fd >= 0:
                os.close(fd)
        self.pidfds = {}

    def memory(self) -> dict:
        n = len(self.local_ranks)
        return {
            "segment_bytes": self.seg.size,
            "ring_bytes_per_pair": self.ring_bytes,
            "rings_of_this_rank": 2 * (n - 1) * self.ring_bytes,
        }

    def goodbye(self, cause: str = "") -> None:
        """Mark this rank's control block closed (once) and wake the peers.
        Done before the engine fails this rank's pending sends: a peer that
        reads a single copy from this rank's memory checks the mark after the
        read, so memory changed once a failed send gave it back is never taken
        for the message."""
        if os.getpid() != self.seg.pid or _core.ctl_closed(self.my_ctl):
            return
        _core.ctl_close(self.my_ctl, cause.encode())   # cut to CAUSE_BYTES there
        for r, ctl in self.ctls.items():
            _core.ring_bell(ctl)

    def close(self, cause: str = "", unmap: bool = True) -> None:
        """Say goodbye: peers waiting on this rank learn it left, not died,
        and ``cause``: the failure that made it leave, if one did. Without
        ``unmap`` the memory stays mapped (a thread may still read it)."""
        if os.getpid() != self.seg.pid:
            return
        self.unwatch()
        self.goodbye(cause)
        self.out = self.inc = {}
        if unmap:
            self.seg.close()

"""The contract every transport implements: what the engine (engine.py)
needs to move records to and from the ranks a transport reaches, to know
whether those ranks still take part, and to leave them with a cause.

Two implement it today: shared memory between the ranks of one host
(shm.ShmHost, channels are _core.Ring) and TCP to the ranks on other hosts
(tcp.Transport, channels are tcp.Link). Another inter-host transport
implements the same two Protocols and nothing else changes above it.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Channel(Protocol):
    """One rank's records to or from one other rank, in order. A record is
    a layout.HEADER header and a payload; its size in a channel is
    layout.record_bytes(payload bytes). Positions count from the record's
    start, so a record may move in several calls (a full ring, a socket
    that would block)."""

    def push(self, header: bytes, addr: int, nbytes: int, pos: int) -> int:
        """Write what fits of the record from position ``pos``; the new position."""

    def take(self, tag: int, gid: int, addr: int, nbytes: int, dtype16: bytes, single: bool = True) -> int:
        """Receive the next record in one call when it is all there and its
        header names (tag, group, bytes, dtype): layout.DONE. NOT_YET when it
        is not all there (a transport without a one-call receive always
        says so), OTHER_RECORD when it is another one. Without ``single``, a
        single-copy record (shm) is left for the engine (OTHER_RECORD)."""

    def peek(self) -> bytes | None:
        """The next record's header, or None when it has not arrived."""

    def pull(self, addr: int, nbytes: int, pos: int) -> int:
        """Consume what arrived of the peeked record into ``addr`` (0: drop
        it) from position ``pos``; the new position."""

    # Sharing a single copy's reading with its sender (shm; a transport without single
    # copies: help_open False, settle_help True, and an attribute help_min of 0, the bytes
    # from which it offers: 0 never, -1 not known yet, which the engine sets).

    def help_open(self) -> bool:
        """Whether the next record is being read with its sender's help (take
        said HELPING): nothing else may be read from the channel meanwhile."""

    def settle_help(self) -> bool:
        """End that help (its receive went elsewhere): True once the sender
        copies nothing more of it."""


@runtime_checkable
class Transport(Protocol):
    """The ranks one transport reaches: its channels, their liveness, and
    leaving them."""

    ctl: int                       # the control block whose doorbell wakes this rank's waits
    out: dict                      # peer -> Channel this rank produces into
    inc: dict                      # peer -> Channel this rank consumes

    def gone(self, peer: int) -> tuple[str | None, str, bool]:
        """Whether ``peer`` still takes part: (None, "", False) while it
        does; else (what happened to it, the failure it said it left over
        or "", whether that is final: a rank that died stays dead, a clean
        leave is asked again)."""

    def close(self, cause: str = "") -> None:
        """Leave every peer of this transport, telling them ``cause``: ""
        for a plain destroy, else the failure that made this rank leave
        ("rank 2 died"), so that every survivor names the first failure."""

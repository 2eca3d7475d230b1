"""Shared memory shared by the local ranks of a job: nameless (memfd).

The creating rank makes the memory with ``memfd_create``: it never has a
name in /dev/shm or anywhere else, so nothing can outlive the processes
that hold it (whatever is killed when, with any launcher or none), nothing
can be planted under its name, and a container's small /dev/shm does not
limit it. It is filled to its full size up front (``posix_fallocate``), so
too little memory is a clear error here instead of a SIGBUS later.

The other local ranks open it through ``/proc/<creator pid>/fd/<fd>``,
which the kernel allows to processes of the same user only (no ptrace
attach right needed), and check before they use it that it is what the
store said: a memfd owned by this user, mode 0600, of the announced size,
whose header carries the random token published in the store. The creator
closes its descriptor once every local rank has mapped it; from then on
the memory lives exactly as long as some rank maps it.
"""
from __future__ import annotations

import errno
import json
import mmap
import os
import secrets
import stat
import struct

import numpy as np

from shmdist.errors import DistError, DistPeerError

MAGIC = 0x53484D44_53454731  # "SHMDSEG1"
_HEAD = struct.Struct("<QQ16s")  # magic, size, token
MEMFD_NAME = "shmdist"           # what /proc/<pid>/maps shows: /memfd:shmdist (deleted)
HEADER_BYTES = 4096              # the first page of every segment holds the header above


class Segment:
    """One mapped segment. ``addr`` is where it starts in this process;
    ``fd`` is the creator's descriptor until every local rank mapped it."""

    def __init__(self, size: int, mm: mmap.mmap, token: bytes, fd: int | None = None):
        self.size, self.mm, self.token, self.fd = size, mm, token, fd
        self.mapped = True        # False once close() unmapped it
        self.name = f"memfd:{MEMFD_NAME}:{token[:8].hex()}"   # for messages and tests: no file has it
        self.array = np.frombuffer(mm, dtype=np.uint8)
        self.addr = self.array.ctypes.data
        self.pid = os.getpid()

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.array[offset:offset + nbytes]

    def release(self) -> None:
        """Close the creator's descriptor (the mapping stays)."""
        if self.fd is not None and os.getpid() == self.pid:
            os.close(self.fd)
        self.fd = None

    def unlink(self) -> None:
        """Nothing to remove: the memory has no name. Kept for the callers
        that clean up after a failed set-up; closing the descriptor is all."""
        self.release()

    def close(self) -> None:
        """Unmap, in the process that mapped it only (a forked child keeps its hands off)."""
        if os.getpid() != self.pid:
            return
        self.release()
        if self.mm is None:
            return
        self.array = None
        try:
            self.mm.close()
            self.mapped = False
        except BufferError:
            pass  # views still alive somewhere: the mapping goes with the process (still mapped)
        self.mm = None


def memory_available() -> int:
    """Bytes this process may still fill: MemAvailable, or less when its
    cgroup (a container's memory limit) has less room left; -1 if unknown."""
    avail = -1
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line.strip().split(":", 2)[2] for line in f if line.startswith("0::")), None)
        if path is not None:
            base = "/sys/fs/cgroup" + path
            with open(base + "/memory.max") as f:
                limit = f.read().strip()
            if limit != "max":
                with open(base + "/memory.current") as f:
                    room = int(limit) - int(f.read())
                avail = room if avail < 0 else min(avail, room)
    except (OSError, ValueError, IndexError):
        pass
    return avail


_FIX = ("Lower SHMDIST_RING_BYTES (per-pair ring size) or SHMDIST_ARENA_BYTES, run fewer local ranks, "
        "or give the job more memory (a container's memory limit); /dev/shm's size does not matter")
_FD_HINT = " (if it says too many files are open, raise the limit: ulimit -n)"


def _no_room(size: int, who: str, why: str) -> DistError:
    free = memory_available()
    have = f"{free / 2**20:.1f} MiB of memory available" if free >= 0 else "memory available unknown"
    return DistError(f"{who}: cannot reserve {size / 2**20:.1f} MiB of shared memory ({why}); "
                     f"{have}. {_FIX}")


# Every page mapped at once (its page-table entry made now, the memory is already allocated):
# a ring's first pass otherwise took a page fault per 4 KiB of traffic in each process, and a
# 4 KiB ping-pong ran at 5.4 us one way instead of 1.8 for its first ~500 messages, which some
# benchmark rounds measured whole (2026-12-06).
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def _map(fd: int, size: int, who: str) -> mmap.mmap:
    try:
        return mmap.mmap(fd, size, flags=_MAP_FLAGS)
    except OSError as e:
        raise DistError(
            f"{who}: cannot map {size / 2**20:.1f} MiB of shared memory: {e.strerror}. Raise "
            "the address-space limit (ulimit -v) or vm.max_map_count, or lower SHMDIST_RING_BYTES / "
            "SHMDIST_ARENA_BYTES") from e


def create(size: int, who: str) -> Segment:
    """New nameless memory of ``size`` bytes, filled, mapped, header written."""
    free = memory_available()
    if 0 <= free < size:
        raise _no_room(size, who, "more than is available")
    try:
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
    except OSError as e:
        raise DistError(f"{who}: cannot create shared memory (memfd_create: {e.strerror}){_FD_HINT}") from e
    try:
        os.fchmod(fd, 0o600)          # a memfd starts 0777; only this user may reach it anyway
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            raise _no_room(size, who, e.strerror) from e
        mm = _map(fd, size, who)
    except BaseException:
        os.close(fd)
        raise
    token = secrets.token_bytes(16)
    _HEAD.pack_into(mm, 0, MAGIC, size, token)
    return Segment(size, mm, token, fd)


def record(seg: Segment) -> bytes:
    """What the store carries so the other local ranks can open ``seg``."""
    return json.dumps({"pid": seg.pid, "fd": seg.fd, "token": seg.token.hex(), "size": seg.size}).encode()


def attach(rec: dict, who: str, creator: str = "the rank that created it") -> Segment:
    """Open and map the memory ``rec`` (from ``record``) describes, after
    checking that it is that memory: owned by us, 0600, a memfd of ours, of
    the size and with the token the store announced."""
    pid, fd, token, size = int(rec["pid"]), int(rec["fd"]), bytes.fromhex(rec["token"]), int(rec["size"])
    path = f"/proc/{pid}/fd/{fd}"

    def foreign(what: str) -> DistError:
        return DistError(f"{who}: the shared memory announced by {creator} (pid {pid}) is not this job's: "
                         f"{what}; two jobs must not share a rendezvous (master port or file)")
    try:
        target = os.readlink(path)
        if not target.startswith(f"/memfd:{MEMFD_NAME} "):
            raise foreign(f"{path} is {target!r}, not a shmdist memfd")
        own = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ESRCH):
            raise DistPeerError(f"{who}: {creator} (pid {pid}) exited before this rank could open the "
                                "shared memory it created; restart the job") from e
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise DistError(f"{who}: cannot open the shared memory of {creator} (pid {pid}): "
                            f"{e.strerror}{_FD_HINT}") from e
        raise DistError(f"{who}: cannot open the shared memory of {creator} (pid {pid}) through {path}: "
                        f"{e.strerror}. Every local rank must run as the same user, and the creating "
                        "process must be dumpable (not setuid, no prctl PR_SET_DUMPABLE 0)") from e
    try:
        st = os.fstat(own)
        if st.st_uid != os.geteuid():
            raise foreign(f"it belongs to uid {st.st_uid}, this rank is uid {os.geteuid()}")
        if not stat.S_ISREG(st.st_mode) or stat.S_IMODE(st.st_mode) != 0o600:
            raise foreign(f"mode {oct(st.st_mode)}, expected a regular file of mode 0600")
        if st.st_size != size:
            raise foreign(f"{st.st_size} bytes, the store announced {size}")
        mm = _map(own, size, who)
    finally:
        os.close(own)
    magic, hsize, htoken = _HEAD.unpack_from(mm, 0)
    if magic != MAGIC or hsize != size or not secrets.compare_digest(htoken, token):
        mm.close()
        raise foreign("its header does not carry the token the store announced")
    return Segment(size, mm, token)


def share(store, key: str, nlocal: int, is_creator: bool, size: int, who: str,
          timeout: float, init=None) -> Segment:
    """Create (one rank) or open (the other ``nlocal - 1``) the memory
    announced under ``key`` in the store.

    The creator runs ``init(segment)`` before it announces the memory, then
    waits until every other local rank mapped it and closes its descriptor.
    If it fails before announcing, it announces its error instead, so the
    others fail at once with the cause. Nothing here can leak: the memory
    has no name and goes with the last process that maps it.
    """
    if is_creator:
        seg, announced = None, False
        try:
            seg = create(size, who)
            if init is not None:
                init(seg)
            store.set(key, record(seg))
            announced = True
            if nlocal > 1:
                store.get(key + "/mapped", timeout)
            seg.release()
            return seg
        except BaseException as e:
            if seg is not None:
                seg.close()
            if not announced:
                announce_error(store, key, e)
            _name_the_dead(store, key, e)
            raise
    try:
        rec = json.loads(store.get(key, timeout))
        if "error" in rec:
            raise DistError(f"{who}: the rank that creates the shared memory failed: {rec['error']}")
        seg = attach(rec, who)
        if store.add(key + "/opened", 1) == nlocal - 1:
            store.set(key + "/mapped", b"1")
        return seg
    except BaseException as e:
        _name_the_dead(store, key, e)
        raise


def announce_error(store, key: str, e: BaseException) -> None:
    """The creator of the memory announced under ``key`` failed before announcing it:
    say why instead, so the others fail at once with the cause (share)."""
    try:
        store.set(key, json.dumps({"error": str(e) or type(e).__name__}).encode())
    except Exception:   # noqa: BLE001 - the store may be what failed
        pass


def _name_the_dead(store, key: str, e: BaseException) -> None:
    if isinstance(e, DistError) and hasattr(store, "check"):
        store.check(key)     # memory gone because a peer died: name the dead rank

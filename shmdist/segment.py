"""POSIX shared-memory segments shared by the local ranks of a job.

A segment is created O_EXCL with mode 0600 under a name carrying a random
token (and the launcher's job id), filled to its full size up front so that
a short /dev/shm fails here with a clear message instead of a SIGBUS later,
and unlinked by the last local rank to map it: a killed job leaves nothing
in /dev/shm.
"""
from __future__ import annotations

import mmap
import os
import secrets
import struct

import numpy as np
import posix_ipc

from shmdist.errors import DistError

MAGIC = 0x53484D44_53454731  # "SHMDSEG1"
_HEAD = struct.Struct("<QQ16s")  # magic, size, token
JOB_ENV = "SHMDIST_JOB_ID"       # set by shmdist-run; segments carry it so it can sweep leftovers
PREFIX = "shmdist-"


def segment_prefix() -> str:
    job = os.environ.get(JOB_ENV, "")
    return f"{PREFIX}{job}-" if job else PREFIX


class Segment:
    """One mapped segment. ``addr`` is where it starts in this process."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, token: bytes):
        self.name, self.size, self.mm, self.token = name, size, mm, token
        self.array = np.frombuffer(mm, dtype=np.uint8)
        self.addr = self.array.ctypes.data
        self.pid = os.getpid()

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.array[offset:offset + nbytes]

    def unlink(self) -> None:
        """Remove the name now (it is normally gone already); for failed set-ups."""
        if os.getpid() == self.pid:
            unlink(self.name)

    def close(self) -> None:
        """Unmap, in the process that mapped it only (a forked child keeps its hands off)."""
        if self.mm is None or os.getpid() != self.pid:
            return
        self.array = None
        try:
            self.mm.close()
        except BufferError:
            pass  # views still alive somewhere: the mapping goes with the process
        self.mm = None


def _shm_free() -> int:
    try:
        st = os.statvfs("/dev/shm")
        return st.f_bavail * st.f_frsize
    except OSError:
        return -1


def _fill(fd: int, size: int, name: str, who: str) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        free = _shm_free()
        raise DistError(
            f"{who}: cannot reserve {size / 2**20:.1f} MiB of shared memory for {name} "
            f"({e.strerror}); /dev/shm has {free / 2**20:.1f} MiB free. Lower SHMDIST_RING_BYTES "
            "(per-pair ring size), run fewer local ranks, or give the container more /dev/shm "
            "(docker run --shm-size=1g)") from e


_FD_HINT = " (if it says too many files are open, raise the limit: ulimit -n)"


def new_name() -> str:
    return segment_prefix() + secrets.token_bytes(8).hex()


def _map(fd: int, size: int, name: str, who: str) -> mmap.mmap:
    try:
        return mmap.mmap(fd, size)
    except OSError as e:
        raise DistError(
            f"{who}: cannot map {size / 2**20:.1f} MiB of shared memory ({name}): {e.strerror}. Raise "
            "the address-space limit (ulimit -v) or vm.max_map_count, or lower SHMDIST_RING_BYTES / "
            "SHMDIST_ARENA_BYTES") from e


def create(size: int, who: str, name: str | None = None) -> Segment:
    name = name or new_name()
    try:
        shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600)
    except (posix_ipc.Error, OSError) as e:   # posix_ipc says EMFILE as a bare OSError
        raise DistError(f"{who}: cannot create shared memory segment /dev/shm/{name}: {e}{_FD_HINT}") from e
    try:
        _fill(shm.fd, size, name, who)
        mm = _map(shm.fd, size, name, who)
    except BaseException:
        unlink(name)
        raise
    finally:
        shm.close_fd()
    token = bytes.fromhex(name.rpartition("-")[2]).ljust(16, b"\0")
    _HEAD.pack_into(mm, 0, MAGIC, size, token)
    return Segment(name, size, mm, token)


def attach(name: str, who: str) -> Segment:
    try:
        shm = posix_ipc.SharedMemory("/" + name)
    except posix_ipc.ExistentialError as e:
        raise DistError(f"{who}: shared memory segment /dev/shm/{name} is gone before this rank mapped "
                        "it; did another rank of the job fail during init?") from e
    except (posix_ipc.Error, OSError) as e:
        raise DistError(f"{who}: cannot open shared memory segment /dev/shm/{name}: {e}{_FD_HINT}") from e
    try:
        size = os.fstat(shm.fd).st_size
        mm = _map(shm.fd, size, name, who)
    finally:
        shm.close_fd()
    magic, hsize, token = _HEAD.unpack_from(mm, 0)
    if magic != MAGIC or hsize != size or token[:8].hex() != name.rpartition("-")[2]:
        mm.close()
        raise DistError(f"{who}: /dev/shm/{name} is not a shmdist segment of this job (bad header); "
                        "two jobs must not share a name")
    return Segment(name, size, mm, token)


def unlink(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        pass


HEADER_BYTES = 4096  # the first page of every segment holds the header above


def share(store, key: str, nlocal: int, is_creator: bool, size: int, who: str,
          timeout: float, init=None) -> Segment:
    """Create (one rank) or attach (the others) the segment named under ``key``
    in the store; the last of ``nlocal`` ranks to map it unlinks it.

    The creator publishes the name before it creates the segment and runs
    ``init(segment)`` before it says the segment is ready, so every rank
    knows the name from the start and whoever fails unlinks it: a rank that
    dies during set-up leaves nothing behind.
    """
    name = new_name() if is_creator else None
    try:
        if is_creator:
            store.set(key, name.encode())
            seg = create(size, who, name)
            if init is not None:
                init(seg)
            store.set(key + "/ready", b"1")
        else:
            name = store.get(key, timeout).decode()
            store.get(key + "/ready", timeout)
            seg = attach(name, who)
        if store.add(key + "/mapped", 1) == nlocal:
            unlink(name)
        return seg
    except BaseException as e:
        if name is not None:
            unlink(name)
        if isinstance(e, DistError) and hasattr(store, "check"):
            store.check(key)     # a segment gone because a peer died: name the dead rank
        raise

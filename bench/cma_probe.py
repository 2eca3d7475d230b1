"""Is a single-copy transfer (process_vm_readv, "CMA") faster than memcpy here?

    python bench/cma_probe.py [MiB]

Forks a child that owns a buffer, then copies it into the parent with
process_vm_readv in chunks of 1, 4 and the whole size, and times np.copyto
of the same bytes in one process. On the 2-core VM where shmdist is
measured, CMA ran at 4.3-4.9 GB/s and memcpy at 6.8 GB/s (64 MiB) once; on
the quiet VM of 2026-12-04, 18.4 GB/s at 1 MiB, 11.4 at 4 MiB, 10.4 at 16 MiB.
One way, the ring's two copies in parallel beat it from ~16 MiB up; both ways
at once, each core has its own copy to make and one copy per byte halves the
work. So shmdist uses it (transport/engine.py, "single copy") for messages of
at least SHMDIST_SINGLE_COPY bytes that the ring cannot take whole at once,
one way those bigger than the ring (or from 1 MiB inside a window), and any size while a
receive from the peer is pending.
"""
import ctypes
import os
import sys
import time

import numpy as np


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t


def cma_read(pid: int, dst: int, src: int, n: int) -> int:
    """Copy n bytes from address ``src`` of process ``pid`` (one copy,
    process_vm_readv). Returns bytes read, or -errno. (shmdist's core has
    its own: _core.cma_read.)"""
    local, remote = _IOVec(dst, n), _IOVec(src, n)
    r = _libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return r if r >= 0 else -ctypes.get_errno()


def main() -> None:
    size = int(sys.argv[1] if len(sys.argv) > 1 else 64) << 20
    src = np.arange(size // 8, dtype=np.int64)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        src += 1                       # the child's own pages, not shared copy-on-write
        os.read(r, 1)
        os._exit(0)
    time.sleep(0.3)
    dst = np.ones_like(src)
    try:
        for chunk in (1 << 20, 4 << 20, size):
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for off in range(0, size, chunk):
                    n = cma_read(pid, dst.ctypes.data + off, src.ctypes.data + off, min(chunk, size - off))
                    if n < 0:
                        sys.exit(f"process_vm_readv refused: errno {-n} (ptrace scope or seccomp)")
                best = min(best, time.perf_counter() - t)
            assert (dst == src + 1).all()
            print(f"CMA, {chunk >> 20} MiB chunks: {size / best / 1e9:.2f} GB/s")
        best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
        print(f"memcpy (np.copyto): {size / best / 1e9:.2f} GB/s")
    finally:
        os.write(w, b"x")
        os.waitpid(pid, 0)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()

"""The floor of "both ways at once" for a copying transport, outside any library.

    python bench/bidir_floor.py [MiB] [launches]

Two forked processes each own a buffer and, at the same moment, each read
the other's whole buffer into its own second buffer with process_vm_readv
(one copy per byte received, as shmdist, Open MPI and MPICH do for big
messages both ways). Best of 10 such exchanges per launch, aggregate GB/s
(both directions' bytes over the slower side's time), for several fresh
launches: the spread between launches (where the kernel placed the pages)
is part of the answer. On the 2-core VM of 2026-12-06 evening, `16 5`:
17.4-19.5 GB/s in all; in the benchmark run of the same hour shmdist's
both-ways rounds at 16 MiB gave 16.8-21.2 and MPICH's 15.7-28.5: the floor
moves more between launches than five show (README, Benchmarks).
"""
import os
import signal
import sys
import time

import numpy as np

from cma_probe import cma_read


def _side(me: int, size: int, go_r: int, go_w: int, said_w: int, heard_r: int) -> None:
    """One side: publish its buffer's address, then 10 times wait for the go,
    read the other's buffer, report the time; exit when told (not while the
    other may still read this one's buffer)."""
    mine = np.full(size, me + 1, dtype=np.uint8)
    into = np.zeros(size, dtype=np.uint8)
    os.write(said_w, f"{os.getpid()} {mine.ctypes.data}\n".encode())
    pid, addr = (int(x) for x in os.read(heard_r, 64).split())
    for _ in range(10):
        os.read(go_r, 1)
        t = time.perf_counter()
        n = cma_read(pid, into.ctypes.data, addr, size)
        took = time.perf_counter() - t
        if n != size:
            os.write(go_w, f"error {n}\n".encode())
            return
        os.write(go_w, f"{took}\n".encode())
    assert (into == 2 - me).all()
    os.read(go_r, 1)       # the other side may still be reading this one's buffer until then


def launch(size: int) -> float:
    """One launch: two fresh processes; the best aggregate GB/s of 10 exchanges."""
    pipes = [os.pipe() for _ in range(6)]   # go to 0, go to 1, times from 0, 1, addresses 0->1, 1->0
    pids = []
    for me in (0, 1):
        pid = os.fork()
        if pid == 0:
            try:
                _side(me, size, pipes[me][0], pipes[2 + me][1], pipes[4 + me][1], pipes[5 - me][0])
            finally:
                os._exit(0)
        pids.append(pid)
    best, refused = 0.0, None
    try:
        for _ in range(10):
            for me in (0, 1):
                os.write(pipes[me][1], b"g")
            times = []
            for me in (0, 1):
                line = os.read(pipes[2 + me][0], 64).decode()
                if line.startswith("error"):
                    refused = line.strip()
                    break
                times.append(float(line))
            if refused:
                break
            best = max(best, 2 * size / max(times) / 1e9)
    finally:
        for me, pid in enumerate(pids):
            if refused:
                os.kill(pid, signal.SIGKILL)    # the other side may wait for a go that never comes
            else:
                os.write(pipes[me][1], b"e")
        for pid in pids:
            os.waitpid(pid, 0)
        for r, w in pipes:
            os.close(r)
            os.close(w)
    if refused:
        sys.exit(f"process_vm_readv refused: {refused} (ptrace scope or seccomp)")
    return best


def main() -> None:
    size = int(sys.argv[1] if len(sys.argv) > 1 else 16) << 20
    launches = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    rates = [launch(size) for _ in range(launches)]
    print(f"both ways at once, {size >> 20} MiB each way, best of 10 per launch, GB/s in all: "
          + ", ".join(f"{r:.1f}" for r in rates))


if __name__ == "__main__":
    main()

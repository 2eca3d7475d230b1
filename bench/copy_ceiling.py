"""What this machine's memory moves when one or two processes copy at once.

    python bench/copy_ceiling.py [MiB ...]       (default: 16 64 256)

For each size, one process and then two processes at the same moment copy
an array of that size into another (np.copyto) for a second; GB/s copied,
in all and per process. A message one way that both cores copy (shmdist's
shared reading, bench.py's bandwidth and blocking rows) cannot move faster
than the two-process figure, and its copies are process_vm_readv/writev,
slower than memcpy on the VMs here (bench/cma_probe.py): that bounds what
any transport can gain on a peer that already moves big messages in one
copy. On the 2-core VM of 2026-12-07 morning, three runs within three
minutes, alone / two at once: 16 MiB 11.0-25.3 / 13.0-22.5 (two at once no
faster than one alone: the two vCPUs share what copies); 64 MiB 8.1-12.7 /
12.6-18.9; 256 MiB 11.2-12.3 / 17.6-21.6 (README, Benchmarks). The spread
between runs is this VM's, and is why every comparison here alternates.
"""
import sys
import time
from multiprocessing import Barrier, Process, Queue

import numpy as np


def _copier(n: int, start: Barrier, out: Queue) -> None:
    a, b = np.ones(n, np.uint8), np.zeros(n, np.uint8)
    np.copyto(b, a)                     # every page touched before the clock starts
    start.wait()
    t, k = time.perf_counter(), 0
    while time.perf_counter() - t < 1.0:
        np.copyto(b, a)
        k += 1
    out.put(k * n / (time.perf_counter() - t))


def ceiling(mib: int, procs: int) -> list[float]:
    """GB/s each of ``procs`` processes copied, all copying ``mib`` MiB at once."""
    start, out = Barrier(procs), Queue()
    ps = [Process(target=_copier, args=(mib << 20, start, out)) for _ in range(procs)]
    for p in ps:
        p.start()
    rates = [out.get(timeout=60) / 1e9 for _ in ps]
    for p in ps:
        p.join()
    return rates


def main() -> None:
    for mib in [int(x) for x in sys.argv[1:]] or [16, 64, 256]:
        for procs in (1, 2):
            rates = ceiling(mib, procs)
            each = ", ".join(f"{r:.1f}" for r in rates)
            print(f"{mib} MiB, {procs} copying at once: {sum(rates):.1f} GB/s in all ({each})")


if __name__ == "__main__":
    main()

"""One rank's CPU work in a 2-rank float32 all_reduce, per algorithm, in one process.

    python bench/pair_allreduce_cost.py [BYTES ...]

CPU time (thread_time), best and median of 9 batches, so that other processes
on the host count little; cross-core transfers are not modelled (every
algorithm below reads the other rank's bytes once: the vector, or two halves).
The "other rank's" buffer is a plain array here. Rows:

- quick: copy the vector into the arena, reduce both rows into it (the
  one-call small all_reduce; at 2 ranks up to arena.SMALL_ALLREDUCE_PAIR);
- ds: DeepSpeed's shm op from 1 MiB: copy all in, reduce my half into my
  buffer, copy both halves out;
- rounds/N KiB: the C rounds in chunks of N KiB (the default round is 512
  KiB): copy the other's half in, reduce mine into my other buffer, copy it to
  the data, copy the other's reduced half out.
"""
import sys
import time

import numpy as np

from shmdist import _core


def measure(size: int) -> None:
    n = size // 4
    big = np.ones(4 * (n + 1024), np.float32)     # data, my two buffers, the other's: rising addresses
    data, mine0, mine1, other = (big[i * (n + 1024):i * (n + 1024) + n] for i in range(4))
    d, m0, m1, o = data.ctypes.data, mine0.ctypes.data, mine1.ctypes.data, other.ctypes.data

    def quick():
        _core.copy(m0, d, size)
        _core.reduce_rows(0, 0, d, m0, o - m0, 2, n)

    def ds():
        h = n // 2
        _core.copy(m0, d, size)
        _core.reduce_rows(0, 0, m0, m0, o - m0, 2, h)
        _core.copy(d, m0, h * 4)
        _core.copy(d + h * 4, o + h * 4, (n - h) * 4)

    def rounds(chunk):
        def run():
            for lo in range(0, n, chunk):
                m = min(chunk, n - lo)
                h, at = m // 2, d + lo * 4
                _core.copy(m0 + h * 4, at + h * 4, (m - h) * 4)
                _core.reduce_rows(0, 0, m1, at, o - at, 2, h)
                _core.copy(at, m1, h * 4)
                _core.copy(at + h * 4, o + h * 4, (m - h) * 4)
        return run

    algos = {"quick": quick, "ds": ds, "rounds/one chunk": rounds(n)}
    algos.update({f"rounds/{k} KiB": rounds(k * 256) for k in (256, 512)})
    reps = max(3, (32 << 20) // size)
    res: dict = {}
    for _ in range(9):
        for name, f in algos.items():
            t0 = time.thread_time()
            for _ in range(reps):
                f()
            res.setdefault(name, []).append((time.thread_time() - t0) / reps)
    for name, v in res.items():
        print(f"{size:>9} B {name:17s} best {min(v) * 1e6:8.1f} us  median {np.median(v) * 1e6:8.1f} us",
              flush=True)


def main() -> None:
    for size in [int(s) for s in sys.argv[1:]] or [256 << 10, 512 << 10, 768 << 10, 1 << 20, 2 << 20]:
        measure(size)


if __name__ == "__main__":
    main()

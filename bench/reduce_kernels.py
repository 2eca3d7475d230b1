"""CPU time of the C reductions per call, one process: float32 against bfloat16 and float16
at the same bytes, n = 2 and 4 inputs (what one rank of an all_reduce reduces).

    python bench/reduce_kernels.py [--levels 2,3]

CPU time (thread_time), best of 7 batches, so that other processes on the host
do not count. The inputs are touched pages (not the zero page). At 1 MiB and up
the reduction is memory-bound and a 16-bit byte costs what a float32 byte costs;
in L1-sized blocks (4-64 KiB) the widening and rounding cost more per byte.
"""
import time

import numpy as np

from shmdist import _core


def per_call(kind: int, n: int, nbytes: int, reps: int) -> float:
    count = nbytes // (4 if kind == 0 else 2)
    rows = np.full((n, nbytes + 4096), 0x3F, np.uint8)
    out = np.full(nbytes, 1, np.uint8)
    best = []
    for _ in range(7):
        t0 = time.thread_time()
        for _ in range(reps):
            _core.reduce_rows(kind, 0, out.ctypes.data, rows.ctypes.data, rows.strides[0], n, count)
        best.append((time.thread_time() - t0) / reps)
    return min(best)


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="", help="builds to compare, e.g. 2,3 (default: the best this CPU has); "
                    "each row runs every level in turn, so they share the moment's load")
    args = ap.parse_args()
    best = _core.half_level()
    levels = [int(x) for x in args.levels.split(",")] if args.levels else [best]
    print(f"half_level {best} (3 AVX-512 with BF16/FP16, 2 AVX-512, 1 AVX2+F16C, 0 plain C); levels {levels}")
    try:
        for n in (2, 4):
            for nbytes, reps in ((4096, 20000), (65536, 2000), (1 << 20, 100), (4 << 20, 20)):
                cells = []
                for level in levels:
                    _core.set_half_limit(level)
                    f, b, h = (per_call(k, n, nbytes, reps) for k in (0, 4, 5))
                    cells.append((f"L{level}: " if len(levels) > 1 else "") +
                                 f"float32 {f * 1e6:8.2f} us  bfloat16 {b * 1e6:8.2f} us ({b / f:.2f}x)"
                                 f"  float16 {h * 1e6:8.2f} us ({h / f:.2f}x)")
                print(f"n={n} {nbytes:>8} B: " + " | ".join(cells), flush=True)
    finally:
        _core.set_half_limit(99)


if __name__ == "__main__":
    main()

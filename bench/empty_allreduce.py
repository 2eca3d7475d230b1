"""all_reduce and broadcast on arrays from shmdist.empty (in place) against
plain arrays and Open MPI, interleaved: the figures of README's Benchmarks
section for issue 14's target 2 (all_reduce 16 MiB <= 0.75 x Open MPI).

    python bench/empty_allreduce.py --mpi-python /tmp/venv-ompi/bin/python \
        [--rounds 3] [--ranks 2,4] [--json bench/results-empty.json]

It is shmdist.bench with the all_reduce sizes cut to 1 MiB and 16 MiB and
the backends shmdist, shmdist-empty and mpi; any other option of
shmdist.bench passes through (--quick, --backends, --timeout ...).
"""
from __future__ import annotations

import sys

from shmdist import bench

SIZES = (bench.MiB, 16 * bench.MiB)


def main(argv: list[str]) -> int:
    bench.ALL_REDUCE_SIZES = SIZES           # plan() reads it when it makes the rows
    defaults = {"--only": "all_reduce,broadcast", "--backends": "shmdist,shmdist-empty,mpi",
                "--ranks": "2,4", "--rounds": "3"}
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    extra = [x for k, v in defaults.items() if k not in given for x in (k, v)]
    return bench.main(argv + extra)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

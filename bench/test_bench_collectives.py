"""shmdist collectives: all_reduce (float32 SUM), broadcast and barrier, 2 and 4 ranks."""
import numpy as np
import pytest

import shmdist as dist
from conftest import ALL_REDUCE, BARRIER, BROADCAST

KiB, MiB = 1 << 10, 1 << 20
pytestmark = pytest.mark.parametrize("world", [2, 4], indirect=True)


@pytest.mark.parametrize("nbytes", [4 * KiB, MiB, 16 * MiB, 64 * MiB])
def test_all_reduce(benchmark, world, nbytes):
    buf = np.zeros(nbytes // 4, np.float32)
    world.run(benchmark, ALL_REDUCE, nbytes, 1000 if nbytes <= MiB else 20, lambda: dist.all_reduce(buf))


def test_broadcast(benchmark, world):
    buf = np.full(16 * MiB, 1, np.uint8)
    world.run(benchmark, BROADCAST, buf.nbytes, 50, lambda: dist.broadcast(buf, 0))


def test_barrier(benchmark, world):
    world.run(benchmark, BARRIER, 0, 2000, dist.barrier)

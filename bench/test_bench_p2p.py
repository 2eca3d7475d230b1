"""shmdist point to point: ping-pong latency and unidirectional bandwidth.

The figures are round trips (latency: one-way is half) and windows of
messages; extra_info holds the derived one-way µs and GB/s.
"""
import numpy as np
import pytest

import shmdist as dist
from conftest import ECHO, SINK

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.parametrize("nbytes", [8, 4 * KiB, 64 * KiB, MiB])
def test_pingpong(benchmark, world, nbytes):
    buf = np.full(nbytes, 1, np.uint8)

    def pingpong():
        dist.send(buf, 1).wait()
        dist.recv(buf, 1).wait()
    world.run(benchmark, ECHO, nbytes, 2000 if nbytes <= 64 * KiB else 300, pingpong)
    if benchmark.stats:
        benchmark.extra_info["one_way_us"] = benchmark.stats.stats.median / 2 * 1e6


@pytest.mark.parametrize("nbytes", [MiB, 16 * MiB, 64 * MiB, 256 * MiB])
def test_bandwidth(benchmark, world, nbytes):
    buf, ack = np.full(nbytes, 1, np.uint8), np.zeros(8, np.uint8)
    window = min(max(32 * MiB // nbytes, 1), 64)

    def burst():
        for req in [dist.isend(buf, 1) for _ in range(window)]:
            req.wait()
        dist.recv(ack, 1).wait()
    world.run(benchmark, SINK, nbytes, 20, burst, window)
    if benchmark.stats:
        benchmark.extra_info["GB/s"] = window * nbytes / benchmark.stats.stats.median / 1e9

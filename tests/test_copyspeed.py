"""The choice made from this machine's copy speeds (shmdist/transport/copyspeed.py): with
SHMDIST_SINGLE_COPY unset, an arena's creator whose single copies measure over twice
memcpy's time publishes 16 MiB, not 1 MiB, as where a pair's collectives copy between the
arrays; a value set in the environment is used as set.

The verdict is tested on given times, never on timings of this run; in the ranks each
rank's measure is pinned (copyspeed._slow), as if its machine had given it."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import shmdist as dist
from test_split_copy import THRESHOLD, count_copies

SLOW = 16 << 20             # arena.SLOW_SPLIT_MIN
DEFAULT = 32 << 10          # SHMDIST_SINGLE_COPY's default


def test_the_verdict_and_the_measure(monkeypatch):
    from shmdist import _core, settings
    from shmdist.comm import arena
    from shmdist.transport import copyspeed
    assert (arena.PAIR_SPLIT_MIN, arena.SLOW_SPLIT_MIN, copyspeed.SLOWER_MAX) == (THRESHOLD, SLOW, 2.0)
    assert copyspeed.PROBE_PIECE == arena.SPLIT_CHUNK        # it times the pieces the split reads
    assert settings.SETTINGS["SHMDIST_SINGLE_COPY"].default == DEFAULT
    # (single copy's seconds, memcpy's): up to twice memcpy's time keeps up
    assert [copyspeed.too_slow(t) for t in ((1e-4, 1e-4), (2e-4, 1e-4), (2.01e-4, 1e-4), (8.5e-5, 2.1e-5))] \
        == [False, False, True, True]
    assert copyspeed.too_slow(None) is False           # a read refused: the probe at init decides
    cma, copy = copyspeed.times()                       # a real measure: two times, no verdict asserted
    assert 0 < cma < 1 and 0 < copy < 1
    monkeypatch.setattr(_core, "cma_read", lambda pid, dst, src, n: errno.EPERM)
    assert copyspeed.times() is None
    monkeypatch.setattr(copyspeed, "_slow", None)
    assert copyspeed.slow() is False and copyspeed._slow is False      # measured once, kept
    # the pair's threshold the creator publishes: as set (at least 1 MiB), or unset, by the verdict
    monkeypatch.setattr(copyspeed, "_slow", True)
    assert [arena._split_from(v) for v in (0, 64 << 10, 32 << 20, None)] == [0, THRESHOLD, 32 << 20, SLOW]
    monkeypatch.setattr(copyspeed, "_slow", False)
    assert arena._split_from(None) == THRESHOLD


def _pinned(rank: int, slow: tuple, setting) -> None:
    """This rank's verdict pinned to slow[rank]; the knob unset, or set to ``setting``."""
    os.environ.pop("SHMDIST_SINGLE_COPY", None)
    if setting is not None:
        os.environ["SHMDIST_SINGLE_COPY"] = str(setting)
    from shmdist.transport import copyspeed
    copyspeed._slow = slow[rank]


def pair_threshold(rank, world_size, init_method, slow, setting):
    """The pair's threshold, then per size whether a broadcast and an all_reduce came out
    right and whether this rank made single copies for them."""
    _pinned(rank, slow, setting)
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    from shmdist.api import group
    threshold = group._world.default.coll.split_min
    seen = count_copies()
    out = {}
    for n in (4 << 20, SLOW):
        before = seen["read"] + seen["write"]
        b = np.arange(n, dtype=np.uint8) if rank == 0 else np.zeros(n, np.uint8)
        dist.broadcast(b, src=0)
        x = np.full(n // 4, rank + 1, np.float32)
        dist.all_reduce(x)
        out[n] = (bool(np.array_equal(b, np.arange(n, dtype=np.uint8))), bool((x == 3).all()),
                  seen["read"] + seen["write"] > before)
    dist.destroy_process_group()
    return threshold, out


@pytest.mark.parametrize("slow,setting,threshold", [
    ((True, False), None, SLOW), ((False, True), None, THRESHOLD), ((True, True), 64 << 10, THRESHOLD)],
    ids=["creator measured slow", "creator measured fast", "set in the environment"])
def test_both_members_take_the_creators_threshold(run_ranks, slow, setting, threshold):
    """Members whose own verdicts differ still take one way: the creator's (rank 0)."""
    results = run_ranks(pair_threshold, 2, slow, setting, timeout=90)
    for r, (got, out) in enumerate(results):
        assert got == threshold, (r, got)
        assert out == {4 << 20: (True, True, threshold <= 4 << 20), SLOW: (True, True, True)}, (r, out)

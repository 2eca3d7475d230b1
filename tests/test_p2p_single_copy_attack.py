"""Attacks on the single copy (transport/engine.py): what a sceptic tries
against README's promises (no silently wrong data, no hang, a peer that
goes is named, nothing left behind). A 64 KiB ring and threshold, as in
test_p2p_single_copy.py, so that every big message goes as a single copy."""
from __future__ import annotations

import gc
import os
import time

import numpy as np
import pytest

import shmdist as dist
from test_p2p_single_copy import ENV, pattern

# they count single copies: the sender's timing of the ring against them off (transport/ways.py)
pytestmark = pytest.mark.usefixtures("p2p_choose_off")

N = 2 << 20


def left_then_read(rank, world_size, init_method, flag, how):
    """Rank 0 posts a single-copy send, then leaves (destroy_process_group):
    its send fails ("it never will" complete), so its buffer is its own
    again: it writes 7s into it (``changed``), or frees it and allocates
    another of 7s (``freed``). Only then does rank 1 read the message, from
    a receive posted after (``changed``, ``freed``) or before (``posted``:
    the fast lane's C read). Rank 1 must not take the 7s for the message."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=30)
    if rank == 0:
        a = pattern(N, 3)
        dist.recv(np.ones(1), 1).wait()
        req = dist.isend(a, 1)
        from shmdist.api import group
        single = bool(group._world.engine.queues.awaiting)
        dist.destroy_process_group()
        try:
            req.wait()
            failed = ""
        except dist.DistError as e:
            failed = str(e)
        if how == "freed":
            del a, req
            gc.collect()
            b = np.full(N, 7, np.uint8)     # noqa: F841 (maybe where ``a`` was)
        else:
            a[:] = 7
        with open(flag, "w") as f:
            f.write("changed")
        time.sleep(3)       # alive while rank 1 reads
        return single, failed
    into = np.zeros(N, np.uint8)
    early = dist.irecv(into, 0) if how == "posted" else None
    dist.send(np.ones(1), 0).wait()
    while not os.path.exists(flag):
        time.sleep(0.01)
    try:
        (early or dist.irecv(into, 0)).wait(timeout=20)
    except dist.DistError as e:
        return type(e).__name__, str(e)
    return "exact" if np.array_equal(into, pattern(N, 3)) else f"wrong data: {np.unique(into)[:5]}"


@pytest.mark.parametrize("how", ["changed", "freed", "posted"])
def test_sender_that_left_is_not_read(run_ranks, tmp_path, how):
    (single, failed), got = run_ranks(left_then_read, 2, str(tmp_path / "flag"), how, env=ENV,
                                      timeout=90)
    assert single and "destroy_process_group was called before it completed" in failed
    assert got[0] == "DistPeerError" and "rank 0 left the group" in got[1], got

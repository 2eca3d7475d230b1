"""Many pending fast receives at once (a window of irecvs, both ranks sending
at once): the lane queues them in posting order and completes them as their
records come, and every way out of that queue -- a general receive posted
behind them, a record of the wrong size, a timeout of one in the middle,
destroy -- ends as it would on the general path. Also: a loop of blocking
receives gets each message straight into its buffer (no private drain).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import shmdist as dist
from shmdist.transport import engine as engine_module
from shmdist.api import fast
from shmdist.errors import DistError, DistMismatchError, DistTimeoutError

pytestmark = pytest.mark.skipif(os.environ.get("SHMDIST_TRANSPORT", "").lower() == "tcp",
                                reason="the fast lane is a shared-memory path")


def _init(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    box = np.zeros(1, dtype=np.int64)     # one exchange on the general path teaches the lane int64
    if rank == 0:
        dist.send(box, 1).wait()
        dist.recv(box, 1).wait()
    else:
        dist.recv(box, 0).wait()
        dist.send(box, 0).wait()


def window_both_ways(rank, world_size, init_method, n, mixed):
    """Both ranks post n receives, then send n messages, then wait in reverse
    order; with ``mixed`` an any-source receive sits in the middle."""
    _init(rank, world_size, init_method)
    peer = 1 - rank
    bufs = [np.zeros(4, dtype=np.int64) for _ in range(n)]
    reqs = [dist.irecv(b, None if mixed and i == n // 2 else peer) for i, b in enumerate(bufs)]
    queued = len(fast.paths.lane.pending_requests())
    dist.barrier()          # nothing is sent before both ranks posted every receive
    sends = [dist.isend(np.full(4, 1000 * rank + i, dtype=np.int64), peer) for i in range(n)]
    for r in reversed(reqs + sends):
        r.wait()
    got = [int(b[0]) for b in bufs]
    dist.destroy_process_group()
    return got, queued


@pytest.mark.parametrize("mixed", [False, True])
def test_a_window_of_pending_receives_fills_in_posting_order(run_ranks, mixed):
    n = 40
    results = run_ranks(window_both_ways, 2, n, mixed)
    for rank, (got, queued) in enumerate(results):
        assert got == [1000 * (1 - rank) + i for i in range(n)]
        assert queued == (0 if mixed else n)    # the lane held them all (an any-source one posts them)


def mismatch_in_the_queue(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    go = np.zeros(1, dtype=np.int64)
    if rank == 0:
        dist.recv(go, 1).wait()
        dist.send(np.array([1], dtype=np.int64), 1).wait()
        dist.send(np.arange(3, dtype=np.int64), 1).wait()     # the second receive expects 1 element
        dist.send(np.array([3], dtype=np.int64), 1).wait()
        result = None
    else:
        a, b, c = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), np.zeros(3, dtype=np.int64)
        ra, rb, rc = dist.irecv(a, 0), dist.irecv(b, 0), dist.irecv(c, 0)
        dist.send(go, 0).wait()
        ra.wait()
        try:
            rb.wait()
            error = "no error"
        except DistMismatchError as e:
            error = "got 24 bytes" in str(e)
        rc.wait()            # the kept message goes to the next receive, as on the general path
        rest = np.zeros(1, dtype=np.int64)
        dist.recv(rest, 0).wait()
        result = (int(a[0]), error, c.tolist(), int(rest[0]))
    dist.destroy_process_group()
    return result


def test_a_wrong_size_among_pending_receives_fails_only_that_one(run_ranks):
    """The general path's rule: the failed receive leaves the message to the next one that fits."""
    assert run_ranks(mismatch_in_the_queue, 2) == [None, (1, True, [0, 1, 2], 3)]


def timeout_in_the_middle(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    go = np.zeros(1, dtype=np.int64)
    if rank == 0:
        dist.recv(go, 1).wait()
        dist.send(np.array([7], dtype=np.int64), 1).wait()
        result = None
    else:
        a, b = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
        ra, rb = dist.irecv(a, 0), dist.irecv(b, 0)
        try:
            rb.wait(timeout=0.3)
            timed_out = False
        except DistTimeoutError as e:
            timed_out = "cancelled" in str(e)
        dist.send(go, 0).wait()
        ra.wait()
        result = (timed_out, int(a[0]), int(b[0]), rb.is_completed())
    dist.destroy_process_group()
    return result


def test_a_timeout_of_a_queued_receive_withdraws_it_and_keeps_the_others(run_ranks):
    # withdrawn, as on the general path, and from then on completed with its timeout error
    assert run_ranks(timeout_in_the_middle, 2) == [None, (True, 7, 0, True)]


def destroy_with_a_queue(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    if rank == 0:
        dist.barrier()
        result = None
    else:
        reqs = [dist.irecv(np.zeros(1, dtype=np.int64), 0) for _ in range(5)]
        dist.barrier()
        dist.destroy_process_group()
        errors = []
        for r in reqs:
            try:
                r.wait(timeout=5)
                errors.append("completed")
            except DistError as e:
                errors.append("destroy_process_group" in str(e))
        return errors
    dist.destroy_process_group()
    return result


def test_destroy_fails_every_queued_receive(run_ranks):
    assert run_ranks(destroy_with_a_queue, 2) == [None, [True] * 5]


def blocking_loop(rank, world_size, init_method, nbytes, count):
    """rank 0: send(x).wait() in a loop; rank 1: recv(buf).wait() in a loop.
    Rank 1 counts the messages drained into a private buffer."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    drained = [0]
    arrive = engine_module.Engine._arrive

    def counting(self, src, header, drain):
        inc = arrive(self, src, header, drain)
        if inc is not None and inc.target is None:
            drained[0] += 1
        return inc
    engine_module.Engine._arrive = counting
    buf = np.zeros(nbytes, np.uint8)
    ok = True
    for i in range(count):
        if rank == 0:
            buf[:] = i % 251
            dist.send(buf, 1).wait()
        else:
            dist.recv(buf, 0).wait()
            ok = ok and buf[0] == i % 251 and buf[-1] == i % 251
    dist.barrier()
    dist.destroy_process_group()
    return bool(ok), drained[0]


@pytest.mark.parametrize("nbytes", [1 << 20, 5 << 20])
def test_blocking_receives_get_each_message_straight_into_their_buffer(run_ranks, nbytes):
    """The slow mode of issue 14: each message was drained into a private buffer
    and copied again, because the receive was not posted yet when its header came."""
    results = run_ranks(blocking_loop, 2, nbytes, 30, timeout=120)
    assert results[1] == (True, 0)

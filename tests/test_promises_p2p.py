"""An outside tester's attempts to break README's point-to-point promises:
the API table rows for send/recv/DistributedRequest/destroy, the "differs
from torch on purpose" p2p items (mismatch keeps the message, wait(timeout)
cancels or stays pending) and "How it works / Point-to-point" (posting-order
matching, draining, no deadlock, delivery after the sender exits).

numpy only; torch tensors are in test_promises_torch.py."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

import shmdist as dist

SMALL_RING = {"SHMDIST_RING_BYTES": "65536"}
# tests that stall a transfer by filling a 64 KiB ring: over TCP the kernel's socket buffers and
# the I/O thread move the bytes anyway, so the premise does not hold there
RING_ONLY = pytest.mark.skipif(os.environ.get("SHMDIST_TRANSPORT", "").lower() == "tcp",
                               reason="stalls a transfer by filling the shared-memory ring")


def _init(rank, world_size, init_method, **kw):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, **kw)


def _payload(seed: int, n: int, dtype="float64") -> np.ndarray:
    return (np.random.default_rng(seed).random(n) * 1000).astype(dtype)


# ---------------------------------------------------------------- matching order

def many_tags(rank, world_size, init_method):
    """Rank 0 sends 3 messages on each of 12 tags, interleaved, with sizes
    that take the fast lane, the general path and more than the ring; rank 1
    posts its receives tag by tag in another order, alternating contiguous
    (lane) and strided (general path) buffers. Per (pair, tag) order holds."""
    _init(rank, world_size, init_method)
    tags = [5, -3, 0, 1 << 40, 7, 2, 11, 9, -(1 << 62), 4, 3, 1]
    sizes = [0, 1, 3, 1000, 40000, 200000]
    plan = [(tag, k, sizes[(i + k) % len(sizes)]) for k in range(3) for i, tag in enumerate(tags)]
    bad = []
    if rank == 0:
        reqs = [dist.send(_payload(hash((tag, k)) & 0xFFFF, n), 1, tag=tag) for tag, k, n in plan]
        for q in reqs:
            q.wait()
    else:
        posted = []
        for tag in reversed(tags):
            for k in range(3):
                n = next(n for t, kk, n in plan if t == tag and kk == k)
                if (tag + k) % 2:
                    box = np.zeros(2 * n)[::2]            # strided: the general path
                else:
                    box = np.zeros(n)
                posted.append((tag, k, n, box, dist.recv(box, 0, tag=tag)))
        for tag, k, n, box, q in posted:
            q.wait()
            if q.source != 0 or not np.array_equal(box, _payload(hash((tag, k)) & 0xFFFF, n)):
                bad.append((tag, k, n))
    dist.destroy_process_group()
    return bad


def test_many_interleaved_tags_keep_order_per_tag(run_ranks):
    assert run_ranks(many_tags, 2, timeout=90, env=SMALL_RING) == [[], []]


def any_source_race(rank, world_size, init_method, rounds):
    """Rank 2 posts, per round, recv(src=0), recv(any), recv(src=1), recv(any)
    while ranks 0 and 1 each send two messages. Posting order decides: each
    specific receive gets its rank's first message, the any-source ones take
    the rest, and nothing is lost or duplicated."""
    _init(rank, world_size, init_method)
    got = []
    for r in range(rounds):
        if rank < 2:
            for k in range(2):
                dist.send(np.array([rank, r, k], dtype=np.int64), 2, tag=r % 3).wait()
        else:
            boxes = [np.full(3, -1, dtype=np.int64) for _ in range(4)]
            srcs = [0, None, 1, None]
            reqs = [dist.recv(b, s, tag=r % 3) for b, s in zip(boxes, srcs)]
            for q in reqs:
                q.wait()
            got.append(([b.tolist() for b in boxes], [q.source for q in reqs]))
        dist.barrier()
    dist.destroy_process_group()
    return got


def test_any_source_receives_racing_with_specific_ones(run_ranks):
    rounds = 40
    got = run_ranks(any_source_race, 3, rounds, timeout=90)[2]
    for r, (boxes, sources) in enumerate(got):
        assert boxes[0][:2] == [0, r] and boxes[2][:2] == [1, r], (r, boxes)
        assert [b[0] for b in boxes] == sources, (r, boxes, sources)
        assert sorted(map(tuple, boxes)) == sorted((s, r, k) for s in (0, 1) for k in (0, 1)), (r, boxes)
        # rank 0's first message goes to the first receive posted that matches it: recv(src=0)
        assert boxes[0][2] == 0
        # per sender order: whichever receives rank 1's two messages get them in order
        ones = [b[2] for b in boxes if b[0] == 1]
        assert ones == [0, 1], (r, boxes)


def larger_than_ring(rank, world_size, init_method, n):
    """Both ranks send a message 64 times the ring before receiving anything."""
    _init(rank, world_size, init_method)
    peer = 1 - rank
    out = _payload(rank, n)
    box = np.empty(n)
    s = dist.send(out, peer, tag=3)
    r = dist.recv(box, peer, tag=3)
    s.wait()
    r.wait()
    ok = np.array_equal(box, _payload(peer, n))
    dist.destroy_process_group()
    return ok


def test_messages_larger_than_the_ring_both_ways_do_not_deadlock(run_ranks):
    assert run_ranks(larger_than_ring, 2, (64 << 10) * 64 // 8, timeout=90, env=SMALL_RING) == [True, True]


def zero_bytes(rank, world_size, init_method):
    """Zero-byte messages of several dtypes and shapes, specific and any-source,
    interleaved with non-empty ones; a zero-byte message of another dtype is a
    mismatch that keeps the message."""
    _init(rank, world_size, init_method)
    res = []
    if rank == 0:
        for dt in ("float32", "int8", "complex128", "bool"):
            dist.send(np.zeros((0, 5), dtype=dt), 1, tag=1).wait()
            dist.send(np.ones(2, dtype=dt), 1, tag=1).wait()
        dist.send(np.zeros(0, dtype=np.float32), 1, tag=2).wait()
    else:
        for dt in ("float32", "int8", "complex128", "bool"):
            e = np.zeros(0, dtype=dt)
            q = dist.recv(e, None, tag=1)
            q.wait()
            res.append(q.source)
            one = np.zeros(2, dtype=dt)
            dist.recv(one, 0, tag=1).wait()
            res.append(one.tolist())
        try:
            dist.recv(np.zeros(0, dtype=np.int32), 0, tag=2).wait()
            res.append("no error")
        except dist.DistMismatchError as e:
            res.append("int32" in str(e) and "float32" in str(e))
        q = dist.recv(np.zeros((3, 0), dtype=np.float32), 0, tag=2)
        res.append(q.wait())
    dist.destroy_process_group()
    return res


def test_zero_byte_messages(run_ranks):
    got = run_ranks(zero_bytes, 2, timeout=60)[1]
    ones = [[1.0, 1.0], [1, 1], [1 + 0j, 1 + 0j], [True, True]]
    assert got == [x for pair in zip([0] * 4, ones) for x in pair] + [True, True]


# ---------------------------------------------------------------- delivery after the sender left

def sender_leaves(rank, world_size, init_method, how):
    """Rank 0 and 1 send to rank 2 and leave (destroy, plain exit, or
    os._exit: no goodbye at all). Rank 2 posts its receives only after both
    are gone: everything whose send completed arrives; one receive more is a
    DistPeerError, not a hang."""
    _init(rank, world_size, init_method, timeout=30)
    if rank < 2:
        reqs = [dist.send(np.full(n, rank * 10 + k, dtype=np.int32), 2, tag=k)
                for _ in range(2) for k, n in enumerate((1, 5000, 30000))]   # lane, general, 2 x SLICE
        reqs.append(dist.send(np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2], 2, tag=9))
        for q in reqs:
            q.wait()
        dist.barrier()
        if how == "destroy":
            dist.destroy_process_group()
            return None
        if how == "_exit":
            os._exit(0)
        return None                 # atexit says goodbye
    dist.barrier()
    time.sleep(1.5)                 # both are gone by now
    got = []
    for src in (0, None, 1, None):
        for k, n in enumerate((1, 5000, 30000)):
            box = np.zeros(n, dtype=np.int32)
            q = dist.recv(box, src, tag=k)
            q.wait(timeout=20)
            got.append((q.source, int(box[0]), bool((box == box[0]).all())))
        if src is not None:
            box = np.zeros(6)
            dist.recv(box, src, tag=9).wait(timeout=20)
            got.append(box.tolist())
    try:
        dist.recv(np.zeros(1, dtype=np.int32), None, tag=0).wait(timeout=20)
        got.append("a receive with no sender left completed")
    except dist.DistPeerError as e:
        got.append("peer" if "rank 0" in str(e) or "rank 1" in str(e) else str(e))
    except dist.DistTimeoutError as e:
        got.append(f"timeout instead of a peer error: {e}")
    dist.destroy_process_group()
    return got


@pytest.mark.parametrize("how", ["destroy", "atexit", "_exit"])
def test_receive_posted_after_the_sender_exited(run_ranks, how):
    got = run_ranks(sender_leaves, 3, how, timeout=90, errors="return")
    for sender in got[:2]:        # os._exit leaves no result, only exit code 0
        assert sender is None or (how == "_exit" and sender.exitcode == 0), got
    got = got[2]
    assert isinstance(got, list), got
    assert got[-1] == "peer", got[-1]
    got = got[:-1]
    specific = got[0:3] + got[7:10]
    assert specific == [(0, 0, True), (0, 1, True), (0, 2, True), (1, 10, True), (1, 11, True), (1, 12, True)]
    assert got[3] == got[10] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    everything = sorted(got[0:3] + got[4:7] + got[7:10] + got[11:14])
    assert everything == sorted([(s, s * 10 + k, True) for s in (0, 1) for k in range(3)] * 2)


# ---------------------------------------------------------------- mismatch keeps the message

def mismatch_keeps(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    res = []
    if rank == 0:
        dist.send(np.arange(10, dtype=np.float32), 1).wait()            # lane
        dist.send(np.arange(40000, dtype=np.float32), 1, tag=4).wait()   # general path
    else:
        for box, src, tag in ((np.zeros(4, dtype=np.float32), 0, 0), (np.zeros(10, dtype=np.int32), None, 0),
                              (np.zeros(10, dtype=np.int32), 0, 0),           # same bytes, other dtype
                              (np.zeros(10, dtype=np.float32)[::1], 0, 0),
                              (np.zeros(39999, dtype=np.float32), 0, 4), (np.zeros(40000, dtype=np.float64), None, 4),
                              (np.zeros(80000, dtype=np.float32)[::2], None, 4)):
            try:
                q = dist.recv(box, src, tag=tag)
                q.wait()
                res.append(("ok", q.source, bool(np.array_equal(box, np.arange(box.size)))))
            except dist.DistMismatchError as e:
                res.append(("mismatch", "rank 0" in str(e) and "rank 1" in str(e) and "bytes" in str(e)))
    dist.destroy_process_group()
    return res


def test_mismatched_receive_raises_and_keeps_the_message(run_ranks):
    got = run_ranks(mismatch_keeps, 2, timeout=60)[1]
    assert got == [("mismatch", True), ("mismatch", True), ("mismatch", True), ("ok", 0, True),
                   ("mismatch", True), ("mismatch", True), ("ok", 0, True)]


def mismatch_message_text(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    msg = None
    if rank == 0:
        dist.send(np.zeros(10, dtype=np.float32), 1).wait()
        dist.send(np.zeros(10, dtype=np.float32), 1).wait()
    else:
        try:
            dist.recv(np.zeros(4, dtype=np.float32), 0).wait()
        except dist.DistMismatchError as e:
            msg = str(e)
        dist.recv(np.zeros(10, dtype=np.float32), 0).wait()
        dist.recv(np.zeros(10, dtype=np.float32), 0).wait()
    dist.destroy_process_group()
    return msg


def test_mismatch_message_states_both_as_the_readme_shows(run_ranks):
    msg = run_ranks(mismatch_message_text, 2, timeout=60)[1]
    # README quotes `expected 16 bytes (float32[4]) from rank 0, got 40 bytes (float32[10])`; the
    # message puts "(tag 0)" between the two halves, so it is checked by halves
    assert "expected 16 bytes (float32[4]) from rank 0" in msg and "got 40 bytes (float32[10])" in msg, msg


# ---------------------------------------------------------------- wait(timeout)

def unmoved_timeout(rank, world_size, init_method, path):
    """A receive that has not moved a byte is cancelled by wait(timeout=...):
    the message sent afterwards goes to the next receive, and the cancelled
    buffer is never written."""
    _init(rank, world_size, init_method)
    res = []
    if rank == 0:
        dist.barrier()               # rank 1 timed out
        dist.send(np.arange(8, dtype=np.int64), 1, tag=2).wait()
        dist.send(np.arange(8, dtype=np.int64) + 100, 1, tag=2).wait()
        dist.barrier()
    else:
        first = np.full(8, -1, dtype=np.int64)
        view = first if path == "lane" else np.full(16, -1, dtype=np.int64)[::2]
        q = dist.recv(view, None if path == "any" else 0, tag=2)
        t0 = time.monotonic()
        try:
            q.wait(timeout=0.3)
            res.append("no timeout")
        except dist.DistTimeoutError as e:
            res.append("cancelled" in str(e) and isinstance(e, TimeoutError))
        res.append(time.monotonic() - t0 < 10)
        dist.barrier()
        second = np.zeros(8, dtype=np.int64)
        q2 = dist.recv(second, 0, tag=2)
        q2.wait()
        third = np.zeros(8, dtype=np.int64)
        dist.recv(third, 0, tag=2).wait()
        dist.barrier()
        res += [second.tolist() == list(range(8)), third[0] == 100, bool((view == -1).all()),
                q.is_completed() is False or isinstance(q.exception(), dist.DistTimeoutError)]
    dist.destroy_process_group()
    return res


@pytest.mark.parametrize("path", ["lane", "general", "any"])
def test_wait_timeout_on_an_unmoved_receive_cancels_it(run_ranks, path):
    assert run_ranks(unmoved_timeout, 2, path, timeout=60)[1] == [True] * 6


def unmoved_send(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    res = []
    if rank == 0:
        k = 0
        while True:      # 496 int64 + the 128-byte header: 4 KiB records, 16 fill the ring exactly
            q = dist.send(np.full(496, k, dtype=np.int64), 1, tag=1)
            if not q.is_completed():
                break
            k += 1
        try:
            q.wait(timeout=0.3)
            res.append("no timeout")
        except dist.DistTimeoutError as e:
            res.append("cancelled" in str(e))
        dist.barrier()                                   # rank 1 starts draining
        dist.send(np.array([k], dtype=np.int64), 1, tag=3).wait()
        dist.send(np.full(496, 77, dtype=np.int64), 1, tag=1).wait()
    else:
        dist.barrier()
        box = np.zeros(496, dtype=np.int64)
        count = np.zeros(1, dtype=np.int64)
        dist.recv(count, 0, tag=3).wait()
        seen = []
        for _ in range(int(count[0]) + 1):
            dist.recv(box, 0, tag=1).wait()
            seen.append(int(box[0]))
        res = [seen == list(range(int(count[0]))) + [77], int(count[0]) > 0]
    dist.destroy_process_group()
    return res


@RING_ONLY
def test_wait_timeout_on_an_unmoved_send_cancels_it(run_ranks):
    assert run_ranks(unmoved_send, 2, timeout=60, env=SMALL_RING) == [[True], [True, True]]


def half_moved(rank, world_size, init_method, side):
    """A transfer whose message is half moved stays pending after
    wait(timeout) and completes, intact, when waited on again. The peer parks
    in a barrier (which does not move point-to-point bytes) meanwhile; the
    receive is posted only once the send has returned, so the two cannot copy
    the whole message at once inside the sender's first push."""
    _init(rank, world_size, init_method)
    n = 1 << 17                     # 1 MiB of float64, 16 rings
    res = []

    def timeouts(q):
        for _ in range(2):          # twice: a second timeout must not break it either
            try:
                q.wait(timeout=0.3)
                res.append("no timeout")
            except dist.DistTimeoutError as e:
                res.append("stays pending" in str(e))
        res.append(q.is_completed())

    if rank == 0:
        q = dist.send(_payload(3, n), 1)
        if side == "send":
            timeouts(q)
            dist.barrier()
        else:
            dist.barrier()
            dist.barrier()          # rank 1 times out meanwhile
    else:
        dist.barrier()
        box = np.zeros(n)
        q = dist.recv(box, 0)
        if side == "recv":
            timeouts(q)
            dist.barrier()
    res.append(q.wait())
    if rank == 1:
        res.append(bool(np.array_equal(box, _payload(3, n))))
    dist.destroy_process_group()
    return res


@RING_ONLY
@pytest.mark.parametrize("side", ["send", "recv"])
def test_wait_timeout_on_a_half_moved_message_then_wait_again(run_ranks, side):
    # through the ring: a single copy (SHMDIST_SINGLE_COPY) is never half moved; the receiver
    # reads it whole while the sender sits in the barrier (tests/test_p2p_single_copy.py)
    got = run_ranks(half_moved, 2, side, timeout=60, env=dict(SMALL_RING, SHMDIST_SINGLE_COPY="0"))
    if side == "send":
        assert got == [[True, True, False, True], [True, True]]
    else:
        assert got == [[True], [True, True, False, True, True]]


# ---------------------------------------------------------------- requests

def request_api(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    res = {}
    if rank == 0:
        dist.barrier()
        q = dist.send(np.arange(3, dtype=np.int64), 1)          # lane, completes at once
        res["send"] = (q.wait(), q.is_completed(), q.exception())
        q = dist.send(np.arange(6, dtype=np.int64)[::2], 1)       # general path
        res["send_general"] = (q.wait(), q.is_completed(), q.exception())
        dist.send(np.arange(3, dtype=np.int64), 1).wait()
        dist.send(np.arange(5, dtype=np.int64), 1).wait()
    else:
        a = np.zeros(3, dtype=np.int64)
        pend = dist.recv(a, 0)                                     # pending lane receive
        res["pending"] = (pend.is_completed(), pend.exception())
        dist.barrier()
        res["recv"] = (pend.wait(), pend.is_completed(), pend.source, pend.exception(),
                       pend.result()[0] is a, a.tolist())
        b = np.zeros(3, dtype=np.int64)
        q = dist.recv(b, None)
        res["any"] = (q.wait(), q.source, b.tolist(), q.result()[0] is b)
        c = np.zeros(3, dtype=np.int64)
        q = dist.recv(c, 0)
        q.wait()
        q = dist.recv(np.zeros(4, dtype=np.int64), 0)
        try:
            q.wait()
        except dist.DistMismatchError:
            pass
        res["failed"] = (q.is_completed(), isinstance(q.exception(), dist.DistMismatchError))
        dist.recv(np.zeros(5, dtype=np.int64), 0).wait()
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, np.ones(2), 0), dist.P2POp(dist.irecv, np.ones(2), 0)])
        res["batch"] = [type(r).__name__ for r in reqs]
        for r in reqs[:1]:
            r.wait()
    if rank == 0:
        box = np.zeros(2)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, box, 1), dist.P2POp(dist.isend, np.ones(2), 1)])
        for r in reqs:
            r.wait()
        res["batch"] = [type(r).__name__ for r in reqs]
    else:
        reqs[1].wait()
    dist.destroy_process_group()
    return res


def test_distributed_request_api(run_ranks):
    r0, r1 = run_ranks(request_api, 2, timeout=60)
    assert r0["send"] == (True, True, None) and r0["send_general"] == (True, True, None)
    assert r1["pending"] == (False, None)
    assert r1["recv"] == (True, True, 0, None, True, [0, 1, 2])
    assert r1["any"] == (True, 0, [0, 2, 4], True)
    assert r1["failed"] == (True, True)
    assert r0["batch"] == r1["batch"] == ["DistributedRequest"] * 2


# ---------------------------------------------------------------- destroy with requests pending

def pending_at_destroy(rank, world_size, init_method):
    """Every kind of pending request fails with a DistError at destroy:
    a pending fast-lane receive, a posted general one, an any-source one, a
    send half way through a ring, and one queued behind it."""
    _init(rank, world_size, init_method, timeout=30)
    res = []
    if rank == 0:
        reqs = [dist.recv(np.zeros(4), 1, tag=1),               # lane pending
                dist.recv(np.zeros(8)[::2], 1, tag=2),          # general
                dist.recv(np.zeros(4), None, tag=3),            # any
                dist.send(np.zeros(1 << 17), 1, tag=4),         # half moved (ring 64 KiB)
                dist.send(np.zeros(4), 1, tag=5)]               # queued behind
        dist.barrier()
        dist.destroy_process_group()
        for q in reqs:
            try:
                q.wait(timeout=5)
                res.append("completed")
            except dist.DistTimeoutError:
                res.append("timeout")
            except dist.DistError as e:
                res.append("destroy" in str(e) and "rank 0" in str(e))
        res.append([q.is_completed() for q in reqs])
        return res
    dist.barrier()
    dist.destroy_process_group()
    return res


@RING_ONLY
def test_requests_pending_at_destroy_fail(run_ranks):
    # through the ring (SHMDIST_SINGLE_COPY=0): a single copy is never half moved, so nothing
    # queues behind it and the small send completes; single copies pending at destroy:
    # tests/test_p2p_single_copy.py and test_p2p_single_copy_attack.py
    env = dict(SMALL_RING, SHMDIST_SINGLE_COPY="0")
    assert run_ranks(pending_at_destroy, 2, timeout=60, env=env)[0] == [True] * 5 + [[True] * 5]


def pending_at_subgroup_destroy(rank, world_size, init_method):
    """The same for a subgroup: destroy_process_group(sub) while a receive on
    it is pending."""
    _init(rank, world_size, init_method, timeout=30)
    sub = dist.new_group([0, 1])
    res = None
    if rank == 0:
        q = dist.recv(np.zeros(4), 1, group=sub)
        dist.destroy_process_group(sub)
        try:
            q.wait(timeout=3)
            res = "completed"
        except dist.DistTimeoutError:
            res = "still pending: timed out"
        except dist.DistError as e:
            res = "destroy" in str(e)
    dist.barrier()
    dist.destroy_process_group()
    return res


def test_requests_pending_at_subgroup_destroy_fail(run_ranks):
    assert run_ranks(pending_at_subgroup_destroy, 2, timeout=60)[0] is True


# ---------------------------------------------------------------- non-members and bad input

def nonmember_p2p(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    sub = dist.new_group([0, 1])
    res = []
    if rank == 2:
        calls = [lambda: dist.send(np.zeros(1), 0, group=sub), lambda: dist.recv(np.zeros(1), 0, group=sub),
                 lambda: dist.isend(np.zeros(1), 1, group=sub), lambda: dist.irecv(np.zeros(1), None, group=sub),
                 lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, np.zeros(1), 0, sub)]),
                 lambda: dist.send_object_list([1], 0, group=sub),
                 lambda: dist.recv_object_list([None], 0, group=sub)]
        for call in calls:
            try:
                call()
                res.append("no error")
            except dist.DistError as e:
                res.append("not a member" in str(e) and "rank 2" in str(e))
        res.append((dist.get_rank(sub), dist.get_world_size(sub)))
    else:
        res.append((dist.get_rank(sub), dist.get_world_size(sub)))
    dist.barrier()
    dist.destroy_process_group()
    return res


def test_point_to_point_on_a_group_this_rank_is_not_in_raises(run_ranks):
    got = run_ranks(nonmember_p2p, 3, timeout=60)
    assert got[2] == [True] * 7 + [(-1, -1)]
    assert got[0] == [(0, 2)] and got[1] == [(1, 2)]


def bad_send(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    res = []
    if rank == 0:
        for thing in ([1, 2, 3], b"abc", bytearray(4), memoryview(b"abcd"), 3.0, None,
                      np.array([object()], dtype=object)):
            try:
                dist.send(thing, 1)
                res.append("no error")
            except TypeError as e:
                res.append(type(thing).__name__ in str(e) or "object" in str(e))
    dist.barrier()
    dist.destroy_process_group()
    return res


def test_sending_anything_else_is_a_type_error_naming_the_type(run_ranks):
    assert run_ranks(bad_send, 2, timeout=60)[0] == [True] * 7


# ---------------------------------------------------------------- numpy dtypes

def numpy_dtypes(rank, world_size, init_method, names):
    _init(rank, world_size, init_method)
    bad = []
    for i, name in enumerate(names):
        dt = np.dtype(name)
        for shape in ((), (0,), (7,), (3, 5)):
            ref = np.frombuffer(np.random.default_rng(i).bytes(int(np.prod(shape)) * dt.itemsize),
                                dtype=dt).reshape(shape)
            if dt.kind == "b":
                ref = np.asarray(ref.view(np.uint8) % 2 == 1)
            if rank == 0:
                dist.send(ref, 1, tag=i).wait()
                rev = np.flip(ref) if ref.ndim else ref           # negative strides
                dist.send(rev, 1, tag=i).wait()
                back = np.zeros(shape, dtype=dt)
                dist.recv(back, 1, tag=i).wait()
                if back.tobytes() != ref.tobytes():
                    bad.append((name, shape, "back"))
            else:
                box = np.zeros(shape, dtype=dt)
                dist.recv(box, 0, tag=i).wait()
                big = np.zeros(tuple(2 * s for s in shape) or (), dtype=dt)
                view = big[tuple(slice(None, None, -2) for _ in shape)] if shape else big
                dist.recv(view, 0, tag=i).wait()
                if box.tobytes() != ref.tobytes() or not np.array_equal(np.flip(view) if shape else view, ref,
                                                                        equal_nan=dt.kind in "fc"):
                    bad.append((name, shape))
                dist.send(box.T if box.ndim == 2 else box, 0, tag=i).wait() if box.ndim != 2 else \
                    dist.send(np.ascontiguousarray(box.T).T, 0, tag=i).wait()
    dist.destroy_process_group()
    return bad


NUMPY_DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                "float16", "float32", "float64", "longdouble", "complex64", "complex128", "clongdouble"]


def test_every_numpy_dtype_both_directions_strided_0d_and_empty(run_ranks):
    assert run_ranks(numpy_dtypes, 2, NUMPY_DTYPES, timeout=90) == [[], []]


def byte_order(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    out = None
    if rank == 0:
        dist.send(np.arange(4, dtype=">f4"), 1).wait()
        dist.send(np.arange(4, dtype="<f4"), 1).wait()
        dist.send(np.arange(4, dtype=">i8"), 1).wait()
    else:
        a = np.zeros(4, dtype="<f4")
        b = np.zeros(4, dtype=">f4")
        c = np.zeros(4, dtype="<i8")
        res = []
        for box in (a, b, c):
            try:
                dist.recv(box, 0).wait()
                res.append(box.tolist())
            except dist.DistMismatchError:
                res.append("mismatch")      # an error would keep the promise too
        out = res
    dist.destroy_process_group()
    return out


def test_non_native_byte_order_moves_values_or_raises(run_ranks):
    got = run_ranks(byte_order, 2, timeout=60)[1]
    for value in got:
        assert value == "mismatch" or value == [0, 1, 2, 3], got


# ---------------------------------------------------------------- more wait(timeout) corners

def cancelled_then(rank, world_size, init_method):
    """Two receives posted for the same (src, tag); the first times out and is
    cancelled, so the message sent afterwards goes to the second. The
    cancelled request then says what happened to it."""
    _init(rank, world_size, init_method)
    res = {}
    if rank == 0:
        dist.barrier()
        dist.send(np.arange(4, dtype=np.int64), 1, tag=5).wait()
        dist.barrier()
        dist.barrier()          # stays until rank 1 looked at the cancelled request
    else:
        a = np.full(4, -1, dtype=np.int64)
        b = np.full(4, -1, dtype=np.int64)
        qa = dist.recv(a, 0, tag=5)
        qb = dist.recv(b, 0, tag=5)
        try:
            qa.wait(timeout=0.3)
        except dist.DistTimeoutError as e:
            res["first"] = "cancelled" in str(e)
        dist.barrier()
        qb.wait(timeout=20)
        res["second_got_it"] = b.tolist() == [0, 1, 2, 3] and bool((a == -1).all())
        dist.barrier()
        res["state"] = (qa.is_completed(), type(qa.exception()).__name__)
        try:
            qa.wait(timeout=0.3)
            res["again"] = "completed"
        except dist.DistTimeoutError as e:
            res["again"] = "cancelled" if "cancelled" in str(e) else str(e)
        dist.barrier()
    dist.destroy_process_group()
    return res


def test_a_cancelled_receive_lets_the_next_one_take_the_message(run_ranks):
    got = run_ranks(cancelled_then, 2, timeout=60)[1]
    assert got["first"] is True and got["second_got_it"] is True


def test_a_cancelled_receive_reports_itself_failed(run_ranks):
    got = run_ranks(cancelled_then, 2, timeout=60)[1]
    assert got["state"] == (True, "DistTimeoutError") and got["again"] == "cancelled", got


def lane_pending_mismatch(rank, world_size, init_method):
    """The receive is posted (a pending fast-lane receive) before the
    mismatched message comes; the message is then kept for the next one."""
    _init(rank, world_size, init_method)
    res = []
    if rank == 0:
        dist.barrier()
        dist.send(np.arange(10, dtype=np.float32), 1).wait()
    else:
        q = dist.recv(np.zeros(4, dtype=np.float32), 0)
        dist.barrier()
        try:
            q.wait(timeout=20)
            res.append("no error")
        except dist.DistMismatchError as e:
            res.append("40 bytes" in str(e))
        box = np.zeros(10, dtype=np.float32)
        dist.recv(box, 0).wait(timeout=20)
        res.append(box.tolist() == list(range(10)))
    dist.destroy_process_group()
    return res


def test_mismatch_on_a_receive_posted_before_the_message(run_ranks):
    assert run_ranks(lane_pending_mismatch, 2, timeout=60)[1] == [True, True]


def collective_timeout(rank, world_size, init_method):
    """A collective that times out leaves its group unusable (a clear error,
    at once); point-to-point still works, the default group too, and a new
    group can be made."""
    _init(rank, world_size, init_method, timeout=30)
    sub = dist.new_group([0, 1], timeout=1)
    res = {}
    if rank == 0:
        try:
            dist.all_reduce(np.ones(3), group=sub)
        except dist.DistTimeoutError:
            res["timeout"] = True
        t0 = time.monotonic()
        try:
            dist.barrier(group=sub)
            res["after"] = "worked"
        except dist.DistTimeoutError:
            res["after"] = "waited again"
        except dist.DistError as e:
            res["after"] = "unusable" in str(e) and time.monotonic() - t0 < 0.5
    box = np.zeros(2)
    reqs = [dist.send(np.full(2, float(rank)), 1 - rank), dist.recv(box, 1 - rank)]
    for q in reqs:
        q.wait()
    res["p2p"] = box.tolist() == [float(1 - rank)] * 2
    x = np.ones(2)
    dist.all_reduce(x)
    res["default"] = x.tolist() == [2.0, 2.0]
    fresh = dist.new_group([0, 1])
    y = np.ones(2)
    dist.all_reduce(y, group=fresh)
    res["fresh"] = y.tolist() == [2.0, 2.0]
    dist.destroy_process_group()
    return res


def test_a_collective_timeout_leaves_its_group_unusable_but_p2p_works(run_ranks):
    r0, r1 = run_ranks(collective_timeout, 2, timeout=60)
    assert r0 == {"timeout": True, "after": True, "p2p": True, "default": True, "fresh": True}
    assert r1 == {"p2p": True, "default": True, "fresh": True}


# ---------------------------------------------------------------- dtypes named past 16 bytes, structured

def same_dtype(rank, world_size, init_method, sent, received):
    _init(rank, world_size, init_method)
    out = None
    st, rt = np.dtype(sent if isinstance(sent, str) else [tuple(f) for f in sent]), \
        np.dtype(received if isinstance(received, str) else [tuple(f) for f in received])
    ref = np.frombuffer(np.random.default_rng(1).bytes(st.itemsize * 3), dtype=st)
    if rank == 0:
        dist.send(ref, 1, tag=1).wait()
        dist.send(np.zeros(1), 1, tag=0).wait()
    else:
        dist.recv(np.zeros(1), 0, tag=0).wait()     # waiting drains the tag-1 message aside first
        box = np.zeros(3, dtype=rt)
        try:
            dist.recv(box, 0, tag=1).wait(timeout=20)
            out = "same values" if (st == rt and box.tobytes() == ref.tobytes()) or \
                (st != rt and box.tolist() == ref.astype(rt).tolist()) else "other values"
        except dist.DistMismatchError as e:
            out = f"mismatch: {e}"
    dist.destroy_process_group()
    return out


def test_a_dtype_with_a_long_name_reaches_the_same_dtype(run_ranks):
    assert run_ranks(same_dtype, 2, "timedelta64[100ns]", "timedelta64[100ns]", timeout=60)[1] == "same values"


def test_short_named_datetime_and_string_dtypes_move(run_ranks):
    for dt in ("datetime64[ns]", "datetime64[25us]", "U7", "S5", "V12"):
        assert run_ranks(same_dtype, 2, dt, dt, timeout=60)[1] == "same values", dt


def test_structured_dtypes_with_other_fields_are_not_reinterpreted(run_ranks):
    got = run_ranks(same_dtype, 2, [("a", "<i4"), ("b", "<f8")], [("b", "<f8"), ("a", "<i4")], timeout=60)[1]
    assert got == "same values" or got.startswith("mismatch"), got


# ---------------------------------------------------------------- groups, global ranks, threads

def any_source_in_a_subgroup(rank, world_size, init_method):
    """recv(src=None, group=sub) takes only messages of that group, and
    ``source`` is the sender's global rank; roots are global ranks too."""
    _init(rank, world_size, init_method)
    sub = dist.new_group([0, 2])                 # global 2 is group rank 1
    res = {}
    if rank == 1:
        dist.send(np.full(3, 1.0), 0).wait()     # default group, same tag, arrives first
        dist.barrier()
    elif rank == 2:
        dist.barrier()
        dist.send(np.full(3, 2.0), 0, group=sub).wait()
    else:
        dist.barrier()
        box = np.zeros(3)
        q = dist.recv(box, None, group=sub)
        q.wait()
        res["sub"] = (q.source, box.tolist())
        other = np.zeros(3)
        q = dist.recv(other, None)
        q.wait()
        res["default"] = (q.source, other.tolist())
    if rank != 1:
        x = np.full(2, float(rank))
        dist.broadcast(x, 2, group=sub)
        res["bcast"] = x.tolist()
    dist.destroy_process_group()
    return res


def test_any_source_in_a_subgroup_and_global_ranks(run_ranks):
    r0, _, r2 = run_ranks(any_source_in_a_subgroup, 3, timeout=60)
    assert r0 == {"sub": (2, [2.0] * 3), "default": (1, [1.0] * 3), "bcast": [2.0, 2.0]}
    assert r2 == {"bcast": [2.0, 2.0]}


def threads_same_peer(rank, world_size, init_method, rounds):
    """Three threads send to and receive from the same peer at once, each on
    its own tag, with sizes on both sides of the lane's no-GIL copy."""
    _init(rank, world_size, init_method, timeout=60)
    errors = []

    def worker(tag):
        try:
            for i in range(rounds):
                n = (17, 20000, 300000)[(i + tag) % 3]
                box = np.zeros(n, dtype=np.int32)
                reqs = [dist.send(np.full(n, rank * 1000 + tag * 100 + i % 100, dtype=np.int32), 1 - rank, tag=tag),
                        dist.recv(box, 1 - rank, tag=tag)]
                for q in reqs:
                    q.wait()
                want = (1 - rank) * 1000 + tag * 100 + i % 100
                if not (box == want).all():
                    errors.append((tag, i, int(box[0]), want))
        except Exception as e:  # noqa: BLE001
            errors.append((tag, repr(e)))

    import threading
    ts = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dist.barrier()
    dist.destroy_process_group()
    return errors


def test_threads_sharing_one_peer(run_ranks):
    assert run_ranks(threads_same_peer, 2, 60, timeout=120) == [[], []]

"""Single copy between local ranks (transport/engine.py): a message at least
SHMDIST_SINGLE_COPY bytes big that the ring cannot take whole at once (and,
one way, only when it is bigger than the ring or of at least
engine.ONE_WAY_SINGLE_MIN bytes; else only while a receive from its
destination is pending too) goes
through the ring as a small record naming the sender's memory, and the
receiver reads it from there with process_vm_readv. A 64 KiB ring here, so
that every message from the threshold up takes that way. Bit-exact data around the threshold, both ways at once,
many in flight, out-of-order tags, a buffer sent and received into at once,
the fallback (the knob at 0, a peer the probe cannot read), a sender killed
while its message is being read, and the flight recorder."""
from __future__ import annotations

import errno
import os
import signal
import time

import numpy as np
import pytest

import shmdist as dist
from shmdist.transport.engine import ONE_WAY_SINGLE_MIN

# they count single copies: the sender's timing of the ring against them off (transport/ways.py)
pytestmark = pytest.mark.usefixtures("p2p_choose_off")

THRESHOLD = 64 << 10
ENV = {"SHMDIST_SINGLE_COPY": str(THRESHOLD), "SHMDIST_RING_BYTES": str(THRESHOLD)}
SIZES = (THRESHOLD - 64, THRESHOLD - 1, THRESHOLD, THRESHOLD + 1, THRESHOLD + 4096, 3 << 20)


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def single_copy_used(peer: int) -> bool:
    """Whether this rank sends big messages to ``peer`` in a single copy."""
    from shmdist.api import group
    engine = group._world.engine
    return engine.single.get(peer, 0) < float("inf") and peer in engine.single


def exchange_sizes(rank, world_size, init_method, patch_refuse):
    if patch_refuse and rank == 1:      # this rank's probe is refused, as under Yama or seccomp
        from shmdist import _core
        _core.cma_read = lambda pid, dst, src, n: errno.EPERM
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    peer = 1 - rank
    bad = []
    for i, n in enumerate(SIZES):
        out = pattern(n, 10 * i + rank)
        into = np.zeros(n, np.uint8)
        reqs = [dist.irecv(into, peer, tag=i), dist.isend(out, peer, tag=i)]    # both ways at once
        for r in reqs:
            r.wait()
        if not np.array_equal(into, pattern(n, 10 * i + peer)):
            bad.append(n)
    used = single_copy_used(peer)
    dist.destroy_process_group()
    return bad, used


@pytest.mark.parametrize("how", ["single", "knob", "refused"])
def test_sizes_around_threshold_both_ways(run_ranks, how):
    env = dict(ENV, SHMDIST_SINGLE_COPY="0") if how == "knob" else ENV
    results = run_ranks(exchange_sizes, 2, how == "refused", env=env, timeout=90)
    assert [bad for bad, _ in results] == [[], []]
    used = [u for _, u in results]
    if how == "single":
        assert used == [True, True]
    elif how == "knob":
        assert used == [False, False]
    else:   # rank 1 cannot read rank 0: rank 0 sends through the ring; rank 1 may still single-copy
        assert used == [False, True]


def many_in_flight(rank, world_size, init_method, count, nbytes):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    bad = []
    if rank == 0:
        outs = [pattern(nbytes, t) for t in range(count)]
        reqs = [dist.isend(outs[t], 1, tag=t) for t in range(count)]
        for r in reqs:
            r.wait()
        ok = single_copy_used(1)
        # a buffer changed after its send completed must not change what was received
        for o in outs:
            o[:] = 0
        dist.send(np.ones(1), 1).wait()
    else:
        intos = [np.zeros(nbytes, np.uint8) for _ in range(count)]
        # out-of-order tags: the last one first, then the rest in order
        reqs = [dist.irecv(intos[count - 1], 0, tag=count - 1)]
        reqs += [dist.irecv(intos[t], 0, tag=t) for t in range(count - 1)]
        for r in reqs:
            r.wait()
        dist.recv(np.zeros(1), 0).wait()
        bad = [t for t in range(count) if not np.array_equal(intos[t], pattern(nbytes, t))]
        ok = True
    dist.destroy_process_group()
    return bad, ok


def test_many_in_flight_out_of_order_tags(run_ranks):
    results = run_ranks(many_in_flight, 2, 24, 200_000, env=ENV, timeout=90)
    assert results == [([], True), ([], True)]


def unexpected_then_received(rank, world_size, init_method, n):
    """Both ranks send big messages before either receives: each drains the
    other's into a buffer of its own (no deadlock), then receives it."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    peer = 1 - rank
    out = [pattern(n, 100 * rank + k) for k in range(3)]
    for k in range(3):
        dist.send(out[k], peer, tag=k).wait()
    got = []
    for k in range(3):
        into = np.zeros(n, np.uint8)
        dist.recv(into, peer, tag=k).wait()
        got.append(np.array_equal(into, pattern(n, 100 * peer + k)))
    dist.destroy_process_group()
    return got


@pytest.mark.parametrize("ring", ["small", "default"])
def test_sends_before_receives_do_not_deadlock(run_ranks, ring):
    # the default ring would hold each whole: single copies one way from ONE_WAY_SINGLE_MIN
    env, n = (ENV, 1 << 20) if ring == "small" else ({}, ONE_WAY_SINGLE_MIN)
    assert run_ranks(unexpected_then_received, 2, n, env=env, timeout=90) == [[True] * 3] * 2


def aliased(rank, world_size, init_method, recv_first):
    """One buffer sent and received into at once (a swap): the peer must get
    what the buffer held when the send was posted, this rank the peer's.
    With ``recv_first`` rank 0 posts the receive into the buffer, then the
    send from it, then tells rank 1 to go: rank 1's message may land in the
    buffer before rank 1 reads it, so that send must not be a single copy."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    peer = 1 - rank
    n = 1 << 20
    bad = []
    for it in range(5):
        buf = pattern(n, 1000 * it + rank)
        if not recv_first:
            reqs = [dist.isend(buf, peer, tag=it), dist.irecv(buf, peer, tag=it)]
        elif rank == 0:
            reqs = [dist.irecv(buf, peer, tag=it), dist.isend(buf, peer, tag=it)]
            dist.send(np.ones(1), peer, tag=-1).wait()
        else:
            reqs = [dist.irecv(buf, peer, tag=it)]
            dist.recv(np.ones(1), peer, tag=-1).wait()
            reqs.append(dist.isend(pattern(n, 1000 * it + rank), peer, tag=it))
        for r in reqs:
            r.wait()
        if not np.array_equal(buf, pattern(n, 1000 * it + peer)):
            bad.append(it)
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("recv_first", [True, False])
def test_aliased_send_and_recv_buffer(run_ranks, recv_first):
    assert run_ranks(aliased, 2, recv_first, env=ENV, timeout=90) == [[], []]


def sender_killed(rank, world_size, init_method, nbytes, when, note):
    """Rank 0 sends a big single copy and is killed (SIGKILL): ``before`` the
    read (right after its record went into the ring; rank 1 receives once
    rank 0 is gone), or ``during`` it (from a second thread of rank 1 while
    its main thread reads). Rank 1's receive then either has the whole,
    exact message (the kernel keeps a dying sender's memory until a read
    under way ends) or fails naming rank 0 as dead; it never hangs."""
    import threading
    from ranks import wait_until_gone
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    if rank == 0:
        buf = pattern(nbytes, 5)
        dist.send(np.ones(1), 1).wait()      # ready
        never = dist.irecv(np.zeros(1), 1)   # (a receive from rank 1 pending: big sends go single copy)
        dist.isend(buf, 1)
        from shmdist.api import group
        with open(note, "w") as f:           # the message went as a single copy
            f.write(str(sum(len(q) for q in group._world.engine.queues.awaiting.values())))
        if when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        never.wait()                         # never completes: rank 1 kills this process
        return "not killed"
    from shmdist.api import group
    pid = group._world.host.peer_pids[0]
    into = np.zeros(nbytes, np.uint8)
    into[:] = 2     # its pages are there: the read is the only long part
    dist.recv(np.ones(1), 0).wait()
    killer = None
    if when == "before":
        wait_until_gone(pid)
    else:
        killer = threading.Timer(0.02, os.kill, (pid, signal.SIGKILL))
        killer.start()
    t0 = time.monotonic()
    try:
        dist.recv(into, 0).wait()
        outcome = "exact" if np.array_equal(into, pattern(nbytes, 5)) else "corrupt"
    except dist.DistError as e:
        outcome = (type(e).__name__, str(e), time.monotonic() - t0 < 30)
    if killer is not None:
        killer.join()
    return outcome


def test_sender_killed_before_its_message_is_read(run_ranks, tmp_path):
    note = tmp_path / "awaiting"
    res = run_ranks(sender_killed, 2, 8 << 20, "before", str(note), env=ENV, timeout=90, errors="return")
    assert note.read_text() == "1"
    kind, message, prompt = res[1]
    assert kind == "DistPeerError" and "rank 0 died" in message and prompt, res[1]


def test_sender_killed_while_its_message_is_read(run_ranks, tmp_path):
    note = tmp_path / "awaiting"
    res = run_ranks(sender_killed, 2, 512 << 20, "during", str(note), env=ENV, timeout=90, errors="return")
    assert note.read_text() == "1"
    assert res[1] == "exact" or (res[1][0] == "DistPeerError" and "rank 0 died" in res[1][1]), res[1]


def traced(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    from shmdist import trace
    n = 1 << 20
    if rank == 0:
        dist.send(pattern(n, 1), 1, tag=7).wait()
    else:
        dist.recv(np.zeros(n, np.uint8), 0, tag=7).wait()
    used = single_copy_used(1 - rank)
    got = [(e.kind, e.peer, e.tag, e.nbytes, e.state) for e in trace.own_ring().entries()
           if e.kind in ("send", "recv")]
    dist.destroy_process_group()
    return used, got


def test_flight_recorder_records_single_copies(run_ranks):
    from shmdist import trace
    (used0, sent), (used1, received) = run_ranks(traced, 2, env=ENV, timeout=60)
    assert used0
    assert sent == [("send", 1, 7, 1 << 20, trace.DONE)]
    assert received == [("recv", 0, 7, 1 << 20, trace.DONE)]


def ring_or_single(rank, world_size, init_method, nbytes, pending):
    """What rank 0's one send of ``nbytes`` becomes: 'ring' (completed at
    once, or streaming through the ring) or 'single' (waiting to be read).
    ``pending``: rank 0 has a receive from rank 1 pending meanwhile; False:
    rank 1 receives only once rank 0 has exited; None: rank 1 receives at once."""
    from shmdist.api import group
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    if rank == 0:
        answer = dist.irecv(np.zeros(1), 1) if pending else None
        req = dist.isend(pattern(nbytes, 9), 1)
        got = "single" if group._world.engine.queues.awaiting else "ring"
        req.wait()
        if answer is not None:
            answer.wait()
        dist.destroy_process_group()
        return got
    from ranks import wait_until_gone
    if pending is False:    # a send that fit the ring completed without this rank
        wait_until_gone(group._world.host.peer_pids[0])
    into = np.zeros(nbytes, np.uint8)
    dist.recv(into, 0).wait(timeout=30)
    if pending:
        dist.send(np.zeros(1), 0).wait()
    dist.destroy_process_group()
    return np.array_equal(into, pattern(nbytes, 9))


@pytest.mark.parametrize("nbytes, pending, way", [
    (96 << 10, False, "ring"),      # fits the 1 MiB ring, under ONE_WAY_SINGLE_MIN: completes at once,
                                    # even if the sender exits
    (8 << 20, None, "single"),      # one way, bigger than the ring: its reading shared with the sender
    (8 << 20, True, "single"),      # the same with a receive from the peer pending
    (2 << 20, None, "single"),      # one way, does not fit the ring
    (ONE_WAY_SINGLE_MIN, None, "single"),   # one way, fits the ring: from the one-way threshold
    (ONE_WAY_SINGLE_MIN - 64, False, "ring"),
])
def test_which_messages_go_single_copy(run_ranks, nbytes, pending, way):
    env = {"SHMDIST_SINGLE_COPY": str(THRESHOLD), "SHMDIST_RING_BYTES": str(1 << 20)}
    assert run_ranks(ring_or_single, 2, nbytes, pending, env=env, timeout=90) == [way, True]


def behind_another(rank, world_size, init_method, pending):
    """What rank 0's second send of 96 KiB (under ONE_WAY_SINGLE_MIN) becomes
    while its first still fills the 128 KiB ring: 'ring' (streams behind it) or 'single'.
    ``pending``: rank 0 has a receive from rank 1 pending meanwhile."""
    from shmdist.api import group
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    dist.barrier()      # rank 1 has probed that it may read rank 0 (init's last step)
    n = 96 << 10
    if rank == 0:
        answer = dist.irecv(np.zeros(1), 1) if pending else None
        reqs = [dist.isend(pattern(n, 5), 1), dist.isend(pattern(n, 6), 1)]
        engine = group._world.engine
        got = "single" if engine.queues.awaiting else "ring" if 1 in engine.queues.sendq else "?"
        dist.barrier()      # rank 1 receives only now
        for r in reqs + ([answer] if answer is not None else []):
            r.wait()
        dist.destroy_process_group()
        return got
    ok = []
    dist.barrier()
    for seed in (5, 6):
        into = np.zeros(n, np.uint8)
        dist.recv(into, 0).wait(timeout=30)
        ok.append(np.array_equal(into, pattern(n, seed)))
    if pending:
        dist.send(np.zeros(1), 0).wait()
    dist.destroy_process_group()
    return ok


@pytest.mark.parametrize("pending, way", [(False, "ring"), (True, "single")])
def test_one_way_message_that_fits_the_ring_streams_behind_another(run_ranks, pending, way):
    """One way, a message under ONE_WAY_SINGLE_MIN the empty ring could take
    whole streams through it even while the ring is busy; both ways at once it
    goes in a single copy."""
    env = {"SHMDIST_SINGLE_COPY": str(THRESHOLD), "SHMDIST_RING_BYTES": str(128 << 10)}
    assert run_ranks(behind_another, 2, pending, env=env, timeout=90) == [way, [True, True]]


def receiver_killed(rank, world_size, init_method):
    """Rank 0's single-copy send waits for rank 1 to read it; rank 1 is
    killed first: the send fails naming rank 1, it does not hang."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    if rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    from shmdist.api import group
    req = dist.isend(pattern(2 << 20, 3), 1)
    single = bool(group._world.engine.queues.awaiting)
    t0 = time.monotonic()
    try:
        req.wait()
        return single, "completed"
    except dist.DistError as e:
        return single, (type(e).__name__, str(e), time.monotonic() - t0 < 30)


def test_receiver_killed_before_reading(run_ranks):
    res = run_ranks(receiver_killed, 2, env=ENV, timeout=90, errors="return")
    single, (kind, message, prompt) = res[0]
    assert single
    assert kind == "DistPeerError" and "send to rank 1" in message and "rank 1 died" in message and prompt, message


def read_while_sender_parked(rank, world_size, init_method):
    """A single copy is read whole while its sender sits in a barrier (which
    moves no point-to-point bytes): on the ring it would stay half moved."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    n = 2 << 20
    if rank == 0:
        q = dist.send(pattern(n, 4), 1)
        dist.barrier()
        dist.barrier()
        got = q.wait()
    else:
        dist.barrier()
        into = np.zeros(n, np.uint8)
        q = dist.recv(into, 0)
        q.wait(timeout=10)      # rank 0 is in the second barrier meanwhile
        got = np.array_equal(into, pattern(n, 4))
        dist.barrier()
    dist.destroy_process_group()
    return got


def test_single_copy_is_read_while_the_sender_is_in_a_barrier(run_ranks):
    assert run_ranks(read_while_sender_parked, 2, env=ENV, timeout=60)[1] is True


def queued_at_destroy(rank, world_size, init_method):
    """Sends queued behind a half-moved one at destroy, a single copy's
    record among them (its record not even in the ring yet): each fails
    naming the destroy; the one that went whole into the ring completed."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=30)
    dist.barrier()      # rank 1 has probed that it may read rank 0 (init's last step)
    res = []
    if rank == 0:
        part = 48 << 10         # two of them do not fit the 64 KiB ring
        reqs = [dist.send(np.zeros(part, np.uint8), 1, tag=1),            # whole into the ring
                dist.send(np.zeros(part, np.uint8), 1, tag=2),            # half moved
                dist.send(np.zeros(2 * THRESHOLD, np.uint8), 1, tag=3),   # single copy, queued behind
                dist.send(np.zeros(4), 1, tag=4)]                         # queued behind
        from shmdist.api import group
        queued = [op.meta is not None for op in group._world.engine.queues.sendq[1]]
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
        return res, queued
    dist.barrier()
    dist.destroy_process_group()
    return res


def test_sends_queued_behind_at_destroy_fail(run_ranks):
    res, queued = run_ranks(queued_at_destroy, 2, timeout=60, env=ENV)[0]
    assert queued == [False, True, False]
    assert res == ["completed", True, True, True]

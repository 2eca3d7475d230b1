"""Single copies written and read by the fast lane (_lane.pxi): a send of a
numpy array (or plain torch tensor) on the default group, of at least
SHMDIST_SINGLE_COPY bytes, goes as a single copy from the lane itself while
a receive from its destination is pending there (both ways at once), or one
way from engine.ONE_WAY_SINGLE_MIN bytes; the receive reads it in its wait.
The request stays pending until the destination has read the message.

Each test checks the bytes, and counts that the lane, not the engine, took
the messages (Lane.sends) and that they went as single copies (the ring's
acks_seen: reads the sender saw end): bit-exact windows both ways, a torch
tensor, a receive into memory a single copy still reads, a send from memory
a pending receive writes, a timed-out wait that finishes later, the
receiver killed while the sender waits, destroy with one pending, one way:
a window (the sender helping with the reads) and a loop of blocking sends,
each side of the threshold."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import shmdist as dist
from shmdist import settings
from shmdist.transport.engine import ONE_WAY_SINGLE_MIN

# they count single copies: the sender's timing of the ring against them off (transport/ways.py)
pytestmark = pytest.mark.usefixtures("p2p_choose_off")

MiB = 1 << 20
SINGLE = settings.SETTINGS["SHMDIST_SINGLE_COPY"].default   # the default threshold


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _engine():
    from shmdist.api import group
    return group._world.engine


def counters(peer: int) -> tuple[int, int]:
    """(sends the lane took, single copies ``peer`` has read and this rank saw end)."""
    engine = _engine()
    return engine.lane.sends, engine.chan_out[peer].acks_seen


def teach_the_lane(peer: int) -> None:
    """The lane takes a dtype once the general path has moved one (api/fast.py, learn)."""
    u8 = np.zeros(1, np.uint8)
    for q in (dist.irecv(u8.copy(), peer), dist.isend(u8, peer)):
        q.wait()


def start(rank: int, world_size: int, init_method: str, timeout: float = 60) -> None:
    """Join, wait until the peer has probed that it may read this rank (init's
    last step), and teach the lane uint8."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=timeout)
    dist.barrier()
    teach_the_lane(1 - rank)


def window_both_ways(rank, world_size, init_method, sizes, window, torch_tensors):
    start(rank, world_size, init_method)
    peer = 1 - rank
    bad, took = [], []
    for i, n in enumerate(sizes):
        outs = [pattern(n, 1000 * i + 10 * k + rank) for k in range(window)]
        intos = [np.zeros(n, np.uint8) for _ in range(window)]
        if torch_tensors:
            import torch
            outs = [torch.from_numpy(o) for o in outs]
            intos = [torch.from_numpy(o) for o in intos]
        sends0, acks0 = counters(peer)
        reqs = [dist.irecv(intos[k], peer, tag=k) for k in range(window)]
        reqs += [dist.isend(outs[k], peer, tag=k) for k in range(window)]
        sends1, _ = counters(peer)
        for q in reqs:
            q.wait()
        _, acks1 = counters(peer)
        took.append((sends1 - sends0, acks1 - acks0))
        for k in range(window):
            got = intos[k].numpy() if torch_tensors else intos[k]
            if not np.array_equal(got, pattern(n, 1000 * i + 10 * k + peer)):
                bad.append((n, k))
    dist.destroy_process_group()
    return bad, took


@pytest.mark.parametrize("torch_tensors", [False, True])
def test_both_ways_windows_are_bit_exact_and_go_as_the_lanes_single_copies(run_ranks, torch_tensors):
    if torch_tensors:
        pytest.importorskip("torch")
    sizes = (SINGLE, SINGLE + 1, MiB + 24, 2 * MiB - 4096)   # from the threshold (the default) up
    window = 6
    env = {"SHMDIST_RING_BYTES": str(4 * MiB)}
    res = run_ranks(window_both_ways, 2, sizes, window, torch_tensors, env=env, timeout=120)
    for bad, took in res:
        assert bad == []
        assert took == [(window, window)] * len(sizes)    # every send the lane's, every one a single copy


def test_below_the_threshold_or_with_the_knob_off_the_ring_carries_them(run_ranks):
    sizes = (SINGLE - 1, MiB)
    res = run_ranks(window_both_ways, 2, sizes[:1], 4, False, timeout=120)
    assert [r[1] for r in res] == [[(4, 0)]] * 2     # the lane's, through the ring
    res = run_ranks(window_both_ways, 2, sizes[1:], 2, False, env={"SHMDIST_SINGLE_COPY": "0"}, timeout=120)
    assert [r[0] for r in res] == [[], []]
    assert all(took[0][1] == 0 for _, took in res)


def receive_into_memory_being_read(rank, world_size, init_method):
    """Rank 0 sends ``buf`` as a single copy, then at once posts a receive into
    that same memory: the receive must not land before rank 1 read the send."""
    start(rank, world_size, init_method)
    n = MiB
    if rank == 0:
        buf = pattern(n, 1)
        answer = dist.irecv(np.zeros(8, np.uint8), 1, tag=9)          # pending: the send goes single copy
        sends0, acks0 = counters(1)
        sent = dist.isend(buf, 1, tag=1)
        single = len(_engine().queues.awaiting.get(1, ())) == 1 and counters(1)[0] == sends0 + 1
        dist.barrier()          # rank 1 sends its reply, then reads (a barrier moves no message)
        back = dist.irecv(buf, 1, tag=2)                    # into the memory the send is read from
        back.wait()
        sent.wait()
        answer.wait()
        ok = np.array_equal(buf, pattern(n, 2))
        read = counters(1)[1] - acks0
        dist.destroy_process_group()
        return single, read, ok
    dist.barrier()
    reply = dist.isend(pattern(n, 2), 0, tag=2)         # whole into the ring
    time.sleep(0.3)                     # a receive posted straight into buf would have it by now
    into = np.zeros(n, np.uint8)
    dist.recv(into, 0, tag=1).wait()
    reply.wait()
    dist.send(np.zeros(8, np.uint8), 0, tag=9).wait()
    ok = np.array_equal(into, pattern(n, 1))
    dist.destroy_process_group()
    return ok


def test_a_receive_into_memory_a_single_copy_still_reads_waits_for_that_read(run_ranks):
    (single, read, ok0), ok1 = run_ranks(receive_into_memory_being_read, 2, timeout=90)
    assert single and read == 1
    assert ok1, "rank 1 read bytes the later receive had already written"
    assert ok0


def send_from_memory_a_receive_writes(rank, world_size, init_method):
    """Rank 0 posts a receive into ``buf`` and then sends ``buf``: the send may
    not be read later than now (the receive may overwrite it first), so it
    goes through the ring and carries ``buf`` as it was when sent."""
    start(rank, world_size, init_method)
    n = MiB
    if rank == 0:
        buf = pattern(n, 1)
        sends0, acks0 = counters(1)
        into = dist.irecv(buf, 1, tag=2)
        sent = dist.isend(buf, 1, tag=1)
        was = (counters(1)[0] - sends0, sent.is_completed())
        into.wait()
        sent.wait()
        ok = np.array_equal(buf, pattern(n, 2))
        acks = counters(1)[1] - acks0
        dist.destroy_process_group()
        return was, acks, ok
    into = np.zeros(n, np.uint8)
    dist.recv(into, 0, tag=1).wait()
    dist.send(pattern(n, 2), 0, tag=2).wait()
    ok = np.array_equal(into, pattern(n, 1))
    dist.destroy_process_group()
    return ok


def test_a_send_from_memory_a_pending_receive_writes_goes_through_the_ring(run_ranks):
    (was, acks, ok0), ok1 = run_ranks(send_from_memory_a_receive_writes, 2, timeout=90)
    assert was == (1, True) and acks == 0      # the lane's, whole into the ring: done at once
    assert ok1 and ok0


def timed_out_then_finished(rank, world_size, init_method):
    """A single-copy send whose destination does not read it yet: wait(timeout)
    raises DistTimeoutError saying it stays pending; the next wait, once the
    destination read it, completes, and the bytes are exact."""
    start(rank, world_size, init_method)
    n = MiB
    if rank == 0:
        answer = dist.irecv(np.zeros(8, np.uint8), 1)
        sent = dist.isend(pattern(n, 7), 1)
        single = bool(_engine().queues.awaiting)
        t0 = time.monotonic()
        try:
            sent.wait(timeout=0.3)
            first = "completed"
        except dist.DistTimeoutError as e:
            first = ("stays pending" in str(e) and "send to rank 1" in str(e), time.monotonic() - t0 < 5)
        dist.barrier()          # rank 1 waited here meanwhile (a barrier moves no message), and now reads
        sent.wait(timeout=30)
        answer.wait()
        dist.destroy_process_group()
        return single, first
    dist.barrier()
    into = np.zeros(n, np.uint8)
    dist.recv(into, 0).wait()
    dist.send(np.zeros(8, np.uint8), 0).wait()
    ok = np.array_equal(into, pattern(n, 7))
    dist.destroy_process_group()
    return ok


def test_a_timed_out_wait_on_a_single_copy_stays_pending_and_finishes_later(run_ranks):
    (single, first), ok = run_ranks(timed_out_then_finished, 2, timeout=90)
    assert single and first == (True, True) and ok


def receiver_killed(rank, world_size, init_method):
    """Rank 0 waits on a lane single copy; rank 1 is killed before reading it:
    the wait fails naming rank 1, promptly."""
    start(rank, world_size, init_method)
    if rank == 1:
        dist.barrier()          # (a barrier moves no message: the single copy stays unread)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.irecv(np.zeros(8, np.uint8), 1, tag=4)       # pending: the send goes single copy
    sends0, _ = counters(1)
    sent = dist.isend(pattern(MiB, 3), 1)
    lane = counters(1)[0] == sends0 + 1 and bool(_engine().queues.awaiting)
    dist.barrier()
    t0 = time.monotonic()
    try:
        sent.wait()
        return lane, "completed"
    except dist.DistError as e:
        return lane, (type(e).__name__, "send to rank 1" in str(e) and "rank 1 died" in str(e),
                      time.monotonic() - t0 < 30)


def test_the_receiver_killed_while_the_sender_waits_is_named(run_ranks):
    res = run_ranks(receiver_killed, 2, timeout=90, errors="return")
    assert res[0] == (True, ("DistPeerError", True, True)), res[0]


def destroy_with_one_pending(rank, world_size, init_method):
    start(rank, world_size, init_method, 30)
    if rank == 0:
        dist.irecv(np.zeros(8, np.uint8), 1)
        sent = dist.isend(pattern(MiB, 3), 1)
        lane = bool(_engine().queues.awaiting)
        dist.barrier()
        dist.destroy_process_group()
        try:
            sent.wait(timeout=5)
            return lane, "completed"
        except dist.DistError as e:
            return lane, ("destroy_process_group" in str(e) and "send to rank 1" in str(e))
    dist.barrier()
    dist.destroy_process_group()
    return None


def test_destroy_fails_a_pending_single_copy_send(run_ranks):
    assert run_ranks(destroy_with_one_pending, 2, timeout=60)[0] == (True, True)


def one_way_window(rank, world_size, init_method, count, rounds):
    """One way, nothing sent before: a message one byte under ONE_WAY_SINGLE_MIN
    goes through the ring, one of ONE_WAY_SINGLE_MIN and ``count`` of 6 MiB as
    the lane's single copies; rank 0 waits on the last one first, in the lane's
    spin (long enough, SHMDIST_SPIN, that the engine's wait never runs), copying
    chunks of the reads rank 1 offers to share. Whether rank 0 gets a CPU while
    rank 1 reads is the scheduler's: on two loaded cores a whole window may pass
    without it, so the window is sent again (up to ``rounds`` times) until rank
    0 has copied a chunk; every round is counted and checked."""
    start(rank, world_size, init_method)
    sizes = [ONE_WAY_SINGLE_MIN - 1, ONE_WAY_SINGLE_MIN] + [6 * MiB] * count
    again = np.zeros(1, np.uint8)
    if rank == 0:
        engine = _engine()
        helped0 = engine.chan_out[1].helped
        counts = []
        for r in range(rounds):
            sends0, acks0 = counters(1)
            reqs = [dist.isend(pattern(n, k), 1, tag=k) for k, n in enumerate(sizes)]
            lane = counters(1)[0] - sends0
            reqs[-1].wait()
            for q in reqs:
                q.wait()
            counts.append((lane, counters(1)[1] - acks0))
            again[0] = engine.chan_out[1].helped == helped0 and r + 1 < rounds
            dist.send(again, 1).wait()
            if not again[0]:
                break
        res = counts, engine.chan_out[1].helped > helped0
        dist.barrier()
        dist.destroy_process_group()
        return res
    ok = []
    while True:
        time.sleep(0.2)         # rank 0 is in its wait by now, spinning: it sees every offer
        for k, n in enumerate(sizes):
            into = np.zeros(n, np.uint8)
            dist.recv(into, 0, tag=k).wait()
            ok.append(np.array_equal(into, pattern(n, k)))
        dist.recv(again, 0).wait()
        if not again[0]:
            break
    dist.barrier()
    dist.destroy_process_group()
    return ok


def test_one_way_from_the_threshold_the_lane_sends_single_copies_and_the_sender_helps(run_ranks):
    count, rounds = 6, 5
    env = {"SHMDIST_RING_BYTES": str(8 * MiB), "SHMDIST_SPIN": str(1 << 30)}
    res = run_ranks(one_way_window, 2, count, rounds, env=env, timeout=120)
    counts, helped = res[0]
    assert res[1] == [True] * (count + 2) * len(counts)
    assert counts == [(count + 2, count + 1)] * len(counts)   # all the lane's; all but the first read in place
    assert helped, f"rank 0 copied no chunk of a read in {rounds} windows"


def blocking_loop(rank, world_size, init_method, n, count):
    """What a pipeline stage does: ``count`` blocking sends of ``n`` bytes, each
    waited for before the next (the same buffer, refilled), against blocking
    receives; then the sender's counters."""
    start(rank, world_size, init_method)
    buf = np.zeros(n, np.uint8)
    if rank == 0:
        sends0, acks0 = counters(1)
        for k in range(count):
            buf[:] = pattern(n, k)
            dist.send(buf, 1, tag=k).wait()
        res = counters(1)[0] - sends0, counters(1)[1] - acks0
        dist.barrier()
        dist.destroy_process_group()
        return res
    ok = []
    for k in range(count):
        dist.recv(buf, 0, tag=k).wait()
        ok.append(np.array_equal(buf, pattern(n, k)))
    dist.barrier()
    dist.destroy_process_group()
    return ok


@pytest.mark.parametrize("n", [ONE_WAY_SINGLE_MIN - 1, ONE_WAY_SINGLE_MIN, 2 * MiB])
def test_a_loop_of_blocking_sends_is_bit_exact_and_single_copies_from_the_threshold(run_ranks, n):
    count = 8
    res = run_ranks(blocking_loop, 2, n, count, timeout=90)
    assert res[1] == [True] * count
    lane, read = res[0]
    if n >= ONE_WAY_SINGLE_MIN:
        assert (lane, read) == (count, count)     # the lane's every one, each read in place
    else:
        assert read == 0 and lane >= 1      # through the ring (the engine's while it is full)

"""A sender times the two ways of a big one-way message to a local rank
(transport/ways.py): a single copy (the receiver reads the sender's memory)
or the ring, per destination and size class, and takes the faster.

What must hold: on made-up times the choice follows the faster way, leaves it
in a slow window and comes back; one message is timed at a time; a try of the
other way lasts several messages, whatever samples of home are still in
flight; a peer that is gone is forgotten. In real processes whose sender picks
a way at random for every message, every pattern (blocking loop, window of
isends, receives posted late, any source, tags out of order, torch tensors,
two senders to one receiver) is bit-exact and both ways are taken; a message
the ring cannot hold whole, or one sent while a receive from the destination
is pending, is never timed (single copies as before); a receiver never waits
for a sender that is busy elsewhere, whichever way it prefers; and
SHMDIST_P2P_CHOOSE=0 means single copies always. No timing decides a test."""
from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest

import shmdist as dist
from shmdist import _core
from shmdist.transport import ways

KiB, MiB = 1 << 10, 1 << 20


# ---------------------------------------------------------------- the timing, without processes

class Chan:
    """A ring's producer side: its tail and the receiver's stamp of the timed record."""

    def __init__(self):
        self.tail = 0
        self.want = 0
        self.stamp = None

    def consumed(self):
        return self.tail

    def time_until(self, end):
        self.want = end

    def read_at(self, end):
        return self.stamp if end == self.want and self.tail >= end else None


class Req:
    _done = False


class Sim:
    """One sender and a made-up receiver: every message is read ``cost(way)`` seconds after
    its post; the sender looks (poll) at once for a single copy (its send's wait sees the
    ack), 0.5 ms later for a ring copy (the receiver stamped the moment it read it)."""

    def __init__(self):
        self.t = 0.0
        self.chan = Chan()
        self.w = ways.Ways({1: self.chan}, complete_sent=lambda: None, clock=lambda: self.t)
        self.head = 0

    def send(self, nbytes, cost) -> bool:
        single = self.w.single(1, nbytes, False)
        req = Req() if single else None
        end = self.head + _core.record_bytes(16 if single else nbytes)
        self.head = end
        self.w.posted(1, single, req, end, nbytes, False)
        self.t += cost(single)
        if single:
            req._done = True
        self.chan.tail, self.chan.stamp = end, self.t
        if single:                # its wait looks as soon as the ack comes
            self.w.poll()
        self.t += 0.0005          # the sender's own work before it looks again (a ring copy's stamp says when)
        self.w.poll()
        return single


def test_size_classes():
    assert [ways.bit(False, n) for n in (128 * KiB, 256 * KiB - 1, 256 * KiB, MiB, 16 * MiB, 1 << 34)] == \
        [0, 0, 1, 3, 7, 7]
    assert ways.bit(True, 32 * KiB) == ways.CLASSES
    for n in [0, 1, 4095, 1 << 17, (1 << 17) - 1, 3 << 20, (1 << 63) + 5] + [1 << k for k in range(64)]:
        assert _core.lane_ways_class(n) == ways.bit(False, n), n     # the lane's own copy of the rule


def test_the_faster_way_is_taken_left_in_a_slow_window_and_taken_again():
    s = Sim()
    quiet = lambda single: 50e-6 if single else 30e-6       # the ring faster
    window = lambda single: 60e-6 if single else 300e-6     # the ring 10 x slower
    first = [s.send(MiB, quiet) for _ in range(60)]
    assert first[:3] == [True, False, False]                # home first, then the other way (a try of 8 MiB)
    assert first[20:].count(False) >= 38                    # then the ring
    slow = [s.send(MiB, window) for _ in range(60)]
    assert slow[:3] == [False] * 3                          # (its last three calls were fast)
    assert slow[30:].count(True) >= 28                      # single copies within a try or two
    again = [s.send(MiB, quiet) for _ in range(300)]        # 0.5 ms a message: tries within the gaps
    assert again[-100:].count(False) >= 80                  # the ring again, tries of 8 MiB aside


def test_one_message_is_timed_at_a_time_and_a_try_lasts_several():
    s = Sim()
    w = s.w
    reqs = []
    for _ in range(4):                                      # four in flight: only the first is timed
        r = Req()
        w.posted(1, True, r, 0, MiB, False)
        reqs.append(r)
    assert list(w.pending) == [1] and w.pending[1].req is reqs[0] and w.taken == [0, 4]
    s.t = 1e-4
    for r in reqs:
        r._done = True
    w.poll()
    assert not w.pending
    # not timed twice yet: the ring is tried, for TRY_BYTES of messages
    assert w.trying[(1, ways.bit(False, MiB))] == [0, min(ways.TRY_BYTES // MiB, ways.TRY_MOST)]
    assert not w.single(1, MiB, False)
    for k in range(ways.TRY_BYTES // MiB):
        w.posted(1, False, None, 10 ** 9, MiB, False)        # (never read: not timed again)
    assert (1, ways.bit(False, MiB)) not in w.trying and w.single(1, MiB, False)


def test_a_peer_that_is_gone_is_forgotten():
    s = Sim()
    s.w.posted(1, False, None, 10 ** 9, MiB, False)
    s.w.trying[(1, 3)] = [0, 5]
    s.w.forget(1)
    assert not s.w.pending and not s.w.trying
    s.w.poll()


# ---------------------------------------------------------------- real ranks, ways at random

SIZES = (128 * KiB, 128 * KiB + 5, 512 * KiB + 3, MiB, (2 * MiB) - 4096, 3 * MiB + 1)   # the last: over the ring


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def random_ways(rank, world_size, init_method, seed, torch_too):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    from shmdist.api import group
    engine = group._world.engine
    pick = random.Random(seed + rank)
    asked = []
    if engine.ways is not None:
        def single(dst, nbytes, both):
            way = pick.random() < 0.5
            asked.append(way)
            return way
        engine.ways.single = single
        engine.ways.shortcut = False         # (else the lane takes the home way itself while one is timed)
    bad = []
    receiver = world_size - 1
    senders = list(range(world_size - 1))
    rng = np.random.default_rng(seed)        # the same plan on every rank
    for i in range(60):
        how = int(rng.integers(0, 5))
        sizes = [int(SIZES[k]) for k in rng.integers(0, len(SIZES), 4)]
        if rank in senders:
            msgs = [pattern(n, i * 100 + k + 10 * rank) for k, n in enumerate(sizes)]
            if how == 0:                     # a loop of blocking sends
                for m in msgs:
                    dist.send(m, receiver).wait()
            elif how == 4 and torch_too:
                import torch
                for k, m in enumerate(msgs):
                    dist.send(torch.from_numpy(m), receiver, tag=k).wait()
            else:                            # a window, tags in order
                for r in [dist.isend(m, receiver, tag=k) for k, m in enumerate(msgs)]:
                    r.wait()
        if rank == receiver:
            for s in senders:
                want = [pattern(n, i * 100 + k + 10 * s) for k, n in enumerate(sizes)]
                got = [np.zeros(n, np.uint8) for n in sizes]
                if how == 0:
                    for g in got:
                        dist.recv(g, s).wait()
                elif how == 1:               # posted late: the messages wait in the ring or are drained
                    time.sleep(0.002)
                    for r in [dist.irecv(g, s, tag=k) for k, g in enumerate(got)]:
                        r.wait()
                elif how == 2:               # tags out of order
                    for r in [dist.irecv(got[k], s, tag=k) for k in (3, 1, 2, 0)]:
                        r.wait()
                elif how == 3 and len(senders) == 1:   # any source
                    for k, g in enumerate(got):
                        r = dist.irecv(g, None, tag=k)
                        r.wait()
                        if r.source != s:
                            bad.append((i, "source", r.source))
                elif how == 4 and torch_too:
                    import torch
                    tg = [torch.from_numpy(g) for g in got]
                    for k, t in enumerate(tg):
                        dist.recv(t, s, tag=k).wait()
                else:
                    for r in [dist.irecv(g, s, tag=k) for k, g in enumerate(got)]:
                        r.wait()
                for k, (g, w) in enumerate(zip(got, want)):
                    if not np.array_equal(g, w):
                        bad.append((i, how, s, k, len(g)))
        dist.barrier()
    taken = list(engine.ways.taken) if engine.ways is not None else None
    dist.destroy_process_group()
    return bad, taken, asked.count(True), asked.count(False)


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_pattern_is_bit_exact_whichever_way_each_message_takes(run_ranks, world_size):
    from test_collectives import HAVE_TORCH
    got = run_ranks(random_ways, world_size, 7 + world_size, HAVE_TORCH, timeout=180)
    for rank, (bad, taken, singles, rings) in enumerate(got):
        assert bad == [], rank
        if rank < world_size - 1:            # a sender: both ways taken, many times
            assert singles >= 30 and rings >= 30, (singles, rings)
            assert taken[0] >= 20 and taken[1] >= 20, taken


def never_timed(rank, world_size, init_method):
    """The sender's chooser wants the ring everywhere: a message over the ring's size and one
    sent while a receive from its destination is pending still go as single copies."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    from shmdist.api import group
    engine = group._world.engine
    engine.ways.single = lambda dst, nbytes, both: False
    engine.ways.shortcut = False
    peer = 1 - rank
    big = pattern(3 * MiB + 1, 5)                        # over the 2 MiB ring
    mid = pattern(MiB, 6)
    out = []
    if rank == 0:
        dist.send(big, 1).wait()
        r = dist.irecv(np.zeros(MiB, np.uint8), 1)       # a receive pending: both ways
        dist.send(mid, 1).wait()
        r.wait()
        dist.send(mid, 1).wait()                         # one way, fits: the ring
        out = list(engine.ways.taken)
    else:
        g = np.zeros_like(big)
        dist.recv(g, 0).wait()
        out.append(bool(np.array_equal(g, big)))
        dist.send(mid, 0).wait()
        for _ in range(2):
            g = np.zeros_like(mid)
            dist.recv(g, 0).wait()
            out.append(bool(np.array_equal(g, mid)))
    dist.destroy_process_group()
    return out


def test_over_the_ring_or_both_ways_a_message_is_not_timed(run_ranks):
    taken, got = run_ranks(never_timed, 2, timeout=60)
    assert got == [True, True, True]
    assert taken == [1, 0]      # only the last: one way and whole in the ring, through the ring


def busy_sender(rank, world_size, init_method, nbytes):
    """Rank 0 prefers the ring, posts its sends and computes: rank 1 gets them all meanwhile."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    from shmdist.api import group
    out = []
    if rank == 0:
        group._world.engine.ways.single = lambda dst, n, both: False
        group._world.engine.ways.shortcut = False
        reqs = [dist.isend(pattern(nbytes, k), 1, tag=k) for k in range(2)]
        time.sleep(1.5)                 # in no shmdist call
        for r in reqs:
            r.wait()
    else:
        t0 = time.monotonic()
        for k in range(2):
            into = np.zeros(nbytes, np.uint8)
            dist.recv(into, 0, tag=k).wait()
            out.append(bool(np.array_equal(into, pattern(nbytes, k))))
        out.append(time.monotonic() - t0 < 1.4)
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("nbytes", [512 * KiB, 6 * MiB + 7])
def test_a_receiver_never_waits_for_a_sender_busy_elsewhere(run_ranks, nbytes):
    """512 KiB: two fit the ring whole, written at the post; 6 MiB: single copies, read alone."""
    assert run_ranks(busy_sender, 2, nbytes, timeout=60)[1] == [True, True, True]


def choose_off(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    from shmdist.api import group
    engine = group._world.engine
    m = pattern(MiB, 1)
    for _ in range(20):
        if rank == 0:
            dist.send(m, 1).wait()
        else:
            g = np.zeros_like(m)
            dist.recv(g, 0).wait()
            assert np.array_equal(g, m)
    read = engine.single_by[1 - rank].out[1 - rank].acked() if rank == 0 else None
    dist.destroy_process_group()
    return engine.ways is None, read


def test_choose_off_means_single_copies_always(run_ranks, monkeypatch):
    monkeypatch.setenv("SHMDIST_P2P_CHOOSE", "0")
    got = run_ranks(choose_off, 2, timeout=60)
    assert got[0] == (True, 20) and got[1][0] is True

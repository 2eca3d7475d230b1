"""Two members choose, per size class, how a big broadcast or all_reduce
moves: single copies between their arrays or the arena's buffers
(comm/paths.py). The first member times both and writes the choice into a
word both read at the start of each call.

What must hold: the word's protocol gives both members the same way in
every call, whenever the second reads it, including phase counters that
wrap; the chooser takes the faster way, leaves it when it slows and comes
back, and does not flap between equals; in real processes whose first
member changes its mind at random on every call, with the second arriving
early or late, every call is bit-exact and both members' ways agree call by
call; calls the members disagree on raise on both even when their ways
differ; and with SHMDIST_PAIR_CHOOSE=0 the pair always takes single copies
(test_split_copy.py counts them)."""
from __future__ import annotations

import random
import time

import numpy as np
import pytest

import shmdist as dist
from shmdist.comm import paths

MiB = 1 << 20


# ---------------------------------------------------------------- the word, without processes

def test_size_classes():
    assert [paths.bit(0, n) for n in (MiB, 2 * MiB - 1, 2 * MiB, 4 * MiB + 3, 64 * MiB, 1 << 40)] == \
        [0, 0, 1, 2, 6, 7]
    assert paths.bit(1, MiB) == paths.CLASSES and paths.bit(1, 1 << 33) == 2 * paths.CLASSES - 1
    assert paths.mask_at(paths.INITIAL, 0) == paths.EVERY_CLASS == paths.mask_at(paths.INITIAL, 12345)


@pytest.mark.parametrize("start", [0, 7, (1 << 31) - 3, (1 << 32) - 2, (1 << 33) + 5, (1 << 40) - 1])
def test_a_write_between_calls_changes_no_member_s_way_for_the_call_at_that_phase(start):
    """Member 0 writes at the phase its last call ended at (P), "from P + 1": a member reading
    at P before the write and one reading after it get the same masks; every later phase gets
    the new ones, long after the write and across the 32-bit wrap of the phase."""
    rng = random.Random(start)
    word, phase = paths.INITIAL, start
    for _ in range(2000):
        phase += rng.choice((1, 1, 2, 3, 40))            # the call that just ended passed this many phases
        now = paths.mask_at(word, phase)
        new = now ^ (1 << rng.randrange(2 * paths.CLASSES))
        written = paths.pack(phase + 1, new, now)
        assert paths.mask_at(written, phase) == now       # the second member, after the write
        for later in (1, 2, 17, 1 << 20, (1 << 31) - 1):
            assert paths.mask_at(written, phase + later) == new
        word = written


# ---------------------------------------------------------------- the chooser, on made-up times

class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def drive(chooser, clock, cost, calls, cls=0, step=0.002, first=(1, 1)):
    """Run ``calls`` calls of one class, each costing cost(way) seconds per MiB, as the
    word takes the chooser's answers: from the second call after (``first``: the ways of
    the first two); returns the ways taken and the next two."""
    coming, ways = list(first), []
    for _ in range(calls):
        clock.t += step
        way = coming.pop(0)
        ways.append(way)
        coming.append(int(chooser.record(cls, bool(way), cost(way), MiB)))
    return ways, tuple(coming)


def test_the_chooser_times_both_takes_the_faster_leaves_it_when_slow_and_comes_back():
    clock = Clock()
    c = paths.Chooser(clock)
    quiet = lambda way: 150e-6 if way else 100e-6         # arena faster (this VM, quiet)
    ways, nxt = drive(c, clock, quiet, 200)
    assert ways[:4] == [1, 1, 0, 0]                         # each way timed twice first
    tail = ways[20:]
    assert tail.count(0) >= 0.9 * len(tail) and tail.count(1) >= 2    # home: the arena; single copies tried
    window = lambda way: 150e-6 if way else 600e-6        # the arena 6 x slower (a slow window)
    ways, nxt = drive(c, clock, window, 200, first=nxt)
    assert ways[:6].count(0) <= 4 and ways[6:].count(0) <= 0.1 * len(ways[6:])
    ways, nxt = drive(c, clock, quiet, 200, first=nxt)     # the window ends
    back = ways.index(0) if 0 in ways else len(ways)
    assert back * 0.002 <= c.EXPLORE_S + 0.01 and ways[back:].count(0) >= 0.9 * len(ways[back:])


def test_the_other_way_is_tried_soon_then_ever_more_rarely_down_to_once_per_explore_period():
    clock = Clock()
    c = paths.Chooser(clock)
    ways, _ = drive(c, clock, lambda way: 100e-6 if way else 900e-6, 2000, step=0.0005)
    tries = [i for i, w in enumerate(ways) if w == 0][2:]       # after the first two of the arena
    gaps = np.diff(tries) * 0.0005
    assert tries[0] <= 4 + c.EXPLORE_CALLS + 2                   # the first try soon
    assert all(b >= a - 1e-9 for a, b in zip(gaps, gaps[1:]))    # then ever rarer
    assert len(tries) >= 10 and gaps[-4:].min() >= c.EXPLORE_S - 1e-9
    assert len(tries) <= 8 + 2000 * 0.0005 / c.EXPLORE_S + 1


def test_a_first_impression_is_corrected_within_tens_of_calls():
    """The first calls of a job are slow for either way; the arena's happen to be the
    slowest (its first two), then it is the faster for good."""
    clock = Clock()
    c = paths.Chooser(clock)
    seen = {0: 0}

    def cost(way):
        if way:
            return 150e-6
        seen[0] += 1
        return 800e-6 if seen[0] <= 2 else 100e-6
    ways, _ = drive(c, clock, cost, 200, step=0.0002)
    assert ways[:4] == [1, 1, 0, 0] and ways[40:].count(0) >= 0.9 * 160, ways[:40]


def test_two_ways_within_the_margin_never_flap():
    clock = Clock()
    c = paths.Chooser(clock)
    rng = random.Random(1)
    ways, _ = drive(c, clock, lambda way: (100e-6 if way else 92e-6) * rng.uniform(1, 1.05), 3000)
    switches = sum(a != b for a, b in zip(ways[20:], ways[21:]))
    explores = 3000 * 0.002 / c.EXPLORE_S
    assert switches <= 2 * explores + 2           # each try out and back; no run of switching


def test_classes_are_timed_apart():
    clock = Clock()
    c = paths.Chooser(clock)
    a, _ = drive(c, clock, lambda way: 150e-6 if way else 100e-6, 100, cls=0)
    b, _ = drive(c, clock, lambda way: 100e-6 if way else 150e-6, 100, cls=paths.bit(1, 16 * MiB))
    assert a[40:].count(0) > 50 and b[40:].count(1) > 50


# ---------------------------------------------------------------- two real members

class Erratic:
    """A chooser that asks for a random way after every call (rank 0's, in place of timing)."""

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def record(self, cls, single, seconds, nbytes):
        return self.rng.random() < 0.5


def log_ways(comm) -> list:
    """Record the way the group's _splits gives each call it is asked about."""
    seen, real = [], comm._splits

    def logged(nbytes, kind):
        way = real(nbytes, kind)
        seen.append((kind, nbytes, way))
        return way
    comm._splits = logged
    return seen


SIZES = (MiB, MiB + 4096 * 3 + 8, 2 * MiB + 4, 4 * MiB + 12)   # classes 0, 0, 1, 2


def erratic(rank, world_size, init_method, calls, seed, torch_too):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    from shmdist.api import group
    comm = group._world.default.coll
    if rank == 0:
        assert isinstance(comm.chooser, paths.Chooser)
        comm.chooser = Erratic(seed)
    ways = log_ways(comm)
    rng = np.random.default_rng(seed)           # the same calls on both ranks
    late = random.Random(seed * 7 + rank)       # but each rank late in its own way
    bad = []
    for i in range(calls):
        what = rng.integers(0, 6)
        nbytes = int(SIZES[rng.integers(0, len(SIZES))])
        data = [rng.standard_normal(nbytes // 4).astype(np.float32) for _ in range(2)]
        if late.random() < 0.3:
            time.sleep(late.random() * 0.002)
        if what == 0:                            # broadcast from either member
            root = int(rng.integers(0, 2))
            b = data[0].copy() if rank == root else np.zeros_like(data[0])
            dist.broadcast(b, src=root)
            ok = np.array_equal(b, data[0])
        elif what == 1:                          # int32 and float64 all_reduce
            x = (data[rank] * 1000).astype(np.int32)
            dist.all_reduce(x)
            ok = np.array_equal(x, (data[0] * 1000).astype(np.int32) + (data[1] * 1000).astype(np.int32))
        elif what == 2:
            x = data[rank][: nbytes // 8].astype(np.float64)
            dist.all_reduce(x)
            ok = np.array_equal(x, data[0][: nbytes // 8].astype(np.float64) + data[1][: nbytes // 8])
        elif what == 3 and torch_too:            # bfloat16 through torch: added in float32, rounded once
            import torch
            t = torch.from_numpy(data[rank]).to(torch.bfloat16)
            want = (torch.from_numpy(data[0]).to(torch.bfloat16).float()
                    + torch.from_numpy(data[1]).to(torch.bfloat16).float()).to(torch.bfloat16)
            dist.all_reduce(t)
            ok = torch.equal(t, want)
        elif what == 4:                          # small calls between: phases move, no way to choose
            x = np.full(16, rank + 1.0, np.float32)
            dist.all_reduce(x)
            ok = bool(np.all(x == 3.0))
        else:                                    # float32 SUM, the common one
            x = data[rank].copy()
            dist.all_reduce(x)
            ok = np.array_equal(x, data[0] + data[1])
        if not ok:
            bad.append((i, int(what), nbytes))
    dist.destroy_process_group()
    return bad, ways


def test_both_members_take_the_same_way_in_every_call_while_the_first_changes_its_mind(run_ranks):
    from test_collectives import HAVE_TORCH
    (bad0, ways0), (bad1, ways1) = run_ranks(erratic, 2, 150, 11, HAVE_TORCH, timeout=150)
    assert bad0 == [] and bad1 == []
    assert ways0 == ways1
    taken = [w for _, n, w in ways0 if n >= MiB]
    assert taken.count(True) >= 20 and taken.count(False) >= 20, taken


class Scripted:
    """Rank 0's chooser with made-up times: the arena fast, then slow (calls
    ``slow_from`` to ``slow_to``), then fast again; the clock advances 10 ms per call."""

    def __init__(self, slow_from, slow_to):
        self.clock_t = 0.0
        self.calls = 0
        self.slow = range(slow_from, slow_to)
        self.real = paths.Chooser(lambda: self.clock_t)

    def record(self, cls, single, seconds, nbytes):
        self.calls += 1
        self.clock_t += 0.01
        arena = 600e-6 if self.calls in self.slow else 100e-6
        return self.real.record(cls, single, 150e-6 if single else arena, nbytes)


def scripted(rank, world_size, init_method, calls, slow_from, slow_to):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    from shmdist.api import group
    comm = group._world.default.coll
    if rank == 0:
        comm.chooser = Scripted(slow_from, slow_to)
    ways = log_ways(comm)
    x = np.ones(MiB // 4, np.float32)
    for _ in range(calls):
        x[:] = rank + 1
        dist.all_reduce(x)
        assert np.all(x == 3)
    dist.destroy_process_group()
    return [w for _, _, w in ways]


def test_both_members_follow_the_first_one_s_timing(run_ranks):
    """Fast arena: both take it; a slow window: both take single copies within a few
    calls; it ends: both go back within one explore period (5 calls here)."""
    ways0, ways1 = run_ranks(scripted, 2, 120, 40, 80, timeout=90)
    assert ways0 == ways1 and len(ways0) == 120
    assert ways0[:4] == [True, True, False, False]
    assert ways0[10:40].count(False) >= 26
    assert ways0[45:80].count(True) >= 31
    assert ways0[90:].count(False) >= 26


def disagreeing(rank, world_size, init_method, seed):
    """The ranks' all_reduce sizes differ, in different classes, so their ways may differ
    too: both must raise the mismatch, then go on together."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    from shmdist.api import group
    comm = group._world.default.coll
    if rank == 0:
        comm.chooser = Erratic(seed)
    said = []
    for i in range(8):
        x = np.ones((MiB if rank == 0 or i % 2 else 2 * MiB) // 4, np.float32)
        try:
            dist.all_reduce(x)
            said.append("ok" if np.all(x == 2) else "wrong")
        except dist.DistMismatchError as e:
            said.append("mismatch" if f"rank {rank}: all_reduce" in str(e) else str(e))
    dist.destroy_process_group()
    return said


def test_calls_the_members_disagree_on_raise_on_both_whatever_their_ways(run_ranks):
    said0, said1 = run_ranks(disagreeing, 2, 5, timeout=90)
    assert said0 == said1 == ["mismatch", "ok"] * 4

"""Attacks on the sender's choice of way for big one-way messages
(transport/ways.py, the fast lane's Lane._single/send, Engine.send): what a
sceptic tries against README's promise ("Which way, one way: timed").

Whatever the sender picks, every receive gets exactly the bytes sent, in
order per (source, tag), an any-source receive names the right source,
errors are named, never a hang or wrong data; a message bigger than the ring
or sent while a receive from its destination is pending is never timed; a
receiver never waits for a sender busy elsewhere; SHMDIST_P2P_CHOOSE=0 means
single copies wherever the old rule allows. The choice is forced in the ranks
(``engine.ways.single``, ``engine.ways.shortcut = False``), as in
tests/test_p2p_ways.py. No timing decides a test: "busy elsewhere" is a
sender in no shmdist call until the receiver says it got everything."""
from __future__ import annotations

import os
import random
import signal
import threading
import time

import numpy as np
import pytest

import shmdist as dist
from shmdist import _core

KiB, MiB = 1 << 10, 1 << 20
RING = 2 * MiB                          # the ring with <= 4 local ranks (transport/shm.py)
MIN = 128 * KiB                         # ONE_WAY_SINGLE_MIN
WHOLE = max(n for n in range(RING - 4096, RING + 1) if _core.record_bytes(n) <= RING)   # the biggest the ring holds whole
EDGES = (MIN - 1, MIN, MIN + 1, WHOLE - 1, WHOLE, WHOLE + 1)


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def stamped(nbytes: int, src: int, seq: int) -> np.ndarray:
    """A message that says who sent it and which it is (first 16 bytes)."""
    m = pattern(nbytes, src * 100003 + seq)
    m[:16] = np.frombuffer(np.array([src, seq], dtype=np.int64).tobytes(), np.uint8)
    return m


def who(m: np.ndarray) -> tuple:
    src, seq = np.frombuffer(m[:16].tobytes(), np.int64)
    return int(src), int(seq)


def start(rank, world_size, init_method, timeout=60):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=timeout)
    from shmdist.api import group
    return group._world.engine


def force(engine, fn):
    """The sender's choice made by ``fn(dst, nbytes, both)``; every question is kept."""
    asked = []
    if engine.ways is None:
        return asked

    def single(dst, nbytes, both):
        way = bool(fn(dst, nbytes, both))
        asked.append((dst, nbytes, both, way))
        return way
    engine.ways.single = single
    engine.ways.shortcut = False
    return asked


def flipper():
    state = [False]

    def fn(dst, nbytes, both):
        state[0] = not state[0]
        return state[0]
    return fn


def outcome(req, into, want, timeout=15.0):
    """'exact', 'wrong ...', or the error's type and text."""
    try:
        req.wait(timeout=timeout)
    except dist.DistError as e:
        return f"{type(e).__name__}: {e}"
    return "exact" if np.array_equal(into, want) else f"wrong data ({int((into != want).sum())} bytes differ)"


def wait_file(path, limit=30.0):
    end = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


# ---------------------------------------------------------------- a sender flipping way every message

def flip_windows(rank, world_size, init_method, seed):
    """Rank 0 flips the way at every message; sizes around 128 KiB and the ring-whole edge,
    non-contiguous arrays both sides; rank 1 posts its windows late, tags shuffled."""
    engine = start(rank, world_size, init_method)
    asked = force(engine, flipper()) if rank == 0 else []
    rng = random.Random(seed)
    sizes = list(EDGES) + [512 * KiB + 3, MiB, 256 * KiB]
    bad, seq = [], 0
    for rnd in range(14):
        how = rnd % 4
        plan = [rng.choice(sizes) for _ in range(4)]
        msgs = []
        for k, n in enumerate(plan):
            msgs.append(stamped(n, 0, seq))
            seq += 1
        if rank == 0:
            if how == 0:                          # blocking
                for k, m in enumerate(msgs):
                    dist.send(m, 1, tag=k).wait()
            elif how == 3:                        # non-contiguous: every other byte of twice as much
                reqs = []
                for k, m in enumerate(msgs):
                    big = np.zeros(2 * m.size, np.uint8)
                    big[::2] = m
                    reqs.append((dist.isend(big[::2], 1, tag=k), big))
                for r, _ in reqs:
                    r.wait()
            else:                                 # a window
                for r in [dist.isend(m, 1, tag=k) for k, m in enumerate(msgs)]:
                    r.wait()
        else:
            if how == 1:
                time.sleep(0.003)                 # late: the messages wait in the ring or are drained
            order = list(range(4))
            if how != 0:
                rng2 = random.Random(rnd)
                rng2.shuffle(order)
            if how == 3:                          # into non-contiguous views
                bigs = {k: np.zeros(2 * len(msgs[k]), np.uint8) for k in order}
                reqs = [(k, dist.irecv(bigs[k][1::2], 0, tag=k)) for k in order]
                for k, r in reqs:
                    r.wait(timeout=30)
                    if not np.array_equal(bigs[k][1::2], msgs[k]) or bigs[k][::2].any():
                        bad.append((rnd, how, k, len(msgs[k])))
            else:
                got = {k: np.zeros(len(msgs[k]), np.uint8) for k in order}
                if how == 0:
                    for k in range(4):
                        dist.recv(got[k], 0, tag=k).wait(timeout=30)
                else:
                    for r in [dist.irecv(got[k], 0, tag=k) for k in order]:
                        r.wait(timeout=30)
                for k in order:
                    if not np.array_equal(got[k], msgs[k]):
                        bad.append((rnd, how, k, len(msgs[k]), who(got[k])))
        dist.barrier()
    taken = list(engine.ways.taken) if engine.ways is not None else None
    dist.destroy_process_group()
    return bad, taken, [n for _, n, _, _ in asked], [w for *_, w in asked]


def test_a_sender_flipping_way_every_message_windows_posted_late(run_ranks):
    (bad0, taken, sizes, ways_), (bad1, _, _, _) = run_ranks(flip_windows, 2, 3, timeout=120)
    assert bad0 == [] and bad1 == []
    assert all(MIN <= n <= WHOLE for n in sizes), sorted(set(sizes))     # never asked outside the range
    assert ways_.count(True) >= 5 and ways_.count(False) >= 5
    assert taken[0] >= 3 and taken[1] >= 3, taken


# ---------------------------------------------------------------- never timed: over the ring, both ways

def never_asked(rank, world_size, init_method):
    """Rank 0's chooser wants the ring and notes every question: messages of WHOLE + 1 and
    3 MiB (over the ring) go many times, blocking and windowed, so that the fast lane takes
    them too; then 1 MiB ones while a receive from rank 1 is pending. None may be timed."""
    engine = start(rank, world_size, init_method)
    asked = force(engine, lambda d, n, b: False) if rank == 0 else []
    timed = note_posted(engine) if rank == 0 else []
    sizes = [WHOLE + 1, 3 * MiB + 1, MIN - 1] * 4
    out = []
    dist.barrier()
    if rank == 0:
        for i, n in enumerate(sizes):
            dist.send(stamped(n, 0, i), 1).wait()
        for r in [dist.isend(stamped(n, 0, 100 + i), 1, tag=1) for i, n in enumerate(sizes)]:
            r.wait()
        before = list(engine.ways.taken)
        for i in range(6):                    # both ways: a receive from 1 pending at each send
            r = dist.irecv(np.zeros(MiB, np.uint8), 1, tag=2)
            dist.send(stamped(MiB, 0, 200 + i), 1, tag=2).wait()
            r.wait()
        out = [before, list(engine.ways.taken), sorted(set(timed))]
    else:
        for i, n in enumerate(sizes):
            g = np.zeros(n, np.uint8)
            dist.recv(g, 0).wait(timeout=30)
            out.append(np.array_equal(g, stamped(n, 0, i)))
        gs = [np.zeros(n, np.uint8) for n in sizes]
        time.sleep(0.01)
        for r in [dist.irecv(g, 0, tag=1) for g in gs]:
            r.wait(timeout=30)
        out += [np.array_equal(g, stamped(n, 0, 100 + i)) for i, (g, n) in enumerate(zip(gs, sizes))]
        for i in range(6):
            g = np.zeros(MiB, np.uint8)
            r = dist.irecv(g, 0, tag=2)
            dist.send(stamped(MiB, 1, i), 0, tag=2).wait()
            r.wait(timeout=30)
            out.append(np.array_equal(g, stamped(MiB, 0, 200 + i)))
    dist.destroy_process_group()
    return out, asked


def test_over_the_ring_and_both_ways_never_timed_even_through_the_fast_lane(run_ranks):
    (info, asked), (exact, _) = run_ranks(never_asked, 2, timeout=90)
    assert all(exact), exact
    before, after, timed = info
    assert asked == [], asked
    # what went to the timing (nbytes, single, both): nothing of these
    assert timed == [], f"handed to the timing (ways.posted), taken {before} then {after}: {timed}"
    assert before == after == [0, 0]


# ---------------------------------------------------------------- the ring-whole edge, each way forced

def note_posted(engine) -> list:
    """Every message handed to the timing (ways.posted), as (nbytes, single, both)."""
    timed = []
    posted = engine.ways.posted

    def note(dst, single, req, end, nbytes, both):
        timed.append((nbytes, single, both))
        return posted(dst, single, req, end, nbytes, both)
    engine.ways.posted = note
    return timed


def edges(rank, world_size, init_method, way):
    engine = start(rank, world_size, init_method)
    asked = force(engine, lambda d, n, b: way) if rank == 0 else []
    timed = note_posted(engine) if rank == 0 else []
    out = []
    dist.barrier()
    for rnd in range(2):
        if rank == 0:
            if rnd == 0:
                for i, n in enumerate(EDGES):
                    dist.send(stamped(n, 0, i), 1, tag=i).wait()
            else:                              # two whole-ring records at once: the second queued
                reqs = [dist.isend(stamped(n, 0, 10 + i), 1, tag=i % len(EDGES)) for i, n in enumerate(EDGES + EDGES)]
                for r in reqs:
                    r.wait()
        else:
            sizes = EDGES if rnd == 0 else EDGES + EDGES
            time.sleep(0.005)
            gs = [np.zeros(n, np.uint8) for n in sizes]
            reqs = [dist.irecv(g, 0, tag=i % len(EDGES)) for i, g in enumerate(gs)]
            for r, g, i in zip(reqs, gs, range(len(sizes))):
                out.append((len(g), outcome(r, g, stamped(len(g), 0, (10 if rnd else 0) + i), 30)))
        dist.barrier()
    dist.destroy_process_group()
    return out, sorted({n for _, n, _, _ in asked}), sorted(set(timed))


@pytest.mark.parametrize("way", [True, False], ids=["single", "ring"])
def test_the_ring_whole_edge_and_128_KiB_each_way(run_ranks, way):
    """(Messages over the ring handed to the timing are the next test's: only those that
    may go either way are looked at here.)"""
    (_, sizes, timed), (got, _, _) = run_ranks(edges, 2, way, timeout=90)
    assert [o for _, o in got] == ["exact"] * len(got), got
    assert set(sizes) <= {MIN, MIN + 1, WHOLE - 1, WHOLE}, sizes
    assert {MIN, WHOLE} <= set(sizes), sizes      # the edge itself may go either way
    either = [t for t in timed if t[0] <= WHOLE]
    # the ring only where the record fits whole at the post: a bigger one that could go either way
    # went as an untimed single copy (the previous ring copy not read yet), never partly
    assert {n for n, _, _ in either} <= {MIN, MIN + 1, WHOLE - 1, WHOLE} and MIN in {n for n, _, _ in either}, timed
    assert all(single == way and not both for _, single, both in either), timed


# ---------------------------------------------------------------- any source, three senders flipping

def any_source_equal(rank, world_size, init_method, seed):
    """Ranks 0..n-2 each pick a way at random per message, tags 0 1 0 1; the last rank takes
    them with any-source receives (windows, sometimes late) and checks source, bytes and the
    order per (source, tag). Every message of a round is the same size (any-source receives
    must fit whichever sender's message comes)."""
    engine = start(rank, world_size, init_method, timeout=90)
    pick = random.Random(seed * 10 + rank)
    senders = range(world_size - 1)
    me_recv = world_size - 1
    if rank != me_recv:
        force(engine, lambda d, n, b: pick.random() < 0.5)
    sizes = (MIN, 300 * KiB + 7, WHOLE, 700 * KiB, MIN - 1)
    bad = []
    seen = {}
    for rnd in range(8):
        n = sizes[rnd % len(sizes)]
        k = 4                                  # messages per sender per round, tags 0 1 0 1
        if rank != me_recv:
            reqs = [dist.isend(stamped(n, rank, rnd * k + i), me_recv, tag=i % 2) for i in range(k)]
            for r in reqs:
                r.wait()
        else:
            if rnd % 2:
                time.sleep(0.005)
            gs = [np.zeros(n, np.uint8) for _ in range(k * len(senders))]
            reqs = [dist.irecv(g, None, tag=i % 2) for i, g in enumerate(gs)]
            for r, g in zip(reqs, gs):
                try:
                    r.wait(timeout=30)
                except dist.DistError as e:
                    bad.append(("error", str(e)))
                    continue
                src, seq = who(g)
                if r.source != src or src not in senders:
                    bad.append(("source", r.source, src))
                    continue
                if not np.array_equal(g, stamped(n, src, seq)):
                    bad.append(("bytes", rnd, src, seq))
                key = (src, seq % 2)
                if seen.get(key, -1) >= seq:
                    bad.append(("order", key, seen[key], seq))
                seen[key] = seq
        dist.barrier()
    taken = list(engine.ways.taken) if engine.ways is not None else None
    dist.destroy_process_group()
    return bad, taken, seen if rank == me_recv else None


@pytest.mark.parametrize("world_size", [3, 4])
def test_any_source_from_senders_flipping_independently(run_ranks, world_size):
    got = run_ranks(any_source_equal, world_size, 5, timeout=150)
    bad, _, seen = got[-1]
    assert bad == []
    assert len(seen) == 2 * (world_size - 1)
    for rank in range(world_size - 1):
        assert got[rank][0] == [] and sum(got[rank][1]) >= 6, got[rank][1]


# ---------------------------------------------------------------- reusing and aliasing buffers

def reuse(rank, world_size, init_method):
    """Rank 0 sends one buffer, waits, overwrites it at once, sends it again ... (flipping
    way, blocking and windowed); rank 1 posts late: it must get each version, not a later one."""
    engine = start(rank, world_size, init_method)
    if rank == 0:
        force(engine, flipper())
    n = 640 * KiB + 9
    bad = []
    buf = np.zeros(n, np.uint8)
    for rnd in range(10):
        if rank == 0:
            if rnd % 2 == 0:
                for i in range(4):
                    buf[:] = stamped(n, 0, rnd * 4 + i)
                    dist.send(buf, 1, tag=i).wait()
                buf[:] = 0xEE                          # after the last wait: ours again
            else:
                bufs = [stamped(n, 0, rnd * 4 + i) for i in range(4)]
                reqs = [dist.isend(b, 1, tag=i) for i, b in enumerate(bufs)]
                for r, b in zip(reqs, bufs):
                    r.wait()
                    b[:] = 0xDD
        else:
            time.sleep(0.004 if rnd % 3 == 0 else 0)
            gs = [np.zeros(n, np.uint8) for _ in range(4)]
            reqs = [dist.irecv(g, 0, tag=i) for i, g in enumerate(gs)]
            for i, (r, g) in enumerate(zip(reqs, gs)):
                o = outcome(r, g, stamped(n, 0, rnd * 4 + i), 30)
                if o != "exact":
                    bad.append((rnd, i, o, who(g), np.unique(g[16:])[:3].tolist()))
        dist.barrier()
    dist.destroy_process_group()
    return bad


def test_a_buffer_overwritten_right_after_wait_is_not_what_arrives(run_ranks):
    assert run_ranks(reuse, 2, timeout=90) == [[], []]


def aliasing(rank, world_size, init_method, variant):
    """Rank 0 sends buffer X to rank 1 (its chooser always wants the single copy) while a
    receive into X is pending (from rank 2, ``other``; from rank 1 itself, ``same``), or
    posts that receive after the send (``send_first``). Rank 1 must get X as it was when sent."""
    engine = start(rank, world_size, init_method)
    n = 768 * KiB
    x0, y = stamped(n, 0, 1), stamped(n, 2, 2)
    out = None
    if rank == 0:
        force(engine, lambda d, nb, b: True)
        x = x0.copy()
        ysrc = 1 if variant == "same" else 2
        if variant == "send_first":
            s = dist.isend(x, 1)
            r = dist.irecv(x, ysrc)           # waits for rank 1's read of x first (a single copy)
        else:
            r = dist.irecv(x, ysrc)
            s = dist.isend(x, 1)
        dist.barrier()
        r.wait(timeout=30)
        dist.barrier()
        s.wait(timeout=30)
        out = np.array_equal(x, y)
    elif rank == 1:
        if variant == "send_first":
            g = np.zeros(n, np.uint8)
            dist.recv(g, 0).wait(timeout=30)
            dist.barrier()
            dist.barrier()
        else:
            dist.barrier()
            if variant == "same":
                dist.send(y, 0).wait()
            dist.barrier()                    # rank 0's receive wrote y into x
            g = np.zeros(n, np.uint8)
            dist.recv(g, 0).wait(timeout=30)
        out = "exact" if np.array_equal(g, x0) else ("got the later bytes" if np.array_equal(g, y) else "wrong")
    else:
        dist.barrier()
        if variant != "same":
            dist.send(y, 0).wait()
        dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("variant", ["other", "same", "send_first"])
def test_sending_the_buffer_a_pending_receive_writes(run_ranks, variant):
    got = run_ranks(aliasing, 3, variant, timeout=90)
    assert got[0] is True and got[1] == "exact", got


# ---------------------------------------------------------------- torch tensors

def raw(t) -> bytes:
    import torch
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def torch_ways(rank, world_size, init_method):
    import torch
    engine = start(rank, world_size, init_method)
    if rank == 0:
        force(engine, flipper())
    bad = []
    for rnd in range(6):
        base = torch.from_numpy(stamped(2 * MiB - 4096, 0, rnd).view(np.float32).copy())
        msgs = [base[: (MIN // 4)].clone(),                            # 128 KiB float32
                base.view(512, -1)[:, :256].t(),                       # non-contiguous 512 KiB
                base.view(torch.bfloat16)[: (WHOLE // 2)],             # the ring-whole edge, bfloat16
                base[: (300 * KiB) // 4].view(torch.int32)]
        if rank == 0:
            if rnd % 2:
                for k, m in enumerate(msgs):
                    dist.send(m, 1, tag=k).wait()
            else:
                for r in [dist.isend(m, 1, tag=k) for k, m in enumerate(msgs)]:
                    r.wait()
        else:
            got = [torch.zeros_like(m.contiguous()) for m in msgs]
            got[1] = torch.zeros(msgs[1].shape[1], msgs[1].shape[0], dtype=msgs[1].dtype).t()  # non-contiguous too
            time.sleep(0.003 if rnd % 3 == 0 else 0)
            for r in [dist.irecv(g, 0, tag=k) for k, g in enumerate(got)]:
                r.wait(timeout=30)
            for k, (g, m) in enumerate(zip(got, msgs)):
                if g.shape != m.shape or raw(g) != raw(m):      # (bytes: random floats hold NaNs)
                    bad.append((rnd, k))
        dist.barrier()
    taken = list(engine.ways.taken)
    dist.destroy_process_group()
    return bad, taken


def test_torch_tensors_whichever_way(run_ranks):
    pytest.importorskip("torch")
    (bad0, taken), (bad1, _) = run_ranks(torch_ways, 2, timeout=120)
    assert bad0 == [] and bad1 == []
    assert taken[0] >= 2 and taken[1] >= 2, taken


# ---------------------------------------------------------------- a sender that dies or leaves

def killed_sender(rank, world_size, init_method, how, flag):
    """Rank 1 waits in its receives; rank 0 posts a timed ring copy, a single copy, a
    ring copy that does not fit beside them, another single copy, then dies at once."""
    engine = start(rank, world_size, init_method, timeout=60)
    plan = [(512 * KiB, False), (512 * KiB + 1, True), (MiB + 3, False), (MIN, True)]
    if rank == 0:
        ways_ = iter([w for _, w in plan])
        force(engine, lambda d, n, b: next(ways_))
        wait_file(flag)                       # rank 1 is waiting
        time.sleep(0.05)
        msgs = [stamped(n, 0, i) for i, (n, _) in enumerate(plan)]
        reqs = [dist.isend(m, 1, tag=i) for i, m in enumerate(msgs)]   # noqa: F841
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    gs = [np.zeros(n, np.uint8) for n, _ in plan]
    reqs = [dist.irecv(g, 0, tag=i) for i, g in enumerate(gs)]
    with open(flag, "w") as f:
        f.write("waiting")
    out = []
    for i, (r, g) in enumerate(zip(reqs, gs)):
        t0 = time.monotonic()
        o = outcome(r, g, stamped(len(g), 0, i), timeout=20)
        out.append((o, time.monotonic() - t0 < 19))
    try:
        dist.destroy_process_group()
    except dist.DistError:
        pass
    return out


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_a_sender_that_dies_right_after_posting_both_ways(run_ranks, tmp_path, how):
    got = run_ranks(killed_sender, 2, how, str(tmp_path / "flag"), timeout=120, errors="return")
    assert not isinstance(got[1], Exception) and not hasattr(got[1], "traceback"), got[1]
    for o, in_time in got[1]:
        assert o == "exact" or (o.startswith("DistPeerError") and "rank 0" in o), got[1]
        assert "Timeout" not in o, got[1]


def left_sender(rank, world_size, init_method, flag):
    """Rank 0 posts a timed ring copy, a single copy, a ring copy and a message over the
    ring, then destroys its group at once and stays alive; rank 1 receives after that."""
    engine = start(rank, world_size, init_method, timeout=60)
    plan = [(512 * KiB, False), (512 * KiB + 1, True), (300 * KiB, False), (3 * MiB, True)]
    if rank == 0:
        ways_ = iter([w for _, w in plan if _ <= WHOLE])
        force(engine, lambda d, n, b: next(ways_))
        dist.barrier()
        msgs = [stamped(n, 0, i) for i, (n, _) in enumerate(plan)]
        reqs = [dist.isend(m, 1, tag=i) for i, m in enumerate(msgs)]
        dist.destroy_process_group()
        fates = []
        for r, m in zip(reqs, msgs):
            try:
                r.wait()
                fates.append("done")
            except dist.DistError as e:
                fates.append(str(e))
            m[:] = 7                           # ours again either way
        with open(flag, "w") as f:
            f.write("left")
        time.sleep(2)
        return fates
    dist.barrier()
    wait_file(flag)
    out = []
    for i, (n, _) in enumerate(plan):
        g = np.zeros(n, np.uint8)
        out.append(outcome(dist.irecv(g, 0, tag=i), g, stamped(n, 0, i), timeout=20))
    try:
        dist.destroy_process_group()
    except dist.DistError:
        pass
    return out


def test_destroy_with_timed_messages_pending(run_ranks, tmp_path):
    fates, got = run_ranks(left_sender, 2, str(tmp_path / "flag"), timeout=90)
    assert fates[0] == "done" and fates[2] == "done", fates        # ring copies went at the post
    for o in got:
        assert o == "exact" or (o.startswith("DistPeerError") and "rank 0" in o), got
    assert got[0] == "exact" and got[2] == "exact", got             # whole in the ring before the goodbye


# ---------------------------------------------------------------- a sender busy elsewhere

def busy(rank, world_size, init_method, nbytes, count, flag_posted, flag_got):
    """Rank 0 prefers the ring, posts ``count`` isends, then is in no shmdist call until
    rank 1 says it got them all (or 8 s passed). Rank 1 must get them meanwhile."""
    engine = start(rank, world_size, init_method, timeout=60)
    if rank == 0:
        force(engine, lambda d, n, b: False)
        dist.barrier()
        msgs = [stamped(nbytes, 0, i) for i in range(count)]
        reqs = [dist.isend(m, 1, tag=i) for i, m in enumerate(msgs)]
        open(flag_posted, "w").close()
        wait_file(flag_got, 8)                # busy elsewhere: no progress of its own
        for r in reqs:
            r.wait()
        dist.barrier()
        dist.destroy_process_group()
        return list(engine.ways.taken) if engine.ways is not None else None
    dist.barrier()
    wait_file(flag_posted)
    out = []
    for i in range(count):
        g = np.zeros(nbytes, np.uint8)
        out.append(outcome(dist.irecv(g, 0, tag=i), g, stamped(nbytes, 0, i), timeout=5))
    open(flag_got, "w").close()
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("nbytes,count", [(MiB, 3), (512 * KiB, 6), (WHOLE, 1)])
def test_a_receiver_never_waits_for_a_busy_sender_that_prefers_the_ring(run_ranks, tmp_path, nbytes, count):
    """Each message fits the ring whole, but not all at once: a ring copy goes only where it
    fits whole at the post, the others as single copies, so every one is read without the
    sender. (Found by this file: the ring was taken where only part fitted, and that part
    waited for the sender's next call.)"""
    taken, got = run_ranks(busy, 2, nbytes, count, str(tmp_path / "p"), str(tmp_path / "g"), timeout=90)
    assert got == ["exact"] * count, (taken, got)


def behind_a_full_ring(rank, world_size, init_method):
    """Rank 0 prefers the ring: a message that fills the ring whole, then another one, then
    1 s in no shmdist call, then its waits. The second's record may be queued behind the first
    until the sender's next call (README, "Which way, one way: timed"; whether it is depends on
    how much of the first the receiver had read when the second was posted): rank 1 gets the
    first while the sender is busy, and the second whole, then or after that call."""
    engine = start(rank, world_size, init_method, timeout=60)
    if rank == 0:
        force(engine, lambda d, n, b: False)
        dist.barrier()
        reqs = [dist.isend(stamped(WHOLE, 0, i), 1, tag=i) for i in range(2)]
        time.sleep(1.0)
        for r in reqs:
            r.wait()
        dist.barrier()
        dist.destroy_process_group()
        return None
    dist.barrier()
    out = []
    t0 = time.monotonic()
    for i in range(2):
        g = np.zeros(WHOLE, np.uint8)
        out.append(outcome(dist.irecv(g, 0, tag=i), g, stamped(WHOLE, 0, i), timeout=30))
        out.append(time.monotonic() - t0 < 0.9)
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_a_send_behind_a_ring_copy_that_filled_the_ring_arrives_by_the_sender_s_next_call(run_ranks):
    _, got = run_ranks(behind_a_full_ring, 2, timeout=60)
    assert got[:3] == ["exact", True, "exact"]


def test_control_the_same_busy_sender_with_choose_off(run_ranks, tmp_path, p2p_choose_off):
    """SHMDIST_P2P_CHOOSE=0: the same messages go as single copies, read without the sender."""
    for nbytes, count in [(MiB, 3), (WHOLE, 2)]:
        d = tmp_path / str(nbytes)
        d.mkdir()
        taken, got = run_ranks(busy, 2, nbytes, count, str(d / "p"), str(d / "g"), timeout=60)
        assert taken is None and got == ["exact"] * count, got


# ---------------------------------------------------------------- threads

def threaded(rank, world_size, init_method):
    """Two threads per rank, one tag each: rank 0's send with the way flipping (one chooser,
    both threads), rank 1's receive, windows of two."""
    engine = start(rank, world_size, init_method)
    if rank == 0:
        force(engine, flipper())
    bad = []
    sizes = (MIN, 400 * KiB + 1, WHOLE, MIN - 1)

    def worker(tag):
        for i in range(12):
            n = sizes[(i + tag) % len(sizes)]
            seq = tag * 1000 + i
            if rank == 0:
                a, b = stamped(n, 0, seq), stamped(n, 0, seq + 500)
                r1, r2 = dist.isend(a, 1, tag=tag), dist.isend(b, 1, tag=tag)
                r1.wait(timeout=30)
                r2.wait(timeout=30)
            else:
                a, b = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
                r1, r2 = dist.irecv(a, 0, tag=tag), dist.irecv(b, 0, tag=tag)
                r1.wait(timeout=30)
                r2.wait(timeout=30)
                if not (np.array_equal(a, stamped(n, 0, seq)) and np.array_equal(b, stamped(n, 0, seq + 500))):
                    bad.append((tag, i, who(a), who(b)))

    errors = []

    def run(tag):
        try:
            worker(tag)
        except BaseException as e:      # noqa: BLE001
            errors.append(repr(e))
    ts = [threading.Thread(target=run, args=(t,)) for t in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    alive = any(t.is_alive() for t in ts)
    if not alive:
        dist.barrier()
        dist.destroy_process_group()
        return bad, errors, False
    os._exit(5)   # a thread hangs: no clean exit possible


def test_two_threads_each_sending_with_the_way_flipping(run_ranks):
    got = run_ranks(threaded, 2, timeout=120)
    assert got == [([], [], False), ([], [], False)], got


# ---------------------------------------------------------------- SHMDIST_P2P_CHOOSE=0, the stamp

def choose_off_edges(rank, world_size, init_method):
    engine = start(rank, world_size, init_method)
    dist.barrier()
    out = []
    for rnd in range(3):
        for i, n in enumerate(EDGES):
            if rank == 0:
                dist.send(stamped(n, 0, rnd * 10 + i), 1).wait()
            else:
                g = np.zeros(n, np.uint8)
                dist.recv(g, 0).wait(timeout=30)
                out.append(np.array_equal(g, stamped(n, 0, rnd * 10 + i)))
    dist.barrier()
    read = engine.single_by[1].out[1].acked() if rank == 0 else None
    dist.destroy_process_group()
    return engine.ways is None, read, out


def test_choose_off_single_copies_at_every_edge(run_ranks, p2p_choose_off):
    (off0, read, _), (off1, _, exact) = run_ranks(choose_off_edges, 2, timeout=60)
    assert off0 and off1 and all(exact)
    assert read == 3 * (len(EDGES) - 1), read       # all but 128 KiB - 1 (the ring by rule)


def stamp(rank, world_size, init_method, late):
    """Rank 0 sends a ring copy it times; rank 1 reads it (posted first, or posted late);
    the ring's control block then says when, for that very end."""
    from shmdist import layout
    engine = start(rank, world_size, init_method)
    out = None
    dist.barrier()
    if rank == 0:
        force(engine, lambda d, n, b: False)
        chan = engine.chan_out[1]
        end = chan.produced() + _core.record_bytes(MiB)
        dist.send(stamped(MiB, 0, 0), 1).wait()
        dist.recv(np.zeros(1, np.uint8), 1).wait(timeout=30)     # rank 1 has it
        out = (chan.consumed() >= end, chan.read_at(end) is not None, len(engine.ways.pending),
               layout.RING_TIMED_END - layout.RING_TIMED_NS)
        # the timed message was seen read: the next post's look removes it
        dist.send(stamped(MiB, 0, 1), 1).wait()
    else:
        g = np.zeros(MiB, np.uint8)
        if late:                                  # the record waits in the ring, whole, first
            time.sleep(0.05)
        r = dist.irecv(g, 0)
        r.wait(timeout=30)
        ok = np.array_equal(g, stamped(MiB, 0, 0))
        dist.send(np.zeros(1, np.uint8), 0).wait()
        g2 = np.zeros(MiB, np.uint8)
        dist.recv(g2, 0).wait(timeout=30)
        out = ok and np.array_equal(g2, stamped(MiB, 0, 1))
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("late", [False, True])
def test_the_receiver_stamps_a_timed_ring_record(run_ranks, late):
    (consumed, stamped_, _, gap), exact = run_ranks(stamp, 2, late, timeout=60)
    assert exact is True and consumed and stamped_ and gap == 8


# ---------------------------------------------------------------- four ranks on two cores, every pair

def all_pairs(rank, world_size, init_method, seed):
    """Every rank sends to every other, each choosing at random; half the rounds post their
    receives first (both ways: single copies, never timed), half after their sends."""
    engine = start(rank, world_size, init_method, timeout=90)
    pick = random.Random(seed + rank)
    asked = force(engine, lambda d, n, b: pick.random() < 0.5)
    peers = [p for p in range(world_size) if p != rank]
    bad = []
    for rnd in range(6):
        n = (MIN, 600 * KiB + 5, WHOLE)[rnd % 3]
        gs = {p: np.zeros(n, np.uint8) for p in peers}
        first = rnd % 2 == 0
        rr = {p: dist.irecv(gs[p], p, tag=rnd) for p in peers} if first else None
        ss = [dist.isend(stamped(n, rank, rnd * 10 + p), p, tag=rnd) for p in peers]
        if not first:
            rr = {p: dist.irecv(gs[p], p, tag=rnd) for p in peers}
        for p in peers:
            o = outcome(rr[p], gs[p], stamped(n, p, rnd * 10 + rank), 30)
            if o != "exact":
                bad.append((rnd, p, o))
        for s in ss:
            s.wait(timeout=30)
        dist.barrier()
    dist.destroy_process_group()
    return bad, [b for _, _, b, _ in asked]


def test_four_ranks_every_pair_both_orders(run_ranks):
    got = run_ranks(all_pairs, 4, 11, timeout=150)
    for rank, (bad, boths) in enumerate(got):
        assert bad == [], (rank, bad)
        assert not any(boths), f"rank {rank}: asked about a message sent while a receive was pending"

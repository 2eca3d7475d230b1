"""Attacks on "no offer to share a single copy's reading while the ring to the
sender holds a message of the receiver's that the sender has not read"
(2f945ec; _ring.pxi, Ring.pair / Ring._mate_busy; README, How it works,
"Shared reading"), written by a helper told to break it. It found no fault
in the rule, and one elsewhere: a torch tensor sent through the fast lane as
a single copy was not kept alive (the last test; fixed).

The rule flips mid-stream in every test here: windows of uneven size each
way (one side's messages are all read before the other's, so the later
readings of the other side are offered again), a receiver whose own message
becomes read between two of its readings, another thread of the receiver
that keeps sending to the sender while it reads (an offer open when the
ring to the sender becomes busy), any-source receives, three ranks in a
cycle and all to all, tags out of order, torch tensors, one buffer sent and
received into both ways at once, the fast lane and the engine (a group of
its own), and a sender SIGKILLed while both read. The data must be
bit-exact, nothing may hang or be lost; offers must resume one way after
heavy traffic both ways. Counts of chunks the sender copied are asserted
only with retries (whether it gets a CPU is the scheduler's)."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

import shmdist as dist
from shmdist import layout

pytestmark = pytest.mark.usefixtures("p2p_choose_off")

CHUNK, BIG = layout.HELP_CHUNK, layout.HELP_BIG
EDGES = (2 * CHUNK - 1, 2 * CHUNK, 2 * CHUNK + 1, 3 * CHUNK + 5, BIG - 1, BIG, BIG + 1,
         BIG + 2 * CHUNK + 7, (3 << 20) + 5)
PATHS = ["lane", "engine"]     # the default group (fast lane), or a group of its own (the engine)
RETRIES = 8


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def engine():
    from shmdist.api import group
    return group._world.engine


def offers_from(src: int) -> int:
    """Offers this rank made to share the reading of ``src``'s single copies, ever."""
    return dict(engine().chan_in)[src].offers()


def helped(dst: int) -> int:
    return engine().chan_out[dst].helped


def _group(path, ranks=(0, 1)):
    """None (the default group: the fast lane) or a group of its own (the
    engine), after a barrier: every rank has probed whether its peers may
    read its memory (until then a big message goes through the ring)."""
    dist.barrier()
    return dist.new_group(list(ranks)) if path == "engine" else None


def _flag(path: str) -> None:
    open(path, "w").close()


def _wait_for(path: str) -> None:
    """Poll for a file, in no shmdist call."""
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.001)


# ---------------------------------------------------------------- uneven windows both ways

def uneven(rank, world_size, init_method, path, how):
    """For each size around the chunk edges, rank 0 sends ``a`` messages and
    rank 1 ``b`` (a != b), every receive and send posted at once: the side that
    sends fewer has its messages read first, and from then on the other side's
    readings are offered again, mid-window. ``how``: receives in tag order, in
    reverse tag order, or from any source (the engine)."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    g = _group(path)
    peer, bad = 1 - rank, []
    for i, n in enumerate(EDGES):
        for a, b in ((1, 3), (3, 1), (2, 4)):
            mine, theirs = (a, b) if rank == 0 else (b, a)
            seed = lambda who, k: 1000 * i + 100 * a + 10 * who + k
            intos = [np.zeros(n, np.uint8) for _ in range(theirs)]
            order = list(range(theirs))[::-1] if how == "reversed" else list(range(theirs))
            src = None if how == "any source" else peer
            reqs = {k: dist.irecv(intos[k], src, group=g, tag=k) for k in order}
            outs = [pattern(n, seed(rank, k)) for k in range(mine)]
            sends = [dist.isend(x, peer, group=g, tag=k) for k, x in enumerate(outs)]
            for k in order:
                reqs[k].wait(timeout=30)
                if how == "any source" and reqs[k].source != peer:
                    bad.append((n, a, b, k, "source", reqs[k].source))
            for s in sends:
                s.wait(timeout=30)
            bad += [(n, a, b, k) for k in range(theirs)
                    if not np.array_equal(intos[k], pattern(n, seed(peer, k)))]
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("path,how", [("lane", "in order"), ("lane", "reversed"),
                                      ("engine", "in order"), ("engine", "any source")])
def test_uneven_windows_both_ways_at_the_chunk_edges_are_bit_exact(run_ranks, path, how):
    """Uneven windows both ways at every chunk edge: the rule flips mid-window
    (both ways, then one way) and every message arrives whole, in its receive."""
    assert run_ranks(uneven, 2, path, how, timeout=120) == [[], []]


# ---------------------------------------------------------------- the flip between two readings

def flip(rank, world_size, init_method, path, kind, order, flag):
    """Rank 0 first sends rank 1 one message of its own (``kind``: a ring
    record of 1 KiB, or a single copy), which stays unread (rank 1 is in no
    shmdist call, polling a file), then reads rank 1's single copy 0: alone.
    Rank 1 then reads rank 0's message, and rank 0 reads rank 1's copies 1 and
    2: the ring to rank 1 is empty now, and each is offered to share, once.
    ``order``: rank 1 sends all three before rank 0 posts its receives
    ("records first"), or rank 0 posts its three receives first and rank 1
    sends copy 0, then 1 and 2 only after reading ("receives first"). Returns
    the data checks and the offers made in each phase."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    g = _group(path)
    n = BIG + 2 * CHUNK + 7
    small = 1024 if kind == "ring" else BIG
    ok = []
    if rank == 1:
        if order == "receives first":
            _wait_for(f"{flag}.posted")
            sends = [dist.isend(pattern(n, 0), 0, group=g, tag=0)]
        else:
            sends = [dist.isend(pattern(n, k), 0, group=g, tag=k) for k in range(3)]
        _wait_for(f"{flag}.read0")
        before = offers_from(0)
        into = np.zeros(small, np.uint8)
        dist.recv(into, 0, group=g, tag=50).wait(timeout=30)
        ok.append(bool(np.array_equal(into, pattern(small, 50))))
        mine = offers_from(0) - before       # rank 1's offers, on rank 0's message
        _flag(f"{flag}.small")
        if order == "receives first":
            sends += [dist.isend(pattern(n, k), 0, group=g, tag=k) for k in (1, 2)]
        for s in sends:
            s.wait(timeout=30)
        res = ok, mine
    else:
        sent = dist.isend(pattern(small, 50), 1, group=g, tag=50)
        intos = [np.zeros(n, np.uint8) for _ in range(3)]
        before = offers_from(1)
        if order == "receives first":
            reqs = [dist.irecv(x, 1, group=g, tag=k) for k, x in enumerate(intos)]
            _flag(f"{flag}.posted")
        else:
            reqs = [dist.irecv(intos[0], 1, group=g, tag=0)]
        reqs[0].wait(timeout=30)
        alone = offers_from(1) - before
        _flag(f"{flag}.read0")
        _wait_for(f"{flag}.small")
        before = offers_from(1)
        if order != "receives first":
            reqs += [dist.irecv(intos[k], 1, group=g, tag=k) for k in (1, 2)]
        for q in reqs[1:]:
            q.wait(timeout=30)
        ok += [bool(np.array_equal(intos[k], pattern(n, k))) for k in range(3)]
        sent.wait(timeout=30)
        res = ok, (alone, offers_from(1) - before)
    dist.destroy_process_group()
    return res


@pytest.mark.parametrize("path,order", [("lane", "records first"), ("lane", "receives first"),
                                        ("engine", "receives first")])
@pytest.mark.parametrize("kind", ["ring", "single"])
def test_offers_resume_for_the_next_message_once_the_peer_read_ours(run_ranks, tmp_path, path, order, kind):
    """A reader whose own message to the sender is unread reads alone; once the
    sender read it, the very next readings are offered again (exactly one
    offer per message), and all data is right."""
    (ok0, (alone, after)), (ok1, mine) = \
        run_ranks(flip, 2, path, kind, order, str(tmp_path / "f"), timeout=60)
    assert ok0 == [True] * 3 and ok1 == [True]
    assert alone == 0, "rank 0 offered while its own message to rank 1 was unread"
    assert after == 2, "the ring to the sender was empty again, but the readings were not offered"
    if kind == "single" and order == "records first":
        assert mine == 0, "rank 1 offered while its own single copies to rank 0 were unread"
    elif kind == "single" and path == "lane":   # nothing of rank 1's unread: it offers
        assert mine == 1, "rank 1 (nothing of its own unread) did not offer"
    # (the engine reads a single copy whose record came before its receive was posted into
    # its own buffer alone, _read_single: rank 1, with a send pending, drains it in recv())


# ---------------------------------------------------------------- the mate ring busy / empty at random

def chatter(rank, world_size, init_method, path, count, talk):
    """Rank 0 sends ``count`` big messages (sizes around the chunk edges) to
    rank 1, which reads them in its main thread while a second thread of
    rank 1 sends ``talk`` small messages to rank 0 at odd moments: the ring
    rank 1 writes to rank 0 becomes busy and empty again at any point of rank
    1's readings (also while an offer is open). Rank 0 reads the small ones in
    a thread of its own while its main thread waits for its sends."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    g = _group(path)
    rng = np.random.default_rng(7 + rank)
    sizes = [EDGES[k % len(EDGES)] for k in range(count)]
    bad = []

    def talker():
        for j in range(talk):
            if rank == 1:
                dist.send(pattern(64 + j, 5000 + j), 0, group=g, tag=1000 + j).wait(timeout=30)
            else:
                into = np.zeros(64 + j, np.uint8)
                dist.recv(into, 1, group=g, tag=1000 + j).wait(timeout=30)
                if not np.array_equal(into, pattern(64 + j, 5000 + j)):
                    bad.append(("small", j))
            if rng.random() < 0.5:
                time.sleep(rng.random() * 0.002)

    t = threading.Thread(target=talker)
    t.start()
    if rank == 0:
        sends = [dist.isend(pattern(n, k), 1, group=g, tag=k) for k, n in enumerate(sizes)]
        for s in sends:
            s.wait(timeout=60)
    else:
        for k, n in enumerate(sizes):
            into = np.zeros(n, np.uint8)
            dist.recv(into, 0, group=g, tag=k).wait(timeout=60)
            if not np.array_equal(into, pattern(n, k)):
                bad.append(("big", k, n))
    t.join(60)
    assert not t.is_alive(), "the talking thread hung"
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("path", PATHS)
def test_the_ring_to_the_sender_busy_and_empty_at_any_moment_of_a_reading(run_ranks, path):
    """Another thread of the reader keeps sending to the sender while it reads:
    the rule flips at any moment (an offer open when the ring becomes busy
    stays open); every message, big and small, arrives whole and in order."""
    assert run_ranks(chatter, 2, path, 27, 60, timeout=120) == [[], []]


# ---------------------------------------------------------------- three ranks

def three(rank, world_size, init_method, path):
    """A cycle (0 -> 1 -> 2 -> 0: each reads from a rank it does not write to,
    so it offers), then all to all (every pair both ways), any-source receives
    in both, sizes around the chunk edges."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    g = _group(path, (0, 1, 2))
    nxt, prv = (rank + 1) % 3, (rank - 1) % 3
    bad = []
    for i, n in enumerate((2 * CHUNK + 1, BIG, BIG + 1, (3 << 20) + 5)):
        # the cycle, two messages each, the second received from any source
        intos = [np.zeros(n, np.uint8) for _ in range(2)]
        reqs = [dist.irecv(intos[0], prv, group=g, tag=0), dist.irecv(intos[1], None, group=g, tag=1)]
        sends = [dist.isend(pattern(n, 100 * i + 10 * rank + k), nxt, group=g, tag=k) for k in range(2)]
        for r in reqs + sends:
            r.wait(timeout=30)
        bad += [("cycle", n, k) for k in range(2) if not np.array_equal(intos[k], pattern(n, 100 * i + 10 * prv + k))]
        if reqs[1].source != prv:
            bad.append(("cycle source", n, reqs[1].source))
        # all to all: a tag per source, half the receives from any source
        others = [r for r in range(3) if r != rank]
        intos = {s: np.zeros(n + s, np.uint8) for s in others}
        reqs = {s: dist.irecv(intos[s], None if s == others[0] else s, group=g, tag=10 + s) for s in others}
        sends = [dist.isend(pattern(n + rank, 7000 + 100 * i + 10 * rank + d), d, group=g, tag=10 + rank)
                 for d in others]
        for r in list(reqs.values()) + sends:
            r.wait(timeout=30)
        bad += [("all", n, s) for s in others
                if not np.array_equal(intos[s], pattern(n + s, 7000 + 100 * i + 10 * s + rank))]
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("path", PATHS)
def test_three_ranks_in_a_cycle_and_all_to_all_are_bit_exact(run_ranks, path):
    """Three ranks: a cycle (one way per pair: offers) and all to all (both ways
    per pair: none), with any-source receives; all data right, nothing lost."""
    assert run_ranks(three, 3, path, timeout=120) == [[], [], []]


# ---------------------------------------------------------------- one way again after both ways

def resume(rank, world_size, init_method, path, n):
    """Heavy traffic both ways (windows of 3 each way, 4 rounds), then one way
    in the same processes: the reader offers for every message (nothing of its
    own unread), and the sender copies chunks (rounds repeated until it got a
    CPU for it)."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    g = _group(path)
    peer, ok, again = 1 - rank, [], np.ones(1, np.uint8)
    for r in range(4):
        intos = [np.zeros(n, np.uint8) for _ in range(3)]
        reqs = [dist.irecv(x, peer, group=g, tag=k) for k, x in enumerate(intos)]
        reqs += [dist.isend(pattern(n, 100 * r + 10 * rank + k), peer, group=g, tag=k) for k in range(3)]
        for q in reqs:
            q.wait(timeout=30)
        ok += [bool(np.array_equal(intos[k], pattern(n, 100 * r + 10 * peer + k))) for k in range(3)]
    before, helped0 = offers_from(0) if rank == 1 else 0, helped(1) if rank == 0 else 0
    for r in range(RETRIES):
        msg = pattern(n, 9000 + r)
        if rank == 0:
            dist.recv(again, 1, group=g).wait(timeout=30)      # rank 1's receive is posted
            dist.send(msg, 1, group=g, tag=r).wait(timeout=30)
            again[0] = helped(1) == helped0 and r + 1 < RETRIES
            dist.send(again, 1, group=g).wait(timeout=30)
        else:
            into = np.zeros(n, np.uint8)
            got = dist.irecv(into, 0, group=g, tag=r)
            dist.send(again, 0, group=g).wait(timeout=30)
            got.wait(timeout=30)
            ok.append(bool(np.array_equal(into, msg)))
            dist.recv(again, 0, group=g).wait(timeout=30)
        if not again[0]:
            break
    res = ok, (offers_from(0) - before if rank == 1 else None, r + 1), \
        (helped(1) - helped0 if rank == 0 else None)
    dist.destroy_process_group()
    return res


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [2 * CHUNK, BIG + 1, (5 << 20) + 3])
def test_one_way_sharing_resumes_after_heavy_traffic_both_ways(run_ranks, path, n):
    """After rounds both ways at once, one way the reader offers again for every
    message, and the sender copies chunks of the big ones (with retries)."""
    (ok0, _, copied), (ok1, (offered, rounds), _) = run_ranks(resume, 2, path, n, timeout=90)
    assert ok0 == [True] * 12 and ok1 == [True] * (12 + rounds)
    assert offered == rounds, "one way after traffic both ways, the reader did not offer"
    if n >= BIG:    # (of 2 chunks the reader has often claimed both before the sender woke)
        assert copied > 0, f"the sender never copied a chunk in {rounds} messages"


# ---------------------------------------------------------------- one buffer, both ways

def same_buffer(rank, world_size, init_method, path, lib):
    """Each rank sends a buffer and receives into that very buffer, both ways
    at once (the receive waits until the peer read the send)."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    g = _group(path)
    peer, bad = 1 - rank, []
    for i, n in enumerate((2 * CHUNK + 4, BIG, BIG + 2 * CHUNK + 8, (3 << 20) + 4)):
        arr = pattern(n, 10 * i + rank)
        buf = arr if lib == "numpy" else __import__("torch").from_numpy(arr).view(__import__("torch").float32)
        s = dist.isend(buf, peer, group=g, tag=i)
        r = dist.irecv(buf, peer, group=g, tag=i)
        r.wait(timeout=30)
        s.wait(timeout=30)
        if not np.array_equal(arr, pattern(n, 10 * i + peer)):
            bad.append(n)
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_one_buffer_sent_and_received_into_both_ways_at_once(run_ranks, path, lib):
    """A send from and a receive into the same buffer, both ways at once: each
    ends with the peer's original bytes (never its own, never a mix)."""
    if lib == "torch":
        pytest.importorskip("torch")
    assert run_ranks(same_buffer, 2, path, lib, timeout=60) == [[], []]


# ---------------------------------------------------------------- torch tensors both ways

def tensors(rank, world_size, init_method, path):
    """torch tensors (float32, bfloat16, int64) both ways with uneven windows,
    sizes around the chunk edges, compared bit for bit."""
    import torch
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    g = _group(path)
    peer, bad = 1 - rank, []
    for i, n in enumerate((2 * CHUNK - 8, 2 * CHUNK, 2 * CHUNK + 8, BIG - 8, BIG + 8, BIG + 2 * CHUNK + 8)):
        for j, dt in enumerate((torch.float32, torch.bfloat16, torch.int64)):
            mine, theirs = (1, 2) if (rank + j) % 2 else (2, 1)
            seed = lambda who, k: 1000 * i + 100 * j + 10 * who + k
            intos = [torch.zeros(n // dt.itemsize, dtype=dt) for _ in range(theirs)]
            outs = [torch.from_numpy(pattern(n, seed(rank, k))).view(dt) for k in range(mine)]
            reqs = [dist.irecv(x, peer, group=g, tag=k) for k, x in enumerate(intos)]
            reqs += [dist.isend(x, peer, group=g, tag=k) for k, x in enumerate(outs)]
            for q in reqs:
                q.wait(timeout=30)
            bad += [(n, str(dt), k) for k in range(theirs)
                    if not np.array_equal(intos[k].view(torch.uint8).numpy(), pattern(n, seed(peer, k)))]
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("path", PATHS)
def test_torch_tensors_both_ways_uneven_are_bit_exact(run_ranks, path):
    """torch tensors of three dtypes both ways, windows uneven (the rule flips):
    bit-exact."""
    pytest.importorskip("torch")
    assert run_ranks(tensors, 2, path, timeout=90) == [[], []]


# ---------------------------------------------------------------- a sender killed while both read

def killed(rank, world_size, init_method, path, delay):
    """Both ranks post two big receives and two big sends to each other; rank
    0 is SIGKILLed ``delay`` seconds later (by a thread of its own). Rank 1
    reports for each request: right data, or the error that names rank 0."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    g = _group(path)
    peer = 1 - rank
    n = (6 << 20) + 3
    intos = [np.zeros(n, np.uint8) for _ in range(2)]
    outs = [pattern(n, 10 * rank + k) for k in range(2)]
    if rank == 0:
        threading.Thread(target=lambda: (time.sleep(delay), os.kill(os.getpid(), signal.SIGKILL)),
                         daemon=True).start()
    recvs = [dist.irecv(x, peer, group=g, tag=k) for k, x in enumerate(intos)]
    sends = [dist.isend(x, peer, group=g, tag=k) for k, x in enumerate(outs)]
    if rank == 0:
        for q in recvs + sends:
            q.wait(timeout=30)
        time.sleep(30)          # killed meanwhile
        return "not killed"
    got = []
    for k, q in enumerate(recvs):
        try:
            q.wait(timeout=30)
            got.append("right" if np.array_equal(intos[k], pattern(n, k)) else "WRONG DATA")
        except dist.DistPeerError as e:
            got.append(str(e))
    for q in sends:
        try:
            q.wait(timeout=30)
            got.append("sent")
        except dist.DistPeerError as e:
            got.append(str(e))
    try:
        dist.destroy_process_group()
    except dist.DistError:
        pass
    return got


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("delay", [0.0, 0.003, 0.03])
def test_a_sender_killed_while_both_read_is_named_or_was_read(run_ranks, path, delay):
    """SIGKILL of one rank while both read each other's single copies: each of
    the survivor's receives has the right data or fails naming rank 0 (never
    wrong data, never a hang); its sends complete or fail naming rank 0."""
    res = run_ranks(killed, 2, path, delay, timeout=60, errors="return")
    assert getattr(res[0], "exitcode", None) == -signal.SIGKILL, res[0]
    got = res[1]
    assert isinstance(got, list), got
    for k, what in enumerate(got[:2]):
        assert what == "right" or ("rank 0" in what and "recv from rank 0" in what), (k, what)
    for what in got[2:]:
        assert what == "sent" or "rank 0" in what, what


# ---------------------------------------------------------------- a torch tensor the caller dropped

def dropped_tensor(rank, world_size, init_method, path, flag):
    """Rank 0 isends torch tensors it keeps no reference to (``dist.isend(t.clone(), 1)``,
    as one may with torch, whose Work keeps its tensors), allocates more
    tensors of that size, and only then lets rank 1 receive (rank 1 waits for
    a file, in no shmdist call). Each round's outcome on rank 1: right, WRONG
    DATA, or the receive's error."""
    import torch
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    g = _group(path)
    n, rounds = (1 << 20) + 64, 4
    got = []
    for k in range(rounds):
        if rank == 0:
            src = torch.from_numpy(pattern(n, k))
            req = dist.isend(src.clone(), 1, group=g, tag=k)     # the clone: no reference kept here
            junk = [torch.full((n,), 0xAB, dtype=torch.uint8) for _ in range(3)]
            _flag(f"{flag}.{k}")
            req.wait(timeout=30)
            del junk
        else:
            _wait_for(f"{flag}.{k}")
            into = np.zeros(n, np.uint8)
            try:
                dist.recv(into, 0, group=g, tag=k).wait(timeout=30)
                got.append("right" if np.array_equal(into, pattern(n, k)) else "WRONG DATA")
            except dist.DistError as e:
                got.append(str(e))
    dist.destroy_process_group()
    return got


@pytest.mark.parametrize("path", PATHS)
def test_a_torch_tensor_sent_without_a_reference_kept_arrives(run_ranks, tmp_path, path):
    """isend of a torch tensor the caller keeps no reference to (torch's Work keeps
    it alive until the send completed): a one-way single copy (1 MiB) is read
    from the sender's memory later, so something must keep the tensor. On
    the fast lane (the default group) it failed before Lane.send took the
    tensor as ``owner``: the lane kept only the numpy view
    shmdist.tensors.numpy_view made, which holds no reference to the tensor,
    so the tensor was freed when isend returned and rank 1 read its memory
    reused: other bytes, no error, in rounds 1-3 of every run."""
    pytest.importorskip("torch")
    _, got = run_ranks(dropped_tensor, 2, path, str(tmp_path / "f"), timeout=60)
    assert got == ["right"] * 4, got

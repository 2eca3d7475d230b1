"""A big single copy read by both ends (_ring.pxi, "sharing a single copy's
reading"; transport/engine.py): the receiver of a single copy of at least
engine.HELP_MIN bytes offers the sender, which waits for that read, to copy
chunks of it (layout.HELP_CHUNK bytes, twice that from layout.HELP_BIG) into the
receiver's buffer (process_vm_writev) while it reads the others, each chunk
claimed once by compare-and-swap.

Bit-exact data around the chunk edges, one way windowed and blocking, both
ways at once, any-source receives; that the sender really copied chunks
(its ring's ``helped`` count); a sender busy elsewhere (the receiver reads
it all alone); a sender whose copies fail (the receiver reads it all again);
and a sender that dies with an offer open."""
from __future__ import annotations

import ctypes
import os
import time

import numpy as np
import pytest

import shmdist as dist
from shmdist import layout

# they count single copies: the sender's timing of the ring against them off (transport/ways.py)
pytestmark = pytest.mark.usefixtures("p2p_choose_off")

CHUNK, BIG = layout.HELP_CHUNK, layout.HELP_BIG
SIZES = (2 * CHUNK - 1, 2 * CHUNK, 2 * CHUNK + 1, 5 * CHUNK + 13, BIG - 1, BIG, BIG + 1,
         BIG + 2 * CHUNK + 7, (3 << 20) + 5, (17 << 20) + 3)


SENDS = 8      # messages a test sends at most until the sender got a CPU while they were read


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def engine():
    from shmdist.api import group
    return group._world.engine


def helped(peer: int) -> int:
    """Chunks this rank copied into ``peer``'s memory, ever."""
    return engine().chan_out[peer].helped


def one_way(rank, world_size, init_method, how):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    bad = []
    for i, n in enumerate(SIZES):
        if rank == 0:
            msgs = [pattern(n, 10 * i + k) for k in range(3)]
            if how == "window":
                for r in [dist.isend(m, 1, tag=k) for k, m in enumerate(msgs)]:
                    r.wait()
            else:
                for k, m in enumerate(msgs):
                    dist.send(m, 1, tag=k).wait()
        else:
            for k in range(3):
                into = np.zeros(n, np.uint8)
                src = None if how == "any source" else 0
                dist.recv(into, src, tag=k).wait()
                if not np.array_equal(into, pattern(n, 10 * i + k)):
                    bad.append((n, k))
    copied = helped(1) if rank == 0 else 0
    dist.destroy_process_group()
    return bad, copied


@pytest.mark.parametrize("how", ["window", "blocking", "any source"])
def test_one_way_is_bit_exact_and_the_sender_copies_chunks(run_ranks, how):
    (bad0, copied), (bad1, _) = run_ranks(one_way, 2, how, timeout=90)
    assert bad0 == [] and bad1 == []
    assert copied > 0       # the sender took part in reading its own messages


def both_ways(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    peer = 1 - rank
    bad = []
    for i, n in enumerate(SIZES):
        outs = [pattern(n, 100 * i + 10 * rank + k) for k in range(4)]
        intos = [np.zeros(n, np.uint8) for _ in range(4)]
        reqs = [dist.irecv(x, peer, tag=k) for k, x in enumerate(intos)]
        reqs += [dist.isend(x, peer, tag=k) for k, x in enumerate(outs)]
        for r in reqs:
            r.wait()
        bad += [(n, k) for k in range(4) if not np.array_equal(intos[k], pattern(n, 100 * i + 10 * peer + k))]
    dist.destroy_process_group()
    return bad


def test_both_ways_at_once_is_bit_exact(run_ranks):
    assert run_ranks(both_ways, 2, timeout=90) == [[], []]


def _wait_for(path: str) -> None:
    """Poll for a file, in no shmdist call (the peer's message to this rank stays unread)."""
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.001)


def crossing(rank, world_size, init_method, n, rounds, flag):
    """Both ways: rank 0 posts a send to rank 1, then receives rank 1's
    message, while rank 1 (in no shmdist call, polling a file) has read
    nothing: rank 0 reads it with its own message unread in the ring to rank
    1, and so reads it alone, offering nothing. Then one way, in the same
    processes: rank 1 posts a receive first and rank 0 sends, nothing of
    rank 1's unread: rank 1 offers to share the reading in every round, and
    rank 0, in its send's wait, copies chunks (rounds repeated, up to
    ``rounds``, until it got a CPU for it). Returns the data's checks, the
    offers made while crossing and one way, and rank 0's chunks copied."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    peer, ok, again = 1 - rank, [], np.ones(1, np.uint8)
    offers = lambda: engine().chan_out[peer].offers()      # the peer's, on what this rank sends it
    before = offers()
    for r in range(rounds):
        out, into = pattern(n, 2 * r + rank), np.zeros(n, np.uint8)
        if rank == 0:
            sent = dist.isend(out, 1, tag=r)
            dist.recv(into, 1, tag=r).wait()
            open(f"{flag}.{r}", "w").close()
            sent.wait()
        else:
            sent = dist.isend(out, 0, tag=r)
            _wait_for(f"{flag}.{r}")
            sent.wait()
            dist.recv(into, 0, tag=r).wait()
        ok.append(bool(np.array_equal(into, pattern(n, 2 * r + peer))))
    crossed, before = offers() - before, offers()
    helped0 = helped(peer)
    for r in range(rounds):
        msg = pattern(n, 100 + r)
        if rank == 0:
            dist.recv(again, 1).wait()           # rank 1's receive is posted
            dist.send(msg, 1, tag=r).wait()
            again[0] = helped(1) == helped0 and r + 1 < rounds
            dist.send(again, 1).wait()
        else:
            into = np.zeros(n, np.uint8)
            got = dist.irecv(into, 0, tag=r)
            dist.send(again, 0).wait()
            got.wait()
            ok.append(bool(np.array_equal(into, msg)))
            dist.recv(again, 0).wait()
        if not again[0]:
            break
    res = ok, crossed, (offers() - before, r + 1), helped(peer) - helped0
    dist.destroy_process_group()
    return res


@pytest.mark.parametrize("n", [BIG, (17 << 20) + 3])
def test_both_ways_at_once_a_read_is_not_shared_while_the_peer_reads_ours(run_ranks, n, tmp_path):
    (ok0, _, (offered0, rounds), copied), (ok1, crossed1, _, _) = \
        run_ranks(crossing, 2, n, 6, str(tmp_path / "read"), timeout=90)
    assert ok0 == [True] * 6 and ok1 == [True] * (6 + rounds)
    assert crossed1 == 0, "rank 0 offered to share a read while its own message to rank 1 was unread"
    assert offered0 == rounds, "one way (nothing of its own unread) the reader did not offer"
    assert copied > 0, "one way the sender never copied a chunk"


def busy_sender(rank, world_size, init_method):
    """Rank 0 posts its sends and then computes for a while: nobody shares rank 1's reading."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    n = (6 << 20) + 7
    if rank == 0:
        reqs = [dist.isend(pattern(n, k), 1, tag=k) for k in range(3)]
        time.sleep(1.5)                 # not in any shmdist call: rank 1 reads alone meanwhile
        for r in reqs:
            r.wait()
        out = helped(1)
    else:
        out = []
        t0 = time.monotonic()
        for k in range(3):
            into = np.zeros(n, np.uint8)
            dist.recv(into, 0, tag=k).wait()
            out.append(bool(np.array_equal(into, pattern(n, k))))
        out.append(time.monotonic() - t0 < 1.4)  # it did not wait for the busy sender
    dist.destroy_process_group()
    return out


def test_a_sender_busy_elsewhere_leaves_the_whole_reading_to_the_receiver(run_ranks):
    copied, got = run_ranks(busy_sender, 2, timeout=60)
    assert got == [True, True, True, True]
    assert copied == 0


def failing_sender(rank, world_size, init_method):
    """Rank 0's shared copies all fail: it writes into a process that is gone (ESRCH)."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    n, again = (4 << 20) + 9, np.ones(1, np.uint8)
    if rank == 0:
        import subprocess
        from shmdist.transport import engine as eng
        gone = subprocess.Popen(["true"])
        gone.wait()                     # its pid names no process now

        def into_nobody(self):
            for dst in list(self.queues.awaiting):
                offer = self.chan_out[dst].help_offer()
                if offer is not None:
                    self.chan_out[dst].help(gone.pid, *offer)
        real, eng.Engine._help = eng.Engine._help, into_nobody
        for k in range(SENDS):          # (until it got a CPU while rank 1 read: the scheduler's)
            dist.send(pattern(n, k), 1, tag=k).wait()
            again[0] = helped(1) == 0 and k + 1 < SENDS
            dist.send(again, 1).wait()
            if not again[0]:
                break
        eng.Engine._help = real
        out = helped(1)
    else:
        out = []
        while again[0]:
            into = np.zeros(n, np.uint8)
            dist.recv(into, 0, tag=len(out)).wait()
            out.append(bool(np.array_equal(into, pattern(n, len(out)))))
            dist.recv(again, 0).wait()
    dist.destroy_process_group()
    return out


def test_a_sender_whose_copies_fail_makes_the_receiver_read_it_all_again(run_ranks):
    tried, got = run_ranks(failing_sender, 2, timeout=60)
    assert got == [True] * len(got) and got
    assert tried > 0        # it claimed chunks, and its copies failed


def dying_sender(rank, world_size, init_method):
    """Rank 0 dies the moment it sees one of rank 1's offers (it sends until then:
    whether it gets a CPU while rank 1 reads is the scheduler's)."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    n = (8 << 20) + 1
    if rank == 0:
        from shmdist.transport import engine as eng
        eng.Engine._help = lambda self: os._exit(3)
        for k in range(SENDS):
            dist.send(pattern(n, k), 1, tag=k).wait()
        return "sent"
    into = np.zeros(n, np.uint8)
    try:
        for k in range(SENDS):
            dist.recv(into, 0, tag=k).wait(timeout=30)
            if not np.array_equal(into, pattern(n, k)):
                return "WRONG DATA"
        return "right"
    except dist.DistPeerError as e:
        return str(e)


def test_a_sender_that_dies_with_an_offer_open_is_named_or_was_read(run_ranks):
    """Either the receiver had read it all before the sender's memory went, or it names
    the death; never wrong data, never a hang (the test's timeout is below the group's)."""
    results = run_ranks(dying_sender, 2, timeout=40, errors="return")
    assert results[0].exitcode == 3
    got = results[1]
    assert got == "right" or ("rank 0 died" in got and "recv from rank 0" in got), got


def untouched_receiver(rank, world_size, init_method):
    """Receive into np.empty buffers this process never touched, fresh each time."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    n, ok = (12 << 20) + 3, []
    for k in range(4):
        if rank == 0:
            dist.send(pattern(n, k), 1).wait()
        else:
            into = np.empty(n, np.uint8)
            dist.recv(into, 0).wait()
            ok.append(bool(np.array_equal(into, pattern(n, k))))
    copied = helped(1) if rank == 0 else 0
    dist.destroy_process_group()
    return ok, copied


def test_receives_into_pages_never_touched_are_right(run_ranks):
    """(Without _touch, chunks the sender wrote into such pages read back wrong here.)"""
    (_, copied), (ok, _) = run_ranks(untouched_receiver, 2, timeout=60)
    assert ok == [True] * 4 and copied > 0


class LateChunk:
    """The ring from one sender as the engine sees it, with that sender's chunk
    of a shared reading landing late (descheduled mid-copy, for longer than
    the receiver waits for it): the first single copy taken for a receive is
    read whole, then its first chunk is given back to zero and take() says
    HELPING, the reading still open. The chunk lands (its bytes written where
    that first receive's buffer is) when the engine comes back to take it for
    that receive, which then completes, or when it ends the offer
    (settle_help) to give the record to another receive, which then gets the
    whole message, as a real reading read again would. Everything else is
    the real ring's."""

    def __init__(self, ring):
        self.ring, self.held = ring, None

    def __getattr__(self, name):
        return getattr(self.ring, name)

    def take(self, tag, gid, addr, nbytes, dtype16, single=True):
        if self.held is None and single and nbytes >= 2 * CHUNK:
            got = self.ring.take(tag, gid, addr, nbytes, dtype16, single)
            if got != layout.DONE:
                return got
            self.held = (addr, ctypes.string_at(addr, nbytes))
            ctypes.memset(addr, 0, CHUNK)
            return layout.HELPING
        if self.held is not None:
            first, message = self.held
            self._land()
            if addr != first:       # (read again for another receive: the whole message)
                ctypes.memmove(addr, message, nbytes)
            self.held = False
            return layout.DONE
        return self.ring.take(tag, gid, addr, nbytes, dtype16, single)

    def _land(self):
        first, message = self.held
        ctypes.memmove(first, message, CHUNK)

    def help_open(self):
        return bool(self.held) or self.ring.help_open()

    def settle_help(self):
        if self.held:
            self._land()        # (its record stays: the next take reads it for its receive)
        return True if self.held else self.ring.settle_help()


def two_senders_any_source(rank, world_size, init_method, n, flag):
    """Rank 2 posts two any-source receives of ``n`` bytes; then ranks 0 and 1
    each send it a single copy (same tag), and once both records are in its
    rings rank 2 waits. Its ring from rank 0 (scanned first) says the first
    receive is still being read with rank 0's help (LateChunk): that receive
    must then take nothing from rank 1, or rank 0's late chunk would land in
    the middle of rank 1's message."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    if rank < 2:
        _wait_for(f"{flag}.posted")
        sent = dist.isend(pattern(n, rank), 2, tag=7)
        open(f"{flag}.{rank}", "w").close()
        sent.wait()
        out = None
    else:
        eng = engine()
        assert [src for src, _ in eng.chan_in][:2] == [0, 1]
        late = LateChunk(eng.chan_in[0][1])
        eng.chan_in[0] = (0, late)
        intos = [np.zeros(n, np.uint8) for _ in range(2)]
        reqs = [dist.irecv(x, None, tag=7) for x in intos]
        open(f"{flag}.posted", "w").close()
        for s in (0, 1):
            _wait_for(f"{flag}.{s}")        # (in no shmdist call: both records wait in the rings)
        for q in reqs:
            q.wait()
        eng.chan_in[0] = (0, late.ring)
        out = [(q.source, bool(np.array_equal(x, pattern(n, q.source)))) for q, x in zip(reqs, intos)]
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_an_any_source_receive_read_with_help_takes_no_other_message_meanwhile(run_ranks, tmp_path):
    got = run_ranks(two_senders_any_source, 3, BIG + 7, str(tmp_path / "sent"), timeout=60)[2]
    assert sorted(src for src, _ in got) == [0, 1]
    assert got == [(0, True), (1, True)], got      # the first is rank 0's, whole; rank 1's went to the second

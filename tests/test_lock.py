"""_core.RLock, the engine's and the arena's lock (_lock.pxi): threading.RLock's
behaviour with the GIL doing the uncontended work. Reentrant, owned, released
only by its owner; waits (with and without a limit) hand it over; many
threads that take it in turns, sleeping and switching while they hold it,
never overlap and none is left waiting; it keeps working after one thread
timed out waiting while it was held."""
from __future__ import annotations

import sys
import threading
import time

import pytest

from shmdist import _core


def test_reentrant_and_owned_by_one_thread():
    lock = _core.RLock()
    assert lock.acquire() and lock.acquire(blocking=False)
    assert lock._is_owned()
    lock.release()
    assert lock._is_owned()
    lock.release()
    assert not lock._is_owned()
    with pytest.raises(RuntimeError, match="un-acquired"):
        lock.release()


def test_another_thread_cannot_take_or_release_it():
    lock = _core.RLock()
    lock.acquire()
    seen = {}

    def other():
        seen["nonblocking"] = lock.acquire(blocking=False)
        t0 = time.monotonic()
        seen["timed"] = lock.acquire(timeout=0.2)
        seen["waited"] = time.monotonic() - t0
        try:
            lock.release()
        except RuntimeError as e:
            seen["release"] = str(e)

    t = threading.Thread(target=other)
    t.start()
    t.join(10)
    assert seen["nonblocking"] is False and seen["timed"] is False
    assert seen["waited"] >= 0.15
    assert "un-acquired" in seen["release"]
    lock.release()
    with pytest.raises(ValueError):
        lock.acquire(blocking=False, timeout=1)


def test_a_waiter_gets_it_when_the_owner_leaves():
    lock = _core.RLock()
    got = threading.Event()
    lock.acquire()
    lock.acquire()          # twice: it is free only after the second release

    def waiter():
        with lock:
            got.set()

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.1)
    assert not got.is_set()
    lock.release()
    time.sleep(0.1)
    assert not got.is_set()
    lock.release()
    assert got.wait(10)
    t.join(10)
    assert lock.acquire(blocking=False)     # free again, and the lock works after a hand-over
    lock.release()


def test_it_works_after_a_waiter_timed_out():
    lock = _core.RLock()
    lock.acquire()
    out = []
    t = threading.Thread(target=lambda: out.append(lock.acquire(timeout=0.05)))
    t.start()
    t.join(10)
    lock.release()
    assert out == [False]
    t = threading.Thread(target=lambda: (out.append(lock.acquire(timeout=5)), lock.release()))
    t.start()
    t.join(10)
    assert out == [False, True]
    assert lock.acquire(blocking=False)
    lock.release()


def test_threads_taking_it_in_turns_never_overlap():
    lock = _core.RLock()
    inside = [0]
    overlaps = [0]
    counts = [0] * 8
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)     # the GIL changes hands inside the held section too
    try:
        def worker(k):
            for i in range(2000):
                with lock:
                    with lock:      # reentrant while others wait
                        inside[0] += 1
                        if inside[0] != 1:
                            overlaps[0] += 1
                        if i % 200 == 0:
                            time.sleep(0.0005)      # holds it with the GIL released
                        counts[k] += 1
                        inside[0] -= 1

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    finally:
        sys.setswitchinterval(old)
    assert overlaps[0] == 0
    assert counts == [2000] * 8
    assert lock.acquire(blocking=False)
    lock.release()


def retire_inside_a_call(rank, world_size, init_method):
    """GroupComm.retire from the thread that holds the arena's lock (a signal
    handler's destroy during a collective): not quiet, so the arena stays mapped."""
    import shmdist as dist
    from shmdist.api import group
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    dist.barrier()
    coll = group._world.default.coll
    with coll.lock:
        inside = coll.retire("test", 0.05)
    outside = coll.retire("test", 0.05)
    dist.destroy_process_group()
    return inside, outside


def test_a_group_is_not_retired_from_inside_its_own_call(run_ranks):
    assert run_ranks(retire_inside_a_call, 2, timeout=60) == [(False, True)] * 2

"""An outside tester's attempts to break README's life-cycle promises:
init -> destroy -> init again, new_group's mismatch error, get_rank for
non-members, the timeout setting, forked children, and threads using two
groups at once. numpy only."""
from __future__ import annotations

import datetime
import glob
import os
import threading
import time

import numpy as np
import pytest

import shmdist as dist
from ranks import free_port


def _init(rank, world_size, init_method, **kw):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, **kw)


def _round_trip(rank, world_size, i):
    """A little of everything, checked: all_reduce, a p2p ring, a subgroup."""
    x = np.full(3, rank + i, dtype=np.int64)
    dist.all_reduce(x)
    ok = x.tolist() == [sum(range(world_size)) + world_size * i] * 3
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    box = np.zeros(5, dtype=np.int64)
    reqs = [dist.send(np.full(5, rank * 100 + i, dtype=np.int64), nxt), dist.recv(box, prv)]
    for q in reqs:
        q.wait()
    ok &= box.tolist() == [prv * 100 + i] * 5
    sub = dist.new_group([0, world_size - 1])
    y = np.ones(2)
    dist.all_reduce(y, group=sub)
    if rank in (0, world_size - 1):
        ok &= y.tolist() == [2.0, 2.0]
    return ok


def reinit_fresh_ports(rank, world_size, init_method, ports):
    oks = []
    for i, port in enumerate([None] + ports):
        _init(rank, world_size, init_method if port is None else f"tcp://127.0.0.1:{port}", timeout=30)
        oks.append(bool(_round_trip(rank, world_size, i)) and dist.is_initialized())
        dist.destroy_process_group()
        oks.append(not dist.is_initialized())
    return oks


def test_init_destroy_init_several_times_in_one_process(run_ranks):
    ports = [free_port() for _ in range(4)]
    assert run_ranks(reinit_fresh_ports, 3, ports, timeout=120) == [[True] * 10] * 3


def reinit_same_method(rank, world_size, init_method, rounds):
    """The same init_method every time, as a script using env:// does; no
    barrier before destroy, so ranks leave at different moments."""
    out = []
    for i in range(rounds):
        try:
            _init(rank, world_size, init_method, timeout=10)
        except dist.DistError as e:
            out.append(f"round {i}: {type(e).__name__}: {e}")
            return out
        out.append(bool(_round_trip(rank, world_size, i)))
        if rank == 0:
            time.sleep(0.5)   # ordering only: rank 0 (the store) leaves last, as a busy rank 0 would
        dist.destroy_process_group()
    return out


def test_init_destroy_init_again_with_the_same_init_method(run_ranks):
    got = run_ranks(reinit_same_method, 3, 3, timeout=120, init_method=f"tcp://127.0.0.1:{free_port()}")
    assert got == [[True] * 3] * 3, got


def reinit_same_method_last(rank, world_size, init_method, rounds, last):
    """As reinit_same_method, with rank ``last`` leaving 0.5 s after the
    others: rank 0 (the store) last, or first, so that it serves the next
    job's store while the others still finish the previous one."""
    out = []
    for i in range(rounds):
        try:
            _init(rank, world_size, init_method, timeout=10)
        except dist.DistError as e:
            out.append(f"round {i}: {type(e).__name__}: {e}")
            return out
        out.append(bool(_round_trip(rank, world_size, i)))
        if rank == last:
            time.sleep(0.5)   # ordering only
        dist.destroy_process_group()
    return out


@pytest.mark.parametrize("last", [0, 2])
def test_init_destroy_init_again_with_the_same_file(run_ranks, tmp_path, last):
    """file:// too: a rank that inits again does not join the previous job's
    file, which the last rank to leave removes."""
    got = run_ranks(reinit_same_method_last, 3, 3, last, timeout=120, init_method=f"file://{tmp_path}/rdv")
    assert got == [[True] * 3] * 3, got
    assert not os.path.exists(tmp_path / "rdv")


def test_init_destroy_init_again_when_rank_0_leaves_first(run_ranks):
    got = run_ranks(reinit_same_method_last, 3, 3, 2, timeout=120, init_method=f"tcp://127.0.0.1:{free_port()}")
    assert got == [[True] * 3] * 3, got


def test_a_store_this_process_left_is_refused_clearly(tmp_path):
    """In one process: a client that left a store and meets it again at the
    same address (its rank 0 never started the next job) waits, then says so;
    a fresh client of the same store is served as before."""
    from shmdist.rendezvous import store as R
    master = R.TCPStore("127.0.0.1", 0, is_master=True, timeout=5.0)
    try:
        port = master.port
        left = R.TCPStore("127.0.0.1", port, is_master=False, timeout=5.0)
        left.close()
        with pytest.raises(dist.DistTimeoutError, match="previous job this process left"):
            R.TCPStore("127.0.0.1", port, is_master=False, timeout=0.5)
        master.set("k", b"v")
        assert master.get("k", 1.0) == b"v"
    finally:
        master.close()
    path = str(tmp_path / "rdv")
    first = R.FileStore(path, 2, 5.0)
    other = R.FileStore(path, 2, 5.0)          # another rank, still in the job
    first.close()
    with pytest.raises(dist.DistError, match="previous job this process left"):
        R.FileStore(path, 2, 0.5)
    other.close()                              # the last one out removes the file
    again = R.FileStore(path, 2, 0.5)           # so the next job starts afresh
    again.set("k", b"v")
    assert again.get("k", 1.0) == b"v"
    again.close()


# ---------------------------------------------------------------- new_group mismatch

def new_group_disagree(rank, world_size, init_method, variant):
    _init(rank, world_size, init_method, timeout=10)
    if variant == "overlap":          # ranks 0, 1 ask for [0, 1]; rank 2 for [1, 2], a little later
        ranks = [1, 2] if rank == 2 else [0, 1]
        if rank == 2:
            time.sleep(1.0)           # ordering only: ranks 0 and 1 have mapped "their" arena by then
    else:                             # ranks 0, 1 ask for [0, 2]; rank 2 for [0, 1]
        ranks = [0, 1] if rank == 2 else [0, 2]
    res = []
    try:
        dist.new_group(ranks)
        res.append("made")
    except dist.DistMismatchError as e:
        res.append("mismatch" if str(ranks) in str(e) else str(e))
    except dist.DistError as e:
        res.append(f"{type(e).__name__}: {e}")
    try:                              # the job goes on: a group everyone agrees on
        g = dist.new_group([0, 1, 2])
        x = np.ones(2)
        dist.all_reduce(x, group=g)
        res.append(x.tolist())
    except dist.DistError as e:
        res.append(f"{type(e).__name__}: {e}")
    dist.destroy_process_group()
    return res


def _take_leaked(job: str) -> list:
    """The segments this test's job left in /dev/shm, removed (they are
    asserted on by test_new_group_mismatch_then_an_agreed_group_works, not by
    the no_leaks fixture)."""
    found = sorted(glob.glob(f"/dev/shm/shmdist-{job}-*"))
    for path in found:
        os.unlink(path)
    return found


def test_new_group_with_disagreeing_ranks_raises_mismatch_on_every_rank(run_ranks, no_leaks):
    """The promise as README words it: DistMismatchError on every rank."""
    got = run_ranks(new_group_disagree, 3, "disjoint", timeout=60, errors="return")
    _take_leaked(no_leaks)
    assert [g[0] for g in got] == ["mismatch"] * 3, got


def test_new_group_overlapping_disagreement_raises_mismatch_on_every_rank(run_ranks, no_leaks):
    got = run_ranks(new_group_disagree, 3, "overlap", timeout=60, errors="return")
    _take_leaked(no_leaks)
    assert [g[0] if isinstance(g, list) else g for g in got] == ["mismatch"] * 3, got


@pytest.mark.parametrize("variant", ["overlap", "disjoint"])
def test_new_group_mismatch_then_an_agreed_group_works(run_ranks, no_leaks, variant):
    got = run_ranks(new_group_disagree, 3, variant, timeout=60, errors="return")
    leaked = _take_leaked(no_leaks)
    assert got == [["mismatch", [3.0, 3.0]]] * 3 and leaked == [], (got, leaked)


# ---------------------------------------------------------------- timeouts

def timeouts(rank, world_size, init_method, how):
    if how == "env":
        _init(rank, world_size, init_method)
    elif how == "timedelta":
        _init(rank, world_size, init_method, timeout=datetime.timedelta(seconds=1.5))
    else:
        _init(rank, world_size, init_method, timeout=1.5)
    res = None
    if rank == 1:
        t0 = time.monotonic()
        try:
            dist.recv(np.zeros(3), 0, tag=99).wait()
            res = "no timeout"
        except dist.DistTimeoutError as e:
            res = (isinstance(e, TimeoutError), time.monotonic() - t0 < 30, "rank 1" in str(e))
        dist.send(np.zeros(1), 0).wait(timeout=60)
    else:
        dist.recv(np.zeros(1), 1).wait(timeout=60)     # a collective would time out here too
    dist.destroy_process_group()
    return res


@pytest.mark.parametrize("how", ["env", "timedelta", "seconds"])
def test_timeout_as_seconds_timedelta_or_environment(run_ranks, how):
    # the argument wins over SHMDIST_TIMEOUT: with it, the environment says an hour
    env = {"SHMDIST_TIMEOUT": "1.5" if how == "env" else "3600"}
    got = run_ranks(timeouts, 2, how, timeout=60, env=env)[1]
    assert got == (True, True, True)


# ---------------------------------------------------------------- fork

def fork_touches_request(rank, world_size, init_method, what):
    """Rank 1 posts a receive, forks, and the child touches the parent's
    request (wait / is_completed). README: a forked child 'gets a DistError
    saying it was forked if it touches the parent's group'; it must not take
    the parent's message."""
    _init(rank, world_size, init_method, timeout=20)
    out = None
    if rank == 0:
        dist.barrier()                              # the child has touched the request
        dist.send(np.arange(4, dtype=np.int64), 1).wait()
        dist.send(np.arange(40000, dtype=np.int64), 1).wait()
    else:
        small = np.zeros(4, dtype=np.int64)
        big = np.zeros(40000, dtype=np.int64)
        reqs = [dist.recv(small, 0), dist.recv(big, 0)]
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            lines = []
            for q in reqs:
                try:
                    if what == "wait":
                        q.wait(timeout=2)
                    else:
                        for _ in range(50):
                            q.is_completed()
                            time.sleep(0.01)
                    lines.append("no error")
                except dist.DistError as e:
                    lines.append("forked" if "fork" in str(e) else f"{type(e).__name__}: {e}")
                except BaseException as e:  # noqa: BLE001
                    lines.append(f"{type(e).__name__}: {e}")
            os.write(w, ";".join(lines).encode())
            os._exit(0)
        os.close(w)
        dist.barrier()
        with os.fdopen(r) as f:
            child = f.read()
        os.waitpid(pid, 0)
        try:
            for q in reqs:
                q.wait(timeout=10)
            out = (child, small.tolist() == list(range(4)), bool((big == np.arange(40000)).all()))
        except dist.DistError as e:
            out = (child, f"parent: {type(e).__name__}: {e}")
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("what", ["wait", "is_completed"])
def test_forked_child_touching_the_parents_requests_gets_an_error(run_ranks, what):
    got = run_ranks(fork_touches_request, 2, what, timeout=60, errors="return")[1]
    assert got == ("forked;forked", True, True), got


def fork_touches_group(rank, world_size, init_method):
    """The child touches the parent's groups every other way README implies:
    a subgroup, every query, p2p and collectives on it, object collectives.
    Each is a DistError naming the fork; the parent's job goes on."""
    _init(rank, world_size, init_method, timeout=20)
    sub = dist.new_group([0, 1])
    out = None
    if rank == 0:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            x = np.ones(4)
            calls = [lambda: dist.get_rank(sub), lambda: dist.get_world_size(), lambda: dist.get_backend(),
                     lambda: dist.memory_usage(), lambda: dist.barrier(), lambda: dist.barrier(group=sub),
                     lambda: dist.all_reduce(x), lambda: dist.all_reduce(x, group=sub),
                     lambda: dist.broadcast(x, 0), lambda: dist.send(x, 1), lambda: dist.recv(x, 1),
                     lambda: dist.recv(x, None), lambda: dist.send(x, 1, group=sub),
                     lambda: dist.all_gather_object([None, None], 1), lambda: dist.send_object_list([1], 1),
                     lambda: dist.new_group([0, 1]), lambda: dist.destroy_process_group(sub)]
            lines = []
            for call in calls:
                try:
                    call()
                    lines.append("no error")
                except dist.DistError as e:
                    lines.append("forked" if "forked" in str(e) else str(e))
                except BaseException as e:  # noqa: BLE001
                    lines.append(f"{type(e).__name__}: {e}")
            os.write(w, "\n".join(lines).encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            out = f.read().split("\n")
        os.waitpid(pid, 0)
    x = np.full(4, rank + 1.0)
    dist.all_reduce(x, group=sub)
    box = np.zeros(3)
    reqs = [dist.send(np.full(3, float(rank)), 1 - rank), dist.recv(box, 1 - rank)]
    for q in reqs:
        q.wait()
    ok = x.tolist() == [3.0] * 4 and box.tolist() == [float(1 - rank)] * 3
    dist.destroy_process_group()
    return out, ok


def test_forked_child_touching_the_parents_groups_gets_a_fork_error(run_ranks):
    (lines, ok0), (_, ok1) = run_ranks(fork_touches_group, 2, timeout=60)
    assert lines == ["forked"] * 17, lines
    assert ok0 and ok1


# ---------------------------------------------------------------- threads

def threads_two_groups(rank, world_size, init_method, rounds):
    """Thread A ping-pongs on the default group while thread B runs
    all_reduce on a subgroup of the same ranks; both check every value."""
    _init(rank, world_size, init_method, timeout=30)
    sub = dist.new_group([0, 1])
    errors = []

    def p2p():
        try:
            for i in range(rounds):
                box = np.zeros(64, dtype=np.int64)
                reqs = [dist.send(np.full(64, rank * 1000 + i, dtype=np.int64), 1 - rank, tag=7),
                        dist.recv(box, 1 - rank, tag=7)]
                for q in reqs:
                    q.wait()
                if box[0] != (1 - rank) * 1000 + i or not (box == box[0]).all():
                    errors.append(("p2p", i, int(box[0])))
        except Exception as e:  # noqa: BLE001
            errors.append(("p2p", repr(e)))

    def coll():
        try:
            for i in range(rounds):
                x = np.full(1000, float(rank + i))
                dist.all_reduce(x, group=sub)
                if not (x == 2 * i + 1).all():
                    errors.append(("coll", i, float(x[0])))
        except Exception as e:  # noqa: BLE001
            errors.append(("coll", repr(e)))

    ts = [threading.Thread(target=p2p), threading.Thread(target=coll)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dist.barrier()
    dist.destroy_process_group()
    return errors


def test_threads_use_point_to_point_and_a_subgroups_collectives_at_once(run_ranks):
    assert run_ranks(threads_two_groups, 2, 300, timeout=120) == [[], []]


# ---------------------------------------------------------------- init methods and error texts

def via_method(rank, world_size, init_method, method):
    dist.init_process_group(backend="gloo", init_method=method, rank=rank, world_size=world_size)
    x = np.full(2, rank + 1.0)
    dist.all_reduce(x)
    ok = x.tolist() == [3.0, 3.0] and dist.get_rank() == rank and dist.get_world_size() == 2
    dist.destroy_process_group()
    return ok


def test_file_and_env_init_methods(run_ranks, tmp_path):
    assert run_ranks(via_method, 2, f"file://{tmp_path}/rdv", timeout=60) == [True, True]
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    assert run_ranks(via_method, 2, "env://", timeout=60, env=env) == [True, True]
    assert run_ranks(via_method, 2, None, timeout=60, env={**env, "MASTER_PORT": str(free_port())}) == [True, True]


def error_texts(rank, world_size, init_method):
    """Bad calls of every family: each message names the rank and the
    operation (README: 'every message names the rank, the operation, what was
    expected and what to do'). A collective with bad arguments is still a
    collective call (README: every rank makes it), so every rank makes those;
    the point-to-point and set-up ones only rank 0."""
    _init(rank, world_size, init_method, timeout=20)
    sub = dist.new_group([0, 1])
    out = []
    calls = {
        "broadcast": lambda: dist.broadcast(np.zeros(3), 7),
        "all_reduce": lambda: dist.all_reduce(np.zeros(3), "NOPE"),
        "gather": lambda: dist.gather(np.zeros(3), [np.zeros(3)] if rank == 0 else None, 0),
        "all_to_all_single": lambda: dist.all_to_all_single(np.zeros(3), np.zeros(3)),
        "scatter_object_list": lambda: dist.scatter_object_list([], [1, 2], 0),
    }
    if rank == 0:
        ro = np.zeros(3)
        ro.flags.writeable = False
        calls.update({
            "send": lambda: dist.send(np.zeros(3), 0),                  # to itself
            "recv": lambda: dist.recv(np.zeros(3), 5),                  # no such rank
            "recv ": lambda: dist.recv(ro, 1),                          # read-only buffer
            "send  ": lambda: dist.send(np.zeros(3), 1, tag=1 << 70),   # tag too big
            "new_group": lambda: dist.new_group([0, 0]),
        })
    for op, call in calls.items():
        try:
            call()
            out.append((op, "no error"))
        except (dist.DistError, TypeError, ValueError) as e:
            out.append((op, f"rank {rank}" in str(e) and op.strip() in str(e)))
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_error_messages_name_the_rank_and_the_operation(run_ranks):
    for got in run_ranks(error_texts, 2, timeout=60):
        assert got and all(ok is True for _, ok in got), got


def reinit_other_sizes(rank, world_size, init_method, ports):
    """World of 3, then of 2 (rank 2 sits out), then of 3 again, in the same
    processes: the second job's ranks, rings and lanes must not remember the first."""
    oks = []
    plan = [(init_method, 3), (f"tcp://127.0.0.1:{ports[0]}", 2), (f"tcp://127.0.0.1:{ports[1]}", 3)]
    for i, (method, size) in enumerate(plan):
        if rank >= size:
            continue
        _init(rank, size, method, timeout=30)
        oks.append(bool(_round_trip(rank, size, i)) and dist.get_world_size() == size)
        dist.destroy_process_group()
    return oks


def test_init_destroy_init_with_another_world_size(run_ranks):
    got = run_ranks(reinit_other_sizes, 3, [free_port(), free_port()], timeout=120)
    assert got == [[True] * 3, [True] * 3, [True] * 2]


def destroy_while_another_thread_waits(rank, world_size, init_method, what):
    """A thread blocked in wait() (or in a collective) while the main thread
    calls destroy_process_group: README says pending requests fail with a
    DistError; the process must not crash on memory unmapped under it."""
    _init(rank, world_size, init_method, timeout=30)
    sub = dist.new_group([0, 1])
    out = {}
    if rank == 0:
        started = threading.Event()

        def waiter():
            try:
                if what == "recv":
                    q = dist.recv(np.zeros(4), 1, tag=42)
                    started.set()
                    q.wait()
                elif what == "subgroup all_reduce":
                    started.set()
                    dist.all_reduce(np.ones(4), group=sub)
                else:
                    started.set()
                    dist.all_reduce(np.ones(4))
                out["waiter"] = "completed"
            except dist.DistError as e:
                out["waiter"] = type(e).__name__
            except BaseException as e:  # noqa: BLE001
                out["waiter"] = f"{type(e).__name__}: {e}"

        t = threading.Thread(target=waiter)
        t.start()
        started.wait()
        time.sleep(0.5)                 # ordering only: the thread is asleep in its wait by then
        dist.destroy_process_group(sub if what == "subgroup all_reduce" else None)
        t.join(20)
        if what == "subgroup all_reduce":
            dist.destroy_process_group()
        out["joined"] = not t.is_alive()
        return out
    time.sleep(2.0)                     # rank 1 stays up without calling anything, then leaves
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("what", ["recv", "all_reduce", "subgroup all_reduce"])
def test_destroy_while_another_thread_waits(run_ranks, what):
    got = run_ranks(destroy_while_another_thread_waits, 2, what, timeout=60, errors="return")
    assert isinstance(got[0], dict), got
    assert got[0]["joined"] and got[0]["waiter"] in ("DistError", "DistPeerError", "DistTimeoutError"), got

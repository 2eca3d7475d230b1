"""init_process_group and friends: the rendezvous schemes, the queries, re-init,
and the errors a wrong start-up gets."""
from __future__ import annotations

import os
import socket
import time
from urllib.parse import urlparse

import numpy as np
import pytest

import shmdist as dist
from ranks import RankError, free_port


# ---------------------------------------------------------------- errors found before any rank meets
# (these run in the test process itself: init fails before it changes anything)

def test_queries_before_init_say_to_call_init_process_group():
    assert not dist.is_initialized()
    with pytest.raises(dist.DistNotInitializedError, match="call shmdist.init_process_group"):
        dist.get_rank()
    with pytest.raises(dist.DistNotInitializedError, match="get_world_size"):
        dist.get_world_size()


def test_unknown_scheme_is_named():
    with pytest.raises(dist.DistError, match=r"unknown init_method scheme 'udp://'.*tcp://HOST:PORT"):
        dist.init_process_group("shm", "udp://127.0.0.1:1234", rank=0, world_size=1)
    assert not dist.is_initialized()


def test_unknown_backend_is_named():
    with pytest.raises(dist.DistError, match=r"unknown backend 'nccl'.*'shm'"):
        dist.init_process_group("nccl", f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


@pytest.mark.parametrize("rank", [2, -1])
def test_rank_outside_the_world_is_refused(rank):
    with pytest.raises(dist.DistError, match=rf"rank {rank} is outside \[0, 2\)"):
        dist.init_process_group("shm", f"tcp://127.0.0.1:{free_port()}", rank=rank, world_size=2)


def test_port_taken_is_reported_for_rank_0():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(dist.DistError, match=rf"tcp:// rendezvous: port {port} .* already in use"):
            dist.init_process_group("shm", f"tcp://127.0.0.1:{port}", rank=0, world_size=2, timeout=5)
    assert not dist.is_initialized()


def test_unreachable_master_times_out():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(dist.DistTimeoutError, match=rf"could not reach the master at 127.0.0.1:{port} "
                                                    r"within 1 s.*rank 0 is running"):
        dist.init_process_group("shm", f"tcp://127.0.0.1:{port}", rank=1, world_size=2, timeout=1)
    elapsed = time.monotonic() - start
    assert 0.8 <= elapsed <= 5, f"a 1 s rendezvous timeout took {elapsed:.2f} s"


def test_env_scheme_names_the_missing_variable(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(dist.DistError, match="environment variable RANK expected, but not set"):
        dist.init_process_group("shm", "env://")


# ---------------------------------------------------------------- errors found when ranks meet

def claim_rank_twice(i, world_size, init_method, marker):
    """Processes 1 and 2 both say they are rank 1; the second to arrive is refused."""
    rank = [0, 1, 1][i]
    try:
        dist.init_process_group("shm", init_method, rank=rank, world_size=2, timeout=30)
    except dist.DistError as e:
        open(marker, "w").close()
        return str(e)
    deadline = time.monotonic() + 30      # keep the store up until the refused process has heard
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    dist.destroy_process_group()
    return "joined"


def test_two_processes_claiming_one_rank(run_ranks, tmp_path):
    results = run_ranks(claim_rank_twice, 3, str(tmp_path / "refused"))
    assert results[0] == "joined"
    refused = [r for r in results[1:] if r != "joined"]
    assert len(refused) == 1, f"exactly one claimant of rank 1 must be refused: {results}"
    assert "rank 1: init_process_group: rank 1 is already claimed by another process" in refused[0]


def disagree_on_world_size(rank, world_size, init_method, sizes):
    dist.init_process_group("shm", init_method, rank=rank, world_size=sizes[rank], timeout=3)


def test_world_sizes_that_disagree(run_ranks):
    first, second = run_ranks(disagree_on_world_size, 2, [2, 3], errors="return")
    assert isinstance(first, RankError) and isinstance(first.exc, dist.DistMismatchError)
    assert "rank 0: init_process_group: rank 1 was started with world_size 3 but this rank with 2" \
        in first.message
    # Rank 1 waits for a rank 2 that never comes; it ends when rank 0 gives up.
    assert isinstance(second, RankError) and isinstance(second.exc, dist.DistError)


def test_rank_0_with_the_larger_world_size_learns_of_the_mismatch(run_ranks):
    for rank, error in enumerate(run_ranks(disagree_on_world_size, 2, [3, 2], errors="return")):
        assert isinstance(error.exc, dist.DistMismatchError), f"rank {rank}: {error}"


# ---------------------------------------------------------------- rendezvous schemes

def ping(rank: int, world_size: int) -> list:
    """Every rank sends its rank to rank 0, which returns what it got."""
    if rank == 0:
        got = []
        for src in range(1, world_size):
            box = np.zeros(1, dtype=np.int64)
            dist.recv(box, src=src).wait()
            got.append(int(box[0]))
        return got
    dist.send(np.array([rank]), dst=0).wait()
    return []


def by_env(rank, world_size, init_method):
    url = urlparse(init_method)
    os.environ.update(MASTER_ADDR=url.hostname, MASTER_PORT=str(url.port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    dist.init_process_group()          # env:// and backend shm are the defaults
    result = (dist.get_rank(), dist.get_world_size(), dist.get_backend(), ping(rank, world_size))
    dist.destroy_process_group()
    return result


def test_env_rendezvous(run_ranks):
    assert run_ranks(by_env, 3) == [(0, 3, "shm", [1, 2]), (1, 3, "shm", []), (2, 3, "shm", [])]


def by_file(rank, world_size, init_method, path):
    dist.init_process_group("shm", f"file://{path}", rank=rank, world_size=world_size, timeout=30)
    result = ping(rank, world_size)
    dist.destroy_process_group()
    return result


def test_file_rendezvous_removes_its_file(run_ranks, tmp_path):
    path = tmp_path / "rendezvous"
    assert run_ranks(by_file, 3, str(path)) == [[1, 2], [], []]
    assert not path.exists(), "the last rank to leave removes the rendezvous file"


# ---------------------------------------------------------------- queries and groups

def queries(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    group = dist.new_group([0, 2, 3])
    result = {
        "initialized": dist.is_initialized(),
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "group_rank": dist.get_rank(group),
        "group_size": dist.get_world_size(group),
    }
    dist.destroy_process_group()
    result["initialized_after_destroy"] = dist.is_initialized()
    return result


def test_rank_world_size_and_backend_queries(run_ranks):
    results = run_ranks(queries, 4)
    group_ranks = [0, -1, 1, 2]
    for rank, got in enumerate(results):
        member = group_ranks[rank] >= 0
        assert got == {"initialized": True, "rank": rank, "world_size": 4, "backend": "shm",
                       "group_rank": group_ranks[rank], "group_size": 3 if member else -1,
                       "initialized_after_destroy": False}, f"rank {rank}"


def init_twice(rank, world_size, init_method, second_port):
    got = []
    for method in (init_method, f"tcp://127.0.0.1:{second_port}"):
        dist.init_process_group("shm", method, rank=rank, world_size=world_size)
        got.append(ping(rank, world_size))
        dist.destroy_process_group()
    return got


def test_init_destroy_init_in_one_process(run_ranks):
    assert run_ranks(init_twice, 2, free_port()) == [[[1], [1]], [[], []]]


def init_while_initialized(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    try:
        dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    except dist.DistError as e:
        message = str(e)
    else:
        raise AssertionError("a second init_process_group without destroy_process_group succeeded")
    dist.destroy_process_group()
    return message


def test_second_init_without_destroy_is_refused(run_ranks):
    for rank, message in enumerate(run_ranks(init_while_initialized, 2)):
        assert f"rank {rank}: init_process_group: trying to initialize the default process group twice" \
            in message


# ---------------------------------------------------------------- rank 0 serves the store: it must outlive its use

def late_for_the_store(rank, world_size, init_method, step):
    """Ranks other than 0 read every store reply late; rank 0 destroys its
    group as soon as init (or new_group) returns, as a user's script may."""
    if rank != 0:
        recv_exact = dist.rendezvous.store.recv_exact

        def slow_recv_exact(sock, n, closed="connection closed"):
            time.sleep(0.05)
            return recv_exact(sock, n, closed)
        dist.rendezvous.store.recv_exact = slow_recv_exact
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=30)
    if step == "new_group":
        dist.new_group([0, 1])
    dist.destroy_process_group()
    return step


@pytest.mark.parametrize("step", ["init", "new_group"])
def test_rank_0_may_leave_right_after_the_last_store_call(run_ranks, step):
    """Rank 0 serves the tcp:// store; ranks still reading its last answers must not be stranded."""
    assert run_ranks(late_for_the_store, 3, step) == [step] * 3


def claims_on_a_kept_store(rank, world_size, init_method, port):
    """One store kept across inits (as torch keeps its TCPStore per port): this process
    inits, leaves and inits again as rank 0 three times; then a forked child, another
    process, asks for rank 0 in the same store and must be refused at once."""
    from shmdist.rendezvous import store as rv
    st = rv.TCPStore("127.0.0.1", port, is_master=True, timeout=10)
    got = []
    for _ in range(3):
        dist.init_process_group("shm", store=st, rank=0, world_size=1, timeout=10)
        x = np.ones(4)
        dist.all_reduce(x)
        got.append(float(x[0]))
        dist.destroy_process_group()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                       # the child: a client of the parent's store
        text = "initialized"
        try:
            client = rv.TCPStore("127.0.0.1", port, is_master=False, timeout=10)
            dist.init_process_group("shm", store=client, rank=0, world_size=1, timeout=5)
        except Exception as e:         # noqa: BLE001 - the outcome is the result
            text = f"{type(e).__name__}: {e}"
        os.write(w, text.encode()[:4000])
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        child = f.read()
    os.waitpid(pid, 0)
    st.close()
    return got, child


def test_init_again_on_a_kept_store_works_and_another_process_is_still_refused(run_ranks):
    """init -> destroy -> init on one store that keeps its keys (torch hands the next init
    the same TCPStore) works; a process that never claimed the rank in that store (a
    forked child: the parent's claims are not its own) is refused as before."""
    got, child = run_ranks(claims_on_a_kept_store, 1, free_port(), timeout=60)[0]
    assert got == [1.0, 1.0, 1.0]
    assert child.startswith("DistError") and "already claimed by another process" in child, child

"""The failure model: mismatched sizes, deadlines, dead and departed peers,
Ctrl-C, and the test harness's own handling of ranks that fail or hang."""
from __future__ import annotations

import glob
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import shmdist as dist
from ranks import RankError, RankFailed, RankTimeout, wait_until_gone

pytest_plugins = ["pytester"]


# ---------------------------------------------------------------- mismatched receives

def size_mismatch(rank, world_size, init_method, posted_first):
    """A wrong-sized or wrong-typed receive fails alone; the message stays for the next one."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    sent = np.arange(10, dtype=np.float32)
    if rank == 0:
        dist.recv(np.zeros(1, dtype=np.uint8), src=1, tag=9).wait()     # rank 1 is ready
        dist.send(sent, dst=1).wait()
        dist.send(np.arange(4, dtype=np.int32), dst=1, tag=2).wait()
        dist.send(np.zeros(1, dtype=np.uint8), dst=1, tag=1).wait()      # both have arrived
        echo = np.zeros(10, dtype=np.float32)
        dist.recv(echo, src=1).wait()
        result = echo.tolist()
    else:
        too_small = dist.recv(np.zeros(4, dtype=np.float32), src=0) if posted_first else None
        dist.send(np.zeros(1, dtype=np.uint8), dst=0, tag=9).wait()
        if not posted_first:
            dist.recv(np.zeros(1, dtype=np.uint8), src=0, tag=1).wait()
            too_small = dist.recv(np.zeros(4, dtype=np.float32), src=0)
        errors = []
        for req in (too_small, dist.recv(np.zeros(4, dtype=np.float32), src=0, tag=2)):
            try:
                req.wait(timeout=30)
            except dist.DistMismatchError as e:
                errors.append(str(e))
        right = np.zeros(10, dtype=np.float32)
        dist.recv(right, src=0).wait(timeout=30)
        dist.send(right, dst=0).wait()
        result = errors
    dist.destroy_process_group()
    return result


@pytest.mark.parametrize("posted_first", [True, False], ids=["recv-posted-first", "message-first"])
def test_size_mismatch_is_reported_and_the_message_kept(run_ranks, posted_first):
    echo, errors = run_ranks(size_mismatch, 2, posted_first)
    assert len(errors) == 2, f"both wrong receives must fail, got {errors}"
    size, dtype = errors
    assert "rank 1: recv" in size
    assert "expected 16 bytes (float32[4]) from rank 0" in size and "got 40 bytes (float32[10])" in size
    assert "expected 16 bytes (float32[4]) from rank 0" in dtype and "got 16 bytes (int32[4])" in dtype
    assert echo == list(range(10)), "the message must reach the correctly sized receive after the error"


# ---------------------------------------------------------------- deadlines

def wait_times_out(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    box = np.zeros(1, dtype=np.int64)
    if rank == 0:
        req = dist.recv(box, src=1)
        if req.is_completed():
            raise AssertionError("is_completed() is True although rank 1 sent nothing")
        start = time.monotonic()
        try:
            req.wait(timeout=1)
            raise AssertionError("wait(timeout=1) returned although rank 1 sent nothing")
        except dist.DistTimeoutError as e:
            error, elapsed = e, time.monotonic() - start
        dist.send(box, dst=1).wait()                 # now rank 1 may send
        req = dist.recv(box, src=1)
        req.wait(timeout=30)
        if not req.is_completed():
            raise AssertionError("is_completed() is False after wait() returned")
        result = (elapsed, isinstance(error, TimeoutError), isinstance(error, dist.DistError), str(error),
                  int(box[0]))
    else:
        dist.recv(box, src=0).wait()
        dist.send(np.array([42]), dst=0).wait()
        result = None
    dist.destroy_process_group()
    return result


def test_wait_timeout_raises_and_the_group_keeps_working(run_ranks):
    elapsed, is_timeout_error, is_dist_error, message, after = run_ranks(wait_times_out, 2)[0]
    assert is_timeout_error and is_dist_error
    assert 0.8 <= elapsed <= 5, f"wait(timeout=1) raised after {elapsed:.2f} s"
    assert "rank 0: recv from rank 1" in message and "Timed out after 1 s" in message
    assert "with rank 1" not in message, message   # the peer is named once
    assert after == 42, "a receive posted after the timeout must get the next message"


def send_times_out(rank, world_size, init_method, nbytes):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    if rank == 0:
        req = dist.isend(np.ones(nbytes, dtype=np.uint8), dst=1)
        try:
            req.wait(timeout=1)
            raise AssertionError("wait(timeout=1) returned although rank 1 received nothing")
        except dist.DistTimeoutError as e:
            result = str(e)
        req.wait(timeout=60)
    else:
        time.sleep(4)       # not receiving: the message does not fit the ring, so rank 0 must wait
        box = np.zeros(nbytes, dtype=np.uint8)
        dist.recv(box, src=0).wait()
        result = bool(box.all())
    dist.destroy_process_group()
    return result


def test_send_timeout_keeps_a_started_message_pending(run_ranks):
    message, received = run_ranks(send_times_out, 2, 4 << 20)
    assert "rank 0: send to rank 1" in message and "Timed out" in message
    assert "wait() again" in message
    assert received is True


# ---------------------------------------------------------------- peers that die or leave

def peer_goes_away(rank, world_size, init_method, how, direction):
    """Rank 1 dies (SIGKILL) or leaves (destroy_process_group) while rank 0 waits on it."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    pid = np.array([os.getpid()], dtype=np.int64)
    if rank == 1:
        dist.recv(pid, src=0).wait()
        dist.send(np.zeros(1, dtype=np.uint8), dst=0).wait()
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        dist.destroy_process_group()
        wait_until_gone(int(pid[0]))    # alive but out of the group while rank 0 waits
        return None
    dist.send(pid, dst=1).wait()
    dist.recv(np.zeros(1, dtype=np.uint8), src=1).wait()
    if direction == "recv":
        req = dist.recv(np.zeros(8, dtype=np.uint8), src=1)
    else:
        req = dist.isend(np.ones(8 << 20, dtype=np.uint8), dst=1)    # more than the ring holds
    start = time.monotonic()
    try:
        req.wait(timeout=60)
        raise AssertionError(f"{direction} completed although rank 1 is gone")
    except dist.DistPeerError as e:
        result = (time.monotonic() - start, str(e))
    dist.destroy_process_group()
    return result


@pytest.mark.parametrize("direction", ["recv", "send"])
@pytest.mark.parametrize("how", ["sigkill", "destroy"])
def test_waiting_on_a_peer_that_goes_away_raises_naming_it(run_ranks, no_leaks, how, direction):
    survivor, gone = run_ranks(peer_goes_away, 2, how, direction, errors="return")
    if how == "sigkill":
        assert isinstance(gone, RankError) and gone.exitcode == -signal.SIGKILL
    elapsed, message = survivor
    assert elapsed < 2, f"the survivor noticed after {elapsed:.2f} s"
    assert f"rank 0: {direction}" in message
    assert ("rank 1 died" if how == "sigkill" else "rank 1 left the group") in message
    assert glob.glob(f"/dev/shm/shmdist-{no_leaks}-*") == []


def pending_at_destroy(rank, world_size, init_method, where):
    """Operations still pending when their rank calls destroy_process_group:
    a receive waiting in the fast lane (``where`` "lane") or posted to the
    engine ("engine"), and a send too big for the ring. Their wait() and
    is_completed() afterwards must answer, not touch unmapped memory."""
    from shmdist.api import fast
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    box = np.zeros(4)
    out = {}
    if rank == 1:
        dist.recv(box, 0).wait()        # teaches the lane float64 through the general path
        recv = dist.irecv(np.zeros(4), 0 if where == "lane" else None)
        out["in lane"] = fast.paths.lane.pending is recv
        send = dist.isend(np.zeros((64 << 20) // 8), 0)
        dist.destroy_process_group()
        for name, req in (("recv", recv), ("send", send)):
            out[name + " completed"] = req.is_completed()
            try:
                req.wait(timeout=5)
                out[name] = "returned"
            except dist.DistError as e:
                out[name] = "destroy_process_group" in str(e) and "rank 1" in str(e)
    else:
        dist.send(box, 1).wait()
        dist.destroy_process_group()
    return out


@pytest.mark.parametrize("where", ["lane", "engine"])
def test_wait_after_destroy_raises_instead_of_crashing(run_ranks, where):
    got = run_ranks(pending_at_destroy, 2, where)[1]
    assert got == {"in lane": where == "lane", "recv completed": True, "recv": True,
                   "send completed": True, "send": True}


def interrupted(rank, world_size, init_method):
    """Rank 1 sends SIGINT to rank 0 while rank 0 blocks in wait()."""
    # Python raises KeyboardInterrupt only if SIGINT was not ignored when it started, and a shell
    # starts background jobs (`pytest &`, nohup) with SIGINT ignored: put Python's handler back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    word = np.zeros(1, dtype=np.int64)
    if rank == 0:
        word[0] = os.getpid()
        dist.send(word, dst=1).wait()
        start = time.monotonic()
        try:
            dist.recv(word, src=1).wait(timeout=60)
            raise AssertionError("wait() returned although rank 1 sent nothing")
        except KeyboardInterrupt:
            result = time.monotonic() - start
        dist.send(word, dst=1, tag=1).wait()      # rank 1 may go
    else:
        dist.recv(word, src=0).wait()
        time.sleep(0.5)                         # rank 0 is blocked in wait() by now
        os.kill(int(word[0]), signal.SIGINT)
        dist.recv(word, src=0, tag=1).wait()
        result = None
    dist.destroy_process_group()
    return result


def test_ctrl_c_interrupts_a_blocked_wait(run_ranks):
    blocked = run_ranks(interrupted, 2)[0]
    assert blocked < 5, f"KeyboardInterrupt came {blocked:.2f} s after wait() began (SIGINT at 0.5 s)"


# ---------------------------------------------------------------- the harness itself

def fails_or_sleeps(rank, world_size, init_method):
    if rank == 1:
        raise ValueError("rank 1 gives up")
    time.sleep(60)


def test_harness_reraises_a_rank_error_with_its_traceback(run_ranks):
    with pytest.raises(RankFailed) as info:
        run_ranks(fails_or_sleeps, 2, timeout=30)
    text = str(info.value)
    assert "rank 1 raised ValueError: rank 1 gives up" in text
    assert "killed ranks [0]" in text
    assert 'in fails_or_sleeps\n    raise ValueError("rank 1 gives up")' in text


def fails_or_returns(rank, world_size, init_method):
    if rank == 1:
        raise ValueError("rank 1 gives up")
    return "done"


def test_harness_returns_rank_errors_on_request(run_ranks):
    returned, failed = run_ranks(fails_or_returns, 2, errors="return")
    assert returned == "done"
    assert isinstance(failed, RankError) and isinstance(failed.exc, ValueError)
    assert failed.type == "ValueError" and failed.message == "rank 1 gives up" and failed.exitcode == 0


def sleeps_if_odd(rank, world_size, init_method):
    if rank % 2:
        time.sleep(60)
    return rank


def test_harness_names_the_ranks_that_did_not_finish(run_ranks):
    with pytest.raises(RankTimeout, match=r"ranks \[1, 3\] had not finished within 3 s"):
        run_ranks(sleeps_if_odd, 4, timeout=3)


def reads_env(rank, world_size, init_method):
    env = os.environ
    return env.get("SHMDIST_RING_BYTES"), env.get("SHMDIST_TIMEOUT"), env.get("SHMDIST_JOB_ID"), init_method


def test_harness_sets_the_environment_of_every_rank(run_ranks, no_leaks, monkeypatch):
    monkeypatch.setenv("SHMDIST_TIMEOUT", "77")
    monkeypatch.delenv("SHMDIST_RING_BYTES", raising=False)
    results = run_ranks(reads_env, 2, env={"SHMDIST_RING_BYTES": "65536", "SHMDIST_TIMEOUT": None})
    assert results[0] == results[1]
    ring, timeout, job, init_method = results[0]
    assert ring == "65536" and timeout is None and job == no_leaks
    assert init_method.startswith("tcp://127.0.0.1:")
    assert os.environ["SHMDIST_TIMEOUT"] == "77" and "SHMDIST_RING_BYTES" not in os.environ


LEAKY_TESTS = '''
import os
import subprocess


def test_leaves_a_child_process():
    subprocess.Popen(["sleep", "60"])


def test_leaves_a_segment():
    with open("/dev/shm/shmdist-" + os.environ["SHMDIST_JOB_ID"] + "-leak", "x") as f:
        f.write("x" * 4096)


def test_clean():
    pass
'''


def test_leak_check_fails_the_leaking_test_and_cleans_up(pytester):
    here = Path(__file__).parent
    pytester.makeconftest((here / "conftest.py").read_text())
    pytester.makepyfile(ranks=(here / "ranks.py").read_text(), test_leaky=LEAKY_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines_random([
        "*ERROR at teardown of test_leaves_a_child_process*",
        "the test leaked: child processes [[]*[]] are still alive (killed now)*",
        "*ERROR at teardown of test_leaves_a_segment*",
        "the test leaked: shared memory [[]'/dev/shm/shmdist-pytest*-leak'[]] was left behind (removed now)*",
    ])
    assert glob.glob("/dev/shm/shmdist-*-leak") == []

"""The flight recorder attacked from outside (issue 17): hangs that its first
tests did not build, each with short timeouts, and the verdict they must
get; threads; several errors at once with SHMDIST_TRACE_DIR; --hang-after
behind newer operations; a metadata page too small for a big job."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import shmdist as dist
from test_trace import (ROOT, _idle_until, _nothing_new_in_dev_shm, _raise, _short_timeout,  # noqa: F401
                        _timeout_text)


# ---------------------------------------------------------------- receives

def _recv_any_nobody_sends(rank, world_size, init_method, flag):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    dist.all_reduce(np.ones(2, dtype=np.float32))
    text = ""
    if rank == 0:
        text = _timeout_text(lambda: dist.recv(np.zeros(2), tag=5).wait(timeout=1.0))
        _raise(flag)
    else:
        _idle_until(flag)
    dist.destroy_process_group()
    return text


def test_a_receive_from_any_rank_nobody_sends_to(run_ranks, tmp_path):
    """It was "no hang found: the waiting ranks' peers are in the matching operations"."""
    text = run_ranks(_recv_any_nobody_sends, 3, str(tmp_path / "flag"), timeout=60)[0]
    assert "rank 0: in recv from any rank (tag 5, 16 B float64), waiting for any rank" in text
    assert ("a receive nobody sends to: rank 0 waits in recv from any rank (tag 5, 16 B float64), but no rank "
            "has a send to rank 0 pending: rank 1 is not inside any shmdist call") in text, text
    assert "rank 2 is not inside any shmdist call" in text
    assert "no hang found" not in text


def _received_tag_then_another(rank, world_size, init_method, flag):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    text = ""
    if rank == 0:
        first = dist.irecv(np.zeros(2), src=1, tag=1)      # a window of two receives:
        second = dist.irecv(np.zeros(2), src=1, tag=2)     # rank 1 sends the first one only
        _raise(flag + ".posted")
        text = _timeout_text(lambda: second.wait(timeout=1.5))
        assert first.is_completed()
        _raise(flag)
    else:
        _idle_until(flag + ".posted")
        dist.send(np.ones(2), dst=0, tag=1).wait()
        _idle_until(flag)
    dist.destroy_process_group()
    return text


def test_a_send_already_received_is_not_a_tag_that_differs(run_ranks, tmp_path):
    """Rank 1's send with tag 1 was taken by rank 0's receive with tag 1: the
    receive with tag 2 has nobody sending to it. It was "tags differ"."""
    text = run_ranks(_received_tag_then_another, 2, str(tmp_path / "flag"), timeout=60)[0]
    assert ("a receive nobody sends to: rank 0 waits in recv from rank 1 (tag 2, 16 B float64), but rank 1 has "
            "no send to rank 0 pending: rank 1 is not inside any shmdist call; its last operation, send to rank 0 "
            "(tag 1, 16 B float64)") in text, text
    assert "tags differ" not in text


def _groups_differ(rank, world_size, init_method, flag):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    sub = dist.new_group([0, 2])
    text = ""
    if rank == 0:      # receives within the group, rank 2 sends on WORLD: same tag, another group
        text = _timeout_text(lambda: dist.recv(np.zeros(2), src=2, group=sub, tag=2).wait(timeout=1.5))
        _raise(flag)
    else:
        if rank == 2:
            dist.send(np.ones(2), dst=0, tag=2).wait()
        _idle_until(flag)
    dist.destroy_process_group()
    return text


def test_groups_that_differ_are_not_called_tags_that_differ(run_ranks, tmp_path):
    text = run_ranks(_groups_differ, 3, str(tmp_path / "flag"), timeout=60)[0]
    assert ("groups differ: rank 0 waits in recv from rank 2 (tag 2, 16 B float64, group [0, 2]), but rank 2's "
            "send to rank 0 (tag 2, 16 B float64) does not match it; use the same tag and group on both sides") \
        in text, text
    assert "tags differ" not in text


# ---------------------------------------------------------------- threads

def _two_threads_blocked(rank, world_size, init_method, flag):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    dist.all_reduce(np.ones(2, dtype=np.float32))
    text = ""
    if rank == 0:
        _short_timeout(1.5)
        got = []
        t = threading.Thread(target=lambda: got.append(_timeout_text(
            lambda: dist.recv(np.zeros(2), src=1, tag=1).wait(timeout=3.0))))
        t.start()
        time.sleep(0.3)
        text = _timeout_text(lambda: dist.barrier())    # rank 1 never calls it
        t.join(30)
        _raise(flag)
    else:
        _idle_until(flag)
    dist.destroy_process_group()
    return text


def test_every_blocked_thread_is_in_the_table(run_ranks, tmp_path):
    """A thread waits in a receive nobody sends to while the main thread
    waits in a barrier: the barrier's timeout shows both, with both verdicts
    (the table showed the barrier only)."""
    text = run_ranks(_two_threads_blocked, 2, str(tmp_path / "flag"), timeout=60)[0]
    assert ("rank 0: in barrier #2 of WORLD, waiting for rank 1 (") in text, text
    assert "; another thread: in recv from rank 1 (tag 1, 16 B float64), waiting for rank 1 (" in text
    assert ("a receive nobody sends to: rank 0 waits in recv from rank 1 (tag 1, 16 B float64), but rank 1 has "
            "no send to rank 0 pending") in text
    assert "a rank that never called it: rank 0 waits in barrier #2 of WORLD, but rank 1 is not inside" in text


def _threads_fail_at_once(rank, world_size, init_method, flag):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    if rank == 0:
        go = threading.Barrier(8)

        def one(i):
            req = dist.irecv(np.zeros(2), src=1, tag=100 + i)
            go.wait()
            _timeout_text(lambda: req.wait(timeout=0.5))
        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        _raise(flag)
    else:
        _idle_until(flag)
    dist.destroy_process_group()


def test_history_of_errors_in_several_threads_at_once(run_ranks, tmp_path, capfd):
    """Eight threads time out together: the history is one JSON object with
    every error (the writers shared one temporary file: 'Extra data' JSON
    and 'No such file' complaints)."""
    where = tmp_path / "h"
    for _ in range(2):
        run_ranks(_threads_fail_at_once, 2, str(tmp_path / "flag"), timeout=60, env={"SHMDIST_TRACE_DIR": str(where)})
        os.unlink(tmp_path / "flag")
        hist = json.loads((where / "shmdist-trace-rank0.json").read_text())
        assert len(hist["errors"]) == 8 and all("Timed out" in e for e in hist["errors"])
        assert sorted(e["tag"] for e in hist["entries"] if e["state"] == "failed") == list(range(100, 108))
        assert not [n for n in os.listdir(where) if n.endswith(".tmp")]
    assert "flight recorder:" not in capfd.readouterr().err


# ---------------------------------------------------------------- shmdist-run --hang-after

BEHIND = textwrap.dedent("""
    import threading, time
    import numpy as np
    import shmdist as dist
    dist.init_process_group()
    rank = dist.get_rank()
    if rank == 0:    # a thread waits for a message rank 1 sends late
        t = threading.Thread(target=lambda: dist.recv(np.zeros(2), src=1, tag=1).wait())
        t.start()
        time.sleep(0.3)
    for _ in range(20):     # more operations than the launcher looked at
        dist.all_reduce(np.ones(2))
    time.sleep(5)
    if rank == 1:
        dist.send(np.ones(2), dst=0, tag=1).wait()
    else:
        t.join()
    dist.destroy_process_group()
""")


def test_hang_after_sees_a_thread_that_waits_behind_newer_operations(tmp_path):
    """No rank moves for 5 s while a thread of rank 0 waits: --hang-after 1
    says so, though 20 collectives came after the receive (it looked only
    at each ring's last 8 entries)."""
    script = tmp_path / "behind.py"
    script.write_text(BEHIND)
    out = subprocess.run([sys.executable, "-m", "shmdist.run", "-n", "2", "--hang-after", "1", str(script)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT, SHMDIST_TIMEOUT="60"))
    assert out.returncode == 0, out.stderr
    assert "shmdist-run: no rank progressed for" in out.stderr, out.stderr
    assert "rank 0: in recv from rank 1 (tag 1, 16 B float64), waiting for rank 1" in out.stderr
    assert "a receive nobody sends to: rank 0 waits in recv from rank 1 (tag 1, 16 B float64)" in out.stderr


# ---------------------------------------------------------------- a wait left by KeyboardInterrupt

INTERRUPTED = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import shmdist as dist
    dist.init_process_group()
    rank = dist.get_rank()
    with open(os.path.join(sys.argv[1], f"ready{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 0:
        try:
            dist.recv(np.zeros(2), src=1, tag=1).wait()     # Ctrl-C gets it out
        except KeyboardInterrupt:
            pass
    dist.all_reduce(np.ones(2))
    if rank == 0:
        print("computing", file=sys.stderr, flush=True)
        open(os.path.join(sys.argv[1], "computing"), "w").close()
    time.sleep(4)            # both compute, outside any shmdist call
    dist.destroy_process_group()
""")


def test_a_wait_left_by_keyboard_interrupt_is_no_longer_waiting(tmp_path):
    """Ctrl-C out of a recv's wait, then on: the entry stayed 'waiting' for
    ever, so the doctor said 'rank 0: in recv' while rank 0 computed and
    --hang-after reported ranks that only computed. Now the wait leaves it
    posted (it is still pending) and the doctor reads rank 0 as idle."""
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED)
    p = subprocess.Popen([sys.executable, "-m", "shmdist.run", "-n", "2", "--hang-after", "1", str(script),
                          str(tmp_path)], stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT, SHMDIST_TIMEOUT="60"))
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(int((tmp_path / "ready0").read_text()), signal.SIGINT)
        while not (tmp_path / "computing").exists():
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
        doc = subprocess.run([sys.executable, "-m", "shmdist.doctor", str(p.pid)], capture_output=True,
                             text=True, timeout=60, cwd=ROOT)
        assert "rank 0: not inside any shmdist call; last: all_reduce #1 of WORLD" in doc.stdout, doc.stdout
        assert "verdict" not in doc.stdout
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err
    assert "no rank progressed" not in err.partition("computing")[2], err


# ---------------------------------------------------------------- a big job's metadata

def test_metadata_that_does_not_fit_its_page_keeps_the_job_and_rank():
    """Many ranks and groups: the JSON metadata outgrew its page and was cut
    short, so it no longer parsed: the job id, the rank's pids and every
    group were lost (the doctor by job id found nothing). Now the oldest
    groups, then the pids, are left out until it fits."""
    from shmdist import trace
    own = trace._Own(4)
    try:
        n = 300
        own.set_meta(job="big-job", rank=7, world_size=n, groups={str(g): list(range(n)) for g in range(3)},
                     pids={str(r): 4_000_000 + r for r in range(n)})
        meta = trace.Ring(own.mm).meta()
        assert meta["job"] == "big-job" and meta["rank"] == 7 and meta["world_size"] == n
        own.set_meta(pids={str(r): 4_000_000 + r for r in range(8)},
                     groups={str(g): list(range(n)) if g < 3 else [g, g + 1] for g in range(6)})
        meta = trace.Ring(own.mm).meta()
        assert meta["job"] == "big-job" and len(meta["pids"]) == 8
        assert meta["groups"]["5"] == [5, 6], "the newest groups are kept"
        hist = trace.history(trace.Ring(own.mm))
        assert hist["job"] == "big-job" and hist["groups"]["0"] == list(range(n))
    finally:
        own.mm.close()


# ---------------------------------------------------------------- a second job in the same processes

def _reinit_then_skip(rank, world_size, init_method, port, flag):
    x = np.ones(4, dtype=np.float32)
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    for _ in range(5):
        dist.all_reduce(x)          # the first job: collectives #1 to #5 of WORLD
    dist.destroy_process_group()
    dist.init_process_group("shm", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=60)
    dist.all_reduce(x)              # the second job's #1
    text = ""
    if rank == 0:
        _short_timeout(1.5)
        text = _timeout_text(lambda: dist.broadcast(x, src=0))    # #2: rank 1 never calls it
        _raise(flag)
    else:
        _idle_until(flag)
    dist.destroy_process_group()
    return text


def test_an_earlier_job_of_the_same_processes_does_not_count(run_ranks, tmp_path):
    """The ring is kept across a re-init: rank 1's all_reduce #5 of the first
    job read as having reached broadcast #2 of the second, so the verdict was
    'no hang found' and rank 0 waited for nobody."""
    from test_trace import _free_ports
    text = run_ranks(_reinit_then_skip, 2, _free_ports(1)[0], str(tmp_path / "flag"), timeout=90)[0]
    assert "rank 0: in broadcast #2 of WORLD (root 0, 16 B float32), waiting for rank 1" in text, text
    assert "rank 1: not inside any shmdist call; last: all_reduce #1 of WORLD (SUM, 16 B float32), done" in text
    assert ("a rank that never called it: rank 0 waits in broadcast #2 of WORLD (root 0, 16 B float32), but "
            "rank 1 is not inside any shmdist call") in text
    assert "no hang found" not in text


# ---------------------------------------------------------------- torch's analyzer on a one-sided hang

def _one_rank_fails(rank, world_size, init_method, flag):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    x = np.ones(4, dtype=np.float32)
    dist.all_reduce(x)
    if rank == 0:
        _short_timeout(1.0)
        _timeout_text(lambda: dist.broadcast(x, src=0))     # #2: rank 1 never calls it
        _raise(flag)
    else:
        _idle_until(flag)
    dist.destroy_process_group()


def test_torch_analyzer_reads_a_hang_where_one_rank_fails(run_ranks, tmp_path):
    """The classic hang fails one rank only: its dump alone made torch's
    analyzer stop at 'Missing dump files from ranks {1}'. The failing rank
    writes the dumps of the local ranks it maps too (their JSON history
    stays its own to write)."""
    pytest.importorskip("torch.distributed.flight_recorder.fr_trace")
    where = tmp_path / "h"
    run_ranks(_one_rank_fails, 2, str(tmp_path / "flag"), timeout=60, env={"SHMDIST_TRACE_DIR": str(where)})
    assert sorted(os.listdir(where)) == ["shmdist-trace-rank0.json", "shmdist_fr_trace_rank_0",
                                         "shmdist_fr_trace_rank_1"]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(where),
                          "-p", "shmdist_fr_trace_rank_"], capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert "Missing dump files" not in text, text
    assert "Not all ranks joining collective, sequence number: 2" in text, text
    assert "collective: gloo:broadcast" in text and "missing ranks: {1}" in text, text


# ---------------------------------------------------------------- the doctor pointed at the wrong thing

def _doctor(target):
    return subprocess.run([sys.executable, "-m", "shmdist.doctor", str(target)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_doctor_on_a_job_that_ended_or_another_users_process_says_which():
    """Both said 'no flight recorder found ... give the pid of a rank', which
    the user had just done."""
    ended = subprocess.Popen(["true"])
    ended.wait(30)
    doc = _doctor(ended.pid)
    assert doc.returncode == 2 and f"no process {ended.pid}: the job has ended" in doc.stderr, doc.stderr
    if os.geteuid() != 0:
        pytest.skip("another user's process needs root to start here")
    other = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "60"])
    try:
        time.sleep(0.3)
        doc = _doctor(other.pid)
        assert doc.returncode == 2 and f"process {other.pid} belongs to user" in doc.stderr, doc.stderr
        assert "(uid 65534): a flight recorder opens only for the user that runs the job" in doc.stderr
    finally:
        other.kill()
        other.wait(30)


def test_hang_after_must_be_above_0():
    """0 turned it off without a word; -1 reported every wait longer than a poll."""
    for value in ("0", "-1"):
        out = subprocess.run([sys.executable, "-m", "shmdist.run", "--hang-after", value, "-n", "1", "x.py"],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 2 and f"--hang-after {value} must be a number of seconds above 0" in out.stderr


# ---------------------------------------------------------------- posted in one thread, waited in another

def _waited_elsewhere(rank, world_size, init_method, flag):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    x = np.ones(2, dtype=np.float32)
    text = ""
    if rank == 0:
        req = dist.irecv(np.zeros(2), src=1, tag=1)       # rank 1 never sends it
        got = []
        t = threading.Thread(target=lambda: got.append(_timeout_text(lambda: req.wait(timeout=2.0))))
        t.start()
        time.sleep(0.3)
        for _ in range(3):          # the thread that posted it goes on
            dist.all_reduce(x)
        t.join(30)
        text = got[0]
        _raise(flag)
    else:
        for _ in range(3):
            dist.all_reduce(x)
        _idle_until(flag)
    dist.destroy_process_group()
    return text


def test_a_receive_waited_in_another_thread_than_its_poster(run_ranks, tmp_path):
    """A thread that posted a receive goes on while another thread waits
    for it: the wait is still where the rank hangs."""
    text = run_ranks(_waited_elsewhere, 2, str(tmp_path / "flag"), timeout=60)[0]
    assert "rank 0: in recv from rank 1 (tag 1, 16 B float64), waiting for rank 1" in text, text
    assert "a receive nobody sends to: rank 0 waits in recv from rank 1 (tag 1, 16 B float64)" in text


def _recv_any_in_a_group(rank, world_size, init_method, flag):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    sub = dist.new_group([0, 2])
    text = ""
    if rank == 0:
        text = _timeout_text(lambda: dist.recv(np.zeros(2), group=sub, tag=3).wait(timeout=1.0))
        _raise(flag)
    else:
        _idle_until(flag)
    dist.destroy_process_group()
    return text


def test_a_receive_from_any_member_of_a_group_names_the_members_only(run_ranks, tmp_path):
    text = run_ranks(_recv_any_in_a_group, 3, str(tmp_path / "flag"), timeout=60)[0]
    verdict = text.partition("verdict:")[2]
    assert ("a receive nobody sends to: rank 0 waits in recv from any rank (tag 3, 16 B float64, group [0, 2]), "
            "but no rank has a send to rank 0 pending: rank 2 is not inside any shmdist call") in verdict, text
    assert "rank 1" not in verdict

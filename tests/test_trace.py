"""The flight recorder (shmdist/trace.py): each classic hang built on purpose,
with short timeouts, and the verdict it gets; shmdist-run's SIGUSR1 and
--hang-after; the doctor on a live job; the JSON history; SHMDIST_TRACE=0."""
from __future__ import annotations

import glob
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import shmdist as dist
from ranks import wait_until_gone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _shm_names():
    return {n for n in os.listdir("/dev/shm") if "shmdist" in n or "trace" in n}


@pytest.fixture(autouse=True)
def _nothing_new_in_dev_shm():
    """Every test here, each hang included: the recorders and segments are
    nameless, so nothing of ours appears in /dev/shm."""
    before = _shm_names()
    yield
    assert not _shm_names() - before


def _short_timeout(seconds):
    """Give the collectives of this rank's groups a short timeout now that
    the (slower, on a loaded host) set-up is done."""
    w = dist.api.group.world()
    w.timeout = seconds
    for g in w.groups:
        g.timeout = seconds


def _idle_until(flag):
    """Stay out of every shmdist call until another rank raised ``flag``."""
    deadline = time.monotonic() + 60
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.02)


def _raise(flag):
    open(flag, "w").close()


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _timeout_text(fn):
    """Run ``fn``; return the message of the DistError it raises (else fail)."""
    try:
        fn()
    except dist.DistError as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("expected a DistError")


# ---------------------------------------------------------------- the classic hangs

def _recv_nobody_sends(rank, world_size, init_method, flag):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    buf = np.zeros(2, dtype=np.int64)
    if rank == 0:
        text = _timeout_text(lambda: dist.recv(buf, src=1, tag=3).wait(timeout=1.0))
        _raise(flag)
    else:
        _idle_until(flag)       # not inside any shmdist call: never sends
        text = ""
    dist.destroy_process_group()
    return text


def test_a_receive_nobody_sends_to(run_ranks, tmp_path):
    text = run_ranks(_recv_nobody_sends, 2, str(tmp_path / "flag"), timeout=60)[0]
    assert "DistTimeoutError" in text
    assert "rank 0: in recv from rank 1 (tag 3, 16 B int64), waiting for rank 1" in text
    assert "rank 1: not inside any shmdist call" in text
    assert ("a receive nobody sends to: rank 0 waits in recv from rank 1 (tag 3, 16 B int64), but rank 1 "
            "has no send to rank 0 pending: rank 1 is not inside any shmdist call") in text


def _tags_differ(rank, world_size, init_method, flag):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    if rank == 0:
        dist.send(np.ones(1, dtype=np.float32), dst=1, tag=0).wait()
        _idle_until(flag)
        text = ""
    else:
        text = _timeout_text(lambda: dist.recv(np.zeros(1, dtype=np.float32), src=0, tag=9).wait(timeout=1.0))
        _raise(flag)
    dist.destroy_process_group()
    return text


def test_tags_that_differ(run_ranks, tmp_path):
    text = run_ranks(_tags_differ, 2, str(tmp_path / "flag"), timeout=60)[1]
    assert "rank 1: in recv from rank 0 (tag 9, 4 B float32), waiting for rank 0" in text
    assert ("tags differ: rank 1 waits in recv from rank 0 (tag 9, 4 B float32), but rank 0's send to "
            "rank 1 (tag 0, 4 B float32) does not match it; use the same tag and group on both sides") in text


def _send_nobody_receives_idle(rank, world_size, init_method, flag):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    if rank == 0:
        text = _timeout_text(lambda: dist.send(np.ones(1 << 18, dtype=np.float32), dst=1).wait(timeout=1.0))
        _raise(flag)
    else:
        _idle_until(flag)
        text = ""
    dist.destroy_process_group()
    return text


def test_a_send_nobody_receives(run_ranks, tmp_path):
    text = run_ranks(_send_nobody_receives_idle, 2, str(tmp_path / "flag"), timeout=60,
                     env={"SHMDIST_RING_BYTES": "65536"})[0]
    assert ("a send nobody receives: rank 0 waits in send to rank 1 (tag 0, 1 MiB float32) (too big to "
            "leave in the ring), but rank 1 does not receive it: rank 1 is not inside any shmdist call") in text


def _never_called(rank, world_size, init_method, flag):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    x = np.arange(4, dtype=np.float32)
    dist.all_reduce(x)                        # collective #1 of WORLD: everyone
    _short_timeout(1.5 if rank == 0 else 30)    # rank 0 times out first, then leaves
    text = ""
    if rank != 2:
        text = _timeout_text(lambda: dist.broadcast(x, src=0))    # #2: rank 2 skips it
        _raise(flag)
    else:
        _idle_until(flag)
    dist.destroy_process_group()
    return text


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_rank_that_never_called_it(run_ranks, tmp_path, transport):
    text = run_ranks(_never_called, 3, str(tmp_path / "flag"), timeout=60, errors="return",
                     env={"SHMDIST_TRANSPORT": transport})[0]
    assert "rank 0: in broadcast #2 of WORLD (root 0, 16 B float32), waiting for rank 2" in text
    assert "rank 1: in broadcast #2 of WORLD (root 0, 16 B float32), waiting for rank 2" in text
    assert "rank 2: not inside any shmdist call; last: all_reduce #1 of WORLD (SUM, 16 B float32), done" in text
    assert ("a rank that never called it: ranks 0,1 wait in broadcast #2 of WORLD (root 0, 16 B float32), "
            "but rank 2 is not inside any shmdist call") in text


def _different_collective(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    sub = dist.new_group([1, 2])
    dist.barrier()
    _short_timeout(1.5 if rank == 0 else 30)    # rank 0 times out first; its leaving ends the others' waits
    x = np.ones(2, dtype=np.float64)
    if rank == 1:      # rank 1 enters its subgroup's collective first: ranks 0 and 2 wait in WORLD's
        text = _timeout_text(lambda: dist.all_reduce(x, group=sub))
    else:
        text = _timeout_text(lambda: dist.all_reduce(x))
    return text


@pytest.mark.parametrize("transport", ["shm", "tcp"])     # tcp: the collectives of groups across hosts
def test_a_rank_in_a_different_collective(run_ranks, transport):
    text = run_ranks(_different_collective, 3, timeout=60, errors="return",
                     env={"SHMDIST_TRANSPORT": transport})[0]
    assert "rank 0: in all_reduce #2 of WORLD (SUM, 16 B float64), waiting for rank 1" in text
    assert "rank 1: in all_reduce #1 (group [1, 2], SUM, 16 B float64), waiting for rank 2" in text
    assert ("a rank in a different collective: ranks 0,2 wait in all_reduce #2 of WORLD (SUM, 16 B float64), "
            "but rank 1 is in all_reduce #1 (group [1, 2], SUM, 16 B float64)") in text


def _gone(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    x = np.ones(3, dtype=np.int32)
    dist.all_reduce(x)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return _timeout_text(lambda: dist.barrier())


def test_a_rank_that_is_gone(run_ranks):
    results = run_ranks(_gone, 3, timeout=60, errors="return")
    text = results[0]
    assert "DistPeerError" in text
    assert "rank 2: gone (process" in text and "last: all_reduce #1 of WORLD (SUM, 12 B int32), done" in text
    assert "a rank that is gone: rank 2 (process" in text


# ---------------------------------------------------------------- shmdist-run and the doctor

HUNG_JOB = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import shmdist as dist
    dist.init_process_group()
    rank = dist.get_rank()
    x = np.ones(4, dtype=np.float32)
    dist.all_reduce(x)
    with open(os.path.join(sys.argv[1], f"ready{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 0:
        dist.broadcast(x, src=0)     # rank 1 never calls it
    else:
        time.sleep(120)
""")


class _Launch:
    """shmdist-run over HUNG_JOB with 2 ranks; its stderr collected by a thread."""

    def __init__(self, tmp_path, *extra):
        import threading
        script = tmp_path / "hung.py"
        script.write_text(HUNG_JOB)
        self.dir = tmp_path
        env = dict(os.environ, SHMDIST_TIMEOUT="120", PYTHONPATH=ROOT)
        self.p = subprocess.Popen([sys.executable, "-m", "shmdist.run", "-n", "2", *extra, str(script),
                                   str(tmp_path)], stderr=subprocess.PIPE, env=env, cwd=ROOT)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.p.stderr:
            self.lines.append(line.decode(errors="replace"))

    def ready(self) -> list[int]:
        deadline = time.monotonic() + 60
        while not all((self.dir / f"ready{r}").exists() for r in range(2)):
            assert self.p.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.05)
        time.sleep(0.3)
        return [int((self.dir / f"ready{r}").read_text()) for r in range(2)]

    def wait_for(self, text: str, within: float = 20) -> str:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            out = "".join(self.lines)
            if text in out:
                return out
            time.sleep(0.05)
        raise AssertionError(f"{text!r} not in the launcher's output:\n{''.join(self.lines)}")

    def stop(self, pids=()):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        self.p.wait(30)
        self.reader.join(5)
        for pid in pids:
            wait_until_gone(pid)


VERDICT = ("a rank that never called it: rank 0 waits in broadcast #2 of WORLD (root 0, 16 B float32), "
           "but rank 1 is not inside any shmdist call")


def test_sigusr1_to_shmdist_run_prints_the_table_and_the_doctor_reads_a_live_job(tmp_path, no_leaks):
    job = _Launch(tmp_path)
    pids = []
    try:
        pids = job.ready()
        job.p.send_signal(signal.SIGUSR1)
        out = job.wait_for("verdict:")
        out = job.wait_for(VERDICT)
        assert "shmdist-run: SIGUSR1:" in out
        assert "rank 0: in broadcast #2 of WORLD (root 0, 16 B float32), waiting for rank 1" in out
        assert "rank 1: not inside any shmdist call; last: all_reduce #1 of WORLD (SUM, 16 B float32), done" in out
        assert job.p.poll() is None, "SIGUSR1 must not stop the job"
        for target in (str(pids[1]), str(job.p.pid), no_leaks):     # a rank, the launcher, the job id
            doc = subprocess.run([sys.executable, "-m", "shmdist.doctor", target], capture_output=True,
                                 text=True, timeout=60, cwd=ROOT)
            assert doc.returncode == 0, doc.stderr
            assert "rank 0: in broadcast #2 of WORLD (root 0, 16 B float32), waiting for rank 1" in doc.stdout
            assert VERDICT in doc.stdout
        doc = subprocess.run([sys.executable, "-m", "shmdist.doctor", "--json", str(pids[0])],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        hist = json.loads(doc.stdout)
        assert hist["0"]["entries"][-1]["op"] == "broadcast" and hist["0"]["entries"][-1]["state"] == "waiting"
        # read-only: the job goes on, still stuck where it was
        assert job.p.poll() is None
    finally:
        job.stop(pids)


def test_doctor_on_nothing_says_what_to_give(no_leaks):
    doc = subprocess.run([sys.executable, "-m", "shmdist.doctor", "no-such-job-xyz"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert doc.returncode == 2
    assert "no flight recorder found for 'no-such-job-xyz'" in doc.stderr


def test_hang_after_prints_the_table_by_itself(tmp_path):
    job = _Launch(tmp_path, "--hang-after", "1")
    pids = []
    try:
        pids = job.ready()
        out = job.wait_for(VERDICT)
        assert "shmdist-run: no rank progressed for 1 s:" in out
        assert out.count("verdict:") == 1, "printed once until something moves again"
    finally:
        job.stop(pids)


# ---------------------------------------------------------------- history on failure, switching it off

def _history(rank, world_size, init_method, flag):
    if rank == 1:
        time.sleep(0.8)     # rank 0's set-up waits in slices meanwhile: their timeouts are not errors
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    x = np.arange(6, dtype=np.float64)
    dist.all_reduce(x)
    if rank == 0:
        dist.send(np.ones(2, dtype=np.int32), dst=1, tag=4).wait()
        _timeout_text(lambda: dist.recv(np.zeros(1, dtype=np.int64), src=1, tag=7).wait(timeout=0.5))
        _raise(flag)
    else:
        dist.recv(np.zeros(2, dtype=np.int32), src=0, tag=4).wait()
        _idle_until(flag)
    dist.destroy_process_group()


def test_history_json_on_a_dist_error(run_ranks, tmp_path):
    run_ranks(_history, 2, str(tmp_path / "flag"), timeout=60, env={"SHMDIST_TRACE_DIR": str(tmp_path / "h")})
    tmp_path = tmp_path / "h"
    assert not (tmp_path / "shmdist-trace-rank1.json").exists(), "only a rank that met a DistError writes"
    hist = json.loads((tmp_path / "shmdist-trace-rank0.json").read_text())
    assert hist["format"] == "shmdist-trace" and hist["version"] == 1
    assert hist["rank"] == 0 and hist["world_size"] == 2 and hist["groups"] == {"0": [0, 1]}
    assert len(hist["errors"]) == 1, hist["errors"]
    assert "Timed out" in hist["errors"][0] and "a receive nobody sends to" in hist["diagnosis"]
    ar, send, recv = hist["entries"][-3:]
    assert {k: ar[k] for k in ("op", "state", "group", "group_ranks", "collective", "root", "reduce_op",
                              "bytes", "dtype")} == {
        "op": "all_reduce", "state": "done", "group": 0, "group_ranks": [0, 1], "collective": 1,
        "root": None, "reduce_op": "SUM", "bytes": 48, "dtype": "float64"}
    assert {k: send[k] for k in ("op", "state", "peer", "tag", "bytes", "dtype")} == {
        "op": "send", "state": "done", "peer": 1, "tag": 4, "bytes": 8, "dtype": "int32"}
    assert {k: recv[k] for k in ("op", "state", "peer", "tag", "bytes", "dtype")} == {
        "op": "recv", "state": "failed", "peer": 1, "tag": 7, "bytes": 8, "dtype": "int64"}
    assert recv["posted"] <= recv["wait_began"] <= recv["ended"] and abs(recv["ended"] - time.time()) < 60
    assert [e["seq"] for e in hist["entries"]] == sorted(e["seq"] for e in hist["entries"])
    fr = pickle.loads((tmp_path / "shmdist_fr_trace_rank_0").read_bytes())
    assert fr["pg_config"]["0"]["ranks"] == "[0, 1]"
    assert [(e["profiling_name"], e["state"]) for e in fr["entries"][-3:]] == [
        ("gloo:all_reduce", "completed"), ("gloo:send 0->1", "completed"), ("gloo:recv 0<-1", "completed")]


def _calls_differ(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    x = np.ones(4, dtype=np.float32)
    for _ in range(3):
        dist.all_reduce(x)       # caught while spinning, most of them: recorded as done at once
    text = _timeout_text(lambda: dist.all_reduce(np.ones(4 + rank, dtype=np.float32)))
    dist.destroy_process_group()
    return text


def test_a_collective_recorded_before_its_wait_ends_is_never_left_done(run_ranks, tmp_path):
    """The C writer records a collective as done while the others are still on
    their way (so that the entry costs nothing on the call's critical path) and
    takes that back when the call does not pass: here its members' calls differ
    and the entry ends failed. (The hang tests above check a rank left waiting:
    without the take-back, "waiting for rank 2" there read as done.)"""
    texts = run_ranks(_calls_differ, 2, timeout=60, env={"SHMDIST_TRACE_DIR": str(tmp_path)})
    assert all("DistMismatchError" in t for t in texts), texts
    for rank in range(2):
        hist = json.loads((tmp_path / f"shmdist-trace-rank{rank}.json").read_text())
        ars = [e for e in hist["entries"] if e["op"] == "all_reduce"]
        assert [e["state"] for e in ars[:3]] == ["done"] * 3, ars
        assert all(e["ended"] is not None and e["ended"] >= e["posted"] for e in ars[:3]), ars
        last = ars[-1]
        assert last["bytes"] == 16 + 4 * rank and last["state"] == "failed", last


def _trace_fds() -> list[str]:
    """What this process's descriptors to flight recorders point at."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue      # listdir's own descriptor, closed by now
        if target.startswith("/memfd:shmdist-trace"):
            out.append((target, oct(os.stat(f"/proc/self/fd/{fd}").st_mode & 0o777)))
    return out


def _ring_size(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    x = np.ones(1, dtype=np.int64)
    for _ in range(50):
        dist.all_reduce(x)
    from shmdist import trace
    ring = trace.own_ring()
    found = _trace_fds()
    dist.destroy_process_group()
    return ring.capacity, [e.coll for e in ring.entries()], found


def test_the_ring_keeps_the_last_n_operations(run_ranks):
    before = set(os.listdir("/dev/shm"))
    cap, colls, found = run_ranks(_ring_size, 2, timeout=60, env={"SHMDIST_TRACE_SIZE": "16"})[0]
    assert cap == 16 and colls == list(range(35, 51))
    assert len(found) == 2       # its own and its peer's
    assert all(f.endswith("(deleted)") and mode == "0o600" for f, mode in found)   # nameless, this user's only
    new = set(os.listdir("/dev/shm")) - before      # other users of the host may add theirs meanwhile
    assert not [n for n in new if "shmdist" in n or "trace" in n]


def _trace_off(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    text = ""
    if rank == 0:
        text = _timeout_text(lambda: dist.recv(np.zeros(1), src=1).wait(timeout=0.3))
    dist.barrier()
    found = _trace_fds()
    dist.destroy_process_group()
    return text, found


def test_shmdist_trace_0_turns_it_off(run_ranks, tmp_path):
    (text, found), _ = run_ranks(_trace_off, 2, timeout=60, env={"SHMDIST_TRACE": "0",
                                                                 "SHMDIST_TRACE_DIR": str(tmp_path)})
    assert "Timed out" in text and "flight recorder" not in text
    assert found == [] and os.listdir(tmp_path) == []


def _reinit_on_off_on(rank, world_size, init_method, ports):
    """Three jobs in one process: recorder on, then SHMDIST_TRACE=0, then on."""
    from shmdist import trace
    out = []
    for on, method in zip(("1", "0", "1"), [init_method] + [f"tcp://127.0.0.1:{p}" for p in ports]):
        os.environ["SHMDIST_TRACE"] = on
        dist.init_process_group("shm", method, rank=rank, world_size=world_size, timeout=60)
        text = ""
        if rank == 0:
            text = _timeout_text(lambda: dist.recv(np.zeros(1), src=1, tag=4).wait(timeout=0.3))
        dist.barrier()
        out.append((len(_trace_fds()), trace.own_ring() is not None, "flight recorder" in text))
        dist.destroy_process_group()
    return out


def test_shmdist_trace_0_on_a_re_init_drops_the_ring(run_ranks):
    """destroy_process_group, then init again with SHMDIST_TRACE=0: the ring
    of the first job is let go (no descriptor, nothing recorded, no table),
    and a third init with it on makes a new one."""
    got = run_ranks(_reinit_on_off_on, 2, _free_ports(2), timeout=90, env={"SHMDIST_TRACE": "1"})[0]
    assert got == [(2, True, True), (0, False, False), (2, True, True)], got


def _both_fail(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    x = np.ones(4, dtype=np.float32)
    dist.all_reduce(x)
    _short_timeout(1.0)
    try:
        if rank == 0:
            dist.barrier()               # collective #2: rank 1 calls all_reduce instead, too late
        else:
            time.sleep(1.5)
            dist.all_reduce(x)
    except dist.DistError:
        pass


def test_torch_flight_recorder_analyzer_reads_the_dumps(run_ranks, tmp_path):
    pytest.importorskip("torch.distributed.flight_recorder.fr_trace")
    run_ranks(_both_fail, 2, timeout=60, env={"SHMDIST_TRACE_DIR": str(tmp_path)})
    out = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path),
                          "-p", "shmdist_fr_trace_rank_"], capture_output=True, text=True, timeout=120)
    assert "Collective sequence number: 2 has errors" in out.stdout + out.stderr, out.stdout + out.stderr
    assert "Expected collective type: 'barrier' does not match found collective type: 'all_reduce'" in \
        out.stdout + out.stderr or \
        "Expected collective type: 'all_reduce' does not match found collective type: 'barrier'" in \
        out.stdout + out.stderr


# ---------------------------------------------------------------- through torch's backend "shm"

def _torch_hang(rank, world_size, init_method, flag):
    import datetime
    import torch
    import torch.distributed as tdist
    import shmdist.torch  # noqa: F401  (registers the backend)
    tdist.init_process_group("shm", init_method=init_method, rank=rank, world_size=world_size,
                             timeout=datetime.timedelta(seconds=60))
    sub = tdist.new_group([0, 1])
    t = torch.ones(3)
    tdist.all_reduce(t, group=sub)
    text = ""
    if rank == 0:
        try:
            tdist.irecv(torch.zeros(2, dtype=torch.int64), src=1).wait(datetime.timedelta(seconds=1.5))
        except Exception as e:       # noqa: BLE001 - the test reads its text
            text = f"{type(e).__name__}: {e}"
        _raise(flag)
    else:
        _idle_until(flag)
    tdist.destroy_process_group()
    return text


def test_through_torch_backend_shm(run_ranks, tmp_path):
    pytest.importorskip("torch")
    text = run_ranks(_torch_hang, 2, str(tmp_path / "flag"), timeout=90)[0]
    assert "Timed out" in text
    assert text.count("where each rank is (flight recorder):") == 1
    assert "rank 0: in recv from rank 1 (tag 0, 16 B int64), waiting for rank 1" in text
    assert "rank 1: not inside any shmdist call; last: all_reduce #1 (group [0, 1], SUM, 12 B float32), done" in text
    assert "a receive nobody sends to: rank 0 waits in recv from rank 1" in text


def test_hang_after_stays_quiet_while_ranks_compute(tmp_path):
    script = tmp_path / "compute.py"
    script.write_text(textwrap.dedent("""
        import time
        import numpy as np
        import shmdist as dist
        dist.init_process_group()
        dist.all_reduce(np.ones(2))
        time.sleep(3)            # computing: no rank inside a shmdist call
        dist.all_reduce(np.ones(2))
        dist.destroy_process_group()
    """))
    out = subprocess.run([sys.executable, "-m", "shmdist.run", "-n", "2", "--hang-after", "1", str(script)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr
    assert "no rank progressed" not in out.stderr


# ---------------------------------------------------------------- the layout, defined once

def test_the_c_writer_and_the_python_reader_share_layout_py():
    """Entry offsets name the struct's fields, and what C writes (sd_tr_post,
    sd_tr_set) Python reads back field by field."""
    from shmdist import _core, layout, trace
    raw = bytes(range(256))[:layout.TRACE_ENT.size]
    fields = layout.TRACE_ENT.unpack(raw)
    offsets = [layout.TRACE_E_SEQ, layout.TRACE_E_STATE, layout.TRACE_E_OP, layout.TRACE_E_GID,
               layout.TRACE_E_PEER, layout.TRACE_E_TAG, layout.TRACE_E_NBYTES, layout.TRACE_E_COLL,
               layout.TRACE_E_POSTED, layout.TRACE_E_ENDED, layout.TRACE_E_THREAD, layout.TRACE_E_DTYPE,
               layout.TRACE_E_WAIT]
    sizes = [8, 4, 4, 8, 8, 8, 8, 8, 8, 8, 8, layout.DTYPE_BYTES, 8]
    for value, at, size in zip(fields, offsets, sizes):
        got = raw[at:at + size]
        assert got == value or int.from_bytes(got, "little", signed=True) == value or \
            int.from_bytes(got, "little") == value
    assert layout.TRACE_ENT.size <= layout.TRACE_ENTRY and layout.TRACE_HDR.size <= layout.TRACE_META_AT
    own = trace._Own(4)
    try:
        _core.trace_attach(own.addr, own.capacity)
        seq = _core.trace_post(layout.TRACE_COLL + layout.KINDS.index("reduce"), layout.TRACE_POSTED, 7, 3,
                               int(dist.ReduceOp.MAX), 4096, 12, b"float64".ljust(16, b"\0"))
        _core.trace_set(seq, layout.TRACE_WAITING)
        (e,) = trace.Ring(own.mm).entries()
        assert (e.seq, e.state, e.kind, e.gid, e.peer, e.tag, e.nbytes, e.coll, e.dtype) == \
            (1, layout.TRACE_WAITING, "reduce", 7, 3, int(dist.ReduceOp.MAX), 4096, 12, "float64")
        assert e.posted and e.wait_began >= e.posted and e.ended == 0
        _core.trace_set(seq, layout.TRACE_DONE)
        (e,) = trace.Ring(own.mm).entries()
        assert e.state == layout.TRACE_DONE and e.ended >= e.wait_began
        assert trace.Ring(own.mm).changes == 3
    finally:
        _core.trace_attach(0, 0)
        own.mm.close()


# ---------------------------------------------------------------- every classic hang through torch's "shm"

def _torch_classic(rank, world_size, init_method, case, flag):
    """Build the classic hang ``case`` with torch.distributed over backend
    "shm"; return the text of the error the rank that times out (or
    survives) gets, "" for the others."""
    import datetime
    import torch
    import torch.distributed as tdist
    import shmdist.torch  # noqa: F401  (registers the backend)
    tdist.init_process_group("shm", init_method=init_method, rank=rank, world_size=world_size,
                             timeout=datetime.timedelta(seconds=60))
    sub = tdist.new_group([1, 2]) if case == "different" else None
    t = torch.ones(4)
    tdist.all_reduce(t)                       # collective #1 of WORLD: everyone
    short = datetime.timedelta(seconds=1.5)

    def text_of(fn):
        try:
            fn()
        except Exception as e:     # noqa: BLE001 - the test reads its text
            return f"{type(e).__name__}: {e}"
        raise AssertionError("expected an error")

    text = ""
    if case == "never":
        _short_timeout(1.5 if rank == 0 else 30)
        if rank != 2:
            text = text_of(lambda: tdist.broadcast(t, src=0))     # #2: rank 2 skips it
            _raise(flag)
        else:
            _idle_until(flag)
    elif case == "different":
        _short_timeout(1.5 if rank == 0 else 30)
        text = text_of(lambda: tdist.all_reduce(t, group=sub if rank == 1 else None))
        return text
    elif case == "send":
        if rank == 0:
            text = text_of(lambda: tdist.isend(torch.ones(1 << 18), dst=1).wait(short))
            _raise(flag)
        else:
            _idle_until(flag)
    elif case == "tags":
        if rank == 0:
            tdist.send(torch.ones(1), dst=1, tag=0)
            _idle_until(flag)
        else:
            text = text_of(lambda: tdist.irecv(torch.zeros(1), src=0, tag=9).wait(short))
            _raise(flag)
    elif case == "gone":
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return text_of(lambda: tdist.barrier())
    tdist.destroy_process_group()
    return text


TORCH_CASES = {   # case: (ranks, the rank whose text is read, what it must say)
    "never": (3, 0, ["rank 0: in broadcast #2 of WORLD (root 0, 16 B float32), waiting for rank 2",
                     "a rank that never called it: ranks 0,1 wait in broadcast #2 of WORLD (root 0, 16 B "
                     "float32), but rank 2 is not inside any shmdist call"]),
    "different": (3, 0, ["rank 1: in all_reduce #1 (group [1, 2], SUM, 16 B float32), waiting for rank 2",
                         "a rank in a different collective: ranks 0,2 wait in all_reduce #2 of WORLD (SUM, 16 B "
                         "float32), but rank 1 is in all_reduce #1 (group [1, 2], SUM, 16 B float32)"]),
    "send": (2, 0, ["a send nobody receives: rank 0 waits in send to rank 1 (tag 0, 1 MiB float32) (too big to "
                    "leave in the ring), but rank 1 does not receive it: rank 1 is not inside any shmdist call"]),
    "tags": (2, 1, ["rank 1: in recv from rank 0 (tag 9, 4 B float32), waiting for rank 0",
                    "tags differ: rank 1 waits in recv from rank 0 (tag 9, 4 B float32), but rank 0's send to "
                    "rank 1 (tag 0, 4 B float32) does not match it; use the same tag and group on both sides"]),
    "gone": (3, 0, ["rank 2: gone (process", "a rank that is gone: rank 2 (process"]),
}


@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_each_classic_hang_through_torch_backend_shm(run_ranks, tmp_path, case):
    """(The receive nobody sends to: test_through_torch_backend_shm.)"""
    pytest.importorskip("torch")
    n, reader, wanted = TORCH_CASES[case]
    results = run_ranks(_torch_classic, n, case, str(tmp_path / "flag"), timeout=120, errors="return",
                        env={"SHMDIST_RING_BYTES": "65536"} if case == "send" else None)
    text = str(results[reader])
    print(text)
    for line in wanted:
        assert line in text, f"{line!r} not in:\n{text}"


def test_entries_name_the_thread_as_threading_does_and_keep_wall_time():
    """The C writer reads the thread pointer inline (glibc's pthread_self())
    and the clock through the vDSO: what it records must still be
    threading.get_ident() of the writing thread, and a time that ring.wall()
    turns into time.time() (within the coarse clock's step)."""
    import threading
    from shmdist import _core, layout, trace
    own = trace._Own(8)
    got = {}

    def post(name):
        before = time.time()
        seq = _core.trace_post(layout.TRACE_SEND, layout.TRACE_DONE, 0, 1, 0, 8, 0, b"int64".ljust(16, b"\0"))
        got[name] = (seq, threading.get_ident(), before, time.time())

    try:
        _core.trace_attach(own.addr, own.capacity)
        post("main")
        t = threading.Thread(target=post, args=("other",))
        t.start()
        t.join(10)
        time.sleep(0.05)
        post("later")
        ring = trace.Ring(own.mm)
        by_seq = {e.seq: e for e in ring.entries()}
        assert len(by_seq) == 3
        for name, (seq, ident, before, after) in got.items():
            e = by_seq[seq]
            assert e.thread == ident, (name, hex(e.thread), hex(ident))
            assert e.posted == e.ended
            # COARSE steps by one tick (at most 10 ms at HZ=100); the header's pair is read 2 calls apart
            assert before - 0.02 <= ring.wall(e.posted) <= after + 0.02, (name, ring.wall(e.posted), before, after)
        assert got["main"][1] != got["other"][1]
        assert by_seq[got["later"][0]].posted - by_seq[got["main"][0]].posted >= 30_000_000
        assert ring.changes == 3      # progress: three posts, no state change
    finally:
        _core.trace_attach(0, 0)
        own.mm.close()

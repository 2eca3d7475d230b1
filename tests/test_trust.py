"""Trust: who a rank talks to and what it maps must be its own job's.

- A process that binds the master port before rank 0 (a fake store) gets
  nothing from a rank that has SHMDIST_SECRET: the store must prove the
  secret back, and the rank sends nothing but its HELLO before it did.
- The same holds on the data ports: a fake listener that cannot prove the
  secret never receives the connecting rank's proof, let alone data.
- A rank of another job (SHMDIST_JOB_ID / TORCHELASTIC_RUN_ID) is refused
  by the store, naming both jobs.
- What memory_usage() reports is what the rank really maps (the memfd
  mappings in /proc/self/maps).
"""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

import shmdist as dist
from shmdist.rendezvous import store as rendezvous
from shmdist.transport import tcp
from shmdist.errors import DistPeerError


class FakeStore:
    """Binds a port first and plays the store: greets, says OK to any HELLO
    (with a made-up proof), and records every byte a client sends."""

    def __init__(self, greeting: bytes | None = None):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.greeting = greeting
        self.received = bytearray()
        self.hello_frames = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        self.listener.settimeout(10)
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(3)
            conn.sendall(self.greeting if self.greeting is not None
                         else rendezvous.GREETING + os.urandom(rendezvous.NONCE_BYTES))
            try:
                head = rendezvous.recv_exact(conn, rendezvous._REQ.size)
                op, klen, vlen, _ = rendezvous._REQ.unpack(head)
                rendezvous.recv_exact(conn, klen + vlen)
                self.hello_frames += op == rendezvous._OP_HELLO
                conn.sendall(rendezvous._REP.pack(rendezvous._OK, 32) + os.urandom(32))
                while True:                      # whatever comes next is what the fake steals
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    self.received += chunk
            except OSError:
                return

    def close(self):
        self.listener.close()
        self.thread.join(10)


def test_a_fake_store_that_bound_the_port_first_gets_nothing(monkeypatch):
    monkeypatch.setenv("SHMDIST_SECRET", "s3cret")
    fake = FakeStore()
    try:
        start = time.monotonic()
        with pytest.raises(dist.DistError, match="could not prove SHMDIST_SECRET: it is not this job's store"):
            dist.init_process_group("shm", f"tcp://127.0.0.1:{fake.port}", rank=1, world_size=2, timeout=5)
        took = time.monotonic() - start
    finally:
        fake.close()
    print(f"\nTRUST fake store: refused after {took:.3f} s; it received {len(fake.received)} bytes after HELLO")
    assert fake.hello_frames == 1
    assert bytes(fake.received) == b"", "the rank sent the fake store requests after its HELLO"
    assert not dist.is_initialized()
    assert took < 5


def test_something_else_on_the_master_port_is_named(monkeypatch):
    fake = FakeStore(greeting=b"HTTP/1.1 400 Bad Request\r\n\r\n")
    try:
        with pytest.raises(dist.DistError, match="is not a shmdist store"):
            dist.init_process_group("shm", f"tcp://127.0.0.1:{fake.port}", rank=1, world_size=2, timeout=5)
    finally:
        fake.close()


def test_a_fake_data_port_listener_never_gets_the_ranks_proof():
    """The listener answers the HELLO like rank 0 of this job would (it may
    know the job digest from a fake store) but cannot prove the secret."""
    job = tcp.job_digest(["test"])
    listener = socket.create_server(("127.0.0.1", 0))
    got = bytearray()

    def fake_rank0():
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(3)
            hello = rendezvous.recv_exact(conn, tcp.HELLO.size)
            got.extend(hello)
            conn.sendall(tcp.HELLO.pack(tcp.HELLO_MAGIC, tcp.VERSION, 0, 0, os.urandom(16), job)
                         + os.urandom(tcp.PROOF_BYTES))
            try:
                while True:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    got.extend(chunk)
            except OSError:
                pass
    thread = threading.Thread(target=fake_rank0, daemon=True)
    thread.start()
    t = tcp.Transport.__new__(tcp.Transport)
    t.rank, t.secret = 1, "s3cret"
    try:
        with pytest.raises(DistPeerError, match="failed the SHMDIST_SECRET check"):
            t._connect(0, listener.getsockname(), job, time.monotonic() + 5, "rank 1: init_process_group")
    finally:
        thread.join(10)
        listener.close()
    assert len(got) == tcp.HELLO.size, f"the rank sent {len(got) - tcp.HELLO.size} bytes beyond its HELLO"


def test_a_rank_of_another_job_is_refused_by_the_store():
    master = rendezvous.TCPStore("127.0.0.1", 0, is_master=True, timeout=5, job="job-A")
    try:
        with pytest.raises(dist.DistError, match="serves job 'job-A', this rank belongs to job 'job-B'"):
            rendezvous.TCPStore("127.0.0.1", master.port, is_master=False, timeout=5, job="job-B")
        same = rendezvous.TCPStore("127.0.0.1", master.port, is_master=False, timeout=5, job="job-A")
        same.set("k", b"v")
        assert master.get("k", 1) == b"v"
        same.close()
    finally:
        master.close()


def test_torchrun_run_id_is_a_job_identity(monkeypatch):
    monkeypatch.delenv("SHMDIST_JOB_ID")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    assert rendezvous.job_identity() == "run-7"
    monkeypatch.setenv("SHMDIST_JOB_ID", "job-1")
    assert rendezvous.job_identity() == "job-1"


def memfd_mapped_bytes() -> int:
    """Bytes this process maps of shmdist segments (not the flight recorder's)."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "/memfd:shmdist " in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                total += hi - lo
    return total


def maps_what_it_reports(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    dist.new_group([0, 1])
    dist.barrier()
    mapped = memfd_mapped_bytes()
    usage = dist.memory_usage()
    dist.destroy_process_group()
    return usage["total_mapped"], mapped


def test_memory_usage_matches_the_mappings(run_ranks):
    for rank, (reported, mapped) in enumerate(run_ranks(maps_what_it_reports, 3, timeout=60)):
        print(f"\nTRUST rank {rank}: memory_usage {reported} B, /proc/self/maps {mapped} B")
        assert reported == mapped > 0


# ---------------------------------------------------------------- jobs never merge

def member_of(rank, world_size, init_method, job, letter, flag_dir):
    """A rank of job ``letter`` with SHMDIST_JOB_ID ``job`` (None: no identity)."""
    import numpy as np
    if job is None:
        os.environ.pop("SHMDIST_JOB_ID", None)
    else:
        os.environ["SHMDIST_JOB_ID"] = job
    if flag_dir == "slow":
        from shmdist.api import group
        real = group._open_collectives

        def slow(*a, **k):
            time.sleep(1.5)             # set-up takes long: a second claim arrives meanwhile
            return real(*a, **k)
        group._open_collectives = slow
    try:
        dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=8)
    except dist.DistError as e:
        return "error", str(e)
    t = np.full(4, ord(letter), dtype=np.int64)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return "ok", "".join("A" if v == 2 * ord("A") else "B" if v == 2 * ord("B") else "?" for v in t)


def _start_in_order(run_ranks, port, plan, tmp_path):
    """Start the ranks of ``plan`` (rank, job id, letter) one after the other,
    0.3 s apart, on one master port; return each outcome."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = []
    for i, (rank, job, letter, *how) in enumerate(plan):
        p = ctx.Process(target=_one, args=(out, i, rank, port, job, letter, how[0] if how else ""))
        p.start()
        procs.append(p)
        time.sleep(0.3)
    results = {}
    deadline = time.monotonic() + 60
    while len(results) < len(plan) and time.monotonic() < deadline:
        try:
            i, res = out.get(timeout=1)
            results[i] = res
        except Exception:       # noqa: BLE001 - queue.Empty: keep waiting until the deadline
            pass
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
    return [results.get(i, ("hung", "")) for i in range(len(plan))]


def _one(out, i, rank, port, job, letter, flag_dir):
    try:
        out.put((i, member_of(rank, 2, f"tcp://127.0.0.1:{port}", job, letter, flag_dir)))
    except Exception as e:      # noqa: BLE001 - reported to the test
        out.put((i, ("raised", f"{type(e).__name__}: {e}")))


def test_two_jobs_with_identities_on_one_port_never_merge(tmp_path):
    """A0, B1, B0, A1 on one port, each job with its own SHMDIST_JOB_ID: B1
    is refused by A's store naming both jobs, B0 cannot bind, A finishes."""
    from ranks import free_port
    port = free_port()
    a0, b1, b0, a1 = _start_in_order(None, port, [(0, "job-A", "A"), (1, "job-B", "B"),
                                                  (0, "job-B", "B"), (1, "job-A", "A")], tmp_path)
    print(f"\nTRUST two jobs, one port: A0 {a0}\n  B1 {b1}\n  B0 {b0}\n  A1 {a1}")
    assert a0 == a1 == ("ok", "AAAA"), "job A must finish with its own data (A + A in every element)"
    assert b1[0] == "error" and "serves job 'job-A', this rank belongs to job 'job-B'" in b1[1]
    assert b0[0] == "error" and "already in use" in b0[1]


def test_a_rank_claimed_twice_fails_every_rank_involved(tmp_path):
    """Without any job identity: A0 and B1 meet; while they set up, A1
    claims rank 1 again. A1 fails ("already claimed"), and so do A0 and B1
    ("claimed twice"): no rank goes on with ranks that may be another job's.

    (Two jobs that use one port strictly one after the other cannot be told
    apart without an identity; shmdist-run and torchrun always set one.)"""
    from ranks import free_port
    port = free_port()
    a0, b1, a1 = _start_in_order(None, port, [(0, None, "A", "slow"), (1, None, "B", "slow"),
                                              (1, None, "A")], tmp_path)
    print(f"\nTRUST rank 1 claimed twice: A0 {a0}\n  B1 {b1}\n  A1 {a1}")
    assert a1[0] == "error" and "rank 1 is already claimed by another process" in a1[1], a1
    for res in (a0, b1):
        assert res[0] == "error" and "claimed twice: two jobs were started with the same init_method" in res[1], res


# ---------------------------------------------------------------- file://

def test_file_store_refuses_a_symlink(tmp_path):
    target = tmp_path / "elsewhere"
    link = tmp_path / "store"
    link.symlink_to(target)
    with pytest.raises(dist.DistError, match="symbolic link"):
        rendezvous.FileStore(str(link), 1, 5)
    assert not target.exists(), "the store created a file where the link pointed"


def test_file_store_refuses_a_file_of_another_user_or_readable_by_others(tmp_path):
    path = tmp_path / "store"
    path.write_bytes(b"")
    os.chmod(path, 0o644)
    with pytest.raises(dist.DistError, match="mode is 0o644"):
        rendezvous.FileStore(str(path), 1, 5)
    if os.geteuid() == 0:
        os.chmod(path, 0o600)
        os.chown(path, 65534, 65534)
        with pytest.raises(dist.DistError, match="belongs to uid 65534"):
            rendezvous.FileStore(str(path), 1, 5)


def test_file_store_refuses_a_file_that_is_not_a_store(tmp_path):
    path = tmp_path / "store"
    path.write_bytes(b"hello world\n")
    os.chmod(path, 0o600)
    with pytest.raises(dist.DistError, match="line 1 is not a store record"):
        rendezvous.FileStore(str(path), 1, 5)


def test_file_store_applies_the_secret_and_the_job(tmp_path):
    path = str(tmp_path / "store")
    first = rendezvous.FileStore(path, 2, 5, secret="s3cret", job="job-A")
    try:
        with pytest.raises(dist.DistError, match="another SHMDIST_SECRET"):
            rendezvous.FileStore(path, 2, 5, secret="other", job="job-A")
        with pytest.raises(dist.DistError, match="with SHMDIST_SECRET set"):
            rendezvous.FileStore(path, 2, 5, secret="", job="job-A")
        with pytest.raises(dist.DistError, match="belongs to job 'job-A', this rank to job 'job-B'"):
            rendezvous.FileStore(path, 2, 5, secret="s3cret", job="job-B")
        second = rendezvous.FileStore(path, 2, 5, secret="s3cret", job="job-A")
        second.set("k", b"v")
        assert first.get("k", 1) == b"v"
        second.close()
    finally:
        first.close()
    assert not os.path.exists(path)


# ---------------------------------------------------------------- death during rendezvous

def dies_before_publishing(rank, world_size, init_method, victim):
    """The victim is SIGKILLed right after it claimed its rank, before it
    published its info: no pid of it is known to anyone yet."""
    import signal
    from shmdist.rendezvous import store as rv
    if rank == victim:
        real_set = rv.PrefixStore.set

        def set_(self, key, value):
            if key.startswith("info/"):
                os.kill(os.getpid(), signal.SIGKILL)
            return real_set(self, key, value)
        rv.PrefixStore.set = set_
    else:
        time.sleep(0.5)                          # the victim is dead before the others wait for it
    start = time.time()
    try:
        dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=30)
    except dist.DistError as e:
        return type(e).__name__, str(e), time.time() - start
    dist.destroy_process_group()
    return "ok", "", time.time() - start


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_killed_before_publishing_its_info_is_named_within_2_s(run_ranks, world_size):
    victim = world_size - 1
    results = run_ranks(dies_before_publishing, world_size, victim, errors="return", timeout=60)
    for r in range(world_size - 1):
        kind, message, took = results[r]
        print(f"\nTRUST rank {r}: {kind} after {took:.2f} s: {message[:160]}")
        assert kind == "DistPeerError", results[r]
        assert f"rank {victim} (pid " in message and "closed its connection to the rendezvous store" in message
        assert took < 2 + 0.5, f"rank {r} needed {took:.2f} s to name the dead rank (30 s timeout)"

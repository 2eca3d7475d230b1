"""Hostile clients of the store and of the data ports.

The store (served by rank 0) and the data ports must survive anything a
client sends: garbage, frames claiming a gigabyte, slowloris, thousands of
idle connections, clients that never read their replies, bad numbers. Each
such connection is closed on its own; the store goes on serving, rank 0's
memory and file descriptors stay bounded, no live rank is called dead, and
the job finishes.

The unit tests run a store in this process with HELLO_SECONDS cut to 1 s;
the job tests run two ranks under attack (rank 0's open-files limit lowered
to 512 so that 2,000 connections exhaust it) and print rank 0's peak
descriptors and resident memory.
"""
from __future__ import annotations

import json
import math
import os
import resource
import socket
import struct
import sys
import threading
import time

import numpy as np
import pytest

import shmdist as dist
from shmdist.rendezvous import store as rendezvous
from ranks import free_port

R = rendezvous


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _connect(port: int, timeout: float = 5.0) -> tuple[socket.socket, bytes]:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    greeting = R.recv_exact(s, len(R.GREETING) + R.NONCE_BYTES)
    assert greeting.startswith(R.GREETING)
    return s, greeting[len(R.GREETING):]


def _frame(op, key: bytes, value: bytes, tmo: float = 0.0) -> bytes:
    return R._REQ.pack(op, len(key), len(value), tmo) + key + value


def _authed(port: int, secret: str | None = None, job: bytes = b"") -> socket.socket:
    """A raw connection that said a proper HELLO (the way a rank does)."""
    s, theirs = _connect(port)
    mine = os.urandom(R.NONCE_BYTES)
    s.sendall(_frame(R._OP_HELLO, b"", R.HELLO_MAGIC + mine + R._proof(secret, b"client", theirs, mine, job) + job))
    status, n = R._REP.unpack(R.recv_exact(s, R._REP.size))
    R.recv_exact(s, n)
    assert status == R._OK
    return s


def _closed_within(s: socket.socket, seconds: float) -> bool:
    """True once the server closed ``s`` (replies before the close are skipped)."""
    s.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if not s.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except (socket.timeout, TimeoutError):
        return False
    return False


@pytest.fixture(params=["secret", "no secret"])
def store(request, monkeypatch):
    monkeypatch.setattr(R, "HELLO_SECONDS", 1.0)
    secret = "s3cret" if request.param == "secret" else None
    master = R.TCPStore("127.0.0.1", 0, is_master=True, timeout=5, secret=secret or "", job="")
    master.secret_used = secret
    yield master
    master.close()


def _still_serves(master) -> None:
    good = R.TCPStore("127.0.0.1", master.port, is_master=False, timeout=5,
                      secret=master.secret_used or "", job="")
    try:
        good.set("alive", b"yes")
        assert good.get("alive", 2) == b"yes"
        assert good.add("n", 2) >= 2
    finally:
        good.close()


def test_garbage_and_huge_claims_close_only_their_connection(store):
    before = _rss()
    bad = []
    s, _ = _connect(store.port)
    s.sendall(os.urandom(4096))                                     # garbage
    bad.append(("garbage", s))
    for op, klen, vlen in ((R._OP_HELLO, 0, 1 << 30), (R._OP_SET, 1 << 31, 0), (R._OP_SET, 0, 1 << 40)):
        s, _ = _connect(store.port)
        s.sendall(R._REQ.pack(op, klen, vlen, 0.0) + b"x" * 1000)   # a frame claiming a huge size
        bad.append((f"op {op} claiming {klen}+{vlen} bytes", s))
    for _ in range(3):                                              # the same, several at once
        s, _ = _connect(store.port)
        s.sendall(R._REQ.pack(R._OP_HELLO, 0, 1 << 30, 0.0) + os.urandom(60000))
        bad.append(("HELLO claiming 1 GiB", s))
    s, _ = _connect(store.port)
    s.sendall(_frame(R._OP_GET, b"k", b"", 1.0))                     # a request before HELLO
    bad.append(("GET before HELLO", s))
    for what, s in bad:
        assert _closed_within(s, 3), f"{what}: the store kept the connection"
        s.close()
    grew = _rss() - before
    print(f"\nHOSTILE garbage and huge claims: all {len(bad)} closed; RSS grew {grew / 2**20:.1f} MiB")
    assert grew < 64 << 20, "the store buffered what the frames claimed"
    _still_serves(store)
    assert store.server.thread.is_alive()


def test_idle_and_slowloris_connections_are_dropped(store):
    idle, _ = _connect(store.port)
    slow, _ = _connect(store.port)
    hello = _frame(R._OP_HELLO, b"", R.HELLO_MAGIC + bytes(R.NONCE_BYTES + R.PROOF_BYTES))
    start = time.monotonic()
    dropped = None
    for byte in hello:
        try:
            slow.send(bytes([byte]))
        except OSError:
            dropped = time.monotonic() - start
            break
        time.sleep(0.1)
        if _closed_within(slow, 0.01):
            dropped = time.monotonic() - start
            break
    assert _closed_within(idle, 3), "an idle connection that never said HELLO was kept"
    print(f"\nHOSTILE slowloris dropped after {dropped} s (HELLO_SECONDS = {R.HELLO_SECONDS})")
    assert dropped is not None, "a slowloris HELLO was accepted"
    assert len(store.server.conns) <= 1      # the master's own connection
    _still_serves(store)


BAD_REQUESTS = {
    "ADD of a non-integer": _frame(R._OP_ADD, b"n", b"abc"),
    "ADD of NaN text": _frame(R._OP_ADD, b"n", b"nan"),
    "a non-UTF-8 key": _frame(R._OP_SET, b"\xff\xfe", b"v"),
    "ARRIVE with a non-UTF-8 value": _frame(R._OP_ARRIVE, b"b", b"\xff\xfe", 1.0),
    "ARRIVE with a non-integer count": _frame(R._OP_ARRIVE, b"b", b"x:y", 1.0),
    "GET with a NaN timeout": _frame(R._OP_GET, b"nothing", b"", math.nan),
    "GET with an infinite timeout": _frame(R._OP_GET, b"nothing", b"", math.inf),
    "GET with a negative timeout": _frame(R._OP_GET, b"nothing", b"", -1.0),
    "an unknown op": _frame(99, b"k", b"v"),
    "a second HELLO": _frame(R._OP_HELLO, b"", R.HELLO_MAGIC + bytes(48)),
}


@pytest.mark.parametrize("what", sorted(BAD_REQUESTS))
def test_a_bad_value_closes_its_connection_and_the_store_lives(what, monkeypatch):
    """Without a secret anyone may speak to the store: a request no rank
    sends closes that connection; the store serves on, without spinning."""
    master = R.TCPStore("127.0.0.1", 0, is_master=True, timeout=5, secret="", job="")
    try:
        s = _authed(master.port)
        s.sendall(BAD_REQUESTS[what])
        assert _closed_within(s, 3), f"{what}: the connection stayed open"
        s.close()
        cpu = time.process_time()
        time.sleep(0.5)
        spent = time.process_time() - cpu
        assert spent < 0.3, f"{what}: the store spins ({spent:.2f} s of CPU in 0.5 s)"
        master.set("after", b"1")
        assert master.get("after", 1) == b"1"
        assert master.server.thread.is_alive()
    finally:
        master.close()


def test_a_client_that_never_reads_cannot_stall_the_store():
    master = R.TCPStore("127.0.0.1", 0, is_master=True, timeout=5, secret="", job="")
    try:
        master.set("big", b"x" * (R.MAX_VALUE - 1))
        hog = _authed(master.port)
        hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        hog.settimeout(10)
        asked = 0
        start = time.monotonic()
        try:
            for _ in range(64):                     # 64 MiB of replies asked for, none read
                hog.sendall(_frame(R._OP_GET, b"big", b"", 1.0))
                asked += 1
                master.set(f"k{asked}", b"v")       # the store answers others meanwhile
        except OSError:
            pass                                    # the store closed it
        took = time.monotonic() - start
        assert _closed_within(hog, 5), "a client that never reads was kept"
        print(f"\nHOSTILE never-reading client: dropped after {asked} GETs of 1 MiB; "
              f"others served meanwhile in {took:.2f} s")
        assert master.get("k1", 1) == b"v"
    finally:
        master.close()


def test_pid_alive_does_not_read_emfile_as_dead():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))   # no new descriptor fits
    try:
        with pytest.raises(OSError):
            open("/proc/self/stat").close()             # no file can be opened now
        alive = R.pid_alive(os.getppid())
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert alive, "pid_alive called a live process dead because no file could be opened"


# ---------------------------------------------------------------- a job under attack

def _sample(stats, stop):
    while not stop.is_set():
        try:
            stats["fds"] = max(stats["fds"], len(os.listdir("/proc/self/fd")))
        except OSError:
            stats["emfile"] += 1
        stats["rss"] = max(stats["rss"], _rss())
        time.sleep(0.01)


def under_attack(rank, world_size, init_method, flag, limit, secret):
    if secret:
        os.environ["SHMDIST_SECRET"] = secret
    stats = {"fds": 0, "rss": 0, "emfile": 0}
    stop = threading.Event()
    if rank == 0:
        R.HELLO_SECONDS = 2.0
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        stats["rss0"] = _rss()
        threading.Thread(target=_sample, args=(stats, stop), daemon=True).start()
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)                     # join while the attack runs
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    sums = []
    for _ in range(3):
        g = dist.new_group([0, 1])
        t = np.full(1000, rank + 1.0)
        dist.all_reduce(t, group=g)
        sums.append(float(t[0]))
    dropped = getattr(sys.modules["shmdist.api.group"]._world.owned_store.server, "dropped", -1) if rank == 0 else 0
    dist.barrier()
    dist.destroy_process_group()
    stop.set()
    return sums, stats, dropped


def _attack(port: int, flag: str, connections: int, done: threading.Event, report: dict):
    """Garbage, huge claims, slowloris and ``connections`` idle connections,
    held until ``done``; writes ``flag`` once they are under way."""
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "rank 0's store never listened"
            time.sleep(0.05)
    held = []

    def opened(payload: bytes = b"") -> None:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=0.5)
            if payload:
                s.sendall(payload)
            held.append(s)
        except OSError:
            report["refused"] += 1
    for _ in range(5):
        opened(os.urandom(1024))
        opened(R._REQ.pack(R._OP_HELLO, 0, 1 << 30, 0.0) + os.urandom(4096))
        opened(R._REQ.pack(R._OP_SET, 1 << 30, 1 << 30, 0.0))
    slow = [socket.create_connection(("127.0.0.1", port), timeout=1) for _ in range(5)]
    for i in range(connections):
        opened()
        if i == connections // 4:
            open(flag, "w").close()               # rank 1 starts now, in the middle of it
    open(flag, "w").close()
    report["opened"] = len(held)
    while not done.wait(0.2):                     # slowloris: a byte now and then
        for s in slow:
            try:
                s.send(b"\0")
            except OSError:
                pass
    for s in held + slow:
        s.close()


@pytest.mark.parametrize("secret", ["s3cret", ""], ids=["secret", "no-secret"])
def test_a_job_finishes_under_attack(run_ranks, tmp_path, secret):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    connections = 2000
    if soft < connections + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, connections + 500), hard))
    port = free_port()
    flag = str(tmp_path / "attacking")
    done, report = threading.Event(), {"refused": 0}
    attacker = threading.Thread(target=_attack, args=(port, flag, connections, done, report), daemon=True)
    attacker.start()
    limit = 512
    try:
        results = run_ranks(under_attack, 2, flag, limit, secret, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=120)
    finally:
        done.set()
        attacker.join(30)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    (sums0, stats, dropped), (sums1, _, _) = results
    grew = stats["rss"] - stats["rss0"]
    print(f"\nHOSTILE job under attack ({'secret' if secret else 'no secret'}): {report.get('opened')} attack "
          f"connections held, {report['refused']} refused; rank 0 peak {stats['fds']} fds (limit {limit}), "
          f"RSS +{grew / 2**20:.1f} MiB, {dropped} connections dropped by the store")
    assert sums0 == sums1 == [3.0, 3.0, 3.0], "the job did not compute its results"
    assert stats["fds"] <= limit
    assert grew < 128 << 20, f"rank 0's memory grew by {grew / 2**20:.0f} MiB under attack"
    assert dropped > 0


# ---------------------------------------------------------------- data ports

def tcp_job_with_idle_intruders(rank, world_size, init_method, flag):
    if rank == 1:                   # rank 1 connects to rank 0 only once the intruders are in
        from shmdist.transport import tcp
        real = tcp.Transport._connect

        def late(*a, **k):
            deadline = time.monotonic() + 60
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.05)
            return real(*a, **k)
        tcp.Transport._connect = late
    dist.init_process_group("tcp", init_method, rank=rank, world_size=world_size, timeout=30)
    t = np.full(10, rank + 1.0)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return float(t[0])


def test_idle_and_garbage_connections_to_a_data_port_do_not_kill_init(run_ranks, tmp_path):
    """Before rank 1 connects, intruders open rank 0's data port: some say
    nothing, one sends garbage, one a HELLO of another job. Rank 0 accepts
    rank 1 anyway (handshakes run side by side, each with its own deadline)."""
    port = free_port()
    flag = str(tmp_path / "intruded")
    held = []

    def intrude():
        deadline = time.monotonic() + 60
        where = None
        while where is None and time.monotonic() < deadline:
            try:
                probe = R.TCPStore("127.0.0.1", port, is_master=False, timeout=2)
                where = json.loads(probe.get("shmdist/tcp/0", 20))
                probe.close()
            except dist.DistError:
                time.sleep(0.1)
        for payload in (b"", b"", b"", os.urandom(200), struct.pack("<I", 0x50435444) + os.urandom(60)):
            s = socket.create_connection(tuple(where), timeout=5)
            if payload:
                s.sendall(payload)
            held.append(s)
        open(flag, "w").close()
    thread = threading.Thread(target=intrude, daemon=True)
    thread.start()
    try:
        results = run_ranks(tcp_job_with_idle_intruders, 2, flag, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=90)
    finally:
        thread.join(30)
        for s in held:
            s.close()
    assert results == [3.0, 3.0]
    assert len(held) == 5

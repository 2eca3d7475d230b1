"""The TCP transport: backend "tcp" (TCP between every pair), the data-port
handshake and its shared secret, and peers that die or send garbage."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import shmdist as dist
from shmdist import _core
from shmdist.api import group as _group
from shmdist.transport.engine import make_header
from shmdist.errors import DistPeerError, DistTimeoutError
from shmdist.transport.tcp import Transport, job_digest
from shmdist.tensors import as_buf


def p2p_cases(rank, world_size, init_method, backend="tcp"):
    """Every pair, both directions at once with 8 MiB (more than any socket
    buffer: both ranks send before they receive), tags out of order,
    any-source, and a group. Returns what it got."""
    dist.init_process_group(backend, init_method, rank=rank, world_size=world_size, timeout=60)
    got = {}
    big = np.arange(1 << 20, dtype=np.float64) * (rank + 1)
    for peer in range(world_size):
        if peer == rank:
            continue
        out = np.empty_like(big)
        reqs = [dist.isend(big, peer), dist.irecv(out, peer)]
        for r in reqs:
            r.wait()
        got[f"big from {peer}"] = bool((out == np.arange(1 << 20) * (peer + 1)).all())
    if rank == 0:
        for tag in (3, 1, 2):
            dist.send(np.array([tag, rank], dtype=np.int32), 1, tag=tag).wait()
    elif rank == 1:
        order = []
        for tag in (1, 2, 3):
            t = np.zeros(2, dtype=np.int32)
            dist.recv(t, 0, tag=tag).wait()
            order.append(t.tolist())
        got["tags"] = order
    if rank == world_size - 1:
        senders = []
        for _ in range(world_size - 1):
            t = np.zeros(1, dtype=np.int64)
            senders.append(dist.recv(t).wait() and int(t[0]))
        got["any source"] = sorted(senders)
    else:
        dist.send(np.array([rank], dtype=np.int64), world_size - 1, tag=0).wait()
    odd = dist.new_group([r for r in range(world_size) if r % 2])
    if rank % 2:
        t = np.array([rank * 10.0])
        dist.all_reduce(t, group=odd)
        got["odd group sum"] = float(t[0])
    dist.barrier()
    dist.destroy_process_group()
    return got


def expected_p2p(rank, world_size):
    want = {f"big from {p}": True for p in range(world_size) if p != rank}
    if rank == 1:
        want["tags"] = [[1, 0], [2, 0], [3, 0]]
    if rank == world_size - 1:
        want["any source"] = list(range(world_size - 1))
    if rank % 2:
        want["odd group sum"] = float(sum(r * 10 for r in range(world_size) if r % 2))
    return want


@pytest.mark.parametrize("world_size", [2, 3])
def test_backend_tcp_point_to_point(run_ranks, world_size):
    results = run_ranks(p2p_cases, world_size, timeout=120)
    assert results == [expected_p2p(r, world_size) for r in range(world_size)]


def test_transport_env_var_forces_tcp(run_ranks):
    results = run_ranks(p2p_cases, 2, "shm", timeout=120, env={"SHMDIST_TRANSPORT": "tcp"})
    assert results == [expected_p2p(r, 2) for r in range(2)]


def die_while_peer_waits(rank, world_size, init_method):
    dist.init_process_group("tcp", init_method, rank=rank, world_size=world_size, timeout=60)
    dist.barrier()
    if rank == 1:
        os._exit(3)
    try:
        dist.recv(np.zeros(4), src=1).wait(timeout=30)
    except DistPeerError as e:
        return str(e)
    finally:
        dist.destroy_process_group()
    return "no error"


def test_dead_peer_over_tcp_is_named(run_ranks):
    """The wait's own timeout is 30 s: the error must come from the closed socket."""
    results = run_ranks(die_while_peer_waits, 2, timeout=60, errors="return")
    assert results[1].exitcode == 3
    assert results[0].startswith("rank 0: recv from rank 1: rank 1 closed its connection"), results[0]


def garbage_sender(rank, world_size, init_method):
    dist.init_process_group("tcp", init_method, rank=rank, world_size=world_size, timeout=60)
    dist.barrier()
    if rank == 1:
        _group.world().tcp.links[0].sock.send(b"\x00" * _core.HEADER_BYTES)
        dist.recv(np.zeros(1), src=0).wait(timeout=30)     # until rank 0 hangs up on it
        return "no error"
    try:
        dist.recv(np.zeros(4), src=1).wait(timeout=30)
    except DistPeerError as e:
        return str(e)
    return "no error"


def test_garbage_from_a_peer_is_rejected_naming_it(run_ranks):
    results = run_ranks(garbage_sender, 2, timeout=60, errors="return")
    assert "rank 1 sent a malformed message (bad magic 0x00000000" in results[0], results[0]
    assert "rank 0 closed its connection" in str(getattr(results[1], "message", results[1]))


# ---------------------------------------------------------------- the handshake, in one process

class DictStore:
    def __init__(self):
        self.data, self.cond = {}, threading.Condition()

    def set(self, key, value):
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def get(self, key, timeout=None):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout):
                raise DistTimeoutError(key)
            return self.data[key]


def two_transports(secrets, monkeypatch, timeout=5.0):
    """Rank 0 and rank 1 in threads; returns each one's Transport or exception."""
    monkeypatch.setenv("SHMDIST_TCP_ADDR", "127.0.0.1")
    store, job, out = DictStore(), job_digest(["test"]), [None, None]

    def make(rank):
        try:
            out[rank] = Transport(rank, [1 - rank], store, job, timeout, f"rank {rank}: test", secrets[rank])
        except Exception as e:
            out[rank] = e

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_same_secret_connects_and_a_record_crosses(monkeypatch):
    t0, t1 = two_transports(["s3cret", "s3cret"], monkeypatch)
    try:
        data = np.arange(100000, dtype=np.int64)
        header = make_header(0, 0, 1, as_buf(data, writable=False, who="test"))
        a, b = t1.links[0], t0.links[1]
        out = np.zeros_like(data)
        pos, got, total = 0, 0, _core.record_bytes(data.nbytes)
        header_in = None
        while pos < total or got < total:
            seen = _core.bell_value(t0.ctl)
            pos = a.push(header, data.ctypes.data, data.nbytes, pos) if pos < total else pos
            if header_in is None:
                header_in = b.peek()
            if header_in is not None and got < total:
                got = b.pull(out.ctypes.data, out.nbytes, got)
            if got < total:    # the I/O thread rings rank 0's doorbell when more can move
                _core.wait_bell(t0.ctl, seen, 0, 0, 0.05)
        assert header_in == header and (out == data).all()
        t1.close("rank 7 died")      # its goodbye says why it left
        assert _wait_gone(b) == "left the group (destroy_process_group) after rank 7 died"
        assert b.cause == "rank 7 died"
    finally:
        t0.close()


def _wait_gone(link):
    for _ in range(1000):
        link.peek()                  # a goodbye is a record: it is read in order, after the data
        why = link.gone()
        if why:
            return why
        threading.Event().wait(0.01)
    return "still connected"


def test_a_peer_without_the_secret_is_refused(monkeypatch):
    t0, t1 = two_transports(["s3cret", "other"], monkeypatch, timeout=3.0)
    assert isinstance(t1, DistPeerError) and "SHMDIST_SECRET" in str(t1), t1
    assert isinstance(t0, DistTimeoutError), t0
    assert "rank(s) [1]" in str(t0) and "1 connection(s) failed" in str(t0)

"""Point-to-point send/recv between real processes: the seed page's examples,
large and many messages, ordering, tags, any-source, and groups."""
from __future__ import annotations

import contextlib
import hashlib
import io
import os

import numpy as np
import pytest

import shmdist as dist
from ranks import wait_until_gone

pytestmark = pytest.mark.usefixtures("transport")   # each test over shm, then over TCP


def _printed(fn, *args) -> str:
    """What ``fn(*args)`` prints, without its trailing newline."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn(*args)
    return out.getvalue().rstrip("\n")


def _new_tensor(kind: str, values, dtype="int64"):
    if kind == "torch":
        import torch
        return torch.tensor(values, dtype=getattr(torch, dtype))
    return np.array(values, dtype=dtype)


def _zeros(kind: str, n: int):
    if kind == "torch":
        import torch
        return torch.zeros(n, dtype=torch.int64)
    return np.zeros(n, dtype=np.int64)


# ---------------------------------------------------------------- the seed page's examples

def seed_tensor_sent(rank, world_size, init_method, kind):
    dist.init_process_group(backend="gloo", init_method=init_method, rank=rank, world_size=world_size)
    if rank == 0:
        def example():
            t = _new_tensor(kind, [1, 2, 3, 4, 5])
            req = dist.send(t, dst=1)
            req.wait()
            print("Tensor sent")
        result = _printed(example)
    else:
        t = _zeros(kind, 5)
        dist.recv(t, src=0).wait()
        result = t.tolist()
    dist.destroy_process_group()
    return result


def seed_process_sent(rank, world_size, init_method, kind):
    dist.init_process_group(backend="gloo", init_method=init_method, rank=rank, world_size=world_size)
    if rank == 0:
        def example():
            t = _new_tensor(kind, [10, 20, 30, 40, 50])
            req = dist.send(t, dst=1)
            req.wait()
            print(f"Process {dist.get_rank()} sent tensor: {t}")
        result = _printed(example)
    else:
        t = _zeros(kind, 5)
        req = dist.recv(t, src=0)
        req.wait()
        result = (t.tolist(), req.source)
    dist.destroy_process_group()
    return result


def seed_custom_group(rank, world_size, init_method, kind):
    dist.init_process_group(backend="gloo", init_method=init_method, rank=rank, world_size=world_size)
    result = None
    new_group = dist.new_group([0, 2, 3])
    if dist.get_rank() == 0:
        def example():
            t = _new_tensor(kind, [100, 200, 300])
            req = dist.send(t, dst=2, group=new_group)
            req.wait()
            print("Tensor sent to rank 2 in custom group")
        result = _printed(example)
    elif rank == 2:
        t = _zeros(kind, 3)
        dist.recv(t, src=0, group=new_group).wait()
        result = t.tolist()
    dist.destroy_process_group()
    return result


@pytest.fixture(params=["numpy", "torch"])
def kind(request):
    if request.param == "torch":
        pytest.importorskip("torch")
    return request.param


def test_seed_example_tensor_sent(run_ranks, kind):
    assert run_ranks(seed_tensor_sent, 2, kind) == ["Tensor sent", [1, 2, 3, 4, 5]]


def test_seed_example_process_sent(run_ranks, kind):
    shown = "tensor([10, 20, 30, 40, 50])" if kind == "torch" else "[10 20 30 40 50]"
    assert run_ranks(seed_process_sent, 2, kind) == [
        f"Process 0 sent tensor: {shown}", ([10, 20, 30, 40, 50], 0)]


def test_seed_example_custom_group(run_ranks, kind):
    assert run_ranks(seed_custom_group, 4, kind) == [
        "Tensor sent to rank 2 in custom group", None, [100, 200, 300], None]


# ---------------------------------------------------------------- large messages

def _pattern(nbytes: int, seed: int) -> np.ndarray:
    """nbytes of data that differ at every 8-byte word and between seeds."""
    words = np.arange(nbytes // 8, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    words += np.uint64(seed)
    return words.view(np.uint8)


def send_huge(rank, world_size, init_method, nbytes):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    digest = np.zeros(32, dtype=np.uint8)
    if rank == 0:
        data = _pattern(nbytes, seed=7)
        digest[:] = np.frombuffer(hashlib.sha256(data).digest(), dtype=np.uint8)
        dist.send(data, dst=1).wait()
        dist.send(digest, dst=1).wait()
        result = None
    else:
        data = np.empty(nbytes, dtype=np.uint8)
        dist.recv(data, src=0).wait()
        dist.recv(digest, src=0).wait()
        result = hashlib.sha256(data).digest() == digest.tobytes()
    dist.destroy_process_group()
    return result


def test_256_mib_message_arrives_intact(run_ranks):
    assert run_ranks(send_huge, 2, 256 << 20, timeout=90) == [None, True]


def exchange_both_ways(rank, world_size, init_method, nbytes):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    peer = 1 - rank
    out = _pattern(nbytes, seed=rank)
    into = np.empty(nbytes, dtype=np.uint8)
    sent = dist.isend(out, dst=peer)
    received = dist.irecv(into, src=peer)
    sent.wait()
    received.wait()
    dist.destroy_process_group()
    return np.array_equal(into, _pattern(nbytes, seed=peer))


def test_both_ranks_isend_64_mib_before_irecv(run_ranks):
    assert run_ranks(exchange_both_ways, 2, 64 << 20) == [True, True]


def streamed_at_odd_offsets(rank, world_size, init_method, sizes):
    """Each message lands at another misalignment inside a larger buffer;
    the bytes either side of it must stay untouched."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    bad = []
    for i, n in enumerate(sizes):
        if rank == 0:
            dist.send(_pattern(n + 16, seed=i)[3:3 + n], dst=1).wait()
        else:
            off = 1 + i % 63
            box = np.full(n + 128, 0xA5, dtype=np.uint8)
            dist.recv(box[off:off + n], src=0).wait()
            intact = (box[:off] == 0xA5).all() and (box[off + n:] == 0xA5).all()
            if not (intact and np.array_equal(box[off:off + n], _pattern(n + 16, seed=i)[3:3 + n])):
                bad.append(i)
    dist.destroy_process_group()
    return bad if rank == 1 else None


@pytest.mark.parametrize("ring", [None, "65536"], ids=["default-ring", "64KiB-ring"])
def test_streamed_receives_keep_every_byte_at_odd_offsets(run_ranks, ring):
    """SHMDIST_STREAM_BYTES=1 sends every payload through the streaming-store
    copy (normally only those of half the last-level cache and up)."""
    sizes = [1, 15, 63, 64, 65, 127, 4095, 65536 + 17, (1 << 20) + 33, (3 << 20) + 5]
    env = {"SHMDIST_STREAM_BYTES": "1", "SHMDIST_RING_BYTES": ring}
    assert run_ranks(streamed_at_odd_offsets, 2, sizes, env=env) == [None, []]


# ---------------------------------------------------------------- order, tags, sources

def _mixed_sizes(count: int) -> list[int]:
    rng = np.random.default_rng(2)
    choices = [0, 1, 7, 8, 63, 64, 65, 1000, 4096, 65535, 65536, (1 << 20) - 1, 1 << 20,
               (1 << 20) + 1, 3 << 20]
    return [int(rng.choice(choices)) for _ in range(count)]


def _message(i: int, size: int) -> np.ndarray:
    return np.full(size, i + 1, dtype=np.uint8)


def many_in_order(rank, world_size, init_method, count):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    sizes = _mixed_sizes(count)
    if rank == 0:
        messages = [_message(i, n) for i, n in enumerate(sizes)]
        for req in [dist.isend(m, dst=1) for m in messages]:
            req.wait()
        result = None
    else:
        boxes = [np.zeros(n, dtype=np.uint8) for n in sizes]
        for req in [dist.irecv(b, src=0) for b in boxes]:
            req.wait()
        result = [i for i, b in enumerate(boxes) if not np.array_equal(b, _message(i, sizes[i]))]
    dist.destroy_process_group()
    return result


@pytest.mark.parametrize("ring", [None, "65536"], ids=["default-ring", "64KiB-ring"])
def test_100_mixed_size_messages_arrive_in_order(run_ranks, ring):
    sizes = _mixed_sizes(100)
    assert min(sizes) == 0 and max(sizes) > (1 << 20), "the mix must include empty and multi-chunk messages"
    assert run_ranks(many_in_order, 2, 100, env={"SHMDIST_RING_BYTES": ring}) == [None, []]


def tags_out_of_order(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    if rank == 0:
        for tag in (1, 2, 3):
            dist.send(np.array([tag * 10], dtype=np.int64), dst=1, tag=tag).wait()
        result = None
    else:
        result = []
        for tag in (3, 1, 2):
            box = np.zeros(1, dtype=np.int64)
            dist.recv(box, src=0, tag=tag).wait()
            result.append((tag, int(box[0])))
    dist.destroy_process_group()
    return result


def test_tags_received_out_of_order(run_ranks):
    assert run_ranks(tags_out_of_order, 2) == [None, [(3, 30), (1, 10), (2, 20)]]


def any_source(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    if rank == 0:
        boxes = [np.zeros(1, dtype=np.int64) for _ in range(world_size - 1)]
        reqs = [dist.recv(b, src=None) for b in boxes]
        for req in reqs:
            req.wait()
        result = sorted((req.source, int(b[0])) for req, b in zip(reqs, boxes))
    else:
        dist.send(np.array([rank * 100], dtype=np.int64), dst=0).wait()
        result = None
    dist.destroy_process_group()
    return result


def test_any_source_reports_the_sender(run_ranks):
    assert run_ranks(any_source, 4)[0] == [(1, 100), (2, 200), (3, 300)]


def ring_token(rank, world_size, init_method, laps):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    token = np.zeros(1, dtype=np.int64)
    after, before = (rank + 1) % world_size, (rank - 1) % world_size
    for _ in range(laps):
        if rank != 0:
            dist.recv(token, src=before).wait()
        token += 1
        dist.send(token, dst=after).wait()
        if rank == 0:
            dist.recv(token, src=before).wait()
    dist.destroy_process_group()
    return int(token[0])


def test_8_ranks_on_2_cores_pass_a_token_round_a_ring(run_ranks):
    """More ranks than cores must not collapse: 1600 hand-offs in well under the timeout."""
    results = run_ranks(ring_token, 8, 200, timeout=60)
    assert results[0] == 8 * 200


N_LEFT = 96 << 10     # (from engine.ONE_WAY_SINGLE_MIN a send waits until its message was read)


def delivered_after_sender_left(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    pid = np.array([os.getpid()], dtype=np.int64)
    if rank == 0:
        dist.send(pid, dst=1).wait()
        # fits the ring, under the one-way single-copy size: completes at once
        dist.send(_pattern(N_LEFT, seed=3), dst=1).wait()
        dist.destroy_process_group()
        return None
    dist.recv(pid, src=0).wait()
    wait_until_gone(int(pid[0]))
    box = np.empty(N_LEFT, dtype=np.uint8)
    dist.recv(box, src=0).wait(timeout=10)
    dist.destroy_process_group()
    return np.array_equal(box, _pattern(N_LEFT, seed=3))


def test_completed_send_is_delivered_after_the_sender_exits(run_ranks):
    assert run_ranks(delivered_after_sender_left, 2) == [None, True]

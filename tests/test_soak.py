"""Soak: 4 ranks exchange random messages interleaved with random collectives.

Every round, all ranks derive the same plan from a shared seed: a few to a
few dozen messages between random pairs, of random sizes (0 B to 4 MiB,
mostly small), random dtypes and shapes, random tags (several messages often
share a pair and a tag, so their order matters), some received from any
source; and, in most rounds, a random collective (all_reduce small or large,
reduce, broadcast, all_gather, barrier) run while those messages are still
in flight. Each rank posts its sends and receives in a random interleaving,
runs the collective, then waits for everything in a random order.

Every payload is a pseudo-random pattern keyed by (seed, round, message), so
the receiver compares all of its bytes with what must have been sent (a
checksum as strong as it gets): a misplaced chunk, a message delivered to
the wrong receive, or out of order, counts as corrupted; a receive that
never completes counts as lost; an any-source receive that names the wrong
sender is counted too. RSS is measured after warming up and at the end.

Seconds-scale by default. For the long run of issue 6 (10^6 messages):

    SHMDIST_SOAK_SECONDS=7200 SHMDIST_SOAK_MESSAGES=1000000 python -m pytest tests/test_soak.py -s

SHMDIST_SOAK_SEED replays a run (the seed is printed).
"""
from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest

import shmdist as dist

SECONDS_ENV = "SHMDIST_SOAK_SECONDS"
MESSAGES_ENV = "SHMDIST_SOAK_MESSAGES"
SEED_ENV = "SHMDIST_SOAK_SEED"
DEFAULT_SECONDS = 8.0
WORLD = 4
MAX_BYTES = 4 << 20
DTYPES = [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
          np.float16, np.float32, np.float64, np.complex64, np.complex128, np.bool_]
ANY_TAG_BASE = 1 << 30          # tags of any-source messages: unique within a round
WARM_ROUNDS = 20                # RSS "before" is taken after these
MASK = (1 << 64) - 1


@pytest.fixture
def soak_seconds() -> float:
    """How long the exchange runs: SHMDIST_SOAK_SECONDS (default 8 s)."""
    return float(os.environ.get(SECONDS_ENV, DEFAULT_SECONDS))


@pytest.fixture
def soak_messages() -> int:
    """Stop early once this many messages went through (SHMDIST_SOAK_MESSAGES; 0: no limit)."""
    return int(float(os.environ.get(MESSAGES_ENV, 0)))


# ---------------------------------------------------------------- what every rank derives from the seed

def pattern(key: int, nbytes: int) -> np.ndarray:
    """``nbytes`` pseudo-random bytes determined by ``key`` (no period: every
    8-byte word mixes its own index)."""
    words = np.arange((nbytes + 7) // 8, dtype=np.uint64)
    words += np.uint64((key * 0x9E3779B97F4A7C15) & MASK)
    words ^= words >> np.uint64(31)
    words *= np.uint64(0xBF58476D1CE4E5B9)
    words ^= words >> np.uint64(29)
    return words.view(np.uint8)[:nbytes]


def message_key(seed: int, rnd: int, i: int) -> int:
    return (seed * 1_000_003 + rnd * 4099 + i + 1) & MASK


def _size(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.05:
        return 0
    if r < 0.75:
        return rng.randint(1, 512)
    if r < 0.95:
        return rng.randint(513, 64 << 10)
    return rng.randint((64 << 10) + 1, MAX_BYTES)


def plan(seed: int, rnd: int, n: int):
    """The messages of a round: (i, src, dst, dtype, shape, tag, any_source)."""
    rng = random.Random(seed * 7919 + rnd)
    msgs = []
    for i in range(rng.randint(4, 32)):
        src = rng.randrange(n)
        dst = rng.choice([r for r in range(n) if r != src])
        dtype = np.dtype(rng.choice(DTYPES))
        count = _size(rng) // dtype.itemsize
        shape = (count,)
        if count and rng.random() < 0.2:
            for a in (2, 3, 4, 5, 8):
                if count % a == 0:
                    shape = (a, count // a)
                    break
        any_source = rng.random() < 0.25
        if any_source:
            tag = ANY_TAG_BASE + i
        else:
            tag = rng.randrange(4) if rng.random() < 0.7 else rng.randrange(1 << 20)
        msgs.append((i, src, dst, dtype, shape, tag, any_source))
    r = rng.random()
    coll = None
    if r < 0.75:
        kind = rng.choice(["all_reduce", "all_reduce", "reduce", "broadcast", "all_gather", "barrier"])
        coll = (kind, rng.randrange(n), rng.choice([rng.randint(1, 512), rng.randint(513, 600_000)]),
                rng.choice([np.int64, np.float32, np.int32]))
    return msgs, coll, rng.random()


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return -1


# ---------------------------------------------------------------- one rank

def _collective(coll, rank, n, seed, rnd, stats):
    kind, root, count, dtype = coll
    dtype = np.dtype(dtype)
    base = np.arange(count) % 1000
    if kind in ("all_reduce", "reduce"):
        t = (base + rank + 1).astype(dtype)
        if kind == "all_reduce":
            dist.all_reduce(t)
        else:
            dist.reduce(t, dst=root)
        if kind == "all_reduce" or rank == root:
            want = (n * base + n * (n + 1) // 2).astype(dtype)
            if not np.array_equal(t, want):
                stats["collectives_bad"].append(f"round {rnd}: {kind} of {count} {dtype}")
    elif kind == "broadcast":
        nbytes = count * dtype.itemsize
        want = pattern(message_key(seed, rnd, 10_000), nbytes)
        t = want.copy() if rank == root else np.zeros(nbytes, dtype=np.uint8)
        dist.broadcast(t, src=root)
        if not np.array_equal(t, want):
            stats["collectives_bad"].append(f"round {rnd}: broadcast of {nbytes} bytes from {root}")
    elif kind == "all_gather":
        nbytes = min(count * dtype.itemsize, 1 << 20)
        mine = pattern(message_key(seed, rnd, 20_000 + rank), nbytes)
        outs = [np.zeros(nbytes, dtype=np.uint8) for _ in range(n)]
        dist.all_gather(outs, mine)
        for j, out in enumerate(outs):
            if not np.array_equal(out, pattern(message_key(seed, rnd, 20_000 + j), nbytes)):
                stats["collectives_bad"].append(f"round {rnd}: all_gather part of rank {j}")
    else:
        dist.barrier()
    stats["collectives"] += 1


def soak(rank, world_size, init_method, seconds, max_messages, seed):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=120)
    stats = {"sent": 0, "received": 0, "bytes": 0, "corrupted": [], "wrong_source": [], "lost": [],
             "collectives": 0, "collectives_bad": [], "rounds": 0, "messages_total": 0,
             "rss_init": _rss(), "rss_warm": None, "rss_end": None}
    mix = random.Random(seed * 31 + rank)     # this rank's own posting and waiting order
    start = time.monotonic()
    flag = np.zeros(1, dtype=np.int64)
    rnd = 0
    while True:
        msgs, coll, _ = plan(seed, rnd, world_size)
        sends = [m for m in msgs if m[1] == rank]
        recvs = [m for m in msgs if m[2] == rank]
        # a random interleaving that keeps the plan's order among sends and among receives
        ops = _merge([("s", m) for m in sends], [("r", m) for m in recvs], mix)
        pending = []
        coll_at = mix.randint(0, len(ops))
        for k, (what, m) in enumerate(ops):
            if coll is not None and k == coll_at:
                _collective(coll, rank, world_size, seed, rnd, stats)
                coll = None
            i, src, dst, dtype, shape, tag, any_source = m
            nbytes = int(np.prod(shape)) * dtype.itemsize
            if what == "s":
                data = pattern(message_key(seed, rnd, i), nbytes).view(dtype).reshape(shape)
                pending.append(("s", m, data, dist.send(data, dst=dst, tag=tag)))
            else:
                box = np.empty(shape, dtype=dtype)
                box.view(np.uint8).fill(0xA5)
                req = dist.recv(box, src=None if any_source else src, tag=tag)
                pending.append(("r", m, box, req))
        if coll is not None:
            _collective(coll, rank, world_size, seed, rnd, stats)
        mix.shuffle(pending)
        for what, m, data, req in pending:
            i, src, dst, dtype, shape, tag, any_source = m
            try:
                req.wait(timeout=60)
            except dist.DistTimeoutError as e:
                stats["lost"].append(f"round {rnd} message {i} {src}->{dst}: {e}")
                continue
            if what == "s":
                stats["sent"] += 1
                continue
            stats["received"] += 1
            stats["bytes"] += data.nbytes
            want = pattern(message_key(seed, rnd, i), data.nbytes)
            if not np.array_equal(data.view(np.uint8).reshape(-1), want):
                stats["corrupted"].append(f"round {rnd} message {i} {src}->{dst} {data.dtype}{list(shape)} "
                                          f"tag {tag}")
            if req.source != src:
                stats["wrong_source"].append(f"round {rnd} message {i}: source {req.source}, sent by {src}")
        stats["messages_total"] += len(msgs)
        rnd += 1
        stats["rounds"] = rnd
        if rnd == WARM_ROUNDS:
            stats["rss_warm"] = _rss()
        if rank == 0:
            done = time.monotonic() - start >= seconds or (max_messages and stats["messages_total"] >= max_messages)
            flag[0] = 1 if done and rnd > WARM_ROUNDS else 0
        dist.broadcast(flag, src=0)
        if flag[0]:
            break
    stats["seconds"] = time.monotonic() - start
    stats["rss_end"] = _rss()
    stats["memory_usage"] = dist.memory_usage()
    dist.destroy_process_group()
    return stats


def _merge(a: list, b: list, rng: random.Random) -> list:
    """A random interleaving of ``a`` and ``b`` that keeps each one's order."""
    out, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        if j == len(b) or (i < len(a) and rng.random() < len(a[i:]) / (len(a[i:]) + len(b[j:]))):
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out


@pytest.mark.timeout(float(os.environ.get(SECONDS_ENV, DEFAULT_SECONDS)) + 300)
def test_soak(run_ranks, soak_seconds, soak_messages):
    seed = int(os.environ.get(SEED_ENV) or random.randrange(1 << 30))
    results = run_ranks(soak, WORLD, soak_seconds, soak_messages, seed, timeout=soak_seconds + 240)
    sent = sum(r["sent"] for r in results)
    received = sum(r["received"] for r in results)
    planned = results[0]["messages_total"]
    gib = sum(r["bytes"] for r in results) / 2**30
    seconds = max(r["seconds"] for r in results)
    print(f"\nSOAK seed={seed}: {results[0]['rounds']} rounds in {seconds:.1f} s, {planned} messages planned, "
          f"{sent} sent, {received} received ({gib:.2f} GiB, {received / seconds:.0f} msg/s), "
          f"{results[0]['collectives']} collectives per rank; "
          f"corrupted {sum(len(r['corrupted']) for r in results)}, "
          f"lost {sum(len(r['lost']) for r in results)}, "
          f"wrong source {sum(len(r['wrong_source']) for r in results)}, "
          f"bad collectives {sum(len(r['collectives_bad']) for r in results)}")
    for rank, r in enumerate(results):
        print(f"SOAK rank {rank}: RSS after init {r['rss_init'] / 2**20:.1f} MiB, after {WARM_ROUNDS} rounds "
              f"{r['rss_warm'] / 2**20:.1f} MiB, at the end {r['rss_end'] / 2**20:.1f} MiB; "
              f"shared memory mapped {r['memory_usage']['total_mapped'] / 2**20:.1f} MiB")
    problems = [p for r in results for p in r["corrupted"] + r["lost"] + r["wrong_source"] + r["collectives_bad"]]
    assert problems == [], f"seed {seed}: " + "; ".join(problems[:20])
    assert sent == received == planned, f"seed {seed}: planned {planned}, sent {sent}, received {received}"
    for rank, r in enumerate(results):
        growth = r["rss_end"] - r["rss_warm"]
        assert growth < 64 << 20, f"rank {rank}: RSS grew by {growth / 2**20:.1f} MiB after warm-up"

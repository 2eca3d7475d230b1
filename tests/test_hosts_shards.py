"""Sharded all_reduce across pretend hosts (hier.HierComm._sharded_all_reduce):
local rank i carries share i between hosts. On 2 hosts x 2 ranks and
2 hosts x 3 ranks, over the gloo and the tcp engine, element counts that
local sizes do not divide:

- the sharded result is bit for bit the leader path's (the same ranks, the
  same call with SHMDIST_SHARD_BYTES=0), for every dtype and op, in one
  piece or in many (SHMDIST_SHARD_PIECE_BYTES);
- with values whose sums are exact, it is the rank-order sum itself
  (what plain gloo or tcp give);
- every local rank carried bytes between hosts (with gloo), not only the
  leader."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

import hosts
import shmdist as dist
from hosts import in_host, master_url

WHY = hosts.unavailable()
HAVE_TORCH = importlib.util.find_spec("torch") is not None
ENGINES = ["tcp", pytest.param("gloo", marks=pytest.mark.skipif(not HAVE_TORCH, reason="gloo needs torch"))]
COUNTS = (4099, 6001, 6000)      # elements: divisible by neither 2 nor 3 ranks per host, then by both
CASES = [(dtype, op) for dtype in ("float32", "float64", "int64", "float16")
         for op in ("SUM", "AVG", "MAX", "PRODUCT") if not (dtype == "int64" and op == "AVG")]


@pytest.fixture
def pretend_hosts(monkeypatch):
    if WHY:
        pytest.skip(WHY)
    for var in ("SHMDIST_HOST_ID", "SHMDIST_TCP_ADDR", "SHMDIST_INTER", "MASTER_ADDR", "MASTER_PORT",
                "SHMDIST_SHARD_BYTES", "SHMDIST_SHARD_PIECE_BYTES"):
        monkeypatch.delenv(var, raising=False)
    with hosts.PretendHosts(2) as h:
        yield h


def _inputs(rank: int, count: int, dtype: str, seed: int, exact: bool) -> np.ndarray:
    rng = np.random.default_rng(seed * 100 + rank)
    if exact or dtype == "int64":
        return rng.integers(-8, 9, count).astype(dtype)
    return rng.standard_normal(count).astype(dtype)


def _shards(rank, world_size, init_method, engine):
    os.environ["SHMDIST_INTER"] = engine
    os.environ["SHMDIST_SHARD_BYTES"] = "4096"
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=120)
    from shmdist.comm import hier, inter
    problems = []
    for seed, (dtype, op) in enumerate(CASES):
        for count in COUNTS:
            label = f"{dtype} {op} {count}"
            red = getattr(dist.ReduceOp, op)
            a = _inputs(rank, count, dtype, seed, exact=False)
            os.environ["SHMDIST_SHARD_BYTES"] = "4096"
            # pieces (hier.py): one piece, or many, the last of them shorter
            os.environ["SHMDIST_SHARD_PIECE_BYTES"] = str(4 << 20 if seed % 2 else 4096)
            sharded = a.copy()
            dist.all_reduce(sharded, op=red)
            os.environ["SHMDIST_SHARD_BYTES"] = "0"
            leader = a.copy()
            dist.all_reduce(leader, op=red)
            if sharded.tobytes() != leader.tobytes():
                problems.append(f"{label}: sharded differs from the leader path at "
                                f"{int(np.flatnonzero(sharded != leader)[0])}")
            if op in ("SUM", "MAX"):            # exact values: the rank-order result itself
                os.environ["SHMDIST_SHARD_BYTES"] = "4096"
                b = _inputs(rank, count, dtype, seed, exact=True)
                dist.all_reduce(b, op=red)
                every = [_inputs(r, count, dtype, seed, exact=True) for r in range(world_size)]
                want = every[0].copy()
                for x in every[1:]:
                    want = want + x if op == "SUM" else np.maximum(want, x)
                if b.tobytes() != want.astype(dtype).tobytes():
                    problems.append(f"{label}: not the rank-order result")
    digest = sharded.tobytes()[:64]
    dist.destroy_process_group()
    return {"problems": problems, "carried": dict(inter.carried), "digest": digest,
            "sharded": hier.sharded["calls"]}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("per_host", [2, 3])
def test_sharded_all_reduce_matches_the_leader_path(run_ranks, pretend_hosts, engine, per_host):
    h = pretend_hosts
    layout = tuple([0] * per_host + [1] * per_host)
    n = len(layout)
    got = run_ranks(in_host, n, h.pids, layout, _shards, engine, timeout=400, init_method=master_url(h))
    problems = [f"rank {r}: {p}" for r, g in enumerate(got) for p in g["problems"]]
    assert problems == []
    assert len({g["digest"] for g in got}) == 1
    assert all(g["sharded"] == len(CASES) * len(COUNTS) + len(COUNTS) * sum(
        op in ("SUM", "MAX") for _, op in CASES) for g in got), [g["sharded"] for g in got]
    if engine == "gloo":        # every local rank carried a share between hosts, not only the leaders
        assert all(g["carried"]["bytes"] > 0 for g in got), [g["carried"] for g in got]

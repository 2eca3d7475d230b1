"""Across hosts: 2 pretend hosts x 2 ranks (tests/hosts.py: own network
namespace, /dev/shm and host name each), every host's link limited to
10 Gbit/s by a token-bucket qdisc on its eth0.

Rows, each the median of per-round medians with the range over rounds;
rounds interleave the configurations, so drift on a shared machine hits
them alike:

- all_reduce of 1 MiB and 16 MiB (``--sizes``: others) float32 through shmdist (shared memory
  inside each host; between hosts on gloo, MPI or our TCP transport; a
  config ``shm/tcp/0`` sets SHMDIST_SHARD_BYTES=0: the leader carries all)
  against plain torch gloo across all 4 ranks;
- one-way latency of an 8-byte message between hosts (rank 0 <-> rank 2,
  half a round trip): shmdist's TCP transport against gloo's send/recv.

Needs root (namespaces), `ip`, `tc` and torch. Run from the repo root:

    python bench/hosts_bench.py [--rounds 3] [--rate 10gbit] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import hosts  # noqa: E402
from ranks import run_ranks  # noqa: E402

SIZES = (1 << 20, 16 << 20)


def _label(n: int) -> str:
    return f"all_reduce {n >> 20} MiB" if n >= 1 << 20 else f"all_reduce {n >> 10} KiB"
LAYOUT = (0, 0, 1, 1)


def _timed(fn, iters: int) -> float:
    fn()
    fn()                         # warm: connections, lazily made engines, arenas
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def one_config(rank, world_size, init_method, config, iters, lat_iters, sizes=SIZES):
    """A run_ranks target inside a pretend host: init, time, return {row: seconds}."""
    import numpy as np
    import torch
    out = {}
    if config == "gloo":
        import torch.distributed as tdist
        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
        tdist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
        for n in sizes:
            t = torch.ones(n // 4, dtype=torch.float32)
            tdist.barrier()
            out[_label(n)] = _timed(lambda: tdist.all_reduce(t), iters)
        msg = torch.zeros(2, dtype=torch.float32)
        tdist.barrier()
        if rank in (0, 2):
            peer = 2 - rank

            def ping():
                if rank == 0:
                    tdist.send(msg, peer)
                    tdist.recv(msg, peer)
                else:
                    tdist.recv(msg, peer)
                    tdist.send(msg, peer)
            out["one-way 8 B"] = _timed(ping, lat_iters) / 2
        tdist.barrier()
        tdist.destroy_process_group()
        return out
    import shmdist as dist
    parts = config.split("/")          # shm/<engine>[/<SHMDIST_SHARD_BYTES>]
    os.environ["SHMDIST_INTER"] = parts[1]
    if len(parts) > 2 and parts[2]:
        os.environ["SHMDIST_SHARD_BYTES"] = parts[2]
    if len(parts) > 3:                  # shm/<engine>/<shard bytes>/<SHMDIST_ARENA_BYTES>
        os.environ["SHMDIST_ARENA_BYTES"] = parts[3]
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=120)
    for n in sizes:
        a = np.ones(n // 4, dtype=np.float32)
        dist.barrier()
        out[_label(n)] = _timed(lambda: dist.all_reduce(a), iters)
    msg = np.zeros(2, dtype=np.float32)
    dist.barrier()
    if rank in (0, 2):
        peer = 2 - rank

        def ping():
            if rank == 0:
                dist.send(msg, peer)
                dist.recv(msg, peer)
            else:
                dist.recv(msg, peer)
                dist.send(msg, peer)
        out["one-way 8 B"] = _timed(ping, lat_iters) / 2
    dist.barrier()
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--lat-iters", type=int, default=300)
    parser.add_argument("--rate", default="10gbit")
    parser.add_argument("--configs", default="shm/gloo,shm/tcp,shm/tcp/0,gloo")
    parser.add_argument("--sizes", default="1M,16M", help="all_reduce sizes, e.g. 64K,1M,4M,16M")
    parser.add_argument("--json")
    args = parser.parse_args()
    why = hosts.unavailable()
    if why:
        sys.exit(why)
    configs = args.configs.split(",")
    units = {"K": 1 << 10, "M": 1 << 20}
    sizes = tuple(int(x[:-1]) * units[x[-1].upper()] if x[-1].upper() in units else int(x)
                  for x in args.sizes.split(","))
    for var in ("SHMDIST_HOST_ID", "SHMDIST_TCP_ADDR", "SHMDIST_INTER", "SHMDIST_SHARD_BYTES",
                "SHMDIST_ARENA_BYTES"):
        os.environ.pop(var, None)
    results: dict = {c: {} for c in configs}
    with hosts.PretendHosts(2) as h:
        if args.rate != "none":
            h.limit(args.rate)
        port = 29600
        for rnd in range(args.rounds):
            order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
            for config in order:
                port += 1
                got = run_ranks(hosts.in_host, 4, h.pids, LAYOUT, one_config, config, args.iters,
                                args.lat_iters, sizes, timeout=600, init_method=f"tcp://{h.addresses[0]}:{port}")
                for row in got[0]:
                    # a collective's time is its slowest rank's; the latency is rank 0's
                    value = got[0][row] if row.startswith("one-way") else max(g[row] for g in got)
                    results[config].setdefault(row, []).append(value)
                print(f"round {rnd} {config}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in got[0].items()),
                      flush=True)
    print(f"\n2 pretend hosts x 2 ranks, link {args.rate}, {args.rounds} interleaved rounds "
          f"(median of rounds, [min-max]); a shared, noisy machine")
    rows = sorted({r for c in configs for r in results[c]})
    for row in rows:
        cells = []
        for c in configs:
            vals = results[c].get(row)
            if vals:
                unit, scale = ("us", 1e6) if row.startswith("one-way") else ("ms", 1e3)
                cells.append(f"{c}: {statistics.median(vals) * scale:.1f} {unit} "
                             f"[{min(vals) * scale:.1f}-{max(vals) * scale:.1f}]")
        print(f"{row:>18}  " + "   ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rate": args.rate, "rounds": args.rounds, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

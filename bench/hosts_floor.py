"""What the pretend-host link and this machine's CPUs allow, for the
cross-host rows of bench/hosts_bench.py: 2 pretend hosts x 2 ranks
(tests/hosts.py), each host's link limited by a token bucket; each local
rank i exchanges N bytes each way with rank i of the other host at once
(the bytes a sharded all_reduce of 2N per host moves per lane), over

- ``raw``: plain blocking TCP sockets (a sender thread, the receiver in
  recv_into): the link's floor, and the CPU the kernel's TCP path costs;
- ``shmdist``: shmdist's isend/irecv between the hosts (its TCP transport);
- ``allreduce``: shmdist's all_reduce of 2N bytes (float32) on the 4 ranks,
  SHMDIST_INTER=tcp, with the CPU time each rank spent per call.

Prints the median over calls of the slowest rank's time and each rank's
CPU time (user + system) per call. Needs root, `ip`, `tc`. Timings only.

    python bench/hosts_floor.py [--rate 10gbit] [--bytes 8M] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import hosts  # noqa: E402
from ranks import run_ranks  # noqa: E402

LAYOUT = (0, 0, 1, 1)
PORT = 31000


def _raw(rank, addresses, nbytes, iters):
    host, lane = LAYOUT[rank], rank % 2
    if host == 0:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((addresses[0], PORT + lane))
        srv.listen(1)
        s, _ = srv.accept()
        srv.close()
    else:
        deadline = time.monotonic() + 30
        while True:
            try:
                s = socket.create_connection((addresses[0], PORT + lane))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out, into = bytearray(nbytes), bytearray(nbytes)

    def once():
        s.sendall(b"x")                      # line the two ends up
        if s.recv(1) != b"x":
            raise RuntimeError("peer out of step")
        sender = threading.Thread(target=s.sendall, args=(out,))
        sender.start()
        view, got = memoryview(into), 0
        while got < nbytes:
            got += s.recv_into(view[got:], nbytes - got)
        sender.join()
    try:
        return _timed(once, iters)
    finally:
        s.close()


def _timed(fn, iters):
    fn()
    fn()
    times, cpu0 = [], time.process_time()
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), (time.process_time() - cpu0) / iters


def target(rank, world_size, init_method, mode, addresses, nbytes, iters):
    if mode == "raw":
        return _raw(rank, addresses, nbytes, iters)
    import numpy as np
    os.environ["SHMDIST_INTER"] = "tcp"
    import shmdist as dist
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=120)
    try:
        if mode == "shmdist":
            a = np.ones(nbytes // 4, np.float32)
            b = np.empty_like(a)
            peer = (rank + 2) % 4

            def once():
                dist.barrier()
                reqs = [dist.isend(a, peer), dist.irecv(b, peer)]
                for r in reqs:
                    r.wait()
        else:
            a = np.ones(2 * nbytes // 4, np.float32)

            def once():
                dist.all_reduce(a)
        got = _timed(once, iters)
        dist.barrier()
        return got
    finally:
        dist.destroy_process_group()


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--rate", default="10gbit")
    parser.add_argument("--bytes", default="8M", help="bytes each way per lane (default 8M)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--modes", default="raw,shmdist,allreduce")
    args = parser.parse_args()
    why = hosts.unavailable()
    if why:
        sys.exit(why)
    for var in ("SHMDIST_HOST_ID", "SHMDIST_TCP_ADDR", "SHMDIST_INTER", "SHMDIST_SHARD_BYTES"):
        os.environ.pop(var, None)
    nbytes = _size(args.bytes)
    modes = args.modes.split(",")
    results: dict = {m: [] for m in modes}
    with hosts.PretendHosts(2) as h:
        if args.rate != "none":
            h.limit(args.rate)
        port = 29650
        for rnd in range(args.rounds):
            for mode in modes[rnd % len(modes):] + modes[:rnd % len(modes)]:
                port += 1
                got = run_ranks(hosts.in_host, 4, h.pids, LAYOUT, target, mode, list(h.addresses), nbytes,
                                args.iters, timeout=300, init_method=f"tcp://{h.addresses[0]}:{port}")
                wall = max(g[0] for g in got)
                results[mode].append(wall)
                print(f"round {rnd} {mode}: {wall * 1e3:.2f} ms, CPU ms per call by rank "
                      + " ".join(f"{g[1] * 1e3:.1f}" for g in got), flush=True)
    print(f"\n2 pretend hosts x 2 ranks, link {args.rate}, {args.bytes} each way per lane "
          f"({args.rounds} interleaved rounds, median [min-max] of the slowest rank's median)")
    for mode in modes:
        v = results[mode]
        print(f"  {mode:>9}: {statistics.median(v) * 1e3:.2f} ms [{min(v) * 1e3:.2f}-{max(v) * 1e3:.2f}]")


if __name__ == "__main__":
    main()

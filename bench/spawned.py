"""Ranks of a benchmark script as spawned processes on one host (bench/idle_cost.py,
bench/broadcast_cpu.py): each runs ``target(rank, world_size, init_method, *args, out)``
and reports through the queue ``out``; every process is joined, or killed, on the way out."""
from __future__ import annotations

import contextlib
import multiprocessing
import socket


@contextlib.contextmanager
def spawned(target, world_size: int, *args, join_s: float = 60.0):
    """Start the ranks; yield the queue they report through."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world_size, init_method, *args, out))
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        yield out
    finally:
        for p in procs:
            p.join(join_s)
            if p.is_alive():
                p.kill()
                p.join()

"""A partner rank for the pytest-benchmark runs (rank 0 is the pytest process).

It waits for commands from rank 0: (op, bytes, rounds, window), and does its
side of ``rounds`` rounds of that operation, until told to exit.
    python bench/partner.py RANK WORLD_SIZE PORT
"""
import sys

import numpy as np

import shmdist as dist

EXIT, ECHO, SINK, ALL_REDUCE, BROADCAST, BARRIER = range(6)


def main(rank: int, world: int, port: int) -> None:
    dist.init_process_group("shm", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=120)
    cmd = np.zeros(4, np.int64)
    ack = np.zeros(8, np.uint8)
    while True:
        dist.recv(cmd, 0).wait()
        op, nbytes, rounds, window = (int(x) for x in cmd)
        if op == EXIT:
            break
        buf = np.zeros(nbytes // 4, np.float32) if op == ALL_REDUCE else np.full(nbytes, 1, np.uint8)
        for _ in range(rounds):
            if op == ECHO:
                dist.recv(buf, 0).wait()
                dist.send(buf, 0).wait()
            elif op == SINK:
                for req in [dist.irecv(buf, 0) for _ in range(window)]:
                    req.wait()
                dist.send(ack, 0).wait()
            elif op == ALL_REDUCE:
                dist.all_reduce(buf)
            elif op == BROADCAST:
                dist.broadcast(buf, 0)
            elif op == BARRIER:
                dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))

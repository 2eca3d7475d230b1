"""Data-parallel training of a linear regression with numpy, one data shard per rank.

    shmdist-run -n 4 examples/allreduce_train.py [--steps 100] [--lr 0.05]

Each rank computes the gradient on its own shard; all_reduce sums the
gradients (and the losses) of every rank, so every rank takes the same step
and ends with the same weights, bit for bit. Rank 0 prints the loss; every
rank prints its final weights and a checksum of their bytes.
"""
import argparse
import hashlib

import numpy as np

import shmdist as dist

SAMPLES_PER_RANK = 256
TRUE_WEIGHTS = np.array([2.0, -3.0, 0.5, 1.0])
TRUE_BIAS = 4.0


def shard(rank):
    """This rank's data: its own samples of y = x . w + b + noise."""
    rng = np.random.default_rng(seed=rank)
    x = rng.normal(size=(SAMPLES_PER_RANK, TRUE_WEIGHTS.size))
    y = x @ TRUE_WEIGHTS + TRUE_BIAS + rng.normal(scale=0.1, size=SAMPLES_PER_RANK)
    return np.hstack([x, np.ones((SAMPLES_PER_RANK, 1))]), y   # a column of ones learns the bias


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    dist.init_process_group(backend="shm")   # env://: rank, world size and port from shmdist-run
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = shard(rank)
    w = np.zeros(x.shape[1])                 # the same start on every rank
    for step in range(1, args.steps + 1):
        error = x @ w - y
        grad = 2.0 * x.T @ error / len(y)
        loss = np.array([np.mean(error ** 2)])
        dist.all_reduce(grad)                # sum over ranks, in place
        dist.all_reduce(loss)
        grad /= world
        loss /= world
        w -= args.lr * grad
        if rank == 0 and (step == 1 or step % 20 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {loss[0]:.6f}", flush=True)

    digest = hashlib.sha1(w.tobytes()).hexdigest()[:16]
    print(f"rank {rank}: final weights {np.array2string(w, precision=4)} checksum {digest}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

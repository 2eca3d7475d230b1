"""Train a small model with DistributedDataParallel over shmdist's "shm" backend.

    torchrun --nproc-per-node 2 examples/ddp_train.py                   # shm
    torchrun --nproc-per-node 2 examples/ddp_train.py --backend gloo    # torch's own, to compare
    shmdist-run -n 2 examples/ddp_train.py

An ordinary torch DDP script: the one line that is about shmdist is
``import shmdist.torch``, which registers the backend "shm" with torch.
Rank 0 prints the loss of each step and a checksum of the final parameters;
with two ranks the checksum is the same for "shm" and "gloo" (a sum of two
numbers does not depend on the order it is taken in).
"""
import argparse
import hashlib

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import shmdist.torch  # noqa: F401  (registers the "shm" backend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--backend", default="shm")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    dist.init_process_group(backend=args.backend)       # env://, as torchrun sets it
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)                                # the same start on every rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=0.004)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    data = torch.Generator().manual_seed(1 + rank)      # each rank its own shard
    for step in range(args.steps):
        x = torch.randn(16, 32, generator=data)
        y = torch.randn(16, 4, generator=data)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}")

    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    if rank == 0:
        print(f"{args.backend} world_size {world_size} parameters {digest.hexdigest()[:16]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

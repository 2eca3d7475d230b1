"""A DDP script for the cross-host test (tests/test_hosts_ddp.py), run by
torchrun on each pretend host with --backend shm or gloo.

Its arithmetic is exact (float64, a linear model, small integer inputs,
weights, batch, world size and learning rate of few bits, three steps: no
value needs more than ~30 of the 53 bits), so every sum of gradients is
the same in any order: the parameters must then match gloo's bit for bit
whatever order each backend adds the ranks' gradients in. (With a real
model in float32, four ranks' gradients summed in another order differ in
their last bits: gloo's ring and shmdist's per-host sums do not agree bit
for bit there, nor do gloo's own algorithms among themselves.) Prints, on rank
0, each step's loss and a digest of the final parameters.
"""
import argparse
import hashlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import shmdist.torch  # noqa: F401  (registers the "shm" backend)

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="shm")
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()
dist.init_process_group(backend=args.backend)
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_default_dtype(torch.float64)
model = torch.nn.Linear(8, 2, bias=False)
with torch.no_grad():
    for i, p in enumerate(model.parameters()):
        p.copy_(torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape).remainder(3).sub(1).div(4))
ddp = DistributedDataParallel(model, bucket_cap_mb=0.0001)
opt = torch.optim.SGD(ddp.parameters(), lr=1 / 16)
data = torch.Generator().manual_seed(1 + rank)
for step in range(args.steps):
    x = torch.randint(-2, 3, (4, 8), generator=data).double()
    y = torch.randint(-2, 3, (4, 2), generator=data).double()
    loss = ((ddp(x) - y) ** 2).sum() / 4
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        print(f"step {step} loss {loss.item().hex()}", flush=True)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
if rank == 0:
    print(f"{args.backend} world_size {world} parameters {digest}", flush=True)
dist.destroy_process_group()

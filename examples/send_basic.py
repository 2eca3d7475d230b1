"""The first example of the send page: rank 0 sends a tensor to rank 1.

    shmdist-run -n 2 examples/send_basic.py            # torch tensors
    shmdist-run -n 2 examples/send_basic.py --numpy    # numpy arrays (or SHMDIST_EXAMPLE_NUMPY=1)

The page's code with only its import changed; the rank comes from RANK,
which shmdist-run sets (the page hard-codes 0), and the port from
MASTER_PORT when set (the page's 23456 otherwise). Rank 1 is the receiving
side the page leaves out.
"""
import os
import sys
from types import SimpleNamespace

import shmdist as dist

if "--numpy" in sys.argv[1:] or os.environ.get("SHMDIST_EXAMPLE_NUMPY") == "1":
    import numpy as np
    torch = SimpleNamespace(tensor=np.array, zeros=np.zeros, int64=np.int64)  # numpy plays torch's part
else:
    import torch

port = os.environ.get("MASTER_PORT", "23456")
dist.init_process_group(backend='gloo', init_method=f'tcp://localhost:{port}', rank=int(os.environ["RANK"]), world_size=2)

if dist.get_rank() == 0:
    t = torch.tensor([1, 2, 3, 4, 5])
    req = dist.send(t, dst=1)
    req.wait()
    print("Tensor sent")
else:
    t = torch.zeros(5, dtype=torch.int64)
    dist.recv(t, src=0).wait()
    print(f"Tensor received: {t}")
dist.destroy_process_group()

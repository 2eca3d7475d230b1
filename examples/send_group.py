"""The third example of the send page: a custom group of ranks 0, 2 and 3,
inside which rank 0 sends a tensor to rank 2.

    shmdist-run -n 4 examples/send_group.py            # torch tensors
    shmdist-run -n 4 examples/send_group.py --numpy    # numpy arrays (or SHMDIST_EXAMPLE_NUMPY=1)

The page's code with only its import changed; the rank comes from RANK,
which shmdist-run sets (the page hard-codes 0), and the port from
MASTER_PORT when set (the page's 23456 otherwise). Every rank calls
new_group, members or not, as torch requires; rank 2 receives.
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
dist.init_process_group(backend='gloo', init_method=f'tcp://localhost:{port}', rank=int(os.environ["RANK"]), world_size=4)

new_group = dist.new_group([0, 2, 3])
if dist.get_rank() == 0:
    t = torch.tensor([100, 200, 300])
    req = dist.send(t, dst=2, group=new_group)
    req.wait()
    print("Tensor sent to rank 2 in custom group")
elif dist.get_rank() == 2:
    t = torch.zeros(3, dtype=torch.int64)
    dist.recv(t, src=0, group=new_group).wait()
    print(f"Rank 2 received tensor in custom group: {t}")
dist.destroy_process_group()

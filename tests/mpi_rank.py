"""One rank under a real MPI launcher (tests/test_hosts_launchers.py):
init_process_group() with no arguments, an all_reduce and a ring of sends;
prints one JSON line."""
import json
import sys

import numpy as np

import shmdist as dist
from shmdist.rendezvous import launchers

launch = launchers.detect()
if "--collectives" in sys.argv:          # pretend hosts of 2 ranks each; the inter-host leg on SHMDIST_INTER
    import os
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_collectives import MOVEMENTS, REDUCTIONS, make_cases, run_cases
    from shmdist.comm import inter
    os.environ["SHMDIST_HOST_ID"] = f"mpi-pretend-host-{launch.rank // 2}"
    cases = make_cases(REDUCTIONS, [1, 1023]) + make_cases(MOVEMENTS, [1, 1023], first_seed=1000)
    result = run_cases(launch.rank, launch.world_size, None, cases)
    with open(os.path.join(sys.argv[sys.argv.index("--collectives") + 1], f"{launch.rank}.json"), "w") as f:
        json.dump({"rank": launch.rank, "chosen": inter.chosen(), "carried": inter.carried,
                   "problems": result["problems"], "digests": result["digests"]}, f)
    sys.exit(0)
if "--mpi4py-master" in sys.argv:        # the path for ranks on several hosts, forced
    launch.master_addr, launch.master_port = "", -1
    ok = launchers.master_by_mpi(launch)
    print(json.dumps({"rank": launch.rank, "master": [launch.master_addr, launch.master_port], "ok": ok}))
    sys.exit(0)
dist.init_process_group()
rank, size = dist.get_rank(), dist.get_world_size()
t = np.full(8, rank + 1, dtype=np.int64)
dist.all_reduce(t)
out = np.empty(1, dtype=np.int64)
reqs = [dist.isend(np.array([rank], dtype=np.int64), (rank + 1) % size), dist.irecv(out, (rank - 1) % size)]
for r in reqs:
    r.wait()
dist.destroy_process_group()
print(json.dumps({"rank": rank, "size": size, "source": launch.source, "local_rank": launch.local_rank,
                  "sum": int(t[0]), "left": int(out[0])}))

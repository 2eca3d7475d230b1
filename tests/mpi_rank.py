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
    if "--pretend-hosts" not in sys.argv:     # else each rank is on a pretend host of its own (tests/hosts.py)
        os.environ["SHMDIST_HOST_ID"] = f"mpi-pretend-host-{launch.rank // 2}"
    cases = make_cases(REDUCTIONS, [1, 1023]) + make_cases(MOVEMENTS, [1, 1023], first_seed=1000)
    result = run_cases(launch.rank, launch.world_size, None, cases)
    with open(os.path.join(sys.argv[sys.argv.index("--collectives") + 1], f"{launch.rank}.json"), "w") as f:
        json.dump({"rank": launch.rank, "chosen": inter.chosen(), "carried": inter.carried,
                   "problems": result["problems"], "digests": result["digests"]}, f)
    sys.exit(0)
if "--until-cut" in sys.argv:            # all_reduce until a host's link goes down; report, wait for the others
    import os
    import time
    folder = sys.argv[sys.argv.index("--until-cut") + 1]
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ.get("DUMP_AFTER", "60")), exit=False)   # where a rank waits, should the job not end
    dist.init_process_group(timeout=20)
    t = np.ones(1 << 18, dtype=np.float32)
    dist.all_reduce(t)
    open(os.path.join(folder, f"ready{launch.rank}"), "w").close()
    start = time.monotonic()
    error = None
    try:
        for i in range(100000):
            dist.all_reduce(t)
            if os.environ.get("COUNT_CALLS"):
                with open(os.path.join(folder, f"count{launch.rank}"), "w") as f:
                    f.write(f"{i} {time.monotonic() - start:.2f}")
            time.sleep(0.01)
    except dist.DistError as e:
        error = f"{type(e).__name__}: {e}"
    from shmdist.comm import inter
    with open(os.path.join(folder, f"{launch.rank}.json"), "w") as f:
        json.dump({"rank": launch.rank, "error": error, "after": time.monotonic() - start,
                   "chosen": inter.chosen()}, f)
    deadline = time.monotonic() + 30          # the others report too before this job ends
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(folder, f"{r}.json")) for r in range(launch.world_size)):
        time.sleep(0.1)
    sys.exit(0)                               # shmdist ends the MPI job (MPI_Abort at exit, inter.py)
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

"""shmdist: torch.distributed-style communication through POSIX shared memory.

    import shmdist as dist
    dist.init_process_group(backend="shm", init_method="tcp://127.0.0.1:23456", rank=r, world_size=2)
    req = dist.send(t, dst=1)
    req.wait()
"""
import sys as _sys

if _sys.argv[:1] == ["-m"]:     # `python -m shmdist.settings` (or another module): runpy imports this first
    import warnings as _warnings
    # the package imports shmdist.settings itself, which runpy would warn about before running it
    _warnings.filterwarnings("ignore", message=r"'shmdist\.[a-z_.]+' found in sys\.modules",
                             category=RuntimeWarning)

from shmdist.errors import (DistError, DistMismatchError, DistNotInitializedError, DistPeerError,
                            DistTimeoutError)
from shmdist.api.group import (P2POp, ProcessGroup, batch_isend_irecv, destroy_process_group, get_backend,
                           get_rank, get_world_size, init_process_group, irecv, is_initialized, isend,
                           memory_usage, new_group, recv, send)
from shmdist.request import DistributedRequest
from shmdist.reduce_ops import ReduceOp
from shmdist.api.collectives import (all_gather, all_gather_into_tensor, all_gather_object, all_reduce,
                                    all_to_all, all_to_all_single, barrier, broadcast,
                                    broadcast_object_list, empty, gather, gather_object, recv_object_list,
                                    reduce, reduce_scatter, reduce_scatter_tensor, scatter,
                                    scatter_object_list, send_object_list)

__version__ = "0.1.0"

__all__ = [
    "DistError", "DistMismatchError", "DistNotInitializedError", "DistPeerError", "DistTimeoutError",
    "DistributedRequest", "P2POp", "ProcessGroup", "batch_isend_irecv", "destroy_process_group",
    "get_backend", "get_rank", "get_world_size", "init_process_group", "irecv", "is_initialized",
    "isend", "memory_usage", "new_group", "recv", "send", "ReduceOp",
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "empty", "gather", "gather_object",
    "recv_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "scatter_object_list", "send_object_list",
]

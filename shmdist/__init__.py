"""shmdist: torch.distributed-style communication through POSIX shared memory.

    import shmdist as dist
    dist.init_process_group(backend="shm", init_method="tcp://127.0.0.1:23456", rank=r, world_size=2)
    req = dist.send(t, dst=1)
    req.wait()
"""
from shmdist.errors import (DistError, DistMismatchError, DistNotInitializedError, DistPeerError,
                            DistTimeoutError)
from shmdist.group import (P2POp, ProcessGroup, batch_isend_irecv, destroy_process_group, get_backend,
                           get_rank, get_world_size, init_process_group, irecv, is_initialized, isend,
                           memory_usage, new_group, recv, send)
from shmdist.request import DistributedRequest

__version__ = "0.1.0"

__all__ = [
    "DistError", "DistMismatchError", "DistNotInitializedError", "DistPeerError", "DistTimeoutError",
    "DistributedRequest", "P2POp", "ProcessGroup", "batch_isend_irecv", "destroy_process_group",
    "get_backend", "get_rank", "get_world_size", "init_process_group", "irecv", "is_initialized",
    "isend", "memory_usage", "new_group", "recv", "send",
]

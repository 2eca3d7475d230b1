"""shmdist as a torch.distributed backend named "shm".

    import torch.distributed as dist
    import shmdist.torch                      # registers the backend "shm"
    dist.init_process_group(backend="shm")    # env://, as torchrun sets it
    model = torch.nn.parallel.DistributedDataParallel(model)

Importing this module registers the backend with torch; every rank imports
it before ``init_process_group``. ``import shmdist`` alone never imports torch.

How torch's process groups map onto shmdist:

- The default group (torch's ``init_process_group``) initialises shmdist's
  world with torch's rendezvous store, so global ranks are torch's ranks.
  Its ``shutdown`` (``dist.destroy_process_group()``) tears the world down.
- ``dist.new_group(ranks)`` calls the backend on the group's members only.
  The members agree on a shmdist group id through the group's store and map
  a collective arena of their own; ranks outside the group do nothing.
- Every torch call runs shmdist's own collective or point-to-point call, so
  argument checks, non-contiguous tensors, float16/bfloat16 and ReduceOp.AVG
  behave as in shmdist. Collectives finish before they return (their Work is
  complete); sends and receives return a Work that ``wait()`` completes.

The default group must use "shm" for "shm" subgroups to exist; the other way
round (default "shm", subgroups of "gloo") works, as any torch backend does.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

import shmdist
from shmdist import collective_api as api
from shmdist import collectives, group as groups, rendezvous
from shmdist.errors import DistError, DistPeerError
from shmdist.reduce_ops import ReduceOp

BACKEND = "shm"
GID_BASE = 1 << 32   # shmdist group ids of torch subgroups; shmdist.new_group counts from 1

_Red = dist.ReduceOp.RedOpType
_OPS = {
    _Red.SUM: ReduceOp.SUM, _Red.AVG: ReduceOp.AVG, _Red.PRODUCT: ReduceOp.PRODUCT,
    _Red.MIN: ReduceOp.MIN, _Red.MAX: ReduceOp.MAX, _Red.BAND: ReduceOp.BAND,
    _Red.BOR: ReduceOp.BOR, _Red.BXOR: ReduceOp.BXOR,
}


class ShmWork(dist.Work):
    """The Work torch callers get. ``request`` is the pending shmdist request
    of a send or receive; collectives are complete when their Work is made."""

    def __init__(self, tensors: list, request=None, group=None):
        super().__init__()
        self._tensors = tensors
        self._request = request
        self._group = group

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        if self._request is not None:
            seconds = timeout.total_seconds()
            self._request.wait(seconds if seconds > 0 else None)
        return True

    def is_completed(self) -> bool:
        return self._request is None or self._request.is_completed()

    def is_success(self) -> bool:
        return self.is_completed() and (self._request is None or self._request.exception() is None)

    def exception(self):
        return None if self._request is None else self._request.exception()

    def result(self) -> list:
        self.wait()
        return self._tensors

    def get_future(self) -> torch.futures.Future:
        """A completed Future of the tensors (a send or receive is waited for first)."""
        fut = torch.futures.Future()
        try:
            self.wait()
        except DistError as e:
            fut.set_exception(e)
            return fut
        fut.set_result(self._tensors)
        return fut

    def _source_rank(self) -> int:
        """The group rank that sent what a receive from any rank got."""
        self.wait()
        return self._group.group_rank(self._request.source)


class ShmProcessGroup(dist.ProcessGroup):
    """A torch ProcessGroup whose calls run on the shmdist group ``group``."""

    def __init__(self, group: shmdist.ProcessGroup, is_default: bool):
        super().__init__(group.rank(), group.size())
        self._group = group
        self._is_default = is_default
        self._name = ""
        self._desc = ""

    # ------------------------------------------------------------ identity

    def getBackendName(self) -> str:
        return BACKEND

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    def _global(self, group_rank: int) -> int:
        return self._group.ranks[group_rank]

    def _op(self, opts, call: str) -> ReduceOp:
        red = opts.reduceOp.op
        if red not in _OPS:
            raise DistError(f"rank {self._group.world.rank}: {call}: ReduceOp.{red.name} is not supported "
                            "by the shm backend; use SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR or BXOR")
        return _OPS[red]

    # ------------------------------------------------------------ collectives

    def allreduce(self, tensors, opts=None):
        op = self._op(opts or dist.AllreduceOptions(), "all_reduce")
        for t in tensors:
            api.all_reduce(t, op, self._group)
        return ShmWork(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        op = self._op(opts or dist.AllreduceCoalescedOptions(), "all_reduce_coalesced")
        for t in tensors:
            api.all_reduce(t, op, self._group)
        return ShmWork(tensors)

    def broadcast(self, tensors, opts=None):
        src = self._global((opts or dist.BroadcastOptions()).rootRank)
        for t in tensors:
            api.broadcast(t, src, self._group)
        return ShmWork(tensors)

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        op = self._op(opts, "reduce")
        for t in tensors:
            api.reduce(t, self._global(opts.rootRank), op, self._group)
        return ShmWork(tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        for outs, t in zip(output_tensors, input_tensors):
            api.all_gather(outs, t, self._group)
        return ShmWork([t for outs in output_tensors for t in outs])

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self.allgather(output_lists, input_list, opts)

    def all_gather_single(self, output, input, opts=None):
        api.all_gather_into_tensor(output, input, self._group)
        return ShmWork([output])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for out, t in zip(outputs, inputs):
            api.all_gather_into_tensor(out, t, self._group)
        return ShmWork(list(outputs))

    def gather(self, output_tensors, input_tensors, opts=None):
        dst = self._global((opts or dist.GatherOptions()).rootRank)
        gather_list = output_tensors[0] if output_tensors else None
        api.gather(input_tensors[0], gather_list, dst, self._group)
        return ShmWork(list(gather_list or []))

    def scatter(self, output_tensors, input_tensors, opts=None):
        src = self._global((opts or dist.ScatterOptions()).rootRank)
        scatter_list = input_tensors[0] if input_tensors else None
        api.scatter(output_tensors[0], scatter_list, src, self._group)
        return ShmWork(output_tensors)

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        op = self._op(opts or dist.ReduceScatterOptions(), "reduce_scatter")
        for out, ins in zip(output_tensors, input_lists):
            api.reduce_scatter(out, ins, op, self._group)
        return ShmWork(output_tensors)

    def reduce_scatter_single(self, output, input, opts=None):
        op = self._op(opts or dist.ReduceScatterOptions(), "reduce_scatter_tensor")
        api.reduce_scatter_tensor(output, input, op, self._group)
        return ShmWork([output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op = self._op(opts or dist.ReduceScatterOptions(), "reduce_scatter_tensor_coalesced")
        for out, t in zip(outputs, inputs):
            api.reduce_scatter_tensor(out, t, op, self._group)
        return ShmWork(list(outputs))

    def alltoall(self, output_tensors, input_tensors, opts=None):
        api.all_to_all(output_tensors, input_tensors, self._group)
        return ShmWork(output_tensors)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        api.all_to_all_single(output, input, output_split_sizes or None, input_split_sizes or None,
                              self._group)
        return ShmWork([output])

    def barrier(self, opts=None):
        api.barrier(self._group)
        return ShmWork([])

    # ------------------------------------------------------------ point to point

    def send(self, tensors, dst: int, tag: int):
        request = shmdist.send(tensors[0], self._global(dst), self._group, tag)
        return ShmWork(tensors, request, self._group)

    def recv(self, tensors, src: int, tag: int):
        request = shmdist.recv(tensors[0], self._global(src), self._group, tag)
        return ShmWork(tensors, request, self._group)

    def recv_anysource(self, tensors, tag: int):
        request = shmdist.recv(tensors[0], None, self._group, tag)
        return ShmWork(tensors, request, self._group)

    # ------------------------------------------------------------ end

    def shutdown(self) -> None:
        """Leave the group; for the default group, leave shmdist's world.

        The default group first passes a barrier: rank 0's process serves
        torch's rendezvous store, and a rank that exits right after this call
        must not take the store away from peers still setting up. A peer that
        already died or left does not stop the shutdown."""
        g = self._group
        if g.destroyed:
            return
        if not self._is_default:
            shmdist.destroy_process_group(g)
            return
        try:
            api.barrier(g)
        except DistPeerError:
            pass     # a peer exited or died: there is no one left to wait for
        finally:
            shmdist.destroy_process_group()

    def abort(self) -> None:
        if not self._group.destroyed:
            shmdist.destroy_process_group(None if self._is_default else self._group)


def _world_group(opts) -> ShmProcessGroup:
    """The default group: shmdist's world, met through torch's store."""
    if shmdist.is_initialized():
        raise DistError(
            f"rank {opts.group_rank}: init_process_group(backend='shm'): shmdist is already "
            "initialized in this process (shmdist.init_process_group was called); use either "
            "shmdist's own API or torch.distributed with backend 'shm', not both")
    shmdist.init_process_group(backend="shm", store=opts.store, rank=opts.group_rank,
                               world_size=opts.group_size, timeout=opts.timeout)
    return ShmProcessGroup(groups.world("init_process_group").default, is_default=True)


def _subgroup(opts) -> ShmProcessGroup:
    """A group of torch's new_group, made by its members only."""
    ranks = tuple(opts.global_ranks_in_group)
    if not shmdist.is_initialized():
        raise DistError(
            f"new_group(ranks={list(ranks)}, backend='shm'): the default process group does not use "
            "the shm backend; call torch.distributed.init_process_group(backend='shm') to make "
            "shm subgroups (gloo subgroups of an shm default group work)")
    w = groups.world("new_group")
    store = rendezvous.PrefixStore("shmdist/", opts.store)
    if opts.group_rank == 0:
        store.set("gid", str(GID_BASE + w.store.add("torch-groups", 1)).encode())
    gid = int(store.get("gid", w.timeout))
    g = groups.ProcessGroup(w, gid, ranks, opts.timeout.total_seconds())
    g.coll = collectives.open_group(w, g)
    return ShmProcessGroup(g, is_default=False)


def _create(opts, backend_options) -> ShmProcessGroup:
    """torch's creator hook: called on the members of every new group."""
    if not opts.global_ranks_in_group:
        return _world_group(opts)
    return _subgroup(opts)


dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])

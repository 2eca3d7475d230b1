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
import threading

import torch
import torch.distributed as dist

import shmdist
from shmdist.api import collectives as api
from shmdist import trace
from shmdist.api import group as groups
from shmdist.rendezvous import store as rendezvous
from shmdist.errors import DistError, DistTimeoutError
from shmdist.reduce_ops import ReduceOp

BACKEND = "shm"

_Red = dist.ReduceOp.RedOpType
_OPS = {
    _Red.SUM: ReduceOp.SUM, _Red.AVG: ReduceOp.AVG, _Red.PRODUCT: ReduceOp.PRODUCT,
    _Red.MIN: ReduceOp.MIN, _Red.MAX: ReduceOp.MAX, _Red.BAND: ReduceOp.BAND,
    _Red.BOR: ReduceOp.BOR, _Red.BXOR: ReduceOp.BXOR,
}
# the same reductions on local tensors (several tensors in one allreduce, as gloo reduces them)
_LOCAL = {
    _Red.SUM: torch.add, _Red.AVG: torch.add, _Red.PRODUCT: torch.mul, _Red.MIN: torch.minimum,
    _Red.MAX: torch.maximum, _Red.BAND: torch.bitwise_and, _Red.BOR: torch.bitwise_or,
    _Red.BXOR: torch.bitwise_xor,
}
_C10D = torch._C._distributed_c10d
_Options = frozenset((_C10D.AllreduceOptions, _C10D.AllreduceCoalescedOptions, _C10D.BroadcastOptions,
            _C10D.ReduceOptions, _C10D.AllgatherOptions, _C10D.GatherOptions, _C10D.ScatterOptions,
            _C10D.ReduceScatterOptions, _C10D.AllToAllOptions, _C10D.BarrierOptions))
_AllreduceOptions = dist.AllreduceOptions
_BarrierOptions = dist.BarrierOptions
_OPS_BY_VALUE = {red.value: op for red, op in _OPS.items()}
_LOCAL = {red.value: fn for red, fn in _LOCAL.items()}
_SUM = _Red.SUM
_AVG = _Red.AVG.value
_Tensor = torch.Tensor
_NO_WAIT = datetime.timedelta(0)
_work_init = dist.Work.__init__


def _timed_out(e: DistTimeoutError) -> DistTimeoutError:
    """The same error, worded as torch's backends word a timeout ("Timed out"),
    which scripts and torch's own tests match."""
    text = str(e)
    if " Timed out " in text:
        return e
    worded = text.replace(" timed out ", " Timed out ", 1)
    if worded == text:
        worded = f"{text} (shm backend: Timed out waiting for the group's timeout)"
    out = DistTimeoutError(worded)
    out.__cause__ = e.__cause__
    return out


def _bad(text: str) -> DistError:
    """This layer's refusal of a collective's own arguments: the method that catches it
    takes part in the call as a refusal (ShmProcessGroup._take_part), as shmdist's own
    checks do (api.collectives._refusing), so the group stays in step."""
    e = DistError(text)
    e.refused_here = True
    return e


def _at_least(timeout):
    """A per-call timeout as shmdist takes it: 0 (torch's "do not wait") as the least wait."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    return 1e-6 if seconds == 0 else timeout


class ShmWork(dist.Work):
    """The Work torch callers get. ``request`` is the pending shmdist request
    of a send or receive; collectives are complete when their Work is made.

    Collectives called through torch.distributed's functions without
    ``async_op`` get no Work at all (torch accepts None from a backend that
    finished the call, and skips its wait): it saves making one per call."""

    def __init__(self, tensors: list, request=None, group=None):
        _work_init(self)              # dist.Work's own: what super() would find, without the look-up
        self._tensors = tensors
        self._request = request
        self._group = group

    def wait(self, timeout: datetime.timedelta = _NO_WAIT) -> bool:
        if self._request is not None:
            seconds = 0 if timeout is _NO_WAIT else timeout.total_seconds()
            try:
                self._request.wait(seconds if seconds > 0 else None)
            except DistTimeoutError as e:
                raise _timed_out(e) from None
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
        """A Future of the tensors, returned at once: completed already for a collective
        or a finished send or receive; for a pending one, completed when it finishes, by
        a thread that waits for it (torch's Future cannot move shmdist's messages itself;
        waiting here instead made two ranks that each asked for the Future of a receive
        before their send wait for each other until the timeout)."""
        fut = torch.futures.Future()
        if self.is_completed():
            self._settle(fut)
        else:
            threading.Thread(target=self._settle, args=(fut,), name="shmdist-future", daemon=True).start()
        return fut

    def _settle(self, fut: torch.futures.Future) -> None:
        try:
            self.wait()
        except Exception as e:    # noqa: BLE001 - the Future carries it
            fut.set_exception(e)
            return
        fut.set_result(self._tensors)

    def _source_rank(self) -> int:
        """The group rank that sent what a receive from any rank got."""
        self.wait()
        return self._group.group_rank(self._request.source)


def _cpu_backend(rank: int, size: int):
    """What ``ProcessGroup._get_backend(torch.device("cpu"))`` returns for an shm group.

    torch keeps a C++ ``Backend`` per device type on each ProcessGroup, and
    some of its code asks for it (FSDP2 asks it whether it allocates tensors,
    ``batch_isend_irecv`` whether it coalesces). A backend written in Python
    can only be a ProcessGroup subclass, as this one is: torch offers no
    Python-subclassable C++ Backend. So the CPU slot holds torch's
    FakeProcessGroup with ``error_on_collective``: it answers those questions
    (no tensor allocator, no splitting, no coalescing) and a collective sent
    to it directly, past the group, raises instead of silently doing nothing.
    Every collective through the group, or through torch.distributed's
    functions, runs on shm."""
    opts = _C10D.FakeProcessGroup.Options()
    opts.error_on_collective = True
    return _C10D.FakeProcessGroup._create_internal(rank, size, opts)


class ShmProcessGroup(dist.ProcessGroup):
    """A torch ProcessGroup whose calls run on the shmdist group ``group``.

    Its methods take every form torch's ProcessGroup methods take (a list of
    tensors and an options object, or the convenience forms: a bare tensor,
    ``root=``, ``op=``), and check their arguments as gloo does: several
    tensors in one call reduce or broadcast together (``opts.rootTensor``
    picks the root's tensor), an empty list, mixed dtypes or sizes, or a root
    outside the group are refused with an error naming the call."""

    def __init__(self, group: shmdist.ProcessGroup, is_default: bool):
        super().__init__(group.rank(), group.size())
        self._group = group
        self._is_default = is_default
        self._g = None if is_default else group     # what shmdist's calls take: None takes the fast paths
        self._me, self._n, self._ranks = group.rank(), group.size(), group.ranks
        self._who = f"rank {group.world.rank}: ProcessGroup"
        self._name = ""
        self._desc = ""
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM,
                               _cpu_backend(self._me, self._n))
        self._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)

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

    # ------------------------------------------------------------ argument checks

    def _global(self, group_rank, call: str, what: str = "root rank") -> int:
        if not isinstance(group_rank, int) or isinstance(group_rank, bool) or not 0 <= group_rank < self._n:
            raise _bad(f"{self._who}.{call}: invalid {what}: {group_rank!r}; the group has ranks "
                            f"0..{self._n - 1} (torch passes group ranks to ProcessGroup methods)")
        return self._group.ranks[group_rank]

    def _take_part(self, e: DistError, kind: str) -> None:
        """After ``e``: if this layer refused the call (_bad), this rank still takes part in it, as
        a refusal: the others raise a mismatch naming it, and every rank's next call lines up."""
        if e.__dict__.pop("refused_here", False):
            api.refuse_call(self._g, kind)

    def _pairs(self, outputs, inputs, call: str) -> None:
        """A coalesced call's lists: one output per input (checked before any call is made)."""
        if len(outputs) != len(inputs):
            raise _bad(f"{self._who}.{call}: {len(outputs)} output tensor(s) for {len(inputs)} input(s); "
                       "give one output per input")

    def _op(self, op, call: str) -> ReduceOp:
        """shmdist's op for a ReduceOp (what options objects hold) or a RedOpType."""
        red = op if op.__class__ is _Red else getattr(op, "op", op)     # RedOpType, or a ReduceOp
        found = _OPS_BY_VALUE.get(getattr(red, "value", None))
        if found is None:
            name = getattr(red, "name", repr(red))
            raise _bad(f"rank {self._group.world.rank}: {call}: ReduceOp.{name} is not supported "
                            "by the shm backend; use SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR or BXOR")
        return found

    def _tensors(self, tensors, call: str, what: str = "tensors") -> list:
        if isinstance(tensors, _Tensor):
            return [tensors]
        if not isinstance(tensors, (list, tuple)) or not tensors:
            got = "an empty list" if isinstance(tensors, (list, tuple)) else type(tensors).__name__
            raise _bad(f"{self._who}.{call}: {what} must be a non-empty list of tensors, got {got}")
        for i, t in enumerate(tensors):
            if not isinstance(t, _Tensor):
                raise _bad(f"{self._who}.{call}: {what}[{i}] is a {type(t).__name__}, not a tensor")
        return tensors

    def _alike(self, tensors, call: str, what: str = "tensors", sizes: bool = True) -> None:
        """gloo's rule for several tensors in one call: one dtype (and one size)."""
        first = tensors[0]
        for i, t in enumerate(tensors[1:], 1):
            if t.dtype != first.dtype or (sizes and t.shape != first.shape):
                raise _bad(
                    f"{self._who}.{call}: invalid tensor {'type' if t.dtype != first.dtype else 'size'} "
                    f"at index {i} of {what}: {str(t.dtype)[6:]}{list(t.shape)}, but {what}[0] is "
                    f"{str(first.dtype)[6:]}{list(first.shape)}; tensors of one call must have one "
                    f"dtype{' and size' if sizes else ''}")

    def _single(self, tensors, call: str, what: str = "tensors") -> _Tensor:
        tensors = self._tensors(tensors, call, what)
        if len(tensors) != 1:
            raise _bad(f"{self._who}.{call}: requires a single-element list of {what}, got "
                            f"{len(tensors)} (as gloo); make one call per tensor")
        return tensors[0]

    @staticmethod
    def _work(opts, tensors):
        """A Work, unless torch.distributed's function called without async_op (it then takes None)."""
        if opts.__class__ in _Options and not opts.asyncOp:
            return None
        return ShmWork(tensors)

    # ------------------------------------------------------------ collectives

    def allreduce(self, tensors, opts=None, op=None, timeout=None):
        try:
            if opts.__class__ is _AllreduceOptions:
                red = opts.reduceOp
                if red == _SUM and tensors.__class__ is list and len(tensors) == 1:   # the common call
                    api.all_reduce(tensors[0], ReduceOp.SUM, self._g)
                    return ShmWork(tensors) if opts.asyncOp else None
            else:
                red = op if opts is None else opts       # allreduce(tensors, op) or (tensor, op=...)
                red = _SUM if red is None else red
            tensors = self._tensors(tensors, "allreduce")
            rop = self._op(red, "all_reduce")
            if len(tensors) == 1:
                api.all_reduce(tensors[0], rop, self._g)
            else:
                self._allreduce_several(tensors, red, rop)
            return self._work(opts, tensors)
        except DistTimeoutError as e:
            raise _timed_out(e) from None
        except DistError as e:
            self._take_part(e, "all_reduce")
            raise

    def _allreduce_several(self, tensors, red, rop) -> None:
        """gloo's allreduce of several tensors: one result over the ranks and the tensors, in each."""
        self._alike(tensors, "allreduce")
        value = (red if red.__class__ is _Red else red.op).value
        acc = tensors[0].clone()
        try:
            for t in tensors[1:]:
                acc = _LOCAL[value](acc, t)
        except (RuntimeError, TypeError) as e:     # (BOR of floats: before any call of shmdist's)
            raise _bad(f"{self._who}.allreduce: {rop.name} of {str(acc.dtype)[6:]} tensors: {e}") from None
        if value == _AVG:            # the mean over ranks and tensors
            acc = acc / len(tensors)
        api.all_reduce(acc, rop, self._g)
        for t in tensors:
            t.copy_(acc)

    def allreduce_coalesced(self, tensors, opts=None):
        """One reduction over the tensors laid end to end, as gloo does: a
        tensor listed twice is reduced once (it gets the same result twice)."""
        try:
            tensors = self._tensors(tensors, "allreduce_coalesced")
            rop = self._op((opts or _C10D.AllreduceCoalescedOptions()).reduceOp, "all_reduce_coalesced")
            self._alike(tensors, "allreduce_coalesced", sizes=False)
            if len(tensors) == 1:
                api.all_reduce(tensors[0], rop, self._g)
            else:
                flat = torch.cat([t.reshape(-1) for t in tensors])
                api.all_reduce(flat, rop, self._g)
                at = 0
                for t in tensors:
                    n = t.numel()
                    t.copy_(flat[at:at + n].view(t.shape))
                    at += n
            return self._work(opts, tensors)
        except DistTimeoutError as e:
            raise _timed_out(e) from None
        except DistError as e:
            self._take_part(e, "all_reduce")
            raise

    def broadcast(self, tensors, opts=None, root=None, timeout=None):
        try:
            if opts is None or isinstance(opts, int):       # broadcast(tensor, root) / (tensor, root=r)
                root_rank, root_tensor = (opts if opts is not None else 0 if root is None else root), 0
            else:
                root_rank, root_tensor = opts.rootRank, opts.rootTensor
            tensors = self._tensors(tensors, "broadcast")
            src = self._global(root_rank, "broadcast")
            if not 0 <= root_tensor < len(tensors):
                raise _bad(f"{self._who}.broadcast: invalid root tensor: {root_tensor}; the call "
                                f"has {len(tensors)} tensor(s)")
            if len(tensors) == 1:
                api.broadcast(tensors[0], src, self._g)
            else:
                self._alike(tensors, "broadcast")
                mine = tensors[root_tensor] if root_rank == self._me else tensors[0]
                api.broadcast(mine, src, self._g)
                for t in tensors:
                    if t is not mine:
                        t.copy_(mine)
            return self._work(opts, tensors)
        except DistTimeoutError as e:
            raise _timed_out(e) from None
        except DistError as e:
            self._take_part(e, "broadcast")
            raise

    def reduce(self, tensors, opts=None, root=None, op=None, timeout=None):
        try:
            if opts is None:                                # reduce(tensor, root=r, op=...)
                root_rank, red = (0 if root is None else root), (_SUM if op is None else op)
            elif isinstance(opts, int):                     # reduce(tensor, r, op)
                root_rank, red = opts, root if root is not None else _SUM if op is None else op
            else:
                root_rank, red = opts.rootRank, opts.reduceOp
            t = self._single(tensors, "reduce")
            rop = self._op(red, "reduce")
            api.reduce(t, self._global(root_rank, "reduce"), rop, self._g)
            return self._work(opts, [t])
        except DistTimeoutError as e:
            raise _timed_out(e) from None
        except DistError as e:
            self._take_part(e, "reduce")
            raise

    def allgather(self, output_tensors, input_tensors, opts=None, timeout=None):
        try:
            if isinstance(input_tensors, _Tensor):          # allgather(output_list, input_tensor)
                output_tensors, input_tensors = [output_tensors], [input_tensors]
            ins = self._tensors(input_tensors, "allgather", "input_tensors")
            k, n = len(ins), self._n
            if not isinstance(output_tensors, (list, tuple)) or len(output_tensors) != k:
                raise _bad(f"{self._who}.allgather: output_tensors must be a list of {k} list(s) "
                                "of tensors, one list per input tensor")
            for i, outs in enumerate(output_tensors):
                if not isinstance(outs, (list, tuple)) or len(outs) != n * k:
                    got = len(outs) if isinstance(outs, (list, tuple)) else type(outs).__name__
                    raise _bad(f"{self._who}.allgather: invalid output tensor list at index {i} "
                                    f"(expected length {n * k}, got {got})")
            if k == 1:
                api.all_gather(output_tensors[0], ins[0], self._g)
            else:                   # gloo: output j*k + i is input i of group rank j, in every list
                self._alike(ins, "allgather", "input_tensors")
                first = output_tensors[0]
                for i, t in enumerate(ins):
                    api.all_gather([first[j * k + i] for j in range(n)], t, self._g)
                for outs in output_tensors[1:]:
                    for o, f in zip(outs, first):
                        o.copy_(f)
            return self._work(opts, [t for outs in output_tensors for t in outs])
        except DistTimeoutError as e:
            raise _timed_out(e) from None
        except DistError as e:
            self._take_part(e, "all_gather")
            raise

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """torch's layout: ``output_lists[r][i]`` gets ``input_list[i]`` of group rank r."""
        try:
            ins = self._tensors(input_list, "allgather_coalesced", "input_list")
            n = self._n
            if not isinstance(output_lists, (list, tuple)) or len(output_lists) != n or any(
                    not isinstance(outs, (list, tuple)) or len(outs) != len(ins) for outs in output_lists):
                raise _bad(f"{self._who}.allgather_coalesced: output_lists must be {n} lists (one "
                                f"per rank of the group) of {len(ins)} tensors (one per input), "
                                "output_lists[rank][i] receiving input i of that rank")
            for i, t in enumerate(ins):
                api.all_gather([output_lists[j][i] for j in range(n)], t, self._g)
            return self._work(opts, [t for outs in output_lists for t in outs])
        except DistTimeoutError as e:
            raise _timed_out(e) from None
        except DistError as e:
            self._take_part(e, "all_gather")
            raise

    def all_gather_single(self, output, input, opts=None):
        try:
            api.all_gather_into_tensor(output, input, self._g)
            return self._work(opts, [output])
        except DistTimeoutError as e:
            raise _timed_out(e) from None

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        try:
            self._pairs(outputs, inputs, "allgather_into_tensor_coalesced")
            for out, t in zip(outputs, inputs):
                api.all_gather_into_tensor(out, t, self._g)
            return self._work(opts, list(outputs))
        except DistTimeoutError as e:
            raise _timed_out(e) from None
        except DistError as e:
            self._take_part(e, "all_gather")
            raise

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors, input_tensors, opts=None, root=None, timeout=None):
        try:
            if isinstance(input_tensors, _Tensor):          # gather(output_list, input_tensor, root)
                root_rank = opts if opts is not None else root
                output_tensors = [output_tensors] if output_tensors else []
                input_tensors = [input_tensors]
            else:
                root_rank = (opts or _C10D.GatherOptions()).rootRank
            t = self._single(input_tensors, "gather", "input_tensors")
            dst = self._global(root_rank, "gather")
            if root_rank == self._me:
                if not isinstance(output_tensors, (list, tuple)) or len(output_tensors) != 1:
                    raise _bad(f"{self._who}.gather: the root requires a single-element list of "
                                    "output lists (one tensor per rank of the group in it)")
                gather_list = output_tensors[0]
            else:
                if output_tensors:
                    raise _bad(f"{self._who}.gather: requires empty output on non-root ranks "
                                    f"(this is group rank {self._me}, the root is {root_rank})")
                gather_list = None
            api.gather(t, gather_list, dst, self._g)
            return self._work(opts, list(gather_list or []))
        except DistTimeoutError as e:
            raise _timed_out(e) from None
        except DistError as e:
            self._take_part(e, "gather")
            raise

    def scatter(self, output_tensors, input_tensors, opts=None, root=None, timeout=None):
        try:
            if isinstance(output_tensors, _Tensor):         # scatter(output_tensor, input_list, root)
                root_rank = opts if opts is not None else root
                output_tensors = [output_tensors]
                input_tensors = [input_tensors] if input_tensors else []
            else:
                root_rank = (opts or _C10D.ScatterOptions()).rootRank
            out = self._single(output_tensors, "scatter", "output_tensors")
            src = self._global(root_rank, "scatter")
            if root_rank == self._me:
                if not isinstance(input_tensors, (list, tuple)) or len(input_tensors) != 1:
                    raise _bad(f"{self._who}.scatter: the root requires a single-element list of "
                                    "input lists (one tensor per rank of the group in it)")
                scatter_list = input_tensors[0]
            else:
                if input_tensors:
                    raise _bad(f"{self._who}.scatter: requires empty input on non-root ranks "
                                    f"(this is group rank {self._me}, the root is {root_rank})")
                scatter_list = None
            api.scatter(out, scatter_list, src, self._g)
            return self._work(opts, [out])
        except DistTimeoutError as e:
            raise _timed_out(e) from None
        except DistError as e:
            self._take_part(e, "scatter")
            raise

    def reduce_scatter(self, output_tensors, input_lists, opts=None, op=None, timeout=None):
        try:
            if isinstance(output_tensors, _Tensor):         # reduce_scatter(output, input_list, op)
                red = opts if opts is not None else _SUM if op is None else op
                output_tensors, input_lists, opts = [output_tensors], [input_lists], None
            else:
                red = (opts or _C10D.ReduceScatterOptions()).reduceOp
            out = self._single(output_tensors, "reduce_scatter", "output_tensors")
            if not isinstance(input_lists, (list, tuple)) or len(input_lists) != 1:
                raise _bad(f"{self._who}.reduce_scatter: requires a single-element list of input "
                                "lists (one tensor per rank of the group in it)")
            api.reduce_scatter(out, input_lists[0], self._op(red, "reduce_scatter"), self._g)
            return self._work(opts, [out])
        except DistTimeoutError as e:
            raise _timed_out(e) from None
        except DistError as e:
            self._take_part(e, "reduce_scatter")
            raise

    def reduce_scatter_single(self, output, input, opts=None):
        try:
            op = self._op((opts or _C10D.ReduceScatterOptions()).reduceOp, "reduce_scatter_tensor")
            api.reduce_scatter_tensor(output, input, op, self._g)
            return self._work(opts, [output])
        except DistTimeoutError as e:
            raise _timed_out(e) from None
        except DistError as e:
            self._take_part(e, "reduce_scatter")
            raise

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        try:
            op = self._op((opts or _C10D.ReduceScatterOptions()).reduceOp, "reduce_scatter_tensor_coalesced")
            self._pairs(outputs, inputs, "reduce_scatter_tensor_coalesced")
            for out, t in zip(outputs, inputs):
                api.reduce_scatter_tensor(out, t, op, self._g)
            return self._work(opts, list(outputs))
        except DistTimeoutError as e:
            raise _timed_out(e) from None
        except DistError as e:
            self._take_part(e, "reduce_scatter")
            raise

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, output_tensors, input_tensors, opts=None):
        try:
            api.all_to_all(output_tensors, input_tensors, self._g)
            return self._work(opts, output_tensors)
        except DistTimeoutError as e:
            raise _timed_out(e) from None

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None,
                          timeout=None):
        try:
            api.all_to_all_single(output, input, output_split_sizes or None, input_split_sizes or None,
                                  self._g)
            return self._work(opts, [output])
        except DistTimeoutError as e:
            raise _timed_out(e) from None

    alltoall_base = all_to_all_single

    def barrier(self, opts=None, timeout=None):
        """``dist.barrier(timeout=...)`` puts its timeout in ``opts.timeout``
        (unset: negative); that call then waits that long, not the group's timeout."""
        try:
            if opts.__class__ is _BarrierOptions:
                limit = opts.timeout                    # unset: negative
                limit = timeout if limit < _NO_WAIT else _at_least(limit)
            else:
                limit = _at_least(timeout)
            api.barrier(self._g, timeout=limit)
            return self._work(opts, [])
        except DistTimeoutError as e:
            raise _timed_out(e) from None

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False) -> None:
        """A barrier that waits ``timeout`` (a timedelta or seconds; 0: no
        wait; the group's timeout when None); one that times out says so as
        gloo's does ("Rank R timed out in monitoredBarrier") and names every
        rank it waited for, whatever ``wait_all_ranks`` says.
        (torch.distributed.monitored_barrier itself accepts gloo groups only;
        this is the method on the group.)"""
        try:
            self.barrier(timeout=timeout)
        except DistTimeoutError as e:
            raise DistTimeoutError(f"Rank {self._me} timed out in monitoredBarrier: {e}") from None

    # ------------------------------------------------------------ point to point

    def _peer(self, peer, call: str, what: str) -> int | None:
        """The global rank for shmdist's call (None where the fast path may take it)."""
        if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < self._n:
            raise DistError(f"{self._who}.{call}: invalid {what}: {peer!r}; the group has ranks "
                            f"0..{self._n - 1} (torch passes group ranks to ProcessGroup methods)")
        return self._group.ranks[peer]

    def send(self, tensors, dst: int, tag: int):
        try:
            t = tensors[0] if tensors.__class__ is list and len(tensors) == 1 else self._single(tensors, "send")
            peer = self._ranks[dst] if dst.__class__ is int and 0 <= dst < self._n else \
                self._peer(dst, "send", "destination rank")
            request = shmdist.send(t, peer, self._g, tag)
            return ShmWork(tensors, request, self._group)
        except DistTimeoutError as e:
            raise _timed_out(e) from None

    def recv(self, tensors, src: int, tag: int):
        try:
            t = tensors[0] if tensors.__class__ is list and len(tensors) == 1 else self._single(tensors, "recv")
            peer = self._ranks[src] if src.__class__ is int and 0 <= src < self._n else \
                self._peer(src, "recv", "source rank")
            request = shmdist.recv(t, peer, self._g, tag)
            return ShmWork(tensors, request, self._group)
        except DistTimeoutError as e:
            raise _timed_out(e) from None

    def recv_anysource(self, tensors, tag: int):
        try:
            request = shmdist.recv(self._single(tensors, "recv_anysource"), None, self._group, tag)
            return ShmWork(tensors, request, self._group)
        except DistTimeoutError as e:
            raise _timed_out(e) from None

    # ------------------------------------------------------------ end

    def shutdown(self) -> None:
        """Leave the group; for the default group, leave shmdist's world.

        The default group first passes a barrier: rank 0's process serves
        torch's rendezvous store, and a rank that exits right after this call
        must not take the store away from peers still setting up. A peer that
        already died or left, or a timeout that left the group unusable,
        does not stop the shutdown."""
        g = self._group
        if g.destroyed:
            return
        if not self._is_default:
            shmdist.destroy_process_group(g)
            return
        try:
            api.barrier(g)
        except DistError:
            pass     # a peer exited or died, or a timeout broke the group: leave all the same
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
    """A group of torch's new_group, made by its members only.

    It is made as shmdist.new_group makes its groups (the engine for the
    members' hosts: a shared arena, or the hierarchical one across hosts) and
    registered in the world, so that leaving the world closes it and
    ``memory_usage`` counts its arena."""
    ranks = tuple(opts.global_ranks_in_group)
    if not shmdist.is_initialized():
        raise DistError(
            f"new_group(ranks={list(ranks)}, backend='shm'): the default process group does not use "
            "the shm backend; call torch.distributed.init_process_group(backend='shm') to make "
            "shm subgroups (gloo subgroups of an shm default group work)")
    w = groups.world("new_group")
    gid = w.allocate_gid(rendezvous.PrefixStore("shmdist/", opts.store), opts.group_rank == 0)
    g = groups.open_group(w, gid, ranks, opts.timeout.total_seconds())
    return ShmProcessGroup(g, is_default=False)


def _create(opts, backend_options) -> ShmProcessGroup:
    """torch's creator hook: called on the members of every new group."""
    if not opts.global_ranks_in_group:
        return _world_group(opts)
    return _subgroup(opts)


dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])

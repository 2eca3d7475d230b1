"""An outside tester's attempts to break README's "Using shmdist from
torch.distributed" and "Where shmdist differs from torch.distributed, on
purpose": torch.distributed with backend "shm" against backend "gloo" run the
same way in the same processes (a gloo group of the same ranks), bit for bit.

Where gloo itself is wrong (in-place all_to_all_single, a scatter into the
root's own list, an expanded root tensor, bool sums that store 2 in a bool) or
refuses (non-contiguous tensors, uint16..uint64, float8, uneven all_to_all
lists), the reference is gloo on separate contiguous buffers, or the value
README promises. Every test runs real processes under a time limit. Skips
without torch.

The tests that fail on the current code document faults; see the report of
the session that wrote this file (and each test's docstring)."""
from __future__ import annotations

import datetime
import os
import time

import pytest

torch = pytest.importorskip("torch")

from ranks import free_port  # noqa: E402


def _init(rank, world_size, init_method, seconds=None):
    """The default group on "shm" and a gloo group of the same ranks (the reference)."""
    import shmdist.torch  # noqa: F401  (registers the backend)
    import torch.distributed as d
    kw = {} if seconds is None else {"timeout": datetime.timedelta(seconds=seconds)}
    d.init_process_group("shm", init_method=init_method, rank=rank, world_size=world_size, **kw)
    return d, d.new_group(backend="gloo")


def _bytes(t):
    """dtype, shape and bytes of a tensor (or of each in a list), for exact comparisons."""
    if isinstance(t, (list, tuple)):
        return [_bytes(x) for x in t]
    if t is None:
        return None
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    raw = bytes(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
    return str(t.dtype), tuple(t.shape), raw


def _call(f, *args):
    try:
        return "ok", f(*args)
    except Exception as e:  # noqa: BLE001 - compared as text
        return "error", f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------- every dtype and op, against gloo

SWEEP_DTYPES = ("bool", "int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64")


def _sweep_data(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == "bool":
        return torch.randint(0, 2, (n,), generator=g).bool()
    x = torch.randint(-60, 61, (n,), generator=g)
    x[x == 0] = 3                                  # no zeros: MIN/MAX of 0.0 and -0.0 is order-dependent in gloo
    if dtype.startswith(("float", "bfloat")):
        return (x.double() * 0.37).to(getattr(torch, dtype))
    return x.to(getattr(torch, dtype))


def sweep_against_gloo(rank, world_size, init_method):
    """all_reduce, reduce and reduce_scatter_tensor of every dtype with every op
    gloo takes, small (the one-call paths) and above 256 KiB (the medium and
    general paths), 2 ranks (so the order of a sum cannot matter)."""
    d, gloo = _init(rank, world_size, init_method)
    R = d.ReduceOp
    bad = []
    for dtype in SWEEP_DTYPES:
        ops = ["SUM", "PRODUCT", "MIN", "MAX"]
        if dtype in ("bool", "int8", "uint8", "int32", "int64"):
            ops += ["BAND", "BOR", "BXOR"]
        for n in (7, 100003):
            for op in ops:
                x = _sweep_data(dtype, n, 17 * rank + n)
                a, b = x.clone(), x.clone()
                d.all_reduce(a, op=getattr(R, op))
                d.all_reduce(b, op=getattr(R, op), group=gloo)
                if dtype == "bool":
                    # gloo's bool SUM stores 2 in a bool byte: compare truth values, and shm's bytes are 0/1
                    if a.view(torch.uint8).max().item() > 1 or not torch.equal(a, b.view(torch.uint8) != 0):
                        bad.append(("all_reduce", dtype, n, op))
                elif _bytes(a) != _bytes(b):
                    bad.append(("all_reduce", dtype, n, op))
            if dtype != "bool":
                x = _sweep_data(dtype, 2 * n, 5 + rank)
                a, b = torch.zeros(n, dtype=x.dtype), torch.zeros(n, dtype=x.dtype)
                d.reduce_scatter_tensor(a, x.clone(), op=R.MAX)
                d.reduce_scatter_tensor(b, x.clone(), op=R.MAX, group=gloo)
                if _bytes(a) != _bytes(b):
                    bad.append(("reduce_scatter_tensor MAX", dtype, n))
                a, b = x.clone(), x.clone()
                d.reduce(a, dst=1, op=R.MIN)
                d.reduce(b, dst=1, op=R.MIN, group=gloo)
                if rank == 1 and _bytes(a) != _bytes(b):
                    bad.append(("reduce MIN", dtype, n))
        if dtype.startswith(("float", "bfloat")):
            x = _sweep_data(dtype, 9, rank) * 2
            a, ref = x.clone(), x.clone()
            d.all_reduce(a, op=R.AVG)
            d.all_reduce(ref, group=gloo)                # gloo has no AVG: its SUM / 2, exact for 2 ranks
            if _bytes(a) != _bytes(ref / 2):
                bad.append(("all_reduce AVG", dtype))
    c = torch.tensor([1 + 2j, -3.5 + 0.25j], dtype=torch.complex64) * (rank + 1)
    a, b = c.clone(), c.clone()
    d.all_reduce(a)
    d.all_reduce(b, group=gloo)
    if _bytes(a) != _bytes(b):
        bad.append(("all_reduce complex64",))
    for dtype in ("uint16", "uint32", "uint64"):      # gloo: "Invalid scalar type"; the values are plain
        t = torch.full((5,), rank + 2, dtype=getattr(torch, dtype))
        d.all_reduce(t, op=R.PRODUCT)
        if t.tolist() != [6] * 5:
            bad.append(("all_reduce PRODUCT", dtype, t.tolist()))
    d.destroy_process_group()
    return bad


def test_every_dtype_and_op_matches_gloo_bit_for_bit(run_ranks):
    assert run_ranks(sweep_against_gloo, 2, timeout=150) == [[], []]


# ---------------------------------------------------------------- outputs that alias inputs

def aliasing_against_separate_buffers(rank, world_size, init_method, k):
    """README: "Inputs and outputs of one collective may share memory, and the
    result is what separate buffers give". The reference is gloo on separate
    buffers (gloo itself gets several of these in-place calls wrong)."""
    d, gloo = _init(rank, world_size, init_method)
    me, n = rank, world_size
    bad = []

    def base(m, dtype):
        return ((torch.arange(m, dtype=torch.float64) * 7 + 1000 * me) % 251).to(dtype)

    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        t = base(n * k, dtype)
        ref = torch.empty_like(t)
        d.all_gather_into_tensor(ref, t[me * k:(me + 1) * k].clone(), group=gloo)
        d.all_gather_into_tensor(t, t[me * k:(me + 1) * k])
        bad += [] if torch.equal(t, ref) else [("all_gather_into_tensor in place", dtype)]

        t = base(n * k, dtype)
        ref = torch.empty_like(t)
        d.all_gather_into_tensor(ref, t[k // 2:k // 2 + k].clone(), group=gloo)
        d.all_gather_into_tensor(t, t[k // 2:k // 2 + k])
        bad += [] if torch.equal(t, ref) else [("all_gather_into_tensor, input across two slots", dtype)]

        t = base(n * k, dtype)
        ref = torch.empty(k, dtype=dtype)
        d.reduce_scatter_tensor(ref, t.clone(), op=d.ReduceOp.MAX, group=gloo)
        d.reduce_scatter_tensor(t[me * k:(me + 1) * k], t, op=d.ReduceOp.MAX)
        bad += [] if torch.equal(t[me * k:(me + 1) * k], ref) else [("reduce_scatter_tensor in place", dtype)]

        t = base(n * k, dtype)
        ref = torch.empty(k, dtype=dtype)
        d.reduce_scatter_tensor(ref, t.clone(), op=d.ReduceOp.MIN, group=gloo)
        d.reduce_scatter_tensor(t[k // 3:k // 3 + k], t, op=d.ReduceOp.MIN)
        bad += [] if torch.equal(t[k // 3:k // 3 + k], ref) else [("reduce_scatter_tensor, output across chunks", dtype)]

        t = base(n * k, dtype)
        ref = torch.empty_like(t)
        d.all_to_all_single(ref, t.clone(), group=gloo)
        d.all_to_all_single(t, t)
        bad += [] if torch.equal(t, ref) else [("all_to_all_single in place, even", dtype)]

        sizes = [[k, 2, k // 2], [2, k - 3, 7], [k // 2, 7, 5]]     # symmetric: every rank's in == out
        ins, outs = sizes[me][:n], [sizes[j][me] for j in range(n)]
        t = base(sum(ins), dtype)
        ref = torch.empty(sum(outs), dtype=dtype)
        d.all_to_all_single(ref, t.clone(), outs, ins, group=gloo)
        d.all_to_all_single(t, t, outs, ins)
        bad += [] if torch.equal(t, ref) else [("all_to_all_single in place, uneven", dtype)]

        t = base(n * k + 3, dtype)
        ref = torch.empty(n * k, dtype=dtype)
        d.all_to_all_single(ref, t[:-3].clone(), group=gloo)
        d.all_to_all_single(t[3:], t[:-3])
        bad += [] if torch.equal(t[3:], ref) else [("all_to_all_single, output shifted over input", dtype)]

    pieces = [torch.full((3,), float(j + 7)) for j in range(n)]
    out = pieces[1] if me == 0 else torch.zeros(3)                  # the root scatters into its own list
    d.scatter(out, pieces if me == 0 else None, src=0)
    if out.tolist() != [float(me + 7)] * 3:
        bad.append(("scatter into an item of the root's own list", out.tolist()))
    ts = [torch.full((2,), float(10 * me + j)) for j in range(n)]
    d.all_to_all(ts, ts)                                            # one list as input and output
    if [t.tolist() for t in ts] != [[float(10 * j + me)] * 2 for j in range(n)]:
        bad.append(("all_to_all in place", [t.tolist() for t in ts]))
    t = torch.full((2,), float(me + 1))
    outs = [torch.zeros(2) for _ in range(n)]
    outs[(me + 1) % n] = t                                          # the input is another rank's slot
    d.all_gather(outs, t)
    if [o.tolist() for o in outs] != [[float(j + 1)] * 2 for j in range(n)]:
        bad.append(("all_gather, input in another rank's slot", [o.tolist() for o in outs]))
    d.destroy_process_group()
    return bad


@pytest.mark.parametrize("world_size,k", [(2, 5), (3, 5), (3, 70000)], ids=["2-small", "3-small", "3-big"])
def test_aliased_outputs_give_what_separate_buffers_give(run_ranks, world_size, k):
    assert run_ranks(aliasing_against_separate_buffers, world_size, k, timeout=120) == [[]] * world_size


# ---------------------------------------------------------------- shapes and layouts

def layouts_against_gloo(rank, world_size, init_method):
    """0-d, empty, transposed, channels_last, odd strides of size-1 dims, a
    storage offset, a stride-0 root: shm on the tensor as it is, gloo on a
    contiguous copy (gloo refuses non-contiguous tensors, and reads past an
    expanded one)."""
    d, gloo = _init(rank, world_size, init_method)
    me, n = rank, world_size
    bad = []

    def check(name, shm_fn, gloo_fn):
        a, b = _call(shm_fn), _call(gloo_fn)
        if a[0] != "ok" or b[0] != "ok" or _bytes(a[1]) != _bytes(b[1]):
            bad.append((name, str(a)[:300], str(b)[:300]))

    def ar(t, g=None):
        d.all_reduce(t, group=g)
        return t

    check("0-d all_reduce", lambda: ar(torch.tensor(float(me + 1))), lambda: ar(torch.tensor(float(me + 1)), gloo))
    check("0-d broadcast", lambda: _bc(d, torch.tensor(me + 3), 1, None), lambda: _bc(d, torch.tensor(me + 3), 1, gloo))
    check("0-d all_gather", lambda: _ag(d, torch.tensor(float(me)), n, None), lambda: _ag(d, torch.tensor(float(me)), n, gloo))
    check("empty all_reduce", lambda: ar(torch.zeros(0, 3)), lambda: ar(torch.zeros(0, 3), gloo))
    check("empty all_gather", lambda: _ag(d, torch.zeros(0), n, None), lambda: _ag(d, torch.zeros(0), n, gloo))

    def a2a0(g):
        out = torch.ones(0, 2)
        d.all_to_all_single(out, torch.zeros(0, 2), [0] * n, [0] * n, group=g)
        return out
    check("empty all_to_all_single with splits", lambda: a2a0(None), lambda: a2a0(gloo))

    def rst0(g):
        out = torch.ones(0)
        d.reduce_scatter_tensor(out, torch.zeros(0), group=g)
        return out
    check("empty reduce_scatter_tensor", lambda: rst0(None), lambda: rst0(gloo))

    def transposed():
        return (torch.arange(12.).reshape(3, 4) * (me + 1)).t()
    check("transposed all_reduce", lambda: ar(transposed()), lambda: ar(transposed().contiguous(), gloo))

    def cl():
        return (torch.arange(24.).reshape(1, 2, 3, 4) * (me + 1)).to(memory_format=torch.channels_last)
    check("channels_last all_reduce", lambda: ar(cl()), lambda: ar(cl().contiguous(), gloo))

    def odd():
        t = torch.empty_strided((3, 1), (1, 7))
        t.copy_(torch.arange(3.).reshape(3, 1) * (me + 1))
        return t
    check("size-1 dim with an odd stride", lambda: ar(odd()), lambda: ar(odd().contiguous(), gloo))

    def offset(g):
        base = torch.arange(10.) * (me + 1)
        d.all_reduce(base[3:7], group=g)
        return base
    check("storage offset", lambda: offset(None), lambda: offset(gloo))

    def expanded(g):
        t = torch.tensor([5.0 + me]).expand(4)
        return _bc(d, t if me == 0 else t.clone(), 0, g)
    want = torch.full((4,), 5.0)
    got = _call(expanded, None)
    if got[0] != "ok" or not torch.equal(got[1], want):
        bad.append(("broadcast from a stride-0 root", str(got)))

    def strided_a2a(contig):
        src = (torch.arange(n * 2 * 3.).reshape(3, n * 2) + 100 * me).t()      # (2n, 3), not contiguous
        out = torch.zeros(3, n * 2).t()
        if contig:
            src, out = src.contiguous(), out.contiguous()
        d.all_to_all_single(out, src, group=gloo if contig else None)
        return out
    check("non-contiguous all_to_all_single", lambda: strided_a2a(False), lambda: strided_a2a(True))

    def strided_rst(contig):
        src = (torch.arange(2 * n * 2.).reshape(2, 2 * n) + me).t()
        out = torch.zeros(2, 2).t()
        if contig:
            src, out = src.contiguous(), out.contiguous()
        d.reduce_scatter_tensor(out, src, group=gloo if contig else None)
        return out
    check("non-contiguous reduce_scatter_tensor", lambda: strided_rst(False), lambda: strided_rst(True))

    def stacked(g):
        out = torch.zeros(n, 3)
        d.all_gather_into_tensor(out, torch.full((3,), float(me)), group=g)
        return out
    got = _call(stacked, None)
    if got[0] != "ok" or got[1].tolist() != [[float(j)] * 3 for j in range(n)]:
        bad.append(("all_gather_into_tensor into (n, k)", str(got)))

    def neg_root(g):
        base = torch.arange(3.) + me
        t = torch._neg_view(base)
        d.broadcast(t, src=1, group=g)
        return t
    got = _call(neg_root, None)
    if got[0] != "ok" or got[1].tolist() != [-1.0, -2.0, -3.0]:
        bad.append(("broadcast of a negative view", str(got)))
    d.destroy_process_group()
    return bad


def _bc(d, t, src, g):
    d.broadcast(t, src=src, group=g)
    return t


def _ag(d, t, n, g):
    outs = [torch.ones_like(t) for _ in range(n)]
    d.all_gather(outs, t, group=g)
    return outs


@pytest.mark.parametrize("world_size", [2, 3])
def test_shapes_and_layouts_match_gloo(run_ranks, world_size):
    assert run_ranks(layouts_against_gloo, world_size, timeout=120) == [[]] * world_size


# ---------------------------------------------------------------- async handles

def async_handles(rank, world_size, init_method):
    """Every collective with async_op=True: wait, is_completed, the Future's
    value and a chained callback, torch.futures.wait_all; compared with gloo."""
    d, gloo = _init(rank, world_size, init_method)
    me, n = rank, world_size
    res = {}
    for name, g in (("shm", None), ("gloo", gloo)):
        r = {}
        t = torch.full((3,), float(me + 1))
        w = d.all_reduce(t, group=g, async_op=True)
        r["all_reduce"] = (w.wait(), w.is_completed(), _bytes(w.get_future().wait()), _bytes(t))
        r["then"] = _bytes(w.get_future().then(lambda f: f.value()[0] * 2).wait())
        outs = [torch.zeros(2) for _ in range(n)]
        w = d.all_gather(outs, torch.full((2,), float(me)), group=g, async_op=True)
        w.wait()
        r["all_gather"] = (_bytes(outs), _bytes(w.get_future().wait()))
        t = torch.full((2,), float(me))
        w = d.broadcast(t, src=1, group=g, async_op=True)
        w.wait()
        r["broadcast"] = _bytes(w.get_future().wait())
        w = d.barrier(group=g, async_op=True)
        w.wait()
        r["barrier"] = w.is_completed()
        o = torch.zeros(n)
        w = d.all_to_all_single(o, torch.arange(float(n)) + 10 * me, group=g, async_op=True)
        w.wait()
        r["all_to_all_single"] = _bytes(w.get_future().wait())
        o = torch.zeros(1)
        w = d.scatter(o, [torch.tensor([float(j)]) for j in range(n)] if me == 0 else None, src=0, group=g,
                      async_op=True)
        w.wait()
        r["scatter"] = _bytes(w.get_future().wait())
        go = [torch.zeros(1) for _ in range(n)] if me == 0 else None
        w = d.gather(torch.tensor([float(me)]), go, dst=0, group=g, async_op=True)
        w.wait()
        r["gather"] = (_bytes(w.get_future().wait()), _bytes(go))
        ts = [torch.full((2,), float(me + k)) for k in range(3)]
        torch.futures.wait_all([d.all_reduce(x, group=g, async_op=True).get_future() for x in ts])
        r["wait_all"] = _bytes(ts)
        res[name] = r
    d.destroy_process_group()
    return [k for k in res["shm"] if res["shm"][k] != res["gloo"][k]]


def test_async_handles_match_gloo(run_ranks):
    assert run_ranks(async_handles, 3, timeout=120) == [[]] * 3


def p2p_future(rank, world_size, init_method):
    """torch.distributed.irecv's Work: get_future() must not block until the
    message arrives. gloo answers at once ("Work::getFuture not implemented");
    a Future that is not done yet, completed when the message comes, is what
    torch's Futures are for. Both ranks post a receive, ask for its Future,
    then send: with a get_future that waits for the message, both wait for
    the other's send (until the group's 5 s timeout)."""
    d, gloo = _init(rank, world_size, init_method, seconds=5)
    other = 1 - rank
    t = torch.zeros(2)
    w = d.irecv(t, src=other)
    start = time.monotonic()
    fut, refused = None, None
    try:
        fut = w.get_future()
    except RuntimeError as e:
        refused = str(e)
    took = time.monotonic() - start
    try:
        d.send(torch.full((2,), float(rank + 5)), dst=other)
        w.wait()
        value = fut.wait()[0].tolist() if fut is not None else t.tolist()
    except Exception as e:   # noqa: BLE001
        value = f"{type(e).__name__}: {str(e)[:200]}"
    try:
        d.destroy_process_group()
    except Exception:   # noqa: BLE001
        pass
    return round(took, 2), refused, value


def test_get_future_of_a_pending_receive_does_not_block(run_ranks):
    """FAILS on the current code: ShmWork.get_future() (shmdist/torch.py) calls
    self.wait() first, so it blocks until the message arrives."""
    for rank, (took, refused, value) in enumerate(run_ranks(p2p_future, 2, timeout=60)):
        assert took < 2, f"rank {rank}: irecv(...).get_future() blocked {took} s waiting for the message"
        assert value == [float(1 - rank + 5)] * 2, f"rank {rank}: {value} (refused: {refused})"


# ---------------------------------------------------------------- point to point

def p2p_against_gloo(rank, world_size, init_method):
    d, gloo = _init(rank, world_size, init_method)
    me, n = rank, world_size
    res = {}
    for name, g in (("shm", None), ("gloo", gloo)):
        r = {}
        t = torch.zeros(3)
        if me == 0:
            w = d.irecv(t, src=1, group=g)
            before = w.is_completed()
            d.barrier(group=gloo)                      # rank 1 sends after it
            w.wait()
            r["irecv"] = (before, w.is_completed(), w.is_success(), _bytes(t))
        else:
            d.barrier(group=gloo)
            if me == 1:
                w = d.isend(torch.ones(3), dst=0, group=g)
                w.wait()
                r["isend"] = w.is_completed()
        right, left = (me + 1) % n, (me - 1) % n
        a, b = torch.zeros(4), torch.zeros(2, dtype=torch.int64)
        ops = [d.P2POp(d.irecv, a, left, g, tag=1), d.P2POp(d.isend, torch.arange(4.) + me, right, g, tag=1),
               d.P2POp(d.isend, torch.tensor([me, me * 2]), left, g, tag=2), d.P2POp(d.irecv, b, right, g, tag=2)]
        for w in d.batch_isend_irecv(ops):
            w.wait()
        r["batch"] = _bytes([a, b])
        if me == 0:
            got = []
            for _ in range(n - 1):
                x = torch.zeros(1)
                got.append((d.recv(x, group=g), x.item()))
            r["any source"] = sorted(got)
        else:
            d.send(torch.tensor([float(me)]), dst=0, group=g)
        if me == 0:
            x = torch.arange(3., requires_grad=True)
            d.send(x * 2, dst=1, group=g)
            d.send(torch.zeros(0), dst=1, group=g)
            d.send(torch.tensor(3.0), dst=1, group=g)
        elif me == 1:
            a, e, z = torch.zeros(3, requires_grad=True), torch.ones(0), torch.zeros(())
            with torch.no_grad():
                d.recv(a, src=0, group=g)
            d.recv(e, src=0, group=g)
            d.recv(z, src=0, group=g)
            r["grad, empty, 0-d"] = (_bytes([a, e, z]), a.requires_grad)
        if me == 0:
            d.send_object_list([{"a": 1}, [2, 3]], dst=n - 1, group=g)
        elif me == n - 1:
            lst = [None, None]
            d.recv_object_list(lst, src=0, group=g)
            r["objects"] = lst
        d.barrier(group=gloo)
        res[name] = r
    # what gloo refuses: non-contiguous sends and receives, and a receive that times out (gloo's pair dies)
    extra = []
    if me == 0:
        d.send(torch.arange(12.).reshape(3, 4).t(), dst=1)
        d.send(torch.arange(6.)[::2], dst=1)
        w = d.irecv(torch.zeros(1), src=1, tag=9)
        try:
            w.wait(datetime.timedelta(seconds=0.2))
            extra.append("the receive did not time out")
        except RuntimeError as e:
            if "Timed out" not in str(e) or "rank 0" not in str(e):
                extra.append(f"timeout reads {e}")
    elif me == 1:
        a, base = torch.zeros(4, 3), torch.zeros(3, 2)
        d.recv(a, src=0)
        d.recv(base[:, 1], src=0)
        if not torch.equal(a, torch.arange(12.).reshape(3, 4).t()) or base.tolist() != [[0, 0], [0, 2], [0, 4]]:
            extra.append(("strided p2p", a.tolist(), base.tolist()))
    d.barrier()                                   # the group stays usable after the cancelled receive
    d.destroy_process_group()
    return [k for k in res["shm"] if res["shm"][k] != res["gloo"][k]] + extra


def test_point_to_point_matches_gloo(run_ranks):
    assert run_ranks(p2p_against_gloo, 3, timeout=120) == [[]] * 3


def pending_at_destroy(rank, world_size, init_method):
    d, _ = _init(rank, world_size, init_method)
    w = d.irecv(torch.zeros(1), src=1 - rank, tag=3)
    d.destroy_process_group()
    try:
        w.wait()
    except RuntimeError as e:
        return str(e)
    return "wait() returned"


def test_a_receive_pending_at_destroy_fails_clearly(run_ranks):
    for rank, msg in enumerate(run_ranks(pending_at_destroy, 2, timeout=60)):
        assert f"rank {rank}" in msg and "destroy_process_group" in msg, msg


# ---------------------------------------------------------------- subgroups and uneven sizes

def subgroups_against_gloo(rank, world_size, init_method):
    """A subgroup [1, 2] of 3 ranks (roots are global ranks), a one-member
    group, uneven reduce_scatter (as gloo), uneven all_to_all lists, threads
    on two subgroups at once."""
    import threading
    d, gloo = _init(rank, world_size, init_method)
    me, n = rank, world_size
    sub, sub_gloo = d.new_group([1, 2]), d.new_group([1, 2], backend="gloo")
    one, one_gloo = d.new_group([2]), d.new_group([2], backend="gloo")
    pair, pair2 = d.new_group([0, 1]), d.new_group([0, 1])
    res = {}
    for name, g, g1, G in (("shm", sub, one, None), ("gloo", sub_gloo, one_gloo, gloo)):
        r = {}
        if me in (1, 2):
            r["rank"] = (d.get_rank(g), d.get_world_size(g))
            t = torch.full((3,), float(me))
            d.broadcast(t, src=2, group=g)
            r["broadcast"] = _bytes(t)
            t = torch.full((3,), float(me))
            d.reduce(t, dst=1, group=g, op=d.ReduceOp.MAX)
            r["reduce"] = _bytes(t) if me == 1 else None
            go = [torch.zeros(2) for _ in range(2)] if me == 2 else None
            d.gather(torch.full((2,), float(me)), go, dst=2, group=g)
            r["gather"] = _bytes(go)
            so = torch.zeros(2)
            d.scatter(so, [torch.full((2,), 5.0 + j) for j in range(2)] if me == 1 else None, src=1, group=g)
            r["scatter"] = _bytes(so)
            o = torch.zeros(2)
            d.all_to_all_single(o, torch.tensor([me * 10.0, me * 10.0 + 1]), group=g)
            r["all_to_all_single"] = _bytes(o)
            if me == 1:
                d.send(torch.tensor([7.0]), dst=2, group=g)
                x = torch.zeros(1)
                r["recv"] = (d.recv(x, group=g), _bytes(x))
            else:
                x = torch.zeros(1)
                d.recv(x, src=1, group=g)
                d.send(torch.tensor([9.0]), dst=1, group=g)
                r["recv"] = _bytes(x)
            objs = [None, None]
            d.all_gather_object(objs, {"me": me}, group=g)
            r["objects"] = objs
        if me == 2:
            t = torch.full((3,), 4.0)
            d.all_reduce(t, op=d.ReduceOp.PRODUCT, group=g1)
            o = [torch.zeros(3)]
            d.all_gather(o, torch.ones(3), group=g1)
            r["one member"] = _bytes([t, o])
        sizes = [1, 3, 2]
        o = torch.zeros(sizes[me])
        d.reduce_scatter(o, [torch.arange(float(sizes[j])) * (me + 1) + j for j in range(n)], group=G)
        r["uneven reduce_scatter"] = _bytes(o)
        d.barrier(group=gloo)
        res[name] = r
    bad = [k for k in res["shm"] if res["shm"][k] != res["gloo"][k]]
    ins = [torch.arange(float((me + j) % 3) * 2).reshape(-1, 2) + 10 * me for j in range(n)]
    outs = [torch.full(((j + me) % 3, 2), -1.0) for j in range(n)]
    d.all_to_all(outs, ins)                       # gloo refuses uneven lists
    want = [torch.arange(float((j + me) % 3) * 2).reshape(-1, 2) + 10 * j for j in range(n)]
    if _bytes(outs) != _bytes(want):
        bad.append(("uneven all_to_all", [o.tolist() for o in outs]))
    if me in (0, 1):
        done = {}

        def loop(g, key, k):
            done[key] = all(_ar_value(d, g, me + i, k) == 1 + 2 * i for i in range(100))
        th = [threading.Thread(target=loop, args=(pair, "a", 3)), threading.Thread(target=loop, args=(pair2, "b", 70000))]
        for x in th:
            x.start()
        for x in th:
            x.join(60)
        if done != {"a": True, "b": True}:
            bad.append(("two subgroups from two threads", done))
    d.barrier()
    d.destroy_process_group()
    return bad


def _ar_value(d, g, value, k):
    t = torch.full((k,), float(value))
    d.all_reduce(t, group=g)
    return t[0].item()


def test_subgroups_one_member_groups_and_uneven_sizes_match_gloo(run_ranks):
    assert run_ranks(subgroups_against_gloo, 3, timeout=120) == [[]] * 3


# ---------------------------------------------------------------- refusals stay collective calls

def one_rank_refuses(rank, world_size, init_method, how):
    """README (differs, on purpose): "A collective called with arguments its
    own rank refuses ... is still a collective call: that rank takes part in
    the call's first phase, then raises its own error, and the members that
    called it validly raise a DistMismatchError naming the refusal; every
    rank's next call lines up." Here rank 0 alone makes the call its backend
    refuses; both ranks then all_reduce a 1."""
    d, _ = _init(rank, world_size, init_method, seconds=10)
    t = torch.ones(3, dtype=torch.int32 if (how == "avg_of_int" and rank == 0) else torch.float32)
    try:
        if how == "premul_sum":          # torch's op the shm backend refuses, on one rank
            d.all_reduce(t, op=d._make_nccl_premul_sum(2.0) if rank == 0 else d.ReduceOp.SUM)
        elif how == "mixed_dtypes":      # ProcessGroup.allreduce of several tensors, refused by gloo's rule
            ts = [torch.ones(2), torch.ones(2, dtype=torch.float64 if rank == 0 else torch.float32)]
            d.group.WORLD.allreduce(ts).wait()
        elif how == "bor_of_floats":     # several tensors: the local pre-reduction refuses BOR of floats
            kind = torch.float32 if rank == 0 else torch.int32
            d.group.WORLD.allreduce([torch.ones(2, dtype=kind), torch.ones(2, dtype=kind)],
                                    d.ReduceOp.BOR).wait()
        elif how == "coalesced_lengths":  # one output fewer than inputs, on rank 0
            ins = [torch.ones(4), torch.ones(4)]
            outs = [torch.zeros(2), torch.zeros(2)][:1 if rank == 0 else 2]
            d.group.WORLD.reduce_scatter_tensor_coalesced(outs, ins).wait()
        else:                            # AVG of an int32 tensor: shmdist's own refusal
            d.all_reduce(t, op=d.ReduceOp.AVG)
        first = "no error"
    except Exception as e:  # noqa: BLE001
        first = f"{type(e).__name__}: {e}"
    nxt = torch.ones(1)
    try:
        d.all_reduce(nxt)
        second = nxt.item()
    except Exception as e:  # noqa: BLE001
        second = f"{type(e).__name__}: {str(e)[:300]}"
    try:
        d.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return first, second


@pytest.mark.parametrize("how", ["premul_sum", "mixed_dtypes", "bor_of_floats", "coalesced_lengths",
                                 "avg_of_int"])
def test_a_call_one_rank_refuses_leaves_the_next_call_in_step(run_ranks, how):
    """Failed before 293ffe5 for premul_sum and mixed_dtypes: ShmProcessGroup
    (shmdist/torch.py: _op, _alike, _single, _global) raised before any
    shmdist collective ran, so the refusing rank took no part in the call;
    its next all_reduce paired with the others' refused one and every later
    call of the job was out of step (avg_of_int, refused inside shmdist's
    _refusing, held). bor_of_floats (torch's own error in the local
    pre-reduction of several tensors) and coalesced_lengths (an output list
    shorter than the inputs, found after some calls were made) came from a
    review of that fix."""
    (first0, second0), (first1, second1) = run_ranks(one_rank_refuses, 2, how, timeout=60)
    assert first0.startswith("DistError") and "rank 0" in first0, first0
    assert first1.startswith("DistMismatchError") and "refused" in first1, first1
    assert (second0, second1) == (2.0, 2.0), f"the next all_reduce: rank 0 {second0!r}; rank 1 {second1!r}"


def clear_errors(rank, world_size, init_method):
    d, _ = _init(rank, world_size, init_method)
    calls = {
        "float8": lambda: d.all_reduce(torch.ones(3).to(torch.float8_e4m3fn)),
        "BXOR of float32": lambda: d.all_reduce(torch.ones(2), op=d.ReduceOp.BXOR),
        "AVG of bool": lambda: d.all_reduce(torch.ones(2, dtype=torch.bool), op=d.ReduceOp.AVG),
        "sparse": lambda: d.broadcast(torch.eye(3).to_sparse(), src=0),
        "PREMUL_SUM": lambda: d.reduce_scatter_tensor(torch.zeros(1), torch.ones(world_size),
                                                      op=d._make_nccl_premul_sum(2.0)),
    }
    bad = []
    for name, call in calls.items():
        kind, msg = _call(call)
        if kind != "error" or f"rank {rank}" not in msg:
            bad.append((name, msg))
    outs = [torch.zeros(3).to(torch.float8_e4m3fn) for _ in range(world_size)]
    d.all_gather(outs, torch.full((3,), float(rank + 1)).to(torch.float8_e4m3fn))   # moved, not reduced
    if [o.float().tolist() for o in outs] != [[float(j + 1)] * 3 for j in range(world_size)]:
        bad.append(("float8 all_gather", [o.float().tolist() for o in outs]))
    t = torch.ones(1)
    d.all_reduce(t)                                       # every refusal above was on every rank: in step
    if t.item() != world_size:
        bad.append(("after the refusals", t.item()))
    d.destroy_process_group()
    return bad


def test_refusals_name_the_rank_and_the_group_stays_in_step(run_ranks):
    assert run_ranks(clear_errors, 2, timeout=60) == [[], []]


# ---------------------------------------------------------------- init, destroy, init again

def init_three_times(rank, world_size, init_method, backend, env_style):
    import shmdist.torch  # noqa: F401
    import torch.distributed as d
    if env_style:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=init_method.rpartition(":")[2],
                          RANK=str(rank), WORLD_SIZE=str(world_size))
    got = []
    for i in range(3):
        try:
            if env_style:
                d.init_process_group(backend, timeout=datetime.timedelta(seconds=20))
            else:
                d.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                     timeout=datetime.timedelta(seconds=20))
        except Exception as e:  # noqa: BLE001
            got.append(f"init #{i + 1}: {type(e).__name__}: {str(e)[:200]}")
            break
        t = torch.full((2,), float(rank + i))
        d.all_reduce(t)
        got.append(t.tolist())
        d.destroy_process_group()
    return got


@pytest.mark.parametrize("env_style", [False, True], ids=["tcp", "env"])
def test_init_destroy_init_again_through_torch_as_gloo(run_ranks, env_style):
    """FAILS on the current code: the second torch.distributed.init_process_group
    (backend "shm", same init_method) raises "rank 0 is already claimed by
    another process". torch hands the backend the same store again (its
    TCPStore server is cached per port in the process, and the default group's
    prefix restarts), and shmdist's _setup (shmdist/api/group.py) finds its own
    claim/<rank> key from the first init. gloo re-inits fine."""
    port = free_port()
    method = f"tcp://127.0.0.1:{port}"
    want = run_ranks(init_three_times, 2, "gloo", env_style, timeout=90, init_method=method)
    assert want == [[[1.0, 1.0], [3.0, 3.0], [5.0, 5.0]]] * 2, want
    method = f"tcp://127.0.0.1:{free_port()}"
    assert run_ranks(init_three_times, 2, "shm", env_style, timeout=90, init_method=method) == want


# ---------------------------------------------------------------- DDP beyond the plain loop

def _ddp_model(unused=False):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.bn, self.b = torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)
            if unused:
                self.unused = torch.nn.Linear(3, 3)     # never in the graph

        def forward(self, x):
            return self.b(torch.relu(self.bn(self.a(x))))
    g = torch.Generator().manual_seed(0)
    m = M().double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randint(-4, 5, p.shape, generator=g) / 8)
    return m


def _ddp_train(rank, pg, kind):
    import contextlib
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel
    m = _ddp_model(kind == "find_unused")
    kw = {"process_group": pg, "bucket_cap_mb": 0.0002}
    if kind == "find_unused":
        kw["find_unused_parameters"] = True
    if kind == "static_graph":
        kw["static_graph"] = True
    ddp = DistributedDataParallel(m, **kw)
    if kind == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
        ddp.register_comm_hook(P.PowerSGDState(process_group=pg, matrix_approximation_rank=1,
                                               start_powerSGD_iter=2, random_seed=3), P.powerSGD_hook)
    if kind == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, process_group=pg,
                                      lr=2.0 ** -6)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=2.0 ** -6)
    data = torch.Generator().manual_seed(100 + rank)
    losses = []
    with Join([ddp]) if kind == "join" else contextlib.nullcontext():
        for i in range(5 + (rank if kind == "join" else 0)):          # join: uneven inputs
            x = torch.randint(-2, 3, (4, 6), generator=data).double()
            y = torch.randint(-3, 4, (4, 3), generator=data).double()
            if kind == "no_sync" and i % 2 == 0:
                with ddp.no_sync():
                    ((ddp(x) - y).pow(2).sum() / 4).backward()
                continue
            loss = (ddp(x) - y).pow(2).sum() / 4
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            with torch.no_grad():
                for p in m.parameters():
                    p.copy_(torch.round(p * 64) / 64)
    return losses, {k: v.clone() for k, v in m.state_dict().items()}


DDP_KINDS = ("find_unused", "static_graph", "zero", "join", "no_sync")


def ddp_against_gloo(rank, world_size, init_method):
    """BatchNorm buffers (broadcast every step), unused parameters, a static
    graph, ZeroRedundancyOptimizer
    (async broadcasts), Join with uneven inputs, no_sync: the same losses,
    parameters and buffers as gloo, bit for bit (2 ranks, values on a grid)."""
    d, gloo = _init(rank, world_size, init_method)
    bad = []
    # PowerSGD (Futures chained with then): gloo aborts in it here (size mismatch inside gloo), so
    # the check is DDP's own invariant: both replicas end with the same parameters
    got = _call(_ddp_train, rank, None, "powersgd")
    powersgd = [_bytes(v) for k, v in got[1][1].items() if not k.startswith("bn.running") and "num_batches" not in k] \
        if got[0] == "ok" else got[1]      # (BatchNorm's running stats are each replica's own after its last step)
    d.barrier(group=gloo)
    for kind in DDP_KINDS:
        a = _call(_ddp_train, rank, None, kind)
        d.barrier(group=gloo)
        b = _call(_ddp_train, rank, gloo, kind)
        d.barrier(group=gloo)
        if a[0] != "ok" or b[0] != "ok":
            bad.append((kind, str(a)[:300], str(b)[:300]))
            continue
        if a[1][0] != b[1][0] or any(not torch.equal(v, b[1][1][k]) for k, v in a[1][1].items()):
            bad.append(kind)
    d.destroy_process_group()
    return bad, powersgd


def test_ddp_features_match_gloo_bit_for_bit(run_ranks):
    (bad0, p0), (bad1, p1) = run_ranks(ddp_against_gloo, 2, timeout=150)
    assert (bad0, bad1) == ([], [])
    assert isinstance(p0, list) and p0 == p1, "PowerSGD: the replicas differ (or it failed)"

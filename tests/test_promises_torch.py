"""An outside tester's attempts to break README's "Tensors" paragraph with
torch tensors: every dtype torch has (float8 too), 0-d, empty, strided,
transposed, expanded, requires_grad, lazily conjugated and negated views,
both directions and across numpy/torch; torch's ReduceOp values; and
shmdist's collectives against torch's own gloo, bit for bit, where the
semantics are torch's. Skips without torch."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import shmdist as dist  # noqa: E402

DTYPES = ["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
          "bfloat16", "float32", "float64", "complex32", "complex64", "complex128", "float8_e4m3fn",
          "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]
NUMPY_TOO = {"bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
             "float32", "float64", "complex64", "complex128"}


def _init(rank, world_size, init_method, **kw):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, **kw)


def _bytes(t) -> bytes:
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1)
    out = torch.empty(flat.numel(), dtype=flat.dtype)     # a fresh dense copy: stride 1 even for 1 element
    out.copy_(flat)
    return bytes(out.view(torch.uint8).numpy()) if out.numel() else b""


def _make(name: str, shape, seed: int):
    import torch as T
    dt = getattr(T, name)
    n = int(np.prod(shape)) if shape else 1
    if name == "bool":
        return T.from_numpy(np.random.default_rng(seed).integers(0, 2, n).astype(bool)).reshape(shape)
    if n == 0:
        return T.empty(shape, dtype=dt)
    size = T.empty(0, dtype=dt).element_size()
    raw = np.frombuffer(np.random.default_rng(seed).bytes(n * size), dtype=np.uint8).copy()
    return T.from_numpy(raw).view(dt).reshape(shape)


SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 3)]


def dtype_ping_pong(rank, world_size, init_method, names):
    """Rank 0 sends each dtype and shape contiguous, transposed, sliced with a
    step and expanded; rank 1 receives into contiguous and strided targets
    and sends it back. numpy takes part wherever numpy has the dtype."""
    import torch as T
    _init(rank, world_size, init_method)
    bad = []
    tag = 0
    for i, name in enumerate(names):
        for shape in SHAPES:
            tag += 1
            ref = _make(name, shape, i * 31 + len(shape))
            if rank == 0:
                sends = [ref]
                if ref.dim() == 2:
                    sends.append(ref.t().contiguous().t())                  # transposed layout
                if ref.dim() >= 1 and ref.numel():
                    big = _make(name, (2 * shape[0],) + shape[1:], 99)
                    big[::2] = ref
                    sends.append(big[::2])                                   # stepped
                for s in sends:
                    dist.send(s, 1, tag=tag).wait()
                if name in NUMPY_TOO:
                    dist.send(ref.numpy(), 1, tag=tag).wait()                # numpy -> torch
                back = T.zeros(shape, dtype=ref.dtype)
                dist.recv(back, 1, tag=tag).wait()
                if _bytes(back) != _bytes(ref):
                    bad.append((name, shape, "back"))
                if name in NUMPY_TOO:
                    nback = np.zeros(shape, dtype=name)
                    dist.recv(nback, 1, tag=tag).wait()                      # torch -> numpy
                    if nback.tobytes() != _bytes(ref):
                        bad.append((name, shape, "numpy back"))
            else:
                count = 1 + (ref.dim() == 2) + (ref.dim() >= 1 and ref.numel() > 0) + (name in NUMPY_TOO)
                for k in range(count):
                    if k % 2 and len(shape) >= 1 and ref.numel():
                        box = T.zeros((shape[0], 2) + shape[1:], dtype=ref.dtype)[:, 0]   # strided target
                    else:
                        box = T.zeros(shape, dtype=ref.dtype)
                    dist.recv(box, 0, tag=tag).wait()
                    if _bytes(box) != _bytes(ref):
                        bad.append((name, shape, k))
                dist.send(box, 0, tag=tag).wait()
                if name in NUMPY_TOO:
                    dist.send(box, 0, tag=tag).wait()
    dist.destroy_process_group()
    return bad


def test_every_torch_dtype_every_shape_both_directions(run_ranks):
    assert run_ranks(dtype_ping_pong, 2, DTYPES, timeout=120) == [[], []]


def views(rank, world_size, init_method):
    """requires_grad leaves and non-leaves, conj and neg views, expanded
    tensors: sent and received, point-to-point and through collectives."""
    import torch as T
    _init(rank, world_size, init_method)
    res = {}
    c = T.tensor([1 + 2j, 3 - 4j, -5 + 0.5j], dtype=T.complex64)
    f = T.tensor([1.5, -2.0, 3.25])
    if rank == 0:
        dist.send(c.conj(), 1).wait()                                  # conj bit
        dist.send(T._neg_view(f), 1).wait()                            # neg bit
        dist.send(c.conj().imag, 1).wait()                             # neg bit from conj().imag
        leaf = f.clone().requires_grad_(True)
        dist.send(leaf, 1).wait()                                      # requires_grad leaf
        dist.send(leaf * 2, 1).wait()                                  # non-leaf with grad_fn
        dist.send(T.tensor([7.0]).expand(4), 1).wait()                 # stride 0
        dist.send(c, 1).wait()
        dist.send(f, 1).wait()
        dist.send(f, 1).wait()
    else:
        got = []
        a = T.zeros(3, dtype=T.complex64)
        dist.recv(a, 0).wait()
        got.append(a.tolist() == c.conj().tolist())
        b = T.zeros(3)
        dist.recv(b, 0).wait()
        got.append(b.tolist() == (-f).tolist())
        d = T.zeros(3)
        dist.recv(d, 0).wait()
        got.append(d.tolist() == [-2.0, 4.0, -0.5])
        g = T.zeros(3, requires_grad=True)
        dist.recv(g, 0).wait()                                         # into a requires_grad leaf
        got.append(g.tolist() == f.tolist() and g.requires_grad and g.grad_fn is None)
        h = T.zeros(3)
        dist.recv(h, 0).wait()
        got.append(h.tolist() == (f * 2).tolist())
        e = T.zeros(4)
        dist.recv(e, 0).wait()
        got.append(e.tolist() == [7.0] * 4)
        target = T.zeros(3, dtype=T.complex64)
        dist.recv(target.conj(), 0).wait()                             # receive into a conj view
        got.append(target.conj().tolist() == c.tolist() and target.tolist() == c.conj().tolist())
        base = T.zeros(3)
        dist.recv(T._neg_view(base), 0).wait()                         # receive into a neg view
        got.append(T._neg_view(base).tolist() == f.tolist() and base.tolist() == (-f).tolist())
        strided_leaf = T.zeros(3, 2)
        dist.recv(strided_leaf[:, 1], 0).wait()                        # strided receive
        got.append(strided_leaf[:, 1].tolist() == f.tolist() and strided_leaf[:, 0].abs().sum().item() == 0)
        res["p2p"] = got
    # collectives on views
    x = T.tensor([1 + 1j, 2 - 2j], dtype=T.complex64) * (rank + 1)
    xc = x.clone()
    dist.all_reduce(xc.conj())                                         # sum of conjugates, seen through conj
    res["all_reduce_conj"] = xc.conj().tolist() == (T.tensor([1 - 1j, 2 + 2j], dtype=T.complex64) * 3).tolist()
    y = T.full((4,), float(rank + 1), requires_grad=True)
    dist.all_reduce(y)
    res["all_reduce_grad"] = y.tolist() == [3.0] * 4 and y.requires_grad
    z = T.zeros(3, 4)
    if rank == 1:
        z[:, 2] = T.tensor([4.0, 5.0, 6.0])
    dist.broadcast(z[:, 2], 1)                                         # strided broadcast target
    res["broadcast_strided"] = z[:, 2].tolist() == [4.0, 5.0, 6.0] and z[:, 0].abs().sum().item() == 0
    w = T.full((2,), float(rank + 1))
    dist.all_reduce(T._neg_view(w))                                    # sum of -1 and -2, seen negated
    res["all_reduce_neg"] = w.tolist() == [3.0, 3.0]
    dist.destroy_process_group()
    return res


def test_requires_grad_conj_neg_strided_and_expanded_tensors(run_ranks):
    r0, r1 = run_ranks(views, 2, timeout=60)
    assert r1["p2p"] == [True] * 9
    for r in (r0, r1):
        assert r["all_reduce_conj"] and r["all_reduce_grad"] and r["broadcast_strided"] and r["all_reduce_neg"], r


def bfloat16_reduce(rank, world_size, init_method, n):
    import torch as T
    _init(rank, world_size, init_method)
    g = T.Generator().manual_seed(rank)
    x = (T.randn(n, generator=g) * 100).to(T.bfloat16)
    inp = x.clone()
    dist.all_reduce(x)
    a = (T.randn(n, generator=g) * 100).to(T.bfloat16)
    ain = a.clone()
    dist.all_reduce(a, dist.ReduceOp.AVG)
    dist.destroy_process_group()
    bits = lambda t: t.view(T.int16).numpy().copy()       # tensors do not travel back (torch's pickling)
    return bits(inp), bits(x), bits(ain), bits(a)


@pytest.mark.parametrize("n", [5, 200001], ids=["small", "rounds"])
def test_bfloat16_reductions_accumulate_in_float32_and_round_once(run_ranks, n):
    got = [[torch.from_numpy(b).view(torch.bfloat16) for b in r]
           for r in run_ranks(bfloat16_reduce, 3, n, timeout=120)]
    acc = got[0][0].float() + got[1][0].float() + got[2][0].float()
    avg = (got[0][2].float() + got[1][2].float() + got[2][2].float()) / 3
    for r in range(3):
        assert torch.equal(got[r][1], acc.to(torch.bfloat16)), r
        assert torch.equal(got[r][3], avg.to(torch.bfloat16)), r


def torch_reduce_ops(rank, world_size, init_method):
    import torch as T
    import torch.distributed as tdist
    _init(rank, world_size, init_method)
    res = []
    for op, ref in ((tdist.ReduceOp.SUM, 3), (tdist.ReduceOp.PRODUCT, 2), (tdist.ReduceOp.MIN, 1),
                    (tdist.ReduceOp.MAX, 2), (tdist.ReduceOp.BAND, 0), (tdist.ReduceOp.BOR, 3),
                    (tdist.ReduceOp.BXOR, 3)):
        x = T.full((3,), rank + 1, dtype=T.int32)
        dist.all_reduce(x, op)
        res.append(x.tolist() == [ref] * 3)
    y = T.full((2,), float(rank + 1))
    dist.all_reduce(y, tdist.ReduceOp.AVG)
    res.append(y.tolist() == [1.5, 1.5])
    n = np.full(2, rank + 1, dtype=np.int64)
    dist.all_reduce(n, tdist.ReduceOp.MAX)                           # torch's op on a numpy array
    res.append(n.tolist() == [2, 2])
    dist.destroy_process_group()
    return res


def test_torch_reduce_op_values_are_accepted(run_ranks):
    assert run_ranks(torch_reduce_ops, 2, timeout=60) == [[True] * 9] * 2


# ---------------------------------------------------------------- against gloo, bit for bit

def against_gloo(rank, world_size, init_method, gloo_port, arith):
    """The same calls through shmdist and through torch.distributed's gloo, in
    the same processes; every result compared byte for byte. Reductions only
    with 2 ranks (gloo's ring sums 3 ranks in another order than rank order,
    which README promises instead; with 2 the order cannot matter)."""
    import torch as T
    import torch.distributed as tdist
    _init(rank, world_size, init_method)
    tdist.init_process_group("gloo", f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world_size)
    g = T.Generator().manual_seed(rank)
    n = world_size
    last = n - 1
    bad = []

    def both(name, fn):
        a, b = fn(dist), fn(tdist)
        if [_bytes(t) for t in a] != [_bytes(t) for t in b]:
            bad.append(name)

    x = T.randn(1000, generator=g)
    if arith:
        for op in ("SUM", "PRODUCT", "MIN", "MAX"):
            both(f"all_reduce {op}", lambda m, op=op: [_ar(m, x.clone(), op)])
            both(f"reduce {op}", lambda m, op=op: [_rd(m, x.clone(), op, last)])
            both(f"reduce_scatter_tensor {op}", lambda m, op=op: [_rst(m, x, op, n)])
        both("all_reduce int64", lambda m: [_ar(m, T.arange(50) * (rank + 1), "SUM")])
        both("all_reduce BXOR", lambda m: [_ar(m, T.arange(50) * (rank + 3), "BXOR")])
    both("broadcast", lambda m: [_bc(m, x.clone(), last)])
    both("all_gather", lambda m: _ag(m, x, n))
    both("all_gather_into_tensor", lambda m: [_agt(m, x, n)])
    both("gather", lambda m: _ga(m, x, n, last))
    both("scatter", lambda m: [_sc(m, x, n)])
    splits = [[1, 4, 2], [3, 0, 3], [2, 2, 2]] if n == 3 else [[1, 4], [3, 0]]
    both("all_to_all_single uneven", lambda m: [_a2a(m, rank, splits)])
    both("all_to_all_single even", lambda m: [_a2a(m, rank, [[2] * n] * n)])
    tdist.destroy_process_group()
    dist.destroy_process_group()
    return bad


def _ar(m, t, op):
    m.all_reduce(t, getattr(m.ReduceOp, op))
    return t


def _bc(m, t, src):
    m.broadcast(t, src)
    return t


def _ag(m, t, n):
    outs = [torch.zeros_like(t) for _ in range(n)]
    m.all_gather(outs, t)
    return outs


def _agt(m, t, n):
    out = torch.zeros(n * t.numel())
    m.all_gather_into_tensor(out, t)
    return out


def _rst(m, t, op, n):
    res = torch.zeros(250)
    m.reduce_scatter_tensor(res, t[:250 * n].clone(), getattr(m.ReduceOp, op))
    return res


def _ga(m, t, n, dst):
    outs = [torch.zeros_like(t) for _ in range(n)] if m.get_rank() == dst else None
    m.gather(t, outs, dst=dst)
    return outs or []


def _sc(m, t, n):
    out = torch.zeros(10)
    m.scatter(out, [t[10 * j:10 * j + 10].clone() for j in range(n)] if m.get_rank() == 0 else None, src=0)
    return out


def _rd(m, t, op, dst):
    m.reduce(t, dst, getattr(m.ReduceOp, op))
    return t if m.get_rank() == dst else torch.zeros(0)


def _a2a(m, rank, splits):
    n = len(splits)
    ins = splits[rank]
    outs = [splits[j][rank] for j in range(n)]
    inp = torch.arange(sum(ins), dtype=torch.float32) + 100 * rank
    out = torch.zeros(sum(outs))
    m.all_to_all_single(out, inp, outs, ins)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_match_gloo_bit_for_bit(run_ranks, world_size):
    from ranks import free_port
    got = run_ranks(against_gloo, world_size, free_port(), world_size == 2, timeout=120)
    assert got == [[]] * world_size

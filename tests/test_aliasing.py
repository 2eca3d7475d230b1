"""Collectives whose inputs and outputs share memory give what separate
buffers give (and what gloo gives): the in-place idioms of torch code —
reduce into my own chunk, gather into the slot that holds my input, one
tensor as all_to_all_single's input and output — and the odd ones (an
output over another rank's input piece), each small and across several
rounds of a small arena. Also reduce_scatter with a different output size
per rank, which gloo accepts.

Every rank computes the expected result itself from the same seeds.
"""
from __future__ import annotations

import numpy as np
import pytest

import shmdist as dist

SMALL_ARENA = {"SHMDIST_ARENA_BYTES": "16384"}     # pieces below take several rounds
COUNTS = (5, 3000)


def data(rank: int, count: int, dtype="float32") -> np.ndarray:
    """Rank ``rank``'s input: small integers, so every sum is exact."""
    return (np.arange(count) % 97 + 3 * rank + 1).astype(dtype)


def aliasing_cases(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    n, me = world_size, rank
    bad = []

    def expect(name, got, want):
        if got.shape != want.shape or not np.array_equal(got, want):
            bad.append(f"rank {me}: {name}: got {got[:8]}... want {want[:8]}...")

    for k in COUNTS:
        for dtype in ("float32", "int64"):
            full = [data(r, n * k, dtype) for r in range(n)]       # every rank's whole input
            mine = lambda j: slice(j * k, (j + 1) * k)
            summed = [sum(full[r][mine(j)] for r in range(n)).astype(dtype) for j in range(n)]

            t = full[me].copy()      # reduce_scatter_tensor into my own chunk
            dist.reduce_scatter_tensor(t[mine(me)], t)
            expect(f"reduce_scatter_tensor in place {dtype}[{k}]", t[mine(me)], summed[me])

            t = full[me].copy()      # reduce_scatter, output = input_list[me]
            pieces = [t[mine(j)] for j in range(n)]
            dist.reduce_scatter(pieces[me], pieces)
            expect(f"reduce_scatter in place {dtype}[{k}]", t[mine(me)], summed[me])

            t = full[me].copy()      # output over the piece another rank still needs
            pieces = [t[mine(j)] for j in range(n)]
            other = (me + 1) % n
            dist.reduce_scatter(pieces[other], pieces)
            expect(f"reduce_scatter into input_list[{other}] {dtype}[{k}]", t[mine(other)], summed[me])

            t = np.zeros(n * k, dtype)   # all_gather_into_tensor from my own slot
            t[mine(me)] = full[me][:k]
            dist.all_gather_into_tensor(t, t[mine(me)])
            expect(f"all_gather_into_tensor in place {dtype}[{k}]", t,
                   np.concatenate([full[r][:k] for r in range(n)]))

            t = np.zeros(n * k, dtype)   # all_gather, tensor = tensor_list[me]
            t[mine(me)] = full[me][:k]
            outs = [t[mine(j)] for j in range(n)]
            dist.all_gather(outs, outs[me])
            expect(f"all_gather in place {dtype}[{k}]", t, np.concatenate([full[r][:k] for r in range(n)]))

            # all_to_all_single with one tensor as input and output: piece j of rank r is
            # full[r][mine(j)]; afterwards piece j here is rank j's piece me
            t = full[me].copy()
            dist.all_to_all_single(t, t)
            expect(f"all_to_all_single in place {dtype}[{k}]", t,
                   np.concatenate([full[j][mine(me)] for j in range(n)]))

            t = full[me].copy()          # all_to_all, the same list as input and output
            pieces = [t[mine(j)] for j in range(n)]
            dist.all_to_all(pieces, pieces)
            expect(f"all_to_all in place {dtype}[{k}]", t, np.concatenate([full[j][mine(me)] for j in range(n)]))

            root = n - 1                 # scatter: the root's output is its own input piece
            t = full[me].copy()
            pieces = [t[mine(j)] for j in range(n)] if me == root else None
            out = pieces[root] if me == root else np.zeros(k, dtype)
            dist.scatter(out, pieces, src=root)
            expect(f"scatter in place {dtype}[{k}]", out, full[root][mine(me)])

            t = full[me].copy()          # scatter: the root's output over another piece
            pieces = [t[mine(j)] for j in range(n)] if me == root else None
            out = pieces[0] if me == root else np.zeros(k, dtype)
            dist.scatter(out, pieces, src=root)
            expect(f"scatter into scatter_list[0] {dtype}[{k}]", out, full[root][mine(me)])

            t = np.zeros(n * k, dtype)   # gather: the root's input is its own slot
            t[mine(me)] = full[me][:k]
            pieces = [t[mine(j)] for j in range(n)] if me == root else None
            dist.gather(t[mine(me)], pieces, dst=root)
            if me == root:
                expect(f"gather in place {dtype}[{k}]", t, np.concatenate([full[r][:k] for r in range(n)]))

    # uneven all_to_all_single in place: rank i sends s(i, j) rows to j; s is symmetric,
    # so what a rank sends adds up to what it receives and one tensor can hold both
    s = lambda i, j: 1 + (i + j) % 3
    for rows_scale in (1, 700):
        sizes = [s(me, j) * rows_scale for j in range(n)]
        blocks = [np.full(sizes[j], 100 * me + j, "float32") for j in range(n)]
        t = np.concatenate(blocks)
        dist.all_to_all_single(t, t, sizes, sizes)
        want = np.concatenate([np.full(s(j, me) * rows_scale, 100 * j + me, "float32") for j in range(n)])
        expect(f"uneven all_to_all_single in place x{rows_scale}", t, want)
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("arena", ["default arena", "small arena"])
def test_inputs_aliasing_outputs_give_the_separate_buffers_result(run_ranks, world_size, arena):
    env = SMALL_ARENA if arena == "small arena" else {}
    results = run_ranks(aliasing_cases, world_size, timeout=120, env=env)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems[:20])


def uneven_reduce_scatter(rank, world_size, init_method, scale):
    """Rank i's output has 2 + i (times ``scale``) elements; input_list[j] has rank j's size."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    n, me = world_size, rank
    size = lambda j: (2 + j) * scale
    bad = []
    for op, fold in ((dist.ReduceOp.SUM, np.add), (dist.ReduceOp.MAX, np.maximum)):
        for dtype in ("float32", "int32", "float64"):
            inputs = lambda r: [data(r + 7 * j, size(j), dtype) for j in range(n)]
            out = np.zeros(size(me), dtype)
            dist.reduce_scatter(out, inputs(me), op=op)
            want = inputs(0)[me]
            for r in range(1, n):
                want = fold(want, inputs(r)[me])
            if not np.array_equal(out, want):
                bad.append(f"rank {me}: uneven reduce_scatter {op.name} {dtype}: {out[:6]} != {want[:6]}")
    # in place, uneven: the output is my own piece
    ins = [data(me + 7 * j, size(j)) for j in range(n)]
    dist.reduce_scatter(ins[me], ins)
    want = sum(data(r + 7 * me, size(me)) for r in range(n))
    if not np.array_equal(ins[me], want):
        bad.append(f"rank {me}: uneven reduce_scatter in place: {ins[me][:6]} != {want[:6]}")
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("scale", [1, 5000])
def test_reduce_scatter_accepts_a_different_size_per_rank(run_ranks, world_size, scale):
    results = run_ranks(uneven_reduce_scatter, world_size, scale, timeout=120)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


def disagreeing_reduce_scatter(rank, world_size, init_method):
    """Rank 1 thinks rank 0's piece has 3 elements, rank 0 says 2: every rank
    raises naming the pair, and the group then runs a correct collective."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    sizes = [2 + (rank == 1 and j == 0) + j for j in range(world_size)]
    out = np.zeros(sizes[rank], "float32")
    try:
        dist.reduce_scatter(out, [np.ones(s, "float32") for s in sizes])
        message = None
    except dist.DistMismatchError as e:
        message = str(e)
    t = np.ones(4, "float32")
    dist.all_reduce(t)
    dist.destroy_process_group()
    return message, t.tolist()


def test_reduce_scatter_sizes_that_disagree_raise_on_every_rank(run_ranks):
    results = run_ranks(disagreeing_reduce_scatter, 3, timeout=60)
    for rank, (message, after) in enumerate(results):
        assert message is not None, f"rank {rank} did not raise"
        assert f"rank {rank}: reduce_scatter" in message and "rank 1 sends rank 0 12 bytes" in message, message
        assert after == [3.0] * 4


def requires_grad_cases(rank, world_size, init_method):
    """Tensors that require grad (a leaf, a non-leaf, as DDP with create_graph
    hands them) reduce as gloo reduces them: the values, outside autograd."""
    torch = __import__("torch")
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    n = world_size
    bad = []
    leaf = torch.arange(6, dtype=torch.float32).requires_grad_()
    with torch.no_grad():
        dist.all_reduce(leaf)
    if not torch.equal(leaf.detach(), torch.arange(6, dtype=torch.float32) * n):
        bad.append(f"all_reduce leaf: {leaf}")
    base = torch.ones(4 * n, requires_grad=True)
    nonleaf = base * (rank + 1)                  # has a grad_fn
    dist.all_reduce(nonleaf)
    if not torch.equal(nonleaf.detach(), torch.full((4 * n,), float(n * (n + 1) // 2))):
        bad.append(f"all_reduce non-leaf: {nonleaf}")
    out = torch.zeros(4, requires_grad=True)
    with torch.no_grad():
        dist.reduce_scatter_tensor(out, base * (rank + 1))
    if not torch.equal(out.detach(), torch.full((4,), float(n * (n + 1) // 2))):
        bad.append(f"reduce_scatter_tensor: {out}")
    p = torch.nn.Parameter(torch.full((3,), float(rank)))     # DDP's parameters: broadcast from 0
    dist.broadcast(p, 0)
    if not torch.equal(p.detach(), torch.zeros(3)):
        bad.append(f"broadcast Parameter: {p}")
    dist.destroy_process_group()
    return bad


def test_tensors_that_require_grad_reduce_like_gloo(run_ranks):
    pytest.importorskip("torch")
    results = run_ranks(requires_grad_cases, 3, timeout=120)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


def test_aliasing_and_uneven_reduce_scatter_across_pretend_hosts(run_ranks):
    """The same through the hierarchical collectives: 4 ranks on 2 pretend hosts."""
    from test_multihost import on_pretend_host
    results = run_ranks(on_pretend_host, 4, "interleaved", aliasing_cases, timeout=240)
    problems = [p for r in results for p in r]
    results = run_ranks(on_pretend_host, 4, "blocks", uneven_reduce_scatter, 300, timeout=120)
    problems += [p for r in results for p in r]
    assert not problems, "\n".join(problems[:20])


def refusals_and_mixed_evenness(rank, world_size, init_method):
    """One rank refuses its own bad arguments, and all_to_all_single is even on
    some ranks only: every rank raises (or completes) together, and the group
    runs a correct all_reduce afterwards."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=30)
    n, me = world_size, rank
    got = []
    try:
        dist.all_gather([np.zeros(4) for _ in range(n)], np.zeros(5 if me == 1 else 4))
        got.append("no error")
    except dist.DistError as e:
        got.append(type(e).__name__ + (" naming the refusal" if "refused" in str(e) or me == 1 else ""))
    # rank i sends s(i, j) rows to rank j; rank 0's pieces all equal 2, the others' not
    s = lambda i, j: 2 if 0 in (i, j) else 1 + i + j
    inp = np.concatenate([np.full(s(me, j), 10 * me + j, "float64") for j in range(n)])
    out = np.zeros(sum(s(j, me) for j in range(n)))
    dist.all_to_all_single(out, inp, [s(j, me) for j in range(n)], [s(me, j) for j in range(n)])
    want = np.concatenate([np.full(s(j, me), 10 * j + me, "float64") for j in range(n)])
    got.append(bool(np.array_equal(out, want)))
    x = np.ones(3)
    dist.all_reduce(x)
    got.append(x.tolist())
    dist.destroy_process_group()
    return got


@pytest.mark.parametrize("hosts", ["one host", "pretend hosts"])
def test_a_rank_refusing_its_arguments_and_mixed_evenness_keep_the_group_in_step(run_ranks, hosts):
    from test_multihost import on_pretend_host
    if hosts == "one host":
        results = run_ranks(refusals_and_mixed_evenness, 3, timeout=90)
    else:
        results = run_ranks(on_pretend_host, 4, "interleaved", refusals_and_mixed_evenness, timeout=90)
    for rank, got in enumerate(results):
        assert got[0] == ("DistMismatchError naming the refusal"), (rank, got)
        assert got[1:] == [True, [float(len(results))] * 3], (rank, got)

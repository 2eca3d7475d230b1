"""What can be sent: every numpy and torch dtype, 0-d and empty tensors,
non-contiguous ones, and clear errors for what cannot."""
from __future__ import annotations

import numpy as np
import pytest

import shmdist as dist

NUMPY_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "complex64", "complex128"]
TORCH_DTYPES = NUMPY_DTYPES + ["bfloat16"]
SHAPE = (3, 5)


def _numpy_values(name: str, shape=SHAPE) -> np.ndarray:
    """Distinct, exactly representable values of dtype ``name`` (float32 for bfloat16)."""
    base = np.arange(int(np.prod(shape))).reshape(shape)
    if name == "bool":
        values = base % 3 == 0
    elif name.startswith("uint"):
        values = base * 7 + 1
    elif name.startswith("int"):
        values = base * 5 - 20
    elif name.startswith("complex"):
        values = base * 0.5 - 3 + 1j * (base + 0.25)
    else:
        values = base * 0.5 - 3.25
    return np.asarray(values, dtype="float32" if name == "bfloat16" else name)   # 0-d stays an array


def _values(kind: str, name: str, shape=SHAPE):
    values = _numpy_values(name, shape)
    if kind == "numpy":
        return values
    import torch
    return torch.from_numpy(values).to(getattr(torch, name))


def _zeros(kind: str, name: str, shape=SHAPE):
    if kind == "numpy":
        return np.zeros(shape, dtype=name)
    import torch
    return torch.zeros(shape, dtype=getattr(torch, name))


def _equal(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    import torch
    return torch.equal(a, b)


def send_every_dtype(rank, world_size, init_method, sender, receiver, names):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    wrong = []
    for name in names:
        if rank == 0:
            dist.send(_values(sender, name), dst=1).wait()
        else:
            box = _zeros(receiver, name)
            dist.recv(box, src=0).wait()
            if not _equal(box, _values(receiver, name)):
                wrong.append(name)
    dist.destroy_process_group()
    return wrong


@pytest.mark.parametrize("sender, receiver, names", [
    ("numpy", "numpy", NUMPY_DTYPES),
    ("torch", "torch", TORCH_DTYPES),
    ("numpy", "torch", NUMPY_DTYPES),
    ("torch", "numpy", NUMPY_DTYPES),
], ids=["numpy-numpy", "torch-torch", "numpy-torch", "torch-numpy"])
def test_every_dtype_arrives_unchanged(run_ranks, sender, receiver, names):
    if "torch" in (sender, receiver):
        pytest.importorskip("torch")
    assert run_ranks(send_every_dtype, 2, sender, receiver, names) == [[], []], \
        "the dtypes listed for rank 1 arrived with other values"


def zero_d_and_empty(rank, world_size, init_method, kind):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    shapes = [(), (0,), (0, 3), (4, 0, 2)]
    got = []
    for shape in shapes:
        if rank == 0:
            dist.send(_values(kind, "float64", shape), dst=1).wait()
        else:
            box = _zeros(kind, "float64", shape)
            req = dist.recv(box, src=0)
            req.wait()
            got.append((tuple(box.shape), box.tolist()))
    dist.destroy_process_group()
    return got


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_0d_and_empty_tensors(run_ranks, kind):
    if kind == "torch":
        pytest.importorskip("torch")
    assert run_ranks(zero_d_and_empty, 2, kind)[1] == [
        ((), -3.25), ((0,), []), ((0, 3), []), ((4, 0, 2), [[], [], [], []])]


def non_contiguous(rank, world_size, init_method, kind):
    """Send a strided view; receive into a strided view of a bigger buffer."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    big = _values(kind, "int32", (6, 10))
    if rank == 0:
        dist.send(big[::2, 1::3], dst=1).wait()     # shape (3, 3), strided both ways
        dist.send(big.T, dst=1).wait()              # transposed (Fortran order for numpy)
        result = None
    else:
        into = _zeros(kind, "int32", (6, 12))
        dist.recv(into[1::2, ::4], src=0).wait()
        transposed = _zeros(kind, "int32", (6, 10)).T
        dist.recv(transposed, src=0).wait()
        expected = _zeros(kind, "int32", (6, 12))
        expected[1::2, ::4] = big[::2, 1::3]
        result = (_equal(into, expected), _equal(transposed, big.T))
    dist.destroy_process_group()
    return result


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_non_contiguous_send_and_receive(run_ranks, kind):
    if kind == "torch":
        pytest.importorskip("torch")
    assert run_ranks(non_contiguous, 2, kind)[1] == (True, True)


def lazy_views(rank, world_size, init_method):
    """torch's conjugate and negative views keep the other values in memory:
    what moves must be the values the view shows, both ways, also for
    in-place collectives."""
    import torch
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    x = torch.tensor([1.0, -2.0])
    got = {}
    if rank == 0:
        dist.send(z.conj(), 1).wait()
        dist.send(x._neg_view(), 1).wait()
        dist.send(z, 1).wait()
    else:
        box = torch.zeros(2, dtype=torch.complex64)
        dist.recv(box, 0).wait()
        got["conj sent"] = box.tolist()
        box = torch.zeros(2)
        dist.recv(box, 0).wait()
        got["neg sent"] = box.tolist()
        view = torch.zeros(2, dtype=torch.complex64).conj()
        dist.recv(view, 0).wait()
        got["into conj"] = view.tolist()
    summed = torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64).conj()
    dist.all_reduce(summed)
    got["all_reduce conj"] = summed.tolist()
    negated = torch.tensor([1.0, -2.0])._neg_view()
    dist.all_reduce(negated)
    got["all_reduce neg"] = negated.tolist()
    if rank == 0:
        dist.send(torch.tensor([5.0, 6.0]), 1).wait()
    else:
        view = torch.zeros(2)._neg_view()
        dist.recv(view, 0).wait()
        got["into neg"] = view.tolist()
    dist.destroy_process_group()
    return got


def test_conjugate_and_negative_views_move_their_values(run_ranks):
    pytest.importorskip("torch")
    got = run_ranks(lazy_views, 2)
    both = [2 - 2j, 4 + 2j]
    negs = [-2.0, 4.0]
    assert got == [{"all_reduce conj": both, "all_reduce neg": negs},
                   {"conj sent": [1 - 2j, 3 + 4j], "neg sent": [-1.0, 2.0], "into conj": [1 + 2j, 3 - 4j],
                    "all_reduce conj": both, "all_reduce neg": negs, "into neg": [5.0, 6.0]}]


def _read_only() -> np.ndarray:
    a = np.zeros(2)
    a.flags.writeable = False
    return a


def bad_arguments(rank, world_size, init_method):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
    errors = {}
    if rank == 0:
        attempts = {
            "send list": lambda: dist.send([1, 2, 3], dst=1),
            "recv str": lambda: dist.recv("abc", src=1),
            "send objects": lambda: dist.send(np.array([object()]), dst=1),
            "recv read-only": lambda: dist.recv(_read_only(), src=1),
        }
        for what, call in attempts.items():
            try:
                call()
            except Exception as e:
                errors[what] = (type(e).__name__, str(e))
    dist.destroy_process_group()
    return errors


def test_what_is_not_a_tensor_is_refused_naming_it(run_ranks):
    errors = run_ranks(bad_arguments, 2)[0]
    assert errors.keys() == {"send list", "recv str", "send objects", "recv read-only"}
    kind, message = errors["send list"]
    assert kind == "TypeError" and "rank 0: send" in message and "builtins.list" in message
    kind, message = errors["recv str"]
    assert kind == "TypeError" and "rank 0: recv" in message and "builtins.str" in message
    kind, message = errors["send objects"]
    assert kind == "TypeError" and "object" in message and "send_object_list" in message
    kind, message = errors["recv read-only"]
    assert kind == "DistError" and "read-only" in message

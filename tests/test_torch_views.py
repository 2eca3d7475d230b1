"""The fast paths' cached numpy views of torch tensors are never stale.

shmdist's send/recv and quick all_reduce take a torch tensor through a numpy
view of it (``fast.paths.array``), kept in a cache keyed by the tensor's
address, shape, strides and dtype (``tensors.numpy_view``) because
``tensor.numpy()`` on every call costs as much as the rest of a small send.
Whatever changes a tensor in place must be seen on the next call, and the
cache must keep no tensor's memory alive.
"""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from shmdist.api import fast  # noqa: E402
from shmdist import tensors  # noqa: E402


def _view(t):
    """What the fast paths get for ``t``, asserted to be a view of ``t``'s own memory now."""
    arr = fast.paths.array(t)
    assert arr is not None
    assert arr.ctypes.data == t.data_ptr() and arr.shape == tuple(t.shape) and arr.dtype.itemsize == \
        t.element_size(), f"a view of {arr.ctypes.data:#x}{arr.shape} for a tensor at {t.data_ptr():#x}{tuple(t.shape)}"
    return arr


def test_the_second_call_is_served_from_the_cache():
    t = torch.zeros(4)
    assert fast.paths.array(t) is fast.paths.array(t)
    _view(t)[2] = 7
    assert t.tolist() == [0, 0, 7, 0]


def test_a_tensor_that_went_through_the_fast_path_can_still_be_resized():
    """t.numpy() would mark its storage not resizable; gloo leaves it resizable."""
    t = torch.zeros(4)
    _view(t)
    t.resize_(1000)
    assert _view(t).shape == (1000,)


def test_in_place_changes_of_a_tensor_are_seen():
    t = torch.zeros(4)
    _view(t), _view(t)
    t.resize_(1000)                       # new memory, new shape
    assert _view(t).shape == (1000,)
    t.resize_(2)                          # same memory, smaller shape
    assert _view(t).shape == (2,)
    other = torch.arange(6, dtype=torch.float32)
    t.set_(other)                         # another tensor's storage
    _view(t)[0] = 42
    assert other[0].item() == 42
    t.set_(other.untyped_storage(), 2, (2,), (1,))   # same storage, an offset
    assert _view(t).tolist() == [2, 3]
    t.as_strided_((2, 2), (2, 1), 0)
    assert _view(t).shape == (2, 2)
    t.data = other.view(torch.int32)      # same address and size, another dtype
    arr = _view(t)
    assert arr.dtype.name == "int32" and arr[0] == other.view(torch.int32)[0].item()
    t.data = other[:3]                    # same address, another shape
    assert _view(t).shape == (3,)


def test_a_new_tensor_at_a_freed_tensors_address_gets_its_own_memory():
    for _ in range(50):                   # the allocator hands the same small block back, often
        a = torch.zeros(8)
        _view(a), _view(a)
        address = a.data_ptr()
        del a
        b = torch.full((8,), 3.0)
        arr = _view(b)
        arr[0] = 9
        assert b[0].item() == 9 and arr.tolist()[1:] == [3.0] * 7, address


def test_a_negative_or_conjugate_view_is_never_served_the_plain_view():
    t = torch.arange(4, dtype=torch.float32)
    _view(t), _view(t)
    negative = torch._neg_view(t)         # same address, shape, strides and dtype; values negated
    assert negative.is_neg() and negative.data_ptr() == t.data_ptr()
    assert fast.paths.array(negative) is None        # the general path resolves the bit
    c = torch.zeros(2, dtype=torch.complex64)
    _view(c), _view(c)
    assert fast.paths.array(c.conj()) is None


def test_the_cache_keeps_no_memory_alive():
    t = torch.zeros(1 << 16)
    _view(t), _view(t)
    gone = weakref.ref(t)
    storage = weakref.ref(t.untyped_storage())
    del t
    gc.collect()
    assert gone() is None and storage() is None
    assert all(not isinstance(getattr(v[-1], "base", None), torch.Tensor) for v in tensors._VIEWS.values())


def test_autograd_and_other_layouts_stay_off_the_fast_path():
    t = torch.zeros(4)
    _view(t), _view(t)
    t.requires_grad_(True)
    assert fast.paths.array(t) is None
    t.requires_grad_(False)
    assert fast.paths.array(t) is not None
    assert fast.paths.array(torch.zeros(4, 4).t()) is None          # not contiguous: the general path
    assert fast.paths.array(torch.zeros(4).to_sparse()) is None


def test_bfloat16_bits_are_served_to_the_reductions_only():
    """all_reduce takes a bfloat16 tensor as a cached view of its uint16 bits,
    of a dtype of its own (tensors.BF16_BITS); send/recv never get that view,
    nor does a uint16 tensor over the same memory pass for bfloat16."""
    t = torch.arange(8, dtype=torch.float32).to(torch.bfloat16)
    bits = fast.paths.array(t, True)
    assert bits is not None and bits.dtype is tensors.BF16_BITS and bits.dtype == np.uint16
    assert bits.ctypes.data == t.data_ptr() and bits.shape == (8,)
    assert fast.paths.array(t, True) is bits                       # from the cache
    assert bits.tolist() == t.clone().view(torch.int16).numpy().view(np.uint16).tolist()
    assert fast.paths.array(t) is None                             # p2p: the general path
    if hasattr(torch, "uint16"):
        u = t.view(torch.uint16)                                   # same address and shape, another dtype
        assert fast.paths.array(u, True).dtype is not tensors.BF16_BITS
        assert fast.paths.array(t, True).dtype is tensors.BF16_BITS
    assert fast.paths.array(torch._neg_view(t), True) is None
    t.resize_(16)
    assert fast.paths.array(t, True).shape == (16,)


def p2p_after_in_place_changes(rank, world_size, init_method):
    import shmdist
    shmdist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    t = torch.zeros(4)
    got = []
    for step in range(6):
        if step == 2:
            t.resize_(16)                  # new memory, 64 bytes
        if step == 4:
            t.set_(torch.zeros(3))         # another storage, 12 bytes
        if rank == 0:
            t.copy_(torch.arange(t.numel(), dtype=torch.float32) + 100 * step)
            shmdist.send(t, 1).wait()
        else:
            shmdist.recv(t, 0).wait()
            got.append(t.tolist())
        shmdist.all_reduce(t)              # the quick all_reduce takes the same view
        if rank == 1:
            got.append(t.tolist())
    shmdist.destroy_process_group()
    return got


def test_send_recv_and_all_reduce_follow_in_place_changes(run_ranks):
    got = run_ranks(p2p_after_in_place_changes, 2, timeout=60)[1]
    for step in range(6):
        n = 4 if step < 2 else 16 if step < 4 else 3
        sent = [float(i + 100 * step) for i in range(n)]
        assert got[2 * step] == sent, f"step {step}: received {got[2 * step]}, sent {sent}"
        assert got[2 * step + 1] == [2 * v for v in sent], f"step {step}: all_reduce gave {got[2 * step + 1]}"

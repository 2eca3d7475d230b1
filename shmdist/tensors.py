"""Turn numpy arrays and torch CPU tensors into (address, size, dtype, shape).

torch is imported only when a torch tensor actually arrives, so that
``import shmdist`` stays light.
"""
from __future__ import annotations

import ctypes
import hashlib
import sys

import numpy as np

from shmdist import _core
from shmdist.errors import DistError


class Buf:
    """One tensor's memory, ready for the core.

    ``obj`` owns the memory (kept alive while ``addr`` is in use);
    ``finish`` copies a temporary back into a non-contiguous receive target.
    """

    __slots__ = ("obj", "addr", "nbytes", "dtype", "shape", "tensor", "finish")

    def __init__(self, obj, addr, nbytes, dtype, shape, tensor, finish=None):
        self.obj = obj
        self.addr = addr
        self.nbytes = nbytes
        self.dtype = dtype
        self.shape = shape
        self.tensor = tensor
        self.finish = finish

    def describe(self) -> str:
        return describe(self.nbytes, self.dtype, self.shape)


def describe(nbytes: int, dtype: str, shape: tuple) -> str:
    dims = ",".join(str(d) for d in shape)
    return f"{nbytes} bytes ({dtype}[{dims}])"


def _torch():
    return sys.modules.get("torch")


def is_torch_tensor(obj) -> bool:
    torch = _torch()
    return torch is not None and isinstance(obj, torch.Tensor)


def torch_dtype_name(dtype) -> str:
    return str(dtype).rpartition(".")[2]


def as_buf(tensor, *, writable: bool, who: str) -> Buf:
    """Describe ``tensor`` for a send (``writable=False``) or a receive.

    Non-contiguous tensors are handled: a send sends a contiguous copy, a
    receive lands in a contiguous temporary copied back on completion.
    ``who`` is the error prefix ("rank 0: send").
    """
    if isinstance(tensor, np.ndarray):
        return _numpy_buf(tensor, writable, who)
    if is_torch_tensor(tensor):
        return _torch_buf(tensor, writable, who)
    raise TypeError(
        f"{who}: expected a numpy.ndarray or a torch.Tensor, got {type(tensor).__module__}."
        f"{type(tensor).__qualname__}; wrap the data first, e.g. numpy.asarray(x)"
    )


_NUMPY_NAMES: dict = {}


DTYPE_NAME_BYTES = 16   # what a message header keeps of a dtype's name


def _numpy_name(dtype: np.dtype, who: str) -> str:
    """The name that identifies a (native byte order) numpy dtype in a message:
    its own name, or for structured dtypes and names too long for a header,
    the start of the name and a digest of the whole layout (fields, their
    order and types), so that two layouts never pass for each other."""
    name = _NUMPY_NAMES.get(dtype)
    if name is None:
        if dtype.hasobject:
            raise TypeError(f"{who}: numpy arrays of dtype {dtype} hold Python objects and cannot be "
                            "sent; use send_object_list / broadcast_object_list for objects")
        name = dtype.name
        if dtype.fields is not None or dtype.subdtype is not None or len(name) > DTYPE_NAME_BYTES:
            digest = hashlib.sha1(str(dtype).encode()).hexdigest()[:8]
            name = f"{name[:DTYPE_NAME_BYTES - 9]}#{digest}"
        _NUMPY_NAMES[dtype] = name
    return name


def _numpy_buf(arr: np.ndarray, writable: bool, who: str) -> Buf:
    if not arr.dtype.isnative:
        # another byte order ('>f4'): move the values, in this host's order
        work = arr.astype(arr.dtype.newbyteorder("="), order="C")   # (C order: the bytes move as C order)
        finish = (lambda: np.copyto(arr, work)) if writable else None
        return Buf(work, work.ctypes.data, work.nbytes, _numpy_name(work.dtype, who), arr.shape, arr, finish)
    dtype = _numpy_name(arr.dtype, who)
    try:
        addr, nbytes = _core.buffer_address(arr, writable)
    except BufferError:
        if writable and not arr.flags.writeable:
            raise DistError(f"{who}: the receive buffer is read-only; pass a writable array "
                            "(numpy.array(x) makes one)") from None
        work = np.ascontiguousarray(arr)        # not C-contiguous: move a contiguous copy
        finish = (lambda: np.copyto(arr, work)) if writable else None
        return Buf(work, work.ctypes.data, work.nbytes, dtype, arr.shape, arr, finish)
    return Buf(arr, addr, nbytes, dtype, arr.shape, arr)


def _torch_buf(t, writable: bool, who: str) -> Buf:
    if t.device.type != "cpu":
        raise DistError(f"{who}: tensor is on {t.device}; shmdist moves CPU tensors only, "
                        "call .cpu() first")
    if t.layout != _torch().strided:
        raise DistError(f"{who}: tensor layout {t.layout} is not supported; send a dense "
                        "tensor (.to_dense())")
    dtype = torch_dtype_name(t.dtype)
    shape = tuple(t.shape)
    if t.requires_grad:
        # as gloo does: a collective writes the values, outside autograd (the result
        # carries no grad_fn of ours, and a leaf may be written in place)
        t = t.detach()
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        if writable and any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
            raise DistError(f"{who}: the tensor to write has elements that share memory (a stride of 0, "
                            f"shape {shape}, strides {tuple(t.stride())}: from expand() or similar), so it "
                            "cannot hold the values; pass a tensor with memory of its own (.clone())")
        # a lazily conjugated or negated view's memory holds the other values: move them resolved
        work = t.resolve_conj().resolve_neg().contiguous()
        finish = (lambda: t.copy_(work)) if writable else None
        return Buf(work, work.data_ptr(), work.numel() * work.element_size(), dtype, shape, t, finish)
    return Buf(t, t.data_ptr(), t.numel() * t.element_size(), dtype, shape, t)



def typed_view(buf: Buf) -> np.ndarray | None:
    """The buffer's memory as a flat numpy array of its element type
    (bfloat16 as its uint16 bits), or None when numpy has no such type."""
    obj = buf.obj
    if isinstance(obj, np.ndarray):
        return obj.reshape(-1)
    torch = _torch()
    flat = obj.reshape(-1)
    # not flat.numpy(): that marks the tensor's storage not resizable (a tensor once all_reduced
    # could not grow, which gloo allows); this view owns nothing, and is used within the call,
    # while buf holds the tensor
    view = _view_of(flat, True, flat.data_ptr())
    if view is not None:
        return view.view(np.uint16) if view.dtype is BF16_BITS else view
    if flat.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy().view(np.uint16)
    try:
        return flat.numpy()
    except (TypeError, RuntimeError):
        return None


# ---------------------------------------------------------------- numpy views of torch tensors, cached

_VIEWS: dict = {}   # data_ptr -> (shape, torch dtype, numpy view of exactly that memory, complex?)
_MAX_VIEWS = 64
_NUMPY_OF: dict = {}   # torch dtype -> numpy dtype, for the dtypes numpy has (bfloat16: BF16_BITS)
_COMPLEX: tuple = ()
_BF16 = None           # torch.bfloat16
# bfloat16 as its uint16 bits: uint16 in everything numpy does, but its own dtype object, so that
# ``view.dtype is BF16_BITS`` tells a bfloat16 tensor's view from a uint16 one's in one compare
BF16_BITS = np.dtype(np.uint16, metadata={"shmdist": "bfloat16"})


def _numpy_dtypes(torch) -> None:
    global _COMPLEX, _BF16
    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                 "uint32", "uint64", "bool", "complex64", "complex128"):
        if hasattr(torch, name):
            _NUMPY_OF[getattr(torch, name)] = np.dtype(name)
    _BF16 = torch.bfloat16
    _NUMPY_OF[_BF16] = BF16_BITS
    _COMPLEX = (torch.complex64, torch.complex128)


def numpy_view(t, bits: bool = False) -> np.ndarray | None:
    """A numpy view of a plain C-contiguous CPU torch tensor's memory (what
    ``t.numpy()`` gives), else None (another device or layout, a conjugate
    or negative bit, a dtype numpy lacks, not contiguous, empty): what the
    fast paths take. ``bits``: a bfloat16 tensor too, as a view of dtype
    BF16_BITS (its uint16 bits; only the reductions, which are told the
    dtype's name, may take it: everywhere else it would pass for uint16).

    The view is made here, not by ``t.numpy()``: that call costs about as
    much as all the rest of an 8-byte send, and it marks the tensor's storage
    as not resizable (torch's rule for memory numpy shares), so a tensor
    once sent could no longer be resized, which gloo does not do. The view
    is kept, under what it is a view of: the address of the first element,
    the shape and the dtype, all read from the tensor on every call, which
    must be C-contiguous (as every kept view's tensor was: the same shape and
    contiguity make the same memory). A tensor changed in place (``set_``,
    ``resize_``, ``as_strided_``, ``.data = ...``) or another tensor has
    another layout unless it has exactly the same memory and layout, and
    then the kept view is exactly right: a view does not own its memory (it
    holds no tensor or storage, so the cache keeps nothing alive) and is
    only handed to a caller that holds a tensor with that memory, for the
    duration of a call (a pending receive, and a send pending as a single
    copy, keeps its tensor). A tensor with the negative (or, complex, the
    conjugate) bit set is never served from the cache."""
    ptr = t.data_ptr()
    kept = _VIEWS.get(ptr)
    if kept is not None:
        dtype = kept[1]
        if dtype is t.dtype and kept[0] == t.shape and t.is_contiguous() and not t.is_neg() \
                and (bits or dtype is not _BF16) and (not kept[3] or not t.is_conj()):
            return kept[2]
    view = _view_of(t, bits, ptr)
    if view is not None:
        if len(_VIEWS) >= _MAX_VIEWS:
            _VIEWS.clear()
        _VIEWS[ptr] = (t.shape, t.dtype, view, t.dtype in _COMPLEX)
    return view


def _view_of(t, bits: bool, ptr: int) -> np.ndarray | None:
    """numpy_view's view, made anew (not cached); it owns nothing either."""
    torch = sys.modules["torch"]
    if not _NUMPY_OF:
        _numpy_dtypes(torch)
    dtype = _NUMPY_OF.get(t.dtype)
    if dtype is None or (dtype is BF16_BITS and not bits) or t.layout is not torch.strided or not t.is_cpu \
            or t.is_neg() or t.is_conj() or not t.is_contiguous() or ptr == 0:
        return None
    nbytes = t.numel() * dtype.itemsize
    if nbytes == 0:
        return None
    return np.ndarray(tuple(t.shape), dtype, buffer=(ctypes.c_char * nbytes).from_address(ptr))

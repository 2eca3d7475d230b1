# Included by _core.pyx (the hub); its classes are declared in _core.pxd.
# The reductions: element kinds of layout.KERNEL_KINDS, ReduceOp codes of layout.OPS.

# ---------------------------------------------------------------- phases

cdef inline int _all_reached(const uint8_t *flags, size_t stride, int n, uint64_t target) noexcept nogil:
    cdef int i
    for i in range(n):
        if sd_load64(<const uint64_t *>(flags + i * stride)) < target:
            return 0
    return 1


cdef enum:
    _GIL_KEPT_BYTES = 16384   # reductions up to this many bytes per row keep the GIL (~0.1 us of work)
KIND_BFLOAT16, KIND_FLOAT16 = SD_KIND_BFLOAT16, SD_KIND_FLOAT16   # float32 sums, one rounding (_half.h)
_BF16_PLAN = (KIND_BFLOAT16, b"bfloat16")
import numpy as _np
_F16 = _np.dtype("float16")


ctypedef fused _num:
    float
    double
    int32_t
    int64_t


cdef void _reduce_parts(_num *out, const size_t *ins, int n, size_t count, int op) noexcept nogil:
    """out = ins[0] op ins[1] op ... (n inputs at any addresses; one input
    is copied), in rank order, as numpy's ufunc.reduce along the first axis
    does, so both give the same bits; ``op`` 0 SUM, 1 PRODUCT, 2 MIN, 3 MAX
    (MIN and MAX for integers only: numpy's NaN rules are its own). Integer
    overflow wraps (-fwrapv), as in numpy. ``out`` must not overlap an input."""
    cdef const _num *a = <const _num *>ins[0]
    cdef const _num *b
    cdef size_t i
    cdef int j
    if n == 1:
        memcpy(out, a, count * sizeof(_num))
    for j in range(1, n):
        b = <const _num *>ins[j]
        if op == SD_OP_SUM:
            for i in range(count):
                out[i] = a[i] + b[i]
        elif op == SD_OP_PRODUCT:
            for i in range(count):
                out[i] = a[i] * b[i]
        elif op == SD_OP_MIN:
            for i in range(count):
                out[i] = b[i] if b[i] < a[i] else a[i]
        else:
            for i in range(count):
                out[i] = b[i] if b[i] > a[i] else a[i]
        a = out


cdef inline size_t _part_start(size_t count, int n, int j) noexcept nogil:
    """Where part j starts when ``count`` elements are split into n parts as
    layout.parts does (the first count % n parts one longer)."""
    cdef size_t base = count // n, rem = count % n
    return j * base + (j if <size_t>j < rem else rem)


def part_start(size_t count, int n, int j):
    """Where the C rounds start part j of ``count`` elements split in n
    (for the test that it is layout.parts)."""
    return _part_start(count, n, j)


cdef void _reduce_parts_kind(int kind, int op, size_t out, const size_t *ins, int n,
                             size_t count) noexcept nogil:
    if kind <= SD_KIND_FLOAT64 and sd_reduce_float(kind == SD_KIND_FLOAT64, op, <void *>out,
                                                   <const void *const *>ins, n, count):
        return
    if kind >= SD_KIND_BFLOAT16:    # bfloat16, float16: SUM, PRODUCT, AVG (the sum divided by n)
        sd_reduce_half(kind == SD_KIND_FLOAT16, op, <uint16_t *>out, <const uint16_t *const *>ins, n, count,
                       <float>n)
    elif kind == SD_KIND_FLOAT32:
        _reduce_parts[float](<float *>out, ins, n, count, op)
    elif kind == SD_KIND_FLOAT64:
        _reduce_parts[double](<double *>out, ins, n, count, op)
    elif kind == SD_KIND_INT32:
        _reduce_parts[int32_t](<int32_t *>out, ins, n, count, op)
    else:
        _reduce_parts[int64_t](<int64_t *>out, ins, n, count, op)


def reduce_rows(int kind, int op, size_t out, size_t first, size_t stride, int n, size_t count):
    """The C reduction of small all_reduce (see _reduce_parts); ``kind`` 0
    float32, 1 float64, 2 int32, 3 int64, 4 bfloat16, 5 float16 (these two:
    see reduce_half)."""
    _reduce_kind(kind, op, out, first, stride, n, count)


cdef int _reduce_kind(int kind, int op, size_t out, size_t first, size_t stride, int n,
                      size_t count) except -1:
    """_reduce_parts of n rows ``stride`` bytes apart from ``first``."""
    cdef size_t[64] near
    cdef size_t *ins = &near[0] if n <= 64 else <size_t *>malloc(n * sizeof(size_t))
    cdef int j
    if ins == NULL:
        raise MemoryError()
    for j in range(n):
        ins[j] = first + j * stride
    if count * sd_kind_itemsize[kind] <= _GIL_KEPT_BYTES:   # letting the GIL go costs more than this
        _reduce_parts_kind(kind, op, out, ins, n, count)
    else:
        with nogil:
            _reduce_parts_kind(kind, op, out, ins, n, count)
    if ins != &near[0]:
        free(ins)
    return 0


def half_level():
    """Which build of the 16-bit reductions this CPU runs: 3 AVX-512 with its
    BF16 or FP16 instructions, 2 AVX-512, 1 AVX2 with F16C, 0 plain C (after
    any cap set_half_limit put)."""
    return sd_half_level()


def set_half_limit(int level):
    """Cap the build half_level() picks (tests run every build this CPU has)."""
    sd_half_set_limit(level)


def reduce_half(out, inputs, int op, str dtype, int count):
    """out = inputs[0] op inputs[1] op ... for bfloat16 (arrays of its uint16
    bits) or float16: each element widened to float32, combined in rank
    order, AVG (op 7) divided by ``count``, rounded once to nearest even,
    NaN kept: bit for bit reduce_ops' numpy path. ``op`` 0 SUM, 1 PRODUCT,
    7 AVG. Returns False, doing nothing, when it does not apply (another
    dtype or op, arrays not C-contiguous or not all of out's size, out not
    writable or overlapping an input other than at the same address)."""
    cdef Py_buffer ov
    cdef Py_buffer iv
    cdef size_t[64] ins
    cdef int n = len(inputs), j, f16
    cdef size_t nbytes, lo, hi, a
    if dtype == "bfloat16":
        f16 = 0
    elif dtype == "float16":
        f16 = 1
    else:
        return False
    if op not in (SD_OP_SUM, SD_OP_PRODUCT, SD_OP_AVG) or n < 1 or n > 64 or count < 1:
        return False
    try:
        PyObject_GetBuffer(out, &ov, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
    except (BufferError, ValueError):
        return False
    try:
        nbytes = ov.len
        if nbytes % 2:
            return False
        lo, hi = <size_t>ov.buf, <size_t>ov.buf + nbytes
        for j in range(n):
            try:
                PyObject_GetBuffer(inputs[j], &iv, PyBUF_C_CONTIGUOUS)
            except (BufferError, ValueError):
                return False
            a = <size_t>iv.buf
            PyBuffer_Release(&iv)
            if <size_t>iv.len != nbytes or (a != lo and a < hi and a + nbytes > lo):
                return False
            ins[j] = a      # the caller keeps the inputs alive for this call
        with nogil:
            sd_reduce_half(f16, op, <uint16_t *>ov.buf, <const uint16_t *const *>&ins[0], n, nbytes // 2,
                           <float>count)
        return True
    finally:
        PyBuffer_Release(&ov)


def reduce_two(int kind, int op, size_t out, size_t first, size_t second, size_t count):
    """out = first op second, element by element (the two members' values in
    rank order), without the GIL; ``out`` may be either input (each element
    is read from both before it is written)."""
    cdef size_t ins[2]
    ins[0], ins[1] = first, second
    with nogil:
        _reduce_parts_kind(kind, op, out, ins, 2, count)

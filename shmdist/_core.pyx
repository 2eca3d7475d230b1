# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The hot path of shmdist: ring buffers in shared memory, doorbells
(futex wait/wake), copies and reductions, all without the GIL.

Everything above this module is plain Python. Addresses are passed as
integers (``size_t``); the Python layers keep the objects that own the
memory alive for as long as an address is in use.
"""
from libc.stdint cimport uint8_t, uint16_t, int32_t, uint32_t, uint64_t, int64_t
from libc.string cimport memcmp, memcpy, memset
from libc.stdlib cimport malloc, free
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE, PyBUF_C_CONTIGUOUS
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from shmdist._core cimport (sd_load64, sd_store64, sd_load32, sd_store32, sd_add32,
                            sd_fence, sd_relax, sd_futex_wait, sd_futex_wake, sd_yield, sd_cma_read,
                            sd_copy_nt, sd_reduce_half, sd_half_level, sd_half_set_limit)

include "_layout.pxi"     # every layout and code shared with Python (generated from layout.py)

cdef enum:
    NOGIL_COPY = 65536  # copies at least this big drop the GIL
    SLICE = 131072      # a ring publishes its index after each slice this big
CTL_BYTES = SD_CTL_BYTES

cdef uint64_t stream_min = 16 << 20


def set_stream_min(uint64_t nbytes):
    """Receive payloads of at least ``nbytes`` with streaming stores (0: never)."""
    global stream_min
    stream_min = nbytes if nbytes else <uint64_t>-1
HEADER_BYTES = SD_HEADER_BYTES
RING_CTL_BYTES = SD_RING_CTL_BYTES


cdef inline uint32_t *_u32(size_t addr) noexcept nogil:
    return <uint32_t *>addr


cdef inline uint64_t _record(uint64_t nbytes) noexcept nogil:
    """Bytes one message of ``nbytes`` payload occupies in a ring (layout.record_bytes)."""
    return SD_HEADER_BYTES + ((nbytes + SD_RECORD_ALIGN - 1) & ~(<uint64_t>(SD_RECORD_ALIGN - 1)))


def buffer_address(obj, bint writable=False):
    """(address, nbytes) of a C-contiguous buffer-protocol object (a numpy array).

    Raises BufferError when the object is not C-contiguous or, with
    ``writable``, read-only.
    """
    cdef Py_buffer view
    cdef int flags = PyBUF_C_CONTIGUOUS | (PyBUF_WRITABLE if writable else 0)
    try:
        PyObject_GetBuffer(obj, &view, flags)
    except ValueError as e:      # numpy says "not C-contiguous" / "read-only" this way
        raise BufferError(str(e)) from None
    try:
        return <size_t>view.buf, <size_t>view.len
    finally:
        PyBuffer_Release(&view)


# ---------------------------------------------------------------- doorbells

CAUSE_BYTES = SD_CAUSE_BYTES


def ctl_set_pid(size_t ctl, uint32_t pid):
    sd_store32(_u32(ctl + SD_CTL_PID), pid)
    memset(<void *>(ctl + SD_CTL_CAUSE), 0, CAUSE_BYTES)
    sd_store32(_u32(ctl + SD_CTL_CLOSED), 0)


def ctl_close(size_t ctl, bytes cause=b""):
    """Mark the owner as gone cleanly, with why it left (UTF-8, at most
    CAUSE_BYTES; "" for a plain destroy). The store that marks it comes
    last, so a peer that sees it closed reads the whole cause."""
    cdef Py_ssize_t n = min(len(cause), CAUSE_BYTES)
    memset(<void *>(ctl + SD_CTL_CAUSE), 0, CAUSE_BYTES)
    memcpy(<void *>(ctl + SD_CTL_CAUSE), PyBytes_AS_STRING(cause), n)
    sd_store32(_u32(ctl + SD_CTL_CLOSED), 1)


def ctl_closed(size_t ctl):
    return sd_load32(_u32(ctl + SD_CTL_CLOSED)) != 0


def ctl_cause(size_t ctl):
    """What the owner wrote as its cause when it closed (b"" if none)."""
    cdef bytes raw = PyBytes_FromStringAndSize(<char *>(ctl + SD_CTL_CAUSE), CAUSE_BYTES)
    return raw.split(b"\0", 1)[0]


cdef inline void _ring_bell(size_t ctl) noexcept nogil:
    sd_add32(_u32(ctl + SD_CTL_BELL), 1)
    if sd_load32(_u32(ctl + SD_CTL_SLEEPING)):
        sd_futex_wake(_u32(ctl + SD_CTL_BELL), 0x7fffffff)


def ring_bell(size_t ctl):
    """Tell the owner of ``ctl`` that something changed; the futex wake
    syscall is made only when the owner sleeps."""
    _ring_bell(ctl)


def bell_value(size_t ctl):
    return sd_load32(_u32(ctl + SD_CTL_BELL))


cdef int _wait_bell(uint32_t *bell, uint32_t *sleeping, uint32_t seen,
                    long spin, long yields, long ns) noexcept nogil:
    cdef long i
    for i in range(spin):
        if sd_load32(bell) != seen:
            return 2
        sd_relax()
    for i in range(yields):
        if sd_load32(bell) != seen:
            return 1
        sd_yield()
    if ns > 0:
        sd_add32(sleeping, 1)
        if sd_load32(bell) == seen:
            sd_futex_wait(bell, seen, ns)
        sd_add32(sleeping, -1)
    return sd_load32(bell) != seen


def wait_bell(size_t ctl, uint32_t seen, long spin, long yields, double timeout):
    """Wait until the doorbell of ``ctl`` differs from ``seen``.

    Spins ``spin`` times (cpu pause), then yields the CPU ``yields`` times,
    then sleeps on the futex for at most ``timeout`` seconds. Returns 2 when
    the bell moved while spinning, 1 when it moved later, 0 on timeout or
    signal (the caller loops and so lets Python run signal handlers).
    """
    cdef int r
    cdef long ns = <long>(timeout * 1e9)
    with nogil:
        r = _wait_bell(_u32(ctl + SD_CTL_BELL), _u32(ctl + SD_CTL_SLEEPING), seen, spin, yields, ns)
    return r


# ---------------------------------------------------------------- copies

cdef inline void _copy(void *dst, const void *src, size_t n) noexcept:
    if n >= NOGIL_COPY:
        with nogil:
            memcpy(dst, src, n)
    else:
        memcpy(dst, src, n)


def copy(size_t dst, size_t src, size_t n):
    """memcpy between two addresses, without the GIL for large copies."""
    _copy(<void *>dst, <const void *>src, n)


def cma_read(int pid, size_t dst, size_t src, size_t n):
    """Copy n bytes from address ``src`` of process ``pid`` (one copy,
    process_vm_readv). Returns bytes read, or -errno."""
    cdef long r
    with nogil:
        r = sd_cma_read(pid, <void *>dst, <const void *>src, n)
    return r


# ---------------------------------------------------------------- rings

cdef class Ring:
    """One single-producer, single-consumer byte ring in shared memory.

    A message is a record: a HEADER_BYTES header, the payload, and padding
    to 64 bytes. The producer publishes ``head`` (bytes written, ever) and
    the consumer ``tail`` (bytes consumed, ever), each on its own cache
    line. Each side rings the other's doorbell after it moved its index.
    One process uses a Ring either as producer or as consumer, never both.
    """
    cdef uint64_t *head
    cdef uint64_t *tail
    cdef uint8_t *data
    cdef uint64_t size
    cdef uint64_t mask
    cdef size_t other_ctl
    cdef uint64_t cached_head   # what the consumer last saw
    cdef uint64_t cached_tail   # what the producer last saw

    def __cinit__(self, size_t ctl_addr, size_t data_addr, uint64_t size, size_t other_ctl):
        if size == 0 or (size & (size - 1)) != 0 or size < SD_RING_MIN_BYTES:
            raise ValueError(f"ring size must be a power of two >= {SD_RING_MIN_BYTES}, got {size}")
        self.head = <uint64_t *>(ctl_addr + SD_RING_HEAD)
        self.tail = <uint64_t *>(ctl_addr + SD_RING_TAIL)
        self.data = <uint8_t *>data_addr
        self.size = size
        self.mask = size - 1
        self.other_ctl = other_ctl
        self.cached_head = sd_load64(self.head)
        self.cached_tail = sd_load64(self.tail)

    cdef inline void _put(self, uint64_t at, const uint8_t *src, size_t n) noexcept nogil:
        cdef uint64_t off = at & self.mask
        cdef uint64_t first = self.size - off
        if first >= n:
            memcpy(self.data + off, src, n)
        else:
            memcpy(self.data + off, src, first)
            memcpy(self.data, src + first, n - first)

    cdef inline void _get(self, uint64_t at, uint8_t *dst, size_t n, bint stream=False) noexcept nogil:
        cdef uint64_t off = at & self.mask
        cdef uint64_t first = self.size - off
        if stream:
            if first >= n:
                sd_copy_nt(dst, self.data + off, n)
            else:
                sd_copy_nt(dst, self.data + off, first)
                sd_copy_nt(dst + first, self.data, n - first)
        elif first >= n:
            memcpy(dst, self.data + off, n)
        else:
            memcpy(dst, self.data + off, first)
            memcpy(dst + first, self.data, n - first)

    cdef uint64_t _push(self, const uint8_t *hdr, const uint8_t *src, uint64_t nbytes,
                        uint64_t pos, uint64_t total) noexcept nogil:
        cdef uint64_t h = sd_load64(self.head)
        cdef uint64_t free, end, upto
        while pos < total:
            free = self.size - (h - self.cached_tail)
            if free < SLICE and free < total - pos:
                self.cached_tail = sd_load64(self.tail)
                free = self.size - (h - self.cached_tail)
                if free == 0:
                    break
            end = pos + min(free, SLICE, total - pos)
            if pos < SD_HEADER_BYTES:
                upto = min(end, <uint64_t>SD_HEADER_BYTES)
                self._put(h, hdr + pos, upto - pos)
                h += upto - pos
                pos = upto
            if pos < end and pos < SD_HEADER_BYTES + nbytes:
                upto = min(end, SD_HEADER_BYTES + nbytes)
                self._put(h, src + pos - SD_HEADER_BYTES, upto - pos)
                h += upto - pos
                pos = upto
            h += end - pos          # padding: nothing to copy
            pos = end
            sd_store64(self.head, h)   # publish each slice: the consumer copies it meanwhile
            _ring_bell(self.other_ctl)
        return pos

    cdef uint64_t _pull(self, uint8_t *dst, uint64_t nbytes, uint64_t pos,
                        uint64_t total) noexcept nogil:
        cdef uint64_t t = sd_load64(self.tail)
        cdef uint64_t avail, end, upto
        while pos < total:
            avail = self.cached_head - t
            if avail < SLICE and avail < total - pos:
                self.cached_head = sd_load64(self.head)
                avail = self.cached_head - t
                if avail == 0:
                    break
            end = pos + min(avail, SLICE, total - pos)
            if pos < SD_HEADER_BYTES:          # the header itself, already read by peek
                upto = min(end, <uint64_t>SD_HEADER_BYTES)
                t += upto - pos
                pos = upto
            if pos < end and pos < SD_HEADER_BYTES + nbytes:
                upto = min(end, SD_HEADER_BYTES + nbytes)
                if dst != NULL:
                    self._get(t, dst + pos - SD_HEADER_BYTES, upto - pos, nbytes >= stream_min)
                t += upto - pos
                pos = upto
            t += end - pos
            pos = end
            sd_store64(self.tail, t)   # hand each slice back to the producer at once
            _ring_bell(self.other_ctl)
        return pos

    def push(self, bytes header, size_t addr, size_t nbytes, size_t pos):
        """Write what fits of one record, from record offset ``pos``.

        The record is ``header`` (HEADER_BYTES), ``nbytes`` of payload at
        ``addr``, then padding to 64 bytes. Copies in slices, publishing
        each, for as long as the consumer makes room. Returns the new
        offset; the record is complete when it equals ``record_bytes(nbytes)``.
        """
        cdef uint64_t total = _record(nbytes)
        cdef const uint8_t *hdr = <const uint8_t *>PyBytes_AS_STRING(header)
        cdef const uint8_t *src = <const uint8_t *>addr
        cdef uint64_t p = pos
        if total - p < NOGIL_COPY:
            return self._push(hdr, src, nbytes, p, total)
        with nogil:
            p = self._push(hdr, src, nbytes, p, total)
        return p

    def take(self, int64_t tag, int64_t gid, size_t addr, uint64_t nbytes, bytes dtype16):
        """Receive the next record in one call when it is complete and its
        header says (tag, group, byte count, dtype): copy the payload to
        ``addr`` and return 1. Return 0 when no complete record is there,
        -1 when the next record is another one (the caller then reads the
        header itself). Header layout: layout.HEADER."""
        return self._take(tag, gid, addr, nbytes, PyBytes_AS_STRING(dtype16))

    cdef int _take(self, int64_t tag, int64_t gid, size_t addr, uint64_t nbytes, const char *dtype16):
        cdef uint64_t t = sd_load64(self.tail)
        cdef uint64_t total = _record(nbytes)
        cdef uint8_t hdr[SD_HEADER_BYTES]
        cdef int64_t htag, hgid
        cdef uint64_t hbytes
        if self.cached_head - t < total:
            self.cached_head = sd_load64(self.head)
            if self.cached_head - t < total:
                return 0
        self._get(t, hdr, SD_HEADER_BYTES)
        memcpy(&htag, hdr + SD_HDR_TAG, 8)
        memcpy(&hgid, hdr + SD_HDR_GID, 8)
        memcpy(&hbytes, hdr + SD_HDR_NBYTES, 8)
        if htag != tag or hgid != gid or hbytes != nbytes or memcmp(hdr + SD_HDR_DTYPE, dtype16, SD_DTYPE_BYTES):
            return -1
        if nbytes < NOGIL_COPY:
            self._get(t + SD_HEADER_BYTES, <uint8_t *>addr, nbytes)
        else:
            with nogil:
                self._get(t + SD_HEADER_BYTES, <uint8_t *>addr, nbytes, nbytes >= stream_min)
        sd_store64(self.tail, t + total)
        _ring_bell(self.other_ctl)
        return 1

    def peek(self):
        """The next record's header, or None when it has not arrived."""
        cdef uint64_t t = sd_load64(self.tail)
        if self.cached_head - t < SD_HEADER_BYTES:
            self.cached_head = sd_load64(self.head)
            if self.cached_head - t < SD_HEADER_BYTES:
                return None
        out = PyBytes_FromStringAndSize(NULL, SD_HEADER_BYTES)
        self._get(t, <uint8_t *>PyBytes_AS_STRING(out), SD_HEADER_BYTES)
        return out

    def pull(self, size_t addr, size_t nbytes, size_t pos):
        """Consume what has arrived of the record whose header was peeked.

        ``pos`` is the record offset reached so far (0 right after peek).
        Copies the payload into ``addr`` (0 discards it), slice by slice
        for as long as the producer keeps writing, and returns the new
        offset; complete at ``record_bytes(nbytes)``.
        """
        cdef uint64_t total = _record(nbytes)
        cdef uint8_t *dst = <uint8_t *>addr
        cdef uint64_t p = pos
        if total - p < NOGIL_COPY:
            return self._pull(dst, nbytes, p, total)
        with nogil:
            p = self._pull(dst, nbytes, p, total)
        return p


def record_bytes(size_t nbytes):
    """Bytes one message of ``nbytes`` payload occupies in a ring."""
    return _record(nbytes)


# ---------------------------------------------------------------- phases

cdef inline int _all_reached(const uint8_t *flags, size_t stride, int n, uint64_t target) noexcept nogil:
    cdef int i
    for i in range(n):
        if sd_load64(<const uint64_t *>(flags + i * stride)) < target:
            return 0
    return 1


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
    with nogil:
        _reduce_parts_kind(kind, op, out, ins, n, count)
    if ins != &near[0]:
        free(ins)
    return 0


def half_level():
    """Which build of the 16-bit reductions this CPU runs: 2 AVX-512, 1 AVX2
    with F16C, 0 plain C (after any cap set_half_limit put)."""
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


def wait_phase(size_t flags, size_t stride, int n, uint64_t target, size_t ctl,
               long spin, long yields, double timeout):
    """Wait until each of the ``n`` phase flags (``stride`` bytes apart from
    ``flags``) is at least ``target``. Spins, yields, then sleeps on this
    process's doorbell for at most ``timeout`` seconds. True when reached."""
    cdef const uint8_t *f = <const uint8_t *>flags
    cdef uint32_t *bell = _u32(ctl + SD_CTL_BELL)
    cdef uint32_t *sleeping = _u32(ctl + SD_CTL_SLEEPING)
    cdef long i
    cdef long ns = <long>(timeout * 1e9)
    cdef uint32_t seen
    cdef int done = 0
    with nogil:
        for i in range(spin):
            if _all_reached(f, stride, n, target):
                done = 2
                break
            sd_relax()
        if not done:
            for i in range(yields):
                if _all_reached(f, stride, n, target):
                    done = 1
                    break
                sd_yield()
        if not done and ns > 0:
            sd_add32(sleeping, 1)
            seen = sd_load32(bell)
            if not _all_reached(f, stride, n, target):
                sd_futex_wait(bell, seen, ns)
            sd_add32(sleeping, -1)
        if not done:
            done = _all_reached(f, stride, n, target)
    return done


def all_same(size_t first, size_t stride, int n, size_t nbytes):
    """True when the ``n`` records of ``nbytes``, ``stride`` apart from
    ``first``, are byte for byte the same."""
    cdef int i
    for i in range(1, n):
        if memcmp(<const void *>first, <const void *>(first + i * stride), nbytes):
            return False
    return True


def load_u64(size_t addr):
    return sd_load64(<const uint64_t *>addr)


cdef class Backoff:
    """How long a waiter spins before it sleeps, adapted to what worked.

    Spinning pays when the peer answers within microseconds (a futex wake
    costs ~40 us when the other core idles); it steals the peer's core when
    the host is busy. So: spin up to ``most`` pauses (~12 ns each here),
    halve the spin each time it ended in a sleep (down to ``least``) and
    double it each time it caught the event. With more local ranks than
    cores, never spin: yield ``yields`` times, then sleep.
    """
    cdef public long spin, yields, most, least

    def __init__(self, long most, long yields):
        self.most = most
        self.least = min(most, 256)    # ~3 us: never 0, or spinning could never prove itself again
        self.spin = most
        self.yields = yields

    cpdef update(self, int how):
        """``how``: 2 caught while spinning, 1 after that, 0 not at all."""
        if how == 2:
            self.spin = min(self.most, self.spin * 2 + 16)
        elif how == 1:
            self.spin = max(self.least, self.spin // 2)


# ---------------------------------------------------------------- requests

cdef class DistributedRequest:
    """A pending operation. ``wait()`` blocks until it finished and returns
    True, or raises the error that ended it (a DistError subclass);
    ``is_completed()`` checks without blocking. Receives carry ``source``,
    the global rank of the sender, once complete."""
    cdef public object _engine
    cdef public bint _done
    cdef public object _error
    cdef public object op
    cdef public object source
    cdef public object _then
    cdef public object tensors
    cdef public object _peers
    cdef public object _lane      # the Lane while this is its pending fast receive

    def __init__(self, engine, op, tensors=None):
        self._engine = engine
        self.op = op
        self.tensors = tensors
        self._peers = ()

    def wait(self, timeout=None):
        if not self._done:
            if self._lane is not None:      # first a spin on the ring it waits for, from here
                lane, self._lane = self._lane, None
                lane.wait_pending(self, -1)
            if not self._done:
                self._engine.wait_for(self, timeout)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self):
        if not self._done:
            self._engine.poll()
        return self._done

    def exception(self):
        return self._error

    def result(self):
        """The tensors the operation produced (as torch's Work.result())."""
        self.wait()
        return self.tensors

    cpdef _complete(self, error=None):
        if self._done:
            return
        self._error = error
        self._done = True
        then, self._then = self._then, None
        if then is not None:
            then(self)

    def __repr__(self):
        state = "failed" if self._error is not None else ("completed" if self._done else "pending")
        return f"<DistributedRequest {self.op} {state}>"


# ---------------------------------------------------------------- the fast lane

cdef extern from "Python.h":
    int PyLong_Check(object o)
    long PyLong_AsLong(object o) except? -1
    long long PyLong_AsLongLongAndOverflow(object o, int *overflow) except? -1



cdef enum:
    MAX_PENDING = 1024     # pending fast receives at most; more go the general way


cdef class _Pend:
    """A pending fast receive: where its message goes and what it must be."""
    cdef DistributedRequest req
    cdef Ring ring
    cdef object arr
    cdef int src
    cdef int64_t tag
    cdef size_t addr
    cdef uint64_t nbytes
    cdef bytes dtype16


cdef class Lane:
    """The whole of a small send or receive between two local ranks in one
    call, for the common case: a C-contiguous numpy array, the default
    group, an int tag, nothing else pending that it would have to queue
    behind. Anything else returns None and goes the general way (engine.py),
    which also raises the errors. The engine's lock is held while a ring
    is touched, as the engine itself does.

    A receive whose message has not arrived yet is kept here as the one
    *pending* fast receive rather than posted; the engine posts it
    (``settle``) before it matches anything else, so the order of receives
    is the order they were posted. ``wait()`` on it spins on its ring alone.
    """
    cdef int rank
    cdef list outs, ins
    cdef list send_ops, recv_ops
    cdef public dict dtypes      # numpy dtype -> its 16-byte header field, filled by the general path
    cdef object acquire, release
    cdef dict sendq, rx
    cdef list posted, unexpected
    cdef object engine
    cdef object peers            # (src,) tuples, per rank
    cdef list pend               # the pending fast receives (_Pend), in posting order
    cdef public unsigned long long sends, recvs   # operations the lane took whole
    cdef int64_t a_tag
    cdef bytes a_dtype16
    cdef Backoff backoff

    def __cinit__(self, engine, int rank, int size, dict outs, dict ins):
        self.engine = engine
        self.backoff = engine.backoff
        self.rank = rank
        self.outs = [outs.get(r) if isinstance(outs.get(r), Ring) else None for r in range(size)]
        self.ins = [ins.get(r) if isinstance(ins.get(r), Ring) else None for r in range(size)]
        self.send_ops = [f"send to rank {r}" for r in range(size)]
        self.recv_ops = [f"recv from rank {r}" for r in range(size)]
        self.peers = [(r,) for r in range(size)]
        self.dtypes = {}
        self.acquire = engine.lock.acquire
        self.release = engine.lock.release
        self.sendq = engine.sendq
        self.rx = engine.rx
        self.posted = engine.posted
        self.unexpected = engine.unexpected
        self.pend = []

    @property
    def pending(self):
        """The first pending fast receive's request, or None; setting None
        forgets them all (the engine's close fails them first)."""
        return (<_Pend>self.pend[0]).req if self.pend else None

    @pending.setter
    def pending(self, value):
        if value is not None:
            raise ValueError("Lane.pending can only be cleared")
        self.pend = []

    def pending_requests(self):
        """The requests of every pending fast receive, in posting order."""
        return [(<_Pend>p).req for p in self.pend]

    def holds(self, req):
        """True when ``req`` is one of the pending fast receives."""
        cdef _Pend p
        for p in self.pend:
            if p.req is req:
                return True
        return False

    cdef int _header(self, uint8_t *hdr, Py_buffer *view, int64_t tag, bytes dtype16) except -1:
        cdef int i
        cdef int64_t zero = 0, d
        cdef int32_t src = self.rank
        cdef uint64_t nbytes = view.len
        cdef uint32_t magic = SD_MAGIC
        cdef uint16_t version = SD_VERSION, ndim = <uint16_t>view.ndim
        memset(hdr, 0, SD_HEADER_BYTES)
        memcpy(hdr + SD_HDR_MAGIC, &magic, 4)
        memcpy(hdr + SD_HDR_VERSION, &version, 2)
        memcpy(hdr + SD_HDR_NDIM, &ndim, 2)
        memcpy(hdr + SD_HDR_TAG, &tag, 8)
        memcpy(hdr + SD_HDR_GID, &zero, 8)
        memcpy(hdr + SD_HDR_SRC, &src, 4)
        memcpy(hdr + SD_HDR_NBYTES, &nbytes, 8)
        memcpy(hdr + SD_HDR_DTYPE, PyBytes_AS_STRING(dtype16), SD_DTYPE_BYTES)
        for i in range(view.ndim):
            d = view.shape[i]
            memcpy(hdr + SD_HDR_DIMS + 8 * i, &d, 8)
        return 0

    cdef Ring _args(self, arr, peer, tag, list chans):
        """The ring when (peer, tag, dtype) suit the fast lane, else None;
        the tag and dtype field are left in a_tag and a_dtype16 (read them
        at once: the GIL may pass to another thread later)."""
        cdef int overflow = 0
        cdef long long p, t
        if not PyLong_Check(peer) or not PyLong_Check(tag) or isinstance(peer, bool):
            return None
        p = PyLong_AsLongLongAndOverflow(peer, &overflow)
        if overflow or p < 0 or p >= len(chans):
            return None
        t = PyLong_AsLongLongAndOverflow(tag, &overflow)
        if overflow or isinstance(tag, bool):
            return None
        r = chans[p]
        if r is None:
            return None
        d = self.dtypes.get(arr.dtype)
        if d is None:
            return None
        self.a_tag = t
        self.a_dtype16 = <bytes>d
        return <Ring>r

    def send(self, arr, dst, tag):
        """The completed request of a send written whole into its ring now, or None."""
        cdef Ring ring = None
        cdef int64_t t
        cdef bytes dtype16 = None
        cdef Py_buffer view
        cdef uint8_t hdr[SD_HEADER_BYTES]
        cdef uint64_t total, free, h
        cdef DistributedRequest req
        ring = self._args(arr, dst, tag, self.outs)
        if ring is None:
            return None
        t, dtype16 = self.a_tag, self.a_dtype16
        try:
            PyObject_GetBuffer(arr, &view, PyBUF_C_CONTIGUOUS)
        except (BufferError, ValueError):
            return None         # not contiguous: the general path sends a contiguous copy
        try:
            if view.ndim > SD_MAX_DIMS:
                return None
            total = _record(<uint64_t>view.len)
            if total > ring.size:
                return None
            self._header(hdr, &view, t, dtype16)
            self.acquire()
            try:
                if self.sendq:
                    return None
                h = sd_load64(ring.head)
                free = ring.size - (h - ring.cached_tail)
                if free < total:
                    ring.cached_tail = sd_load64(ring.tail)
                    free = ring.size - (h - ring.cached_tail)
                    if free < total:
                        return None
                if view.len < NOGIL_COPY:
                    ring._push(hdr, <const uint8_t *>view.buf, view.len, 0, total)
                else:
                    with nogil:
                        ring._push(hdr, <const uint8_t *>view.buf, view.len, 0, total)
            finally:
                self.release()
        finally:
            PyBuffer_Release(&view)
        self.sends += 1
        req = DistributedRequest.__new__(DistributedRequest)
        req._engine = self.engine
        req.op = self.send_ops[dst]
        req._peers = self.peers[dst]
        req._done = True
        return req

    def recv(self, arr, src, tag):
        """The request of a receive from ``src``: completed when its message
        was already there (and no earlier pending receive from ``src`` waits
        for one), else a pending fast receive, queued behind the others;
        None when the general path must take it."""
        cdef Ring ring = None
        cdef int64_t t
        cdef bytes dtype16 = None
        cdef Py_buffer view
        cdef uint64_t total
        cdef size_t addr
        cdef int got, isrc
        cdef _Pend p
        cdef DistributedRequest req
        if len(self.pend) >= MAX_PENDING:
            return None
        ring = self._args(arr, src, tag, self.ins)
        if ring is None:
            return None
        t, dtype16 = self.a_tag, self.a_dtype16
        try:
            PyObject_GetBuffer(arr, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        except (BufferError, ValueError):
            return None         # read-only or not contiguous: the general path says or handles it
        addr, total = <size_t>view.buf, _record(<uint64_t>view.len)
        nbytes = view.len
        PyBuffer_Release(&view)
        if total > SLICE:       # bigger ones are copied out slice by slice as they arrive
            return None
        isrc = src
        req = DistributedRequest.__new__(DistributedRequest)
        req._engine = self.engine
        req.op = self.recv_ops[isrc]
        req._peers = self.peers[isrc]
        req.tensors = [arr]
        self.acquire()
        try:
            if self.posted or self.unexpected or self.rx[isrc] is not None:
                return None
            ahead = False
            for p in self.pend:
                if p.src == isrc:
                    ahead = True
                    break
            if not ahead:       # the next record from src is this receive's
                got = ring._take(t, 0, addr, nbytes, PyBytes_AS_STRING(dtype16))
                if got < 0:
                    return None     # another record first: the general path (after the pending ones)
                if got > 0:
                    self.recvs += 1
                    req.source = src
                    req._done = True
                    return req
            self.recvs += 1
            p = _Pend.__new__(_Pend)
            p.req, p.ring, p.arr, p.src, p.tag = req, ring, arr, isrc, t
            p.addr, p.nbytes, p.dtype16 = addr, nbytes, dtype16
            self.pend.append(p)
            req._lane = self
        finally:
            self.release()
        return req

    def settle(self):
        """Post every pending fast receive to the engine, in posting order (lock held)."""
        cdef _Pend p
        if self.pend:
            pend, self.pend = self.pend, []
            for p in pend:
                p.req._lane = None
                self.engine.post_recv(p.req, p.arr, p.src, p.tag)

    def progress_pending(self):
        """For the engine's progress (lock held): complete the pending fast
        receives whose records are there. Returns the sources the ones
        still pending wait on, whose rings the engine must leave alone; or
        None after posting them all to the engine, when a record is not the
        one expected or is there only in part (the engine streams those)."""
        cdef _Pend p
        cdef set srcs
        if self._drain(None) < 0:
            return None
        if not self.pend:
            return None
        srcs = set()
        for p in self.pend:
            if p.src not in srcs:
                srcs.add(p.src)
                if sd_load64(p.ring.head) != sd_load64(p.ring.tail):
                    self.settle()           # a record is coming in part: the general path streams it
                    return None
        return srcs

    cdef int _drain(self, DistributedRequest req) except -2:
        """Complete, in posting order, the pending receives whose records
        are there (lock held). 1 when ``req`` is done, 0 when not yet, -1
        when a record is not the one its receive expects: every pending
        receive went to the engine, which says so or matches it elsewhere."""
        cdef _Pend p
        cdef int got
        cdef Py_ssize_t i = 0
        cdef uint64_t blocked = 0      # sources (< 64) with an earlier receive still waiting
        cdef bint any_blocked = False
        while i < len(self.pend):
            p = <_Pend>self.pend[i]
            if (p.src < 64 and (blocked >> p.src) & 1) or (p.src >= 64 and any_blocked):
                i += 1
                continue
            got = p.ring._take(p.tag, 0, p.addr, p.nbytes, PyBytes_AS_STRING(p.dtype16))
            if got < 0:
                self.settle()
                return -1
            if got == 0:
                if p.src < 64:
                    blocked |= (<uint64_t>1) << p.src
                else:
                    any_blocked = True
                i += 1
                continue
            del self.pend[i]
            p.req._lane = None
            p.req.source = p.src
            p.req._complete()
            if p.req is req:
                return 1
        return 1 if req is not None and req._done else 0

    def wait_pending(self, DistributedRequest req, long spin):
        """Spin up to ``spin`` pauses (-1: as the engine's backoff says) for
        ``req``, a pending fast receive, on its ring alone while nothing
        else is pending, completing the pending receives ahead of it as
        their records come. True when it completed; else every pending
        receive is posted to the engine, which waits for it."""
        cdef _Pend p, mine, first = None
        cdef uint64_t total, t
        cdef long i
        cdef int how
        if req._done:
            return True
        if spin < 0:
            spin = self.backoff.spin
        self.acquire()
        try:
            if not self.holds(req):
                return req._done
            how = self._drain(req)
            if how != 0:
                return how > 0
            mine = <_Pend>self._find(req)
            for p in self.pend:         # the first receive from req's source waits for the ring's next record
                if p.src == mine.src:
                    first = p
                    break
        finally:
            self.release()
        if not self.sendq:
            total = _record(first.nbytes)
            t = sd_load64(first.ring.tail)
            with nogil:
                for i in range(spin):
                    if sd_load64(first.ring.head) - t >= total:
                        break
                    sd_relax()
        self.acquire()
        try:
            if not self.holds(req):
                return req._done
            how = self._drain(req)
            if how != 0:
                return how > 0
            self.settle()
        finally:
            self.release()
        return False

    cdef object _find(self, DistributedRequest req):
        cdef _Pend p
        for p in self.pend:
            if p.req is req:
                return p
        return None


# ---------------------------------------------------------------- waiting policy and collective phases

cdef class Phaser:
    """The phases of one group's arena, as seen by one member: its counters
    (``phase``: phases entered; ``calls``: collectives started), entering a
    phase in one call, and the whole of a barrier or a small all_reduce when
    the other members are already there.

    Control slot of member i at ``flags + i * stride``: its phase (u64) at 0
    and the descriptors of its last two calls at 64 and 128. Data buffers:
    member i's buffer of parity b at ``bufs + (2 i + b) * slot``.
    """
    cdef public uint64_t phase, calls
    cdef public object broken            # why the group is unusable, or None
    cdef size_t flags, stride, bell, bufs, slot
    cdef int n, me
    cdef object others_ref
    cdef const uint64_t *others
    cdef Py_ssize_t nothers
    cdef Backoff backoff
    cdef object acquire, release
    cdef bytes barrier_desc
    cdef dict kinds                      # numpy dtype -> (reduce_rows kind, its name) for all_reduce
    cdef uint64_t all_reduce_index

    def __cinit__(self, size_t flags, size_t stride, int n, int me, others, size_t bell,
                  Backoff backoff, lock, bytes barrier_desc, size_t bufs, size_t slot,
                  dict kinds, uint64_t all_reduce_index):
        cdef const uint64_t[::1] view = others
        self.flags, self.stride, self.n, self.me, self.bell = flags, stride, n, me, bell
        self.others_ref = others        # keeps the addresses alive
        self.others = &view[0] if view.shape[0] else NULL
        self.nothers = view.shape[0]
        self.backoff = backoff
        self.acquire, self.release = lock.acquire, lock.release
        self.barrier_desc = barrier_desc
        self.bufs, self.slot = bufs, slot
        self.kinds, self.all_reduce_index = dict(kinds), all_reduce_index
        self.kinds.setdefault(_F16, (KIND_FLOAT16, b"float16"))
        self.broken = None

    @property
    def desc_at(self):
        """Offset in a control slot of the descriptor of the last call."""
        return SD_SLOT_DESC + SD_DESC_BYTES * ((self.calls - 1) % 2)

    cdef int _enter(self, const char *desc, size_t nd) except -2:
        cdef uint8_t *mine = <uint8_t *>(self.flags + self.me * self.stride)
        cdef const uint8_t *f = <const uint8_t *>self.flags
        cdef size_t at = 0
        cdef Py_ssize_t i
        cdef long k, spin = self.backoff.spin, yields = self.backoff.yields
        cdef int done = 0, n = self.n
        cdef uint64_t target
        if desc != NULL:
            at = SD_SLOT_DESC + SD_DESC_BYTES * (self.calls % 2)
            self.calls += 1
            memcpy(mine + at, desc, nd)
        self.phase += 1
        target = self.phase
        sd_store64(<uint64_t *>mine, target)
        sd_fence()
        for i in range(self.nothers):
            if sd_load32(_u32(<size_t>self.others[i] + SD_CTL_SLEEPING)):
                sd_add32(_u32(<size_t>self.others[i] + SD_CTL_BELL), 1)
                sd_futex_wake(_u32(<size_t>self.others[i] + SD_CTL_BELL), 0x7fffffff)
        with nogil:
            for k in range(spin):
                if _all_reached(f, self.stride, n, target):
                    done = 2
                    break
                sd_relax()
            if not done:
                for k in range(yields):
                    if _all_reached(f, self.stride, n, target):
                        done = 1
                        break
                    sd_yield()
        if done != 2 or self.backoff.spin < self.backoff.most:
            self.backoff.update(done or 1)    # not caught while spinning: spin less next time
        if done and nd:
            for i in range(1, n):
                if memcmp(f + at, f + i * self.stride + at, nd):
                    return -1
        return done

    def enter(self, bytes desc=None):
        """Enter the next phase (publishing ``desc``, this call's descriptor,
        first when given), spin and yield for the others. 2 or 1: every
        member is there; -1: they are, but their descriptors differ; 0: not
        yet (the caller sleeps, then compares)."""
        if desc is None:
            return self._enter(NULL, 0)
        return self._enter(PyBytes_AS_STRING(desc), len(desc))

    cdef int _call(self, const char *desc, size_t nd, void *data, size_t nbytes, int kind,
                   int op) except -4:
        """One collective call of a single phase under the group's lock: the
        data (if any) into this member's buffer, the phase, and once every
        member is there the reduction of all buffers into ``data``. 2 or 1
        when done; -2 when the group is broken (nothing done); 0 (not passed
        yet) and -1 (the calls differ) leave the lock held."""
        cdef int how
        cdef size_t parity
        self.acquire()
        if self.broken is not None:
            self.release()
            return -2
        try:
            parity = self.phase % 2
            if data != NULL:
                memcpy(<void *>(self.bufs + (2 * self.me + parity) * self.slot), data, nbytes)
            how = self._enter(desc, nd)
            if how > 0 and data != NULL:
                _reduce_kind(kind, op, <size_t>data, self.bufs + parity * self.slot, 2 * self.slot,
                             self.n, nbytes // sd_kind_itemsize[kind])
        except BaseException:
            self.release()
            raise
        if how > 0:
            self.release()
        return how

    def barrier(self):
        """A whole barrier: 2 or 1 when passed; -2, 0 and -1 as for _call."""
        return self._call(PyBytes_AS_STRING(self.barrier_desc), len(self.barrier_desc), NULL, 0, 0, 0)

    cpdef object plan(self, dtype, op, name=None):
        """(reduce_parts kind, op code, dtype name) when the C reduction
        takes ``dtype`` and ReduceOp ``op``, else None (other dtypes, AVG and
        bitwise ops, and MIN/MAX of floats, whose NaN rules are numpy's).
        ``name``: the buffer's dtype name when numpy's differs from it
        ("bfloat16" travels as uint16 arrays)."""
        plan = _BF16_PLAN if name == "bfloat16" else self.kinds.get(dtype)
        if plan is None or not PyLong_Check(op):
            return None
        kind, name = plan
        code = PyLong_AsLong(op)
        if kind >= SD_KIND_BFLOAT16:       # the 16-bit floats: SUM, PRODUCT, AVG
            return (kind, code, name) if code in (SD_OP_SUM, SD_OP_PRODUCT, SD_OP_AVG) else None
        if code < SD_OP_SUM or code > SD_OP_MAX or (code >= SD_OP_MIN and kind <= SD_KIND_FLOAT64):
            return None
        return kind, code, name

    def all_reduce(self, arr, op, size_t most, dtype_name=None):
        """A whole small all_reduce of a C-contiguous writable numpy array of
        a dtype in ``kinds`` with ReduceOp ``op`` (0 SUM, 1 PRODUCT; 2 MIN and
        3 MAX for integers), reduced in C (see reduce_rows): 2 or 1 when
        done. -3: it does not qualify (or is over ``most`` bytes), nothing
        done; -2, 0 and -1 as for _call, the data already in place: the
        caller finishes with reduce_rows on buffers of parity (phase - 1) % 2.
        The descriptor is the one layout.pack_desc packs for it.
        ``dtype_name``: "bfloat16" for a uint16 array of bfloat16 bits."""
        cdef Py_buffer view
        cdef long code
        cdef int kind
        cdef uint64_t desc[SD_DESC_WORDS]
        cdef bytes name
        plan = self.plan(arr.dtype, op, dtype_name)
        if plan is None:
            return -3
        kind, code, name = plan
        try:
            PyObject_GetBuffer(arr, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        except (BufferError, ValueError):
            return -3
        try:
            if <size_t>view.len > most:
                return -3
            memset(desc, 0, sizeof(desc))      # layout.DESC: 0, kind, bytes, op, root, dtype, extra
            desc[SD_DESC_KIND // 8] = self.all_reduce_index
            desc[SD_DESC_NBYTES // 8] = view.len
            desc[SD_DESC_OP // 8] = <uint64_t>code
            desc[SD_DESC_ROOT // 8] = <uint64_t>(<int64_t>-1)
            memcpy(<char *>desc + SD_DESC_DTYPE, PyBytes_AS_STRING(name), min(<size_t>len(name), SD_DTYPE_BYTES))
            return self._call(<const char *>desc, sizeof(desc), view.buf, view.len, kind, code)
        finally:
            PyBuffer_Release(&view)

    def all_reduce_rounds(self, size_t addr, size_t count, int kind, int op, size_t per_round,
                          bint keep, size_t r, bint resume, bytes desc):
        """Rounds ``r``.. of a large all_reduce (or reduce) of the ``count``
        elements at ``addr``, in C: what GroupComm.all_reduce's loop does,
        with the reduction of reduce_rows. Round r copies the others' parts
        of chunk r into this member's buffer, passes a phase (the first one
        with ``desc``), copies the reduced parts of chunk r-1 out (when
        ``keep``: every rank of an all_reduce, the root of a reduce) and
        reduces this member's part of chunk r into its other buffer (and,
        when ``keep``, straight into the data). -1: done. -2: the first
        phase passed and the descriptors differ. Otherwise the round whose
        phase this member entered but the others have not: the caller waits
        for them and calls again from that round with ``resume``."""
        cdef size_t isz = sd_kind_itemsize[kind]
        cdef size_t rounds = (count + per_round - 1) // per_round
        cdef int n = self.n, me = self.me, j, how
        cdef size_t lo, plo, chunk, s, length, b, out
        cdef size_t *ins = <size_t *>malloc(n * sizeof(size_t))
        if ins == NULL:
            raise MemoryError()
        try:
            while r <= rounds:
                if not resume:
                    b = self.phase % 2
                    if r < rounds:
                        lo = r * per_round
                        chunk = min(per_round, count - lo)
                        with nogil:
                            for j in range(n):
                                if j != me:
                                    s = _part_start(chunk, n, j)
                                    length = _part_start(chunk, n, j + 1) - s
                                    memcpy(<void *>(self.bufs + (2 * me + b) * self.slot + s * isz),
                                           <const void *>(addr + (lo + s) * isz), length * isz)
                    how = (self._enter(PyBytes_AS_STRING(desc), len(desc)) if r == 0 else
                           self._enter(NULL, 0))
                    if how == -1:
                        return -2
                    if how == 0:
                        return r
                resume = False
                b = (self.phase - 1) % 2
                with nogil:
                    if r >= 1 and keep:                 # the reduced parts of chunk r-1
                        plo = (r - 1) * per_round
                        chunk = min(per_round, count - plo)
                        for j in range(n):
                            if j != me:
                                s = _part_start(chunk, n, j)
                                length = _part_start(chunk, n, j + 1) - s
                                memcpy(<void *>(addr + (plo + s) * isz),
                                       <const void *>(self.bufs + (2 * j + b) * self.slot + per_round * isz),
                                       length * isz)
                    if r < rounds:                      # my part of chunk r
                        lo = r * per_round
                        chunk = min(per_round, count - lo)
                        s = _part_start(chunk, n, me)
                        length = _part_start(chunk, n, me + 1) - s
                        if length:
                            for j in range(n):
                                ins[j] = (addr + (lo + s) * isz if j == me else
                                          self.bufs + (2 * j + b) * self.slot + s * isz)
                            out = self.bufs + (2 * me + 1 - b) * self.slot + per_round * isz
                            _reduce_parts_kind(kind, op, out, ins, n, length)
                            if keep:
                                memcpy(<void *>(addr + (lo + s) * isz), <const void *>out, length * isz)
                r += 1
            return -1
        finally:
            free(ins)

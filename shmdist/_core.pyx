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
from shmdist._core cimport (PyThread_allocate_lock, PyThread_free_lock, PyThread_acquire_lock,
                            PyThread_acquire_lock_timed, PyThread_release_lock, PyThread_get_thread_ident,
                            PY_LOCK_ACQUIRED, WAIT_LOCK,
                            sd_load64, sd_store64, sd_load32, sd_store32, sd_add32, sd_add64, sd_cas64,
                            sd_fence, sd_relax, sd_futex_wait, sd_futex_wake, sd_yield,
                            sd_copy_nt, sd_reduce_half, sd_half_level, sd_half_set_limit,
                            sd_reduce_float, sd_tr_post, sd_tr_set, sd_tr_attach)

cdef extern from "sys/uio.h" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len
    ssize_t process_vm_readv(int pid, const iovec *local, unsigned long liovcnt,
                             const iovec *remote, unsigned long riovcnt, unsigned long flags)
    ssize_t process_vm_writev(int pid, const iovec *local, unsigned long liovcnt,
                              const iovec *remote, unsigned long riovcnt, unsigned long flags)

from libc.errno cimport errno, EINTR, EFAULT
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

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


include "_bells.pxi"
include "_ring.pxi"
include "_kernels.pxi"
include "_waiting.pxi"
include "_lock.pxi"
include "_request.pxi"
include "_lane.pxi"
include "_phaser.pxi"
include "_trace.pxi"
include "_entry.pxi"

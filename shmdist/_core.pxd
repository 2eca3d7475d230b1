# Declarations of the core (_core.pyx and the .pxi files it includes): the C helpers
# it calls, then its classes, each field commented once. The layouts and codes it
# shares with Python are in _layout.pxi, generated from layout.py.
cimport cython
from libc.stdint cimport uint8_t, uint16_t, int32_t, uint32_t, uint64_t, int64_t

# static inline helpers of _atomics.h, all safe to call nogil

cdef extern from "_atomics.h" nogil:
    uint64_t sd_load64(const uint64_t *p)
    void sd_store64(uint64_t *p, uint64_t v)
    uint32_t sd_load32(const uint32_t *p)
    void sd_store32(uint32_t *p, uint32_t v)
    uint32_t sd_add32(uint32_t *p, int v)
    uint64_t sd_add64(uint64_t *p, uint64_t v)
    int sd_cas64(uint64_t *p, uint64_t expect, uint64_t v)
    void sd_fence()
    void sd_relax()
    int sd_futex_wait(uint32_t *addr, uint32_t val, long timeout_ns)
    int sd_futex_wake(uint32_t *addr, int n)
    int sd_yield()
    void sd_copy_nt(void *dst, const void *src, size_t n)

cdef extern from "_sum.h" nogil:     # float32/float64 SUM and PRODUCT, all inputs in one pass
    int sd_reduce_float(int f64, int op, void *out, const void *const *ins, int n, size_t count)

cdef extern from "_trace.h":           # the flight recorder's C writer (layout: SD_TR_*, layout.py)
    uint64_t sd_tr_post(uint32_t op, uint32_t state, int64_t gid, int64_t peer, int64_t tag,
                        uint64_t nbytes, uint64_t coll, const char *dtype16)
    void sd_tr_set(uint64_t seq, uint32_t state, int at_once)
    void sd_tr_undone(uint64_t seq, uint32_t state)
    void sd_tr_attach(uint8_t *base, uint64_t capacity)

cdef extern from "pythread.h":
    ctypedef void *PyThread_type_lock
    ctypedef enum PyLockStatus:
        PY_LOCK_FAILURE = 0
        PY_LOCK_ACQUIRED = 1
        PY_LOCK_INTR
    enum:
        WAIT_LOCK
        NOWAIT_LOCK
    unsigned long PyThread_get_thread_ident()
    PyThread_type_lock PyThread_allocate_lock()
    void PyThread_free_lock(PyThread_type_lock)
    int PyThread_acquire_lock(PyThread_type_lock, int mode) nogil
    PyLockStatus PyThread_acquire_lock_timed(PyThread_type_lock, long long microseconds, int intr_flag) nogil
    void PyThread_release_lock(PyThread_type_lock) nogil

cdef extern from "_half.h" nogil:
    void sd_reduce_half(int f16, int op, uint16_t *out, const uint16_t *const *ins, int n,
                        size_t count, float div)
    int sd_half_level()
    void sd_half_set_limit(int level)
    uint16_t sd_f32_bf16(float f)
    uint16_t sd_f32_f16(float f)
    float sd_f16_f32(uint16_t h)


@cython.final
cdef class Ring:
    """_ring.pxi"""
    cdef uint64_t *head
    cdef uint64_t *tail
    cdef uint32_t *want         # 1 while the producer waits for room
    cdef uint8_t *data
    cdef uint64_t size
    cdef uint64_t mask
    cdef size_t other_ctl
    cdef uint64_t cached_head   # what the consumer last saw
    cdef uint64_t cached_tail   # what the producer last saw
    cdef uint64_t help_t        # consumer: the record whose reading it shares (HELP_NONE: none)
    cdef size_t help_dst        # consumer: where that record's message goes
    cdef uint64_t help_seq      # consumer: offers made, ever; producer: the last offer it helped
    cdef uint64_t help_n        # consumer: chunks of the open offer
    cdef int help_err           # consumer: the errno of one of its own chunks that failed
    cdef public int64_t help_min   # consumer: offer from this many bytes (0 never; -1 not known yet)
    cdef public uint64_t helped    # producer: chunks it copied into its consumer's memory, ever
    cdef public uint64_t acks_seen # producer: single-copy records whose read completed their send here
    cdef uint64_t *mate_head    # consumer: the ring this rank writes to the same peer (NULL: none);
    cdef uint64_t *mate_tail    #   records in it the peer has not read yet: the peer's core reads ours
    cdef object mate            # (keeps that ring alive)
    cdef int _settle_help(self, long spins) noexcept nogil
    cdef bint _mate_busy(self) noexcept nogil
    cdef void _offer(self, uint64_t t, size_t dst, size_t src, uint64_t nbytes) noexcept
    cdef void _put(self, uint64_t at, const uint8_t *src, size_t n) noexcept nogil
    cdef void _get(self, uint64_t at, uint8_t *dst, size_t n, bint stream=*) noexcept nogil
    cdef uint64_t _push(self, const uint8_t *hdr, const uint8_t *src, uint64_t nbytes,
                        uint64_t pos, uint64_t total) noexcept nogil
    cdef uint64_t _pull(self, uint8_t *dst, uint64_t nbytes, uint64_t pos,
                        uint64_t total) noexcept nogil
    cdef void _room(self) noexcept nogil
    cdef void _stamp(self, uint64_t t) noexcept nogil
    cdef int _take(self, int64_t tag, int64_t gid, size_t addr, uint64_t nbytes, const char *dtype16)
    cdef int _take_single(self, int64_t tag, int64_t gid, size_t addr, uint64_t nbytes,
                          const char *dtype16)


cdef class Backoff:
    """_waiting.pxi"""
    cdef public long spin, yields, most, least
    cpdef update(self, int how)


cdef class DistributedRequest:
    """_request.pxi"""
    cdef public object _engine
    cdef public bint _done
    cdef public object _error
    cdef public object op
    cdef public object source
    cdef public object tensors
    cdef public object _peers     # the global ranks it waits on (None: any)
    cdef public object _lane      # the Lane while this is its pending fast receive
    cdef public uint64_t _tseq    # its flight-recorder entry (trace.py), 0 if none
    cpdef _complete(self, error=*)


@cython.final
cdef class Queues:
    """_lane.pxi: the engine's point-to-point queues, which its fast lane reads.
    Made once with the engine and never rebound (readonly): both hold this one
    object, so neither can be left with a list the other replaced."""
    cdef readonly dict sendq       # destination -> deque of the sends not yet written whole
    cdef readonly list posted      # receives posted and not yet matched, in posting order
    cdef readonly dict rx          # source -> the record streaming in from it, or None
    cdef readonly list unexpected  # records that arrived before a receive asked for them
    cdef readonly dict awaiting    # destination -> deque of single-copy sends not yet read by it


@cython.final
cdef class _Sent:
    """_lane.pxi: a single-copy send the lane wrote, in the engine's awaiting queue
    until its destination has read it (what the engine reads of an awaiting send:
    req, dst, buf.addr, buf.nbytes)."""
    cdef readonly DistributedRequest req
    cdef readonly object arr       # the message's memory, kept alive until it was read
    cdef readonly size_t addr
    cdef readonly uint64_t nbytes
    cdef readonly int dst
    cdef readonly uint64_t target  # the destination's reads (Ring.acked) once it has read this one


@cython.final
cdef class _Pend:
    """_lane.pxi: a pending fast receive: where its message goes and what it must be."""
    cdef DistributedRequest req
    cdef Ring ring
    cdef object arr
    cdef int src
    cdef int64_t tag
    cdef size_t addr
    cdef uint64_t nbytes
    cdef bytes dtype16


@cython.final
cdef class RLock:
    """_lock.pxi"""
    cdef PyThread_type_lock real    # what a thread that finds it held waits on
    cdef unsigned long owner        # the thread that holds it (while count > 0)
    cdef int count                  # how many times its owner took it
    cdef int waiting                # threads waiting on real
    cdef bint real_held             # real is taken (for the owner, or by it)
    cdef bint _take(self, bint blocking=*, double timeout=*) except -1
    cdef bint _wait(self, unsigned long me, double timeout) except -1
    cdef int _give(self) except -1


@cython.final
cdef class Lane:
    """_lane.pxi"""
    cdef int rank
    cdef list outs, ins            # Ring or None, per global rank
    cdef list send_ops, recv_ops   # the op names of requests, per global rank
    cdef public dict dtypes        # numpy dtype -> its 16-byte header field, filled by the general path
    cdef RLock lock                # the engine's
    cdef Queues q                  # the engine's queues (the same object, for good)
    cdef object engine
    cdef object peers              # (src,) tuples, per rank
    cdef list pend                 # the pending fast receives (_Pend), in posting order
    cdef public unsigned long long sends, recvs   # operations the lane took whole
    cdef int64_t a_tag             # what _args found, read at once
    cdef int64_t a_peer            # the peer _args parsed (for the flight recorder)
    cdef bytes a_dtype16
    cdef bint a_both              # _single: a receive from the destination is pending (both ways)
    cdef bint a_counted           # _single: no call to the timing for this send (not timed, or ways.want's shortcut)
    cdef Backoff backoff
    cdef list single_at            # per global rank: smallest message sent it as a single copy (0 unknown, -1 none)
    cdef uint64_t single_floor     # SHMDIST_SINGLE_COPY (0: off): below it no single copy is considered
    cdef uint64_t pid
    cdef object deque              # collections.deque, the type of the engine's awaiting queues
    cdef int _header(self, uint8_t *hdr, Py_buffer *view, int64_t tag, bytes dtype16, int32_t flags) except -1
    cdef Ring _args(self, arr, peer, tag, list chans)
    cpdef object send(self, arr, dst, tag, owner=*)
    cpdef object recv(self, arr, src, tag)
    cdef int _drain(self, DistributedRequest req) except -2
    cdef object _find(self, DistributedRequest req)
    cdef int _single(self, int dst, size_t addr, uint64_t nbytes) except -1
    cdef bint _overlaps_sent(self, size_t addr, uint64_t nbytes)
    cdef int _read_single(self, _Pend p) except -2
    cdef bint _wait_sent(self, _Sent op, long spin) except -1
    cdef bint _engine_receiving(self)
    cdef void _complete_sent(self, int dst)


@cython.final
cdef class Phaser:
    """_phaser.pxi"""
    cdef public uint64_t phase, calls, call_phase   # call_phase: the first phase of the last call
    cdef public object broken            # why the group is unusable, or None
    cdef size_t flags, stride, bell, bufs, slot
    cdef int n, me
    cdef object others_ref               # keeps the others' control block addresses alive
    cdef const uint64_t *others
    cdef Py_ssize_t nothers
    cdef Backoff backoff
    cdef RLock lock                      # the group's (arena.GroupComm.lock)
    cdef bytes barrier_desc
    cdef dict kinds                      # numpy dtype -> (reduce_rows kind, its name) for all_reduce
    cdef object last_dtype, last_op, last_name, last_plan   # plan()'s last answer, by identity
    cdef uint64_t all_reduce_index
    cdef uint64_t broadcast_index        # layout.KINDS' index of "broadcast" (0: not given, no one-call broadcast)
    cdef public int64_t trace_gid        # the group id its calls are recorded under (-1: not recorded)
    cdef public uint64_t tseq            # the flight-recorder entry of its last call
    cdef int _enter(self, const char *desc, size_t nd) except -2
    cdef int _call(self, const char *desc, size_t nd, void *data, size_t nbytes, int kind,
                   int op, int root=*) except -4
    cpdef object plan(self, dtype, op, name=*)
    cdef object _plan(self, dtype, op, name)

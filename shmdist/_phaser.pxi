# Included by _core.pyx (the hub); its classes are declared in _core.pxd.
# Phaser: the phases of one group's arena, and the collectives that run whole in C.

# ---------------------------------------------------------------- waiting policy and collective phases

cdef enum:
    GIL_SPIN = 64       # pauses a member spins for the others with the GIL held, before releasing it


cdef inline uint64_t _check_word(const uint64_t *desc, size_t words, uint64_t calls) noexcept nogil:
    """A call's check word: its number and its descriptor's words mixed, each step a
    bijection of the state (xor a word, multiply by an odd constant, xor-shift), so two
    calls that differ in their number or in any one word of the descriptor never share
    it; other differences share it with a chance of about 2**-64. A member writes it
    beside its phase counter, so that a call whose members' words are equal needs no
    read of their descriptors' cache lines (30 % of a 2-member barrier)."""
    cdef uint64_t h = calls * <uint64_t>0x9E3779B97F4A7C15ULL
    cdef size_t i
    for i in range(words):
        h = (h ^ desc[i]) * <uint64_t>0xFF51AFD7ED558CCDULL
        h ^= h >> 32
    return h


cdef class Phaser:
    """The phases of one group's arena, as seen by one member: its counters
    (``phase``: phases entered; ``calls``: collectives started), entering a
    phase in one call, and the whole of a barrier or a small all_reduce when
    the other members are already there.

    Control slot of member i at ``flags + i * stride``: its phase (u64) at 0,
    its last call's check word at 8, and the descriptors of its last two
    calls at 64 and 128. Data buffers:
    member i's buffer of parity b at ``bufs + (2 i + b) * slot``.
    """

    def __cinit__(self, size_t flags, size_t stride, int n, int me, others, size_t bell,
                  Backoff backoff, RLock lock, bytes barrier_desc, size_t bufs, size_t slot,
                  dict kinds, uint64_t all_reduce_index, uint64_t broadcast_index=0):
        cdef const uint64_t[::1] view = others
        self.flags, self.stride, self.n, self.me, self.bell = flags, stride, n, me, bell
        self.others_ref = others        # keeps the addresses alive
        self.others = &view[0] if view.shape[0] else NULL
        self.nothers = view.shape[0]
        self.backoff = backoff
        self.lock = lock
        self.barrier_desc = barrier_desc
        self.bufs, self.slot = bufs, slot
        self.kinds, self.all_reduce_index, self.broadcast_index = dict(kinds), all_reduce_index, broadcast_index
        self.kinds.setdefault(_F16, (KIND_FLOAT16, b"float16"))
        self.broken = None
        self.trace_gid = -1

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
        cdef int done = SD_NOT_YET, n = self.n
        cdef uint64_t target, check = 0
        cdef bint same
        if desc != NULL:
            at = SD_SLOT_DESC + SD_DESC_BYTES * (self.calls % 2)
            self.calls += 1
            memcpy(mine + at, desc, nd)
            check = _check_word(<const uint64_t *>desc, nd // 8, self.calls)
            sd_store64(<uint64_t *>(mine + SD_SLOT_CHECK), check)    # before the phase, as the descriptor
        self.phase += 1
        target = self.phase
        if desc != NULL:
            self.call_phase = target      # (a member at or past it has begun this call: arena's timeouts)
        sd_store64(<uint64_t *>mine, target)
        sd_fence()
        # trace: this call, from its descriptor, written while the others may still be on their
        # way, as done (the common case: caught while spinning); the slow paths below correct it
        # (waiting, or its members' calls differ) before this rank sleeps or raises, so a hang's
        # diagnosis, made seconds later, reads the truth. Written after the spin instead, it sat
        # on the call's critical path: a 2-rank all_reduce of 8 B 4-6 % (~40 ns) slower; written
        # as posted and moved to done after, as much again.
        if desc != NULL and self.trace_gid >= 0 and nd >= SD_DESC_BYTES:
            self.tseq = sd_tr_post(SD_TR_COLL + (<const uint64_t *>(desc + SD_DESC_KIND))[0],
                                   SD_TR_DONE, self.trace_gid,
                                   (<const int64_t *>(desc + SD_DESC_ROOT))[0],
                                   (<const int64_t *>(desc + SD_DESC_OP))[0],
                                   (<const uint64_t *>(desc + SD_DESC_NBYTES))[0], self.calls,
                                   desc + SD_DESC_DTYPE)
        elif desc != NULL:
            self.tseq = 0
        # (a later phase keeps its call's entry: waiting there, the call is marked waiting again)
        for i in range(self.nothers):    # a waiter spins on the flags; wake the sleepers (_bells.pxi)
            if (sd_load32(_u32(<size_t>self.others[i] + SD_CTL_PHASE_SLEEPING))
                    or sd_load32(_u32(<size_t>self.others[i] + SD_CTL_SLEEPING))):
                sd_add32(_u32(<size_t>self.others[i] + SD_CTL_BELL), 1)
                sd_futex_wake(_u32(<size_t>self.others[i] + SD_CTL_BELL), 0x7fffffff)
        for k in range(min(spin, GIL_SPIN)):     # most waits end here: no GIL handover around them
            if _all_reached(f, self.stride, n, target):
                done = SD_DONE_SPINNING
                break
            sd_relax()
        if not done:
            with nogil:
                for k in range(spin):
                    if _all_reached(f, self.stride, n, target):
                        done = SD_DONE_SPINNING
                        break
                    sd_relax()
                if not done:
                    for k in range(yields):
                        if _all_reached(f, self.stride, n, target):
                            done = SD_DONE
                            break
                        sd_yield()
        if done != SD_DONE_SPINNING or self.backoff.spin < self.backoff.most:
            self.backoff.update(done or SD_DONE)    # not caught while spinning: spin less next time
        if done and nd:
            # every member's check word equal to this one's: the same call (the common case,
            # read from the lines just polled); else compare the descriptors themselves (a
            # member may already have started its next call: its check word is that one's)
            same = nd % 8 == 0
            i = 0
            while same and i < n:
                same = sd_load64(<const uint64_t *>(f + i * self.stride + SD_SLOT_CHECK)) == check
                i += 1
            if not same:
                for i in range(1, n):
                    if memcmp(f + at, f + i * self.stride + at, nd):
                        done = SD_DIFFER
                        break
        if done != SD_DONE_SPINNING and done != SD_DONE and self.tseq:
            sd_tr_undone(self.tseq, SD_TR_POSTED if done == SD_DIFFER else SD_TR_WAITING)
        return done

    def enter(self, bytes desc=None):
        """Enter the next phase (publishing ``desc``, this call's descriptor,
        first when given), spin and yield for the others. DONE_SPINNING or
        DONE: every member is there; DIFFER: they are, but their descriptors
        differ; NOT_YET: not yet (the caller sleeps, then compares)."""
        if desc is None:
            return self._enter(NULL, 0)
        return self._enter(PyBytes_AS_STRING(desc), len(desc))

    cdef int _call(self, const char *desc, size_t nd, void *data, size_t nbytes, int kind,
                   int op, int root=-1) except -4:
        """One collective call of a single phase under the group's lock: the
        data (if any) into this member's buffer, the phase, and once every
        member is there the reduction of all buffers into ``data``; with
        ``root`` (a broadcast), only the root's data goes in, and the others
        copy it out of the root's buffer instead.
        DONE_SPINNING or DONE when done; BROKEN when the group is broken
        (nothing done); NOT_YET (not passed yet) and DIFFER (the calls
        differ) leave the lock held."""
        cdef int how
        cdef size_t parity, src
        self.lock._take()
        if self.broken is not None:
            self.lock._give()
            return SD_BROKEN
        try:
            parity = self.phase % 2
            src = self.bufs + (2 * (self.me if root < 0 else root) + parity) * self.slot
            if data != NULL and (root < 0 or root == self.me):
                memcpy(<void *>src, data, nbytes)
            how = self._enter(desc, nd)
            if how > 0 and data != NULL:
                if root < 0:
                    _reduce_kind(kind, op, <size_t>data, self.bufs + parity * self.slot, 2 * self.slot,
                                 self.n, nbytes // sd_kind_itemsize[kind])
                elif root != self.me:
                    if nbytes < NOGIL_COPY:
                        memcpy(data, <const void *>src, nbytes)
                    else:
                        with nogil:
                            memcpy(data, <const void *>src, nbytes)
        except BaseException:
            self.lock._give()
            raise
        if how > 0:
            self.lock._give()
        return how

    def broadcast(self, arr, int root, size_t most, bytes name):
        """A whole broadcast of a C-contiguous numpy array of at most ``most``
        bytes (one round) from member ``root`` (writable on the others),
        ``name`` its dtype's name in a descriptor: DONE_SPINNING or DONE when
        done. NOT_TAKEN: it does not qualify, nothing done; BROKEN, NOT_YET
        and DIFFER as for _call, the root's data already in its buffer of
        parity (phase - 1) % 2, from which the caller finishes. The descriptor
        is the one layout.pack_desc packs for it, naming ``root`` as the root's
        global rank: the one-call path serves the default group only, where
        they are the same (GroupComm.quick_broadcast checks)."""
        cdef Py_buffer view
        cdef uint64_t desc[SD_DESC_WORDS]
        if root < 0 or root >= self.n or self.broadcast_index == 0:     # (0: not given)
            return SD_NOT_TAKEN
        try:
            PyObject_GetBuffer(arr, &view, PyBUF_C_CONTIGUOUS | (0 if root == self.me else PyBUF_WRITABLE))
        except (BufferError, ValueError):
            return SD_NOT_TAKEN
        try:
            if <size_t>view.len > most or len(name) > SD_DTYPE_BYTES:
                return SD_NOT_TAKEN
            memset(desc, 0, sizeof(desc))      # layout.DESC: 0, kind, bytes, op, root, dtype, extra
            desc[SD_DESC_KIND // 8] = self.broadcast_index
            desc[SD_DESC_NBYTES // 8] = view.len
            desc[SD_DESC_ROOT // 8] = <uint64_t>root
            memcpy(<char *>desc + SD_DESC_DTYPE, PyBytes_AS_STRING(name), len(name))
            return self._call(<const char *>desc, sizeof(desc), view.buf, view.len, 0, 0, root)
        finally:
            PyBuffer_Release(&view)

    def barrier(self):
        """A whole barrier: DONE_SPINNING or DONE when passed; BROKEN, NOT_YET
        and DIFFER as for _call."""
        return self._call(PyBytes_AS_STRING(self.barrier_desc), len(self.barrier_desc), NULL, 0, 0, 0)

    cpdef object plan(self, dtype, op, name=None):
        """(reduce_parts kind, op code, dtype name) when the C reduction
        takes ``dtype`` and ReduceOp ``op``, else None (other dtypes, AVG and
        bitwise ops, and MIN/MAX of floats, whose NaN rules are numpy's).
        ``name``: the buffer's dtype name when numpy's differs from it
        ("bfloat16" travels as uint16 arrays)."""
        if dtype is self.last_dtype and op is self.last_op and name is self.last_name:
            return self.last_plan          # the same call as last time (numpy hashes a dtype slowly)
        answer = self._plan(dtype, op, name)
        self.last_dtype, self.last_op, self.last_name, self.last_plan = dtype, op, name, answer
        return answer

    cdef object _plan(self, dtype, op, name):
        cdef long code
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
        3 MAX for integers), reduced in C (see reduce_rows): DONE_SPINNING
        or DONE when done. NOT_TAKEN: it does not qualify (or is over
        ``most`` bytes), nothing done; BROKEN, NOT_YET and DIFFER as for
        _call, the data already in place: the
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
            return SD_NOT_TAKEN
        kind, code, name = plan
        try:
            PyObject_GetBuffer(arr, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        except (BufferError, ValueError):
            return SD_NOT_TAKEN
        try:
            if <size_t>view.len > most:
                return SD_NOT_TAKEN
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
        when ``keep``, straight into the data). ALL_ROUNDS_DONE: done.
        DIFFER: the first phase passed and the descriptors differ. Otherwise the round whose
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
                    if how == SD_DIFFER:
                        return SD_DIFFER
                    if how == SD_NOT_YET:
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
            return SD_ALL_ROUNDS_DONE
        finally:
            free(ins)

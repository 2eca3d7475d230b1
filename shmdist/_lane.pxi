# Included by _core.pyx (the hub); its classes are declared in _core.pxd.
# The fast lane: a small send or receive between two local ranks in one call.

# ---------------------------------------------------------------- the fast lane

cdef extern from "Python.h":
    int PyLong_Check(object o)
    long PyLong_AsLong(object o) except? -1
    long long PyLong_AsLongLongAndOverflow(object o, int *overflow) except? -1



cdef enum:
    MAX_PENDING = 1024     # pending fast receives at most; more go the general way


cdef class Queues:
    """The engine's point-to-point queues (declared in _core.pxd): the sends
    per destination, the posted receives, the record streaming in per
    source, the unexpected records. Engine.close and fail_group empty them
    in place; nothing replaces them, so the fast lane, which decides from
    them whether a receive may skip the engine, always sees the engine's."""

    def __cinit__(self, sources):
        self.sendq = {}
        self.posted = []
        self.rx = dict.fromkeys(sources)
        self.unexpected = []
        self.awaiting = {}


cdef class _Pend:
    """A pending fast receive: where its message goes and what it must be."""


cdef class Lane:
    """The whole of a small send or receive between two local ranks in one
    call, for the common case: a C-contiguous numpy array, the default
    group, an int tag, nothing else pending that it would have to queue
    behind. Anything else returns None and goes the general way (transport/engine.py),
    which also raises the errors. The engine's lock is held while a ring
    is touched, as the engine itself does.

    A receive whose message has not arrived yet is kept here as the one
    *pending* fast receive rather than posted; the engine posts it
    (``settle``) before it matches anything else, so the order of receives
    is the order they were posted. ``wait()`` on it spins on its ring alone.
    """

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
        self.q = <Queues?>engine.queues
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
        self.a_peer = p
        self.a_dtype16 = <bytes>d
        return <Ring>r

    cpdef object send(self, arr, dst, tag):
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
                if self.q.sendq:
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
        sd_tr_post(SD_TR_SEND, SD_TR_DONE, 0, self.a_peer, t, <uint64_t>view.len, 0, PyBytes_AS_STRING(dtype16))  # trace: send, done
        req = DistributedRequest.__new__(DistributedRequest)
        req._engine = self.engine
        req.op = self.send_ops[dst]
        req._peers = self.peers[dst]
        req._done = True
        return req

    cpdef object recv(self, arr, src, tag):
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
            if self.q.posted or self.q.unexpected or self.q.rx[isrc] is not None or self.q.awaiting:
                return None     # (a single-copy send may be read from this very buffer: the engine checks)
            ahead = False
            for p in self.pend:
                if p.src == isrc:
                    ahead = True
                    break
            if not ahead:       # the next record from src is this receive's
                got = ring._take(t, 0, addr, nbytes, PyBytes_AS_STRING(dtype16))
                if got == SD_OTHER_RECORD:
                    return None     # another record first: the general path (after the pending ones)
                if got == SD_DONE:
                    self.recvs += 1
                    sd_tr_post(SD_TR_RECV, SD_TR_DONE, 0, isrc, t, nbytes, 0, PyBytes_AS_STRING(dtype16))  # trace: recv, done
                    req.source = src
                    req._done = True
                    return req
            self.recvs += 1
            req._tseq = sd_tr_post(SD_TR_RECV, SD_TR_POSTED, 0, isrc, t, nbytes, 0, PyBytes_AS_STRING(dtype16))  # trace: recv, posted
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
        if self._drain(None) == SD_OTHER_RECORD:
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
        are there (lock held). DONE when ``req`` is done, NOT_YET when not
        yet, OTHER_RECORD when a record is not the one its receive expects: every pending
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
            if got == SD_OTHER_RECORD:
                self.settle()
                return SD_OTHER_RECORD
            if got == SD_NOT_YET:
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
                return SD_DONE
        return SD_DONE if req is not None and req._done else SD_NOT_YET

    def wait_pending(self, DistributedRequest req, long spin):
        """Spin up to ``spin`` pauses (-1: as the engine's backoff says) for
        ``req``, a pending fast receive, on its ring alone while nothing
        else is pending, completing the pending receives ahead of it as
        their records come. True when it completed; else every pending
        receive is posted to the engine, which waits for it."""
        cdef _Pend p, mine, first = None
        cdef uint64_t total, t, h
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
            if how != SD_NOT_YET:
                return how == SD_DONE
            mine = <_Pend>self._find(req)
            for p in self.pend:         # the first receive from req's source waits for the ring's next record
                if p.src == mine.src:
                    first = p
                    break
        finally:
            self.release()
        if not self.q.sendq:
            total = _record(first.nbytes)
            t = sd_load64(first.ring.tail)
            with nogil:
                for i in range(spin):
                    h = sd_load64(first.ring.head) - t
                    if h >= total:
                        break
                    if h >= SD_HEADER_BYTES and _single_copy_at(first.ring, t):
                        break       # a single-copy record: shorter than the message, the engine's
                    sd_relax()
        self.acquire()
        try:
            if not self.holds(req):
                return req._done
            how = self._drain(req)
            if how != SD_NOT_YET:
                return how == SD_DONE
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

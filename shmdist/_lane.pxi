# Included by _core.pyx (the hub); its classes are declared in _core.pxd.
# The fast lane: a small send or receive between two local ranks in one call.

from collections import deque

# ---------------------------------------------------------------- the fast lane

cdef extern from "Python.h":
    int PyLong_Check(object o)
    long PyLong_AsLong(object o) except? -1
    long long PyLong_AsLongLongAndOverflow(object o, int *overflow) except? -1



cdef enum:
    MAX_PENDING = 1024     # pending fast receives at most; more go the general way

# One way (no receive from the destination pending here), a message the ring could take
# goes as a single copy from this size, its reading shared with the sender (engine.HELP_MIN)
# (transport/engine.py, which takes it from here: one rule for the lane and the engine).
cdef uint64_t _one_way_single_min = 1 << 17
cdef enum:          # how a send goes (Lane._single)
    RING_BY_RULE = 0
    SINGLE = 1
    RING_BY_CHOICE = 2
ONE_WAY_SINGLE_MIN = _one_way_single_min


cdef inline int _ways_class(uint64_t nbytes) noexcept:
    """transport/ways.py's bit(False, nbytes): 128 KiB, 256 KiB ... 16 MiB or more."""
    cdef int n = 0
    while nbytes:
        n += 1
        nbytes >>= 1
    return min(max(n - 18, 0), 7)


def lane_ways_class(uint64_t nbytes):
    """_ways_class, for the test that it is ways.bit's."""
    return _ways_class(nbytes)


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


cdef class _Sent:
    """A single-copy send the lane wrote (declared in _core.pxd)."""

    @property
    def buf(self):
        """The message's memory as the engine reads an awaiting send's (addr, nbytes): this object."""
        return self


cdef inline bint _has_room(Ring ring, uint64_t total) noexcept:
    """Producer: whether a record of ``total`` bytes fits in ``ring`` now."""
    cdef uint64_t h = sd_load64(ring.head)
    if ring.size - (h - ring.cached_tail) >= total:
        return True
    ring.cached_tail = sd_load64(ring.tail)
    return ring.size - (h - ring.cached_tail) >= total


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
        self.lock = engine.lock
        self.q = <Queues?>engine.queues
        self.pend = []
        self.single_at = [0] * size
        self.single_floor = max(int(engine.single_min), 0)
        self.pid = engine.pid
        self.deque = deque

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

    cdef int _header(self, uint8_t *hdr, Py_buffer *view, int64_t tag, bytes dtype16, int32_t flags) except -1:
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
        memcpy(hdr + SD_HDR_FLAGS, &flags, 4)
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

    cpdef object send(self, arr, dst, tag, owner=None):
        """The request of a send written into its ring now: completed when the
        message went whole, pending when it went as a single copy (its
        destination reads it from here, _single says when); or None.
        ``owner``: what keeps ``arr``'s memory alive, where ``arr`` does not (a
        torch tensor's cached numpy view owns nothing, shmdist.tensors): a
        single copy holds it until read, or the memory could be freed and
        reused under the reader (a tensor sent with ``isend(t.clone(), ...)``)."""
        cdef Ring ring = None
        cdef int64_t t
        cdef int d
        cdef bytes dtype16 = None
        cdef Py_buffer view
        cdef uint8_t hdr[SD_HEADER_BYTES]
        cdef uint64_t total, meta[2]
        cdef DistributedRequest req
        cdef _Sent op = None
        cdef int way
        ring = self._args(arr, dst, tag, self.outs)
        if ring is None:
            return None
        t, d, dtype16 = self.a_tag, <int>self.a_peer, self.a_dtype16
        try:
            PyObject_GetBuffer(arr, &view, PyBUF_C_CONTIGUOUS)
        except (BufferError, ValueError):
            return None         # not contiguous: the general path sends a contiguous copy
        req = DistributedRequest.__new__(DistributedRequest)
        req._engine = self.engine
        req.op = self.send_ops[d]
        req._peers = self.peers[d]
        try:
            if view.ndim > SD_MAX_DIMS:
                return None
            total = _record(<uint64_t>view.len)
            self.lock._take()
            try:
                if self.q.sendq:
                    return None
                way = self._single(d, <size_t>view.buf, <uint64_t>view.len) \
                    if self.single_floor and <uint64_t>view.len >= self.single_floor else RING_BY_RULE
                if way == SINGLE:
                    total = _record(sizeof(meta))
                    if not _has_room(ring, total):
                        return None
                    self._header(hdr, &view, t, dtype16, SD_HDR_SINGLE_COPY)
                    meta[0], meta[1] = self.pid, <uint64_t><size_t>view.buf     # layout.SINGLE_COPY
                    ring._push(hdr, <const uint8_t *>meta, sizeof(meta), 0, total)
                    req._tseq = sd_tr_post(SD_TR_SEND, SD_TR_POSTED, 0, d, t, <uint64_t>view.len, 0,
                                           PyBytes_AS_STRING(dtype16))  # trace: send, posted
                    req._lane = self
                    op = _Sent.__new__(_Sent)
                    op.req, op.addr, op.nbytes, op.dst = req, <size_t>view.buf, <uint64_t>view.len, d
                    op.arr = arr if owner is None else owner
                    q = self.q.awaiting.get(d)
                    if q is None:
                        q = self.q.awaiting[d] = self.deque()
                    q.append(op)
                    op.target = ring.acks_seen + len(q)
                    if self.engine.ways is not None and not self.a_both and not self.a_counted:
                        self.engine.ways.posted(d, True, req, 0, view.len, False)   # (both ways: not timed)
                else:
                    if total > ring.size or not _has_room(ring, total):
                        return None
                    if way == RING_BY_CHOICE and not self.a_counted:     # timed: it ends at the head after it
                        self.engine.ways.posted(d, False, None, sd_load64(ring.head) + total, view.len, False)
                    self._header(hdr, &view, t, dtype16, 0)
                    if view.len < NOGIL_COPY:
                        ring._push(hdr, <const uint8_t *>view.buf, view.len, 0, total)
                    else:
                        with nogil:
                            ring._push(hdr, <const uint8_t *>view.buf, view.len, 0, total)
                    sd_tr_post(SD_TR_SEND, SD_TR_DONE, 0, d, t, <uint64_t>view.len, 0, PyBytes_AS_STRING(dtype16))  # trace: send, done
                    req._done = True
            finally:
                self.lock._give()
        finally:
            PyBuffer_Release(&view)
        self.sends += 1
        return req

    cdef int _single(self, int dst, size_t addr, uint64_t nbytes) except -1:
        """How a send of ``nbytes`` at ``addr`` to ``dst`` goes (lock held), as
        the engine's send decides: SINGLE (a single copy) or RING_BY_CHOICE
        (the ring, where the sender's timing, ways.py, prefers it) when a
        receive from ``dst`` is pending here (both ways at once: each core then
        copies each byte once, not twice; self.a_both says so), or, one way, it
        is of at least ONE_WAY_SINGLE_MIN bytes; else RING_BY_RULE; never a
        single copy when a receive pending here may write into its memory
        before ``dst`` read it."""
        cdef int64_t lim = self.single_at[dst]
        cdef _Pend p
        cdef bint receiving = False
        if lim == 0:
            lim = self.engine.lane_single_at(dst)
            self.single_at[dst] = lim
        if lim <= 0 or nbytes < <uint64_t>lim:
            return RING_BY_RULE
        if self._engine_receiving():
            return RING_BY_RULE        # its send path checks them
        for p in self.pend:
            if p.addr < addr + nbytes and addr < p.addr + p.nbytes:
                return RING_BY_RULE
            if p.src == dst:
                receiving = True
        if not receiving and nbytes < _one_way_single_min:
            return RING_BY_RULE
        self.a_both = receiving
        self.a_counted = True       # (no call to the timing: not a message it times, or the shortcut below)
        chooser = self.engine.ways
        if chooser is None or receiving or _record(nbytes) > (<Ring>self.outs[dst]).size:
            return SINGLE
        if chooser.shortcut and dst in chooser.pending and not chooser.trying:
            # a message to dst is being timed and no try is on: the home way, without a call
            # (ways.py: the calls cost ~20 % of a 256 KiB message's time through the ring)
            self.a_counted = True
            return SINGLE if chooser.want.get((dst, _ways_class(nbytes)), 1) else RING_BY_CHOICE
        self.a_counted = False
        return SINGLE if chooser.single(dst, nbytes, False) else RING_BY_CHOICE

    cdef bint _engine_receiving(self):
        """Whether the engine has receives of its own: posted, streaming in, or
        unexpected records (lock held)."""
        if self.q.posted or self.q.unexpected:
            return True
        for inc in self.q.rx.values():
            if inc is not None:
                return True
        return False

    cdef bint _overlaps_sent(self, size_t addr, uint64_t nbytes):
        """Whether a single-copy send still being read uses memory in [addr, addr + nbytes)."""
        cdef size_t a
        cdef uint64_t n
        for q in self.q.awaiting.values():
            for op in q:
                b = op.buf
                a, n = b.addr, b.nbytes
                if a < addr + nbytes and addr < a + n:
                    return True
        return False

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
        isrc = src
        req = DistributedRequest.__new__(DistributedRequest)
        req._engine = self.engine
        req.op = self.recv_ops[isrc]
        req._peers = self.peers[isrc]
        req.tensors = [arr]
        self.lock._take()
        try:
            if self.q.posted or self.q.unexpected or self.q.rx[isrc] is not None:
                return None
            if self.q.awaiting and self._overlaps_sent(addr, nbytes):
                return None     # a single-copy send is read from this very memory: the engine waits for it
            ahead = False
            for p in self.pend:
                if p.src == isrc:
                    ahead = True
                    break
            if not ahead:       # the next record from src is this receive's
                got = ring._take(t, 0, addr, nbytes, PyBytes_AS_STRING(dtype16))
                if got == SD_OTHER_RECORD and not _single_copy_at(ring, sd_load64(ring.tail)):
                    return None     # another record first: the general path (after the pending ones)
                # (a single copy is read in the wait, not here: see Engine.progress, "Without single")
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
            self.lock._give()
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
                got = self._read_single(p)
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

    cdef int _read_single(self, _Pend p) except -2:
        """A pending receive's next record is not a ring copy of its message:
        read it when it is a single copy of it (DONE; NOT_YET while its producer
        still copies a chunk of it), else OTHER_RECORD (lock held)."""
        cdef int got
        if not _single_copy_at(p.ring, sd_load64(p.ring.tail)):
            return SD_OTHER_RECORD
        if p.ring.help_min < 0:
            p.ring.help_min = self.engine._help_min(p.src)
        got = p.ring._take_single(p.tag, 0, p.addr, p.nbytes, PyBytes_AS_STRING(p.dtype16))
        return SD_NOT_YET if got == SD_HELPING else got

    def wait_pending(self, DistributedRequest req, long spin):
        """Spin up to ``spin`` pauses (-1: as the engine's backoff says) for
        ``req``, a pending fast receive, on its ring alone while nothing
        else is pending, completing the pending receives ahead of it as
        their records come; or for ``req``, a single-copy send of the lane's,
        until its destination has read it. True when it completed; else every pending
        receive is posted to the engine, which waits for it."""
        cdef _Pend p, mine, first = None
        cdef uint64_t total, t, h
        cdef long i
        cdef int how
        if req._done:
            return True
        if spin < 0:
            spin = self.backoff.spin
        op = None
        self.lock._take()
        try:
            if not self.holds(req):
                op = self._sent_op(req)
                if op is None:
                    return req._done
            else:
                how = self._drain(req)
                if how != SD_NOT_YET:
                    return how == SD_DONE
                mine = <_Pend>self._find(req)
                for p in self.pend:         # the first receive from req's source waits for the ring's next record
                    if p.src == mine.src:
                        first = p
                        break
        finally:
            self.lock._give()
        if op is not None:
            return self._wait_sent(<_Sent>op, spin)
        if not self.q.sendq:
            total = _record(first.nbytes)
            t = sd_load64(first.ring.tail)
            with nogil:
                for i in range(spin):
                    h = sd_load64(first.ring.head) - t
                    if h >= total:
                        break
                    if h >= SD_HEADER_BYTES and (total > first.ring.size or _single_copy_at(first.ring, t)):
                        break       # a single copy (read at once), or a ring record too big to come whole
                    sd_relax()
        self.lock._take()
        try:
            if not self.holds(req):
                return req._done
            how = self._drain(req)
            if how != SD_NOT_YET:
                return how == SD_DONE
            self.settle()
        finally:
            self.lock._give()
        return False

    def _sent_op(self, DistributedRequest req):
        """The lane's single-copy send whose request ``req`` is, while it is
        being read, else None (lock held)."""
        peers = req._peers
        if len(peers) != 1:
            return None
        q = self.q.awaiting.get(peers[0])
        if q is None:
            return None
        for op in q:
            if isinstance(op, _Sent) and (<_Sent>op).req is req:
                return op
        return None

    cdef bint _wait_sent(self, _Sent op, long spin) except -1:
        """Spin up to ``spin`` pauses until ``op``'s destination has read it.
        Meanwhile complete the pending fast receives whose messages come (the
        destination may itself be waiting for this rank to read its single
        copies: both ways at once, each waits on its sends first), and copy
        the chunks of it the destination offers to share (the engine's _help).
        True when its request completed; the engine waits for the rest (at once
        when it has receives of its own to move)."""
        cdef Ring ring = <Ring>self.outs[op.dst]
        cdef Ring inring = None
        cdef uint64_t *acked = _hw(ring, SD_RING_ACKED)
        cdef uint64_t *seq = _hw(ring, SD_RING_HELP_SEQ)
        cdef uint64_t target = op.target, offers = sd_load64(seq), head = 0
        cdef long i = 0
        cdef bint woke
        while True:
            self.lock._take()
            try:
                if self._engine_receiving():
                    break       # its wait moves them
                if self.pend and self._drain(None) == SD_OTHER_RECORD:
                    break       # (they went to the engine)
                inring = (<_Pend>self.pend[0]).ring if self.pend else None
                if inring is not None:
                    head = sd_load64(inring.head)
                if sd_load64(seq) != offers:
                    offers = sd_load64(seq)
                    self.engine._help()
            finally:
                self.lock._give()
            woke = False
            with nogil:
                while i < spin and sd_load64(acked) < target:
                    if sd_load64(seq) != offers or (inring is not None and sd_load64(inring.head) != head):
                        woke = True     # an offer to share its reading, or a message for a pending receive
                        break
                    sd_relax()
                    i += 1
            if not woke:
                break
        self.lock._take()
        try:
            self._complete_sent(op.dst)
            chooser = self.engine.ways
            if chooser is not None and chooser.pending:
                chooser.poll()      # (at once: the sender's timing of single copies against the ring)
        finally:
            self.lock._give()
        return op.req._done

    cdef void _complete_sent(self, int dst):
        """Complete, in order, the single-copy sends to ``dst`` it has read (lock held)."""
        cdef Ring ring = <Ring>self.outs[dst]
        cdef uint64_t acked
        q = self.q.awaiting.get(dst)
        if q is None:
            return
        acked = sd_load64(_hw(ring, SD_RING_ACKED))
        while q and ring.acks_seen < acked:
            (<DistributedRequest>q.popleft().req)._complete()
            ring.acks_seen += 1
        if not q:
            del self.q.awaiting[dst]

    def complete_sent(self):
        """Complete the single-copy sends (the engine's and the lane's) their
        destinations have read (lock held)."""
        for dst in list(self.q.awaiting):
            self._complete_sent(dst)

    cdef object _find(self, DistributedRequest req):
        cdef _Pend p
        for p in self.pend:
            if p.req is req:
                return p
        return None

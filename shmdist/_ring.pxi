# Included by _core.pyx (the hub); its classes are declared in _core.pxd.
# Ring: one single-producer, single-consumer byte ring in shared memory.

# ---------------------------------------------------------------- rings

cdef inline bint _single_copy_at(Ring ring, uint64_t t) noexcept nogil:
    """Whether the record at ``t`` (its header there) is a single copy's."""
    cdef int32_t flags
    memcpy(&flags, ring.data + ((t + SD_HDR_FLAGS) & ring.mask), 4)   # never wraps: records are 64-aligned
    return flags != 0


cdef enum:
    HELP_SPIN = 20000          # spins for the producer's last chunk before the caller waits its way


cdef uint64_t HELP_NONE = 0xffffffffffffffff
cdef uint64_t LOW32 = 0xffffffff


cdef inline uint64_t *_hw(Ring ring, size_t at) noexcept nogil:
    """A word of the ring's control block at offset ``at`` (the help slot's, layout.RING_HELP_*; RING_ACKED)."""
    return <uint64_t *>(<size_t>ring.head - SD_RING_HEAD + at)


cdef inline uint64_t _chunk_bytes(uint64_t nbytes) noexcept nogil:
    """The bytes of each chunk of an offer of a message of ``nbytes``: HELP_CHUNK, twice
    that from HELP_BIG (both ends decide alike). Small chunks let a 256 KiB message be
    shared; for 16-64 MiB they cost (64 MiB ping-pong 4.1 -> 6.4 ms with 128 KiB chunks)."""
    return SD_HELP_CHUNK if nbytes < SD_HELP_BIG else 2 * SD_HELP_CHUNK


cdef inline uint64_t _chunks(uint64_t nbytes) noexcept nogil:
    """The chunks an offer of a message of ``nbytes`` has."""
    cdef uint64_t c = _chunk_bytes(nbytes)
    return (nbytes + c - 1) // c


cdef inline void _help_done(uint64_t *done, uint64_t tag, uint64_t k) noexcept nogil:
    """Count ``k`` more chunks done in offer ``tag``; nothing if that offer is over (a copy
    that ended late must not count in the next one)."""
    cdef uint64_t w
    while True:
        w = sd_load64(done)
        if (w >> 32) != tag or sd_cas64(done, w, w + k):
            return


cdef void _touch(size_t addr, uint64_t nbytes) noexcept nogil:
    """Write every page of [addr, addr + nbytes) once (each byte as it was): the
    producer's process_vm_writev then lands on pages this process has faulted in.
    Without it, chunks the producer wrote into pages never touched here read back
    as other bytes on the 2-core VM (not reproduced in C alone; measured, not explained)."""
    cdef volatile uint8_t *p
    cdef size_t at = addr & ~(<size_t>4095)
    while at < addr + nbytes:
        p = <volatile uint8_t *>(at if at >= addr else addr)
        p[0] = p[0]
        at += 4096


def touch(size_t addr, size_t nbytes):
    """_touch: fault in every page of this process's [addr, addr + nbytes)
    before another process writes there with process_vm_writev."""
    with nogil:
        _touch(addr, nbytes)


cdef int _claim_copy(Ring ring, uint64_t tag, uint64_t n, int pid, size_t dst, size_t src,
                     uint64_t nbytes, bint write) noexcept nogil:
    """Claim chunks of offer ``tag`` (of ``n``) one at a time and copy each: the
    producer writes its memory at ``src`` to the consumer's at ``dst``
    (``write``), the consumer reads. Until none is left, or a copy fails:
    then its errno (the producer's also in HELP_ERR, before the chunk counts)."""
    cdef uint64_t *nxt = _hw(ring, SD_RING_HELP_NEXT)
    cdef uint64_t w, k, off, ln
    cdef int err
    while True:
        w = sd_load64(nxt)
        if (w >> 32) != tag or (w & LOW32) >= n:
            return 0
        if not sd_cas64(nxt, w, w + 1):
            continue
        k = w & LOW32
        off = k * _chunk_bytes(nbytes)
        ln = min(_chunk_bytes(nbytes), nbytes - off)
        if write:
            ring.helped += 1
            err = _cma(pid, src + off, dst + off, ln, True)
            if err:
                sd_store64(_hw(ring, SD_RING_HELP_ERR), <uint64_t>err)
        else:
            err = _cma(pid, dst + off, src + off, ln, False)
        _help_done(_hw(ring, SD_RING_HELP_DONE), tag, 1)
        if err:
            return err


cdef class Ring:
    """One single-producer, single-consumer byte ring in shared memory.

    A message is a record: a HEADER_BYTES header, the payload, and padding
    to 64 bytes. The producer publishes ``head`` (bytes written, ever) and
    the consumer ``tail`` (bytes consumed, ever), each on its own cache
    line. The producer rings the consumer's doorbell after each move of
    ``head``; the consumer rings the producer's after it moved ``tail`` only
    while the producer waits for room (``want``, on a third line: 1 from the
    push that found the ring full until a push completes a record). One
    process uses a Ring either as producer or as consumer, never both.

    Why a room wakeup is never lost (Dekker's pattern, both sides fenced):
    the producer stores want = 1, fences, then reads tail once more; the
    consumer stores tail, fences, then reads want. With the two sequentially
    consistent fences, either the producer's second read sees the new tail
    (it goes on pushing) or the consumer's read sees want = 1 (it rings).
    The producer read its doorbell (``seen``) before this push, so that ring
    moves the bell past ``seen`` and its wait_bell does not sleep, or wakes.
    """

    def __cinit__(self, size_t ctl_addr, size_t data_addr, uint64_t size, size_t other_ctl):
        if size == 0 or (size & (size - 1)) != 0 or size < SD_RING_MIN_BYTES:
            raise ValueError(f"ring size must be a power of two >= {SD_RING_MIN_BYTES}, got {size}")
        self.head = <uint64_t *>(ctl_addr + SD_RING_HEAD)
        self.tail = <uint64_t *>(ctl_addr + SD_RING_TAIL)
        self.want = _u32(ctl_addr + SD_RING_WANT)
        self.data = <uint8_t *>data_addr
        self.size = size
        self.mask = size - 1
        self.other_ctl = other_ctl
        self.cached_head = sd_load64(self.head)
        self.cached_tail = sd_load64(self.tail)
        self.help_t = HELP_NONE
        self.help_min = -1
        self.help_seq = sd_load64(_hw(self, SD_RING_HELP_SEQ))
        self.mate_head = self.mate_tail = NULL

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
                if free == 0:       # full: ask for a ring when room comes, then look once more
                    sd_store32(self.want, 1)
                    sd_fence()
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
            _ring_traffic(self.other_ctl)
        if pos == total and sd_load32(self.want):
            sd_store32(self.want, 0)   # a record went whole: no more rings for room until full again
        return pos

    cdef inline void _stamp(self, uint64_t t) noexcept nogil:
        """After the consumer moved tail to ``t``: if it passed the end of the record
        the producer times (RING_TIME_END), write the moment, then that end."""
        cdef uint64_t want = sd_load64(_hw(self, SD_RING_TIME_END))
        cdef timespec now
        if want != 0 and t >= want and sd_load64(_hw(self, SD_RING_TIMED_END)) != want:
            clock_gettime(CLOCK_MONOTONIC, &now)
            sd_store64(_hw(self, SD_RING_TIMED_NS), <uint64_t>now.tv_sec * 1000000000 + <uint64_t>now.tv_nsec)
            sd_store64(_hw(self, SD_RING_TIMED_END), want)

    cdef inline void _room(self) noexcept nogil:
        """After the consumer moved tail: ring the producer only if it waits for room."""
        sd_fence()
        if sd_load32(self.want):
            _ring_traffic(self.other_ctl)

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
            self._stamp(t)
            self._room()
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

    def take(self, int64_t tag, int64_t gid, size_t addr, uint64_t nbytes, bytes dtype16, bint single=True):
        """Receive the next record in one call when it is complete and its
        header says (tag, group, byte count, dtype): copy the payload to
        ``addr`` and return DONE. Return NOT_YET when no complete record is
        there, OTHER_RECORD when the next record is another one (the caller
        then reads the header itself). Header layout: layout.HEADER.
        A single-copy record of that message is read from the sender's
        memory and acknowledged here too; if the read fails, the record is
        left for the caller (OTHER_RECORD), which reads it again and reports.
        Without ``single``, a single-copy record is left for later (OTHER_RECORD)."""
        cdef int got = self._take(tag, gid, addr, nbytes, PyBytes_AS_STRING(dtype16))
        if got == SD_OTHER_RECORD and single:
            got = self._take_single(tag, gid, addr, nbytes, PyBytes_AS_STRING(dtype16))
        return got

    cdef int _take_single(self, int64_t tag, int64_t gid, size_t addr, uint64_t nbytes,
                          const char *dtype16):
        cdef uint64_t t = sd_load64(self.tail)
        cdef uint64_t total = _record(16)
        cdef uint8_t hdr[SD_HEADER_BYTES]
        cdef uint64_t meta[2]
        cdef int64_t htag, hgid
        cdef uint64_t hbytes
        cdef int32_t flags
        cdef int err, pid
        cdef size_t src
        cdef uint64_t otag
        cdef bint settled
        cdef uint64_t *acked
        if self.cached_head - t < total:
            self.cached_head = sd_load64(self.head)
            if self.cached_head - t < total:
                return SD_OTHER_RECORD
        self._get(t, hdr, SD_HEADER_BYTES)
        memcpy(&flags, hdr + SD_HDR_FLAGS, 4)
        memcpy(&htag, hdr + SD_HDR_TAG, 8)
        memcpy(&hgid, hdr + SD_HDR_GID, 8)
        memcpy(&hbytes, hdr + SD_HDR_NBYTES, 8)
        if (flags != SD_HDR_SINGLE_COPY or htag != tag or hgid != gid or hbytes != nbytes
                or memcmp(hdr + SD_HDR_DTYPE, dtype16, SD_DTYPE_BYTES)):
            return SD_OTHER_RECORD
        self._get(t + SD_HEADER_BYTES, <uint8_t *>meta, 16)
        pid, src = <int>meta[0], <size_t>meta[1]
        if self.help_t != HELP_NONE and (self.help_t != t or self.help_dst != addr):
            with nogil:     # an earlier offer, for another receive: over first
                settled = self._settle_help(HELP_SPIN)
            if not settled:
                return SD_HELPING
        if self.help_min > 0 and nbytes >= <uint64_t>self.help_min and nbytes >= 2 * SD_HELP_CHUNK \
                and (self.help_t != HELP_NONE or not self._mate_busy()):
            # shared: the producer, waiting for this very read, copies chunks of it too (not
            # while it reads what this rank sent it: both ways at once each core is busy already)
            if self.help_t == HELP_NONE:
                with nogil:
                    _touch(addr, nbytes)
                self._offer(t, addr, src, nbytes)
            otag = self.help_seq & LOW32
            with nogil:
                if not self.help_err:
                    self.help_err = _claim_copy(self, otag, self.help_n, pid, addr, src, nbytes, False)
                settled = self._settle_help(HELP_SPIN)
            if not settled:
                return SD_HELPING       # the producer's last chunk: the caller waits, then comes back
            err = self.help_err or <int>sd_load64(_hw(self, SD_RING_HELP_ERR))
            self.help_err = 0
            if err:                     # redo it alone: a chunk may be missing
                with nogil:
                    err = _cma(pid, addr, src, nbytes, False)
        else:
            with nogil:
                err = _cma(pid, addr, src, nbytes, False)
        if err or sd_load32(<uint32_t *>(self.other_ctl + SD_CTL_CLOSED)):
            # (a sender that said goodbye may have changed the memory read: the engine reports it)
            return SD_OTHER_RECORD
        sd_store64(self.tail, t + total)
        self._stamp(t + total)
        self._room()
        acked = _hw(self, SD_RING_ACKED)
        sd_store64(acked, sd_load64(acked) + 1)
        _ring_traffic(self.other_ctl)
        return SD_DONE

    # ------------------------------------------------------------ sharing a single copy's reading
    #
    # A consumer reading a big single copy (_take_single) offers its producer, which is
    # waiting for that read to end, to copy chunks of it too, each core then copying about
    # half (one core's copy was what limited a big message one way). The offer is the help
    # slot of the ring's control block (layout.RING_HELP_*): where the message is and goes,
    # then NEXT = offer << 32 | 0 and DONE = offer << 32 | 0, then SEQ = offer. Either side
    # claims the next chunk by compare-and-swap on NEXT (only while its tag is that offer's
    # and chunks are left), copies it and counts it in DONE (only while its tag is still
    # that offer's). The offer is over when DONE counts every chunk; the consumer opens the
    # next only then, so a claim made under one offer never lands in another. A producer
    # that never looks copies nothing: the consumer claims every chunk itself. A copy of
    # the producer's that fails is in HELP_ERR, and the consumer then reads it all again.

    def pair(self, Ring out):
        """Consumer: ``out`` is the ring this rank writes to the same peer. While
        it holds a record the peer has not read (traffic both ways at once), a
        single copy from the peer is read alone, not shared: the peer's core is
        busy reading ours, and helping only trades work between two busy cores at
        the cost of claims and writes into each other's memory (both ways at once,
        2 ranks, 1 / 16 / 64 MiB: 22.1 / 16.4 / 14.8 GB/s shared against 25.6 /
        19.4 / 16.7 alone, README)."""
        self.mate, self.mate_head, self.mate_tail = out, out.head, out.tail

    cdef inline bint _mate_busy(self) noexcept nogil:
        return self.mate_head != NULL and sd_load64(self.mate_head) != sd_load64(self.mate_tail)

    cdef void _offer(self, uint64_t t, size_t dst, size_t src, uint64_t nbytes) noexcept:
        cdef uint64_t tag
        self.help_seq += 1
        tag = self.help_seq & LOW32
        self.help_t, self.help_dst, self.help_err = t, dst, 0
        self.help_n = _chunks(nbytes)
        sd_store64(_hw(self, SD_RING_HELP_DST), dst)
        sd_store64(_hw(self, SD_RING_HELP_SRC), src)
        sd_store64(_hw(self, SD_RING_HELP_BYTES), nbytes)
        sd_store64(_hw(self, SD_RING_HELP_ERR), 0)
        sd_store64(_hw(self, SD_RING_HELP_DONE), tag << 32)
        sd_store64(_hw(self, SD_RING_HELP_NEXT), tag << 32)
        sd_fence()
        sd_store64(_hw(self, SD_RING_HELP_SEQ), self.help_seq)
        _ring_traffic(self.other_ctl)      # a producer asleep in its wait for this read looks now

    cdef int _settle_help(self, long spins) noexcept nogil:
        """Consumer: end the open offer: claim the chunks nobody claimed yet (as
        done, uncopied), then wait up to ``spins`` for the producer's chunk in
        flight. 1 when the offer is over (or there was none)."""
        cdef uint64_t tag, w, left
        cdef uint64_t *nxt
        cdef long i
        if self.help_t == HELP_NONE:
            return 1
        tag = self.help_seq & LOW32
        nxt = _hw(self, SD_RING_HELP_NEXT)
        while True:
            w = sd_load64(nxt)
            left = self.help_n - min(w & LOW32, self.help_n)
            if left == 0 or sd_cas64(nxt, w, (tag << 32) | self.help_n):
                break
        if left:
            _help_done(_hw(self, SD_RING_HELP_DONE), tag, left)
            self.help_err = self.help_err or EFAULT    # (those chunks were not copied: read it all again)
        for i in range(spins):
            if (sd_load64(_hw(self, SD_RING_HELP_DONE)) & LOW32) >= self.help_n:
                self.help_t = HELP_NONE
                return 1
            sd_relax()
        return 0

    def offers(self):
        """The consumer's offers to share a reading made on this ring, ever (the help
        slot's SEQ; either end may ask)."""
        return sd_load64(_hw(self, SD_RING_HELP_SEQ))

    def help_open(self):
        """Consumer: whether the record at its tail is being read with its producer's help."""
        return self.help_t != HELP_NONE

    def settle_help(self, long spins=HELP_SPIN):
        """Consumer: end the open offer, if any (its receive went elsewhere, or
        the engine closes): True once the producer copies nothing more of it."""
        cdef int done
        with nogil:
            done = self._settle_help(spins)
        return bool(done)

    def help_offer(self):
        """Producer: the consumer's open offer it has not helped yet, with chunks
        left to claim: (offer, address of the message here, its bytes), else None."""
        cdef uint64_t seq = sd_load64(_hw(self, SD_RING_HELP_SEQ))
        cdef uint64_t w, nbytes
        if seq == self.help_seq:
            return None
        w = sd_load64(_hw(self, SD_RING_HELP_NEXT))
        nbytes = sd_load64(_hw(self, SD_RING_HELP_BYTES))
        if (w >> 32) != (seq & LOW32) or (w & LOW32) >= _chunks(nbytes):
            self.help_seq = seq
            return None
        return seq, sd_load64(_hw(self, SD_RING_HELP_SRC)), nbytes

    def help(self, int pid, uint64_t seq, size_t src, uint64_t nbytes):
        """Producer: copy chunks of offer ``seq`` (which help_offer gave, for the
        message of ``nbytes`` at ``src`` here) into process ``pid``, the consumer,
        until none is left; then ring it. Returns the errno of a copy that failed, or 0."""
        cdef int err = 0
        cdef size_t dst = sd_load64(_hw(self, SD_RING_HELP_DST))
        self.help_seq = seq
        if sd_load64(_hw(self, SD_RING_HELP_SRC)) != src or sd_load64(_hw(self, SD_RING_HELP_BYTES)) != nbytes:
            return 0
        with nogil:
            err = _claim_copy(self, seq & LOW32, _chunks(nbytes),
                              pid, dst, src, nbytes, True)
        _ring_traffic(self.other_ctl)
        return err

    cdef int _take(self, int64_t tag, int64_t gid, size_t addr, uint64_t nbytes, const char *dtype16):
        cdef uint64_t t = sd_load64(self.tail)
        cdef uint64_t total = _record(nbytes)
        cdef uint8_t hdr[SD_HEADER_BYTES]
        cdef int64_t htag, hgid
        cdef uint64_t hbytes
        cdef int32_t flags
        if self.cached_head - t < total:
            self.cached_head = sd_load64(self.head)
            if self.cached_head - t < total:
                if self.cached_head - t < SD_HEADER_BYTES:
                    return SD_NOT_YET
                return SD_OTHER_RECORD if _single_copy_at(self, t) else SD_NOT_YET  # single copy: the engine's
        self._get(t, hdr, SD_HEADER_BYTES)
        memcpy(&flags, hdr + SD_HDR_FLAGS, 4)
        if flags:
            return SD_OTHER_RECORD
        memcpy(&htag, hdr + SD_HDR_TAG, 8)
        memcpy(&hgid, hdr + SD_HDR_GID, 8)
        memcpy(&hbytes, hdr + SD_HDR_NBYTES, 8)
        if htag != tag or hgid != gid or hbytes != nbytes or memcmp(hdr + SD_HDR_DTYPE, dtype16, SD_DTYPE_BYTES):
            return SD_OTHER_RECORD
        if nbytes < NOGIL_COPY:
            self._get(t + SD_HEADER_BYTES, <uint8_t *>addr, nbytes)
        else:
            with nogil:
                self._get(t + SD_HEADER_BYTES, <uint8_t *>addr, nbytes, nbytes >= stream_min)
        sd_store64(self.tail, t + total)
        self._stamp(t + total)
        self._room()
        return SD_DONE

    def room(self):
        """Producer side: bytes free in the ring now."""
        self.cached_tail = sd_load64(self.tail)
        return self.size - (sd_load64(self.head) - self.cached_tail)

    def produced(self):
        """Producer side: bytes written into the ring, ever (where the next record starts)."""
        return sd_load64(self.head)

    def time_until(self, uint64_t end):
        """Producer side: ask the consumer for the moment its tail passes ``end``
        (before the record that ends there is written)."""
        sd_store64(_hw(self, SD_RING_TIME_END), end)

    def read_at(self, uint64_t end):
        """Producer side: when (time.monotonic's clock) the consumer's tail passed
        ``end``, asked for with time_until; None while not."""
        if sd_load64(_hw(self, SD_RING_TIMED_END)) != end:
            return None
        return sd_load64(_hw(self, SD_RING_TIMED_NS)) * 1e-9

    def consumed(self):
        """Producer side: bytes the consumer has taken out, ever (a record ending at or
        before it was read whole)."""
        return sd_load64(self.tail)

    def acked(self):
        """Producer side: single-copy records the consumer has read, ever."""
        return sd_load64(_hw(self, SD_RING_ACKED))

    def ack(self):
        """Consumer side: one more single-copy record read; wake the producer."""
        cdef uint64_t *acked = _hw(self, SD_RING_ACKED)
        sd_store64(acked, sd_load64(acked) + 1)
        _ring_traffic(self.other_ctl)

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

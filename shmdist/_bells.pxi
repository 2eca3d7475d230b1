# Included by _core.pyx (the hub); its classes are declared in _core.pxd.
# Control blocks, doorbells (futex wait/wake) and copies.

# ---------------------------------------------------------------- doorbells

CAUSE_BYTES = SD_CAUSE_BYTES


def ctl_set_pid(size_t ctl, uint32_t pid):
    sd_store64(<uint64_t *>(ctl + SD_CTL_READS), 0)
    sd_store64(<uint64_t *>(ctl + SD_CTL_PROBED), 0)
    sd_store64(<uint64_t *>(ctl + SD_CTL_ADDR), ctl)    # where the owner sees it: peers probe it there
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


def ctl_addr(size_t ctl):
    """The address of ``ctl`` in its owner's memory (0 before it set its pid)."""
    return sd_load64(<uint64_t *>(ctl + SD_CTL_ADDR))


def ctl_probed(size_t ctl, int index, bint readable):
    """The owner of ``ctl`` records whether it can read local rank ``index``'s memory
    (local ranks from 64 on have no bit: never probed, never read)."""
    if not 0 <= index < 64:
        return
    cdef uint64_t bit = (<uint64_t>1) << index
    if readable:
        sd_store64(<uint64_t *>(ctl + SD_CTL_READS), sd_load64(<uint64_t *>(ctl + SD_CTL_READS)) | bit)
    sd_fence()
    sd_store64(<uint64_t *>(ctl + SD_CTL_PROBED), sd_load64(<uint64_t *>(ctl + SD_CTL_PROBED)) | bit)


def ctl_reads(size_t ctl, int index):
    """Whether the owner of ``ctl`` can read local rank ``index``'s memory:
    True, False, or None while it has not probed it yet. False for local
    ranks from 64 on, which have no bit."""
    if not 0 <= index < 64:
        return False
    cdef uint64_t bit = (<uint64_t>1) << index
    if not sd_load64(<uint64_t *>(ctl + SD_CTL_PROBED)) & bit:
        return None
    sd_fence()
    return bool(sd_load64(<uint64_t *>(ctl + SD_CTL_READS)) & bit)


def ctl_closed(size_t ctl):
    return sd_load32(_u32(ctl + SD_CTL_CLOSED)) != 0


def ctl_cause(size_t ctl):
    """What the owner wrote as its cause when it closed (b"" if none)."""
    cdef bytes raw = PyBytes_FromStringAndSize(<char *>(ctl + SD_CTL_CAUSE), CAUSE_BYTES)
    return raw.split(b"\0", 1)[0]


# Who is woken, and why no wakeup is lost.
#
# A process has one doorbell (CTL_BELL) and two counts of its threads asleep
# on it: CTL_SLEEPING for waits that ring traffic can end (the engine's
# wait_bell: a message or room it waits for), CTL_PHASE_SLEEPING for waits on
# a group's phase flags (wait_phase), which no ring index can end. A ring
# event (_ring_traffic) bumps the bell, for a waiter that spins on it, and
# makes the futex wake syscall only when CTL_SLEEPING says a thread sleeps in
# a wait it can end; a phase or a goodbye (_ring_bell) wakes both kinds. So a
# rank asleep in a barrier costs its peer's sends and receives no syscall
# (it cost one per call: +40 % on an 8 B receive).
#
# The race: the waiter does  sleeping += 1; v = bell; if v == seen: futex_wait(bell, seen)
# and the ringer            bell += 1;     if sleeping: futex_wake(bell).
# Both read-modify-writes and both loads are sequentially consistent, so in
# their one total order either the ringer's load of ``sleeping`` comes after
# the waiter's increment (it sees it and wakes), or the waiter's load of the
# bell comes after the ringer's increment (it sees v != seen and does not
# sleep; and futex_wait itself re-checks bell == seen in the kernel). The
# waiter's ``seen`` was read before it last looked at what it waits for, so a
# change made after that look always moves the bell past ``seen``.
#
# Room in a ring is rung for only when the producer asked (RING_WANT, see
# Ring._push): a consumer's take or pull makes no bell RMW and no syscall
# otherwise.


cdef inline void _ring_bell(size_t ctl) noexcept nogil:
    """News for every thread of ctl's owner (a phase, a goodbye, a retire)."""
    sd_add32(_u32(ctl + SD_CTL_BELL), 1)
    if sd_load32(_u32(ctl + SD_CTL_SLEEPING)) or sd_load32(_u32(ctl + SD_CTL_PHASE_SLEEPING)):
        sd_futex_wake(_u32(ctl + SD_CTL_BELL), 0x7fffffff)


cdef inline void _ring_traffic(size_t ctl) noexcept nogil:
    """A ring index moved: news only for the owner's waits on rings (the
    engine's); a thread asleep on phase flags is left asleep."""
    sd_add32(_u32(ctl + SD_CTL_BELL), 1)
    if sd_load32(_u32(ctl + SD_CTL_SLEEPING)):
        sd_futex_wake(_u32(ctl + SD_CTL_BELL), 0x7fffffff)


def ring_bell(size_t ctl):
    """Tell every thread of the owner of ``ctl`` that something changed; the
    futex wake syscall is made only when one sleeps."""
    _ring_bell(ctl)


def bell_value(size_t ctl):
    return sd_load32(_u32(ctl + SD_CTL_BELL))


cdef int _wait_bell(uint32_t *bell, uint32_t *sleeping, uint32_t seen,
                    long spin, long yields, long ns) noexcept nogil:
    cdef long i
    for i in range(spin):
        if sd_load32(bell) != seen:
            return SD_DONE_SPINNING
        sd_relax()
    for i in range(yields):
        if sd_load32(bell) != seen:
            return SD_DONE
        sd_yield()
    if ns > 0:
        sd_add32(sleeping, 1)
        if sd_load32(bell) == seen:
            sd_futex_wait(bell, seen, ns)
        sd_add32(sleeping, -1)
    return SD_DONE if sd_load32(bell) != seen else SD_NOT_YET


def wait_bell(size_t ctl, uint32_t seen, long spin, long yields, double timeout):
    """Wait until the doorbell of ``ctl`` differs from ``seen`` (read it
    before looking at what you wait for: see the race above).

    Spins ``spin`` times (cpu pause), then yields the CPU ``yields`` times,
    then sleeps on the futex for at most ``timeout`` seconds, counted in
    CTL_SLEEPING (ring traffic wakes it). Returns
    DONE_SPINNING when the bell moved while spinning, DONE when it moved
    later, NOT_YET on timeout or signal (the caller loops and so lets Python
    run signal handlers).
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


# ---------------------------------------------------------------- single copy

cdef int _cma(int pid, size_t local_at, size_t remote_at, size_t n, bint write) noexcept nogil:
    """One copy between this process (``local_at``) and process ``pid``
    (``remote_at``), either way; 0, or the errno that stopped it."""
    cdef iovec local, remote
    cdef ssize_t got
    cdef size_t done = 0
    while done < n:
        local.iov_base = <void *>(local_at + done)
        local.iov_len = n - done
        remote.iov_base = <void *>(remote_at + done)
        remote.iov_len = n - done
        if write:
            got = process_vm_writev(pid, &local, 1, &remote, 1, 0)
        else:
            got = process_vm_readv(pid, &local, 1, &remote, 1, 0)
        if got < 0:
            if errno == EINTR:
                continue
            return errno
        if got == 0:
            return EFAULT
        done += <size_t>got
    return 0


def cma_read(int pid, size_t dst, size_t src, size_t n):
    """Copy ``n`` bytes at address ``src`` of process ``pid`` to ``dst`` in
    this one, in one copy (process_vm_readv), without the GIL. Returns 0, or
    the errno that stopped it (ESRCH: the process is gone; EPERM: ptrace
    rules or seccomp refuse; EFAULT: the address is not mapped there)."""
    cdef int err
    with nogil:
        err = _cma(pid, dst, src, n, False)
    return err


def cma_claim(size_t counter, uint64_t chunks, uint64_t chunk, int pid, size_t local, size_t remote,
              uint64_t nbytes, bint write, bint one):
    """One copy of ``nbytes`` between this process (``local``) and process
    ``pid`` (``remote``), either way, cut into ``chunks`` of ``chunk`` bytes
    that processes claim from the shared ``counter`` (a fetch-and-add): make
    each chunk claimed here, until none is left (``one``: at most one).
    Returns -1 when none was left to claim, else 0, or the errno of the copy
    that failed (and claims no more)."""
    cdef uint64_t k, off
    cdef int err = -1
    with nogil:
        while True:
            k = sd_add64(<uint64_t *>counter, 1) - 1
            if k >= chunks:
                break
            off = k * chunk
            err = _cma(pid, local + off, remote + off, min(chunk, nbytes - off), write)
            if err or one:
                break
    return err


def cma_write(int pid, size_t dst, size_t src, size_t n):
    """Copy ``n`` bytes at ``src`` in this process to address ``dst`` of
    process ``pid`` (process_vm_writev), as cma_read the other way (EFAULT
    also when the memory there is read-only)."""
    cdef int err
    with nogil:
        err = _cma(pid, src, dst, n, True)
    return err

# Included by _core.pyx (the hub); its classes are declared in _core.pxd.
# Waiting on phase flags, and the spin/yield/sleep policy (Backoff).

def wait_phase(size_t flags, size_t stride, int n, uint64_t target, size_t ctl,
               long spin, long yields, double timeout):
    """Wait until each of the ``n`` phase flags (``stride`` bytes apart from
    ``flags``) is at least ``target``. Spins, yields, then sleeps on this
    process's doorbell for at most ``timeout`` seconds, counted in
    CTL_PHASE_SLEEPING: ring traffic never wakes it (_bells.pxi). True when
    reached."""
    cdef const uint8_t *f = <const uint8_t *>flags
    cdef uint32_t *bell = _u32(ctl + SD_CTL_BELL)
    cdef uint32_t *sleeping = _u32(ctl + SD_CTL_PHASE_SLEEPING)
    cdef long i
    cdef long ns = <long>(timeout * 1e9)
    cdef uint32_t seen
    cdef int done = SD_NOT_YET
    with nogil:
        for i in range(spin):
            if _all_reached(f, stride, n, target):
                done = SD_DONE_SPINNING
                break
            sd_relax()
        if not done:
            for i in range(yields):
                if _all_reached(f, stride, n, target):
                    done = SD_DONE
                    break
                sd_yield()
        if not done and ns > 0:
            sd_add32(sleeping, 1)
            seen = sd_load32(bell)
            if not _all_reached(f, stride, n, target):
                sd_futex_wait(bell, seen, ns)
            sd_add32(sleeping, -1)
        if not done:
            done = SD_DONE if _all_reached(f, stride, n, target) else SD_NOT_YET
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


def store_u64(size_t addr, uint64_t value):
    sd_store64(<uint64_t *>addr, value)


cdef class Backoff:
    """How long a waiter spins before it sleeps, adapted to what worked.

    Spinning pays when the peer answers within microseconds (a futex wake
    costs ~40 us when the other core idles); it steals the peer's core when
    the host is busy. So: spin up to ``most`` pauses (~12 ns each here),
    halve the spin each time it ended in a sleep (down to ``least``) and
    double it each time it caught the event. With more local ranks than
    cores, never spin: yield ``yields`` times, then sleep.
    """

    def __init__(self, long most, long yields):
        self.most = most
        self.least = min(most, 256)    # ~3 us: never 0, or spinning could never prove itself again
        self.spin = most
        self.yields = yields

    cpdef update(self, int how):
        """``how``: what the wait returned (DONE_SPINNING, DONE, NOT_YET)."""
        if how == SD_DONE_SPINNING:
            self.spin = min(self.most, self.spin * 2 + 16)
        elif how == SD_DONE:
            self.spin = max(self.least, self.spin // 2)

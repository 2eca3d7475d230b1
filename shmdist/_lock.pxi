# Included by _core.pyx (the hub); its class is declared in _core.pxd.
# The engine's and the arena's lock: a reentrant lock that the GIL guards.

cdef class RLock:
    """A reentrant lock for code that holds the GIL whenever it takes or
    leaves it (the engine, the fast lane, the arena's calls), as
    threading.RLock behaves, without its cost while no other thread wants it.

    Taking it free, or again by its owner, is a check and two stores under
    the GIL: no semaphore, no clock, no argument parsing (threading.RLock's
    acquire and release took ~90 ns a pair here, four pairs per 8-byte
    ping-pong message and side). Only a thread that finds it held by another
    uses the OS lock ``real``: it takes ``real`` for the owner if nobody has
    (the owner then releases ``real`` when it leaves), then waits on it with
    the GIL released; whoever gets ``real`` owns the lock. While a thread
    waits, a newcomer queues on ``real`` too rather than take the lock past
    it. The owner may release the GIL while it holds the lock (a copy
    without the GIL): the others still find it held.
    """

    def __cinit__(self):
        self.real = PyThread_allocate_lock()
        if self.real == NULL:
            raise MemoryError("cannot allocate a lock")

    def __dealloc__(self):
        if self.real != NULL:
            if self.real_held:
                PyThread_release_lock(self.real)
            PyThread_free_lock(self.real)
            self.real = NULL

    cdef bint _take(self, bint blocking=True, double timeout=-1) except -1:
        cdef unsigned long me = PyThread_get_thread_ident()
        if self.count:
            if self.owner == me:
                self.count += 1
                return True
        elif not self.waiting:
            self.owner = me
            self.count = 1
            return True
        if not blocking:
            return False
        return self._wait(me, timeout)

    cdef bint _wait(self, unsigned long me, double timeout) except -1:
        """Another thread holds it (or is about to, having waited): wait on ``real`` (GIL held)."""
        cdef long long us = -1 if timeout < 0 else <long long>(timeout * 1e6)
        cdef int got
        if not self.real_held and not self.waiting:
            PyThread_acquire_lock(self.real, WAIT_LOCK)    # free now: taken for the owner, no wait
            self.real_held = True
        self.waiting += 1
        with nogil:
            got = PyThread_acquire_lock_timed(self.real, us, 0)
        self.waiting -= 1
        if got != PY_LOCK_ACQUIRED:
            return False
        self.real_held = True
        self.owner = me
        self.count = 1
        return True

    cdef int _give(self) except -1:
        if self.count == 0 or self.owner != PyThread_get_thread_ident():
            raise RuntimeError("cannot release un-acquired lock")
        self.count -= 1
        if self.count == 0 and self.real_held:
            self.real_held = False
            PyThread_release_lock(self.real)      # to a waiter
        return 0

    def acquire(self, bint blocking=True, double timeout=-1):
        """As threading.RLock.acquire: True once held; False when not
        ``blocking`` or after ``timeout`` seconds (-1: no limit)."""
        if timeout >= 0 and not blocking:
            raise ValueError("can't specify a timeout for a non-blocking call")
        return self._take(blocking, timeout)

    def release(self):
        self._give()

    def __enter__(self):
        return self._take(True, -1)

    def __exit__(self, *exc):
        self._give()

    def _is_owned(self):
        return self.count > 0 and self.owner == PyThread_get_thread_ident()

    def __repr__(self):
        return f"<shmdist RLock {'held' if self.count else 'free'}, {self.waiting} waiting>"

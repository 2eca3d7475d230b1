# Included by _core.pyx (the hub); its classes are declared in _core.pxd.
# DistributedRequest, the handle of every operation.

# ---------------------------------------------------------------- requests

cdef class DistributedRequest:
    """A pending operation. ``wait()`` blocks until it finished and returns
    True, or raises the error that ended it (a DistError subclass);
    ``is_completed()`` checks without blocking. Receives carry ``source``,
    the global rank of the sender, once complete."""

    def __init__(self, engine, op, tensors=None):
        self._engine = engine
        self.op = op
        self.tensors = tensors
        self._peers = ()

    def wait(self, timeout=None):
        if not self._done:
            if timeout is not None:
                timeout = self._engine.wait_limit(self, timeout)
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
        if self._tseq:
            sd_tr_set(self._tseq, SD_TR_DONE if error is None else SD_TR_FAILED, 0)

    def __repr__(self):
        state = "failed" if self._error is not None else ("completed" if self._done else "pending")
        return f"<DistributedRequest {self.op} {state}>"

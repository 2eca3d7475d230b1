"""DistributedRequest: the handle every send, recv and async collective returns."""
from __future__ import annotations


class DistributedRequest:
    """A pending operation. ``wait()`` blocks until it finished and returns
    True, or raises the error that ended it (a DistError subclass);
    ``is_completed()`` checks without blocking. Receives carry ``source``,
    the global rank of the sender, once complete."""

    __slots__ = ("_engine", "_done", "_error", "op", "source", "_then", "tensors", "_peers")

    def __init__(self, engine, op: str, tensors=None):
        self._engine = engine
        self._done = False
        self._error: BaseException | None = None
        self.op = op
        self.source: int | None = None
        self._then = None
        self.tensors = tensors
        self._peers = ()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._done:
            self._engine.wait_for(self, timeout)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if not self._done:
            self._engine.poll()
        return self._done

    def exception(self) -> BaseException | None:
        return self._error

    def result(self):
        """The tensors the operation produced (as torch's Work.result())."""
        self.wait()
        return self.tensors

    def _complete(self, error: BaseException | None = None) -> None:
        if self._done:
            return
        self._error = error
        self._done = True
        then, self._then = self._then, None
        if then is not None:
            then(self)

    def __repr__(self) -> str:
        state = "failed" if self._error else ("completed" if self._done else "pending")
        return f"<DistributedRequest {self.op} {state}>"


def completed(op: str, tensors=None) -> DistributedRequest:
    """A request that is already done (for operations that finished inline)."""
    req = DistributedRequest(None, op, tensors)
    req._done = True
    return req

"""The one family of errors shmdist raises.

Every message names the rank, the operation, what was expected and what to
do about it.
"""
from __future__ import annotations

import contextlib
import threading

_on_error = None   # set by trace.py (the flight recorder): called with every DistError made
_expected = threading.local()     # .depth > 0: errors made now are caught and retried by the caller


@contextlib.contextmanager
def expected():
    """The DistErrors made inside are the caller's to catch (a wait in
    slices): the flight recorder neither reports nor writes them."""
    _expected.depth = getattr(_expected, "depth", 0) + 1
    try:
        yield
    finally:
        _expected.depth -= 1


class DistError(RuntimeError):
    """Base class of every error shmdist raises on purpose."""

    def __init__(self, *args):
        super().__init__(*args)
        if _on_error is not None and not getattr(_expected, "depth", 0):
            _on_error(self)


class DistTimeoutError(DistError, TimeoutError):
    """A wait passed its deadline. The group stays usable."""


class DistPeerError(DistError):
    """A peer died, closed its socket, or left the group before finishing."""


class DistMismatchError(DistError):
    """Ranks called different operations, or the same one with different
    sizes, dtypes, ops or roots, or a message did not fit its receive."""


class DistNotInitializedError(DistError):
    """No process group yet: call shmdist.init_process_group first."""


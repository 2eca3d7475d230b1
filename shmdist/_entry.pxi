# The API's hottest entry points, shmdist.send / recv (isend / irecv) and
# barrier, as C functions: the fast path (api/fast.py) without a Python frame
# around it; every other call goes to the Python implementation (api/group.py,
# api/collectives.py). A Python function around the one C call cost ~35 ns per
# call: an 8 B one-way (send + recv, each waited) took 0.725 us through the API
# against 0.654 us calling the Lane directly.
#
# fast.py's FastPaths keeps _entry_lane and _entry_barrier equal to its own
# ``lane`` and ``barrier`` (entry_attach on every change), so its one switch
# turns these off too.

cdef object _entry_lane = None          # the world's Lane while the fast paths are attached
cdef object _entry_barrier = None       # the default group's Phaser.barrier, or None
cdef object _entry_send_py = None       # the Python send (any tensor, torch ones included)
cdef object _entry_send_general = None  # its general path (api/group.py)
cdef object _entry_recv_py = None
cdef object _entry_recv_general = None
cdef object _entry_barrier_py = None    # the Python barrier, whole
cdef object _entry_barrier_rest = None  # finishes a fast barrier that did not pass at once
cdef object _entry_ndarray = None       # numpy.ndarray: the one type the C paths take


def entry_attach(lane, barrier):
    """Point the C entry points at ``lane`` (a Lane or None) and ``barrier``."""
    global _entry_lane, _entry_barrier
    _entry_lane = lane if isinstance(lane, Lane) else None
    _entry_barrier = barrier


def entry_fallbacks(ndarray, send_py, send_general, recv_py, recv_general, barrier_py, barrier_rest):
    """numpy.ndarray, and the Python implementations the C entry points hand calls to."""
    global _entry_send_py, _entry_send_general, _entry_recv_py, _entry_recv_general
    global _entry_barrier_py, _entry_barrier_rest, _entry_ndarray
    _entry_ndarray = ndarray
    _entry_send_py, _entry_send_general = send_py, send_general
    _entry_recv_py, _entry_recv_general = recv_py, recv_general
    _entry_barrier_py, _entry_barrier_rest = barrier_py, barrier_rest


def send(tensor, dst, group=None, tag=0):
    """Send ``tensor`` to global rank ``dst``. Returns at once; ``wait()``
    returns when the bytes are handed over (the tensor may be reused then)."""
    if type(tensor) is not _entry_ndarray:
        return _entry_send_py(tensor, dst, group, tag)
    if _entry_lane is not None and group is None:
        req = (<Lane>_entry_lane).send(tensor, dst, tag)
        if req is not None:
            return req
    return _entry_send_general(tensor, dst, group, tag)


def recv(tensor, src=None, group=None, tag=0):
    """Receive into ``tensor`` from global rank ``src`` (any rank when None).
    The request's ``source`` tells the sender once complete."""
    if type(tensor) is not _entry_ndarray:
        return _entry_recv_py(tensor, src, group, tag)
    if _entry_lane is not None and group is None and src is not None:
        req = (<Lane>_entry_lane).recv(tensor, src, tag)
        if req is not None:
            return req
    return _entry_recv_general(tensor, src, group, tag)


def barrier(group=None, async_op=False, device_ids=None, timeout=None):
    """Return when every rank of the group has called barrier. ``timeout``
    (seconds or a timedelta, as torch's): this call's limit instead of the group's."""
    if group is None and async_op is False and timeout is None and _entry_barrier is not None:
        how = _entry_barrier()           # the default group's whole barrier, when the others are there
        if how > 0:
            return None
        return _entry_barrier_rest(how, device_ids)
    return _entry_barrier_py(group, async_op, device_ids, timeout)

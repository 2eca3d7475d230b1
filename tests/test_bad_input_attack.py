"""An outside tester's attempts to break README's error promise (the API
table's last row): "every message names the rank, the operation, what was
expected and what to do", with the house rule behind it: bad input gets a
clear error (a DistError, or the TypeError/ValueError a Python user expects),
never a crash, a bare error from deep inside, a hang or silently wrong data;
nothing already received is lost; and after a refused collective the group
stays usable ("a collective call one rank refuses still lines up every rank's
next call").

Every call is attacked through shmdist's own API (numpy; torch where
installed). The comments "Found by this attack and fixed" say what went wrong
before the fix their test checks; the rest is what held.
"""
from __future__ import annotations

import datetime
import re
import threading
import time

import numpy as np
import pytest

import shmdist as dist
from ranks import free_port

CLEAN = ("TypeError", "ValueError")     # besides DistError and its subclasses


def _init(rank, world_size, init_method, timeout=10):
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=timeout)


def _try(call):
    """(type name, message without the flight recorder's part, names of the type's bases)."""
    try:
        got = call()
        return ("ok", repr(got)[:200], ())
    except Exception as e:  # noqa: BLE001 - the point is to see every kind
        return (type(e).__name__, str(e).split("\nwhere each rank is")[0],
                tuple(c.__name__ for c in type(e).__mro__))


def _is_clear(outcome, rank, op, hint=None) -> str | None:
    """None when ``outcome`` is a clean error naming the rank and the operation
    (and ``hint``: what was expected or what to do); else why not."""
    kind, msg, bases = outcome
    if kind == "ok":
        return f"no error (returned {msg})"
    if "DistError" not in bases and kind not in CLEAN:
        return f"a bare {kind}: {msg!r}"
    for want in (f"rank {rank}", op) + ((hint,) if hint else ()):
        if want not in msg:
            return f"{kind} {msg!r} does not say {want!r}"
    return None


def _next_all_reduce(rank, group=None):
    x = np.full(3, rank + 1.0)
    outcome = _try(lambda: dist.all_reduce(x, group=group))
    return outcome[0], x.tolist()


# ================================================================ point to point: what held

def p2p_bad_arguments(rank, world_size, init_method):
    """Rank 0 sends two messages first; rank 1 makes every bad point-to-point
    call it can think of, then receives both, correctly."""
    _init(rank, world_size, init_method)
    solo = dist.new_group([0])               # rank 1 is not a member
    gone = dist.new_group([0, 1])
    dist.destroy_process_group(gone)
    out = {}
    if rank == 0:
        dist.send(np.arange(4.0), 1, tag=3).wait()
        dist.send(np.arange(4.0) + 10, 1, tag=4).wait()
        dist.send(np.array([7], dtype=np.int64), 1, tag=-(1 << 63)).wait()      # the extreme tags work
        dist.send(np.array([8], dtype=np.int64), 1, tag=(1 << 63) - 1).wait()
    dist.barrier()
    if rank == 1:
        ro = np.zeros(4)
        ro.flags.writeable = False
        z = np.zeros(4)
        calls = {
            ("send", "dst 1.0", "must be an int"): lambda: dist.send(z, 1.0),
            ("send", "dst True", "must be an int"): lambda: dist.send(z, True),
            ("send", "dst None", "must be an int"): lambda: dist.send(z, None),
            ("send", "dst -1", "is not a rank of the job"): lambda: dist.send(z, -1),
            ("send", "dst 7", "is not a rank of the job"): lambda: dist.send(z, 7),
            ("send", "dst 2**70", "is not a rank of the job"): lambda: dist.send(z, 1 << 70),
            ("send", "dst self", "own rank"): lambda: dist.send(z, 1),
            ("send", "tag 1.5", "tag must be an int"): lambda: dist.send(z, 0, tag=1.5),
            ("send", "tag None", "tag must be an int"): lambda: dist.send(z, 0, tag=None),
            ("send", "tag True", "tag must be an int"): lambda: dist.send(z, 0, tag=True),
            ("send", "tag 2**64", "64 bits"): lambda: dist.send(z, 0, tag=1 << 64),
            ("send", "tag -2**63-1", "64 bits"): lambda: dist.send(z, 0, tag=-(1 << 63) - 1),
            ("send", "None tensor", "numpy.ndarray or a torch.Tensor"): lambda: dist.send(None, 0),
            ("send", "list tensor", "numpy.asarray"): lambda: dist.send([1.0, 2.0], 0),
            ("send", "float tensor", "numpy.asarray"): lambda: dist.send(3.0, 0),
            ("send", "object array", "send_object_list"): lambda: dist.send(np.zeros(2, dtype=object), 0),
            ("send", "group str", "group must be"): lambda: dist.send(z, 0, group="g"),
            ("send", "non-member group", "not a member"): lambda: dist.send(z, 0, group=solo),
            ("send", "destroyed group", "was destroyed"): lambda: dist.send(z, 0, group=gone),
            ("recv", "src 5", "is not a rank of the job"): lambda: dist.recv(np.zeros(4), 5, tag=3),
            ("recv", "src -1", "is not a rank of the job"): lambda: dist.recv(np.zeros(4), -1, tag=3),
            ("recv", "src self", "own rank"): lambda: dist.recv(np.zeros(4), 1, tag=3),
            ("recv", "src 0.0", "must be an int"): lambda: dist.recv(np.zeros(4), 0.0, tag=3),
            ("recv", "tag str", "tag must be an int"): lambda: dist.recv(np.zeros(4), 0, tag="3"),
            ("recv", "tag 2**63", "64 bits"): lambda: dist.recv(np.zeros(4), 0, tag=1 << 63),
            ("recv", "read-only", "writable"): lambda: dist.recv(ro, 0, tag=3),
            ("recv", "read-only any source", "writable"): lambda: dist.recv(ro, None, tag=3),
            ("recv", "read-only strided", "writable"): lambda: dist.recv(_read_only(np.zeros(8)[::2]), 0, tag=3),
            ("recv", "list", "numpy.ndarray or a torch.Tensor"): lambda: dist.recv([0.0] * 4, 0, tag=3),
            ("recv", "None", "numpy.ndarray or a torch.Tensor"): lambda: dist.recv(None, None, tag=3),
            ("recv", "object array", "send_object_list"): lambda: dist.recv(np.zeros(4, dtype=object), 0, tag=3),
            ("recv", "group 0", "group must be"): lambda: dist.recv(np.zeros(4), 0, group=0, tag=3),
            ("recv", "non-member group", "not a member"): lambda: dist.recv(np.zeros(4), 0, group=solo, tag=3),
            ("recv", "destroyed group", "was destroyed"): lambda: dist.recv(np.zeros(4), 0, group=gone, tag=3),
            ("recv", "wrong dtype, any source", "was kept"):
                lambda: dist.recv(np.zeros(4, np.float32), None, tag=3).wait(timeout=10),
            ("recv", "wrong size, strided", "was kept"):
                lambda: dist.recv(np.zeros((3, 2))[:, 0], 0, tag=3).wait(timeout=10),
            ("recv", "wrong size, posted by batch", "was kept"):
                lambda: dist.batch_isend_irecv([dist.P2POp(dist.irecv, np.zeros(5), 0, tag=4)])[0].wait(timeout=10),
            ("send", "batch: bad peer", "is not a rank of the job"):
                lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, z, 9)]),
        }
        out["bad"] = {key: _try(call) for key, call in calls.items()}
        first, second = np.zeros(4), np.zeros((4, 3))[:, 1]
        tags = np.zeros(2, dtype=np.int64)
        out["first"] = _try(lambda: dist.recv(first, 0, tag=3).wait(timeout=10))
        out["second"] = _try(lambda: dist.recv(second, 0, tag=4).wait(timeout=10))
        out["tags"] = (_try(lambda: dist.recv(tags[:1], 0, tag=-(1 << 63)).wait(timeout=10)),
                       _try(lambda: dist.recv(tags[1:], 0, tag=(1 << 63) - 1).wait(timeout=10)))
        out["values"] = (first.tolist(), second.tolist(), tags.tolist())
        out["empty batch"] = _try(lambda: dist.batch_isend_irecv([]))
    dist.barrier()
    dist.destroy_process_group()
    return out


def _read_only(a):
    a.flags.writeable = False
    return a


@pytest.mark.timeout(60)
def test_bad_point_to_point_calls_are_refused_clearly_and_no_message_is_lost(run_ranks):
    got = run_ranks(p2p_bad_arguments, 2, timeout=50)[1]
    bad = [f"{what}: {why}" for (op, what, hint), outcome in got["bad"].items()
           if (why := _is_clear(outcome, 1, op, hint))]
    assert not bad, "\n".join(bad)
    assert got["first"][0] == got["second"][0] == "ok", got
    assert got["tags"][0][0] == got["tags"][1][0] == "ok", got["tags"]
    assert got["values"] == ([0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0], [7, 8]), \
        "the messages sent before the bad calls must reach the right receives"
    assert got["empty batch"] == ("ok", "[]", ())


def waits_cancel(rank, world_size, init_method):
    """wait(timeout=0) and wait(timeout=-1) on a receive nothing was sent to:
    a DistTimeoutError naming the rank and the receive, and the receive is
    cancelled, so the message sent afterwards goes to the next receive."""
    _init(rank, world_size, init_method)
    out = {}
    if rank == 1:
        for t in (0, -1, 0.05):
            req = dist.recv(np.zeros(3), 0, tag=1)
            out[t] = (_try(lambda: req.wait(timeout=t)), req.is_completed(),
                      isinstance(req.exception(), dist.DistTimeoutError))
    dist.barrier()
    if rank == 0:
        dist.send(np.array([1.0, 2.0, 3.0]), 1, tag=1).wait()
    else:
        box = np.zeros(3)
        out["after"] = (_try(lambda: dist.recv(box, 0, tag=1).wait(timeout=10)), box.tolist())
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
def test_wait_with_a_zero_or_negative_timeout_cancels_cleanly(run_ranks):
    got = run_ranks(waits_cancel, 2, timeout=50)[1]
    for t in (0, -1, 0.05):
        outcome, completed, is_timeout = got[t]
        assert outcome[0] == "DistTimeoutError" and _is_clear(outcome, 1, "recv from rank 0", "timeout") is None, got[t]
        assert completed and is_timeout, got[t]
    assert got["after"] == (("ok", "True", ()), [1.0, 2.0, 3.0]), got["after"]


# ================================================================ point to point: faults

def wait_bad_timeout(rank, world_size, init_method, bad):
    """Rank 1 waits on a pending receive with a bad timeout, in a thread that
    may take at most 3 s; then rank 0 sends and the receive must get it."""
    _init(rank, world_size, init_method, timeout=20)
    timeout = {"str": "x", "list": [1], "timedelta": datetime.timedelta(seconds=0.2),
               "nan": float("nan"), "inf": float("inf"), "True": True, "numpy int": np.int64(0)}[bad]
    out = {}
    if rank == 1:
        box = np.zeros(3)
        req = dist.recv(box, 0, tag=2)
        done = []
        waiter = threading.Thread(target=lambda: done.append(_try(lambda: req.wait(timeout=timeout))),
                                  daemon=True)
        start = time.monotonic()
        waiter.start()
        waiter.join(3)
        out["bad wait"] = done[0] if done else f"still blocked after {time.monotonic() - start:.1f} s"
    dist.barrier()
    if rank == 0:
        dist.send(np.array([4.0, 5.0, 6.0]), 1, tag=2).wait()
    else:
        waiter.join(10)
        if req.is_completed() and req.exception() is not None:     # cancelled: the next receive gets it
            req = dist.recv(box, 0, tag=2)
        out["then"] = (_try(lambda: req.wait(timeout=10)), box.tolist())
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
# Each found by this attack and fixed (engine.wait_limit): "x" and [1] were bare ValueError/TypeError
# from float(timeout) naming neither rank nor operation; a timedelta (what torch's Work.wait takes)
# a bare TypeError; nan never timed out (deadline = start + nan), ignoring even the group's timeout.
@pytest.mark.parametrize("bad", ["str", "list", "timedelta", "nan", "inf", "True", "numpy int"])
def test_wait_with_a_bad_timeout_is_a_clear_error_and_the_receive_survives(run_ranks, bad):
    got = run_ranks(wait_bad_timeout, 2, bad, timeout=50)[1]
    assert got["then"] == (("ok", "True", ()), [4.0, 5.0, 6.0]), \
        f"the receive (or the next one) must still get the message: {got['then']}"
    outcome = got["bad wait"]
    assert isinstance(outcome, tuple), outcome       # not blocked
    if bad in ("timedelta", "numpy int"):            # seconds, as torch's Work.wait and numpy give them
        assert outcome[0] == "DistTimeoutError", outcome
        return
    assert _is_clear(outcome, 1, "recv", "timeout") is None, outcome


def batch_with_a_bad_item(rank, world_size, init_method, item):
    """Rank 1 passes batch_isend_irecv a receive from rank 0 and a bad item.
    The call fails; the receive it posted first must not swallow rank 0's
    next message."""
    _init(rank, world_size, init_method, timeout=20)
    out = {}
    if rank == 1:
        early = np.zeros(2)
        bad = {"str": "junk", "tuple": (dist.irecv, np.zeros(2), 0), "None": None,
               "peer 7": dist.P2POp(dist.irecv, np.zeros(2), 7)}[item]     # refused while posting
        out["batch"] = _try(lambda: dist.batch_isend_irecv([dist.P2POp(dist.irecv, early, 0), bad]))
        out["None list"] = _try(lambda: dist.batch_isend_irecv(None))
    dist.barrier()
    if rank == 0:
        dist.send(np.array([1.0, 2.0]), 1).wait()
    else:
        box = np.zeros(2)
        out["next recv"] = (_try(lambda: dist.recv(box, 0).wait(timeout=2))[0], box.tolist())
        out["early"] = early.tolist()
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
# Found by this attack and fixed: batch_isend_irecv([P2POp(irecv, buf, 0), 'junk']) posts the
# receive, then fails with a bare AttributeError "'str' object has no attribute 'op'" (group.py
# batch_isend_irecv: no check of the list before posting, as torch's _check_p2p_op_list does); the
# orphan receive, whose request the caller never got, swallows rank 0's next message and the
# caller's next recv times out. batch_isend_irecv(None) is a bare 'NoneType' object is not
# iterable
@pytest.mark.parametrize("item", ["str", "peer 7"])
def test_batch_isend_irecv_with_a_bad_item_posts_nothing_and_says_so(run_ranks, item):
    """A bad item ("str": not a P2POp, so nothing is posted; "peer 7": refused while posting, so
    the receive posted before it is withdrawn): rank 0's next message goes to the next receive."""
    got = run_ranks(batch_with_a_bad_item, 2, item, timeout=50)[1]
    op, hint = ("batch_isend_irecv", None) if item == "str" else ("recv", "7")
    problems = [f"batch: {why}" for why in [_is_clear(got["batch"], 1, op, hint)] if why]
    if why := _is_clear(got["None list"], 1, "batch_isend_irecv"):
        problems.append(f"None list: {why}")
    if got["next recv"] != ("ok", [1.0, 2.0]) or got["early"] != [0.0, 0.0]:
        problems.append(f"the next recv from rank 0 got {got['next recv']} (the failed batch's receive "
                        f"{got['early']}): the failed batch's receive took the message")
    assert not problems, "\n".join(problems)


def objects_short_list(rank, world_size, init_method):
    _init(rank, world_size, init_method, timeout=20)
    out = {}
    if rank == 0:
        dist.send_object_list(["a", "b"], 1)
        dist.send_object_list(["c", "d"], 1)
    else:
        short = [None]
        out["short"] = _try(lambda: dist.recv_object_list(short, 0))
        first = [None, None]
        dist.recv_object_list(first, 0)
        out["first"] = first
        if first == ["a", "b"]:
            dist.recv_object_list([None, None], 0)
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
# Found by this attack and fixed: the objects were received and unpickled before the length
# check, so a refused receive dropped them and the next one got the sender's following message.
def test_recv_object_list_of_the_wrong_length_keeps_the_objects(run_ranks):
    got = run_ranks(objects_short_list, 2, timeout=50)[1]
    assert got["short"][0] == "DistMismatchError" and _is_clear(got["short"], 1, "recv_object_list") is None
    assert got["first"] == ["a", "b"], f"the objects of the refused receive were lost: the next receive got {got['first']}"


# ================================================================ collectives one rank refuses: what held

def _cases(rank, n, g):
    """name -> (the refusing rank, the op its error names, the kind the others'
    mismatch names, the call). Every rank makes the call; only one has bad arguments."""
    def Z(*shape, dtype=np.float64):
        return np.zeros(shape, dtype=dtype)
    bad = rank == 1
    ro = _read_only(Z(4))
    return {
        "broadcast src True": (1, "broadcast", "broadcast", lambda: dist.broadcast(Z(4), True if bad else 0, group=g)),
        "broadcast src 0.0": (1, "broadcast", "broadcast", lambda: dist.broadcast(Z(4), 0.0 if bad else 0, group=g)),
        "broadcast src 7": (1, "broadcast", "broadcast", lambda: dist.broadcast(Z(4), 7 if bad else 0, group=g)),
        "broadcast list": (1, "broadcast", "broadcast", lambda: dist.broadcast([0.0] * 4 if bad else Z(4), 0, group=g)),
        "broadcast read-only": (1, "broadcast", "broadcast", lambda: dist.broadcast(ro if bad else Z(4), 0, group=g)),
        "all_reduce op None": (1, "all_reduce", "all_reduce",
                               lambda: dist.all_reduce(Z(4), None if bad else dist.ReduceOp.SUM, group=g)),
        "all_reduce op 3": (1, "all_reduce", "all_reduce",
                            lambda: dist.all_reduce(Z(4), 3 if bad else dist.ReduceOp.SUM, group=g)),
        "all_reduce object dtype": (1, "all_reduce", "all_reduce",
                                    lambda: dist.all_reduce(Z(4, dtype=object) if bad else Z(4), group=g)),
        "all_reduce datetime": (1, "all_reduce", "all_reduce",
                                lambda: dist.all_reduce(Z(4, dtype="M8[s]") if bad else Z(4), group=g)),
        "all_reduce read-only": (1, "all_reduce", "all_reduce", lambda: dist.all_reduce(ro if bad else Z(4), group=g)),
        "reduce dst -1": (1, "reduce", "reduce", lambda: dist.reduce(Z(4), -1 if bad else 0, group=g)),
        "reduce dst '0'": (1, "reduce", "reduce", lambda: dist.reduce(Z(4), "0" if bad else 0, group=g)),
        "all_gather None item": (1, "all_gather", "all_gather",
                                 lambda: dist.all_gather([None if bad else Z(4)] + [Z(4)] * (n - 1), Z(4), group=g)),
        "all_gather not a list": (1, "all_gather", "all_gather",
                                  lambda: dist.all_gather(Z(4 * n) if bad else [Z(4)] * n, Z(4), group=g)),
        "all_gather_into_tensor dtype": (1, "all_gather_into_tensor", "all_gather",
                                         lambda: dist.all_gather_into_tensor(Z(4 * n, dtype=np.int64 if bad else np.float64),
                                                                             Z(4), group=g)),
        "gather list off the root": (1, "gather", "gather",
                                     lambda: dist.gather(Z(4), [Z(4)] * n if rank in (0, 1) else None, 0, group=g)),
        "gather root list short": (0, "gather", "gather",
                                   lambda: dist.gather(Z(4), [Z(4)] * (n - 1) if rank == 0 else None, 0, group=g)),
        "scatter root item size": (0, "scatter", "scatter",
                                   lambda: dist.scatter(Z(4), [Z(4), Z(5)] + [Z(4)] * (n - 2) if rank == 0 else None, 0,
                                                        group=g)),
        "reduce_scatter op": (1, "reduce_scatter", "reduce_scatter",
                              lambda: dist.reduce_scatter(Z(4), [Z(4)] * n, op="bogus" if bad else "sum", group=g)),
        "reduce_scatter dtype": (1, "reduce_scatter", "reduce_scatter",
                                 lambda: dist.reduce_scatter(Z(4, dtype=np.float32) if bad else Z(4), [Z(4)] * n, group=g)),
        "reduce_scatter_tensor size": (1, "reduce_scatter_tensor", "reduce_scatter",
                                       lambda: dist.reduce_scatter_tensor(Z(4), Z(4 * n + bad), group=g)),
        "all_to_all dtype": (1, "all_to_all", "all_to_all",
                             lambda: dist.all_to_all([Z(4, dtype=np.int32 if bad else np.float64)] * n, [Z(4)] * n, group=g)),
        "all_to_all_single negative split": (1, "all_to_all_single", "all_to_all",
                                             lambda: dist.all_to_all_single(Z(2 * n), Z(2 * n), [2] * n,
                                                                            [-1, 3] + [2] * (n - 2) if bad else [2] * n,
                                                                            group=g)),
        "all_to_all_single splits too long": (1, "all_to_all_single", "all_to_all",
                                              lambda: dist.all_to_all_single(Z(2 * n), Z(2 * n), [2] * n,
                                                                             [2] * n + [0] if bad else [2] * n, group=g)),
        "all_to_all_single rows not divisible": (1, "all_to_all_single", "all_to_all",
                                                 lambda: dist.all_to_all_single(Z(2 * n), Z(2 * n + bad), group=g)),
        "empty negative shape": (1, "empty", "empty", lambda: dist.empty((-1,) if bad else (4,), group=g)),
        "empty bad dtype": (1, "empty", "empty", lambda: dist.empty((4,), "nope" if bad else None, group=g)),
    }


def one_rank_refuses(rank, world_size, init_method, on_subgroup):
    _init(rank, world_size, init_method, timeout=8)
    g = dist.new_group(list(range(world_size))) if on_subgroup else None
    out = {}
    for name, (refuser, op, kind, call) in _cases(rank, world_size, g).items():
        out[name] = (_try(call), _next_all_reduce(rank, g))
        if out[name][1][0] != "ok":
            break       # the group is out of step: the rest would only repeat it
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(80)
@pytest.mark.parametrize("on_subgroup", [False, True], ids=["default-group", "subgroup"])
def test_a_collective_one_rank_refuses_keeps_every_rank_in_step(run_ranks, on_subgroup):
    n = 3
    got = run_ranks(one_rank_refuses, n, on_subgroup, timeout=70)
    problems = []
    for name, (refuser, op, kind, _) in _cases(0, n, None).items():
        for r in range(n):
            if name not in got[r]:
                problems.append(f"{name}: rank {r} never got there")
                continue
            outcome, after = got[r][name]
            if r == refuser:
                why = _is_clear(outcome, r, op)
            elif outcome[0] != "DistMismatchError":
                why = f"a valid caller got {outcome[:2]}, not a DistMismatchError"
            elif f"rank {refuser} called {kind} with arguments it refused" not in outcome[1]:
                why = f"the mismatch does not name rank {refuser}'s refusal: {outcome[1]!r}"
            else:
                why = None
            if why:
                problems.append(f"{name}, rank {r}: {why}")
            if after != ("ok", [6.0] * 3):
                problems.append(f"{name}, rank {r}: the next all_reduce gave {after}")
    assert not problems, "\n".join(problems)


# ================================================================ collectives: faults

def refused_barrier(rank, world_size, init_method, timeout):
    _init(rank, world_size, init_method, timeout=5)
    bad = {"str": "x", "negative": -1, "nan": float("nan")}[timeout]
    out = {"call": _try(lambda: dist.barrier(timeout=bad if rank == 1 else None))}
    out["next"] = _next_all_reduce(rank)
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
# Found by this attack and fixed: barrier(timeout='x') (or -1, nan) on one rank raises
# ValueError('timeout must be a positive number ...') from _seconds (collectives.py _barrier_py,
# before _enter/_refusing): it names neither the rank nor barrier, and that rank never takes part
# in the barrier, so the others' barrier pairs with its next all_reduce: both raise
# DistMismatchError and the group stays out of step
@pytest.mark.parametrize("timeout", ["str", "negative", "nan"])
def test_a_barrier_with_a_bad_timeout_on_one_rank_is_a_refused_call(run_ranks, timeout):
    got = run_ranks(refused_barrier, 2, timeout, timeout=50, errors="return")
    assert all(isinstance(g, dict) for g in got), got
    assert _is_clear(got[1]["call"], 1, "barrier", "timeout") is None, got[1]["call"]
    assert got[0]["call"][0] == "DistMismatchError", got[0]["call"]
    assert [g["next"] for g in got] == [("ok", [3.0] * 3)] * 2, [g["next"] for g in got]


OBJECT_CASES = ("all_gather_object unpicklable", "all_gather_object short list", "gather_object short list on dst",
                "gather_object bad dst", "broadcast_object_list unpicklable", "broadcast_object_list None",
                "scatter_object_list short input", "scatter_object_list empty output")


def object_call_one_rank_refuses(rank, world_size, init_method):
    """Each case on a fresh group of both ranks: one rank's arguments are bad;
    then both make a correct all_reduce on that group."""
    _init(rank, world_size, init_method, timeout=15)
    local = lambda: 0       # noqa: E731 - cannot be pickled
    cases = {
        "all_gather_object unpicklable": (1, lambda g: dist.all_gather_object([None, None], local if rank == 1 else 1, group=g)),
        "all_gather_object short list": (1, lambda g: dist.all_gather_object([None] * (1 if rank == 1 else 2), 1, group=g)),
        "gather_object short list on dst": (0, lambda g: dist.gather_object(1, [None] if rank == 0 else None, 0, group=g)),
        "gather_object bad dst": (1, lambda g: dist.gather_object(1, [None, None], 7 if rank == 1 else 0, group=g)),
        "broadcast_object_list unpicklable": (0, lambda g: dist.broadcast_object_list([local] if rank == 0 else [None], 0, group=g)),
        "broadcast_object_list None": (0, lambda g: dist.broadcast_object_list(None if rank == 0 else [None], 0, group=g)),
        "scatter_object_list short input": (0, lambda g: dist.scatter_object_list([None], [1] if rank == 0 else None, 0, group=g)),
        "scatter_object_list empty output": (1, lambda g: dist.scatter_object_list([] if rank == 1 else [None],
                                                                                    [1, 2] if rank == 0 else None, 0, group=g)),
    }
    out = {}
    for name, (refuser, call) in cases.items():
        made = []      # a group whose collectives give up after 1 s: a case left out of step costs 1 s
        if _try(lambda: made.append(dist.new_group([0, 1], timeout=1)))[0] != "ok":
            break
        out[name] = (refuser, _try(lambda: call(made[0])), _next_all_reduce(rank, made[0]))
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(80)
# Found by this attack and fixed: the object collectives checked and pickled outside _refusing,
# so the refusing rank took no part and its next call paired with the others' first internal one;
# an unpicklable object was a bare AttributeError.
def test_an_object_collective_one_rank_refuses_keeps_every_rank_in_step(run_ranks):
    got = run_ranks(object_call_one_rank_refuses, 2, timeout=70)
    problems = [f"{name}: not reached" for name in OBJECT_CASES if name not in got[0] or name not in got[1]]
    for name in set(got[0]) & set(got[1]):
        refuser = got[0][name][0]
        op = name.split()[0]
        why = _is_clear(got[refuser][name][1], refuser, op)
        if why:
            problems.append(f"{name}, refusing rank {refuser}: {why}")
        for r in (0, 1):
            if got[r][name][2] != ("ok", [3.0] * 3):
                problems.append(f"{name}, rank {r}: the next all_reduce gave {got[r][name][2]}")
    assert not problems, "\n".join(problems)


def wrong_data_after_refusal(rank, world_size, init_method):
    _init(rank, world_size, init_method, timeout=5)
    local = lambda: 0       # noqa: E731
    refused = _try(lambda: dist.all_gather_object([None, None], local if rank == 1 else {"x": 1}))
    gathered = np.zeros(2, dtype=np.int64)
    nxt = _try(lambda: dist.all_gather_into_tensor(gathered, np.array([100 + rank], dtype=np.int64)))
    dist.destroy_process_group()
    return refused[0], nxt[0], gathered.tolist()


@pytest.mark.timeout(60)
# Found by this attack and fixed: after such a refusal, a valid all_gather_into_tensor returned
# [21, 101] for [100, 101] (21: the size of rank 0's pickle), with no error.
def test_a_valid_call_after_a_refused_object_collective_gets_the_right_data(run_ranks):
    got = run_ranks(wrong_data_after_refusal, 2, timeout=50)
    assert got[1][2] in ([100, 101], [0, 0]), f"rank 1's valid all_gather_into_tensor returned {got[1][2]}"
    assert [g[1:] for g in got] == [("ok", [100, 101])] * 2, got


def split_sizes(rank, world_size, init_method):
    _init(rank, world_size, init_method, timeout=5)
    out = {}
    # consistent on both ranks: rank 0 sends 2.5 rows to rank 1, which expects 2.5 rows from it
    s = [1.5, 2.5] if rank == 0 else [2.5, 1.5]
    got = np.full(4, -1.0)
    out["fractional"] = (_try(lambda: dist.all_to_all_single(got, np.arange(4.0), s, s)), got.tolist(),
                         _next_all_reduce(rank))
    for name, sizes in (("None items", [None, None]), ("an int", 4), ("strings", ["2", "2"])):
        o = np.full(4, -1.0)
        out[name] = (_try(lambda: dist.all_to_all_single(o, np.arange(4.0), [2, 2], sizes if rank == 1 else [2, 2])),
                     o.tolist(), _next_all_reduce(rank))
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
# Found by this attack and fixed: all_to_all_single's split sizes are not checked to be ints
# (collectives.py _splits: only their count, sum and sign): [1.5, 2.5] passes, makes pieces of 12
# and 20 bytes, and fails deep in the exchange with a bare struct.error 'required argument is not
# an integer' after the own piece was partly copied into the output; None, an int or strings as
# split sizes raise bare TypeErrors ("unsupported operand type(s) for +", "'int' object is not
# iterable") naming neither rank nor operation (the group does stay in step)
def test_all_to_all_single_split_sizes_that_are_not_ints_are_refused_clearly(run_ranks):
    got = run_ranks(split_sizes, 2, timeout=50)
    problems = []
    for r in (0, 1):
        outcome, output, after = got[r]["fractional"]
        if why := _is_clear(outcome, r, "all_to_all_single", "split"):
            problems.append(f"fractional, rank {r}: {why}")
        if output != [-1.0] * 4:
            problems.append(f"fractional, rank {r}: the refused call wrote its output: {output}")
        if after != ("ok", [3.0] * 3):
            problems.append(f"fractional, rank {r}: next all_reduce {after}")
    for name in ("None items", "an int", "strings"):
        if why := _is_clear(got[1][name][0], 1, "all_to_all_single", "split"):
            problems.append(f"{name}: {why}")
        for r in (0, 1):
            if got[r][name][2] != ("ok", [3.0] * 3):
                problems.append(f"{name}, rank {r}: next all_reduce {got[r][name][2]}")
    assert not problems, "\n".join(problems)


# ================================================================ new_group

def new_group_one_rank_bad(rank, world_size, init_method, what):
    _init(rank, world_size, init_method, timeout=2)
    out = {}
    if rank == 1:
        bad = {"ranks": dict(ranks=[0, 5]), "timeout": dict(ranks=[0, 1], timeout="x")}[what]
        out["first"] = _try(lambda: dist.new_group(**bad))
    else:
        out["first"] = _try(lambda: dist.new_group([0, 1]))
    groups = []
    out["second"] = _try(lambda: groups.append(dist.new_group([0, 1])))
    out["all_reduce"] = _next_all_reduce(rank, groups[0]) if groups else None
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["ranks", "timeout"])
# Found by this attack and fixed: a rank's bad new_group raised before counting the call, so the
# others' new_group paired with its next one and later groups waited out the timeout.
def test_new_group_one_rank_refuses_raises_on_every_rank_and_the_job_goes_on(run_ranks, what):
    got = run_ranks(new_group_one_rank_bad, 2, what, timeout=50, errors="return")
    assert all(isinstance(g, dict) for g in got), got
    assert _is_clear(got[1]["first"], 1, "new_group") is None, got[1]["first"]
    assert got[0]["first"][0] != "ok", f"rank 0's new_group succeeded although rank 1's failed: {got[0]['first']}"
    assert [g["all_reduce"] for g in got] == [("ok", [3.0] * 3)] * 2, [(g["second"], g["all_reduce"]) for g in got]


# ================================================================ init_process_group and calls outside a job

def init_and_outside_calls(rank, world_size, init_method):
    good = f"tcp://127.0.0.1:{free_port()}"
    base = dict(backend="shm", init_method=good, rank=0, world_size=1, timeout=5)
    out = {"init": {}, "outside": {}}
    for name, change in {
        "world_size 0": dict(world_size=0), "world_size -5": dict(world_size=-5),
        "world_size '1'": dict(world_size="1"), "rank 3 of 2": dict(rank=3, world_size=2),
        "rank -2": dict(rank=-2, world_size=2), "backend nccl": dict(backend="nccl"),
        "scheme foo": dict(init_method="foo://x"), "tcp without port": dict(init_method="tcp://127.0.0.1"),
        "file without path": dict(init_method="file://"), "timeout 0": dict(timeout=0),
        "timeout nan": dict(timeout=float("nan")), "timeout 'x'": dict(timeout="x"),
        "timeout -timedelta": dict(timeout=datetime.timedelta(seconds=-3)),
    }.items():
        out["init"][name] = _try(lambda: dist.init_process_group(**{**base, **change}))
        assert not dist.is_initialized()
    z = np.zeros(2)
    calls = {
        "send": lambda: dist.send(z, 1), "recv": lambda: dist.recv(z, 1), "barrier": lambda: dist.barrier(),
        "broadcast": lambda: dist.broadcast(z, 0), "all_reduce": lambda: dist.all_reduce(z),
        "reduce": lambda: dist.reduce(z, 0), "all_gather": lambda: dist.all_gather([z], z),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(z, z[:1]),
        "gather": lambda: dist.gather(z, [z], 0), "scatter": lambda: dist.scatter(z, [z], 0),
        "reduce_scatter": lambda: dist.reduce_scatter(z, [z]),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(z, z),
        "all_to_all": lambda: dist.all_to_all([z], [z]), "all_to_all_single": lambda: dist.all_to_all_single(z, z),
        "broadcast_object_list": lambda: dist.broadcast_object_list([1], 0),
        "all_gather_object": lambda: dist.all_gather_object([None], 1),
        "gather_object": lambda: dist.gather_object(1, [None], 0),
        "scatter_object_list": lambda: dist.scatter_object_list([None], [1], 0),
        "new_group": lambda: dist.new_group([0]), "get_rank": lambda: dist.get_rank(),
        "get_world_size": lambda: dist.get_world_size(), "get_backend": lambda: dist.get_backend(),
        "memory_usage": lambda: dist.memory_usage(), "empty": lambda: dist.empty((2,)),
        "destroy_process_group": lambda: dist.destroy_process_group(),
    }
    for when in ("before init", "after destroy"):
        out["outside"][when] = {op: _try(call) for op, call in calls.items()}
        if when == "before init":
            dist.init_process_group(**{**base, "init_method": f"tcp://127.0.0.1:{free_port()}"})
            sub = dist.new_group([0])
            dist.destroy_process_group(sub)
            out["destroyed group"] = {op: _try(lambda: f(sub)) for op, f in {
                "all_reduce": lambda g: dist.all_reduce(z, group=g), "send": lambda g: dist.send(z, 0, group=g),
                "barrier": lambda g: dist.barrier(group=g), "get_rank": lambda g: dist.get_rank(g)}.items()}
            out["twice"] = _try(lambda: dist.init_process_group(**base))
            out["group str"] = _try(lambda: dist.all_reduce(z, group="WORLD"))
            dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
def test_init_refusals_and_calls_outside_a_job_are_clear(run_ranks):
    got = run_ranks(init_and_outside_calls, 1, timeout=50)[0]
    problems = []
    hints = {"world_size": "world_size", "rank": "distinct rank", "backend": "'shm'", "scheme": "tcp://HOST:PORT",
             "tcp": "tcp://HOST:PORT", "file": "file:///", "timeout": "positive number of seconds"}
    for name, (kind, msg, bases) in got["init"].items():
        if not (kind in CLEAN or "DistError" in bases) or hints[name.split()[0]] not in msg:
            problems.append(f"init {name}: {kind} {msg!r}")
    for when, results in got["outside"].items():
        for op, outcome in results.items():
            if outcome[0] != "DistNotInitializedError" or "init_process_group" not in outcome[1] or \
                    op not in outcome[1]:
                problems.append(f"{op} {when}: {outcome[:2]}")
    for op, outcome in got["destroyed group"].items():
        if why := _is_clear(outcome, 0, op, "was destroyed"):
            problems.append(f"{op} on a destroyed group: {why}")
    if why := _is_clear(got["twice"], 0, "init_process_group", "destroy_process_group first"):
        problems.append(f"init twice: {why}")
    if why := _is_clear(got["group str"], 0, "all_reduce", "ProcessGroup"):
        problems.append(f"group='WORLD': {why}")
    assert not problems, "\n".join(problems)


def init_bad(rank, world_size, init_method, case):
    port = free_port()
    kw = dict(backend="shm", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=3)
    kw.update({
        "init_method 5": dict(init_method=5),
        "store object()": dict(store=object()),
        "port 99999": dict(init_method="tcp://127.0.0.1:99999"),
        "rank 1.0": dict(rank=1.0, world_size=2),
        "rank '0'": dict(rank="0"),
        "rank True": dict(rank=True, world_size=2),
        "world_size True": dict(world_size=True),
        "timeout 'x'": dict(timeout="x"),
    }[case])
    outcome = _try(lambda: dist.init_process_group(**kw))
    if dist.is_initialized():
        dist.destroy_process_group()
    return outcome


INIT_FAULTS = {
    "init_method 5": ("init_method", "a bare AttributeError \"'int' object has no attribute 'decode'\" "
                      "(rendezvous.parse_init_method): expected a TypeError naming init_method"),
    "store object()": ("store", "a bare AttributeError \"'object' object has no attribute 'add'\" from deep in "
                       "_setup: expected a TypeError saying store must be a Store"),
    "port 99999": ("65535|range", "DistError 'port number missing in tcp://127.0.0.1:99999': the port is there, "
                   "out of range; the message says the wrong thing"),
    "rank 1.0": ("int", "DistError 'rank 1.0 is outside [0, 2)' (group.py:226): 1.0 is inside; the type "
                 "is wrong and the message does not say so"),
    "rank '0'": ("int", "DistError \"rank '0' is outside [0, 1)\": the type is wrong, not the range"),
    "rank True": ("int", "rank=True is taken as rank 1 (isinstance(True, int), group.py:226), where every "
                  "other rank argument (dst, src, roots, new_group) refuses bools; it then waits for a master "
                  "as rank 1"),
    "world_size True": ("int", "world_size=True is taken as a world of 1 and the init succeeds"),
    "timeout 'x'": ("init_process_group", "ValueError 'timeout must be a positive number of seconds ...' "
                    "(group.py _seconds) does not name init_process_group (nor new_group/barrier where the same "
                    "check runs)"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(INIT_FAULTS))      # each found by this attack and fixed
def test_init_process_group_bad_argument_types_are_clear(run_ranks, case):
    outcome = run_ranks(init_bad, 1, case, timeout=25)[0]
    hint = INIT_FAULTS[case][0]
    kind, msg, bases = outcome
    assert kind in CLEAN or "DistError" in bases, outcome
    assert "Timeout" not in kind, f"not refused up front: {outcome}"
    assert re.search(rf"\b(?:{hint})\b", msg) and ("init_process_group" in msg or "initializing" in msg), outcome


# ================================================================ torch tensors

def torch_refusals(rank, world_size, init_method):
    import torch
    import torch.distributed as tdist
    _init(rank, world_size, init_method)
    out = {}
    if rank == 0:
        dist.send(torch.arange(4.0), 1, tag=1).wait()
    dist.barrier()
    if rank == 1:
        out["p2p"] = {
            ("recv", "meta", "CPU tensors only"): _try(lambda: dist.recv(torch.zeros(4, device="meta"), 0, tag=1)),
            ("send", "sparse", "dense"): _try(lambda: dist.send(torch.zeros(4).to_sparse(), 0)),
            ("recv", "torch scalar src", "must be an int"): _try(lambda: dist.recv(torch.zeros(4), torch.tensor(0), tag=1)),
        }
        box = torch.zeros(4)
        out["kept"] = (_try(lambda: dist.recv(box, 0, tag=1).wait(timeout=10))[0], box.tolist())
    steps = {
        "all_reduce float8": lambda: dist.all_reduce(torch.zeros(4, dtype=torch.float8_e4m3fn) if rank == 1
                                                     else torch.zeros(4)),
        "all_reduce premul_sum": lambda: dist.all_reduce(torch.ones(2), tdist._make_nccl_premul_sum(2.0) if rank == 1
                                                         else dist.ReduceOp.SUM),
        "all_reduce torch BAND on float": lambda: dist.all_reduce(torch.ones(2), tdist.ReduceOp.BAND if rank == 1
                                                                  else tdist.ReduceOp.SUM),
        "broadcast meta": lambda: dist.broadcast(torch.zeros(2, device="meta") if rank == 1 else torch.zeros(2), 0),
    }
    out["collectives"] = {}
    for name, call in steps.items():
        x = torch.full((3,), rank + 1.0)
        first = _try(call)
        after = _try(lambda: dist.all_reduce(x))
        out["collectives"][name] = (first, after[0], x.tolist())
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
def test_torch_tensors_that_cannot_move_are_refused_clearly_and_lined_up(run_ranks):
    pytest.importorskip("torch")
    got = run_ranks(torch_refusals, 2, timeout=50)
    problems = [f"{what}: {why}" for (op, what, hint), o in got[1]["p2p"].items() if (why := _is_clear(o, 1, op, hint))]
    if got[1]["kept"] != ("ok", [0.0, 1.0, 2.0, 3.0]):
        problems.append(f"the message sent before the bad calls: {got[1]['kept']}")
    for name, (first, after, x) in got[1]["collectives"].items():
        if why := _is_clear(first, 1, name.split()[0]):
            problems.append(f"{name}: {why}")
    for r in (0, 1):
        for name, (first, after, x) in got[r]["collectives"].items():
            if (after, x) != ("ok", [3.0] * 3):
                problems.append(f"{name}, rank {r}: the next all_reduce gave {after} {x}")
    assert not problems, "\n".join(problems)


def torch_overlapping_receive(rank, world_size, init_method):
    import torch
    _init(rank, world_size, init_method, timeout=10)
    out = {}
    if rank == 1:
        expanded = torch.zeros(1).expand(4)           # writable to torch's eye, one element 4 times
        held = []
        posted = _try(lambda: held.append(dist.irecv(expanded, 0, tag=1)))   # refused here, or later
        box = torch.zeros(4)
        second = dist.irecv(box, 0, tag=2)
    dist.barrier()
    if rank == 0:
        dist.send(torch.arange(4.0), 1, tag=1).wait()
        dist.send(torch.arange(4.0) + 10, 1, tag=2).wait()
    dist.barrier()
    if rank == 1:
        out["second"] = _try(lambda: second.wait(timeout=3))      # the valid one first
        out["first"] = _try(lambda: held[0].wait(timeout=3)) if held else posted
        out["box"] = box.tolist()
        again = torch.zeros(4)
        out["again"] = (_try(lambda: dist.recv(again, 0, tag=1).wait(timeout=1))[0], again.tolist())
    dist.barrier()
    target = torch.zeros(1).expand(4) if rank == 1 else torch.arange(4.0)
    out["broadcast"] = _try(lambda: dist.broadcast(target, 0))
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
# Found by this attack and fixed: A torch receive buffer with internal overlap
# (torch.zeros(1).expand(4)) is taken (tensors.py _torch_buf: not contiguous -> a temporary,
# copied back by finish()); on arrival finish() raises torch's bare RuntimeError 'unsupported
# operation: more than one element of the written-to tensor refers to a single memory location'
# inside Engine.progress (engine.py _complete_recv), out of the wait of ANOTHER, valid request;
# the receive itself is never completed (its wait then times out claiming 'part of the message
# already moved'), and the message is lost. A broadcast into such a tensor raises the same bare
# RuntimeError after the collective. numpy's equivalent (broadcast_to) is read-only and refused
def test_a_torch_receive_buffer_with_internal_overlap_is_refused_and_loses_nothing(run_ranks):
    pytest.importorskip("torch")
    got = run_ranks(torch_overlapping_receive, 2, timeout=50)[1]
    problems = []
    if why := _is_clear(got["first"], 1, "recv"):
        problems.append(f"the overlapping receive: {why}")
    elif got["first"][0] == "DistTimeoutError":
        problems.append(f"the overlapping receive was never completed, its wait timed out: {got['first'][1]!r}")
    if got["second"][0] != "ok" or got["box"] != [10.0, 11.0, 12.0, 13.0]:
        problems.append(f"the valid receive beside it got {got['second'][:2]} and {got['box']}")
    if got["again"] != ("ok", [0.0, 1.0, 2.0, 3.0]):
        problems.append(f"the message of the refused receive is lost: a receive after it got {got['again']}")
    if why := _is_clear(got["broadcast"], 1, "broadcast"):
        problems.append(f"broadcast into it: {why}")
    assert not problems, "\n".join(problems)

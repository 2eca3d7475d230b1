"""Run a function as N real ranks, each in its own process, and collect what they return.

    from ranks import run_ranks

    def ping(rank, world_size, init_method, n):          # module level, so it pickles
        dist.init_process_group("shm", init_method, rank=rank, world_size=world_size)
        ...
        return something_picklable

    results = run_ranks(ping, 2, 5, timeout=60, env={"SHMDIST_RING_BYTES": "65536"})

Every rank calls ``target(rank, world_size, init_method, *args)`` in a fresh
interpreter (multiprocessing "spawn"), with ``init_method`` set to
``tcp://127.0.0.1:<free port>``. ``run_ranks`` returns the ranks' return
values, indexed by rank.

- When a rank raises, the others are killed at once and ``RankFailed`` is
  raised here with that rank's traceback text.
- When ``timeout`` passes, every rank is killed (after dumping its Python
  stacks to stderr, which pytest shows) and ``RankTimeout`` names the ranks
  that had not finished.
- With ``errors="return"``, a rank that raises or dies gives a ``RankError``
  in its slot instead, and the other ranks run on: tests assert on the
  error's type and message (``results[1].exc`` is the exception object).

``env`` sets (or, with a value of None, removes) environment variables of
every rank from the start of its interpreter, so even what is read at import
time sees them. The conftest fixture of the same name
also gives each test its own SHMDIST_JOB_ID, so that the shared memory a
test leaves behind can be told apart from that of anyone else on the host.
"""
from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import time
import traceback

DUMP_SIGNAL = signal.SIGUSR1   # a rank that gets it prints the stacks of its threads
FAIL_GRACE = 1.0              # seconds the other ranks get to report their own errors after one failed


class RankFailed(Exception):
    """A rank raised or died while the test expected it to succeed."""


class RankTimeout(Exception):
    """Some ranks did not finish within the timeout."""


class RankError:
    """What a rank that failed left behind (returned with ``errors="return"``).

    ``exc`` is the exception the rank raised (None when it died without
    raising, or when the exception did not survive pickling); ``type`` and
    ``message`` are its class name and ``str()``; ``exitcode`` is the
    process's exit code, negative for a signal (-9 for SIGKILL).
    """

    def __init__(self, rank: int, exc: BaseException | None, type_name: str, message: str,
                 traceback_text: str, exitcode: int | None = None):
        self.rank = rank
        self.exc = exc
        self.type = type_name
        self.message = message
        self.traceback = traceback_text
        self.exitcode = exitcode

    def __repr__(self) -> str:
        if self.type:
            return f"<RankError rank {self.rank}: {self.type}: {self.message}>"
        return f"<RankError rank {self.rank}: exited with code {self.exitcode} without a result>"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def wait_until_gone(pid: int, timeout: float = 30) -> None:
    """Block until process ``pid`` has exited."""
    deadline = time.monotonic() + timeout
    while not process_gone(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not exit within {timeout:g} s")
        time.sleep(0.01)


@contextlib.contextmanager
def _environment(env: dict):
    """This process's environment changed by ``env`` (None removes), restored on exit;
    processes started inside inherit it."""
    saved = {key: os.environ.get(key) for key in env}
    _apply(env)
    try:
        yield
    finally:
        _apply(saved)


def _apply(env: dict) -> None:
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = str(value)


def _rank_main(target, rank, world_size, init_method, args, conn):
    """The body of one rank's process: run the target, send back its result or error."""
    faulthandler.register(DUMP_SIGNAL, all_threads=True)
    try:
        reply = ("ok", target(rank, world_size, init_method, *args))
    except BaseException as e:
        reply = ("error", _error_of(rank, e))
    try:
        conn.send(reply)
    except Exception as e:   # the return value did not pickle
        conn.send(("error", _error_of(rank, e)))
    conn.close()


def _error_of(rank: int, e: BaseException) -> RankError:
    text = "".join(traceback.format_exception(e))
    error = RankError(rank, e, type(e).__name__, str(e), text)
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:   # some exceptions pickle but cannot be rebuilt
        error.exc = None
    return error


def run_ranks(target, world_size: int, *args, timeout: float = 60, env: dict | None = None,
              errors: str = "raise", init_method: str | None = None) -> list:
    """Run ``target`` as ranks 0..world_size-1; see the module docstring."""
    if errors not in ("raise", "return"):
        raise ValueError(f"errors must be 'raise' or 'return', got {errors!r}")
    init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
    ctx = multiprocessing.get_context("spawn")
    procs, conns = [], []
    try:
        with _environment(env or {}):
            for rank in range(world_size):
                mine, theirs = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_rank_main, name=f"rank-{rank}",
                                args=(target, rank, world_size, init_method, args, theirs))
                p.start()
                theirs.close()
                procs.append(p)
                conns.append(mine)
        return _collect(procs, conns, timeout, errors)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        for c in conns:
            c.close()


_PENDING = object()


def _collect(procs, conns, timeout: float, errors: str) -> list:
    """Read each rank's reply (a rank that dies closes its pipe without one)."""
    deadline = time.monotonic() + timeout
    results = [_PENDING] * len(procs)
    waiting = {c: rank for rank, c in enumerate(conns)}
    while waiting:
        left = deadline - time.monotonic()
        ready = multiprocessing.connection.wait(list(waiting), left) if left > 0 else []
        if not ready:
            _time_out(procs, sorted(waiting.values()), timeout, "had not finished")
        for conn in ready:
            rank = waiting.pop(conn)
            try:
                status, value = conn.recv()
            except EOFError:
                procs[rank].join(max(0.0, deadline - time.monotonic()))
                code = procs[rank].exitcode
                status, value = "error", RankError(rank, None, "", f"exited with code {code} without "
                                                   "a result", "", code)
            if status == "error" and errors == "raise":
                _fail(procs, rank, value, _late_errors(waiting, FAIL_GRACE))
            results[rank] = value
    for rank, p in enumerate(procs):
        p.join(max(0.0, deadline - time.monotonic()))
    stuck = [rank for rank, p in enumerate(procs) if p.is_alive()]
    if stuck:
        _time_out(procs, stuck, timeout, "returned a result but did not exit")
    for rank, res in enumerate(results):
        if isinstance(res, RankError):
            res.exitcode = procs[rank].exitcode
    return results


def _late_errors(waiting: dict, grace: float) -> list:
    """The errors other ranks report within ``grace`` seconds of the first
    one: that one is often only the consequence (a peer that left) of
    another rank's failure, whose traceback is the one that explains it."""
    found = []
    end = time.monotonic() + grace
    while waiting:
        left = end - time.monotonic()
        ready = multiprocessing.connection.wait(list(waiting), left) if left > 0 else []
        if not ready:
            break
        for conn in ready:
            waiting.pop(conn)
            try:
                status, value = conn.recv()
            except EOFError:
                continue
            if status == "error":
                found.append(value)
    return found


def _fail(procs, rank: int, error: RankError, also: list = ()):
    others = [r for r, p in enumerate(procs) if r != rank and p.is_alive()]
    for r in others:
        procs[r].kill()
    killed = f" (killed ranks {others}, still running)" if others else ""
    what = f"raised {error.type}: {error.message}" if error.type else error.message
    more = "".join(f"\n\n--- rank {e.rank} raised too: {e.type}: {e.message} ---\n{e.traceback}"
                   for e in also)
    raise RankFailed(f"rank {rank} {what}{killed}\n\n--- traceback of rank {rank} ---\n"
                     f"{error.traceback}{more}")


def _time_out(procs, late: list, timeout: float, why: str):
    for r in late:
        if procs[r].is_alive():
            os.kill(procs[r].pid, DUMP_SIGNAL)
    time.sleep(0.5)   # let them print their stacks
    for p in procs:
        if p.is_alive():
            p.kill()
    raise RankTimeout(f"ranks {late} {why} within {timeout:g} s and were killed; their Python stacks "
                      "are in the captured stderr")

"""shmdist-run: start the ranks of a job on this host, as torchrun does.

    shmdist-run --nproc-per-node 4 train.py --lr 0.1
    shmdist-run -n 2 -m mypackage.main
    python -m shmdist.run -n 2 --prefix-output train.py

Each rank is ``python script.py args...`` (or ``python -m module args...``)
with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
and SHMDIST_JOB_ID set, so ``init_process_group()`` (env://) needs no
arguments. OMP_NUM_THREADS defaults to 1 when several ranks share the host,
as under torchrun.

When a rank fails (non-zero exit or a signal) the launcher stops the others:
SIGTERM, then SIGKILL for those still alive after a grace period. SIGINT or
SIGTERM sent to the launcher is forwarded to every rank the same way. There
is no shared memory to sweep afterwards: segments have no name (memfd) and go
with the ranks, however they end. A launcher that is itself killed takes
its ranks with it (PR_SET_PDEATHSIG).
It holds each rank's flight recorder open (see trace.py): SIGUSR1 prints
where every rank is and why it waits, as does ``--hang-after S`` once no
rank progressed for S seconds while one waits.
The launcher exits 0 when every rank did, else with the failing rank's exit
code (128 + the signal number for a signal).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

from shmdist import settings, trace
from shmdist.rendezvous.store import JOB_ENV

GRACE_SECONDS = 5.0   # between SIGTERM (or a forwarded signal) and SIGKILL
POLL_SECONDS = 0.05
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="shmdist-run", allow_abbrev=False,
        description="Start the ranks of a shmdist (or torch.distributed-style) job on this host.")
    p.add_argument("-n", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=1,
                   help="ranks to start on this host (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="hosts in the job (default 1)")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                   help="this host's index among the nnodes hosts (default 0)")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default="127.0.0.1",
                   help="host of rank 0, where the rendezvous store listens (default 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                   help="port of the rendezvous store (default: a free port, single-host jobs only)")
    p.add_argument("--tee", "--prefix-output", dest="prefix", action="store_true",
                   help='prefix every line the ranks print with "[rank N] "')
    p.add_argument("--hang-after", dest="hang_after", type=float, default=None, metavar="S",
                   help="print where each rank is (flight recorder) when no rank progressed for S "
                        "seconds while one waits; SIGUSR1 prints it at any time")
    p.add_argument("-m", "--module", action="store_true",
                   help="run the target as a module (python -m), not as a script")
    p.add_argument("target", metavar="script.py | module", help="what each rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed on to every rank")
    a = p.parse_args(argv)
    if a.nproc < 1:
        p.error(f"--nproc-per-node must be at least 1, got {a.nproc}")
    if a.nnodes < 1:
        p.error(f"--nnodes must be at least 1, got {a.nnodes}")
    if not 0 <= a.node_rank < a.nnodes:
        p.error(f"--node-rank {a.node_rank} is outside [0, {a.nnodes}); number the hosts 0 to {a.nnodes - 1}")
    if a.master_port is None and a.nnodes > 1:
        p.error("with --nnodes > 1 pass --master-port (the same on every host); "
                "a free port picked here would not be known to the other hosts")
    if a.hang_after is not None and not a.hang_after > 0:    # (0 turned it off, below 0 spoke at every wait)
        p.error(f"--hang-after {a.hang_after:g} must be a number of seconds above 0")
    if a.master_port is not None and not 0 < a.master_port < 65536:
        p.error(f"--master-port {a.master_port} is not a TCP port (1-65535)")
    return a


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _die_with_launcher(launcher_pid: int):
    """What each rank runs before exec: the kernel kills the rank if the
    launcher dies without stopping it (a SIGKILL, a crash). None where
    there is no prctl (not Linux): ranks then outlive a killed launcher."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "prctl"):
        return None

    def arm():
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != launcher_pid:
            os._exit(1)           # the launcher died before prctl took effect
    return arm


def _describe(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by signal {signal.Signals(-code).name}"
    except ValueError:     # a real-time signal has no name
        return f"was killed by signal {-code}"


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


class Job:
    """The ranks of one launch on this host."""

    def __init__(self, a: argparse.Namespace):
        self.a = a
        inherited = settings.get(JOB_ENV)   # a launcher inside a test or another job: nest its id
        self.job_id = f"{inherited}-{secrets.token_hex(6)}" if inherited else secrets.token_hex(6)
        if a.nnodes > 1:
            # Every host's launcher must give the same id (the store refuses ranks of another
            # job): the one the user set for all of them, or none.
            self.job_id = inherited or ""
        self.port = a.master_port or _free_port()
        self.procs: dict[int, subprocess.Popen] = {}   # global rank -> its process
        self.copiers: list[threading.Thread] = []
        self.out_lock = threading.Lock()
        self.signalled = 0
        self.watch = trace.JobWatch(a.nnodes * a.nproc, a.hang_after)   # the ranks' flight recorders
        self.report_asked = False

    def _env(self, local_rank: int) -> dict[str, str]:
        a = self.a
        env = dict(os.environ)
        env.update(RANK=str(a.node_rank * a.nproc + local_rank), WORLD_SIZE=str(a.nnodes * a.nproc),
                   LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(a.nproc),
                   MASTER_ADDR=a.master_addr, MASTER_PORT=str(self.port))
        if self.job_id:
            env[JOB_ENV] = self.job_id
        else:
            env.pop(JOB_ENV, None)
        if a.nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        if a.prefix:
            env.setdefault("PYTHONUNBUFFERED", "1")   # lines show up as printed, not at exit
        return env

    def start(self) -> None:
        a = self.a
        cmd = [sys.executable, "-m", a.target] if a.module else [sys.executable, a.target]
        pipe = subprocess.PIPE if a.prefix else None
        arm = _die_with_launcher(os.getpid())
        for local in range(a.nproc):
            if self.signalled:
                break             # told to stop while starting: start no more ranks
            rank = a.node_rank * a.nproc + local
            self.procs[rank] = subprocess.Popen(cmd + a.args, env=self._env(local), stdout=pipe,
                                                stderr=pipe, preexec_fn=arm)
        if a.prefix:
            for rank, p in self.procs.items():
                self._copy(rank, p.stdout, sys.stdout)
                self._copy(rank, p.stderr, sys.stderr)

    def _copy(self, rank: int, pipe, dest) -> None:
        prefix = f"[rank {rank}] ".encode()

        def run():
            for line in pipe:
                if not line.endswith(b"\n"):
                    line += b"\n"     # the last line of a rank that did not end it
                with self.out_lock:
                    dest.buffer.write(prefix + line)
                    dest.flush()
            pipe.close()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.copiers.append(t)

    def on_report(self, signum, frame) -> None:
        self.report_asked = True

    def _watch(self) -> None:
        """Hold the ranks' flight recorders; print the table when asked or stalled."""
        self.watch.hold(self.procs)
        text = self.watch.stalled()
        if self.report_asked:
            self.report_asked = False
            text = f"SIGUSR1:\n{self.watch.report()}"
        if text:
            self._log(text)

    def on_signal(self, signum, frame) -> None:
        self.signalled = signum
        for p in self.procs.values():
            p.send_signal(signum)    # does nothing for a rank already reaped

    def wait(self) -> int:
        """Wait for every rank; stop the rest when one fails. Returns the exit code."""
        while True:
            if self.signalled:
                name = signal.Signals(self.signalled).name
                self._log(f"got {name}; forwarded it to every rank")
                self._stop(already_signalled=True)
                return 128 + self.signalled
            codes = {rank: p.poll() for rank, p in self.procs.items()}
            failed = [rank for rank, code in codes.items() if code not in (None, 0)]
            if failed:
                # Ranks that exit because a peer died follow it within a poll or two: name the
                # one a signal ended first (the likely cause), else the lowest rank.
                rank = min(failed, key=lambda r: (codes[r] >= 0, r))
                p, code = self.procs[rank], codes[rank]
                others = any(q.poll() is None for q in self.procs.values())
                stopped = "; stopped the other ranks" if others else ""
                self._log(f"rank {rank} (pid {p.pid}) {_describe(code)}{stopped}")
                self._stop(already_signalled=False)
                return _exit_code(code)
            if all(code is not None for code in codes.values()):
                return 0
            self._watch()
            time.sleep(POLL_SECONDS)

    def _stop(self, already_signalled: bool) -> None:
        """End the ranks still running: SIGTERM (unless a signal was just
        forwarded), then SIGKILL after the grace period."""
        live = [(r, p) for r, p in self.procs.items() if p.poll() is None]
        if not already_signalled:
            for _, p in live:
                p.terminate()
        deadline = time.monotonic() + GRACE_SECONDS
        for rank, p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                self._log(f"rank {rank} (pid {p.pid}) was still running {GRACE_SECONDS:g}s after being "
                          "told to stop; killed it (SIGKILL)")

    def finish(self) -> None:
        for t in self.copiers:
            t.join(timeout=1.0)   # a grandchild may hold a pipe open: do not wait for it forever

    def _log(self, message: str) -> None:
        with self.out_lock:
            print(f"shmdist-run: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    job = Job(_parse(argv))
    previous = {s: signal.signal(s, job.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, job.on_report)
    try:
        job.start()
        code = job.wait()
    finally:
        job._stop(already_signalled=False)   # only does something if start() or wait() raised
        for s, handler in previous.items():
            signal.signal(s, handler)
        job.finish()
        job.watch.close()
    sys.exit(code)


if __name__ == "__main__":
    main()

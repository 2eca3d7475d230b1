"""shmdist against its peers on this host, in one run: ``python -m shmdist.bench``.

Spawns the ranks itself and measures, side by side:

- shmdist (ranks started here, rendezvous on tcp://127.0.0.1:<free port>),
- torch.distributed with gloo (same harness; skipped when torch is absent),
- mpi4py under every MPI found: the ``mpiexec`` beside each Python given by
  ``--mpi-python`` (default: this Python and ``./.venv*/bin/python``),
- DeepSpeed's shared-memory all_reduce (``inference_all_reduce``, the op of
  CPU inference) under the Python given by ``--ds-python``, all_reduce rows only,
- a one-process numpy copy (``np.copyto``, ``a += b``): the physical reference.

Every figure is a median over many iterations after a warm-up. Each point has
a timeout: a point that hangs (more ranks than cores) is killed, reported, and
the run goes on with the next point. Progress goes to stderr, the table to
stdout. The same file is the rank program (``--worker``): for MPI it runs as a
plain script (``python -I bench.py``) and needs only numpy and mpi4py there
(for DeepSpeed: numpy, torch and deepspeed).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import queue
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import NamedTuple

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
LATENCY_SIZES = (8, 4 * KiB, 64 * KiB, MiB, 16 * MiB, 256 * MiB)
BANDWIDTH_SIZES = (4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB, 256 * MiB)
# the other send/recv patterns: a loop of blocking sends, and both ranks sending at once
STREAM_SIZES = BANDWIDTH_SIZES
ALL_REDUCE_SIZES = (4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB)
BROADCAST_SIZES = (16 * MiB,)
KINDS = ("latency", "bandwidth", "blocking", "bidir", "all_reduce", "all_reduce_bf16", "all_reduce_fp16",
         "broadcast", "barrier", "idle")
# all_reduce (SUM) of each dtype: float32 as numpy arrays, the 16-bit floats as torch tensors
REDUCE_DTYPES = {"all_reduce": "float32", "all_reduce_bf16": "bfloat16", "all_reduce_fp16": "float16"}
P2P = ("latency", "bandwidth", "blocking", "bidir")
COLLECTIVES = ("all_reduce", "broadcast", "barrier")
BACKENDS = ("shmdist", "shmdist-empty", "shmdist-tcp", "gloo", "mpi", "deepspeed", "memcpy")
PEERS_ORDER = ("shmdist", "shmdist empty", "shmdist tcp", "gloo", "MPICH", "Open MPI", "DeepSpeed", "memcpy")
OURS = ("shmdist", "shmdist empty", "shmdist tcp", "memcpy")   # not peers: the ratio compares shmdist with the others
EMPTY = "shmdist empty"   # shmdist on arrays from shmdist.empty (all_reduce and broadcast in place): its own ratio column
IDLE_SECONDS = 1.0
BANDWIDTH_WINDOW = 32 * MiB      # bytes in flight per bandwidth iteration (at most 64 messages)
LINE = "@shmdist-bench "         # prefix of the lines rank 0 reports on stdout

# Iteration settings: seconds of timed work per point, fewest and most timed iterations.
FULL = {"budget": 1.0, "min_iters": 10, "max_iters": 200_000, "idle_reps": 3}
QUICK = {"budget": 0.12, "min_iters": 4, "max_iters": 20_000, "idle_reps": 1}
PROBE_ITERS = 3     # untimed iterations that size the run, before the warm-up proper


class Point(NamedTuple):
    kind: str
    nbytes: int
    ranks: int


def plan(kinds, ranks, sizes=None) -> list[Point]:
    """The table's rows, in order. p2p figures and the idle cost use 2 ranks. ``sizes``
    (bytes), when given, replaces the sizes of every sized figure (``--sizes``)."""
    def each(default):
        return sizes or default
    rows = []
    if "latency" in kinds:
        rows += [Point("latency", n, 2) for n in each(LATENCY_SIZES)]
    if "bandwidth" in kinds:
        rows += [Point("bandwidth", n, 2) for n in each(BANDWIDTH_SIZES)]
    for kind in ("blocking", "bidir"):
        if kind in kinds:
            rows += [Point(kind, n, 2) for n in each(STREAM_SIZES)]
    for r in ranks:
        for kind in REDUCE_DTYPES:
            if kind in kinds:
                rows += [Point(kind, n, r) for n in each(ALL_REDUCE_SIZES)]
        if "broadcast" in kinds:
            rows += [Point("broadcast", n, r) for n in each(BROADCAST_SIZES)]
        if "barrier" in kinds:
            rows.append(Point("barrier", 0, r))
    if "idle" in kinds:
        rows.append(Point("idle", 8, 2))
    return rows


# ================================================================ rank side

class ShmdistComm:
    def __init__(self, rank: int, world: int, port: int, timeout: float, backend: str = "shm"):
        import shmdist
        self.d = shmdist
        shmdist.init_process_group(backend, f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                   timeout=timeout)
        self.rank, self.size = rank, world
        self.version = f"shmdist {shmdist.__version__}"

    def wrap(self, arr):
        return arr

    def send(self, buf, dst):
        self.d.send(buf, dst).wait()

    def recv(self, buf, src):
        self.d.recv(buf, src).wait()

    def isend(self, buf, dst):
        return self.d.isend(buf, dst)

    def irecv(self, buf, src):
        return self.d.irecv(buf, src)

    def wait_all(self, reqs):
        for r in reqs:
            r.wait()

    def all_reduce(self, buf):
        self.d.all_reduce(buf)

    def broadcast(self, buf, root):
        self.d.broadcast(buf, root)

    def barrier(self):
        self.d.barrier()

    def close(self):
        self.d.destroy_process_group()


class EmptyComm(ShmdistComm):
    """shmdist on arrays made by shmdist.empty: every buffer above the
    in-place threshold is a copy in shared memory (the ranks wrap the same
    sizes in the same order, so each wrap is the collective call it must be)."""

    def wrap(self, arr):
        from shmdist.comm.shared import IN_PLACE_MIN
        if arr.nbytes <= IN_PLACE_MIN:
            return arr
        out = self.d.empty(arr.shape, arr.dtype)
        out[...] = arr
        return out

    def wrap_tensor(self, t):
        from shmdist.comm.shared import IN_PLACE_MIN
        if t.nbytes <= IN_PLACE_MIN:
            return t
        out = self.d.empty(tuple(t.shape), t.dtype)
        out.copy_(t)
        return out


class GlooComm(ShmdistComm):
    """torch.distributed with gloo; tensors share the numpy buffers."""

    def __init__(self, rank: int, world: int, port: int, timeout: float):
        import torch
        import torch.distributed as dist
        self.d, self.torch = dist, torch
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout))
        self.rank, self.size = rank, world
        self.version = f"torch {torch.__version__}"

    def wrap(self, arr):
        return self.torch.from_numpy(arr)

    def send(self, buf, dst):
        self.d.send(buf, dst)

    def recv(self, buf, src):
        self.d.recv(buf, src)


class DeepSpeedComm(GlooComm):
    """DeepSpeed's shared-memory all_reduce: the op ``deepspeed.comm.inference_all_reduce``
    runs (``torch.ops.deepspeed.inference_all_reduce_``, called directly: the peer at its
    fastest). Rendezvous, and the harness's own sends, over gloo as DeepSpeed sets it up.
    The launcher sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE (without it the op crashes),
    MASTER_ADDR/PORT and OMP_NUM_THREADS=1, DeepSpeed's favourable setting."""

    def __init__(self, rank: int, world: int, port: int, timeout: float):
        import torch
        import torch.distributed as dist

        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        op = getattr(getattr(torch.ops, "deepspeed", None), "inference_all_reduce_", None)
        if op is None:
            raise RuntimeError("DeepSpeed's shm all_reduce op did not build (torch.ops.deepspeed."
                               "inference_all_reduce_ is missing): inference_all_reduce would be gloo's")
        self.d, self.torch, self.op = dist, torch, op
        self.rank, self.size = rank, world
        self.version = f"DeepSpeed {deepspeed.__version__} (torch {torch.__version__})"

    def all_reduce(self, buf):
        self.op(buf)


def ds_env(world: int, rank: int, port: int) -> dict:
    """The environment of a DeepSpeed rank (see DeepSpeedComm)."""
    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}


def ds_shm_entries(port: int) -> list[str]:
    """The /dev/shm files DeepSpeed's op made for the job on ``port`` (it never removes them)."""
    return glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*")


# What MPI libraries put in /dev/shm: Open MPI's shared-memory segment per job and node stays when
# its ranks exit (one 16 MiB file per launch, seen with the pip wheel of 5.0), so the run removes the
# ones its own launches left.
MPI_SHM_PREFIXES = ("sm_segment.", "vader_segment.", "mpich_shar_tmp")


def mpi_shm_entries() -> set[str]:
    return {os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm") if n.startswith(MPI_SHM_PREFIXES)} \
        if os.path.isdir("/dev/shm") else set()


def mapped_anywhere(paths: set[str]) -> set[str]:
    """Those of ``paths`` that a live process still maps (another job's: left alone)."""
    found = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                text = f.read()
        except OSError:
            continue
        found |= {p for p in paths if p in text}
    return found


def remove_mpi_leftovers(before: set[str]) -> None:
    """Remove the MPI files in /dev/shm that appeared since ``before`` and no live process maps."""
    new = mpi_shm_entries() - before
    for path in new - mapped_anywhere(new):
        try:
            os.unlink(path)
        except OSError:
            pass


class MpiComm:
    def __init__(self):
        from mpi4py import MPI
        self.MPI, self.c = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.c.Get_rank(), self.c.Get_size()
        self.version = MPI.Get_library_version().splitlines()[0].strip()

    def wrap(self, arr):
        return arr

    def send(self, buf, dst):
        self.c.Send(buf, dst)

    def recv(self, buf, src):
        self.c.Recv(buf, src)

    def isend(self, buf, dst):
        return self.c.Isend(buf, dst)

    def irecv(self, buf, src):
        return self.c.Irecv(buf, src)

    def wait_all(self, reqs):
        self.MPI.Request.Waitall(reqs)

    def all_reduce(self, buf):
        self.c.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)

    def broadcast(self, buf, root):
        self.c.Bcast(buf, root)

    def barrier(self):
        self.c.Barrier()

    def close(self):
        pass


class MemcpyComm:
    """One process: the copies and additions a transfer cannot beat."""
    rank, size, version = 0, 1, f"numpy {np.__version__}"

    def wrap(self, arr):
        return arr

    def close(self):
        pass


def filled(comm, nbytes: int, dtype=np.uint8, value=1):
    """A buffer whose pages are all touched (zero-page reads would flatter a copy)."""
    return comm.wrap(np.full(nbytes // np.dtype(dtype).itemsize, value, dtype))


def agree(comm, n: int) -> int:
    """Rank 0's ``n``, for every rank."""
    box = comm.wrap(np.array([n], dtype=np.int64))
    if comm.rank == 0:
        for r in range(1, comm.size):
            comm.send(box, r)
    else:
        comm.recv(box, 0)
    return int(box[0])


def timed(comm, step, s) -> np.ndarray:
    """Seconds per ``step()`` on this rank. Rank 0 sizes the run from a probe
    so that the timed part takes about ``s['budget']``; a fifth of that count
    runs first, untimed, as the warm-up."""
    t0 = time.perf_counter()
    for _ in range(PROBE_ITERS):
        step()
    each = max((time.perf_counter() - t0) / PROBE_ITERS, 1e-9)
    n = agree(comm, min(max(int(s["budget"] / each), s["min_iters"]), s["max_iters"]))
    for _ in range(n // 5):
        step()
    samples = np.empty(n)
    clock = time.perf_counter
    for i in range(n):
        t0 = clock()
        step()
        samples[i] = clock() - t0
    return samples


def stats(values: np.ndarray, unit: str) -> dict:
    p10, med, p90 = np.percentile(values, [10, 50, 90])
    return {"value": float(med), "unit": unit, "p10": float(p10), "p90": float(p90),
            "iters": int(values.size)}


def measure(comm, p: Point, s: dict) -> dict:
    """One point, run by every rank; rank 0's figures."""
    if isinstance(comm, MemcpyComm):
        return measure_memcpy(comm, p, s)
    peer = 1 - comm.rank
    if p.kind == "latency":
        buf = filled(comm, p.nbytes)
        if comm.rank == 0:
            def step():
                comm.send(buf, 1)
                comm.recv(buf, 1)
        else:
            def step():
                comm.recv(buf, 0)
                comm.send(buf, 0)
        return stats(timed(comm, step, s) / 2, "s")
    if p.kind == "bandwidth":
        buf, ack = filled(comm, p.nbytes), filled(comm, 8)
        window = min(max(BANDWIDTH_WINDOW // p.nbytes, 1), 64)
        if comm.rank == 0:
            def step():
                comm.wait_all([comm.isend(buf, 1) for _ in range(window)])
                comm.recv(ack, 1)
        else:
            def step():
                comm.wait_all([comm.irecv(buf, 0) for _ in range(window)])
                comm.send(ack, 0)
        return stats(window * p.nbytes / timed(comm, step, s), "B/s")
    if p.kind == "blocking":
        # what a pipeline stage does: each send waited for before the next one
        buf, ack = filled(comm, p.nbytes), filled(comm, 8)
        count = min(max(BANDWIDTH_WINDOW // p.nbytes, 1), 64)
        if comm.rank == 0:
            def step():
                for _ in range(count):
                    comm.send(buf, 1)
                comm.recv(ack, 1)
        else:
            def step():
                for _ in range(count):
                    comm.recv(buf, 0)
                comm.send(ack, 0)
        return stats(count * p.nbytes / timed(comm, step, s), "B/s")
    if p.kind == "bidir":
        # both ranks send a window and receive one at once; bytes of both directions per second
        out, into = filled(comm, p.nbytes), filled(comm, p.nbytes)
        window = min(max(BANDWIDTH_WINDOW // p.nbytes, 1), 64) if p.nbytes < 64 * MiB else 1

        def step():
            reqs = [comm.irecv(into, peer) for _ in range(window)]
            comm.wait_all([comm.isend(out, peer) for _ in range(window)] + reqs)
        return stats(2 * window * p.nbytes / timed(comm, step, s), "B/s")
    if p.kind in REDUCE_DTYPES:
        buf = reduce_buffer(comm, p)
        comm.all_reduce(buf)
        expect(comm, p, buf, comm.size)
        buf[:] = 0      # sums stay 0 however many iterations run: no overflow, no denormals
        return stats(timed(comm, lambda: comm.all_reduce(buf), s), "s")
    if p.kind == "broadcast":
        buf = filled(comm, p.nbytes, value=7 if comm.rank == 0 else 0)
        comm.broadcast(buf, 0)
        expect(comm, p, buf, 7)
        return stats(timed(comm, lambda: comm.broadcast(buf, 0), s), "s")
    if p.kind == "barrier":
        return stats(timed(comm, comm.barrier, s), "s")
    if p.kind == "idle":
        return measure_idle(comm, peer, s)
    raise ValueError(f"unknown figure {p.kind!r}")


def reduce_buffer(comm, p: Point, value=1):
    """The array of an all_reduce point: float32 numpy (wrapped), or a torch tensor of a 16-bit float."""
    dtype = REDUCE_DTYPES[p.kind]
    if dtype == "float32":
        return filled(comm, p.nbytes, np.float32, value)
    import torch
    t = torch.full((p.nbytes // 2,), value, dtype=getattr(torch, dtype))
    return comm.wrap_tensor(t) if hasattr(comm, "wrap_tensor") else t


def expect(comm, p: Point, buf, value) -> None:
    """A collective that computes nothing must not look fast."""
    if not (buf[0] == value and buf[-1] == value):
        raise RuntimeError(f"rank {comm.rank}: {p.kind} of {p.nbytes} bytes computed a wrong result "
                           f"({float(buf[0])}, expected {value})")


def measure_idle(comm, peer: int, s: dict) -> dict:
    """CPU used by rank 1 while its receive waits ``IDLE_SECONDS`` for rank 0."""
    buf, box = filled(comm, 8), comm.wrap(np.zeros(1))
    fractions = []
    for _ in range(s["idle_reps"]):
        if comm.rank == 0:
            comm.recv(buf, peer)
            time.sleep(IDLE_SECONDS)
            comm.send(buf, peer)
            comm.recv(box, peer)
            fractions.append(float(box[0]))
        else:
            r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            comm.send(buf, peer)
            comm.recv(buf, peer)
            r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            box[0] = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / (w1 - w0)
            comm.send(box, peer)
    return stats(np.array(fractions or [0.0]), "cpu")


def measure_memcpy(comm, p: Point, s: dict) -> dict:
    if p.kind == "all_reduce":
        a, b = filled(comm, p.nbytes, np.float32, 0), filled(comm, p.nbytes, np.float32, 0)
        return stats(timed(comm, lambda: np.add(a, b, out=a), s), "s")
    src, dst = filled(comm, p.nbytes), filled(comm, p.nbytes, value=2)
    samples = timed(comm, lambda: np.copyto(dst, src), s)
    return stats(p.nbytes / samples, "B/s") if p.kind == "bandwidth" else stats(samples, "s")


def report(comm, record: dict) -> None:
    if comm.rank == 0:
        print(LINE + json.dumps(record), flush=True)


def worker(args) -> int:
    points = [Point(*p) for p in json.loads(args.points)]
    settings = json.loads(args.settings)
    if args.worker == "shmdist":
        comm = ShmdistComm(args.rank, args.world, args.port, args.timeout)
    elif args.worker == "shmdist-empty":
        comm = EmptyComm(args.rank, args.world, args.port, args.timeout)
    elif args.worker == "shmdist-tcp":
        comm = ShmdistComm(args.rank, args.world, args.port, args.timeout, backend="tcp")
    elif args.worker == "gloo":
        comm = GlooComm(args.rank, args.world, args.port, args.timeout)
    elif args.worker == "deepspeed":
        comm = DeepSpeedComm(args.rank, args.world, args.port, args.timeout)
    elif args.worker == "mpi":
        comm = MpiComm()
    else:
        comm = MemcpyComm()
    report(comm, {"ready": comm.version})
    for p in points:
        report(comm, measure(comm, p, settings))
    comm.close()
    return 0


# ================================================================ driver side

class Backend(NamedTuple):
    label: str          # the table's column
    key: str            # worker kind: shmdist, gloo, mpi, deepspeed, memcpy
    python: str         # interpreter of the ranks
    mpiexec: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_mpis(pythons) -> tuple[list[Backend], list[str]]:
    """An mpi4py backend for every interpreter whose mpi4py loads and that
    has an mpiexec beside it (else on PATH); one per MPI library."""
    found, notes = [], []
    # MPI_Get_library_version may be called before MPI_Init: the probe starts no MPI (a singleton
    # init would leave Open MPI's segment file in /dev/shm)
    probe = "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; print(MPI.Get_library_version())"
    for py in pythons:
        before = mpi_shm_entries()
        try:
            out = subprocess.run([py, "-I", "-c", probe], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            notes.append(f"mpi4py under {py}: {e}")
            continue
        finally:
            remove_mpi_leftovers(before)
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            notes.append(f"mpi4py under {py} does not load ({last}); pip install mpich mpi4py")
            continue
        version = out.stdout.strip()
        label = ("MPICH" if "MPICH" in version else "Open MPI" if "Open MPI" in version
                 else version.split(",")[0].split()[0])
        mpiexec = os.path.join(os.path.dirname(py), "mpiexec")
        if not os.access(mpiexec, os.X_OK):
            mpiexec = shutil.which("mpiexec") or ""
        if not mpiexec:
            notes.append(f"{label} (mpi4py under {py}): no mpiexec beside it or on PATH")
        elif label not in [b.label for b in found]:
            found.append(Backend(label, "mpi", py, mpiexec))
    return found, notes


DS_PROBE = """
import os, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed
from deepspeed.accelerator import get_accelerator
b = get_accelerator().create_op_builder("ShareMemCommBuilder")
if b is None or not deepspeed.ops.__compatible_ops__.get(b.NAME, False):
    sys.exit("its shm op is not compatible here")
b.load()
print("DeepSpeed", deepspeed.__version__)
"""


def find_deepspeed(py: str) -> tuple[list[Backend], list[str]]:
    """DeepSpeed under ``py``, its shm op built once here (g++ -fopenmp, about 35 s the first
    time; cached after), so that no rank's start-up runs into the point's timeout."""
    how = (f"DeepSpeed skipped (under {py}); make its venv: python -m venv V && V/bin/pip install "
           f"torch && DS_ACCELERATOR=cpu DS_BUILD_OPS=0 V/bin/pip install deepspeed; then --ds-python "
           f"V/bin/python")
    try:
        out = subprocess.run([py, "-I", "-c", DS_PROBE], capture_output=True, text=True, timeout=600,
                             env={**os.environ, "DS_ACCELERATOR": "cpu"})
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], [f"{how}: {e}"]
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return [], [f"{how}: its shm all_reduce op does not build or load ({last})"]
    return [Backend("DeepSpeed", "deepspeed", py)], []


def detect(args) -> tuple[list[Backend], list[str]]:
    wanted = set(args.backends)
    backends, notes = [], []
    if "shmdist" in wanted:
        backends.append(Backend("shmdist", "shmdist", sys.executable))
    if "shmdist-empty" in wanted:    # arrays from shmdist.empty: all_reduce and broadcast in place
        backends.append(Backend(EMPTY, "shmdist-empty", sys.executable))
    if "shmdist-tcp" in wanted:      # the TCP transport, to show the gap to shared memory
        backends.append(Backend("shmdist tcp", "shmdist-tcp", sys.executable))
    if "gloo" in wanted:
        import importlib.util
        if importlib.util.find_spec("torch") is None:
            notes.append("gloo skipped: torch is not installed (pip install torch)")
        else:
            backends.append(Backend("gloo", "gloo", sys.executable))
    if "mpi" in wanted:
        pythons = args.mpi_python or [sys.executable] + sorted(glob.glob(".venv*/bin/python"))
        mpis, mpi_notes = find_mpis(dict.fromkeys(pythons))
        backends += mpis
        notes += mpi_notes
        if not mpis:
            notes.append("MPI skipped: no mpi4py with an mpiexec found (pip install mpich mpi4py)")
    if "deepspeed" in wanted:
        if args.ds_python:
            found, ds_notes = find_deepspeed(args.ds_python)
            backends += found
            notes += ds_notes
        else:
            notes.append("DeepSpeed skipped: give its interpreter with --ds-python (a venv with torch "
                         "and deepspeed: DS_ACCELERATOR=cpu DS_BUILD_OPS=0 pip install deepspeed)")
    if "memcpy" in wanted:
        backends.append(Backend("memcpy", "memcpy", sys.executable))
    half = [REDUCE_DTYPES[k] for k in args.only if REDUCE_DTYPES.get(k, "float32") != "float32"]
    if half and wanted & {"shmdist", "shmdist-empty"} and not has_torch():
        notes.append(f"shmdist's {' and '.join(half)} all_reduce rows skipped: they are measured on torch "
                     f"tensors and torch is not installed under {sys.executable} (pip install torch)")
    return backends, notes


def has_torch() -> bool:
    import importlib.util
    return importlib.util.find_spec("torch") is not None


def measures(b: Backend, kind: str) -> bool:
    """Whether ``b`` measures figures of ``kind``: DeepSpeed only all_reduce; MPI and the
    TCP transport no 16-bit floats (mpi4py has no bfloat16; the rows compare shared memory);
    shmdist the 16-bit floats through torch tensors, so only where torch is installed."""
    half = kind in REDUCE_DTYPES and REDUCE_DTYPES[kind] != "float32"
    if b.key == "deepspeed":
        return kind in REDUCE_DTYPES
    if b.key in ("mpi", "shmdist-tcp") and half:
        return False
    if b.key == "shmdist-empty" and kind not in REDUCE_DTYPES and kind != "broadcast":
        return False
    if b.key in ("shmdist", "shmdist-empty"):
        return not (half and not has_torch())
    return True


def runs(b: Backend, rows: list[Point]) -> dict[int, list[Point]]:
    """The points ``b`` measures, by number of ranks."""
    if b.key == "memcpy":
        own = [p._replace(ranks=1, kind="bandwidth" if p.kind in P2P[1:] else p.kind)
               for p in rows if p.kind in ("latency", "bandwidth", "blocking", "bidir", "all_reduce", "broadcast")]
        return {1: list(dict.fromkeys(own))}
    by_ranks: dict[int, list[Point]] = {}
    for p in rows:
        if measures(b, p.kind):
            by_ranks.setdefault(p.ranks, []).append(p)
    return by_ranks


def launch(b: Backend, world: int, points: list[Point], settings: dict, timeout: float, logdir: str):
    """Start the ranks; returns (processes, rank 0's stdout, stderr files)."""
    common = ["--worker", b.key, "--world", str(world), "--timeout", str(timeout),
              "--points", json.dumps(points), "--settings", json.dumps(settings)]
    if b.key == "mpi":
        extra = []
        if "Open MPI" in b.label:
            extra += ["--allow-run-as-root"] if os.geteuid() == 0 else []
            extra += ["--oversubscribe"] if world > (os.cpu_count() or 1) else []
        argvs = [[b.mpiexec, *extra, "-n", str(world), b.python, "-I", os.path.abspath(__file__), *common]]
        envs = [None]
    else:
        port = free_port()
        # DeepSpeed's ranks run this file as a plain script in their own venv, like MPI's
        start = ["-I", os.path.abspath(__file__)] if b.key == "deepspeed" else ["-m", "shmdist.bench"]
        argvs = [[b.python, *start, *common, "--rank", str(r), "--port", str(port)] for r in range(world)]
        envs = [ds_env(world, r, port) if b.key == "deepspeed" else None for r in range(world)]
    procs, errs = [], []
    shm_before = mpi_shm_entries() if b.key == "mpi" else None
    for i, (argv, env) in enumerate(zip(argvs, envs)):
        err = open(os.path.join(logdir, f"{b.key}-{world}-{i}.err"), "w+")
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
                                      stderr=err, text=True, start_new_session=True, env=env))
        procs[-1].ds_port = port if b.key == "deepspeed" else None
        procs[-1].shm_before = shm_before
        errs.append(err)
    return procs, errs


def stop(procs, errs, kill: bool) -> None:
    """End the ranks this run started (each in its own session: mpiexec's
    ranks go with it), politely if they are finishing."""
    if not kill:
        deadline = time.monotonic() + 15
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                kill = True
    for p in procs:
        if kill and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()
        if p.stdout is not None:
            p.stdout.close()
    for p in procs[:1]:
        for path in ds_shm_entries(p.ds_port) if getattr(p, "ds_port", None) else []:
            os.unlink(path)
        if getattr(p, "shm_before", None) is not None:
            remove_mpi_leftovers(p.shm_before)
    for e in errs:
        e.close()


def last_error(errs) -> str:
    for e in errs:
        e.seek(0)
        lines = [ln.strip() for ln in e.read().splitlines() if ln.strip()]
        if lines:
            return lines[-1][:200]
    return "no message"


def forward(stream, lines: queue.Queue) -> None:
    """Hand the lines of ``stream`` to ``lines``; None at its end."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def run_backend(b: Backend, world: int, points: list[Point], args, settings, results, versions, progress):
    """Measure ``points`` with ``b`` on ``world`` ranks, one launch for all of
    them; after a point fails or times out, the rest run in a new launch."""
    pending = list(points)
    with tempfile.TemporaryDirectory(prefix="shmdist-bench-") as logdir:
        while pending:
            procs, errs = launch(b, world, pending, settings, args.timeout, logdir)
            lines: queue.Queue = queue.Queue()
            threading.Thread(target=forward, args=(procs[0].stdout, lines), daemon=True).start()
            done, failure, ready = 0, None, False
            deadline = time.monotonic() + args.timeout
            while done < len(pending) and failure is None:
                try:
                    line = lines.get(timeout=0.2)
                except queue.Empty:
                    line = ""
                if line is None or (not line and any(p.poll() not in (None, 0) for p in procs)):
                    time.sleep(0.3)     # let the failed rank finish writing its message
                    failure = f"error: {last_error(errs)}"
                elif line.startswith(LINE):
                    record = json.loads(line[len(LINE):])
                    if "ready" in record:
                        versions[b.label] = record["ready"]
                        ready = True
                    else:
                        results[(b.label, pending[done])] = record
                        progress(b.label, pending[done], record)
                        done += 1
                    deadline = time.monotonic() + args.timeout
                elif time.monotonic() > deadline:
                    failure = f"timeout ({args.timeout:g} s)"
            stop(procs, errs, kill=failure is not None)
            if failure is None:
                return
            failed = pending[done:] if not ready else [pending[done]]
            for p in failed:
                results[(b.label, p)] = {"failed": failure}
                progress(b.label, p, results[(b.label, p)])
            pending = pending[done + len(failed):]


# ---------------------------------------------------------------- presenting

def size_text(n: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def row_label(p: Point) -> str:
    if p.kind == "latency":
        return f"p2p one-way latency {size_text(p.nbytes)}"
    if p.kind == "bandwidth":
        return f"p2p bandwidth {size_text(p.nbytes)}"
    if p.kind == "blocking":
        return f"p2p blocking-send loop {size_text(p.nbytes)}"
    if p.kind == "bidir":
        return f"p2p both ways at once {size_text(p.nbytes)}"
    ranks = "1 process" if p.ranks == 1 else f"{p.ranks} ranks"
    if p.kind in REDUCE_DTYPES and p.kind != "all_reduce":
        return f"all_reduce {REDUCE_DTYPES[p.kind]} {size_text(p.nbytes)}, {ranks}"
    if p.kind == "barrier":
        return f"barrier, {ranks}"
    if p.kind == "idle":
        return f"CPU of a rank blocked {IDLE_SECONDS:g} s in wait()"
    return f"{p.kind} {size_text(p.nbytes)}, {ranks}"


def value_text(record: dict | None) -> str:
    if record is None:
        return "n/a"
    if "failed" in record:
        return record["failed"].split(":")[0]
    v, unit = record["value"], record["unit"]
    if unit == "B/s":
        return f"{v / 1e9:.2f} GB/s"
    if unit == "cpu":
        return f"{v * 100:.1f} %"
    for name, scale in (("µs", 1e-6), ("ms", 1e-3)):
        if v < scale * 1000:
            return f"{v / scale:.3g} {name}"
    return f"{v:.3g} s"


def cost(record: dict | None) -> float | None:
    """Lower is better: seconds, CPU fraction, or seconds per byte."""
    if record is None or "failed" in record:
        return None
    return 1 / record["value"] if record["unit"] == "B/s" else record["value"]


def lookup(results, label: str, p: Point):
    if label == "memcpy":
        p = p._replace(ranks=1, kind="bandwidth" if p.kind in P2P[1:] else p.kind)
    return results.get((label, p))


def round_ratio(results, labels, p: Point, ours: str = "shmdist"):
    """(shmdist's (or ``ours``') cost ÷ the best peer's, that peer) in one round's results, or None."""
    mine = cost(results.get((ours, p)))
    peers = [(c, lab) for lab in labels if lab not in OURS
             for c in [cost(results.get((lab, p)))] if c is not None]
    if mine is None or not peers:
        return None
    best, who = min(peers)
    return (mine / best, who) if best > 0 else None


def ratios(rounds: list, labels, p: Point, ours: str = "shmdist") -> list:
    """The ratio of every round in which shmdist (or ``ours``) and a peer both measured ``p``."""
    return [r for res in rounds for r in [round_ratio(res, labels, p, ours)] if r is not None]


def ratio_text(found: list) -> str:
    """Median ratio over the rounds, its range when there are several, the peer most often best."""
    if not found:
        return "—"
    values = sorted(v for v, _ in found)
    whos = [w for _, w in found]
    who = max(set(whos), key=whos.count)
    text = f"{float(np.median(values)):.2f}"
    if len(values) > 1:
        text += f" ({values[0]:.2f}–{values[-1]:.2f})"
    return f"{text} {who}"


def combine(rounds: list) -> dict:
    """One record per (backend, point): the median over the rounds that measured it."""
    out = {}
    for key in dict.fromkeys(k for res in rounds for k in res):
        recs = [res[key] for res in rounds if key in res]
        good = [r for r in recs if "failed" not in r]
        if not good:
            out[key] = recs[0]
            continue
        values = [r["value"] for r in good]
        out[key] = {**good[0], "value": float(np.median(values)), "rounds": values,
                    "iters": int(sum(r["iters"] for r in good))}
    return out


def table(rows, labels, rounds: list) -> str:
    results = combine(rounds)
    head = ["figure", *labels, "shmdist ÷ best peer" + (f" (median, range over {len(rounds)} rounds)"
                                                         if len(rounds) > 1 else "")]
    empty = EMPTY in labels
    head += [f"{EMPTY} ÷ best peer"] if empty else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in rows:
        cells = [value_text(lookup(results, lab, p)) for lab in labels]
        if p.kind == "idle" or p.kind == "barrier":
            cells = [c if lab != "memcpy" else "—" for c, lab in zip(cells, labels)]
        extra = [ratio_text(ratios(rounds, labels, p, EMPTY))] if empty else []
        lines.append("| " + " | ".join([row_label(p), *cells, ratio_text(ratios(rounds, labels, p)), *extra]) + " |")
    return "\n".join(lines)


def plot(path: str, rows, labels, results) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("latency", "p2p one-way latency (µs)", 1e6), ("bandwidth", "p2p bandwidth (GB/s)", 1e-9),
              ("all_reduce", "all_reduce float32 SUM (µs)", 1e6)]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, (kind, title, scale) in zip(axes, panels):
        for i, lab in enumerate(labels):
            counts = sorted({p.ranks for p in rows if p.kind == kind})
            for ranks in counts[:1] if lab == "memcpy" else counts:
                pts = [(p.nbytes, r["value"] * scale) for p in rows if p.kind == kind and p.ranks == ranks
                       for r in [lookup(results, lab, p)] if r and "value" in r]
                if pts:
                    name = lab if kind != "all_reduce" or lab == "memcpy" else f"{lab}, {ranks} ranks"
                    ax.plot(*zip(*pts), marker="o", label=name, color=f"C{i}",
                            linestyle="-" if ranks == counts[0] else "--")
        ax.set(title=title, xlabel="message size (bytes)", xscale="log", yscale="log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------- main

def parse(argv):
    ap = argparse.ArgumentParser(
        prog="python -m shmdist.bench",
        description="Benchmark shmdist against torch.distributed (gloo), mpi4py (every MPI found) "
                    "and a one-process numpy copy, in one run. Prints one table; the ratio column is "
                    "shmdist's time divided by the best peer's (for bandwidth: the best peer's GB/s "
                    "divided by shmdist's), so below 1 means shmdist is faster.")
    ap.add_argument("--quick", action="store_true", help="fewer iterations per point (about a minute)")
    ap.add_argument("--ranks", default="2,4", help="rank counts for the collectives (default 2,4)")
    ap.add_argument("--only", default=",".join(KINDS), help=f"figures to measure, of {','.join(KINDS)}")
    ap.add_argument("--sizes", help="sizes for every sized figure instead of the table's, e.g. 16K,32K,64K,1M")
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"of {','.join(BACKENDS)} (default all)")
    ap.add_argument("--mpi-python", action="append", metavar="PYTHON",
                    help="an interpreter with mpi4py, its mpiexec beside it (repeatable; default: this "
                         "Python and ./.venv*/bin/python)")
    ap.add_argument("--ds-python", metavar="PYTHON",
                    help="an interpreter with torch and deepspeed: DeepSpeed's shm all_reduce joins the "
                         "all_reduce rows (skipped, with a note, without it or when its op cannot build)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="measure every backend this many times, interleaved (A B A B ...), and report "
                         "medians and the ratio's range over the rounds (default 3, 1 with --quick)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per point before it is killed "
                                                                "(default 60, 30 with --quick)")
    ap.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    ap.add_argument("--plot", metavar="FILE.png", help="draw latency, bandwidth and all_reduce vs size")
    for name in ("--worker", "--points", "--settings"):
        ap.add_argument(name, help=argparse.SUPPRESS)
    for name in ("--rank", "--world", "--port"):
        ap.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return args
    args.only = [k.strip() for k in args.only.split(",") if k.strip()]
    args.backends = [k.strip() for k in args.backends.split(",") if k.strip()]
    for given, allowed, flag in ((args.only, KINDS, "--only"), (args.backends, BACKENDS, "--backends")):
        unknown = sorted(set(given) - set(allowed))
        if unknown:
            ap.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(allowed)}")
    try:
        args.ranks = sorted({int(r) for r in args.ranks.split(",") if r.strip()})
    except ValueError:
        ap.error(f"--ranks: expected rank counts like 2,4, got {args.ranks!r}")
    if any(r < 2 for r in args.ranks):
        ap.error("--ranks: collectives need at least 2 ranks")
    if args.sizes is not None:
        try:
            args.sizes = sorted({_size(t) for t in args.sizes.split(",") if t.strip()})
        except ValueError:
            ap.error(f"--sizes: expected sizes like 16K,1M,8, got {args.sizes!r}")
        if not args.sizes or min(args.sizes) < 8:
            ap.error("--sizes: at least one size, each at least 8 bytes")
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    if args.timeout is None:
        args.timeout = 30.0 if args.quick else 60.0
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib, which is not installed: pip install matplotlib")
    return args


def _size(text: str) -> int:
    """'64K' -> 65536, '1M' -> 1048576, '8' -> 8."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = {"K": KiB, "M": MiB, "G": 1 << 30}.get(t[-1:], 1)
    return int(t[:-1] if unit > 1 else t) * unit


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        return worker(args)
    settings = QUICK if args.quick else FULL
    rows = plan(args.only, args.ranks, args.sizes)
    backends, notes = detect(args)
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    # Interleaved: each round runs every backend on one kind of figure (and rank count), then the
    # next kind, so a drift of the machine's speed hits every backend alike; the order of the
    # backends alternates from round to round.
    by_backend = [(b, runs(b, rows)) for b in backends]
    chunks = list(dict.fromkeys((world, p.kind) for _, by in by_backend
                                for world, pts in sorted(by.items()) for p in pts))
    work = []
    for rnd in range(args.rounds):
        order = by_backend if rnd % 2 == 0 else by_backend[::-1]
        for world, kind in chunks:
            for b, by in order:
                pts = [p for p in by.get(world, []) if p.kind == kind]
                if pts:
                    work.append((rnd, b, world, pts))
    total = sum(len(pts) for *_, pts in work)
    rounds = [{} for _ in range(args.rounds)]
    versions, count = {}, [0]

    def progress(label, p, record):
        count[0] += 1
        print(f"[{count[0]:3d}/{total}] {label:9s} {row_label(p):38s} {value_text(record)}"
              f"{'  (%d iters)' % record['iters'] if 'iters' in record else ''}", file=sys.stderr, flush=True)

    started = time.time()
    for rnd, b, world, pts in work:
        print(f"round {rnd + 1}/{args.rounds}: {b.label} on {world} rank(s), {pts[0].kind}...",
              file=sys.stderr, flush=True)
        run_backend(b, world, pts, args, settings, rounds[rnd], versions, progress)
    results = combine(rounds)
    labels = [lab for lab in PEERS_ORDER if lab in {b.label for b in backends}]
    labels += [b.label for b in backends if b.label not in labels]
    print(f"shmdist.bench on {platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"{'quick, ' if args.quick else ''}medians; {args.rounds} interleaved round(s); "
          f"took {time.time() - started:.0f} s")
    print(table(rows, labels, rounds))
    print("ratio = shmdist's time ÷ the best peer's (bandwidth: best peer's GB/s ÷ shmdist's); "
          "below 1 means shmdist is faster. Peers: " +
          "; ".join(f"{lab}: {versions.get(lab, '?')}" for lab in labels))
    for n in notes:
        print(f"note: {n}")
    if args.json:
        doc = {"meta": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                        "quick": args.quick, "rounds": args.rounds, "argv": sys.argv, "date": datetime.datetime.now().isoformat(),
                        "versions": versions, "notes": notes},
               "results": [{"backend": lab, **p._asdict(), **rec} for (lab, p), rec in results.items()],
               "ratios": [{**p._asdict(), "label": row_label(p), "rounds": [v for v, _ in found],
                           "peers": [w for _, w in found],
                           **({"empty_rounds": [v for v, _ in e]} if e else {})}
                          for p in rows for found, e in [(ratios(rounds, labels, p), ratios(rounds, labels, p, EMPTY))]
                          if found]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        plot(args.plot, rows, labels, results)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

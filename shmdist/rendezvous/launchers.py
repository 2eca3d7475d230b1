"""Rank, size, local rank and master from the launcher's environment, so
that ``init_process_group()`` with no arguments works under torchrun,
shmdist-run, mpirun/mpiexec (Open MPI, MPICH/Hydra) and srun.

Which launcher is read, first found wins (one source for rank and size
together, never a mix):

1. ``RANK`` + ``WORLD_SIZE`` (torchrun, shmdist-run, or set by hand);
2. Open MPI: ``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``/``_LOCAL_SIZE``;
3. MPICH/Hydra (and Intel MPI, srun --mpi=pmi2): ``PMI_RANK``/``PMI_SIZE``,
   ``MPI_LOCALRANKID``/``MPI_LOCALNRANKS``;
4. Slurm: ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``.

MPI comes before Slurm because ``mpirun`` inside an ``sbatch`` or
``salloc`` allocation inherits the batch step's ``SLURM_PROCID`` (0 in
every rank); torchrun's variables come first because torchrun is often
started by srun or mpirun, one per node, and then its own numbering is
the one the processes belong to. Arguments passed to
``init_process_group(rank=..., world_size=...)`` override what was read,
as in torch.

The master (the host of rank 0, which serves the rendezvous store):
``MASTER_ADDR``/``MASTER_PORT`` when set; else under Slurm the first host
of ``SLURM_STEP_NODELIST``/``SLURM_NODELIST`` and a port derived from the
job and step ids; else under MPI, when every rank is on one host,
127.0.0.1 and a port derived from the MPI job; else, with mpi4py
installed, rank 0's address and a free port sent by MPI; else an error
that says to set MASTER_ADDR and MASTER_PORT.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
from dataclasses import dataclass

from shmdist import settings
from shmdist.errors import DistError

PORT_BASE, PORT_SPAN = 20000, 20000    # ports derived from a job id fall in [20000, 40000)


@dataclass
class Launch:
    source: str          # "torchrun", "openmpi", "mpich", "slurm" or "" (none found)
    rank: int = -1
    world_size: int = -1
    local_rank: int = -1
    local_size: int = -1
    master_addr: str = ""
    master_port: int = -1
    master_from: str = ""   # where the master came from, for the log line and errors


_SOURCES = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


def _int(env, key: str, source: str) -> int:
    value = env.get(key)
    if value is None:
        return -1
    try:
        return int(value.split("(")[0].split(",")[0])   # SLURM_NTASKS_PER_NODE may read "2(x3)"
    except ValueError:
        raise DistError(f"init_process_group: {key}={value!r} (set by {source}) is not an integer") from None


def detect(env=None) -> Launch:
    """The first launcher whose rank and size variables are both set
    (``env``: the variables, by default those settings.py reads)."""
    env = settings.launcher_env() if env is None else env
    for source, rank, size, local, local_size in _SOURCES:
        if rank in env and size in env:
            found = Launch(source, _int(env, rank, source), _int(env, size, source),
                           _int(env, local, source), _int(env, local_size, source))
            if source == "slurm" and "SLURM_STEP_NUM_TASKS" in env:
                found.world_size = _int(env, "SLURM_STEP_NUM_TASKS", source)
            _master(found, env)
            return found
    launch = Launch("")
    _master(launch, env)
    return launch


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list: 'a[01-03,7],b' -> ['a01', 'a02', 'a03', 'a7', 'b']."""
    hosts = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", text):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if hi:
                for n in range(int(lo), int(hi) + 1):
                    hosts.append(f"{prefix}{str(n).zfill(len(lo))}{suffix}")
            else:
                hosts.append(f"{prefix}{lo}{suffix}")
    return hosts


def derived_port(job: str) -> int:
    """A port every rank of a job computes alike from the job's id (two jobs
    on one master host collide with probability 1/PORT_SPAN; set MASTER_PORT
    to choose)."""
    digest = hashlib.sha1(job.encode()).digest()
    return PORT_BASE + int.from_bytes(digest[:4], "little") % PORT_SPAN


def _master(launch: Launch, env) -> None:
    if env.get("MASTER_ADDR"):
        launch.master_addr, launch.master_from = env["MASTER_ADDR"], "MASTER_ADDR"
    if env.get("MASTER_PORT"):
        try:
            launch.master_port = int(env["MASTER_PORT"])
        except ValueError:
            raise DistError(f"init_process_group: MASTER_PORT={env['MASTER_PORT']!r} is not a port number") \
                from None
    if launch.source == "slurm":
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not launch.master_addr and nodes:
            launch.master_addr, launch.master_from = expand_nodelist(nodes)[0], "SLURM_NODELIST"
        if launch.master_port < 0 and env.get("SLURM_JOB_ID"):
            launch.master_port = derived_port(f"slurm/{env['SLURM_JOB_ID']}/{env.get('SLURM_STEP_ID', '')}")
    elif launch.source in ("openmpi", "mpich"):
        one_host = launch.local_size > 0 and launch.local_size == launch.world_size
        if not launch.master_addr and one_host:
            launch.master_addr, launch.master_from = "127.0.0.1", "every rank on this host"
        if launch.master_port < 0 and one_host:
            # Open MPI names the job; Hydra does not, but all ranks of one host share its proxy.
            job = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid") or f"ppid{os.getppid()}"
            launch.master_port = derived_port(f"{launch.source}/{job}")


def master_by_mpi(launch: Launch) -> bool:
    """With mpi4py: rank 0 sends its address and a free port to every rank."""
    from shmdist.comm.inter import load_mpi
    try:
        MPI, _ = load_mpi()      # None when mpi4py was built for another MPI than the launcher's
    except ImportError:
        return False
    if MPI is None:
        return False
    comm = MPI.COMM_WORLD
    if comm.Get_size() != launch.world_size:
        return False
    mine = None
    if comm.Get_rank() == 0:
        addr = launch.master_addr or _own_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        mine = (addr, launch.master_port if launch.master_port > 0 else port)
    addr, port = comm.bcast(mine, root=0)
    launch.master_addr, launch.master_port = addr, port
    launch.master_from = launch.master_from or "rank 0, sent by MPI"
    return True


def _own_address() -> str:
    """This host's first non-loopback IPv4 address (of its interfaces, no traffic)."""
    import fcntl
    import struct
    for _, name in socket.if_nameindex():
        if name == "lo":
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        addr = socket.inet_ntoa(packed[20:24])
        if not addr.startswith("127."):
            return addr
    return socket.gethostbyname(socket.gethostname())


def resolve(rank: int, world_size: int, env=None) -> tuple[Launch, dict]:
    """What env:// needs (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) from
    the launcher found, with the caller's rank and world_size winning."""
    launch = detect(env)
    if rank >= 0:
        launch.rank = rank
    if world_size >= 0:
        launch.world_size = world_size
    if launch.source in ("openmpi", "mpich") and (not launch.master_addr or launch.master_port < 0):
        master_by_mpi(launch)
    if launch.source:
        logging.getLogger("shmdist").info(
            "launcher: %s (rank %s of %s, local rank %s), master %s:%s from %s", launch.source, launch.rank,
            launch.world_size, launch.local_rank, launch.master_addr or "?", launch.master_port,
            launch.master_from or "nowhere")
    out = {}
    if launch.rank >= 0:
        out["RANK"] = launch.rank
    if launch.world_size >= 0:
        out["WORLD_SIZE"] = launch.world_size
    if launch.master_addr:
        out["MASTER_ADDR"] = launch.master_addr
    if launch.master_port >= 0:
        out["MASTER_PORT"] = launch.master_port
    return launch, out


def missing_hint(launch: Launch) -> str:
    """What to do when something env:// needs was not found."""
    if launch.source in ("openmpi", "mpich"):
        return (f"under {launch.source} with ranks on several hosts, set MASTER_ADDR (rank 0's host) and "
                "MASTER_PORT, or install mpi4py so that rank 0 can send them")
    if launch.source == "slurm":
        return "under srun, set MASTER_ADDR and MASTER_PORT (SLURM_NODELIST or SLURM_JOB_ID is missing)"
    return ("run under shmdist-run, torchrun, mpirun/mpiexec or srun, or pass init_method='tcp://HOST:PORT' "
            "with rank and world_size")

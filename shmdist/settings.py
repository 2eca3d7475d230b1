"""Every environment variable shmdist reads, and the only module that reads
the environment: each SHMDIST_* setting with its name, default and meaning
in one table (``get``), and the launchers' variables (torchrun, Open MPI,
MPICH/Hydra, Slurm) declared by name in another (``launcher``).

A setting is read from the environment when the step that uses it runs
(``init_process_group``, ``new_group``, a call with no timeout), never at
import, so a test or a launcher may set it any time before that step. The
launcher's own variables (shmdist-run) and the benchmark's live with them.
Code that starts processes may still copy ``os.environ`` for the children.
"""
from __future__ import annotations

import math
import os
from typing import Callable, NamedTuple


class Setting(NamedTuple):
    name: str
    default: object          # the value when the variable is unset or empty
    parse: Callable          # text -> value; raises ValueError on a bad one
    meaning: str


# A parser returns the value, or raises ValueError saying what it expected (get() names the
# variable and the value around it).

def _count(lo: int, hi: int = 1 << 62, what: str = "a whole number") -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 0)
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise ValueError(f"{what} from {lo} to {hi}")
        return value
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < 1e9):      # (nan, inf and <= 0 are refused: a deadline must come)
        raise ValueError("a number of seconds above 0 and below 1e9")
    return value


def _flag(text: str) -> bool:
    said = text.strip().lower()
    if said in ("1", "true", "yes", "on"):
        return True
    if said in ("0", "false", "no", "off"):
        return False
    raise ValueError("1 or 0 (or true/false, yes/no, on/off)")


def _transport(text: str) -> str:
    said = text.strip().lower()
    if said not in ("tcp", "shm"):
        raise ValueError("tcp (or shm, the default)")
    return said


def _multiple_of_page(text: str) -> int:
    value = _count(4096, 1 << 40, "a multiple of 4096 bytes")(text)
    if value % 4096:
        raise ValueError("a multiple of 4096 bytes, at least 4096")
    return value


def _power_of_two(text: str) -> int:
    value = _count(4096, 1 << 40, "a power of two of bytes")(text)
    if value & (value - 1):
        raise ValueError("a power of two of bytes, at least 4096 (the ring size)")
    return value


SETTINGS = {s.name: s for s in (
    Setting("SHMDIST_TIMEOUT", None, _seconds,
            "seconds an operation waits when init_process_group got no timeout (default 1800, as torch)"),
    Setting("SHMDIST_TRANSPORT", "", _transport,
            "'tcp' runs every rank as its own node over TCP, even on one host (tests, debugging)"),
    Setting("SHMDIST_RING_BYTES", None, _power_of_two,
            "bytes of each ring between two local ranks (default by local rank count, shm.py)"),
    Setting("SHMDIST_STREAM_BYTES", None, _count(0, what="a number of bytes"),
            "payloads at least this big are received with streaming stores; 0 never (default: half "
            "the last-level cache, at least 8 MiB)"),
    Setting("SHMDIST_SINGLE_COPY", 32 << 10, _count(0, what="a number of bytes"),
            "a message to a local rank at least this big moves in one copy while a receive from that rank "
            "is pending (both ways at once; or, one way, when bigger than the ring or from 128 KiB): "
            "the receiver reads it from the sender's memory (process_vm_readv) "
            "where it may; two-member broadcast and all_reduce copy between the arrays from this size, "
            "at least 1 MiB, a broadcast of three or more members is read from the root's array from "
            "4 MiB, where timed faster than the arena (SHMDIST_PAIR_CHOOSE); 0 never (engine.py, _lane.pxi, comm/arena.py)"),
    Setting("SHMDIST_PAIR_CHOOSE", True, _flag,
            "the first member of a group times the two ways of a broadcast (or, two members, an "
            "all_reduce) that may go as single copies (SHMDIST_SINGLE_COPY): those copies, or the arena's "
            "buffers, and all take the faster per size class, trying the other now and then "
            "(comm/paths.py); 0: always the single copies"),
    Setting("SHMDIST_P2P_CHOOSE", True, _flag,
            "a sender times the two ways of a message to a local rank that may go as a single copy "
            "(SHMDIST_SINGLE_COPY): that copy, or the ring, and takes the faster per destination, "
            "direction and size class, trying the other now and then (transport/ways.py); 0: always "
            "the single copy"),
    Setting("SHMDIST_ARENA_BYTES", 1 << 20, _multiple_of_page,
            "bytes of each of the two buffers per member in a group's collective arena"),
    Setting("SHMDIST_ROUND_BYTES", 512 << 10, _multiple_of_page,
            "most bytes of elements per round of a large all_reduce"),
    Setting("SHMDIST_SPIN", 4000, _count(0, (1 << 31) - 1, "a count of pauses"),
            "most cpu pauses a waiter spins before it sleeps (~50 us), when ranks do not outnumber cores"),
    Setting("SHMDIST_YIELDS", 64, _count(0, (1 << 31) - 1, "a count of yields"),
            "sched_yields a waiter makes before it sleeps, when local ranks outnumber cores"),
    Setting("SHMDIST_SECRET", None, str,
            "a shared secret: the store and the TCP transport refuse peers that cannot prove it"),
    Setting("SHMDIST_JOB_ID", "", str,
            "the job's identity (shmdist-run sets it): ranks of different jobs never meet"),
    Setting("SHMDIST_HOST_ID", None, str,
            "the host identity: ranks with the same one share memory (containers; pretend hosts in tests)"),
    Setting("SHMDIST_FAST", True, _flag,
            "0 turns every fast path off (fast.py): each call takes the general path (tests, debugging)"),
    Setting("SHMDIST_TCP_ADDR", None, str,
            "the address this rank's TCP transport listens on, when the default is wrong"),
    Setting("SHMDIST_INTER", "auto", lambda text: text.strip().lower() or "auto",
            "the engine between hosts: gloo, mpi or tcp; auto picks (inter.py)"),
    Setting("SHMDIST_SHARD_BYTES", 256 << 10, _count(0, what="a number of bytes"),
            "all_reduce across hosts at least this big is sharded: local rank i carries the i-th share "
            "between hosts (hier.py); 0 never"),
    Setting("SHMDIST_SHARD_PIECE_BYTES", 4 << 20, _count(1, what="a number of bytes"),
            "a sharded all_reduce runs in pieces of about this many bytes, so that the bytes of one "
            "piece cross between hosts while the ranks reduce the next inside the host (hier.py)"),
    Setting("SHMDIST_TRACE", True, _flag,
            "0 turns the flight recorder off (trace.py)"),
    Setting("SHMDIST_TRACE_SIZE", None, str,
            "operations each rank's flight recorder keeps (default 512, rounded up to a power of two)"),
    Setting("SHMDIST_TRACE_DIR", None, str,
            "a folder: on a DistError each rank writes its recent operations there as JSON"),
)}


_UNSET = object()


def get(name: str, default=_UNSET):
    """The value of setting ``name`` now: its environment variable parsed,
    or, when unset or empty, ``default`` if given (a default that depends on
    the situation), else the table's. A bad value raises ValueError naming
    the variable."""
    s = SETTINGS[name]
    raw = os.environ.get(name)
    if not raw:
        return s.default if default is _UNSET else default
    try:
        return s.parse(raw)
    except (ValueError, OverflowError) as e:
        raise ValueError(f"{name}={raw!r}: expected {e}; set it so, or unset it for the default") from None


# The launchers' variables (not shmdist's to define or parse: read as text, by
# rendezvous/launchers.py, which picks the first launcher found, and by the
# store's job identity). Reading one not declared here is an error.
LAUNCHER_VARIABLES = frozenset((
    # torchrun (and shmdist-run, which sets the same)
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    # Open MPI
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE",
    # MPICH/Hydra, Intel MPI, srun --mpi=pmi2
    "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
    # Slurm
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST", "SLURM_JOB_ID", "SLURM_STEP_ID",
))


def launcher(name: str) -> str | None:
    """The text of launcher variable ``name`` (one of LAUNCHER_VARIABLES), or None when unset."""
    if name not in LAUNCHER_VARIABLES:
        raise KeyError(f"{name} is not a launcher variable shmdist reads; declare it in "
                       "settings.LAUNCHER_VARIABLES")
    return os.environ.get(name)


def launcher_env() -> dict[str, str]:
    """Every launcher variable that is set, by name (what launchers.detect reads)."""
    return {name: os.environ[name] for name in LAUNCHER_VARIABLES if name in os.environ}


def describe() -> str:
    """Every setting, one per line (for docs and `python -m shmdist.settings`)."""
    return "\n".join(f"{s.name} (default {s.default!r}): {s.meaning}" for s in SETTINGS.values())


if __name__ == "__main__":
    print(describe())

"""python -m shmdist.doctor <job id | pid>: where is each rank of a running
job, and why does it wait? Read-only: it maps the ranks' flight recorders
(see trace.py) without their help and changes nothing.

    python -m shmdist.doctor 4242          # a rank's pid, or shmdist-run's
    python -m shmdist.doctor 3f9c2a1b0d4e  # SHMDIST_JOB_ID (shmdist-run sets one per job)
    python -m shmdist.doctor --json 4242   # each rank's history as JSON instead

Given a rank's pid it finds the other local ranks through the pids that
rank recorded, and rings its launcher holds (those of ranks that were
killed); given shmdist-run's pid, every ring it holds; given a job id,
every process of this user whose SHMDIST_JOB_ID is that id (or starts
with it and a dash: launchers nested in a job extend the id).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from shmdist import trace


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _job_pids(job: str) -> list[int]:
    """Processes of this user whose SHMDIST_JOB_ID is ``job`` or extends it."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != os.geteuid():
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"SHMDIST_JOB_ID="):
                value = item.split(b"=", 1)[1].decode(errors="replace")
                if value == job or value.startswith(job + "-"):
                    found.append(int(name))
                break
    return found


def find(target: str) -> dict:
    """Global rank -> Ring of the job named by ``target`` (a pid or a job id)."""
    rings: list = []
    job = None
    if target.isdigit() and os.path.exists(f"/proc/{target}"):
        pid = int(target)
        mine = trace.rings_of(pid)
        rings += mine
        own = next((r for r in mine if r.pid == pid), None)
        if own is not None:
            meta = own.meta()
            job = meta.get("job")
            for p in set(int(x) for x in meta.get("pids", {}).values()) - {pid}:
                rings += trace.rings_of(p)
            parent = _ppid(pid)
            if parent:
                rings += trace.rings_of(parent)     # shmdist-run holds its ranks' rings
    else:
        job = target
        for pid in _job_pids(target):
            rings += trace.rings_of(pid)
            parent = _ppid(pid)
            if parent:
                rings += trace.rings_of(parent)
    out: dict = {}
    for ring in rings:
        meta_job = ring.meta().get("job", "")
        if job is not None and meta_job != job and not meta_job.startswith(job + "-"):
            continue
        held = out.get(ring.rank)
        if held is None or (not held.alive() and ring.alive()):
            out[ring.rank] = ring
    return out


def _why_none(target: str) -> str:
    """What to tell when ``target`` gave no flight recorder."""
    what = (f"no flight recorder found for {target!r}: give the pid of a rank or of shmdist-run, or the job's "
            "SHMDIST_JOB_ID, of a job of this user that is running (and was not started with SHMDIST_TRACE=0)")
    if not target.isdigit():
        return what
    try:
        owner = os.stat(f"/proc/{target}").st_uid
    except OSError:
        return (f"no process {target}: the job has ended (its flight recorders went with its processes; "
                "with SHMDIST_TRACE_DIR set, the ranks that met an error left their history there), or it is "
                "not a pid; a job id is the SHMDIST_JOB_ID value")
    if owner != os.geteuid():
        try:
            import pwd
            name = f"{pwd.getpwuid(owner).pw_name} (uid {owner})"
        except (ImportError, KeyError):
            name = f"uid {owner}"
        return (f"process {target} belongs to user {name}: a flight recorder opens only for the user "
                "that runs the job; run the doctor as that user")
    return what


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shmdist.doctor",
                                description="Show where each rank of a running shmdist job is and why it waits "
                                            "(read-only, from the ranks' flight recorders).")
    p.add_argument("target", help="a rank's pid, shmdist-run's pid, or the job id (SHMDIST_JOB_ID)")
    p.add_argument("--json", action="store_true", help="print each rank's recent history as JSON")
    a = p.parse_args(argv)
    rings = find(a.target)
    if not rings:
        print(f"shmdist.doctor: {_why_none(a.target)}", file=sys.stderr)
        return 2
    world = max(r.world_size for r in rings.values())
    if a.json:
        print(json.dumps({str(k): trace.history(v) for k, v in sorted(rings.items())}, indent=1))
    else:
        print(trace.diagnose(rings, world))
    return 0


if __name__ == "__main__":
    sys.exit(main())

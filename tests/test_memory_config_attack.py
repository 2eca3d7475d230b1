"""Attacks on README's "Memory and limits" and "Configuration" sections.

- Every variable of the configuration table, given a bad value (negative,
  zero, not a number, huge, not a power of two, a typo): the ranks must end,
  each with a clear error that names the variable, never a crash from deep
  inside (OverflowError, "invalid literal for int()"), a hang, or a value
  silently taken.
- "each is read when the step that uses it runs, never at import"; `python -m
  shmdist.settings` prints the list; settings.py is the only module that
  reads the environment.
- memory_usage() reports what the rank maps (/proc/self/maps), also after a
  subgroup was destroyed and across worlds.
- A forked child (a DataLoader worker) gets a clear error from every call on
  its parent's group, never unmaps the parent's memory, whatever way it ends
  (full interpreter exit, an exception, os._exit, a signal, gc, its own job,
  multiprocessing's fork workers), and may run a job of its own.

Each case runs real processes with a timeout (run_ranks, or subprocesses
killed at their deadline), so a hang is a failure, not a stuck run.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import shmdist as dist
from ranks import RankError, free_port
from test_trust import memfd_mapped_bytes as _memfd_bytes

ROOT = pathlib.Path(__file__).resolve().parent.parent
CASE_TIMEOUT = 25          # seconds a case of two or three ranks gets (each should take ~1 s)




# ---------------------------------------------------------------- bad values

def works(rank, world_size, init_method, pass_timeout, set_here):
    """A short job that reads every setting of the shared-memory path: init (ring,
    stream, single copy, spin/yields, trace), the default arena, p2p, a subgroup,
    shmdist.empty and its in-place all_reduce. ``set_here`` is set in os.environ
    after import (the settings are read when used)."""
    os.environ.update(set_here)
    kw = {"timeout": 10} if pass_timeout else {}
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, **kw)
    x = np.full(1 << 18, rank + 1.0, dtype=np.float32)
    dist.all_reduce(x)
    if rank < 2:
        peer = 1 - rank
        box = np.zeros(1 << 16, dtype=np.float32)
        reqs = [dist.isend(np.full(1 << 16, rank, dtype=np.float32), peer), dist.irecv(box, peer)]
        for q in reqs:
            q.wait()
        assert (box == peer).all()
    sub = dist.new_group(list(range(world_size)))
    e = dist.empty(1 << 17, group=sub)
    e[:] = 1
    dist.all_reduce(e, group=sub)
    dist.barrier()
    ok = bool((x == sum(range(1, world_size + 1))).all() and (e == world_size).all())
    dist.destroy_process_group()
    return ok


# (variable, bad value, ranks, extra environment). The job passes no timeout
# argument only for SHMDIST_TIMEOUT. SHMDIST_YIELDS is read with more local ranks
# than CPUs, so it runs 3 ranks (this machine has 2 cores; more are pinned below).
BAD_VALUES = [
    ("SHMDIST_RING_BYTES", "-1", 2, {}),
    ("SHMDIST_RING_BYTES", "3000", 2, {}),
    ("SHMDIST_RING_BYTES", "abc", 2, {}),
    ("SHMDIST_RING_BYTES", "1e6", 2, {}),
    ("SHMDIST_ARENA_BYTES", "0", 2, {}),
    ("SHMDIST_ARENA_BYTES", "4097", 2, {}),
    ("SHMDIST_ARENA_BYTES", "1MiB", 2, {}),
    ("SHMDIST_ROUND_BYTES", "-4096", 2, {}),
    ("SHMDIST_ROUND_BYTES", "nan", 2, {}),
    ("SHMDIST_SINGLE_COPY", "-1", 2, {}),
    ("SHMDIST_SINGLE_COPY", "lots", 2, {}),
    ("SHMDIST_SINGLE_COPY", "99999999999999999999", 2, {}),
    ("SHMDIST_STREAM_BYTES", "-1", 2, {}),
    ("SHMDIST_STREAM_BYTES", "99999999999999999999", 2, {}),
    ("SHMDIST_TIMEOUT", "nan", 2, {}),
    ("SHMDIST_TIMEOUT", "-1", 2, {}),
    ("SHMDIST_TIMEOUT", "inf", 2, {}),
    ("SHMDIST_TIMEOUT", "ten", 2, {}),
    ("SHMDIST_SPIN", "-5", 2, {}),
    ("SHMDIST_SPIN", "1e3", 2, {}),
    ("SHMDIST_YIELDS", "-5", 3, {}),
    ("SHMDIST_YIELDS", "many", 3, {}),
    ("SHMDIST_TRACE_SIZE", "0", 2, {}),
    ("SHMDIST_TRACE_SIZE", "big", 2, {}),
    ("SHMDIST_TRANSPORT", "tpc", 2, {}),
    ("SHMDIST_INTER", "udp", 2, {"SHMDIST_TRANSPORT": "tcp"}),
    ("SHMDIST_FAST", "nope", 2, {}),
    ("SHMDIST_PAIR_CHOOSE", "disabled", 2, {}),
]


@pytest.mark.parametrize("name,value,nranks,extra", BAD_VALUES,
                         ids=[f"{n[8:]}={v}" for n, v, _, _ in BAD_VALUES])
def test_a_bad_value_gives_a_clear_error_naming_the_variable(run_ranks, name, value, nranks, extra):
    """README: every variable of the table; a bad value must end every rank with an
    error that names the variable (and says what it expected), never a crash deep
    inside, a hang, or a value silently taken."""
    env = {name: value, **extra}
    start = time.monotonic()
    try:
        results = run_ranks(works, nranks, name != "SHMDIST_TIMEOUT", {}, env=env, errors="return",
                            timeout=CASE_TIMEOUT)
    except Exception as e:      # RankTimeout: a hang
        pytest.fail(f"{name}={value!r}: the ranks did not end within {CASE_TIMEOUT} s: {e}", pytrace=False)
    took = time.monotonic() - start
    errors = [r for r in results if isinstance(r, RankError)]
    assert errors, f"{name}={value!r} was taken silently (every rank ran the job): {results}"
    said = [f"{r.type}: {r.message}" for r in errors]
    assert any(name in r.message for r in errors), f"{name}={value!r}: no rank's error names the variable: {said}"
    crashes = [s for r, s in zip(errors, said) if r.type not in ("DistError", "ValueError")
               and not r.type.startswith("Dist")]
    assert not crashes, f"{name}={value!r}: a rank crashed instead of saying what is wrong: {crashes}"
    assert took < 15, f"{name}={value!r}: {took:.1f} s to fail; a bad setting must fail at once"


def creator_with_a_bad_ring(rank, world_size, init_method):
    """Only rank 0 (which creates the host segment) has a bad SHMDIST_RING_BYTES;
    it reports its error and stays alive, as a launcher's wrapper that logs does.
    Rank 1 must learn the cause at once, not wait for its timeout."""
    if rank == 0:
        os.environ["SHMDIST_RING_BYTES"] = "5000"
    start = time.monotonic()
    try:
        dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=12)
    except Exception as e:      # noqa: BLE001 - the outcome is the result
        took = time.monotonic() - start
        if rank == 0:
            time.sleep(6)       # alive, its store still up
        return type(e).__name__, str(e), took
    dist.destroy_process_group()
    return "ok", "", time.monotonic() - start


def test_a_bad_ring_size_on_the_creator_reaches_the_other_rank_at_once(run_ranks):
    """The other rank must fail at once with the cause (as for rings too large
    for memory, tests/test_resources.py), not after its timeout, nor with
    'rank 0 has probably exited'."""
    (k0, m0, _), (k1, m1, t1) = run_ranks(creator_with_a_bad_ring, 2, timeout=40)
    assert k0 in ("DistError", "ValueError") and "SHMDIST_RING_BYTES" in m0, (k0, m0)
    assert k1 != "ok", "rank 1 initialized although rank 0 failed"
    assert t1 < 5, f"rank 1 waited {t1:.1f} s (its timeout) instead of learning rank 0's cause: {k1}: {m1}"
    assert "SHMDIST_RING_BYTES" in m1, f"rank 1 does not learn the cause: {k1}: {m1}"


# ---------------------------------------------------------------- read when used, never at import

GARBAGE = {name: "garbage!" for name in (
    "SHMDIST_RING_BYTES", "SHMDIST_ARENA_BYTES", "SHMDIST_ROUND_BYTES", "SHMDIST_SINGLE_COPY",
    "SHMDIST_P2P_CHOOSE", "SHMDIST_PAIR_CHOOSE", "SHMDIST_STREAM_BYTES", "SHMDIST_TIMEOUT",
    "SHMDIST_SPIN", "SHMDIST_YIELDS", "SHMDIST_TRANSPORT", "SHMDIST_HOST_ID", "SHMDIST_INTER",
    "SHMDIST_SHARD_BYTES", "SHMDIST_SHARD_PIECE_BYTES", "SHMDIST_TCP_ADDR", "SHMDIST_SECRET",
    "SHMDIST_TRACE", "SHMDIST_TRACE_SIZE", "SHMDIST_TRACE_DIR", "SHMDIST_FAST")}


def imports_with_garbage_then_reads_later(rank, world_size, init_method, port2):
    """Every variable is garbage while every shmdist module is imported; then
    they go, and init must work. Then, between two worlds, new sizes are set:
    the second world must use them (read at the step, not cached)."""
    import importlib
    import pkgutil
    import shmdist
    names = [m.name for m in pkgutil.walk_packages(shmdist.__path__, "shmdist.")
             if m.name not in ("shmdist.torch", "shmdist.bench", "shmdist.run", "shmdist.doctor")]
    for name in names:
        importlib.import_module(name)
    for name in GARBAGE:
        os.environ.pop(name, None)
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=20)
    x = np.ones(1000)
    dist.all_reduce(x)
    first = dist.memory_usage()
    dist.destroy_process_group()
    os.environ["SHMDIST_RING_BYTES"] = str(1 << 16)
    os.environ["SHMDIST_ARENA_BYTES"] = str(1 << 14)
    dist.init_process_group("shm", f"tcp://127.0.0.1:{port2}", rank=rank, world_size=world_size, timeout=20)
    y = np.ones(1000)
    dist.all_reduce(y)
    second = dist.memory_usage()
    mapped = _memfd_bytes()
    dist.destroy_process_group()
    return bool((x == 2).all() and (y == 2).all()), first, second, mapped


def test_settings_are_read_when_used_never_at_import(run_ranks):
    got = run_ranks(imports_with_garbage_then_reads_later, 2, free_port(), env=GARBAGE, timeout=60)
    for ok, first, second, mapped in got:
        assert ok
        assert first["ring_bytes_per_pair"] == 2 << 20, first
        assert second["ring_bytes_per_pair"] == 1 << 16, second
        assert second["collective_arenas"] < first["collective_arenas"], (first, second)
        assert second["total_mapped"] == mapped, (second, mapped)


def test_python_m_shmdist_settings_prints_every_variable_of_the_table():
    """README: `python -m shmdist.settings` prints the list (every variable of the table),
    and nothing else: no warning on the way."""
    out = subprocess.run([sys.executable, "-m", "shmdist.settings"], capture_output=True, text=True,
                         timeout=30, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    names = sorted(set(re.findall(r"^\| `(SHMDIST_[A-Z_0-9]+)", table, re.M)))
    assert len(names) >= 20, names
    printed = {line.split(" ", 1)[0] for line in out.stdout.splitlines()}
    assert [n for n in names if n not in printed] == [], "variables of README's table the list lacks"
    assert out.stderr.strip() == "", f"python -m shmdist.settings warns: {out.stderr.strip()}"


# Copies of the environment for a child process are allowed (settings.py says so),
# and the text of a probe script that runs in another interpreter.
_ALLOWED = (re.compile(r"\{\*\*os\.environ\b"), re.compile(r"dict\(os\.environ\)"),
            re.compile(r'^os\.environ\.setdefault\("DS_ACCELERATOR"'))


def test_settings_py_is_the_only_module_that_reads_the_environment():
    found = []
    for path in sorted((ROOT / "shmdist").rglob("*")):
        if path.suffix not in (".py", ".pyx", ".pxi", ".pxd", ".h") or path.name == "settings.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"os\.environ|os\.getenv|environb|\bgetenv\s*\(|secure_getenv|putenv", line) \
                    and not any(p.search(line.strip()) for p in _ALLOWED):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == [], "modules other than settings.py read the environment:\n" + "\n".join(found)


# ---------------------------------------------------------------- memory_usage

def usage_along_the_way(rank, world_size, init_method, port2):
    """memory_usage()'s total against /proc/self/maps after each step: a subgroup,
    shmdist.empty arrays, the subgroup destroyed, and an array kept into the next world."""
    steps = []

    def note(step):
        steps.append((step, dist.memory_usage()["total_mapped"], _memfd_bytes()))

    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=20)
    note("init")
    sub = dist.new_group([0, 1])
    note("subgroup")
    kept = dist.empty(1 << 16, dtype=np.float64)       # the default group's: kept into the next world
    e = dist.empty(1 << 16, group=sub) if rank < 2 else None
    note("empty")
    dist.barrier()
    if rank < 2:
        dist.destroy_process_group(sub)
    del e
    dist.barrier()
    note("subgroup destroyed")
    dist.destroy_process_group()
    dist.init_process_group("shm", f"tcp://127.0.0.1:{port2}", rank=rank, world_size=world_size, timeout=20)
    note("second world, an array of the first kept")
    kept[:] = 1
    dist.barrier()
    dist.destroy_process_group()
    return steps


def test_memory_usage_matches_the_mappings_after_a_subgroup_is_destroyed(run_ranks):
    """README: memory_usage() reports what this rank maps. A destroyed subgroup's
    arena is unmapped; memory_usage must stop counting it."""
    wrong = []
    for rank, steps in enumerate(run_ranks(usage_along_the_way, 3, free_port(), timeout=60)):
        for step, reported, mapped in steps:
            if reported != mapped:
                wrong.append(f"rank {rank} after {step}: total_mapped {reported} B, /proc/self/maps {mapped} B "
                             f"({(reported - mapped) / 2**20:+.2f} MiB)")
    assert wrong == [], "\n".join(wrong)


# ---------------------------------------------------------------- forked children

FORK_RANK = r"""
import gc, json, os, signal, socket, sys, time
import numpy as np
import shmdist as dist

MODE, FORKER = sys.argv[1], int(sys.argv[2])
rank = int(os.environ["RANK"])

def memfd_maps():
    with open("/proc/self/maps") as f:
        return sorted(l.split()[0] for l in f if "/memfd:shmdist " in l)

def try_all(sub, e):
    x = np.ones(4)
    calls = {
        "get_rank": lambda: dist.get_rank(), "memory_usage": lambda: dist.memory_usage(),
        "all_reduce": lambda: dist.all_reduce(x), "all_reduce_empty": lambda: dist.all_reduce(e, group=sub),
        "broadcast": lambda: dist.broadcast(x, 0),
        "all_gather": lambda: dist.all_gather([np.ones(4), np.ones(4)], x),
        "reduce_scatter": lambda: dist.reduce_scatter(np.ones(2), [np.ones(2), np.ones(2)]),
        "isend": lambda: dist.isend(x, 1 - rank), "irecv": lambda: dist.irecv(x, 1 - rank),
        "empty": lambda: dist.empty(4, group=sub), "new_group": lambda: dist.new_group([0, 1]),
        "barrier": lambda: dist.barrier(), "destroy_sub": lambda: dist.destroy_process_group(sub),
        "destroy": lambda: dist.destroy_process_group(),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except dist.DistError as exc:
            out[name] = "forked" if "forked" in str(exc) else f"DistError: {exc}"
        except BaseException as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out

def own_job(report):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    try:
        dist.init_process_group("shm", f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=10)
        y = np.ones(8); dist.all_reduce(y)
        z = dist.empty(1 << 17); z[:] = 2; dist.all_reduce(z)
        report["own"] = f"ok {y.sum():g} {float(z[0]):g}"
        if MODE == "own_job_destroy":
            dist.destroy_process_group()
            try:
                dist.all_reduce(y); report["after_own_destroy"] = "no error"
            except Exception as exc:
                report["after_own_destroy"] = type(exc).__name__
    except Exception as exc:
        report["own"] = f"{type(exc).__name__}: {exc}"

def child_body(sub, e, w):
    report = try_all(sub, e)
    if MODE.startswith("own_job"):
        own_job(report)
    os.write(w, json.dumps(report).encode()); os.close(w)
    if MODE == "gc":
        del sub, e
        for k in [k for k in sys.modules if k.startswith("shmdist")]:
            sys.modules.pop(k)
        gc.collect()
    if MODE == "exception":
        raise RuntimeError("the child fails")
    if MODE == "os_exit":
        os._exit(0)
    if MODE == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if MODE == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    sys.exit(0)        # a full interpreter shutdown: atexit, module teardown, every object freed

def worker(q, sub, e):
    report = try_all(sub, e)
    own_job(report)
    q.put(report)
    del e; gc.collect()

dist.init_process_group("shm", "env://", timeout=30)
sub = dist.new_group([0, 1])
e = dist.empty(1 << 17, dtype=np.float64, group=sub)   # 1 MiB: all_reduce runs in place
e[:] = rank + 1
dist.all_reduce(e, group=sub)
result = {}
maps0 = memfd_maps()
if rank == FORKER:
    if MODE == "dataloader":
        import multiprocessing as mp
        ctx = mp.get_context("fork")
        q = ctx.SimpleQueue()
        p = ctx.Process(target=worker, args=(q, sub, e)); p.start()
        result["child"] = q.get(); p.join(20); result["status"] = p.exitcode
    else:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            child_body(sub, e, w)
        os.close(w)
        with os.fdopen(r) as f:
            text = f.read()
        result["child"] = json.loads(text) if text else None
        result["status"] = os.waitpid(pid, 0)[1]
    time.sleep(0.3)
ok = True
dist.barrier()
for i in range(5):
    x = np.full(1 << 16, rank + 1.0); dist.all_reduce(x); ok &= bool((x == 3).all())
    e[:] = rank + 1 + i; dist.all_reduce(e, group=sub); ok &= bool((e == 3 + 2 * i).all())
    box = np.zeros(1 << 17, dtype=np.int32)
    reqs = [dist.isend(np.full(1 << 17, rank + i, dtype=np.int32), 1 - rank), dist.irecv(box, 1 - rank)]
    for q in reqs: q.wait()
    ok &= bool((box == 1 - rank + i).all())
g2 = dist.new_group([0, 1]); y = np.ones(10); dist.all_reduce(y, group=g2); ok &= bool((y == 2).all())
result["ok"] = ok
result["unmapped"] = [m for m in maps0 if m not in memfd_maps()]
dist.destroy_process_group()
print("RESULT " + json.dumps(result), flush=True)
"""

FORK_MODES = [("normal", 0), ("normal", 1), ("exception", 0), ("os_exit", 0), ("sigkill", 0),
              ("sigterm", 0), ("gc", 0), ("own_job", 0), ("own_job", 1), ("own_job_destroy", 0),
              ("dataloader", 0)]


@pytest.mark.parametrize("mode,forker", FORK_MODES, ids=[f"{m}-rank{r}" for m, r in FORK_MODES])
def test_a_forked_child_never_harms_the_parents_group(tmp_path, mode, forker):
    """README: a forked child must not use its parent's group; it gets a clear
    error, and it never unmaps or unlinks the parent's memory, however it ends.
    It may call init_process_group as a rank of its own. Two ranks as real
    scripts (env://), so that the child's exit is a real interpreter's."""
    script = tmp_path / "rank.py"
    script.write_text(FORK_RANK)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), mode, str(forker)],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs, deadline = [], time.monotonic() + 60
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            for q in procs:
                q.wait()
            pytest.fail(f"{mode}: the ranks did not end within 60 s\n{err[-3000:]}", pytrace=False)
        outs.append((p.returncode, out, err))
    results = []
    for rank, (code, out, err) in enumerate(outs):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert code == 0 and lines, f"rank {rank} failed (exit {code}):\n{err[-3000:]}"
        results.append(json.loads(lines[-1][7:]))
    child = results[forker]["child"]
    assert child is not None, f"{mode}: the child reported nothing"
    calls = {k: v for k, v in child.items() if k not in ("own", "after_own_destroy")}
    assert all(v == "forked" for v in calls.values()), \
        f"{mode}: calls on the parent's group in the child: {calls}"
    if mode.startswith("own_job") or mode == "dataloader":
        assert child.get("own") == "ok 8 2", child.get("own")
    if mode == "own_job_destroy":
        assert child["after_own_destroy"] == "DistNotInitializedError", child
    for rank, r in enumerate(results):
        assert r["ok"], f"{mode}: rank {rank}'s collectives went wrong after the child ended"
        assert r["unmapped"] == [], f"{mode}: rank {rank} lost mappings: {r['unmapped']}"


def test_a_bad_switch_read_by_one_member_is_refused_by_every_member(run_ranks):
    """SHMDIST_PAIR_CHOOSE is used by a group's member 0 only, after the arena is shared: a bad
    value made only rank 0 name it while the others failed later on something else (a review
    of the settings fix). Every rank's error must name it."""
    results = run_ranks(works, 2, True, {}, env={"SHMDIST_PAIR_CHOOSE": "nope"}, errors="return",
                        timeout=CASE_TIMEOUT)
    said = [f"{r.type}: {r.message}" if isinstance(r, RankError) else repr(r) for r in results]
    assert all(isinstance(r, RankError) and "SHMDIST_PAIR_CHOOSE" in r.message for r in results), said

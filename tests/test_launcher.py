"""shmdist-run: the environment of each rank, output, failures, signals, cleanup.

Every test runs the launcher as a real subprocess with a timeout. The
launcher gives each launch its own SHMDIST_JOB_ID (not the one the conftest
sets per test), so the tests read it back from the ranks to check /dev/shm.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

LAUNCHER = [sys.executable, "-m", "shmdist.run"]
TIMEOUT = 90   # seconds for one launch; a hang fails the test instead of the suite


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(**extra) -> dict[str, str]:
    env = dict(os.environ, SHMDIST_TIMEOUT="60", **extra)   # a stuck rank fails within a minute
    return env


def launch(*args, env=None, port=True) -> subprocess.CompletedProcess:
    """Run the launcher to its end; ``args`` are its flags, the script and the script's arguments."""
    ports = ["--master-port", str(free_port())] if port else []
    return subprocess.run([*LAUNCHER, *ports, *args], capture_output=True, text=True, timeout=TIMEOUT,
                          env=env or rank_env())


def script(tmp_path, *parts: str, name: str = "script.py") -> str:
    """Write a script made of ``parts`` (each dedented on its own) and return its path."""
    path = tmp_path / name
    path.write_text("".join(textwrap.dedent(part) for part in parts))
    return str(path)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for_files(paths, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, f"the ranks did not write {paths} within {seconds}s"
        time.sleep(0.05)


PRINT_ENV = """
    import json, os, sys
    names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "SHMDIST_JOB_ID"]
    line = json.dumps({**{n: os.environ.get(n) for n in names}, "argv": sys.argv[1:]}) + "\\n"
    os.write(1, line.encode())   # one write, so lines of ranks sharing the pipe do not interleave
"""


def env_of_ranks(result) -> list[dict]:
    assert result.returncode == 0, result.stderr
    return sorted((json.loads(line) for line in result.stdout.splitlines()), key=lambda e: int(e["RANK"]))


def test_each_rank_gets_its_environment(tmp_path):
    port = free_port()
    result = subprocess.run([*LAUNCHER, "--nproc-per-node", "3", "--master-port", str(port),
                             script(tmp_path, PRINT_ENV), "--lr", "0.1", "-n", "5"],
                            capture_output=True, text=True, timeout=TIMEOUT, env=rank_env())
    envs = env_of_ranks(result)
    job = envs[0]["SHMDIST_JOB_ID"]
    assert job and job != os.environ["SHMDIST_JOB_ID"]   # a fresh one, not the one inherited
    assert envs == [{"RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "3",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "SHMDIST_JOB_ID": job,
                     "argv": ["--lr", "0.1", "-n", "5"]} for r in range(3)]


def test_every_launch_has_its_own_job_id_and_a_free_port(tmp_path):
    path = script(tmp_path, PRINT_ENV)
    first, second = (env_of_ranks(launch("-n", "2", path, port=False)) for _ in range(2))
    assert first[0]["SHMDIST_JOB_ID"] != second[0]["SHMDIST_JOB_ID"]
    port = int(first[0]["MASTER_PORT"])
    assert 0 < port < 65536 and first[1]["MASTER_PORT"] == str(port)


def test_node_rank_offsets_the_global_ranks(tmp_path):
    envs = env_of_ranks(launch("--nnodes", "2", "--node-rank", "1", "--nproc_per_node", "2",
                               "--master-addr", "10.0.0.1", script(tmp_path, PRINT_ENV)))
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["MASTER_ADDR"])
            for e in envs] == [("2", "0", "4", "2", "10.0.0.1"), ("3", "1", "4", "2", "10.0.0.1")]


def test_runs_a_module_with_its_arguments(tmp_path):
    script(tmp_path, PRINT_ENV, name="printenv_mod.py")
    envs = env_of_ranks(launch("-n", "2", "-m", "printenv_mod", "a", "--b",
                               env=rank_env(PYTHONPATH=str(tmp_path))))
    assert [e["argv"] for e in envs] == [["a", "--b"], ["a", "--b"]]


@pytest.mark.parametrize("flag", ["--prefix-output", "--tee"])
def test_prefix_output_names_the_rank_on_each_line(tmp_path, flag):
    path = script(tmp_path, """
        import os, sys
        rank = os.environ["RANK"]
        print(f"hello from {rank}")
        print(f"second line {rank}")
        print(f"warning {rank}", file=sys.stderr)
    """)
    result = launch(flag, "-n", "2", path)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[rank 0] hello from 0", "[rank 0] second line 0",
                                                  "[rank 1] hello from 1", "[rank 1] second line 1"]
    assert sorted(result.stderr.splitlines()) == ["[rank 0] warning 0", "[rank 1] warning 1"]


# A rank writes its pid (and job id) to <dir>/pid.<rank> as soon as it starts.
RECORD_PID = """
    import os, sys, time
    here = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with open(os.path.join(here, f"pid.{rank}.tmp"), "w") as f:
        f.write(f"{os.getpid()} {os.environ['SHMDIST_JOB_ID']}")
    os.rename(os.path.join(here, f"pid.{rank}.tmp"), os.path.join(here, f"pid.{rank}"))

    def wait_for_everyone():
        deadline = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(here, f"pid.{r}")) for r in range(world)):
            assert time.monotonic() < deadline, "the other ranks did not start"
            time.sleep(0.05)
"""


def recorded(tmp_path, world: int) -> tuple[list[int], str]:
    """The pids of the ranks and the job id, once every rank wrote them."""
    paths = [tmp_path / f"pid.{r}" for r in range(world)]
    wait_for_files(paths)
    records = [p.read_text().split() for p in paths]
    return [int(pid) for pid, _ in records], records[0][1]


def test_a_failing_rank_stops_the_others(tmp_path):
    path = script(tmp_path, RECORD_PID, """
        wait_for_everyone()
        if rank == 1:
            sys.exit(3)
        time.sleep(60)
    """)
    started = time.monotonic()
    result = launch("-n", "3", path, str(tmp_path))
    pids, _ = recorded(tmp_path, 3)
    assert result.returncode == 3
    assert f"shmdist-run: rank 1 (pid {pids[1]}) exited with code 3; stopped the other ranks" in result.stderr
    assert not any(alive(pid) for pid in pids)
    assert time.monotonic() - started < 30   # SIGTERM ended the sleepers, no waiting them out


def test_a_rank_killed_by_a_signal_is_named(tmp_path):
    path = script(tmp_path, RECORD_PID, """
        wait_for_everyone()
        if rank == 0:
            os.kill(os.getpid(), 9)
        time.sleep(60)
    """)
    result = launch("-n", "2", path, str(tmp_path))
    pids, _ = recorded(tmp_path, 2)
    assert result.returncode == 128 + signal.SIGKILL
    assert f"rank 0 (pid {pids[0]}) was killed by signal SIGKILL; stopped the other ranks" in result.stderr
    assert not alive(pids[1])


def test_a_rank_that_ignores_sigterm_is_killed(tmp_path):
    path = script(tmp_path, """
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    """, RECORD_PID, """
        wait_for_everyone()
        if rank == 1:
            sys.exit(1)
        time.sleep(60)
    """)
    result = launch("-n", "2", path, str(tmp_path))
    pids, _ = recorded(tmp_path, 2)
    assert result.returncode == 1
    assert f"rank 0 (pid {pids[0]}) was still running" in result.stderr
    assert "killed it (SIGKILL)" in result.stderr
    assert not alive(pids[0])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_ends_every_rank(tmp_path, sig):
    """The ranks have joined a process group (so they mapped shared memory) and sleep."""
    path = script(tmp_path, """
        import shmdist as dist
        dist.init_process_group()
    """, RECORD_PID, """
        time.sleep(60)
    """)
    launcher = subprocess.Popen([*LAUNCHER, "--master-port", str(free_port()), "-n", "2", path,
                                 str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=rank_env())
    try:
        pids, job = recorded(tmp_path, 2)
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=TIMEOUT)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 128 + sig
    assert f"got {signal.Signals(sig).name}; forwarded it to every rank" in err
    assert not any(alive(pid) for pid in pids)
    assert glob.glob(f"/dev/shm/shmdist-{job}-*") == []


@pytest.mark.parametrize("code", [0, 1])
def test_the_job_puts_nothing_in_dev_shm_and_the_launcher_sweeps_nothing(tmp_path, code):
    """Segments have no name, so there is nothing to sweep: while the job
    runs, no rank maps or opens anything under /dev/shm, and the launcher
    leaves /dev/shm alone (it no longer removes what others put there)."""
    path = script(tmp_path, RECORD_PID, f"""
        import shmdist as dist
        dist.init_process_group()
        dist.new_group([0, 1])
        uses = [l for l in open("/proc/self/maps") if "/dev/shm/" in l]
        uses += [os.readlink(f"/proc/self/fd/{{fd}}") for fd in os.listdir("/proc/self/fd")
                 if os.path.exists(f"/proc/self/fd/{{fd}}")
                 and os.readlink(f"/proc/self/fd/{{fd}}").startswith("/dev/shm/")]
        print(f"uses of /dev/shm: {{len(uses)}}", flush=True)
        wait_for_everyone()
        if rank == 0:
            open(f"/dev/shm/shmdist-{{os.environ['SHMDIST_JOB_ID']}}-x", "w").close()
        dist.destroy_process_group()
        sys.exit({code} if rank == 0 else 0)
    """)
    result = launch("-n", "2", path, str(tmp_path))
    _, job = recorded(tmp_path, 2)
    try:
        assert result.returncode == code, result.stderr
        assert result.stdout.count("uses of /dev/shm: 0") == 2, result.stdout
        assert "removed" not in result.stderr
        assert glob.glob(f"/dev/shm/shmdist-{job}-*") == [f"/dev/shm/shmdist-{job}-x"]
    finally:
        for p in glob.glob(f"/dev/shm/shmdist-{job}-*"):
            os.unlink(p)


@pytest.mark.parametrize("flags, message", [
    (["-n", "0"], "--nproc-per-node must be at least 1, got 0"),
    (["--nnodes", "2", "--node-rank", "2", "--master-port", "1234"], "--node-rank 2 is outside [0, 2)"),
    (["--nnodes", "2"], "pass --master-port"),
])
def test_bad_flags_are_refused_with_the_fix(tmp_path, flags, message):
    path = script(tmp_path, "print('ran')\n")
    result = subprocess.run([*LAUNCHER, *flags, path], capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 2
    assert message in result.stderr
    assert "ran" not in result.stdout


def test_console_script_is_installed():
    # beside this interpreter (a venv used without activating it), else on PATH
    exe = shutil.which("shmdist-run", path=os.pathsep.join([os.path.dirname(sys.executable),
                                                            os.environ.get("PATH", "")]))
    if exe is None:
        pytest.skip("shmdist-run is not installed; run `pip install -e .`")
    result = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0
    assert "--nproc-per-node" in result.stdout

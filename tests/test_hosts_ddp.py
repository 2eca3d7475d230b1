"""torchrun on each of 2 pretend hosts (2 ranks each), an unchanged DDP
script with backend "shm" (inter-host leg on gloo, or on our TCP), against
the same script with backend "gloo": the same losses and parameters, bit
for bit (tests/ddp_hosts.py keeps its arithmetic exact, see there).
Needs torch and pretend hosts (root)."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import warnings

import pytest

pytest.importorskip("torch")
import hosts  # noqa: E402

WHY = hosts.unavailable()
pytestmark = pytest.mark.skipif(bool(WHY), reason=WHY or "")
TORCHRUN_SECONDS = 90     # each torchrun (its 2 ranks on a host); a run takes ~6 s on a quiet machine
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_hosts.py")


def _torchrun_on_hosts(backend: str, inter: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("SHMDIST_HOST_ID", "SHMDIST_TCP_ADDR", "SHMDIST_INTER", "MASTER_ADDR", "MASTER_PORT",
                        "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if inter:
        env["SHMDIST_INTER"] = inter
    if backend == "gloo":
        env["GLOO_SOCKET_IFNAME"] = "eth0"     # gloo's own knob: the host names do not resolve
    hung = []
    with hosts.PretendHosts(2) as h:
        procs = [subprocess.Popen(
            h.command(i, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i),
                          "--nproc-per-node", "2", "--master-addr", h.addresses[0], "--master-port", "29500",
                          SCRIPT, "--backend", backend]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
            for i in range(2)]
        outs = []
        try:
            for p in procs:
                try:
                    outs.append(p.communicate(timeout=TORCHRUN_SECONDS))
                except subprocess.TimeoutExpired:
                    hung.append(p)
                    os.killpg(p.pid, 9)     # torchrun and the ranks it started
                    outs.append(p.communicate())
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.communicate()
    lines = outs[0][0].strip().splitlines()
    # gloo itself sometimes aborts, or hangs, in its teardown after the script printed its results
    # (see test_torch_backend): the reference run is then still whole
    finished = len(lines) == 4 and lines[-1].startswith(f"{backend} world_size 4 parameters ")
    for p, (out, err) in zip(procs, outs):
        gloo_teardown = backend == "gloo" and finished and (p in hung or "terminate called" in err)
        what = f"hung for {TORCHRUN_SECONDS} s" if p in hung else f"failed (exit {p.returncode})"
        assert (p.returncode == 0 and p not in hung) or gloo_teardown, \
            f"{backend}/{inter}: torchrun {what}:\n{out[-4000:]}\n{err[-4000:]}"
    if hung:
        warnings.warn(f"{backend}: gloo hung in its teardown for {TORCHRUN_SECONDS} s after printing its results")
    return lines


@functools.cache
def _gloo_reference() -> tuple:
    """The same script on backend gloo, run once for every case."""
    return tuple(_torchrun_on_hosts("gloo", None))


@pytest.mark.timeout(3 * 2 * TORCHRUN_SECONDS)
@pytest.mark.parametrize("inter", ["gloo", "tcp"])
def test_ddp_across_hosts_matches_gloo_bit_for_bit(inter):
    shm = _torchrun_on_hosts("shm", inter)
    gloo = list(_gloo_reference())
    assert len(shm) == 4 and shm[-1].startswith("shm world_size 4 parameters "), shm
    assert shm[:-1] == gloo[:-1], f"other losses: {shm} vs {gloo}"
    assert shm[-1].split()[-1] == gloo[-1].split()[-1], f"other parameters: {shm[-1]} vs {gloo[-1]}"

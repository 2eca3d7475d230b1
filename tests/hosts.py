"""Pretend hosts on one machine, separate the way real hosts are.

Each host is a process ("keeper") that holds three namespaces of its own:

- a network namespace with one interface, ``eth0``, its own address
  (10.213.0.<1+i>/24), the far end of a veth pair whose other end sits on
  a bridge in a "switch" namespace (also held by a keeper of ours);
- a mount namespace with its own ``/dev/shm``: a 64 MB tmpfs, as Docker
  gives by default, so that two hosts cannot map each other's memory;
- a UTS namespace with its own hostname, ``shmdist-ph<i>``, which no
  resolver knows (the way a fresh cluster node's name often is).

Nothing is named anywhere (no ``ip netns add``, no mount in this
machine's namespace): the namespaces, the veths and the bridge exist only
as long as the keepers do, and the keepers are started with
PR_SET_PDEATHSIG, so they die with the process that made them even when it
is killed. ``close()`` ends them by pid. Only addresses inside those
namespaces are ever used.

A rank enters a host with ``PretendHosts.enter(keeper_pid)`` (setns into
the three namespaces), which is what ``in_host`` does as the first thing
in a rank process started by ``run_ranks``; a command runs inside one
with ``hosts.command(i, argv)`` (nsenter).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import signal
import subprocess
import sys
import time

SUBNET = "10.213.0"
PR_SET_PDEATHSIG = 1
CLONE_FS = 0x00000200
_NS = (("net", 0x40000000), ("uts", 0x04000000), ("mnt", 0x00020000))   # CLONE_NEWNET, NEWUTS, NEWNS


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _die_with_parent() -> None:   # preexec_fn of a keeper
    _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def unavailable() -> str:
    """Why pretend hosts cannot be made here ('' when they can)."""
    if os.geteuid() != 0:
        return "pretend hosts need root (network and mount namespaces)"
    for tool in ("ip", "unshare", "nsenter"):
        if not shutil.which(tool):
            return f"pretend hosts need '{tool}'"
    probe = subprocess.run(["unshare", "--net", "--mount", "--uts", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm && ip link add name x0 type veth peer name x1"],
                           capture_output=True, text=True)
    if probe.returncode:
        return f"cannot make namespaces, a tmpfs or a veth here: {probe.stderr.strip()}"
    return ""


def _sh(argv: list, what: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"pretend hosts: {what} failed: {' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


class PretendHosts:
    """``n`` hosts on a bridge; see the module doc. A context manager."""

    def __init__(self, n: int, shm_bytes: int = 64 << 20):
        self.n = n
        self.shm_bytes = shm_bytes
        self.keepers: list[subprocess.Popen] = []
        self.switch: subprocess.Popen | None = None
        self.addresses = [f"{SUBNET}.{1 + i}" for i in range(n)]
        self.hostnames = [f"shmdist-ph{i}" for i in range(n)]

    # ------------------------------------------------------------ life

    def __enter__(self) -> "PretendHosts":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _keeper(self, flags: list, script: str) -> subprocess.Popen:
        p = subprocess.Popen(["unshare", *flags, "--propagation", "private", "sh", "-c",
                              f"{script} && echo ready && exec sleep 100000"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=_die_with_parent)
        line = p.stdout.readline()
        if line.strip() != "ready":
            p.kill()
            err = p.stderr.read()
            p.wait()
            raise RuntimeError(f"pretend hosts: a keeper did not start: {err.strip()}")
        return p

    def _start(self) -> None:
        self.switch = self._keeper(["--net", "--mount"], "ip link add name br0 type bridge && ip link set br0 up")
        for i in range(self.n):
            k = self._keeper(["--net", "--mount", "--uts"],
                             f"mount -t tmpfs -o size={self.shm_bytes} tmpfs /dev/shm && "
                             f"hostname {self.hostnames[i]} && ip link set lo up")
            self.keepers.append(k)
            self.in_switch(["ip", "link", "add", "name", f"h{i}", "type", "veth", "peer", "name", "eth0",
                            "netns", str(k.pid)], "making a veth")
            self.in_switch(["ip", "link", "set", f"h{i}", "master", "br0", "up"], "plugging a veth in")
            self.in_host(i, ["ip", "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0"], "an address")
            self.in_host(i, ["ip", "link", "set", "eth0", "up"], "bringing eth0 up")

    def namespaces(self) -> set[str]:
        """The network namespaces of our keepers (as /proc/PID/ns/net reads)."""
        found = set()
        for p in [*self.keepers, self.switch]:
            if p is not None and p.poll() is None:
                try:
                    found.add(os.readlink(f"/proc/{p.pid}/ns/net"))
                except OSError:
                    pass
        return found

    def leftovers(self) -> list[int]:
        """Pids of the processes inside our namespaces other than the keepers
        (ranks, nsenter'd commands, an mpiexec's proxies): everything there
        was started by us, since nothing else can enter them."""
        ours = self.namespaces()
        keepers = {p.pid for p in [*self.keepers, self.switch] if p is not None}
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in keepers or int(entry) == os.getpid():
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/net") in ours:
                    found.append(int(entry))
            except OSError:
                pass
        return found

    def close(self) -> None:
        """End what is left inside the hosts (by pid), then every keeper (by
        pid): the namespaces, veths and bridge go with them, a failed test or not."""
        for _ in range(3):
            left = self.leftovers()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}/ns") for pid in left):
                time.sleep(0.02)
        for p in [*self.keepers, self.switch]:
            if p is not None and p.poll() is None:
                p.kill()
            if p is not None:
                p.wait()
                p.stdout.close()
                p.stderr.close()
        self.keepers, self.switch = [], None

    # ------------------------------------------------------------ inside

    @property
    def pids(self) -> list[int]:
        return [k.pid for k in self.keepers]

    def command(self, i: int, argv: list) -> list:
        """``argv`` as it runs inside host ``i``."""
        return ["nsenter", "-t", str(self.keepers[i].pid), "-n", "-m", "-u", "--", *argv]

    def in_host(self, i: int, argv: list, what: str = "a command") -> str:
        return _sh(self.command(i, argv), what)

    def in_switch(self, argv: list, what: str = "a command") -> str:
        return _sh(["nsenter", "-t", str(self.switch.pid), "-n", "--", *argv], what)

    def link(self, i: int, up: bool) -> None:
        """Bring host ``i``'s cable up or down (its end on the switch)."""
        self.in_switch(["ip", "link", "set", f"h{i}", "up" if up else "down"], "setting a link")

    def limit(self, rate: str = "10gbit") -> None:
        """A token-bucket qdisc on every host's eth0 (egress), as a datacenter link."""
        for i in range(self.n):
            self.in_host(i, ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate,
                             "burst", "4mb", "latency", "50ms"], "limiting a link")


    def mpiexec(self, mpiexec: str, n: int, ppn: int, folder: str) -> list:
        """MPICH's (Hydra's) mpiexec, started inside host 0, starting its
        proxies on the hosts by their addresses: ``-bootstrap ssh`` with
        ``-bootstrap-exec`` a script that, called as ssh would be
        (``[-x] HOST COMMAND``), runs COMMAND inside that host's namespaces
        (nsenter) instead of logging in. The proxies call back to mpiexec on
        host 0's address, the ranks find each other on eth0, and MPICH tells
        hosts apart by their host names, as on real hosts. Append the program."""
        script = os.path.join(folder, "nsexec.sh")
        cases = "\n".join(f"  {a}|{name}) pid={pid} ;;" for a, name, pid in
                           zip(self.addresses, self.hostnames, self.pids))
        with open(script, "w") as f:
            f.write(f"""#!/bin/sh
# ssh as Hydra calls it ([options] HOST COMMAND...), into a pretend host instead (tests/hosts.py)
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host=$1; shift
case "$host" in
{cases}
  *) echo "nsexec.sh: not a pretend host: $host" >&2; exit 1 ;;
esac
exec nsenter -t "$pid" -n -m -u -- sh -c "$*"
""")
        os.chmod(script, 0o755)
        return self.command(0, [mpiexec, "-hosts", ",".join(self.addresses[:-(-n // ppn)]), "-ppn", str(ppn),
                                "-n", str(n), "-bootstrap", "ssh", "-bootstrap-exec", script])


def enter(keeper_pid: int) -> None:
    """Move this process's calling thread (and the threads and processes it
    starts from now on) into a pretend host's namespaces. Threads already
    running (numpy's, say) share the file-system context, which a mount
    namespace cannot be entered with: unshare(CLONE_FS) gives this thread
    its own first."""
    libc = _libc()
    if libc.unshare(CLONE_FS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_FS): {os.strerror(err)}")
    for name, flag in _NS:
        fd = os.open(f"/proc/{keeper_pid}/ns/{name}", os.O_RDONLY)
        try:
            if libc.setns(fd, flag) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into host (keeper pid {keeper_pid}) {name} namespace: "
                              f"{os.strerror(err)}")
        finally:
            os.close(fd)


def in_host(rank, world_size, init_method, pids, layout, target, *args):
    """A run_ranks target: enter host ``layout[rank]`` (an index into
    ``pids``), then run ``target`` there."""
    enter(pids[layout[rank]])
    return target(rank, world_size, init_method, *args)


def master_url(hosts: PretendHosts, port: int = 29500) -> str:
    """tcp:// of a port on host 0 (inside its namespace every port is free)."""
    return f"tcp://{hosts.addresses[0]}:{port}"


if __name__ == "__main__":   # a quick look: python tests/hosts.py
    why = unavailable()
    if why:
        sys.exit(why)
    with PretendHosts(2) as h:
        for i in range(2):
            print(h.in_host(i, ["sh", "-c", "hostname; ip -4 -o addr show eth0; df -h /dev/shm | tail -1"]))
        print(h.in_host(0, ["ping", "-c", "1", "-W", "2", h.addresses[1]]) if shutil.which("ping") else "")
        time.sleep(0)

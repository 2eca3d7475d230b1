"""Ranks on pretend hosts that are separate the way hosts are (tests/hosts.py):
own network namespace and address, own /dev/shm, own unresolvable host
name. No SHMDIST_HOST_ID, no SHMDIST_TCP_ADDR, no /etc/hosts edits.
Skips where pretend hosts cannot be made (not root, no `ip`)."""
from __future__ import annotations

import os
import socket
import subprocess
import time

import numpy as np
import pytest

import hosts
import shmdist as dist
from hosts import in_host, master_url

WHY = hosts.unavailable()
BLOCKS = (0, 0, 1, 1)          # 2 hosts x 2 ranks: ranks 0,1 on host 0; 2,3 on host 1
INTERLEAVED = (0, 1, 0, 1)


@pytest.fixture
def pretend_hosts(monkeypatch):
    """Two pretend hosts, torn down (keepers ended by pid) however the test ends."""
    if WHY:
        pytest.skip(WHY)
    for var in ("SHMDIST_HOST_ID", "SHMDIST_TCP_ADDR", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with hosts.PretendHosts(2) as h:
        yield h


def test_pretend_hosts_are_separate_and_leave_nothing(pretend_hosts):
    h = pretend_hosts
    names = [h.in_host(i, ["hostname"]).strip() for i in range(2)]
    assert names == h.hostnames
    for name in names:
        with pytest.raises(OSError):
            socket.gethostbyname(name)     # unresolvable, as the hosts were
    h.in_host(0, ["sh", "-c", "echo x > /dev/shm/shmdist-ph-probe"])
    assert h.in_host(0, ["ls", "/dev/shm"]).split() == ["shmdist-ph-probe"]
    assert h.in_host(1, ["ls", "/dev/shm"]).split() == []
    assert not os.path.exists("/dev/shm/shmdist-ph-probe")
    assert "65536" in h.in_host(1, ["df", "-k", "/dev/shm"])    # a 64 MB tmpfs
    assert h.addresses[1] in h.in_host(1, ["ip", "-4", "-o", "addr", "show", "eth0"])
    # host 0 reaches host 1's address over the bridge
    server = subprocess.Popen(h.command(1, ["python3", "-c", (
        "import socket; s = socket.create_server(('%s', 5000)); print('up', flush=True); "
        "c, _ = s.accept(); c.sendall(b'hi'); c.close()" % h.addresses[1])]), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        said = h.in_host(0, ["python3", "-c", (
            "import socket; print(socket.create_connection(('%s', 5000), timeout=10).recv(2).decode())"
            % h.addresses[1])])
        assert said.strip() == "hi"
    finally:
        server.wait(timeout=10)
        server.stdout.close()
    pids = h.pids
    nets = h.namespaces()
    # a leftover inside a host (a rank a failed test did not end): close() ends it too
    stray = subprocess.Popen(h.command(1, ["sleep", "1000"]), stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while len(h.leftovers()) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    inside = h.leftovers()
    assert inside, "the stray sleep is not seen inside the host"
    h.close()
    assert stray.wait(timeout=10) != 0
    for pid in [*pids, *inside]:
        assert not os.path.exists(f"/proc/{pid}/ns"), "a process outlived close()"
    for entry in os.listdir("/proc"):   # no process holds our namespaces: they are gone
        try:
            assert os.readlink(f"/proc/{entry}/ns/net") not in nets, f"pid {entry} is still inside"
        except OSError:
            pass


def _identity(rank, world_size, init_method):
    from shmdist.rendezvous.hosts import host_identity, identity_parts
    return host_identity(), identity_parts()[0]


def test_host_identity_tells_pretend_hosts_apart(run_ranks, pretend_hosts):
    h = pretend_hosts
    got = run_ranks(in_host, 4, h.pids, BLOCKS, _identity, timeout=60)
    ids = [g[0] for g in got]
    assert ids[0] == ids[1] and ids[2] == ids[3] and ids[0] != ids[2]
    assert [g[1] for g in got] == [h.hostnames[i] for i in BLOCKS]


def _init_and_talk(rank, world_size, init_method):
    """init with nothing but the master's address; a p2p ring and an all_reduce."""
    dist.init_process_group("shm", init_method, rank=rank, world_size=world_size, timeout=60)
    w = dist.api.group.world()
    nodes = list(w.nodes)
    out = np.empty(4, dtype=np.int64)
    reqs = [dist.isend(np.full(4, rank, dtype=np.int64), (rank + 1) % world_size),
            dist.irecv(out, (rank - 1) % world_size)]
    for r in reqs:
        r.wait()
    t = np.arange(1 << 16, dtype=np.float32) * (rank + 1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"nodes": nodes, "from_left": int(out[0]), "sum_ok": bool(np.array_equal(
        t, np.arange(1 << 16, dtype=np.float32) * sum(range(1, world_size + 1))))}


@pytest.mark.parametrize("layout", [BLOCKS, INTERLEAVED], ids=["blocks", "interleaved"])
def test_init_on_pretend_hosts_needs_no_hints(run_ranks, pretend_hosts, layout):
    """The issue's failure: every rank raised socket.gaierror from tcp._listen_address
    because the host name does not resolve; the address that reaches the master is used now."""
    h = pretend_hosts
    got = run_ranks(in_host, 4, h.pids, layout, _init_and_talk, timeout=120,
                    init_method=master_url(h))
    for rank, g in enumerate(got):
        assert g["from_left"] == (rank - 1) % 4 and g["sum_ok"], g
    nodes = got[0]["nodes"]
    assert [nodes[r] == nodes[0] for r in range(4)] == [layout[r] == layout[0] for r in range(4)]


def test_listen_address_unwraps_the_stores_it_is_handed():
    """tcp._listen_address is handed WatchedStore(PrefixStore(TCPStore)): it must find the master."""
    from shmdist.rendezvous import store as rendezvous
    from shmdist.rendezvous.hosts import listen_address, master_of
    from ranks import free_port
    port = free_port()
    store = rendezvous.TCPStore("127.0.0.1", port, is_master=True, timeout=10)
    try:
        wrapped = rendezvous.WatchedStore(rendezvous.PrefixStore("shmdist/", store), 0, 10)
        assert master_of(wrapped) == ("127.0.0.1", port)
        assert listen_address(wrapped) == "127.0.0.1"
    finally:
        store.close()

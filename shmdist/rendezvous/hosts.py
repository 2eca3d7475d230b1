"""Which host a rank is on, and the address other hosts reach it by.

host_identity(): ranks with equal identities share memory (one node of
the hierarchical collectives); ranks with different ones talk over the
inter-host engine. A wrong "equal" is a failure (a rank would look for
memory it cannot map), a wrong "different" only costs speed, so the
identity is made of everything that separates two hosts or two
containers on one machine:

- the host name (UTS namespace),
- the kernel's boot id (two machines),
- the network namespace (containers and pretend hosts mostly have their own),
- the device and inode of ``/dev/shm`` (a container's own tmpfs),
- the pid and IPC namespaces (peers must see each other's pids to be
  watched, and map each other's memory).

SHMDIST_HOST_ID overrides it.

listen_address(store): SHMDIST_TCP_ADDR, else the local address of the
route to the rendezvous master (so that a host whose name does not
resolve, as on a fresh cluster node or in a container, still works), else
the host name's address.
"""
from __future__ import annotations

import hashlib
import os
import socket

from shmdist import settings

HOST_ENV = "SHMDIST_HOST_ID"
ADDR_ENV = "SHMDIST_TCP_ADDR"
_NAMESPACES = ("/proc/self/ns/net", "/dev/shm", "/proc/self/ns/pid", "/proc/self/ns/ipc")


def identity_parts() -> list[str]:
    """What host_identity() is made of, readable (for doctor output and tests)."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    for path in _NAMESPACES:
        try:
            st = os.stat(path)
            parts.append(f"{path}={st.st_dev}:{st.st_ino}")
        except OSError:
            pass
    return parts


def host_identity() -> str:
    forced = settings.get(HOST_ENV)
    if forced:
        return forced
    return hashlib.sha1("|".join(identity_parts()).encode()).hexdigest()[:16]


def master_of(store) -> tuple[str, int] | None:
    """(host, port) of the rendezvous master behind ``store`` and its
    wrappers (ours: PrefixStore, WatchedStore; torch's TCPStore, PrefixStore)."""
    seen = 0
    while store is not None and seen < 16:
        seen += 1
        sock = getattr(store, "sock", None)
        if isinstance(sock, socket.socket):
            try:
                return sock.getpeername()[:2]
            except OSError:
                pass
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        if isinstance(host, str) and isinstance(port, int) and host:
            return host, port
        inner = getattr(store, "store", None)
        if inner is None and hasattr(store, "underlying_store"):   # torch's PrefixStore
            inner = store.underlying_store
        store = inner
    return None


def route_address(host: str, port: int) -> str | None:
    """The local address this host would use to reach ``host`` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(addr)
                return s.getsockname()[0]
        except OSError:
            continue
    return None


def listen_address(store, who: str = "") -> str:
    forced = settings.get(ADDR_ENV)
    if forced:
        return forced
    master = master_of(store)
    if master:
        addr = route_address(*master)
        if addr:
            return addr
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError as e:
        from shmdist.errors import DistError
        raise DistError(f"{who + ': ' if who else ''}cannot tell the address other hosts reach this one by: "
                        f"no route to the rendezvous master was found and the host name '{name}' does not "
                        f"resolve ({e}); set {ADDR_ENV} to this host's address") from None

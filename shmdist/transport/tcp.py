"""The TCP transport: channels to the ranks on other hosts.

A ``Link`` is one connection to one remote rank and offers the channel
interface of ``_core.Ring`` (``push``, ``peek``, ``pull``), so the engine
matches and waits the same way over both transports. On the wire a record
is the engine's header (HEADER_BYTES, starting with its magic and version
word) followed by the payload; the ring's padding is not sent. Payloads go
straight from the sender's tensor into the socket and from the socket into
the receiver's tensor (``recv_into`` on a view of the target address).

Sockets are non-blocking and only the engine's thread reads and writes
them. When one would block, the link asks the I/O thread to watch it; the
I/O thread sleeps in ``poll`` and, when a watched socket can move, rings
this process's doorbell so that an engine wait wakes up and moves it.

A rank that leaves (destroy_process_group, or the interpreter's exit) sends
a last record on each link, a goodbye whose payload is why it leaves: ""
or the failure it saw ("rank 2 died"). The peer then reports "left the
group ... after rank 2 died" instead of a bare closed connection, so every
survivor names the rank that failed first. A connection that closes
without a goodbye is a rank that crashed, was killed, or exited mid-send.

Connections are made eagerly at init, one per pair of ranks on different
hosts: each rank listens on a port advertised through the store, connects
to the lower ranks and accepts the higher ones. Both ends prove the job
(a digest of everyone's init record) and, with ``SHMDIST_SECRET`` set,
the secret (HMAC of the other side's nonce, as the store does); a peer
that cannot is refused.
"""
from __future__ import annotations

import ctypes
import hashlib
import hmac
import json
import mmap
import os
import select
import selectors
import socket
import struct
import threading
import time
import warnings

import numpy as np

from shmdist import _core, settings
from shmdist.transport.engine import left_because
from shmdist.errors import DistError, DistPeerError, DistTimeoutError
from shmdist.layout import CTL_BYTES, HEADER as HDR, HEADER_BYTES, MAGIC, MAX_DIMS, VERSION, record_bytes
from shmdist.rendezvous.store import SECRET_ENV, recv_exact

ADDR_ENV = "SHMDIST_TCP_ADDR"   # the address this rank listens on, when the default is wrong
HELLO = struct.Struct("<IHHi16s32s")   # magic, version, 0, rank, nonce, job digest
HELLO_MAGIC = 0x50435444              # "DTCP"
PROOF_BYTES = 32
HANDSHAKE_SECONDS = 10.0              # a connection must finish the handshake within this
MAX_PENDING = 256                     # handshakes in progress at once; beyond, the oldest goes
CLOSED = "the connection closed during the handshake"
HUNG_UP = ("closed its connection without saying goodbye (it crashed, was killed, or exited "
           "in the middle of an operation)")
GOODBYE = b"_goodbye"                  # the dtype field of the goodbye record; no dtype starts with "_"
GOODBYE_MAX = 1024                     # bytes of cause a goodbye carries at most
GOODBYE_WAIT = 1.0                     # seconds a receiver waits for the rest of a goodbye
MAX_NDIM = 64                          # torch and numpy allow no more dimensions
TORCH_ITEMSIZE = {"bfloat16": 2, "complex32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
                  "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1}
_DTYPE_CHARS = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789_[]")
_PHYSICAL_BYTES = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class FrameError(DistPeerError):
    """A remote rank sent bytes that are not a well-formed shmdist record."""

    def __init__(self, me: int, peer: int, detail: str):
        super().__init__(
            f"rank {me}: receive over TCP: rank {peer} sent a malformed message ({detail}); only "
            "shmdist ranks of this job and of the same version may connect to each other's ports "
            f"(set {SECRET_ENV} in every rank to refuse anything else)")
        self.peer, self.detail = peer, detail


def _itemsize(name: str) -> int | None:
    if name in TORCH_ITEMSIZE:
        return TORCH_ITEMSIZE[name]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return np.dtype(name).itemsize
    except (TypeError, ValueError, SyntaxError):
        return None


def check_header(raw: bytes, peer: int, me: int) -> tuple[bytes, int]:
    """Raise FrameError unless ``raw`` (HEADER_BYTES received from rank
    ``peer``) is a record header that rank could have sent: our magic and
    version, its own rank as source, a dtype name, a shape that accounts
    for the length, and a length a host could hold. Returns the dtype name
    and the length."""
    magic, version, ndim, _tag, _gid, src, _, nbytes, dtype, *dims = HDR.unpack(raw)
    if magic != MAGIC:
        raise FrameError(me, peer, f"bad magic {magic:#010x}, expected {MAGIC:#010x}")
    if version != VERSION:
        raise FrameError(me, peer, f"protocol version {version}, this rank speaks {VERSION}")
    if src != peer:
        raise FrameError(me, peer, f"it claims to come from rank {src}")
    name = dtype.rstrip(b"\0")
    if not name or not set(name) <= _DTYPE_CHARS:
        raise FrameError(me, peer, f"dtype {dtype!r} is not a dtype name")
    if nbytes > _PHYSICAL_BYTES:
        raise FrameError(me, peer, f"length {nbytes} exceeds this host's {_PHYSICAL_BYTES} bytes of memory")
    if ndim > MAX_NDIM:
        raise FrameError(me, peer, f"{ndim} dimensions, at most {MAX_NDIM} exist")
    if ndim > MAX_DIMS:
        return name, nbytes     # the header carries no shape then, only the length
    shape = dims[:ndim]
    if any(d < 0 for d in shape) or any(dims[ndim:]):
        raise FrameError(me, peer, f"shape {tuple(dims)} for {ndim} dimensions")
    itemsize = _itemsize(name.decode())
    if itemsize is not None and itemsize * int(np.prod(shape, dtype=object)) != nbytes:
        raise FrameError(me, peer, f"length {nbytes} does not match {name.decode()}{list(shape)}")
    return name, nbytes


def _memory(addr: int, nbytes: int) -> memoryview:
    """A writable view of ``nbytes`` at ``addr`` (the engine keeps the owner alive)."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(addr))


class Link:
    """The connection to one remote rank, in both directions (a channel)."""

    def __init__(self, transport: "Transport", sock: socket.socket, peer: int):
        self.transport = transport
        self.sock = sock
        self.fd = sock.fileno()
        self.me, self.peer = transport.rank, peer
        self.armed = 0               # poll events the I/O thread watches for us
        self.broken: str | None = None
        self.cause = ""              # the failure the peer said it left over (its goodbye)
        self.head = bytearray(HEADER_BYTES)
        self.got = 0                 # bytes of the next header received

    # ------------------------------------------------------------ channel interface

    def push(self, header: bytes, addr: int, nbytes: int, pos: int) -> int:
        """Send what the socket takes of one record from offset ``pos``."""
        if self.broken or self.armed & select.POLLOUT:
            return pos
        end = HEADER_BYTES + nbytes
        try:
            while pos < end:
                if pos < HEADER_BYTES:
                    parts = [memoryview(header)[pos:]] + ([_memory(addr, nbytes)] if nbytes else [])
                    pos += self.sock.sendmsg(parts)
                else:
                    pos += self.sock.send(_memory(addr + pos - HEADER_BYTES, end - pos))
        except BlockingIOError:
            self._arm(select.POLLOUT)
            return pos
        except OSError as e:
            self._break(f"closed its connection ({e.strerror})")
            return pos
        return record_bytes(nbytes)

    def take(self, tag: int, gid: int, addr: int, nbytes: int, dtype16: bytes, single: bool = True) -> int:
        """No one-call receive over a socket: the engine reads the header first."""
        return 0

    help_min = 0        # no single copies over a socket, so none to share

    def help_open(self) -> bool:
        return False

    def settle_help(self) -> bool:
        return True

    def peek(self) -> bytes | None:
        """The next record's header once it has fully arrived and is well formed."""
        if self.broken or self.armed & select.POLLIN:
            return None
        while self.got < HEADER_BYTES:
            n = self._read(memoryview(self.head)[self.got:])
            if not n:
                return None
            self.got += n
        header = bytes(self.head)
        try:
            dtype, nbytes = check_header(header, self.peer, self.me)
        except FrameError as e:
            self._break(f"sent a malformed message ({e.detail})")
            return None
        if dtype == GOODBYE:
            self._goodbye(nbytes)
            return None
        return header

    def pull(self, addr: int, nbytes: int, pos: int) -> int:
        """Receive what has arrived of the payload after a peeked header,
        straight into ``addr``."""
        if pos < HEADER_BYTES:
            pos, self.got = HEADER_BYTES, 0
        end = HEADER_BYTES + nbytes
        while pos < end and not (self.broken or self.armed & select.POLLIN):
            n = self._read(_memory(addr + pos - HEADER_BYTES, end - pos))
            if not n:
                break
            pos += n
        return record_bytes(nbytes) if pos == end else pos

    def gone(self) -> str | None:
        """None while the connection is up; else what happened to it."""
        if self.broken is None:
            try:
                if self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    self._break(HUNG_UP)
            except BlockingIOError:
                pass
            except OSError as e:
                self._break(f"closed its connection ({e.strerror})")
        return self.broken

    # ------------------------------------------------------------ helpers

    def _read(self, view: memoryview) -> int:
        """Bytes read into ``view``; 0 when none arrived (then the I/O
        thread watches the socket) or the connection is gone."""
        try:
            n = self.sock.recv_into(view)
        except BlockingIOError:
            self._arm(select.POLLIN)
            return 0
        except OSError as e:
            self._break(f"closed its connection ({e.strerror})")
            return 0
        if n == 0:
            self._break(HUNG_UP)
        return n

    def _goodbye(self, nbytes: int) -> None:
        """The peer left: read why (sent with the header, so it has arrived
        or is about to) and close the link with it."""
        self.got = 0
        cause = bytearray(min(nbytes, GOODBYE_MAX))
        got, deadline = 0, time.monotonic() + GOODBYE_WAIT
        while got < len(cause) and time.monotonic() < deadline:
            select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))
            try:
                n = self.sock.recv_into(memoryview(cause)[got:])
            except BlockingIOError:
                continue
            except OSError:
                break
            if not n:
                break
            got += n
        self.cause = bytes(cause[:got]).decode(errors="replace")
        self._break(left_because(self.cause))

    def say_goodbye(self, cause: str) -> None:
        """Send the goodbye record (best effort: never blocks; a peer whose
        socket buffer is full sees a plain hang-up instead)."""
        if self.broken:
            return
        text = cause.encode()[:GOODBYE_MAX]
        header = HDR.pack(MAGIC, VERSION, 1, 0, 0, self.me, 0, len(text), GOODBYE, len(text),
                          *([0] * (MAX_DIMS - 1)))
        try:
            self.sock.send(header + text)
        except OSError:
            pass

    def _arm(self, event: int) -> None:
        self.transport.watch(self, event)

    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handshake:
    """The accepting side of one handshake, fed as bytes arrive: the
    connector's HELLO, then (after ours and our proof) its proof."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline
        self.buf = bytearray()
        self.need = HELLO.size
        self.nonce = os.urandom(16)
        self.peer = None

    def step(self, t: "Transport", waiting, job) -> int | None:
        """None while incomplete; the peer's rank once it proved itself; -1 if refused."""
        try:
            chunk = self.sock.recv(self.need - len(self.buf))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return -1
        if not chunk:
            return -1
        self.buf += chunk
        if len(self.buf) < self.need:
            return None
        try:
            if self.peer is None:
                magic, version, _, peer, their_nonce, their_job = HELLO.unpack(self.buf)
                if (magic, version, their_job) != (HELLO_MAGIC, VERSION, job) or peer not in waiting:
                    return -1
                self.peer = peer
                self.buf, self.need = bytearray(), PROOF_BYTES
                _send_small(self.sock, HELLO.pack(HELLO_MAGIC, VERSION, 0, t.rank, self.nonce, job)
                            + t._proof(b"accept", their_nonce, job))
                return None
            if not hmac.compare_digest(bytes(self.buf), t._proof(b"connect", self.nonce, job)):
                return -1
            _send_small(self.sock, b"\1")
            return self.peer
        except OSError:
            return -1


def _send_small(sock: socket.socket, data: bytes) -> None:
    """Send a few bytes on a non-blocking socket (they fit its buffer)."""
    if sock.send(data) != len(data):
        raise OSError("short send during the handshake")


class Transport:
    """This rank's links to the ranks on other hosts, and the I/O thread.

    ``secret`` (SHMDIST_SECRET) must be the same on both ends of a link. ``ctl`` is the control block whose doorbell the engine waits on; without
    one (backend "tcp") the transport makes a private doorbell. ``ctl_memory``
    is an object that keeps ``ctl`` mapped: the I/O thread may ring it until
    the process ends.
    """

    def __init__(self, rank: int, remote: list[int], store, job: bytes, timeout: float, who: str,
                 secret: str | None, ctl: int | None = None, ctl_memory=None):
        self.rank = rank
        self.secret = secret
        if ctl is None:
            ctl_memory = np.frombuffer(mmap.mmap(-1, CTL_BYTES), dtype=np.uint8)
            ctl = ctl_memory.ctypes.data
        self.ctl, self.ctl_memory = ctl, ctl_memory
        self.lock = threading.Lock()
        self.changed: list[Link] = []
        self.closed = False
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.links: dict[int, Link] = {}
        self.thread = threading.Thread(target=self._loop, name="shmdist-tcp", daemon=True)
        try:
            self._connect_all(remote, store, job, timeout, who)
        except BaseException:
            self.close()
            raise
        self.thread.start()

    @property
    def out(self) -> dict:
        return self.links          # a link carries both directions

    inc = out

    def gone(self, peer: int) -> tuple[str | None, str, bool]:
        """transport.Transport.gone: a closed connection is final; its
        goodbye, if one came, says why the peer left."""
        link = self.links[peer]
        why = link.gone()
        return why, (link.cause if why else ""), bool(why)

    # ------------------------------------------------------------ connections

    def _proof(self, role: bytes, nonce: bytes, job: bytes) -> bytes:
        if not self.secret:
            return bytes(PROOF_BYTES)
        return hmac.new(self.secret.encode(), role + nonce + job, hashlib.sha256).digest()

    def _connect_all(self, remote, store, job, timeout, who) -> None:
        addr = _listen_address(store)
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        try:
            listener = socket.create_server((addr, 0), family=family, backlog=len(remote) + 16)
        except OSError as e:
            raise DistError(f"{who}: cannot listen for TCP peers on {addr} ({e.strerror}); set "
                            f"{ADDR_ENV} to an address of this host the other hosts can reach") from e
        with listener:
            store.set(f"tcp/{self.rank}", json.dumps([addr, listener.getsockname()[1]]).encode())
            deadline = time.monotonic() + timeout
            for peer in sorted(r for r in remote if r < self.rank):
                where = tuple(json.loads(store.get(f"tcp/{peer}", timeout)))
                self._add(peer, self._connect(peer, where, job, deadline, who))
            self._accept(listener, sorted(r for r in remote if r > self.rank), job, deadline, who)

    def _add(self, peer: int, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.links[peer] = Link(self, sock, peer)

    def _connect(self, peer, where, job, deadline, who) -> socket.socket:
        nonce = os.urandom(16)
        try:
            sock = socket.create_connection(where, timeout=max(0.1, deadline - time.monotonic()))
        except OSError as e:
            raise DistError(f"{who}: cannot connect to rank {peer} at {where[0]}:{where[1]} ({e}); "
                            "check that the hosts reach each other on that address (a firewall?), or "
                            f"set {ADDR_ENV} on rank {peer} to an address this host can reach") from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(HELLO.pack(HELLO_MAGIC, VERSION, 0, self.rank, nonce, job))
            magic, version, _, rank, their_nonce, their_job = HELLO.unpack(recv_exact(sock, HELLO.size, CLOSED))
            proof = recv_exact(sock, PROOF_BYTES, CLOSED)
            if (magic, version, rank, their_job) != (HELLO_MAGIC, VERSION, peer, job):
                raise ConnectionError(f"the listener is not rank {peer} of this job")
            if not hmac.compare_digest(proof, self._proof(b"accept", nonce, job)):
                raise ConnectionError(f"it failed the {SECRET_ENV} check")
            sock.sendall(self._proof(b"connect", their_nonce, job))
            if recv_exact(sock, 1, CLOSED) != b"\1":
                raise ConnectionError("it refused this rank")
        except (OSError, ConnectionError) as e:
            sock.close()
            if isinstance(e, socket.timeout):
                raise DistTimeoutError(f"{who}: rank {peer} at {where[0]}:{where[1]} did not answer the "
                                       "TCP handshake in time; is it still starting?") from e
            raise DistPeerError(f"{who}: TCP handshake with rank {peer} at {where[0]}:{where[1]} failed "
                                f"({e}); start every rank with the same {SECRET_ENV} (or none)") from e
        return sock

    def _accept(self, listener, expected, job, deadline, who) -> None:
        """Accept the higher ranks. Handshakes run side by side, each with
        its own short deadline, so a connection that says nothing (or
        garbage) costs a slot for HANDSHAKE_SECONDS at most, never the init."""
        waiting = set(expected)
        refused = 0
        pending: dict[socket.socket, _Handshake] = {}
        sel = selectors.DefaultSelector()
        listener.setblocking(False)
        sel.register(listener, selectors.EVENT_READ)
        try:
            while waiting:
                now = time.monotonic()
                for sock in [s for s, h in pending.items() if h.deadline <= now]:
                    refused += 1
                    self._forget(sel, pending, sock)
                if now >= deadline:
                    extra = (f"; {refused} connection(s) failed the job or {SECRET_ENV} check or said "
                             "nothing" if refused else "")
                    raise DistTimeoutError(
                        f"{who}: rank(s) {sorted(waiting)} on other hosts did not connect to this rank "
                        f"within the timeout{extra}; check that they run, share the same {SECRET_ENV}, "
                        "and can reach this host")
                wake = min([deadline] + [h.deadline for h in pending.values()])
                for key, _ in sel.select(max(0.0, wake - now)):
                    if key.fileobj is listener:
                        self._take(listener, sel, pending, min(deadline, now + HANDSHAKE_SECONDS))
                        continue
                    sock = key.fileobj
                    h = pending.get(sock)
                    if h is None:
                        continue
                    peer = h.step(self, waiting, job)
                    if peer is None:
                        continue
                    del pending[sock]
                    sel.unregister(sock)
                    if peer < 0:
                        refused += 1
                        sock.close()
                        continue
                    waiting.discard(peer)
                    self._add(peer, sock)
        finally:
            for sock in list(pending):
                self._forget(sel, pending, sock)
            sel.close()

    @staticmethod
    def _take(listener, sel, pending, until) -> None:
        for _ in range(64):
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:      # out of descriptors and the like: the peer retries, we do not spin
                time.sleep(0.05)
                return
            if len(pending) >= MAX_PENDING:
                oldest = min(pending, key=lambda s: pending[s].deadline)
                Transport._forget(sel, pending, oldest)
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            pending[sock] = _Handshake(sock, until)
            sel.register(sock, selectors.EVENT_READ)

    @staticmethod
    def _forget(sel, pending, sock) -> None:
        pending.pop(sock, None)
        try:
            sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    # ------------------------------------------------------------ the I/O thread

    def watch(self, link: Link, event: int) -> None:
        """Have the I/O thread ring the doorbell once ``link`` can ``event``."""
        with self.lock:
            if link.broken or link.armed & event:
                return
            link.armed |= event
            self.changed.append(link)
            if len(self.changed) == 1:
                os.write(self.wake_w, b"\0")

    def _loop(self) -> None:
        poller = select.poll()
        poller.register(self.wake_r, select.POLLIN)
        watched: dict[int, Link] = {}
        while True:
            for fd, events in poller.poll():
                if fd == self.wake_r:
                    os.read(self.wake_r, 4096)
                    with self.lock:
                        if self.closed:
                            return
                        for link in self.changed:
                            if link.fd in watched:
                                poller.modify(link.fd, link.armed)
                            else:
                                poller.register(link.fd, link.armed)
                                watched[link.fd] = link
                        self.changed = []
                    continue
                link = watched[fd]
                with self.lock:
                    if events & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                        link.armed = 0
                        poller.unregister(fd)
                        del watched[fd]
                    else:
                        link.armed &= ~events
                        poller.modify(fd, link.armed)
                _core.ring_bell(self.ctl)

    def close(self, cause: str = "", busy=()) -> None:
        """Stop the I/O thread and close every connection, saying goodbye
        with ``cause`` on each except those to the ``busy`` peers (a record
        to them went out only in part: anything more would garble it)."""
        with self.lock:
            self.closed = True
        os.write(self.wake_w, b"\0")
        if self.thread.is_alive():
            self.thread.join()
        for peer, link in self.links.items():
            if peer not in busy:
                link.say_goodbye(cause)
            _discard_unread(link.sock)   # else close() resets the connection and may drop the goodbye
            link._break(left_because(cause))
            link.sock.close()
        self.links = {}
        os.close(self.wake_r)
        os.close(self.wake_w)


def _discard_unread(sock: socket.socket, limit: int = 64 << 20) -> None:
    """Read and drop what has arrived and not been read (up to ``limit``):
    Linux answers the close of a socket with unread data by a reset, which
    can discard what this side still had queued for the peer."""
    scratch = bytearray(1 << 16)
    while limit > 0:
        try:
            n = sock.recv_into(scratch, 0, socket.MSG_DONTWAIT)
        except OSError:
            return
        if not n:
            return
        limit -= n


def _listen_address(store) -> str:
    """SHMDIST_TCP_ADDR, else the address through which this host reaches
    the rendezvous store's master, else the host name's address (see hosts.py)."""
    from shmdist.rendezvous.hosts import listen_address
    return listen_address(store)


def job_digest(records: list) -> bytes:
    """What both ends of a connection must agree on: every rank's init record."""
    return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).digest()

"""Rendezvous: parse init_method, and the small key-value stores ranks meet in.

``tcp://host:port`` and ``env://``: rank 0 serves a TCPStore, the others
connect with retries until the timeout. ``file:///path``: a FileStore.
A store maps str keys to bytes values and offers set, get (blocking with a
deadline), add (atomic counter) and arrive (a barrier that counts each caller once).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import math
import os
import resource
import selectors
import socket
import stat
import struct
import threading
import time
from urllib.parse import urlparse, unquote

from shmdist import errors, settings
from shmdist.errors import DistError, DistTimeoutError

SECRET_ENV = "SHMDIST_SECRET"
JOB_ENV = "SHMDIST_JOB_ID"       # set by shmdist-run; ranks of one job must agree on it

_OP_SET, _OP_GET, _OP_ADD, _OP_HELLO, _OP_ARRIVE, _OP_OWN, _OP_BYE = range(1, 8)
_OK, _TIMEOUT, _DENIED = range(3)
REASK_GRACE = 1.0    # how long a closing store waits for ranks about to ask again (see reasking)
_REQ = struct.Struct("<BIQd")   # op, key length, value length, timeout seconds
_REP = struct.Struct("<BQ")      # status, value length
GREETING = b"SHMDSTO1"           # the store's first bytes, then its nonce
HELLO_MAGIC = b"SHMDHEL1"        # a client's HELLO value: magic, nonce, proof, job id
NONCE_BYTES = 16
PROOF_BYTES = 32
MAX_JOB_ID = 256                 # bytes of job identity a HELLO may carry
MAX_HELLO = len(HELLO_MAGIC) + NONCE_BYTES + PROOF_BYTES + MAX_JOB_ID
MAX_KEY = 4096                   # every key and value the ranks store is far smaller
MAX_VALUE = 1 << 20
MAX_DATA = 64 << 20              # bytes all keys and values together may hold
MAX_OUT = 4 << 20                # replies queued for a client that does not read them
MAX_CONNS = 4096                 # open connections the store keeps at most (and half the fd limit)
HELLO_SECONDS = 10.0             # a connection must authenticate and ask something within this
ACCEPT_PAUSE = 0.1               # seconds the store stops accepting when out of descriptors
STORE_ID_BYTES = 16              # a store's random identity, after its proof in the HELLO answer

# The identities of the stores this process has left (destroy_process_group,
# or a failed init): met again at the same address, such a store is still the
# previous job's (its rank 0 has not closed it yet), so a rank that inits again
# with the same init_method waits for the new one instead of joining the old.
_left_stores: set[bytes] = set()


class _PreviousStore(Exception):
    """What answers is a store this process already left."""


def recv_exact(sock: socket.socket, n: int, closed: str = "connection closed") -> bytes:
    """Exactly ``n`` bytes from a blocking socket; ConnectionError(``closed``) at EOF."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(closed)
        got += k
    return bytes(buf)


def _proof(secret: str | None, role: bytes, first: bytes, second: bytes, job: bytes) -> bytes:
    """HMAC proving the secret, bound to the role, both nonces and the job."""
    if not secret:
        return bytes(PROOF_BYTES)
    return hmac.new(secret.encode(), role + first + second + job, hashlib.sha256).digest()


def job_identity() -> str:
    """The job this process belongs to, if its launcher said: SHMDIST_JOB_ID
    (shmdist-run sets it), else torchrun's TORCHELASTIC_RUN_ID, else Slurm's
    job and step ids; "" if none."""
    for value in (settings.get(JOB_ENV), settings.launcher("TORCHELASTIC_RUN_ID")):
        if value and value != "none":
            return value[:MAX_JOB_ID]
    job, step = settings.launcher("SLURM_JOB_ID"), settings.launcher("SLURM_STEP_ID")
    if job and step:   # srun: one job step
        return f"slurm-{job}.{step}"[:MAX_JOB_ID]
    return ""


class _Waiter:
    """A GET waiting for a key to exist, or an ARRIVE waiting for a count."""
    __slots__ = ("conn", "key", "deadline", "count")

    def __init__(self, conn, key, deadline, count=None):
        self.conn, self.key, self.deadline, self.count = conn, key, deadline, count

    def ready(self, data) -> bool:
        if self.count is None:
            return self.key in data
        try:
            return int(data.get(self.key, b"0")) >= self.count
        except ValueError:      # someone SET the counter to garbage: it never completes
            return False


class _BadRequest(Exception):
    """A request that no shmdist rank sends: its connection is closed."""


class _Conn:
    """One client connection: what it sent and what it still has to be sent."""
    __slots__ = ("sock", "inbuf", "out", "nonce", "authed", "member", "since", "events", "owner", "reasks")

    def __init__(self, sock: socket.socket, nonce: bytes, now: float):
        self.sock, self.nonce, self.since = sock, nonce, now
        self.inbuf = bytearray()
        self.out = bytearray()
        self.authed = False     # proved the secret (or said HELLO, without one)
        self.member = False     # made a request after HELLO: a rank's connection
        self.events = selectors.EVENT_READ
        self.owner = None       # (key, label): appended to key if it closes without BYE
        self.reasks = False     # its last wait ended in a timeout slice: it asks again at once

    def limit(self) -> int:
        """Bytes of one frame this connection may send now."""
        return _REQ.size + (MAX_KEY + MAX_VALUE if self.authed else MAX_HELLO)


class _StoreServer:
    """A single-threaded selector loop serving the TCPStore protocol.

    Hostile or broken clients cannot hurt it: a connection must say HELLO
    (proving the secret, if there is one) in one small frame before anything
    else is read, and make a request within HELLO_SECONDS; every frame is
    bounded; replies are sent without blocking, queued per connection up to
    MAX_OUT; a bad request closes its own connection only; out of
    descriptors, the store drops the oldest connection that has not made a
    request yet, or pauses accepting for a moment (no spinning).
    """

    def __init__(self, sock: socket.socket, secret: str | None, job: str = ""):
        self.sock = sock
        self.secret = secret
        self.job = job.encode()
        self.store_id = os.urandom(STORE_ID_BYTES)
        self.data: dict[str, bytes] = {}
        self.data_bytes = 0
        self.arrived: dict[str, set] = {}
        self.waiters: list[_Waiter] = []
        self.conns: dict[socket.socket, _Conn] = {}
        self.sel = selectors.DefaultSelector()
        self.trouble = ""      # why ranks may fail to reach this store, for the timeout messages
        self.dropped = 0       # connections closed for misbehaving (tests read it)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_conns = MAX_CONNS if soft == resource.RLIM_INFINITY else max(16, min(MAX_CONNS, soft // 2))
        self.accepting = True
        self.resume_at = 0.0
        self.stop = threading.Event()
        self.wake_r, self.wake_w = socket.socketpair()
        self.thread = threading.Thread(target=self._loop, name="shmdist-store", daemon=True)

    def start(self):
        self.sock.setblocking(False)
        self.sel.register(self.sock, selectors.EVENT_READ, "accept")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")
        self.thread.start()

    def close(self, timeout: float = 5.0):
        """Stop, after sending the replies already due (for up to 2 s)."""
        self.stop.set()
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass
        self.thread.join(timeout)
        deadline = time.monotonic() + min(timeout, 2.0)
        for c in list(self.conns.values()):
            if c.out:
                try:
                    c.sock.setblocking(True)
                    c.sock.settimeout(max(0.01, deadline - time.monotonic()))
                    c.sock.sendall(c.out)
                except OSError:
                    pass
            c.sock.close()
        self.conns.clear()
        for s in (self.sock, self.wake_r, self.wake_w):
            s.close()
        self.sel.close()

    def reasking(self) -> bool:
        """A rank whose wait just ended in a timeout slice (set-up waits in
        slices of 0.25 s) is about to ask again, maybe for a barrier that has
        completed since: the store must still be there to say so."""
        return any(c.reasks for c in list(self.conns.values()))

    def members(self) -> int:
        """Connections that made a request (the ranks', normally)."""
        return sum(c.member for c in self.conns.values())

    # ------------------------------------------------------------ the loop

    def _loop(self):
        while not self.stop.is_set():
            for key, events in self.sel.select(self._next_timeout()):
                try:
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self.wake_r.recv(64)
                    else:
                        conn = self.conns.get(key.fileobj)
                        if conn is not None and events & selectors.EVENT_WRITE:
                            self._flush(conn)
                        if conn is not None and events & selectors.EVENT_READ and key.fileobj in self.conns:
                            self._read(conn)
                except Exception as e:   # noqa: BLE001 - one connection's trouble must not stop the store
                    self.trouble = f"the store on rank 0 hit {type(e).__name__}: {e}"
                    if key.data not in ("accept", "wake"):
                        self._drop(key.fileobj)
            self._expire()

    def _next_timeout(self) -> float | None:
        times = [w.deadline for w in self.waiters]
        times += [c.since + HELLO_SECONDS for c in self.conns.values() if not c.member]
        if not self.accepting:
            times.append(self.resume_at)
        return max(0.0, min(times) - time.monotonic()) if times else None

    def _accept(self):
        for _ in range(64):   # a burst of connections, then serve the others
            try:
                sock, _ = self.sock.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.trouble = (f"the store on rank 0 ran out of file descriptors accepting a "
                                    f"connection ({e.strerror}); raise the open-files limit (ulimit -n)")
                    if not self._evict():
                        self._pause_accepting()
                return
            if len(self.conns) >= self.max_conns and not self._evict():
                self.trouble = (f"the store on rank 0 holds {len(self.conns)} connections, as many as half "
                                "its open-files limit allows; raise the limit (ulimit -n)")
                sock.close()
                continue
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            nonce = os.urandom(NONCE_BYTES)
            conn = _Conn(sock, nonce, time.monotonic())
            self.conns[sock] = conn
            self.sel.register(sock, selectors.EVENT_READ, "conn")
            self._send(conn, GREETING + nonce)

    def _evict(self) -> bool:
        """Drop the oldest connection that has not authenticated, else the
        oldest that has not made a request yet; False if none."""
        idle = ([c for c in self.conns.values() if not c.authed]
                or [c for c in self.conns.values() if not c.member])
        if not idle:
            return False
        self._drop(min(idle, key=lambda c: c.since).sock)
        return True

    def _pause_accepting(self):
        if self.accepting:
            self.sel.unregister(self.sock)
            self.accepting = False
        self.resume_at = time.monotonic() + ACCEPT_PAUSE

    def _drop(self, sock, misbehaved: bool = True):
        conn = self.conns.pop(sock, None)
        if conn is None:
            return
        self.dropped += misbehaved
        if conn.owner is not None:      # a rank's connection closed without goodbye: it died
            key, label = conn.owner
            old = self.data.get(key, b"")
            if len(old) < MAX_VALUE // 2:
                self.data[key] = old + label + b";"
        try:
            self.sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        self.waiters = [w for w in self.waiters if w.conn is not conn]
        sock.close()

    # ------------------------------------------------------------ bytes in and out

    def _send(self, conn: _Conn, data: bytes):
        if not conn.out:
            try:
                n = conn.sock.send(data)
            except BlockingIOError:
                n = 0
            except OSError:
                self._drop(conn.sock, misbehaved=False)
                return
            data = data[n:]
        conn.out += data
        if len(conn.out) > MAX_OUT:
            self._drop(conn.sock)       # it asks and never reads the answers
        elif conn.out and not conn.events & selectors.EVENT_WRITE:
            conn.events |= selectors.EVENT_WRITE
            self.sel.modify(conn.sock, conn.events, "conn")

    def _flush(self, conn: _Conn):
        try:
            n = conn.sock.send(conn.out)
        except BlockingIOError:
            return
        except OSError:
            self._drop(conn.sock, misbehaved=False)
            return
        del conn.out[:n]
        if not conn.out:
            conn.events &= ~selectors.EVENT_WRITE
            self.sel.modify(conn.sock, conn.events, "conn")

    def _reply(self, conn: _Conn, status: int, value: bytes = b""):
        if conn.sock in self.conns:
            self._send(conn, _REP.pack(status, len(value)) + value)

    def _read(self, conn: _Conn):
        try:
            chunk = conn.sock.recv(max(1, min(conn.limit() - len(conn.inbuf), 1 << 16)))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn.sock, misbehaved=False)
            return
        conn.inbuf += chunk
        buf = conn.inbuf
        try:
            while len(buf) >= _REQ.size and conn.sock in self.conns:
                op, klen, vlen, tmo = _REQ.unpack_from(buf)
                if not conn.authed and (op != _OP_HELLO or klen or vlen > MAX_HELLO):
                    raise _BadRequest("a request before HELLO")
                if klen > MAX_KEY or vlen > MAX_VALUE:
                    raise _BadRequest(f"a frame of {klen} + {vlen} bytes")
                end = _REQ.size + klen + vlen
                if len(buf) < end:
                    return
                key = bytes(buf[_REQ.size:_REQ.size + klen]).decode("utf-8")
                value = bytes(buf[_REQ.size + klen:end])
                del buf[:end]
                self._handle(conn, op, key, value, tmo)
        except (_BadRequest, ValueError, UnicodeDecodeError, OverflowError):
            self._drop(conn.sock)

    # ------------------------------------------------------------ requests

    def _handle(self, conn: _Conn, op, key, value, tmo):
        if op == _OP_HELLO:
            self._hello(conn, value)
            return
        conn.member = True
        conn.reasks = False
        if not math.isfinite(tmo) or tmo < 0:
            raise _BadRequest(f"timeout {tmo}")
        deadline = time.monotonic() + min(tmo, 1e7)
        if op == _OP_SET:
            self._store(key, value)
            self._reply(conn, _OK)
            self._notify(key)
        elif op == _OP_GET:
            if key in self.data:
                self._reply(conn, _OK, self.data[key])
            else:
                self.waiters.append(_Waiter(conn, key, deadline))
        elif op == _OP_ADD:
            n = int(self.data.get(key, b"0")) + int(value.decode("ascii"))
            self._store(key, str(n).encode())
            self._reply(conn, _OK, self.data[key])
            self._notify(key)
        elif op == _OP_ARRIVE:
            # Count this caller ("count:caller") in, once however often it asks,
            # and answer once ``count`` callers arrived. All answers go out in
            # one pass, so a master that exits right after its own answer cannot
            # strand the others.
            count, _, caller = value.decode("utf-8").partition(":")
            count = int(count)
            arrived = self.arrived.setdefault(key, set())
            if caller not in arrived:
                self._account(len(caller) + 64)
                arrived.add(caller)
            self._store(key, str(len(arrived)).encode())
            self.waiters.append(_Waiter(conn, key, deadline, count))
            self._notify(key)
        elif op == _OP_OWN:
            # "if this connection closes without BYE, append ``value`` to ``key``":
            # how the others learn at once that a rank died during set-up
            if len(value) > 256:
                raise _BadRequest("an OWN label too long")
            conn.owner = (key, value)
            self._reply(conn, _OK)
        elif op == _OP_BYE:
            conn.owner = None           # no reply: the client closes right after
        else:
            raise _BadRequest(f"op {op}")

    def _hello(self, conn: _Conn, value: bytes):
        """Check the client's proof and job; answer with the store's own proof."""
        at = len(HELLO_MAGIC)
        if conn.authed or not value.startswith(HELLO_MAGIC) or len(value) < at + NONCE_BYTES + PROOF_BYTES:
            raise _BadRequest("a malformed HELLO")
        their_nonce = value[at:at + NONCE_BYTES]
        proof = value[at + NONCE_BYTES:at + NONCE_BYTES + PROOF_BYTES]
        job = value[at + NONCE_BYTES + PROOF_BYTES:]
        if self.secret and not hmac.compare_digest(
                proof, _proof(self.secret, b"client", conn.nonce, their_nonce, job)):
            self._reply(conn, _DENIED, b"secret")
            self._close_after_reply(conn)
            return
        if job and self.job and job != self.job:
            self._reply(conn, _DENIED, b"job:" + self.job)
            self._close_after_reply(conn)
            return
        conn.authed = True
        self._reply(conn, _OK, _proof(self.secret, b"store", their_nonce, conn.nonce, job) + self.store_id)

    def _close_after_reply(self, conn: _Conn):
        """Refused: send the refusal (best effort, never blocking), then close."""
        try:
            conn.sock.send(conn.out)
        except OSError:
            pass
        conn.out = bytearray()
        self._drop(conn.sock)

    def _account(self, nbytes: int):
        if self.data_bytes + nbytes > MAX_DATA:
            raise _BadRequest("the store is full")
        self.data_bytes += nbytes

    def _store(self, key: str, value: bytes):
        old = self.data.get(key)
        self._account(len(key) + len(value) - (len(key) + len(old) if old is not None else 0))
        self.data[key] = value

    def _notify(self, key):
        ready = [w for w in self.waiters if w.key == key and w.ready(self.data)]
        if ready:
            self.waiters = [w for w in self.waiters if w not in ready]
            for w in ready:
                self._reply(w.conn, _OK, self.data[key])

    def _expire(self):
        now = time.monotonic()
        late = [w for w in self.waiters if w.deadline <= now]
        if late:
            self.waiters = [w for w in self.waiters if w.deadline > now]
            for w in late:
                w.conn.reasks = True
                self._reply(w.conn, _TIMEOUT)
        for c in [c for c in self.conns.values() if not c.member and c.since + HELLO_SECONDS <= now]:
            self._drop(c.sock)       # never authenticated, or never asked anything
        if not self.accepting and now >= self.resume_at:
            self.sel.register(self.sock, selectors.EVENT_READ, "accept")
            self.accepting = True


class TCPStore:
    """Key-value store over TCP; the master process also serves it.

    Both ends authenticate: the client proves ``SHMDIST_SECRET`` (HMAC of the
    store's nonce) and the store proves it back (HMAC of the client's nonce),
    so a process that bound the port first learns nothing; the client sends
    it nothing but its HELLO. Both also name their job (``job_identity``),
    and a store refuses a rank of another job. The store's answer carries its
    random identity: a process never joins a store it has left (see
    ``_left_stores``), so init -> destroy -> init with one address waits for
    rank 0's next store instead of joining the previous job's.
    """

    def __init__(self, host: str, port: int, *, is_master: bool, timeout: float,
                 scheme: str = "tcp://", secret: str | None = None, job: str | None = None):
        self.host, self.port, self.timeout = host, port, timeout
        self.scheme = scheme
        self.secret = secret if secret is not None else settings.get(SECRET_ENV)
        self.job = job_identity() if job is None else job
        self.server = None
        self.sock = None
        self.store_id = b""       # the identity of the store this client reached
        self.lock = threading.Lock()
        if is_master:
            self.server = _StoreServer(self._listen(host, port), self.secret, self.job)
            self.server.start()
            self.port = self.server.sock.getsockname()[1]
        try:
            self.sock = self._connect(timeout)
        except BaseException:
            self.close()
            raise

    def _listen(self, host, port) -> socket.socket:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        last = None
        for family, kind, proto, _, addr in infos:
            s = socket.socket(family, kind, proto)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
                s.listen(1024)
                return s
            except OSError as e:
                s.close()
                last = e
        if last is not None and last.errno == errno.EADDRINUSE:
            raise DistError(
                f"Error initializing shmdist using {self.scheme} rendezvous: port {port} on {host} is "
                "already in use (another job, or a previous run still exiting); choose another "
                "MASTER_PORT / init_method port") from last
        raise DistError(f"Error initializing shmdist using {self.scheme} rendezvous: cannot listen on "
                        f"{host}:{port}: {last}") from last

    def _fail(self, what: str) -> DistError:
        return DistError(f"Error initializing shmdist using {self.scheme} rendezvous: {what}")

    def _connect(self, timeout) -> socket.socket:
        deadline = time.monotonic() + timeout
        delay = 0.01
        last = None
        while True:
            s = None
            try:
                s = socket.create_connection((self.host, self.port), timeout=max(0.1, deadline - time.monotonic()))
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(max(0.1, min(deadline - time.monotonic(), HELLO_SECONDS)))
                self._hello(s)
                s.settimeout(None)
                return s
            except DistError:
                if s is not None:
                    s.close()
                raise
            except (OSError, ConnectionError, _PreviousStore) as e:
                if s is not None:
                    s.close()
                last = e
            if time.monotonic() + delay > deadline:
                if isinstance(last, _PreviousStore):
                    raise DistTimeoutError(
                        f"Error initializing shmdist using {self.scheme} rendezvous: the store at "
                        f"{self.host}:{self.port} is still the one of the previous job this process left "
                        f"(destroy_process_group), {timeout:g} s on: rank 0 has not destroyed that job and "
                        "started this one's store. Call destroy_process_group then init_process_group on "
                        "every rank, rank 0 included")
                trouble = self.hint()
                raise DistTimeoutError(
                    f"Error initializing shmdist using {self.scheme} rendezvous: could not reach the "
                    f"master at {self.host}:{self.port} within {timeout:g} s ({last}); "
                    + (f"{trouble}" if trouble else "check that rank 0 is running and that MASTER_ADDR / "
                       "MASTER_PORT point to it"))
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def _hello(self, s: socket.socket) -> None:
        """Authenticate both ways on a new connection, or raise DistError."""
        where = f"{self.host}:{self.port}"
        greeting = recv_exact(s, len(GREETING) + NONCE_BYTES)
        if not greeting.startswith(GREETING):
            raise self._fail(f"what answers at {where} is not a shmdist store (it sent {greeting[:8]!r}); "
                             "check MASTER_ADDR / MASTER_PORT")
        theirs, mine, job = greeting[len(GREETING):], os.urandom(NONCE_BYTES), self.job.encode()
        hello = HELLO_MAGIC + mine + _proof(self.secret, b"client", theirs, mine, job) + job
        status, value = self._request_on(s, _OP_HELLO, "", hello, 0.0)
        if status == _DENIED and value == b"secret":
            raise self._fail(f"the store at {where} refused this process's {SECRET_ENV}; set the same "
                             "secret in every rank")
        if status == _DENIED and value.startswith(b"job:"):
            other = value[4:].decode(errors="replace")
            raise self._fail(f"the store at {where} serves job '{other}', this rank belongs to job "
                             f"'{self.job}' ({JOB_ENV} / TORCHELASTIC_RUN_ID); two jobs were given the "
                             "same master port: give each job its own")
        if status != _OK:
            raise self._fail(f"the store at {where} answered HELLO with status {status}")
        proof, store_id = value[:PROOF_BYTES], value[PROOF_BYTES:]
        if self.secret and not hmac.compare_digest(proof, _proof(self.secret, b"store", mine, theirs, job)):
            raise self._fail(f"the server at {where} could not prove {SECRET_ENV}: it is not this job's store "
                             "(another process may have bound the port first). This rank sent it nothing "
                             "but its own proof; check MASTER_ADDR / MASTER_PORT and who listens there")
        if store_id and store_id in _left_stores:
            raise _PreviousStore()
        self.store_id = store_id

    @staticmethod
    def _request_on(sock, op, key, value, tmo):
        k = key.encode()
        sock.sendall(_REQ.pack(op, len(k), len(value), tmo) + k + value)
        status, n = _REP.unpack(recv_exact(sock, _REP.size))
        if n > MAX_VALUE:
            raise ConnectionError(f"the store announced a reply of {n} bytes, more than any it sends")
        return status, (recv_exact(sock, n) if n else b"")

    def _request(self, op, key, value=b"", tmo=0.0):
        from shmdist.errors import DistPeerError
        with self.lock:
            if self.sock is None:
                raise DistPeerError(f"rendezvous store at {self.host}:{self.port} is closed for this rank "
                                    f"(a request before '{key}' failed)")
            self.sock.settimeout(tmo + min(self.timeout, 60.0))   # a store that never answers
            try:
                return self._request_on(self.sock, op, key, value, tmo)
            except socket.timeout as e:
                self.sock.close()
                self.sock = None        # a late answer would be taken for the next one's
                raise DistTimeoutError(
                    f"rendezvous store at {self.host}:{self.port} did not answer '{key}' within "
                    f"{tmo + min(self.timeout, 60.0):g} s; rank 0, which serves it, is stuck or is not "
                    "this job's store") from e
            except (OSError, ConnectionError) as e:
                raise DistPeerError(
                    f"rendezvous store at {self.host}:{self.port} went away during '{key}' ({e}); "
                    "rank 0, which serves it, has probably exited") from e


    def set(self, key: str, value: bytes) -> None:
        self._request(_OP_SET, key, bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        tmo = self.timeout if timeout is None else timeout
        status, value = self._request(_OP_GET, key, b"", tmo)
        if status == _TIMEOUT:
            raise DistTimeoutError(f"rendezvous: waited {tmo:g} s for key '{key}' in the store at "
                                   f"{self.host}:{self.port}; a rank has not arrived")
        return value

    def add(self, key: str, amount: int) -> int:
        return int(self._request(_OP_ADD, key, str(int(amount)).encode())[1])

    def hint(self) -> str:
        """What the master's server saw go wrong, if anything."""
        return self.server.trouble if self.server is not None else ""

    def own(self, key: str, label: str) -> None:
        """Should this connection close without ``close()`` (the process
        crashed or was killed), the store appends ``label;`` to ``key``."""
        self._request(_OP_OWN, key, label.encode()[:256])

    def arrive(self, key: str, count: int, timeout: float | None = None, caller: str = "") -> None:
        """Barrier: return once ``count`` callers arrived at ``key``. A caller
        that asks again (after a timeout) is counted once."""
        tmo = self.timeout if timeout is None else timeout
        status, value = self._request(_OP_ARRIVE, key, f"{int(count)}:{caller}".encode(), tmo)
        if status == _TIMEOUT:
            raise DistTimeoutError(f"rendezvous: waited {tmo:g} s at barrier '{key}'; a rank has not "
                                   "arrived")

    def close(self, linger: float = 0.0) -> None:
        """Disconnect; the master also stops serving, after up to ``linger``
        seconds for the others to hang up (a failed init lingers, so the
        other ranks can still read why and fail with the real cause)."""
        sock = getattr(self, "sock", None)
        if sock is not None:
            try:
                sock.settimeout(0.5)
                sock.sendall(_REQ.pack(_OP_BYE, 0, 0, 0.0))   # a goodbye: this rank did not die
            except OSError:
                pass
            sock.close()
            self.sock = None
        if self.store_id:
            _left_stores.add(self.store_id)
        if self.server is not None:
            now = time.monotonic()
            deadline, grace = now + linger, now + REASK_GRACE
            while ((self.server.conns and time.monotonic() < deadline)
                   or (self.server.reasking() and time.monotonic() < grace)):
                time.sleep(0.01)
            self.server.close()
            self.server = None


class FileStore:
    """A store in one file, for ``file://`` rendezvous: append-only records
    under an fcntl lock. The file is removed by the last rank to close.

    The file is opened without following a symlink, and used only if it is
    a regular file of this user with mode 0600 whose first record says it
    is a shmdist store; with ``SHMDIST_SECRET`` set, its second record must
    prove the same secret, and with a job identity, its third must name the
    same job. The first rank to open an empty file writes those records.
    """

    MAGIC = "__shmdist_store__"

    def __init__(self, path: str, world_size: int, timeout: float, secret: str | None = None,
                 job: str | None = None):
        self.path, self.world_size, self.timeout = path, world_size, timeout
        self.secret = secret if secret is not None else settings.get(SECRET_ENV)
        self.job = job_identity() if job is None else job
        self.closed = True
        self.store_id = b""
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            try:
                self._open(path)
                break
            except _PreviousStore:
                if time.monotonic() + delay > deadline:
                    raise self._fail(f"it is still the store of the previous job this process left "
                                     f"(destroy_process_group), {timeout:g} s on: a rank of that job has not "
                                     "destroyed it yet (the last rank to leave removes the file). Call "
                                     "destroy_process_group then init_process_group on every rank") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
        self.closed = False
        self.add("__users__", 1)

    def _open(self, path: str) -> None:
        """Open the file and check it (or stamp it, if empty); _PreviousStore
        if it is a store this process already left."""
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise self._fail("it is a symbolic link; file:// follows none (someone may have planted "
                                 "it): use a path in a directory only you can write") from e
            raise self._fail(f"cannot open it ({e.strerror}); use a path in a writable directory that "
                             "every rank sees") from e
        try:
            os.set_blocking(self.fd, True)
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode):
                raise self._fail("it is not a regular file")
            if st.st_uid != os.geteuid():
                raise self._fail(f"it belongs to uid {st.st_uid}, not to this process's uid {os.geteuid()}; "
                                 "someone else made it: remove it or use another path")
            if stat.S_IMODE(st.st_mode) & 0o077:
                raise self._fail(f"its mode is {oct(stat.S_IMODE(st.st_mode))}; a store file must be 0600 "
                                 "(others could read or change the rendezvous): remove it or use another path")
            self._check_or_stamp()
        except BaseException:
            os.close(self.fd)
            raise

    def _fail(self, why: str) -> DistError:
        return DistError(f"Error initializing shmdist using file:// rendezvous: {self.path}: {why}")

    def _check_or_stamp(self) -> None:
        salt_proof = lambda salt: _proof(self.secret, b"file", salt, b"", b"")   # noqa: E731
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            recs = self._records()
            if not recs:
                salt = os.urandom(NONCE_BYTES)
                self._append(self.MAGIC, b"1")
                self._append("__auth__", salt + salt_proof(salt) if self.secret else b"")
                self._append("__job__", self.job.encode())
                self.store_id = os.urandom(STORE_ID_BYTES)
                self._append("__id__", self.store_id)
                return
            if recs.get(self.MAGIC) != b"1":
                raise self._fail("it is not a shmdist store file; use a fresh path")
            auth = recs.get("__auth__", b"")
            if self.secret and not (len(auth) == NONCE_BYTES + PROOF_BYTES and hmac.compare_digest(
                    auth[NONCE_BYTES:], salt_proof(auth[:NONCE_BYTES]))):
                raise self._fail(f"it was made by a rank with another {SECRET_ENV} (or none); set the same "
                                 "secret in every rank")
            if not self.secret and auth:
                raise self._fail(f"it was made by a rank with {SECRET_ENV} set; set the same secret in "
                                 "every rank")
            store_id = recs.get("__id__", b"")
            if store_id and store_id in _left_stores:
                raise _PreviousStore()
            self.store_id = store_id
            theirs = recs.get("__job__", b"").decode(errors="replace")
            if theirs and self.job and theirs != self.job:
                raise self._fail(f"it belongs to job '{theirs}', this rank to job '{self.job}' ({JOB_ENV} / "
                                 "TORCHELASTIC_RUN_ID); two jobs were given the same file: give each its own")
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _records(self) -> dict[str, bytes]:
        os.lseek(self.fd, 0, os.SEEK_SET)
        raw = b""
        while True:
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                break
            raw += chunk
        out: dict[str, bytes] = {}
        for n, line in enumerate(raw.splitlines(), 1):
            k, sep, v = line.partition(b"\t")
            try:
                if not sep:
                    raise ValueError("no tab")
                out[bytes.fromhex(k.decode("ascii")).decode()] = bytes.fromhex(v.decode("ascii"))
            except (ValueError, UnicodeDecodeError):
                raise self._fail(f"line {n} is not a store record: it is not a shmdist store file, or "
                                 "something else wrote to it; use a fresh path") from None
        return out

    def _append(self, key, value):
        os.lseek(self.fd, 0, os.SEEK_END)
        os.write(self.fd, key.encode().hex().encode() + b"\t" + bytes(value).hex().encode() + b"\n")

    def set(self, key, value):
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            self._append(key, value)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def get(self, key, timeout=None):
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        delay = 0.001
        while True:
            fcntl.flock(self.fd, fcntl.LOCK_SH)
            try:
                recs = self._records()
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            if key in recs:
                return recs[key]
            if time.monotonic() > deadline:
                raise DistTimeoutError(f"rendezvous: waited for key '{key}' in {self.path}; a rank has "
                                       "not arrived")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def add(self, key, amount):
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            n = int(self._records().get(key, b"0")) + int(amount)
            self._append(key, str(n).encode())
            return n
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self, linger: float = 0.0):
        if self.closed:
            return
        self.closed = True
        if self.store_id:
            _left_stores.add(self.store_id)
        if self.add("__users__", -1) == 0:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        os.close(self.fd)


class PrefixStore:
    """Keys of one init (or one group) under a prefix, over any store
    (ours or a torch.distributed Store)."""

    def __init__(self, prefix: str, store):
        self.prefix, self.store = prefix, store

    def set(self, key, value):
        self.store.set(self.prefix + key, value)

    def get(self, key, timeout=None):
        if isinstance(self.store, _OURS):
            return self.store.get(self.prefix + key, timeout)
        return bytes(self.store.get(self.prefix + key))   # a torch Store: its own timeout

    def add(self, key, amount):
        return int(self.store.add(self.prefix + key, amount))

    def arrive(self, key, count, timeout=None, caller=""):
        arrive(self.store, self.prefix + key, count, timeout, caller)

    def hint(self) -> str:
        return self.store.hint() if hasattr(self.store, "hint") else ""

    def own(self, key, label) -> bool:
        """As TCPStore.own, under the prefix; False where the store cannot."""
        if not hasattr(self.store, "own"):
            return False
        return self.store.own(self.prefix + key, label) is not False


def arrive(store, key: str, count: int, timeout: float | None = None, caller: str = "") -> None:
    """Barrier of ``count`` processes on any store: one request where the store
    supports it, else add then wait for the last arrival's mark."""
    if hasattr(store, "arrive"):
        store.arrive(key, count, timeout, caller)
        return
    if int(store.add(f"{key}/{caller}", 1)) == 1 and int(store.add(key, 1)) == count:
        store.set(key + "/done", b"1")
    store.get(key + "/done", timeout) if isinstance(store, _OURS) else store.get(key + "/done")


def pid_alive(pid: int) -> bool:
    """False once ``pid`` exited, zombie (not yet reaped) included."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True   # EMFILE and the like say nothing about the process: kill(0) found it


class WatchedStore:
    """The store as set-up uses it (init, new_group): waits go in slices, and
    between slices the local peers known so far are checked, so a rank that
    dies during set-up is named at once instead of after the timeout."""

    SLICE = 0.25
    DEPARTED = "departed"     # the store appends "rank R (pid P);" when R's connection drops

    def __init__(self, store, rank: int, timeout: float, op: str = "init_process_group"):
        self.store, self.rank, self.timeout, self.op = store, rank, timeout, op
        self.peers: dict[int, int] = {}     # rank -> pid, of ranks on this host
        own = getattr(store, "own", None)
        self.owned = bool(own and own(self.DEPARTED, f"rank {rank} (pid {os.getpid()})"))

    def set(self, key, value):
        self.store.set(key, value)

    def add(self, key, amount):
        return self.store.add(key, amount)

    def get(self, key, timeout=None):
        return self._sliced(lambda t: self.store.get(key, t), key, timeout)

    def arrive(self, key, count, timeout=None, caller=""):
        self._sliced(lambda t: self.store.arrive(key, count, t, caller or str(self.rank)), key, timeout)

    def check(self, key: str) -> None:
        """Raise DistPeerError if a rank on this host died (the real cause of
        whatever went wrong while this rank waited for or used ``key``)."""
        for r, pid in self.peers.items():
            if not pid_alive(pid):
                from shmdist.errors import DistPeerError
                try:        # it may have left over another rank's death, and said so
                    with errors.expected():
                        cause = self.store.get(f"failed/{r}", 0.0).decode(errors="replace")
                except DistError:
                    cause = ""
                if cause:
                    raise DistPeerError(
                        f"rank {self.rank}: {self.op}: rank {r} (pid {pid}) left the set-up after a failure "
                        f"it saw ({cause}); this rank waited for '{key}'; restart the job") from None
                raise DistPeerError(
                    f"rank {self.rank}: {self.op}: rank {r} (pid {pid}) died while the job was being "
                    f"set up (this rank waited for '{key}'); restart the job") from None
        gone = self.departed()
        if gone:
            raise self._died(gone, key)

    def departed(self) -> str:
        """Who closed their store connection without leaving ("" if no one, or unknown)."""
        if not self.owned:
            return ""
        try:
            with errors.expected():
                return self.store.get(self.DEPARTED, 0.0).decode(errors="replace").rstrip(";")
        except DistError:
            return ""

    def _died(self, gone: str, key: str):
        from shmdist.errors import DistPeerError
        return DistPeerError(
            f"rank {self.rank}: {self.op}: {gone.replace(';', ', ')} closed its connection to the rendezvous "
            f"store without leaving (it crashed or was killed) while the job was being set up (this rank "
            f"waited for '{key}'); restart the job")

    def _sliced(self, call, key, timeout):
        total = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + total
        while True:
            try:
                with errors.expected():     # a slice's timeout is no error of the job's (flight recorder)
                    return call(min(self.SLICE, max(0.01, deadline - time.monotonic())))
            except DistTimeoutError:
                for r, pid in self.peers.items():
                    if not pid_alive(pid):
                        self.check(key)           # names it
                gone = self.departed()
                if gone:
                    try:
                        return call(0.05)         # it may have left after this very wait completed
                    except DistTimeoutError:
                        raise self._died(gone, key) from None
                if time.monotonic() >= deadline:
                    hint = self.store.hint() if hasattr(self.store, "hint") else ""
                    raise DistTimeoutError(
                        f"rank {self.rank}: {self.op}: waited {total:g} s for '{key}' in the rendezvous "
                        f"store; a rank has not arrived{'; ' + hint if hint else ''}. Check that every "
                        "rank was started, with the same init_method and world_size") from None


_OURS = (TCPStore, FileStore, PrefixStore, WatchedStore)


def parse_init_method(init_method: str | None, rank: int, world_size: int):
    """Return (kind, where, rank, world_size) from init_method and the environment.

    kind is "tcp" (where = (host, port)) or "file" (where = path).
    """
    if init_method is None:
        init_method = "env://"
    from shmdist.comm import inter
    inter.prepare()   # MPI_Init, when the inter-host leg runs on MPI, before any store (see inter.py)
    url = urlparse(init_method)
    scheme = url.scheme
    if scheme == "env":
        from shmdist.rendezvous import launchers   # torchrun, mpirun/mpiexec, srun: see launchers.py
        launch, env = launchers.resolve(rank, world_size)
        try:
            if rank < 0:
                rank = int(env["RANK"])
            if world_size < 0:
                world_size = int(env["WORLD_SIZE"])
            host = env["MASTER_ADDR"]
            port = int(env["MASTER_PORT"])
        except KeyError as e:
            raise DistError(f"Error initializing shmdist using env:// rendezvous: environment variable "
                            f"{e.args[0]} expected, but not set; {launchers.missing_hint(launch)}") from None
        except ValueError as e:
            raise DistError(f"Error initializing shmdist using env:// rendezvous: {e}") from None
        return "tcp", (host, port), rank, world_size
    if scheme == "tcp":
        if not url.hostname:
            raise DistError(f"Error initializing shmdist using tcp:// rendezvous: host missing in "
                            f"'{init_method}'; write tcp://HOST:PORT")
        try:
            port = url.port
        except ValueError:
            raise DistError(f"Error initializing shmdist using tcp:// rendezvous: the port in "
                            f"'{init_method}' is not a port number (1-65535); write tcp://HOST:PORT") from None
        if port is None:
            raise DistError(f"Error initializing shmdist using tcp:// rendezvous: port number missing "
                            f"in '{init_method}'; write tcp://HOST:PORT")
        return "tcp", (url.hostname, port), rank, world_size
    if scheme == "file":
        path = unquote(url.path)
        if not path:
            raise DistError(f"Error initializing shmdist using file:// rendezvous: path missing in "
                            f"'{init_method}'; write file:///absolute/path")
        return "file", path, rank, world_size
    raise DistError(f"Error initializing shmdist: unknown init_method scheme '{scheme}://' in "
                    f"'{init_method}'; use tcp://HOST:PORT, env:// or file:///PATH")


def host_identity() -> str:
    """Ranks with the same identity can map each other's shared memory (see hosts.py).

    SHMDIST_HOST_ID overrides it (containers; tests that pretend to be
    several hosts)."""
    from shmdist.rendezvous.hosts import host_identity
    return host_identity()

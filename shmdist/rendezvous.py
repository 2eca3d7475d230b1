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
import os
import selectors
import socket
import struct
import threading
import time
from urllib.parse import urlparse, unquote

from shmdist.errors import DistError, DistTimeoutError

SECRET_ENV = "SHMDIST_SECRET"
JOB_ENV = "SHMDIST_JOB_ID"       # set by shmdist-run; ranks of one job must agree on it

_OP_SET, _OP_GET, _OP_ADD, _OP_HELLO, _OP_ARRIVE = range(1, 6)
_OK, _TIMEOUT, _DENIED = range(3)
_REQ = struct.Struct("<BIQd")   # op, key length, value length, timeout seconds
_REP = struct.Struct("<BQ")      # status, value length
_MAX_FRAME = 1 << 30


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


def _auth_token(secret: str, nonce: bytes) -> bytes:
    return hmac.new(secret.encode(), nonce, hashlib.sha256).digest()


class _Waiter:
    """A GET waiting for a key to exist, or an ARRIVE waiting for a count."""
    __slots__ = ("conn", "key", "deadline", "count")

    def __init__(self, conn, key, deadline, count=None):
        self.conn, self.key, self.deadline, self.count = conn, key, deadline, count

    def ready(self, data) -> bool:
        if self.count is None:
            return self.key in data
        return int(data.get(self.key, b"0")) >= self.count


class _StoreServer:
    """A single-threaded selector loop serving the TCPStore protocol."""

    def __init__(self, sock: socket.socket, secret: str | None):
        self.sock = sock
        self.secret = secret
        self.data: dict[str, bytes] = {}
        self.arrived: dict[str, set] = {}
        self.waiters: list[_Waiter] = []
        self.conns: dict[socket.socket, bytearray] = {}
        self.authed: set[socket.socket] = set()
        self.nonce: dict[socket.socket, bytes] = {}
        self.sel = selectors.DefaultSelector()
        self.trouble = ""      # why ranks may fail to reach this store, for the timeout messages
        self.stop = threading.Event()
        self.wake_r, self.wake_w = socket.socketpair()
        self.thread = threading.Thread(target=self._loop, name="shmdist-store", daemon=True)

    def start(self):
        self.sock.setblocking(False)
        self.sel.register(self.sock, selectors.EVENT_READ, "accept")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")
        self.thread.start()

    def close(self, timeout: float = 5.0):
        """Finish the request being served (so replies already due go out), then stop."""
        self.stop.set()
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass
        self.thread.join(timeout)
        for c in list(self.conns):
            c.close()
        for s in (self.sock, self.wake_r, self.wake_w):
            s.close()
        self.sel.close()

    def _loop(self):
        while not self.stop.is_set():
            now = time.monotonic()
            timeout = None
            if self.waiters:
                timeout = max(0.0, min(w.deadline for w in self.waiters) - now)
            for key, _ in self.sel.select(timeout):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    self.wake_r.recv(64)
                else:
                    self._read(key.fileobj)
            self._expire()

    def _accept(self):
        try:
            conn, _ = self.sock.accept()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                self.trouble = (f"the store on rank 0 could not accept a connection ({e.strerror}): "
                                "raise the open-files limit (ulimit -n)")
            return
        conn.setblocking(True)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conns[conn] = bytearray()
        nonce = os.urandom(16)
        self.nonce[conn] = nonce
        try:
            conn.sendall(nonce)
        except OSError:
            self._drop(conn)
            return
        self.sel.register(conn, selectors.EVENT_READ, "conn")

    def _drop(self, conn):
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        self.conns.pop(conn, None)
        self.authed.discard(conn)
        self.nonce.pop(conn, None)
        self.waiters = [w for w in self.waiters if w.conn is not conn]
        conn.close()

    def _reply(self, conn, status: int, value: bytes = b""):
        try:
            conn.sendall(_REP.pack(status, len(value)) + value)
        except OSError:
            self._drop(conn)

    def _read(self, conn):
        buf = self.conns.get(conn)
        if buf is None:
            return
        try:
            chunk = conn.recv(1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)
            return
        buf += chunk
        while len(buf) >= _REQ.size:
            op, klen, vlen, tmo = _REQ.unpack_from(buf)
            if klen > _MAX_FRAME or vlen > _MAX_FRAME:
                self._drop(conn)   # garbage: not one of ours
                return
            end = _REQ.size + klen + vlen
            if len(buf) < end:
                break
            key = bytes(buf[_REQ.size:_REQ.size + klen]).decode("utf-8", "replace")
            value = bytes(buf[_REQ.size + klen:end])
            del buf[:end]
            if not self._handle(conn, op, key, value, tmo):
                return

    def _handle(self, conn, op, key, value, tmo) -> bool:
        if op == _OP_HELLO:
            if self.secret and not hmac.compare_digest(value, _auth_token(self.secret, self.nonce[conn])):
                self._reply(conn, _DENIED)
                self._drop(conn)
                return False
            self.authed.add(conn)
            self._reply(conn, _OK)
            return True
        if conn not in self.authed:
            self._drop(conn)
            return False
        if op == _OP_SET:
            self.data[key] = value
            self._reply(conn, _OK)
            self._notify(key)
        elif op == _OP_GET:
            if key in self.data:
                self._reply(conn, _OK, self.data[key])
            else:
                self.waiters.append(_Waiter(conn, key, time.monotonic() + tmo))
        elif op == _OP_ADD:
            n = int(self.data.get(key, b"0")) + int(value)
            self.data[key] = str(n).encode()
            self._reply(conn, _OK, self.data[key])
            self._notify(key)
        elif op == _OP_ARRIVE:
            # Count this caller ("count:caller") in, once however often it asks,
            # and answer once ``count`` callers arrived. All answers go out in
            # one pass, so a master that exits right after its own answer cannot
            # strand the others.
            count, _, caller = value.decode().partition(":")
            arrived = self.arrived.setdefault(key, set())
            arrived.add(caller)
            self.data[key] = str(len(arrived)).encode()
            self.waiters.append(_Waiter(conn, key, time.monotonic() + tmo, int(count)))
            self._notify(key)
        else:
            self._drop(conn)
            return False
        return True

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
                self._reply(w.conn, _TIMEOUT)


class TCPStore:
    """Key-value store over TCP; the master process also serves it."""

    def __init__(self, host: str, port: int, *, is_master: bool, timeout: float,
                 scheme: str = "tcp://", secret: str | None = None):
        self.host, self.port, self.timeout = host, port, timeout
        self.scheme = scheme
        self.secret = secret if secret is not None else os.environ.get(SECRET_ENV) or None
        self.server = None
        self.lock = threading.Lock()
        if is_master:
            self.server = _StoreServer(self._listen(host, port), self.secret)
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

    def _connect(self, timeout) -> socket.socket:
        deadline = time.monotonic() + timeout
        delay = 0.01
        last = None
        while True:
            try:
                s = socket.create_connection((self.host, self.port), timeout=max(0.1, deadline - time.monotonic()))
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(None)
                nonce = recv_exact(s, 16)
                token = _auth_token(self.secret, nonce) if self.secret else b""
                status, _ = self._request_on(s, _OP_HELLO, "", token, 0.0)
                if status == _DENIED:
                    s.close()
                    raise DistError(
                        f"Error initializing shmdist using {self.scheme} rendezvous: the store at "
                        f"{self.host}:{self.port} refused this process's {SECRET_ENV}; set the same "
                        "secret in every rank")
                return s
            except (OSError, ConnectionError) as e:
                last = e
            if time.monotonic() + delay > deadline:
                raise DistTimeoutError(
                    f"Error initializing shmdist using {self.scheme} rendezvous: could not reach the "
                    f"master at {self.host}:{self.port} within {timeout:g} s ({last}); check that rank 0 "
                    "is running and that MASTER_ADDR / MASTER_PORT point to it")
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    @staticmethod
    def _request_on(sock, op, key, value, tmo):
        k = key.encode()
        sock.sendall(_REQ.pack(op, len(k), len(value), tmo) + k + value)
        status, n = _REP.unpack(recv_exact(sock, _REP.size))
        return status, (recv_exact(sock, n) if n else b"")

    def _request(self, op, key, value=b"", tmo=0.0):
        with self.lock:
            try:
                return self._request_on(self.sock, op, key, value, tmo)
            except (OSError, ConnectionError) as e:
                from shmdist.errors import DistPeerError
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
            sock.close()
            self.sock = None
        if self.server is not None:
            deadline = time.monotonic() + linger
            while self.server.conns and time.monotonic() < deadline:
                time.sleep(0.01)
            self.server.close()
            self.server = None


class FileStore:
    """A store in one file, for ``file://`` rendezvous: append-only records
    under an fcntl lock. The file is removed by the last rank to close."""

    def __init__(self, path: str, world_size: int, timeout: float):
        self.path, self.world_size, self.timeout = path, world_size, timeout
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise DistError(f"Error initializing shmdist using file:// rendezvous: cannot open {path}: "
                            f"{e}; use a path in a writable directory that every rank sees") from e
        self.closed = False
        self.add("__users__", 1)

    def _records(self) -> dict[str, bytes]:
        os.lseek(self.fd, 0, os.SEEK_SET)
        raw = b""
        while True:
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                break
            raw += chunk
        out: dict[str, bytes] = {}
        for line in raw.splitlines():
            k, _, v = line.partition(b"\t")
            out[bytes.fromhex(k.decode()).decode()] = bytes.fromhex(v.decode())
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
    except OSError:
        return False


class WatchedStore:
    """The store as set-up uses it (init, new_group): waits go in slices, and
    between slices the local peers known so far are checked, so a rank that
    dies during set-up is named at once instead of after the timeout."""

    SLICE = 0.25

    def __init__(self, store, rank: int, timeout: float, op: str = "init_process_group"):
        self.store, self.rank, self.timeout, self.op = store, rank, timeout, op
        self.peers: dict[int, int] = {}     # rank -> pid, of ranks on this host

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
                raise DistPeerError(
                    f"rank {self.rank}: {self.op}: rank {r} (pid {pid}) died while the job was being "
                    f"set up (this rank waited for '{key}'); restart the job") from None

    def _sliced(self, call, key, timeout):
        total = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + total
        while True:
            try:
                return call(min(self.SLICE, max(0.01, deadline - time.monotonic())))
            except DistTimeoutError:
                self.check(key)
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
    url = urlparse(init_method)
    scheme = url.scheme
    if scheme == "env":
        env = os.environ
        try:
            if rank < 0:
                rank = int(env["RANK"])
            if world_size < 0:
                world_size = int(env["WORLD_SIZE"])
            host = env["MASTER_ADDR"]
            port = int(env["MASTER_PORT"])
        except KeyError as e:
            raise DistError(f"Error initializing shmdist using env:// rendezvous: environment variable "
                            f"{e.args[0]} expected, but not set; run under shmdist-run or torchrun, or "
                            "pass init_method='tcp://HOST:PORT' with rank and world_size") from None
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
            port = None
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
    """Ranks with the same identity can map each other's shared memory.

    SHMDIST_HOST_ID overrides it (containers; tests that pretend to be
    several hosts)."""
    forced = os.environ.get("SHMDIST_HOST_ID")
    if forced:
        return forced
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    for path in ("/dev/shm", "/proc/self/ns/pid", "/proc/self/ns/ipc"):
        try:
            st = os.stat(path)
            parts.append(f"{st.st_dev}:{st.st_ino}")
        except OSError:
            pass
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]

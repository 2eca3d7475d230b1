"""Collectives for groups whose members span hosts (or, with backend "tcp",
do not share memory at all).

The members of a group fall into nodes (the members on one host); the
lowest member of each node is its leader. A collective runs in three
steps: inside each node through a GroupComm of the node's members (shared
memory), between the leaders by point-to-point messages through the
engine (TCP), then inside each node again. Collectives whose every byte
has one destination (gather, scatter, reduce_scatter, all_to_all) send
each piece straight to its rank instead.

Every call starts with a check: each member's descriptor of the call
(which collective, sizes, dtype, op, root) is gathered inside its node,
the leaders exchange their nodes' descriptors, and each node's leader
hands the whole table back to its members. Every rank compares the same
table, so a mismatch raises the same error everywhere before any data
moved, and the group stays usable.

Leader messages use the group id ``COLLECTIVE_GID | gid`` so they never
match a user's messages; every step runs in the same order on both ends of
a pair, so FIFO order per pair keeps them apart.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import numpy as np

from shmdist import _core, layout, settings
from shmdist.comm import arena
from shmdist.comm import inter
from shmdist.transport.engine import COLLECTIVE_GID
from shmdist.errors import DistError, DistPeerError, DistTimeoutError
from shmdist.reduce_ops import ReduceOp, _from_f32, _to_f32, reduce_into
from shmdist.tensors import Buf, as_buf

sharded = {"calls": 0}   # all_reduces this process ran sharded (tests, bench)


def open_group(world, group) -> "HierComm":
    """Split the group into nodes and open the shared arena of this rank's node."""
    nodes: dict[str, list[int]] = {}
    for r in group.ranks:
        nodes.setdefault(world.nodes[r], []).append(r)
    mine = nodes[world.nodes[world.rank]]
    comm = None
    if len(mine) > 1:
        comm = arena.open_group(world, f"{group.gid}/{mine[0]}", mine)
    return HierComm(world, group, list(nodes.values()), comm)


def _array_buf(a: np.ndarray, dtype: str) -> Buf:
    return Buf(a, a.ctypes.data, a.nbytes, dtype, a.shape, None)


def _piece(addr: int, nbytes: int) -> Buf:
    """Raw bytes at ``addr`` (dtypes and sizes were agreed by the check)."""
    return Buf(None, addr, nbytes, "uint8", (nbytes,), None)


class HierComm:
    """arena.Comm for a group spanning nodes (GroupComm is the one for
    a group inside one node)."""

    def __init__(self, world, group, nodes: list[list[int]], comm):
        self.world, self.group, self.comm = world, group, comm
        self.rank = world.rank
        self.engine = world.engine
        self.gid = COLLECTIVE_GID | group.gid
        self.n = group.size()
        self.me = group.rank()
        self.nodes = nodes
        self.node_of = {r: k for k, members in enumerate(nodes) for r in members}
        self.local = nodes[self.node_of[self.rank]]
        self.leaders = [members[0] for members in nodes]
        self.is_leader = self.rank == self.local[0]
        self.order = [r for members in nodes for r in members]   # table rows: node by node
        self.broken: str | None = None
        self.lock = threading.Lock()
        # Lanes (sharded all_reduce, below): local rank i of every node forms lane i; lane 0 is the leaders.
        self.lane_index = self.local.index(self.rank)
        self.lane = [m[self.lane_index] for m in nodes if len(m) > self.lane_index]
        self.even = len({len(m) for m in nodes}) == 1
        self.inter = inter.for_comm(self)   # the leaders' leg on gloo/MPI (inter.py), or None: the engine

    def arena_bytes(self) -> int:
        return self.comm.arena_bytes() if self.comm else 0

    def unlink(self) -> None:
        if self.comm:
            self.comm.unlink()

    def close(self) -> None:
        if self.inter:
            self.inter.close()
        if self.comm:
            self.comm.close()

    def retire(self, why: str, within: float) -> bool:
        """As GroupComm.retire; the leaders' messages of a call inside fail first."""
        self.broken = why
        self.engine.fail_group((self.gid,), why)
        deadline = time.monotonic() + within
        quiet = self.comm is None or self.comm.retire(why, within)
        while not self.lock.acquire(timeout=0.005):
            if time.monotonic() > deadline:
                return False
        self.lock.release()
        return quiet

    # ------------------------------------------------------------ steps

    @contextmanager
    def _step(self, what: str):
        """A step that leaves the group unusable when it fails half-way."""
        try:
            yield
        except DistError as e:
            self.broken = f"{what} failed ({type(e).__name__})"
            if not self.is_leader and isinstance(e, (DistTimeoutError, DistPeerError)):
                raise inter.leader_was_away(self, e) from e   # name the hosts the leader was exchanging with
            raise

    def _exchange(self, what: str, sends: list, recvs: list, timeout: float) -> None:
        """Post ``recvs`` [(buf, src)] and ``sends`` [(buf, dst)], wait for all (Engine.exchange)."""
        between = None
        if self.inter:   # takes the leader-to-leader messages (see inter.py)
            with self._step(what):
                sends, recvs, between = self.inter.start(what, sends, recvs, timeout)
        with self._step(what):
            try:
                self.engine.exchange(what, sends, recvs, self.gid, self.group.ranks, timeout)
                if between:
                    between.wait(timeout)
            except (DistTimeoutError, DistPeerError) as e:   # name the host the peer is on
                raise inter.on_host(self, e, getattr(e, "peers", ())) from e

    def _local_broadcast(self, buf, root: int, what: str, timeout: float) -> None:
        """Broadcast inside this node from global rank ``root``."""
        if self.comm:
            with self._step(what):
                self.comm.broadcast(buf, self.local.index(root), timeout)

    def _check(self, what: str, desc: tuple, timeout: float) -> None:
        """Compare every member's descriptor of this call (see the module doc)."""
        if self.broken:
            raise arena.unusable(self.rank, what, self.group.ranks, self.broken)
        kind, nbytes, op, root, dtype, extra = desc
        mine = np.frombuffer(layout.pack_desc(kind, nbytes, op, self.group.ranks[root] if root >= 0 else -1,
                                              dtype.encode(), extra), dtype=np.int64)
        table = np.zeros((self.n, layout.DESC_WORDS), dtype=np.int64)
        rows = {r: table[i] for i, r in enumerate(self.order)}
        if self.comm:
            with self._step(what):
                self.comm.all_gather([rows[r].ctypes.data for r in self.local], as_buf(mine, writable=False,
                                     who=f"rank {self.rank}: {what}"), -1, timeout)
        else:
            rows[self.rank][:] = mine
        if self.is_leader:
            k = self.node_of[self.rank]
            self._exchange(what, [(self._block(table, k), dst) for dst in self.leaders if dst != self.rank],
                           [(self._block(table, j), src) for j, src in enumerate(self.leaders)
                            if src != self.rank], timeout)
        self._local_broadcast(as_buf(table, writable=True, who=f"rank {self.rank}: {what}"),
                              self.local[0], what, timeout)
        if (table != table[0]).any():
            descs = [_desc(rows[r]) for r in self.group.ranks]
            raise arena.disagree(self.rank, what, self.group.ranks, descs)

    def _block(self, table: np.ndarray, node: int) -> Buf:
        """The table rows of one node's members, as a buffer."""
        start = sum(len(m) for m in self.nodes[:node])
        rows = table[start:start + len(self.nodes[node])]
        return as_buf(rows, writable=True, who=f"rank {self.rank}")

    # ------------------------------------------------------------ collectives

    def barrier(self, timeout: float) -> None:
        self._check("barrier", ("barrier", 0, 0, -1, "", 0), timeout)

    def barrier_as(self, kind: str, dtype: str, timeout: float) -> None:
        self._check(f"{kind} (uneven)", (kind, 0, 0, -1, dtype, 1), timeout)

    def refuse(self, kind: str, timeout: float) -> None:
        """As GroupComm.refuse."""
        self._check(f"{kind} (refused)", arena.refused(kind), timeout)

    def broadcast(self, buf, root: int, timeout: float) -> None:
        """Inside the root's node, then root's leader to the other leaders,
        then inside the other nodes."""
        src = self.group.ranks[root]
        what = f"broadcast(src={src}, {buf.describe()})"
        self._check(what, ("broadcast", buf.nbytes, 0, root, buf.dtype, 0), timeout)
        home = self.node_of[src] == self.node_of[self.rank]
        if home:
            self._local_broadcast(buf, src, what, timeout)
        if self.is_leader:
            first = self.leaders[self.node_of[src]]
            if home:
                self._exchange(what, [(buf, dst) for dst in self.leaders if dst != self.rank], [], timeout)
            else:
                self._exchange(what, [], [(buf, first)], timeout)
        if not home:
            self._local_broadcast(buf, self.local[0], what, timeout)

    def quick_barrier(self, timeout: float, how: int | None = None) -> bool:
        return False    # across hosts the general calls below do everything

    def quick_all_reduce(self, arr, op, timeout: float, dtype_name: str | None = None) -> bool:
        return False

    def all_reduce(self, buf, arr: np.ndarray, op: ReduceOp, timeout: float, root: int = -1) -> None:
        """Reduce inside each node to its leader, all-reduce between the
        leaders, then broadcast inside each node (all_reduce) or hand the
        result to the root (reduce). AVG sums and divides once."""
        kind = "all_reduce" if root < 0 else "reduce"
        dst = self.group.ranks[root] if root >= 0 else -1
        what = f"all_reduce({op.name}, {buf.describe()})" if root < 0 else \
            f"reduce({op.name}, dst={dst}, {buf.describe()})"
        self._check(what, (kind, buf.nbytes, int(op), root, buf.dtype, 0), timeout)
        if root < 0 and self._shards(buf.nbytes):
            self._sharded_all_reduce(buf, arr, op, what, timeout)
            return
        half = buf.dtype in ("float16", "bfloat16")
        gets_result = root < 0 or dst == self.rank
        # The node and leader steps run on ``work``: the tensor itself, or a copy (in float32
        # for half floats, so that they are rounded once; a leader's own when its tensor stays).
        if half:
            work = _to_f32(arr, buf.dtype)
        elif self.is_leader and not gets_result:
            work = arr.copy()
        else:
            work = arr
        wbuf = buf if work is arr else _array_buf(work, "float32" if half else buf.dtype)
        if self.comm:
            with self._step(what):
                self.comm.all_reduce(wbuf, work, ReduceOp.SUM if op == ReduceOp.AVG else op, timeout, root=0)
        result = wbuf
        if self.is_leader:
            self._leaders_reduce(work, op, wbuf.dtype, what, timeout)
            if half:
                out = arr if gets_result else np.empty_like(arr)
                _from_f32(work, out, buf.dtype)
                result = buf if gets_result else _array_buf(out, buf.dtype)
        if root < 0:
            self._local_broadcast(buf, self.local[0], what, timeout)
        elif self.node_of[dst] == self.node_of[self.rank] and dst != self.local[0]:
            if self.is_leader:
                self._exchange(what, [(result, dst)], [], timeout)
            elif self.rank == dst:
                self._exchange(what, [], [(buf, self.local[0])], timeout)

    # ------------------------------------------------------------ sharded all_reduce

    def _shards(self, nbytes: int) -> bool:
        """Whether an all_reduce of ``nbytes`` runs sharded: big enough
        (SHMDIST_SHARD_BYTES), several ranks per node and the same number on
        every node (lane i then has one member per node)."""
        least = settings.get("SHMDIST_SHARD_BYTES")
        return (least > 0 and nbytes >= least and self.even and len(self.local) > 1
                and len(self.nodes) > 1)

    def _sharded_all_reduce(self, buf, arr: np.ndarray, op: ReduceOp, what: str, timeout: float) -> None:
        """all_reduce where every local rank carries a share of the bytes
        between hosts, instead of the leader carrying all of them:

        1. all_reduce inside the node (shared memory): every local rank
           holds the node's partial;
        2. local rank i sends its share i (layout.parts of the elements)
           to rank i of every other node and receives theirs (its lane:
           the inter-host engine's all_gather among the lane, or the
           point-to-point engine), and reduces the nodes' shares in node
           order; AVG divides by the group size here;
        3. each local rank broadcasts its reduced share inside the node.

        The same reductions in the same order as the leader path (the node's
        partial, then the nodes in node order), so the same bytes; half
        floats are reduced in float32 and rounded once."""
        sharded["calls"] += 1
        try:
            self._sharded_steps(buf, arr, op, what, timeout)
        except (DistTimeoutError, DistPeerError) as e:
            raise inter.shares_were_away(self, e) from e

    def _sharded_steps(self, buf, arr: np.ndarray, op: ReduceOp, what: str, timeout: float) -> None:
        half = buf.dtype in ("float16", "bfloat16")
        work = _to_f32(arr, buf.dtype) if half else arr
        wdtype = "float32" if half else buf.dtype
        flat = work.reshape(-1)
        n = len(self.local)
        # Pieces of a multiple of n elements (equal shares): local reduce_scatter, the lane's
        # exchange started, then the previous piece's exchange finished, reduced and gathered
        # inside the node, so the bytes of piece k cross between hosts while piece k+1 is
        # reduced inside the host. A tail whose shares differ takes the steps one by one.
        step = max(1, settings.get("SHMDIST_SHARD_PIECE_BYTES") // flat.itemsize // n) * n
        even = flat.size // n * n
        pieces = [(lo, min(step, even - lo)) for lo in range(0, even, step)]
        prev = None
        for k, (lo, plen) in enumerate(pieces):
            cur = self._piece_start(flat, lo, plen, k % 2, op, wdtype, what, timeout)
            if prev is not None:
                self._piece_finish(flat, prev, op, wdtype, what, timeout)
            prev = cur
        if prev is not None:
            self._piece_finish(flat, prev, op, wdtype, what, timeout)
        if even < flat.size:
            self._uneven_steps(flat[even:], op, wdtype, what, timeout)
        if half:
            _from_f32(work, arr, buf.dtype)

    def _scratch_for(self, slot: int, ln: int, dtype) -> tuple:
        """Reused buffers of one piece in flight (``slot`` 0 or 1): my reduced
        share of the node, and the lane's other members' shares (fresh ones
        per call would page-fault every byte again)."""
        scratch = self.__dict__.setdefault("_scratch", {})
        need = ln * dtype.itemsize * len(self.lane)
        have = scratch.get(slot)
        if have is None or have.nbytes < need:
            have = scratch[slot] = np.empty(need, dtype=np.uint8)
        views = have[:need].view(dtype).reshape(len(self.lane), ln)
        mine = views[self.lane.index(self.rank)]
        got = {p: views[i] for i, p in enumerate(self.lane) if p != self.rank}
        return mine, got

    def _piece_start(self, flat: np.ndarray, lo: int, plen: int, slot: int, op: ReduceOp, wdtype: str,
                     what: str, timeout: float):
        """Reduce-scatter one piece inside the node (my share of the node's
        partial, reduced in local rank order as the node's all_reduce does)
        and start its exchange in the lane."""
        n = len(self.local)
        ln = plen // n
        isz = flat.itemsize
        mine, got = self._scratch_for(slot, ln, flat.dtype)
        ins = [flat[lo + j * ln:lo + (j + 1) * ln] for j in range(n)]
        with self._step(what):
            self.comm.reduce_scatter(_array_buf(mine, wdtype), mine, [a.ctypes.data for a in ins], ins,
                                     ReduceOp.SUM if op == ReduceOp.AVG else op, timeout)
        pending = self._lane_start(what, mine, got, timeout)
        return lo, ln, mine, got, pending

    def _piece_finish(self, flat: np.ndarray, piece: tuple, op: ReduceOp, wdtype: str, what: str,
                      timeout: float) -> None:
        """Wait for a piece's exchange, reduce the nodes' shares in node order
        into my share of the piece, and gather the shares inside the node."""
        lo, ln, mine, got, pending = piece
        self._lane_wait(what, pending, timeout)
        n = len(self.local)
        isz = flat.itemsize
        at = lo + self.lane_index * ln
        reduce_into(flat[at:at + ln], [mine if p == self.rank else got[p] for p in self.lane], op, wdtype, self.n)
        with self._step(what):
            self.comm.all_gather([flat.ctypes.data + (lo + j * ln) * isz for j in range(n)],
                                 _array_buf(flat[at:at + ln], wdtype), -1, timeout)

    def _uneven_steps(self, flat: np.ndarray, op: ReduceOp, wdtype: str, what: str, timeout: float) -> None:
        """The sharded steps for elements whose shares differ in length: the
        node's all_reduce, the lane's exchange of share i, a broadcast of
        each share inside the node."""
        with self._step(what):
            self.comm.all_reduce(_array_buf(flat, wdtype), flat, ReduceOp.SUM if op == ReduceOp.AVG else op,
                                 timeout)
        shares = layout.parts(flat.size, len(self.local))
        start, length = shares[self.lane_index]
        mine = flat[start:start + length]
        if length:
            got = {p: np.empty_like(mine) for p in self.lane if p != self.rank}
            self._lane_wait(what, self._lane_start(what, mine, got, timeout), timeout)
            out = np.empty_like(mine)
            reduce_into(out, [mine if p == self.rank else got[p] for p in self.lane], op, wdtype, self.n)
            np.copyto(mine, out)
        with self._step(what):
            for j, (s, ln) in enumerate(shares):
                if ln:
                    self.comm.broadcast(_array_buf(flat[s:s + ln], wdtype), j, timeout)

    def _lane_start(self, what: str, mine: np.ndarray, got: dict, timeout: float):
        """Start sending this rank's share to every other member of its lane
        and receiving theirs into ``got``; _lane_wait finishes."""
        if self.inter and self.inter.gathers:
            with self._step(what):
                return self.inter.start_gather(what, mine, got, timeout)
        who = f"rank {self.rank}: {what}"
        sends = [(as_buf(mine, writable=False, who=who), p) for p in got]
        recvs = [(as_buf(a, writable=True, who=who), p) for p, a in got.items()]
        between = None
        if self.inter:
            with self._step(what):
                sends, recvs, between = self.inter.start(what, sends, recvs, timeout)
        with self._step(what):
            reqs = self.engine.post_exchange(what, sends, recvs, self.gid, self.group.ranks)
        return reqs, between

    def _lane_wait(self, what: str, pending, timeout: float) -> None:
        if not isinstance(pending, tuple):      # the engine's all_gather (inter.py)
            with self._step(what):
                pending.wait(timeout)
            return
        reqs, between = pending
        with self._step(what):
            try:
                self.engine.wait_exchange(reqs, timeout)
                if between:
                    between.wait(timeout)
            except (DistTimeoutError, DistPeerError) as e:   # name the host the peer is on
                raise inter.on_host(self, e, getattr(e, "peers", ())) from e

    def _leaders_reduce(self, work: np.ndarray, op: ReduceOp, dtype: str, what: str,
                        timeout: float) -> None:
        """Every leader sends its node's partial to the others and reduces
        all of them in node order (so every leader ends with the same
        bytes, and half floats are rounded once); AVG divides by the group
        size here."""
        who = f"rank {self.rank}: {what}"
        got = {r: np.empty_like(work) for r in self.leaders if r != self.rank}
        self._exchange(what, [(as_buf(work, writable=False, who=who), r) for r in got],
                       [(as_buf(a, writable=True, who=who), r) for r, a in got.items()], timeout)
        result = np.empty_like(work)
        reduce_into(result, [work if r == self.rank else got[r] for r in self.leaders], op, dtype, self.n)
        np.copyto(work, result)

    def all_gather(self, outs: list, buf, root: int, timeout: float) -> None:
        """all_gather: inside each node, between the leaders, then each
        other node's pieces inside each node. gather: straight to the root."""
        kind = "all_gather" if root < 0 else "gather"
        dst = self.group.ranks[root] if root >= 0 else -1
        what = f"all_gather({buf.describe()})" if root < 0 else f"gather(dst={dst}, {buf.describe()})"
        self._check(what, (kind, buf.nbytes, 0, root, buf.dtype, 0), timeout)
        index = {r: j for j, r in enumerate(self.group.ranks)}

        def piece(r):
            return _piece(outs[index[r]], buf.nbytes)

        if root >= 0:
            if self.rank != dst:
                self._exchange(what, [(_piece(buf.addr, buf.nbytes), dst)], [], timeout)
                return
            _core.copy(outs[self.me], buf.addr, buf.nbytes)
            self._exchange(what, [], [(piece(r), r) for r in self.group.ranks if r != self.rank], timeout)
            return
        if self.comm:
            with self._step(what):
                self.comm.all_gather([outs[index[r]] for r in self.local], buf, -1, timeout)
        else:
            _core.copy(outs[self.me], buf.addr, buf.nbytes)
        if self.is_leader:
            others = [k for k in range(len(self.nodes)) if self.nodes[k] is not self.local]
            self._exchange(what, [(piece(r), self.leaders[k]) for k in others for r in self.local],
                           [(piece(r), self.leaders[k]) for k in others for r in self.nodes[k]], timeout)
        for r in self.group.ranks:
            if r not in self.local:
                self._local_broadcast(piece(r), self.local[0], what, timeout)

    def scatter(self, ins: list, buf, root: int, timeout: float) -> None:
        """The root sends each rank its piece."""
        src = self.group.ranks[root]
        what = f"scatter(src={src}, {buf.describe()})"
        self._check(what, ("scatter", buf.nbytes, 0, root, buf.dtype, 0), timeout)
        if self.rank != src:
            self._exchange(what, [], [(_piece(buf.addr, buf.nbytes), src)], timeout)
            return
        _core.copy(buf.addr, ins[self.me], buf.nbytes)
        self._exchange(what, [(_piece(ins[j], buf.nbytes), r)
                              for j, r in enumerate(self.group.ranks) if r != self.rank], [], timeout)

    def reduce_scatter(self, out_buf, out_arr: np.ndarray, ins: list, in_arrs: list, op: ReduceOp,
                       timeout: float) -> None:
        """Each rank sends its j-th input to rank j and reduces what it gets,
        in group rank order."""
        what = f"reduce_scatter({op.name}, {out_buf.describe()} per rank)"
        self._check(what, ("reduce_scatter", out_buf.nbytes, int(op), -1, out_buf.dtype, 0), timeout)
        got = {r: np.empty_like(out_arr) for r in self.group.ranks if r != self.rank}
        self._exchange(what, [(_piece(ins[j], out_buf.nbytes), r)
                              for j, r in enumerate(self.group.ranks) if r != self.rank],
                       [(_piece(a.ctypes.data, out_buf.nbytes), r) for r, a in got.items()],
                       timeout)
        inputs = [in_arrs[self.me] if r == self.rank else got[r] for r in self.group.ranks]
        reduce_into(out_arr, inputs, op, out_buf.dtype, self.n)

    def all_to_all(self, outs: list, ins: list, piece: int, dtype: str, timeout: float) -> None:
        """Each rank sends its j-th input to rank j."""
        what = f"all_to_all({piece} bytes per pair)"
        self._check(what, ("all_to_all", piece, 0, -1, dtype, 0), timeout)
        _core.copy(outs[self.me], ins[self.me], piece)
        others = [(j, r) for j, r in enumerate(self.group.ranks) if r != self.rank]
        self._exchange(what, [(_piece(ins[j], piece), r) for j, r in others],
                       [(_piece(outs[j], piece), r) for j, r in others], timeout)


def _desc(row: np.ndarray) -> tuple:
    """A table row (a packed layout.DESC) as the descriptor tuple arena.disagree reads."""
    return layout.DESC.unpack(row.tobytes())


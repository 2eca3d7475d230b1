"""Single-process tests of the core's rings, doorbells and phases, one
process playing every side: records that wrap around a ring's end, records
that move in part (ring full, producer and consumer taking turns), the one-
call take, doorbells and leave causes, phase flags and call descriptors,
and the C rounds of a large all_reduce against numpy."""
import os

import numpy as np
import pytest

from shmdist import _core, layout
from shmdist.comm import arena
from shmdist.transport.engine import dtype_field, make_header
from shmdist.reduce_ops import ReduceOp
from shmdist.tensors import as_buf


class Mem:
    """Two control blocks and one ring of ``size`` bytes, page-aligned."""
    def __init__(self, size=4096):
        self.raw = np.zeros(3 * 4096 + layout.RING_CTL_BYTES + size, dtype=np.uint8)
        base = (self.raw.ctypes.data + 4095) // 4096 * 4096
        self.ctl_a, self.ctl_b = base, base + layout.CTL_BYTES
        ring_at = self.producer_ctl = base + 4096
        self.producer = _core.Ring(ring_at, ring_at + layout.RING_CTL_BYTES, size, self.ctl_b)
        self.consumer = _core.Ring(ring_at, ring_at + layout.RING_CTL_BYTES, size, self.ctl_a)


def header(arr, tag=5):
    return make_header(tag, 0, 0, as_buf(arr, writable=False, who="test"))


def receive(ring, nbytes):
    head = ring.peek()
    assert head is not None
    got = np.empty(nbytes, dtype=np.uint8)
    assert ring.pull(got.ctypes.data if nbytes else 0, nbytes, 0) == layout.record_bytes(nbytes)
    return head, got


def test_records_wrap_around_the_ring_end_intact():
    mem = Mem(4096)
    rng = np.random.default_rng(0)
    for i in range(200):            # sizes that leave every offset at the end of the ring
        n = int(rng.integers(0, 4096 - layout.HEADER_BYTES - 64))
        data = rng.integers(0, 256, n, dtype=np.uint8)
        h = header(data, tag=i)
        assert mem.producer.push(h, data.ctypes.data, n, 0) == layout.record_bytes(n)
        head, got = receive(mem.consumer, n)
        assert head == h and np.array_equal(got, data), f"record {i} of {n} bytes"
    assert mem.consumer.peek() is None


def test_a_record_bigger_than_the_ring_moves_in_parts():
    mem = Mem(4096)
    data = np.random.default_rng(1).integers(0, 256, 50_000, dtype=np.uint8)
    total = layout.record_bytes(data.nbytes)
    h = header(data)
    got = np.empty_like(data)
    sent = mem.producer.push(h, data.ctypes.data, data.nbytes, 0)
    assert 0 < sent < total                  # the ring filled: the rest waits for the consumer
    assert mem.consumer.peek() == h
    took = 0
    turns = 0
    while took < total:
        took = mem.consumer.pull(got.ctypes.data, data.nbytes, took)
        if sent < total:
            sent = mem.producer.push(h, data.ctypes.data, data.nbytes, sent)
        turns += 1
        assert turns < 1000
    assert sent == total and np.array_equal(got, data) and turns > 5


def test_pull_to_address_zero_discards_the_payload():
    mem = Mem()
    data = np.arange(100, dtype=np.uint8)
    mem.producer.push(header(data), data.ctypes.data, 100, 0)
    assert mem.consumer.peek() is not None
    assert mem.consumer.pull(0, 100, 0) == layout.record_bytes(100)
    assert mem.consumer.peek() is None


def test_take_receives_only_the_record_it_names():
    mem = Mem()
    data = np.arange(10, dtype=np.float32)
    out = np.zeros_like(data)
    f32 = dtype_field("float32")
    assert mem.consumer.take(5, 0, out.ctypes.data, out.nbytes, f32) == layout.NOT_YET      # nothing there
    mem.producer.push(header(data, tag=5), data.ctypes.data, data.nbytes, 0)
    assert mem.consumer.take(6, 0, out.ctypes.data, out.nbytes, f32) == layout.OTHER_RECORD    # another tag
    assert mem.consumer.take(5, 1, out.ctypes.data, out.nbytes, f32) == layout.OTHER_RECORD    # another group
    assert mem.consumer.take(5, 0, out.ctypes.data, 36, f32) == layout.OTHER_RECORD   # another length
    big = np.zeros(100, dtype=np.float32)
    assert mem.consumer.take(5, 0, big.ctypes.data, big.nbytes, f32) == layout.NOT_YET   # longer: not all there
    assert mem.consumer.take(5, 0, out.ctypes.data, out.nbytes, dtype_field("int32")) == layout.OTHER_RECORD
    assert not out.any()
    assert mem.consumer.take(5, 0, out.ctypes.data, out.nbytes, f32) == layout.DONE
    assert np.array_equal(out, data) and mem.consumer.peek() is None


def test_a_ring_rings_the_other_sides_doorbell():
    mem = Mem()
    before = _core.bell_value(mem.ctl_b)
    data = np.arange(8, dtype=np.uint8)
    mem.producer.push(header(data), data.ctypes.data, 8, 0)
    assert _core.bell_value(mem.ctl_b) > before                 # the consumer's bell
    seen = _core.bell_value(mem.ctl_a)
    assert _core.wait_bell(mem.ctl_a, seen, 100, 0, 0.0) == layout.NOT_YET
    mem.consumer.pull(0, 8, 0)
    assert _core.bell_value(mem.ctl_a) == seen        # the producer did not wait for room: no ring


def _want(mem):
    return int(np.frombuffer(mem.raw, np.uint32, 1, mem.producer_ctl - mem.raw.ctypes.data + layout.RING_WANT)[0])


def test_the_consumer_rings_for_room_only_when_the_producer_waits_for_it():
    mem = Mem(4096)
    data = np.arange(3000, dtype=np.uint8)
    h = header(data)
    total = layout.record_bytes(data.nbytes)
    assert mem.producer.push(h, data.ctypes.data, data.nbytes, 0) == total
    assert _want(mem) == 0
    sent = mem.producer.push(h, data.ctypes.data, data.nbytes, 0)   # the second one does not fit whole
    assert 0 < sent < total and _want(mem) == 1
    seen = _core.bell_value(mem.ctl_a)
    receive(mem.consumer, data.nbytes)                 # frees room: the producer asked, so it rings
    assert _core.wait_bell(mem.ctl_a, seen, 100, 0, 0.0) == layout.DONE_SPINNING
    assert mem.producer.push(h, data.ctypes.data, data.nbytes, sent) == total
    assert _want(mem) == 0                             # the record went whole: asks no more
    seen = _core.bell_value(mem.ctl_a)
    receive(mem.consumer, data.nbytes)
    assert _core.bell_value(mem.ctl_a) == seen


def _ping_pong(mem, me, rounds, sizes, timeout):
    """One side of a ping-pong over two rings in shared memory: side 0 sends
    a message of sizes[i] bytes (bigger ones fill the ring: its producer
    waits for room), side 1 receives it and answers 8 B. A wait spins a
    little or not at all (so that the sides overlap in every way) and then
    sleeps on the futex, as the engine's does. Exit status 3: a wait timed
    out, i.e. a wakeup was lost."""
    out, inc = mem.rings(me)
    my_ctl = mem.ctls[me]
    buf = np.zeros(max(sizes) + 64, dtype=np.uint8)
    spins = np.random.default_rng(me).choice([0, 0, 20, 200, 2000], 4096)
    waits = [0]

    def wait(seen):
        waits[0] += 1
        if _core.wait_bell(my_ctl, seen, int(spins[waits[0] % 4096]), 0, timeout) == layout.NOT_YET:
            os._exit(3)

    def send(n):
        h = header(buf[:n])
        pos, total = 0, layout.record_bytes(n)
        while True:
            seen = _core.bell_value(my_ctl)
            pos = out.push(h, buf.ctypes.data, n, pos)
            if pos == total:
                return
            wait(seen)

    def recv(n):
        while True:
            seen = _core.bell_value(my_ctl)
            if inc.peek() is not None:
                break
            wait(seen)
        pos, total = 0, layout.record_bytes(n)
        while True:
            seen = _core.bell_value(my_ctl)
            pos = inc.pull(buf.ctypes.data, n, pos)
            if pos == total:
                return
            wait(seen)

    for i in range(rounds):
        if me == 0:
            send(sizes[i])
            recv(8)
        else:
            recv(sizes[i])
            send(8)


class SharedMem:
    """Two control blocks and two rings (0 -> 1, 1 -> 0) in memory two processes share."""
    def __init__(self, size=4096):
        import mmap
        self.size = size
        self.mm = mmap.mmap(-1, 3 * 4096 + 2 * (layout.RING_CTL_BYTES + size))
        self.base = _core.buffer_address(self.mm, True)[0]
        self.ctls = [self.base, self.base + layout.CTL_BYTES]

    def rings(self, me):
        at = [self.base + 4096 + k * (layout.RING_CTL_BYTES + self.size) for k in (0, 1)]
        ring = lambda k: _core.Ring(at[k], at[k] + layout.RING_CTL_BYTES, self.size, self.ctls[1 - me])
        return ring(me), ring(1 - me)     # mine to send on, the other's to receive on; each rings the other side


def test_no_wakeup_is_lost_when_both_sides_sleep():
    """Thousands of rounds where each side sleeps on its doorbell while it
    waits (for a message, or for room in a full ring), and the other side
    wakes it only through the bell: each wait may take at most 10 s, where a
    wakeup takes microseconds; a lost one fails the test (a timed-out wait)."""
    import multiprocessing
    mem = SharedMem(4096)
    rng = np.random.default_rng(7)
    rounds = 3000
    sizes = [int(x) for x in rng.choice([8, 100, 3000, 9000, 20000], rounds)]   # some 2-5 times the ring
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_ping_pong, args=(mem, me, rounds, sizes, 10.0)) for me in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert codes == [0, 0], f"exit codes {codes} (3: a wait timed out: a lost wakeup; None: hung)"
    words = np.frombuffer(mem.mm, np.uint32, layout.CTL_BYTES // 2)
    assert words[(layout.CTL_SLEEPING) // 4] == 0 and words[(layout.CTL_BYTES + layout.CTL_SLEEPING) // 4] == 0


def test_control_block_pid_close_and_cause():
    mem = Mem()
    _core.ctl_set_pid(mem.ctl_a, 1234)
    assert not _core.ctl_closed(mem.ctl_a) and _core.ctl_cause(mem.ctl_a) == b""
    assert int.from_bytes(bytes(np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 4).from_address(
        mem.ctl_a + layout.CTL_PID))), "little") == 1234
    _core.ctl_close(mem.ctl_a, b"x" * 500)
    assert _core.ctl_closed(mem.ctl_a) and _core.ctl_cause(mem.ctl_a) == b"x" * layout.CAUSE_BYTES
    _core.ctl_set_pid(mem.ctl_a, 1)
    assert not _core.ctl_closed(mem.ctl_a) and _core.ctl_cause(mem.ctl_a) == b""


class Arena:
    """The control slots and buffers of an n-member group, and a Phaser per member."""
    def __init__(self, n, slot=1 << 16, spin=200):
        self.n, self.slot = n, slot
        self.flags = np.zeros(n * layout.SLOT_STRIDE, dtype=np.uint8)
        self.bufs = np.zeros(2 * n * slot, dtype=np.uint8)
        self.bells = np.zeros(n * layout.CTL_BYTES, dtype=np.uint8)
        bell = lambda i: self.bells.ctypes.data + i * layout.CTL_BYTES
        self.ph = [_core.Phaser(self.flags.ctypes.data, layout.SLOT_STRIDE, n, i,
                                np.array([bell(j) for j in range(n) if j != i], dtype=np.uint64), bell(i),
                                _core.Backoff(spin, 0), _core.RLock(), arena._BARRIER,
                                self.bufs.ctypes.data, slot, arena._PHASER_KINDS,
                                layout.KINDS.index("all_reduce"))
                   for i in range(n)]

    def phase_flag(self, i):
        at = i * layout.SLOT_STRIDE + layout.SLOT_PHASE
        return int.from_bytes(bytes(self.flags[at:at + 8]), "little")

    def desc(self, i):
        at = i * layout.SLOT_STRIDE + self.ph[i].desc_at
        return bytes(self.flags[at:at + layout.DESC_BYTES])


def test_phase_flags_and_descriptors():
    a = Arena(3)
    d1 = layout.pack_desc("broadcast", 64, 0, 0, b"float32", 0)
    assert a.ph[0].enter(d1) == layout.NOT_YET            # alone: the others are not there yet
    assert [a.phase_flag(i) for i in range(3)] == [1, 0, 0]
    assert a.ph[1].enter(d1) == layout.NOT_YET
    assert a.ph[2].enter(d1) == layout.DONE_SPINNING      # the last one finds everyone there
    assert [a.phase_flag(i) for i in range(3)] == [1, 1, 1]
    assert all(a.desc(i) == d1 for i in range(3))
    assert _core.wait_phase(a.flags.ctypes.data, layout.SLOT_STRIDE, 3, 1, a.bells.ctypes.data, 10, 0, 0.0)
    assert not _core.wait_phase(a.flags.ctypes.data, layout.SLOT_STRIDE, 3, 2, a.bells.ctypes.data, 10, 0, 0.0)
    d2 = layout.pack_desc("broadcast", 64, 0, 1, b"float32", 0)   # member 2 names another root
    a.ph[0].enter(d1)
    a.ph[1].enter(d1)
    assert a.ph[2].enter(d2) == layout.DIFFER
    assert a.ph[0].desc_at != a.ph[0].desc_at - layout.DESC_BYTES    # parity alternates
    assert {a.ph[i].calls for i in range(3)} == {2} and {a.ph[i].phase for i in range(3)} == {2}
    assert a.ph[2].enter() == layout.NOT_YET          # a phase without a call
    assert a.ph[2].calls == 2 and a.phase_flag(2) == 3


def test_a_broken_phaser_does_nothing():
    a = Arena(2)
    a.ph[0].broken = "test"
    assert a.ph[0].barrier() == layout.BROKEN and a.phase_flag(0) == 0
    assert a.ph[0].all_reduce(np.ones(4, np.float32), ReduceOp.SUM, 1 << 16) == layout.BROKEN
    assert a.ph[1].all_reduce(np.ones(4, np.float32), ReduceOp.AVG, 1 << 16) == layout.NOT_TAKEN


@pytest.mark.parametrize("dtype,op", [("float32", ReduceOp.SUM), ("float64", ReduceOp.PRODUCT),
                                      ("int32", ReduceOp.MIN), ("int64", ReduceOp.MAX)])
@pytest.mark.parametrize("n", [2, 3])
def test_c_rounds_of_a_large_all_reduce_match_numpy(dtype, op, n):
    """Members take turns in one process: each runs until it waits for the others."""
    a = Arena(n, slot=1 << 13)
    count = 5000
    rng = np.random.default_rng(n)
    data = [(rng.integers(-3, 4, count)).astype(dtype) for _ in range(n)]
    want = {ReduceOp.SUM: np.add, ReduceOp.PRODUCT: np.multiply, ReduceOp.MIN: np.minimum,
            ReduceOp.MAX: np.maximum}[op].reduce(np.stack(data), axis=0)
    isz = np.dtype(dtype).itemsize
    per_round = min((a.slot // isz - 1) * n // (n + 1), (512 << 10) // isz)
    kind = layout.kind_of(dtype)
    desc = layout.pack_desc("all_reduce", count * isz, int(op), -1, dtype.encode(), 0)
    state = [(0, False)] * n
    for _ in range(10_000):
        if all(r == layout.ALL_ROUNDS_DONE for r, _ in state):
            break
        for i in range(n):
            r, resume = state[i]
            if r != layout.ALL_ROUNDS_DONE:
                r = a.ph[i].all_reduce_rounds(data[i].ctypes.data, count, kind, int(op), per_round, True, r,
                                              resume, desc)
                assert r != layout.DIFFER
                state[i] = (r, True)
    assert all(r == layout.ALL_ROUNDS_DONE for r, _ in state)
    for i in range(n):
        assert np.array_equal(data[i], want), f"member {i}"

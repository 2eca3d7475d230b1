"""Hostile and broken bytes on a TCP link: the header parser and a Link
reading from a socket reject them with an error naming the peer, and never
crash or allocate by a length they were sent."""
from __future__ import annotations

import socket
import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from shmdist import _core
from shmdist.transport.engine import HDR, MAGIC, VERSION, make_header
from shmdist.transport.tcp import FrameError, Link, check_header
from shmdist.tensors import as_buf

PEER, ME = 1, 0


def good_header(shape=(3, 4), dtype="float32") -> bytes:
    return make_header(5, 0, PEER, as_buf(np.zeros(shape, dtype=dtype), writable=False, who="test"))


def with_fields(raw: bytes, **changes) -> bytes:
    names = ("magic", "version", "ndim", "tag", "gid", "src", "pad", "nbytes", "dtype")
    fields = dict(zip(names, HDR.unpack(raw)[:9]))
    dims = list(HDR.unpack(raw)[9:])
    fields.update({k: v for k, v in changes.items() if k != "dims"})
    return HDR.pack(*fields.values(), *changes.get("dims", dims))


def rejected(raw: bytes) -> str:
    with pytest.raises(FrameError) as err:
        check_header(raw, PEER, ME)
    message = str(err.value)
    assert f"rank {PEER} sent a malformed message" in message and message.startswith(f"rank {ME}:")
    return err.value.detail


def test_headers_the_engine_makes_pass():
    for shape, dtype in [((3, 4), "float32"), ((), "int64"), ((0,), "uint8"), ((2,) * 9, "int8"),
                         ((5,), "complex128"), ((7,), "bool")]:
        check_header(good_header(shape, dtype), PEER, ME)


@pytest.mark.parametrize("change, words", [
    ({"magic": 0x12345678}, "bad magic 0x12345678"),
    ({"version": VERSION + 1}, f"protocol version {VERSION + 1}"),
    ({"src": 3}, "claims to come from rank 3"),
    ({"nbytes": 1 << 62}, "exceeds this host's"),
    ({"nbytes": 47}, "length 47 does not match float32[3, 4]"),
    ({"dims": [3, -4, 0, 0, 0, 0, 0, 0]}, "shape"),
    ({"dims": [3, 4, 9, 0, 0, 0, 0, 0]}, "shape"),
    ({"ndim": 65}, "65 dimensions"),
    ({"dtype": b"float\xff32"}, "not a dtype name"),
    ({"dtype": b""}, "not a dtype name"),
])
def test_bad_header_fields_are_named(change, words):
    assert words in rejected(with_fields(good_header(), **change))


@settings(max_examples=500, deadline=None)
@given(st.binary(min_size=HDR.size, max_size=HDR.size))
def test_fuzz_random_headers_pass_or_raise_frame_error(raw):
    try:
        check_header(raw, PEER, ME)
    except FrameError as e:
        assert e.peer == PEER and e.detail


@settings(max_examples=500, deadline=None)
@given(st.integers(0, HDR.size - 1), st.integers(1, 255))
def test_fuzz_one_corrupted_byte_passes_or_raises_frame_error(at, flip):
    raw = bytearray(good_header())
    raw[at] ^= flip
    try:
        check_header(bytes(raw), PEER, ME)
    except FrameError as e:
        assert e.peer == PEER


class _Transport:
    """What a Link asks of its transport, without the I/O thread."""
    rank = ME

    def __init__(self):
        self.watched = []

    def watch(self, link, event):
        self.watched.append(event)
        link.armed |= event


@pytest.fixture
def link_and_wire():
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    link = Link(_Transport(), ours, PEER)
    yield link, theirs
    ours.close()
    theirs.close()


def test_a_record_arrives_straight_in_the_target(link_and_wire):
    link, wire = link_and_wire
    data = np.arange(1000, dtype=np.float64)
    wire.sendall(make_header(0, 0, PEER, as_buf(data, writable=False, who="test")) + data.tobytes())
    header = link.peek()
    assert header is not None and struct.unpack_from("<I", header)[0] == MAGIC
    out = np.zeros_like(data)
    assert link.pull(out.ctypes.data, out.nbytes, 0) == _core.record_bytes(out.nbytes)
    assert (out == data).all() and link.gone() is None


def test_a_record_in_pieces_waits_for_the_rest(link_and_wire):
    link, wire = link_and_wire
    data = np.arange(64, dtype=np.int32)
    frame = make_header(0, 0, PEER, as_buf(data, writable=False, who="test")) + data.tobytes()
    wire.sendall(frame[:100])
    assert link.peek() is None and link.transport.watched      # the I/O thread would watch now
    link.armed = 0                                              # ...and wake us: data came
    wire.sendall(frame[100:200])
    header = link.peek()
    assert header == frame[:_core.HEADER_BYTES]
    out = np.zeros_like(data)
    pos = link.pull(out.ctypes.data, out.nbytes, 0)
    assert pos == 200
    link.armed = 0
    wire.sendall(frame[200:])
    assert link.pull(out.ctypes.data, out.nbytes, pos) == _core.record_bytes(out.nbytes)
    assert (out == data).all()


def test_garbage_on_the_wire_breaks_the_link_naming_the_peer(link_and_wire):
    link, wire = link_and_wire
    wire.sendall(b"\xff" * _core.HEADER_BYTES)
    assert link.peek() is None
    assert link.gone().startswith("sent a malformed message (bad magic 0xffffffff")
    assert wire.recv(1) == b""      # we hung up on it


def test_a_huge_claimed_length_is_refused_before_anything_is_allocated(link_and_wire):
    link, wire = link_and_wire
    wire.sendall(with_fields(good_header((1,), "uint8"), nbytes=1 << 40, dims=[1 << 40] + [0] * 7))
    assert link.peek() is None
    assert "exceeds this host's" in link.gone()


def test_a_closed_socket_is_reported(link_and_wire):
    link, wire = link_and_wire
    wire.close()
    assert link.gone().startswith("closed its connection without saying goodbye")
    assert link.peek() is None


class _PeerTransport(_Transport):
    rank = PEER


def test_a_goodbye_after_data_is_read_in_order_and_gives_the_cause(link_and_wire):
    link, wire = link_and_wire
    data = np.arange(10, dtype=np.int16)
    wire.sendall(make_header(0, 0, PEER, as_buf(data, writable=False, who="test")) + data.tobytes())
    Link(_PeerTransport(), wire, ME).say_goodbye("rank 2 died")
    assert link.gone() is None                  # the data first: nothing already sent is lost
    assert link.peek() is not None
    out = np.zeros_like(data)
    link.pull(out.ctypes.data, out.nbytes, 0)
    assert (out == data).all()
    assert link.peek() is None
    assert link.gone() == "left the group (destroy_process_group) after rank 2 died"
    assert link.cause == "rank 2 died"


def test_a_plain_goodbye_and_a_cut_or_oversized_one(link_and_wire):
    link, wire = link_and_wire
    Link(_PeerTransport(), wire, ME).say_goodbye("")
    assert link.peek() is None and link.gone() == "left the group (destroy_process_group)"
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    cut = Link(_Transport(), ours, PEER)
    goodbye = with_fields(good_header((1,), "uint8"), nbytes=1 << 30, dims=[1 << 30] + [0] * 7,
                          dtype=b"_goodbye")
    theirs.sendall(goodbye + b"rank 9 ")     # claims a GiB of cause, sends 7 bytes, hangs up
    theirs.close()
    assert cut.peek() is None and cut.cause == "rank 9 "
    assert cut.gone().startswith("left the group")
    ours.close()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3 * _core.HEADER_BYTES))
def test_fuzz_any_bytes_on_the_wire_never_crash_a_link(garbage):
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    try:
        link = Link(_Transport(), ours, PEER)
        theirs.sendall(garbage)
        header = link.peek()
        if header is not None:       # a well-formed header: the payload is read into a buffer
            nbytes = HDR.unpack(header)[7]
            sink = np.zeros(max(nbytes, 1), dtype=np.uint8)
            link.pull(sink.ctypes.data, nbytes, 0)
        else:
            assert link.gone() is None or link.gone().startswith(("sent a malformed", "closed"))
    finally:
        ours.close()
        theirs.close()

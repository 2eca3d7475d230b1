"""Every binary layout shmdist shares between processes, or between its
Python and its C, defined once.

The C core reads these numbers from ``_layout.h``, which is generated from
this file (``python shmdist/layout.py`` writes it; ``setup.py`` does so on
every build, and tests/test_layout.py fails when the checked-in copy is
stale or when the compiled core disagrees with what is here). Nothing else
writes an offset, a struct format, a kernel kind or a ReduceOp code by hand.

This module imports only the standard library, so that the build can run it
before the core exists.
"""
from __future__ import annotations

import struct

# ---------------------------------------------------------------- message record
# A message is a record: a HEADER_BYTES header, the payload, and padding to
# RECORD_ALIGN bytes (the padding stays in a ring; TCP does not send it).

MAGIC = 0x444D4853            # "SHMD"
VERSION = 1
MAX_DIMS = 8                  # dims carried in a header; more still work, by element count
DTYPE_BYTES = 16              # the dtype name, NUL-padded
# magic, version, ndim, tag, group id, source rank, flags, payload bytes, dtype, dims, padding
HEADER = struct.Struct(f"<IHHqqiiQ{DTYPE_BYTES}s{MAX_DIMS}q8x")
HEADER_BYTES = HEADER.size
HDR_MAGIC = 0
HDR_VERSION = 4
HDR_NDIM = 6
HDR_TAG = 8
HDR_GID = 16
HDR_SRC = 24
HDR_FLAGS = 28                # int32: 0, or HDR_SINGLE_COPY
HDR_SINGLE_COPY = 1           # the record carries SINGLE_COPY (sender pid, address), not the payload
HDR_NBYTES = 32
HDR_DTYPE = 40
HDR_DIMS = HDR_DTYPE + DTYPE_BYTES
RECORD_ALIGN = 64
# The payload of a single-copy record (transport/engine.py): the sender's pid and the
# address of the message in its memory; the receiver reads it with process_vm_readv.
SINGLE_COPY = struct.Struct("<QQ")


def record_bytes(nbytes: int) -> int:
    """Bytes one message of ``nbytes`` payload occupies in a ring."""
    return HEADER_BYTES + (nbytes + RECORD_ALIGN - 1) // RECORD_ALIGN * RECORD_ALIGN


# ---------------------------------------------------------------- control block
# One per process, in the host segment: who owns it, whether it left and
# why, and its doorbell (a futex word bumped by anyone with news for it).

CTL_BYTES = 256
CTL_PID = 0                   # uint32: pid of the owner
CTL_CLOSED = 4                # uint32: 1 once the owner left the group cleanly
CTL_ADDR = 8                  # uint64: this block's address in its owner's memory (the single-copy probe)
CTL_READS = 16                # uint64: bit i: the owner can read local rank i's memory (process_vm_readv)
CTL_PROBED = 24               # uint64: bit i: the owner probed local rank i (CTL_READS says how it went)
CTL_BELL = 64                 # uint32: doorbell sequence
CTL_SLEEPING = 128            # uint32: owner threads asleep on the doorbell in a wait ring traffic can end
CTL_PHASE_SLEEPING = 132      # uint32: owner threads asleep on it for phase flags only (rings never wake them)
CTL_CAUSE = 136               # bytes: why the owner left, NUL-padded (written before CTL_CLOSED)
CAUSE_BYTES = CTL_BYTES - CTL_CAUSE

# ---------------------------------------------------------------- ring
RING_CTL_BYTES = 4096         # head and tail of a ring, each on its own cache line
RING_HEAD = 0                 # uint64: bytes the producer wrote, ever
RING_TAIL = 128               # uint64: bytes the consumer consumed, ever
RING_WANT = 256               # uint32: 1 while the producer waits for room (the consumer rings only then)
RING_ACKED = 384              # uint64: single-copy records the consumer has read from the producer, ever
RING_MIN_BYTES = 4096         # a ring's data is a power of two at least this big
# Sharing the reading of a big single copy (_ring.pxi, "help"): the consumer offers the
# producer chunks of HELP_CHUNK bytes of the message it is reading; whoever claims a chunk
# copies it (the consumer with process_vm_readv, the producer with process_vm_writev).
RING_HELP_SEQ = 512           # uint64: the number of the consumer's last offer (0: none yet)
RING_HELP_DST = 520           # uint64: where the message goes, in the consumer's memory
RING_HELP_SRC = 528           # uint64: where it is, in the producer's
RING_HELP_BYTES = 536         # uint64: its bytes
RING_HELP_ERR = 544           # uint64: the errno of a producer's copy that failed (0: none)
RING_HELP_NEXT = 640          # uint64: offer number << 32 | the next chunk to claim (compare-and-swap)
RING_HELP_DONE = 768          # uint64: chunks of the offer copied (or given up), by both
# The producer times a record's reading (transport/ways.py): it asks for the moment the consumer's
# tail passes the record's end, and the consumer, when it does, writes that moment, then the end.
RING_TIME_END = 896           # uint64: the end (ring position) of the record the producer times; 0: none
RING_TIMED_NS = 1024          # uint64: CLOCK_MONOTONIC ns when the consumer's tail passed it
RING_TIMED_END = 1032         # uint64: the RING_TIME_END that RING_TIMED_NS is for (written last)
HELP_CHUNK = 128 << 10         # bytes of a chunk; of messages from HELP_BIG bytes, twice that
HELP_BIG = 1 << 20

# ---------------------------------------------------------------- segment parameters
# Written by a segment's creator after the segment header (segment.py), read
# by every member: the host segment's (ring bytes, local ranks), an arena's
# (slot bytes, bytes per round of a large all_reduce).

PARAMS = struct.Struct("<QQ")
PARAMS_AT = 64
# An arena's, after them: bytes from which its two members, if it has two, copy
# straight between their arrays (the creator's SHMDIST_SINGLE_COPY; 0 never).
PAIR_SINGLE = struct.Struct("<Q")
PAIR_SINGLE_AT = PARAMS_AT + PARAMS.size
# And the way its two members move a big broadcast or all_reduce, by size class: the word of
# comm/paths.py, which the first member writes (single copies or the arena's buffers).
PAIR_PATHS_AT = PAIR_SINGLE_AT + PAIR_SINGLE.size

# ---------------------------------------------------------------- collective arena
# Per member of a group, a control slot of SLOT_STRIDE bytes: its phase
# counter, and the descriptors of its last two calls (parity 0 and 1).

SLOT_STRIDE = 256
SLOT_PHASE = 0                # uint64: phases this member entered
SLOT_CHECK = 8                # uint64: its last call's check word (_phaser.pxi, _check_word), beside the phase
SLOT_DESC = 64                # descriptor of parity p at SLOT_DESC + p * DESC_BYTES
# The call descriptor every member publishes and compares:
# 0 (reserved), kind, payload bytes, ReduceOp code, root (global rank, -1 none), dtype, extra
DESC = struct.Struct(f"<QQQqq{DTYPE_BYTES}sQ")
DESC_BYTES = DESC.size
DESC_WORDS = DESC_BYTES // 8
DESC_KIND = 8
DESC_NBYTES = 16
DESC_OP = 24
DESC_ROOT = 32
DESC_DTYPE = 40
DESC_EXTRA = DESC_DTYPE + DTYPE_BYTES
# refused: a call whose own arguments were bad (its op field: the kind it refused)
KINDS = ("barrier", "broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter",
         "reduce_scatter", "all_to_all", "refused", "empty")


def pack_desc(kind: str, nbytes: int, op: int, root: int, dtype: bytes, extra: int) -> bytes:
    """A call descriptor (``root``: a global rank or -1)."""
    return DESC.pack(0, KINDS.index(kind), nbytes, op, root, dtype, extra)


def parts(count: int, n: int) -> list[tuple[int, int]]:
    """Split ``count`` elements into n contiguous (start, length) parts, the
    first ``count % n`` one longer: how every member splits a chunk of a
    large all_reduce (the C rounds too: _core.part_start is this)."""
    base, rem = divmod(count, n)
    out, start = [], 0
    for j in range(n):
        length = base + (j < rem)
        out.append((start, length))
        start += length
    return out


# ---------------------------------------------------------------- reductions
# ReduceOp codes (shmdist.ReduceOp is the IntEnum of these) and the element
# kinds of the C kernels (reduce_rows, the rounds of a large all_reduce).

OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG")
KERNEL_KINDS = (("float32", 4), ("float64", 8), ("int32", 4), ("int64", 8),
                ("bfloat16", 2), ("float16", 2))   # the 16-bit ones: float32 sums, one rounding (_half.h)


def kind_of(name: str) -> int:
    """The C kernel kind of a dtype name."""
    return [k for k, _ in KERNEL_KINDS].index(name)


# ---------------------------------------------------------------- flight recorder
# Each rank's ring of its recent operations (trace.py makes and reads it; the
# hot paths write entries in C, _trace.h). A header page, then TRACE_CAPACITY
# entries of TRACE_ENTRY bytes; the entry of sequence number s (from 1) is at
# TRACE_HEAD + (s & (capacity - 1)) * TRACE_ENTRY. Little-endian.

TRACE_MAGIC = int.from_bytes(b"SHMDTRC1", "little")
TRACE_VERSION = 2              # 2: entry s in slot s & mask; posts no longer counted in changes
TRACE_HEAD = 4096             # the header page
TRACE_ENTRY = 128
# magic, version, entry bytes, capacity (a power of two), entries written, changes (state
# changes only), rank, world size, pid, state (TRACE_LIVE/LEFT), metadata bytes,
# CLOCK_MONOTONIC_COARSE ns and time.time_ns() when made (to turn entry times into wall times)
TRACE_HDR = struct.Struct("<QIIQQQqqqIIQQ")
TRACE_H_WRITTEN = 24          # uint64, stored last when an entry is added
TRACE_H_CHANGES = 32          # uint64: state changes (progress = written + changes)
TRACE_H_RANK = 40             # int64 rank, int64 world size
TRACE_H_STATE = 64            # uint32
TRACE_H_META_LEN = 68         # uint32: bytes of JSON metadata at TRACE_META_AT (0 while rewritten)
TRACE_META_AT = 512
TRACE_META_MAX = TRACE_HEAD - TRACE_META_AT
TRACE_LIVE, TRACE_LEFT = 1, 2
# seq (0 while being written), state, op, group id, peer (dst, src or root; TRACE_ANY, -1 none),
# tag (p2p) or ReduceOp code (collectives), bytes, collective number in its group (0 for p2p),
# posted ns, ended ns, thread, dtype name (NUL-padded), ns when it began to block
TRACE_ENT = struct.Struct(f"<QIIqqqQQQQQ{DTYPE_BYTES}sQ")
TRACE_E_SEQ = 0
TRACE_E_STATE = 8
TRACE_E_OP = 12
TRACE_E_GID = 16
TRACE_E_PEER = 24
TRACE_E_TAG = 32
TRACE_E_NBYTES = 40
TRACE_E_COLL = 48
TRACE_E_POSTED = 56
TRACE_E_ENDED = 64
TRACE_E_THREAD = 72
TRACE_E_DTYPE = 80
TRACE_E_WAIT = TRACE_E_DTYPE + DTYPE_BYTES
TRACE_STATES = ("posted", "waiting", "done", "failed")     # entry states, codes 1, 2, 3, 4
TRACE_POSTED, TRACE_WAITING, TRACE_DONE, TRACE_FAILED = range(1, len(TRACE_STATES) + 1)
TRACE_SEND, TRACE_RECV = 1, 2          # entry ops; a collective's is TRACE_COLL + its KINDS index
TRACE_COLL = 16
TRACE_ANY = -2                # the peer of a receive from any rank

# ---------------------------------------------------------------- what the core returns
# The outcomes of the core's waits, takes and phases: one name, and one value,
# per meaning, shared by C and Python.

DONE_SPINNING = 2             # done (the event came while spinning: keep spinning that long)
DONE = 1                      # done (the event came later, or no spin was asked)
NOT_YET = 0                   # not yet (a timeout, a signal, or the record is not all there)
DIFFER = -1                   # every member is there, but their call descriptors differ
BROKEN = -2                   # the group is broken: nothing was done
NOT_TAKEN = -3                # the call does not suit this fast path: nothing was done
OTHER_RECORD = -4             # the next record is not the one asked for: read its header
ALL_ROUNDS_DONE = -5          # every round of a large all_reduce is done
HELPING = -6                  # the record is being read, the producer copying chunks of it too: later
CODES = ("DONE_SPINNING", "DONE", "NOT_YET", "DIFFER", "BROKEN", "NOT_TAKEN", "OTHER_RECORD", "ALL_ROUNDS_DONE",
         "HELPING")

# ---------------------------------------------------------------- the C view

def c_constants() -> dict[str, int]:
    """Every number above that the C core uses, by its name in _layout.h."""
    c = {
        "SD_MAGIC": MAGIC, "SD_VERSION": VERSION, "SD_MAX_DIMS": MAX_DIMS, "SD_DTYPE_BYTES": DTYPE_BYTES,
        "SD_HEADER_BYTES": HEADER_BYTES, "SD_HDR_MAGIC": HDR_MAGIC, "SD_HDR_VERSION": HDR_VERSION,
        "SD_HDR_NDIM": HDR_NDIM, "SD_HDR_TAG": HDR_TAG, "SD_HDR_GID": HDR_GID, "SD_HDR_SRC": HDR_SRC, "SD_HDR_FLAGS": HDR_FLAGS,
        "SD_HDR_SINGLE_COPY": HDR_SINGLE_COPY,
        "SD_HDR_NBYTES": HDR_NBYTES, "SD_HDR_DTYPE": HDR_DTYPE, "SD_HDR_DIMS": HDR_DIMS,
        "SD_RECORD_ALIGN": RECORD_ALIGN,
        "SD_CTL_BYTES": CTL_BYTES, "SD_CTL_PID": CTL_PID, "SD_CTL_CLOSED": CTL_CLOSED,
        "SD_CTL_ADDR": CTL_ADDR, "SD_CTL_READS": CTL_READS,
        "SD_CTL_PROBED": CTL_PROBED, "SD_CTL_BELL": CTL_BELL, "SD_CTL_SLEEPING": CTL_SLEEPING, "SD_CTL_PHASE_SLEEPING": CTL_PHASE_SLEEPING,
        "SD_CTL_CAUSE": CTL_CAUSE,
        "SD_CAUSE_BYTES": CAUSE_BYTES,
        "SD_RING_CTL_BYTES": RING_CTL_BYTES, "SD_RING_HEAD": RING_HEAD, "SD_RING_TAIL": RING_TAIL,
        "SD_RING_WANT": RING_WANT, "SD_RING_ACKED": RING_ACKED,
        "SD_RING_HELP_SEQ": RING_HELP_SEQ, "SD_RING_HELP_DST": RING_HELP_DST, "SD_RING_HELP_SRC": RING_HELP_SRC,
        "SD_RING_HELP_BYTES": RING_HELP_BYTES, "SD_RING_HELP_ERR": RING_HELP_ERR,
        "SD_RING_HELP_NEXT": RING_HELP_NEXT, "SD_RING_HELP_DONE": RING_HELP_DONE,
        "SD_RING_TIME_END": RING_TIME_END, "SD_RING_TIMED_NS": RING_TIMED_NS, "SD_RING_TIMED_END": RING_TIMED_END,
        "SD_HELP_CHUNK": HELP_CHUNK, "SD_HELP_BIG": HELP_BIG,
        "SD_RING_MIN_BYTES": RING_MIN_BYTES,
        "SD_SLOT_STRIDE": SLOT_STRIDE, "SD_SLOT_PHASE": SLOT_PHASE, "SD_SLOT_CHECK": SLOT_CHECK, "SD_SLOT_DESC": SLOT_DESC,
        "SD_DESC_BYTES": DESC_BYTES, "SD_DESC_WORDS": DESC_WORDS, "SD_DESC_KIND": DESC_KIND,
        "SD_DESC_NBYTES": DESC_NBYTES, "SD_DESC_OP": DESC_OP, "SD_DESC_ROOT": DESC_ROOT,
        "SD_DESC_DTYPE": DESC_DTYPE, "SD_DESC_EXTRA": DESC_EXTRA,
    }
    c.update({f"SD_CALL_{k.upper()}": i for i, k in enumerate(KINDS)})
    c.update({f"SD_OP_{name}": i for i, name in enumerate(OPS)})
    c.update({f"SD_KIND_{name.upper()}": i for i, (name, _) in enumerate(KERNEL_KINDS)})
    c["SD_NKINDS"] = len(KERNEL_KINDS)
    c.update({f"SD_TR_{name[6:]}": globals()[name] for name in (
        "TRACE_HEAD", "TRACE_ENTRY", "TRACE_H_WRITTEN", "TRACE_H_CHANGES",
        "TRACE_POSTED", "TRACE_WAITING", "TRACE_DONE", "TRACE_FAILED", "TRACE_SEND", "TRACE_RECV", "TRACE_COLL")})
    c.update({f"SD_TR_{name[6:]}": globals()[name] for name in globals() if name.startswith("TRACE_E_")})
    c.update({f"SD_{name}": globals()[name] for name in CODES})
    return c


def c_header() -> str:
    """The text of _layout.h."""
    lines = ["/* GENERATED from shmdist/layout.py by `python shmdist/layout.py`; do not edit. */",
             "#ifndef SHMDIST_LAYOUT_H", "#define SHMDIST_LAYOUT_H", "", "#include <stddef.h>", "",
             "enum {"]
    lines += [f"    {name} = {value:#x}," if name == "SD_MAGIC" else f"    {name} = {value},"
              for name, value in c_constants().items()]
    lines += ["};", "",
              "/* bytes per element of each kernel kind, indexed by SD_KIND_* */",
              "static const size_t sd_kind_itemsize[SD_NKINDS] = {"
              + ", ".join(str(size) for _, size in KERNEL_KINDS) + "};", "",
              "#endif", ""]
    return "\n".join(lines)


def pxi_text() -> str:
    """The text of _layout.pxi: the C declarations of _layout.h for Cython,
    and C_LAYOUT, the values as the compiled core sees them (for the test
    that the build is in step with this file)."""
    names = list(c_constants())
    lines = ["# GENERATED from shmdist/layout.py by `python shmdist/layout.py`; do not edit.",
             'cdef extern from "_layout.h" nogil:', "    enum:"]
    lines += [f"        {name}" for name in names]
    lines += ["    const size_t sd_kind_itemsize[]", "",
              "C_LAYOUT = {", *[f'    "{name}": {name},' for name in names], "}", ""]
    return "\n".join(lines)


def write(folder: str) -> None:
    """(Re)write _layout.h and _layout.pxi in ``folder`` when they differ."""
    import os
    for name, text in (("_layout.h", c_header()), ("_layout.pxi", pxi_text())):
        path = os.path.join(folder, name)
        try:
            with open(path) as f:
                if f.read() == text:
                    continue
        except OSError:
            pass
        with open(path, "w") as f:
            f.write(text)


if __name__ == "__main__":
    import os
    write(os.path.dirname(os.path.abspath(__file__)))

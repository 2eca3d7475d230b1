# The flight recorder's ring, written from Python (trace.py) through these; the
# fast lane and the Phaser write it directly (sd_tr_post / sd_tr_set, _trace.h).
# Its layout is layout.py's (SD_TR_* in _layout.h).

def trace_attach(size_t base, uint64_t capacity):
    """Record into the ring at ``base`` (``capacity`` entries); 0 detaches."""
    sd_tr_attach(<uint8_t *>base, capacity)


def trace_post(uint32_t op, uint32_t state, int64_t gid, int64_t peer, int64_t tag, uint64_t nbytes,
               uint64_t coll, bytes dtype16):
    """Append one operation; returns its sequence number (0 when not recording)."""
    return sd_tr_post(op, state, gid, peer, tag, nbytes, coll, PyBytes_AS_STRING(dtype16))


def trace_set(uint64_t seq, uint32_t state):
    """Set the state of entry ``seq`` (nothing when it was overwritten since)."""
    sd_tr_set(seq, state, 0)

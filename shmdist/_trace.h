/* The flight recorder's writer for the hot paths (see shmdist/trace.py).
 *
 * Each rank owns one nameless shared-memory ring (a memfd) of fixed-size
 * entries, one per operation: the fast lane's sends and receives and every
 * collective's first phase are recorded here, in C, with the GIL held (so
 * writers never race); trace.py writes through the same two functions and
 * reads the ring, from this process or any other.
 *
 * The layout (header page, entry offsets, states, ops) is layout.py's
 * "flight recorder" section, as SD_TR_* in _layout.h; nothing is repeated here.
 * Times are CLOCK_MONOTONIC_COARSE (a few ns to read; millisecond steps). */
#ifndef SHMDIST_TRACE_H
#define SHMDIST_TRACE_H
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#include "_layout.h"

/* The writer's state, in one cache line: the ring, its index mask, and
 * private copies of the header's two counters (this process is the ring's
 * only writer, and every write goes through these functions, GIL held), so
 * that adding an entry loads nothing from the shared header, only stores. */
static struct {
    uint8_t *base;                     /* NULL: recording off */
    uint64_t mask;
    uint64_t written;                  /* = the header's SD_TR_H_WRITTEN */
    uint64_t changes;                  /* = the header's SD_TR_H_CHANGES */
} __attribute__((aligned(64))) sd_tr = {NULL, 0, 0, 0};
#define sd_tr_base (sd_tr.base)

#define SD_TR_U32(e, at) (*(uint32_t *)((e) + (at)))
#define SD_TR_U64(e, at) (*(uint64_t *)((e) + (at)))
#define SD_TR_I64(e, at) (*(int64_t *)((e) + (at)))

static inline void sd_tr_attach(uint8_t *base, uint64_t capacity) {
    sd_tr.base = base;
    sd_tr.mask = capacity ? capacity - 1 : 0;
    if (base != NULL) {        /* a ring written before (reused across process groups) goes on */
        sd_tr.written = __atomic_load_n((uint64_t *)(base + SD_TR_H_WRITTEN), __ATOMIC_ACQUIRE);
        sd_tr.changes = __atomic_load_n((uint64_t *)(base + SD_TR_H_CHANGES), __ATOMIC_ACQUIRE);
    }
}

static inline uint64_t sd_tr_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint8_t *sd_tr_slot(uint64_t seq) {
    return sd_tr_base + SD_TR_HEAD + ((seq - 1) & sd_tr.mask) * SD_TR_ENTRY;
}

static inline void sd_tr_changed(uint8_t *b) {
    __atomic_store_n((uint64_t *)(b + SD_TR_H_CHANGES), ++sd_tr.changes, __ATOMIC_RELEASE);
}

/* Record a new operation; returns its seq (0 when recording is off). */
static inline uint64_t sd_tr_post(uint32_t op, uint32_t state, int64_t gid, int64_t peer, int64_t tag,
                                  uint64_t nbytes, uint64_t coll, const char *dtype16) {
    uint8_t *b = sd_tr_base, *e;
    uint64_t seq, now;
    if (b == NULL)
        return 0;
    seq = ++sd_tr.written;
    e = sd_tr_slot(seq);
    __atomic_store_n((uint64_t *)(e + SD_TR_E_SEQ), 0, __ATOMIC_RELEASE);   /* readers skip it meanwhile */
    now = sd_tr_now();
    SD_TR_U32(e, SD_TR_E_STATE) = state;
    SD_TR_U32(e, SD_TR_E_OP) = op;
    SD_TR_I64(e, SD_TR_E_GID) = gid;
    SD_TR_I64(e, SD_TR_E_PEER) = peer;
    SD_TR_I64(e, SD_TR_E_TAG) = tag;
    SD_TR_U64(e, SD_TR_E_NBYTES) = nbytes;
    SD_TR_U64(e, SD_TR_E_COLL) = coll;
    SD_TR_U64(e, SD_TR_E_POSTED) = now;
    SD_TR_U64(e, SD_TR_E_ENDED) = state >= SD_TR_DONE ? now : 0;
    SD_TR_U64(e, SD_TR_E_THREAD) = (uint64_t)pthread_self();
    if (dtype16 != NULL)
        memcpy(e + SD_TR_E_DTYPE, dtype16, SD_DTYPE_BYTES);
    else
        memset(e + SD_TR_E_DTYPE, 0, SD_DTYPE_BYTES);
    SD_TR_U64(e, SD_TR_E_WAIT) = 0;
    __atomic_store_n((uint64_t *)(e + SD_TR_E_SEQ), seq, __ATOMIC_RELEASE);
    __atomic_store_n((uint64_t *)(b + SD_TR_H_WRITTEN), seq, __ATOMIC_RELEASE);
    sd_tr_changed(b);
    return seq;
}

/* Move operation ``seq`` to ``state`` (if the ring still holds it). With
 * ``at_once`` (done right after it was posted, caught while spinning: well
 * under the coarse clock's millisecond step) its end time is its post time,
 * without a second clock read. */
static inline void sd_tr_set(uint64_t seq, uint32_t state, int at_once) {
    uint8_t *b = sd_tr_base, *e;
    if (b == NULL || seq == 0)
        return;
    e = sd_tr_slot(seq);
    if (SD_TR_U64(e, SD_TR_E_SEQ) != seq)
        return;
    if (state >= SD_TR_DONE)
        SD_TR_U64(e, SD_TR_E_ENDED) = at_once ? SD_TR_U64(e, SD_TR_E_POSTED) : sd_tr_now();
    else if (state == SD_TR_WAITING)
        SD_TR_U64(e, SD_TR_E_WAIT) = sd_tr_now();
    __atomic_store_n((uint32_t *)(e + SD_TR_E_STATE), state, __ATOMIC_RELEASE);
    sd_tr_changed(b);
}
#endif

/* The flight recorder's writer for the hot paths (see shmdist/trace.py).
 *
 * Each rank owns one nameless shared-memory ring (a memfd) of fixed-size
 * entries, one per operation: the fast lane's sends and receives and every
 * collective's first phase are recorded here, in C, with the GIL held (so
 * writers never race); trace.py writes the same layout from Python for the
 * general paths and reads it, from this process or any other.
 *
 * Layout (little-endian), kept in step with trace.py:
 *   page 0: header. u64 magic at 0, u32 version at 8, u32 entry bytes at 12,
 *           u64 capacity (a power of two) at 16, u64 entries written at 24,
 *           u64 changes (posts + state changes) at 32, ... (trace.py).
 *   then capacity entries of SD_TR_ENTRY bytes, entry of seq s at slot
 *   (s - 1) & (capacity - 1):
 *     0 u64 seq (0 while being written)   8 u32 state   12 u32 op
 *    16 i64 gid   24 i64 peer (dst, src or root; -1 none, -2 any)
 *    32 i64 tag (p2p) or reduce op (collectives)   40 u64 bytes
 *    48 u64 collective number in its group (0 for p2p)
 *    56 u64 posted ns   64 u64 ended ns   72 u64 thread   80 char dtype[16]
 *    96 u64 wait began ns
 * Times are CLOCK_MONOTONIC_COARSE (a few ns to read; millisecond steps). */
#ifndef SHMDIST_TRACE_H
#define SHMDIST_TRACE_H
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <pthread.h>

#define SD_TR_ENTRY 128
#define SD_TR_HEAD 4096
enum { SD_TR_POSTED = 1, SD_TR_WAITING = 2, SD_TR_DONE = 3, SD_TR_FAILED = 4 };
enum { SD_TR_SEND = 1, SD_TR_RECV = 2, SD_TR_COLL = 16 };   /* collective: SD_TR_COLL + its KINDS index */

static uint8_t *sd_tr_base = NULL;     /* NULL: recording off */
static uint64_t sd_tr_mask = 0;

static inline void sd_tr_attach(uint8_t *base, uint64_t capacity) {
    sd_tr_base = base;
    sd_tr_mask = capacity ? capacity - 1 : 0;
}

static inline uint64_t sd_tr_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint8_t *sd_tr_slot(uint64_t seq) {
    return sd_tr_base + SD_TR_HEAD + ((seq - 1) & sd_tr_mask) * SD_TR_ENTRY;
}

/* Record a new operation; returns its seq (0 when recording is off). */
static inline uint64_t sd_tr_post(uint32_t op, uint32_t state, int64_t gid, int64_t peer, int64_t tag,
                                  uint64_t nbytes, uint64_t coll, const char *dtype16) {
    uint8_t *b = sd_tr_base, *e;
    uint64_t seq, now;
    if (b == NULL)
        return 0;
    seq = *(uint64_t *)(b + 24) + 1;
    e = sd_tr_slot(seq);
    __atomic_store_n((uint64_t *)e, 0, __ATOMIC_RELEASE);
    now = sd_tr_now();
    *(uint32_t *)(e + 8) = state;
    *(uint32_t *)(e + 12) = op;
    *(int64_t *)(e + 16) = gid;
    *(int64_t *)(e + 24) = peer;
    *(int64_t *)(e + 32) = tag;
    *(uint64_t *)(e + 40) = nbytes;
    *(uint64_t *)(e + 48) = coll;
    *(uint64_t *)(e + 56) = now;
    *(uint64_t *)(e + 64) = state >= SD_TR_DONE ? now : 0;
    *(uint64_t *)(e + 72) = (uint64_t)pthread_self();
    if (dtype16 != NULL)
        memcpy(e + 80, dtype16, 16);
    else
        memset(e + 80, 0, 16);
    *(uint64_t *)(e + 96) = 0;
    __atomic_store_n((uint64_t *)e, seq, __ATOMIC_RELEASE);
    __atomic_store_n((uint64_t *)(b + 24), seq, __ATOMIC_RELEASE);
    __atomic_store_n((uint64_t *)(b + 32), *(uint64_t *)(b + 32) + 1, __ATOMIC_RELEASE);
    return seq;
}

/* Move operation ``seq`` to ``state`` (if the ring still holds it). */
static inline void sd_tr_set(uint64_t seq, uint32_t state) {
    uint8_t *b = sd_tr_base, *e;
    if (b == NULL || seq == 0)
        return;
    e = sd_tr_slot(seq);
    if (*(uint64_t *)e != seq)
        return;
    if (state >= SD_TR_DONE)
        *(uint64_t *)(e + 64) = sd_tr_now();
    else if (state == SD_TR_WAITING)
        *(uint64_t *)(e + 96) = sd_tr_now();
    __atomic_store_n((uint32_t *)(e + 8), state, __ATOMIC_RELEASE);
    __atomic_store_n((uint64_t *)(b + 32), *(uint64_t *)(b + 32) + 1, __ATOMIC_RELEASE);
}

/* Operation ``seq``, just posted, is done at once (caught while spinning,
 * well under the coarse clock's millisecond step): no second clock read. */
static inline void sd_tr_done_at_once(uint64_t seq) {
    uint8_t *b = sd_tr_base, *e;
    if (b == NULL || seq == 0)
        return;
    e = sd_tr_slot(seq);
    if (*(uint64_t *)e != seq)
        return;
    *(uint64_t *)(e + 64) = *(uint64_t *)(e + 56);
    __atomic_store_n((uint32_t *)(e + 8), (uint32_t)SD_TR_DONE, __ATOMIC_RELEASE);
    __atomic_store_n((uint64_t *)(b + 32), *(uint64_t *)(b + 32) + 1, __ATOMIC_RELEASE);
}
#endif

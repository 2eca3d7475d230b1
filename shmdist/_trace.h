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
 * Times are CLOCK_MONOTONIC_COARSE (a few ns to read; millisecond steps), read
 * through the vDSO's own entry point when there is one (glibc's clock_gettime
 * wraps it: 4.2 ns a read against 2.4 ns here). Not the TSC: on the KVM guest
 * it was measured on, an rdtsc between other work cost 10-100 ns more than the
 * coarse clock, though it is one instruction to callgrind. */
#ifndef SHMDIST_TRACE_H
#define SHMDIST_TRACE_H
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#include <dlfcn.h>
#include "_layout.h"

/* The writer's state, in one cache line: the ring, its index mask, and
 * private copies of the header's two counters (this process is the ring's
 * only writer, and every write goes through these functions, GIL held), so
 * that adding an entry loads nothing from the shared header, only stores. */
typedef int (*sd_tr_clock_fn)(clockid_t, struct timespec *);
static struct {
    uint8_t *base;                     /* NULL: recording off */
    uint64_t mask;
    uint64_t written;                  /* = the header's SD_TR_H_WRITTEN */
    uint64_t changes;                  /* = the header's SD_TR_H_CHANGES */
    sd_tr_clock_fn clock;              /* the vDSO's clock_gettime, or libc's */
} __attribute__((aligned(64))) sd_tr = {NULL, 0, 0, 0, clock_gettime};
#define sd_tr_base (sd_tr.base)

/* Forced inline: left to itself the compiler calls sd_tr_post out of line,
 * and the call (eight arguments, saving registers) cost a quarter of the
 * entry's instructions (callgrind, per 8 B send: 83 instructions in the entry, about 20 of them the call). */
#define SD_TR_INLINE static inline __attribute__((always_inline))

#define SD_TR_U32(e, at) (*(uint32_t *)((e) + (at)))
#define SD_TR_U64(e, at) (*(uint64_t *)((e) + (at)))
#define SD_TR_I64(e, at) (*(int64_t *)((e) + (at)))

/* The vDSO's clock_gettime, if this process has a vDSO that exports it and
 * it reads the coarse clock as libc does; else libc's (under valgrind, say). */
static sd_tr_clock_fn sd_tr_find_clock(void) {
#if defined(__linux__) && (defined(__x86_64__) || defined(__aarch64__))
#if defined(__x86_64__)
    const char *name = "__vdso_clock_gettime";
#else
    const char *name = "__kernel_clock_gettime";
#endif
    struct timespec a, b;
    sd_tr_clock_fn fn = NULL;
    void *vdso = dlopen("linux-vdso.so.1", RTLD_LAZY | RTLD_LOCAL | RTLD_NOLOAD);
    if (vdso != NULL) {
        fn = (sd_tr_clock_fn)dlsym(vdso, name);
        dlclose(vdso);     /* NOLOAD: only a reference was taken; the vDSO stays mapped */
    }
    if (fn != NULL && clock_gettime(CLOCK_MONOTONIC_COARSE, &a) == 0 && fn(CLOCK_MONOTONIC_COARSE, &b) == 0
            && clock_gettime(CLOCK_MONOTONIC_COARSE, &a) == 0 && b.tv_sec <= a.tv_sec + 1 && a.tv_sec <= b.tv_sec + 1)
        return fn;
#endif
    return clock_gettime;
}

/* The writing thread, as threading.get_ident() names it (pthread_self()).
 * glibc's pthread_self() on x86-64 is the thread pointer (%fs:0 holds the TCB,
 * which is the struct pthread): read inline, without a call into libc.
 * test_trace checks the two agree. */
SD_TR_INLINE uint64_t sd_tr_thread(void) {
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && __GNUC__ >= 11
    return (uint64_t)__builtin_thread_pointer();
#else
    return (uint64_t)pthread_self();
#endif
}

SD_TR_INLINE void sd_tr_attach(uint8_t *base, uint64_t capacity) {
    static int found = 0;
    if (base != NULL && !found) {
        sd_tr.clock = sd_tr_find_clock();
        found = 1;
    }
    sd_tr.base = base;
    sd_tr.mask = capacity ? capacity - 1 : 0;
    if (base != NULL) {        /* a ring written before (reused across process groups) goes on */
        sd_tr.written = __atomic_load_n((uint64_t *)(base + SD_TR_H_WRITTEN), __ATOMIC_ACQUIRE);
        sd_tr.changes = __atomic_load_n((uint64_t *)(base + SD_TR_H_CHANGES), __ATOMIC_ACQUIRE);
    }
}

SD_TR_INLINE uint64_t sd_tr_now(void) {
    struct timespec ts;
    sd_tr.clock(CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

SD_TR_INLINE uint8_t *sd_tr_slot(uint64_t seq) {
    return sd_tr_base + SD_TR_HEAD + (seq & sd_tr.mask) * SD_TR_ENTRY;
}

/* A state change (posts are counted by SD_TR_H_WRITTEN alone: a reader's
 * measure of progress is written + changes). */
SD_TR_INLINE void sd_tr_changed(uint8_t *b) {
    __atomic_store_n((uint64_t *)(b + SD_TR_H_CHANGES), ++sd_tr.changes, __ATOMIC_RELEASE);
}

/* Record a new operation; returns its seq (0 when recording is off). */
SD_TR_INLINE uint64_t sd_tr_post(uint32_t op, uint32_t state, int64_t gid, int64_t peer, int64_t tag,
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
    SD_TR_U64(e, SD_TR_E_THREAD) = sd_tr_thread();
    if (dtype16 != NULL)
        memcpy(e + SD_TR_E_DTYPE, dtype16, SD_DTYPE_BYTES);
    else
        memset(e + SD_TR_E_DTYPE, 0, SD_DTYPE_BYTES);
    SD_TR_U64(e, SD_TR_E_WAIT) = state == SD_TR_WAITING ? now : 0;
    __atomic_store_n((uint64_t *)(e + SD_TR_E_SEQ), seq, __ATOMIC_RELEASE);
    __atomic_store_n((uint64_t *)(b + SD_TR_H_WRITTEN), seq, __ATOMIC_RELEASE);
    return seq;
}

/* Move operation ``seq`` to ``state`` (if the ring still holds it). With
 * ``at_once`` (done right after it was posted, caught while spinning: well
 * under the coarse clock's millisecond step) its end time is its post time,
 * without a second clock read. */
SD_TR_INLINE void sd_tr_set(uint64_t seq, uint32_t state, int at_once) {
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
/* An entry posted as done that is not (a collective is written before its
 * wait ends: _phaser.pxi): back to ``state`` (POSTED, or WAITING from now). */
SD_TR_INLINE void sd_tr_undone(uint64_t seq, uint32_t state) {
    uint8_t *b = sd_tr_base, *e;
    if (b == NULL || seq == 0)
        return;
    e = sd_tr_slot(seq);
    if (SD_TR_U64(e, SD_TR_E_SEQ) != seq)
        return;
    SD_TR_U64(e, SD_TR_E_ENDED) = 0;
    SD_TR_U64(e, SD_TR_E_WAIT) = state == SD_TR_WAITING ? sd_tr_now() : 0;
    __atomic_store_n((uint32_t *)(e + SD_TR_E_STATE), state, __ATOMIC_RELEASE);
    sd_tr_changed(b);
}
#endif

/* Atomics, futex and cross-memory helpers for shmdist's core.
 * Everything here works on memory shared between processes, so futexes
 * are the shared (not FUTEX_PRIVATE) kind. */
#ifndef SHMDIST_ATOMICS_H
#define SHMDIST_ATOMICS_H
#define _GNU_SOURCE
#include <stdint.h>
#include <errno.h>
#include <time.h>
#include <unistd.h>
#include <sched.h>
#include <sys/syscall.h>
#include <linux/futex.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

static inline uint64_t sd_load64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void sd_store64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline uint32_t sd_load32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
static inline void sd_store32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
static inline uint32_t sd_add32(uint32_t *p, int v) { return __atomic_add_fetch(p, (uint32_t)v, __ATOMIC_SEQ_CST); }
static inline void sd_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline uint64_t sd_add64(uint64_t *p, uint64_t v) { return __atomic_add_fetch(p, v, __ATOMIC_SEQ_CST); }
static inline int sd_cas64(uint64_t *p, uint64_t expect, uint64_t v) {
    return __atomic_compare_exchange_n(p, &expect, v, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

static inline void sd_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int sd_yield(void) { return sched_yield(); }

/* Sleep while *addr == val, at most timeout_ns. Returns 0 when woken,
 * or -errno (ETIMEDOUT, EAGAIN when the value already changed, EINTR). */
static inline int sd_futex_wait(uint32_t *addr, uint32_t val, long timeout_ns) {
    struct timespec ts;
    ts.tv_sec = timeout_ns / 1000000000L;
    ts.tv_nsec = timeout_ns % 1000000000L;
    long r = syscall(SYS_futex, addr, FUTEX_WAIT, val, &ts, NULL, 0);
    return r == 0 ? 0 : -errno;
}

static inline int sd_futex_wake(uint32_t *addr, int n) {
    return (int)syscall(SYS_futex, addr, FUTEX_WAKE, n, NULL, NULL, 0);
}

/* memcpy with non-temporal (streaming) stores: the destination bypasses
 * the caches. For large destinations that will not be read again soon this
 * saves the read-for-ownership of every line, as glibc does by itself only
 * for single copies above about 3/4 of the L3. Rings hand payloads over in
 * slices of 128 KiB, so glibc would never choose it for us. */
static inline void sd_copy_nt(void *dst, const void *src, size_t n) {
#if defined(__x86_64__)
    char *d = (char *)dst;
    const char *s = (const char *)src;
    size_t head = (64 - ((uintptr_t)d & 63)) & 63;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head; s += head; n -= head;
    while (n >= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
        d += 64; s += 64; n -= 64;
    }
    _mm_sfence();
    memcpy(d, s, n);
#else
    memcpy(dst, src, n);
#endif
}

#endif

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
#include <sys/uio.h>
#include <sys/syscall.h>
#include <linux/futex.h>

static inline uint64_t sd_load64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void sd_store64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline uint32_t sd_load32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
static inline void sd_store32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
static inline uint32_t sd_add32(uint32_t *p, int v) { return __atomic_add_fetch(p, (uint32_t)v, __ATOMIC_SEQ_CST); }
static inline void sd_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

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

/* One copy from another process's memory (cross-memory attach).
 * Returns bytes read or -errno. */
static inline long sd_cma_read(int pid, void *dst, const void *src, size_t n) {
    struct iovec local = { dst, n };
    struct iovec remote = { (void *)src, n };
    ssize_t r = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    return r < 0 ? -errno : (long)r;
}
#endif

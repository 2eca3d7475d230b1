# C declarations for the shared-memory core: atomics, futex, copies.
# All of them are static inline helpers in _atomics.h and safe to call nogil.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int64_t

cdef extern from "_atomics.h" nogil:
    uint64_t sd_load64(const uint64_t *p)
    void sd_store64(uint64_t *p, uint64_t v)
    uint32_t sd_load32(const uint32_t *p)
    void sd_store32(uint32_t *p, uint32_t v)
    uint32_t sd_add32(uint32_t *p, int v)
    void sd_fence()
    void sd_relax()
    int sd_futex_wait(uint32_t *addr, uint32_t val, long timeout_ns)
    int sd_futex_wake(uint32_t *addr, int n)
    int sd_yield()
    void sd_copy_nt(void *dst, const void *src, size_t n)
    long sd_cma_read(int pid, void *dst, const void *src, size_t n)

cdef extern from "_half.h" nogil:
    void sd_reduce_half(int f16, int op, uint16_t *out, const uint16_t *const *ins, int n,
                        size_t count, float div)
    int sd_half_level()
    void sd_half_set_limit(int level)
    uint16_t sd_f32_bf16(float f)
    uint16_t sd_f32_f16(float f)
    float sd_f16_f32(uint16_t h)

/* SUM and PRODUCT of float32 / float64 vectors from n inputs in one pass:
 * for each block of elements, acc = ins[0]; acc = acc op ins[j] for j = 1..n-1
 * (rank order, the order numpy's ufunc.reduce along the first axis uses, so the
 * same bits), stored once. The generic loop in _core.pyx (out = a op b, then
 * out = out op c, ...) reads and writes ``out`` n - 1 times; at 4 inputs this
 * pass moves 5 vectors' bytes instead of 9. Vector widths: AVX-512 (16 or 8
 * lanes, two registers an iteration) or AVX2 (8 or 4), chosen at run time
 * with the level _half.h detects; returns 0 (nothing done) on other CPUs and
 * ops, and the caller runs its generic loop.
 *
 * ``out`` may be one of the inputs (the same address): every input of a block
 * is read before the block is stored. It must not overlap one partly. */
#ifndef SHMDIST_SUM_H
#define SHMDIST_SUM_H
#include <stddef.h>
#include "_half.h"

#if SD_X86
#define SD_SUM_KERNEL(NAME, TARGET, T, V, W, LOAD, STORE, ADD, MUL)                  \
__attribute__((target(TARGET)))                                                     \
static void NAME(int op, T *out, const T *const *ins, int n, size_t count) {         \
    size_t i = 0;                                                                    \
    int j;                                                                           \
    for (; i + 2 * W <= count; i += 2 * W) {                                         \
        V a0 = LOAD(ins[0] + i), a1 = LOAD(ins[0] + i + W);                          \
        if (op == 1) {                                                               \
            for (j = 1; j < n; j++) {                                                \
                a0 = MUL(a0, LOAD(ins[j] + i));                                      \
                a1 = MUL(a1, LOAD(ins[j] + i + W));                                  \
            }                                                                        \
        } else {                                                                     \
            for (j = 1; j < n; j++) {                                                \
                a0 = ADD(a0, LOAD(ins[j] + i));                                      \
                a1 = ADD(a1, LOAD(ins[j] + i + W));                                  \
            }                                                                        \
        }                                                                            \
        STORE(out + i, a0);                                                          \
        STORE(out + i + W, a1);                                                      \
    }                                                                                \
    for (; i < count; i++) {                                                         \
        T a = ins[0][i];                                                             \
        for (j = 1; j < n; j++) a = op == 1 ? a * ins[j][i] : a + ins[j][i];         \
        out[i] = a;                                                                  \
    }                                                                                \
}

SD_SUM_KERNEL(sd_sum_f32_512, "avx512f", float, __m512, 16, _mm512_loadu_ps, _mm512_storeu_ps,
              _mm512_add_ps, _mm512_mul_ps)
SD_SUM_KERNEL(sd_sum_f64_512, "avx512f", double, __m512d, 8, _mm512_loadu_pd, _mm512_storeu_pd,
              _mm512_add_pd, _mm512_mul_pd)
SD_SUM_KERNEL(sd_sum_f32_256, "avx2", float, __m256, 8, _mm256_loadu_ps, _mm256_storeu_ps,
              _mm256_add_ps, _mm256_mul_ps)
SD_SUM_KERNEL(sd_sum_f64_256, "avx2", double, __m256d, 4, _mm256_loadu_pd, _mm256_storeu_pd,
              _mm256_add_pd, _mm256_mul_pd)
#endif

/* out = ins[0] op ... op ins[n-1]; ``f64``: 0 float32, 1 float64; ``op`` 0 SUM, 1
 * PRODUCT. 1 when done, 0 when the caller must (no vector build here, or another op). */
static int sd_reduce_float(int f64, int op, void *out, const void *const *ins, int n, size_t count) {
#if SD_X86
    int level = sd_half_level();
    if ((op != 0 && op != 1) || n < 1)
        return 0;
    if (level >= 2) {
        if (f64) sd_sum_f64_512(op, (double *)out, (const double *const *)ins, n, count);
        else sd_sum_f32_512(op, (float *)out, (const float *const *)ins, n, count);
        return 1;
    }
    if (level == 1) {
        if (f64) sd_sum_f64_256(op, (double *)out, (const double *const *)ins, n, count);
        else sd_sum_f32_256(op, (float *)out, (const float *const *)ins, n, count);
        return 1;
    }
#endif
    (void)f64; (void)op; (void)out; (void)ins; (void)n; (void)count;
    return 0;
}
#endif

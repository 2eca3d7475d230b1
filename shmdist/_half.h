/* Reductions of bfloat16 and float16 vectors: each input widened to float32
 * (exactly), combined in float32 in rank order, rounded once to the 16-bit
 * type, round-to-nearest-even, NaN kept as NaN. Bit for bit what
 * reduce_ops.reduce_into's numpy path gives, but for which NaN's payload an
 * element with several NaN inputs keeps: here always the first in rank order,
 * quietened (SD_COMBINE); numpy's choice depends on where the element falls in
 * its loops (vector body or tail, in place or not):
 *
 *   bfloat16 -> float32   the bits shifted left by 16
 *   float32 -> bfloat16   (b + 0x7FFF + ((b >> 16) & 1)) >> 16; a NaN becomes
 *                         (b >> 16) | 0x40 (quiet, sign and top payload kept).
 *                         Integer arithmetic on purpose: AVX512-BF16's
 *                         vcvtneps2bf16 flushes denormals, numpy does not.
 *   float16 <-> float32   IEEE conversions, as numpy's npy_half functions
 *                         (F16C's vcvtph2ps / vcvtps2ph give the same bits for
 *                         every value reached here: see sd_reduce_half).
 *
 * Four builds of the block kernels, chosen once at run time with
 * __builtin_cpu_supports: AVX-512 with its BF16 or FP16 instructions (level 3:
 * see sd_bf16_fast512 and sd_f16_pair512), AVX-512 (F, BW, VL), AVX2 with
 * F16C, and plain C (any CPU, any architecture). The wheel never assumes the
 * CPU it runs on, nor a compiler that knows the newer instructions. */
#ifndef SHMDIST_HALF_H
#define SHMDIST_HALF_H
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SD_X86 1
#else
#define SD_X86 0
#endif

#define SD_HALF_BLOCK 1024   /* floats of the accumulator: 4 KiB, stays in L1 */

enum { SD_BF16 = 0, SD_F16 = 1 };
enum { SD_HSUM = 0, SD_HPROD = 1, SD_HAVG = 7 };

/* ------------------------------------------------------------ scalar conversions */

static inline float sd_bf16_f32(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline uint16_t sd_f32_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((b >> 16) | 0x40);
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1)) >> 16);
}

/* numpy's npy_halfbits_to_floatbits */
static inline float sd_f16_f32(uint16_t h) {
    uint32_t sgn = (uint32_t)(h & 0x8000u) << 16, e = h & 0x7c00u, m = h & 0x03ffu, b;
    float f;
    if (e == 0) {
        if (m == 0) {
            b = sgn;
        } else {                       /* denormal: normalise */
            m <<= 1;
            while ((m & 0x0400u) == 0) {
                m <<= 1;
                e++;
            }
            b = sgn + (((uint32_t)(112 - e)) << 23) + ((m & 0x03ffu) << 13);
        }
    } else if (e == 0x7c00u) {
        b = sgn + 0x7f800000u + (m << 13);
    } else {
        b = sgn + (((uint32_t)e + 0x1c000u) << 13) + (m << 13);
    }
    memcpy(&f, &b, 4);
    return f;
}

/* numpy's npy_floatbits_to_halfbits (round to nearest even) */
static inline uint16_t sd_f32_f16(float x) {
    uint32_t f, fe, fm;
    uint16_t s, he, hm;
    memcpy(&f, &x, 4);
    s = (uint16_t)((f & 0x80000000u) >> 16);
    fe = f & 0x7f800000u;
    if (fe >= 0x47800000u) {                   /* overflow, inf, NaN */
        if (fe == 0x7f800000u) {
            fm = f & 0x007fffffu;
            if (fm != 0) {
                uint16_t r = (uint16_t)(0x7c00u + (fm >> 13));
                if (r == 0x7c00u) r++;
                return s + r;
            }
            return s + 0x7c00u;
        }
        return s + 0x7c00u;
    }
    if (fe <= 0x38000000u) {                   /* denormal or zero */
        if (fe < 0x33000000u) return s;
        fe >>= 23;
        fm = 0x00800000u + (f & 0x007fffffu);
        fm >>= (113 - fe);
        if (((fm & 0x00003fffu) != 0x00001000u) || (f & 0x000007ffu))
            fm += 0x00001000u;
        hm = (uint16_t)(fm >> 13);   /* a carry into the exponent gives the smallest normal: right */
        return s + hm;
    }
    he = (uint16_t)((fe - 0x38000000u) >> 13);
    fm = f & 0x007fffffu;
    if ((fm & 0x00003fffu) != 0x00001000u)     /* round half to even */
        fm += 0x00001000u;
    hm = (uint16_t)(fm >> 13);
    return s + (uint16_t)(he + hm);            /* a carry into the exponent is right, up to inf */
}

/* ------------------------------------------------------------ block kernels */

/* one element of SD_COMBINE */
static inline float sd_combine1(int op, float a, float w) {
    uint32_t ab, rb;
    float r = op == SD_HPROD ? a * w : a + w;
    memcpy(&ab, &a, 4);
    if ((ab & 0x7fffffffu) > 0x7f800000u) {
        rb = ab | 0x400000u;
        memcpy(&r, &rb, 4);
    }
    return r;
}

/* acc op= w, element by element, with x86's rule for NaN operands spelled
 * out: a NaN accumulator stays (quietened), else a NaN w comes through
 * (quietened) -- what numpy's acc + w gives. Written out because the compiler
 * may swap the operands of a commutative operation. */
#define SD_COMBINE(OPER)                                                             \
    for (i = 0; i < m; i++) {                                                        \
        uint32_t ab = bits[i];                                                       \
        float r = acc[i] OPER wide[i];                                               \
        uint32_t rb;                                                                 \
        memcpy(&rb, &r, 4);                                                          \
        bits[i] = (ab & 0x7fffffffu) > 0x7f800000u ? (ab | 0x400000u) : rb;          \
    }

#define SD_HALF_BODY(LOAD, STORE)                                                    \
    float acc[SD_HALF_BLOCK], wide[SD_HALF_BLOCK];                                   \
    uint32_t *bits = (uint32_t *)acc;                                                \
    size_t at, m, i;                                                                 \
    int j;                                                                           \
    for (at = 0; at < count; at += m) {                                              \
        m = count - at < SD_HALF_BLOCK ? count - at : SD_HALF_BLOCK;                 \
        { const uint16_t *x = ins[0] + at; for (i = 0; i < m; i++) acc[i] = LOAD(x[i]); } \
        for (j = 1; j < n; j++) {                                                    \
            const uint16_t *x = ins[j] + at;                                         \
            for (i = 0; i < m; i++) wide[i] = LOAD(x[i]);                            \
            if (op == SD_HPROD) { SD_COMBINE(*) }                                    \
            else { SD_COMBINE(+) }                                                   \
        }                                                                            \
        if (op == SD_HAVG) { for (i = 0; i < m; i++) acc[i] /= div; }                \
        { uint16_t *o = out + at; for (i = 0; i < m; i++) o[i] = STORE(acc[i]); }    \
    }

static void sd_half_plain(int f16, int op, uint16_t *out, const uint16_t *const *ins, int n,
                          size_t count, float div) {
    if (f16) {
        SD_HALF_BODY(sd_f16_f32, sd_f32_f16)
    } else {
        SD_HALF_BODY(sd_bf16_f32, sd_f32_bf16)
    }
}

#if SD_X86
/* Vector builds. One pass per 16 (AVX-512) or 8 (AVX2) elements: every input
 * widened, combined in rank order (a NaN accumulator kept, quietened: see
 * SD_COMBINE), AVG divided, rounded and stored; the tail in plain C.
 * bfloat16 widening is a shift, its rounding the integer formula above; float16
 * uses F16C (vcvtph2ps is exact; vcvtps2ph rounds to nearest even and gives
 * numpy's bits for every float32 that is not a signalling NaN, and arithmetic
 * never leaves one: see sd_reduce_half for the one input alone). */
#define SD_TAIL(F16)                                                                 \
    if (i < count) {                                                                 \
        const uint16_t *rest[64];                                                    \
        int k;                                                                       \
        if (n <= 64) {                                                               \
            for (k = 0; k < n; k++) rest[k] = ins[k] + i;                            \
            sd_half_plain(F16, op, out + i, rest, n, count - i, div);                \
        } else {                                                                     \
            for (; i < count; i++) {                                                 \
                float a = F16 ? sd_f16_f32(ins[0][i]) : sd_bf16_f32(ins[0][i]);      \
                for (k = 1; k < n; k++)                                              \
                    a = sd_combine1(op, a, F16 ? sd_f16_f32(ins[k][i]) : sd_bf16_f32(ins[k][i])); \
                if (op == SD_HAVG) a /= div;                                         \
                out[i] = F16 ? sd_f32_f16(a) : sd_f32_bf16(a);                       \
            }                                                                        \
        }                                                                            \
    }

#define SD_512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,f16c"

__attribute__((target(SD_512_TARGET)))
static inline __m512 sd512_load(int f16, const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (f16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

__attribute__((target(SD_512_TARGET)))
static inline void sd512_store(int f16, uint16_t *p, __m512 a) {
    __m512i b, r, q;
    __mmask16 nan;
    if (f16) {
        _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        return;
    }
    b = _mm512_castps_si512(a);
    r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)),
                                           _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))), 16);
    q = _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
    nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, q)));
}

__attribute__((target(SD_512_TARGET)))
static void sd_half_avx512(int f16, int op, uint16_t *out, const uint16_t *const *ins, int n,
                           size_t count, float div) {
    size_t i = 0;
    int j;
    __m512 d = _mm512_set1_ps(div);
    __m512 quiet = _mm512_castsi512_ps(_mm512_set1_epi32(0x400000));
    for (; i + 16 <= count; i += 16) {
        __m512 a = sd512_load(f16, ins[0] + i);
        for (j = 1; j < n; j++) {
            __m512 b = sd512_load(f16, ins[j] + i);
            __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
            __m512 r = op == SD_HPROD ? _mm512_mul_ps(a, b) : _mm512_add_ps(a, b);
            a = _mm512_mask_mov_ps(r, nan, _mm512_or_ps(a, quiet));
        }
        if (op == SD_HAVG) a = _mm512_div_ps(a, d);
        sd512_store(f16, out + i, a);
    }
    SD_TAIL(f16)
}

/* The common case at AVX-512, 32 elements an iteration: no element of the block's
 * result is a NaN, so no input is one and the NaN rule of SD_COMBINE has nothing
 * to keep: the combination is plain vector arithmetic. A block with a NaN result
 * (a NaN input, or one made: inf - inf, 0 * inf) goes through sd_half_avx512, 32
 * elements at a time. Testing the result, not every input, costs two compares a
 * block whatever the number of inputs.
 * bfloat16 widens by interleaving zero words below each element (vpunpck*wd:
 * the lanes come out permuted within each 128 bits, the same for every input)
 * and narrows by packing the rounded top halves back in that order (vpackusdw;
 * no value exceeds 0xFFFF, so nothing saturates). */
static void sd_half_avx512(int f16, int op, uint16_t *out, const uint16_t *const *ins, int n,
                           size_t count, float div);

__attribute__((target(SD_512_TARGET)))
static inline __m512i sd512_round_bf16(__m512 a) {
    __m512i b = _mm512_castps_si512(a);
    return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)),
                                              _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))), 16);
}

/* LO, HI: the 32 elements at P widened */
#define SD_FAST_LOAD(P, LO, HI)                                                      \
    {                                                                                \
        if (f16) {                                                                   \
            LO = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(P)));          \
            HI = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(P) + 1));      \
        } else {                                                                     \
            __m512i x_ = _mm512_loadu_si512((const void *)(P));                      \
            LO = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, x_));               \
            HI = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, x_));               \
        }                                                                            \
    }

__attribute__((target(SD_512_TARGET)))
static void sd_half_fast512(int f16, int op, uint16_t *out, const uint16_t *const *ins, int n,
                            size_t count, float div) {
    const __m512i zero = _mm512_setzero_si512();
    const __m512 d = _mm512_set1_ps(div);
    const uint16_t *at[64];
    size_t i = 0;
    int j, k;
    for (; i + 32 <= count; i += 32) {
        __m512 lo, hi, blo, bhi;
        SD_FAST_LOAD(ins[0] + i, lo, hi)
        for (j = 1; j < n; j++) {
            SD_FAST_LOAD(ins[j] + i, blo, bhi)
            if (op == SD_HPROD) {
                lo = _mm512_mul_ps(lo, blo);
                hi = _mm512_mul_ps(hi, bhi);
            } else {
                lo = _mm512_add_ps(lo, blo);
                hi = _mm512_add_ps(hi, bhi);
            }
        }
        if (_mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q)) {
            /* a NaN result (a NaN input, inf - inf, 0 * inf): the careful build, this block */
            for (k = 0; k < n; k++) at[k] = ins[k] + i;
            sd_half_avx512(f16, op, out + i, at, n, 32, div);
            continue;
        }
        if (op == SD_HAVG) {
            lo = _mm512_div_ps(lo, d);
            hi = _mm512_div_ps(hi, d);
        }
        if (f16) {
            _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            _mm256_storeu_si256((__m256i *)(out + i) + 1, _mm512_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        } else {
            _mm512_storeu_si512((void *)(out + i), _mm512_packus_epi32(sd512_round_bf16(lo), sd512_round_bf16(hi)));
        }
    }
    if (i < count) {
        for (k = 0; k < n; k++) at[k] = ins[k] + i;
        sd_half_avx512(f16, op, out + i, at, n, count - i, div);
    }
}

/* Level 3. The 16-bit instructions of newer AVX-512 CPUs, each where it gives
 * numpy's bits exactly; a 32-element block whose result is a NaN (a NaN input,
 * inf - inf, 0 * inf) or, bfloat16, a float32 denormal goes through the careful
 * build (sd_half_avx512), as a block with a NaN result does in sd_half_fast512.
 *
 * bfloat16 (AVX512-BF16): widened and combined as in sd_half_fast512, rounded
 * by vcvtne2ps2bf16, 32 elements in one instruction: round to nearest even,
 * a NaN becomes (b >> 16) | 0x40, the integer formula's bits, except that it
 * flushes a float32 denormal to zero (hence the careful build for those);
 * vpermq puts back the order vpunpck*wd permuted.
 *
 * float16, SUM and PRODUCT of two inputs (AVX512-FP16): vaddph / vmulph round
 * the exact result once to float16, and so does float32 arithmetic followed by
 * one rounding: a float32 sum or product of two float16 values rounded to
 * float16 is the correctly rounded one, because 24 >= 2 * 11 + 1 bits (double
 * rounding is innocuous: Figueroa, "When is double rounding innocuous?", 1995);
 * the product is even exact in float32. FP16 arithmetic handles denormals
 * always. Three or more inputs, or AVG, round more than once that way: they
 * stay in sd_half_fast512. */
#if defined(__clang__)
#define SD_HAVE_BF16_INSN (__clang_major__ >= 9)
#define SD_HAVE_FP16_INSN (__clang_major__ >= 14)
#else
#define SD_HAVE_BF16_INSN (__GNUC__ >= 10)
#define SD_HAVE_FP16_INSN (__GNUC__ >= 12)
#endif

#define SD_NAN_OR_DENORMAL 0xA1     /* vfpclassps: QNaN 0x01, denormal 0x20, SNaN 0x80 */
#define SD_NAN 0x81

/* the careful build for the 32 elements at ``i`` */
#define SD_CAREFUL_BLOCK(F16)                                                        \
    {                                                                                \
        for (k = 0; k < n; k++) at[k] = ins[k] + i;                                  \
        sd_half_avx512(F16, op, out + i, at, n, 32, div);                            \
    }

#if SD_HAVE_BF16_INSN
__attribute__((target(SD_512_TARGET ",avx512bf16")))
static void sd_bf16_fast512(int op, uint16_t *out, const uint16_t *const *ins, int n, size_t count,
                            float div) {
    const __m512i zero = _mm512_setzero_si512();
    const __m512i order = _mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0);   /* 64-bit pieces 0 4 1 5 2 6 3 7 */
    const __m512 d = _mm512_set1_ps(div);
    const uint16_t *at[64];
    size_t i = 0;
    int j, k;
    for (; i + 32 <= count; i += 32) {
        __m512i x = _mm512_loadu_si512((const void *)(ins[0] + i));
        __m512 lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, x));
        __m512 hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, x));
        for (j = 1; j < n; j++) {
            x = _mm512_loadu_si512((const void *)(ins[j] + i));
            if (op == SD_HPROD) {
                lo = _mm512_mul_ps(lo, _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, x)));
                hi = _mm512_mul_ps(hi, _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, x)));
            } else {
                lo = _mm512_add_ps(lo, _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, x)));
                hi = _mm512_add_ps(hi, _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, x)));
            }
        }
        if (op == SD_HAVG) {
            lo = _mm512_div_ps(lo, d);
            hi = _mm512_div_ps(hi, d);
        }
        if (_mm512_fpclass_ps_mask(lo, SD_NAN_OR_DENORMAL) | _mm512_fpclass_ps_mask(hi, SD_NAN_OR_DENORMAL)) {
            SD_CAREFUL_BLOCK(0)
            continue;
        }
        _mm512_storeu_si512((void *)(out + i),
                            _mm512_permutexvar_epi64(order, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
    }
    if (i < count) {
        for (k = 0; k < n; k++) at[k] = ins[k] + i;
        sd_half_avx512(0, op, out + i, at, n, count - i, div);
    }
}
#endif

#if SD_HAVE_FP16_INSN
__attribute__((target(SD_512_TARGET ",avx512fp16")))
static void sd_f16_pair512(int op, uint16_t *out, const uint16_t *const *ins, size_t count) {
    const uint16_t *at[2];
    const int n = 2;
    const float div = 2.0f;          /* not used: SUM and PRODUCT only */
    size_t i = 0;
    int k;
    for (; i + 32 <= count; i += 32) {
        __m512h a = _mm512_castsi512_ph(_mm512_loadu_si512((const void *)(ins[0] + i)));
        __m512h b = _mm512_castsi512_ph(_mm512_loadu_si512((const void *)(ins[1] + i)));
        __m512h r = op == SD_HPROD ? _mm512_mul_ph(a, b) : _mm512_add_ph(a, b);
        if (_mm512_fpclass_ph_mask(r, SD_NAN)) {
            SD_CAREFUL_BLOCK(1)
            continue;
        }
        _mm512_storeu_si512((void *)(out + i), _mm512_castph_si512(r));
    }
    if (i < count) {
        for (k = 0; k < n; k++) at[k] = ins[k] + i;
        sd_half_avx512(1, op, out + i, at, n, count - i, div);
    }
}
#endif

__attribute__((target("avx2,f16c")))
static inline __m256 sd256_load(int f16, const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (f16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2,f16c")))
static inline void sd256_store(int f16, uint16_t *p, __m256 a) {
    __m256i b, r, q, v;
    if (f16) {
        _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        return;
    }
    b = _mm256_castps_si256(a);
    r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)),
                                           _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1))), 16);
    q = _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40));
    v = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(q),
                                             _mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
    v = _mm256_packus_epi32(v, v);                 /* every value fits 16 bits: no saturation */
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(v, 0x08)));
}

__attribute__((target("avx2,f16c")))
static void sd_half_avx2(int f16, int op, uint16_t *out, const uint16_t *const *ins, int n,
                         size_t count, float div) {
    size_t i = 0;
    int j;
    __m256 d = _mm256_set1_ps(div);
    __m256 quiet = _mm256_castsi256_ps(_mm256_set1_epi32(0x400000));
    for (; i + 8 <= count; i += 8) {
        __m256 a = sd256_load(f16, ins[0] + i);
        for (j = 1; j < n; j++) {
            __m256 b = sd256_load(f16, ins[j] + i);
            __m256 nan = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
            __m256 r = op == SD_HPROD ? _mm256_mul_ps(a, b) : _mm256_add_ps(a, b);
            a = _mm256_blendv_ps(r, _mm256_or_ps(a, quiet), nan);
        }
        if (op == SD_HAVG) a = _mm256_div_ps(a, d);
        sd256_store(f16, out + i, a);
    }
    SD_TAIL(f16)
}
#endif

/* 3: AVX-512 with BF16 or FP16 instructions (each used where this CPU has it:
 * sd_half_bf16, sd_half_fp16), 2: AVX-512, 1: AVX2 + F16C, 0: plain C.
 * sd_half_limit caps it (tests). */
static int sd_half_detected = -1;
static int sd_half_limit = 3;
static int sd_half_bf16 = 0, sd_half_fp16 = 0;

static inline void sd_half_set_limit(int level) { sd_half_limit = level; }

static inline int sd_half_level(void) {
    if (sd_half_detected < 0) {
        int level = 0;
#if SD_X86
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
            level = 1;
        if (level && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
            level = 2;
#if SD_HAVE_BF16_INSN
        if (level == 2 && __builtin_cpu_supports("avx512bf16"))
            sd_half_bf16 = 1;
#endif
#if SD_HAVE_FP16_INSN
        if (level == 2 && __builtin_cpu_supports("avx512fp16"))
            sd_half_fp16 = 1;
#endif
        if (sd_half_bf16 || sd_half_fp16)
            level = 3;
#endif
        sd_half_detected = level;
    }
    return sd_half_detected < sd_half_limit ? sd_half_detected : sd_half_limit;
}

/* out = round(ins[0] op ins[1] op ... op ins[n-1]) for ``count`` elements
 * (SD_HAVG: the sum divided by ``div``). ``out`` may be one of the inputs
 * (the same address), not overlap one partly. One float16 input alone is
 * copied: the conversions there and back give every bit pattern back in
 * numpy's path, while F16C would quieten a signalling NaN. */
static void sd_reduce_half(int f16, int op, uint16_t *out, const uint16_t *const *ins, int n,
                           size_t count, float div) {
    int level = sd_half_level();
    if (f16 && n == 1 && op != SD_HAVG) {
        if (out != ins[0]) memmove(out, ins[0], count * 2);
        return;
    }
#if SD_X86
#if SD_HAVE_FP16_INSN
    if (level == 3 && f16 && sd_half_fp16 && n == 2 && (op == SD_HSUM || op == SD_HPROD)) {
        sd_f16_pair512(op, out, ins, count);
        return;
    }
#endif
#if SD_HAVE_BF16_INSN
    if (level == 3 && !f16 && sd_half_bf16 && n <= 64) {
        sd_bf16_fast512(op, out, ins, n, count, div);
        return;
    }
#endif
    if (level >= 2) {
        if (n <= 64) sd_half_fast512(f16, op, out, ins, n, count, div);
        else sd_half_avx512(f16, op, out, ins, n, count, div);
        return;
    }
    if (level == 1) {
        sd_half_avx2(f16, op, out, ins, n, count, div);
        return;
    }
#endif
    (void)level;
    sd_half_plain(f16, op, out, ins, n, count, div);
}
#endif

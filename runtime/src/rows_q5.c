/* Q5_0 and Q5_1 row kernels (llama.cpp writes them where a K-quant's row is not a multiple of
 * 256: Q4_K -> Q5_0, Q5_K -> Q5_1), scalar and AVX2 (the AVX-512 level uses the AVX2 ones).
 *
 * Blocks of 32 (ggml's block_q5_0 / block_q5_1): f16 d, [f16 m,] uint8 qh[4], uint8 qs[16].
 * Element i < 16 has its low 4 bits in the low nibble of qs[i], element i + 16 in the high
 * nibble; bit i of qh (a little-endian u32) is element i's fifth bit. Code q in 0..31;
 * Q5_0: weight = d * (q - 16); Q5_1: weight = d * q + m. Dots are integer against the
 * activation's Q8 blocks; Q5_1 adds m * xd * sum(xq) per block. */
#include "rows.h"

/* Block layout: where qh and qs start, and whether there is an m. */
#define Q5_0_QH 2
#define Q5_1_QH 4

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Element i's code (0..31) of the block whose qh is at `qh` (qs follows it). */
static inline int q5_code(const uint8_t *qh, uint32_t h, int i) {
    const uint8_t *qs = qh + 4;
    const int nib = i < 16 ? qs[i] & 0xF : qs[i - 16] >> 4;
    return nib | (int)((h >> i) & 1) << 4;
}

/* ---- scalar -------------------------------------------------------------------------------- */

static float dot_q5_0(const void *row, const void *x, int n) {
    const uint8_t *w = row;
    const pyrt_xq8 *xq = x;
    float sum = 0.0f;
    for (int b = 0; b < n / PYRT_QK; b++, w += PYRT_Q5_0_BYTES) {
        const uint32_t h = load_u32(w + Q5_0_QH);
        int32_t isum = 0;
        for (int i = 0; i < PYRT_QK; i++)
            isum += (q5_code(w + Q5_0_QH, h, i) - 16) * xq[b].q[i];
        sum += pyrt_fp16_to_fp32(pyrt_load_u16(w)) * xq[b].d * (float)isum;
    }
    return sum;
}

static float dot_q5_1(const void *row, const void *x, int n) {
    const uint8_t *w = row;
    const pyrt_xq8 *xq = x;
    float sum = 0.0f;
    for (int b = 0; b < n / PYRT_QK; b++, w += PYRT_Q5_1_BYTES) {
        const uint32_t h = load_u32(w + Q5_1_QH);
        int32_t isum = 0, xsum = 0;
        for (int i = 0; i < PYRT_QK; i++) {
            isum += q5_code(w + Q5_1_QH, h, i) * xq[b].q[i];
            xsum += xq[b].q[i];
        }
        sum += pyrt_fp16_to_fp32(pyrt_load_u16(w)) * xq[b].d * (float)isum +
               pyrt_fp16_to_fp32(pyrt_load_u16(w + 2)) * xq[b].d * (float)xsum;
    }
    return sum;
}

static void axpy_q5_0(float a, const void *row, float *y, int n) {
    const uint8_t *w = row;
    for (int b = 0; b < n / PYRT_QK; b++, w += PYRT_Q5_0_BYTES, y += PYRT_QK) {
        const uint32_t h = load_u32(w + Q5_0_QH);
        const float s = a * pyrt_fp16_to_fp32(pyrt_load_u16(w));
        for (int i = 0; i < PYRT_QK; i++)
            y[i] += s * (float)(q5_code(w + Q5_0_QH, h, i) - 16);
    }
}

static void axpy_q5_1(float a, const void *row, float *y, int n) {
    const uint8_t *w = row;
    for (int b = 0; b < n / PYRT_QK; b++, w += PYRT_Q5_1_BYTES, y += PYRT_QK) {
        const uint32_t h = load_u32(w + Q5_1_QH);
        const float s = a * pyrt_fp16_to_fp32(pyrt_load_u16(w));
        const float m = a * pyrt_fp16_to_fp32(pyrt_load_u16(w + 2));
        for (int i = 0; i < PYRT_QK; i++)
            y[i] += s * (float)q5_code(w + Q5_1_QH, h, i) + m;
    }
}

static const pyrt_row_ops ops_q5_0_scalar = {.dot = dot_q5_0, .axpy = axpy_q5_0};
static const pyrt_row_ops ops_q5_1_scalar = {.dot = dot_q5_1, .axpy = axpy_q5_1};

const pyrt_row_ops *pyrt_row_ops_q5_scalar(int fmt) {
    return fmt == PYRT_FMT_Q5_0 ? &ops_q5_0_scalar : &ops_q5_1_scalar;
}

/* ---- AVX2 ---------------------------------------------------------------------------------- */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "rows_x86.h"
#include "rows_b32_avx2.h"

/* The 32 codes of a block (elements 0..15: low nibbles, 16..31: high) with their fifth bits:
 * each byte of the broadcast qh picks its own bit (byte k of lane j holds bits 8j..8j+7 of the
 * four qh bytes spread so that element i reads bit i), then or-ed in as 16. */
PYRT_X86_AVX2 static inline __m256i unpack_q5(const uint8_t *qh, int offset) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)(qh + 4));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4),
                                         _mm_and_si128(raw, m4));
    /* byte i of `bytes` = qh byte i / 8; then test bit i % 8 of it */
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)load_u32(qh)), shuf);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201);
    const __m256i has = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    const __m256i q = _mm256_or_si256(nib, _mm256_and_si256(has, _mm256_set1_epi8(16)));
    return _mm256_sub_epi8(q, _mm256_set1_epi8((char)offset));
}

#define Q5_D(w) pyrt_fp16_to_fp32(pyrt_load_u16(w))
#define Q5_M(w) pyrt_fp16_to_fp32(pyrt_load_u16((w) + 2))
#define Q5_0_UNPACK(w) unpack_q5((w) + Q5_0_QH, 16)
#define Q5_1_UNPACK(w) unpack_q5((w) + Q5_1_QH, 0)
#define NO_MIN(w) 0.0f

PYRT_B32_AVX2_KERNELS(q5_0, PYRT_Q5_0_BYTES, Q5_D, NO_MIN, 0, Q5_0_UNPACK)
PYRT_B32_AVX2_KERNELS(q5_1, PYRT_Q5_1_BYTES, Q5_D, Q5_M, 1, Q5_1_UNPACK)

const pyrt_row_ops *pyrt_row_ops_q5_avx2(int fmt) {
    return fmt == PYRT_FMT_Q5_0 ? &q5_0_ops : &q5_1_ops;
}

#else /* not x86-64: the scalar kernels stand in (cpu.c never selects an x86 level) */

const pyrt_row_ops *pyrt_row_ops_q5_avx2(int fmt) {
    return pyrt_row_ops_q5_scalar(fmt);
}

#endif

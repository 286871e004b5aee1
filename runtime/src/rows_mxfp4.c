/* MXFP4 row kernels (gpt-oss's expert format), scalar and AVX2 (the AVX-512 level uses the AVX2
 * ones: a block is 16 bytes of nibbles, one 256-bit register of int8 weights once looked up).
 *
 * Block (ggml's block_mxfp4, 17 bytes, PYRT_MXFP4_BYTES): uint8 e (E8M0 scale), uint8 qs[16];
 * element i < 16 is the e2m1 code in the low nibble of qs[i], element i + 16 the high nibble.
 * Value = pyrt_mxfp4_values[code] * 2^(e - 128): the table holds the e2m1 values doubled (0, 1, 2,
 * 3, 4, 6, 8, 12 and their negatives, int8), so the dots are integer like Q4_0's, against the
 * activation's Q8 blocks, and the block scale is d_w = 2^(e - 128) (pyrt_e8m0_half). The AVX2
 * kernels are rows_b32_avx2.h's, with a pshufb lookup of the codes. */
#include "rows.h"

const int8_t pyrt_mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* ---- scalar -------------------------------------------------------------------------------- */

static float dot_mxfp4(const void *row, const void *x, int n) {
    const uint8_t *w = row;
    const pyrt_xq8 *xq = x;
    float sum = 0.0f;
    for (int b = 0; b < n / PYRT_QK; b++, w += PYRT_MXFP4_BYTES) {
        const uint8_t *qs = w + 1;
        int32_t isum = 0;
        for (int i = 0; i < PYRT_QK / 2; i++) {
            isum += pyrt_mxfp4_values[qs[i] & 0xF] * xq[b].q[i];
            isum += pyrt_mxfp4_values[qs[i] >> 4] * xq[b].q[i + PYRT_QK / 2];
        }
        sum += pyrt_e8m0_half(w[0]) * xq[b].d * (float)isum;
    }
    return sum;
}

static void axpy_mxfp4(float a, const void *row, float *y, int n) {
    const uint8_t *w = row;
    for (int b = 0; b < n / PYRT_QK; b++, w += PYRT_MXFP4_BYTES, y += PYRT_QK) {
        const uint8_t *qs = w + 1;
        const float s = a * pyrt_e8m0_half(w[0]);
        for (int i = 0; i < PYRT_QK / 2; i++) {
            y[i] += s * (float)pyrt_mxfp4_values[qs[i] & 0xF];
            y[i + PYRT_QK / 2] += s * (float)pyrt_mxfp4_values[qs[i] >> 4];
        }
    }
}

static const pyrt_row_ops ops_scalar = {.dot = dot_mxfp4, .axpy = axpy_mxfp4};

const pyrt_row_ops *pyrt_row_ops_mxfp4_scalar(void) {
    return &ops_scalar;
}

/* ---- AVX2 ---------------------------------------------------------------------------------- */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "rows_x86.h"
#include "rows_b32_avx2.h"

#define AVX2 PYRT_X86_AVX2

/* The 32 int8 weights of a block (elements 0..15: low nibbles, 16..31: high), looked up in the
 * doubled e2m1 table with one pshufb per half. */
AVX2 static inline __m256i unpack_mxfp4(const uint8_t *qs) {
    const __m128i table = _mm_loadu_si128((const __m128i *)pyrt_mxfp4_values);
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(raw, m4));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(raw, 4), m4));
    return _mm256_set_m128i(hi, lo);
}

#define MXFP4_SCALE(w) pyrt_e8m0_half((w)[0])
#define MXFP4_UNPACK(w) unpack_mxfp4((w) + 1)
#define NO_MIN(w) 0.0f

PYRT_B32_AVX2_KERNELS(mxfp4, PYRT_MXFP4_BYTES, MXFP4_SCALE, NO_MIN, 0, MXFP4_UNPACK)

const pyrt_row_ops *pyrt_row_ops_mxfp4_avx2(void) {
    return &mxfp4_ops;
}

#else /* not x86-64: the scalar kernels stand in (cpu.c never selects an x86 level) */

const pyrt_row_ops *pyrt_row_ops_mxfp4_avx2(void) {
    return &ops_scalar;
}

#endif

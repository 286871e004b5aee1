/* MXFP4 row kernels (gpt-oss's expert format), scalar and AVX2 (the AVX-512 level uses the AVX2
 * ones: a block is 16 bytes of nibbles, one 256-bit register of int8 weights once looked up).
 *
 * Block (ggml's block_mxfp4, 17 bytes, PYRT_MXFP4_BYTES): uint8 e (E8M0 scale), uint8 qs[16];
 * element i < 16 is the e2m1 code in the low nibble of qs[i], element i + 16 the high nibble.
 * Value = pyrt_mxfp4_values[code] * 2^(e - 128): the table holds the e2m1 values doubled (0, 1, 2,
 * 3, 4, 6, 8, 12 and their negatives, int8), so the dots are integer like Q4_0's, against the
 * activation's Q8 blocks, and the block scale is d_w = 2^(e - 128) (pyrt_e8m0_half). */
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

#define AVX2 __attribute__((target("avx2,fma,f16c")))

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

#define BLOCK_FMA(acc, s, wq, x)                                                                  \
    acc = _mm256_fmadd_ps(_mm256_set1_ps(s), _mm256_cvtepi32_ps(dot32_i8((wq), (x))), acc)
#define LOAD_X(xb) _mm256_loadu_si256((const __m256i *)(xb))

/* Even blocks into acc0, odd ones into acc1 (two chains of FMAs), prefetches spread over the
 * block pairs. */
AVX2 static float dot_pf_avx2(const void *row, const void *x, int n, const void *const *pf,
                              int n_pf) {
    const uint8_t *w = row;
    const pyrt_xq8 *xq = x;
    const int nb = n / PYRT_QK;
    pyrt_pf_spread ps = pyrt_pf_begin(pf, n_pf, nb / 2);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *w0 = w + (size_t)b * PYRT_MXFP4_BYTES, *w1 = w0 + PYRT_MXFP4_BYTES;
        BLOCK_FMA(acc0, pyrt_e8m0_half(w0[0]) * xq[b].d, unpack_mxfp4(w0 + 1), LOAD_X(xq[b].q));
        BLOCK_FMA(acc1, pyrt_e8m0_half(w1[0]) * xq[b + 1].d, unpack_mxfp4(w1 + 1),
                  LOAD_X(xq[b + 1].q));
        pyrt_pf_tick(&ps);
    }
    if (b < nb) {
        const uint8_t *w0 = w + (size_t)b * PYRT_MXFP4_BYTES;
        BLOCK_FMA(acc0, pyrt_e8m0_half(w0[0]) * xq[b].d, unpack_mxfp4(w0 + 1), LOAD_X(xq[b].q));
    }
    pyrt_pf_end(&ps);
    return hsum8(_mm256_add_ps(acc0, acc1));
}

AVX2 static float dot_avx2(const void *row, const void *x, int n) {
    return dot_pf_avx2(row, x, n, NULL, 0);
}

/* A neuron's gate and up rows in one pass over x: per row exactly dot_pf_avx2's operations in
 * its order (the same bits as two dot calls); x's blocks loaded once. */
AVX2 static void dot2_pf_avx2(const void *row0, const void *row1, const void *x, int n,
                              float out[2], const void *const *pf, int n_pf) {
    const uint8_t *wr[2] = {row0, row1};
    const pyrt_xq8 *xq = x;
    const int nb = n / PYRT_QK;
    pyrt_pf_spread ps = pyrt_pf_begin(pf, n_pf, nb / 2);
    __m256 acc0[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 acc1[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        const __m256i x0 = LOAD_X(xq[b].q), x1 = LOAD_X(xq[b + 1].q);
        for (int r = 0; r < 2; r++) {
            const uint8_t *w0 = wr[r] + (size_t)b * PYRT_MXFP4_BYTES, *w1 = w0 + PYRT_MXFP4_BYTES;
            BLOCK_FMA(acc0[r], pyrt_e8m0_half(w0[0]) * xq[b].d, unpack_mxfp4(w0 + 1), x0);
            BLOCK_FMA(acc1[r], pyrt_e8m0_half(w1[0]) * xq[b + 1].d, unpack_mxfp4(w1 + 1), x1);
        }
        pyrt_pf_tick(&ps);
    }
    if (b < nb) {
        const __m256i x0 = LOAD_X(xq[b].q);
        for (int r = 0; r < 2; r++) {
            const uint8_t *w0 = wr[r] + (size_t)b * PYRT_MXFP4_BYTES;
            BLOCK_FMA(acc0[r], pyrt_e8m0_half(w0[0]) * xq[b].d, unpack_mxfp4(w0 + 1), x0);
        }
    }
    pyrt_pf_end(&ps);
    out[0] = hsum8(_mm256_add_ps(acc0[0], acc1[0]));
    out[1] = hsum8(_mm256_add_ps(acc0[1], acc1[1]));
}

AVX2 static void dot2_avx2(const void *row0, const void *row1, const void *x, int n,
                           float out[2]) {
    dot2_pf_avx2(row0, row1, x, n, out, NULL, 0);
}

/* The 32 weights of a block as f32 in four registers (elements 0..7, 8..15, 16..23, 24..31). */
AVX2 static inline void widen_block(const uint8_t *qs, __m256 f[4]) {
    const __m256i q = unpack_mxfp4(qs);
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

/* Several down rows into one y: a block of y (4 registers) loaded once, every row's share added
 * in row order, stored once (the same bits as nr axpy calls in order). */
AVX2 static void axpyn_pf_avx2(int nr, const float *a, const void *const *rows, float *y, int n,
                               const void *const *pf, int n_pf) {
    pyrt_pf_spread ps = pyrt_pf_begin(pf, n_pf, n / PYRT_QK);
    for (int b = 0; b < n / PYRT_QK; b++, y += PYRT_QK) {
        __m256 acc[4] = {_mm256_loadu_ps(y), _mm256_loadu_ps(y + 8), _mm256_loadu_ps(y + 16),
                         _mm256_loadu_ps(y + 24)};
        for (int r = 0; r < nr; r++) {
            const uint8_t *w = (const uint8_t *)rows[r] + (size_t)b * PYRT_MXFP4_BYTES;
            const __m256 vs = _mm256_set1_ps(a[r] * pyrt_e8m0_half(w[0]));
            __m256 f[4];
            widen_block(w + 1, f);
            for (int p = 0; p < 4; p++)
                acc[p] = _mm256_fmadd_ps(vs, f[p], acc[p]);
        }
        for (int p = 0; p < 4; p++)
            _mm256_storeu_ps(y + 8 * p, acc[p]);
        pyrt_pf_tick(&ps);
    }
    pyrt_pf_end(&ps);
}

AVX2 static void axpyn_avx2(int nr, const float *a, const void *const *rows, float *y, int n) {
    axpyn_pf_avx2(nr, a, rows, y, n, NULL, 0);
}

AVX2 static void axpy_avx2(float a, const void *row, float *y, int n) {
    axpyn_pf_avx2(1, &a, &row, y, n, NULL, 0);
}

static const pyrt_row_ops ops_avx2 = {.dot = dot_avx2,       .axpy = axpy_avx2,
                                      .dot2 = dot2_avx2,     .axpyn = axpyn_avx2,
                                      .dot_pf = dot_pf_avx2, .dot2_pf = dot2_pf_avx2,
                                      .axpyn_pf = axpyn_pf_avx2};

const pyrt_row_ops *pyrt_row_ops_mxfp4_avx2(void) {
    return &ops_avx2;
}

#else /* not x86-64: the scalar kernels stand in (cpu.c never selects an x86 level) */

const pyrt_row_ops *pyrt_row_ops_mxfp4_avx2(void) {
    return &ops_scalar;
}

#endif

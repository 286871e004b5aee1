/* MXFP4 row kernels (gpt-oss's expert format): scalar, AVX2, and AVX-512 (BW, or VNNI where the
 * CPU has it; two blocks per 512-bit step, the AVX2 kernels' bits).
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


/* ---- AVX-512 ------------------------------------------------------------------------------- *
 *
 * Two blocks per 512-bit step, as rows_avx512.c's Q4_0 kernels: 128-bit lanes 0..3 hold block b's
 * low nibbles (elements 0..15), its high nibbles (16..31), block b+1's low and high nibbles, in
 * the order of x's two blocks joined. The codes come from two 16-byte broadcasts, one variable
 * shift (lanes 1 and 3 by 4) and one mask; one vpshufb looks all 64 up. The dots:
 * The lookup gives the weights plus a bias, unsigned, and the lanes start from -bias * (sum of
 * their 4 x bytes), made once per x vector (shared by dot2's rows): the same int32 lanes exactly.
 *  - BW: bias 12 (0..24: vpmaddubsw's pair sums stay under 2^15), then vpmaddwd and an add;
 *  - VNNI: bias 128 (0..255), one vpdpbusd from neg_x128.
 * The block scales d_w * d_x of 8 blocks are made in one vector (2^(e - 128) by vscalefps, exact
 * for every e: pyrt_e8m0_half's values) and spread over each step's lanes by one permute. Lanes
 * 0..7 accumulate the even blocks and 8..15 the odd ones, an odd last block goes into lanes 0..7
 * (masked FMA), and the two halves are added and summed as the AVX2 kernel's two accumulators:
 * the AVX2 dot's bits. The axpy kernels widen the 16 code bytes to int32 lanes and look the f32
 * values up with vpermps (it reads only an index's low 4 bits), y += (a d_w) * value per element
 * in row order: the AVX2 axpy's bits. */

#include "blocks_avx512.h"

/* pyrt_mxfp4_values + 12 (BW) and + 128 (VNNI) as unsigned bytes, and as f32 (axpy). */
static const uint8_t mxfp4_plus12[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                         12, 11, 10, 9,  8,  6,  4,  0};
static const uint8_t mxfp4_plus128[16] = {128, 129, 130, 131, 132, 134, 136, 140,
                                          128, 127, 126, 125, 124, 122, 120, 116};
static const float mxfp4_f32[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* The 64 codes (0..15 in bytes) of the blocks at w0 and w0 + PYRT_MXFP4_BYTES. */
AVX512 static inline __m512i mxfp4_codes2(const uint8_t *w0) {
    const __m128i q0 = _mm_loadu_si128((const __m128i *)(w0 + 1));
    const __m128i q1 = _mm_loadu_si128((const __m128i *)(w0 + PYRT_MXFP4_BYTES + 1));
    const __m512i raw = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(q0), 0xFF00, q1);
    const __m512i sh = _mm512_srlv_epi64(raw, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
    return _mm512_and_si512(sh, _mm512_set1_epi8(0x0F));
}

/* The codes of the one block at w0 in lanes 0..7's bytes (lanes 8..15: copies, never summed). */
AVX512 static inline __m512i mxfp4_codes1(const uint8_t *w0) {
    const __m512i raw = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(w0 + 1)));
    const __m512i sh = _mm512_srlv_epi64(raw, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
    return _mm512_and_si512(sh, _mm512_set1_epi8(0x0F));
}

/* d_w * d_x of the 8 blocks at w (PYRT_MXFP4_BYTES apart) in lanes 0..7 (8..15: zero). */
AVX512 static inline __m512 mxfp4_scales8(const uint8_t *w, const pyrt_xq8 *xq) {
    __m128i e = _mm_cvtsi32_si128(w[0]);
    e = _mm_insert_epi8(e, w[1 * PYRT_MXFP4_BYTES], 1);
    e = _mm_insert_epi8(e, w[2 * PYRT_MXFP4_BYTES], 2);
    e = _mm_insert_epi8(e, w[3 * PYRT_MXFP4_BYTES], 3);
    e = _mm_insert_epi8(e, w[4 * PYRT_MXFP4_BYTES], 4);
    e = _mm_insert_epi8(e, w[5 * PYRT_MXFP4_BYTES], 5);
    e = _mm_insert_epi8(e, w[6 * PYRT_MXFP4_BYTES], 6);
    e = _mm_insert_epi8(e, w[7 * PYRT_MXFP4_BYTES], 7);
    const __m256 ef = _mm256_cvtepi32_ps(
        _mm256_sub_epi32(_mm256_cvtepu8_epi32(e), _mm256_set1_epi32(128)));
    const __m512 dw = _mm512_scalef_ps(_mm512_set1_ps(1.0f), _mm512_castps256_ps512(ef));
    const __m256 dx = _mm256_setr_ps(xq[0].d, xq[1].d, xq[2].d, xq[3].d, xq[4].d, xq[5].d,
                                     xq[6].d, xq[7].d);
    return _mm512_zextps256_ps512(_mm256_mul_ps(_mm512_castps512_ps256(dw), dx));
}

AVX512 static inline __m512i mxfp4_x2(const pyrt_xq8 *xq) {
    return join256(_mm256_loadu_si256((const __m256i *)xq[0].q),
                   _mm256_loadu_si256((const __m256i *)xq[1].q));
}

/* acc's lanes 0..7 plus lanes 8..15, summed as hsum8 (the AVX2 kernel's acc0 + acc1). */
AVX512 static inline float mxfp4_sum(__m512 acc) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc), hi));
}

/* -12 * (sum of each int32 lane's 4 x bytes): the BW lanes' start. */
AVX512 static inline __m512i neg_x12(__m512i x) {
    const __m512i sum = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_set1_epi8(12), x),
                                          _mm512_set1_epi16(1));
    return _mm512_sub_epi32(_mm512_setzero_si512(), sum);
}

/* The BW and VNNI lookup tables and int32 lanes (see above); nx: PREP(x), the lanes' start. */
#define MXFP4_TABLE(t) _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(t)))
#define MXFP4_TABLE_BW() MXFP4_TABLE(mxfp4_plus12)
#define MXFP4_TABLE_VNNI() MXFP4_TABLE(mxfp4_plus128)
#define MXFP4_LANES_BW(w, xv, nx)                                                                 \
    _mm512_add_epi32(nx, _mm512_madd_epi16(_mm512_maddubs_epi16(w, xv), _mm512_set1_epi16(1)))
#define MXFP4_LANES_VNNI(w, xv, nx) _mm512_dpbusd_epi32(nx, w, xv)

#define MXFP4_DOT(name, TGT, TABLE, PREP, LANES)                                                  \
    /* nrow rows (1 or 2) against x; per row the same operations in the same order. */           \
    TGT static inline __attribute__((always_inline)) void name##_dotn(                          \
        int nrow, const uint8_t *const *wr, const pyrt_xq8 *xq, int n, float *out,               \
        const void *const *pf, int n_pf) {                                                        \
        const int nb = n / PYRT_QK;                                                               \
        const __m512i table = TABLE();                                                            \
        pyrt_pf_spread ps = pyrt_pf_begin(pf, n_pf, nb / 2);                                      \
        __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};                               \
        int b = 0;                                                                                \
        for (; b + 8 <= nb; b += 8) {                                                             \
            __m512 s8[2];                                                                         \
            for (int r = 0; r < nrow; r++)                                                        \
                s8[r] = mxfp4_scales8(wr[r] + (size_t)b * PYRT_MXFP4_BYTES, xq + b);              \
            _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) {                                 \
                const int bp = b + 2 * p;                                                         \
                const __m512i xv = mxfp4_x2(xq + bp);                                             \
                const __m512i nx = PREP(xv);                                                      \
                for (int r = 0; r < nrow; r++) {                                                  \
                    const __m512i wq = _mm512_shuffle_epi8(                                       \
                        table, mxfp4_codes2(wr[r] + (size_t)bp * PYRT_MXFP4_BYTES));              \
                    const __m512 s = _mm512_permutexvar_ps(pair_index(p), s8[r]);                 \
                    acc[r] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(LANES(wq, xv, nx)), acc[r]);   \
                }                                                                                 \
                pyrt_pf_tick(&ps);                                                                \
            }                                                                                     \
        }                                                                                         \
        for (; b + 2 <= nb; b += 2) {                                                             \
            const __m512i xv = mxfp4_x2(xq + b);                                                  \
            const __m512i nx = PREP(xv);                                                          \
            for (int r = 0; r < nrow; r++) {                                                      \
                const uint8_t *w0 = wr[r] + (size_t)b * PYRT_MXFP4_BYTES;                         \
                const __m512i wq = _mm512_shuffle_epi8(table, mxfp4_codes2(w0));                  \
                const __m512 s =                                                                  \
                    scales2(pyrt_e8m0_half(w0[0]) * xq[b].d,                                      \
                            pyrt_e8m0_half(w0[PYRT_MXFP4_BYTES]) * xq[b + 1].d);                  \
                acc[r] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(LANES(wq, xv, nx)), acc[r]);       \
            }                                                                                     \
            pyrt_pf_tick(&ps);                                                                    \
        }                                                                                         \
        if (b < nb) { /* the odd last block: lanes 0..7 only */                                   \
            const __m512i xv =                                                                    \
                _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)xq[b].q));             \
            const __m512i nx = PREP(xv);                                                          \
            for (int r = 0; r < nrow; r++) {                                                      \
                const uint8_t *w0 = wr[r] + (size_t)b * PYRT_MXFP4_BYTES;                         \
                const __m512i wq = _mm512_shuffle_epi8(table, mxfp4_codes1(w0));                  \
                const __m512 s = _mm512_set1_ps(pyrt_e8m0_half(w0[0]) * xq[b].d);                 \
                acc[r] = _mm512_mask3_fmadd_ps(s, _mm512_cvtepi32_ps(LANES(wq, xv, nx)), acc[r],  \
                                               0x00FF);                                           \
            }                                                                                     \
        }                                                                                         \
        pyrt_pf_end(&ps);                                                                         \
        for (int r = 0; r < nrow; r++)                                                            \
            out[r] = mxfp4_sum(acc[r]);                                                           \
    }                                                                                             \
    TGT static float name##_dot_pf(const void *row, const void *x, int n, const void *const *pf, \
                                   int n_pf) {                                                    \
        const uint8_t *wr[1] = {row};                                                             \
        float out;                                                                                \
        name##_dotn(1, wr, x, n, &out, pf, n_pf);                                                 \
        return out;                                                                               \
    }                                                                                             \
    TGT static float name##_dot(const void *row, const void *x, int n) {                         \
        return name##_dot_pf(row, x, n, NULL, 0);                                                 \
    }                                                                                             \
    TGT static void name##_dot2_pf(const void *row0, const void *row1, const void *x, int n,     \
                                   float out[2], const void *const *pf, int n_pf) {              \
        const uint8_t *wr[2] = {row0, row1};                                                      \
        name##_dotn(2, wr, x, n, out, pf, n_pf);                                                  \
    }                                                                                             \
    TGT static void name##_dot2(const void *row0, const void *row1, const void *x, int n,        \
                                float out[2]) {                                                   \
        name##_dot2_pf(row0, row1, x, n, out, NULL, 0);                                           \
    }

MXFP4_DOT(mxfp4_bw, AVX512, MXFP4_TABLE_BW, neg_x12, MXFP4_LANES_BW)
MXFP4_DOT(mxfp4_vnni, AVX512VNNI, MXFP4_TABLE_VNNI, neg_x128, MXFP4_LANES_VNNI)

/* Several down rows into one y: a block of y (two registers) loaded once, every row's
 * (a[r] d_w) * values added in row order, stored once (the same bits as nr axpy calls). */
AVX512 static void mxfp4_512_axpyn_pf(int nr, const float *a, const void *const *rows, float *y,
                                  int n, const void *const *pf, int n_pf) {
    const int nb = n / PYRT_QK;
    const __m512 table = _mm512_loadu_ps(mxfp4_f32);
    pyrt_pf_spread ps = pyrt_pf_begin(pf, n_pf, nb);
    for (int b = 0; b < nb; b++, y += PYRT_QK) {
        __m512 y0 = _mm512_loadu_ps(y), y1 = _mm512_loadu_ps(y + 16);
        for (int r = 0; r < nr; r++) {
            const uint8_t *w = (const uint8_t *)rows[r] + (size_t)b * PYRT_MXFP4_BYTES;
            const __m512 vs = _mm512_set1_ps(a[r] * pyrt_e8m0_half(w[0]));
            const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 1)));
            y0 = _mm512_fmadd_ps(vs, _mm512_permutexvar_ps(q, table), y0);
            y1 = _mm512_fmadd_ps(vs, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table), y1);
        }
        _mm512_storeu_ps(y, y0);
        _mm512_storeu_ps(y + 16, y1);
        pyrt_pf_tick(&ps);
    }
    pyrt_pf_end(&ps);
}

AVX512 static void mxfp4_512_axpyn(int nr, const float *a, const void *const *rows, float *y,
                                   int n) {
    mxfp4_512_axpyn_pf(nr, a, rows, y, n, NULL, 0);
}

AVX512 static void mxfp4_512_axpy(float a, const void *row, float *y, int n) {
    mxfp4_512_axpyn_pf(1, &a, &row, y, n, NULL, 0);
}

static const pyrt_row_ops mxfp4_bw_ops = {
    .dot = mxfp4_bw_dot,           .axpy = mxfp4_512_axpy,    .dot2 = mxfp4_bw_dot2,
    .axpyn = mxfp4_512_axpyn,      .dot_pf = mxfp4_bw_dot_pf, .dot2_pf = mxfp4_bw_dot2_pf,
    .axpyn_pf = mxfp4_512_axpyn_pf};
static const pyrt_row_ops mxfp4_vnni_ops = {
    .dot = mxfp4_vnni_dot,         .axpy = mxfp4_512_axpy,      .dot2 = mxfp4_vnni_dot2,
    .axpyn = mxfp4_512_axpyn,      .dot_pf = mxfp4_vnni_dot_pf, .dot2_pf = mxfp4_vnni_dot2_pf,
    .axpyn_pf = mxfp4_512_axpyn_pf};

const pyrt_row_ops *pyrt_row_ops_mxfp4_avx512(int vnni) {
    return vnni ? &mxfp4_vnni_ops : &mxfp4_bw_ops;
}

#else /* not x86-64: the scalar kernels stand in (cpu.c never selects an x86 level) */

const pyrt_row_ops *pyrt_row_ops_mxfp4_avx2(void) {
    return &ops_scalar;
}

const pyrt_row_ops *pyrt_row_ops_mxfp4_avx512(int vnni) {
    (void)vnni;
    return &ops_scalar;
}

#endif

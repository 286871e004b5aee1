/* K-quant row kernels (Q4_K, Q5_K, Q6_K: ggml's 256-element super-blocks), scalar and AVX2 (the
 * AVX-512 ones: rows_kquant_avx512.c). Rows are a multiple of 256 elements.
 *
 * Super-block layouts (ggml's block_q4_K / block_q5_K / block_q6_K):
 *   Q4_K: f16 d, f16 dmin, scales[12], qs[128]. Eight sub-blocks j of 32 elements, weight =
 *         d * sc_j * q - dmin * m_j with six-bit sc_j, m_j packed in scales (scale_min) and q
 *         in 0..15: element l of sub-block j is nibble j % 2 of qs[32 (j / 2) + l].
 *   Q5_K: f16 d, f16 dmin, scales[12], qh[32], qs[128]: as Q4_K, plus bit j of qh[l] as q's
 *         fifth bit (q in 0..31).
 *   Q6_K: ql[128], qh[64], int8 scales[16], f16 d. Element e = 128 h + 32 p + l (half h,
 *         quarter p, l < 32): low 4 bits in nibble p / 2 of ql[64 h + 32 (p % 2) + l], high 2
 *         bits at bit 2 p of qh[32 h + l]; weight = d * scales[e / 16] * (q - 32).
 * The activation comes as Q8 blocks of 32 whose 8 blocks per super-block share one scale xd
 * (pyrt_quantize_x_q8k, ggml's Q8_K in Q8_0's layout), so a super-block's dot is integer but for
 * d xd: sum_j sc_j (q_j . x_j) (Q6_K: per 16) times d xd, minus sum_j m_j sum(x_j) times
 * dmin xd. The SIMD kernels take sum(x_j) from the sums per 16 stored after the blocks
 * (pyrt_xq_sums); the scalar ones, the reference, sum x's codes themselves. */
#include "rows.h"

/* Sub-block j's six-bit scale and min of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4). */
static inline void scale_min(int j, const uint8_t *s, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | (s[j - 4] >> 6) << 4;
        *m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

#define D(w) pyrt_fp16_to_fp32(pyrt_load_u16(w))

/* Element l's code of sub-block j (of 32): Q4_K 0..15, Q5_K 0..31, Q6_K -32..31. */
static inline int code_q4_k(const uint8_t *w, int j, int l) {
    return (w[16 + 32 * (j / 2) + l] >> 4 * (j % 2)) & 0xF;
}
static inline int code_q5_k(const uint8_t *w, int j, int l) {
    return ((w[48 + 32 * (j / 2) + l] >> 4 * (j % 2)) & 0xF) | ((w[16 + l] >> j) & 1) << 4;
}
static inline int code_q6_k(const uint8_t *w, int j, int l) {
    const int h = j / 4, p = j % 4;
    const int lo = (w[64 * h + 32 * (p % 2) + l] >> 4 * (p / 2)) & 0xF;
    const int hi = (w[128 + 32 * h + l] >> 2 * p) & 3;
    return (lo | hi << 4) - 32;
}

/* ---- scalar -------------------------------------------------------------------------------- */

#define SCALAR_DOT_MIN(name, BYTES, CODE)                                                         \
    static float dot_##name(const void *row, const void *x, int n) {                              \
        const uint8_t *w = row;                                                                   \
        const pyrt_xq8 *xq = x;                                                                   \
        float sum = 0.0f;                                                                         \
        for (int s = 0; s < n / PYRT_QK_K; s++, w += (BYTES), xq += 8) {                          \
            int32_t isum = 0, msum = 0;                                                           \
            for (int j = 0; j < 8; j++) {                                                         \
                int sc, m;                                                                        \
                scale_min(j, w + 4, &sc, &m);                                                     \
                int32_t qx = 0, xsum = 0;                                                         \
                for (int l = 0; l < PYRT_QK; l++) {                                               \
                    qx += CODE(w, j, l) * xq[j].q[l];                                             \
                    xsum += xq[j].q[l];                                                           \
                }                                                                                 \
                isum += sc * qx;                                                                  \
                msum += m * xsum;                                                                 \
            }                                                                                     \
            sum += D(w) * xq[0].d * (float)isum - D(w + 2) * xq[0].d * (float)msum;               \
        }                                                                                         \
        return sum;                                                                               \
    }                                                                                             \
    static void axpy_##name(float a, const void *row, float *y, int n) {                          \
        const uint8_t *w = row;                                                                   \
        for (int s = 0; s < n / PYRT_QK_K; s++, w += (BYTES)) {                                   \
            const float d = D(w), dmin = D(w + 2);                                                \
            for (int j = 0; j < 8; j++, y += PYRT_QK) {                                           \
                int sc, m;                                                                        \
                scale_min(j, w + 4, &sc, &m);                                                     \
                const float vs = a * d * (float)sc, vm = a * dmin * (float)m;                     \
                for (int l = 0; l < PYRT_QK; l++)                                                 \
                    y[l] += vs * (float)CODE(w, j, l) - vm;                                       \
            }                                                                                     \
        }                                                                                         \
    }

SCALAR_DOT_MIN(q4_k, PYRT_Q4_K_BYTES, code_q4_k)
SCALAR_DOT_MIN(q5_k, PYRT_Q5_K_BYTES, code_q5_k)

static float dot_q6_k(const void *row, const void *x, int n) {
    const uint8_t *w = row;
    const pyrt_xq8 *xq = x;
    float sum = 0.0f;
    for (int s = 0; s < n / PYRT_QK_K; s++, w += PYRT_Q6_K_BYTES, xq += 8) {
        const int8_t *sc = (const int8_t *)(w + 192);
        int32_t isum = 0;
        for (int j = 0; j < 8; j++) {
            int32_t lo = 0, hi = 0;
            for (int l = 0; l < 16; l++) {
                lo += code_q6_k(w, j, l) * xq[j].q[l];
                hi += code_q6_k(w, j, l + 16) * xq[j].q[l + 16];
            }
            isum += sc[2 * j] * lo + sc[2 * j + 1] * hi;
        }
        sum += D(w + 208) * xq[0].d * (float)isum;
    }
    return sum;
}

static void axpy_q6_k(float a, const void *row, float *y, int n) {
    const uint8_t *w = row;
    for (int s = 0; s < n / PYRT_QK_K; s++, w += PYRT_Q6_K_BYTES) {
        const float ad = a * D(w + 208);
        const int8_t *sc = (const int8_t *)(w + 192);
        for (int j = 0; j < 8; j++, y += PYRT_QK)
            for (int l = 0; l < PYRT_QK; l++)
                y[l] += ad * (float)sc[2 * j + l / 16] * (float)code_q6_k(w, j, l);
    }
}

static const pyrt_row_ops ops_q4_k_scalar = {.dot = dot_q4_k, .axpy = axpy_q4_k};
static const pyrt_row_ops ops_q5_k_scalar = {.dot = dot_q5_k, .axpy = axpy_q5_k};
static const pyrt_row_ops ops_q6_k_scalar = {.dot = dot_q6_k, .axpy = axpy_q6_k};

const pyrt_row_ops *pyrt_row_ops_kquant_scalar(int fmt) {
    return fmt == PYRT_FMT_Q4_K   ? &ops_q4_k_scalar
           : fmt == PYRT_FMT_Q5_K ? &ops_q5_k_scalar
                                  : &ops_q6_k_scalar;
}

/* ---- AVX2 ---------------------------------------------------------------------------------- */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "rows_x86.h"
#include "blocks_kquant_x86.h"

#define AVX2 PYRT_X86_AVX2

/* Sub-block j's 32 codes (uint8 0..15 / 0..31; Q6_K: int8 -32..31) in one register. */
AVX2 static inline __m256i codes_q4_k(const uint8_t *w, int j) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * (j / 2)));
    return _mm256_and_si256(_mm256_srli_epi16(raw, 4 * (j % 2)), _mm256_set1_epi8(0x0F));
}
AVX2 static inline __m256i codes_q5_k(const uint8_t *w, int j) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + 48 + 32 * (j / 2)));
    const __m256i lo =
        _mm256_and_si256(_mm256_srli_epi16(raw, 4 * (j % 2)), _mm256_set1_epi8(0x0F));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 16));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
}
/* Q6_K's codes plus 32 (uint8 0..63), and as they are (int8 -32..31). */
AVX2 static inline __m256i codes_q6_k_u(const uint8_t *w, int j) {
    const int h = j / 4, p = j % 4;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32 * (p % 2)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (p / 2)), _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
}
AVX2 static inline __m256i codes_q6_k(const uint8_t *w, int j) {
    return _mm256_sub_epi8(codes_q6_k_u(w, j), _mm256_set1_epi8(32));
}

/* Scales as int16 pairs: each int32 lane (v & 0xFFFF) | v << 16 for the int32 v in it, the
 * multiplier vpmaddwd applies to both int16 halves of the lane. */
AVX2 static inline __m256i scale_pairs8(__m256i v) {
    return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)),
                           _mm256_slli_epi32(v, 16));
}

/* 32 int8 codes as f32 in four registers (elements 0..7, 8..15, 16..23, 24..31). */
AVX2 static inline void widen32(__m256i q, __m256 f[4]) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

/* The kernels of each format come from one function over nr rows (1 or 2 for the dots, up to
 * PYRT_AXPY_ROWS for axpy): dot and axpy are its nr = 1 case, so dot2 / axpyn give exactly the
 * bits of two dots / nr axpys in order. dotn: per super-block and row the scales of its 8
 * sub-blocks as int16 pairs (scale_pairs8), kept in a small array and broadcast from it per
 * sub-block; x's blocks loaded once for the rows; per row int32 lanes of sc_j (q . x)
 * (vpmaddubsw, then vpmaddwd by sc_j), and the min term m_j sum(x_j) as one vpmaddwd of the
 * mins with x's sums per 16 (pyrt_xq_sums); both meet d xd and dmin xd once per super-block in
 * f32 (x's blocks share xd: pyrt_quantize_x_q8k).
 * axpyn: a block of y (4 registers) loaded once, each row's a (d sc_j) q - a (dmin m_j) added in
 * row order, stored once. */
#define AVX2_KMIN(name, BYTES, CODES)                                                              \
    AVX2 static inline void dotn_##name(int nr, const void *const *rows, const void *x, int n,     \
                                        float *out) {                                              \
        const pyrt_xq8 *xq = x;                                                                    \
        const int16_t *sums = pyrt_xq_sums(x, n);                                                  \
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                                \
        for (int s = 0; s < n / PYRT_QK_K; s++, xq += 8) {                                         \
            const uint8_t *w[2];                                                                   \
            int32_t sp[2][8]; /* sc_j pairs */                                                     \
            __m256i mins[2];                                                                       \
            __m256i ai[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};                      \
            _Pragma("GCC unroll 2") for (int r = 0; r < nr; r++) {                                 \
                w[r] = (const uint8_t *)rows[r] + (size_t)s * (BYTES);                             \
                const __m128i sm = pyrt_kq_sc_m_bytes(w[r]);                                       \
                _mm256_storeu_si256((__m256i *)sp[r], scale_pairs8(_mm256_cvtepu8_epi32(sm)));     \
                mins[r] = pyrt_kq_mins16(sm);                                                      \
            }                                                                                      \
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {                                  \
                const __m256i xv = _mm256_loadu_si256((const __m256i *)xq[j].q);                   \
                _Pragma("GCC unroll 2") for (int r = 0; r < nr; r++) {                             \
                    const __m256i p = _mm256_maddubs_epi16(CODES(w[r], j), xv);                    \
                    ai[r] = _mm256_add_epi32(                                                      \
                        ai[r], _mm256_madd_epi16(p, _mm256_set1_epi32(sp[r][j])));                 \
                }                                                                                  \
            }                                                                                      \
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(sums + 16 * s));               \
            _Pragma("GCC unroll 2") for (int r = 0; r < nr; r++) {                                 \
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(pyrt_load_u16(w[r])) * xq->d),   \
                                         _mm256_cvtepi32_ps(ai[r]), acc[r]);                       \
                acc[r] = _mm256_fnmadd_ps(                                                         \
                    _mm256_set1_ps(_cvtsh_ss(pyrt_load_u16(w[r] + 2)) * xq->d),                    \
                    _mm256_cvtepi32_ps(_mm256_madd_epi16(mins[r], bs)), acc[r]);                   \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 2") for (int r = 0; r < nr; r++)                                       \
            out[r] = hsum8(acc[r]);                                                                \
    }                                                                                              \
    AVX2 static float dot_##name##_avx2(const void *row, const void *x, int n) {                   \
        float out;                                                                                 \
        dotn_##name(1, &row, x, n, &out);                                                          \
        return out;                                                                                \
    }                                                                                              \
    AVX2 static void dot2_##name##_avx2(const void *row0, const void *row1, const void *x, int n,  \
                                        float out[2]) {                                            \
        const void *rows[2] = {row0, row1};                                                        \
        dotn_##name(2, rows, x, n, out);                                                           \
    }                                                                                              \
    AVX2 static void axpyn_##name##_avx2(int nr, const float *a, const void *const *rows,          \
                                         float *y, int n) {                                        \
        float vs[PYRT_AXPY_ROWS][8], vm[PYRT_AXPY_ROWS][8];                                        \
        for (int s = 0; s < n / PYRT_QK_K; s++) {                                                  \
            for (int r = 0; r < nr; r++) {                                                         \
                __m256 dsc, dm;                                                                    \
                pyrt_kq_scales_mins((const uint8_t *)rows[r] + (size_t)s * (BYTES), &dsc, &dm);    \
                _mm256_storeu_ps(vs[r], _mm256_mul_ps(_mm256_set1_ps(a[r]), dsc));                 \
                _mm256_storeu_ps(vm[r], _mm256_mul_ps(_mm256_set1_ps(a[r]), dm));                  \
            }                                                                                      \
            for (int j = 0; j < 8; j++) {                                                          \
                float *yj = y + (size_t)s * PYRT_QK_K + PYRT_QK * j;                               \
                __m256 acc[4] = {_mm256_loadu_ps(yj), _mm256_loadu_ps(yj + 8),                     \
                                 _mm256_loadu_ps(yj + 16), _mm256_loadu_ps(yj + 24)};              \
                for (int r = 0; r < nr; r++) {                                                     \
                    const uint8_t *w = (const uint8_t *)rows[r] + (size_t)s * (BYTES);             \
                    const __m256 s_ = _mm256_broadcast_ss(&vs[r][j]);                              \
                    const __m256 m_ = _mm256_broadcast_ss(&vm[r][j]);                              \
                    __m256 f[4];                                                                   \
                    widen32(CODES(w, j), f);                                                       \
                    for (int p = 0; p < 4; p++)                                                    \
                        acc[p] = _mm256_sub_ps(_mm256_fmadd_ps(s_, f[p], acc[p]), m_);             \
                }                                                                                  \
                for (int p = 0; p < 4; p++)                                                        \
                    _mm256_storeu_ps(yj + 8 * p, acc[p]);                                          \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    AVX2 static void axpy_##name##_avx2(float a, const void *row, float *y, int n) {               \
        axpyn_##name##_avx2(1, &a, &row, y, n);                                                    \
    }

AVX2_KMIN(q4_k, PYRT_Q4_K_BYTES, codes_q4_k)
AVX2_KMIN(q5_k, PYRT_Q5_K_BYTES, codes_q5_k)

/* Q6_K's 16 scales times d, as f32 (one per 16 elements). */
AVX2 static inline void scales_q6_k(const uint8_t *w, float out[16]) {
    const __m128i sc = _mm_loadu_si128((const __m128i *)(w + 192));
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(pyrt_load_u16(w + 208)));
    const __m256i lo = _mm256_cvtepi8_epi32(sc), hi = _mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8));
    _mm256_storeu_ps(out, _mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(hi)));
}

/* Q6_K: the codes read unsigned (q + 32), (q + 32) . x per int16 pair (<= 2 * 63 * 127: no
 * saturation) times its scale of 16 by vpmaddwd (lanes 0..3: elements 0..15 of the sub-block,
 * 4..7: 16..31), summed in int32 per super-block, less 32 sum_i sc_i sum(x_i) (one vpmaddwd of
 * the 16 scales with x's sums per 16, pyrt_xq_sums): exactly sum sc q x, times d xd in f32. */
AVX2 static inline void dotn_q6_k(int nr, const void *const *rows, const void *x, int n,
                                  float *out) {
    const pyrt_xq8 *xq = x;
    const int16_t *sums = pyrt_xq_sums(x, n);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int s = 0; s < n / PYRT_QK_K; s++, xq += 8) {
        const uint8_t *w[2];
        int32_t sp[2][16]; /* the 16 scales as int16 pairs */
        __m256i sc16[2];   /* and as int16 */
        __m256i ai[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        _Pragma("GCC unroll 2") for (int r = 0; r < nr; r++) {
            w[r] = (const uint8_t *)rows[r] + (size_t)s * PYRT_Q6_K_BYTES;
            const __m128i sc = _mm_loadu_si128((const __m128i *)(w[r] + 192));
            _mm256_storeu_si256((__m256i *)sp[r], scale_pairs8(_mm256_cvtepi8_epi32(sc)));
            _mm256_storeu_si256((__m256i *)(sp[r] + 8),
                                scale_pairs8(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
            sc16[r] = _mm256_cvtepi8_epi16(sc);
        }
        _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)xq[j].q);
            _Pragma("GCC unroll 2") for (int r = 0; r < nr; r++) {
                const __m256i p = _mm256_maddubs_epi16(codes_q6_k_u(w[r], j), xv);
                const __m256i sj = _mm256_set_m128i(_mm_set1_epi32(sp[r][2 * j + 1]),
                                                    _mm_set1_epi32(sp[r][2 * j]));
                ai[r] = _mm256_add_epi32(ai[r], _mm256_madd_epi16(p, sj));
            }
        }
        const __m256i bs = _mm256_loadu_si256((const __m256i *)(sums + 16 * s));
        _Pragma("GCC unroll 2") for (int r = 0; r < nr; r++) {
            const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(sc16[r], bs), 5);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(pyrt_load_u16(w[r] + 208)) * xq->d),
                                     _mm256_cvtepi32_ps(_mm256_sub_epi32(ai[r], off)), acc[r]);
        }
    }
    _Pragma("GCC unroll 2") for (int r = 0; r < nr; r++)
        out[r] = hsum8(acc[r]);
}

AVX2 static float dot_q6_k_avx2(const void *row, const void *x, int n) {
    float out;
    dotn_q6_k(1, &row, x, n, &out);
    return out;
}

AVX2 static void dot2_q6_k_avx2(const void *row0, const void *row1, const void *x, int n,
                                float out[2]) {
    const void *rows[2] = {row0, row1};
    dotn_q6_k(2, rows, x, n, out);
}

AVX2 static void axpyn_q6_k_avx2(int nr, const float *a, const void *const *rows, float *y,
                                 int n) {
    float vs[PYRT_AXPY_ROWS][16]; /* a (d sc) per 16 elements */
    for (int s = 0; s < n / PYRT_QK_K; s++) {
        for (int r = 0; r < nr; r++) {
            scales_q6_k((const uint8_t *)rows[r] + (size_t)s * PYRT_Q6_K_BYTES, vs[r]);
            const __m256 va = _mm256_set1_ps(a[r]);
            _mm256_storeu_ps(vs[r], _mm256_mul_ps(va, _mm256_loadu_ps(vs[r])));
            _mm256_storeu_ps(vs[r] + 8, _mm256_mul_ps(va, _mm256_loadu_ps(vs[r] + 8)));
        }
        for (int j = 0; j < 8; j++) {
            float *yj = y + (size_t)s * PYRT_QK_K + PYRT_QK * j;
            __m256 acc[4] = {_mm256_loadu_ps(yj), _mm256_loadu_ps(yj + 8), _mm256_loadu_ps(yj + 16),
                             _mm256_loadu_ps(yj + 24)};
            for (int r = 0; r < nr; r++) {
                const uint8_t *w = (const uint8_t *)rows[r] + (size_t)s * PYRT_Q6_K_BYTES;
                __m256 f[4];
                widen32(codes_q6_k(w, j), f);
                for (int p = 0; p < 4; p++)
                    acc[p] = _mm256_fmadd_ps(_mm256_broadcast_ss(&vs[r][2 * j + p / 2]), f[p],
                                             acc[p]);
            }
            for (int p = 0; p < 4; p++)
                _mm256_storeu_ps(yj + 8 * p, acc[p]);
        }
    }
}

AVX2 static void axpy_q6_k_avx2(float a, const void *row, float *y, int n) {
    axpyn_q6_k_avx2(1, &a, &row, y, n);
}

#define K_OPS(name)                                                                               \
    static const pyrt_row_ops ops_##name##_avx2 = {.dot = dot_##name##_avx2,                      \
                                                   .axpy = axpy_##name##_avx2,                    \
                                                   .dot2 = dot2_##name##_avx2,                    \
                                                   .axpyn = axpyn_##name##_avx2};
K_OPS(q4_k)
K_OPS(q5_k)
K_OPS(q6_k)

const pyrt_row_ops *pyrt_row_ops_kquant_avx2(int fmt) {
    return fmt == PYRT_FMT_Q4_K   ? &ops_q4_k_avx2
           : fmt == PYRT_FMT_Q5_K ? &ops_q5_k_avx2
                                  : &ops_q6_k_avx2;
}

#else /* not x86-64: the scalar kernels stand in (cpu.c never selects an x86 level) */

const pyrt_row_ops *pyrt_row_ops_kquant_avx2(int fmt) {
    return pyrt_row_ops_kquant_scalar(fmt);
}

#endif

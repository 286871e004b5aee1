/* Q4_K, Q5_K and Q6_K down rows with int8 multipliers (AVX-512 VNNI): y[0:n) += sum_r a[r] rows[r]
 * for up to PYRT_AXPY_ROWS rows in one pass, the expert down projection of a decode step. The
 * float axpyn (rows_kquant_avx512.c) spends a code conversion (Q4_K: a lookup) and an add or FMA
 * per weight, per row; here the rows' codes meet integer multipliers in vpdpbusd, 4 rows per
 * int32 lane, and y meets two conversions and two FMAs per element per pass of 8 rows.
 *
 * Per super-block s and sub-block j (Q4_K, Q5_K: 32 elements, Q6_K: 16), row r's weights are
 * (d sc_j) q - (dmin m_j), q in 0..15 (Q5_K: 0..31; Q6_K: d sc_j (q - 32), q in 0..63, so
 * dmin m_j = 32 d sc_j), so the pass adds to y[32 j + i] (Q6_K: y[16 j + i])
 *     sum_r c_rj q_ri - sum_r a_r dmin_r m_rj,    c_rj = a_r d_r sc_rj.
 * The second sum is computed in f32 as it stands. The first takes c_rj in two int8 parts against
 * the pass's scale for sub-block j, S_j = max_r |c_rj| / 127: c_rj ~ S_j (k_rj + k'_rj / 254)
 * (k: c / S rounded, k': the remainder in steps of S / 254), each part's sum exact in int32
 * (|sum| <= 8 * 127 * 63 * 4), then times its step in f32. Error: |c_rj - S_j (k + k' / 254)|
 * <= S_j / 508 per row (plus the f32 rounding of the remainder), so |dy| <= (S_j / 500) sum_r q_ri
 * per element beside f32 rounding (the bound tests/c/test_core.c checks). One part alone (error
 * S_j / 2 per row) measured 1.15x this one's speed, but moved a Q4_K_M model's decode away from
 * its prefill (float axpy) by a mean KL of 3e-6, above the 1e-6 the two paths are held to.
 *
 * Layout: 64 bytes of each of 4 rows, their dwords transposed 4 x 4 across 128-bit lanes (vpermd),
 * then interleaved by unpacks (in 128-bit lanes) into X_0..X_3: X_q holds bytes 16 q .. 16 q + 15
 * of each row in order, the 4 rows' bytes of an element in one int32 lane. Q4_K: the bytes are a
 * 64-byte piece of qs (qs[64 p ..]: sub-blocks 4p, 4p + 1 in the low and high nibbles of its bytes
 * 0..31, 4p + 2, 4p + 3 in those of 32..63), the high nibbles used in place (x & 0xF0 = 16 q:
 * their sums 16x, their steps a 16th); Q5_K, Q6_K: 64 codes (elements 64 p ..) as the dots unpack
 * them (blocks_kquant_avx512.h).
 *
 * pf, n_pf: cache lines to prefetch (pyrt_pf_line), spread over the pass's pieces (axpyn_pf's). */
#include "rows.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "blocks_kquant_avx512.h"
#include "blocks_kquant_x86.h"

#define INLINE __attribute__((always_inline)) inline

enum { GROUP = 4 }; /* rows per int32 lane of vpdpbusd */

AVX512VNNI static INLINE __m512 join256_ps(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

/* The high 256 bits of v. */
AVX512VNNI static INLINE __m256 high256_ps(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* c as two int8 parts against S (inv = 1 / S): c ~ S (k + k' / 254), k = round(c / S) in
 * -127..127, k' = round(254 (c - S k) / S) in -127..127 (|c - S k| <= S / 2); each part's 16
 * lanes as int32. */
AVX512VNNI static INLINE void two_parts(__m512 c, __m512 scale, __m512 inv, __m512i out[2]) {
    const __m512i k = _mm512_cvtps_epi32(_mm512_mul_ps(c, inv));
    const __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(k), scale, c);
    const __m512 inv254 = _mm512_mul_ps(inv, _mm512_set1_ps(254.0f));
    out[0] = k;
    out[1] = _mm512_cvtps_epi32(_mm512_mul_ps(rest, inv254));
}

/* In-lane byte shuffle: a 4 x 4 transpose of each 128-bit lane's bytes (rows 0..3's runs of 4 ->
 * dword t holding byte t of each run, row r in byte r). */
AVX512VNNI static INLINE __m512i transpose_4x4_bytes(__m512i v) {
    return _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13,
                                                                       2, 6, 10, 14, 3, 7, 11, 15)));
}

/* Q4_K: rows 4g .. 4g + 3's c, two rows per register (lanes 0..7 row 2h, 8..15 row 2h + 1, one
 * per sub-block) -> k[part][j], sub-block j's 4 int8 (rows 4g .. 4g + 3) of that part. Packed to
 * bytes by saturating packs (|k| <= 127: exact): dword D of the result holds 4 sub-blocks of one
 * row and part (D 0..3: part 0 row 0, part 0 row 2, part 1 row 0, part 1 row 2 for j 0..3; 4..7
 * the same for j 4..7; 8..15 rows 1 and 3); one dword permute gathers each (part, 4 sub-blocks)'s
 * 4 rows into a 128-bit lane, the transpose puts them in one dword per sub-block. */
AVX512VNNI static INLINE void multipliers_8(const __m512 c[2], __m512 scale, __m512 inv,
                                            int32_t k[2][8]) {
    __m512i b01[2], b23[2];
    two_parts(c[0], scale, inv, b01);
    two_parts(c[1], scale, inv, b23);
    const __m512i bytes = _mm512_packs_epi16(_mm512_packs_epi32(b01[0], b23[0]),
                                             _mm512_packs_epi32(b01[1], b23[1]));
    const __m512i by_lane =
        _mm512_setr_epi32(0, 8, 1, 9, 4, 12, 5, 13, 2, 10, 3, 11, 6, 14, 7, 15);
    _mm512_storeu_si512((void *)k,
                        transpose_4x4_bytes(_mm512_permutexvar_epi32(by_lane, bytes)));
}

/* Q6_K: rows 4g .. 4g + 3's c, one row per register (a lane per sub-block of 16) -> k[part][j].
 * The 4 rows' parts packed to bytes by two saturating packs (|k| <= 127: exact), which leave
 * 128-bit lane L as rows 0..3's j = 4L .. 4L + 3 in runs of 4 bytes; one in-lane byte shuffle
 * (a 4 x 4 transpose) puts row r of sub-block j in byte r of dword j: 3 shuffle-port operations
 * a part, not 4 two-uop truncations and 4 unpacks. */
AVX512VNNI static INLINE void multipliers_16(const __m512 c[4], __m512 scale, __m512 inv,
                                             int32_t k[2][16]) {
    __m512i b[4][2];
    for (int r = 0; r < 4; r++)
        two_parts(c[r], scale, inv, b[r]);
    for (int part = 0; part < 2; part++) {
        const __m512i p01 = _mm512_packs_epi32(b[0][part], b[1][part]);
        const __m512i p23 = _mm512_packs_epi32(b[2][part], b[3][part]);
        const __m512i bytes = _mm512_packs_epi16(p01, p23);
        _mm512_storeu_si512((void *)k[part], transpose_4x4_bytes(bytes));
    }
}

/* 127 / max |c| per lane, 0 where every c is 0. */
AVX512VNNI static INLINE __m512 inverse_scale(__m512 amax) {
    const __mmask16 live = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
    return _mm512_maskz_div_ps(live, _mm512_set1_ps(127.0f), amax);
}

/* 4 rows' 64 bytes each -> x[q]: bytes 16 q .. 16 q + 15 of every row in order, the rows' bytes
 * of an element in one int32 lane (row r in byte r). */
AVX512VNNI static INLINE void interleave_4(const __m512i r[4], __m512i x[4]) {
    /* dword t of 128-bit lane L <- dword 4 t + L, so that the in-lane unpacks give order */
    const __m512i spread =
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512i s[4];
    for (int i = 0; i < 4; i++)
        s[i] = _mm512_permutexvar_epi32(spread, r[i]);
    const __m512i p01l = _mm512_unpacklo_epi8(s[0], s[1]), p01h = _mm512_unpackhi_epi8(s[0], s[1]);
    const __m512i p23l = _mm512_unpacklo_epi8(s[2], s[3]), p23h = _mm512_unpackhi_epi8(s[2], s[3]);
    x[0] = _mm512_unpacklo_epi16(p01l, p23l);
    x[1] = _mm512_unpackhi_epi16(p01l, p23l);
    x[2] = _mm512_unpacklo_epi16(p01h, p23h);
    x[3] = _mm512_unpackhi_epi16(p01h, p23h);
}

/* y[0:16) += step1 sum1 + step2 sum2 - min: 16 elements of one sub-block. */
AVX512VNNI static INLINE void add_run(float *y, __m512i sum1, __m512i sum2, float step1,
                                      float step2, float min) {
    __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum1), _mm512_set1_ps(step1), _mm512_loadu_ps(y));
    v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum2), _mm512_set1_ps(step2), v);
    _mm512_storeu_ps(y, _mm512_sub_ps(v, _mm512_set1_ps(min)));
}

/* The rows of a pass: nr real ones, then row 0 at multiplier 0 up to whole groups of 4. */
static int pass_rows(int nr, const float *a, const void *const *rows, const uint8_t **w,
                     float *av) {
    const int ng = nr > GROUP ? 2 : 1;
    for (int r = 0; r < GROUP * ng; r++) {
        w[r] = (const uint8_t *)rows[r < nr ? r : 0];
        av[r] = r < nr ? a[r] : 0.0f;
    }
    return ng;
}

/* Q4_K / Q5_K (one scale and one min per sub-block of 32): c_rj = a_r d_r sc_rj, two rows a
 * register [GROUP * ng / 2], the sum over the rows of a_r dmin_r m_rj, and max |c_rj| per j.
 * Two rows at a time in 512 bits (lanes 0..7 row 2h, 8..15 row 2h + 1): their scale and min bytes
 * from one vector unpack each (pyrt_kq_sc_m_from), their d and dmin by one vcvtph2ps, spread
 * over the lanes by vpermps; the min sums and maxima of the two halves joined at the end. */
AVX512VNNI static INLINE void scales_mins_pass(const uint8_t *const *w, size_t at, const float *av,
                                               int ng, __m512 *c, __m256 *mins, __m256 *amax) {
    const __m512i lane_d = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i lane_m = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3);
    __m512 m2 = _mm512_setzero_ps(), x2 = _mm512_setzero_ps();
    for (int h = 0; h < GROUP * ng / 2; h++) {
        const __m128i h0 = _mm_loadu_si128((const __m128i *)(w[2 * h] + at));
        const __m128i h1 = _mm_loadu_si128((const __m128i *)(w[2 * h + 1] + at));
        const __m128i sm0 = pyrt_kq_sc_m_from(h0), sm1 = pyrt_kq_sc_m_from(h1);
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(sm0, sm1)));
        const __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi64(sm0, sm1)));
        /* a_r d_r, a_r dmin_r of both rows: (d0, dmin0, d1, dmin1) times (a0, a0, a1, a1) */
        const __m128 a01 = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(av + 2 * h)));
        const __m128 ad = _mm_mul_ps(_mm_cvtph_ps(_mm_unpacklo_epi32(h0, h1)),
                                     _mm_unpacklo_ps(a01, a01));
        const __m512 ad512 = _mm512_castps128_ps512(ad);
        c[h] = _mm512_mul_ps(sc, _mm512_permutexvar_ps(lane_d, ad512));
        m2 = _mm512_fmadd_ps(m, _mm512_permutexvar_ps(lane_m, ad512), m2);
        x2 = _mm512_max_ps(x2, _mm512_abs_ps(c[h]));
    }
    *mins = _mm256_add_ps(_mm512_castps512_ps256(m2), high256_ps(m2));
    *amax = _mm256_max_ps(_mm512_castps512_ps256(x2), high256_ps(x2));
}

AVX512VNNI void pyrt_axpyn_i8_q4_k(int nr, const float *a, const void *const *rows, float *y,
                                   int n, const void *const *pf, int n_pf) {
    const uint8_t *w[PYRT_AXPY_ROWS];
    float av[PYRT_AXPY_ROWS];
    const int ng = pass_rows(nr, a, rows, w, av);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    pyrt_pf_spread spread = pyrt_pf_begin(pf, n_pf, n / PYRT_QK_K * 2);
    for (int s = 0; s < n / PYRT_QK_K; s++) {
        const size_t at = (size_t)s * PYRT_Q4_K_BYTES;
        /* c_rj (two rows per register), the sum of the min terms, and max |c_rj| per j */
        __m512 c[PYRT_AXPY_ROWS / 2];
        __m256 mins, amax;
        scales_mins_pass(w, at, av, ng, c, &mins, &amax);
        /* the steps of k and k' for the low nibbles' sums, S_j and S_j / 254, and for the high
         * ones' (their codes read as 16 q) a 16th of those; the sums of the min terms */
        const __m256 scale = _mm256_mul_ps(amax, _mm256_set1_ps(1.0f / 127.0f));
        float step[4][8], min[8];
        _mm256_storeu_ps(step[0], scale);
        _mm256_storeu_ps(step[1], _mm256_mul_ps(scale, _mm256_set1_ps(1.0f / 254.0f)));
        _mm256_storeu_ps(step[2], _mm256_mul_ps(scale, _mm256_set1_ps(1.0f / 16.0f)));
        _mm256_storeu_ps(step[3], _mm256_mul_ps(scale, _mm256_set1_ps(1.0f / (16.0f * 254.0f))));
        _mm256_storeu_ps(min, mins);
        const __m512 inv = inverse_scale(join256_ps(amax, amax));
        int32_t k[2][2][8]; /* group g's multipliers of sub-block j: 4 int8, then their k' */
        for (int g = 0; g < ng; g++)
            multipliers_8(c + 2 * g, join256_ps(scale, scale), inv, k[g]);
        for (int p = 0; p < 2; p++) { /* the 64-byte pieces: sub-blocks 4p .. 4p + 3 */
            /* X_q's low nibbles (sub-block 4p + 2 (q / 2)) times k and k', its high ones' */
            __m512i lo[4], hi[4], lo2[4], hi2[4];
            for (int q = 0; q < 4; q++)
                lo[q] = hi[q] = lo2[q] = hi2[q] = _mm512_setzero_si512();
            for (int g = 0; g < ng; g++) {
                __m512i rw[GROUP], x[4];
                for (int r = 0; r < GROUP; r++)
                    rw[r] = _mm512_loadu_si512((const void *)(w[GROUP * g + r] + at + 16 + 64 * p));
                interleave_4(rw, x);
                for (int q = 0; q < 4; q++) { /* high nibbles as 16 q: no shift */
                    const int j = 4 * p + 2 * (q / 2);
                    const __m512i ql = _mm512_and_si512(x[q], m4);
                    const __m512i qh = _mm512_andnot_si512(m4, x[q]);
                    lo[q] = _mm512_dpbusd_epi32(lo[q], ql, _mm512_set1_epi32(k[g][0][j]));
                    lo2[q] = _mm512_dpbusd_epi32(lo2[q], ql, _mm512_set1_epi32(k[g][1][j]));
                    hi[q] = _mm512_dpbusd_epi32(hi[q], qh, _mm512_set1_epi32(k[g][0][j + 1]));
                    hi2[q] = _mm512_dpbusd_epi32(hi2[q], qh, _mm512_set1_epi32(k[g][1][j + 1]));
                }
            }
            for (int q = 0; q < 4; q++) { /* elements 16 (q % 2) .. of sub-blocks j, j + 1 */
                const int j = 4 * p + 2 * (q / 2);
                float *yl = y + (size_t)s * PYRT_QK_K + 32 * j + 16 * (q % 2);
                add_run(yl, lo[q], lo2[q], step[0][j], step[1][j], min[j]);
                add_run(yl + 32, hi[q], hi2[q], step[2][j + 1], step[3][j + 1], min[j + 1]);
            }
            pyrt_pf_tick(&spread);
        }
    }
    pyrt_pf_end(&spread);
}

/* Q5_K: Q4_K's scales and mins, 64 codes (0..31) per piece as Q6_K's (elements 64 p ..: sub-blocks
 * 2p, 2p + 1). */
AVX512VNNI void pyrt_axpyn_i8_q5_k(int nr, const float *a, const void *const *rows, float *y,
                                   int n, const void *const *pf, int n_pf) {
    const uint8_t *w[PYRT_AXPY_ROWS];
    float av[PYRT_AXPY_ROWS];
    const int ng = pass_rows(nr, a, rows, w, av);
    pyrt_pf_spread spread = pyrt_pf_begin(pf, n_pf, n / PYRT_QK_K * 4);
    for (int s = 0; s < n / PYRT_QK_K; s++) {
        const size_t at = (size_t)s * PYRT_Q5_K_BYTES;
        __m512 c[PYRT_AXPY_ROWS / 2];
        __m256 mins, amax;
        scales_mins_pass(w, at, av, ng, c, &mins, &amax);
        const __m256 scale = _mm256_mul_ps(amax, _mm256_set1_ps(1.0f / 127.0f));
        float step[2][8], min[8];
        _mm256_storeu_ps(step[0], scale);
        _mm256_storeu_ps(step[1], _mm256_mul_ps(scale, _mm256_set1_ps(1.0f / 254.0f)));
        _mm256_storeu_ps(min, mins);
        const __m512 inv = inverse_scale(join256_ps(amax, amax));
        int32_t k[2][2][8];
        for (int g = 0; g < ng; g++)
            multipliers_8(c + 2 * g, join256_ps(scale, scale), inv, k[g]);
        for (int p = 0; p < 4; p++) {
            __m512i s1[4], s2[4];
            for (int q = 0; q < 4; q++)
                s1[q] = s2[q] = _mm512_setzero_si512();
            for (int g = 0; g < ng; g++) {
                __m512i rw[GROUP], x[4];
                for (int r = 0; r < GROUP; r++)
                    rw[r] = codes_q5_k(w[GROUP * g + r] + at, p);
                interleave_4(rw, x);
                for (int q = 0; q < 4; q++) {
                    const int j = 2 * p + q / 2;
                    s1[q] = _mm512_dpbusd_epi32(s1[q], x[q], _mm512_set1_epi32(k[g][0][j]));
                    s2[q] = _mm512_dpbusd_epi32(s2[q], x[q], _mm512_set1_epi32(k[g][1][j]));
                }
            }
            for (int q = 0; q < 4; q++) {
                const int j = 2 * p + q / 2;
                add_run(y + (size_t)s * PYRT_QK_K + 64 * p + 16 * q, s1[q], s2[q], step[0][j],
                        step[1][j], min[j]);
            }
            pyrt_pf_tick(&spread);
        }
    }
    pyrt_pf_end(&spread);
}

AVX512VNNI void pyrt_axpyn_i8_q6_k(int nr, const float *a, const void *const *rows, float *y,
                                   int n, const void *const *pf, int n_pf) {
    const uint8_t *w[PYRT_AXPY_ROWS];
    float av[PYRT_AXPY_ROWS];
    const int ng = pass_rows(nr, a, rows, w, av);
    pyrt_pf_spread spread = pyrt_pf_begin(pf, n_pf, n / PYRT_QK_K * 4);
    for (int s = 0; s < n / PYRT_QK_K; s++) {
        const size_t at = (size_t)s * PYRT_Q6_K_BYTES;
        /* c_rj = a_r d_r sc_rj (a register per row, a lane per sub-block of 16), their sum (the
         * -32 offset's term is 32 times it) and max |c_rj| per j */
        __m512 c[PYRT_AXPY_ROWS], sum = _mm512_setzero_ps(), amax = _mm512_setzero_ps();
        for (int r = 0; r < GROUP * ng; r++) {
            const uint8_t *b = w[r] + at;
            const __m512 sc = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192))));
            c[r] = _mm512_mul_ps(_mm512_set1_ps(av[r] * _cvtsh_ss(pyrt_load_u16(b + 208))), sc);
            sum = _mm512_add_ps(sum, c[r]);
            amax = _mm512_max_ps(amax, _mm512_abs_ps(c[r]));
        }
        const __m512 scale = _mm512_mul_ps(amax, _mm512_set1_ps(1.0f / 127.0f));
        float step[2][16], min[16];
        _mm512_storeu_ps(step[0], scale);
        _mm512_storeu_ps(step[1], _mm512_mul_ps(scale, _mm512_set1_ps(1.0f / 254.0f)));
        _mm512_storeu_ps(min, _mm512_mul_ps(sum, _mm512_set1_ps(32.0f)));
        const __m512 inv = inverse_scale(amax);
        int32_t k[2][2][16]; /* group g's multipliers of sub-block j: 4 int8, then their k' */
        for (int g = 0; g < ng; g++)
            multipliers_16(c + GROUP * g, scale, inv, k[g]);
        for (int p = 0; p < 4; p++) { /* elements 64 p .. 64 p + 63: sub-blocks 4p .. 4p + 3 */
            __m512i s1[4], s2[4];
            for (int q = 0; q < 4; q++)
                s1[q] = s2[q] = _mm512_setzero_si512();
            for (int g = 0; g < ng; g++) {
                __m512i rw[GROUP], x[4];
                for (int r = 0; r < GROUP; r++)
                    rw[r] = codes_q6_k(w[GROUP * g + r] + at, p);
                interleave_4(rw, x);
                for (int q = 0; q < 4; q++) {
                    s1[q] = _mm512_dpbusd_epi32(s1[q], x[q], _mm512_set1_epi32(k[g][0][4 * p + q]));
                    s2[q] = _mm512_dpbusd_epi32(s2[q], x[q], _mm512_set1_epi32(k[g][1][4 * p + q]));
                }
            }
            for (int q = 0; q < 4; q++) {
                const int j = 4 * p + q;
                add_run(y + (size_t)s * PYRT_QK_K + 16 * j, s1[q], s2[q], step[0][j], step[1][j],
                        min[j]);
            }
            pyrt_pf_tick(&spread);
        }
    }
    pyrt_pf_end(&spread);
}

#endif

/* Q4_K down rows with int8 multipliers (AVX-512 VNNI): y[0:n) += sum_r a[r] rows[r] for up to
 * PYRT_AXPY_ROWS rows in one pass, the expert down projection of a decode step. The float axpyn
 * (rows_kquant_avx512.c) spends a code conversion (a lookup) and an add per weight, per row; here
 * the rows' codes meet integer multipliers in vpdpbusd, 4 rows per int32 lane, and y meets two
 * conversions and two FMAs per element per pass of 8 rows.
 *
 * Per super-block s and sub-block j (32 elements), row r's weights are (d sc_j) q - (dmin m_j),
 * q in 0..15, so the pass adds to y[32 j + i]
 *     sum_r c_rj q_ri - sum_r a_r dmin_r m_rj,    c_rj = a_r d_r sc_rj.
 * The second sum is computed in f32 as it stands. The first takes c_rj in two int8 parts against
 * the pass's scale for sub-block j, S_j = max_r |c_rj| / 127: c_rj ~ S_j (k_rj + k'_rj / 254)
 * (k: c / S rounded, k': the remainder in steps of S / 254), each part's sum exact in int32
 * (|sum| <= 8 * 127 * 15 * 16), then times its step in f32. Error: |c_rj - S_j (k + k' / 254)|
 * <= S_j / 508 per row (plus the f32 rounding of the remainder), so |dy| <= (S_j / 500) sum_r q_ri
 * per element beside f32 rounding (the bound tests/c/test_core.c checks). One part alone (error
 * S_j / 2 per row) measured 1.15x this one's speed, but moved a Q4_K_M model's decode away from
 * its prefill (float axpy) by a mean KL of 3e-6, above the 1e-6 the two paths are held to.
 *
 * Layout: a 64-byte piece of a row's codes (qs bytes 64 p .. 64 p + 63) holds sub-blocks 4p,
 * 4p + 1 (low and high nibbles of bytes 0..31) and 4p + 2, 4p + 3 (bytes 32..63). Each row's
 * piece has its dwords transposed 4 x 4 across 128-bit lanes (vpermd); then unpacks (in 128-bit
 * lanes) interleave 4 rows' pieces into X_0..X_3, X_q holding bytes 16 q .. 16 q + 15 of each row
 * in order, 4 rows' bytes of an element in one int32 lane. The high nibbles are used in place
 * (x & 0xF0 = 16 q): their sums are 16x, their steps a 16th. */
#include "rows.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "blocks_avx512.h"
#include "blocks_kquant_x86.h"

#define INLINE __attribute__((always_inline)) inline

enum { GROUP = 4 }; /* rows per int32 lane of vpdpbusd */

AVX512VNNI static INLINE __m512 join256_ps(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

/* Rows 4g .. 4g + 3's c (two rows per register: lanes 0..7 row 2h, 8..15 row 2h + 1, one lane
 * per sub-block) as two int8 parts against S (inv = 1 / S): c ~ S (k + k' / 254), k = round(c /
 * S) in -127..127, k' = round(254 (c - S k) / S) in -127..127 (|c - S k| <= S / 2). Int32 lane j
 * (sub-block j) of k[0] holds (k_0j, k_1j, k_2j, k_3j), of k[1] the k'. */
AVX512VNNI static INLINE void group_multipliers(__m512 c01, __m512 c23, __m512 scale, __m512 inv,
                                                int32_t k[2][8]) {
    const __m512i k01 = _mm512_cvtps_epi32(_mm512_mul_ps(c01, inv));
    const __m512i k23 = _mm512_cvtps_epi32(_mm512_mul_ps(c23, inv));
    const __m512 inv254 = _mm512_mul_ps(inv, _mm512_set1_ps(254.0f));
    const __m512 r01 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(k01), scale, c01);
    const __m512 r23 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(k23), scale, c23);
    const __m128i b01[2] = {_mm512_cvtepi32_epi8(k01),
                            _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(r01, inv254)))};
    const __m128i b23[2] = {_mm512_cvtepi32_epi8(k23),
                            _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(r23, inv254)))};
    for (int part = 0; part < 2; part++) {
        const __m128i p01 = _mm_unpacklo_epi8(b01[part], _mm_srli_si128(b01[part], 8));
        const __m128i p23 = _mm_unpacklo_epi8(b23[part], _mm_srli_si128(b23[part], 8));
        _mm_storeu_si128((__m128i *)k[part], _mm_unpacklo_epi16(p01, p23));
        _mm_storeu_si128((__m128i *)(k[part] + 4), _mm_unpackhi_epi16(p01, p23));
    }
}

AVX512VNNI void pyrt_axpyn_i8_q4_k(int nr, const float *a, const void *const *rows, float *y,
                                   int n) {
    const uint8_t *w[PYRT_AXPY_ROWS];
    float av[PYRT_AXPY_ROWS];
    const int ng = nr > GROUP ? 2 : 1;
    for (int r = 0; r < GROUP * ng; r++) { /* missing rows: row 0 at multiplier 0 */
        w[r] = (const uint8_t *)rows[r < nr ? r : 0];
        av[r] = r < nr ? a[r] : 0.0f;
    }
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int s = 0; s < n / PYRT_QK_K; s++) {
        const size_t at = (size_t)s * PYRT_Q4_K_BYTES;
        /* c_rj (two rows per register), the sum of the min terms, and max |c_rj| per j */
        __m512 c[PYRT_AXPY_ROWS / 2];
        __m256 mins = _mm256_setzero_ps(), amax = _mm256_setzero_ps();
        for (int h = 0; h < GROUP * ng / 2; h++) {
            __m256 dsc0, dm0, dsc1, dm1;
            pyrt_kq_scales_mins(w[2 * h] + at, &dsc0, &dm0);
            pyrt_kq_scales_mins(w[2 * h + 1] + at, &dsc1, &dm1);
            const __m256 a0 = _mm256_set1_ps(av[2 * h]), a1 = _mm256_set1_ps(av[2 * h + 1]);
            const __m256 c0 = _mm256_mul_ps(a0, dsc0), c1 = _mm256_mul_ps(a1, dsc1);
            mins = _mm256_fmadd_ps(a1, dm1, _mm256_fmadd_ps(a0, dm0, mins));
            const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
            amax = _mm256_max_ps(amax, _mm256_max_ps(_mm256_and_ps(c0, abs),
                                                     _mm256_and_ps(c1, abs)));
            c[h] = join256_ps(c0, c1);
        }
        /* the steps of k and k' for the low nibbles' sums, S_j and S_j / 254, and for the high
         * ones' (their codes read as 16 q) a 16th of those; the sums of the min terms */
        const __m256 scale8 = _mm256_mul_ps(amax, _mm256_set1_ps(1.0f / 127.0f));
        float step[4][8], min[8];
        _mm256_storeu_ps(step[0], scale8);
        _mm256_storeu_ps(step[1], _mm256_mul_ps(scale8, _mm256_set1_ps(1.0f / 254.0f)));
        _mm256_storeu_ps(step[2], _mm256_mul_ps(scale8, _mm256_set1_ps(1.0f / 16.0f)));
        _mm256_storeu_ps(step[3], _mm256_mul_ps(scale8, _mm256_set1_ps(1.0f / (16.0f * 254.0f))));
        _mm256_storeu_ps(min, mins);
        /* 127 / max |c|, 0 where every c is 0 */
        const __m256 inv8 = _mm256_and_ps(
            _mm256_div_ps(_mm256_set1_ps(127.0f), amax),
            _mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_GT_OQ));
        const __m512 inv = join256_ps(inv8, inv8);
        int32_t k[2][2][8]; /* group g's multipliers of sub-block j: 4 int8, then their k' */
        for (int g = 0; g < ng; g++)
            group_multipliers(c[2 * g], c[2 * g + 1], join256_ps(scale8, scale8), inv, k[g]);
        /* dword t of 128-bit lane L <- dword 4 t + L: after the unpacks, X_q holds bytes
         * 16 q .. 16 q + 15 of the piece, in order */
        const __m512i spread = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7,
                                                 11, 15);
        for (int p = 0; p < 2; p++) { /* the 64-byte pieces: sub-blocks 4p .. 4p + 3 */
            /* X_q's low nibbles (sub-block 4p + 2 (q / 2)) times k and k', its high ones' */
            __m512i lo[4], hi[4], lo2[4], hi2[4];
            for (int q = 0; q < 4; q++)
                lo[q] = hi[q] = lo2[q] = hi2[q] = _mm512_setzero_si512();
            for (int g = 0; g < ng; g++) {
                __m512i rw[GROUP];
                for (int r = 0; r < GROUP; r++)
                    rw[r] = _mm512_permutexvar_epi32(
                        spread,
                        _mm512_loadu_si512((const void *)(w[GROUP * g + r] + at + 16 + 64 * p)));
                const __m512i p01l = _mm512_unpacklo_epi8(rw[0], rw[1]);
                const __m512i p01h = _mm512_unpackhi_epi8(rw[0], rw[1]);
                const __m512i p23l = _mm512_unpacklo_epi8(rw[2], rw[3]);
                const __m512i p23h = _mm512_unpackhi_epi8(rw[2], rw[3]);
                const __m512i x[4] = {
                    _mm512_unpacklo_epi16(p01l, p23l), _mm512_unpackhi_epi16(p01l, p23l),
                    _mm512_unpacklo_epi16(p01h, p23h), _mm512_unpackhi_epi16(p01h, p23h)};
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
                float *yh = yl + 32;
                __m512 vl = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[q]), _mm512_set1_ps(step[0][j]),
                                            _mm512_loadu_ps(yl));
                __m512 vh = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[q]),
                                            _mm512_set1_ps(step[2][j + 1]), _mm512_loadu_ps(yh));
                vl = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo2[q]), _mm512_set1_ps(step[1][j]), vl);
                vh = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi2[q]), _mm512_set1_ps(step[3][j + 1]),
                                     vh);
                _mm512_storeu_ps(yl, _mm512_sub_ps(vl, _mm512_set1_ps(min[j])));
                _mm512_storeu_ps(yh, _mm512_sub_ps(vh, _mm512_set1_ps(min[j + 1])));
            }
        }
    }
}

#endif

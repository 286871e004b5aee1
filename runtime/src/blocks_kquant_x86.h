/* Pieces the K-quant AVX2 and AVX-512 row kernels (rows_kquant.c, rows_kquant_avx512.c) share.
 * AVX2 target, a subset of both files' targets. Include after <immintrin.h>, on x86-64 with GCC
 * or Clang only. */
#ifndef PYRT_BLOCKS_KQUANT_X86_H
#define PYRT_BLOCKS_KQUANT_X86_H

#include <string.h>

#include "rows.h"
#include "rows_x86.h"

/* Q4_K / Q5_K super-block whose first 16 bytes are v (dwords: d and dmin, then the 12 scale
 * bytes a, b, c): its 8 six-bit sub-block scales sc_j (bytes 0..7) and mins m_j (bytes 8..15),
 * ggml's get_scale_min_k4 four bytes at a time, in vector registers:
 *   sc_lo = a & 0x3F..,  sc_hi = (c & 0x0F..) | ((a >> 2) & 0x30..),
 *   m_lo  = b & 0x3F..,  m_hi  = ((c >> 4) & 0x0F..) | ((b >> 2) & 0x30..)
 * (7 vector operations; the scalar form, 4-byte loads, shifts, masks and inserts, was ~25 per
 * super-block and row, a third of the Q4_K dot's instructions). */
PYRT_X86_AVX2 static inline __m128i pyrt_kq_sc_m_from(__m128i v) {
    const __m128i acbc = _mm_shuffle_epi32(v, _MM_SHUFFLE(3, 2, 3, 1));
    const __m128i lo_mask = _mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F);
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(acbc, _mm_setr_epi32(0, 0, 0, 4)), lo_mask);
    const __m128i aabb = _mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 2, 1, 1)), 2);
    const __m128i hi = _mm_and_si128(aabb, _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(lo, hi);
}

/* pyrt_kq_sc_m_from of the super-block at w. */
PYRT_X86_AVX2 static inline __m128i pyrt_kq_sc_m_bytes(const uint8_t *w) {
    return pyrt_kq_sc_m_from(_mm_loadu_si128((const __m128i *)w));
}

/* The 8 mins m_j of pyrt_kq_sc_m_bytes's sm, each twice, as int16 (lanes 2j, 2j + 1: m_j), the
 * multipliers of x's 16 sums per 16 of a super-block (pyrt_xq_sums) in one vpmaddwd. */
PYRT_X86_AVX2 static inline __m256i pyrt_kq_mins16(__m128i sm) {
    return _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));
}

/* Q4_K / Q5_K super-block at w: d * sc_j and dmin * m_j of its 8 sub-blocks (lanes 0..7). */
PYRT_X86_AVX2 static inline void pyrt_kq_scales_mins(const uint8_t *w, __m256 *dsc, __m256 *dm) {
    const __m128i sm = pyrt_kq_sc_m_bytes(w);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
    *dsc = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(pyrt_load_u16(w))), sc);
    *dm = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(pyrt_load_u16(w + 2))), m);
}

/* The sums of q per 16 elements after the n/32 blocks at xq (pyrt_xq_sums): per block, its bytes
 * made unsigned (q + 128) and summed per 8 by vpsadbw, each 16's sum less 16 * 128. */
PYRT_X86_AVX2 static inline void pyrt_kq_store_sums(pyrt_xq8 *xq, int n) {
    uint8_t *s = (uint8_t *)(xq + n / PYRT_QK);
    for (int b = 0; b < n / PYRT_QK; b++) {
        const __m256i u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)xq[b].q),
                                           _mm256_set1_epi8((char)0x80));
        const __m256i sad = _mm256_sad_epu8(u, _mm256_setzero_si256());
        const __m256i t = _mm256_add_epi64(sad, _mm256_srli_si256(sad, 8));
        const int16_t v[2] = {(int16_t)(_mm256_extract_epi16(t, 0) - 16 * 128),
                              (int16_t)(_mm256_extract_epi16(t, 8) - 16 * 128)};
        memcpy(s + 4 * b, v, 4);
    }
}

#endif /* PYRT_BLOCKS_KQUANT_X86_H */

/* Pieces shared by the x86 row kernels (rows_avx2.c, rows_avx512.c, rows_mxfp4.c's AVX2 part).
 * They carry the AVX2 target, a subset of every including file's target, so they inline into
 * any of them. Include after <immintrin.h>, on x86-64 with GCC or Clang only. */
#ifndef PYRT_ROWS_X86_H
#define PYRT_ROWS_X86_H

#include "rows.h"

#define PYRT_X86_AVX2 __attribute__((target("avx2,fma,f16c")))

/* The sum of v's 8 lanes. */
PYRT_X86_AVX2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 int32 lanes summing to sum_i w[i] * x[i] over 32 int8 pairs.
 * maddubs needs an unsigned operand: |w| (|-128| = 128 reads as unsigned 128) times x with w's
 * sign (x is in [-127, 127], so negating it cannot overflow). Pairs sum to <= 2*128*127 < 2^15:
 * no saturation for Q8_0, Q4_0 or MXFP4's doubled e2m1 values (|w| <= 12). */
PYRT_X86_AVX2 static inline __m256i dot32_i8(__m256i w, __m256i x) {
    const __m256i aw = _mm256_sign_epi8(w, w);
    const __m256i sx = _mm256_sign_epi8(x, w);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1));
}

/* The f16 scales of 8 consecutive weight blocks (at the start of each block, bb bytes apart) as
 * f32, exactly (vcvtph2ps). */
PYRT_X86_AVX2 static inline __m256 wscales8(const uint8_t *w, size_t bb) {
    __m128i h = _mm_cvtsi32_si128(pyrt_load_u16(w));
    h = _mm_insert_epi16(h, pyrt_load_u16(w + 1 * bb), 1);
    h = _mm_insert_epi16(h, pyrt_load_u16(w + 2 * bb), 2);
    h = _mm_insert_epi16(h, pyrt_load_u16(w + 3 * bb), 3);
    h = _mm_insert_epi16(h, pyrt_load_u16(w + 4 * bb), 4);
    h = _mm_insert_epi16(h, pyrt_load_u16(w + 5 * bb), 5);
    h = _mm_insert_epi16(h, pyrt_load_u16(w + 6 * bb), 6);
    h = _mm_insert_epi16(h, pyrt_load_u16(w + 7 * bb), 7);
    return _mm256_cvtph_ps(h);
}

#endif

/* Pieces shared by the AVX2 and AVX-512 row kernels (rows_avx2.c, rows_avx512.c). They use
 * only SSE4.1 + F16C instructions under the AVX2 target, a subset of both files' targets, so
 * they inline into either. Include after <immintrin.h>, on x86-64 with GCC or Clang only. */
#ifndef PYRT_ROWS_X86_H
#define PYRT_ROWS_X86_H

#include "rows.h"

/* The f16 scales of 8 consecutive weight blocks (at the start of each block, bb bytes apart) as
 * f32, exactly (vcvtph2ps). */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 wscales8(const uint8_t *w,
                                                                        size_t bb) {
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

/* Pieces the AVX-512 row kernels (rows_avx512.c) and tile kernels (tiles_avx512.c) share, so that
 * a tile computes each of its dots with a row kernel's operations in its order: the same bits.
 * Include after <immintrin.h>, on x86-64 with GCC or Clang only. */
#ifndef PYRT_BLOCKS_AVX512_H
#define PYRT_BLOCKS_AVX512_H

#include "rows.h"
#include "rows_x86.h"

#define AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))
#define AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c")))

/* 16 weights of each float format widened to f32; the masked forms read only `m`'s lanes. */
AVX512 static inline __m512 load16_f32(const void *p, int i, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}
AVX512 static inline __m256i load16_u16(const void *p, int i, __mmask16 m) {
    /* A 32-lane masked u16 load whose lanes 16..31 are masked off: the low 256 bits. */
    return _mm512_castsi512_si256(_mm512_maskz_loadu_epi16((__mmask32)m, (const uint16_t *)p + i));
}
AVX512 static inline __m512 load16_f16(const void *p, int i, __mmask16 m) {
    return _mm512_cvtph_ps(load16_u16(p, i, m));
}
AVX512 static inline __m512 load16_bf16(const void *p, int i, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load16_u16(p, i, m)), 16));
}

/* The 32 int8 weights of a Q4_0 block (low nibbles: elements 0..15, high: 16..31). */
AVX512 static inline __m256i unpack_q4_0(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, m4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
    return _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8));
}

AVX512 static inline __m512i join256(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* 16 int32 lanes: lanes 0..7 sum block 0's 32 products, lanes 8..15 block 1's. Same unsigned x
 * signed trick as the AVX2 kernel: |w| (128 for -128, read unsigned) times x carrying w's sign. */
AVX512 static inline __m512i dot64_i8(__m512i w, __m512i x) {
    const __mmask64 neg = _mm512_movepi8_mask(w);
    const __m512i aw = _mm512_abs_epi8(w);
    const __m512i sx = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
    return _mm512_madd_epi16(_mm512_maddubs_epi16(aw, sx), _mm512_set1_epi16(1));
}

/* Scale vector: s0 in lanes 0..7, s1 in lanes 8..15. */
AVX512 static inline __m512 scales2(float s0, float s1) {
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s0), _mm512_set1_ps(s1));
}

/* wscales8: rows_x86.h */

/* d_w * d_x of 8 consecutive blocks in lanes 0..7 (lanes 8..15 undefined); x's scales are f32,
 * 36 bytes apart. */
AVX512 static inline __m512 scales8(const uint8_t *w, size_t bb, const pyrt_xq8 *xq) {
    const __m256 dx = _mm256_setr_ps(xq[0].d, xq[1].d, xq[2].d, xq[3].d, xq[4].d, xq[5].d,
                                     xq[6].d, xq[7].d);
    return _mm512_castps256_ps512(_mm256_mul_ps(wscales8(w, bb), dx));
}

/* Permute indices that spread lanes 2p and 2p+1 of scales8 over lanes 0..7 and 8..15. */
AVX512 static inline __m512i pair_index(int p) {
    return _mm512_add_epi32(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                            _mm512_set1_epi32(2 * p));
}

/* hsum8: rows_x86.h */

/* One trailing block with 256-bit registers (odd block counts); w is the block's int8 weights. */
AVX512 static inline float dot_one_block(__m256i w, const pyrt_xq8 *xq, float dw) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)xq->q);
    const __m256i p = _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)),
        _mm256_set1_epi16(1));
    return hsum8(_mm256_mul_ps(_mm256_set1_ps(dw * xq->d), _mm256_cvtepi32_ps(p)));
}

#define LOAD_Q8_0(wb) _mm256_loadu_si256((const __m256i *)((wb) + 2))
#define LOAD_Q4_0(wb) unpack_q4_0((wb) + 2)
/* The int8 weights of the two blocks at w0 and w0 + bb, as one vector. */
#define LOAD_PAIR(load_block, w0, bb) join256(load_block(w0), load_block((w0) + (bb)))

/* The int32 lanes of a pair step, plain AVX-512 BW: dot64_i8, nothing made per x vector. */
#define PREP_BW(xv) _mm512_setzero_si512()
#define LANES_BW(wq, xv, nx) ((void)(nx), dot64_i8(wq, xv))


AVX512VNNI static inline __m512i neg_x128(__m512i x) {
    const __m512i sum =
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80), x);
    return _mm512_sub_epi32(_mm512_setzero_si512(), sum);
}

AVX512VNNI static inline __m512i dot64_vnni(__m512i w, __m512i x, __m512i nx) {
    return _mm512_dpbusd_epi32(nx, _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)), x);
}

#endif /* PYRT_BLOCKS_AVX512_H */

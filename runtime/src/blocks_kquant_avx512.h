/* The K-quants' codes as bytes, 64 (a pair of sub-blocks of 32) per 512-bit register, for the
 * AVX-512 row kernels (rows_kquant_avx512.c: dots and float axpy; rows_kquant_i8.c: the int8
 * down rows). Include after <immintrin.h>, on x86-64 with GCC or Clang only. */
#ifndef PYRT_BLOCKS_KQUANT_AVX512_H
#define PYRT_BLOCKS_KQUANT_AVX512_H

#include "blocks_avx512.h"

/* 32 bytes at p in both halves. */
AVX512 static inline __attribute__((always_inline)) __m512i bcast32(const uint8_t *p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}

/* Shift counts per 16-bit lane: lo for the low 256 bits, hi for the high. */
AVX512 static inline __attribute__((always_inline)) __m512i counts16(short lo, short hi) {
    return join256(_mm256_set1_epi16(lo), _mm256_set1_epi16(hi));
}

/* Q5_K pair k's 64 codes (uint8; bytes 0..31: sub-block 2k, 32..63: 2k + 1). */
AVX512 static inline __attribute__((always_inline)) __m512i codes_q5_k(const uint8_t *w, int k) {
    const __m512i raw = bcast32(w + 48 + 32 * k);
    const __m512i lo = _mm512_and_si512(
        _mm512_srlv_epi16(raw, counts16(0, 4)), _mm512_set1_epi8(0x0F));
    const __m512i qh = bcast32(w + 16);
    const __m512i bit = join256(_mm256_set1_epi8((char)(1 << 2 * k)),
                                _mm256_set1_epi8((char)(1 << (2 * k + 1))));
    return _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh, bit), lo, _mm512_set1_epi8(16));
}
/* The dots' pairs (rows_kquant_avx512.c): pair k holds sub-blocks a = 4 (k / 2) + k % 2 and
 * a + 2, the low (k even) or high (k odd) nibbles of one 64-byte piece of qs (bytes 0..31:
 * sub-blocks 4h, 4h + 1, bytes 32..63: 4h + 2, 4h + 3 of piece h), so two pairs share one full
 * load and a 16-bit shift by an immediate, not a broadcast and a variable shift each. */
static inline __attribute__((always_inline)) int split_first(int k) {
    return 4 * (k / 2) + k % 2;
}
AVX512 static inline __attribute__((always_inline)) __m512i split_nibbles(const uint8_t *qs,
                                                                          int k) {
    const __m512i raw = _mm512_loadu_si512((const void *)(qs + 64 * (k / 2)));
    const __m512i nib = k % 2 ? _mm512_srli_epi16(raw, 4) : raw;
    return _mm512_and_si512(nib, _mm512_set1_epi8(0x0F));
}
AVX512 static inline __attribute__((always_inline)) __m512i codes_q4_k_split(const uint8_t *w,
                                                                             int k) {
    return split_nibbles(w + 16, k);
}
AVX512 static inline __attribute__((always_inline)) __m512i codes_q5_k_split(const uint8_t *w,
                                                                             int k) {
    const int a = split_first(k);
    const __m512i lo = split_nibbles(w + 48, k);
    const __m512i qh = bcast32(w + 16);
    const __m512i bit =
        join256(_mm256_set1_epi8((char)(1 << a)), _mm256_set1_epi8((char)(1 << (a + 2))));
    return _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh, bit), lo, _mm512_set1_epi8(16));
}

/* Q6_K: q + 32 (0..63). Pair k = 2h + half holds quarters p = 2 half (ql's first 32 bytes of
 * half h) and 2 half + 1 (its next 32), nibble `half`; their high bits are bits 2p, 2p + 1 of qh,
 * moved to bits 4, 5 (16-bit shifts: the bits that cross into the next byte are masked off). */
AVX512 static inline __attribute__((always_inline)) __m512i codes_q6_k(const uint8_t *w, int k) {
    const int h = k / 2, half = k % 2;
    const __m512i ql = _mm512_loadu_si512((const void *)(w + 64 * h));
    const __m512i nib = half ? _mm512_srli_epi16(ql, 4) : ql;
    const __m512i lo = _mm512_and_si512(nib, _mm512_set1_epi8(0x0F));
    const __m512i qh = bcast32(w + 128 + 32 * h);
    const __m512i hi =
        half ? _mm512_srlv_epi16(qh, counts16(0, 2))
             : _mm512_sllv_epi16(qh, counts16(4, 2));
    return _mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi8(0x30), 0xF8); /* lo | (hi & 0x30) */
}

#endif /* PYRT_BLOCKS_KQUANT_AVX512_H */

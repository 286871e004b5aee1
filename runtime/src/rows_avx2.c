/* AVX2 + FMA + F16C row kernels. Every function carries the target attribute, so this file is
 * compiled with the baseline flags and only called after cpuid said yes (cpu.c). */
#include "rows.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "rows_x86.h"
#include "blocks_kquant_x86.h"

#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* 8 weights of each float format, widened to f32. */
AVX2 static inline __m256 load8_f32(const void *p, int i) {
    return _mm256_loadu_ps((const float *)p + i);
}
AVX2 static inline __m256 load8_f16(const void *p, int i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
}
AVX2 static inline __m256 load8_bf16(const void *p, int i) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

#define FLOAT_ROW_KERNELS(name, load8, scalar_load)                                               \
    AVX2 static float dot_##name(const void *row, const void *x, int n) {                         \
        const float *xf = x;                                                                      \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                                \
        __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();                                \
        int i = 0;                                                                                \
        for (; i + 32 <= n; i += 32) {                                                            \
            a0 = _mm256_fmadd_ps(load8(row, i), _mm256_loadu_ps(xf + i), a0);                     \
            a1 = _mm256_fmadd_ps(load8(row, i + 8), _mm256_loadu_ps(xf + i + 8), a1);             \
            a2 = _mm256_fmadd_ps(load8(row, i + 16), _mm256_loadu_ps(xf + i + 16), a2);           \
            a3 = _mm256_fmadd_ps(load8(row, i + 24), _mm256_loadu_ps(xf + i + 24), a3);           \
        }                                                                                         \
        for (; i + 8 <= n; i += 8)                                                                \
            a0 = _mm256_fmadd_ps(load8(row, i), _mm256_loadu_ps(xf + i), a0);                     \
        float sum = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));           \
        for (; i < n; i++)                                                                        \
            sum += scalar_load(row, i) * xf[i];                                                   \
        return sum;                                                                               \
    }                                                                                             \
    AVX2 static void axpy_##name(float a, const void *row, float *y, int n) {                     \
        const __m256 va = _mm256_set1_ps(a);                                                      \
        int i = 0;                                                                                \
        for (; i + 8 <= n; i += 8)                                                                \
            _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load8(row, i), _mm256_loadu_ps(y + i)));  \
        for (; i < n; i++)                                                                        \
            y[i] += a * scalar_load(row, i);                                                      \
    }

#define SCALAR_F32(p, i) (((const float *)(p))[i])
#define SCALAR_F16(p, i) pyrt_fp16_to_fp32(((const uint16_t *)(p))[i])
#define SCALAR_BF16(p, i) pyrt_bf16_to_fp32(((const uint16_t *)(p))[i])

FLOAT_ROW_KERNELS(f32, load8_f32, SCALAR_F32)
FLOAT_ROW_KERNELS(f16, load8_f16, SCALAR_F16)
FLOAT_ROW_KERNELS(bf16, load8_bf16, SCALAR_BF16)

/* ---- quantized formats --------------------------------------------------------------------- */

/* The 32 int8 weights of a Q4_0 block: low nibbles are elements 0..15, high nibbles 16..31. */
AVX2 static inline __m256i unpack_q4_0(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, m4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
    return _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8));
}

/* ---- quantized dots --------------------------------------------------------------------------
 *
 * One row (dot) or two (dot2) against one quantized activation vector x (pyrt_xq8 blocks), one
 * 32-element block per 256-bit step: 8 int32 lanes (dot32_i8), converted to f32 and accumulated
 * as acc += s * lanes with s = d_w * d_x of the block, even blocks into acc0 and odd ones into
 * acc1, two blocks per prefetch tick.
 *
 * Scales, 8 blocks at a time: the weight scales of 8 blocks are gathered (vpinsrw), converted in
 * one vcvtph2ps and multiplied by x's 8 scales in one vmulps; each half (blocks 0..3, 4..7) is
 * copied to both 128-bit lanes once (vperm2f128) and each block takes its s with one in-lane
 * vpermilps. Per block this replaces a scalar conversion, a multiply and a broadcast. A group's
 * scales are made one group ahead: made at the start of their own group, their latency (8
 * dependent inserts, convert, multiply) held up the accumulators and dot was 15% slower than one
 * block at a time. The f32 products and the accumulation order are those of one block at a time,
 * so are the results (bit for bit; fewer than 8 blocks left go a pair, then one block, at a time).
 * On Zen 3, rows in L2: Q8_0 dot 4% and dot2 7% faster, Q4_0 dot even and
 * dot2 2-5%; the MoE kernel, sparse 0.9 8-10% faster, dense even (within that machine's noise).
 * The same scheme in axpyn was 3-9% faster from L2 but 4-19% slower (Q8_0) streaming from DRAM,
 * and the MoE kernel's dense cells were slower with it, so axpyn keeps one scale per block. */

/* wscales8: rows_x86.h */

/* x's scales of 8 consecutive blocks (f32, sizeof(pyrt_xq8) = 36 bytes apart; a vgatherdps was
 * 1.5x slower here). */
AVX2 static inline __m256 xscales8(const pyrt_xq8 *xq) {
    return _mm256_setr_ps(xq[0].d, xq[1].d, xq[2].d, xq[3].d, xq[4].d, xq[5].d, xq[6].d,
                          xq[7].d);
}

/* half[0] = lanes 0..3 of s8 in both 128-bit lanes, half[1] = lanes 4..7; block i of the group
 * then takes its scale as _mm256_permute_ps(half[i / 4], 0x55 * (i % 4)). */
#define SPLIT_HALVES(half, s8)                                                                    \
    do {                                                                                          \
        (half)[0] = _mm256_permute2f128_ps((s8), (s8), 0x00);                                     \
        (half)[1] = _mm256_permute2f128_ps((s8), (s8), 0x11);                                     \
    } while (0)

/* acc += s * (w . x over one block); wq the block's 32 int8 weights, x its 32 int8 activations. */
#define BLOCK_FMA(acc, s, wq, x)                                                                  \
    acc = _mm256_fmadd_ps((s), _mm256_cvtepi32_ps(dot32_i8((wq), (x))), acc)
#define LOAD_X(xb) _mm256_loadu_si256((const __m256i *)(xb))

/* Blocks b + i and b + i + 1 (i even, 0..6) of the group at b, one row (w, acc0, acc1, half). */
#define DOT_PAIR(i, bb, load_block)                                                               \
    do {                                                                                          \
        const uint8_t *w0 = w + (size_t)(b + (i)) * (bb);                                         \
        BLOCK_FMA(acc0, _mm256_permute_ps(half[(i) / 4], 0x55 * ((i) % 4)), load_block(w0),       \
                  LOAD_X(xq[b + (i)].q));                                                         \
        BLOCK_FMA(acc1, _mm256_permute_ps(half[(i) / 4], 0x55 * ((i) % 4 + 1)),                   \
                  load_block(w0 + (bb)), LOAD_X(xq[b + (i) + 1].q));                              \
        pyrt_pf_tick(&ps);                                                                        \
    } while (0)

/* One row against x; prefetches of pf[0 .. n_pf-1] are spread over the loop (pyrt_pf_*). */
#define QUANT_DOT(name, bb, load_block)                                                           \
    AVX2 static float dot_pf_##name(const void *row, const void *x, int n,                        \
                                    const void *const *pf, int n_pf) {                            \
        const uint8_t *w = row;                                                                   \
        const pyrt_xq8 *xq = x;                                                                   \
        const int nb = n / PYRT_QK;                                                               \
        pyrt_pf_spread ps = pyrt_pf_begin(pf, n_pf, nb / 2);                                      \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                            \
        __m256 next = acc0; /* d_w * d_x of the next group's 8 blocks */                          \
        if (nb >= 8)                                                                              \
            next = _mm256_mul_ps(wscales8(w, (bb)), xscales8(xq));                                \
        int b = 0;                                                                                \
        for (; b + 8 <= nb; b += 8) {                                                             \
            __m256 half[2];                                                                       \
            SPLIT_HALVES(half, next);                                                             \
            if (b + 16 <= nb)                                                                     \
                next = _mm256_mul_ps(wscales8(w + (size_t)(b + 8) * (bb), (bb)),                  \
                                     xscales8(xq + b + 8));                                       \
            DOT_PAIR(0, bb, load_block);                                                          \
            DOT_PAIR(2, bb, load_block);                                                          \
            DOT_PAIR(4, bb, load_block);                                                          \
            DOT_PAIR(6, bb, load_block);                                                          \
        }                                                                                         \
        for (; b + 2 <= nb; b += 2) {                                                             \
            const uint8_t *w0 = w + (size_t)b * (bb), *w1 = w0 + (bb);                            \
            const float s0 = _cvtsh_ss(pyrt_load_u16(w0)) * xq[b].d;                              \
            const float s1 = _cvtsh_ss(pyrt_load_u16(w1)) * xq[b + 1].d;                          \
            BLOCK_FMA(acc0, _mm256_set1_ps(s0), load_block(w0), LOAD_X(xq[b].q));                 \
            BLOCK_FMA(acc1, _mm256_set1_ps(s1), load_block(w1), LOAD_X(xq[b + 1].q));             \
            pyrt_pf_tick(&ps);                                                                    \
        }                                                                                         \
        if (b < nb) {                                                                             \
            const uint8_t *w0 = w + (size_t)b * (bb);                                             \
            const float s0 = _cvtsh_ss(pyrt_load_u16(w0)) * xq[b].d;                              \
            BLOCK_FMA(acc0, _mm256_set1_ps(s0), load_block(w0), LOAD_X(xq[b].q));                 \
        }                                                                                         \
        pyrt_pf_end(&ps);                                                                         \
        return hsum8(_mm256_add_ps(acc0, acc1));                                                  \
    }                                                                                             \
    AVX2 static float dot_##name(const void *row, const void *x, int n) {                         \
        return dot_pf_##name(row, x, n, NULL, 0);                                                 \
    }

#define LOAD_Q8_0(wb) _mm256_loadu_si256((const __m256i *)((wb) + 2))
#define LOAD_Q4_0(wb) unpack_q4_0((wb) + 2)
QUANT_DOT(q8_0, PYRT_Q8_0_BYTES, LOAD_Q8_0)
QUANT_DOT(q4_0, PYRT_Q4_0_BYTES, LOAD_Q4_0)

/* DOT_PAIR for both rows of dot2 (wr[r], acc0[r], acc1[r], half[r]); x's blocks loaded once. */
#define DOT2_PAIR(i, bb, load_block)                                                              \
    do {                                                                                          \
        const __m256i x0 = LOAD_X(xq[b + (i)].q), x1 = LOAD_X(xq[b + (i) + 1].q);                 \
        for (int r = 0; r < 2; r++) {                                                             \
            const uint8_t *w0 = wr[r] + (size_t)(b + (i)) * (bb);                                 \
            BLOCK_FMA(acc0[r], _mm256_permute_ps(half[r][(i) / 4], 0x55 * ((i) % 4)),             \
                      load_block(w0), x0);                                                        \
            BLOCK_FMA(acc1[r], _mm256_permute_ps(half[r][(i) / 4], 0x55 * ((i) % 4 + 1)),         \
                      load_block(w0 + (bb)), x1);                                                 \
        }                                                                                         \
        pyrt_pf_tick(&ps);                                                                        \
    } while (0)

/* Two rows against one x in one pass: per row exactly the operations of dot_q8_0 / dot_q4_0 (same
 * products, same accumulators, same order), so the results equal two dot calls bit for bit; x's
 * blocks and scales are loaded once for both rows. */
#define QUANT_DOT2(name, bb, load_block)                                                          \
    AVX2 static void dot2_pf_##name(const void *row0, const void *row1, const void *x, int n,     \
                                    float out[2], const void *const *pf, int n_pf) {              \
        const uint8_t *wr[2] = {row0, row1};                                                      \
        const pyrt_xq8 *xq = x;                                                                   \
        const int nb = n / PYRT_QK;                                                               \
        pyrt_pf_spread ps = pyrt_pf_begin(pf, n_pf, nb / 2);                                      \
        __m256 acc0[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                              \
        __m256 acc1[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                              \
        __m256 next[2] = {acc0[0], acc0[0]}; /* per row, d_w * d_x of the next group */           \
        if (nb >= 8) {                                                                            \
            const __m256 dx = xscales8(xq);                                                       \
            for (int r = 0; r < 2; r++)                                                           \
                next[r] = _mm256_mul_ps(wscales8(wr[r], (bb)), dx);                               \
        }                                                                                         \
        int b = 0;                                                                                \
        for (; b + 8 <= nb; b += 8) {                                                             \
            __m256 half[2][2];                                                                    \
            for (int r = 0; r < 2; r++)                                                           \
                SPLIT_HALVES(half[r], next[r]);                                                   \
            if (b + 16 <= nb) {                                                                   \
                const __m256 dx = xscales8(xq + b + 8);                                           \
                for (int r = 0; r < 2; r++)                                                       \
                    next[r] = _mm256_mul_ps(wscales8(wr[r] + (size_t)(b + 8) * (bb), (bb)), dx);  \
            }                                                                                     \
            DOT2_PAIR(0, bb, load_block);                                                         \
            DOT2_PAIR(2, bb, load_block);                                                         \
            DOT2_PAIR(4, bb, load_block);                                                         \
            DOT2_PAIR(6, bb, load_block);                                                         \
        }                                                                                         \
        for (; b + 2 <= nb; b += 2) {                                                             \
            const __m256i x0 = LOAD_X(xq[b].q), x1 = LOAD_X(xq[b + 1].q);                         \
            for (int r = 0; r < 2; r++) {                                                         \
                const uint8_t *w0 = wr[r] + (size_t)b * (bb), *w1 = w0 + (bb);                    \
                const float s0 = _cvtsh_ss(pyrt_load_u16(w0)) * xq[b].d;                          \
                const float s1 = _cvtsh_ss(pyrt_load_u16(w1)) * xq[b + 1].d;                      \
                BLOCK_FMA(acc0[r], _mm256_set1_ps(s0), load_block(w0), x0);                       \
                BLOCK_FMA(acc1[r], _mm256_set1_ps(s1), load_block(w1), x1);                       \
            }                                                                                     \
            pyrt_pf_tick(&ps);                                                                    \
        }                                                                                         \
        if (b < nb) {                                                                             \
            const __m256i x0 = LOAD_X(xq[b].q);                                                   \
            for (int r = 0; r < 2; r++) {                                                         \
                const uint8_t *w0 = wr[r] + (size_t)b * (bb);                                     \
                const float s0 = _cvtsh_ss(pyrt_load_u16(w0)) * xq[b].d;                          \
                BLOCK_FMA(acc0[r], _mm256_set1_ps(s0), load_block(w0), x0);                       \
            }                                                                                     \
        }                                                                                         \
        pyrt_pf_end(&ps);                                                                         \
        out[0] = hsum8(_mm256_add_ps(acc0[0], acc1[0]));                                          \
        out[1] = hsum8(_mm256_add_ps(acc0[1], acc1[1]));                                          \
    }                                                                                             \
    AVX2 static void dot2_##name(const void *row0, const void *row1, const void *x, int n,        \
                                 float out[2]) {                                                  \
        dot2_pf_##name(row0, row1, x, n, out, NULL, 0);                                           \
    }

QUANT_DOT2(q8_0, PYRT_Q8_0_BYTES, LOAD_Q8_0)
QUANT_DOT2(q4_0, PYRT_Q4_0_BYTES, LOAD_Q4_0)

/* ---- quantized axpyn and axpy ------------------------------------------------------------- */

/* Several down rows into one y: a block of y (32 floats, 4 registers) is loaded once, takes every
 * row's contribution in row order, and is stored once: per row and block 4 widen + convert + fma
 * and no y traffic, where one axpy per row pays 4 loads and 4 stores of y each time. */
AVX2 static void axpyn_pf_q8_0(int nr, const float *a, const void *const *rows, float *y,
                               int n, const void *const *pf, int n_pf) {
    pyrt_pf_spread ps = pyrt_pf_begin(pf, n_pf, n / PYRT_QK);
    for (int b = 0; b < n / PYRT_QK; b++, y += PYRT_QK) {
        __m256 y0 = _mm256_loadu_ps(y), y1 = _mm256_loadu_ps(y + 8);
        __m256 y2 = _mm256_loadu_ps(y + 16), y3 = _mm256_loadu_ps(y + 24);
        for (int r = 0; r < nr; r++) {
            const uint8_t *w = (const uint8_t *)rows[r] + (size_t)b * PYRT_Q8_0_BYTES;
            const __m256 vs = _mm256_set1_ps(a[r] * _cvtsh_ss(pyrt_load_u16(w)));
#define Q8_PART(part)                                                                             \
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + 2 + 8 * (part)))))
            y0 = _mm256_fmadd_ps(vs, Q8_PART(0), y0);
            y1 = _mm256_fmadd_ps(vs, Q8_PART(1), y1);
            y2 = _mm256_fmadd_ps(vs, Q8_PART(2), y2);
            y3 = _mm256_fmadd_ps(vs, Q8_PART(3), y3);
#undef Q8_PART
        }
        _mm256_storeu_ps(y, y0);
        _mm256_storeu_ps(y + 8, y1);
        _mm256_storeu_ps(y + 16, y2);
        _mm256_storeu_ps(y + 24, y3);
        pyrt_pf_tick(&ps);
    }
    pyrt_pf_end(&ps);
}

AVX2 static void axpyn_q8_0(int nr, const float *a, const void *const *rows, float *y, int n) {
    axpyn_pf_q8_0(nr, a, rows, y, n, NULL, 0);
}

AVX2 static void axpyn_pf_q4_0(int nr, const float *a, const void *const *rows, float *y,
                               int n, const void *const *pf, int n_pf) {
    pyrt_pf_spread ps = pyrt_pf_begin(pf, n_pf, n / PYRT_QK);
    const __m256i m4 = _mm256_set1_epi32(0xF), eight = _mm256_set1_epi32(8);
    for (int b = 0; b < n / PYRT_QK; b++, y += PYRT_QK) {
        /* y0, y1: elements 0..15 (low nibbles), y2, y3: 16..31 (high nibbles) */
        __m256 y0 = _mm256_loadu_ps(y), y1 = _mm256_loadu_ps(y + 8);
        __m256 y2 = _mm256_loadu_ps(y + 16), y3 = _mm256_loadu_ps(y + 24);
        for (int r = 0; r < nr; r++) {
            const uint8_t *w = (const uint8_t *)rows[r] + (size_t)b * PYRT_Q4_0_BYTES;
            const __m256 vs = _mm256_set1_ps(a[r] * _cvtsh_ss(pyrt_load_u16(w)));
            const __m256i q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + 2)));
            const __m256i q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + 10)));
            y0 = _mm256_fmadd_ps(vs, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(q0, m4), eight)), y0);
            y1 = _mm256_fmadd_ps(vs, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(q1, m4), eight)), y1);
            y2 = _mm256_fmadd_ps(vs, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(q0, 4), eight)), y2);
            y3 = _mm256_fmadd_ps(vs, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(q1, 4), eight)), y3);
        }
        _mm256_storeu_ps(y, y0);
        _mm256_storeu_ps(y + 8, y1);
        _mm256_storeu_ps(y + 16, y2);
        _mm256_storeu_ps(y + 24, y3);
        pyrt_pf_tick(&ps);
    }
    pyrt_pf_end(&ps);
}

AVX2 static void axpyn_q4_0(int nr, const float *a, const void *const *rows, float *y, int n) {
    axpyn_pf_q4_0(nr, a, rows, y, n, NULL, 0);
}

/* Axpy kernels widen the quants straight from memory (vpmovsxbd / vpmovzxbd with a memory
 * operand), which costs fewer shuffle uops than unpacking a 256-bit register. */
AVX2 static void axpy_q8_0(float a, const void *row, float *y, int n) {
    const uint8_t *w = row;
    for (int b = 0; b < n / PYRT_QK; b++, w += PYRT_Q8_0_BYTES, y += PYRT_QK) {
        const __m256 vs = _mm256_set1_ps(a * _cvtsh_ss(pyrt_load_u16(w)));
        for (int part = 0; part < 4; part++) {
            const __m128i q8 = _mm_loadl_epi64((const __m128i *)(w + 2 + 8 * part));
            const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
            _mm256_storeu_ps(y + 8 * part, _mm256_fmadd_ps(vs, f, _mm256_loadu_ps(y + 8 * part)));
        }
    }
}

AVX2 static void axpy_q4_0(float a, const void *row, float *y, int n) {
    const uint8_t *w = row;
    const __m256i m4 = _mm256_set1_epi32(0xF), eight = _mm256_set1_epi32(8);
    for (int b = 0; b < n / PYRT_QK; b++, w += PYRT_Q4_0_BYTES, y += PYRT_QK) {
        const __m256 vs = _mm256_set1_ps(a * _cvtsh_ss(pyrt_load_u16(w)));
        for (int part = 0; part < 2; part++) {
            /* bytes qs[8p .. 8p+7]: low nibbles are elements 8p.., high nibbles 16+8p.. */
            const __m128i raw = _mm_loadl_epi64((const __m128i *)(w + 2 + 8 * part));
            const __m256i q = _mm256_cvtepu8_epi32(raw);
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(q, m4), eight));
            const __m256 hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(q, 4), eight));
            float *ylo = y + 8 * part, *yhi = y + 16 + 8 * part;
            _mm256_storeu_ps(ylo, _mm256_fmadd_ps(vs, lo, _mm256_loadu_ps(ylo)));
            _mm256_storeu_ps(yhi, _mm256_fmadd_ps(vs, hi, _mm256_loadu_ps(yhi)));
        }
    }
}

static const pyrt_row_ops ops_f32 = {.dot = dot_f32, .axpy = axpy_f32};
static const pyrt_row_ops ops_f16 = {.dot = dot_f16, .axpy = axpy_f16};
static const pyrt_row_ops ops_bf16 = {.dot = dot_bf16, .axpy = axpy_bf16};
AVX2 void pyrt_add_f32_avx2(float *y, const float *x, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(x + i)));
    for (; i < n; i++)
        y[i] += x[i];
}

/* x [n] f32 -> Q8_0 blocks, for finite x the same bytes as pyrt_quantize_x_q8_scalar (see the
 * AVX-512 twin in rows_avx512.c): NaN lanes ignored by the max, q the low byte of the truncated
 * int32 (masked to 0..255 and packed without saturation). */
AVX2 static inline float amax32_avx2(const float *xb) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) /* NaN lane: keeps m */
        m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xb + 8 * i), abs_mask), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

AVX2 static inline void store32_avx2(const float *xb, float amax, pyrt_xq8 *out) {
    const __m256i low_byte = _mm256_set1_epi32(0xFF);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    out->d = d;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q[4];
    for (int i = 0; i < 4; i++) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), vid),
                                         _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
        q[i] = _mm256_and_si256(_mm256_cvttps_epi32(r), low_byte);
    }
    /* packs work per 128-bit lane: bytes come out as q0[0..3] q1[0..3] q2[0..3] q3[0..3] |
     * q0[4..7] q1[4..7] ...; the dword permute puts them back in element order */
    const __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]),
                                          _mm256_packus_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)out->q, _mm256_permutevar8x32_epi32(p, order));
}

AVX2 void pyrt_quantize_x_q8_avx2(const float *x, pyrt_xq8 *out, int n) {
    for (int b = 0; b < n / PYRT_QK; b++)
        store32_avx2(x + (size_t)b * PYRT_QK, amax32_avx2(x + (size_t)b * PYRT_QK), out + b);
}

/* pyrt_quantize_x_q8k_scalar's bytes (for finite x), the pieces above per block of 32. */
AVX2 void pyrt_quantize_x_q8k_avx2(const float *x, pyrt_xq8 *out, int n) {
    int b = 0;
    for (; b + 8 <= n / PYRT_QK; b += 8) {
        float amax = 0.0f;
        for (int j = 0; j < 8; j++) {
            const float a = amax32_avx2(x + (size_t)(b + j) * PYRT_QK);
            amax = a > amax ? a : amax;
        }
        for (int j = 0; j < 8; j++)
            store32_avx2(x + (size_t)(b + j) * PYRT_QK, amax, out + b + j);
    }
    pyrt_quantize_x_q8_avx2(x + (size_t)b * PYRT_QK, out + b, n - b * PYRT_QK);
    pyrt_kq_store_sums(out, n);
}

static const pyrt_row_ops ops_q8_0 = {.dot = dot_q8_0,       .axpy = axpy_q8_0,
                                      .dot2 = dot2_q8_0,     .axpyn = axpyn_q8_0,
                                      .dot_pf = dot_pf_q8_0, .dot2_pf = dot2_pf_q8_0,
                                      .axpyn_pf = axpyn_pf_q8_0};
static const pyrt_row_ops ops_q4_0 = {.dot = dot_q4_0,       .axpy = axpy_q4_0,
                                      .dot2 = dot2_q4_0,     .axpyn = axpyn_q4_0,
                                      .dot_pf = dot_pf_q4_0, .dot2_pf = dot2_pf_q4_0,
                                      .axpyn_pf = axpyn_pf_q4_0};

const pyrt_row_ops *pyrt_row_ops_avx2(int fmt) {
    switch (fmt) {
    case PYRT_FMT_F32:
        return &ops_f32;
    case PYRT_FMT_F16:
        return &ops_f16;
    case PYRT_FMT_BF16:
        return &ops_bf16;
    case PYRT_FMT_Q8_0:
        return &ops_q8_0;
    case PYRT_FMT_Q4_0:
        return &ops_q4_0;
    case PYRT_FMT_MXFP4:
        return pyrt_row_ops_mxfp4_avx2();
    case PYRT_FMT_Q5_0:
    case PYRT_FMT_Q5_1:
        return pyrt_row_ops_q5_avx2(fmt);
    case PYRT_FMT_Q4_K:
    case PYRT_FMT_Q5_K:
    case PYRT_FMT_Q6_K:
        return pyrt_row_ops_kquant_avx2(fmt);
    default:
        return NULL;
    }
}

#else /* not x86-64: no AVX2 kernels; cpu.c never selects this level */

const pyrt_row_ops *pyrt_row_ops_avx2(int fmt) {
    (void)fmt;
    return NULL;
}

void pyrt_quantize_x_q8_avx2(const float *x, pyrt_xq8 *out, int n) {
    pyrt_quantize_x_q8_scalar(x, out, n);
}

void pyrt_quantize_x_q8k_avx2(const float *x, pyrt_xq8 *out, int n) {
    pyrt_quantize_x_q8k_scalar(x, out, n);
}

void pyrt_add_f32_avx2(float *y, const float *x, size_t n) {
    pyrt_add_f32_scalar(y, x, n);
}

#endif

/* AVX-512 tile kernels (rows.h): PYRT_TILE_ROWS quantized rows against up to PYRT_TILE_TOKENS
 * tokens (dot_tile), and quantized or float down rows into up to PYRT_AXPY_TOKENS tokens' y
 * (axpy_tile). Each result takes the operations of the row kernels of rows_avx512.c in their
 * order (the shared pieces are blocks_avx512.h's), so it is the same bits as a dot or an axpy.
 * The installed tables (rows_avx512.c) point here. */
#include "rows.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "blocks_avx512.h"
#include "tiles_avx512.h"

#define INLINE __attribute__((always_inline)) static inline
#define R PYRT_TILE_ROWS

/* ---- dot tiles ------------------------------------------------------------------------------
 * Per step (two blocks of 32), each row's int8 weights are loaded once and each token's once:
 * R x nt dots of QUANT_DOT's step, acc[r][t] += s * lanes, s = d_w * d_x of the lane's block.
 * The scales of 8 blocks are made per row (f16 -> f32) and per token, spread to a step's pair
 * of blocks by one permute each, and multiplied per (row, token): the products QUANT_DOT's
 * scales8 makes. nt is a constant in each caller of tile_body (always inlined), so the
 * accumulators live in registers. */

/* d_x of 8 consecutive blocks in lanes 0..7, as scales8 reads them. */
AVX512 static inline __m512 xscales8(const pyrt_xq8 *xq) {
    return _mm512_castps256_ps512(_mm256_setr_ps(xq[0].d, xq[1].d, xq[2].d, xq[3].d, xq[4].d,
                                                 xq[5].d, xq[6].d, xq[7].d));
}

#define QUANT_TILE(name, bb, load_block, TGT, PREP, LANES)                                        \
    TGT INLINE void tile_body_##name(const void *const *rows, const int nt,                       \
                                     const void *const *xs, int n, float *out, size_t ts,         \
                                     size_t rs) {                                                 \
        const uint8_t *w[R];                                                                      \
        const pyrt_xq8 *x[PYRT_TILE_TOKENS];                                                      \
        for (int r = 0; r < R; r++)                                                               \
            w[r] = rows[r];                                                                       \
        for (int t = 0; t < nt; t++)                                                              \
            x[t] = xs[t];                                                                         \
        const int nb = n / PYRT_QK;                                                               \
        __m512 acc[R][PYRT_TILE_TOKENS];                                                          \
        for (int r = 0; r < R; r++)                                                               \
            for (int t = 0; t < nt; t++)                                                          \
                acc[r][t] = _mm512_setzero_ps();                                                  \
        int b = 0;                                                                                \
        for (; b + 8 <= nb; b += 8) {                                                             \
            __m512 sw8[R], sx8[PYRT_TILE_TOKENS];                                                 \
            for (int r = 0; r < R; r++)                                                           \
                sw8[r] = _mm512_castps256_ps512(wscales8(w[r] + (size_t)b * (bb), (bb)));         \
            for (int t = 0; t < nt; t++)                                                          \
                sx8[t] = xscales8(x[t] + b);                                                      \
            _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) {                                 \
                const int bp = b + 2 * p;                                                         \
                const __m512i pi = pair_index(p);                                                 \
                __m512i wq[R];                                                                    \
                __m512 swp[R];                                                                    \
                for (int r = 0; r < R; r++) {                                                     \
                    wq[r] = LOAD_PAIR(load_block, w[r] + (size_t)bp * (bb), (bb));                \
                    swp[r] = _mm512_permutexvar_ps(pi, sw8[r]);                                   \
                }                                                                                 \
                for (int t = 0; t < nt; t++) {                                                    \
                    const __m256i x0 = _mm256_loadu_si256((const __m256i *)x[t][bp].q);          \
                    const __m256i x1 = _mm256_loadu_si256((const __m256i *)x[t][bp + 1].q);      \
                    const __m512i xv = join256(x0, x1);                                           \
                    const __m512i nx = PREP(xv);                                                  \
                    const __m512 sxp = _mm512_permutexvar_ps(pi, sx8[t]);                         \
                    for (int r = 0; r < R; r++)                                                   \
                        acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(swp[r], sxp),                   \
                                                    _mm512_cvtepi32_ps(LANES(wq[r], xv, nx)),     \
                                                    acc[r][t]);                                   \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (; b + 2 <= nb; b += 2) {                                                             \
            __m512i wq[R];                                                                        \
            float dw0[R], dw1[R];                                                                 \
            for (int r = 0; r < R; r++) {                                                         \
                const uint8_t *w0 = w[r] + (size_t)b * (bb);                                      \
                wq[r] = LOAD_PAIR(load_block, w0, (bb));                                          \
                dw0[r] = _cvtsh_ss(pyrt_load_u16(w0));                                            \
                dw1[r] = _cvtsh_ss(pyrt_load_u16(w0 + (bb)));                                     \
            }                                                                                     \
            for (int t = 0; t < nt; t++) {                                                        \
                const __m512i xv = join256(_mm256_loadu_si256((const __m256i *)x[t][b].q),        \
                                           _mm256_loadu_si256((const __m256i *)x[t][b + 1].q));   \
                const __m512i nx = PREP(xv);                                                      \
                for (int r = 0; r < R; r++) {                                                     \
                    const __m512 s = scales2(dw0[r] * x[t][b].d, dw1[r] * x[t][b + 1].d);         \
                    acc[r][t] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(LANES(wq[r], xv, nx)),      \
                                                acc[r][t]);                                       \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < R; r++)                                                               \
            for (int t = 0; t < nt; t++) {                                                        \
                float sum = _mm512_reduce_add_ps(acc[r][t]);                                      \
                if (b < nb) {                                                                     \
                    const uint8_t *w0 = w[r] + (size_t)b * (bb);                                  \
                    sum += dot_one_block(load_block(w0), &x[t][b], _cvtsh_ss(pyrt_load_u16(w0))); \
                }                                                                                 \
                out[(size_t)t * ts + (size_t)r * rs] = sum;                                       \
            }                                                                                     \
    }                                                                                             \
    TGT void pyrt_dot_tile_##name(const void *const *rows, int nt, const void *const *xs, int n,  \
                                  float *out, size_t ts, size_t rs) {                             \
        switch (nt) {                                                                             \
        case 1:                                                                                   \
            tile_body_##name(rows, 1, xs, n, out, ts, rs);                                        \
            break;                                                                                \
        case 2:                                                                                   \
            tile_body_##name(rows, 2, xs, n, out, ts, rs);                                        \
            break;                                                                                \
        case 3:                                                                                   \
            tile_body_##name(rows, 3, xs, n, out, ts, rs);                                        \
            break;                                                                                \
        default:                                                                                  \
            tile_body_##name(rows, 4, xs, n, out, ts, rs);                                        \
        }                                                                                         \
    }

QUANT_TILE(q8_0, PYRT_Q8_0_BYTES, LOAD_Q8_0, AVX512, PREP_BW, LANES_BW)
QUANT_TILE(q4_0, PYRT_Q4_0_BYTES, LOAD_Q4_0, AVX512, PREP_BW, LANES_BW)
QUANT_TILE(q8_0_vnni, PYRT_Q8_0_BYTES, LOAD_Q8_0, AVX512VNNI, neg_x128, dot64_vnni)

/* ---- axpy tiles -----------------------------------------------------------------------------
 * Per block of 32 of y, the nt tokens' y (two registers each) are loaded once, take every row's
 * contribution in row order and are stored once: per (row, token), vs = a * d_w (f32) and
 * y += vs * w, as axpy does. */

#define QUANT_AXPY_TILE(name, bb, DEQUANT)                                                        \
    AVX512 INLINE void axpy_body_##name(int nr, const void *const *rows, const float *const *a,   \
                                        const int nt, float *const *ys, int n) {                  \
        for (int b = 0; b < n / PYRT_QK; b++) {                                                   \
            __m512 y0[PYRT_AXPY_TOKENS], y1[PYRT_AXPY_TOKENS];                                    \
            for (int t = 0; t < nt; t++) {                                                        \
                y0[t] = _mm512_loadu_ps(ys[t] + (size_t)b * PYRT_QK);                             \
                y1[t] = _mm512_loadu_ps(ys[t] + (size_t)b * PYRT_QK + 16);                        \
            }                                                                                     \
            for (int r = 0; r < nr; r++) {                                                        \
                const uint8_t *w = (const uint8_t *)rows[r] + (size_t)b * (bb);                   \
                const float dw = _cvtsh_ss(pyrt_load_u16(w));                                     \
                __m512 q0, q1;                                                                    \
                DEQUANT(w, q0, q1);                                                               \
                const float *ar = a[r];                                                           \
                for (int t = 0; t < nt; t++) {                                                    \
                    const __m512 vs = _mm512_set1_ps(ar[t] * dw);                                 \
                    y0[t] = _mm512_fmadd_ps(vs, q0, y0[t]);                                       \
                    y1[t] = _mm512_fmadd_ps(vs, q1, y1[t]);                                       \
                }                                                                                 \
            }                                                                                     \
            for (int t = 0; t < nt; t++) {                                                        \
                _mm512_storeu_ps(ys[t] + (size_t)b * PYRT_QK, y0[t]);                             \
                _mm512_storeu_ps(ys[t] + (size_t)b * PYRT_QK + 16, y1[t]);                        \
            }                                                                                     \
        }                                                                                         \
    }

/* The 32 weights of a block as f32 (as axpy_q8_0 / axpy_q4_0 widen them). */
#define DEQUANT_Q8_0(w, q0, q1)                                                                   \
    do {                                                                                          \
        q0 = _mm512_cvtepi32_ps(                                                                  \
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((w) + 2))));                   \
        q1 = _mm512_cvtepi32_ps(                                                                  \
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((w) + 18))));                  \
    } while (0)
#define DEQUANT_Q4_0(w, q0, q1)                                                                   \
    do {                                                                                          \
        const __m512i m4_ = _mm512_set1_epi32(0xF), eight_ = _mm512_set1_epi32(8);                \
        const __m512i q_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((w) + 2)));     \
        q0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(q_, m4_), eight_));             \
        q1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(q_, 4), eight_));              \
    } while (0)

QUANT_AXPY_TILE(q8_0, PYRT_Q8_0_BYTES, DEQUANT_Q8_0)
QUANT_AXPY_TILE(q4_0, PYRT_Q4_0_BYTES, DEQUANT_Q4_0)

/* Float rows: y += a * w per 16 lanes, masked at the tail, as the float axpy kernels. */
#define FLOAT_AXPY_TILE(name, load16)                                                             \
    AVX512 INLINE void axpy_body_##name(int nr, const void *const *rows, const float *const *a,   \
                                        const int nt, float *const *ys, int n) {                  \
        for (int i = 0; i < n; i += 16) {                                                         \
            const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);          \
            __m512 y[PYRT_AXPY_TOKENS];                                                           \
            for (int t = 0; t < nt; t++)                                                          \
                y[t] = _mm512_maskz_loadu_ps(m, ys[t] + i);                                       \
            for (int r = 0; r < nr; r++) {                                                        \
                const __m512 w = load16(rows[r], i, m);                                           \
                for (int t = 0; t < nt; t++)                                                      \
                    y[t] = _mm512_fmadd_ps(_mm512_set1_ps(a[r][t]), w, y[t]);                     \
            }                                                                                     \
            for (int t = 0; t < nt; t++)                                                          \
                _mm512_mask_storeu_ps(ys[t] + i, m, y[t]);                                        \
        }                                                                                         \
    }

FLOAT_AXPY_TILE(f32, load16_f32)
FLOAT_AXPY_TILE(f16, load16_f16)
FLOAT_AXPY_TILE(bf16, load16_bf16)

/* nt a constant in each call of the body, so its y live in registers. */
#define AXPY_TILE(name)                                                                           \
    AVX512 void pyrt_axpy_tile_##name(int nr, const void *const *rows, const float *const *a,     \
                                      int nt, float *const *ys, int n) {                          \
        switch (nt) {                                                                             \
        case 1:                                                                                   \
            axpy_body_##name(nr, rows, a, 1, ys, n);                                              \
            break;                                                                                \
        case 2:                                                                                   \
            axpy_body_##name(nr, rows, a, 2, ys, n);                                              \
            break;                                                                                \
        case 3:                                                                                   \
            axpy_body_##name(nr, rows, a, 3, ys, n);                                              \
            break;                                                                                \
        case 4:                                                                                   \
            axpy_body_##name(nr, rows, a, 4, ys, n);                                              \
            break;                                                                                \
        case 5:                                                                                   \
            axpy_body_##name(nr, rows, a, 5, ys, n);                                              \
            break;                                                                                \
        case 6:                                                                                   \
            axpy_body_##name(nr, rows, a, 6, ys, n);                                              \
            break;                                                                                \
        case 7:                                                                                   \
            axpy_body_##name(nr, rows, a, 7, ys, n);                                              \
            break;                                                                                \
        default:                                                                                  \
            axpy_body_##name(nr, rows, a, 8, ys, n);                                              \
        }                                                                                         \
    }

AXPY_TILE(q8_0)
AXPY_TILE(q4_0)
AXPY_TILE(f32)
AXPY_TILE(f16)
AXPY_TILE(bf16)

#endif

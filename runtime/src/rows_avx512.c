/* AVX-512 (F + BW) row kernels: 16 f32 lanes, two quantized blocks per 512-bit vector, masked
 * tails. Per-function target attributes, called only after cpuid said yes (cpu.c). */
#include "rows.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "blocks_avx512.h"
#include "tiles_avx512.h"
#include "blocks_kquant_x86.h"

#define FLOAT_ROW_KERNELS(name, load16)                                                           \
    AVX512 static float dot_##name(const void *row, const void *x, int n) {                       \
        const float *xf = x;                                                                      \
        const __mmask16 all = 0xFFFF;                                                             \
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();                                \
        int i = 0;                                                                                \
        for (; i + 32 <= n; i += 32) {                                                            \
            a0 = _mm512_fmadd_ps(load16(row, i, all), _mm512_loadu_ps(xf + i), a0);               \
            a1 = _mm512_fmadd_ps(load16(row, i + 16, all), _mm512_loadu_ps(xf + i + 16), a1);     \
        }                                                                                         \
        for (; i < n; i += 16) {                                                                  \
            const __mmask16 m = n - i >= 16 ? all : (__mmask16)((1u << (n - i)) - 1);             \
            a0 = _mm512_fmadd_ps(load16(row, i, m), _mm512_maskz_loadu_ps(m, xf + i), a0);        \
        }                                                                                         \
        return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));                                       \
    }                                                                                             \
    AVX512 static void axpy_##name(float a, const void *row, float *y, int n) {                   \
        const __m512 va = _mm512_set1_ps(a);                                                      \
        for (int i = 0; i < n; i += 16) {                                                         \
            const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);          \
            const __m512 yi = _mm512_maskz_loadu_ps(m, y + i);                                    \
            _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(va, load16(row, i, m), yi));          \
        }                                                                                         \
    }

FLOAT_ROW_KERNELS(f32, load16_f32)
FLOAT_ROW_KERNELS(f16, load16_f16)
FLOAT_ROW_KERNELS(bf16, load16_bf16)

/* ---- quantized formats: dots -------------------------------------------------------------
 *
 * One row (dot) or two (dot2) against one quantized activation vector x (pyrt_xq8 blocks), two
 * blocks per 512-bit step. Each step makes 16 int32 lanes (lanes 0..7: block b's 32 products
 * summed in groups of 4 bytes, lanes 8..15: block b+1's), converts them to f32 and accumulates
 * acc += s * lanes with s = d_w * d_x of the lane's block. The scales of 8 blocks are converted
 * (f16 -> f32) and multiplied in one vector, then spread over each step's lanes by one permute
 * (per step this replaced two scalar conversions, two multiplies, two broadcasts and a blend: 5%
 * faster on 16 Sapphire Rapids cores); the f32 products and the accumulation order are
 * unchanged, so are the results. Where the CPU has AVX512_VNNI, the int32 lanes come from
 * vpdpbusd instead (ops_q8_0_vnni below, the same bits). */

/* dot_pf / dot: one row; the prefetches of pf[0 .. n_pf-1] are spread over the steps. */
#define QUANT_DOT(name, bb, load_block, TGT, PREP, LANES)                                                           \
    TGT static float dot_pf_##name(const void *row, const void *x, int n,                      \
                                    const void *const *pf, int n_pf) {                            \
        const uint8_t *w = row;                                                                   \
        const pyrt_xq8 *xq = x;                                                                   \
        const int nb = n / PYRT_QK;                                                               \
        pyrt_pf_spread ps = pyrt_pf_begin(pf, n_pf, nb / 2);                                      \
        __m512 acc = _mm512_setzero_ps();                                                         \
        int b = 0;                                                                                \
        for (; b + 8 <= nb; b += 8) {                                                             \
            const __m512 s8 = scales8(w + (size_t)b * (bb), (bb), xq + b);                        \
            _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) {                                 \
                const int bp = b + 2 * p;                                                         \
                const __m512i xv = join256(_mm256_loadu_si256((const __m256i *)xq[bp].q),         \
                                           _mm256_loadu_si256((const __m256i *)xq[bp + 1].q));    \
                const __m512i nx = PREP(xv);                                                      \
                const __m512i wq = LOAD_PAIR(load_block, w + (size_t)bp * (bb), (bb));            \
                const __m512 s = _mm512_permutexvar_ps(pair_index(p), s8);                        \
                acc = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(LANES(wq, xv, nx)), acc);              \
                pyrt_pf_tick(&ps);                                                                \
            }                                                                                     \
        }                                                                                         \
        for (; b + 2 <= nb; b += 2) {                                                             \
            const uint8_t *w0 = w + (size_t)b * (bb), *w1 = w0 + (bb);                            \
            const __m512i xv = join256(_mm256_loadu_si256((const __m256i *)xq[b].q),              \
                                       _mm256_loadu_si256((const __m256i *)xq[b + 1].q));         \
            const __m512i nx = PREP(xv);                                                          \
            const __m512i wq = LOAD_PAIR(load_block, w0, (bb));                                   \
            const __m512 s = scales2(_cvtsh_ss(pyrt_load_u16(w0)) * xq[b].d,                      \
                                     _cvtsh_ss(pyrt_load_u16(w1)) * xq[b + 1].d);                 \
            acc = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(LANES(wq, xv, nx)), acc);                  \
            pyrt_pf_tick(&ps);                                                                    \
        }                                                                                         \
        pyrt_pf_end(&ps);                                                                         \
        float sum = _mm512_reduce_add_ps(acc);                                                    \
        if (b < nb) {                                                                             \
            const uint8_t *w0 = w + (size_t)b * (bb);                                             \
            sum += dot_one_block(load_block(w0), &xq[b], _cvtsh_ss(pyrt_load_u16(w0)));           \
        }                                                                                         \
        return sum;                                                                               \
    }                                                                                             \
    TGT static float dot_##name(const void *row, const void *x, int n) {                       \
        return dot_pf_##name(row, x, n, NULL, 0);                                                 \
    }

/* Two rows against one x in one pass: per row exactly the operations of QUANT_DOT (bit for bit
 * two dot calls), x's blocks and scales loaded once for both. */
#define QUANT_DOT2(name, bb, load_block, TGT, PREP, LANES)                                                          \
    TGT static void dot2_pf_##name(const void *row0, const void *row1, const void *x, int n,   \
                                    float out[2], const void *const *pf, int n_pf) {              \
        const uint8_t *wr[2] = {row0, row1};                                                      \
        const pyrt_xq8 *xq = x;                                                                   \
        const int nb = n / PYRT_QK;                                                               \
        pyrt_pf_spread ps = pyrt_pf_begin(pf, n_pf, nb / 2);                                      \
        __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};                               \
        int b = 0;                                                                                \
        for (; b + 8 <= nb; b += 8) {                                                             \
            __m512 s8[2];                                                                         \
            s8[0] = scales8(wr[0] + (size_t)b * (bb), (bb), xq + b);                              \
            s8[1] = scales8(wr[1] + (size_t)b * (bb), (bb), xq + b);                              \
            _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) {                                 \
                const int bp = b + 2 * p;                                                         \
                const __m512i xv = join256(_mm256_loadu_si256((const __m256i *)xq[bp].q),         \
                                           _mm256_loadu_si256((const __m256i *)xq[bp + 1].q));    \
                const __m512i nx = PREP(xv);                                                      \
                for (int r = 0; r < 2; r++) {                                                     \
                    const __m512i wq = LOAD_PAIR(load_block, wr[r] + (size_t)bp * (bb), (bb));    \
                    const __m512 s = _mm512_permutexvar_ps(pair_index(p), s8[r]);                 \
                    acc[r] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(LANES(wq, xv, nx)), acc[r]);    \
                }                                                                                 \
                pyrt_pf_tick(&ps);                                                                \
            }                                                                                     \
        }                                                                                         \
        for (; b + 2 <= nb; b += 2) {                                                             \
            const __m512i xv = join256(_mm256_loadu_si256((const __m256i *)xq[b].q),              \
                                       _mm256_loadu_si256((const __m256i *)xq[b + 1].q));         \
            const __m512i nx = PREP(xv);                                                          \
            for (int r = 0; r < 2; r++) {                                                         \
                const uint8_t *w0 = wr[r] + (size_t)b * (bb), *w1 = w0 + (bb);                    \
                const __m512i wq = LOAD_PAIR(load_block, w0, (bb));                               \
                const __m512 s = scales2(_cvtsh_ss(pyrt_load_u16(w0)) * xq[b].d,                  \
                                         _cvtsh_ss(pyrt_load_u16(w1)) * xq[b + 1].d);             \
                acc[r] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(LANES(wq, xv, nx)), acc[r]);        \
            }                                                                                     \
            pyrt_pf_tick(&ps);                                                                    \
        }                                                                                         \
        pyrt_pf_end(&ps);                                                                         \
        for (int r = 0; r < 2; r++) {                                                             \
            float sum = _mm512_reduce_add_ps(acc[r]);                                             \
            if (b < nb) {                                                                         \
                const uint8_t *w0 = wr[r] + (size_t)b * (bb);                                     \
                sum += dot_one_block(load_block(w0), &xq[b], _cvtsh_ss(pyrt_load_u16(w0)));       \
            }                                                                                     \
            out[r] = sum;                                                                         \
        }                                                                                         \
    }                                                                                             \
    TGT static void dot2_##name(const void *row0, const void *row1, const void *x, int n,      \
                                 float out[2]) {                                                  \
        dot2_pf_##name(row0, row1, x, n, out, NULL, 0);                                           \
    }

QUANT_DOT(q8_0, PYRT_Q8_0_BYTES, LOAD_Q8_0, AVX512, PREP_BW, LANES_BW)
QUANT_DOT(q4_0, PYRT_Q4_0_BYTES, LOAD_Q4_0, AVX512, PREP_BW, LANES_BW)
QUANT_DOT2(q8_0, PYRT_Q8_0_BYTES, LOAD_Q8_0, AVX512, PREP_BW, LANES_BW)
QUANT_DOT2(q4_0, PYRT_Q4_0_BYTES, LOAD_Q4_0, AVX512, PREP_BW, LANES_BW)

/* ---- quantized formats: dots with AVX512_VNNI ----------------------------------------------
 * The same int32 lanes as dot64_i8 in fewer instructions: vpdpbusd multiplies unsigned by
 * signed bytes and sums each group of 4 into an int32 lane, so it takes w + 128 (w ^ 0x80 read
 * unsigned, 0..255) times x and starts from -128 * (sum of the lane's 4 x bytes), made once per
 * x vector (shared by dot2's rows): sum (w + 128) x - 128 sum x = sum w x, exactly (|lanes| <=
 * 4 * 255 * 127, no overflow). Per pair step and row one xor and one vpdpbusd replace
 * vpmovb2m, vpabsb, a masked vpsubb, vpmaddubsw and vpmaddwd, and the rest (scales, order of
 * the f32 accumulation) is QUANT_DOT's: the same bits. The step is bound by the vector ports
 * (~25 GB/s of Q8_0 rows per core from L2 on a 2.6 GHz Sapphire Rapids), and a core streaming
 * from DRAM overlaps the arithmetic with its misses only partly, so fewer instructions per byte
 * also raise the rate at which one core streams rows from DRAM. */
QUANT_DOT(q8_0_vnni, PYRT_Q8_0_BYTES, LOAD_Q8_0, AVX512VNNI, neg_x128, dot64_vnni)
QUANT_DOT2(q8_0_vnni, PYRT_Q8_0_BYTES, LOAD_Q8_0, AVX512VNNI, neg_x128, dot64_vnni)

/* ---- quantized formats: axpy --------------------------------------------------------------- */

/* Several down rows into one y: a block of y (two registers) is loaded once, takes every row's
 * contribution in row order (bit for bit nr axpy calls), and is stored once. Per row and block,
 * y0/y1 (elements 0..15 / 16..31) += vs * the block's weights, vs = a[r] * d_w broadcast. */
#define BLOCK_FMA_Q8_0(vs, w, y0, y1)                                                             \
    do {                                                                                          \
        const __m128i q0_ = _mm_loadu_si128((const __m128i *)((w) + 2));                          \
        const __m128i q1_ = _mm_loadu_si128((const __m128i *)((w) + 18));                         \
        y0 = _mm512_fmadd_ps(vs, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0_)), y0);              \
        y1 = _mm512_fmadd_ps(vs, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1_)), y1);              \
    } while (0)
#define BLOCK_FMA_Q4_0(vs, w, y0, y1)                                                             \
    do {                                                                                          \
        const __m512i m4_ = _mm512_set1_epi32(0xF), eight_ = _mm512_set1_epi32(8);                \
        const __m512i q_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((w) + 2)));     \
        const __m512i lo_ = _mm512_sub_epi32(_mm512_and_si512(q_, m4_), eight_);                  \
        const __m512i hi_ = _mm512_sub_epi32(_mm512_srli_epi32(q_, 4), eight_);                   \
        y0 = _mm512_fmadd_ps(vs, _mm512_cvtepi32_ps(lo_), y0);                                    \
        y1 = _mm512_fmadd_ps(vs, _mm512_cvtepi32_ps(hi_), y1);                                    \
    } while (0)

/* Per 8 blocks, each row's 8 scales times a[r] in one vector (the same products a[r] * d_w as
 * one at a time), stored, then broadcast from memory per (row, block): a load, no shuffle. */
#define QUANT_AXPYN(name, bb, BLOCK_FMA)                                                          \
    AVX512 static void axpyn_pf_##name(int nr, const float *a, const void *const *rows, float *y, \
                                       int n, const void *const *pf, int n_pf) {                  \
        const int nb = n / PYRT_QK;                                                               \
        pyrt_pf_spread ps = pyrt_pf_begin(pf, n_pf, nb);                                          \
        float sc[PYRT_AXPY_ROWS][8]; /* a[r] * d_w of the group's 8 blocks */                     \
        int b = 0;                                                                                \
        for (; b + 8 <= nb; b += 8) {                                                             \
            for (int r = 0; r < nr; r++) {                                                        \
                const uint8_t *w = (const uint8_t *)rows[r] + (size_t)b * (bb);                   \
                _mm256_storeu_ps(sc[r], _mm256_mul_ps(_mm256_set1_ps(a[r]), wscales8(w, (bb))));  \
            }                                                                                     \
            for (int i = 0; i < 8; i++, y += PYRT_QK) {                                           \
                __m512 y0 = _mm512_loadu_ps(y), y1 = _mm512_loadu_ps(y + 16);                     \
                for (int r = 0; r < nr; r++) {                                                    \
                    const uint8_t *w = (const uint8_t *)rows[r] + (size_t)(b + i) * (bb);         \
                    BLOCK_FMA(_mm512_set1_ps(sc[r][i]), w, y0, y1);                               \
                }                                                                                 \
                _mm512_storeu_ps(y, y0);                                                          \
                _mm512_storeu_ps(y + 16, y1);                                                     \
                pyrt_pf_tick(&ps);                                                                \
            }                                                                                     \
        }                                                                                         \
        for (; b < nb; b++, y += PYRT_QK) {                                                       \
            __m512 y0 = _mm512_loadu_ps(y), y1 = _mm512_loadu_ps(y + 16);                         \
            for (int r = 0; r < nr; r++) {                                                        \
                const uint8_t *w = (const uint8_t *)rows[r] + (size_t)b * (bb);                   \
                const __m512 vs = _mm512_set1_ps(a[r] * _cvtsh_ss(pyrt_load_u16(w)));             \
                BLOCK_FMA(vs, w, y0, y1);                                                         \
            }                                                                                     \
            _mm512_storeu_ps(y, y0);                                                              \
            _mm512_storeu_ps(y + 16, y1);                                                         \
            pyrt_pf_tick(&ps);                                                                    \
        }                                                                                         \
        pyrt_pf_end(&ps);                                                                         \
    }                                                                                             \
    AVX512 static void axpyn_##name(int nr, const float *a, const void *const *rows, float *y,    \
                                    int n) {                                                      \
        axpyn_pf_##name(nr, a, rows, y, n, NULL, 0);                                              \
    }

QUANT_AXPYN(q8_0, PYRT_Q8_0_BYTES, BLOCK_FMA_Q8_0)
QUANT_AXPYN(q4_0, PYRT_Q4_0_BYTES, BLOCK_FMA_Q4_0)

/* Axpy kernels widen the quants straight from memory (vpmovsxbd / vpmovzxbd, memory operand). */
AVX512 static void axpy_q8_0(float a, const void *row, float *y, int n) {
    const uint8_t *w = row;
    for (int b = 0; b < n / PYRT_QK; b++, w += PYRT_Q8_0_BYTES, y += PYRT_QK) {
        const __m512 vs = _mm512_set1_ps(a * _cvtsh_ss(pyrt_load_u16(w)));
        for (int part = 0; part < 2; part++) {
            const __m128i q8 = _mm_loadu_si128((const __m128i *)(w + 2 + 16 * part));
            const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8));
            _mm512_storeu_ps(y + 16 * part,
                             _mm512_fmadd_ps(vs, f, _mm512_loadu_ps(y + 16 * part)));
        }
    }
}

AVX512 static void axpy_q4_0(float a, const void *row, float *y, int n) {
    const uint8_t *w = row;
    const __m512i m4 = _mm512_set1_epi32(0xF), eight = _mm512_set1_epi32(8);
    for (int b = 0; b < n / PYRT_QK; b++, w += PYRT_Q4_0_BYTES, y += PYRT_QK) {
        const __m512 vs = _mm512_set1_ps(a * _cvtsh_ss(pyrt_load_u16(w)));
        /* the 16 bytes qs: low nibbles are elements 0..15, high nibbles 16..31 */
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 2)));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(q, m4), eight));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight));
        _mm512_storeu_ps(y, _mm512_fmadd_ps(vs, lo, _mm512_loadu_ps(y)));
        _mm512_storeu_ps(y + 16, _mm512_fmadd_ps(vs, hi, _mm512_loadu_ps(y + 16)));
    }
}

AVX512 void pyrt_add_f32_avx512(float *y, const float *x, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_add_ps(_mm512_loadu_ps(y + i), _mm512_loadu_ps(x + i)));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(y + i, m,
                              _mm512_add_ps(_mm512_maskz_loadu_ps(m, y + i),
                                            _mm512_maskz_loadu_ps(m, x + i)));
    }
}

/* x [n] f32 -> Q8_0 blocks, for finite x the same bytes as pyrt_quantize_x_q8_scalar: per
 * block of 32, amax = max |x| with NaN lanes ignored (max(v, acc) returns acc where v is NaN, as
 * fmaxf), d = amax / 127, q = low byte of the truncated int32 of x * (1/d) rounded in the current
 * mode (vpmovdb truncates, as the scalar (int8_t) cast of cvttss2si). ~0.1 us for 2048 floats
 * where the scalar code calls fmaxf and nearbyintf per element (~10 us). */
AVX512 static inline float amax32_avx512(const float *xb) {
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const __m512 zero = _mm512_setzero_ps();
    return _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_abs_ps(v1), _mm512_max_ps(_mm512_abs_ps(v0), zero)));
}

AVX512 static inline void store32_avx512(const float *xb, float amax, pyrt_xq8 *out) {
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    out->d = d;
    const __m512 vid = _mm512_set1_ps(id);
    const int rnd = _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC;
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const __m512i q0 = _mm512_cvttps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v0, vid), rnd));
    const __m512i q1 = _mm512_cvttps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v1, vid), rnd));
    _mm_storeu_si128((__m128i *)out->q, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(out->q + 16), _mm512_cvtepi32_epi8(q1));
}

AVX512 void pyrt_quantize_x_q8_avx512(const float *x, pyrt_xq8 *out, int n) {
    for (int b = 0; b < n / PYRT_QK; b++)
        store32_avx512(x + (size_t)b * PYRT_QK, amax32_avx512(x + (size_t)b * PYRT_QK), out + b);
}

/* pyrt_quantize_x_q8k_scalar's bytes (for finite x), the pieces above per block of 32. */
AVX512 void pyrt_quantize_x_q8k_avx512(const float *x, pyrt_xq8 *out, int n) {
    int b = 0;
    for (; b + 8 <= n / PYRT_QK; b += 8) {
        float amax = 0.0f;
        for (int j = 0; j < 8; j++) {
            const float a = amax32_avx512(x + (size_t)(b + j) * PYRT_QK);
            amax = a > amax ? a : amax;
        }
        for (int j = 0; j < 8; j++)
            store32_avx512(x + (size_t)(b + j) * PYRT_QK, amax, out + b + j);
    }
    pyrt_quantize_x_q8_avx512(x + (size_t)b * PYRT_QK, out + b, n - b * PYRT_QK);
    pyrt_kq_store_sums(out, n);
}

static const pyrt_row_ops ops_f32 = {.dot = dot_f32, .axpy = axpy_f32,
                                     .axpy_tile = pyrt_axpy_tile_f32};
static const pyrt_row_ops ops_f16 = {.dot = dot_f16, .axpy = axpy_f16,
                                     .axpy_tile = pyrt_axpy_tile_f16};
static const pyrt_row_ops ops_bf16 = {.dot = dot_bf16, .axpy = axpy_bf16,
                                      .axpy_tile = pyrt_axpy_tile_bf16};

static const pyrt_row_ops ops_q8_0 = {dot_q8_0,    axpy_q8_0,    dot2_q8_0,    axpyn_q8_0,
                                      dot_pf_q8_0, dot2_pf_q8_0, axpyn_pf_q8_0,
                                      pyrt_dot_tile_q8_0, pyrt_axpy_tile_q8_0, NULL};
static const pyrt_row_ops ops_q8_0_vnni = {dot_q8_0_vnni,    axpy_q8_0,
                                           dot2_q8_0_vnni,   axpyn_q8_0,
                                           dot_pf_q8_0_vnni, dot2_pf_q8_0_vnni,
                                           axpyn_pf_q8_0,    pyrt_dot_tile_q8_0_vnni,
                                           pyrt_axpy_tile_q8_0, NULL};
static const pyrt_row_ops ops_q4_0 = {dot_q4_0,    axpy_q4_0,    dot2_q4_0,    axpyn_q4_0,
                                      dot_pf_q4_0, dot2_pf_q4_0, axpyn_pf_q4_0,
                                      pyrt_dot_tile_q4_0, pyrt_axpy_tile_q4_0, NULL};
const pyrt_row_ops *pyrt_row_ops_avx512(int fmt) {
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
        return pyrt_row_ops_mxfp4_avx512(0);
    case PYRT_FMT_Q5_0:
    case PYRT_FMT_Q5_1:
        return pyrt_row_ops_q5_avx2(fmt);
    case PYRT_FMT_Q4_K:
    case PYRT_FMT_Q5_K:
    case PYRT_FMT_Q6_K:
        return pyrt_row_ops_kquant_avx512(fmt, 0);
    default:
        return NULL;
    }
}

const pyrt_row_ops *pyrt_row_ops_avx512_vnni(int fmt) {
    if (fmt == PYRT_FMT_Q4_K || fmt == PYRT_FMT_Q5_K || fmt == PYRT_FMT_Q6_K)
        return pyrt_row_ops_kquant_avx512(fmt, 1);
    if (fmt == PYRT_FMT_MXFP4)
        return pyrt_row_ops_mxfp4_avx512(1);
    return fmt == PYRT_FMT_Q8_0 ? &ops_q8_0_vnni : pyrt_row_ops_avx512(fmt);
}

#else /* not x86-64 */

const pyrt_row_ops *pyrt_row_ops_avx512(int fmt) {
    (void)fmt;
    return NULL;
}

const pyrt_row_ops *pyrt_row_ops_avx512_vnni(int fmt) {
    (void)fmt;
    return NULL;
}

void pyrt_quantize_x_q8_avx512(const float *x, pyrt_xq8 *out, int n) {
    pyrt_quantize_x_q8_scalar(x, out, n);
}

void pyrt_quantize_x_q8k_avx512(const float *x, pyrt_xq8 *out, int n) {
    pyrt_quantize_x_q8k_scalar(x, out, n);
}

void pyrt_add_f32_avx512(float *y, const float *x, size_t n) {
    pyrt_add_f32_scalar(y, x, n);
}

#endif

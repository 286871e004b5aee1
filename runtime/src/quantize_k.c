/* pyrt_quantize_rows: float32 rows -> Q4_K, Q5_K or Q6_K super-blocks, the bytes llama-quantize
 * writes without an importance matrix (ggml's reference row quantizers). Every float operation
 * below is done in the reference's order and precision, so the output is bit-exact with it:
 *
 * - Q4_K / Q5_K: per sub-block of 32 a scale s > 0 and an offset m <= 0 (x ~ s q + m, q in
 *   0..nmax), from a weighted least-squares search over nstep + 1 stretched grids (weights
 *   sqrt(mean x^2) + |x|, the min/max grid kept when none beats it); then the 8 scales and the
 *   8 -m quantized to 6 bits against f16 super-block scales d = max s / 63, dmin = max -m / 63,
 *   and the codes recomputed from those rounded values;
 * - Q6_K: per sub-block of 16 a symmetric scale from 19 grids around -32 / (the largest-|x|
 *   value), weights x^2; the 16 scales as int8 against d = (the largest-|scale| one) / -128.
 *
 * The grid searches (quantize_k_search.h) run on 4 sub-blocks at once, 8 on AVX2 CPUs, one per
 * lane of a GCC vector: a lane does the reference's scalar operations in the reference's order,
 * so lanes change speed, never bits. No FMA contraction anywhere: GCC does not contract in ISO C
 * mode (the build's -std=c11), clang is told so below. */
#include <math.h>
#include <string.h>

#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif

#include "kquant_rows.h"

enum { SUB = 32, NSUB = PYRT_QK_K / SUB, SUB6 = 16, NSUB6 = PYRT_QK_K / SUB6 };

/* Smallest |x| a Q6_K sub-block (and super-block scale) is treated as non-zero from. */
static const float GROUP_EPS = 1e-15f;

/* Round to the nearest integer, ties to even, for |f| < 2^22: adding 1.5 * 2^23 leaves the
 * rounded value in the low mantissa bits. */
static inline int round_int(float f) {
    const float shifted = f + 12582912.f;
    int32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    return (bits & 0x007fffff) - 0x00400000;
}

/* float -> IEEE half, round to nearest even (subnormals, overflow to inf). */
static uint16_t fp32_to_fp16(float f) {
    const uint32_t w = pyrt_fp32_to_bits(f);
    const uint16_t sign = (uint16_t)((w >> 16) & 0x8000);
    const uint32_t a = w & 0x7fffffff;
    if (a > 0x7f800000)
        return sign | 0x7e00; /* NaN */
    if (a >= 0x477ff000)
        return sign | 0x7c00; /* >= 65520 rounds to inf */
    if (a <= 0x33000000)
        return sign; /* <= 2^-25 rounds to 0 */
    const uint32_t e = a >> 23, mant = a & 0x7fffff;
    uint32_t h, rem, half;
    if (e < 113) { /* below 2^-14: a subnormal half, units of 2^-24 */
        const uint32_t m = mant | 0x800000, shift = 126 - e;
        h = m >> shift;
        rem = m & ((1u << shift) - 1);
        half = 1u << (shift - 1);
    } else {
        h = ((e - 112) << 10) | (mant >> 13);
        rem = mant & 0x1fff;
        half = 0x1000;
    }
    if (rem > half || (rem == half && (h & 1)))
        h++; /* a carry out of the mantissa raises the exponent, as it should */
    return sign | (uint16_t)h;
}

static inline void store_f16(uint8_t *p, float f) {
    const uint16_t h = fp32_to_fp16(f);
    memcpy(p, &h, 2);
}

static inline float load_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return pyrt_fp16_to_fp32(h);
}

/* ---- the searches, on 4 lanes and (x86-64, GCC) on 8 ----------------------------------------- */

#define QK_LANES 4
#define QK_NAME(name) name##_4
#include "quantize_k_search.h"
#undef QK_LANES
#undef QK_NAME

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("avx2")
#define QK_LANES 8
#define QK_NAME(name) name##_8
#include "quantize_k_search.h"
#undef QK_LANES
#undef QK_NAME
#pragma GCC pop_options
#define QK_HAVE_8_LANES 1
#endif

/* The searches one call uses: 8 lanes where the CPU has AVX2 and the build them. */
typedef struct {
    int lanes;
    void (*fit_min)(int nmax, const float *x, uint8_t *L, float *scales, float *neg_mins,
                    float rmin, float rdelta, int nstep);
    void (*fit_q6)(const float *x, uint8_t *L, float *scales);
} searches;

static searches pick_searches(void) {
#ifdef QK_HAVE_8_LANES
    if (pyrt_simd_active() >= PYRT_SIMD_AVX2)
        return (searches){8, fit_scale_min_8, fit_scale_q6_8};
#endif
    return (searches){4, fit_scale_min_4, fit_scale_q6_4};
}

/* ---- Q4_K / Q5_K: scale and min per sub-block of 32 ------------------------------------------ */

/* One super-block x[256] -> d, dmin (f16 bytes at out, out + 2), the 12 packed 6-bit scale and
 * min bytes at out + 4, and codes L[256] (0..nmax). */
static void k_min_block(const searches *sr, int nmax, float rmin, int nstep, const float *x,
                        uint8_t *out, uint8_t *L) {
    float scales[NSUB], mins[NSUB];
    for (int j = 0; j < NSUB; j += sr->lanes)
        sr->fit_min(nmax, x + SUB * j, L + SUB * j, scales + j, mins + j, rmin, 0.1f, nstep);
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < NSUB; j++) {
        if (scales[j] > max_scale)
            max_scale = scales[j];
        if (mins[j] > max_min)
            max_min = mins[j];
    }
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    uint8_t *packed = out + 4, sc[NSUB], mn[NSUB];
    for (int j = 0; j < NSUB; j++) {
        const uint8_t ls = (uint8_t)round_int(inv_scale * scales[j]);
        const uint8_t lm = (uint8_t)round_int(inv_min * mins[j]);
        sc[j] = ls < 63 ? ls : 63;
        mn[j] = lm < 63 ? lm : 63;
    }
    /* sub-blocks 0..3: low 6 bits of bytes 0..3 (scale) and 4..7 (min); 4..7: nibbles of bytes
     * 8..11, their top 2 bits in the top bits of bytes 0..3 / 4..7 */
    for (int j = 0; j < 4; j++) {
        packed[j] = (uint8_t)(sc[j] | ((sc[j + 4] >> 4) << 6));
        packed[j + 4] = (uint8_t)(mn[j] | ((mn[j + 4] >> 4) << 6));
        packed[j + 8] = (uint8_t)((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
    }
    store_f16(out, max_scale / 63.f);
    store_f16(out + 2, max_min / 63.f);
    const float d_all = load_f16(out), dmin_all = load_f16(out + 2);
    for (int j = 0; j < NSUB; j++) {
        const float d = d_all * sc[j];
        if (!d)
            continue; /* the search's codes stay */
        const float dm = dmin_all * mn[j];
        for (int i = 0; i < SUB; i++) {
            const int l = round_int((x[SUB * j + i] + dm) / d);
            L[SUB * j + i] = (uint8_t)(l < 0 ? 0 : l > nmax ? nmax : l);
        }
    }
}

/* Q4_K: d, dmin, scales[12], qs[128]: sub-blocks 2k and 2k + 1 in the low and high nibbles of
 * qs[32 k + l]. */
static void q4_k_block(const searches *sr, const float *x, uint8_t *out) {
    uint8_t L[PYRT_QK_K];
    k_min_block(sr, 15, -1.f, 20, x, out, L);
    uint8_t *qs = out + 16;
    for (int k = 0; k < 4; k++)
        for (int l = 0; l < SUB; l++)
            qs[SUB * k + l] = (uint8_t)(L[64 * k + l] | (L[64 * k + SUB + l] << 4));
}

/* Q5_K: d, dmin, scales[12], qh[32], qs[128]: the low 4 bits as Q4_K's, bit j of qh[l] the fifth
 * bit of element l of sub-block j. */
static void q5_k_block(const searches *sr, const float *x, uint8_t *out) {
    uint8_t L[PYRT_QK_K];
    k_min_block(sr, 31, -0.5f, 15, x, out, L);
    uint8_t *qh = out + 16, *qs = out + 48;
    memset(qh, 0, SUB);
    for (int j = 0; j < NSUB; j++)
        for (int l = 0; l < SUB; l++)
            qh[l] |= (uint8_t)((L[SUB * j + l] >> 4) << j);
    for (int k = 0; k < 4; k++)
        for (int l = 0; l < SUB; l++)
            qs[SUB * k + l] =
                (uint8_t)((L[64 * k + l] & 0xF) | ((L[64 * k + SUB + l] & 0xF) << 4));
}

/* ---- Q6_K: symmetric scale per sub-block of 16 ----------------------------------------------- */

/* Q6_K: ql[128], qh[64], int8 scales[16], f16 d: element 128 h + 32 p + l has its low 4 bits in
 * nibble p / 2 of ql[64 h + 32 (p % 2) + l] and its high 2 at bits 2 p of qh[32 h + l]. */
static void q6_k_block(const searches *sr, const float *x, uint8_t *out) {
    uint8_t L[PYRT_QK_K];
    float scales[NSUB6];
    float max_scale = 0, max_abs = 0;
    for (int j = 0; j < NSUB6; j += sr->lanes)
        sr->fit_q6(x + SUB6 * j, L + SUB6 * j, scales + j);
    for (int j = 0; j < NSUB6; j++) {
        if (fabsf(scales[j]) > max_abs) {
            max_abs = fabsf(scales[j]);
            max_scale = scales[j];
        }
    }
    if (max_abs < GROUP_EPS) {
        memset(out, 0, PYRT_Q6_K_BYTES);
        return;
    }
    const float iscale = -128.f / max_scale;
    int8_t *sc = (int8_t *)(out + 192);
    store_f16(out + 208, 1 / iscale);
    const float d_all = load_f16(out + 208);
    for (int j = 0; j < NSUB6; j++) {
        const int s = round_int(iscale * scales[j]);
        sc[j] = (int8_t)(s < 127 ? s : 127);
    }
    for (int j = 0; j < NSUB6; j++) {
        const float d = d_all * sc[j];
        if (!d)
            continue;
        for (int i = 0; i < SUB6; i++) {
            int l = round_int(x[SUB6 * j + i] / d);
            l = l < -32 ? -32 : l > 31 ? 31 : l;
            L[SUB6 * j + i] = (uint8_t)(l + 32);
        }
    }
    uint8_t *ql = out, *qh = out + 128;
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < SUB; l++) {
            const uint8_t *q = L + 128 * h + l;
            ql[64 * h + l] = (uint8_t)((q[0] & 0xF) | ((q[64] & 0xF) << 4));
            ql[64 * h + SUB + l] = (uint8_t)((q[32] & 0xF) | ((q[96] & 0xF) << 4));
            qh[SUB * h + l] = (uint8_t)((q[0] >> 4) | ((q[32] >> 4) << 2) | ((q[64] >> 4) << 4) |
                                        ((q[96] >> 4) << 6));
        }
}

/* ---- rows ------------------------------------------------------------------------------------ */

typedef void (*block_fn)(const searches *sr, const float *x, uint8_t *out);

typedef struct {
    block_fn fn;
    searches sr;
    const float *x;
    uint8_t *out;
    size_t block_bytes;
} quant_ctx;

static void quantize_one(void *p, int64_t i, int ith) {
    (void)ith;
    const quant_ctx *c = p;
    c->fn(&c->sr, c->x + (size_t)i * PYRT_QK_K, c->out + (size_t)i * c->block_bytes);
}

enum { QUANT_GRAIN = 16 }; /* super-blocks a thread claims at a time */

int pyrt_quantize_rows(pyrt_pool *pool, int fmt, const float *x, int64_t n_rows,
                       int64_t n_per_row, void *out, size_t out_bytes) {
    pyrt_clear_error();
    const int st = pyrt_kq_rows_check("pyrt_quantize_rows", fmt, n_rows, n_per_row, "out",
                                      out_bytes, x, "x", out, "out");
    if (st != PYRT_OK || n_rows == 0)
        return st;
    block_fn fn = fmt == PYRT_FMT_Q4_K   ? q4_k_block
                  : fmt == PYRT_FMT_Q5_K ? q5_k_block
                                         : q6_k_block;
    quant_ctx c = {fn, pick_searches(), x, out, pyrt_row_bytes(fmt, PYRT_QK_K)};
    pyrt_kq_rows_run(pool, n_rows * (n_per_row / PYRT_QK_K), QUANT_GRAIN, quantize_one, &c);
    return PYRT_OK;
}

/* C unit tests of the core, built with -fsanitize=address,undefined by tests/test_cpu_core.py.
 *
 * 1. Every SIMD level's row kernels (dot, axpy) against a float64 computation on the same
 *    dequantized numbers, for every format, at lengths that hit every tail path; Q8_0 rows holding
 *    -128 (the edge of the unsigned x signed multiply trick).
 * 2. pyrt_moe_ffn against a naive float64 MoE, dense and sparse, several thread counts.
 * 3. Errors: status codes, messages, thread-local last_error; pools built and freed repeatedly
 *    (LeakSanitizer checks nothing is lost).
 * Exit status 0 and "all C core tests passed" on success. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pyrt.h"
#include "pool.h"
#include "rows.h"

#define TEST_RNG_SEED 0x9E3779B97F4A7C15ull
#include "check.h"

/* ---- deterministic random numbers ---------------------------------------------------------- */

static float rng_normalish(void) { /* sum of 4 uniforms, centred: mean 0, sd ~0.58 */
    float s = 0.0f;
    for (int i = 0; i < 4; i++)
        s += (float)rng_u32() / 4294967296.0f;
    return s - 2.0f;
}

/* float -> half, round to nearest (test data only; values are small and normal). */
static uint16_t fp16_from_fp32(float f) {
    uint32_t x = pyrt_fp32_to_bits(f);
    uint32_t sign = (x >> 16) & 0x8000;
    int32_t exp = (int32_t)((x >> 23) & 0xFF) - 127 + 15;
    uint32_t mant = x & 0x7FFFFF;
    if (exp <= 0)
        return (uint16_t)sign; /* flush tiny values: fine for test data */
    uint32_t h = sign | ((uint32_t)exp << 10) | (mant >> 13);
    if ((mant & 0x1FFF) > 0x1000 || ((mant & 0x1FFF) == 0x1000 && (h & 1)))
        h++;
    return (uint16_t)h;
}

/* ---- random rows in each format, and their exact values ------------------------------------ */

/* Fill `row` (format fmt, n elements) with random data; values[i] gets its exact value. */
static void make_row(int fmt, int n, uint8_t *row, double *values, int with_min_int8) {
    switch (fmt) {
    case PYRT_FMT_F32:
        for (int i = 0; i < n; i++) {
            float v = rng_normalish();
            memcpy(row + 4 * i, &v, 4);
            values[i] = v;
        }
        break;
    case PYRT_FMT_F16:
    case PYRT_FMT_BF16:
        for (int i = 0; i < n; i++) {
            float v = rng_normalish();
            uint16_t h = fmt == PYRT_FMT_F16 ? fp16_from_fp32(v)
                                             : (uint16_t)(pyrt_fp32_to_bits(v) >> 16);
            memcpy(row + 2 * i, &h, 2);
            values[i] = fmt == PYRT_FMT_F16 ? pyrt_fp16_to_fp32(h) : pyrt_bf16_to_fp32(h);
        }
        break;
    case PYRT_FMT_Q8_0:
        for (int b = 0; b < n / 32; b++) {
            uint8_t *blk = row + b * PYRT_Q8_0_BYTES;
            uint16_t d = fp16_from_fp32(0.01f + 0.02f * (float)(rng_u32() % 100) / 100.0f);
            memcpy(blk, &d, 2);
            for (int i = 0; i < 32; i++) {
                int8_t q = (int8_t)(rng_u32() & 0xFF); /* full range, -128 included */
                if (with_min_int8 && i % 5 == 0)
                    q = -128;
                blk[2 + i] = (uint8_t)q;
                values[b * 32 + i] = (double)pyrt_fp16_to_fp32(d) * q;
            }
        }
        break;
    case PYRT_FMT_Q4_0:
        for (int b = 0; b < n / 32; b++) {
            uint8_t *blk = row + b * PYRT_Q4_0_BYTES;
            uint16_t d = fp16_from_fp32(0.05f + 0.1f * (float)(rng_u32() % 100) / 100.0f);
            memcpy(blk, &d, 2);
            for (int i = 0; i < 16; i++) {
                uint8_t qs = (uint8_t)(rng_u32() & 0xFF);
                blk[2 + i] = qs;
                values[b * 32 + i] = (double)pyrt_fp16_to_fp32(d) * ((qs & 0xF) - 8);
                values[b * 32 + i + 16] = (double)pyrt_fp16_to_fp32(d) * ((qs >> 4) - 8);
            }
        }
        break;
    case PYRT_FMT_MXFP4: /* scale 2^(e - 128) near 1; with_min_int8: e = 0, 1 (subnormal), 200 */
        for (int b = 0; b < n / 32; b++) {
            uint8_t *blk = row + b * PYRT_MXFP4_BYTES;
            blk[0] = (uint8_t)(124 + rng_u32() % 8);
            if (with_min_int8 && b % 4 == 1)
                blk[0] = (uint8_t)(b % 3 == 0 ? 0 : b % 3 == 1 ? 1 : 200);
            const double d = (double)pyrt_e8m0_half(blk[0]);
            for (int i = 0; i < 16; i++) {
                const uint8_t qs = (uint8_t)(rng_u32() & 0xFF);
                blk[1 + i] = qs;
                values[b * 32 + i] = d * pyrt_mxfp4_values[qs & 0xF];
                values[b * 32 + i + 16] = d * pyrt_mxfp4_values[qs >> 4];
            }
        }
        break;
    }
}

static const int FORMATS[] = {PYRT_FMT_F32,  PYRT_FMT_F16,  PYRT_FMT_BF16,
                              PYRT_FMT_Q8_0, PYRT_FMT_Q4_0, PYRT_FMT_MXFP4};

static int is_quant(int fmt) {
    return fmt == PYRT_FMT_Q8_0 || fmt == PYRT_FMT_Q4_0 || fmt == PYRT_FMT_MXFP4;
}

/* ---- 1. row kernels ------------------------------------------------------------------------ */

static void test_row_kernels(void) {
    const int lengths_float[] = {1, 7, 8, 15, 16, 17, 31, 32, 33, 83, 256, 1027};
    /* 608: 19 blocks (2 groups of 8 scales, a pair step, an odd last block) */
    const int lengths_quant[] = {32, 64, 96, 608, 2048};
    const double u = ldexp(1.0, -24);
    for (int level = PYRT_SIMD_SCALAR; level <= pyrt_simd_best(); level++) {
        for (int f = 0; f < COUNT_OF(FORMATS); f++) {
            const int fmt = FORMATS[f];
            const pyrt_row_ops *ops = pyrt_row_ops_at(level, fmt, 1);
            CHECK(ops != NULL, "level %d has no kernels for format %d", level, fmt);
            if (ops == NULL)
                continue;
            const int *lengths = is_quant(fmt) ? lengths_quant : lengths_float;
            const int n_lengths =
                is_quant(fmt) ? COUNT_OF(lengths_quant) : COUNT_OF(lengths_float);
            for (int li = 0; li < n_lengths; li++) {
                const int n = lengths[li];
                uint8_t *row = malloc(pyrt_row_bytes(fmt, n));
                double *wv = malloc(sizeof(double) * n);
                float *x = malloc(sizeof(float) * n);
                double *xv = malloc(sizeof(double) * n);
                pyrt_xq8 *xq = malloc(sizeof(pyrt_xq8) * (n / 32 + 1));
                float *y = malloc(sizeof(float) * n);
                double *yref = malloc(sizeof(double) * n);
                make_row(fmt, n, row, wv, li % 2);
                for (int i = 0; i < n; i++)
                    x[i] = rng_normalish();
                if (is_quant(fmt)) {
                    pyrt_quantize_x_q8(x, xq, n);
                    for (int i = 0; i < n; i++)
                        xv[i] = (double)xq[i / 32].d * xq[i / 32].q[i % 32];
                } else {
                    for (int i = 0; i < n; i++)
                        xv[i] = x[i];
                }
                double ref = 0.0, absum = 0.0;
                for (int i = 0; i < n; i++) {
                    ref += wv[i] * xv[i];
                    absum += fabs(wv[i] * xv[i]);
                }
                const float got = ops->dot(row, is_quant(fmt) ? (const void *)xq : x, n);
                CHECK(fabs(got - ref) <= (n + 4) * u * absum + 1e-30,
                      "dot level %d fmt %d n %d: %.9g vs %.9g", level, fmt, n, got, ref);

                const float a = 0.75f;
                for (int i = 0; i < n; i++) {
                    y[i] = x[i];
                    yref[i] = x[i] + (double)a * wv[i];
                }
                ops->axpy(a, row, y, n);
                for (int i = 0; i < n; i++) {
                    const double tol = 3 * u * (fabs(x[i]) + fabs(a * wv[i])) + 1e-30;
                    if (fabs(y[i] - yref[i]) > tol) {
                        CHECK(0, "axpy level %d fmt %d n %d at %d: %.9g vs %.9g", level, fmt, n,
                              i, y[i], yref[i]);
                        break;
                    }
                }
                free(row), free(wv), free(x), free(xv), free(xq), free(y), free(yref);
            }
        }
    }
}

/* The fused kernels (dot2: gate and up in one pass; axpyn: several down rows per pass over y)
 * must give exactly the bits of the plain kernels, or sparse-keeping-everything would not equal
 * dense bit for bit. */
static void test_fused_kernels_match_plain(void) {
    const int lengths[] = {32, 96, 608, 2048}; /* 608: 19 blocks, AVX-512 groups of 8 + tails */
    for (int level = PYRT_SIMD_SCALAR; level <= pyrt_simd_best(); level++) {
        for (int f = 0; f < COUNT_OF(FORMATS); f++) {
            const int fmt = FORMATS[f];
            const pyrt_row_ops *ops = pyrt_row_ops_at(level, fmt, 1);
            if (ops == NULL || (ops->dot2 == NULL && ops->axpyn == NULL))
                continue;
            for (int li = 0; li < COUNT_OF(lengths); li++) {
                const int n = lengths[li];
                const size_t rb = pyrt_row_bytes(fmt, n);
                uint8_t *rows = malloc(rb * PYRT_AXPY_ROWS);
                double *wv = malloc(sizeof(double) * n);
                float *x = malloc(sizeof(float) * n), *y1 = malloc(sizeof(float) * n);
                float *y2 = malloc(sizeof(float) * n);
                pyrt_xq8 *xq = malloc(sizeof(pyrt_xq8) * (n / 32 + 1));
                for (int r = 0; r < PYRT_AXPY_ROWS; r++)
                    make_row(fmt, n, rows + r * rb, wv, r % 2);
                for (int i = 0; i < n; i++)
                    x[i] = rng_normalish();
                const void *xk = x;
                if (is_quant(fmt)) {
                    pyrt_quantize_x_q8(x, xq, n);
                    xk = xq;
                }
                if (ops->dot2 != NULL) {
                    float out[2];
                    ops->dot2(rows, rows + rb, xk, n, out);
                    const float d0 = ops->dot(rows, xk, n), d1 = ops->dot(rows + rb, xk, n);
                    CHECK(memcmp(&out[0], &d0, 4) == 0 && memcmp(&out[1], &d1, 4) == 0,
                          "dot2 level %d fmt %d n %d: %.9g %.9g vs dot %.9g %.9g", level, fmt, n,
                          out[0], out[1], d0, d1);
                }
                /* with prefetches of other rows' lines spread through the loop: same bits */
                const void *pf[3 * 64];
                int n_pf = 0;
                for (size_t off = 0; off < 3 * rb && n_pf < 3 * 64; off += 64)
                    pf[n_pf++] = rows + 2 * rb + off;
                if (ops->dot_pf != NULL) {
                    const float d0 = ops->dot(rows, xk, n);
                    for (int np = 0; np <= n_pf; np += n_pf / 3 + 1) {
                        const float p0 = ops->dot_pf(rows, xk, n, pf, np);
                        CHECK(memcmp(&p0, &d0, 4) == 0,
                              "dot_pf level %d fmt %d n %d n_pf %d: %.9g vs dot %.9g", level, fmt,
                              n, np, p0, d0);
                    }
                }
                if (ops->dot2_pf != NULL && ops->dot2 != NULL) {
                    float out[2], outp[2];
                    ops->dot2(rows, rows + rb, xk, n, out);
                    for (int np = 0; np <= n_pf; np += n_pf / 3 + 1) {
                        ops->dot2_pf(rows, rows + rb, xk, n, outp, pf, np);
                        CHECK(memcmp(out, outp, sizeof out) == 0,
                              "dot2_pf level %d fmt %d n %d n_pf %d differs from dot2", level, fmt,
                              n, np);
                    }
                }
                if (ops->axpyn != NULL) {
                    for (int nr = 1; nr <= PYRT_AXPY_ROWS; nr++) {
                        float a[PYRT_AXPY_ROWS];
                        const void *rp[PYRT_AXPY_ROWS];
                        for (int r = 0; r < nr; r++)
                            a[r] = rng_normalish(), rp[r] = rows + r * rb;
                        for (int i = 0; i < n; i++)
                            y1[i] = y2[i] = x[i];
                        ops->axpyn(nr, a, rp, y1, n);
                        for (int r = 0; r < nr; r++)
                            ops->axpy(a[r], rp[r], y2, n);
                        CHECK(memcmp(y1, y2, sizeof(float) * n) == 0,
                              "axpyn level %d fmt %d n %d nr %d differs from %d axpy calls", level,
                              fmt, n, nr, nr);
                        if (ops->axpyn_pf != NULL) {
                            for (int i = 0; i < n; i++)
                                y2[i] = x[i];
                            ops->axpyn_pf(nr, a, rp, y2, n, pf, n_pf);
                            CHECK(memcmp(y1, y2, sizeof(float) * n) == 0,
                                  "axpyn_pf level %d fmt %d n %d nr %d differs from axpyn", level,
                                  fmt, n, nr);
                        }
                    }
                }
                free(rows), free(wv), free(x), free(y1), free(y2), free(xq);
            }
        }
    }
}

/* Random K-quant rows: every byte random (all codes, every packed scale / min pattern) but the
 * f16 super-block scales, set to small normal values. */
static void make_kquant_rows(int fmt, int n, int nr, uint8_t *rows) {
    const size_t rb = pyrt_row_bytes(fmt, n), bb = pyrt_row_bytes(fmt, PYRT_QK_K);
    for (size_t i = 0; i < rb * (size_t)nr; i++)
        rows[i] = (uint8_t)(rng_u32() & 0xFF);
    for (size_t b = 0; b < rb * (size_t)nr / bb; b++) {
        uint8_t *blk = rows + b * bb;
        for (int k = 0; k < (fmt == PYRT_FMT_Q6_K ? 1 : 2); k++) {
            const uint16_t d = fp16_from_fp32(1e-3f + 1e-3f * (float)(rng_u32() % 100) / 100.0f);
            memcpy(blk + (fmt == PYRT_FMT_Q6_K ? 208 : 2 * k), &d, 2);
        }
    }
}

/* The K-quant kernels against the activation pyrt_quantize_x_q8k makes: dot2 gives two dots'
 * bits, the dot tiles (4 rows x 2 tokens, and their 1-token tails) the dots' bits, axpyn nr axpys'
 * bits, the axpy tiles per token axpy calls' bits, and the VNNI dots the plain AVX-512 ones' bits,
 * at 1, 3 and 8 super-blocks. */
static void test_kquant_kernels_match_plain(void) {
    static const int fmts[] = {PYRT_FMT_Q4_K, PYRT_FMT_Q5_K, PYRT_FMT_Q6_K};
    const int lengths[] = {256, 768, 2048};
    enum { NR = 9, NT = 5 };
    for (int f = 0; f < COUNT_OF(fmts); f++)
        for (int li = 0; li < COUNT_OF(lengths); li++) {
            const int fmt = fmts[f], n = lengths[li];
            const size_t rb = pyrt_row_bytes(fmt, n);
            uint8_t *rows = malloc(rb * NR);
            float *x = malloc(sizeof(float) * n * NT), *y1 = malloc(sizeof(float) * n);
            float *y2 = malloc(sizeof(float) * n);
            const size_t xs = pyrt_xq_units((size_t)n);
            pyrt_xq8 *xq = malloc(sizeof(pyrt_xq8) * xs * NT);
            const void *rp[NR], *xp[NT];
            make_kquant_rows(fmt, n, NR, rows);
            for (int r = 0; r < NR; r++)
                rp[r] = rows + r * rb;
            for (int i = 0; i < n * NT; i++)
                x[i] = rng_normalish();
            for (int t = 0; t < NT; t++) {
                pyrt_quantize_x_q8k(x + (size_t)t * n, xq + (size_t)t * xs, n);
                xp[t] = xq + (size_t)t * xs;
            }
            float plain[NR * NT];
            for (int level = PYRT_SIMD_SCALAR; level <= pyrt_simd_best(); level++)
                for (int vnni = 0; vnni < 2; vnni++) {
                    const pyrt_row_ops *ops = pyrt_row_ops_at(level, fmt, vnni);
                    float dots[NR * NT], tile[NT * NR];
                    for (int t = 0; t < NT; t++)
                        for (int r = 0; r < NR; r++)
                            dots[t * NR + r] = ops->dot(rp[r], xp[t], n);
                    if (level == PYRT_SIMD_AVX512 && vnni == 0)
                        memcpy(plain, dots, sizeof dots);
                    if (level == PYRT_SIMD_AVX512 && vnni == 1)
                        CHECK(memcmp(plain, dots, sizeof dots) == 0,
                              "kquant fmt %d n %d: VNNI dots differ from AVX-512's", fmt, n);
                    pyrt_dot_tile(ops, NR, rp, NT, xp, n, tile, NR, 1);
                    CHECK(memcmp(tile, dots, sizeof dots) == 0,
                          "kquant level %d vnni %d fmt %d n %d: dot tiles differ from dots",
                          level, vnni, fmt, n);
                    if (ops->dot2 != NULL) {
                        float out[2];
                        ops->dot2(rp[0], rp[1], xp[0], n, out);
                        CHECK(memcmp(out, dots, sizeof out) == 0,
                              "kquant level %d fmt %d n %d: dot2 differs from dots", level, fmt,
                              n);
                    }
                    if (ops->axpyn != NULL) {
                        float a[PYRT_AXPY_ROWS];
                        for (int r = 0; r < PYRT_AXPY_ROWS; r++)
                            a[r] = rng_normalish();
                        for (int i = 0; i < n; i++)
                            y1[i] = y2[i] = x[i];
                        ops->axpyn(PYRT_AXPY_ROWS, a, rp, y1, n);
                        for (int r = 0; r < PYRT_AXPY_ROWS; r++)
                            ops->axpy(a[r], rp[r], y2, n);
                        CHECK(memcmp(y1, y2, sizeof(float) * n) == 0,
                              "kquant level %d fmt %d n %d: axpyn differs from axpy calls", level,
                              fmt, n);
                    }
                    /* axpy tiles (NR rows into NT tokens' ys): per token, NR axpy calls' bits */
                    float av[NR][NT], *ya = malloc(sizeof(float) * n * NT);
                    float *yb = malloc(sizeof(float) * n * NT);
                    const float *ap[NR];
                    float *yap[NT];
                    for (int r = 0; r < NR; r++) {
                        for (int t = 0; t < NT; t++)
                            av[r][t] = rng_normalish();
                        ap[r] = av[r];
                    }
                    memcpy(ya, x, sizeof(float) * n * NT);
                    memcpy(yb, x, sizeof(float) * n * NT);
                    for (int t = 0; t < NT; t++)
                        yap[t] = ya + (size_t)t * n;
                    pyrt_axpy_tile(ops, NR, rp, ap, NT, yap, n);
                    for (int t = 0; t < NT; t++)
                        for (int r = 0; r < NR; r++)
                            ops->axpy(av[r][t], rp[r], yb + (size_t)t * n, n);
                    CHECK(memcmp(ya, yb, sizeof(float) * n * NT) == 0,
                          "kquant level %d vnni %d fmt %d n %d: axpy tiles differ from axpy calls",
                          level, vnni, fmt, n);
                    free(ya), free(yb);
                }
            free(rows), free(x), free(y1), free(y2), free(xq);
        }
}

/* The AVX512_VNNI Q8_0 dots (vpdpbusd on w + 128, from -128 * sum x) make the int32 lanes of
 * the plain AVX-512 ones exactly, so every result must be the same bits: rows with -128 and 127
 * weights (the ends of the w + 128 range), x blocks with +-127, every tail length. */
static void test_vnni_dots_match_avx512(void) {
    if (pyrt_simd_best() < PYRT_SIMD_AVX512 || !__builtin_cpu_supports("avx512vnni"))
        return;
    const pyrt_row_ops *plain = pyrt_row_ops_avx512(PYRT_FMT_Q8_0);
    const pyrt_row_ops *vnni = pyrt_row_ops_avx512_vnni(PYRT_FMT_Q8_0);
    CHECK(plain != NULL && vnni != NULL && plain != vnni, "no AVX512_VNNI Q8_0 kernels");
    if (plain == NULL || vnni == NULL)
        return;
    const int lengths[] = {32, 64, 96, 256, 288, 544, 608, 1024, 2048, 2080};
    for (int li = 0; li < COUNT_OF(lengths); li++) {
        const int n = lengths[li];
        const size_t rb = pyrt_row_bytes(PYRT_FMT_Q8_0, n);
        uint8_t *rows = malloc(2 * rb);
        double *wv = malloc(sizeof(double) * n);
        float *x = malloc(sizeof(float) * n);
        pyrt_xq8 *xq = malloc(sizeof(pyrt_xq8) * (n / 32 + 1));
        for (int trial = 0; trial < 4; trial++) {
            for (int r = 0; r < 2; r++)
                make_row(PYRT_FMT_Q8_0, n, rows + r * rb, wv, 1);
            if (trial == 3) /* extremes: every weight -128 in row 0, 127 in row 1 */
                for (int b = 0; b < n / 32; b++)
                    for (int i = 0; i < 32; i++) {
                        rows[b * PYRT_Q8_0_BYTES + 2 + i] = 0x80;
                        rows[rb + b * PYRT_Q8_0_BYTES + 2 + i] = 0x7F;
                    }
            for (int i = 0; i < n; i++)
                x[i] = trial == 3 ? (i % 2 ? 1.0f : -1.0f) : rng_normalish();
            pyrt_quantize_x_q8(x, xq, n);
            const float d0 = plain->dot(rows, xq, n), v0 = vnni->dot(rows, xq, n);
            CHECK(memcmp(&d0, &v0, 4) == 0, "vnni dot n %d trial %d: %.9g vs %.9g", n, trial,
                  v0, d0);
            float dp[2], vp[2];
            plain->dot2(rows, rows + rb, xq, n, dp);
            vnni->dot2(rows, rows + rb, xq, n, vp);
            CHECK(memcmp(dp, vp, sizeof dp) == 0, "vnni dot2 n %d trial %d: %.9g %.9g vs %.9g %.9g",
                  n, trial, vp[0], vp[1], dp[0], dp[1]);
            const void *pf[4] = {rows, rows + 64, rows + rb, rows + rb + 64};
            const float p0 = vnni->dot_pf(rows, xq, n, pf, 4);
            vnni->dot2_pf(rows, rows + rb, xq, n, vp, pf, 4);
            CHECK(memcmp(&p0, &d0, 4) == 0 && memcmp(dp, vp, sizeof dp) == 0,
                  "vnni dot_pf/dot2_pf n %d trial %d differ", n, trial);
        }
        free(rows), free(wv), free(x), free(xq);
    }
}

/* MXFP4's AVX-512 kernels (BW, and VNNI where the CPU has it) make the AVX2 kernels' int32 lanes,
 * scales and accumulation order, so every dot, dot2 and axpyn must be the AVX2 bits: every code
 * (table and sign), scales e = 0, 1 (subnormal 2^(e - 128)) and 200, block counts with 8-groups,
 * pairs and an odd last block. */
static void test_mxfp4_avx512_matches_avx2(void) {
    if (pyrt_simd_best() < PYRT_SIMD_AVX512)
        return;
    const pyrt_row_ops *ref = pyrt_row_ops_at(PYRT_SIMD_AVX2, PYRT_FMT_MXFP4, 0);
    const pyrt_row_ops *lv[2] = {pyrt_row_ops_at(PYRT_SIMD_AVX512, PYRT_FMT_MXFP4, 0),
                                 pyrt_row_ops_at(PYRT_SIMD_AVX512, PYRT_FMT_MXFP4, 1)};
    CHECK(lv[0] != ref && lv[1] != ref, "the AVX-512 level has no MXFP4 kernels of its own");
    const int lengths[] = {32, 64, 96, 256, 288, 320, 544, 608, 2048, 2880};
    for (int li = 0; li < COUNT_OF(lengths); li++) {
        const int n = lengths[li];
        const size_t rb = pyrt_row_bytes(PYRT_FMT_MXFP4, n);
        uint8_t *rows = malloc(PYRT_AXPY_ROWS * rb);
        double *wv = malloc(sizeof(double) * n);
        float *x = malloc(sizeof(float) * n), *y0 = malloc(sizeof(float) * n);
        float *y1 = malloc(sizeof(float) * n);
        pyrt_xq8 *xq = malloc(sizeof(pyrt_xq8) * (n / 32 + 1));
        for (int trial = 0; trial < 3; trial++) {
            for (int r = 0; r < PYRT_AXPY_ROWS; r++)
                make_row(PYRT_FMT_MXFP4, n, rows + r * rb, wv, (r + trial) % 2);
            if (trial == 2) /* row 0: every code in order; x: +-127 */
                for (int b = 0; b < n / 32; b++)
                    for (int i = 0; i < 16; i++)
                        rows[b * PYRT_MXFP4_BYTES + 1 + i] = (uint8_t)(i | (15 - i) << 4);
            for (int i = 0; i < n; i++)
                x[i] = trial == 2 ? (i % 3 ? 1.0f : -1.0f) : rng_normalish();
            pyrt_quantize_x_q8(x, xq, n);
            const float d0 = ref->dot(rows, xq, n);
            float dp[2];
            ref->dot2(rows, rows + rb, xq, n, dp);
            float a[PYRT_AXPY_ROWS];
            const void *rp[PYRT_AXPY_ROWS];
            for (int r = 0; r < PYRT_AXPY_ROWS; r++)
                a[r] = rng_normalish(), rp[r] = rows + r * rb;
            memcpy(y0, x, sizeof(float) * n);
            ref->axpyn(PYRT_AXPY_ROWS, a, rp, y0, n);
            for (int v = 0; v < 2; v++) {
                const float v0 = lv[v]->dot(rows, xq, n);
                CHECK(memcmp(&d0, &v0, 4) == 0, "mxfp4 avx512 vnni %d dot n %d trial %d: %.9g vs "
                      "avx2 %.9g", v, n, trial, v0, d0);
                float vp[2];
                lv[v]->dot2(rows, rows + rb, xq, n, vp);
                CHECK(memcmp(dp, vp, sizeof dp) == 0, "mxfp4 avx512 vnni %d dot2 n %d trial %d "
                      "differs from avx2", v, n, trial);
                memcpy(y1, x, sizeof(float) * n);
                lv[v]->axpyn(PYRT_AXPY_ROWS, a, rp, y1, n);
                CHECK(memcmp(y0, y1, sizeof(float) * n) == 0, "mxfp4 avx512 axpyn n %d trial %d "
                      "differs from avx2", n, trial);
            }
        }
        free(rows), free(wv), free(x), free(y0), free(y1), free(xq);
    }
}

static void test_quantize_x(void) {
    float x[64];
    pyrt_xq8 q[2];
    for (int i = 0; i < 32; i++)
        x[i] = 0.0f; /* an all-zero block: d = 0, q = 0, no division by zero */
    for (int i = 32; i < 64; i++)
        x[i] = (float)(i - 48);
    pyrt_quantize_x_q8(x, q, 64);
    CHECK(q[0].d == 0.0f && q[0].q[5] == 0, "zero block");
    CHECK(q[1].q[0] == -127 && fabsf(q[1].d - 16.0f / 127.0f) < 1e-7f, "amax maps to -127");
    int maxq = 0;
    for (int i = 0; i < 32; i++)
        maxq = abs(q[1].q[i]) > maxq ? abs(q[1].q[i]) : maxq;
    CHECK(maxq == 127, "max |q| is 127, got %d", maxq);
}

/* Every SIMD level's quantize gives the scalar code's bytes: random blocks at several scales,
 * halfway cases (x * id = k + 0.5), zeros, denormals, a huge lane. Finite x only: for NaN or inf
 * the scalar code's (int8_t) cast of a NaN is undefined behaviour (UBSan's float-cast-overflow). */
static void test_quantize_x_levels(void) {
    enum { N = 32 * 40, UNITS = N / 32 + (N / 32 + 8) / 9 }; /* pyrt_xq_units(N) */
    static float x[N];
    static pyrt_xq8 want[UNITS], got[UNITS];
    for (int i = 0; i < N; i++) {
        const int block = i / 32;
        const float scale = block < 8 ? 1.0f : block < 16 ? 1e-3f : block < 24 ? 1e4f : 3.0f;
        x[i] = rng_normalish() * scale;
    }
    for (int i = 0; i < 32; i++) /* block 24: amax 127, so x * id = x: halfway values */
        x[24 * 32 + i] = i == 0 ? 127.0f : (float)(i - 16) + 0.5f;
    for (int i = 0; i < 32; i++) { /* block 25: zeros and denormals; 26: denormals only */
        x[25 * 32 + i] = i % 2 ? 0.0f : -0.0f;
        x[26 * 32 + i] = (float)(i - 16) * 1e-44f;
    }
    x[25 * 32 + 7] = 1e-40f;
    x[27 * 32 + 3] = 3e38f; /* near FLT_MAX: d = amax / 127 still finite */
    const int best = pyrt_simd_best();
    /* per 32, then with scales shared per 256 (N / 32 = 40: 5 groups of 8, one of them holding
     * every special block above) */
    for (int shared = 0; shared < 2; shared++) {
        (shared ? pyrt_quantize_x_q8k_scalar : pyrt_quantize_x_q8_scalar)(x, want, N);
        for (int level = PYRT_SIMD_SCALAR; level <= best; level++) {
            CHECK(pyrt_simd_force(level) == PYRT_OK, "force level %d", level);
            memset(got, 0x5A, sizeof got);
            (shared ? pyrt_quantize_x_q8k : pyrt_quantize_x_q8)(x, got, N);
            for (int b = 0; b < N / 32; b++)
                CHECK(memcmp(&got[b].d, &want[b].d, sizeof got[b].d) == 0 &&
                          memcmp(got[b].q, want[b].q, sizeof got[b].q) == 0,
                      "quantize%s level %d block %d differs from scalar", shared ? "_q8k" : "",
                      level, b);
            if (shared) /* and the sums per 16 after the blocks */
                CHECK(memcmp(pyrt_xq_sums(got, N), pyrt_xq_sums(want, N), N / 16 * 2) == 0,
                      "quantize_q8k level %d: sums per 16 differ from scalar", level);
        }
    }
    pyrt_simd_force(best);
}

/* pyrt_quantize_x_q8k: every block of a whole group of 256 holds the group's d = amax / 127 and
 * q = round(x / d); the 3 blocks after the last group (n = 352) are quantized per 32; after the
 * blocks, the sums of q per 16 of every level (pyrt_xq_sums), at the ends of their range too. */
static void test_quantize_x_q8k_groups(void) {
    enum { N = 352, UNITS = N / 32 + (N / 32 + 8) / 9 }; /* pyrt_xq_units(N) */
    float x[N];
    pyrt_xq8 q[UNITS], q32[UNITS];
    CHECK(pyrt_xq_units(N) == UNITS, "pyrt_xq_units(%d) = %zu", N, pyrt_xq_units(N));
    for (int i = 0; i < N; i++)
        x[i] = rng_normalish() * (i < 32 ? 0.01f : 1.0f);
    x[100] = -9.0f;
    pyrt_quantize_x_q8k(x, q, N);
    pyrt_quantize_x_q8(x, q32, N);
    const float d = 9.0f / 127.0f, id = 1.0f / d;
    for (int b = 0; b < 8; b++) {
        CHECK(q[b].d == d, "q8k block %d: d %.9g, not the group's", b, q[b].d);
        for (int i = 0; i < 32; i++)
            CHECK(q[b].q[i] == (int8_t)nearbyintf(x[32 * b + i] * id), "q8k block %d q[%d]", b,
                  i);
    }
    CHECK(q[3].q[4] == -127, "q8k: the group's amax maps to -127, got %d", q[3].q[4]);
    for (int b = 8; b < N / 32; b++)
        CHECK(memcmp(&q[b], &q32[b], sizeof q[b]) == 0, "q8k tail block %d is not per 32", b);
    for (int i = 0; i < 16; i++) /* 16 elements at +-amax: sums of +-2032 */
        x[32 + i] = x[48 + i] = i % 2 ? 9.0f : -9.0f, x[64 + i] = 9.0f, x[80 + i] = -9.0f;
    const int best = pyrt_simd_best();
    for (int level = PYRT_SIMD_SCALAR; level <= best; level++) {
        CHECK(pyrt_simd_force(level) == PYRT_OK, "force level %d", level);
        memset(q, 0x5A, sizeof q);
        pyrt_quantize_x_q8k(x, q, N);
        int16_t sums[N / 16];
        memcpy(sums, pyrt_xq_sums(q, N), sizeof sums);
        for (int i = 0; i < N / 16; i++) {
            int want = 0;
            for (int l = 0; l < 16; l++)
                want += q[i / 2].q[16 * (i % 2) + l];
            CHECK(sums[i] == want, "q8k level %d: sum of 16 number %d is %d, not %d", level, i,
                  sums[i], want);
        }
        CHECK(sums[4] == 2032 && sums[5] == -2032, "q8k level %d: sums at the range's ends %d %d",
              level, sums[4], sums[5]);
    }
    pyrt_simd_force(best);
}

/* Every SIMD level's y += x (the expert kernel's sum of partial ys) gives the scalar loop's bits,
 * at lengths with and without a vector tail. */
static void test_add_levels(void) {
    enum { N = 77 };
    static const size_t lengths[] = {1, 15, 16, 17, 33, 64, N};
    float x[N], y0[N], want[N], got[N];
    for (int i = 0; i < N; i++) {
        x[i] = rng_normalish() * 1e3f;
        y0[i] = rng_normalish();
    }
    const int best = pyrt_simd_best();
    for (int l = 0; l < COUNT_OF(lengths); l++) {
        const size_t n = lengths[l];
        memcpy(want, y0, sizeof want);
        pyrt_add_f32_scalar(want, x, n);
        for (int level = PYRT_SIMD_SCALAR; level <= best; level++) {
            CHECK(pyrt_simd_force(level) == PYRT_OK, "force level %d", level);
            memcpy(got, y0, sizeof got);
            pyrt_add_f32_active()(got, x, n);
            CHECK(memcmp(got, want, sizeof got) == 0, "add level %d n %zu differs from scalar",
                  level, n);
        }
    }
    pyrt_simd_force(best);
}

/* ---- 2. the MoE kernel --------------------------------------------------------------------- */

static double act_silu(double g) {
    return g / (1.0 + exp(-g));
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* A threshold in the widest gap between the sorted |act| values of the 40-60% quantiles, so
 * that no |act| lies near it (the kernel's f32 |act| falls on the reference's side). */
static double clean_threshold(const double *wv, const double *xv, const int32_t *ids, int T,
                              int K, int FF, int D) {
    const int n = T * K * FF;
    double *a = malloc(sizeof(double) * n);
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < FF; j++) {
                const double *gate = wv + ((size_t)ids[t * K + k] * FF * 3 + 3 * j) * D;
                double g = 0;
                for (int i = 0; i < D; i++)
                    g += gate[i] * xv[t * D + i];
                a[(t * K + k) * FF + j] = fabs(act_silu(g));
            }
    qsort(a, n, sizeof *a, cmp_double);
    int best = (int)(0.4 * n);
    for (int i = best; i < (int)(0.6 * n); i++)
        if (a[i + 1] - a[i] > a[best + 1] - a[best])
            best = i;
    const double thr = 0.5 * (a[best] + a[best + 1]);
    free(a);
    return thr;
}

/* The float64 MoE over the pairs whose expert has here[e] != 0 (NULL: all): y and, per element,
 * a scale for the tolerance (sum of |terms|); returns the neurons kept; *near counts |act| within
 * 1e-4 of thr (where f32 may fall on the other side). */
static int64_t moe_ref(const double *wv, const double *xv, const int32_t *ids, const float *tw,
                       int T, int K, int FF, int D, double thr, const int *here, double *yref,
                       double *yabs, int64_t *near) {
    int64_t active = 0;
    memset(yref, 0, sizeof(double) * T * D);
    memset(yabs, 0, sizeof(double) * T * D);
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
            if (here != NULL && !here[ids[t * K + k]])
                continue;
            const double *we = wv + (size_t)ids[t * K + k] * FF * 3 * D;
            for (int j = 0; j < FF; j++) {
                double g = 0, u = 0;
                for (int i = 0; i < D; i++) {
                    g += we[(3 * j) * D + i] * xv[t * D + i];
                    u += we[(3 * j + 1) * D + i] * xv[t * D + i];
                }
                const double a = act_silu(g);
                if (thr > 0 && fabs(fabs(a) - thr) < 1e-4)
                    (*near)++;
                if (fabs(a) < thr)
                    continue;
                active++;
                for (int i = 0; i < D; i++) {
                    const double c = tw[t * K + k] * a * u * we[(3 * j + 2) * D + i];
                    yref[t * D + i] += c;
                    yabs[t * D + i] += fabs(c) + fabs(tw[t * K + k] * u);
                }
            }
        }
    return active;
}

/* Whether y [n] is within 1e-4 of the reference's scale (f32 through the kernel's sums). */
static int close_to(const float *y, const double *yref, const double *yabs, int n) {
    for (int i = 0; i < n; i++)
        if (fabs(y[i] - yref[i]) > 1e-4 * yabs[i] + 1e-6)
            return 0;
    return 1;
}

static pyrt_experts all_experts(const void *gud, int fmt, int E, int FF, int D) {
    return (pyrt_experts){.data = gud, .bytes = (size_t)E * FF * 3 * pyrt_row_bytes(fmt, D),
                          .fmt = fmt, .n_expert = E, .n_slots = E, .n_ff = FF, .n_embd = D};
}

/* Expert maps (pyrt_experts.expert_map): a compact tensor holding experts 4, 0, 2 in slots 0, 1,
 * 2 gives the reference over those experts' pairs; the full tensor with a map that keeps the
 * other two (1, 3) gives theirs, and the two results sum to the unmapped one; a map of -1 only
 * gives y = 0 and no neuron; bad maps are refused. */
static void check_expert_maps(pyrt_pool *pool, const uint8_t *gud, const double *wv,
                              const double *xv, const float *x, const int32_t *ids,
                              const float *tw, int fmt, int T, int K, int E, int FF, int D,
                              double thr, const float *y_full) {
    const size_t rb = pyrt_row_bytes(fmt, D), eb = (size_t)FF * 3 * rb;
    static const int slot_expert[3] = {4, 0, 2};
    uint8_t *compact = malloc(3 * eb);
    for (int s = 0; s < 3; s++)
        memcpy(compact + s * eb, gud + (size_t)slot_expert[s] * eb, eb);
    const int32_t map_a[5] = {1, -1, 2, -1, 0}, map_b[5] = {-1, 1, -1, 3, -1};
    const int32_t none[5] = {-1, -1, -1, -1, -1};
    const int here_a[5] = {1, 0, 1, 0, 1}, here_b[5] = {0, 1, 0, 1, 0};
    double yref[4 * 64], yabs[4 * 64];
    float ya[4 * 64], yb[4 * 64];
    int64_t near = 0, active_a = -1, active_b = -1;
    pyrt_experts ea = {.data = compact, .bytes = 3 * eb, .fmt = fmt, .n_expert = E, .n_slots = 3,
                       .n_ff = FF, .n_embd = D, .expert_map = map_a};
    CHECK(pyrt_moe_ffn(pool, &ea, x, T, ids, tw, K, PYRT_ACT_SILU, (float)thr, ya, &active_a) ==
              PYRT_OK, "map a: %s", pyrt_last_error());
    const int64_t ref_a = moe_ref(wv, xv, ids, tw, T, K, FF, D, thr, here_a, yref, yabs, &near);
    CHECK(near > 0 || (active_a == ref_a && close_to(ya, yref, yabs, T * D)),
          "fmt %d thr %g: compact permuted slots differ from the reference", fmt, thr);
    pyrt_experts eb_ = all_experts(gud, fmt, E, FF, D);
    eb_.expert_map = map_b;
    CHECK(pyrt_moe_ffn(pool, &eb_, x, T, ids, tw, K, PYRT_ACT_SILU, (float)thr, yb, &active_b) ==
              PYRT_OK, "map b: %s", pyrt_last_error());
    const int64_t ref_b = moe_ref(wv, xv, ids, tw, T, K, FF, D, thr, here_b, yref, yabs, &near);
    CHECK(near > 0 || (active_b == ref_b && close_to(yb, yref, yabs, T * D)),
          "fmt %d thr %g: masking map differs from the reference", fmt, thr);
    /* complementary maps: y_a + y_b = y (up to the order of the f32 sums) */
    moe_ref(wv, xv, ids, tw, T, K, FF, D, thr, NULL, yref, yabs, &near);
    float sum[4 * 64];
    for (int i = 0; i < T * D; i++)
        sum[i] = ya[i] + yb[i];
    for (int i = 0; i < T * D; i++)
        yref[i] = y_full[i];
    CHECK(close_to(sum, yref, yabs, T * D), "fmt %d thr %g: complementary maps do not sum to y",
          fmt, thr);
    /* nothing held here */
    eb_.expert_map = none;
    int64_t active = -1;
    CHECK(pyrt_moe_ffn(pool, &eb_, x, T, ids, tw, K, PYRT_ACT_SILU, (float)thr, ya, &active) ==
              PYRT_OK && active == 0, "all -1: %s", pyrt_last_error());
    for (int i = 0; i < T * D; i++)
        CHECK(ya[i] == 0.0f, "all -1: y[%d] = %g", i, ya[i]);
    /* refused: a slot past n_slots or under -1 (checked where a pair uses it), a map-less
     * tensor of fewer slots, bytes of another number of slots */
    int32_t bad[5] = {1, -1, 2, -1, 0};
    bad[ids[0]] = 3;
    ea.expert_map = bad;
    char want[64];
    snprintf(want, sizeof want, "expert_map[%d] = 3 is outside [-1, n_slots=3)", (int)ids[0]);
    CHECK(pyrt_moe_ffn(pool, &ea, x, T, ids, tw, K, PYRT_ACT_SILU, 0.0f, ya, NULL) ==
                  PYRT_E_INVALID &&
              strstr(pyrt_last_error(), want) != NULL,
          "slot 3 of 3 accepted: %s", pyrt_last_error());
    bad[ids[0]] = -2;
    CHECK(pyrt_moe_ffn(pool, &ea, x, T, ids, tw, K, PYRT_ACT_SILU, 0.0f, ya, NULL) ==
              PYRT_E_INVALID, "slot -2 accepted");
    ea.expert_map = NULL;
    CHECK(pyrt_moe_ffn(pool, &ea, x, T, ids, tw, K, PYRT_ACT_SILU, 0.0f, ya, NULL) ==
                  PYRT_E_INVALID &&
              strstr(pyrt_last_error(), "without an expert_map") != NULL,
          "3 slots without a map accepted: %s", pyrt_last_error());
    ea.expert_map = map_a;
    ea.bytes = 2 * eb;
    CHECK(pyrt_moe_ffn(pool, &ea, x, T, ids, tw, K, PYRT_ACT_SILU, 0.0f, ya, NULL) ==
                  PYRT_E_INVALID &&
              strstr(pyrt_last_error(), "n_slots=3") != NULL,
          "2 slots of bytes for 3 accepted: %s", pyrt_last_error());
    free(compact);
}

/* The gate rows apart (pyrt_experts.gates): the same bits and neurons as y (the call without
 * them), dense or sparse; allocated to exactly their bytes, so a read past them trips ASan; a
 * copy of the wrong size is refused. */
static void check_gates_apart(pyrt_pool *pool, const pyrt_experts *experts, const float *x,
                              const int32_t *ids, const float *tw, int T, int K, double thr,
                              const float *y, int64_t active) {
    const size_t rb = pyrt_row_bytes(experts->fmt, experts->n_embd);
    const size_t rows = (size_t)experts->n_slots * experts->n_ff;
    uint8_t *gates = malloc(rows * rb);
    for (size_t r = 0; r < rows; r++)
        memcpy(gates + r * rb, (const uint8_t *)experts->data + r * 3 * rb, rb);
    pyrt_experts eg = *experts;
    eg.gates = gates;
    eg.gates_bytes = rows * rb;
    float y2[4 * 64];
    int64_t active2 = -1;
    CHECK(pyrt_moe_ffn(pool, &eg, x, T, ids, tw, K, PYRT_ACT_SILU, (float)thr, y2, &active2) ==
                  PYRT_OK &&
              active2 == active && memcmp(y, y2, sizeof(float) * T * experts->n_embd) == 0,
          "fmt %d thr %g: the gate rows apart changed the result (%s)", experts->fmt, thr,
          pyrt_last_error());
    eg.gates_bytes -= rb;
    CHECK(pyrt_moe_ffn(pool, &eg, x, T, ids, tw, K, PYRT_ACT_SILU, (float)thr, y2, NULL) ==
                  PYRT_E_INVALID &&
              strstr(pyrt_last_error(), "gates hold") != NULL,
          "a gate copy a row short accepted: %s", pyrt_last_error());
    free(gates);
}

/* E experts of FF neurons over D columns in fmt, random: their rows (*gud, E * FF * 3 rows of
 * pyrt_row_bytes(fmt, D)) and the rows' values (*wv [E * FF * 3, D]); the caller frees both. */
static pyrt_experts random_experts(int fmt, int E, int FF, int D, uint8_t **gud, double **wv) {
    const size_t rb = pyrt_row_bytes(fmt, D);
    *gud = malloc((size_t)E * FF * 3 * rb);
    *wv = malloc(sizeof(double) * E * FF * 3 * D);
    for (int r = 0; r < E * FF * 3; r++)
        make_row(fmt, D, *gud + r * rb, *wv + (size_t)r * D, 0);
    return all_experts(*gud, fmt, E, FF, D);
}

/* Two distinct experts of E per token (K = 2) for T tokens, weighted w0 and 1 - w0. */
static void two_routes(int T, int E, float w0, int32_t *ids, float *tw) {
    for (int t = 0; t < T; t++) {
        ids[t * 2] = (int32_t)(rng_u32() % E);
        ids[t * 2 + 1] = (ids[t * 2] + 1 + (int32_t)(rng_u32() % (E - 1))) % E;
        tw[t * 2] = w0, tw[t * 2 + 1] = 1.0f - w0;
    }
}

/* xv [T, D]: the x the kernel computes with (for a quantized fmt, x's Q8 blocks' values; D <=
 * 64). */
static void kernel_x(int fmt, const float *x, int T, int D, double *xv) {
    for (int t = 0; t < T; t++) {
        pyrt_xq8 xq[2];
        if (is_quant(fmt))
            pyrt_quantize_x_q8(x + t * D, xq, D);
        for (int i = 0; i < D; i++)
            xv[t * D + i] = is_quant(fmt) ? (double)xq[i / 32].d * xq[i / 32].q[i % 32]
                                          : x[t * D + i];
    }
}

/* n_ff = FF: 13 (items shorter than a chunk of neurons) and 197 (items spanning several sparse
 * chunks of 32 neurons, so the software-pipelined path runs; 197 % 8 leaves a dense tail). */
static void test_moe_ffn_case(int FF) {
    enum { E = 5, T = 4, K = 2 };
    for (int f = 0; f < COUNT_OF(FORMATS); f++) {
        const int fmt = FORMATS[f];
        const int D = is_quant(fmt) ? 64 : 45;
        const size_t rb = pyrt_row_bytes(fmt, D);
        uint8_t *gud;
        double *wv;
        const pyrt_experts experts = random_experts(fmt, E, FF, D, &gud, &wv);
        float x[T * 64], tw[T * K], y[T * 64];
        int32_t ids[T * K];
        for (int i = 0; i < T * D; i++)
            x[i] = rng_normalish();
        two_routes(T, E, 0.7f, ids, tw);
        double xv[T * 64];
        kernel_x(fmt, x, T, D, xv);
        const double thresholds[] = {0.0, clean_threshold(wv, xv, ids, T, K, FF, D)};
        for (int ti = 0; ti < 2; ti++) {
            const double thr = thresholds[ti];
            double yref[T * 64], yabs[T * 64];
            int64_t near = 0;
            const int64_t active_ref =
                moe_ref(wv, xv, ids, tw, T, K, FF, D, thr, NULL, yref, yabs, &near);
            CHECK(near == 0, "fmt %d FF %d: %lld |act| within 1e-4 of threshold %g", fmt, FF,
                  (long long)near, thr);
            for (int nth = 1; nth <= 3; nth++) {
                pyrt_pool *pool = NULL;
                CHECK(pyrt_pool_create(nth, NULL, &pool) == PYRT_OK, "pool %d", nth);
                int64_t active = -1;
                int rc = pyrt_moe_ffn(pool, &experts, x, T, ids, tw, K, PYRT_ACT_SILU, (float)thr,
                                      y, &active);
                CHECK(rc == PYRT_OK, "moe_ffn fmt %d: %s", fmt, pyrt_last_error());
                if (near == 0)
                    CHECK(active == active_ref, "fmt %d thr %g: active %lld vs %lld", fmt, thr,
                          (long long)active, (long long)active_ref);
                if (thr == 0.0)
                    CHECK(active == (int64_t)T * K * FF, "dense active count");
                CHECK(near > 0 || close_to(y, yref, yabs, T * D), "moe fmt %d thr %g nth %d", fmt,
                      thr, nth);
                /* other prefetch distances, the VNNI dots off and on, and an idle-prefetch plan
                 * over the weights move no bit */
                for (int v = 0; v < 2; v++) {
                    pyrt_params params;
                    pyrt_params_default(&params);
                    params.expert_prefetch_neurons = v ? 5 : 0;
                    params.reduce_prefetch_items = v ? 6 : 0;
                    params.vnni = v;
                    pyrt_pool *other = NULL;
                    CHECK(pyrt_pool_create(nth, &params, &other) == PYRT_OK, "pool: %s",
                          pyrt_last_error());
                    pyrt_pf_plan plan = {.r = {{gud, rb, (int64_t)E * FF * 3}}, .n = 1};
                    pyrt_pool_plan_prefetch(other, &plan);
                    float y2[T * 64];
                    int64_t active2 = -1;
                    rc = pyrt_moe_ffn(other, &experts, x, T, ids, tw, K, PYRT_ACT_SILU,
                                      (float)thr, y2, &active2);
                    CHECK(rc == PYRT_OK && active2 == active &&
                              memcmp(y, y2, sizeof(float) * T * D) == 0,
                          "fmt %d thr %g nth %d: params %d changed the result", fmt, thr, nth, v);
                    pyrt_pool_free(other);
                }
                check_gates_apart(pool, &experts, x, ids, tw, T, K, thr, y, active);
                check_expert_maps(pool, gud, wv, xv, x, ids, tw, fmt, T, K, E, FF, D, thr, y);
                pyrt_pool_free(pool);
            }
        }
        free(gud);
        free(wv);
    }
}

/* One pool through both of pyrt_moe_ffn's routes in turn (the token blocks under 16 routes an
 * expert on average, pyrt_moe_batch from there, on the pool's second workspace), its workspaces
 * grown and reused: 40 tokens x 2 routes over 3 experts (~27 an expert: batch), 6 (4: blocks),
 * 96 (batch, a larger workspace), 40 again (batch, in the workspace the 96 left), each against
 * the float64 reference, dense and sparse, f32 and Q8_0 weights. */
static void test_moe_ffn_routes_share_a_pool(void) {
    enum { E = 3, K = 2, FF = 13, D = 64, T_MAX = 96 };
    static const int fmts[] = {PYRT_FMT_F32, PYRT_FMT_Q8_0};
    static const int token_counts[] = {40, 6, 96, 40};
    float *x = malloc(sizeof(float) * T_MAX * D), *y = malloc(sizeof(float) * T_MAX * D);
    double *xv = malloc(sizeof(double) * T_MAX * D), *yref = malloc(sizeof(double) * T_MAX * D),
           *yabs = malloc(sizeof(double) * T_MAX * D);
    float tw[T_MAX * K];
    int32_t ids[T_MAX * K];
    for (int i = 0; i < T_MAX * D; i++)
        x[i] = rng_normalish();
    two_routes(T_MAX, E, 0.6f, ids, tw);
    for (int f = 0; f < COUNT_OF(fmts); f++) {
        const int fmt = fmts[f];
        uint8_t *gud;
        double *wv;
        const pyrt_experts experts = random_experts(fmt, E, FF, D, &gud, &wv);
        kernel_x(fmt, x, T_MAX, D, xv);
        pyrt_pool *pool = NULL;
        CHECK(pyrt_pool_create(2, NULL, &pool) == PYRT_OK, "pool: %s", pyrt_last_error());
        for (int c = 0; c < COUNT_OF(token_counts); c++) {
            const int T = token_counts[c];
            const double thresholds[] = {0.0, clean_threshold(wv, xv, ids, T, K, FF, D)};
            for (int ti = 0; ti < 2; ti++) {
                int64_t near = 0, active = -1;
                const int64_t active_ref = moe_ref(wv, xv, ids, tw, T, K, FF, D, thresholds[ti],
                                                   NULL, yref, yabs, &near);
                const int rc = pyrt_moe_ffn(pool, &experts, x, T, ids, tw, K, PYRT_ACT_SILU,
                                            (float)thresholds[ti], y, &active);
                CHECK(rc == PYRT_OK, "fmt %d T %d: %s", fmt, T, pyrt_last_error());
                CHECK(near > 0 || (active == active_ref && close_to(y, yref, yabs, T * D)),
                      "fmt %d T %d thr %g: active %lld vs %lld, or y off the reference", fmt, T,
                      thresholds[ti], (long long)active, (long long)active_ref);
            }
        }
        pyrt_pool_free(pool);
        free(gud);
        free(wv);
    }
    free(x);
    free(y);
    free(xv);
    free(yref);
    free(yabs);
}

/* ---- 3. errors ----------------------------------------------------------------------------- */

static void *other_thread_error(void *arg) {
    (void)arg;
    /* last_error is per thread: this thread has not failed, so its message is empty. */
    return (void *)(uintptr_t)(pyrt_last_error()[0] == '\0');
}

static void test_errors(void) {
    pyrt_pool *pool = NULL;
    CHECK(pyrt_pool_create(0, NULL, &pool) == PYRT_E_INVALID && pool == NULL, "zero threads");
    CHECK(strstr(pyrt_last_error(), "n_threads") != NULL, "message: %s", pyrt_last_error());
    CHECK(pyrt_pool_create(2, NULL, NULL) == PYRT_E_INVALID, "NULL out");
    pyrt_params params;
    pyrt_params_default(&params);
    params.fuse_layer = 2;
    CHECK(pyrt_pool_create(2, &params, &pool) == PYRT_E_INVALID && pool == NULL &&
              strstr(pyrt_last_error(), "params.fuse_layer = 2 is outside [0, 1]") != NULL,
          "bad params: %s", pyrt_last_error());
    /* the automatic prefetch settings: L2 and 4 ahead on every pool */
    for (int th = 1; th <= 3; th++) {
        CHECK(pyrt_pool_create(th, NULL, &pool) == PYRT_OK, "pool of %d", th);
        const pyrt_params *got = pyrt_pool_params(pool);
        const int l2 = 1, ahead = 4;
        CHECK(got->prefetch_l2 == l2 && got->matvec_prefetch_rows == ahead &&
                  got->expert_prefetch_neurons == ahead,
              "%d threads: prefetch_l2 %d, rows %d, neurons %d", th, got->prefetch_l2,
              got->matvec_prefetch_rows, got->expert_prefetch_neurons);
        pyrt_pool_free(pool);
    }
    pyrt_params_default(&params);
    params.prefetch_l2 = 0;
    params.expert_prefetch_neurons = 7;
    CHECK(pyrt_pool_create(1, &params, &pool) == PYRT_OK, "pool");
    CHECK(pyrt_pool_params(pool)->prefetch_l2 == 0 &&
              pyrt_pool_params(pool)->matvec_prefetch_rows == 2 &&
              pyrt_pool_params(pool)->expert_prefetch_neurons == 7,
          "given settings kept, the automatic one resolved");
    pyrt_pool_free(pool);
    pool = NULL;
    pyrt_params_default(&params);
    params.spin_us = -1;
    CHECK(pyrt_pool_create(2, &params, &pool) == PYRT_E_INVALID &&
              strstr(pyrt_last_error(), "params.spin_us") != NULL,
          "negative spin: %s", pyrt_last_error());

    pthread_t th;
    void *ok = NULL;
    pthread_create(&th, NULL, other_thread_error, NULL);
    pthread_join(th, &ok);
    CHECK(ok != NULL, "last_error is thread-local");

    CHECK(pyrt_pool_create(2, NULL, &pool) == PYRT_OK, "pool");
    CHECK(pyrt_last_error()[0] == '\0', "success clears the message");
    float x[64] = {0}, y[64], tw[1] = {1.0f};
    int32_t ids[1] = {0};
    uint8_t gud[3 * 64 * 4] = {0};
    pyrt_experts e = all_experts(gud, PYRT_FMT_F32, 1, 1, 64);
    e.fmt = 5;
    CHECK(pyrt_moe_ffn(pool, &e, x, 1, ids, tw, 1, 0, 0.0f, y, NULL) == PYRT_E_INVALID,
          "unknown format");
    CHECK(strstr(pyrt_last_error(), "unknown weight format 5") != NULL, "%s", pyrt_last_error());
    e = all_experts(gud, PYRT_FMT_F32, 1, 1, 64);
    e.bytes -= 1;
    CHECK(pyrt_moe_ffn(pool, &e, x, 1, ids, tw, 1, 0, 0.0f, y, NULL) == PYRT_E_INVALID,
          "short weights");
    e = all_experts(gud, PYRT_FMT_Q8_0, 1, 1, 48);
    CHECK(pyrt_moe_ffn(pool, &e, x, 1, ids, tw, 1, 0, 0.0f, y, NULL) == PYRT_E_INVALID,
          "Q8_0 with n_embd 48");
    e = all_experts(gud, PYRT_FMT_F32, 1, 1, 64);
    ids[0] = 1;
    CHECK(pyrt_moe_ffn(pool, &e, x, 1, ids, tw, 1, 0, 0.0f, y, NULL) == PYRT_E_INVALID,
          "expert id out of range");
    ids[0] = 0;
    CHECK(pyrt_moe_ffn(pool, &e, NULL, 1, ids, tw, 1, 0, 0.0f, y, NULL) == PYRT_E_INVALID,
          "NULL x");
    CHECK(pyrt_moe_ffn(pool, NULL, x, 1, ids, tw, 1, 0, 0.0f, y, NULL) == PYRT_E_INVALID &&
              strstr(pyrt_last_error(), "experts is NULL") != NULL, "NULL experts");
    CHECK(pyrt_moe_ffn(NULL, &e, x, 1, ids, tw, 1, 0, 0.0f, y, NULL) == PYRT_E_INVALID,
          "NULL pool");
    CHECK(pyrt_moe_ffn(pool, &e, x, 1, ids, tw, 1, 7, 0.0f, y, NULL) == PYRT_E_INVALID,
          "bad activation");
    CHECK(pyrt_moe_ffn(pool, &e, x, 1, ids, tw, 1, 0, -1.0f, y, NULL) == PYRT_E_INVALID,
          "negative threshold");
    CHECK(pyrt_moe_ffn(pool, &e, x, 1, ids, tw, 1, 0, 0.0f, y, NULL) == PYRT_OK,
          "valid call: %s", pyrt_last_error());
    /* gpt-oss's expert biases: each read only within its length (heap buffers of exactly that
     * length: without the check, ASan reports the read past the short one) */
    float *bgu = calloc(2, sizeof(float)), *bd = calloc(64, sizeof(float));
    e.bias_gu = bgu;
    e.bias_down = bd;
    e.bias_gu_len = 1;
    e.bias_down_len = 64;
    CHECK(pyrt_moe_ffn(pool, &e, x, 1, ids, tw, 1, 0, 0.0f, y, NULL) == PYRT_E_INVALID &&
              strstr(pyrt_last_error(), "bias_gu holds 1 floats") != NULL,
          "short bias_gu: %s", pyrt_last_error());
    e.bias_gu_len = 2;
    e.bias_down_len = 63;
    CHECK(pyrt_moe_ffn(pool, &e, x, 1, ids, tw, 1, 0, 0.0f, y, NULL) == PYRT_E_INVALID &&
              strstr(pyrt_last_error(), "bias_down 63") != NULL,
          "short bias_down: %s", pyrt_last_error());
    e.bias_down_len = 64;
    CHECK(pyrt_moe_ffn(pool, &e, x, 1, ids, tw, 1, 0, 0.0f, y, NULL) == PYRT_OK,
          "biases of the right lengths: %s", pyrt_last_error());
    free(bgu);
    free(bd);
    CHECK(pyrt_simd_force(pyrt_simd_best() + 1) != PYRT_OK || pyrt_simd_best() == PYRT_SIMD_AVX512,
          "cannot force a level the CPU lacks");
    CHECK(pyrt_simd_force(-1) == PYRT_E_INVALID, "unknown level");
    pyrt_pool_free(pool);
    pyrt_pool_free(NULL);

    for (int i = 0; i < 20; i++) { /* build/free churn: LeakSanitizer reports anything lost */
        CHECK(pyrt_pool_create(1 + i % 4, NULL, &pool) == PYRT_OK, "pool churn");
        pyrt_pool_free(pool);
    }
    CHECK(pyrt_physical_cores() >= 1, "physical cores");
}

/* Tiles (rows x tokens in registers, the prefill's kernels) give every result bit for bit as a
 * dot or an axpy would: each level, format and VNNI setting, nr and nt across the tile sizes and
 * their remainders, lengths with every tail (odd block counts, groups of 8 and their rest). */
static void test_tiles_match_rows(void) {
    const int lengths_quant[] = {32, 64, 96, 288, 608};
    const int lengths_float[] = {16, 45, 96, 608};
    enum { NR = 9, NT = 11 };
    for (int level = PYRT_SIMD_SCALAR; level <= pyrt_simd_best(); level++) {
        for (int vnni = 0; vnni < 2; vnni++) {
            for (int f = 0; f < COUNT_OF(FORMATS); f++) {
                const int fmt = FORMATS[f];
                const pyrt_row_ops *ops = pyrt_row_ops_at(level, fmt, vnni);
                if (ops == NULL)
                    continue;
                const int *lengths = is_quant(fmt) ? lengths_quant : lengths_float;
                const int n_len = is_quant(fmt) ? COUNT_OF(lengths_quant) : COUNT_OF(lengths_float);
                for (int li = 0; li < n_len; li++) {
                    const int n = lengths[li];
                    const size_t rb = pyrt_row_bytes(fmt, n);
                    uint8_t *rows = malloc(rb * NR);
                    double *wv = malloc(sizeof(double) * n);
                    float *x = malloc(sizeof(float) * n * NT);
                    pyrt_xq8 *xq = malloc(sizeof(pyrt_xq8) * (n / 32 + 1) * NT);
                    const void *rp[NR], *xp[NT];
                    for (int r = 0; r < NR; r++) {
                        make_row(fmt, n, rows + r * rb, wv, r % 3 == 0);
                        rp[r] = rows + r * rb;
                    }
                    for (int i = 0; i < n * NT; i++)
                        x[i] = rng_normalish();
                    for (int t = 0; t < NT; t++) {
                        xp[t] = x + (size_t)t * n;
                        if (is_quant(fmt)) {
                            pyrt_quantize_x_q8(x + (size_t)t * n, xq + (size_t)t * (n / 32), n);
                            xp[t] = xq + (size_t)t * (n / 32);
                        }
                    }
                    /* dot tiles: out[t][r] (ts NR, rs 1) and transposed out[r][t] */
                    for (int nr = 1; nr <= NR; nr += 2)
                        for (int nt = 1; nt <= NT; nt += 3) {
                            float out[NT * NR], outt[NR * NT];
                            pyrt_dot_tile(ops, nr, rp, nt, xp, n, out, NR, 1);
                            pyrt_dot_tile(ops, nr, rp, nt, xp, n, outt, 1, NT);
                            for (int t = 0; t < nt; t++)
                                for (int r = 0; r < nr; r++) {
                                    const float d = ops->dot(rp[r], xp[t], n);
                                    CHECK(memcmp(&out[t * NR + r], &d, 4) == 0 &&
                                              memcmp(&outt[r * NT + t], &d, 4) == 0,
                                          "dot tile level %d vnni %d fmt %d n %d (%d x %d) at "
                                          "(%d, %d): %.9g vs dot %.9g", level, vnni, fmt, n, nr,
                                          nt, r, t, out[t * NR + r], d);
                                }
                        }
                    /* axpy tiles: the same bits as axpy calls per token, rows in order */
                    for (int nr = 1; nr <= NR; nr += 4)
                        for (int nt = 1; nt <= NT; nt += 2) {
                            float *ya = malloc(sizeof(float) * n * NT);
                            float *yb = malloc(sizeof(float) * n * NT);
                            float coef[NR][NT];
                            const float *ap[NR];
                            float *yap[NT];
                            for (int r = 0; r < nr; r++) {
                                for (int t = 0; t < nt; t++)
                                    coef[r][t] = rng_normalish();
                                ap[r] = coef[r];
                            }
                            for (int i = 0; i < n * nt; i++)
                                ya[i] = yb[i] = rng_normalish();
                            for (int t = 0; t < nt; t++)
                                yap[t] = ya + (size_t)t * n;
                            pyrt_axpy_tile(ops, nr, rp, ap, nt, yap, n);
                            for (int t = 0; t < nt; t++)
                                for (int r = 0; r < nr; r++)
                                    ops->axpy(coef[r][t], rp[r], yb + (size_t)t * n, n);
                            CHECK(memcmp(ya, yb, sizeof(float) * n * nt) == 0,
                                  "axpy tile level %d vnni %d fmt %d n %d (%d x %d) differs from "
                                  "axpy", level, vnni, fmt, n, nr, nt);
                            free(ya);
                            free(yb);
                        }
                    free(rows), free(wv), free(x), free(xq);
                }
            }
        }
    }
}

/* The K-quants' kernels of every level and VNNI setting: dot2, axpyn and the dot tiles give the
 * bits of dot / axpy calls; the AVX-512 VNNI dots the plain AVX-512 ones' bits; every level's dot
 * and axpy within f32 rounding of the scalar ones (their accuracy against a float64 reference is
 * tests/test_cpu_core.py's). Random super-blocks: every code and six-bit scale, f16 scales kept
 * small and finite. */
static void make_kquant_row(int fmt, int n, uint8_t *row) {
    const size_t bb = pyrt_row_bytes(fmt, PYRT_QK_K);
    for (size_t i = 0; i < bb * (size_t)(n / PYRT_QK_K); i++)
        row[i] = (uint8_t)(rng_u32() >> 5);
    for (int s = 0; s < n / PYRT_QK_K; s++) {
        uint8_t *w = row + (size_t)s * bb;
        const uint16_t d = fp16_from_fp32(0.002f + 0.004f * (float)(rng_u32() % 100) / 100.0f);
        const uint16_t dmin = fp16_from_fp32(0.001f * (float)(rng_u32() % 100) / 100.0f);
        if (fmt == PYRT_FMT_Q6_K) {
            memcpy(w + 208, &d, 2);
        } else {
            memcpy(w, &d, 2);
            memcpy(w + 2, &dmin, 2);
        }
    }
}

static void test_kquant_kernels_agree(void) {
    const int fmts[] = {PYRT_FMT_Q4_K, PYRT_FMT_Q5_K, PYRT_FMT_Q6_K};
    const int lengths[] = {256, 768, 2048};
    enum { NR = 9, NT = 5 };
    const double u = ldexp(1.0, -24);
    for (int f = 0; f < COUNT_OF(fmts); f++) {
        const int fmt = fmts[f];
        for (int li = 0; li < COUNT_OF(lengths); li++) {
            const int n = lengths[li];
            const size_t rb = pyrt_row_bytes(fmt, n);
            uint8_t *rows = malloc(rb * NR);
            float *x = malloc(sizeof(float) * n * NT), *y1 = malloc(sizeof(float) * n);
            float *y2 = malloc(sizeof(float) * n), *y0 = malloc(sizeof(float) * n);
            const size_t xs = pyrt_xq_units((size_t)n);
            pyrt_xq8 *xq = malloc(sizeof(pyrt_xq8) * xs * NT);
            const void *rp[NR], *xp[NT];
            for (int r = 0; r < NR; r++) {
                make_kquant_row(fmt, n, rows + r * rb);
                rp[r] = rows + r * rb;
            }
            for (int i = 0; i < n * NT; i++)
                x[i] = rng_normalish();
            /* the activation the K-quant dots take: scales per 256, sums per 16 after the blocks
             * (the scalar dots sum x's codes themselves: a wrong sum shows as a SIMD mismatch) */
            for (int t = 0; t < NT; t++) {
                pyrt_quantize_x_q8k(x + (size_t)t * n, xq + (size_t)t * xs, n);
                xp[t] = xq + (size_t)t * xs;
            }
            const pyrt_row_ops *scalar = pyrt_row_ops_at(PYRT_SIMD_SCALAR, fmt, 0);
            for (int level = PYRT_SIMD_SCALAR; level <= pyrt_simd_best(); level++)
                for (int vnni = 0; vnni < 2; vnni++) {
                    const pyrt_row_ops *ops = pyrt_row_ops_at(level, fmt, vnni);
                    CHECK(ops != NULL, "level %d has no kernels for format %d", level, fmt);
                    if (ops == NULL)
                        continue;
                    float d[NR][NT];
                    for (int r = 0; r < NR; r++)
                        for (int t = 0; t < NT; t++) {
                            d[r][t] = ops->dot(rp[r], xp[t], n);
                            const float s = scalar->dot(rp[r], xp[t], n);
                            /* both within (n + 4) u sum|w x| of the exact dot: no worse apart */
                            double absum = 0.0;
                            for (int i = 0; i < n; i++)
                                y0[i] = 0.0f;
                            scalar->axpy(1.0f, rp[r], y0, n);
                            for (int i = 0; i < n; i++)
                                absum += fabs((double)y0[i] * xq[t * xs + i / 32].d *
                                              xq[t * xs + i / 32].q[i % 32]);
                            CHECK(fabs((double)d[r][t] - s) <= 2 * (n + 8) * u * absum + 1e-30,
                                  "kquant dot level %d vnni %d fmt %d n %d: %.9g vs scalar %.9g",
                                  level, vnni, fmt, n, d[r][t], s);
                        }
                    if (ops->dot2 != NULL) {
                        float out[2];
                        ops->dot2(rp[0], rp[1], xp[1], n, out);
                        CHECK(memcmp(&out[0], &d[0][1], 4) == 0 &&
                                  memcmp(&out[1], &d[1][1], 4) == 0,
                              "kquant dot2 level %d vnni %d fmt %d n %d differs from dot", level,
                              vnni, fmt, n);
                    }
                    if (ops->dot_pf != NULL && ops->dot2_pf != NULL) { /* prefetches: same bits */
                        const void *pf[5] = {rp[2], rp[3], rp[4], rp[5], rp[6]};
                        float out[2];
                        const float p0 = ops->dot_pf(rp[0], xp[1], n, pf, 5);
                        ops->dot2_pf(rp[0], rp[1], xp[1], n, out, pf, 5);
                        CHECK(memcmp(&p0, &d[0][1], 4) == 0 && memcmp(&out[0], &d[0][1], 4) == 0 &&
                                  memcmp(&out[1], &d[1][1], 4) == 0,
                              "kquant dot_pf/dot2_pf level %d vnni %d fmt %d n %d differ from dot",
                              level, vnni, fmt, n);
                    }
                    for (int nr = 1; nr <= NR; nr += 4)
                        for (int nt = 1; nt <= NT; nt += 2) {
                            float out[NT * NR];
                            pyrt_dot_tile(ops, nr, rp, nt, xp, n, out, NR, 1);
                            for (int t = 0; t < nt; t++)
                                for (int r = 0; r < nr; r++)
                                    CHECK(memcmp(&out[t * NR + r], &d[r][t], 4) == 0,
                                          "kquant dot tile level %d vnni %d fmt %d n %d (%d x %d) "
                                          "at (%d, %d) differs from dot", level, vnni, fmt, n, nr,
                                          nt, r, t);
                        }
                    for (int nr = 1; nr <= PYRT_AXPY_ROWS && ops->axpyn != NULL; nr += 3) {
                        float a[PYRT_AXPY_ROWS];
                        for (int r = 0; r < nr; r++)
                            a[r] = rng_normalish();
                        for (int i = 0; i < n; i++)
                            y1[i] = y2[i] = y0[i] = x[i];
                        ops->axpyn(nr, a, rp, y1, n);
                        for (int r = 0; r < nr; r++) {
                            ops->axpy(a[r], rp[r], y2, n);
                            scalar->axpy(a[r], rp[r], y0, n);
                        }
                        CHECK(memcmp(y1, y2, sizeof(float) * n) == 0,
                              "kquant axpyn level %d fmt %d n %d nr %d differs from axpy calls",
                              level, fmt, n, nr);
                        for (int i = 0; i < n; i++) { /* rounding: a few u of each term */
                            double mag = fabs(x[i]);
                            for (int r = 0; r < nr; r++)
                                mag += 64.0 * fabs(a[r]);
                            if (fabs((double)y1[i] - y0[i]) > 8 * nr * u * mag + 1e-30) {
                                CHECK(0, "kquant axpy level %d fmt %d n %d nr %d at %d: %.9g vs "
                                      "scalar %.9g", level, fmt, n, nr, i, y1[i], y0[i]);
                                break;
                            }
                        }
                    }
                }
            free(rows), free(x), free(y1), free(y2), free(y0), free(xq);
        }
    }
}

/* The K-quants' int8-multiplier axpyn (pyrt_row_ops.axpyn_i8, where the level has it: Q4_K,
 * Q5_K, Q6_K) against the exact sum in double, within its stated bound: per element i of
 * sub-block j, (S_j / 500) sum_r q_ri (S_j = max_r |a_r d_r sc_rj| / 127: each multiplier off by
 * at most half of S_j / 254, and the f32 rounding of its remainder) plus f32 rounding, a few u
 * of the terms' magnitude. Rows of 1, 3 and 8 super-blocks, every nr (a group of 4 with a tail),
 * multipliers of both signs and one zero. */
static void q4_k_sc_m(const uint8_t *w, int j, int *sc, int *m) {
    const uint8_t *p = w + 4;
    if (j < 4) {
        *sc = p[j] & 63, *m = p[j + 4] & 63;
    } else {
        *sc = (p[j + 4] & 0xF) | ((p[j - 4] >> 6) << 4);
        *m = (p[j + 4] >> 4) | ((p[j] >> 6) << 4);
    }
}

/* Element e (0..255) of super-block w: weight = c q - mt for multiplier a, c = a d sc of its
 * sub-block, q its stored code (Q5_K: 0..31; Q6_K: 0..63, the weight d sc (q - 32)). */
static void kquant_term(int fmt, const uint8_t *w, int e, double a, double *c, int *q,
                        double *mt) {
    if (fmt == PYRT_FMT_Q4_K || fmt == PYRT_FMT_Q5_K) { /* Q5_K: qh at 16, qs at 48 */
        const int j = e / 32, l = e % 32, q5 = fmt == PYRT_FMT_Q5_K;
        int sc, m;
        q4_k_sc_m(w, j, &sc, &m);
        *c = a * pyrt_fp16_to_fp32(pyrt_load_u16(w)) * sc;
        *mt = a * pyrt_fp16_to_fp32(pyrt_load_u16(w + 2)) * m;
        *q = (w[(q5 ? 48 : 16) + 32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
        if (q5)
            *q |= ((w[16 + l] >> j) & 1) << 4;
        return;
    }
    const int h = e / 128, p = e % 128 / 32, l = e % 32;
    const int lo = (w[64 * h + 32 * (p % 2) + l] >> (4 * (p / 2))) & 0xF;
    const int hi = (w[128 + 32 * h + l] >> (2 * p)) & 3;
    *c = a * pyrt_fp16_to_fp32(pyrt_load_u16(w + 208)) * (int8_t)w[192 + e / 16];
    *q = lo | hi << 4;
    *mt = 32 * *c;
}

static void test_kquant_axpyn_i8(void) {
    const int fmts[] = {PYRT_FMT_Q4_K, PYRT_FMT_Q5_K, PYRT_FMT_Q6_K};
    const int lengths[] = {256, 768, 2048};
    const double u = ldexp(1.0, -24);
    for (int f = 0; f < COUNT_OF(fmts); f++)
        for (int level = PYRT_SIMD_SCALAR; level <= pyrt_simd_best(); level++)
            for (int vnni = 0; vnni < 2; vnni++) {
                const int fmt = fmts[f];
                const pyrt_row_ops *ops = pyrt_row_ops_at(level, fmt, vnni);
                if (ops == NULL || ops->axpyn_i8 == NULL)
                    continue;
                for (int li = 0; li < COUNT_OF(lengths); li++) {
                    const int n = lengths[li];
                    const size_t rb = pyrt_row_bytes(fmt, n), bb = pyrt_row_bytes(fmt, PYRT_QK_K);
                    uint8_t *rows = malloc(rb * PYRT_AXPY_ROWS);
                    float *y = malloc(sizeof(float) * n);
                    double *ref = malloc(sizeof(double) * n);
                    double *bound = malloc(sizeof(double) * n);
                    const void *rp[PYRT_AXPY_ROWS];
                    for (int r = 0; r < PYRT_AXPY_ROWS; r++) {
                        make_kquant_row(fmt, n, rows + r * rb);
                        rp[r] = rows + r * rb;
                    }
                    for (int nr = 1; nr <= PYRT_AXPY_ROWS; nr++) {
                        float a[PYRT_AXPY_ROWS];
                        for (int r = 0; r < nr; r++)
                            a[r] = r == 2 ? 0.0f : rng_normalish();
                        for (int i = 0; i < n; i++) {
                            y[i] = rng_normalish();
                            double c[PYRT_AXPY_ROWS], mt[PYRT_AXPY_ROWS], cmax = 0.0;
                            int q[PYRT_AXPY_ROWS];
                            ref[i] = y[i];
                            bound[i] = 4 * u * fabs(y[i]);
                            for (int r = 0; r < nr; r++) {
                                const uint8_t *w = (const uint8_t *)rp[r] + (size_t)(i / 256) * bb;
                                kquant_term(fmt, w, i % 256, a[r], &c[r], &q[r], &mt[r]);
                                cmax = fmax(cmax, fabs(c[r]));
                                ref[i] += c[r] * q[r] - mt[r];
                            }
                            for (int r = 0; r < nr; r++) /* rounding; the multipliers' step */
                                bound[i] += 8 * nr * u * (fabs(c[r]) * 63 + fabs(mt[r])) +
                                            cmax / 127 / 500 * q[r];
                        }
                        ops->axpyn_i8(nr, a, rp, y, n, NULL, 0);
                        for (int i = 0; i < n; i++)
                            if (!(fabs((double)y[i] - ref[i]) <= bound[i] + 1e-30)) {
                                CHECK(0,
                                      "axpyn_i8 fmt %d level %d n %d nr %d at %d: %.9g vs %.9g "
                                      "(bound %.3g)",
                                      fmt, level, n, nr, i, y[i], ref[i], bound[i]);
                                break;
                            }
                    }
                    free(rows), free(y), free(ref), free(bound);
                }
            }
}

int main(void) {
    test_quantize_x();
    test_quantize_x_levels();
    test_kquant_axpyn_i8();
    test_quantize_x_q8k_groups();
    test_kquant_kernels_match_plain();
    test_add_levels();
    test_row_kernels();
    test_fused_kernels_match_plain();
    test_vnni_dots_match_avx512();
    test_mxfp4_avx512_matches_avx2();
    test_tiles_match_rows();
    test_kquant_kernels_agree();
    test_moe_ffn_case(13);
    test_moe_ffn_case(197);
    test_moe_ffn_routes_share_a_pool();
    test_errors();
    if (failures) {
        printf("%d C core test(s) failed\n", failures);
        return 1;
    }
    printf("all C core tests passed\n");
    return 0;
}

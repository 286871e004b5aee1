/* How long do the row kernels take per byte of weights, per format and SIMD level, when the
 * bytes are already in cache? The compute side of a decode step: a format whose kernel reads
 * fewer bytes per second than DRAM delivers is compute-bound there, whatever the prefetching.
 *
 * One thread; per format a matrix of ROWS rows of N elements (about 1.5 MB: L2/L3-resident),
 * against one token quantized as the decode step does. Cases per format and level:
 *   dot2   gate and up rows of a neuron in one pass over x (the expert kernel's gate/up);
 *   axpyn  8 down rows into one y (the expert kernel's down);
 *   axpyi8 the same with int8 multipliers (pyrt_row_ops.axpyn_i8), where the level has them;
 * timed over --rounds interleaved rounds (formats and levels alternate inside each round); the
 * fastest round per case (the least disturbed by other work on the machine) in GB/s of weight
 * bytes and ns per row. Not part of the library.
 *
 * K-quant rows take x as pyrt_quantize_x_q8k makes it (scales shared per 256, sums per 16), the
 * others per 32.
 *
 *   cc -O3 -fno-math-errno -std=c11 -Iruntime/include -Iruntime/src runtime/src/*.c \
 *      bench/cpu_rows.c -o /tmp/cpu_rows -pthread -lm && /tmp/cpu_rows 7
 * (the sources: each .c file in runtime/src, with the library's optimization flags (CMakeLists.txt:
 * at -O2 GCC leaves some of the kernels' small loops rolled); argument: rounds) */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pyrt.h"
#include "rows.h"

enum { N = 2048, ROWS = 768, REPS = 6, MAX_ROUNDS = 31 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Random blocks with every f16 scale set to a small normal value (no inf / NaN). */
static void fill(uint8_t *w, int fmt, size_t row_bytes, unsigned *seed) {
    const size_t bb = pyrt_row_bytes(fmt, pyrt_fmt_block(fmt));
    for (size_t i = 0; i < row_bytes * ROWS; i++)
        w[i] = (uint8_t)(rand_r(seed) >> 7);
    for (size_t b = 0; b < row_bytes * ROWS / bb; b++) {
        uint8_t *blk = w + b * bb;
        const size_t at = fmt == PYRT_FMT_Q6_K ? 208 : 0;
        blk[at] = 0x1F;
        blk[at + 1] = 0x21;
        if (fmt == PYRT_FMT_Q4_K || fmt == PYRT_FMT_Q5_K || fmt == PYRT_FMT_Q5_1) {
            blk[2] = 0x1F;
            blk[3] = 0x21;
        }
    }
}

static volatile float sink;

/* c: 0 dot2, 1 axpyn, 2 axpyn_i8 */
static double run_case(const pyrt_row_ops *ops, int c, const uint8_t *w, size_t rb,
                       const pyrt_xq8 *xq, float *y) {
    const int axpy = c > 0;
    const double t0 = now();
    for (int rep = 0; rep < REPS; rep++) {
        if (!axpy) {
            for (int r = 0; r + 1 < ROWS; r += 2) {
                float out[2];
                if (ops->dot2)
                    ops->dot2(w + r * rb, w + (r + 1) * rb, xq, N, out);
                else {
                    out[0] = ops->dot(w + r * rb, xq, N);
                    out[1] = ops->dot(w + (r + 1) * rb, xq, N);
                }
                sink += out[0] + out[1];
            }
        } else {
            float a[PYRT_AXPY_ROWS];
            const void *rows[PYRT_AXPY_ROWS];
            for (int k = 0; k < PYRT_AXPY_ROWS; k++)
                a[k] = 0.001f * (float)(k + 1);
            for (int r = 0; r + PYRT_AXPY_ROWS <= ROWS; r += PYRT_AXPY_ROWS) {
                for (int k = 0; k < PYRT_AXPY_ROWS; k++)
                    rows[k] = w + (size_t)(r + k) * rb;
                if (c == 2)
                    ops->axpyn_i8(PYRT_AXPY_ROWS, a, rows, y, N, NULL, 0);
                else if (ops->axpyn)
                    ops->axpyn(PYRT_AXPY_ROWS, a, rows, y, N);
                else
                    for (int k = 0; k < PYRT_AXPY_ROWS; k++)
                        ops->axpy(a[k], rows[k], y, N);
            }
            sink += y[N / 2];
        }
    }
    return (now() - t0) / REPS;
}

int main(int argc, char **argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 5;
    if (rounds < 1 || rounds > MAX_ROUNDS)
        return fprintf(stderr, "rounds: 1..%d\n", MAX_ROUNDS), 1;
    const int fmts[] = {PYRT_FMT_Q8_0, PYRT_FMT_Q4_0, PYRT_FMT_MXFP4, PYRT_FMT_Q5_0,
                        PYRT_FMT_Q4_K, PYRT_FMT_Q5_K, PYRT_FMT_Q6_K};
    const char *names[] = {"Q8_0", "Q4_0", "MXFP4", "Q5_0", "Q4_K", "Q5_K", "Q6_K"};
    enum { NF = sizeof fmts / sizeof fmts[0] };
    /* levels: 1 AVX2, 2 AVX-512, 3 AVX-512 + VNNI (where the CPU has them) */
    const int best = pyrt_simd_best();
    const int nl = best < PYRT_SIMD_AVX512 ? 1 : pyrt_cpu_has_vnni() ? 3 : 2;
    static const char *lname[] = {"avx2", "avx512", "avx512+vnni"};
    uint8_t *w[NF];
    size_t rb[NF];
    unsigned seed = 1;
    for (int f = 0; f < NF; f++) {
        rb[f] = pyrt_row_bytes(fmts[f], N);
        w[f] = malloc(rb[f] * ROWS);
        fill(w[f], fmts[f], rb[f], &seed);
    }
    float x[N], y[N];
    for (int i = 0; i < N; i++)
        x[i] = (float)(rand_r(&seed) % 2001 - 1000) * 1e-3f, y[i] = 0.0f;
    /* per 32; shared per 256 with the sums per 16 after the blocks (the K-quants') */
    pyrt_xq8 xq[N / PYRT_QK], xqk[N / PYRT_QK + (N / PYRT_QK + 8) / 9]; /* pyrt_xq_units(N) */
    pyrt_quantize_x_q8_scalar(x, xq, N);
    pyrt_quantize_x_q8k_scalar(x, xqk, N);
    static double t[NF][3][3][MAX_ROUNDS];
    for (int round = 0; round < rounds; round++)
        for (int f = 0; f < NF; f++)
            for (int l = 0; l < nl; l++) {
                const pyrt_row_ops *ops =
                    pyrt_row_ops_at(l == 0 ? PYRT_SIMD_AVX2 : PYRT_SIMD_AVX512, fmts[f], l == 2);
                for (int c = 0; c < 3; c++) {
                    if (c == 2 && ops->axpyn_i8 == NULL)
                        continue;
                    memset(y, 0, sizeof y);
                    const pyrt_xq8 *xf = pyrt_fmt_xq(fmts[f]) == PYRT_XQ_SHARED ? xqk : xq;
                    t[f][l][c][round] = run_case(ops, c, w[f], rb[f], xf, y);
                }
            }
    printf("%-5s %-12s %-6s %9s %9s\n", "fmt", "level", "case", "GB/s", "ns/row");
    for (int f = 0; f < NF; f++)
        for (int l = 0; l < nl; l++)
            for (int c = 0; c < 3; c++) {
                if (t[f][l][c][0] == 0.0)
                    continue;
                qsort(t[f][l][c], (size_t)rounds, sizeof(double), cmp_double);
                const double s = t[f][l][c][0];
                printf("%-5s %-12s %-6s %9.2f %9.1f\n", names[f], lname[l],
                       c == 2 ? "axpyi8" : c ? "axpyn" : "dot2",
                       (double)(rb[f] * ROWS) / s * 1e-9, s / ROWS * 1e9);
            }
    return 0;
}

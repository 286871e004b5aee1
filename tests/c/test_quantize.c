/* pyrt_quantize_rows / pyrt_dequantize_rows under the sanitizers (tests/test_quantize_k.py builds
 * and runs this with ASan + UBSan): every lane width and a pool give the same bytes, the round
 * trip stays within the format's error, the edge rows (zeros, constants, a spike, tiny values)
 * decode to finite values, and bad arguments fail with a status and a message. The bytes
 * themselves are checked against llama-quantize's in tests/test_quantize_k.py. */
#define TEST_RNG_SEED 0x51ab7e3c9d2f4a61ull
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "pyrt.h"

enum { ROWS = 7, N = 768 };

static float gaussian(void) { /* Box-Muller from two uniforms in (0, 1] */
    const float u = (rng_u32() + 1.f) / 4294967296.f, v = (rng_u32() + 1.f) / 4294967296.f;
    return sqrtf(-2.f * logf(u)) * cosf(6.2831853f * v);
}

/* Rows: gaussian, zeros, a constant, one spike, negative only, tiny, gaussian with a zero
 * sub-block. */
static void fill(float *x) {
    for (int i = 0; i < ROWS * N; i++)
        x[i] = gaussian();
    memset(x + N, 0, N * sizeof *x);
    for (int i = 0; i < N; i++) {
        x[2 * N + i] = 0.25f;
        x[3 * N + i] = i == 300 ? 1e3f : 0.f;
        x[4 * N + i] = -fabsf(x[4 * N + i]);
        x[5 * N + i] *= 1e-30f;
    }
    memset(x + 6 * N + 32, 0, 32 * sizeof *x);
}

static void test_format(pyrt_pool *pool, int fmt, float max_rel_rmse) {
    static float x[ROWS * N], y[ROWS * N];
    fill(x);
    const size_t bytes = ROWS * pyrt_row_bytes(fmt, N);
    uint8_t *a = malloc(bytes), *b = malloc(bytes);
    CHECK(a && b, "malloc");
    if (!a || !b)
        return;
    const int best = pyrt_simd_best();
    pyrt_simd_force(PYRT_SIMD_SCALAR); /* the 4-lane searches */
    CHECK(pyrt_quantize_rows(NULL, fmt, x, ROWS, N, a, bytes) == PYRT_OK, "%s",
          pyrt_last_error());
    pyrt_simd_force(best); /* 8 lanes where the CPU has AVX2; on the pool */
    CHECK(pyrt_quantize_rows(pool, fmt, x, ROWS, N, b, bytes) == PYRT_OK, "%s",
          pyrt_last_error());
    CHECK(memcmp(a, b, bytes) == 0, "fmt %d: lane widths or the pool changed the bytes", fmt);
    CHECK(pyrt_dequantize_rows(pool, fmt, b, bytes, ROWS, N, y) == PYRT_OK, "%s",
          pyrt_last_error());
    double err = 0, ref = 0;
    for (int i = 0; i < N; i++) {
        err += (double)(y[i] - x[i]) * (y[i] - x[i]);
        ref += (double)x[i] * x[i];
    }
    CHECK(sqrt(err / ref) < max_rel_rmse, "fmt %d: relative RMSE %g", fmt, sqrt(err / ref));
    for (int i = 0; i < ROWS * N; i++)
        if (!isfinite(y[i])) {
            CHECK(0, "fmt %d: element %d decodes to %g", fmt, i, y[i]);
            break;
        }
    for (int i = N; i < 2 * N; i++)
        CHECK(y[i] == 0.f, "fmt %d: zero row decodes to %g at %d", fmt, y[i], i - N);
    free(a);
    free(b);
}

static void test_errors(void) {
    float x[512] = {0};
    uint8_t out[4 * 210];
    CHECK(pyrt_quantize_rows(NULL, PYRT_FMT_Q4_K, x, 1, 384, out, sizeof out) == PYRT_E_INVALID,
          "row of 384 accepted");
    CHECK(strstr(pyrt_last_error(), "multiple of 256") != NULL, "%s", pyrt_last_error());
    CHECK(pyrt_quantize_rows(NULL, PYRT_FMT_Q8_0, x, 1, 256, out, 34 * 8) == PYRT_E_UNSUPPORTED,
          "Q8_0 accepted");
    CHECK(pyrt_quantize_rows(NULL, PYRT_FMT_Q6_K, x, 2, 256, out, 419) == PYRT_E_INVALID,
          "short out accepted");
    CHECK(pyrt_quantize_rows(NULL, PYRT_FMT_Q6_K, NULL, 1, 256, out, 210) == PYRT_E_INVALID,
          "NULL x accepted");
    CHECK(pyrt_dequantize_rows(NULL, PYRT_FMT_Q5_K, out, 175, 1, 256, x) == PYRT_E_INVALID,
          "short data accepted");
    CHECK(pyrt_dequantize_rows(NULL, PYRT_FMT_Q5_K, out, 176, 1, 200, x) == PYRT_E_INVALID,
          "row of 200 accepted");
    CHECK(pyrt_quantize_rows(NULL, PYRT_FMT_Q4_K, x, 0, 256, out, 0) == PYRT_OK, "no rows: %s",
          pyrt_last_error());
}

int main(void) {
    pyrt_pool *pool = NULL;
    CHECK(pyrt_pool_create(3, NULL, &pool) == PYRT_OK, "%s", pyrt_last_error());
    test_format(pool, PYRT_FMT_Q4_K, 0.1f);
    test_format(pool, PYRT_FMT_Q5_K, 0.05f);
    test_format(pool, PYRT_FMT_Q6_K, 0.026f);
    test_errors();
    pyrt_pool_free(pool);
    if (failures) {
        printf("%d failures\n", failures);
        return 1;
    }
    printf("all C quantize tests passed\n");
    return 0;
}

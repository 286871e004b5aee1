/* Portable row kernels (any CPU), and the activation quantizer every SIMD level shares.
 * These are also the reference the SIMD kernels are tested against in tests/c/. */
#include <math.h>
#include <string.h>

#include "rows.h"

/* ---- activation quantization --------------------------------------------------------------- */

void pyrt_add_f32_scalar(float *y, const float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        y[i] += x[i];
}

static float amax32(const float *xb) {
    float amax = 0.0f;
    for (int i = 0; i < PYRT_QK; i++)
        amax = fmaxf(amax, fabsf(xb[i]));
    return amax;
}

/* One block of 32 at scale d = amax / 127. */
static void store32(const float *xb, float amax, pyrt_xq8 *out) {
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    out->d = d;
    /* nearbyintf rounds half to even under the default rounding mode (as torch.round). */
    for (int i = 0; i < PYRT_QK; i++)
        out->q[i] = (int8_t)nearbyintf(xb[i] * id);
}

void pyrt_quantize_x_q8_scalar(const float *x, pyrt_xq8 *out, int n) {
    for (int b = 0; b < n / PYRT_QK; b++)
        store32(x + (size_t)b * PYRT_QK, amax32(x + (size_t)b * PYRT_QK), out + b);
}

/* The sums of q per 16 elements after x's n/32 blocks (pyrt_xq_sums). */
static void store_sums(pyrt_xq8 *out, int n) {
    uint8_t *s = (uint8_t *)(out + n / PYRT_QK);
    for (int i = 0; i < n / 16; i++) {
        int16_t v = 0;
        for (int l = 0; l < 16; l++)
            v = (int16_t)(v + out[i / 2].q[16 * (i % 2) + l]);
        memcpy(s + 2 * i, &v, 2);
    }
}

void pyrt_quantize_x_q8k_scalar(const float *x, pyrt_xq8 *out, int n) {
    int b = 0;
    for (; b + 8 <= n / PYRT_QK; b += 8) {
        float amax = 0.0f;
        for (int j = 0; j < 8; j++)
            amax = fmaxf(amax, amax32(x + (size_t)(b + j) * PYRT_QK));
        for (int j = 0; j < 8; j++)
            store32(x + (size_t)(b + j) * PYRT_QK, amax, out + b + j);
    }
    pyrt_quantize_x_q8_scalar(x + (size_t)b * PYRT_QK, out + b, n - b * PYRT_QK);
    store_sums(out, n);
}

/* ---- float formats ------------------------------------------------------------------------- */

/* Eight partial sums: shorter dependency chains and smaller rounding error than one. */
#define DOT8(load)                                                                                \
    float acc[8] = {0};                                                                           \
    int i = 0;                                                                                    \
    for (; i + 8 <= n; i += 8)                                                                    \
        for (int l = 0; l < 8; l++)                                                               \
            acc[l] += load(i + l) * xf[i + l];                                                    \
    float sum = 0.0f;                                                                             \
    for (; i < n; i++)                                                                            \
        sum += load(i) * xf[i];                                                                   \
    return sum + ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));

static float dot_f32(const void *row, const void *x, int n) {
    const float *w = row, *xf = x;
#define LOAD(i) w[i]
    DOT8(LOAD)
#undef LOAD
}

static float dot_f16(const void *row, const void *x, int n) {
    const uint16_t *w = row;
    const float *xf = x;
#define LOAD(i) pyrt_fp16_to_fp32(w[i])
    DOT8(LOAD)
#undef LOAD
}

static float dot_bf16(const void *row, const void *x, int n) {
    const uint16_t *w = row;
    const float *xf = x;
#define LOAD(i) pyrt_bf16_to_fp32(w[i])
    DOT8(LOAD)
#undef LOAD
}

static void axpy_f32(float a, const void *row, float *y, int n) {
    const float *w = row;
    for (int i = 0; i < n; i++)
        y[i] += a * w[i];
}

static void axpy_f16(float a, const void *row, float *y, int n) {
    const uint16_t *w = row;
    for (int i = 0; i < n; i++)
        y[i] += a * pyrt_fp16_to_fp32(w[i]);
}

static void axpy_bf16(float a, const void *row, float *y, int n) {
    const uint16_t *w = row;
    for (int i = 0; i < n; i++)
        y[i] += a * pyrt_bf16_to_fp32(w[i]);
}

/* ---- quantized formats: integer dot per block, f32 across blocks --------------------------- */

static float dot_q8_0(const void *row, const void *x, int n) {
    const uint8_t *w = row;
    const pyrt_xq8 *xq = x;
    float sum = 0.0f;
    for (int b = 0; b < n / PYRT_QK; b++, w += PYRT_Q8_0_BYTES) {
        const int8_t *q = (const int8_t *)(w + 2);
        int32_t isum = 0;
        for (int i = 0; i < PYRT_QK; i++)
            isum += (int32_t)q[i] * xq[b].q[i];
        sum += pyrt_fp16_to_fp32(pyrt_load_u16(w)) * xq[b].d * (float)isum;
    }
    return sum;
}

static float dot_q4_0(const void *row, const void *x, int n) {
    const uint8_t *w = row;
    const pyrt_xq8 *xq = x;
    float sum = 0.0f;
    for (int b = 0; b < n / PYRT_QK; b++, w += PYRT_Q4_0_BYTES) {
        const uint8_t *qs = w + 2;
        int32_t isum = 0;
        for (int i = 0; i < PYRT_QK / 2; i++) {
            isum += ((int32_t)(qs[i] & 0xF) - 8) * xq[b].q[i];
            isum += ((int32_t)(qs[i] >> 4) - 8) * xq[b].q[i + PYRT_QK / 2];
        }
        sum += pyrt_fp16_to_fp32(pyrt_load_u16(w)) * xq[b].d * (float)isum;
    }
    return sum;
}

static void axpy_q8_0(float a, const void *row, float *y, int n) {
    const uint8_t *w = row;
    for (int b = 0; b < n / PYRT_QK; b++, w += PYRT_Q8_0_BYTES, y += PYRT_QK) {
        const int8_t *q = (const int8_t *)(w + 2);
        const float s = a * pyrt_fp16_to_fp32(pyrt_load_u16(w));
        for (int i = 0; i < PYRT_QK; i++)
            y[i] += s * (float)q[i];
    }
}

static void axpy_q4_0(float a, const void *row, float *y, int n) {
    const uint8_t *w = row;
    for (int b = 0; b < n / PYRT_QK; b++, w += PYRT_Q4_0_BYTES, y += PYRT_QK) {
        const uint8_t *qs = w + 2;
        const float s = a * pyrt_fp16_to_fp32(pyrt_load_u16(w));
        for (int i = 0; i < PYRT_QK / 2; i++) {
            y[i] += s * (float)((int)(qs[i] & 0xF) - 8);
            y[i + PYRT_QK / 2] += s * (float)((int)(qs[i] >> 4) - 8);
        }
    }
}

static const pyrt_row_ops ops_f32 = {.dot = dot_f32, .axpy = axpy_f32};
static const pyrt_row_ops ops_f16 = {.dot = dot_f16, .axpy = axpy_f16};
static const pyrt_row_ops ops_bf16 = {.dot = dot_bf16, .axpy = axpy_bf16};
static const pyrt_row_ops ops_q8_0 = {.dot = dot_q8_0, .axpy = axpy_q8_0};
static const pyrt_row_ops ops_q4_0 = {.dot = dot_q4_0, .axpy = axpy_q4_0};

const pyrt_row_ops *pyrt_row_ops_scalar(int fmt) {
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
        return pyrt_row_ops_mxfp4_scalar();
    case PYRT_FMT_Q5_0:
    case PYRT_FMT_Q5_1:
        return pyrt_row_ops_q5_scalar(fmt);
    case PYRT_FMT_Q4_K:
    case PYRT_FMT_Q5_K:
    case PYRT_FMT_Q6_K:
        return pyrt_row_ops_kquant_scalar(fmt);
    default:
        return NULL;
    }
}

/* pyrt_dequantize_rows: Q4_K, Q5_K or Q6_K rows -> float32, the values ggml's (and gguf-py's)
 * dequantizers give, bit for bit: x = (d sc_j) q - (dmin m_j) for Q4_K / Q5_K, x = (d sc_i)
 * (q - 32) for Q6_K, each product rounded to float as theirs is. Layouts: formats.h. */
#include "kquant_rows.h"

/* Q4_K / Q5_K: sub-block j's six-bit scale and min from the 12 packed bytes. */
static inline void scale_min(const uint8_t *p, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = p[j] & 63;
        *m = p[j + 4] & 63;
    } else {
        *sc = (p[j + 4] & 0xF) | ((p[j - 4] >> 6) << 4);
        *m = (p[j + 4] >> 4) | ((p[j] >> 6) << 4);
    }
}

/* Q4_K (qh NULL) or Q5_K: element l of sub-block j has its low 4 bits in nibble j % 2 of
 * qs[32 (j / 2) + l], its fifth bit (Q5_K) at bit j of qh[l]. */
static void k_min_block(const uint8_t *b, const uint8_t *qh, const uint8_t *qs, float *y) {
    const float d = pyrt_fp16_to_fp32(pyrt_load_u16(b));
    const float dmin = pyrt_fp16_to_fp32(pyrt_load_u16(b + 2));
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min(b + 4, j, &sc, &m);
        const float d1 = d * sc, m1 = dmin * m;
        const uint8_t *q = qs + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int l = 0; l < 32; l++) {
            int v = (q[l] >> shift) & 0xF;
            if (qh != NULL)
                v |= ((qh[l] >> j) & 1) << 4;
            y[32 * j + l] = d1 * v - m1;
        }
    }
}

static void q4_k_block(const uint8_t *b, float *y) {
    k_min_block(b, NULL, b + 16, y);
}

static void q5_k_block(const uint8_t *b, float *y) {
    k_min_block(b, b + 16, b + 48, y);
}

/* Q6_K: element 128 h + 32 p + l: low 4 bits in nibble p / 2 of ql[64 h + 32 (p % 2) + l], high
 * 2 at bits 2 p of qh[32 h + l]; scale sc[(128 h + 32 p + l) / 16]. */
static void q6_k_block(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = pyrt_fp16_to_fp32(pyrt_load_u16(b + 208));
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 4; p++)
            for (int l = 0; l < 32; l++) {
                const int e = 128 * h + 32 * p + l;
                const int lo = (ql[64 * h + 32 * (p % 2) + l] >> (4 * (p / 2))) & 0xF;
                const int hi = (qh[32 * h + l] >> (2 * p)) & 3;
                y[e] = d * sc[e / 16] * ((lo | (hi << 4)) - 32);
            }
}

typedef void (*block_fn)(const uint8_t *b, float *y);

typedef struct {
    block_fn fn;
    const uint8_t *data;
    size_t block_bytes;
    float *out;
} dequant_ctx;

static void dequantize_one(void *p, int64_t i, int ith) {
    (void)ith;
    const dequant_ctx *c = p;
    c->fn(c->data + (size_t)i * c->block_bytes, c->out + (size_t)i * PYRT_QK_K);
}

enum { DEQUANT_GRAIN = 64 }; /* super-blocks a thread claims at a time */

int pyrt_dequantize_rows(pyrt_pool *pool, int fmt, const void *data, size_t bytes, int64_t n_rows,
                         int64_t n_per_row, float *out) {
    pyrt_clear_error();
    const int st = pyrt_kq_rows_check("pyrt_dequantize_rows", fmt, n_rows, n_per_row, "data",
                                      bytes, data, "data", out, "out");
    if (st != PYRT_OK || n_rows == 0)
        return st;
    block_fn fn = fmt == PYRT_FMT_Q4_K   ? q4_k_block
                  : fmt == PYRT_FMT_Q5_K ? q5_k_block
                                         : q6_k_block;
    dequant_ctx c = {fn, data, pyrt_row_bytes(fmt, PYRT_QK_K), out};
    pyrt_kq_rows_run(pool, n_rows * (n_per_row / PYRT_QK_K), DEQUANT_GRAIN, dequantize_one, &c);
    return PYRT_OK;
}

/* Llama-4's pieces of the decode step and the prefill (llama4.h): per layer either a rope layer
 * (RoPE, then q and k L2-normalized per head; attention within chunks, attn_tile.h) or a NoPE
 * layer (no RoPE, global attention, q times a temperature of its position), and routed experts
 * whose sigmoid routing weight multiplies their input, one top-k slot at a time, as
 * input_weighted_experts (pyruntime/model/llama4.py) runs them through the C expert kernels:
 * the same kernels on the same inputs, so the same bits. */
#include <math.h>
#include <string.h>

#include "formats.h"
#include "llama4.h"
#include "vec.h"

float pyrt_temperature(int length, float scale, int pos) {
    if (length <= 0)
        return 1.0f;
    return log1pf((float)((pos + 1) / length)) * scale + 1.0f;
}

void pyrt_position_heads(float *x, int n_heads, int hd, int rope_dim, const float *cs, int nope,
                         int l2, float eps, float temp) {
    if (nope) {
        if (temp != 1.0f)
            for (int i = 0; i < n_heads * hd; i++)
                x[i] *= temp;
        return;
    }
    pyrt_rope(x, n_heads, hd, rope_dim, cs);
    if (!l2)
        return;
    for (int h = 0; h < n_heads; h++) {
        float *xh = x + (size_t)h * hd;
        double ss = 0.0; /* f64 sum, as pyrt_rms_norm */
        for (int i = 0; i < hd; i++)
            ss += (double)xh[i] * xh[i];
        const float r = 1.0f / sqrtf((float)(ss / hd) + eps);
        for (int i = 0; i < hd; i++)
            xh[i] = xh[i] * r;
    }
}

void pyrt_route_sigmoid(const float *logits, int n_expert, int k, int32_t *ids, float *w,
                        uint8_t *taken) {
    memset(taken, 0, (size_t)n_expert);
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n_expert; e++)
            if (!taken[e] && (best < 0 || logits[e] > logits[best]))
                best = e;
        taken[best] = 1;
        ids[j] = best;
        w[j] = 1.0f / (1.0f + expf(-logits[best]));
    }
}

int pyrt_decode_input_weighted(pyrt_decoder *d, pyrt_pool *pool, const pyrt_experts *experts,
                               pyrt_ffn_io *io) {
    const int n = d->w.n_embd;
    const float one = 1.0f;
    io->n_active = 0;
    for (int j = 0; j < io->k; j++) {
        for (int i = 0; i < n; i++)
            d->xw[i] = d->xn[i] * d->topw[j];
        float *y = j == 0 ? d->y : d->ys; /* y = expert 0's output, + each next one's */
        int64_t active = 0;
        const int rc = pyrt_moe_ffn(pool, experts, d->xw, 1, d->ids + j, &one, 1,
                                    d->w.activation, io->threshold, y, &active);
        if (rc != PYRT_OK)
            return rc;
        io->n_active += active;
        if (j > 0)
            for (int i = 0; i < n; i++)
                d->y[i] = d->y[i] + d->ys[i];
    }
    return PYRT_OK;
}

typedef struct {
    const pyrt_chunk *c;
    int k, slot, blocked;
} slot_ctx;

/* Token t's input for one slot: xw = xn * w[t, slot], its expert id, weight 1. */
static void slot_row(void *p, int64_t t, int ith) {
    (void)ith;
    const slot_ctx *s = p;
    const pyrt_prefill_buf *b = s->c->b;
    const int n = s->c->d->w.n_embd;
    const float wt = b->w[t * s->k + s->slot];
    const float *xn = b->xn + (size_t)t * b->in_stride;
    float *xw = b->xw + (size_t)t * n;
    for (int i = 0; i < n; i++)
        xw[i] = xn[i] * wt;
    b->ids1[t] = b->ids[t * s->k + s->slot];
    b->ones[t] = 1.0f;
    b->xv[t] = s->blocked ? (const void *)(b->xq + (size_t)t * b->q_stride) : (const void *)xw;
}

/* y += yw, token t's row. */
static void add_row(void *p, int64_t t, int ith) {
    (void)ith;
    const slot_ctx *s = p;
    const pyrt_prefill_buf *b = s->c->b;
    const int n = s->c->d->w.n_embd;
    float *y = b->y + (size_t)t * n;
    const float *yw = b->yw + (size_t)t * n;
    for (int i = 0; i < n; i++)
        y[i] = y[i] + yw[i];
}

int pyrt_prefill_input_weighted(const pyrt_chunk *c, const pyrt_experts *experts, int k,
                                float threshold, int64_t *n_active, int64_t *n_pairs) {
    pyrt_prefill_buf *b = c->b;
    const int n_embd = c->d->w.n_embd;
    slot_ctx s = {.c = c, .k = k, .blocked = pyrt_fmt_is_blocked(experts->fmt)};
    for (s.slot = 0; s.slot < k; s.slot++) {
        pyrt_pool_for(c->pool, c->n, 4, slot_row, &s);
        if (s.blocked)
            pyrt_prefill_quantize(c, pyrt_fmt_xq(experts->fmt), b->xw, (size_t)n_embd, n_embd);
        int64_t active = 0, pairs = 0;
        const int rc = pyrt_moe_batch(c->pool, &b->moe, experts, c->n, b->xv, b->ids1, b->ones,
                                      1, c->d->w.activation, threshold,
                                      s.slot == 0 ? b->y : b->yw, &active, &pairs);
        if (rc != PYRT_OK)
            return rc;
        *n_active += active;
        *n_pairs += pairs;
        if (s.slot > 0)
            pyrt_pool_for(c->pool, c->n, 4, add_row, &s);
    }
    return PYRT_OK;
}

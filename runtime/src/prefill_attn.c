/* The attention half of a block for a chunk of tokens (the prefill), with the math of a step's
 * (attention.c), op for op, per token:
 *
 *   q, k, v = xn Wq^T + bq, ... (clamped) ; q/k norm ; RoPE at the token's position ;
 *   k, v -> cache[pos] ; a = softmax(q k^T * scale) v over positions 0..pos (the last `window`
 *   of them on a sliding-window layer; with sinks, exp(sink[h]) joins the softmax's
 *   denominator) ; y = a Wo^T + bo
 *
 * The matrix products take every token of the chunk at once (each weight row read once per
 * chunk, in tiles); the attention is one pool task over (head, token) pairs, each query against
 * the cached positions up to its own with a step's row kernels in a step's order (so a query's
 * output is the bits a step would give for it). The chunk's keys and values are in the cache
 * before any query reads them. Also the chunk's shared pieces: norm, quantize, matrix product. */
#include <math.h>
#include <string.h>

#include "error.h"
#include "prefill.h"
#include "vec.h"

/* ---- shared pieces --------------------------------------------------------------------------- */

typedef struct {
    const pyrt_chunk *c;
    const float *src, *norm;
    size_t src_stride;
    int n_in, quantize;
} rows_ctx;

static void norm_row(void *p, int64_t t, int ith) {
    (void)ith;
    const rows_ctx *r = p;
    const pyrt_decoder *d = r->c->d;
    const pyrt_prefill_buf *b = r->c->b;
    float *xn = b->xn + (size_t)t * b->in_stride;
    pyrt_rms_norm(r->src + (size_t)t * d->w.n_embd, r->norm, d->w.rms_eps, d->w.n_embd, xn);
    if (r->quantize)
        pyrt_quantize_x_q8(xn, b->xq + (size_t)t * b->q_stride, d->w.n_embd);
}

void pyrt_prefill_norm(const pyrt_chunk *c, const float *src, const float *norm, int quantize) {
    rows_ctx r = {.c = c, .src = src, .norm = norm, .quantize = quantize};
    pyrt_pool_for(c->pool, c->n, 4, norm_row, &r);
}

static void quantize_row(void *p, int64_t t, int ith) {
    (void)ith;
    const rows_ctx *r = p;
    const pyrt_prefill_buf *b = r->c->b;
    pyrt_xq8 *out = b->xq + (size_t)t * b->q_stride;
    pyrt_quantize_x_q8(r->src + (size_t)t * r->src_stride, out, r->n_in);
}

void pyrt_prefill_quantize(const pyrt_chunk *c, const float *src, size_t stride, int n_in) {
    rows_ctx r = {.c = c, .src = src, .src_stride = stride, .n_in = n_in};
    pyrt_pool_for(c->pool, c->n, 8, quantize_row, &r);
}

void pyrt_prefill_matmul(const pyrt_chunk *c, pyrt_mv_job *job, const float *x, size_t x_stride) {
    job->x = x;
    job->x_stride = x_stride;
    job->xq = c->b->xq;
    job->xq_stride = c->b->q_stride;
    job->n_tokens = c->n;
    if (job->div == 0.0f)
        job->div = 1.0f;
    pyrt_mv_job_prepare(job, c->pool);
    pyrt_pool_plan_prefetch(c->pool, NULL);
    pyrt_pool_run(c->pool, pyrt_mv_task, job);
}

/* ---- q/k norms, RoPE, the cache -------------------------------------------------------------- */

typedef struct {
    const pyrt_chunk *c;
    const pyrt_block_weights *blk;
    float *kc, *vc; /* the layer's cache */
    const pyrt_row_ops *f32;
} attn_ctx;

static void qk_token(void *p, int64_t t, int ith) {
    (void)ith;
    const attn_ctx *a = p;
    const pyrt_decoder *d = a->c->d;
    const pyrt_model_weights *w = &d->w;
    const pyrt_prefill_buf *b = a->c->b;
    const pyrt_block_weights *blk = a->blk;
    const int hd = w->head_dim, nq = w->n_head * hd, nkv = w->n_head_kv * hd;
    float *q = b->q + (size_t)t * nq, *k = b->k + (size_t)t * nkv;
    const float *v = b->v + (size_t)t * nkv;
    if (blk->q_norm.data != NULL && blk->q_norm.n == nq) { /* olmoe: over all heads */
        pyrt_rms_norm(q, blk->q_norm.data, w->rms_eps, nq, q);
        pyrt_rms_norm(k, blk->k_norm.data, w->rms_eps, nkv, k);
    } else if (blk->q_norm.data != NULL) { /* qwen3moe: per head */
        for (int h = 0; h < w->n_head; h++)
            pyrt_rms_norm(q + (size_t)h * hd, blk->q_norm.data, w->rms_eps, hd, q + (size_t)h * hd);
        for (int h = 0; h < w->n_head_kv; h++)
            pyrt_rms_norm(k + (size_t)h * hd, blk->k_norm.data, w->rms_eps, hd, k + (size_t)h * hd);
    }
    const float *cs = b->rope_cs + (size_t)t * (w->rope_dim > 0 ? w->rope_dim : 1);
    pyrt_rope(q, w->n_head, hd, w->rope_dim, cs);
    pyrt_rope(k, w->n_head_kv, hd, w->rope_dim, cs);
    const size_t cap = (size_t)a->c->cache->cap, pos = (size_t)a->c->pos + (size_t)t;
    for (int h = 0; h < w->n_head_kv; h++) {
        const size_t at = ((size_t)h * cap + pos) * hd, bytes = (size_t)hd * sizeof(float);
        memcpy(a->kc + at, k + (size_t)h * hd, bytes);
        memcpy(a->vc + at, v + (size_t)h * hd, bytes);
    }
}

/* ---- the heads ------------------------------------------------------------------------------- */

/* Query head h of token t over the cached positions 0..pos+t, the window's last on a
 * sliding-window layer (attention.c's attend_head). */
static void attend(void *p, int64_t item, int ith) {
    const attn_ctx *a = p;
    const pyrt_decoder *d = a->c->d;
    const pyrt_model_weights *w = &d->w;
    const pyrt_prefill_buf *b = a->c->b;
    const int h = (int)(item % w->n_head), t = (int)(item / w->n_head);
    const int hd = w->head_dim, kvh = h / (w->n_head / w->n_head_kv);
    const int last = a->c->pos + t, window = a->blk->window;
    const int first = window > 0 && last + 1 > window ? last + 1 - window : 0;
    const int n_pos = last + 1 - first;
    const size_t cap = (size_t)a->c->cache->cap;
    const float *q = b->q + ((size_t)t * w->n_head + h) * hd;
    const float *keys = a->kc + ((size_t)kvh * cap + first) * hd;
    const float *vals = a->vc + ((size_t)kvh * cap + first) * hd;
    float *s = b->scores + (size_t)ith * b->pos_cap;
    float *out = b->xn + (size_t)t * b->in_stride + (size_t)h * hd;
    for (int pos = 0; pos < n_pos; pos++)
        s[pos] = a->f32->dot(keys + (size_t)pos * hd, q, hd) * w->attention_scale;
    if (a->blk->sinks.data != NULL)
        pyrt_softmax_sink(s, n_pos, a->blk->sinks.data[h]);
    else
        pyrt_softmax(s, n_pos);
    memset(out, 0, (size_t)hd * sizeof *out);
    for (int pos = 0; pos < n_pos; pos++)
        a->f32->axpy(s[pos], vals + (size_t)pos * hd, out, hd);
}

/* ---- the half -------------------------------------------------------------------------------- */

typedef struct {
    const pyrt_chunk *c;
    float scale;
} residual_ctx;

static void add_y(void *p, int64_t t, int ith) {
    (void)ith;
    const residual_ctx *r = p;
    const pyrt_prefill_buf *b = r->c->b;
    const int n = r->c->d->w.n_embd;
    float *x = b->x + (size_t)t * n;
    const float *y = b->y + (size_t)t * n;
    for (int i = 0; i < n; i++)
        x[i] = x[i] + y[i] * r->scale;
}

void pyrt_prefill_attention(const pyrt_chunk *c, int layer) {
    pyrt_decoder *d = c->d;
    const pyrt_model_weights *w = &d->w;
    const pyrt_prefill_buf *b = c->b;
    const pyrt_block_weights *blk = &d->blocks[layer];
    const int nq = w->n_head * w->head_dim, nkv = w->n_head_kv * w->head_dim;
    pyrt_mv_job qkv = {.out = {{&blk->wq, blk->bq.data, b->q, (size_t)nq},
                               {&blk->wk, blk->bk.data, b->k, (size_t)nkv},
                               {&blk->wv, blk->bv.data, b->v, (size_t)nkv}},
                       .n_mats = 3,
                       .clamp = w->clamp_kqv};
    pyrt_prefill_norm(c, b->x, blk->attn_norm.data, pyrt_mv_job_blocked(&qkv));
    pyrt_prefill_matmul(c, &qkv, b->xn, b->in_stride);
    attn_ctx a = {.c = c, .blk = blk, .kc = c->cache->k[layer], .vc = c->cache->v[layer],
                  .f32 = pyrt_pool_row_ops(c->pool, PYRT_FMT_F32)};
    pyrt_pool_for(c->pool, c->n, 2, qk_token, &a);
    /* every query of the chunk against the cache, its output into xn's rows (xn is free now) */
    pyrt_pool_for(c->pool, (int64_t)c->n * w->n_head, 1, attend, &a);
    pyrt_mv_job o = {.out = {{&blk->wo, blk->bo.data, b->y, (size_t)w->n_embd}},
                     .n_mats = 1};
    if (pyrt_mv_job_blocked(&o))
        pyrt_prefill_quantize(c, b->xn, b->in_stride, nq);
    pyrt_prefill_matmul(c, &o, b->xn, b->in_stride);
    residual_ctx r = {.c = c, .scale = w->residual_scale};
    pyrt_pool_for(c->pool, c->n, 4, add_y, &r);
}

/* The attention half of a block for a chunk of tokens (the prefill), with the math of a step's
 * (attention.c), op for op, per token:
 *
 *   q, k, v = xn Wq^T + bq, ... (clamped) ; q/k norm ; RoPE at the token's position ;
 *   k, v -> cache[pos] ; a = softmax(q k^T * scale) v over positions 0..pos (the last `window`
 *   of them on a sliding-window layer; with sinks, exp(sink[h]) joins the softmax's
 *   denominator) ; y = a Wo^T + bo
 *
 * The matrix products take every token of the chunk at once (each weight row read once per
 * chunk, in tiles); the attention is one pool task over tiles of (query heads of one kv head) x
 * (consecutive tokens), each tile against its cached positions flash-style (attn_tile.h: every
 * key block read once per tile, an online softmax, scratch of fixed size), so its cost is the
 * arithmetic, not a re-read of the cache per query. The chunk's keys and values are in the cache
 * before any query reads them. Also the chunk's shared pieces: norm, quantize, matrix product. */
#include <math.h>
#include <string.h>

#include "attn_tile.h"
#include "error.h"
#include "llama4_qk.h"
#include "prefill.h"
#include "vec.h"

/* ---- shared pieces --------------------------------------------------------------------------- */

typedef struct {
    const pyrt_chunk *c;
    const float *src, *norm;
    size_t src_stride;
    int n_in, quantize; /* PYRT_XQ_* */
} rows_ctx;

static void norm_row(void *p, int64_t t, int ith) {
    (void)ith;
    const rows_ctx *r = p;
    const pyrt_decoder *d = r->c->d;
    const pyrt_prefill_buf *b = r->c->b;
    float *xn = b->xn + (size_t)t * b->in_stride;
    pyrt_rms_norm(r->src + (size_t)t * d->w.n_embd, r->norm, d->w.rms_eps, d->w.n_embd, xn);
    pyrt_quantize_x_for(r->quantize, xn, b->xq + (size_t)t * b->q_stride, d->w.n_embd);
}

void pyrt_prefill_norm(const pyrt_chunk *c, const float *src, const float *norm, int xq_kind) {
    rows_ctx r = {.c = c, .src = src, .norm = norm, .quantize = xq_kind};
    pyrt_pool_for(c->pool, c->n, 4, norm_row, &r);
}

static void quantize_row(void *p, int64_t t, int ith) {
    (void)ith;
    const rows_ctx *r = p;
    const pyrt_prefill_buf *b = r->c->b;
    pyrt_xq8 *out = b->xq + (size_t)t * b->q_stride;
    pyrt_quantize_x_for(r->quantize, r->src + (size_t)t * r->src_stride, out, r->n_in);
}

void pyrt_prefill_quantize(const pyrt_chunk *c, int xq_kind, const float *src, size_t stride,
                           int n_in) {
    rows_ctx r = {.c = c, .src = src, .src_stride = stride, .n_in = n_in, .quantize = xq_kind};
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
    const size_t cap = (size_t)a->c->cache->cap, pos = (size_t)a->c->pos + (size_t)t;
    const float temp = pyrt_temperature(w->temperature_length, w->temperature_scale, (int)pos);
    pyrt_position_heads(q, w->n_head, hd, w->rope_dim, cs, blk->nope, w->qk_l2_norm, w->rms_eps,
                        temp);
    pyrt_position_heads(k, w->n_head_kv, hd, w->rope_dim, cs, blk->nope, w->qk_l2_norm,
                        w->rms_eps, 1.0f);
    for (int h = 0; h < w->n_head_kv; h++) {
        const size_t at = ((size_t)h * cap + pos) * hd, bytes = (size_t)hd * sizeof(float);
        memcpy(a->kc + at, k + (size_t)h * hd, bytes);
        memcpy(a->vc + at, v + (size_t)h * hd, bytes);
    }
}

/* ---- the heads ------------------------------------------------------------------------------- */

/* Tiles of the chunk's queries: the query heads of one kv head (GQA: heads h with h / group =
 * kvh), up to PYRT_ATTN_ROWS of them, times as many consecutive tokens as fill the rest of the
 * rows; each tile reads its kv head's cached keys and values once per key block (attn_tile.h). */
typedef struct {
    const attn_ctx *a;
    int group, heads, tokens; /* heads per kv head; per tile: heads, tokens */
    int head_tiles, token_tiles;
} tiles_ctx;

static void attend_tile(void *p, int64_t item, int ith) {
    const tiles_ctx *tc = p;
    const attn_ctx *a = tc->a;
    const pyrt_model_weights *w = &a->c->d->w;
    const pyrt_prefill_buf *b = a->c->b;
    /* the longest tiles (last tokens) first: the pool's threads then end together */
    const int tt = tc->token_tiles - 1 - (int)(item / ((int64_t)w->n_head_kv * tc->head_tiles));
    const int rest = (int)(item % ((int64_t)w->n_head_kv * tc->head_tiles));
    const int kvh = rest / tc->head_tiles, h0 = kvh * tc->group + (rest % tc->head_tiles) * tc->heads;
    const int h1 = h0 + tc->heads < (kvh + 1) * tc->group ? h0 + tc->heads : (kvh + 1) * tc->group;
    const int t0 = tt * tc->tokens, t1 = t0 + tc->tokens < a->c->n ? t0 + tc->tokens : a->c->n;
    const int hd = w->head_dim;
    const size_t cap = (size_t)a->c->cache->cap;
    pyrt_attn_tile tile = {.k = a->kc + (size_t)kvh * cap * hd, .v = a->vc + (size_t)kvh * cap * hd,
                           .hd = hd, .window = a->blk->window, .chunk = a->blk->chunk,
                           .scale = w->attention_scale,
                           .has_sink = a->blk->sinks.data != NULL,
                           .scratch = b->scores + (size_t)ith * b->scratch_floats};
    for (int t = t0; t < t1; t++)
        for (int h = h0; h < h1; h++) {
            const int r = tile.n_rows++;
            tile.q[r] = b->q + ((size_t)t * w->n_head + h) * hd;
            tile.out[r] = b->xn + (size_t)t * b->in_stride + (size_t)h * hd;
            tile.pos[r] = a->c->pos + t;
            tile.sink[r] = tile.has_sink ? a->blk->sinks.data[h] : 0.0f;
        }
    pyrt_attn_tile_run(&tile);
}

static void attend(const attn_ctx *a) {
    const pyrt_model_weights *w = &a->c->d->w;
    tiles_ctx tc = {.a = a, .group = w->n_head / w->n_head_kv};
    tc.heads = tc.group < PYRT_ATTN_ROWS ? tc.group : PYRT_ATTN_ROWS;
    tc.tokens = PYRT_ATTN_ROWS / tc.heads;
    tc.head_tiles = (tc.group + tc.heads - 1) / tc.heads;
    tc.token_tiles = (a->c->n + tc.tokens - 1) / tc.tokens;
    const int64_t n = (int64_t)tc.token_tiles * w->n_head_kv * tc.head_tiles;
    pyrt_pool_for(a->c->pool, n, 1, attend_tile, &tc);
}

/* ---- the half -------------------------------------------------------------------------------- */

/* x += y * residual_scale for one token t of the chunk (a pool task's item). */
static void add_y(void *p, int64_t t, int ith) {
    (void)ith;
    const pyrt_chunk *c = p;
    const pyrt_prefill_buf *b = c->b;
    const int n = c->d->w.n_embd;
    const float scale = c->d->w.residual_scale;
    float *x = b->x + (size_t)t * n;
    const float *y = b->y + (size_t)t * n;
    for (int i = 0; i < n; i++)
        x[i] = x[i] + y[i] * scale;
}

void pyrt_prefill_add_residual(const pyrt_chunk *c) {
    pyrt_pool_for(c->pool, c->n, 4, add_y, (void *)c);
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
    pyrt_prefill_norm(c, b->x, blk->attn_norm.data, pyrt_mv_job_xq(&qkv));
    pyrt_prefill_matmul(c, &qkv, b->xn, b->in_stride);
    attn_ctx a = {.c = c, .blk = blk, .kc = c->cache->k[layer], .vc = c->cache->v[layer]};
    pyrt_pool_for(c->pool, c->n, 2, qk_token, &a);
    /* every query of the chunk against the cache, its output into xn's rows (xn is free now) */
    attend(&a);
    pyrt_mv_job o = {.out = {{&blk->wo, blk->bo.data, b->y, (size_t)w->n_embd}},
                     .n_mats = 1};
    if (pyrt_mv_job_xq(&o) != PYRT_XQ_NONE)
        pyrt_prefill_quantize(c, pyrt_mv_job_xq(&o), b->xn, b->in_stride, nq);
    pyrt_prefill_matmul(c, &o, b->xn, b->in_stride);
    pyrt_prefill_add_residual(c);
}

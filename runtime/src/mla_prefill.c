/* Multi-head latent attention's half of a block for a chunk of tokens (the prefill), with the
 * step's math (mla_step.c), op for op, per token: the absorbed form over the latent cache. The
 * matrix products take every token of the chunk at once (each weight row read once per chunk);
 * the chunk's latents and rope keys are in the cache before any query reads them; then one pool
 * task over (head, tile of up to PYRT_ATTN_ROWS consecutive tokens) items, each folding its
 * tokens' q_nope through the head's k_b, running them as one attention tile over the cache
 * (attn_tile.h: each key block read once per tile) and taking the outputs through the head's v_b
 * (the head's k_b and v_b stay in the thread's L2 across its tile's tokens). Against
 * decompressing the cache's keys and values per head (positions x H x (D + v) x R per chunk),
 * the absorbed tiles fold only the chunk's T queries (T x H x (D + v) x R) but score and sum
 * over R + r dims per position instead of D + r and v: the cheaper form while the positions
 * are few against the chunk (not measured beyond pp64: the decompressed form is a follow-up
 * for long prompts). */
#include <stdlib.h>
#include <string.h>

#include "attn_tile.h"
#include "error.h"
#include "prefill.h"
#include "vec.h"

/* ---- buffers --------------------------------------------------------------------------------- */

void pyrt_mla_prefill_free(pyrt_mla *m) {
    free(m->c_q);
    free(m->c_qa);
    free(m->c_kv);
    free(m->c_o);
    free(m->c_xq);
    free(m->c_rows);
    free(m->c_xqh);
    m->c_q = m->c_qa = m->c_kv = m->c_o = m->c_rows = NULL;
    m->c_xq = m->c_xqh = NULL;
    m->tokens_cap = m->threads_cap = 0;
}

int pyrt_mla_prefill_ensure(pyrt_mla *m, int T, int threads, const char *fn) {
    if (T <= m->tokens_cap && threads <= m->threads_cap)
        return PYRT_OK;
    T = T > m->tokens_cap ? T : m->tokens_cap;
    threads = threads > m->threads_cap ? threads : m->threads_cap;
    const size_t f = sizeof(float), H = (size_t)m->n_head, hd = (size_t)(m->rank + m->rope);
    const size_t ov = H * (size_t)m->v_dim;
    const size_t in_max = (size_t)m->q_rank > ov ? (size_t)m->q_rank : ov;
    pyrt_mla_prefill_free(m);
    m->c_q = malloc((size_t)T * H * ((size_t)m->nope + (size_t)m->rope) * f);
    m->c_qa = malloc((size_t)T * ((size_t)m->q_rank + 1) * f);
    m->c_kv = malloc((size_t)T * hd * f);
    m->c_o = malloc((size_t)T * ov * f);
    m->c_xq_stride = pyrt_xq_units(in_max);
    m->c_xq = malloc((size_t)T * m->c_xq_stride * sizeof(pyrt_xq8));
    m->c_rows = malloc((size_t)threads * 2 * PYRT_ATTN_ROWS * hd * f);
    m->c_xqh = malloc((size_t)threads * PYRT_ATTN_ROWS * (size_t)m->xqh_stride * sizeof(pyrt_xq8));
    m->tokens_cap = T;
    m->threads_cap = threads;
    if (!m->c_q || !m->c_qa || !m->c_kv || !m->c_o || !m->c_xq || !m->c_rows || !m->c_xqh) {
        m->tokens_cap = m->threads_cap = 0;
        return pyrt_fail(PYRT_E_NOMEM, "%s: cannot allocate the latent attention's chunk buffers",
                         fn);
    }
    return PYRT_OK;
}

/* ---- the pieces ------------------------------------------------------------------------------ */

typedef struct {
    const pyrt_chunk *c;
    pyrt_mla *m;
    const pyrt_block_weights *blk;
    float *cache; /* the layer's [cap, R + r] */
    const float *x;
    size_t x_stride;
    int n_in;
    int xq_kind; /* PYRT_XQ_* of the matrix product being set up */
    int token_tiles;
} mla_ctx;

static void quantize_row(void *p, int64_t t, int ith) {
    (void)ith;
    const mla_ctx *a = p;
    pyrt_quantize_x_for(a->xq_kind, a->x + (size_t)t * a->x_stride,
                        a->m->c_xq + (size_t)t * a->m->c_xq_stride, a->n_in);
}

/* job over the chunk's rows of x [n, x_stride] (n_in read), through m's own Q8 blocks (of the
 * kind its matrices read). */
static void matmul(mla_ctx *a, pyrt_mv_job *job, const float *x, size_t x_stride, int n_in) {
    const pyrt_chunk *c = a->c;
    a->xq_kind = pyrt_mv_job_xq(job);
    if (a->xq_kind != PYRT_XQ_NONE) {
        a->x = x;
        a->x_stride = x_stride;
        a->n_in = n_in;
        pyrt_pool_for(c->pool, c->n, 8, quantize_row, a);
    }
    job->x = x;
    job->x_stride = x_stride;
    job->xq = a->m->c_xq;
    job->xq_stride = a->m->c_xq_stride;
    job->n_tokens = c->n;
    job->div = 1.0f;
    pyrt_mv_job_prepare(job, c->pool);
    pyrt_pool_plan_prefetch(c->pool, NULL);
    pyrt_pool_run(c->pool, pyrt_mv_task, job);
}

/* Token t's latent and rope key into the cache row of its position; its query LoRA normed. */
static void latent_token(void *p, int64_t t, int ith) {
    (void)ith;
    const mla_ctx *a = p;
    const pyrt_mla *m = a->m;
    const int hd = m->rank + m->rope;
    const float *kv = m->c_kv + (size_t)t * hd;
    const float *cs = a->c->b->rope_cs + (size_t)t * m->rope;
    float *row = a->cache + ((size_t)a->c->pos + (size_t)t) * hd;
    pyrt_rms_norm(kv, a->blk->kv_a_norm.data, m->rms_eps, m->rank, row);
    memcpy(row + m->rank, kv + m->rank, (size_t)m->rope * sizeof(float));
    pyrt_rope(row + m->rank, 1, m->rope, m->rope, cs);
    if (a->blk->wq_a.data != NULL) {
        float *qa = m->c_qa + (size_t)t * m->q_rank;
        pyrt_rms_norm(qa, a->blk->q_a_norm.data, m->rms_eps, m->q_rank, qa);
    }
}

/* Item: head h x token tile; the last tokens' tiles (the longest) first. */
static void head_tile(void *p, int64_t item, int ith) {
    const mla_ctx *a = p;
    const pyrt_chunk *c = a->c;
    const pyrt_mla *m = a->m;
    const pyrt_block_weights *blk = a->blk;
    const int H = m->n_head, hd = m->rank + m->rope, nqh = m->nope + m->rope;
    const int tt = a->token_tiles - 1 - (int)(item / H), h = (int)(item % H);
    const int t0 = tt * PYRT_ATTN_ROWS;
    const int t1 = t0 + PYRT_ATTN_ROWS < c->n ? t0 + PYRT_ATTN_ROWS : c->n;
    float *qt = m->c_rows + (size_t)ith * 2 * PYRT_ATTN_ROWS * hd;
    float *ot = qt + (size_t)PYRT_ATTN_ROWS * hd;
    pyrt_xq8 *xq = m->c_xqh + (size_t)ith * PYRT_ATTN_ROWS * m->xqh_stride;
    pyrt_attn_tile tile = {.k = a->cache, .v = a->cache, .hd = hd,
                           .scale = c->d->w.attention_scale,
                           .scratch = c->b->scores + (size_t)ith * c->b->scratch_floats};
    const float *qn[PYRT_ATTN_ROWS];
    for (int t = t0; t < t1; t++) {
        const int r = tile.n_rows++;
        qn[r] = m->c_q + ((size_t)t * H + h) * nqh;
        tile.q[r] = qt + (size_t)r * hd;
        tile.out[r] = ot + (size_t)r * hd;
        tile.pos[r] = c->pos + t;
    }
    /* q_lat of the tile's tokens (the head's k_b rows against all of them), then q_pe roped */
    pyrt_mla_head_rows(c->pool, &blk->wk_b, h, m->rank, tile.n_rows, qn, xq,
                       (size_t)m->xqh_stride, qt, (size_t)hd);
    for (int r = 0; r < tile.n_rows; r++) {
        float *pe = qt + (size_t)r * hd + m->rank;
        memcpy(pe, qn[r] + m->nope, (size_t)m->rope * sizeof(float));
        pyrt_rope(pe, 1, m->rope, m->rope, c->b->rope_cs + (size_t)(t0 + r) * m->rope);
    }
    pyrt_attn_tile_run(&tile);
    /* o_lat (the first R of each output) through the head's v_b */
    pyrt_mla_head_rows(c->pool, &blk->wv_b, h, m->v_dim, tile.n_rows,
                       (const float *const *)tile.out, xq, (size_t)m->xqh_stride,
                       m->c_o + ((size_t)t0 * H + h) * m->v_dim, (size_t)H * m->v_dim);
}

void pyrt_prefill_mla(const pyrt_chunk *c, int layer) {
    pyrt_decoder *d = c->d;
    const pyrt_model_weights *w = &d->w;
    const pyrt_prefill_buf *b = c->b;
    pyrt_mla *m = &d->mla;
    const pyrt_block_weights *blk = &d->blocks[layer];
    const int lora = blk->wq_a.data != NULL, H = m->n_head, hd = m->rank + m->rope;
    const size_t nq = (size_t)H * (m->nope + m->rope);
    mla_ctx a = {.c = c, .m = m, .blk = blk, .cache = c->cache->k[layer],
                 .token_tiles = (c->n + PYRT_ATTN_ROWS - 1) / PYRT_ATTN_ROWS};
    pyrt_mv_job in = {.out = {{lora ? &blk->wq_a : &blk->wq_b, NULL, lora ? m->c_qa : m->c_q,
                               lora ? (size_t)m->q_rank : nq},
                              {&blk->wkv_a, NULL, m->c_kv, (size_t)hd}},
                      .n_mats = 2};
    pyrt_prefill_norm(c, b->x, blk->attn_norm.data, PYRT_XQ_NONE); /* matmul quantizes */
    matmul(&a, &in, b->xn, b->in_stride, w->n_embd);
    pyrt_pool_for(c->pool, c->n, 2, latent_token, &a);
    if (lora) {
        pyrt_mv_job q_b = {.out = {{&blk->wq_b, NULL, m->c_q, nq}}, .n_mats = 1};
        matmul(&a, &q_b, m->c_qa, (size_t)m->q_rank, m->q_rank);
    }
    pyrt_pool_for(c->pool, (int64_t)a.token_tiles * H, 1, head_tile, &a);
    pyrt_mv_job o = {.out = {{&blk->wo, NULL, b->y, (size_t)w->n_embd}}, .n_mats = 1};
    matmul(&a, &o, m->c_o, (size_t)H * m->v_dim, H * m->v_dim);
    pyrt_prefill_add_residual(c);
}

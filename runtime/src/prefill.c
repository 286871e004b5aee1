/* pyrt_decoder_prefill: many tokens through the model in one call, chunk by chunk (args->ubatch
 * tokens each): per chunk the embedding, every block's attention half (prefill_attn.c) and FFN
 * half (prefill_ffn.c) for all the chunk's tokens at once, and the logits asked for (every
 * token's, or the prompt's last one's). A chunk's buffers (pyrt_prefill_buf) are sized by the
 * chunk, not the prompt, and kept in the decoder between calls. The math is a step's, token by
 * token (decode.c); what differs is the order of some sums (the routed experts', the tiles'), so
 * the logits agree with that many steps to f32 rounding. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn_tile.h"
#include "error.h"
#include "prefill.h"
#include "vec.h"

static void buf_free(pyrt_prefill_buf *b) {
    free(b->x);
    free(b->xn);
    free(b->xq);
    free(b->xv);
    free(b->q);
    free(b->k);
    free(b->v);
    free(b->y);
    free(b->ys);
    free(b->gate);
    free(b->up);
    free(b->gs);
    free(b->router);
    free(b->ids);
    free(b->w);
    free(b->rope_cs);
    free(b->scores);
    free(b->taken);
    free(b->xw);
    free(b->yw);
    free(b->ids1);
    free(b->ones);
    pyrt_moe_batch_free(&b->moe);
    memset(b, 0, sizeof *b);
}

void pyrt_prefill_free(pyrt_decoder *d) {
    if (d->prefill != NULL)
        buf_free(d->prefill);
    free(d->prefill);
    d->prefill = NULL;
}

/* Room for T tokens and `threads` threads. */
static int ensure(pyrt_decoder *d, int T, int threads) {
    pyrt_prefill_buf *b = d->prefill;
    if (b == NULL) {
        b = d->prefill = calloc(1, sizeof *b);
        if (b == NULL)
            return pyrt_fail(PYRT_E_NOMEM, "pyrt_decoder_prefill: out of memory");
    }
    if (T <= b->tokens_cap && threads <= b->threads_cap)
        return PYRT_OK;
    pyrt_moe_batch_buf moe = b->moe; /* kept: it grows on its own */
    b->moe = (pyrt_moe_batch_buf){0};
    buf_free(b);
    b->moe = moe;
    const pyrt_model_weights *w = &d->w;
    const size_t n = (size_t)T, f = sizeof(float);
    const size_t nq = (size_t)w->n_head * w->head_dim, nkv = (size_t)w->n_head_kv * w->head_dim;
    b->in_stride = (size_t)d->max_in;
    b->q_stride = pyrt_xq_units(b->in_stride);
    b->x = malloc(n * w->n_embd * f);
    b->xn = malloc(n * b->in_stride * f);
    b->xq = malloc(n * b->q_stride * sizeof(pyrt_xq8));
    b->xv = malloc(n * sizeof *b->xv);
    b->q = malloc(n * nq * f);
    b->k = malloc(n * nkv * f);
    b->v = malloc(n * nkv * f);
    b->y = malloc(n * w->n_embd * f);
    b->ys = malloc(n * w->n_embd * f);
    b->gate = malloc(n * b->in_stride * f);
    b->up = malloc(n * b->in_stride * f);
    b->gs = malloc(n * f);
    b->router = malloc(n * w->n_expert * f);
    b->ids = malloc(n * w->n_expert * sizeof(int32_t));
    b->w = malloc(n * w->n_expert * f);
    b->rope_cs = malloc(n * ((size_t)w->rope_dim + 1) * f);
    b->scratch_floats = pyrt_attn_scratch_floats(w->head_dim);
    b->scores = malloc((size_t)threads * b->scratch_floats * f);
    b->taken = malloc((size_t)threads * w->n_expert);
    if (!b->x || !b->xn || !b->xq || !b->xv || !b->q || !b->k || !b->v || !b->y || !b->ys ||
        !b->gate || !b->up || !b->gs || !b->router || !b->ids || !b->w || !b->rope_cs ||
        !b->scores || !b->taken) {
        buf_free(b);
        return pyrt_fail(PYRT_E_NOMEM, "pyrt_decoder_prefill: cannot allocate the buffers of a "
                         "chunk of %d tokens", T);
    }
    if (w->expert_input_weight) {
        b->xw = malloc(n * w->n_embd * f);
        b->yw = malloc(n * w->n_embd * f);
        b->ids1 = malloc(n * sizeof(int32_t));
        b->ones = malloc(n * f);
    }
    if (w->expert_input_weight && (!b->xw || !b->yw || !b->ids1 || !b->ones)) {
        buf_free(b);
        return pyrt_fail(PYRT_E_NOMEM, "pyrt_decoder_prefill: cannot allocate the buffers of a "
                         "chunk of %d tokens", T);
    }
    b->tokens_cap = T;
    b->threads_cap = threads;
    return PYRT_OK;
}

/* ---- checks ---------------------------------------------------------------------------------- */

static int check(const pyrt_decoder *d, const pyrt_pool *pool, const pyrt_prefill_args *a) {
    const char *fn = "pyrt_decoder_prefill";
    int rc = pyrt_decoder_check_call(d, pool, a, fn);
    if (rc != PYRT_OK)
        return rc;
    if (a->tokens == NULL || a->n_tokens < 1)
        return pyrt_fail(PYRT_E_INVALID, "%s: %s", fn,
                         a->tokens == NULL ? "tokens is NULL" : "n_tokens must be >= 1");
    if (a->ubatch < 0 || (a->all_logits != 0 && a->all_logits != 1))
        return pyrt_fail(PYRT_E_INVALID, "%s: ubatch=%d must be >= 0 and all_logits=%d 0 or 1",
                         fn, a->ubatch, a->all_logits);
    for (int i = 0; i < a->n_tokens; i++)
        if ((rc = pyrt_decoder_check_token(d, a->tokens[i], fn)) != PYRT_OK)
            return rc;
    if ((rc = pyrt_decoder_check_experts(d, &a->experts, fn)) != PYRT_OK ||
        (rc = pyrt_decoder_check_cache(d, &a->cache, fn)) != PYRT_OK)
        return rc;
    for (int i = 0; i < d->w.n_layer; i++)
        if ((rc = pyrt_decoder_check_attention(&a->cache, i, a->pos, a->n_tokens, fn)) !=
                PYRT_OK ||
            (rc = pyrt_decoder_check_ffn(d, &a->experts, i, fn)) != PYRT_OK)
            return rc;
    const pyrt_outputs o = {
        .logits = a->logits, .logits_len = a->logits_len,
        .logits_need = (a->all_logits ? (int64_t)a->n_tokens : 1) * d->w.n_vocab,
        .route_ids = a->route_ids, .route_ids_len = a->route_ids_len,
        .route_logits = a->route_logits, .route_logits_len = a->route_logits_len};
    return pyrt_decoder_check_outputs(d, &a->experts, &o, fn);
}

/* ---- a chunk --------------------------------------------------------------------------------- */

typedef struct {
    const pyrt_chunk *c;
    const int32_t *tokens;
} embed_ctx;

/* x[t] = token_embd[token] * embedding_scale (as a step's embed), and the RoPE table of its
 * position, cos and sin times rope_scale (as pyrt_attention_prepare makes it). */
static void embed_row(void *p, int64_t t, int ith) {
    (void)ith;
    const embed_ctx *e = p;
    const pyrt_decoder *d = e->c->d;
    const pyrt_model_weights *w = &d->w;
    const pyrt_matrix *emb = &w->token_embd;
    float *x = e->c->b->x + (size_t)t * w->n_embd;
    memset(x, 0, (size_t)w->n_embd * sizeof *x);
    pyrt_pool_row_ops(e->c->pool, emb->fmt)
        ->axpy(1.0f,
               (const uint8_t *)emb->data +
                   (size_t)e->tokens[t] * pyrt_row_bytes(emb->fmt, w->n_embd),
               x, w->n_embd);
    for (int i = 0; i < w->n_embd; i++)
        x[i] *= w->embedding_scale;
    float *cs = e->c->b->rope_cs + (size_t)t * (w->rope_dim > 0 ? w->rope_dim : 1);
    const int pos = e->c->pos + (int)t;
    const float scale = w->rope_scale != 0.0f ? w->rope_scale : 1.0f;
    for (int i = 0; i < w->rope_dim / 2; i++) {
        const float f = (float)pos * w->rope_inv_freq.data[i];
        cs[2 * i] = cosf(f) * scale;
        cs[2 * i + 1] = sinf(f) * scale;
    }
}

/* logits rows = (rms_norm(x) * output_norm) Wout^T / logit_scale for the chunk's tokens
 * [first, n): rows of `out` in that order. */
static void output(const pyrt_chunk *c, int first, float *out) {
    const pyrt_model_weights *w = &c->d->w;
    const pyrt_prefill_buf *b = c->b;
    pyrt_mv_job job = {.out = {{&w->output, NULL, out, (size_t)w->n_vocab}}, .n_mats = 1,
                       .div = w->logit_scale};
    const pyrt_chunk tail = {c->d, c->pool, c->b, c->cache, c->pos + first, c->n - first};
    pyrt_prefill_norm(&tail, b->x + (size_t)first * w->n_embd, w->output_norm.data,
                      pyrt_mv_job_xq(&job));
    pyrt_prefill_matmul(&tail, &job, b->xn, b->in_stride);
}

static int prefill(pyrt_decoder *d, pyrt_pool *pool, pyrt_prefill_args *a, int T) {
    const pyrt_model_weights *w = &d->w;
    int rc = PYRT_OK;
    for (int t0 = 0; t0 < a->n_tokens && rc == PYRT_OK; t0 += T) {
        const int n = a->n_tokens - t0 < T ? a->n_tokens - t0 : T;
        const int last_chunk = t0 + n == a->n_tokens;
        const pyrt_chunk c = {d, pool, d->prefill, &a->cache, a->pos + t0, n};
        embed_ctx e = {&c, a->tokens + t0};
        pyrt_pool_for(pool, n, 4, embed_row, &e);
        for (int i = 0; i < w->n_layer && rc == PYRT_OK; i++) {
            if (w->mla_kv_rank > 0)
                pyrt_prefill_mla(&c, i);
            else
                pyrt_prefill_attention(&c, i);
            /* the routing outputs are the prompt's last token's: the last chunk's */
            pyrt_ffn_io io = pyrt_decode_ffn_io(d, &a->experts, last_chunk ? a->route_ids : NULL,
                                                last_chunk ? a->route_logits : NULL, i);
            rc = pyrt_prefill_ffn(&c, i, &io);
            a->n_active += io.n_active;
            a->n_pairs += io.n_pairs;
        }
        if (rc != PYRT_OK)
            break;
        if (a->all_logits)
            output(&c, 0, a->logits + (size_t)t0 * w->n_vocab);
        else if (last_chunk)
            output(&c, n - 1, a->logits);
    }
    return rc;
}

int pyrt_decoder_prefill(pyrt_decoder *d, pyrt_pool *pool, pyrt_prefill_args *a) {
    pyrt_clear_error();
    int rc = check(d, pool, a);
    if (rc != PYRT_OK)
        return rc;
    if (atomic_flag_test_and_set(&d->busy))
        return pyrt_fail(PYRT_E_INVALID, "pyrt_decoder_prefill: this decoder is running a call on "
                         "another thread (use one decoder per thread)");
    const int ubatch = a->ubatch > 0 ? a->ubatch : PYRT_UBATCH_DEFAULT;
    const int T = a->n_tokens < ubatch ? a->n_tokens : ubatch;
    a->n_active = a->n_pairs = 0;
    pyrt_pool_acquire(pool);
    rc = ensure(d, T, pyrt_pool_threads(pool));
    if (rc == PYRT_OK && d->w.mla_kv_rank > 0)
        rc = pyrt_mla_prefill_ensure(&d->mla, T, pyrt_pool_threads(pool), "pyrt_decoder_prefill");
    if (rc == PYRT_OK)
        rc = prefill(d, pool, a, T);
    pyrt_pool_release(pool);
    atomic_flag_clear(&d->busy);
    return rc;
}

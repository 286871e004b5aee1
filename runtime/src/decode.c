/* pyrt_decoder_step: one decode step (one token, every layer, the logits) in one C call, on the
 * same thread pool as the expert kernels, with the dense weights read in place in their own
 * format. The math is the reference model's (pyruntime/model/reference.py), op for op:
 *
 *   x = token_embd[token] * embedding_scale
 *   per block:  x += attention(rms_norm(x) * attn_norm) * residual_scale      (attention.c)
 *               x += ffn(rms_norm(x) * ffn_norm) * residual_scale             (decode_ffn.c)
 *   logits = (rms_norm(x) * output_norm) Wout^T / logit_scale
 *
 * Threads. Serial pieces (norms, RoPE, top-k, activations: O(n_embd) each, a few microseconds)
 * run on the calling thread between pool tasks; every matrix product, the attention heads and
 * the routed experts are pool tasks. Matrices that read the same input share one task (q, k, v;
 * router, shared gate, shared up), and where the q/k norms are per head or absent, q/k/v, the
 * attention heads (with their norms, RoPE and cache append) and the o projection are one task
 * (pyrt_attention_task); the router, the routing and the routed experts are one task
 * (pyrt_moe_ffn_routed), and where both apply the whole block is one (layer_fused): a granite
 * block costs 1 hand-off, a qwen2moe-like one 2 (its shared down), olmoe (all-heads norms) 4.
 *
 * Before each pool task the step names the rows of the matvec that comes after it, so that the
 * threads' idle time (serial pieces on the caller, waiting for the slowest thread, the tiny
 * attention task) streams them into each thread's L2 (pyrt_pool_plan_prefetch): q/k/v and
 * attention -> o; o -> the first FFN matvec (router + shared gate/up, or dense gate/up); the
 * routed experts and the shared/dense down -> the next block's q/k/v; the last block -> the
 * output matrix; the output matrix -> block 0's q/k/v (the next step, after Python's turn). */
#include <string.h>

#include "decoder.h"
#include "error.h"
#include "vec.h"

static pyrt_mv_job output_job(const pyrt_decoder *d, float *logits) {
    return (pyrt_mv_job){.out = {{&d->w.output, NULL, logits, 0}}, .n_mats = 1,
                         .div = d->w.logit_scale};
}

/* x += attention(rms_norm(x) * attn_norm) * residual_scale. */
static void attention_half(pyrt_decoder *d, pyrt_pool *pool, const pyrt_attn_layer *l) {
    const pyrt_model_weights *w = &d->w;
    pyrt_rms_norm(d->x, l->b->attn_norm.data, w->rms_eps, w->n_embd, d->xn);
    const pyrt_mv_job ffn_in = pyrt_decode_ffn_in_job(d, l->b);
    if (w->mla_kv_rank > 0)
        pyrt_mla_run(&d->mla, &d->att, pool, l, d->xn, d->xq, d->y, &ffn_in);
    else
        pyrt_attention_run(&d->att, pool, l, d->xn, d->xq, d->y, &ffn_in, d->fuse_attention);
    for (int i = 0; i < w->n_embd; i++)
        d->x[i] = d->x[i] + d->y[i] * w->residual_scale;
}

/* ---- the whole MoE block in one pool task ----------------------------------------------------
 * Where the attention is one task (per-head or no q/k norms) and the router, routing and experts
 * are another, the two are joined: the thread whose o chunk completes the o rows adds the
 * attention to x, norms it for the FFN, quantizes it, switches the pool's prefetch plan to the
 * one the experts' run would have had (the shared down or the next block's q/k/v), and raises
 * ffn_ready; every thread then goes on to the router's chunks (pyrt_moe_ffn_routed, `before`).
 * One hand-off per block instead of two, and the caller's serial residual and norm between them
 * leave the critical path's hand-offs. The same operations on the same numbers: the same bits. */
typedef struct {
    pyrt_attn_task at;
    pyrt_decoder *d;
    const pyrt_block_weights *b;
    pyrt_pf_plan after; /* the plan from ffn_ready on */
    int quantize;       /* how the FFN input's readers (router/shared matrices, experts) want it
                         * quantized: PYRT_XQ_* */
    int64_t t_ffn;      /* when the FFN's input was ready: the attention / FFN split of times */
} layer_ctx;

static void o_rows_done(void *p, int64_t lo, int64_t hi) {
    layer_ctx *c = p;
    pyrt_decoder *d = c->d;
    const pyrt_model_weights *w = &d->w;
    const int got = (int)(hi - lo);
    if (atomic_fetch_add_explicit(&d->o_rows, got, memory_order_acq_rel) + got != w->n_embd)
        return;
    for (int i = 0; i < w->n_embd; i++)
        d->x[i] = d->x[i] + d->y[i] * w->residual_scale;
    pyrt_rms_norm(d->x, c->b->ffn_norm.data, w->rms_eps, w->n_embd, d->xn);
    pyrt_quantize_x_for(c->quantize, d->xn, d->xq, w->n_embd);
    pyrt_pool_plan_switch(c->at.pool, &c->after);
    c->t_ffn = pyrt_now_ns(); /* read by the caller after the run */
    pyrt_pool_flag_store(c->at.pool, &d->ffn_ready, 1);
}

static void task_attention_then_ffn_in(void *p, int ith, int nth) {
    layer_ctx *c = p;
    pyrt_attention_task(&c->at, ith, nth);
    pyrt_pool_wait_flag(c->at.pool, &c->d->ffn_ready, 1, ith);
}

static int layer_fusable(const pyrt_decoder *d, const pyrt_block_weights *b) {
    return d->fuse_layer && d->fuse_attention && d->fuse_router && d->w.mla_kv_rank == 0 &&
           pyrt_attention_fusable(&d->att, b) && b->router.data != NULL &&
           !d->w.expert_input_weight;
}

/* *t_ffn: when the attention part ended (the FFN's input was ready). */
static int layer_fused(pyrt_decoder *d, pyrt_pool *pool, const pyrt_attn_layer *l,
                       pyrt_ffn_io *io, const pyrt_mv_job *next, int64_t *t_ffn) {
    const pyrt_model_weights *w = &d->w;
    const pyrt_block_weights *b = l->b;
    const int n_embd = w->n_embd;
    pyrt_rms_norm(d->x, b->attn_norm.data, w->rms_eps, n_embd, d->xn);
    pyrt_mv_job qkv, o;
    pyrt_mv_job in = pyrt_decode_ffn_in_job(d, b);
    const pyrt_experts experts = pyrt_decode_experts(d, b, io);
    const pyrt_mv_job sh_down = {.out = {{&b->sh_down, NULL, d->ys, 0}}, .n_mats = 1};
    layer_ctx lc = {.d = d, .b = b,
                    .quantize = pyrt_xq_join(pyrt_mv_job_xq(&in), pyrt_fmt_xq(b->gud_fmt))};
    pyrt_mv_job_plan(b->sh_gate.data != NULL ? &sh_down : next, &lc.after);
    pyrt_attention_task_setup(&lc.at, &d->att, pool, l, &qkv, &o, d->xn, d->xq, d->y);
    pyrt_pool_plan_job(pool, &o);
    o.on_rows = o_rows_done;
    o.on_rows_ctx = &lc;
    atomic_store_explicit(&d->o_rows, 0, memory_order_relaxed); /* pool_run publishes them */
    atomic_store_explicit(&d->ffn_ready, 0, memory_order_relaxed);
    pyrt_mv_job_bind(&in, pool, d->xn, n_embd, d->xq); /* xn, xq: made by o_rows_done */
    pyrt_decode_route_begin(d, io);
    const int rc = pyrt_moe_ffn_routed(pool, task_attention_then_ffn_in, &lc, &in,
                                       pyrt_decode_route, d, d->ids, d->topw, &experts, d->xn,
                                       d->xq, io->k, w->activation, io->threshold, d->y,
                                       &io->n_active);
    *t_ffn = lc.t_ffn > 0 ? lc.t_ffn : pyrt_now_ns(); /* 0: the run did not start */
    if (rc != PYRT_OK)
        return rc;
    pyrt_decode_route_end(d, io);
    pyrt_decode_moe_tail(d, pool, b, next);
    return PYRT_OK;
}

/* ---- the step ------------------------------------------------------------------------------ */

/* The decode switches of the pool the call runs on. */
static void use_pool(pyrt_decoder *d, const pyrt_pool *pool) {
    const pyrt_params *params = pyrt_pool_params(pool);
    d->fuse_attention = params->fuse_attention;
    d->fuse_router = params->fuse_router;
    d->fuse_layer = params->fuse_layer;
}

/* x = token_embd[token] * embedding_scale (an axpy of 1.0 onto 0 dequantizes the row). */
static void embed(pyrt_decoder *d, const pyrt_pool *pool, int token) {
    const pyrt_model_weights *w = &d->w;
    const pyrt_matrix *emb = &w->token_embd;
    memset(d->x, 0, (size_t)w->n_embd * sizeof(float));
    pyrt_pool_row_ops(pool, emb->fmt)->axpy(
        1.0f, (const uint8_t *)emb->data + (size_t)token * pyrt_row_bytes(emb->fmt, w->n_embd),
        d->x, w->n_embd);
    for (int i = 0; i < w->n_embd; i++)
        d->x[i] *= w->embedding_scale;
}

/* A block's first matvec: q/k/v, or MLA's in-projections. */
static pyrt_mv_job block_in_job(pyrt_decoder *d, const pyrt_block_weights *b) {
    return d->w.mla_kv_rank > 0 ? pyrt_mla_in_job(&d->mla, b) : pyrt_attention_qkv_job(&d->att, b);
}

/* The matvec after block `layer` (the next block's first, or the output matrix): prefetch plans. */
static pyrt_mv_job after_layer(pyrt_decoder *d, int layer, const pyrt_mv_job *out) {
    return layer + 1 < d->w.n_layer ? block_in_job(d, &d->blocks[layer + 1]) : *out;
}

static pyrt_attn_layer attn_layer(const pyrt_decoder *d, int layer, const pyrt_step_args *a) {
    return (pyrt_attn_layer){&d->blocks[layer], a->cache.k[layer], a->cache.v[layer],
                             (size_t)a->cache.cap, a->pos};
}

static pyrt_ffn_io ffn_io(const pyrt_decoder *d, const pyrt_step_args *a, int layer) {
    return pyrt_decode_ffn_io(d, &a->experts, a->route_ids, a->route_logits, layer);
}

/* logits = (rms_norm(x) * output_norm) Wout^T / logit_scale; plans block 0's q/k/v next. */
static void output(pyrt_decoder *d, pyrt_pool *pool, pyrt_mv_job *out) {
    const pyrt_model_weights *w = &d->w;
    pyrt_rms_norm(d->x, w->output_norm.data, w->rms_eps, w->n_embd, d->xn);
    const pyrt_mv_job first = block_in_job(d, &d->blocks[0]); /* the next step's */
    pyrt_pool_plan_job(pool, &first);
    pyrt_mv_run(out, pool, d->xn, w->n_embd, d->xq);
}

static int decoder_step(pyrt_decoder *d, pyrt_pool *pool, pyrt_step_args *a) {
    const pyrt_model_weights *w = &d->w;
    int rc = pyrt_attention_prepare(&d->att, a->pos, a->cache.cap, "pyrt_decoder_step");
    if (rc != PYRT_OK)
        return rc;
    use_pool(d, pool);
    int64_t t0 = pyrt_now_ns();
    embed(d, pool, a->token);

    pyrt_pool_acquire(pool);
    pyrt_mv_job out = output_job(d, a->logits);
    for (int i = 0; i < w->n_layer && rc == PYRT_OK; i++) {
        const pyrt_block_weights *b = &d->blocks[i];
        const pyrt_attn_layer l = attn_layer(d, i, a);
        const pyrt_mv_job next = after_layer(d, i, &out);
        pyrt_ffn_io io = ffn_io(d, a, i);
        int64_t t1 = t0;
        if (layer_fusable(d, b)) { /* one task: split where the FFN's input was ready */
            rc = layer_fused(d, pool, &l, &io, &next, &t1);
            d->times[0] += t1 - t0;
        } else {
            attention_half(d, pool, &l);
            t1 = pyrt_now_ns();
            d->times[0] += t1 - t0;
            rc = pyrt_decode_ffn(d, pool, b, &io, &next);
        }
        a->n_active += io.n_active;
        a->n_pairs += io.n_pairs;
        t0 = pyrt_now_ns();
        d->times[1] += t0 - t1;
    }
    if (rc == PYRT_OK) {
        output(d, pool, &out);
        d->times[2] += pyrt_now_ns() - t0;
        d->times[3] += 1;
    }
    pyrt_pool_release(pool);
    return rc;
}

/* Marks the decoder busy for one call; PYRT_E_INVALID when another thread is in one. */
static int enter(pyrt_decoder *d, const char *fn) {
    if (atomic_flag_test_and_set(&d->busy))
        return pyrt_fail(PYRT_E_INVALID, "%s: this decoder is running a step on another thread "
                                         "(use one decoder per thread)", fn);
    return PYRT_OK;
}

/* The outputs of a step and their lengths (logits_need: n_vocab when `logits` is written). */
static pyrt_outputs step_outputs(const pyrt_decoder *d, const pyrt_step_args *a, int logits) {
    return (pyrt_outputs){.logits = a->logits, .logits_len = a->logits_len,
                          .logits_need = logits ? d->w.n_vocab : 0, .route_ids = a->route_ids,
                          .route_ids_len = a->route_ids_len, .route_logits = a->route_logits,
                          .route_logits_len = a->route_logits_len};
}

/* What every call of a step checks: its args, the expert arguments and the outputs it writes
 * (`logits`: whether it writes the logits). */
static int check_step_call(const pyrt_decoder *d, const pyrt_pool *pool, const pyrt_step_args *a,
                           int logits, const char *fn) {
    int rc = pyrt_decoder_check_call(d, pool, a, fn);
    if (rc == PYRT_OK)
        rc = pyrt_decoder_check_experts(d, &a->experts, fn);
    if (rc == PYRT_OK) {
        const pyrt_outputs o = step_outputs(d, a, logits);
        rc = pyrt_decoder_check_outputs(d, &a->experts, &o, fn);
    }
    return rc;
}

int pyrt_decoder_step(pyrt_decoder *d, pyrt_pool *pool, pyrt_step_args *a) {
    const char *fn = "pyrt_decoder_step";
    pyrt_clear_error();
    int rc = check_step_call(d, pool, a, 1, fn);
    if (rc == PYRT_OK)
        rc = pyrt_decoder_check_token(d, a->token, fn);
    if (rc == PYRT_OK)
        rc = pyrt_decoder_check_cache(d, &a->cache, fn);
    for (int i = 0; rc == PYRT_OK && i < d->w.n_layer; i++) {
        rc = pyrt_decoder_check_attention(&a->cache, i, a->pos, 1, fn);
        if (rc == PYRT_OK)
            rc = pyrt_decoder_check_ffn(d, &a->experts, i, fn);
    }
    if (rc != PYRT_OK)
        return rc;
    if ((rc = enter(d, fn)) != PYRT_OK)
        return rc;
    a->n_active = a->n_pairs = 0;
    rc = decoder_step(d, pool, a);
    atomic_flag_clear(&d->busy);
    return rc;
}

/* ---- the step in pieces ----------------------------------------------------------------------
 * The unfused composition of decoder_step (attention and FFN halves as their own calls, each
 * fused inside where the pool's params say), the same bits. Each call holds the pool for itself
 * and adds its time to the decoder's timers. */

int pyrt_decoder_begin(pyrt_decoder *d, pyrt_pool *pool, pyrt_step_args *a) {
    const char *fn = "pyrt_decoder_begin";
    pyrt_clear_error();
    int rc = check_step_call(d, pool, a, 0, fn);
    if (rc == PYRT_OK)
        rc = pyrt_decoder_check_token(d, a->token, fn);
    if (rc != PYRT_OK || (rc = enter(d, fn)) != PYRT_OK)
        return rc;
    const int64_t t0 = pyrt_now_ns();
    embed(d, pool, a->token);
    a->n_active = a->n_pairs = 0;
    d->times[0] += pyrt_now_ns() - t0;
    atomic_flag_clear(&d->busy);
    return PYRT_OK;
}

int pyrt_decoder_attention(pyrt_decoder *d, pyrt_pool *pool, int layer, pyrt_step_args *a) {
    const char *fn = "pyrt_decoder_attention";
    pyrt_clear_error();
    int rc = check_step_call(d, pool, a, 0, fn);
    if (rc == PYRT_OK)
        rc = pyrt_decoder_check_layer(d, layer, fn);
    if (rc == PYRT_OK)
        rc = pyrt_decoder_check_cache(d, &a->cache, fn);
    if (rc == PYRT_OK)
        rc = pyrt_decoder_check_attention(&a->cache, layer, a->pos, 1, fn);
    if (rc != PYRT_OK || (rc = enter(d, fn)) != PYRT_OK)
        return rc;
    const int64_t t0 = pyrt_now_ns();
    rc = pyrt_attention_prepare(&d->att, a->pos, a->cache.cap, fn);
    if (rc == PYRT_OK) {
        use_pool(d, pool);
        const pyrt_attn_layer l = attn_layer(d, layer, a);
        pyrt_pool_acquire(pool);
        attention_half(d, pool, &l);
        pyrt_pool_release(pool);
    }
    d->times[0] += pyrt_now_ns() - t0;
    atomic_flag_clear(&d->busy);
    return rc;
}

int pyrt_decoder_ffn(pyrt_decoder *d, pyrt_pool *pool, int layer, pyrt_step_args *a) {
    const char *fn = "pyrt_decoder_ffn";
    pyrt_clear_error();
    int rc = check_step_call(d, pool, a, 0, fn);
    if (rc == PYRT_OK)
        rc = pyrt_decoder_check_layer(d, layer, fn);
    if (rc == PYRT_OK)
        rc = pyrt_decoder_check_ffn(d, &a->experts, layer, fn);
    if (rc != PYRT_OK || (rc = enter(d, fn)) != PYRT_OK)
        return rc;
    const int64_t t0 = pyrt_now_ns();
    use_pool(d, pool);
    const pyrt_mv_job out = output_job(d, a->logits); /* its rows: the plan after the last */
    const pyrt_mv_job next = after_layer(d, layer, &out);
    pyrt_ffn_io io = ffn_io(d, a, layer);
    pyrt_pool_acquire(pool);
    rc = pyrt_decode_ffn(d, pool, &d->blocks[layer], &io, &next);
    pyrt_pool_release(pool);
    a->n_active += io.n_active;
    a->n_pairs += io.n_pairs;
    d->times[1] += pyrt_now_ns() - t0;
    atomic_flag_clear(&d->busy);
    return rc;
}

int pyrt_decoder_end(pyrt_decoder *d, pyrt_pool *pool, pyrt_step_args *a) {
    const char *fn = "pyrt_decoder_end";
    pyrt_clear_error();
    int rc = check_step_call(d, pool, a, 1, fn);
    if (rc != PYRT_OK || (rc = enter(d, fn)) != PYRT_OK)
        return rc;
    const int64_t t0 = pyrt_now_ns();
    pyrt_mv_job out = output_job(d, a->logits);
    pyrt_pool_acquire(pool);
    output(d, pool, &out);
    pyrt_pool_release(pool);
    d->times[2] += pyrt_now_ns() - t0;
    d->times[3] += 1;
    atomic_flag_clear(&d->busy);
    return PYRT_OK;
}

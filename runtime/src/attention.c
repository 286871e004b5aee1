/* The attention half of a block for one token: q/k/v, q/k norms, RoPE, the KV-cache append, the
 * heads over the cached positions (GQA: head h reads kv head h / (n_head / n_head_kv)) and the
 * output projection, with the model's math (pyruntime/model/reference.py), op for op:
 *
 *   q, k, v = xn Wq^T + bq, ... ; clamp to +-clamp_kqv ; q/k norm (all heads or per head) ;
 *   RoPE (rotate_half, first rope_dim dims of each head, cos/sin times rope_scale), and
 *   llama4's q/k L2 norm after it, or on its NoPE layers no RoPE and q times a temperature ;
 *   k, v -> cache[pos] ; a = softmax(q k^T * scale) v over positions 0..pos (the last `window`
 *   of them on a sliding-window layer, those of pos's chunk on a chunked one; with sinks, exp(sink[h]) joins the softmax's
 *   denominator) ; y = a Wo^T + bo
 *
 * Where the q/k norms are per head or absent, all of it is one pool task (pyrt_attention_task);
 * otherwise three (q/k/v; heads; o) with the norms, RoPE and cache append on the calling thread
 * between them. The same operations on the same numbers either way: the same bits. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "attn_tile.h"
#include "error.h"
#include "llama4_qk.h"
#include "vec.h"

int pyrt_attention_init(pyrt_attention *a, const pyrt_model_weights *w, const char *fn) {
    const int nq = w->n_head * w->head_dim, nkv = w->n_head_kv * w->head_dim;
    *a = (pyrt_attention){.n_embd = w->n_embd, .n_head = w->n_head, .n_head_kv = w->n_head_kv,
                          .head_dim = w->head_dim, .rope_dim = w->rope_dim, .rms_eps = w->rms_eps,
                          .scale = w->attention_scale, .clamp_kqv = w->clamp_kqv,
                          .rope_inv_freq = w->rope_inv_freq.data,
                          .rope_scale = w->rope_scale != 0.0f ? w->rope_scale : 1.0f,
                          .rope_pos = -1, .qk_l2 = w->qk_l2_norm,
                          .temp_len = w->temperature_length,
                          .temp_scale = w->temperature_scale, .temp = 1.0f};
    const size_t f = sizeof(float);
    a->q = malloc((size_t)nq * f);
    a->k = malloc((size_t)nkv * f);
    a->v = malloc((size_t)nkv * f);
    a->att = malloc((size_t)nq * f);
    a->att_q = malloc(pyrt_xq_units((size_t)nq) * sizeof(pyrt_xq8));
    a->rope_cs = malloc(((size_t)w->rope_dim + 1) * f);
    a->rows_done = malloc(((size_t)w->n_head + 2 * (size_t)w->n_head_kv) * sizeof(atomic_int));
    a->kv_ready = malloc((size_t)w->n_head_kv * sizeof(atomic_int));
    if (!a->q || !a->k || !a->v || !a->att || !a->att_q || !a->rope_cs || !a->rows_done ||
        !a->kv_ready) {
        pyrt_attention_free(a);
        return pyrt_fail(PYRT_E_NOMEM, "%s: out of memory", fn);
    }
    return PYRT_OK;
}

void pyrt_attention_free(pyrt_attention *a) {
    free(a->q);
    free(a->k);
    free(a->v);
    free(a->att);
    free(a->att_q);
    free(a->scores);
    free(a->rope_cs);
    free(a->rows_done);
    free(a->kv_ready);
    memset(a, 0, sizeof *a);
}

int pyrt_attention_prepare(pyrt_attention *a, int pos, int cap, const char *fn) {
    /* per head: a tile's scratch, then its stream scores over cap positions */
    const size_t need = pyrt_attn_scratch_floats(a->head_dim) + pyrt_attn_stream_floats(cap);
    if (a->scores_cap < need) {
        float *s = realloc(a->scores, (size_t)a->n_head * need * sizeof(float));
        if (s == NULL)
            return pyrt_fail(PYRT_E_NOMEM, "%s: cannot allocate attention scores", fn);
        a->scores = s;
        a->scores_cap = need;
    }
    /* RoPE table of this position: (cos, sin) of pos * inv_freq[i], pos * inv_freq in f32 as in
     * rope_tables (reference.py). */
    if (a->rope_pos != pos) {
        for (int i = 0; i < a->rope_dim / 2; i++) {
            const float f = (float)pos * a->rope_inv_freq[i];
            a->rope_cs[2 * i] = cosf(f) * a->rope_scale;
            a->rope_cs[2 * i + 1] = sinf(f) * a->rope_scale;
        }
        a->temp = pyrt_temperature(a->temp_len, a->temp_scale, pos);
        a->rope_pos = pos;
    }
    return PYRT_OK;
}

pyrt_mv_job pyrt_attention_qkv_job(const pyrt_attention *a, const pyrt_block_weights *b) {
    return (pyrt_mv_job){
        .out = {{&b->wq, b->bq.data, a->q, 0},
                {&b->wk, b->bk.data, a->k, 0},
                {&b->wv, b->bv.data, a->v, 0}},
        .n_mats = 3,
        .clamp = a->clamp_kqv,
    };
}

static int all_heads_norm(const pyrt_attention *a, const pyrt_block_weights *b) {
    return b->q_norm.data != NULL && b->q_norm.n == (int64_t)a->n_head * a->head_dim;
}

int pyrt_attention_fusable(const pyrt_attention *a, const pyrt_block_weights *b) {
    return !all_heads_norm(a, b);
}

/* ---- the heads ------------------------------------------------------------------------------
 * Query head h over the cached positions (the window's on a sliding-window layer) as a tile of
 * one row (attn_tile.h): the prefill's kernel, so a step and a prefill give a query the same
 * bits. With room for all its scores the row streams its keys first, fetched ahead into L1 and
 * their values into L2 (the cache has left every cache since the previous step: a step streams
 * the weights), then the values. */
static void attend_head(const pyrt_attn_task *t, int h) {
    const pyrt_attention *a = t->a;
    const pyrt_block_weights *b = t->l.b;
    const int hd = a->head_dim, kvh = h / (a->n_head / a->n_head_kv);
    pyrt_attn_tile tile = {.q = {a->q + (size_t)h * hd}, .out = {a->att + (size_t)h * hd},
                           .pos = {t->l.pos}, .n_rows = 1,
                           .k = t->l.kc + (size_t)kvh * t->l.cap * hd,
                           .v = t->l.vc + (size_t)kvh * t->l.cap * hd,
                           .hd = hd, .window = b->window, .chunk = b->chunk, .scale = a->scale,
                           .has_sink = b->sinks.data != NULL,
                           .sink = {b->sinks.data != NULL ? b->sinks.data[h] : 0.0f},
                           .scratch = a->scores + (size_t)h * a->scores_cap,
                           .stream = a->scores + (size_t)h * a->scores_cap +
                                     pyrt_attn_scratch_floats(hd)};
    pyrt_attn_tile_run(&tile);
}

/* One query head per work item (q, k, v normed and roped, k and v in the cache). */
static void task_heads(void *p, int ith, int nth) {
    (void)ith;
    (void)nth;
    pyrt_attn_task *t = p;
    for (int h; (h = atomic_fetch_add_explicit(&t->next_head, 1, memory_order_relaxed)) <
                t->a->n_head;)
        attend_head(t, h);
}

/* ---- q/k/v, attention and o in one pool task -----------------------------------------------
 * Where the q/k norms are per head (or absent), a head's attention needs only its own q rows
 * and its kv head's k and v rows, so it need not wait for the whole q/k/v matvec, nor the
 * caller's serial norms, RoPE and cache append between two pool runs: one task computes the
 * q/k/v chunks (pyrt_mv_task), publishing per head how many of its rows are done (rows of the
 * job's list [q | k | v] are head_dim per head: unit u = row / head_dim), then its threads take
 * heads in order. The first head of each kv group (the lowest, so taken first) norms and ropes
 * k, appends k and v to the cache and raises kv_ready; the group's other heads wait for it. Each
 * head norms and ropes its own q. The last head done quantizes att (into its own blocks: q/k/v
 * chunks may still read x's) and raises att_ready; then every thread runs the o chunks. The
 * same operations on the same numbers as the serial path: the same bits (tests/c/test_decode.c
 * compares both). A thread waiting for rows or att prefetches its home of the pool's plan (the
 * o projection). */

static void qkv_rows_done(void *p, int64_t lo, int64_t hi) {
    const pyrt_attn_task *t = p;
    const int hd = t->a->head_dim;
    for (int64_t u = lo / hd; u * hd < hi; u++) {
        const int64_t a = lo > u * hd ? lo : u * hd, e = hi < (u + 1) * hd ? hi : (u + 1) * hd;
        pyrt_pool_flag_add(t->pool, &t->a->rows_done[u], (int)(e - a));
    }
}

void pyrt_attention_task(void *p, int ith, int nth) {
    pyrt_attn_task *t = p;
    pyrt_attention *a = t->a;
    const pyrt_block_weights *b = t->l.b;
    const int hd = a->head_dim, group = a->n_head / a->n_head_kv;
    pyrt_mv_task(t->qkv, ith, nth);
    for (int h; (h = atomic_fetch_add_explicit(&t->next_head, 1, memory_order_relaxed)) <
                a->n_head;) {
        const int kvh = h / group;
        float *q = a->q + (size_t)h * hd;
        pyrt_pool_wait_flag(t->pool, &a->rows_done[h], hd, ith);
        if (h % group == 0) {
            float *k = a->k + (size_t)kvh * hd;
            const float *v = a->v + (size_t)kvh * hd;
            pyrt_pool_wait_flag(t->pool, &a->rows_done[a->n_head + kvh], hd, ith);
            pyrt_pool_wait_flag(t->pool, &a->rows_done[a->n_head + a->n_head_kv + kvh], hd, ith);
            if (b->k_norm.data != NULL)
                pyrt_rms_norm(k, b->k_norm.data, a->rms_eps, hd, k);
            pyrt_position_heads(k, 1, hd, a->rope_dim, a->rope_cs, b->nope, a->qk_l2,
                                a->rms_eps, 1.0f);
            const size_t at = ((size_t)kvh * t->l.cap + t->l.pos) * hd;
            memcpy(t->l.kc + at, k, (size_t)hd * sizeof(float));
            memcpy(t->l.vc + at, v, (size_t)hd * sizeof(float));
            pyrt_pool_flag_store(t->pool, &a->kv_ready[kvh], 1);
        } else {
            pyrt_pool_wait_flag(t->pool, &a->kv_ready[kvh], 1, ith);
        }
        if (b->q_norm.data != NULL)
            pyrt_rms_norm(q, b->q_norm.data, a->rms_eps, hd, q);
        pyrt_position_heads(q, 1, hd, a->rope_dim, a->rope_cs, b->nope, a->qk_l2, a->rms_eps,
                            a->temp);
        attend_head(t, h);
        /* the last head done quantizes att for o (one vector of n_head * head_dim) */
        if (atomic_fetch_add_explicit(&a->heads_done, 1, memory_order_acq_rel) == a->n_head - 1) {
            pyrt_quantize_x_for(t->o_xq, a->att, a->att_q, a->n_head * hd);
            pyrt_pool_flag_store(t->pool, &a->att_ready, 1);
        }
    }
    pyrt_pool_wait_flag(t->pool, &a->att_ready, 1, ith);
    pyrt_mv_task(t->o, ith, nth);
}

void pyrt_attention_task_setup(pyrt_attn_task *t, pyrt_attention *a, pyrt_pool *pool,
                               const pyrt_attn_layer *l, pyrt_mv_job *qkv, pyrt_mv_job *o,
                               const float *xn, pyrt_xq8 *xq, float *y) {
    *t = (pyrt_attn_task){.a = a, .pool = pool, .l = *l, .qkv = qkv, .o = o,
                          .o_xq = pyrt_fmt_xq(l->b->wo.fmt)};
    atomic_init(&t->next_head, 0);
    *qkv = pyrt_attention_qkv_job(a, l->b);
    qkv->on_rows = qkv_rows_done;
    qkv->on_rows_ctx = t;
    pyrt_mv_job_setup(qkv, pool, xn, a->n_embd, xq);
    /* o reads att, or its Q8 blocks made by the last head (not quantized here: att is not
     * computed yet) */
    const int nq = a->n_head * a->head_dim;
    *o = (pyrt_mv_job){.out = {{&l->b->wo, l->b->bo.data, y, 0}}, .n_mats = 1};
    pyrt_mv_job_bind(o, pool, a->att, nq, a->att_q);
    for (int u = 0; u < a->n_head + 2 * a->n_head_kv; u++) /* pool_run publishes them */
        atomic_store_explicit(&a->rows_done[u], 0, memory_order_relaxed);
    for (int h = 0; h < a->n_head_kv; h++)
        atomic_store_explicit(&a->kv_ready[h], 0, memory_order_relaxed);
    atomic_store_explicit(&a->heads_done, 0, memory_order_relaxed);
    atomic_store_explicit(&a->att_ready, 0, memory_order_relaxed);
}

/* ---- the attention half --------------------------------------------------------------------- */

void pyrt_attention_run(pyrt_attention *a, pyrt_pool *pool, const pyrt_attn_layer *l,
                        const float *xn, pyrt_xq8 *xq, float *y, const pyrt_mv_job *after,
                        int fuse) {
    const pyrt_block_weights *b = l->b;
    const int hd = a->head_dim, nq = a->n_head * hd, nkv = a->n_head_kv * hd;
    pyrt_mv_job qkv, o = {.out = {{&b->wo, b->bo.data, y, 0}}, .n_mats = 1};
    pyrt_attn_task t;
    pyrt_pool_plan_job(pool, &o);
    if (fuse && pyrt_attention_fusable(a, b)) {
        pyrt_attention_task_setup(&t, a, pool, l, &qkv, &o, xn, xq, y);
        pyrt_pool_run(pool, pyrt_attention_task, &t);
        return;
    }
    qkv = pyrt_attention_qkv_job(a, b);
    pyrt_mv_run(&qkv, pool, xn, a->n_embd, xq);
    if (all_heads_norm(a, b)) { /* olmoe: over all heads */
        pyrt_rms_norm(a->q, b->q_norm.data, a->rms_eps, nq, a->q);
        pyrt_rms_norm(a->k, b->k_norm.data, a->rms_eps, nkv, a->k);
    } else if (b->q_norm.data != NULL) { /* qwen3moe: per head */
        for (int h = 0; h < a->n_head; h++) {
            float *q = a->q + (size_t)h * hd;
            pyrt_rms_norm(q, b->q_norm.data, a->rms_eps, hd, q);
        }
        for (int h = 0; h < a->n_head_kv; h++) {
            float *k = a->k + (size_t)h * hd;
            pyrt_rms_norm(k, b->k_norm.data, a->rms_eps, hd, k);
        }
    }
    pyrt_position_heads(a->q, a->n_head, hd, a->rope_dim, a->rope_cs, b->nope, a->qk_l2,
                        a->rms_eps, a->temp);
    pyrt_position_heads(a->k, a->n_head_kv, hd, a->rope_dim, a->rope_cs, b->nope, a->qk_l2,
                        a->rms_eps, 1.0f);
    for (int h = 0; h < a->n_head_kv; h++) {
        memcpy(l->kc + ((size_t)h * l->cap + l->pos) * hd, a->k + (size_t)h * hd,
               (size_t)hd * sizeof(float));
        memcpy(l->vc + ((size_t)h * l->cap + l->pos) * hd, a->v + (size_t)h * hd,
               (size_t)hd * sizeof(float));
    }
    t = (pyrt_attn_task){.a = a, .pool = pool, .l = *l};
    atomic_init(&t.next_head, 0);
    pyrt_pool_plan_job(pool, &o);
    pyrt_pool_run(pool, task_heads, &t);
    pyrt_pool_plan_job(pool, after);
    pyrt_mv_run(&o, pool, a->att, nq, xq);
}

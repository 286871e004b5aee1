/* Multi-head latent attention for one token (deepseek2; pyruntime/model/mla.py, the absorbed
 * form), with the reference's math op for op. With R = kv_lora_rank, D = nope dims, r = rope
 * dims, per token x (normed):
 *
 *   q = Wq x, or Wq_b (rms_norm(Wq_a x) * q_a_norm)      [H (D + r)]: per head q_nope, q_pe
 *   [c; k_pe] = Wkv_a x ; c_kv = rms_norm(c) * kv_a_norm ; k_pe roped -> cache[pos]
 *   per head h:  q_lat = Wk_b[h] q_nope[h]  (attn_k_b's rows [h R, (h + 1) R), [R, D])
 *                a = softmax([q_lat; rope(q_pe)] . cache[p] * scale) over p <= pos
 *                o_lat = sum_p a_p c_kv[p] ; o[h] = Wv_b[h] o_lat  (attn_v_b's [v, R])
 *   y = Wo [o_0; ...; o_H-1]
 *
 * The scores against [c_kv; k_pe] are one dot per cached row of R + r floats, so a head is the
 * decode step's one-row attention tile (attn_tile.h) with keys and values both the cache; the
 * tile's output over all R + r dims holds o_lat in its first R (the r more cost r / (R + r) of
 * the value sums). A head's k_b fold, attention and v_b run on one thread: 16 heads (the lite
 * shape) of ~70 KB of Q8_0 k_b and v_b each balance over up to 16 threads in one pool task. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn_tile.h"
#include "error.h"
#include "mla_step.h"
#include "model_check.h"
#include "vec.h"

int pyrt_mla_init(pyrt_mla *m, const pyrt_model_weights *w, const char *fn) {
    *m = (pyrt_mla){.n_embd = w->n_embd, .n_head = w->n_head, .rank = w->mla_kv_rank,
                    .q_rank = w->mla_q_rank, .nope = w->mla_nope_dim, .rope = w->rope_dim,
                    .v_dim = w->mla_v_dim, .rms_eps = w->rms_eps};
    const size_t f = sizeof(float), H = (size_t)w->n_head;
    const size_t ov = H * (size_t)m->v_dim;
    const size_t xq_in = (size_t)m->q_rank > ov ? (size_t)m->q_rank : ov;
    m->xqh_stride = (int)pyrt_xq_units((size_t)(m->nope > m->rank ? m->nope : m->rank));
    m->q = malloc(H * ((size_t)m->nope + (size_t)m->rope) * f);
    m->qa = malloc(((size_t)m->q_rank + 1) * f);
    m->kv = malloc(((size_t)m->rank + (size_t)m->rope) * f);
    m->o = malloc(ov * f);
    m->xq = malloc(pyrt_xq_units(xq_in) * sizeof(pyrt_xq8));
    m->xqh = malloc(H * (size_t)m->xqh_stride * sizeof(pyrt_xq8));
    if (!m->q || !m->qa || !m->kv || !m->o || !m->xq || !m->xqh) {
        pyrt_mla_free(m);
        return pyrt_fail(PYRT_E_NOMEM, "%s: out of memory", fn);
    }
    return PYRT_OK;
}

void pyrt_mla_free(pyrt_mla *m) {
    pyrt_mla_prefill_free(m);
    free(m->q);
    free(m->qa);
    free(m->kv);
    free(m->o);
    free(m->xq);
    free(m->xqh);
    memset(m, 0, sizeof *m);
}

/* ---- checks ------------------------------------------------------------------------------- */

static int bad(int i, const char *name, const char *msg) {
    return pyrt_fail(PYRT_E_INVALID, "pyrt_decoder_create: blk.%d.%s %s", i, name, msg);
}

static int vector(const pyrt_vector *v, int64_t n, int i, const char *name) {
    if (v->data == NULL || v->n != n || (uintptr_t)v->data % 4)
        return pyrt_fail(PYRT_E_INVALID, "pyrt_decoder_create: blk.%d.%s: NULL, unaligned, or "
                         "%lld elements where the model needs %lld", i, name, (long long)v->n,
                         (long long)n);
    return PYRT_OK;
}

int pyrt_mla_check_model(const pyrt_model_weights *w) {
    if (w->mla_kv_rank < 1 || w->mla_nope_dim < 1 || w->mla_v_dim < 1 || w->mla_q_rank < 0 ||
        w->n_head_kv != 1 || w->head_dim != w->mla_kv_rank + w->rope_dim || w->rope_dim < 2)
        return pyrt_fail(PYRT_E_INVALID,
                         "pyrt_decoder_create: multi-head latent attention needs mla_kv_rank, "
                         "mla_nope_dim, mla_v_dim, rope_dim > 0, mla_q_rank >= 0, n_head_kv 1 "
                         "and head_dim = mla_kv_rank + rope_dim; got %d, %d, %d, %d, %d, %d, %d",
                         w->mla_kv_rank, w->mla_nope_dim, w->mla_v_dim, w->rope_dim,
                         w->mla_q_rank, w->n_head_kv, w->head_dim);
    return PYRT_OK;
}

int pyrt_mla_check_block(const pyrt_model_weights *w, const pyrt_block_weights *b, int i) {
    const int H = w->n_head, R = w->mla_kv_rank, D = w->mla_nope_dim, r = w->rope_dim;
    const int qr = w->mla_q_rank, n_embd = w->n_embd;
    if (b->wq.data != NULL || b->wk.data != NULL || b->wv.data != NULL)
        return bad(i, "attn_q/k/v", "present in a multi-head latent attention block");
    if (b->bq.data || b->bk.data || b->bv.data || b->bo.data || b->q_norm.data ||
        b->k_norm.data || b->sinks.data || b->window != 0)
        return bad(i, "attention", "has biases, q/k norms, sinks or a window, which multi-head "
                   "latent attention does not take");
    if (qr > 0) {
        PYRT_CHECK(pyrt_check_model_matrix(&b->wq_a, qr, n_embd, "attn_q_a", i));
        PYRT_CHECK(vector(&b->q_a_norm, qr, i, "attn_q_a_norm"));
        PYRT_CHECK(pyrt_check_model_matrix(&b->wq_b, H * (D + r), qr, "attn_q_b", i));
    } else {
        if (b->wq_a.data != NULL || b->q_a_norm.data != NULL)
            return bad(i, "attn_q_a", "given, but the model's mla_q_rank is 0");
        PYRT_CHECK(pyrt_check_model_matrix(&b->wq_b, H * (D + r), n_embd, "attn_q", i));
    }
    PYRT_CHECK(pyrt_check_model_matrix(&b->wkv_a, R + r, n_embd, "attn_kv_a_mqa", i));
    PYRT_CHECK(vector(&b->kv_a_norm, R, i, "attn_kv_a_norm"));
    PYRT_CHECK(pyrt_check_model_matrix(&b->wk_b, H * R, D, "attn_k_b", i));
    PYRT_CHECK(pyrt_check_model_matrix(&b->wv_b, H * w->mla_v_dim, R, "attn_v_b", i));
    PYRT_CHECK(pyrt_check_model_matrix(&b->wo, n_embd, H * w->mla_v_dim, "attn_output", i));
    return PYRT_OK;
}

/* ---- the step ----------------------------------------------------------------------------- */

pyrt_mv_job pyrt_mla_in_job(pyrt_mla *m, const pyrt_block_weights *b) {
    const int lora = b->wq_a.data != NULL;
    return (pyrt_mv_job){.out = {{lora ? &b->wq_a : &b->wq_b, NULL, lora ? m->qa : m->q, 0},
                                 {&b->wkv_a, NULL, m->kv, 0}},
                         .n_mats = 2};
}

typedef struct {
    pyrt_mla *m;
    pyrt_attention *a;
    pyrt_pool *pool;
    const pyrt_attn_layer *l;
    atomic_int next_head;
} heads_ctx;

enum { HEAD_ROWS = 64 }; /* rows per pyrt_dot_tile call */

void pyrt_mla_head_rows(const pyrt_pool *pool, const pyrt_matrix *w, int h, int n_out, int nt,
                        const float *const *x, pyrt_xq8 *xq, size_t xq_stride, float *y,
                        size_t y_stride) {
    const pyrt_row_ops *ops = pyrt_pool_row_ops(pool, w->fmt);
    const size_t rb = pyrt_row_bytes(w->fmt, w->n_in);
    const int kind = pyrt_fmt_xq(w->fmt);
    const void *xv[PYRT_ATTN_ROWS];
    for (int t = 0; t < nt; t++) {
        xv[t] = x[t];
        if (kind != PYRT_XQ_NONE) {
            pyrt_quantize_x_for(kind, x[t], xq + (size_t)t * xq_stride, w->n_in);
            xv[t] = xq + (size_t)t * xq_stride;
        }
    }
    const uint8_t *base = (const uint8_t *)w->data + (size_t)h * n_out * rb;
    const void *rows[HEAD_ROWS];
    for (int o = 0; o < n_out; o += HEAD_ROWS) {
        const int nr = n_out - o < HEAD_ROWS ? n_out - o : HEAD_ROWS;
        for (int r = 0; r < nr; r++)
            rows[r] = base + (size_t)(o + r) * rb;
        pyrt_dot_tile(ops, nr, rows, nt, xv, w->n_in, y + o, y_stride, 1);
    }
}

/* y[o] = row o of the head's block of w . x [n_in] for o < n_out (one token). */
static void head_matvec(const pyrt_pool *pool, const pyrt_matrix *w, int h, int n_out,
                        const float *x, pyrt_xq8 *xq, float *y) {
    pyrt_mla_head_rows(pool, w, h, n_out, 1, &x, xq, 0, y, 0);
}

static void attend_head(const heads_ctx *c, int h) {
    const pyrt_mla *m = c->m;
    const pyrt_attention *a = c->a;
    const pyrt_block_weights *b = c->l->b;
    const int hd = m->rank + m->rope;
    const float *qn = m->q + (size_t)h * (m->nope + m->rope);
    float *qh = a->q + (size_t)h * hd, *out = a->att + (size_t)h * hd;
    pyrt_xq8 *xqh = m->xqh + (size_t)h * m->xqh_stride;
    head_matvec(c->pool, &b->wk_b, h, m->rank, qn, xqh, qh); /* q_lat */
    memcpy(qh + m->rank, qn + m->nope, (size_t)m->rope * sizeof(float));
    pyrt_rope(qh + m->rank, 1, m->rope, m->rope, a->rope_cs);
    const pyrt_attn_tile tile = {
        .q = {qh}, .out = {out}, .pos = {c->l->pos}, .n_rows = 1, .k = c->l->kc, .v = c->l->kc,
        .hd = hd, .scale = a->scale, .scratch = a->scores + (size_t)h * a->scores_cap,
        .stream = a->scores + (size_t)h * a->scores_cap + pyrt_attn_scratch_floats(hd)};
    pyrt_attn_tile_run(&tile);
    head_matvec(c->pool, &b->wv_b, h, m->v_dim, out, xqh, m->o + (size_t)h * m->v_dim);
}

static void task_heads(void *p, int ith, int nth) {
    (void)ith;
    (void)nth;
    heads_ctx *c = p;
    for (int h; (h = atomic_fetch_add_explicit(&c->next_head, 1, memory_order_relaxed)) <
                c->m->n_head;)
        attend_head(c, h);
}

void pyrt_mla_run(pyrt_mla *m, pyrt_attention *a, pyrt_pool *pool, const pyrt_attn_layer *l,
                  const float *xn, pyrt_xq8 *xq, float *y, const pyrt_mv_job *after) {
    const pyrt_block_weights *b = l->b;
    const int lora = b->wq_a.data != NULL, hd = m->rank + m->rope;
    const pyrt_mv_job q_b = {.out = {{&b->wq_b, NULL, m->q, 0}}, .n_mats = 1};
    pyrt_mv_job o = {.out = {{&b->wo, NULL, y, 0}}, .n_mats = 1};
    pyrt_mv_job in = pyrt_mla_in_job(m, b);
    pyrt_pool_plan_job(pool, lora ? &q_b : &o);
    pyrt_mv_run(&in, pool, xn, m->n_embd, xq);

    /* the latent and the rope key into the cache row of pos */
    float *row = l->kc + (size_t)l->pos * hd;
    pyrt_rms_norm(m->kv, b->kv_a_norm.data, m->rms_eps, m->rank, row);
    memcpy(row + m->rank, m->kv + m->rank, (size_t)m->rope * sizeof(float));
    pyrt_rope(row + m->rank, 1, m->rope, m->rope, a->rope_cs);
    if (lora) {
        pyrt_rms_norm(m->qa, b->q_a_norm.data, m->rms_eps, m->q_rank, m->qa);
        pyrt_mv_job qb = q_b;
        pyrt_pool_plan_job(pool, &o);
        pyrt_mv_run(&qb, pool, m->qa, m->q_rank, m->xq);
    }
    heads_ctx c = {.m = m, .a = a, .pool = pool, .l = l};
    atomic_init(&c.next_head, 0);
    pyrt_pool_run(pool, task_heads, &c);
    pyrt_pool_plan_job(pool, after);
    pyrt_mv_run(&o, pool, m->o, m->n_head * m->v_dim, m->xq);
}

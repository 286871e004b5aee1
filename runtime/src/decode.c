/* pyrt_decoder_step: one decode step (one token, every layer, the logits) in one C call, on the
 * same thread pool as the expert kernels, with the dense weights read in place in their own
 * format. The math is the torch path's (pyruntime/models/transformer.py), op for op:
 *
 *   x = token_embd[token] * embedding_scale
 *   per block:  h = rms_norm(x) * attn_norm
 *               q, k, v = h Wq^T + bq, ... ; clamp to +-clamp_kqv ; q/k norm (all heads or per
 *               head) ; RoPE (rotate_half, first rope_dim dims of each head) ; k, v -> cache[pos]
 *               a = softmax(q k^T * scale) v over positions 0..pos (GQA: head h reads kv head
 *               h / (n_head / n_head_kv)) ; x += (a Wo^T) * residual_scale
 *               h = rms_norm(x) * ffn_norm
 *               MoE: p = softmax(h R^T), top-k (+ renormalize), routed experts (pyrt_moe_ffn),
 *                    + shared expert * sigmoid(h . g_shexp) ; dense: down(act(gate h) * up h)
 *               x += y * residual_scale
 *   logits = (rms_norm(x) * output_norm) Wout^T / logit_scale
 *
 * Threads. Serial pieces (norms, RoPE, top-k, activations: O(n_embd) each, a few microseconds)
 * run on the calling thread between pool tasks; every matrix product, the attention heads and
 * the routed experts are pool tasks. Matrices that read the same input share one task (q, k, v;
 * router, shared gate, shared up), and where the q/k norms are per head or absent, q/k/v, the
 * attention heads (with their norms, RoPE and cache append) and the o projection are one task
 * (task_qkv_attention); the router, the routing and the routed experts are one task
 * (pyrt_moe_ffn_routed), and where both apply the whole block is one (layer_fused): a granite
 * block costs 1 hand-off, a qwen2moe-like one 2 (its shared down), olmoe (all-heads norms) 4. */
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "decode_internal.h"

struct pyrt_decoder {
    pyrt_model_weights w;        /* copy; w.blocks points at `blocks` */
    pyrt_block_weights *blocks;  /* [n_layer] copy */
    int max_in;                  /* longest input of any matrix (elements) */
    int max_ff;                  /* widest shared expert / dense FFN */
    float *x;                    /* [n_embd] residual stream */
    float *xn;                   /* [max_in] normed input, then FFN hidden h */
    pyrt_xq8 *xq;                /* [max_in / 32] Q8 blocks of the current matvec input */
    pyrt_xq8 *att_q;             /* [n_head * head_dim / 32] Q8 blocks of att for the fused o
                                    projection (xq is still read by q/k/v chunks meanwhile) */
    float *q, *k, *v;            /* [n_head*hd], [n_kv*hd], [n_kv*hd] */
    float *att;                  /* [n_head*hd] attention output */
    float *y, *ys;               /* [n_embd] block output; shared expert / dense FFN output */
    float *gate, *up;            /* [max_ff] */
    float *router;               /* [n_expert] router logits, then probabilities */
    int32_t *ids;                /* [n_expert_used] */
    float *topw;                 /* [n_expert_used] */
    uint8_t *taken;              /* [n_expert] top-k scratch */
    atomic_int *rows_done;       /* [n_head + 2 n_head_kv] fused q/k/v + attention: rows of each
                                    q head, then k head, then v head computed (of head_dim) */
    atomic_int *kv_ready;        /* [n_head_kv] 1 once head kvh's k is normed and roped, and k, v
                                    are in the cache */
    atomic_int heads_done;       /* fused: attention heads finished */
    atomic_int att_ready;        /* fused: 1 once att is complete and quantized into att_q */
    atomic_int o_rows;           /* fused layer: o rows computed */
    atomic_int ffn_ready;        /* fused layer: 1 once x, xn (and xq) are the FFN's */
    float *scores;               /* [n_head, scores_cap] attention probabilities */
    size_t scores_cap;           /* positions per head in scores */
    int fuse_attention;          /* this step's pool's params.fuse_attention, fuse_router and */
    int fuse_router;             /* fuse_layer (pyrt.h), read at the start of the step */
    int fuse_layer;
    int64_t times[4];            /* see pyrt_decoder_times */
    atomic_flag busy;            /* set during a step: the scratch above is not shareable */
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- checks -------------------------------------------------------------------------------- */

static int check_shape(const pyrt_matrix *m, int n_out, int n_in, const char *what, int layer) {
    char name[64];
    if (layer >= 0)
        snprintf(name, sizeof name, "blk.%d.%s", layer, what);
    else
        snprintf(name, sizeof name, "%s", what);
    int rc = pyrt_matrix_check(m, "pyrt_decoder_create", name);
    if (rc != PYRT_OK)
        return rc;
    if (m->n_out != n_out || m->n_in != n_in)
        return pyrt_fail(PYRT_E_INVALID,
                         "pyrt_decoder_create: %s has shape [%d, %d], the model needs [%d, %d]",
                         name, m->n_out, m->n_in, n_out, n_in);
    return PYRT_OK;
}

#define CHECK(call)                                                                               \
    do {                                                                                          \
        int rc_ = (call);                                                                         \
        if (rc_ != PYRT_OK)                                                                       \
            return rc_;                                                                           \
    } while (0)

static int fail_block(int i, const char *msg) {
    return pyrt_fail(PYRT_E_INVALID, "pyrt_decoder_create: blk.%d: %s", i, msg);
}

static int check_block(const pyrt_model_weights *w, const pyrt_block_weights *b, int i,
                       int *max_ff) {
    const int n_embd = w->n_embd, nq = w->n_head * w->head_dim, nkv = w->n_head_kv * w->head_dim;
    if (b->attn_norm == NULL || b->ffn_norm == NULL)
        return fail_block(i, "attn_norm or ffn_norm is NULL");
    CHECK(check_shape(&b->wq, nq, n_embd, "attn_q", i));
    CHECK(check_shape(&b->wk, nkv, n_embd, "attn_k", i));
    CHECK(check_shape(&b->wv, nkv, n_embd, "attn_v", i));
    CHECK(check_shape(&b->wo, n_embd, nq, "attn_output", i));
    if ((b->q_norm == NULL) != (b->k_norm == NULL))
        return fail_block(i, "q_norm and k_norm must be both present or both absent");
    if (b->q_norm != NULL) {
        const int all = b->q_norm_len == nq && b->k_norm_len == nkv;
        const int per_head = b->q_norm_len == w->head_dim && b->k_norm_len == w->head_dim;
        if (!all && !per_head)
            return pyrt_fail(PYRT_E_INVALID,
                             "pyrt_decoder_create: blk.%d: q/k norms have %d/%d elements; expected "
                             "%d/%d (over all heads) or %d/%d (per head)", i, b->q_norm_len,
                             b->k_norm_len, nq, nkv, w->head_dim, w->head_dim);
    }
    if (b->router.data != NULL) {
        CHECK(check_shape(&b->router, w->n_expert, n_embd, "ffn_gate_inp", i));
        const size_t rb = pyrt_row_bytes(b->gud_fmt, n_embd);
        if (b->gud == NULL || pyrt_row_ops_scalar(b->gud_fmt) == NULL || rb == 0 ||
            (double)w->n_expert * w->n_ff_exp * 3.0 * (double)rb != (double)b->gud_bytes)
            return pyrt_fail(PYRT_E_INVALID,
                             "pyrt_decoder_create: blk.%d.ffn_gud_exps: NULL, unknown format %d, "
                             "or %zu bytes where [%d, %d, 3, %d] needs %.0f", i, b->gud_fmt,
                             b->gud_bytes, w->n_expert, w->n_ff_exp, n_embd,
                             (double)w->n_expert * w->n_ff_exp * 3.0 * (double)rb);
        /* checked here, once: the fused router's pyrt_moe_ffn_routed skips check_args */
        if (pyrt_check_weights_aligned("pyrt_decoder_create: ffn_gud_exps", b->gud, b->gud_fmt) !=
            PYRT_OK)
            return PYRT_E_INVALID;
        if (b->sh_gate.data != NULL) {
            const int n_ff = b->sh_gate.n_out;
            CHECK(check_shape(&b->sh_gate, n_ff, n_embd, "ffn_gate_shexp", i));
            CHECK(check_shape(&b->sh_up, n_ff, n_embd, "ffn_up_shexp", i));
            CHECK(check_shape(&b->sh_down, n_embd, n_ff, "ffn_down_shexp", i));
            *max_ff = n_ff > *max_ff ? n_ff : *max_ff;
        } else if (b->sh_gate_inp != NULL) {
            return fail_block(i, "ffn_gate_inp_shexp without a shared expert");
        }
    } else {
        const int n_ff = b->ffn_gate.n_out;
        CHECK(check_shape(&b->ffn_gate, n_ff, n_embd, "ffn_gate", i));
        CHECK(check_shape(&b->ffn_up, n_ff, n_embd, "ffn_up", i));
        CHECK(check_shape(&b->ffn_down, n_embd, n_ff, "ffn_down", i));
        *max_ff = n_ff > *max_ff ? n_ff : *max_ff;
    }
    return PYRT_OK;
}

static int check_model(const pyrt_model_weights *w, int *max_ff) {
    const char *fn = "pyrt_decoder_create";
    if (w->n_vocab < 1 || w->n_embd < 1 || w->n_layer < 1 || w->n_head < 1 || w->n_head_kv < 1 ||
        w->head_dim < 1 || w->n_expert < 1 || w->n_expert_used < 1 || w->n_ff_exp < 1)
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: sizes must be positive: n_vocab=%d n_embd=%d n_layer=%d n_head=%d "
                         "n_head_kv=%d head_dim=%d n_expert=%d n_expert_used=%d n_ff_exp=%d", fn,
                         w->n_vocab, w->n_embd, w->n_layer, w->n_head, w->n_head_kv, w->head_dim,
                         w->n_expert, w->n_expert_used, w->n_ff_exp);
    if (w->n_head % w->n_head_kv != 0)
        return pyrt_fail(PYRT_E_INVALID, "%s: n_head=%d is not a multiple of n_head_kv=%d", fn,
                         w->n_head, w->n_head_kv);
    if (w->n_expert_used > w->n_expert)
        return pyrt_fail(PYRT_E_INVALID, "%s: n_expert_used=%d > n_expert=%d", fn,
                         w->n_expert_used, w->n_expert);
    if (w->rope_dim < 0 || w->rope_dim % 2 || w->rope_dim > w->head_dim ||
        (w->rope_dim > 0 && w->rope_inv_freq == NULL))
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: rope_dim=%d must be even, <= head_dim=%d, with rope_inv_freq set", fn,
                         w->rope_dim, w->head_dim);
    if (w->activation < PYRT_ACT_SILU || w->activation > PYRT_ACT_GELU_ERF)
        return pyrt_fail(PYRT_E_INVALID, "%s: unknown activation %d", fn, w->activation);
    if (w->blocks == NULL || w->output_norm == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: blocks or output_norm is NULL", fn);
    if (!(w->logit_scale != 0.0f) || !(w->rms_eps >= 0.0f) || !(w->clamp_kqv >= 0.0f))
        return pyrt_fail(PYRT_E_INVALID, "%s: logit_scale must be non-zero, rms_eps and clamp_kqv "
                         ">= 0", fn);
    CHECK(check_shape(&w->token_embd, w->n_vocab, w->n_embd, "token_embd", -1));
    CHECK(check_shape(&w->output, w->n_vocab, w->n_embd, "output", -1));
    for (int i = 0; i < w->n_layer; i++)
        CHECK(check_block(w, &w->blocks[i], i, max_ff));
    return PYRT_OK;
}

/* ---- build / free -------------------------------------------------------------------------- */

int pyrt_decoder_create(const pyrt_model_weights *w, pyrt_decoder **out) {
    pyrt_clear_error();
    if (out == NULL || w == NULL)
        return pyrt_fail(PYRT_E_INVALID, "pyrt_decoder_create: %s is NULL", w ? "out" : "w");
    *out = NULL;
    int max_ff = 0;
    CHECK(check_model(w, &max_ff));
    pyrt_decoder *d = calloc(1, sizeof *d);
    if (d == NULL)
        return pyrt_fail(PYRT_E_NOMEM, "pyrt_decoder_create: out of memory");
    d->w = *w;
    const int nq = w->n_head * w->head_dim, nkv = w->n_head_kv * w->head_dim;
    d->max_ff = max_ff;
    d->max_in = w->n_embd > nq ? w->n_embd : nq;
    d->max_in = max_ff > d->max_in ? max_ff : d->max_in;
    const size_t f = sizeof(float);
    d->blocks = malloc((size_t)w->n_layer * sizeof *d->blocks);
    d->x = malloc((size_t)w->n_embd * f);
    d->xn = malloc((size_t)d->max_in * f);
    d->xq = malloc(((size_t)d->max_in / PYRT_QK + 1) * sizeof(pyrt_xq8));
    d->att_q = malloc(((size_t)nq / PYRT_QK + 1) * sizeof(pyrt_xq8));
    d->q = malloc((size_t)nq * f);
    d->k = malloc((size_t)nkv * f);
    d->v = malloc((size_t)nkv * f);
    d->att = malloc((size_t)nq * f);
    d->y = malloc((size_t)w->n_embd * f);
    d->ys = malloc((size_t)w->n_embd * f);
    d->gate = malloc(((size_t)max_ff + 1) * f);
    d->up = malloc(((size_t)max_ff + 1) * f);
    d->router = malloc((size_t)w->n_expert * f);
    d->ids = malloc((size_t)w->n_expert_used * sizeof(int32_t));
    d->topw = malloc((size_t)w->n_expert_used * f);
    d->taken = malloc((size_t)w->n_expert);
    d->rows_done = malloc(((size_t)w->n_head + 2 * (size_t)w->n_head_kv) * sizeof(atomic_int));
    d->kv_ready = malloc((size_t)w->n_head_kv * sizeof(atomic_int));
    if (!d->blocks || !d->x || !d->xn || !d->xq || !d->att_q || !d->q || !d->k || !d->v ||
        !d->att || !d->y || !d->ys || !d->gate || !d->up || !d->router || !d->ids || !d->topw ||
        !d->taken || !d->rows_done || !d->kv_ready) {
        pyrt_decoder_free(d);
        return pyrt_fail(PYRT_E_NOMEM, "pyrt_decoder_create: out of memory");
    }
    memcpy(d->blocks, w->blocks, (size_t)w->n_layer * sizeof *d->blocks);
    d->w.blocks = d->blocks;
    atomic_flag_clear(&d->busy);
    *out = d;
    return PYRT_OK;
}

void pyrt_decoder_free(pyrt_decoder *d) {
    if (d == NULL)
        return;
    free(d->blocks);
    free(d->x);
    free(d->xn);
    free(d->xq);
    free(d->att_q);
    free(d->q);
    free(d->k);
    free(d->v);
    free(d->att);
    free(d->y);
    free(d->ys);
    free(d->gate);
    free(d->up);
    free(d->router);
    free(d->ids);
    free(d->topw);
    free(d->taken);
    free(d->rows_done);
    free(d->kv_ready);
    free(d->scores);
    free(d);
}

int pyrt_decoder_times(pyrt_decoder *d, int64_t *ns, int reset) {
    pyrt_clear_error();
    if (d == NULL || ns == NULL)
        return pyrt_fail(PYRT_E_INVALID, "pyrt_decoder_times: %s is NULL", d ? "ns" : "dec");
    memcpy(ns, d->times, sizeof d->times);
    if (reset)
        memset(d->times, 0, sizeof d->times);
    return PYRT_OK;
}

/* ---- serial pieces (calling thread) -------------------------------------------------------- */

/* out = x * rsqrt(mean(x^2) + eps) * w, in that order (as rms_norm in transformer.py). */
static void rms_norm(const float *x, const float *w, float eps, int n, float *out) {
    double ss = 0.0; /* f64 sum: order-independent to well under f32 rounding */
    for (int i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++)
        out[i] = x[i] * r * w[i];
}

/* HF rotate_half on the first rope_dim dims of each of n_heads heads of x [n_heads, hd]:
 * with c = cos(pos f_i), s = sin(pos f_i), i < rope_dim/2:
 * x[i] <- x[i] c - x[i + d/2] s,  x[i + d/2] <- x[i + d/2] c + x[i] s. */
static void rope(float *x, int n_heads, int hd, int rope_dim, const float *cs) {
    const int half = rope_dim / 2;
    for (int h = 0; h < n_heads; h++) {
        float *xh = x + (size_t)h * hd;
        for (int i = 0; i < half; i++) {
            const float x1 = xh[i], x2 = xh[i + half], c = cs[2 * i], s = cs[2 * i + 1];
            xh[i] = x1 * c + (-x2) * s;
            xh[i + half] = x2 * c + x1 * s;
        }
    }
}

/* Softmax over n values in place. */
static void softmax(float *p, int n) {
    float mx = p[0];
    for (int i = 1; i < n; i++)
        mx = p[i] > mx ? p[i] : mx;
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        p[i] = expf(p[i] - mx);
        sum += p[i];
    }
    for (int i = 0; i < n; i++)
        p[i] /= sum;
}

/* p = softmax(logits) over the experts; ids/w = the k largest (ties: lower id first), renormalized
 * to sum 1 when asked (docs/gguf-layout.md, "Routing"). taken: [n_expert] scratch. */
static void route(float *p, int n_expert, int k, int renorm, int32_t *ids, float *w,
                  uint8_t *taken) {
    softmax(p, n_expert);
    memset(taken, 0, (size_t)n_expert);
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n_expert; e++)
            if (!taken[e] && (best < 0 || p[e] > p[best]))
                best = e;
        taken[best] = 1;
        ids[j] = best;
        w[j] = p[best];
        sum += w[j];
    }
    if (renorm)
        for (int j = 0; j < k; j++)
            w[j] /= sum;
}

/* The routing of the fused router + experts task (pyrt_moe_ffn_routed), from d->router. */
static void route_task(void *ctx, int32_t *ids, float *w) {
    pyrt_decoder *d = ctx;
    route(d->router, d->w.n_expert, d->w.n_expert_used, d->w.expert_weights_norm, ids, w,
          d->taken);
}

/* ---- pool tasks ---------------------------------------------------------------------------- */

/* Readies a matvec job over x (n elements) for the pool: quantizes x once when some matrix
 * needs Q8 blocks, sets the chunking. */
static int job_blocked(const pyrt_mv_job *job) {
    int blocked = 0;
    for (int i = 0; i < job->n_mats; i++)
        blocked |= pyrt_fmt_is_blocked(job->out[i].m->fmt);
    return blocked;
}

/* The job over x (n elements; its Q8 blocks in d->xq, not made here), chunked for the pool. */
static void matvec_bind(pyrt_decoder *d, pyrt_pool *pool, pyrt_mv_job *job, const float *x,
                        int n) {
    job->x = x;
    job->x_stride = (size_t)n;
    job->xq = d->xq;
    job->xq_stride = (size_t)n / PYRT_QK;
    job->n_tokens = 1;
    if (job->div == 0.0f)
        job->div = 1.0f;
    pyrt_mv_job_prepare(job, pool);
}

static void matvec_setup(pyrt_decoder *d, pyrt_pool *pool, pyrt_mv_job *job, const float *x,
                         int n) {
    if (job_blocked(job))
        pyrt_quantize_x_q8(x, d->xq, n);
    matvec_bind(d, pool, job, x, n);
}

/* y = x W^T for the job's matrices, as one pool task. */
static void run_matvec(pyrt_decoder *d, pyrt_pool *pool, pyrt_mv_job *job, const float *x,
                       int n) {
    matvec_setup(d, pool, job, x, n);
    pyrt_pool_run(pool, pyrt_mv_task, job);
}

typedef struct {
    const pyrt_decoder *d;
    const pyrt_row_ops *f32; /* the pool's F32 row kernels */
    const float *kc, *vc; /* this layer's cache [n_kv, cap, hd] */
    size_t cap;
    int n_pos;            /* positions attended: 0 .. n_pos-1 */
    float scale;
    _Alignas(64) atomic_int next; /* next head (own cache line) */
    char pad[60];
} attn_ctx;

/* The KV cache of a layer was written one position per step and has left every cache since
 * (a step streams ~460 MB of weights): a head's keys and values come from DRAM, and walked one
 * 256-byte row per dot they are latency-bound (the hardware prefetcher ramps up per head).
 * So the key pass prefetches keys KV_AHEAD rows ahead and, beside them, the values of the same
 * position into L2 (the first KV_V_MAX positions: a long context's values would not fit). */
enum { KV_AHEAD = 16, KV_V_MAX = 2048 };

static inline void prefetch_kv(const float *p, size_t bytes, int l2) {
    const char *c = (const char *)p;
    for (size_t off = 0; off < bytes; off += 64) {
        if (l2)
            __builtin_prefetch(c + off, 0, 2);
        else
            __builtin_prefetch(c + off, 0, 3);
    }
}

/* Query head h: scores over the cached positions, softmax, weighted sum of V. */
static void attend_head(const attn_ctx *c, int h) {
    const pyrt_decoder *d = c->d;
    const int hd = d->w.head_dim, kvh = h / (d->w.n_head / d->w.n_head_kv);
    const pyrt_row_ops *f32 = c->f32;
    const float *q = d->q + (size_t)h * hd;
    const float *keys = c->kc + (size_t)kvh * c->cap * hd;
    const float *vals = c->vc + (size_t)kvh * c->cap * hd;
    float *s = d->scores + (size_t)h * d->scores_cap;
    float *out = d->att + (size_t)h * hd;
    const size_t row = (size_t)hd * sizeof(float);
    for (int t = 0; t < c->n_pos && t < KV_AHEAD; t++)
        prefetch_kv(keys + (size_t)t * hd, row, 0);
    for (int t = 0; t < c->n_pos; t++) {
        if (t + KV_AHEAD < c->n_pos)
            prefetch_kv(keys + (size_t)(t + KV_AHEAD) * hd, row, 0);
        if (t < KV_V_MAX)
            prefetch_kv(vals + (size_t)t * hd, row, 1);
        s[t] = f32->dot(keys + (size_t)t * hd, q, hd) * c->scale;
    }
    softmax(s, c->n_pos);
    memset(out, 0, (size_t)hd * sizeof *out);
    for (int t = 0; t < c->n_pos; t++)
        f32->axpy(s[t], vals + (size_t)t * hd, out, hd);
}

/* One query head per work item (q, k, v normed and roped, k and v in the cache). */
static void task_attention(void *p, int ith, int nth) {
    (void)ith;
    (void)nth;
    attn_ctx *c = p;
    for (int h; (h = atomic_fetch_add_explicit(&c->next, 1, memory_order_relaxed)) <
                c->d->w.n_head;)
        attend_head(c, h);
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
typedef struct {
    pyrt_decoder *d; /* its counters and flags (attn->d is the same decoder, read-only) */
    attn_ctx *attn;
    pyrt_mv_job *qkv;
    pyrt_mv_job *o; /* the output projection over att (x: att, xq: att_q), prepared */
    pyrt_pool *pool;
    float *kc, *vc;  /* this layer's cache [n_kv, cap, hd] (attn's, writable) */
    const pyrt_block_weights *b;
    const float *cs; /* this position's RoPE table */
    int pos;
    int o_blocked;   /* o's weights are Q8_0/Q4_0: it reads att_q */
} qkv_attn_ctx;

static void qkv_rows_done(void *p, int64_t lo, int64_t hi) {
    const qkv_attn_ctx *c = p;
    const int hd = c->attn->d->w.head_dim;
    for (int64_t u = lo / hd; u * hd < hi; u++) {
        const int64_t a = lo > u * hd ? lo : u * hd, e = hi < (u + 1) * hd ? hi : (u + 1) * hd;
        atomic_fetch_add_explicit(&c->attn->d->rows_done[u], (int)(e - a), memory_order_release);
    }
}

static void wait_flag(const atomic_int *flag, int value, pyrt_pool *pool, int ith) {
    int pf_more = 1;
    for (int spins = 0; atomic_load_explicit(flag, memory_order_acquire) < value;)
        if (!pf_more || !(pf_more = pyrt_pool_idle_prefetch(pool, ith)))
            pyrt_spin_pause(++spins);
}

static void task_qkv_attention(void *p, int ith, int nth) {
    const qkv_attn_ctx *c = p;
    const pyrt_decoder *d = c->attn->d;
    const pyrt_model_weights *w = &d->w;
    const int hd = w->head_dim, group = w->n_head / w->n_head_kv;
    pyrt_mv_task(c->qkv, ith, nth);
    for (int h; (h = atomic_fetch_add_explicit(&c->attn->next, 1, memory_order_relaxed)) <
                w->n_head;) {
        const int kvh = h / group;
        float *q = d->q + (size_t)h * hd;
        wait_flag(&d->rows_done[h], hd, c->pool, ith);
        if (h % group == 0) {
            float *k = d->k + (size_t)kvh * hd;
            const float *v = d->v + (size_t)kvh * hd;
            wait_flag(&d->rows_done[w->n_head + kvh], hd, c->pool, ith);
            wait_flag(&d->rows_done[w->n_head + w->n_head_kv + kvh], hd, c->pool, ith);
            if (c->b->k_norm != NULL)
                rms_norm(k, c->b->k_norm, w->rms_eps, hd, k);
            rope(k, 1, hd, w->rope_dim, c->cs);
            const size_t at = ((size_t)kvh * c->attn->cap + c->pos) * hd;
            memcpy(c->kc + at, k, (size_t)hd * sizeof(float));
            memcpy(c->vc + at, v, (size_t)hd * sizeof(float));
            atomic_store_explicit(&d->kv_ready[kvh], 1, memory_order_release);
        } else {
            wait_flag(&d->kv_ready[kvh], 1, c->pool, ith);
        }
        if (c->b->q_norm != NULL)
            rms_norm(q, c->b->q_norm, w->rms_eps, hd, q);
        rope(q, 1, hd, w->rope_dim, c->cs);
        attend_head(c->attn, h);
        /* the last head done quantizes att for o (one vector of n_head * head_dim) */
        if (atomic_fetch_add_explicit(&c->d->heads_done, 1, memory_order_acq_rel) ==
            w->n_head - 1) {
            if (c->o_blocked)
                pyrt_quantize_x_q8(d->att, c->d->att_q, w->n_head * hd);
            atomic_store_explicit(&c->d->att_ready, 1, memory_order_release);
        }
    }
    wait_flag(&d->att_ready, 1, c->pool, ith);
    pyrt_mv_task(c->o, ith, nth);
}

/* ---- prefetch plans ------------------------------------------------------------------------
 * Before each pool task the step names the rows of the matvec that comes after it, so that the
 * threads' idle time (serial pieces on the caller, waiting for the slowest thread, the tiny
 * attention task) streams them into each thread's L2 (pyrt_pool_plan_prefetch): q/k/v and
 * attention -> o; o -> the first FFN matvec (router + shared gate/up, or dense gate/up); the
 * routed experts and the shared/dense down -> the next block's q/k/v; the last block -> the
 * output matrix; the output matrix -> block 0's q/k/v (the next step, after Python's turn). */

static pyrt_mv_job qkv_job(const pyrt_decoder *d, const pyrt_block_weights *b) {
    return (pyrt_mv_job){
        .out = {{&b->wq, b->bq, d->q, 0}, {&b->wk, b->bk, d->k, 0}, {&b->wv, b->bv, d->v, 0}},
        .n_mats = 3,
        .clamp = d->w.clamp_kqv,
    };
}

/* The FFN's first matvec: router (+ shared gate and up), or the dense FFN's gate and up. */
static pyrt_mv_job ffn_in_job(const pyrt_decoder *d, const pyrt_block_weights *b) {
    if (b->router.data == NULL)
        return (pyrt_mv_job){.out = {{&b->ffn_gate, NULL, d->gate, 0}, {&b->ffn_up, NULL, d->up, 0}},
                             .n_mats = 2};
    return (pyrt_mv_job){.out = {{&b->router, NULL, d->router, 0},
                                 {&b->sh_gate, NULL, d->gate, 0},
                                 {&b->sh_up, NULL, d->up, 0}},
                         .n_mats = b->sh_gate.data != NULL ? 3 : 1};
}

static pyrt_mv_job output_job(const pyrt_decoder *d, float *logits) {
    return (pyrt_mv_job){.out = {{&d->w.output, NULL, logits, 0}}, .n_mats = 1,
                         .div = d->w.logit_scale};
}

/* The idle time of the next pool run prefetches `next`'s rows (NULL: nothing). */
static void plan_next(pyrt_pool *pool, const pyrt_mv_job *next) {
    pyrt_pf_plan plan = {.n = 0};
    if (next != NULL)
        pyrt_mv_job_plan(next, &plan);
    pyrt_pool_plan_prefetch(pool, &plan);
}

/* ---- the step ------------------------------------------------------------------------------ */

/* The q/k/v job, the attention heads and the o projection as one pool task (see
 * task_qkv_attention). */
static void qkv_attention_setup(pyrt_decoder *d, pyrt_pool *pool, const pyrt_block_weights *b,
                                pyrt_mv_job *qkv, attn_ctx *ac, pyrt_mv_job *o, float *kc,
                                float *vc, const float *cs, int pos, qkv_attn_ctx *cp) {
    const pyrt_model_weights *w = &d->w;
    *cp = (qkv_attn_ctx){.d = d, .attn = ac, .qkv = qkv, .o = o, .pool = pool, .kc = kc,
                         .vc = vc, .b = b, .cs = cs, .pos = pos,
                         .o_blocked = pyrt_fmt_is_blocked(b->wo.fmt)};
    qkv->on_rows = qkv_rows_done;
    qkv->on_rows_ctx = cp;
    matvec_setup(d, pool, qkv, d->xn, w->n_embd);
    /* o reads att, or its Q8 blocks made by the last head (not quantized here: att is not
     * computed yet) */
    const int nq = w->n_head * w->head_dim;
    o->x = d->att;
    o->x_stride = (size_t)nq;
    o->xq = d->att_q;
    o->xq_stride = (size_t)nq / PYRT_QK;
    o->n_tokens = 1;
    o->div = 1.0f;
    pyrt_mv_job_prepare(o, pool);
    for (int u = 0; u < w->n_head + 2 * w->n_head_kv; u++) /* pool_run publishes them */
        atomic_store_explicit(&d->rows_done[u], 0, memory_order_relaxed);
    for (int h = 0; h < w->n_head_kv; h++)
        atomic_store_explicit(&d->kv_ready[h], 0, memory_order_relaxed);
    atomic_store_explicit(&d->heads_done, 0, memory_order_relaxed);
    atomic_store_explicit(&d->att_ready, 0, memory_order_relaxed);
}

static void run_qkv_attention_o(pyrt_decoder *d, pyrt_pool *pool, const pyrt_block_weights *b,
                                pyrt_mv_job *qkv, attn_ctx *ac, pyrt_mv_job *o, float *kc,
                                float *vc, const float *cs, int pos) {
    qkv_attn_ctx c;
    qkv_attention_setup(d, pool, b, qkv, ac, o, kc, vc, cs, pos, &c);
    pyrt_pool_run(pool, task_qkv_attention, &c);
}

static void attention_block(pyrt_decoder *d, pyrt_pool *pool, const pyrt_block_weights *b,
                            int pos, float *kc, float *vc, size_t cap, const float *cs) {
    const pyrt_model_weights *w = &d->w;
    const int hd = w->head_dim, nq = w->n_head * hd, nkv = w->n_head_kv * hd;
    rms_norm(d->x, b->attn_norm, w->rms_eps, w->n_embd, d->xn);
    pyrt_mv_job qkv = qkv_job(d, b);
    pyrt_mv_job o = {.out = {{&b->wo, NULL, d->y, 0}}, .n_mats = 1};
    const pyrt_mv_job ffn_in = ffn_in_job(d, b);
    attn_ctx ac = {.d = d, .f32 = pyrt_pool_row_ops(pool, PYRT_FMT_F32), .kc = kc, .vc = vc,
                   .cap = cap, .n_pos = pos + 1, .scale = w->attention_scale};
    atomic_init(&ac.next, 0);
    const int all_heads_norm = b->q_norm != NULL && b->q_norm_len == nq;
    plan_next(pool, &o);
    if (d->fuse_attention && !all_heads_norm) {
        run_qkv_attention_o(d, pool, b, &qkv, &ac, &o, kc, vc, cs, pos);
    } else {
        run_matvec(d, pool, &qkv, d->xn, w->n_embd);
        if (all_heads_norm) { /* olmoe: over all heads */
            rms_norm(d->q, b->q_norm, w->rms_eps, nq, d->q);
            rms_norm(d->k, b->k_norm, w->rms_eps, nkv, d->k);
        } else if (b->q_norm != NULL) { /* qwen3moe: per head */
            for (int h = 0; h < w->n_head; h++)
                rms_norm(d->q + (size_t)h * hd, b->q_norm, w->rms_eps, hd, d->q + (size_t)h * hd);
            for (int h = 0; h < w->n_head_kv; h++)
                rms_norm(d->k + (size_t)h * hd, b->k_norm, w->rms_eps, hd, d->k + (size_t)h * hd);
        }
        rope(d->q, w->n_head, hd, w->rope_dim, cs);
        rope(d->k, w->n_head_kv, hd, w->rope_dim, cs);
        for (int h = 0; h < w->n_head_kv; h++) {
            memcpy(kc + ((size_t)h * cap + pos) * hd, d->k + (size_t)h * hd,
                   (size_t)hd * sizeof(float));
            memcpy(vc + ((size_t)h * cap + pos) * hd, d->v + (size_t)h * hd,
                   (size_t)hd * sizeof(float));
        }
        plan_next(pool, &o);
        pyrt_pool_run(pool, task_attention, &ac);
        plan_next(pool, &ffn_in);
        run_matvec(d, pool, &o, d->att, nq);
    }
    for (int i = 0; i < w->n_embd; i++)
        d->x[i] = d->x[i] + d->y[i] * w->residual_scale;
}

/* d->ys = down(act(gate) * up), gate and up already in d->gate / d->up [n_ff]; `next`: the
 * matvec after it (prefetch plan). */
static void ffn_down(pyrt_decoder *d, pyrt_pool *pool, const pyrt_matrix *down, int n_ff,
                     const pyrt_mv_job *next) {
    for (int j = 0; j < n_ff; j++)
        d->gate[j] = pyrt_activate(d->w.activation, d->gate[j]) * d->up[j];
    pyrt_mv_job job = {.out = {{down, NULL, d->ys, 0}}, .n_mats = 1};
    plan_next(pool, next);
    run_matvec(d, pool, &job, d->gate, n_ff);
}

/* After the routed experts (in d->y): the shared expert, if any, then the residual. */
static void moe_tail(pyrt_decoder *d, pyrt_pool *pool, const pyrt_block_weights *b,
                     const pyrt_mv_job *next) {
    const pyrt_model_weights *w = &d->w;
    const int n_embd = w->n_embd;
    if (b->sh_gate.data != NULL) {
        float gs = 1.0f;
        if (b->sh_gate_inp != NULL) {
            const float z = pyrt_pool_row_ops(pool, PYRT_FMT_F32)->dot(b->sh_gate_inp, d->xn,
                                                                       n_embd);
            gs = 1.0f / (1.0f + expf(-z));
        }
        ffn_down(d, pool, &b->sh_down, b->sh_gate.n_out, next);
        for (int i = 0; i < n_embd; i++)
            d->y[i] = d->y[i] + d->ys[i] * gs;
    }
    for (int i = 0; i < n_embd; i++)
        d->x[i] = d->x[i] + d->y[i] * w->residual_scale;
}

/* Returns the routed neurons computed (n_active of pyrt_moe_ffn), or -1 on failure. `next`: the
 * matvec after this block (the next block's q/k/v, or the output matrix), for prefetch plans. */
static int64_t ffn_block(pyrt_decoder *d, pyrt_pool *pool, const pyrt_block_weights *b,
                         float threshold, const pyrt_mv_job *next) {
    const pyrt_model_weights *w = &d->w;
    const int n_embd = w->n_embd;
    rms_norm(d->x, b->ffn_norm, w->rms_eps, n_embd, d->xn);
    int64_t active = 0;
    pyrt_mv_job in = ffn_in_job(d, b);
    if (b->router.data == NULL) { /* dense FFN layer */
        const pyrt_mv_job down = {.out = {{&b->ffn_down, NULL, d->ys, 0}}, .n_mats = 1};
        plan_next(pool, &down);
        run_matvec(d, pool, &in, d->xn, n_embd);
        ffn_down(d, pool, &b->ffn_down, b->ffn_gate.n_out, next);
        memcpy(d->y, d->ys, (size_t)n_embd * sizeof(float));
    } else {
        const int shared = b->sh_gate.data != NULL;
        /* The routed experts' rows are known only after the router. Its run gets the plan of
         * the experts' run (the shared down or the next block's q/k/v): the threads' wait at its
         * end and through top-k and pyrt_moe_ffn's set-up (the DRAM idled there) start on it,
         * and the experts' run goes on from where they stopped (same plan: pool.c). */
        const pyrt_mv_job sh_down = {.out = {{&b->sh_down, NULL, d->ys, 0}}, .n_mats = 1};
        const pyrt_mv_job *after = shared ? &sh_down : next;
        plan_next(pool, after);
        int rc;
        if (d->fuse_router) {
            /* one task: router rows, routing by the thread that completes them, experts */
            matvec_setup(d, pool, &in, d->xn, n_embd);
            const int blocked = pyrt_fmt_is_blocked(b->router.fmt) ||
                                (shared && (pyrt_fmt_is_blocked(b->sh_gate.fmt) ||
                                            pyrt_fmt_is_blocked(b->sh_up.fmt)));
            rc = pyrt_moe_ffn_routed(pool, NULL, NULL, &in, route_task, d, d->ids, d->topw, b->gud,
                                     b->gud_fmt, w->n_expert, w->n_ff_exp, n_embd, d->xn,
                                     blocked ? d->xq : NULL, w->n_expert_used, w->activation,
                                     threshold, d->y, &active);
        } else {
            run_matvec(d, pool, &in, d->xn, n_embd);
            route(d->router, w->n_expert, w->n_expert_used, w->expert_weights_norm, d->ids,
                  d->topw, d->taken);
            plan_next(pool, after);
            /* pyrt_moe_ffn takes the pool itself */
            pyrt_pool_release(pool);
            rc = pyrt_moe_ffn(pool, b->gud, b->gud_bytes, b->gud_fmt, w->n_expert, w->n_ff_exp,
                              n_embd, d->xn, 1, d->ids, d->topw, w->n_expert_used, w->activation,
                              threshold, d->y, &active);
            pyrt_pool_acquire(pool);
        }
        if (rc != PYRT_OK)
            return -1;
        moe_tail(d, pool, b, next);
        return active;
    }
    for (int i = 0; i < n_embd; i++)
        d->x[i] = d->x[i] + d->y[i] * w->residual_scale;
    return active;
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
    qkv_attn_ctx qa;
    pyrt_decoder *d;
    const pyrt_block_weights *b;
    pyrt_pf_plan after; /* the plan from ffn_ready on */
    int quantize;       /* the FFN input's Q8 blocks are read (router/shared matrices, experts) */
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
    rms_norm(d->x, c->b->ffn_norm, w->rms_eps, w->n_embd, d->xn);
    if (c->quantize)
        pyrt_quantize_x_q8(d->xn, d->xq, w->n_embd);
    pyrt_pool_plan_switch(c->qa.pool, &c->after);
    c->t_ffn = now_ns(); /* read by the caller after the run */
    atomic_store_explicit(&d->ffn_ready, 1, memory_order_release);
}

static void task_attention_then_ffn_in(void *p, int ith, int nth) {
    layer_ctx *c = p;
    task_qkv_attention(&c->qa, ith, nth);
    wait_flag(&c->d->ffn_ready, 1, c->qa.pool, ith);
}

static int layer_fusable(const pyrt_decoder *d, const pyrt_block_weights *b) {
    const int all_heads_norm = b->q_norm != NULL && b->q_norm_len == d->w.n_head * d->w.head_dim;
    return d->fuse_layer && d->fuse_attention && d->fuse_router && !all_heads_norm &&
           b->router.data != NULL;
}

/* *t_ffn: when the attention part ended (the FFN's input was ready). */
static int64_t layer_fused(pyrt_decoder *d, pyrt_pool *pool, const pyrt_block_weights *b,
                           int pos, float *kc, float *vc, size_t cap, const float *cs,
                           float threshold, const pyrt_mv_job *next, int64_t *t_ffn) {
    const pyrt_model_weights *w = &d->w;
    const int n_embd = w->n_embd;
    rms_norm(d->x, b->attn_norm, w->rms_eps, n_embd, d->xn);
    pyrt_mv_job qkv = qkv_job(d, b);
    pyrt_mv_job o = {.out = {{&b->wo, NULL, d->y, 0}}, .n_mats = 1};
    pyrt_mv_job in = ffn_in_job(d, b);
    attn_ctx ac = {.d = d, .f32 = pyrt_pool_row_ops(pool, PYRT_FMT_F32), .kc = kc, .vc = vc,
                   .cap = cap, .n_pos = pos + 1, .scale = w->attention_scale};
    atomic_init(&ac.next, 0);
    const pyrt_mv_job sh_down = {.out = {{&b->sh_down, NULL, d->ys, 0}}, .n_mats = 1};
    layer_ctx lc = {.d = d, .b = b,
                    .quantize = job_blocked(&in) || pyrt_fmt_is_blocked(b->gud_fmt)};
    pyrt_mv_job_plan(b->sh_gate.data != NULL ? &sh_down : next, &lc.after);
    plan_next(pool, &o);
    qkv_attention_setup(d, pool, b, &qkv, &ac, &o, kc, vc, cs, pos, &lc.qa);
    o.on_rows = o_rows_done;
    o.on_rows_ctx = &lc;
    atomic_store_explicit(&d->o_rows, 0, memory_order_relaxed); /* pool_run publishes them */
    atomic_store_explicit(&d->ffn_ready, 0, memory_order_relaxed);
    matvec_bind(d, pool, &in, d->xn, n_embd); /* xn, xq: made by o_rows_done */
    int64_t active = 0;
    const int rc = pyrt_moe_ffn_routed(
        pool, task_attention_then_ffn_in, &lc, &in, route_task, d, d->ids, d->topw, b->gud,
        b->gud_fmt, w->n_expert, w->n_ff_exp, n_embd, d->xn, d->xq, w->n_expert_used,
        w->activation, threshold, d->y, &active);
    *t_ffn = lc.t_ffn > 0 ? lc.t_ffn : now_ns(); /* 0: the run did not start */
    if (rc != PYRT_OK)
        return -1;
    moe_tail(d, pool, b, next);
    return active;
}

static int check_step(const pyrt_decoder *d, const pyrt_pool *pool, int token, int pos,
                      float *const *k_cache, float *const *v_cache, int cache_cap,
                      const float *thresholds, const float *logits) {
    const char *fn = "pyrt_decoder_step";
    if (d == NULL || pool == NULL || logits == NULL || k_cache == NULL || v_cache == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: %s is NULL", fn,
                         d == NULL ? "dec" : pool == NULL ? "pool" : logits == NULL ? "logits"
                                                                                    : "kv cache");
    if (token < 0 || token >= d->w.n_vocab)
        return pyrt_fail(PYRT_E_INVALID, "%s: token %d is outside [0, n_vocab=%d)", fn, token,
                         d->w.n_vocab);
    if (pos < 0 || pos >= cache_cap)
        return pyrt_fail(PYRT_E_INVALID, "%s: position %d is outside the cache [0, %d)", fn, pos,
                         cache_cap);
    for (int i = 0; i < d->w.n_layer; i++) {
        if (k_cache[i] == NULL || v_cache[i] == NULL)
            return pyrt_fail(PYRT_E_INVALID, "%s: kv cache of layer %d is NULL", fn, i);
        if (thresholds != NULL && (!(thresholds[i] >= 0.0f) || isinf(thresholds[i])))
            return pyrt_fail(PYRT_E_INVALID, "%s: threshold of layer %d must be finite and >= 0",
                             fn, i);
    }
    return PYRT_OK;
}

static int decoder_step(pyrt_decoder *d, pyrt_pool *pool, int token, int pos,
                        float *const *k_cache, float *const *v_cache, int cache_cap,
                        const float *thresholds, float *logits, int64_t *n_active);

int pyrt_decoder_step(pyrt_decoder *d, pyrt_pool *pool, int token, int pos,
                      float *const *k_cache, float *const *v_cache, int cache_cap,
                      const float *thresholds, float *logits, int64_t *n_active) {
    pyrt_clear_error();
    CHECK(check_step(d, pool, token, pos, k_cache, v_cache, cache_cap, thresholds, logits));
    if (atomic_flag_test_and_set(&d->busy))
        return pyrt_fail(PYRT_E_INVALID, "pyrt_decoder_step: this decoder is running a step on "
                                         "another thread (use one decoder per thread)");
    const int rc = decoder_step(d, pool, token, pos, k_cache, v_cache, cache_cap, thresholds,
                                logits, n_active);
    atomic_flag_clear(&d->busy);
    return rc;
}

static int decoder_step(pyrt_decoder *d, pyrt_pool *pool, int token, int pos,
                        float *const *k_cache, float *const *v_cache, int cache_cap,
                        const float *thresholds, float *logits, int64_t *n_active) {
    const pyrt_model_weights *w = &d->w;
    if (d->scores_cap < (size_t)cache_cap) {
        float *s = realloc(d->scores, (size_t)w->n_head * cache_cap * sizeof(float));
        if (s == NULL)
            return pyrt_fail(PYRT_E_NOMEM, "pyrt_decoder_step: cannot allocate attention scores");
        d->scores = s;
        d->scores_cap = (size_t)cache_cap;
    }
    /* RoPE table of this position: (cos, sin) of pos * inv_freq[i], pos * inv_freq in f32 as in
     * rope_tables (transformer.py). */
    float cs[2 * 512];
    const int half = w->rope_dim / 2;
    float *csp = half <= 512 ? cs : malloc((size_t)half * 2 * sizeof(float));
    if (csp == NULL)
        return pyrt_fail(PYRT_E_NOMEM, "pyrt_decoder_step: out of memory");
    for (int i = 0; i < half; i++) {
        const float f = (float)pos * w->rope_inv_freq[i];
        csp[2 * i] = cosf(f);
        csp[2 * i + 1] = sinf(f);
    }
    const pyrt_params *params = pyrt_pool_params(pool);
    d->fuse_attention = params->fuse_attention;
    d->fuse_router = params->fuse_router;
    d->fuse_layer = params->fuse_layer;
    int64_t t0 = now_ns();
    /* embedding row: x = token_embd[token] * embedding_scale (axpy of 1.0 onto 0 dequantizes) */
    const pyrt_matrix *emb = &w->token_embd;
    memset(d->x, 0, (size_t)w->n_embd * sizeof(float));
    pyrt_pool_row_ops(pool, emb->fmt)->axpy(
        1.0f, (const uint8_t *)emb->data + (size_t)token * pyrt_row_bytes(emb->fmt, w->n_embd),
        d->x, w->n_embd);
    for (int i = 0; i < w->n_embd; i++)
        d->x[i] *= w->embedding_scale;

    pyrt_pool_acquire(pool);
    int64_t active = 0;
    int rc = PYRT_OK;
    pyrt_mv_job out = output_job(d, logits);
    for (int l = 0; l < w->n_layer && rc == PYRT_OK; l++) {
        const pyrt_block_weights *b = &d->blocks[l];
        const pyrt_mv_job next = l + 1 < w->n_layer ? qkv_job(d, &d->blocks[l + 1]) : out;
        const float thr = thresholds != NULL ? thresholds[l] : 0.0f;
        int64_t a;
        int64_t t1 = t0;
        if (layer_fusable(d, b)) { /* one task: split where the FFN's input was ready */
            a = layer_fused(d, pool, b, pos, k_cache[l], v_cache[l], (size_t)cache_cap, csp, thr,
                            &next, &t1);
            d->times[0] += t1 - t0;
        } else {
            attention_block(d, pool, b, pos, k_cache[l], v_cache[l], (size_t)cache_cap, csp);
            t1 = now_ns();
            d->times[0] += t1 - t0;
            a = ffn_block(d, pool, b, thr, &next);
        }
        if (a < 0)
            rc = PYRT_E_INVALID; /* pyrt_moe_ffn's message stays in last_error */
        active += a;
        t0 = now_ns();
        d->times[1] += t0 - t1;
    }
    if (rc == PYRT_OK) {
        rms_norm(d->x, w->output_norm, w->rms_eps, w->n_embd, d->xn);
        const pyrt_mv_job first = qkv_job(d, &d->blocks[0]); /* the next step's */
        plan_next(pool, &first);
        run_matvec(d, pool, &out, d->xn, w->n_embd);
        d->times[2] += now_ns() - t0;
        d->times[3] += 1;
    }
    pyrt_pool_release(pool);
    if (csp != cs)
        free(csp);
    if (n_active != NULL)
        *n_active = rc == PYRT_OK ? active : 0;
    return rc;
}

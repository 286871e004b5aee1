/* The FFN half of a block for a chunk of tokens (the prefill), with the math of a step's
 * (decode_ffn.c) per token: x += ffn(rms_norm(x) * ffn_norm) * residual_scale, ffn the routed
 * experts (router softmax, top-k, renormalized weights; pyrt_moe_batch, each expert once for its
 * tokens; with gpt-oss's router and expert biases and clamped SwiGLU where the model has them)
 * plus a shared expert (times sigmoid(h . g_shexp) where the model gates it), or a dense FFN
 * down(act(gate h) * up h). Every matrix product takes the chunk's tokens at once. */
#include <math.h>
#include <string.h>

#include "activation.h"
#include "llama4.h"
#include "prefill.h"

typedef struct {
    const pyrt_chunk *c;
    const pyrt_block_weights *blk;
    int k, n_ff;
    const pyrt_ffn_io *io;
} ffn_ctx;

/* gate[t] = act(gate[t]) * up[t] over n_ff, as the hidden of the next product. */
static void hidden_row(void *p, int64_t t, int ith) {
    (void)ith;
    const ffn_ctx *f = p;
    const pyrt_prefill_buf *b = f->c->b;
    const int act = f->c->d->w.activation;
    float *g = b->gate + (size_t)t * b->in_stride;
    const float *u = b->up + (size_t)t * b->in_stride;
    for (int j = 0; j < f->n_ff; j++)
        g[j] = pyrt_activate(act, g[j]) * u[j];
}

/* The down product of the hidden in gate (n_ff wide) into ys. */
static void down(const ffn_ctx *f, const pyrt_matrix *m) {
    const pyrt_chunk *c = f->c;
    const pyrt_prefill_buf *b = c->b;
    pyrt_pool_for(c->pool, c->n, 4, hidden_row, (void *)f);
    pyrt_mv_job job = {.out = {{m, NULL, b->ys, (size_t)c->d->w.n_embd}}, .n_mats = 1};
    if (pyrt_mv_job_xq(&job) != PYRT_XQ_NONE)
        pyrt_prefill_quantize(c, pyrt_mv_job_xq(&job), b->gate, b->in_stride, f->n_ff);
    pyrt_prefill_matmul(c, &job, b->gate, b->in_stride);
}

/* One token's routing: softmax and top k of its router logits (the last token's logits first
 * copied out when asked), and what the experts' dots read for it. */
static void route_row(void *p, int64_t t, int ith) {
    const ffn_ctx *f = p;
    const pyrt_decoder *d = f->c->d;
    const pyrt_prefill_buf *b = f->c->b;
    const int n_expert = d->w.n_expert;
    float *logits = b->router + (size_t)t * n_expert;
    if (t == f->c->n - 1 && f->io->route_logits != NULL)
        memcpy(f->io->route_logits, logits, (size_t)n_expert * sizeof *logits);
    if (d->w.expert_input_weight)
        pyrt_route_sigmoid(logits, n_expert, f->k, b->ids + (size_t)t * f->k,
                           b->w + (size_t)t * f->k, b->taken + (size_t)ith * n_expert);
    else
        pyrt_route_topk(logits, &d->w, f->k, b->ids + (size_t)t * f->k,
                        b->w + (size_t)t * f->k, b->taken + (size_t)ith * n_expert);
}

/* The shared expert's gate, sigmoid(xn . g_shexp), per token (before xn is overwritten). */
static void shared_gate_row(void *p, int64_t t, int ith) {
    (void)ith;
    const ffn_ctx *f = p;
    const pyrt_chunk *c = f->c;
    const pyrt_prefill_buf *b = c->b;
    const float z = pyrt_pool_row_ops(c->pool, PYRT_FMT_F32)
                        ->dot(f->blk->sh_gate_inp.data, b->xn + (size_t)t * b->in_stride,
                              c->d->w.n_embd);
    b->gs[t] = 1.0f / (1.0f + expf(-z));
}

typedef struct {
    const pyrt_chunk *c;
    int shared, gated;
} tail_ctx;

/* y += ys * gs (the shared expert), then x += y * residual_scale. */
static void tail_row(void *p, int64_t t, int ith) {
    (void)ith;
    const tail_ctx *r = p;
    const pyrt_prefill_buf *b = r->c->b;
    const pyrt_model_weights *w = &r->c->d->w;
    const int n = w->n_embd;
    float *x = b->x + (size_t)t * n, *y = b->y + (size_t)t * n;
    const float *ys = b->ys + (size_t)t * n;
    if (r->shared) {
        const float gs = r->gated ? b->gs[t] : 1.0f;
        for (int i = 0; i < n; i++)
            y[i] = y[i] + ys[i] * gs;
    }
    for (int i = 0; i < n; i++)
        x[i] = x[i] + y[i] * w->residual_scale;
}

static void dense_layer(const ffn_ctx *f, pyrt_ffn_io *io) {
    const pyrt_chunk *c = f->c;
    const pyrt_prefill_buf *b = c->b;
    const pyrt_block_weights *blk = f->blk;
    pyrt_mv_job in = {.out = {{&blk->ffn_gate, NULL, b->gate, b->in_stride},
                              {&blk->ffn_up, NULL, b->up, b->in_stride}},
                      .n_mats = 2};
    pyrt_prefill_norm(c, b->x, blk->ffn_norm.data, pyrt_mv_job_xq(&in));
    pyrt_prefill_matmul(c, &in, b->xn, b->in_stride);
    down(f, &blk->ffn_down);
    memcpy(b->y, b->ys, (size_t)c->n * c->d->w.n_embd * sizeof(float));
    tail_ctx r = {.c = c};
    pyrt_pool_for(c->pool, c->n, 4, tail_row, &r);
    /* a dense-FFN layer's routing outputs: no experts chosen (-1), no router logits (NaN) */
    if (io->route_ids != NULL)
        for (int j = 0; j < io->k; j++)
            io->route_ids[j] = -1;
    if (io->route_logits != NULL)
        for (int e = 0; e < c->d->w.n_expert; e++)
            io->route_logits[e] = NAN;
}

int pyrt_prefill_ffn(const pyrt_chunk *c, int layer, pyrt_ffn_io *io) {
    pyrt_decoder *d = c->d;
    const pyrt_model_weights *w = &d->w;
    const pyrt_prefill_buf *b = c->b;
    const pyrt_block_weights *blk = &d->blocks[layer];
    ffn_ctx f = {.c = c, .blk = blk, .k = io->k, .io = io};
    if (blk->router.data == NULL) {
        f.n_ff = blk->ffn_gate.n_out;
        dense_layer(&f, io);
        return PYRT_OK;
    }
    const int shared = blk->sh_gate.data != NULL;
    pyrt_mv_job in = {.out = {{&blk->router, blk->router_bias.data, b->router,
                               (size_t)w->n_expert},
                              {&blk->sh_gate, NULL, b->gate, b->in_stride},
                              {&blk->sh_up, NULL, b->up, b->in_stride}},
                      .n_mats = shared ? 3 : 1};
    const int experts_blocked = pyrt_fmt_is_blocked(blk->gud_fmt);
    pyrt_prefill_norm(c, b->x, blk->ffn_norm.data,
                      pyrt_xq_join(pyrt_mv_job_xq(&in), pyrt_fmt_xq(blk->gud_fmt)));
    pyrt_prefill_matmul(c, &in, b->xn, b->in_stride);
    if (shared && blk->sh_gate_inp.data != NULL)
        pyrt_pool_for(c->pool, c->n, 8, shared_gate_row, &f);
    pyrt_pool_for(c->pool, c->n, 4, route_row, &f);
    if (io->route_ids != NULL)
        memcpy(io->route_ids, b->ids + (size_t)(c->n - 1) * io->k, (size_t)io->k * sizeof(int32_t));
    for (int t = 0; t < c->n; t++)
        b->xv[t] = experts_blocked ? (const void *)(b->xq + (size_t)t * b->q_stride)
                                   : (const void *)(b->xn + (size_t)t * b->in_stride);
    const pyrt_ffn_io io_in = *io;
    const pyrt_experts experts = pyrt_decode_experts(d, blk, &io_in);
    int64_t n_active = 0, n_pairs = 0;
    const int rc =
        w->expert_input_weight /* llama4: the weight on each expert's input */
            ? pyrt_prefill_input_weighted(c, &experts, io->k, io->threshold, &n_active, &n_pairs)
            : pyrt_moe_batch(c->pool, &c->b->moe, &experts, c->n, b->xv, b->ids, b->w, io->k,
                             w->activation, io->threshold, b->y, &n_active, &n_pairs);
    if (rc != PYRT_OK)
        return rc;
    io->n_active += n_active;
    io->n_pairs += n_pairs;
    if (shared) {
        f.n_ff = blk->sh_gate.n_out;
        down(&f, &blk->sh_down);
    }
    tail_ctx r = {.c = c, .shared = shared, .gated = blk->sh_gate_inp.data != NULL};
    pyrt_pool_for(c->pool, c->n, 4, tail_row, &r);
    return PYRT_OK;
}

/* The FFN half of a block for one token: x += ffn(rms_norm(x) * ffn_norm) * residual_scale, where
 * ffn is the routed experts (router softmax, top-k, renormalized weights, pyrt_moe_ffn's kernel)
 * plus a shared expert (times sigmoid(h . g_shexp) where the model gates it), or a dense FFN
 * down(act(gate h) * up h). The router, routing and experts are one pool task by default
 * (pyrt_moe_ffn_routed); the same bits as the router's own run followed by pyrt_moe_ffn. */
#include <math.h>
#include <string.h>

#include "activation.h"
#include "decoder.h"
#include "vec.h"

/* p = softmax(logits) over the experts; ids/w = the k largest (ties: lower id first), renormalized
 * to sum 1 when asked (docs/gguf-layout.md, "Routing"). taken: [n_expert] scratch. */
static void route(float *p, int n_expert, int k, int renorm, int32_t *ids, float *w,
                  uint8_t *taken) {
    pyrt_softmax(p, n_expert);
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

void pyrt_decode_route(void *ctx, int32_t *ids, float *w) {
    pyrt_decoder *d = ctx;
    route(d->router, d->w.n_expert, d->w.n_expert_used, d->w.expert_weights_norm, ids, w,
          d->taken);
}

pyrt_mv_job pyrt_decode_ffn_in_job(const pyrt_decoder *d, const pyrt_block_weights *b) {
    if (b->router.data == NULL)
        return (pyrt_mv_job){.out = {{&b->ffn_gate, NULL, d->gate, 0}, {&b->ffn_up, NULL, d->up, 0}},
                             .n_mats = 2};
    return (pyrt_mv_job){.out = {{&b->router, NULL, d->router, 0},
                                 {&b->sh_gate, NULL, d->gate, 0},
                                 {&b->sh_up, NULL, d->up, 0}},
                         .n_mats = b->sh_gate.data != NULL ? 3 : 1};
}

/* d->ys = down(act(gate) * up), gate and up already in d->gate / d->up [n_ff]; `next`: the
 * matvec after it (prefetch plan). */
static void ffn_down(pyrt_decoder *d, pyrt_pool *pool, const pyrt_matrix *down, int n_ff,
                     const pyrt_mv_job *next) {
    for (int j = 0; j < n_ff; j++)
        d->gate[j] = pyrt_activate(d->w.activation, d->gate[j]) * d->up[j];
    pyrt_mv_job job = {.out = {{down, NULL, d->ys, 0}}, .n_mats = 1};
    pyrt_pool_plan_job(pool, next);
    pyrt_mv_run(&job, pool, d->gate, n_ff, d->xq);
}

void pyrt_decode_moe_tail(pyrt_decoder *d, pyrt_pool *pool, const pyrt_block_weights *b,
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

int64_t pyrt_decode_ffn(pyrt_decoder *d, pyrt_pool *pool, const pyrt_block_weights *b,
                        float threshold, const pyrt_mv_job *next) {
    const pyrt_model_weights *w = &d->w;
    const int n_embd = w->n_embd;
    pyrt_rms_norm(d->x, b->ffn_norm, w->rms_eps, n_embd, d->xn);
    int64_t active = 0;
    pyrt_mv_job in = pyrt_decode_ffn_in_job(d, b);
    if (b->router.data == NULL) { /* dense FFN layer */
        const pyrt_mv_job down = {.out = {{&b->ffn_down, NULL, d->ys, 0}}, .n_mats = 1};
        pyrt_pool_plan_job(pool, &down);
        pyrt_mv_run(&in, pool, d->xn, n_embd, d->xq);
        ffn_down(d, pool, &b->ffn_down, b->ffn_gate.n_out, next);
        memcpy(d->y, d->ys, (size_t)n_embd * sizeof(float));
        for (int i = 0; i < n_embd; i++)
            d->x[i] = d->x[i] + d->y[i] * w->residual_scale;
        return active;
    }
    const int shared = b->sh_gate.data != NULL;
    /* The routed experts' rows are known only after the router. Its run gets the plan of the
     * experts' run (the shared down or the next block's q/k/v): the threads' wait at its end and
     * through top-k and pyrt_moe_ffn's set-up (the DRAM idled there) start on it, and the
     * experts' run goes on from where they stopped (same plan: pool.c). */
    const pyrt_mv_job sh_down = {.out = {{&b->sh_down, NULL, d->ys, 0}}, .n_mats = 1};
    const pyrt_mv_job *after = shared ? &sh_down : next;
    pyrt_pool_plan_job(pool, after);
    int rc;
    if (d->fuse_router) {
        /* one task: router rows, routing by the thread that completes them, experts */
        pyrt_mv_job_setup(&in, pool, d->xn, n_embd, d->xq);
        const int blocked = pyrt_fmt_is_blocked(b->router.fmt) ||
                            (shared && (pyrt_fmt_is_blocked(b->sh_gate.fmt) ||
                                        pyrt_fmt_is_blocked(b->sh_up.fmt)));
        rc = pyrt_moe_ffn_routed(pool, NULL, NULL, &in, pyrt_decode_route, d, d->ids, d->topw,
                                 b->gud, b->gud_fmt, w->n_expert, w->n_ff_exp, n_embd, d->xn,
                                 blocked ? d->xq : NULL, w->n_expert_used, w->activation,
                                 threshold, d->y, &active);
    } else {
        pyrt_mv_run(&in, pool, d->xn, n_embd, d->xq);
        route(d->router, w->n_expert, w->n_expert_used, w->expert_weights_norm, d->ids, d->topw,
              d->taken);
        pyrt_pool_plan_job(pool, after);
        /* pyrt_moe_ffn takes the pool itself */
        pyrt_pool_release(pool);
        rc = pyrt_moe_ffn(pool, b->gud, b->gud_bytes, b->gud_fmt, w->n_expert, w->n_ff_exp,
                          n_embd, d->xn, 1, d->ids, d->topw, w->n_expert_used, w->activation,
                          threshold, d->y, &active);
        pyrt_pool_acquire(pool);
    }
    if (rc != PYRT_OK)
        return -1;
    pyrt_decode_moe_tail(d, pool, b, next);
    return active;
}

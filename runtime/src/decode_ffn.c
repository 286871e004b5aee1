/* The FFN half of a block for one token: x += ffn(rms_norm(x) * ffn_norm) * residual_scale, where
 * ffn is the routed experts (router softmax, top-k, renormalized weights, pyrt_moe_ffn's kernel)
 * plus a shared expert (times sigmoid(h . g_shexp) where the model gates it), or a dense FFN
 * down(act(gate h) * up h). The router, routing and experts are one pool task by default
 * (pyrt_moe_ffn_routed); the same bits as the router's own run followed by pyrt_moe_ffn. A
 * llama4 model routes by sigmoid weights on the experts' inputs (llama4.c): the router's run,
 * then one expert run per top-k slot. */
#include <math.h>
#include <string.h>

#include "activation.h"
#include "decoder.h"
#include "llama4.h"
#include "vec.h"

/* With groups (deepseek2): every expert outside the n_used groups whose best probability is
 * highest (ties: lower group first) is marked taken, so top-k picks within those groups only. */
static void mark_groups_out(const float *p, int n_expert, int groups, int n_used,
                            uint8_t *taken) {
    const int per = n_expert / groups;
    float best[PYRT_MAX_EXPERT_GROUPS];
    for (int g = 0; g < groups; g++) {
        best[g] = p[g * per];
        for (int e = g * per + 1; e < (g + 1) * per; e++)
            best[g] = p[e] > best[g] ? p[e] : best[g];
    }
    uint8_t keep[PYRT_MAX_EXPERT_GROUPS] = {0};
    for (int j = 0; j < n_used; j++) {
        int top = -1;
        for (int g = 0; g < groups; g++)
            if (!keep[g] && (top < 0 || best[g] > best[top]))
                top = g;
        keep[top] = 1;
    }
    for (int e = 0; e < n_expert; e++)
        taken[e] = !keep[e / per];
}

void pyrt_route_topk(float *p, const pyrt_model_weights *m, int k, int32_t *ids, float *w,
                     uint8_t *taken) {
    const int n_expert = m->n_expert;
    pyrt_softmax(p, n_expert);
    if (m->expert_groups > 1)
        mark_groups_out(p, n_expert, m->expert_groups, m->expert_groups_used, taken);
    else
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
    if (m->expert_weights_norm)
        for (int j = 0; j < k; j++)
            w[j] /= sum;
    if (m->expert_weights_scale != 0.0f && m->expert_weights_scale != 1.0f)
        for (int j = 0; j < k; j++)
            w[j] *= m->expert_weights_scale;
}

void pyrt_decode_route(void *ctx, int32_t *ids, float *w) {
    pyrt_decoder *d = ctx;
    if (d->route_logits != NULL)
        memcpy(d->route_logits, d->router, (size_t)d->w.n_expert * sizeof(float));
    if (d->w.expert_input_weight) { /* llama4 */
        pyrt_route_sigmoid(d->router, d->w.n_expert, d->route_k, ids, w, d->taken);
        return;
    }
    pyrt_route_topk(d->router, &d->w, d->route_k, ids, w, d->taken);
}

pyrt_ffn_io pyrt_decode_ffn_io(const pyrt_decoder *d, const pyrt_expert_args *e,
                               int32_t *route_ids, float *route_logits, int layer) {
    const int k = e->k > 0 ? e->k : d->w.n_expert_used;
    return (pyrt_ffn_io){
        .threshold = e->thresholds != NULL ? e->thresholds[layer] : 0.0f,
        .k = k,
        .expert_map = e->maps != NULL ? e->maps[layer] : NULL,
        .route_ids = route_ids != NULL ? route_ids + (size_t)layer * k : NULL,
        .route_logits = route_logits != NULL ? route_logits + (size_t)layer * d->w.n_expert : NULL,
    };
}

pyrt_experts pyrt_decode_experts(const pyrt_decoder *d, const pyrt_block_weights *b,
                                 const pyrt_ffn_io *io) {
    return (pyrt_experts){.data = b->gud, .bytes = b->gud_bytes, .fmt = b->gud_fmt,
                          .gates = b->gud_gates, .gates_bytes = b->gud_gates_bytes,
                          .n_expert = d->w.n_expert, .n_slots = d->w.n_expert,
                          .n_ff = d->w.n_ff_exp, .n_embd = d->w.n_embd,
                          .expert_map = io->expert_map, .bias_gu = b->exp_bias_gu.data,
                          .bias_gu_len = b->exp_bias_gu.n, .bias_down = b->exp_bias_down.data,
                          .bias_down_len = b->exp_bias_down.n, .swiglu_alpha = d->w.swiglu_alpha,
                          .swiglu_limit = d->w.swiglu_limit};
}

void pyrt_decode_route_begin(pyrt_decoder *d, const pyrt_ffn_io *io) {
    d->route_k = io->k;
    d->route_logits = io->route_logits;
}

void pyrt_decode_route_end(pyrt_decoder *d, pyrt_ffn_io *io) {
    if (io->route_ids != NULL)
        memcpy(io->route_ids, d->ids, (size_t)io->k * sizeof *d->ids);
    io->n_pairs = io->k;
    if (io->expert_map != NULL)
        for (int j = 0; j < io->k; j++)
            io->n_pairs -= io->expert_map[d->ids[j]] < 0;
}

/* A dense-FFN layer's routing outputs: no experts chosen (-1), no router logits (NaN). */
static void no_routing(const pyrt_decoder *d, pyrt_ffn_io *io) {
    if (io->route_ids != NULL)
        for (int j = 0; j < io->k; j++)
            io->route_ids[j] = -1;
    if (io->route_logits != NULL)
        for (int e = 0; e < d->w.n_expert; e++)
            io->route_logits[e] = NAN;
    io->n_active = io->n_pairs = 0;
}

pyrt_mv_job pyrt_decode_ffn_in_job(const pyrt_decoder *d, const pyrt_block_weights *b) {
    if (b->router.data == NULL)
        return (pyrt_mv_job){
            .out = {{&b->ffn_gate, NULL, d->gate, 0}, {&b->ffn_up, NULL, d->up, 0}},
            .n_mats = 2};
    return (pyrt_mv_job){.out = {{&b->router, b->router_bias.data, d->router, 0},
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
        if (b->sh_gate_inp.data != NULL) {
            const float z = pyrt_pool_row_ops(pool, PYRT_FMT_F32)->dot(b->sh_gate_inp.data, d->xn,
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

int pyrt_decode_ffn(pyrt_decoder *d, pyrt_pool *pool, const pyrt_block_weights *b,
                    pyrt_ffn_io *io, const pyrt_mv_job *next) {
    const pyrt_model_weights *w = &d->w;
    const int n_embd = w->n_embd;
    pyrt_rms_norm(d->x, b->ffn_norm.data, w->rms_eps, n_embd, d->xn);
    pyrt_mv_job in = pyrt_decode_ffn_in_job(d, b);
    if (b->router.data == NULL) { /* dense FFN layer */
        no_routing(d, io);
        const pyrt_mv_job down = {.out = {{&b->ffn_down, NULL, d->ys, 0}}, .n_mats = 1};
        pyrt_pool_plan_job(pool, &down);
        pyrt_mv_run(&in, pool, d->xn, n_embd, d->xq);
        ffn_down(d, pool, &b->ffn_down, b->ffn_gate.n_out, next);
        memcpy(d->y, d->ys, (size_t)n_embd * sizeof(float));
        for (int i = 0; i < n_embd; i++)
            d->x[i] = d->x[i] + d->y[i] * w->residual_scale;
        return PYRT_OK;
    }
    const int shared = b->sh_gate.data != NULL;
    const pyrt_experts experts = pyrt_decode_experts(d, b, io);
    /* The routed experts' rows are known only after the router. Its run gets the plan of the
     * experts' run (the shared down or the next block's q/k/v): the threads' wait at its end and
     * through top-k and pyrt_moe_ffn's set-up (the DRAM idled there) start on it, and the
     * experts' run goes on from where they stopped (same plan: pool_prefetch.c). */
    const pyrt_mv_job sh_down = {.out = {{&b->sh_down, NULL, d->ys, 0}}, .n_mats = 1};
    const pyrt_mv_job *after = shared ? &sh_down : next;
    pyrt_pool_plan_job(pool, after);
    pyrt_decode_route_begin(d, io);
    int rc;
    if (d->fuse_router && !w->expert_input_weight) {
        /* one task: router rows, routing by the thread that completes them, experts */
        /* x quantized once for the router / shared matrices and the experts */
        const int xq = pyrt_xq_join(pyrt_mv_job_xq(&in), pyrt_fmt_xq(b->gud_fmt));
        pyrt_quantize_x_for(xq, d->xn, d->xq, n_embd);
        pyrt_mv_job_bind(&in, pool, d->xn, n_embd, d->xq);
        rc = pyrt_moe_ffn_routed(pool, NULL, NULL, &in, pyrt_decode_route, d, d->ids, d->topw,
                                 &experts, d->xn, xq ? d->xq : NULL, io->k, w->activation,
                                 io->threshold, d->y, &io->n_active);
    } else {
        pyrt_mv_run(&in, pool, d->xn, n_embd, d->xq);
        pyrt_decode_route(d, d->ids, d->topw);
        pyrt_pool_plan_job(pool, after);
        /* pyrt_moe_ffn takes the pool itself */
        pyrt_pool_release(pool);
        if (w->expert_input_weight) /* llama4: the weight on each expert's input */
            rc = pyrt_decode_input_weighted(d, pool, &experts, io);
        else
            rc = pyrt_moe_ffn(pool, &experts, d->xn, 1, d->ids, d->topw, io->k, w->activation,
                              io->threshold, d->y, &io->n_active);
        pyrt_pool_acquire(pool);
    }
    if (rc != PYRT_OK)
        return rc;
    pyrt_decode_route_end(d, io);
    pyrt_decode_moe_tail(d, pool, b, next);
    return PYRT_OK;
}

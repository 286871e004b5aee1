/* pyrt_moe_ffn: one MoE layer's routed experts on the CPU, dense or neuron-sparse.
 *
 * Work split. Tokens are processed in blocks of up to TOKEN_BLOCK. Inside a block the (token,
 * expert) routes are grouped by expert, so an expert's rows are read from DRAM once per block and
 * reused from L1 for every token routed to it. The neurons of all used experts form one list
 * (expert-major, so a work item walks contiguous memory), cut into work items by estimated cost,
 * guided (sizes shrinking from half a thread's share to a sixteenth; plan_items): batch 1 with
 * top-8 puts every thread to work even when nth > 8. Threads take items from a shared counter, so
 * a preempted or slower core delays the call by one item, not by a fixed 1/nth share. Each item
 * accumulates into its own partial y; in the same pool task, threads out of items sum them per
 * range of y in item order as the items complete, so the result does not depend on thread timing
 * (sparse with threshold 0 equals dense bit for bit, and a rerun gives the same bits). One pool
 * hand-off per token block.
 *
 * Where the used experts have BATCH_MIN_ROUTES routes each on average, a call runs the
 * prefill's kernel instead (pyrt_moe_batch: each expert's rows in tiles against all its tokens,
 * not one token's dots at a time), its buffers on the pool's second workspace, kept between calls
 * (run_batch): the hybrid's CPU share of a prefill comes here. Measured
 * (olmoe-1b-7b Q8_0 / Q4_K, 2 threads, bench/cpu_experts.py, pyrt_moe_batch's time over the
 * token blocks'): 2 routes an expert 1.68x, 8 1.26x, 16 0.75-0.88x, 32 0.60x, 64 0.76x.
 *
 * This file: the API (argument checks, the route), the token blocks' context on the pool's
 * workspace, the pool tasks and the reduce; moe_plan.c plans a token block, moe_neurons.c computes
 * the items. */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "moe_batch.h"
#include "moe_ctx.h"

enum { BATCH_MIN_ROUTES = 16 }; /* routes per used expert from which pyrt_moe_batch runs */

/* ---- tasks --------------------------------------------------------------------------------- */

/* The activations' Q8 blocks, QUANTIZE_TOKENS tokens per claim (next_item: reset before). */
static void task_quantize(void *p, int ith, int nth) {
    (void)ith;
    (void)nth;
    moe_ctx *c = p;
    const size_t nb = pyrt_xq_units((size_t)c->n_embd);
    for (int t0; (t0 = atomic_fetch_add_explicit(c->next_item, QUANTIZE_TOKENS,
                                                 memory_order_relaxed)) < c->n_tokens;) {
        const int t1 = c->n_tokens - t0 < QUANTIZE_TOKENS ? c->n_tokens : t0 + QUANTIZE_TOKENS;
        for (int t = t0; t < t1; t++)
            pyrt_quantize_x_for(c->xq_kind, c->x + (size_t)t * c->n_embd,
                                c->xq + (size_t)t * nb, c->n_embd);
    }
}

/* One token block in one hand-off to the pool. (1) Threads take work items from a shared
 * counter: a thread that the OS preempts or that runs on a busier core delays the block by one
 * item, not by its whole share. (2) A thread out of items takes one of nth - 1 ranges of y at a
 * time (while some are left) and sums the items' partial ys there in item order, each item as
 * soon as it is done: the sums run while the last items are computed, and the result does not
 * depend on which thread ran which item. */
static void task_block(void *p, int ith, int nth) {
    moe_ctx *c = p;
    c->active[(size_t)ith * 8] += pyrt_moe_run_items(c);
    const int n_ranges = nth > 1 ? nth - 1 : 1;
    for (int range; (range = atomic_fetch_add_explicit(c->next_slice, 1, memory_order_relaxed)) <
                    n_ranges;) {
        /* whole cache lines (16 floats) per range */
        const size_t n = (size_t)c->tb * c->n_embd, lines = (n + 15) / 16;
        const size_t lo = lines * range / n_ranges * 16;
        const size_t end = lines * (range + 1) / n_ranges * 16;
        const size_t hi = end < n ? end : n;
        float *y = c->y + (size_t)c->t0 * c->n_embd;
        int pf_next = 0; /* the next item whose part of the range is not prefetched */
        for (int item = 0; item < c->n_items; item++) {
            pyrt_pool_wait_flag(c->pool, &c->item_done[item], 1, ith);
            /* The partial ys sit in the caches of the cores that made them: ask for the ranges
             * of the done items up to reduce_pf on, so the remote reads overlap (at the end of a
             * call every item is done and the sums are a chain of ~100 such reads). */
            pf_next = pf_next > item ? pf_next : item + 1;
            for (; pf_next < c->n_items && pf_next - item <= c->reduce_pf &&
                   atomic_load_explicit(&c->item_done[pf_next], memory_order_relaxed);
                 pf_next++)
                pyrt_moe_prefetch(c->acc + (size_t)pf_next * c->acc_stride + lo,
                                  (hi - lo) * sizeof *y);
            const float *acc = c->acc + (size_t)item * c->acc_stride;
            if (item == 0)
                memcpy(y + lo, acc + lo, (hi - lo) * sizeof *y);
            else
                c->ops_add(y + lo, acc + lo, hi - lo);
        }
    }
}

/* ---- entry point --------------------------------------------------------------------------- */

/* The experts' shape, format, size and alignment (not the map's values: per pair, below). */
static int check_experts(const pyrt_experts *e, const char *fn) {
    if (e->data == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: experts->data (the expert weights) is NULL", fn);
    if (!pyrt_fmt_known(e->fmt))
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: unknown weight format %d (supported: %s)", fn, e->fmt,
                         PYRT_FMT_NAMES);
    if (e->n_expert < 1 || e->n_slots < 0 || e->n_ff < 1 || e->n_embd < 1)
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: sizes must be positive (n_slots >= 0): n_expert=%d n_slots=%d "
                         "n_ff=%d n_embd=%d", fn, e->n_expert, e->n_slots, e->n_ff, e->n_embd);
    if (e->expert_map == NULL && e->n_slots != e->n_expert)
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: n_slots=%d but n_expert=%d: without an expert_map the weights hold "
                         "every expert", fn, e->n_slots, e->n_expert);
    const size_t rb = pyrt_row_bytes(e->fmt, e->n_embd);
    if (rb == 0)
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: n_embd=%d is not a multiple of %d, which format %d (quantized in "
                         "blocks of %d) needs", fn, e->n_embd, pyrt_fmt_block(e->fmt), e->fmt,
                         pyrt_fmt_block(e->fmt));
    const double need = (double)e->n_slots * e->n_ff * 3.0 * (double)rb;
    if (need != (double)e->bytes)
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: weights hold %zu bytes but n_slots=%d x n_ff=%d x 3 rows x %zu "
                         "bytes/row need %.0f: wrong shape or format for this tensor",
                         fn, e->bytes, e->n_slots, e->n_ff, rb, need);
    if (pyrt_check_weights_aligned(fn, e->data, e->fmt) != PYRT_OK)
        return PYRT_E_INVALID;
    if (e->gates != NULL) {
        const double gates = (double)e->n_slots * e->n_ff * (double)rb;
        if (gates != (double)e->gates_bytes)
            return pyrt_fail(PYRT_E_INVALID,
                             "%s: gates hold %zu bytes but n_slots=%d x n_ff=%d x %zu bytes/row "
                             "need %.0f", fn, e->gates_bytes, e->n_slots, e->n_ff, rb, gates);
        if (pyrt_check_weights_aligned(fn, e->gates, e->fmt) != PYRT_OK)
            return PYRT_E_INVALID;
    }
    if ((uintptr_t)e->expert_map % 4)
        return pyrt_fail(PYRT_E_INVALID, "%s: expert_map must be 4-byte aligned", fn);
    if ((e->bias_gu == NULL) != (e->bias_down == NULL))
        return pyrt_fail(PYRT_E_INVALID, "%s: bias_gu and bias_down go together (both or none)",
                         fn);
    if ((uintptr_t)e->bias_gu % 4 || (uintptr_t)e->bias_down % 4)
        return pyrt_fail(PYRT_E_INVALID, "%s: bias_gu and bias_down must be 4-byte aligned", fn);
    if (e->bias_gu != NULL) {
        const int64_t gu = (int64_t)e->n_slots * e->n_ff * 2;
        const int64_t down = (int64_t)e->n_slots * e->n_embd;
        if (e->bias_gu_len < gu || e->bias_down_len < down)
            return pyrt_fail(PYRT_E_INVALID,
                             "%s: bias_gu holds %lld floats and bias_down %lld, but n_slots=%d x "
                             "n_ff=%d x 2 = %lld and n_slots x n_embd=%d = %lld are read", fn,
                             (long long)e->bias_gu_len, (long long)e->bias_down_len, e->n_slots,
                             e->n_ff, (long long)gu, e->n_embd, (long long)down);
    }
    return PYRT_OK;
}

int pyrt_check_activation(int activation, float alpha, float limit, const char *fn) {
    if (activation < PYRT_ACT_SILU || activation > PYRT_ACT_SWIGLU_OAI)
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: unknown activation %d (0 silu, 1 gelu tanh, 2 gelu erf, 3 swiglu "
                         "oai)", fn, activation);
    if (activation == PYRT_ACT_SWIGLU_OAI && !(limit > 0.0f && isfinite(limit) && isfinite(alpha)))
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: swiglu oai needs a finite alpha and limit > 0, got %g and %g", fn,
                         (double)alpha, (double)limit);
    return PYRT_OK;
}

static int check_args(const pyrt_pool *pool, const pyrt_experts *e, const float *x, int n_tokens,
                      const int32_t *topk_ids, const float *topk_w, int k, int activation,
                      float threshold, const float *y) {
    const char *fn = "pyrt_moe_ffn";
    if (pool == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: pool is NULL (create one with pyrt_pool_create)", fn);
    if (e == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: experts is NULL", fn);
    if (x == NULL || topk_ids == NULL || topk_w == NULL || y == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: %s is NULL", fn,
                         x == NULL ? "x" : topk_ids == NULL ? "topk_ids"
                                        : topk_w == NULL   ? "topk_w"
                                                           : "y");
    int rc = check_experts(e, fn);
    if (rc != PYRT_OK)
        return rc;
    if (k < 1 || n_tokens < 0)
        return pyrt_fail(PYRT_E_INVALID, "%s: k=%d must be positive and n_tokens=%d >= 0", fn, k,
                         n_tokens);
    if ((uintptr_t)x % 4 || (uintptr_t)y % 4 || (uintptr_t)topk_w % 4 || (uintptr_t)topk_ids % 4)
        return pyrt_fail(PYRT_E_INVALID, "%s: x, y, topk_ids, topk_w must be 4-byte aligned", fn);
    rc = pyrt_check_activation(activation, e->swiglu_alpha, e->swiglu_limit, fn);
    if (rc != PYRT_OK)
        return rc;
    if (!(threshold >= 0.0f) || isinf(threshold))
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: threshold must be finite and >= 0 (0 = dense), got %g", fn,
                         (double)threshold);
    for (int64_t i = 0; i < (int64_t)n_tokens * k; i++) {
        const int32_t id = topk_ids[i];
        if (id < 0 || id >= e->n_expert)
            return pyrt_fail(PYRT_E_INVALID,
                             "%s: topk_ids[%lld, %lld] = %d is outside [0, n_expert=%d)", fn,
                             (long long)(i / k), (long long)(i % k), (int)id, e->n_expert);
        if (e->expert_map != NULL && (e->expert_map[id] < -1 || e->expert_map[id] >= e->n_slots))
            return pyrt_fail(PYRT_E_INVALID,
                             "%s: expert_map[%d] = %d is outside [-1, n_slots=%d)", fn, (int)id,
                             (int)e->expert_map[id], e->n_slots);
    }
    return PYRT_OK;
}

/* Fills *c for a call over n_tokens tokens on the pool's workspace (the caller holds the pool).
 * The activations are not quantized yet (c->xv unset). */
static int moe_setup(moe_ctx *c, pyrt_pool *pool, const pyrt_experts *e, const float *x,
                     int n_tokens, const int32_t *topk_ids, const float *topk_w, int k,
                     int activation, float threshold, float *y) {
    const int fmt = e->fmt, n_embd = e->n_embd;
    const int quantized = pyrt_fmt_is_blocked(fmt);
    const int nth = pyrt_pool_threads(pool);
    const int tb_max = n_tokens < TOKEN_BLOCK ? n_tokens : TOKEN_BLOCK;
    const int routes = tb_max * k;
    const int used_max = routes < e->n_slots ? routes : e->n_slots;
    const size_t acc_stride = pyrt_align64((size_t)tb_max * n_embd * sizeof(float)) / sizeof(float);
    /* Room for up to MAX_ITEMS_PER_THREAD work items per thread (plan_items), fewer when their
     * partial ys would pass ITEMS_ACC_BYTES (long prefill blocks), at least one per thread. */
    size_t n_items_max = ITEMS_ACC_BYTES / (acc_stride * sizeof(float));
    if (n_items_max > (size_t)nth * MAX_ITEMS_PER_THREAD)
        n_items_max = (size_t)nth * MAX_ITEMS_PER_THREAD;
    if (n_items_max < (size_t)nth)
        n_items_max = (size_t)nth;
    const size_t xq_bytes =
        quantized ? (size_t)n_tokens * pyrt_xq_units((size_t)n_embd) * sizeof(pyrt_xq8) : 0;

    /* Workspace layout (each piece 64-byte aligned). */
    size_t off_acc = 0;
    size_t off_active = off_acc + n_items_max * acc_stride * sizeof(float);
    size_t off_xq = off_active + pyrt_align64((size_t)nth * 8 * sizeof(int64_t));
    size_t off_counts = off_xq + pyrt_align64(xq_bytes);
    size_t off_used = off_counts + pyrt_align64((size_t)e->n_slots * sizeof(int));
    size_t off_rstart = off_used + pyrt_align64((size_t)used_max * sizeof(int));
    size_t off_rtok = off_rstart + pyrt_align64((size_t)(used_max + 1) * sizeof(int));
    size_t off_rw = off_rtok + pyrt_align64((size_t)(routes + used_max) * sizeof(int));
    size_t off_cost = off_rw + pyrt_align64((size_t)routes * sizeof(float));
    size_t off_istart = off_cost + pyrt_align64((size_t)(used_max + 1) * sizeof(int64_t));
    size_t off_next = off_istart + pyrt_align64((n_items_max + 1) * sizeof(int64_t));
    size_t off_done = off_next + 2 * 64; /* next_item, next_slice: a cache line each */
    size_t total = off_done + pyrt_align64(n_items_max * sizeof(atomic_int));

    const pyrt_params *params = pyrt_pool_params(pool);
    uint8_t *ws = pyrt_pool_workspace(pool, total);
    if (ws == NULL)
        return pyrt_fail(PYRT_E_NOMEM, "pyrt_moe_ffn: cannot allocate %zu bytes of workspace",
                         total);
    *c = (moe_ctx){
        .gud = e->data,
        .gates = e->gates,
        .row_bytes = pyrt_row_bytes(fmt, n_embd),
        .ops = pyrt_pool_row_ops(pool, fmt),
        .n_slots = e->n_slots,
        .expert_map = e->expert_map,
        .n_ff = e->n_ff,
        .n_embd = n_embd,
        .activation = activation,
        .swiglu_alpha = e->swiglu_alpha,
        .swiglu_limit = e->swiglu_limit,
        .bias_gu = e->bias_gu,
        .bias_down = e->bias_down,
        .threshold = threshold,
        .x = x,
        .ids = topk_ids,
        .w = topk_w,
        .n_tokens = n_tokens,
        .k = k,
        .y = y,
        .xq = quantized ? (pyrt_xq8 *)(ws + off_xq) : NULL,
        .xq_kind = pyrt_fmt_xq(fmt),
        .used = (int *)(ws + off_used),
        .route_start = (int *)(ws + off_rstart),
        .route_tok = (int *)(ws + off_rtok),
        .route_w = (float *)(ws + off_rw),
        .cost_start = (int64_t *)(ws + off_cost),
        .counts = (int *)(ws + off_counts),
        .acc = (float *)(ws + off_acc),
        .acc_stride = acc_stride,
        .n_items_max = (int)n_items_max,
        .item_start = (int64_t *)(ws + off_istart),
        .next_item = (atomic_int *)(ws + off_next),
        .next_slice = (atomic_int *)(ws + off_next + 64),
        .item_done = (atomic_int *)(ws + off_done),
        .active = (int64_t *)(ws + off_active),
        .prefetch_ahead = params->expert_prefetch_neurons,
        .reduce_pf = params->reduce_prefetch_items,
        .ops_add = pyrt_add_f32_active(),
        .pool = pool,
        .nth = nth,
    };
    memset(c->active, 0, (size_t)nth * 8 * sizeof(int64_t));
    return PYRT_OK;
}

static int64_t active_sum(const moe_ctx *c) {
    int64_t sum = 0;
    for (int t = 0; t < c->nth; t++)
        sum += c->active[(size_t)t * 8];
    return sum;
}

/* Whether the routes held here number BATCH_MIN_ROUTES per expert they use, on average (0
 * also where the scratch cannot be allocated: the token blocks then run). */
static int batch_pays(const pyrt_experts *e, int n_tokens, const int32_t *ids, int k) {
    if ((int64_t)n_tokens * k < BATCH_MIN_ROUTES)
        return 0;
    uint8_t *used = calloc((size_t)e->n_slots, 1);
    if (used == NULL)
        return 0;
    int64_t routes = 0, n_used = 0;
    for (int64_t r = 0; r < (int64_t)n_tokens * k; r++) {
        const int s = e->expert_map != NULL ? e->expert_map[ids[r]] : ids[r];
        if (s < 0)
            continue;
        routes++;
        n_used += !used[s];
        used[s] = 1;
    }
    free(used);
    return n_used > 0 && routes >= (int64_t)BATCH_MIN_ROUTES * n_used;
}

/* The activations as the dot kernels read them (c->xv, c->xv_stride): their Q8 blocks, made in
 * c->xq, where the format quantizes them, else x itself. */
static void ready_activations(moe_ctx *c, pyrt_pool *pool) {
    if (c->xq == NULL) {
        c->xv = (const uint8_t *)c->x;
        c->xv_stride = (size_t)c->n_embd * sizeof(float);
        return;
    }
    /* A few tokens take microseconds: cheaper on this thread than a hand-off to the pool. */
    atomic_store_explicit(c->next_item, 0, memory_order_relaxed);
    if ((int64_t)c->n_tokens * c->n_embd <= SERIAL_QUANTIZE_MAX)
        task_quantize(c, 0, 1);
    else
        pyrt_pool_run(pool, task_quantize, c);
    c->xv = (const uint8_t *)c->xq;
    c->xv_stride = pyrt_xq_units((size_t)c->n_embd) * sizeof(pyrt_xq8);
}

/* pyrt_moe_ffn's many-token case: the prefill's kernel, on the pool's second workspace, kept
 * between calls as the C prefill keeps its buffers between layers (the token blocks' workspace
 * is not touched). Layout, each piece 64-byte aligned: xv [n_tokens] pointers to each token's
 * activations; xq [n_tokens, n_embd / 32] Q8 blocks where the format quantizes x; then
 * pyrt_moe_batch's buffers for n_tokens * k routes (h and yr: routes x (n_ff + n_embd) floats,
 * ~20-50 MB for a 512-token share of olmoe or granite). The caller holds the pool. */
static int run_batch(pyrt_pool *pool, const pyrt_experts *e, const float *x, int n_tokens,
                     const int32_t *topk_ids, const float *topk_w, int k, int activation,
                     float threshold, float *y, int64_t *n_active) {
    const int n_embd = e->n_embd, routes = n_tokens * k;
    const size_t xq_bytes =
        pyrt_fmt_is_blocked(e->fmt)
            ? (size_t)n_tokens * pyrt_xq_units((size_t)n_embd) * sizeof(pyrt_xq8) : 0;
    const size_t off_xq = pyrt_align64((size_t)n_tokens * sizeof(const void *));
    const size_t off_buf = off_xq + pyrt_align64(xq_bytes);
    const size_t total = off_buf + pyrt_moe_batch_bytes(routes, e->n_slots, e->n_ff, n_embd);
    uint8_t *ws = pyrt_pool_batch_workspace(pool, total);
    if (ws == NULL)
        return pyrt_fail(PYRT_E_NOMEM,
                         "pyrt_moe_ffn: cannot allocate %zu bytes of workspace for %d tokens' "
                         "routes", total, n_tokens);
    atomic_int next_item;
    moe_ctx c = {.x = x, .n_tokens = n_tokens, .n_embd = n_embd,
                 .xq = xq_bytes > 0 ? (pyrt_xq8 *)(ws + off_xq) : NULL,
                 .xq_kind = pyrt_fmt_xq(e->fmt), .next_item = &next_item};
    ready_activations(&c, pool);
    const void **xv = (const void **)ws;
    for (int t = 0; t < n_tokens; t++)
        xv[t] = c.xv + (size_t)t * c.xv_stride;
    pyrt_moe_batch_buf buf;
    pyrt_moe_batch_place(&buf, ws + off_buf, routes, e->n_slots, e->n_ff, n_embd);
    int64_t n_pairs = 0;
    const int rc = pyrt_moe_batch(pool, &buf, e, n_tokens, xv, topk_ids, topk_w, k, activation,
                                  threshold, y, n_active, &n_pairs);
    pyrt_moe_batch_free(&buf); /* the workspace stays; a block of its own, had it taken one */
    return rc;
}

/* pyrt_moe_ffn's token blocks (TOKEN_BLOCK tokens per pool hand-off) on the pool's workspace.
 * The caller holds the pool. */
static int run_blocks(pyrt_pool *pool, const pyrt_experts *e, const float *x, int n_tokens,
                      const int32_t *topk_ids, const float *topk_w, int k, int activation,
                      float threshold, float *y, int64_t *n_active) {
    moe_ctx c;
    const int rc =
        moe_setup(&c, pool, e, x, n_tokens, topk_ids, topk_w, k, activation, threshold, y);
    if (rc != PYRT_OK)
        return rc;
    ready_activations(&c, pool);
    for (c.t0 = 0; c.t0 < n_tokens; c.t0 += TOKEN_BLOCK) {
        pyrt_moe_plan_token_block(&c);
        pyrt_pool_run(pool, task_block, &c);
    }
    *n_active = active_sum(&c);
    return PYRT_OK;
}

int pyrt_moe_ffn(pyrt_pool *pool, const pyrt_experts *experts, const float *x, int n_tokens,
                 const int32_t *topk_ids, const float *topk_w, int k, int activation,
                 float threshold, float *y, int64_t *n_active) {
    pyrt_clear_error();
    int rc = check_args(pool, experts, x, n_tokens, topk_ids, topk_w, k, activation, threshold, y);
    if (rc != PYRT_OK)
        return rc;
    if (n_active != NULL)
        *n_active = 0;
    if (n_tokens == 0)
        return PYRT_OK;
    const int batch = batch_pays(experts, n_tokens, topk_ids, k);
    int64_t sum = 0;
    pyrt_pool_acquire(pool);
    rc = (batch ? run_batch : run_blocks)(pool, experts, x, n_tokens, topk_ids, topk_w, k,
                                          activation, threshold, y, &sum);
    pyrt_pool_release(pool);
    if (rc == PYRT_OK && n_active != NULL)
        *n_active = sum;
    return rc;
}

/* ---- router, routing and experts in one pool task (the decode step) --------------------------
 * The threads run the router's matvec chunks; the one whose chunk completes the router's rows
 * routes (route_fn: ids and weights of the top k) and plans the token's routes and work items,
 * while the others, out of router chunks, prefetch their home of the pool's plan; then the
 * experts' items and the reduce as in task_block. One pool hand-off instead of two, and the
 * routing off the caller's serial path between them. The same operations on the same numbers as
 * the router's own run followed by pyrt_moe_ffn: the same bits. */

static void router_rows_done(void *p, int64_t lo, int64_t hi) {
    moe_ctx *c = p;
    const int64_t n = c->router->out[0].m->n_out;
    if (lo >= n)
        return;
    const int64_t got = (hi < n ? hi : n) - lo;
    if (atomic_fetch_add_explicit(&c->router_rows, got, memory_order_acq_rel) + got != n)
        return;
    c->route(c->route_ctx, c->route_ids, c->route_wts);
    pyrt_moe_plan_token_block(c);
    pyrt_pool_flag_store(c->pool, &c->planned, 1);
}

static void task_routed(void *p, int ith, int nth) {
    moe_ctx *c = p;
    if (c->before != NULL)
        c->before(c->before_ctx, ith, nth);
    pyrt_mv_task(c->router, ith, nth);
    pyrt_pool_wait_flag(c->pool, &c->planned, 1, ith);
    task_block(c, ith, nth);
}

int pyrt_moe_ffn_routed(pyrt_pool *pool, pyrt_task_fn before, void *before_ctx,
                        pyrt_mv_job *router, pyrt_route_fn route, void *route_ctx, int32_t *ids,
                        float *w, const pyrt_experts *experts, const float *x,
                        const pyrt_xq8 *xq, int k, int activation, float threshold, float *y,
                        int64_t *n_active) {
    const int n_embd = experts->n_embd;
    moe_ctx c;
    int rc = moe_setup(&c, pool, experts, x, 1, ids, w, k, activation, threshold, y);
    if (rc != PYRT_OK)
        return rc;
    if (c.xq != NULL) {
        if (xq != NULL) /* the router's job quantized x the same way */
            c.xv = (const uint8_t *)xq;
        else {
            atomic_store_explicit(c.next_item, 0, memory_order_relaxed);
            task_quantize(&c, 0, 1);
            c.xv = (const uint8_t *)c.xq;
        }
        c.xv_stride = pyrt_xq_units((size_t)n_embd) * sizeof(pyrt_xq8);
    } else {
        c.xv = (const uint8_t *)x;
        c.xv_stride = (size_t)n_embd * sizeof(float);
    }
    c.before = before;
    c.before_ctx = before_ctx;
    c.router = router;
    c.route = route;
    c.route_ctx = route_ctx;
    c.route_ids = ids;
    c.route_wts = w;
    c.t0 = 0;
    atomic_init(&c.router_rows, 0);
    atomic_init(&c.planned, 0);
    router->on_rows = router_rows_done;
    router->on_rows_ctx = &c;
    pyrt_pool_run(pool, task_routed, &c);
    *n_active = active_sum(&c);
    return PYRT_OK;
}

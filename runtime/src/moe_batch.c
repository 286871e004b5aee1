/* pyrt_moe_batch: one MoE layer's routed experts for a chunk of many tokens (the prefill).
 *
 * The chunk's (token, expert) routes are grouped by expert (counting sort), so each expert's
 * rows are read once per chunk for all its tokens, then three pool tasks:
 *  1. gate and up: items of (expert, GU_NEURONS neurons), the expert's tokens against the rows in
 *     tiles (rows.h): h[n][i] = w_i * act(g_n . x_i) * (u_n . x_i) (with gpt-oss's biases
 *     act(g_n . x_i + bg_n) * up(u_n . x_i + bu_n), up as activation.h says), the expert's h
 *     kept as [n_ff][its routes]. With a threshold, the gates first; then the up rows of the
 *     union of the neurons some token of the pass keeps (h = 0 for a token that drops it), so a
 *     row no token needs is not read; or, where that union is nearly everything, gate and up
 *     together and the drops after (dense_union);
 *  2. down: items of (expert, up to PYRT_AXPY_TOKENS routes, DOWN_COLS columns of y): each route's
 *     yr = sum_n h[n][i] d_n (+ w_i * bd, the expert's down bias, where it has one) over the
 *     neurons with a nonzero h in the group (a zero adds nothing), in tiles, each down row's
 *     block loaded once for the group;
 *  3. each token's y = the sum of its routes' yr in routing order.
 * The same operations per (token, neuron) as pyrt_moe_ffn (the dots bit for bit, h as it makes
 * it), summed in another order. Items are claimed from counters: work-conserving (pool.h). */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "activation.h"
#include "error.h"
#include "moe_batch.h"

enum {
    GU_NEURONS = 32, /* neurons of a gate/up item */
    GU_TOKENS = 64,  /* routes of a gate/up tile pass (their x in L2 while the rows go by) */
    DOWN_COLS = 256, /* columns of y of a down item (a multiple of 32: whole quantized blocks) */
    DOWN_ROWS = 256  /* rows handed to one axpy tile call */
};

void pyrt_moe_batch_free(pyrt_moe_batch_buf *b) {
    free(b->mem);
    memset(b, 0, sizeof *b);
}

/* The buffers' byte offsets in their block, in pyrt_moe_batch_buf's order; end: the block's
 * size. */
typedef struct {
    size_t counts, used, start, fill, down_start, route_tok, route_w, route_of, h, yr, end;
} batch_layout;

static batch_layout layout(int routes, int n_slots, int n_ff, int n_embd) {
    const size_t slots = (size_t)n_slots + 1, r = (size_t)routes;
    batch_layout l;
    l.counts = 0;
    l.used = l.counts + pyrt_align64(slots * sizeof(int));
    l.start = l.used + pyrt_align64(slots * sizeof(int));
    l.fill = l.start + pyrt_align64((slots + 1) * sizeof(int));
    l.down_start = l.fill + pyrt_align64(slots * sizeof(int));
    l.route_tok = l.down_start + pyrt_align64((slots + 1) * sizeof(int));
    l.route_w = l.route_tok + pyrt_align64(r * sizeof(int));
    l.route_of = l.route_w + pyrt_align64(r * sizeof(float));
    l.h = l.route_of + pyrt_align64(r * sizeof(int));
    l.yr = l.h + pyrt_align64(r * n_ff * sizeof(float));
    l.end = l.yr + pyrt_align64(r * n_embd * sizeof(float));
    return l;
}

size_t pyrt_moe_batch_bytes(int routes, int n_slots, int n_ff, int n_embd) {
    return layout(routes, n_slots, n_ff, n_embd).end;
}

void pyrt_moe_batch_place(pyrt_moe_batch_buf *b, void *mem, int routes, int n_slots, int n_ff,
                          int n_embd) {
    const batch_layout l = layout(routes, n_slots, n_ff, n_embd);
    uint8_t *m = mem;
    *b = (pyrt_moe_batch_buf){
        .routes_cap = routes,
        .slots_cap = n_slots,
        .ff_cap = n_ff,
        .embd_cap = n_embd,
        .counts = (int *)(m + l.counts),
        .used = (int *)(m + l.used),
        .start = (int *)(m + l.start),
        .fill = (int *)(m + l.fill),
        .down_start = (int *)(m + l.down_start),
        .route_tok = (int *)(m + l.route_tok),
        .route_w = (float *)(m + l.route_w),
        .route_of = (int *)(m + l.route_of),
        .h = (float *)(m + l.h),
        .yr = (float *)(m + l.yr),
    };
}

/* Room for `routes` routes over n_slots slots, n_ff neurons, n_embd columns: a block of the
 * buffers' own where the one they have is too small. */
static int ensure(pyrt_moe_batch_buf *b, int routes, int n_slots, int n_ff, int n_embd) {
    if (routes <= b->routes_cap && n_slots <= b->slots_cap && n_ff <= b->ff_cap &&
        n_embd <= b->embd_cap)
        return PYRT_OK;
    pyrt_moe_batch_free(b);
    const size_t bytes = pyrt_moe_batch_bytes(routes, n_slots, n_ff, n_embd);
    void *mem = aligned_alloc(64, bytes);
    if (mem == NULL)
        return pyrt_fail(PYRT_E_NOMEM, "pyrt_moe_batch: cannot allocate %zu bytes for the "
                         "routed experts' buffers (%d routes)", bytes, routes);
    pyrt_moe_batch_place(b, mem, routes, n_slots, n_ff, n_embd);
    b->mem = mem;
    return PYRT_OK;
}

/* Routes grouped by slot (counting sort, token order within a slot); pairs not held here are
 * dropped (route_of -1). *n_used: the slots used. */
static void plan(pyrt_moe_batch_buf *b, const pyrt_experts *e, int n_tokens, const int32_t *ids,
                 const float *w, int k, int *n_used) {
    const int n_routes = n_tokens * k;
    memset(b->counts, 0, (size_t)e->n_slots * sizeof *b->counts);
    for (int r = 0; r < n_routes; r++) {
        const int s = e->expert_map != NULL ? e->expert_map[ids[r]] : ids[r];
        b->route_of[r] = s;
        if (s >= 0)
            b->counts[s]++;
    }
    int u = 0, at = 0;
    for (int s = 0; s < e->n_slots; s++) {
        if (b->counts[s] == 0)
            continue;
        b->used[u] = s;
        b->start[u] = b->fill[u] = at;
        at += b->counts[s];
        b->counts[s] = u++; /* from here on: slot -> its index in used[] */
    }
    b->start[u] = at;
    *n_used = u;
    for (int r = 0; r < n_routes; r++) {
        const int s = b->route_of[r];
        if (s < 0)
            continue;
        const int i = b->fill[b->counts[s]]++;
        b->route_tok[i] = r / k;
        b->route_w[i] = w[r];
        b->route_of[r] = i;
    }
}

/* The call's context, shared by its tasks. */
typedef struct {
    pyrt_moe_batch_buf *b;
    const uint8_t *gud;
    size_t row_bytes;
    const pyrt_row_ops *ops;
    int fmt, n_ff, n_embd, activation, k, n_tokens, n_used;
    float threshold;
    float alpha, limit;       /* PYRT_ACT_SWIGLU_OAI's */
    const float *bias_gu;     /* [n_slots, n_ff, 2] or NULL */
    const float *bias_down;   /* [n_slots, n_embd] or NULL (with bias_gu) */
    const void *const *xv;
    float *y;
    pyrt_add_fn add;
    int gu_items;         /* gate/up items per expert */
    int union_pct;        /* params.prefill_union_pct (dense_union) */
    int col_blocks;       /* down items per group of routes */
    atomic_int next;      /* the next item to claim */
    atomic_llong active;  /* neurons computed */
    atomic_llong union_kept, union_total; /* neurons some token of a pass kept; neurons passed */
} batch_ctx;

/* v where on, else +0: a mask, not a branch (a token keeps or drops a neuron at random: a branch
 * on it mispredicts; at 50% skipped the branches cost 9% of a granite-1b-a400m prefill). */
static inline float kept_or_zero(int on, float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    u &= 0u - (uint32_t)on;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* Row r (0 gate, 1 up, 2 down) of neuron n of used expert u. */
static inline const uint8_t *row_of(const batch_ctx *c, int u, int n, int r) {
    return c->gud + (((size_t)c->b->used[u] * c->n_ff + n) * 3 + r) * c->row_bytes;
}

/* ---- 1. gate and up -------------------------------------------------------------------------- */

/* Used expert u's [n_ff, 2] gate/up biases, or NULL. */
static inline const float *bias_of(const batch_ctx *c, int u) {
    return c->bias_gu != NULL ? c->bias_gu + (size_t)c->b->used[u] * c->n_ff * 2 : NULL;
}

/* act(g + bg_j) and up(u + bu_j) of neuron j, as moe_neurons.c's gate_act and up_term. */
static inline float gate_act(const batch_ctx *c, const float *bias, int j, float g) {
    if (bias != NULL)
        g += bias[2 * j];
    return pyrt_activate_gate(c->activation, c->alpha, c->limit, g);
}

static inline float up_term(const batch_ctx *c, const float *bias, int j, float u) {
    if (bias != NULL)
        u += bias[2 * j + 1];
    return pyrt_activate_up(c->activation, c->limit, u);
}

/* With a threshold, a pass reads the up rows of the union of the neurons its tokens keep. Over
 * many tokens that union is nearly every neuron, and reading the gates apart from the up rows
 * then costs (granite-1b-a400m, 1 thread, pp512, 50% skipped: 0.97x dense apart, 1.03x
 * together; params.c). So once the call's passes so far needed at least
 * params.prefill_union_pct % of their neurons, the next ones run gate and up together as dense
 * does and drop per token after. Either way the same dots, the same h: the choice moves no bit,
 * whichever threads saw which counts. */
static int dense_union(batch_ctx *c) {
    const long long total = atomic_load_explicit(&c->union_total, memory_order_relaxed);
    const long long kept = atomic_load_explicit(&c->union_kept, memory_order_relaxed);
    return c->union_pct == 0 ||
           (total >= 4 * GU_NEURONS && kept * 100 >= total * (long long)c->union_pct);
}

static void count_union(batch_ctx *c, int kept, int total) {
    atomic_fetch_add_explicit(&c->union_kept, kept, memory_order_relaxed);
    atomic_fetch_add_explicit(&c->union_total, total, memory_order_relaxed);
}

/* Neurons [j0, j0 + nj) of used expert u for its routes [i0, i0 + nt) (nt <= GU_TOKENS). */
static int64_t gate_up_pass(batch_ctx *c, int u, int j0, int nj, int i0, int nt) {
    const pyrt_moe_batch_buf *b = c->b;
    const int base = b->start[u], n_routes = b->start[u + 1] - base;
    float *h = b->h + (size_t)base * c->n_ff; /* [n_ff][n_routes] */
    const void *xp[GU_TOKENS];
    for (int i = 0; i < nt; i++)
        xp[i] = c->xv[b->route_tok[base + i0 + i]];
    const float *rw = b->route_w + base + i0;
    float g[GU_TOKENS * 2 * GU_NEURONS]; /* [token][2 * neuron] */
    const void *rp[2 * GU_NEURONS] = {0};
    int64_t active = 0;
    const int sparse = c->threshold > 0.0f;
    const float *bias = bias_of(c, u);
    if (!sparse || dense_union(c)) { /* gate and up rows together */
        for (int j = 0; j < nj; j++) {
            rp[2 * j] = row_of(c, u, j0 + j, 0);
            rp[2 * j + 1] = row_of(c, u, j0 + j, 1);
        }
        pyrt_dot_tile(c->ops, 2 * nj, rp, nt, xp, c->n_embd, g, 2 * GU_NEURONS, 1);
        int n_union = 0;
        for (int j = 0; j < nj; j++) {
            int any = 0;
            float *hj = h + (size_t)(j0 + j) * n_routes + i0;
            for (int i = 0; i < nt; i++) { /* no branch on the data: a drop is a select */
                const float *gu = g + (size_t)i * 2 * GU_NEURONS + 2 * j;
                const float a = gate_act(c, bias, j0 + j, gu[0]);
                const float v = rw[i] * a * up_term(c, bias, j0 + j, gu[1]);
                const int on = !(fabsf(a) < c->threshold); /* always on when dense; NaN too */
                hj[i] = kept_or_zero(on, v);
                any |= on;
                active += on;
            }
            n_union += any;
        }
        if (sparse)
            count_union(c, n_union, nj);
        return active;
    }
    /* sparse: the gates, then the up rows of the neurons some token keeps */
    for (int j = 0; j < nj; j++)
        rp[j] = row_of(c, u, j0 + j, 0);
    pyrt_dot_tile(c->ops, nj, rp, nt, xp, c->n_embd, g, GU_NEURONS, 1);
    int keep[GU_NEURONS], n_keep = 0;
    uint8_t kept[GU_NEURONS] = {0};
    for (int j = 0; j < nj; j++) {
        int any = 0;
        for (int i = 0; i < nt; i++) {
            float *a = g + (size_t)i * GU_NEURONS + j;
            *a = gate_act(c, bias, j0 + j, *a);
            const int on = !(fabsf(*a) < c->threshold); /* NaN stays on, so it propagates */
            any |= on;
            active += on;
        }
        if (any) {
            rp[n_keep] = row_of(c, u, j0 + j, 1);
            keep[n_keep++] = j;
            kept[j] = 1;
        }
    }
    count_union(c, n_keep, nj);
    /* Whole tiles: the rows of a last partial tile would go through per-token dot2 / dot calls,
     * slower than a tile's wasted rows; so dropped neurons' up rows fill it (their products
     * are made and not used: h stays 0 where no token keeps the neuron). */
    int n_up = n_keep;
    for (int j = 0; j < nj && n_up % PYRT_TILE_ROWS != 0; j++)
        if (!kept[j])
            rp[n_up++] = row_of(c, u, j0 + j, 1);
    float *up = g + (size_t)GU_TOKENS * GU_NEURONS; /* [token][kept neuron, then padding] */
    pyrt_dot_tile(c->ops, n_up, rp, nt, xp, c->n_embd, up, GU_NEURONS, 1);
    for (int j = 0; j < nj; j++)
        for (int i = 0; i < nt; i++)
            h[(size_t)(j0 + j) * n_routes + i0 + i] = 0.0f;
    for (int l = 0; l < n_keep; l++) {
        const int j = keep[l];
        for (int i = 0; i < nt; i++) {
            const float a = g[(size_t)i * GU_NEURONS + j];
            const float u_l = up[(size_t)i * GU_NEURONS + l];
            const float v = rw[i] * a * up_term(c, bias, j0 + j, u_l);
            h[(size_t)(j0 + j) * n_routes + i0 + i] = kept_or_zero(!(fabsf(a) < c->threshold), v);
        }
    }
    return active;
}

static void task_gate_up(void *p, int ith, int nth) {
    (void)ith;
    (void)nth;
    batch_ctx *c = p;
    const int n_items = c->n_used * c->gu_items;
    int64_t active = 0;
    for (int it; (it = atomic_fetch_add_explicit(&c->next, 1, memory_order_relaxed)) < n_items;) {
        const int u = it / c->gu_items, j0 = it % c->gu_items * GU_NEURONS;
        const int nj = c->n_ff - j0 < GU_NEURONS ? c->n_ff - j0 : GU_NEURONS;
        const int n_routes = c->b->start[u + 1] - c->b->start[u];
        for (int i0 = 0; i0 < n_routes; i0 += GU_TOKENS)
            active += gate_up_pass(c, u, j0, nj, i0,
                                   n_routes - i0 < GU_TOKENS ? n_routes - i0 : GU_TOKENS);
    }
    atomic_fetch_add_explicit(&c->active, active, memory_order_relaxed);
}

/* ---- 2. down --------------------------------------------------------------------------------- */

/* Routes [i0, i0 + nt) of used expert u, columns [c0, c0 + nc): their yr. */
static void down_item(const batch_ctx *c, int u, int i0, int nt, int c0, int nc) {
    const pyrt_moe_batch_buf *b = c->b;
    const int base = b->start[u], n_routes = b->start[u + 1] - base;
    const float *h = b->h + (size_t)base * c->n_ff;
    float *ys[PYRT_AXPY_TOKENS];
    const float *bd = c->bias_down != NULL
                          ? c->bias_down + (size_t)b->used[u] * c->n_embd + c0 : NULL;
    for (int i = 0; i < nt; i++) {
        ys[i] = b->yr + (size_t)(base + i0 + i) * c->n_embd + c0;
        if (bd == NULL) {
            memset(ys[i], 0, (size_t)nc * sizeof(float));
        } else { /* w * bd first, as moe_neurons.c's down_bias */
            const float wr = b->route_w[base + i0 + i];
            for (int col = 0; col < nc; col++)
                ys[i][col] = wr * bd[col];
        }
    }
    const size_t col_bytes = pyrt_row_bytes(c->fmt, c0); /* whole blocks: c0 % 32 == 0 */
    const void *rp[DOWN_ROWS];
    const float *ap[DOWN_ROWS];
    int n = 0;
    for (int j = 0; j < c->n_ff; j++) {
        const float *hj = h + (size_t)j * n_routes + i0;
        int any = 0;
        for (int i = 0; i < nt; i++)
            any |= hj[i] != 0.0f;
        if (!any)
            continue;
        rp[n] = row_of(c, u, j, 2) + col_bytes;
        ap[n++] = hj;
        if (n == DOWN_ROWS) {
            pyrt_axpy_tile(c->ops, n, rp, ap, nt, ys, nc);
            n = 0;
        }
    }
    if (n > 0)
        pyrt_axpy_tile(c->ops, n, rp, ap, nt, ys, nc);
}

static void task_down(void *p, int ith, int nth) {
    (void)ith;
    (void)nth;
    batch_ctx *c = p;
    const pyrt_moe_batch_buf *b = c->b;
    const int n_items = b->down_start[c->n_used];
    int u = 0;
    for (int it; (it = atomic_fetch_add_explicit(&c->next, 1, memory_order_relaxed)) < n_items;) {
        while (b->down_start[u + 1] <= it) /* items are claimed in order: u only grows */
            u++;
        const int local = it - b->down_start[u];
        const int i0 = local / c->col_blocks * PYRT_AXPY_TOKENS;
        const int c0 = local % c->col_blocks * DOWN_COLS;
        const int n_routes = b->start[u + 1] - b->start[u];
        down_item(c, u, i0, n_routes - i0 < PYRT_AXPY_TOKENS ? n_routes - i0 : PYRT_AXPY_TOKENS,
                  c0, c->n_embd - c0 < DOWN_COLS ? c->n_embd - c0 : DOWN_COLS);
    }
}

/* ---- 3. each token's sum --------------------------------------------------------------------- */

static void token_sum(void *p, int64_t t, int ith) {
    (void)ith;
    const batch_ctx *c = p;
    float *y = c->y + (size_t)t * c->n_embd;
    int first = 1;
    for (int j = 0; j < c->k; j++) {
        const int i = c->b->route_of[(size_t)t * c->k + j];
        if (i < 0)
            continue;
        const float *yr = c->b->yr + (size_t)i * c->n_embd;
        if (first)
            memcpy(y, yr, (size_t)c->n_embd * sizeof *y);
        else
            c->add(y, yr, (size_t)c->n_embd);
        first = 0;
    }
    if (first)
        memset(y, 0, (size_t)c->n_embd * sizeof *y);
}

/* ---- entry ----------------------------------------------------------------------------------- */

int pyrt_moe_batch(pyrt_pool *pool, pyrt_moe_batch_buf *buf, const pyrt_experts *e,
                   int n_tokens, const void *const *xv, const int32_t *ids, const float *w, int k,
                   int activation, float threshold, float *y, int64_t *n_active,
                   int64_t *n_pairs) {
    int rc = ensure(buf, n_tokens * k, e->n_slots, e->n_ff, e->n_embd);
    if (rc != PYRT_OK)
        return rc;
    int n_used = 0;
    plan(buf, e, n_tokens, ids, w, k, &n_used);
    batch_ctx c = {.b = buf, .gud = e->data, .row_bytes = pyrt_row_bytes(e->fmt, e->n_embd),
                   .ops = pyrt_pool_row_ops(pool, e->fmt), .fmt = e->fmt, .n_ff = e->n_ff,
                   .n_embd = e->n_embd, .activation = activation, .k = k, .n_tokens = n_tokens,
                   .n_used = n_used, .threshold = threshold, .alpha = e->swiglu_alpha,
                   .limit = e->swiglu_limit, .bias_gu = e->bias_gu, .bias_down = e->bias_down,
                   .xv = xv, .y = y,
                   .add = pyrt_add_f32_active(),
                   .gu_items = (e->n_ff + GU_NEURONS - 1) / GU_NEURONS,
                   .union_pct = pyrt_pool_params(pool)->prefill_union_pct,
                   .col_blocks = (e->n_embd + DOWN_COLS - 1) / DOWN_COLS};
    buf->down_start[0] = 0;
    for (int u = 0; u < n_used; u++) {
        const int groups = (buf->start[u + 1] - buf->start[u] + PYRT_AXPY_TOKENS - 1) /
                           PYRT_AXPY_TOKENS;
        buf->down_start[u + 1] = buf->down_start[u] + groups * c.col_blocks;
    }
    atomic_init(&c.active, 0);
    atomic_init(&c.union_kept, 0);
    atomic_init(&c.union_total, 0);
    atomic_init(&c.next, 0);
    pyrt_pool_run(pool, task_gate_up, &c);
    atomic_store_explicit(&c.next, 0, memory_order_relaxed);
    pyrt_pool_run(pool, task_down, &c);
    pyrt_pool_for(pool, n_tokens, 4, token_sum, &c);
    *n_active = atomic_load_explicit(&c.active, memory_order_relaxed);
    *n_pairs = buf->start[n_used];
    return PYRT_OK;
}

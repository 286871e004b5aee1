/* pyrt_moe_ffn: one MoE layer's routed experts on the CPU, dense or neuron-sparse.
 *
 * Work split. Tokens are processed in blocks of up to TOKEN_BLOCK. Inside a block the (token,
 * expert) routes are grouped by expert, so an expert's rows are read from DRAM once per block and
 * reused from L1 for every token routed to it. The neurons of all used experts form one list
 * (expert-major, so each thread walks contiguous memory), cut into nth ranges of equal estimated
 * cost: batch 1 with top-8 puts every thread to work even when nth > 8. Each thread accumulates
 * into its own y buffer; a second pass sums those buffers in a fixed order. Partitioning is
 * static, so the result does not depend on thread timing (sparse with threshold 0 equals dense
 * bit for bit, and a rerun gives the same bits).
 *
 * Per neuron j of expert e and route (t, w):  a = act(g_j . x_t); skip if |a| < threshold;
 * h = w * a * (u_j . x_t); y_t += h * d_j (an axpy: the down row is the transposed column). */
#include <math.h>
#include <stdint.h>

#include "pyrt_internal.h"

enum { TOKEN_BLOCK = 64 };

typedef struct {
    /* weights: row r (0 gate, 1 up, 2 down) of neuron j of expert e starts at
     * gud + ((e * n_ff + j) * 3 + r) * row_bytes */
    const uint8_t *gud;
    size_t row_bytes;
    const pyrt_row_ops *ops;
    const pyrt_row_ops *ops_f32; /* f32 axpy for down rows dequantized once and shared by tokens */
    int n_expert, n_ff, n_embd, activation;
    float threshold;
    /* tokens */
    const float *x;         /* [n_tokens, n_embd] */
    const int32_t *ids;     /* [n_tokens, k] */
    const float *w;         /* [n_tokens, k] */
    int n_tokens, k;
    float *y;               /* [n_tokens, n_embd] */
    const uint8_t *xv;      /* what the dot kernels read per token: x itself, or its Q8 blocks */
    size_t xv_stride;       /* bytes between tokens in xv */
    pyrt_xq8 *xq;           /* [n_tokens, n_embd/32] when quantized, else NULL */
    /* the current token block [t0, t0 + tb) */
    int t0, tb;
    int n_used;             /* experts used by the block */
    int *used;              /* [n_used] expert ids, ascending */
    int *route_start;       /* [n_used + 1] routes of used[u]: route_start[u] .. route_start[u+1] */
    int *route_tok;         /* [tb*k] token index inside the block */
    float *route_w;         /* [tb*k] routing weight */
    int64_t *cost_start;    /* [n_used + 1] prefix sums of n_ff * cost per neuron */
    int *counts;            /* [n_expert] scratch */
    float *acc;             /* [nth, acc_stride] per-thread partial y of the block */
    size_t acc_stride;      /* floats, >= TOKEN_BLOCK * n_embd, multiple of 16 */
    int64_t *active;        /* [nth * 8] per-thread active-neuron counters (own cache line) */
    float *down_f32;        /* [nth, down_stride] a dequantized down row, or NULL (f32 weights) */
    size_t down_stride;     /* floats, >= n_embd, multiple of 16 */
} moe_ctx;

static inline float activate(int kind, float g) {
    switch (kind) {
    case PYRT_ACT_GELU_TANH:
        return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    case PYRT_ACT_GELU_ERF:
        return 0.5f * g * (1.0f + erff(g * 0.7071067811865476f));
    default: /* SiLU: for g -> -inf, expf overflows to inf and g / inf = -0, as wanted */
        return g / (1.0f + expf(-g));
    }
}

/* ---- tasks --------------------------------------------------------------------------------- */

static void task_quantize(void *p, int ith, int nth) {
    moe_ctx *c = p;
    const int nb = c->n_embd / PYRT_QK;
    const int t_lo = (int)((int64_t)c->n_tokens * ith / nth);
    const int t_hi = (int)((int64_t)c->n_tokens * (ith + 1) / nth);
    for (int t = t_lo; t < t_hi; t++)
        pyrt_quantize_x_q8(c->x + (size_t)t * c->n_embd, c->xq + (size_t)t * nb, c->n_embd);
}

static inline int64_t ceil_div(int64_t a, int64_t b) {
    return a <= 0 ? 0 : (a + b - 1) / b;
}

/* Prefetch one row into the caches (a row is row_bytes, i.e. tens of cache lines). */
static inline void prefetch_row(const uint8_t *row, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64)
        __builtin_prefetch(row + off, 0, 3);
}

enum {
    NEURON_CHUNK = 16, /* neurons whose gates are computed before their up/down rows are read */
    ROUTE_CHUNK = 64   /* routes of one expert handled together (gate activations kept) */
};

/* Neurons [j0, j1) of one expert, for routes [r0, r1) (all routes of that expert in the block).
 * Phase 1 computes the gates of a chunk of neurons; phase 2 reads the up/down rows of the
 * neurons that are active for some route. In sparse mode the gate rows are strided (every third
 * row) and the up/down rows are a data-dependent gather, which the hardware prefetcher does not
 * follow, so both are prefetched in software a little ahead of use. */
static int64_t expert_neurons(const moe_ctx *c, const uint8_t *expert, int64_t j0, int64_t j1,
                              int r0, int r1, float *acc, float *down_f32) {
    const size_t rb = c->row_bytes;
    const int n_embd = c->n_embd;
    const float thr = c->threshold;
    const int sparse = thr > 0.0f;
    const pyrt_dot_fn dot = c->ops->dot;
    const pyrt_axpy_fn axpy = c->ops->axpy;
    const pyrt_axpy_fn axpy_f32 = c->ops_f32->axpy;
    float act[NEURON_CHUNK][ROUTE_CHUNK];   /* act(g . x) per (neuron, route) */
    uint8_t on[NEURON_CHUNK][ROUTE_CHUNK];  /* 0: skipped (under the threshold) */
    int64_t active = 0;
    for (int rc = r0; rc < r1; rc += ROUTE_CHUNK) {
        const int nr = r1 - rc < ROUTE_CHUNK ? r1 - rc : ROUTE_CHUNK;
        for (int64_t jc = j0; jc < j1; jc += NEURON_CHUNK) {
            const int nj = j1 - jc < NEURON_CHUNK ? (int)(j1 - jc) : NEURON_CHUNK;
            int list[NEURON_CHUNK], n_list = 0, n_routes_of[NEURON_CHUNK];
            /* phase 1: gates */
            for (int i = 0; i < nj; i++) {
                const uint8_t *gate = expert + (size_t)(jc + i) * 3 * rb;
                /* the next chunk's rows: its gate rows (sparse), all three rows (dense) */
                if (jc + i + NEURON_CHUNK < j1)
                    prefetch_row(gate + (size_t)NEURON_CHUNK * 3 * rb, sparse ? rb : 3 * rb);
                int n_on = 0;
                for (int r = 0; r < nr; r++) {
                    const int t = c->route_tok[rc + r];
                    const void *xt = c->xv + (size_t)(c->t0 + t) * c->xv_stride;
                    const float a = activate(c->activation, dot(gate, xt, n_embd));
                    /* sparse: a neuron under the threshold skips its up and down rows */
                    act[i][r] = a;
                    on[i][r] = !(fabsf(a) < thr); /* NaN stays on, so it propagates */
                    n_on += on[i][r];
                }
                n_routes_of[n_list] = n_on;
                if (n_on > 0)
                    list[n_list++] = i;
                active += n_on;
            }
            /* phase 2: up and down rows of the active neurons */
            if (sparse)
                for (int l = 0; l < n_list && l < 2; l++)
                    prefetch_row(expert + ((size_t)(jc + list[l]) * 3 + 1) * rb, 2 * rb);
            for (int l = 0; l < n_list; l++) {
                const int i = list[l];
                const uint8_t *up = expert + ((size_t)(jc + i) * 3 + 1) * rb;
                const uint8_t *down = up + rb;
                if (sparse && l + 2 < n_list)
                    prefetch_row(expert + ((size_t)(jc + list[l + 2]) * 3 + 1) * rb, 2 * rb);
                /* Several tokens on this neuron: dequantize the down row once, then f32 axpys. */
                const int shared = n_routes_of[l] > 1 && down_f32 != NULL;
                if (shared) {
                    memset(down_f32, 0, (size_t)n_embd * sizeof *down_f32);
                    axpy(1.0f, down, down_f32, n_embd);
                }
                for (int r = 0; r < nr; r++) {
                    if (!on[i][r])
                        continue;
                    const float a = act[i][r];
                    const int t = c->route_tok[rc + r];
                    const void *xt = c->xv + (size_t)(c->t0 + t) * c->xv_stride;
                    const float h = c->route_w[rc + r] * a * dot(up, xt, n_embd);
                    if (shared)
                        axpy_f32(h, down_f32, acc + (size_t)t * n_embd, n_embd);
                    else
                        axpy(h, down, acc + (size_t)t * n_embd, n_embd);
                }
            }
        }
    }
    return active;
}

static void task_experts(void *p, int ith, int nth) {
    moe_ctx *c = p;
    float *acc = c->acc + (size_t)ith * c->acc_stride;
    float *down_f32 = c->down_f32 ? c->down_f32 + (size_t)ith * c->down_stride : NULL;
    memset(acc, 0, (size_t)c->tb * c->n_embd * sizeof *acc);
    const int64_t total = c->cost_start[c->n_used];
    const int64_t lo = total * ith / nth, hi = total * (ith + 1) / nth;
    int64_t active = 0;
    for (int u = 0; u < c->n_used; u++) {
        const int64_t base = c->cost_start[u], end = c->cost_start[u + 1];
        if (end <= lo || base >= hi)
            continue;
        /* Neuron j of this expert belongs to the thread whose range holds base + j * cost. */
        const int64_t cost = (end - base) / c->n_ff;
        const int64_t j0 = ceil_div(lo - base, cost);
        int64_t j1 = ceil_div(hi - base, cost);
        if (j1 > c->n_ff)
            j1 = c->n_ff;
        const uint8_t *expert = c->gud + (size_t)c->used[u] * c->n_ff * 3 * c->row_bytes;
        active += expert_neurons(c, expert, j0, j1, c->route_start[u], c->route_start[u + 1], acc,
                                 down_f32);
    }
    c->active[(size_t)ith * 8] += active;
}

static void task_reduce(void *p, int ith, int nth) {
    moe_ctx *c = p;
    const size_t n = (size_t)c->tb * c->n_embd;
    const size_t lo = n * ith / nth, hi = n * (ith + 1) / nth;
    float *y = c->y + (size_t)c->t0 * c->n_embd;
    for (size_t i = lo; i < hi; i++) {
        float s = 0.0f;
        for (int t = 0; t < nth; t++)
            s += c->acc[(size_t)t * c->acc_stride + i];
        y[i] = s;
    }
}

/* Group the block's routes by expert (counting sort) and price each expert's neurons. */
static void plan_block(moe_ctx *c) {
    memset(c->counts, 0, (size_t)c->n_expert * sizeof *c->counts);
    const int32_t *ids = c->ids + (size_t)c->t0 * c->k;
    const float *w = c->w + (size_t)c->t0 * c->k;
    const int n_routes = c->tb * c->k;
    for (int r = 0; r < n_routes; r++)
        c->counts[ids[r]]++;
    c->n_used = 0;
    int start = 0;
    for (int e = 0; e < c->n_expert; e++) {
        if (c->counts[e] == 0)
            continue;
        const int u = c->n_used++;
        c->used[u] = e;
        c->route_start[u] = start;
        /* Cost of one neuron: reading its rows (~1) plus one unit per routed token. */
        c->cost_start[u + 1] = (int64_t)c->n_ff * (1 + c->counts[e]);
        start += c->counts[e];
        c->counts[e] = u; /* from here on: expert -> its index in used[] */
    }
    c->route_start[c->n_used] = start;
    c->cost_start[0] = 0;
    for (int u = 0; u < c->n_used; u++)
        c->cost_start[u + 1] += c->cost_start[u];
    /* Scatter routes; fill[u] walks route_start[u] .. route_start[u+1]. fill lives in the
     * n_used spare ints after route_tok's n_routes (see the workspace layout). */
    int *fill = c->route_tok + n_routes;
    for (int u = 0; u < c->n_used; u++)
        fill[u] = c->route_start[u];
    for (int r = 0; r < n_routes; r++) {
        const int u = c->counts[ids[r]];
        const int slot = fill[u]++;
        c->route_tok[slot] = r / c->k;
        c->route_w[slot] = w[r];
    }
}

/* ---- entry point --------------------------------------------------------------------------- */

static size_t align64(size_t n) {
    return (n + 63) & ~(size_t)63;
}

static int check_args(const pyrt_pool *pool, const void *gud, size_t gud_bytes, int fmt,
                      int n_expert, int n_ff, int n_embd, const float *x, int n_tokens,
                      const int32_t *topk_ids, const float *topk_w, int k, int activation,
                      float threshold, const float *y) {
    const char *fn = "pyrt_moe_ffn";
    if (pool == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: pool is NULL (create one with pyrt_pool_create)", fn);
    if (gud == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: gud (expert weights) is NULL", fn);
    if (x == NULL || topk_ids == NULL || topk_w == NULL || y == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: %s is NULL", fn,
                         x == NULL ? "x" : topk_ids == NULL ? "topk_ids"
                                        : topk_w == NULL   ? "topk_w"
                                                           : "y");
    if (pyrt_row_ops_scalar(fmt) == NULL)
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: unknown weight format %d (supported: 0 F32, 1 F16, 30 BF16, 8 Q8_0, "
                         "2 Q4_0)", fn, fmt);
    if (n_expert < 1 || n_ff < 1 || n_embd < 1 || k < 1 || n_tokens < 0)
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: sizes must be positive: n_expert=%d n_ff=%d n_embd=%d k=%d "
                         "n_tokens=%d", fn, n_expert, n_ff, n_embd, k, n_tokens);
    const size_t rb = pyrt_row_bytes(fmt, n_embd);
    if (rb == 0)
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: n_embd=%d is not a multiple of 32, which format %d (quantized in "
                         "blocks of 32) needs", fn, n_embd, fmt);
    const double need = (double)n_expert * n_ff * 3.0 * (double)rb;
    if (need != (double)gud_bytes)
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: weights hold %zu bytes but n_expert=%d x n_ff=%d x 3 rows x %zu "
                         "bytes/row need %.0f: wrong shape or format for this tensor",
                         fn, gud_bytes, n_expert, n_ff, rb, need);
    const size_t elem = fmt == PYRT_FMT_F32                             ? 4
                        : (fmt == PYRT_FMT_F16 || fmt == PYRT_FMT_BF16) ? 2
                                                                        : 1;
    if ((uintptr_t)gud % elem != 0)
        return pyrt_fail(PYRT_E_INVALID, "%s: weights pointer is not %zu-byte aligned", fn, elem);
    if ((uintptr_t)x % 4 || (uintptr_t)y % 4 || (uintptr_t)topk_w % 4 || (uintptr_t)topk_ids % 4)
        return pyrt_fail(PYRT_E_INVALID, "%s: x, y, topk_ids, topk_w must be 4-byte aligned", fn);
    if (activation < PYRT_ACT_SILU || activation > PYRT_ACT_GELU_ERF)
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: unknown activation %d (0 silu, 1 gelu tanh, 2 gelu erf)", fn,
                         activation);
    if (!(threshold >= 0.0f) || isinf(threshold))
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: threshold must be finite and >= 0 (0 = dense), got %g", fn,
                         (double)threshold);
    for (int64_t i = 0; i < (int64_t)n_tokens * k; i++)
        if (topk_ids[i] < 0 || topk_ids[i] >= n_expert)
            return pyrt_fail(PYRT_E_INVALID,
                             "%s: topk_ids[%lld, %lld] = %d is outside [0, n_expert=%d)", fn,
                             (long long)(i / k), (long long)(i % k), (int)topk_ids[i], n_expert);
    return PYRT_OK;
}

int pyrt_moe_ffn(pyrt_pool *pool, const void *gud, size_t gud_bytes, int fmt, int n_expert,
                 int n_ff, int n_embd, const float *x, int n_tokens, const int32_t *topk_ids,
                 const float *topk_w, int k, int activation, float threshold, float *y,
                 int64_t *n_active) {
    pyrt_clear_error();
    int rc = check_args(pool, gud, gud_bytes, fmt, n_expert, n_ff, n_embd, x, n_tokens, topk_ids,
                        topk_w, k, activation, threshold, y);
    if (rc != PYRT_OK)
        return rc;
    if (n_active != NULL)
        *n_active = 0;
    if (n_tokens == 0)
        return PYRT_OK;

    const int quantized = fmt == PYRT_FMT_Q8_0 || fmt == PYRT_FMT_Q4_0;
    const int nth = pyrt_pool_threads(pool);
    const int tb_max = n_tokens < TOKEN_BLOCK ? n_tokens : TOKEN_BLOCK;
    const int routes = tb_max * k;
    const int used_max = routes < n_expert ? routes : n_expert;
    const size_t acc_stride = align64((size_t)tb_max * n_embd * sizeof(float)) / sizeof(float);
    const size_t xq_bytes =
        quantized ? (size_t)n_tokens * (n_embd / PYRT_QK) * sizeof(pyrt_xq8) : 0;

    /* Workspace layout (each piece 64-byte aligned). */
    size_t off_acc = 0;
    size_t off_active = off_acc + (size_t)nth * acc_stride * sizeof(float);
    size_t off_xq = off_active + align64((size_t)nth * 8 * sizeof(int64_t));
    size_t off_counts = off_xq + align64(xq_bytes);
    size_t off_used = off_counts + align64((size_t)n_expert * sizeof(int));
    size_t off_rstart = off_used + align64((size_t)used_max * sizeof(int));
    size_t off_rtok = off_rstart + align64((size_t)(used_max + 1) * sizeof(int));
    size_t off_rw = off_rtok + align64((size_t)(routes + used_max) * sizeof(int));
    size_t off_cost = off_rw + align64((size_t)routes * sizeof(float));
    const size_t down_stride =
        fmt == PYRT_FMT_F32 ? 0 : align64((size_t)n_embd * sizeof(float)) / sizeof(float);
    size_t off_down = off_cost + align64((size_t)(used_max + 1) * sizeof(int64_t));
    size_t total = off_down + (size_t)nth * down_stride * sizeof(float);

    pyrt_pool_acquire(pool);
    uint8_t *ws = pyrt_pool_workspace(pool, total);
    if (ws == NULL) {
        pyrt_pool_release(pool);
        return pyrt_fail(PYRT_E_NOMEM, "pyrt_moe_ffn: cannot allocate %zu bytes of workspace",
                         total);
    }
    moe_ctx c = {
        .gud = gud,
        .row_bytes = pyrt_row_bytes(fmt, n_embd),
        .ops = pyrt_row_ops_active(fmt),
        .ops_f32 = pyrt_row_ops_active(PYRT_FMT_F32),
        .n_expert = n_expert,
        .n_ff = n_ff,
        .n_embd = n_embd,
        .activation = activation,
        .threshold = threshold,
        .x = x,
        .ids = topk_ids,
        .w = topk_w,
        .n_tokens = n_tokens,
        .k = k,
        .y = y,
        .xq = quantized ? (pyrt_xq8 *)(ws + off_xq) : NULL,
        .used = (int *)(ws + off_used),
        .route_start = (int *)(ws + off_rstart),
        .route_tok = (int *)(ws + off_rtok),
        .route_w = (float *)(ws + off_rw),
        .cost_start = (int64_t *)(ws + off_cost),
        .counts = (int *)(ws + off_counts),
        .acc = (float *)(ws + off_acc),
        .acc_stride = acc_stride,
        .active = (int64_t *)(ws + off_active),
        .down_f32 = down_stride ? (float *)(ws + off_down) : NULL,
        .down_stride = down_stride,
    };
    memset(c.active, 0, (size_t)nth * 8 * sizeof(int64_t));
    if (quantized) {
        pyrt_pool_run(pool, task_quantize, &c);
        c.xv = (const uint8_t *)c.xq;
        c.xv_stride = (size_t)(n_embd / PYRT_QK) * sizeof(pyrt_xq8);
    } else {
        c.xv = (const uint8_t *)x;
        c.xv_stride = (size_t)n_embd * sizeof(float);
    }
    for (c.t0 = 0; c.t0 < n_tokens; c.t0 += TOKEN_BLOCK) {
        c.tb = n_tokens - c.t0 < TOKEN_BLOCK ? n_tokens - c.t0 : TOKEN_BLOCK;
        plan_block(&c);
        pyrt_pool_run(pool, task_experts, &c);
        pyrt_pool_run(pool, task_reduce, &c);
    }
    int64_t sum = 0;
    for (int t = 0; t < nth; t++)
        sum += c.active[(size_t)t * 8];
    pyrt_pool_release(pool);
    if (n_active != NULL)
        *n_active = sum;
    return PYRT_OK;
}

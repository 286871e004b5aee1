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
 * Per neuron j of expert e and route (t, w):  a = act(g_j . x_t); skip if |a| < threshold;
 * h = w * a * (u_j . x_t); y_t += h * d_j (an axpy: the down row is the transposed column).
 * Dense computes g_j . x and u_j . x in one pass over x (dot2); the down rows of up to
 * PYRT_AXPY_ROWS active neurons go into y_t in one pass over y (axpyn, y held in registers). */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "decode_internal.h"

enum {
    TOKEN_BLOCK = 64,
    MAX_ITEMS_PER_THREAD = 8, /* guided items come to ~6.2 per thread */
    ITEMS_ACC_BYTES = 16 << 20, /* cap on the work items' partial ys together */
    SERIAL_QUANTIZE_MAX = 1 << 15 /* activations (tokens * n_embd) quantized without the pool */
};

typedef struct {
    /* weights: row r (0 gate, 1 up, 2 down) of neuron j of expert e starts at
     * gud + ((e * n_ff + j) * 3 + r) * row_bytes */
    const uint8_t *gud;
    size_t row_bytes;
    const pyrt_row_ops *ops;
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
    float *acc;             /* [n_items, acc_stride] per-work-item partial y of the block */
    int n_items;            /* work items the block's neurons are cut into */
    int n_items_max;        /* room in acc and item_start */
    int64_t *item_start;    /* [n_items + 1] item i: costs [item_start[i], item_start[i+1]) */
    atomic_int *next_item;  /* next item to take (own cache line) */
    atomic_int *item_done;  /* [n_items_max] 1 once the item's partial y is complete */
    atomic_int *next_slice; /* next range of y to reduce (own cache line) */
    size_t acc_stride;      /* floats, >= TOKEN_BLOCK * n_embd, multiple of 16 */
    int64_t *active;        /* [nth * 8] per-thread active-neuron counters (own cache line) */
    int prefetch_ahead;     /* neurons ahead whose rows are software-prefetched (0: none) */
    int reduce_pf;          /* reduce: items ahead whose part of the range is prefetched */
    pyrt_add_fn ops_add;    /* y += partial y (the active SIMD level's) */
    pyrt_pool *pool;        /* for the idle prefetch while a reducer waits on an item */
    int nth;
    /* pyrt_moe_ffn_routed: the router's job and the routing, in the experts' pool task */
    pyrt_task_fn before; /* run by every thread first (NULL: none) */
    void *before_ctx;
    pyrt_mv_job *router;
    pyrt_route_fn route;
    void *route_ctx;
    int32_t *route_ids;     /* what route writes: c->ids, c->w point at them */
    float *route_wts;
    _Alignas(64) atomic_llong router_rows; /* router rows (out[0]) computed (own cache line) */
    _Alignas(64) atomic_int planned;       /* 1 once the routes and items are planned */
} moe_ctx;

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

/* ---- software prefetch ---------------------------------------------------------------------
 * Rows are prefetched a few neurons ahead of use. The line addresses of what to prefetch are
 * handed to the row kernels (dot_pf / dot2_pf), which spread them over their loops: a burst of
 * one neuron's ~100 lines would stall the core on full line-fill buffers, so that the weight
 * stream and the arithmetic would take turns instead of overlapping (one thread streamed 5.8
 * GB/s through the kernel against 10.3 GB/s in the read test with bursts). */

enum {
    PF_MAX_LINES = 512,           /* line addresses for one neuron's kernels (32 KiB of rows) */
    NEURON_CHUNK = 32,            /* sparse: neurons whose gates go before their up/down rows */
    DENSE_CHUNK = PYRT_AXPY_ROWS, /* dense: neurons whose down rows go out in one axpyn pass */
    ROUTE_CHUNK = 64              /* routes of one expert handled together (>= TOKEN_BLOCK) */
};

/* Prefetch one region now, in a burst (where no spread is possible). */
static inline void prefetch_row(const uint8_t *row, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64)
        __builtin_prefetch(row + off, 0, 3);
}

/* Appends the addresses of the cache lines covering [p, p + bytes) to lines[*n], up to
 * PF_MAX_LINES in all. */
static inline void add_lines(const void **lines, int *n, const uint8_t *p, size_t bytes) {
    const uint8_t *line = p - ((uintptr_t)p & 63);
    for (; line < p + bytes && *n < PF_MAX_LINES; line += 64)
        lines[(*n)++] = line;
}

static inline void prefetch_lines(const void *const *lines, int n) {
    for (int i = 0; i < n; i++)
        __builtin_prefetch(lines[i], 0, 3);
}

/* The row kernels with prefetches, or the plain ones after a burst where a level has none. */
static inline void dot2_pf(const moe_ctx *c, const uint8_t *gate, const void *xt, float gu[2],
                           const void *const *pf, int n_pf) {
    const pyrt_row_ops *ops = c->ops;
    const int n = c->n_embd;
    if (ops->dot2_pf != NULL) {
        ops->dot2_pf(gate, gate + c->row_bytes, xt, n, gu, pf, n_pf);
        return;
    }
    prefetch_lines(pf, n_pf);
    if (ops->dot2 != NULL) {
        ops->dot2(gate, gate + c->row_bytes, xt, n, gu);
    } else {
        gu[0] = ops->dot(gate, xt, n);
        gu[1] = ops->dot(gate + c->row_bytes, xt, n);
    }
}

static inline float dot_pf(const moe_ctx *c, const uint8_t *row, const void *xt,
                           const void *const *pf, int n_pf) {
    if (c->ops->dot_pf != NULL)
        return c->ops->dot_pf(row, xt, c->n_embd, pf, n_pf);
    prefetch_lines(pf, n_pf);
    return c->ops->dot(row, xt, c->n_embd);
}

/* y += sum_r a[r] * rows[r] for nr rows, in row order. */
static inline void axpy_rows(const moe_ctx *c, int nr, const float *a, const void *const *rows,
                             float *y) {
    if (c->ops->axpyn != NULL) {
        for (int r0 = 0; r0 < nr; r0 += PYRT_AXPY_ROWS) {
            const int m = nr - r0 < PYRT_AXPY_ROWS ? nr - r0 : PYRT_AXPY_ROWS;
            c->ops->axpyn(m, a + r0, rows + r0, y, c->n_embd);
        }
    } else {
        for (int r = 0; r < nr; r++)
            c->ops->axpy(a[r], rows[r], y, c->n_embd);
    }
}

static inline const void *token_x(const moe_ctx *c, int route) {
    return c->xv + (size_t)(c->t0 + c->route_tok[route]) * c->xv_stride;
}

/* ---- dense --------------------------------------------------------------------------------- */

/* Down rows into one y with prefetches spread through the pass (or a burst, then axpy_rows). */
static inline void axpy_rows_pf(const moe_ctx *c, int nr, const float *a, const void *const *rows,
                                float *y, const void *const *pf, int n_pf) {
    if (c->ops->axpyn_pf != NULL && nr <= PYRT_AXPY_ROWS) {
        c->ops->axpyn_pf(nr, a, rows, y, c->n_embd, pf, n_pf);
        return;
    }
    prefetch_lines(pf, n_pf);
    axpy_rows(c, nr, a, rows, y);
}

/* A software-prefetch cursor that runs `ahead` neurons before the reads through a contiguous
 * stream of rows and advances by what each kernel call consumes, so prefetches are issued at
 * the pace the rows are used (a steady distance, no bursts, no idle phases). */
typedef struct {
    const uint8_t *at, *end;
} pf_cursor;

/* The next `bytes` of the stream as line addresses in lines[*n] (fewer at the stream's end). */
static inline void pf_cursor_take(pf_cursor *pc, size_t bytes, const void **lines, int *n) {
    if (pc->at >= pc->end)
        return;
    if (bytes > (size_t)(pc->end - pc->at))
        bytes = (size_t)(pc->end - pc->at);
    add_lines(lines, n, pc->at, bytes);
    pc->at += bytes;
}

/* Neurons [j0, j1) of one expert for its routes [r0, r1): per neuron, gate and up dots in one
 * pass over x (dot2) for each route, then every DENSE_CHUNK neurons their down rows into each
 * route's y in one pass (axpyn, y in registers). The rows of [j0, j1) are one contiguous stream;
 * a prefetch cursor `ahead` neurons on advances by 2 rows per dot2 phase of a neuron and by the
 * chunk's down rows per axpyn phase, its lines split across the routes' calls (with only the
 * dot2 calls prefetching, the memory idled through every axpyn pass). */
static int64_t dense_neurons(const moe_ctx *c, const uint8_t *expert, int64_t j0, int64_t j1,
                             int r0, int r1, float *acc) {
    const size_t rb = c->row_bytes, nrb = 3 * rb; /* bytes of one row, of one neuron */
    const int ahead = c->prefetch_ahead;
    const void *pf[PF_MAX_LINES];
    float h[ROUTE_CHUNK][DENSE_CHUNK]; /* w * act(g . x) * (u . x) per route and neuron */
    const void *down[DENSE_CHUNK];
    pf_cursor pc = {expert + (size_t)j0 * nrb, expert + (size_t)j1 * nrb};
    if (ahead > 0) { /* the first `ahead` neurons, in a burst; the cursor runs from there */
        const size_t lead = (size_t)ahead * nrb;
        prefetch_row(pc.at, lead < (size_t)(pc.end - pc.at) ? lead : (size_t)(pc.end - pc.at));
        pc.at = lead < (size_t)(pc.end - pc.at) ? pc.at + lead : pc.end;
    } else {
        pc.at = pc.end;
    }
    for (int rc = r0; rc < r1; rc += ROUTE_CHUNK) {
        const int nr = r1 - rc < ROUTE_CHUNK ? r1 - rc : ROUTE_CHUNK;
        for (int64_t jc = j0; jc < j1; jc += DENSE_CHUNK) {
            const int nj = j1 - jc < DENSE_CHUNK ? (int)(j1 - jc) : DENSE_CHUNK;
            for (int i = 0; i < nj; i++) {
                const uint8_t *gate = expert + (size_t)(jc + i) * nrb;
                int n_pf = 0;
                pf_cursor_take(&pc, 2 * rb, pf, &n_pf);
                for (int r = 0; r < nr; r++) {
                    const int lo = n_pf * r / nr, hi = n_pf * (r + 1) / nr;
                    float gu[2];
                    dot2_pf(c, gate, token_x(c, rc + r), gu, pf + lo, hi - lo);
                    h[r][i] = c->route_w[rc + r] * pyrt_activate(c->activation, gu[0]) * gu[1];
                }
                down[i] = gate + 2 * rb;
            }
            int n_pf = 0;
            pf_cursor_take(&pc, (size_t)nj * rb, pf, &n_pf);
            for (int r = 0; r < nr; r++) {
                const int lo = n_pf * r / nr, hi = n_pf * (r + 1) / nr;
                axpy_rows_pf(c, nj, h[r], down, acc + (size_t)c->route_tok[rc + r] * c->n_embd,
                             pf + lo, hi - lo);
            }
        }
    }
    return (j1 - j0) * (r1 - r0);
}

/* ---- sparse -------------------------------------------------------------------------------- */

/* A chunk of neurons whose gates are done: which are active for which route, and their h; and
 * where its results go (its expert's rows, its routes, its work item's partial y). */
typedef struct {
    const uint8_t *expert;
    float *acc;
    int item, rc, nr;
    int64_t jc;
    int n_list;
    int list[NEURON_CHUNK];                /* neurons active for some route (offsets from jc) */
    float h[NEURON_CHUNK][ROUTE_CHUNK];    /* act(g . x), then w * act * (u . x) */
    uint8_t on[NEURON_CHUNK][ROUTE_CHUNK]; /* 0: under the threshold, skipped */
} sparse_chunk;

/* One thread's software pipeline over its sparse chunks, carried across experts and work items:
 * the up/down rows of a chunk are read while the gates of the thread's next chunk (whatever
 * expert or item it belongs to) are computed, so that only the thread's very last chunk waits
 * on a gather. */
typedef struct {
    sparse_chunk chunks[2];
    int cur;            /* the chunk to fill next */
    sparse_chunk *prev; /* gates done, up/down rows still to read; or NULL */
} sparse_pipe;

/* Walks the up+down rows (2 * row_bytes, contiguous) of a chunk's active neurons line by line,
 * handing out their addresses for prefetching. */
typedef struct {
    const sparse_chunk *ch;
    int l;             /* active neuron (index into ch->list) being walked */
    const uint8_t *at; /* next line of it */
} gather_lines;

static inline const uint8_t *up_row(const moe_ctx *c, const sparse_chunk *ch, int i) {
    return ch->expert + ((size_t)(ch->jc + i) * 3 + 1) * c->row_bytes;
}

static inline const uint8_t *line_of(const uint8_t *p) {
    return p - ((uintptr_t)p & 63);
}

static void gather_begin(gather_lines *g, const moe_ctx *c, const sparse_chunk *ch) {
    g->ch = ch;
    g->l = 0;
    g->at = NULL;
    if (ch != NULL && ch->n_list > 0)
        g->at = line_of(up_row(c, ch, ch->list[0]));
}

/* Appends up to `count` more line addresses to lines[*n]. */
static void gather_take(gather_lines *g, const moe_ctx *c, int count, const void **lines,
                        int *n) {
    while (count > 0 && g->ch != NULL && g->l < g->ch->n_list && *n < PF_MAX_LINES) {
        const uint8_t *end = up_row(c, g->ch, g->ch->list[g->l]) + 2 * c->row_bytes;
        for (; g->at < end && count > 0 && *n < PF_MAX_LINES; g->at += 64, count--)
            lines[(*n)++] = g->at;
        if (g->at >= end && ++g->l < g->ch->n_list)
            g->at = line_of(up_row(c, g->ch, g->ch->list[g->l]));
    }
}

/* The gate rows of one expert's neurons [next, end) not prefetched yet (every third row). The
 * gate phase keeps it `ahead` neurons before its reads; the up/down phase of the previous chunk,
 * which reads gathered rows the gate prefetches do not cover, moves it on by two gates per
 * active neuron (as many rows as it reads), up to `limit`, so the memory does not idle there. */
typedef struct {
    const uint8_t *expert;
    int64_t next, end, limit;
} gate_cursor;

static void gate_cursor_take(const moe_ctx *c, gate_cursor *gc, int64_t upto, const void **lines,
                             int *n) {
    if (gc == NULL)
        return;
    upto = upto < gc->end ? upto : gc->end;
    for (; gc->next < upto; gc->next++)
        add_lines(lines, n, gc->expert + (size_t)gc->next * 3 * c->row_bytes, c->row_bytes);
}

/* Gates of the chunk's nj neurons. While they run, the kernels prefetch the gate row `ahead`
 * neurons on (within [.., j1)) and an even share of `prev`'s active up/down rows (a gather the
 * hardware prefetcher cannot follow), so those are in cache when `prev` is finished. */
static int64_t sparse_gates(const moe_ctx *c, sparse_chunk *ch, int nj, gate_cursor *gc,
                            const sparse_chunk *prev) {
    const size_t rb = c->row_bytes;
    const int ahead = c->prefetch_ahead, nr = ch->nr, rc = ch->rc;
    const float thr = c->threshold;
    const int prev_lines = prev == NULL ? 0 : prev->n_list * (int)((2 * rb + 63) / 64 + 1);
    const int share = (prev_lines + nj - 1) / nj;
    const void *pf[PF_MAX_LINES];
    gather_lines g;
    gather_begin(&g, c, prev);
    int64_t active = 0;
    ch->n_list = 0;
    for (int i = 0; i < nj; i++) {
        const uint8_t *gate = ch->expert + (size_t)(ch->jc + i) * 3 * rb;
        int n_pf = 0;
        if (ahead > 0)
            gate_cursor_take(c, gc, ch->jc + i + ahead + 1, pf, &n_pf);
        gather_take(&g, c, share, pf, &n_pf);
        int n_on = 0;
        for (int r = 0; r < nr; r++) {
            const int lo = n_pf * r / nr, hi = n_pf * (r + 1) / nr;
            const float a = pyrt_activate(c->activation,
                                          dot_pf(c, gate, token_x(c, rc + r), pf + lo, hi - lo));
            ch->h[i][r] = a;
            ch->on[i][r] = !(fabsf(a) < thr); /* NaN stays on, so it propagates */
            n_on += ch->on[i][r];
        }
        if (n_on > 0)
            ch->list[ch->n_list++] = i;
        active += n_on;
    }
    return active;
}

/* Up dots and down rows of a chunk's active neurons, into its item's partial y. `prefetched`:
 * their rows were prefetched during the next chunk's gates; else (the thread's last chunk) each
 * up dot prefetches the rows of the active neuron two on. */
static void sparse_finish(const moe_ctx *c, sparse_chunk *ch, int prefetched, gate_cursor *gc) {
    const size_t rb = c->row_bytes;
    const int rc = ch->rc, nr = ch->nr;
    const void *pf[PF_MAX_LINES];
    if (!prefetched)
        for (int l = 0; l < ch->n_list && l < 2; l++)
            prefetch_row(up_row(c, ch, ch->list[l]), 2 * rb);
    for (int l = 0; l < ch->n_list; l++) {
        const int i = ch->list[l];
        const uint8_t *up = up_row(c, ch, i);
        int n_pf = 0;
        if (!prefetched && l + 2 < ch->n_list)
            add_lines(pf, &n_pf, up_row(c, ch, ch->list[l + 2]), 2 * rb);
        if (gc != NULL && gc->next < gc->limit)
            gate_cursor_take(c, gc, gc->next + 1 < gc->limit ? gc->next + 1 : gc->limit, pf, &n_pf);
        int first = 1;
        for (int r = 0; r < nr; r++) {
            if (!ch->on[i][r])
                continue;
            const float a = ch->h[i][r];
            const float u = dot_pf(c, up, token_x(c, rc + r), pf, first ? n_pf : 0);
            first = 0;
            ch->h[i][r] = c->route_w[rc + r] * a * u;
        }
    }
    /* down rows, per route, in neuron order, several per pass over that token's y */
    for (int r = 0; r < nr; r++) {
        float a[NEURON_CHUNK];
        const void *rows[NEURON_CHUNK];
        int n = 0;
        for (int l = 0; l < ch->n_list; l++) {
            const int i = ch->list[l];
            if (ch->on[i][r]) {
                a[n] = ch->h[i][r];
                rows[n++] = up_row(c, ch, i) + rb;
            }
        }
        float *y = ch->acc + (size_t)c->route_tok[rc + r] * c->n_embd;
        for (int r0 = 0; r0 < n; r0 += PYRT_AXPY_ROWS) {
            const int m = n - r0 < PYRT_AXPY_ROWS ? n - r0 : PYRT_AXPY_ROWS;
            int n_pf = 0;
            if (r == 0 && gc != NULL && gc->next < gc->limit)
                gate_cursor_take(c, gc, gc->next + m < gc->limit ? gc->next + m : gc->limit, pf,
                                 &n_pf);
            axpy_rows_pf(c, m, a + r0, rows + r0, y, pf, n_pf);
        }
    }
}

static inline void mark_item_done(const moe_ctx *c, int item) {
    atomic_store_explicit(&c->item_done[item], 1, memory_order_release);
}

/* Finishes the pipeline's pending chunk; marks its item done when the thread has moved on to
 * another item (`item_now`; -1: none, the thread's last chunk). */
static void sparse_pipe_flush(const moe_ctx *c, sparse_pipe *pp, int prefetched, int item_now,
                              gate_cursor *gc) {
    sparse_chunk *prev = pp->prev;
    if (prev == NULL)
        return;
    sparse_finish(c, prev, prefetched, gc);
    if (prev->item != item_now)
        mark_item_done(c, prev->item);
    pp->prev = NULL;
}

/* Neurons [j0, j1) of one expert for its routes [r0, r1), neuron-sparse: per chunk of
 * NEURON_CHUNK neurons the gates, then (one chunk later, software-pipelined) the up and down
 * rows of the neurons whose |act| reaches the threshold. Down rows go into each y in neuron
 * order, as in dense, so a threshold that drops nothing gives dense's bits. */
static int64_t sparse_neurons(const moe_ctx *c, sparse_pipe *pp, int item, const uint8_t *expert,
                              int64_t j0, int64_t j1, int r0, int r1, float *acc) {
    const size_t rb = c->row_bytes;
    const int ahead = c->prefetch_ahead;
    int64_t active = 0;
    for (int rc = r0; rc < r1; rc += ROUTE_CHUNK) {
        const int nr = r1 - rc < ROUTE_CHUNK ? r1 - rc : ROUTE_CHUNK;
        /* the first `ahead` gates in a burst; the cursor runs from there (nowhere if ahead 0) */
        gate_cursor gc = {expert, j0 + ahead < j1 ? j0 + ahead : j1, ahead > 0 ? j1 : j0, j0};
        for (int64_t j = j0; j < gc.next; j++)
            prefetch_row(expert + (size_t)j * 3 * rb, rb);
        for (int64_t jc = j0; jc < j1; jc += NEURON_CHUNK) {
            const int nj = j1 - jc < NEURON_CHUNK ? (int)(j1 - jc) : NEURON_CHUNK;
            sparse_chunk *ch = &pp->chunks[pp->cur];
            *ch = (sparse_chunk){.expert = expert, .acc = acc, .item = item, .rc = rc, .nr = nr,
                                 .jc = jc};
            active += sparse_gates(c, ch, nj, &gc, pp->prev);
            gc.limit = jc + nj + NEURON_CHUNK; /* at most the next chunk's gates */
            sparse_pipe_flush(c, pp, 1, item, &gc);
            pp->prev = ch;
            pp->cur ^= 1;
        }
    }
    return active;
}

/* One work item: the neurons whose estimated cost falls in [item_start[item],
 * item_start[item + 1]), accumulated into the item's own partial y. Dense marks the item done
 * at its end; sparse when its last chunk leaves the pipeline. */
static int64_t run_item(const moe_ctx *c, sparse_pipe *pp, int item) {
    float *acc = c->acc + (size_t)item * c->acc_stride;
    memset(acc, 0, (size_t)c->tb * c->n_embd * sizeof *acc);
    const int64_t lo = c->item_start[item], hi = c->item_start[item + 1];
    const int sparse = c->threshold > 0.0f;
    int64_t active = 0;
    for (int u = 0; u < c->n_used; u++) {
        const int64_t base = c->cost_start[u], end = c->cost_start[u + 1];
        if (end <= lo || base >= hi)
            continue;
        /* Neuron j of this expert belongs to the item whose range holds base + j * cost. */
        const int64_t cost = (end - base) / c->n_ff;
        const int64_t j0 = ceil_div(lo - base, cost);
        int64_t j1 = ceil_div(hi - base, cost);
        if (j1 > c->n_ff)
            j1 = c->n_ff;
        if (j1 <= j0)
            continue;
        const uint8_t *expert = c->gud + (size_t)c->used[u] * c->n_ff * 3 * c->row_bytes;
        const int r0 = c->route_start[u], r1 = c->route_start[u + 1];
        active += sparse ? sparse_neurons(c, pp, item, expert, j0, j1, r0, r1, acc)
                         : dense_neurons(c, expert, j0, j1, r0, r1, acc);
    }
    if (pp->prev == NULL || pp->prev->item != item)
        mark_item_done(c, item);
    return active;
}

/* One token block in one hand-off to the pool. (1) Threads take work items from a shared
 * counter: a thread that the OS preempts or that runs on a busier core delays the block by one
 * item, not by its whole share. (2) A thread out of items takes one of nth - 1 ranges of y (if
 * one is left) and sums the items' partial ys there in item order, each item as soon as it is
 * done: the sums run while the last items are computed, and the result does not depend on
 * which thread ran which item. */
static void task_block(void *p, int ith, int nth) {
    moe_ctx *c = p;
    sparse_pipe pp;
    pp.cur = 0;
    pp.prev = NULL;
    int64_t active = 0;
    for (int item; (item = atomic_fetch_add_explicit(c->next_item, 1, memory_order_relaxed)) <
                   c->n_items;)
        active += run_item(c, &pp, item);
    sparse_pipe_flush(c, &pp, 0, -1, NULL);
    c->active[(size_t)ith * 8] += active;
    const int n_ranges = nth > 1 ? nth - 1 : 1;
    const int range = atomic_fetch_add_explicit(c->next_slice, 1, memory_order_relaxed);
    if (range < n_ranges) {
        /* whole cache lines (16 floats) per range */
        const size_t n = (size_t)c->tb * c->n_embd, lines = (n + 15) / 16;
        const size_t lo = lines * range / n_ranges * 16;
        const size_t hi = lines * (range + 1) / n_ranges * 16 < n ? lines * (range + 1) / n_ranges * 16 : n;
        float *y = c->y + (size_t)c->t0 * c->n_embd;
        int pf_more = 1; /* while waiting, prefetch this thread's home of the pool's plan */
        int pf_next = 0; /* the next item whose part of the range is not prefetched */
        for (int item = 0; item < c->n_items; item++) {
            for (int spins = 0; !atomic_load_explicit(&c->item_done[item], memory_order_acquire);)
                if (!pf_more || !(pf_more = pyrt_pool_idle_prefetch(c->pool, ith)))
                    pyrt_spin_pause(++spins);
            /* The partial ys sit in the caches of the cores that made them: ask for the ranges
             * of the done items up to reduce_pf on, so the remote reads overlap (at the end of a
             * call every item is done and the sums are a chain of ~100 such reads). */
            pf_next = pf_next > item ? pf_next : item + 1;
            for (; pf_next < c->n_items && pf_next - item <= c->reduce_pf &&
                   atomic_load_explicit(&c->item_done[pf_next], memory_order_relaxed);
                 pf_next++)
                prefetch_row((const uint8_t *)(c->acc + (size_t)pf_next * c->acc_stride + lo),
                             (hi - lo) * sizeof *y);
            const float *acc = c->acc + (size_t)item * c->acc_stride;
            if (item == 0)
                memcpy(y + lo, acc + lo, (hi - lo) * sizeof *y);
            else
                c->ops_add(y + lo, acc + lo, hi - lo);
        }
    }
}

/* Cut the block's total cost into work items, guided: item sizes shrink from half a thread's
 * share to a sixteenth, so the first items amortize their start (a cold prefetch stream, a
 * partial y to clear and later sum) and the last ones are small enough that threads finish
 * within a small fraction of a share of each other (equal items, 3 per thread, measured 3%
 * slower on 16 cores). At most n_items_max (the partial ys' memory). */
static void plan_items(moe_ctx *c, int nth) {
    const int64_t total = c->cost_start[c->n_used];
    int n = 0;
    const int64_t min_size = total / (16 * (int64_t)nth) > 0 ? total / (16 * (int64_t)nth) : 1;
    int64_t lo = 0;
    while (lo < total && n < c->n_items_max - 1) {
        int64_t size = (total - lo) / (2 * (int64_t)nth);
        size = size < min_size ? min_size : size;
        c->item_start[n++] = lo;
        lo = lo + size < total ? lo + size : total;
    }
    if (lo < total || n == 0)
        c->item_start[n++] = lo;
    c->item_start[n] = total;
    c->n_items = n;
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

int pyrt_check_weights_aligned(const char *fn, const void *gud, int fmt) {
    const size_t elem = pyrt_fmt_align(fmt);
    if ((uintptr_t)gud % elem != 0)
        return pyrt_fail(PYRT_E_INVALID, "%s: weights pointer is not %zu-byte aligned", fn, elem);
    return PYRT_OK;
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
    if (pyrt_check_weights_aligned(fn, gud, fmt) != PYRT_OK)
        return PYRT_E_INVALID;
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

/* Fills *c for a call over n_tokens tokens on the pool's workspace (the caller holds the pool).
 * The activations are not quantized yet (c->xv unset). */
static int moe_setup(moe_ctx *c, pyrt_pool *pool, const void *gud, int fmt,
                     int n_expert, int n_ff, int n_embd, const float *x, int n_tokens,
                     const int32_t *topk_ids, const float *topk_w, int k, int activation,
                     float threshold, float *y) {
    const int quantized = fmt == PYRT_FMT_Q8_0 || fmt == PYRT_FMT_Q4_0;
    const int nth = pyrt_pool_threads(pool);
    const int tb_max = n_tokens < TOKEN_BLOCK ? n_tokens : TOKEN_BLOCK;
    const int routes = tb_max * k;
    const int used_max = routes < n_expert ? routes : n_expert;
    const size_t acc_stride = align64((size_t)tb_max * n_embd * sizeof(float)) / sizeof(float);
    /* Room for up to MAX_ITEMS_PER_THREAD work items per thread (plan_items), fewer when their
     * partial ys would pass ITEMS_ACC_BYTES (long prefill blocks), at least one per thread. */
    size_t n_items_max = ITEMS_ACC_BYTES / (acc_stride * sizeof(float));
    if (n_items_max > (size_t)nth * MAX_ITEMS_PER_THREAD)
        n_items_max = (size_t)nth * MAX_ITEMS_PER_THREAD;
    if (n_items_max < (size_t)nth)
        n_items_max = (size_t)nth;
    const size_t xq_bytes =
        quantized ? (size_t)n_tokens * (n_embd / PYRT_QK) * sizeof(pyrt_xq8) : 0;

    /* Workspace layout (each piece 64-byte aligned). */
    size_t off_acc = 0;
    size_t off_active = off_acc + n_items_max * acc_stride * sizeof(float);
    size_t off_xq = off_active + align64((size_t)nth * 8 * sizeof(int64_t));
    size_t off_counts = off_xq + align64(xq_bytes);
    size_t off_used = off_counts + align64((size_t)n_expert * sizeof(int));
    size_t off_rstart = off_used + align64((size_t)used_max * sizeof(int));
    size_t off_rtok = off_rstart + align64((size_t)(used_max + 1) * sizeof(int));
    size_t off_rw = off_rtok + align64((size_t)(routes + used_max) * sizeof(int));
    size_t off_cost = off_rw + align64((size_t)routes * sizeof(float));
    size_t off_istart = off_cost + align64((size_t)(used_max + 1) * sizeof(int64_t));
    size_t off_next = off_istart + align64((n_items_max + 1) * sizeof(int64_t));
    size_t off_done = off_next + 2 * 64; /* next_item, next_slice: a cache line each */
    size_t total = off_done + align64(n_items_max * sizeof(atomic_int));

    const pyrt_params *params = pyrt_pool_params(pool);
    uint8_t *ws = pyrt_pool_workspace(pool, total);
    if (ws == NULL)
        return pyrt_fail(PYRT_E_NOMEM, "pyrt_moe_ffn: cannot allocate %zu bytes of workspace",
                         total);
    *c = (moe_ctx){
        .gud = gud,
        .row_bytes = pyrt_row_bytes(fmt, n_embd),
        .ops = pyrt_pool_row_ops(pool, fmt),
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

/* Plans the token block at c->t0 (routes grouped by expert, work items) and resets its counters
 * (the pool run that follows publishes them). */
static void plan_token_block(moe_ctx *c) {
    c->tb = c->n_tokens - c->t0 < TOKEN_BLOCK ? c->n_tokens - c->t0 : TOKEN_BLOCK;
    plan_block(c);
    plan_items(c, c->nth);
    atomic_store_explicit(c->next_item, 0, memory_order_relaxed);
    for (int i = 0; i < c->n_items; i++)
        atomic_store_explicit(&c->item_done[i], 0, memory_order_relaxed);
    atomic_store_explicit(c->next_slice, 0, memory_order_relaxed);
}

static int64_t active_sum(const moe_ctx *c) {
    int64_t sum = 0;
    for (int t = 0; t < c->nth; t++)
        sum += c->active[(size_t)t * 8];
    return sum;
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

    pyrt_pool_acquire(pool);
    moe_ctx c;
    rc = moe_setup(&c, pool, gud, fmt, n_expert, n_ff, n_embd, x, n_tokens, topk_ids, topk_w,
                   k, activation, threshold, y);
    if (rc != PYRT_OK) {
        pyrt_pool_release(pool);
        return rc;
    }
    if (c.xq != NULL) {
        /* A few tokens take microseconds: cheaper on this thread than a hand-off to the pool. */
        if ((int64_t)n_tokens * n_embd <= SERIAL_QUANTIZE_MAX)
            task_quantize(&c, 0, 1);
        else
            pyrt_pool_run(pool, task_quantize, &c);
        c.xv = (const uint8_t *)c.xq;
        c.xv_stride = (size_t)(n_embd / PYRT_QK) * sizeof(pyrt_xq8);
    } else {
        c.xv = (const uint8_t *)x;
        c.xv_stride = (size_t)n_embd * sizeof(float);
    }
    for (c.t0 = 0; c.t0 < n_tokens; c.t0 += TOKEN_BLOCK) {
        plan_token_block(&c);
        pyrt_pool_run(pool, task_block, &c);
    }
    const int64_t sum = active_sum(&c);
    pyrt_pool_release(pool);
    if (n_active != NULL)
        *n_active = sum;
    return PYRT_OK;
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
    plan_token_block(c);
    atomic_store_explicit(&c->planned, 1, memory_order_release);
}

static void task_routed(void *p, int ith, int nth) {
    moe_ctx *c = p;
    if (c->before != NULL)
        c->before(c->before_ctx, ith, nth);
    pyrt_mv_task(c->router, ith, nth);
    int pf_more = 1;
    for (int spins = 0; !atomic_load_explicit(&c->planned, memory_order_acquire);)
        if (!pf_more || !(pf_more = pyrt_pool_idle_prefetch(c->pool, ith)))
            pyrt_spin_pause(++spins);
    task_block(c, ith, nth);
}

int pyrt_moe_ffn_routed(pyrt_pool *pool, pyrt_task_fn before, void *before_ctx,
                        pyrt_mv_job *router, pyrt_route_fn route, void *route_ctx, int32_t *ids,
                        float *w, const void *gud, int fmt, int n_expert, int n_ff, int n_embd,
                        const float *x, const pyrt_xq8 *xq, int k, int activation,
                        float threshold, float *y, int64_t *n_active) {
    moe_ctx c;
    int rc = moe_setup(&c, pool, gud, fmt, n_expert, n_ff, n_embd, x, 1, ids, w, k,
                       activation, threshold, y);
    if (rc != PYRT_OK)
        return rc;
    if (c.xq != NULL) {
        if (xq != NULL) /* the router's job quantized x the same way */
            c.xv = (const uint8_t *)xq;
        else {
            task_quantize(&c, 0, 1);
            c.xv = (const uint8_t *)c.xq;
        }
        c.xv_stride = (size_t)(n_embd / PYRT_QK) * sizeof(pyrt_xq8);
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

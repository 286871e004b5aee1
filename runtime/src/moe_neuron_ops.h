/* What the routed experts' per-neuron loops share (moe_neurons.c: dense, and the work items;
 * moe_sparse.c: neuron-sparse): the chunk sizes, the row kernels with their software prefetches,
 * the activation terms, and the sparse software pipeline a thread carries across its items. Not
 * seen outside them.
 *
 * Per neuron j of expert e and route (t, w):  a = act(g_j . x_t); skip if |a| < threshold;
 * h = w * a * (u_j . x_t); y_t += h * d_j (an axpy: the down row is the transposed column).
 * With biases (gpt-oss): a = act(g_j . x_t + bg_j), the up term up(u_j . x_t + bu_j) (the
 * activation's: itself, or swiglu oai's clamp + 1), and y_t += w * bd_e once per route. */
#ifndef PYRT_MOE_NEURON_OPS_H
#define PYRT_MOE_NEURON_OPS_H

#include <stdint.h>

#include "activation.h"
#include "moe_ctx.h"

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

/* Appends the addresses of the cache lines covering [p, p + bytes) to lines[*n], up to
 * PF_MAX_LINES in all. */
static inline void add_lines(const void **lines, int *n, const uint8_t *p, size_t bytes) {
    const uint8_t *line = p - ((uintptr_t)p & 63);
    int count = (int)(((size_t)(p - line) + bytes + 63) / 64);
    count = count < PF_MAX_LINES - *n ? count : PF_MAX_LINES - *n;
    const void **out = lines + *n;
    for (int i = 0; i < count; i++) /* a counted loop: ~4 instructions a line */
        out[i] = line + (size_t)i * 64;
    *n += count > 0 ? count : 0;
}

static inline void prefetch_lines(const void *const *lines, int n) {
    for (int i = 0; i < n; i++)
        pyrt_pf_line(lines[i]);
}

/* The row kernels with prefetches, or the plain ones after a burst where a level has none.
 * dot2_rows_pf: any two rows against one x (out[r] = row r . x). */
static inline void dot2_rows_pf(const moe_ctx *c, const uint8_t *row0, const uint8_t *row1,
                                const void *xt, float out[2], const void *const *pf, int n_pf) {
    const pyrt_row_ops *ops = c->ops;
    const int n = c->n_embd;
    if (ops->dot2_pf != NULL) {
        ops->dot2_pf(row0, row1, xt, n, out, pf, n_pf);
        return;
    }
    prefetch_lines(pf, n_pf);
    if (ops->dot2 != NULL) {
        ops->dot2(row0, row1, xt, n, out);
    } else {
        out[0] = ops->dot(row0, xt, n);
        out[1] = ops->dot(row1, xt, n);
    }
}

/* A neuron's gate and up rows (contiguous) in one pass over x. */
static inline void dot2_pf(const moe_ctx *c, const uint8_t *gate, const void *xt, float gu[2],
                           const void *const *pf, int n_pf) {
    dot2_rows_pf(c, gate, gate + c->row_bytes, xt, gu, pf, n_pf);
}

static inline float dot_pf(const moe_ctx *c, const uint8_t *row, const void *xt,
                           const void *const *pf, int n_pf) {
    if (c->ops->dot_pf != NULL)
        return c->ops->dot_pf(row, xt, c->n_embd, pf, n_pf);
    prefetch_lines(pf, n_pf);
    return c->ops->dot(row, xt, c->n_embd);
}

/* y += sum_r a[r] * rows[r] for nr rows, in row order; where the level has int8-multiplier down
 * rows (K-quants on VNNI: axpyn_i8), those, in passes of PYRT_AXPY_ROWS rows from row 0 (so the
 * dense and the sparse kernels, keeping the same neurons, group them alike: the same bits). */
static inline void axpy_rows(const moe_ctx *c, int nr, const float *a, const void *const *rows,
                             float *y) {
    if (c->ops->axpyn_i8 != NULL) {
        for (int r0 = 0; r0 < nr; r0 += PYRT_AXPY_ROWS) {
            const int m = nr - r0 < PYRT_AXPY_ROWS ? nr - r0 : PYRT_AXPY_ROWS;
            c->ops->axpyn_i8(m, a + r0, rows + r0, y, c->n_embd, NULL, 0);
        }
    } else if (c->ops->axpyn != NULL) {
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

/* act(g . x + bg_j) of neuron j (bias: the expert's [n_ff, 2] gate/up biases, or NULL). */
static inline float gate_act(const moe_ctx *c, const float *bias, int64_t j, float g) {
    if (bias != NULL)
        g += bias[2 * j];
    return pyrt_activate_gate(c->activation, c->swiglu_alpha, c->swiglu_limit, g);
}

/* The up term of neuron j: up(u . x + bu_j). */
static inline float up_term(const moe_ctx *c, const float *bias, int64_t j, float u) {
    if (bias != NULL)
        u += bias[2 * j + 1];
    return pyrt_activate_up(c->activation, c->swiglu_limit, u);
}

/* Down rows into one y with prefetches spread through the pass (or a burst, then axpy_rows). */
static inline void axpy_rows_pf(const moe_ctx *c, int nr, const float *a, const void *const *rows,
                                float *y, const void *const *pf, int n_pf) {
    if (c->ops->axpyn_i8 != NULL && nr <= PYRT_AXPY_ROWS) {
        c->ops->axpyn_i8(nr, a, rows, y, c->n_embd, pf, n_pf);
        return;
    }
    if (c->ops->axpyn_pf != NULL && nr <= PYRT_AXPY_ROWS) {
        c->ops->axpyn_pf(nr, a, rows, y, c->n_embd, pf, n_pf);
        return;
    }
    prefetch_lines(pf, n_pf);
    axpy_rows(c, nr, a, rows, y);
}

static inline void mark_item_done(const moe_ctx *c, int item) {
    pyrt_pool_flag_store(c->pool, &c->item_done[item], 1);
}

/* ---- the sparse pipeline (moe_sparse.c) ----------------------------------------------------- */

/* A chunk of neurons whose gates are done: which are active for which route, and their h; and
 * where its results go (its expert's rows, its routes, its work item's partial y). */
typedef struct {
    const uint8_t *expert;
    const uint8_t *gates;                  /* gate row of neuron j: gates + j * gate_stride */
    size_t gate_stride;                    /* 3 rows (in expert) or 1 (the gates apart) */
    const float *bias;                     /* the expert's [n_ff, 2] gate/up biases, or NULL */
    float *acc;
    int item, rc, nr;
    int64_t jc;
    int n_list;
    int list[NEURON_CHUNK];                /* neurons active for some route (offsets from jc) */
    float h[NEURON_CHUNK][ROUTE_CHUNK];    /* act(g . x), then w * act * (u . x) */
    uint8_t on[NEURON_CHUNK][ROUTE_CHUNK]; /* 0: under the threshold, skipped */
} sparse_chunk;

/* Down rows of one-route chunks waiting for their axpyn pass: kept neurons of one expert into
 * one y, in neuron order, gathered across chunks, so that a pass carries PYRT_AXPY_ROWS rows (y
 * loaded and stored once per PYRT_AXPY_ROWS rows) where a chunk keeps 3 of its 32 neurons. The
 * same bits as a pass per chunk (axpyn: bit for bit the axpy calls in order). */
typedef struct {
    float *y;
    const uint8_t *expert;
    int n;
    float a[PYRT_AXPY_ROWS];
    const void *rows[PYRT_AXPY_ROWS];
} down_queue;

/* One thread's software pipeline over its sparse chunks, carried across experts and work items:
 * a chunk is finished after the gates of the thread's next chunk (whatever expert or item it
 * belongs to); where the gate rows are apart its up/down rows are prefetched during those gates,
 * so that only the thread's very last chunk waits on a gather (moe_sparse.c says why only
 * there). */
typedef struct {
    sparse_chunk chunks[2];
    int cur;            /* the chunk to fill next */
    sparse_chunk *prev; /* gates done, up/down rows still to read; or NULL */
    down_queue down;    /* rows of finished one-route chunks of prev's item, not yet summed */
} sparse_pipe;

/* Neurons [j0, j1) of one expert (its rows at `expert`, its gate rows apart at `gates` or NULL:
 * read in `expert`, its gate/up biases or NULL) for its routes [r0, r1), neuron-sparse, through
 * the thread's pipeline pp (item: the work item, acc its partial y); returns the active (neuron,
 * route) pairs. */
int64_t pyrt_moe_sparse_neurons(const moe_ctx *c, sparse_pipe *pp, int item, const uint8_t *expert,
                                const uint8_t *gates, const float *bias, int64_t j0, int64_t j1,
                                int r0, int r1, float *acc);

/* The thread's last pending chunk finished (its rows not prefetched), its item marked done. */
void pyrt_moe_sparse_drain(const moe_ctx *c, sparse_pipe *pp);

#endif /* PYRT_MOE_NEURON_OPS_H */

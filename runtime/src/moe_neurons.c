/* The routed experts' per-neuron loops: a work item's neurons of each expert it covers, dense
 * (gate and up in one pass over x, down rows several per pass over y) or neuron-sparse (gates
 * first, then the up and down rows of the neurons whose |act| reaches the threshold), with the
 * software prefetches that keep the weight stream ahead of the arithmetic.
 *
 * Per neuron j of expert e and route (t, w):  a = act(g_j . x_t); skip if |a| < threshold;
 * h = w * a * (u_j . x_t); y_t += h * d_j (an axpy: the down row is the transposed column).
 * With biases (gpt-oss): a = act(g_j . x_t + bg_j), the up term up(u_j . x_t + bu_j) (the
 * activation's: itself, or swiglu oai's clamp + 1), and y_t += w * bd_e once per route. */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "activation.h"
#include "moe_ctx.h"

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
static int64_t dense_neurons(const moe_ctx *c, const uint8_t *expert, const float *bias,
                             int64_t j0, int64_t j1, int r0, int r1, float *acc) {
    const size_t rb = c->row_bytes, nrb = 3 * rb; /* bytes of one row, of one neuron */
    const int ahead = c->prefetch_ahead;
    const void *pf[PF_MAX_LINES];
    float h[ROUTE_CHUNK][DENSE_CHUNK]; /* w * act(g . x) * (u . x) per route and neuron */
    const void *down[DENSE_CHUNK];
    pf_cursor pc = {expert + (size_t)j0 * nrb, expert + (size_t)j1 * nrb};
    if (ahead > 0) { /* the first `ahead` neurons, in a burst; the cursor runs from there */
        const size_t lead = (size_t)ahead * nrb;
        const size_t left = (size_t)(pc.end - pc.at);
        pyrt_moe_prefetch(pc.at, lead < left ? lead : left);
        pc.at = lead < left ? pc.at + lead : pc.end;
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
                    h[r][i] = c->route_w[rc + r] * gate_act(c, bias, jc + i, gu[0]) *
                              up_term(c, bias, jc + i, gu[1]);
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
 * the up/down rows of a chunk are read while the gates of the thread's next chunk (whatever
 * expert or item it belongs to) are computed, so that only the thread's very last chunk waits
 * on a gather. */
typedef struct {
    sparse_chunk chunks[2];
    int cur;            /* the chunk to fill next */
    sparse_chunk *prev; /* gates done, up/down rows still to read; or NULL */
    down_queue down;    /* rows of finished one-route chunks of prev's item, not yet summed */
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

/* Gates of the chunk's nj neurons, two neurons' gate rows per pass over each route's x where the
 * level has dot2 (the same bits as two dots; half the x loads and reductions). While they run,
 * the kernels prefetch the gate rows `ahead` neurons on (within [.., j1)) and an even share of
 * `prev`'s active up/down rows (a gather the hardware prefetcher cannot follow), so those are in
 * cache when `prev` is finished. */
static int64_t sparse_gates(const moe_ctx *c, sparse_chunk *ch, int nj, gate_cursor *gc,
                            const sparse_chunk *prev) {
    const size_t rb = c->row_bytes;
    const pyrt_row_ops *ops = c->ops;
    const int ahead = c->prefetch_ahead, nr = ch->nr, rc = ch->rc;
    const float thr = c->threshold;
    const int prev_lines = prev == NULL ? 0 : prev->n_list * (int)((2 * rb + 63) / 64 + 1);
    const int share = (prev_lines + nj - 1) / nj;
    const int paired = ops->dot2 != NULL;
    const void *pf[PF_MAX_LINES];
    gather_lines g;
    gather_begin(&g, c, prev);
    int64_t active = 0;
    ch->n_list = 0;
    for (int i = 0; i < nj;) {
        const int m = paired && i + 1 < nj ? 2 : 1; /* neurons of this pass */
        const uint8_t *gate = ch->expert + (size_t)(ch->jc + i) * 3 * rb;
        int n_pf = 0;
        if (ahead > 0)
            gate_cursor_take(c, gc, ch->jc + i + m + ahead, pf, &n_pf);
        gather_take(&g, c, share * m, pf, &n_pf);
        int n_on[2] = {0, 0};
        for (int r = 0; r < nr; r++) {
            const int lo = n_pf * r / nr, hi = n_pf * (r + 1) / nr;
            const void *xt = token_x(c, rc + r);
            float d[2];
            if (m == 2) {
                if (ops->dot2_pf != NULL) {
                    ops->dot2_pf(gate, gate + 3 * rb, xt, c->n_embd, d, pf + lo, hi - lo);
                } else {
                    prefetch_lines(pf + lo, hi - lo);
                    ops->dot2(gate, gate + 3 * rb, xt, c->n_embd, d);
                }
            } else {
                d[0] = dot_pf(c, gate, xt, pf + lo, hi - lo);
            }
            for (int q = 0; q < m; q++) {
                const float a = gate_act(c, ch->bias, ch->jc + i + q, d[q]);
                ch->h[i + q][r] = a;
                ch->on[i + q][r] = !(fabsf(a) < thr); /* NaN stays on, so it propagates */
                n_on[q] += ch->on[i + q][r];
            }
        }
        for (int q = 0; q < m; q++) {
            if (n_on[q] > 0)
                ch->list[ch->n_list++] = i + q;
            active += n_on[q];
        }
        i += m;
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
            pyrt_moe_prefetch(up_row(c, ch, ch->list[l]), 2 * rb);
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
            ch->h[i][r] = c->route_w[rc + r] * a * up_term(c, ch->bias, ch->jc + i, u);
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

/* The queued down rows into their y in one pass; while it runs, the gate rows of the next
 * neurons (one per row, up to gc->limit; gc NULL: none) are prefetched. */
static void down_queue_flush(const moe_ctx *c, down_queue *q, gate_cursor *gc) {
    if (q->n == 0)
        return;
    const void *pf[PF_MAX_LINES];
    int n_pf = 0;
    if (gc != NULL && gc->next < gc->limit)
        gate_cursor_take(c, gc, gc->next + q->n < gc->limit ? gc->next + q->n : gc->limit, pf,
                         &n_pf);
    axpy_rows_pf(c, q->n, q->a, q->rows, q->y, pf, n_pf);
    q->n = 0;
}

static void down_queue_add(const moe_ctx *c, down_queue *q, float *y, const uint8_t *expert,
                           float a, const void *row, gate_cursor *gc) {
    if (q->n > 0 && (q->y != y || q->expert != expert))
        down_queue_flush(c, q, gc);
    q->y = y;
    q->expert = expert;
    q->a[q->n] = a;
    q->rows[q->n++] = row;
    if (q->n == PYRT_AXPY_ROWS)
        down_queue_flush(c, q, gc);
}

/* sparse_finish for a chunk of one route (the decode step's): its kept neurons' up rows two per
 * pass over x (dot2: the same bits as two dots), their down rows through the pipe's queue. */
static void sparse_finish_one(const moe_ctx *c, sparse_chunk *ch, int prefetched,
                              gate_cursor *gc, down_queue *q) {
    const size_t rb = c->row_bytes;
    const void *xt = token_x(c, ch->rc);
    const float w = c->route_w[ch->rc];
    float *y = ch->acc + (size_t)c->route_tok[ch->rc] * c->n_embd;
    const void *pf[PF_MAX_LINES];
    if (!prefetched)
        for (int l = 0; l < ch->n_list && l < 2; l++)
            pyrt_moe_prefetch(up_row(c, ch, ch->list[l]), 2 * rb);
    for (int l = 0; l < ch->n_list; l += 2) {
        const int m = l + 1 < ch->n_list ? 2 : 1; /* kept neurons of this pass */
        int n_pf = 0;
        for (int k = l + 2; !prefetched && k < l + 2 + m && k < ch->n_list; k++)
            add_lines(pf, &n_pf, up_row(c, ch, ch->list[k]), 2 * rb);
        if (gc != NULL && gc->next < gc->limit)
            gate_cursor_take(c, gc, gc->next + m < gc->limit ? gc->next + m : gc->limit, pf,
                             &n_pf);
        const uint8_t *up0 = up_row(c, ch, ch->list[l]);
        float u[2];
        if (m == 2)
            dot2_rows_pf(c, up0, up_row(c, ch, ch->list[l + 1]), xt, u, pf, n_pf);
        else
            u[0] = dot_pf(c, up0, xt, pf, n_pf);
        for (int k = 0; k < m; k++) {
            const int i = ch->list[l + k];
            const float h = w * ch->h[i][0] * up_term(c, ch->bias, ch->jc + i, u[k]);
            down_queue_add(c, q, y, ch->expert, h, up_row(c, ch, i) + rb, gc);
        }
    }
}

static inline void mark_item_done(const moe_ctx *c, int item) {
    pyrt_pool_flag_store(c->pool, &c->item_done[item], 1);
}

/* Finishes the pipeline's pending chunk; marks its item done when the thread has moved on to
 * another item (`item_now`; -1: none, the thread's last chunk). */
static void sparse_pipe_flush(const moe_ctx *c, sparse_pipe *pp, int prefetched, int item_now,
                              gate_cursor *gc) {
    sparse_chunk *prev = pp->prev;
    if (prev == NULL)
        return;
    if (prev->nr == 1) {
        sparse_finish_one(c, prev, prefetched, gc, &pp->down);
    } else {
        down_queue_flush(c, &pp->down, gc); /* the rows of earlier chunks go first */
        sparse_finish(c, prev, prefetched, gc);
    }
    if (prev->item != item_now) {
        down_queue_flush(c, &pp->down, NULL);
        mark_item_done(c, prev->item);
    }
    pp->prev = NULL;
}

/* Neurons [j0, j1) of one expert for its routes [r0, r1), neuron-sparse: per chunk of
 * NEURON_CHUNK neurons the gates, then (one chunk later, software-pipelined) the up and down
 * rows of the neurons whose |act| reaches the threshold. Down rows go into each y in neuron
 * order, as in dense, so a threshold that drops nothing gives dense's bits. */
static int64_t sparse_neurons(const moe_ctx *c, sparse_pipe *pp, int item, const uint8_t *expert,
                              const float *bias, int64_t j0, int64_t j1, int r0, int r1,
                              float *acc) {
    const size_t rb = c->row_bytes;
    const int ahead = c->prefetch_ahead;
    int64_t active = 0;
    for (int rc = r0; rc < r1; rc += ROUTE_CHUNK) {
        const int nr = r1 - rc < ROUTE_CHUNK ? r1 - rc : ROUTE_CHUNK;
        /* the first `ahead` gates in a burst; the cursor runs from there (nowhere if ahead 0) */
        gate_cursor gc = {expert, j0 + ahead < j1 ? j0 + ahead : j1, ahead > 0 ? j1 : j0, j0};
        for (int64_t j = j0; j < gc.next; j++)
            pyrt_moe_prefetch(expert + (size_t)j * 3 * rb, rb);
        for (int64_t jc = j0; jc < j1; jc += NEURON_CHUNK) {
            const int nj = j1 - jc < NEURON_CHUNK ? (int)(j1 - jc) : NEURON_CHUNK;
            sparse_chunk *ch = &pp->chunks[pp->cur];
            *ch = (sparse_chunk){.expert = expert, .bias = bias, .acc = acc, .item = item,
                                 .rc = rc, .nr = nr, .jc = jc};
            active += sparse_gates(c, ch, nj, &gc, pp->prev);
            gc.limit = jc + nj + NEURON_CHUNK; /* at most the next chunk's gates */
            sparse_pipe_flush(c, pp, 1, item, &gc);
            pp->prev = ch;
            pp->cur ^= 1;
        }
    }
    return active;
}

/* y_t += w * bd for the expert's routes [r0, r1) (bd: its [n_embd] down bias). */
static void down_bias(const moe_ctx *c, const float *bd, int r0, int r1, float *acc) {
    for (int r = r0; r < r1; r++) {
        float *y = acc + (size_t)c->route_tok[r] * c->n_embd;
        const float w = c->route_w[r];
        for (int i = 0; i < c->n_embd; i++)
            y[i] += w * bd[i];
    }
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
        const size_t slot = (size_t)c->used[u];
        const uint8_t *expert = c->gud + slot * c->n_ff * 3 * c->row_bytes;
        const float *bias = c->bias_gu != NULL ? c->bias_gu + slot * c->n_ff * 2 : NULL;
        const int r0 = c->route_start[u], r1 = c->route_start[u + 1];
        if (j0 == 0 && c->bias_down != NULL) /* the item holding neuron 0 adds w * bd once */
            down_bias(c, c->bias_down + slot * c->n_embd, r0, r1, acc);
        active += sparse ? sparse_neurons(c, pp, item, expert, bias, j0, j1, r0, r1, acc)
                         : dense_neurons(c, expert, bias, j0, j1, r0, r1, acc);
    }
    if (pp->prev == NULL || pp->prev->item != item)
        mark_item_done(c, item);
    return active;
}

/* Thread ith's items: whichever is next on the shared counter, until none is left; the
 * software pipeline of sparse chunks runs across them (its last chunk is flushed at the end). */
int64_t pyrt_moe_run_items(const moe_ctx *c) {
    sparse_pipe pp;
    pp.cur = 0;
    pp.prev = NULL;
    pp.down.n = 0;
    int64_t active = 0;
    for (int item; (item = atomic_fetch_add_explicit(c->next_item, 1, memory_order_relaxed)) <
                   c->n_items;)
        active += run_item(c, &pp, item);
    sparse_pipe_flush(c, &pp, 0, -1, NULL);
    return active;
}

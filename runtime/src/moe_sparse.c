/* The routed experts' neurons, neuron-sparse: per chunk of NEURON_CHUNK neurons the gates (a
 * compact list of the kept ones), then, one chunk later (software-pipelined where the gate rows
 * are apart: their rows are prefetched while the next chunk's gates run), the up and down rows
 * of the neurons whose |act| reaches the threshold. Down rows go into each y in neuron order,
 * as in dense, so a threshold that drops nothing gives dense's bits (moe_neuron_ops.h: the
 * formulas). */
#include <math.h>
#include <stdint.h>

#include "moe_neuron_ops.h"

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

/* The gate rows of one expert's neurons [next, end) not prefetched yet (every third row of the
 * expert, or consecutive rows of the gates apart: row j at gates + j * stride). The
 * gate phase keeps it `ahead` neurons before its reads; the up/down phase of the previous chunk,
 * which reads gathered rows the gate prefetches do not cover, moves it on by two gates per
 * active neuron (as many rows as it reads), up to `limit`, so the memory does not idle there. */
typedef struct {
    const uint8_t *gates;
    size_t stride;
    int64_t next, end, limit;
} gate_cursor;

static void gate_cursor_take(const moe_ctx *c, gate_cursor *gc, int64_t upto, const void **lines,
                             int *n) {
    if (gc == NULL)
        return;
    upto = upto < gc->end ? upto : gc->end;
    for (; gc->next < upto; gc->next++)
        add_lines(lines, n, gc->gates + (size_t)gc->next * gc->stride, c->row_bytes);
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
        const uint8_t *gate = ch->gates + (size_t)(ch->jc + i) * ch->gate_stride;
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
                    ops->dot2_pf(gate, gate + ch->gate_stride, xt, c->n_embd, d, pf + lo,
                                 hi - lo);
                } else {
                    prefetch_lines(pf + lo, hi - lo);
                    ops->dot2(gate, gate + ch->gate_stride, xt, c->n_embd, d);
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
 * their rows were prefetched during the next chunk's gates (pipelined); else (the file's layout,
 * or the thread's last chunk) each up dot prefetches the rows of the active neuron two on. */
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
 * pass over x (dot2: the same bits as two dots), their down rows through the pipe's queue. The
 * next gate rows are prefetched during the down rows' passes (memory-idle arithmetic on rows in
 * cache) and, where the kept rows were prefetched before (`prefetched`), during the up dots; in
 * the file's layout the up dots' own prefetches of the kept rows two on are the stream there,
 * and gate rows among them slowed it: without them there the sparse time was 0.951x / 0.980x
 * (a copy of the old build 1.035x) at 16 threads on two H200 hosts, 0.963x of the copy's at 4,
 * sparse / dense 1.26x against 1.18x at 1 (olmoe-1b-7b Q8_0, docs/benchmarks.md). */
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
        if (prefetched && gc != NULL && gc->next < gc->limit)
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

/* Finishes the pipeline's pending chunk (`prefetched`: as sparse_finish's); marks its item done
 * when the thread has moved on to another item (`item_now`; -1: none, the thread's last chunk). */
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
 * NEURON_CHUNK neurons the gates, then (one chunk later; software-pipelined where the gate rows
 * are apart) the up and down rows of the neurons whose |act| reaches the threshold. Down rows go
 * into each y in neuron order, as in dense, so a threshold that drops nothing gives dense's
 * bits. */
int64_t pyrt_moe_sparse_neurons(const moe_ctx *c, sparse_pipe *pp, int item, const uint8_t *expert,
                                const uint8_t *gates, const float *bias, int64_t j0, int64_t j1,
                                int r0, int r1, float *acc) {
    const size_t rb = c->row_bytes;
    const int ahead = c->prefetch_ahead;
    const size_t stride = gates != NULL ? rb : 3 * rb; /* bytes from one gate row to the next */
    /* The previous chunk's kept rows prefetched during this chunk's gates only where the gate
     * rows are apart (one contiguous stream, which the hardware prefetcher follows): in the
     * file's layout, where the gate rows too are software-prefetched, that lost 2-4% at 16
     * threads (the kept rows prefetched two kept neurons ahead as they are read instead) and
     * gained nothing at 1-8; with the gates apart it gained ~3% at 1 thread (granite-1b-a400m,
     * docs/benchmarks.md: the sparse kernel's shape). */
    const int pipelined = gates != NULL;
    if (gates == NULL)
        gates = expert;
    int64_t active = 0;
    for (int rc = r0; rc < r1; rc += ROUTE_CHUNK) {
        const int nr = r1 - rc < ROUTE_CHUNK ? r1 - rc : ROUTE_CHUNK;
        /* the first `ahead` gates in a burst; the cursor runs from there (nowhere if ahead 0) */
        gate_cursor gc = {gates, stride, j0 + ahead < j1 ? j0 + ahead : j1, ahead > 0 ? j1 : j0,
                          j0};
        for (int64_t j = j0; j < gc.next; j++)
            pyrt_moe_prefetch(gates + (size_t)j * stride, rb);
        for (int64_t jc = j0; jc < j1; jc += NEURON_CHUNK) {
            const int nj = j1 - jc < NEURON_CHUNK ? (int)(j1 - jc) : NEURON_CHUNK;
            sparse_chunk *ch = &pp->chunks[pp->cur];
            *ch = (sparse_chunk){.expert = expert, .gates = gates, .gate_stride = stride,
                                 .bias = bias, .acc = acc, .item = item, .rc = rc, .nr = nr,
                                 .jc = jc};
            active += sparse_gates(c, ch, nj, &gc, pipelined ? pp->prev : NULL);
            gc.limit = jc + nj + NEURON_CHUNK; /* at most the next chunk's gates */
            sparse_pipe_flush(c, pp, pipelined, item, &gc);
            pp->prev = ch;
            pp->cur ^= 1;
        }
    }
    return active;
}

void pyrt_moe_sparse_drain(const moe_ctx *c, sparse_pipe *pp) {
    sparse_pipe_flush(c, pp, 0, -1, NULL);
}

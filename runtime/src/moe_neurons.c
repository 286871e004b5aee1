/* The routed experts' per-neuron loops: a work item's neurons of each expert it covers, dense
 * (gate and up in one pass over x, down rows several per pass over y; here) or neuron-sparse
 * (gates first, then the up and down rows of the neurons whose |act| reaches the threshold;
 * moe_sparse.c), with the software prefetches that keep the weight stream ahead of the
 * arithmetic (moe_neuron_ops.h: the formulas). */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "moe_neuron_ops.h"

static inline int64_t ceil_div(int64_t a, int64_t b) {
    return a <= 0 ? 0 : (a + b - 1) / b;
}

/* ---- dense --------------------------------------------------------------------------------- */

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
        if (sparse) {
            const uint8_t *gates =
                c->gates != NULL ? c->gates + slot * c->n_ff * c->row_bytes : NULL;
            active += pyrt_moe_sparse_neurons(c, pp, item, expert, gates, bias, j0, j1, r0, r1,
                                              acc);
        } else {
            active += dense_neurons(c, expert, bias, j0, j1, r0, r1, acc);
        }
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
    pyrt_moe_sparse_drain(c, &pp);
    return active;
}

/* The routed experts' plan of one token block: its (token, expert) routes grouped by expert
 * (counting sort), each expert's neurons priced, and the block's total cost cut into work items. */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "moe_ctx.h"

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

/* The slot of route r (a (token, expert) pair of the block) in the weights; -1: not held here
 * (one load of the map per pair). */
static inline int route_slot(const moe_ctx *c, const int32_t *ids, int r) {
    return c->expert_map != NULL ? c->expert_map[ids[r]] : ids[r];
}

/* Group the block's routes by slot (counting sort; routes whose expert is not held here are
 * dropped) and price each used expert's neurons. */
static void plan_block(moe_ctx *c) {
    memset(c->counts, 0, (size_t)c->n_slots * sizeof *c->counts);
    const int32_t *ids = c->ids + (size_t)c->t0 * c->k;
    const float *w = c->w + (size_t)c->t0 * c->k;
    const int n_routes = c->tb * c->k;
    for (int r = 0; r < n_routes; r++) {
        const int s = route_slot(c, ids, r);
        if (s >= 0)
            c->counts[s]++;
    }
    c->n_used = 0;
    int start = 0;
    for (int s = 0; s < c->n_slots; s++) {
        if (c->counts[s] == 0)
            continue;
        const int u = c->n_used++;
        c->used[u] = s;
        c->route_start[u] = start;
        /* Cost of one neuron: reading its rows (~1) plus one unit per routed token. */
        c->cost_start[u + 1] = (int64_t)c->n_ff * (1 + c->counts[s]);
        start += c->counts[s];
        c->counts[s] = u; /* from here on: slot -> its index in used[] */
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
        const int s = route_slot(c, ids, r);
        if (s < 0)
            continue;
        const int at = fill[c->counts[s]]++;
        c->route_tok[at] = r / c->k;
        c->route_w[at] = w[r];
    }
}

void pyrt_moe_plan_token_block(moe_ctx *c) {
    c->tb = c->n_tokens - c->t0 < TOKEN_BLOCK ? c->n_tokens - c->t0 : TOKEN_BLOCK;
    plan_block(c);
    plan_items(c, c->nth);
    atomic_store_explicit(c->next_item, 0, memory_order_relaxed);
    for (int i = 0; i < c->n_items; i++)
        atomic_store_explicit(&c->item_done[i], 0, memory_order_relaxed);
    atomic_store_explicit(c->next_slice, 0, memory_order_relaxed);
}

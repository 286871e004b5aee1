/* One MoE layer's routed experts for a chunk of many tokens (moe_batch.c), as the prefill runs
 * them: the chunk's (token, expert) routes grouped by expert, so each expert's rows are read once
 * per chunk for all its tokens, in tiles (rows.h). */
#ifndef PYRT_MOE_BATCH_H
#define PYRT_MOE_BATCH_H

#include <stddef.h>
#include <stdint.h>

#include "pool.h"
#include "rows.h"

/* The plan and the intermediate results of one call, grown on demand and kept between calls
 * (pyrt_moe_batch_free). Sizes: [routes] for the route lists, [routes, n_ff] for h and
 * [routes, n_embd] for each route's down output: they grow with a chunk, not a prompt. All in one
 * block: their own (mem, grown by pyrt_moe_batch) or the caller's (pyrt_moe_batch_place). */
typedef struct {
    int routes_cap, slots_cap, ff_cap, embd_cap;
    void *mem;            /* the block when the buffers own it (freed by pyrt_moe_batch_free), or
                           * NULL: placed in the caller's memory, or none yet */
    int *counts;          /* [n_slots] routes per slot, then the slot's index in used[] */
    int *used;            /* [n_used] slots with routes, ascending */
    int *start;           /* [n_used + 1] routes of used[u]: start[u] .. start[u+1] (sorted) */
    int *fill;            /* [n_used] the plan's cursor per expert */
    int *down_start;      /* [n_used + 1] each expert's first down item */
    int *route_tok;       /* [routes] sorted route -> its token */
    float *route_w;       /* [routes] its routing weight */
    int *route_of;        /* [n_tokens * k] a token's j-th route -> its sorted index, or -1 */
    float *h;             /* per used expert u, [n_ff][start[u+1] - start[u]]: w * act(g) * u */
    float *yr;            /* [routes, n_embd] each sorted route's w * expert(x) */
} pyrt_moe_batch_buf;

void pyrt_moe_batch_free(pyrt_moe_batch_buf *b);

/* Bytes of the block that holds the buffers for `routes` routes over n_slots slots, n_ff
 * neurons and n_embd columns (64-byte aligned pieces; h and yr make nearly all of it:
 * routes x (n_ff + n_embd) floats). */
size_t pyrt_moe_batch_bytes(int routes, int n_slots, int n_ff, int n_embd);
/* The buffers for those sizes laid out in mem (64-byte aligned, pyrt_moe_batch_bytes long, the
 * caller's: pyrt_moe_batch_free does not free it, and a call that needs more room than it has
 * takes a block of its own instead). */
void pyrt_moe_batch_place(pyrt_moe_batch_buf *b, void *mem, int routes, int n_slots, int n_ff,
                          int n_embd);

/* y[t] = sum_j w[t, j] * expert_{ids[t, j]}(x_t) over the pairs held here (experts->expert_map),
 * for t < n_tokens, with expert_e(x) = sum_n act(g_n . x) * (u_n . x) * d_n and neurons whose
 * |act| < threshold skipped for that token (0: dense), as pyrt_moe_ffn computes it.
 * xv [n_tokens] what the rows' dots read per token: its Q8 blocks (Q8_0 / Q4_0 weights) or its
 * f32 values. y [n_tokens, n_embd] (written). *n_active: neurons computed; *n_pairs: pairs
 * computed (held here). The experts, ids, weights and map were checked by the caller, who holds
 * the pool. PYRT_E_NOMEM (last_error set) when the buffers cannot grow. */
int pyrt_moe_batch(pyrt_pool *pool, pyrt_moe_batch_buf *buf, const pyrt_experts *experts,
                   int n_tokens, const void *const *xv, const int32_t *ids, const float *w, int k,
                   int activation, float threshold, float *y, int64_t *n_active,
                   int64_t *n_pairs);

#endif /* PYRT_MOE_BATCH_H */

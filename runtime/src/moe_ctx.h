/* What the routed-expert kernel's files share (moe_ffn.c: API, set-up, the pool tasks and the
 * reduce; moe_plan.c: routes and work items of a token block; moe_neurons.c: the per-neuron
 * loops): the call's context. Not seen outside them. */
#ifndef PYRT_MOE_CTX_H
#define PYRT_MOE_CTX_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "moe.h"

enum {
    TOKEN_BLOCK = 64,         /* tokens whose routes are planned together (one pool hand-off) */
    MAX_ITEMS_PER_THREAD = 8, /* guided items come to ~6.2 per thread */
    ITEMS_ACC_BYTES = 16 << 20, /* cap on the work items' partial ys together */
    SERIAL_QUANTIZE_MAX = 1 << 15, /* activations (tokens * n_embd) quantized without the pool */
    QUANTIZE_TOKENS = 8            /* tokens a thread quantizes per claim */
};

typedef struct {
    /* weights: row r (0 gate, 1 up, 2 down) of neuron j of the expert in slot s starts at
     * gud + ((s * n_ff + j) * 3 + r) * row_bytes */
    const uint8_t *gud;
    /* NULL, or the gate rows apart: neuron j's of slot s at gates + (s * n_ff + j) * row_bytes
     * (read by the sparse pass instead of row 0 in gud) */
    const uint8_t *gates;
    size_t row_bytes;
    const pyrt_row_ops *ops;
    int n_slots, n_ff, n_embd, activation;
    float swiglu_alpha, swiglu_limit; /* PYRT_ACT_SWIGLU_OAI's */
    const float *bias_gu;      /* [n_slots, n_ff, 2] gate and up biases per neuron, or NULL */
    const float *bias_down;    /* [n_slots, n_embd] per expert, or NULL (with bias_gu) */
    const int32_t *expert_map; /* [n_expert]: id -> slot, -1: skipped; NULL: slot = id */
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
    int xq_kind;            /* how xq is quantized: PYRT_XQ_* of the experts' format */
    /* the current token block [t0, t0 + tb) */
    int t0, tb;
    int n_used;             /* slots used by the block */
    int *used;              /* [n_used] slots, ascending */
    int *route_start;       /* [n_used + 1] routes of used[u]: route_start[u] .. route_start[u+1] */
    int *route_tok;         /* [tb*k] token index inside the block */
    float *route_w;         /* [tb*k] routing weight */
    int64_t *cost_start;    /* [n_used + 1] prefix sums of n_ff * cost per neuron */
    int *counts;            /* [n_slots] scratch */
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

/* Plans the token block at c->t0 (routes grouped by expert, work items) and resets its counters
 * (the pool run that follows publishes them) (moe_plan.c). */
void pyrt_moe_plan_token_block(moe_ctx *c);

/* Thread ith's share of the block's work items, taken from the shared counter until none is
 * left, each marked done once its partial y is complete; returns the neurons it computed
 * (moe_neurons.c). */
int64_t pyrt_moe_run_items(const moe_ctx *c);

/* Prefetch [p, p + bytes) now (into L1 or L2: pyrt_pf_line), in a burst (where no spread is
 * possible). */
static inline void pyrt_moe_prefetch(const void *p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64)
        pyrt_pf_line((const uint8_t *)p + off);
}

#endif /* PYRT_MOE_CTX_H */

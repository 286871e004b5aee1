/* The attention half of a transformer block for one token (attention.c): q/k/v projections,
 * q/k norms, RoPE, the KV-cache append, the attention heads over the cached positions and the
 * output projection, as pool tasks. The scratch of one token lives in pyrt_attention. */
#ifndef PYRT_ATTENTION_H
#define PYRT_ATTENTION_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "linear.h"
#include "pool.h"
#include "rows.h"

/* The model's attention shape and one token's scratch (owned; pyrt_attention_init / _free). */
typedef struct {
    int n_embd, n_head, n_head_kv, head_dim, rope_dim;
    float rms_eps, scale, clamp_kqv;
    const float *rope_inv_freq; /* [rope_dim / 2] (borrowed) */
    float rope_scale;           /* cos and sin multiplied by it (1: plain rope) */
    int qk_l2;                  /* llama4: q/k L2 norm on the rope layers */
    int temp_len;               /* llama4: the NoPE layers' query temperature (0: none) */
    float temp_scale;
    float temp;                 /* its value at rope_pos */
    float *q, *k, *v;           /* [n_head*hd], [n_kv*hd], [n_kv*hd]: the q/k/v outputs */
    float *att;                 /* [n_head*hd] attention output, o's input */
    pyrt_xq8 *att_q;            /* [n_head*hd / 32] Q8 blocks of att for a fused o projection
                                   (the q/k/v input's blocks are still read meanwhile) */
    float *scores;              /* [n_head, scores_cap] each head's tile scratch and its scores
                                   over the cache's positions (attn_tile.h) */
    size_t scores_cap;          /* floats per head in scores */
    float *rope_cs;             /* [rope_dim]: (cos, sin) of rope_pos * inv_freq[i] */
    int rope_pos;               /* the position rope_cs holds (-1: none yet) */
    atomic_int *rows_done;      /* [n_head + 2 n_kv] fused: rows of each q head, then k head,
                                   then v head computed (of head_dim) */
    atomic_int *kv_ready;       /* [n_kv] fused: 1 once head kvh's k is normed and roped, and k,
                                   v are in the cache */
    atomic_int heads_done;      /* fused: attention heads finished */
    atomic_int att_ready;       /* fused: 1 once att is complete and quantized into att_q */
} pyrt_attention;

/* Allocates a's scratch for the model w (checked); PYRT_E_NOMEM with a message naming fn. */
int pyrt_attention_init(pyrt_attention *a, const pyrt_model_weights *w, const char *fn);
void pyrt_attention_free(pyrt_attention *a);

/* Ready for a token at position pos of caches of cap positions: room for the scores, the RoPE
 * table of pos. PYRT_E_NOMEM with a message naming fn. */
int pyrt_attention_prepare(pyrt_attention *a, int pos, int cap, const char *fn);

/* One layer's weights and KV cache for this token. */
typedef struct {
    const pyrt_block_weights *b;
    float *kc, *vc; /* [n_head_kv, cap, head_dim] f32: positions < pos hold earlier tokens */
    size_t cap;
    int pos;        /* written by this token */
} pyrt_attn_layer;

/* The q/k/v job of a block over one token (outputs a->q, k, v; the clamp of the model). */
pyrt_mv_job pyrt_attention_qkv_job(const pyrt_attention *a, const pyrt_block_weights *b);

/* 1 where q/k/v, the heads and o can be one pool task: q/k norms per head or absent. */
int pyrt_attention_fusable(const pyrt_attention *a, const pyrt_block_weights *b);

/* y [n_embd] = the block's attention output (after o, before the residual) for the normed input
 * xn [n_embd] (its Q8 blocks go to xq), writing k and v at the layer's pos. fuse: one pool task
 * where pyrt_attention_fusable, else q/k/v, heads and o in three with the norms, RoPE and the
 * cache append between them; the same bits either way. The o run's idle time prefetches
 * `after`'s rows (NULL: none). The caller holds the pool. */
void pyrt_attention_run(pyrt_attention *a, pyrt_pool *pool, const pyrt_attn_layer *l,
                        const float *xn, pyrt_xq8 *xq, float *y, const pyrt_mv_job *after,
                        int fuse);

/* ---- q/k/v, attention heads and o in one pool task -------------------------------------------
 * For a caller that runs more in the same task (decode.c: the whole block): set up with
 * pyrt_attention_task_setup, set o.on_rows if wanted, then run pyrt_attention_task on the pool
 * (ctx: the pyrt_attn_task). */
typedef struct {
    pyrt_attention *a;
    pyrt_pool *pool;
    pyrt_attn_layer l;
    pyrt_mv_job *qkv;        /* prepared over the input; its on_rows publishes rows per head */
    pyrt_mv_job *o;          /* over att (x: att, xq: att_q), prepared; y its output */
    int o_xq;                /* how o's weights want att quantized into att_q (PYRT_XQ_*) */
    _Alignas(64) atomic_int next_head; /* next head to take (own cache line) */
} pyrt_attn_task;

/* Fills t for layer l: qkv (a's q/k/v job) over xn [n_embd] quantized into xq when it reads Q8
 * blocks; o (writing y [n_embd]) over att; the counters reset (the pool run publishes them). */
void pyrt_attention_task_setup(pyrt_attn_task *t, pyrt_attention *a, pyrt_pool *pool,
                               const pyrt_attn_layer *l, pyrt_mv_job *qkv, pyrt_mv_job *o,
                               const float *xn, pyrt_xq8 *xq, float *y);
void pyrt_attention_task(void *ctx, int ith, int nth);

#endif /* PYRT_ATTENTION_H */

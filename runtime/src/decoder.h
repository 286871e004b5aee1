/* The decoder's state and what its files share (decoder.c: create, free, timers; decode_check.c:
 * the checks; decode_ffn.c: the FFN half of a block; decode.c: the step). Not part of the
 * public API (pyrt.h). */
#ifndef PYRT_DECODER_H
#define PYRT_DECODER_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "attention.h"
#include "linear.h"
#include "mla_step.h"
#include "moe.h"
#include "pool.h"

/* A prefill's chunk buffers (prefill.h), made by the first prefill. */
typedef struct pyrt_prefill_buf pyrt_prefill_buf;

struct pyrt_decoder {
    pyrt_model_weights w;        /* copy; w.blocks points at `blocks` */
    pyrt_block_weights *blocks;  /* [n_layer] copy */
    int max_in;                  /* longest input of any matrix (elements) */
    int max_ff;                  /* widest shared expert / dense FFN */
    float *x;                    /* [n_embd] residual stream */
    float *xn;                   /* [max_in] normed input, then FFN hidden h */
    pyrt_xq8 *xq;                /* [max_in / 32] Q8 blocks of the current matvec input */
    pyrt_attention att;          /* the attention half's scratch */
    pyrt_mla mla;                /* multi-head latent attention's (w.mla_kv_rank > 0), or zero */
    float *y, *ys;               /* [n_embd] block output; shared expert / dense FFN output */
    float *xw;                   /* [n_embd] an expert's input times its routing weight
                                    (expert_input_weight models; else NULL) */
    float *gate, *up;            /* [max_ff] */
    float *router;               /* [n_expert] router logits, then probabilities */
    int32_t *ids;                /* [k] chosen experts (room for n_expert) */
    float *topw;                 /* [k] their routing weights (room for n_expert) */
    uint8_t *taken;              /* [n_expert] top-k scratch */
    int route_k;                 /* experts per token of the layer being routed */
    float *route_logits;         /* [n_expert] where the routing copies the router's logits
                                    before its softmax, or NULL (not asked for) */
    atomic_int o_rows;           /* fused layer: o rows computed */
    atomic_int ffn_ready;        /* fused layer: 1 once x, xn (and xq) are the FFN's */
    int fuse_attention;          /* this step's pool's params.fuse_attention, fuse_router and */
    int fuse_router;             /* fuse_layer (pyrt.h), read at the start of the step */
    int fuse_layer;
    int64_t times[4];            /* see pyrt_decoder_times */
    pyrt_prefill_buf *prefill;   /* NULL until the first prefill */
    atomic_flag busy;            /* set during a step: the scratch above is not shareable */
};

/* Frees d->prefill (prefill.c). */
void pyrt_prefill_free(pyrt_decoder *d);

/* CLOCK_MONOTONIC in ns (decoder.c). */
int64_t pyrt_now_ns(void);

/* ---- checks (decode_check.c) ---------------------------------------------------------------- */

/* Every shape and format of the model once; *max_ff gets the widest shared expert / dense FFN. */
int pyrt_decoder_check_model(const pyrt_model_weights *w, int *max_ff);
/* The outputs of a step or a prefill and their lengths, checked together. */
typedef struct {
    float *logits;
    int64_t logits_len;
    int64_t logits_need;         /* floats the call writes into logits (0: none) */
    int32_t *route_ids;
    int64_t route_ids_len;
    float *route_logits;
    int64_t route_logits_len;
} pyrt_outputs;

/* dec, pool, args non-NULL. */
int pyrt_decoder_check_call(const pyrt_decoder *d, const pyrt_pool *pool, const void *args,
                            const char *fn);
/* k in [0, n_expert]; thresholds and maps (when set) of n_layer entries, maps of n_expert. */
int pyrt_decoder_check_experts(const pyrt_decoder *d, const pyrt_expert_args *e, const char *fn);
/* k and v of n_layer layers, each holding [n_head_kv, cap, head_dim] floats. */
int pyrt_decoder_check_cache(const pyrt_decoder *d, const pyrt_kv_cache *c, const char *fn);
/* logits (when the call writes any), route_ids and route_logits (when set) long enough. */
int pyrt_decoder_check_outputs(const pyrt_decoder *d, const pyrt_expert_args *e,
                               const pyrt_outputs *o, const char *fn);
/* token in [0, n_vocab). */
int pyrt_decoder_check_token(const pyrt_decoder *d, int token, const char *fn);
/* Layer `layer`'s attention inputs for n tokens from pos: [pos, pos + n) in the cache (checked
 * by pyrt_decoder_check_cache), the layer's k/v cache pointers. */
int pyrt_decoder_check_attention(const pyrt_kv_cache *c, int layer, int pos, int n,
                                 const char *fn);
/* Layer `layer`'s FFN inputs: its threshold, its expert map's values (e checked). */
int pyrt_decoder_check_ffn(const pyrt_decoder *d, const pyrt_expert_args *e, int layer,
                           const char *fn);
/* A layer index in [0, n_layer). */
int pyrt_decoder_check_layer(const pyrt_decoder *d, int layer, const char *fn);

/* ---- the FFN half of a block (decode_ffn.c) ------------------------------------------------- */

/* One layer's FFN inputs and outputs beyond the weights (from pyrt_step_args). */
typedef struct {
    float threshold;             /* routed-expert sparsity threshold (0: dense) */
    int k;                       /* experts per token */
    const int32_t *expert_map;   /* [n_expert] or NULL: every expert computed here */
    int32_t *route_ids;          /* out [k] or NULL */
    float *route_logits;         /* out [n_expert] or NULL */
    int64_t n_active;            /* out: routed neurons computed */
    int64_t n_pairs;             /* out: (token, expert) pairs computed here */
} pyrt_ffn_io;

/* The layer's pyrt_ffn_io from a call's expert arguments and routing outputs (NULL: none). */
pyrt_ffn_io pyrt_decode_ffn_io(const pyrt_decoder *d, const pyrt_expert_args *e,
                               int32_t *route_ids, float *route_logits, int layer);
/* The FFN's first matvec: router (+ shared gate and up), or the dense FFN's gate and up. */
pyrt_mv_job pyrt_decode_ffn_in_job(const pyrt_decoder *d, const pyrt_block_weights *b);
/* The layer's routed experts as pyrt_moe_ffn reads them (all n_expert, io's map). */
pyrt_experts pyrt_decode_experts(const pyrt_decoder *d, const pyrt_block_weights *b,
                                 const pyrt_ffn_io *io);
/* Before the router's run: what the routing (pyrt_decode_route) takes from io. */
void pyrt_decode_route_begin(pyrt_decoder *d, const pyrt_ffn_io *io);
/* After the routed experts ran (d->ids chosen, io->n_active set): the chosen ids out, the pairs
 * computed. */
void pyrt_decode_route_end(pyrt_decoder *d, pyrt_ffn_io *io);
/* x += ffn(rms_norm(x) * ffn_norm) * residual_scale with io's threshold, k and map (io's outputs
 * filled); PYRT_OK, or the routed experts' failure (last_error set). `next`: the matvec after
 * this block (the next block's q/k/v, or the output matrix), for prefetch plans. */
int pyrt_decode_ffn(pyrt_decoder *d, pyrt_pool *pool, const pyrt_block_weights *b,
                    pyrt_ffn_io *io, const pyrt_mv_job *next);
/* After the routed experts (in d->y): the shared expert, if any, then the residual. */
void pyrt_decode_moe_tail(pyrt_decoder *d, pyrt_pool *pool, const pyrt_block_weights *b,
                          const pyrt_mv_job *next);
enum { PYRT_MAX_EXPERT_GROUPS = 64 }; /* expert_groups a model may have (checked at creation) */

/* p = softmax(logits) over the model's experts, in place; ids/w [k] = the k largest (ties: lower
 * id first; within the best groups where the model has expert groups), renormalized to sum 1
 * when the model says, times its expert_weights_scale (docs/gguf-layout.md, "Routing"). taken:
 * [n_expert] scratch. */
void pyrt_route_topk(float *p, const pyrt_model_weights *m, int k, int32_t *ids, float *w,
                     uint8_t *taken);
/* The routing of the router + experts task (pyrt_moe_ffn_routed) from d->router (ctx: the
 * decoder): the router's logits to d->route_logits when asked, then softmax, top d->route_k. */
void pyrt_decode_route(void *ctx, int32_t *ids, float *w);

#endif /* PYRT_DECODER_H */

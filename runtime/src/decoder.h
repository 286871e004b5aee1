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
#include "moe.h"
#include "pool.h"

struct pyrt_decoder {
    pyrt_model_weights w;        /* copy; w.blocks points at `blocks` */
    pyrt_block_weights *blocks;  /* [n_layer] copy */
    int max_in;                  /* longest input of any matrix (elements) */
    int max_ff;                  /* widest shared expert / dense FFN */
    float *x;                    /* [n_embd] residual stream */
    float *xn;                   /* [max_in] normed input, then FFN hidden h */
    pyrt_xq8 *xq;                /* [max_in / 32] Q8 blocks of the current matvec input */
    pyrt_attention att;          /* the attention half's scratch */
    float *y, *ys;               /* [n_embd] block output; shared expert / dense FFN output */
    float *gate, *up;            /* [max_ff] */
    float *router;               /* [n_expert] router logits, then probabilities */
    int32_t *ids;                /* [n_expert_used] */
    float *topw;                 /* [n_expert_used] */
    uint8_t *taken;              /* [n_expert] top-k scratch */
    atomic_int o_rows;           /* fused layer: o rows computed */
    atomic_int ffn_ready;        /* fused layer: 1 once x, xn (and xq) are the FFN's */
    int fuse_attention;          /* this step's pool's params.fuse_attention, fuse_router and */
    int fuse_router;             /* fuse_layer (pyrt.h), read at the start of the step */
    int fuse_layer;
    int64_t times[4];            /* see pyrt_decoder_times */
    atomic_flag busy;            /* set during a step: the scratch above is not shareable */
};

/* CLOCK_MONOTONIC in ns (decoder.c). */
int64_t pyrt_now_ns(void);

/* ---- checks (decode_check.c) ---------------------------------------------------------------- */

/* Every shape and format of the model once; *max_ff gets the widest shared expert / dense FFN. */
int pyrt_decoder_check_model(const pyrt_model_weights *w, int *max_ff);
/* The arguments of one step. */
int pyrt_decoder_check_step(const pyrt_decoder *d, const pyrt_pool *pool, int token, int pos,
                            float *const *k_cache, float *const *v_cache, int cache_cap,
                            const float *thresholds, const float *logits);

/* ---- the FFN half of a block (decode_ffn.c) ------------------------------------------------- */

/* The FFN's first matvec: router (+ shared gate and up), or the dense FFN's gate and up. */
pyrt_mv_job pyrt_decode_ffn_in_job(const pyrt_decoder *d, const pyrt_block_weights *b);
/* x += ffn(rms_norm(x) * ffn_norm) * residual_scale; returns the routed neurons computed
 * (n_active of pyrt_moe_ffn), or -1 on failure (last_error set). `next`: the matvec after this
 * block (the next block's q/k/v, or the output matrix), for prefetch plans. */
int64_t pyrt_decode_ffn(pyrt_decoder *d, pyrt_pool *pool, const pyrt_block_weights *b,
                        float threshold, const pyrt_mv_job *next);
/* After the routed experts (in d->y): the shared expert, if any, then the residual. */
void pyrt_decode_moe_tail(pyrt_decoder *d, pyrt_pool *pool, const pyrt_block_weights *b,
                          const pyrt_mv_job *next);
/* The routing of the fused router + experts task (pyrt_moe_ffn_routed), from d->router
 * (ctx: the decoder). */
void pyrt_decode_route(void *ctx, int32_t *ids, float *w);

#endif /* PYRT_DECODER_H */

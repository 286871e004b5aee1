/* The prefill's pieces (prefill.c: the call and its chunks; prefill_attn.c: the attention half of
 * a block for a chunk; prefill_ffn.c: its FFN half) and the buffers of one chunk they share. Not
 * part of the public API (pyrt.h). */
#ifndef PYRT_PREFILL_H
#define PYRT_PREFILL_H

#include <stddef.h>
#include <stdint.h>

#include "decoder.h"
#include "moe_batch.h"

/* One chunk's activations, T tokens at most (the call's ubatch), grown on demand and kept in the
 * decoder between calls; row strides in floats (blocks for xq). Nothing here grows with the
 * prompt or the cache: only with the chunk. */
struct pyrt_prefill_buf {
    int tokens_cap;      /* T the buffers hold */
    int threads_cap;     /* threads the attention and top-k scratch hold */
    size_t scratch_floats; /* floats of a thread's attention scratch (attn_tile.h) */
    size_t in_stride;    /* floats per row of xn: max(n_embd, n_head * head_dim, widest FFN) */
    size_t q_stride;     /* units per row of xq: pyrt_xq_units(in_stride) */
    float *x;            /* [T, n_embd] the residual stream */
    float *xn;           /* [T, in_stride] a matrix product's input: normed x, attention out */
    pyrt_xq8 *xq;        /* [T, q_stride] its Q8 blocks */
    const void **xv;     /* [T] what the routed experts' dots read per token (xq or xn rows) */
    float *q, *k, *v;    /* [T, n_head * hd], [T, n_head_kv * hd] x 2 */
    float *y, *ys;       /* [T, n_embd] a half's output; the shared expert's or dense FFN's */
    float *gate, *up;    /* [T, widest FFN] */
    float *gs;           /* [T] the shared expert's gate */
    float *router;       /* [T, n_expert] router logits, then probabilities */
    int32_t *ids;        /* [T, n_expert] chosen experts (room for any k) */
    float *w;            /* [T, n_expert] their routing weights */
    float *rope_cs;      /* [T, rope_dim]: (cos, sin) per token's position, as a step makes them */
    float *scores;       /* [threads, scratch_floats] a thread's attention tile scratch */
    uint8_t *taken;      /* [threads, n_expert] top-k scratch */
    /* expert_input_weight models only (else NULL): one top-k slot's inputs (llama4.c) */
    float *xw, *yw;      /* [T, n_embd] xn times the slot's weight; the slot's expert output */
    int32_t *ids1;       /* [T] the slot's expert per token */
    float *ones;         /* [T] weight 1 */
    pyrt_moe_batch_buf moe;
};

/* One chunk's place in the call: tokens [pos, pos + n) of the cache. */
typedef struct {
    pyrt_decoder *d;
    pyrt_pool *pool;
    pyrt_prefill_buf *b;
    const pyrt_kv_cache *cache;
    int pos, n;
} pyrt_chunk;

/* x += attention(rms_norm(x) * attn_norm) * residual_scale for the chunk's tokens, at layer
 * `layer`, writing their keys and values into the cache (prefill_attn.c). */
void pyrt_prefill_attention(const pyrt_chunk *c, int layer);

/* The same for a multi-head latent attention block: its absorbed form over the latent cache,
 * writing the chunk's [c_kv; k_pe] rows (mla_prefill.c; buffers: pyrt_mla_prefill_ensure). */
void pyrt_prefill_mla(const pyrt_chunk *c, int layer);

/* x += ffn(rms_norm(x) * ffn_norm) * residual_scale for the chunk's tokens with io's threshold,
 * k and map; io's route_ids / route_logits (when set) get the chunk's last token's routing;
 * io's n_active and n_pairs add up the chunk's (prefill_ffn.c). PYRT_E_NOMEM when the routed
 * experts' buffers cannot grow (last_error set). */
int pyrt_prefill_ffn(const pyrt_chunk *c, int layer, pyrt_ffn_io *io);

/* Rows [0, n) of src [n, n_embd] normed by `norm` into xn (stride in_stride), and quantized into
 * xq when `quantize` (prefill_attn.c). */
void pyrt_prefill_norm(const pyrt_chunk *c, const float *src, const float *norm, int xq_kind);
/* xq rows = the Q8 blocks of xn's first `n_in` columns (prefill_attn.c). */
void pyrt_prefill_quantize(const pyrt_chunk *c, int xq_kind, const float *src, size_t stride,
                           int n_in);
/* The chunk's matrix products: job's outputs over its n tokens of x (stride x_stride) and their
 * Q8 blocks in xq (made by the caller where a matrix reads them) (prefill_attn.c). */
void pyrt_prefill_matmul(const pyrt_chunk *c, pyrt_mv_job *job, const float *x, size_t x_stride);
/* x += y * residual_scale over the chunk's n tokens: an attention half's last step
 * (prefill_attn.c). */
void pyrt_prefill_add_residual(const pyrt_chunk *c);

#endif /* PYRT_PREFILL_H */

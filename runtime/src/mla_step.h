/* Multi-head latent attention's half of a block for one token (mla_step.c; deepseek2), the
 * decode step's counterpart of attention.c for a model with mla_kv_rank > 0. Not part of the
 * public API (pyrt.h). */
#ifndef PYRT_MLA_STEP_H
#define PYRT_MLA_STEP_H

#include "attention.h"
#include "linear.h"
#include "pool.h"

/* The MLA shape and one token's scratch beyond pyrt_attention's (owned: init / free). With
 * R = rank, D = nope, r = rope: a->q holds per head [q_lat (R); q_pe (r)] and a->att per head
 * the attention's output over the cache rows [c_kv; k_pe], of which the first R are o_lat. */
typedef struct {
    int n_embd, n_head, rank, q_rank, nope, rope, v_dim;
    float rms_eps;
    float *q;       /* [n_head (D + r)] the query projection's output */
    float *qa;      /* [q_rank] the query LoRA's first projection (normed in place) */
    float *kv;      /* [R + r] attn_kv_a_mqa's output */
    float *o;       /* [n_head v_dim] the heads' outputs: attn_output's input */
    pyrt_xq8 *xq;   /* [max(q_rank, n_head v_dim) / 32 + 1] Q8 blocks of qa or o */
    pyrt_xq8 *xqh;  /* [n_head, xqh_stride] each head's Q8 blocks of q_nope, then of o_lat */
    int xqh_stride; /* blocks per head: pyrt_xq_units(max(D, R)) */
    /* a prefill's chunk of T tokens (mla_prefill.c), grown on demand: */
    int tokens_cap, threads_cap;
    float *c_q, *c_qa, *c_kv; /* [T, n_head (D + r)], [T, q_rank], [T, R + r] in-projections */
    float *c_o;               /* [T, n_head v_dim] the heads' outputs */
    pyrt_xq8 *c_xq;           /* [T, c_xq_stride] Q8 blocks of a matrix product's input rows */
    size_t c_xq_stride;
    float *c_rows;            /* [threads, 2, PYRT_ATTN_ROWS, R + r] a tile's queries, outputs */
    pyrt_xq8 *c_xqh;          /* [threads, PYRT_ATTN_ROWS, xqh_stride] a tile's Q8 blocks */
} pyrt_mla;

/* Allocates m's scratch for the model w (mla_kv_rank > 0); PYRT_E_NOMEM naming fn. */
int pyrt_mla_init(pyrt_mla *m, const pyrt_model_weights *w, const char *fn);
void pyrt_mla_free(pyrt_mla *m);

/* Room for a prefill chunk of T tokens on `threads` threads; PYRT_E_NOMEM naming fn. */
int pyrt_mla_prefill_ensure(pyrt_mla *m, int T, int threads, const char *fn);
/* Frees the chunk buffers (tokens_cap and threads_cap back to 0; pyrt_mla_free does it too). */
void pyrt_mla_prefill_free(pyrt_mla *m);

/* The MLA shape of the model and block i's MLA weights (at pyrt_decoder_create). */
int pyrt_mla_check_model(const pyrt_model_weights *w);
int pyrt_mla_check_block(const pyrt_model_weights *w, const pyrt_block_weights *b, int i);

/* y[t * y_stride + o] = row o of head h's block of w (rows [h n_out, (h + 1) n_out)) . x[t] for
 * o < n_out, t < nt <= PYRT_ATTN_ROWS tokens (x[t] [w->n_in]; quantized into xq + t xq_stride
 * first as w's format reads it, pyrt_fmt_xq), in tiles of rows x tokens: the same bits as one dot each. */
void pyrt_mla_head_rows(const pyrt_pool *pool, const pyrt_matrix *w, int h, int n_out, int nt,
                        const float *const *x, pyrt_xq8 *xq, size_t xq_stride, float *y,
                        size_t y_stride);

/* The block's first matvec over its normed input: [attn_q_a or attn_q; attn_kv_a_mqa]. */
pyrt_mv_job pyrt_mla_in_job(pyrt_mla *m, const pyrt_block_weights *b);

/* y [n_embd] = the block's attention output (after attn_output, before the residual) for the
 * normed input xn [n_embd] (its Q8 blocks go to xq), writing [c_kv; k_pe] at the layer's pos;
 * a: the decoder's attention scratch prepared for pos (its RoPE table, scores). Pool tasks: the
 * in-projections; the query LoRA's second; the heads (k_b fold, attention over the latents,
 * v_b), one head per work item; attn_output, whose idle time prefetches `after` (NULL: none).
 * The caller holds the pool. */
void pyrt_mla_run(pyrt_mla *m, pyrt_attention *a, pyrt_pool *pool, const pyrt_attn_layer *l,
                  const float *xn, pyrt_xq8 *xq, float *y, const pyrt_mv_job *after);

#endif /* PYRT_MLA_STEP_H */

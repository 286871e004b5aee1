/* Llama-4's pieces of the decode step and the prefill (llama4.c; the math of
 * pyruntime/model/llama4.py and reference.py): the rope layers' q/k L2 norm, the NoPE layers'
 * query temperature, routing by the router's logits with sigmoid weights, and the routed
 * experts fed their routing weight times the input. Not part of the public API (pyrt.h). */
#ifndef PYRT_LLAMA4_H
#define PYRT_LLAMA4_H

#include <stdint.h>

#include "prefill.h"

/* A NoPE layer's query scale at position pos: 1 + scale log(1 + floor((pos + 1) / length)) in
 * f32 as temperature_scales (llama4.py) computes it; 1 when length is 0. */
float pyrt_temperature(int length, float scale, int pos);

/* q or k heads x [n_heads, hd] after their q/k norms, at one position: RoPE (cs: its (cos, sin)
 * pairs of rope_dim) unless `nope`; then on a rope layer with `l2` each head times
 * 1 / sqrt(mean(x^2) + eps), on a NoPE layer x times `temp` (1 for keys). */
void pyrt_position_heads(float *x, int n_heads, int hd, int rope_dim, const float *cs, int nope,
                         int l2, float eps, float temp);

/* ids/w [k] = the k largest of logits [n_expert] (ties: lower id first; the order a softmax
 * keeps), weights sigmoid(logit). taken: [n_expert] scratch. */
void pyrt_route_sigmoid(const float *logits, int n_expert, int k, int32_t *ids, float *w,
                        uint8_t *taken);

/* A step's routed experts with the weights on their input (d->ids, d->topw chosen; d->xn the
 * FFN's input): y = sum over slots j of expert_{ids[j]}(xn * w[j]), into d->y (d->ys, d->xw
 * scratch); io->n_active set. The caller holds the pool. */
int pyrt_decode_input_weighted(pyrt_decoder *d, pyrt_pool *pool, const pyrt_experts *experts,
                               pyrt_ffn_io *io);

/* The same for a prefill chunk (b->ids, b->w [n, k] chosen; b->xn rows the input): b->y; the
 * chunk's neurons and pairs computed added to *n_active, *n_pairs. PYRT_E_NOMEM as
 * pyrt_moe_batch. */
int pyrt_prefill_input_weighted(const pyrt_chunk *c, const pyrt_experts *experts, int k,
                                float threshold, int64_t *n_active, int64_t *n_pairs);

#endif /* PYRT_LLAMA4_H */

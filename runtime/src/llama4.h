/* Llama-4's pieces of the decode step and the prefill (llama4.c; the math of
 * pyruntime/model/llama4.py and reference.py): the rope layers' q/k L2 norm, the NoPE layers'
 * query temperature, routing by the router's logits with sigmoid weights, and the routed
 * experts fed their routing weight times the input. Not part of the public API (pyrt.h). */
#ifndef PYRT_LLAMA4_H
#define PYRT_LLAMA4_H

#include <stdint.h>

#include "llama4_qk.h"
#include "prefill.h"

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

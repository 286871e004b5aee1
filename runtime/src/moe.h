/* The routed experts as the decode step calls them (moe_ffn.c): router, routing and experts of
 * one token in one pool task. pyrt_moe_ffn (pyrt.h) is the public entry point. */
#ifndef PYRT_MOE_H
#define PYRT_MOE_H

#include <stddef.h>
#include <stdint.h>

#include "linear.h"
#include "pool.h"

/* Writes the top k expert ids and weights of the token from the router's output. */
typedef void (*pyrt_route_fn)(void *ctx, int32_t *ids, float *w);

/* One token's router, routing and routed experts as one pool task: every thread runs `before`
 * first (NULL: none; it returns once x, xq and the router's input are ready), then `router`'s
 * chunks (prepared: pyrt_mv_job_prepare; its out[0] the router, whose rows' completion triggers
 * `route`, which fills ids/w [k]), then pyrt_moe_ffn's work for x (xq: its Q8 blocks, made by the
 * router's job or by `before`; NULL: quantized here, before the run). The caller holds the pool;
 * the experts (and their map's values) were checked. */
int pyrt_moe_ffn_routed(pyrt_pool *pool, pyrt_task_fn before, void *before_ctx,
                        pyrt_mv_job *router, pyrt_route_fn route, void *route_ctx, int32_t *ids,
                        float *w, const pyrt_experts *experts, const float *x,
                        const pyrt_xq8 *xq, int k, int activation, float threshold, float *y,
                        int64_t *n_active);

/* PYRT_OK for a known PYRT_ACT_* (with SWIGLU_OAI: finite alpha, limit > 0), else
 * PYRT_E_INVALID with a message naming fn. */
int pyrt_check_activation(int activation, float alpha, float limit, const char *fn);

#endif /* PYRT_MOE_H */

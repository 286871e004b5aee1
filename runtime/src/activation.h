/* The FFN activations (PYRT_ACT_*): routed experts (moe_neurons.c), shared expert and dense FFN
 * (decode_ffn.c). */
#ifndef PYRT_ACTIVATION_H
#define PYRT_ACTIVATION_H

#include <math.h>

#include "pyrt.h"

/* act(g) for a PYRT_ACT_* kind. */
static inline float pyrt_activate(int kind, float g) {
    switch (kind) {
    case PYRT_ACT_GELU_TANH:
        return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    case PYRT_ACT_GELU_ERF:
        return 0.5f * g * (1.0f + erff(g * 0.7071067811865476f));
    default: /* SiLU: for g -> -inf, expf overflows to inf and g / inf = -0, as wanted */
        return g / (1.0f + expf(-g));
    }
}

/* act(g) of a PYRT_ACT_* kind with its parameters (PYRT_ACT_SWIGLU_OAI's alpha and limit). A NaN
 * stays NaN (the comparisons fail on it), as torch's clamp keeps it. */
static inline float pyrt_activate_gate(int kind, float alpha, float limit, float g) {
    if (kind != PYRT_ACT_SWIGLU_OAI)
        return pyrt_activate(kind, g);
    g = g > limit ? limit : g;
    return g / (1.0f + expf(-(g * alpha)));
}

/* What multiplies act(gate): u itself, or PYRT_ACT_SWIGLU_OAI's clamp(u, -limit, limit) + 1. */
static inline float pyrt_activate_up(int kind, float limit, float u) {
    if (kind != PYRT_ACT_SWIGLU_OAI)
        return u;
    u = u > limit ? limit : (u < -limit ? -limit : u);
    return u + 1.0f;
}

#endif /* PYRT_ACTIVATION_H */

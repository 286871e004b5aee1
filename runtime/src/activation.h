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

#endif /* PYRT_ACTIVATION_H */

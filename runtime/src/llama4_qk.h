/* Llama-4's q/k positioning (llama4.c), apart from llama4.h so that the attention halves
 * (attention.c, prefill_attn.c) include it without the decoder and prefill headers. Not part of
 * the public API (pyrt.h). */
#ifndef PYRT_LLAMA4_QK_H
#define PYRT_LLAMA4_QK_H

/* A NoPE layer's query scale at position pos: 1 + scale log(1 + floor((pos + 1) / length)) in
 * f32 as temperature_scales (llama4.py) computes it; 1 when length is 0. */
float pyrt_temperature(int length, float scale, int pos);

/* q or k heads x [n_heads, hd] after their q/k norms, at one position: RoPE (cs: its (cos, sin)
 * pairs of rope_dim) unless `nope`; then on a rope layer with `l2` each head times
 * 1 / sqrt(mean(x^2) + eps), on a NoPE layer x times `temp` (1 for keys). */
void pyrt_position_heads(float *x, int n_heads, int hd, int rope_dim, const float *cs, int nope,
                         int l2, float eps, float temp);

#endif /* PYRT_LLAMA4_QK_H */

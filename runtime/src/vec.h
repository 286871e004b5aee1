/* Serial vector pieces of the decode step (vec.c), O(n) on the calling thread: RMS norm and
 * softmax. */
#ifndef PYRT_VEC_H
#define PYRT_VEC_H

/* out = x * rsqrt(mean(x^2) + eps) * w, in that order (as rms_norm in the reference model);
 * out may be x. */
void pyrt_rms_norm(const float *x, const float *w, float eps, int n, float *out);

/* Softmax over n values in place. */
void pyrt_softmax(float *p, int n);

/* Softmax of p [n] in place with one more logit, `sink`, in the denominator (it attends to
 * nothing): p[i] = exp(p[i] - m) / (sum_j exp(p[j] - m) + exp(sink - m)), m the largest of all
 * (gpt-oss's attention sinks). */
void pyrt_softmax_sink(float *p, int n, float sink);

/* HF rotate_half on the first rope_dim dims of each of n_heads heads of x [n_heads, hd];
 * cs [rope_dim]: (cos, sin) pairs. */
void pyrt_rope(float *x, int n_heads, int hd, int rope_dim, const float *cs);

#endif /* PYRT_VEC_H */

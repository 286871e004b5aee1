/* Serial vector pieces of the decode step and the prefill: RMS norm, softmax and RoPE. */
#include <math.h>
#include <stddef.h>

#include "vec.h"

void pyrt_rms_norm(const float *x, const float *w, float eps, int n, float *out) {
    double ss = 0.0; /* f64 sum: order-independent to well under f32 rounding */
    for (int i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++)
        out[i] = x[i] * r * w[i];
}

void pyrt_softmax(float *p, int n) {
    float mx = p[0];
    for (int i = 1; i < n; i++)
        mx = p[i] > mx ? p[i] : mx;
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        p[i] = expf(p[i] - mx);
        sum += p[i];
    }
    for (int i = 0; i < n; i++)
        p[i] /= sum;
}

void pyrt_softmax_sink(float *p, int n, float sink) {
    float mx = sink;
    for (int i = 0; i < n; i++)
        mx = p[i] > mx ? p[i] : mx;
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        p[i] = expf(p[i] - mx);
        sum += p[i];
    }
    sum += expf(sink - mx);
    for (int i = 0; i < n; i++)
        p[i] /= sum;
}

/* HF rotate_half on the first rope_dim dims of each of n_heads heads of x [n_heads, hd]:
 * with c = cos(pos f_i), s = sin(pos f_i), i < rope_dim/2:
 * x[i] <- x[i] c - x[i + d/2] s,  x[i + d/2] <- x[i + d/2] c + x[i] s. */
void pyrt_rope(float *x, int n_heads, int hd, int rope_dim, const float *cs) {
    const int half = rope_dim / 2;
    for (int h = 0; h < n_heads; h++) {
        float *xh = x + (size_t)h * hd;
        for (int i = 0; i < half; i++) {
            const float x1 = xh[i], x2 = xh[i + half], c = cs[2 * i], s = cs[2 * i + 1];
            xh[i] = x1 * c + (-x2) * s;
            xh[i + half] = x2 * c + x1 * s;
        }
    }
}

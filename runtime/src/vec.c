/* Serial vector pieces of the decode step and the prefill: RMS norm and softmax. */
#include <math.h>

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

/* C unit tests of pyrt_deltanet_step (deltanet.c), built with -fsanitize=address,undefined by
 * tests/test_cpu_deltanet.py.
 *
 * 1. Several tokens through a layer at odd shapes (F32 weights: 2 key heads of 5, 6 value heads
 *    of 7, conv kernel 3, n_embd 13), from a random state, against a naive float64 computation
 *    of the same recurrence: outputs and both states within float32 rounding (1e-4), on pools of
 *    1, 2 and 3 threads, which give the same bits.
 * 2. Errors: every length and shape check is one status + message, and a refused call leaves the
 *    states untouched.
 * Exit status 0 and "all C deltanet tests passed" on success. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pyrt.h"

#define TEST_RNG_SEED 0xD1B54A32D192ED03ull
#include "check.h"

enum { E = 13, HK = 2, HV = 6, DK = 5, DV = 7, K = 3, C = 2 * HK * DK + HV * DV, STEPS = 5 };

static float rnd(void) { return (float)rng_u32() / 4294967296.0f * 2.0f - 1.0f; }

static void fill(float *v, int n, float scale) {
    for (int i = 0; i < n; i++)
        v[i] = rnd() * scale;
}

typedef struct {
    float qkv[C * E], gate[HV * DV * E], beta[HV * E], alpha[HV * E], out[E * HV * DV];
    float conv[C * K], dt_bias[HV], a[HV], norm[DV];
} layer_data;

static void describe(const layer_data *d, pyrt_deltanet *w) {
    memset(w, 0, sizeof *w);
    w->n_embd = E, w->n_k_heads = HK, w->n_v_heads = HV, w->head_k_dim = DK, w->head_v_dim = DV;
    w->conv_kernel = K, w->rms_eps = 1e-6f;
    w->qkv = (pyrt_matrix){d->qkv, sizeof d->qkv, PYRT_FMT_F32, C, E};
    w->gate = (pyrt_matrix){d->gate, sizeof d->gate, PYRT_FMT_F32, HV * DV, E};
    w->beta = (pyrt_matrix){d->beta, sizeof d->beta, PYRT_FMT_F32, HV, E};
    w->alpha = (pyrt_matrix){d->alpha, sizeof d->alpha, PYRT_FMT_F32, HV, E};
    w->out = (pyrt_matrix){d->out, sizeof d->out, PYRT_FMT_F32, E, HV * DV};
    w->conv = (pyrt_vector){d->conv, C * K};
    w->dt_bias = (pyrt_vector){d->dt_bias, HV};
    w->a = (pyrt_vector){d->a, HV};
    w->norm = (pyrt_vector){d->norm, DV};
}

static double dsilu(double v) { return v / (1.0 + exp(-v)); }

/* The layer's step in float64, written from the formulas (pyruntime/model/deltanet.py). */
static void reference_step(const layer_data *d, const float *x, double *conv_state, double *ssm,
                           double *y) {
    double in[C], mixed[C], z[HV * DV], o[HV * DV];
    for (int c = 0; c < C; c++) {
        in[c] = 0.0;
        for (int e = 0; e < E; e++)
            in[c] += (double)d->qkv[c * E + e] * x[e];
    }
    for (int c = 0; c < C; c++) {
        double window[K];
        for (int j = 0; j < K - 1; j++)
            window[j] = conv_state[c * (K - 1) + j];
        window[K - 1] = in[c];
        double acc = 0.0;
        for (int j = 0; j < K; j++)
            acc += d->conv[c * K + j] * window[j];
        mixed[c] = dsilu(acc);
        for (int j = 0; j < K - 1; j++)
            conv_state[c * (K - 1) + j] = window[j + 1];
    }
    for (int r = 0; r < HV * DV; r++) {
        z[r] = 0.0;
        for (int e = 0; e < E; e++)
            z[r] += (double)d->gate[r * E + e] * x[e];
    }
    for (int h = 0; h < HV; h++) {
        const int kh = h / (HV / HK);
        double q[DK], k[DK], qn = 0.0, kn = 0.0, b = 0.0, al = 0.0;
        for (int i = 0; i < DK; i++) {
            q[i] = mixed[kh * DK + i];
            k[i] = mixed[HK * DK + kh * DK + i];
            qn += q[i] * q[i];
            kn += k[i] * k[i];
        }
        for (int i = 0; i < DK; i++) {
            q[i] /= sqrt(qn + 1e-6) * sqrt((double)DK);
            k[i] /= sqrt(kn + 1e-6);
        }
        for (int e = 0; e < E; e++) {
            b += (double)d->beta[h * E + e] * x[e];
            al += (double)d->alpha[h * E + e] * x[e];
        }
        const double beta = 1.0 / (1.0 + exp(-b));
        const double g = d->a[h] * log1p(exp(al + d->dt_bias[h]));
        double *s = ssm + h * DK * DV, kv[DV], ms = 0.0;
        for (int i = 0; i < DK * DV; i++)
            s[i] *= exp(g);
        for (int j = 0; j < DV; j++) {
            kv[j] = 0.0;
            for (int i = 0; i < DK; i++)
                kv[j] += s[i * DV + j] * k[i];
        }
        for (int i = 0; i < DK; i++)
            for (int j = 0; j < DV; j++)
                s[i * DV + j] += k[i] * beta * (mixed[2 * HK * DK + h * DV + j] - kv[j]);
        for (int j = 0; j < DV; j++) {
            o[h * DV + j] = 0.0;
            for (int i = 0; i < DK; i++)
                o[h * DV + j] += s[i * DV + j] * q[i];
            ms += o[h * DV + j] * o[h * DV + j];
        }
        ms /= DV;
        for (int j = 0; j < DV; j++)
            o[h * DV + j] *= d->norm[j] / sqrt(ms + 1e-6) * dsilu(z[h * DV + j]);
    }
    for (int e = 0; e < E; e++) {
        y[e] = 0.0;
        for (int r = 0; r < HV * DV; r++)
            y[e] += (double)d->out[e * HV * DV + r] * o[r];
    }
}

static double max_diff(const float *a, const double *b, int n) {
    double m = 0.0;
    for (int i = 0; i < n; i++)
        m = fmax(m, fabs((double)a[i] - b[i]));
    return m;
}

static void test_steps(const layer_data *d) {
    pyrt_deltanet w;
    describe(d, &w);
    float conv0[C * (K - 1)], ssm0[HV * DK * DV], x[STEPS][E];
    fill(conv0, C * (K - 1), 1.0f);
    fill(ssm0, HV * DK * DV, 0.5f);
    for (int t = 0; t < STEPS; t++)
        fill(x[t], E, 1.0f);
    float first_y[STEPS][E];
    for (int nth = 1; nth <= 3; nth++) {
        pyrt_pool *pool = NULL;
        CHECK(pyrt_pool_create(nth, NULL, &pool) == PYRT_OK, "pool %d: %s", nth,
              pyrt_last_error());
        if (pool == NULL)
            return;
        float conv[C * (K - 1)], ssm[HV * DK * DV], y[E];
        double rconv[C * (K - 1)], rssm[HV * DK * DV], ry[E];
        memcpy(conv, conv0, sizeof conv);
        memcpy(ssm, ssm0, sizeof ssm);
        for (int i = 0; i < C * (K - 1); i++)
            rconv[i] = conv0[i];
        for (int i = 0; i < HV * DK * DV; i++)
            rssm[i] = ssm0[i];
        for (int t = 0; t < STEPS; t++) {
            int rc = pyrt_deltanet_step(pool, &w, x[t], conv, C * (K - 1), ssm, HV * DK * DV, y);
            CHECK(rc == PYRT_OK, "step %d on %d threads: %s", t, nth, pyrt_last_error());
            reference_step(d, x[t], rconv, rssm, ry);
            CHECK(max_diff(y, ry, E) < 1e-4, "y of step %d (%d threads): %g", t, nth,
                  max_diff(y, ry, E));
            CHECK(max_diff(conv, rconv, C * (K - 1)) < 1e-6, "conv state of step %d", t);
            CHECK(max_diff(ssm, rssm, HV * DK * DV) < 1e-4, "ssm state of step %d: %g", t,
                  max_diff(ssm, rssm, HV * DK * DV));
            if (nth == 1)
                memcpy(first_y[t], y, sizeof y);
            else
                CHECK(memcmp(first_y[t], y, sizeof y) == 0, "%d threads: other bits", nth);
        }
        pyrt_pool_free(pool);
    }
}

static void expect_error(pyrt_pool *pool, const pyrt_deltanet *w, int64_t conv_n, int64_t ssm_n,
                         const char *needle) {
    static float conv[C * (K - 1) + 1], ssm[HV * DK * DV + 1], x[E], y[E];
    conv[0] = 1.5f, ssm[0] = 2.5f;
    int rc = pyrt_deltanet_step(pool, w, x, conv, conv_n, ssm, ssm_n, y);
    CHECK(rc == PYRT_E_INVALID, "expected PYRT_E_INVALID (%s), got %d", needle, rc);
    CHECK(strstr(pyrt_last_error(), needle) != NULL, "message '%s' lacks '%s'",
          pyrt_last_error(), needle);
    CHECK(conv[0] == 1.5f && ssm[0] == 2.5f, "a refused call wrote the states (%s)", needle);
}

static void test_errors(const layer_data *d) {
    pyrt_pool *pool = NULL;
    CHECK(pyrt_pool_create(2, NULL, &pool) == PYRT_OK, "pool");
    if (pool == NULL)
        return;
    pyrt_deltanet w;
    describe(d, &w);
    const int64_t cn = C * (K - 1), sn = HV * DK * DV;
    expect_error(pool, &w, cn + 1, sn, "conv_state holds");
    expect_error(pool, &w, cn, sn - 1, "ssm_state holds");
    w.out.n_in = HV * DV - 1;
    expect_error(pool, &w, cn, sn, "ssm_out");
    describe(d, &w);
    w.norm.n = DV + 1;
    expect_error(pool, &w, cn, sn, "ssm_norm has 8 floats");
    describe(d, &w);
    w.n_v_heads = 5;
    expect_error(pool, &w, cn, sn, "not a multiple of 2 key heads");
    describe(d, &w);
    w.conv.data = NULL;
    expect_error(pool, &w, cn, sn, "ssm_conv1d");
    describe(d, &w);
    w.qkv.fmt = 77;
    expect_error(pool, &w, cn, sn, "unknown weight format 77");
    describe(d, &w);
    float x[E], y[E], conv[C * (K - 1)], ssm[HV * DK * DV];
    CHECK(pyrt_deltanet_step(NULL, &w, x, conv, cn, ssm, sn, y) == PYRT_E_INVALID, "NULL pool");
    CHECK(pyrt_deltanet_step(pool, NULL, x, conv, cn, ssm, sn, y) == PYRT_E_INVALID, "NULL w");
    CHECK(pyrt_deltanet_step(pool, &w, x, NULL, cn, ssm, sn, y) == PYRT_E_INVALID &&
              strstr(pyrt_last_error(), "conv_state is NULL"),
          "NULL conv_state: %s", pyrt_last_error());
    pyrt_pool_free(pool);
}

int main(void) {
    static layer_data d;
    fill(d.qkv, C * E, 0.5f);
    fill(d.gate, HV * DV * E, 0.5f);
    fill(d.beta, HV * E, 0.5f);
    fill(d.alpha, HV * E, 0.5f);
    fill(d.out, E * HV * DV, 0.3f);
    fill(d.conv, C * K, 0.7f);
    fill(d.dt_bias, HV, 1.0f);
    for (int h = 0; h < HV; h++)
        d.a[h] = -(0.2f + 1.5f * (rnd() + 1.0f)); /* decay rates < 0 */
    for (int j = 0; j < DV; j++)
        d.norm[j] = 1.0f + 0.3f * rnd();
    test_steps(&d);
    test_errors(&d);
    if (failures) {
        printf("%d C deltanet test(s) failed\n", failures);
        return 1;
    }
    printf("all C deltanet tests passed\n");
    return 0;
}

/* pyrt_deltanet_step: one token through a Gated DeltaNet layer (qwen35moe's linear attention;
 * the math of pyruntime/model/deltanet.py's recurrent form), its state owned by the caller.
 *
 * Three pool tasks: the four in-projections (qkv, z, beta, alpha) as one matvec job over x; the
 * value heads, claimed one at a time from a counter (per head two passes over its [dk, dv]
 * state: decay + S^T k, then the rank-one update + S^T q, and the gated RMSNorm of its output);
 * the out-projection, whose rows the waiting threads prefetch while the heads run. The causal
 * conv (C channels of K taps) runs on the calling thread between the first two. */
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "error.h"
#include "linear.h"
#include "pool.h"

#define L2_EPS 1e-6f /* transformers' l2norm (the FLA library's) */

static const char *FN = "pyrt_deltanet_step";

static int check_matrix(const pyrt_matrix *m, int n_out, int n_in, const char *what) {
    int rc = pyrt_matrix_check(m, FN, what);
    if (rc != PYRT_OK)
        return rc;
    if (m->n_out != n_out || m->n_in != n_in)
        return pyrt_fail(PYRT_E_INVALID, "%s: %s has shape [%d, %d], the layer's shape needs "
                         "[%d, %d]", FN, what, m->n_out, m->n_in, n_out, n_in);
    return PYRT_OK;
}

static int check_vector(const pyrt_vector *v, int64_t n, const char *what) {
    if (v->data == NULL || v->n != n)
        return pyrt_fail(PYRT_E_INVALID, "%s: %s has %lld floats%s, the layer's shape needs %lld",
                         FN, what, (long long)v->n, v->data == NULL ? " (NULL)" : "",
                         (long long)n);
    if ((uintptr_t)v->data % 4)
        return pyrt_fail(PYRT_E_INVALID, "%s: %s is not 4-byte aligned", FN, what);
    return PYRT_OK;
}

static int check_layer(const pyrt_deltanet *w) {
    if (w->n_embd < 1 || w->n_k_heads < 1 || w->n_v_heads < 1 || w->head_k_dim < 1 ||
        w->head_v_dim < 1 || w->conv_kernel < 2)
        return pyrt_fail(PYRT_E_INVALID, "%s: n_embd %d, heads %d / %d, head dims %d / %d must "
                         "be >= 1 and conv_kernel %d >= 2", FN, w->n_embd, w->n_k_heads,
                         w->n_v_heads, w->head_k_dim, w->head_v_dim, w->conv_kernel);
    if (w->n_v_heads % w->n_k_heads)
        return pyrt_fail(PYRT_E_INVALID, "%s: %d value heads are not a multiple of %d key heads",
                         FN, w->n_v_heads, w->n_k_heads);
    if (!(w->rms_eps > 0.0f))
        return pyrt_fail(PYRT_E_INVALID, "%s: rms_eps must be > 0", FN);
    const int64_t hv = w->n_v_heads, dv_all = hv * w->head_v_dim;
    const int64_t c = 2 * (int64_t)w->n_k_heads * w->head_k_dim + dv_all;
    if (c > INT32_MAX || dv_all > INT32_MAX)
        return pyrt_fail(PYRT_E_INVALID, "%s: %lld conv channels is too many", FN, (long long)c);
    int rc;
    if ((rc = check_matrix(&w->qkv, (int)c, w->n_embd, "attn_qkv")) != PYRT_OK ||
        (rc = check_matrix(&w->gate, (int)dv_all, w->n_embd, "attn_gate")) != PYRT_OK ||
        (rc = check_matrix(&w->beta, (int)hv, w->n_embd, "ssm_beta")) != PYRT_OK ||
        (rc = check_matrix(&w->alpha, (int)hv, w->n_embd, "ssm_alpha")) != PYRT_OK ||
        (rc = check_matrix(&w->out, w->n_embd, (int)dv_all, "ssm_out")) != PYRT_OK ||
        (rc = check_vector(&w->conv, c * w->conv_kernel, "ssm_conv1d")) != PYRT_OK ||
        (rc = check_vector(&w->dt_bias, hv, "ssm_dt_bias")) != PYRT_OK ||
        (rc = check_vector(&w->a, hv, "ssm_a")) != PYRT_OK ||
        (rc = check_vector(&w->norm, w->head_v_dim, "ssm_norm")) != PYRT_OK)
        return rc;
    return PYRT_OK;
}

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* torch's softplus (beta 1, threshold 20) */
static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* mixed[c] = silu(conv over the channel's last K - 1 inputs and in[c]); the state shifted by one
 * with in[c] as its newest input. */
static void causal_conv(const float *w, float *state, const float *in, float *mixed, int c_n,
                        int k) {
    for (int c = 0; c < c_n; c++) {
        const float *wc = w + (size_t)c * k;
        float *sc = state + (size_t)c * (k - 1);
        float acc = wc[k - 1] * in[c];
        for (int j = 0; j < k - 1; j++)
            acc += wc[j] * sc[j];
        for (int j = 0; j < k - 2; j++)
            sc[j] = sc[j + 1];
        sc[k - 2] = in[c];
        mixed[c] = silu(acc);
    }
}

typedef struct {
    const pyrt_deltanet *w;
    const float *mixed; /* [C]: q [Hk dk], k [Hk dk], v [Hv dv] after the conv */
    const float *z;     /* [Hv dv] */
    const float *beta;  /* [Hv] before the sigmoid */
    const float *alpha; /* [Hv] before dt_bias and the softplus */
    float *ssm;         /* [Hv, dk, dv] */
    float *u;           /* [Hv dv] scratch */
    float *o;           /* [Hv dv] the gated, normed output */
    atomic_int next;    /* next head to claim */
} heads_ctx;

static float inv_norm(const float *v, int n) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++)
        ss += v[i] * v[i];
    return 1.0f / sqrtf(ss + L2_EPS);
}

static void one_head(const heads_ctx *c, int h) {
    const pyrt_deltanet *w = c->w;
    const int dk = w->head_k_dim, dv = w->head_v_dim;
    const int kh = h / (w->n_v_heads / w->n_k_heads);
    const size_t nqk = (size_t)w->n_k_heads * dk;
    const float *q = c->mixed + (size_t)kh * dk, *k = c->mixed + nqk + (size_t)kh * dk;
    const float *v = c->mixed + 2 * nqk + (size_t)h * dv;
    const float qs = inv_norm(q, dk) / sqrtf((float)dk), ks = inv_norm(k, dk);
    const float beta = 1.0f / (1.0f + expf(-c->beta[h]));
    const float decay = expf(w->a.data[h] * softplus(c->alpha[h] + w->dt_bias.data[h]));
    float *s = c->ssm + (size_t)h * dk * dv, *u = c->u + (size_t)h * dv, *o = c->o + (size_t)h * dv;
    memset(u, 0, (size_t)dv * sizeof *u);
    for (int i = 0; i < dk; i++) { /* S = decay S; u = S^T k */
        float *si = s + (size_t)i * dv;
        const float ki = k[i] * ks;
        for (int j = 0; j < dv; j++) {
            si[j] *= decay;
            u[j] += si[j] * ki;
        }
    }
    for (int j = 0; j < dv; j++) {
        u[j] = beta * (v[j] - u[j]);
        o[j] = 0.0f;
    }
    for (int i = 0; i < dk; i++) { /* S += k u^T; o = S^T q */
        float *si = s + (size_t)i * dv;
        const float ki = k[i] * ks, qi = q[i] * qs;
        for (int j = 0; j < dv; j++) {
            si[j] += ki * u[j];
            o[j] += si[j] * qi;
        }
    }
    float ss = 0.0f;
    for (int j = 0; j < dv; j++)
        ss += o[j] * o[j];
    const float r = 1.0f / sqrtf(ss / (float)dv + w->rms_eps);
    const float *z = c->z + (size_t)h * dv, *norm = w->norm.data;
    for (int j = 0; j < dv; j++)
        o[j] = o[j] * r * norm[j] * silu(z[j]);
}

static void task_heads(void *p, int ith, int nth) {
    (void)ith;
    (void)nth;
    heads_ctx *c = p;
    for (int h; (h = atomic_fetch_add_explicit(&c->next, 1, memory_order_relaxed)) <
                c->w->n_v_heads;)
        one_head(c, h);
}

int pyrt_deltanet_step(pyrt_pool *pool, const pyrt_deltanet *w, const float *x,
                       float *conv_state, int64_t conv_n, float *ssm_state, int64_t ssm_n,
                       float *y) {
    pyrt_clear_error();
    if (pool == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: pool is NULL (create one with pyrt_pool_create)", FN);
    if (w == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: the layer's weights are NULL", FN);
    int rc = check_layer(w);
    if (rc != PYRT_OK)
        return rc;
    if (x == NULL || y == NULL || conv_state == NULL || ssm_state == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: %s is NULL", FN,
                         x == NULL ? "x" : y == NULL ? "y" : conv_state == NULL ? "conv_state"
                                                                                : "ssm_state");
    if ((uintptr_t)x % 4 || (uintptr_t)y % 4 || (uintptr_t)conv_state % 4 ||
        (uintptr_t)ssm_state % 4)
        return pyrt_fail(PYRT_E_INVALID, "%s: x, y and the states must be 4-byte aligned", FN);
    const int hv = w->n_v_heads, dk = w->head_k_dim, dv = w->head_v_dim, k = w->conv_kernel;
    const int dv_all = hv * dv, c_n = 2 * w->n_k_heads * dk + dv_all;
    if (conv_n != (int64_t)c_n * (k - 1))
        return pyrt_fail(PYRT_E_INVALID, "%s: conv_state holds %lld floats, the layer's [%d, %d] "
                         "needs %lld", FN, (long long)conv_n, c_n, k - 1,
                         (long long)c_n * (k - 1));
    if (ssm_n != (int64_t)hv * dk * dv)
        return pyrt_fail(PYRT_E_INVALID, "%s: ssm_state holds %lld floats, the layer's [%d, %d, "
                         "%d] needs %lld", FN, (long long)ssm_n, hv, dk, dv,
                         (long long)hv * dk * dv);

    /* workspace: proj (qkv | z | beta | alpha), mixed, u, o, then x's and o's Q8 blocks */
    const size_t n_proj = (size_t)c_n + dv_all + 2 * (size_t)hv;
    const size_t floats = pyrt_align64((n_proj + c_n + 2 * (size_t)dv_all) * sizeof(float));
    const int n_q8 = w->n_embd > dv_all ? w->n_embd : dv_all;
    const size_t bytes = floats + pyrt_xq_units((size_t)n_q8) * sizeof(pyrt_xq8);
    pyrt_pool_acquire(pool);
    char *ws = pyrt_pool_workspace(pool, bytes);
    if (ws == NULL) {
        pyrt_pool_release(pool);
        return pyrt_fail(PYRT_E_NOMEM, "%s: cannot allocate %zu bytes of workspace", FN, bytes);
    }
    float *proj = (float *)ws, *mixed = proj + n_proj, *u = mixed + c_n, *o = u + dv_all;
    pyrt_xq8 *xq = (pyrt_xq8 *)(ws + floats);
    float *z = proj + c_n, *beta = z + dv_all, *alpha = beta + hv;

    pyrt_mv_job in = {
        .out = {{.m = &w->qkv, .y = proj, .y_stride = (size_t)c_n},
                {.m = &w->gate, .y = z, .y_stride = (size_t)dv_all},
                {.m = &w->beta, .y = beta, .y_stride = (size_t)hv},
                {.m = &w->alpha, .y = alpha, .y_stride = (size_t)hv}},
        .n_mats = 4,
    };
    pyrt_mv_run(&in, pool, x, w->n_embd, xq);
    causal_conv(w->conv.data, conv_state, proj, mixed, c_n, k);

    pyrt_mv_job out = {.out = {{.m = &w->out, .y = y, .y_stride = (size_t)w->n_embd}},
                       .n_mats = 1};
    pyrt_mv_job_bind(&out, pool, o, dv_all, xq);
    pyrt_pool_plan_job(pool, &out); /* its rows into the threads' L2 while the heads run */
    heads_ctx hc = {.w = w, .mixed = mixed, .z = z, .beta = beta, .alpha = alpha,
                    .ssm = ssm_state, .u = u, .o = o};
    atomic_init(&hc.next, 0);
    pyrt_pool_run(pool, task_heads, &hc);
    pyrt_mv_run(&out, pool, o, dv_all, xq);
    pyrt_pool_release(pool);
    return PYRT_OK;
}

/* Multi-head latent attention in the C decoder (runtime/src/mla_step.c), under ASan + UBSan:
 * a 2-block deepseek2-like model (a dense first block, then a MoE block with 2 groups of 4
 * experts, one group used, a routed scale and a shared expert), with and without the query
 * LoRA, F32 and Q8_0 k_b / v_b. Checked: the attention half against a float64 reference of the
 * absorbed form over the latent cache the step wrote (F32 weights: only f32 rounding between
 * them); the cache row [c_kv; k_pe] against float64; a prompt's prefill (the chunk form,
 * mla_prefill.c) against that many steps, and its bits whatever the chunks and threads;
 * every routed expert chosen within the best group; wrong MLA shapes refused in one line naming
 * the tensor. The logits against transformers are tests/test_deepseek2.py's. */
#define TEST_RNG_SEED 0x6d6c61c0ffee1234ull
#include "check.h"
#include "tiny_model.h"

enum { M_EMBD = 64, M_HEAD = 3, M_RANK = 32, M_NOPE = 32, M_ROPE = 8, M_V = 32, M_QR = 64 };
enum { M_HD = M_RANK + M_ROPE, M_LAYER = 2, M_EXP = 8, M_K = 2, M_FF = 32, M_CAP = 9 };
enum { M_VOCAB = 40, M_SHFF = 64, M_DENSE = 96 };

typedef struct {
    pyrt_model_weights w;
    pyrt_block_weights blocks[M_LAYER];
    void *owned[64];
    int n_owned;
    float inv_freq[M_ROPE / 2];
} mla_model;

static const void *m_own(mla_model *t, const void *p) {
    t->owned[t->n_owned++] = (void *)p;
    return p;
}

static pyrt_matrix m_matrix(mla_model *t, int fmt, int n_out, int n_in, float s) {
    pyrt_matrix m = make_matrix(fmt, n_out, n_in, s);
    m_own(t, m.data);
    return m;
}

static pyrt_vector m_vec(mla_model *t, int n, float base, float s) {
    return vec(m_own(t, make_vec(n, base, s)), n);
}

/* lora: with the query LoRA; fmt: of k_b and v_b (the other MLA matrices F32). */
static void build_mla(mla_model *t, int lora, int fmt) {
    memset(t, 0, sizeof *t);
    const int f32 = PYRT_FMT_F32, q8 = PYRT_FMT_Q8_0, nq = M_HEAD * (M_NOPE + M_ROPE);
    for (int l = 0; l < M_LAYER; l++) {
        pyrt_block_weights *b = &t->blocks[l];
        b->attn_norm = m_vec(t, M_EMBD, 1.0f, 0.1f);
        b->ffn_norm = m_vec(t, M_EMBD, 1.0f, 0.1f);
        if (lora) {
            b->wq_a = m_matrix(t, f32, M_QR, M_EMBD, 0.2f);
            b->q_a_norm = m_vec(t, M_QR, 1.0f, 0.1f);
            b->wq_b = m_matrix(t, f32, nq, M_QR, 0.2f);
        } else {
            b->wq_b = m_matrix(t, f32, nq, M_EMBD, 0.2f);
        }
        b->wkv_a = m_matrix(t, f32, M_RANK + M_ROPE, M_EMBD, 0.2f);
        b->kv_a_norm = m_vec(t, M_RANK, 1.0f, 0.1f);
        b->wk_b = m_matrix(t, fmt, M_HEAD * M_RANK, M_NOPE, 0.2f);
        b->wv_b = m_matrix(t, fmt, M_HEAD * M_V, M_RANK, 0.2f);
        b->wo = m_matrix(t, f32, M_EMBD, M_HEAD * M_V, 0.2f);
        if (l == 0) {
            b->ffn_gate = m_matrix(t, q8, M_DENSE, M_EMBD, 0.1f);
            b->ffn_up = m_matrix(t, q8, M_DENSE, M_EMBD, 0.1f);
            b->ffn_down = m_matrix(t, q8, M_EMBD, M_DENSE, 0.1f);
            continue;
        }
        b->router = m_matrix(t, f32, M_EXP, M_EMBD, 0.5f);
        pyrt_matrix gud = m_matrix(t, q8, M_EXP * M_FF * 3, M_EMBD, 0.1f);
        b->gud = gud.data;
        b->gud_bytes = gud.bytes;
        b->gud_fmt = q8;
        b->sh_gate = m_matrix(t, q8, M_SHFF, M_EMBD, 0.1f);
        b->sh_up = m_matrix(t, q8, M_SHFF, M_EMBD, 0.1f);
        b->sh_down = m_matrix(t, q8, M_EMBD, M_SHFF, 0.1f);
    }
    for (int i = 0; i < M_ROPE / 2; i++)
        t->inv_freq[i] = powf(10000.0f, -2.0f * i / M_ROPE);
    t->w = (pyrt_model_weights){
        .n_vocab = M_VOCAB, .n_embd = M_EMBD, .n_layer = M_LAYER, .n_head = M_HEAD,
        .n_head_kv = 1, .head_dim = M_HD, .rope_dim = M_ROPE, .n_expert = M_EXP,
        .n_expert_used = M_K, .n_ff_exp = M_FF, .activation = PYRT_ACT_SILU, .rms_eps = 1e-6f,
        .embedding_scale = 1.0f, .residual_scale = 1.0f, .attention_scale = 0.15f,
        .logit_scale = 1.0f, .rope_inv_freq = vec(t->inv_freq, M_ROPE / 2), .rope_scale = 1.2f,
        .mla_kv_rank = M_RANK, .mla_q_rank = lora ? M_QR : 0, .mla_nope_dim = M_NOPE,
        .mla_v_dim = M_V, .expert_weights_scale = 2.5f, .expert_groups = 2,
        .expert_groups_used = 1, .output_norm = m_vec(t, M_EMBD, 1.0f, 0.1f),
        .blocks = t->blocks, .n_blocks = M_LAYER};
    t->w.token_embd = m_matrix(t, q8, M_VOCAB, M_EMBD, 1.0f);
    t->w.output = m_matrix(t, f32, M_VOCAB, M_EMBD, 0.2f);
}

static void free_mla(mla_model *t) {
    for (int i = 0; i < t->n_owned; i++)
        free(t->owned[i]);
}

typedef struct {
    float *c[M_LAYER];
} mla_cache;

static pyrt_kv_cache m_kv(mla_cache *c) {
    return (pyrt_kv_cache){.k = c->c, .v = c->c, .n_layer = M_LAYER, .cap = M_CAP,
                           .layer_floats = (int64_t)M_CAP * M_HD};
}

static void m_cache_alloc(mla_cache *c) {
    for (int l = 0; l < M_LAYER; l++)
        c->c[l] = calloc((size_t)M_CAP * M_HD, sizeof(float));
}

static void m_cache_free(mla_cache *c) {
    for (int l = 0; l < M_LAYER; l++)
        free(c->c[l]);
}

/* ---- float64 reference of the attention half (F32 matrices only) ------------------------- */

static void mv64(const pyrt_matrix *m, int row0, int n_out, const double *x, double *y) {
    const float *w = m->data;
    for (int o = 0; o < n_out; o++) {
        double s = 0.0;
        for (int i = 0; i < m->n_in; i++)
            s += (double)w[(size_t)(row0 + o) * m->n_in + i] * x[i];
        y[o] = s;
    }
}

static void norm64(double *x, const float *w, int n, double eps) {
    double ss = 0.0;
    for (int i = 0; i < n; i++)
        ss += x[i] * x[i];
    const double r = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++)
        x[i] = x[i] * r * w[i];
}

static void rope64(double *x, const mla_model *t, int pos) {
    const int h = M_ROPE / 2;
    double out[M_ROPE];
    for (int i = 0; i < h; i++) {
        const float f = (float)pos * t->inv_freq[i];
        const double c = cos(f) * t->w.rope_scale, s = sin(f) * t->w.rope_scale;
        out[i] = x[i] * c - x[i + h] * s;
        out[i + h] = x[i + h] * c + x[i] * s;
    }
    memcpy(x, out, sizeof out);
}

/* y = the attention half of block b for the normed input xn at pos over `cache` (positions <
 * pos as the step wrote them); row: the float64 [c_kv; k_pe] of pos. */
static void mla64(const mla_model *t, const pyrt_block_weights *b, const double *xn, int pos,
                  const float *cache, double *y, double *row) {
    const int nqh = M_NOPE + M_ROPE;
    double q[M_HEAD * (M_NOPE + M_ROPE)], kv[M_HD], o[M_HEAD * M_V];
    if (b->wq_a.data != NULL) {
        double qa[M_QR];
        mv64(&b->wq_a, 0, M_QR, xn, qa);
        norm64(qa, b->q_a_norm.data, M_QR, t->w.rms_eps);
        mv64(&b->wq_b, 0, M_HEAD * nqh, qa, q);
    } else {
        mv64(&b->wq_b, 0, M_HEAD * nqh, xn, q);
    }
    mv64(&b->wkv_a, 0, M_HD, xn, kv);
    norm64(kv, b->kv_a_norm.data, M_RANK, t->w.rms_eps);
    rope64(kv + M_RANK, t, pos);
    memcpy(row, kv, sizeof kv);
    for (int h = 0; h < M_HEAD; h++) {
        double ql[M_HD], s[M_CAP], ol[M_RANK] = {0};
        mv64(&b->wk_b, h * M_RANK, M_RANK, q + h * nqh, ql);
        memcpy(ql + M_RANK, q + h * nqh + M_NOPE, M_ROPE * sizeof(double));
        rope64(ql + M_RANK, t, pos);
        double mx = -INFINITY, sum = 0.0;
        for (int p = 0; p <= pos; p++) {
            const float *k = cache + (size_t)p * M_HD;
            s[p] = 0.0;
            for (int i = 0; i < M_HD; i++)
                s[p] += ql[i] * (p == pos ? row[i] : (double)k[i]);
            s[p] *= t->w.attention_scale;
            mx = s[p] > mx ? s[p] : mx;
        }
        for (int p = 0; p <= pos; p++)
            sum += (s[p] = exp(s[p] - mx));
        for (int p = 0; p <= pos; p++)
            for (int i = 0; i < M_RANK; i++)
                ol[i] += s[p] / sum * (p == pos ? row[i] : (double)cache[(size_t)p * M_HD + i]);
        mv64(&b->wv_b, h * M_V, M_V, ol, o + h * M_V);
    }
    mv64(&b->wo, 0, M_EMBD, o, y);
}

/* Steps of tokens 0..n-1 in pieces; at each layer's attention the half is compared with mla64
 * (where the MLA matrices are F32). */
static void test_attention_vs_f64(int lora) {
    mla_model t;
    build_mla(&t, lora, PYRT_FMT_F32);
    pyrt_decoder *dec = NULL;
    pyrt_pool *pool = NULL;
    CHECK(pyrt_decoder_create(&t.w, &dec) == PYRT_OK, "create: %s", pyrt_last_error());
    CHECK(pyrt_pool_create(2, NULL, &pool) == PYRT_OK, "pool");
    mla_cache c;
    m_cache_alloc(&c);
    float logits[M_VOCAB], x0[M_EMBD], x1[M_EMBD];
    double worst = 0.0, worst_row = 0.0;
    for (int pos = 0; pos < 6; pos++) {
        pyrt_step_args a = {.token = (7 * pos + 3) % M_VOCAB, .pos = pos, .cache = m_kv(&c),
                            .logits = logits, .logits_len = M_VOCAB};
        CHECK(pyrt_decoder_begin(dec, pool, &a) == PYRT_OK, "begin: %s", pyrt_last_error());
        for (int l = 0; l < M_LAYER; l++) {
            const pyrt_block_weights *b = &t.blocks[l];
            pyrt_decoder_read_x(dec, x0);
            double xn[M_EMBD], y[M_EMBD], row[M_HD];
            for (int i = 0; i < M_EMBD; i++)
                xn[i] = x0[i];
            norm64(xn, b->attn_norm.data, M_EMBD, t.w.rms_eps);
            mla64(&t, b, xn, pos, c.c[l], y, row);
            CHECK(pyrt_decoder_attention(dec, pool, l, &a) == PYRT_OK, "attention: %s",
                  pyrt_last_error());
            pyrt_decoder_read_x(dec, x1);
            for (int i = 0; i < M_EMBD; i++) {
                const double d = fabs((double)x1[i] - x0[i] - y[i]) / (1.0 + fabs(y[i]));
                worst = d > worst ? d : worst;
            }
            for (int i = 0; i < M_HD; i++) {
                const double d = fabs((double)c.c[l][(size_t)pos * M_HD + i] - row[i]);
                worst_row = d > worst_row ? d : worst_row;
            }
            CHECK(pyrt_decoder_ffn(dec, pool, l, &a) == PYRT_OK, "ffn: %s", pyrt_last_error());
        }
        CHECK(pyrt_decoder_end(dec, pool, &a) == PYRT_OK, "end: %s", pyrt_last_error());
    }
    CHECK(worst < 2e-5, "lora=%d: attention half vs float64: %g", lora, worst);
    CHECK(worst_row < 2e-5, "lora=%d: cache row vs float64: %g", lora, worst_row);
    m_cache_free(&c);
    pyrt_pool_free(pool);
    pyrt_decoder_free(dec);
    free_mla(&t);
}

/* n steps from pos 0 on `threads` threads (logits [n, M_VOCAB]; the last step's route ids
 * [M_LAYER, M_K]); the cache is the caller's. */
static void steps(const pyrt_model_weights *w, int threads, const int32_t *tokens, int n,
                  mla_cache *c, float *logits, int32_t *ids) {
    pyrt_decoder *dec = NULL;
    pyrt_pool *pool = NULL;
    CHECK(pyrt_decoder_create(w, &dec) == PYRT_OK, "create: %s", pyrt_last_error());
    CHECK(pyrt_pool_create(threads, NULL, &pool) == PYRT_OK, "pool");
    for (int i = 0; i < n; i++) {
        pyrt_step_args a = {.token = tokens[i], .pos = i, .cache = m_kv(c),
                            .logits = logits + (size_t)i * M_VOCAB, .logits_len = M_VOCAB,
                            .route_ids = ids, .route_ids_len = M_LAYER * M_K};
        CHECK(pyrt_decoder_step(dec, pool, &a) == PYRT_OK, "step: %s", pyrt_last_error());
        CHECK(a.n_pairs == M_K, "pairs %lld", (long long)a.n_pairs);
    }
    pyrt_pool_free(pool);
    pyrt_decoder_free(dec);
}

/* Tokens [first, first + n) prefilled after `first` steps; logits [first + n, M_VOCAB] (the
 * steps' rows, then the prefill's: every row, or the last only). */
static void prefill(const pyrt_model_weights *w, int threads, int ubatch, int all_logits,
                    const int32_t *tokens, int first, int n, mla_cache *c, float *logits,
                    int32_t *ids) {
    int32_t step_ids[M_LAYER * M_K];
    steps(w, threads, tokens, first, c, logits, step_ids);
    pyrt_decoder *dec = NULL;
    pyrt_pool *pool = NULL;
    CHECK(pyrt_decoder_create(w, &dec) == PYRT_OK, "create: %s", pyrt_last_error());
    CHECK(pyrt_pool_create(threads, NULL, &pool) == PYRT_OK, "pool");
    float *out = logits + (size_t)first * M_VOCAB;
    pyrt_prefill_args p = {.tokens = tokens + first, .n_tokens = n, .pos = first,
                           .ubatch = ubatch, .cache = m_kv(c), .all_logits = all_logits,
                           .logits = all_logits ? out : out + (size_t)(n - 1) * M_VOCAB,
                           .logits_len = all_logits ? n * M_VOCAB : M_VOCAB, .route_ids = ids,
                           .route_ids_len = M_LAYER * M_K};
    CHECK(pyrt_decoder_prefill(dec, pool, &p) == PYRT_OK, "prefill: %s", pyrt_last_error());
    CHECK(p.n_pairs == n * M_K, "prefill pairs %lld", (long long)p.n_pairs);
    pyrt_pool_free(pool);
    pyrt_decoder_free(dec);
}

static float max_diff(const float *a, const float *b, size_t n) {
    float worst = 0.0f;
    for (size_t i = 0; i < n; i++)
        worst = fmaxf(worst, fabsf(a[i] - b[i]));
    return worst;
}

/* The chunk form (mla_prefill.c) against steps: f32 rounding apart (the matrix products over a
 * chunk's tokens sum in another order); the same bits whatever the chunk size, threads, and
 * logits asked for; from an empty cache and after steps. */
static void test_prefill_is_steps(int lora, int fmt) {
    mla_model t;
    build_mla(&t, lora, fmt);
    enum { N = M_CAP };
    const int32_t tokens[N] = {1, 9, 33, 4, 4, 17, 38, 0, 21};
    static float by_steps[N * M_VOCAB], pre[N * M_VOCAB], other[N * M_VOCAB];
    int32_t ids[M_LAYER * M_K], ids_p[M_LAYER * M_K];
    mla_cache cs, cp, co;
    m_cache_alloc(&cs);
    steps(&t.w, 1, tokens, N, &cs, by_steps, ids);
    for (int k = 0; k < M_K; k++) /* one group of 4 used: every pick in the same group */
        CHECK(ids[M_K + k] / 4 == ids[M_K] / 4, "ids %d %d outside one group", ids[M_K],
              ids[M_K + k]);
    CHECK(ids[0] == -1, "the dense block's route ids are -1");
    for (int first = 0; first <= 4; first += 4) {
        m_cache_alloc(&cp);
        prefill(&t.w, 3, 2, 1, tokens, first, N - first, &cp, pre, ids_p);
        const float d = max_diff(pre, by_steps, (size_t)N * M_VOCAB);
        const float dc = max_diff(cp.c[1], cs.c[1], (size_t)N * M_HD);
        CHECK(d <= 1e-4f && dc <= 1e-4f, "lora=%d fmt=%d after %d: prefill vs steps %g, caches %g",
              lora, fmt, first, d, dc);
        CHECK(memcmp(ids, ids_p, sizeof ids) == 0, "prefill route ids != the last step's");
        const int ubatches[] = {1, 4, 0};
        for (int u = 0; u < COUNT_OF(ubatches); u++)
            for (int threads = 1; threads <= 4; threads += 3)
                for (int all = 0; all < 2; all++) {
                    m_cache_alloc(&co);
                    prefill(&t.w, threads, ubatches[u], all, tokens, first, N - first, &co, other,
                            ids_p);
                    const size_t from = all ? (size_t)first * M_VOCAB : (size_t)(N - 1) * M_VOCAB;
                    CHECK(memcmp(pre + from, other + from, (N * M_VOCAB - from) * sizeof(float)) ==
                              0,
                          "lora=%d fmt=%d after %d: ubatch %d, %d threads, all %d moved bits",
                          lora, fmt, first, ubatches[u], threads, all);
                    m_cache_free(&co);
                }
        m_cache_free(&cp);
    }
    m_cache_free(&cs);
    free_mla(&t);
}

static void expect_refused(const pyrt_model_weights *w, const char *name) {
    pyrt_decoder *dec = NULL;
    const int rc = pyrt_decoder_create(w, &dec);
    CHECK(rc == PYRT_E_INVALID && dec == NULL && strstr(pyrt_last_error(), name) != NULL,
          "%s: create gave %d: %s", name, rc, pyrt_last_error());
    pyrt_decoder_free(dec);
}

static void test_bad_shapes(void) {
    mla_model t;
    build_mla(&t, 1, PYRT_FMT_Q8_0);
    pyrt_block_weights *b = &t.blocks[1];
    const pyrt_block_weights saved = *b;
    b->wk_b.n_out -= 32; /* one head's rows short */
    b->wk_b.bytes = (size_t)b->wk_b.n_out * pyrt_row_bytes(b->wk_b.fmt, b->wk_b.n_in);
    expect_refused(&t.w, "blk.1.attn_k_b");
    *b = saved;
    b->kv_a_norm.n = M_RANK - 1;
    expect_refused(&t.w, "blk.1.attn_kv_a_norm");
    *b = saved;
    b->wq_a = (pyrt_matrix){0};
    expect_refused(&t.w, "blk.1.attn_q_a");
    *b = saved;
    b->wq = b->wq_b;
    expect_refused(&t.w, "blk.1.attn_q/k/v");
    *b = saved;
    t.w.head_dim = M_HD + 1;
    expect_refused(&t.w, "head_dim = mla_kv_rank + rope_dim");
    t.w.head_dim = M_HD;
    t.w.expert_groups = 3; /* does not divide 8 experts */
    expect_refused(&t.w, "expert_groups=3");
    t.w.expert_groups = 2;
    /* k beyond the used group's 4 experts: refused per call */
    pyrt_decoder *dec = NULL;
    pyrt_pool *pool = NULL;
    CHECK(pyrt_decoder_create(&t.w, &dec) == PYRT_OK, "create: %s", pyrt_last_error());
    CHECK(pyrt_pool_create(1, NULL, &pool) == PYRT_OK, "pool");
    mla_cache c;
    m_cache_alloc(&c);
    float logits[M_VOCAB];
    pyrt_step_args a = {.token = 1, .cache = m_kv(&c), .logits = logits, .logits_len = M_VOCAB,
                        .experts = {.k = 5}};
    CHECK(pyrt_decoder_step(dec, pool, &a) == PYRT_E_INVALID &&
              strstr(pyrt_last_error(), "best expert groups") != NULL,
          "k=5 over one group of 4: %s", pyrt_last_error());
    m_cache_free(&c);
    pyrt_pool_free(pool);
    pyrt_decoder_free(dec);
    free_mla(&t);
}

int main(void) {
    for (int lora = 0; lora < 2; lora++) {
        test_attention_vs_f64(lora);
        for (int fmt = 0; fmt < 2; fmt++)
            test_prefill_is_steps(lora, fmt ? PYRT_FMT_Q8_0 : PYRT_FMT_F32);
    }
    test_bad_shapes();
    if (failures) {
        printf("%d C MLA test(s) failed\n", failures);
        return 1;
    }
    printf("all C MLA tests passed\n");
    return 0;
}

/* The C tests' tiny model (test_decode.c, test_prefill.c): random F32 / Q8_0 weights, and a
 * 3-block model touching every block kind (MoE + shared expert + gate + biases + per-head q/k
 * norm; dense FFN + q/k norm over all heads; plain MoE), partial RoPE and clamp; its KV cache
 * and expert arguments. Include after check.h. */
#ifndef PYRT_TEST_TINY_MODEL_H
#define PYRT_TEST_TINY_MODEL_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pyrt.h"
#include "rows.h"

static inline float rng_uniform(void) { /* [-1, 1) */
    return (float)rng_u32() / 2147483648.0f - 1.0f;
}

/* ---- weights ------------------------------------------------------------------------------- */

/* A matrix [n_out, n_in] in fmt (F32 or Q8_0) with random values of scale `s`; malloc'd bytes. */
static inline pyrt_matrix make_matrix(int fmt, int n_out, int n_in, float s) {
    const size_t rb = pyrt_row_bytes(fmt, n_in);
    uint8_t *data = malloc(rb * (size_t)n_out);
    if (fmt == PYRT_FMT_F32) {
        float *w = (float *)data;
        for (size_t i = 0; i < (size_t)n_out * n_in; i++)
            w[i] = s * rng_uniform();
    } else { /* Q8_0: d = 2^-7 * s-ish (an exact f16), q uniform in [-127, 127] */
        for (size_t b = 0; b < (size_t)n_out * n_in / PYRT_QK; b++) {
            uint8_t *blk = data + b * PYRT_Q8_0_BYTES;
            const uint16_t d = 0x2000; /* f16 2^-7 */
            memcpy(blk, &d, 2);
            for (int i = 0; i < PYRT_QK; i++)
                blk[2 + i] = (uint8_t)(int8_t)((int)(rng_u32() % 255) - 127);
        }
    }
    return (pyrt_matrix){.data = data, .bytes = rb * (size_t)n_out, .fmt = fmt, .n_out = n_out,
                         .n_in = n_in};
}

static inline float *make_vec(int n, float base, float s) {
    float *v = malloc((size_t)n * sizeof *v);
    for (int i = 0; i < n; i++)
        v[i] = base + s * rng_uniform();
    return v;
}

/* ---- the tiny model ------------------------------------------------------------------------ */

enum { N_EMBD = 64, N_HEAD = 4, N_KV = 2, HD = 16, N_EXP = 4, TOP_K = 2, N_FF = 32, N_VOCAB = 50 };
enum { N_LAYER = 3, SH_FF = 64, DENSE_FF = 96, CAP = 7 };

typedef struct {
    pyrt_model_weights w;
    pyrt_block_weights blocks[N_LAYER];
    void *owned[128];
    int n_owned;
} tiny_model;

static const void *own(tiny_model *t, const void *p) {
    t->owned[t->n_owned++] = (void *)p;
    return p;
}

static inline pyrt_vector vec(const float *data, int n) {
    return (pyrt_vector){.data = data, .n = n};
}

static inline pyrt_matrix own_matrix(tiny_model *t, int fmt, int n_out, int n_in, float s) {
    pyrt_matrix m = make_matrix(fmt, n_out, n_in, s);
    own(t, m.data);
    return m;
}

static inline pyrt_vector own_vec(tiny_model *t, int n, float base, float s) {
    return vec(own(t, make_vec(n, base, s)), n);
}

static inline void build_tiny(tiny_model *t) {
    memset(t, 0, sizeof *t);
    const int q8 = PYRT_FMT_Q8_0, nq = N_HEAD * HD, nkv = N_KV * HD;
    for (int l = 0; l < N_LAYER; l++) {
        pyrt_block_weights *b = &t->blocks[l];
        b->attn_norm = own_vec(t, N_EMBD, 1.0f, 0.1f);
        b->ffn_norm = own_vec(t, N_EMBD, 1.0f, 0.1f);
        b->wq = own_matrix(t, q8, nq, N_EMBD, 0.1f);
        b->wk = own_matrix(t, q8, nkv, N_EMBD, 0.1f);
        b->wv = own_matrix(t, l == 2 ? PYRT_FMT_F32 : q8, nkv, N_EMBD, 0.1f);
        b->wo = own_matrix(t, q8, N_EMBD, nq, 0.1f);
        if (l == 0) { /* qwen2moe-like: biases, per-head norms, shared expert with its gate */
            b->bq = own_vec(t, nq, 0.0f, 0.5f);
            b->bk = own_vec(t, nkv, 0.0f, 0.5f);
            b->bv = own_vec(t, nkv, 0.0f, 0.5f);
            b->q_norm = own_vec(t, HD, 1.0f, 0.1f);
            b->k_norm = own_vec(t, HD, 1.0f, 0.1f);
            b->sh_gate = own_matrix(t, q8, SH_FF, N_EMBD, 0.1f);
            b->sh_up = own_matrix(t, q8, SH_FF, N_EMBD, 0.1f);
            b->sh_down = own_matrix(t, q8, N_EMBD, SH_FF, 0.1f);
            b->sh_gate_inp = own_vec(t, N_EMBD, 0.0f, 0.1f);
        }
        if (l == 1) { /* olmoe-like norms over all heads; a dense FFN layer */
            b->q_norm = own_vec(t, nq, 1.0f, 0.1f);
            b->k_norm = own_vec(t, nkv, 1.0f, 0.1f);
            b->ffn_gate = own_matrix(t, q8, DENSE_FF, N_EMBD, 0.1f);
            b->ffn_up = own_matrix(t, q8, DENSE_FF, N_EMBD, 0.1f);
            b->ffn_down = own_matrix(t, q8, N_EMBD, DENSE_FF, 0.1f);
            continue;
        }
        b->router = own_matrix(t, PYRT_FMT_F32, N_EXP, N_EMBD, 0.3f);
        pyrt_matrix gud = own_matrix(t, q8, N_EXP * N_FF * 3, N_EMBD, 0.1f);
        b->gud = gud.data;
        b->gud_bytes = gud.bytes;
        b->gud_fmt = q8;
    }
    static float inv_freq[4];
    for (int i = 0; i < 4; i++)
        inv_freq[i] = powf(10000.0f, -2.0f * i / 8.0f);
    t->w = (pyrt_model_weights){
        .n_vocab = N_VOCAB, .n_embd = N_EMBD, .n_layer = N_LAYER, .n_head = N_HEAD,
        .n_head_kv = N_KV, .head_dim = HD, .rope_dim = 8, .n_expert = N_EXP,
        .n_expert_used = TOP_K, .n_ff_exp = N_FF, .expert_weights_norm = 1,
        .activation = PYRT_ACT_SILU, .rms_eps = 1e-6f, .embedding_scale = 2.0f,
        .residual_scale = 0.5f, .attention_scale = 0.25f, .logit_scale = 3.0f,
        .clamp_kqv = 4.0f, .rope_inv_freq = vec(inv_freq, 4),
        .output_norm = own_vec(t, N_EMBD, 1.0f, 0.1f), .blocks = t->blocks, .n_blocks = N_LAYER};
    t->w.token_embd = own_matrix(t, q8, N_VOCAB, N_EMBD, 1.0f);
    t->w.output = own_matrix(t, PYRT_FMT_F32, N_VOCAB, N_EMBD, 0.2f);
}

static inline void free_tiny(tiny_model *t) {
    for (int i = 0; i < t->n_owned; i++)
        free(t->owned[i]);
}

static const float THRESHOLDS[N_LAYER] = {0.0f, 0.0f, 0.05f};

/* A KV cache of `cap` positions per layer ([N_KV, cap, HD] each, zeroed). */
typedef struct {
    float *kc[N_LAYER], *vc[N_LAYER];
    int cap;
} tiny_cache;

static inline pyrt_kv_cache kv(tiny_cache *c) {
    return (pyrt_kv_cache){.k = c->kc, .v = c->vc, .n_layer = N_LAYER, .cap = c->cap,
                           .layer_floats = (int64_t)N_KV * c->cap * HD};
}

/* expert arguments: thresholds [N_LAYER] or NULL, k, maps [N_LAYER] or NULL */
static inline pyrt_expert_args experts_args(const float *thresholds, int k,
                                            const int32_t *const *maps) {
    return (pyrt_expert_args){.thresholds = thresholds, .n_thresholds = thresholds ? N_LAYER : 0,
                              .k = k, .maps = maps, .n_maps = maps ? N_LAYER : 0,
                              .map_len = N_EXP};
}

static inline void cache_alloc_cap(tiny_cache *c, int cap) {
    c->cap = cap;
    for (int l = 0; l < N_LAYER; l++) {
        c->kc[l] = calloc((size_t)N_KV * cap * HD, sizeof(float));
        c->vc[l] = calloc((size_t)N_KV * cap * HD, sizeof(float));
    }
}

static inline void cache_alloc(tiny_cache *c) {
    cache_alloc_cap(c, CAP);
}

static inline void cache_free(tiny_cache *c) {
    for (int l = 0; l < N_LAYER; l++) {
        free(c->kc[l]);
        free(c->vc[l]);
    }
}

#endif

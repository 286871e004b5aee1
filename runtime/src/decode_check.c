/* The decoder's checks: every shape and format of the model once at creation, with the tensor's
 * name in the message (blk.N.attn_q, ...), and the arguments of each step. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "decoder.h"
#include "error.h"

static int check_shape(const pyrt_matrix *m, int n_out, int n_in, const char *what, int layer) {
    char name[64];
    if (layer >= 0)
        snprintf(name, sizeof name, "blk.%d.%s", layer, what);
    else
        snprintf(name, sizeof name, "%s", what);
    int rc = pyrt_matrix_check(m, "pyrt_decoder_create", name);
    if (rc != PYRT_OK)
        return rc;
    if (m->n_out != n_out || m->n_in != n_in)
        return pyrt_fail(PYRT_E_INVALID,
                         "pyrt_decoder_create: %s has shape [%d, %d], the model needs [%d, %d]",
                         name, m->n_out, m->n_in, n_out, n_in);
    return PYRT_OK;
}

#define CHECK(call)                                                                               \
    do {                                                                                          \
        int rc_ = (call);                                                                         \
        if (rc_ != PYRT_OK)                                                                       \
            return rc_;                                                                           \
    } while (0)

static int fail_block(int i, const char *msg) {
    return pyrt_fail(PYRT_E_INVALID, "pyrt_decoder_create: blk.%d: %s", i, msg);
}

static int check_block(const pyrt_model_weights *w, const pyrt_block_weights *b, int i,
                       int *max_ff) {
    const int n_embd = w->n_embd, nq = w->n_head * w->head_dim, nkv = w->n_head_kv * w->head_dim;
    if (b->attn_norm == NULL || b->ffn_norm == NULL)
        return fail_block(i, "attn_norm or ffn_norm is NULL");
    CHECK(check_shape(&b->wq, nq, n_embd, "attn_q", i));
    CHECK(check_shape(&b->wk, nkv, n_embd, "attn_k", i));
    CHECK(check_shape(&b->wv, nkv, n_embd, "attn_v", i));
    CHECK(check_shape(&b->wo, n_embd, nq, "attn_output", i));
    if ((b->q_norm == NULL) != (b->k_norm == NULL))
        return fail_block(i, "q_norm and k_norm must be both present or both absent");
    if (b->q_norm != NULL) {
        const int all = b->q_norm_len == nq && b->k_norm_len == nkv;
        const int per_head = b->q_norm_len == w->head_dim && b->k_norm_len == w->head_dim;
        if (!all && !per_head)
            return pyrt_fail(PYRT_E_INVALID,
                             "pyrt_decoder_create: blk.%d: q/k norms have %d/%d elements; expected "
                             "%d/%d (over all heads) or %d/%d (per head)", i, b->q_norm_len,
                             b->k_norm_len, nq, nkv, w->head_dim, w->head_dim);
    }
    if (b->router.data != NULL) {
        CHECK(check_shape(&b->router, w->n_expert, n_embd, "ffn_gate_inp", i));
        const size_t rb = pyrt_row_bytes(b->gud_fmt, n_embd);
        if (b->gud == NULL || !pyrt_fmt_known(b->gud_fmt) || rb == 0 ||
            (double)w->n_expert * w->n_ff_exp * 3.0 * (double)rb != (double)b->gud_bytes)
            return pyrt_fail(PYRT_E_INVALID,
                             "pyrt_decoder_create: blk.%d.ffn_gud_exps: NULL, unknown format %d, "
                             "or %zu bytes where [%d, %d, 3, %d] needs %.0f", i, b->gud_fmt,
                             b->gud_bytes, w->n_expert, w->n_ff_exp, n_embd,
                             (double)w->n_expert * w->n_ff_exp * 3.0 * (double)rb);
        /* checked here, once: the fused router's pyrt_moe_ffn_routed skips check_args */
        if (pyrt_check_weights_aligned("pyrt_decoder_create: ffn_gud_exps", b->gud, b->gud_fmt) !=
            PYRT_OK)
            return PYRT_E_INVALID;
        if ((b->exp_bias_gu == NULL) != (b->exp_bias_down == NULL))
            return fail_block(i, "exp_bias_gu and exp_bias_down go together (both or none)");
        if (b->sh_gate.data != NULL && w->activation == PYRT_ACT_SWIGLU_OAI)
            return fail_block(i, "a shared expert with the swiglu oai activation is not supported");
        if (b->sh_gate.data != NULL) {
            const int n_ff = b->sh_gate.n_out;
            CHECK(check_shape(&b->sh_gate, n_ff, n_embd, "ffn_gate_shexp", i));
            CHECK(check_shape(&b->sh_up, n_ff, n_embd, "ffn_up_shexp", i));
            CHECK(check_shape(&b->sh_down, n_embd, n_ff, "ffn_down_shexp", i));
            *max_ff = n_ff > *max_ff ? n_ff : *max_ff;
        } else if (b->sh_gate_inp != NULL) {
            return fail_block(i, "ffn_gate_inp_shexp without a shared expert");
        }
    } else {
        if (w->activation == PYRT_ACT_SWIGLU_OAI)
            return fail_block(i, "a dense FFN with the swiglu oai activation is not supported");
        const int n_ff = b->ffn_gate.n_out;
        CHECK(check_shape(&b->ffn_gate, n_ff, n_embd, "ffn_gate", i));
        CHECK(check_shape(&b->ffn_up, n_ff, n_embd, "ffn_up", i));
        CHECK(check_shape(&b->ffn_down, n_embd, n_ff, "ffn_down", i));
        *max_ff = n_ff > *max_ff ? n_ff : *max_ff;
    }
    if (b->window < 0)
        return fail_block(i, "window must be >= 0 (0: full attention)");
    return PYRT_OK;
}

int pyrt_decoder_check_model(const pyrt_model_weights *w, int *max_ff) {
    const char *fn = "pyrt_decoder_create";
    if (w->n_vocab < 1 || w->n_embd < 1 || w->n_layer < 1 || w->n_head < 1 || w->n_head_kv < 1 ||
        w->head_dim < 1 || w->n_expert < 1 || w->n_expert_used < 1 || w->n_ff_exp < 1)
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: sizes must be positive: n_vocab=%d n_embd=%d n_layer=%d n_head=%d "
                         "n_head_kv=%d head_dim=%d n_expert=%d n_expert_used=%d n_ff_exp=%d", fn,
                         w->n_vocab, w->n_embd, w->n_layer, w->n_head, w->n_head_kv, w->head_dim,
                         w->n_expert, w->n_expert_used, w->n_ff_exp);
    if (w->n_head % w->n_head_kv != 0)
        return pyrt_fail(PYRT_E_INVALID, "%s: n_head=%d is not a multiple of n_head_kv=%d", fn,
                         w->n_head, w->n_head_kv);
    if (w->n_expert_used > w->n_expert)
        return pyrt_fail(PYRT_E_INVALID, "%s: n_expert_used=%d > n_expert=%d", fn,
                         w->n_expert_used, w->n_expert);
    if (w->rope_dim < 0 || w->rope_dim % 2 || w->rope_dim > w->head_dim ||
        (w->rope_dim > 0 && w->rope_inv_freq == NULL))
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: rope_dim=%d must be even, <= head_dim=%d, with rope_inv_freq set", fn,
                         w->rope_dim, w->head_dim);
    CHECK(pyrt_check_activation(w->activation, w->swiglu_alpha, w->swiglu_limit, fn));
    if (!(w->rope_scale >= 0.0f) || isinf(w->rope_scale))
        return pyrt_fail(PYRT_E_INVALID, "%s: rope_scale must be finite and >= 0 (0: 1)", fn);
    if (w->blocks == NULL || w->output_norm == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: blocks or output_norm is NULL", fn);
    if (!(w->logit_scale != 0.0f) || !(w->rms_eps >= 0.0f) || !(w->clamp_kqv >= 0.0f))
        return pyrt_fail(PYRT_E_INVALID, "%s: logit_scale must be non-zero, rms_eps and clamp_kqv "
                         ">= 0", fn);
    CHECK(check_shape(&w->token_embd, w->n_vocab, w->n_embd, "token_embd", -1));
    CHECK(check_shape(&w->output, w->n_vocab, w->n_embd, "output", -1));
    for (int i = 0; i < w->n_layer; i++)
        CHECK(check_block(w, &w->blocks[i], i, max_ff));
    return PYRT_OK;
}

int pyrt_decoder_check_call(const pyrt_decoder *d, const pyrt_pool *pool, const pyrt_step_args *a,
                            const char *fn) {
    if (d == NULL || pool == NULL || a == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: %s is NULL", fn,
                         d == NULL ? "dec" : pool == NULL ? "pool" : "args");
    if (a->k < 0 || a->k > d->w.n_expert)
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: k=%d experts per token is outside [1, n_expert=%d] (0: the model's "
                         "%d)", fn, a->k, d->w.n_expert, d->w.n_expert_used);
    return PYRT_OK;
}

int pyrt_decoder_check_token(const pyrt_decoder *d, const pyrt_step_args *a, const char *fn) {
    if (a->token < 0 || a->token >= d->w.n_vocab)
        return pyrt_fail(PYRT_E_INVALID, "%s: token %d is outside [0, n_vocab=%d)", fn, a->token,
                         d->w.n_vocab);
    return PYRT_OK;
}

int pyrt_decoder_check_layer(const pyrt_decoder *d, int layer, const char *fn) {
    if (layer < 0 || layer >= d->w.n_layer)
        return pyrt_fail(PYRT_E_INVALID, "%s: layer %d is outside [0, n_layer=%d)", fn, layer,
                         d->w.n_layer);
    return PYRT_OK;
}

int pyrt_decoder_check_attention(int layer, const pyrt_step_args *a, const char *fn) {
    if (a->pos < 0 || a->pos >= a->cache_cap)
        return pyrt_fail(PYRT_E_INVALID, "%s: position %d is outside the cache [0, %d)", fn, a->pos,
                         a->cache_cap);
    if (a->k_cache == NULL || a->v_cache == NULL || a->k_cache[layer] == NULL ||
        a->v_cache[layer] == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: kv cache of layer %d is NULL", fn, layer);
    return PYRT_OK;
}

int pyrt_decoder_check_ffn(const pyrt_decoder *d, int layer, const pyrt_step_args *a,
                           const char *fn) {
    const float *thr = a->thresholds;
    if (thr != NULL && (!(thr[layer] >= 0.0f) || isinf(thr[layer])))
        return pyrt_fail(PYRT_E_INVALID, "%s: threshold of layer %d must be finite and >= 0", fn,
                         layer);
    const int32_t *map = a->expert_maps != NULL ? a->expert_maps[layer] : NULL;
    if (map == NULL || d->blocks[layer].router.data == NULL)
        return PYRT_OK;
    if ((uintptr_t)map % 4)
        return pyrt_fail(PYRT_E_INVALID, "%s: expert map of layer %d is not 4-byte aligned", fn,
                         layer);
    for (int e = 0; e < d->w.n_expert; e++)
        if (map[e] < -1 || map[e] >= d->w.n_expert)
            return pyrt_fail(PYRT_E_INVALID,
                             "%s: expert map of layer %d: [%d] = %d is outside [-1, n_expert=%d)",
                             fn, layer, e, (int)map[e], d->w.n_expert);
    return PYRT_OK;
}

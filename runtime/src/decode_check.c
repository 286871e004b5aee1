/* The decoder's checks: every shape and format of the model once at creation, with the tensor's
 * name in the message (blk.N.attn_q, ...), and the arguments of each step. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "decoder.h"
#include "error.h"
#include "model_check.h"

/* A tensor's GGUF name: blk.<layer>.<what>, or <what> for a model-level one (layer < 0). */
static void tensor_name(char *name, size_t size, const char *what, int layer) {
    if (layer >= 0)
        snprintf(name, size, "blk.%d.%s", layer, what);
    else
        snprintf(name, size, "%s", what);
}

int pyrt_check_model_matrix(const pyrt_matrix *m, int n_out, int n_in, const char *what,
                            int layer) {
    char name[64];
    tensor_name(name, sizeof name, what, layer);
    int rc = pyrt_matrix_check(m, "pyrt_decoder_create", name);
    if (rc != PYRT_OK)
        return rc;
    if (m->n_out != n_out || m->n_in != n_in)
        return pyrt_fail(PYRT_E_INVALID,
                         "pyrt_decoder_create: %s has shape [%d, %d], the model needs [%d, %d]",
                         name, m->n_out, m->n_in, n_out, n_in);
    return PYRT_OK;
}

static int fail_block(int i, const char *msg) {
    return pyrt_fail(PYRT_E_INVALID, "pyrt_decoder_create: blk.%d: %s", i, msg);
}

/* A float32 vector of the model: present with exactly n elements (4-byte aligned), or, where
 * `optional`, absent (data NULL, n 0). */
static int check_vector(const pyrt_vector *v, int64_t n, int optional, const char *what,
                        int layer) {
    char name[64];
    tensor_name(name, sizeof name, what, layer);
    if (v->data == NULL) {
        if (optional && v->n == 0)
            return PYRT_OK;
        return pyrt_fail(PYRT_E_INVALID, "pyrt_decoder_create: %s is NULL%s", name,
                         optional ? " with a length" : "");
    }
    if (v->n != n)
        return pyrt_fail(PYRT_E_INVALID,
                         "pyrt_decoder_create: %s has %lld elements, the model needs %lld", name,
                         (long long)v->n, (long long)n);
    if ((uintptr_t)v->data % 4)
        return pyrt_fail(PYRT_E_INVALID, "pyrt_decoder_create: %s is not 4-byte aligned", name);
    return PYRT_OK;
}

static int check_qk_norms(const pyrt_model_weights *w, const pyrt_block_weights *b, int i) {
    const int64_t nq = (int64_t)w->n_head * w->head_dim, nkv = (int64_t)w->n_head_kv * w->head_dim;
    if ((b->q_norm.data == NULL) != (b->k_norm.data == NULL))
        return fail_block(i, "q_norm and k_norm must be both present or both absent");
    if (b->q_norm.data == NULL)
        return PYRT_OK;
    /* over all heads (olmoe) or per head (qwen3moe): the lengths say which */
    const int per_head = b->q_norm.n == w->head_dim && b->k_norm.n == w->head_dim;
    PYRT_CHECK(check_vector(&b->q_norm, per_head ? w->head_dim : nq, 0, "attn_q_norm", i));
    PYRT_CHECK(check_vector(&b->k_norm, per_head ? w->head_dim : nkv, 0, "attn_k_norm", i));
    return PYRT_OK;
}

static int check_block(const pyrt_model_weights *w, const pyrt_block_weights *b, int i,
                       int *max_ff) {
    const int n_embd = w->n_embd, nq = w->n_head * w->head_dim, nkv = w->n_head_kv * w->head_dim;
    PYRT_CHECK(check_vector(&b->attn_norm, n_embd, 0, "attn_norm", i));
    PYRT_CHECK(check_vector(&b->ffn_norm, n_embd, 0, "ffn_norm", i));
    if (w->mla_kv_rank > 0) {
        PYRT_CHECK(pyrt_mla_check_block(w, b, i));
    } else {
        if (b->wq_a.data || b->wq_b.data || b->wkv_a.data || b->wk_b.data || b->wv_b.data)
            return fail_block(i, "multi-head latent attention weights in a model whose "
                              "mla_kv_rank is 0");
        PYRT_CHECK(pyrt_check_model_matrix(&b->wq, nq, n_embd, "attn_q", i));
        PYRT_CHECK(pyrt_check_model_matrix(&b->wk, nkv, n_embd, "attn_k", i));
        PYRT_CHECK(pyrt_check_model_matrix(&b->wv, nkv, n_embd, "attn_v", i));
        PYRT_CHECK(pyrt_check_model_matrix(&b->wo, n_embd, nq, "attn_output", i));
        PYRT_CHECK(check_vector(&b->bq, nq, 1, "attn_q.bias", i));
        PYRT_CHECK(check_vector(&b->bk, nkv, 1, "attn_k.bias", i));
        PYRT_CHECK(check_vector(&b->bv, nkv, 1, "attn_v.bias", i));
        PYRT_CHECK(check_qk_norms(w, b, i));
        PYRT_CHECK(check_vector(&b->bo, n_embd, 1, "attn_output.bias", i));
        PYRT_CHECK(check_vector(&b->sinks, w->n_head, 1, "attn_sinks", i));
    }
    if (b->router.data != NULL) {
        PYRT_CHECK(pyrt_check_model_matrix(&b->router, w->n_expert, n_embd, "ffn_gate_inp", i));
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
        if (b->gud_gates != NULL &&
            ((double)w->n_expert * w->n_ff_exp * (double)rb != (double)b->gud_gates_bytes ||
             pyrt_check_weights_aligned("pyrt_decoder_create: gud_gates", b->gud_gates,
                                        b->gud_fmt) != PYRT_OK))
            return pyrt_fail(PYRT_E_INVALID,
                             "pyrt_decoder_create: blk.%d gud_gates: %zu bytes where [%d, %d, "
                             "%d] needs %.0f, or misaligned", i, b->gud_gates_bytes, w->n_expert,
                             w->n_ff_exp, n_embd, (double)w->n_expert * w->n_ff_exp * (double)rb);
        PYRT_CHECK(check_vector(&b->router_bias, w->n_expert, 1, "ffn_gate_inp.bias", i));
        if ((b->exp_bias_gu.data == NULL) != (b->exp_bias_down.data == NULL))
            return fail_block(i, "exp_bias_gu and exp_bias_down go together (both or none)");
        PYRT_CHECK(check_vector(&b->exp_bias_gu, (int64_t)w->n_expert * w->n_ff_exp * 2, 1,
                           "ffn_gu_exps.bias", i));
        PYRT_CHECK(check_vector(&b->exp_bias_down, (int64_t)w->n_expert * n_embd, 1,
                           "ffn_down_exps.bias", i));
        if (b->sh_gate.data != NULL && w->activation == PYRT_ACT_SWIGLU_OAI)
            return fail_block(i, "a shared expert with the swiglu oai activation is not supported");
        if (b->sh_gate.data != NULL) {
            const int n_ff = b->sh_gate.n_out;
            PYRT_CHECK(pyrt_check_model_matrix(&b->sh_gate, n_ff, n_embd, "ffn_gate_shexp", i));
            PYRT_CHECK(pyrt_check_model_matrix(&b->sh_up, n_ff, n_embd, "ffn_up_shexp", i));
            PYRT_CHECK(pyrt_check_model_matrix(&b->sh_down, n_embd, n_ff, "ffn_down_shexp", i));
            PYRT_CHECK(check_vector(&b->sh_gate_inp, n_embd, 1, "ffn_gate_inp_shexp", i));
            *max_ff = n_ff > *max_ff ? n_ff : *max_ff;
        } else if (b->sh_gate_inp.data != NULL) {
            return fail_block(i, "ffn_gate_inp_shexp without a shared expert");
        }
    } else {
        if (b->router_bias.data != NULL || b->exp_bias_gu.data != NULL)
            return fail_block(i, "router or expert biases in a dense FFN layer");
        if (w->activation == PYRT_ACT_SWIGLU_OAI)
            return fail_block(i, "a dense FFN with the swiglu oai activation is not supported");
        const int n_ff = b->ffn_gate.n_out;
        PYRT_CHECK(pyrt_check_model_matrix(&b->ffn_gate, n_ff, n_embd, "ffn_gate", i));
        PYRT_CHECK(pyrt_check_model_matrix(&b->ffn_up, n_ff, n_embd, "ffn_up", i));
        PYRT_CHECK(pyrt_check_model_matrix(&b->ffn_down, n_embd, n_ff, "ffn_down", i));
        *max_ff = n_ff > *max_ff ? n_ff : *max_ff;
    }
    if (b->window < 0)
        return fail_block(i, "window must be >= 0 (0: full attention)");
    if (b->chunk < 0 || (b->chunk > 0 && b->window > 0))
        return fail_block(i, "chunk must be >= 0 (0: none) and not with a window");
    if (b->nope != 0 && b->nope != 1)
        return fail_block(i, "nope must be 0 or 1");
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
    if (w->mla_kv_rank != 0)
        PYRT_CHECK(pyrt_mla_check_model(w));
    if (!(w->expert_weights_scale >= 0.0f) || isinf(w->expert_weights_scale))
        return pyrt_fail(PYRT_E_INVALID, "%s: expert_weights_scale must be finite and >= 0 (0: 1)",
                         fn);
    if (w->expert_groups != 0 &&
        (w->expert_groups < 2 || w->expert_groups > PYRT_MAX_EXPERT_GROUPS ||
         w->n_expert % w->expert_groups != 0 || w->expert_groups_used < 1 ||
         w->expert_groups_used > w->expert_groups ||
         w->expert_groups_used * (w->n_expert / w->expert_groups) < w->n_expert_used))
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: expert_groups=%d must be 0, or in [2, %d] dividing n_expert=%d with "
                         "expert_groups_used=%d in [1, expert_groups] whose groups hold "
                         "n_expert_used=%d", fn, w->expert_groups, PYRT_MAX_EXPERT_GROUPS,
                         w->n_expert, w->expert_groups_used, w->n_expert_used);
    if (w->rope_dim < 0 || w->rope_dim % 2 || w->rope_dim > w->head_dim)
        return pyrt_fail(PYRT_E_INVALID, "%s: rope_dim=%d must be even and <= head_dim=%d", fn,
                         w->rope_dim, w->head_dim);
    PYRT_CHECK(check_vector(&w->rope_inv_freq, w->rope_dim / 2, w->rope_dim == 0,
                            "rope_inv_freq", -1));
    PYRT_CHECK(pyrt_check_activation(w->activation, w->swiglu_alpha, w->swiglu_limit, fn));
    if (!(w->rope_scale >= 0.0f) || isinf(w->rope_scale))
        return pyrt_fail(PYRT_E_INVALID, "%s: rope_scale must be finite and >= 0 (0: 1)", fn);
    if (w->blocks == NULL || w->n_blocks != w->n_layer)
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: blocks holds %d entries (%s), the model has n_layer=%d", fn,
                         w->n_blocks, w->blocks == NULL ? "NULL" : "set", w->n_layer);
    PYRT_CHECK(check_vector(&w->output_norm, w->n_embd, 0, "output_norm", -1));
    if (!(w->logit_scale != 0.0f) || !(w->rms_eps >= 0.0f) || !(w->clamp_kqv >= 0.0f))
        return pyrt_fail(PYRT_E_INVALID, "%s: logit_scale must be non-zero, rms_eps and clamp_kqv "
                         ">= 0", fn);
    if ((w->qk_l2_norm != 0 && w->qk_l2_norm != 1) || w->temperature_length < 0 ||
        !isfinite(w->temperature_scale) ||
        (w->expert_input_weight != 0 && w->expert_input_weight != 1))
        return pyrt_fail(PYRT_E_INVALID, "%s: qk_l2_norm and expert_input_weight must be 0 or 1, "
                         "temperature_length >= 0 and temperature_scale finite", fn);
    PYRT_CHECK(pyrt_check_model_matrix(&w->token_embd, w->n_vocab, w->n_embd, "token_embd", -1));
    PYRT_CHECK(pyrt_check_model_matrix(&w->output, w->n_vocab, w->n_embd, "output", -1));
    for (int i = 0; i < w->n_layer; i++)
        PYRT_CHECK(check_block(w, &w->blocks[i], i, max_ff));
    return PYRT_OK;
}

int pyrt_decoder_check_call(const pyrt_decoder *d, const pyrt_pool *pool, const void *args,
                            const char *fn) {
    if (d == NULL || pool == NULL || args == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: %s is NULL", fn,
                         d == NULL ? "dec" : pool == NULL ? "pool" : "args");
    return PYRT_OK;
}

int pyrt_decoder_check_experts(const pyrt_decoder *d, const pyrt_expert_args *e, const char *fn) {
    const int n_layer = d->w.n_layer;
    if (e->k < 0 || e->k > d->w.n_expert)
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: k=%d experts per token is outside [1, n_expert=%d] (0: the model's "
                         "%d)", fn, e->k, d->w.n_expert, d->w.n_expert_used);
    const int kept = d->w.expert_groups > 0
                         ? d->w.expert_groups_used * (d->w.n_expert / d->w.expert_groups)
                         : d->w.n_expert;
    if (e->k > kept)
        return pyrt_fail(PYRT_E_INVALID, "%s: k=%d experts per token is more than the %d experts "
                         "of the model's %d best expert groups", fn, e->k, kept,
                         d->w.expert_groups_used);
    if (e->thresholds != NULL && e->n_thresholds != n_layer)
        return pyrt_fail(PYRT_E_INVALID, "%s: thresholds holds %d entries, the model has "
                         "n_layer=%d", fn, e->n_thresholds, n_layer);
    if (e->maps != NULL && (e->n_maps != n_layer || e->map_len != d->w.n_expert))
        return pyrt_fail(PYRT_E_INVALID, "%s: expert maps: %d maps of %d entries, the model needs "
                         "n_layer=%d maps of n_expert=%d", fn, e->n_maps, e->map_len, n_layer,
                         d->w.n_expert);
    return PYRT_OK;
}

int pyrt_decoder_check_cache(const pyrt_decoder *d, const pyrt_kv_cache *c, const char *fn) {
    const pyrt_model_weights *w = &d->w;
    if (c->k == NULL || c->v == NULL || c->n_layer != w->n_layer)
        return pyrt_fail(PYRT_E_INVALID, "%s: kv cache: k and v must hold n_layer=%d layers, got "
                         "%d (%s)", fn, w->n_layer, c->n_layer,
                         c->k == NULL || c->v == NULL ? "NULL" : "set");
    /* one layer's floats, in int64: cap and the heads are ints, their product need not be */
    const int64_t need = (int64_t)w->n_head_kv * w->head_dim * (c->cap > 0 ? c->cap : 0);
    if (c->cap < 1 || c->layer_floats < need)
        return pyrt_fail(PYRT_E_INVALID, "%s: kv cache of %d positions needs %lld floats per layer "
                         "([n_head_kv=%d, cap, head_dim=%d]), holds %lld", fn, c->cap,
                         (long long)need, w->n_head_kv, w->head_dim, (long long)c->layer_floats);
    return PYRT_OK;
}

int pyrt_decoder_check_outputs(const pyrt_decoder *d, const pyrt_expert_args *e,
                               const pyrt_outputs *o, const char *fn) {
    const pyrt_model_weights *w = &d->w;
    const int64_t k = e->k > 0 ? e->k : w->n_expert_used;
    if (o->logits_need > 0 && (o->logits == NULL || o->logits_len < o->logits_need))
        return pyrt_fail(PYRT_E_INVALID, "%s: logits %s; it needs room for %lld floats", fn,
                         o->logits == NULL ? "is NULL" : "is too short", (long long)o->logits_need);
    if (o->route_ids != NULL && o->route_ids_len < (int64_t)w->n_layer * k)
        return pyrt_fail(PYRT_E_INVALID, "%s: route_ids holds %lld entries, [n_layer=%d, k=%lld] "
                         "needs %lld", fn, (long long)o->route_ids_len, w->n_layer, (long long)k,
                         (long long)w->n_layer * k);
    if (o->route_logits != NULL && o->route_logits_len < (int64_t)w->n_layer * w->n_expert)
        return pyrt_fail(PYRT_E_INVALID, "%s: route_logits holds %lld floats, [n_layer=%d, "
                         "n_expert=%d] needs %lld", fn, (long long)o->route_logits_len, w->n_layer,
                         w->n_expert, (long long)w->n_layer * w->n_expert);
    return PYRT_OK;
}

int pyrt_decoder_check_token(const pyrt_decoder *d, int token, const char *fn) {
    if (token < 0 || token >= d->w.n_vocab)
        return pyrt_fail(PYRT_E_INVALID, "%s: token %d is outside [0, n_vocab=%d)", fn, token,
                         d->w.n_vocab);
    return PYRT_OK;
}

int pyrt_decoder_check_layer(const pyrt_decoder *d, int layer, const char *fn) {
    if (layer < 0 || layer >= d->w.n_layer)
        return pyrt_fail(PYRT_E_INVALID, "%s: layer %d is outside [0, n_layer=%d)", fn, layer,
                         d->w.n_layer);
    return PYRT_OK;
}

int pyrt_decoder_check_attention(const pyrt_kv_cache *c, int layer, int pos, int n,
                                 const char *fn) {
    if (pos < 0 || pos > c->cap - n)
        return pyrt_fail(PYRT_E_INVALID, "%s: position%s %d%s%d %s outside the cache [0, %d)", fn,
                         n > 1 ? "s" : "", pos, n > 1 ? ".." : "", n > 1 ? pos + n - 1 : pos,
                         n > 1 ? "are" : "is", c->cap);
    if (c->k[layer] == NULL || c->v[layer] == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: kv cache of layer %d is NULL", fn, layer);
    return PYRT_OK;
}

int pyrt_decoder_check_ffn(const pyrt_decoder *d, const pyrt_expert_args *e, int layer,
                           const char *fn) {
    const float *thr = e->thresholds;
    if (thr != NULL && (!(thr[layer] >= 0.0f) || isinf(thr[layer])))
        return pyrt_fail(PYRT_E_INVALID, "%s: threshold of layer %d must be finite and >= 0", fn,
                         layer);
    const int32_t *map = e->maps != NULL ? e->maps[layer] : NULL;
    if (map == NULL || d->blocks[layer].router.data == NULL)
        return PYRT_OK;
    if ((uintptr_t)map % 4)
        return pyrt_fail(PYRT_E_INVALID, "%s: expert map of layer %d is not 4-byte aligned", fn,
                         layer);
    for (int e_ = 0; e_ < d->w.n_expert; e_++)
        if (map[e_] < -1 || map[e_] >= d->w.n_expert)
            return pyrt_fail(PYRT_E_INVALID,
                             "%s: expert map of layer %d: [%d] = %d is outside [-1, n_expert=%d)",
                             fn, layer, e_, (int)map[e_], d->w.n_expert);
    return PYRT_OK;
}

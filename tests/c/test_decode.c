/* C unit tests of pyrt_linear and the decode step, built with -fsanitize=address,undefined by
 * tests/test_cpu_decode.py (the model math is checked against torch there; here the point is
 * memory safety on every path and the error contract).
 *
 * 1. pyrt_linear, F32 and Q8_0, 1..5 tokens, 1..3 threads, with and without bias, against a
 *    float64 computation on the same numbers (Q8_0: x quantized as the kernel does).
 * 2. A tiny 3-block model touching every block kind (MoE + shared expert + gate + biases +
 *    per-head q/k norm; dense FFN + q/k norm over all heads; plain MoE), partial RoPE, clamp,
 *    decoded for a full cache with 1 and 3 threads: finite logits, same logits for both; the
 *    same with llama4's chunked / NoPE layers and input-weighted experts.
 * 3. Errors: status codes and messages (bad shapes, formats, tokens, positions, NULLs); build
 *    and free pairs (LeakSanitizer checks nothing is lost).
 * Exit status 0 and "all C decode tests passed" on success. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pyrt.h"
#include "rows.h"

#define TEST_RNG_SEED 0x2545F4914F6CDD1Dull
#include "check.h"
#include "tiny_model.h"

/* ---- weights ------------------------------------------------------------------------------- */

static double weight_at(const pyrt_matrix *m, int o, int i) {
    const uint8_t *row = (const uint8_t *)m->data + (size_t)o * pyrt_row_bytes(m->fmt, m->n_in);
    if (m->fmt == PYRT_FMT_F32)
        return ((const float *)row)[i];
    const uint8_t *blk = row + (size_t)(i / PYRT_QK) * PYRT_Q8_0_BYTES;
    return (double)pyrt_fp16_to_fp32(pyrt_load_u16(blk)) * (int8_t)blk[2 + i % PYRT_QK];
}

/* ---- 1. pyrt_linear ------------------------------------------------------------------------ */

static void test_linear(int fmt, int n_tokens, int threads) {
    const int n_out = 37, n_in = fmt == PYRT_FMT_F32 ? 83 : 96;
    pyrt_matrix m = make_matrix(fmt, n_out, n_in, 0.1f);
    float *x = make_vec(n_tokens * n_in, 0.0f, 1.0f), *bias = make_vec(n_out, 0.0f, 1.0f);
    float *y = malloc((size_t)n_tokens * n_out * sizeof *y);
    pyrt_xq8 *xq = malloc((size_t)n_in / PYRT_QK * sizeof *xq + sizeof *xq);
    pyrt_pool *pool = NULL;
    CHECK(pyrt_pool_create(threads, NULL, &pool) == PYRT_OK, "pool: %s", pyrt_last_error());
    for (int with_bias = 0; with_bias < 2; with_bias++) {
        int rc = pyrt_linear(pool, &m, x, n_tokens, with_bias ? bias : NULL, y);
        CHECK(rc == PYRT_OK, "pyrt_linear: %s", pyrt_last_error());
        for (int t = 0; t < n_tokens; t++) {
            const float *xt = x + (size_t)t * n_in;
            if (fmt != PYRT_FMT_F32)
                pyrt_quantize_x_q8(xt, xq, n_in);
            for (int o = 0; o < n_out; o++) {
                double ref = with_bias ? bias[o] : 0.0, mag = fabs(ref);
                for (int i = 0; i < n_in; i++) {
                    const double xi = fmt == PYRT_FMT_F32
                                          ? xt[i]
                                          : (double)xq[i / PYRT_QK].d * xq[i / PYRT_QK].q[i % 32];
                    ref += weight_at(&m, o, i) * xi;
                    mag += fabs(weight_at(&m, o, i) * xi);
                }
                const double err = fabs(y[(size_t)t * n_out + o] - ref);
                CHECK(err <= (n_in + 4) * 0x1.0p-24 * mag + 1e-30,
                      "linear fmt %d t %d o %d: %g vs %g", fmt, t, o, y[(size_t)t * n_out + o],
                      ref);
            }
        }
    }
    pyrt_pool_free(pool);
    free((void *)m.data);
    free(x);
    free(bias);
    free(y);
    free(xq);
}

/* ---- 2. decode step ------------------------------------------------------------------------ */

static const int64_t LAYER_FLOATS = (int64_t)N_KV * CAP * HD;

/* How decode_tiny_opts decodes: the pool, the step's k and maps, step or pieces, and where the
 * routing outputs go. */
typedef struct {
    int threads;
    const pyrt_params *params;   /* NULL: the defaults */
    int k;                       /* 0: the model's */
    int pieces;                  /* begin / attention / ffn / end instead of pyrt_decoder_step */
    const int32_t *const *maps;  /* [N_LAYER] or NULL */
    const float *thresholds;     /* [N_LAYER] or NULL */
    int32_t *route_ids;          /* [CAP, N_LAYER, k] or NULL */
    float *route_logits;         /* [CAP, N_LAYER, N_EXP] or NULL */
    int64_t *n_active, *n_pairs; /* [CAP] or NULL */
} decode_opts;

/* One step as the per-layer calls, in order. */
static int step_in_pieces(pyrt_decoder *dec, pyrt_pool *pool, pyrt_step_args *a) {
    int rc = pyrt_decoder_begin(dec, pool, a);
    for (int l = 0; l < N_LAYER && rc == PYRT_OK; l++) {
        rc = pyrt_decoder_attention(dec, pool, l, a);
        if (rc == PYRT_OK)
            rc = pyrt_decoder_ffn(dec, pool, l, a);
    }
    return rc == PYRT_OK ? pyrt_decoder_end(dec, pool, a) : rc;
}

/* Decodes CAP tokens as `o` says; logits of every step into out [CAP, N_VOCAB]. */
static void decode_tiny_opts(const tiny_model *t, const decode_opts *o, float *out) {
    pyrt_pool *pool = NULL;
    pyrt_decoder *dec = NULL;
    CHECK(pyrt_pool_create(o->threads, o->params, &pool) == PYRT_OK, "pool: %s",
          pyrt_last_error());
    CHECK(pyrt_decoder_create(&t->w, &dec) == PYRT_OK, "create: %s", pyrt_last_error());
    tiny_cache c;
    cache_alloc(&c);
    const int k = o->k > 0 ? o->k : TOP_K;
    for (int pos = 0; pos < CAP && dec != NULL; pos++) {
        pyrt_step_args a = {.token = (pos * 7 + 3) % N_VOCAB, .pos = pos, .cache = kv(&c),
                            .experts = experts_args(o->thresholds, o->k, o->maps),
                            .logits = out + (size_t)pos * N_VOCAB, .logits_len = N_VOCAB};
        if (o->route_ids != NULL) {
            a.route_ids = o->route_ids + (size_t)pos * N_LAYER * k;
            a.route_ids_len = (int64_t)N_LAYER * k;
        }
        if (o->route_logits != NULL) {
            a.route_logits = o->route_logits + (size_t)pos * N_LAYER * N_EXP;
            a.route_logits_len = (int64_t)N_LAYER * N_EXP;
        }
        const int rc = o->pieces ? step_in_pieces(dec, pool, &a) : pyrt_decoder_step(dec, pool, &a);
        CHECK(rc == PYRT_OK, "step %d: %s", pos, pyrt_last_error());
        CHECK(a.n_active >= 0 && a.n_active <= 2 * (int64_t)k * N_FF, "n_active %lld",
              (long long)a.n_active);
        CHECK(a.n_pairs >= 0 && a.n_pairs <= 2 * k, "n_pairs %lld", (long long)a.n_pairs);
        if (o->n_active != NULL)
            o->n_active[pos] = a.n_active;
        if (o->n_pairs != NULL)
            o->n_pairs[pos] = a.n_pairs;
        for (int v = 0; v < N_VOCAB; v++)
            CHECK(isfinite(out[(size_t)pos * N_VOCAB + v]), "logit %d at %d not finite", v, pos);
    }
    int64_t ns[4];
    CHECK(pyrt_decoder_times(dec, ns, 1) == PYRT_OK && ns[3] == CAP, "times: %lld steps",
          (long long)ns[3]);
    cache_free(&c);
    pyrt_decoder_free(dec);
    pyrt_pool_free(pool);
}

/* Decodes CAP tokens with `threads` threads on a pool with `params` (NULL: the defaults), the
 * thresholds THRESHOLDS; logits of every step into out [CAP, N_VOCAB]. */
static void decode_tiny_with(const tiny_model *t, int threads, const pyrt_params *params,
                             float *out) {
    const decode_opts o = {.threads = threads, .params = params, .thresholds = THRESHOLDS};
    decode_tiny_opts(t, &o, out);
}

static void decode_tiny(const tiny_model *t, int threads, float *out) {
    decode_tiny_with(t, threads, NULL, out);
}

/* A switch of pyrt_params, by name and offset. */
typedef struct {
    const char *name;
    size_t offset;
} param_switch;

/* decode_tiny on a pool whose params are the defaults with the switch turned off (a path not
 * taken) */
static void decode_tiny_off(const tiny_model *t, int threads, param_switch sw, float *out) {
    pyrt_params params;
    pyrt_params_default(&params);
    *(int *)((char *)&params + sw.offset) = 0;
    decode_tiny_with(t, threads, &params, out);
}

#define SWITCH(field) ((param_switch){#field, offsetof(pyrt_params, field)})

/* whether two decodes' logits [CAP, N_VOCAB] are the same bits */
static int same_logits(const float *a, const float *b) {
    return memcmp(a, b, sizeof(float) * CAP * N_VOCAB) == 0;
}

static void test_decode(void) {
    tiny_model t;
    build_tiny(&t);
    float *a = malloc(sizeof(float) * CAP * N_VOCAB), *b = malloc(sizeof(float) * CAP * N_VOCAB);
    decode_tiny(&t, 1, a);
    decode_tiny(&t, 3, b);
    double worst = 0.0;
    for (int i = 0; i < CAP * N_VOCAB; i++)
        worst = fmax(worst, fabs((double)a[i] - b[i]));
    /* threads change only the summation order of the expert partial sums */
    CHECK(worst <= 1e-4, "1 vs 3 threads differ by %g", worst);
    /* more threads than some matrices have row pairs (empty matvec homes) */
    float *c = malloc(sizeof(float) * CAP * N_VOCAB);
    decode_tiny(&t, 16, c);
    worst = 0.0;
    for (int i = 0; i < CAP * N_VOCAB; i++)
        worst = fmax(worst, fabs((double)a[i] - c[i]));
    CHECK(worst <= 1e-4, "1 vs 16 threads differ by %g", worst);
    /* which threads join which run never moves a bit: a second 16-thread decode (on a
     * machine with fewer cores many runs go without some workers), workers that sleep at once
     * (spin_us 0: they join late or not at all), the caller never going solo */
    decode_tiny(&t, 16, a);
    CHECK(same_logits(a, c), "two 16-thread decodes differ");
    pyrt_params no_spin;
    pyrt_params_default(&no_spin);
    no_spin.spin_us = 0;
    decode_tiny_with(&t, 3, &no_spin, c);
    CHECK(same_logits(b, c), "spin_us 0 changed the logits");
    decode_tiny_off(&t, 3, SWITCH(adapt_to_load), c);
    CHECK(same_logits(b, c), "adapt_to_load 0 changed the logits");
    decode_tiny(&t, 1, a); /* a: 1 thread again, for the tests below */
    /* prefetching while idle (on by default) moves no bit */
    decode_tiny_off(&t, 3, SWITCH(idle_prefetch), c);
    CHECK(same_logits(b, c), "idle prefetch changed the logits");
    /* the VNNI dots give the AVX-512 BW dots' bits */
    decode_tiny_off(&t, 3, SWITCH(vnni), c);
    CHECK(same_logits(b, c), "vnni changed the logits");
    /* other prefetch distances move no bit */
    pyrt_params far;
    pyrt_params_default(&far);
    far.matvec_prefetch_rows = 7;
    far.expert_prefetch_neurons = 9;
    far.reduce_prefetch_items = 0;
    far.prefetch_l2 = 0; /* L1 (L2 by default) */
    decode_tiny_with(&t, 3, &far, c);
    CHECK(same_logits(b, c), "prefetch distances changed the logits");
    /* q/k/v and attention in one task (blocks 0 and 2: per-head norms, none) or two (serial
     * norms, RoPE, cache append between them): the same operations, the same bits */
    decode_tiny_off(&t, 3, SWITCH(fuse_attention), c);
    CHECK(same_logits(b, c), "fused attention changed the logits");
    decode_tiny(&t, 16, c);
    decode_tiny_off(&t, 16, SWITCH(fuse_attention), a);
    CHECK(same_logits(a, c), "fused attention changed the logits at 16 threads");
    /* router, routing and experts in one task (blocks 0 and 2) or the router's own run and
     * pyrt_moe_ffn: the same bits (c: 16 threads, fused; with fuse_router 0 the blocks are
     * not fused whole either); then the whole block in one task (blocks 0 and 2) or attention
     * and FFN in two. b: 3 threads, everything fused. */
    const param_switch fused_paths[] = {SWITCH(fuse_router), SWITCH(fuse_layer)};
    for (int i = 0; i < COUNT_OF(fused_paths); i++) {
        decode_tiny_off(&t, 16, fused_paths[i], a);
        CHECK(same_logits(a, c), "%s 0 changed the logits at 16 threads", fused_paths[i].name);
        decode_tiny_off(&t, 3, fused_paths[i], a);
        CHECK(same_logits(a, b), "%s 0 changed the logits at 3 threads", fused_paths[i].name);
    }
    free(c);

    /* create refuses a wrong shape and a missing dense FFN, with the tensor in the message */
    pyrt_decoder *dec = NULL;
    t.blocks[2].wq.n_out = N_HEAD * HD + 1;
    CHECK(pyrt_decoder_create(&t.w, &dec) == PYRT_E_INVALID && dec == NULL &&
              strstr(pyrt_last_error(), "blk.2.attn_q") != NULL,
          "wrong wq shape: %s", pyrt_last_error());
    t.blocks[2].wq.n_out = N_HEAD * HD;
    const void *gate = t.blocks[1].ffn_gate.data;
    t.blocks[1].ffn_gate.data = NULL;
    CHECK(pyrt_decoder_create(&t.w, &dec) == PYRT_E_INVALID &&
              strstr(pyrt_last_error(), "blk.1.ffn_gate") != NULL,
          "missing ffn_gate: %s", pyrt_last_error());
    t.blocks[1].ffn_gate.data = gate;
    t.w.rope_dim = 5;
    CHECK(pyrt_decoder_create(&t.w, &dec) == PYRT_E_INVALID, "odd rope_dim accepted");
    t.w.rope_dim = 8;
    CHECK(pyrt_decoder_create(NULL, &dec) == PYRT_E_INVALID, "NULL weights accepted");
    CHECK(pyrt_decoder_create(&t.w, &dec) == PYRT_OK, "create: %s", pyrt_last_error());
    pyrt_decoder_free(dec);
    pyrt_decoder_free(NULL);
    free(a);
    free(b);
    free_tiny(&t);
}

/* llama4's layers on the tiny model: chunks of 3 on blocks 0 and 2 (CAP 7 crosses two chunk
 * boundaries), block 1 NoPE with the query temperature, q/k L2 norm, top-2 sigmoid weights on
 * the experts' inputs: finite logits not the plain model's, the same bits fused or not, in
 * pieces or whole, at 1 and 3 threads to rounding; chunk < 0 or with a window refused. */
static void test_decode_llama4(void) {
    tiny_model t;
    build_tiny(&t);
    float *plain = malloc(sizeof(float) * CAP * N_VOCAB), *a = malloc(sizeof(float) * CAP * N_VOCAB),
          *b = malloc(sizeof(float) * CAP * N_VOCAB), *c = malloc(sizeof(float) * CAP * N_VOCAB);
    decode_tiny(&t, 3, plain);
    t.blocks[0].chunk = t.blocks[2].chunk = 3;
    t.blocks[1].nope = 1;
    t.w.qk_l2_norm = t.w.expert_input_weight = 1;
    t.w.temperature_length = 2;
    t.w.temperature_scale = 0.5f;
    decode_tiny(&t, 1, a);
    decode_tiny(&t, 3, b);
    double worst = 0.0, moved = 0.0;
    for (int i = 0; i < CAP * N_VOCAB; i++) {
        worst = fmax(worst, fabs((double)a[i] - b[i]));
        moved = fmax(moved, fabs((double)plain[i] - b[i]));
    }
    CHECK(worst <= 1e-4, "llama4: 1 vs 3 threads differ by %g", worst);
    CHECK(moved > 1e-2, "llama4's layers changed the logits by only %g", moved);
    const param_switch paths[] = {SWITCH(fuse_attention), SWITCH(fuse_router), SWITCH(fuse_layer)};
    for (int i = 0; i < COUNT_OF(paths); i++) {
        decode_tiny_off(&t, 3, paths[i], c);
        CHECK(same_logits(b, c), "llama4: %s 0 changed the logits", paths[i].name);
    }
    const decode_opts pieces = {.threads = 3, .thresholds = THRESHOLDS, .pieces = 1};
    decode_tiny_opts(&t, &pieces, c);
    CHECK(same_logits(b, c), "llama4: the step in pieces differs");
    pyrt_decoder *dec = NULL;
    t.blocks[0].chunk = -1;
    CHECK(pyrt_decoder_create(&t.w, &dec) == PYRT_E_INVALID &&
              strstr(pyrt_last_error(), "chunk") != NULL,
          "chunk -1: %s", pyrt_last_error());
    t.blocks[0].chunk = 3;
    t.blocks[0].window = 2;
    CHECK(pyrt_decoder_create(&t.w, &dec) == PYRT_E_INVALID, "chunk with a window accepted");
    t.blocks[0].window = 0;
    t.w.expert_input_weight = 2;
    CHECK(pyrt_decoder_create(&t.w, &dec) == PYRT_E_INVALID, "expert_input_weight 2 accepted");
    free(plain);
    free(a);
    free(b);
    free(c);
    free_tiny(&t);
}

/* ---- 3. the seams: per-layer calls, k per step, routing out, expert maps ----------------- */

/* Errors of the step and the per-layer calls: status and message, the decoder usable after. */
static void test_step_errors(const tiny_model *t) {
    pyrt_pool *pool = NULL;
    pyrt_decoder *dec = NULL;
    CHECK(pyrt_pool_create(2, NULL, &pool) == PYRT_OK, "pool");
    CHECK(pyrt_decoder_create(&t->w, &dec) == PYRT_OK, "create: %s", pyrt_last_error());
    tiny_cache c;
    cache_alloc(&c);
    float logits[N_VOCAB];
    const pyrt_step_args good = {.token = 1, .pos = 0, .cache = kv(&c),
                                 .logits = logits, .logits_len = N_VOCAB};
    pyrt_step_args a = good;
    a.token = N_VOCAB;
    CHECK(pyrt_decoder_step(dec, pool, &a) == PYRT_E_INVALID &&
              strstr(pyrt_last_error(), "token 50 is outside") != NULL,
          "bad token: %s", pyrt_last_error());
    CHECK(pyrt_decoder_begin(dec, pool, &a) == PYRT_E_INVALID, "begin: bad token accepted");
    a = good;
    a.pos = CAP;
    CHECK(pyrt_decoder_step(dec, pool, &a) == PYRT_E_INVALID &&
              strstr(pyrt_last_error(), "outside the cache") != NULL,
          "bad position: %s", pyrt_last_error());
    CHECK(pyrt_decoder_attention(dec, pool, 0, &a) == PYRT_E_INVALID, "attention: bad position");
    a = good;
    float *saved = c.kc[1];
    c.kc[1] = NULL;
    CHECK(pyrt_decoder_step(dec, pool, &a) == PYRT_E_INVALID, "NULL cache accepted");
    c.kc[1] = saved;
    const float bad_thr[N_LAYER] = {0.0f, -1.0f, 0.0f};
    a.experts = experts_args(bad_thr, 0, NULL);
    CHECK(pyrt_decoder_step(dec, pool, &a) == PYRT_E_INVALID, "negative threshold accepted");
    CHECK(pyrt_decoder_ffn(dec, pool, 1, &a) == PYRT_E_INVALID, "ffn: negative threshold");
    a = good;
    a.experts.k = N_EXP + 1;
    CHECK(pyrt_decoder_step(dec, pool, &a) == PYRT_E_INVALID &&
              strstr(pyrt_last_error(), "k=5 experts per token is outside [1, n_expert=4]") !=
                  NULL,
          "k 5 of 4: %s", pyrt_last_error());
    a.experts.k = -1;
    CHECK(pyrt_decoder_step(dec, pool, &a) == PYRT_E_INVALID, "k -1 accepted");
    a = good;
    const int32_t bad_map[N_EXP] = {0, 1, 4, -1};
    const int32_t *maps[N_LAYER] = {NULL, NULL, bad_map};
    a.experts = experts_args(NULL, 0, maps);
    CHECK(pyrt_decoder_step(dec, pool, &a) == PYRT_E_INVALID &&
              strstr(pyrt_last_error(), "expert map of layer 2: [2] = 4 is outside") != NULL,
          "map value 4 of 4 experts: %s", pyrt_last_error());
    a = good;
    a.logits = NULL;
    CHECK(pyrt_decoder_step(dec, pool, &a) == PYRT_E_INVALID, "NULL logits accepted");
    CHECK(pyrt_decoder_end(dec, pool, &a) == PYRT_E_INVALID, "end: NULL logits accepted");
    a = good;
    CHECK(pyrt_decoder_attention(dec, pool, N_LAYER, &a) == PYRT_E_INVALID &&
              strstr(pyrt_last_error(), "layer 3 is outside [0, n_layer=3)") != NULL,
          "layer 3: %s", pyrt_last_error());
    CHECK(pyrt_decoder_ffn(dec, pool, -1, &a) == PYRT_E_INVALID, "layer -1 accepted");
    CHECK(pyrt_decoder_step(dec, pool, NULL) == PYRT_E_INVALID, "NULL args accepted");
    CHECK(pyrt_decoder_read_x(dec, NULL) == PYRT_E_INVALID, "read_x NULL accepted");
    CHECK(pyrt_decoder_step(dec, pool, &a) == PYRT_OK, "after the errors: %s", pyrt_last_error());
    cache_free(&c);
    pyrt_decoder_free(dec);
    pyrt_pool_free(pool);
}

/* route_ids / route_logits of CAP steps: each MoE layer's ids are the top k of its logits (in
 * order, distinct), the dense layer's row is -1 / NaN. */
static void check_routing(const int32_t *ids, const float *logits, int k) {
    for (int pos = 0; pos < CAP; pos++)
        for (int l = 0; l < N_LAYER; l++) {
            const int32_t *id = ids + ((size_t)pos * N_LAYER + l) * k;
            const float *lg = logits + ((size_t)pos * N_LAYER + l) * N_EXP;
            if (l == 1) { /* the dense FFN layer */
                for (int j = 0; j < k; j++)
                    CHECK(id[j] == -1, "dense layer id %d", id[j]);
                for (int e = 0; e < N_EXP; e++)
                    CHECK(isnan(lg[e]), "dense layer logit %g", lg[e]);
                continue;
            }
            uint8_t taken[N_EXP] = {0};
            for (int j = 0; j < k; j++) {
                int best = -1;
                for (int e = 0; e < N_EXP; e++)
                    if (!taken[e] && (best < 0 || lg[e] > lg[best]))
                        best = e;
                taken[best] = 1;
                CHECK(id[j] == best, "pos %d layer %d: id %d is %d, the logits' top is %d", pos, l,
                      j, id[j], best);
                CHECK(isfinite(lg[best]), "logit not finite");
            }
        }
}

static void test_seams(const tiny_model *t) {
    const size_t n = (size_t)CAP * N_VOCAB;
    float *step = malloc(sizeof(float) * n), *got = malloc(sizeof(float) * n);
    int32_t ids_step[CAP * N_LAYER * N_EXP], ids_got[CAP * N_LAYER * N_EXP];
    float lg_step[CAP * N_LAYER * N_EXP], lg_got[CAP * N_LAYER * N_EXP];
    int64_t act_step[CAP], act_got[CAP], pairs[CAP];
    /* the step in pieces: the same bits and routing as the (fused) step, 3 and 16 threads */
    for (int threads = 3; threads <= 16; threads += 13) {
        decode_opts o = {.threads = threads, .thresholds = THRESHOLDS, .route_ids = ids_step,
                         .route_logits = lg_step, .n_active = act_step, .n_pairs = pairs};
        decode_tiny_opts(t, &o, step);
        check_routing(ids_step, lg_step, TOP_K);
        for (int pos = 0; pos < CAP; pos++)
            CHECK(pairs[pos] == 2 * TOP_K, "n_pairs %lld", (long long)pairs[pos]);
        o.pieces = 1;
        o.route_ids = ids_got;
        o.route_logits = lg_got;
        o.n_active = act_got;
        decode_tiny_opts(t, &o, got);
        CHECK(same_logits(step, got), "per-layer calls differ from the step at %d threads",
              threads);
        CHECK(memcmp(ids_step, ids_got, sizeof(int32_t) * CAP * N_LAYER * TOP_K) == 0 &&
                  memcmp(act_step, act_got, sizeof act_step) == 0,
              "per-layer routing differs at %d threads", threads);
        for (int i = 0; i < CAP * N_LAYER * N_EXP; i++)
            CHECK(memcmp(&lg_step[i], &lg_got[i], 4) == 0, "per-layer router logit %d", i);
    }
    /* k per step: k = the model's k gives the default's bits; other k route that many experts
     * (the logits move) */
    decode_opts o = {.threads = 3, .thresholds = THRESHOLDS};
    decode_tiny_opts(t, &o, step);
    o.k = TOP_K;
    decode_tiny_opts(t, &o, got);
    CHECK(same_logits(step, got), "k = n_expert_used differs from the default");
    for (int k = 1; k <= N_EXP; k++) {
        o = (decode_opts){.threads = 3, .k = k, .route_ids = ids_got, .route_logits = lg_got,
                          .n_pairs = pairs, .pieces = k % 2};
        decode_tiny_opts(t, &o, got);
        check_routing(ids_got, lg_got, k);
        for (int pos = 0; pos < CAP; pos++)
            CHECK(pairs[pos] == 2 * k, "k %d: n_pairs %lld", k, (long long)pairs[pos]);
        if (k != TOP_K)
            CHECK(!same_logits(step, got), "k %d gave k %d's logits", k, TOP_K);
    }
    /* expert maps: every expert here = no map, bit for bit; none here = no routed neuron */
    const int32_t ident[N_EXP] = {0, 1, 2, 3}, none[N_EXP] = {-1, -1, -1, -1};
    const int32_t *all[N_LAYER] = {ident, ident, ident}, *nothing[N_LAYER] = {none, none, none};
    decode_tiny_opts(t, &(decode_opts){.threads = 3, .thresholds = THRESHOLDS}, step);
    decode_tiny_opts(t, &(decode_opts){.threads = 3, .thresholds = THRESHOLDS, .maps = all},
                     got);
    CHECK(same_logits(step, got), "identity maps changed the logits");
    decode_tiny_opts(t,
                     &(decode_opts){.threads = 3, .maps = nothing, .n_active = act_got,
                                    .n_pairs = pairs, .route_ids = ids_got,
                                    .route_logits = lg_got},
                     got);
    check_routing(ids_got, lg_got, TOP_K); /* every chosen id, computed here or not */
    for (int pos = 0; pos < CAP; pos++)
        CHECK(act_got[pos] == 0 && pairs[pos] == 0, "maps of -1: %lld neurons, %lld pairs",
              (long long)act_got[pos], (long long)pairs[pos]);
    CHECK(!same_logits(step, got), "maps of -1 left the logits as they were");
    free(step);
    free(got);
}

/* The hybrid flow at one layer: x after block 2's attention; its FFN with half the experts (map
 * a), then from the same x with the other half (map b), then with all: the two halves' updates
 * of x sum to the full one (block 2 has no shared expert, which both halves would add). */
static void test_complementary_maps(const tiny_model *t) {
    pyrt_pool *pool = NULL;
    pyrt_decoder *dec = NULL;
    CHECK(pyrt_pool_create(3, NULL, &pool) == PYRT_OK, "pool");
    CHECK(pyrt_decoder_create(&t->w, &dec) == PYRT_OK, "create: %s", pyrt_last_error());
    tiny_cache c;
    cache_alloc(&c);
    float logits[N_VOCAB], x0[N_EMBD], xa[N_EMBD], xb[N_EMBD], xf[N_EMBD];
    const int32_t map_a[N_EXP] = {0, -1, 2, -1}, map_b[N_EXP] = {-1, 1, -1, 3};
    const int32_t *maps_a[N_LAYER] = {NULL, NULL, map_a}, *maps_b[N_LAYER] = {NULL, NULL, map_b};
    for (int pos = 0; pos < 3; pos++) {
        pyrt_step_args a = {.token = 5 + pos, .pos = pos, .cache = kv(&c),
                            .experts = experts_args(THRESHOLDS, 0, NULL), .logits = logits,
                            .logits_len = N_VOCAB};
        int rc = pyrt_decoder_begin(dec, pool, &a);
        for (int l = 0; l < 2 && rc == PYRT_OK; l++) {
            rc = pyrt_decoder_attention(dec, pool, l, &a);
            rc = rc == PYRT_OK ? pyrt_decoder_ffn(dec, pool, l, &a) : rc;
        }
        rc = rc == PYRT_OK ? pyrt_decoder_attention(dec, pool, 2, &a) : rc;
        rc = rc == PYRT_OK ? pyrt_decoder_read_x(dec, x0) : rc;
        const int64_t before = a.n_pairs;
        a.experts.maps = maps_a;
        a.experts.n_maps = N_LAYER;
        a.experts.map_len = N_EXP;
        rc = rc == PYRT_OK ? pyrt_decoder_ffn(dec, pool, 2, &a) : rc;
        rc = rc == PYRT_OK ? pyrt_decoder_read_x(dec, xa) : rc;
        const int64_t pairs_a = a.n_pairs - before;
        rc = rc == PYRT_OK ? pyrt_decoder_write_x(dec, x0) : rc;
        a.experts.maps = maps_b;
        rc = rc == PYRT_OK ? pyrt_decoder_ffn(dec, pool, 2, &a) : rc;
        rc = rc == PYRT_OK ? pyrt_decoder_read_x(dec, xb) : rc;
        const int64_t pairs_b = a.n_pairs - before - pairs_a;
        rc = rc == PYRT_OK ? pyrt_decoder_write_x(dec, x0) : rc;
        a.experts.maps = NULL;
        float route_logits[N_LAYER * N_EXP];
        a.route_logits = route_logits;
        a.route_logits_len = N_LAYER * N_EXP;
        rc = rc == PYRT_OK ? pyrt_decoder_ffn(dec, pool, 2, &a) : rc;
        rc = rc == PYRT_OK ? pyrt_decoder_read_x(dec, xf) : rc;
        /* route_logits: the router's (F32) logits of rms_norm(x0) * ffn_norm, before softmax */
        const pyrt_block_weights *b = &t->blocks[2];
        double ss = 0.0;
        for (int i = 0; i < N_EMBD; i++)
            ss += (double)x0[i] * x0[i];
        const double r = 1.0 / sqrt(ss / N_EMBD + 1e-6);
        for (int e = 0; e < N_EXP; e++) {
            const float *row = (const float *)b->router.data + (size_t)e * N_EMBD;
            double z = 0.0, zabs = 0.0;
            for (int i = 0; i < N_EMBD; i++) {
                z += row[i] * (x0[i] * r * b->ffn_norm.data[i]);
                zabs += fabs(row[i] * (x0[i] * r * b->ffn_norm.data[i]));
            }
            CHECK(fabs(route_logits[2 * N_EXP + e] - z) <= 1e-5 * zabs + 1e-7,
                  "pos %d: router logit %d is %g, want %g", pos, e, route_logits[2 * N_EXP + e],
                  z);
        }
        rc = rc == PYRT_OK ? pyrt_decoder_end(dec, pool, &a) : rc;
        CHECK(rc == PYRT_OK, "pos %d: %s", pos, pyrt_last_error());
        CHECK(pairs_a + pairs_b == TOP_K, "pairs %lld + %lld", (long long)pairs_a,
              (long long)pairs_b);
        double worst = 0.0;
        for (int i = 0; i < N_EMBD; i++) {
            const double da = (double)xa[i] - x0[i], db = (double)xb[i] - x0[i];
            const double df = (double)xf[i] - x0[i];
            /* f32: each x = x0 + y * residual_scale rounded, y's sums in another order */
            const double tol = 1e-5 * (fabs(x0[i]) + fabs(da) + fabs(db)) + 1e-7;
            worst = fmax(worst, fabs(da + db - df) / tol);
        }
        CHECK(worst <= 1.0, "pos %d: the halves' updates miss the full one (ratio %g)", pos,
              worst);
    }
    cache_free(&c);
    pyrt_decoder_free(dec);
    pyrt_pool_free(pool);
}

/* ---- 4. pyrt_linear errors ----------------------------------------------------------------- */

static void test_linear_errors(void) {
    pyrt_matrix m = make_matrix(PYRT_FMT_Q8_0, 8, 64, 0.1f);
    float x[64] = {0}, y[8];
    pyrt_pool *pool = NULL;
    CHECK(pyrt_pool_create(2, NULL, &pool) == PYRT_OK, "pool");
    CHECK(pyrt_linear(NULL, &m, x, 1, NULL, y) == PYRT_E_INVALID, "NULL pool accepted");
    CHECK(pyrt_linear(pool, NULL, x, 1, NULL, y) == PYRT_E_INVALID, "NULL matrix accepted");
    CHECK(pyrt_linear(pool, &m, NULL, 1, NULL, y) == PYRT_E_INVALID, "NULL x accepted");
    CHECK(pyrt_linear(pool, &m, x, -1, NULL, y) == PYRT_E_INVALID, "negative n_tokens accepted");
    pyrt_matrix bad = m;
    bad.bytes -= 1;
    CHECK(pyrt_linear(pool, &bad, x, 1, NULL, y) == PYRT_E_INVALID &&
              strstr(pyrt_last_error(), "wrong shape") != NULL,
          "wrong bytes: %s", pyrt_last_error());
    bad = m;
    bad.fmt = 7;
    CHECK(pyrt_linear(pool, &bad, x, 1, NULL, y) == PYRT_E_INVALID, "format 7 accepted");
    bad = m;
    bad.n_in = 40;
    CHECK(pyrt_linear(pool, &bad, x, 1, NULL, y) == PYRT_E_INVALID, "n_in 40 Q8_0 accepted");
    CHECK(pyrt_linear(pool, &m, x, 0, NULL, y) == PYRT_OK, "zero tokens refused");
    pyrt_pool_free(pool);
    free((void *)m.data);
}

/* Expert weights in F32 at a pointer that is not 4-byte aligned: refused at decoder creation
 * (the fused router's path does not check its arguments again). */
static void test_unaligned_experts(void) {
    tiny_model t;
    build_tiny(&t);
    const size_t bytes = (size_t)N_EXP * N_FF * 3 * N_EMBD * sizeof(float);
    uint8_t *raw = calloc(bytes + 4, 1);
    pyrt_block_weights *b = &t.blocks[2];
    b->gud = raw + 1;
    b->gud_bytes = bytes;
    b->gud_fmt = PYRT_FMT_F32;
    pyrt_decoder *dec = NULL;
    CHECK(pyrt_decoder_create(&t.w, &dec) == PYRT_E_INVALID &&
              strstr(pyrt_last_error(), "not 4-byte aligned") != NULL,
          "unaligned F32 experts: %s", pyrt_last_error());
    pyrt_decoder_free(dec);
    b->gud = raw; /* aligned: accepted */
    CHECK(pyrt_decoder_create(&t.w, &dec) == PYRT_OK, "aligned F32 experts: %s",
          pyrt_last_error());
    pyrt_decoder_free(dec);
    free(raw);
    free_tiny(&t);
}

/* ---- 5. every length the decoder reads ---------------------------------------------------
 * Each case hands the decoder a buffer that is exactly as long as the length it declares, and
 * shorter than the model needs: the check must refuse it, naming it. Without the check the call
 * goes on and reads (or writes) past the buffer, which ASan reports (a step runs when a create
 * is wrongly accepted, so the overflow happens inside this program). */

/* One decode step on dec (3 threads), arguments `a` (NULL: a plain step on a fresh cache). */
static int one_step(pyrt_decoder *dec, pyrt_step_args *a) {
    pyrt_pool *pool = NULL;
    CHECK(pyrt_pool_create(3, NULL, &pool) == PYRT_OK, "pool");
    tiny_cache c;
    cache_alloc(&c);
    float logits[N_VOCAB];
    pyrt_step_args plain = {.token = 3, .pos = 0, .cache = kv(&c), .logits = logits,
                            .logits_len = N_VOCAB};
    const int rc = pyrt_decoder_step(dec, pool, a != NULL ? a : &plain);
    cache_free(&c);
    pyrt_pool_free(pool);
    return rc;
}

/* pyrt_decoder_create(w) must fail with `name` in the message; a decoder it wrongly made runs a
 * step (the overflow ASan reports). */
static void expect_create_refused(const pyrt_model_weights *w, const char *name) {
    pyrt_decoder *dec = NULL;
    const int rc = pyrt_decoder_create(w, &dec);
    CHECK(rc == PYRT_E_INVALID && dec == NULL && strstr(pyrt_last_error(), name) != NULL,
          "%s: create gave %d: %s", name, rc, pyrt_last_error());
    if (dec != NULL) {
        one_step(dec, NULL);
        pyrt_decoder_free(dec);
    }
}

/* A vector field of the tiny model replaced by a buffer of n elements declared as n. */
static void short_vector(tiny_model *t, pyrt_vector *field, int n, const char *name) {
    const pyrt_vector saved = *field;
    float *buf = make_vec(n, 1.0f, 0.1f);
    *field = vec(buf, n);
    expect_create_refused(&t->w, name);
    *field = saved;
    free(buf);
}

static void test_weight_lengths(void) {
    tiny_model t;
    build_tiny(&t);
    const int nq = N_HEAD * HD;
    short_vector(&t, &t.blocks[2].attn_norm, 1, "blk.2.attn_norm has 1 elements");
    short_vector(&t, &t.blocks[1].ffn_norm, N_EMBD - 1, "blk.1.ffn_norm");
    short_vector(&t, &t.w.output_norm, 1, "output_norm has 1 elements, the model needs 64");
    short_vector(&t, &t.blocks[0].bq, nq - 1, "blk.0.attn_q.bias");
    short_vector(&t, &t.blocks[0].bk, 1, "blk.0.attn_k.bias");
    short_vector(&t, &t.blocks[0].bv, 1, "blk.0.attn_v.bias");
    short_vector(&t, &t.blocks[0].q_norm, HD - 1, "blk.0.attn_q_norm");     /* per head */
    short_vector(&t, &t.blocks[1].k_norm, N_KV * HD - 1, "blk.1.attn_k_norm"); /* all heads */
    short_vector(&t, &t.blocks[0].sh_gate_inp, 1, "blk.0.ffn_gate_inp_shexp");
    short_vector(&t, &t.w.rope_inv_freq, 3, "rope_inv_freq has 3 elements, the model needs 4");
    /* gpt-oss's vectors */
    short_vector(&t, &t.blocks[1].bo, N_EMBD - 1, "blk.1.attn_output.bias");
    short_vector(&t, &t.blocks[2].sinks, N_HEAD - 1, "blk.2.attn_sinks");
    short_vector(&t, &t.blocks[0].router_bias, N_EXP - 1, "blk.0.ffn_gate_inp.bias");
    float *down = make_vec(N_EXP * N_EMBD, 0.0f, 0.1f), *gu = make_vec(N_EXP * N_FF * 2, 0.f, .1f);
    t.blocks[2].exp_bias_down = vec(down, N_EXP * N_EMBD);
    short_vector(&t, &t.blocks[2].exp_bias_gu, N_EXP * N_FF * 2 - 1, "blk.2.ffn_gu_exps.bias");
    t.blocks[2].exp_bias_gu = vec(gu, N_EXP * N_FF * 2);
    short_vector(&t, &t.blocks[2].exp_bias_down, N_EXP * N_EMBD - 1, "blk.2.ffn_down_exps.bias");
    t.blocks[2].exp_bias_gu = t.blocks[2].exp_bias_down = (pyrt_vector){0};
    free(down);
    free(gu);
    /* a norm's pointer without its length is refused too (a length of 0 would read nothing) */
    const pyrt_vector saved = t.blocks[0].attn_norm;
    t.blocks[0].attn_norm.n = 0;
    expect_create_refused(&t.w, "blk.0.attn_norm has 0 elements");
    t.blocks[0].attn_norm.n = N_EMBD; /* and a length without its pointer */
    t.blocks[0].attn_norm.data = NULL;
    expect_create_refused(&t.w, "blk.0.attn_norm is NULL");
    t.blocks[0].attn_norm = saved;
    /* the blocks array: as long as it says, shorter than n_layer */
    pyrt_block_weights *two = malloc(2 * sizeof *two);
    memcpy(two, t.blocks, 2 * sizeof *two);
    t.w.blocks = two;
    t.w.n_blocks = 2;
    expect_create_refused(&t.w, "blocks holds 2 entries");
    t.w.blocks = t.blocks;
    t.w.n_blocks = N_LAYER;
    free(two);
    pyrt_decoder *dec = NULL;
    CHECK(pyrt_decoder_create(&t.w, &dec) == PYRT_OK, "restored: %s", pyrt_last_error());
    pyrt_decoder_free(dec);
    free_tiny(&t);
}

/* A step with argument `a`, which holds a buffer declared as long as it is and too short:
 * refused with `name` in the message (else the step writes or reads past it). */
static void expect_step_refused(pyrt_decoder *dec, pyrt_step_args *a, const char *name) {
    const int rc = one_step(dec, a);
    CHECK(rc == PYRT_E_INVALID && strstr(pyrt_last_error(), name) != NULL, "%s: step gave %d: %s",
          name, rc, pyrt_last_error());
}

static void test_call_lengths(void) {
    tiny_model t;
    build_tiny(&t);
    pyrt_decoder *dec = NULL;
    CHECK(pyrt_decoder_create(&t.w, &dec) == PYRT_OK, "create: %s", pyrt_last_error());
    /* the KV cache: each layer one position short of the capacity it declares */
    const int64_t short_floats = LAYER_FLOATS - HD;
    float *kc[N_LAYER], *vc[N_LAYER];
    for (int l = 0; l < N_LAYER; l++) {
        kc[l] = calloc((size_t)short_floats, sizeof(float));
        vc[l] = calloc((size_t)short_floats, sizeof(float));
    }
    float logits[N_VOCAB];
    pyrt_step_args a = {.token = 3, .pos = CAP - 1, .logits = logits, .logits_len = N_VOCAB,
                        .cache = {.k = kc, .v = vc, .n_layer = N_LAYER, .cap = CAP,
                                  .layer_floats = short_floats}};
    expect_step_refused(dec, &a, "needs 224 floats per layer");
    a.cache.n_layer = N_LAYER - 1; /* k and v arrays of fewer layers than the model */
    a.cache.layer_floats = LAYER_FLOATS;
    expect_step_refused(dec, &a, "must hold n_layer=3 layers, got 2");
    for (int l = 0; l < N_LAYER; l++) {
        free(kc[l]);
        free(vc[l]);
    }
    tiny_cache c;
    cache_alloc(&c);
    const pyrt_step_args good = {.token = 3, .pos = 0, .cache = kv(&c), .logits = logits,
                                 .logits_len = N_VOCAB};
    /* per-layer inputs shorter than n_layer */
    float *thr = calloc(N_LAYER - 1, sizeof(float));
    a = good;
    a.experts = (pyrt_expert_args){.thresholds = thr, .n_thresholds = N_LAYER - 1};
    expect_step_refused(dec, &a, "thresholds holds 2 entries");
    free(thr);
    const int32_t **maps = malloc((N_LAYER - 1) * sizeof *maps);
    int32_t *short_map = malloc((N_EXP - 1) * sizeof *short_map);
    for (int e = 0; e < N_EXP - 1; e++)
        short_map[e] = e;
    for (int l = 0; l < N_LAYER - 1; l++)
        maps[l] = NULL;
    a = good;
    a.experts = (pyrt_expert_args){.maps = maps, .n_maps = N_LAYER - 1, .map_len = N_EXP};
    expect_step_refused(dec, &a, "2 maps of 4 entries");
    free(maps);
    const int32_t *full[N_LAYER] = {short_map, NULL, short_map};
    a.experts = (pyrt_expert_args){.maps = full, .n_maps = N_LAYER, .map_len = N_EXP - 1};
    expect_step_refused(dec, &a, "3 maps of 3 entries");
    free(short_map);
    /* outputs shorter than the model's */
    float *short_logits = malloc((N_VOCAB - 1) * sizeof(float));
    a = good;
    a.logits = short_logits;
    a.logits_len = N_VOCAB - 1;
    expect_step_refused(dec, &a, "logits is too short");
    free(short_logits);
    int32_t *ids = malloc(((size_t)N_LAYER * TOP_K - 1) * sizeof *ids);
    a = good;
    a.route_ids = ids;
    a.route_ids_len = N_LAYER * TOP_K - 1;
    expect_step_refused(dec, &a, "route_ids holds 5 entries");
    free(ids);
    float *rl = malloc(((size_t)N_LAYER * N_EXP - 1) * sizeof *rl);
    a = good;
    a.route_logits = rl;
    a.route_logits_len = N_LAYER * N_EXP - 1;
    expect_step_refused(dec, &a, "route_logits holds 11 floats");
    free(rl);
    a = good;
    CHECK(one_step(dec, &a) == PYRT_OK, "after the refusals: %s", pyrt_last_error());
    cache_free(&c);
    pyrt_decoder_free(dec);
    free_tiny(&t);
}

int main(void) {
    for (int fmt = 0; fmt < 2; fmt++)
        for (int threads = 1; threads <= 3; threads += 2)
            for (int n_tokens = 1; n_tokens <= 5; n_tokens += 4)
                test_linear(fmt ? PYRT_FMT_Q8_0 : PYRT_FMT_F32, n_tokens, threads);
    test_decode();
    test_decode_llama4();
    tiny_model t;
    build_tiny(&t);
    test_step_errors(&t);
    test_seams(&t);
    test_complementary_maps(&t);
    free_tiny(&t);
    test_linear_errors();
    test_unaligned_experts();
    test_weight_lengths();
    test_call_lengths();
    if (failures) {
        printf("%d C decode test(s) failed\n", failures);
        return 1;
    }
    printf("all C decode tests passed\n");
    return 0;
}

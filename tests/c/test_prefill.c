/* C unit tests of the prefill (pyrt_decoder_prefill), built with -fsanitize=address,undefined by
 * tests/test_cpu_prefill.py (the model math against token-by-token decoding of real models is
 * checked there; here: memory safety on every path, the invariants, the error contract).
 *
 * On the tiny model of tiny_model.h (every block kind, Q8_0 and F32 weights):
 * 1. A prefill of n tokens (1, 7, 33) gives the logits and KV cache of n steps, to f32 rounding
 *    (the routed experts' sums run in another order), dense and sparse; from an empty cache and
 *    after steps (pos > 0).
 * 2. Its bits do not depend on the chunk size (ubatch 1, 3, 16, the default), the threads
 *    (1, 3, 16), whether sparse passes read gate and up rows together (params.prefill_union_pct
 *    0, 101) or whether every token's logits are asked for (the last row is the last-token
 *    call's); the routing of the last token and the counts (pairs, neurons) agree with the step.
 * 3. Expert maps: identity maps are the plain prefill bit for bit; a map that sends a layer's
 *    experts elsewhere computes none of its pairs there.
 * 4. Errors: each bad argument refused with its name, nothing written, the decoder usable after.
 * 5. gpt-oss's pieces (sinks, sliding window, YaRN's factor, o / router / expert biases): 1-2 again.
 * Exit status 0 and "all C prefill tests passed" on success. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn_tile.h"
#include "pyrt.h"

#define TEST_RNG_SEED 0x9E3779B97F4A7C15ull
#include "check.h"
#include "tiny_model.h"

enum { P_CAP = 40, MAX_N = 33 };

static const float SPARSE[N_LAYER] = {0.02f, 0.0f, 0.05f};

static int token_at(int i) {
    return (i * 11 + 5) % N_VOCAB;
}

/* How a run goes: a pool of `threads`, the first `n_steps` tokens as steps, the next `n_pre` as
 * one prefill of chunks of `ubatch`. */
typedef struct {
    int threads, n_steps, n_pre, ubatch, all_logits;
    const float *thresholds;
    const int32_t *const *maps;
    const pyrt_params *params; /* NULL: the defaults */
} run_opts;

/* What a run gives: the logits of every token ([n_steps + n_pre, N_VOCAB]; with all_logits 0
 * only the last row is the prefill's), the prefill's counts and last-token routing, the cache. */
typedef struct {
    float logits[(size_t)(P_CAP)*N_VOCAB];
    int64_t n_active, n_pairs;
    int32_t route_ids[N_LAYER * TOP_K];
    float route_logits[N_LAYER * N_EXP];
    tiny_cache cache;
} run_out;

static void run(const tiny_model *t, const run_opts *o, run_out *out) {
    pyrt_pool *pool = NULL;
    pyrt_decoder *dec = NULL;
    CHECK(pyrt_pool_create(o->threads, o->params, &pool) == PYRT_OK, "pool: %s",
          pyrt_last_error());
    CHECK(pyrt_decoder_create(&t->w, &dec) == PYRT_OK, "create: %s", pyrt_last_error());
    memset(out->logits, 0, sizeof out->logits);
    cache_alloc_cap(&out->cache, P_CAP);
    for (int pos = 0; pos < o->n_steps; pos++) {
        pyrt_step_args a = {.token = token_at(pos), .pos = pos, .cache = kv(&out->cache),
                            .experts = experts_args(o->thresholds, 0, o->maps),
                            .logits = out->logits + (size_t)pos * N_VOCAB,
                            .logits_len = N_VOCAB,
                            .route_ids = out->route_ids, .route_ids_len = N_LAYER * TOP_K,
                            .route_logits = out->route_logits,
                            .route_logits_len = N_LAYER * N_EXP};
        CHECK(pyrt_decoder_step(dec, pool, &a) == PYRT_OK, "step %d: %s", pos, pyrt_last_error());
        out->n_active = a.n_active;
        out->n_pairs = a.n_pairs;
    }
    if (o->n_pre > 0) {
        int32_t tokens[P_CAP];
        for (int i = 0; i < o->n_pre; i++)
            tokens[i] = token_at(o->n_steps + i);
        const int n_rows = o->all_logits ? o->n_pre : 1;
        pyrt_prefill_args a = {
            .tokens = tokens, .n_tokens = o->n_pre, .pos = o->n_steps, .ubatch = o->ubatch,
            .cache = kv(&out->cache), .experts = experts_args(o->thresholds, 0, o->maps),
            .all_logits = o->all_logits,
            .logits = out->logits + (size_t)(o->n_steps + o->n_pre - n_rows) * N_VOCAB,
            .logits_len = (int64_t)n_rows * N_VOCAB, .route_ids = out->route_ids,
            .route_ids_len = N_LAYER * TOP_K, .route_logits = out->route_logits,
            .route_logits_len = N_LAYER * N_EXP};
        CHECK(pyrt_decoder_prefill(dec, pool, &a) == PYRT_OK, "prefill: %s", pyrt_last_error());
        out->n_active = a.n_active;
        out->n_pairs = a.n_pairs;
    }
    pyrt_decoder_free(dec);
    pyrt_pool_free(pool);
}

static float max_diff(const float *a, const float *b, size_t n) {
    float worst = 0.0f;
    for (size_t i = 0; i < n; i++)
        worst = fmaxf(worst, fabsf(a[i] - b[i]));
    return worst;
}

/* The caches' positions [0, n) of every layer, keys and values. */
static float cache_diff(const tiny_cache *a, const tiny_cache *b, int n) {
    float worst = 0.0f;
    for (int l = 0; l < N_LAYER; l++)
        for (int h = 0; h < N_KV; h++) {
            const size_t at = (size_t)h * P_CAP * HD, len = (size_t)n * HD;
            worst = fmaxf(worst, max_diff(a->kc[l] + at, b->kc[l] + at, len));
            worst = fmaxf(worst, max_diff(a->vc[l] + at, b->vc[l] + at, len));
        }
    return worst;
}

static int same_bits(const run_out *a, const run_out *b, int n) {
    return memcmp(a->logits, b->logits, sizeof(float) * (size_t)n * N_VOCAB) == 0 &&
           cache_diff(&a->cache, &b->cache, n) == 0.0f && a->n_active == b->n_active &&
           a->n_pairs == b->n_pairs;
}

/* 1 and 2: against steps, and across chunk sizes, threads and logits asked for. */
static void test_prefill_is_the_steps(const tiny_model *t) {
    run_out *steps = malloc(sizeof *steps), *pre = malloc(sizeof *pre);
    run_out *other = malloc(sizeof *other);
    const int lengths[] = {1, 7, MAX_N};
    for (int sparse = 0; sparse < 2; sparse++)
        for (int li = 0; li < COUNT_OF(lengths); li++)
            for (int first = 0; first <= 5; first += 5) { /* from an empty cache, after 5 steps */
                const int n = lengths[li];
                const float *thr = sparse ? SPARSE : NULL;
                /* the steps on one thread (their expert sums in one order; with 3, token 30's
                 * last routing is a near tie that f32 rounding flips) */
                const run_opts by_step = {.threads = 1, .n_steps = first + n, .thresholds = thr};
                run(t, &by_step, steps);
                const run_opts o = {.threads = 3, .n_steps = first, .n_pre = n, .ubatch = 4,
                                    .all_logits = 1, .thresholds = thr};
                run(t, &o, pre);
                /* f32 rounding through 3 blocks: ~1e-6 of logits of magnitude ~1 */
                const float d = max_diff(steps->logits, pre->logits, (size_t)(first + n) * N_VOCAB);
                CHECK(d <= 1e-4f, "sparse %d n %d after %d: prefill vs steps differ by %g", sparse,
                      n, first, d);
                const float dc = cache_diff(&steps->cache, &pre->cache, first + n);
                CHECK(dc <= 1e-4f, "sparse %d n %d: caches differ by %g", sparse, n, dc);
                for (int j = 0; j < N_LAYER * TOP_K; j++)
                    CHECK(pre->route_ids[j] == steps->route_ids[j], "route id %d: %d vs %d", j,
                          pre->route_ids[j], steps->route_ids[j]);
                for (int j = 0; j < N_LAYER * N_EXP; j++)
                    CHECK(isnan(steps->route_logits[j])
                              ? isnan(pre->route_logits[j])
                              : fabsf(pre->route_logits[j] - steps->route_logits[j]) <= 1e-4f,
                          "route logit %d: %g vs %g", j, pre->route_logits[j],
                          steps->route_logits[j]);
                CHECK(pre->n_pairs == (int64_t)n * 2 * TOP_K, "n %d: %lld pairs", n,
                      (long long)pre->n_pairs);
                if (!sparse)
                    CHECK(pre->n_active == pre->n_pairs * N_FF, "dense: %lld neurons",
                          (long long)pre->n_active);
                else
                    CHECK(pre->n_active > 0 && pre->n_active < pre->n_pairs * N_FF,
                          "sparse: %lld neurons of %lld", (long long)pre->n_active,
                          (long long)(pre->n_pairs * N_FF));
                cache_free(&steps->cache);
                /* the same bits whatever the chunks, threads (from an empty cache: the steps'
                 * expert sums depend on the threads), logits asked for */
                const int ubatches[] = {1, 3, 16, 0};
                const int threads[] = {1, 16};
                for (int u = 0; u < COUNT_OF(ubatches); u++)
                    for (int th = 0; th < (first == 0 ? COUNT_OF(threads) : 1); th++) {
                        run_opts p = o;
                        p.ubatch = ubatches[u];
                        p.threads = first == 0 ? threads[th] : o.threads;
                        run(t, &p, other);
                        CHECK(same_bits(pre, other, first + n),
                              "sparse %d n %d after %d: ubatch %d, %d threads moved bits", sparse,
                              n, first, p.ubatch, p.threads);
                        cache_free(&other->cache);
                    }
                /* the routed experts' gate and up rows together or apart (sparse) */
                for (int pct = 0; pct <= 101; pct += 101) {
                    pyrt_params params;
                    pyrt_params_default(&params);
                    params.prefill_union_pct = pct;
                    run_opts p = o;
                    p.params = &params;
                    run(t, &p, other);
                    CHECK(same_bits(pre, other, first + n),
                          "sparse %d n %d after %d: prefill_union_pct %d moved bits", sparse, n,
                          first, pct);
                    cache_free(&other->cache);
                }
                run_opts last = o;
                last.all_logits = 0;
                run(t, &last, other);
                const size_t row = (size_t)(first + n - 1) * N_VOCAB;
                CHECK(memcmp(pre->logits + row, other->logits + row, sizeof(float) * N_VOCAB) == 0,
                      "n %d: the last token's logits differ from every token's last row", n);
                cache_free(&other->cache);
                cache_free(&pre->cache);
            }
    free(steps);
    free(pre);
    free(other);
}

/* 3: expert maps. */
static void test_prefill_maps(const tiny_model *t) {
    run_out *a = malloc(sizeof *a), *b = malloc(sizeof *b);
    const int32_t ident[N_EXP] = {0, 1, 2, 3}, none[N_EXP] = {-1, -1, -1, -1};
    const int32_t *identity[N_LAYER] = {ident, NULL, ident};
    const int32_t *elsewhere[N_LAYER] = {NULL, NULL, none};
    const run_opts plain = {.threads = 3, .n_pre = 9, .ubatch = 4, .all_logits = 1,
                            .thresholds = SPARSE};
    run(t, &plain, a);
    run_opts o = plain;
    o.maps = identity;
    run(t, &o, b);
    CHECK(same_bits(a, b, 9), "identity maps moved bits");
    cache_free(&b->cache);
    o.maps = elsewhere;
    run(t, &o, b);
    CHECK(b->n_pairs == 9 * TOP_K, "layer 2 elsewhere: %lld pairs here", (long long)b->n_pairs);
    CHECK(max_diff(a->logits, b->logits, (size_t)9 * N_VOCAB) > 1e-3f,
          "layer 2's experts elsewhere changed nothing");
    cache_free(&a->cache);
    cache_free(&b->cache);
    free(a);
    free(b);
}

/* 4: errors. */
static void expect_refused(pyrt_decoder *dec, pyrt_pool *pool, pyrt_prefill_args *a,
                           const char *name) {
    const int rc = pyrt_decoder_prefill(dec, pool, a);
    CHECK(rc == PYRT_E_INVALID && strstr(pyrt_last_error(), name) != NULL,
          "%s: prefill gave %d: %s", name, rc, pyrt_last_error());
}

static void test_prefill_errors(const tiny_model *t) {
    pyrt_pool *pool = NULL;
    pyrt_decoder *dec = NULL;
    CHECK(pyrt_pool_create(2, NULL, &pool) == PYRT_OK, "pool");
    CHECK(pyrt_decoder_create(&t->w, &dec) == PYRT_OK, "create: %s", pyrt_last_error());
    tiny_cache c;
    cache_alloc_cap(&c, 8);
    int32_t tokens[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    float *logits = malloc(sizeof(float) * 9 * N_VOCAB);
    const pyrt_prefill_args good = {.tokens = tokens, .n_tokens = 5, .pos = 0, .cache = kv(&c),
                                    .logits = logits, .logits_len = N_VOCAB};
    pyrt_prefill_args a = good;
    a.tokens = NULL;
    expect_refused(dec, pool, &a, "tokens is NULL");
    a = good;
    a.n_tokens = 0;
    expect_refused(dec, pool, &a, "n_tokens must be >= 1");
    a = good;
    a.ubatch = -1;
    expect_refused(dec, pool, &a, "ubatch=-1 must be >= 0");
    a = good;
    a.all_logits = 2;
    expect_refused(dec, pool, &a, "all_logits=2");
    a = good;
    tokens[3] = N_VOCAB;
    expect_refused(dec, pool, &a, "token 50 is outside");
    tokens[3] = 4;
    a = good;
    a.pos = 4; /* [4, 9) in a cache of 8 */
    expect_refused(dec, pool, &a, "outside the cache");
    a = good;
    a.n_tokens = 9;
    expect_refused(dec, pool, &a, "outside the cache");
    a = good;
    a.all_logits = 1; /* 5 rows asked for, room for 1 */
    expect_refused(dec, pool, &a, "logits is too short");
    a = good;
    a.logits = NULL;
    expect_refused(dec, pool, &a, "logits");
    int32_t ids[N_LAYER * TOP_K];
    a = good;
    a.route_ids = ids;
    a.route_ids_len = N_LAYER * TOP_K - 1;
    expect_refused(dec, pool, &a, "route_ids holds 5 entries");
    const float bad_thr[N_LAYER] = {0.0f, -1.0f, 0.0f};
    a = good;
    a.experts = experts_args(bad_thr, 0, NULL);
    expect_refused(dec, pool, &a, "threshold");
    a = good;
    a.experts.k = N_EXP + 1;
    expect_refused(dec, pool, &a, "k=5 experts per token is outside");
    CHECK(pyrt_decoder_prefill(dec, pool, NULL) == PYRT_E_INVALID, "NULL args accepted");
    CHECK(pyrt_decoder_prefill(NULL, pool, &a) == PYRT_E_INVALID, "NULL decoder accepted");
    a = good;
    a.all_logits = 1;
    a.logits_len = 5 * N_VOCAB;
    a.ubatch = 2;
    CHECK(pyrt_decoder_prefill(dec, pool, &a) == PYRT_OK, "after the refusals: %s",
          pyrt_last_error());
    /* a later chunk size larger than the first: the buffers grow */
    a = good;
    a.pos = 5;
    a.n_tokens = 3;
    a.ubatch = 0;
    CHECK(pyrt_decoder_prefill(dec, pool, &a) == PYRT_OK, "larger chunk: %s", pyrt_last_error());
    free(logits);
    cache_free(&c);
    pyrt_decoder_free(dec);
    pyrt_pool_free(pool);
}

/* 5. gpt-oss's pieces: attention sinks, a sliding window, YaRN's cos/sin factor, o, router and
 * expert biases, each on a block of the tiny model, then all of 1-2 again (the clamped SwiGLU
 * needs MoE-only FFNs: tests/test_cpu_prefill.py's gpt-oss model has it). */
static void test_prefill_gpt_oss_pieces(tiny_model *t) {
    float *sinks = make_vec(N_HEAD, 0.0f, 1.0f), *bo = make_vec(N_EMBD, 0.0f, 0.3f);
    float *rb = make_vec(N_EXP, 0.0f, 0.5f), *bgu = make_vec(N_EXP * N_FF * 2, 0.0f, 0.5f);
    float *bd = make_vec(N_EXP * N_EMBD, 0.0f, 0.2f);
    t->blocks[0].window = 3;
    t->blocks[1].bo = vec(bo, N_EMBD);
    t->blocks[2].sinks = vec(sinks, N_HEAD);
    t->blocks[2].router_bias = vec(rb, N_EXP);
    t->blocks[2].exp_bias_gu = vec(bgu, N_EXP * N_FF * 2);
    t->blocks[2].exp_bias_down = vec(bd, N_EXP * N_EMBD);
    t->w.rope_scale = 1.25f;
    test_prefill_is_the_steps(t);
    t->blocks[0].window = 0;
    t->blocks[1].bo = t->blocks[2].sinks = t->blocks[2].router_bias = (pyrt_vector){0};
    t->blocks[2].exp_bias_gu = t->blocks[2].exp_bias_down = (pyrt_vector){0};
    t->w.rope_scale = 0.0f;
    free(sinks);
    free(bo);
    free(rb);
    free(bgu);
    free(bd);
}

/* The attention tile kernel (attn_tile.h) at every SIMD level this CPU has: each row against a
 * plain f64 softmax over its positions (window, sink), head_dim with and without a vector tail,
 * positions across key blocks; and each row's bits the same alone (a decode step's one-row tile,
 * its keys streamed first) as in a tile (a step and a prefill give a query the same output). */
static float rnd(void) { return (float)(rng_u32() % 2001) / 1000.0f - 1.0f; }

static void attn_reference(const pyrt_attn_tile *t, int r, double *out) {
    const int hd = t->hd, p = t->pos[r];
    const int lo = t->window > 0 && p + 1 > t->window ? p + 1 - t->window : 0;
    double mx = t->has_sink ? t->sink[r] : -INFINITY, sum = 0.0, s[256];
    for (int j = lo; j <= p; j++) {
        double x = 0.0;
        for (int c = 0; c < hd; c++)
            x += (double)t->q[r][c] * t->k[(size_t)j * hd + c];
        s[j] = x * t->scale;
        mx = s[j] > mx ? s[j] : mx;
    }
    for (int c = 0; c < hd; c++)
        out[c] = 0.0;
    for (int j = lo; j <= p; j++) {
        const double e = exp(s[j] - mx);
        sum += e;
        for (int c = 0; c < hd; c++)
            out[c] += e * t->v[(size_t)j * hd + c];
    }
    if (t->has_sink)
        sum += exp(t->sink[r] - mx);
    for (int c = 0; c < hd; c++)
        out[c] /= sum;
}

static void test_attn_tile(void) {
    enum { N_POS = 200, MAX_HD = 64 };
    static const int hds[] = {5, 16, 20, 64};
    float *k = malloc(sizeof(float) * N_POS * MAX_HD), *v = malloc(sizeof(float) * N_POS * MAX_HD);
    float q[PYRT_ATTN_ROWS][MAX_HD], o[PYRT_ATTN_ROWS][MAX_HD], alone[MAX_HD];
    float *scratch = malloc(sizeof(float) * pyrt_attn_scratch_floats(MAX_HD));
    float *stream = malloc(sizeof(float) * pyrt_attn_stream_floats(N_POS));
    CHECK(k && v && scratch && stream, "attn tile: out of memory");
    for (int i = 0; i < N_POS * MAX_HD; i++) {
        k[i] = rnd();
        v[i] = rnd();
    }
    const int best = pyrt_simd_best();
    for (int level = PYRT_SIMD_SCALAR; level <= best; level++) {
        CHECK(pyrt_simd_force(level) == PYRT_OK, "simd %d", level);
        for (int ih = 0; ih < COUNT_OF(hds); ih++)
            for (int window = 0; window <= 70; window += 70)
                for (int sink = 0; sink <= 1; sink++) {
                    const int hd = hds[ih];
                    pyrt_attn_tile t = {.n_rows = PYRT_ATTN_ROWS, .k = k, .v = v, .hd = hd,
                                        .window = window, .scale = 0.7f, .has_sink = sink,
                                        .scratch = scratch};
                    for (int r = 0; r < t.n_rows; r++) {
                        for (int c = 0; c < hd; c++)
                            q[r][c] = 3.0f * rnd();
                        t.q[r] = q[r];
                        t.out[r] = o[r];
                        t.pos[r] = (r * 37 + 60) % N_POS; /* 0 .. 199, blocks of 64 */
                        t.sink[r] = 2.0f * rnd();
                    }
                    pyrt_attn_tile_run(&t);
                    for (int r = 0; r < t.n_rows; r++) {
                        double ref[MAX_HD];
                        attn_reference(&t, r, ref);
                        double err = 0.0;
                        for (int c = 0; c < hd; c++)
                            err = fmax(err, fabs(o[r][c] - ref[c]));
                        CHECK(err <= 2e-6, "attn tile simd %d hd %d window %d sink %d row %d: "
                              "|d| %g", level, hd, window, sink, r, err);
                        pyrt_attn_tile one = t; /* a decode step's: one row, streamed */
                        one.n_rows = 1;
                        one.stream = stream;
                        one.q[0] = q[r];
                        one.out[0] = alone;
                        one.pos[0] = t.pos[r];
                        one.sink[0] = t.sink[r];
                        pyrt_attn_tile_run(&one);
                        CHECK(memcmp(alone, o[r], sizeof(float) * hd) == 0,
                              "attn tile simd %d hd %d row %d: other bits alone", level, hd, r);
                    }
                }
    }
    CHECK(pyrt_simd_force(best) == PYRT_OK, "simd back to %d", best);
    free(k);
    free(v);
    free(scratch);
    free(stream);
}

int main(void) {
    tiny_model t;
    build_tiny(&t);
    test_prefill_is_the_steps(&t);
    test_prefill_maps(&t);
    test_prefill_errors(&t);
    test_prefill_gpt_oss_pieces(&t);
    test_attn_tile();
    free_tiny(&t);
    if (failures) {
        printf("%d C prefill test(s) failed\n", failures);
        return 1;
    }
    printf("all C prefill tests passed\n");
    return 0;
}

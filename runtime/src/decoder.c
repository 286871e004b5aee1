/* The decoder's life: pyrt_decoder_create checks the model once and allocates the step's
 * scratch (the weights are borrowed), pyrt_decoder_free, the step timers, and the residual
 * stream's accessors for the per-layer calls. */
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "decoder.h"
#include "error.h"

int64_t pyrt_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int pyrt_decoder_create(const pyrt_model_weights *w, pyrt_decoder **out) {
    pyrt_clear_error();
    const char *fn = "pyrt_decoder_create";
    if (out == NULL || w == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: %s is NULL", fn, w ? "out" : "w");
    *out = NULL;
    int max_ff = 0;
    int rc = pyrt_decoder_check_model(w, &max_ff);
    if (rc != PYRT_OK)
        return rc;
    pyrt_decoder *d = calloc(1, sizeof *d);
    if (d == NULL)
        return pyrt_fail(PYRT_E_NOMEM, "%s: out of memory", fn);
    d->w = *w;
    const int nq = w->n_head * w->head_dim;
    d->max_ff = max_ff;
    d->max_in = w->n_embd > nq ? w->n_embd : nq;
    d->max_in = max_ff > d->max_in ? max_ff : d->max_in;
    const size_t f = sizeof(float);
    d->blocks = malloc((size_t)w->n_layer * sizeof *d->blocks);
    d->x = malloc((size_t)w->n_embd * f);
    d->xn = malloc((size_t)d->max_in * f);
    d->xq = malloc(pyrt_xq_units((size_t)d->max_in) * sizeof(pyrt_xq8));
    d->y = malloc((size_t)w->n_embd * f);
    d->ys = malloc((size_t)w->n_embd * f);
    d->gate = malloc(((size_t)max_ff + 1) * f);
    d->up = malloc(((size_t)max_ff + 1) * f);
    d->router = malloc((size_t)w->n_expert * f);
    d->ids = malloc((size_t)w->n_expert * sizeof(int32_t)); /* any k <= n_expert per step */
    d->topw = malloc((size_t)w->n_expert * f);
    d->taken = malloc((size_t)w->n_expert);
    if (w->expert_input_weight)
        d->xw = malloc((size_t)w->n_embd * f);
    if (!d->blocks || !d->x || !d->xn || !d->xq || !d->y || !d->ys || !d->gate || !d->up ||
        !d->router || !d->ids || !d->topw || !d->taken || (w->expert_input_weight && !d->xw)) {
        pyrt_decoder_free(d);
        return pyrt_fail(PYRT_E_NOMEM, "%s: out of memory", fn);
    }
    rc = pyrt_attention_init(&d->att, w, fn);
    if (rc == PYRT_OK && w->mla_kv_rank > 0)
        rc = pyrt_mla_init(&d->mla, w, fn);
    if (rc != PYRT_OK) {
        pyrt_decoder_free(d);
        return rc;
    }
    memcpy(d->blocks, w->blocks, (size_t)w->n_layer * sizeof *d->blocks);
    d->w.blocks = d->blocks;
    d->w.n_blocks = w->n_layer;
    atomic_flag_clear(&d->busy);
    *out = d;
    return PYRT_OK;
}

void pyrt_decoder_free(pyrt_decoder *d) {
    if (d == NULL)
        return;
    pyrt_attention_free(&d->att);
    pyrt_mla_free(&d->mla);
    pyrt_prefill_free(d);
    free(d->blocks);
    free(d->x);
    free(d->xn);
    free(d->xq);
    free(d->y);
    free(d->ys);
    free(d->xw);
    free(d->gate);
    free(d->up);
    free(d->router);
    free(d->ids);
    free(d->topw);
    free(d->taken);
    free(d);
}

int pyrt_decoder_times(pyrt_decoder *d, int64_t *ns, int reset) {
    pyrt_clear_error();
    if (d == NULL || ns == NULL)
        return pyrt_fail(PYRT_E_INVALID, "pyrt_decoder_times: %s is NULL", d ? "ns" : "dec");
    memcpy(ns, d->times, sizeof d->times);
    if (reset)
        memset(d->times, 0, sizeof d->times);
    return PYRT_OK;
}

int pyrt_decoder_read_x(pyrt_decoder *d, float *x) {
    pyrt_clear_error();
    if (d == NULL || x == NULL)
        return pyrt_fail(PYRT_E_INVALID, "pyrt_decoder_read_x: %s is NULL", d ? "x" : "dec");
    if (atomic_flag_test_and_set(&d->busy))
        return pyrt_fail(PYRT_E_INVALID, "pyrt_decoder_read_x: this decoder is running a step on "
                                         "another thread");
    memcpy(x, d->x, (size_t)d->w.n_embd * sizeof(float));
    atomic_flag_clear(&d->busy);
    return PYRT_OK;
}

int pyrt_decoder_write_x(pyrt_decoder *d, const float *x) {
    pyrt_clear_error();
    if (d == NULL || x == NULL)
        return pyrt_fail(PYRT_E_INVALID, "pyrt_decoder_write_x: %s is NULL", d ? "x" : "dec");
    if (atomic_flag_test_and_set(&d->busy))
        return pyrt_fail(PYRT_E_INVALID, "pyrt_decoder_write_x: this decoder is running a step "
                                         "on another thread");
    memcpy(d->x, x, (size_t)d->w.n_embd * sizeof(float));
    atomic_flag_clear(&d->busy);
    return PYRT_OK;
}

/* The host's side of a hybrid decode step (pyrt_moe_host_step in pyrt.h): the turns of a GPU
 * graph and the C core at each MoE layer, with no Python between them. Per layer the step used
 * to return to Python for the wait, the expert map, the call and the signal: ~42 us a layer
 * (olmoe-1b-7b, H100 host), ~0.7 ms of a ~7.5 ms token, on the serial path between the CPU's
 * share of one layer and the GPU's next. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "decoder.h"
#include "error.h"
#include "pool_struct.h"
#include "pyrt.h"

/* The graph writes flags over PCIe into page-locked host memory: an acquire load sees its
 * earlier writes of the routing (the graph fences them before the flag). */
static int32_t load_flag(const int32_t *flag) {
    return __atomic_load_n(flag, __ATOMIC_ACQUIRE);
}

/* Spins until *flag == seq; PYRT_E_TIMEOUT after timeout_ns (> 0). */
static int wait_flag(const int32_t *flag, int32_t seq, int64_t timeout_ns, int layer) {
    if (load_flag(flag) == seq)
        return PYRT_OK;
    const int64_t start = pyrt_now_ns();
    for (unsigned looks = 1; load_flag(flag) != seq; looks++) {
        pyrt_cpu_relax();
        if (timeout_ns > 0 && looks % 1024 == 0 && pyrt_now_ns() - start > timeout_ns)
            return pyrt_fail(PYRT_E_TIMEOUT,
                             "pyrt_moe_host_step: the graph did not reach MoE layer %d in %.3g s",
                             layer, (double)timeout_ns * 1e-9);
    }
    return PYRT_OK;
}

static int check_step(const pyrt_host_step *s) {
    const char *fn = "pyrt_moe_host_step";
    if (s == NULL || s->n_layers < 1 || s->k < 1 || s->layers == NULL || s->thresholds == NULL ||
        s->x == NULL || s->ids == NULL || s->w == NULL || s->codes == NULL || s->y == NULL ||
        s->flags == NULL || s->n_active == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: a required field is NULL or a count below 1", fn);
    if (s->logits_log != NULL && (s->logits == NULL || s->n_logits < 1))
        return pyrt_fail(PYRT_E_INVALID, "%s: logits_log without logits", fn);
    const int n_embd = s->layers[0] == NULL ? 0 : s->layers[0]->n_embd;
    const int n_expert = s->layers[0] == NULL ? 0 : s->layers[0]->n_expert;
    for (int m = 0; m < s->n_layers; m++) {
        const pyrt_experts *e = s->layers[m];
        if (e == NULL || e->n_embd != n_embd || e->n_expert != n_expert ||
            e->n_slots != n_expert)
            return pyrt_fail(PYRT_E_INVALID,
                             "%s: layer %d's experts are missing or not all %d experts of %d "
                             "inputs (the first layer's)",
                             fn, m, n_expert, n_embd);
        /* pyrt_moe_ffn's own check, here before any layer runs: not mid-step */
        if (!(s->thresholds[m] >= 0.0f) || isinf(s->thresholds[m]))
            return pyrt_fail(PYRT_E_INVALID,
                             "%s: layer %d's threshold must be finite and >= 0 (0 = dense), "
                             "got %g",
                             fn, m, (double)s->thresholds[m]);
    }
    return PYRT_OK;
}

/* Layer m's turn once its routing is there: the pairs coded s->code into y. map [n_expert]. */
static int run_layer(pyrt_pool *pool, const pyrt_host_step *s, int m, int32_t *map) {
    const int k = s->k;
    int n = 0;
    const pyrt_experts *layer = s->layers[m];
    for (int e = 0; e < layer->n_expert; e++)
        map[e] = -1;
    for (int j = 0; j < k; j++) {
        const int32_t id = s->ids[j];
        if (s->codes[j] != s->code)
            continue;
        if (id < 0 || id >= layer->n_expert)
            return pyrt_fail(PYRT_E_INVALID, "pyrt_moe_host_step: layer %d routes to expert %d "
                             "of %d", m, (int)id, layer->n_expert);
        map[id] = id;
        n++;
    }
    if (s->ids_log != NULL)
        memcpy(s->ids_log + (size_t)m * k, s->ids, (size_t)k * sizeof(int32_t));
    if (s->codes_log != NULL)
        memcpy(s->codes_log + (size_t)m * k, s->codes, (size_t)k * sizeof(int32_t));
    if (s->logits_log != NULL)
        memcpy(s->logits_log + (size_t)m * s->n_logits, s->logits,
               (size_t)s->n_logits * sizeof(float));
    s->n_active[m] = 0;
    if (n == 0) { /* nothing here: y is 0, without a pool run */
        memset(s->y, 0, (size_t)layer->n_embd * sizeof(float));
        return PYRT_OK;
    }
    pyrt_experts here = *layer;
    here.expert_map = map;
    return pyrt_moe_ffn(pool, &here, s->x, 1, s->ids, s->w, k, s->activation, s->thresholds[m],
                        s->y, &s->n_active[m]);
}

int pyrt_moe_host_step(pyrt_pool *pool, const pyrt_host_step *step, int32_t seq, int64_t *ns) {
    pyrt_clear_error();
    int rc = check_step(step);
    if (rc != PYRT_OK)
        return rc;
    int32_t *map = malloc((size_t)step->layers[0]->n_expert * sizeof(int32_t));
    if (map == NULL)
        return pyrt_fail(PYRT_E_NOMEM, "pyrt_moe_host_step: no memory for an expert map");
    int64_t waited = 0, computed = 0;
    int32_t *done = step->flags + step->n_layers;
    for (int m = 0; m < step->n_layers && rc == PYRT_OK; m++) {
        const int64_t t0 = pyrt_now_ns();
        rc = wait_flag(step->flags + m, seq, step->timeout_ns, m);
        const int64_t t1 = pyrt_now_ns();
        if (rc == PYRT_OK)
            rc = run_layer(pool, step, m, map);
        if (rc == PYRT_OK) /* y written before the graph may read it */
            __atomic_store_n(done + m, seq, __ATOMIC_RELEASE);
        waited += t1 - t0;
        computed += pyrt_now_ns() - t1;
    }
    free(map);
    if (ns != NULL) {
        ns[0] = waited;
        ns[1] = computed;
    }
    return rc;
}

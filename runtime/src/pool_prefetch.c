/* Prefetch while idle (pool.h): the plan of the next pool run, cut into one home per thread, and
 * each thread's progress through its home while it waits. */
#include <stdatomic.h>

#include "pool_struct.h"

#define LOAD(x) atomic_load_explicit(&(x), memory_order_relaxed)
#define STORE(x, v) atomic_store_explicit(&(x), (v), memory_order_relaxed)

/* Whether slot s holds plan b (only the caller writes slots: its reads race with nobody). */
static int same_plan(const pf_slot *s, const pyrt_pf_plan *b) {
    if (LOAD(s->n) != b->n)
        return 0;
    for (int i = 0; i < b->n; i++)
        if (LOAD(s->r[i].data) != b->r[i].data || LOAD(s->r[i].row_bytes) != b->r[i].row_bytes ||
            LOAD(s->r[i].n_rows) != b->r[i].n_rows)
            return 0;
    return 1;
}

static void set_slot(pf_slot *s, const pyrt_pf_plan *p, int64_t epoch) {
    const int n = p == NULL ? 0 : p->n < PYRT_PF_REGIONS ? p->n : PYRT_PF_REGIONS;
    for (int i = 0; i < n; i++) {
        STORE(s->r[i].data, p->r[i].data);
        STORE(s->r[i].row_bytes, p->r[i].row_bytes);
        STORE(s->r[i].n_rows, p->r[i].n_rows);
    }
    STORE(s->n, n);
    STORE(s->epoch, epoch);
}

int pyrt_pool_idle_step(pyrt_pool *pool, int ith, int slot, int lines) {
    const pf_slot *s = &pool->plans[slot];
    const int n_homes = pool->n_threads < PYRT_MAX_HOMES ? pool->n_threads : PYRT_MAX_HOMES;
    pyrt_pf_plan plan; /* this step's copy */
    plan.n = LOAD(s->n);
    if (plan.n <= 0 || plan.n > PYRT_PF_REGIONS || ith >= n_homes)
        return 0;
    for (int i = 0; i < plan.n; i++)
        plan.r[i] = (pyrt_pf_region){LOAD(s->r[i].data), LOAD(s->r[i].row_bytes),
                                     LOAD(s->r[i].n_rows)};
    const pyrt_pf_plan *p = &plan;
    idle_progress *pr = &pool->progress[ith];
    const int64_t epoch = LOAD(s->epoch);
    if (pr->epoch != epoch) {
        pr->epoch = epoch;
        pr->done = 0;
    }
    int64_t rows = 0;
    for (int i = 0; i < p->n; i++)
        rows += p->r[i].n_rows;
    const int64_t lo = pyrt_home_start(rows, ith, n_homes);
    const int64_t hi = pyrt_home_start(rows, ith + 1, n_homes);
    int64_t skip = pr->done; /* bytes of the home before the next line to prefetch */
    int left = lines;
    int64_t base = 0;        /* first row of region i in the list */
    for (int i = 0; i < p->n && left > 0; base += p->r[i].n_rows, i++) {
        const pyrt_pf_region *r = &p->r[i];
        const int64_t a = lo > base ? lo : base;
        const int64_t b = hi < base + r->n_rows ? hi : base + r->n_rows;
        if (a >= b)
            continue;
        const int64_t seg = (b - a) * (int64_t)r->row_bytes;
        if (skip >= seg) {
            skip -= seg;
            continue;
        }
        const uint8_t *start = r->data + (size_t)(a - base) * r->row_bytes;
        for (; skip < seg && left > 0; skip += 64, left--, pr->done += 64)
            __builtin_prefetch(start + skip, 0, 2); /* prefetcht1: into L2 */
        skip = 0;
    }
    return left == 0;
}

int pyrt_pool_idle_prefetch(pyrt_pool *pool, int ith) {
    return pyrt_pool_idle_step(pool, ith,
                               atomic_load_explicit(&pool->cur_slot, memory_order_acquire),
                               IDLE_LINES);
}

void pyrt_pool_plan_switch(pyrt_pool *pool, const pyrt_pf_plan *plan) {
    if (!pool->idle_pf || pool->n_threads == 1)
        return;
    const int slot = (atomic_load_explicit(&pool->cur_slot, memory_order_relaxed) + 1) % PLAN_SLOTS;
    /* pool->epoch: the caller's next pool_run reads it after the run */
    set_slot(&pool->plans[slot], plan, ++pool->epoch);
    atomic_store_explicit(&pool->cur_slot, slot, memory_order_release);
}

void pyrt_pool_plan_prefetch(pyrt_pool *pool, const pyrt_pf_plan *plan) {
    if (!pool->idle_pf || plan == NULL || plan->n <= 0) {
        pool->has_next = 0;
        return;
    }
    pool->next_plan.n = plan->n < PYRT_PF_REGIONS ? plan->n : PYRT_PF_REGIONS;
    for (int i = 0; i < pool->next_plan.n; i++)
        pool->next_plan.r[i] = plan->r[i];
    pool->has_next = 1;
}

int pyrt_pool_plan_for_run(pyrt_pool *pool) {
    /* the slot after the one in force (the last run's, read by threads that have not seen this
     * run yet) */
    const int prev = atomic_load_explicit(&pool->cur_slot, memory_order_relaxed);
    const int slot = (prev + 1) % PLAN_SLOTS;
    if (pool->has_next) {
        if (!same_plan(&pool->plans[prev], &pool->next_plan))
            pool->epoch++;
        set_slot(&pool->plans[slot], &pool->next_plan, pool->epoch);
        pool->has_next = 0;
    } else {
        set_slot(&pool->plans[slot], NULL, LOAD(pool->plans[slot].epoch));
    }
    return slot;
}

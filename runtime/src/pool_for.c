/* pyrt_pool_for (pool.h): a loop over indices as one work-conserving pool task. */
#include <stdatomic.h>

#include "pool.h"

typedef struct {
    pyrt_index_fn fn;
    void *ctx;
    int64_t n;
    int grain;
    atomic_llong next; /* the next index to claim */
} for_task;

static void task_for(void *p, int ith, int nth) {
    (void)nth;
    for_task *f = p;
    for (int64_t i0; (i0 = atomic_fetch_add_explicit(&f->next, f->grain, memory_order_relaxed)) <
                     f->n;) {
        const int64_t i1 = f->n - i0 < f->grain ? f->n : i0 + f->grain;
        for (int64_t i = i0; i < i1; i++)
            f->fn(f->ctx, i, ith);
    }
}

void pyrt_pool_for(pyrt_pool *pool, int64_t n, int grain, pyrt_index_fn fn, void *ctx) {
    if (n <= 0)
        return;
    for_task f = {.fn = fn, .ctx = ctx, .n = n, .grain = grain > 0 ? grain : 1};
    atomic_init(&f.next, 0);
    if (n <= f.grain) { /* one claim: no hand-off */
        task_for(&f, 0, 1);
        return;
    }
    pyrt_pool_run(pool, task_for, &f);
}

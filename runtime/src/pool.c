/* Thread pool: n_threads - 1 workers plus the calling thread, created once, woken per task.
 *
 * A decode step calls the expert kernel once per layer (tens of calls per token, each a few
 * hundred microseconds of work), so waking must be cheap: workers spin on an atomic generation
 * counter for up to spin_ns before sleeping on a condition variable, and the caller locks the
 * mutex and broadcasts only when some worker sleeps (the common back-to-back case is one atomic
 * increment). Likewise the last worker to finish signals the caller only when the caller sleeps.
 * Both hand-offs are Dekker-style pairs of sequentially consistent atomics (write own flag, read
 * the other's), so a wake-up cannot be lost. The spin is bounded so that idle workers do not
 * keep the cores torch needs between our calls. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "error.h"
#include "pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PYRT_CPU_RELAX() _mm_pause()
#else
#define PYRT_CPU_RELAX() ((void)0)
#endif

enum {
    SPIN_CHECK = 64,       /* pause instructions (or idle-prefetch steps) between clock reads */
    IDLE_LINES = 8,        /* cache lines per idle-prefetch step, between looks at the flag */
    PLAN_SLOTS = 3         /* a run's plan and one mid-run switch, beside the one before */
};

/* Where a thread's idle prefetch of its home has got to (own cache line: only ith writes it). */
typedef struct {
    _Alignas(64) int64_t epoch; /* the plan it belongs to (plan_epoch) */
    int64_t done;               /* bytes of the home prefetched */
} idle_progress;

typedef struct {
    pyrt_pool *pool;
    int ith;
} worker_arg;

struct pyrt_pool {
    int n_threads;
    int n_started;       /* workers actually started (n_threads - 1 on success) */
    pthread_t *threads;  /* [n_threads - 1] */
    worker_arg *args;    /* [n_threads - 1] */
    pthread_mutex_t call_lock; /* held by the kernel call using the pool */
    pthread_mutex_t lock;      /* guards sleeping on wake/done */
    pthread_cond_t wake;
    pthread_cond_t done;
    atomic_uint_fast64_t generation; /* bumped once per task */
    atomic_int pending;              /* workers still running the current task */
    atomic_int shutdown;
    atomic_int n_sleeping;      /* workers inside the wake wait (or about to be) */
    atomic_int caller_sleeping; /* the caller waits on `done` */
    pyrt_params params;
    int64_t spin_ns;   /* params.spin_us in ns */
    pyrt_task_fn fn; /* current task, written before generation is bumped */
    void *ctx;
    void *workspace; /* scratch owned by the pool */
    size_t workspace_bytes;
    /* prefetch while idle (pool.h): plans[cur_slot] is the plan in force: a run writes
     * the next slot (mod PLAN_SLOTS) before its generation is published, and a task may switch
     * once more mid-run (pyrt_pool_plan_switch), so a thread that has not yet seen the run start
     * still reads a slot nobody writes; plan_epoch[slot] changes only when the plan differs from
     * the one before, so a thread whose home is the same (qkv, then attention, both before the o
     * projection) goes on from where it stopped instead of walking it again. */
    int idle_pf;              /* params.idle_prefetch (0: plans ignored) */
    int has_next;             /* next_plan is set for the next run */
    pyrt_pf_plan next_plan;
    pyrt_pf_plan plans[PLAN_SLOTS];
    int64_t plan_epoch[PLAN_SLOTS];
    atomic_int cur_slot;
    int64_t epoch;            /* last epoch handed out */
    idle_progress *progress;  /* [n_threads] */
};

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int same_plan(const pyrt_pf_plan *a, const pyrt_pf_plan *b) {
    if (a->n != b->n)
        return 0;
    for (int i = 0; i < a->n; i++)
        if (a->r[i].data != b->r[i].data || a->r[i].row_bytes != b->r[i].row_bytes ||
            a->r[i].n_rows != b->r[i].n_rows)
            return 0;
    return 1;
}

/* One step of thread ith's idle prefetch of the plan of the run in `slot`: the next `lines`
 * lines of its home into L2. Returns 0 when its home is done (or it has none). */
static int idle_step(pyrt_pool *pool, int ith, int slot, int lines) {
    const pyrt_pf_plan *p = &pool->plans[slot];
    const int n_homes = pool->n_threads < PYRT_MAX_HOMES ? pool->n_threads : PYRT_MAX_HOMES;
    if (p->n == 0 || ith >= n_homes)
        return 0;
    idle_progress *pr = &pool->progress[ith];
    if (pr->epoch != pool->plan_epoch[slot]) {
        pr->epoch = pool->plan_epoch[slot];
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
    return idle_step(pool, ith, atomic_load_explicit(&pool->cur_slot, memory_order_acquire),
                     IDLE_LINES);
}

void pyrt_pool_plan_switch(pyrt_pool *pool, const pyrt_pf_plan *plan) {
    if (!pool->idle_pf || pool->n_threads == 1)
        return;
    const int slot = (atomic_load_explicit(&pool->cur_slot, memory_order_relaxed) + 1) % PLAN_SLOTS;
    pyrt_pf_plan *p = &pool->plans[slot];
    p->n = plan == NULL ? 0 : plan->n < PYRT_PF_REGIONS ? plan->n : PYRT_PF_REGIONS;
    for (int i = 0; i < p->n; i++)
        p->r[i] = plan->r[i];
    pool->plan_epoch[slot] = ++pool->epoch; /* the caller's next pool_run reads it after the run */
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

/* Spins until the generation differs from `seen` or spin_ns have passed; returns the last read.
 * While it spins, thread ith prefetches its home of the plan in force (the last run's: the next
 * task's rows). */
static uint_fast64_t spin_for_generation(pyrt_pool *pool, uint_fast64_t seen, int ith) {
    uint_fast64_t gen = atomic_load_explicit(&pool->generation, memory_order_acquire);
    const int64_t t0 = gen == seen ? mono_ns() : 0;
    int more = 1;
    while (gen == seen) {
        for (int i = 0; i < SPIN_CHECK && gen == seen; i++) {
            if (more)
                more = idle_step(pool, ith,
                                 atomic_load_explicit(&pool->cur_slot, memory_order_acquire),
                                 IDLE_LINES);
            else
                PYRT_CPU_RELAX();
            gen = atomic_load_explicit(&pool->generation, memory_order_acquire);
        }
        if (gen == seen && mono_ns() - t0 > pool->spin_ns)
            break;
    }
    return gen;
}

static void *worker_main(void *p) {
    worker_arg *arg = p;
    pyrt_pool *pool = arg->pool;
    uint_fast64_t seen = 0;
    for (;;) {
        uint_fast64_t gen = spin_for_generation(pool, seen, arg->ith);
        if (gen == seen) {
            pthread_mutex_lock(&pool->lock);
            atomic_fetch_add(&pool->n_sleeping, 1); /* then read generation: see pool_run */
            while ((gen = atomic_load(&pool->generation)) == seen && !atomic_load(&pool->shutdown))
                pthread_cond_wait(&pool->wake, &pool->lock);
            atomic_fetch_sub(&pool->n_sleeping, 1);
            pthread_mutex_unlock(&pool->lock);
        }
        if (atomic_load(&pool->shutdown))
            return NULL;
        seen = gen;
        pool->fn(pool->ctx, arg->ith, pool->n_threads);
        /* the last one out wakes the caller if it went to sleep (seq_cst pair with pool_run) */
        if (atomic_fetch_sub(&pool->pending, 1) == 1 && atomic_load(&pool->caller_sleeping)) {
            pthread_mutex_lock(&pool->lock);
            pthread_cond_signal(&pool->done);
            pthread_mutex_unlock(&pool->lock);
        }
    }
}

static void stop_workers(pyrt_pool *pool) {
    pthread_mutex_lock(&pool->lock);
    atomic_store(&pool->shutdown, 1);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 0; i < pool->n_started; i++)
        pthread_join(pool->threads[i], NULL);
    pool->n_started = 0;
}

int pyrt_pool_create(int n_threads, const pyrt_params *params, pyrt_pool **out) {
    pyrt_clear_error();
    if (out == NULL)
        return pyrt_fail(PYRT_E_INVALID, "pyrt_pool_create: out is NULL");
    *out = NULL;
    if (n_threads < 1 || n_threads > 1024)
        return pyrt_fail(PYRT_E_INVALID,
                         "pyrt_pool_create: n_threads must be in [1, 1024], got %d", n_threads);
    pyrt_params p;
    if (params != NULL)
        p = *params;
    else
        pyrt_params_default(&p);
    if (pyrt_params_check(&p, "pyrt_pool_create") != PYRT_OK)
        return PYRT_E_INVALID;
    pyrt_pool *pool = calloc(1, sizeof *pool);
    if (pool == NULL)
        return pyrt_fail(PYRT_E_NOMEM, "pyrt_pool_create: out of memory");
    pool->n_threads = n_threads;
    pool->params = p;
    pool->threads = calloc((size_t)n_threads, sizeof *pool->threads);
    pool->args = calloc((size_t)n_threads, sizeof *pool->args);
    if (pool->threads == NULL || pool->args == NULL) {
        free(pool->threads);
        free(pool->args);
        free(pool);
        return pyrt_fail(PYRT_E_NOMEM, "pyrt_pool_create: out of memory");
    }
    pthread_mutex_init(&pool->call_lock, NULL);
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    atomic_init(&pool->generation, 0);
    atomic_init(&pool->pending, 0);
    atomic_init(&pool->shutdown, 0);
    atomic_init(&pool->n_sleeping, 0);
    atomic_init(&pool->caller_sleeping, 0);
    atomic_init(&pool->cur_slot, 0);
    pool->spin_ns = (int64_t)p.spin_us * 1000;
    pool->idle_pf = p.idle_prefetch;
    pool->progress = aligned_alloc(64, (size_t)n_threads * sizeof *pool->progress);
    if (pool->progress == NULL) {
        pyrt_pool_free(pool);
        return pyrt_fail(PYRT_E_NOMEM, "pyrt_pool_create: out of memory");
    }
    memset(pool->progress, 0, (size_t)n_threads * sizeof *pool->progress);
    for (int i = 0; i < n_threads - 1; i++) {
        pool->args[i] = (worker_arg){.pool = pool, .ith = i + 1};
        int rc = pthread_create(&pool->threads[i], NULL, worker_main, &pool->args[i]);
        if (rc != 0) {
            stop_workers(pool);
            pyrt_pool_free(pool);
            return pyrt_fail(PYRT_E_SYSTEM, "pyrt_pool_create: cannot start thread %d of %d: %s",
                             i + 1, n_threads, strerror(rc));
        }
        pool->n_started++;
    }
    *out = pool;
    return PYRT_OK;
}

void pyrt_pool_free(pyrt_pool *pool) {
    if (pool == NULL)
        return;
    stop_workers(pool);
    pthread_cond_destroy(&pool->done);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->lock);
    pthread_mutex_destroy(&pool->call_lock);
    free(pool->workspace);
    free(pool->progress);
    free(pool->threads);
    free(pool->args);
    free(pool);
}

int pyrt_pool_threads(const pyrt_pool *pool) {
    return pool == NULL ? 0 : pool->n_threads;
}

const pyrt_params *pyrt_pool_params(const pyrt_pool *pool) {
    return &pool->params;
}

const pyrt_row_ops *pyrt_pool_row_ops(const pyrt_pool *pool, int fmt) {
    return pyrt_row_ops_at(pyrt_simd_active(), fmt, pool->params.vnni);
}

void pyrt_pool_acquire(pyrt_pool *pool) {
    pthread_mutex_lock(&pool->call_lock);
}

void pyrt_pool_release(pyrt_pool *pool) {
    pthread_mutex_unlock(&pool->call_lock);
}

void *pyrt_pool_workspace(pyrt_pool *pool, size_t bytes) {
    if (bytes <= pool->workspace_bytes)
        return pool->workspace;
    free(pool->workspace);
    pool->workspace = NULL;
    pool->workspace_bytes = 0;
    size_t rounded = (bytes + 63) / 64 * 64;
    void *p = aligned_alloc(64, rounded);
    if (p == NULL)
        return NULL;
    pool->workspace = p;
    pool->workspace_bytes = rounded;
    return p;
}

void pyrt_spin_pause(int spins) {
    if (spins % 1024 == 0)
        sched_yield();
    else
        PYRT_CPU_RELAX();
}

void pyrt_pool_run(pyrt_pool *pool, pyrt_task_fn fn, void *ctx) {
    const int nth = pool->n_threads;
    if (nth == 1) {
        fn(ctx, 0, 1);
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    /* this run's plan, in the slot after the one in force (the last run's, read by threads that
     * have not seen this run yet) */
    const int prev = atomic_load_explicit(&pool->cur_slot, memory_order_relaxed);
    const int slot = (prev + 1) % PLAN_SLOTS;
    pyrt_pf_plan *plan = &pool->plans[slot];
    if (pool->has_next) {
        if (!same_plan(&pool->next_plan, &pool->plans[prev]))
            pool->epoch++;
        *plan = pool->next_plan;
        pool->plan_epoch[slot] = pool->epoch;
        pool->has_next = 0;
    } else {
        plan->n = 0;
    }
    atomic_store_explicit(&pool->cur_slot, slot, memory_order_release);
    atomic_store_explicit(&pool->pending, nth - 1, memory_order_relaxed);
    /* Publish the task (seq_cst), then look for sleepers: a worker that counted itself asleep
     * after this read re-reads the generation under the lock and sees the new task. */
    atomic_fetch_add(&pool->generation, 1);
    if (atomic_load(&pool->n_sleeping) > 0) {
        pthread_mutex_lock(&pool->lock);
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->lock);
    }

    fn(ctx, 0, nth);

    if (atomic_load_explicit(&pool->pending, memory_order_acquire) == 0)
        return;
    const int64_t t0 = mono_ns();
    int more = 1;
    for (;;) {
        for (int i = 0; i < SPIN_CHECK; i++) {
            if (atomic_load_explicit(&pool->pending, memory_order_acquire) == 0)
                return;
            if (more)
                more = idle_step(pool, 0,
                                 atomic_load_explicit(&pool->cur_slot, memory_order_acquire),
                                 IDLE_LINES);
            else
                PYRT_CPU_RELAX();
        }
        if (mono_ns() - t0 > pool->spin_ns)
            break;
    }
    pthread_mutex_lock(&pool->lock);
    atomic_store(&pool->caller_sleeping, 1); /* then read pending: see worker_main */
    while (atomic_load(&pool->pending) > 0)
        pthread_cond_wait(&pool->done, &pool->lock);
    atomic_store(&pool->caller_sleeping, 0);
    pthread_mutex_unlock(&pool->lock);
}

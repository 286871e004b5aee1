/* The thread pool's threads (pool.h): n_threads - 1 workers plus the calling thread, created once,
 * woken per task.
 *
 * A decode step hands the pool tens of tasks per token, each a few hundred microseconds of work,
 * so waking must be cheap: workers spin on the run word for up to spin_us before sleeping on a
 * condition variable, and the caller locks the mutex and broadcasts only when some worker sleeps
 * (the common back-to-back case is one atomic store). Both hand-offs are Dekker-style pairs of
 * sequentially consistent atomics (write own flag, read the other's), so a wake-up cannot be
 * lost. The spin is bounded so that idle workers do not keep the cores torch, or another
 * process, needs between our calls.
 *
 * A busy machine. A worker the OS has preempted (another process runs on its core) may start a
 * task a scheduler slice (milliseconds) late; waiting for it would stall every task of a step
 * behind the slowest core's competitor. So a run is joined, not assigned: the caller publishes
 * the task open, each worker that sees it in time joins it (counted in the run word) and takes
 * work from the task's shared counters; when the caller runs out of work it closes the run, and
 * it waits only for the workers that joined (they hold claimed work). A worker that comes late
 * finds the run closed and skips it. Every task is written so (pool.h): its work is claimed from
 * counters, never assigned to a thread index, and its results do not depend on which thread did
 * which part (so the bits do not depend on the machine's load either).
 *
 * A worker preempted while it holds claimed work still stalls the run until it runs again. So
 * when a run shows that the machine is oversubscribed (the caller waited for the joined workers
 * longer than its own part took and at least CONTENDED_NS; or a thread of the pool, spinning,
 * found the clock had jumped by more than PREEMPTED_NS between two looks: it had lost its CPU to
 * another process), the caller runs the next tasks alone for a while (params.adapt_to_load):
 * SOLO_MIN_NS, doubling while the load lasts, up to SOLO_MAX_NS, so a busy machine costs at most
 * one stall per stretch; after CALM_NS without one the stretch is back to its minimum. Alone it
 * runs at -t 1's speed (what a loaded machine leaves a process anyway); the workers, seeing no
 * runs, sleep after spin_us. A long task is no false alarm: only lost CPUs and stragglers are. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "error.h"
#include "pool_struct.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* adapt_to_load (see above), in ns */
static const int64_t CONTENDED_NS = 200000, PREEMPTED_NS = 200000, SOLO_MIN_NS = 2000000,
                     SOLO_MAX_NS = 128000000, CALM_NS = 1000000000;

int64_t pyrt_pool_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

pyrt_spinner pyrt_spin_begin(void) {
    const int64_t now = pyrt_pool_now_ns();
    return (pyrt_spinner){.start = now, .last = now, .looks = 0};
}

int pyrt_spin_on(pyrt_pool *pool, pyrt_spinner *s) {
    const int64_t now = pyrt_pool_now_ns();
    if (now - s->last > PREEMPTED_NS && pool->adapt)
        atomic_store_explicit(&pool->preempted, 1, memory_order_relaxed);
    s->last = now;
    if (++s->looks % YIELD_LOOKS == 0)
        sched_yield();
    return now - s->start <= pool->spin_ns;
}

void pyrt_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
}

/* ---- workers ------------------------------------------------------------------------------- */

/* Spins until the run word's generation differs from `seen` or spin_ns have passed; returns the
 * last word read. While it spins, thread ith prefetches its home of the plan in force (the last
 * run's: the next task's rows). */
static uint64_t spin_for_run(pyrt_pool *pool, uint64_t seen, int ith) {
    uint64_t w = atomic_load_explicit(&pool->run, memory_order_acquire);
    if (w >> 32 != seen)
        return w;
    pyrt_spinner sp = pyrt_spin_begin();
    int more = 1;
    while (w >> 32 == seen) {
        for (int i = 0; i < SPIN_CHECK && w >> 32 == seen; i++) {
            if (more)
                more = pyrt_pool_idle_step(
                    pool, ith, atomic_load_explicit(&pool->cur_slot, memory_order_acquire),
                    IDLE_LINES);
            else
                pyrt_cpu_relax();
            w = atomic_load_explicit(&pool->run, memory_order_acquire);
        }
        if (w >> 32 == seen && !pyrt_spin_on(pool, &sp))
            break;
    }
    return w;
}

/* The run after generation `seen`: spins, then sleeps; 0 at shutdown. */
static uint64_t next_run(pyrt_pool *pool, uint64_t seen, int ith) {
    uint64_t w = spin_for_run(pool, seen, ith);
    if (w >> 32 == seen) {
        pthread_mutex_lock(&pool->lock);
        atomic_fetch_add(&pool->n_sleeping, 1); /* then read the run word: see pyrt_pool_run */
        while ((w = atomic_load(&pool->run)) >> 32 == seen && !atomic_load(&pool->shutdown))
            pthread_cond_wait(&pool->wake, &pool->lock);
        atomic_fetch_sub(&pool->n_sleeping, 1);
        pthread_mutex_unlock(&pool->lock);
    }
    return atomic_load(&pool->shutdown) ? 0 : w;
}

/* Joins the open run whose word is w (or a later open one): 1 when joined (*w its word). */
static int join_run(pyrt_pool *pool, uint64_t *w) {
    while (*w & RUN_OPEN)
        if (atomic_compare_exchange_weak(&pool->run, w, *w + 1))
            return 1;
    return 0;
}

/* Leaves the run it joined; the last one out of a closed run wakes the caller if it sleeps. */
static void leave_run(pyrt_pool *pool) {
    const uint64_t before = atomic_fetch_sub(&pool->run, 1);
    if ((before & RUN_COUNT) == 1 && !(before & RUN_OPEN) && atomic_load(&pool->caller_sleeping)) {
        pthread_mutex_lock(&pool->lock);
        pthread_cond_signal(&pool->done);
        pthread_mutex_unlock(&pool->lock);
    }
}

_Thread_local int pyrt_pf_into_l2;

static void *worker_main(void *p) {
    worker_arg *arg = p;
    pyrt_pool *pool = arg->pool;
    pyrt_pf_into_l2 = pool->params.prefetch_l2;
    uint64_t seen = 0;
    for (;;) {
        uint64_t w = next_run(pool, seen, arg->ith);
        if (w == 0)
            return NULL;
        seen = w >> 32;
        if (!join_run(pool, &w))
            continue; /* closed before this thread came: the others did its share */
        seen = w >> 32;
        pool->fn(pool->ctx, arg->ith, pool->n_threads);
        leave_run(pool);
    }
}

/* Waits (spin, then sleep) until no worker is inside the closed run. */
static void wait_for_joined(pyrt_pool *pool) {
    pyrt_spinner sp = pyrt_spin_begin();
    int more = 1;
    for (;;) {
        for (int i = 0; i < SPIN_CHECK; i++) {
            if ((atomic_load_explicit(&pool->run, memory_order_acquire) & RUN_COUNT) == 0)
                return;
            if (more)
                more = pyrt_pool_idle_step(
                    pool, 0, atomic_load_explicit(&pool->cur_slot, memory_order_acquire),
                    IDLE_LINES);
            else
                pyrt_cpu_relax();
        }
        if (!pyrt_spin_on(pool, &sp))
            break;
    }
    pthread_mutex_lock(&pool->lock);
    atomic_store(&pool->caller_sleeping, 1); /* then read the count: see leave_run */
    while (atomic_load(&pool->run) & RUN_COUNT)
        pthread_cond_wait(&pool->done, &pool->lock);
    atomic_store(&pool->caller_sleeping, 0);
    pthread_mutex_unlock(&pool->lock);
}

/* After a run from t_start to t_end whose own part ended at t_fn: solo for a while if it waited
 * for a straggler or a thread lost its CPU. */
static void adapt(pyrt_pool *pool, int64_t t_start, int64_t t_fn, int64_t t_end) {
    const int64_t waited = t_end - t_fn, own = t_fn - t_start;
    const int lost = atomic_exchange_explicit(&pool->preempted, 0, memory_order_relaxed);
    if (lost || (waited > CONTENDED_NS && waited > own)) {
        pool->solo_until = t_end + pool->backoff_ns;
        pool->backoff_ns = pool->backoff_ns * 2 < SOLO_MAX_NS ? pool->backoff_ns * 2 : SOLO_MAX_NS;
        pool->calm_since = t_end;
    } else if (t_end - pool->calm_since > CALM_NS) {
        pool->backoff_ns = SOLO_MIN_NS;
    }
}

void pyrt_pool_run(pyrt_pool *pool, pyrt_task_fn fn, void *ctx) {
    const int nth = pool->n_threads;
    pyrt_pf_into_l2 = pool->params.prefetch_l2; /* the caller's kernels prefetch as the pool's */
    if (nth == 1) {
        fn(ctx, 0, 1);
        return;
    }
    const int64_t t_start = pool->adapt ? pyrt_pool_now_ns() : 0;
    if (t_start < pool->solo_until) { /* the task completes on the caller alone */
        fn(ctx, 0, nth);
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    const int slot = pyrt_pool_plan_for_run(pool);
    atomic_store_explicit(&pool->cur_slot, slot, memory_order_release);
    /* Publish the run open (seq_cst), then look for sleepers: a worker that counted itself
     * asleep after this read re-reads the run word under the lock and sees the new run. */
    const uint64_t gen = (atomic_load_explicit(&pool->run, memory_order_relaxed) >> 32) + 1;
    atomic_store(&pool->run, gen << 32 | RUN_OPEN);
    if (atomic_load(&pool->n_sleeping) > 0) {
        pthread_mutex_lock(&pool->lock);
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->lock);
    }

    fn(ctx, 0, nth);

    /* Every piece of work is claimed: close the run, then wait for the workers inside it. */
    const int64_t t_fn = pool->adapt ? pyrt_pool_now_ns() : 0;
    const uint64_t closed = atomic_fetch_and(&pool->run, ~RUN_OPEN) & ~RUN_OPEN;
    if ((closed & RUN_COUNT) != 0)
        wait_for_joined(pool);
    if (pool->adapt)
        adapt(pool, t_start, t_fn, pyrt_pool_now_ns());
}

/* ---- life ---------------------------------------------------------------------------------- */

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
    pyrt_pool *pool = aligned_alloc(64, (sizeof(pyrt_pool) + 63) / 64 * 64);
    if (pool == NULL)
        return pyrt_fail(PYRT_E_NOMEM, "pyrt_pool_create: out of memory");
    memset(pool, 0, sizeof *pool);
    pool->n_threads = n_threads;
    pyrt_params_resolve(&p);
    pool->params = p;
    pool->threads = calloc((size_t)n_threads, sizeof *pool->threads);
    pool->args = calloc((size_t)n_threads, sizeof *pool->args);
    pool->progress = aligned_alloc(64, (size_t)n_threads * sizeof *pool->progress);
    if (pool->threads == NULL || pool->args == NULL || pool->progress == NULL) {
        free(pool->threads);
        free(pool->args);
        free(pool->progress);
        free(pool);
        return pyrt_fail(PYRT_E_NOMEM, "pyrt_pool_create: out of memory");
    }
    memset(pool->progress, 0, (size_t)n_threads * sizeof *pool->progress);
    pthread_mutex_init(&pool->call_lock, NULL);
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    atomic_init(&pool->run, 0);
    atomic_init(&pool->shutdown, 0);
    atomic_init(&pool->n_sleeping, 0);
    atomic_init(&pool->caller_sleeping, 0);
    atomic_init(&pool->flag_sleepers, 0);
    atomic_init(&pool->preempted, 0);
    atomic_init(&pool->cur_slot, 0);
    pool->spin_ns = (int64_t)p.spin_us * 1000;
    pool->adapt = p.adapt_to_load;
    pool->backoff_ns = SOLO_MIN_NS;
    pool->idle_pf = p.idle_prefetch;
    for (int i = 0; i < n_threads - 1; i++) {
        pool->args[i] = (worker_arg){.pool = pool, .ith = i + 1};
        int rc = pthread_create(&pool->threads[i], NULL, worker_main, &pool->args[i]);
        if (rc != 0) {
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
    free(pool->batch_workspace);
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

/* *mem with room for `bytes` (64-byte aligned): kept when it has it, else replaced (the old
 * contents dropped); NULL when out of memory (then *mem is freed and *have 0). */
static void *grow(void **mem, size_t *have, size_t bytes) {
    if (bytes <= *have)
        return *mem;
    free(*mem);
    *mem = NULL;
    *have = 0;
    const size_t rounded = pyrt_align64(bytes);
    void *p = aligned_alloc(64, rounded);
    if (p == NULL)
        return NULL;
    *mem = p;
    *have = rounded;
    return p;
}

void *pyrt_pool_workspace(pyrt_pool *pool, size_t bytes) {
    return grow(&pool->workspace, &pool->workspace_bytes, bytes);
}

void *pyrt_pool_batch_workspace(pyrt_pool *pool, size_t bytes) {
    return grow(&pool->batch_workspace, &pool->batch_workspace_bytes, bytes);
}

/* The thread pool (pool_threads.c, pool_wait.c, pool_prefetch.c): n_threads - 1 workers plus the
 * calling thread, running one task at a time; what its threads prefetch while they wait; its
 * params, row kernels and scratch memory. */
#ifndef PYRT_POOL_H
#define PYRT_POOL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "pyrt.h"
#include "rows.h"

/* A task: run by the calling thread (ith 0) and by every worker that joins the run in time,
 * ith in [0, nth). A task must be work-conserving: its threads claim its work from shared
 * counters (never by thread index), so that the caller alone, or any set of threads with it,
 * completes it; and its results must not depend on which thread did which part. A worker that
 * comes late (preempted, asleep) is not waited for (pool_threads.c). */
typedef void (*pyrt_task_fn)(void *ctx, int ith, int nth);

/* Run fn on the pool and return when all its work is done. The caller holds the pool
 * (pool_acquire). */
void pyrt_pool_run(pyrt_pool *pool, pyrt_task_fn fn, void *ctx);
/* Serialize users of one pool: a kernel call holds the pool from its start to its end. */
void pyrt_pool_acquire(pyrt_pool *pool);
void pyrt_pool_release(pyrt_pool *pool);

/* fn(ctx, i, ith) for every i in [0, n), as one pool task whose threads claim `grain`
 * consecutive i at a time (pool_for.c). The caller holds the pool. */
typedef void (*pyrt_index_fn)(void *ctx, int64_t i, int ith);
void pyrt_pool_for(pyrt_pool *pool, int64_t n, int grain, pyrt_index_fn fn, void *ctx);

/* ---- prefetch while idle -------------------------------------------------------------------
 * Between pool tasks the DRAM idles: the caller runs serial pieces (norms, RoPE, top-k), threads
 * wait for the slowest one, and each task's first rows arrive a memory latency late. A plan names
 * the rows the NEXT task will read (the rows of up to PYRT_PF_REGIONS matrices, as one list), cut
 * into homes: thread ith < n_homes = min(nth, PYRT_MAX_HOMES) owns rows
 * [pyrt_home_start(rows, ith, n_homes), pyrt_home_start(rows, ith + 1, n_homes)). While a thread
 * waits (for the next task, or for the others at the end of one), it prefetches its home of the
 * plan into its L2 (prefetcht1), a few lines at a time, until the next task starts; the matvec
 * (linear.c) then takes its home's rows first, from L2. A plan is only a hint: prefetches never
 * fault, and a stale or wrong plan costs bandwidth, never correctness. */
enum { PYRT_PF_REGIONS = 4, PYRT_MAX_HOMES = 64 };

typedef struct {
    const uint8_t *data; /* row 0 */
    size_t row_bytes;
    int64_t n_rows;
} pyrt_pf_region;

typedef struct {
    pyrt_pf_region r[PYRT_PF_REGIONS];
    int n;
} pyrt_pf_plan;

/* First row of home h of n_homes over `rows` rows: even (so row pairs stay in one home), rising,
 * `rows` for h = n_homes. */
static inline int64_t pyrt_home_start(int64_t rows, int h, int n_homes) {
    return h >= n_homes ? rows : (rows * h / n_homes) & ~(int64_t)1;
}

/* The plan for the idle time of the next pyrt_pool_run only (its threads' waits inside and after
 * the task); copied. NULL or an empty plan: nothing. Ignored when the pool's params have
 * idle_prefetch 0. Call while holding the pool, or just before the kernel call that will. */
void pyrt_pool_plan_prefetch(pyrt_pool *pool, const pyrt_pf_plan *plan);
/* Inside a task (thread ith): one step (a few lines) of this task's plan for ith; returns 0 once
 * ith's home is done (or there is no plan), so a spin-wait can prefetch instead of pausing. */
int pyrt_pool_idle_prefetch(pyrt_pool *pool, int ith);
/* From inside a pool task, by one thread, at most once per run: the rest of the run's idle time
 * (and the idle time after it) prefetches `plan` instead of the run's own plan. */
void pyrt_pool_plan_switch(pyrt_pool *pool, const pyrt_pf_plan *plan);

/* Inside a task (thread ith): waits until *flag >= value, where another thread of the task sets
 * the flag with pyrt_pool_flag_store / _add: spins up to params.spin_us (prefetching ith's home
 * of the plan while there is some left), then sleeps until woken (pool_wait.c). */
void pyrt_pool_wait_slow(pyrt_pool *pool, const atomic_int *flag, int value, int ith);
static inline void pyrt_pool_wait_flag(pyrt_pool *pool, const atomic_int *flag, int value,
                                       int ith) {
    if (atomic_load_explicit(flag, memory_order_acquire) < value)
        pyrt_pool_wait_slow(pool, flag, value, ith);
}
/* *flag = value / *flag += n (returning the value before), sequentially consistent, waking the
 * threads asleep in pyrt_pool_wait_flag (a load of a counter when none sleeps). Flags reset
 * before a run (no thread waits yet) are plain atomic stores. */
void pyrt_pool_flag_store(pyrt_pool *pool, atomic_int *flag, int value);
int pyrt_pool_flag_add(pyrt_pool *pool, atomic_int *flag, int n);

/* ---- the pool's settings and scratch -------------------------------------------------------- */

/* PYRT_OK, or PYRT_E_INVALID with "<fn>: params.<field> = <v> is outside [lo, hi]" (params.c). */
int pyrt_params_check(const pyrt_params *params, const char *fn);
/* Replaces params' automatic (-1) fields by their values. */
void pyrt_params_resolve(pyrt_params *params);
/* The pool's params (as given at creation, the automatic fields resolved). */
const pyrt_params *pyrt_pool_params(const pyrt_pool *pool);
/* The active SIMD level's row kernels for fmt, with the pool's vnni setting. */
const pyrt_row_ops *pyrt_pool_row_ops(const pyrt_pool *pool, int fmt);

/* Scratch memory owned by the pool (64-byte aligned, grown on demand, kept between calls); NULL
 * when out of memory. Valid while the caller holds the pool and until the next workspace call. */
void *pyrt_pool_workspace(pyrt_pool *pool, size_t bytes);
/* n rounded up to a multiple of 64: the scratch's alignment, kept by the pieces callers lay out
 * in it. */
static inline size_t pyrt_align64(size_t n) {
    return (n + 63) & ~(size_t)63;
}
/* A second scratch, as pyrt_pool_workspace's and apart from it (neither call moves the other's):
 * pyrt_moe_ffn's many-token route keeps pyrt_moe_batch's plan, h and per-route outputs here
 * between calls (~20-50 MB for a 512-token chunk), beside the token blocks' workspace. */
void *pyrt_pool_batch_workspace(pyrt_pool *pool, size_t bytes);

#endif /* PYRT_POOL_H */

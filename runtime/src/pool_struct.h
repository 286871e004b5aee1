/* struct pyrt_pool: the thread pool's state, shared by its files (pool_threads.c: threads and
 * runs; pool_wait.c: waiting for a flag; pool_prefetch.c: prefetch while idle). Not seen outside
 * them. */
#ifndef PYRT_POOL_STRUCT_H
#define PYRT_POOL_STRUCT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "pool.h"

enum {
    SPIN_CHECK = 64, /* pause instructions (or idle-prefetch steps) between clock reads */
    YIELD_LOOKS = 8, /* clock reads between two yields of the CPU (~10-20 us of spinning) */
    IDLE_LINES = 8,  /* cache lines per idle-prefetch step, between looks at the flag */
    PLAN_SLOTS = 3   /* a run's plan and one mid-run switch, beside the one before */
};

/* The run word (pyrt_pool.run): the run's generation in the high 32 bits, RUN_OPEN while
 * workers may still join it, and the number of workers inside it in the low bits. */
#define RUN_OPEN ((uint64_t)1 << 31)
#define RUN_COUNT ((uint64_t)RUN_OPEN - 1)

/* Where a thread's idle prefetch of its home has got to (own cache line: only ith writes it). */
typedef struct {
    _Alignas(64) int64_t epoch; /* the plan it belongs to (plan_epoch) */
    int64_t done;               /* bytes of the home prefetched */
} idle_progress;

typedef struct {
    pyrt_pool *pool;
    int ith;
} worker_arg;

/* A plan as the pool keeps it for its threads' idle time: relaxed atomics, because a worker
 * that missed runs (preempted, or late to join) may still read a slot the caller is rewriting;
 * it then prefetches a mix of two plans' rows, which costs bandwidth, never correctness. */
typedef struct {
    _Atomic(const uint8_t *) data;
    atomic_size_t row_bytes;
    atomic_llong n_rows;
} pf_slot_region;

typedef struct {
    pf_slot_region r[PYRT_PF_REGIONS];
    atomic_int n;
    atomic_llong epoch; /* changes only when the plan differs from the one before */
} pf_slot;

struct pyrt_pool {
    int n_threads;
    int n_started;       /* workers actually started (n_threads - 1 on success) */
    pthread_t *threads;  /* [n_threads - 1] */
    worker_arg *args;    /* [n_threads - 1] */
    pthread_mutex_t call_lock; /* held by the kernel call using the pool */
    pthread_mutex_t lock;      /* guards sleeping on wake/done */
    pthread_cond_t wake;
    pthread_cond_t done;
    _Alignas(64) atomic_uint_fast64_t run; /* see RUN_OPEN */
    atomic_int shutdown;
    atomic_int n_sleeping;      /* workers inside the wake wait (or about to be) */
    atomic_int caller_sleeping; /* the caller waits on `done` */
    _Alignas(64) atomic_int flag_sleepers; /* threads asleep on a task's flag (pool_wait.c) */
    atomic_int preempted; /* 1: a spinning thread of the pool lost its CPU (pyrt_pool_spun) */
    _Alignas(64) pyrt_params params;
    int64_t spin_ns;   /* params.spin_us in ns */
    /* params.adapt_to_load (pool_threads.c): until solo_until (CLOCK_MONOTONIC ns) the caller
     * runs tasks alone; backoff_ns is the next solo stretch; calm_since: the end of the last run
     * that waited for a preempted thread */
    int adapt;
    int64_t solo_until, backoff_ns, calm_since;
    pyrt_task_fn fn;   /* current task, written before the run word is published */
    void *ctx;
    void *workspace;   /* scratch owned by the pool (pyrt_pool_workspace) */
    size_t workspace_bytes;
    void *batch_workspace; /* the second scratch (pyrt_pool_batch_workspace) */
    size_t batch_workspace_bytes;
    /* prefetch while idle (pool_prefetch.c): plans[cur_slot] is the plan in force: a run writes
     * the next slot (mod PLAN_SLOTS) before it is published, and a task may switch once more
     * mid-run (pyrt_pool_plan_switch), so a thread that has not yet seen the run start still
     * reads a slot nobody writes; plan_epoch[slot] changes only when the plan differs from the
     * one before, so a thread whose home is the same (qkv, then attention, both before the o
     * projection) goes on from where it stopped instead of walking it again. */
    int idle_pf;              /* params.idle_prefetch (0: plans ignored) */
    int has_next;             /* next_plan is set for the next run */
    pyrt_pf_plan next_plan;
    pf_slot plans[PLAN_SLOTS];
    atomic_int cur_slot;
    int64_t epoch;            /* last epoch handed out */
    idle_progress *progress;  /* [n_threads] */
};

/* CLOCK_MONOTONIC in ns (pool_threads.c). */
int64_t pyrt_pool_now_ns(void);

/* A thread spinning in the pool (waiting for a run, for the joined workers, for a task's flag):
 * when it started and its last look at the clock. */
typedef struct {
    int64_t start, last;
    int looks;
} pyrt_spinner;

pyrt_spinner pyrt_spin_begin(void);
/* A spinner's look at the clock, every SPIN_CHECK steps of its loop: 1 while it may spin on
 * (params.spin_us not passed). Every YIELD_LOOKS looks it yields its CPU (sched_yield): on a busy
 * machine the thread it waits for may be queued on the same CPU, behind it. When more than
 * PREEMPTED_NS passed since its last look, it was descheduled in between (another thread wanted
 * its CPU): it says so in pool->preempted for adapt_to_load (pool_threads.c). */
int pyrt_spin_on(pyrt_pool *pool, pyrt_spinner *s);

/* A pause instruction (nothing where the CPU has none). */
void pyrt_cpu_relax(void);

/* One step of thread ith's idle prefetch of the plan in `slot` (pool_prefetch.c): the next
 * `lines` lines of its home into L2; 0 when its home is done (or it has none). */
int pyrt_pool_idle_step(pyrt_pool *pool, int ith, int slot, int lines);
/* A run's plan into the slot after the one in force (pool_prefetch.c); the slot to publish. */
int pyrt_pool_plan_for_run(pyrt_pool *pool);

#endif /* PYRT_POOL_STRUCT_H */

/* Dense weight matrices (linear.c): y = x W^T over matrices read in place in their own format,
 * as pool tasks (matvec jobs) that the decode step composes, and pyrt_linear on top. */
#ifndef PYRT_LINEAR_H
#define PYRT_LINEAR_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "pool.h"
#include "rows.h"

enum { PYRT_MV_MAX = 4 }; /* matrices one matvec job can hold (q, k, v; router, gate, up) */

/* Checks one weight matrix (non-NULL data, known format, n_in fits the format, bytes match the
 * shape, aligned); on failure sets last_error ("fn: what ...") and returns the status. */
int pyrt_matrix_check(const pyrt_matrix *m, const char *fn, const char *what);

/* One output of a matvec job: y[t * y_stride + o] = m[o, :] . x_t (+ bias[o]), then clamped to
 * [-clamp, clamp] when clamp > 0, then divided by div when div != 1. */
typedef struct {
    const pyrt_matrix *m;
    const float *bias; /* [n_out] or NULL */
    float *y;
    size_t y_stride; /* floats between tokens in y */
} pyrt_mv_out;

/* y = x W^T for up to PYRT_MV_MAX matrices over the same tokens, as one pool task: the rows of
 * all matrices form one list, cut into one home per thread (pyrt_home_start, the same split as
 * a prefetch plan of the job: pyrt_mv_job_plan), each home into chunks. A thread takes its own
 * home's chunks first (their rows are in its L2 when it prefetched them while idle), then those
 * of the other homes, from per-home counters (a slower or preempted core delays the task by one
 * chunk). Each y element is written by one thread. */
typedef struct {
    pyrt_mv_out out[PYRT_MV_MAX];
    int n_mats;
    const float *x;       /* [n_tokens, x_stride] f32: read by float-format matrices */
    size_t x_stride;      /* floats between tokens in x */
    const pyrt_xq8 *xq;   /* [n_tokens, xq_stride] Q8 blocks of x (pyrt_mv_job_xq's kind): read
                           * by the blocked matrices */
    size_t xq_stride;     /* pyrt_xq8 units between tokens in xq: pyrt_xq_units(n) */
    int n_tokens;
    float clamp;          /* > 0: clamp every output to [-clamp, clamp] (after the bias) */
    float div;            /* every output divided by it (1: no-op) */
    /* called by the thread that computed rows [lo, hi) of the list, right after (NULL: none):
     * a later phase of the same pool task can start on rows as they complete */
    void (*on_rows)(void *ctx, int64_t lo, int64_t hi);
    void *on_rows_ctx;
    /* set by pyrt_mv_job_prepare */
    const pyrt_row_ops *ops[PYRT_MV_MAX]; /* out[i]'s row kernels (the pool's SIMD setting) */
    int prefetch_rows;    /* the pool's params.matvec_prefetch_rows */
    int64_t total_rows;
    int n_homes;          /* min(nth, PYRT_MAX_HOMES) */
    int chunk;            /* rows per work item (even, so row pairs share one pass over x) */
    struct {
        _Alignas(64) atomic_int next; /* next chunk of the home (own cache line) */
    } home[PYRT_MAX_HOMES];
} pyrt_mv_job;

/* Sets the chunking for the pool's threads, the row kernels and prefetch distance of its
 * params, and resets the counters; call before each pyrt_pool_run. */
void pyrt_mv_job_prepare(pyrt_mv_job *job, const pyrt_pool *pool);
/* The job's rows as a prefetch plan (the same homes as its task's). */
void pyrt_mv_job_plan(const pyrt_mv_job *job, pyrt_pf_plan *plan);
/* The pool task (ctx: pyrt_mv_job). */
void pyrt_mv_task(void *ctx, int ith, int nth);

/* ---- one token (the decode step) ----------------------------------------------------------- */

/* How the job's matrices want x quantized (PYRT_XQ_*, rows.h): the join over its matrices. */
int pyrt_mv_job_xq(const pyrt_mv_job *job);
/* The job over one token x [n] whose Q8 blocks are in xq [n / 32] (not made here), prepared for
 * the pool (div 0 is taken as 1). */
void pyrt_mv_job_bind(pyrt_mv_job *job, pyrt_pool *pool, const float *x, int n, pyrt_xq8 *xq);
/* pyrt_mv_job_bind after quantizing x into xq as the job's matrices want (pyrt_mv_job_xq). */
void pyrt_mv_job_setup(pyrt_mv_job *job, pyrt_pool *pool, const float *x, int n, pyrt_xq8 *xq);
/* pyrt_mv_job_setup, then the job as one pool task (the caller holds the pool). */
void pyrt_mv_run(pyrt_mv_job *job, pyrt_pool *pool, const float *x, int n, pyrt_xq8 *xq);
/* The idle time of the next pool run prefetches `next`'s rows (NULL: nothing). */
void pyrt_pool_plan_job(pyrt_pool *pool, const pyrt_mv_job *next);

#endif /* PYRT_LINEAR_H */

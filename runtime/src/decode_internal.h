/* Internal declarations of the dense-weight kernels (linear.c) shared with the decode step
 * (decode.c). Not part of the public API. */
#ifndef PYRT_DECODE_INTERNAL_H
#define PYRT_DECODE_INTERNAL_H

#include <stdatomic.h>

#include "pyrt_internal.h"

enum { PYRT_MV_MAX = 4 }; /* matrices one matvec job can hold (q, k, v; router, gate, up) */

static inline int pyrt_fmt_is_blocked(int fmt) {
    return fmt == PYRT_FMT_Q8_0 || fmt == PYRT_FMT_Q4_0;
}

/* Bytes a weights pointer in fmt must be aligned to: its element (F32 4, F16/BF16 2; blocks 1). */
static inline size_t pyrt_fmt_align(int fmt) {
    return fmt == PYRT_FMT_F32 ? 4 : pyrt_fmt_is_blocked(fmt) ? 1 : 2;
}

/* PYRT_OK if expert weights `gud` in `fmt` are aligned to pyrt_fmt_align(fmt); else
 * PYRT_E_INVALID with "<fn>: weights pointer is not N-byte aligned". */
int pyrt_check_weights_aligned(const char *fn, const void *gud, int fmt);

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
    const pyrt_xq8 *xq;   /* [n_tokens, xq_stride] Q8 blocks of x: read by Q8_0/Q4_0 matrices */
    size_t xq_stride;     /* blocks between tokens in xq */
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

/* Writes the top k expert ids and weights of the token from the router's output. */
typedef void (*pyrt_route_fn)(void *ctx, int32_t *ids, float *w);

/* One token's router, routing and routed experts as one pool task (moe_ffn.c): every thread
 * runs `before` first (NULL: none; it returns once x, xq and the router's input are ready),
 * then `router`'s chunks (prepared: pyrt_mv_job_prepare; its out[0] the router, whose rows'
 * completion triggers `route`, which fills ids/w [k]), then pyrt_moe_ffn's work for x (xq: its
 * Q8 blocks, made by the router's job or by `before`; NULL: quantized here, before the run).
 * The caller holds the pool; the weights were checked. */
int pyrt_moe_ffn_routed(pyrt_pool *pool, pyrt_task_fn before, void *before_ctx,
                        pyrt_mv_job *router, pyrt_route_fn route, void *route_ctx, int32_t *ids,
                        float *w, const void *gud, int fmt, int n_expert, int n_ff, int n_embd,
                        const float *x, const pyrt_xq8 *xq, int k, int activation,
                        float threshold, float *y, int64_t *n_active);

#endif /* PYRT_DECODE_INTERNAL_H */

/* pyrt_linear: y = x W^T (+ b) over a dense weight matrix read in place from the GGUF mmap, in its
 * own format (float, 32-element blocks, K-quants), for one token (decode: a matvec, DRAM-bound) or
 * many (prefill). For the blocked formats the activations are quantized to Q8 blocks once per
 * token (for the K-quants with a scale per 256: pyrt_quantize_x_q8k) and the dot products are
 * integer, as in pyrt_moe_ffn and llama.cpp; accumulation is f32.
 *
 * Work split: the rows of the matrices of one job form one list, cut into one home per thread
 * (the homes of a prefetch plan, pool.h), each home into CHUNKS_PER_THREAD chunks that
 * threads take from the home's counter: its own home first (in the decode step its rows were
 * prefetched into its L2 while the thread waited), then the others'. A chunk walks its rows in
 * pairs (dot2: one pass over x for two rows) and, inside a pair, every token of a TOKEN_TILE, so
 * a weight row is read from DRAM once and reused from L1 for the tile. */
#include <stdlib.h>

#include "error.h"
#include "linear.h"

enum {
    CHUNKS_PER_THREAD = 4,
    MIN_CHUNK = 16,             /* rows: below this the counter traffic costs more than it saves */
    TOKEN_TILE = 64,            /* tokens whose Q8 blocks stay in L2 while a chunk's rows pass */
    SERIAL_QUANTIZE_MAX = 1 << 15 /* x elements quantized on the calling thread */
};

int pyrt_matrix_check(const pyrt_matrix *m, const char *fn, const char *what) {
    if (m == NULL || m->data == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: %s weights are NULL", fn, what);
    if (!pyrt_fmt_known(m->fmt))
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: %s has unknown weight format %d (supported: %s)", fn, what, m->fmt,
                         PYRT_FMT_NAMES);
    if (m->n_out < 1 || m->n_in < 1)
        return pyrt_fail(PYRT_E_INVALID, "%s: %s has shape [%d, %d]; both must be positive", fn,
                         what, m->n_out, m->n_in);
    const size_t rb = pyrt_row_bytes(m->fmt, m->n_in);
    if (rb == 0)
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: %s rows have %d elements, not a multiple of %d, which format %d "
                         "(quantized in blocks of %d) needs", fn, what, m->n_in,
                         pyrt_fmt_block(m->fmt), m->fmt, pyrt_fmt_block(m->fmt));
    if ((double)rb * m->n_out != (double)m->bytes)
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: %s holds %zu bytes but [%d, %d] in format %d needs %.0f: wrong shape "
                         "or format for this tensor", fn, what, m->bytes, m->n_out, m->n_in,
                         m->fmt, (double)rb * m->n_out);
    const size_t elem = pyrt_fmt_align(m->fmt);
    if ((uintptr_t)m->data % elem != 0)
        return pyrt_fail(PYRT_E_INVALID, "%s: %s weights pointer is not %zu-byte aligned", fn,
                         what, elem);
    return PYRT_OK;
}

void pyrt_mv_job_prepare(pyrt_mv_job *job, const pyrt_pool *pool) {
    const int nth = pyrt_pool_threads(pool);
    int64_t total = 0;
    for (int i = 0; i < job->n_mats; i++) {
        total += job->out[i].m->n_out;
        job->ops[i] = pyrt_pool_row_ops(pool, job->out[i].m->fmt);
    }
    job->prefetch_rows = pyrt_pool_params(pool)->matvec_prefetch_rows;
    job->total_rows = total;
    job->n_homes = nth < PYRT_MAX_HOMES ? nth : PYRT_MAX_HOMES;
    const int64_t home = (total + job->n_homes - 1) / job->n_homes;
    int64_t chunk = (home + CHUNKS_PER_THREAD - 1) / CHUNKS_PER_THREAD;
    if (chunk < MIN_CHUNK)
        chunk = MIN_CHUNK;
    chunk += chunk & 1;
    job->chunk = (int)chunk;
    for (int h = 0; h < job->n_homes; h++) /* pool_run publishes them */
        atomic_store_explicit(&job->home[h].next, 0, memory_order_relaxed);
}

void pyrt_mv_job_plan(const pyrt_mv_job *job, pyrt_pf_plan *plan) {
    plan->n = job->n_mats < PYRT_PF_REGIONS ? job->n_mats : PYRT_PF_REGIONS;
    for (int i = 0; i < plan->n; i++) {
        const pyrt_matrix *m = job->out[i].m;
        plan->r[i] = (pyrt_pf_region){m->data, pyrt_row_bytes(m->fmt, m->n_in), m->n_out};
    }
}

/* What happens to one output after its dot: bias, clamp, division (the job's, held in locals
 * so that the stores into y need not reload them). */
typedef struct {
    const float *bias; /* [n_out] or NULL */
    float clamp;       /* > 0: clamp to [-clamp, clamp] */
    float div;         /* 1: none */
} mv_finish;

static inline float finish(const mv_finish *f, int row, float v) {
    if (f->bias != NULL)
        v += f->bias[row];
    if (f->clamp > 0.0f)
        v = v < -f->clamp ? -f->clamp : v > f->clamp ? f->clamp : v;
    if (f->div != 1.0f)
        v /= f->div;
    return v;
}

/* Software prefetch of a weight range (into L1 or L2: pyrt_pf_line): the hardware prefetcher
 * alone leaves a one-stream-per-core matvec latency-bound (~3 GB/s per Zen 3 core, vs ~12 GB/s
 * of compute). */
static inline void prefetch_bytes(const uint8_t *p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64)
        pyrt_pf_line(p + off);
}

enum { PAIR_LINES = 1024 }; /* prefetch list of one row pair (64 KiB of rows; more: the rest not) */

/* Line addresses covering [p, p + bytes), at most PAIR_LINES. */
static int pair_lines(const uint8_t *p, size_t bytes, const void **lines) {
    int n = 0;
    for (const uint8_t *l = p - ((uintptr_t)p & 63); l < p + bytes && n < PAIR_LINES; l += 64)
        lines[n++] = l;
    return n;
}

/* Rows [r0, r1) of matrix i for many tokens (prefill): PYRT_TILE_ROWS rows at a time against
 * every token of a TOKEN_TILE, in tiles (rows.h); the same bits as the row-pair loop below. */
static void mv_rows_tiled(const pyrt_mv_job *job, int i, int r0, int r1) {
    const pyrt_mv_out *o = &job->out[i];
    const pyrt_matrix *m = o->m;
    const pyrt_row_ops *ops = job->ops[i];
    const mv_finish fin = {o->bias, job->clamp, job->div};
    const size_t rb = pyrt_row_bytes(m->fmt, m->n_in);
    const int blocked = pyrt_fmt_is_blocked(m->fmt);
    const uint8_t *xv = blocked ? (const uint8_t *)job->xq : (const uint8_t *)job->x;
    const size_t xs = blocked ? job->xq_stride * sizeof(pyrt_xq8) : job->x_stride * sizeof(float);
    float out[TOKEN_TILE * PYRT_TILE_ROWS];
    const void *xp[TOKEN_TILE], *rp[PYRT_TILE_ROWS];
    for (int t0 = 0; t0 < job->n_tokens; t0 += TOKEN_TILE) {
        const int nt = job->n_tokens - t0 < TOKEN_TILE ? job->n_tokens - t0 : TOKEN_TILE;
        for (int t = 0; t < nt; t++)
            xp[t] = xv + (size_t)(t0 + t) * xs;
        for (int r = r0; r < r1; r += PYRT_TILE_ROWS) {
            const int nr = r1 - r < PYRT_TILE_ROWS ? r1 - r : PYRT_TILE_ROWS;
            for (int k = 0; k < nr; k++)
                rp[k] = (const uint8_t *)m->data + (size_t)(r + k) * rb;
            pyrt_dot_tile(ops, nr, rp, nt, xp, m->n_in, out, PYRT_TILE_ROWS, 1);
            for (int t = 0; t < nt; t++)
                for (int k = 0; k < nr; k++)
                    o->y[(size_t)(t0 + t) * o->y_stride + r + k] =
                        finish(&fin, r + k, out[t * PYRT_TILE_ROWS + k]);
        }
    }
}

/* Rows [r0, r1) of matrix i of the job, every token of the job. */
static void mv_rows(const pyrt_mv_job *job, int i, int r0, int r1) {
    const int ahead = job->prefetch_rows;
    const void *pf[PAIR_LINES];
    const pyrt_mv_out *o = &job->out[i];
    const pyrt_matrix *m = o->m;
    const pyrt_row_ops *ops = job->ops[i];
    if (job->n_tokens > 1 && ops->dot_tile != NULL) {
        mv_rows_tiled(job, i, r0, r1);
        return;
    }
    const mv_finish fin = {o->bias, job->clamp, job->div};
    float *y = o->y;
    const size_t ys = o->y_stride;
    const size_t rb = pyrt_row_bytes(m->fmt, m->n_in);
    const uint8_t *w = m->data;
    const int blocked = pyrt_fmt_is_blocked(m->fmt);
    const uint8_t *xv = blocked ? (const uint8_t *)job->xq : (const uint8_t *)job->x;
    const size_t xs = blocked ? job->xq_stride * sizeof(pyrt_xq8) : job->x_stride * sizeof(float);
    if (ahead > 0) /* the chunk's first rows, which no pair before it prefetched */
        prefetch_bytes(w + (size_t)r0 * rb, (size_t)(r1 - r0 < ahead ? r1 - r0 : ahead) * rb);
    for (int t0 = 0; t0 < job->n_tokens; t0 += TOKEN_TILE) {
        const int t1 = job->n_tokens - t0 < TOKEN_TILE ? job->n_tokens : t0 + TOKEN_TILE;
        int r = r0;
        for (; ops->dot2 != NULL && r + 1 < r1; r += 2) {
            const uint8_t *row = w + (size_t)r * rb;
            /* the pair `ahead` rows on: spread through this pair's first dot2 where the level
             * has dot2_pf (a burst of a pair's ~70 lines stalls on full line-fill buffers) */
            int n_pf = 0;
            if (t0 == 0 && r + ahead + 2 <= r1) {
                if (ops->dot2_pf != NULL)
                    n_pf = pair_lines(row + (size_t)ahead * rb, 2 * rb, pf);
                else
                    prefetch_bytes(row + (size_t)ahead * rb, 2 * rb);
            }
            for (int t = t0; t < t1; t++) {
                float d[2];
                if (n_pf > 0 && t == t0)
                    ops->dot2_pf(row, row + rb, xv + (size_t)t * xs, m->n_in, d, pf, n_pf);
                else
                    ops->dot2(row, row + rb, xv + (size_t)t * xs, m->n_in, d);
                y[(size_t)t * ys + r] = finish(&fin, r, d[0]);
                y[(size_t)t * ys + r + 1] = finish(&fin, r + 1, d[1]);
            }
        }
        for (; r < r1; r++) {
            const uint8_t *row = w + (size_t)r * rb;
            for (int t = t0; t < t1; t++)
                y[(size_t)t * ys + r] =
                    finish(&fin, r, ops->dot(row, xv + (size_t)t * xs, m->n_in));
        }
    }
}

/* Rows [lo, hi) of the job's list, mapped onto the matrices they cross. */
static void mv_range(const pyrt_mv_job *job, int64_t lo, int64_t hi) {
    int64_t base = 0;
    for (int i = 0; i < job->n_mats && lo < hi; i++) {
        const int64_t n = job->out[i].m->n_out;
        if (lo < base + n) {
            const int64_t end = hi < base + n ? hi : base + n;
            mv_rows(job, i, (int)(lo - base), (int)(end - base));
            lo = end;
        }
        base += n;
    }
}

void pyrt_mv_task(void *ctx, int ith, int nth) {
    (void)nth;
    pyrt_mv_job *job = ctx;
    const int nh = job->n_homes;
    /* own home first, then the others' from the next one on */
    for (int k = 0; k < nh; k++) {
        const int h = (ith + k) % nh;
        const int64_t lo = pyrt_home_start(job->total_rows, h, nh);
        const int64_t hi = pyrt_home_start(job->total_rows, h + 1, nh);
        /* a plain load first: a finished home costs no atomic (which would serialize the
         * threads' scans at the end of the task) */
        if (lo + (int64_t)atomic_load_explicit(&job->home[h].next, memory_order_relaxed) *
                     job->chunk >= hi)
            continue;
        for (;;) {
            const int64_t i = atomic_fetch_add_explicit(&job->home[h].next, 1,
                                                        memory_order_relaxed);
            const int64_t r0 = lo + i * job->chunk;
            if (r0 >= hi)
                break;
            const int64_t r1 = r0 + job->chunk < hi ? r0 + job->chunk : hi;
            mv_range(job, r0, r1);
            if (job->on_rows != NULL)
                job->on_rows(job->on_rows_ctx, r0, r1);
        }
    }
}

/* ---- one token (the decode step) ----------------------------------------------------------- */

int pyrt_mv_job_xq(const pyrt_mv_job *job) {
    int kind = PYRT_XQ_NONE;
    for (int i = 0; i < job->n_mats; i++)
        kind = pyrt_xq_join(kind, pyrt_fmt_xq(job->out[i].m->fmt));
    return kind;
}

void pyrt_mv_job_bind(pyrt_mv_job *job, pyrt_pool *pool, const float *x, int n, pyrt_xq8 *xq) {
    job->x = x;
    job->x_stride = (size_t)n;
    job->xq = xq;
    job->xq_stride = pyrt_xq_units((size_t)n);
    job->n_tokens = 1;
    if (job->div == 0.0f)
        job->div = 1.0f;
    pyrt_mv_job_prepare(job, pool);
}

void pyrt_mv_job_setup(pyrt_mv_job *job, pyrt_pool *pool, const float *x, int n, pyrt_xq8 *xq) {
    pyrt_quantize_x_for(pyrt_mv_job_xq(job), x, xq, n);
    pyrt_mv_job_bind(job, pool, x, n, xq);
}

void pyrt_mv_run(pyrt_mv_job *job, pyrt_pool *pool, const float *x, int n, pyrt_xq8 *xq) {
    pyrt_mv_job_setup(job, pool, x, n, xq);
    pyrt_pool_run(pool, pyrt_mv_task, job);
}

void pyrt_pool_plan_job(pyrt_pool *pool, const pyrt_mv_job *next) {
    pyrt_pf_plan plan = {.n = 0};
    if (next != NULL)
        pyrt_mv_job_plan(next, &plan);
    pyrt_pool_plan_prefetch(pool, &plan);
}

/* ---- pyrt_linear --------------------------------------------------------------------------- */

enum { QUANTIZE_TOKENS = 8 }; /* tokens a thread quantizes per claim */

typedef struct {
    const float *x;
    pyrt_xq8 *xq;
    int kind; /* PYRT_XQ_* */
    int n_tokens, n_in;
    atomic_int next; /* next token to claim */
} quantize_ctx;

static void task_quantize(void *p, int ith, int nth) {
    (void)ith;
    (void)nth;
    quantize_ctx *c = p;
    const size_t nb = pyrt_xq_units((size_t)c->n_in);
    for (int t0; (t0 = atomic_fetch_add_explicit(&c->next, QUANTIZE_TOKENS,
                                                 memory_order_relaxed)) < c->n_tokens;) {
        const int t1 = c->n_tokens - t0 < QUANTIZE_TOKENS ? c->n_tokens : t0 + QUANTIZE_TOKENS;
        for (int t = t0; t < t1; t++)
            pyrt_quantize_x_for(c->kind, c->x + (size_t)t * c->n_in, c->xq + (size_t)t * nb,
                                c->n_in);
    }
}

int pyrt_linear(pyrt_pool *pool, const pyrt_matrix *w, const float *x, int n_tokens,
                const float *bias, float *y) {
    pyrt_clear_error();
    const char *fn = "pyrt_linear";
    if (pool == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: pool is NULL (create one with pyrt_pool_create)", fn);
    if (w == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: w is NULL", fn);
    int rc = pyrt_matrix_check(w, fn, "w");
    if (rc != PYRT_OK)
        return rc;
    if (n_tokens < 0)
        return pyrt_fail(PYRT_E_INVALID, "%s: n_tokens must be >= 0, got %d", fn, n_tokens);
    if (x == NULL || y == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: %s is NULL", fn, x == NULL ? "x" : "y");
    if ((uintptr_t)x % 4 || (uintptr_t)y % 4 || (uintptr_t)bias % 4)
        return pyrt_fail(PYRT_E_INVALID, "%s: x, y, bias must be 4-byte aligned", fn);
    if (n_tokens == 0)
        return PYRT_OK;

    const int blocked = pyrt_fmt_is_blocked(w->fmt);
    const size_t nb = pyrt_xq_units((size_t)w->n_in); /* xq's stride */
    pyrt_pool_acquire(pool);
    pyrt_xq8 *xq = NULL;
    if (blocked) {
        xq = pyrt_pool_workspace(pool, (size_t)n_tokens * nb * sizeof(pyrt_xq8));
        if (xq == NULL) {
            pyrt_pool_release(pool);
            return pyrt_fail(PYRT_E_NOMEM, "%s: cannot allocate %zu bytes for quantized x", fn,
                             (size_t)n_tokens * nb * sizeof(pyrt_xq8));
        }
        quantize_ctx qc = {
            .x = x, .xq = xq, .kind = pyrt_fmt_xq(w->fmt), .n_tokens = n_tokens, .n_in = w->n_in};
        atomic_init(&qc.next, 0);
        if ((int64_t)n_tokens * w->n_in <= SERIAL_QUANTIZE_MAX)
            task_quantize(&qc, 0, 1);
        else
            pyrt_pool_run(pool, task_quantize, &qc);
    }
    pyrt_mv_job job = {
        .out = {{.m = w, .bias = bias, .y = y, .y_stride = (size_t)w->n_out}},
        .n_mats = 1,
        .x = x,
        .x_stride = (size_t)w->n_in,
        .xq = xq,
        .xq_stride = nb,
        .n_tokens = n_tokens,
        .clamp = 0.0f,
        .div = 1.0f,
    };
    pyrt_mv_job_prepare(&job, pool);
    pyrt_pool_run(pool, pyrt_mv_task, &job);
    pyrt_pool_release(pool);
    return PYRT_OK;
}

/* pyrt_linear_heads: one matvec per attention head, y_h = W_h x_h, over a per-head stack of
 * matrices read in place: multi-head latent attention's absorbed decode (docs/gguf-layout.md,
 * deepseek2) folds attn_k_b [H, rank, nope] into each head's query and applies attn_v_b
 * [H, v, rank] to each head's weighted latent. One pool task for all heads: work items are
 * (head, chunk of rows) pairs taken from one counter, so H small matvecs cost one dispatch. */
#include <stdatomic.h>

#include "error.h"
#include "linear.h"

enum { HEAD_CHUNK = 32 }; /* rows per work item */

typedef struct {
    const pyrt_matrix *w;
    const pyrt_row_ops *ops;
    const float *x;      /* [n_heads, n_in] f32 */
    const pyrt_xq8 *xq;  /* [n_heads, n_in / 32] Q8 blocks of x (blocked formats), or NULL */
    float *y;            /* [n_heads, rows] */
    int rows;            /* rows per head: w->n_out / n_heads */
    int per_head;        /* work items per head */
    int n_items;
    atomic_int next;
} heads_ctx;

static void task_heads(void *p, int ith, int nth) {
    (void)ith;
    (void)nth;
    heads_ctx *c = p;
    const pyrt_matrix *w = c->w;
    const size_t rb = pyrt_row_bytes(w->fmt, w->n_in);
    const size_t nb = pyrt_xq_units((size_t)w->n_in); /* xq's stride */
    for (int item; (item = atomic_fetch_add_explicit(&c->next, 1, memory_order_relaxed)) <
                   c->n_items;) {
        const int h = item / c->per_head;
        const int r0 = (item % c->per_head) * HEAD_CHUNK;
        const int r1 = r0 + HEAD_CHUNK < c->rows ? r0 + HEAD_CHUNK : c->rows;
        const void *xh = c->xq != NULL ? (const void *)(c->xq + (size_t)h * nb)
                                       : (const void *)(c->x + (size_t)h * w->n_in);
        const uint8_t *base = (const uint8_t *)w->data + (size_t)h * c->rows * rb;
        for (int r = r0; r < r1; r++)
            c->y[(size_t)h * c->rows + r] = c->ops->dot(base + (size_t)r * rb, xh, w->n_in);
    }
}

int pyrt_linear_heads(pyrt_pool *pool, const pyrt_matrix *w, int n_heads, const float *x,
                      int64_t x_len, float *y, int64_t y_len) {
    pyrt_clear_error();
    const char *fn = "pyrt_linear_heads";
    if (pool == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: pool is NULL (create one with pyrt_pool_create)", fn);
    int rc = pyrt_matrix_check(w, fn, "w");
    if (rc != PYRT_OK)
        return rc;
    if (n_heads < 1 || w->n_out % n_heads != 0)
        return pyrt_fail(PYRT_E_INVALID, "%s: n_heads %d does not divide w's %d rows", fn,
                         n_heads, w->n_out);
    if (x == NULL || y == NULL)
        return pyrt_fail(PYRT_E_INVALID, "%s: %s is NULL", fn, x == NULL ? "x" : "y");
    if (x_len < (int64_t)n_heads * w->n_in)
        return pyrt_fail(PYRT_E_INVALID, "%s: x holds %lld floats, %d heads of %d need %lld", fn,
                         (long long)x_len, n_heads, w->n_in, (long long)n_heads * w->n_in);
    if (y_len < (int64_t)w->n_out)
        return pyrt_fail(PYRT_E_INVALID, "%s: y holds %lld floats, w's %d rows need as many", fn,
                         (long long)y_len, w->n_out);
    if ((uintptr_t)x % 4 || (uintptr_t)y % 4)
        return pyrt_fail(PYRT_E_INVALID, "%s: x and y must be 4-byte aligned", fn);

    const int rows = w->n_out / n_heads;
    const size_t nb = pyrt_xq_units((size_t)w->n_in); /* xq's stride */
    pyrt_pool_acquire(pool);
    pyrt_xq8 *xq = NULL;
    const int kind = pyrt_fmt_xq(w->fmt);
    if (kind != PYRT_XQ_NONE) {
        xq = pyrt_pool_workspace(pool, (size_t)n_heads * nb * sizeof(pyrt_xq8));
        if (xq == NULL) {
            pyrt_pool_release(pool);
            return pyrt_fail(PYRT_E_NOMEM, "%s: cannot allocate %zu bytes for quantized x", fn,
                             (size_t)n_heads * nb * sizeof(pyrt_xq8));
        }
        for (int h = 0; h < n_heads; h++)
            pyrt_quantize_x_for(kind, x + (size_t)h * w->n_in, xq + (size_t)h * nb, w->n_in);
    }
    heads_ctx c = {
        .w = w,
        .ops = pyrt_pool_row_ops(pool, w->fmt),
        .x = x,
        .xq = xq,
        .y = y,
        .rows = rows,
        .per_head = (rows + HEAD_CHUNK - 1) / HEAD_CHUNK,
    };
    c.n_items = c.per_head * n_heads;
    atomic_init(&c.next, 0);
    pyrt_pool_run(pool, task_heads, &c);
    pyrt_pool_release(pool);
    return PYRT_OK;
}

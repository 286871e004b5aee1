/* What pyrt_quantize_rows (quantize_k.c) and pyrt_dequantize_rows (dequantize_k.c) share: the
 * checks of their arguments and the loop over their super-blocks. Not seen outside them. */
#ifndef PYRT_KQUANT_ROWS_H
#define PYRT_KQUANT_ROWS_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "formats.h"
#include "pool.h"

/* fn's arguments: fmt one of the K-quants (PYRT_E_UNSUPPORTED otherwise), n_rows >= 0 rows of a
 * positive multiple of 256 elements, `bytes` (the size of the quantized buffer, named
 * bytes_name) exactly the rows' size, and where there are rows, src and dst (named) not NULL.
 * Returns PYRT_OK or the failing status with pyrt_last_error() set, naming fn. */
static inline int pyrt_kq_rows_check(const char *fn, int fmt, int64_t n_rows, int64_t n_per_row,
                                     const char *bytes_name, size_t bytes, const void *src,
                                     const char *src_name, const void *dst,
                                     const char *dst_name) {
    if (fmt != PYRT_FMT_Q4_K && fmt != PYRT_FMT_Q5_K && fmt != PYRT_FMT_Q6_K)
        return pyrt_fail(PYRT_E_UNSUPPORTED,
                         "%s: format %d is not one of 12 Q4_K, 13 Q5_K, 14 Q6_K", fn, fmt);
    if (n_rows < 0 || n_per_row <= 0 || n_per_row % PYRT_QK_K)
        return pyrt_fail(PYRT_E_INVALID,
                         "%s: rows of %lld elements x %lld: the row length must be a positive "
                         "multiple of 256",
                         fn, (long long)n_per_row, (long long)n_rows);
    const size_t need = (size_t)n_rows * pyrt_row_bytes(fmt, n_per_row);
    if (bytes != need)
        return pyrt_fail(PYRT_E_INVALID, "%s: %s holds %zu bytes, the rows need %zu", fn,
                         bytes_name, bytes, need);
    if (n_rows > 0 && (src == NULL || dst == NULL))
        return pyrt_fail(PYRT_E_INVALID, "%s: %s is NULL", fn, src ? dst_name : src_name);
    return PYRT_OK;
}

/* task(ctx, i, ith) for each of the n_blocks super-blocks, on the pool's threads (grain at a
 * time) or, without a pool, on the caller's. */
static inline void pyrt_kq_rows_run(pyrt_pool *pool, int64_t n_blocks, int grain,
                                    pyrt_index_fn task, void *ctx) {
    if (pool == NULL) {
        for (int64_t i = 0; i < n_blocks; i++)
            task(ctx, i, 0);
        return;
    }
    pyrt_pool_acquire(pool);
    pyrt_pool_for(pool, n_blocks, grain, task, ctx);
    pyrt_pool_release(pool);
}

#endif /* PYRT_KQUANT_ROWS_H */

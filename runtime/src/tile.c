/* Tiles of rows against tokens (rows.h) with a level's kernels: the tile kernels where the level
 * has them, else the row kernels one dot or axpy at a time (the same bits). */
#include "rows.h"

void pyrt_dot_tile(const pyrt_row_ops *ops, int nr, const void *const *rows, int nt,
                   const void *const *xs, int n, float *out, size_t ts, size_t rs) {
    int r = 0;
    if (ops->dot_tile != NULL)
        for (; r + PYRT_TILE_ROWS <= nr; r += PYRT_TILE_ROWS)
            for (int t = 0; t < nt; t += PYRT_TILE_TOKENS) {
                const int m = nt - t < PYRT_TILE_TOKENS ? nt - t : PYRT_TILE_TOKENS;
                ops->dot_tile(rows + r, m, xs + t, n, out + (size_t)t * ts + (size_t)r * rs, ts,
                              rs);
            }
    for (; ops->dot2 != NULL && r + 2 <= nr; r += 2)
        for (int t = 0; t < nt; t++) {
            float d[2];
            ops->dot2(rows[r], rows[r + 1], xs[t], n, d);
            out[(size_t)t * ts + (size_t)r * rs] = d[0];
            out[(size_t)t * ts + (size_t)(r + 1) * rs] = d[1];
        }
    for (; r < nr; r++)
        for (int t = 0; t < nt; t++)
            out[(size_t)t * ts + (size_t)r * rs] = ops->dot(rows[r], xs[t], n);
}

void pyrt_axpy_tile(const pyrt_row_ops *ops, int nr, const void *const *rows,
                    const float *const *a, int nt, float *const *ys, int n) {
    if (ops->axpy_tile != NULL) {
        for (int t = 0; t < nt; t += PYRT_AXPY_TOKENS) {
            const int m = nt - t < PYRT_AXPY_TOKENS ? nt - t : PYRT_AXPY_TOKENS;
            const float *at[512];
            for (int r0 = 0; r0 < nr; r0 += 512) { /* a[r] + t for a chunk of rows */
                const int k = nr - r0 < 512 ? nr - r0 : 512;
                for (int r = 0; r < k; r++)
                    at[r] = a[r0 + r] + t;
                ops->axpy_tile(k, rows + r0, at, m, ys + t, n);
            }
        }
        return;
    }
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++)
            ops->axpy(a[r][t], rows[r], ys[t], n);
}

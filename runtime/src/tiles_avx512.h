/* The AVX-512 tile kernels (tiles_avx512.c), for the level's tables in rows_avx512.c. */
#ifndef PYRT_TILES_AVX512_H
#define PYRT_TILES_AVX512_H

#include "rows.h"

void pyrt_dot_tile_q8_0(const void *const *rows, int nt, const void *const *xs, int n,
                        float *out, size_t ts, size_t rs);
void pyrt_dot_tile_q8_0_vnni(const void *const *rows, int nt, const void *const *xs, int n,
                             float *out, size_t ts, size_t rs);
void pyrt_dot_tile_q4_0(const void *const *rows, int nt, const void *const *xs, int n,
                        float *out, size_t ts, size_t rs);

void pyrt_axpy_tile_q8_0(int nr, const void *const *rows, const float *const *a, int nt,
                         float *const *ys, int n);
void pyrt_axpy_tile_q4_0(int nr, const void *const *rows, const float *const *a, int nt,
                         float *const *ys, int n);
void pyrt_axpy_tile_f32(int nr, const void *const *rows, const float *const *a, int nt,
                        float *const *ys, int n);
void pyrt_axpy_tile_f16(int nr, const void *const *rows, const float *const *a, int nt,
                        float *const *ys, int n);
void pyrt_axpy_tile_bf16(int nr, const void *const *rows, const float *const *a, int nt,
                         float *const *ys, int n);

#endif /* PYRT_TILES_AVX512_H */

/* AVX2 row kernels for a format of 32-element blocks whose weights unpack to 32 int8 codes with
 * one f32 scale per block and, for some formats, an offset (weight = d * q + m): MXFP4, Q5_0,
 * Q5_1 (rows_mxfp4.c, rows_q5.c). The dots are integer against the activation's Q8 blocks:
 * block b adds d_b * xd_b * (q . xq_b), plus m_b * xd_b * sum(xq_b) with an offset.
 *
 * PYRT_B32_AVX2_KERNELS(name, BYTES, SCALE, MIN, HAS_MIN, UNPACK) defines the static kernels
 * name##_dot ... and `static const pyrt_row_ops name##_ops`: BYTES per block; SCALE(w) the block's
 * d (float), MIN(w) its offset m (float; read only when HAS_MIN is 1), UNPACK(w) its 32 codes
 * (__m256i, int8, elements 0..31 in order), w the block's first byte. Include after
 * <immintrin.h> and rows_x86.h, on x86-64 with GCC or Clang only. */
#ifndef PYRT_ROWS_B32_AVX2_H
#define PYRT_ROWS_B32_AVX2_H

/* 8 int32 lanes summing to the 32 int8 values of x. */
PYRT_X86_AVX2 static inline __m256i sum32_i8(__m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), x),
                             _mm256_set1_epi16(1));
}

/* The 32 codes of a block (from a __m256i of int8) as f32 in four registers. */
PYRT_X86_AVX2 static inline void pyrt_b32_widen(__m256i q, __m256 f[4]) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

#define PYRT_B32_LOAD_X(xb) _mm256_loadu_si256((const __m256i *)(xb))

/* acc += d * xd * (q . x), and with an offset accm += m * xd * sum(x), for block w against the
 * activation block xb (its codes already loaded into xv). */
#define PYRT_B32_BLOCK(acc, accm, w, xb, xv, SCALE, MIN, HAS_MIN, UNPACK)                          \
    do {                                                                                          \
        acc = _mm256_fmadd_ps(_mm256_set1_ps(SCALE(w) * (xb).d),                                  \
                              _mm256_cvtepi32_ps(dot32_i8(UNPACK(w), (xv))), acc);                \
        if (HAS_MIN)                                                                              \
            accm = _mm256_fmadd_ps(_mm256_set1_ps(MIN(w) * (xb).d),                               \
                                   _mm256_cvtepi32_ps(sum32_i8(xv)), accm);                       \
    } while (0)

#define PYRT_B32_AVX2_KERNELS(name, BYTES, SCALE, MIN, HAS_MIN, UNPACK)                           \
    /* Even blocks into acc0, odd ones into acc1 (two chains of FMAs), prefetches spread over  \
     * the block pairs. */                                                                        \
    PYRT_X86_AVX2 static float name##_dot_pf(const void *row, const void *x, int n,               \
                                             const void *const *pf, int n_pf) {                   \
        const uint8_t *w = row;                                                                   \
        const pyrt_xq8 *xq = x;                                                                   \
        const int nb = n / PYRT_QK;                                                               \
        pyrt_pf_spread ps = pyrt_pf_begin(pf, n_pf, nb / 2);                                      \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                            \
        __m256 accm0 = _mm256_setzero_ps(), accm1 = _mm256_setzero_ps();                          \
        int b = 0;                                                                                \
        for (; b + 2 <= nb; b += 2) {                                                             \
            const uint8_t *w0 = w + (size_t)b * (BYTES), *w1 = w0 + (BYTES);                      \
            const __m256i x0 = PYRT_B32_LOAD_X(xq[b].q), x1 = PYRT_B32_LOAD_X(xq[b + 1].q);       \
            PYRT_B32_BLOCK(acc0, accm0, w0, xq[b], x0, SCALE, MIN, HAS_MIN, UNPACK);              \
            PYRT_B32_BLOCK(acc1, accm1, w1, xq[b + 1], x1, SCALE, MIN, HAS_MIN, UNPACK);          \
            pyrt_pf_tick(&ps);                                                                    \
        }                                                                                         \
        if (b < nb) {                                                                             \
            const uint8_t *w0 = w + (size_t)b * (BYTES);                                          \
            const __m256i x0 = PYRT_B32_LOAD_X(xq[b].q);                                          \
            PYRT_B32_BLOCK(acc0, accm0, w0, xq[b], x0, SCALE, MIN, HAS_MIN, UNPACK);              \
        }                                                                                         \
        pyrt_pf_end(&ps);                                                                         \
        __m256 acc = _mm256_add_ps(acc0, acc1);                                                   \
        if (HAS_MIN)                                                                              \
            acc = _mm256_add_ps(acc, _mm256_add_ps(accm0, accm1));                                \
        return hsum8(acc);                                                                        \
    }                                                                                             \
                                                                                                  \
    PYRT_X86_AVX2 static float name##_dot(const void *row, const void *x, int n) {                \
        return name##_dot_pf(row, x, n, NULL, 0);                                                 \
    }                                                                                             \
                                                                                                  \
    /* A neuron's gate and up rows in one pass over x: per row exactly dot_pf's operations in   \
     * its order (the same bits as two dot calls); x's blocks loaded once. */                     \
    PYRT_X86_AVX2 static void name##_dot2_pf(const void *row0, const void *row1, const void *x,   \
                                             int n, float out[2], const void *const *pf,          \
                                             int n_pf) {                                          \
        const uint8_t *wr[2] = {row0, row1};                                                      \
        const pyrt_xq8 *xq = x;                                                                   \
        const int nb = n / PYRT_QK;                                                               \
        pyrt_pf_spread ps = pyrt_pf_begin(pf, n_pf, nb / 2);                                      \
        __m256 acc0[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                              \
        __m256 acc1[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                              \
        __m256 accm0[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                             \
        __m256 accm1[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                             \
        int b = 0;                                                                                \
        for (; b + 2 <= nb; b += 2) {                                                             \
            const __m256i x0 = PYRT_B32_LOAD_X(xq[b].q), x1 = PYRT_B32_LOAD_X(xq[b + 1].q);       \
            for (int r = 0; r < 2; r++) {                                                         \
                const uint8_t *w0 = wr[r] + (size_t)b * (BYTES), *w1 = w0 + (BYTES);              \
                PYRT_B32_BLOCK(acc0[r], accm0[r], w0, xq[b], x0, SCALE, MIN, HAS_MIN, UNPACK);    \
                PYRT_B32_BLOCK(acc1[r], accm1[r], w1, xq[b + 1], x1, SCALE, MIN, HAS_MIN,         \
                               UNPACK);                                                           \
            }                                                                                     \
            pyrt_pf_tick(&ps);                                                                    \
        }                                                                                         \
        if (b < nb) {                                                                             \
            const __m256i x0 = PYRT_B32_LOAD_X(xq[b].q);                                          \
            for (int r = 0; r < 2; r++) {                                                         \
                const uint8_t *w0 = wr[r] + (size_t)b * (BYTES);                                  \
                PYRT_B32_BLOCK(acc0[r], accm0[r], w0, xq[b], x0, SCALE, MIN, HAS_MIN, UNPACK);    \
            }                                                                                     \
        }                                                                                         \
        pyrt_pf_end(&ps);                                                                         \
        for (int r = 0; r < 2; r++) {                                                             \
            __m256 acc = _mm256_add_ps(acc0[r], acc1[r]);                                         \
            if (HAS_MIN)                                                                          \
                acc = _mm256_add_ps(acc, _mm256_add_ps(accm0[r], accm1[r]));                      \
            out[r] = hsum8(acc);                                                                  \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    PYRT_X86_AVX2 static void name##_dot2(const void *row0, const void *row1, const void *x,      \
                                          int n, float out[2]) {                                  \
        name##_dot2_pf(row0, row1, x, n, out, NULL, 0);                                           \
    }                                                                                             \
                                                                                                  \
    /* Several down rows into one y: a block of y (4 registers) loaded once, every row's share  \
     * (a d q, then a m with an offset) added in row order, stored once (the same bits as nr     \
     * axpy calls in order). */                                                                   \
    PYRT_X86_AVX2 static void name##_axpyn_pf(int nr, const float *a, const void *const *rows,    \
                                              float *y, int n, const void *const *pf, int n_pf) { \
        pyrt_pf_spread ps = pyrt_pf_begin(pf, n_pf, n / PYRT_QK);                                 \
        for (int b = 0; b < n / PYRT_QK; b++, y += PYRT_QK) {                                     \
            __m256 acc[4] = {_mm256_loadu_ps(y), _mm256_loadu_ps(y + 8), _mm256_loadu_ps(y + 16), \
                             _mm256_loadu_ps(y + 24)};                                            \
            for (int r = 0; r < nr; r++) {                                                        \
                const uint8_t *w = (const uint8_t *)rows[r] + (size_t)b * (BYTES);                \
                const __m256 vs = _mm256_set1_ps(a[r] * SCALE(w));                                \
                __m256 f[4];                                                                      \
                pyrt_b32_widen(UNPACK(w), f);                                                     \
                for (int p = 0; p < 4; p++)                                                       \
                    acc[p] = _mm256_fmadd_ps(vs, f[p], acc[p]);                                   \
                if (HAS_MIN) {                                                                    \
                    const __m256 vm = _mm256_set1_ps(a[r] * MIN(w));                              \
                    for (int p = 0; p < 4; p++)                                                   \
                        acc[p] = _mm256_add_ps(acc[p], vm);                                       \
                }                                                                                 \
            }                                                                                     \
            for (int p = 0; p < 4; p++)                                                           \
                _mm256_storeu_ps(y + 8 * p, acc[p]);                                              \
            pyrt_pf_tick(&ps);                                                                    \
        }                                                                                         \
        pyrt_pf_end(&ps);                                                                         \
    }                                                                                             \
                                                                                                  \
    PYRT_X86_AVX2 static void name##_axpyn(int nr, const float *a, const void *const *rows,       \
                                           float *y, int n) {                                     \
        name##_axpyn_pf(nr, a, rows, y, n, NULL, 0);                                              \
    }                                                                                             \
                                                                                                  \
    PYRT_X86_AVX2 static void name##_axpy(float a, const void *row, float *y, int n) {            \
        name##_axpyn_pf(1, &a, &row, y, n, NULL, 0);                                              \
    }                                                                                             \
                                                                                                  \
    static const pyrt_row_ops name##_ops = {                                                      \
        .dot = name##_dot,       .axpy = name##_axpy,       .dot2 = name##_dot2,                  \
        .axpyn = name##_axpyn,   .dot_pf = name##_dot_pf,   .dot2_pf = name##_dot2_pf,            \
        .axpyn_pf = name##_axpyn_pf};

#endif

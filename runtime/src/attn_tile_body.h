/* The body of one SIMD level's tile kernel (attn_tile.h), written once with GCC/Clang vector
 * extensions and included by attn_tile.c per level with:
 *   ATT_W       floats per vector (16: AVX-512, 8: AVX2, 4: baseline)
 *   ATT_TARGET  the level's function attribute (empty for baseline)
 *   ATT(name)   the level's name for `name`
 * Loads and stores go through memcpy (unaligned rows); a head_dim that is not a multiple of
 * ATT_W ends in a scalar tail. Scratch: s [ROWS, KB] scores then probabilities, o [ROWS, hd]. */

typedef float ATT(vf) __attribute__((vector_size(ATT_W * 4)));
typedef int ATT(vi) __attribute__((vector_size(ATT_W * 4)));

ATT_TARGET static inline ATT(vf) ATT(ld)(const float *p) {
    ATT(vf) v;
    memcpy(&v, p, sizeof v);
    return v;
}

ATT_TARGET static inline void ATT(st)(float *p, ATT(vf) v) { memcpy(p, &v, sizeof v); }

ATT_TARGET static inline ATT(vf) ATT(splat)(float x) {
    ATT(vf) v = {0};
    return v + x;
}

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define ATT_SHUFFLE 1
#endif
#endif
#ifndef ATT_SHUFFLE
#define ATT_SHUFFLE 0
#endif

typedef float ATT(v4) __attribute__((vector_size(16)));
typedef float ATT(v8) __attribute__((vector_size(32)));

/* Sum of the lanes, pairwise by halves (lane i + lane i + W/2, ...): in registers, and the same
 * order for every row whatever its tile. */
ATT_TARGET static inline float ATT(hsum)(ATT(vf) v) {
#if ATT_SHUFFLE && ATT_W == 16
    const ATT(v8) h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                      __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const ATT(v4) s = __builtin_shufflevector(h, h, 0, 1, 2, 3) +
                      __builtin_shufflevector(h, h, 4, 5, 6, 7);
#elif ATT_SHUFFLE && ATT_W == 8
    const ATT(v4) s = __builtin_shufflevector(v, v, 0, 1, 2, 3) +
                      __builtin_shufflevector(v, v, 4, 5, 6, 7);
#elif ATT_W == 16
    const union {
        ATT(vf) v;
        ATT(v8) h[2];
    } a = {v};
    const union {
        ATT(v8) v;
        ATT(v4) h[2];
    } b = {a.h[0] + a.h[1]};
    const ATT(v4) s = b.h[0] + b.h[1];
#elif ATT_W == 8
    const union {
        ATT(vf) v;
        ATT(v4) h[2];
    } b = {v};
    const ATT(v4) s = b.h[0] + b.h[1];
#else
    const ATT(v4) s = v;
#endif
    return (s[0] + s[2]) + (s[1] + s[3]);
}

ATT_TARGET static inline float ATT(hmax)(ATT(vf) v) {
    float t[ATT_W];
    memcpy(t, &v, sizeof v);
    for (int w = ATT_W / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++)
            t[i] = t[i] > t[i + w] ? t[i] : t[i + w];
    return t[0];
}

/* exp(x) for x <= 0 (x = -inf included: 0); below -87 it is 0. Cephes' expf: x = n ln2 + r,
 * |r| <= ln2 / 2, a degree-6 polynomial in r, times 2^n by the exponent bits (~1 ulp). */
ATT_TARGET static inline ATT(vf) ATT(vexp)(ATT(vf) x) {
    const ATT(vi) keep = x > -87.0f;
    const ATT(vf) lo = ATT(splat)(-87.0f);
    x = (ATT(vf))(((ATT(vi))x & keep) | ((ATT(vi))lo & ~keep));
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const ATT(vf) t = x * 1.44269504088896341f + magic;
    const ATT(vi) n = (ATT(vi))t - (ATT(vi))ATT(splat)(magic);
    const ATT(vf) fn = t - magic;
    const ATT(vf) r = x - fn * 0.693359375f - fn * -2.12194440e-4f;
    ATT(vf) p = 1.9875691500E-4f * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * (r * r) + r + 1.0f;
    return (ATT(vf))(((ATT(vi))p + (n << 23)) & keep);
}

/* Positions [j, j + n) (up to position last) of the keys and values toward L2: a decode step's
 * cache has left every cache since the previous step (a step streams the weights). The QK pass
 * of a block's first rows fetches the next block's rows as it goes, KB positions ahead. */
ATT_TARGET static inline void ATT(prefetch)(const pyrt_attn_tile *t, int j, int n, int last) {
    if (j + n > last + 1)
        n = last + 1 - j;
    if (n <= 0)
        return;
    const size_t bytes = (size_t)n * t->hd * sizeof(float);
    const char *k = (const char *)(t->k + (size_t)j * t->hd);
    const char *v = (const char *)(t->v + (size_t)j * t->hd);
    for (size_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(k + off, 0, 2);
        __builtin_prefetch(v + off, 0, 2);
    }
}

/* One row streaming its keys (ATT(attn_tile)'s stream pass): keys 16 positions ahead into L1,
 * the values of the same positions into L2 (the first 2,048: a longer context's would not fit). */
ATT_TARGET static inline void ATT(prefetch_stream)(const pyrt_attn_tile *t, int j, int start,
                                                   int last) {
    j += 16;
    const int n = last + 1 - j < 2 ? last + 1 - j : 2;
    const size_t bytes = n > 0 ? (size_t)n * t->hd * sizeof(float) : 0;
    const char *k = (const char *)(t->k + (size_t)j * t->hd);
    const char *v = (const char *)(t->v + (size_t)j * t->hd);
    for (size_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(k + off, 0, 3);
        if (j - start < 2048)
            __builtin_prefetch(v + off, 0, 2);
    }
}

/* s[r][j] = (q_r . k_{j0+j}) * scale for the rows r0 .. r0+NR-1 and nb keys, two keys per pass
 * (each q chunk loaded once for both; 2 NR independent sums). */
#define ATT_QK(NR)                                                                                \
    for (int j = 0; j < nb; j += 2) {                                                             \
        const int two = j + 1 < nb;                                                               \
        if (stream)                                                                               \
            ATT(prefetch_stream)(t, j0 + j, start, last);                                         \
        else if (r0 == 0)                                                                         \
            ATT(prefetch)(t, j0 + PYRT_ATTN_KB + j, 2, last);                                     \
        const float *k0 = t->k + (size_t)(j0 + j) * hd, *k1 = two ? k0 + hd : k0;                \
        ATT(vf) acc0[NR], acc1[NR];                                                               \
        for (int i = 0; i < NR; i++)                                                              \
            acc0[i] = acc1[i] = ATT(splat)(0.0f);                                                 \
        int c = 0;                                                                                \
        for (; c + ATT_W <= hd; c += ATT_W) {                                                     \
            const ATT(vf) ka = ATT(ld)(k0 + c), kb = ATT(ld)(k1 + c);                             \
            for (int i = 0; i < NR; i++) {                                                        \
                const ATT(vf) qv = ATT(ld)(t->q[r0 + i] + c);                                     \
                acc0[i] += qv * ka;                                                               \
                acc1[i] += qv * kb;                                                               \
            }                                                                                     \
        }                                                                                         \
        for (int i = 0; i < NR; i++) {                                                            \
            float x0 = ATT(hsum)(acc0[i]), x1 = ATT(hsum)(acc1[i]);                               \
            for (int e = c; e < hd; e++) {                                                        \
                x0 += t->q[r0 + i][e] * k0[e];                                                    \
                x1 += t->q[r0 + i][e] * k1[e];                                                    \
            }                                                                                     \
            float *sr = sb + (size_t)(r0 + i) * PYRT_ATTN_KB + j;                                 \
            sr[0] = x0 * t->scale;                                                                \
            if (two)                                                                              \
                sr[1] = x1 * t->scale;                                                            \
        }                                                                                         \
    }

/* o[r] += sum_j p[r][j] v_{j0+j} for the rows r0 .. r0+NR-1. */
#define ATT_PV(NR)                                                                                \
    {                                                                                             \
        int c = 0;                                                                                \
        for (; c + ATT_W <= hd; c += ATT_W) {                                                     \
            ATT(vf) acc[NR];                                                                      \
            for (int i = 0; i < NR; i++)                                                          \
                acc[i] = ATT(ld)(o + (size_t)(r0 + i) * hd + c);                                  \
            for (int j = 0; j < nb; j++) {                                                        \
                const ATT(vf) vv = ATT(ld)(t->v + (size_t)(j0 + j) * hd + c);                     \
                for (int i = 0; i < NR; i++)                                                      \
                    acc[i] += sb[(size_t)(r0 + i) * PYRT_ATTN_KB + j] * vv;                       \
            }                                                                                     \
            for (int i = 0; i < NR; i++)                                                          \
                ATT(st)(o + (size_t)(r0 + i) * hd + c, acc[i]);                                   \
        }                                                                                         \
        for (; c < hd; c++)                                                                       \
            for (int i = 0; i < NR; i++) {                                                        \
                float x = o[(size_t)(r0 + i) * hd + c];                                           \
                for (int j = 0; j < nb; j++)                                                      \
                    x += sb[(size_t)(r0 + i) * PYRT_ATTN_KB + j] * t->v[(size_t)(j0 + j) * hd + c]; \
                o[(size_t)(r0 + i) * hd + c] = x;                                                 \
            }                                                                                     \
    }

/* ATT_PV(1) row by row over the values (a decode step's row: its values stream from L2 or
 * DRAM), up to 8 vectors of o in registers: per element of o the same sums in the same order. */
#define ATT_PV_ROW                                                                                \
    {                                                                                             \
        const float *pr = sb + (size_t)r0 * PYRT_ATTN_KB;                                         \
        float *orow = o + (size_t)r0 * hd;                                                        \
        int c0 = 0;                                                                               \
        for (; c0 + ATT_W <= hd; c0 += 8 * ATT_W) {                                               \
            const int nv = (hd - c0) / ATT_W < 8 ? (hd - c0) / ATT_W : 8;                         \
            ATT(vf) acc[8];                                                                       \
            for (int u = 0; u < nv; u++)                                                          \
                acc[u] = ATT(ld)(orow + c0 + u * ATT_W);                                          \
            for (int j = 0; j < nb; j++) {                                                        \
                const float *vj = t->v + (size_t)(j0 + j) * hd + c0;                              \
                for (int u = 0; u < nv; u++)                                                      \
                    acc[u] += pr[j] * ATT(ld)(vj + u * ATT_W);                                    \
            }                                                                                     \
            for (int u = 0; u < nv; u++)                                                          \
                ATT(st)(orow + c0 + u * ATT_W, acc[u]);                                           \
        }                                                                                         \
        for (int c = hd - hd % ATT_W; c < hd; c++) {                                              \
            float x = orow[c];                                                                    \
            for (int j = 0; j < nb; j++)                                                          \
                x += pr[j] * t->v[(size_t)(j0 + j) * hd + c];                                     \
            orow[c] = x;                                                                          \
        }                                                                                         \
    }

ATT_TARGET static void ATT(attn_tile)(const pyrt_attn_tile *t) {
    const int hd = t->hd, n = t->n_rows;
    float *s = t->scratch, *o = t->scratch + (size_t)PYRT_ATTN_ROWS * PYRT_ATTN_KB;
    (void)s;
    float m[PYRT_ATTN_ROWS], l[PYRT_ATTN_ROWS];
    int lo[PYRT_ATTN_ROWS];
    int first = t->pos[0], last = t->pos[0];
    for (int r = 0; r < n; r++) {
        const int p = t->pos[r];
        lo[r] = t->chunk > 0                        ? p - p % t->chunk
                : t->window > 0 && p + 1 > t->window ? p + 1 - t->window
                                                     : 0;
        first = lo[r] < first ? lo[r] : first;
        last = p > last ? p : last;
        m[r] = t->has_sink ? t->sink[r] : -INFINITY;
        l[r] = t->has_sink ? 1.0f : 0.0f;
        memset(o + (size_t)r * hd, 0, (size_t)hd * sizeof *o);
    }
    /* blocks at multiples of KB whatever the tile: a row's bits do not depend on its tile */
    const int start = first - first % PYRT_ATTN_KB;
    /* one row with room for all its scores: every block's QK first, a stream over the keys (a
     * decode step's cache comes from DRAM), then the blocks' softmax and PV in the same order:
     * the same operations as the tiled path */
    const int stream = n == 1 && t->stream != NULL;
    int r0 = 0;
    if (stream) {
        for (int j = start - 16; j < start; j += 2) /* the first 16 keys */
            ATT(prefetch_stream)(t, j, start, last);
        for (int j0 = start; j0 <= last; j0 += PYRT_ATTN_KB) {
            const int nb = last + 1 - j0 < PYRT_ATTN_KB ? last + 1 - j0 : PYRT_ATTN_KB;
            float *sb = t->stream + (j0 - start);
            ATT_QK(1)
        }
    } else {
        ATT(prefetch)(t, start, PYRT_ATTN_KB, last);
    }
    for (int j0 = start; j0 <= last; j0 += PYRT_ATTN_KB) {
        const int nb = last + 1 - j0 < PYRT_ATTN_KB ? last + 1 - j0 : PYRT_ATTN_KB;
        float *sb = stream ? t->stream + (j0 - start) : s;
        r0 = 0;
        if (!stream) {
            for (; r0 + 4 <= n; r0 += 4)
                ATT_QK(4)
            for (; r0 < n; r0++)
                ATT_QK(1)
        }
        /* the mask, the online softmax's update; sb becomes the block's probabilities */
        for (int r = 0; r < n; r++) {
            float *sr = sb + (size_t)r * PYRT_ATTN_KB;
            const int a = lo[r] - j0, b = t->pos[r] + 1 - j0; /* row r's keys: [a, b) */
            for (int j = 0; j < a && j < nb; j++)
                sr[j] = -INFINITY;
            for (int j = b > 0 ? b : 0; j < PYRT_ATTN_KB; j++) /* past the row's position */
                sr[j] = -INFINITY;
            ATT(vf) mx = ATT(ld)(sr);
            for (int j = ATT_W; j < PYRT_ATTN_KB; j += ATT_W) {
                const ATT(vf) x = ATT(ld)(sr + j);
                const ATT(vi) gt = x > mx;
                mx = (ATT(vf))(((ATT(vi))x & gt) | ((ATT(vi))mx & ~gt));
            }
            const float bm = ATT(hmax)(mx), mn = bm > m[r] ? bm : m[r];
            if (mn == -INFINITY) { /* no key of this row yet */
                memset(sr, 0, PYRT_ATTN_KB * sizeof *sr);
                continue;
            }
            const float corr = expf(m[r] - mn);
            ATT(vf) sum = ATT(splat)(0.0f);
            for (int j = 0; j < PYRT_ATTN_KB; j += ATT_W) {
                const ATT(vf) p = ATT(vexp)(ATT(ld)(sr + j) - mn);
                ATT(st)(sr + j, p);
                sum += p;
            }
            l[r] = l[r] * corr + ATT(hsum)(sum);
            m[r] = mn;
            if (corr != 1.0f) {
                float *orow = o + (size_t)r * hd;
                for (int c = 0; c < hd; c++)
                    orow[c] *= corr;
            }
        }
        r0 = 0;
        for (; r0 + 4 <= n; r0 += 4)
            ATT_PV(4)
        for (; r0 < n; r0++)
            ATT_PV_ROW
    }
    for (int r = 0; r < n; r++) {
        const float inv = 1.0f / l[r];
        for (int c = 0; c < hd; c++)
            t->out[r][c] = o[(size_t)r * hd + c] * inv;
    }
}

#undef ATT_QK
#undef ATT_SHUFFLE
#undef ATT_PV
#undef ATT_PV_ROW

/* K-quant row kernels on AVX-512 (Q4_K, Q5_K, Q6_K; F + BW, and VNNI where the CPU has it):
 * the super-block layouts are rows_kquant.c's. Rows are a multiple of 256 elements.
 *
 * Dots: two sub-blocks of 32 per 512-bit step (a "pair", against the activation's Q8 blocks of
 * the same sub-blocks, which share a scale per super-block: pyrt_quantize_x_q8k), their codes
 * unpacked as uint8 and multiplied with x's int8 per 4 codes into int32 (vpdpbusd, or vpmaddubsw
 * + vpmaddwd: the same numbers), two pairs' sums packed to int16 (vpackssdw; each <= 4 * 63 *
 * 127: no saturation) and times their sub-blocks' scales summed in int32 by vpdpwssd (or
 * vpmaddwd + vpaddd): per 128 codes 2 + 1 multiplies and one scale shuffle, not 2 + 2 and two.
 * The mins (Q6_K: the -32 offset) meet x's sums per 16 (pyrt_xq_sums) in one vpmaddwd per
 * super-block; a super-block's integers meet d, dmin and x's scale once, in f32.
 * One function computes a block of rows x tokens (1 x 1: dot, 2 x 1: dot2, 4 x 2: the prefill
 * tiles), each result with the same operations in the same order: a tile's results are the
 * dots' bits; dot_pf / dot2_pf spread their prefetch lines over the super-blocks.
 * axpy: 16 codes widened to int32 per step (from the bytes, no cross-lane shuffles), y held in
 * registers across up to PYRT_AXPY_ROWS rows (axpyn), each row's operations those of axpy; the
 * axpy tile (several tokens) converts a row's codes once for all its tokens. */
#include "rows.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "blocks_avx512.h"
#include "blocks_kquant_avx512.h"
#include "blocks_kquant_x86.h"

#define D(w) _cvtsh_ss(pyrt_load_u16(w))
#define INLINE __attribute__((always_inline)) inline

enum { KQ_ROWS = 4, KQ_TOKENS = 2 };

/* ---- pieces -------------------------------------------------------------------------------- */

/* x's Q8 blocks 2k and 2k + 1 as one vector. */
AVX512 static INLINE __m512i x_pair(const pyrt_xq8 *xq, int k) {
    return join256(_mm256_loadu_si256((const __m256i *)xq[2 * k].q),
                   _mm256_loadu_si256((const __m256i *)xq[2 * k + 1].q));
}

/* x's Q8 blocks a and a + 2 as one vector (the Q4_K / Q5_K pairs: split_first). */
AVX512 static INLINE __m512i x_split(const pyrt_xq8 *xq, int a) {
    return join256(_mm256_loadu_si256((const __m256i *)xq[a].q),
                   _mm256_loadu_si256((const __m256i *)xq[a + 2].q));
}

/* Q6_K's 16 scales times d (lanes 0..15, one per 16 elements). */
AVX512 static INLINE __m512 scales_q6_k(const uint8_t *w) {
    const __m128i sc = _mm_loadu_si128((const __m128i *)(w + 192));
    return _mm512_mul_ps(_mm512_set1_ps(D(w + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
}

/* vpshufb indices for the Q6_K scales of pairs k, k + 1 (k even) after vpackssdw of their per-4
 * sums: 128-bit lane L holds (dwords 0, 1) sub-block 4k + L, (dwords 2, 3) 4k + 4 + L, so from
 * scales 4k .. 4k + 7 as int16 in every 128-bit lane (words 0..7) words L and 4 + L, each in both
 * int16 halves of its dwords. */
AVX512 static INLINE __m512i pick_q6(void) {
#define KQ_W2(i) ((int)((unsigned)(2 * (i)) | (unsigned)(2 * (i) + 1) << 8 |                        \
                        (unsigned)(2 * (i)) << 16 | (unsigned)(2 * (i) + 1) << 24))
    const int a0 = KQ_W2(0), a1 = KQ_W2(1), a2 = KQ_W2(2), a3 = KQ_W2(3);
    const int b0 = KQ_W2(4), b1 = KQ_W2(5), b2 = KQ_W2(6), b3 = KQ_W2(7);
#undef KQ_W2
    return _mm512_setr_epi32(a0, a0, b0, b0, a1, a1, b1, b1, a2, a2, b2, b2, a3, a3, b3, b3);
}

/* vpshufb indices that give pyrt_kq_mins16 (the mins m_j, bytes 8..15 of every 128-bit lane,
 * each twice as int16) in the low 256 bits. */
AVX512 static INLINE __m512i pick_mins(void) {
#define KQ_M2(j) ((int)(0x80008000u | (unsigned)(8 + (j)) | (unsigned)(8 + (j)) << 16))
    const int m0 = KQ_M2(0), m1 = KQ_M2(1), m2 = KQ_M2(2), m3 = KQ_M2(3);
    const int m4 = KQ_M2(4), m5 = KQ_M2(5), m6 = KQ_M2(6), m7 = KQ_M2(7);
#undef KQ_M2
    return _mm512_setr_epi32(m0, m1, m2, m3, m4, m5, m6, m7, m0, m1, m2, m3, m4, m5, m6, m7);
}

/* vpshufb indices for the scales of the Q4_K / Q5_K pairs k, k + 1 after vpackssdw
 * of their per-4 sums: every int32 lane holds two int16 sums of one sub-block, and its 128-bit
 * lane L holds (dwords 0, 1) sub-block a_k + 2 (L / 2), (dwords 2, 3) a_{k+1} + 2 (L / 2), so
 * the indices give that sub-block's scale, zero-extended, in both int16 halves (bytes sc_j at
 * j of every 128-bit lane of the source). */
AVX512 static INLINE __m512i pick_quad(int k) {
    const int a = split_first(k), b = split_first(k + 1);
#define KQ_SC16(j) ((int)(0x80008000u | (unsigned)(j) | (unsigned)(j) << 16))
    const int la = KQ_SC16(a), lb = KQ_SC16(b), ha = KQ_SC16(a + 2), hb = KQ_SC16(b + 2);
#undef KQ_SC16
    return _mm512_setr_epi32(la, la, lb, lb, la, la, lb, lb, ha, ha, hb, hb, ha, ha, hb, hb);
}

/* acc + the int16 pairs of a times those of b, summed per int32 lane. */
#define KQ_PAIRS_BW(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16((a), (b)))
#define KQ_PAIRS_VNNI(acc, a, b) _mm512_dpwssd_epi32((acc), (a), (b))

/* The uint8 bytes of u times the int8 bytes of x, summed per 4 into int32 lanes (vpdpbusd, or
 * vpmaddubsw and vpmaddwd by 1: the same numbers, |each int16 pair| <= 2 * 63 * 127). */
#define KQ_QUADS_BW(u, x) _mm512_madd_epi16(_mm512_maddubs_epi16((u), (x)), _mm512_set1_epi16(1))
#define KQ_QUADS_VNNI(u, x) _mm512_dpbusd_epi32(_mm512_setzero_si512(), (u), (x))

/* ---- dots ----------------------------------------------------------------------------------
 * out[t * ts + r * rs] = rows[r] . xs[t] for r < nr <= KQ_ROWS, t < nt <= KQ_TOKENS; fmt and the
 * counts are constants where it is inlined, and the loops over them unroll (rolled, the arrays
 * of registers indexed by r and t lived in memory: ~1.5x the time). x's 8 blocks of a super-block
 * share one scale xd (pyrt_quantize_x_q8k), so a super-block's sum is integer up to d xd:
 *   Q4_K / Q5_K: acc_i += sc_j (q . x) per two pairs (split_first's: sub-blocks a, a + 2 in one
 *                64-byte piece of the codes; per-4 sums packed to int16, times sc_j), the scales
 *                spread over the lanes by vpshufb (in-lane) from a copy in each 128-bit lane; the
 *                min term sum_j m_j sum(x_j) one vpmaddwd of the mins with x's 16 sums per 16
 *                (pyrt_xq_sums); then acc += (d xd) acc_i and, in 256-bit registers (port 1 as
 *                well as 0), accm -= (dmin xd) mins, in f32.
 *   Q6_K:        (q + 32) . x per two pairs (elements 64k .. 64k + 127) times the scale of its
 *                16, less 32 sum_i sc_i sum(x_i) (one vpmaddwd with x's sums per 16): exact,
 *                acc += (d xd) acc_i. */
#define KQ_DOTS(SUF, TGT, PAIRS, QUADS)                                                            \
    TGT static INLINE void dots_##SUF(int fmt, int nr, const void *const *rows, int nt,            \
                                      const void *const *xs, int n, float *out, size_t ts,         \
                                      size_t rs, const void *const *pf, int n_pf) {                \
        const size_t bb = fmt == PYRT_FMT_Q4_K   ? PYRT_Q4_K_BYTES                                 \
                          : fmt == PYRT_FMT_Q5_K ? PYRT_Q5_K_BYTES                                 \
                                                 : PYRT_Q6_K_BYTES;                                \
        const int q6 = fmt == PYRT_FMT_Q6_K;                                                       \
        __m512 acc[KQ_ROWS][KQ_TOKENS];                                                            \
        __m256 accm[KQ_ROWS][KQ_TOKENS]; /* Q4_K / Q5_K: the min terms */                          \
        _Pragma("GCC unroll 4") for (int r = 0; r < nr; r++)                                       \
            _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++) {                                 \
                acc[r][t] = _mm512_setzero_ps();                                                   \
                accm[r][t] = _mm256_setzero_ps();                                                  \
            }                                                                                      \
        pyrt_pf_spread spread = pyrt_pf_begin(pf, n_pf, n / PYRT_QK_K);                            \
        for (int s = 0; s < n / PYRT_QK_K; s++) {                                                  \
            const uint8_t *w[KQ_ROWS];                                                             \
            const pyrt_xq8 *xq[KQ_TOKENS];                                                         \
            __m512i sp[KQ_ROWS][2], ai[KQ_ROWS][KQ_TOKENS];                                        \
            __m256i m16[KQ_ROWS], bs[KQ_TOKENS]; /* mins (Q6_K: scales) per 16, x's sums */        \
            __m128i head[KQ_ROWS];                /* Q4_K / Q5_K: d, dmin and the scale bytes */   \
            _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++) {                                 \
                xq[t] = (const pyrt_xq8 *)xs[t] + 8 * s;                                           \
                bs[t] = _mm256_loadu_si256((const __m256i *)(pyrt_xq_sums(xs[t], n) + 16 * s));    \
            }                                                                                      \
            _Pragma("GCC unroll 4") for (int r = 0; r < nr; r++) {                                 \
                w[r] = (const uint8_t *)rows[r] + (size_t)s * bb;                                  \
                if (q6) { /* its 16 scales as int16: 0..7 in every 128-bit lane, 8..15 */          \
                    m16[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[r] + 192))); \
                    sp[r][0] = _mm512_broadcast_i32x4(_mm256_castsi256_si128(m16[r]));             \
                    sp[r][1] = _mm512_broadcast_i32x4(_mm256_extracti128_si256(m16[r], 1));        \
                } else { /* scales (bytes 0..7) and mins (8..15) in every 128-bit lane */          \
                    head[r] = _mm_loadu_si128((const __m128i *)w[r]);                              \
                    const __m128i sm = pyrt_kq_sc_m_from(head[r]);                                 \
                    sp[r][0] = _mm512_broadcast_i32x4(sm);                                         \
                    m16[r] = _mm512_castsi512_si256(_mm512_shuffle_epi8(sp[r][0], pick_mins()));   \
                }                                                                                  \
                _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++)                               \
                    ai[r][t] = _mm512_setzero_si512();                                             \
            }                                                                                      \
            _Pragma("GCC unroll 2") for (int k = 0; k < 4; k += 2) { /* pairs k, k + 1 */          \
                __m512i xv[2][KQ_TOKENS];                                                          \
                _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++) {                             \
                    xv[0][t] = q6 ? x_pair(xq[t], k) : x_split(xq[t], split_first(k));             \
                    xv[1][t] = q6 ? x_pair(xq[t], k + 1) : x_split(xq[t], split_first(k + 1));     \
                }                                                                                  \
                _Pragma("GCC unroll 4") for (int r = 0; r < nr; r++) {                             \
                    const __m512i u0 = q6                      ? codes_q6_k(w[r], k)               \
                                       : fmt == PYRT_FMT_Q4_K ? codes_q4_k_split(w[r], k)          \
                                                              : codes_q5_k_split(w[r], k);         \
                    const __m512i u1 = q6                      ? codes_q6_k(w[r], k + 1)           \
                                       : fmt == PYRT_FMT_Q4_K ? codes_q4_k_split(w[r], k + 1)      \
                                                              : codes_q5_k_split(w[r], k + 1);     \
                    const __m512i scq = q6 ? _mm512_shuffle_epi8(sp[r][k / 2], pick_q6())          \
                                           : _mm512_shuffle_epi8(sp[r][0], pick_quad(k));          \
                    _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++) {                         \
                        const __m512i c0 = QUADS(u0, xv[0][t]);                                    \
                        const __m512i c1 = QUADS(u1, xv[1][t]);                                    \
                        ai[r][t] = PAIRS(ai[r][t], _mm512_packs_epi32(c0, c1), scq);               \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
            _Pragma("GCC unroll 4") for (int r = 0; r < nr; r++) {                                 \
                /* Q4_K / Q5_K: d and dmin as f32 from the head's halves 0 and 1 */                \
                const __m128 dm = q6 ? _mm_set1_ps(D(w[r] + 208)) : _mm_cvtph_ps(head[r]);         \
                _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++) {                             \
                    const __m128 dmx = _mm_mul_ps(dm, _mm_set1_ps(xq[t]->d)); /* d xd, dmin xd */  \
                    const __m256i ms = _mm256_madd_epi16(m16[r], bs[t]);                           \
                    if (q6)                                                                        \
                        ai[r][t] = _mm512_sub_epi32(                                               \
                            ai[r][t], _mm512_slli_epi32(_mm512_zextsi256_si512(ms), 5));           \
                    acc[r][t] = _mm512_fmadd_ps(_mm512_broadcastss_ps(dmx),                        \
                                                _mm512_cvtepi32_ps(ai[r][t]), acc[r][t]);          \
                    if (!q6) /* 256 bits: these also issue on port 1 */                            \
                        accm[r][t] = _mm256_fnmadd_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dmx)), \
                                                      _mm256_cvtepi32_ps(ms), accm[r][t]);         \
                }                                                                                  \
            }                                                                                      \
            pyrt_pf_tick(&spread);                                                                 \
        }                                                                                          \
        pyrt_pf_end(&spread);                                                                      \
        _Pragma("GCC unroll 4") for (int r = 0; r < nr; r++)                                       \
            _Pragma("GCC unroll 4") for (int t = 0; t < nt; t++)                                   \
                out[(size_t)t * ts + (size_t)r * rs] = _mm512_reduce_add_ps(                       \
                    _mm512_add_ps(acc[r][t], _mm512_zextps256_ps512(accm[r][t])));                 \
    }

KQ_DOTS(bw, AVX512, KQ_PAIRS_BW, KQ_QUADS_BW)
KQ_DOTS(vnni, AVX512VNNI, KQ_PAIRS_VNNI, KQ_QUADS_VNNI)

/* dot, dot2 and the dot tile of one format and one kind of lanes. */
#define KQ_DOT_ENTRIES(name, FMT, SUF, TGT)                                                       \
    TGT static float dot_##name##_##SUF(const void *row, const void *x, int n) {                  \
        float out;                                                                                \
        dots_##SUF(FMT, 1, &row, 1, &x, n, &out, 0, 0, NULL, 0);                                  \
        return out;                                                                               \
    }                                                                                             \
    TGT static float dot_pf_##name##_##SUF(const void *row, const void *x, int n,                 \
                                           const void *const *pf, int n_pf) {                     \
        float out;                                                                                \
        dots_##SUF(FMT, 1, &row, 1, &x, n, &out, 0, 0, pf, n_pf);                                 \
        return out;                                                                               \
    }                                                                                             \
    TGT static void dot2_##name##_##SUF(const void *row0, const void *row1, const void *x, int n, \
                                        float out[2]) {                                           \
        const void *rows[2] = {row0, row1};                                                       \
        dots_##SUF(FMT, 2, rows, 1, &x, n, out, 0, 1, NULL, 0);                                   \
    }                                                                                             \
    TGT static void dot2_pf_##name##_##SUF(const void *row0, const void *row1, const void *x,     \
                                           int n, float out[2], const void *const *pf,            \
                                           int n_pf) {                                            \
        const void *rows[2] = {row0, row1};                                                       \
        dots_##SUF(FMT, 2, rows, 1, &x, n, out, 0, 1, pf, n_pf);                                  \
    }                                                                                             \
    TGT static void dot_tile_##name##_##SUF(const void *const *rows, int nt,                      \
                                            const void *const *xs, int n, float *out, size_t ts,  \
                                            size_t rs) {                                          \
        int t = 0;                                                                                \
        for (; t + KQ_TOKENS <= nt; t += KQ_TOKENS)                                               \
            dots_##SUF(FMT, PYRT_TILE_ROWS, rows, KQ_TOKENS, xs + t, n, out + (size_t)t * ts, ts, \
                       rs, NULL, 0);                                                              \
        if (t < nt)                                                                               \
            dots_##SUF(FMT, PYRT_TILE_ROWS, rows, 1, xs + t, n, out + (size_t)t * ts, ts, rs,     \
                       NULL, 0);                                                                  \
    }

KQ_DOT_ENTRIES(q4_k, PYRT_FMT_Q4_K, bw, AVX512)
KQ_DOT_ENTRIES(q5_k, PYRT_FMT_Q5_K, bw, AVX512)
KQ_DOT_ENTRIES(q6_k, PYRT_FMT_Q6_K, bw, AVX512)
KQ_DOT_ENTRIES(q4_k, PYRT_FMT_Q4_K, vnni, AVX512VNNI)
KQ_DOT_ENTRIES(q5_k, PYRT_FMT_Q5_K, vnni, AVX512VNNI)
KQ_DOT_ENTRIES(q6_k, PYRT_FMT_Q6_K, vnni, AVX512VNNI)

/* ---- axpy ----------------------------------------------------------------------------------
 * Per sub-block pair k of each super-block, y's 64 floats (4 registers) are loaded once, each
 * row's 64 weights added in row order (16 codes widened from 16 bytes per step), stored once. */

/* Bit j of each int32 lane as 16 (j in 0..7). */
AVX512 static INLINE __m512i bit_as_16(__m512i v, int j) {
    const __m512i moved = j <= 4 ? _mm512_slli_epi32(v, 4 - j) : _mm512_srli_epi32(v, j - 4);
    return _mm512_and_si512(moved, _mm512_set1_epi32(16));
}

/* The 64 codes of pair k as int32 in 4 registers, q[i] for y[64 k + 16 i ..]: elements 0..15,
 * 16..31 of sub-block 2k, then of 2k + 1 (Q6_K: q - 32). */
AVX512 static INLINE void wide_codes(int fmt, const uint8_t *w, int k, __m512i q[4]) {
    const __m512i m4 = _mm512_set1_epi32(0x0F);
    if (fmt == PYRT_FMT_Q6_K) { /* the dots' 64 codes (q + 32), less 32, widened 16 at a time */
        const __m512i c = _mm512_sub_epi8(codes_q6_k(w, k), _mm512_set1_epi8(32));
        q[0] = _mm512_cvtepi8_epi32(_mm512_castsi512_si128(c));
        q[1] = _mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(c, 1));
        q[2] = _mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(c, 2));
        q[3] = _mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(c, 3));
        return;
    }
    const uint8_t *qs = w + (fmt == PYRT_FMT_Q4_K ? 16 : 48) + 32 * k;
    for (int i = 0; i < 2; i++) { /* elements 16 i .. 16 i + 15 of both sub-blocks */
        const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16 * i)));
        q[i] = _mm512_and_si512(raw, m4);
        q[2 + i] = _mm512_srli_epi32(raw, 4);
        if (fmt == PYRT_FMT_Q5_K) { /* bit j of qh[l] as 16 */
            const __m512i qh =
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 16 + 16 * i)));
            q[i] = _mm512_or_si512(q[i], bit_as_16(qh, 2 * k));
            q[2 + i] = _mm512_or_si512(q[2 + i], bit_as_16(qh, 2 * k + 1));
        }
    }
}

/* y[0:n) += a[r] rows[r] for r < nr in order; nr = 1: axpy. Per row and sub-block j the weight
 * times a is vs q - vm (vs = a (d sc_j), vm = a (dmin m_j); Q6_K: vs = a (d sc), vm = 0), added as
 * y = fma(vs, q, y) - vm; Q4_K: as y + T[q], T the sub-block's 16 values fma(vs, q, -vm), one
 * vpermps per 16 codes instead of a conversion, an FMA and a subtraction (in cache, rows of 2048:
 * 1.2x). The scales of a super-block's rows made once, 8 (16) at a time. */
AVX512 static INLINE void axpyn_k(int fmt, int nr, const float *a, const void *const *rows,
                                  float *y, int n) {
    const size_t bb = fmt == PYRT_FMT_Q4_K   ? PYRT_Q4_K_BYTES
                      : fmt == PYRT_FMT_Q5_K ? PYRT_Q5_K_BYTES
                                             : PYRT_Q6_K_BYTES;
    float vs[PYRT_AXPY_ROWS][16], vm[PYRT_AXPY_ROWS][8]; /* a vs_j (Q6_K: per 16), a vm_j */
    for (int s = 0; s < n / PYRT_QK_K; s++) {
        for (int r = 0; r < nr; r++) {
            const uint8_t *w = (const uint8_t *)rows[r] + (size_t)s * bb;
            const __m512 va = _mm512_set1_ps(a[r]);
            if (fmt == PYRT_FMT_Q6_K) {
                _mm512_storeu_ps(vs[r], _mm512_mul_ps(va, scales_q6_k(w)));
            } else {
                __m256 dsc, dm;
                pyrt_kq_scales_mins(w, &dsc, &dm);
                _mm256_storeu_ps(vs[r], _mm256_mul_ps(_mm512_castps512_ps256(va), dsc));
                _mm256_storeu_ps(vm[r], _mm256_mul_ps(_mm512_castps512_ps256(va), dm));
            }
        }
        _Pragma("GCC unroll 4") for (int k = 0; k < 4; k++) {
            float *yk = y + (size_t)s * PYRT_QK_K + 64 * k;
            __m512 acc[4];
            for (int i = 0; i < 4; i++)
                acc[i] = _mm512_loadu_ps(yk + 16 * i);
            for (int r = 0; r < nr; r++) {
                const uint8_t *w = (const uint8_t *)rows[r] + (size_t)s * bb;
                if (fmt == PYRT_FMT_Q4_K) { /* the 16 values a vs q - vm, looked up per code */
                    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                       13, 14, 15);
                    const __m512 t0 = _mm512_fmadd_ps(_mm512_set1_ps(vs[r][2 * k]), iota,
                                                      _mm512_set1_ps(-vm[r][2 * k]));
                    const __m512 t1 = _mm512_fmadd_ps(_mm512_set1_ps(vs[r][2 * k + 1]), iota,
                                                      _mm512_set1_ps(-vm[r][2 * k + 1]));
                    for (int i = 0; i < 2; i++) { /* vpermps reads an index's low 4 bits */
                        const __m512i raw = _mm512_cvtepu8_epi32(
                            _mm_loadu_si128((const __m128i *)(w + 16 + 32 * k + 16 * i)));
                        acc[i] = _mm512_add_ps(acc[i], _mm512_permutexvar_ps(raw, t0));
                        acc[2 + i] = _mm512_add_ps(
                            acc[2 + i], _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), t1));
                    }
                    continue;
                }
                __m512i q[4];
                wide_codes(fmt, w, k, q);
                for (int i = 0; i < 4; i++) { /* y[16 i ..]: sub-block 2k + i / 2 */
                    const float si = fmt == PYRT_FMT_Q6_K ? vs[r][4 * k + i] : vs[r][2 * k + i / 2];
                    acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(si), _mm512_cvtepi32_ps(q[i]), acc[i]);
                    if (fmt != PYRT_FMT_Q6_K)
                        acc[i] = _mm512_sub_ps(acc[i], _mm512_set1_ps(vm[r][2 * k + i / 2]));
                }
            }
            for (int i = 0; i < 4; i++)
                _mm512_storeu_ps(yk + 16 * i, acc[i]);
        }
    }
}

/* ys[t][0:n) += sum_r a[r][t] rows[r] for t < nt <= PYRT_AXPY_TOKENS, r < nr in order (the
 * prefill's expert down rows): per token axpy's operations, so its bits, but a row's 64 codes of
 * a pair converted to f32 once and used for every token, not decoded again per token. Q4_K's
 * T[q] = fma(vs, q, -vm) is computed from the converted code (the value axpy looks up). */
AVX512 static INLINE void axpy_tile_k(int fmt, int nr, const void *const *rows,
                                      const float *const *a, int nt, float *const *ys, int n) {
    const size_t bb = fmt == PYRT_FMT_Q4_K   ? PYRT_Q4_K_BYTES
                      : fmt == PYRT_FMT_Q5_K ? PYRT_Q5_K_BYTES
                                             : PYRT_Q6_K_BYTES;
    float vs[PYRT_AXPY_TOKENS][16], vm[PYRT_AXPY_TOKENS][8]; /* as axpyn_k's, per token */
    for (int r = 0; r < nr; r++)
        for (int s = 0; s < n / PYRT_QK_K; s++) {
            const uint8_t *w = (const uint8_t *)rows[r] + (size_t)s * bb;
            __m512 dsc16 = _mm512_setzero_ps();
            __m256 dsc = _mm256_setzero_ps(), dm = _mm256_setzero_ps();
            if (fmt == PYRT_FMT_Q6_K)
                dsc16 = scales_q6_k(w);
            else
                pyrt_kq_scales_mins(w, &dsc, &dm);
            for (int t = 0; t < nt; t++) {
                const __m512 va = _mm512_set1_ps(a[r][t]);
                if (fmt == PYRT_FMT_Q6_K) {
                    _mm512_storeu_ps(vs[t], _mm512_mul_ps(va, dsc16));
                } else {
                    _mm256_storeu_ps(vs[t], _mm256_mul_ps(_mm512_castps512_ps256(va), dsc));
                    _mm256_storeu_ps(vm[t], _mm256_mul_ps(_mm512_castps512_ps256(va), dm));
                }
            }
            _Pragma("GCC unroll 4") for (int k = 0; k < 4; k++) {
                __m512i q[4];
                wide_codes(fmt, w, k, q);
                __m512 qf[4];
                for (int i = 0; i < 4; i++)
                    qf[i] = _mm512_cvtepi32_ps(q[i]);
                for (int t = 0; t < nt; t++) {
                    float *yk = ys[t] + (size_t)s * PYRT_QK_K + 64 * k;
                    for (int i = 0; i < 4; i++) { /* y[16 i ..]: sub-block 2k + i / 2 */
                        const int j = 2 * k + i / 2;
                        __m512 acc = _mm512_loadu_ps(yk + 16 * i);
                        if (fmt == PYRT_FMT_Q4_K) {
                            acc = _mm512_add_ps(acc, _mm512_fmadd_ps(_mm512_set1_ps(vs[t][j]), qf[i],
                                                                     _mm512_set1_ps(-vm[t][j])));
                        } else {
                            const float si = fmt == PYRT_FMT_Q6_K ? vs[t][4 * k + i] : vs[t][j];
                            acc = _mm512_fmadd_ps(_mm512_set1_ps(si), qf[i], acc);
                            if (fmt != PYRT_FMT_Q6_K)
                                acc = _mm512_sub_ps(acc, _mm512_set1_ps(vm[t][j]));
                        }
                        _mm512_storeu_ps(yk + 16 * i, acc);
                    }
                }
            }
        }
}

#define KQ_AXPY_ENTRIES(name, FMT)                                                                \
    AVX512 static void axpyn_##name(int nr, const float *a, const void *const *rows, float *y,    \
                                    int n) {                                                      \
        axpyn_k(FMT, nr, a, rows, y, n);                                                          \
    }                                                                                             \
    AVX512 static void axpy_##name(float a, const void *row, float *y, int n) {                   \
        axpyn_k(FMT, 1, &a, &row, y, n);                                                          \
    }                                                                                             \
    AVX512 static void axpy_tile_##name(int nr, const void *const *rows, const float *const *a,   \
                                        int nt, float *const *ys, int n) {                        \
        axpy_tile_k(FMT, nr, rows, a, nt, ys, n);                                                 \
    }

KQ_AXPY_ENTRIES(q4_k, PYRT_FMT_Q4_K)
KQ_AXPY_ENTRIES(q5_k, PYRT_FMT_Q5_K)
KQ_AXPY_ENTRIES(q6_k, PYRT_FMT_Q6_K)

#define KQ_OPS(name, SUF, I8)                                                                     \
    static const pyrt_row_ops ops_##name##_##SUF = {.dot = dot_##name##_##SUF,                     \
                                                    .axpy = axpy_##name,                          \
                                                    .dot2 = dot2_##name##_##SUF,                  \
                                                    .axpyn = axpyn_##name,                        \
                                                    .dot_pf = dot_pf_##name##_##SUF,              \
                                                    .dot2_pf = dot2_pf_##name##_##SUF,            \
                                                    .dot_tile = dot_tile_##name##_##SUF,          \
                                                    .axpy_tile = axpy_tile_##name,                \
                                                    .axpyn_i8 = I8};
KQ_OPS(q4_k, bw, NULL)
KQ_OPS(q5_k, bw, NULL)
KQ_OPS(q6_k, bw, NULL)
KQ_OPS(q4_k, vnni, pyrt_axpyn_i8_q4_k)
KQ_OPS(q5_k, vnni, pyrt_axpyn_i8_q5_k)
KQ_OPS(q6_k, vnni, pyrt_axpyn_i8_q6_k)

const pyrt_row_ops *pyrt_row_ops_kquant_avx512(int fmt, int vnni) {
    if (vnni)
        return fmt == PYRT_FMT_Q4_K   ? &ops_q4_k_vnni
               : fmt == PYRT_FMT_Q5_K ? &ops_q5_k_vnni
                                      : &ops_q6_k_vnni;
    return fmt == PYRT_FMT_Q4_K   ? &ops_q4_k_bw
           : fmt == PYRT_FMT_Q5_K ? &ops_q5_k_bw
                                  : &ops_q6_k_bw;
}

#else /* not x86-64: the scalar kernels stand in (cpu.c never selects an x86 level) */

const pyrt_row_ops *pyrt_row_ops_kquant_avx512(int fmt, int vnni) {
    (void)vnni;
    return pyrt_row_ops_kquant_scalar(fmt);
}

#endif

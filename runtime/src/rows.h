/* Row kernels: one weight row against one token, per format and SIMD level (rows_scalar.c,
 * rows_avx2.c, rows_avx512.c), the activation quantizer and the f32 add they share, and the
 * run-time choice among the levels (cpu.c). */
#ifndef PYRT_ROWS_H
#define PYRT_ROWS_H

#include <stddef.h>
#include <stdint.h>

#include "formats.h"

/* ---- activation quantization --------------------------------------------------------------- */

/* One quantized activation block: x[i] ~= d * q[i], q in [-127, 127]. The scale is kept in f32
 * (llama.cpp rounds it to f16; f32 is as fast here and a little more accurate). */
typedef struct {
    float d;
    int8_t q[PYRT_QK];
} pyrt_xq8;

/* x [n] f32 -> n/32 blocks; n must be a multiple of 32. Round-half-to-even (as torch.round).
 * pyrt_quantize_x_q8 runs the active SIMD level's version (cpu.c); for finite x every level gives
 * the scalar one's bytes (tests/c). The SIMD ones also mirror the scalar code as compiled on x86
 * where x holds NaN/inf: amax ignores NaN lanes (as fmaxf), q is the low byte of the truncated
 * int32 (cvttss2si + (int8_t)). */
void pyrt_quantize_x_q8(const float *x, pyrt_xq8 *out, int n);
void pyrt_quantize_x_q8_scalar(const float *x, pyrt_xq8 *out, int n);
void pyrt_quantize_x_q8_avx2(const float *x, pyrt_xq8 *out, int n);
void pyrt_quantize_x_q8_avx512(const float *x, pyrt_xq8 *out, int n);

/* x [n] f32 -> n/32 blocks whose scales are shared per 256 elements (the K-quants' activation,
 * ggml's Q8_K in Q8_0's layout): each whole group of 8 blocks is quantized at d = (max |x| over
 * its 256) / 127, every block of it holding that d; blocks after the last whole group as
 * pyrt_quantize_x_q8. Every reader of Q8 blocks takes them (a Q8_0 row reads d per block); the
 * K-quant dots need them, summing a super-block's 8 sub-blocks in integers. After the blocks go
 * the sums of q per 16 elements (pyrt_xq_sums; out holds pyrt_xq_units(n)). The levels give the
 * scalar one's bytes for finite x, as pyrt_quantize_x_q8's. */
void pyrt_quantize_x_q8k(const float *x, pyrt_xq8 *out, int n);
void pyrt_quantize_x_q8k_scalar(const float *x, pyrt_xq8 *out, int n);
void pyrt_quantize_x_q8k_avx2(const float *x, pyrt_xq8 *out, int n);
void pyrt_quantize_x_q8k_avx512(const float *x, pyrt_xq8 *out, int n);

/* The sums of q per 16 elements that pyrt_quantize_x_q8k stores after a token's n/32 blocks
 * (ggml's bsums): int16 [n / 16], element i the sum of q over elements 16 i .. 16 i + 15
 * (|.| <= 2032). A K-quant row's min term (Q4_K, Q5_K: m_j sum(x_j)) and offset term (Q6_K:
 * -32 sc_i sum(x_i)) are then a 16-element integer dot of the row's scales with them per
 * super-block, not a pass over x per row. */
static inline const int16_t *pyrt_xq_sums(const void *xq, int n) {
    return (const int16_t *)((const pyrt_xq8 *)xq + n / PYRT_QK);
}

/* pyrt_xq8 units that one token of n elements takes quantized (n rounded up to 32): its blocks,
 * then room for its sums (pyrt_xq_sums). The size of, and the stride between tokens in, every
 * buffer pyrt_quantize_x_for writes. */
static inline size_t pyrt_xq_units(size_t n) {
    const size_t nb = (n + PYRT_QK - 1) / PYRT_QK;
    return nb + (nb * 2 * sizeof(int16_t) + sizeof(pyrt_xq8) - 1) / sizeof(pyrt_xq8);
}

/* How the matrices that read one activation vector want it quantized (pyrt_fmt_xq): not at all
 * (float formats), Q8 blocks of 32, or blocks sharing a scale per 256 (a K-quant reads it; the
 * others read those too, so a mix takes the largest kind). */
enum { PYRT_XQ_NONE = 0, PYRT_XQ_BLOCKS = 1, PYRT_XQ_SHARED = 2 };

static inline int pyrt_fmt_xq(int fmt) {
    return pyrt_fmt_block(fmt) == PYRT_QK_K ? PYRT_XQ_SHARED
           : pyrt_fmt_is_blocked(fmt)       ? PYRT_XQ_BLOCKS
                                            : PYRT_XQ_NONE;
}

/* The kind that serves readers of kinds a and b. */
static inline int pyrt_xq_join(int a, int b) {
    return a > b ? a : b;
}

/* x quantized as `kind` asks (PYRT_XQ_NONE: nothing written) into out [pyrt_xq_units(n)]. */
void pyrt_quantize_x_for(int kind, const float *x, pyrt_xq8 *out, int n);

/* y[0:n] += x[0:n] in f32, element by element (every level gives the same bits): the expert
 * kernel's sum of partial ys. pyrt_add_f32_active: the active SIMD level's (cpu.c). */
typedef void (*pyrt_add_fn)(float *y, const float *x, size_t n);
void pyrt_add_f32_scalar(float *y, const float *x, size_t n);
void pyrt_add_f32_avx2(float *y, const float *x, size_t n);
void pyrt_add_f32_avx512(float *y, const float *x, size_t n);
pyrt_add_fn pyrt_add_f32_active(void);

/* ---- row kernels --------------------------------------------------------------------------- */

/* One weight row of n elements, in one format, against one token.
 * dot:  returns row . x, where x is f32 [n] for float formats and pyrt_xq8 [n/32] for the blocked
 *       ones (for Q4_K / Q5_K / Q6_K from pyrt_quantize_x_q8k: a scale per 256, and the sums
 *       per 16 after the blocks, pyrt_xq_sums(x, n)).
 * axpy: y[0:n] += a * row (the row dequantized on the fly); y is f32 [n]. */
typedef float (*pyrt_dot_fn)(const void *row, const void *x, int n);
typedef void (*pyrt_axpy_fn)(float a, const void *row, float *y, int n);
/* dot2: out[r] = rows r . x for two rows in one pass over x (a neuron's gate and up rows);
 *       bit for bit what two dot calls return.
 * axpyn: y[0:n] += a[r] * rows[r] for r = 0 .. nr-1 (1 <= nr <= PYRT_AXPY_ROWS) in one pass over
 *       y, y held in registers across the rows; bit for bit what nr axpy calls in order give. */
typedef void (*pyrt_dot2_fn)(const void *row0, const void *row1, const void *x, int n,
                             float out[2]);
typedef void (*pyrt_axpyn_fn)(int nr, const float *a, const void *const *rows, float *y, int n);

#define PYRT_AXPY_ROWS 8

/* dot_pf / dot2_pf: dot / dot2, bit for bit, that also issue software prefetches (prefetcht0) of
 *       the n_pf cache-line addresses pf[0 .. n_pf-1], spread evenly over the kernel's loop. A
 *       burst of ~100 prefetches stalls the core once its line-fill buffers are full, so the
 *       weight stream and the arithmetic run one after the other; spread out, they overlap. */
typedef float (*pyrt_dot_pf_fn)(const void *row, const void *x, int n, const void *const *pf,
                                int n_pf);
typedef void (*pyrt_dot2_pf_fn)(const void *row0, const void *row1, const void *x, int n,
                                float out[2], const void *const *pf, int n_pf);

typedef void (*pyrt_axpyn_pf_fn)(int nr, const float *a, const void *const *rows, float *y, int n,
                                 const void *const *pf, int n_pf);

/* ---- tiles: several rows against several tokens (prefill) -----------------------------------
 * A tile keeps a block of results in registers while the rows and tokens stream through it, so
 * each weight block loaded serves several tokens and each activation block several rows (a
 * dot per row and token reloads both). Every result is bit for bit what the row kernels give. */
enum {
    PYRT_TILE_ROWS = 4,  /* rows of a dot tile */
    PYRT_TILE_TOKENS = 4, /* tokens of a dot tile, at most */
    PYRT_AXPY_TOKENS = 8  /* tokens of an axpy tile, at most */
};

/* dot_tile: out[t * ts + r * rs] = rows[r] . xs[t] for r < PYRT_TILE_ROWS, t < nt
 *       (1 <= nt <= PYRT_TILE_TOKENS), each bit for bit what dot gives; x as for dot. */
typedef void (*pyrt_dot_tile_fn)(const void *const *rows, int nt, const void *const *xs, int n,
                                 float *out, size_t ts, size_t rs);
/* axpy_tile: ys[t][0:n) += sum_r a[r][t] * rows[r][0:n) for t < nt (1 <= nt <=
 *       PYRT_AXPY_TOKENS), r < nr in order: per token bit for bit nr axpy calls. */
typedef void (*pyrt_axpy_tile_fn)(int nr, const void *const *rows, const float *const *a, int nt,
                                  float *const *ys, int n);

typedef struct {
    pyrt_dot_fn dot;
    pyrt_axpy_fn axpy;
    pyrt_dot2_fn dot2;   /* NULL: the caller makes two dot calls */
    pyrt_axpyn_fn axpyn; /* NULL: the caller makes nr axpy calls */
    pyrt_dot_pf_fn dot_pf;   /* NULL: the caller prefetches, then calls dot */
    pyrt_dot2_pf_fn dot2_pf; /* NULL: the caller prefetches, then calls dot2 (or two dots) */
    pyrt_axpyn_pf_fn axpyn_pf; /* axpyn with spread prefetches; NULL: as for dot_pf */
    pyrt_dot_tile_fn dot_tile;   /* NULL: pyrt_dot_tile makes dot calls */
    pyrt_axpy_tile_fn axpy_tile; /* NULL: pyrt_axpy_tile makes axpy calls */
    /* axpyn_pf with each row's multiplier folded into int8 per sub-block (within a stated bound
     * of axpyn, not its bits: pyrt_axpyn_i8_q4_k); NULL: axpyn. The decode's expert down rows. */
    pyrt_axpyn_pf_fn axpyn_i8;
} pyrt_row_ops;

/* Any rows against any tokens with a level's kernels (tile.c): out[t * ts + r * rs] = rows[r] .
 * xs[t] for r < nr, t < nt, in PYRT_TILE_ROWS x PYRT_TILE_TOKENS tiles where the level has them,
 * else dot2 / dot calls; the same bits either way. */
void pyrt_dot_tile(const pyrt_row_ops *ops, int nr, const void *const *rows, int nt,
                   const void *const *xs, int n, float *out, size_t ts, size_t rs);
/* ys[t][0:n) += sum_r a[r][t] * rows[r][0:n) for t < nt, r < nr in order, in tiles of
 * PYRT_AXPY_TOKENS tokens where the level has them, else axpy calls; the same bits either way. */
void pyrt_axpy_tile(const pyrt_row_ops *ops, int nr, const void *const *rows,
                    const float *const *a, int nt, float *const *ys, int n);

/* Where the software prefetches of weight rows go: L2 (prefetcht1) when nonzero, else L1
 * (prefetcht0). Set per thread from the pool's params.prefetch_l2 by the pool's workers and by
 * pyrt_pool_run on its caller (pool_threads.c), so the kernels' signatures need not carry it. */
extern _Thread_local int pyrt_pf_into_l2;

static inline void pyrt_pf_line(const void *p) {
    if (pyrt_pf_into_l2)
        __builtin_prefetch(p, 0, 2);
    else
        __builtin_prefetch(p, 0, 3);
}

/* Spreads n prefetches over a loop of n_it iterations: pyrt_pf_tick after each iteration issues
 * the lines due so far (16.16 fixed point, no division in the loop; n < 65536), pyrt_pf_end the
 * rest. */
typedef struct {
    const void *const *lines;
    int n, i;
    uint32_t acc, step;
} pyrt_pf_spread;

static inline pyrt_pf_spread pyrt_pf_begin(const void *const *lines, int n, int n_it) {
    pyrt_pf_spread s = {lines, n, 0, 0, 0};
    if (n > 0 && n_it > 0)
        s.step = (uint32_t)(((uint64_t)n << 16) / (uint64_t)n_it);
    return s;
}

static inline void pyrt_pf_tick(pyrt_pf_spread *s) {
    s->acc += s->step;
    const int due = (int)(s->acc >> 16);
    for (; s->i < due; s->i++)
        pyrt_pf_line(s->lines[s->i]);
}

static inline void pyrt_pf_end(pyrt_pf_spread *s) {
    for (; s->i < s->n; s->i++)
        pyrt_pf_line(s->lines[s->i]);
}

/* MXFP4's kernels (rows_mxfp4.c), which each level's table returns for PYRT_FMT_MXFP4: scalar,
 * AVX2, and AVX-512 (vnni != 0: its dots on AVX512_VNNI, the same bits; call only where the CPU
 * has it). */
const pyrt_row_ops *pyrt_row_ops_mxfp4_scalar(void);
const pyrt_row_ops *pyrt_row_ops_mxfp4_avx2(void);
const pyrt_row_ops *pyrt_row_ops_mxfp4_avx512(int vnni);

/* Q5_0 / Q5_1 (rows_q5.c; scalar, and AVX2, also the AVX-512 level's) and the K-quants Q4_K /
 * Q5_K / Q6_K (rows_kquant.c: scalar, AVX2), fmt one of theirs. */
const pyrt_row_ops *pyrt_row_ops_q5_scalar(int fmt);
const pyrt_row_ops *pyrt_row_ops_q5_avx2(int fmt);
const pyrt_row_ops *pyrt_row_ops_kquant_scalar(int fmt);
const pyrt_row_ops *pyrt_row_ops_kquant_avx2(int fmt);
/* The K-quants' AVX-512 kernels (rows_kquant_avx512.c); vnni != 0: their int8 dots on
 * AVX512_VNNI (the same bits; call only where the CPU has it). */
const pyrt_row_ops *pyrt_row_ops_kquant_avx512(int fmt, int vnni);
/* Q4_K, Q5_K and Q6_K down rows on AVX512_VNNI with int8 multipliers (rows_kquant_i8.c; x86-64
 * only): y[0:n) += a[r] rows[r] for r < nr <= PYRT_AXPY_ROWS, each sub-block j's a[r] d_r sc_rj
 * rounded to a multiple of S_j / 254, S_j = max_r |a[r] d_r sc_rj| / 127 (two int8 parts);
 * |error| <= (S_j / 500) sum_r q_ri per element (q: the stored code, e.g. Q6_K's 0..63) beside f32
 * rounding. pf, n_pf: as axpyn_pf's (NULL, 0: none). */
void pyrt_axpyn_i8_q4_k(int nr, const float *a, const void *const *rows, float *y, int n,
                        const void *const *pf, int n_pf);
void pyrt_axpyn_i8_q5_k(int nr, const float *a, const void *const *rows, float *y, int n,
                        const void *const *pf, int n_pf);
void pyrt_axpyn_i8_q6_k(int nr, const float *a, const void *const *rows, float *y, int n,
                        const void *const *pf, int n_pf);

/* Row kernels of one SIMD level for fmt; NULL when the level has none for fmt (unknown format). */
const pyrt_row_ops *pyrt_row_ops_scalar(int fmt);
const pyrt_row_ops *pyrt_row_ops_avx2(int fmt);
const pyrt_row_ops *pyrt_row_ops_avx512(int fmt);
/* The AVX-512 level's kernels with the Q8_0, MXFP4 and K-quant dots on AVX512_VNNI (the same
 * bits as pyrt_row_ops_avx512); call only where the CPU has it (pyrt_cpu_has_vnni). */
const pyrt_row_ops *pyrt_row_ops_avx512_vnni(int fmt);

/* ---- the choice among levels (cpu.c) ------------------------------------------------------- */

/* 1 when the CPU has AVX512_VNNI. */
int pyrt_cpu_has_vnni(void);
/* Level `level`'s kernels; NULL for an unknown level or format. vnni != 0: the AVX-512 level's
 * Q8_0, MXFP4 and K-quant dots are pyrt_row_ops_avx512_vnni's where the CPU has AVX512_VNNI. */
const pyrt_row_ops *pyrt_row_ops_at(int level, int fmt, int vnni);

#endif /* PYRT_ROWS_H */

/* Internal declarations shared by the C core's translation units (not part of the public API). */
#ifndef PYRT_INTERNAL_H
#define PYRT_INTERNAL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pyrt.h"

#define PYRT_QK 32 /* elements per Q8_0 / Q4_0 block */
#define PYRT_Q8_0_BYTES 34 /* f16 d; int8 q[32] */
#define PYRT_Q4_0_BYTES 18 /* f16 d; uint8 qs[16] (low nibbles: elements 0..15, high: 16..31) */

/* ---- errors (error.c) ---------------------------------------------------------------------- */

/* Formats the thread's last_error message; returns `status` so callers can `return pyrt_fail(..)`. */
int pyrt_fail(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void pyrt_clear_error(void);

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

/* y[0:n] += x[0:n] in f32, element by element (every level gives the same bits): the expert
 * kernel's sum of partial ys. pyrt_add_f32_active: the active SIMD level's (cpu.c). */
typedef void (*pyrt_add_fn)(float *y, const float *x, size_t n);
void pyrt_add_f32_scalar(float *y, const float *x, size_t n);
void pyrt_add_f32_avx2(float *y, const float *x, size_t n);
void pyrt_add_f32_avx512(float *y, const float *x, size_t n);
pyrt_add_fn pyrt_add_f32_active(void);

/* ---- row kernels (rows_*.c) ---------------------------------------------------------------- */

/* One weight row of n elements, in one format, against one token.
 * dot:  returns row . x, where x is f32 [n] for float formats and pyrt_xq8 [n/32] for Q8_0/Q4_0.
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

typedef struct {
    pyrt_dot_fn dot;
    pyrt_axpy_fn axpy;
    pyrt_dot2_fn dot2;   /* NULL: the caller makes two dot calls */
    pyrt_axpyn_fn axpyn; /* NULL: the caller makes nr axpy calls */
    pyrt_dot_pf_fn dot_pf;   /* NULL: the caller prefetches, then calls dot */
    pyrt_dot2_pf_fn dot2_pf; /* NULL: the caller prefetches, then calls dot2 (or two dots) */
    pyrt_axpyn_pf_fn axpyn_pf; /* axpyn with spread prefetches; NULL: as for dot_pf */
} pyrt_row_ops;

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
        __builtin_prefetch(s->lines[s->i], 0, 3);
}

static inline void pyrt_pf_end(pyrt_pf_spread *s) {
    for (; s->i < s->n; s->i++)
        __builtin_prefetch(s->lines[s->i], 0, 3);
}

/* Row kernels of one SIMD level for fmt; NULL when the level has none for fmt (unknown format). */
const pyrt_row_ops *pyrt_row_ops_scalar(int fmt);
const pyrt_row_ops *pyrt_row_ops_avx2(int fmt);
const pyrt_row_ops *pyrt_row_ops_avx512(int fmt);
/* The AVX-512 level's kernels with the Q8_0 dots on AVX512_VNNI (the same bits as
 * pyrt_row_ops_avx512); call only where the CPU has it (pyrt_cpu_has_vnni). */
const pyrt_row_ops *pyrt_row_ops_avx512_vnni(int fmt);
/* 1 when the CPU has AVX512_VNNI (cpu.c). */
int pyrt_cpu_has_vnni(void);
/* Level `level`'s kernels (cpu.c); NULL for an unknown level or format. vnni != 0: the AVX-512
 * level's Q8_0 dots are pyrt_row_ops_avx512_vnni's where the CPU has AVX512_VNNI. */
const pyrt_row_ops *pyrt_row_ops_at(int level, int fmt, int vnni);

/* ---- scalar conversions -------------------------------------------------------------------- */

static inline float pyrt_fp32_from_bits(uint32_t w) {
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline uint32_t pyrt_fp32_to_bits(float f) {
    uint32_t w;
    memcpy(&w, &f, sizeof w);
    return w;
}

/* IEEE half -> float, exact, branch-light (the method of Maratyszcza's FP16 library). */
static inline float pyrt_fp16_to_fp32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & UINT32_C(0x80000000);
    const uint32_t two_w = w + w;
    const uint32_t exp_offset = UINT32_C(0xE0) << 23;
    const float exp_scale = 0x1.0p-112f;
    const float normalized = pyrt_fp32_from_bits((two_w >> 4) + exp_offset) * exp_scale;
    const uint32_t magic_mask = UINT32_C(126) << 23;
    const float magic_bias = 0.5f;
    const float denormalized = pyrt_fp32_from_bits((two_w >> 17) | magic_mask) - magic_bias;
    const uint32_t denormalized_cutoff = UINT32_C(1) << 27;
    const uint32_t result =
        sign | (two_w < denormalized_cutoff ? pyrt_fp32_to_bits(denormalized)
                                             : pyrt_fp32_to_bits(normalized));
    return pyrt_fp32_from_bits(result);
}

static inline float pyrt_bf16_to_fp32(uint16_t h) {
    return pyrt_fp32_from_bits((uint32_t)h << 16);
}

/* Little-endian u16 at any alignment (block scales sit at odd offsets inside a row). */
static inline uint16_t pyrt_load_u16(const void *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* act(g) for a PYRT_ACT_* kind (expert FFNs in moe_ffn.c, shared/dense FFNs in decode.c). */
static inline float pyrt_activate(int kind, float g) {
    switch (kind) {
    case PYRT_ACT_GELU_TANH:
        return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    case PYRT_ACT_GELU_ERF:
        return 0.5f * g * (1.0f + erff(g * 0.7071067811865476f));
    default: /* SiLU: for g -> -inf, expf overflows to inf and g / inf = -0, as wanted */
        return g / (1.0f + expf(-g));
    }
}



/* ---- thread pool (pool.c) ------------------------------------------------------------------ */

/* A task runs once on every thread of the pool: ith in [0, nth), ith 0 being the caller. */
typedef void (*pyrt_task_fn)(void *ctx, int ith, int nth);

/* Run fn on all threads and return when all are done. The caller holds the pool (pool_acquire). */
void pyrt_pool_run(pyrt_pool *pool, pyrt_task_fn fn, void *ctx);
/* Serialize users of one pool: a kernel call holds the pool from its start to its end. */
void pyrt_pool_acquire(pyrt_pool *pool);
void pyrt_pool_release(pyrt_pool *pool);
/* One step of a spin wait inside a task (spins: steps so far): a pause instruction, and from
 * time to time a sched_yield, so that a waiter does not starve the preempted thread it waits
 * for on an oversubscribed machine. */
void pyrt_spin_pause(int spins);
/* ---- prefetch while idle (pool.c) ----------------------------------------------------------
 * Between pool tasks the DRAM idles: the caller runs serial pieces (norms, RoPE, top-k), threads
 * wait for the slowest one, and each task's first rows arrive a memory latency late. A plan names
 * the rows the NEXT task will read (the rows of up to PYRT_PF_REGIONS matrices, as one list), cut
 * into homes: thread ith < n_homes = min(nth, PYRT_MAX_HOMES) owns rows
 * [pyrt_home_start(rows, ith, n_homes), pyrt_home_start(rows, ith + 1, n_homes)). While a thread
 * waits (for the next task, or for the others at the end of one), it prefetches its home of the
 * plan into its L2 (prefetcht1), a few lines at a time, until the next task starts; the matvec
 * (linear.c) then takes its home's rows first, from L2. A plan is only a hint: prefetches never
 * fault, and a stale or wrong plan costs bandwidth, never correctness. */
enum { PYRT_PF_REGIONS = 4, PYRT_MAX_HOMES = 64 };

typedef struct {
    const uint8_t *data; /* row 0 */
    size_t row_bytes;
    int64_t n_rows;
} pyrt_pf_region;

typedef struct {
    pyrt_pf_region r[PYRT_PF_REGIONS];
    int n;
} pyrt_pf_plan;

/* First row of home h of n_homes over `rows` rows: even (so row pairs stay in one home), rising,
 * `rows` for h = n_homes. */
static inline int64_t pyrt_home_start(int64_t rows, int h, int n_homes) {
    return h >= n_homes ? rows : (rows * h / n_homes) & ~(int64_t)1;
}

/* The plan for the idle time of the next pyrt_pool_run only (its threads' waits inside and after
 * the task); copied. NULL or an empty plan: nothing. Ignored when the pool's params have
 * idle_prefetch 0. Call while holding the pool, or just before the kernel call that will. */
void pyrt_pool_plan_prefetch(pyrt_pool *pool, const pyrt_pf_plan *plan);
/* Inside a task (thread ith): one step (a few lines) of this task's plan for ith; returns 0 once
 * ith's home is done (or there is no plan), so a spin-wait can prefetch instead of pausing. */
int pyrt_pool_idle_prefetch(pyrt_pool *pool, int ith);
/* From inside a pool task, by one thread, at most once per run: the rest of the run's idle time
 * (and the idle time after it) prefetches `plan` instead of the run's own plan. */
void pyrt_pool_plan_switch(pyrt_pool *pool, const pyrt_pf_plan *plan);

/* The pool's params (as given at creation). */
const pyrt_params *pyrt_pool_params(const pyrt_pool *pool);
/* The active SIMD level's row kernels for fmt, with the pool's vnni setting. */
const pyrt_row_ops *pyrt_pool_row_ops(const pyrt_pool *pool, int fmt);

/* Scratch memory owned by the pool (64-byte aligned, grown on demand, kept between calls); NULL
 * when out of memory. Valid while the caller holds the pool and until the next workspace call. */
void *pyrt_pool_workspace(pyrt_pool *pool, size_t bytes);
#endif /* PYRT_INTERNAL_H */

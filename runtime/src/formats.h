/* Weight formats (formats.c): the quantized block layouts, what a weights pointer must be
 * aligned to, and the scalar conversions the row kernels share (f16, bf16, unaligned loads). */
#ifndef PYRT_FORMATS_H
#define PYRT_FORMATS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "pyrt.h"

#define PYRT_QK 32 /* elements per Q8_0 / Q4_0 block */
#define PYRT_Q8_0_BYTES 34 /* f16 d; int8 q[32] */
#define PYRT_Q4_0_BYTES 18 /* f16 d; uint8 qs[16] (low nibbles: elements 0..15, high: 16..31) */
#define PYRT_MXFP4_BYTES 17 /* uint8 e (E8M0); uint8 qs[16] (e2m1 codes, nibbles as Q4_0's) */
#define PYRT_Q5_0_BYTES 22 /* f16 d; uint8 qh[4] (fifth bits); uint8 qs[16] (nibbles as Q4_0's) */
#define PYRT_Q5_1_BYTES 24 /* f16 d; f16 m; uint8 qh[4]; uint8 qs[16] */
#define PYRT_QK_K 256      /* elements per K-quant super-block */
#define PYRT_Q4_K_BYTES 144 /* f16 d; f16 dmin; uint8 scales[12]; uint8 qs[128] */
#define PYRT_Q5_K_BYTES 176 /* f16 d; f16 dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128] */
#define PYRT_Q6_K_BYTES 210 /* uint8 ql[128]; uint8 qh[64]; int8 scales[16]; f16 d */

/* Elements per block of a blocked format (32, or 256 for the K-quants); 1 for the others. */
static inline int pyrt_fmt_block(int fmt) {
    switch (fmt) {
    case PYRT_FMT_Q8_0:
    case PYRT_FMT_Q4_0:
    case PYRT_FMT_MXFP4:
    case PYRT_FMT_Q5_0:
    case PYRT_FMT_Q5_1:
        return PYRT_QK;
    case PYRT_FMT_Q4_K:
    case PYRT_FMT_Q5_K:
    case PYRT_FMT_Q6_K:
        return PYRT_QK_K;
    default:
        return 1;
    }
}

/* The quantized formats: the activations are quantized to Q8 blocks and the dots are integer. */
static inline int pyrt_fmt_is_blocked(int fmt) {
    return pyrt_fmt_block(fmt) > 1;
}

/* The formats the row kernels read, for error messages. */
#define PYRT_FMT_NAMES                                                                            \
    "0 F32, 1 F16, 30 BF16, 8 Q8_0, 2 Q4_0, 39 MXFP4, 6 Q5_0, 7 Q5_1, 12 Q4_K, 13 Q5_K, 14 Q6_K"

/* 1 for the formats the row kernels read (F32, F16, BF16 and the blocked ones). */
static inline int pyrt_fmt_known(int fmt) {
    return fmt == PYRT_FMT_F32 || fmt == PYRT_FMT_F16 || fmt == PYRT_FMT_BF16 ||
           pyrt_fmt_is_blocked(fmt);
}

/* Bytes a weights pointer in fmt must be aligned to: its element (F32 4, F16/BF16 2; blocks 1). */
static inline size_t pyrt_fmt_align(int fmt) {
    return fmt == PYRT_FMT_F32 ? 4 : pyrt_fmt_is_blocked(fmt) ? 1 : 2;
}

/* PYRT_OK if weights `data` in `fmt` are aligned to pyrt_fmt_align(fmt); else PYRT_E_INVALID
 * with "<fn>: weights pointer is not N-byte aligned". */
int pyrt_check_weights_aligned(const char *fn, const void *data, int fmt);

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

/* An MXFP4 block's scale for the doubled e2m1 values (rows_mxfp4.c): 2^(e - 128) as f32, exactly
 * (ggml's ggml_e8m0_to_fp32_half; e < 2 gives the subnormals 2^-128, 2^-127). */
static inline float pyrt_e8m0_half(uint8_t e) {
    return pyrt_fp32_from_bits(e < 2 ? UINT32_C(0x00200000) << e : (uint32_t)(e - 1) << 23);
}

/* The e2m1 values doubled, by 4-bit code (rows_mxfp4.c). */
extern const int8_t pyrt_mxfp4_values[16];

/* Little-endian u16 at any alignment (block scales sit at odd offsets inside a row). */
static inline uint16_t pyrt_load_u16(const void *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#endif /* PYRT_FORMATS_H */

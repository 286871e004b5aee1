/* The tile kernel of attn_tile.h at each SIMD level: one body (attn_tile_body.h) compiled for
 * AVX-512, AVX2 + FMA and the baseline, picked by pyrt_simd_active(). This file is built with
 * -ffp-contract=fast (CMakeLists.txt) so that a * b + c in the body is one FMA. */
#include <math.h>
#include <string.h>

#include "attn_tile.h"
#include "pyrt.h"

size_t pyrt_attn_scratch_floats(int hd) {
    return (size_t)PYRT_ATTN_ROWS * PYRT_ATTN_KB + (size_t)PYRT_ATTN_ROWS * (size_t)hd;
}

size_t pyrt_attn_stream_floats(int n_pos) {
    return ((size_t)n_pos / PYRT_ATTN_KB + 2) * PYRT_ATTN_KB;
}

#define ATT_W 4
#define ATT_TARGET
#define ATT(name) name##_base
#include "attn_tile_body.h"
#undef ATT_W
#undef ATT_TARGET
#undef ATT

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PYRT_ATT_X86 1

#define ATT_W 8
#define ATT_TARGET __attribute__((target("avx2,fma")))
#define ATT(name) name##_avx2
#include "attn_tile_body.h"
#undef ATT_W
#undef ATT_TARGET
#undef ATT

#define ATT_W 16
#define ATT_TARGET __attribute__((target("avx512f,avx512dq,avx2,fma")))
#define ATT(name) name##_avx512
#include "attn_tile_body.h"
#undef ATT_W
#undef ATT_TARGET
#undef ATT
#endif

void pyrt_attn_tile_run(const pyrt_attn_tile *t) {
#ifdef PYRT_ATT_X86
    switch (pyrt_simd_active()) {
    case PYRT_SIMD_AVX512:
        attn_tile_avx512(t);
        return;
    case PYRT_SIMD_AVX2:
        attn_tile_avx2(t);
        return;
    default:
        break;
    }
#endif
    attn_tile_base(t);
}

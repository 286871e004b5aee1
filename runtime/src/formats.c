/* Weight formats: bytes per row, alignment of a weights pointer. */
#include "formats.h"

#include "error.h"

/* Bytes of one block of a blocked format; 0 for the others. */
static size_t block_bytes(int fmt) {
    switch (fmt) {
    case PYRT_FMT_Q8_0:
        return PYRT_Q8_0_BYTES;
    case PYRT_FMT_Q4_0:
        return PYRT_Q4_0_BYTES;
    case PYRT_FMT_MXFP4:
        return PYRT_MXFP4_BYTES;
    case PYRT_FMT_Q5_0:
        return PYRT_Q5_0_BYTES;
    case PYRT_FMT_Q5_1:
        return PYRT_Q5_1_BYTES;
    case PYRT_FMT_Q4_K:
        return PYRT_Q4_K_BYTES;
    case PYRT_FMT_Q5_K:
        return PYRT_Q5_K_BYTES;
    case PYRT_FMT_Q6_K:
        return PYRT_Q6_K_BYTES;
    default:
        return 0;
    }
}

size_t pyrt_row_bytes(int fmt, int64_t n) {
    if (n <= 0)
        return 0;
    switch (fmt) {
    case PYRT_FMT_F32:
        return (size_t)n * 4;
    case PYRT_FMT_F16:
    case PYRT_FMT_BF16:
        return (size_t)n * 2;
    default:
        break;
    }
    const int block = pyrt_fmt_block(fmt);
    const size_t bytes = block_bytes(fmt);
    return bytes == 0 || n % block ? 0 : (size_t)(n / block) * bytes;
}

int pyrt_check_weights_aligned(const char *fn, const void *data, int fmt) {
    const size_t elem = pyrt_fmt_align(fmt);
    if ((uintptr_t)data % elem != 0)
        return pyrt_fail(PYRT_E_INVALID, "%s: weights pointer is not %zu-byte aligned", fn, elem);
    return PYRT_OK;
}

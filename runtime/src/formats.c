/* Weight formats: bytes per row, alignment of a weights pointer. */
#include "formats.h"

#include "error.h"

size_t pyrt_row_bytes(int fmt, int64_t n) {
    if (n <= 0)
        return 0;
    switch (fmt) {
    case PYRT_FMT_F32:
        return (size_t)n * 4;
    case PYRT_FMT_F16:
    case PYRT_FMT_BF16:
        return (size_t)n * 2;
    case PYRT_FMT_Q8_0:
        return n % PYRT_QK ? 0 : (size_t)(n / PYRT_QK) * PYRT_Q8_0_BYTES;
    case PYRT_FMT_Q4_0:
        return n % PYRT_QK ? 0 : (size_t)(n / PYRT_QK) * PYRT_Q4_0_BYTES;
    case PYRT_FMT_MXFP4:
        return n % PYRT_QK ? 0 : (size_t)(n / PYRT_QK) * PYRT_MXFP4_BYTES;
    default:
        return 0;
    }
}

int pyrt_check_weights_aligned(const char *fn, const void *data, int fmt) {
    const size_t elem = pyrt_fmt_align(fmt);
    if ((uintptr_t)data % elem != 0)
        return pyrt_fail(PYRT_E_INVALID, "%s: weights pointer is not %zu-byte aligned", fn, elem);
    return PYRT_OK;
}

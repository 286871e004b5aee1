/* pyrt_mem_read: a stream-like DRAM read test on the same thread pool the kernels use, so the
 * benchmark can put the kernels' bytes/s next to what this machine's memory delivers. The threads
 * sum the 64-bit words of contiguous 1 MiB pieces they claim in order (the sum is returned so
 * nothing is optimized away). */
#include <stdatomic.h>
#include <string.h>

#include "error.h"
#include "pool.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

__attribute__((target("avx2"))) static uint64_t sum_avx2(const uint8_t *p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, s);
    uint64_t sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; i < n; i++)
        sum += p[i];
    return sum;
}
#endif

static uint64_t sum_scalar(const uint8_t *p, size_t n) {
    uint64_t a[4] = {0};
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int l = 0; l < 4; l++) {
            uint64_t w;
            memcpy(&w, p + i + 8 * l, 8);
            a[l] += w;
        }
    uint64_t sum = a[0] + a[1] + a[2] + a[3];
    for (; i < n; i++)
        sum += p[i];
    return sum;
}

enum { READ_PIECE = 1 << 20 }; /* bytes a thread claims at a time (a multiple of 128) */

typedef struct {
    const uint8_t *buf;
    size_t bytes;
    atomic_size_t next;      /* the next piece's offset */
    uint64_t sums[1024 * 8]; /* one per thread, a cache line apart */
} read_ctx;

static uint64_t sum_bytes(const uint8_t *p, size_t n) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (pyrt_simd_active() >= PYRT_SIMD_AVX2)
        return sum_avx2(p, n);
#endif
    return sum_scalar(p, n);
}

/* Pieces of READ_PIECE bytes claimed in order: each thread streams its pieces, and one that
 * starts late reads fewer. */
static void task_read(void *p, int ith, int nth) {
    (void)nth;
    read_ctx *c = p;
    uint64_t sum = 0;
    for (size_t lo; (lo = atomic_fetch_add_explicit(&c->next, READ_PIECE,
                                                    memory_order_relaxed)) < c->bytes;)
        sum += sum_bytes(c->buf + lo, c->bytes - lo < READ_PIECE ? c->bytes - lo : READ_PIECE);
    c->sums[ith * 8] = sum;
}

int pyrt_mem_read(pyrt_pool *pool, const void *buf, size_t bytes, uint64_t *checksum) {
    pyrt_clear_error();
    if (pool == NULL || buf == NULL)
        return pyrt_fail(PYRT_E_INVALID, "pyrt_mem_read: %s is NULL", pool ? "buf" : "pool");
    static _Thread_local read_ctx c; /* 64 KiB: off the stack */
    c.buf = buf;
    c.bytes = bytes;
    atomic_init(&c.next, 0);
    memset(c.sums, 0, sizeof c.sums);
    pyrt_pool_acquire(pool);
    pyrt_pool_run(pool, task_read, &c);
    uint64_t sum = 0;
    for (int t = 0; t < pyrt_pool_threads(pool); t++)
        sum += c.sums[t * 8];
    pyrt_pool_release(pool);
    if (checksum != NULL)
        *checksum = sum;
    return PYRT_OK;
}
